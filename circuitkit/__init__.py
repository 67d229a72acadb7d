"""circuitkit: find how a transformer reasons over a huge label space, then distil that mechanism.

Importing this package is cheap: torch and transformer_lens load on first use of a function that
needs them (``ck.load_model`` ...), never at ``import circuitkit``.
"""

from __future__ import annotations

from circuitkit._lazy import lazy_exports
from circuitkit.patching import _EXPORTS as _PATCHING  # (lazy itself: no torch)

__version__ = "0.1.0"

# public name -> "module:attribute" (resolved lazily, PEP 562); the patching names as
# ``ck.patching`` exports them
_EXPORTS = {
    "load_model": "circuitkit.models:load_model",
    "save_model": "circuitkit.models:save_model",
    "ModelNotAvailableError": "circuitkit.models:ModelNotAvailableError",
    "load_task": "circuitkit.tasks:load_task",
    "Task": "circuitkit.tasks.base:Task",
    "Example": "circuitkit.tasks.base:Example",
    "evaluate": "circuitkit.evaluation:evaluate",
    **{name: _PATCHING[name] for name in (
        "PromptMetric", "as_metric", "patch", "HeadUnits", "LayerUnits", "EdgeUnits",
        "PathUnits", "HeadSetUnits", "PatchOptions", "MethodOptions", "BudgetRule",
        "patch_heads", "patch_layers", "plan_patch", "PatchResult", "patch_edges", "patch_paths",
        "EdgeResult", "circuit", "CircuitOptions", "CircuitResult")},
    "score_heads": "circuitkit.scoring.heads:score_heads",
    "validate_heads": "circuitkit.experiments.validation:validate_heads",
    "ablate_heads": "circuitkit.experiments.validation:ablate_heads",
}


# Subpackages and modules reachable as attributes (``ck.patching.PromptMetric``), still lazily.
_MODULES = ("hooks", "metrics", "models", "tasks", "evaluation", "patching", "files", "viz",
            "scoring", "distill", "experiments")
_EXPORTS.update({name: f"circuitkit.{name}" for name in _MODULES})
_EXPORTS["characterize"] = "circuitkit.experiments.characterize"  # the module, as before

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
__all__ = sorted(_EXPORTS)
