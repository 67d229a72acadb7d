"""Integrated gradients along the clean-corrupt embedding path (``ig``, as EAP-IG, Hanna et al.
2024): the site gradient averaged over midpoints of the interpolated token embeddings."""

from __future__ import annotations

import torch

from circuitkit import hooks
from circuitkit.patching.estimators.common import (
    BatchOut,
    _grad_run,
    _grads,
    _head_effect,
    _lean,
    _MetricStash,
    _plain_run,
    _raw_attn_names,
    _site_scale,
    _z_scale,
)


def _batch_ig(model, base, src, stash_base, stash_src, site, positions, at, ig_steps):
    """Integrated gradients along the embedding path from the base to the source tokens."""
    f = hooks.facts(model)
    L = f.n_layers
    site_names = [hooks.head_site(site, layer) for layer in range(L)]
    mids = [hooks.resid_mid_of(model, layer) for layer in range(L)] if site == "z" else []
    raws = _raw_attn_names(model) if site == "z" else []
    with _lean(model, at):
        b_acts = _plain_run(model, base, stash_base, [hooks.EMBED, *site_names, *mids, *raws])
        s_acts = _plain_run(model, src, stash_src, [hooks.EMBED, *site_names])
        e_b, e_s = b_acts[hooks.EMBED], s_acts[hooks.EMBED]
        mean_grad = [torch.zeros_like(b_acts[n]) for n in site_names]
        for k in range(ig_steps):
            alpha = (k + 0.5) / ig_steps
            obj, kept = _grad_run(model, base, _MetricStash(stash_base.metric, torch.arange(
                base.shape[0]), stash_base.at), site_names, embed=e_b + alpha * (e_s - e_b))
            for acc, g in zip(mean_grad, _grads(obj, kept, site_names, retain=False), strict=True):
                acc += g / ig_steps
    a_raw = {hooks.layer_of(n): b_acts[n] for n in raws}
    eff, scale = [], []
    for layer, name in enumerate(site_names):
        delta = s_acts[name] - b_acts[name]
        eff.append(_head_effect(delta, mean_grad[layer], site, positions))
        scale.append(_z_scale(model, layer, delta, b_acts[mids[layer]], positions, a_raw)
                     if site == "z" else _site_scale(delta, b_acts[name], site, positions))
    return torch.stack(eff, dim=1), torch.stack(scale, dim=1)


def batch(job, b):
    """Registry entry "ig"."""
    return BatchOut(*_batch_ig(*b.head_args(job), job.ig_steps))
