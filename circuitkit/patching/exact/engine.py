"""``ExactEngine``: exact activation patching of heads and layers, batched and restarted at the
patched layer; how it works (cached runs, restart, fast path, fused suffix, read positions):
``patching/exact/__init__.py``'s docstring. Head sets patched together: ``HeadSetRuns``
(``patching/exact/head_sets.py``); edges: ``EdgeEngine`` (``patching/exact/edges.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching import shortcuts
from circuitkit.patching.exact import fused
from circuitkit.patching.exact.checks import (
    _FAST_PATH_VERDICTS,
    _warn_fast_path_off,
    _within_fast_path_tol,
    evaluate_metric,
)
from circuitkit.patching.exact.head_sets import HeadSetRuns
from circuitkit.patching.inputs import ReadsDoNotHold
from circuitkit.patching.sweep import Chunk, Sweep, auto_rows, bucket_split, is_out_of_memory

# Sites whose patch leaves block l's attention computation to a cached output (fast path).
ATTN_OUTPUT_SITES = frozenset({("heads", "z"), ("layers", "attn_out"), ("layers", "mlp_out")})


class ExactEngine(HeadSetRuns):
    """Caches the base/source runs once, then computes any chunk of a ``Sweep``.

    ``fast``: use the fast path (``patching/exact/__init__.py``'s docstring); ``None`` = after
    checking it on a probe.
    """

    def __init__(self, model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric,
                 sweep: Sweep, fast: bool | None = None, rows: int | None = None):
        self._bind(model, clean, corrupt, metric, sweep)
        L = sweep.n_layers
        site = hooks.layer_site if sweep.kind == "layers" else hooks.head_site
        self.site_names = [site(sweep.site, layer) for layer in range(L)]
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
            self.attn_at_rows = shortcuts.supports_attention_at_rows(model.blocks[L - 1].attn)
            self.fast = self._fast_path_agrees() if fast is None else fast
        self._mean_z: dict[int, Tensor] = {}  # mean_z per layer, computed on first use
        self._whole_site_base: list[Tensor] | None = None  # (_site_base_to_length)

    def _bind(self, model: Any, clean: Tensor, corrupt: Tensor, metric: PromptMetric,
              sweep: Sweep) -> None:
        """What every engine holds: the model, metric and sweep, devices, the metric's reads
        and the base and source tokens (up to the last read position)."""
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
        # (reads a probe found on random logits, metric.probed, are checked on the cached runs'
        # logits at the reads: PromptMetric.reads_hold_at; inputs.ReadsDoNotHold if not)
        base, source = (corrupt, clean) if sweep.direction == "denoise" else (clean, corrupt)
        self.base = base[:, :self.length].to(self.device)
        self.source = source[:, :self.length].to(self.device)

    def _cached_runs(self, token_sets: Sequence[Tensor], names: Sequence[str], rows: int
                     ) -> tuple[list[Tensor], dict[str, list[Tensor]]]:
        """Metric of unpatched runs of each ``[n, seq]`` token set and their activations at
        ``names`` (``cache[name][set]``, stored on the CPU). The sets run stacked in the batch,
        at most ``rows`` sequences per forward. A probed metric's reads are checked on each
        set's logits at the reads (``PromptMetric.reads_hold_at``; ``inputs.ReadsDoNotHold``)."""
        want, n = set(names), self.sweep.n_prompts
        tokens = torch.cat(list(token_sets))
        check = self.metric.probed and self.reads is not None
        reads = None if self.reads is None else self.reads.repeat(len(token_sets), 1)
        logits, acts = [], {name: [] for name in want}
        kinds = fused.cache_kinds(len(self.fused.blocks)) if self.fused is not None else {}
        if not (want <= kinds.keys() and self._fused_cache_agrees(tokens, reads, kinds)):
            kinds = {}
        # The fused run stops each prompt at its own last read (later positions hold zeros):
        # enough for every patch of a prompt by itself, not for a z taken from another prompt
        # (run_head_sets' resample, _site_base_to_length).
        self.rows_cut_at_reads = bool(kinds) and reads is not None
        for r0 in range(0, tokens.shape[0], rows):
            if kinds:  # a Llama-form model: the same run as plain tensor code
                out, cache = self.fused.cached_run(
                    tokens[r0:r0 + rows], {name: kinds[name] for name in want},
                    None if reads is None else reads[r0:r0 + rows], self.layer_device)
                logits.append(out)
                for name in want:
                    acts[name].append(cache[name].to("cpu"))
                continue
            fwd_hooks = []
            if reads is not None:
                idx = reads[r0:r0 + rows].to(self.device)
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
                if not self.metric.reads_hold_at(all_logits[i * n:(i + 1) * n], self.sweep.seq):
                    raise ReadsDoNotHold(self.metric.name, which[i % 2])
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
                f"its cfg implies {sw.n_units} "
                f"(n_key_value_heads={hooks.facts(self.model).n_kv_heads}). The cfg lacks correct "
                f"GQA info; set model.cfg.n_key_value_heads = {got}, or patch site='z' or 'q'.")

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
            view += einops.einsum(dz[:, :, heads], W_O[heads], "b pos v dh, v dh dm -> v b pos dm")
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
        """For a metric without per-prompt values (its chunks hold every prompt): a prompt index
        splitting ``p0:p1`` (sorted by length) into two forwards (``sweep.bucket_split``, as
        ``sweep.chunked`` splits chunks for per-prompt metrics); None otherwise, or when the logits
        are not read at known positions (full-length logits of two buckets would not join)."""
        if self.reads is None or p1 - p0 < 4 or self.sweep.split_prompts or not self.causal:
            return None  # (a per-prompt metric's chunks are already length buckets: sweep.chunked)
        need = (self.reads[p0:p1].max(1).values + 1).tolist()
        if any(a > b for a, b in zip(need, need[1:], strict=False)):
            return None  # not sorted by length: nothing to gain
        best = bucket_split(need)
        return None if best is None else p0 + best

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
        """The model read as Llama-form blocks (``patching/exact/fused.py``) when the fast path may
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
            x = pack.gather(self._write_patch(resid[0].repeat(n_v, 1, 1), src, variants, length))
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
