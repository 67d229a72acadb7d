"""Every attention head at a site: ``HeadUnits``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from circuitkit import hooks
from circuitkit.identity import sweep_identity
from circuitkit.patching import groups
from circuitkit.patching.estimators import attribution
from circuitkit.patching.estimators.registry import names, resolve_estimator
from circuitkit.patching.exact import ExactEngine
from circuitkit.patching.exact import sweeps as exact
from circuitkit.patching.hybrid import Screenable
from circuitkit.patching.inputs import (
    BACKENDS,
    METHODS,
    POSITIONS,
    choice,
    pad_token_id,
    padded_lengths,
)
from circuitkit.patching.results import PatchResult
from circuitkit.patching.sweep import (
    auto_rows,
    make_sweep,
)
from circuitkit.patching.units.base import (
    PatchOptions,
    _hybrid_options,
    _read_share,
    _stray,
    _Units,
    unused_checkpoint,
)


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
        return ("atp",) if self.grouped else names("heads")  # (every registered entry)

    @property
    def axes(self) -> tuple[str, ...]:
        return ("layer", "head") + (("pos",) if self.positions == "each" else ("group",)
                                    if self.grouped else ())

    def check_method(self, method: str, opts: PatchOptions) -> str:
        """The method and options checked for heads (one line each); returns the method."""
        checkpoint, backend, remote = opts.checkpoint, opts.backend, opts.remote
        _hybrid_options(method, opts)
        if opts.estimator is not None:
            choice("estimator", opts.estimator, names("heads"))
        _stray(method, opts, {"attribution": {"estimator", "atp_star", "ig_steps"},
                              "auto": {"top_k", "max_passes", "screening_recall"},
                              "attribution+exact": {"estimator", "atp_star", "top_k",
                                                    "max_passes", "budget"}})
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
        if backend != "transformer_lens" or remote:
            choice("backend", backend, BACKENDS)
            if backend != "nnsight":
                raise ValueError("remote=True runs through NDIF and needs backend='nnsight'.")
            from circuitkit.patching.exact.nnsight import SITES

            if self.site not in SITES:
                raise ValueError(f"site={self.site!r} is not supported by backend='nnsight'; "
                                 f"expected one of {list(SITES)} (pattern patching needs the "
                                 "TransformerLens backend).")
            if method not in ("exact", "auto"):
                raise ValueError(f"method={method!r} is not supported by backend='nnsight'; use "
                                 "'exact' (attribution needs the TransformerLens backend).")
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

    def estimate(self, model, clean, corrupt, pm, opts: PatchOptions) -> Any:
        """Attribution; position groups: the per-position estimate summed over each group.
        ``atp_star`` without an estimator named: "qk" with the exact tail (its legacy switch)."""
        if self.grouped:
            each = attribution.estimate_heads(model, clean, corrupt, pm, "atp", self.site, "each",
                                              opts)
            res = groups.summed_over(each, self.positions)
            res.meta.update(exact.group_meta(self.positions))
            return res
        return attribution.estimate_heads(
            model, clean, corrupt, pm, resolve_estimator(opts.estimator, opts.atp_star),
            self.site, self.positions, opts, tail=opts.atp_star and opts.estimator is None)

    def screenable(self, model, clean, corrupt, pm, opts: PatchOptions) -> Screenable:
        """What ``hybrid.screen_then_verify`` takes of these heads (checked): flat cell ``j``
        is ``values``'s row-major cell, layer ``j // per_layer``; ``d = (L - l) / L``; the
        exact sweep instead: ``exact`` (checkpointed in the same folder). The screen:
        ``estimator``, else "qk" with ``atp_star`` where it applies, else the screening one."""
        estimator = opts.estimator or ("qk" if opts.atp_star and self.site in
                                       attribution.ATP_STAR_SITES else
                                       attribution.screening_estimator(model, self.site, clean))
        direction, batch_size = opts.direction, opts.batch_size
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
            exact=lambda: self.exact(model, clean, corrupt, pm, opts, {}),
            screen=lambda: attribution.estimate_heads(  # (its own ig_steps: the default)
                model, clean, corrupt, pm, estimator, self.site, self.positions,
                replace(opts, ig_steps=None)),
            screen_passes=n * attribution.estimator_passes(
                model, estimator, self.site, self.positions, seq, batch=min(batch_size or n, n)),
            identity=lambda: sweep_identity(model, sweep, clean, corrupt, pm,
                                            method="attribution+exact", estimator=estimator,
                                            atp_star=star),
            read_share=_read_share(pm, clean), rows=batch_size or auto_rows(model, seq),
            result_type=PatchResult)

    def cost_plan(self, arch: Any, lengths: list[int], **kw: Any) -> dict[str, Any]:
        """``cost.sweep_plan`` of these heads (config only)."""
        from circuitkit.patching.cost import sweep_plan

        return sweep_plan(arch, lengths, site=self.site, positions=self.positions, **kw)
