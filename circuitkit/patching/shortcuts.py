"""Work a patched run can skip: each piece is a replacement ``forward`` (or a hook) for one run.

* ``skipped_blocks``: blocks below the restart layer as identities (the bridge's
  ``start_at_layer`` still runs them);
* ``returning``: a module whose output is known (cached, or cached plus a linear patch) returns
  it without computing;
* read positions: a metric that reads logits at positions ``idx[b]`` of row ``b`` needs, of the
  last block, only those query positions: its attention reads keys/values everywhere but writes
  only there, and its MLP, the final norm and the unembedding are position-wise
  (``gather_rows``, ``mlp_at_rows``, ``attention_at_rows``). Outputs elsewhere are zeros: nothing
  downstream reads them;
* ``attn_result_off``: no per-head ``hook_result`` einsum when no hook reads it.

``overridden`` installs replacement forwards for the duration of a run. ``idx``:
``Int[Tensor, "rows k"]``, sequence positions per row (duplicates allowed).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from circuitkit import hooks


@contextlib.contextmanager
def overridden(forwards: Sequence[tuple[Any, Any]]):
    """Replace ``module.forward`` for each ``(module, forward)`` pair; restored on exit."""
    for module, fn in forwards:
        # An instance attribute shadows the class method. object.__setattr__: the bridge's
        # component __setattr__ would forward the assignment to the wrapped HF module.
        object.__setattr__(module, "forward", fn)
    try:
        yield
    finally:
        for module, _ in forwards:
            module.__dict__.pop("forward", None)


@contextlib.contextmanager
def hooked(model: Any, fwd_hooks: Sequence[tuple[str, Any]]):
    """``model.hooks(fwd_hooks=...)`` for hook *names* (aliases allowed), with each name's
    ``HookPoint`` looked up once per model: the bridge's context rebuilds its alias table on
    every entry (~1 ms, paid per chunk). Hook functions get ``(activation, hook_point)``."""
    points = _POINTS.setdefault(model, {})
    for name, _ in fwd_hooks:
        if name not in points:
            points[name] = model.hook_dict.get(name)
    if any(points[name] is None for name, _ in fwd_hooks):  # a name only the bridge resolves
        with model.hooks(fwd_hooks=list(fwd_hooks)):
            yield
        return
    added = []
    try:
        for name, fn in fwd_hooks:
            hp = points[name]
            added.append((hp, hp.add_hook(fn, dir="fwd")))
        yield
    finally:
        for hp, handle in added:
            handle.hook.remove()
            hp.fwd_hooks[:] = [h for h in hp.fwd_hooks if h is not handle]


# HookPoints by model and hook name (weakly: the entry goes with the model).
_POINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def attn_result(model: Any, on: bool):
    """Per-head ``hook_result`` on or off for the run (``set_use_attn_result``), the caller's
    flag restored after; the one switch of it (``attn_result_off``, scoring's ``hook_result``
    readers)."""
    was = bool(getattr(getattr(model, "cfg", None), "use_attn_result", False))
    if was != on:
        model.set_use_attn_result(on)
    try:
        yield
    finally:
        if was != on:
            model.set_use_attn_result(was)


def attn_result_off(model: Any):
    """Per-head ``hook_result`` off for the run: no sweep site reads it, and the bridge's
    per-head einsum for it costs as much as the output projection again."""
    return attn_result(model, False)


@contextlib.contextmanager
def split_qkv_inputs(model: Any):
    """Each head's q/k/v input as its own copy of the residual for the run (``hooks.q_input``
    ...: TransformerLens's ``use_split_qkv_input``; ``use_attn_in``, exclusive with it, off
    meanwhile); the caller's flags are restored on exit. Every copy goes through the block's
    norm and its head's projection alone, so an edit of one copy reaches one head only."""
    split = bool(getattr(model.cfg, "use_split_qkv_input", False))
    attn_in = bool(getattr(model.cfg, "use_attn_in", False))
    try:
        if attn_in:
            model.set_use_attn_in(False)
        if not split:
            try:
                model.set_use_split_qkv_input(True)
            except NotImplementedError:
                raise ValueError(
                    f"this model's attention ({type(model.blocks[0].attn).__name__}, e.g. a "
                    "native TransformerLens config) has no per-head q/k/v input "
                    "(use_split_qkv_input), which eap and EAP-IG differentiate at; use "
                    "estimator='eap*' (it needs none) or method='exact' for its edges.") from None
        yield
    finally:
        model.set_use_split_qkv_input(split)
        if attn_in:
            model.set_use_attn_in(True)


def skipped_blocks(model: Any, layer: int, block_arity: int) -> list[tuple[Any, Any]]:
    """Blocks ``0..layer-1`` as identities (``block_arity``: see ``output_arity``)."""
    def identity(*args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else kwargs["hidden_states"]
        return (x,) if block_arity else x

    return [(b, identity) for b in list(model.blocks)[:layer]]


class _Stop(Exception):
    """Raised by a hook once a partial run has what it came for (``run_until``)."""


def run_until(model: Any, layer: int, x: Tensor, names: Sequence[str], block_arity: int,
              fwd_hooks: Sequence[tuple[str, Any]] = ()) -> dict[str, Tensor]:
    """The activations at hooks ``names`` of a run re-entering ``model`` at block ``layer``
    with residual ``x`` (blocks below it skipped), stopped as soon as all of them fired:
    nothing after the last one runs. ``fwd_hooks`` are attached too (before the grabs: an edit
    there is seen by what is grabbed). ``block_arity``: ``output_arity``'s."""
    got: dict[str, Tensor] = {}

    def grab(name: str):
        def hook(t: Tensor, hook: Any) -> Tensor:
            got[name] = t
            if len(got) == len(names):
                raise _Stop
            return t
        return hook

    try:
        with overridden(skipped_blocks(model, layer, block_arity)), \
                hooked(model, [*fwd_hooks, *((n, grab(n)) for n in names)]), \
                attn_result_off(model):
            model(x, start_at_layer=layer)
    except _Stop:
        pass
    missing = [n for n in names if n not in got]
    if missing:
        raise RuntimeError(f"a run from block {layer} did not fire {missing}.")
    return got


def native_norms(model: Any, layer: int, keep: Sequence[str] = ()) -> list[tuple[Any, Any]]:
    """The norms of blocks ``layer..`` and the final norm as their wrapped HF module's own forward.
    A bridge norm computes the normalisation twice (once for its hook points, once by HF,
    bit-identical); with no hook on it the first pass is wasted: ~10% of a small model's suffix
    forward. Norms with a hook attached, holding a hook point named in ``keep`` (hooks about to be
    attached, e.g. a cache's), or without a wrapped module keep theirs."""
    kept = {id(model.hook_dict.get(name)) for name in keep}
    out = []
    norms = [getattr(b, name, None) for b in list(model.blocks)[layer:] for name in ("ln1", "ln2")]
    for norm in [*norms, getattr(model, "ln_final", None)]:
        hf = getattr(norm, "original_component", None)
        if (hf is None or isinstance(hf, torch.nn.Identity) or _hooked(norm)
                or any(id(m) in kept for m in norm.modules())):
            continue
        out.append((norm, hf.forward))
    return out


def _hooked(module: Any) -> bool:
    """Whether any hook point inside ``module`` has a forward or backward hook."""
    return any(getattr(m, "fwd_hooks", None) or getattr(m, "bwd_hooks", None)
               for m in module.modules())


def _as_output(value: Tensor, n_outputs: int) -> Any:
    """``value`` shaped as a module returns it: bare (``0``) or first of an n-tuple."""
    return value if n_outputs == 0 else (value,) + (None,) * (n_outputs - 1)


def returning(value: Tensor, n_outputs: int):
    """A ``forward`` that ignores its input and returns ``value`` (as the module's tuple)."""
    out = _as_output(value, n_outputs)
    return lambda *args, **kwargs: out


def passthrough(module: Any) -> list[tuple[Any, Any]]:
    """``module`` (a post-attention/MLP norm, ``hooks.post_norm``; None: nothing) as an
    identity: where the attention or MLP returns the cached value of ``hook_attn_out`` /
    ``hook_mlp_out``, which on Gemma 2 is that norm's output, it must not be normalised twice."""
    if module is None:
        return []

    def identity(*args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))

    return [(module, identity)]


def output_arity(model: Any, tokens: Tensor) -> tuple[int, int]:
    """How blocks and attention modules return: ``0`` a bare tensor, ``n`` an n-tuple (the HF
    stack expects tuple block outputs in transformers < 5; attention returns (out, weights)).
    Found by a 2-token forward, once per model."""
    if model not in _ARITY:
        _ARITY[model] = _probe_arity(model, tokens)
    return _ARITY[model]


# Output arity by model (weakly: the entry goes with the model).
_ARITY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _probe_arity(model: Any, tokens: Tensor) -> tuple[int, int]:
    seen: dict[str, int] = {}

    def grab(key: str):
        def hook(module: Any, args: Any, out: Any) -> None:  # returns None: output unchanged
            seen.setdefault(key, len(out) if isinstance(out, tuple) else 0)
        return hook

    hs = [model.blocks[0].register_forward_hook(grab("block")),
          model.blocks[0].attn.register_forward_hook(grab("attn"))]
    try:
        model(tokens[:1, :2])
    finally:
        for h in hs:
            h.remove()
    return seen.get("block", 0), seen.get("attn", 2)


# Attention modules whose forward ``attention_at_rows`` reproduces: plain softmax attention with
# rotary position embeddings and optional GQA (the Llama form). Anything else keeps its forward.
ROTARY_ATTENTION = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention"})
_BRIDGE_FLAGS = ("use_split_qkv_input", "use_attn_in", "gated_q_proj",
                 "rotary_interleaved_cos_sin", "rotary_adjacent_pairs", "qk_norm_after_rope")


def _index(idx: Tensor, width: int) -> Tensor:
    return idx[..., None].expand(-1, -1, width)


@contextlib.contextmanager
def reads_only(model: Any, idx: Int[Tensor, "rows k"]):
    """Runs of ``model`` inside compute the last MLP and the unembedding only at ``idx``
    (logits ``[rows, k, vocab]``: read them with ``PromptMetric.per_prompt(logits, at=idx)``),
    and no per-head results. The MLP keeps every position where its input hook is the block's
    ``hook_resid_mid`` (a block without a pre-MLP norm, OLMo 2): that stays whole."""
    layer = len(model.blocks) - 1
    mlp = last_mlp_at_rows(model, idx)
    if mlp and hooks.owner(model, hooks.resid_mid_of(model, layer)) is mlp[0][0]:
        mlp = []
    with model.hooks(fwd_hooks=[(hooks.UNEMBED_IN, gather_rows(idx))]), overridden(mlp), \
            attn_result_off(model):
        yield


def take_rows(x: Tensor, idx: Int[Tensor, "rows k"]) -> Tensor:
    """Positions ``idx[b]`` of each row: ``[rows, seq, d] -> [rows, k, d]``. (``idx`` follows
    ``x`` to its device: a model split over GPUs unembeds on another GPU than it embeds.)"""
    return x.gather(1, _index(idx.to(x.device), x.shape[-1]))


def put_rows(y: Tensor, idx: Int[Tensor, "rows k"], seq: int) -> Tensor:
    """Inverse of ``take_rows``: ``[rows, k, d] -> [rows, seq, d]``, zeros elsewhere. A
    position repeated in ``idx[b]`` (reads are padded by repetition) takes its first copy
    only, so a gradient through it counts that position once, not once per copy."""
    idx = idx.to(y.device)
    k = idx.shape[1]
    earlier = torch.ones(k, k, dtype=torch.bool, device=y.device).tril(-1)
    repeat = ((idx[:, :, None] == idx[:, None, :]) & earlier).any(-1)  # [rows, k]
    y = torch.where(repeat[..., None], torch.zeros((), dtype=y.dtype, device=y.device), y)
    return y.new_zeros(y.shape[0], seq, y.shape[-1]).scatter_add_(1, _index(idx, y.shape[-1]), y)


def gather_rows(idx: Int[Tensor, "rows k"]):
    """A hook applying ``take_rows``."""
    return lambda x, hook: take_rows(x, idx)


def last_mlp_at_rows(model: Any, idx: Int[Tensor, "rows k"]) -> list[tuple[Any, Any]]:
    """The last block's MLP computed only at ``idx`` (``mlp_at_rows``), as ``overridden``
    takes it; nothing for a block without an MLP (attention-only)."""
    layer = len(model.blocks) - 1
    if not hooks.has_mlp(model, layer):
        return []
    mlp = model.blocks[layer].mlp
    return [(mlp, mlp_at_rows(mlp, idx))]


def mlp_at_rows(module: Any, idx: Int[Tensor, "rows k"]):
    """``forward`` of a position-wise ``module`` (an MLP) computed only at ``idx``."""
    forward = type(module).forward

    def fn(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if any(isinstance(a, Tensor) and a.shape[:2] == x.shape[:2]
               for a in (*args, *kwargs.values())):
            # another per-position input (Bloom's MLP adds the residual it is handed): whole
            return forward(module, x, *args, **kwargs)
        return put_rows(forward(module, take_rows(x, idx), *args, **kwargs), idx, x.shape[1])
    return fn


def supports_attention_at_rows(attn: Any) -> bool:
    """Whether ``attention_at_rows`` reproduces this bridge attention module (see
    ``ROTARY_ATTENTION``; no Q/K norms, gates, softcapping, sinks or sliding windows)."""
    return rotary_softmax(attn) and attention_window(attn) is None


def rotary_softmax(attn: Any) -> bool:
    """Whether a bridge attention module is plain rotary softmax attention (``ROTARY_ATTENTION``;
    no Q/K norms, gates, softcapping, sinks, bridge flags), up to a sliding window."""
    hf = getattr(attn, "original_component", None)
    cfg = getattr(attn, "config", None)
    return (type(attn).__name__ == "PositionEmbeddingsAttentionBridge"
            and type(hf).__name__ in ROTARY_ATTENTION
            and not any(m in attn.submodules for m in ("q_norm", "k_norm", "gate"))
            and all(getattr(hf, a, None) is None for a in (
                "attn_logit_softcapping", "sinks", "key_multiplier"))
            and getattr(getattr(hf, "config", None), "clip_qkv", None) is None
            and not any(bool(getattr(cfg, f, False)) for f in _BRIDGE_FLAGS))


def attention_window(attn: Any) -> int | None:
    """The sliding window of a bridge attention module (None: none). Qwen2 keeps it per layer
    on the module (None on full-attention layers); Mistral reads its config's at run time."""
    hf = getattr(attn, "original_component", None)
    if hasattr(hf, "sliding_window"):
        return hf.sliding_window
    return getattr(getattr(hf, "config", None), "sliding_window", None)


def attention_at_rows(attn: Any, idx: Int[Tensor, "rows k"], n_outputs: int):
    """``forward`` of a rotary softmax attention (``supports_attention_at_rows``) with queries
    only at ``idx``: keys and values at every position, causal mask, output zero elsewhere.

    ``z[b, j] = softmax(q[b, idx[b, j]] . k[b, :s] * scale) v[b, :s]`` for ``s <= idx[b, j]``,
    through ``torch.nn.functional.scaled_dot_product_attention`` (GQA by repeating K/V heads).
    Only the causal mask is applied: use it for unpadded runs, as the engine's are. Falls back
    to the module's own forward when the rotary tables do not cover the head. The engine's
    fast-path probe compares it with the module's own attention before use.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    hf = attn.original_component
    d_head = hf.head_dim
    groups = int(getattr(hf, "num_key_value_groups", 1))
    scale = float(getattr(hf, "scaling", d_head ** -0.5))

    def fn(hidden_states: Tensor, *args: Any, position_embeddings: Any = None,
           **kwargs: Any) -> Any:
        if args or position_embeddings is None or position_embeddings[0].shape[-1] != d_head:
            return type(attn).forward(attn, hidden_states, *args,
                                      position_embeddings=position_embeddings, **kwargs)
        x = hidden_states
        n, seq, _ = x.shape
        k = idx.shape[1]
        cos, sin = (t.expand(n, -1, -1) for t in position_embeddings)  # [n, seq, d_head]
        q = attn.q(take_rows(x, idx)).view(n, k, -1, d_head).transpose(1, 2)  # [n, h, k, d]
        q, _ = apply_rotary_pos_emb(q, q, take_rows(cos, idx), take_rows(sin, idx))
        key = attn.k(x).view(n, seq, -1, d_head).transpose(1, 2)
        key, _ = apply_rotary_pos_emb(key, key, cos, sin)
        value = attn.v(x).view(n, seq, -1, d_head).transpose(1, 2)
        visible = (torch.arange(seq, device=x.device)
                   <= idx.to(x.device)[:, None, :, None])  # [n, 1, k, seq]
        z = torch.nn.functional.scaled_dot_product_attention(
            q, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=visible, scale=scale)
        return _as_output(put_rows(attn.o(z.transpose(1, 2).reshape(n, k, -1)), idx, seq),
                          n_outputs)
    return fn
