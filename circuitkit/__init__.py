"""circuitkit: find how a transformer reasons over a huge label space, then distil that mechanism.

Importing this package is cheap: torch and transformer_lens load on first use of a function that
needs them (``ck.load_model`` ...), never at ``import circuitkit``.
"""

from __future__ import annotations

from circuitkit._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> "module:attribute" (resolved lazily, PEP 562)
_EXPORTS = {
    "load_model": "circuitkit.models:load_model",
    "save_model": "circuitkit.models:save_model",
    "ModelNotAvailableError": "circuitkit.models:ModelNotAvailableError",
    "PromptMetric": "circuitkit.metrics:PromptMetric",
    "as_metric": "circuitkit.metrics:as_metric",
    "load_task": "circuitkit.tasks:load_task",
    "Task": "circuitkit.tasks.base:Task",
    "Example": "circuitkit.tasks.base:Example",
    "evaluate": "circuitkit.evaluation:evaluate",
    "patch": "circuitkit.patching.api:patch",
    "HeadUnits": "circuitkit.patching.units:HeadUnits",
    "LayerUnits": "circuitkit.patching.units:LayerUnits",
    "EdgeUnits": "circuitkit.patching.units:EdgeUnits",
    "MethodOptions": "circuitkit.patching.units:MethodOptions",
    "patch_heads": "circuitkit.patching.api:patch_heads",
    "patch_layers": "circuitkit.patching.api:patch_layers",
    "plan_patch": "circuitkit.patching.api:plan_patch",
    "PatchResult": "circuitkit.patching.results:PatchResult",
    "patch_edges": "circuitkit.patching.api:patch_edges",
    "patch_paths": "circuitkit.patching.paths:patch_paths",
    "EdgeResult": "circuitkit.patching.results:EdgeResult",
    "circuit": "circuitkit.patching.faithfulness:circuit",
    "CircuitResult": "circuitkit.patching.results:CircuitResult",
    "score_heads": "circuitkit.scoring.heads:score_heads",
    "validate_heads": "circuitkit.scoring.validate:validate_heads",
    "ablate_heads": "circuitkit.scoring.validate:ablate_heads",
}


# Subpackages and modules reachable as attributes (``ck.patching.PromptMetric``), still lazily.
_MODULES = ("hooks", "metrics", "models", "tasks", "evaluation", "patching", "files", "viz",
            "scoring", "characterize", "distill")
_EXPORTS.update({name: f"circuitkit.{name}" for name in _MODULES})

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
__all__ = sorted(_EXPORTS)
