"""Issue 44 item 8: the Ctrl-C line on a line of its own and no bar redrawn after it;
``--no-progress`` silences transformers' "Loading weights" bar; under torchrun the header is
said once (rank 0); ``edges`` prints a table, not an ``EdgeResult(...)`` repr; a circuitkit
warning names the caller's line (a notebook showed a line of validate.py). Each fails on the
code before the issue."""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import circuitkit
from circuitkit.cli import app


def run(args, **kw):
    return CliRunner().invoke(app, args, **kw)


def test_ctrl_c_is_said_on_its_own_line_and_the_bar_is_not_redrawn(capsys):
    from circuitkit._progress import tqdm
    from circuitkit.cli.console import _interrupted

    bar = tqdm(total=10, desc="patch z", file=sys.stderr, mininterval=0)
    bar.update(3)
    with pytest.raises(typer.Exit):
        _interrupted("finished work is in x.")
    bar.close()  # (what unwinding does later)
    err = capsys.readouterr().err
    assert "\ninterrupted; finished work is in x." in err, err
    assert err.rstrip().endswith("finished work is in x."), err  # nothing drawn after it


def test_no_progress_silences_transformers_loading_bar(tmp_path):
    folder = tmp_path / "model"  # a folder (a shipped name loads without transformers' bar)
    shutil.copytree(Path(circuitkit.__file__).parent / "assets" / "induction-2l", folder)
    cmd = ["patch", "--model", str(folder), "--task", "induction", "-n", "4"]
    shown = run([*cmd, "--out", str(tmp_path / "a")])
    assert shown.exit_code == 0 and "Loading weights" in shown.output  # (the test can fail)
    quiet = run([*cmd, "--out", str(tmp_path / "b"), "--no-progress"])
    assert quiet.exit_code == 0, quiet.output
    assert "Loading weights" not in quiet.output and "%|" not in quiet.output


def test_the_header_is_said_once_under_torchrun(tmp_path, monkeypatch):
    from circuitkit.patching import distributed

    patch_cli = sys.modules["circuitkit.cli.patch"]  # (circuitkit.cli.patch is the command)
    cmd = ["patch", "--model", "induction-2l", "--task", "induction", "-n", "4", "--out",
           str(tmp_path / "o")]
    said = run(cmd)
    assert said.exit_code == 0 and said.output.count("patching induction-2l") == 1
    monkeypatch.setattr(distributed, "rank_world", lambda: (1, 2))  # another rank
    monkeypatch.setattr(patch_cli, "_run_patch", lambda *a, **k: None)
    other = run(cmd)
    assert other.exit_code == 0, other.output
    assert "patching induction-2l" not in other.output


def test_edges_prints_a_table_not_a_repr(tmp_path):
    r = run(["edges", "--model", "induction-2l", "--task", "induction", "-n", "4",
             "--no-circuit", "--receivers", "logits", "--no-progress", "--out",
             str(tmp_path / "e")])
    assert r.exit_code == 0, r.output
    assert "EdgeResult(" not in r.output
    lines = r.output.splitlines()
    assert any(ln.startswith("edges   ") and "senders x 1 receivers" in ln for ln in lines)
    assert any(ln.startswith("method  exact, denoise") for ln in lines)
    assert any(ln.startswith("metric  ") and "clean" in ln for ln in lines)


def test_a_warning_names_the_callers_line_not_circuitkits():
    from circuitkit.experiments.validation import _distinct

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _distinct(lambda rng: [(0, 1)], 1, [(0, 0)], 5, 0, "same-layers")  # 1 of 5 possible
    (w,) = [w for w in caught if "random head sets differ" in str(w.message)]
    assert w.filename == __file__, w.filename
