"""What a sweep costs, in one place: ``price`` turns a ``Work`` (what a sweep patches, however it
was learnt) into pass-equivalents per method, the hybrid's verified cells and ``method="auto"``'s
choice. Every route calls it:

* ``circuitkit patch --plan`` / ``edges --plan`` / ``circuitkit info`` without weights:
  ``sweep_plan`` (heads), ``edge_plan`` (edges), ``path_plan`` (paths) build the ``Work`` from the
  architecture alone (a 70B model is planned before 141 GB are downloaded) and add FLOPs, memory,
  GPUs and time (``basis``);
* ``api.plan_patch`` (weights here): the ``Work`` of a one-chunk probe, timed at its rates;
* ``hybrid.screen_then_verify``: the ``Work`` of its ``Screenable`` (``Screenable.work``), priced
  before it runs (what it verifies; exact instead where the hybrid would cost as much);
* ``auto.choice``: the ``Work`` of the model's head sweep (``auto`` below).

Every figure is a formula of the config (or the loaded model) and the prompts' token counts,
each written once here, so the numbers can be checked by hand:

* **pass-equivalent**: one prompt of ``seq`` tokens through the whole model; a backward counts 2.
* **exact** (``exact_passes``): the suffix reruns plus 2 per prompt (the cached clean and corrupt
  runs; paths: ``4 + n_senders``), the suffix measured on the engine's chunk plan
  (``chunk_suffix``: as ``sweep.chunked`` cuts a real run) or summed over cells
  (``cell_suffix``); a head in layer ``l`` reruns ``d = (L - l) / L`` of the model
  (``head_shares``).
* **attribution**: its registry entry's passes per prompt (``estimators.costs``; AtP: 4) x ``n``.
* **attribution then exact** (``hybrid_passes``): the screen's passes + the verified cells
  (``hybrid_cells``) at their mean ``d`` + 2 per prompt (``verified_passes``).
* **auto** (``auto_method``): exact at or below ``AUTO_EXACT_MAX_FLOPS_PER_TOKEN`` FLOPs per
  prompt token (``exact_flops_per_token``: ``2 x N x sum_c d_c``), else attribution+exact.
* **FLOPs** per pass-equivalent: ``seq x (2 (N - V d) + 2 L H d_head seq)``: two per weight
  (``N`` parameters less the embedding lookup ``V d``) per token, plus causal attention (QK^T and
  AV over on average ``seq / 2`` keys, 2 FLOPs per multiply-add).
* **weights**: ``N x`` bytes per element (bf16: 2).
* **GPUs**: the fewest of the chosen class whose memory holds the weights within
  ``WEIGHT_SHARE`` of each GPU and leaves room for one sequence of activations per GPU.
* **activations**: exact, per forward: ``rows x sweep.row_bytes`` (one block + logits);
  ``rows`` = what ``ACTIVATION_SHARE`` of a GPU's memory left beside its share of the weights
  holds (at most ``sweep.MAX_ROWS``). Attribution, per prompt: every layer's saved tensors for
  the backward, ``seq x L x (12 d + 4 d_mlp + 2 H seq)`` elements, spread over the GPUs.
  Host RAM: the exact engine caches ``resid_pre`` and the site's base and source activations
  of every layer on the CPU (``engine.ExactEngine``).
* **time**: FLOPs / (bf16 dense peak x ``utilisation``) / replicas. A model split over the GPUs
  of one replica by layers runs one GPU at a time, so a replica computes at one GPU's rate.

Token counts come from the model's tokenizer when it is on this machine, else from the prompt
text at ``CHARS_PER_TOKEN`` characters per token (``tasks.text.token_counts``). The ``--plan``
text of these dicts: ``cli/plan_text.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from circuitkit.patching.estimators.costs import CostShape, block_flop_shares, receiver_attn_passes
from circuitkit.patching.estimators.registry import REGISTRY
from circuitkit.patching.inputs import check_top_k
from circuitkit.patching.sweep import MAX_ROWS, Sweep, chunked, row_bytes


@dataclass(frozen=True)
class GPUClass:
    name: str
    memory_bytes: float
    bf16_dense_flops: float  # peak, dense (no sparsity), FLOP/s


# Vendor datasheet figures (SXM parts): bf16 tensor-core dense peak, memory.
GPU_CLASSES = {
    "H100": GPUClass("H100 SXM 80 GB", 80e9, 989e12),
    "H200": GPUClass("H200 SXM 141 GB", 141e9, 989e12),
    "A100": GPUClass("A100 SXM 80 GB", 80e9, 312e12),
}
UTILISATION = 0.4  # share of peak a patching forward reaches (memory-bound pieces, small batches)
WEIGHT_SHARE = 0.9  # of each GPU's memory: the rest is the CUDA context and allocator slack
ACTIVATION_SHARE = 0.7  # of what is left beside the weights (as sweep.available_bytes)
# `--method auto`: exact when the exact sweep costs at most this many FLOPs per prompt token
# (2 x parameters x exact pass-equivalents per prompt): every head of an 8B model at all
# positions (~8.4e12) runs exact; Llama-3-70B (~3.7e14) or per-position sweeps of billion-
# parameter models screen by attribution and verify the top cells exactly.
AUTO_EXACT_MAX_FLOPS_PER_TOKEN = 5e13
# attribution+exact with its automatic budget: the share of cells it is expected to verify, and
# its cap (``Budget.max_fraction``, ``ck.BudgetRule(max_fraction=...)``)
AUTO_EXPECTED_FRACTION = 0.2
AUTO_MAX_FRACTION = 0.5


# --- the pass formulas (pass-equivalents: one prompt through the whole model) -------------------


def chunk_suffix(token_blocks: float, n_layers: int, seq: int) -> float:
    """An exact sweep's suffix reruns measured on its chunk plan: ``token_blocks`` (the chunks'
    ``rows x run_length x (L - l)``, ``Sweep.chunk_cost``) over ``L x seq``."""
    return token_blocks / (n_layers * seq)


def cell_suffix(n: int, shares: float, read_share: float = 1.0) -> float:
    """An exact sweep's suffix reruns summed over its cells: ``n x shares x read_share``
    (``shares`` = ``sum_c d_c``, each cell's share of the model; ``read_share``: the prompts'
    tokens up to the metric's last read)."""
    return n * shares * read_share


def exact_passes(suffix: float, n: int, cached: float = 2) -> float:
    """The exact sweep: its ``suffix`` reruns plus ``cached`` runs per prompt (the clean and
    corrupt runs the engine caches: 2; a path sweep's ``4 + n_senders``)."""
    return suffix + cached * n


def head_shares(n_layers: int, per_layer: int) -> float:
    """``sum_c d_c`` of a head sweep at full length: ``per_layer`` cells in each layer ``l``,
    each rerunning ``(L - l) / L`` of the model: ``per_layer x (L + 1) / 2``."""
    return per_layer * (n_layers + 1) / 2


def verified_passes(n: int, shares: float) -> float:
    """Verifying cells exactly: ``n x (shares + 2)``, ``shares`` the verified cells' ``sum d``,
    2 the exact engine's cached runs (paid once, whatever the cells)."""
    return n * (shares + 2)


def hybrid_passes(screen: float, n: int, cells: float, mean_share: float) -> float:
    """attribution+exact: the ``screen``'s passes (all prompts) plus ``cells`` verified at their
    ``mean_share`` of the model (``verified_passes``)."""
    return screen + verified_passes(n, cells * mean_share)


def hybrid_cells(n_cells: int, per_round: int, top_k: int | None,
                 max_fraction: float = AUTO_MAX_FRACTION, recall_top: int = 10) -> tuple[int, int]:
    """(expected, at most) cells attribution+exact verifies: ``top_k`` when given; else its
    rule's floor, the first round (``2 x per_round``: the calibration cells) and rounds until
    ``recall_top`` are verified, or ``AUTO_EXPECTED_FRACTION`` of the cells if more, capped at
    ``max_fraction`` of them (``hybrid.budget_rule``). On a small model the floor dominates:
    the teacher's 32 heads verify 16 (its cap) whatever the fraction says."""
    if top_k is not None:
        return (min(top_k, n_cells),) * 2
    cap = hybrid_cap(n_cells, max_fraction)
    floor = min(2 * per_round, n_cells)
    if floor < recall_top:
        floor += math.ceil((min(recall_top, n_cells) - floor) / per_round) * per_round
    return min(cap, max(floor, math.ceil(AUTO_EXPECTED_FRACTION * n_cells))), cap


def hybrid_cap(n_cells: int, max_fraction: float = AUTO_MAX_FRACTION) -> int:
    """The most cells the automatic budget verifies: ``max_fraction`` of them, at least 1 (none
    of none)."""
    return min(n_cells, max(1, int(max_fraction * n_cells)))


def exact_flops_per_token(n_params: int, shares: float) -> float:
    """``2 x n_params x`` the exact sweep's pass-equivalents per prompt at full length
    (``shares`` = ``sum_c d_c``; heads: ``head_shares``)."""
    return 2.0 * n_params * shares


def tl_loop_passes(n_cells: int, n_prompts: int) -> int:
    """Full passes of TransformerLens's patching loop: one per patched cell and prompt, plus the
    clean and corrupt runs of each prompt (``circuitkit info``'s comparison row)."""
    return (n_cells + 2) * n_prompts


def auto_method(flops_per_token: float) -> str:
    """``"exact"`` at or below ``AUTO_EXACT_MAX_FLOPS_PER_TOKEN``, else ``"attribution+exact"``."""
    return "exact" if flops_per_token <= AUTO_EXACT_MAX_FLOPS_PER_TOKEN else "attribution+exact"


# --- the one price ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """attribution+exact's budget: ``top_k`` cells, or its automatic rule (``hybrid.budget_rule``:
    ``recall_top``, ``quantile``, ``max_fraction``), within ``max_passes`` when given."""

    top_k: int | None = None
    max_passes: float | None = None
    recall_top: int = 10
    quantile: float = 0.9
    max_fraction: float = AUTO_MAX_FRACTION

    def rule(self) -> dict[str, Any]:
        """The automatic rule's knobs (``recall_top``, ``quantile``, ``max_fraction``)."""
        return dict(recall_top=self.recall_top, quantile=self.quantile,
                    max_fraction=self.max_fraction)


@dataclass(frozen=True)
class Work:
    """What a sweep's price depends on, however it was learnt (a config, a loaded model, a
    probe). ``n``: prompts; ``n_cells`` cells, ``shares`` = ``sum_c d_c`` (each cell's share of
    the model its patch reruns), ``per_round``: cells per round of the hybrid's rule (one
    layer's); ``read_share``: the prompts' tokens up to the metric's last read; ``suffix``: the
    exact reruns measured on a chunk plan (``chunk_suffix``; None: ``cell_suffix``);
    ``cached``: the exact engine's cached runs per prompt; ``per_prompt``: other rows' passes
    per prompt (attribution estimators, TL's loop); ``screen``: the hybrid's screen, all prompts
    (None: no hybrid row); ``n_params``: for ``method="auto"`` (None: no choice)."""

    n: int
    n_cells: int = 0
    shares: float = 0.0
    per_round: int = 1
    read_share: float = 1.0
    suffix: float | None = None
    cached: float = 2
    per_prompt: Mapping[str, float] = field(default_factory=dict)
    screen: float | None = None
    n_params: int | None = None


def price(work: Work, budget: Budget | None = None) -> dict[str, Any]:
    """Pass-equivalents of ``work`` per method (the formulas above, once for every route).

    Returns ``passes``: ``{"exact": ..., <per_prompt row>: ...}``; ``hybrid`` (None without a
    screen): ``cells`` and ``cells_max`` verified (``hybrid_cells``), ``passes`` (at most
    ``max_passes``, never below the screen) and ``passes_max`` (at the cap), ``exact_passes``,
    ``screen_passes`` and ``runs``: "exact" where the automatic budget (no ``top_k``, no
    ``max_passes``) is predicted to cost at least the exact sweep, else "attribution+exact";
    ``auto`` (None without ``n_params``): ``chose``, ``exact_flops_per_token``, ``threshold``.
    """
    budget = budget or Budget()
    n = work.n
    suffix = cell_suffix(n, work.shares, work.read_share) if work.suffix is None \
        else work.suffix
    passes = {"exact": exact_passes(suffix, n, work.cached)}
    passes.update({name: p * n for name, p in work.per_prompt.items()})
    hybrid = None if work.screen is None else _hybrid(work, budget, passes["exact"])
    auto = None
    if work.n_params is not None:
        flops = exact_flops_per_token(work.n_params, work.shares)
        auto = dict(chose=auto_method(flops), exact_flops_per_token=flops,
                    threshold=AUTO_EXACT_MAX_FLOPS_PER_TOKEN)
    return dict(passes=passes, hybrid=hybrid, auto=auto)


def _hybrid(work: Work, budget: Budget, exact: float) -> dict[str, Any]:
    """``price``'s attribution+exact entry."""
    cells, most = hybrid_cells(work.n_cells, work.per_round, budget.top_k, budget.max_fraction,
                               budget.recall_top)
    mean = work.shares / work.n_cells if work.n_cells else 0.0
    pas = hybrid_passes(work.screen, work.n, cells, mean)
    if budget.max_passes is not None:
        pas = min(pas, max(float(budget.max_passes), work.screen))
    auto_budget = budget.top_k is None and budget.max_passes is None
    return dict(runs="exact" if auto_budget and pas >= exact else "attribution+exact",
                cells=cells, cells_max=most, passes=pas,
                passes_max=hybrid_passes(work.screen, work.n, most, mean), exact_passes=exact,
                screen_passes=work.screen)


# --- plans from the config alone: FLOPs, memory, GPUs, time -------------------------------------


@dataclass(frozen=True)
class PlanOptions:
    """Where and how a planned sweep runs: ``gpu`` (a key of ``GPU_CLASSES``) at
    ``utilisation`` of its peak, ``dtype_bytes`` per element, ``replicas`` (model copies sharing
    the work: ``torchrun``), ``n_gpus`` per replica (``--gpus-per-replica``; None: the fewest
    that hold the model, ``gpus_needed``) and ``rows`` per forward (``--batch-size``; None: what
    fits the memory left)."""

    gpu: str = "H100"
    utilisation: float = UTILISATION
    dtype_bytes: int = 2
    replicas: int = 1
    n_gpus: int | None = None
    rows: int | None = None


def plan_options(options: PlanOptions | Mapping[str, Any] | None) -> PlanOptions:
    """``options`` as a ``PlanOptions`` (a dict of its fields accepted; an unknown key is one
    line naming the fields)."""
    if options is None or isinstance(options, PlanOptions):
        return options or PlanOptions()
    known = {f.name for f in fields(PlanOptions)}
    stray = sorted(set(options) - known)
    if stray:
        raise ValueError(f"plan options {stray} are not known; expected some of {sorted(known)}.")
    return PlanOptions(**options)


def flops_per_pass(arch: Any, seq: int) -> float:
    """Forward FLOPs of one prompt of ``seq`` tokens (module docstring)."""
    weights = arch.n_params - arch.d_vocab * arch.d_model
    return seq * (2.0 * weights + 2.0 * arch.n_layers * arch.n_heads * arch.d_head * seq)


def gpus_needed(weights_bytes: float, gpu: GPUClass, one_row_bytes: float) -> int:
    """Fewest GPUs holding the weights (``WEIGHT_SHARE`` of each) plus one row of activations."""
    n = max(1, math.ceil(weights_bytes / (gpu.memory_bytes * WEIGHT_SHARE)))
    while (gpu.memory_bytes - weights_bytes / n) * ACTIVATION_SHARE < one_row_bytes:
        n += 1
    return n


@dataclass(frozen=True)
class Basis:
    """What every plan prices from, whatever its units (``basis``): the prompts (sorted
    ``lengths``: ``n`` of up to ``seq`` tokens), the GPU class ``g``, the weights and one row's
    activations (bytes), the GPUs per replica, each GPU's ``budget`` for activations, the rows
    per forward (``fit``: what the budget holds; ``rows``: ``--batch-size``, else ``fit``), and
    one pass-equivalent's FLOPs and the FLOP/s it runs at."""

    g: GPUClass
    lengths: list[int]
    n: int
    seq: int
    L: int
    dtype_bytes: int
    weights: float
    one_row: float
    n_gpus: int
    budget: float
    fit: int
    rows: int
    per_pass: float
    rate: float

    def cost(self, passes: float, **extra: Any) -> dict[str, Any]:
        """A method's row: its pass-equivalents, their FLOPs and time, and ``extra``."""
        return dict(pass_equivalents=passes, flops=passes * self.per_pass,
                    seconds=self.seconds(passes), **extra)

    def seconds(self, passes: float) -> float:
        """GPU time of ``passes`` pass-equivalents at this basis's FLOP rate."""
        return passes * self.per_pass / self.rate

    def saved_per_gpu(self, arch: Any, extra_elems: int = 0) -> float:
        """Every layer's saved tensors for one prompt's backward (``12 d + 4 d_mlp + 2 H seq``
        elements per token and layer, plus ``extra_elems``), spread over the GPUs."""
        return (self.dtype_bytes * self.seq * self.L
                * (12 * arch.d_model + 4 * arch.d_mlp + 2 * arch.n_heads * self.seq
                   + extra_elems)) / self.n_gpus

    def host_cache_bytes(self, arch: Any, site_elems: int) -> int:
        """Host RAM of the exact engine's caches (``engine.ExactEngine``): ``resid_pre`` and
        ``site_elems`` per token (the site's base and source) of every layer and prompt."""
        return self.dtype_bytes * self.L * sum(self.lengths) * (arch.d_model + site_elems)

    def attribution_rows(self, saved_per_gpu: float) -> int:
        """Prompts per backward: how many of one prompt's saved tensors (this GPU's share) plus
        one row the budget holds, at least 1, at most ``n``."""
        return int(max(1, min(self.n, self.budget // (saved_per_gpu + self.one_row))))

    def buckets(self, kind: str, direction: str) -> list[tuple[int, int]]:
        """The engine's length buckets ``(p0, p1)`` of an edge or path sweep (one variant per
        layer: what ``sweep.chunked`` cuts the prompts into at ``rows`` per forward)."""
        sweep = Sweep(kind, "", direction, "all", 1, 1, 1, self.n, self.seq, True)
        return sorted({(c.p0, c.p1) for c in chunked(sweep, self.rows, self.lengths).chunks})


def basis(arch: Any, lengths: Sequence[int], *, top_k: int | None = None,
          options: PlanOptions | Mapping[str, Any] | None = None) -> Basis:
    """The checks, GPU count, memory and time basis every plan shares (module docstring): one
    road for heads (``sweep_plan``), edges (``edge_plan``) and paths (``path_plan``)."""
    o = plan_options(options)
    _check_inputs(o.gpu, lengths, top_k)
    if not 0 < o.utilisation <= 1:
        raise ValueError(f"utilisation={o.utilisation!r}: expected a share of peak in (0, 1].")
    g = GPU_CLASSES[o.gpu]
    lengths = sorted(int(x) for x in lengths)
    n, seq = len(lengths), lengths[-1]
    weights = arch.n_params * o.dtype_bytes
    one_row = row_bytes(arch.d_model, arch.d_mlp, arch.n_heads, arch.d_vocab, seq, o.dtype_bytes)
    need = gpus_needed(weights, g, one_row)
    if o.n_gpus is not None and o.n_gpus < need:
        raise ValueError(f"n_gpus={o.n_gpus} (--gpus-per-replica): {arch.name} needs at least "
                         f"{need} {g.name} GPUs per copy ({weights / 1e9:.1f} GB of weights "
                         "plus one sequence of activations).")
    n_gpus = o.n_gpus or need
    budget = (g.memory_bytes - weights / n_gpus) * ACTIVATION_SHARE  # per GPU
    fit = int(max(1, min(MAX_ROWS, budget // one_row)))
    if o.rows is not None and o.rows < 1:
        raise ValueError(f"rows={o.rows!r} (--batch-size): expected a positive integer.")
    return Basis(g, lengths, n, seq, arch.n_layers, o.dtype_bytes, weights, one_row, n_gpus,
                 budget, fit, fit if o.rows is None else o.rows, flops_per_pass(arch, seq),
                 g.bf16_dense_flops * o.utilisation * o.replicas)


def sweep_plan(arch: Any, lengths: list[int], *, site: str = "z", positions: str = "all",
               direction: str = "denoise", top_k: int | None = None,
               options: PlanOptions | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Cost of a head sweep of ``arch`` (``models.Architecture``) over prompts of ``lengths``
    tokens, per method (``price``), on ``options`` (a ``PlanOptions`` or a dict of its fields:
    the GPU class, utilisation, bytes per element, replicas, GPUs per replica, rows per
    forward). Returns a dict: the inputs, ``weights_bytes``, ``n_gpus``, ``gpu``, ``auto`` (the
    method ``--method auto`` picks) and ``methods``: ``{name: {pass_equivalents, flops,
    activation_bytes, rows, n_chunks, seconds, ...}}`` for "exact", "attribution" and
    "attribution+exact". Formulas: module docstring.
    """
    o = plan_options(options)
    b = basis(arch, lengths, top_k=top_k, options=o)
    g, lengths, n, seq, L, rows, cost = b.g, b.lengths, b.n, b.seq, b.L, b.rows, b.cost
    n_units = arch.n_kv_heads if site in ("k", "v") else arch.n_heads
    n_pos = seq if positions == "each" else 1
    sweep = chunked(Sweep("heads", site, direction, positions, L, n_units, n_pos, n, seq, True),
                    rows, lengths)
    shares = block_flop_shares(arch.d_model, arch.d_mlp, arch.d_head, arch.n_heads,
                               arch.n_kv_heads, seq)  # the shipped configs' MLPs are gated
    # Priced as one MLP call per head: the all-heads formula has fewer FLOPs (5.9 against 29.7
    # pass-equivalents for a Llama-3-8B shape at 16 x 256 tokens) but its elementwise passes are
    # memory-bound; measured on an H200 it took 3.0x AtP's time (12 pass-equivalents), the
    # per-head call 6.5x: conservative rather than optimistic (docs/attribution.md).
    screen = REGISTRY["block"].passes(CostShape(L, arch.n_heads, n_units * n_pos, site, *shares))
    p = price(Work(n, n_cells=L * n_units * n_pos, shares=head_shares(L, n_units * n_pos),
                   per_round=n_units * n_pos,
                   suffix=chunk_suffix(sum(sweep.chunk_cost(c) for c in sweep.chunks), L, seq),
                   per_prompt={"attribution": REGISTRY["atp"].passes(CostShape(L))},
                   screen=screen * n, n_params=arch.n_params), Budget(top_k=top_k))
    exact = cost(p["passes"]["exact"], rows=min(rows, n_units * n_pos * n),
                 n_chunks=len(sweep.chunks),
                 activation_bytes=min(rows, n_units * n_pos * n) * b.one_row)
    saved = b.saved_per_gpu(arch)
    att_rows = b.attribution_rows(saved)
    if rows != b.fit:  # --batch-size: the attribution passes take it too
        att_rows = min(rows, n)
    att = cost(p["passes"]["attribution"], rows=att_rows, n_chunks=math.ceil(n / att_rows),
               activation_bytes=att_rows * (saved + b.one_row))
    hy = p["hybrid"]
    hybrid = cost(hy["passes"], rows=att_rows,
                  n_chunks=att["n_chunks"] + math.ceil(hy["cells"] * n / rows),
                  activation_bytes=att["activation_bytes"], verified_cells=hy["cells"],
                  budget="top_k" if top_k is not None else "auto",
                  verified_cells_max=hy["cells_max"], seconds_max=b.seconds(hy["passes_max"]),
                  screening_passes=hy["screen_passes"])
    # host RAM of the exact engine's caches: resid_pre + the site's base and source, per layer
    site_elems = {"z": 2 * arch.n_heads * arch.d_head, "q": 2 * arch.n_heads * arch.d_head,
                  "k": 2 * arch.n_kv_heads * arch.d_head, "v": 2 * arch.n_kv_heads * arch.d_head,
                  "pattern": 2 * arch.n_heads * seq}[site]
    return dict(
        model=arch.name, n_params=arch.n_params, n_layers=L, n_units=n_units, n_pos=n_pos,
        n_cells=L * n_units * n_pos, n_prompts=n, seq=seq, mean_tokens=sum(lengths) / n,
        site=site, positions=positions, direction=direction, top_k=top_k,
        dtype_bytes=o.dtype_bytes, weights_bytes=b.weights, gpu=g.name, gpu_key=o.gpu,
        gpu_memory_bytes=g.memory_bytes, peak_flops=g.bf16_dense_flops,
        utilisation=o.utilisation, n_gpus=b.n_gpus, replicas=o.replicas,
        activation_budget_bytes=b.budget, host_cache_bytes=b.host_cache_bytes(arch, site_elems),
        exact_flops_per_token=p["auto"]["exact_flops_per_token"], auto=p["auto"]["chose"],
        methods={"exact": exact, "attribution": att, "attribution+exact": hybrid})


# --- edges and paths -----------------------------------------------------------------------------


def edge_plan(arch: Any, lengths: list[int], layout: Any, *, direction: str = "denoise",
              top_k: int | None = None, ig_steps: int = 5,
              options: PlanOptions | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Cost of an edge sweep (``api.patch_edges``) of ``arch`` over prompts of ``lengths``
    tokens, per method (``price``), from the config alone (``layout``: the ``sweep.EdgeLayout``;
    ``options``: as ``sweep_plan``'s).

    Exact: the engine's plan (length buckets as ``sweep.chunked`` cuts them, at most ``rows``
    sequences per forward); an edge into layer ``l`` reruns blocks ``l..L-1`` up to its bucket's
    last read (the logits: one block's worth, the final norm and unembedding), plus one partial run
    per (sender, receiver layer) through the receiving layer's norm and q/k/v projections (counted
    as a third of a block), plus 2 passes per prompt (the cached runs). TL's loop: one full pass per
    head -> later head edge and prompt (it has no embeddings or logits). Attribution: each edge
    estimator's registry entry; attribution+exact: the eap* screen + the verified edges
    (``hybrid_cells``) x their mean ``d = max(1, L - l) / L`` + 2 per prompt. Checks, time, GPUs and
    memory: ``basis``; ``results_bytes``: the per-prompt result tensor (float32, every cell)."""
    o = plan_options(options)
    b = basis(arch, lengths, top_k=top_k, options=o)
    g, lengths, n, seq, L, rows, cost = b.g, b.lengths, b.n, b.seq, b.L, b.rows, b.cost
    per_layer = layout.layer_variants
    n_edges = sum(per_layer)
    token_blocks, n_chunks = 0.0, 0
    senders_before = [sum(1 for sl, _ in layout.senders if sl < la) for la in range(L + 1)]
    for p0, p1 in b.buckets("edges", direction):
        c, per = lengths[p1 - 1], max(1, rows // (p1 - p0))
        for layer, v in enumerate(per_layer):
            if not v:
                continue
            token_blocks += v * (p1 - p0) * c * max(1, L - layer)
            token_blocks += senders_before[layer] * (p1 - p0) * c / 3 if layer < L else 0
            n_chunks += math.ceil(v / per)
    # TL's loop: one forward per (head, later query head) pair and input; k/v only without GQA
    tl_inputs = [i for i in layout.inputs if i == "q" or arch.n_kv_heads == arch.n_heads]
    head_edges = sum(1 for sl, _ in layout.senders if sl >= 0 for rl, _ in layout.receivers
                     if sl < rl < L) * len(tl_inputs)
    attn_share = block_flop_shares(arch.d_model, arch.d_mlp, arch.d_head, arch.n_heads,
                                   arch.n_kv_heads, seq)[0]
    pairs = sum(senders_before[la] for la in {rl for rl, _ in layout.receivers if rl < L})
    shape = CostShape(L, ig_steps=ig_steps,
                      n_sender_groups=len({max(sl, -1) for sl, _ in layout.senders}),
                      receiver_attn=receiver_attn_passes(attn_share, L, len(layout.inputs), pairs))
    per_prompt = {"TL loop": float(head_edges)}
    per_prompt.update({e.name: e.passes(shape) for e in REGISTRY.values() if e.units == "edges"})
    p = price(Work(n, n_cells=n_edges, per_round=len(layout.inputs) * arch.n_heads,
                   shares=sum(v * max(1, L - la) for la, v in enumerate(per_layer)) / L,
                   suffix=chunk_suffix(token_blocks, L, seq), per_prompt=per_prompt,
                   screen=per_prompt["eap*"] * n), Budget(top_k=top_k))
    # attribution keeps every layer's saved tensors and one residual copy per head and input
    saved = b.saved_per_gpu(arch, (arch.n_heads + 2 * arch.n_kv_heads) * arch.d_model)
    att_rows = b.attribution_rows(saved)
    methods = {"exact": cost(p["passes"]["exact"], n_chunks=n_chunks,
                             rows=min(rows, max(per_layer) * n),
                             activation_bytes=min(rows, n_edges * n) * b.one_row),
               "TL loop": cost(p["passes"]["TL loop"], forwards=head_edges)}
    for name in per_prompt:
        if name != "TL loop":  # each edge estimator, in the registry's order
            methods[name] = cost(p["passes"][name], rows=att_rows,
                                 activation_bytes=att_rows * (saved + b.one_row))
    methods["attribution+exact"] = cost(p["hybrid"]["passes"], verified_edges=p["hybrid"]["cells"],
                                        budget="top_k" if top_k is not None else "auto")
    return dict(model=arch.name, n_params=arch.n_params, n_layers=L, n_heads=arch.n_heads,
                n_kv_heads=arch.n_kv_heads, n_senders=len(layout.senders),
                n_receivers=len(layout.receivers), inputs=list(layout.inputs),
                n_edges=n_edges, head_edges=head_edges, n_prompts=n, seq=seq,
                mean_tokens=sum(lengths) / n, direction=direction, dtype_bytes=o.dtype_bytes,
                weights_bytes=b.weights, gpu=g.name, n_gpus=b.n_gpus, utilisation=o.utilisation,
                peak_flops=g.bf16_dense_flops, activation_budget_bytes=b.budget,
                host_cache_bytes=b.host_cache_bytes(arch, arch.n_heads * arch.d_head),
                results_bytes=4 * n * len(layout.senders) * len(layout.receivers)
                * len(layout.inputs), ig_steps=ig_steps, methods=methods)


def path_plan(arch: Any, lengths: list[int], layout: Any, *, direction: str = "denoise",
              options: PlanOptions | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Cost of a path sweep (``api.patch_paths``) of ``arch`` over prompts of ``lengths``
    tokens, from the config alone (``layout``: the ``sweep.PathLayout``; ``options``: as
    ``sweep_plan``'s); exact only (``price``).

    The engine's plan (length buckets and chunks as ``sweep.chunked`` cuts them): a path into
    layer ``l`` reruns blocks ``l..L-1`` up to its bucket's last read; each chunk runs its
    senders' runs from each sender's layer to ``l`` (a chunk's variants are sender-major) and
    one partial run per (sender, group) through the receiving layer's q/k/v (a third of a
    block); plus 2 passes per prompt (the cached runs) and ``2 + n_senders`` (each sender's node
    effect: the base, the source and one run per sender)."""
    b = basis(arch, lengths, options=options)
    lengths, n, seq, L, rows = b.lengths, b.n, b.seq, b.L, b.rows
    per_layer = layout.layer_variants
    token_blocks = 0.0
    for p0, p1 in b.buckets("paths", direction):
        c, per = lengths[p1 - 1], max(1, rows // (p1 - p0))
        for layer, v in enumerate(per_layer):
            before = [sl for sl, _ in layout.senders if sl < layer]
            if not v:
                continue
            runs = math.ceil(v / len(before) / per)  # chunks holding each sender's cells
            token_blocks += (p1 - p0) * c * (v * (L - layer) + runs * sum(
                layer - sl for sl in before) + len(before) * layout.n_groups / 3)
    p = price(Work(n, suffix=chunk_suffix(token_blocks, L, seq), cached=4 + len(layout.senders)))
    return dict(model=arch.name, n_params=arch.n_params, n_layers=L, n_heads=arch.n_heads,
                n_senders=len(layout.senders), n_receivers=len(layout.receivers),
                inputs=list(layout.inputs), n_groups=layout.n_groups, n_paths=sum(per_layer),
                n_prompts=n, seq=seq, mean_tokens=sum(lengths) / n, direction=direction,
                gpu=b.g.name, n_gpus=b.n_gpus,
                methods={"exact": b.cost(p["passes"]["exact"], rows=min(rows, max(per_layer) * n))})


def _check_inputs(gpu: str, lengths: Sequence[int], top_k: Any) -> None:
    """One line for a plan's bad arguments (an unknown GPU class, no or empty prompts, top_k)."""
    if gpu not in GPU_CLASSES:
        raise ValueError(f"gpu={gpu!r} is not a known GPU class; expected one of "
                         f"{sorted(GPU_CLASSES)}.")
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be a non-empty list of positive token counts; got "
                         f"{list(lengths)[:8]}.")
    check_top_k(top_k)
