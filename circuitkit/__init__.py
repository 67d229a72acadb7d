"""circuitkit: find how a transformer reasons over a huge label space, then distil that mechanism.

Importing this package is cheap: torch and transformer_lens load on first use of a function that
needs them (``ck.load_model`` ...), never at ``import circuitkit``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attribute" (resolved lazily, PEP 562)
_EXPORTS = {
    "load_model": "circuitkit.models:load_model",
    "ModelNotAvailableError": "circuitkit.models:ModelNotAvailableError",
    "hooks": "circuitkit.hooks",
    "load_task": "circuitkit.tasks:load_task",
    "Task": "circuitkit.tasks.base:Task",
    "Example": "circuitkit.tasks.base:Example",
    "evaluate": "circuitkit.evaluate:evaluate",
    "patch_heads": "circuitkit.patching.engine:patch_heads",
    "patch_layers": "circuitkit.patching.engine:patch_layers",
    "PatchResult": "circuitkit.patching.results:PatchResult",
}


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'circuitkit' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = importlib.import_module(module)
    if attr:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
