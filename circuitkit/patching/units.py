"""What is patched: ``HeadUnits``, ``LayerUnits``, ``EdgeUnits``, and ``MethodOptions``.

A unit object says what ``ck.patch`` patches; each stage takes it, and each kind knows, once, its
own checks (``check_method``, ``entry``, ``checked``), ``sweep``, ``exact``, ``estimate``,
``screenable`` (the hybrid's ``Screenable``), ``axes``, ``cost_plan``, ``methods`` and
``estimators``. ``MethodOptions``: what every method shares, one frozen object; an option the
chosen method does not use is said to do nothing (a warning), never dropped silently.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching import attribution, exact, groups
from circuitkit.patching.checkpoint import sweep_identity
from circuitkit.patching.engine import EdgeEngine, ExactEngine
from circuitkit.patching.estimators.registry import resolve_estimator
from circuitkit.patching.hybrid import Screenable, check_max_passes
from circuitkit.patching.inputs import (
    BACKENDS,
    EDGE_METHODS,
    METHODS,
    POSITIONS,
    check_edge_model,
    check_edge_nodes,
    check_path_nodes,
    check_top_k,
    choice,
    pad_token_id,
    padded_lengths,
)
from circuitkit.patching.results import EdgeResult, PatchResult
from circuitkit.patching.sweep import (
    EdgeLayout,
    PathLayout,
    auto_rows,
    length_order,
    make_edge_sweep,
    make_path_sweep,
    make_sweep,
)

_STACK = 5  # warnings point at the caller of patch_heads / patch_edges (through ck.patch)


@dataclass(frozen=True)
class MethodOptions:
    """Options every method shares. ``estimator``: the attribution estimate (or the hybrid's
    screen; ``attribution.ESTIMATORS`` for heads, ``EDGE_ESTIMATORS`` for edges); ``atp_star``:
    AtP*'s Q/K fix (heads); ``ig_steps``: the eap-ig estimators' steps (edges); ``top_k`` /
    ``max_passes``: the cells ``attribution+exact`` (or ``auto``) verifies; ``screening_recall``:
    ``auto``'s extra screen on an exact run."""

    estimator: str | None = None
    top_k: int | None = None
    max_passes: float | None = None
    atp_star: bool = False
    ig_steps: int | None = None
    screening_recall: bool = False

    def given(self) -> list[str]:
        """The options set away from their defaults, in declaration order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]


def as_options(options: Any) -> MethodOptions:
    """``options``: None, a ``MethodOptions`` or a dict of its fields (one line otherwise)."""
    if options is None:
        return MethodOptions()
    if isinstance(options, MethodOptions):
        return options
    names = [f.name for f in fields(MethodOptions)]
    if isinstance(options, dict) and set(options) <= set(names):
        return MethodOptions(**options)
    raise ValueError(f"options={options!r}: expected ck.MethodOptions(...) or a dict of "
                     f"{names}.")


def as_units(units: Any) -> Any:
    """``units``: a ``HeadUnits``, ``LayerUnits``, ``EdgeUnits`` or ``PathUnits`` (or "heads",
    "layers", "edges", "paths" for their defaults); anything else is one line naming what is
    expected."""
    if isinstance(units, HeadUnits | LayerUnits | EdgeUnits | PathUnits):
        return units
    if isinstance(units, str) and units in KINDS:
        return KINDS[units]()
    raise ValueError(f"units={units!r}: expected ck.HeadUnits(site, positions), "
                     "ck.LayerUnits(site), ck.EdgeUnits(senders, receivers, inputs) or "
                     "ck.PathUnits(senders, receivers, inputs, positions) (or 'heads', "
                     "'layers', 'edges', 'paths' for their defaults).")


def _stray(method: str, opts: MethodOptions, allowed: dict[str, set[str]]) -> None:
    """Warn for options ``method`` does not use (a notebook loop may pass one set to all)."""
    stray = [g for g in opts.given() if g not in allowed.get(method, set())
             and g != "screening_recall"]  # a flag of auto's exact run, harmless elsewhere
    if stray:
        warnings.warn(
            f"{' and '.join(stray)} {'does' if len(stray) == 1 else 'do'} nothing with "
            f"method={method!r}: estimator and atp_star choose the estimate of method "
            "'attribution' or 'attribution+exact', top_k and max_passes the cells "
            "'attribution+exact' (or 'auto') verifies.", stacklevel=_STACK)


def unused_checkpoint(checkpoint: Any, what: str) -> None:
    if checkpoint is not None:
        warnings.warn(f"checkpoint={str(checkpoint)!r} is not used: {what} is not checkpointed "
                      "(exact sweeps and attribution+exact of the TransformerLens backend "
                      "are).", stacklevel=_STACK)


def _hybrid_options(method: str, opts: MethodOptions) -> None:
    check_top_k(opts.top_k)  # every entry, whatever the method (top_k=0 verified nothing)
    if method in ("attribution+exact", "auto"):
        check_max_passes(opts.max_passes, opts.top_k)


def _exact_only(method: str, opts: MethodOptions, backend: str, remote: bool, what: str,
                refusal: str) -> str:
    """The method of units patched exactly only ("auto" is "exact"): another one is
    ``refusal``, another backend a line naming ``what`` sweeps."""
    method = "exact" if method == "auto" else method  # the one choice
    choice("method", method, METHODS)
    if method != "exact":
        raise ValueError(refusal)
    _stray(method, opts, {})
    if backend != "transformer_lens" or remote:
        raise ValueError(f"backend={backend!r}: {what} sweeps run on the TransformerLens "
                         "backend only.")
    return method


class _Units:
    """What every kind shares: no entry work of its own, ``meta`` the task's hash, and the
    exact sweep of ``sweep`` (edges: their own engine)."""

    def checked(self, model: Any, clean: Tensor, corrupt: Tensor) -> Any:
        return self

    def meta(self, model: Any, task_hash: str | None) -> dict[str, Any]:
        return dict(task_hash=task_hash)

    def exact(self, model, clean, corrupt, pm, direction, batch_size, checkpoint, progress,
              meta) -> Any:
        sweep = self.sweep(model, direction, clean, pm)
        return exact.run(model, clean, corrupt, pm, sweep, batch_size, checkpoint, progress,
                         meta)[0]


def _read_share(metric: PromptMetric, clean: Tensor) -> float:
    """The share of prompt tokens up to each prompt's metric's last read (1: it reads all)."""
    _, lengths = length_order(metric)
    return 1.0 if lengths is None else sum(lengths) / clean.numel()


# --- heads ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadUnits(_Units):
    """Every attention head at ``site`` ("z", "pattern", "q", "k", "v"), at ``positions``:
    "all" (values ``[layer, head]``), "each" (``[layer, head, pos]``) or position groups, a
    bool mask ``[batch, seq]`` or ``{name: mask}`` (``[layer, head, group]``; ``checked``
    turns them into ``groups.PositionGroups``)."""

    site: str = "z"
    positions: Any = "all"
    kind: ClassVar[str] = "heads"
    methods: ClassVar[tuple[str, ...]] = METHODS

    def __post_init__(self) -> None:
        choice("site", self.site, hooks.PATCH_HEAD_SITES)
        if not groups.is_groups(self.positions):
            choice("positions", self.positions, POSITIONS)

    @property
    def grouped(self) -> bool:
        return groups.is_groups(self.positions)

    @property
    def estimators(self) -> tuple[str, ...]:
        return ("atp",) if self.grouped else attribution.ESTIMATORS

    @property
    def axes(self) -> tuple[str, ...]:
        return ("layer", "head") + (("pos",) if self.positions == "each" else ("group",)
                                    if self.grouped else ())

    def check_method(self, method: str, opts: MethodOptions, checkpoint: Any, backend: str,
                     remote: bool) -> str:
        """The method and options checked for heads (one line each); returns the method."""
        _hybrid_options(method, opts)
        if opts.estimator is not None:
            choice("estimator", opts.estimator, attribution.ESTIMATORS)
        _stray(method, opts, {"attribution": {"estimator", "atp_star", "ig_steps"},
                              "auto": {"top_k", "max_passes", "screening_recall"},
                              "attribution+exact": {"estimator", "atp_star", "top_k",
                                                    "max_passes"}})
        if self.grouped and (backend != "transformer_lens" or remote or method not in (
                "exact", "attribution") or (method == "attribution" and (
                opts.atp_star or opts.estimator not in (None, "atp")))):
            raise NotImplementedError(
                f"position groups run with method='exact' or plain method='attribution' "
                f"(estimator 'atp') on the TransformerLens backend; got method={method!r}, "
                f"estimator={opts.estimator!r}, atp_star={opts.atp_star}, "
                f"backend={backend!r}.")
        if method == "attribution":
            unused_checkpoint(checkpoint, "method='attribution'")
        elif backend == "nnsight":
            unused_checkpoint(checkpoint, "backend='nnsight'")
        if backend != "transformer_lens" or remote:
            choice("backend", backend, BACKENDS)
            if backend != "nnsight":
                raise ValueError("remote=True runs through NDIF and needs backend='nnsight'.")
        return method

    def entry(self, method: str) -> dict[str, Any]:
        """What the entry's checks (``api._check``) take of these units."""
        return dict(site=self.site, positions="all" if self.grouped else self.positions,
                    sites=hooks.PATCH_HEAD_SITES, engine_checks=method == "exact")

    def checked(self, model: Any, clean: Any, corrupt: Any) -> HeadUnits:
        """Position groups checked against the (checked) tokens."""
        if not self.grouped:
            return self
        real = padded_lengths(clean, corrupt, pad_token_id(model))
        return replace(self, positions=groups.position_groups(self.positions, clean, real))

    def meta(self, model: Any, task_hash: str | None) -> dict[str, Any]:
        gqa = self.site in hooks.KV_SITES and hooks.facts(model).gqa
        return dict(head_axis="kv_head" if gqa else "head", task_hash=task_hash)

    def sweep(self, model: Any, direction: str, clean: Any, metric: Any) -> Any:
        return make_sweep(model, "heads", self.site, direction, self.positions, clean, metric)

    def estimate(self, model, clean, corrupt, pm, direction, opts, batch_size, progress) -> Any:
        """Attribution; position groups: the per-position estimate summed over each group."""
        extra = {} if opts.ig_steps is None else dict(ig_steps=opts.ig_steps)
        if self.grouped:
            each = attribution.estimate_heads(
                model, clean, corrupt, pm, "atp", direction=direction, site=self.site,
                positions="each", batch_size=batch_size, progress=progress)
            res = groups.summed_over(each, self.positions)
            res.meta.update(exact.group_meta(self.positions))
            return res
        return attribution.estimate_heads(
            model, clean, corrupt, pm, resolve_estimator(opts.estimator, opts.atp_star),
            direction=direction, site=self.site, positions=self.positions,
            atp_star=opts.atp_star, batch_size=batch_size, progress=progress,
            explicit=opts.estimator is not None, **extra)

    def screenable(self, model, clean, corrupt, pm, direction, opts, batch_size, progress,
                   checkpoint=None) -> Screenable:
        """What ``hybrid.screen_then_verify`` takes of these heads (checked): flat cell ``j``
        is ``values``'s row-major cell, layer ``j // per_layer``; ``d = (L - l) / L``; the
        exact sweep instead: ``exact`` (checkpointed in the same folder). The screen:
        ``estimator``, else "qk" with ``atp_star`` where it applies, else the screening one."""
        estimator = opts.estimator or ("qk" if opts.atp_star and self.site in
                                       attribution.ATP_STAR_SITES else
                                       attribution.screening_estimator(model, self.site, clean))
        sweep = self.sweep(model, direction, clean, pm)
        (n, seq), f = clean.shape, hooks.facts(model)
        L, per_layer, n_units = f.n_layers, sweep.n_variants, f.n_heads_at(self.site)
        shape = (L, n_units, seq) if self.positions == "each" else (L, n_units)
        index = torch.stack(torch.unravel_index(torch.arange(L * per_layer), shape), 1)
        layer = torch.arange(L).repeat_interleave(per_layer)
        star = bool(opts.atp_star) and estimator in ("qk", "atp*")  # what atp_star changes
        engines: list[ExactEngine] = []  # built at the first cell: its two cached runs cost 2n

        def run(la: int, cells: list[int], p0: int, p1: int) -> Tensor:
            if not engines:
                engines.append(ExactEngine(model, clean, corrupt, pm, sweep))
            return engines[0].run_variants(la, [j % per_layer for j in cells], p0, p1)

        return Screenable(
            kind="heads", index=index, layer=layer, downstream=(L - layer) / L, run=run,
            per_round=per_layer, metric=pm, n_prompts=n,
            exact=lambda: self.exact(model, clean, corrupt, pm, direction, batch_size,
                                     checkpoint, progress, {}),
            screen=lambda: attribution.estimate_heads(
                model, clean, corrupt, pm, estimator, direction=direction, site=self.site,
                positions=self.positions, atp_star=star, batch_size=batch_size,
                progress=progress),
            screen_passes=n * attribution.estimator_passes(
                model, estimator, self.site, self.positions, seq, batch=min(batch_size or n, n)),
            identity=lambda: sweep_identity(model, sweep, clean, corrupt, pm,
                                            method="attribution+exact", estimator=estimator,
                                            atp_star=star),
            read_share=_read_share(pm, clean), rows=batch_size or auto_rows(model, seq),
            result_type=PatchResult)

    def cost_plan(self, arch: Any, lengths: list[int], **kw: Any) -> dict[str, Any]:
        """``plan.sweep_plan`` of these heads (config only)."""
        from circuitkit.patching.plan import sweep_plan

        return sweep_plan(arch, lengths, site=self.site, positions=self.positions, **kw)


# --- layers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerUnits(_Units):
    """A whole-layer site ("resid_pre", "attn_out", "mlp_out") at each (layer, position):
    values ``[layer, pos]``; exact only."""

    site: str = "resid_pre"
    kind: ClassVar[str] = "layers"
    methods: ClassVar[tuple[str, ...]] = ("exact",)
    estimators: ClassVar[tuple[str, ...]] = ()
    axes: ClassVar[tuple[str, ...]] = ("layer", "pos")
    positions: ClassVar[str] = "each"

    def __post_init__(self) -> None:
        choice("site", self.site, hooks.PATCH_LAYER_SITES)

    def check_method(self, method, opts, checkpoint, backend, remote) -> str:
        return _exact_only(method, opts, backend, remote, "layer", (
            f"patch_layers is exact only; got method={method!r}. Use patch_heads for "
            "attribution (heads, not layers)."))

    def entry(self, method: str) -> dict[str, Any]:
        return dict(site=self.site, positions="each", sites=hooks.PATCH_LAYER_SITES,
                    engine_checks=True)

    def sweep(self, model: Any, direction: str, clean: Any, metric: Any) -> Any:
        return make_sweep(model, "layers", self.site, direction, "each", clean, metric)


# --- edges ----------------------------------------------------------------------------------


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

    def check_method(self, method, opts, checkpoint, backend, remote) -> str:
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
                                                    "max_passes"}})
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
        """The layout of these nodes (``check_edge_nodes``), every input patchable, and no
        post-norm block (``check_edge_model``)."""
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
        return dict(task_hash=task_hash, kv_heads=hooks.facts(model).gqa)

    def sweep(self, model: Any, direction: str, clean: Any, metric: Any) -> Any:
        return make_edge_sweep(model, self.layout, direction, clean, metric)

    def exact(self, model, clean, corrupt, pm, direction, batch_size, checkpoint, progress,
              meta) -> Any:
        return exact.run_edges(model, clean, corrupt, pm, self.layout, direction, batch_size,
                               checkpoint, progress, meta)

    def estimate(self, model, clean, corrupt, pm, direction, opts, batch_size, progress) -> Any:
        return attribution.attribution_patch_edges(
            model, clean, corrupt, pm, self.layout, direction=direction,
            estimator=opts.estimator, ig_steps=opts.ig_steps, batch_size=batch_size,
            progress=progress)

    def screenable(self, model, clean, corrupt, pm, direction, opts, batch_size, progress,
                   checkpoint=None) -> Screenable:
        """What ``hybrid.screen_then_verify`` takes of these edges (checked): flat cells are
        the edges in ``values``'s row-major order (sender, receiver, input), each verified as
        variant ``v`` of its receiver layer (``EdgeLayout.cells``); ``d = (L + 1 - l) / (L +
        1)`` (the logits count as layer ``L``)."""
        estimator = opts.estimator or attribution.EDGE_SCREENING_ESTIMATOR
        layout, (n, seq) = self.layout, clean.shape
        L = layout.n_layers
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
            est = self.estimate(model, clean, corrupt, pm, direction,
                                replace(opts, estimator=estimator), batch_size, progress)
            return replace(est, clean=float(est.clean), corrupt=float(est.corrupt))  # savable

        return Screenable(
            kind="edges", index=index, layer=layer, screen=screen, run=run,
            downstream=(L + 1 - layer).float() / (L + 1), metric=pm, n_prompts=n,
            per_round=max(1, len(layout.inputs) * hooks.facts(model).n_heads),
            exact=lambda: self.exact(model, clean, corrupt, pm, direction, batch_size,
                                     checkpoint, progress, {}),
            screen_passes=n * attribution.edge_estimator_passes(
                model, layout, estimator, attribution.EDGE_IG_STEPS if opts.ig_steps is None
                else opts.ig_steps, seq),
            identity=lambda: sweep_identity(model, sweep, clean, corrupt, pm,
                                            **layout.to_dict(), method="attribution+exact",
                                            estimator=estimator, ig_steps=opts.ig_steps),
            read_share=_read_share(pm, clean), rows=batch_size or auto_rows(model, seq),
            result_type=EdgeResult)

    def cost_plan(self, arch: Any, lengths: list[int], **kw: Any) -> dict[str, Any]:
        """``plan.edge_plan`` of these edges (config only)."""
        from circuitkit.patching.plan import edge_plan

        return edge_plan(arch, lengths, self.layout or self.layout_of(arch), **kw)


# --- paths ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PathUnits(_Units):
    """Every path from ``senders`` into ``receivers`` (heads: ``(layer, head)`` or "L3H2")
    through everything between them (MLPs, other heads, other positions): the receiver's
    ``inputs`` ("q", "k", "v", patched together) read the sender run's residual at each position
    group of ``positions`` (a bool mask ``[batch, seq]`` or ``{name: mask}``; None: every
    position). Values ``[sender, receiver]`` or ``[sender, receiver, group]``, NaN where the
    receiver is not after the sender; exact only (``patching/paths.py``, ``PathEngine``)."""

    senders: Any = None
    receivers: Any = None
    inputs: Any = hooks.EDGE_INPUTS
    positions: Any = None
    layout: PathLayout | None = field(default=None, compare=False, repr=False)
    kind: ClassVar[str] = "paths"
    methods: ClassVar[tuple[str, ...]] = ("exact",)
    estimators: ClassVar[tuple[str, ...]] = ()

    @property
    def axes(self) -> tuple[str, ...]:
        return ("sender", "receiver") + (() if self.positions is None else ("group",))

    def check_method(self, method, opts, checkpoint, backend, remote) -> str:
        return _exact_only(method, opts, backend, remote, "path", (
            f"paths are patched exactly only; got method={method!r}. Screen the direct edges "
            "with patch_edges(method='attribution') instead."))

    def entry(self, method: str) -> dict[str, Any]:
        return dict(site="z", positions="all", sites=hooks.PATCH_HEAD_SITES,
                    engine_checks=False)

    def checked(self, model: Any, clean: Any, corrupt: Any) -> PathUnits:
        """The nodes checked (``check_path_nodes``) into a ``PathLayout``, every input
        patchable; position groups checked against the (checked) tokens."""
        layout = self.layout_of(model)
        for name in layout.inputs:
            hooks.check_patchable(model, name, clean)
        pos = self.positions
        if pos is not None:
            real = padded_lengths(clean, corrupt, pad_token_id(model))
            pos = groups.position_groups(pos, clean, real)
        return replace(self, positions=pos, layout=layout)

    def layout_of(self, model: Any) -> PathLayout:
        """The ``PathLayout`` of these nodes on ``model`` (or a ``models.Architecture``): one
        group without ``positions``, one per mask of a ``{name: mask}``."""
        s, r, i = check_path_nodes(model, self.senders, self.receivers, self.inputs)
        pos = self.positions
        n_groups = 1 if pos is None or isinstance(pos, Tensor) else len(pos)
        return PathLayout(hooks.facts(model).n_layers, s, r, i, n_groups)

    def sweep(self, model: Any, direction: str, clean: Any, metric: Any) -> Any:
        return make_path_sweep(self.layout, direction, clean, metric, self.positions)

    def exact(self, model, clean, corrupt, pm, direction, batch_size, checkpoint, progress,
              meta) -> Any:
        return exact.run_paths(model, clean, corrupt, pm, self.layout, self.positions, direction,
                               batch_size, checkpoint, progress, meta)

    def cost_plan(self, arch: Any, lengths: list[int], **kw: Any) -> dict[str, Any]:
        """``plan.path_plan`` of these paths (config only)."""
        from circuitkit.patching.plan import path_plan

        return path_plan(arch, lengths, self.layout or self.layout_of(arch), **kw)


KINDS = {"heads": HeadUnits, "layers": LayerUnits, "edges": EdgeUnits, "paths": PathUnits}
