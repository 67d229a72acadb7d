"""Issue 44 items 4 and 5: a reused --out is checked before any model loads and refused naming
the flags that differ (``--overwrite`` starts again on purpose); refused runs leave no folders;
output paths whose suffix does not match what is written are refused; ``save`` into a path
under a file is one line. Each test fails on the code before the issue."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import circuitkit as ck
from circuitkit import models
from circuitkit.cli import app
from circuitkit.patching.results import PatchResult

PATCH = ["patch", "--model", "induction-2l", "--task", "induction"]


def run(args, **kw):
    return CliRunner().invoke(app, args, **kw)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: a refusal must come before it."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the refusal")
    monkeypatch.setattr(ck, "load_model", refuse)
    monkeypatch.setattr(models, "load_model", refuse)


def _one_error_line(r) -> str:
    lines = [x for x in r.output.strip().splitlines() if x.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    return lines[0]


def test_a_reused_out_is_refused_before_the_model_loads_naming_the_flags(tmp_path, monkeypatch):
    out = tmp_path / "p"
    assert run([*PATCH, "-n", "6", "--out", str(out)]).exit_code == 0
    with monkeypatch.context() as m:  # the refusal: no model loaded
        m.setattr(ck, "load_model", lambda *a, **k: pytest.fail("model loaded"))
        m.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
        line = _one_error_line(run([*PATCH, "-n", "8", "--seed", "1", "--out", str(out)]))
    assert "-n 6 there, -n 8 now" in line and "--seed 0 there, --seed 1 now" in line, line
    assert f"--out {out}" in line and "--overwrite" in line
    assert "checkpoint folder" not in line and "metric_behaviour" not in line
    # the same flags, however spelled: a resume
    again = run([*PATCH, "--n-examples", "6", "--out", str(out)])
    assert again.exit_code == 0, again.output
    # --overwrite: a fresh start with the new flags, the old results and checkpoints gone
    fresh = run([*PATCH, "-n", "8", "--seed", "1", "--out", str(out), "--overwrite"])
    assert fresh.exit_code == 0, fresh.output
    assert PatchResult.load(out).meta["n_examples"] == 8
    assert json.loads((out / ".circuitkit-run").read_text())["flags"]["seed"]["value"] == 1


def test_edges_refuses_another_seed_before_loading(tmp_path, monkeypatch):
    out = tmp_path / "e"
    edges = ["edges", "--model", "induction-2l", "--task", "induction", "-n", "4",
             "--no-circuit", "--receivers", "logits"]
    assert run([*edges, "--out", str(out)]).exit_code == 0
    monkeypatch.setattr(ck, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    line = _one_error_line(run([*edges, "--seed", "3", "--out", str(out)]))
    assert "--seed 0 there, --seed 3 now" in line and "--overwrite" in line
    # what only redoes the circuit (--circuit, --ablation) is not a different run
    monkeypatch.undo()
    assert run([*edges, "--ablation", "zero", "--out", str(out)]).exit_code == 0


def test_characterize_refuses_another_n_before_loading(tmp_path, monkeypatch):
    import circuitkit.experiments.characterize as characterize

    out = tmp_path / "c"

    def interrupted(*a, **k):  # a run stopped in its first step: its folder holds its work
        (Path(a[2]) / "checkpoints").mkdir(exist_ok=True)
        raise KeyboardInterrupt
    monkeypatch.setattr(characterize, "characterize", interrupted)
    assert run(["characterize", "-n", "16", "--out", str(out)]).exit_code == 130
    monkeypatch.setattr(characterize, "characterize",
                        lambda *a, **k: pytest.fail("ran into a folder of other flags"))
    monkeypatch.setattr(ck, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    line = _one_error_line(run(["characterize", "-n", "32", "--out", str(out)]))
    assert "-n 16 there, -n 32 now" in line and "--overwrite" in line
    # -k and the random sets only redo validation from the same sweeps: not refused
    monkeypatch.setattr(characterize, "characterize", interrupted)
    assert run(["characterize", "-n", "16", "-k", "3", "--out", str(out)]).exit_code == 130


def test_same_flags_on_changed_inputs_are_said_with_out_and_overwrite(tmp_path):
    task = ck.load_task("induction", n_examples=4, seed=0)
    data = tmp_path / "t.jsonl"
    task.to_jsonl(data)
    out = tmp_path / "o"
    cmd = ["patch", "--model", "induction-2l", "--task", str(data), "--method", "exact",
           "--out", str(out)]
    assert run(cmd).exit_code == 0
    head, *rows = data.read_text().splitlines()
    rows = rows[1:] + rows[:1]  # the same number of rows, another order: other tokens
    data.write_text("\n".join([head, *rows]) + "\n")
    line = _one_error_line(run(cmd))
    assert f"--out {out} holds a run of the same flags on other inputs" in line, line
    assert "--overwrite" in line and "checkpoint folder" not in line
    assert run([*cmd, "--overwrite"]).exit_code == 0


def test_a_bad_estimator_is_refused_before_the_model_loads(tmp_path, no_model_loads):
    for cmd, known in (("patch", "atp"), ("edges", "eap")):
        out = tmp_path / "new" / cmd
        line = _one_error_line(run([cmd, "--method", "attribution", "--estimator", "foo",
                                    "--out", str(out)]))
        assert "--estimator foo" in line and known in line
        assert not (tmp_path / "new").exists()


def test_missing_weights_are_said_before_torch_is_imported(tmp_path):
    code = ("import sys; from circuitkit import models\n"
            "models._hub_reachable = lambda timeout=3.0: False\n"
            "try:\n    models.check_available('someorg/some-model')\n"
            "except models.ModelNotAvailableError as e:\n    print('refused:', e)\n"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path),
                            "HF_HOME": str(tmp_path / "hf")}, timeout=120)
    assert "refused: The weights of 'someorg/some-model'" in r.stdout, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"
    models.check_available("induction-2l")  # shipped: passes


def test_refused_runs_leave_no_folders_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "_hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for cmd in (["patch"], ["edges"], ["characterize"]):
        out = tmp_path / "a" / "b" / cmd[0]
        r = run([*cmd, "--model", "someorg/some-model", "--out", str(out)])
        assert r.exit_code == 2 and "not on this machine" in r.output, r.output
        assert not (tmp_path / "a").exists(), cmd
    r = run(["score", "--model", "someorg/some-model", "--out", str(tmp_path / "s" / "x.csv")])
    assert r.exit_code == 2 and not (tmp_path / "s").exists()


def test_an_out_file_whose_suffix_is_not_what_is_written_is_refused(tmp_path, no_model_loads):
    line = _one_error_line(run(["score", "--out", str(tmp_path / "new" / "x.json")]))
    assert "score writes CSV" in line and "x.csv" in line and "--json" in line
    assert not (tmp_path / "new").exists()
    line = _one_error_line(run(["report", str(tmp_path), "--out", str(tmp_path / "r.pdf")]))
    assert "HTML" in line and "r.html" in line


def test_save_under_a_file_is_one_line(tmp_path):
    from circuitkit.files import WriteError

    res = ck.patch_heads(ck.load_model("induction-2l"), *_induction(), options=dict(progress=False))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(WriteError) as e:
        res.save(blocker / "r")
    assert type(e.value) is WriteError and "is a file, not a folder" in str(e.value)
    assert len(str(e.value).splitlines()) == 1


def _induction():
    task = ck.load_task("induction", n_examples=4, seed=0)
    return task.clean_tokens, task.corrupt_tokens, task.metric


def test_the_resume_line_of_an_overwrite_run_does_not_overwrite(tmp_path, monkeypatch):
    from circuitkit.patching.exact import ExactEngine

    out = tmp_path / "p"
    assert run([*PATCH, "-n", "6", "--out", str(out)]).exit_code == 0

    def interrupted(self, chunk):
        raise KeyboardInterrupt
    monkeypatch.setattr(ExactEngine, "run_chunk", interrupted)
    r = run([*PATCH, "-n", "8", "--method", "exact", "--out", str(out), "--overwrite"])
    assert r.exit_code == 130, r.output
    said = r.output.split("Resume with the same command:")[1].strip().splitlines()[0]
    assert "--n-examples 8" in said and "--overwrite" not in said


def test_a_claim_with_nothing_behind_it_is_taken_over_whatever_its_flags(tmp_path, monkeypatch):
    """A run killed before it wrote anything left only its claim (and lock): nothing to resume,
    so a run with other flags takes the folder over instead of being refused (issue 49)."""
    import circuitkit.experiments.characterize as characterize

    out = tmp_path / "c"

    def interrupted(*a, **k):  # stopped before any step wrote: only the claim is there
        raise KeyboardInterrupt
    monkeypatch.setattr(characterize, "characterize", interrupted)
    assert run(["characterize", "-n", "16", "--out", str(out)]).exit_code == 130
    assert run(["characterize", "-n", "32", "--out", str(out)]).exit_code == 130
    record = json.loads((out / ".circuitkit-run").read_text())
    assert record["flags"]["n_examples"]["value"] == 32
