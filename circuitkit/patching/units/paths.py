"""Every path sender -> everything between -> receiver input: ``PathUnits``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from torch import Tensor

from circuitkit import hooks
from circuitkit.patching import groups
from circuitkit.patching.exact import sweeps as exact
from circuitkit.patching.inputs import (
    check_path_nodes,
    pad_token_id,
    padded_lengths,
)
from circuitkit.patching.sweep import (
    PathLayout,
    make_path_sweep,
)
from circuitkit.patching.units.base import (
    _exact_only,
    _Units,
)


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

    def check_method(self, method, opts) -> str:
        return _exact_only(method, opts, "path", (
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

    def exact(self, model, clean, corrupt, pm, opts, meta) -> Any:
        return exact.run_paths(model, clean, corrupt, pm, self.layout, self.positions, opts,
                               meta)

    def cost_plan(self, arch: Any, lengths: list[int], **kw: Any) -> dict[str, Any]:
        """``cost.path_plan`` of these paths (config only)."""
        from circuitkit.patching.cost import path_plan

        return path_plan(arch, lengths, self.layout or self.layout_of(arch), **kw)
