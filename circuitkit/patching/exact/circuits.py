"""``CircuitEngine``: ``ck.circuit``'s ablated runs (``patching/faithfulness.py``'s docstring), a
subclass of ``ExactEngine`` run by ``exact.sweeps.run_sweep`` (prompts by length, chunks,
checkpoint, progress bar, ranks). Its sweep (``circuit_sweep``) has one "layer" whose variants
are the circuits; the base run is the clean one (direction "noise"), the source the corrupt one.
A chunk runs the clean prompts ``p0:p1`` with each of its circuits' kept edges kept and the
rest ablated, circuits stacked in the batch (rows circuit-major), block by block: a receiver
``r`` reads at input ``i`` its own copy

    x_r,i = x - sum_{s alive, (s, r, i) not kept} (live_s - abl_s)

(``shortcuts.run_until``), ``x`` the residual stream, in which every sender that is not alive
writes its ablated write ``abl_s`` (``CircuitUnits.ablation``: the corrupt run's, zero, the
clean prompts' mean per position, or another clean prompt's). Runs are hooked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching import shortcuts
from circuitkit.patching.exact.checks import evaluate_metric
from circuitkit.patching.exact.engine import ExactEngine
from circuitkit.patching.sweep import Sweep, auto_rows


def circuit_sweep(n_circuits: int, tokens: Tensor, metric: PromptMetric) -> Sweep:
    """The unplanned sweep of ``n_circuits`` circuits over ``tokens`` ``[n_prompts, seq]``:
    kind "circuits", one layer, a variant per circuit; base the clean run (direction
    "noise")."""
    n, seq = tokens.shape
    return Sweep("circuits", "z", "noise", "all", 1, n_circuits, 1, n, seq,
                 metric.per_prompt_values)


def circuit_rows(model: Any, length: int, f: Any = None) -> int:
    """Sequences per forward of a circuit run: ``auto_rows`` over the split inputs' share (a
    residual copy per head and input, ``(n_heads + 2 n_kv) x`` a block's residual, and the
    circuit masks' corrections as much again). ``f``: the model's facts, if taken already."""
    f = f or hooks.facts(model)
    d_mlp = int(getattr(model.cfg, "d_mlp", None) or 4 * f.d_model)
    per_row = max(1, (2 * (f.n_heads + 2 * f.n_kv_heads) * f.d_model) // (8 * f.d_model
                                                                        + 3 * d_mlp) + 1)
    return max(1, auto_rows(model, length) // per_row)


class CircuitEngine(ExactEngine):
    """``ck.circuit``'s runs (module docstring). ``circuits``: a checked ``CircuitUnits``
    (its ``graph``, ``kept`` ``[n_circuits, n_items]`` and ``ablation``); ``perm``: the
    resample ablation's prompt pairing in this sweep's prompt order (clean prompt ``i`` takes
    prompt ``perm[i]``'s writes)."""

    def __init__(self, model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric,
                 sweep: Sweep, circuits: Any, perm: Tensor | None = None,
                 rows: int | None = None, fast: bool | None = None):
        self._bind(model, clean, corrupt, metric, sweep)  # base: clean[:, :length]
        self.graph, self.kept, self.ablation = circuits.graph, circuits.kept, circuits.ablation
        self.fast, self.forwards = False, 0  # (hooked runs: no fast path to probe)
        self.rows = rows or circuit_rows(model, self.length, circuits.facts)
        names = [hooks.resid_pre(0), *(hooks.z(la) for la in range(self.graph.n_layers))]
        with torch.no_grad():
            self.block_arity, _ = shortcuts.output_arity(model, self.base)
            self.base_metric, cache = self._run(self.base, names, "clean run")
            self.resid0 = cache[hooks.resid_pre(0)]
            self.abl = self._ablated_writes(cache, names, perm)

    def _packed(self, fast: bool | None) -> bool:
        return False

    def _run(self, tokens: Tensor, names: list[str], what: str
             ) -> tuple[Tensor, dict[str, Tensor]]:
        """The metric of an unpatched run of ``tokens`` (one call on every prompt's logits: a
        metric without per-prompt values needs them all) and its activations at ``names``, at
        most ``rows`` sequences per forward (the last MLP and the unembedding at the reads)."""
        want, logits, cache = set(names), [], {n: [] for n in names}
        for r0 in range(0, tokens.shape[0], self.rows):
            part = tokens[r0:r0 + self.rows]
            ctx = shortcuts.attn_result_off(self.model) if self.reads is None else \
                shortcuts.reads_only(self.model, self.reads[r0:r0 + len(part)].to(self.device))
            with ctx:
                out, got = self.model.run_with_cache(part, names_filter=lambda n: n in want)
            self.forwards += 1
            logits.append(out)
            for n in names:
                cache[n].append(got[n])
        metric = evaluate_metric(self.metric, torch.cat(logits), what, at=self.reads)
        return metric, {n: torch.cat(t) for n, t in cache.items()}

    def _writes(self, cache: dict[str, Tensor]) -> list[Tensor]:
        """Per sender layer: the embeddings' ``[n, pos, 1, d]`` then each layer's heads'
        ``[n, pos, H, d]`` writes."""
        out = [cache[hooks.resid_pre(0)][:, :, None]]
        for la in range(self.graph.n_layers):
            W_O = self.model.blocks[la].attn.W_O.detach()
            out.append(einops.einsum(cache[hooks.z(la)], W_O, "b p h d, h d m -> b p h m"))
        return out

    def _ablated_writes(self, clean_cache: dict[str, Tensor], names: list[str],
                        perm: Tensor | None) -> list[Tensor]:
        """Each sender layer's ablated writes: ``[n, pos, k, d]`` (corrupt, resample) or
        ``[1, pos, k, d]`` (zero, position-mean), and the corrupt run's metric (the gap the
        scored items' share is of)."""
        self.source_metric, cache = self._run(self.source, names, "corrupt run")
        if self.ablation == "corrupt":
            return self._writes(cache)
        clean = self._writes(clean_cache)
        if self.ablation == "zero":
            return [torch.zeros_like(w[:1]) for w in clean]
        if self.ablation == "position-mean":
            return [w.mean(0, keepdim=True) for w in clean]
        return [w[perm.to(w.device)] for w in clean]  # resample: no prompt keeps its own

    def _patched_logits(self, layer: int, variants: Sequence[int], p0: int, p1: int,
                        fast: bool | None) -> Tensor:
        """Logits of the clean prompts ``p0:p1`` under each circuit of ``variants`` (rows
        circuit-major)."""
        kept, alive = self.graph.masks(self.kept[list(variants)])
        return self._forward(kept, alive, p0, p1)

    def _forward(self, kept: Bool[Tensor, "c s r i"], alive: Bool[Tensor, "c s"], p0: int,
                 p1: int) -> Tensor:
        """Logits of the clean prompts ``p0:p1`` under each circuit (rows circuit-major), block
        by block: each head's q/k/v is the module's own computation on its corrected residual
        (``shortcuts.run_until`` on one copy per head), then the block runs on the stream
        with those slices written in and dead senders' writes swapped at ``hook_attn_out``."""
        g, model = self.graph, self.model
        c, n, L, H = kept.shape[0], p1 - p0, g.n_layers, g.n_heads
        dev, arity, length = self.device, self.block_arity, self._run_length(p0, p1)
        kept, alive = kept.to(dev), alive.to(dev)
        per_prompt = self.ablation in ("corrupt", "resample")
        abl = [w[p0:p1, :length] if per_prompt else w[:, :length] for w in self.abl]

        def tile(t: Tensor) -> Tensor:  # [n or 1, ...] -> [c * n, ...]
            return t.expand(n, *t.shape[1:]).repeat(c, *([1] * (t.ndim - 1)))

        def rows(mask: Tensor) -> Tensor:  # [c, ...] -> [c * n, ...] (circuit-major)
            return mask.repeat_interleave(n, 0)

        def correction(layer: int, drop: Tensor) -> Tensor:
            """sum_s drop[row, s, unit] (live_s - abl_s): [rows, pos, units, d]."""
            diffs = torch.cat(live[:layer + 1], dim=2)  # [rows, pos, senders, d]
            return einops.einsum(rows(drop).to(diffs.dtype), diffs, "b s u, b p s m -> b p u m")

        x = tile(self.resid0[p0:p1, :length])
        diff = x - tile(abl[0][:, :, 0])
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
                live.append(w - tile(abl[layer + 1][:, :t.shape[1]]))
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
            self.reads[p0:p1].repeat(c, 1).to(dev)))]
        with shortcuts.overridden(forwards), shortcuts.hooked(model, fwd_hooks), \
                shortcuts.attn_result_off(model):
            return model(x, start_at_layer=L - 1)

    def metrics(self, done: dict[int, Tensor]) -> Float[Tensor, "c n"]:
        """Each circuit's per-prompt metric ``[n_circuits, n_prompts]`` (this sweep's prompt
        order) from a finished sweep's chunks."""
        sw = self.sweep
        grid = torch.full((sw.n_variants, sw.n_prompts), float("nan"))
        for cid, ch in enumerate(sw.chunks):
            grid[ch.v0:ch.v1, ch.p0:ch.p1] = done[cid]
        return grid
