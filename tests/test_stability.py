"""Stability and nulls (issue 45): bootstrap inclusion of a top set's heads and the layer-matched
p-value, each reproduced by a hand computation on a fixed sample; the stable core and its
"one of"; the claims table's verdicts, including "not testable here" for note-editing
corruptions."""

from __future__ import annotations

import itertools
import warnings

import pandas as pd
import pytest
import scipy.stats
import torch

import circuitkit as ck
from circuitkit import hooks
from circuitkit.experiments.claims import claims
from circuitkit.experiments.stability import bootstrap_inclusion, core_phrase, stable_core
from circuitkit.experiments.validation import validate_heads
from circuitkit.tasks.base import phase_task


def test_bootstrap_inclusion_is_a_hand_resample_rank_and_count():
    """Resample the prompts with replacement (the same seeded draws), re-rank the heads by their
    resampled mean with plain Python, count how often each is in the top k."""
    g = torch.Generator().manual_seed(3)
    n, units, k, n_boot, seed = 9, 6, 2, 200, 5
    values = torch.randn(n, units, generator=g, dtype=torch.float64)
    values[:, 4] += 2.0  # a clear first head, a rotating second slot
    values[:, 1] += 0.3
    values[:, 2] += 0.3
    got = bootstrap_inclusion(values, k, n_boot=n_boot, seed=seed)
    draws = torch.randint(0, n, (n_boot, n), generator=torch.Generator().manual_seed(seed))
    counts = [0] * units
    rows = values.tolist()
    for b in range(n_boot):
        idx = draws[b].tolist()
        means = [sum(rows[i][u] for i in idx) / n for u in range(units)]
        for u in sorted(range(units), key=lambda u: (-means[u], u))[:k]:
            counts[u] += 1
    assert got.tolist() == pytest.approx([c / n_boot for c in counts], abs=1e-12)
    assert got[4] == got.max() and 0 < got[1] < 1 and abs(float(got.sum()) - k) < 1e-9


def test_a_rotating_set_is_its_stable_core_plus_one_of():
    names = ["L0H0", "L0H1", "L0H2", "L0H3", "L0H4", "L0H5", "L0H7"]
    inc = [0.97, 0.73, 1.0, 0.05, 0.92, 0.99, 0.12]
    core = stable_core(names, inc, top=[2, 5, 0, 4, 1])
    assert [n for n, _ in core["core"]] == ["L0H2", "L0H5", "L0H0", "L0H4"]
    assert core["slots"] == 1 and [n for n, _ in core["one_of"]] == ["L0H1", "L0H7"]
    assert core_phrase(core) == ("L0H2 (1.00), L0H5 (0.99), L0H0 (0.97), L0H4 (0.92) plus 1 "
                                 "of L0H1 (0.73), L0H7 (0.12)")
    full = stable_core(names, [1.0] * 7, top=[0, 1])
    assert full["slots"] == 0 and full["one_of"] == [] and "plus" not in core_phrase(full)


def _hand_effects(model, base, source, sets, metric):
    """Mean metric change of patching each set's z from ``source`` into ``base``, by plain
    TransformerLens hooks (no circuitkit engine): test_validate's hooked reference."""
    from test_validate import reference

    with torch.no_grad():
        base_v = metric.per_prompt(model(base)).double()
        return [float((v.double() - base_v).mean())
                for v in reference(model, base, source, sets, metric)]


def test_the_layer_matched_p_is_a_hand_count_over_every_set_of_the_same_layers(tiny_llama):
    """The top set {L1H0, L1H2}: the layer-matched pool is every other pair of layer 1's 4
    heads (5 sets, all used: exact); p = (1 + #{|effect_r| >= |effect_top|}) / 6 from hand-hooked
    effects, and its interval is Clopper-Pearson (scipy's beta quantiles)."""
    task = ck.load_task("synthetic", n_examples=10, n_labels=8, children=4,
                        labels_per_note=(1, 1), split="test", seed=4)
    f = hooks.facts(tiny_llama)
    scores = pd.DataFrame(dict(layer=[la for la in range(f.n_layers) for _ in range(f.n_heads)],
                               head=[h for _ in range(f.n_layers) for h in range(f.n_heads)]))
    rank = [5 + i for i in range(len(scores))]
    rank[1 * f.n_heads + 0], rank[1 * f.n_heads + 2] = 1, 2
    scores["phase1_rank"] = scores["phase2_rank"] = rank
    with pytest.warns(UserWarning, match="only 5 layer-stratified"):
        val = validate_heads(tiny_llama, task, scores, k=2, n_random=50,
                             options=dict(progress=False, pools=("layer-stratified",)))
    top = [(1, 0), (1, 2)]
    others = [list(s) for s in itertools.combinations([(1, h) for h in range(4)], 2)
              if list(s) != top]
    for phase in (1, 2):
        tp = phase_task(task, phase)
        used = val.attrs["sets"][phase]["random"]["layer-stratified"]
        assert sorted(map(lambda s: [tuple(h) for h in s], used)) == sorted(others)
        for direction, (base, source) in (("noise", (tp.clean_tokens, tp.corrupt_tokens)),
                                          ("denoise", (tp.corrupt_tokens, tp.clean_tokens))):
            e = _hand_effects(tiny_llama, base, source, [top, *others], tp.metric)
            hits = sum(abs(x) >= abs(e[0]) - 1e-6 * max(1, abs(e[0])) for x in e[1:])
            row = val[(val["phase"] == phase) & (val["direction"] == direction)
                      & (val["quantity"] == tp.metric.name)].iloc[0]
            assert row["top_effect"] == pytest.approx(e[0], abs=2e-5)
            assert row["random_mean"] == pytest.approx(sum(e[1:]) / 5, abs=2e-5)
            assert row["p_value"] == pytest.approx((1 + hits) / 6, abs=1e-12)
            lo = 0.0 if hits == 0 else scipy.stats.beta.ppf(0.025, hits, 5 - hits + 1)
            hi = 1.0 if hits == 5 else scipy.stats.beta.ppf(0.975, hits + 1, 5 - hits)
            assert (row["p_low"], row["p_high"]) == pytest.approx((lo, hi), abs=1e-8)


def _phase(edited=False, early=(0.5, 0.4, 0.6), answer=(0.3, 0.2, 0.4), core=("L0H1",)):
    tri = lambda t: dict(share=t[0], low=t[1], high=t[2])  # noqa: E731
    return dict(direction="noise", metric="m", n_layers=6, n_heads=4, note_edited=edited,
                where=dict(n_held=64, n_select=64, chosen=[]),
                depth=dict(early=tri(early)), mid_late_at_answer=tri(answer),
                heads=dict(top=list(core), core=dict(core=[[c, 1.0] for c in core], slots=0,
                                                     one_of=[], rotate_min=0.1)),
                by_phase1_heads=tri((0.02, 0.0, 0.05)))


def test_claims_say_not_testable_for_a_note_editing_corruption_and_decide_otherwise():
    pic = dict(phase1=_phase(), phase2=_phase(core=("L4H2",)))
    rows = {r["claim"]: r for r in claims(pic)}
    assert rows["early-phase1"]["verdict"] == "reproduced" and rows["early-phase1"]["n"] == 64
    assert rows["late-phase2"]["verdict"] == "reproduced"
    assert rows["separate-heads"]["verdict"] == "reproduced"
    assert rows["distill"]["verdict"] == "not testable here"
    assert "finds a share >=" in rows["early-phase1"]["power"]
    edited = dict(phase1=_phase(edited=True), phase2=_phase(edited=True, core=("L0H1",)))
    rows = {r["claim"]: r for r in claims(edited)}
    for key in ("early-phase1", "late-phase2", "separate-heads"):
        assert rows[key]["verdict"] == "not testable here" and "edits the note" in \
            rows[key]["evidence"]
    low = dict(phase1=_phase(early=(0.02, 0.0, 0.05)), phase2=_phase(answer=(0.1, 0.02, 0.3),
                                                                      core=("L0H1",)))
    rows = {r["claim"]: r for r in claims(low)}
    assert rows["early-phase1"]["verdict"] == "refuted"
    assert rows["late-phase2"]["verdict"] == "undecided"
    assert rows["separate-heads"]["verdict"] == "refuted"  # L0H1 in both stable cores


@pytest.mark.slow
def assert_frames_close(a: pd.DataFrame, b: pd.DataFrame, ulps: int = 256) -> None:
    """Equal frames, float columns within ``ulps`` float32 epsilons of the column's scale: sums
    taken in another order (shared runs vs one call, 1 vs 2 threads, another CPU) differ by
    ~3e-5 relative in a float32 ``normalized`` (FIELD-NOTES), so 1e-5 fails elsewhere."""
    assert list(a.columns) == list(b.columns) and len(a) == len(b)
    eps = float(torch.finfo(torch.float32).eps)
    for col in a.columns:
        x, y = a[col], b[col]
        if pd.api.types.is_float_dtype(x):
            tol = ulps * eps * max(1.0, float(pd.concat([x, y]).abs().max(skipna=True) or 0))
            assert ((x - y).abs() <= tol).all() or x.isna().equals(y.isna()) and \
                ((x - y).abs().fillna(0) <= tol).all(), (col, (x - y).abs().max(), tol)
        else:
            assert x.tolist() == y.tolist(), col


def test_the_frame_tolerance_can_fail():
    a = pd.DataFrame(dict(v=[-0.21163159, 1.0], name=["x", "y"]))
    assert_frames_close(a, a.assign(v=[-0.21162541, 1.0]))  # 2.9e-5 relative: same sums
    with pytest.raises(AssertionError):
        assert_frames_close(a, a.assign(v=[-0.2118, 1.0]))  # 8e-4: a real difference
    with pytest.raises(AssertionError):
        assert_frames_close(a, a.assign(name=["x", "z"]))


def test_two_selections_in_shared_runs_equal_their_own_calls(tiny_llama):
    """validate_selections runs the score and the causal top sets' distinct sets in one run per
    (phase, direction); each frame equals its own validate_heads call."""
    from circuitkit.experiments.validation import validate_selections

    task = ck.load_task("synthetic", n_examples=8, n_labels=8, children=4,
                        labels_per_note=(1, 1), split="test", seed=6)
    f = hooks.facts(tiny_llama)
    n = f.n_layers * f.n_heads
    scores = pd.DataFrame(dict(layer=[la for la in range(f.n_layers) for _ in range(f.n_heads)],
                               head=[h for _ in range(f.n_layers) for h in range(f.n_heads)]))
    g = torch.Generator().manual_seed(1)
    for col in ("phase1_rank", "phase2_rank", "p1_noise_rank_all", "p2_noise_rank_all"):
        scores[col] = (torch.randperm(n, generator=g) + 1).tolist()
    pools = {"score": ("layer-stratified", "all-layers"), "causal": ("all-layers",
                                                                      "layer-stratified")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a pool with fewer distinct sets than asked says so)
        both = validate_selections(tiny_llama, task, scores, pools, k=2, n_random=6,
                                   options=dict(progress=False))
        for sel in pools:
            alone = validate_heads(tiny_llama, task, scores, k=2, n_random=6,
                                   options=dict(progress=False, pools=("layer-stratified",),
                                                selection=sel))
            mine = both[sel][both[sel]["pool"] == "layer-stratified"].reset_index(drop=True)
            assert_frames_close(mine, alone)
    for phase in (1, 2):  # one all-layers pool, free of both top sets
        got = [both[s].attrs["sets"][phase] for s in pools]
        assert got[0]["random"]["all-layers"] == got[1]["random"]["all-layers"]
        tops = {tuple(h) for g in got for h in g["top"]}
        assert all(not tops & {tuple(h) for h in s} for s in got[0]["random"]["all-layers"])


def test_the_findings_lead_with_where_each_phase_is_decided_and_the_claims():
    from circuitkit.experiments.findings import findings, format_findings

    tri = dict(share=0.5, low=0.4, high=0.6)
    ph = _phase(edited=True)
    ph["where"]["chosen"] = [dict(layer=0, group="anchor", selection=0.6, share=0.55, low=0.5,
                                  high=0.6)]
    ph["heads"]["top_share"] = tri
    ph["heads"]["core"]["top"] = [["L0H1", 1.0]]
    pic = dict(k=1, held_out=True, phase1=ph)
    summary = dict(phases=[1], lead=pic, claims=claims(pic))
    found = findings(summary)
    assert [f.phase for f in found[:2]] == ["lead1", "claims"]
    text = " ".join(format_findings(found).split())  # (unwrapped)
    assert "Layer 0 at the anchor positions carries 55% [50%, 60%]" in text
    assert "edits the note" in text and "NOT TESTABLE HERE" in text
    assert text.index("where the decision is made") < text.index("The paper's claims")


@pytest.mark.slow
def test_a_sequential_validation_stops_a_settled_pool_and_equals_a_shorter_draw(monkeypatch):
    """sequential=True: a pool whose every p-value's Monte Carlo interval lies on one side of
    ALPHA_SETTLED stops at the first checkpoint; its rows equal validate_heads with that many
    sets (one seeded sequence of draws); a pool not settled runs all its sets. On the planted
    circuit (k = 1): the planted heads beat every other head of their layer (settled early);
    Phase 2's all-layers pool holds its mover, as strong (not settled: all 7 sets)."""
    from planted_circuit import planted_model, planted_task

    from circuitkit.experiments import validation as validate
    from circuitkit.scoring.heads import score_heads

    model, task = planted_model(), planted_task(24)
    scores = score_heads(model, task, progress=False, anchor_directions="tokens")
    monkeypatch.setattr(validate, "SEQUENTIAL", (3,))
    monkeypatch.setattr(validate, "ALPHA_SETTLED", 0.9)  # (0 hits of 3: interval [0, 0.71])
    pools = ("all-layers", "same-layers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seq = validate.validate_selections(model, task, scores, {"score": pools}, k=1,
                                           n_random=7, options=dict(progress=False,
                                                                    sequential=True))["score"]
        used = {(int(r.phase), r.pool): int(r.n_random) for r in seq.itertuples()}
        assert used[(2, "all-layers")] == 7 and used[(1, "all-layers")] == 3
        for (phase, pool), m in used.items():
            ref = validate_heads(model, task, scores, k=1, n_random=m,
                                 options=dict(progress=False, pools=(pool,)))
            ref = ref[ref["phase"] == phase].reset_index(drop=True)
            mine = seq[(seq["phase"] == phase) & (seq["pool"] == pool)].reset_index(drop=True)
            pd.testing.assert_frame_equal(mine, ref, rtol=1e-5, atol=1e-6)
            if m < 7 and pool == "all-layers":  # stopped early: settled
                assert ((mine["p_high"] < 0.9) | (mine["p_low"] > 0.9)).all()
