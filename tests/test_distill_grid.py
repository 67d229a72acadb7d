"""The ablation grid's own durability (issue 33, items 4, 16, 18, 19): a changed configuration
is refused (or, with ``--overwrite``, started over) instead of mixed into the runs there; the
grid's workers die with it; a dead worker is one line and the resume hint; Ctrl-C stops at once.

The kill tests run the real ``circuitkit distill --ablation --quick --workers 2`` in a
subprocess, on a copy of a grid whose stores and CoT-only runs are already there (so the workers
start within seconds), and find the workers through ``/proc``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from circuitkit.cli import app
from circuitkit.distill import train as T
from circuitkit.experiments import distill_grid as A
from circuitkit.files import sha256_file

GRID = dict(seeds=1, size="quick", students=("student",), progress=False)
CLI = ["distill", "--ablation", "--quick", "--seeds", "1", "--student-config", "student"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished quick grid of the CoT-only variant on both data sizes (stores, held-out
    store, teacher.json, pre-training, one run per cell)."""
    out = tmp_path_factory.mktemp("grid") / "g"
    A.run_ablation(out, A.GridOptions(variants=("cot",), **GRID))
    return out


def _copy(base, tmp_path):
    dest = tmp_path / "g"
    shutil.copytree(base, dest)
    return dest


def _boom(*a, **k):
    raise AssertionError("trained or built although the grid was refused")


# --- item 4: a changed configuration ------------------------------------------------------------


def test_a_finished_grid_refuses_a_changed_flag_in_one_line(base, tmp_path, monkeypatch):
    """Before: the rerun with --lambda-p1 0.5 (or --steps 6) exited 0 doing nothing and
    ablation.json recorded the new value while every run was trained at the old one."""
    out = _copy(base, tmp_path)
    record = (out / "ablation.json").read_bytes()
    monkeypatch.setattr(A, "train_student", _boom)
    monkeypatch.setattr(T, "prepare_store", _boom)
    for kw, diff in ((dict(lambda_p1=0.5), "lambda_p1: 1.0 -> 0.5"),
                     (dict(steps=6), "steps: 4 -> 6"),
                     (dict(grad_ratio=0.25), "grad_ratio: 0.5 -> 0.25"),
                     (dict(pretrain=3), "pretrain: 2 -> 3")):
        with pytest.raises(ValueError, match=f"another configuration \\({diff}\\); pass "
                                             "--overwrite"):
            A.run_ablation(out, dict(GRID, variants=("cot",), data=("full",), **kw))
    r = CliRunner().invoke(app, CLI + ["--lambda-p1", "0.5", "--steps", "6", "--out", str(out)])
    errors = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert "lambda_p1: 1.0 -> 0.5, steps: 4 -> 6); pass --overwrite" in errors[0]
    assert "Traceback" not in r.output
    assert (out / "ablation.json").read_bytes() == record  # nothing recorded, nothing run


def test_a_partial_grid_refuses_a_change_and_overwrite_starts_over(base, tmp_path, monkeypatch):
    """Before: a grid stopped part-way and rerun with another --steps trained the rest at the
    new value (runs at both values, rc 0). Now it is refused before anything runs; with
    overwrite every run is trained again at the new value and the stores, which do not
    depend on --steps, are kept."""
    out = _copy(base, tmp_path)
    (out / "runs" / "student-full" / "cot-seed0" / "metrics.json").unlink()  # unfinished run
    with monkeypatch.context() as m:
        m.setattr(A, "train_student", _boom)
        m.setattr(T, "prepare_store", _boom)
        with pytest.raises(ValueError, match="another configuration \\(steps: 4 -> 6\\)"):
            A.run_ablation(out, dict(GRID, variants=("cot",), data=("full",), steps=6))
    store = (out / "signals-full" / "manifest.json").stat().st_mtime_ns
    A.run_ablation(out, dict(GRID, variants=("cot",), data=("full",), steps=6,
                             overwrite=True))
    assert not (out / "runs" / "student-small").exists()  # the old grid's runs are gone
    run = json.loads((out / "runs" / "student-full" / "cot-seed0" / "distill.json").read_text())
    assert run["config"]["steps"] == 6 and len(run["history"]) == 6
    assert json.loads((out / "ablation.json").read_text())["sizes"]["steps"] == 6
    assert (out / "signals-full" / "manifest.json").stat().st_mtime_ns == store
    assert (out / "signals-small" / "manifest.json").exists()  # its keys did not change either
    assert "steps" not in A.STORE_KEYS and "pool_size" in A.STORE_KEYS


def test_a_run_measured_with_fewer_metrics_is_measured_again_not_retrained(tmp_path):
    """A run whose metrics.json lacks one of ``METRICS`` (a version that measured less, e.g.
    before ``focus_per_step``) is measured again from its saved student on resume; training
    is not repeated and the other values stay."""
    out = tmp_path / "g"  # (a copy would move the folders its runs' configs name)
    A.run_ablation(out, A.GridOptions(variants=("cot",), data=("full",), **GRID))
    (done,) = list((out / "runs").glob("*/cot-seed0/metrics.json"))
    rec = json.loads(done.read_text())
    old = dict(rec["metrics"])
    rec["metrics"].pop("focus_per_step")
    done.write_text(json.dumps(rec))
    teacher = json.loads((out / "teacher.json").read_text())  # the teacher's too
    (out / "teacher.json").write_text(json.dumps({k: v for k, v in teacher.items()
                                                  if k != "focus_per_step"}))
    doc = json.loads((out / "ablation.json").read_text())  # (that version: no resume record)
    (out / "ablation.json").write_text(json.dumps(
        {k: v for k, v in doc.items() if k not in ("record_version", "steps")}))
    assert not A.measured(done.parent)
    record = (done.parent / T.RECORD).read_bytes()  # distill.json: rewritten if it trained
    A.run_ablation(out, A.GridOptions(variants=("cot",), data=("full",), **GRID))
    again = json.loads(done.read_text())["metrics"]
    assert A.measured(done.parent) and (done.parent / T.RECORD).read_bytes() == record
    assert again == old  # (deterministic: the same student, the same notes)
    doc = json.loads((out / "ablation.json").read_text())  # each call's timings kept
    assert len(doc["calls"]) == 2 and doc["timings"] == doc["calls"][-1]
    assert doc["teacher_metrics"]["focus_per_step"] == teacher["focus_per_step"]
    # a recorded run's metrics.json modified since: said (the record's SHA-256 differs) and
    # measured again from its saved student, not trained
    rec = json.loads(done.read_text())
    done.write_text(json.dumps(dict(rec, metrics=dict(rec["metrics"], focus=-1.0))))
    with pytest.warns(UserWarning, match="ablation grid step runs/student-full/cot-seed0 is "
                                         "recorded as done in .*ablation.json, but its file "
                                         ".*metrics.json was modified .*; recomputing it"):
        A.run_ablation(out, A.GridOptions(variants=("cot",), data=("full",), **GRID))
    assert json.loads(done.read_text())["metrics"] == old
    assert (done.parent / T.RECORD).read_bytes() == record


def test_a_grid_resumes_through_its_record(base, tmp_path, monkeypatch):
    """``ablation.json`` holds the grid's resume record (``experiments.runner.StepRecord``,
    the one ``characterize`` keeps in ``summary.json``): the teacher's metrics, each CoT-only
    start and each run, bound to the hash of its config and the SHA-256 of the file it wrote
    last. A copy of the grid resumes from it (nothing trained or measured); a record of a
    newer version is refused in one line naming it; a record as the code before it wrote
    (no version, no steps) still resumes and gets one. (A modified ``metrics.json``:
    ``test_a_run_measured_with_fewer_metrics_is_measured_again_not_retrained``.)"""
    out = _copy(base, tmp_path)
    doc = json.loads((out / "ablation.json").read_text())
    assert doc["record_version"] == 1
    run = "runs/student-full/cot-seed0"
    steps = doc["steps"]
    assert {"teacher", run, "runs/student-small/cot-seed0", "runs/student-full/pretrain"} \
        <= set(steps)
    assert steps[run]["files"] == [f"{run}/metrics.json"]
    assert steps[run]["sha256"][f"{run}/metrics.json"] == sha256_file(out / run /
                                                                       "metrics.json")
    assert steps["teacher"]["files"] == ["teacher.json"]
    frame = pd.read_csv(out / "ablation.csv")
    with monkeypatch.context() as m:
        m.setattr(A, "train_student", _boom)
        m.setattr(A, "student_metrics", _boom)
        A.run_ablation(out, A.GridOptions(variants=("cot",), **GRID))
    pd.testing.assert_frame_equal(pd.read_csv(out / "ablation.csv"), frame)
    assert json.loads((out / "ablation.json").read_text())["steps"][run] == steps[run]
    # a newer record: refused, named, nothing run or rewritten
    doc = json.loads((out / "ablation.json").read_text())
    (out / "ablation.json").write_text(json.dumps(dict(doc, record_version=2)))
    with monkeypatch.context() as m:
        m.setattr(A, "train_student", _boom)
        m.setattr(T, "prepare_store", _boom)
        with pytest.raises(ValueError) as e:
            A.run_ablation(out, A.GridOptions(variants=("cot",), **GRID))
    assert "resume record version 2 is not one this circuitkit reads" in str(e.value)
    assert "--overwrite" in str(e.value) and "\n" not in str(e.value)
    # today's record (before the resume record): every finished part is taken as it is
    legacy = {k: v for k, v in doc.items() if k not in ("record_version", "steps")}
    (out / "ablation.json").write_text(json.dumps(legacy))
    with monkeypatch.context() as m:
        m.setattr(A, "train_student", _boom)
        m.setattr(A, "student_metrics", _boom)
        A.run_ablation(out, A.GridOptions(variants=("cot",), **GRID))
    again = json.loads((out / "ablation.json").read_text())
    # (the CoT-only starts: looked at when a run of their cell is left to train)
    assert again["record_version"] == 1 and set(again["steps"]) == {
        k for k in doc["steps"] if not k.endswith("/pretrain")}
    assert again["steps"][run]["depends"] == doc["steps"][run]["depends"]
    pd.testing.assert_frame_equal(pd.read_csv(out / "ablation.csv"), frame)


def test_ablation_refuses_single_student_options():
    r = CliRunner().invoke(app, CLI + ["--batch-size", "8", "--out", "/tmp/unused-grid"])
    assert r.exit_code == 2 and "--batch-size is a single student's option" in r.output


# --- items 16, 18, 19: the workers ---------------------------------------------------------------


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                kids.append(int(d.name))
    return kids


def _alive(pids):
    out = []
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(p)
    return out


def _alive_after(pids, seconds: float):
    """``_alive(pids)`` once they are all gone or ``seconds`` have passed."""
    deadline = time.time() + seconds
    while _alive(pids) and time.time() < deadline:
        time.sleep(0.1)
    return _alive(pids)


def _start(base, tmp_path):
    """The quick grid (all variants) with two workers on a copy of ``base``, until a worker has
    saved a training state; returns ``(proc, out, log, workers, others)``."""
    out = _copy(base, tmp_path)
    log = tmp_path / "log.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "circuitkit.cli", *CLI, "--workers", "2",
                             "--out", str(out)], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if [p for p in out.glob("runs/*/*-seed0/train_state.safetensors")
                if not p.parent.name.startswith("cot")]:
            break
        time.sleep(0.05)
    if proc.poll() is not None:
        pytest.fail(f"the grid ended before a worker started: {log.read_text()[-2000:]}")
    kids = _children(proc.pid)
    workers = [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    assert len(workers) == 2, kids
    return proc, out, log, workers, [k for k in kids if k not in workers]


def _stop(proc, pids):
    for p in _alive([proc.pid, *pids]):
        os.kill(p, signal.SIGKILL)


def _files(out):
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in out.rglob("*") if p.is_file()}


def test_workers_die_with_a_killed_grid_and_write_nothing_after(base, tmp_path):
    """Before: after SIGKILL of the grid, both workers and the resource tracker lived on (ppid
    1, ~690 MB each, measured 15 minutes later), training and writing metrics.json into a folder
    whose lock was gone. Now the kernel's parent-death signal ends them: all gone within
    seconds, and no file is written after the kill."""
    proc, out, log, workers, others = _start(base, tmp_path)
    try:
        proc.send_signal(signal.SIGKILL)
        killed = time.time()
        proc.wait()
        deadline = killed + 10
        while _alive(workers + others) and time.time() < deadline:
            time.sleep(0.05)
        gone = time.time() - killed
        assert not _alive(workers), f"workers alive {gone:.1f} s after the grid was killed"
        assert not _alive(others), "the resource tracker outlived the grid and its workers"
        late = [str(p) for p in out.rglob("*") if p.is_file()
                and p.stat().st_mtime > killed + 0.5]  # a write in flight at the kill, at most
        assert not late, late
        before = _files(out)
        time.sleep(2)
        assert _files(out) == before
    finally:
        _stop(proc, workers + others)


def test_a_killed_worker_is_one_line_and_the_resume_hint(base, tmp_path):
    """Before: a rich traceback ending BrokenProcessPool, then the resource tracker's "leaked
    semaphore objects" warning. Now one error line naming the dead worker, what is kept, and the
    resume hint; the other worker saves its training state and ends."""
    proc, out, log, workers, others = _start(base, tmp_path)
    try:
        os.kill(workers[0], signal.SIGKILL)
        rc = proc.wait(timeout=90)
        text = log.read_text()
        errors = [x for x in text.splitlines() if x.startswith("error:")]
        assert rc == 2 and len(errors) == 1 and text.count("error:") == 1, text[-3000:]
        assert f"worker died (pid {workers[0]} (killed by SIGKILL)" in errors[0]
        assert "rerun the same command to resume" in errors[0]
        assert "Traceback" not in text and "BrokenProcessPool" not in text
        time.sleep(1)  # the resource tracker reports at its own exit
        assert "leaked semaphore" not in log.read_text()
        assert not _alive_after(workers + others, 10.0)
    finally:
        _stop(proc, workers + others)


def test_ctrl_c_stops_dispatching_at_once(base, tmp_path):
    """Before (quick grid, 2 workers): Ctrl-C ended the grid 7.6 s later, after two more runs
    were started and finished (default sizes: 37-45 s, up to 12 runs). Now nothing more is
    dispatched, the running ones stop at their last training state, and the grid says so."""
    proc, out, log, workers, others = _start(base, tmp_path)
    try:
        started = {p.parent for p in out.glob("runs/*/*/.circuitkit.lock")}
        os.killpg(proc.pid, signal.SIGINT)  # as the terminal's Ctrl-C: the whole group
        sent = time.time()
        rc = proc.wait(timeout=120)
        took = time.time() - sent
        text = log.read_text()
        assert rc == 130, text[-3000:]
        assert "stopped dispatching" in text and "rerun the same command to resume" in text
        assert {p.parent for p in out.glob("runs/*/*/.circuitkit.lock")} == started
        assert took < 30, took  # measured 2.4 s to the message, 5 s to exit, on 2 busy cores
        # the resource tracker ends when its pipe closes, a moment after the grid exits
        assert not _alive_after(workers + others, 10.0)
    finally:
        _stop(proc, workers + others)
