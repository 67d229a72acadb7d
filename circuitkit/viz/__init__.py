"""Pictures of every result circuitkit computes: plotly figures, circuitsvis attention views, and a
self-contained ``report.html``.

Every chart function returns a ``plotly.graph_objects.Figure``; ``attention`` returns an
``AttentionView`` (renders in Jupyter, ``.html`` for embedding). Imports are lazy: importing
``circuitkit.viz`` loads neither plotly nor torch.
"""

from __future__ import annotations

from circuitkit._lazy import lazy_exports

_EXPORTS = {
    "patch_heatmap": "circuitkit.viz.heatmaps:patch_heatmap",
    "patch_heatmaps": "circuitkit.viz.heatmaps:patch_heatmaps",
    "edge_heatmap": "circuitkit.viz.heatmaps:edge_heatmap",
    "circuit_graph": "circuitkit.viz.edges:circuit_graph",
    "faithfulness_curve": "circuitkit.viz.edges:faithfulness_curve",
    "attention": "circuitkit.viz.attention:attention",
    "AttentionView": "circuitkit.viz.attention:AttentionView",
    "top_heads": "circuitkit.scoring.heads:top_heads",
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
__all__ = sorted(_EXPORTS)
