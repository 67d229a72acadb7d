"""Exact activation patching, batched and restarted at the patched layer.

A patch at layer ``l`` cannot change anything upstream of ``l``. So one cached run of the *base*
tokens stores ``resid_pre(l)`` for every layer, one run of the *source* tokens stores the source
activations at the patched site, and each patched run re-enters the model at block ``l`` from
the cached residual. Variants (heads, or heads x positions) of one layer are stacked in the batch
dimension, ``[n_variants * n_prompts, seq, d_model]``, and a forward hook at the site of layer
``l`` writes the source activation into variant ``i``'s head slice only.

Direction: ``denoise`` = base corrupt, source clean; ``noise`` = base clean, source corrupt.

TransformerLens 4.3's ``TransformerBridge.forward(start_at_layer=l)`` still executes blocks
``0..l-1`` (it discards their output when block ``l`` swaps the residual in; measured: every
block's forward ran). ``shortcuts.skipped_blocks`` therefore turns blocks below ``l`` into
identities for the duration of the run, so only embedding lookup (needed by HF to size
positions/masks; rotary positions come from the sequence length as in a normal run) and blocks
``l..L-1`` run.

Inside the blocks, the *fast path* skips two more pieces of work the patch cannot change:

* sites ``z``, ``attn_out``, ``mlp_out``: block ``l``'s attention is not re-run; its output is
  known. For ``z`` the attention's output is its affine output projection ``o`` of z, so
  ``attn_out = o(z_base) + (z_source - z_base)[:, :, h] @ W_O[h]``; for ``attn_out`` it is the
  cached base output with the patched position from the source; for ``mlp_out`` the base one,
  and the MLP returns its cached output with the patched position from the source;
* with a metric that declares ``reads`` (``PromptMetric.reads``, per prompt), the last block's
  MLP and the unembedding are computed at those positions only, and so are the last block's
  attention queries where ``shortcuts`` can reproduce its attention (rotary Llama form).

Both replace module ``forward``s for the duration of one run (``patching/shortcuts.py``), so
they hold for any block layout (sequential, parallel, post-norm). Before use, the engine checks
the fast path against the plain hooked path on a probe chunk of the model at hand and falls back
(with a warning) if they differ by more than ``FAST_PATH_TOL``.

Causal models: nothing after a prompt's last read position can change its metric. Runs stop
there (``ExactEngine._cut``), and the sweep orders prompts by that length (``_length_order``;
results come back in the caller's order), so chunks of short prompts stop early.

Work is cut into *chunks* (one layer, a range of variants, a range of prompts). Each chunk's
result is a ``[n_variants, n_prompts]`` tensor; chunks are independent, which is what makes
checkpointing (a folder of chunk files, ``SweepCheckpoint``) and sharding across
``torchrun`` ranks (``distributed.py``) simple and bit-reproducible: the chunk plan is fixed up
front and stored with the checkpoint, and a chunk's numbers never depend on who computes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import einops
import torch
from jaxtyping import Float, Int
from torch import Tensor

from circuitkit import hooks
from circuitkit.patching import shortcuts
from circuitkit.patching.inputs import (
    DIRECTIONS,
    HEAD_SITES,
    LAYER_SITES,
    METHODS,
    POSITIONS,
    check_tokens,
    choice,
)
from circuitkit.patching.results import PatchResult

MAX_ROWS = 1024  # cap on sequences per forward: bigger batches gain nothing and hurt latency
# Max |fast - plain| on the probe chunk, relative to max(1, |metric|), by weight dtype: the two
# paths round differently (the z write is added after the output projection, not inside it).
FAST_PATH_TOL = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 2e-2,
                 torch.bfloat16: 5e-2}
# Sites whose patch leaves block l's attention computation to a cached output (fast path).
ATTN_OUTPUT_SITES = frozenset({("heads", "z"), ("layers", "attn_out"), ("layers", "mlp_out")})


# --- validation ---------------------------------------------------------------------------------


def _is_prompt_metric(metric: Any) -> bool:
    return hasattr(metric, "per_prompt") and hasattr(metric, "select")


def _metric_name(metric: Any) -> str:
    return str(getattr(metric, "name", None) or getattr(metric, "__name__", type(metric).__name__))


def _reads(metric: Any) -> Int[Tensor, "n k"] | None:
    """Per-prompt logit positions a PromptMetric declares it reads (None: it may read any)."""
    if not _is_prompt_metric(metric) or getattr(metric, "reads", None) is None:
        return None
    return metric.read_positions() if hasattr(metric, "read_positions") else metric.reads


def _evaluate(metric: Any, logits: Tensor, n_prompts: int, what: str,
              at: Tensor | None = None) -> Tensor:
    """Metric of one [n_prompts, seq, vocab] batch: per-prompt [n] or scalar [1] (validated).

    ``at``: the logits hold only these positions (see ``PromptMetric.reads``)."""
    if _is_prompt_metric(metric):
        out = metric.per_prompt(logits) if at is None else metric.per_prompt(logits, at=at)
        if out.shape != (n_prompts,):
            raise ValueError(f"metric.per_prompt must return [{n_prompts}] values ({what}); got "
                             f"shape {tuple(out.shape)}.")
    else:
        out = torch.as_tensor(metric(logits))
        if out.ndim != 0:
            raise ValueError(
                f"metric must return a scalar tensor ({what}); got shape {tuple(out.shape)}. "
                "Average over prompts inside the metric, or pass a PromptMetric "
                "(circuitkit.metrics) for per-prompt values.")
        out = out[None]
    out = out.detach().float().cpu()
    if not torch.isfinite(out).all():
        raise ValueError(f"metric returned a non-finite value ({what}): {out.tolist()[:8]}. "
                         "Check the answer positions/tokens it reads and the logits' dtype.")
    return out


# --- the suffix run ---------------------------------------------------------------------------


# --- sweep description --------------------------------------------------------------------------


@dataclass
class Sweep:
    """What to patch: ``n_layers`` layers x ``n_units`` heads (1 for layer sites) x ``n_pos``."""

    kind: str  # "heads" | "layers"
    site: str
    direction: str
    positions: str
    n_layers: int
    n_units: int
    n_pos: int  # seq for per-position sweeps, else 1
    n_prompts: int
    seq: int
    per_prompt: bool  # metric has a per-prompt view
    chunks: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # chunk = (layer, variant_start, variant_end, prompt_start, prompt_end)
    cuts: list[int] | None = None  # positions each prompt needs (set by ``plan``)

    @property
    def n_variants(self) -> int:
        return self.n_units * self.n_pos

    def variant(self, v: int) -> tuple[int, int | None]:
        """Variant index -> (unit, pos or None); layout unit-major: v = unit * n_pos + pos."""
        unit, pos = divmod(v, self.n_pos)
        return unit, (pos if self.positions == "each" else None)

    def value_shape(self) -> tuple[int, ...]:
        if self.kind == "layers":
            return (self.n_layers, self.n_pos)
        if self.positions == "each":
            return (self.n_layers, self.n_units, self.n_pos)
        return (self.n_layers, self.n_units)

    def chunk_cost(self, chunk: tuple[int, ...]) -> int:
        """Token-blocks a chunk runs: rows x positions (up to its prompts' ``cuts``) x blocks."""
        layer, v0, v1, p0, p1 = chunk
        length = max(self.cuts[p0:p1]) if self.cuts else self.seq
        return (v1 - v0) * (p1 - p0) * length * (self.n_layers - layer)

    def plan(self, rows: int, cuts: Sequence[int] | None = None) -> None:
        """Cut the work into chunks of at most ``rows`` sequences per forward pass.

        ``cuts``: positions each prompt needs (ascending; see ``_length_order``). When all
        prompts fit in one forward, they are split in two length buckets if that saves >= 10%
        of the token-rows (a chunk runs up to its longest prompt); each bucket keeps >= 1/4 of
        the prompts so forwards stay large.
        """
        rows = max(1, int(rows))
        self.chunks, self.cuts = [], None if cuts is None else list(cuts)
        n = self.n_prompts
        if rows >= n or not self.per_prompt:
            buckets = [(0, n)]
            if cuts is not None and self.per_prompt and n >= 4:
                cost = {s: s * cuts[s - 1] + (n - s) * cuts[-1] for s in range(n // 4, n - n // 4)}
                best = min(cost, key=cost.__getitem__, default=None)
                if best and cost[best] <= 0.9 * n * cuts[-1]:
                    buckets = [(0, best), (best, n)]
            for layer in range(self.n_layers):
                for p0, p1 in buckets:
                    per = max(1, rows // (p1 - p0))
                    for v0 in range(0, self.n_variants, per):
                        self.chunks.append((layer, v0, min(v0 + per, self.n_variants), p0, p1))
        else:  # prompts split: one variant per forward (needs a per-prompt metric)
            for layer in range(self.n_layers):
                for v in range(self.n_variants):
                    for p0 in range(0, n, rows):
                        self.chunks.append((layer, v, v + 1, p0, min(p0 + rows, n)))


def _length_order(metric: Any) -> tuple[Tensor | None, list[int] | None]:
    """Prompt order by the positions each prompt's metric needs (last read + 1), ascending, and
    those lengths in that order; ``(None, None)`` when the metric declares no reads. Chunks of
    similar prompts then stop early (``ExactEngine._cut``)."""
    reads = _reads(metric)
    if reads is None:
        return None, None
    need = reads.max(1).values + 1
    order = torch.argsort(need, stable=True)
    return order, need[order].tolist()


def _sorted_and_planned(clean: Tensor, corrupt: Tensor, metric: Any, sweep: Sweep, rows: int
                        ) -> tuple[Tensor, Tensor, Any, Tensor | None]:
    """Prompts sorted by length (``_length_order``; per-prompt metrics only) and the sweep
    planned for them. Returns the sorted inputs and the order (None: unchanged)."""
    order, cuts = _length_order(metric) if sweep.per_prompt else (None, None)
    if order is not None:
        clean, corrupt, metric = clean[order], corrupt[order], metric.select(order)
    sweep.plan(rows, cuts)
    return clean, corrupt, metric, order


def bytes_per_row(model: Any, seq: int) -> int:
    """Rough peak bytes of one sequence in a no-grad forward (activations of one block + logits)."""
    f = hooks.facts(model)
    d_mlp = int(getattr(model.cfg, "d_mlp", None) or 4 * f.d_model)
    elem = next(model.parameters()).element_size()
    per_tok = 8 * f.d_model + 3 * d_mlp + 3 * f.n_heads * seq + 3 * f.d_vocab
    return int(elem * seq * per_tok * 1.5)  # 1.5: allocator slack, hook copies


def available_bytes(device: torch.device) -> int:
    """Free memory usable by activations: a share of free GPU memory or of available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.7)
    import psutil

    return int(psutil.virtual_memory().available * 0.4)


def auto_rows(model: Any, seq: int) -> int:
    device = next(model.parameters()).device
    return max(1, min(MAX_ROWS, available_bytes(device) // bytes_per_row(model, seq)))


# --- identity (for checkpoints) ---------------------------------------------------------------


def tokens_hash(*tokens: Tensor) -> str:
    h = hashlib.sha256()
    for t in tokens:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().long().numpy().tobytes())
    return h.hexdigest()[:16]


def model_fingerprint(model: Any) -> str:
    """Hash of the shape facts, the model name and a sample of the first and last weights."""
    h = hashlib.sha256(json.dumps(hooks.facts(model).to_dict(), sort_keys=True).encode())
    h.update(str(getattr(model.cfg, "model_name", "")).encode())
    params = list(model.parameters())
    for p in (params[0], params[-1]):
        h.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("circuitkit", "torch", "transformer-lens", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "?"
    return out


# --- the engine ---------------------------------------------------------------------------------


class ExactEngine:
    """Caches the base/source runs once, then computes any chunk of a ``Sweep``.

    ``fast``: use the fast path (module docstring); ``None`` = after checking it on a probe.
    """

    def __init__(self, model: Any, clean: Tensor, corrupt: Tensor, metric: Any, sweep: Sweep,
                 fast: bool | None = None, rows: int | None = None):
        self.model, self.metric, self.sweep = model, metric, sweep
        self.device = next(model.parameters()).device
        self.reads = _reads(metric)
        # Causal model: positions after the last one the metric reads cannot matter. Runs stop
        # there; a per-position patch beyond it is a no-op (its value is the base metric).
        self.cut = sweep.seq if self.reads is None else int(self.reads.max()) + 1
        base, source = (corrupt, clean) if sweep.direction == "denoise" else (clean, corrupt)
        self.base = base[:, :self.cut].to(self.device)
        self.source = source[:, :self.cut].to(self.device)
        L = sweep.n_layers
        self.site_names = [self._site_name(layer) for layer in range(L)]
        self.attn_cached = (sweep.kind, sweep.site) in ATTN_OUTPUT_SITES
        # Cached per layer: resid_pre (the restart point); for the fast path the base attention
        # output (attn_out, mlp_out sites; for z it is o(z_base), so only z_base is kept) and
        # the base activation of the site (z: for the write; mlp_out: the output to patch).
        base_names = [hooks.resid_pre(layer) for layer in range(L)]
        if self.attn_cached and sweep.site != "z":
            base_names += [hooks.attn_out(layer) for layer in range(L)]
        if self.attn_cached and sweep.site != "attn_out":
            base_names += self.site_names
        with torch.no_grad():
            self.block_arity, self.attn_arity = shortcuts.output_arity(model, self.base)
            (self.base_metric, self.source_metric), cache = self._cached_runs(
                [self.base, self.source], [*base_names, *self.site_names],
                rows or auto_rows(model, self.cut))
            self.resid = [cache[hooks.resid_pre(layer)][0] for layer in range(L)]
            self.attn_base = [cache[hooks.attn_out(layer)][0] for layer in range(L)] \
                if self.attn_cached and sweep.site != "z" else []
            self.site_base = [cache[n][0] for n in self.site_names] \
                if self.attn_cached and sweep.site != "attn_out" else []
            self.src = [cache[n][1] for n in self.site_names]
            del cache
            self._check_head_axis()
            self.W_O = [b.attn.W_O.detach() for b in model.blocks] \
                if self.attn_cached and sweep.site == "z" else []
            self.attn_at_rows = shortcuts.supports_attention_at_rows(
                model.blocks[L - 1].attn)
            self.fast = self._fast_path_agrees() if fast is None else fast

    def _cached_runs(self, token_sets: Sequence[Tensor], names: Sequence[str], rows: int
                     ) -> tuple[list[Tensor], dict[str, list[Tensor]]]:
        """Metric of unpatched runs of each ``[n, seq]`` token set and their activations at
        ``names`` (``cache[name][set]``, stored on the CPU). The sets run stacked in the batch,
        at most ``rows`` sequences per forward."""
        want, n = set(names), self.sweep.n_prompts
        tokens = torch.cat(list(token_sets))
        reads = None if self.reads is None else self.reads.repeat(len(token_sets), 1)
        logits, acts = [], {name: [] for name in want}
        for r0 in range(0, tokens.shape[0], rows):
            fwd_hooks = []
            if reads is not None:
                idx = reads[r0:r0 + rows].to(self.device)
                fwd_hooks = [(hooks.UNEMBED_IN, shortcuts.gather_rows(idx))]
            with self.model.hooks(fwd_hooks=fwd_hooks), shortcuts.attn_result_off(self.model):
                out, cache = self.model.run_with_cache(tokens[r0:r0 + rows],
                                                       names_filter=lambda name: name in want)
            logits.append(out)
            # Caches live on the CPU when the model is on a GPU: a 70B sweep's per-layer source
            # patterns would not fit next to the weights. Each layer's slice moves on demand.
            for name in want:
                acts[name].append(cache[name].to("cpu"))
            del cache
        all_logits = torch.cat(logits)
        whats = ("unpatched base run", "unpatched source run")
        values = [_evaluate(self.metric, all_logits[i * n:(i + 1) * n], n, whats[i % 2],
                            at=self.reads) for i in range(len(token_sets))]
        return values, {name: list(torch.cat(a).split(n)) for name, a in acts.items()}

    def _check_head_axis(self) -> None:
        sw = self.sweep
        if sw.kind != "heads":
            return
        got = self.src[0].shape[hooks.head_axis(sw.site)]
        if got != sw.n_units:
            raise ValueError(
                f"site={sw.site!r}: the model's activation has {got} heads on the head axis but "
                f"its cfg implies {sw.n_units} (n_key_value_heads="
                f"{hooks.facts(self.model).n_kv_heads}). The cfg lacks correct GQA info; set "
                f"model.cfg.n_key_value_heads = {got}, or "
                "patch site='z' or 'q'.")

    def _site_name(self, layer: int) -> str:
        if self.sweep.kind == "layers":
            return hooks.layer_site(self.sweep.site, layer)
        return hooks.head_site(self.sweep.site, layer)

    @property
    def clean_metric(self) -> Tensor:
        return self.source_metric if self.sweep.direction == "denoise" else self.base_metric

    @property
    def corrupt_metric(self) -> Tensor:
        return self.base_metric if self.sweep.direction == "denoise" else self.source_metric

    def _cut(self, p0: int, p1: int) -> int:
        """Positions prompts ``p0:p1`` need: up to their last read (causal model)."""
        return self.cut if self.reads is None else int(self.reads[p0:p1].max()) + 1

    def _span(self, cached: Tensor, p0: int, p1: int, cut: int, site: bool = False) -> Tensor:
        """Prompts ``p0:p1``, positions ``< cut`` of a cached activation, on the device.
        ``site``: it is the swept site's activation (a pattern has two position axes)."""
        t = cached[p0:p1]
        t = t[:, :, :cut, :cut] if site and self.sweep.site == "pattern" else t[:, :cut]
        return t.to(self.device)

    def _write_patch(self, act: Tensor, src: Tensor, variants: Sequence[int],
                     cut: int) -> Tensor:
        """Write ``src``'s slice of each variant into ``act`` ([n_var * n_p, ...], in place).

        Head sites: head axis from ``hooks.head_axis`` (2 for q/k/v/z, 1 for pattern); the
        position axis is the one after batch for vectors, ``query_pos`` for patterns.
        Layer sites: ``[batch, pos, d_model]``, patched at one position. Positions ``>= cut``
        come after every read position: patching them changes nothing, so they are skipped.
        """
        sw = self.sweep
        n_p = src.shape[0]
        view = act.view(len(variants), n_p, *act.shape[1:])
        for i, v in enumerate(variants):
            unit, pos = sw.variant(v)
            if pos is not None and pos >= cut:
                continue
            if sw.kind == "layers":
                view[i, :, pos] = src[:, pos]
                continue
            idx: list[Any] = [slice(None)] * src.ndim
            idx[hooks.head_axis(sw.site)] = unit
            if pos is not None:
                idx[2 if sw.site == "pattern" else 1] = pos
            view[i][tuple(idx)] = src[tuple(idx)]
        return act

    def _attn_output(self, layer: int, variants: Sequence[int], p0: int, p1: int, cut: int
                     ) -> Float[Tensor, "n_var_x_n_p seq d_model"]:
        """Block ``layer``'s attention output under each variant's patch, without running it.

        z: ``o(z_base) + (z_source - z_base)[:, :, h] @ W_O[h]`` (the attention's output is its
        output projection ``o`` of z, affine); attn_out: the source output at the patched
        position; mlp_out: the base output.
        """
        sw, n_v = self.sweep, len(variants)
        src = self._span(self.src[layer], p0, p1, cut, site=True)
        if sw.site != "z":
            out = self._span(self.attn_base[layer], p0, p1, cut).repeat(n_v, 1, 1)
            return self._write_patch(out, src, variants, cut) if sw.site == "attn_out" else out
        z_base = self._span(self.site_base[layer], p0, p1, cut, site=True)  # [n_p, pos, h, d]
        out = self.model.blocks[layer].attn.o(z_base.flatten(-2)).repeat(n_v, 1, 1)
        dz = src - z_base
        W_O = self.W_O[layer]  # [head, d_head, d_model]
        view = out.view(n_v, p1 - p0, *out.shape[1:])
        cells = [sw.variant(v) for v in variants]
        if sw.positions == "all":
            heads = torch.tensor([h for h, _ in cells], device=self.device)
            view += einops.einsum(dz[:, :, heads], W_O[heads],
                                  "b pos v dh, v dh dm -> v b pos dm")
        else:
            for i, (h, pos) in enumerate(cells):
                if pos < cut:
                    view[i, :, pos] += dz[:, pos, h] @ W_O[h]
        return out

    def run_chunk(self, chunk: tuple[int, int, int, int, int]) -> Float[Tensor, "n_var n_p"]:
        """Metric after each patch of the chunk: ``[n_variants, n_prompts]`` ([n_variants, 1] for a
        scalar metric)."""
        layer, v0, v1, p0, p1 = chunk
        return self.run_variants(layer, range(v0, v1), p0, p1)

    @torch.no_grad()
    def run_variants(self, layer: int, variants: Sequence[int], p0: int, p1: int,
                     fast: bool | None = None) -> Float[Tensor, "n_var n_p"]:
        """Metric after patching each of ``variants`` (any subset) of ``layer``, on prompts
        ``p0:p1``, all in one suffix forward: ``[len(variants), p1 - p0]`` (``[., 1]`` for a
        scalar metric, which needs all prompts). ``fast``: override ``self.fast``."""
        sw, model = self.sweep, self.model
        fast = self.fast if fast is None else fast
        n_v, n_p, cut = len(variants), p1 - p0, self._cut(p0, p1)
        x = self._span(self.resid[layer], p0, p1, cut).repeat(n_v, 1, 1)  # variant-major rows
        src = self._span(self.src[layer], p0, p1, cut, site=True)
        block, last = model.blocks[layer], model.blocks[sw.n_layers - 1]
        forwards = shortcuts.skipped_blocks(model, layer, self.block_arity)
        fwd_hooks = []
        if fast and self.attn_cached:
            attn = self._attn_output(layer, variants, p0, p1, cut)
            forwards.append((block.attn, shortcuts.returning(attn, self.attn_arity)))
            if sw.site == "mlp_out":
                mlp = self._write_patch(self._span(self.site_base[layer], p0, p1, cut)
                                        .repeat(n_v, 1, 1), src, variants, cut)
                forwards.append((block.mlp, shortcuts.returning(mlp, 0)))
        elif sw.kind == "layers" and sw.site == "resid_pre":
            self._write_patch(x, src, variants, cut)  # the patch *is* the restart point
        else:
            def hook(act: Tensor, hook: Any) -> Tensor:
                return self._write_patch(act, src, variants, cut)

            fwd_hooks = [(self.site_names[layer], hook)]
        metric = self.metric
        if _is_prompt_metric(metric) and (p0, p1) != (0, sw.n_prompts):
            metric = metric.select(list(range(p0, p1)))
        at = None if self.reads is None else self.reads[p0:p1]
        if at is not None:
            # Unembed only the positions the metric reads: with a big vocabulary the
            # unembedding costs as much as several blocks, and most positions are never read.
            rows = at.to(self.device).repeat(n_v, 1)
            # (After the final norm: HF GPT-2 reshapes the norm's output to the input's shape.)
            fwd_hooks.append((hooks.UNEMBED_IN, shortcuts.gather_rows(rows)))
            if fast and not (sw.site == "mlp_out" and block is last):
                forwards.append((last.mlp, shortcuts.mlp_at_rows(last.mlp, rows)))
            if fast and block is not last and self.attn_at_rows:
                forwards.append((last.attn, shortcuts.attention_at_rows(
                    last.attn, rows, self.attn_arity)))
        with shortcuts.overridden(forwards), model.hooks(fwd_hooks=fwd_hooks), \
                shortcuts.attn_result_off(model):
            logits = model(x, start_at_layer=layer)
        what = f"patched layer {layer}, variants {variants[0]}..{variants[-1]}"
        if _is_prompt_metric(metric):  # one call for all variants: rows are (variant, prompt)
            tiled = metric.select(list(range(n_p)) * n_v)
            return _evaluate(tiled, logits, n_v * n_p, what,
                             at=None if at is None else at.repeat(n_v, 1)).view(n_v, n_p)
        return torch.stack([_evaluate(metric, logits[i * n_p:(i + 1) * n_p], n_p, what, at=at)
                            for i in range(n_v)])

    def _fast_path_agrees(self) -> bool:
        """Whether the fast path matches the plain hooked path on a probe of this model.

        Probe: layer 0 (every later block runs), the first and last unit, patched at all
        positions or (per-position sweeps) at the first prompt's last read position, on two
        prompts (all of them for a scalar metric)."""
        sw = self.sweep
        if not self.attn_cached and self.reads is None:
            return True  # nothing to speed up
        # The verdict depends on the architecture, not on weights or inputs: once per model.
        verdicts = self.model.__dict__.setdefault("_circuitkit_fast_path", {})
        key = (sw.kind, sw.site, sw.positions, self.reads is not None)
        if key not in verdicts:
            verdicts[key] = self._probe_fast_path()
        return verdicts[key]

    def _probe_fast_path(self) -> bool:
        sw = self.sweep
        p1 = min(2, sw.n_prompts) if sw.per_prompt else sw.n_prompts
        pos = 0
        if sw.n_pos > 1:
            pos = int(self.reads[0].max()) if self.reads is not None else sw.seq - 1
        variants = sorted({pos, (sw.n_units - 1) * sw.n_pos + pos})
        fast = self.run_variants(0, variants, 0, p1, fast=True)
        plain = self.run_variants(0, variants, 0, p1, fast=False)
        err = float((fast - plain).abs().max())
        tol = FAST_PATH_TOL.get(next(self.model.parameters()).dtype, 5e-2)
        if err <= tol * max(1.0, float(plain.abs().max())):
            return True
        warnings.warn(
            f"circuitkit: the fast exact-patching path differs from the plain hooked path by "
            f"{err:.2e} on this model ({type(self.model.blocks[0]).__name__} blocks); using the "
            "plain path (slower, still exact). Please report the architecture.", stacklevel=3)
        return False

    def assemble(self, done: dict[int, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Chunk results -> (values [value_shape], per_prompt [n_prompts, *value_shape] | None)."""
        sw = self.sweep
        width = sw.n_prompts if sw.per_prompt else 1
        grid = torch.full((sw.n_layers, sw.n_variants, width), float("nan"))
        for cid, (layer, v0, v1, p0, p1) in enumerate(sw.chunks):
            grid[layer, v0:v1, (p0 if sw.per_prompt else 0):(p1 if sw.per_prompt else 1)] = \
                done[cid]
        shape = sw.value_shape()
        values = grid.mean(-1).reshape(shape)
        per_prompt = grid.permute(2, 0, 1).reshape(sw.n_prompts, *shape) if sw.per_prompt \
            else None
        return values, per_prompt

    # --- head sets patched together (causal validation) -------------------------------------
    @torch.no_grad()
    def run_head_sets(self, head_sets: Sequence[Sequence[tuple[int, int]]], p0: int = 0,
                      p1: int | None = None, metrics: Sequence[Any] | None = None,
                      rows: int | None = None) -> Float[Tensor, "n_metrics n_sets n_p"]:
        """Metrics after patching each head set *together*: every ``(layer, head)`` of a set gets
        its source ``z`` at all positions, at every layer the set spans, in one run.

        Needs a sweep over site ``z`` (the engine caches ``resid_pre`` and source ``z`` of every
        layer). Sets are grouped by their lowest layer ``l0``; a group's sets are stacked in the
        batch (set-major rows ``[n_sets * n_p, seq, d_model]``) and re-enter the model at
        ``l0`` from the cached base ``resid_pre(l0)``; a hook at ``z(l)`` of every layer ``l``
        the group touches writes the source ``z`` of each set's heads at ``l`` into that set's
        rows. The empty set is the unpatched base run. Plain hooked path (no cached attention
        outputs); with ``reads`` only the read positions are unembedded.

        ``metrics``: per-prompt metrics evaluated on the same patched logits (default: the
        engine's metric); each must declare ``reads`` within the engine metric's (PromptMetric
        ``reads``), or the engine's metric must read every position. Prompts ``p0:p1`` (default
        all; a scalar metric needs all). ``rows``: sequences per forward (default from free
        memory). Returns ``[len(metrics), len(head_sets), p1 - p0]`` (``[., ., 1]`` for a scalar
        metric).
        """
        sw, model = self.sweep, self.model
        if (sw.kind, sw.site, sw.positions) != ("heads", "z", "all"):
            raise ValueError("run_head_sets needs an engine built for site='z', positions='all' "
                             f"(got kind={sw.kind!r}, site={sw.site!r}, "
                             f"positions={sw.positions!r}).")
        p1 = sw.n_prompts if p1 is None else p1
        metrics = [self.metric] if metrics is None else list(metrics)
        for i, m in enumerate(metrics):
            if not _is_prompt_metric(m) and (p0, p1) != (0, sw.n_prompts):
                raise ValueError(f"metrics[{i}] has no per-prompt view; run all prompts (p0=0, "
                                 "p1=None) or pass a PromptMetric.")
            if self.reads is not None and m is not self.metric:
                mine = _reads(m)
                if mine is None or mine.shape[0] != self.reads.shape[0] or any(
                        not set(a.tolist()) <= set(b.tolist())
                        for a, b in zip(mine, self.reads, strict=True)):
                    raise ValueError(
                        f"metrics[{i}] ({_metric_name(m)}) reads logit positions outside the "
                        "engine metric's reads; give it the same reads (PromptMetric.reads).")
        sets = [sorted({(int(la), int(h)) for la, h in s}) for s in head_sets]
        for s in sets:
            bad = [(la, h) for la, h in s if not (0 <= la < sw.n_layers and 0 <= h < sw.n_units)]
            if bad:
                raise ValueError(f"head_sets: {bad} outside the model's {sw.n_layers} layers x "
                                 f"{sw.n_units} heads.")
        per_prompt = [_is_prompt_metric(m) for m in metrics]
        if any(per_prompt) and not all(per_prompt):
            raise ValueError("metrics: mix of per-prompt and scalar metrics; pass one kind.")
        n_p, cut = p1 - p0, self._cut(p0, p1)
        out = torch.empty(len(metrics), len(sets), n_p if all(per_prompt) else 1)
        at = None if self.reads is None else self.reads[p0:p1]
        per = max(1, (rows or auto_rows(model, cut)) // n_p)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(sets):
            groups.setdefault(min((la for la, _ in s), default=sw.n_layers - 1), []).append(i)
        last = model.blocks[sw.n_layers - 1]
        for start, members in sorted(groups.items()):
            for g0 in range(0, len(members), per):
                idx = members[g0:g0 + per]
                n_g = len(idx)
                x = self._span(self.resid[start], p0, p1, cut).repeat(n_g, 1, 1)
                fwd_hooks = []
                for layer in sorted({la for i in idx for la, _ in sets[i]}):
                    heads = [[h for la, h in sets[i] if la == layer] for i in idx]
                    src = self._span(self.src[layer], p0, p1, cut, site=True)

                    def hook(act: Tensor, hook: Any, heads=heads, src=src, n_g=n_g) -> Tensor:
                        view = act.view(n_g, n_p, *act.shape[1:])
                        for j, hs in enumerate(heads):
                            if hs:
                                view[j][:, :, hs] = src[:, :, hs]
                        return act

                    fwd_hooks.append((self.site_names[layer], hook))
                forwards = shortcuts.skipped_blocks(model, start, self.block_arity)
                if at is not None:
                    read_rows = at.to(self.device).repeat(n_g, 1)
                    fwd_hooks.append((hooks.UNEMBED_IN, shortcuts.gather_rows(read_rows)))
                    if self.fast:
                        forwards.append((last.mlp, shortcuts.mlp_at_rows(last.mlp, read_rows)))
                with shortcuts.overridden(forwards), model.hooks(fwd_hooks=fwd_hooks), \
                        shortcuts.attn_result_off(model):
                    logits = model(x, start_at_layer=start)
                what = f"head sets {idx[0]}..{idx[-1]}"
                for k, m in enumerate(metrics):
                    if _is_prompt_metric(m):
                        m = m.select(list(range(p0, p1)) * n_g)
                        out[k, idx] = _evaluate(m, logits, n_g * n_p, what, at=None if at is None
                                                else at.repeat(n_g, 1)).view(n_g, n_p)
                    else:
                        for j, i in enumerate(idx):
                            out[k, i] = _evaluate(m, logits[j * n_p:(j + 1) * n_p], n_p, what,
                                                  at=at)
        return out


# --- public entry points --------------------------------------------------------------------------


def patch_heads(
    model: Any,
    clean_tokens: Int[Tensor, "batch seq"],
    corrupt_tokens: Int[Tensor, "batch seq"],
    metric: Any,
    direction: str = "denoise",
    method: str = "exact",
    positions: str = "all",
    site: str = "z",
    batch_size: int | None = None,
    checkpoint: str | Path | None = None,
    progress: bool = True,
    *,
    atp_star: bool = False,
    top_k: int = 20,
    task_hash: str | None = None,
) -> PatchResult:
    """Patch every attention head (per layer; per position with ``positions="each"``).

    ``denoise``: each head's clean activation at ``site`` patched into the corrupt run;
    ``noise``: its corrupt activation patched into the clean run. Returns a ``PatchResult``
    with ``values`` ``[n_layers, n_heads]`` (or ``[n_layers, n_heads, seq]``) = the metric after
    the patch, mean over prompts. For ``site`` k/v on a GQA model the head axis is the KV-head
    axis (``meta["head_axis"] == "kv_head"``). For ``site="pattern"`` a position is the query
    (destination) position, whose whole attention row is patched (as TransformerLens's
    ``get_act_patch_attn_head_pattern_by_pos``).

    ``method``: "exact" (this engine), "attribution" (gradient estimate, AtP / AtP* with
    ``atp_star``), "attribution+exact" (attribution ranks, exact re-check of the ``top_k``).
    ``batch_size``: sequences per forward pass (default: from free memory).
    ``checkpoint``: folder; finished chunks are stored durably and a rerun resumes.
    Under ``torchrun`` the chunks are split over ranks; every rank returns the merged result.
    """
    choice("direction", direction, DIRECTIONS)
    choice("method", method, METHODS)
    choice("positions", positions, POSITIONS)
    choice("site", site, HEAD_SITES)
    if method != "exact":
        from circuitkit.patching import attribution

        args = dict(direction=direction, site=site, positions=positions, atp_star=atp_star,
                    batch_size=batch_size, progress=progress)
        if method == "attribution":
            return attribution.attribution_patch_heads(
                model, clean_tokens, corrupt_tokens, metric, **args)
        return attribution.attribution_plus_exact(
            model, clean_tokens, corrupt_tokens, metric, top_k=top_k, **args)
    f = hooks.facts(model)
    clean_tokens, corrupt_tokens = check_tokens(clean_tokens, corrupt_tokens, model)
    n, seq = clean_tokens.shape
    sweep = Sweep("heads", site, direction, positions, f.n_layers, f.n_heads_at(site),
                  seq if positions == "each" else 1, n, seq, _is_prompt_metric(metric))
    head_axis = "kv_head" if site in hooks.KV_SITES and f.gqa else "head"
    return _run(model, clean_tokens, corrupt_tokens, metric, sweep, batch_size, checkpoint,
                progress, dict(head_axis=head_axis, task_hash=task_hash))


def patch_layers(
    model: Any,
    clean_tokens: Int[Tensor, "batch seq"],
    corrupt_tokens: Int[Tensor, "batch seq"],
    metric: Any,
    site: str = "resid_pre",
    direction: str = "denoise",
    batch_size: int | None = None,
    checkpoint: str | Path | None = None,
    progress: bool = True,
    *,
    task_hash: str | None = None,
) -> PatchResult:
    """Patch a whole-layer site (``resid_pre``, ``attn_out``, ``mlp_out``) at each (layer, pos).

    ``values``: ``[n_layers, seq]``, the metric after patching layer l's site at position p.
    """
    choice("site", site, LAYER_SITES)
    choice("direction", direction, DIRECTIONS)
    clean_tokens, corrupt_tokens = check_tokens(clean_tokens, corrupt_tokens, model)
    f = hooks.facts(model)
    n, seq = clean_tokens.shape
    sweep = Sweep("layers", site, direction, "each", f.n_layers, 1, seq, n, seq,
                  _is_prompt_metric(metric))
    return _run(model, clean_tokens, corrupt_tokens, metric, sweep, batch_size, checkpoint,
                progress, dict(task_hash=task_hash))


def plan_patch(model: Any, clean_tokens: Tensor, corrupt_tokens: Tensor, metric: Any,
               site: str = "z", direction: str = "denoise", positions: str = "all",
               batch_size: int | None = None) -> dict[str, Any]:
    """Cost of an exact head sweep, with the time estimated from a one-chunk probe."""
    choice("site", site, HEAD_SITES)
    choice("direction", direction, DIRECTIONS)
    choice("positions", positions, POSITIONS)
    clean_tokens, corrupt_tokens = check_tokens(clean_tokens, corrupt_tokens, model)
    f = hooks.facts(model)
    n, seq = clean_tokens.shape
    sweep = Sweep("heads", site, direction, positions, f.n_layers, f.n_heads_at(site),
                  seq if positions == "each" else 1, n, seq, _is_prompt_metric(metric))
    rows = batch_size or auto_rows(model, seq)
    clean_tokens, corrupt_tokens, metric, _ = _sorted_and_planned(
        clean_tokens, corrupt_tokens, metric, sweep, rows)
    engine = ExactEngine(model, clean_tokens, corrupt_tokens, metric, sweep, rows=rows)
    probe = sweep.chunks[0]
    t0 = time.perf_counter()
    engine.run_chunk(probe)
    per_cost = (time.perf_counter() - t0) / sweep.chunk_cost(probe)
    total = sum(sweep.chunk_cost(c) for c in sweep.chunks)
    return dict(
        n_variants=sweep.n_layers * sweep.n_variants, n_prompts=n, seq=seq,
        n_chunks=len(sweep.chunks), rows_per_forward=min(rows, sweep.n_variants * n),
        # one pass = one prompt of ``seq`` tokens through all layers; the engine's chunks run
        # (L-l)/L of one, up to their last read (an upper bound: the fast path skips more)
        pass_equivalents=total / (f.n_layers * seq) + 2 * n,
        naive_passes=sweep.n_layers * sweep.n_variants * n + 2 * n,
        bytes_per_chunk=bytes_per_row(model, seq) * min(rows, sweep.n_variants * n),
        available_bytes=available_bytes(next(model.parameters()).device),
        est_seconds=per_cost * total,
    )


# --- orchestration --------------------------------------------------------------------------------


def _run(model, clean, corrupt, metric, sweep: Sweep, batch_size, checkpoint, progress,
         meta: dict) -> PatchResult:
    from circuitkit.patching import distributed as dist

    t_start = time.perf_counter()
    rank, world = dist.rank_world()
    identity = dict(kind=sweep.kind, site=sweep.site, direction=sweep.direction,
                    positions=sweep.positions, tokens=tokens_hash(clean, corrupt),
                    model=model_fingerprint(model), metric=_metric_name(metric),
                    per_prompt=sweep.per_prompt, prompt_order="by_length")
    # The sweep runs on prompts sorted by length; results are put back in the caller's order.
    rows = batch_size or auto_rows(model, sweep.seq)
    clean, corrupt, metric, order = _sorted_and_planned(clean, corrupt, metric, sweep, rows)
    ckpt = None
    if checkpoint is not None:
        ckpt = SweepCheckpoint.open(checkpoint, identity, sweep.chunks, rank=rank, world=world)
        sweep.chunks = ckpt.chunks  # a resumed sweep keeps its original chunk plan
    done: dict[int, Tensor] = dict(ckpt.load_done()) if ckpt else {}
    engine = ExactEngine(model, clean, corrupt, metric, sweep, rows=rows)
    mine = [c for c in range(len(sweep.chunks)) if c % world == rank and c not in done]
    bar = _progress_bar(sweep, mine, progress and rank == 0)
    computed: dict[int, Tensor] = {}
    try:
        for cid in mine:
            computed[cid] = engine.run_chunk(sweep.chunks[cid])
            if ckpt is not None:
                ckpt.save_chunk(cid, computed[cid])
            if bar is not None:
                bar.update(sweep.chunk_cost(sweep.chunks[cid]))
    except KeyboardInterrupt:
        if ckpt is None and computed:
            path = default_checkpoint_dir(identity)
            ckpt = SweepCheckpoint.open(path, identity, sweep.chunks, rank=0, world=1)
            for cid, t in computed.items():
                ckpt.save_chunk(cid, t)
        if ckpt is not None:
            n_done = len(done) + len(computed)
            print(f"\ninterrupted: {n_done}/{len(sweep.chunks)} chunks saved in {ckpt.path}; "
                  f"rerun the same call with checkpoint={str(ckpt.path)!r} (CLI: --checkpoint "
                  f"{ckpt.path}) to resume.", file=sys.stderr)
        raise
    finally:
        if bar is not None:
            bar.close()
    done.update(computed)
    if world > 1:
        done.update(dist.all_gather_chunks(computed))
    values, per_prompt = engine.assemble(done)
    clean_pp, corrupt_pp = engine.clean_metric, engine.corrupt_metric
    if order is not None:  # back to the caller's prompt order
        inv = torch.argsort(order)
        per_prompt, clean_pp, corrupt_pp = per_prompt[inv], clean_pp[inv], corrupt_pp[inv]
    pp = sweep.per_prompt
    return PatchResult(
        values=values, clean=float(clean_pp.mean()), corrupt=float(corrupt_pp.mean()),
        direction=sweep.direction, method="exact", site=sweep.site, positions=sweep.positions,
        per_prompt=per_prompt, clean_per_prompt=clean_pp if pp else None,
        corrupt_per_prompt=corrupt_pp if pp else None,
        meta=dict(model=str(getattr(model.cfg, "model_name", "")), model_fingerprint=identity[
            "model"], tokens_hash=identity["tokens"], metric=identity["metric"],
            n_prompts=sweep.n_prompts, seq=sweep.seq, n_chunks=len(sweep.chunks), world=world,
            seconds=time.perf_counter() - t_start, versions=versions(),
            facts=asdict(hooks.facts(model)), **{k: v for k, v in meta.items() if v is not None}),
    )


def _progress_bar(sweep: Sweep, mine: list[int], show: bool):
    if not show:
        return None
    from tqdm.auto import tqdm

    total = sum(sweep.chunk_cost(sweep.chunks[c]) for c in mine)
    return tqdm(total=total, desc=f"patch {sweep.site} {sweep.direction}", unit="token-block",
                unit_scale=True, dynamic_ncols=True, file=sys.stderr)


# --- checkpoints ----------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Any) -> None:
    """``write(tmp_path)``, fsync the file, rename over ``path``, fsync the folder.

    A crash (SIGKILL included) leaves either the old state or the complete new file, never a
    partial one under the final name.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def default_checkpoint_dir(identity: dict) -> Path:
    from circuitkit.models import CACHE_DIR

    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    return CACHE_DIR / "checkpoints" / f"patch-{identity['site']}-{identity['direction']}-{key}"


class SweepCheckpoint:
    """A folder: ``header.json`` (sweep identity + chunk plan) and one file per finished chunk.

    Chunk ``i`` is ``chunk_{i:06d}.safetensors`` holding its ``[n_variants, n_prompts]`` result,
    written atomically (``_atomic_write``) the moment it completes. Several ranks can write to
    one folder: chunk files never collide, and only rank 0 writes the header.
    """

    HEADER = "header.json"

    def __init__(self, path: Path, identity: dict, chunks: list[tuple[int, ...]]):
        self.path, self.identity, self.chunks = path, identity, chunks

    @classmethod
    def open(cls, path: str | Path, identity: dict, chunks: list, rank: int = 0,
             world: int = 1) -> SweepCheckpoint:
        from circuitkit.patching import distributed as dist

        path = Path(path)
        header = path / cls.HEADER
        if rank == 0 and not header.exists():
            path.mkdir(parents=True, exist_ok=True)
            text = json.dumps(dict(identity=identity, chunks=chunks), indent=1)
            _atomic_write(header, lambda p: p.write_text(text))
        if world > 1:
            dist.barrier()
        stored = json.loads(header.read_text())
        if stored["identity"] != identity:
            diff = {k: (stored["identity"].get(k), identity.get(k))
                    for k in sorted(set(stored["identity"]) | set(identity))
                    if stored["identity"].get(k) != identity.get(k)}
            raise ValueError(
                f"checkpoint {path} belongs to a different sweep; differing fields "
                f"(stored, now): {diff}. Use a new checkpoint folder, or delete this one to "
                "start over.")
        return cls(path, identity, [tuple(c) for c in stored["chunks"]])

    def _file(self, cid: int) -> Path:
        return self.path / f"chunk_{cid:06d}.safetensors"

    def save_chunk(self, cid: int, values: Tensor) -> None:
        from safetensors.torch import save_file

        _atomic_write(self._file(cid),
                      lambda p: save_file({"values": values.contiguous()}, str(p)))

    def load_done(self) -> dict[int, Tensor]:
        from safetensors.torch import load_file

        done = {}
        for p in sorted(self.path.glob("chunk_*.safetensors")):
            done[int(p.stem.split("_")[1])] = load_file(str(p))["values"]
        return done
