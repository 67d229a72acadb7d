"""``PathEngine``: exact path patching (``patch_paths``; ``patching/paths.py``), a subclass of
``ExactEngine`` (the same cached runs, chunks, read-position logits and metric evaluation; only
the patch differs). The sweep's layer ``l`` is receiver layer ``l``, its variants
``PathLayout.cells(l)``: (sender ``s``, group ``g``, receiver ``r``).

A cell re-enters the model at ``l`` from the base run's ``resid_pre(l)``; receiver ``r``'s
inputs (q, k and/or v) are computed from its own copy of the residual,

    x_r = resid_base(l) + mask_g * (resid_s(l) - resid_base(l)),

``resid_s`` the *sender run*'s (the base run with ``s``'s source ``z`` at every position, every
block from ``s``'s on recomputed); every other head reads the base residual. q, k and v are
position-wise functions of the residual, so ``r`` reads the sender run's q/k/v at the group's
positions and the base run's elsewhere. Runs are hooked (no fused fast path)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching import shortcuts
from circuitkit.patching.exact.engine import ExactEngine
from circuitkit.patching.exact.nodes import NodeRuns
from circuitkit.patching.sweep import Sweep, auto_rows


class PathEngine(NodeRuns, ExactEngine):
    """Exact path patching (module docstring). ``layout``: the ``sweep.PathLayout``; its
    senders' node runs: ``NodeRuns`` (``patching/exact/nodes.py``)."""

    def __init__(self, model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric,
                 sweep: Sweep, layout: Any, fast: bool | None = None, rows: int | None = None):
        self._bind(model, clean, corrupt, metric, sweep)
        self.layout = layout
        L = layout.n_layers
        self.cells = [layout.cells(layer) for layer in range(L)]
        sender_layers = sorted({sl for sl, _ in layout.senders})
        names = [hooks.resid_pre(layer) for layer in range(L)] + [hooks.z(sl)
                                                                  for sl in sender_layers]
        self.rows = rows or auto_rows(model, self.length)
        with torch.no_grad():
            self.block_arity, self.attn_arity = shortcuts.output_arity(model, self.base)
            (self.base_metric, self.source_metric), cache = self._cached_runs(
                [self.base, self.source], names, self.rows)
            self.resid = [cache[hooks.resid_pre(layer)][0] for layer in range(L)]
            self.z_source = {sl: cache[hooks.z(sl)][1] for sl in sender_layers}
        self.fast = False

    def _packed(self, fast: bool | None) -> bool:
        return False

    def _sender_resid(self, s: int, layer: int, p0: int, p1: int, length: int
                      ) -> Float[Tensor, "n_p pos d_model"]:
        """The sender run's ``resid_pre(layer)`` on prompts ``p0:p1``."""
        ls, x, put = self._sender_run(s, p0, p1, length)
        name = hooks.resid_pre(layer)
        return shortcuts.run_until(self.model, ls, x, [name], self.block_arity,
                                   fwd_hooks=[put])[name]

    def _patched_logits(self, layer: int, variants: Sequence[int], p0: int, p1: int,
                        fast: bool | None) -> Tensor:
        """Logits with each path into receiver layer ``layer`` patched, rows variant-major."""
        n_v, n_p, length = len(variants), p1 - p0, self._run_length(p0, p1)
        cells = self.cells[layer][list(variants)]  # [n_v, 3]: sender, group, receiver
        pairs = sorted({(s, g) for s, g, _ in cells.tolist()})  # one residual copy per pair
        row = torch.tensor([pairs.index((s, g)) for s, g, _ in cells.tolist()])
        resid = self._span(self.resid[layer], p0, p1, length, layer=layer)
        sent = {s: self._sender_resid(s, layer, p0, p1, length) - resid
                for s in sorted({s for s, _ in pairs})}
        groups = self.sweep.groups
        copies = torch.stack([resid + sent[s] * (1.0 if groups is None else groups.masks[g][
            p0:p1, :length, None].to(resid)) for s, g in pairs])  # [n_pairs, n_p, pos, d]
        names = [hooks.head_site(i, layer) for i in self.layout.inputs]
        got = shortcuts.run_until(self.model, layer, copies.flatten(0, 1), names, self.block_arity)
        heads = torch.tensor([self.layout.receivers[r][1] for r in cells[:, 2].tolist()])

        def write(name: str):
            def hook(act: Tensor, hook: Any) -> Tensor:  # [n_v * n_p, pos, head, d]
                view = act.view(n_v, n_p, *act.shape[1:])
                given = got[name].view(len(pairs), n_p, *act.shape[1:])
                v = torch.arange(n_v, device=act.device)
                view[v, :, :, heads.to(act.device)] = given[row.to(act.device), :, :,
                                                            heads.to(act.device)]
                return act
            return hook

        hooks_at, forwards_at = self._read_rows_only(p0, p1, n_v, False)
        forwards = shortcuts.skipped_blocks(self.model, layer, self.block_arity)
        return self._suffix(resid.repeat(n_v, 1, 1), layer, forwards + forwards_at,
                            [(name, write(name)) for name in names] + hooks_at)

    def assemble(self, done: dict[int, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Chunk results -> (values ``[n_senders, n_receivers, n_groups]``, per_prompt
        ``[n_prompts, ...]`` or None); NaN where the receiver is not after the sender."""
        sw, lay = self.sweep, self.layout
        grid = torch.full((sw.n_prompts, len(lay.senders), len(lay.receivers), lay.n_groups),
                          float("nan"))
        for cid, c in enumerate(sw.chunks):
            cells = self.cells[c.layer][c.v0:c.v1]
            grid[c.p0:c.p1, cells[:, 0], cells[:, 2], cells[:, 1]] = done[cid].T
        return grid.mean(0), grid if self.metric.per_prompt_values else None
