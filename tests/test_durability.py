"""Nothing lost, nothing silently wrong, round three (issue 22): one lock per output folder, every
durable write atomic (a full disk is one ``error:`` line and the rerun repairs it), strict
loading of results, a step reused only when its files verify, and the batch size's (documented)
effect on sweep values. The distillation faults are in ``test_distill_durability.py``.

A full disk is simulated at the write layer (a write that stores half its bytes, then raises
``ENOSPC``), never by filling a real disk."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import signal
import time

import pytest
import torch
from typer.testing import CliRunner

import circuitkit as ck
from circuitkit import files
from circuitkit.cli import app
from circuitkit.experiments.characterize import characterize
from circuitkit.patching.results import PatchResult

PATCH = ["patch", "--model", "induction-2l", "--task", "induction", "-n", "6"]


def _cli(args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _full_disk(monkeypatch, name: str):
    """Writes of files named ``*name*`` store half their text, then fail with ENOSPC (what a
    full disk does), through ``Path.write_text``: the layer plotly and ``files.write_text``
    write through."""
    real = pathlib.Path.write_text

    def write_text(self, data, *a, **k):
        if name in self.name:
            real(self, data[: len(data) // 2], *a, **k)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data, *a, **k)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)


# --- every durable write atomic; a full disk is one line; the rerun repairs it ----------------


def test_a_full_disk_during_patch_is_one_line_and_the_rerun_repairs_the_page(tmp_path,
                                                                            monkeypatch):
    """Before: a full disk while ``result.html`` was written printed a traceback (exit 1). Now
    one ``error:`` line naming the file, nothing half-written under its name, and the rerun
    (the sweep resumed from its checkpoint) writes the whole page."""
    from plotly.offline import get_plotlyjs

    out = tmp_path / "p"
    args = [*PATCH, "--method", "exact", "--out", out]
    with monkeypatch.context() as m:
        _full_disk(m, "result.html")
        r = _cli(args)
    assert r.exit_code == 2, (r.output, r.exception)
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "result.html" in errors[0], r.output
    assert "No space left on device" in errors[0] and "free some space" in errors[0]
    assert "Traceback" not in r.output
    assert not (out / "result.html").exists()  # nothing half-written under its name
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    r = _cli(args)  # the rerun: the sweep resumes from its checkpoint, the page is whole
    assert r.exit_code == 0, r.output
    page = (out / "result.html").read_text(encoding="utf-8")
    assert page.rstrip().endswith("</html>") and 'src="plotly.min.js"' in page
    assert (out / "plotly.min.js").read_text(encoding="utf-8") == get_plotlyjs()  # whole


def test_a_full_disk_while_saving_checkpoint_chunks_is_one_line_and_resumes(tmp_path,
                                                                           monkeypatch):
    """safetensors reports a full disk as a ``SafetensorError`` (not an ``OSError``): it was a
    traceback. Now one line; the rerun keeps the chunks written before the disk filled."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out = tmp_path / "p"
    args = [*PATCH, "--method", "exact", "--batch-size", "2", "--out", out]
    calls = [0]

    def filling(tensors, filename, metadata=None):
        calls[0] += 1
        if calls[0] > 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on "
                                  "device (os error 28)")
        save_file(tensors, filename, metadata=metadata)

    with monkeypatch.context() as m:
        m.setattr("safetensors.torch.save_file", filling)
        r = _cli(args)
    assert r.exit_code == 2, (r.output, r.exception)
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "chunk_" in errors[0] and "No space left" in errors[0], r.output
    assert len(list((out / "checkpoints" / "result").glob("chunk_*.safetensors"))) == 2
    r = _cli(args)
    assert r.exit_code == 0 and "resumed 2 of" in r.output, r.output


def test_a_truncated_plotly_bundle_is_replaced(tmp_path):
    """Pages that share one ``plotly.min.js`` (edge results, circuit pages) got it from plotly's
    ``include_plotlyjs="directory"``, written in place and kept whatever it held: a write cut
    short left every later page blank. ``plotly_bundle`` writes it atomically and replaces a
    copy that is not the whole bundle; a whole one is left alone."""
    from plotly.offline import get_plotlyjs

    from circuitkit.patching.results import plotly_bundle

    bundle = tmp_path / "plotly.min.js"
    bundle.write_text(get_plotlyjs()[:1000], encoding="utf-8")
    assert plotly_bundle(tmp_path) == bundle
    assert bundle.read_text(encoding="utf-8") == get_plotlyjs()
    os.utime(bundle, (1, 1))
    plotly_bundle(tmp_path)
    assert bundle.stat().st_mtime == 1


def test_write_failures_name_the_file_and_keep_the_old_one(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    target = tmp_path / "a.json"
    files.write_json(target, {"old": 1})

    def half_then_full(p):
        p.write_bytes(b'{"new": ')
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(files.WriteError) as err:
        files.atomic_write(target, half_then_full)
    assert err.value.errno == errno.ENOSPC and isinstance(err.value, OSError)
    assert str(err.value).startswith(f"could not write {target}: No space left on device")
    assert json.loads(target.read_text()) == {"old": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    # safetensors reports a full disk as its own error type: the same one line
    monkeypatch.setattr("safetensors.torch.save_file", lambda *a, **k: (_ for _ in ()).throw(
        SafetensorError("Error while serializing: I/O error: No space left on device (os "
                        "error 28)")))
    with pytest.raises(files.WriteError, match="t.safetensors: No space left on device"):
        files.write_tensors(tmp_path / "t.safetensors", {"x": torch.zeros(2)})
    # a bug is not a disk problem: other errors pass through unchanged
    with pytest.raises(ZeroDivisionError):
        files.atomic_write(tmp_path / "b", lambda p: 1 / 0)


def test_a_dangling_symlink_out_is_named(tmp_path):
    link = tmp_path / "results"
    link.symlink_to(tmp_path / "gone" / "deeper")
    r = _cli([*PATCH, "--out", link])
    assert r.exit_code == 2 and "File exists" not in r.output, r.output
    assert "symbolic link" in r.output and "does not exist" in r.output
    r = _cli([*PATCH, "--out", link / "sub"])  # a dangling link above the folder
    assert r.exit_code == 2 and "symbolic link" in r.output and "File exists" not in r.output


# --- one lock per output folder ----------------------------------------------------------------


def test_every_patch_method_is_refused_on_a_folder_in_use(tmp_path, holder):
    """Before: only exact sweeps (through their checkpoint) took a lock."""
    out = tmp_path / "p"
    proc = holder(out)
    for method in ("attribution", "exact"):
        r = _cli([*PATCH, "--method", method, "--out", out])
        assert r.exit_code == 2, r.output
        line = next(x for x in r.output.splitlines() if x.startswith("error:"))
        assert f"{out} is in use by another process (pid {proc.pid})" in line, r.output
    assert not (out / "result.json").exists()


def test_a_dead_processes_lock_is_taken_over(tmp_path, holder):
    proc = holder(tmp_path / "f")
    with pytest.raises(ValueError, match=f"in use by another process \\(pid {proc.pid}\\)"):
        files.lock_folder(tmp_path / "f")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with files.lock_folder(tmp_path / "f"):
        assert (tmp_path / "f" / files.LOCK_NAME).read_text() == str(os.getpid())
        assert files.holds_lock(tmp_path / "f")
    assert not files.holds_lock(tmp_path / "f")


def test_report_and_characterize_are_refused_on_a_folder_in_use(tmp_path, holder, tiny_llama):
    out = tmp_path / "c"
    proc = holder(out)
    with pytest.raises(ValueError, match=f"out_dir {out} is in use.*pid {proc.pid}"):
        characterize(tiny_llama, "synthetic", out, dict(n_examples=4, progress=False))
    (out / "summary.json").write_text("{}")
    r = _cli(["report", out, "--no-attention"])
    assert r.exit_code == 2 and f"pid {proc.pid}" in r.output, r.output


def test_taking_a_lock_removes_dead_writers_temporaries(tmp_path):
    dead = 2 ** 22 + 12345  # above pid_max's default: no such process
    live = os.getppid()
    for name in (f".model.safetensors.{dead}.tmp", f".result.json.{live}.tmp"):
        (tmp_path / name).write_text("half")
    (tmp_path / f".staging.{dead}").mkdir()
    (tmp_path / f".staging.{dead}" / "model.safetensors").write_text("half")
    (tmp_path / f".out.{dead}.partial").mkdir()
    (tmp_path / "keep.tmp").write_text("not ours")
    with files.lock_folder(tmp_path, clean=False):  # a folder other hosts' ranks write too
        assert (tmp_path / f".model.safetensors.{dead}.tmp").exists()
    with files.lock_folder(tmp_path):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [files.LOCK_NAME, f".result.json.{live}.tmp", "keep.tmp"])


# --- a step is reused only when its files verify -------------------------------------------------

TASK = dict(n_labels=8, children=4, labels_per_note=(1, 1))


def _characterize(model, out, **kw):
    return characterize(model, "synthetic", out, dict(n_examples=8, k=2, n_random=4,
                                                      text=False, progress=False,
                                                      task_kwargs=TASK, **kw))


def test_a_step_whose_file_was_deleted_or_changed_is_recomputed(tiny_llama, tmp_path):
    """Before: a step recorded in summary.json counted as reused even when its file was gone,
    and the report then left that sweep out without a word."""
    from circuitkit.experiments.report import build_report

    out = tmp_path / "run"
    _characterize(tiny_llama, out)
    want = PatchResult.load(out / "patch-p2-noise")
    (out / "patch-p2-noise.safetensors").unlink()
    page = build_report(out, attention=False)
    assert "Missing files" in page and "patch-p2-noise.safetensors" in page
    scores = (out / "scores.csv").read_text()
    (out / "scores.csv").write_text(scores.replace("0.", "9.", 1))
    with pytest.warns(UserWarning) as caught:
        summary = _characterize(tiny_llama, out)
    said = " ".join(str(w.message) for w in caught)
    assert "patch-p2-noise" in said and "is missing; recomputing" in said
    assert "scores.csv was modified" in said
    assert summary["complete"]
    got = PatchResult.load(out / "patch-p2-noise")
    assert torch.equal(got.values, want.values)  # its checkpoint chunks: the same numbers
    assert (out / "scores.csv").read_text() == scores
    assert "Missing files" not in build_report(out, attention=False)
    with warnings_as_errors():  # and now every step verifies: all reused, nothing said
        _characterize(tiny_llama, out)


def test_one_check_of_a_file_against_its_recorded_digest(tmp_path, monkeypatch):
    """characterize's reusable-step check (``step_problem``) and the report's ``read_summary``
    compare a file with its recorded SHA-256 through the one helper, ``files.modified`` (they
    had each their own copy): same verdicts, each in its own words."""
    from circuitkit.experiments.report import read_summary
    from circuitkit.experiments.runner import step_problem

    out = tmp_path / "run"
    out.mkdir()
    (out / "scores.csv").write_text("layer,head\n0,0\n")
    record = dict(files=["scores.csv"], sha256={"scores.csv": files.sha256_file(
        out / "scores.csv")})
    (out / "summary.json").write_text(json.dumps(dict(steps=dict(scores=record))))
    assert not files.modified(out / "scores.csv", record["sha256"]["scores.csv"])
    assert not files.modified(out / "gone.csv", "0" * 64)  # missing: each caller names it
    asked = []
    real = files.modified
    monkeypatch.setattr(files, "modified", lambda path, digest: asked.append(
        pathlib.Path(path).name) or real(path, digest))
    assert step_problem(out, record) == "" and read_summary(out)["steps"]["scores"] == record
    assert asked == ["scores.csv", "scores.csv"]
    (out / "scores.csv").write_text("layer,head\n0,1\n")
    assert files.modified(out / "scores.csv", record["sha256"]["scores.csv"])
    assert "scores.csv was modified (its SHA-256 differs" in step_problem(out, record)
    with pytest.raises(ValueError, match="scores.csv was modified after characterize wrote it"):
        read_summary(out)
    (out / "scores.csv").unlink()
    assert "is missing" in step_problem(out, record)
    assert read_summary(out)["steps"]["scores"] == record  # the page's "Missing files" note


def warnings_as_errors():
    import warnings

    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error", UserWarning)

    class _Exit:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            ctx.__exit__(*exc)

    return _Exit()


def test_a_truncated_summary_names_the_file(tiny_llama, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text('{"identity": {"task": ')
    with pytest.raises(ValueError, match="summary.json: not valid JSON \\(truncated\\?\\) at "
                                         "line 1"):
        _characterize(tiny_llama, out)


# --- PatchResult.load: types, ranges and agreement, with the file and field named ----------------


def _saved(tmp_path):
    res = PatchResult(values=torch.full((2, 3), 0.5), clean=1.0, corrupt=0.0,
                      direction="denoise", method="exact", site="z", positions="all",
                      per_prompt=torch.full((4, 2, 3), 0.5), clean_per_prompt=torch.ones(4),
                      corrupt_per_prompt=torch.zeros(4))
    res.save(tmp_path / "r", views=False)
    return tmp_path / "r.json", tmp_path / "r.safetensors"


def test_one_strict_json_read_names_the_file(tmp_path, monkeypatch):
    """``files.read_json``: a truncated or unreadable JSON file is one line naming it; the
    result files' load reads through it (the "not a readable ... file" wording had its own
    copy in each reader)."""
    bad = tmp_path / "c.json"
    bad.write_text('{"ablation": ')
    with pytest.raises(ValueError, match="c.json is not a readable circuit file: not valid "
                                         "JSON \\(truncated\\?\\) at line 1 column 14\\.$"):
        files.read_json(bad, "circuit file")
    bad.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match="c.json is not a readable circuit file \\(.*utf-8"):
        files.read_json(bad, "circuit file")
    bad.write_text('{"a": [1, 2.5]}')
    assert files.read_json(bad, "circuit file") == {"a": [1, 2.5]}
    js, _ = _saved(tmp_path)
    read = []
    real = files.read_json
    monkeypatch.setattr(files, "read_json", lambda path, noun: read.append(
        (pathlib.Path(path).name, noun)) or real(path, noun))
    PatchResult.load(js)
    assert read == [("r.json", "result file")]


def _set(key, value):
    return lambda info: info.__setitem__(key, value)


@pytest.mark.parametrize("edit,message", [
    (lambda text: text.replace('"clean": 1.0', '"clean": 1e400'),
     "r.json: field 'clean' must be a finite number; got inf"),
    (lambda text: text.replace('"corrupt": 0.0', '"corrupt": NaN'),
     "r.json: field 'corrupt' must be a finite number; got nan"),
    (lambda text: text[: len(text) // 2], "r.json is not a readable result file: not valid JSON "
                                          "\\(truncated\\?\\) at line"),
])
def test_load_refuses_damaged_json_text(tmp_path, edit, message):
    js, _ = _saved(tmp_path)
    js.write_text(edit(js.read_text()))
    with pytest.raises(ValueError, match=message):
        PatchResult.load(tmp_path / "r")


@pytest.mark.parametrize("edit,message", [
    (_set("version", "2"), "field 'version' must be a positive integer; got '2'"),
    (_set("version", True), "field 'version' must be a positive integer; got True"),
    (_set("meta", [1, 2]), "field 'meta' must be a JSON object; got list"),
    (_set("meta", True), "field 'meta' must be a JSON object; got bool"),
    (_set("clean", "1.0"), "field 'clean' must be a finite number; got '1.0'"),
    (_set("clean", 7.0), "field 'clean' and .*r.safetensors: 'clean' is not the mean over "
                         "prompts"),
    (_set("axes", "layerhead"), "field 'axes' must be a list of distinct names"),
    (_set("axes", ["layer", "layer"]), "field 'axes' must be a list of distinct names"),
    (_set("direction", ["noise"]), "field 'direction' must be a string"),
])
def test_load_names_the_file_and_the_field(tmp_path, edit, message):
    js, _ = _saved(tmp_path)
    info = json.loads(js.read_text())
    edit(info)
    js.write_text(json.dumps(info))
    with pytest.raises(ValueError, match=message):
        PatchResult.load(tmp_path / "r")


@pytest.mark.parametrize("edit,message", [
    (lambda t: t["values"].__setitem__((0, 0), float("nan")),
     "tensor 'values' holds 1 non-finite value"),
    (lambda t: t["clean_per_prompt"].__setitem__(0, float("inf")),
     "tensor 'clean_per_prompt' holds 1 non-finite value"),
    (lambda t: t.__setitem__("values", t["values"] * 3),
     "'values' is not the mean over prompts of its per-prompt values"),
    (lambda t: t.pop("corrupt_per_prompt"), "'clean_per_prompt' without its pair"),
    (lambda t: t.__setitem__("values", t["values"].long()),
     "tensor 'values' must be floating point"),
])
def test_load_refuses_tensors_that_disagree(tmp_path, edit, message):
    from safetensors.torch import load_file, save_file

    _, st = _saved(tmp_path)
    tensors = load_file(str(st))
    edit(tensors)
    save_file(tensors, str(st))
    with pytest.raises(ValueError, match=f"r.safetensors: {message}"):
        PatchResult.load(tmp_path / "r")


def test_results_of_every_method_still_load(tiny_llama, tmp_path):
    """The agreement checks hold for what each method writes (float32 means: ~1e-7 x scale)."""
    task = ck.load_task("induction", n_examples=5, seg_len=5, vocab_size=64, seed=2)
    for method in ("exact", "attribution", "attribution+exact"):
        for positions in ("all", "each"):
            res = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, task.metric,
                                 method=method, positions=positions, options=dict(progress=False))
            res.save(tmp_path / f"{method}-{positions}", views=False)
            back = PatchResult.load(tmp_path / f"{method}-{positions}")
            assert torch.equal(back.values, res.values)


# --- --batch-size: not part of a sweep's identity, within a documented tolerance ----------------

BATCH_RTOL = 1e-6  # docs/durability.md: |values(b1) - values(b2)| <= 1e-6 x scale (float32)


@pytest.mark.parametrize("method", ["exact", "attribution+exact"])
def test_batch_size_changes_values_within_the_documented_tolerance(tiny_llama, tmp_path,
                                                                   method):
    """Sweeps at several batch sizes, and a sweep resumed under another batch size, agree with
    one another to ``BATCH_RTOL`` x scale (scale: the largest of 1, |clean|, |corrupt| and
    |values|): float32 rounding of differently shaped matmuls. A float64 run of the same model
    is as far from each (the reference nobody here wrote: the model in float64)."""
    task = ck.load_task("induction", n_examples=8, seg_len=6, vocab_size=64, seed=2)

    def run(bs, model=tiny_llama, checkpoint=None):
        return ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                              method=method, positions="each",
                              options=dict(batch_size=bs, checkpoint=checkpoint, progress=False))

    ref = run(64)
    scale = max(1.0, abs(ref.clean), abs(ref.corrupt), float(ref.values.abs().max()))
    for bs in (1, 3, 5):
        diff = float((run(bs).values - ref.values).abs().max())
        assert diff <= BATCH_RTOL * scale, (bs, diff, scale)
    ckpt = tmp_path / "ckpt"
    run(64, checkpoint=ckpt)
    if method == "exact":
        chunks = sorted(ckpt.glob("chunk_*.safetensors"))
        for c in chunks[len(chunks) // 2:]:
            c.unlink()
    else:
        (ckpt / "hybrid-cells.safetensors").unlink()
    mixed = run(3, checkpoint=ckpt)
    assert float((mixed.values - ref.values).abs().max()) <= BATCH_RTOL * scale
    m64 = _float64(tiny_llama)
    exact = run(64, model=m64)
    assert float((ref.values.double() - exact.values.double()).abs().max()) <= BATCH_RTOL * scale


def _float64(model):
    import copy

    return copy.deepcopy(model).double()


def test_cli_lock_is_released_after_each_command(tmp_path):
    """Under the in-process test runner the ``--out`` lock ends with the command."""
    out = tmp_path / "p"
    for _ in range(2):
        t0 = time.perf_counter()
        r = _cli([*PATCH, "--method", "attribution", "--out", out])
        assert r.exit_code == 0, r.output
        assert time.perf_counter() - t0 < 120
    assert not files.holds_lock(out)
