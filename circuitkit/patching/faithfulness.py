"""Circuit faithfulness (``ck.circuit``): keep the top edges (or heads), ablate the rest
(docs/edges.md, "Circuit faithfulness"). For each size of the curve, the clean prompts run with
every scored item outside the kept share ablated; MIB's measures over the kept shares ``x_k``:

    f(C)  = (m(C) - m(empty)) / (m(full) - m(empty))
    CPR   = sum_k (x_{k+1} - x_k) (f_k + f_{k+1}) / 2
    CMD   = sum_k (x_{k+1} - x_k) (|1 - f_k| + |1 - f_{k+1}|) / 2
    share = (m(full) - m(empty)) / (m(clean) - m(corrupt))     (m(full): the clean run)

``m(full)``: every scored item kept; ``m(empty)``: every one ablated. Intervals: percentile
bootstrap over prompts (each resample recomputes the means). The run (``_Ablated``), block by
block, with ``live_s`` a sender's write in this run and ``abl_s`` its ablated write: a receiver
``r`` reads at input ``i`` its own copy

    x_r,i = x - sum_{s alive, (s, r, i) not kept} (live_s - abl_s)

(``shortcuts.run_until``), ``x`` the residual stream, in which every sender that is not alive
(no kept outgoing edge; an unscored edge counts as kept) writes ``abl_s``. MLPs are no nodes:
they read the stream. Heads: a kept head's edges are all kept, an ablated head's none.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import as_metric
from circuitkit.patching import shortcuts
from circuitkit.patching.exact.checks import evaluate_metric
from circuitkit.patching.exact.head_sets import derangement
from circuitkit.patching.inputs import (
    check_edge_model,
    check_metric_prompts,
    check_tokens,
    choice,
)
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
from circuitkit.patching.sweep import auto_rows

ABLATIONS = CIRCUIT_ABLATIONS  # "mean": position-mean's old name (CIRCUIT_OLD_ABLATIONS)
# MIB's circuit sizes: shares of the scored items kept
MIB_SIZES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def circuit(model: Any, task: Any, edges_or_heads: EdgeResult | PatchResult,
            sizes: Any = MIB_SIZES, *, ablation: str = "corrupt", rank: str = "abs",
            target: float = 0.8, n_boot: int = 1000, seed: int = 0,
            batch_size: int | None = None, progress: bool = True) -> CircuitResult:
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
    largest (``target_reached`` False, a ``CircuitTargetWarning``). ``n_boot``: bootstrap
    resamples (0: none). A degenerate baseline (``PatchResult``'s rule, on clean vs corrupt and
    on full vs empty) gives ``degenerate`` (why), raw effects in ``faithfulness``, None for
    cpr/cmd/share and one ``DegenerateBaselineWarning``.
    """
    t0 = time.perf_counter()
    ablation, sizes = _checked_options(ablation, rank, sizes, target)
    clean, corrupt, metric = _task_inputs(task)
    clean, corrupt = check_tokens(clean, corrupt, model)
    n, seq = clean.shape
    pm = as_metric(metric, n, seq, hooks.facts(model).d_vocab_out)
    check_metric_prompts(pm, n)
    check_edge_model(model)
    _check_same_model(model, edges_or_heads)
    graph = CircuitGraph.of(model, edges_or_heads)
    order = graph.order(rank, edges_or_heads.direction)
    counts = [int(share * graph.n_items) for share in sizes]
    kept = [torch.zeros(graph.n_items, dtype=torch.bool).index_fill_(0, order[:k], True)
            for k in counts]
    # m(full): the clean run (nothing ablated); m(empty): every scored item ablated
    runner = _Ablated(model, clean, corrupt, pm, graph, ablation, seed, batch_size)
    full, corrupt_m = runner.clean_metric, runner.corrupt_metric
    masks = [torch.zeros(graph.n_items, dtype=torch.bool), *kept]
    per = runner.metrics(masks, progress)
    empty, curve = per[0], per[1:]
    real = pm.per_prompt_values
    degenerate = _degenerate(full, corrupt_m, empty, real, pm.name, ablation)
    f, cpr, cmd, share, intervals = _curve(sizes, curve, full, empty, corrupt_m, degenerate,
                                           n_boot if real and n > 1 else 0, seed)
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
                  seconds=time.perf_counter() - t0, forwards=runner.forwards))


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


class _Ablated:
    """Runs the clean prompts with circuits' edges kept and the rest ablated (module
    docstring): each circuit's rows stacked in the batch, one forward per group."""

    def __init__(self, model: Any, clean: Tensor, corrupt: Tensor, metric: Any, graph: CircuitGraph,
                 ablation: str, seed: int, batch_size: int | None):
        self.model, self.metric, self.graph = model, metric, graph
        self.device = next(model.parameters()).device
        self.reads = metric.read_positions()
        # causal: nothing after the last read matters; a bidirectional model reads everything
        whole = self.reads is None or not hooks.facts(model).causal
        self.length = clean.shape[1] if whole else int(self.reads.max()) + 1
        self.clean = clean[:, :self.length].to(self.device)
        self.forwards = 0
        L = graph.n_layers
        names = [hooks.resid_pre(0), *(hooks.z(la) for la in range(L))]
        with torch.no_grad():
            self.block_arity, _ = shortcuts.output_arity(model, self.clean)
            logits, cache = self._run(self.clean, names)
            self.clean_metric = evaluate_metric(metric, logits, "clean run", at=self.reads)
            self.resid0 = cache[hooks.resid_pre(0)]
            self.abl = self._ablated_writes(ablation, corrupt, cache, seed)
        f = hooks.facts(model)
        d_mlp = int(getattr(model.cfg, "d_mlp", None) or 4 * f.d_model)
        # the split inputs hold a residual copy per head and input: (n_heads + 2 n_kv) times
        # a block's residual, and the circuit masks' corrections as much again
        per_row = max(1, (2 * (f.n_heads + 2 * f.n_kv_heads) * f.d_model) // (8 * f.d_model
                                                                            + 3 * d_mlp) + 1)
        self.rows = batch_size or max(1, auto_rows(model, self.length) // per_row)

    def _run(self, tokens: Tensor, names: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
        want = set(names)
        idx = None if self.reads is None else self.reads.to(self.device)
        ctx = shortcuts.reads_only(self.model, idx) if idx is not None else \
            shortcuts.attn_result_off(self.model)
        with ctx:
            logits, cache = self.model.run_with_cache(tokens, names_filter=lambda n: n in want)
        self.forwards += 1
        return logits, {n: cache[n] for n in names}

    def _writes(self, cache: dict[str, Tensor]) -> list[Tensor]:
        """Per sender layer: the embeddings' ``[n, pos, 1, d]`` then each layer's heads'
        ``[n, pos, H, d]`` writes."""
        out = [cache[hooks.resid_pre(0)][:, :, None]]
        for la in range(self.graph.n_layers):
            W_O = self.model.blocks[la].attn.W_O.detach()
            out.append(einops.einsum(cache[hooks.z(la)], W_O, "b p h d, h d m -> b p h m"))
        return out

    def _ablated_writes(self, ablation: str, corrupt: Tensor, clean_cache: dict[str, Tensor],
                        seed: int) -> list[Tensor]:
        names = list(clean_cache)
        # the corrupt run's metric: the gap the scored items' share is of
        logits, cache = self._run(corrupt[:, :self.length].to(self.device), names)
        self.corrupt_metric = evaluate_metric(self.metric, logits, "corrupt run", at=self.reads)
        if ablation == "corrupt":
            return self._writes(cache)
        clean = self._writes(clean_cache)
        if ablation == "zero":
            return [torch.zeros_like(w[:1]) for w in clean]
        if ablation == "position-mean":
            return [w.mean(0, keepdim=True) for w in clean]
        n = clean[0].shape[0]
        if n < 2:
            raise ValueError("ablation='resample' takes another prompt's writes: it needs at "
                             "least 2 prompts.")
        perm = derangement(n, seed)  # the engine's: no prompt keeps its own (ablate_heads' too)
        return [w[perm] for w in clean]

    @torch.no_grad()
    def metrics(self, kept_items: list[Tensor], progress: bool) -> Float[Tensor, "c n"]:
        """Per-prompt metric of each circuit (``[n_circuits, n_prompts]``)."""
        n = self.clean.shape[0]
        per = max(1, self.rows // n)  # circuits per forward (all prompts in each)
        out = []
        groups = range(0, len(kept_items), per)
        if progress:
            from circuitkit._progress import tqdm

            groups = tqdm(groups, desc="circuit", leave=False)
        for g0 in groups:
            batch = torch.stack(kept_items[g0:g0 + per])
            kept, alive = self.graph.masks(batch)
            logits = self._forward(kept, alive)
            c = batch.shape[0]
            tiled = self.metric.select(list(range(n)) * c)
            at = None if self.reads is None else self.reads.repeat(c, 1)
            out.append(evaluate_metric(tiled, logits, "circuit", at=at).view(c, n))
        return torch.cat(out)

    def _forward(self, kept: Bool[Tensor, "c s r i"], alive: Bool[Tensor, "c s"]) -> Tensor:
        """Logits of the clean prompts under each circuit (rows circuit-major), block by block:
        each head's q/k/v is the module's own computation on its corrected residual
        (``shortcuts.run_until`` on one copy per head), then the block runs on the stream
        with those slices written in and dead senders' writes swapped at ``hook_attn_out``."""
        g, model = self.graph, self.model
        c, n, L, H = kept.shape[0], self.clean.shape[0], g.n_layers, g.n_heads
        dev, arity = self.device, self.block_arity
        kept, alive = kept.to(dev), alive.to(dev)

        def tile(t: Tensor) -> Tensor:  # [n or 1, ...] -> [c * n, ...]
            return t.expand(n, *t.shape[1:]).repeat(c, *([1] * (t.ndim - 1)))

        def rows(mask: Tensor) -> Tensor:  # [c, ...] -> [c * n, ...] (circuit-major)
            return mask.repeat_interleave(n, 0)

        def correction(layer: int, drop: Tensor) -> Tensor:
            """sum_s drop[row, s, unit] (live_s - abl_s): [rows, pos, units, d]."""
            diffs = torch.cat(live[:layer + 1], dim=2)  # [rows, pos, senders, d]
            return einops.einsum(rows(drop).to(diffs.dtype), diffs, "b s u, b p s m -> b p u m")

        x = tile(self.resid0)
        diff = x - tile(self.abl[0][:, :, 0])
        live = [diff[:, :, None]]  # per sender layer: live - ablated writes [rows, pos, k, d]
        x = x - rows(~alive[:, :1]).to(x.dtype)[:, :, None] * diff  # the stream
        for layer in range(L):
            s = slice(0, 1 + layer * H)  # senders before this layer
            copies, spans = [], []
            for i, name in enumerate(hooks.EDGE_INPUTS):
                units = g.n_kv if name in hooks.KV_SITES else H
                drop = alive[:, s, None] & ~kept[:, s, layer * H:layer * H + units, i]
                if bool(drop.any()):
                    fixed = x[:, :, None] - correction(layer, drop)  # [rows, pos, units, d]
                    copies.append(einops.rearrange(fixed, "b p u m -> (u b) p m"))
                    spans.append((hooks.head_site(name, layer), units))
            given: dict[str, Tensor] = {}
            if copies:
                got = shortcuts.run_until(model, layer, torch.cat(copies),
                                          [site for site, _ in spans], arity)
                start = 0
                for site, units in spans:
                    act = got[site][start:start + units * x.shape[0]]
                    act = act.view(units, x.shape[0], *act.shape[1:])  # [copy, rows, pos, u, d]
                    given[site] = torch.stack([act[u, :, :, u] for u in range(units)], dim=2)
                    start += units * x.shape[0]

            def put(value: Tensor):
                return lambda t, hook: value.to(t.dtype)

            def z_hook(t: Tensor, hook: Any, layer: int = layer) -> Tensor:
                W_O = model.blocks[layer].attn.W_O.detach()
                w = einops.einsum(t, W_O, "b p h d, h d m -> b p h m")
                live.append(w - tile(self.abl[layer + 1][:, :t.shape[1]]))
                return t

            def attn_out_hook(t: Tensor, hook: Any, layer: int = layer) -> Tensor:
                dead = (~rows(alive[:, 1 + layer * H:1 + (layer + 1) * H])).to(t.dtype)
                return t - einops.einsum(dead, live[layer + 1], "b h, b p h m -> b p m")

            fwd = [(site, put(value)) for site, value in given.items()]
            fwd += [(hooks.z(layer), z_hook), (hooks.attn_out(layer), attn_out_hook)]
            x = shortcuts.run_until(model, layer, x, [hooks.resid_post(layer)], arity,
                                    fwd)[hooks.resid_post(layer)]
            self.forwards += 1 + bool(copies)
        drop = alive[:, :, None] & ~kept[:, :, L * H:L * H + 1, 0]
        final = x - correction(L, drop)[:, :, 0]
        # the logits of the corrected final residual: the last block returns it
        forwards = shortcuts.skipped_blocks(model, L - 1, arity) + [
            (model.blocks[L - 1], shortcuts.returning(final, arity))]
        fwd_hooks = [] if self.reads is None else [(hooks.UNEMBED_IN, shortcuts.gather_rows(
            self.reads.repeat(c, 1).to(dev)))]
        with shortcuts.overridden(forwards), shortcuts.hooked(model, fwd_hooks), \
                shortcuts.attn_result_off(model):
            return model(x, start_at_layer=L - 1)
