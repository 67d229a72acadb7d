"""Mechanistic distillation: teacher signals and their store (signals), L_CoT + L_P1 + L_P2
(loss: not ``losses``, which would shadow ``ck.distill.losses``), student training (train), the
ablation table (ablation). docs/distill.md. Names resolve lazily: no torch at import.
"""

from __future__ import annotations

from circuitkit._lazy import lazy_exports

_EXPORTS = {
    "losses": "circuitkit.distill.loss:losses",
    "LossConfig": "circuitkit.distill.loss:LossConfig",
    "train_student": "circuitkit.distill.train:train_student",
    "DistillConfig": "circuitkit.distill.train:DistillConfig",
    "build_store": "circuitkit.distill.signals:build_store",
    "SignalStore": "circuitkit.distill.signals:SignalStore",
    "StoreOptions": "circuitkit.distill.signals:StoreOptions",
    "Pooling": "circuitkit.distill.signals:Pooling",
}

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
__all__ = sorted(_EXPORTS)
