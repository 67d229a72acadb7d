"""The patching results' public import path; each type lives in a file named for it
(``patch_result.py``, ``edge_result.py``, ``circuit_result.py``; pages beside them: ``pages.py``;
the file format and the strict load's checks: ``result_files.py``)."""

from circuitkit.hooks import node_name
from circuitkit.hooks import parse_node as node_of  # node_name's inverse, under its old name
from circuitkit.patching.circuit_result import (
    CIRCUIT_ABLATIONS,
    CIRCUIT_OLD_ABLATIONS,
    CircuitResult,
    CircuitTargetWarning,
    gap_percent,
    read_circuit_json,
    share_phrase,
)
from circuitkit.patching.edge_result import EdgeResult
from circuitkit.patching.pages import plotly_bundle, write_page
from circuitkit.patching.patch_result import (
    MIN_GAP_SE,
    DegenerateBaselineWarning,
    PatchResult,
    quiet_baseline,
    verified_mask,
)
from circuitkit.patching.result_files import MEAN_RTOL

__all__ = ["CIRCUIT_ABLATIONS", "CIRCUIT_OLD_ABLATIONS", "MEAN_RTOL", "MIN_GAP_SE",
           "CircuitResult", "CircuitTargetWarning",
           "DegenerateBaselineWarning", "EdgeResult", "PatchResult", "gap_percent", "node_name",
           "node_of", "plotly_bundle", "quiet_baseline", "read_circuit_json", "share_phrase",
           "verified_mask", "write_page"]
