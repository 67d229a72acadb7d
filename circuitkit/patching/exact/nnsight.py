"""Exact head sweeps through nnsight's tracing: locally, or on NDIF (``remote=True``).

The same sweep as the TransformerLens engine (``ck.patch(..., options=dict(backend="nnsight"))``),
for models that only nnsight reaches: NDIF serves large hub models (Llama-3.1-70B ...) to
researchers without GPUs of their own; nnsight ships the trace there and brings back what it
saves. It takes ``ck.patch``'s road: the entry's checks (``api._check``: tokens, the metric
wrapped, its reads checked on the real logits, except on NDIF, where that would download them
whole), then ``exact.sweeps.run_sweep`` (prompts by length, chunks, checkpoint, progress bar,
ranks) with ``NnsightEngine``, whose chunks run as traces. The model is seen through
``NnsightModel`` (its shape facts under TransformerLens's names, its weights' fingerprint).

For each layer ``l``: the *source* tokens' activation at the site of ``l`` (locally: every layer's
from one trace; remotely: one trace per layer that stops there, so each download is one layer's
size); then each chunk is one trace of its *base* prompts, repeated once per variant (``g``
variants of ``n`` prompts, ``[g * n, seq]``), writing each variant's head slice from the source
in place:

* ``z``: the input of ``self_attn.o_proj`` (heads concatenated, ``[batch, pos, n_heads *
  d_head]``), columns ``h * d_head:(h + 1) * d_head``;
* ``q`` / ``k`` / ``v``: the output of ``q_proj`` / ``k_proj`` / ``v_proj`` (before rotary for q
  and k: patching a position with the source's value at the same position gives the source's
  rotated value, so it equals TransformerLens's ``hook_q`` / ``hook_k`` patch); k and v have the
  KV-head count under GQA.

Each trace saves the logits at the positions the metric reads only (``PromptMetric.reads``), so
a remote run downloads ``[g * n, k, vocab]``, not every position's logits. Runs stop after the
chunk's last read position (causal model), as the engine's. Direction, positions and metric mean
what they mean for ``patch_heads``; pattern patching and attribution need the TransformerLens
backend (``HeadUnits.check_method`` says so). Models: Llama-style decoders
(``model.layers[l].self_attn.{q,k,v,o}_proj``: Llama, Mistral, Qwen2, SmolLM2, ...). nnsight
facts this relies on: ``circuitkit``'s FIELD notes (traces live in this source file;
``torch.no_grad()``; eager attention, as TransformerLens's bridge).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit.hooks import ModelFacts
from circuitkit.metrics import PromptMetric
from circuitkit.patching.exact.checks import evaluate_metric
from circuitkit.patching.exact.engine import ExactEngine
from circuitkit.patching.results import PatchResult
from circuitkit.patching.sweep import Chunk, Sweep

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


# --- the sweep ---------------------------------------------------------------------------


class NnsightModel:
    """An nnsight model as ``ck.patch``'s checks and ``exact.sweeps.run_sweep`` see a model:
    ``cfg`` (its shape facts under TransformerLens's names: ``hooks.facts``,
    ``inputs.check_tokens``; ``model_name``: its hub id or folder), ``tokenizer`` (the pad
    id), ``named_parameters`` (``checkpoint.model_fingerprint``) and ``logits_of`` (the entry's
    read checks). On NDIF (``remote``) the weights stay there (here they are on the meta
    device): the hub id and its revision stand for them in the fingerprint, and ``logits_of``
    is False (checking reads on the real logits would download them whole)."""

    def __init__(self, lm: Any, remote: bool = False):
        self.lm, self.remote = lm, remote
        f = facts(lm)
        self.cfg = SimpleNamespace(
            n_layers=f.n_layers, n_heads=f.n_heads, n_key_value_heads=f.n_kv_heads,
            d_head=f.d_head, d_model=f.d_model, d_vocab=f.d_vocab, n_ctx=f.n_ctx,
            d_vocab_out=f.d_vocab_out, model_name=str(getattr(lm.config, "_name_or_path", "")))
        self.tokenizer = getattr(lm, "tokenizer", None)

    @classmethod
    def of(cls, model: Any, remote: bool = False) -> NnsightModel:
        """``model`` (an ``NnsightModel``, or anything ``load`` takes) seen through nnsight."""
        return model if isinstance(model, cls) else cls(load(model, remote=remote), remote)

    def named_parameters(self) -> Any:
        if not self.remote:
            return self.lm._module.named_parameters()
        name = f"ndif:{self.cfg.model_name}@{getattr(self.lm.config, '_commit_hash', None)}"
        return iter([(name, torch.tensor(list(name.encode()), dtype=torch.uint8))])

    def parameters(self) -> Any:
        return (p for _, p in self.named_parameters())

    @property
    def logits_of(self) -> Any:
        """``tokens -> logits`` of an unpatched local run (``inputs.checked_metric``), or
        False on NDIF."""
        return False if self.remote else (lambda tokens: _logits(self.lm, tokens))


def exact(model: NnsightModel, clean: Tensor, corrupt: Tensor, pm: PromptMetric, units: Any,
          opts: Any, meta: dict, method: str) -> PatchResult:
    """The exact sweep of head ``units`` (checked by ``ck.patch``'s entry) through nnsight:
    ``exact.sweeps.run_sweep`` with ``NnsightEngine`` (checkpoint identity: the sweep's, the
    model's fingerprint and ``backend="nnsight"``). ``opts.batch_size``: sequences per trace
    (default: 64, at least all prompts: a chunk runs all prompts of a variant where they fit).
    ``method`` "auto" runs exact (the attribution screen needs the TransformerLens backend),
    said in ``meta["auto"]``."""
    from circuitkit.patching.exact import sweeps

    sweep = units.sweep(model, opts.direction, clean, pm)
    rows = opts.batch_size or max(clean.shape[0], 64)
    swept = sweeps.run_sweep(model, clean, corrupt, pm, sweep, replace(opts, batch_size=rows),
                             make_engine=NnsightEngine,
                             identity_extra=dict(backend="nnsight"))
    res = sweeps.patch_result(model, swept, sweep, pm, meta)
    res.meta.update(backend="nnsight", remote=model.remote,
                    traces_per_layer=-(-swept.info["n_chunks"] // sweep.n_layers))
    if method == "auto":
        res.meta["auto"] = dict(chose="exact", note="backend='nnsight' runs exact sweeps only")
    return res


class NnsightEngine(ExactEngine):
    """An exact head sweep's chunks as nnsight traces (module docstring), for
    ``exact.sweeps.run_sweep``: the unpatched base and source runs' metric (one trace) and the
    source activations (locally every layer's from one trace; remotely one layer's at a time,
    fetched when its first chunk runs), then one trace per chunk. ``model``: an
    ``NnsightModel``. Of ``ExactEngine`` it keeps what reads no model: ``clean_metric``,
    ``corrupt_metric``, ``_run_length`` and ``assemble``; every run is its own."""

    def __init__(self, model: NnsightModel, clean: Tensor, corrupt: Tensor,
                 metric: PromptMetric, sweep: Sweep, rows: int | None = None,
                 fast: bool | None = None):
        self.model, self.metric, self.sweep = model, metric, sweep
        self.lm, self.remote, self.d_head = model.lm, model.remote, int(model.cfg.d_head)
        self.reads, self.causal = metric.read_positions(), True  # (HF causal LMs)
        self.length = self._run_length(0, sweep.n_prompts)
        base, source = (corrupt, clean) if sweep.direction == "denoise" else (clean, corrupt)
        self.base, self.source = base[:, :self.length], source[:, :self.length]
        with torch.no_grad():
            self.base_metric, self.source_metric = self._baselines()
            self._src = {} if self.remote else dict(enumerate(_source_activations(
                self.lm, self.source, sweep.n_layers, sweep.site)))

    def _baselines(self) -> tuple[Tensor, Tensor]:
        """Metric of the unpatched base and source runs (one trace, both stacked)."""
        tokens = torch.cat([self.base, self.source])
        n = self.sweep.n_prompts
        with self.lm.trace(tokens, remote=self.remote):
            out = _read_logits(self.lm, tokens.shape[0], self.reads, 2).save()
        m = _metric_of(out, self.metric, (0, n), self.reads, "unpatched base and source runs")
        return m[0], m[1]

    def _source(self, layer: int) -> Tensor:
        """The source run's activation at the sweep's site of ``layer`` (remotely fetched
        once per layer: a chunk of another layer drops the last one)."""
        if layer not in self._src:
            self._src = {layer: _source_activation(self.lm, self.source, layer,
                                                   self.sweep.site, self.remote)}
        return self._src[layer]

    @torch.no_grad()
    def run_chunk(self, chunk: Chunk) -> Float[Tensor, "n_var n_p"]:
        """Metric after each patch of the chunk, ``[n_variants, n_prompts]``, from one trace of
        its base prompts repeated once per variant. A per-position patch after the chunk's
        last read changes nothing (causal model): its value is the base metric, as in the
        engine."""
        c = Chunk(*chunk)
        n_p, length = c.p1 - c.p0, self._run_length(c.p0, c.p1)
        group = [self.sweep.variant(v) for v in range(c.v0, c.v1)]
        todo = [i for i, (_, p) in enumerate(group) if p is None or p < length]
        out = self.base_metric[c.p0:c.p1].expand(len(group), n_p).clone()
        if not todo:
            return out
        src = self._source(c.layer)[c.p0:c.p1, :length]
        reads = None if self.reads is None else self.reads[c.p0:c.p1]
        tokens = self.base[c.p0:c.p1, :length].repeat(len(todo), 1)
        d = self.d_head
        with self.lm.trace(tokens, remote=self.remote):
            act = _site(self.lm, c.layer, self.sweep.site)
            for j, i in enumerate(todo):
                h, p = group[i]
                cols, rows = slice(h * d, (h + 1) * d), slice(j * n_p, (j + 1) * n_p)
                if p is None:
                    act[rows, :, cols] = src[:, :, cols]
                else:
                    act[rows, p, cols] = src[:, p, cols]
            logits = _read_logits(self.lm, tokens.shape[0], reads, len(todo)).save()
        out[todo] = _metric_of(logits, self.metric, (c.p0, c.p1), reads,
                               f"nnsight patch, layer {c.layer}")
        return out


def _metric_of(logits: Tensor, pm: PromptMetric, prompts: tuple[int, int], reads: Tensor | None,
               what: str) -> Tensor:
    """Per-prompt metric of stacked copies of prompts ``p0:p1`` (``prompts``; ``reads``:
    theirs, ``[p1 - p0, k]``): ``[copies, p1 - p0]``."""
    p0, p1 = prompts
    copies = logits.shape[0] // (p1 - p0)
    tiled = pm.select(list(range(p0, p1)) * copies)
    at = None if reads is None else reads.repeat(copies, 1)
    return evaluate_metric(tiled, logits.float(), what, at=at).view(copies, p1 - p0)


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
