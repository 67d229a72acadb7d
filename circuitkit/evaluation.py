"""Evaluation of a model on a CoT task: Reasoning Focus, Near-Miss Confusion, F1, exact match.

Definitions (positions follow the task layout: the token at p is predicted from logits at p - 1):

* **focus** (Reasoning Focus), teacher-forced: at each Phase-1 step p in ``anchor_pos``, softmax of
  ``logits[p - 1]`` restricted to the task's anchor tokens; focus_step = mass on the example's
  correct anchors (``anchor_token_ids[example.anchors]``), at any step: blind to order (issue
  34). Mean over steps, then over examples.
* **focus_per_step**: the same softmax at step j (``p = anchor_pos[j]``), mass on *that step's
  own* anchor only (the token at ``p`` when ``anchors`` is not one per step).
* **confusion** (Near-Miss Confusion), teacher-forced: at each answer step p in ``answer_pos``,
  softmax of ``logits[p - 1]`` restricted to the tokens of targets + near-misses; confusion_step =
  mass on the near-misses. Mean over steps, then over examples (0 without near-misses).
* Greedy decoding from the prompt ``tokens[: <think> position + 1]`` up to ``<eos>`` or
  ``max_new_tokens``; the predicted set = label tokens between ``</think>`` and ``<eos>`` (empty
  if ``</think>`` is never emitted).
* **confusion_rate**: share of examples whose predicted set contains a near-miss of that example.
* **exact_match**: share of examples with predicted set == target set.
* **micro_f1** = 2 TP / (2 TP + FP + FN) pooled over examples and labels; **macro_f1** = mean over
  labels that occur in a target or predicted set of 2 TP_l / (2 TP_l + FP_l + FN_l).
* **focus_embedding**, **confusion_embedding**: the paper's sentence-embedding measures
  (``circuitkit.embedding``, docs/metrics.md), with ``embedding_encoder``; NaN and None, with a
  one-line warning naming the ``embed`` extra, when the encoder is not installed.
* **step accuracy** (tasks whose ``config["step_accuracy"]`` is set: ``capitals``), teacher-forced:
  ``anchor_accuracy`` / ``answer_accuracy``: share of anchor / answer steps whose arg-max over the
  whole vocabulary is the correct token; ``*_accuracy_among``: among the anchor / label tokens
  only; ``*_chance``: 1 / number of anchors / labels; ``*_majority``: the share of the most
  frequent correct token.

A ``las`` key (distillation) can be added to ``evaluate``'s output without changing the others.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from circuitkit._progress import interactive, tqdm
from circuitkit.metrics import PromptMetric
from circuitkit.tasks.base import Task, check_task

__all__ = ["evaluate", "restricted_mass", "focus_from_logits", "focus_per_step_from_logits",
           "confusion_from_logits", "focus_metric", "confusion_metric", "restricted_mass_metric",
           "step_accuracy", "accuracy_baselines", "f1_scores", "set_metrics", "parse_answer",
           "greedy_decode", "teacher_forced_greedy"]


# --- pure functions on tensors/sets ---------------------------------------------------------------
def restricted_mass(logits: Float[Tensor, "batch seq vocab"], positions: Sequence[Sequence[int]],
                    candidates: Sequence[Sequence[int]], good: Sequence[Sequence[int]]
                    ) -> Float[Tensor, " batch"]:
    """Per example: mean over p in ``positions[i]`` of
    ``sum_{t in good[i]} softmax(logits[i, p - 1, candidates[i]])[t]``.

    ``good[i]`` must be a subset of ``candidates[i]``. NaN for an example without positions.
    """
    out = torch.full((logits.shape[0],), float("nan"))
    for i, (pos, cand, g) in enumerate(zip(positions, candidates, good, strict=True)):
        if not pos or not cand:
            continue
        cand_t = torch.as_tensor(list(cand), dtype=torch.long, device=logits.device)
        rows = logits[i, torch.as_tensor(pos, device=logits.device) - 1][:, cand_t].float()
        probs = rows.softmax(-1)  # [steps, n_cand]
        is_good = torch.isin(cand_t, torch.as_tensor(list(g), dtype=torch.long,
                                                     device=logits.device))
        out[i] = (probs * is_good).sum(-1).mean().cpu()
    return out


def focus_sets(task: Task) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Reasoning Focus's ``(positions, candidates, good)`` per example (``restricted_mass``):
    the anchor steps, every anchor token, the example's correct anchors' tokens."""
    anchors, ex = task.anchor_token_ids.tolist(), task.examples
    return ([e.anchor_pos for e in ex], [anchors] * len(ex),
            [task.anchor_token_ids[e.anchors].tolist() for e in ex])


def confusion_sets(task: Task) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Near-Miss Confusion's ``(positions, candidates, good)`` per example (``restricted_mass``):
    the answer steps, the tokens of the targets and near-misses, the near-misses' tokens."""
    lt, ex = task.label_token_ids, task.examples
    return ([e.answer_pos for e in ex], [lt[e.targets + e.near_misses].tolist() for e in ex],
            [lt[e.near_misses].tolist() for e in ex])


def focus_from_logits(logits: Float[Tensor, "batch seq vocab"],
                      task: Task) -> Float[Tensor, " batch"]:
    """Reasoning Focus per example (``task.examples`` aligned with ``logits``' batch)."""
    return restricted_mass(logits, *focus_sets(task))


def focus_per_step_from_logits(logits: Float[Tensor, "batch seq vocab"],
                               task: Task) -> Float[Tensor, " batch"]:
    """Per-step Reasoning Focus per example (module docstring): at each anchor step, the mass on
    that step's own anchor among all anchors; NaN for an example without anchor steps."""
    all_anchors = task.anchor_token_ids.tolist()
    out = torch.full((logits.shape[0],), float("nan"))
    for i, e in enumerate(task.examples):
        own = (task.anchor_token_ids[e.anchors].tolist() if len(e.anchors) == len(e.anchor_pos)
               else [int(e.tokens[p]) for p in e.anchor_pos])
        steps = [restricted_mass(logits[i:i + 1], [[p]], [all_anchors], [[a]])[0]
                 for p, a in zip(e.anchor_pos, own, strict=True) if a in all_anchors]
        if steps:
            out[i] = torch.stack(steps).mean()
    return out


def confusion_from_logits(logits: Float[Tensor, "batch seq vocab"],
                          task: Task) -> Float[Tensor, " batch"]:
    """Near-Miss Confusion per example (``task.examples`` aligned with ``logits``' batch)."""
    return restricted_mass(logits, *confusion_sets(task))


def step_reads(pos: Int[Tensor, "n k"]) -> Int[Tensor, "n k"]:
    """Logit rows ``p - 1`` of the steps ``pos`` (-1 padded; padding repeats the first step):
    a step metric's ``PromptMetric.reads``."""
    first = torch.where(pos[:, :1] >= 1, pos[:, :1] - 1, torch.zeros_like(pos[:, :1]))
    return torch.where(pos >= 1, pos - 1, first)


def restricted_mass_metric(positions: Sequence[Sequence[int]],
                           candidates: Sequence[Sequence[int]],
                           good: Sequence[Sequence[int]], name: str) -> PromptMetric:
    """Per prompt: mean over ``p`` in ``positions[i]`` of the softmax of ``logits[p - 1]``
    restricted to ``candidates[i]``, summed over ``good[i]`` (``restricted_mass`` as a
    ``PromptMetric`` with ``reads``, for patching; 0 for a prompt without positions, where
    ``restricted_mass`` gives NaN)."""
    from circuitkit.scoring.heads import _padded

    pos, cand = _padded(positions), _padded(candidates)
    is_good = torch.stack([torch.isin(c, torch.as_tensor(list(g), dtype=torch.long))
                           for c, g in zip(cand, good, strict=True)]) & (cand >= 0)

    def fn(logits: Tensor, idx: Tensor, rows: Tensor) -> Tensor:
        dev = logits.device
        p, c, g = pos[idx].to(dev), cand[idx].to(dev), is_good[idx].to(dev)
        valid = p >= 1
        b = torch.arange(logits.shape[0], device=dev)[:, None]
        step = logits[b, rows[b, (p - 1).clamp(min=0)]].float()  # [n, steps, vocab]
        cl = step.gather(-1, c.clamp(min=0)[:, None, :].expand(-1, step.shape[1], -1))
        cl = cl.masked_fill(~(c >= 0)[:, None, :], float("-inf"))
        mass = (cl.softmax(-1) * g[:, None, :]).sum(-1) * valid
        return mass.sum(-1) / valid.sum(-1).clamp(min=1)

    return PromptMetric(fn, name, reads=step_reads(pos))


def focus_metric(task: Task) -> PromptMetric:
    """Reasoning Focus per prompt (``focus_from_logits``) as a ``PromptMetric``."""
    return restricted_mass_metric(*focus_sets(task), "focus")


def confusion_metric(task: Task) -> PromptMetric:
    """Near-Miss Confusion per prompt (``confusion_from_logits``) as a ``PromptMetric``."""
    return restricted_mass_metric(*confusion_sets(task), "confusion")


def step_accuracy(logits: Float[Tensor, "batch seq vocab"], task: Task
                  ) -> dict[str, list[bool]]:
    """Teacher-forced top-1 hits per step (one entry per step of every example): at each
    ``anchor_pos`` step, whether ``logits[p - 1]``'s arg-max over the whole vocabulary
    (``anchor``) and over the task's anchor tokens (``anchor_among``) is the token at ``p``;
    the same at ``answer_pos`` steps over labels (``answer``, ``answer_among``)."""
    out: dict[str, list[bool]] = {k: [] for k in ("anchor", "anchor_among", "answer",
                                                  "answer_among")}
    for i, e in enumerate(task.examples):
        for kind, pos, cands in (("anchor", e.anchor_pos, task.anchor_token_ids),
                                 ("answer", e.answer_pos, task.label_token_ids)):
            cands = cands.to(logits.device)
            for p in pos:
                row, want = logits[i, p - 1], int(e.tokens[p])
                out[kind].append(int(row.argmax()) == want)
                out[kind + "_among"].append(int(cands[row[cands].argmax()]) == want)
    return out


def accuracy_baselines(task: Task, hits: dict[str, list[bool]]) -> dict[str, float]:
    """``step_accuracy``'s hits as accuracies, beside chance (a uniform guess among the anchors /
    labels) and the majority class (always the most frequent correct token): ``anchor_accuracy``
    (arg-max over the vocabulary), ``anchor_accuracy_among`` (among anchors), ``anchor_chance``,
    ``anchor_majority``, and the same four for ``answer``."""
    out: dict[str, float] = {}
    for kind, field, ids in (("anchor", "anchor_pos", task.anchor_token_ids),
                             ("answer", "answer_pos", task.label_token_ids)):
        truth = [int(e.tokens[p]) for e in task.examples for p in getattr(e, field)]
        n = len(truth)
        out[f"{kind}_accuracy"] = sum(hits[kind]) / n if n else float("nan")
        out[f"{kind}_accuracy_among"] = sum(hits[kind + "_among"]) / n if n else float("nan")
        out[f"{kind}_chance"] = 1 / len(ids) if len(ids) else float("nan")
        out[f"{kind}_majority"] = max(Counter(truth).values()) / n if n else float("nan")
    return out


def f1_scores(pred_sets: Sequence[set[int]], true_sets: Sequence[set[int]]) -> tuple[float, float]:
    """(macro_f1, micro_f1) of predicted vs true label sets (see module docstring).

    Both are 1.0 when there is nothing to predict and nothing predicted.
    """
    tp: Counter[int] = Counter()
    fp: Counter[int] = Counter()
    fn: Counter[int] = Counter()
    for p, t in zip(pred_sets, true_sets, strict=True):
        tp.update(p & t)
        fp.update(p - t)
        fn.update(t - p)
    labels = set(tp) | set(fp) | set(fn)
    if not labels:
        return 1.0, 1.0
    per = [2 * tp[lab] / (2 * tp[lab] + fp[lab] + fn[lab]) for lab in labels]
    TP, FP, FN = sum(tp.values()), sum(fp.values()), sum(fn.values())
    return sum(per) / len(per), 2 * TP / (2 * TP + FP + FN)


def set_metrics(pred_sets: Sequence[set[int]], true_sets: Sequence[set[int]],
                near_sets: Sequence[set[int]]) -> dict[str, float]:
    """exact_match, confusion_rate, macro_f1, micro_f1 of predicted label sets."""
    n = max(1, len(true_sets))
    macro, micro = f1_scores(pred_sets, true_sets)
    return dict(
        exact_match=sum(p == t for p, t in zip(pred_sets, true_sets, strict=True)) / n,
        confusion_rate=sum(bool(p & m) for p, m in zip(pred_sets, near_sets, strict=True)) / n,
        macro_f1=macro, micro_f1=micro)


def task_set_metrics(generations: Sequence[Sequence[int]], task: Task) -> dict[str, float]:
    """``set_metrics`` of ``task``'s decoded continuations against its targets and near-misses."""
    return set_metrics([parse_answer(g, task) for g in generations],
                       [set(e.targets) for e in task.examples],
                       [set(e.near_misses) for e in task.examples])


def parse_answer(generated: Sequence[int], task: Task) -> set[int]:
    """Label ids among the tokens after the first ``</think>`` and before the next ``<eos>``."""
    gen = list(generated)
    if "</think>" in task.vocab:
        end = task.vocab.index("</think>")
        if end not in gen:
            return set()
        gen = gen[gen.index(end) + 1:]
    if task.eos_id in gen:
        gen = gen[: gen.index(task.eos_id)]
    tok2label = {int(t): i for i, t in enumerate(task.label_token_ids.tolist())}
    return {tok2label[t] for t in gen if t in tok2label}


def _logits(model, tokens: Tensor) -> Tensor:
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def _causal(model, tokens: Tensor | None = None, vocab: int | None = None) -> bool:
    """Whether ``model`` is causal: its logits at ``p`` never read a token after ``p``. A config
    that says ``attention_dir="bidirectional"`` settles it (no); otherwise it is *measured*
    (``reads_ahead``) on ``tokens`` ``[batch, seq]``: a config can say causal of a model that is not
    (a hand-built module, a wrapped callable, a look-ahead bug), and any callable without a config
    may read the whole row. Without ``tokens``: the config alone (False without one)."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and getattr(cfg, "attention_dir", "causal") == "bidirectional":
        return False
    if tokens is None:
        return cfg is not None
    return not reads_ahead(model, tokens, vocab)


@torch.no_grad()
def reads_ahead(model, tokens: Int[Tensor, "batch seq"], vocab: int | None = None) -> bool:
    """Whether ``model``'s logits at some position ``p`` change when every token after ``p`` is
    changed, probed on up to 2 rows of ``tokens`` at three cuts (``p`` = 0, the middle, the
    next to last): each row's tokens after the cut are replaced by ``(t + 1) % vocab`` (so every
    one differs; ``vocab``: default the largest id + 1), all variants in one forward. The
    logits up to the cut must equal the unchanged row's within a dtype-fitted tolerance
    (64 x eps x the largest |logit|: a causal model gives the same bits, a model that reads
    ahead moves them by its logits' scale)."""
    rows = tokens[:2]  # (8 rows in one forward: a [8, seq, vocab] logits tensor)
    seq = rows.shape[1]
    if seq < 2:
        return False  # nothing after any position to read
    vocab = int(tokens.max()) + 1 if vocab is None else int(vocab)
    cuts = sorted({0, (seq - 1) // 2, seq - 2})
    variants = [rows]
    for cut in cuts:
        v = rows.clone()
        v[:, cut + 1:] = (v[:, cut + 1:] + 1) % max(vocab, 2)
        variants.append(v)
    logits = _logits(model, torch.cat(variants).to(_device(model)))
    eps = torch.finfo(logits.dtype if logits.is_floating_point() else torch.float32).eps
    logits = logits.float()
    base, n = logits[:len(rows)], len(rows)
    tol = 64 * eps * max(1.0, float(base.abs().max()))
    for k, cut in enumerate(cuts, start=1):
        got = logits[k * n:(k + 1) * n, :cut + 1]
        if float((got - base[:, :cut + 1]).abs().max()) > tol:
            return True
    return False


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def length_batches(prompts: Sequence[Tensor], batch_size: int
                   ) -> Iterator[tuple[int, list[int]]]:
    """``(length, indices)``: batches of at most ``batch_size`` prompts of one length (unpadded:
    exact, no attention mask needed)."""
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for n, idx in by_len.items():
        for s in range(0, len(idx), batch_size):
            yield n, idx[s: s + batch_size]


@torch.no_grad()
def greedy_decode(model, prompts: Sequence[Int[Tensor, " p"]], eos_id: int, max_new_tokens: int,
                  batch_size: int = 64, on_batch=None) -> list[list[int]]:
    """Greedy continuation of each prompt (new tokens only, cut after the first ``eos_id``).

    Prompts are grouped by length (``length_batches``).
    """
    dev = _device(model)
    out: list[list[int]] = [[] for _ in prompts]
    for n, idx in length_batches(prompts, batch_size):
        cur = torch.stack([prompts[i] for i in idx]).to(dev)
        done = torch.zeros(len(idx), dtype=torch.bool, device=dev)
        for _ in range(max_new_tokens):
            nxt = _logits(model, cur)[:, -1].argmax(-1)
            cur = torch.cat([cur, nxt[:, None]], 1)
            done |= nxt == eos_id
            if bool(done.all()):
                break
        for i, row in zip(idx, cur[:, n:].tolist(), strict=True):
            out[i] = _until_eos(row, eos_id)
        if on_batch is not None:
            on_batch(len(idx))
    return out


def _until_eos(row: list[int], eos_id: int) -> list[int]:
    return row[: row.index(eos_id) + 1] if eos_id in row else row


def teacher_forced_greedy(model, task: Task, ends: Sequence[int],
                          argmax: Sequence[Int[Tensor, " seq"]], max_new_tokens: int,
                          batch_size: int = 64, on_batch=None) -> list[list[int]]:
    """``greedy_decode`` of each example's prompt ``tokens[:ends[i]]``, decided from its
    teacher-forced pass where it can be. ``argmax[i][p]``: the arg-max of the clean run's
    ``logits[p]``. Greedy step ``t`` emits ``argmax(logits[ends[i] - 1 + t])`` of the prefix
    ``tokens[:ends[i] + t]``; while its tokens equal the example's own continuation ``c =
    tokens[ends[i]:]`` the prefix *is* the clean one, so step ``t`` is ``argmax[i][ends[i] - 1 +
    t]``. An example whose first ``T`` steps match (``T``: up to and including ``c``'s first
    ``<eos>``, at most ``max_new_tokens``) is ``c[:T]`` with no decoding; any other is decoded
    greedily from its last matching prefix ``tokens[:ends[i] + t*]`` (``t*``: the first step
    that differs, or the end of ``c``) for the ``max_new_tokens - t*`` steps left, after
    ``c[:t*]``. All of this holds for a causal model only (``_causal``, measured): a model that
    reads ahead is decoded greedily from every prompt, with nothing taken from its pass."""
    eos = task.eos_id
    # the shortcut and the padding below are exact for a causal model only, and whether the
    # model is one is measured: a look-ahead model would score its own teacher-forced pass
    vocab = len(task.vocab)  # (the probe's changed tokens stay inside both vocabularies)
    d_vocab = getattr(getattr(model, "cfg", None), "d_vocab", None)
    vocab = min(vocab, int(d_vocab)) if isinstance(d_vocab, int) and d_vocab > 0 else vocab
    causal = _causal(model, task.clean_tokens[:2], vocab)
    out: list[list[int] | None] = [None] * len(task.examples)
    rest: list[tuple[int, int]] = []  # (example, steps already matched)
    for i, (e, n) in enumerate(zip(task.examples, ends, strict=True)):
        if not causal:  # decoded for real, from its prompt
            rest.append((i, 0))
            continue
        c = e.tokens[n:].tolist()
        pred = argmax[i][n - 1:len(e.tokens) - 1].tolist()  # step t's token, teacher-forced
        stop = c.index(eos) + 1 if eos in c else len(c)
        want = min(stop, max_new_tokens)
        t = next((t for t in range(want) if pred[t] != c[t]), want)
        if t == want and (want == max_new_tokens or (eos in c and want == stop)):
            out[i] = c[:want]
            if on_batch is not None:
                on_batch(1)
        else:
            rest.append((i, t))
    prompts = [task.examples[i].tokens[:ends[i] + t] for i, t in rest]
    gens = (padded_greedy(model, prompts, eos, [max_new_tokens - t for _, t in rest], batch_size,
                          on_batch=on_batch) if causal else
            greedy_decode(model, prompts, eos, max_new_tokens, batch_size, on_batch=on_batch))
    for (i, t), g in zip(rest, gens, strict=True):
        out[i] = task.examples[i].tokens[ends[i]:ends[i] + t].tolist() + g
    return [g for g in out if g is not None]


@torch.no_grad()
def padded_greedy(model, prompts: Sequence[Int[Tensor, " p"]], eos_id: int,
                  steps: Sequence[int], batch_size: int = 64, on_batch=None) -> list[list[int]]:
    """``greedy_decode`` with prompts of any lengths in one batch (causal model): the rows are
    right-padded in a ``[B, max(len_i + steps_i)]`` buffer, and each step runs the rows still
    decoding up to the longest of them, takes row ``i``'s arg-max at its own last position
    ``len_i - 1`` and writes it at ``len_i`` (a causal model's logits at ``p`` never read
    positions after ``p``, so the padding changes nothing a row reads). Row ``i`` stops after
    ``eos_id`` or ``steps[i]`` tokens; new tokens only, cut after the first ``eos_id``."""
    dev = _device(model)
    out: list[list[int]] = [[] for _ in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        length = torch.tensor([len(prompts[i]) for i in idx], device=dev)
        left = torch.tensor([int(steps[i]) for i in idx], device=dev)
        buf = torch.full((len(idx), int((length + left).max())), eos_id, dtype=torch.long,
                         device=dev)
        for r, i in enumerate(idx):
            buf[r, :len(prompts[i])] = prompts[i].to(dev)
        start = length.clone()
        live = (left > 0).nonzero()[:, 0]  # the rows still decoding: only they run
        while len(live):
            width = int(length[live].max())
            at = torch.arange(len(live), device=dev)
            nxt = _logits(model, buf[live, :width])[at, length[live] - 1].argmax(-1)
            buf[live, length[live]] = nxt
            length[live] += 1
            left[live] -= 1
            live = live[(nxt != eos_id) & (left[live] > 0)]
        for r, i in enumerate(idx):
            out[i] = buf[r, int(start[r]):int(length[r])].tolist()
        if on_batch is not None:
            on_batch(len(idx))
    return out


def non_finite_parameters(model) -> list[str]:
    """Names of ``model``'s parameters holding NaN or inf (none without ``named_parameters``)."""
    params = getattr(model, "named_parameters", None)
    return [] if params is None else [n for n, p in params() if not bool(torch.isfinite(p).all())]


def check_finite_model(model) -> None:
    """Refuse (``ValueError``) a model whose parameters hold NaN or inf, naming a few."""
    bad = non_finite_parameters(model)
    if bad:
        raise ValueError(f"the model's weights hold NaN/inf in {len(bad)} parameter(s) (e.g. "
                         f"{', '.join(bad[:3])}): nothing meaningful to evaluate. Is it a "
                         "diverged training run?")


def prompt_end(e, think_id: int | None) -> int:
    """Length of the prompt a model continues: the note up to and including ``<think>``."""
    toks = e.tokens.tolist()
    if think_id is not None and think_id in toks:
        return toks.index(think_id) + 1
    return min(e.anchor_pos + e.shortlist_pos + e.answer_pos)


def think_id(task: Task) -> int | None:
    return task.vocab.index("<think>") if "<think>" in task.vocab else None


def task_prompts(task: Task) -> tuple[list[Tensor], int]:
    """Each note's prompt (``prompt_end``) and ``evaluate``'s default ``max_new_tokens``: the
    longest continuation after a prompt, plus 4."""
    think = think_id(task)
    ends = [prompt_end(e, think) for e in task.examples]
    return ([e.tokens[:n] for e, n in zip(task.examples, ends, strict=True)],
            max(len(e.tokens) - n for e, n in zip(task.examples, ends, strict=True)) + 4)


def _nanmean(t: Tensor) -> float:
    return float(t.nanmean()) if t.numel() and not t.isnan().all() else float("nan")


# --- the model-facing entry point -----------------------------------------------------------------
@torch.no_grad()
def evaluate(model, task: Task, batch_size: int = 64, max_new_tokens: int | None = None,
             progress: bool | None = None, las: bool = False,
             las_train: Task | None = None, embeddings: bool = True) -> dict[str, Any]:
    """Run ``model`` (``model(tokens) -> logits [batch, seq, vocab]``) on ``task``; see the module
    docstring for ``focus, focus_per_step, confusion, confusion_rate, macro_f1, micro_f1,
    exact_match``.

    ``max_new_tokens`` defaults to the longest clean continuation after the prompt plus 4. Memory:
    one forward holds ``batch_size x seq x vocab`` float logits (lower ``batch_size`` for the
    86k-token ``labels="all"`` vocabulary). ``progress``: a bar over notes (teacher-forced pass,
    then decoding); None (the default): in a terminal or a notebook, not in a log
    (``_progress.interactive``). ``las``: add ``las``, ``las_ci_low``, ``las_ci_high`` (``las``
    below; the simulator trains on ``las_train``'s notes, else cross-fits two halves of ``task``).
    ``embeddings``: add the paper's ``focus_embedding``, ``confusion_embedding`` and
    ``embedding_encoder`` (module docstring) from the decoded continuations.
    """
    check_task(task, "evaluate")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be a positive integer; got {batch_size!r}.")
    if hasattr(model, "cfg"):
        task.check_model(model)
    check_finite_model(model)
    dev = _device(model)
    if progress is None:
        progress = interactive()
    bar = tqdm(total=2 * len(task), desc="evaluate (teacher-forced, then decoding)",
               unit="note-pass", file=sys.stderr, disable=not progress)
    focus, focus_step, conf, argmax = [], [], [], []
    hits: dict[str, list[bool]] = {}  # step accuracy (tasks whose config asks for it: capitals)
    for s in range(0, len(task), batch_size):
        sub = task.subset(range(s, min(s + batch_size, len(task))))
        logits = _logits(model, sub.clean_tokens.to(dev))
        if not bool(torch.isfinite(logits).all()):  # every metric below would be NaN or noise
            raise ValueError(f"evaluate: the model's logits are not finite (NaN/inf) on notes "
                             f"{s}..{s + len(sub) - 1}; its metrics would be meaningless. Is it "
                             "a diverged training run?")
        focus.append(focus_from_logits(logits, sub))
        focus_step.append(focus_per_step_from_logits(logits, sub))
        conf.append(confusion_from_logits(logits, sub))
        argmax += list(logits.argmax(-1).cpu())
        if task.config.get("step_accuracy"):
            for k, v in step_accuracy(logits, sub).items():
                hits.setdefault(k, []).extend(v)
        bar.update(len(sub))
    prompts, default_new = task_prompts(task)
    gens = teacher_forced_greedy(model, task, [len(p) for p in prompts], argmax,
                                 default_new if max_new_tokens is None else max_new_tokens,
                                 batch_size, on_batch=bar.update)
    bar.close()
    out = dict(focus=_nanmean(torch.cat(focus)), focus_per_step=_nanmean(torch.cat(focus_step)),
               confusion=_nanmean(torch.cat(conf)))
    out.update(task_set_metrics(gens, task))
    if embeddings:
        out.update(embedding_keys(task, gens))
    if hits:
        out.update(accuracy_baselines(task, hits))
    if las:
        res = las_of(model, task, las_train, generations=gens, batch_size=batch_size)
        out.update({k: res[k] for k in ("las", "las_ci_low", "las_ci_high")})
    return out


def embedding_keys(task: Task, generations: Sequence[Sequence[int]]) -> dict[str, Any]:
    """``embedding.embedding_metrics`` of the decoded continuations; NaN (and a one-line
    warning naming the ``embed`` extra) when the sentence encoder is not installed."""
    from circuitkit import embedding

    try:
        encoder = embedding.load_encoder()
    except embedding.EncoderMissing as err:
        warnings.warn(str(err), stacklevel=3)
        return dict(focus_embedding=float("nan"), confusion_embedding=float("nan"),
                    embedding_encoder=None)
    return embedding.embedding_metrics(task, generations, encoder)


# --- LAS: leakage-adjusted simulatability (Hase et al. 2020; docs/distill.md, "LAS") -------
#
# A simulator predicts the model's decoded label set from the note (x), the note and the model's
# rationale (x + e: its CoT before ``</think>``), or e alone; an example *leaks* when e alone
# gets it right. With ``c(.)`` = 1 if the simulator's set equals the model's:
#
#     LAS = 1/2 [ mean_leaking (c(x+e) - c(x)) + mean_non-leaking (c(x+e) - c(x)) ]
#
# (a group without examples drops out); 95% interval: 2.5/97.5 percentiles over ``n_boot``
# bootstrap resamples of the evaluation notes.


def las_score(correct_xe: Sequence[bool], correct_x: Sequence[bool], correct_e: Sequence[bool],
              n_boot: int = 1000, seed: int = 0) -> dict[str, float]:
    """LAS and its bootstrap 95% interval from per-example simulator correctness (see above).

    Returns ``las, las_ci_low, las_ci_high, n_leaking, n_nonleaking, acc_xe, acc_x, acc_e``.
    """
    xe = torch.as_tensor(list(correct_xe), dtype=torch.float64)
    x = torch.as_tensor(list(correct_x), dtype=torch.float64)
    leak = torch.as_tensor(list(correct_e), dtype=torch.bool)
    if not (len(xe) == len(x) == len(leak)) or len(xe) == 0:
        raise ValueError("las_score needs three equally long, non-empty lists of booleans "
                         f"(got {len(xe)}, {len(x)}, {len(leak)}).")
    if n_boot < 1:
        raise ValueError(f"n_boot must be a positive integer, got {n_boot}.")

    def las_of(idx: Tensor) -> Tensor:  # idx [B, n] -> LAS [B]
        d, lk = (xe - x)[idx], leak[idx].double()
        parts = []
        for g in (lk, 1 - lk):
            n = g.sum(-1)
            parts.append(torch.where(n > 0, (d * g).sum(-1) / n.clamp(min=1),
                                     torch.full_like(n, float("nan"))))
        return torch.stack(parts).nanmean(0)

    n = len(xe)
    value = float(las_of(torch.arange(n)[None])[0])
    gen = torch.Generator().manual_seed(seed)
    boot = las_of(torch.randint(0, n, (n_boot, n), generator=gen))
    boot = boot[~boot.isnan()]
    lo, hi = (torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
              if len(boot) else (float("nan"), float("nan")))
    return dict(las=value, las_ci_low=lo, las_ci_high=hi, n_leaking=int(leak.sum()),
                n_nonleaking=int((~leak).sum()), acc_xe=float(xe.mean()), acc_x=float(x.mean()),
                acc_e=float(leak.double().mean()))


class SignatureSimulator:
    """The default LAS simulator: a token-signature rule learner fitted by counting
    (docs/distill.md, "LAS"). From training rows ``(x, e, y)`` (note tokens, rationale tokens,
    answer set), the signature of label l in segment s in {x, e}:

        sig_s(l) = { t : P(t in s | l in y) >= support  and  P(t in s | l in y) >= lift P(t in s) }

    l is predicted iff it was seen at least ``min_count`` times, some given segment has a
    non-empty signature of l, and every given segment contains its whole signature of l.
    ``fit(xs, es, ys, warm=True)`` adds counts to the current ones (``las_gold_prefit``).
    """

    def __init__(self, vocab_size: int, label_token_ids: Tensor, support: float = 0.9,
                 lift: float = 3.0, min_count: int = 2):
        self.V, self.n_labels = int(vocab_size), len(label_token_ids)
        self.support, self.lift, self.min_count = float(support), float(lift), int(min_count)
        self.counts: dict[str, Tensor] | None = None

    def _presence(self, seqs: Sequence[Sequence[int] | None]) -> Tensor:
        out = torch.zeros(len(seqs), self.V)
        for i, q in enumerate(seqs):
            if q:
                out[i, torch.as_tensor(list(q), dtype=torch.long)] = 1.0
        return out

    def fit(self, xs: Sequence[Sequence[int]], es: Sequence[Sequence[int]],
            ys: Sequence[set[int]], warm: bool = False) -> SignatureSimulator:
        if self.counts is None or not warm:
            z = torch.zeros
            self.counts = dict(n=z(()), n_l=z(self.n_labels), x=z(self.V, self.n_labels),
                               e=z(self.V, self.n_labels), tx=z(self.V), te=z(self.V))
        c = self.counts
        for s in range(0, len(xs), 1024):
            Y = torch.zeros(len(xs[s: s + 1024]), self.n_labels)
            for i, y in enumerate(ys[s: s + 1024]):
                Y[i, list(y)] = 1.0
            Ax, Ae = self._presence(xs[s: s + 1024]), self._presence(es[s: s + 1024])
            c["n"] += len(Y)
            c["n_l"] += Y.sum(0)
            c["x"] += Ax.T @ Y
            c["e"] += Ae.T @ Y
            c["tx"] += Ax.sum(0)
            c["te"] += Ae.sum(0)
        return self

    def signatures(self) -> dict[str, Tensor]:
        """``{"x": [V, n_labels], "e": [V, n_labels]}`` booleans: t in sig_s(l)."""
        if self.counts is None:
            raise ValueError("SignatureSimulator used before fit.")
        c = self.counts
        seen = c["n_l"] >= self.min_count
        return {k: (c[k] >= self.support * c["n_l"])
                & (c[k] * c["n"] >= self.lift * c["n_l"] * c["t" + k][:, None]) & seen
                for k in ("x", "e")}

    @torch.no_grad()
    def predict(self, xs: Sequence[Sequence[int] | None], es: Sequence[Sequence[int] | None]
                ) -> list[set[int]]:
        sig = self.signatures()
        seen = self.counts["n_l"] >= self.min_count
        out: list[set[int]] = []
        for s in range(0, len(xs), 512):
            part = {"x": xs[s: s + 512], "e": es[s: s + 512]}
            ok = seen.expand(len(part["x"]), -1).clone()
            any_sig = torch.zeros_like(ok)
            for k, seqs in part.items():
                given = torch.tensor([q is not None for q in seqs])[:, None]
                absent = 1 - self._presence([q or [] for q in seqs])
                ok &= ~given | ((absent @ sig[k].float()) == 0)  # no signature token missing
                any_sig |= given & sig[k].any(0)[None]
            out += [set(row.nonzero()[:, 0].tolist()) for row in ok & any_sig]
        return out


def split_generation(generated: Sequence[int], task: Task) -> tuple[list[int], set[int]]:
    """``(rationale, answer)`` of a decoded continuation: the tokens before the first
    ``</think>`` (all of them if none) and ``parse_answer``'s label set."""
    gen = list(generated)
    end = task.vocab.index("</think>") if "</think>" in task.vocab else None
    rationale = gen[: gen.index(end)] if end is not None and end in gen else \
        [t for t in gen if t != task.eos_id]
    return rationale, parse_answer(gen, task)


def note_tokens(e, think_id: int | None) -> list[int]:
    """The simulator's input x: the note (after ``<bos>``, before ``<think>``)."""
    return e.tokens[1: prompt_end(e, think_id) - (1 if think_id is not None else 0)].tolist()


def decode_task(model, task: Task, batch_size: int = 64,
                max_new_tokens: int | None = None) -> list[list[int]]:
    """``greedy_decode`` of every note's prompt, with ``evaluate``'s default length."""
    prompts, default_new = task_prompts(task)
    return greedy_decode(model, prompts, task.eos_id,
                         default_new if max_new_tokens is None else max_new_tokens, batch_size)


def gold_simulation_data(task: Task) -> tuple[list[list[int]], list[list[int]], list[set[int]]]:
    """``(xs, es, ys)`` of a task's own notes, CoT (between ``<think>`` and ``</think>``) and
    targets: data to pre-train a simulator on (``pretrained_simulator``)."""
    think = think_id(task)
    gold = [e.tokens[prompt_end(e, think):].tolist() for e in task.examples]
    xs, es, _ = simulation_data(task, gold)
    return xs, es, [set(e.targets) for e in task.examples]


def simulation_data(task: Task, generations: Sequence[Sequence[int]]
                    ) -> tuple[list[list[int]], list[list[int]], list[set[int]]]:
    """``(xs, es, ys)``: each note (``note_tokens``) and the rationale and answer set of its
    decoded continuation (``split_generation``)."""
    split, think = [split_generation(g, task) for g in generations], think_id(task)
    return ([note_tokens(e, think) for e in task.examples], [r for r, _ in split],
            [a for _, a in split])


def gold_prefit_simulator(task: Task, **kw) -> SignatureSimulator:
    """A ``SignatureSimulator`` fitted to ``task``'s own gold CoT and answers (``las_gold_prefit``;
    passed to ``las`` as ``simulator``, a copy then adds the model's outputs)."""
    return SignatureSimulator(len(task.vocab), task.label_token_ids, **kw).fit(
        *gold_simulation_data(task))


pretrained_simulator = gold_prefit_simulator  # the name before issue 25


def las_gold_prefit(model, task: Task, train_task: Task | None, gold_task: Task, *,
                    simulator: SignatureSimulator | None = None, **kw) -> dict[str, float]:
    """``las`` with a simulator pre-fitted on ``gold_task``'s gold CoT and answers (disjoint from
    ``task``), then on the model's outputs for ``train_task``: *not* Hase et al.'s LAS (their
    simulator learns from the model's outputs only), kept under its own name. ``simulator``: an
    already pre-fitted one (``gold_prefit_simulator(gold_task)``) to skip refitting."""
    sim = simulator if simulator is not None else gold_prefit_simulator(gold_task)
    if getattr(sim, "counts", None) is None:
        raise ValueError("las_gold_prefit: simulator is not fitted; pass "
                         "gold_prefit_simulator(gold_task) or none.")
    return las(model, task, train_task, simulator=sim, **kw)


def las(model, task: Task, train_task: Task | None = None, *,
        generations: Sequence[Sequence[int]] | None = None,
        train_generations: Sequence[Sequence[int]] | None = None, simulator=None,
        n_boot: int = 1000, seed: int = 0, batch_size: int = 64) -> dict[str, float]:
    """LAS of ``model`` on ``task`` as Hase et al. (see above; ``las_score`` for the keys): the
    simulator learns only from the model's own outputs.

    ``train_task``: notes for training the simulator, disjoint from ``task``'s (e.g. the other
    split of a built-in task); None: two-fold cross-fitting on ``task`` (each half scored by a
    simulator trained on the other). ``generations`` / ``train_generations``: the model's
    decoded continuations of those notes if already at hand (``decode_task``). ``simulator``:
    an object with ``fit(xs, es, ys)`` and ``predict(xs, es) -> list[set]`` (``es[i] = None``:
    no rationale; ``xs[i] = None``: no note); default a fresh ``SignatureSimulator``. A fitted
    ``SignatureSimulator`` (``gold_prefit_simulator``) is copied and fitted further
    (``warm=True``): that is ``las_gold_prefit``, not Hase et al.'s LAS.
    """
    gens = list(generations) if generations is not None else decode_task(model, task,
                                                                         batch_size)
    if len(gens) != len(task):
        raise ValueError(f"generations has {len(gens)} rows for {len(task)} notes.")
    xs, es, ys = simulation_data(task, gens)
    base = simulator if simulator is not None else \
        SignatureSimulator(len(task.vocab), task.label_token_ids)
    warm = getattr(base, "counts", None) is not None  # pre-fitted: add the model's counts

    def fitted(fx: list, fe: list, fy: list):
        sim = copy.deepcopy(base)
        return sim.fit(fx, fe, fy, warm=True) if warm else sim.fit(fx, fe, fy)

    def score(sim, idx: list[int]) -> tuple[list[bool], list[bool], list[bool]]:
        px, pe, none = [xs[i] for i in idx], [es[i] for i in idx], [None] * len(idx)
        truth = [ys[i] for i in idx]
        return ([p == t for p, t in zip(sim.predict(px, pe), truth, strict=True)],
                [p == t for p, t in zip(sim.predict(px, none), truth, strict=True)],
                [p == t for p, t in zip(sim.predict(none, pe), truth, strict=True)])

    if train_task is not None:
        tg = list(train_generations) if train_generations is not None else \
            decode_task(model, train_task, batch_size)
        sim = fitted(*simulation_data(train_task, tg))
        c_xe, c_x, c_e = score(sim, list(range(len(task))))
    else:
        if len(task) < 4:
            raise ValueError("las without train_task cross-fits two halves of task: give at "
                             "least 4 notes, or a train_task.")
        half = len(task) // 2
        folds = [list(range(half)), list(range(half, len(task)))]
        c_xe, c_x, c_e = [False] * len(task), [False] * len(task), [False] * len(task)
        for k in (0, 1):
            fit_idx, ev_idx = folds[1 - k], folds[k]
            sim = fitted([xs[i] for i in fit_idx], [es[i] for i in fit_idx],
                         [ys[i] for i in fit_idx])
            for i, a, b, c in zip(ev_idx, *score(sim, ev_idx), strict=True):
                c_xe[i], c_x[i], c_e[i] = a, b, c
    return las_score(c_xe, c_x, c_e, n_boot=n_boot, seed=seed)


las_of = las  # ``evaluate``'s parameter ``las`` shadows the function inside it


@torch.no_grad()
def greedy_decode_cached(hf_model, prompts: Sequence[Int[Tensor, " p"]], eos_id: int,
                         max_new_tokens: int | Callable[[int], int], pad_id: int = 0,
                         batch_size: int = 256) -> list[list[int]]:
    """``greedy_decode`` for a plain HF causal LM, with its KV cache (``generate``, greedy):
    the same tokens (prompts grouped by length, unpadded; each row cut after its first
    ``eos_id``), ~10x faster on CPU than re-running the whole prefix every step. A model
    wrapped by a ``TransformerBridge`` cannot ``generate``: load its folder afresh.
    ``max_new_tokens``: a number, or a function of the prompt length."""
    out: list[list[int]] = [[] for _ in prompts]
    dev = _device(hf_model)
    for n, idx in length_batches(prompts, batch_size):
        gen = hf_model.generate(torch.stack([prompts[i] for i in idx]).to(dev), do_sample=False,
                                max_new_tokens=max_new_tokens(n) if callable(max_new_tokens)
                                else max_new_tokens, eos_token_id=eos_id, pad_token_id=pad_id)
        for i, row in zip(idx, gen[:, n:].tolist(), strict=True):
            out[i] = _until_eos(row, eos_id)
    return out
