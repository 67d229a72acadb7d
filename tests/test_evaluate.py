"""evaluate(): pure metrics on hand-made logits/sets, controlled models, a tiny real model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import circuitkit as ck
from circuitkit.evaluation import (
    confusion_from_logits,
    confusion_metric,
    evaluate,
    f1_scores,
    focus_from_logits,
    focus_metric,
    focus_per_step_from_logits,
    parse_answer,
    restricted_mass,
    set_metrics,
)
from circuitkit.tasks import load_task


@pytest.fixture(scope="module")
def task():
    return load_task("synthetic", n_examples=24, seed=1, n_labels=60, children=4)


def test_restricted_mass_hand_logits():
    logits = torch.zeros(2, 3, 6)
    logits[0, 0, 2] = math.log(3.0)  # step p=1 reads logits[0]: cand {2,3} -> probs 3/4, 1/4
    logits[0, 1, 4] = 5.0  # not a candidate at p=2: ignored by the restriction
    out = restricted_mass(logits, [[1, 2], []], [[2, 3], [2, 3]], [[2], [2]])
    assert out[0].item() == pytest.approx((0.75 + 0.5) / 2)
    assert math.isnan(out[1].item())


def test_focus_and_confusion_known_values(task):
    e = task.examples[0]
    L = e.tokens.shape[0]
    logits = torch.zeros(1, L, len(task.vocab))
    sub = task.subset([0])
    # uniform logits: focus = n correct anchors / n anchors; confusion = |near| / (|tgt| + |near|)
    assert focus_from_logits(logits, sub)[0].item() == pytest.approx(
        len(set(e.anchors)) / len(task.anchor_names))
    assert confusion_from_logits(logits, sub)[0].item() == pytest.approx(
        len(e.near_misses) / (len(e.targets) + len(e.near_misses)))
    # a big logit on the right anchor/target at every step: focus -> 1, confusion -> 0
    for p in e.anchor_pos + e.answer_pos:
        logits[0, p - 1, e.tokens[p]] = 50.0
    assert focus_from_logits(logits, sub)[0].item() == pytest.approx(1.0)
    assert confusion_from_logits(logits, sub)[0].item() == pytest.approx(0.0, abs=1e-6)
    # all mass on a near-miss at the answer steps: confusion -> 1
    nm_tok = int(task.label_token_ids[e.near_misses[0]])
    for p in e.answer_pos:
        logits[0, p - 1, nm_tok] = 100.0
    assert confusion_from_logits(logits, sub)[0].item() == pytest.approx(1.0)



def test_focus_and_confusion_metrics_are_the_same_quantities(task):
    """``focus_metric`` / ``confusion_metric`` (the PromptMetrics patching reads) give
    ``focus_from_logits`` / ``confusion_from_logits`` per prompt, from full logits and from
    the logits at their ``reads`` only (seeded logits; float32 tolerance)."""
    logits = torch.randn(len(task), task.clean_tokens.shape[1], len(task.vocab),
                         generator=torch.Generator().manual_seed(0)) * 3
    for metric, ref, name in ((focus_metric(task), focus_from_logits, "focus"),
                              (confusion_metric(task), confusion_from_logits, "confusion")):
        want = ref(logits, task)
        assert metric.name == name and not want.isnan().any()
        torch.testing.assert_close(metric.per_prompt(logits), want, atol=1e-6, rtol=0)
        reads = metric.reads
        at_reads = logits.gather(1, reads[..., None].expand(-1, -1, logits.shape[-1]))
        torch.testing.assert_close(metric.per_prompt(at_reads, at=reads), want, atol=1e-6,
                                   rtol=0)


def test_f1_and_set_metrics():
    pred = [{1, 2}, {3}, set()]
    true = [{1}, {3}, {4}]
    macro, micro = f1_scores(pred, true)
    # label 1: tp1 -> 1; label 2: fp1 -> 0; label 3: tp1 -> 1; label 4: fn1 -> 0
    assert macro == pytest.approx(0.5)
    assert micro == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    m = set_metrics(pred, true, [{2}, {5}, {4}])
    assert m["exact_match"] == pytest.approx(1 / 3)
    assert m["confusion_rate"] == pytest.approx(1 / 3)
    assert f1_scores([set()], [set()]) == (1.0, 1.0)


def test_parse_answer(task):
    v = task.vocab
    end, eos = v.index("</think>"), task.eos_id
    l0, l5 = int(task.label_token_ids[0]), int(task.label_token_ids[5])
    assert parse_answer([l5, end, l0, l5, eos, l0], task) == {0, 5}
    assert parse_answer([l0, l5], task) == set()  # no </think>: no answer


class Oracle(nn.Module):
    """Logits put ``scale`` on the next token of the clean sequence whose prefix matches the input;
    if ``swap`` is set, answer tokens are replaced by the first near-miss (a confused model)."""

    def __init__(self, task, swap=False, scale=30.0):
        super().__init__()
        self.seqs = [e.tokens.tolist() for e in task.examples]
        self.v = len(task.vocab)
        self.scale = scale
        self.swap = {}
        if swap:
            for i, e in enumerate(task.examples):
                if e.near_misses:
                    self.swap[i] = {p: int(task.label_token_ids[e.near_misses[0]])
                                    for p in e.answer_pos}

    def forward(self, tokens):
        b, s = tokens.shape
        out = torch.zeros(b, s, self.v)
        for r in range(b):
            row = tokens[r].tolist()
            for i, seq in enumerate(self.seqs):
                n = min(len(seq), s)
                if seq[:n] == row[:n] or seq[: len(row)] == row[: len(seq)]:
                    for p in range(min(s, len(seq) - 1)):
                        out[r, p, self.swap.get(i, {}).get(p + 1, seq[p + 1])] = self.scale
                    break
        return out


def test_evaluate_oracle_and_confused(task):
    m = evaluate(Oracle(task), task, batch_size=7)
    assert m["exact_match"] == 1.0 and m["macro_f1"] == 1.0 and m["micro_f1"] == 1.0
    assert m["confusion_rate"] == 0.0
    assert m["focus"] == pytest.approx(1.0) and m["confusion"] == pytest.approx(0.0, abs=1e-6)
    c = evaluate(Oracle(task, swap=True), task, batch_size=5)
    n_sw = sum(bool(e.near_misses) for e in task.examples)
    assert c["confusion_rate"] == pytest.approx(n_sw / len(task))
    assert c["exact_match"] == pytest.approx(1 - n_sw / len(task))
    assert c["focus"] == pytest.approx(1.0)  # the anchors are still right


def test_evaluate_tiny_random_model(task):
    import circuitkit as ck

    torch.manual_seed(0)
    model = ck.load_model(
        {"model_type": "llama", "vocab_size": len(task.vocab), "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 2, "max_position_embeddings": 128},
        tokenizer=task.tokenizer(), device="cpu")
    m = evaluate(model, task.subset(range(8)), batch_size=4, embeddings=False)
    assert set(m) == {"focus", "focus_per_step", "confusion", "confusion_rate", "macro_f1",
                      "micro_f1", "exact_match"}
    for k, v in m.items():
        assert 0.0 <= v <= 1.0, (k, v)
    sub = task.subset(range(8))  # batched evaluate == the pure functions on one full batch
    with torch.no_grad():
        logits = model(sub.clean_tokens)
    assert m["focus"] == pytest.approx(float(focus_from_logits(logits, sub).nanmean()), abs=1e-5)
    assert m["confusion"] == pytest.approx(
        float(confusion_from_logits(logits, sub).nanmean()), abs=1e-5)
    # ck.evaluate works even though the circuitkit.evaluate module was imported first
    assert ck.evaluate(model, task.subset(range(2)), batch_size=2,
                       embeddings=False).keys() == m.keys()


def test_model_with_too_small_vocabulary_is_refused_clearly():
    model = ck.load_model("induction-2l")  # 64-token vocabulary
    task = ck.load_task("icd10", n_examples=4, split="test")
    with pytest.raises(ValueError, match="vocabulary has 64 tokens"):
        ck.evaluate(model, task)


def test_bad_task_and_batch_size_are_named():
    import dataclasses

    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=2, split="test")
    with pytest.raises(ValueError, match="evaluate: task must be a circuitkit Task"):
        ck.evaluate(model, "icd10")
    with pytest.raises(ValueError, match="evaluate: task has no examples"):
        ck.evaluate(model, task.subset([]))
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        ck.evaluate(model, task, batch_size=0)
    e = task.examples[0]
    bad = dataclasses.replace(task, examples=[dataclasses.replace(
        e, tokens=torch.cat([e.tokens[:-1], torch.tensor([-1])]))] + task.examples[1:])
    with pytest.raises(ValueError, match="negative token id"):  # not an IndexError in embed
        ck.evaluate(model, bad)



@pytest.mark.parametrize("name", ["icd-teacher", "icd-student-cot"])
def test_teacher_forced_greedy_equals_greedy_decoding(name, monkeypatch):
    """evaluate's generations, decided from the teacher-forced pass where the model follows the
    note's own continuation and decoded greedily (right-padded batches, padded_greedy) only
    from where it departs, are token for token the plain greedy decode of every prompt (the old
    path: unpadded batches of one length), and so are its metrics (exactly); a short
    max_new_tokens cuts both the same way."""
    from circuitkit import evaluation

    model = ck.load_model(name)
    task = load_task("icd10", n_examples=48, seed=3, split="test", phase=2)
    think = task.vocab.index("<think>")
    ends = [evaluation.prompt_end(e, think) for e in task.examples]
    with torch.no_grad():
        argmax = list(model(task.clean_tokens).argmax(-1))
    prompts = [e.tokens[:n] for e, n in zip(task.examples, ends, strict=True)]
    real, padded, decoded = evaluation.greedy_decode, evaluation.padded_greedy, []

    def counted(*a, **k):
        decoded.append(len(a[1]))
        return padded(*a, **k)

    monkeypatch.setattr(evaluation, "padded_greedy", counted)
    longest = max(len(e.tokens) - n for e, n in zip(task.examples, ends, strict=True))
    for max_new in (longest + 4, 5):
        want = real(model, prompts, task.eos_id, max_new)
        assert evaluation.teacher_forced_greedy(model, task, ends, argmax, max_new) == want
    # some notes are decided by the teacher-forced pass alone, the others (a shortlist the
    # model orders otherwise) are decoded from where they depart: both branches ran
    assert 0 < sum(decoded) < 2 * len(task), decoded
    fast = evaluate(model, task)
    monkeypatch.setattr(evaluation, "teacher_forced_greedy",
                        lambda m, t, e, a, n, b, on_batch: real(
                            m, [x.tokens[:k] for x, k in zip(t.examples, e, strict=True)],
                            t.eos_id, n, b))
    assert evaluate(model, task) == fast


class WrongOrder(Oracle):
    """The oracle, but naming each note's anchors in reverse order (a constructed chain of
    thought whose steps are right as a set, wrong in order)."""

    def __init__(self, task):
        super().__init__(task)
        for i, e in enumerate(task.examples):
            toks = [int(e.tokens[p]) for p in e.anchor_pos]
            self.swap[i] = dict(zip(e.anchor_pos, reversed(toks), strict=True))


def test_focus_per_step_sees_the_order_that_focus_does_not():
    """issue 34: anchors in the wrong order keep today's focus at 1; the per-step focus (each
    step's own anchor) falls to the share of steps whose anchor the reversal leaves in place."""
    task = load_task("icd10", n_examples=16, split="test")
    e_multi = [e for e in task.examples if len(set(e.anchors)) > 1]
    assert e_multi  # the constructed order is wrong somewhere
    m = evaluate(WrongOrder(task), task, batch_size=8)
    assert m["focus"] == pytest.approx(1.0, abs=1e-6)
    want = sum(sum(a == b for a, b in zip(e.anchors, reversed(e.anchors), strict=True))
               / len(e.anchors) for e in task.examples) / len(task)
    assert m["focus_per_step"] == pytest.approx(want, abs=1e-6) and want < 0.9
    right = evaluate(Oracle(task), task, batch_size=8)
    assert right["focus"] == pytest.approx(1.0) and right["focus_per_step"] == pytest.approx(1.0)
    # hand logits: step 1 names step 2's anchor and vice versa
    e = e_multi[0]
    sub = task.subset([task.examples.index(e)])
    logits = torch.zeros(1, e.tokens.shape[0], len(task.vocab))
    for p, a in zip(e.anchor_pos, reversed(e.anchors), strict=True):
        logits[0, p - 1, int(task.anchor_token_ids[a])] = 50.0
    assert focus_from_logits(logits, sub)[0].item() == pytest.approx(1.0)
    assert focus_per_step_from_logits(logits, sub)[0].item() == pytest.approx(
        sum(a == b for a, b in zip(e.anchors, reversed(e.anchors), strict=True))
        / len(e.anchors), abs=1e-6)


def test_focus_per_step_equals_a_recomputation_on_the_teacher():
    """``focus_per_step`` on the teacher from its raw logits (``run_with_cache``), written here:
    at anchor step j, softmax over the anchor tokens at ``anchor_pos[j] - 1``, mass on the token
    the note has at ``anchor_pos[j]`` (that step's own anchor); mean over steps, then notes."""
    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=32, split="test")
    with torch.no_grad():
        logits, _ = model.run_with_cache(task.clean_tokens, names_filter=lambda n: False)
    anchors = task.anchor_token_ids.tolist()
    per_note, any_note = [], []
    for b, e in enumerate(task.examples):
        steps, any_steps = [], []
        for p in e.anchor_pos:
            probs = logits[b, p - 1, anchors].double().softmax(-1)
            steps.append(float(probs[anchors.index(int(e.tokens[p]))]))
            own = {int(task.anchor_token_ids[a]) for a in e.anchors}
            any_steps.append(float(sum(probs[i] for i, t in enumerate(anchors) if t in own)))
        per_note.append(sum(steps) / len(steps))
        any_note.append(sum(any_steps) / len(any_steps))
    got = evaluate(model, task, batch_size=16)
    assert got["focus_per_step"] == pytest.approx(sum(per_note) / len(per_note), abs=1e-5)
    assert got["focus"] == pytest.approx(sum(any_note) / len(any_note), abs=1e-5)
    assert got["focus_per_step"] <= got["focus"] + 1e-9
