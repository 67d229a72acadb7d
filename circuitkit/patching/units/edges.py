"""Every edge sender -> receiver input: ``EdgeUnits``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from circuitkit import hooks
from circuitkit.identity import sweep_identity
from circuitkit.patching.estimators import attribution
from circuitkit.patching.exact import EdgeEngine
from circuitkit.patching.exact import sweeps as exact
from circuitkit.patching.hybrid import Screenable
from circuitkit.patching.inputs import (
    EDGE_METHODS,
    check_edge_model,
    check_edge_nodes,
    choice,
)
from circuitkit.patching.results import EdgeResult
from circuitkit.patching.sweep import (
    EdgeLayout,
    auto_rows,
    make_edge_sweep,
)
from circuitkit.patching.units.base import (
    _STACK,
    _hybrid_options,
    _read_share,
    _stray,
    _Units,
    unused_checkpoint,
)


@dataclass(frozen=True)
class EdgeUnits(_Units):
    """Every edge from ``senders`` into ``receivers``' ``inputs`` ("q", "k", "v"): nodes
    ``(layer, head)`` or their names ("L3H2", "embed" a sender, "logits" a receiver); None:
    every head and the embeddings / the logits. Values ``[sender, receiver, input]``
    (``EdgeResult``); ``checked`` builds the ``sweep.EdgeLayout`` (``layout``)."""

    senders: Any = None
    receivers: Any = None
    inputs: Any = hooks.EDGE_INPUTS
    layout: EdgeLayout | None = field(default=None, compare=False, repr=False)
    kind: ClassVar[str] = "edges"
    methods: ClassVar[tuple[str, ...]] = EDGE_METHODS
    estimators: ClassVar[tuple[str, ...]] = attribution.EDGE_ESTIMATORS
    axes: ClassVar[tuple[str, ...]] = ("sender", "receiver", "input")

    def check_method(self, method, opts) -> str:
        checkpoint, backend, remote = opts.checkpoint, opts.backend, opts.remote
        choice("method", method, EDGE_METHODS)
        _hybrid_options(method, opts)
        default = attribution.EDGE_SCREENING_ESTIMATOR if method == "attribution+exact" else \
            attribution.EDGE_ESTIMATORS[0]
        if opts.estimator is not None or opts.ig_steps is not None:
            if method == "exact":
                warnings.warn("estimator and ig_steps do nothing with method='exact'.",
                              stacklevel=_STACK - 1)
            else:
                choice("estimator", opts.estimator or default, attribution.EDGE_ESTIMATORS)
        _stray(method, opts, {"exact": {"estimator", "ig_steps"},
                              "attribution": {"estimator", "ig_steps"},
                              "attribution+exact": {"estimator", "ig_steps", "top_k",
                                                    "max_passes", "budget"}})
        if method == "attribution":
            unused_checkpoint(checkpoint, "method='attribution'")
        if backend != "transformer_lens" or remote:
            raise ValueError(f"backend={backend!r}: edge sweeps run on the TransformerLens "
                             "backend only.")
        return method

    def entry(self, method: str) -> dict[str, Any]:
        return dict(site="z", positions="all", sites=hooks.PATCH_HEAD_SITES,
                    engine_checks=False)

    def checked(self, model: Any, clean: Any, corrupt: Any) -> EdgeUnits:
        """The layout of these nodes (``check_edge_nodes``; the model's facts taken once, here,
        and carried by the layout), every input patchable, and no post-norm block
        (``check_edge_model``)."""
        layout = self.layout_of(model)
        for name in layout.inputs:
            hooks.check_patchable(model, name, clean)
        check_edge_model(model)
        return replace(self, layout=layout)

    def layout_of(self, model: Any) -> EdgeLayout:
        """The ``EdgeLayout`` of these nodes on ``model`` (or a ``models.Architecture``)."""
        s, r, i = check_edge_nodes(model, self.senders, self.receivers, self.inputs)
        f = model if hasattr(model, "n_kv_heads") else hooks.facts(model)
        return EdgeLayout(f.n_layers, f.n_heads, f.n_kv_heads, s, r, i)

    def meta(self, model: Any, task_hash: str | None) -> dict[str, Any]:
        """(Checked units: the layout's facts, not the model's asked again.)"""
        lay = self.layout or self.layout_of(model)
        return dict(task_hash=task_hash, kv_heads=lay.n_kv_heads != lay.n_heads)

    def sweep(self, model: Any, direction: str, clean: Any, metric: Any) -> Any:
        return make_edge_sweep(model, self.layout, direction, clean, metric)

    def exact(self, model, clean, corrupt, pm, opts, meta) -> Any:
        return exact.run_edges(model, clean, corrupt, pm, self.layout, opts, meta)


    def estimate(self, model, clean, corrupt, pm, opts) -> Any:
        return attribution._attribution_patch_edges(model, clean, corrupt, pm, self.layout, opts)

    def screenable(self, model, clean, corrupt, pm, opts) -> Screenable:
        """What ``hybrid.screen_then_verify`` takes of these edges (checked): flat cells are
        the edges in ``values``'s row-major order (sender, receiver, input), each verified as
        variant ``v`` of its receiver layer (``EdgeLayout.cells``); ``d = (L + 1 - l) / (L +
        1)`` (the logits count as layer ``L``)."""
        estimator = opts.estimator or attribution.EDGE_SCREENING_ESTIMATOR
        layout, (n, seq) = self.layout, clean.shape
        L = layout.n_layers
        direction, batch_size = opts.direction, opts.batch_size
        sweep = self.sweep(model, direction, clean, pm)
        where: dict[tuple[int, int, int], tuple[int, int]] = {}  # (s, r, i) -> (layer, v)
        r_index = layout.receiver_index()
        for la in range(L + 1):
            for v, (s, i, u) in enumerate(layout.cells(la).tolist()):
                where[(s, r_index[(la, u) if la < L else (L, -1)], i)] = (la, v)
        index = torch.tensor(sorted(where), dtype=torch.long).reshape(-1, 3)
        layer = torch.tensor([where[tuple(c)][0] for c in index.tolist()], dtype=torch.long)
        variant = [where[tuple(c)][1] for c in index.tolist()]
        engines: list[EdgeEngine] = []

        def run(la: int, cells: list[int], p0: int, p1: int) -> Tensor:
            if not engines:
                engines.append(EdgeEngine(model, clean, corrupt, pm, sweep, layout))
            return engines[0].run_variants(la, [variant[j] for j in cells], p0, p1)

        def screen() -> EdgeResult:
            est = self.estimate(model, clean, corrupt, pm, replace(opts, estimator=estimator))
            return replace(est, clean=float(est.clean), corrupt=float(est.corrupt))  # savable

        return Screenable(
            kind="edges", index=index, layer=layer, screen=screen, run=run,
            downstream=(L + 1 - layer).float() / (L + 1), metric=pm, n_prompts=n,
            per_round=max(1, len(layout.inputs) * layout.n_heads),
            exact=lambda: self.exact(model, clean, corrupt, pm, opts, {}),
            screen_passes=n * attribution.edge_estimator_passes(
                model, layout, estimator, attribution.EDGE_IG_STEPS if opts.ig_steps is None
                else opts.ig_steps, seq),
            identity=lambda: sweep_identity(model, sweep, clean, corrupt, pm,
                                            **layout.to_dict(), method="attribution+exact",
                                            estimator=estimator, ig_steps=opts.ig_steps),
            read_share=_read_share(pm, clean), rows=batch_size or auto_rows(model, seq),
            result_type=EdgeResult)

    def cost_plan(self, arch: Any, lengths: list[int], **kw: Any) -> dict[str, Any]:
        """``cost.edge_plan`` of these edges (config only)."""
        from circuitkit.patching.cost import edge_plan

        return edge_plan(arch, lengths, self.layout or self.layout_of(arch), **kw)
