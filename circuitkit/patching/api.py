"""The public patching functions: ``patch_heads``, ``patch_layers``, ``plan_patch``.

All three take ``(model, clean_tokens, corrupt_tokens, metric)`` and then the same keyword-only
arguments. This is the one module that imports both the exact engine and attribution, and the
one place a user's metric is wrapped (``circuitkit.metrics.as_metric``), so exact, attribution and
the hybrid see the same ``PromptMetric``.

Flow of an exact sweep: arguments checked (``inputs``) -> metric wrapped -> ``make_sweep`` ->
prompts sorted by the length their metric needs -> ``plan`` (chunks) -> checkpoint opened and
verified (``checkpoint``) -> ``ExactEngine`` caches the base/source runs -> this rank's missing
chunks computed (``run_chunk``), each saved as it finishes -> ranks merged (``distributed``) ->
``PatchResult`` in the caller's prompt order.
"""

from __future__ import annotations

import functools
import math
import sys
import time
import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from jaxtyping import Int
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric, as_metric
from circuitkit.patching import attribution, distributed
from circuitkit.patching import plan as costs
from circuitkit.patching.checkpoint import (
    HybridCheckpoint,
    SweepCheckpoint,
    default_dir,
    model_fingerprint,
    sweep_identity,
    tokens_hash,
)
from circuitkit.patching.engine import EdgeEngine, ExactEngine
from circuitkit.patching.inputs import (
    BACKENDS,
    DIRECTIONS,
    EDGE_METHODS,
    METHODS,
    POSITIONS,
    NoGradientError,
    ReadsDoNotHold,
    check_batch_size,
    check_edge_model,
    check_edge_nodes,
    check_gradient,
    check_metric_prompts,
    check_tokens,
    check_top_k,
    checked_metric,
    choice,
    without_probed_reads,
)
from circuitkit.patching.results import (  # noqa: F401 (re-exported)
    EdgeResult,
    PatchResult,
    quiet_baseline,
    verified_mask,
)
from circuitkit.patching.sweep import (
    Chunk,
    EdgeLayout,
    Sweep,
    auto_rows,
    is_out_of_memory,
    length_order,
    make_edge_sweep,
    make_sweep,
    plan,
    release_cached_memory,
)

# One wording for cost everywhere: a pass-equivalent is one prompt through the whole model;
# a backward counts as two forwards.


def patch_heads(
    model: Any,
    clean_tokens: Int[Tensor, "batch seq"],
    corrupt_tokens: Int[Tensor, "batch seq"],
    metric: Any,
    *,
    direction: str = "denoise",
    method: str = "exact",
    positions: str = "all",
    site: str = "z",
    batch_size: int | None = None,
    checkpoint: str | Path | None = None,
    progress: bool = True,
    atp_star: bool = False,
    top_k: int | None = None,
    task_hash: str | None = None,
    backend: str = "transformer_lens",
    remote: bool = False,
    estimator: str | None = None,
    max_passes: float | None = None,
) -> PatchResult:
    """Patch every attention head (per layer; per position with ``positions="each"``).

    ``denoise``: each head's clean activation at ``site`` patched into the corrupt run;
    ``noise``: its corrupt activation patched into the clean run. ``values``: ``[n_layers,
    n_heads]`` (or ``[n_layers, n_heads, seq]``), the metric after the patch, mean over prompts.
    For ``site`` k/v on a GQA model the head axis is the KV-head axis (``meta["head_axis"] ==
    "kv_head"``). For ``site="pattern"`` a position is the query (destination) position, whose
    whole attention row is patched (as TransformerLens's
    ``get_act_patch_attn_head_pattern_by_pos``).

    ``metric``: a ``PromptMetric`` or any callable ``logits -> scalar | [batch]`` (wrapped once by
    ``as_metric``; same values either way). ``method``: "exact" (the engine), "attribution"
    (gradient estimate by ``estimator``, default plain AtP, or AtP*'s Q/K fix with ``atp_star``;
    ``attribution.ESTIMATORS``), "attribution+exact" (an estimator screens, default "block";
    the exact engine verifies the ``top_k``, or with ``top_k=None`` as many cells as its error
    bound requires: ``attribution_plus_exact``), "auto" (``_auto``: exact below
    ``plan.AUTO_EXACT_MAX_FLOPS_PER_TOKEN``, else attribution+exact with the automatic budget;
    ``meta["auto"]`` records the choice, the verified cells and, where every cell is exact, the
    screening recall of the top k). ``max_passes``: attribution+exact (and auto's hybrid) stop
    verifying when the next cell would pass this many pass-equivalents in all.
    ``batch_size``: sequences per forward (default: from free memory; halved and retried on
    out-of-memory). ``checkpoint``: folder; finished chunks (attribution+exact: the screen and
    the verified cells) are stored durably and a rerun resumes. Under ``torchrun`` an exact
    sweep's chunks are split over ranks (replicas, see ``distributed``); every rank returns the
    merged result. Attribution and attribution+exact are not split: each replica runs them
    whole (a warning says so).
    ``backend="nnsight"``: the same exact sweep through nnsight's tracing (``nnsight_backend``;
    ``model`` an nnsight model or a name/folder; ``remote=True`` runs it on NDIF).
    """
    _check_method_options(method, estimator, atp_star, top_k, max_passes)
    if method == "attribution":
        _unused_checkpoint(checkpoint, "method='attribution'")
    elif backend == "nnsight":
        _unused_checkpoint(checkpoint, "backend='nnsight'")
    if backend != "transformer_lens" or remote:
        choice("backend", backend, BACKENDS)
        if backend != "nnsight":
            raise ValueError("remote=True runs through NDIF and needs backend='nnsight'.")
        from circuitkit.patching import nnsight_backend

        res = nnsight_backend.patch_heads(
            model, clean_tokens, corrupt_tokens, metric, direction=direction, method=method,
            positions=positions, site=site, batch_size=batch_size, progress=progress,
            remote=remote, task_hash=task_hash)
        res.warn_if_degenerate()
        return res
    clean_tokens, corrupt_tokens, pm = _check(model, clean_tokens, corrupt_tokens, metric,
                                              direction, method, positions, site, batch_size,
                                              hooks.PATCH_HEAD_SITES,
                                              engine_checks=method == "exact")
    f = hooks.facts(model)
    meta = dict(head_axis="kv_head" if site in hooks.KV_SITES and f.gqa else "head",
                task_hash=task_hash)
    if method == "auto":
        res = _auto(model, clean_tokens, corrupt_tokens, pm, direction=direction,
                    positions=positions, site=site, batch_size=batch_size,
                    checkpoint=checkpoint, progress=progress, top_k=top_k,
                    max_passes=max_passes, meta=meta)
        res.warn_if_degenerate()
        return res
    chosen = {} if estimator is None else dict(estimator=estimator)
    if method in ("attribution", "attribution+exact"):
        _whole_on_every_replica(f"method={method!r}")
    if method == "attribution":
        res = attribution.attribution_patch_heads(
            model, clean_tokens, corrupt_tokens, pm, direction=direction, site=site,
            positions=positions, atp_star=atp_star, batch_size=batch_size, progress=progress,
            **chosen)
    elif method == "attribution+exact":
        res = attribution_plus_exact(
            model, clean_tokens, corrupt_tokens, pm, direction=direction, site=site,
            positions=positions, top_k=top_k, atp_star=atp_star, batch_size=batch_size,
            progress=progress, max_passes=max_passes, checkpoint=checkpoint, **chosen)
    else:
        sweep = make_sweep(model, "heads", site, direction, positions, clean_tokens, pm)
        res, _ = _run(model, clean_tokens, corrupt_tokens, pm, sweep, batch_size, checkpoint,
                      progress, meta)
        res.warn_if_degenerate()
        return res
    res.meta.update(_described(meta, pm))
    res.warn_if_degenerate()
    return res


def patch_edges(
    model: Any,
    clean_tokens: Int[Tensor, "batch seq"],
    corrupt_tokens: Int[Tensor, "batch seq"],
    metric: Any,
    senders: Any = None,
    receivers: Any = None,
    inputs: Any = hooks.EDGE_INPUTS,
    *,
    direction: str = "denoise",
    method: str = "exact",
    checkpoint: str | Path | None = None,
    progress: bool = True,
    batch_size: int | None = None,
    estimator: str | None = None,
    ig_steps: int | None = None,
    top_k: int | None = None,
    max_passes: float | None = None,
    task_hash: str | None = None,
) -> EdgeResult:
    """Patch every edge: a sender's write into one receiver's q, k or v input alone.

    An edge (sender, receiver, input): the sender's write (source minus base: a head's
    ``dz @ W_O``, or the embeddings' difference) is added to the receiver's own copy of the
    residual at that input only; every other reader keeps the base run (denoise: base corrupt,
    source clean; noise: the reverse). ``values[s, r, i]`` is the metric after that patch,
    mean over prompts (``EdgeResult``; docs/edges.md).

    ``senders``/``receivers``: lists of ``(layer, head)`` (or "L3H2"), with "embed" (a sender)
    and "logits" (a receiver); None: every head and the embeddings / the logits. ``inputs``:
    any of "q", "k", "v" (under GQA, k/v receivers are KV heads). ``method``: "exact" (the
    edge engine: receivers of one layer per forward, re-entering at their layer), "attribution"
    (``estimator``: "eap", the default, "eap-ig-inputs" or "eap-ig-activations", ``ig_steps``
    steps, or "eap*", the receiving head run exactly; ``attribution.attribution_patch_edges``)
    or "attribution+exact" (an estimator screens every edge, default "eap*", and the exact
    engine verifies the ``top_k``,
    or as many as the error bound of ``attribution_plus_exact`` requires; ``max_passes`` caps
    the cost). ``checkpoint``: folder; finished chunks of an exact sweep are stored and a rerun
    resumes (the other methods are not checkpointed: a warning says so).
    ``metric``: a ``PromptMetric`` or any callable (``as_metric``).
    """
    choice("method", method, EDGE_METHODS)
    _check_method_options(method, None, False, top_k, max_passes)
    if estimator is not None or ig_steps is not None:
        if method == "exact":
            warnings.warn("estimator and ig_steps do nothing with method='exact'.", stacklevel=2)
        else:
            choice("estimator", estimator or attribution.EDGE_ESTIMATORS[0],
                   attribution.EDGE_ESTIMATORS)
    if method != "exact" and checkpoint is not None:
        warnings.warn(f"checkpoint={str(checkpoint)!r} is not used: edges are checkpointed with "
                      f"method='exact' only (method={method!r} is not).", stacklevel=2)
    clean_tokens, corrupt_tokens, pm = _check(model, clean_tokens, corrupt_tokens, metric,
                                              direction, "exact", "all", "z", batch_size,
                                              hooks.PATCH_HEAD_SITES)
    layout = edge_layout(model, senders, receivers, inputs)
    for name in layout.inputs:
        hooks.check_patchable(model, name, clean_tokens)
    check_edge_model(model)
    meta = dict(task_hash=task_hash, kv_heads=hooks.facts(model).gqa)
    if method == "attribution":
        res = attribution.attribution_patch_edges(
            model, clean_tokens, corrupt_tokens, pm, layout, direction=direction,
            estimator=estimator, ig_steps=ig_steps, batch_size=batch_size, progress=progress)
        res.meta.update(_described(meta, pm))
        res.warn_if_degenerate()
        return res
    if method == "attribution+exact":
        res = _edges_screen_then_verify(
            model, clean_tokens, corrupt_tokens, pm, layout, direction=direction,
            estimator=estimator, ig_steps=ig_steps, top_k=top_k, max_passes=max_passes,
            batch_size=batch_size, progress=progress)
        res.meta.update(_described(meta, pm))
        res.warn_if_degenerate()
        return res
    sweep = make_edge_sweep(model, layout, direction, clean_tokens, pm)
    swept = _sweep(model, clean_tokens, corrupt_tokens, pm, sweep, batch_size, checkpoint,
                   progress, make_engine=functools.partial(EdgeEngine, layout=layout),
                   identity_extra=layout.to_dict())
    values, per_prompt, clean_pp, corrupt_pp = _assembled(swept)
    pp = pm.per_prompt_values
    res = EdgeResult(
        values=values, clean=float(clean_pp.mean()), corrupt=float(corrupt_pp.mean()),
        direction=direction, method="exact", senders=layout.senders,
        receivers=layout.receivers, inputs=layout.inputs, n_layers=layout.n_layers,
        per_prompt=per_prompt, clean_per_prompt=clean_pp if pp else None,
        corrupt_per_prompt=corrupt_pp if pp else None,
        meta=dict(model=str(getattr(model.cfg, "model_name", "")), n_edges=layout.n_edges,
                  **swept.provenance(model), **_described(meta, pm)))
    res.warn_if_degenerate()
    return res


def _edges_screen_then_verify(model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric,
                              layout: EdgeLayout, *, direction: str, estimator: str | None,
                              ig_steps: int | None, top_k: int | None, max_passes: float | None,
                              batch_size: int | None, progress: bool, recall_top: int = 10,
                              quantile: float = 0.9, max_fraction: float = 0.5) -> EdgeResult:
    """``patch_edges(method="attribution+exact")``: screen every edge with an edge estimator
    (default ``attribution.EDGE_SCREENING_ESTIMATOR``), then verify edges with the edge engine
    (``EdgeEngine.run_variants``): the ``top_k`` largest ``|estimated effect|``, or with
    ``top_k=None`` by ``attribution_plus_exact``'s rule (``_budget_rule``), the error unit of an
    edge being ``u = write_scale x (L + 1 - l) / (L + 1)`` (``l``: its receiver layer; the logits
    count as layer ``L``). ``values``: exact where verified (``meta["verified"]``), the
    estimate elsewhere; ``meta["cost"]``: pass-equivalents of the screen and of the
    verification."""
    est = attribution.attribution_patch_edges(
        model, clean, corrupt, metric, layout, direction=direction,
        estimator=estimator or attribution.EDGE_SCREENING_ESTIMATOR, ig_steps=ig_steps,
        batch_size=batch_size, progress=progress)
    mask = est.edge_mask()
    cells = mask.nonzero()  # [E, 3]: sender, receiver, input
    n, L = clean.shape[0], layout.n_layers
    base = est.corrupt if direction == "denoise" else est.clean
    effect = (est.values - base)[mask]
    ws = torch.tensor([[[float("nan") if v is None else v for v in row] for row in mat]
                       for mat in est.meta["write_scale"]])[mask]
    rl = torch.tensor([layout.receivers[int(r)][0] for r in cells[:, 1]])
    downstream = (L + 1 - rl).float() / (L + 1)
    scale = (ws.nan_to_num(0.0) * downstream).clamp_min(1e-12)
    where: dict[tuple[int, int, int], tuple[int, int]] = {}  # (s, r, i) -> (layer, variant)
    r_index = layout.receiver_index()
    for layer in range(L + 1):
        for v, (s, i, u) in enumerate(layout.cells(layer).tolist()):
            where[(s, r_index[(layer, u) if layer < L else (L, -1)], i)] = (layer, v)
    place = [where[tuple(c)] for c in cells.tolist()]
    t0 = time.perf_counter()
    engines: list[EdgeEngine] = []

    def engine() -> EdgeEngine:
        if not engines:
            sweep = make_edge_sweep(model, layout, direction, clean, metric)
            engines.append(EdgeEngine(model, clean, corrupt, metric, sweep, layout))
        return engines[0]

    rows = batch_size or auto_rows(model, clean.shape[1])
    step = min(n, rows) if metric.per_prompt_values else n
    per = max(1, rows // step)
    n_cells = len(place)
    exact_pp = torch.zeros(n_cells, n)
    done = torch.zeros(n_cells, dtype=torch.bool)
    order: list[int] = []

    def verify(flat: list[int]) -> None:
        by_layer: dict[int, list[int]] = {}
        for j in flat:
            by_layer.setdefault(place[j][0], []).append(j)
        for layer, js in by_layer.items():
            for g0 in range(0, len(js), per):
                group = js[g0:g0 + per]
                exact_pp[group] = torch.cat([
                    engine().run_variants(layer, [place[j][1] for j in group], p0,
                                          min(p0 + step, n)) for p0 in range(0, n, step)], 1)
        done[flat] = True
        order.extend(flat)

    k_err, tau, stopped, rounds = 0.0, None, "top_k", 0
    if top_k is not None:
        verify(torch.topk(effect.abs(), min(top_k, n_cells)).indices.tolist())
    else:
        per_round = max(1, len(layout.inputs) * hooks.facts(model).n_heads)
        k_err, tau, stopped, rounds = _budget_rule(
            effect, scale, downstream, exact_pp, done, base, verify, n, per_round,
            recall_top=recall_top, quantile=quantile, max_fraction=max_fraction,
            max_passes=max_passes, screen_passes=est.meta["pass_equivalents"])
    values = est.values.clone()
    per_prompt = est.per_prompt.clone() if est.per_prompt is not None else None
    verified = torch.zeros_like(mask)
    for j in order:
        s, r, i = cells[j].tolist()
        values[s, r, i] = exact_pp[j].mean()
        verified[s, r, i] = True
        if per_prompt is not None:
            per_prompt[:, s, r, i] = exact_pp[j]
    verify_passes = n * (float(downstream[order].sum()) + 2 * bool(order))
    cost = dict(estimator=est.meta["estimator"], estimator_passes=est.meta["pass_equivalents"],
                verify_passes=verify_passes,
                total_passes=est.meta["pass_equivalents"] + verify_passes,
                exact_sweep_passes=n * (float(downstream.sum()) + 2),
                estimator_seconds=est.meta["seconds"],
                verify_seconds=time.perf_counter() - t0)
    budget = dict(rule="top_k" if top_k is not None else "auto", top_k=top_k,
                  recall_top=recall_top, quantile=quantile, max_fraction=max_fraction,
                  max_passes=max_passes, error_scale=k_err, tau=tau, stopped=stopped,
                  rounds=rounds)
    meta = dict(est.meta, verified=verified.tolist(), n_verified=len(order),
                verified_fraction=len(order) / max(1, n_cells), budget=budget, cost=cost,
                attribution_values=[[[None if v != v else v for v in row] for row in mat]
                                    for mat in est.values.tolist()])
    return replace(est, values=values, per_prompt=per_prompt, method="attribution+exact",
                   meta=meta)


def edge_layout(model: Any, senders: Any = None, receivers: Any = None,
                inputs: Any = hooks.EDGE_INPUTS) -> EdgeLayout:
    """The ``EdgeLayout`` of ``patch_edges``'s node arguments (checked: ``check_edge_nodes``)."""
    s, r, i = check_edge_nodes(model, senders, receivers, inputs)
    f = hooks.facts(model)
    return EdgeLayout(f.n_layers, f.n_heads, f.n_kv_heads, s, r, i)


def patch_layers(
    model: Any,
    clean_tokens: Int[Tensor, "batch seq"],
    corrupt_tokens: Int[Tensor, "batch seq"],
    metric: Any,
    *,
    direction: str = "denoise",
    method: str = "exact",
    positions: str = "each",
    site: str = "resid_pre",
    batch_size: int | None = None,
    checkpoint: str | Path | None = None,
    progress: bool = True,
    task_hash: str | None = None,
) -> PatchResult:
    """Patch a whole-layer site (``resid_pre``, ``attn_out``, ``mlp_out``) at each (layer, pos).

    ``values``: ``[n_layers, seq]``, the metric after patching layer l's site at position p.
    Exact only (``method="exact"``), per position only (``positions="each"``).
    """
    method = "exact" if method == "auto" else method  # one choice for layer sites
    clean_tokens, corrupt_tokens, pm = _check(model, clean_tokens, corrupt_tokens, metric,
                                              direction, method, positions, site, batch_size,
                                              hooks.PATCH_LAYER_SITES, engine_checks=True)
    if method != "exact":
        raise ValueError(f"patch_layers is exact only; got method={method!r}. Use patch_heads "
                         "for attribution (heads, not layers).")
    if positions != "each":
        raise ValueError(f"patch_layers patches one position at a time (positions='each', its "
                         f"default); got positions={positions!r}. For one value per layer, use "
                         "patch_heads (site z, positions='all').")
    sweep = make_sweep(model, "layers", site, direction, "each", clean_tokens, pm)
    res, _ = _run(model, clean_tokens, corrupt_tokens, pm, sweep, batch_size, checkpoint,
                  progress, dict(task_hash=task_hash))
    res.warn_if_degenerate()
    return res


def plan_patch(
    model: Any,
    clean_tokens: Int[Tensor, "batch seq"],
    corrupt_tokens: Int[Tensor, "batch seq"],
    metric: Any,
    *,
    direction: str = "denoise",
    method: str = "exact",
    positions: str = "all",
    site: str = "z",
    batch_size: int | None = None,
    top_k: int | None = None,
    estimator: str | None = None,
) -> dict[str, Any]:
    """Cost of a head sweep by ``method``, with the time measured on a one-chunk probe.

    ``pass_equivalents``: prompts through the whole model (a backward counts 2). Exact: each
    chunk runs ``(L - l) / L`` of a pass per patched prompt, up to its last read, plus the two
    cached runs; attribution: ``estimator``'s passes (``attribution.estimator_passes``; plain
    AtP: 4 per prompt, whatever the head count); attribution+exact: the screening estimator's
    passes (``estimator``, default the screening one) plus the verified cells:
    ``top_k``, or with the automatic budget (``top_k=None``) the expected
    ``plan.AUTO_EXPECTED_FRACTION`` of the cells (``verified_cells_max``, ``est_seconds_max``:
    at its cap, ``plan.AUTO_MAX_FRACTION``).
    """
    clean_tokens, corrupt_tokens, pm = _check(model, clean_tokens, corrupt_tokens, metric,
                                              direction, method, positions, site, batch_size,
                                              hooks.PATCH_HEAD_SITES)
    check_top_k(top_k)
    _check_method_options(method, estimator, False, top_k)
    f = hooks.facts(model)
    n, seq = clean_tokens.shape
    auto = None
    if method == "auto":
        auto = _auto_choice(model, seq, site, positions)
        method = auto["chose"]
    sweep = make_sweep(model, "heads", site, direction, positions, clean_tokens, pm)
    rows = batch_size or auto_rows(model, seq)
    order, lengths = length_order(pm)
    if order is not None:
        clean_tokens, corrupt_tokens, pm = clean_tokens[order], corrupt_tokens[order], \
            pm.select(order)
    timing: dict[str, float] = {}  # the memory probe is the time probe (rows halved on OOM)
    _, sweep, rows, first, _ = _fit_rows(model, clean_tokens, corrupt_tokens, pm, sweep, rows,
                                         lengths, None, timing)
    cached_seconds = timing["cached"]  # the two cached runs: ~2 passes per prompt
    per_cost = timing["probe"] / sweep.chunk_cost(sweep.chunks[next(iter(first))])
    total = sum(sweep.chunk_cost(c) for c in sweep.chunks)
    exact_passes = total / (f.n_layers * seq) + 2 * n
    per_pass = cached_seconds / (2 * n)
    out = dict(method=method, n_variants=sweep.n_layers * sweep.n_variants, n_prompts=n, seq=seq,
               n_chunks=len(sweep.chunks), rows_per_forward=min(rows, sweep.n_variants * n),
               naive_passes=sweep.n_layers * sweep.n_variants * n + 2 * n,
               bytes_per_chunk=_bytes_per_chunk(model, seq, rows, sweep),
               available_bytes=_available(model))
    if auto is not None:
        out["auto"] = auto
    if method == "exact":
        out.update(pass_equivalents=exact_passes, est_seconds=per_cost * total)
    elif method == "attribution":
        att = n * attribution.estimator_passes(model, estimator or "atp", site, positions, seq,
                                               batch=min(batch_size or n, n))
        out.update(pass_equivalents=att, est_seconds=per_pass * att, verified_cells=0,
                   estimator=estimator or "atp")
    else:
        from circuitkit.patching.plan import AUTO_EXPECTED_FRACTION, AUTO_MAX_FRACTION

        n_cells = sweep.n_layers * sweep.n_variants
        screener = estimator or attribution.screening_estimator(model, site, clean_tokens)
        screen = n * attribution.estimator_passes(model, screener, site, positions, seq,
                                                  batch=min(batch_size or n, n))
        out["estimator"] = screener
        if top_k is None:
            cells, most = (math.ceil(AUTO_EXPECTED_FRACTION * n_cells),
                           max(1, int(AUTO_MAX_FRACTION * n_cells)))
        else:
            cells = most = min(top_k, n_cells)

        L = sweep.n_layers
        per_cell = (L + 1) / (2 * L)  # a cell in layer l reruns (L - l) / L; its mean over layers

        def passes(k: int) -> float:  # as the run counts it (meta["cost"]), for an average cell
            return screen + k * n * per_cell + 2 * n

        def seconds(k: int) -> float:
            return per_pass * screen + per_cost * total * k / n_cells + cached_seconds

        out.update(pass_equivalents=passes(cells), est_seconds=seconds(cells),
                   verified_cells=cells, verified_cells_max=most,
                   est_seconds_max=seconds(most), budget="auto" if top_k is None else "top_k")
    return out


# --- the hybrid --------------------------------------------------------------------------------


def attribution_plus_exact(
    model: Any, clean_tokens: Tensor, corrupt_tokens: Tensor, metric: Any, *,
    direction: str = "denoise", site: str = "z", positions: str = "all",
    top_k: int | None = None, atp_star: bool = False, estimator: str | None = None,
    recall_top: int = 10, quantile: float = 0.9, max_fraction: float = 0.5,
    max_passes: float | None = None, batch_size: int | None = None, progress: bool = True,
    checkpoint: str | Path | None = None,
) -> PatchResult:
    """Screen every cell with an attribution estimator, then verify cells with the exact engine
    (``ExactEngine.run_variants``).

    ``estimator``: any of ``attribution.ESTIMATORS`` (default ``SCREENING_ESTIMATOR``, "block";
    ``atp_star=True``: "qk" where supported). ``top_k``: verify exactly the ``top_k`` largest
    ``|estimated effect|``. ``top_k=None`` (default): the budget is chosen from the estimator's
    own error, by this rule (``e``: estimated effect, ``x``: exact effect, ``u = w (L - l) / L``
    the error unit, ``w`` the cell's ``meta["write_scale"]``, ``l`` its layer; all per cell):

    1. error bound ``|x - e| <= k u``, with ``k`` the ``quantile`` of ``|x - e| / u`` over the
       cells verified so far (0 before any). ``u`` grows with the size of the patch and with
       the share of the model downstream of it: a first-order estimate's error is what the
       layers after the patch do nonlinearly with it (docs/attribution.md, "Screening");
    2. cells are verified in rounds of one layer's worth (``n_heads`` cells), highest upper bound
       ``U = |e| + k u`` first; the first round adds as many cells of largest ``u`` (the
       calibration then covers the largest patches, where first-order estimates fail);
    3. ``tau`` = the ``recall_top``-th largest ``|x|`` verified; stop as soon as every
       unverified ``U < tau`` ("bound"), or when ``max_fraction`` of the cells are verified
       ("budget"), or when no further cell fits in ``max_passes`` pass-equivalents, estimator
       and verification together (``meta["cost"]["total_passes"]``; "passes"): within a round,
       cells that do not fit are skipped in priority order.

    Stated recall: if every unverified cell obeys the bound (it held for a fraction ``quantile``
    of the verified cells), every cell with ``|x| >= tau`` is verified, so the exact top
    ``recall_top`` cells are all among the verified ones. ``meta["budget"]`` says which stop
    applied, with ``k`` (``error_scale``) and ``tau``.

    ``values``: exact metric-after-patch for the verified cells, the estimate for the rest;
    ``meta["verified"]``: nested-list bool mask shaped like ``values``, ``meta["verified_cells"]``
    in verification order; ``meta["attribution_values"]``: the screening estimate of every cell;
    ``meta["error_unit"]``: ``u`` of every cell;
    ``meta["cost"]``: pass-equivalents and seconds of the estimator and of the verification,
    and of a full exact sweep for reference (each prompt up to its metric's last read, as the
    exact engine runs it).

    ``metric``: a ``PromptMetric`` or any callable (``as_metric``). ``batch_size``: sequences
    per verification forward (default from free memory; halved and retried on out-of-memory).
    ``checkpoint``: folder (``checkpoint.HybridCheckpoint``); the screen and every verified
    cell are stored as they finish, and a rerun of the same call resumes (the rule replays
    on the stored numbers and picks the same cells).
    """
    check_top_k(top_k)
    if not (0.0 < quantile <= 1.0 and 0.0 < max_fraction <= 1.0) or recall_top < 1:
        raise ValueError(f"quantile={quantile!r} and max_fraction={max_fraction!r} must lie in "
                         f"(0, 1] and recall_top={recall_top!r} must be >= 1.")
    check_max_passes(max_passes, top_k)
    clean_tokens, corrupt_tokens, metric = _check(
        model, clean_tokens, corrupt_tokens, metric, direction, "attribution+exact", positions,
        site, batch_size, hooks.PATCH_HEAD_SITES)
    if estimator is None:
        estimator = ("qk" if atp_star and site in attribution.ATP_STAR_SITES
                     else attribution.screening_estimator(model, site, clean_tokens))
    sweep = make_sweep(model, "heads", site, direction, positions, clean_tokens, metric)
    store = None
    if checkpoint is not None:
        store = HybridCheckpoint.open(checkpoint, dict(
            sweep_identity(model, sweep, clean_tokens, corrupt_tokens, metric),
            method="attribution+exact", estimator=estimator,
            atp_star=bool(atp_star) and estimator in ("qk", "atp*")))  # what it changes
    try:
        res = _screen_then_verify(
            model, clean_tokens, corrupt_tokens, metric, sweep, store, direction=direction,
            site=site, positions=positions, top_k=top_k, atp_star=atp_star,
            estimator=estimator, recall_top=recall_top, quantile=quantile,
            max_fraction=max_fraction, max_passes=max_passes, batch_size=batch_size,
            progress=progress)
    finally:
        if store is not None:
            store.close()
    res.warn_if_degenerate()
    return res


def check_max_passes(max_passes: Any, top_k: int | None) -> None:
    """``max_passes``: None or a positive, finite number; not together with ``top_k``."""
    if max_passes is None:
        return
    import numbers

    if isinstance(max_passes, bool) or not isinstance(max_passes, numbers.Real) or not (
            math.isfinite(max_passes) and max_passes > 0):
        raise ValueError(f"max_passes={max_passes!r}: expected a positive number of "
                         "pass-equivalents (prompts through the whole model), or None.")
    if top_k is not None:
        raise ValueError(f"max_passes={max_passes!r} and top_k={top_k!r}: top_k verifies "
                         "exactly top_k cells whatever they cost; give one of the two.")


def _screen_then_verify(model: Any, clean_tokens: Tensor, corrupt_tokens: Tensor,
                        metric: PromptMetric, sweep: Any, store: HybridCheckpoint | None, *,
                        direction: str, site: str, positions: str, top_k: int | None,
                        atp_star: bool, estimator: str, recall_top: int, quantile: float,
                        max_fraction: float, max_passes: float | None, batch_size: int | None,
                        progress: bool) -> PatchResult:
    """``attribution_plus_exact`` after its checks: the screen (stored or run), then the rule."""
    est = store.load_screen() if store is not None else None
    if est is None:
        est = attribution.attribution_patch_heads(
            model, clean_tokens, corrupt_tokens, metric, direction=direction, site=site,
            positions=positions, estimator=estimator,
            atp_star=atp_star and estimator in ("qk", "atp*"), batch_size=batch_size,
            progress=progress)
        if store is not None:
            store.save_screen(est)
    elif progress:
        print(f"attribution+exact: screen ({estimator}) reused from {store.path}",
              file=sys.stderr)
    base = est.corrupt if direction == "denoise" else est.clean
    effect = (est.values - base).flatten()
    shape, n_cells = est.values.shape, effect.numel()
    n, L = clean_tokens.shape[0], est.values.shape[0]
    per_layer = n_cells // L
    downstream = (L - torch.arange(L).repeat_interleave(per_layer)) / L  # (L - l) / L per cell
    scale = (torch.tensor(est.meta["write_scale"]).flatten() * downstream).clamp_min(1e-12)
    t0 = time.perf_counter()
    engines: list[ExactEngine] = []  # built at the first cell: its two cached runs cost 2n

    def engine() -> ExactEngine:
        if not engines:
            engines.append(ExactEngine(model, clean_tokens, corrupt_tokens, metric, sweep))
        return engines[0]
    rows = [batch_size or auto_rows(model, clean_tokens.shape[1])]  # sequences per forward
    if not metric.per_prompt_values and batch_size is not None and batch_size < n:
        warnings.warn(f"batch_size={batch_size} is below the {n} prompts, but a metric without "
                      "per-prompt values needs every prompt in each forward: verification "
                      f"runs {n} sequences per forward.", stacklevel=3)
    backoffs = [0]
    exact_pp = torch.zeros(n_cells, n)  # per-prompt exact metric of verified cells
    done = torch.zeros(n_cells, dtype=torch.bool)
    order: list[int] = []
    stored = store.load_cells(n_cells, n) if store is not None else {}
    finished: dict[int, Tensor] = dict(stored)
    if stored and progress:
        print(f"attribution+exact: {len(stored)} verified cells reused from {store.path}",
              file=sys.stderr)

    def prompts_per_forward() -> int:  # a metric without per-prompt values needs them all
        return min(n, rows[0]) if metric.per_prompt_values else n

    def run(layer: int, group: list[int]) -> Tensor:
        """``[len(group), n]`` exact values, prompts split to fit ``rows``."""
        step = prompts_per_forward()
        return torch.cat([engine().run_variants(layer, [j % per_layer for j in group], p0,
                                                min(p0 + step, n))
                          for p0 in range(0, n, step)], dim=1)

    reused: set[int] = set()

    def verify(flat: list[int]) -> None:
        by_layer: dict[int, list[int]] = {}
        for j in flat:
            if j in finished:  # a resumed run: the rule replays on the stored values
                exact_pp[j] = finished[j]
                reused.add(j)
            else:
                by_layer.setdefault(j // per_layer, []).append(j)
        for layer, js in by_layer.items():
            i = 0
            while i < len(js):
                group = js[i:i + max(1, rows[0] // prompts_per_forward())]
                try:
                    exact_pp[group] = run(layer, group)
                except Exception as e:
                    smallest = len(group) == 1 and (rows[0] == 1 or not metric.per_prompt_values)
                    if not is_out_of_memory(e) or smallest:  # nothing left to shrink
                        raise
                    release_cached_memory()
                    rows[0], backoffs[0] = max(1, rows[0] // 2), backoffs[0] + 1
                    continue
                finished.update({j: exact_pp[j].clone() for j in group})
                i += len(group)
                if store is not None:  # a killed run loses at most the forward in progress
                    store.save_cells(finished)
        done[flat] = True
        order.extend(flat)

    k_err, tau, stopped, rounds = 0.0, None, "top_k", 0
    try:
        if top_k is not None:
            verify(torch.topk(effect.abs(), min(top_k, n_cells)).indices.tolist())
        else:
            k_err, tau, stopped, rounds = _budget_rule(
                effect, scale, downstream, exact_pp, done, base, verify, n, per_layer,
                recall_top=recall_top, quantile=quantile, max_fraction=max_fraction,
                max_passes=max_passes, screen_passes=est.meta["pass_equivalents"])
    except KeyboardInterrupt:
        print(f"\ninterrupted: {len(finished)} verified cells" + (
            f" and the screen saved in {store.path}; rerun the same call to resume." if store
            is not None else " lost (no checkpoint folder: pass checkpoint= to keep them)."),
            file=sys.stderr)
        raise
    if stopped == "passes" and rounds == 0:
        warnings.warn(f"max_passes={max_passes!r} leaves nothing to verify: the screen costs "
                      f"{est.meta['pass_equivalents']:.1f} pass-equivalents and the exact "
                      f"engine's two cached runs would cost {2 * n}; every cell is the "
                      "estimate.", stacklevel=3)
    verify_seconds = time.perf_counter() - t0
    values = est.values.clone()
    per_prompt = est.per_prompt.clone() if est.per_prompt is not None else None
    verified = torch.zeros(shape, dtype=torch.bool)
    cells = [tuple(int(i) for i in torch.unravel_index(torch.tensor(j), shape)) for j in order]
    for j, cell in zip(order, cells, strict=True):
        values[cell] = exact_pp[j].mean()
        verified[cell] = True
        if per_prompt is not None:
            per_prompt[(slice(None), *cell)] = exact_pp[j]
    # pass-equivalents: a verified cell of layer l re-runs layers l..L-1 (plus the engine's two
    # cached runs per prompt); the exact sweep does that for every cell, each prompt up to its
    # metric's last read (as plan_patch counts it)
    verify_passes = n * (float(downstream[order].sum()) + 2 * bool(order))  # as a fresh run
    _, lengths = length_order(metric)
    read_share = 1.0 if lengths is None else sum(lengths) / (n * clean_tokens.shape[1])
    cost = dict(estimator=est.meta["estimator"], estimator_passes=est.meta["pass_equivalents"],
                verify_passes=verify_passes,
                total_passes=est.meta["pass_equivalents"] + verify_passes,
                exact_sweep_passes=n * (float(downstream.sum()) * read_share + 2),
                estimator_seconds=est.meta["seconds"], verify_seconds=verify_seconds,
                reused_cells=len(reused), rows_per_forward=rows[0] if metric.per_prompt_values
                else max(rows[0], n), oom_backoffs=backoffs[0])
    budget = dict(rule="top_k" if top_k is not None else "auto", top_k=top_k,
                  recall_top=recall_top, quantile=quantile, max_fraction=max_fraction,
                  max_passes=max_passes,
                  error_scale=k_err, tau=tau, stopped=stopped, rounds=rounds)
    meta = dict(est.meta, top_k=len(order), verified=verified.tolist(), verified_cells=cells,
                n_verified=len(order), verified_fraction=len(order) / n_cells, budget=budget,
                cost=cost, attribution_values=est.values.tolist(),
                error_unit=scale.reshape(shape).tolist())
    return replace(est, values=values, per_prompt=per_prompt, method="attribution+exact",
                   meta=meta).said_as(est)  # the screen's baselines: said once


def _budget_rule(effect: Tensor, scale: Tensor, downstream: Tensor, exact_pp: Tensor,
                 done: Tensor, base: float, verify: Any, n: int, per_layer: int, *,
                 recall_top: int, quantile: float, max_fraction: float,
                 max_passes: float | None, screen_passes: float
                 ) -> tuple[float, float | None, str, int]:
    """The automatic budget of ``attribution_plus_exact`` (its docstring, steps 1-3): verify
    (``verify(cells)`` fills ``exact_pp`` and ``done``) round by round until the bound, the
    budget or ``max_passes`` stops it. Returns ``(k, tau, stopped, rounds)``."""
    n_cells = effect.numel()
    k_err, tau, rounds = 0.0, None, 0
    cap = max(1, int(max_fraction * n_cells))
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
            picked = _within(picked, screen_passes + n * (2 + float(downstream[done].sum())),
                             n * downstream, max_passes)
            if not picked:
                return k_err, tau, "passes", rounds
        verify(picked)
        rounds += 1
        ratio = (((exact_pp.mean(1) - base) - effect).abs() / scale)[done]
        k_err = float(torch.quantile(ratio, quantile))


def _within(picked: list[int], spent: float, cost: Tensor, limit: float) -> list[int]:
    """The cells of ``picked`` (priority order) that fit, in turn, in what ``limit`` leaves
    after ``spent`` (``cost``: pass-equivalents of verifying each cell)."""
    keep = []
    for j in picked:
        if spent + float(cost[j]) <= limit:
            keep.append(j)
            spent += float(cost[j])
    return keep


# --- method="auto": exact when affordable, else screen then verify ------------------------------


def _auto_choice(model: Any, seq: int, site: str, positions: str) -> dict[str, Any]:
    """What ``method="auto"`` runs for this model and sweep shape, and why."""
    f = hooks.facts(model)
    n_params = sum(p.numel() for p in model.parameters())
    cost = costs.exact_flops_per_token(n_params, f.n_layers, f.n_heads_at(site),
                                       seq if positions == "each" else 1)
    return dict(chose=costs.auto_method(cost), exact_flops_per_token=cost,
                threshold=costs.AUTO_EXACT_MAX_FLOPS_PER_TOKEN, n_params=n_params)


def top_cells(effect: Tensor, k: int) -> list[tuple[int, ...]]:
    """The ``k`` cells of largest ``|effect|`` (a ``values``-shaped tensor), largest first."""
    flat = torch.topk(effect.abs().flatten(), min(k, effect.numel())).indices
    return [tuple(int(i) for i in torch.unravel_index(j, effect.shape)) for j in flat]


def _auto(model: Any, clean: Tensor, corrupt: Tensor, pm: PromptMetric, *, direction: str,
          positions: str, site: str, batch_size: int | None, checkpoint: str | Path | None,
          progress: bool, top_k: int | None, meta: dict,
          max_passes: float | None = None) -> PatchResult:
    """``method="auto"``. Below the threshold (``_auto_choice``): the exact sweep, plus the
    screening estimator's pass (``attribution.SCREENING_ESTIMATOR``) so the result says how well
    screening would have done (``attribution.screening_estimator``: plain AtP where the model
    cannot re-run a layer alone): ``meta["auto"]["screening"]["recall"]`` = share of the exact top-k
    cells (by ``|value - baseline|``) among the screen's top k, ``k = min(top_k or 20, cells /
    2)``. Above it: ``attribution_plus_exact`` with the same estimator and, unless ``top_k`` is
    given, its automatic verification budget; the verified cells are listed in
    ``meta["auto"]["verified"]`` (no recall: exact values exist for those cells only)."""
    info = _auto_choice(model, clean.shape[1], site, positions)
    if max_passes is not None and info["chose"] == "exact":
        warnings.warn(f"max_passes={max_passes!r} does nothing here: method='auto' chose the "
                      "exact sweep (every cell).", stacklevel=3)
    estimator = attribution.screening_estimator(model, site, clean)
    n_cells = hooks.facts(model).n_layers * hooks.facts(model).n_heads_at(site) * (
        clean.shape[1] if positions == "each" else 1)
    k = min(top_k or 20, max(1, n_cells // 2))  # a "top k" of every cell would say nothing
    if info["chose"] == "exact":
        sweep = make_sweep(model, "heads", site, direction, positions, clean, pm)
        res, pm = _run(model, clean, corrupt, pm, sweep, batch_size, checkpoint, progress,
                       meta)
        info["verified"] = "all"
        info["screening"] = _screening_recall(model, clean, corrupt, pm, res, k, estimator,
                                              direction, site, positions, batch_size)
    else:
        check_gradient(pm, "attribution+exact")  # (the message names the hybrid auto chose)
        _whole_on_every_replica("method='auto' chose 'attribution+exact' here, which")
        res = attribution_plus_exact(
            model, clean, corrupt, pm, direction=direction, site=site, positions=positions,
            top_k=top_k, estimator=estimator, batch_size=batch_size, progress=progress,
            max_passes=max_passes, checkpoint=checkpoint)
        info["verified"] = [list(c) for c in res.meta["verified_cells"]]
        info["screening"] = dict(k=len(info["verified"]), recall=None, estimator=estimator)
    res.meta.update(_described(meta, pm))
    res.meta["auto"] = info
    return res


def _screening_recall(model: Any, clean: Tensor, corrupt: Tensor, pm: PromptMetric,
                      res: PatchResult, k: int, estimator: str, direction: str, site: str,
                      positions: str, batch_size: int | None) -> dict[str, Any]:
    """``meta["auto"]["screening"]`` of an exact ``auto`` run: how many of the exact top ``k``
    cells the screen finds (none for a metric without a gradient: it cannot screen)."""
    try:
        check_gradient(pm, "attribution")
        with quiet_baseline():  # the exact result says it, once
            screen = attribution.attribution_patch_heads(
                model, clean, corrupt, pm, direction=direction, site=site, positions=positions,
                estimator=estimator, batch_size=batch_size, progress=False)
    except NoGradientError:
        return dict(k=k, estimator=None, recall=None, skipped="the metric carries no gradient")
    base = res.corrupt if direction == "denoise" else res.clean
    exact_top, screen_top = top_cells(res.values - base, k), top_cells(screen.values - base, k)
    return dict(k=k, estimator=estimator,
                recall=len(set(exact_top) & set(screen_top)) / max(1, k),
                exact_top=[list(c) for c in exact_top], screen_top=[list(c) for c in screen_top])


# --- checks and orchestration --------------------------------------------------------------------


def _check(model, clean, corrupt, metric, direction, method, positions, site, batch_size,
           sites, engine_checks: bool = False) -> tuple[Tensor, Tensor, PromptMetric]:
    """Arguments checked, the metric wrapped and fit for the tokens (``checked_metric``;
    ``engine_checks``: a probed metric's reads are left to the exact engine's cached runs)."""
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
                                          engine_checks=engine_checks)


def _check_method_options(method: str, estimator: str | None, atp_star: bool,
                          top_k: int | None, max_passes: float | None = None) -> None:
    """A bad ``estimator`` is refused whatever the method; options only another method uses
    are said to do nothing (a warning: a notebook loop may pass one set of options to every
    method), never dropped in silence."""
    if estimator is not None:
        choice("estimator", estimator, attribution.ESTIMATORS)
    if method in ("attribution+exact", "auto"):
        check_max_passes(max_passes, top_k)
    given = [name for name, on in (("estimator", estimator is not None), ("atp_star", atp_star),
                                   ("top_k", top_k is not None),
                                   ("max_passes", max_passes is not None)) if on]
    allowed = {"exact": set(), "attribution": {"estimator", "atp_star"},
               "auto": {"top_k", "max_passes"},
               "attribution+exact": {"estimator", "atp_star", "top_k", "max_passes"}}.get(method)
    stray = [g for g in given if allowed is not None and g not in allowed]
    if stray:
        warnings.warn(
            f"{' and '.join(stray)} {'does' if len(stray) == 1 else 'do'} nothing with "
            f"method={method!r}: estimator and atp_star choose the estimate of method "
            "'attribution' or 'attribution+exact', top_k and max_passes the cells "
            "'attribution+exact' (or 'auto') verifies.", stacklevel=3)


def _whole_on_every_replica(what: str) -> None:
    """Under torchrun, say that this method is not split over the replicas."""
    if distributed.rank_world()[1] > 1:
        warnings.warn(f"{what} runs whole on every replica: only exact sweeps split their "
                      "chunks over torchrun's replicas. Run it in one process, or use "
                      "method='exact'.", stacklevel=3)


def _unused_checkpoint(checkpoint: Any, what: str) -> None:
    if checkpoint is not None:
        warnings.warn(f"checkpoint={str(checkpoint)!r} is not used: {what} is not checkpointed "
                      "(exact sweeps and attribution+exact of the TransformerLens backend "
                      "are).",
                      stacklevel=3)


def _described(meta: dict, metric: PromptMetric) -> dict:
    """The metric's labels (a task's metric: ``task``, ``phase``), the caller's meta entries
    that are set, and the metric's note when it has one."""
    out = dict(metric.labels)
    out.update({k: v for k, v in meta.items() if v is not None})
    if metric.note:
        out["metric_note"] = metric.note
    return out


class _Lazy:
    """``fn(*args)``, computed on the first call and kept."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args, self.value = fn, args, None

    def __call__(self) -> Any:
        if self.value is None:
            self.value = self.fn(*self.args)
        return self.value


def _bytes_per_chunk(model: Any, seq: int, rows: int, sweep: Sweep) -> int:
    from circuitkit.patching.sweep import bytes_per_row

    return bytes_per_row(model, seq) * min(rows, sweep.n_variants * sweep.n_prompts)


def _available(model: Any) -> int:
    from circuitkit.patching.sweep import available_bytes, model_devices

    return available_bytes(model_devices(model))


def versions() -> dict[str, str]:
    """Installed versions of circuitkit, torch, transformer-lens and transformers (looked up
    once per process: the metadata lookup costs ~6 ms per call)."""
    return dict(_versions())


# circuitkit's distribution name (PyPI's "circuitkit" is another project); the import name is
# circuitkit. An install made before the rename is found under the old name, by its summary.
DIST_NAME = "circuitkit-tl"


@functools.cache
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, distribution, version

    out = {}
    for pkg in ("circuitkit", "torch", "transformer-lens", "transformers"):
        out[pkg] = "?"
        for name in ((DIST_NAME, "circuitkit") if pkg == "circuitkit" else (pkg,)):
            try:
                dist = distribution(name)
            except PackageNotFoundError:
                continue
            if name == pkg and pkg == "circuitkit" and "distil" not in (
                    dist.metadata.get("Summary") or ""):
                continue  # PyPI's other circuitkit
            out[pkg] = version(name)
            break
    return out


def _run(model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric, sweep: Sweep,
         batch_size: int | None, checkpoint: str | Path | None, progress: bool,
         meta: dict) -> tuple[PatchResult, PromptMetric]:
    """The exact sweep, and the metric it ran with: a probed metric's reads are checked by the
    engine's cached runs (``inputs.ReadsDoNotHold``); where they do not hold, the sweep starts
    again reading every position (and right padding is checked for that metric)."""
    try:
        swept = _sweep(model, clean, corrupt, metric, sweep, batch_size, checkpoint, progress)
        metric = replace(metric, probed=False)
    except ReadsDoNotHold as e:
        metric = checked_metric(model, clean, corrupt, without_probed_reads(metric, e.which),
                                batch_size)
        sweep = make_sweep(model, sweep.kind, sweep.site, sweep.direction, sweep.positions,
                           clean, metric)
        swept = _sweep(model, clean, corrupt, metric, sweep, batch_size, checkpoint, progress)
    return _patch_result(model, swept, sweep, metric, meta), metric


def _patch_result(model: Any, swept: _Swept, sweep: Sweep, metric: PromptMetric,
                  meta: dict) -> PatchResult:
    """The ``PatchResult`` of a finished head or layer sweep."""
    values, per_prompt, clean_pp, corrupt_pp = _assembled(swept)
    pp = metric.per_prompt_values
    extra = _described(meta, metric)
    axes = ("layer", "pos") if sweep.kind == "layers" else (
        ("layer", "head", "pos") if sweep.positions == "each" else ("layer", "head"))
    return PatchResult(
        values=values, clean=float(clean_pp.mean()), corrupt=float(corrupt_pp.mean()),
        direction=sweep.direction, method="exact", site=sweep.site, positions=sweep.positions,
        per_prompt=per_prompt, clean_per_prompt=clean_pp if pp else None,
        corrupt_per_prompt=corrupt_pp if pp else None, axes=axes,
        meta=dict(model=str(getattr(model.cfg, "model_name", "")), **swept.provenance(model),
                  **extra))


class _Swept(NamedTuple):
    """A finished exact sweep (``_sweep``): its engine, every chunk's values, the prompt order
    it ran in (None: the caller's) and what the run recorded."""

    engine: Any
    done: dict[int, Tensor]
    order: Tensor | None
    info: dict[str, Any]

    def provenance(self, model: Any) -> dict[str, Any]:
        """The meta entries every exact result records."""
        return dict(**self.info, versions=versions(), facts=asdict(hooks.facts(model)))


def _assembled(swept: _Swept) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """(values, per_prompt, clean per prompt, corrupt per prompt) of a finished sweep, per
    prompt in the caller's order."""
    engine = swept.engine
    values, per_prompt = engine.assemble(swept.done)
    clean_pp, corrupt_pp = engine.clean_metric, engine.corrupt_metric
    if swept.order is not None:  # back to the caller's prompt order
        inv = torch.argsort(swept.order)
        clean_pp, corrupt_pp = clean_pp[inv], corrupt_pp[inv]
        per_prompt = None if per_prompt is None else per_prompt[inv]
    return values, per_prompt, clean_pp, corrupt_pp


def _identity(model: Any, sweep: Sweep, clean: Tensor, corrupt: Tensor, metric: PromptMetric,
              extra: dict) -> dict[str, Any]:
    return dict(sweep_identity(model, sweep, clean, corrupt, metric), **extra)


def _sweep(model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric, sweep: Sweep,
           batch_size: int | None, checkpoint: str | Path | None, progress: bool,
           make_engine: Any = ExactEngine, identity_extra: dict | None = None) -> _Swept:
    """Run every chunk of ``sweep`` with an engine from ``make_engine`` (``ExactEngine`` or
    ``EdgeEngine``): prompts sorted by length, memory fitted, checkpoint opened (its identity:
    ``sweep_identity`` plus ``identity_extra``), this rank's chunks computed and saved, ranks
    merged."""
    t_start = time.perf_counter()
    rank, world = distributed.rank_world()
    # The identity (with the metric's behaviour hash, 10-40 ms) is only needed to open a
    # checkpoint, or to save one on Ctrl-C; a plain sweep never pays for it.
    identity = _Lazy(_identity, model, sweep, clean, corrupt, metric, identity_extra or {})
    fingerprints = dict(model_fingerprint=model_fingerprint(model),
                        tokens_hash=tokens_hash(clean, corrupt))
    # The sweep runs on prompts sorted by length; results are put back in the caller's order.
    rows = batch_size or auto_rows(model, sweep.seq)
    order, lengths = length_order(metric)
    if order is not None:
        clean, corrupt, metric = clean[order], corrupt[order], metric.select(order)
    stored = SweepCheckpoint.stored_chunks(checkpoint) if checkpoint is not None else None
    bar = _Progress(progress and rank == 0, f"{'edges' if sweep.kind == 'edges' else 'patch'} "
                    f"{sweep.site} {sweep.direction}")
    engine, sweep, rows, first, backoffs = _fit_rows(model, clean, corrupt, metric, sweep, rows,
                                                     lengths, stored, bar=bar, rank=rank,
                                                     world=world, make_engine=make_engine)
    if world > 1 and stored is None:  # every rank must cut the sweep into the same chunks
        agreed = distributed.agreed_min(rows)
        if agreed < rows:
            rows, first = agreed, {}
            sweep = engine.sweep = plan(sweep, rows, lengths)
            bar.reset()  # a new plan: the bar restarts over its chunks
    ckpt = None
    if checkpoint is not None:
        ckpt = SweepCheckpoint.open(checkpoint, identity(), sweep.chunks, rank=rank,
                                    world=world)
        sweep = engine.sweep = replace(sweep, chunks=ckpt.chunks)  # a resume keeps its plan
    try:
        done: dict[int, Tensor] = ckpt.load_done() if ckpt else {}
        mine = [c for c in range(len(sweep.chunks)) if c % world == rank and c not in done]
        first = {c: t for c, t in first.items() if c in mine}  # the probe's chunk, if ours
        if ckpt is not None:
            for cid, t in first.items():
                ckpt.save_chunk(cid, t)
        if ckpt is not None and done and progress and rank == 0:
            print(f"resumed {len(done)} of {len(sweep.chunks)} chunks from {ckpt.path}",
                  file=sys.stderr)
        splits = [0]
        computed = _compute(engine, sweep, [c for c in mine if c not in first], ckpt, identity,
                            bar, n_done=len(done), splits=splits, computed=first)
    finally:
        if ckpt is not None:
            ckpt.close()
    done.update(computed)
    if world > 1:
        done.update(distributed.all_gather_chunks(computed))
    info = dict(**fingerprints, metric=metric.name, n_prompts=sweep.n_prompts, seq=sweep.seq,
                n_chunks=len(sweep.chunks), world=world, rows=rows, oom_backoffs=backoffs,
                oom_chunk_splits=splits[0], seconds=time.perf_counter() - t_start)
    return _Swept(engine, done, order, info)


def _heaviest(sweep: Sweep) -> int:
    """The chunk needing the most activation memory: most sequences x longest run."""
    return max(range(len(sweep.chunks)), key=lambda c: (
        (sweep.chunks[c].v1 - sweep.chunks[c].v0) * (sweep.chunks[c].p1 - sweep.chunks[c].p0)
        * sweep.run_length(sweep.chunks[c].p0, sweep.chunks[c].p1)))


def _fit_rows(model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric, sweep: Sweep,
              rows: int, lengths: list[int] | None, stored: tuple[Chunk, ...] | None,
              timing: dict[str, float] | None = None, bar: _Progress | None = None,
              rank: int = 0, world: int = 1, make_engine: Any = ExactEngine
              ) -> tuple[ExactEngine, Sweep, int, dict[int, Tensor], int]:
    """An engine and a plan that fit in memory: the cached runs, then the heaviest chunk run as
    a probe; on out-of-memory ``rows`` is halved, the sweep re-planned and both retried.
    Returns (engine, planned sweep, rows, {probe chunk: its result}, back-offs). A plan fixed
    by a checkpoint (``stored``) is kept (no probe: ``_chunk_fitting`` splits a chunk that
    does not fit). ``timing``: filled with the seconds of the cached runs and of the probe.
    ``bar``: opened on the plan's chunks of this ``rank`` (of ``world``) before the probe runs,
    so it starts at 0 and counts the probe's chunk when it is this rank's."""
    backoffs = 0
    timing = {} if timing is None else timing
    while True:
        planned = plan(sweep, rows, lengths)
        if stored is not None:
            planned = replace(planned, chunks=stored)
        oom = None
        try:
            t0 = time.perf_counter()
            engine = make_engine(model, clean, corrupt, metric, planned, rows=rows)
            t1 = time.perf_counter()
            first = {}
            if stored is None and planned.chunks:
                cid = _heaviest(planned)
                if bar is not None:
                    bar.open(sum(planned.chunk_prompts(c) for i, c in
                                 enumerate(planned.chunks) if i % world == rank))
                first[cid] = engine.run_chunk(planned.chunks[cid])
                if bar is not None and cid % world == rank:
                    bar.update(planned.chunk_prompts(planned.chunks[cid]))
            timing.update(cached=t1 - t0, probe=time.perf_counter() - t1)
            return engine, planned, rows, first, backoffs
        except Exception as e:  # noqa: BLE001 - only out-of-memory is retried
            if not is_out_of_memory(e) or rows <= 1:
                raise
            oom = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        # (out of the except block: the traceback's frames, holding activations, are gone)
        engine = None
        release_cached_memory()
        backoffs += 1
        warnings.warn(f"circuitkit: out of memory with {rows} sequences per forward ({oom}); "
                      f"retrying with {max(1, rows // 2)}.", stacklevel=3)
        rows = max(1, rows // 2)


def _chunk_fitting(engine: ExactEngine, chunk: Chunk, splits: list[int]) -> Tensor:
    """``engine.run_chunk(chunk)``; on out-of-memory the chunk's variants (then prompts, when
    the metric has per-prompt values) are halved and each half run the same way. The plan is
    unchanged, so a checkpoint stays valid; each half computes the same rows."""
    err = None
    try:
        return engine.run_chunk(chunk)
    except Exception as e:  # noqa: BLE001 - only out-of-memory is split
        if not is_out_of_memory(e):
            raise
        err = e
    release_cached_memory()
    c = Chunk(*chunk)
    splits[0] += 1
    if c.v1 - c.v0 > 1:
        m = (c.v0 + c.v1) // 2
        return torch.cat([_chunk_fitting(engine, c._replace(v1=m), splits),
                          _chunk_fitting(engine, c._replace(v0=m), splits)], 0)
    if c.p1 - c.p0 > 1 and engine.sweep.split_prompts:
        m = (c.p0 + c.p1) // 2
        return torch.cat([_chunk_fitting(engine, c._replace(p1=m), splits),
                          _chunk_fitting(engine, c._replace(p0=m), splits)], 1)
    raise err


class _Progress:
    """A sweep's progress bar (tqdm over patched prompts), opened once the plan is known: before
    the memory probe runs, so it starts at 0 (it used to open after the probe, at ~16%)."""

    def __init__(self, show: bool, desc: str):
        self.show, self.desc, self.bar = show, desc, None

    def open(self, total: int) -> None:
        if not self.show:
            return
        if self.bar is None:
            from circuitkit._progress import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit="patched-prompt",
                            dynamic_ncols=True, file=sys.stderr)
        else:  # re-planned (out of memory): the same bar, from 0 over the new chunks
            self.bar.reset(total=total)

    def reset(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _compute(engine: ExactEngine, sweep: Sweep, mine: list[int], ckpt: SweepCheckpoint | None,
             identity: _Lazy, bar: _Progress, n_done: int, splits: list[int],
             computed: dict[int, Tensor]) -> dict[int, Tensor]:
    """This rank's chunks, each saved as it finishes; Ctrl-C saves what was computed (to a
    default folder when the sweep had none) and says how to resume. ``bar``: opened here
    unless the memory probe opened it (then it has counted the probe's chunk)."""
    if bar.bar is None:
        bar.open(sum(sweep.chunk_prompts(sweep.chunks[c]) for c in [*computed, *mine]))
        bar.update(sum(sweep.chunk_prompts(sweep.chunks[c]) for c in computed))
    computed = dict(computed)
    try:
        for cid in mine:
            computed[cid] = _chunk_fitting(engine, sweep.chunks[cid], splits)
            if ckpt is not None:
                ckpt.save_chunk(cid, computed[cid])
            bar.update(sweep.chunk_prompts(sweep.chunks[cid]))
    except KeyboardInterrupt:
        named = ckpt is not None  # the caller chose the folder: it knows how to resume
        if ckpt is None and computed:
            ckpt = SweepCheckpoint.open(default_dir(identity()), identity(), sweep.chunks)
            for cid, t in computed.items():
                ckpt.save_chunk(cid, t)
            ckpt.close()
        if ckpt is not None:
            print(f"\ninterrupted: {n_done + len(computed)}/{len(sweep.chunks)} chunks saved in "
                  f"{ckpt.path}" + ("." if named else f"; rerun the same call with "
                                    f"checkpoint={str(ckpt.path)!r} to resume."), file=sys.stderr)
        raise
    finally:
        bar.close()
    return computed
