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
block's forward ran). ``_suffix`` therefore turns blocks below ``l`` into identities for the
duration of the run, so only embedding lookup (needed by HF to size positions/masks; rotary
positions come from the sequence length as in a normal run) and blocks ``l..L-1`` run.

Work is cut into *chunks* (one layer, a range of variants, a range of prompts). Each chunk's
result is a ``[n_variants, n_prompts]`` tensor; chunks are independent, which is what makes
checkpointing (a folder of chunk files, ``SweepCheckpoint``) and sharding across
``torchrun`` ranks (``distributed.py``) simple and bit-reproducible: the chunk plan is fixed up
front and stored with the checkpoint, and a chunk's numbers never depend on who computes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from circuitkit import hooks
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


# --- validation ---------------------------------------------------------------------------------


def _is_prompt_metric(metric: Any) -> bool:
    return hasattr(metric, "per_prompt") and hasattr(metric, "select")


def _metric_name(metric: Any) -> str:
    return str(getattr(metric, "name", None) or getattr(metric, "__name__", type(metric).__name__))


def _reads(metric: Any) -> Tensor | None:
    """Logit positions a PromptMetric declares it reads (None: it may read any)."""
    return getattr(metric, "reads", None) if _is_prompt_metric(metric) else None


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
                "(circuitkit.patching.metrics) for per-prompt values.")
        out = out[None]
    out = out.detach().float().cpu()
    if not torch.isfinite(out).all():
        raise ValueError(f"metric returned a non-finite value ({what}): {out.tolist()[:8]}. "
                         "Check the answer positions/tokens it reads and the logits' dtype.")
    return out


# --- the suffix run ---------------------------------------------------------------------------


@contextlib.contextmanager
def _suffix(model: Any, layer: int, tuple_out: bool):
    """Make blocks ``0..layer-1`` identities (restored on exit); see the module docstring."""
    def identity(*args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else kwargs["hidden_states"]
        return (x,) if tuple_out else x

    skipped = list(model.blocks)[:layer]
    for b in skipped:
        # An instance attribute shadows the class method. object.__setattr__: the bridge's
        # component __setattr__ would forward the assignment to the wrapped HF module.
        object.__setattr__(b, "forward", identity)
    try:
        yield
    finally:
        for b in skipped:
            b.__dict__.pop("forward", None)


def _block_returns_tuple(model: Any, tokens: Tensor) -> bool:
    """Whether the HF stack expects tuple block outputs (transformers < 5) or bare tensors."""
    seen: list[bool] = []
    h = model.blocks[0].register_forward_hook(lambda m, a, o: seen.append(isinstance(o, tuple)))
    try:
        model(tokens[:1, :2])
    finally:
        h.remove()
    return bool(seen and seen[0])


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
        """Sequence-blocks a chunk runs: rows x blocks executed."""
        layer, v0, v1, p0, p1 = chunk
        return (v1 - v0) * (p1 - p0) * (self.n_layers - layer)

    def plan(self, rows: int) -> None:
        """Cut the work into chunks of at most ``rows`` sequences per forward pass."""
        rows = max(1, int(rows))
        self.chunks = []
        if rows >= self.n_prompts or not self.per_prompt:
            per = max(1, rows // self.n_prompts)
            for layer in range(self.n_layers):
                for v0 in range(0, self.n_variants, per):
                    self.chunks.append(
                        (layer, v0, min(v0 + per, self.n_variants), 0, self.n_prompts))
        else:  # prompts split: one variant per forward (needs a per-prompt metric)
            for layer in range(self.n_layers):
                for v in range(self.n_variants):
                    for p0 in range(0, self.n_prompts, rows):
                        self.chunks.append((layer, v, v + 1, p0, min(p0 + rows, self.n_prompts)))


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
    """Caches the base/source runs once, then computes any chunk of a ``Sweep``."""

    def __init__(self, model: Any, clean: Tensor, corrupt: Tensor, metric: Any, sweep: Sweep):
        self.model, self.metric, self.sweep = model, metric, sweep
        self.device = next(model.parameters()).device
        base, source = (corrupt, clean) if sweep.direction == "denoise" else (clean, corrupt)
        self.base, self.source = base.to(self.device), source.to(self.device)
        L = sweep.n_layers
        self.site_names = [self._site_name(layer) for layer in range(L)]
        resid = [hooks.resid_pre(layer) for layer in range(L)]
        with torch.no_grad():
            self.tuple_out = _block_returns_tuple(model, self.base)
            # Caches live on the CPU when the model is on a GPU: a 70B sweep's per-layer source
            # patterns would not fit next to the weights. Each layer's slice moves on demand.
            store = torch.device("cpu")
            logits, cache = model.run_with_cache(self.base, names_filter=lambda n: n in resid)
            self.base_metric = _evaluate(metric, logits, sweep.n_prompts, "unpatched base run")
            self.resid = [cache[n].to(store) for n in resid]
            del cache, logits
            want = set(self.site_names)
            logits, cache = model.run_with_cache(self.source, names_filter=lambda n: n in want)
            self.source_metric = _evaluate(metric, logits, sweep.n_prompts, "unpatched source run")
            self.src = [cache[n].to(store) for n in self.site_names]
            del cache, logits
        self._check_head_axis()
        self._layer = -1

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

    def _write_patch(self, act: Tensor, src: Tensor, variants: Sequence[int]) -> Tensor:
        """Write ``src``'s slice of each variant into ``act`` ([n_var * n_p, ...], in place).

        Head sites: head axis from ``hooks.head_axis`` (2 for q/k/v/z, 1 for pattern); the
        position axis is the one after batch for vectors, ``query_pos`` for patterns.
        Layer sites: ``[batch, pos, d_model]``, patched at one position.
        """
        sw = self.sweep
        n_p = src.shape[0]
        view = act.view(len(variants), n_p, *act.shape[1:])
        for i, v in enumerate(variants):
            unit, pos = sw.variant(v)
            if sw.kind == "layers":
                view[i, :, pos] = src[:, pos]
                continue
            idx: list[Any] = [slice(None)] * src.ndim
            idx[hooks.head_axis(sw.site)] = unit
            if pos is not None:
                idx[2 if sw.site == "pattern" else 1] = pos
            view[i][tuple(idx)] = src[tuple(idx)]
        return act

    def run_chunk(self, chunk: tuple[int, int, int, int, int]) -> Float[Tensor, "n_var n_p"]:
        """Metric after each patch of the chunk: ``[n_variants, n_prompts]`` ([n_variants, 1] for a
        scalar metric)."""
        layer, v0, v1, p0, p1 = chunk
        return self.run_variants(layer, range(v0, v1), p0, p1)

    def run_variants(self, layer: int, variants: Sequence[int], p0: int, p1: int
                     ) -> Float[Tensor, "n_var n_p"]:
        """Metric after patching each of ``variants`` (any subset) of ``layer``, on prompts
        ``p0:p1``, all in one suffix forward: ``[len(variants), p1 - p0]`` (``[., 1]`` for a
        scalar metric, which needs all prompts)."""
        sw, model = self.sweep, self.model
        n_v, n_p = len(variants), p1 - p0
        resid = self.resid[layer][p0:p1].to(self.device)
        src = self.src[layer][p0:p1].to(self.device)
        x = resid.repeat(n_v, 1, 1)  # [n_v * n_p, seq, d_model], variant-major
        fwd_hooks = []
        if sw.kind == "layers" and sw.site == "resid_pre":
            self._write_patch(x, src, variants)  # the patch *is* the restart point
        else:
            def hook(act: Tensor, hook: Any) -> Tensor:
                return self._write_patch(act, src, variants)

            fwd_hooks = [(self.site_names[layer], hook)]
        metric = self.metric
        if _is_prompt_metric(metric) and (p0, p1) != (0, sw.n_prompts):
            metric = metric.select(list(range(p0, p1)))
        at = _reads(metric)
        if at is not None:
            # Unembed only the positions the metric reads: with a big vocabulary the
            # unembedding costs as much as several blocks, and most positions are never read.
            at = at.to(self.device)
            fwd_hooks = fwd_hooks + [(hooks.UNEMBED_IN, lambda x, hook: x[:, at])]
        with torch.no_grad(), _suffix(model, layer, self.tuple_out), \
                model.hooks(fwd_hooks=fwd_hooks):
            logits = model(x, start_at_layer=layer)
        return torch.stack([
            _evaluate(metric, logits[i * n_p:(i + 1) * n_p], n_p,
                      f"patched layer {layer}, variant {variants[i]}",
                      at=None if at is None else at.cpu())
            for i in range(n_v)])

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
    sweep.plan(rows)
    engine = ExactEngine(model, clean_tokens, corrupt_tokens, metric, sweep)
    probe = sweep.chunks[0]
    t0 = time.perf_counter()
    engine.run_chunk(probe)
    per_cost = (time.perf_counter() - t0) / sweep.chunk_cost(probe)
    total = sum(sweep.chunk_cost(c) for c in sweep.chunks)
    return dict(
        n_variants=sweep.n_layers * sweep.n_variants, n_prompts=n, seq=seq,
        n_chunks=len(sweep.chunks), rows_per_forward=min(rows, sweep.n_variants * n),
        # one pass = one prompt through all layers (the suffix engine runs (L-l)/L of one)
        pass_equivalents=total / f.n_layers + 2 * n,
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
    sweep.plan(batch_size or auto_rows(model, sweep.seq))
    identity = dict(kind=sweep.kind, site=sweep.site, direction=sweep.direction,
                    positions=sweep.positions, tokens=tokens_hash(clean, corrupt),
                    model=model_fingerprint(model), metric=_metric_name(metric),
                    per_prompt=sweep.per_prompt)
    ckpt = None
    if checkpoint is not None:
        ckpt = SweepCheckpoint.open(checkpoint, identity, sweep.chunks, rank=rank, world=world)
        sweep.chunks = ckpt.chunks  # a resumed sweep keeps its original chunk plan
    done: dict[int, Tensor] = dict(ckpt.load_done()) if ckpt else {}
    engine = ExactEngine(model, clean, corrupt, metric, sweep)
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
    pp = sweep.per_prompt
    return PatchResult(
        values=values, clean=float(engine.clean_metric.mean()),
        corrupt=float(engine.corrupt_metric.mean()), direction=sweep.direction, method="exact",
        site=sweep.site, positions=sweep.positions, per_prompt=per_prompt,
        clean_per_prompt=engine.clean_metric if pp else None,
        corrupt_per_prompt=engine.corrupt_metric if pp else None,
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
    return tqdm(total=total, desc=f"patch {sweep.site} {sweep.direction}", unit="seq-block",
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
