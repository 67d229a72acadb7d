"""AtP*'s Q/K fix (Kramar et al. 2024, section 3.1.1): softmax effects recomputed exactly, the
per-layer plan (``LayerStep``, ``estimator_plan``) and the optional exact tail (last block and
readout run exactly on each head's write)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.patching import shortcuts
from circuitkit.patching.estimators.common import (
    ATP_STAR_CHUNK,
    _copy_masks,
    _head_writes,
    _MetricStash,
)
from circuitkit.patching.estimators.rerun import _pattern_of

ATP_STAR_SITES = ("z", "q", "k")
# Sequences per last-block + unembedding call of the exact tail (logits are [n, pos, vocab]).
EXACT_TAIL_CHUNK = 512


def _atp_star_qk_own(model, layer, site, a_src, r_base, kwargs, g_pat, positions, batch) -> Tensor:
    """AtP* for site q/k: exact own-layer pattern change, dotted with dm/dpattern.

    Returns [b, h] or [b, h, pos] (h = heads at ``site``).
    """
    seq = a_src.shape[1]
    n_h = a_src.shape[2]
    masks = _copy_masks(n_h, seq, positions, a_src.device, a_src.dtype)  # [c, p, h]
    with torch.no_grad():
        pat0 = _pattern_of(model, layer, r_base, kwargs, batch)
        out = []
        for start in range(0, masks.shape[0], max(1, ATP_STAR_CHUNK // batch)):
            m = masks[start:start + max(1, ATP_STAR_CHUNK // batch)]
            c = m.shape[0]
            mask = einops.repeat(m, "c p h -> (c b) p h 1", b=batch)
            src = a_src.repeat(c, 1, 1, 1)

            def swap(t: Tensor, hook: Any, mask=mask, src=src) -> Tensor:
                return t + mask * (src - t)

            pat = _pattern_of(model, layer, r_base.repeat(c, 1, 1), kwargs, batch,
                              [(hooks.head_site(site, layer), swap)])
            dp = einops.rearrange(pat, "(c b) h q k -> c b h q k", c=c) - pat0
            out.append(einops.einsum(dp, g_pat, "c b h q k, b h q k -> b c"))
    eff = torch.cat(out, dim=1)  # [b, copies]
    return eff if positions == "all" else einops.rearrange(eff, "b (h p) -> b h p", p=seq)


def _atp_star_z_downstream(model, layer, dz, r_base, kwargs, g_pat, positions, batch,
                           layers: Sequence[int], a_raw: dict[int, Tensor]) -> Tensor:
    """AtP* Q/K correction of head outputs (site z) of ``layer``, summed over ``layers`` (all
    after ``layer``).

    For each such layer l': (exact pattern change - its linearisation) . dm/dP_l'.
    ``dz``: [b, p, h, d_head]; returns [b, h] or [b, h, pos].
    """
    d_r = _head_writes(model, layer, dz, a_raw)
    seq, n_h = d_r.shape[1], d_r.shape[2]
    masks = _copy_masks(n_h, seq, positions, d_r.device, d_r.dtype)  # [c, p, h]
    total = torch.zeros(batch, masks.shape[0], device=d_r.device)
    step = max(1, ATP_STAR_CHUNK // batch)
    for lp in layers:
        r, kw, g = r_base[lp], kwargs[lp], g_pat[lp]
        # Linear part: dr . v with v = d/dr (P(r) . g), one VJP through layer l''s attention.
        with torch.enable_grad():
            r_req = r.detach().clone().requires_grad_(True)
            pat0 = _pattern_of(model, lp, r_req, kw, batch)
            (v,) = torch.autograd.grad((pat0 * g).sum(), r_req)
        pat0 = pat0.detach()
        with torch.no_grad():
            for start in range(0, masks.shape[0], step):
                m = masks[start:start + step]
                c = m.shape[0]
                # copy c's residual write: the head's write at the masked positions
                dr_c = einops.einsum(m, d_r, "c p h, b p h m -> c b p m")
                linear = einops.einsum(dr_c, v, "c b p m, b p m -> b c")
                x = einops.rearrange(r[None] + dr_c, "c b p m -> (c b) p m")
                pat = _pattern_of(model, lp, x, kw, batch)
                dp = einops.rearrange(pat, "(c b) h q k -> c b h q k", c=c) - pat0
                exact = einops.einsum(dp, g, "c b h q k, b h q k -> b c")
                total[:, start:start + c] += exact - linear
    return total if positions == "all" else einops.rearrange(total, "b (h p) -> b h p", p=seq)


def _tail_metric(model: Any, x: Tensor, block_arity: int, stash: _MetricStash, batch: int,
                 fwd_hooks: Sequence[tuple[str, Callable]] = ()) -> Float[Tensor, "b c"]:
    """Metric of the model's own forward re-entered at the last block with input ``x``
    ([c*b, pos, d]): the last block, the final norm, the unembedding and whatever the model does
    to the logits after it (a soft-cap, Cohere's logit scale), as the exact engine runs it.

    Returns [b, c]: per-prompt values of each copy.
    """
    last = len(model.blocks) - 1
    n_c = x.shape[0] // batch
    at = None if stash.at is None else stash.at.repeat(n_c, 1)
    forwards = shortcuts.skipped_blocks(model, last, block_arity)
    tail_hooks = list(fwd_hooks)
    if at is not None:  # the last MLP and the unembedding at the read positions only
        forwards += shortcuts.last_mlp_at_rows(model, at)
        tail_hooks.append((hooks.UNEMBED_IN, shortcuts.gather_rows(at)))
    with shortcuts.overridden(forwards), shortcuts.hooked(model, tail_hooks):
        logits = model(x, start_at_layer=last)
    vals = stash.metric.select(torch.arange(batch).repeat(n_c)).per_prompt(logits, at=at)
    return einops.rearrange(vals, "(c b) -> b c", c=n_c)


def _exact_tail(model, layer, dz, r_last, block_arity, g_r_last, stash, positions, batch,
                a_raw: dict[int, Tensor]) -> Tensor:
    """Exact last block + readout for each head's patch (site z); see the module docstring.

    ``layer`` < last: ``m(tail(r_last + dr)) - m_base - dr . dm/dr_last`` (a correction added
    to the estimate). ``layer`` == last: ``m(tail(r_last, z_head + dz_head)) - m_base`` (the
    whole estimate: the head is patched exactly). Returns [b, h] or [b, h, pos].
    """
    last = len(model.blocks) - 1
    seq, n_h = dz.shape[1], dz.shape[2]
    masks = _copy_masks(n_h, seq, positions, dz.device, dz.dtype)  # [c, p, h]
    m_base = stash.value.to(dz.device)[:, None]
    step = max(1, EXACT_TAIL_CHUNK // batch)
    out = []
    with torch.no_grad():
        d_r = _head_writes(model, layer, dz, a_raw) if layer < last else None
        for start in range(0, masks.shape[0], step):
            m = masks[start:start + step]
            c = m.shape[0]
            if d_r is not None:
                dr_c = einops.einsum(m, d_r, "c p h, b p h m -> c b p m")
                x = einops.rearrange(r_last[None] + dr_c, "c b p m -> (c b) p m")
                linear = einops.einsum(dr_c, g_r_last, "c b p m, b p m -> b c")
                out.append(_tail_metric(model, x, block_arity, stash, batch) - m_base - linear)
            else:
                add = einops.rearrange(m[:, None, :, :, None] * dz[None],
                                       "c b p h d -> (c b) p h d")

                def patch(t: Tensor, hook: Any, add=add) -> Tensor:
                    return t + add

                out.append(_tail_metric(model, r_last.repeat(c, 1, 1), block_arity, stash,
                                        batch, [(hooks.z(last), patch)]) - m_base)
    eff = torch.cat(out, dim=1)  # [b, copies]
    return eff if positions == "all" else einops.rearrange(eff, "b (h p) -> b h p", p=seq)


@dataclass(frozen=True)
class LayerStep:
    """How the estimator treats the heads of one layer.

    ``own``: "linear" (``delta . grad``), "qk_exact" (site q/k: the layer's own pattern recomputed
    exactly, then linear) or "exact_tail" (last layer, site z: the head patched exactly in the
    last block). ``downstream_qk``: later layers whose patterns are recomputed exactly with this
    head's residual write (AtP*'s Q/K fix). ``tail_correction``: the last block and readout run
    exactly on this head's write (site z, layers before the last).
    """

    layer: int
    own: str = "linear"
    downstream_qk: tuple[int, ...] = ()
    tail_correction: bool = False


def estimator_plan(n_layers: int, site: str, atp_star: bool, exact_tail: bool
                   ) -> list[LayerStep]:
    """The per-layer plan of ``estimate_heads`` (see ``LayerStep``)."""
    last = n_layers - 1
    if not atp_star and not exact_tail:
        return [LayerStep(layer) for layer in range(n_layers)]
    if site in ("q", "k"):
        return [LayerStep(layer, own="qk_exact") for layer in range(n_layers)]
    # site z: downstream patterns of every later layer, except the last when the exact tail
    # runs it (the tail subsumes that layer's Q/K fix)
    qk_layers = range(1, last if exact_tail else n_layers) if atp_star else range(0)
    return [LayerStep(layer, own="exact_tail" if exact_tail and layer == last else "linear",
                      downstream_qk=tuple(lp for lp in qk_layers if lp > layer),
                      tail_correction=exact_tail and layer < last)
            for layer in range(n_layers)]
