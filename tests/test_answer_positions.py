"""Each prompt's own positions on a task's right-padded tokens (issue 36 item 8).

The TransformerLens idiom ``lambda l: l[:, -1, tgt].mean()`` on ``task.clean_tokens`` is refused
(shorter examples are right-padded: -1 reads their padding), and nothing offered the positions to
read instead. Now ``task.answer_positions`` / ``task.answer_tokens`` / ``task.last_positions``
give them, ``ck.metrics.at_answers`` builds a metric from a reading at them, and the refusal
names both. References: ``task.metric`` and forward passes of each example alone (unpadded).
Tolerance 1e-6 absolute on metric values (the same float32 arithmetic); 1e-5 on sweep values
(two sweeps, each summing in its own order).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tinymodels import call

import circuitkit as ck
from circuitkit.metrics import pad_rows
from circuitkit.patching.results import DegenerateBaselineWarning


@pytest.fixture(scope="module")
def teacher():
    return ck.load_model("icd-teacher")


@pytest.fixture(scope="module")
def task():
    t = ck.load_task("icd10", n_examples=8, split="test", seed=3)
    assert len({len(e.tokens) for e in t.examples}) > 1  # right-padded clean_tokens
    return t


def margin(step, tok, riv):
    """Target logit minus the mean logit of the rivals, at each step: ``step [b, k, vocab]``,
    ``tok [b, k]``, ``riv [b, r]`` (-1 padding), as a user would write it."""
    tgt = step.gather(-1, tok[..., None])[..., 0]
    keep = (riv >= 0)[:, None, :]
    rv = step.gather(-1, riv.clamp(min=0)[:, None, :].expand(-1, step.shape[1], -1))
    return tgt - (rv * keep).sum(-1) / keep.sum(-1).clamp(min=1)


def margin_reading(task, rivals):
    return ck.metrics.at_answers(margin, task.answer_positions, task.answer_tokens,
                                 pad_rows(rivals), name="my_margin")


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateBaselineWarning)
        return call(fn, *args, **kw)


def test_the_positions_are_each_examples_own(task):
    n = len(task)
    pos, tok, last = task.answer_positions, task.answer_tokens, task.last_positions
    assert pos.shape == tok.shape and pos.shape[0] == n and last.shape == (n,)
    for i, e in enumerate(task.examples):
        # the sibling margin reads the corrupted target's answer step, one before it
        steps = [e.answer_pos[e.targets.index(e.meta["p2_target"])]]
        k = len(steps)
        assert pos[i, :k].tolist() == [p - 1 for p in steps]
        assert (pos[i, k:] == -1).all() and tok[i, :k].tolist() == e.tokens[steps].tolist()
        assert int(last[i]) == len(e.tokens) - 1 < task.clean_tokens.shape[1]
        assert int(pos[i, :k].max()) < len(e.tokens)  # never in its padding
    p1 = task.with_phase(1)
    assert p1.answer_positions[0, : len(p1.examples[0].anchor_pos)].tolist() == [
        p - 1 for p in p1.examples[0].anchor_pos]  # phase 1: the anchor steps


def test_at_answers_on_right_padded_task_tokens_equals_task_metric(teacher, task):
    """The helper, on the padded batch's logits, gives task.metric's values (per prompt, to
    1e-6), and a sweep with it gives the task metric's sweep (to 1e-5)."""
    assert all(e.meta["p2_siblings"] for e in task.examples)  # (else: the vocab mean)
    mine = margin_reading(task, [task.label_token_ids[e.meta["p2_siblings"]].tolist()
                                 for e in task.examples])
    with torch.no_grad():
        logits = teacher(task.clean_tokens)
    torch.testing.assert_close(mine.per_prompt(logits), task.metric.per_prompt(logits),
                               atol=1e-6, rtol=0)
    assert float(mine(logits)) == pytest.approx(float(task.metric(logits)), abs=1e-6)
    ref = quiet(ck.patch_heads, teacher, task.clean_tokens, task.corrupt_tokens, task.metric,
                progress=False)
    got = quiet(ck.patch_heads, teacher, task.clean_tokens, task.corrupt_tokens, mine,
                progress=False)
    torch.testing.assert_close(got.values, ref.values, atol=1e-5, rtol=0)
    for i, e in enumerate(task.examples):  # each prompt as its unpadded run gives it
        with torch.no_grad():
            alone = float(task.subset([i]).metric(teacher(e.tokens[None])))
        assert float(got.clean_per_prompt[i]) == pytest.approx(alone, abs=1e-5)
    # phase 1 (anchor margin, rivals: the corrupt evidence's anchors) the same way
    t1 = task.with_phase(1)
    assert all(e.meta.get("corrupt_anchors") for e in t1.examples)
    one = margin_reading(t1, [t1.anchor_token_ids[e.meta["corrupt_anchors"]].tolist()
                              for e in t1.examples])
    with torch.no_grad():
        logits1 = teacher(t1.clean_tokens)
    torch.testing.assert_close(one.per_prompt(logits1), t1.metric.per_prompt(logits1),
                               atol=1e-6, rtol=0)


def test_the_idiom_is_refused_naming_the_helpers_and_last_positions_reads_its_own(teacher,
                                                                                   task):
    """l[:, -1, tgt] on the padded tokens: refused, in one line naming at_answers,
    answer_positions and last_positions. The idiom with task.last_positions in place of -1 is
    accepted and reads each prompt's own last position (a hand loop over unpadded prompts)."""
    tgt = int(task.label_token_ids[0])
    with pytest.raises(ValueError) as e:
        ck.patch_heads(teacher, task.clean_tokens, task.corrupt_tokens,
                       lambda logits: logits[:, -1, tgt].mean(), options=dict(progress=False))
    msg = str(e.value)
    assert "right-padded" in msg and "\n" not in msg
    for name in ("ck.metrics.at_answers", "task.answer_positions", "task.last_positions"):
        assert name in msg
    n, last = len(task), task.last_positions
    res = quiet(ck.patch_heads, teacher, task.clean_tokens, task.corrupt_tokens,
                lambda logits: logits[torch.arange(n), last, tgt], progress=False)
    with torch.no_grad():
        want = [float(teacher(e.tokens[None])[0, -1, tgt]) for e in task.examples]
    torch.testing.assert_close(res.clean_per_prompt.float(), torch.tensor(want), atol=1e-5,
                               rtol=0)


def test_at_answers_bad_input_is_one_line():
    pos = torch.tensor([[2, 3], [4, -1]])
    cases = [
        (dict(reading=5, positions=pos), "reading must be callable"),
        (dict(reading=lambda s: s[..., 0], positions=torch.zeros(2, 2)), "must be integer"),
        (dict(reading=lambda s: s[..., 0], positions=[["a"]]), "one list of ints per prompt"),
        (dict(reading=lambda s, t: s[..., 0], positions=pos, extra=torch.zeros(3, 2)),
         "one row per prompt"),
    ]
    for kw, want in cases:
        extra = (kw.pop("extra"),) if "extra" in kw else ()
        with pytest.raises(ValueError, match=want) as e:
            ck.metrics.at_answers(kw["reading"], kw["positions"], *extra)
        assert "\n" not in str(e.value)
    bad = ck.metrics.at_answers(lambda s: s.sum(), pos)  # a scalar: not per position/prompt
    with pytest.raises(ValueError, match=r"reading returned \(\); expected \(2, 2\)"):
        bad.per_prompt(torch.randn(2, 6, 10, generator=torch.Generator().manual_seed(0)))
    one = ck.metrics.at_answers(lambda s: s[..., 7], torch.tensor([5, 2]))  # [n]: one each
    x = torch.randn(2, 6, 10, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(one.per_prompt(x), x[[0, 1], [5, 2], 7], atol=0, rtol=0)
    assert one.read_positions().tolist() == [[5], [2]]
