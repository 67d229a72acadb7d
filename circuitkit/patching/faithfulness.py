"""Circuit faithfulness (``ck.circuit``): keep the top edges (or heads), ablate the rest
(docs/edges.md, "Circuit faithfulness"). For each size of the curve, the clean prompts run with
every scored item outside the kept share ablated; MIB's measures over the kept shares ``x_k``:

    f(C)  = (m(C) - m(empty)) / (m(full) - m(empty))
    CPR   = sum_k (x_{k+1} - x_k) (f_k + f_{k+1}) / 2
    CMD   = sum_k (x_{k+1} - x_k) (|1 - f_k| + |1 - f_{k+1}|) / 2
    share = (m(full) - m(empty)) / (m(clean) - m(corrupt))     (m(full): the clean run)

``m(full)``: every scored item kept; ``m(empty)``: every one ablated. Intervals: percentile
bootstrap over prompts (each resample recomputes the means). The runs go the exact road: the
entry's checks (``api._check``: tokens, the metric wrapped and its reads checked), then
``units.circuits.CircuitUnits`` through ``exact.sweeps.run_sweep`` (chunks of circuits,
checkpoint, progress bar) with ``exact.circuits.CircuitEngine``, whose docstring says how a
circuit runs: a receiver ``r`` reads at input ``i`` its own copy of the residual with every
dropped edge's live write swapped for its ablated one; MLPs are no nodes: they read the stream.
Heads: a kept head's edges are all kept, an ablated head's none.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit.patching.inputs import choice
from circuitkit.patching.results.circuit_graph import CircuitGraph
from circuitkit.patching.results.circuit_result import (
    CIRCUIT_ABLATIONS,
    CIRCUIT_OLD_ABLATIONS,
    CIRCUIT_RANKS,
    CircuitResult,
    CircuitTargetWarning,
)
from circuitkit.patching.results.edge_result import EdgeResult
from circuitkit.patching.results.patch_result import (
    DegenerateBaselineWarning,
    PatchResult,
    _outside_circuitkit,
    resample_weights,
)
from circuitkit.patching.units.circuits import CircuitOptions, CircuitUnits, as_circuit_options

ABLATIONS = CIRCUIT_ABLATIONS  # "mean": position-mean's old name (CIRCUIT_OLD_ABLATIONS)
# MIB's circuit sizes: shares of the scored items kept
MIB_SIZES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def circuit(model: Any, task: Any, edges_or_heads: EdgeResult | PatchResult,
            sizes: Any = MIB_SIZES, *, ablation: str = "corrupt", rank: str = "abs",
            target: float = 0.8, options: CircuitOptions | dict | None = None
            ) -> CircuitResult:
    """Faithfulness curve, CPR/CMD, share of the gap and the kept set of the circuits made of
    the top-scored edges or heads (module docstring).

    ``task``: a ``Task`` or a ``(clean_tokens, corrupt_tokens, metric)`` tuple.
    ``edges_or_heads``: an ``EdgeResult`` (items: its edges) or a ``PatchResult`` of heads at
    all positions (items: heads), patched on this model (``meta["model_fingerprint"]``).
    ``rank``: by ``|effect|`` ("abs") or helpful first ("signed", MIB's CPR: effect for
    denoise, ``-effect`` for noise). ``sizes``: shares of the items kept, in (0, 1], ascending
    (``int(share x n_items)`` items). ``ablation``: "corrupt" (the corrupt run's writes),
    "zero", "position-mean" (the clean prompts' mean write per position; "mean", its old name,
    with a ``DeprecationWarning``) or "resample" (another prompt's, ``head_sets.derangement``).
    ``target``: the kept set is the smallest circuit with faithfulness >= target, else the
    largest (``target_reached`` False, a ``CircuitTargetWarning``). ``options``: a
    ``CircuitOptions`` (or a dict of its fields): ``n_boot`` bootstrap resamples (0: none),
    ``seed`` (the bootstrap's and resample's), ``batch_size``, ``checkpoint`` (a folder: a
    rerun resumes) and ``progress``. A degenerate baseline (``PatchResult``'s rule, on clean
    vs corrupt and on full vs empty) gives ``degenerate`` (why), raw effects in
    ``faithfulness``, None for cpr/cmd/share and one ``DegenerateBaselineWarning``.
    """
    from circuitkit.patching.api import _check

    t0 = time.perf_counter()
    opts = as_circuit_options(options)
    ablation, sizes = _checked_options(ablation, rank, sizes, target)
    clean, corrupt, metric = _task_inputs(task)
    clean, corrupt, pm = _check(model, clean, corrupt, metric, "noise", "exact",
                                opts.batch_size, **CircuitUnits.entry())
    n = clean.shape[0]
    _check_same_model(model, edges_or_heads)
    graph = CircuitGraph.of(model, edges_or_heads)
    order = graph.order(rank, edges_or_heads.direction)
    counts = [int(share * graph.n_items) for share in sizes]
    # circuit 0, m(empty): every scored item ablated; m(full): the clean run (nothing ablated)
    kept = torch.zeros(len(counts) + 1, graph.n_items, dtype=torch.bool)
    for i, k in enumerate(counts):
        kept[i + 1, order[:k]] = True
    runs = CircuitUnits(graph, kept, ablation, opts.seed).checked(model, clean, corrupt).exact(
        model, clean, corrupt, pm, opts)
    full, corrupt_m, empty, curve = runs.full, runs.corrupt, runs.per[0], runs.per[1:]
    real = pm.per_prompt_values
    degenerate = _degenerate(full, corrupt_m, empty, real, pm.name, ablation)
    f, cpr, cmd, share, intervals = _curve(sizes, curve, full, empty, corrupt_m, degenerate,
                                           opts.n_boot if real and n > 1 else 0, opts.seed)
    reached = [i for i, v in enumerate(f.tolist()) if v >= target] if degenerate is None else []
    chosen = reached[0] if reached else len(sizes) - 1
    if degenerate is None and not reached:
        warnings.warn(CircuitTargetWarning(_missed(f, sizes, counts, target, graph.n_items)),
                      stacklevel=_outside_circuitkit())
    return CircuitResult(
        kind=graph.kind, sizes=tuple(sizes), n_kept=tuple(counts), faithfulness=f,
        per_prompt=curve if real else None, full=float(full.mean()),
        empty=float(empty.mean()), full_per_prompt=full if real else None,
        empty_per_prompt=empty if real else None, cpr=cpr, cmd=cmd,
        items=graph.ranked(order), n_layers=graph.n_layers, ablation=ablation, rank=rank,
        target=float(target), chosen=chosen, intervals=intervals,
        corrupt=float(corrupt_m.mean()), share=share, target_reached=bool(reached),
        degenerate=degenerate,
        meta=dict(n_prompts=n, n_items=graph.n_items, metric=pm.name, **dict(pm.labels),
                  model=str(getattr(model.cfg, "model_name", "")),
                  scores_method=edges_or_heads.method, direction=edges_or_heads.direction,
                  seconds=time.perf_counter() - t0, forwards=runs.forwards))


def _checked_options(ablation: str, rank: str, sizes: Any, target: Any
                     ) -> tuple[str, list[float]]:
    """``circuit``'s options checked (one clear ``ValueError`` each): (ablation, its old name
    "mean" read as "position-mean" with a ``DeprecationWarning``; sizes)."""
    if ablation in CIRCUIT_OLD_ABLATIONS:
        warnings.warn(f"ablation={ablation!r} is now {CIRCUIT_OLD_ABLATIONS[ablation]!r} (the "
                      "mean over prompts per position; ablate_heads' 'mean' pools positions "
                      "too); the old name will go.", DeprecationWarning, stacklevel=3)
        ablation = CIRCUIT_OLD_ABLATIONS[ablation]
    choice("ablation", ablation, ABLATIONS)
    choice("rank", rank, CIRCUIT_RANKS)
    sizes = _check_sizes(sizes)
    if not (isinstance(target, int | float) and 0 < target <= 1):
        raise ValueError(f"target={target!r}: expected a faithfulness in (0, 1] the kept set "
                         "must reach.")
    return ablation, sizes


def _curve(sizes: list[float], curve: Tensor, full: Tensor, empty: Tensor, corrupt: Tensor,
           degenerate: str | None, n_boot: int, seed: int
           ) -> tuple[Tensor, float | None, float | None, float | None, dict | None]:
    """(f per size, CPR, CMD, share, intervals) of the circuits' per-prompt metrics ``curve``
    ``[n_sizes, n_prompts]`` (module docstring; ``n_boot`` 0: no intervals). A ``degenerate``
    curve has no share to give: f holds the raw effects ``m(C) - m(empty)``, said once, and
    the rest is None."""
    if degenerate is not None:
        warnings.warn(DegenerateBaselineWarning(f"circuitkit: ck.circuit: {degenerate}"),
                      stacklevel=_outside_circuitkit())
        return curve.mean(1) - empty.mean(), None, None, None, None
    x = torch.tensor(sizes)
    f = _faithfulness(curve.mean(1), full.mean(), empty.mean())
    cpr, cmd = (float(a[0]) for a in _areas(x, f[None]))
    share = float(_share(full.mean(), empty.mean(), corrupt.mean()))
    intervals = _bootstrap(x, curve, full, empty, corrupt, n_boot, seed) if n_boot > 0 \
        else None
    return f, cpr, cmd, share, intervals


def _check_same_model(model: Any, result: Any) -> None:
    """Refuse a result patched on another model: its ``meta["model_fingerprint"]`` (written by
    every exact sweep) must be this model's (``identity.model_fingerprint``)."""
    if not isinstance(result, EdgeResult | PatchResult):
        return  # (CircuitGraph.of names the type)
    stored = (result.meta or {}).get("model_fingerprint")
    if stored is None:
        return
    from circuitkit.identity import model_fingerprint

    if stored != model_fingerprint(model):
        what = "EdgeResult" if isinstance(result, EdgeResult) else "PatchResult"
        raise ValueError(f"edges_or_heads: this {what} was patched on another model (its "
                         f"meta['model_fingerprint'] {str(stored)[:12]}... is not this model's "
                         "weights); score the items on the model you measure the circuit on.")


def _degenerate(full: Tensor, corrupt: Tensor, empty: Tensor, per_prompt: bool, metric: str,
                ablation: str) -> str | None:
    """Why faithfulness is no share (``PatchResult.degenerate``'s rule, the one rule), or None:
    the corruption does not lower the metric by its margin (clean vs corrupt run), or ablating
    every scored item does not move it by its margin (``full`` vs ``empty``: f would divide
    noise by noise)."""
    def view(a: Tensor, b: Tensor) -> PatchResult:
        return PatchResult(values=torch.zeros(1, 1), clean=float(a.mean()),
                           corrupt=float(b.mean()), direction="denoise", method="exact",
                           site="z", positions="all",
                           clean_per_prompt=a if per_prompt else None,
                           corrupt_per_prompt=b if per_prompt else None,
                           meta=dict(metric=metric))

    baseline = view(full, corrupt)
    if baseline.degenerate:
        return (baseline.degenerate_reason().removeprefix("circuitkit: ").split(", so ")[0]
                + ", so faithfulness, CPR and CMD are not shares of the behaviour: "
                "CircuitResult.faithfulness holds raw effects m(C) - m(empty) and cpr/cmd are "
                "None. Use a corruption that removes the behaviour, or more prompts.")
    ends = view(full, empty)
    if ends.degenerate:
        return (f"ablating every scored item ({ablation} ablation) moves metric {metric!r} by "
                f"{ends.gap:.3g} only (all kept {ends.clean:.4g}, all ablated {ends.corrupt:.4g}"
                f", margin {ends.gap_margin:.3g}): these items carry none of the behaviour "
                "measurably, so faithfulness would be noise over noise: raw effects m(C) - "
                "m(empty) are given and cpr/cmd are None. Score a larger candidate set.")
    return None


def _missed(f: Tensor, sizes: list[float], counts: list[int], target: float,
            n_items: int) -> str:
    best = int(torch.argmax(f.nan_to_num(float("-inf"))))
    return (f"circuitkit: ck.circuit: no circuit of the curve reaches faithfulness {target:g} "
            f"(best {float(f[best]):.3f} at size {sizes[best]:g}, {counts[best]} of {n_items} "
            f"items): target_reached is False and kept() is the largest circuit of the curve, "
            f"{counts[-1]} of {n_items} items. Add larger sizes (up to 1.0) or lower target.")


def _check_sizes(sizes: Any) -> list[float]:
    try:
        out = [float(s) for s in sizes]
    except (TypeError, ValueError):
        raise ValueError(f"sizes={sizes!r}: expected shares of the items kept, e.g. "
                         f"{list(MIB_SIZES)}.") from None
    if not out or any(not (0 < s <= 1) or math.isnan(s) for s in out) or out != sorted(out) \
            or len(set(out)) != len(out):
        raise ValueError(f"sizes={list(sizes)!r}: expected distinct shares in (0, 1], "
                         f"ascending, e.g. {list(MIB_SIZES)}.")
    return out


def _task_inputs(task: Any) -> tuple[Tensor, Tensor, Any]:
    if isinstance(task, tuple) and len(task) == 3:
        return task
    if all(hasattr(task, a) for a in ("clean_tokens", "corrupt_tokens", "metric")):
        return task.clean_tokens, task.corrupt_tokens, task.metric
    raise ValueError(f"task: expected a ck.Task or a (clean_tokens, corrupt_tokens, metric) "
                     f"tuple; got {type(task).__name__}.")


def _faithfulness(m: Tensor, full: Tensor, empty: Tensor) -> Tensor:
    return (m - empty) / (full - empty)


def _share(full: Tensor, empty: Tensor, corrupt: Tensor) -> Tensor:
    """The scored items' share of the whole behaviour: ``(full - empty) / (clean - corrupt)``
    (``full`` is the clean run)."""
    return (full - empty) / (full - corrupt)


def _areas(x: Float[Tensor, " k"], f: Float[Tensor, "b k"]) -> tuple[Tensor, Tensor]:
    """(CPR, CMD) of each row of ``f`` over ``x`` (trapezoids, as MIB)."""
    dx = x[1:] - x[:-1]
    cpr = (dx * (f[:, 1:] + f[:, :-1]) / 2).sum(1)
    gap = (1 - f).abs()
    cmd = (dx * (gap[:, 1:] + gap[:, :-1]) / 2).sum(1)
    return cpr, cmd


def _bootstrap(x: Tensor, curve: Float[Tensor, "k n"], full: Tensor, empty: Tensor,
               corrupt: Tensor, n_boot: int, seed: int, level: float = 0.95) -> dict[str, Any]:
    """Percentile intervals over prompt resamples of f (per size), CPR, CMD and the share of
    the gap (each resample recomputes every mean)."""
    w = resample_weights(curve.shape[1], n_boot, seed)
    full_b, empty_b = w @ full.double(), w @ empty.double()
    f = _faithfulness(w @ curve.double().T, full_b[:, None], empty_b[:, None])  # [n_boot, k]
    share = _share(full_b, empty_b, w @ corrupt.double())
    cpr, cmd = _areas(x.double(), f)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)

    def band(t: Tensor) -> list:
        t = t[torch.isfinite(t).all(-1) if t.ndim > 1 else torch.isfinite(t)]
        return torch.quantile(t, q, dim=0).movedim(0, -1).tolist() if t.numel() else None

    return dict(level=level, n_boot=n_boot, faithfulness=band(f), cpr=band(cpr),
                cmd=band(cmd), share=band(share))
