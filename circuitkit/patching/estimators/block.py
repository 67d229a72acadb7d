"""The ``block`` estimator: the head's own block completed exactly (its attention for sites
q/k/v/pattern, then its MLP, all heads at once where ``head_mlp`` pays), the rest linear."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import einops
import torch
from einops import einsum
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.patching.estimators.common import (
    ATP_STAR_CHUNK,
    BatchOut,
    _copy_masks,
    _grad_run,
    _grads,
    _head_writes,
    _lean,
    _plain_run,
    _raw_attn_names,
    _relative,
    _residual_write,
    _site_scale,
)
from circuitkit.patching.estimators.costs import head_mlp_pays
from circuitkit.patching.estimators.rerun import _attn_grab, _Inputs, _mlp_of
from circuitkit.patching.exact import head_mlp

# Positions on which the block estimator's all-heads MLP formula is checked against the module.
CHECK_ROWS = 8


def _mlp_change(model: Any, layer: int, r_mid: Float[Tensor, "b pos m"],
                dr: Float[Tensor, "b pos c m"]) -> Float[Tensor, "b pos c m"]:
    """``MLP_l(r_mid + dr) - MLP_l(r_mid)`` for each copy ``c`` (norm included), exactly.

    Position-wise, so every (prompt, position, copy) is one row. Zero for parallel
    attention/MLP blocks, whose MLP reads the block input, not the head's write, and for blocks
    without an MLP (attention-only)."""
    if hooks.parallel(model) or not hooks.has_mlp(model, layer):
        return torch.zeros_like(dr)
    mlp = _mlp_of(model, layer)
    b, p, c, m = dr.shape
    with torch.no_grad():
        base = mlp(r_mid.reshape(-1, m)).view(b, p, 1, m)
        out = mlp((r_mid[:, :, None] + dr).reshape(-1, m)).view(b, p, c, m)
    return out - base


def _block_z(model, layer, dz, r_mid, g_post, positions, a_raw) -> tuple[Tensor, Tensor]:
    """Block estimate and write scale for site z: ``[b, h]`` or ``[b, h, pos]`` each."""
    dr = _head_writes(model, layer, dz, a_raw)  # [b, p, h, m]
    eff = einsum(dr, g_post, "b p h m, b p m -> b p h") + _head_mlp_z(model, layer, dz, dr,
                                                                       r_mid, g_post)
    scale = _relative(dr.norm(dim=-1), r_mid.norm(dim=-1)[:, :, None])  # [b, p, h]
    if positions == "all":
        return eff.sum(1), scale.mean(1)
    return eff.transpose(1, 2), scale.transpose(1, 2)


def _head_mlp_z(model, layer, dz, dr, r_mid, g) -> Float[Tensor, "b p h"]:
    """``g . [MLP_l(r_mid + dr_h) - MLP_l(r_mid)]`` per head. One MLP call per head, or all heads
    at once (``head_mlp``, in float32 at least) when that is cheaper (positions x heads > 2
    d_model: its virtual weights cost d_model positions) and reproduces the module (run in the
    same precision) on the ``CHECK_ROWS`` positions with the largest writes."""
    b, p, h, m = dr.shape
    with torch.no_grad():
        fast = head_mlp.head_mlp(model, layer) if head_mlp_pays(b * p, h, m) else None
        if fast is not None:
            rows = dr.norm(dim=-1).amax(-1).flatten().topk(min(CHECK_ROWS, b * p)).indices
            dz_, r_, g_ = (t.reshape(b * p, *t.shape[2:])[rows][None].to(fast.dtype)
                           for t in (dz, r_mid, g))
            dr_ = einops.einsum(dz_, fast.W_O, "b p h d, h d m -> b p h m")
            block = model.blocks[layer]
            with _parameters_as(fast.dtype, block.ln2, block.mlp):
                slow = einsum(_mlp_change(model, layer, r_, dr_), g_, "b p h m, b p m -> b p h")
            diff = float((fast.readout(dz_, r_, g_, dr_) - slow).abs().max())
            # its products run in the weights' dtype: bf16 rounds them to 2^-8
            rtol = max(1e-3, 4 * torch.finfo(fast.W_out.dtype).eps)
            if diff <= rtol * float(slow.abs().max()) + 1e-7:
                return fast.readout(dz, r_mid, g, dr)
            warnings.warn("block estimator: the all-heads MLP formula "
                          "(patching/exact/head_mlp.py) does "
                          "not reproduce this model's MLP block (its norm or MLP is of another "
                          "kind); running the MLP once per head instead: same estimates, H times "
                          "the MLP cost.", RuntimeWarning, stacklevel=2)
        return einsum(_mlp_change(model, layer, r_mid, dr), g, "b p h m, b p m -> b p h")


@contextlib.contextmanager
def _parameters_as(dtype: torch.dtype, *modules: Any):
    """The modules' floating-point parameters in ``dtype`` inside the block; afterwards each holds
    its original tensor again (same storage, so nothing sharing it is left behind)."""
    params = [(q, q.data) for mod in modules for q in mod.parameters() if q.is_floating_point()]
    try:
        for q, data in params:
            q.data = data.to(dtype)
        yield
    finally:
        for q, data in params:
            q.data = data


def _block_attn(model, layer, site, a_src, r_pre, r_mid, kwargs, g_post, positions,
                batch, a_raw) -> Tensor:
    """Block estimate for sites q/k/v/pattern: each copy's attention recomputed exactly with the
    patched activation, its write through the exact MLP, dotted with ``g_post``."""
    seq = r_pre.shape[1]
    n_h = a_src.shape[hooks.head_axis(site)]
    masks = _copy_masks(n_h, seq, positions, a_src.device, a_src.dtype)  # [c, p, h]
    W_O = model.blocks[layer].attn.W_O.detach()
    eff = []
    step = max(1, ATP_STAR_CHUNK // batch)
    with torch.no_grad():
        z0 = _attn_grab(model, layer, r_pre, kwargs, batch, hooks.z(layer))
        for start in range(0, masks.shape[0], step):
            m = masks[start:start + step]
            c = m.shape[0]
            if site == "pattern":  # [b, h, q, k], copies on (head, query)
                mask = einops.repeat(m, "c q h -> (c b) h q 1", b=batch)
            else:
                mask = einops.repeat(m, "c p h -> (c b) p h 1", b=batch)
            src = a_src.repeat(c, *([1] * (a_src.ndim - 1)))

            def swap(t: Tensor, hook: Any, mask=mask, src=src) -> Tensor:
                return t + mask * (src - t)

            z = _attn_grab(model, layer, r_pre.repeat(c, 1, 1), kwargs, batch, hooks.z(layer),
                           [(hooks.head_site(site, layer), swap)])
            dz = einops.rearrange(z, "(c b) p h d -> c b p h d", c=c) - z0
            dr = _residual_write(model, layer, einsum(dz, W_O, "c b p h d, h d m -> b p c m"),
                                 a_raw)
            total = dr + _mlp_change(model, layer, r_mid, dr)
            eff.append(einsum(total, g_post, "b p c m, b p m -> b c"))
    eff_all = torch.cat(eff, dim=1)  # [b, copies]
    return eff_all if positions == "all" else einops.rearrange(eff_all, "b (h p) -> b h p", p=seq)


def _batch_block(model, base, src, stash_base, stash_src, site, positions, at):
    """The head's own block exactly (its attention for q/k/v/pattern, then its MLP), then the
    base gradient at the block's output."""
    f = hooks.facts(model)
    L = f.n_layers
    site_names = [hooks.head_site(site, layer) for layer in range(L)]
    mids = [hooks.resid_mid_of(model, layer) for layer in range(L)]
    posts = [hooks.resid_post(layer) for layer in range(L)]
    pres = [hooks.resid_pre(layer) for layer in range(L)] if site != "z" else []
    raws = _raw_attn_names(model)
    capture = _Inputs({} if site == "z" else {lay: model.blocks[lay].attn for lay in range(L)})
    with capture, _lean(model, at):
        obj, kept = _grad_run(model, base, stash_base, [*site_names, *mids, *posts, *pres,
                                                        *raws])
        g_post = _grads(obj, kept, posts, retain=False)
        src_acts = _plain_run(model, src, stash_src, site_names)
    a_raw = {hooks.layer_of(n): kept[n].detach() for n in raws}
    eff, scale = [], []
    for layer in range(L):
        a_b, a_s = kept[site_names[layer]].detach(), src_acts[site_names[layer]]
        r_mid = kept[mids[layer]].detach()
        if site == "z":
            e, s = _block_z(model, layer, a_s - a_b, r_mid, g_post[layer], positions, a_raw)
        else:
            e = _block_attn(model, layer, site, a_s, kept[pres[layer]].detach(), r_mid,
                            capture.kwargs[layer], g_post[layer], positions, base.shape[0], a_raw)
            s = _site_scale(a_s - a_b, a_b, site, positions)
        eff.append(e)
        scale.append(s)
    return torch.stack(eff, dim=1), torch.stack(scale, dim=1)


def batch(job, b):
    """Registry entry "block"."""
    return BatchOut(*_batch_block(*b.head_args(job)))
