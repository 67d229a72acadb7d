"""What a sweep patches and how the work is cut: ``Sweep`` (frozen), ``Chunk``, memory sizing.

A sweep patches ``n_layers`` layers x ``n_units`` units (heads, or 1 for a layer site) x ``n_pos``
positions (``seq`` for per-position sweeps, else 1) over ``n_prompts`` prompts. A *variant* is one
(unit, position) of one layer, laid out unit-major: ``v = unit * n_pos + pos``.

The work is cut into ``Chunk``s: one layer, a range of variants, a range of prompts, at most
``rows`` sequences per forward. Chunks are independent, which is what makes checkpointing and
sharding across ranks simple and bit-reproducible: the plan is fixed up front and stored with a
checkpoint, and a chunk's numbers never depend on who computes it. A causal model's prompt needs
only ``last read + 1`` positions (its ``length``): prompts are swept in that order
(``length_order``), and chunks of short prompts stop early.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from jaxtyping import Int
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric

MAX_ROWS = 1024  # cap on sequences per forward: bigger batches gain nothing and hurt latency


class Chunk(NamedTuple):
    """Variants ``v0:v1`` of ``layer`` on prompts ``p0:p1`` (sweep order), one forward."""

    layer: int
    v0: int
    v1: int
    p0: int
    p1: int


@dataclass(frozen=True)
class Sweep:
    """What to patch; ``chunks`` and ``lengths`` are set by ``plan``."""

    kind: str  # "heads" | "layers" | "edges"
    site: str
    direction: str  # "denoise" | "noise"
    positions: str  # "all" | "each" | "groups"
    n_layers: int
    n_units: int
    n_pos: int
    n_prompts: int
    seq: int
    split_prompts: bool  # the metric has per-prompt values, so prompts may go to different chunks
    chunks: tuple[Chunk, ...] = ()
    lengths: tuple[int, ...] | None = None  # positions each prompt (sweep order) needs
    # variants per layer when layers differ (an edge sweep: a receiver layer has as many
    # senders as there are nodes before it); None: every layer has n_variants
    layer_variants: tuple[int, ...] | None = None
    # positions "groups": the position groups (``groups.PositionGroups``), in the sweep's prompt
    # order once ``run_sweep`` sorted the prompts; a variant's "pos" is then its group index
    groups: Any = field(default=None, compare=False)
    # a head-set sweep (``HeadSetUnits``): its ``SetLayout`` (its metrics in the sweep's prompt
    # order once ``run_sweep`` sorted the prompts); a variant is one (set, metric read) pair
    sets: Any = field(default=None, compare=False)

    @property
    def n_variants(self) -> int:
        return self.n_units * self.n_pos

    @property
    def per_patch(self) -> int:
        """Variants one patched run gives: 1, or a head-set sweep's metrics read on its logits
        (its chunks hold whole sets: ``chunked``)."""
        return 1 if self.sets is None else self.sets.n_reads

    def variants_at(self, layer: int) -> int:
        """Variants of ``layer``: ``layer_variants[layer]``, or ``n_variants``."""
        return self.n_variants if self.layer_variants is None else self.layer_variants[layer]

    def variant(self, v: int) -> tuple[int, int | None]:
        """Variant index -> (unit, pos or None); positions "groups": (unit, group index)."""
        unit, pos = divmod(v, self.n_pos)
        return unit, (pos if self.positions in ("each", "groups") else None)

    def value_shape(self) -> tuple[int, ...]:
        if self.kind == "layers":
            return (self.n_layers, self.n_pos)
        if self.positions in ("each", "groups"):
            return (self.n_layers, self.n_units, self.n_pos)
        return (self.n_layers, self.n_units)

    def run_length(self, p0: int, p1: int) -> int:
        """Positions a forward over prompts ``p0:p1`` must compute (their longest length)."""
        return max(self.lengths[p0:p1]) if self.lengths else self.seq

    def chunk_cost(self, chunk: Chunk) -> int:
        """Work of a chunk in token-blocks: rows x positions x blocks run."""
        return (self.chunk_prompts(chunk) * self.run_length(chunk.p0, chunk.p1)
                * (self.n_layers - chunk.layer))

    def chunk_prompts(self, chunk: Chunk) -> int:
        """Patched prompts a chunk computes, its rows (the progress bar's unit)."""
        return (chunk.v1 - chunk.v0) // self.per_patch * (chunk.p1 - chunk.p0)


def make_sweep(model: Any, kind: str, site: str, direction: str, positions: Any,
               tokens: Tensor, metric: PromptMetric) -> Sweep:
    """The one constructor of a ``Sweep`` (unplanned) for ``tokens`` ``[n_prompts, seq]``;
    ``positions``: "all", "each" or checked position groups (``groups.PositionGroups``)."""
    f = hooks.facts(model)
    n, seq = tokens.shape
    n_units = f.n_heads_at(site) if kind == "heads" else 1
    if not isinstance(positions, str):  # position groups: one variant per (unit, group)
        return Sweep(kind, site, direction, "groups", f.n_layers, n_units, len(positions), n,
                     seq, metric.per_prompt_values, groups=positions)
    n_pos = seq if positions == "each" else 1
    return Sweep(kind, site, direction, positions, f.n_layers, n_units, n_pos, n, seq,
                 metric.per_prompt_values)


def chunked(sweep: Sweep, rows: int, lengths: list[int] | None = None) -> Sweep:
    """``sweep`` cut into chunks of at most ``rows`` sequences per forward pass.

    ``lengths``: positions each prompt needs, ascending (``length_order``). When all prompts fit
    in one forward they may run in two length buckets (``bucket_split``). Prompts are split
    across chunks only when the metric has per-prompt values. A head-set sweep's chunks hold
    whole sets (``per_patch`` variants each): a chunk is a group of sets of one lowest layer.
    """
    rows, step = max(1, int(rows)), sweep.per_patch
    n, chunks = sweep.n_prompts, []
    if rows >= n or not sweep.split_prompts:
        best = bucket_split(lengths) if lengths is not None and sweep.split_prompts else None
        buckets = [(0, n)] if best is None else [(0, best), (best, n)]
        for layer in range(sweep.n_layers):
            for p0, p1 in buckets:
                per = max(1, rows // (p1 - p0)) * step
                n_var = sweep.variants_at(layer)
                for v0 in range(0, n_var, per):
                    chunks.append(Chunk(layer, v0, min(v0 + per, n_var), p0, p1))
    else:  # prompts split: one patch per forward
        for layer in range(sweep.n_layers):
            for v in range(0, sweep.variants_at(layer), step):
                for p0 in range(0, n, rows):
                    chunks.append(Chunk(layer, v, v + step, p0, min(p0 + rows, n)))
    return replace(sweep, chunks=tuple(chunks), lengths=None if lengths is None else tuple(lengths))


def bucket_split(lengths: list[int]) -> int | None:
    """Where prompts of ``lengths`` (ascending) split into two forwards, each running to its
    longest prompt: the split that saves >= 10% of the token-rows, each side keeping >= 1/4 of
    the prompts; None where none does (or fewer than 4 prompts)."""
    n = len(lengths)
    if n < 4:
        return None
    cost = {s: s * lengths[s - 1] + (n - s) * lengths[-1] for s in range(n // 4, n - n // 4)}
    best = min(cost, key=cost.__getitem__, default=None)
    return best if best and cost[best] <= 0.9 * n * lengths[-1] else None


def length_order(metric: PromptMetric) -> tuple[Tensor | None, list[int] | None]:
    """Prompt order by the positions each prompt needs (last read + 1), ascending, and those
    lengths in that order; ``(None, None)`` when the metric declares no reads."""
    reads = metric.read_positions()
    if reads is None:
        return None, None
    need = reads.max(1).values + 1
    order = torch.argsort(need, stable=True)
    return order, need[order].tolist()


# --- memory sizing ----------------------------------------------------------------------------


def row_bytes(d_model: int, d_mlp: int, n_heads: int, d_vocab: int, seq: int, elem: int) -> int:
    """Rough peak bytes of one sequence of ``seq`` tokens in a no-grad forward, ``elem`` bytes
    per element: one block's activations (``8 d_model + 3 d_mlp`` per token), its attention
    scores/probabilities (``3 n_heads seq``) and the logits (``3 d_vocab``), times 1.5 for
    allocator slack and hook copies. The one formula behind ``bytes_per_row`` (a loaded model)
    and ``patching.cost`` (a config, no weights)."""
    per_tok = 8 * d_model + 3 * d_mlp + 3 * n_heads * seq + 3 * d_vocab
    return int(elem * seq * per_tok * 1.5)


def bytes_per_row(model: Any, seq: int) -> int:
    """``row_bytes`` of a loaded model at its weights' element size."""
    f = hooks.facts(model)
    d_mlp = int(getattr(model.cfg, "d_mlp", None) or 4 * f.d_model)
    elem = next(model.parameters()).element_size()
    return row_bytes(f.d_model, d_mlp, f.n_heads, f.d_vocab_out, seq, elem)


def model_devices(model: Any) -> list[torch.device]:
    """The devices a model's parameters live on, in first-use order (several when it is split
    across GPUs with ``n_devices`` / ``device_map``)."""
    seen: dict[torch.device, None] = {}
    for p in model.parameters():
        seen.setdefault(p.device, None)
    return list(seen)


def available_bytes(device: torch.device | list[torch.device]) -> int:
    """Free memory usable by activations: a share of free GPU memory (the smallest over the GPUs a
    split model uses: a forward's activations pass through each of them) or of the available RAM."""
    devices = device if isinstance(device, list) else [device]
    gpus = [d for d in devices if d.type == "cuda"]
    if gpus:
        return int(min(torch.cuda.mem_get_info(d)[0] for d in gpus) * 0.7)
    import psutil

    return int(psutil.virtual_memory().available * 0.4)


def auto_rows(model: Any, seq: int) -> int:
    """Sequences per forward that fit the free memory (at most ``MAX_ROWS``)."""
    return max(1, min(MAX_ROWS, available_bytes(model_devices(model)) // bytes_per_row(model, seq)))


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an accelerator (or allocator) out-of-memory error."""
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(error, oom)) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


def release_cached_memory() -> None:
    """Give the allocator's cached blocks back after an out-of-memory error (GPU only)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- edge sweeps ----------------------------------------------------------------------------------

EMBED_NODE, logits_node = hooks.EMBED_NODE, hooks.logits_node  # (their home: hooks)


@dataclass(frozen=True)
class EdgeLayout:
    """Which edges an edge sweep patches (``senders``, ``EMBED_NODE`` first when present;
    ``receivers``, ``logits_node`` last when present; ``inputs``, "q", "k", "v"; docs/edges.md) and
    how they become a sweep's variants: its "layers" are the receiver layers ``0..n_layers``
    (``n_layers``: the logits), a variant of layer ``l`` one edge into it, laid out sender-major,
    then input, then head (``cells``), so a chunk's variants share few senders."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    senders: tuple[tuple[int, int], ...]
    receivers: tuple[tuple[int, int], ...]
    inputs: tuple[str, ...]

    def units(self, layer: int, input_name: str) -> list[int]:
        """Heads of receiver layer ``layer`` that receive at ``input_name`` (KV heads for k/v
        under GQA)."""
        top = self.n_kv_heads if input_name in hooks.KV_SITES else self.n_heads
        return sorted(h for la, h in self.receivers if la == layer and 0 <= h < top)

    def cells(self, layer: int) -> Int[Tensor, "n 3"]:
        """Edges into receiver layer ``layer``: rows ``(sender index, input index, head)``;
        for the logits (``layer == n_layers``) one per sender, input index 0 and head -1."""
        rows: list[tuple[int, int, int]] = []
        if layer == self.n_layers:
            if logits_node(self.n_layers) in self.receivers:
                rows = [(s, 0, -1) for s in range(len(self.senders))]
        else:
            units = [(i, self.units(layer, name)) for i, name in enumerate(self.inputs)]
            for s, (sl, _) in enumerate(self.senders):
                if sl < layer:
                    rows += [(s, i, u) for i, us in units for u in us]
        return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)

    def count(self, layer: int) -> int:
        """``len(cells(layer))``, counted without listing them (a 70B plan has millions)."""
        if layer == self.n_layers:
            return len(self.senders) if logits_node(self.n_layers) in self.receivers else 0
        before = sum(1 for sl, _ in self.senders if sl < layer)
        return before * sum(len(self.units(layer, name)) for name in self.inputs)

    @property
    def layer_variants(self) -> tuple[int, ...]:
        return tuple(self.count(layer) for layer in range(self.n_layers + 1))

    @property
    def n_edges(self) -> int:
        return sum(self.layer_variants)

    def receiver_index(self) -> dict[tuple[int, int], int]:
        return {r: i for i, r in enumerate(self.receivers)}

    def to_dict(self) -> dict[str, Any]:
        return dict(senders=[list(s) for s in self.senders],
                    receivers=[list(r) for r in self.receivers], inputs=list(self.inputs))


def make_edge_sweep(model: Any, layout: EdgeLayout, direction: str, tokens: Tensor,
                    metric: PromptMetric) -> Sweep:
    """The unplanned ``Sweep`` of an edge layout (kind "edges", site the inputs joined by ",",
    one "layer" per receiver layer and the logits)."""
    n, seq = tokens.shape
    per_layer = layout.layer_variants
    return Sweep("edges", ",".join(layout.inputs), direction, "all", layout.n_layers + 1,
                 max(per_layer), 1, n, seq, metric.per_prompt_values, layer_variants=per_layer)


@dataclass(frozen=True)
class PathLayout:
    """Which paths a path sweep patches (``patch_paths``; ``patching/paths.py``): ``senders``
    and ``receivers`` heads in the caller's order, the receivers' ``inputs`` (patched together)
    and ``n_groups`` position groups (1: every position). Its "layers" are the receiver layers;
    a variant of layer ``l`` is one (sender before ``l``, group, receiver head at ``l``), laid out
    sender-major, then group, then head (``cells``), so a chunk's variants share few senders."""

    n_layers: int
    senders: tuple[tuple[int, int], ...]
    receivers: tuple[tuple[int, int], ...]
    inputs: tuple[str, ...]
    n_groups: int = 1

    def cells(self, layer: int) -> Int[Tensor, "n 3"]:
        """Paths into receiver layer ``layer``: rows ``(sender index, group, receiver index)``."""
        into = [ri for ri, (rl, _) in enumerate(self.receivers) if rl == layer]
        rows = [(s, g, r) for s, (sl, _) in enumerate(self.senders) if sl < layer
                for g in range(self.n_groups) for r in into]
        return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)

    @property
    def layer_variants(self) -> tuple[int, ...]:
        return tuple(sum(1 for sl, _ in self.senders if sl < layer) * self.n_groups
                     * sum(1 for rl, _ in self.receivers if rl == layer)
                     for layer in range(self.n_layers))

    def to_dict(self) -> dict[str, Any]:
        return dict(senders=[list(s) for s in self.senders],
                    receivers=[list(r) for r in self.receivers], inputs=list(self.inputs))


def make_path_sweep(layout: PathLayout, direction: str, tokens: Tensor, metric: PromptMetric,
                    groups: Any = None) -> Sweep:
    """The unplanned ``Sweep`` of a path layout (kind "paths", site the inputs joined by ",",
    one "layer" per receiver layer; ``groups``: the checked ``PositionGroups``, or None)."""
    n, seq = tokens.shape
    per_layer = layout.layer_variants
    return Sweep("paths", ",".join(layout.inputs), direction, "all", layout.n_layers,
                 max(per_layer), 1, n, seq, metric.per_prompt_values, layer_variants=per_layer,
                 groups=groups)


@dataclass(frozen=True, eq=False)
class SetLayout:
    """Which head sets a head-set sweep patches, each set's heads together (``HeadSetUnits``,
    ``ExactEngine.run_head_sets``): ``sets``, each sorted ``(layer, head)`` pairs, in the caller's
    order; where (``site``: "z" or "pattern") and what their heads get (``source``,
    ``exact.head_sets.HEAD_SET_SOURCES``; ``seed``: the resample pairing's); the metrics read on
    every patched run besides the sweep's own (``metrics``, per-prompt ``PromptMetric``s). The
    sweep's "layers" are the sets' lowest layers (the empty set's: the last one, as
    ``run_head_sets`` groups them); a variant of layer ``l`` is one (set starting at ``l``, metric)
    pair, set-major, the sweep's own metric first: ``v = j * n_reads + m`` for the ``j``-th set of
    ``at(l)``. A chunk holds whole sets (``Sweep.per_patch``)."""

    n_layers: int
    sets: tuple[tuple[tuple[int, int], ...], ...]
    site: str = "z"
    source: str = "source"
    seed: int = 0
    metrics: tuple[PromptMetric, ...] = ()
    _at: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        starts = [min((la for la, _ in s), default=self.n_layers - 1) for s in self.sets]
        object.__setattr__(self, "_at", tuple(
            tuple(i for i, st in enumerate(starts) if st == layer)
            for layer in range(self.n_layers)))

    @property
    def n_reads(self) -> int:
        """Metrics read on each patched run: the sweep's own and ``metrics``."""
        return 1 + len(self.metrics)

    def at(self, layer: int) -> tuple[int, ...]:
        """The sets (indices into ``sets``, in order) whose lowest layer is ``layer``."""
        return self._at[layer]

    @property
    def layer_variants(self) -> tuple[int, ...]:
        return tuple(len(a) * self.n_reads for a in self._at)

    def reordered(self, order: Tensor) -> SetLayout:
        """This layout with its metrics over the prompts ``order`` (the sweep's prompt order)."""
        return replace(self, metrics=tuple(m.select(order) for m in self.metrics))

    def identity(self, n_prompts: int, seq: int, d_vocab: int) -> dict[str, Any]:
        """What a resumed sweep must share besides ``sweep_identity``: the sets, their source
        and seed, each extra metric by name and behaviour (``PromptMetric.fingerprint``)."""
        return dict(sets=[[list(h) for h in s] for s in self.sets], source=self.source,
                    seed=self.seed, metrics=[[m.name, m.fingerprint(n_prompts, seq, d_vocab)]
                                             for m in self.metrics])


def make_set_sweep(model: Any, layout: SetLayout, direction: str, tokens: Tensor,
                   metric: PromptMetric) -> Sweep:
    """The unplanned ``Sweep`` of a head-set layout: kind "heads" at the layout's site (the engine's
    head-site caches), positions "all", one "layer" per lowest layer (``SetLayout``)."""
    f = hooks.facts(model)
    n, seq = tokens.shape
    site = layout.site
    return Sweep("heads", site, direction, "all", f.n_layers, f.n_heads_at(site), 1, n, seq,
                 metric.per_prompt_values, layer_variants=layout.layer_variants, sets=layout)
