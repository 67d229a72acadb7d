"""Edge attribution: ``eap``, ``eap-ig-inputs``, ``eap-ig-activations``, ``eap*`` (docs/edges.md,
"Edge attribution": what each computes and costs). With ``delta_s`` the sender's write (source
minus base: a head's ``dz[:, :, h] @ W_O[h]``, the embeddings' ``resid_pre(0)`` difference) and
the gradients of the base run (denoise: corrupt), as for heads:

    eap:   delta(s, r, i) = sum_{pos, d} delta_s[pos, d] * dm/dx_{r,i}[pos, d]
    eap*:  delta(s, r, i) = sum_{pos, d} (z'_r - z_r) * dm/dz_r,  z'_r the receiving head's
           output with delta_s in its input i alone (the logits receiver as eap)

``x_{r,i}``: the receiver's own copy of the residual at input ``i`` (``hooks.q_input`` ...,
under ``shortcuts.split_qkv_inputs``); the logits' gradient is taken at the final residual. The
eap-ig estimators average eap's gradient over ``m`` runs with the token embeddings (inputs) or
each sender layer's attention output (activations) interpolated base -> source.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import einops
import torch
from einops import einsum
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.patching import shortcuts
from circuitkit.patching.estimators.common import (
    Batch,
    BatchOut,
    _grad_run,
    _grads,
    _lean,
    _MetricStash,
    _plain_run,
    _progress,
)
from circuitkit.patching.sweep import auto_rows


def _sender_writes(model: Any, senders: Sequence[tuple[int, int]], base: dict[str, Tensor],
                   src: dict[str, Tensor]) -> Float[Tensor, "s b pos d_model"]:
    """``delta_s`` of every sender from two runs' caches (``hook_z``, ``resid_pre(0)``)."""
    out = []
    for sl, h in senders:
        if sl < 0:
            out.append(src[hooks.resid_pre(0)] - base[hooks.resid_pre(0)])
        else:
            dz = (src[hooks.z(sl)] - base[hooks.z(sl)])[:, :, h]
            out.append(dz @ model.blocks[sl].attn.W_O[h].detach())
    return torch.stack(out)


def _receiver_effects(model: Any, layer: int, inputs: Sequence[str],
                      resid: Float[Tensor, "b pos d_model"],
                      writes: Float[Tensor, "s b pos d_model"],
                      grad_z: Float[Tensor, "b pos n_heads d_head"], block_arity: int,
                      max_rows: int) -> dict[str, Float[Tensor, "b s n_heads"]]:
    """eap*'s first-order effect of each write on each head of ``layer`` through input ``i``:
    ``sum_{pos, e} (z'_h - z_h) * dm/dz_h``, ``z'_h`` the head's output when ``writes[s]``
    reaches its input ``i`` alone: the layer's q/k/v computed by the model on ``resid +
    writes[s]`` (``shortcuts.run_until``), one input's written into an otherwise base run of
    the layer. Heads of a layer do not read each other, so all of them take the write at once
    and each gets its single-edge output. The base row runs in the same batch (``z``
    bit-comparable); senders go in chunks of at most ``max_rows`` rows."""
    b = resid.shape[0]
    per = max(1, max_rows // b - 1)
    sites = {i: hooks.head_site(i, layer) for i in inputs}
    out: dict[str, list[Tensor]] = {i: [] for i in inputs}
    with torch.no_grad():
        for c0 in range(0, writes.shape[0], per):
            w = writes[c0:c0 + per].detach()
            n = w.shape[0]
            x = torch.cat([resid[None] + w, resid[None]]).flatten(0, 1)
            given = shortcuts.run_until(model, layer, x, list(sites.values()), block_arity)
            base = resid.repeat(n + 1, 1, 1)  # every input's run: the base, one input replaced
            for i, site in sites.items():
                put = (lambda t, hook, v=given[site]: v.to(t.dtype))
                z = shortcuts.run_until(model, layer, base, [hooks.z(layer)], block_arity,
                                        fwd_hooks=[(site, put)])[hooks.z(layer)]
                z = z.view(n + 1, b, *z.shape[1:])
                out[i].append(einsum(z[:n] - z[n:], grad_z.to(z.dtype),
                                     "s b p h e, b p h e -> b s h").float().cpu())
    return {i: torch.cat(v, dim=1) for i, v in out.items()}


def _edge_grads(model: Any, base: Tensor, stash: _MetricStash, idx: Tensor, at: Tensor | None,
                names: Sequence[str], estimator: str, steps: int, group: int | None,
                b_acts: dict[str, Tensor], s_acts: dict[str, Tensor], split: bool = True
                ) -> dict[str, Tensor]:
    """Gradients of the metric (sum over prompts) at the receivers' inputs ``names``: of the
    base run ("eap", "eap*"), or averaged over ``steps`` interpolated runs: the embeddings
    ("eap-ig-inputs"; "eap-ig-activations" with ``group`` -1) or layer ``group``'s attention
    output ("eap-ig-activations") from base to source at ``alpha_k = (k + 1/2) / steps``."""
    runs = [None] if estimator in ("eap", "eap*") else [(k + 0.5) / steps
                                                         for k in range(steps)]
    out = {name: 0.0 for name in names}
    e_b, e_s = b_acts[hooks.EMBED], s_acts[hooks.EMBED]
    for alpha in runs:
        embed, extra = None, []
        if alpha is not None and (estimator == "eap-ig-inputs" or group == -1):
            embed = e_b + alpha * (e_s - e_b)
        elif alpha is not None:
            a_b, a_s = b_acts[hooks.attn_out(group)], s_acts[hooks.attn_out(group)]

            def interpolate(t: Tensor, hook: Any, a_b=a_b, a_s=a_s, alpha=alpha) -> Tensor:
                return a_b + alpha * (a_s - a_b)

            extra = [(hooks.attn_out(group), interpolate)]
        fresh = _MetricStash(stash.metric, torch.arange(base.shape[0]), stash.at)
        forked = shortcuts.split_qkv_inputs(model) if split else contextlib.nullcontext()
        with forked, _lean(model, at):
            obj, kept = _grad_run(model, base, fresh, names, embed=embed, extra=extra)
            grads = _grads(obj, kept, names, retain=False)
        for name, g in zip(names, grads, strict=True):
            out[name] = out[name] + g.detach() / len(runs)
    return out


@dataclass(frozen=True)
class EdgeJob:
    """What every batch of an edge estimate shares: the layout, the estimator and its steps,
    the hooks to cache (``plain``) and differentiate at (``grad_names``), the sender groups
    (eap-ig-activations: one per sender layer; else ``[None]``), per receiver layer the senders
    before it, and eap*'s receiver runs (``block_arity``, ``max_rows``, ``q_per_kv``)."""

    layout: Any
    estimator: str
    ig_steps: int
    recv_layers: list[int]
    logits: bool
    r_index: dict
    grad_names: list[str]
    groups: list
    plain: list[str]
    before: dict[int, list[int]]
    progress: bool
    block_arity: int = 0
    max_rows: int = 0
    q_per_kv: int = 1

    @property
    def exact_receiver(self) -> bool:
        return self.estimator == "eap*"


def edge_job(model: Any, layout: Any, est: str, m: int, tokens: Tensor, progress: bool) -> EdgeJob:
    """The ``EdgeJob`` of estimating ``layout``'s edges by ``est`` on prompts like ``tokens``."""
    L = layout.n_layers
    r_index = layout.receiver_index()
    logits = (L, -1) in r_index
    recv_layers = sorted({la for la, _ in layout.receivers if la < L})
    exact_receiver = est == "eap*"
    grad_names = ([hooks.z(la) for la in recv_layers] if exact_receiver else
                  [hooks.edge_input(i, la) for la in recv_layers for i in layout.inputs])
    grad_names += [hooks.resid_post(L - 1)] if logits else []
    groups = sorted({max(sl, -1) for sl, _ in layout.senders}) if est == "eap-ig-activations" \
        else [None]
    plain = sorted({hooks.EMBED, hooks.resid_pre(0), hooks.resid_post(L - 1),
                    *(hooks.z(sl) for sl, _ in layout.senders if sl >= 0),
                    *(hooks.resid_pre(la) for la in recv_layers),
                    *(hooks.attn_out(g) for g in groups if g is not None and g >= 0)})
    # cells: for each receiver layer, the senders before it
    before = {la: [s for s, (sl, _) in enumerate(layout.senders) if sl < la]
              for la in [*recv_layers, L]}
    extra = {}
    if exact_receiver:
        f = hooks.facts(model)
        device = next(model.parameters()).device
        extra = dict(q_per_kv=f.n_heads // f.n_kv_heads,
                     block_arity=shortcuts.output_arity(model, tokens[:1].to(device))[0],
                     max_rows=auto_rows(model, tokens.shape[1]))
    return EdgeJob(layout, est, m, recv_layers, logits, r_index, grad_names, groups, plain,
                   before, progress, **extra)


def batch(job: EdgeJob, b: Batch) -> BatchOut:
    """Registry entries "eap", "eap-ig-*", "eap*": one batch's scores ``[b, S, R, I]`` (NaN where
    no edge) and write scales ``[S, R, I]`` (``|delta_s| / |x_r|``)."""
    layout, L = job.layout, job.layout.n_layers
    model, base = b.model, b.base
    with _lean(model, b.at):
        b_acts = _plain_run(model, base, b.stash_base, job.plain)
        s_acts = _plain_run(model, b.src, b.stash_src, job.plain)
    delta = _sender_writes(model, layout.senders, b_acts, s_acts)  # [S, b, pos, d]
    n = base.shape[0]
    score = torch.full((n, len(layout.senders), len(layout.receivers), len(layout.inputs)),
                       float("nan"))
    scale = torch.full(score.shape[1:], float("nan"))
    for group in job.groups:
        grads = _edge_grads(model, base, b.stash_base, b.idx, b.at, job.grad_names, job.estimator,
                            job.ig_steps, group, b_acts, s_acts, split=not job.exact_receiver)
        mine = [s for s, (sl, _) in enumerate(layout.senders)
                if group is None or max(sl, -1) == group]
        layers = [*job.recv_layers, *([L] if job.logits else [])]
        # eap* re-runs each receiving layer's attention per sender: the long part
        for la in _progress(layers, job.progress and job.exact_receiver,
                            f"eap* receiver layers, prompts {b.start}-{b.start + n - 1}"):
            ss = [s for s in job.before[la] if s in mine]
            if ss:
                _layer_scores(job, model, la, ss, delta[ss], b_acts, grads, score, scale)
    return BatchOut(score, scale)


def _layer_scores(job: EdgeJob, model: Any, la: int, ss: list[int], d: Tensor,
                  b_acts: dict[str, Tensor], grads: dict[str, Tensor], score: Tensor,
                  scale: Tensor) -> None:
    """Fill ``score`` and ``scale`` for the edges from senders ``ss`` (writes ``d``) into
    receiver layer ``la`` (the logits when ``la`` is the layer count)."""
    layout, L, r_index = job.layout, job.layout.n_layers, job.r_index
    x = b_acts[hooks.resid_pre(la) if la < L else hooks.resid_post(L - 1)]
    rel = (d.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12)).mean((1, 2))
    st = torch.tensor(ss)
    if la == L:
        g = grads[hooks.resid_post(L - 1)]
        score[:, st, r_index[(L, -1)], 0] = einsum(d, g, "s b p m, b p m -> b s").float().cpu()
        scale[st, r_index[(L, -1)], 0] = rel.float().cpu()
        return
    if job.exact_receiver:
        effects = _receiver_effects(model, la, layout.inputs, x, d, grads[hooks.z(la)],
                                    job.block_arity, job.max_rows)
    for i, name in enumerate(layout.inputs):
        units = layout.units(la, name)
        if not units:
            continue
        rt = torch.tensor([r_index[(la, u)] for u in units])
        if job.exact_receiver:
            e = effects[name]
            if name in hooks.KV_SITES:  # a KV head: its query heads' sum
                e = einops.reduce(e, "b s (g r) -> b s g", "sum", r=job.q_per_kv)
            e = e[:, :, units]
        else:
            g = grads[hooks.edge_input(name, la)][:, :, units]
            e = einsum(d, g, "s b p m, b p h m -> b s h").float().cpu()
        score[:, st[:, None], rt[None, :], i] = e
        scale[st[:, None], rt[None, :], i] = rel.float().cpu()[:, None]
