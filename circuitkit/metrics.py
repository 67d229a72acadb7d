"""The one metric protocol: ``PromptMetric`` (logits -> per-prompt values -> mean).

Every public entry point (``patch_heads``, ``patch_layers``, attribution, scoring) wraps what the
user passes exactly once with ``as_metric``; everything below the entry takes only the wrapped
form. A ``PromptMetric`` is callable like a TransformerLens metric (``metric(logits) -> scalar``,
the mean over prompts) and also has

* ``per_prompt(logits, at=None) -> [batch]``: one value per prompt (bootstrap intervals, splitting
  prompts over chunks, sorting them by length);
* ``reads``: ``[n_prompts, k]``, the logit positions each prompt's value depends on. Sweeps then
  compute logits at those positions only and stop each run after the last one.

``as_metric(fn, n_prompts, seq, d_vocab)`` turns a plain callable into one by a gradient probe on
two seeded random logit tensors ``[n_prompts, seq, d_vocab]``: positions that receive gradient are
read (provided the values stay put when every other position changes); a ``[batch]`` return whose
values each depend on their own prompt only is per-prompt, anything else the mean over prompts. When
the probe cannot tell (no gradient: an argmax), every position is read and ``metric.note`` says so
(sweeps copy it into ``PatchResult.meta["metric_note"]``). The wrapped callable always sees logits
of the full ``[n_prompts, seq, d_vocab]`` shape in the caller's prompt order (unread positions hold
zeros). Probe reuse (``_same``), the check of probed reads on the real logits (``reads_hold``,
``reads_hold_at``), ``gradient`` and their costs: docs/metrics.md, sections 1-3.

Positions follow the task layout: the prediction of the token at position ``p`` is read from the
logits at ``p - 1``. This module imports only torch: ``tasks`` builds its metrics from it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor


@dataclass(frozen=True)
class PromptMetric:
    """A metric with a per-prompt view. ``metric(logits) == metric.per_prompt(logits).mean()``.

    ``per_prompt_fn(logits, prompt_idx, rows)``: ``rows[b, p]`` is the row of ``logits``'
    position axis holding prompt ``b``'s sequence position ``p`` (-1: not computed;
    ``rows[b, p] = p`` for full logits). ``prompt_idx[b]``: which prompt row ``b`` is.
    ``reads``: ``[n_prompts, k]`` logit positions each prompt's value depends on (rows padded by
    repetition), or None (any). ``per_prompt_values``: False for a metric that only has a scalar
    (a wrapped callable returning the mean): its ``per_prompt`` repeats the scalar, it must see
    every prompt at once, and results carry no per-prompt values. ``select(idx)`` restricts the
    metric to a subset (or reordering, or tiling) of prompts. ``labels``: (key, value) pairs a
    patching result copies into its ``meta`` (a task's metric: ``task`` and ``phase``).
    ``probed``: ``reads`` were found on random logits (``as_metric``) and are still to be
    checked on real ones (``reads_hold``). ``gradient``: whether the value carries a gradient
    to the logits (None: not known, e.g. a ``PromptMetric`` built by hand).
    """

    per_prompt_fn: Callable[[Tensor, Tensor, Tensor], Tensor]
    name: str = "metric"
    prompt_idx: Tensor | None = None
    reads: Int[Tensor, "n k"] | None = None
    per_prompt_values: bool = True
    n_prompts: int | None = None
    note: str = ""
    labels: tuple[tuple[str, Any], ...] = ()  # what it measures, e.g. (("task", "icd10"),
    # ("phase", 2)) for a task's metric: results record them in meta (figure titles)
    probed: bool = False
    gradient: bool | None = None

    def per_prompt(self, logits: Float[Tensor, "batch pos vocab"],
                   at: Int[Tensor, "batch k"] | None = None) -> Float[Tensor, " batch"]:
        """Values of the prompts in ``logits`` (``at``: logits hold only these positions)."""
        idx = self.prompt_idx if self.prompt_idx is not None else torch.arange(logits.shape[0])
        if idx.numel() != logits.shape[0]:
            raise ValueError(
                f"{self.name}: logits have batch {logits.shape[0]} but the metric is defined for "
                f"{idx.numel()} prompts; pass the same prompts, or metric.select(indices).")
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

    def check_reads(self, seq: int) -> None:
        """Refuse (one ``ValueError`` line) reads at logit positions prompts of ``seq`` tokens
        do not have: the position check at a sweep's entry (an ``IndexError`` deep in an
        engine, before)."""
        reads = self.read_positions()
        if reads is None or not reads.numel() or int(reads.max()) < seq:
            return
        i = int((reads >= seq).any(1).nonzero()[0, 0])
        raise ValueError(f"metric {self.name!r} reads logit position {int(reads[i].max())} of "
                         f"prompt {i}, but the prompts have {seq} tokens (positions 0..{seq - 1})"
                         "; give positions inside the prompts (task.last_positions: each "
                         "prompt's last token, not its length).")

    def reads_hold(self, logits: Float[Tensor, "batch seq vocab"]) -> bool:
        """Whether the values from ``logits`` at ``reads`` only (zeros elsewhere, as sweeps
        hand them) equal the values from the full ``logits`` (rtol 1e-5, atol 1e-6). Always
        True without ``reads``."""
        reads = self.read_positions()
        if reads is None:
            return True
        n = logits.shape[0]
        at = reads.to(logits.device).expand(n, -1)
        with torch.no_grad():
            full = self.per_prompt(logits)
            kept = self.per_prompt(logits[torch.arange(n, device=logits.device)[:, None], at],
                                   at=at)
        return _same(kept, full)

    def reads_hold_at(self, kept: Float[Tensor, "batch k vocab"], seq: int) -> bool:
        """Whether the values from real logits at ``reads`` (``kept``: the logits there, as a
        sweep's cached runs compute them) stay put when every other position of the ``seq`` holds
        seeded random logits instead of zeros (what sweeps hand the metric there), rtol 1e-5, atol
        1e-6. A read a probe on random logits missed (one that only real values at the reads
        trigger, e.g. a branch on them) then meets random values and shows: the check of
        ``reads_hold`` without unembedding every position. Always True without ``reads``."""
        reads = self.read_positions()
        if reads is None:
            return True
        n, k, vocab = kept.shape
        at = reads.to(kept.device).expand(n, -1)
        full = torch.empty(n, seq, vocab, dtype=kept.dtype)
        _probe_input(full, 2)  # (a fill the probe did not see)
        full = full.to(kept.device)
        full[torch.arange(n, device=kept.device)[:, None], at] = kept
        with torch.no_grad():
            return _same(self.per_prompt(full), self.per_prompt(kept, at=at))

    def reading_every_position(self, why: str) -> PromptMetric:
        """This metric with its reads dropped (every position computed), ``why`` in its note."""
        return replace(self, reads=None, probed=False,
                       note="; ".join(p for p in (self.note, why) if p))

    def select(self, idx: Sequence[int] | Tensor) -> PromptMetric:
        idx = torch.as_tensor(idx, dtype=torch.long)
        if self.prompt_idx is not None:
            idx = self.prompt_idx[idx]
        return replace(self, prompt_idx=idx)

    def fingerprint(self, n_prompts: int, seq: int, d_vocab: int) -> str:
        """Hash of this metric's *behaviour*: its per-prompt values on seeded random logits
        ``[n_prompts, seq, d_vocab]`` (at its reads only, when known), rounded to 6 significant
        digits. Two metrics that differ anywhere on such inputs get different fingerprints, so
        a checkpoint is never resumed under another metric of the same name."""
        g = torch.Generator().manual_seed(1234)
        reads = self.read_positions()
        k = seq if reads is None else reads.shape[1]
        logits = torch.randn(n_prompts, k, d_vocab, generator=g)
        with torch.no_grad():
            v = self.per_prompt(logits, at=reads).double()
        text = ",".join(f"{x:.6g}" for x in v.tolist())
        flags = f"{self.per_prompt_values}|{None if reads is None else reads.tolist()}|"
        return hashlib.sha256((flags + text).encode()).hexdigest()[:16]


# --- wrapping a plain callable ------------------------------------------------------------------


def as_metric(metric: Any, n_prompts: int | None = None, seq: int | None = None,
              d_vocab: int | None = None, name: str | None = None) -> PromptMetric:
    """``metric`` as a ``PromptMetric`` (returned as is when it already is one).

    A plain callable ``fn(logits [n_prompts, seq, d_vocab]) -> scalar | [n_prompts]`` is
    probed (module docstring) and wrapped; it needs the shape of the logits it will see. The
    probe's findings are reused for the same function code and shape only while ``fn`` gives
    the same values on the first probe input as when it was probed.
    """
    if isinstance(metric, PromptMetric):
        return metric
    if not callable(metric):
        raise ValueError(f"metric must be callable (logits -> scalar or [batch]) or a "
                         f"PromptMetric; got {type(metric).__name__}.")
    if n_prompts is None or seq is None or d_vocab is None:
        raise ValueError("as_metric(fn) needs n_prompts, seq and d_vocab: the shape of the "
                         "logits fn will be called on.")
    name = name or str(getattr(metric, "__name__", None) or type(metric).__name__)
    key = (_code(metric), n_prompts, seq, d_vocab, name)
    xs = torch.empty(2, n_prompts, seq, d_vocab)  # the second is filled only to probe
    _probe_input(xs[0], 0)
    with torch.no_grad():
        now, _ = _call(metric, xs[0], n_prompts, name)
    seen = _PROBED.get(key)
    if seen is not None and _same(seen[0], now.detach()):
        _PROBED.move_to_end(key)
        found = seen[1]
    else:
        _probe_input(xs[1], 1)
        found = _probe(metric, xs, n_prompts, name)
        _PROBED[key] = (now.detach(), found)
        while len(_PROBED) > PROBED_KEPT:
            _PROBED.popitem(last=False)
    del xs
    fn = _wrapped(metric, found.per_prompt, n_prompts, seq, d_vocab, name, found.vmappable)
    return PromptMetric(fn, name, reads=found.reads, per_prompt_values=found.per_prompt,
                        n_prompts=n_prompts, note=found.note, probed=found.reads is not None,
                        gradient=found.gradient)


@dataclass(frozen=True)
class _Found:
    """What the probe found about a callable (``_probe``)."""

    per_prompt: bool
    reads: Tensor | None
    note: str
    vmappable: bool
    gradient: bool


# Probe findings by (function code, n, seq, d_vocab, name) -> (values on the first probe input,
# findings); the oldest dropped beyond PROBED_KEPT. Keyed on code, not on the callable: a notebook
# cell re-run makes a new lambda each time, and the values decide whether the findings still hold.
_PROBED: OrderedDict[tuple, tuple[Tensor, _Found]] = OrderedDict()
PROBED_KEPT = 64


def _code(fn: Any) -> Any:
    """What identifies a callable's code: its ``__code__`` (a bound method: its function's),
    else its type (a callable object; the values tell instances apart)."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__",
                                                    None)
    return code if code is not None else type(fn)


def _probe_input(out: Tensor, i: int) -> None:
    """Fill ``out`` ``[n, seq, d_vocab]`` with probe input ``i`` (seeded): a random vocabulary
    profile, scaled and shifted at random per position, so every position has its own softmax.
    One pass over the tensor where filling it with random numbers would cost ~5x more."""
    n, seq, d_vocab = out.shape
    g = torch.Generator().manual_seed(i)
    profile = torch.rand(1, 1, d_vocab, generator=g).mul_(8).sub_(4)
    scale = torch.rand(n, seq, 1, generator=g).add_(0.5)
    torch.addcmul(torch.randn(n, seq, 1, generator=g), profile, scale, out=out)


def _call(fn: Callable, logits: Tensor, n: int, name: str) -> tuple[Tensor, bool]:
    """``fn(logits)`` as a tensor and whether it is per prompt (validated shape)."""
    out = fn(logits)
    if not isinstance(out, Tensor):
        out = torch.as_tensor(out, dtype=torch.float32)
    if out.ndim == 0:
        return out, False
    if tuple(out.shape) == (n,):
        return out, True
    raise ValueError(f"metric {name!r} returned shape {tuple(out.shape)}; expected a scalar "
                     f"(mean over prompts) or [{n}] (one value per prompt).")


def _probe(fn: Callable, xs: Tensor, n: int, name: str) -> _Found:
    """What ``fn`` reads, from the two probe inputs ``xs`` ``[2, n, seq, d_vocab]``: see the
    module docstring.

    vmappable: ``torch.vmap(fn)`` over a leading copy axis of the two probe inputs gives what the
    two plain calls gave (pure tensor code does; ``.item()``, data-dependent Python branches and
    in-place writes into the input do not); then all copies of a sweep chunk are one call."""
    touched = torch.zeros(n, xs.shape[2], dtype=torch.bool)
    per_prompt, differentiable = False, True
    outs = []
    for x in xs:
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out, per_prompt = _call(fn, x, n, name)
            differentiable = differentiable and out.requires_grad
            if differentiable:
                (grad,) = torch.autograd.grad(out.sum(), x, allow_unused=True)
                if grad is not None:
                    touched |= grad.any(-1)
        outs.append(out.detach())
    vmappable = _vmappable(fn, xs, torch.stack(outs))
    notes = []
    if per_prompt and not _prompts_independent(fn, xs, outs, n, name):
        per_prompt = False
        notes.append(f"metric {name!r}: one prompt's value depends on other prompts' logits, so "
                     "its mean over the batch is the value and prompts are never split (no "
                     "per-prompt values)")

    def found(reads: Tensor | None) -> _Found:
        return _Found(per_prompt, reads, "; ".join(notes), vmappable, differentiable)

    if not differentiable:
        notes.append(f"metric {name!r} is not differentiable, so the positions it reads are "
                     "unknown: every position was computed (slower, same values)")
        return found(None)
    if not touched.any(-1).all():
        notes.append(f"metric {name!r}: the probe found prompts whose value reads no logit; "
                     "every position was computed")
        return found(None)
    if not _reads_suffice(fn, xs, outs, touched, name):
        notes.append(f"metric {name!r} depends on logits where it has no gradient (a max, a "
                     "clamp, a detach): every position was computed (slower, same values)")
        return found(None)
    width = int(touched.sum(-1).max())
    reads = torch.zeros(n, width, dtype=torch.long)
    for b in range(n):
        pos = touched[b].nonzero()[:, 0]
        reads[b] = torch.cat([pos, pos[:1].expand(width - len(pos))])
    notes.insert(0, f"metric {name!r}: read positions found by a gradient probe")
    return found(reads)


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


def _reads_suffice(fn: Callable, xs: Tensor, outs: list[Tensor], touched: Tensor,
                   name: str) -> bool:
    """Whether the values stay put when every position outside the gradient's reads holds
    zeros (what sweeps hand the metric there) or the other probe input's logits. A gradient
    misses what a max, a clamp or a detach reads; the values do not."""
    keep = touched[..., None]
    with torch.no_grad():
        for i, fill in ((0, torch.zeros_like(xs[0])), (1, xs[0])):
            if not _same(_call(fn, torch.where(keep, xs[i], fill), len(fill), name)[0], outs[i]):
                return False
    return True


def _prompts_independent(fn: Callable, xs: Tensor, outs: list[Tensor], n: int,
                         name: str) -> bool:
    """Whether each prompt's value depends on its own logits only: for every bit of the prompt
    index, the prompts with that bit set take the second probe input, the others the first,
    and every value must be its own input's. Any two prompts differ in some bit, so any
    dependence between two prompts is seen, in ``ceil(log2 n)`` calls. (Sweeps split prompts
    over chunks and hand the metric zeros for the prompts outside a chunk.)"""
    idx = torch.arange(n)
    with torch.no_grad():
        for bit in range((n - 1).bit_length()):
            side = (idx >> bit) & 1 == 1
            got, _ = _call(fn, torch.where(side[:, None, None], xs[1], xs[0]), n, name)
            if not _same(got, torch.where(side, outs[1], outs[0])):
                return False
    return True


def _whole(logits: Tensor, idx: Tensor, rows: Tensor, n: int, seq: int) -> bool:
    """Whether ``logits`` already are the ``[n, seq, vocab]`` logits a wrapped callable expects:
    every prompt once, in order, every position at its own row (nothing to rebuild)."""
    return (tuple(logits.shape[:2]) == (n, seq) and tuple(rows.shape) == (n, seq)
            and bool((idx == torch.arange(n, device=idx.device)).all())
            and bool((rows == torch.arange(seq, device=rows.device)).all()))


# Bytes of rebuilt logits one batched (vmap) call of a wrapped callable may hold.
VMAP_BYTES = 256 * 2**20


def _vmappable(fn: Callable, xs: Tensor, outs: Tensor) -> bool:
    """Whether ``torch.vmap(fn)(xs)`` equals ``outs`` (the plain calls' results)."""
    try:
        with torch.no_grad():
            batched = torch.vmap(fn)(xs)
        return batched.shape == outs.shape and torch.allclose(batched, outs, rtol=1e-5,
                                                              atol=1e-6)
    except Exception:  # noqa: BLE001 - anything vmap cannot run: the loop is always right
        return False


def _wrapped(fn: Callable, per_prompt: bool, n: int, seq: int, d_vocab: int, name: str,
             vmappable: bool):
    """``per_prompt_fn`` of a wrapped callable: rebuild the ``[n, seq, d_vocab]`` logits the
    callable expects (zeros where not computed), once per copy of the prompt set; copies alike
    (a sweep chunk's variants) go through one ``torch.vmap`` call when ``fn`` allows it."""
    def per_prompt_fn(logits: Tensor, idx: Tensor, rows: Tensor) -> Tensor:
        # Rows may tile the prompts (one copy per patched variant): copy c of prompt i is the
        # c-th row whose idx is i. Each copy is one call of fn on a full batch.
        seen: dict[int, int] = {}
        copies: list[list[int]] = []
        for r, i in enumerate(idx.tolist()):
            c = seen.get(i, 0)
            seen[i] = c + 1
            if c == len(copies):
                copies.append([])
            copies[c].append(r)
        if not per_prompt and any(len(rc) != n for rc in copies):
            raise ValueError(
                f"metric {name!r} gives one value for the whole batch (a scalar, or per-prompt "
                f"values that depend on other prompts), so it must see all {n} prompts at once; "
                f"it was given {min(len(rc) for rc in copies)}. Return one value per prompt, "
                "each from its own prompt's logits, to allow splitting prompts.")
        if _whole(logits, idx, rows, n, seq):  # the callable's own input, as given
            value, _ = _call(fn, logits, n, name)
            return (value if per_prompt else value.mean().expand(n)).float()
        out = logits.new_zeros(logits.shape[0], dtype=torch.float32)
        pos = torch.arange(rows.shape[1], device=logits.device)
        differentiable = torch.is_grad_enabled() and logits.requires_grad
        alike = len(copies) > 1 and all(len(rc) == len(copies[0]) for rc in copies)
        if alike:
            r_all = torch.tensor(copies, device=logits.device)  # [C, m]
            alike = bool((idx[r_all] == idx[r_all[0]]).all() and (rows[r_all] == rows[r_all[0]])
                         .all())
        if alike and not differentiable and vmappable:
            return _batched_copies(logits, idx, rows, r_all, out, pos)
        for rows_c in copies:
            r = torch.tensor(rows_c, device=logits.device)
            ids, rows_r = idx[r], rows[r]
            rr, pp = (rows_r >= 0).nonzero(as_tuple=True)
            where, values = (ids[rr], pos[pp]), logits[r[rr], rows_r[rr, pp]]
            # without autograd, the shared buffer of the vmap path (its first copy)
            full = (logits.new_zeros(n, seq, d_vocab).index_put(where, values) if differentiable
                    else _rebuild_buffer(1, n, seq, d_vocab, logits, where[0] * seq + where[1])[0]
                    .index_put_(where, values))
            value, _ = _call(fn, full, n, name)
            value = value if per_prompt else value.mean()  # a joint [n] metric: its mean
            out = out.index_put((r,), (value[ids] if per_prompt else value.expand(len(r)))
                                .to(out.dtype))
        return out

    def _batched_copies(logits: Tensor, idx: Tensor, rows: Tensor, r_all: Tensor, out: Tensor,
                        pos: Tensor) -> Tensor:
        """All copies (alike: same prompts, same positions) through ``torch.vmap(fn)``, in
        groups of at most ``VMAP_BYTES`` of rebuilt logits."""
        ids, rows_r = idx[r_all[0]], rows[r_all[0]]
        rr, pp = (rows_r >= 0).nonzero(as_tuple=True)
        cells, slots = ids[rr] * seq + pos[pp], rows_r[rr, pp]  # flat (prompt, position)
        step = max(1, VMAP_BYTES // (n * seq * d_vocab * logits.element_size()))
        buffer = _rebuild_buffer(min(step, len(r_all)), n, seq, d_vocab, logits, cells)
        for c0 in range(0, len(r_all), step):
            r = r_all[c0:c0 + step]
            buffer.view(-1, d_vocab).index_copy_(0, _copy_rows(cells, len(r), n * seq),
                                                 logits[r[:, rr], slots].flatten(0, 1))
            full = buffer[:len(r)]
            value = torch.vmap(fn)(full)  # [C] (scalar metric) or [C, n]
            if not per_prompt:
                value = value.reshape(len(r), -1).mean(1)  # a joint [n] metric: its mean
            got = value[:, ids] if per_prompt else value[:, None].expand(len(r), r.shape[1])
            out[r] = got.to(out.dtype)
        return out

    return per_prompt_fn


# The rebuilt-logits buffer, shared by every wrapped callable (vmap path and, without autograd, the
# per-copy loop): zeros ``[copies, n, seq, d_vocab]`` (at most ``VMAP_BYTES`` unless one copy is
# bigger) and the flat ``prompt * seq + position`` cells its last user wrote. Allocating (and first
# touching) it per sweep costs more than the metric: with a new lambda per call that was a sweep's
# whole overhead. One per process, replaced when the shape, dtype or device changes.
_REBUILD: dict[str, Any] = {"buffer": None, "cells": None, "used": 0}


def _rebuild_buffer(copies: int, n: int, seq: int, d_vocab: int, like: Tensor, cells: Tensor
                    ) -> Tensor:
    """The shared buffer with at least ``copies`` copies, zero everywhere except ``cells`` (which
    the caller is about to overwrite in every copy it uses, its first ``copies`` at most)."""
    buf, last, used = _REBUILD["buffer"], _REBUILD["cells"], _REBUILD["used"]
    if (buf is None or tuple(buf.shape[1:]) != (n, seq, d_vocab) or buf.dtype != like.dtype
            or buf.device != like.device or buf.shape[0] < copies):
        keep = buf.shape[0] if buf is not None and tuple(buf.shape[1:]) == (n, seq, d_vocab) \
            else 0
        _REBUILD["buffer"] = None  # (the old one is freed before the new one is made)
        buf, used = like.new_zeros(max(copies, keep), n, seq, d_vocab), 0
    elif last is not None and not torch.equal(last, cells):
        # the old pattern, in the copies its users wrote: whole rows of the 2-d view (a
        # per-copy index_fill_ over dim 1 of [copies, n * seq, d_vocab] took ~8 ms a chunk)
        buf.view(-1, d_vocab).index_fill_(0, _copy_rows(last, used, n * seq), 0)
        used = 0
    _REBUILD.update(buffer=buf, cells=cells, used=max(used, copies))
    return buf


def _copy_rows(cells: Tensor, copies: int, per_copy: int) -> Tensor:
    """Rows of the buffer's ``[copies * n * seq, d_vocab]`` view holding ``cells`` (flat
    ``prompt * seq + position``) in each of its first ``copies`` copies, copy-major."""
    start = torch.arange(copies, device=cells.device)[:, None] * per_copy
    return (start + cells[None]).flatten()


# --- metrics built here -------------------------------------------------------------------------


def pad_rows(rows: Sequence[Sequence[int]], fill: int = -1) -> Int[Tensor, "n k"]:
    """One row per prompt, ``[n, k]`` long, each row filled up with ``fill`` (-1: padding)."""
    width = max(1, max((len(r) for r in rows), default=1))
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return out


def logit_positions(answer_pos: Sequence[Sequence[int]] | Tensor) -> Int[Tensor, "n k"]:
    """The logit positions that predict tokens at ``answer_pos`` (per prompt, ragged or
    ``[n, k]`` with -1 padding): ``p - 1`` (a token's prediction is read one position before
    it; ``p = 0`` reads position 0), -1 where padded. What ``at_answers`` takes."""
    pos = answer_pos if isinstance(answer_pos, Tensor) else pad_rows(answer_pos)
    return torch.where(pos >= 0, (pos - 1).clamp(min=0), torch.full_like(pos, -1))


def _reads(at: Int[Tensor, "n k"]) -> Int[Tensor, "n k"]:
    """``reads`` for logit positions ``at`` (-1 padding replaced by the row's first position,
    or 0 for a prompt without any)."""
    first = torch.where(at[:, :1] >= 0, at[:, :1], torch.zeros_like(at[:, :1]))
    return torch.where(at >= 0, at, first)


def at_answers(reading: Callable[..., Tensor], positions: Sequence[Sequence[int]] | Tensor,
               *per_prompt: Tensor | Sequence[Any], name: str = "at_answers") -> PromptMetric:
    """A ``PromptMetric`` from a reading of the logits at each prompt's own positions.

    ``positions``: the logit positions each prompt is read at, ``[n]`` (one each, e.g.
    ``task.last_positions``) or ``[n, k]`` / ragged lists, -1 padding (``task.answer_positions``:
    the positions predicting each answer step). ``reading(step_logits, *rows)`` gets
    ``step_logits [b, k, vocab]`` (the logits at those positions, for the ``b`` prompts of a
    call) and the rows of each ``per_prompt`` tensor (``[n, ...]``, e.g.
    ``task.answer_tokens``, passed as given) for the same prompts, and returns
    ``[b, k]`` (a value per position: the prompt's value is its mean over its own positions) or
    ``[b]`` (the prompt's value). The metric declares its reads, so right-padded prompts (a
    task's ``clean_tokens``) are read at their own positions and never at their padding::

        # the TransformerLens idiom l[:, -1, tgt].mean(), at each prompt's answer steps
        m = ck.metrics.at_answers(lambda step, tok: step.gather(-1, tok[..., None])[..., 0],
                                  task.answer_positions, task.answer_tokens)
    """
    if not callable(reading):
        raise ValueError(f"at_answers: reading must be callable (step logits [b, k, vocab] "
                         f"-> [b, k] or [b]); got {type(reading).__name__}.")
    at = _positions_tensor(positions)
    n = at.shape[0]
    rows_of = []
    for j, t in enumerate(per_prompt):
        t = torch.as_tensor(t)
        if t.ndim == 0 or t.shape[0] != n:
            raise ValueError(f"at_answers: per-prompt argument {j} has shape {tuple(t.shape)}; "
                             f"it needs one row per prompt ({n}, as positions).")
        rows_of.append(t)

    def fn(logits: Tensor, idx: Tensor, rows: Tensor) -> Tensor:
        a = at[idx.cpu()].to(logits.device)
        if int(a.max()) >= rows.shape[1]:  # (an IndexError deep in a gather, before)
            raise ValueError(f"at_answers {name!r}: positions go up to {int(a.max())} but the "
                             f"logits have {rows.shape[1]} positions (0..{rows.shape[1] - 1}); "
                             "give positions inside the prompts (task.last_positions: each "
                             "prompt's last token, not its length).")
        valid = a >= 0
        b = torch.arange(logits.shape[0], device=logits.device)[:, None]
        step = logits[b, rows[b, a.clamp(min=0)]]  # [batch, k, vocab]
        got = reading(step, *(t[idx.cpu()].to(logits.device) for t in rows_of))
        if not isinstance(got, Tensor) or tuple(got.shape) not in ((len(a),), tuple(a.shape)):
            shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
            raise ValueError(f"at_answers {name!r}: reading returned {shape}; expected "
                             f"{tuple(a.shape)} (a value per position) or ({len(a)},) (a value "
                             "per prompt).")
        if got.ndim == 1:
            return got
        return (got * valid).sum(-1) / valid.sum(-1).clamp(min=1)

    return PromptMetric(fn, name, reads=_reads(at))


def _positions_tensor(positions: Any) -> Int[Tensor, "n k"]:
    """``positions`` of ``at_answers`` as ``[n, k]`` long, -1 padding; bad input: one line
    (never the positions echoed). The position check at the metric's entry: entries are
    positions ``>= 0`` or -1 (padding), and every prompt has at least one position (a prompt
    whose positions are all padding would read logit position 0). Positions past the
    sequence: ``PromptMetric.check_reads`` (the sequence length is known only there)."""
    if hasattr(positions, "__array__") and not isinstance(positions, Tensor):
        try:  # a numpy array (its truth value is ambiguous to the checks below)
            positions = torch.as_tensor(positions)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"at_answers: positions of type {type(positions).__name__} could "
                             "not be read as integers; give a LongTensor [n] or [n, k].") from None
    if isinstance(positions, Tensor):
        at = positions
    else:
        try:
            rows = [[int(p) for p in r] if isinstance(r, Sequence) else [int(r)]
                    for r in positions]
        except (TypeError, ValueError):
            raise ValueError("at_answers: positions must be a LongTensor [n] or [n, k], or one "
                             "list of ints per prompt (task.answer_positions, "
                             "task.last_positions).") from None
        at = pad_rows(rows)
    if at.is_floating_point() or at.dtype == torch.bool or at.ndim not in (1, 2) \
            or at.shape[0] == 0:
        raise ValueError(f"at_answers: positions must be integer, [n] or [n, k] with n >= 1; "
                         f"got {at.dtype} of shape {tuple(at.shape)}.")
    at = at.long().cpu()
    at = at[:, None] if at.ndim == 1 else at
    if bool((at < -1).any()):
        i, j = (at < -1).nonzero()[0].tolist()
        raise ValueError(f"at_answers: position {int(at[i, j])} of prompt {i} is negative; "
                         "positions count from 0 (-1 marks padding only): give each prompt's "
                         "own positions (task.last_positions, not -1 for 'the last').")
    empty = (at < 0).all(1).nonzero()[:, 0].tolist()
    if empty:
        shown = ", ".join(map(str, empty[:5])) + (" ..." if len(empty) > 5 else "")
        raise ValueError(f"at_answers: {len(empty)} of {len(at)} prompts have no position to "
                         f"read (every entry -1, padding: prompts {shown}); each prompt needs "
                         "at least one: drop those prompts (task.subset) or give their "
                         "positions.")
    return at


def token_margin_metric(answer_pos: Sequence[Sequence[int]], answer_tok: Sequence[Sequence[int]],
                        rival_tok: Sequence[Sequence[int]],
                        name: str = "target_vs_near_miss_margin") -> PromptMetric:
    """Mean over answer steps of ``logit[answer] - mean(logit[rivals])`` (per prompt).

    ``answer_pos[i]``: positions of prompt i's answer tokens; ``answer_tok[i]``: the token id at
    each (read from logits at ``pos - 1``); ``rival_tok[i]``: prompt i's rival tokens (near-misses).
    A prompt with no rivals scores ``logit[answer]`` minus the mean logit over the vocabulary.
    """
    rivals = pad_rows(rival_tok)

    def margin(step: Tensor, tok: Tensor, r: Tensor) -> Tensor:
        tgt = step.gather(-1, tok.clamp(min=0)[..., None])[..., 0]
        rmask = (r >= 0)[:, None, :]
        rv = step.gather(-1, r.clamp(min=0)[:, None, :].expand(-1, step.shape[1], -1))
        n_r = rmask.sum(-1).clamp(min=1)
        return tgt - torch.where(rmask.any(-1), (rv * rmask).sum(-1) / n_r, step.mean(-1))

    return at_answers(margin, logit_positions(answer_pos), pad_rows(answer_tok), rivals, name=name)


def token_logprob_metric(answer_pos: Sequence[Sequence[int]], answer_tok: Sequence[Sequence[int]],
                         name: str = "answer_logprob") -> PromptMetric:
    """Mean over answer steps of ``log_softmax(logits)[answer]`` (per prompt).

    Unlike a logit difference, it rises only when the right answer is restored, not when a rival
    is merely suppressed (the logit-difference trap of previous-token heads).
    """
    def logprob(step: Tensor, tok: Tensor) -> Tensor:
        return step.log_softmax(-1).gather(-1, tok.clamp(min=0)[..., None])[..., 0]

    return at_answers(logprob, logit_positions(answer_pos), pad_rows(answer_tok), name=name)
