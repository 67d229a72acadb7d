"""Distillation of the heads the teacher's decision runs through (``LossConfig(heads="causal")``):
heads by ``causal_table``'s noise columns, Phase 2 supervised at the shortlist steps."""

from __future__ import annotations

import pytest
import torch
from distill_helpers import TEACHER_P1, TEACHER_P2, TINY_STUDENT, hand_scores

import circuitkit as ck
from circuitkit.distill import loss as L
from circuitkit.distill import signals as S


@pytest.fixture(scope="module")
def teacher():
    return ck.load_model("icd-teacher")


@pytest.fixture(scope="module")
def task():
    return ck.load_task("icd10", n_examples=6, seed=11, split="train")


def causal_scores(p1: dict, p2: dict, n_layers: int = 4, n_heads: int = 8):
    """``hand_scores`` (descriptive heads: TEACHER_P1/P2) plus causal columns: the given
    shares (noise: negative = the phase needs the head) at anchor / shortlist, 0 elsewhere."""
    frame = hand_scores(n_layers, n_heads, TEACHER_P1, TEACHER_P2)
    for phase, shares in ((1, p1), (2, p2)):
        col, rank = S.causal_columns(phase)
        frame[col] = [shares.get((int(r.layer), int(r.head)), 0.0) for r in frame.itertuples()]
        frame[rank] = frame[col].rank(method="min").astype(int)
    return frame


CAUSAL_P1 = {(0, 4): -0.12, (0, 5): -0.04, (1, 1): 0.02}
CAUSAL_P2 = {(0, 3): -0.09, (0, 4): -0.03, (2, 6): 0.05}


def test_causal_heads_are_the_most_needed_with_weights_by_share():
    frame = causal_scores(CAUSAL_P1, CAUSAL_P2)
    heads, alpha = S.phase_heads(frame, 4, 8, 2, 2, heads="causal")
    assert heads == [(0, 3), (0, 4)] and alpha.tolist() == pytest.approx([0.75, 0.25])
    heads, alpha = S.phase_heads(frame, 4, 8, 1, 3, heads="causal")
    assert heads[:2] == [(0, 4), (0, 5)] and alpha.tolist()[:2] == pytest.approx([0.75, 0.25])
    assert alpha.tolist()[2] == 0.0  # a head that helps when noised gets no weight
    # the descriptive choice is untouched by the causal columns
    assert S.phase_heads(frame, 4, 8, 2, 2)[0] == [(2, 6), (2, 0)]
    with pytest.raises(ValueError, match=r"no causal column\(s\) \['p2_noise_shortlist'.*"
                                         r"causal_table"):
        S.phase_heads(hand_scores(4, 8, TEACHER_P1, TEACHER_P2), 4, 8, 2, 2, heads="causal")
    with pytest.raises(ValueError, match="heads must be one of"):
        L.LossConfig(heads="causl").check()


def test_causal_phase2_rows_sit_at_the_shortlist_steps(task):
    lay = S.Layout.of(task)
    qa, qc = S.queries(task.clean_tokens, lay), S.queries(task.clean_tokens, lay, "causal")
    for b, e in enumerate(task.examples):
        assert qa.q2[qa.b2 == b].tolist() == [p - 1 for p in e.answer_pos]
        assert qc.q2[qc.b2 == b].tolist() == [p - 1 for p in e.shortlist_pos]
        n = len(e.shortlist_pos)
        assert qc.w2[qc.b2 == b].tolist() == pytest.approx([1 / n] * n)
        keys = qc.keys2[qc.b2 == b]
        assert (keys[:, :n] == torch.tensor(e.shortlist_pos)).all()
    assert torch.equal(qa.q1, qc.q1) and torch.equal(qa.w1, qc.w1)  # Phase 1 unchanged


def test_causal_losses_are_zero_for_the_teacher_and_read_other_rows(teacher, task):
    frame = causal_scores(CAUSAL_P1, CAUSAL_P2)
    cot = S.teacher_rows(teacher, task)
    causal = L.LossConfig(heads="causal")
    out = L.losses(teacher, teacher, task, frame, cot=cot, config=causal)
    assert out["p1"].item() == 0.0 and out["p2"].item() == 0.0
    student = ck.load_model(dict(TINY_STUDENT))
    a = L.losses(teacher, student, task, frame, cot=cot)
    c = L.losses(teacher, student, task, frame, cot=cot, config=causal)
    assert c["p1"].item() > 0 and c["p2"].item() > 0
    assert c["cot"].item() == pytest.approx(a["cot"].item())  # the same rows for L_CoT
    assert abs(c["p2"].item() - a["p2"].item()) > 1e-6  # other heads, other rows


def test_a_causal_store_records_its_choice_and_old_stores_keep_theirs(teacher, task, tmp_path):
    frame = causal_scores(CAUSAL_P1, CAUSAL_P2)
    plain = S.build_store(teacher, task, frame, tmp_path / "plain", S.StoreOptions(shard_size=3),
                          progress=False)
    causal = S.build_store(teacher, task, frame, tmp_path / "causal",
                           S.StoreOptions(shard_size=3, heads="causal"), progress=False)
    assert "heads" not in plain.manifest["options"]  # a default store's manifest as before
    assert causal.manifest["options"]["heads"] == "causal"
    assert [tuple(h[:2]) for h in causal.manifest["weights"]["p2"]] == [(0, 3), (0, 4)]
    lay = S.Layout.of(task)
    rows = S.queries(S.teacher_rows(teacher, task)[0], lay, "causal")
    shard = causal.shard(0)
    assert shard["p2_q"].tolist() == rows.q2[rows.b2 < 3].tolist()
    changed = frame.copy()
    changed.loc[0, "p2_noise_shortlist"] = -0.5  # the causal columns are part of the table's hash
    with pytest.raises(S.StoreProblem):
        S.build_store(teacher, task, changed, tmp_path / "causal",
                      S.StoreOptions(shard_size=3, heads="causal"), progress=False)
    # ... and not of a default store's
    S.build_store(teacher, task, changed, tmp_path / "plain", S.StoreOptions(shard_size=3),
                  progress=False)


def test_on_the_teacher_the_causal_phase2_heads_are_the_layer0_deciders(teacher):
    """Known answer (issue 34, measured by hook recomputation): noising the teacher's heads at
    the shortlist steps, the sibling decision runs through layer 0; the descriptive
    ``refine_score`` names the layer-2 retrievers."""
    import tempfile
    from pathlib import Path

    from circuitkit.distill.train import DistillConfig, teacher_scores

    cfg = DistillConfig(score_examples=48, loss=dict(heads="causal"))
    with tempfile.TemporaryDirectory() as d:
        frame = teacher_scores(teacher, cfg, Path(d))
    causal, _ = S.phase_heads(frame, 4, 8, 2, 2, heads="causal")
    scored, _ = S.phase_heads(frame, 4, 8, 2, 2)
    assert all(layer == 0 for layer, _ in causal), causal
    assert all(layer == 2 for layer, _ in scored), scored
