"""Causal validation: ExactEngine.run_head_sets (patching and zero / mean / resample ablation)
against plain hooked runs, the focus/confusion/exact-match PromptMetrics against
circuitkit.evaluation and hand arg-maxes, the two random-set pools, and validate_heads /
ablate_heads on planted circuits (known answers: carried by the top heads, or by no head more
than by random ones) and on random weights (no difference expected)."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest
import torch
from planted_circuit import (
    PLANTED_P1,
    PLANTED_P2,
    planted_model,
    planted_task,
    refine_model,
    refine_task,
)

import circuitkit as ck
from circuitkit import hooks
from circuitkit.evaluation import confusion_from_logits, focus_from_logits
from circuitkit.experiments.validation import (
    ABLATION_COLUMNS,
    VALIDATION_COLUMNS,
    ablate_heads,
    confusion_metric,
    exact_match_metric,
    focus_metric,
    random_head_sets,
    validate_heads,
)
from circuitkit.patching.exact import ExactEngine
from circuitkit.patching.sweep import Sweep
from circuitkit.scoring.heads import score_heads, top_heads
from circuitkit.tasks.base import phase_task


@pytest.fixture(scope="module")
def synth():
    # 8 labels under 2 anchors: vocabulary of 34 tokens (fits the 64-token tiny models)
    return ck.load_task("synthetic", n_examples=12, n_labels=8, children=4,
                        labels_per_note=(1, 1), split="test", phase=2)


@pytest.fixture(scope="module")
def planted():
    model, task = planted_model(), planted_task(24)
    # its causal Phase-1 head writes the anchor token's column: the token reading ranks it
    return model, task, score_heads(model, task, progress=False, anchor_directions="tokens")


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
    # tiny_llama is Llama-form: the fused, packed head-set path (checked against the hooked
    # one by its own probe, and here against TransformerLens's hooked forward)
    assert engine._head_sets_fused(None, "source") == (which == "tiny_llama")
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
    q = ExactEngine(tiny_llama, clean, corrupt, metric,
                    Sweep("heads", "q", "noise", "all", 3, 4, 1, n, seq, True))
    with pytest.raises(ValueError, match="site='z' or 'pattern'"):
        q.run_head_sets([[(0, 0)]])
    pattern = ExactEngine(tiny_llama, clean, corrupt, metric,  # (patterns: source runs only)
                          Sweep("heads", "pattern", "noise", "all", 3, 4, 1, n, seq, True))
    with pytest.raises(ValueError, match="source='source'"):
        pattern.run_head_sets([[(0, 0)]], source="zero")


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
    p-value counted repeats as independent draws (1/21 reported, 1/4 exact). Same-layers sets
    now leave the top heads out where their layer has room."""
    top = [(0, 1), (2, 3), (2, 0)]
    sets = random_head_sets(top, n_heads=4, n_random=3, seed=1)
    assert len(sets) == 3 and all(sorted(la for la, _ in s) == [0, 2, 2] for s in sets)
    assert all(not set(s) & set(top) and len(set(s)) == 3 for s in sets)  # disjoint
    assert sets == random_head_sets(top, n_heads=4, n_random=3, seed=1)  # seeded
    with pytest.warns(UserWarning, match="only 3 same-layers random head sets differ"):
        every = random_head_sets(top, n_heads=4, n_random=50, seed=1)
    assert len({tuple(s) for s in every}) == 3 == 3 * 1  # C(3,1) C(2,2): the other heads only
    wide = random_head_sets(top, n_heads=4, n_random=50, seed=1, n_layers=3, pool="all-layers")
    assert len({tuple(s) for s in wide}) == 50 and all(not set(s) & set(top) for s in wide)
    assert {la for s in wide for la, _ in s} == {0, 1, 2}
    with pytest.warns(UserWarning, match="fill every head there"):
        assert random_head_sets([(1, 0), (1, 1)], n_heads=2, n_random=3, seed=0) == []
    with pytest.raises(ValueError, match="n_layers"):
        random_head_sets(top, n_heads=4, n_random=3, seed=0, pool="all-layers")


def test_a_top_five_in_an_eight_head_layer_draws_across_layers_or_states_the_overlap():
    """Top-5 in an 8-head layer: a same-layers 5-set must reuse 2 top heads (it used to share
    2-4 with the top set silently); the frame says so, and the all-layers pool is disjoint."""
    top = [(1, h) for h in range(5)]
    with pytest.warns(UserWarning, match="only 10 same-layers"):
        same = random_head_sets(top, n_heads=8, n_random=20, seed=0)
    assert len(same) == 10  # C(5, 2): which two top heads fill the layer
    assert all({(1, 5), (1, 6), (1, 7)} <= set(s) and len(set(s) & set(top)) == 2 for s in same)
    wide = random_head_sets(top, n_heads=8, n_random=20, seed=0, n_layers=3, pool="all-layers")
    assert len(wide) == 20 and all(not set(s) & set(top) for s in wide)
    assert len({la for s in wide for la, _ in s}) == 3


def test_planted_heads_far_outside_random(planted):
    model, task, scores = planted
    with pytest.warns(UserWarning, match="random head sets differ from the top set"):
        df = validate_heads(model, task, scores, k=1, n_random=20, seed=0,
                            options=dict(progress=False))
    assert list(df.columns) == VALIDATION_COLUMNS and len(df) == 16
    assert df.attrs["sets"][1]["top"] == [list(PLANTED_P1)]
    assert df.attrs["sets"][2]["top"] == [list(PLANTED_P2)]
    for r in df.itertuples():
        width = r.random_high - r.random_low
        gap = abs(r.clean - r.corrupt)
        assert gap > 0.5 if "margin" in r.quantity else gap > 0.3
        # the planted head alone carries the behaviour: its effect is most of clean - corrupt
        assert abs(r.normalized) > 0.9, r
        assert r.overlap == 0  # k = 1: room for disjoint sets in both pools
        # the other heads of the planted head's layer, or of the model: every set there is
        assert r.n_random == (model.cfg.n_heads - 1 if r.pool == "same-layers"
                              else model.cfg.n_layers * model.cfg.n_heads - 1)
        if r.pool == "same-layers":  # nothing else in its layer does it: far outside them
            if r.top_effect > 0:
                assert r.top_low > r.random_high + 10 * width + 0.1 * gap, r
            else:
                assert r.top_high < r.random_low - 10 * width - 0.1 * gap, r
            assert r.p_value == pytest.approx(1 / (1 + r.n_random))  # the floor
    # across layers, the Phase-2 circuit's other heads (its mover L0H2) do as much: the
    # all-layers control can say the planted head is not alone
    p2_all = df[(df.phase == 2) & (df.pool == "all-layers") & (df.direction == "noise")]
    assert (p2_all.p_value >= 2 / 8).all()
    noise_p1 = df[(df.phase == 1) & (df.direction == "noise") & (df.quantity == "focus")].iloc[0]
    assert noise_p1.top_effect < -0.5  # Reasoning Focus collapses when the anchor head is noised
    noise_p2 = df[(df.phase == 2) & (df.direction == "noise") & (df.quantity == "confusion")]
    assert noise_p2.iloc[0].top_effect > 0.5  # Near-Miss Confusion rises


def test_a_top_set_no_better_than_random_gets_a_large_p_value():
    """Eight identical copy heads in layer 1 carry the Phase-2 behaviour together, and the
    layer-0 mover feeds them all: the top-5 (five of the eight) is no better than five other
    heads, so neither pool may call it specific (p >= 0.2), and the same-layers pool says its
    sets share 2 heads with the top set."""
    model, task = refine_model(("copy",) * 8), refine_task(16)
    scores = score_heads(model, task, progress=False, k=5)
    top = top_heads(scores, 2, 5)
    assert {la for la, _ in top} == {1}
    with pytest.warns(UserWarning, match="only 10 same-layers"):
        df = validate_heads(model, task, scores, k=5, n_random=20, seed=0,
                            options=dict(progress=False))
    same = df[df.pool == "same-layers"]
    wide = df[df.pool == "all-layers"]
    assert set(same.overlap) == {2} and set(same.n_random) == {10}
    assert set(wide.overlap) == {0} and set(wide.n_random) == {20}
    assert (df.p_value >= 0.2).all(), df[["pool", "direction", "quantity", "p_value"]]
    sets = df.attrs["sets"][2]["random"]
    assert all(not {tuple(h) for h in s} & set(top) for s in sets["all-layers"])
    # issue 34: the layer-stratified null (the top set's per-layer counts from all of each
    # layer's heads), 200 sets, cannot call it specific either; p comes with its interval
    strat = validate_heads(model, task, scores, k=5, n_random=200, seed=0,
                           options=dict(progress=False, pools=("layer-stratified",)))
    assert set(strat.pool) == {"layer-stratified"} and set(strat.n_random) == {55}  # C(8,5)-1
    assert (strat.p_value >= 0.2).all(), strat[["direction", "quantity", "p_value"]]
    assert ((strat.p_low <= strat.p_value) & (strat.p_value <= strat.p_high)).all()


def test_layer_stratified_pool_and_monte_carlo_interval():
    """layer-stratified sets keep the top set's per-layer counts, are drawn from every head of
    those layers (top heads included), distinct, seeded, never the top set; pools are checked.
    mc_interval is the Clopper-Pearson interval (values from scipy.stats.beta, 1e-9)."""
    from circuitkit.experiments.validation import mc_interval

    top = [(0, 1), (2, 3), (2, 0)]
    sets = random_head_sets(top, n_heads=4, n_random=500, seed=2, n_layers=3,
                            pool="layer-stratified")
    assert len(sets) == 4 * 6 - 1  # C(4,1) C(4,2) minus the top set
    assert len({tuple(s) for s in sets}) == len(sets) and sorted(top) not in sets
    assert all(sorted(la for la, _ in s) == [0, 2, 2] for s in sets)
    assert any(set(s) & set(top) for s in sets)
    assert sets == random_head_sets(top, n_heads=4, n_random=500, seed=2, n_layers=3,
                                    pool="layer-stratified")
    with pytest.raises(ValueError, match="pools="):
        validate_heads(None, None, None, options=dict(pools=("nearby",)))
    for (hits, r), (lo, hi) in {(0, 20): (0.0, 0.16843347098308), (1, 20): (0.00126508949795,
                                0.24873276277203), (10, 20): (0.27195784956079, 0.72804215043921),
                                (50, 1000): (0.03733539760466, 0.06539048791549),
                                (20, 20): (0.83156652901691, 1.0)}.items():
        got = mc_interval(hits, r)
        assert got == pytest.approx((lo, hi), abs=1e-9), (hits, r, got)


@pytest.mark.parametrize("fast", [False, None])
def test_ablation_sources_equal_hand_hooked_runs(tiny_llama, synth, fast):
    """zero / mean / resample ablation through run_head_sets (hooked: fast=False; fused and
    packed: fast=None on this Llama-form model) against a plain run_with_hooks that writes the
    same z by hand (mean: over every prompt's positions up to its last read; resample: the
    engine's derangement of the prompts). atol 1e-5 (float order differs)."""
    from circuitkit.patching.exact import derangement

    model, metric = tiny_llama, synth.metric
    clean = synth.clean_tokens
    n, seq = clean.shape
    f = hooks.facts(model)
    engine = ExactEngine(model, clean, clean, metric,
                         Sweep("heads", "z", "noise", "all", f.n_layers, f.n_heads, 1, n, seq,
                               True), fast=fast)
    for source in ("zero", "mean", "resample"):
        assert engine._head_sets_fused(None, source) == (fast is None)
    sets = [[], [(0, 1)], [(0, 0), (2, 3)], [(1, 2), (2, 0), (2, 1)]]
    names = [hooks.z(la) for la in range(f.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=lambda x: x in names)
    last = metric.reads.max(1).values
    keep = (torch.arange(seq)[None, :] <= last[:, None]).float()
    for source in ("zero", "mean", "resample"):
        got = engine.run_head_sets(sets, p0=2, p1=10, source=source, seed=3)
        perm = derangement(8, 3) + 2
        out = []
        for s in sets:
            fwd = []
            for layer in sorted({la for la, _ in s}):
                heads = [h for la, h in s if la == layer]
                z_all = cache[hooks.z(layer)]
                mean = torch.einsum("nphd,np->hd", z_all.double(), keep.double()) / keep.sum()

                def hook(z, hook, heads=heads, z_all=z_all, mean=mean, source=source,
                         perm=perm):
                    if source == "zero":
                        z[:, :, heads] = 0.0
                    elif source == "mean":
                        z[:, :, heads] = mean[heads].float()
                    else:
                        z[:, :, heads] = z_all[perm][:, :z.shape[1], heads]
                    return z
                fwd.append((hooks.z(layer), hook))
            with torch.no_grad():
                logits = model.run_with_hooks(clean[2:10], fwd_hooks=fwd)
            out.append(metric.select(list(range(2, 10))).per_prompt(logits))
        torch.testing.assert_close(got[0], torch.stack(out), atol=1e-5, rtol=0, msg=source)
    assert not bool((derangement(8, 3) == torch.arange(8)).any())
    with pytest.raises(ValueError, match="source="):
        engine.run_head_sets(sets, source="shuffle")
    with pytest.raises(ValueError, match="at least 2"):
        engine.run_head_sets(sets, p0=0, p1=1, source="resample")


def test_exact_match_metric_is_a_hand_argmax(tiny_llama, synth):
    with torch.no_grad():
        logits = tiny_llama(synth.clean_tokens)
    metric = exact_match_metric(synth)
    lt = synth.label_token_ids
    want = torch.tensor([float(all(int(logits[i, p - 1].argmax()) in lt[e.targets].tolist()
                                   for p in e.answer_pos))
                         for i, e in enumerate(synth.examples)])
    torch.testing.assert_close(metric.per_prompt(logits), want)
    # the planted circuit answers every note right; flipping the logits makes none right
    model, task = planted_model(), planted_task(8)
    with torch.no_grad():
        lg = model(task.clean_tokens)
    assert exact_match_metric(task).per_prompt(lg).tolist() == [1.0] * 8
    assert exact_match_metric(task).per_prompt(-lg).tolist() == [0.0] * 8


def test_ablating_the_planted_phase2_head_raises_confusion_unlike_random_heads(planted):
    model, task, scores = planted
    with pytest.warns(UserWarning, match="random head sets differ"):
        df = ablate_heads(model, task, scores, k=1, n_random=20, seed=0,
                          options=dict(progress=False))
    assert list(df.columns) == ABLATION_COLUMNS
    assert set(df.ablation) == {"zero", "mean", "resample"}
    assert set(df.quantity) == {"exact_match", "confusion", "focus"}
    assert len(df) == 2 * 2 * 3 * 3  # phase x pool x ablation x quantity
    p2 = df[(df.phase == 2) & (df.pool == "same-layers")].set_index(["ablation", "quantity"])
    for ablation in ("zero", "mean", "resample"):
        conf = p2.loc[(ablation, "confusion")]
        assert conf.base < 0.01 and conf.top_effect > 0.4 and conf.top_low > 0.3
        assert abs(conf.random_mean) < 0.01 and conf.p_value == pytest.approx(1 / 4)
        em = p2.loc[(ablation, "exact_match")]
        # (mean ablation writes the average label: a coin flip between the two children)
        assert em.base == 1.0 and em.top_effect < -0.4 and em.top_high < -0.2
        assert p2.loc[(ablation, "focus")].top_effect == pytest.approx(0.0, abs=1e-3)
    # the Phase-1 head's ablation breaks focus, not the answer (the mover carries that)
    p1 = df[(df.phase == 1) & (df.pool == "same-layers")].set_index(["ablation", "quantity"])
    assert p1.loc[("zero", "focus")].top_effect < -0.5
    assert p1.loc[("zero", "exact_match")].top_effect == 0.0


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_random_weights_top_k_like_random(seed, synth):
    """Random weights: no head set carries a planted behaviour, so the top-k set's effect stays
    near the random sets' interval (within one interval width of it), unlike the planted heads
    (beyond ten widths). It need not lie strictly inside: margin_widening is a direct effect, so
    even in a random network the Phase-2 top set can be the most effective of the 21 sets.
    Checked against the all-layers pool: five other heads of one layer (same-layers, disjoint)
    can spread less than the whole model's (seed 1: the Phase-1 top set, L0H0-2 by tie order,
    lies 2.8 same-layer widths out, p = 0.09, and inside the all-layers interval)."""
    from tinymodels import make_model

    model = make_model({"model_type": "llama", "vocab_size": 64, "hidden_size": 64,
                        "intermediate_size": 128, "num_hidden_layers": 3,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
                        "max_position_embeddings": 64, "seed": seed})
    scores = score_heads(model, synth, progress=False)
    df = validate_heads(model, synth, scores, k=3, n_random=20, seed=0,
                        options=dict(progress=False))
    for r in df.itertuples():
        width = r.random_high - r.random_low
        assert width > 0
        if r.pool == "all-layers":
            assert r.random_low - width <= r.top_effect <= r.random_high + width, r


def test_validate_refuses_bad_input(planted):
    model, task, scores = planted
    with pytest.raises(ValueError, match="k must be"):
        validate_heads(model, task, scores, k=0, options=dict(progress=False))
    with pytest.raises(ValueError, match="n_random"):
        validate_heads(model, task, scores, n_random=0, options=dict(progress=False))
    with pytest.raises(ValueError, match="rows"):
        validate_heads(model, task, scores.head(3), options=dict(progress=False))
    with pytest.raises(ValueError, match="selection='bogus'"):
        validate_heads(model, task, scores, options=dict(selection="bogus", progress=False))
    with pytest.raises(ValueError, match="needs the causal columns"):
        validate_heads(model, task, scores, options=dict(selection="causal", progress=False))


def test_a_task_without_phase1_steps_validates_phase2_only():
    """induction has answers but no anchors: its Phase-1 scores are NaN, so it gets no Phase-1
    ranks (not row order), and validation tests Phase 2 alone (it failed inside the engine)."""
    model = ck.load_model("induction-2l")
    task = ck.load_task("induction", n_examples=6, seed=0)
    with pytest.warns(UserWarning, match="no shortlist positions"):
        scores = ck.score_heads(model, task, progress=False)
    assert scores["coarse_score"].isna().all() and scores["phase1_rank"].isna().all()
    # no shortlist to re-read: refine_score is the direct effect on the answer margin
    assert scores["loopback"].isna().all()
    assert scores["refine_score"].tolist() == scores["margin_widening"].tolist()
    assert sorted(scores["phase2_rank"].tolist()) == list(range(1, len(scores) + 1))
    with pytest.raises(ValueError, match="no phase1_rank"):
        top_heads(scores, 1, 2)
    val = ck.validate_heads(model, task, scores, k=2, n_random=3, options=dict(progress=False))
    assert set(val["phase"]) == {2} and len(val) == 8  # 2 pools x 2 directions x 2 quantities


def counting_chunks(monkeypatch, calls: list[int], fail_at: int | None = None) -> None:
    """Count ``HeadSetEngine.run_chunk`` calls (every head-set chunk ``ck.patch`` computes);
    raise KeyboardInterrupt (Ctrl-C) at call ``fail_at``."""
    from circuitkit.patching.exact.set_engine import HeadSetEngine

    # (the engine's own, also when a test counts twice: monkeypatch restores it after the test)
    real = counting_chunks.__dict__.setdefault("real", HeadSetEngine.run_chunk)

    def run_chunk(self, chunk):
        calls.append(1)
        if fail_at is not None and len(calls) == fail_at:
            raise KeyboardInterrupt
        return real(self, chunk)

    monkeypatch.setattr(HeadSetEngine, "run_chunk", run_chunk)


def test_interrupted_validation_resumes_its_finished_chunks(planted, tmp_path, monkeypatch):
    """With ``checkpoint``, a validation stopped mid-way (Ctrl-C in one of its runs' chunks)
    computes only the chunks it had not finished (each run is a ck.patch over HeadSetUnits,
    its chunks saved as they finish), and gives the uninterrupted frame exactly; other head sets
    (another seed) or other weights do not reuse them. A folder of an older validation's files
    is said to be recomputed."""
    model, task, scores = planted
    opts = dict(progress=False, batch_size=12)  # (several chunks per run)
    run = lambda seed=0, **kw: validate_heads(  # noqa: E731
        model, task, scores, k=1, n_random=5, seed=seed, options=dict(opts, **kw))
    want = run()
    calls: list[int] = []
    counting_chunks(monkeypatch, calls)
    run()
    total = len(calls)
    run(seed=1)
    total_seed1 = len(calls) - total
    assert total > 8 and total_seed1 > 0
    calls.clear()
    counting_chunks(monkeypatch, calls, fail_at=total // 2)
    (tmp_path / "validation-0123abcd.safetensors").write_bytes(b"old")
    with pytest.warns(UserWarning, match="older circuitkit"), \
            pytest.raises(KeyboardInterrupt):
        run(checkpoint=tmp_path)
    saved = len(list(tmp_path.glob("*/chunk_*.safetensors")))
    assert saved == total // 2 - 1  # every chunk finished before Ctrl-C
    calls.clear()
    counting_chunks(monkeypatch, calls)
    got = run(checkpoint=tmp_path)
    assert len(calls) == total - saved  # only the chunks not finished
    pd.testing.assert_frame_equal(got, want)
    calls.clear()
    run(checkpoint=tmp_path)
    assert not calls  # all reused
    run(seed=1, checkpoint=tmp_path)
    assert len(calls) == total_seed1  # other random sets: nothing reused
    calls.clear()
    with torch.no_grad():
        model.blocks[0].attn.W_O.mul_(1.5)  # type: ignore[union-attr]
    try:
        run(checkpoint=tmp_path)
    finally:
        with torch.no_grad():
            model.blocks[0].attn.W_O.div_(1.5)  # type: ignore[union-attr]
    assert len(calls) == total  # other weights: nothing reused


def test_interrupted_ablation_resumes_its_finished_chunks(planted, tmp_path, monkeypatch):
    """ablate_heads stopped mid-way (Ctrl-C in a chunk) computes only its unfinished chunks on
    the rerun and gives the uninterrupted frame exactly (resample included: its pairing does
    not depend on the chunks)."""
    model, task, scores = planted
    run = lambda **kw: ablate_heads(  # noqa: E731
        model, task, scores, k=1, n_random=4, ablations=("zero", "resample"),
        options=dict(progress=False, batch_size=16, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = run()
        calls: list[int] = []
        counting_chunks(monkeypatch, calls)
        run()
        total = len(calls)
        calls.clear()
        counting_chunks(monkeypatch, calls, fail_at=total - 2)
        with pytest.raises(KeyboardInterrupt):
            run(checkpoint=tmp_path)
        calls.clear()
        counting_chunks(monkeypatch, calls)
        got = run(checkpoint=tmp_path)
    assert len(calls) == 3 and len(list(tmp_path.glob("*/chunk_*.safetensors"))) == total
    pd.testing.assert_frame_equal(got, want)


def _mutate(path, rng):
    """One seeded mutation of a head-set sweep's checkpoint chunk file: its kind."""
    import json as _json

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta, values = dict(f.metadata()), f.get_tensor("values")
    kind = rng.choice(["scalar", "shape", "dtype", "int", "nan", "inf", "edit", "key",
                       "no-key", "no-sha", "chunk", "rename", "truncate", "empty"])
    tensors = {"values": values}
    if kind == "scalar":
        tensors = {"values": torch.tensor(0.5)}
    elif kind == "shape":
        tensors = {"values": torch.cat([values, values[:1]]).contiguous()}
    elif kind == "dtype":
        tensors = {"values": values.double()}
    elif kind == "int":
        tensors = {"values": values.round().int()}
    elif kind in ("nan", "inf"):
        bad = values.clone()
        bad.view(-1)[rng.randrange(bad.numel())] = float(kind)
        tensors = {"values": bad}
    elif kind == "edit":  # a plausible value, the checksum kept
        bad = values.clone()
        bad.view(-1)[rng.randrange(bad.numel())] += rng.choice([0.5, -0.25, 1e-3])
        tensors = {"values": bad}
    elif kind == "key":
        meta["sweep"] = "0" * 16
    elif kind == "no-key":
        meta.pop("sweep")
    elif kind == "no-sha":
        meta.pop("sha256")
    elif kind == "chunk":  # another chunk's file under this one's name
        meta["chunk"], meta["plan"] = "999", _json.dumps([0, 0, 1, 0, 1])
    elif kind == "rename":
        tensors = {"runs": values}
    if kind in ("truncate", "empty"):
        data = path.read_bytes()
        path.write_bytes(data[:rng.randrange(1, len(data))] if kind == "truncate" else b"")
        return kind
    save_file(tensors, str(path), metadata=meta)
    return kind


def test_validation_checkpoints_are_verified_fuzzed(planted, tmp_path):
    """Issue 33 item 9: each validation/ablation checkpoint file is checked before reuse: the
    sweep checkpoint's chunk files (their sweep's key, chunk id and plan, one float32 tensor of
    the chunk's shape, SHA-256). A seeded mutator (types, ranges, shapes, swaps, truncation)
    damages one stored file at a time; the rerun names the file in a warning and recomputes
    it, giving the undamaged frames exactly."""
    import random as _random

    model, task, scores = planted

    def both():
        v = validate_heads(model, task, scores, k=1, n_random=3,
                           options=dict(progress=False, checkpoint=tmp_path))
        a = ablate_heads(model, task, scores, k=1, n_random=3, ablations=("zero",),
                         options=dict(progress=False, checkpoint=tmp_path))
        return v, a

    want = both()
    assert len(list(tmp_path.iterdir())) == 4 + 2  # 2 phases x 2 directions, 2 x 1 ablation
    stored = sorted(tmp_path.glob("*/chunk_*.safetensors"))
    originals = {p: p.read_bytes() for p in stored}
    rng = _random.Random(0)
    seen = set()
    for _ in range(20):
        path = rng.choice(stored)
        seen.add(_mutate(path, rng))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = both()
        said = [str(w.message) for w in caught if "checkpoint chunk" in str(w.message)]
        assert len(said) == 1 and str(path) in said[0], said
        pd.testing.assert_frame_equal(got[0], want[0])
        pd.testing.assert_frame_equal(got[1], want[1])
        assert path.read_bytes() != b""  # rewritten by the recomputation
        for p, data in originals.items():
            p.write_bytes(data)
    assert len(seen) >= 10, seen
    with warnings.catch_warnings(record=True) as caught:  # undamaged files: reused silently
        warnings.simplefilter("always")
        got = both()
    assert not [w for w in caught if "checkpoint chunk" in str(w.message)]


def test_teacher_forced_exact_match_equals_greedy_where_greedy_follows_the_note():
    """The ablation's exact match is decided from one teacher-forced pass (every answer step's
    arg-max a target of the note). On the teacher (64 seeded test notes), wherever the greedy
    decode (``evaluation.greedy_decode``, the hooked model) reproduces the note up to its first
    answer step, it equals greedy exact match (``evaluate``'s: predicted set == targets) note
    for note; elsewhere greedy wrote its own shortlist and the two measure different things
    (docs/scores.md)."""
    from circuitkit import evaluation as ev
    from circuitkit.tasks.base import phase_task

    model = ck.load_model("icd-teacher")
    task = phase_task(ck.load_task("icd10", n_examples=64, seed=0, split="test"), 2)
    think = task.vocab.index("<think>")
    ends = [ev.prompt_end(e, think) for e in task.examples]
    with torch.no_grad():
        tf = exact_match_metric(task).per_prompt(model(task.clean_tokens))
    gens = ev.greedy_decode(model, [e.tokens[:n] for e, n in zip(task.examples, ends,
                                                                  strict=True)],
                            task.eos_id, 40)
    greedy = torch.tensor([float(ev.parse_answer(g, task) == set(e.targets))
                           for g, e in zip(gens, task.examples, strict=True)])
    follows = torch.tensor([g[:min(e.answer_pos) - n] == e.tokens[n:min(e.answer_pos)].tolist()
                            for g, e, n in zip(gens, task.examples, ends, strict=True)])
    assert 8 <= int(follows.sum()) < len(task)  # both kinds of note occur
    assert torch.equal(tf[follows], greedy[follows])


def test_a_wrong_fused_head_set_path_is_caught_by_its_probe(synth, monkeypatch):
    """The fused head-set path is compared with the hooked one once per model and source: a
    deliberately wrong one (the set's heads never written) is found, warned about, and the
    hooked path gives the right values."""
    from tinymodels import TINY_LLAMA, make_model

    from circuitkit.patching.exact import head_sets

    model = make_model(TINY_LLAMA)  # a fresh object: its own fast-path verdicts
    clean, corrupt, metric = synth.clean_tokens, synth.corrupt_tokens, synth.metric
    n, seq = clean.shape
    f = hooks.facts(model)
    monkeypatch.setattr(head_sets, "_written", lambda z, which, src, d_head: z)
    engine = ExactEngine(model, clean, corrupt, metric,
                         Sweep("heads", "z", "noise", "all", f.n_layers, f.n_heads, 1, n, seq,
                               True))
    sets = [[], [(0, 1)], [(0, 0), (f.n_layers - 1, 3)]]
    with pytest.warns(UserWarning, match="fused head-set path differs"):
        got = engine.run_head_sets(sets)
    assert not engine._head_sets_fused(None, "source")
    torch.testing.assert_close(got[0], reference(model, clean, corrupt, sets, metric),
                               atol=1e-5, rtol=0)


def test_progress_bars_count_set_prompts_to_a_total_fixed_up_front(planted, monkeypatch):
    """Issue 36 item 12: the validate bar's total jumped mid-run (21504 -> 18176) when fewer
    distinct random sets existed than asked. Every run is now a head-set sweep whose bar counts
    (set, prompt) rows to a total fixed before its first chunk: it never changes and is reached
    exactly; together they count every set of every run on every prompt."""
    import circuitkit._progress  # every circuitkit bar is made from its class

    model, task, scores = planted
    bars = []

    class Recorder:
        def __init__(self, total, desc, **kw):
            self.total, self.desc, self.n, self.totals = total, desc, 0, [total]
            bars.append(self)

        def update(self, n):
            self.n += n
            self.totals.append(self.total)

        def close(self):
            pass

    monkeypatch.setattr(circuitkit._progress, "tqdm", Recorder)
    with pytest.warns(UserWarning, match="random head sets differ"):
        val = validate_heads(model, task, scores, k=1, n_random=50,
                             options=dict(progress=True))
        abl = ablate_heads(model, task, scores, k=1, n_random=50, ablations=("zero", "mean"),
                           options=dict(progress=True))
    assert [b.desc for b in bars] == ["head sets z noise", "head sets z denoise"] * 2 + [
        "head sets z noise"] * 4
    for b in bars:
        assert len(set(b.totals)) == 1 and b.n == b.total > 0, (b.desc, b.totals[:3], b.n)
    rows = [len({tuple(map(tuple, s)) for s in [[], val.attrs["sets"][p]["top"], *(
        s for rs in val.attrs["sets"][p]["random"].values() for s in rs)]})
        * len(phase_task(task, p)) for p in (1, 2)]  # (each distinct set once)
    assert [b.total for b in bars[:4]] == [rows[0]] * 2 + [rows[1]] * 2
    n_abl = int(abl["n_prompts"].iloc[0])
    assert [b.total for b in bars[4:]] == [
        (2 + sum(map(len, abl.attrs["sets"][p]["random"].values()))) * n_abl
        for p in (1, 2) for _ in range(2)]
