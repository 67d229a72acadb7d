"""Issue 47: the paper's score forms against a hand formula on a tiny model, and each instrument
against a null built from what it must not measure (planted heads)."""

from __future__ import annotations

import pytest
import torch

import circuitkit as ck
from circuitkit import hooks
from circuitkit.scoring import coarse, refine
from circuitkit.scoring.heads import COLUMNS, evidence_groups, score_heads


@pytest.fixture(scope="module")
def synth():
    return ck.load_task("synthetic", n_examples=10, n_labels=12, children=4,
                        labels_per_note=(1, 2), split="test", phase=2)


# --- the paper's score forms ----------------------------------------------------------------
@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gpt2"])
def test_paper_scores_equal_a_hand_formula_on_a_tiny_model(which, synth, request):
    """``coarse_score_paper`` = mean over a note's anchor steps of scipy's excess kurtosis of the
    pattern row times cos(hook_result, the anchor's uncentred label centroid), then over notes;
    ``refine_score_paper`` = the same mean of (pattern mass on the shortlist - on near-miss
    entries) x <hook_result, d margin / d x>, the gradient taken by autograd through the
    model's own forward from ``ln_final.hook_in`` to its logits (a perturbation added there)."""
    stats = pytest.importorskip("scipy.stats")
    model = request.getfixturevalue(which)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    df = score_heads(model, synth, progress=False, n_boot=0)
    assert list(df.columns) == COLUMNS
    tokens = synth.clean_tokens
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    # the gradient of every position's margin w.r.t. the final residual, through the model
    delta = torch.zeros(*tokens.shape, model.cfg.d_model, requires_grad=True)
    with model.hooks(fwd_hooks=[(hooks.FINAL_NORM_IN, lambda x, hook: x + delta)]):
        logits = model(tokens)
    lt, W_U = synth.label_token_ids, model.W_U.detach()
    total = 0
    for b, e in enumerate(synth.examples):
        near = lt[e.near_misses]
        for p in e.answer_pos:
            total = total + logits[b, p - 1, int(e.tokens[p])] - logits[b, p - 1, near].mean()
    (grad,) = torch.autograd.grad(total, delta)
    cent = torch.stack([W_U[:, lt[synth.label_anchor == a]].mean(1)
                        for a in range(len(synth.anchor_token_ids))], 1)  # uncentred
    want = {c: torch.zeros(L, H, dtype=torch.float64) for c in ("coarse_score_paper",
                                                                 "refine_score_paper")}
    for b, e in enumerate(synth.examples):
        for j, p in enumerate(e.anchor_pos):
            q, c = p - 1, e.anchors[j]
            for lay in range(L):
                res = cache[hooks.result(lay)][b, q]  # [H, D]
                cos = torch.nn.functional.cosine_similarity(res, cent[:, c][None], dim=-1)
                for h in range(H):
                    row = cache[hooks.pattern(lay)][b, h, q, :q + 1].double().numpy()
                    k = float(stats.kurtosis(row, fisher=True, bias=True))
                    want["coarse_score_paper"][lay, h] += k * float(cos[h]) / len(e.anchor_pos)
        near_tok = set(lt[e.near_misses].tolist())
        for p in e.answer_pos:
            q = p - 1
            sl = [s for s in e.shortlist_pos if s <= q]
            nm = [s for s in sl if int(e.tokens[s]) in near_tok]
            for lay in range(L):
                pat = cache[hooks.pattern(lay)][b, :, q].double()  # [H, S]
                res = cache[hooks.result(lay)][b, q].double()
                gain = res @ grad[b, q].double()  # [H]
                sim = pat[:, sl].sum(-1) - pat[:, nm].sum(-1)
                want["refine_score_paper"][lay] += sim * gain / len(e.answer_pos)
    for col, v in want.items():
        got = torch.tensor(df[col].to_numpy(), dtype=torch.float64).reshape(L, H)
        assert float(v.abs().max()) > 1e-3, col  # the check can fail
        torch.testing.assert_close(got, v / len(synth), atol=2e-5, rtol=2e-4, msg=col)


def test_margin_gradient_includes_the_norm_scale():
    """Through an RMSNorm the gradient of ``n(x) . d`` is not the frozen-scale ``g * d / rms``:
    equal to autograd of the written-out formula, and different from the frozen one."""
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(8) + 0.5)
    x, d = torch.randn(3, 8), torch.randn(3, 8)
    got = refine.margin_gradient(norm, x, d)
    xg = x.clone().requires_grad_(True)
    rms = (xg.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    (want,) = torch.autograd.grad(((xg / rms * norm.weight) * d).sum(), xg)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    frozen = (norm.weight * d / rms).detach()
    assert float((got - frozen).abs().max()) > 1e-3


# --- nulls: planted heads -------------------------------------------------------------------
def _shortlists(n_rows: int = 60, seed: int = 0):
    """Rows of 3..6 shortlist entries, 1-2 targets at random entry indices, the rest near-misses:
    ``(n_entries [R], target [R, 6], near [R, 6])``."""
    g = torch.Generator().manual_seed(seed)
    K = 6
    n = torch.randint(3, K + 1, (n_rows,), generator=g)
    t, m = torch.zeros(n_rows, K), torch.zeros(n_rows, K)
    for r in range(n_rows):
        idx = torch.randperm(int(n[r]), generator=g)
        k = 1 + int(torch.randint(0, 2, (1,), generator=g))
        t[r, idx[:k]] = 1.0
        m[r, idx[k:]] = 1.0
    return n, t, m


def test_key_preference_positional_null_on_planted_heads():
    """A purely positional head (attention by entry index, the entry before last favoured, as
    the teacher's heads favour the entry before a target) has a non-zero key_preference but an
    excess over the positional null of exactly 0; a head preferring targets (3x per entry),
    whatever their order, scores positive with the null removed."""
    n, t, m = _shortlists()
    K = t.shape[1]
    idx = torch.arange(K, dtype=torch.float64)[None, :]
    valid = idx < n[:, None]
    # positional: weight 1 per entry, 4 on the entry before the last
    pos = torch.where(idx == (n[:, None] - 2), 4.0, 1.0) * valid
    pos = 0.8 * pos / pos.sum(-1, keepdim=True)  # 0.8 of the row on the shortlist
    # target-preferring: 3 per target entry, 1 per near-miss entry, any order
    tgt = (3.0 * t + m).double()
    tgt = 0.8 * tgt / tgt.sum(-1, keepdim=True)
    # targets placed just before the last entry more often: the positional head looks biased
    t2, m2 = t.clone(), m.clone()
    for r in range(len(n)):
        j = int(n[r]) - 2
        if m2[r, j] > 0 and r % 2:
            last_t = int(torch.nonzero(t2[r])[0, 0])
            t2[r, last_t], m2[r, last_t], t2[r, j], m2[r, j] = 0.0, 1.0, 1.0, 0.0
    at = torch.stack([pos, tgt], 1)  # [R, 2 heads, K]
    real, null, ok = refine.key_preference_null(at, n, t2, m2)
    assert ok.all()
    excess = (real - null)[ok].mean(0)
    assert abs(float(real[:, 0].mean())) > 0.05  # today's column sees a preference
    assert float(excess[0]) == pytest.approx(0.0, abs=1e-9)  # the null removes it exactly
    assert float(excess[1]) > 0.2  # a real target preference survives (0.28)


def test_sharpness_normalised_equal_across_lengths_and_evidence_counts():
    """A head spread evenly over the note's evidence words scores the same
    ``sharpness_evidence_normalised`` (1) in rows of 8 and 30 keys with 2 and 6 evidence words,
    where kurtosis and concentration differ; half of its mass on one non-evidence key also
    scores the same at 8 and 30 keys."""
    got, kurt, conc = {}, {}, {}
    for n in (8, 30):
        for n_ev in (2, 6):
            rows = torch.zeros(1, 1, n, dtype=torch.float64)
            rows[0, 0, 1:1 + n_ev] = 1.0 / n_ev
            valid = torch.ones(1, n, dtype=torch.bool)
            ne = torch.tensor([float(n_ev)])
            got[n, n_ev] = coarse.evidence_normalised(rows, valid, ne).item()
            kurt[n, n_ev] = coarse.excess_kurtosis(rows, valid).item()
            conc[n, n_ev] = coarse.concentration(rows, valid).item()
    assert all(v == pytest.approx(1.0, abs=1e-9) for v in got.values())
    assert kurt[30, 2] - kurt[8, 2] > 5 and conc[8, 2] != pytest.approx(conc[8, 6])
    half = {}
    for n in (8, 30):
        rows = torch.zeros(1, 1, n, dtype=torch.float64)
        rows[0, 0, 0], rows[0, 0, 1:4] = 0.5, 0.5 / 3
        half[n] = coarse.evidence_normalised(rows, torch.ones(1, n, dtype=torch.bool),
                                             torch.tensor([3.0])).item()
    assert half[8] == pytest.approx(half[30], abs=1e-9)


def test_evidence_mass_on_the_own_group_against_its_group_blind_null():
    """A head reading only the step's own evidence group: own mass 1, null |own| / |evidence|;
    a group-blind head (even over every evidence word): own mass equal to its null."""
    S = 12
    ev, own = torch.zeros(1, S), torch.zeros(1, S)
    ev[0, [1, 2, 3, 5, 6, 7, 9, 10, 11]] = 1.0
    own[0, [5, 6, 7]] = 1.0
    rows = torch.stack([own[0] / 3, ev[0] / 9 * 0.7], 0)[None]  # [1, 2 heads, S]
    mine, null = coarse.group_mass(rows, own, ev)
    assert mine[0, 0].item() == pytest.approx(1.0) and null[0, 0].item() == pytest.approx(1 / 3)
    assert mine[0, 1].item() == pytest.approx(null[0, 1].item(), abs=1e-7)


def test_evidence_groups_follow_the_note_order(synth):
    """Each anchor step's group is the contiguous evidence run of its own target (the synthetic
    note's first evidence token is the target's anchor word)."""
    task = ck.load_task("synthetic", n_examples=12, n_labels=16, children=4,
                        labels_per_note=(2, 3), split="test")
    seen = 0
    for e in task.examples:
        groups = evidence_groups(e)
        assert groups is not None and len(groups) == len(e.anchor_pos)
        for j, grp in enumerate(groups):
            word = task.vocab[int(e.tokens[grp[0]])]
            assert word == task.anchor_names[e.anchors[j]].lower(), (word, j)
            seen += 1
    assert seen > 12
    bare = ck.Example(tokens=torch.zeros(3, dtype=torch.long),
                      corrupt_tokens=torch.zeros(3, dtype=torch.long), evidence_pos=[1],
                      anchor_pos=[2], shortlist_pos=[], answer_pos=[], targets=[0],
                      near_misses=[], anchors=[0])
    assert evidence_groups(bare) is None


def test_score_heads_reports_the_sharpness_nulls(tiny_llama, synth):
    """``attrs["instrument_nulls"]`` holds, per sharpness column, the short-vs-long Spearman and
    the evidence-count correlation; the own-group columns' excess is own minus null."""
    df = score_heads(tiny_llama, synth, progress=False, n_boot=0)
    nulls = df.attrs["instrument_nulls"]
    assert set(nulls) == {"sharpness", "sharpness_concentration",
                          "sharpness_evidence_normalised"}
    assert all(set(v) == {"short_long_spearman", "evidence_count_corr"} for v in nulls.values())
    assert (df.evidence_mass_own_excess - (df.evidence_mass_own - df.evidence_mass_own_null)
            ).abs().max() < 1e-12
    assert df.key_preference_excess.notna().all()
