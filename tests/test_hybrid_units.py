"""One screen-then-verify for every unit: heads (``ck.patch`` over ``HeadUnits``) and edges
(``ck.patch_edges``, its wrapper) go through ``hybrid.screen_then_verify``
with the same checkpoint and resume, out-of-memory halving, Ctrl-C report, top_k check and cost
accounting; and the hybrid says what it did (issue 36: verified cells, stop, cost vs exact,
timing), runs exact where it would cost as much, and its plan matches its run on the teacher."""

from __future__ import annotations

import warnings

import pytest
import torch
from _scale import TINY_GQA8, induction
from tinymodels import TINY_LLAMA, call, hybrid_heads, make_model

import circuitkit as ck
from circuitkit.patching import hybrid
from circuitkit.patching.exact import EdgeEngine, ExactEngine
from circuitkit.patching.results import DegenerateBaselineWarning


@pytest.fixture(scope="module")
def heads_model():
    return ck.load_model(dict(TINY_GQA8, seed=1))


@pytest.fixture(scope="module")
def edges_model():
    return make_model(TINY_LLAMA)


@pytest.fixture(scope="module")
def task():
    return induction(n=4, seed=5)


def edge_margin(logits):
    return logits[:, -1, 5] - logits[:, -1, 7]


def edge_pair():
    g = torch.Generator().manual_seed(3)
    return (torch.randint(1, 64, (3, 7), generator=g), torch.randint(1, 64, (3, 7), generator=g))


@pytest.fixture(params=["heads", "edges"])
def units(request, heads_model, edges_model, task):
    """``(run(**kw), engine class)``: the public entry of one unit kind with the hybrid. The
    automatic budget under ``max_passes=1e9`` (a cap that never binds): the rule itself, never
    swapped for the exact sweep."""
    if request.param == "heads":  # through the one entry itself (patch_edges: its wrapper)
        def run(**kw):
            kw = {**kw.pop("options", {}), **kw}  # (the tests' shorthand: one options dict)
            kw.setdefault("max_passes", 1e9)
            kw.setdefault("progress", False)
            return ck.patch(heads_model, task.clean_tokens, task.corrupt_tokens, task.metric,
                            ck.HeadUnits(), method="attribution+exact", options=kw)
        return run, ExactEngine
    clean, corrupt = edge_pair()

    def run(**kw):
        kw = {**kw.pop("options", {}), **kw}  # (the tests' shorthand: one options dict)
        kw.setdefault("max_passes", 1e9)
        kw.setdefault("progress", False)
        return call(ck.patch_edges, edges_model, clean, corrupt, edge_margin,
                    method="attribution+exact", **kw)
    return run, EdgeEngine


def counting(monkeypatch, engine, stop_at=None, oom_above=None):
    """Count the engine's verification forwards (rows of each); Ctrl-C at call ``stop_at``;
    out-of-memory for a forward of more than ``oom_above`` rows."""
    calls: list[int] = []
    real = engine.run_variants

    def run_variants(self, layer, variants, p0, p1, *a, **k):
        calls.append(len(variants) * (p1 - p0))
        if stop_at is not None and len(calls) == stop_at:
            raise KeyboardInterrupt
        if oom_above is not None and calls[-1] > oom_above:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, layer, variants, p0, p1, *a, **k)
    monkeypatch.setattr(engine, "run_variants", run_variants)
    return calls


def quiet(fn, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateBaselineWarning)  # random models
        return call(fn, **kw)


def test_heads_and_edges_take_the_one_screen_then_verify(units, monkeypatch):
    run, _ = units
    seen = []
    real = hybrid.screen_then_verify

    def spy(u, *a, **k):
        seen.append(u.kind)
        return real(u, *a, **k)
    monkeypatch.setattr(hybrid, "screen_then_verify", spy)
    res = quiet(run)
    assert len(seen) == 1 and res.method == "attribution+exact"
    assert res.meta["hybrid"]["ran"] == "attribution+exact"


def test_interrupted_then_resumed_gives_the_uninterrupted_result(units, tmp_path, monkeypatch,
                                                                 capsys):
    run, engine = units
    want = quiet(run, batch_size=4)
    calls = counting(monkeypatch, engine)
    quiet(run, batch_size=4)
    n_calls = len(calls)
    assert n_calls >= 3  # enough forwards to stop in the middle
    counting(monkeypatch, engine, stop_at=n_calls // 2 + 1)
    with pytest.raises(KeyboardInterrupt):
        quiet(run, batch_size=4, checkpoint=tmp_path)
    assert "verified cells and the screen saved in" in capsys.readouterr().err
    assert (tmp_path / "hybrid-cells.safetensors").exists()
    calls = counting(monkeypatch, engine)
    got = quiet(run, batch_size=4, checkpoint=tmp_path)
    assert 0 < len(calls) < n_calls  # only what the first run had not finished
    assert got.meta["cost"]["reused_cells"] > 0
    assert torch.equal(got.values.nan_to_num(7.0), want.values.nan_to_num(7.0))
    assert got.meta["verified_cells"] == want.meta["verified_cells"]
    assert got.meta["budget"] == want.meta["budget"]
    calls = counting(monkeypatch, engine)
    again = quiet(run, batch_size=4, checkpoint=tmp_path)  # screen and cells stored: no work
    assert not calls and torch.equal(again.values.nan_to_num(7.0), want.values.nan_to_num(7.0))
    with pytest.raises(ValueError, match="different attribution\\+exact run.*direction"):
        quiet(run, direction="noise", checkpoint=tmp_path)


def test_ctrl_c_without_a_checkpoint_says_the_cells_are_lost(units, monkeypatch, capsys):
    run, engine = units
    counting(monkeypatch, engine, stop_at=1)
    with pytest.raises(KeyboardInterrupt):
        quiet(run)
    assert "lost (no checkpoint folder: pass checkpoint= to keep them)" in capsys.readouterr().err


def test_out_of_memory_halves_the_rows_and_changes_no_value(units, monkeypatch):
    run, engine = units
    want = quiet(run, batch_size=16)
    calls = counting(monkeypatch, engine, oom_above=2)
    got = quiet(run, batch_size=16)
    assert got.meta["cost"]["oom_backoffs"] >= 2 and got.meta["cost"]["rows_per_forward"] <= 2
    assert calls[0] > 2 and max(calls[-3:]) <= 2
    torch.testing.assert_close(got.values, want.values, atol=1e-6, rtol=0, equal_nan=True)


@pytest.mark.parametrize("bad", [-3, 0, 1.5, True])
def test_a_bad_top_k_is_refused_at_the_entry(units, bad):
    run, _ = units
    with pytest.raises(ValueError, match=f"top_k={bad!r}: expected a positive integer"):
        run(top_k=bad, max_passes=None)


def test_the_run_says_what_it_verified_why_it_stopped_and_its_cost(units, capsys):
    run, _ = units
    res = quiet(run, progress=True)
    err = capsys.readouterr().err
    c = res.meta["cost"]
    assert f"verified {res.meta['n_verified']} of " in err and "stopped: " in err
    assert f"the exact sweep's {c['exact_sweep_passes']:,.0f}" in err
    assert res.meta["hybrid"]["summary"] in err
    t = res.meta["timing"]
    assert t["total"] >= t["screen"] + t["verify"] - 1e-6 and res.meta["seconds"] == t["total"]
    assert c["total_passes"] == pytest.approx(c["estimator_passes"] + c["verify_passes"])


def test_the_automatic_budget_runs_exact_where_it_would_cost_as_much(edges_model):
    """12 heads: the rule's floor (two rounds, 8 cells) plus the screen costs more than every
    cell exactly: the entry patches exactly, and says so; the hybrid forced through
    (``exact_when_cheaper=False``) is warned about before it starts."""
    clean, corrupt = edge_pair()
    args = (edges_model, clean, corrupt, edge_margin)
    exact = quiet(ck.patch_heads, model=edges_model, clean_tokens=clean, corrupt_tokens=corrupt,
                  metric=edge_margin, progress=False)
    res = quiet(ck.patch_heads, model=edges_model, clean_tokens=clean, corrupt_tokens=corrupt,
                metric=edge_margin, method="attribution+exact", progress=False)
    h = res.meta["hybrid"]
    assert res.method == "exact" and h["ran"] == "exact" and h["passes"] >= h["exact_passes"]
    assert "every cell was patched exactly instead" in h["why"]
    assert torch.equal(res.values, exact.values)
    with pytest.warns(UserWarning, match="at least the exact sweep's"):
        hybrid_heads(*args, exact_when_cheaper=False, progress=False)


def test_plan_cells_floor():
    from circuitkit.patching.cost import hybrid_cells

    assert hybrid_cells(32, 8, None) == (16, 16)  # the teacher: two rounds = its cap
    assert hybrid_cells(5120, 64, None) == (1024, 2560)  # 70B: the 20% expectation
    assert hybrid_cells(40, 3, None) == (12, 20)  # rounds until recall_top (10) are verified
    assert hybrid_cells(40, 3, 7) == (7, 7)


@pytest.fixture(scope="module")
def teacher():
    from circuitkit.tasks.base import phase_task

    return (ck.load_model("icd-teacher"),
            phase_task(ck.load_task("icd10", n_examples=32, split="test"), 2))


@pytest.mark.parametrize("top_k", [None, 6])
def test_the_plan_is_within_a_quarter_of_the_run_on_the_teacher(teacher, top_k):
    """Issue 36: the plan said ~7 cells, 374 pass-equivalents; the run verified 16 (its cap)
    for 658, 1.39x the exact sweep. Now the plan prices the rule's floor, and the automatic
    budget, predicted dearer than exact, runs exact (both say so)."""
    model, task = teacher
    args = (model, task.clean_tokens, task.corrupt_tokens, task.metric)
    plan = ck.plan_patch(*args, method="attribution+exact", options=dict(top_k=top_k))
    res = ck.patch_heads(*args, method="attribution+exact",
                         options=dict(top_k=top_k, progress=False))
    if top_k is None:
        assert plan["method"] == res.method == "exact" and res.meta["hybrid"]["ran"] == "exact"
        ran = res.meta["hybrid"]["exact_passes"]
    else:
        assert res.method == "attribution+exact" and plan["verified_cells"] == 6
        ran = res.meta["cost"]["total_passes"]
    assert abs(plan["pass_equivalents"] - ran) <= 0.25 * ran, (plan["pass_equivalents"], ran)


def test_a_head_checkpoint_written_before_the_one_road_still_resumes(heads_model, task, tmp_path,
                                                                     monkeypatch):
    """``tests/fixtures/hybrid-checkpoint-83ec843``: the head hybrid (``top_k=5``) on
    this model and task, checkpointed by main at 83ec843 (the head-only hybrid in api.py). The
    same identity and cell numbering: it resumes with no screen and no verification forward."""
    import shutil
    from pathlib import Path

    folder = tmp_path / "ckpt"
    shutil.copytree(Path(__file__).parent / "fixtures" / "hybrid-checkpoint-83ec843", folder)
    args = (heads_model, task.clean_tokens, task.corrupt_tokens, task.metric)
    want = quiet(ck.patch_heads, model=heads_model, clean_tokens=task.clean_tokens,
                 corrupt_tokens=task.corrupt_tokens, metric=task.metric,
                 method="attribution+exact", top_k=5, progress=False)
    calls = counting(monkeypatch, ExactEngine)

    def no_screen(*a, **k):
        raise AssertionError("the stored screen was recomputed")
    monkeypatch.setattr("circuitkit.patching.estimators.attribution.estimate_heads", no_screen)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "not usable; screening again" would fail
        warnings.simplefilter("ignore", DegenerateBaselineWarning)
        got = hybrid_heads(*args, top_k=5, progress=False, checkpoint=folder)
    assert not calls and got.meta["cost"]["reused_cells"] == 5
    assert got.meta["verified_cells"] == [(0, 7), (0, 1), (1, 6), (0, 14), (0, 8)]
    torch.testing.assert_close(got.values, want.values, atol=1e-6, rtol=0)


def _conformance():
    import test_conformance

    return test_conformance


@pytest.mark.parametrize("name", _conformance().LAYOUTS)
def test_the_hybrid_itself_on_every_layout(name):
    """The conformance matrix's ``test_hybrid`` calls ``patch_heads``, which on its tiny models
    now runs the exact sweep (the hybrid would cost more): here the hybrid itself
    (``budget=BudgetRule(exact_when_cheaper=False)``: never swapped) on the same 24 layouts, its
    verified cells against the hooked reference, so the screen-then-verify road keeps its
    matrix."""
    tc = _conformance()
    c = tc.case(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hybrid_heads(c.model, c.clean, c.corrupt, c.metric, exact_when_cheaper=False,
                           progress=False)
        routed = ck.patch_heads(c.model, c.clean, c.corrupt, c.metric, method="attribution+exact",
                                options=dict(progress=False))
    assert res.method == "attribution+exact"
    want = tc.hooked_sweep(c.model, c.corrupt, c.clean, c.metric)
    done = res.verified
    assert done.any() and torch.isfinite(res.values).all()
    torch.testing.assert_close(res.values[done], want[done], atol=tc.ATOL, rtol=0)
    assert routed.verified.all() or routed.method == "attribution+exact"  # exact: all True


_KILLED = """
import sys, time, warnings
sys.path.insert(0, {tests!r})
warnings.simplefilter("ignore")
import torch
import circuitkit as ck
from circuitkit.patching.exact import EdgeEngine, ExactEngine
from _scale import TINY_GQA8, induction
from tinymodels import TINY_LLAMA, make_model
engine = ExactEngine if {kind!r} == "heads" else EdgeEngine
real = engine.run_variants
def slow(self, *a, **k):
    time.sleep(0.5)  # a forward long enough to be killed in the middle of the verification
    return real(self, *a, **k)
engine.run_variants = slow
if {kind!r} == "heads":
    task = induction(n=4, seed=5)
    ck.patch_heads(ck.load_model(dict(TINY_GQA8, seed=1)), task.clean_tokens,
                   task.corrupt_tokens, task.metric, method="attribution+exact",
                   max_passes=1e9, batch_size=4, checkpoint={ckpt!r}, progress=False)
else:
    g = torch.Generator().manual_seed(3)
    clean, corrupt = (torch.randint(1, 64, (3, 7), generator=g) for _ in range(2))
    def edge_margin(logits):  # the parent's metric, by name and behaviour
        return logits[:, -1, 5] - logits[:, -1, 7]
    ck.patch_edges(make_model(TINY_LLAMA), clean, corrupt, edge_margin,
                   method="attribution+exact",
                   max_passes=1e9, batch_size=4, checkpoint={ckpt!r}, progress=False)
"""


def test_sigkill_mid_verification_then_resume_gives_the_uninterrupted_result(units, tmp_path,
                                                                            monkeypatch):
    """SIGKILL (no cleanup runs) once the first verified cells are on disk; the rerun resumes
    them and ends identical to a run never killed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from killing import kill_at_first_checkpoint

    run, engine = units
    kind = "heads" if engine is ExactEngine else "edges"
    ckpt = tmp_path / "ckpt"
    tests = str(Path(__file__).parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(tests).parent), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED.format(tests=tests, kind=kind,
                                                                  ckpt=str(ckpt))], env=env)
    kill_at_first_checkpoint(proc, ckpt / "hybrid-cells.safetensors", timeout=120)
    want = quiet(run, batch_size=4)
    calls = counting(monkeypatch, engine)
    got = quiet(run, batch_size=4, checkpoint=ckpt)
    assert got.meta["cost"]["reused_cells"] > 0 and len(calls) > 0  # resumed, then finished
    assert torch.equal(got.values.nan_to_num(7.0), want.values.nan_to_num(7.0))
    assert got.meta["verified_cells"] == want.meta["verified_cells"]


def test_auto_above_the_threshold_that_runs_exact_says_so(edges_model, monkeypatch):
    """``auto`` choosing the hybrid (as for 70B) on a model where the hybrid would cost as much
    as exact: the exact sweep, ``meta["auto"]["verified"] == "all"``, the reason recorded."""
    from circuitkit.patching import cost as P

    monkeypatch.setattr(P, "AUTO_EXACT_MAX_FLOPS_PER_TOKEN", 0.0)
    clean, corrupt = edge_pair()
    res = quiet(ck.patch_heads, model=edges_model, clean_tokens=clean, corrupt_tokens=corrupt,
                metric=edge_margin, method="auto", progress=False)
    auto = res.meta["auto"]
    assert auto["chose"] == "attribution+exact" and res.method == "exact"
    assert auto["verified"] == "all" and auto["screening"]["k"] == res.values.numel()
    assert res.meta["hybrid"]["ran"] == "exact"
