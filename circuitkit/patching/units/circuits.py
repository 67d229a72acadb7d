"""``ck.circuit``'s circuits on the exact road: ``CircuitUnits`` (which circuits and how the rest is
ablated; their entry checks, sweep, checkpoint identity and run through ``exact.sweeps.run_sweep``
with ``exact.circuits.CircuitEngine``) and ``CircuitOptions`` (how ``ck.circuit`` runs, one
frozen object, as ``PatchOptions`` is ``ck.patch``'s)."""

from __future__ import annotations

import functools
import hashlib
import numbers
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching.exact.circuits import CircuitEngine, circuit_rows, circuit_sweep
from circuitkit.patching.exact.head_sets import derangement
from circuitkit.patching.exact.sweeps import run_sweep
from circuitkit.patching.inputs import check_batch_size, check_edge_model
from circuitkit.patching.sweep import length_order


@dataclass(frozen=True)
class CircuitOptions:
    """How ``ck.circuit`` runs (it takes this, or a dict of its fields): ``n_boot`` (bootstrap
    resamples over prompts; 0: no intervals), ``seed`` (the bootstrap's, and the resample
    ablation's pairing of prompts), ``batch_size`` (sequences per forward; None: from free
    memory, halved on out-of-memory), ``checkpoint`` (a folder: finished circuits stored
    durably, a rerun of the same call resumes) and ``progress``."""

    n_boot: int = 1000
    seed: int = 0
    batch_size: int | None = None
    checkpoint: str | Path | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("n_boot", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"{name}={v!r}: expected a non-negative integer.")
        check_batch_size(self.batch_size)
        if not isinstance(self.progress, bool):
            raise ValueError(f"progress={self.progress!r}: expected True or False.")


def as_circuit_options(options: Any) -> CircuitOptions:
    """``options``: None, a ``CircuitOptions`` or a dict of its fields (one line otherwise)."""
    names = [f.name for f in fields(CircuitOptions)]
    if options is None:
        return CircuitOptions()
    if isinstance(options, CircuitOptions):
        return options
    if isinstance(options, dict) and set(options) <= set(names):
        return CircuitOptions(**options)
    bad = sorted(set(options) - set(names)) if isinstance(options, dict) else None
    raise ValueError(f"options={options!r}: expected ck.CircuitOptions(...) or a dict of "
                     f"{names}" + (f" (unknown: {bad})." if bad else "."))


class CircuitRuns(NamedTuple):
    """What the circuits' runs measured, in the caller's prompt order: each circuit's
    per-prompt metric ``per`` ``[n_circuits, n_prompts]``, the clean (``full``) and corrupt
    runs' ``[n_prompts]``, and the forwards this process ran."""

    per: Float[Tensor, "c n"]
    full: Float[Tensor, " n"]
    corrupt: Float[Tensor, " n"]
    forwards: int


@dataclass(frozen=True, eq=False)
class CircuitUnits:
    """The circuits of ``ck.circuit``: each row of ``kept`` (bool ``[n_circuits, n_items]``)
    keeps those items of ``graph`` (a ``results.CircuitGraph``), every other scored item is
    ablated by ``ablation`` ("corrupt", "zero", "position-mean", "resample": another prompt's,
    paired by ``seed``). ``patching/exact/circuits.py`` says how a circuit runs."""

    graph: Any
    kept: Bool[Tensor, "c n_items"]
    ablation: str = "corrupt"
    seed: int = 0
    facts: Any = field(default=None, compare=False, repr=False)  # the model's, once checked
    kind: ClassVar[str] = "circuits"
    axes: ClassVar[tuple[str, ...]] = ("circuit",)

    @staticmethod
    def entry() -> dict[str, Any]:
        """What the entry's checks (``api._check``) take of circuits: the ablated site is z;
        a probed metric's reads are checked on the real clean and corrupt logits."""
        return dict(site="z", positions="all", sites=hooks.PATCH_HEAD_SITES,
                    engine_checks=False)

    def checked(self, model: Any, clean: Tensor, corrupt: Tensor) -> CircuitUnits:
        """No post-norm block (``check_edge_model``); resample needs another prompt; the
        model's facts, taken once here and carried."""
        check_edge_model(model)
        if self.ablation == "resample" and clean.shape[0] < 2:
            raise ValueError("ablation='resample' takes another prompt's writes: it needs at "
                             "least 2 prompts.")
        return replace(self, facts=hooks.facts(model))

    def identity(self) -> dict[str, Any]:
        """What a checkpoint of these circuits must share beyond the sweep's (the model, tokens,
        metric): the graph's items and each circuit's kept set (a hash), the ablation and seed."""
        h = hashlib.sha256(f"{self.graph.kind}|{self.graph.n_items}|".encode())
        for cells in self.graph.cells:
            h.update(cells.long().numpy().tobytes())
        h.update(self.kept.numpy().tobytes())
        return dict(circuits=h.hexdigest()[:16], n_circuits=len(self.kept),
                    ablation=self.ablation, seed=self.seed)

    def exact(self, model: Any, clean: Tensor, corrupt: Tensor, pm: PromptMetric,
              opts: CircuitOptions) -> CircuitRuns:
        """Every circuit's run through ``run_sweep`` (prompts by length, chunks of circuits,
        ``opts``' checkpoint and progress), in the caller's prompt order."""
        n, seq = clean.shape
        order, lengths = length_order(pm)
        perm = None
        if self.ablation == "resample":  # the caller's pairing, in the sweep's prompt order
            perm = derangement(n, self.seed)
            if order is not None:
                perm = torch.argsort(order)[perm[order]]
        f = self.facts or hooks.facts(model)
        length = seq if lengths is None or not f.causal else max(lengths)
        rows = opts.batch_size or circuit_rows(model, length, f)
        swept = run_sweep(model, clean, corrupt, pm, circuit_sweep(len(self.kept), clean, pm),
                          replace(opts, batch_size=rows),
                          make_engine=functools.partial(CircuitEngine, circuits=self, perm=perm),
                          identity_extra=self.identity())
        engine = swept.engine
        per, full, bad = engine.metrics(swept.done), engine.base_metric, engine.source_metric
        if swept.order is not None:  # back to the caller's prompt order
            inv = torch.argsort(swept.order)
            per, full, bad = per[:, inv], full[inv], bad[inv]
        return CircuitRuns(per, full, bad, engine.forwards)

