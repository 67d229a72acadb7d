"""The public patching functions: ``patch`` (one entry for any units: every argument and metric
check, once), its thin wrappers ``patch_heads``, ``patch_layers``, ``patch_edges`` (as
TransformerLens's ``get_act_patch_*`` are partials of ``generic_activation_patch``),
and ``plan_patch``. The route: docs/architecture.md.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from jaxtyping import Int
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric, as_metric
from circuitkit.patching import auto, cost, hybrid
from circuitkit.patching.estimators import attribution
from circuitkit.patching.exact import ExactEngine
from circuitkit.patching.exact import sweeps as exact
from circuitkit.patching.exact.sweeps import chunk_fitting as _chunk_fitting  # noqa: F401 (tests)
from circuitkit.patching.exact.sweeps import versions  # noqa: F401 (re-exported)
from circuitkit.patching.inputs import (
    DIRECTIONS,
    METHODS,
    POSITIONS,
    check_batch_size,
    check_gradient,
    check_metric_prompts,
    check_tokens,
    checked_metric,
    choice,
)
from circuitkit.patching.results import (  # noqa: F401 (verified_mask re-exported)
    EdgeResult,
    PatchResult,
    verified_mask,
)
from circuitkit.patching.sweep import (  # noqa: F401 (make_sweep re-exported)
    EdgeLayout,
    auto_rows,
    available_bytes,
    bytes_per_row,
    length_order,
    make_sweep,
    model_devices,
)
from circuitkit.patching.units import (
    EdgeUnits,
    HeadUnits,
    LayerUnits,
    PatchOptions,
    PathUnits,
    as_options,
    as_units,
)

Tokens = Int[Tensor, "batch seq"]


def patch(model: Any, clean_tokens: Tokens, corrupt_tokens: Tokens, metric: Any, units: Any,
          method: str = "exact", options: PatchOptions | dict | None = None) -> PatchResult:
    """Patch every cell of ``units`` (``HeadUnits``, ``LayerUnits``, ``EdgeUnits``,
    ``PathUnits``; "heads", "layers", "edges", "paths" for their defaults) and return the metric
    after each patch, mean over prompts: a ``PatchResult`` with ``units.axes`` (edges: an
    ``EdgeResult``).

    ``method``: one of ``units.methods``: "exact", "attribution" (``options.estimator``, one of
    ``units.estimators``), "attribution+exact" (``hybrid.screen_then_verify``: one road for
    every unit) or "auto" (heads: ``auto.run``). ``options``: a ``PatchOptions`` (or a dict of
    its fields): the direction ("denoise": each cell's clean activation into the corrupt run;
    "noise": its corrupt activation into the clean run), batch size (default from free memory;
    halved and retried on out-of-memory), checkpoint folder (finished chunks, or
    attribution+exact's screen and verified cells, stored durably; a rerun resumes), progress,
    backend ("nnsight": heads through nnsight, ``remote=True`` on NDIF) and the method's
    options (``nnsight.exact``: the same checks, sweep and checkpoint, each chunk one nnsight
    trace). ``metric``: a ``PromptMetric`` or any callable ``logits -> scalar | [batch]``
    (wrapped once by ``as_metric``; same values either way). Under ``torchrun`` an exact
    sweep's chunks are split over ranks (``distributed``) and every rank returns the merged
    result; attribution and attribution+exact run whole on each replica (a warning says so).
    The route, module by module: docs/architecture.md, "One metric's route".
    """
    units, opts = as_units(units), as_options(options)
    method = units.check_method(method, opts)
    entry, traced = units.entry(method), opts.backend == "nnsight"
    if traced:  # heads, exact (check_method says): the model seen through nnsight's traces
        from circuitkit.patching.exact import nnsight

        model = nnsight.NnsightModel.of(model, opts.remote)
        entry.update(engine_checks=False, logits_of=model.logits_of)
    clean, corrupt, pm = _check(model, clean_tokens, corrupt_tokens, metric, opts.direction,
                                method, opts.batch_size, **entry)
    units = units.checked(model, clean, corrupt)
    meta = units.meta(model, opts.task_hash)
    if method in ("exact", "auto"):
        if traced:
            res = nnsight.exact(model, clean, corrupt, pm, units, opts, meta, method)
        else:
            res = units.exact(model, clean, corrupt, pm, opts, meta) if method == "exact" \
                else auto.run(model, clean, corrupt, pm, units, opts, meta)
        res.warn_if_degenerate()
        return _with_coverage(res, units, model, clean, corrupt, pm, opts.batch_size)
    exact.whole_on_every_replica(f"method={method!r}")
    if method == "attribution":
        res = units.estimate(model, clean, corrupt, pm, opts)
    else:
        screenable = units.screenable(model, clean, corrupt, pm, opts)
        res = hybrid.screen_then_verify(screenable, opts.checkpoint, top_k=opts.top_k,
                                        max_passes=opts.max_passes,
                                        batch_size=opts.batch_size, progress=opts.progress,
                                        exact_when_cheaper=opts.budget.exact_when_cheaper,
                                        **opts.budget.rule())
    res.meta.update(exact.described(meta, pm))
    exact.with_recorded(res, model, clean, corrupt)
    res.warn_if_degenerate()
    return _with_coverage(res, units, model, clean, corrupt, pm, opts.batch_size)


def _with_coverage(res: Any, units: Any, model: Any, clean: Tensor, corrupt: Tensor, pm: Any,
                   batch_size: int | None) -> Any:
    """An edge result with ``meta["coverage"]``: the share of each head sender's node effect
    its edges explain. An exact sweep states it (its own node runs, ``exact.run_edges``); an
    estimate's is measured here (``paths.edge_coverage``: one forward per sender and batch)."""
    if isinstance(units, EdgeUnits) and "coverage" not in res.meta \
            and any(s[0] >= 0 for s in res.senders):
        from circuitkit.patching.paths import edge_coverage

        res.meta["coverage"] = edge_coverage(model, clean, corrupt, pm, res, batch_size)
    return res


def patch_heads(model: Any, clean_tokens: Tokens, corrupt_tokens: Tokens, metric: Any, *,
                direction: str = "denoise", method: str = "exact", positions: Any = "all",
                site: str = "z", options: PatchOptions | dict | None = None) -> PatchResult:
    """``patch`` over every attention head at ``site`` (``HeadUnits(site, positions)``).

    ``values``: ``[n_layers, n_heads]``, ``[n_layers, n_heads, seq]`` (``positions="each"``;
    for "pattern" the query position, whose whole attention row is patched, as
    TransformerLens's ``get_act_patch_attn_head_pattern_by_pos``) or ``[n_layers, n_heads,
    n_groups]`` (``positions`` a bool mask ``[batch, seq]`` or ``{name: mask}``, e.g.
    ``task.position_groups()``: ``patching/groups.py``; methods "exact" and plain "attribution"
    only). Sites k/v of a GQA model: the KV-head axis (``meta["head_axis"] == "kv_head"``).
    ``direction``: ``PatchOptions.direction``, given here or in ``options`` (batch size,
    checkpoint, progress, backend, the estimator, ``top_k``, ``max_passes``...).
    """
    return patch(model, clean_tokens, corrupt_tokens, metric, HeadUnits(site, positions),
                 method, as_options(options, direction=direction))


def patch_edges(model: Any, clean_tokens: Tokens, corrupt_tokens: Tokens, metric: Any,
                senders: Any = None, receivers: Any = None, inputs: Any = hooks.EDGE_INPUTS, *,
                direction: str = "denoise", method: str = "exact",
                options: PatchOptions | dict | None = None) -> EdgeResult:
    """``patch`` over every edge (``EdgeUnits(senders, receivers, inputs)``): a sender's write
    (source minus base: a head's ``dz @ W_O``, or the embeddings') added to one receiver's own
    copy of the residual at one input only, every other reader on the base run.
    ``values[s, r, i]``: the metric after that patch (``EdgeResult``; NaN where no edge;
    docs/edges.md).

    ``senders``/``receivers``: ``(layer, head)`` pairs or names ("L3H2", "embed" a sender,
    "logits" a receiver); None: every head and the embeddings / the logits. ``inputs``: any of
    "q", "k", "v" (under GQA k/v receivers are KV heads). ``options``: ``PatchOptions`` (the
    estimator and ``ig_steps`` of the attribution, default "eap", or of the hybrid's screen,
    default "eap*"; ``top_k``, ``max_passes``; batch size, checkpoint, progress).
    """
    return patch(model, clean_tokens, corrupt_tokens, metric,
                 EdgeUnits(senders, receivers, inputs), method,
                 as_options(options, direction=direction))


def patch_paths(model: Any, clean_tokens: Tokens, corrupt_tokens: Tokens, metric: Any,
                senders: Any = None, receivers: Any = None, inputs: Any = hooks.EDGE_INPUTS, *,
                direction: str = "denoise", positions: Any = None,
                options: PatchOptions | dict | None = None) -> PatchResult:
    """``patch`` over every path (``PathUnits(senders, receivers, inputs, positions)``): the
    sender's source ``z`` in the base run, everything after it recomputed, read by the
    receiver's ``inputs`` only (at each position group of ``positions``; None: every
    position). ``values[s, r(, g)]``: the metric after that patch, NaN where the receiver is
    not after the sender; ``meta``: each sender's ``node`` effect and the paths' ``coverage`` of
    it (``patching/paths.py``; docs/edges.md, "Paths"). Exact only (``ck.patch`` with
    ``PathUnits`` refuses another method in one line)."""
    return patch(model, clean_tokens, corrupt_tokens, metric,
                 PathUnits(senders, receivers, inputs, positions), "exact",
                 as_options(options, direction=direction))


def edge_layout(model: Any, senders: Any = None, receivers: Any = None,
                inputs: Any = hooks.EDGE_INPUTS) -> EdgeLayout:
    """The ``EdgeLayout`` of ``patch_edges``'s node arguments (checked: ``check_edge_nodes``)."""
    return EdgeUnits(senders, receivers, inputs).layout_of(model)


def patch_layers(model: Any, clean_tokens: Tokens, corrupt_tokens: Tokens, metric: Any, *,
                 direction: str = "denoise", method: str = "exact", positions: str = "each",
                 site: str = "resid_pre", options: PatchOptions | dict | None = None
                 ) -> PatchResult:
    """``patch`` of a whole-layer site (``resid_pre``, ``attn_out``, ``mlp_out``) at each
    (layer, position): ``values [n_layers, seq]``. Exact only, per position only."""
    if positions != "each":
        choice("positions", positions, POSITIONS)
        raise ValueError(f"patch_layers patches one position at a time (positions='each', its "
                         f"default); got positions={positions!r}. For one value per layer, use "
                         "patch_heads (site z, positions='all').")
    return patch(model, clean_tokens, corrupt_tokens, metric, LayerUnits(site), method,
                 as_options(options, direction=direction))


def plan_patch(model: Any, clean_tokens: Tokens, corrupt_tokens: Tokens, metric: Any,
               units: Any = "heads", method: str = "exact",
               options: PatchOptions | dict | None = None) -> dict[str, Any]:
    """Cost of ``patch(model, clean, corrupt, metric, units, method, options)`` for head
    ``units`` (a ``HeadUnits`` over positions "all" or "each"), with the time measured on a
    one-chunk probe (``options``: its direction, batch size, ``top_k`` and estimator).

    ``pass_equivalents``: prompts through the whole model (a backward counts 2), by
    ``cost.price``, the one price every route takes. Exact: the probe's chunk plan (each chunk
    runs ``(L - l) / L`` of a pass per patched prompt, up to its last read: ``cost.chunk_suffix``)
    plus the two cached runs; attribution: ``estimator``'s passes
    (``attribution.estimator_passes``); attribution+exact: the run's own prediction
    (``cost.price`` of its ``Screenable.work()``: the screen's passes plus the verified cells,
    ``top_k`` or ``cost.hybrid_cells``; ``verified_cells_max`` and ``est_seconds_max`` at the
    automatic budget's cap). Where that budget is predicted to cost at least the exact sweep,
    the run and the plan are exact (``hybrid["runs"]``).
    """
    units, opts = as_units(units), as_options(options)
    direction, batch_size, top_k, estimator = (opts.direction, opts.batch_size, opts.top_k,
                                               opts.estimator)
    if not isinstance(units, HeadUnits) or units.grouped:
        raise ValueError(f"plan_patch measures head sweeps over positions 'all' or 'each'; got "
                         f"units={units!r}. Edges are priced from the config: cost.edge_plan "
                         "(circuitkit edges --plan).")
    clean, corrupt, pm = _check(model, clean_tokens, corrupt_tokens, metric, direction, method,
                                batch_size, **dict(units.entry(method), engine_checks=False))
    units.check_method(method, PatchOptions(estimator=estimator, top_k=top_k))
    auto_info = None
    if method == "auto":
        auto_info = auto.choice(model, clean.shape[1], units.site, units.positions)
        method = auto_info["chose"]
    p = _probed(model, clean, corrupt, pm, units, direction, batch_size)
    out = dict(method=method, **p["row"])
    if auto_info is not None:
        out["auto"] = auto_info
    (n, seq), est = clean.shape, estimator or "atp"
    per_prompt = {est: attribution.estimator_passes(model, est, units.site, units.positions, seq,
                                                    batch=min(batch_size or n, n))} \
        if method == "attribution" else {}
    passes = cost.price(cost.Work(n, suffix=cost.chunk_suffix(
        p["total"], hooks.facts(model).n_layers, seq), per_prompt=per_prompt))["passes"]
    exact_row = dict(pass_equivalents=passes["exact"], est_seconds=p["per_cost"] * p["total"])
    if method == "exact":
        out.update(exact_row)
    elif method == "attribution":
        out.update(pass_equivalents=passes[est], est_seconds=p["per_pass"] * passes[est],
                   verified_cells=0, estimator=est)
    else:
        out.update(_hybrid_plan(model, p, units, opts, exact_row))
    return out


def _probed(model: Any, clean: Tensor, corrupt: Tensor, pm: PromptMetric, units: HeadUnits,
            direction: str, batch_size: int | None) -> dict[str, Any]:
    """``plan_patch``'s one-chunk probe (prompts in length order, rows halved on OOM): the
    seconds per token-block (``per_cost``) and per pass (``per_pass``, the cached runs'), the
    sweep's token-blocks (``total``) and the plan's shape row (``naive_passes``: TL's loop,
    ``cost.tl_loop_passes``)."""
    n, seq = clean.shape
    sweep = units.sweep(model, direction, clean, pm)
    rows = batch_size or auto_rows(model, seq)
    order, lengths = length_order(pm)
    if order is not None:
        clean, corrupt, pm = clean[order], corrupt[order], pm.select(order)
    timing: dict[str, float] = {}  # the memory probe is the time probe (rows halved on OOM)
    _, sweep, rows, first, _ = exact.fit_rows(partial(ExactEngine, model, clean, corrupt, pm),
                                              sweep, rows, lengths, None, timing)
    row = dict(n_variants=sweep.n_layers * sweep.n_variants, n_prompts=n, seq=seq,
               n_chunks=len(sweep.chunks), rows_per_forward=min(rows, sweep.n_variants * n),
               naive_passes=cost.tl_loop_passes(sweep.n_layers * sweep.n_variants, n),
               bytes_per_chunk=bytes_per_row(model, seq) * min(rows, sweep.n_variants * n),
               available_bytes=available_bytes(model_devices(model)))
    return dict(row=row, clean=clean, corrupt=corrupt, pm=pm,
                total=sum(sweep.chunk_cost(c) for c in sweep.chunks),
                cached_seconds=timing["cached"],  # the two cached runs: ~2 passes per prompt
                per_cost=timing["probe"] / sweep.chunk_cost(sweep.chunks[next(iter(first))]),
                per_pass=timing["cached"] / (2 * n))


def _hybrid_plan(model: Any, p: dict[str, Any], units: HeadUnits, opts: PatchOptions,
                 exact_row: dict[str, float]) -> dict[str, Any]:
    """``plan_patch``'s attribution+exact row: the run's own prediction (``cost.price`` of the
    ``Screenable`` the run builds, at ``opts.top_k``), timed at the probe's rates; the exact row
    where it runs exact."""
    clean, corrupt, pm = p["clean"], p["corrupt"], p["pm"]
    screener = opts.estimator or attribution.screening_estimator(model, units.site, clean)
    s = units.screenable(model, clean, corrupt, pm, PatchOptions(
        direction=opts.direction, estimator=screener, batch_size=opts.batch_size,
        progress=False))
    guess = cost.price(s.work(), cost.Budget(top_k=opts.top_k, **opts.budget.rule()))["hybrid"]
    n_cells = s.index.shape[0]

    def seconds(k: int) -> float:  # the screen at the cached runs' rate, cells at the probe's
        return p["per_pass"] * guess["screen_passes"] \
            + p["per_cost"] * p["total"] * k / n_cells + p["cached_seconds"]

    out = dict(estimator=screener, budget="auto" if opts.top_k is None else "top_k",
               hybrid=guess)
    if guess["runs"] == "exact" and opts.budget.exact_when_cheaper:  # what the run will do
        return dict(out, method="exact", **exact_row)
    return dict(out, pass_equivalents=guess["passes"], est_seconds=seconds(guess["cells"]),
                verified_cells=guess["cells"], verified_cells_max=guess["cells_max"],
                est_seconds_max=seconds(guess["cells_max"]))


# --- checks --------------------------------------------------------------------------------------


def _check(model, clean, corrupt, metric, direction, method, batch_size, *, site, positions,
           sites, engine_checks: bool = False, logits_of: Any = None
           ) -> tuple[Tensor, Tensor, PromptMetric]:
    """Arguments checked, the metric wrapped and fit for the tokens (``checked_metric``;
    ``engine_checks``: a probed metric's reads are left to the exact engine's cached runs;
    ``logits_of``: how the unpatched logits are run, default the TransformerLens model's,
    False: never, as ``checked_metric`` takes it)."""
    choice("direction", direction, DIRECTIONS)
    choice("method", method, METHODS)
    choice("positions", positions, POSITIONS)
    choice("site", site, sites)
    check_batch_size(batch_size)
    clean, corrupt = check_tokens(clean, corrupt, model)
    hooks.check_patchable(model, site, clean)
    n, seq = clean.shape
    pm = as_metric(metric, n, seq, hooks.facts(model).d_vocab_out)
    check_metric_prompts(pm, n)
    check_gradient(pm, method)
    return clean, corrupt, checked_metric(model, clean, corrupt, pm, batch_size,
                                          logits_of=logits_of, engine_checks=engine_checks)

