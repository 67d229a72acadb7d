"""Activation patching: exact sweeps (engine), gradient estimates (attribution), results.

Names resolve lazily so ``import circuitkit.patching`` stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "patch_heads": "circuitkit.patching.engine",
    "patch_layers": "circuitkit.patching.engine",
    "plan_patch": "circuitkit.patching.engine",
    "PatchResult": "circuitkit.patching.results",
    "PromptMetric": "circuitkit.patching.metrics",
    "token_logprob_metric": "circuitkit.patching.metrics",
    "token_margin_metric": "circuitkit.patching.metrics",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'circuitkit.patching' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS)
