"""The paper's experiments, above the core: each a runner built from the core's public pieces
(models, metrics, tasks, ``ck.patch``, scoring, distill, evaluation, viz). The core never imports
this package (``tests/test_import_graph.py``). Names resolve lazily: no torch at import.
"""

from __future__ import annotations

from circuitkit._lazy import lazy_exports

_EXPORTS = {
    "characterize": "circuitkit.experiments.characterize:characterize",
    "CharacterizeOptions": "circuitkit.experiments.characterize:CharacterizeOptions",
    "GridOptions": "circuitkit.experiments.distill_grid:GridOptions",
    "validate_heads": "circuitkit.experiments.validation:validate_heads",
    "ablate_heads": "circuitkit.experiments.validation:ablate_heads",
    "cumulative_bins": "circuitkit.experiments.bins:cumulative_bins",
    "run_ablation": "circuitkit.experiments.distill_grid:run_ablation",
    "write_report": "circuitkit.experiments.report:write_report",
    "findings": "circuitkit.experiments.findings:findings",
    "score_scatter": "circuitkit.experiments.charts:score_scatter",
    "phase_profile": "circuitkit.experiments.charts:phase_profile",
    "validation_chart": "circuitkit.experiments.charts:validation_chart",
    "ablation_chart": "circuitkit.experiments.charts:ablation_chart",
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
__all__ = sorted(_EXPORTS)
