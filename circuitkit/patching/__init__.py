"""Activation patching: public functions (api: ``patch``, the one entry, over the unit objects
of units), exact sweeps (engine; their orchestration: exact), gradient estimates
(attribution), screen then verify for any units (hybrid), the ``method="auto"`` choice (auto),
the sweep description (sweep), checkpoints, results.

Names resolve lazily so ``import circuitkit.patching`` stays free of torch.
"""

from __future__ import annotations

from circuitkit._lazy import lazy_exports

_EXPORTS = {
    "patch": "circuitkit.patching.api:patch",
    "HeadUnits": "circuitkit.patching.units:HeadUnits",
    "LayerUnits": "circuitkit.patching.units:LayerUnits",
    "EdgeUnits": "circuitkit.patching.units:EdgeUnits",
    "PathUnits": "circuitkit.patching.units:PathUnits",
    "HeadSetUnits": "circuitkit.patching.units:HeadSetUnits",
    "PatchOptions": "circuitkit.patching.units:PatchOptions",
    "MethodOptions": "circuitkit.patching.units:MethodOptions",
    "BudgetRule": "circuitkit.patching.units:BudgetRule",
    "patch_heads": "circuitkit.patching.api:patch_heads",
    "patch_layers": "circuitkit.patching.api:patch_layers",
    "plan_patch": "circuitkit.patching.api:plan_patch",
    "PatchResult": "circuitkit.patching.results:PatchResult",
    "patch_edges": "circuitkit.patching.api:patch_edges",
    "patch_paths": "circuitkit.patching.api:patch_paths",
    "EdgeResult": "circuitkit.patching.results:EdgeResult",
    "circuit": "circuitkit.patching.faithfulness:circuit",
    "CircuitOptions": "circuitkit.patching.units:CircuitOptions",
    "CircuitResult": "circuitkit.patching.results:CircuitResult",
    "PromptMetric": "circuitkit.metrics:PromptMetric",
    "token_logprob_metric": "circuitkit.metrics:token_logprob_metric",
    "token_margin_metric": "circuitkit.metrics:token_margin_metric",
    "verified_mask": "circuitkit.patching.results:verified_mask",
    "as_metric": "circuitkit.metrics:as_metric",
}


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
__all__ = sorted(_EXPORTS)
