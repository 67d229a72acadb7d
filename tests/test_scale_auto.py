"""method="auto": exact below the cost threshold (with the screening recall it would have had),
attribution then exact above it (which cells were verified), on a tiny 8:1 GQA Llama."""

from __future__ import annotations

import pytest
import torch
from _scale import TINY_GQA8, induction
from tinymodels import attribution_heads
from typer.testing import CliRunner

import circuitkit as ck
from circuitkit.cli import app
from circuitkit.patching import api
from circuitkit.patching import cost as P
from circuitkit.patching.estimators import attribution
from circuitkit.patching.estimators.attribution import SCREENING_ESTIMATOR


@pytest.fixture(scope="module")
def model():
    return ck.load_model(dict(TINY_GQA8, seed=1))


@pytest.fixture(scope="module")
def task():
    return induction(n=4, seed=5)


@pytest.fixture(scope="module")
def exact(model, task):
    return ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                          options=dict(progress=False))


def topk(effect: torch.Tensor, k: int) -> set[tuple[int, int]]:
    flat = effect.abs().flatten().topk(k).indices
    return {(int(i) // effect.shape[1], int(i) % effect.shape[1]) for i in flat}


def test_small_model_runs_exact_and_reports_screening_recall(model, task, exact):
    res = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric, method="auto",
                         options=dict(top_k=5, progress=False, screening_recall=True))
    auto = res.meta["auto"]
    n_params = sum(p.numel() for p in model.parameters())
    assert auto["chose"] == "exact" and res.method == "exact"
    assert auto["exact_flops_per_token"] == pytest.approx(2 * n_params * 16 * (2 + 1) / 2)
    assert torch.equal(res.values, exact.values)
    # recall by hand: the exact top 5 against the screening estimator's top 5
    screen = attribution_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                               estimator=SCREENING_ESTIMATOR, progress=False)
    want = topk(exact.values - exact.corrupt, 5)
    got = topk(screen.values - exact.corrupt, 5)
    sc = auto["screening"]
    assert sc["k"] == 5 and sc["estimator"] == SCREENING_ESTIMATOR
    assert {tuple(c) for c in sc["exact_top"]} == want
    assert {tuple(c) for c in sc["screen_top"]} == got
    assert sc["recall"] == len(want & got) / 5
    assert auto["verified"] == "all"


def test_auto_runs_no_extra_screen_unless_the_recall_is_asked_for(model, task, exact,
                                                                  monkeypatch):
    """The recall report's screen doubled the default's time on a small model: opt-in."""
    calls = []
    real = attribution.estimate_heads  # (what the entry's checked arguments go through)

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr("circuitkit.patching.estimators.attribution.estimate_heads", counted)
    res = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric, method="auto",
                         options=dict(top_k=5, progress=False))
    assert not calls and res.meta["auto"]["screening"]["recall"] is None
    assert "screening_recall=True" in res.meta["auto"]["screening"]["skipped"]
    assert torch.equal(res.values, exact.values)
    ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric, method="auto",
                   options=dict(top_k=5, progress=False, screening_recall=True))
    assert len(calls) == 1


def test_above_the_threshold_screens_then_verifies(model, task, exact, monkeypatch):
    monkeypatch.setattr(P, "AUTO_EXACT_MAX_FLOPS_PER_TOKEN", 0.0)  # as if it were 70B
    res = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric, method="auto",
                         options=dict(top_k=6, progress=False))
    auto = res.meta["auto"]
    assert auto["chose"] == "attribution+exact" and res.method == "attribution+exact"
    cells = [tuple(c) for c in auto["verified"]]
    assert len(cells) == 6 and auto["screening"]["recall"] is None
    mask = api.verified_mask(res)
    assert int(mask.sum()) == 6 and all(mask[c] for c in cells)
    for c in cells:  # a verified cell holds the exact value
        assert res.values[c] == pytest.approx(float(exact.values[c]), abs=1e-5)
    # the verified cells are the screen's top 6 by |estimate - corrupt|
    est = torch.tensor(res.meta["attribution_values"])
    assert set(cells) == topk(est - res.corrupt, 6)


def test_layer_sites_take_auto_as_exact(model, task):
    res = ck.patch_layers(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                          method="auto", options=dict(progress=False))
    assert res.method == "exact" and res.values.shape == (2, task.clean_tokens.shape[1])


def test_cli_default_is_auto_and_says_what_it_chose(tmp_path):
    r = CliRunner().invoke(app, ["patch", "--model", "induction-2l", "--task", "induction",
                                 "-n", "4", "--top-k", "3", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    saved = ck.PatchResult.load(tmp_path / "o")
    assert saved.meta["auto"]["chose"] == "exact"
    assert saved.meta["auto"]["screening"]["recall"] is None  # no extra screen by default
    said = " ".join(r.output.split())  # plain words, not "screening recall"
    assert "method auto chose exact: patching every cell exactly costs" in said
    assert "would have put" not in said
