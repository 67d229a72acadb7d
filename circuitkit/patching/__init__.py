"""Activation patching: exact sweeps (engine), gradient estimates (attribution), results.

Names resolve lazily so ``import circuitkit.patching`` stays free of torch.
"""

from __future__ import annotations

from circuitkit._lazy import lazy_exports

_EXPORTS = {
    "patch_heads": "circuitkit.patching.engine:patch_heads",
    "patch_layers": "circuitkit.patching.engine:patch_layers",
    "plan_patch": "circuitkit.patching.engine:plan_patch",
    "PatchResult": "circuitkit.patching.results:PatchResult",
    "PromptMetric": "circuitkit.metrics:PromptMetric",
    "token_logprob_metric": "circuitkit.metrics:token_logprob_metric",
    "token_margin_metric": "circuitkit.metrics:token_margin_metric",
    "attribution_patch_heads": "circuitkit.patching.attribution:attribution_patch_heads",
    "attribution_plus_exact": "circuitkit.patching.attribution:attribution_plus_exact",
}


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
__all__ = sorted(_EXPORTS)
