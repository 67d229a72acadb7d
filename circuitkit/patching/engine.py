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

On a Llama-form model (``fused.fused_form``: Llama, Mistral, Qwen2 blocks) with no hook
attached, the fast path goes further (``patching/fused.py``, docs/speed.md): the cached runs and
every patched suffix run as plain tensor code on the modules' own weights, and each row of a
suffix computes only the positions where it can differ from the base run (from the first
position where the prompt's base and source tokens differ, or a per-position patch's position,
to its last read), packed across rows; the last block and the unembedding run at each row's
distinct reads. The fused cached run is checked once per model against the bridge's
``run_with_cache``; the fused suffix is part of the fast path the probe checks.

Causal models: nothing after a prompt's last read position can change its metric, so runs stop
there (``Sweep.run_length``; prompts are swept in order of that length, ``sweep.length_order``).
A bidirectional model (``hooks.facts(model).causal`` False, e.g. a Tracr program) runs whole.

This module holds the engine only: what to patch and how it is cut into chunks is
``patching/sweep.py``; running a whole sweep (checkpoints, ranks, progress) is ``patching/api.py``.
A chunk's result is a ``[n_variants, n_prompts]`` tensor (``run_chunk``); ``run_variants`` patches
any subset of one layer's variants; ``run_head_sets`` patches whole head sets together, with the
source run's ``z`` or, for ablations of the base run, zeros, the mean base ``z`` or another
prompt's base ``z`` (``source=``).

Edges (``EdgeEngine``, a subclass: same cached runs, restart, chunks, read-position logits,
metric evaluation; only the patch differs). An edge (sender, receiver, input) adds the sender's
write ``delta_s`` (source minus base: ``dz[:, :, h] @ W_O[h]`` of head ``h``, or the embeddings'
``resid_pre(0)`` difference) to the receiver's own copy of the residual at one input (q, k or v)
only; every other reader keeps the base run. Nothing before the receiver's layer ``l`` changes, so
the run re-enters at ``l`` from the cached base ``resid_pre(l)``, with the edges into layer ``l``
stacked in the batch. The receiver's patched input activation (``hook_q/k/v`` of layer ``l``,
head slice) is the module's own computation on ``resid_pre(l) + delta_s``: one partial run per
sender, stopped once block ``l``'s q/k/v hooks fired (``shortcuts.run_until``), whose head
slices a hook then writes into each edge's rows. The logits receiver (layer ``n_layers``) reads
the final residual plus ``delta_s``: the last block returns that value and only the final norm
and the unembedding run. On the fused path (Llama-form models) only the receiving head (a q
edge) or the query heads of the receiving KV head (k/v) attend anew: block ``l``'s attention
output is ``o(z_base) + sum_h (z'_h - z_base_h) @ W_O[h]`` over those heads
(``FusedLlama.edge_attention``), and the packed suffix runs from there.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching import fused, shortcuts
from circuitkit.patching.inputs import ReadsDoNotHold, check_edge_model
from circuitkit.patching.sweep import Chunk, Sweep, auto_rows, is_out_of_memory

# Max |fast - plain| on the probe chunk, relative to max(1, |metric|), by weight dtype: the two
# paths round differently (the z write is added after the output projection, not inside it).
# float64: 1e-6, as HF computes rotary tables in float32 whatever the weights' dtype (a float64
# tiny Llama's fused cached run differs from the bridge's by ~5e-8: rounding, not a fault).
FAST_PATH_TOL = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 2e-2,
                 torch.bfloat16: 5e-2}
# Sites whose patch leaves block l's attention computation to a cached output (fast path).
ATTN_OUTPUT_SITES = frozenset({("heads", "z"), ("layers", "attn_out"), ("layers", "mlp_out")})
# The fast path's verdict depends on the architecture, not on weights or inputs: once per model,
# kept beside (never on) the user's model object.
_FAST_PATH_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _within_fast_path_tol(model: Any, err: float, scale: float, what: str, fallback: str,
                     detail: str = "") -> bool:
    """Whether a fast path's difference ``err`` from its reference is within ``FAST_PATH_TOL``
    (for the model's weight dtype) of ``scale``; if not, one warning: ``what`` differs on this
    model (its block type, ``detail``), ``fallback`` is used instead."""
    if err <= FAST_PATH_TOL.get(next(model.parameters()).dtype, 5e-2) * scale:
        return True
    _warn_fast_path_off(model, f"{what} by {err:.2e}", fallback, detail)
    return False


def _warn_fast_path_off(model: Any, why: str, fallback: str, detail: str = "") -> None:
    """One warning: a fast path (``why``: what went wrong) is off for this model's blocks."""
    warnings.warn(f"circuitkit: {why} on this model ({type(model.blocks[0]).__name__} blocks"
                  f"{detail}); using {fallback} (slower, still exact). Please report the "
                  "architecture.", stacklevel=4)


def evaluate_metric(metric: PromptMetric, logits: Tensor, what: str,
                    at: Tensor | None = None) -> Float[Tensor, " batch"]:
    """Per-prompt metric of a batch of logits, validated (shape, finite), on the CPU.

    ``at``: the logits hold only these positions (``PromptMetric.reads``)."""
    n = logits.shape[0]
    out = metric.per_prompt(logits, at=at)
    if out.shape != (n,):
        raise ValueError(f"metric {metric.name!r} must give [{n}] values ({what}); got shape "
                         f"{tuple(out.shape)}.")
    out = out.detach().float().cpu()
    if not torch.isfinite(out).all():
        raise ValueError(f"metric {metric.name!r} returned a non-finite value ({what}): "
                         f"{out.tolist()[:8]}. Check the answer positions/tokens it reads and the "
                         "logits' dtype.")
    return out


# --- the engine ---------------------------------------------------------------------------------


class ExactEngine:
    """Caches the base/source runs once, then computes any chunk of a ``Sweep``.

    ``fast``: use the fast path (module docstring); ``None`` = after checking it on a probe.
    """

    def __init__(self, model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric,
                 sweep: Sweep,
                 fast: bool | None = None, rows: int | None = None):
        self._bind(model, clean, corrupt, metric, sweep)
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
                rows or auto_rows(model, self.base.shape[1]))
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
        self._mean_z: dict[int, Tensor] = {}  # mean_z per layer, computed on first use
        self._whole_site_base: list[Tensor] | None = None  # (_site_base_to_length)

    def _bind(self, model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric,
              sweep: Sweep) -> None:
        """What every engine holds: the model, metric and sweep, devices, the metric's reads
        and the base and source tokens (up to the last read position; all positions for a
        probed metric, whose reads the cached runs check)."""
        self.model, self.metric, self.sweep = model, metric, sweep
        self.device = next(model.parameters()).device
        # A model split over GPUs (n_devices / device_map) holds block l on its own device:
        # cached tensors for layer l go straight there.
        self.layer_device = [next(b.parameters()).device for b in model.blocks]
        self.reads = metric.read_positions()
        # Causal model: positions after the last one the metric reads cannot matter. Runs stop
        # there; a per-position patch beyond it is a no-op (its value is the base metric). A
        # bidirectional model (Tracr's) reads every position at every position: runs are whole.
        self.causal = hooks.facts(model).causal
        self.length = self._run_length(0, sweep.n_prompts)
        # Reads a probe found on random logits (metric.probed) are checked on the cached runs'
        # full logits (inputs.ReadsDoNotHold where they do not hold): those runs go to the end.
        cached = sweep.seq if metric.probed else self.length
        base, source = (corrupt, clean) if sweep.direction == "denoise" else (clean, corrupt)
        self.base = base[:, :cached].to(self.device)
        self.source = source[:, :cached].to(self.device)

    def _cached_runs(self, token_sets: Sequence[Tensor], names: Sequence[str], rows: int
                     ) -> tuple[list[Tensor], dict[str, list[Tensor]]]:
        """Metric of unpatched runs of each ``[n, seq]`` token set and their activations at
        ``names`` (``cache[name][set]``, stored on the CPU). The sets run stacked in the batch,
        at most ``rows`` sequences per forward. A probed metric's reads are checked on each
        set's full logits first (``inputs.ReadsDoNotHold``)."""
        want, n = set(names), self.sweep.n_prompts
        tokens = torch.cat(list(token_sets))
        check = self.metric.probed and self.reads is not None
        reads = None if self.reads is None else self.reads.repeat(len(token_sets), 1)
        gather = None if check else reads  # (checked: every position unembedded)
        logits, acts = [], {name: [] for name in want}
        kinds = fused.cache_kinds(len(self.fused.blocks)) if self.fused is not None else {}
        if not (want <= kinds.keys() and self._fused_cache_agrees(tokens, reads, kinds)):
            kinds = {}
        # The fused run stops each prompt at its own last read (later positions hold zeros):
        # enough for every patch of a prompt by itself, not for a z taken from another prompt
        # (run_head_sets' resample, _site_base_to_length).
        self.rows_cut_at_reads = bool(kinds) and gather is not None
        for r0 in range(0, tokens.shape[0], rows):
            if kinds:  # a Llama-form model: the same run as plain tensor code
                out, cache = self.fused.cached_run(
                    tokens[r0:r0 + rows], {name: kinds[name] for name in want},
                    None if gather is None else gather[r0:r0 + rows], self.layer_device)
                logits.append(out)
                for name in want:
                    acts[name].append(cache[name].to("cpu"))
                continue
            fwd_hooks = []
            if gather is not None:
                idx = gather[r0:r0 + rows].to(self.device)
                fwd_hooks = [(hooks.UNEMBED_IN, shortcuts.gather_rows(idx))]
            norms = shortcuts.native_norms(self.model, 0, keep=want)  # the cache hooks come later
            with shortcuts.hooked(self.model, fwd_hooks), shortcuts.attn_result_off(self.model), \
                    shortcuts.overridden(norms):
                out, cache = self.model.run_with_cache(tokens[r0:r0 + rows],
                                                       names_filter=lambda name: name in want)
            logits.append(out)
            # Caches live on the CPU when the model is on a GPU: a 70B sweep's per-layer source
            # patterns would not fit next to the weights. Each layer's slice moves on demand.
            for name in want:
                acts[name].append(cache[name].to("cpu"))
            del cache
        all_logits = torch.cat(logits)
        if check:
            which = ("corrupt", "clean") if self.sweep.direction == "denoise" else ("clean",
                                                                                 "corrupt")
            for i in range(len(token_sets)):
                if not self.metric.reads_hold(all_logits[i * n:(i + 1) * n]):
                    raise ReadsDoNotHold(self.metric.name, which[i % 2])
            rows_idx = torch.arange(all_logits.shape[0], device=all_logits.device)[:, None]
            all_logits = all_logits[rows_idx, reads.to(all_logits.device)]
        whats = ("unpatched base run", "unpatched source run")
        values = [evaluate_metric(self.metric, all_logits[i * n:(i + 1) * n], whats[i % 2],
                                  at=self.reads) for i in range(len(token_sets))]
        return values, {name: list(torch.cat(a).split(n)) for name, a in acts.items()}

    def _fused_cache_agrees(self, tokens: Tensor, reads: Tensor,
                            kinds: dict[str, tuple[str, int]]) -> bool:
        """Whether ``FusedLlama.cached_run`` equals the bridge's ``run_with_cache`` on this
        model: every activation it computes (at the positions it computes) and the logits at
        the reads, on the first two rows of ``tokens`` ``[R, seq]`` (``reads``: ``[R, k]``, the
        reads of each row); once per model. A difference beyond ``FAST_PATH_TOL`` (relative to
        the largest value) keeps the bridge, with a warning."""
        verdicts = _FAST_PATH_VERDICTS.setdefault(self.model, {})
        if "cached_run" not in verdicts:
            # rows and their reads taken together: with one prompt the first two rows are its
            # base and source runs, not two prompts (the reads of prompts 0 and 1)
            some, at = tokens[:2], reads[:2].to(self.device)
            logits, got = self.fused.cached_run(some, kinds, at, self.layer_device)
            ref_logits, ref = self.model.run_with_cache(some, names_filter=lambda n: n in kinds)
            rows = torch.arange(some.shape[0], device=self.device)[:, None]
            pairs = [(logits, ref_logits[rows, at])]
            upto = torch.arange(some.shape[1]) <= at.max(1).values.cpu()[:, None]
            for name in kinds:
                pairs.append((got[name].cpu()[upto], ref[name].cpu()[upto]))
            err = max(float((a.cpu() - b.cpu()).abs().max() / max(1.0, float(b.abs().max())))
                      for a, b in pairs)
            verdicts["cached_run"] = _within_fast_path_tol(
                self.model, err, 1.0, "the fused cached run differs from the bridge's "
                "run_with_cache (relative)", "the bridge's")
        return verdicts["cached_run"]

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

    def _run_length(self, p0: int, p1: int) -> int:
        """Positions prompts ``p0:p1`` need: up to their last read (causal model), else all."""
        if self.reads is None or not self.causal:
            return self.sweep.seq
        return int(self.reads[p0:p1].max()) + 1

    def _span(self, cached: Tensor, p0: int, p1: int, length: int, site: bool = False,
              layer: int | None = None) -> Tensor:
        """Prompts ``p0:p1``, positions ``< length`` of a cached activation, on the device of
        block ``layer`` (default: the embedding's). ``site``: it is the swept site's activation
        (a pattern has two position axes)."""
        t = cached[p0:p1]
        t = t[:, :, :length, :length] if site and self.sweep.site == "pattern" else t[:, :length]
        return t.to(self.device if layer is None else self.layer_device[layer])

    def _write_patch(self, act: Tensor, src: Tensor, variants: Sequence[int],
                     length: int, p0: int = 0) -> Tensor:
        """Write ``src``'s slice of each variant into ``act`` ([n_var * n_p, ...], in place).

        Head sites: head axis from ``hooks.head_axis`` (2 for q/k/v/z, 1 for pattern); the
        position axis is the one after batch for vectors, ``query_pos`` for patterns.
        Layer sites: ``[batch, pos, d_model]``, patched at one position. Positions ``>= length``
        come after every read position: patching them changes nothing, so they are skipped.
        Position groups (``p0``: the first prompt of ``src``): ``_write_group_patch``.
        """
        sw = self.sweep
        if sw.positions == "groups":
            return self._write_group_patch(act, src, variants, length, p0)
        n_p = src.shape[0]
        view = act.view(len(variants), n_p, *act.shape[1:])
        for i, v in enumerate(variants):
            unit, pos = sw.variant(v)
            if pos is not None and pos >= length:
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

    def _group_masks(self, variants: Sequence[int], p0: int, p1: int, length: int,
                     device: Any) -> Tensor:
        """Bool ``[n_var, p1 - p0, length]``: each variant's group positions of prompts
        ``p0:p1`` (sweep order; positions ``>= length`` come after every read: dropped)."""
        g = torch.tensor([self.sweep.variant(v)[1] for v in variants])
        return self.sweep.groups.masks[g][:, p0:p1, :length].to(device)

    def _write_group_patch(self, act: Tensor, src: Tensor, variants: Sequence[int],
                           length: int, p0: int) -> Tensor:
        """``_write_patch`` of position groups: each variant's head slice takes ``src`` at its
        group's positions of each prompt (query positions of a pattern)."""
        sw, n_p = self.sweep, src.shape[0]
        view = act.view(len(variants), n_p, *act.shape[1:])
        masks = self._group_masks(variants, p0, p0 + n_p, length, act.device)
        for i, v in enumerate(variants):
            unit = sw.variant(v)[0]
            if sw.site == "pattern":  # [n_p, head, q, k]: whole query rows
                m = masks[i][:, :, None]
                view[i][:, unit] = torch.where(m, src[:, unit], view[i][:, unit])
            else:  # [n_p, pos, head, d]
                m = masks[i][:, :, None]
                view[i][:, :, unit] = torch.where(m, src[:, :, unit], view[i][:, :, unit])
        return act

    def _attn_output(self, layer: int, variants: Sequence[int], p0: int, p1: int, length: int
                     ) -> Float[Tensor, "n_var_x_n_p seq d_model"]:
        """Block ``layer``'s attention output under each variant's patch, without running it.

        z: ``o(z_base) + (z_source - z_base)[:, :, h] @ W_O[h]`` (the attention's output is its
        output projection ``o`` of z, affine); attn_out: the source output at the patched
        position; mlp_out: the base output.
        """
        sw, n_v = self.sweep, len(variants)
        src = self._span(self.src[layer], p0, p1, length, site=True, layer=layer)
        if sw.site != "z":
            out = self._span(self.attn_base[layer], p0, p1, length, layer=layer).repeat(n_v, 1, 1)
            return self._write_patch(out, src, variants, length) if sw.site == "attn_out" else out
        z_base = self._span(self.site_base[layer], p0, p1, length, site=True,
                            layer=layer)  # [n_p, pos, h, d]
        out = self.model.blocks[layer].attn.o(z_base.flatten(-2).contiguous()).repeat(n_v, 1, 1)
        dz = src - z_base
        W_O = self.W_O[layer]  # [head, d_head, d_model]
        view = out.view(n_v, p1 - p0, *out.shape[1:])
        cells = [sw.variant(v) for v in variants]
        if sw.positions == "all":
            heads = torch.tensor([h for h, _ in cells], device=W_O.device)
            view += einops.einsum(dz[:, :, heads], W_O[heads],
                                  "b pos v dh, v dh dm -> v b pos dm")
        elif sw.positions == "groups":  # each head's write at its group's positions only
            heads = torch.tensor([h for h, _ in cells], device=W_O.device)
            masks = self._group_masks(variants, p0, p1, length, dz.device)  # [v, b, pos]
            view += einops.einsum(dz[:, :, heads] * masks.permute(1, 2, 0)[..., None]
                                  .to(dz.dtype), W_O[heads], "b pos v dh, v dh dm -> v b pos dm")
        else:
            for i, (h, pos) in enumerate(cells):
                if pos < length:
                    view[i, :, pos] += dz[:, pos, h] @ W_O[h]
        return out

    def run_chunk(self, chunk: Chunk) -> Float[Tensor, "n_var n_p"]:
        """Metric after each patch of the chunk: ``[n_variants, n_prompts]``."""
        chunk = Chunk(*chunk)
        return self.run_variants(chunk.layer, range(chunk.v0, chunk.v1), chunk.p0, chunk.p1)

    @torch.no_grad()
    def run_variants(self, layer: int, variants: Sequence[int], p0: int, p1: int,
                     fast: bool | None = None) -> Float[Tensor, "n_var n_p"]:
        """Metric after patching each of ``variants`` (any subset) of ``layer``, on prompts
        ``p0:p1``: ``[len(variants), p1 - p0]`` (a metric without per-prompt values needs all
        prompts). ``fast``: override ``self.fast``.

        One suffix forward, or, when the metric reads known positions and its prompts (sorted
        by length) are worth running in two length buckets (``length_split``), one forward per
        bucket: the logits at the read positions are joined and the metric is called once. A
        scalar metric, which cannot be split across chunks, still stops each bucket early.
        """
        n_v, n_p = len(variants), p1 - p0
        # (packed rows each stop at their own last read: no length buckets needed)
        split = None if self._packed(fast) else self.length_split(p0, p1)
        parts = [(p0, p1)] if split is None else [(p0, split), (split, p1)]
        logits = [self._patched_logits(layer, variants, a, b, fast) for a, b in parts]
        if len(logits) > 1:  # variant-major rows of each bucket -> variant-major rows of all
            logits = [torch.cat([lg.view(n_v, b - a, *lg.shape[1:])
                                 for lg, (a, b) in zip(logits, parts, strict=True)], dim=1)
                      .flatten(0, 1)]
        at = None if self.reads is None else self.reads[p0:p1]
        what = f"patched layer {layer}, variants {variants[0]}..{variants[-1]}"
        # One metric call for all variants: rows are (variant, prompt), variant-major.
        tiled = self.metric.select(list(range(p0, p1)) * n_v)
        return evaluate_metric(tiled, logits[0], what,
                               at=None if at is None else at.repeat(n_v, 1)).view(n_v, n_p)

    def length_split(self, p0: int, p1: int) -> int | None:
        """For a metric without per-prompt values (its chunks hold every prompt): a prompt
        index splitting ``p0:p1`` (sorted by length) into two forwards when that saves >= 10% of
        token-rows and each keeps >= 1/4 of the prompts (as ``sweep.chunked`` does across chunks
        for per-prompt metrics); None otherwise, or when the logits are not read at known
        positions (full-length logits of two buckets would not join)."""
        if self.reads is None or p1 - p0 < 4 or self.sweep.split_prompts or not self.causal:
            return None  # (a per-prompt metric's chunks are already length buckets: sweep.chunked)
        need = (self.reads[p0:p1].max(1).values + 1).tolist()
        if any(a > b for a, b in zip(need, need[1:], strict=False)):
            return None  # not sorted by length: nothing to gain
        n = p1 - p0
        cost = {s: s * need[s - 1] + (n - s) * need[-1] for s in range(n // 4, n - n // 4)}
        best = min(cost, key=cost.__getitem__, default=None)
        return p0 + best if best and cost[best] <= 0.9 * n * need[-1] else None

    def _patched_logits(self, layer: int, variants: Sequence[int], p0: int, p1: int,
                        fast: bool | None) -> Tensor:
        """Logits of one suffix forward with each variant patched, rows variant-major:
        ``[n_var * n_p, k, vocab]`` at the read positions, or ``[n_var * n_p, length, vocab]``
        when the metric's reads are unknown."""
        sw, model = self.sweep, self.model
        fast = self.fast if fast is None else fast
        if self._packed(fast):
            return self._fused_logits(layer, variants, p0, p1)
        n_v, length = len(variants), self._run_length(p0, p1)
        x = self._span(self.resid[layer], p0, p1, length,
                       layer=layer).repeat(n_v, 1, 1)  # variant-major rows
        src = self._span(self.src[layer], p0, p1, length, site=True, layer=layer)
        block, last = model.blocks[layer], model.blocks[sw.n_layers - 1]
        forwards = shortcuts.skipped_blocks(model, layer, self.block_arity)
        fwd_hooks = []
        if fast:
            forwards += shortcuts.native_norms(model, layer)
        if fast and self.attn_cached:
            attn = self._attn_output(layer, variants, p0, p1, length)
            forwards.append((block.attn, shortcuts.returning(attn, self.attn_arity)))
            if sw.site != "z":  # a cached hook_attn_out value: past any post-attention norm
                forwards += shortcuts.passthrough(hooks.post_norm(model, layer, "attn"))
            if sw.site == "mlp_out":
                mlp = self._write_patch(self._span(self.site_base[layer], p0, p1, length,
                                                   layer=layer).repeat(n_v, 1, 1),
                                        src, variants, length)
                forwards.append((block.mlp, shortcuts.returning(mlp, 0)))
                forwards += shortcuts.passthrough(hooks.post_norm(model, layer, "mlp"))
        elif sw.kind == "layers" and sw.site == "resid_pre":
            self._write_patch(x, src, variants, length)  # the patch *is* the restart point
        else:
            def hook(act: Tensor, hook: Any) -> Tensor:
                return self._write_patch(act, src, variants, length, p0)

            fwd_hooks = [(self.site_names[layer], hook)]
        hooks_at, forwards_at = self._read_rows_only(
            p0, p1, n_v, fast, last_mlp=not (sw.site == "mlp_out" and block is last),
            last_attn=block is not last)
        return self._suffix(x, layer, forwards + forwards_at, fwd_hooks + hooks_at)

    @property
    def fused(self) -> fused.FusedLlama | None:
        """The model read as Llama-form blocks (``patching/fused.py``) when the fast path may
        run its suffix as plain tensor code: a causal model whose metric declares its reads,
        with no hook attached (fused code fires none)."""
        if self.reads is None or not self.causal or not fused.unhooked(self.model):
            return None
        return fused.fused_form(self.model)

    def _packed(self, fast: bool | None) -> bool:
        """Whether a run on the fast path (``fast``: override ``self.fast``) is a fused, packed
        suffix: a Llama-form model (``fused``) and a site whose patch is known before block
        ``l`` runs (the attention-output sites, or resid_pre: the restart point)."""
        return bool(self.fast if fast is None else fast) and self.fused is not None and (
            self.attn_cached or (self.sweep.kind, self.sweep.site) == ("layers", "resid_pre"))

    def _packing(self, variants: Sequence[int], p0: int, p1: int,
                 positions: Sequence[int | None] | None = None,
                 row_start: Tensor | None = None) -> fused.Packing:
        """Which positions each variant-major row of prompts ``p0:p1`` computes: from the
        first position where the prompt's base and source tokens differ (or a per-position
        variant's position, when later; never after the row's first read) to its last read.
        ``positions``: each variant's patched position (None: every position); ``row_start``:
        ``[n_var * n_p]``, each row's first patched position (position groups)."""
        n_v, length = len(variants), self._run_length(p0, p1)
        reads = self.reads[p0:p1].cpu()
        differ = (self.base[p0:p1, :length] != self.source[p0:p1, :length]).cpu()
        first = torch.where(differ.any(1), differ.int().argmax(1), length)  # [n_p]
        start = first.repeat(n_v)
        if positions is not None:
            at = torch.tensor([-1 if pos is None else pos for pos in positions])
            start = torch.maximum(start, at.repeat_interleave(p1 - p0))
        if row_start is not None:
            start = torch.maximum(start, row_start)
        rows = reads.repeat(n_v, 1)
        start = torch.minimum(start, rows.min(1).values)
        return fused.Packing(start, rows.max(1).values + 1, torch.arange(p1 - p0).repeat(n_v),
                             rows, length)

    def _fused_logits(self, layer: int, variants: Sequence[int], p0: int, p1: int
                      ) -> Float[Tensor, "n_var_x_n_p k vocab"]:
        """``_patched_logits`` on the fast path of a Llama-form model: the patch as the
        engine's fast path computes it (block ``layer``'s attention output, or for mlp_out also
        its MLP output; for resid_pre the restart residual), the suffix as
        ``fused.suffix_logits`` on the rows' packed positions."""
        sw, n_v, length = self.sweep, len(variants), self._run_length(p0, p1)
        if sw.positions == "groups":  # a row differs from its group's first position on
            masks = self._group_masks(variants, p0, p1, length, "cpu")  # [n_v, n_p, length]
            first = torch.where(masks.any(-1), masks.int().argmax(-1), length)
            pack = self._packing(variants, p0, p1, row_start=first.flatten())
        else:
            pack = self._packing(variants, p0, p1, [sw.variant(v)[1] for v in variants])
        resid = [self._span(self.resid[j], p0, p1, length, layer=j)
                 for j in range(layer, sw.n_layers)]
        attn = mlp = None
        if not self.attn_cached:  # resid_pre: the patch is the restart point
            src = self._span(self.src[layer], p0, p1, length, site=True, layer=layer)
            x = pack.gather(self._write_patch(resid[0].repeat(n_v, 1, 1), src, variants,
                                              length))
        else:
            x = pack.gather_prompts(resid[0])
            attn = pack.gather(self._attn_output(layer, variants, p0, p1, length))
            if sw.site == "mlp_out":
                src = self._span(self.src[layer], p0, p1, length, site=True, layer=layer)
                mlp = pack.gather(self._write_patch(self._span(
                    self.site_base[layer], p0, p1, length, layer=layer).repeat(n_v, 1, 1),
                    src, variants, length))
        return fused.suffix_logits(self.fused, pack, layer, resid, x, attn, mlp,
                                   devices=self.layer_device)

    def _read_rows_only(self, p0: int, p1: int, n_v: int, fast: bool, last_mlp: bool = True,
                        last_attn: bool = True) -> tuple[list, list]:
        """(hooks, forwards) that compute the logits of ``n_v`` variant-major copies of prompts
        ``p0:p1`` at the metric's read positions only: the unembedding there (it costs as much
        as several blocks with a big vocabulary, and most positions are never read), and on
        the fast path the last block's MLP (``last_mlp``; a block without one is left alone)
        and its attention queries (``last_attn``, where ``attention_at_rows`` reproduces it)
        there too. Nothing when the metric's reads are unknown."""
        if self.reads is None:
            return [], []
        last = self.model.blocks[len(self.model.blocks) - 1]
        rows = self.reads[p0:p1].to(self.device).repeat(n_v, 1)
        # (After the final norm: HF GPT-2 reshapes the norm's output to the input's shape.)
        fwd_hooks = [(hooks.UNEMBED_IN, shortcuts.gather_rows(rows))]
        forwards = shortcuts.last_mlp_at_rows(self.model, rows) if fast and last_mlp else []
        if fast and last_attn and self.attn_at_rows:
            forwards.append((last.attn, shortcuts.attention_at_rows(
                last.attn, rows, self.attn_arity)))
        return fwd_hooks, forwards

    def _suffix(self, x: Tensor, layer: int, forwards: list, fwd_hooks: list) -> Tensor:
        """``model(x, start_at_layer=layer)`` with ``forwards`` replaced and ``fwd_hooks``
        attached for the run, and no per-head results."""
        model = self.model
        with shortcuts.overridden(forwards), shortcuts.hooked(model, fwd_hooks), \
                shortcuts.attn_result_off(model):
            return model(x, start_at_layer=layer)

    def _fast_path_agrees(self) -> bool:
        """Whether the fast path matches the plain hooked path on a probe of this model.

        Probe: layer 0 (every later block runs), the first and last unit, patched at all
        positions or (per-position sweeps) at the first prompt's last read position, and the
        first unit at position 0, on two prompts (all of them for a scalar metric)."""
        sw = self.sweep
        if not self.attn_cached and self.reads is None:
            return True  # nothing to speed up
        verdicts = _FAST_PATH_VERDICTS.setdefault(self.model, {})
        key = (sw.kind, sw.site, sw.positions, self.reads is not None)
        if key not in verdicts:
            verdicts[key] = self._probe_fast_path()
        return verdicts[key]

    def _probe_fast_path(self) -> bool:
        sw = self.sweep
        p1 = min(2, sw.n_prompts) if sw.split_prompts else sw.n_prompts
        pos = 0
        if sw.positions == "groups":
            pos = sw.n_pos - 1
        elif sw.n_pos > 1:
            pos = int(self.reads[0].max()) if self.reads is not None else sw.seq - 1
        variants = sorted({0, pos, (sw.n_units - 1) * sw.n_pos + pos})
        plain = self.run_variants(0, variants, 0, p1, fast=False)
        try:
            fast = self.run_variants(0, variants, 0, p1, fast=True)
        except Exception as e:  # noqa: BLE001 - a replacement forward this layout cannot take
            if is_out_of_memory(e):
                raise
            # (OPT's MLP is no module of its own: a cached MLP output does not fit its place)
            why = f"the fast exact-patching path fails ({type(e).__name__})"
            _warn_fast_path_off(self.model, why, "the plain path", f", site {sw.site!r}")
            return False
        err, scale = float((fast - plain).abs().max()), max(1.0, float(plain.abs().max()))
        return _within_fast_path_tol(self.model, err, scale, "the fast exact-patching path "
                                     "differs from the plain hooked path", "the plain path",
                                     f", site {sw.site!r}")

    def assemble(self, done: dict[int, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Chunk results -> (values [value_shape], per_prompt [n_prompts, *value_shape] | None;
        None for a metric without per-prompt values)."""
        sw = self.sweep
        grid = torch.full((sw.n_layers, sw.n_variants, sw.n_prompts), float("nan"))
        for cid, c in enumerate(sw.chunks):
            grid[c.layer, c.v0:c.v1, c.p0:c.p1] = done[cid]
        shape = sw.value_shape()
        values = grid.mean(-1).reshape(shape)
        per_prompt = grid.permute(2, 0, 1).reshape(sw.n_prompts, *shape)
        return values, per_prompt if self.metric.per_prompt_values else None

    # --- head sets patched together (causal validation) -------------------------------------
    @torch.no_grad()
    def run_head_sets(self, head_sets: Sequence[Sequence[tuple[int, int]]], p0: int = 0,
                      p1: int | None = None, metrics: Sequence[Any] | None = None,
                      rows: int | None = None, source: str = "source", seed: int = 0,
                      fast: bool | None = None, on_done: Any = None
                      ) -> Float[Tensor, "n_metrics n_sets n_p"]:
        """Metrics after patching each head set *together*: every ``(layer, head)`` of a set gets
        its source ``z`` at all positions, at every layer the set spans, in one run.

        ``source``: what the set's heads get (the same hook writes, other values; ablations of
        the base run): "source" (the source run's ``z``: noise / denoise), "zero" (0), "mean"
        (``mean_z``: the head's mean base ``z`` over every prompt's positions up to its last
        read), "resample" (the base ``z`` of another prompt among ``p0:p1``, at the same
        positions: a derangement of the prompts seeded by ``seed``, one for the whole call).

        Needs a sweep over site ``z`` (the engine caches ``resid_pre`` and source ``z`` of every
        layer). Sets are grouped by their lowest layer ``l0``; a group's sets are stacked in the
        batch (set-major rows ``[n_sets * n_p, seq, d_model]``) and re-enter the model at
        ``l0`` from the cached base ``resid_pre(l0)``; a hook at ``z(l)`` of every layer ``l``
        the group touches writes the source ``z`` of each set's heads at ``l`` into that set's
        rows. The empty set is the unpatched base run. On a Llama-form model on the fast path
        (``fast``: override ``self.fast``) the same runs are fused and packed
        (``_fused_head_set_logits``: each row from its first differing position, or 0 for
        ablations, to its last read), once checked against the hooked path on this model
        (``_head_sets_agree``, ``FAST_PATH_TOL``; a difference keeps the hooked path, with a
        warning); otherwise the hooked path, with ``reads`` unembedded at the reads only.

        ``metrics``: ``PromptMetric``s evaluated on the same patched logits (default: the
        engine's metric); each must declare ``reads`` within the engine metric's, or the
        engine's metric must read every position. Prompts ``p0:p1`` (default all; a metric
        without per-prompt values needs all). ``rows``: sequences per forward (default from free
        memory). ``on_done(n)``: called after each forward with its ``n`` (set, prompt) rows (a
        progress bar). Returns ``[len(metrics), len(head_sets), p1 - p0]``.
        """
        sw, model = self.sweep, self.model
        if (sw.kind, sw.site, sw.positions) != ("heads", "z", "all"):
            raise ValueError("run_head_sets needs an engine built for site='z', positions='all' "
                             f"(got kind={sw.kind!r}, site={sw.site!r}, "
                             f"positions={sw.positions!r}).")
        p1 = sw.n_prompts if p1 is None else p1
        if source not in HEAD_SET_SOURCES:
            raise ValueError(f"source={source!r}; expected one of {list(HEAD_SET_SOURCES)}.")
        if source == "resample" and p1 - p0 < 2:
            raise ValueError(f"source='resample' takes each prompt's z from another prompt; "
                             f"prompts {p0}:{p1} hold {p1 - p0}. Pass at least 2.")
        metrics = [self.metric] if metrics is None else list(metrics)
        for i, m in enumerate(metrics):
            if not isinstance(m, PromptMetric):
                raise ValueError(f"metrics[{i}] must be a PromptMetric (circuitkit.metrics."
                                 f"as_metric wraps a callable); got {type(m).__name__}.")
            if not m.per_prompt_values and (p0, p1) != (0, sw.n_prompts):
                raise ValueError(f"metrics[{i}] has no per-prompt values; run all prompts (p0=0, "
                                 "p1=None) or pass a per-prompt metric.")
            if self.reads is not None and m is not self.metric:
                mine = m.read_positions()
                if mine is None or mine.shape[0] != self.reads.shape[0] or any(
                        not set(a.tolist()) <= set(b.tolist())
                        for a, b in zip(mine, self.reads, strict=True)):
                    raise ValueError(
                        f"metrics[{i}] ({m.name}) reads logit positions outside the engine "
                        "metric's reads; give it the same reads (PromptMetric.reads).")
        sets = [sorted({(int(la), int(h)) for la, h in s}) for s in head_sets]
        for s in sets:
            bad = [(la, h) for la, h in s if not (0 <= la < sw.n_layers and 0 <= h < sw.n_units)]
            if bad:
                raise ValueError(f"head_sets: {bad} outside the model's {sw.n_layers} layers x "
                                 f"{sw.n_units} heads.")
        n_p, length = p1 - p0, self._run_length(p0, p1)
        perm = derangement(n_p, seed) if source == "resample" else None
        out = torch.empty(len(metrics), len(sets), n_p)
        at = None if self.reads is None else self.reads[p0:p1]
        fused_sets = self._head_sets_fused(fast, source)
        # (packed rows hold only their own positions: more sets fit one forward)
        per = max(1, (rows or auto_rows(model, length)) // n_p)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(sets):
            groups.setdefault(min((la for la, _ in s), default=sw.n_layers - 1), []).append(i)
        for start, members in sorted(groups.items()):
            for g0 in range(0, len(members), per):
                idx = members[g0:g0 + per]
                n_g = len(idx)
                group = [sets[i] for i in idx]
                logits = (self._fused_head_set_logits if fused_sets else
                          self._hooked_head_set_logits)(group, start, p0, p1, source, perm)
                what = f"head sets {idx[0]}..{idx[-1]}"
                rows_at = None if at is None else at.repeat(n_g, 1)
                for k, m in enumerate(metrics):
                    tiled = m.select(list(range(p0, p1)) * n_g)
                    out[k, idx] = evaluate_metric(tiled, logits, what, at=rows_at).view(n_g, n_p)
                if on_done is not None:
                    on_done(n_g * n_p)
        return out

    def _head_sets_fused(self, fast: bool | None, source: str) -> bool:
        """Whether ``run_head_sets`` runs its sets fused and packed (``_fused_head_set_logits``):
        a Llama-form model on the fast path, once ``_head_sets_agree`` found the fused sets
        equal to the hooked ones on this model (per ``source``)."""
        if not self._packed(fast):
            return False
        if fast:  # forced (the probe itself, tests)
            return True
        verdicts = _FAST_PATH_VERDICTS.setdefault(self.model, {})
        key = ("head_sets", source)
        if key not in verdicts:
            verdicts[key] = self._head_sets_agree(source)
        return verdicts[key]

    def _head_sets_agree(self, source: str) -> bool:
        """The fused head-set path against the hooked one on the first two prompts (all for a
        scalar metric): a set at layer 0, one spanning every layer (each layer's first and last
        head), one in the last layer alone."""
        sw = self.sweep
        p1 = min(2, sw.n_prompts) if self.metric.per_prompt_values else sw.n_prompts
        if source == "resample" and p1 < 2:
            return True  # (run_head_sets refuses it anyway)
        L, H = sw.n_layers, sw.n_units
        sets = [[(0, 0)], sorted({(la, h) for la in range(L) for h in (0, H - 1)}),
                [(L - 1, H - 1)]]
        fast = self.run_head_sets(sets, 0, p1, source=source, fast=True)
        plain = self.run_head_sets(sets, 0, p1, source=source, fast=False)
        err, scale = float((fast - plain).abs().max()), max(1.0, float(plain.abs().max()))
        return _within_fast_path_tol(self.model, err, scale, "the fused head-set path differs "
                                     "from the hooked one", "the hooked path",
                                     f", source {source!r}")

    def _hooked_head_set_logits(self, group: list[list[tuple[int, int]]], start: int, p0: int,
                                p1: int, source: str, perm: Tensor | None) -> Tensor:
        """Logits of the sets ``group`` (lowest layer ``start``) on prompts ``p0:p1``, set-major
        rows: the bridge re-entered at ``start`` from the cached ``resid_pre``, a hook at
        ``z(l)`` writing each set's heads. ``[n_g * n_p, k, vocab]`` at the reads (or every
        position when reads are unknown)."""
        model = self.model
        n_g, n_p, length = len(group), p1 - p0, self._run_length(p0, p1)
        at = None if self.reads is None else self.reads[p0:p1]
        x = self._span(self.resid[start], p0, p1, length).repeat(n_g, 1, 1)
        fwd_hooks = []
        for layer in sorted({la for s in group for la, _ in s}):
            heads = [[h for la, h in s if la == layer] for s in group]
            src = self._head_set_source(layer, source, p0, p1, length, perm)

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
                forwards += shortcuts.last_mlp_at_rows(model, read_rows)
        with shortcuts.overridden(forwards), shortcuts.hooked(model, fwd_hooks), \
                shortcuts.attn_result_off(model):
            return model(x, start_at_layer=start)

    def _fused_head_set_logits(self, group: list[list[tuple[int, int]]], start: int, p0: int,
                               p1: int, source: str, perm: Tensor | None
                               ) -> Float[Tensor, "n_g_x_n_p k vocab"]:
        """``_hooked_head_set_logits`` of a Llama-form model as plain tensor code, packed
        (``fused.Packing``): row ``r`` (set ``r // n_p``, prompt ``r % n_p``) computes positions
        ``s_r <= pos <= last read``, where ``s_r`` is the first position where base and source
        tokens differ for ``source="source"`` (before it ``z_source == z_base``) and 0 for
        ablations. Blocks ``start..L-1`` run as ``FusedLlama.block``; at a layer the group
        touches, the attention's merged ``z`` ``[T, head, d_head]`` takes the set's heads from
        the source ``z`` before the output projection: ``z'[t, h] = src[t, h]`` where ``h`` is
        in row ``t``'s set, else ``z[t, h]``. At block ``start`` (its input is the base run's)
        ``z`` is the cached base ``z``: no attention runs there. The last block runs at the
        reads only (its ``z`` elsewhere reaches no read)."""
        form, L = self.fused, self.sweep.n_layers
        n_g, n_p, length = len(group), p1 - p0, self._run_length(p0, p1)
        if source == "source":
            pack = self._packing(range(n_g), p0, p1)
        else:
            reads = self.reads[p0:p1].cpu().repeat(n_g, 1)
            pack = fused.Packing(torch.zeros(n_g * n_p, dtype=torch.long),
                                 reads.max(1).values + 1, torch.arange(n_p).repeat(n_g), reads,
                                 length)
        token_row = pack.dense_of(torch.device("cpu")) // pack.seq  # [T]
        x = None
        for j in range(start, L):
            b = form.blocks[j]
            dev = self.layer_device[j]
            resid = self._span(self.resid[j], p0, p1, length, layer=j)
            x = pack.gather_prompts(resid) if x is None else x.to(dev)
            heads = torch.zeros(n_g, form.n_heads, dtype=torch.bool)
            for g, s in enumerate(group):
                heads[g, [h for la, h in s if la == j]] = True
            edit = None
            if bool(heads.any()):  # (the group's rows, set-major: row r has set r // n_p)
                src = pack.gather_prompts(self._head_set_source(j, source, p0, p1, length, perm)
                                          .to(dev))  # [T, head, d_head]
                edit = (heads.repeat_interleave(n_p, 0)[token_row].to(dev), src)
            if j == start and edit is not None:  # block start's input is the base run's: its
                # z is the cached base z, the set's heads written over it
                z = pack.gather_prompts(self._span(self.site_base[j], p0, p1, length, site=True,
                                                   layer=j))  # [T, head, d_head]
                attn = form.linear(_written(z.flatten(-2), *edit, form.d_head), b.o)
                if j == L - 1:
                    return pack.spread(form.logits(form.known_block_at_reads(pack, x, b, attn)))
                x = form.block(pack, x, b, resid, attn=attn)
                continue
            if j == L - 1:
                return pack.spread(form.logits(self._fused_last_block(pack, x, b, resid, edit)))
            x = form.block(pack, x, b, resid, attn=None if edit is None else
                           self._fused_attention(pack, x, b, resid, edit))
        raise AssertionError("unreachable")

    def _fused_attention(self, pack: fused.Packing, x: Tensor, b: Any, resid: Tensor,
                         edit: tuple[Tensor, Tensor]) -> Float[Tensor, "T d"]:
        """Block ``b``'s attention output at the packed tokens with ``edit = (which [T, head],
        src [T, head, d_head])`` written into its merged ``z`` before the output projection
        (``FusedLlama.block``'s attention, step for step)."""
        form = self.fused
        z = form.packed_z(pack, x, b, resid)
        return form.linear(_written(z, *edit, form.d_head), b.o)

    def _fused_last_block(self, pack: fused.Packing, x: Tensor, b: Any, resid: Tensor,
                          edit: tuple[Tensor, Tensor] | None) -> Float[Tensor, "N d"]:
        """The last block at each row's distinct reads (``FusedLlama.last_block_at_reads``)
        with ``edit`` (``_fused_attention``) written into ``z`` at the reads."""
        form = self.fused
        if edit is None:
            return form.last_block_at_reads(pack, x, b, resid)
        z, at = form.reads_z(pack, x, b, resid)
        z = _written(z, edit[0][at], edit[1][at], form.d_head)
        y = form.linear(z, b.o).add_(x[at])
        return y.add_(form.mlp(form.norm(y, b.ln2), b))

    def _head_set_source(self, layer: int, source: str, p0: int, p1: int, length: int,
                         perm: Tensor | None) -> Float[Tensor, "n_p pos head d_head"]:
        """The ``z`` that ``run_head_sets`` writes into a set's heads at ``layer`` (its
        ``source``)."""
        if source == "source":
            return self._span(self.src[layer], p0, p1, length, site=True)
        base = self._span(self.site_base[layer], p0, p1, length, site=True)
        if source == "zero":
            return torch.zeros_like(base)
        if source == "mean":
            return self.mean_z(layer).to(base)[None, None].expand_as(base)
        if self.rows_cut_at_reads:  # another prompt's z, at positions after its own last read
            base = self._span(self._site_base_to_length()[layer], p0, p1, length, site=True)
        return base[perm.to(base.device)]

    def _site_base_to_length(self) -> list[Tensor]:
        """The base run's site activation of every layer ``[n, length, ...]`` with every
        prompt run to ``length`` (the fused cached run stops each at its own last read), on the
        CPU like the cache; computed on first use (``run_head_sets``' resample)."""
        if self._whole_site_base is None:
            kinds = fused.cache_kinds(len(self.fused.blocks))
            want = {name: kinds[name] for name in self.site_names}
            n, length = self.base.shape
            rows = max(1, auto_rows(self.model, length))
            parts: dict[str, list[Tensor]] = {name: [] for name in want}
            with torch.no_grad():
                for r0 in range(0, n, rows):
                    tokens = self.base[r0:r0 + rows]
                    last = torch.full((tokens.shape[0], 1), length - 1, device=tokens.device)
                    _, cache = self.fused.cached_run(tokens, want, last, self.layer_device)
                    for name in want:
                        parts[name].append(cache[name].to("cpu"))
            self._whole_site_base = [torch.cat(parts[name]) for name in self.site_names]
        return self._whole_site_base

    def mean_z(self, layer: int) -> Float[Tensor, "head d_head"]:
        """Mean base ``z`` of each head of ``layer`` over every prompt and position up to that
        prompt's last read (all ``length`` positions when reads are unknown), float64 sums."""
        if layer not in self._mean_z:
            z = self.site_base[layer].double()  # [n, length, head, d_head]
            last = (self.reads.max(1).values if self.reads is not None
                    else torch.full((z.shape[0],), self.length - 1))
            keep = (torch.arange(z.shape[1])[None, :] <= last[:, None]).double()
            self._mean_z[layer] = (einops.einsum(z, keep, "n p h d, n p -> h d")
                                   / keep.sum()).float()
        return self._mean_z[layer]


# "mean": mean_z, over prompts and positions (ck.circuit's per-position one is "position-mean")
HEAD_SET_SOURCES = ("source", "zero", "mean", "resample")


def _written(z: Float[Tensor, "T h_d"], which: Bool[Tensor, "T head"],
             src: Float[Tensor, "T head d_head"], d_head: int) -> Float[Tensor, "T h_d"]:
    """Merged ``z`` with ``src`` written where ``which``: ``z'[t, h] = src[t, h] if which[t, h]
    else z[t, h]``."""
    z = z.unflatten(-1, (-1, d_head))
    return torch.where(which[..., None], src.to(z.dtype), z).flatten(-2)


def derangement(n: int, seed: int) -> Tensor:
    """A seeded random permutation of ``range(n)`` without fixed points (``n >= 2``)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n, generator=g)
        if not bool((perm == torch.arange(n)).any()):
            return perm


# --- edges ---------------------------------------------------------------------------------------


class EdgeEngine(ExactEngine):
    """Exact edge patching (module docstring, "Edges"): the cached runs, restart, chunking and
    metric evaluation of ``ExactEngine``; the patch is an edge's.

    ``layout``: the ``sweep.EdgeLayout``; the sweep's layer ``l`` is receiver layer ``l``
    (``n_layers``: the logits) and its variants are ``layout.cells(l)``.
    """

    def __init__(self, model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric,
                 sweep: Sweep, layout: Any, fast: bool | None = None, rows: int | None = None):
        check_edge_model(model)
        self._bind(model, clean, corrupt, metric, sweep)
        self.layout = layout
        L = layout.n_layers
        self.cells = [layout.cells(layer) for layer in range(L + 1)]
        self.attn_cached = False  # the receiving layer's attention runs (with its patched input)
        names = [hooks.resid_pre(layer) for layer in range(L)] + [
            hooks.z(layer) for layer in range(L)] + [hooks.resid_post(L - 1)]
        with torch.no_grad():
            self.block_arity, self.attn_arity = shortcuts.output_arity(model, self.base)
            (self.base_metric, self.source_metric), cache = self._cached_runs(
                [self.base, self.source], names, rows or auto_rows(model, self.length))
            self.resid = [cache[hooks.resid_pre(layer)][0] for layer in range(L)]
            self.embed_delta = cache[hooks.resid_pre(0)][1] - self.resid[0]
            self.dz = [cache[hooks.z(layer)][1] - cache[hooks.z(layer)][0] for layer in range(L)]
            self.z_base = [cache[hooks.z(layer)][0] for layer in range(L)]
            self.final = cache[hooks.resid_post(L - 1)][0]  # what the final norm reads
            del cache
            self.W_O = [b.attn.W_O.detach() for b in model.blocks]
            self.attn_at_rows = shortcuts.supports_attention_at_rows(model.blocks[L - 1].attn)
            self.fast = self._fast_path_agrees() if fast is None else fast

    def _writes(self, senders: Sequence[int], p0: int, p1: int, length: int,
                layer: int | None) -> Float[Tensor, "n_s n_p pos d_model"]:
        """Each sender's write ``delta_s`` on prompts ``p0:p1`` (on block ``layer``'s device):
        the embeddings' ``resid_pre(0)`` difference, or ``dz[:, :, h] @ W_O[h]``."""
        out = []
        for s in senders:
            sl, h = self.layout.senders[s]
            if sl < 0:
                out.append(self._span(self.embed_delta, p0, p1, length, layer=layer))
                continue
            dz = self._span(self.dz[sl], p0, p1, length, layer=layer)[:, :, h]
            out.append(dz @ self.W_O[sl][h].to(dz.device))
        return torch.stack(out)

    def _patched_logits(self, layer: int, variants: Sequence[int], p0: int, p1: int,
                        fast: bool | None) -> Tensor:
        """Logits with each edge into receiver layer ``layer`` patched, rows variant-major."""
        model, L = self.model, self.layout.n_layers
        fast = self.fast if fast is None else fast
        n_v, n_p, length = len(variants), p1 - p0, self._run_length(p0, p1)
        cells = self.cells[layer][list(variants)]  # [n_v, 3]: sender, input, head
        senders = sorted(set(cells[:, 0].tolist()))
        row_of = {s: i for i, s in enumerate(senders)}
        srow = torch.tensor([row_of[s] for s in cells[:, 0].tolist()], dtype=torch.long)
        at = min(layer, L - 1)
        dev = self.layer_device[at]
        writes = self._writes(senders, p0, p1, length, at)  # [n_s, n_p, pos, d_model]
        if self._packed(fast):
            return self._fused_edge_logits(layer, variants, p0, p1, cells, srow, writes)
        forwards = shortcuts.skipped_blocks(model, at, self.block_arity)
        if fast:
            forwards += shortcuts.native_norms(model, at)
        if layer == L:  # the logits: the final residual plus each sender's write
            final = self._span(self.final, p0, p1, length, layer=at)
            out = (final[None] + writes[srow.to(dev)]).flatten(0, 1)
            x = self._span(self.resid[at], p0, p1, length, layer=at).repeat(n_v, 1, 1)
            forwards.append((model.blocks[at], shortcuts.returning(out, self.block_arity)))
            hooks_at, forwards_at = self._read_rows_only(p0, p1, n_v, fast, last_mlp=False,
                                                         last_attn=False)
            return self._suffix(x, at, forwards + forwards_at, hooks_at)
        resid = self._span(self.resid[layer], p0, p1, length, layer=layer)
        names = {i: hooks.head_site(self.layout.inputs[i], layer)
                 for i in sorted(set(cells[:, 1].tolist()))}
        src = shortcuts.run_until(model, layer, (resid[None] + writes).flatten(0, 1),
                                  list(names.values()), self.block_arity)
        fwd_hooks = []
        for i, name in names.items():
            js = (cells[:, 1] == i).nonzero()[:, 0]

            def write(act: Tensor, hook: Any, js=js, name=name) -> Tensor:
                view = act.view(n_v, n_p, *act.shape[1:])
                units = cells[js, 2].to(act.device)
                given = src[name].view(len(senders), n_p, *act.shape[1:])
                view[js.to(act.device), :, :, units] = given[srow[js].to(act.device), :, :,
                                                             units]
                return act

            fwd_hooks.append((name, write))
        hooks_at, forwards_at = self._read_rows_only(p0, p1, n_v, fast,
                                                     last_attn=layer != L - 1)
        x = resid.repeat(n_v, 1, 1)
        return self._suffix(x, layer, forwards + forwards_at, fwd_hooks + hooks_at)

    def _packed(self, fast: bool | None) -> bool:
        """Whether a run on the fast path is fused and packed: on a Llama-form model, always."""
        return bool(self.fast if fast is None else fast) and self.fused is not None

    def _fused_edge_logits(self, layer: int, variants: Sequence[int], p0: int, p1: int,
                           cells: Tensor, srow: Tensor, writes: Tensor
                           ) -> Float[Tensor, "n_var_x_n_p k vocab"]:
        """``_patched_logits`` of a Llama-form model: the receiving layer's attention output
        under each edge (``FusedLlama.edge_attention``: only the receiving head, or a KV head's
        query heads, re-attend), then ``fused.suffix_logits`` on the rows' packed positions;
        the logits receiver unembeds the final residual plus the write at the reads."""
        form, L = self.fused, self.layout.n_layers
        length = self._run_length(p0, p1)
        pack = self._packing(variants, p0, p1)
        if layer == L:
            final = self._span(self.final, p0, p1, length, layer=L - 1)
            y = (final[None] + writes[srow.to(final.device)]).flatten(0, 2)
            return pack.spread(form.logits(y.index_select(0, pack.read_dense_of(y.device))))
        resid = [self._span(self.resid[j], p0, p1, length, layer=j) for j in range(layer, L)]
        z_base = self._span(self.z_base[layer], p0, p1, length, layer=layer)
        inputs = [self.layout.inputs[i] for i in cells[:, 1].tolist()]
        attn = form.edge_attention(form.blocks[layer], resid[0], writes, z_base, srow, inputs,
                                   cells[:, 2])
        return fused.suffix_logits(form, pack, layer, resid, pack.gather_prompts(resid[0]),
                                   pack.gather(attn), devices=self.layer_device)

    def _probe_fast_path(self) -> bool:
        """The fast path against the plain one on the first and last edge of the earliest
        receiver layer (every later block runs) and of the logits, on two prompts (all of them
        for a scalar metric)."""
        sw = self.sweep
        p1 = min(2, sw.n_prompts) if sw.split_prompts else sw.n_prompts
        layers = [la for la, c in enumerate(self.cells) if len(c)]
        if not layers:  # no edge (inputs.check_edge_nodes refuses such a request): nothing to run
            return True
        err, scale = 0.0, 1.0
        for layer in sorted({layers[0], layers[-1]}):
            variants = sorted({0, len(self.cells[layer]) - 1})
            fast = self.run_variants(layer, variants, 0, p1, fast=True)
            plain = self.run_variants(layer, variants, 0, p1, fast=False)
            err = max(err, float((fast - plain).abs().max()))
            scale = max(scale, float(plain.abs().max()))
        return _within_fast_path_tol(self.model, err, scale, "the fast edge-patching path "
                                     "differs from the plain hooked path", "the plain path")

    def assemble(self, done: dict[int, Tensor]) -> tuple[Tensor, Tensor | None]:
        """Chunk results -> (values ``[n_senders, n_receivers, n_inputs]``, per_prompt
        ``[n_prompts, ...]`` or None); NaN where (sender, receiver, input) is no edge."""
        sw, lay = self.sweep, self.layout
        r_index = lay.receiver_index()
        L = lay.n_layers
        grid = torch.full((sw.n_prompts, len(lay.senders), len(lay.receivers), len(lay.inputs)),
                          float("nan"))
        for cid, c in enumerate(sw.chunks):
            cells = self.cells[c.layer][c.v0:c.v1]
            r = torch.tensor([r_index[(c.layer, int(u)) if c.layer < L else (L, -1)]
                              for u in cells[:, 2]], dtype=torch.long)
            grid[c.p0:c.p1, cells[:, 0], r, cells[:, 1]] = done[cid].T
        values = grid.mean(0)
        return values, grid if self.metric.per_prompt_values else None
