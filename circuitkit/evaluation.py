"""Evaluation of a model on a CoT task: Reasoning Focus, Near-Miss Confusion, F1, exact match.

Definitions (positions follow the task layout: the token at p is predicted from logits at p - 1):

* **focus** (Reasoning Focus), teacher-forced: at each Phase-1 step p in ``anchor_pos``, softmax of
  ``logits[p - 1]`` restricted to the task's anchor tokens; focus_step = mass on the example's
  correct anchors (``anchor_token_ids[example.anchors]``). Mean over steps, then over examples.
* **confusion** (Near-Miss Confusion), teacher-forced: at each answer step p in ``answer_pos``,
  softmax of ``logits[p - 1]`` restricted to the tokens of targets + near-misses; confusion_step =
  mass on the near-misses. Mean over steps, then over examples (0 for an example without
  near-misses).
* Greedy decoding from the prompt ``tokens[: <think> position + 1]`` (the note and ``<think>``)
  up to ``<eos>`` or ``max_new_tokens``; the predicted set = label tokens between ``</think>`` and
  ``<eos>``
  (empty if ``</think>`` is never emitted).
* **confusion_rate**: share of examples whose predicted set contains a near-miss of that example.
* **exact_match**: share of examples with predicted set == target set.
* **micro_f1** = 2 TP / (2 TP + FP + FN) pooled over examples and labels; **macro_f1** = mean over
  labels that occur in a target or predicted set of 2 TP_l / (2 TP_l + FP_l + FN_l).

A ``las`` key (distillation) can be added to ``evaluate``'s output without changing the others.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from circuitkit.tasks.base import Task

__all__ = ["evaluate", "restricted_mass", "focus_from_logits", "confusion_from_logits",
           "f1_scores", "set_metrics", "parse_answer", "greedy_decode"]


# --- pure functions on tensors/sets ---------------------------------------------------------------
def restricted_mass(
    logits: Float[Tensor, "batch seq vocab"],
    positions: Sequence[Sequence[int]],
    candidates: Sequence[Sequence[int]],
    good: Sequence[Sequence[int]],
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


def focus_from_logits(logits: Float[Tensor, "batch seq vocab"],
                      task: Task) -> Float[Tensor, " batch"]:
    """Reasoning Focus per example (``task.examples`` aligned with ``logits``' batch)."""
    all_anchors = task.anchor_token_ids.tolist()
    ex = task.examples
    return restricted_mass(logits, [e.anchor_pos for e in ex], [all_anchors] * len(ex),
                           [task.anchor_token_ids[e.anchors].tolist() for e in ex])


def confusion_from_logits(logits: Float[Tensor, "batch seq vocab"],
                          task: Task) -> Float[Tensor, " batch"]:
    """Near-Miss Confusion per example (``task.examples`` aligned with ``logits``' batch)."""
    ex = task.examples
    lt = task.label_token_ids
    return restricted_mass(logits, [e.answer_pos for e in ex],
                           [lt[e.targets + e.near_misses].tolist() for e in ex],
                           [lt[e.near_misses].tolist() for e in ex])


def f1_scores(pred_sets: Sequence[set[int]], true_sets: Sequence[set[int]]) -> tuple[float, float]:
    """(macro_f1, micro_f1) of predicted vs true label sets (see module docstring).

    Both are 1.0 when there is nothing to predict and nothing predicted.
    """
    tp: dict[int, int] = {}
    fp: dict[int, int] = {}
    fn: dict[int, int] = {}
    for p, t in zip(pred_sets, true_sets, strict=True):
        for lab in p & t:
            tp[lab] = tp.get(lab, 0) + 1
        for lab in p - t:
            fp[lab] = fp.get(lab, 0) + 1
        for lab in t - p:
            fn[lab] = fn.get(lab, 0) + 1
    labels = set(tp) | set(fp) | set(fn)
    if not labels:
        return 1.0, 1.0
    per = [2 * tp.get(lab, 0) / (2 * tp.get(lab, 0) + fp.get(lab, 0) + fn.get(lab, 0))
           for lab in labels]
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


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


@torch.no_grad()
def greedy_decode(model, prompts: Sequence[Int[Tensor, " p"]], eos_id: int, max_new_tokens: int,
                  batch_size: int = 64, on_batch=None) -> list[list[int]]:
    """Greedy continuation of each prompt (new tokens only, cut after the first ``eos_id``).

    Prompts are grouped by length so every batch is unpadded (exact, no attention mask needed).
    """
    dev = _device(model)
    out: list[list[int]] = [[] for _ in prompts]
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx_all in by_len.values():
        for s in range(0, len(idx_all), batch_size):
            idx = idx_all[s: s + batch_size]
            cur = torch.stack([prompts[i] for i in idx]).to(dev)
            done = torch.zeros(len(idx), dtype=torch.bool, device=dev)
            for _ in range(max_new_tokens):
                nxt = _logits(model, cur)[:, -1].argmax(-1)
                cur = torch.cat([cur, nxt[:, None]], 1)
                done |= nxt == eos_id
                if bool(done.all()):
                    break
            new = cur[:, len(prompts[idx[0]]):].tolist()
            for i, row in zip(idx, new, strict=True):
                out[i] = row[: row.index(eos_id) + 1] if eos_id in row else row
            if on_batch is not None:
                on_batch(len(idx))
    return out


def prompt_end(e, think_id: int | None) -> int:
    """Length of the prompt a model continues: the note up to and including ``<think>``."""
    toks = e.tokens.tolist()
    if think_id is not None and think_id in toks:
        return toks.index(think_id) + 1
    return min(e.anchor_pos + e.shortlist_pos + e.answer_pos)


# --- the model-facing entry point -----------------------------------------------------------------
@torch.no_grad()
def evaluate(model, task: Task, batch_size: int = 64, max_new_tokens: int | None = None,
             progress: bool = False) -> dict[str, float]:
    """Run ``model`` (``model(tokens) -> logits [batch, seq, vocab]``) on ``task``; see the module
    docstring for ``focus, confusion, confusion_rate, macro_f1, micro_f1, exact_match``.

    ``max_new_tokens`` defaults to the longest clean continuation after the prompt plus 4.
    Memory: one forward holds ``batch_size x seq x vocab`` float logits (lower ``batch_size`` for
    the 86k-token ``labels="all"`` vocabulary). ``progress``: a bar over notes (teacher-forced
    pass, then decoding).
    """
    if len(task) == 0:
        raise ValueError("evaluate needs a task with at least one example.")
    if hasattr(model, "cfg"):
        task.check_model(model)
    dev = _device(model)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=2 * len(task), desc="evaluate", unit="note", file=sys.stderr)
    focus, conf = [], []
    for s in range(0, len(task), batch_size):
        sub = task.subset(range(s, min(s + batch_size, len(task))))
        logits = _logits(model, sub.clean_tokens.to(dev))
        focus.append(focus_from_logits(logits, sub))
        conf.append(confusion_from_logits(logits, sub))
        if bar is not None:
            bar.update(len(sub))
    f, c = torch.cat(focus), torch.cat(conf)
    think = task.vocab.index("<think>") if "<think>" in task.vocab else None
    ends = [prompt_end(e, think) for e in task.examples]
    if max_new_tokens is None:
        rest = [len(e.tokens) - n for e, n in zip(task.examples, ends, strict=True)]
        max_new_tokens = max(rest) + 4
    gens = greedy_decode(model, [e.tokens[:n] for e, n in zip(task.examples, ends, strict=True)],
                         task.eos_id, max_new_tokens, batch_size,
                         on_batch=None if bar is None else bar.update)
    if bar is not None:
        bar.close()
    preds = [parse_answer(g, task) for g in gens]
    out = dict(focus=float(f.nanmean()) if f.numel() and not f.isnan().all() else float("nan"),
               confusion=float(c.nanmean()) if c.numel() and not c.isnan().all() else float("nan"))
    out.update(set_metrics(preds, [set(e.targets) for e in task.examples],
                           [set(e.near_misses) for e in task.examples]))
    return out
