"""Head sets patched together (``ck.HeadSetUnits``: causal validation, ablation, the cumulative
bins): ``HeadSetRuns``, the ``ExactEngine`` mixin behind ``run_head_sets`` (what a set's heads
get: ``HEAD_SET_SOURCES``; another prompt's base ``z``: ``derangement``, also ``ck.circuit``'s
resample, or a sweep's ``resample_pairing``). A head-set sweep's chunks:
``set_engine.HeadSetEngine``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import einops
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching import shortcuts
from circuitkit.patching.exact import fused
from circuitkit.patching.exact.checks import (
    _FAST_PATH_VERDICTS,
    _within_fast_path_tol,
    evaluate_metric,
)
from circuitkit.patching.sweep import auto_rows

# "mean": mean_z, over prompts and positions (ck.circuit's per-position one is "position-mean")
HEAD_SET_SOURCES = ("source", "zero", "mean", "resample")
# the sites a head set is patched at: its output z, or its attention pattern (the paper's
# cumulative-bin experiment; source runs only, on the hooked path)
HEAD_SET_SITES = ("z", "pattern")


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


RESAMPLE_BUCKETS = 4  # a head-set sweep's resample pairs prompts within these length buckets


def resample_pairing(n: int, seed: int) -> Tensor:
    """The prompt whose base ``z`` each of ``n`` prompts (in length order) takes in a head-set
    sweep's resample (``HeadSetUnits``): the prompts cut into ``RESAMPLE_BUCKETS`` buckets of
    equal size (bounds ``round(n i / RESAMPLE_BUCKETS)``; a bucket of one prompt joins the one
    before it, or the next), each paired by ``derangement(size, seed + its first prompt)``: a
    prompt takes ``z`` from another of about its length, and the pairing depends on ``n`` and
    ``seed`` alone, never on how the sweep is cut into chunks. ``[n]`` prompt indices."""
    if n < 2:
        raise ValueError(f"source='resample' takes each prompt's z from another prompt; there "
                         f"{'is' if n == 1 else 'are'} {n}. Pass at least 2.")
    kept = [0]
    for b in sorted({round(n * i / RESAMPLE_BUCKETS) for i in range(1, RESAMPLE_BUCKETS + 1)}):
        if b - kept[-1] >= 2:
            kept.append(b)
    if kept[-1] != n:  # a short tail joins the bucket before it
        kept = kept[:-1] + [n] if len(kept) > 1 else [0, n]
    return torch.cat([derangement(b - a, seed + a) + a
                      for a, b in zip(kept[:-1], kept[1:], strict=True)])


class HeadSetRuns:
    """``ExactEngine``'s head-set runs (a mixin: it uses the engine's cached runs, ``_span``,
    ``_packing``, ``fused`` and ``fast``). ``_pairing``: the resample pairing of every prompt
    (``[n_prompts]``, a head-set sweep's ``resample_pairing``), or None: each call's own."""

    _pairing: Tensor | None = None

    def _resample_pairing(self, p0: int, p1: int, seed: int) -> Tensor:
        """The prompt (an index into all prompts) whose base ``z`` each of ``p0:p1`` takes:
        ``_pairing[p0:p1]``, else ``derangement(p1 - p0, seed)`` within ``p0:p1``."""
        if self._pairing is not None:
            return self._pairing[p0:p1]
        return derangement(p1 - p0, seed) + p0

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
        positions: a derangement of the prompts seeded by ``seed``, one for the whole call; a
        head-set sweep's engine: its pairing of every prompt, ``resample_pairing``).

        Needs a sweep over site ``z`` (the engine caches ``resid_pre`` and source ``z`` of every
        layer), or over site ``pattern`` (``source="source"`` only, hooked: each set's heads get
        the source run's attention pattern, the paper's cumulative-bin experiment). Sets are
        grouped by their lowest layer ``l0``; a group's sets are stacked in the
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
        p1 = sw.n_prompts if p1 is None else p1
        metrics, sets = self._checked_head_sets(head_sets, p0, p1, metrics, source)
        n_p, length = p1 - p0, self._run_length(p0, p1)
        perm = self._resample_pairing(p0, p1, seed) if source == "resample" else None
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

    def _checked_head_sets(self, head_sets: Sequence[Sequence[tuple[int, int]]], p0: int,
                           p1: int, metrics: Sequence[Any] | None, source: str
                           ) -> tuple[list[PromptMetric], list[list[tuple[int, int]]]]:
        """``run_head_sets``' arguments checked (one clear ``ValueError`` each): the engine's
        sweep, ``source``, each metric (a ``PromptMetric`` reading within the engine metric's
        reads), each head in the model; returns (metrics, each set sorted without repeats)."""
        sw = self.sweep
        if (sw.kind, sw.positions) != ("heads", "all") or sw.site not in HEAD_SET_SITES:
            raise ValueError("run_head_sets needs an engine built for site='z' or 'pattern', "
                             f"positions='all' (got kind={sw.kind!r}, site={sw.site!r}, "
                             f"positions={sw.positions!r}).")
        if source not in HEAD_SET_SOURCES:
            raise ValueError(f"source={source!r}; expected one of {list(HEAD_SET_SOURCES)}.")
        if sw.site != "z" and source != "source":
            raise ValueError(f"source={source!r} ablates z; an engine built for site {sw.site!r} "
                             f"patches the source run's {sw.site} only (source='source').")
        if source == "resample" and p1 - p0 < 2 and self._pairing is None:
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
        return metrics, sets

    def _head_sets_fused(self, fast: bool | None, source: str) -> bool:
        """Whether ``run_head_sets`` runs its sets fused and packed (``_fused_head_set_logits``):
        a Llama-form model on the fast path, once ``_head_sets_agree`` found the fused sets
        equal to the hooked ones on this model (per ``source``)."""
        if not self._packed(fast) or self.sweep.site != "z":  # (a pattern set: hooked)
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
        pattern = self.sweep.site == "pattern"  # [batch, head, q, k]; z: [batch, pos, head, d]
        for layer in sorted({la for s in group for la, _ in s}):
            heads = [[h for la, h in s if la == layer] for s in group]
            src = self._head_set_source(layer, source, p0, p1, length, perm)

            def hook(act: Tensor, hook: Any, heads=heads, src=src, n_g=n_g) -> Tensor:
                view = act.view(n_g, n_p, *act.shape[1:])
                for j, hs in enumerate(heads):
                    if hs and pattern:
                        view[j][:, hs] = src[:, hs].to(act.dtype)
                    elif hs:
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
            pack = fused.Packing(torch.zeros(n_g * n_p, dtype=torch.long), reads.max(1).values + 1,
                                 torch.arange(n_p).repeat(n_g), reads, length)
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
        # another prompt's z (``perm``: indices into all prompts), also at positions after
        # its own last read where the cached run stopped there
        every = self._site_base_to_length() if self.rows_cut_at_reads else self.site_base
        return self._span(every[layer][perm.cpu()], 0, p1 - p0, length, site=True)

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

