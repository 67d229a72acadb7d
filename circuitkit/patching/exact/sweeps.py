"""Orchestration of an exact sweep (heads, layers or edges): ``run_sweep``.

Flow: prompts sorted by the length their metric needs -> ``sweep.chunked`` (chunks) -> memory
fitted (``fit_rows``: cached runs and the heaviest chunk as a probe, rows halved on
out-of-memory) -> checkpoint opened and verified (``checkpoint.SweepCheckpoint``) -> this rank's
missing chunks computed (``compute``: each saved as it finishes, split on out-of-memory by
``chunk_fitting``, Ctrl-C saves and says how to resume) -> ranks merged (``distributed``) ->
``Swept``, its result in the caller's prompt order (``Swept.fields``, ``patch_result``).
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from circuitkit import hooks
from circuitkit.identity import model_fingerprint, sweep_identity, tokens_hash
from circuitkit.metrics import PromptMetric
from circuitkit.patching import distributed
from circuitkit.patching.checkpoint import SweepCheckpoint, default_dir
from circuitkit.patching.exact import ExactEngine
from circuitkit.patching.inputs import ReadsDoNotHold, checked_metric, without_probed_reads
from circuitkit.patching.results import PatchResult
from circuitkit.patching.sweep import (
    Chunk,
    Sweep,
    auto_rows,
    chunked,
    is_out_of_memory,
    length_order,
    make_path_sweep,
    make_set_sweep,
    make_sweep,
    release_cached_memory,
)


def whole_on_every_replica(what: str) -> None:
    """Under torchrun, say that this method is not split over the replicas."""
    if distributed.rank_world()[1] > 1:
        warnings.warn(f"{what} runs whole on every replica: only exact sweeps split their "
                      "chunks over torchrun's replicas. Run it in one process, or use "
                      "method='exact'.", stacklevel=3)


def described(meta: dict, metric: PromptMetric) -> dict:
    """The metric's labels (a task's metric: ``task``, ``phase``), the caller's meta entries
    that are set, and the metric's note when it has one."""
    out = dict(metric.labels)
    out.update({k: v for k, v in meta.items() if v is not None})
    if metric.note:
        out["metric_note"] = metric.note
    return out


def with_recorded(res: Any, model: Any, clean: Tensor, corrupt: Tensor) -> Any:
    """``res`` with what every result records of its model and prompts (an exact sweep's
    provenance; also attribution's and the hybrid's, so ``ck.circuit`` and strict loads can
    check them) added where its meta lacks it: ``model_fingerprint``, ``tokens_hash``,
    ``facts``, ``versions``. Each is computed only when missing (the fingerprint reads every
    weight; a hybrid that ran the exact sweep has it already)."""
    make = dict(model_fingerprint=lambda: model_fingerprint(model),
                tokens_hash=lambda: tokens_hash(clean, corrupt),
                facts=lambda: asdict(hooks.facts(model)), versions=versions)
    for k, f in make.items():
        if k not in res.meta:
            res.meta[k] = f()
    return res


def versions() -> dict[str, str]:
    """Installed versions of circuitkit, torch, transformer-lens and transformers (looked up
    once per process: the metadata lookup costs ~6 ms per call)."""
    return dict(_versions())


# circuitkit's distribution name (PyPI's "circuitkit" is another project); the import name is
# circuitkit. An install made before the rename is found under the old name, by its summary.
DIST_NAME = "circuitkit-tl"


@functools.cache
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, distribution, version

    out = {}
    for pkg in ("circuitkit", "torch", "transformer-lens", "transformers"):
        out[pkg] = "?"
        for name in ((DIST_NAME, "circuitkit") if pkg == "circuitkit" else (pkg,)):
            try:
                dist = distribution(name)
            except PackageNotFoundError:
                continue
            if name == pkg and pkg == "circuitkit" and "distil" not in (
                    dist.metadata.get("Summary") or ""):
                continue  # PyPI's other circuitkit
            out[pkg] = version(name)
            break
    return out


def run(model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric, sweep: Sweep,
        opts: Any, meta: dict) -> tuple[PatchResult, PromptMetric]:
    """The exact sweep, and the metric it ran with: a probed metric's reads are checked by the
    engine's cached runs (``inputs.ReadsDoNotHold``); where they do not hold, the sweep starts
    again reading every position (and right padding is checked for that metric). ``opts``: the
    ``PatchOptions`` (its batch size, checkpoint and progress)."""
    try:
        swept = run_sweep(model, clean, corrupt, metric, sweep, opts)
        metric = replace(metric, probed=False)
    except ReadsDoNotHold as e:
        metric = checked_metric(model, clean, corrupt, without_probed_reads(metric, e.which),
                                opts.batch_size)
        sweep = make_sweep(model, sweep.kind, sweep.site, sweep.direction,
                           sweep.groups if sweep.positions == "groups" else sweep.positions,
                           clean, metric)
        swept = run_sweep(model, clean, corrupt, metric, sweep, opts)
    return patch_result(model, swept, sweep, metric, meta), metric


def patch_result(model: Any, swept: Swept, sweep: Sweep, metric: PromptMetric,
                  meta: dict) -> PatchResult:
    """The ``PatchResult`` of a finished head or layer sweep."""
    extra = described(meta, metric)
    if sweep.positions == "groups":
        extra.update(group_meta(sweep.groups))
    # (axes: PatchResult's own, from the site, positions and values' shape)
    return PatchResult(direction=sweep.direction, site=sweep.site, positions=sweep.positions,
                       **swept.fields(model, metric, extra))


def group_meta(groups: Any) -> dict[str, Any]:
    """What a position-group result records: the group names, the masks' hash and each
    group's mean positions per prompt."""
    return dict(group_names=list(groups.names), groups_hash=groups.hash(),
                group_sizes=groups.sizes())


def run_edges(model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric, layout: Any,
              opts: Any, meta: dict) -> Any:
    """The exact edge sweep of ``layout`` (``EdgeEngine``; checkpoint identity: the sweep's plus
    the layout), as an ``EdgeResult`` in the caller's prompt order, with ``meta["coverage"]``:
    the share of each head sender's node effect its edges explain (``paths.edge_coverage_of``;
    the node runs are chunks of the same sweep, ``edges.edge_sweep``, on its cached runs)."""
    from circuitkit.patching.exact.edges import EdgeEngine, edge_sweep
    from circuitkit.patching.paths import edge_coverage_of
    from circuitkit.patching.results import EdgeResult

    direction = opts.direction
    sweep = edge_sweep(model, layout, direction, clean, metric)
    swept = run_sweep(model, clean, corrupt, metric, sweep, opts,
                      make_engine=functools.partial(EdgeEngine, layout=layout),
                      identity_extra=layout.to_dict())
    res = EdgeResult(direction=direction, senders=layout.senders, receivers=layout.receivers,
                     inputs=layout.inputs, n_layers=layout.n_layers, **swept.fields(
                         model, metric, dict(n_edges=layout.n_edges,
                                             **described(meta, metric))))
    if swept.engine.node_senders:
        res.meta["coverage"] = edge_coverage_of(res, swept.engine.node_effects_of(swept.done))
    return res


def run_paths(model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric, layout: Any,
              groups: Any, opts: Any, meta: dict) -> PatchResult:
    """The exact path sweep of ``layout`` (``PathEngine``; ``groups``: checked position groups
    or None; checkpoint identity: the sweep's plus the layout) as a ``PatchResult`` over
    ``(sender, receiver(, group))`` in the caller's prompt order, with each sender's node effect
    and the paths' ``coverage`` of it (``paths.node_effects``, ``paths.coverage``)."""
    from circuitkit.patching.exact.paths import PathEngine
    from circuitkit.patching.paths import coverage

    direction = opts.direction
    sweep = make_path_sweep(layout, direction, clean, metric, groups)
    swept = run_sweep(model, clean, corrupt, metric, sweep, opts,
                      make_engine=functools.partial(PathEngine, layout=layout),
                      identity_extra=layout.to_dict())
    fields = swept.fields(model, metric, described(meta, metric))
    names = ["all"] if groups is None else list(groups.names)
    node = swept.engine.node_effects()  # (the sweep's own cached runs: its base is the same)
    base = fields["corrupt"] if direction == "denoise" else fields["clean"]
    from circuitkit.patching.results.patch_result import noise_floor

    # the degenerate-baseline rule: a node effect within rounding is no whole to share
    margin = noise_floor(fields["clean"], fields["corrupt"])
    fields["meta"].update(
        kind="paths", senders=[hooks.head_name(*s) for s in layout.senders],
        receivers=[hooks.head_name(*r) for r in layout.receivers], inputs=list(layout.inputs),
        node={hooks.head_name(*s): float(v) for s, v in zip(layout.senders, node, strict=True)},
        coverage=coverage(fields["values"] - base, node, layout.senders, names, margin))
    if groups is None:
        fields["values"] = fields["values"][..., 0]
        if fields["per_prompt"] is not None:
            fields["per_prompt"] = fields["per_prompt"][..., 0]
    else:
        fields["meta"]["path_groups"] = names
    axes = ("sender", "receiver") + (() if groups is None else ("group",))
    return PatchResult(direction=direction, site="z", positions="all", axes=axes, **fields)


def run_sets(model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric, layout: Any,
             opts: Any, meta: dict) -> PatchResult:
    """The exact sweep of the head sets of ``layout`` (``sweep.SetLayout``; ``HeadSetEngine``;
    checkpoint identity: the sweep's plus ``layout.identity``) as a ``PatchResult`` over
    ``("set",)`` in the caller's prompt order: ``values [n_sets]`` and ``per_prompt [n_prompts,
    n_sets]`` of ``metric``; ``meta``: ``kind`` "head_sets", ``sets``, ``set_source``,
    ``set_seed`` and ``extra_per_prompt`` (``{name: [n_prompts, n_sets]}`` of each of
    ``layout.metrics``, read on the same patched logits). A probed metric's reads that do not
    hold: the sweep starts again reading every position (as ``run``)."""
    from circuitkit.patching.exact.set_engine import HeadSetEngine

    n, seq = clean.shape
    extra = functools.partial(layout.identity, n, seq, hooks.facts(model).d_vocab_out)

    def swept_with(m: PromptMetric) -> Swept:
        sweep = make_set_sweep(model, layout, opts.direction, clean, m)
        return run_sweep(model, clean, corrupt, m, sweep, opts, make_engine=HeadSetEngine,
                         identity_extra=extra)

    try:
        swept = swept_with(metric)
        metric = replace(metric, probed=False)
    except ReadsDoNotHold as e:
        metric = checked_metric(model, clean, corrupt, without_probed_reads(metric, e.which),
                                opts.batch_size)
        swept = swept_with(metric)
    fields = swept.fields(model, metric, described(meta, metric))
    every = swept.engine.per_metric(swept.done)  # [n_reads, n_prompts (sweep order), n_sets]
    if swept.order is not None:
        every = every[:, torch.argsort(swept.order)]
    fields["meta"].update(kind="head_sets", sets=[[list(h) for h in s] for s in layout.sets],
                          set_source=layout.source, set_seed=layout.seed,
                          extra_per_prompt={m.name: every[i + 1]
                                            for i, m in enumerate(layout.metrics)})
    return PatchResult(direction=opts.direction, site=layout.site, positions="all",
                       axes=("set",), **fields)


class Swept(NamedTuple):
    """A finished exact sweep (``run_sweep``): its engine, every chunk's values, the prompt order
    it ran in (None: the caller's) and what the run recorded."""

    engine: Any
    done: dict[int, Tensor]
    order: Tensor | None
    info: dict[str, Any]

    def fields(self, model: Any, metric: PromptMetric, meta: dict) -> dict[str, Any]:
        """The result's values, baselines and per-prompt values (where the metric has them), in
        the caller's prompt order, and ``meta`` after what every exact result records."""
        values, per_prompt = self.engine.assemble(self.done)
        clean_pp, corrupt_pp = self.engine.clean_metric, self.engine.corrupt_metric
        if self.order is not None:  # back to the caller's prompt order
            inv = torch.argsort(self.order)
            clean_pp, corrupt_pp = clean_pp[inv], corrupt_pp[inv]
            per_prompt = None if per_prompt is None else per_prompt[inv]
        pp = metric.per_prompt_values
        return dict(values=values, clean=float(clean_pp.mean()), corrupt=float(corrupt_pp.mean()),
                    method="exact", per_prompt=per_prompt,
                    clean_per_prompt=clean_pp if pp else None,
                    corrupt_per_prompt=corrupt_pp if pp else None,
                    meta=dict(model=str(getattr(model.cfg, "model_name", "")), **self.info,
                              versions=versions(), facts=asdict(hooks.facts(model)), **meta))


def run_sweep(model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric, sweep: Sweep,
              opts: Any, make_engine: Any = ExactEngine, identity_extra: Any = None) -> Swept:
    """Run every chunk of ``sweep`` with an engine from ``make_engine`` (``ExactEngine`` or
    ``EdgeEngine``): prompts sorted by length, memory fitted, checkpoint opened (its identity:
    ``sweep_identity`` plus ``identity_extra``, a dict or a function giving it), this rank's
    chunks computed and saved, ranks merged. ``opts``: the run's options (``PatchOptions`` or
    another with ``batch_size``, ``checkpoint`` and ``progress``)."""
    batch_size, checkpoint, progress = opts.batch_size, opts.checkpoint, opts.progress
    t_start = time.perf_counter()
    rank, world = distributed.rank_world()
    # The identity (with the metric's behaviour hash, 10-40 ms) is only needed to open a
    # checkpoint, or to save one on Ctrl-C; a plain sweep never pays for it.
    identity = functools.cache(functools.partial(_identity, model, sweep, clean, corrupt,
                                                 metric, identity_extra))
    fingerprints = dict(model_fingerprint=model_fingerprint(model),
                        tokens_hash=tokens_hash(clean, corrupt))
    # The sweep runs on prompts sorted by length; results are put back in the caller's order.
    rows = batch_size or auto_rows(model, sweep.seq)
    order, lengths = length_order(metric)
    if order is not None:
        clean, corrupt, metric = clean[order], corrupt[order], metric.select(order)
        if sweep.groups is not None:  # each prompt keeps its own positions
            sweep = replace(sweep, groups=sweep.groups.reordered(order))
        if sweep.sets is not None:  # (a head-set sweep's other metrics, too)
            sweep = replace(sweep, sets=sweep.sets.reordered(order))
    stored = SweepCheckpoint.stored_chunks(checkpoint) if checkpoint is not None else None
    what = "edges" if sweep.kind == "edges" else "head sets" if sweep.sets else "patch"
    bar = Progress(progress and rank == 0, f"{what} {sweep.site} {sweep.direction}")
    engine, sweep, rows, first, backoffs = fit_rows(
        functools.partial(make_engine, model, clean, corrupt, metric), sweep, rows, lengths,
        stored, bar=bar)
    if world > 1 and stored is None:  # every rank must cut the sweep into the same chunks
        agreed = distributed.agreed_min(rows)
        if agreed < rows:
            rows, first = agreed, {}
            sweep = engine.sweep = chunked(sweep, rows, lengths)
            bar.close()  # a new plan: the bar restarts over its chunks
    ckpt = None
    if checkpoint is not None:
        ckpt = SweepCheckpoint.open(checkpoint, identity(), sweep.chunks, rank=rank,
                                    world=world)
        sweep = engine.sweep = replace(sweep, chunks=ckpt.chunks)  # a resume keeps its plan
    try:
        done: dict[int, Tensor] = ckpt.load_done() if ckpt else {}
        mine = [c for c in range(len(sweep.chunks)) if c % world == rank and c not in done]
        first = {c: t for c, t in first.items() if c in mine}  # the probe's chunk, if ours
        if ckpt is not None:
            for cid, t in first.items():
                ckpt.save_chunk(cid, t)
        if ckpt is not None and done and progress and rank == 0:
            print(f"resumed {len(done)} of {len(sweep.chunks)} chunks from {ckpt.path}",
                  file=sys.stderr)
        splits = [0]
        computed = compute(engine, sweep, [c for c in mine if c not in first], ckpt, identity,
                            bar, n_done=len(done), splits=splits, computed=first)
    finally:
        if ckpt is not None:
            ckpt.close()
    done.update(computed)
    if world > 1:
        done.update(distributed.all_gather_chunks(computed))
    info = dict(**fingerprints, metric=metric.name, n_prompts=sweep.n_prompts, seq=sweep.seq,
                n_chunks=len(sweep.chunks), world=world, rows=rows, oom_backoffs=backoffs,
                oom_chunk_splits=splits[0], seconds=time.perf_counter() - t_start)
    return Swept(engine, done, order, info)


def _identity(model: Any, sweep: Sweep, clean: Tensor, corrupt: Tensor, metric: PromptMetric,
              extra: dict | Callable[[], dict] | None) -> dict[str, Any]:
    """``sweep_identity`` plus ``extra`` (a dict, or a function giving it: a head-set sweep's
    extra metrics' behaviour hashes are computed only when the identity is needed)."""
    extra = extra() if callable(extra) else extra
    return sweep_identity(model, sweep, clean, corrupt, metric, **(extra or {}))


def heaviest(sweep: Sweep) -> int:
    """The chunk needing the most activation memory: most sequences x longest run."""
    return max(range(len(sweep.chunks)), key=lambda c: sweep.chunk_prompts(sweep.chunks[c])
               * sweep.run_length(sweep.chunks[c].p0, sweep.chunks[c].p1))


def fit_rows(new_engine: Callable[..., Any], sweep: Sweep, rows: int, lengths: list[int] | None,
             stored: tuple[Chunk, ...] | None, timing: dict[str, float] | None = None,
             bar: Progress | None = None) -> tuple[ExactEngine, Sweep, int, dict[int, Tensor], int]:
    """An engine and a plan that fit in memory: the cached runs, then the heaviest chunk run as
    a probe; on out-of-memory ``rows`` is halved, the sweep re-planned and both retried.
    ``new_engine(planned, rows=rows)``: the engine of a planned sweep (its cached runs made;
    e.g. ``functools.partial(ExactEngine, model, clean, corrupt, metric)``). Returns (engine,
    planned sweep, rows, {probe chunk: its result}, back-offs). A plan fixed by a checkpoint
    (``stored``) is kept (no probe: ``chunk_fitting`` splits a chunk that does not fit).
    ``timing``: filled with the seconds of the cached runs and of the probe. ``bar``: opened on
    the plan's chunks of this rank (``distributed.rank_world``) before the probe runs, so it
    starts at 0 and counts the probe's chunk when it is this rank's."""
    backoffs = 0
    timing = {} if timing is None else timing
    while True:
        planned = chunked(sweep, rows, lengths)
        if stored is not None:
            planned = replace(planned, chunks=stored)
        oom = None
        try:
            t0 = time.perf_counter()
            engine = new_engine(planned, rows=rows)
            t1 = time.perf_counter()
            first = {}
            if stored is None and planned.chunks:
                cid = heaviest(planned)
                if bar is not None:
                    rank, world = distributed.rank_world()
                    bar.open(sum(planned.chunk_prompts(c) for i, c in
                                 enumerate(planned.chunks) if i % world == rank))
                first[cid] = engine.run_chunk(planned.chunks[cid])
                if bar is not None and cid % world == rank:
                    bar.update(planned.chunk_prompts(planned.chunks[cid]))
            timing.update(cached=t1 - t0, probe=time.perf_counter() - t1)
            return engine, planned, rows, first, backoffs
        except Exception as e:  # noqa: BLE001 - only out-of-memory is retried
            if not is_out_of_memory(e) or rows <= 1:
                raise
            oom = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        # (out of the except block: the traceback's frames, holding activations, are gone)
        engine = None
        release_cached_memory()
        backoffs += 1
        warnings.warn(f"circuitkit: out of memory with {rows} sequences per forward ({oom}); "
                      f"retrying with {max(1, rows // 2)}.", stacklevel=3)
        rows = max(1, rows // 2)


def chunk_fitting(engine: ExactEngine, chunk: Chunk, splits: list[int]) -> Tensor:
    """``engine.run_chunk(chunk)``; on out-of-memory the chunk's variants (then prompts, when
    the metric has per-prompt values) are halved and each half run the same way. The plan is
    unchanged, so a checkpoint stays valid; each half computes the same rows."""
    err = None
    try:
        return engine.run_chunk(chunk)
    except Exception as e:  # noqa: BLE001 - only out-of-memory is split
        if not is_out_of_memory(e):
            raise
        err = e
    release_cached_memory()
    c = Chunk(*chunk)
    splits[0] += 1
    if c.v1 - c.v0 > 1:
        m = (c.v0 + c.v1) // 2
        return torch.cat([chunk_fitting(engine, c._replace(v1=m), splits),
                          chunk_fitting(engine, c._replace(v0=m), splits)], 0)
    if c.p1 - c.p0 > 1 and engine.sweep.split_prompts:
        m = (c.p0 + c.p1) // 2
        return torch.cat([chunk_fitting(engine, c._replace(p1=m), splits),
                          chunk_fitting(engine, c._replace(p0=m), splits)], 1)
    raise err


class Progress:
    """A sweep's progress bar (tqdm over patched prompts), opened once the plan is known: before
    the memory probe runs, so it starts at 0 (it used to open after the probe, at ~16%)."""

    def __init__(self, show: bool, desc: str):
        self.show, self.desc, self.bar = show, desc, None

    def open(self, total: int) -> None:
        if not self.show:
            return
        if self.bar is None:
            from circuitkit._progress import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit="patched-prompt",
                            dynamic_ncols=True, file=sys.stderr)
        else:  # re-planned (out of memory): the same bar, from 0 over the new chunks
            self.bar.reset(total=total)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:  # (a later open starts a new bar)
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def compute(engine: ExactEngine, sweep: Sweep, mine: list[int], ckpt: SweepCheckpoint | None,
             identity: Callable[[], dict], bar: Progress, n_done: int, splits: list[int],
             computed: dict[int, Tensor]) -> dict[int, Tensor]:
    """This rank's chunks, each saved as it finishes; Ctrl-C saves what was computed (to a
    default folder when the sweep had none) and says how to resume. ``bar``: opened here
    unless the memory probe opened it (then it has counted the probe's chunk)."""
    if bar.bar is None:
        bar.open(sum(sweep.chunk_prompts(sweep.chunks[c]) for c in [*computed, *mine]))
        bar.update(sum(sweep.chunk_prompts(sweep.chunks[c]) for c in computed))
    computed = dict(computed)
    try:
        for cid in mine:
            computed[cid] = chunk_fitting(engine, sweep.chunks[cid], splits)
            if ckpt is not None:
                ckpt.save_chunk(cid, computed[cid])
            bar.update(sweep.chunk_prompts(sweep.chunks[cid]))
    except KeyboardInterrupt:
        named = ckpt is not None  # the caller chose the folder: it knows how to resume
        if ckpt is None and computed:
            ckpt = SweepCheckpoint.open(default_dir(identity()), identity(), sweep.chunks)
            for cid, t in computed.items():
                ckpt.save_chunk(cid, t)
            ckpt.close()
        if ckpt is not None:
            print(f"\ninterrupted: {n_done + len(computed)}/{len(sweep.chunks)} chunks saved in "
                  f"{ckpt.path}" + ("." if named else f"; rerun the same call with "
                                    f"checkpoint={str(ckpt.path)!r} to resume."), file=sys.stderr)
        raise
    finally:
        bar.close()
    return computed

