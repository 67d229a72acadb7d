"""Plain attribution (``atp``; Nanda 2023, Syed et al. 2023) and AtP*'s Q/K fix (``qk``): one
backward on the base run, then each layer's heads as the per-layer plan says (``qk.LayerStep``)."""

from __future__ import annotations

import torch

from circuitkit import hooks
from circuitkit.patching import shortcuts
from circuitkit.patching.estimators.common import (
    BatchOut,
    _head_effect,
    _lean,
    _raw_attn_names,
    _site_scale,
    _z_scale,
    _zero_if_none,
)
from circuitkit.patching.estimators.qk import (
    LayerStep,
    _atp_star_qk_own,
    _atp_star_z_downstream,
    _exact_tail,
)
from circuitkit.patching.estimators.rerun import _Inputs


def _batch_atp_qk(model, base, src, stash_base, stash_src, site, positions, at, steps, tail):
    """Plain attribution ("atp") or the Q/K fix ("qk"), walking ``steps`` (None: plain)."""
    from transformer_lens.tools.analysis.attribution_patching import (
        cache_activation_and_gradient,
    )

    f = hooks.facts(model)
    last, b = f.n_layers - 1, base.shape[0]
    steps = steps or [LayerStep(layer) for layer in range(f.n_layers)]
    site_names = [hooks.head_site(site, layer) for layer in range(f.n_layers)]
    # What the plan needs cached: patterns (and their gradients) of the layers it recomputes,
    # the residual inputs there and at the last block, and those modules' call arguments.
    attn_layers = sorted({lp for st in steps for lp in st.downstream_qk}
                         | {st.layer for st in steps if st.own == "qk_exact"})
    resid_layers = sorted(set(attn_layers) | ({last} if tail else set()))
    extra = [hooks.pattern(lay) for lay in attn_layers] + [hooks.resid_pre(lay)
                                                           for lay in resid_layers]
    mids = [hooks.resid_mid_of(model, lay) for lay in range(f.n_layers)] if site == "z" else []
    raws = _raw_attn_names(model) if site == "z" else []
    capture = _Inputs({lay: model.blocks[lay].attn for lay in attn_layers})
    block_arity = shortcuts.output_arity(model, base)[0] if tail else 0
    with torch.enable_grad(), capture, _lean(model, at):
        # hook_embed is cached too: TL's backward stops at the most upstream cached point,
        # whose own backward hook never fires, and a converted point (hook_z, hook_q ...)
        # cannot be backfilled, so layer 0's site gradient would be lost without it.
        gc = cache_activation_and_gradient(model, base, stash_base,
                                           names_filter=[hooks.EMBED, *site_names, *extra,
                                                         *mids, *raws])
    with torch.no_grad(), _lean(model, at):
        sc = cache_activation_and_gradient(model, src, stash_src, names_filter=site_names,
                                           compute_gradient=False)
    acts, grads = gc.activations, gc.gradients
    a_raw = {hooks.layer_of(n): acts[n] for n in raws}
    r_base = {lp: acts[hooks.resid_pre(lp)] for lp in resid_layers}
    g_pat = {lp: _zero_if_none(grads[hooks.pattern(lp)], acts[hooks.pattern(lp)])
             for lp in attn_layers}
    eff, scale = [], []
    for st in steps:
        name = site_names[st.layer]
        a_b, a_s = acts[name], sc.activations[name]
        delta = a_s - a_b
        if st.own == "exact_tail":
            e = _exact_tail(model, st.layer, delta, r_base[last], block_arity, None,
                            stash_base, positions, b, a_raw)
        elif st.own == "qk_exact":
            e = _atp_star_qk_own(model, st.layer, site, a_s, r_base[st.layer],
                                 capture.kwargs[st.layer], g_pat[st.layer], positions, b)
        else:
            e = _head_effect(delta, _zero_if_none(grads[name], a_b), site, positions)
        if st.downstream_qk:
            e = e + _atp_star_z_downstream(model, st.layer, delta, r_base, capture.kwargs,
                                           g_pat, positions, b, st.downstream_qk, a_raw)
        if st.tail_correction:
            e = e + _exact_tail(model, st.layer, delta, r_base[last], block_arity,
                                grads[hooks.resid_pre(last)], stash_base, positions, b, a_raw)
        eff.append(e.detach())
        scale.append(_z_scale(model, st.layer, delta, acts[mids[st.layer]], positions, a_raw)
                     if site == "z" else _site_scale(delta, a_b, site, positions))
    return torch.stack(eff, dim=1), torch.stack(scale, dim=1)


def batch(job, b):
    """Registry entry "atp" and "qk": ``job.steps`` None walks the plain plan."""
    eff, scale = _batch_atp_qk(*b.head_args(job), job.steps, job.tail)
    return BatchOut(eff, scale)
