"""The unit kinds by name and ``as_units`` (a module of its own: it imports every kind)."""

from __future__ import annotations

from typing import Any

from circuitkit.patching.units.edges import EdgeUnits
from circuitkit.patching.units.head_sets import HeadSetUnits
from circuitkit.patching.units.heads import HeadUnits
from circuitkit.patching.units.layers import LayerUnits
from circuitkit.patching.units.paths import PathUnits

KINDS = {"heads": HeadUnits, "layers": LayerUnits, "edges": EdgeUnits, "paths": PathUnits}


def as_units(units: Any) -> Any:
    """``units``: a ``HeadUnits``, ``LayerUnits``, ``EdgeUnits``, ``PathUnits`` or
    ``HeadSetUnits`` (or "heads", "layers", "edges", "paths" for their defaults; head sets have
    none); anything else is one line naming what is expected."""
    kinds = KINDS
    if isinstance(units, (*kinds.values(), HeadSetUnits)):
        return units
    if isinstance(units, str) and units in kinds:
        return kinds[units]()
    raise ValueError(f"units={units!r}: expected ck.HeadUnits(site, positions), "
                     "ck.LayerUnits(site), ck.EdgeUnits(senders, receivers, inputs), "
                     "ck.PathUnits(senders, receivers, inputs, positions) or "
                     "ck.HeadSetUnits(sets, site, source) (or 'heads', "
                     "'layers', 'edges', 'paths' for their defaults).")
