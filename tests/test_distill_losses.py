"""Distillation losses: exactly zero for the teacher itself, positive otherwise; gradients reach
only the parameters each term should; signals equal a hand computation from TransformerLens's
own cache; parsing, pooling weights and the layer map by hand."""

from __future__ import annotations

import math

import pytest
import torch
from distill_helpers import TEACHER_P1, TEACHER_P2, TINY_STUDENT, hand_scores

import circuitkit as ck
from circuitkit import hooks
from circuitkit.distill import loss as L
from circuitkit.distill import signals as S


@pytest.fixture(scope="module")
def teacher():
    return ck.load_model("icd-teacher")


@pytest.fixture(scope="module")
def task():
    return ck.load_task("icd10", n_examples=6, seed=11, split="train")


@pytest.fixture(scope="module")
def scores():
    return hand_scores(4, 8, TEACHER_P1, TEACHER_P2)


@pytest.fixture(scope="module")
def cot(teacher, task):
    return S.teacher_rows(teacher, task)


def test_ck_distill_losses_is_the_function():
    import circuitkit.distill.loss  # noqa: F401  (a submodule import must not shadow it)

    assert callable(ck.distill.losses) and ck.distill.losses is L.losses


def test_p1_p2_exactly_zero_for_the_teacher_itself(teacher, task, scores, cot):
    out = ck.distill.losses(teacher, teacher, task, scores, lambda_p1=1.0, lambda_p2=1.0,
                            cot=cot, lambda_ns=1.0)
    assert out["p1"].item() == 0.0 and out["p2"].item() == 0.0 and out["ns"].item() == 0.0
    assert out["cot"].item() > 0 and out["total"].item() == out["cot"].item()
    twin = ck.load_model("icd-teacher")  # a second copy: same weights, other objects
    out2 = L.losses(teacher, twin, task, scores, cot=cot)
    assert out2["p1"].item() == 0.0 and out2["p2"].item() == 0.0


def test_default_cot_is_the_teachers_own_greedy_chain(teacher, task, scores):
    out = L.losses(teacher, teacher, task, scores)  # decodes the teacher's CoT itself
    assert out["p1"].item() == 0.0 and out["p2"].item() == 0.0


def test_p1_p2_positive_for_other_students(teacher, task, scores, cot):
    tiny = ck.load_model(dict(TINY_STUDENT))
    out = L.losses(teacher, tiny, task, scores, cot=cot, lambda_ns=1.0)
    for k in ("p1", "p2", "ns"):
        assert out[k].item() > 1e-3, (k, out[k])
    assert out["total"].item() == pytest.approx(
        out["cot"].item() + out["p1"].item() + out["p2"].item() + out["ns"].item(), rel=1e-6)
    # a student of the teacher's own shape (identity head map) with perturbed weights
    same = ck.load_model("icd-teacher")
    with torch.no_grad():
        w = same.original_model.model.layers[0].self_attn.q_proj.weight
        w.add_(0.5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    out = L.losses(teacher, same, task, scores, cot=cot)
    assert out["p1"].item() > 1e-4 and out["p2"].item() > 0


def _grads(model) -> dict[str, torch.Tensor | None]:
    """Parameter name -> its gradient (None: none reached it)."""
    return {n: p.grad for n, p in S.plain_parameters(model).items()}


def _reached(out, model, term):
    model.zero_grad(set_to_none=True)
    out[term].backward(retain_graph=True)
    return _grads(model)


def _nz(g) -> bool:
    return g is not None and bool(g.abs().sum() > 0)


def _head_rows(g, head: int, d_head: int, cols: bool = False) -> torch.Tensor:
    """The block of a projection's gradient that belongs to one head: rows of q/k/v_proj,
    columns of o_proj (HF Llama layouts)."""
    sl = slice(head * d_head, (head + 1) * d_head)
    return g[:, sl] if cols else g[sl]


def _check_only_heads(g: dict, layer: int, mapped: set[int], n_heads: int, d_head: int) -> None:
    """In ``layer``, exactly the ``mapped`` heads' q/k/v rows and o columns received gradient."""
    pre = f"model.layers.{layer}.self_attn."
    for h in range(n_heads):
        for proj, cols in (("q_proj", False), ("k_proj", False), ("v_proj", False),
                           ("o_proj", True)):
            block = _head_rows(g[pre + proj + ".weight"], h, d_head, cols) \
                if g[pre + proj + ".weight"] is not None else None
            assert _nz(block) == (h in mapped), (layer, h, proj)


def test_gradients_reach_only_the_mapped_heads_and_what_they_read(teacher, task, scores, cot):
    """Head-selective supervision (gradient mask): the teacher's Phase-1 heads (layer 0) map to
    student heads 0, 1 of layer 0 and its Phase-2 heads (layer 2) to heads 0, 1 of layer 1
    (half of each 4-head layer); L_P1 / L_P2 move only those heads' query, key, value rows and
    output columns in their layer, plus what those heads read (the embeddings, the blocks below,
    the layer's input norm); never the layer's other heads, its MLP, later layers, the final
    norm or the unembedding. L_CoT reaches everything."""
    tiny = ck.load_model(dict(TINY_STUDENT))
    tiny.train()
    for p in teacher.parameters():
        p.grad = None
    pool = S.Pooling.teacher(scores, 4, 8).for_student(2, 4)
    assert pool.heads1 == ((0, 0), (0, 1)) and pool.heads2 == ((1, 0), (1, 1))
    out = L.losses(teacher, tiny, task, scores, cot=cot, lambda_ns=1.0)
    g1, g2, gc = (_reached(out, tiny, t) for t in ("p1", "p2", "cot"))
    frame = ("lm_head.weight", "model.norm.weight")
    _check_only_heads(g1, 0, {0, 1}, 4, 8)
    assert _nz(g1["model.embed_tokens.weight"]) and _nz(g1["model.layers.0.input_layernorm.weight"])
    assert not [n for n, v in g1.items() if _nz(v) and (
        n.startswith("model.layers.1.") or ".0.mlp." in n or n in frame
        or "layers.0.post_attention_layernorm" in n)]
    _check_only_heads(g2, 1, {0, 1}, 4, 8)
    assert _nz(g2["model.layers.0.mlp.up_proj.weight"]) and _nz(g2["model.embed_tokens.weight"])
    assert all(_nz(g2[f"model.layers.0.self_attn.{p}.weight"]) for p in ("q_proj", "o_proj"))
    assert not [n for n, v in g2.items() if _nz(v) and (
        ".1.mlp." in n or n in frame or "layers.1.post_attention_layernorm" in n)]
    assert all(_nz(v) for v in gc.values()), [n for n, v in gc.items() if not _nz(v)]
    assert all(p.grad is None for p in teacher.parameters())


def test_four_layer_student_puts_phase2_below_its_output_layer(teacher, task, scores, cot):
    """The 4-layer student preset (half the teacher's width): teacher layers map one to one, so
    the Phase-2 heads (teacher layer 2) land in student layer 2, not in the output layer 3,
    and L_P2 leaves layer 3 untouched."""
    from circuitkit.training import PRESETS

    pre = PRESETS["student4"]
    assert pre.n_layers == 4 and pre.d_model <= 192 // 2
    s4 = ck.load_model(dict(TINY_STUDENT, num_hidden_layers=4))
    s4.train()
    pool = S.Pooling.teacher(scores, 4, 8).for_student(4, 4)
    assert {lay for lay, _ in pool.heads2} == {2} and {lay for lay, _ in pool.heads1} == {0}
    out = L.losses(teacher, s4, task, scores, cot=cot)
    g2 = _reached(out, s4, "p2")
    _check_only_heads(g2, 2, {0, 1}, 4, 8)
    assert not [n for n, v in g2.items() if _nz(v) and n.startswith("model.layers.3.")]
    assert _nz(g2["model.layers.1.mlp.down_proj.weight"])


def test_signals_equal_a_hand_computation_from_run_with_cache(teacher, task, scores, cot):
    """Each teacher head's signals against TransformerLens's own cache; the shortlist write
    against a run whose pattern is masked to the shortlist keys (TransformerLens computes that
    head's z from it: no v indexing of ours involved)."""
    tokens = cot[0]
    pool = S.Pooling.teacher(scores, 4, 8)
    qs = S.queries(tokens, S.Layout.of(task))
    anchors = S.Anchors.of(task)
    with torch.no_grad():
        _, acts = S.run_and_capture(teacher, tokens, pool.layers(), v_layers=pool.p2_layers())
        sig = S.readout(teacher, acts, qs, pool, anchors)
        _, cache = teacher.run_with_cache(tokens)  # TransformerLens's own cache
    u = teacher.W_U[:, task.anchor_token_ids]
    u = u - u.mean(1, keepdim=True)
    n = 0  # first Phase-1 row
    b, q = int(qs.b1[n]), int(qs.q1[n])
    for j, (lay, h) in enumerate(pool.heads1):
        torch.testing.assert_close(sig.p1_attn[n, j], cache[hooks.pattern(lay)][b, h, q],
                                   atol=1e-6, rtol=1e-5)
        write = cache[hooks.z(lay)][b, q, h] @ teacher.blocks[lay].attn.W_O[h]
        cos = torch.nn.functional.cosine_similarity(write[:, None], u, dim=0)
        torch.testing.assert_close(sig.p1_profile[n, j], cos, atol=1e-5, rtol=1e-4)
        c = int(qs.anchor1[n])
        want = cos[c] - (cos.sum() - cos[c]) / (len(cos) - 1)
        assert sig.p1_alignment[n, j].item() == pytest.approx(want.item(), abs=1e-5)
    m = 0  # first Phase-2 row
    b, q = int(qs.b2[m]), int(qs.q2[m])
    keys = qs.keys2[m][qs.valid2[m]]
    x = cache[hooks.FINAL_NORM_IN][b, q]
    for j, (lay, h) in enumerate(pool.heads2):
        att = cache[hooks.pattern(lay)][b, h, q]
        torch.testing.assert_close(sig.p2_loop[m, j, : len(keys)], att[keys], atol=1e-6,
                                   rtol=1e-5)
        assert sig.p2_loop[m, j, -1].item() == pytest.approx(1 - att[keys].sum().item(),
                                                             abs=1e-5)

        def only_shortlist(pattern, hook, lay=lay, h=h):
            keep = torch.zeros_like(pattern[b, h, q])
            keep[keys] = 1.0
            pattern[b, h, q] = pattern[b, h, q] * keep
            return pattern

        z_sl = {}

        def grab(z, hook, h=h, z_sl=z_sl):
            z_sl["z"] = z[b, q, h].clone()  # returns None: the run goes on unchanged

        with torch.no_grad():
            teacher.run_with_hooks(tokens, fwd_hooks=[(hooks.pattern(lay), only_shortlist),
                                                      (hooks.z(lay), grab)])
        w_sl = z_sl["z"] @ teacher.blocks[lay].attn.W_O[h]
        scaled = w_sl * teacher.ln_final.weight / torch.sqrt(x.pow(2).mean() + teacher.cfg.eps)
        eff = scaled @ teacher.W_U[:, qs.tok2[m][qs.valid2[m]]]
        torch.testing.assert_close(sig.p2_effect[m, j, : len(keys)], eff - eff.mean(),
                                   atol=1e-5, rtol=1e-4)


def test_labels_reading_reads_the_write_against_label_centroids(teacher, task, scores, cot):
    """``phase1_reading="labels"``: heads by ``coarse_score`` and the profile against each
    anchor's centred mean label unembedding (scoring's default directions), by hand."""
    frame = scores.copy()
    frame["coarse_score"] = frame["coarse_score"][::-1].to_numpy()  # another ranking
    frame["phase1_rank"] = frame["coarse_score"].rank(ascending=False, method="first").astype(int)
    pool = S.Pooling.teacher(frame, 4, 8, reading="labels")
    assert pool.heads1 == tuple(S.phase_heads(frame, 4, 8, 1, 2, "labels")[0])
    assert pool.heads1 != S.Pooling.teacher(frame, 4, 8).heads1
    tokens = cot[0]
    qs = S.queries(tokens, S.Layout.of(task))
    with torch.no_grad():
        _, acts = S.run_and_capture(teacher, tokens, pool.layers(), v_layers=pool.p2_layers())
        sig = S.readout(teacher, acts, qs, pool, S.Anchors.of(task, "labels"))
        _, cache = teacher.run_with_cache(tokens)
    W = teacher.W_U
    cent = torch.stack([W[:, task.label_token_ids[task.label_anchor == a]].mean(1)
                        for a in range(len(task.anchor_token_ids))], 1)
    cent = cent - cent.mean(1, keepdim=True)
    b, q = int(qs.b1[0]), int(qs.q1[0])
    lay, h = pool.heads1[0]
    write = cache[hooks.z(lay)][b, q, h] @ teacher.blocks[lay].attn.W_O[h]
    cos = torch.nn.functional.cosine_similarity(write[:, None], cent, dim=0)
    torch.testing.assert_close(sig.p1_profile[0, 0], cos, atol=1e-5, rtol=1e-4)
    out = L.losses(teacher, teacher, task, frame, cot=cot,
                   config=L.LossConfig(phase1_reading="labels"))
    assert out["p1"].item() == 0.0 and out["p2"].item() == 0.0


def _weights(w: torch.Tensor):
    return [((int(a), int(b)), float(w[a, b])) for a, b in (w != 0).nonzero().tolist()]


def test_parsing_gold_rows_gives_the_examples_positions(task):
    lay = S.Layout.of(task)
    for e in task.examples:
        assert S.parse_row(e.tokens.tolist(), lay) == (e.anchor_pos, e.shortlist_pos,
                                                       e.answer_pos)
    qs = S.queries(task.clean_tokens, lay)
    e0 = task.examples[0]
    assert qs.q1[qs.b1 == 0].tolist() == [p - 1 for p in e0.anchor_pos]
    assert qs.w1[qs.b1 == 0].tolist() == [1 / len(e0.anchor_pos)] * len(e0.anchor_pos)
    assert S.parse_row([1, 5, 6], lay) == ([], [], [])  # no <think>: no query rows


def test_head_weights_layer_map_and_head_map_by_hand():
    frame = hand_scores(4, 8, {(0, 1): 3.0, (1, 2): 1.0, (3, 0): -1.0}, {(2, 5): 2.0})
    w = S.head_weights(frame, 4, 8, phase=1, top_k=3)
    assert w[0, 1].item() == pytest.approx(0.75) and w[1, 2].item() == pytest.approx(0.25)
    assert w.sum().item() == pytest.approx(1.0) and w[3, 0].item() == 0.0  # negative -> 0
    heads, alpha = S.phase_heads(frame, 4, 8, 1, 3)
    assert heads[:2] == [(0, 1), (1, 2)] and alpha.tolist()[:2] == pytest.approx([0.75, 0.25])
    assert S.layer_map(4, 2) == [0, 0, 1, 1] and S.layer_map(4, 4) == [0, 1, 2, 3]
    assert S.layer_map(2, 4) == [1, 3] and S.layer_map(3, 2) == [0, 1, 1]
    # fixed assignment: mapped layer's heads 0, 1, ... in the given order, at most half of them
    m = S.head_map([(0, 2), (0, 0), (2, 6), (2, 0), (0, 2)], (4, 8), 2, 4)
    assert m == {(0, 2): (0, 0), (0, 0): (0, 1), (2, 6): (1, 0), (2, 0): (1, 1)}
    m = S.head_map([(0, 2), (1, 0), (0, 5)], (4, 8), 2, 4)  # 3 heads into layer 0: round robin
    assert m == {(0, 2): (0, 0), (1, 0): (0, 1), (0, 5): (0, 0)}
    assert S.head_map([(0, 2), (1, 0)], (4, 8), 2, 8, share=0.25) == {(0, 2): (0, 0),
                                                                       (1, 0): (0, 1)}
    assert S.head_map([(3, 7), (0, 1)], (4, 8), 4, 8) == {(3, 7): (3, 7), (0, 1): (0, 1)}
    # a head in both phases keeps one student head
    pool = S.Pooling((((2, 0),)), torch.ones(1), ((2, 1), (2, 0)), torch.tensor([0.5, 0.5]),
                     (4, 8)).for_student(2, 4)
    assert pool.heads1 == ((1, 0),) and pool.heads2 == ((1, 1), (1, 0))
    assert torch.equal(pool.w2, torch.tensor([[0.0] * 4, [0.5, 0.5, 0, 0]]))
    assert pool.only(False, True, False).heads1 == () and pool.layers() == [1]
    none_positive = hand_scores(2, 2, {}, {})
    assert torch.allclose(S.head_weights(none_positive, 2, 2, 1, 2).sum(), torch.tensor(1.0))


def test_nan_score_among_the_top_heads_is_refused_not_made_uniform():
    frame = hand_scores(2, 2, {(0, 0): 0.5, (0, 1): 0.3, (1, 0): 0.2}, {})
    frame.loc[(frame["layer"] == 1) & (frame["head"] == 1), "coarse_score_tokens"] = float("nan")
    with pytest.raises(ValueError, match=r"coarse_score_tokens'\] is NaN for head\(s\) "
                                         r"\(layer, head\) \[\(1, 1\)\]"):
        S.head_weights(frame, 2, 2, phase=1, top_k=4)
    w = S.head_weights(frame, 2, 2, phase=1, top_k=3)  # the NaN head outside the top 3: fine
    assert w[0, 0].item() == pytest.approx(0.5) and w[1, 0].item() == pytest.approx(0.2)


def test_cot_rows_without_phase_steps_warn_that_p1_p2_are_zero(teacher, task, scores, cot):
    tokens, mask = cot
    flat = torch.full_like(tokens, int(tokens[0, 0]))  # no <think>: no anchor or answer steps
    with pytest.warns(UserWarning, match="p1 and p2 = 0 for this batch"):
        out = L.losses(teacher, teacher, task, scores, cot=(flat, mask))
    assert out["p1"].item() == 0.0 and out["p2"].item() == 0.0
    with pytest.warns(UserWarning, match="p2 = 0"):  # lambda_p1 = 0: only p2 is named
        L.losses(teacher, teacher, task, scores, lambda_p1=0.0, cot=(flat, mask))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the teacher's own CoT has both: no warning
        L.losses(teacher, teacher, task, scores, cot=cot)


def test_kl_hand_values():
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.25, 0.75, 0.0])
    assert L.kl(p, p).item() == 0.0
    ref = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert L.kl(p, q).item() == pytest.approx(ref, rel=1e-6)
    assert L.wmean(torch.tensor([1.0, 3.0]), torch.tensor([0.5, 0.5])).item() == 2.0


def test_bad_inputs_are_named(teacher, task, scores, cot):
    with pytest.raises(ValueError, match="scores is missing column"):
        L.losses(teacher, teacher, task, scores.drop(columns=["refine_score"]), cot=cot)
    with pytest.raises(ValueError, match="teacher has 4 layers x 8 heads"):
        L.losses(teacher, teacher, task, hand_scores(2, 8, {}, {}), cot=cot)
    for lam in (-1.0, float("nan")):  # NaN passed a `< 0` check and made total NaN
        with pytest.raises(ValueError, match="lambda_p1 must be a number >= 0"):
            L.losses(teacher, teacher, task, scores, lambda_p1=lam, cot=cot)
    with pytest.raises(ValueError, match="losses: task must be a circuitkit Task"):
        L.losses(teacher, teacher, "icd10", scores, cot=cot)
    with pytest.raises(ValueError, match="losses: task has no examples"):
        L.losses(teacher, teacher, task.subset([]), scores, cot="task")
    with pytest.raises(ValueError, match="mask must have the tokens' shape"):
        L.losses(teacher, teacher, task, scores, cot=(cot[0], cot[1][:, :3]))
    with pytest.raises(ValueError, match="tokens must be an integer tensor"):
        L.losses(teacher, teacher, task, scores, cot=(cot[0].float(), cot[1]))
    with pytest.raises(ValueError, match="cot must be"):
        L.losses(teacher, teacher, task, scores, cot="gold")
    induction = ck.load_model("induction-2l")
    with pytest.raises(ValueError, match="share a vocabulary"):
        L.losses(teacher, induction, task, scores, cot=cot)
