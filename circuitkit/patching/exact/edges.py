"""``EdgeEngine``: exact edge patching, a subclass of ``ExactEngine`` (same cached runs, restart,
chunks, read-position logits, metric evaluation; only the patch differs). How an edge is
patched: ``patching/exact/__init__.py``'s docstring ("Edges") and docs/edges.md. Its head
senders' node runs (the denominators of the edges' ``coverage``) are the chunks of one more
sweep layer (``NodeRuns``, ``nodes.node_sweep``), so they are checkpointed with the edges."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching import shortcuts
from circuitkit.patching.exact import fused
from circuitkit.patching.exact.checks import _within_fast_path_tol
from circuitkit.patching.exact.engine import ExactEngine
from circuitkit.patching.exact.nodes import NodeRuns, node_sweep
from circuitkit.patching.sweep import Sweep, auto_rows, make_edge_sweep


def edge_sweep(model: Any, layout: Any, direction: str, tokens: Tensor, metric: PromptMetric
               ) -> Sweep:
    """The unplanned sweep of ``layout``'s edges (``sweep.make_edge_sweep``) and, as its layer
    ``n_layers + 1``, the node runs of its head senders (``node_senders``; none: no such
    layer)."""
    sweep = make_edge_sweep(model, layout, direction, tokens, metric)
    n_nodes = len(node_senders(layout))
    return node_sweep(sweep, n_nodes) if n_nodes else sweep


def node_senders(layout: Any) -> list[int]:
    """The layout's head senders (the embeddings have no node run), in its order."""
    return [s for s, (sl, _) in enumerate(layout.senders) if sl >= 0]


class EdgeEngine(NodeRuns, ExactEngine):
    """Exact edge patching (module docstring). ``layout``: the ``sweep.EdgeLayout``; the
    sweep's layer ``l`` is receiver layer ``l`` (``n_layers``: the logits), its variants
    ``layout.cells(l)``; an ``edge_sweep``'s layer ``n_layers + 1`` runs the head senders'
    node runs (``node_senders``), its chunks' values the node runs' metric."""

    def __init__(self, model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric,
                 sweep: Sweep, layout: Any, fast: bool | None = None, rows: int | None = None):
        # (the model is the entry's, checked there once: EdgeUnits.checked, check_edge_model)
        self._bind(model, clean, corrupt, metric, sweep)
        self.layout, self.rows = layout, rows or auto_rows(model, self.length)
        self.node_senders = node_senders(layout)
        L = layout.n_layers
        self.cells = [layout.cells(layer) for layer in range(L + 1)]
        self.attn_cached = False  # the receiving layer's attention runs (with its patched input)
        names = [hooks.resid_pre(layer) for layer in range(L)] + [
            hooks.z(layer) for layer in range(L)] + [hooks.resid_post(L - 1)]
        with torch.no_grad():
            self.block_arity, self.attn_arity = shortcuts.output_arity(model, self.base)
            (self.base_metric, self.source_metric), cache = self._cached_runs(
                [self.base, self.source], names, self.rows)
            self.resid = [cache[hooks.resid_pre(layer)][0] for layer in range(L)]
            self.embed_delta = cache[hooks.resid_pre(0)][1] - self.resid[0]
            # (a sender's dz = z_source - z_base is taken per chunk: z_source is the node runs')
            self.z_source = [cache[hooks.z(layer)][1] for layer in range(L)]
            self.z_base = [cache[hooks.z(layer)][0] for layer in range(L)]
            self.final = cache[hooks.resid_post(L - 1)][0]  # what the final norm reads
            del cache
            self.W_O = [b.attn.W_O.detach() for b in model.blocks]
            self.attn_at_rows = shortcuts.supports_attention_at_rows(model.blocks[L - 1].attn)
            self.fast = self._fast_path_agrees() if fast is None else fast

    def _writes(self, senders: Sequence[int], p0: int, p1: int, length: int,
                layer: int | None) -> Float[Tensor, "n_s n_p pos d_model"]:
        """Each sender's write ``delta_s`` on prompts ``p0:p1`` (on block ``layer``'s device):
        the embeddings' ``resid_pre(0)`` difference, or ``dz[:, :, h] @ W_O[h]``."""
        out = []
        for s in senders:
            sl, h = self.layout.senders[s]
            if sl < 0:
                out.append(self._span(self.embed_delta, p0, p1, length, layer=layer))
                continue
            dz = (self._span(self.z_source[sl], p0, p1, length, layer=layer)[:, :, h]
                  - self._span(self.z_base[sl], p0, p1, length, layer=layer)[:, :, h])
            out.append(dz @ self.W_O[sl][h].to(dz.device))
        return torch.stack(out)

    def _patched_logits(self, layer: int, variants: Sequence[int], p0: int, p1: int,
                        fast: bool | None) -> Tensor:
        """Logits with each edge into receiver layer ``layer`` patched, rows variant-major;
        layer ``n_layers + 1``: each variant's head sender's node run."""
        model, L = self.model, self.layout.n_layers
        if layer == L + 1:
            return self.node_logits([self.node_senders[v] for v in variants], p0, p1)
        fast = self.fast if fast is None else fast
        n_v, n_p, length = len(variants), p1 - p0, self._run_length(p0, p1)
        cells = self.cells[layer][list(variants)]  # [n_v, 3]: sender, input, head
        senders = sorted(set(cells[:, 0].tolist()))
        row_of = {s: i for i, s in enumerate(senders)}
        srow = torch.tensor([row_of[s] for s in cells[:, 0].tolist()], dtype=torch.long)
        at = min(layer, L - 1)
        dev = self.layer_device[at]
        writes = self._writes(senders, p0, p1, length, at)  # [n_s, n_p, pos, d_model]
        if self._packed(fast):
            return self._fused_edge_logits(layer, variants, p0, p1, cells, srow, writes)
        forwards = shortcuts.skipped_blocks(model, at, self.block_arity)
        if fast:
            forwards += shortcuts.native_norms(model, at)
        if layer == L:  # the logits: the final residual plus each sender's write
            final = self._span(self.final, p0, p1, length, layer=at)
            out = (final[None] + writes[srow.to(dev)]).flatten(0, 1)
            x = self._span(self.resid[at], p0, p1, length, layer=at).repeat(n_v, 1, 1)
            forwards.append((model.blocks[at], shortcuts.returning(out, self.block_arity)))
            hooks_at, forwards_at = self._read_rows_only(p0, p1, n_v, fast, last_mlp=False,
                                                         last_attn=False)
            return self._suffix(x, at, forwards + forwards_at, hooks_at)
        resid = self._span(self.resid[layer], p0, p1, length, layer=layer)
        names = {i: hooks.head_site(self.layout.inputs[i], layer)
                 for i in sorted(set(cells[:, 1].tolist()))}
        src = shortcuts.run_until(model, layer, (resid[None] + writes).flatten(0, 1),
                                  list(names.values()), self.block_arity)
        fwd_hooks = []
        for i, name in names.items():
            js = (cells[:, 1] == i).nonzero()[:, 0]

            def write(act: Tensor, hook: Any, js=js, name=name) -> Tensor:
                view = act.view(n_v, n_p, *act.shape[1:])
                units = cells[js, 2].to(act.device)
                given = src[name].view(len(senders), n_p, *act.shape[1:])
                view[js.to(act.device), :, :, units] = given[srow[js].to(act.device), :, :,
                                                             units]
                return act

            fwd_hooks.append((name, write))
        hooks_at, forwards_at = self._read_rows_only(p0, p1, n_v, fast,
                                                     last_attn=layer != L - 1)
        x = resid.repeat(n_v, 1, 1)
        return self._suffix(x, layer, forwards + forwards_at, fwd_hooks + hooks_at)

    def _packed(self, fast: bool | None) -> bool:
        """Whether a run on the fast path is fused and packed: on a Llama-form model, always."""
        return bool(self.fast if fast is None else fast) and self.fused is not None

    def _fused_edge_logits(self, layer: int, variants: Sequence[int], p0: int, p1: int,
                           cells: Tensor, srow: Tensor, writes: Tensor
                           ) -> Float[Tensor, "n_var_x_n_p k vocab"]:
        """``_patched_logits`` of a Llama-form model: the receiving layer's attention output
        under each edge (``FusedLlama.edge_attention``: only the receiving head, or a KV head's
        query heads, re-attend), then ``fused.suffix_logits`` on the rows' packed positions;
        the logits receiver unembeds the final residual plus the write at the reads."""
        form, L = self.fused, self.layout.n_layers
        length = self._run_length(p0, p1)
        pack = self._packing(variants, p0, p1)
        if layer == L:
            final = self._span(self.final, p0, p1, length, layer=L - 1)
            y = (final[None] + writes[srow.to(final.device)]).flatten(0, 2)
            return pack.spread(form.logits(y.index_select(0, pack.read_dense_of(y.device))))
        resid = [self._span(self.resid[j], p0, p1, length, layer=j) for j in range(layer, L)]
        z_base = self._span(self.z_base[layer], p0, p1, length, layer=layer)
        inputs = [self.layout.inputs[i] for i in cells[:, 1].tolist()]
        attn = form.edge_attention(form.blocks[layer], resid[0], writes, z_base, srow, inputs,
                                   cells[:, 2])
        return fused.suffix_logits(form, pack, layer, resid, pack.gather_prompts(resid[0]),
                                   pack.gather(attn), devices=self.layer_device)

    def _probe_fast_path(self) -> bool:
        """The fast path against the plain one on the first and last edge of the earliest
        receiver layer (every later block runs) and of the logits, on two prompts (all of them
        for a scalar metric)."""
        sw = self.sweep
        p1 = min(2, sw.n_prompts) if sw.split_prompts else sw.n_prompts
        layers = [la for la, c in enumerate(self.cells) if len(c)]
        if not layers:  # no edge (inputs.check_edge_nodes refuses such a request): nothing to run
            return True
        err, scale = 0.0, 1.0
        for layer in sorted({layers[0], layers[-1]}):
            variants = sorted({0, len(self.cells[layer]) - 1})
            fast = self.run_variants(layer, variants, 0, p1, fast=True)
            plain = self.run_variants(layer, variants, 0, p1, fast=False)
            err = max(err, float((fast - plain).abs().max()))
            scale = max(scale, float(plain.abs().max()))
        return _within_fast_path_tol(self.model, err, scale, "the fast edge-patching path "
                                     "differs from the plain hooked path", "the plain path")

    def assemble(self, done: dict[int, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Chunk results -> (values ``[n_senders, n_receivers, n_inputs]``, per_prompt
        ``[n_prompts, ...]`` or None); NaN where (sender, receiver, input) is no edge."""
        sw, lay = self.sweep, self.layout
        r_index = lay.receiver_index()
        L = lay.n_layers
        grid = torch.full((sw.n_prompts, len(lay.senders), len(lay.receivers), len(lay.inputs)),
                          float("nan"))
        for cid, c in enumerate(sw.chunks):
            if c.layer > L:  # the node runs (node_effects_of)
                continue
            cells = self.cells[c.layer][c.v0:c.v1]
            r = torch.tensor([r_index[(c.layer, int(u)) if c.layer < L else (L, -1)]
                              for u in cells[:, 2]], dtype=torch.long)
            grid[c.p0:c.p1, cells[:, 0], r, cells[:, 1]] = done[cid].T
        values = grid.mean(0)
        return values, grid if self.metric.per_prompt_values else None

    def node_effects_of(self, done: dict[int, Tensor]) -> Tensor:
        """The head senders' node effects (``node_senders``' order) from a finished sweep's
        chunk results ``done``: its node chunks, or, where its plan has none (an older
        checkpoint's), runs of this engine (``NodeRuns.node_effects``)."""
        nodes = {(c.v0, c.p0, c.p1): done[cid] for cid, c in enumerate(self.sweep.chunks)
                 if c.layer == self.layout.n_layers + 1 and cid in done}
        return self.node_effects(self.node_senders, nodes)
