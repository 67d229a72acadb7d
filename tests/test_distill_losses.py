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


def _grads(model) -> dict[str, bool]:
    """Parameter name -> whether it received a non-zero gradient."""
    return {n: p.grad is not None and bool(p.grad.abs().sum() > 0)
            for n, p in S.plain_parameters(model).items()}


def test_gradients_reach_only_what_each_term_should(teacher, task, scores, cot):
    tiny = ck.load_model(dict(TINY_STUDENT))
    tiny.train()
    for p in teacher.parameters():
        p.grad = None
    # P1 heads sit in teacher layer 0 -> student layer 0; P2 heads in layer 2 -> student layer 1
    out = L.losses(teacher, tiny, task, scores, cot=cot, lambda_ns=1.0)

    def reached(term: str) -> dict[str, bool]:
        tiny.zero_grad(set_to_none=True)
        out[term].backward(retain_graph=True)
        return _grads(tiny)

    g1, g2, gc = reached("p1"), reached("p2"), reached("cot")
    frame = ("lm_head.weight", "model.norm.weight")
    assert g1["model.embed_tokens.weight"] and g1["model.layers.0.self_attn.q_proj.weight"]
    assert g1["model.layers.0.self_attn.o_proj.weight"]
    assert not any(v for n, v in g1.items()
                   if n.startswith("model.layers.1.") or ".0.mlp." in n or n in frame
                   or "layers.0.post_attention_layernorm" in n), \
        [n for n, v in g1.items() if v and (n.startswith("model.layers.1.") or n in frame)]
    assert g2["model.layers.1.self_attn.o_proj.weight"] and g2["model.layers.0.mlp.up_proj.weight"]
    assert not any(v for n, v in g2.items()
                   if ".1.mlp." in n or n in frame or "layers.1.post_attention_layernorm" in n)
    assert all(gc.values()), [n for n, v in gc.items() if not v]  # cot reaches everything
    assert all(p.grad is None for p in teacher.parameters())


def test_signals_equal_a_hand_computation_from_run_with_cache(teacher, task, scores, cot):
    tokens = cot[0]
    pool = S.Pooling.teacher(scores, 4, 8)
    qs = S.queries(tokens, S.Layout.of(task))
    with torch.no_grad():
        _, acts = S.run_and_capture(teacher, tokens, pool.layers())
        sig = S.readout(teacher, acts, qs, pool, task.anchor_token_ids)
        _, cache = teacher.run_with_cache(tokens)  # TransformerLens's own cache
    n = 0  # first Phase-1 row
    b, q = int(qs.b1[n]), int(qs.q1[n])
    ref = sum(w * cache[hooks.pattern(lay)][b, h, q] for (lay, h), w in _weights(pool.w1))
    torch.testing.assert_close(sig.p1_attn[n], ref, atol=1e-6, rtol=1e-5)
    write = sum(w * cache[hooks.z(lay)][b, q, h] @ teacher.blocks[lay].attn.W_O[h]
                for (lay, h), w in _weights(pool.w1))
    u = teacher.W_U[:, task.anchor_token_ids]
    u = u - u.mean(1, keepdim=True)
    cos = torch.nn.functional.cosine_similarity(write[:, None], u, dim=0)
    torch.testing.assert_close(sig.p1_profile[n], cos, atol=1e-5, rtol=1e-4)
    m = 0  # first Phase-2 row: loop-back over the shortlist keys and the "elsewhere" mass
    b, q = int(qs.b2[m]), int(qs.q2[m])
    att = sum(w * cache[hooks.pattern(lay)][b, h, q] for (lay, h), w in _weights(pool.w2))
    keys = qs.keys2[m][qs.valid2[m]]
    torch.testing.assert_close(sig.p2_loop[m, : len(keys)], att[keys], atol=1e-6, rtol=1e-5)
    assert sig.p2_loop[m, -1].item() == pytest.approx(1 - att[keys].sum().item(), abs=1e-5)
    w2 = sum(w * cache[hooks.z(lay)][b, q, h] @ teacher.blocks[lay].attn.W_O[h]
             for (lay, h), w in _weights(pool.w2))
    x = cache[hooks.FINAL_NORM_IN][b, q]
    scaled = w2 * teacher.ln_final.weight / torch.sqrt(x.pow(2).mean() + teacher.cfg.eps)
    eff = scaled @ teacher.W_U[:, qs.tok2[m][qs.valid2[m]]]
    torch.testing.assert_close(sig.p2_effect[m, : len(keys)], eff - eff.mean(), atol=1e-5,
                               rtol=1e-4)


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


def test_head_weights_layer_map_and_student_pooling_by_hand():
    frame = hand_scores(4, 8, {(0, 1): 3.0, (1, 2): 1.0, (3, 0): -1.0}, {(2, 5): 2.0})
    w = S.head_weights(frame, 4, 8, phase=1, top_k=3)
    assert w[0, 1].item() == pytest.approx(0.75) and w[1, 2].item() == pytest.approx(0.25)
    assert w.sum().item() == pytest.approx(1.0) and w[3, 0].item() == 0.0  # negative -> 0
    assert S.layer_map(4, 2) == [0, 0, 1, 1] and S.layer_map(4, 4) == [0, 1, 2, 3]
    assert S.layer_map(2, 4) == [1, 3] and S.layer_map(3, 2) == [0, 1, 1]
    s = S.student_weights(w, 2, 4)
    assert torch.allclose(s[0], torch.full((4,), 0.25)) and s[1].sum() == 0
    assert torch.equal(S.student_weights(w, 4, 8), w)  # same shape: the identity map
    none_positive = hand_scores(2, 2, {}, {})
    assert torch.allclose(S.head_weights(none_positive, 2, 2, 1, 2).sum(), torch.tensor(1.0))


def test_nan_score_among_the_top_heads_is_refused_not_made_uniform():
    frame = hand_scores(2, 2, {(0, 0): 0.5, (0, 1): 0.3, (1, 0): 0.2}, {})
    frame.loc[(frame["layer"] == 1) & (frame["head"] == 1), "coarse_score"] = float("nan")
    with pytest.raises(ValueError, match=r"NaN for head\(s\) \(layer, head\) \[\(1, 1\)\]"):
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
