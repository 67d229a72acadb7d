"""What every kind of unit shares: ``PatchOptions`` (how ``ck.patch`` runs: the run settings and
the method's options, one frozen object; an option the chosen method does not use is said to do
nothing, never dropped silently), ``BudgetRule`` (attribution+exact's automatic budget, one of
those options), ``as_options`` and the checks the kinds call."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from torch import Tensor

from circuitkit.metrics import PromptMetric
from circuitkit.patching.exact import sweeps as exact
from circuitkit.patching.hybrid import RULE, check_max_passes, check_rule
from circuitkit.patching.inputs import (
    DIRECTIONS,
    METHODS,
    check_batch_size,
    check_top_k,
    choice,
)
from circuitkit.patching.sweep import (
    length_order,
)

_STACK = 5  # warnings point at the caller of patch_heads / patch_edges (through ck.patch)


RUN_FIELDS = ("direction", "batch_size", "checkpoint", "progress", "backend", "remote",
              "task_hash")  # how a run goes; the rest choose the method's estimate and budget


@dataclass(frozen=True)
class BudgetRule:
    """How many cells ``method="attribution+exact"`` verifies when ``top_k`` is not given
    (``hybrid.budget_rule``; docs/attribution.md, "Screening"): rounds of one layer's cells,
    by largest ``|estimate| + k u`` (``k``: the ``quantile`` of ``|exact - estimate| / u`` over
    the verified cells, ``u`` the error unit), until no unverified cell can reach the
    ``recall_top``-th largest verified ``|effect|``, or ``max_fraction`` of the cells are
    verified. ``exact_when_cheaper``: where this budget is predicted to cost at least the exact
    sweep, run the exact sweep instead (False: run the hybrid anyway; a warning says it costs
    more). ``PatchOptions(budget=BudgetRule(...))``; a dict of its fields is taken too."""

    recall_top: int = RULE["recall_top"]
    quantile: float = RULE["quantile"]
    max_fraction: float = RULE["max_fraction"]
    exact_when_cheaper: bool = True

    def __post_init__(self) -> None:
        check_rule(None, None, self.recall_top, self.quantile, self.max_fraction)
        if not isinstance(self.exact_when_cheaper, bool):
            raise ValueError(f"exact_when_cheaper={self.exact_when_cheaper!r}: expected True or "
                             "False.")

    def rule(self) -> dict[str, Any]:
        """The keywords of ``hybrid.screen_then_verify``'s rule."""
        return dict(recall_top=self.recall_top, quantile=self.quantile,
                    max_fraction=self.max_fraction)


@dataclass(frozen=True)
class PatchOptions:
    """How ``ck.patch`` runs, one frozen object (``ck.patch`` takes it as ``options``; a dict of
    its fields is taken too).

    Run settings: ``direction`` ("denoise": each cell's clean activation into the corrupt run;
    "noise": its corrupt activation into the clean run); ``batch_size`` (sequences per forward;
    None: from free memory, halved on out-of-memory); ``checkpoint`` (a folder: finished chunks
    stored durably, a rerun resumes); ``progress``; ``backend`` ("transformer_lens" or
    "nnsight") and ``remote`` (nnsight on NDIF); ``task_hash`` (recorded in the result).

    The method's options: ``estimator`` (the attribution estimate or the hybrid's screen;
    ``attribution.ESTIMATORS`` for heads, ``EDGE_ESTIMATORS`` for edges); ``atp_star`` (AtP*'s
    Q/K fix, heads); ``ig_steps`` (the eap-ig estimators' steps, edges); ``top_k`` /
    ``max_passes`` (the cells ``attribution+exact`` or ``auto`` verifies); ``budget``
    (``attribution+exact``'s automatic budget without ``top_k``: a ``BudgetRule`` or a dict of its
    fields); ``screening_recall`` (``auto``'s extra screen of an exact run). One the chosen
    method does not use is said to do nothing (a warning), never dropped silently."""

    direction: str = "denoise"
    batch_size: int | None = None
    checkpoint: str | Path | None = None
    progress: bool = True
    backend: str = "transformer_lens"
    remote: bool = False
    task_hash: str | None = None
    estimator: str | None = None
    top_k: int | None = None
    max_passes: float | None = None
    atp_star: bool = False
    ig_steps: int | None = None
    screening_recall: bool = False
    budget: BudgetRule = BudgetRule()

    def __post_init__(self) -> None:
        rule = [f.name for f in fields(BudgetRule)]
        if isinstance(self.budget, dict) and set(self.budget) <= set(rule):
            object.__setattr__(self, "budget", BudgetRule(**self.budget))  # (frozen: here only)
        elif not isinstance(self.budget, BudgetRule):
            raise ValueError(f"budget={self.budget!r}: expected ck.BudgetRule(...) or a dict of "
                             f"{rule}.")
        choice("direction", self.direction, DIRECTIONS)
        check_batch_size(self.batch_size)
        for name in ("progress", "remote", "atp_star", "screening_recall"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected True or False.")

    def given(self) -> list[str]:
        """The method's options set away from their defaults, in declaration order."""
        return [f.name for f in fields(self) if f.name not in RUN_FIELDS
                and getattr(self, f.name) != f.default]


MethodOptions = PatchOptions  # its name before the run settings joined it (same object)


def as_options(options: Any, **explicit: Any) -> PatchOptions:
    """``options``: None, a ``PatchOptions`` or a dict of its fields (one line otherwise),
    with ``explicit`` keywords of a thin wrapper (``patch_heads(direction=...)``) folded in:
    a wrapper's keyword and the same field of ``options`` set to two values is one line."""
    names = [f.name for f in fields(PatchOptions)]
    if options is None:
        options = PatchOptions()
    elif isinstance(options, dict) and set(options) <= set(names):
        options = PatchOptions(**options)
    elif not isinstance(options, PatchOptions):
        bad = sorted(set(options) - set(names)) if isinstance(options, dict) else None
        raise ValueError(f"options={options!r}: expected ck.PatchOptions(...) or a dict of "
                         f"{names}" + (f" (unknown: {bad})." if bad else "."))
    defaults = PatchOptions()
    for name, value in explicit.items():
        mine = getattr(options, name)
        if value != getattr(defaults, name) and mine != getattr(defaults, name) and mine != value:
            raise ValueError(f"{name}={value!r} and options.{name}={mine!r}: give it once.")
    moved = {k: v for k, v in explicit.items() if v != getattr(defaults, k)}
    return replace(options, **moved) if moved else options


def _stray(method: str, opts: PatchOptions, allowed: dict[str, set[str]]) -> None:
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
                      "(exact sweeps, either backend, and attribution+exact are).",
                      stacklevel=_STACK)


def _hybrid_options(method: str, opts: PatchOptions) -> None:
    check_top_k(opts.top_k)  # every entry, whatever the method (top_k=0 verified nothing)
    if method in ("attribution+exact", "auto"):
        check_max_passes(opts.max_passes, opts.top_k)


def _exact_only(method: str, opts: PatchOptions, what: str, refusal: str) -> str:
    """The method of units patched exactly only ("auto" is "exact"): another one is
    ``refusal``, another backend a line naming ``what`` sweeps."""
    method = "exact" if method == "auto" else method  # the one choice
    choice("method", method, METHODS)
    if method != "exact":
        raise ValueError(refusal)
    _stray(method, opts, {})
    if opts.backend != "transformer_lens" or opts.remote:
        raise ValueError(f"backend={opts.backend!r}: {what} sweeps run on the TransformerLens "
                         "backend only.")
    return method


class _Units:
    """What every kind shares: no entry work of its own, ``meta`` the task's hash, and the
    exact sweep of ``sweep`` (edges: their own engine)."""

    def checked(self, model: Any, clean: Tensor, corrupt: Tensor) -> Any:
        return self

    def meta(self, model: Any, task_hash: str | None) -> dict[str, Any]:
        return dict(task_hash=task_hash)

    def exact(self, model, clean, corrupt, pm, opts: PatchOptions, meta) -> Any:
        sweep = self.sweep(model, opts.direction, clean, pm)
        return exact.run(model, clean, corrupt, pm, sweep, opts, meta)[0]


def _read_share(metric: PromptMetric, clean: Tensor) -> float:
    """The share of prompt tokens up to each prompt's metric's last read (1: it reads all)."""
    _, lengths = length_order(metric)
    return 1.0 if lengths is None else sum(lengths) / clean.numel()

