"""What every kind of unit shares: ``MethodOptions`` (the options every method shares, one frozen
object; an option the chosen method does not use is said to do nothing, never dropped silently),
``as_units``, ``as_options`` and the checks the kinds call."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

from circuitkit.metrics import PromptMetric
from circuitkit.patching.exact import sweeps as exact
from circuitkit.patching.hybrid import check_max_passes
from circuitkit.patching.inputs import (
    METHODS,
    check_top_k,
    choice,
)
from circuitkit.patching.sweep import (
    length_order,
)

_STACK = 5  # warnings point at the caller of patch_heads / patch_edges (through ck.patch)


@dataclass(frozen=True)
class MethodOptions:
    """Options every method shares. ``estimator``: the attribution estimate (or the hybrid's
    screen; ``attribution.ESTIMATORS`` for heads, ``EDGE_ESTIMATORS`` for edges); ``atp_star``:
    AtP*'s Q/K fix (heads); ``ig_steps``: the eap-ig estimators' steps (edges); ``top_k`` /
    ``max_passes``: the cells ``attribution+exact`` (or ``auto``) verifies; ``screening_recall``:
    ``auto``'s extra screen on an exact run."""

    estimator: str | None = None
    top_k: int | None = None
    max_passes: float | None = None
    atp_star: bool = False
    ig_steps: int | None = None
    screening_recall: bool = False

    def given(self) -> list[str]:
        """The options set away from their defaults, in declaration order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]


def as_options(options: Any) -> MethodOptions:
    """``options``: None, a ``MethodOptions`` or a dict of its fields (one line otherwise)."""
    if options is None:
        return MethodOptions()
    if isinstance(options, MethodOptions):
        return options
    names = [f.name for f in fields(MethodOptions)]
    if isinstance(options, dict) and set(options) <= set(names):
        return MethodOptions(**options)
    raise ValueError(f"options={options!r}: expected ck.MethodOptions(...) or a dict of "
                     f"{names}.")


def _stray(method: str, opts: MethodOptions, allowed: dict[str, set[str]]) -> None:
    """Warn for options ``method`` does not use (a notebook loop may pass one set to all)."""
    stray = [g for g in opts.given() if g not in allowed.get(method, set())
             and g != "screening_recall"]  # a flag of auto's exact run, harmless elsewhere
    if stray:
        warnings.warn(
            f"{' and '.join(stray)} {'does' if len(stray) == 1 else 'do'} nothing with "
            f"method={method!r}: estimator and atp_star choose the estimate of method "
            "'attribution' or 'attribution+exact', top_k and max_passes the cells "
            "'attribution+exact' (or 'auto') verifies.", stacklevel=_STACK)


def unused_checkpoint(checkpoint: Any, what: str) -> None:
    if checkpoint is not None:
        warnings.warn(f"checkpoint={str(checkpoint)!r} is not used: {what} is not checkpointed "
                      "(exact sweeps and attribution+exact of the TransformerLens backend "
                      "are).", stacklevel=_STACK)


def _hybrid_options(method: str, opts: MethodOptions) -> None:
    check_top_k(opts.top_k)  # every entry, whatever the method (top_k=0 verified nothing)
    if method in ("attribution+exact", "auto"):
        check_max_passes(opts.max_passes, opts.top_k)


def _exact_only(method: str, opts: MethodOptions, backend: str, remote: bool, what: str,
                refusal: str) -> str:
    """The method of units patched exactly only ("auto" is "exact"): another one is
    ``refusal``, another backend a line naming ``what`` sweeps."""
    method = "exact" if method == "auto" else method  # the one choice
    choice("method", method, METHODS)
    if method != "exact":
        raise ValueError(refusal)
    _stray(method, opts, {})
    if backend != "transformer_lens" or remote:
        raise ValueError(f"backend={backend!r}: {what} sweeps run on the TransformerLens "
                         "backend only.")
    return method


class _Units:
    """What every kind shares: no entry work of its own, ``meta`` the task's hash, and the
    exact sweep of ``sweep`` (edges: their own engine)."""

    def checked(self, model: Any, clean: Tensor, corrupt: Tensor) -> Any:
        return self

    def meta(self, model: Any, task_hash: str | None) -> dict[str, Any]:
        return dict(task_hash=task_hash)

    def exact(self, model, clean, corrupt, pm, direction, batch_size, checkpoint, progress,
              meta) -> Any:
        sweep = self.sweep(model, direction, clean, pm)
        return exact.run(model, clean, corrupt, pm, sweep, batch_size, checkpoint, progress,
                         meta)[0]


def _read_share(metric: PromptMetric, clean: Tensor) -> float:
    """The share of prompt tokens up to each prompt's metric's last read (1: it reads all)."""
    _, lengths = length_order(metric)
    return 1.0 if lengths is None else sum(lengths) / clean.numel()

