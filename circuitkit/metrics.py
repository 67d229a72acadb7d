"""Patching metrics: logits -> scalar, with a per-prompt view for confidence intervals.

A metric follows TransformerLens's convention (``metric(logits) -> scalar tensor``). Metrics built
here are ``PromptMetric`` objects that also expose ``per_prompt(logits) -> [batch]`` so sweeps can
report per-prompt values and bootstrap intervals; the scalar is the mean over prompts. A plain
callable works everywhere too (no per-prompt values then). Positions follow the token layout: the
model's prediction of the token at position ``p`` is read from the logits at ``p - 1``.

This module imports only torch: tasks use it to build their default metric.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor


@dataclass
class PromptMetric:
    """A metric with a per-prompt view. ``metric(logits) == metric.per_prompt(logits).mean()``.

    ``per_prompt_fn(logits, prompt_idx, rows)``: ``rows[b, p]`` is the row of ``logits``'
    position axis holding prompt ``b``'s sequence position ``p`` (``rows[b, p] = p`` for full
    logits). ``reads``: ``[n_prompts, k]``, the logit positions each prompt's value depends on
    (rows padded by repetition), if known; sweeps then compute logits at those positions only,
    ``per_prompt(logits_at_reads, at=reads)`` with ``logits_at_reads[b, j] = logits[b,
    reads[b, j]]``, which skips most of the unembedding and the last block's MLP.
    ``select(idx)`` restricts the metric to a subset of prompts.
    """

    per_prompt_fn: Callable[[Tensor, Tensor, Tensor], Tensor]
    name: str = "metric"
    prompt_idx: Tensor | None = None
    reads: Int[Tensor, "n k"] | None = None

    def per_prompt(self, logits: Float[Tensor, "batch pos vocab"],
                   at: Int[Tensor, "batch k"] | None = None) -> Float[Tensor, " batch"]:
        idx = self.prompt_idx if self.prompt_idx is not None else torch.arange(logits.shape[0])
        if idx.numel() != logits.shape[0]:
            raise ValueError(
                f"{self.name}: logits have batch {logits.shape[0]} but the metric is defined for "
                f"{idx.numel()} prompts; pass the same prompts, or metric.select(indices)."
            )
        n = logits.shape[0]
        if at is None:
            rows = torch.arange(logits.shape[1]).expand(n, -1)
        else:
            at = at.cpu().expand(n, -1)
            rows = torch.full((n, int(at.max()) + 1), -1, dtype=torch.long)
            rows.scatter_(1, at, torch.arange(at.shape[1]).expand(n, -1))
        return self.per_prompt_fn(logits, idx.to(logits.device), rows.to(logits.device))

    def __call__(self, logits: Float[Tensor, "batch seq vocab"]) -> Float[Tensor, ""]:
        return self.per_prompt(logits).mean()

    def read_positions(self) -> Int[Tensor, "batch k"] | None:
        """``reads`` of the prompts this metric is defined for (after ``select``)."""
        if self.reads is None or self.prompt_idx is None:
            return self.reads
        return self.reads[self.prompt_idx]

    def select(self, idx: Sequence[int] | Tensor) -> PromptMetric:
        idx = torch.as_tensor(idx, dtype=torch.long)
        if self.prompt_idx is not None:
            idx = self.prompt_idx[idx]
        return PromptMetric(self.per_prompt_fn, self.name, idx, self.reads)


def _pad(rows: Sequence[Sequence[int]], fill: int = -1) -> Int[Tensor, "n k"]:
    width = max(1, max((len(r) for r in rows), default=1))
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return out


def _reads(pos: Int[Tensor, "n k"]) -> Int[Tensor, "n k"]:
    """Per-prompt logit positions read for answer positions ``pos`` (``p - 1``; padding -1 is
    replaced by the row's first read, or 0 for a prompt without answers)."""
    read = pos - 1
    first = torch.where(pos[:, :1] >= 1, read[:, :1], torch.zeros_like(read[:, :1]))
    return torch.where(pos >= 1, read, first)


def token_margin_metric(
    answer_pos: Sequence[Sequence[int]],
    answer_tok: Sequence[Sequence[int]],
    rival_tok: Sequence[Sequence[int]],
    name: str = "target_vs_near_miss_margin",
) -> PromptMetric:
    """Mean over answer steps of ``logit[answer] - mean(logit[rivals])`` (per prompt).

    ``answer_pos[i]``: positions of prompt i's answer tokens; ``answer_tok[i]``: the token id at
    each (read from logits at ``pos - 1``); ``rival_tok[i]``: prompt i's rival tokens (near-misses).
    A prompt with no rivals scores ``logit[answer]`` minus the mean logit over the vocabulary.
    """
    pos, tok, rivals = _pad(answer_pos), _pad(answer_tok), _pad(rival_tok)

    def fn(logits: Tensor, idx: Tensor, rows: Tensor) -> Tensor:
        p, t, r = pos[idx].to(logits.device), tok[idx].to(logits.device), rivals[idx].to(
            logits.device)
        valid = p >= 0
        b = torch.arange(logits.shape[0], device=logits.device)[:, None]
        step = logits[b, rows[b, (p - 1).clamp(min=0)]]  # [batch, n_answers, vocab]
        tgt = step.gather(-1, t.clamp(min=0)[..., None])[..., 0]
        rmask = (r >= 0)[:, None, :]
        rv = step.gather(-1, r.clamp(min=0)[:, None, :].expand(-1, step.shape[1], -1))
        n_r = rmask.sum(-1).clamp(min=1)
        rival_mean = torch.where(
            rmask.any(-1), (rv * rmask).sum(-1) / n_r, step.mean(-1))
        margin = (tgt - rival_mean) * valid
        return margin.sum(-1) / valid.sum(-1).clamp(min=1)

    return PromptMetric(fn, name, reads=_reads(pos))


def token_logprob_metric(
    answer_pos: Sequence[Sequence[int]],
    answer_tok: Sequence[Sequence[int]],
    name: str = "answer_logprob",
) -> PromptMetric:
    """Mean over answer steps of ``log_softmax(logits)[answer]`` (per prompt).

    Unlike a logit difference, it rises only when the right answer is restored, not when a rival
    is merely suppressed (the logit-difference trap of previous-token heads).
    """
    pos, tok = _pad(answer_pos), _pad(answer_tok)

    def fn(logits: Tensor, idx: Tensor, rows: Tensor) -> Tensor:
        p, t = pos[idx].to(logits.device), tok[idx].to(logits.device)
        valid = p >= 0
        b = torch.arange(logits.shape[0], device=logits.device)[:, None]
        logp = logits[b, rows[b, (p - 1).clamp(min=0)]].log_softmax(-1)
        lp = logp.gather(-1, t.clamp(min=0)[..., None])[..., 0] * valid
        return lp.sum(-1) / valid.sum(-1).clamp(min=1)

    return PromptMetric(fn, name, reads=_reads(pos))
