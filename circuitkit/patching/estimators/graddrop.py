"""AtP*'s GradDrop (Kramar et al. 2024, section 3.1.2): plain AtP with each block's residual
contribution dropped from the backward in turn; the score is their mean magnitude."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from circuitkit import hooks
from circuitkit.patching.estimators.atp import _batch_atp_qk
from circuitkit.patching.estimators.common import (
    BatchOut,
    _grad_run,
    _grads,
    _head_effect,
    _lean,
    _plain_run,
    _raw_attn_names,
    _site_scale,
    _z_scale,
)


def _gates(model: Any, n_layers: int) -> tuple[Tensor, list[tuple[str, Callable]]]:
    """GradDrop: a 0/1 mask per block and forward hooks that scale the gradient flowing back
    through that block's attention and MLP outputs (an attention-only block: its attention
    output) by it (the forward is unchanged)."""
    mask = torch.ones(n_layers)

    def gate(layer: int) -> Callable:
        def f(t: Tensor, hook: Any) -> Tensor:
            if t.requires_grad:
                t.register_hook(lambda g: g * mask[layer])
            return t
        return f

    fwd = [(name(layer), gate(layer)) for layer in range(n_layers)
           for name in (hooks.attn_out, hooks.mlp_out)
           if name is hooks.attn_out or hooks.has_mlp(model, layer)]
    return mask, fwd


def _batch_graddrop(model, base, src, stash_base, stash_src, site, positions, at):
    """Per-prompt GradDrop terms ``[b, L + 1, L, H(, P)]``: index ``l' < L`` is plain AtP with
    block ``l'``'s residual contribution dropped from the backward; index ``L`` drops nothing."""
    f = hooks.facts(model)
    L = f.n_layers
    site_names = [hooks.head_site(site, layer) for layer in range(L)]
    mids = [hooks.resid_mid_of(model, layer) for layer in range(L)] if site == "z" else []
    raws = _raw_attn_names(model) if site == "z" else []
    mask, gates = _gates(model, L)
    with _lean(model, at):
        obj, kept = _grad_run(model, base, stash_base, [*site_names, *mids, *raws], extra=gates)
        src_acts = _plain_run(model, src, stash_src, site_names)
    deltas = [src_acts[n] - kept[n].detach() for n in site_names]

    def effects(grads: list[Tensor]) -> Tensor:
        return torch.stack([_head_effect(d, g, site, positions)
                            for d, g in zip(deltas, grads, strict=True)], dim=1)

    plain = effects(_grads(obj, kept, site_names, retain=True))
    terms = []
    for drop in range(L):
        mask.fill_(1.0)
        mask[drop] = 0.0
        # dropping block ``drop`` changes only the gradients of heads in layers <= drop
        got = _grads(obj, kept, site_names[:drop + 1], retain=drop < L - 1)
        t = plain.clone()
        t[:, :drop + 1] = effects(got + [torch.zeros_like(kept[n]) for n in
                                         site_names[drop + 1:]])[:, :drop + 1]
        terms.append(t)
    mask.fill_(1.0)
    terms.append(plain)
    a_raw = {hooks.layer_of(n): kept[n].detach() for n in raws}
    scale = torch.stack([_z_scale(model, layer, deltas[layer], kept[mids[layer]].detach(),
                                  positions, a_raw) if site == "z"
                         else _site_scale(deltas[layer], kept[name].detach(), site, positions)
                         for layer, name in enumerate(site_names)], dim=1)
    return torch.stack(terms, dim=1), scale


def _graddrop_combine(terms: Tensor) -> Tensor:
    """Mean-over-prompt GradDrop terms ``[L + 1, L, H(, P)]`` -> signed estimates ``[L, H(, P)]``:
    magnitude ``1/(L-1) sum_{l'} |term_l'|``, sign of the largest term."""
    drops = terms[:-1]  # [L, L, H(, P)]
    L = drops.shape[0]
    mag = drops.abs().sum(0) / max(1, L - 1)
    top = drops.abs().argmax(0, keepdim=True)
    sign = torch.sign(drops.gather(0, top)[0])
    return torch.where(sign == 0, torch.ones_like(sign), sign) * mag


def batch(job, b):
    """Registry entry "graddrop": terms ``[b, L(dropped) + 1, L, H(, P)]``, combined over the
    prompt mean by ``_graddrop_combine``; nothing dropped (the last index) is plain AtP."""
    terms, scale = _batch_graddrop(*b.head_args(job))
    return BatchOut(terms[:, -1], scale, terms)


def batch_atp_star(job, b):
    """Registry entry "atp*": the Q/K correction (qk - plain) added to every GradDrop term."""
    terms, scale = _batch_graddrop(*b.head_args(job))
    qk_eff, _ = _batch_atp_qk(*b.head_args(job), job.steps, job.tail)
    terms = terms + (qk_eff - terms[:, -1])[:, None]
    return BatchOut(terms[:, -1], scale, terms)
