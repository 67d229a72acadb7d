"""What every exact engine checks: each metric value it computes (``evaluate_metric``: shape,
finite) and its fast paths against their references (``FAST_PATH_TOL``, once per model:
``_FAST_PATH_VERDICTS``). The engines: ``patching/exact/__init__.py``."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit.metrics import PromptMetric

# Max |fast - plain| on the probe chunk, relative to max(1, |metric|), by weight dtype: the two
# paths round differently (the z write is added after the output projection, not inside it).
# float64: 1e-6, as HF computes rotary tables in float32 whatever the weights' dtype (a float64
# tiny Llama's fused cached run differs from the bridge's by ~5e-8: rounding, not a fault).
FAST_PATH_TOL = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 2e-2,
                 torch.bfloat16: 5e-2}
# The fast path's verdict depends on the architecture, not on weights or inputs: once per model,
# kept beside (never on) the user's model object.
_FAST_PATH_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _within_fast_path_tol(model: Any, err: float, scale: float, what: str, fallback: str,
                     detail: str = "") -> bool:
    """Whether a fast path's difference ``err`` from its reference is within ``FAST_PATH_TOL``
    (for the model's weight dtype) of ``scale``; if not, one warning: ``what`` differs on this
    model (its block type, ``detail``), ``fallback`` is used instead."""
    if err <= FAST_PATH_TOL.get(next(model.parameters()).dtype, 5e-2) * scale:
        return True
    _warn_fast_path_off(model, f"{what} by {err:.2e}", fallback, detail)
    return False


def _warn_fast_path_off(model: Any, why: str, fallback: str, detail: str = "") -> None:
    """One warning: a fast path (``why``: what went wrong) is off for this model's blocks."""
    warnings.warn(f"circuitkit: {why} on this model ({type(model.blocks[0]).__name__} blocks"
                  f"{detail}); using {fallback} (slower, still exact). Please report the "
                  "architecture.", stacklevel=4)


def evaluate_metric(metric: PromptMetric, logits: Tensor, what: str,
                    at: Tensor | None = None) -> Float[Tensor, " batch"]:
    """Per-prompt metric of a batch of logits, validated (shape, finite), on the CPU.

    ``at``: the logits hold only these positions (``PromptMetric.reads``)."""
    n = logits.shape[0]
    out = metric.per_prompt(logits, at=at)
    if out.shape != (n,):
        raise ValueError(f"metric {metric.name!r} must give [{n}] values ({what}); got shape "
                         f"{tuple(out.shape)}.")
    out = out.detach().float().cpu()
    if not torch.isfinite(out).all():
        raise ValueError(f"metric {metric.name!r} returned {_non_finite(metric, out)} ({what}). "
                         "Check the answer positions/tokens it reads and the logits' dtype.")
    return out


def _non_finite(metric: PromptMetric, out: Tensor) -> str:
    """Which of ``out`` (one value per row) are NaN/inf, in words: how many, and the first by its
    prompt and (rows tiled variant-major, ``metric.select(prompts * n_variants)``) its variant
    within the call, with its value (the first 8 values, before: often none of them the bad one)."""
    bad = (~torch.isfinite(out)).nonzero()[:, 0].tolist()
    i = bad[0]
    idx = metric.prompt_idx
    prompt = i if idx is None else int(idx[i])
    n_p = len(out) if idx is None else len(set(idx.tolist()))
    variant = f", variant {i // n_p} of this call's {len(out) // n_p}" if len(out) > n_p else ""
    prompts = sorted({j if idx is None else int(idx[j]) for j in bad})
    more = "" if len(prompts) == 1 else f"; prompts {prompts[:8]} in all"
    return (f"{len(bad)} non-finite value(s) (NaN/inf) of {len(out)}: the first {out[i].item()} "
            f"at prompt {prompt}{variant}{more}")
