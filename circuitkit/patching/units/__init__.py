"""What is patched: ``HeadUnits`` (``heads.py``), ``LayerUnits`` (``layers.py``),
``EdgeUnits`` (``edges.py``), ``PathUnits`` (``paths.py``), ``HeadSetUnits`` (``head_sets.py``:
head sets, each patched together), and ``MethodOptions`` (``base.py``); ``ck.circuit``'s
``CircuitUnits`` and ``CircuitOptions`` (``circuits.py``: the exact road only).

A unit object says what ``ck.patch`` patches; each stage takes it, and each kind knows, once, its
own checks (``check_method``, ``entry``, ``checked``), ``sweep``, ``exact``, ``estimate``,
``screenable`` (the hybrid's ``Screenable``), ``axes``, ``cost_plan``, ``methods`` and
``estimators``. ``MethodOptions``: what every method shares, one frozen object; an option the
chosen method does not use is said to do nothing (a warning), never dropped silently.
"""

from __future__ import annotations

from circuitkit._lazy import lazy_exports

_EXPORTS = {
    "PatchOptions": "circuitkit.patching.units.base:PatchOptions",
    "MethodOptions": "circuitkit.patching.units.base:MethodOptions",
    "BudgetRule": "circuitkit.patching.units.base:BudgetRule",
    "as_options": "circuitkit.patching.units.base:as_options",
    "as_units": "circuitkit.patching.units.kinds:as_units",
    "unused_checkpoint": "circuitkit.patching.units.base:unused_checkpoint",
    "HeadUnits": "circuitkit.patching.units.heads:HeadUnits",
    "LayerUnits": "circuitkit.patching.units.layers:LayerUnits",
    "EdgeUnits": "circuitkit.patching.units.edges:EdgeUnits",
    "PathUnits": "circuitkit.patching.units.paths:PathUnits",
    "HeadSetUnits": "circuitkit.patching.units.head_sets:HeadSetUnits",
    "CircuitUnits": "circuitkit.patching.units.circuits:CircuitUnits",
    "CircuitOptions": "circuitkit.patching.units.circuits:CircuitOptions",
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
__all__ = sorted(_EXPORTS)
