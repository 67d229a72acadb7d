"""What a sweep will cost, from the architecture alone (no weights): ``sweep_plan`` (heads),
``edge_plan`` (edges), ``price`` (one method's row of either). Both stand on ``basis`` (the
checks, GPU count, memory, rows per forward and time on a GPU class: one road for any units);
``circuitkit info`` prints ``sweep_plan``'s rows.

``circuitkit patch --plan`` uses it when the weights are not on this machine (a 70B model is
planned before 141 GB are downloaded); with weights present the CLI measures a one-chunk probe
instead (``api.plan_patch``). Every figure is a formula of the config and the prompts' token
counts, stated here so the numbers can be checked by hand:

* **pass-equivalent**: one prompt of ``seq`` tokens through the whole model; a backward counts 2.
  Exact: the engine's chunk plan (``sweep.chunked``, same rows and length buckets as a real run),
  each chunk costing ``rows x run_length x (L - l)`` token-blocks, divided by ``L x seq``, plus
  2 per prompt (the cached clean and corrupt runs). Attribution: its registry entry's cost
  (``estimators.costs``; AtP: 4 per prompt). Attribution then exact: the screening estimator's
  passes + the verified cells (``hybrid_cells``) x ``(L + 1) / 2L`` (a cell's mean suffix) per
  prompt + 2 per prompt (the exact engine's cached runs).
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
text at ``CHARS_PER_TOKEN`` characters per token (``tasks.text.token_counts``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from circuitkit.patching.estimators.costs import (  # noqa: F401  (their home before)
    CostShape,
    block_flop_shares,
    block_screen_passes,
    head_mlp_pays,
    receiver_attn_passes,
)
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
# its cap (``api.attribution_plus_exact``'s max_fraction)
AUTO_EXPECTED_FRACTION = 0.2
AUTO_MAX_FRACTION = 0.5


def hybrid_cells(n_cells: int, per_round: int, top_k: int | None,
                 max_fraction: float = AUTO_MAX_FRACTION, recall_top: int = 10
                 ) -> tuple[int, int]:
    """(expected, at most) cells attribution+exact verifies: ``top_k`` when given; else its
    rule's floor, the first round (``2 x per_round``: the calibration cells) and rounds until
    ``recall_top`` are verified, or ``AUTO_EXPECTED_FRACTION`` of the cells if more, capped at
    ``max_fraction`` of them (``hybrid.budget_rule``). On a small model the floor dominates:
    the teacher's 32 heads verify 16 (its cap) whatever the fraction says."""
    if top_k is not None:
        return (min(top_k, n_cells),) * 2
    cap = min(n_cells, max(1, int(max_fraction * n_cells)))
    floor = min(2 * per_round, n_cells)
    if floor < recall_top:
        floor += math.ceil((min(recall_top, n_cells) - floor) / per_round) * per_round
    return min(cap, max(floor, math.ceil(AUTO_EXPECTED_FRACTION * n_cells))), cap


def exact_flops_per_token(n_params: int, n_layers: int, n_units: int, n_pos: int) -> float:
    """``2 x n_params x`` the exact sweep's pass-equivalents per prompt (``n_units x n_pos``
    patches per layer, each running ``(L - l) / L`` of the model: ``(L + 1) / 2`` on average)."""
    return 2.0 * n_params * n_units * n_pos * (n_layers + 1) / 2


def tl_loop_passes(n_cells: int, n_prompts: int) -> int:
    """Full passes of TransformerLens's patching loop: one per patched cell and prompt, plus the
    clean and corrupt runs of each prompt (``circuitkit info``'s comparison row)."""
    return (n_cells + 2) * n_prompts


def auto_method(flops_per_token: float) -> str:
    """``"exact"`` at or below ``AUTO_EXACT_MAX_FLOPS_PER_TOKEN``, else ``"attribution+exact"``."""
    return "exact" if flops_per_token <= AUTO_EXACT_MAX_FLOPS_PER_TOKEN else "attribution+exact"


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
                    seconds=passes * self.per_pass / self.rate, **extra)

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

    def hybrid_passes(self, screen: float, k: int, suffix: float) -> float:
        """attribution+exact: the screen's passes (all prompts), ``k`` verified cells per prompt
        at their mean ``suffix`` of the model, and the exact engine's two cached runs."""
        return screen + k * self.n * suffix + 2 * self.n


def basis(arch: Any, lengths: Sequence[int], *, top_k: int | None = None, gpu: str = "H100",
          utilisation: float = UTILISATION, dtype_bytes: int = 2, replicas: int = 1,
          n_gpus: int | None = None, rows: int | None = None) -> Basis:
    """The checks, GPU count, memory and time basis every plan shares (module docstring): one
    road for heads (``sweep_plan``) and edges (``edge_plan``)."""
    _check_inputs(gpu, lengths, top_k)
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation={utilisation!r}: expected a share of peak in (0, 1].")
    g = GPU_CLASSES[gpu]
    lengths = sorted(int(x) for x in lengths)
    n, seq = len(lengths), lengths[-1]
    weights = arch.n_params * dtype_bytes
    one_row = row_bytes(arch.d_model, arch.d_mlp, arch.n_heads, arch.d_vocab, seq, dtype_bytes)
    need = gpus_needed(weights, g, one_row)
    if n_gpus is not None and n_gpus < need:
        raise ValueError(f"n_gpus={n_gpus} (--gpus-per-replica): {arch.name} needs at least "
                         f"{need} {g.name} GPUs per copy ({weights / 1e9:.1f} GB of weights "
                         "plus one sequence of activations).")
    n_gpus = n_gpus or need
    budget = (g.memory_bytes - weights / n_gpus) * ACTIVATION_SHARE  # per GPU
    fit = int(max(1, min(MAX_ROWS, budget // one_row)))
    if rows is not None and rows < 1:
        raise ValueError(f"rows={rows!r} (--batch-size): expected a positive integer.")
    return Basis(g, lengths, n, seq, arch.n_layers, dtype_bytes, weights, one_row, n_gpus,
                 budget, fit, fit if rows is None else rows, flops_per_pass(arch, seq),
                 g.bf16_dense_flops * utilisation * replicas)


def price(arch: Any, lengths: Sequence[int], units: Any, method: str, **kw: Any
          ) -> dict[str, Any]:
    """One method's row (pass-equivalents, FLOPs, seconds, ...) of a sweep of ``units`` (a
    ``HeadUnits`` or ``EdgeUnits``: its ``cost_plan``, ``sweep_plan``'s or ``edge_plan``'s
    keywords in ``kw``); methods "exact", "attribution", "attribution+exact" (heads) or
    "exact", "TL loop", each edge estimator of the registry, "attribution+exact" (edges)."""
    if not callable(getattr(units, "cost_plan", None)):
        raise ValueError(f"units={units!r}: a plan prices heads or edges; pass "
                         "ck.HeadUnits(site, positions) or ck.EdgeUnits(senders, receivers, "
                         "inputs).")
    p = units.cost_plan(arch, list(lengths), **kw)
    if method not in p["methods"]:
        raise ValueError(f"method={method!r}: a {units.kind} plan prices {list(p['methods'])}.")
    return p["methods"][method]


def sweep_plan(arch: Any, lengths: list[int], *, site: str = "z", positions: str = "all",
               direction: str = "denoise", top_k: int | None = None, gpu: str = "H100",
               utilisation: float = UTILISATION, dtype_bytes: int = 2, replicas: int = 1,
               n_gpus: int | None = None, rows: int | None = None) -> dict[str, Any]:
    """Cost of a head sweep of ``arch`` (``models.Architecture``) over prompts of ``lengths``
    tokens, per method, on ``gpu`` (a key of ``GPU_CLASSES``) at ``dtype_bytes`` per element.

    ``n_gpus``: GPUs per replica (default: the fewest that hold the model, ``gpus_needed``);
    ``replicas``: model copies sharing the work (``torchrun``, ``--gpus-per-replica``);
    ``rows``: sequences per forward (``--batch-size``; default: what fits the memory left).
    Returns a dict: the inputs, ``weights_bytes``, ``n_gpus``, ``gpu``, ``auto`` (the method
    ``--method auto`` picks) and ``methods``: ``{name: {pass_equivalents, flops,
    activation_bytes, rows, n_chunks, seconds, ...}}`` for "exact", "attribution" and
    "attribution+exact". Formulas: module docstring.
    """
    b = basis(arch, lengths, top_k=top_k, gpu=gpu, utilisation=utilisation,
              dtype_bytes=dtype_bytes, replicas=replicas, n_gpus=n_gpus, rows=rows)
    g, lengths, n, seq, L, rows, cost = b.g, b.lengths, b.n, b.seq, b.L, b.rows, b.cost
    n_units = arch.n_kv_heads if site in ("k", "v") else arch.n_heads
    n_pos = seq if positions == "each" else 1
    sweep = chunked(Sweep("heads", site, direction, positions, L, n_units, n_pos, n, seq, True),
                 rows, lengths)
    token_blocks = sum(sweep.chunk_cost(c) for c in sweep.chunks)
    exact = cost(token_blocks / (L * seq) + 2 * n, rows=min(rows, n_units * n_pos * n),
                 n_chunks=len(sweep.chunks),
                 activation_bytes=min(rows, n_units * n_pos * n) * b.one_row)
    saved = b.saved_per_gpu(arch)
    att_rows = b.attribution_rows(saved)
    if rows != b.fit:  # --batch-size: the attribution passes take it too
        att_rows = min(rows, n)
    att = cost(REGISTRY["atp"].passes(CostShape(L)) * n, rows=att_rows,
               n_chunks=math.ceil(n / att_rows),
               activation_bytes=att_rows * (saved + b.one_row))
    n_cells = L * n_units * n_pos
    cells, most = hybrid_cells(n_cells, n_units * n_pos, top_k)
    shares = block_flop_shares(arch.d_model, arch.d_mlp, arch.d_head, arch.n_heads,
                               arch.n_kv_heads, seq)  # the shipped configs' MLPs are gated
    # Priced as one MLP call per head: the all-heads formula has fewer FLOPs (5.9 against 29.7
    # pass-equivalents for a Llama-3-8B shape at 16 x 256 tokens) but its elementwise passes are
    # memory-bound; measured on an H200 it took 3.0x AtP's time (12 pass-equivalents), the
    # per-head call 6.5x: conservative rather than optimistic (docs/attribution.md).
    screen = REGISTRY["block"].passes(CostShape(L, arch.n_heads, n_units * n_pos, site, *shares))

    def hybrid_passes(k: int) -> float:
        return b.hybrid_passes(screen * n, k, (L + 1) / (2 * L))

    hybrid = cost(hybrid_passes(cells), rows=att_rows,
                  n_chunks=att["n_chunks"] + math.ceil(cells * n / rows),
                  activation_bytes=att["activation_bytes"], verified_cells=cells,
                  budget="top_k" if top_k is not None else "auto", verified_cells_max=most,
                  seconds_max=hybrid_passes(most) * b.per_pass / b.rate,
                  screening_passes=screen * n)
    # host RAM of the exact engine's caches: resid_pre + the site's base and source, per layer
    site_elems = {"z": 2 * arch.n_heads * arch.d_head, "q": 2 * arch.n_heads * arch.d_head,
                  "k": 2 * arch.n_kv_heads * arch.d_head, "v": 2 * arch.n_kv_heads * arch.d_head,
                  "pattern": 2 * arch.n_heads * seq}[site]
    host = b.host_cache_bytes(arch, site_elems)
    flops_tok = exact_flops_per_token(arch.n_params, L, n_units, n_pos)
    return dict(
        model=arch.name, n_params=arch.n_params, n_layers=L, n_units=n_units, n_pos=n_pos,
        n_cells=n_cells, n_prompts=n, seq=seq, mean_tokens=sum(lengths) / n,
        site=site, positions=positions, direction=direction, top_k=top_k,
        dtype_bytes=dtype_bytes, weights_bytes=b.weights, gpu=g.name, gpu_key=gpu,
        gpu_memory_bytes=g.memory_bytes, peak_flops=g.bf16_dense_flops,
        utilisation=utilisation, n_gpus=b.n_gpus, replicas=replicas,
        activation_budget_bytes=b.budget, host_cache_bytes=host,
        exact_flops_per_token=flops_tok, auto=auto_method(flops_tok),
        methods={"exact": exact, "attribution": att, "attribution+exact": hybrid})


def format_sweep_plan(p: dict[str, Any], tokens_from: str = "",
                      weights_here: bool = False) -> str:
    """The ``--plan`` text of a ``sweep_plan`` dict (planned from the config: no weights, or
    ``weights_here`` and hypothetical prompts, ``--seq-len``)."""
    gb = 1e9
    cells = f"{p['n_layers']} layers x {p['n_units']} heads" + (
        f" x {p['n_pos']} positions" if p["n_pos"] > 1 else "")
    lines = [
        f"model        {p['model']} ({p['n_params'] / 1e9:.2f} B parameters; planned from its "
        + ("config)" if weights_here else "config, no weights on this machine)"),
        f"sweep        {cells} = {p['n_cells']:,} cells, site {p['site']}, {p['direction']}",
        f"prompts      {p['n_prompts']} of up to {p['seq']} tokens (mean {p['mean_tokens']:.1f})"
        + (f"; {tokens_from}" if tokens_from else ""),
        f"weights      {p['weights_bytes'] / gb:,.1f} GB ({p['dtype_bytes'] * 8}-bit: "
        f"{p['n_params']:,} x {p['dtype_bytes']} bytes)",
        f"GPUs         {p['n_gpus']} x {p['gpu']} per replica "
        f"({p['weights_bytes'] / p['n_gpus'] / gb:,.1f} GB of weights each, "
        f"{p['activation_budget_bytes'] / gb:,.1f} GB each for activations)"
        + (f"; {p['replicas']} replicas" if p["replicas"] > 1 else ""),
        f"host RAM     {p['host_cache_bytes'] / gb:,.1f} GB for the exact engine's cached "
        "activations (CPU)",
        f"time basis   bf16 dense peak {p['peak_flops'] / 1e12:,.0f} TFLOP/s x "
        f"{p['utilisation']:.0%} utilisation"
        + (f" x {p['replicas']} replicas" if p["replicas"] > 1 else " (one replica: a model "
           "split by layers computes on one GPU at a time)"),
        "",
        f"{'method':<25} {'pass-equiv.':>12} {'PFLOP':>10} {'activations':>13} {'chunk':>7} "
        f"{'chunks':>8} {'time':>10}",
    ]
    for name, m in p["methods"].items():
        label = name if name != "attribution+exact" else (
            f"attribution+exact@{m['verified_cells']}" if m["budget"] == "top_k"
            else f"attribution+exact@~{m['verified_cells']}")
        unit = "rows" if name == "exact" else "prompts"
        lines.append(
            # every column after a space: wide numbers (per-position sweeps) never run together
            f"{label:<25} {m['pass_equivalents']:>12,.0f} {m['flops'] / 1e15:>10,.1f} "
            f"{m['activation_bytes'] / gb:>10,.1f} GB {m['rows']:>7,} {m['n_chunks']:>8,} "
            f"{_duration(m['seconds']):>10}" + (f"  ({unit} per forward)" if name == "exact"
                                                 else ""))
    hy = p["methods"]["attribution+exact"]
    if hy["budget"] == "auto":
        lines.append(f"{'':<25}verifies as many cells as its error bound asks "
                     f"(~{AUTO_EXPECTED_FRACTION:.0%} expected; at most "
                     f"{hy['verified_cells_max']:,}: {_duration(hy['seconds_max'])})")
    lines += [
        "",
        f"--method auto picks {p['auto']} (exact sweep: {p['exact_flops_per_token']:.2g} FLOPs per "
        f"prompt token; exact at or below {AUTO_EXACT_MAX_FLOPS_PER_TOKEN:.0e})",
        "pass-equivalent: one prompt through the whole model (a backward counts 2); "
        "attribution's chunk is prompts per backward",
    ]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 0.05:  # not "0.0 s": a time too small to print at this resolution
        return "<0.1 s"
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


# --- edges ---------------------------------------------------------------------------------------


def edge_plan(arch: Any, lengths: list[int], layout: Any, *, direction: str = "denoise",
              top_k: int | None = None, ig_steps: int = 5, gpu: str = "H100",
              utilisation: float = UTILISATION, dtype_bytes: int = 2,
              n_gpus: int | None = None, rows: int | None = None) -> dict[str, Any]:
    """Cost of an edge sweep (``api.patch_edges``) of ``arch`` over prompts of ``lengths``
    tokens, per method, from the config alone (``layout``: the ``sweep.EdgeLayout``).

    Exact: the engine's plan (length buckets as ``sweep.chunked`` cuts them, at most ``rows``
    sequences per forward); an edge into layer ``l`` reruns blocks ``l..L-1`` up to its bucket's
    last read (the logits: one block's worth, the final norm and unembedding), plus one partial
    run per (sender, receiver layer) through the receiving layer's norm and q/k/v projections
    (counted as a third of a block), plus 2 passes per prompt (the cached runs). TL's loop:
    one full pass per head -> later head edge and prompt (it has no embeddings or logits).
    Attribution: each edge estimator's registry entry; attribution+exact: the eap* screen + the
    verified edges (``hybrid_cells``) x their mean suffix + 2 per prompt. Checks, time, GPUs and
    memory: ``basis``; ``results_bytes``: the per-prompt result tensor (float32, every cell)."""
    b = basis(arch, lengths, top_k=top_k, gpu=gpu, utilisation=utilisation,
              dtype_bytes=dtype_bytes, n_gpus=n_gpus, rows=rows)
    g, lengths, n, seq, L, rows, cost = b.g, b.lengths, b.n, b.seq, b.L, b.rows, b.cost
    per_layer = layout.layer_variants
    n_edges = sum(per_layer)
    # the engine's length buckets (one variant per layer: what plan cuts prompts into)
    buckets = sorted({(c.p0, c.p1) for c in chunked(
        Sweep("edges", "", direction, "all", 1, 1, 1, n, seq, True), rows, lengths).chunks})
    token_blocks, n_chunks = 0.0, 0
    senders_before = [sum(1 for sl, _ in layout.senders if sl < la) for la in range(L + 1)]
    for p0, p1 in buckets:
        c, per = lengths[p1 - 1], max(1, rows // (p1 - p0))
        for layer, v in enumerate(per_layer):
            if not v:
                continue
            token_blocks += v * (p1 - p0) * c * max(1, L - layer)
            token_blocks += senders_before[layer] * (p1 - p0) * c / 3 if layer < L else 0
            n_chunks += math.ceil(v / per)
    exact = cost(token_blocks / (L * seq) + 2 * n, n_chunks=n_chunks,
                 rows=min(rows, max(per_layer) * n), activation_bytes=min(rows, n_edges * n)
                 * b.one_row)
    # TL's loop: one forward per (head, later query head) pair and input; k/v only without GQA
    tl_inputs = [i for i in layout.inputs if i == "q" or arch.n_kv_heads == arch.n_heads]
    head_edges = sum(1 for sl, _ in layout.senders if sl >= 0 for rl, _ in layout.receivers
                     if sl < rl < L) * len(tl_inputs)
    groups = len({max(sl, -1) for sl, _ in layout.senders})
    # attribution keeps every layer's saved tensors and one residual copy per head and input
    saved = b.saved_per_gpu(arch, (arch.n_heads + 2 * arch.n_kv_heads) * arch.d_model)
    att_rows = b.attribution_rows(saved)
    methods = {"exact": exact,
               "TL loop": cost(float(head_edges * n), forwards=head_edges)}
    attn_share = block_flop_shares(arch.d_model, arch.d_mlp, arch.d_head, arch.n_heads,
                                   arch.n_kv_heads, seq)[0]
    pairs = sum(senders_before[la] for la in {rl for rl, _ in layout.receivers if rl < L})
    shape = CostShape(L, ig_steps=ig_steps, n_sender_groups=groups,
                      receiver_attn=receiver_attn_passes(attn_share, L, len(layout.inputs), pairs))
    for est in (e for e in REGISTRY.values() if e.units == "edges"):
        methods[est.name] = cost(est.passes(shape) * n, rows=att_rows,
                            activation_bytes=att_rows * (saved + b.one_row))
    cells = hybrid_cells(n_edges, len(layout.inputs) * arch.n_heads, top_k)[0]
    mean_suffix = sum(v * max(1, L - la) for la, v in enumerate(per_layer)) / max(1, n_edges * L)
    methods["attribution+exact"] = cost(
        b.hybrid_passes(methods["eap*"]["pass_equivalents"], cells, mean_suffix),
        verified_edges=cells, budget="top_k" if top_k is not None else "auto")
    host = b.host_cache_bytes(arch, arch.n_heads * arch.d_head)
    results = 4 * n * len(layout.senders) * len(layout.receivers) * len(layout.inputs)
    return dict(model=arch.name, n_params=arch.n_params, n_layers=L, n_heads=arch.n_heads,
                n_kv_heads=arch.n_kv_heads, n_senders=len(layout.senders),
                n_receivers=len(layout.receivers), inputs=list(layout.inputs),
                n_edges=n_edges, head_edges=head_edges, n_prompts=n, seq=seq,
                mean_tokens=sum(lengths) / n, direction=direction, dtype_bytes=dtype_bytes,
                weights_bytes=b.weights, gpu=g.name, n_gpus=b.n_gpus, utilisation=utilisation,
                peak_flops=g.bf16_dense_flops, activation_budget_bytes=b.budget,
                host_cache_bytes=host, results_bytes=results, ig_steps=ig_steps,
                methods=methods)


def path_plan(arch: Any, lengths: list[int], layout: Any, *, direction: str = "denoise",
              gpu: str = "H100", utilisation: float = UTILISATION, dtype_bytes: int = 2,
              n_gpus: int | None = None, rows: int | None = None) -> dict[str, Any]:
    """Cost of a path sweep (``api.patch_paths``) of ``arch`` over prompts of ``lengths``
    tokens, from the config alone (``layout``: the ``sweep.PathLayout``); exact only.

    The engine's plan (length buckets and chunks as ``sweep.chunked`` cuts them): a path into
    layer ``l`` reruns blocks ``l..L-1`` up to its bucket's last read; each chunk runs its
    senders' runs from each sender's layer to ``l`` (a chunk's variants are sender-major) and
    one partial run per (sender, group) through the receiving layer's q/k/v (a third of a
    block); plus 2 passes per prompt (the cached runs) and ``2 + n_senders`` (each sender's node
    effect: the base, the source and one run per sender)."""
    b = basis(arch, lengths, gpu=gpu, utilisation=utilisation, dtype_bytes=dtype_bytes,
              n_gpus=n_gpus, rows=rows)
    lengths, n, seq, L, rows = b.lengths, b.n, b.seq, b.L, b.rows
    per_layer = layout.layer_variants
    buckets = sorted({(c.p0, c.p1) for c in chunked(
        Sweep("paths", "", direction, "all", 1, 1, 1, n, seq, True), rows, lengths).chunks})
    token_blocks = 0.0
    for p0, p1 in buckets:
        c, per = lengths[p1 - 1], max(1, rows // (p1 - p0))
        for layer, v in enumerate(per_layer):
            before = [sl for sl, _ in layout.senders if sl < layer]
            if not v:
                continue
            runs = math.ceil(v / len(before) / per)  # chunks holding each sender's cells
            token_blocks += (p1 - p0) * c * (v * (L - layer) + runs * sum(
                layer - sl for sl in before) + len(before) * layout.n_groups / 3)
    exact = b.cost(token_blocks / (L * seq) + (4 + len(layout.senders)) * n,
                   rows=min(rows, max(per_layer) * n))
    return dict(model=arch.name, n_params=arch.n_params, n_layers=L, n_heads=arch.n_heads,
                n_senders=len(layout.senders), n_receivers=len(layout.receivers),
                inputs=list(layout.inputs), n_groups=layout.n_groups, n_paths=sum(per_layer),
                n_prompts=n, seq=seq, mean_tokens=sum(lengths) / n, direction=direction,
                gpu=b.g.name, n_gpus=b.n_gpus, methods={"exact": exact})


def format_edge_plan(p: dict[str, Any], tokens_from: str = "") -> str:
    """The ``circuitkit edges --plan`` text of an ``edge_plan`` dict. Optional keys the CLI
    adds: ``measured`` (the parameters were counted on the loaded weights), ``chosen`` (the
    row of ``--method`` / ``--estimator``, marked), ``top_k_hint`` ((k, the hybrid's row at
    ``top_k=k``): what a smaller verification budget costs)."""
    gb, n = 1e9, p["n_params"]
    size = f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else \
        f"{n / 1e3:.0f} k"
    source = ("the weights are here: parameters and prompts measured" if p.get("measured")
              else "planned from its config, no weights needed")
    lines = [
        f"model        {p['model']} ({size} parameters; {source})",
        f"edges        {p['n_senders']:,} senders x {p['n_receivers']:,} receivers, inputs "
        f"{','.join(p['inputs'])}: {p['n_edges']:,} edges",
        f"prompts      {p['n_prompts']} of up to {p['seq']} tokens (mean {p['mean_tokens']:.1f})"
        + (f"; {tokens_from}" if tokens_from else ""),
        f"weights      {p['weights_bytes'] / gb:,.1f} GB on {p['n_gpus']} x {p['gpu']}",
        f"host RAM     {p['host_cache_bytes'] / gb:,.1f} GB for the exact engine's cached "
        f"activations; results {p['results_bytes'] / gb:,.2f} GB (per-prompt values)",
        f"time basis   {p['gpu']} (--gpu): bf16 dense peak {p['peak_flops'] / 1e12:,.0f} "
        f"TFLOP/s x {p['utilisation']:.0%} utilisation",
        "             (GPU time only, there is no CPU class: on a CPU, time a run with a small -n)",
        "",
        f"{'method':<26} {'pass-equiv.':>14} {'PFLOP':>11} {'GPU time':>10}",
    ]
    chosen = p.get("chosen")
    for name, m in p["methods"].items():
        label = "TL direct-path loop" if name == "TL loop" else (
            f"attribution+exact@{m['verified_edges']:,}" if name == "attribution+exact"
            else name)
        if name.startswith("eap-ig"):
            label += f" (m={p['ig_steps']})"
        mark = "  <- --method" if name == chosen else ""
        lines.append(f"{label:<26} {m['pass_equivalents']:>14,.0f} {m['flops'] / 1e15:>11,.1f} "
                     f"{_duration(m['seconds']):>10}{mark}")
    lines += ["", "pass-equivalent: one prompt through the whole model (a backward counts 2)",
              f"TL's loop: one forward per head -> head edge it supports ({p['head_edges']:,}; "
              "q only under GQA) and prompt"]
    if p.get("top_k_hint"):
        (k, m), full = p["top_k_hint"], p["methods"]["attribution+exact"]["verified_edges"]
        lines.append(f"attribution+exact verifies {full:,} edges by default (the screen's error "
                     f"bound); --top-k {k} verifies {k}: {m['pass_equivalents']:,.0f} "
                     f"pass-equivalents, {_duration(m['seconds'])}")
    return "\n".join(lines)


def _check_inputs(gpu: str, lengths: Sequence[int], top_k: Any) -> None:
    """One line for a plan's bad arguments (an unknown GPU class, no or empty prompts, top_k)."""
    if gpu not in GPU_CLASSES:
        raise ValueError(f"gpu={gpu!r} is not a known GPU class; expected one of "
                         f"{sorted(GPU_CLASSES)}.")
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be a non-empty list of positive token counts; got "
                         f"{list(lengths)[:8]}.")
    check_top_k(top_k)
