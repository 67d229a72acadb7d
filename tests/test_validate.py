"""Causal validation: ExactEngine.run_head_sets against plain hooked runs, the focus/confusion
PromptMetrics against circuitkit.evaluation, and validate_heads on the planted circuit (known
answer) and on random weights (no difference expected)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from planted_circuit import PLANTED_P1, PLANTED_P2, planted_model, planted_task

import circuitkit as ck
from circuitkit import hooks
from circuitkit.evaluation import confusion_from_logits, focus_from_logits
from circuitkit.patching.engine import ExactEngine
from circuitkit.patching.sweep import Sweep
from circuitkit.scoring.heads import score_heads, top_heads
from circuitkit.scoring.validate import (
    confusion_metric,
    focus_metric,
    random_head_sets,
    validate_heads,
)


@pytest.fixture(scope="module")
def synth():
    # 8 labels under 2 anchors: vocabulary of 34 tokens (fits the 64-token tiny models)
    return ck.load_task("synthetic", n_examples=12, n_labels=8, children=4,
                        labels_per_note=(1, 1), split="test", phase=2)


@pytest.fixture(scope="module")
def planted():
    model, task = planted_model(), planted_task(24)
    return model, task, score_heads(model, task, progress=False)


def reference(model, base, source, head_sets, metric):
    """Per-prompt metric of a plain ``run_with_hooks`` forward of ``base`` with the z of each
    set's heads replaced by the source run's (TransformerLens's own hooked forward)."""
    names = {hooks.z(layer) for s in head_sets for layer, _ in s}
    _, cache = model.run_with_cache(source, names_filter=lambda n: n in names)
    out = []
    for s in head_sets:
        fwd = []
        for layer in sorted({la for la, _ in s}):
            heads = [h for la, h in s if la == layer]

            def hook(z, hook, layer=layer, heads=heads):
                z[:, :, heads] = cache[hooks.z(layer)][:, :, heads]
                return z
            fwd.append((hooks.z(layer), hook))
        with torch.no_grad():
            logits = model.run_with_hooks(base, fwd_hooks=fwd)
        out.append(metric.per_prompt(logits))
    return torch.stack(out)


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gpt2"])
@pytest.mark.parametrize("direction", ["noise", "denoise"])
def test_run_head_sets_equals_hooked_reference(which, direction, synth, request):
    model = request.getfixturevalue(which)
    f = hooks.facts(model)
    clean, corrupt, metric = synth.clean_tokens, synth.corrupt_tokens, synth.metric
    n, seq = clean.shape
    sets = [[], [(0, 1)], [(0, 0), (f.n_layers - 1, 3)], [(1, 2), (1, 0), (0, 3)],
            [(f.n_layers - 1, 1)]]
    # GPT-2: fast=False skips the engine's fast-path probe, which fails there (o(z) of a
    # non-contiguous span, a bug outside run_head_sets); run_head_sets takes the hooked path anyway
    engine = ExactEngine(model, clean, corrupt, metric,
                         Sweep("heads", "z", direction, "all", f.n_layers, f.n_heads, 1, n, seq,
                               True), fast=None if which == "tiny_llama" else False)
    got = engine.run_head_sets(sets, rows=7)  # rows=7: sets split over several forwards
    base, source = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
    want = reference(model, base, source, sets, metric)
    assert got.shape == (1, len(sets), n)
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got[0, 0], engine.base_metric, atol=1e-5, rtol=0)
    # a subset of prompts, two metrics on the same logits
    part = engine.run_head_sets(sets[1:3], p0=3, p1=9,
                                metrics=[metric, confusion_metric(synth)])
    torch.testing.assert_close(part[0], want[1:3, 3:9], atol=1e-5, rtol=0)
    assert part.shape == (2, 2, 6)


def test_run_head_sets_refuses_bad_input(tiny_llama, synth):
    clean, corrupt = synth.clean_tokens, synth.corrupt_tokens
    n, seq = clean.shape
    metric = synth.metric
    engine = ExactEngine(tiny_llama, clean, corrupt, metric,
                         Sweep("heads", "z", "noise", "all", 3, 4, 1, n, seq, True))
    with pytest.raises(ValueError, match="outside the model"):
        engine.run_head_sets([[(3, 0)]])
    with pytest.raises(ValueError, match="reads logit positions outside"):
        engine.run_head_sets([[(0, 0)]], metrics=[focus_metric(synth)])  # anchors, not answers
    pattern = ExactEngine(tiny_llama, clean, corrupt, metric,
                          Sweep("heads", "pattern", "noise", "all", 3, 4, 1, n, seq, True))
    with pytest.raises(ValueError, match="site='z'"):
        pattern.run_head_sets([[(0, 0)]])


def test_focus_and_confusion_metrics_equal_evaluation(tiny_llama, synth):
    with torch.no_grad():
        logits = tiny_llama(synth.clean_tokens)
    for metric, ref in ((focus_metric(synth), focus_from_logits),
                        (confusion_metric(synth), confusion_from_logits)):
        want = ref(logits, synth)
        torch.testing.assert_close(metric.per_prompt(logits), want, atol=1e-6, rtol=0)
        reads = metric.reads  # logits gathered at the read positions only
        at_reads = logits.gather(1, reads[..., None].expand(-1, -1, logits.shape[-1]))
        torch.testing.assert_close(metric.per_prompt(at_reads, at=reads), want, atol=1e-6,
                                   rtol=0)


def test_random_head_sets_keep_layers_and_never_repeat():
    """Sets were drawn with replacement: with 3 distinct sets possible and 20 asked, the
    p-value counted repeats as independent draws (1/21 reported, 1/4 exact)."""
    top = [(0, 1), (2, 3), (2, 0)]
    sets = random_head_sets(top, n_heads=4, n_random=10, seed=1)
    assert len(sets) == 10 and all(sorted(la for la, _ in s) == [0, 2, 2] for s in sets)
    assert all(set(s) != set(top) and len(set(s)) == 3 for s in sets)
    assert len({tuple(s) for s in sets}) == 10  # distinct
    assert sets == random_head_sets(top, n_heads=4, n_random=10, seed=1)  # seeded
    with pytest.warns(UserWarning, match="only 23 random head sets differ"):
        every = random_head_sets(top, n_heads=4, n_random=50, seed=1)
    assert len({tuple(s) for s in every}) == 23 == 4 * 6 - 1  # C(4,1) C(4,2), less the top
    with pytest.raises(ValueError, match="fill whole layers"):
        random_head_sets([(1, 0), (1, 1)], n_heads=2, n_random=3, seed=0)
    with pytest.warns(UserWarning, match="drawn from every layer"):
        wide = random_head_sets([(1, 0), (1, 1)], n_heads=2, n_random=3, seed=0, n_layers=3)
    assert len({tuple(s) for s in wide}) == 3 and all(len(s) == 2 for s in wide)
    assert [(1, 0), (1, 1)] not in wide


def test_planted_heads_far_outside_random(planted):
    model, task, scores = planted
    with pytest.warns(UserWarning, match="random head sets differ from the top set"):
        df = validate_heads(model, task, scores, k=1, n_random=20, seed=0, progress=False)
    assert len(df) == 8
    assert df.attrs["sets"][1]["top"] == [list(PLANTED_P1)]
    assert df.attrs["sets"][2]["top"] == [list(PLANTED_P2)]
    for r in df.itertuples():
        width = r.random_high - r.random_low
        gap = abs(r.clean - r.corrupt)
        assert gap > 0.5 if "margin" in r.quantity else gap > 0.3
        # the planted head alone carries the behaviour: its effect is most of clean - corrupt,
        # and its whole 95% interval lies beyond the random sets' interval by far
        assert abs(r.normalized) > 0.9, r
        if r.top_effect > 0:
            assert r.top_low > r.random_high + 10 * width + 0.1 * gap, r
        else:
            assert r.top_high < r.random_low - 10 * width - 0.1 * gap, r
        # k = 1: the other heads of the planted head's layer are every random set there is
        assert r.n_random == model.cfg.n_heads - 1
        assert r.p_value == pytest.approx(1 / (1 + r.n_random))  # the floor: none as strong
    noise_p1 = df[(df.phase == 1) & (df.direction == "noise") & (df.quantity == "focus")].iloc[0]
    assert noise_p1.top_effect < -0.5  # Reasoning Focus collapses when the anchor head is noised
    noise_p2 = df[(df.phase == 2) & (df.direction == "noise") & (df.quantity == "confusion")]
    assert noise_p2.iloc[0].top_effect > 0.5  # Near-Miss Confusion rises


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_random_weights_top_k_like_random(seed, synth):
    """Random weights: no head set carries a planted behaviour, so the top-k set's effect stays
    near the random sets' interval (within one interval width of it), unlike the planted heads
    (beyond ten widths). It need not lie strictly inside: margin_widening is a direct effect, so
    even in a random network the Phase-2 top set can be the most effective of the 21 sets."""
    from tinymodels import make_model

    model = make_model({"model_type": "llama", "vocab_size": 64, "hidden_size": 64,
                        "intermediate_size": 128, "num_hidden_layers": 3,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
                        "max_position_embeddings": 64, "seed": seed})
    scores = score_heads(model, synth, progress=False)
    df = validate_heads(model, synth, scores, k=3, n_random=20, seed=0, progress=False)
    for r in df.itertuples():
        width = r.random_high - r.random_low
        assert width > 0
        assert r.random_low - width <= r.top_effect <= r.random_high + width, r


def test_validate_refuses_bad_input(planted):
    model, task, scores = planted
    with pytest.raises(ValueError, match="k must be"):
        validate_heads(model, task, scores, k=0, progress=False)
    with pytest.raises(ValueError, match="n_random"):
        validate_heads(model, task, scores, n_random=0, progress=False)
    with pytest.raises(ValueError, match="rows"):
        validate_heads(model, task, scores.head(3), progress=False)


def test_a_task_without_phase1_steps_validates_phase2_only():
    """induction has answers but no anchors: its Phase-1 scores are NaN, so it gets no Phase-1
    ranks (not row order), and validation tests Phase 2 alone (it failed inside the engine)."""
    model = ck.load_model("induction-2l")
    task = ck.load_task("induction", n_examples=6, seed=0)
    scores = ck.score_heads(model, task, progress=False)
    assert scores["coarse_score"].isna().all() and scores["phase1_rank"].isna().all()
    assert sorted(scores["phase2_rank"].tolist()) == list(range(1, len(scores) + 1))
    with pytest.raises(ValueError, match="no phase1_rank"):
        top_heads(scores, 1, 2)
    val = ck.validate_heads(model, task, scores, k=2, n_random=3, progress=False)
    assert set(val["phase"]) == {2} and len(val) == 4


def test_interrupted_validation_resumes_its_finished_runs(planted, tmp_path, monkeypatch):
    """With ``checkpoint``, a validation stopped in its second (phase, direction) run redoes
    only the runs it had not finished, and gives the uninterrupted frame exactly; other head
    sets (another seed) or other weights do not reuse them."""
    model, task, scores = planted
    want = validate_heads(model, task, scores, k=1, n_random=5, seed=0, progress=False)
    calls = []
    real = ExactEngine.run_head_sets

    def counted(self, *a, **k):
        calls.append(1)
        if stop_at and len(calls) == stop_at:
            raise KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(ExactEngine, "run_head_sets", counted)
    stop_at = 0
    validate_heads(model, task, scores, k=1, n_random=5, seed=0, progress=False)
    per_run = len(calls) // 4  # engine calls per (phase, direction)
    calls.clear()
    stop_at = per_run + 1  # the first call of the second run
    with pytest.raises(KeyboardInterrupt):
        validate_heads(model, task, scores, k=1, n_random=5, seed=0, progress=False,
                       checkpoint=tmp_path)
    calls.clear()
    stop_at = 0
    got = validate_heads(model, task, scores, k=1, n_random=5, seed=0, progress=False,
                         checkpoint=tmp_path)
    assert len(calls) == 3 * per_run  # the first run was reused, the other three ran
    pd.testing.assert_frame_equal(got, want)
    calls.clear()
    validate_heads(model, task, scores, k=1, n_random=5, seed=0, progress=False,
                   checkpoint=tmp_path)
    assert not calls  # all four reused
    validate_heads(model, task, scores, k=1, n_random=5, seed=1, progress=False,
                   checkpoint=tmp_path)
    assert len(calls) == 4 * per_run  # other random sets: nothing reused
    calls.clear()
    with torch.no_grad():
        model.blocks[0].attn.W_O.mul_(1.5)  # type: ignore[union-attr]
    try:
        validate_heads(model, task, scores, k=1, n_random=5, seed=0, progress=False,
                       checkpoint=tmp_path)
    finally:
        with torch.no_grad():
            model.blocks[0].attn.W_O.div_(1.5)  # type: ignore[union-attr]
    assert len(calls) == 4 * per_run  # other weights: nothing reused
