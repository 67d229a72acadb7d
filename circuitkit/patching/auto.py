"""``method="auto"``: the exact sweep where it is affordable (``choice``: ``cost.price``'s
``auto``, at or below ``cost.AUTO_EXACT_MAX_FLOPS_PER_TOKEN`` FLOPs per prompt token), else
screen then verify with the screening estimator and its automatic budget (``run``). With
``screening_recall=True`` an exact run also screens, to report the screen's recall of the exact
top-k cells (it roughly doubles a small model's time, so it is asked for, never the default).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching import cost, hybrid
from circuitkit.patching.estimators import attribution
from circuitkit.patching.exact import sweeps as exact
from circuitkit.patching.inputs import NoGradientError, check_gradient
from circuitkit.patching.results import PatchResult, quiet_baseline
from circuitkit.patching.units import HeadUnits, PatchOptions


def choice(model: Any, seq: int, site: str, positions: str) -> dict[str, Any]:
    """What ``method="auto"`` runs for this model and sweep shape, and why: ``cost.price``'s
    ``auto`` of the head sweep's ``Work`` (per prompt of ``seq`` tokens; ``chose``,
    ``exact_flops_per_token``, ``threshold``) and ``n_params``."""
    f = hooks.facts(model)
    n_params = sum(p.numel() for p in model.parameters())
    per_layer = f.n_heads_at(site) * (seq if positions == "each" else 1)
    work = cost.Work(1, n_cells=f.n_layers * per_layer, per_round=per_layer,
                     shares=cost.head_shares(f.n_layers, per_layer), n_params=n_params)
    return dict(cost.price(work)["auto"], n_params=n_params)


def top_cells(effect: Tensor, k: int) -> list[tuple[int, ...]]:
    """The ``k`` cells of largest ``|effect|`` (a ``values``-shaped tensor), largest first."""
    flat = torch.topk(effect.abs().flatten(), min(k, effect.numel())).indices
    return [tuple(int(i) for i in torch.unravel_index(j, effect.shape)) for j in flat]


def run(model: Any, clean: Tensor, corrupt: Tensor, pm: PromptMetric, units: HeadUnits,
        opts: PatchOptions, meta: dict) -> PatchResult:
    """``method="auto"`` over head ``units`` (module docstring); ``meta["auto"]``: the choice,
    the verified cells and ``screening``, whose ``recall`` (with ``screening_recall``) is the
    share of the exact top-k cells (by ``|value - baseline|``) among the screen's top k,
    ``k = min(top_k or 20, cells / 2)``."""
    site, positions = units.site, units.positions
    direction, batch_size, checkpoint, progress = (opts.direction, opts.batch_size,
                                                   opts.checkpoint, opts.progress)
    top_k, max_passes = opts.top_k, opts.max_passes
    info = choice(model, clean.shape[1], site, positions)
    if max_passes is not None and info["chose"] == "exact":
        warnings.warn(f"max_passes={max_passes!r} does nothing here: method='auto' chose the "
                      "exact sweep (every cell).", stacklevel=3)
    n_cells = hooks.facts(model).n_layers * hooks.facts(model).n_heads_at(site) * (
        clean.shape[1] if positions == "each" else 1)
    k = min(top_k or 20, max(1, n_cells // 2))  # a "top k" of every cell would say nothing
    if info["chose"] == "exact":
        res, pm = exact.run(model, clean, corrupt, pm, units.sweep(model, direction, clean, pm),
                            opts, meta)
        info["verified"] = "all"
        info["screening"] = _screening_recall(
            model, clean, corrupt, pm, res, k, direction, site, positions, batch_size) \
            if opts.screening_recall else dict(k=k, estimator=None, recall=None,
                                          skipped="not asked (screening_recall=True)")
    else:
        check_gradient(pm, "attribution+exact")  # (the message names the hybrid auto chose)
        exact.whole_on_every_replica("method='auto' chose 'attribution+exact' here, which")
        estimator = attribution.screening_estimator(model, site, clean)
        screenable = units.screenable(model, clean, corrupt, pm,
                                      replace(opts, estimator=estimator, atp_star=False))
        res = hybrid.screen_then_verify(screenable, checkpoint, top_k=top_k, max_passes=max_passes,
                                        batch_size=batch_size, progress=progress)
        # (the hybrid predicted as dear as exact runs exact: res.meta["hybrid"] says why)
        ran_exact = res.method == "exact"
        info["verified"] = "all" if ran_exact else [list(c) for c in res.meta["verified_cells"]]
        info["screening"] = dict(k=n_cells if ran_exact else len(info["verified"]), recall=None,
                                 estimator=None if ran_exact else estimator)
    res.meta.update(exact.described(meta, pm))
    res.meta["auto"] = info
    return res


def _screening_recall(model: Any, clean: Tensor, corrupt: Tensor, pm: PromptMetric,
                      res: PatchResult, k: int, direction: str, site: str, positions: str,
                      batch_size: int | None) -> dict[str, Any]:
    """``meta["auto"]["screening"]`` of an exact ``auto`` run: how many of the exact top ``k``
    cells the screen finds (none for a metric without a gradient: it cannot screen)."""
    estimator = attribution.screening_estimator(model, site, clean)
    try:
        check_gradient(pm, "attribution")
        with quiet_baseline():  # the exact result says it, once
            screen = attribution.estimate_heads(
                model, clean, corrupt, pm, estimator, site, positions,
                PatchOptions(direction=direction, batch_size=batch_size, progress=False))
    except NoGradientError:
        return dict(k=k, estimator=None, recall=None, skipped="the metric carries no gradient")
    base = res.corrupt if direction == "denoise" else res.clean
    exact_top, screen_top = top_cells(res.values - base, k), top_cells(screen.values - base, k)
    return dict(k=k, estimator=estimator, recall=len(set(exact_top) & set(screen_top)) / max(1, k),
                exact_top=[list(c) for c in exact_top], screen_top=[list(c) for c in screen_top])
