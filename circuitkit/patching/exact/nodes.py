"""Sender node runs: the base run with one head sender's ``z`` from the source run at every
position, everything after it recomputed (``patching/paths.py``: the denominator of a path's or
an edge's ``coverage``). ``NodeRuns`` is a mixin of the engines that cache the base run's
``resid_pre`` of every layer (``resid``) and the source run's ``z`` of the senders' layers
(``z_source``): ``PathEngine`` (after its sweep) and ``EdgeEngine`` (inside its sweep, as the
chunks of one more sweep "layer": checkpointed, split over ranks and counted by the progress bar
with the edges; ``node_sweep``).

    node(s) = mean_i M(sender run_i) - M(base_i)

Runs are hooked (no fused fast path): the same forward for either engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.patching import shortcuts
from circuitkit.patching.exact.checks import evaluate_metric
from circuitkit.patching.sweep import Sweep


def node_sweep(sweep: Sweep, n_nodes: int) -> Sweep:
    """``sweep`` (an edge sweep: receiver layers ``0..n_layers``, the last one the logits) with
    one more layer whose ``n_nodes`` variants are the head senders' node runs."""
    per_layer = (*sweep.layer_variants, n_nodes)
    return replace(sweep, n_layers=sweep.n_layers + 1, n_units=max(per_layer),
                   layer_variants=per_layer)


class NodeRuns:
    """Node runs of ``layout.senders`` (module docstring); the engine (an ``ExactEngine``)
    holds ``resid`` (base ``resid_pre`` per layer), ``z_source`` (source ``z``, indexed by
    layer) and ``base_metric``."""

    def _sender_run(self, s: int, p0: int, p1: int, length: int) -> tuple[int, Tensor, tuple]:
        """Sender ``s``'s run on prompts ``p0:p1``: its layer, the base residual there and the
        hook giving it ``s``'s source ``z``."""
        ls, hs = self.layout.senders[s]
        z_src = self._span(self.z_source[ls], p0, p1, length, layer=ls)[:, :, hs]

        def put(act: Tensor, hook: Any) -> Tensor:
            act = act.clone()
            act[:, :, hs] = z_src.to(act.dtype)
            return act

        return ls, self._span(self.resid[ls], p0, p1, length, layer=ls), (hooks.z(ls), put)

    def node_logits(self, senders: Sequence[int], p0: int, p1: int
                    ) -> Float[Tensor, "n_s_x_n_p k vocab"]:
        """Logits of each sender's node run on prompts ``p0:p1``, rows sender-major: one hooked
        forward per sender layer (its senders stacked in the batch), from that layer on."""
        n_p, length = p1 - p0, self._run_length(p0, p1)
        at_layer: dict[int, list[int]] = {}
        for i, s in enumerate(senders):
            at_layer.setdefault(self.layout.senders[s][0], []).append(i)
        out: list[Tensor | None] = [None] * len(senders)
        for ls, idx in sorted(at_layer.items()):
            heads = [self.layout.senders[senders[i]][1] for i in idx]
            z_src = self._span(self.z_source[ls], p0, p1, length, layer=ls)

            def put(act: Tensor, hook: Any, heads: list[int] = heads, z_src: Tensor = z_src
                    ) -> Tensor:
                act = act.clone()
                view = act.view(len(heads), n_p, *act.shape[1:])
                for j, h in enumerate(heads):
                    view[j, :, :, h] = z_src[:, :, h].to(act.dtype)
                return act

            x = self._span(self.resid[ls], p0, p1, length, layer=ls).repeat(len(idx), 1, 1)
            hooks_at, forwards_at = self._read_rows_only(p0, p1, len(idx), False)
            logits = self._suffix(x, ls, shortcuts.skipped_blocks(
                self.model, ls, self.block_arity) + forwards_at, [(hooks.z(ls), put)] + hooks_at)
            for j, i in enumerate(idx):
                out[i] = logits[j * n_p:(j + 1) * n_p]
        return torch.cat(out)

    def node_values(self, senders: Sequence[int], p0: int, p1: int) -> Float[Tensor, "n_s n_p"]:
        """The metric of each sender's node run on prompts ``p0:p1`` (``node_logits``)."""
        n_s, n_p = len(senders), p1 - p0
        tiled = self.metric.select(list(range(p0, p1)) * n_s)
        at = None if self.reads is None else self.reads[p0:p1].repeat(n_s, 1)
        return evaluate_metric(tiled, self.node_logits(senders, p0, p1), "sender node runs",
                               at=at).view(n_s, n_p)

    @torch.no_grad()
    def node_effects(self, senders: Sequence[int] | None = None,
                     done: dict[tuple[int, int, int], Tensor] | None = None
                     ) -> Float[Tensor, " sender"]:
        """Each sender's node effect (module docstring), ``[len(senders)]`` (default: every
        sender of the layout). ``done``: node values already run, ``(v0, p0, p1) -> [v1 - v0,
        p1 - p0]`` over ``senders``' indices (an edge sweep's node chunks); where they do not
        cover every sender and prompt (an edge checkpoint written before node chunks), every
        node runs here, one sender per forward over at most ``rows`` prompts."""
        senders = list(range(len(self.layout.senders))) if senders is None else list(senders)
        n = self.sweep.n_prompts
        base = self.base_metric.double()
        node = torch.zeros(len(senders), dtype=torch.float64)
        seen = torch.zeros(len(senders), n, dtype=torch.int64)
        for (v0, p0, p1), values in (done or {}).items():
            node[v0:v0 + values.shape[0]] += (values.double() - base[p0:p1]).sum(1)
            seen[v0:v0 + values.shape[0], p0:p1] += 1
        if not bool((seen == 1).all()):
            node.zero_()
            step = min(n, self.rows) if self.sweep.split_prompts else n  # (a scalar metric: all)
            for v, s in enumerate(senders):
                for p0 in range(0, n, step):
                    p1 = min(n, p0 + step)
                    got = self.node_values([s], p0, p1)[0]
                    node[v] += float((got.double() - base[p0:p1]).sum())
        return (node / n).float()
