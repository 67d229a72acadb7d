"""Screen then verify (``method="attribution+exact"``) for any units: ``screen_then_verify``.

An estimator screens every cell; the exact engine verifies cells, the ``top_k`` largest
``|estimate|`` or as many as the estimator's own error asks (``budget_rule``). Heads and edges
differ only in their ``Screenable`` (built by ``HeadUnits.screenable`` / ``EdgeUnits.screenable``);
everything else is here, once: the checkpoint (``checkpoint.HybridCheckpoint``: a rerun replays the
rule on the stored numbers and picks the same cells), out-of-memory back-off, Ctrl-C, the budget
rule, the cost against an exact sweep, and running that sweep instead where the hybrid is predicted
to cost as much (``cost.price`` of ``Screenable.work``, which ``plan_patch`` prints too).

Cost (pass-equivalents, ``patching.cost``): a verified cell re-runs the share ``d`` of the
model downstream of it (heads ``(L - l) / L``, edges ``(L + 1 - l) / (L + 1)``): ``verify = n
(sum_verified d + 2)`` (``cost.verified_passes``), the exact sweep ``n read_share sum_all d + 2 n``
(``cost.cell_suffix``, ``cost.exact_passes``).
"""

from __future__ import annotations

import math
import numbers
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from circuitkit.metrics import PromptMetric
from circuitkit.patching import cost
from circuitkit.patching.checkpoint import HybridCheckpoint
from circuitkit.patching.inputs import check_top_k
from circuitkit.patching.sweep import is_out_of_memory, release_cached_memory

RULE = cost.Budget().rule()  # the automatic rule's defaults (recall_top, quantile, max_fraction)


@dataclass(frozen=True)
class Screenable:
    """What ``screen_then_verify`` needs to know of the units it screens (heads or edges).

    ``screen()``: the estimate (a ``PatchResult`` or ``EdgeResult`` with ``meta``
    ``write_scale``, ``pass_equivalents``, ``seconds``, ``estimator``). ``index``: ``[C, ndim]``,
    where flat cell ``j`` lives in ``values``. ``downstream``: ``[C]``, the share of the model a
    verification of cell ``j`` re-runs (its cost per prompt and its error unit's depth factor).
    ``layer``: ``[C]``, the forward a cell shares with others. ``run(layer, cells, p0, p1)``:
    ``[len(cells), p1 - p0]`` exact metric values of prompts ``p0:p1``; ``rows``: sequences per
    forward (halved on out-of-memory). ``per_round``: cells per round of the budget rule (one
    layer's worth). ``screen_passes``: the screen's predicted cost (before it runs). ``exact()``:
    the exact sweep, run instead where it is cheaper. ``identity``: what a checkpoint must share
    (``HybridCheckpoint``)."""

    kind: str
    screen: Callable[[], Any]
    index: Tensor
    downstream: Tensor
    layer: Tensor
    run: Callable[[int, list[int], int, int], Tensor]
    per_round: int
    screen_passes: float
    exact: Callable[[], Any]
    identity: Callable[[], dict]
    metric: PromptMetric
    n_prompts: int
    read_share: float
    rows: int
    result_type: type

    def work(self) -> cost.Work:
        """What ``cost.price`` prices of these cells: ``n`` prompts, ``C`` cells whose
        ``downstream`` shares sum to ``shares``, rounds of ``per_round``, the metric's
        ``read_share`` and the screen's predicted passes."""
        d = self.downstream.double()  # costs in float64
        return cost.Work(self.n_prompts, n_cells=d.numel(), shares=float(d.sum()),
                         per_round=self.per_round, read_share=self.read_share,
                         screen=self.screen_passes)


def check_max_passes(max_passes: Any, top_k: int | None) -> None:
    """``max_passes``: None or a positive, finite number; not together with ``top_k``."""
    if max_passes is None:
        return
    if isinstance(max_passes, bool) or not isinstance(max_passes, numbers.Real) or not (
            math.isfinite(max_passes) and max_passes > 0):
        raise ValueError(f"max_passes={max_passes!r}: expected a positive number of "
                         "pass-equivalents (prompts through the whole model), or None.")
    if top_k is not None:
        raise ValueError(f"max_passes={max_passes!r} and top_k={top_k!r}: top_k verifies "
                         "exactly top_k cells whatever they cost; give one of the two.")


def check_rule(top_k: Any, max_passes: Any, recall_top: int, quantile: float,
               max_fraction: float) -> None:
    """The hybrid's options, one line each."""
    check_top_k(top_k)
    if not (0.0 < quantile <= 1.0 and 0.0 < max_fraction <= 1.0) or recall_top < 1:
        raise ValueError(f"quantile={quantile!r} and max_fraction={max_fraction!r} must lie in "
                         f"(0, 1] and recall_top={recall_top!r} must be >= 1.")
    check_max_passes(max_passes, top_k)


def screen_then_verify(units: Screenable, checkpoint: Any = None, *, top_k: int | None = None,
                       max_passes: float | None = None, batch_size: int | None = None,
                       progress: bool = True, exact_when_cheaper: bool = True, **rule: Any) -> Any:
    """Screen every cell of ``units``, verify by ``top_k`` or ``budget_rule``, and return the
    estimate with the verified cells exact (``place``). With the automatic budget and
    ``exact_when_cheaper``, a hybrid predicted (``cost.price`` of ``units.work()``: its ``hybrid``
    entry) to cost at least the exact sweep runs the exact sweep instead (``meta["hybrid"]["ran"] ==
    "exact"``). Either way ``meta["hybrid"]`` says what ran and why, ``meta["timing"]`` the seconds
    of each part, and with ``progress`` one line on stderr says what was verified, why it stopped
    and the cost against exact's; a run that costs more than the exact sweep says so (a warning)."""
    budget = cost.Budget(top_k, max_passes, **dict(RULE, **rule))
    t_start = time.perf_counter()
    guess = cost.price(units.work(), budget)["hybrid"]
    if guess["runs"] == "exact" and exact_when_cheaper:
        res = units.exact()
        seconds = time.perf_counter() - t_start
        res.meta.update(hybrid=dict(guess, ran="exact", why=(
            f"attribution+exact was predicted to cost {guess['passes']:,.0f} pass-equivalents "
            f"(~{guess['cells']} cells verified), at least the exact sweep's "
            f"{guess['exact_passes']:,.0f}: every cell was patched exactly instead")),
            timing=dict(screen=0.0, verify=0.0, exact=seconds, total=seconds),
            # every cell is exact: the mask a hybrid result carries, all True (edges: every edge)
            verified=(~res.values.isnan()).tolist(), n_verified=units.index.shape[0])
        _say(progress, f"attribution+exact: ran the exact sweep ({res.meta['hybrid']['why']}).")
        return res
    warned = guess["passes"] >= guess["exact_passes"]
    if warned:
        warnings.warn(f"attribution+exact here is predicted to cost {guess['passes']:,.0f} "
                      f"pass-equivalents, at least the exact sweep's {guess['exact_passes']:,.0f}"
                      " (every cell exact): method='exact' is cheaper.", stacklevel=3)
    store = HybridCheckpoint.open(checkpoint, units.identity()) if checkpoint is not None \
        else None
    try:
        res = _verified(units, store, budget, batch_size, progress)
    finally:
        if store is not None:
            store.close()
    spent = res.meta["cost"]
    total = time.perf_counter() - t_start
    res.meta.update(seconds=total, timing=dict(screen=spent["estimator_seconds"],
                                               verify=spent["verify_seconds"], total=total),
                    hybrid=dict(guess, ran="attribution+exact", why=(
                        "top_k given" if top_k is not None else "max_passes given"
                        if max_passes is not None else "predicted cheaper than exact")))
    b, c = res.meta["budget"], res.meta["cost"]
    ratio = c["total_passes"] / max(c["exact_sweep_passes"], 1e-12)
    line = (f"attribution+exact: verified {res.meta['n_verified']} of {units.index.shape[0]} "
            f"cells exactly (stopped: {_STOPS[b['stopped']]}); {c['total_passes']:,.0f} "
            f"pass-equivalents ({c['estimator_passes']:,.0f} screen + "
            f"{c['verify_passes']:,.0f} verify) = {ratio:.2f}x the exact sweep's "
            f"{c['exact_sweep_passes']:,.0f}; {total:.1f} s")
    res.meta["hybrid"]["summary"] = line
    _say(progress, line)
    if ratio > 1 and not warned:  # one warning a run: before it starts, or once it is known
        warnings.warn(f"{line}: it cost more than patching every cell exactly "
                      "(method='exact').", stacklevel=3)
    return res


_STOPS = {"top_k": "top_k cells verified", "bound": "no unverified cell can reach the top "
          "cells", "budget": "max_fraction of the cells verified", "passes": "max_passes reached",
          "all": "every cell verified"}


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr)


def _verified(units: Screenable, store: HybridCheckpoint | None, budget: cost.Budget,
              batch_size: int | None, progress: bool) -> Any:
    """The screen (stored or run), then the verification (``budget.top_k`` or ``budget_rule``), each
    verified cell stored as its forward finishes; cost and budget in ``meta``."""
    top_k, max_passes = budget.top_k, budget.max_passes
    est = store.load_screen(units.result_type) if store is not None else None
    if est is None:
        est = units.screen()
        if store is not None:
            store.save_screen(est)
    elif progress:
        print(f"attribution+exact: screen ({est.meta['estimator']}) reused from {store.path}",
              file=sys.stderr)
    n, at = units.n_prompts, tuple(units.index.T)
    base = est.corrupt if est.direction == "denoise" else est.clean
    effect = (est.values - base)[at]
    scale = (_nan_tensor(est.meta["write_scale"])[at].nan_to_num(0.0)
             * units.downstream).clamp_min(1e-12)
    if not units.metric.per_prompt_values and batch_size is not None and batch_size < n:
        warnings.warn(f"batch_size={batch_size} is below the {n} prompts, but a metric without "
                      "per-prompt values needs every prompt in each forward: verification "
                      f"runs {n} sequences per forward.", stacklevel=4)
    t0 = time.perf_counter()
    v = _Verifier(units, store, progress)
    k_err, tau, stopped, rounds = 0.0, None, "top_k", 0
    try:
        if top_k is not None:
            v(torch.topk(effect.abs(), min(top_k, effect.numel())).indices.tolist())
        else:
            k_err, tau, stopped, rounds = budget_rule(
                Screened(effect, scale, units.downstream, base, n, units.per_round,
                         est.meta["pass_equivalents"]), v, budget)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {len(v.finished)} verified cells" + (
            f" and the screen saved in {store.path}; rerun the same call to resume." if store
            is not None else " lost (no checkpoint folder: pass checkpoint= to keep them)."),
            file=sys.stderr)
        raise
    if stopped == "passes" and rounds == 0:
        warnings.warn(f"max_passes={max_passes!r} leaves nothing to verify: the screen costs "
                      f"{est.meta['pass_equivalents']:.1f} pass-equivalents and the exact "
                      f"engine's two cached runs would cost {2 * n}; every cell is the "
                      "estimate.", stacklevel=4)
    d = units.downstream.double()
    verify_passes = cost.verified_passes(n, float(d[v.order].sum())) if v.order else 0.0
    spent = dict(estimator=est.meta["estimator"], estimator_passes=est.meta["pass_equivalents"],
                 verify_passes=verify_passes,  # (as a fresh run: a resumed one reused cells)
                 total_passes=est.meta["pass_equivalents"] + verify_passes,
                 exact_sweep_passes=cost.exact_passes(
                     cost.cell_suffix(n, float(d.sum()), units.read_share), n),
                 estimator_seconds=est.meta["seconds"],
                 verify_seconds=time.perf_counter() - t0, reused_cells=len(v.reused),
                 rows_per_forward=v.rows if units.metric.per_prompt_values else max(v.rows, n),
                 oom_backoffs=v.backoffs)
    said = dict(rule="top_k" if top_k is not None else "auto", top_k=top_k, max_passes=max_passes,
                error_scale=k_err, tau=tau, stopped=stopped, rounds=rounds, **budget.rule())
    error_unit = torch.full(est.values.shape, float("nan"))  # (NaN: no cell)
    error_unit[at] = scale
    return place(est, units.index, v.order, v.exact_pp[v.order], dict(
        budget=said, cost=spent, error_unit=_nested(error_unit)))


class _Verifier:
    """``verifier(cells)``: the exact values of flat ``cells`` into ``exact_pp`` ``[C, n]``
    (``done``, ``order``), by layer, as many cells per forward as ``rows`` sequences hold; on
    out-of-memory ``rows`` is halved and the forward retried. Cells stored in ``store`` (a
    resumed run) are reused, not run; each finished forward is stored at once (a killed run
    loses at most the forward in progress)."""

    def __init__(self, units: Screenable, store: HybridCheckpoint | None, progress: bool):
        n_cells, n = units.index.shape[0], units.n_prompts
        self.units, self.store, self.rows, self.backoffs = units, store, units.rows, 0
        self.exact_pp = torch.zeros(n_cells, n)
        self.done = torch.zeros(n_cells, dtype=torch.bool)
        self.order: list[int] = []
        self.reused: set[int] = set()
        self.finished: dict[int, Tensor] = dict(store.load_cells(n_cells, n)) if store else {}
        if self.finished and progress:
            print(f"attribution+exact: {len(self.finished)} verified cells reused from "
                  f"{store.path}", file=sys.stderr)

    def prompts_per_forward(self) -> int:  # a metric without per-prompt values needs them all
        n = self.units.n_prompts
        return min(n, self.rows) if self.units.metric.per_prompt_values else n

    def __call__(self, flat: list[int]) -> None:
        by_layer: dict[int, list[int]] = {}
        for j in flat:
            if j in self.finished:  # a resumed run: the rule replays on the stored values
                self.exact_pp[j] = self.finished[j]
                self.reused.add(j)
            else:
                by_layer.setdefault(int(self.units.layer[j]), []).append(j)
        for layer, js in by_layer.items():
            i = 0
            while i < len(js):
                group = js[i:i + max(1, self.rows // self.prompts_per_forward())]
                if not self._run(layer, group):
                    continue  # out of memory: rows halved, the same cells again
                self.finished.update({j: self.exact_pp[j].clone() for j in group})
                i += len(group)
                if self.store is not None:
                    self.store.save_cells(self.finished)
        self.done[flat] = True
        self.order.extend(flat)

    def _run(self, layer: int, group: list[int]) -> bool:
        """One forward's cells (prompts split to fit ``rows``); False after an out-of-memory
        back-off."""
        n, step = self.units.n_prompts, self.prompts_per_forward()
        try:
            self.exact_pp[group] = torch.cat([self.units.run(layer, group, p0, min(p0 + step, n))
                                              for p0 in range(0, n, step)], dim=1)
            return True
        except Exception as e:
            smallest = len(group) == 1 and (self.rows == 1
                                            or not self.units.metric.per_prompt_values)
            if not is_out_of_memory(e) or smallest:  # nothing left to shrink
                raise
        release_cached_memory()  # (out of the except block: its frames hold activations)
        self.rows, self.backoffs = max(1, self.rows // 2), self.backoffs + 1
        return False


def place(est: Any, index: Tensor, order: list[int], exact: Tensor, meta: dict) -> Any:
    """``est`` with cells ``index[order]`` set to ``exact`` (``[len(order), n]`` per prompt):
    ``method="attribution+exact"``, ``meta["verified"]`` the mask, ``meta["verified_cells"]`` in
    verification order, ``meta["attribution_values"]`` the screen's values."""
    values = est.values.clone()
    per_prompt = est.per_prompt.clone() if est.per_prompt is not None else None
    verified = torch.zeros(est.values.shape, dtype=torch.bool)
    cells = [tuple(int(i) for i in index[j]) for j in order]
    for cell, pp in zip(cells, exact, strict=True):
        values[cell] = pp.mean()
        verified[cell] = True
        if per_prompt is not None:
            per_prompt[(slice(None), *cell)] = pp
    n_cells = index.shape[0]
    out = replace(est, values=values, per_prompt=per_prompt, method="attribution+exact",
                  meta=dict(est.meta, top_k=len(order), verified=verified.tolist(),
                            verified_cells=cells, n_verified=len(order),
                            verified_fraction=len(order) / max(1, n_cells),
                            attribution_values=_nested(est.values), **meta))
    out._baseline_said = est._baseline_said  # the screen's baselines: said once
    return out


@dataclass(frozen=True)
class Screened:
    """What the screen said of the cells, each ``[C]``: ``effect`` (estimate minus ``base``, the
    baseline metric), ``scale`` (its error unit ``u``), ``downstream`` (each cell's share ``d``
    of the model); ``n`` prompts, ``per_round`` cells a round (one layer's), and the screen's
    ``passes``."""

    effect: Tensor
    scale: Tensor
    downstream: Tensor
    base: float
    n: int
    per_round: int
    passes: float


def budget_rule(screened: Screened, verify: Any, budget: cost.Budget
                ) -> tuple[float, float | None, str, int]:
    """The automatic budget (docs/attribution.md, "Screening"; ``e`` estimated effect, ``x``
    exact, ``u`` = ``scale`` the error unit, all ``[C]``, of ``screened``): (1) bound ``|x - e|
    <= k u``, ``k`` the ``budget.quantile`` of ``|x - e| / u`` over the verified cells; (2)
    rounds of ``per_round`` cells, highest ``|e| + k u`` first, the first round adding as many
    of largest ``u``; (3) ``tau`` = the ``recall_top``-th largest verified ``|x|``: stop when
    every unverified bound is below ``tau`` ("bound"), at ``max_fraction`` of the cells
    (``cost.hybrid_cap``: "budget"), or when no cell fits in ``max_passes`` (the screen plus
    ``cost.verified_passes``: "passes"). ``verify(cells)`` fills ``verify.exact_pp`` ``[C, n]``
    and ``verify.done`` ``[C]``. Returns ``(k, tau, stopped, rounds)``."""
    effect, scale, downstream, base = (screened.effect, screened.scale, screened.downstream,
                                       screened.base)
    n, per_layer, exact_pp, done = screened.n, screened.per_round, verify.exact_pp, verify.done
    recall_top, max_passes = budget.recall_top, budget.max_passes
    n_cells = effect.numel()
    k_err, tau, rounds = 0.0, None, 0
    cap = cost.hybrid_cap(n_cells, budget.max_fraction)
    while True:
        bound = effect.abs() + k_err * scale
        bound[done] = -1.0
        if int(done.sum()) >= min(recall_top, n_cells):
            x = (exact_pp.mean(1) - base)[done].abs()
            tau = float(x.topk(min(recall_top, x.numel())).values[-1])
            if float(bound.max()) < tau:
                return k_err, tau, "bound", rounds
        if bool(done.all()):
            return k_err, tau, "all", rounds
        if int(done.sum()) >= cap:
            return k_err, tau, "budget", rounds
        take = min(per_layer, int((~done).sum()), cap - int(done.sum()))
        picked = torch.topk(bound, take).indices.tolist()
        if rounds == 0:
            # calibrate on the largest patches too, where a first-order estimate is least
            # trustworthy: the bound is then not extrapolated to them
            size = scale.clone()
            size[picked] = -1.0
            more = min(per_layer, n_cells - take, cap - take)
            picked += torch.topk(size, max(0, more)).indices.tolist()
        if max_passes is not None:
            picked = _within(picked, screened.passes + cost.verified_passes(
                n, float(downstream[done].sum())), n * downstream, max_passes)
            if not picked:
                return k_err, tau, "passes", rounds
        verify(picked)
        rounds += 1
        ratio = (((exact_pp.mean(1) - base) - effect).abs() / scale)[done]
        k_err = float(torch.quantile(ratio, budget.quantile))


def _within(picked: list[int], spent: float, cost: Tensor, limit: float) -> list[int]:
    """The cells of ``picked`` (priority order) that fit, in turn, in what ``limit`` leaves
    after ``spent`` (``cost``: pass-equivalents of verifying each cell)."""
    keep = []
    for j in picked:
        if spent + float(cost[j]) <= limit:
            keep.append(j)
            spent += float(cost[j])
    return keep


def _nan_tensor(nested: Any) -> Tensor:
    """A nested list with None (no cell) as a float tensor with NaN there."""
    def fill(x: Any) -> Any:
        return [fill(v) for v in x] if isinstance(x, list) else float("nan") if x is None else x
    return torch.tensor(fill(nested), dtype=torch.float32)


def _nested(t: Tensor) -> list:
    """``t.tolist()`` with NaN (no cell) as None: JSON-safe."""
    if t.isnan().any():
        return [_nested(x) for x in t] if t.ndim > 1 else [None if v != v else v
                                                           for v in t.tolist()]
    return t.tolist()
