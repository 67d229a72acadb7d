"""The patching results' public import path; each type lives in a file named for it
(``patch_result.py``, ``edge_result.py``, ``circuit_result.py``; pages beside them: ``pages.py``;
the file format and the strict load's checks: ``files.py``; the circuit's graph:
``circuit_graph.py``)."""

from __future__ import annotations

from circuitkit._lazy import lazy_exports

_EXPORTS = {
    "node_name": "circuitkit.hooks:node_name",
    "node_of": "circuitkit.hooks:parse_node",
    "CIRCUIT_ABLATIONS": "circuitkit.patching.results.circuit_result:CIRCUIT_ABLATIONS",
    "CIRCUIT_OLD_ABLATIONS": "circuitkit.patching.results.circuit_result:CIRCUIT_OLD_ABLATIONS",
    "CircuitResult": "circuitkit.patching.results.circuit_result:CircuitResult",
    "CircuitTargetWarning": "circuitkit.patching.results.circuit_result:CircuitTargetWarning",
    "gap_percent": "circuitkit.patching.results.circuit_result:gap_percent",
    "read_circuit_json": "circuitkit.patching.results.circuit_result:read_circuit_json",
    "share_phrase": "circuitkit.patching.results.circuit_result:share_phrase",
    "EdgeResult": "circuitkit.patching.results.edge_result:EdgeResult",
    "plotly_bundle": "circuitkit.patching.results.pages:plotly_bundle",
    "write_page": "circuitkit.patching.results.pages:write_page",
    "MIN_GAP_SE": "circuitkit.patching.results.patch_result:MIN_GAP_SE",
    "DegenerateBaselineWarning":
        "circuitkit.patching.results.patch_result:DegenerateBaselineWarning",
    "PatchResult": "circuitkit.patching.results.patch_result:PatchResult",
    "quiet_baseline": "circuitkit.patching.results.patch_result:quiet_baseline",
    "verified_mask": "circuitkit.patching.results.patch_result:verified_mask",
    "MEAN_RTOL": "circuitkit.patching.results.files:MEAN_RTOL",
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
__all__ = sorted(_EXPORTS)
