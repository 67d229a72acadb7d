"""A whole-layer site at each (layer, position): ``LayerUnits``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from circuitkit import hooks
from circuitkit.patching.inputs import (
    choice,
)
from circuitkit.patching.sweep import (
    make_sweep,
)
from circuitkit.patching.units.base import (
    _exact_only,
    _Units,
)


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

    def check_method(self, method, opts) -> str:
        return _exact_only(method, opts, "layer", (
            f"patch_layers is exact only; got method={method!r}. Use patch_heads for "
            "attribution (heads, not layers)."))

    def entry(self, method: str) -> dict[str, Any]:
        return dict(site=self.site, positions="each", sites=hooks.PATCH_LAYER_SITES,
                    engine_checks=True)

    def sweep(self, model: Any, direction: str, clean: Any, metric: Any) -> Any:
        return make_sweep(model, "layers", self.site, direction, "each", clean, metric)
