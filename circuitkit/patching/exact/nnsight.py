"""Exact head sweeps through nnsight's tracing: locally, or on NDIF (``remote=True``).

The same sweep as the TransformerLens engine (``patch_heads(..., backend="nnsight")``), for
models that only nnsight reaches: NDIF serves large hub models (Llama-3.1-70B ...) to researchers
without GPUs of their own; nnsight ships the trace there and brings back what it saves.

For each layer ``l``: the *source* tokens' activation at the site of ``l`` (locally: every layer's
from one trace; remotely: one trace per layer that stops there, so each download is one layer's
size); then traces of the *base* tokens, repeated once per variant (``g`` variants of ``n``
prompts per trace, ``[g * n, seq]``), write each variant's head slice from the source in place:

* ``z``: the input of ``self_attn.o_proj`` (heads concatenated, ``[batch, pos, n_heads *
  d_head]``), columns ``h * d_head:(h + 1) * d_head``;
* ``q`` / ``k`` / ``v``: the output of ``q_proj`` / ``k_proj`` / ``v_proj`` (before rotary for q
  and k: patching a position with the source's value at the same position gives the source's
  rotated value, so it equals TransformerLens's ``hook_q`` / ``hook_k`` patch); k and v have the
  KV-head count under GQA.

Each trace saves the logits at the positions the metric reads only (``PromptMetric.reads``), so
a remote run downloads ``[g * n, k, vocab]``, not every position's logits. Runs stop after the
last read position (causal model), as the engine's. Direction, positions and metric mean what
they mean for ``patch_heads``; pattern patching and attribution need the TransformerLens backend.
Models: Llama-style decoders (``model.layers[l].self_attn.{q,k,v,o}_proj``: Llama, Mistral,
Qwen2, SmolLM2, ...). nnsight facts this relies on: ``circuitkit``'s FIELD notes (traces live in
this source file; ``torch.no_grad()``; eager attention, as TransformerLens's bridge).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuitkit.hooks import ModelFacts
from circuitkit.metrics import PromptMetric, as_metric
from circuitkit.patching.inputs import (
    DIRECTIONS,
    POSITIONS,
    check_batch_size,
    check_metric_prompts,
    check_tokens,
    checked_metric,
    choice,
)
from circuitkit.patching.results import PatchResult

SITES = ("z", "q", "k", "v")
NDIF_SIGNUP = "https://login.ndif.us"


# --- the model ----------------------------------------------------------------------------------


def check_remote(name: str) -> str:
    """The hub id NDIF would run for ``name``; ``ValueError`` without an API key or a hub id."""
    from circuitkit.models import resolve_name, shipped_path

    hub_id = resolve_name(str(name))
    if shipped_path(str(name)) is not None or Path(str(name)).expanduser().exists() \
            or "/" not in hub_id:
        raise ValueError(
            f"--remote runs the model on NDIF, which serves hub models: pass a hub id or an "
            f"alias (e.g. llama3.1-70b = meta-llama/Llama-3.1-70B), not {name!r}.")
    if not os.environ.get("NDIF_API_KEY"):
        raise ValueError(
            "--remote needs an NDIF API key in the environment: export NDIF_API_KEY=<your key> "
            f"(free sign-up at {NDIF_SIGNUP}); run without --remote to trace locally.")
    return hub_id


def load(model: Any, remote: bool = False, dtype: Any = None) -> Any:
    """An nnsight ``TransformersModel`` for ``model``: an nnsight model (returned as is), a name
    (shipped toy, alias, folder, hub id) or a TransformerBridge loaded from a folder or hub id
    (reloaded from there: the bridge rewraps the HF modules it holds). ``remote``: the model is
    built on the meta device (its weights stay on NDIF); needs ``check_remote``."""
    try:
        from nnsight.modeling.transformers import TransformersModel
    except ImportError:
        raise ValueError("backend='nnsight' needs nnsight 0.8: pip install 'circuitkit[nnsight]' "
                         "(or pip install 'nnsight==0.8.*').") from None
    if hasattr(model, "trace") and hasattr(model, "_module"):
        return model
    if hasattr(model, "original_model"):  # a TransformerBridge
        source = getattr(model.original_model.config, "_name_or_path", "")
        if not source or source.startswith("config:") or not (
                Path(source).is_dir() or "/" in source):
            raise ValueError(
                "backend='nnsight' got a TransformerBridge built in memory; pass a model name, "
                "a checkpoint folder or an nnsight model instead.")
        model = source
    name = str(model)
    if remote:
        return TransformersModel(check_remote(name), task="text-generation")
    from circuitkit import models

    path = models.shipped_path(name) or (Path(name).expanduser()
                                         if Path(name).expanduser().is_dir() else None)
    if path is None and name.lower() == "smollm2-135m":
        path = models.smollm2_local_folder()
    if path is not None:  # (a hub id's pickle: nnsight's own loader, not checked here)
        models.refuse_pickle_weights(str(path), [f.name for f in path.iterdir()])
    target = str(path) if path is not None else models.resolve_name(name)
    if path is None and not models.weights_available(name):
        raise models.ModelNotAvailableError(
            f"backend='nnsight' traces {name!r} locally but its weights are not on this machine;"
            f" download them, or add --remote to run on NDIF.")
    kw = {} if dtype is None else dict(dtype=models._torch_dtype(dtype))
    return TransformersModel(target, task="text-generation", dispatch=True,
                             attn_implementation="eager", **kw)


def facts(lm: Any) -> ModelFacts:
    """Shape facts from the HF config of an nnsight model."""
    c = lm.config
    n_heads = int(c.num_attention_heads)
    d_head = int(getattr(c, "head_dim", None) or c.hidden_size // n_heads)
    return ModelFacts(n_layers=int(c.num_hidden_layers), n_heads=n_heads,
                      n_kv_heads=int(getattr(c, "num_key_value_heads", None) or n_heads),
                      d_head=d_head, d_model=int(c.hidden_size), d_vocab=int(c.vocab_size),
                      n_ctx=int(getattr(c, "max_position_embeddings", 0) or 0),
                      d_vocab_out=int(c.vocab_size), causal=True)  # HF causal LMs


def _attention(lm: Any, layer: int) -> Any:
    try:
        return lm.model.layers[layer].self_attn
    except AttributeError:
        raise ValueError(
            f"backend='nnsight' supports Llama-style decoders (model.layers[l].self_attn with "
            f"q/k/v/o_proj); {type(lm._module).__name__} has another layout. Use the "
            "TransformerLens backend.") from None


def _site(lm: Any, layer: int, site: str) -> Any:
    """The proxy of ``site`` at ``layer`` inside a trace: heads concatenated on the last axis."""
    attn = _attention(lm, layer)
    if site == "z":
        return attn.o_proj.input
    return getattr(attn, f"{site}_proj").output


# --- the sweep ------------------------------------------------------------------------------------


def patch_heads(model: Any, clean_tokens: Tensor, corrupt_tokens: Tensor, metric: Any,
                units: Any, method: str, opts: Any) -> PatchResult:
    """Exact head patching through nnsight (module docstring); the arguments and the result
    are those of ``circuitkit.patch`` over ``HeadUnits`` (``opts``: its ``PatchOptions``).
    ``batch_size``: sequences per trace (default: 64, at least all prompts: every variant runs
    all prompts). ``method``: "exact" ("auto" runs exact: the attribution screen needs the
    TransformerLens backend)."""
    direction, positions, site = opts.direction, units.positions, units.site
    batch_size, progress, remote, task_hash = (opts.batch_size, opts.progress, opts.remote,
                                               opts.task_hash)
    choice("direction", direction, DIRECTIONS)
    choice("positions", positions, POSITIONS)
    if site not in SITES:
        raise ValueError(f"site={site!r} is not supported by backend='nnsight'; expected one of "
                         f"{list(SITES)} (pattern patching needs the TransformerLens backend).")
    if method not in ("exact", "auto"):
        raise ValueError(f"method={method!r} is not supported by backend='nnsight'; use 'exact' "
                         "(attribution needs the TransformerLens backend).")
    check_batch_size(batch_size)
    t0 = time.perf_counter()
    lm = load(model, remote=remote)
    f = facts(lm)
    clean, corrupt = check_tokens(clean_tokens, corrupt_tokens)
    if int(max(clean.max(), corrupt.max())) >= f.d_vocab:
        raise ValueError(f"token ids must lie in [0, {f.d_vocab}) for this model's vocabulary; "
                         f"got ids up to {int(max(clean.max(), corrupt.max()))}.")
    n, seq = clean.shape
    pm = as_metric(metric, n, seq, f.d_vocab_out)
    check_metric_prompts(pm, n)
    # (remotely, checking reads on the real logits would download them whole: not done)
    pm = checked_metric(lm, clean, corrupt, pm,
                        logits_of=False if remote else (lambda t: _logits(lm, t)))
    reads = pm.read_positions()
    length = seq if reads is None else int(reads.max()) + 1  # causal: nothing after matters
    base, source = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
    base, source = base[:, :length], source[:, :length]
    n_units = f.n_heads_at(site)
    n_pos = seq if positions == "each" else 1
    variants = [(u, p) for u in range(n_units) for p in (range(n_pos) if n_pos > 1 else [None])]
    per_trace = max(1, (batch_size or max(n, 64)) // n)
    grid, base_m, source_m = _sweep(lm, f, base, source, pm, reads, site, direction,
                                    variants, per_trace, length, remote, progress)
    shape = (f.n_layers, n_units, n_pos) if positions == "each" else (f.n_layers, n_units)
    values = grid.mean(-1).reshape(shape)
    per_prompt = grid.permute(2, 0, 1).reshape(n, *shape) if pm.per_prompt_values else None
    clean_m, corrupt_m = (source_m, base_m) if direction == "denoise" else (base_m, source_m)
    meta = dict(backend="nnsight", remote=remote, model=str(getattr(lm.config, "_name_or_path",
                                                                     "")),
                metric=pm.name, n_prompts=n, seq=seq, traces_per_layer=-(-len(variants)
                                                                        // per_trace),
                seconds=time.perf_counter() - t0,
                head_axis="kv_head" if site in ("k", "v") and f.gqa else "head",
                facts=f.to_dict())
    if method == "auto":
        meta["auto"] = dict(chose="exact", note="backend='nnsight' runs exact sweeps only")
    if task_hash is not None:
        meta["task_hash"] = task_hash
    if pm.note:
        meta["metric_note"] = pm.note
    return PatchResult(
        values=values, clean=float(clean_m.mean()), corrupt=float(corrupt_m.mean()),
        direction=direction, method="exact", site=site, positions=positions,
        per_prompt=per_prompt, clean_per_prompt=clean_m if pm.per_prompt_values else None,
        corrupt_per_prompt=corrupt_m if pm.per_prompt_values else None, meta=meta)


def _sweep(lm: Any, f: ModelFacts, base: Tensor, source: Tensor, pm: PromptMetric,
           reads: Tensor | None, site: str, direction: str, variants: list, per_trace: int,
           length: int, remote: bool, progress: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Every layer's ``variants`` patched, ``per_trace`` per trace: ``grid [n_layers,
    n_variants, n_prompts]`` and the base and source runs' metric values ``[n_prompts]``."""
    grid = torch.empty(f.n_layers, len(variants), base.shape[0])
    with torch.no_grad():
        base_m, source_m = _baselines(lm, base, source, pm, reads, remote)
        steps = [(layer, s) for layer in range(f.n_layers)
                 for s in range(0, len(variants), per_trace)]
        bar = None
        if progress:
            from circuitkit._progress import tqdm

            bar = tqdm(total=len(steps), desc=f"nnsight patch {site} {direction}",
                       unit="trace")
        # locally every layer's source activation in one trace; remotely one layer per trace
        # (each download stays one layer's size)
        sources = None if remote else _source_activations(lm, source, f.n_layers, site)
        src = None
        for layer, s in steps:
            if s == 0:
                src = sources[layer] if sources is not None else _source_activation(
                    lm, source, layer, site, remote)
            group = variants[s:s + per_trace]
            grid[layer, s:s + len(group)] = _patched(lm, base, src, layer, site, group,
                                                     f.d_head, length, pm, reads, remote,
                                                     base_m)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
    return grid, base_m, source_m


def _metric_of(logits: Tensor, pm: PromptMetric, reads: Tensor | None, copies: int,
               what: str) -> Tensor:
    """Per-prompt metric of ``copies`` stacked copies of the prompts: ``[copies, n]``."""
    from circuitkit.patching.exact import evaluate_metric

    n = logits.shape[0] // copies
    tiled = pm.select(list(range(n)) * copies)
    at = None if reads is None else reads.repeat(copies, 1)
    return evaluate_metric(tiled, logits.float(), what, at=at).view(copies, n)


def _logits(lm: Any, tokens: Tensor) -> Tensor:
    """Logits ``[batch, seq, vocab]`` of an unpatched local run."""
    with torch.no_grad(), lm.trace(tokens):
        out = lm.lm_head.output.save()
    return out


def _read_logits(lm: Any, rows: int, reads: Tensor | None, copies: int) -> Any:
    """Inside a trace: the logits proxy at the metric's read positions (all when None)."""
    logits = lm.lm_head.output
    if reads is None:
        return logits
    idx = reads.repeat(copies, 1)
    return logits[torch.arange(rows)[:, None], idx]


def _baselines(lm: Any, base: Tensor, source: Tensor, pm: PromptMetric, reads: Tensor | None,
               remote: bool) -> tuple[Tensor, Tensor]:
    """Metric of the unpatched base and source runs (one trace, both stacked)."""
    tokens = torch.cat([base, source])
    with lm.trace(tokens, remote=remote):
        out = _read_logits(lm, tokens.shape[0], reads, 2).save()
    m = _metric_of(out, pm, reads, 2, "unpatched base and source runs")
    return m[0], m[1]


def _source_activation(lm: Any, source: Tensor, layer: int, site: str, remote: bool) -> Tensor:
    """The source run's activation at ``site`` of ``layer`` (the run stops there)."""
    with lm.trace(source, remote=remote) as tracer:
        act = _site(lm, layer, site).save()
        tracer.stop()
    return act.detach().clone()


def _source_activations(lm: Any, source: Tensor, n_layers: int, site: str) -> list[Tensor]:
    """The source run's activation at ``site`` of every layer, from one local trace."""
    import nnsight

    with lm.trace(source):
        acts = nnsight.save([_site(lm, layer, site) for layer in range(n_layers)])
    return [a.detach().clone() for a in acts]


def _patched(lm: Any, base: Tensor, src: Tensor, layer: int, site: str,
             group: list[tuple[int, int | None]], d_head: int, length: int, pm: PromptMetric,
             reads: Tensor | None, remote: bool, base_m: Tensor) -> Tensor:
    """Metric after each variant's patch, ``[len(group), n]``, from one trace of the base
    tokens repeated once per variant. A per-position patch after the last read changes
    nothing (causal model): its value is the base metric, as in the engine."""
    n, g = base.shape[0], len(group)
    todo = [i for i, (_, p) in enumerate(group) if p is None or p < length]
    out = base_m.expand(g, n).clone()
    if not todo:
        return out
    tokens = base.repeat(len(todo), 1)
    with lm.trace(tokens, remote=remote):
        act = _site(lm, layer, site)
        for j, i in enumerate(todo):
            h, p = group[i]
            cols = slice(h * d_head, (h + 1) * d_head)
            rows = slice(j * n, (j + 1) * n)
            if p is None:
                act[rows, :, cols] = src[:, :, cols]
            else:
                act[rows, p, cols] = src[:, p, cols]
        logits = _read_logits(lm, tokens.shape[0], reads, len(todo)).save()
    out[todo] = _metric_of(logits, pm, reads, len(todo), f"nnsight patch, layer {layer}")
    return out
