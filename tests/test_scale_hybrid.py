"""attribution+exact as the method 70B gets by default: resumable (screen and verified cells in a
checkpoint folder), bounded by --batch-size and backing off on out-of-memory, max_passes where a
user can reach it, and every public entry taking a plain callable metric. Tiny 8:1 GQA Llama."""

from __future__ import annotations

import warnings

import pytest
import torch
from _scale import TINY_GQA8, induction
from tinymodels import hybrid_heads

import circuitkit as ck
from circuitkit.patching import api
from circuitkit.patching.exact import ExactEngine


@pytest.fixture(scope="module")
def model():
    return ck.load_model(dict(TINY_GQA8, seed=1))


@pytest.fixture(scope="module")
def task():
    return induction(n=4, seed=5)


def hybrid(model, task, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("exact_when_cheaper", False)  # (the hybrid itself, measured, never swapped)
    return hybrid_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric, **kw)


def counting(monkeypatch, stop_at=None):
    """Count ``run_variants`` calls (and the rows of each); raise Ctrl-C at call ``stop_at``."""
    calls: list[int] = []
    real = ExactEngine.run_variants

    def run_variants(self, layer, variants, p0, p1, fast=None):
        calls.append(len(variants) * (p1 - p0))
        if stop_at is not None and len(calls) == stop_at:
            raise KeyboardInterrupt
        return real(self, layer, variants, p0, p1, fast)
    monkeypatch.setattr(ExactEngine, "run_variants", run_variants)
    return calls


def test_interrupted_hybrid_resumes_to_the_uninterrupted_result(model, task, tmp_path,
                                                                 monkeypatch, capsys):
    want = hybrid(model, task, batch_size=8)
    calls = counting(monkeypatch)
    hybrid(model, task, batch_size=8)
    n_calls = len(calls)
    assert n_calls > 4  # enough forwards to stop in the middle
    calls = counting(monkeypatch, stop_at=n_calls // 2)
    with pytest.raises(KeyboardInterrupt):
        hybrid(model, task, batch_size=8, checkpoint=tmp_path)
    assert "verified cells and the screen saved in" in capsys.readouterr().err
    assert (tmp_path / "hybrid-cells.safetensors").exists()

    def no_screen(*a, **k):
        raise AssertionError("the stored screen was recomputed")
    monkeypatch.setattr("circuitkit.patching.estimators.attribution.estimate_heads", no_screen)
    calls = counting(monkeypatch)
    got = hybrid(model, task, batch_size=8, checkpoint=tmp_path)
    assert 0 < len(calls) < n_calls  # only what the first run had not finished
    assert got.meta["cost"]["reused_cells"] > 0
    assert torch.equal(got.values, want.values)
    assert got.meta["verified_cells"] == want.meta["verified_cells"]
    assert got.meta["budget"] == want.meta["budget"]
    calls = counting(monkeypatch)
    again = hybrid(model, task, batch_size=8, checkpoint=tmp_path)
    assert not calls and torch.equal(again.values, want.values)  # everything stored


def test_a_hybrid_checkpoint_of_another_run_is_refused(model, task, tmp_path):
    hybrid(model, task, top_k=3, checkpoint=tmp_path)
    with pytest.raises(ValueError, match="different attribution\\+exact run.*direction"):
        hybrid(model, task, top_k=3, direction="noise", checkpoint=tmp_path)
    other = ck.load_model(dict(TINY_GQA8, seed=2))
    with pytest.raises(ValueError, match="different attribution\\+exact run.*model"):
        hybrid(other, task, top_k=3, checkpoint=tmp_path)
    # the rule's own options are not part of the identity: stored cells serve any of them
    res = hybrid(model, task, top_k=5, checkpoint=tmp_path)
    assert res.meta["cost"]["reused_cells"] == 3


def test_patch_heads_and_the_cli_checkpoint_the_hybrid(model, task, tmp_path):
    from circuitkit.patching.results import DegenerateBaselineWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "checkpoint is not used" would fail here
        warnings.simplefilter("ignore", DegenerateBaselineWarning)  # (a random model)
        ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                       method="attribution+exact",
                       options=dict(top_k=3, checkpoint=tmp_path, progress=False))
    assert (tmp_path / "hybrid.json").exists() and (tmp_path / "hybrid-screen.json").exists()


def test_batch_size_bounds_every_verification_forward_and_oom_halves_it(model, task,
                                                                       monkeypatch):
    want = hybrid(model, task, top_k=20)
    calls = counting(monkeypatch)
    got = hybrid(model, task, top_k=20, batch_size=3)
    assert max(calls) <= 3
    assert torch.allclose(got.values, want.values, atol=1e-5)
    real = ExactEngine.run_variants
    seen = []

    def oom_when_big(self, layer, variants, p0, p1, fast=None):
        seen.append(len(variants) * (p1 - p0))
        if len(variants) * (p1 - p0) > 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, layer, variants, p0, p1, fast)
    monkeypatch.setattr(ExactEngine, "run_variants", oom_when_big)
    got = hybrid(model, task, top_k=20, batch_size=16)
    assert got.meta["cost"]["oom_backoffs"] == 2 and got.meta["cost"]["rows_per_forward"] == 4
    assert torch.allclose(got.values, want.values, atol=1e-5)
    assert seen[0] == 16 and max(seen[3:]) <= 4


def test_a_plain_callable_metric_works_in_the_hybrid(model, task):
    metric = task.metric
    lam = lambda logits: metric(logits)  # noqa: E731
    a = hybrid(model, task, top_k=4)
    b = hybrid_heads(model, task.clean_tokens, task.corrupt_tokens, lam, top_k=4, progress=False)
    assert torch.allclose(a.values, b.values, atol=1e-5)


def test_max_passes_reachable_checked_and_honest(model, task):
    n = task.clean_tokens.shape[0]
    res = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                         method="attribution+exact", options=dict(max_passes=40.0, progress=False))
    assert res.meta["budget"]["max_passes"] == 40.0
    assert res.meta["cost"]["total_passes"] <= 40.0
    for bad in ("50", 0, float("nan"), True):
        with pytest.raises(ValueError, match="max_passes="):
            hybrid(model, task, max_passes=bad)
    with pytest.raises(ValueError, match="give one of the two"):
        hybrid(model, task, max_passes=40.0, top_k=3)
    with pytest.warns(UserWarning, match="leaves nothing to verify"):
        res = hybrid(model, task, max_passes=2.0 * n)
    assert res.meta["n_verified"] == 0
    with pytest.warns(UserWarning, match="max_passes do nothing|max_passes does nothing"):
        ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                       method="attribution", options=dict(max_passes=40.0, progress=False))


def test_the_exact_reference_cost_is_the_plans(model, task):
    res = hybrid(model, task, top_k=2)
    plan = api.plan_patch(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                          method="exact", options=dict(batch_size=1))
    # the plan counts each chunk's prompts up to its longest read: with one prompt per
    # chunk that is each prompt's own, as the hybrid's reference counts it
    assert res.meta["cost"]["exact_sweep_passes"] == pytest.approx(plan["pass_equivalents"],
                                                                   rel=1e-6)


def test_plan_prices_the_estimator_asked_for(model, task):
    for est in ("atp", "ig", "block"):
        plan = api.plan_patch(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                              method="attribution", options=dict(estimator=est))
        run = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                             method="attribution", options=dict(estimator=est, progress=False))
        assert plan["pass_equivalents"] == pytest.approx(run.meta["pass_equivalents"]), est


def test_attribution_under_torchrun_says_it_is_not_split(model, task, monkeypatch):
    monkeypatch.setattr("circuitkit.patching.distributed.rank_world", lambda: (0, 2))
    with pytest.warns(UserWarning, match="runs whole on every replica"):
        ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                       method="attribution", options=dict(progress=False))


def test_a_damaged_screen_is_screened_again_and_reuse_is_counted_honestly(model, task, tmp_path):
    """A screen file edited or swapped in was used without a word (no checksum), one lacking
    meta crashed; reused_cells counted every stored cell, not the ones this run used."""
    import json

    from safetensors.torch import load_file, save_file

    want = hybrid(model, task, top_k=5, checkpoint=tmp_path)
    st = tmp_path / "hybrid-screen.safetensors"
    tensors = load_file(str(st))
    tensors["values"] = tensors["values"] + 100.0
    save_file(tensors, str(st))
    with pytest.warns(UserWarning, match="modified|was changed"):  # checksum or load's check
        again = hybrid(model, task, top_k=2, checkpoint=tmp_path)
    assert again.meta["cost"]["reused_cells"] == 2  # of the 5 stored
    assert again.meta["verified_cells"] == want.meta["verified_cells"][:2]
    js = tmp_path / "hybrid-screen.json"
    info = json.loads(js.read_text())
    del info["meta"]["write_scale"]
    js.write_text(json.dumps(info))
    # (the file's digest is checked first since issue 49: either refusal screens it again)
    with pytest.warns(UserWarning, match="lacks \\['write_scale'\\]|do not match their 'digest'"):
        hybrid(model, task, top_k=2, checkpoint=tmp_path)
    # atp_star changes nothing for plain AtP: its checkpoint serves both
    hybrid(model, task, top_k=2, estimator="atp", checkpoint=tmp_path / "atp")
    res = hybrid(model, task, top_k=2, estimator="atp", atp_star=True,
                 checkpoint=tmp_path / "atp")
    assert res.meta["cost"]["reused_cells"] == 2


def test_max_passes_that_leaves_nothing_spends_nothing_more(model, task):
    import numpy as np

    screen = hybrid(model, task, top_k=1).meta["cost"]["estimator_passes"]
    with pytest.warns(UserWarning, match="leaves nothing to verify"):
        res = hybrid(model, task, max_passes=float(screen) + 1.0)
    assert res.meta["cost"]["total_passes"] == pytest.approx(screen)  # no cached runs either
    res = hybrid(model, task, max_passes=np.int64(int(screen) + 40))  # numpy numbers are numbers
    assert res.meta["cost"]["total_passes"] <= int(screen) + 40


def test_the_hybrid_called_directly_keeps_the_task_labels(model, task):
    res = hybrid(model, task, top_k=2)
    assert res.meta["task"] == "induction" and res.meta["phase"] == task.phase
