"""Each head's write through its own block's MLP, for all heads at once (the ``block`` estimator).

For head ``h`` of layer ``l`` with patch ``dz_h`` and write ``dr_h = dz_h @ W_O[h]``, the block
estimator needs, at every position::

    e_h = g . [MLP(r + dr_h) - MLP(r)],     MLP(x) = W_out^T act(norm(x) W_in)  (gated: act(norm(x)
                                             W_gate) * norm(x) W_in),  g = dm/d resid_post(l)

Calling the MLP once per head costs ``H`` MLP evaluations per position. Here the norm is taken
apart instead (``norm(y) = gamma * (y - mu(y)) / sigma(y) + beta``; RMSNorm: ``mu = 0``,
``beta = 0``, ``sigma`` the root mean square), so each input projection of a head's input is::

    norm(r + dr_h) W = [(gamma * r) W + dz_h V_h - mu_h (gamma W)] / sigma_h + beta W + b,
    V_h = W_O[h] diag(gamma) W                                       [d_head, d_mlp]

with ``mu_h`` and ``sigma_h`` from ``r + dr_h`` (cheap: ``d_model`` per head), and the output
projection is folded into the gradient, ``g . W_out^T u = (W_out g) . u``. Per position this
costs one input projection per projection matrix for all heads together (``sum_h d_head =
d_model``) and one output projection, instead of ``H`` whole MLPs; the virtual weights ``V`` cost
``d_model`` positions' worth once per layer and call, so this pays from about ``2 d_model / H``
positions on (in FLOPs). The products run in the weights' dtype, everything after them in
float32 at least (in bf16 ``MLP(r + dr_h) - MLP(r)`` loses most of its digits); its GPU cost
(``torch.compile``) and the check against the module (``estimators.block._head_mlp_z``, which
keeps the per-head call where they disagree): docs/attribution.md.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks

# (positions x heads) rows per chunk: bounds the [heads, rows, d_mlp] pre-activations. On a CPU
# near cache size (1024: 1.7x faster than 8192 on SmolLM2, 16 x 64 tokens, one thread); on a GPU
# large, so that kernels are few (2^15 rows of a 14336-wide MLP: 1.9 GB a float32 tensor, a few
# alive at once; the H200 measurement in docs/attribution.md ran with it).
ROW_CHUNK = 1024
ROW_CHUNK_GPU = 1 << 15


@dataclass
class HeadMLP:
    """Block ``layer``'s norm and MLP with the virtual weights of its heads' writes."""

    centered: bool  # LayerNorm subtracts the mean; RMSNorm does not
    eps: float
    # Products run in the weights' dtype (bf16 keeps its tensor cores), everything after them in
    # ``dtype``, float32 at least: in bf16, MLP(r + dr_h) - MLP(r) would lose most of its digits.
    dtype: torch.dtype
    gamma: Tensor  # [m], weights' dtype
    W_O: Tensor  # [h, d_head, m], dtype
    V: list[Tensor]  # per input projection W: W_O[h] diag(gamma) W, [h, d_head, f]
    W: list[Tensor]  # the input projections, [m, f]: up (W_in), then gate (gated MLPs)
    gW: list[Tensor]  # gamma W, [f], dtype
    bW: list[Tensor | None]  # beta W + b, [f], dtype
    W_out: Tensor  # [f, m]
    act: Any

    def readout(self, dz: Float[Tensor, "b p h d"], r: Float[Tensor, "b p m"],
                g: Float[Tensor, "b p m"], dr: Float[Tensor, "b p h m"] | None = None
                ) -> Float[Tensor, "b p h"]:
        """``g . [MLP(r + dr_h) - MLP(r)]`` for every head ``h`` and position, in ``dtype``;
        ``dr`` (the writes ``dz_h W_O[h]``) is recomputed unless given in ``dtype``, so that the
        norm sees the same write as ``dz_h V_h``."""
        mm, up = self.W_out.dtype, self.dtype
        if dr is None or dr.dtype != up:
            dr = einops.einsum(dz.to(up), self.W_O, "b p h d, h d m -> b p h m")
        b_, p_, h_, _ = dr.shape
        out = torch.empty(b_ * p_, h_, dtype=up, device=dr.device)
        # [b, p, f]: the output projection folded into the gradient
        v = (g.to(mm) @ self.W_out.T).to(up)
        flat = [t.reshape(b_ * p_, *t.shape[2:]) for t in (dz.to(mm), dr, r, v)]
        step = max(1, (ROW_CHUNK if dr.device.type == "cpu" else ROW_CHUNK_GPU) // h_)
        chunk = _chunk_function(dr.device, self.act)
        for s in range(0, b_ * p_, step):
            dz_c, dr_c, r_c, v_c = (t[s:s + step] for t in flat)
            shared = [((self.gamma * r_c.to(mm)) @ W).to(up) for W in self.W]  # [n, f] each
            dzV = [torch.bmm(dz_c.transpose(0, 1), Vm) for Vm in self.V]  # [h, n, f], mm dtype
            r_c = r_c.to(up)
            y = (r_c[:, None] + dr_c).transpose(0, 1)  # [h, n, m]: each head's MLP input
            out[s:s + step] = chunk(dzV, shared, y, r_c[None], v_c, self.gW, self.bW,
                                    self.centered, self.eps, self.act)
        return out.view(b_, p_, h_)


def _chunk_readout(dzV: list[Tensor], shared: list[Tensor], y: Tensor, y0: Tensor, v: Tensor,
                   gW: list[Tensor], bW: list[Tensor | None], centered: bool, eps: float,
                   act: Any) -> Float[Tensor, "n h"]:
    """``v . [hidden(y_h) - hidden(y0)]`` for one chunk: each head's input projections are
    ``shared + dzV_h``, the base's ``shared``; the norm is applied after the projections."""
    post = _hidden([x.to(sh.dtype) + sh for x, sh in zip(dzV, shared, strict=True)], y, gW, bW,
                   centered, eps, act)  # [h, n, f]
    post0 = _hidden([sh[None] for sh in shared], y0, gW, bW, centered, eps, act)  # [1, n, f]
    return torch.einsum("hnf,nf->nh", post.sub_(post0), v)


def _hidden(lin: list[Tensor], y: Tensor, gW: list[Tensor], bW: list[Tensor | None],
            centered: bool, eps: float, act: Any) -> Tensor:
    """The MLP's hidden activation for inputs ``y`` ([h, n, m]) whose un-normalised projections
    ``(gamma y) W`` are ``lin`` ([h, n, f] each, not modified)."""
    mu = y.mean(-1, keepdim=True) if centered else None
    var = y.var(-1, unbiased=False, keepdim=True) if centered else y.pow(2).mean(-1, True)
    inv = torch.rsqrt(var + eps)  # [h, n, 1]
    pre = []
    for x, g, b in zip(lin, gW, bW, strict=True):
        x = (x - mu * g).mul_(inv) if mu is not None else x * inv
        pre.append(x.add_(b) if b is not None else x)
    return act(pre[1]).mul_(pre[0]) if len(pre) == 2 else act(pre[0])


# torch.compile fuses _chunk_readout's elementwise passes into a few kernels: on a GPU they are
# memory-bound and otherwise take about as long as the per-head MLP calls the formula replaces.
# Only where Triton runs (CUDA), and only for activations of a known kind (dynamo would recompile
# for every layer's own activation module otherwise); a compile failure falls back to eager, once.
_COMPILED: dict[str, Any] = {}
_FUSABLE_ACTS = {"SiLU", "SiLUActivation", "GELU", "GELUActivation", "NewGELUActivation",
                 "GELUTanh", "PytorchGELUTanh", "FastGELUActivation", "QuickGELUActivation",
                 "ReLU"}


def _chunk_function(device: torch.device, act: Any):
    """``_chunk_readout``, compiled where that helps (above)."""
    if device.type != "cuda" or type(act).__name__ not in _FUSABLE_ACTS \
            or _COMPILED.get("failed"):
        return _chunk_readout
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(_chunk_readout, dynamic=True)

    def run(*args: Any) -> Tensor:
        try:
            return _COMPILED["fn"](*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 (any compiler failure: eager is always right)
            _COMPILED["failed"] = True
            warnings.warn(f"block estimator: torch.compile of the all-heads MLP readout failed "
                          f"({type(e).__name__}: {str(e)[:200]}); running it eagerly.",
                          RuntimeWarning, stacklevel=2)
            return _chunk_readout(*args)

    return run


def covers(model: Any) -> bool:
    """Whether the model's blocks expose what ``head_mlp`` needs (checked on block 0, weights not
    touched)."""
    return _parts(model, 0) is not None


def head_mlp(model: Any, layer: int) -> HeadMLP | None:
    """Block ``layer``'s ``HeadMLP``, or None when the block does not expose what the formula
    needs (then the caller runs the MLP per head)."""
    parts = _parts(model, layer)
    if parts is None:
        return None
    norm, act, mats, W_out, gamma, beta, W_O = parts
    mm = W_out.dtype
    dtype = torch.promote_types(mm, torch.float32)
    gamma, W_O, W_out = gamma.detach().to(mm), W_O.detach().to(mm), W_out.detach()
    beta = beta.detach().to(dtype) if isinstance(beta, Tensor) else None
    Ws = [W.detach().to(mm) for W, _ in mats]
    bWs = []
    for W, (_, b) in zip(Ws, mats, strict=True):
        terms = [t for t in (beta @ W.to(dtype) if beta is not None else None,
                             b.detach().to(dtype) if isinstance(b, Tensor) else None)
                 if t is not None]
        bWs.append(sum(terms[1:], terms[0]) if terms else None)
    return HeadMLP(centered=norm == "LN", eps=float(getattr(model.cfg, "eps", 1e-5)), dtype=dtype,
                   gamma=gamma, W_O=W_O.to(dtype),
                   V=[einops.einsum(W_O, gamma, W, "h d m, m, m f -> h d f") for W in Ws], W=Ws,
                   gW=[(gamma @ W).to(dtype) for W in Ws], bW=bWs, W_out=W_out, act=act)


def _parts(model: Any, layer: int) -> tuple | None:
    norm = str(getattr(model.cfg, "normalization_type", "") or "")
    # a parallel block's MLP reads the block input, not the head's write: nothing to compute
    if norm not in ("RMS", "LN") or hooks.parallel(model) or not hooks.has_mlp(model, layer):
        return None
    block = model.blocks[layer]
    # a post-attention/MLP norm (Gemma 2) makes neither the write nor the MLP output linear in W_O
    if hooks.post_norm(model, layer, "attn") is not None \
            or hooks.post_norm(model, layer, "mlp") is not None:
        return None
    gated = bool(getattr(model.cfg, "gated_mlp", False))
    try:
        mlp, ln = block.mlp, block.ln2
        hf = getattr(mlp, "original_component", mlp)
        act = getattr(hf, "act_fn", None) or getattr(hf, "act", None)
        mats = [(mlp.W_in, getattr(mlp, "b_in", None))]
        if gated:
            mats.append((mlp.W_gate, getattr(mlp, "b_gate", None)))
        W_out, gamma, W_O = mlp.W_out, ln.w, block.attn.W_O
        beta = getattr(ln, "b", None) if norm == "LN" else None
    except (AttributeError, NotImplementedError):
        return None
    tensors = [W for W, _ in mats] + [W_out, gamma, W_O]
    if not callable(act) or not all(isinstance(t, Tensor) for t in tensors) \
            or any(W.ndim != 2 for W, _ in mats) or W_out.ndim != 2 or W_O.ndim != 3:
        return None
    return norm, act, mats, W_out, gamma, beta, W_O
