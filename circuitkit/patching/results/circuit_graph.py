"""The scored items of ``ck.circuit`` (``patching/faithfulness.py``) over the model's full edge set:
``CircuitGraph``, the edges of an ``EdgeResult`` or the heads of a head ``PatchResult`` as dense
(sender, receiver, input) cells, their ranking (``order``, ``ranked``) and each circuit's kept
edges and alive senders (``masks``)."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor

from circuitkit import hooks
from circuitkit.hooks import node_name
from circuitkit.patching.results.edge_result import EdgeResult
from circuitkit.patching.results.patch_result import PatchResult, quiet_baseline


class CircuitGraph:
    """The scored items over the model's full edge set: dense ``[senders, receivers, inputs]``
    indices of the model (every head, the embeddings first as sender, the logits last as
    receiver; k/v receivers of GQA models on KV heads)."""

    def __init__(self, model: Any, kind: str, item_cells: list[Tensor], scores: Tensor,
                 names: list[Any], shares: Tensor | None = None):
        f = hooks.facts(model)
        self.kind, self.n_layers, self.n_heads, self.n_kv = kind, f.n_layers, f.n_heads, \
            f.n_kv_heads
        self.n_items = len(item_cells)
        self.cells = item_cells  # per item: [k, 3] dense (sender, receiver, input) rows
        self.scores = scores  # raw effects (value - baseline): what items are ranked by
        self.shares = scores if shares is None else shares  # normalized (PatchResult's)
        self.names = names

    @property
    def n_senders(self) -> int:
        return 1 + self.n_layers * self.n_heads

    @property
    def n_receivers(self) -> int:
        return self.n_layers * self.n_heads + 1

    def sender(self, layer: int, head: int) -> int:
        return 0 if layer < 0 else 1 + layer * self.n_heads + head

    def receiver(self, layer: int, head: int) -> int:
        return self.n_layers * self.n_heads if layer >= self.n_layers else \
            layer * self.n_heads + head

    @classmethod
    def of(cls, model: Any, result: Any) -> CircuitGraph:
        f = hooks.facts(model)
        if isinstance(result, EdgeResult):
            if (result.n_layers, ) != (f.n_layers, ):
                raise ValueError(f"edges_or_heads: an EdgeResult of a {result.n_layers}-layer "
                                 f"model; this one has {f.n_layers} layers.")
            g = cls(model, "edges", [], torch.zeros(0), [])
            idx = result.edge_mask().nonzero()
            eff = result.effect()
            with quiet_baseline():  # the circuit says its own baseline
                norm = result.normalized()
            cells, scores, shares, names = [], [], [], []
            for s, r, i in idx.tolist():
                sl, sh = result.senders[s]
                rl, rh = result.receivers[r]
                inp = "resid" if rl >= f.n_layers else result.inputs[i]
                top = f.n_kv_heads if inp in hooks.KV_SITES else f.n_heads
                if sh >= f.n_heads or rl < f.n_layers and rh >= top:
                    raise ValueError(
                        f"edges_or_heads: edge {node_name((sl, sh), f.n_layers)} -> "
                        f"{node_name((rl, rh), f.n_layers)} ({inp}) is no edge of this model "
                        f"({f.n_layers} layers x {f.n_heads} heads, {f.n_kv_heads} KV heads): "
                        "the EdgeResult was patched on another model.")
                cells.append(torch.tensor([[g.sender(sl, sh), g.receiver(rl, rh),  # (q, k, v)
                                            hooks.EDGE_INPUTS.index(inp) if rl < f.n_layers
                                            else 0]]))
                scores.append(float(eff[s, r, i]))
                shares.append(float(norm[s, r, i]))
                names.append(((sl, sh), (rl, rh), inp))
            return cls(model, "edges", cells, torch.tensor(scores), names, torch.tensor(shares))
        if isinstance(result, PatchResult):
            if result.axes != ("layer", "head") or result.site != "z":
                raise ValueError("edges_or_heads: a PatchResult of heads at site 'z', all "
                                 f"positions (axes ('layer', 'head')); got site "
                                 f"{result.site!r}, axes {result.axes}.")
            if tuple(result.values.shape) != (f.n_layers, f.n_heads):
                raise ValueError(f"edges_or_heads: values of shape {tuple(result.values.shape)}"
                                 f" do not match this model's {f.n_layers} x {f.n_heads} heads.")
            g = cls(model, "heads", [], torch.zeros(0), [])
            eff = result.effect()
            with quiet_baseline():
                norm = result.normalized()
            cells = [torch.tensor([[g.sender(la, h), -1, -1]]) for la in range(f.n_layers)
                     for h in range(f.n_heads)]
            names = [(la, h) for la in range(f.n_layers) for h in range(f.n_heads)]
            return cls(model, "heads", cells, eff.flatten().float(), names,
                       norm.flatten().float())
        raise ValueError(f"edges_or_heads: expected an EdgeResult (patch_edges) or a head "
                         f"PatchResult (patch_heads); got {type(result).__name__}.")

    def order(self, rank: str, direction: str) -> Tensor:
        """Items, first kept first: ``"abs"`` by ``|effect|``; ``"signed"`` helpful first,
        i.e. by effect for denoise (restoring the metric) and by ``-effect`` for noise
        (breaking it: the most negative effect is the most helpful item)."""
        sign = 1.0 if direction == "denoise" else -1.0
        key = self.scores.abs() if rank == "abs" else sign * self.scores
        return torch.argsort(-key.nan_to_num(float("-inf")), stable=True)

    def ranked(self, order: Tensor) -> list[dict[str, Any]]:
        """``CircuitResult.items``: names, normalized score and raw effect of each item."""
        out = []
        for j in order.tolist():
            name = self.names[j]
            said = dict(score=float(self.shares[j]), effect=float(self.scores[j]))
            if self.kind == "heads":
                out.append(dict(name=node_name(name, self.n_layers), layer=name[0],
                                head=name[1], **said))
            else:
                s, r, inp = name
                out.append(dict(sender=node_name(s, self.n_layers),
                                receiver=node_name(r, self.n_layers), input=inp, **said))
        return out

    def masks(self, kept_items: Bool[Tensor, "c n_items"]
              ) -> tuple[Bool[Tensor, "c s r i"], Bool[Tensor, "c s"]]:
        """Dense (kept edge, alive sender) masks of each circuit (``faithfulness``' docstring)."""
        c = kept_items.shape[0]
        kept = torch.ones(c, self.n_senders, self.n_receivers, 3, dtype=torch.bool)
        if self.kind == "heads":
            alive = torch.ones(c, self.n_senders, dtype=torch.bool)
            for j, cell in enumerate(self.cells):
                s = int(cell[0, 0])
                alive[:, s] = kept_items[:, j]
                kept[:, s] = kept_items[:, j, None, None]
            return kept, alive
        scored = torch.zeros(self.n_senders, self.n_receivers, 3, dtype=torch.bool)
        for j, cell in enumerate(self.cells):
            s, r, i = (int(x) for x in cell[0])
            scored[s, r, i] = True
            kept[:, s, r, i] = kept_items[:, j]
        # alive: a kept edge out of it; an unscored (hence kept) edge of the model counts
        unscored = self.real() & ~scored
        alive = (kept & scored).flatten(2).any(-1) | unscored.flatten(1).any(-1)[None]
        return kept, alive

    def real(self) -> Bool[Tensor, "s r i"]:
        """The model's edges among the dense cells: receiver after sender; the logits read one
        input (index 0); k/v receivers are KV heads."""
        L, H = self.n_layers, self.n_heads
        s_layer = torch.tensor([-1] + [la for la in range(L) for _ in range(H)])
        r_layer = torch.tensor([la for la in range(L) for _ in range(H)] + [L])
        r_unit = torch.tensor([h for _ in range(L) for h in range(H)] + [0])
        out = (s_layer[:, None, None] < r_layer[None, :, None]).expand(-1, -1, 3).clone()
        for i, name in enumerate(hooks.EDGE_INPUTS):
            top = self.n_kv if name in hooks.KV_SITES else H
            out[:, :, i] &= (r_unit < top)[None]
        out[:, -1, 1:] = False
        return out
