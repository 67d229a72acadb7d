"""The one driver of every attribution estimator, heads and edges: prompts in batches, the metric
stashes, the finite check, and the result with its meta. An estimator is its registry entry's
per-batch function; everything around it is here."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from circuitkit.metrics import PromptMetric
from circuitkit.patching import shortcuts
from circuitkit.patching.estimators.common import Batch, BatchOut, _MetricStash, _progress
from circuitkit.patching.results.edge_result import EdgeResult
from circuitkit.patching.results.patch_result import PatchResult


class Collected(NamedTuple):
    """Every batch's output, on the CPU in float32: ``delta`` per prompt, ``scales`` and
    ``terms`` (GradDrop) per batch, the base and source metrics per prompt."""

    delta: Tensor
    scales: list[Tensor]
    terms: list[Tensor]
    base_pp: Tensor
    src_pp: Tensor


def base_and_source(clean: Tensor, corrupt: Tensor, direction: str) -> tuple[Tensor, Tensor]:
    """Denoise: the base run is the corrupt prompt, the source the clean one; noise: reversed."""
    return (corrupt, clean) if direction == "denoise" else (clean, corrupt)


def run_batches(model: Any, metric: PromptMetric, base_all: Tensor, src_all: Tensor, bs: int,
                batch_fn: Callable[[Batch], BatchOut], progress: bool, desc: str,
                edges: bool = False) -> Collected:
    """``batch_fn`` on every batch of ``bs`` prompts, collected; then the finite check (edges:
    on edge cells only, NaN marking no edge)."""
    device = next(model.parameters()).device
    n = base_all.shape[0]
    reads = metric.read_positions()
    effects, scales, terms, base_vals, src_vals = [], [], [], [], []
    # No per-head hook_result einsum: nothing here reads it (the writes come from W_O).
    with shortcuts.attn_result_off(model):
        for start in _progress(range(0, n, bs), progress and n > bs, desc):
            idx = torch.arange(start, min(start + bs, n))
            at = None if reads is None else reads[idx].to(device)
            b = Batch(model, base_all[idx].to(device), src_all[idx].to(device),
                      _MetricStash(metric, idx, at), _MetricStash(metric, idx, at), idx, at, start)
            out = batch_fn(b)
            effects.append(out.effects.detach().float().cpu())
            scales.append(out.scale.detach().float().cpu())
            if out.terms is not None:
                terms.append(out.terms)
            base_vals.append(b.stash_base.value.float().cpu())
            src_vals.append(b.stash_src.value.float().cpu())
    got = Collected(torch.cat(effects), scales, terms, torch.cat(base_vals), torch.cat(src_vals))
    check_finite(metric, got, edges)
    return got


def check_finite(metric: PromptMetric, got: Collected, edges: bool) -> None:
    delta = got.delta[:, ~torch.isnan(got.delta[0])] if edges else got.delta
    if not (torch.isfinite(got.base_pp).all() and torch.isfinite(got.src_pp).all()
            and torch.isfinite(delta).all()):
        raise ValueError(
            f"metric {metric.name!r} or its gradient is not finite on these prompts "
            f"(base {got.base_pp.tolist()[:4]}, source {got.src_pp.tolist()[:4]}); attribution "
            "cannot estimate effects. Check the answer positions/tokens the metric reads.")


def base_meta(model: Any, metric: PromptMetric, est: str, n: int, bs: int, passes: float,
              t_start: float) -> dict[str, Any]:
    """The meta every estimate carries (heads and edges); the caller adds its own keys."""
    return dict(**dict(metric.labels), model=str(getattr(model.cfg, "model_name", "")),
                metric=metric.name, estimator=est, n_prompts=n, batch_size=bs,
                pass_equivalents=n * passes, seconds=time.perf_counter() - t_start)


def _fields(got: Collected, values: Tensor, per_prompt: Tensor, per_prompt_values: bool,
            direction: str) -> dict[str, Any]:
    """What every estimate's result holds beside its units: ``values``, the clean and corrupt
    baselines, per-prompt values where the metric has them, method "attribution"."""
    pp = per_prompt_values
    clean_pp, corrupt_pp = (got.src_pp, got.base_pp) if direction == "denoise" else (
        got.base_pp, got.src_pp)
    return dict(values=values, clean=clean_pp.mean(), corrupt=corrupt_pp.mean(),
                direction=direction, method="attribution", per_prompt=per_prompt if pp else None,
                clean_per_prompt=clean_pp if pp else None,
                corrupt_per_prompt=corrupt_pp if pp else None)


def head_result(got: Collected, delta_mean: Tensor, per_prompt_values: bool, direction: str,
                site: str, positions: str, meta: dict[str, Any]) -> PatchResult:
    """``values = metric(base) + delta`` (mean over prompts) as a ``PatchResult``."""
    per_prompt = got.base_pp.reshape(-1, *([1] * (got.delta.ndim - 1))) + got.delta
    res = PatchResult(site=site, positions=positions, meta=meta, **_fields(
        got, got.base_pp.mean() + delta_mean, per_prompt, per_prompt_values, direction))
    res.warn_if_degenerate()
    return res


def edge_result(got: Collected, per_prompt_values: bool, direction: str, layout: Any,
                meta: dict[str, Any]) -> EdgeResult:
    """``values = metric(base) + delta`` (mean over prompts) as an ``EdgeResult``."""
    per_prompt = got.base_pp[:, None, None, None] + got.delta
    return EdgeResult(senders=layout.senders, receivers=layout.receivers, inputs=layout.inputs,
                      n_layers=layout.n_layers, meta=meta, **_fields(
                          got, got.base_pp.mean() + got.delta.mean(0), per_prompt,
                          per_prompt_values, direction))
