"""One layer's attention or MLP re-run alone with the model's own modules, on a modified residual
(what ``block``, ``qk`` and ``atp*`` need), and the probe of whether a bridge allows it."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks

# Rows (positions x copies) per MLP call of the block estimator (bounds [rows, d_mlp] memory).
MLP_ROW_CHUNK = 8192


class _Inputs:
    """Captures the keyword arguments some modules receive in a run (hidden states excluded).

    The bridge calls attention as ``attn(hidden_states=ln1(resid_pre), attention_mask=...,
    position_embeddings=(cos, sin), ...)`` and a block as ``block(resid_pre, attention_mask=...,
    ...)``; keeping the other kwargs lets us re-run one layer alone on a modified residual
    stream with the model's own code (norm, projections, rotary, GQA, mask, softmax, MLP).
    """

    def __init__(self, modules: dict[Any, Any]):
        self.modules = modules
        self.kwargs: dict[Any, dict[str, Any]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> _Inputs:
        for key, mod in self.modules.items():
            def pre(mod, args, kwargs, key=key):
                self.kwargs[key] = {k: v for k, v in kwargs.items()
                                    if k != "hidden_states" and not _is_cache(k, v)}
            self._handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()


def _is_cache(name: str, value: Any) -> bool:
    """A KV cache argument (``past_key_values``, GPT-NeoX/GPT-J's ``layer_past``, ...): a re-run
    of one layer must not read or append to the cache of the run it was captured from."""
    return (name in ("cache", "past_key_value", "past_key_values", "layer_past")
            or type(value).__name__.endswith("Cache"))


def _tile(x: Any, n_copies: int, batch: int) -> Any:
    """Repeat batch-major tensors (inside tuples too) ``n_copies`` times along dim 0."""
    if isinstance(x, Tensor):
        return x.repeat(n_copies, *([1] * (x.ndim - 1))) if x.ndim and x.shape[0] == batch else x
    if isinstance(x, tuple):
        return tuple(_tile(t, n_copies, batch) for t in x)
    return x


def _expand_kwargs(kwargs: dict[str, Any], n_copies: int, batch: int) -> dict[str, Any]:
    kw = {k: _tile(v, n_copies, batch) for k, v in kwargs.items()}
    if "use_cache" in kw:
        kw["use_cache"] = False
    return kw


def _attn_grab(model: Any, layer: int, resid: Float[Tensor, "n pos d_model"],
               kwargs: dict[str, Any], batch: int, name: str,
               fwd_hooks: Sequence[tuple[str, Callable]] = ()) -> Tensor:
    """The activation at hook ``name`` inside layer ``layer``'s attention, run alone on residual
    input ``resid`` (n = copies * batch) with the model's own modules."""
    block = model.blocks[layer]
    kw = _expand_kwargs(kwargs, resid.shape[0] // batch, batch)
    out: dict[str, Tensor] = {}

    def grab(t: Tensor, hook: Any) -> None:
        out["t"] = t

    with model.hooks(fwd_hooks=[*fwd_hooks, (name, grab)]):
        norm = hooks.pre_norm(model, layer, "attn")
        block.attn(hidden_states=resid if norm is None else norm(resid), **kw)
    return out["t"]


def _pattern_of(model: Any, layer: int, resid: Float[Tensor, "n pos d_model"],
                kwargs: dict[str, Any], batch: int,
                fwd_hooks: Sequence[tuple[str, Callable]] = ()) -> Float[Tensor, "n h q k"]:
    """Layer ``layer``'s attention pattern for residual input ``resid`` (n = copies * batch)."""
    return _attn_grab(model, layer, resid, kwargs, batch, hooks.pattern(layer), fwd_hooks)


def _mlp_of(model: Any, layer: int) -> Callable[[Tensor], Tensor]:
    """Block ``layer``'s residual write from its MLP, ``[rows, m] -> [rows, m]``: its norms
    (before: none on OLMo 2; after: Gemma 2, OLMo 2) and MLP, row-chunked."""
    block = model.blocks[layer]
    same = lambda y: y  # noqa: E731
    pre = hooks.pre_norm(model, layer, "mlp") or same
    post = hooks.post_norm(model, layer, "mlp") or same

    def mlp(x: Tensor) -> Tensor:
        return torch.cat([post(block.mlp(pre(x[i:i + MLP_ROW_CHUNK, None])))[:, 0]
                          for i in range(0, x.shape[0], MLP_ROW_CHUNK)])
    return mlp


_RERUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {part: bool}


def layer_reruns(model: Any, tokens: Tensor) -> dict[str, bool]:
    """Whether one layer's attention (``"attn"``) and MLP (``"mlp"``) re-run alone with the
    model's own modules reproduce the full run, as ``block``, ``qk`` and ``atp*`` need: the
    attention of layer 0 on two copies of ``hooks.probe_tokens`` (never ``tokens``: a verdict
    from a 1-token prompt would hold for no longer one; its call arguments tiled) against
    the run's ``hook_z``, its MLP (with its norms) against the block's MLP write. Some bridges
    cannot: OPT's MLP is no module of its own, Bloom's adds a residual it is handed and tiles
    ALiBi per head. Probed once per model."""
    if model in _RERUNS:
        return _RERUNS[model]
    probe = hooks.probe_tokens(model, next(model.parameters()).device)  # (not the prompts)
    names = [hooks.z(0), hooks.resid_pre(0), hooks.resid_mid_of(model, 0), hooks.resid_post(0)]
    capture = _Inputs({0: model.blocks[0].attn})
    ok = {"attn": False, "mlp": False}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with capture:
            _, cache = model.run_with_cache(probe, names_filter=lambda n: n in names)
        try:
            z = _attn_grab(model, 0, cache[hooks.resid_pre(0)].repeat(2, 1, 1),
                           capture.kwargs[0], 1, hooks.z(0))
            ok["attn"] = _agrees(z, cache[hooks.z(0)].repeat(2, 1, 1, 1))
        except Exception:  # noqa: BLE001 - any failure means "cannot re-run it alone"
            pass
        try:
            r_mid = cache[hooks.resid_mid_of(model, 0)]
            if hooks.parallel(model) or not hooks.has_mlp(model, 0):
                ok["mlp"] = True  # nothing runs after the head (the change is zero)
            else:
                want = cache[hooks.resid_post(0)] - r_mid  # the MLP's own write
                got = _mlp_of(model, 0)(r_mid.reshape(-1, r_mid.shape[-1]))
                ok["mlp"] = _agrees(got.view_as(want), want)
        except Exception:  # noqa: BLE001
            pass
    _RERUNS[model] = ok
    return ok


def _agrees(got: Tensor, want: Tensor) -> bool:
    """Equal up to the rounding of ``want``'s dtype (a batch of two may take other kernels:
    bf16 differs in its last bits), relative to the largest value: a layout a re-run cannot
    reproduce is off by O(1) or fails outright."""
    tol = max(1e-3, 16 * torch.finfo(want.dtype).eps)
    err = float((got.float() - want.float()).abs().max())
    return err <= tol * float(want.float().abs().max()) + 1e-6
