"""Attribution patching of attention heads: a gradient estimate of every head's patching effect.

Plain attribution (Nanda 2023; Syed et al. 2023). With ``a`` a head's activation at ``site`` and
``m`` the metric, patching ``a`` from the *base* run to the *source* run changes ``m`` by about

    delta(head) = sum_{pos, d} (a_source - a_base)[pos, head, d] * dm/da_base[pos, head, d]

* denoise: base = corrupt run, source = clean run (clean activation into the corrupt run);
* noise:   base = clean run,   source = corrupt run.

Two forwards (base with gradients, source without) and one backward give every head at once
(TransformerLens's ``cache_activation_and_gradient`` does the caching). The reported value is
``metric(base) + delta`` per prompt, i.e. an estimate of the metric *after* patching, directly
comparable with the exact sweep's ``values``.

AtP* (Kramar et al. 2024, section 3.1, the Q/K fix; ``atp_star=True``). The linear estimate fails
when an attention softmax saturates: a large change in attention scores moves the pattern a lot,
but the gradient at a saturated softmax is ~0. The fix implemented here:

* ``site="q"``/``"k"``: the patched query/key feeds only its own layer's attention pattern, so the
  estimate is ``sum (pattern(q_source) - pattern_base) * dm/dpattern``: that layer's softmax is
  recomputed exactly (per head, all query positions), and only what comes after the pattern is
  linearised. (For GQA a patched key head changes every query head of its group.)
* ``site="z"``: the head writes ``dr = (z_source - z_base) @ W_O[head]`` into the residual stream.
  For every later layer ``l'`` the attention pattern is recomputed exactly with that write added
  to the layer's input, ``P_l'(r_l' + dr)``, (RMSNorm/LayerNorm, Q/K projections, rotary, mask
  and softmax: the model's own modules run on it), and its linearisation is swapped out:

      delta*(head) = delta(head)
                     + sum_{l' > l} [ (P_l'(r_l' + dr) - P_l'(r_l')) . dm/dP_l'
                                      - dr . d/dr (P_l'(r) . dm/dP_l') ]

  The subtracted term is exactly the part of the plain gradient that flows from the head's
  direct residual write through ``l'``'s queries and keys (a vector-Jacobian product, one per
  layer), so the rest of the plain estimate (value/output paths, paths through MLPs) stays.

Approximations that remain (documented, deliberate):

* only the *direct* residual write of the patched head enters ``l'``'s queries/keys exactly;
  its effect on ``l'``'s queries/keys through intermediate layers (MLPs, other heads) stays linear;
* ``dm/dP_l'`` is the base run's gradient: what comes after each recomputed pattern (values,
  later layers, unembedding) is linearised, and the corrections of different ``l'`` are added
  (interactions between the changes of two downstream patterns are ignored);
* AtP*'s second fix (GradDrop, for cancellation across layers) is not implemented;
* ``site="v"``/``"pattern"``: no AtP* correction (raises), as their effect on their own head's
  output is linear in the patched activation; downstream Q/K effects are then linear.

Exact tail (``exact_tail``, default on with ``atp_star``, site z; an extension beyond the paper).
The Q/K fix alone cannot help when the *readout* saturates: on the shipped ``induction-2l`` the
clean log-prob is ~-6e-4, so ``dm/dlogits = onehot - p ~ 0`` and every first-order term, corrected
patterns included, is ~1e-4 while exact noising of the previous-token head is -9 (normalised
-0.81). So the last block and the readout are evaluated exactly for each head's direct write:

* heads of layers ``l < L-1``: add ``m(tail(r_{L-1} + dr)) - m_base - dr . dm/dr_{L-1}``, where
  ``tail`` = last block + final norm + unembedding + metric; this replaces the linearised effect of
  the head's direct write on the last block and the logits (that layer's Q/K correction is
  subsumed). Intermediate layers keep the Q/K correction above.
* heads of the last layer: ``m(tail(r_{L-1}, z_head -> z_source)) - m_base``, i.e. exact patching
  of that head (the last block re-run alone).

For a 2-layer model this makes site-z estimates exact up to the (linear) effect through layer 0's
MLP. Cost: one last-block + unembedding call per head (per head and position for "each").

Cost: plain = 2 forwards + 1 backward per batch; AtP* adds, per pair of layers ``l < l'``, one
attention-layer call over ``n_heads`` (``n_heads * seq`` for ``positions="each"``) copies of the
batch, plus one attention-layer backward per layer, plus the exact tail (above).

``attribution_plus_exact`` screens every head by (AtP*) attribution, then verifies the ``top_k``
cells with the largest estimated ``|effect|`` by exact patching.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import einops
import torch
from jaxtyping import Float, Int
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching import shortcuts
from circuitkit.patching.inputs import DIRECTIONS, HEAD_SITES, POSITIONS, check_tokens, choice
from circuitkit.patching.results import PatchResult

ATP_STAR_SITES = ("z", "q", "k")
# Sequences per attention-layer call of the AtP* correction (bounds its memory).
ATP_STAR_CHUNK = 2048
# Sequences per last-block + unembedding call of the exact tail (logits are [n, pos, vocab]).
EXACT_TAIL_CHUNK = 512

Metric = Callable[[Tensor], Tensor] | PromptMetric


# --- helpers ---------------------------------------------------------------------------------


def _check_args(model: Any, clean: Tensor, corrupt: Tensor, direction: str, site: str,
                positions: str) -> tuple[Tensor, Tensor]:
    choice("direction", direction, DIRECTIONS)
    choice("site", site, HEAD_SITES)
    choice("positions", positions, POSITIONS)
    return check_tokens(clean, corrupt, model)


def _progress(it: Sequence[Any], on: bool, desc: str):
    if not on:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, leave=False)


class _MetricStash:
    """Wraps the metric as the scalar ``cache_activation_and_gradient`` differentiates.

    For a ``PromptMetric`` the scalar is the *sum* of per-prompt values: prompts do not interact,
    so its gradient at prompt ``b``'s activations is ``d metric_b / d a_b`` and the products
    below are per-prompt estimates. A plain callable is differentiated as is (its chunk value).
    """

    def __init__(self, metric: Metric, idx: Tensor, at: Tensor | None = None):
        self.per_prompt = isinstance(metric, PromptMetric)
        self.metric = metric.select(idx) if self.per_prompt else metric
        self.at = at  # the logits hold only these positions (``shortcuts.reads_only``)
        self.value: Tensor | None = None  # [batch] (PromptMetric) or [] (plain)

    def __call__(self, logits: Tensor) -> Tensor:
        if self.per_prompt:
            v = self.metric.per_prompt(logits, at=self.at)
            self.value = v.detach()
            return v.sum()
        v = self.metric(logits)
        self.value = v.detach()
        return v


def _site_names(model: Any, site: str) -> list[str]:
    return [hooks.head_site(site, layer) for layer in range(hooks.facts(model).n_layers)]


def _head_effect(delta: Tensor, grad: Tensor, site: str, positions: str) -> Tensor:
    """Per-prompt, per-head sum of ``delta * grad``: [b, h] ("all") or [b, h, pos] ("each").

    For ``pattern`` the position is the query (destination) position.
    """
    prod = delta * grad
    if site == "pattern":  # [b, h, q, k]
        return einops.reduce(prod, "b h q k -> b h" if positions == "all" else "b h q k -> b h q",
                             "sum")
    return einops.reduce(prod, "b p h d -> b h" if positions == "all" else "b p h d -> b h p",
                         "sum")


# --- exact attention recomputation (AtP*) -----------------------------------------------------


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
                self.kwargs[key] = {
                    k: v for k, v in kwargs.items()
                    if k not in ("hidden_states", "cache", "past_key_value", "past_key_values")}
            self._handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()


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


def _pattern_of(model: Any, layer: int, resid: Float[Tensor, "n pos d_model"],
                kwargs: dict[str, Any], batch: int,
                fwd_hooks: Sequence[tuple[str, Callable]] = ()) -> Float[Tensor, "n h q k"]:
    """Layer ``layer``'s attention pattern for residual input ``resid`` (n = copies * batch)."""
    block = model.blocks[layer]
    kw = _expand_kwargs(kwargs, resid.shape[0] // batch, batch)
    out: dict[str, Tensor] = {}

    def grab(t: Tensor, hook: Any) -> None:
        out["pattern"] = t

    with model.hooks(fwd_hooks=[*fwd_hooks, (hooks.pattern(layer), grab)]):
        block.attn(hidden_states=block.ln1(resid), **kw)
    return out["pattern"]


def _copy_masks(n_heads: int, seq: int, positions: str, device: Any) -> Float[Tensor, "c pos h"]:
    """One 0/1 mask per patched cell: head h at every position ("all") or at one ("each")."""
    eye_h = torch.eye(n_heads, device=device)
    if positions == "all":
        return einops.repeat(eye_h, "c h -> c p h", p=seq).contiguous()
    eye_p = torch.eye(seq, device=device)
    return einops.rearrange(eye_h[:, None, None, :] * eye_p[None, :, :, None],
                            "ch cp p h -> (ch cp) p h")


def _atp_star_qk_own(model, layer, site, a_src, r_base, kwargs, g_pat, positions,
                     batch) -> Tensor:
    """AtP* for site q/k: exact own-layer pattern change, dotted with dm/dpattern.

    Returns [b, h] or [b, h, pos] (h = heads at ``site``).
    """
    seq = a_src.shape[1]
    n_h = a_src.shape[2]
    masks = _copy_masks(n_h, seq, positions, a_src.device)  # [c, p, h]
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


def _head_writes(model: Any, layer: int, dz: Tensor) -> Float[Tensor, "b pos h d_model"]:
    """Each head's residual-stream write ``dz[:, :, h] @ W_O[h]``."""
    W_O = model.blocks[layer].attn.W_O.detach()  # [h, d_head, d_model]
    return einops.einsum(dz, W_O, "b p h d, h d m -> b p h m")


def _atp_star_z_downstream(model, layer, dz, r_base, kwargs, g_pat, positions, batch,
                           stop: int) -> Tensor:
    """AtP* Q/K correction of head outputs (site z) of ``layer``, summed over layers
    ``layer + 1 .. stop - 1``.

    For each such layer l': (exact pattern change - its linearisation) . dm/dP_l'.
    ``dz``: [b, p, h, d_head]; returns [b, h] or [b, h, pos].
    """
    d_r = _head_writes(model, layer, dz)
    seq, n_h = d_r.shape[1], d_r.shape[2]
    masks = _copy_masks(n_h, seq, positions, d_r.device)  # [c, p, h]
    total = torch.zeros(batch, masks.shape[0], device=d_r.device)
    step = max(1, ATP_STAR_CHUNK // batch)
    for lp in range(layer + 1, stop):
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


def _tail_metric(model: Any, x: Tensor, block_kw: dict[str, Any], stash: _MetricStash,
                 idx: Tensor, batch: int, fwd_hooks: Sequence[tuple[str, Callable]] = ()
                 ) -> Float[Tensor, "b c"]:
    """Metric after running the last block, final norm and unembedding on ``x`` ([c*b, pos, d]).

    Returns [b, c]: per-prompt values (PromptMetric) or, for a plain callable, each copy's
    chunk value divided by ``b`` in every row (so a sum over rows gives the chunk value).
    """
    last = model.blocks[len(model.blocks) - 1]
    n_c = x.shape[0] // batch
    at = None if stash.at is None else stash.at.repeat(n_c, 1)
    # With known read positions the MLP, final norm and unembedding run there only.
    lean = [] if at is None else [(last.mlp, shortcuts.mlp_at_rows(last.mlp, at))]
    with model.hooks(fwd_hooks=list(fwd_hooks)), shortcuts.overridden(lean):
        out = last(x, **_expand_kwargs(block_kw, n_c, batch))
    out = out[0] if isinstance(out, tuple) else out
    if at is not None:
        out = shortcuts.take_rows(out, at)
    logits = model.unembed(model.ln_final(out))
    if stash.per_prompt:
        vals = stash.metric.select(torch.arange(batch).repeat(n_c)).per_prompt(logits, at=at)
        return einops.rearrange(vals, "(c b) -> b c", c=n_c)
    vals = torch.stack([stash.metric(logits[c * batch:(c + 1) * batch]) for c in range(n_c)])
    return einops.repeat(vals / batch, "c -> b c", b=batch)


def _exact_tail(model, layer, dz, r_last, block_kw, g_r_last, stash, idx, positions,
                batch) -> Tensor:
    """Exact last block + readout for each head's patch (site z); see the module docstring.

    ``layer`` < last: ``m(tail(r_last + dr)) - m_base - dr . dm/dr_last`` (a correction added
    to the estimate). ``layer`` == last: ``m(tail(r_last, z_head + dz_head)) - m_base`` (the
    whole estimate: the head is patched exactly). Returns [b, h] or [b, h, pos].
    """
    last = len(model.blocks) - 1
    seq, n_h = dz.shape[1], dz.shape[2]
    masks = _copy_masks(n_h, seq, positions, dz.device)  # [c, p, h]
    m_base = stash.value.to(dz.device)
    m_base = m_base[:, None] if stash.per_prompt else m_base / batch
    step = max(1, EXACT_TAIL_CHUNK // batch)
    out = []
    with torch.no_grad():
        d_r = _head_writes(model, layer, dz) if layer < last else None
        for start in range(0, masks.shape[0], step):
            m = masks[start:start + step]
            c = m.shape[0]
            if d_r is not None:
                dr_c = einops.einsum(m, d_r, "c p h, b p h m -> c b p m")
                x = einops.rearrange(r_last[None] + dr_c, "c b p m -> (c b) p m")
                linear = einops.einsum(dr_c, g_r_last, "c b p m, b p m -> b c")
                out.append(_tail_metric(model, x, block_kw, stash, idx, batch) - m_base
                           - linear)
            else:
                add = einops.rearrange(m[:, None, :, :, None] * dz[None],
                                       "c b p h d -> (c b) p h d")

                def patch(t: Tensor, hook: Any, add=add) -> Tensor:
                    return t + add

                out.append(_tail_metric(model, r_last.repeat(c, 1, 1), block_kw, stash, idx,
                                        batch, [(hooks.z(last), patch)]) - m_base)
    eff = torch.cat(out, dim=1)  # [b, copies]
    return eff if positions == "all" else einops.rearrange(eff, "b (h p) -> b h p", p=seq)


# --- public API ------------------------------------------------------------------------------


def attribution_patch_heads(
    model: Any,
    clean_tokens: Int[Tensor, "batch seq"],
    corrupt_tokens: Int[Tensor, "batch seq"],
    metric: Metric,
    direction: str = "denoise",
    site: str = "z",
    positions: str = "all",
    atp_star: bool = False,
    batch_size: int | None = None,
    progress: bool = True,
    exact_tail: bool | None = None,
) -> PatchResult:
    """Estimate every head's patching effect by attribution (optionally AtP*); see module doc.

    Args:
        model: a TransformerBridge (eval mode).
        clean_tokens, corrupt_tokens: [batch, seq], aligned position by position.
        metric: ``logits -> scalar``; a ``PromptMetric`` also gives per-prompt values. A plain
            callable chunked by ``batch_size`` is assumed to be a mean over prompts (chunks are
            weighted by size).
        direction: "denoise" (clean -> corrupt run) or "noise" (corrupt -> clean run).
        site: "z", "q", "k", "v" (k/v: KV heads under GQA) or "pattern".
        positions: "all" -> values [n_layers, n_heads]; "each" -> [n_layers, n_heads, seq]
            (for "pattern" the position is the query position).
        atp_star: apply the AtP* Q/K correction (sites z, q, k).
        batch_size: prompts per forward/backward (default: all).
        exact_tail: evaluate the last block and the readout exactly for each head's direct
            write (site z; default: on with ``atp_star``); see the module docstring.

    Returns:
        PatchResult, method "attribution" (``meta["atp_star"]`` says whether AtP* was applied);
        ``values = metric(base) + delta`` (mean over prompts), ``per_prompt`` for a PromptMetric.
    """
    clean_tokens, corrupt_tokens = _check_args(model, clean_tokens, corrupt_tokens, direction, site,
                                               positions)
    if atp_star and site not in ATP_STAR_SITES:
        raise NotImplementedError(
            f"atp_star=True corrects Q/K (softmax) effects for sites {ATP_STAR_SITES}; "
            f"site={site!r} acts linearly on its own head's output, use atp_star=False.")
    from transformer_lens.tools.analysis.attribution_patching import (
        cache_activation_and_gradient,
    )

    f = hooks.facts(model)
    n, seq = clean_tokens.shape
    device = next(model.parameters()).device
    bs = batch_size or n
    base_all, src_all = ((corrupt_tokens, clean_tokens) if direction == "denoise"
                         else (clean_tokens, corrupt_tokens))
    site_names = _site_names(model, site)
    last = f.n_layers - 1
    tail = (atp_star if exact_tail is None else exact_tail) and site == "z"
    if exact_tail and site != "z":
        raise NotImplementedError("exact_tail is implemented for site='z' only.")
    # Layers whose Q/K correction is computed by recomputing the pattern; the exact tail
    # subsumes the last layer's (it runs the whole last block exactly).
    star_layers = list(range(1, last if tail else f.n_layers)) if (atp_star and site == "z") \
        else []
    own_layers = list(range(f.n_layers)) if (atp_star and site in ("q", "k")) else []
    attn_layers = sorted(set(star_layers) | set(own_layers))
    extra = ([hooks.pattern(lay) for lay in attn_layers]
             + [hooks.resid_pre(lay) for lay in sorted(set(attn_layers) | ({last} if tail
                                                                        else set()))])
    modules = {lay: model.blocks[lay].attn for lay in attn_layers}
    if tail:
        modules["block"] = model.blocks[last]
    per_prompt_metric = isinstance(metric, PromptMetric)
    reads = metric.read_positions() if per_prompt_metric else None

    def lean(at: Tensor | None) -> Any:  # with known read positions: compute only there
        return contextlib.nullcontext() if at is None else shortcuts.reads_only(model, at)

    effects, base_vals, src_vals = [], [], []
    weights: list[float] = []
    # No per-head hook_result einsum: nothing here reads it (the writes come from W_O).
    with shortcuts.attn_result_off(model):
        for start in _progress(range(0, n, bs), progress and n > bs, "attribution"):
            idx = torch.arange(start, min(start + bs, n))
            base = base_all[idx].to(device)
            src = src_all[idx].to(device)
            b = len(idx)
            at = None if reads is None else reads[idx].to(device)
            stash_base, stash_src = _MetricStash(metric, idx, at), _MetricStash(metric, idx, at)
            capture = _Inputs(modules)
            # With known read positions the last MLP and the unembedding run there only.
            with torch.enable_grad(), capture, lean(at):
                # hook_embed is cached too: TL's backward stops at the most upstream cached point,
                # whose own backward hook never fires, and a converted point (hook_z, hook_q ...)
                # cannot be backfilled, so layer 0's site gradient would be lost without it.
                gc = cache_activation_and_gradient(model, base, stash_base,
                                                   names_filter=[hooks.EMBED, *site_names, *extra])
            with torch.no_grad(), lean(at):
                sc = cache_activation_and_gradient(model, src, stash_src, names_filter=site_names,
                                                   compute_gradient=False)
            eff = []
            for layer, name in enumerate(site_names):
                a_b, a_s, g = gc.activations[name], sc.activations[name], gc.gradients[name]
                if g is None:  # the metric does not depend on this activation
                    g = torch.zeros_like(a_b)
                if tail and layer == last:
                    e = _exact_tail(model, layer, a_s - a_b, gc.activations[hooks.resid_pre(last)],
                                    capture.kwargs["block"], None, stash_base, idx, positions, b)
                elif layer in own_layers:
                    e = _atp_star_qk_own(
                        model, layer, site, a_s, gc.activations[hooks.resid_pre(layer)],
                        capture.kwargs[layer], gc.gradients[hooks.pattern(layer)], positions, b)
                else:
                    e = _head_effect(a_s - a_b, g, site, positions)
                if star_layers and layer < star_layers[-1]:
                    e = e + _atp_star_z_downstream(
                        model, layer, a_s - a_b,
                        {lp: gc.activations[hooks.resid_pre(lp)] for lp in star_layers},
                        capture.kwargs,
                        {lp: _zero_if_none(gc.gradients[hooks.pattern(lp)],
                                           gc.activations[hooks.pattern(lp)])
                         for lp in star_layers},
                        positions, b, star_layers[-1] + 1)
                if tail and layer < last:
                    e = e + _exact_tail(model, layer, a_s - a_b,
                                        gc.activations[hooks.resid_pre(last)],
                                        capture.kwargs["block"],
                                        gc.gradients[hooks.resid_pre(last)], stash_base, idx,
                                        positions, b)
                eff.append(e.detach().float().cpu())
            effects.append(torch.stack(eff, dim=1))  # [b, L, H(, P)] (or [L, H(, P)] summed)
            base_vals.append(stash_base.value.float().cpu())
            src_vals.append(stash_src.value.float().cpu())
            weights.append(b / n)

    meta = dict(atp_star=atp_star, exact_tail=tail, n_prompts=n, batch_size=bs,
                passes="2 forward + 1 backward per batch")
    if per_prompt_metric:
        delta = torch.cat(effects)  # [n, L, H(, P)]
        base_pp, src_pp = torch.cat(base_vals), torch.cat(src_vals)
        per_prompt = base_pp.reshape(-1, *([1] * (delta.ndim - 1))) + delta
        clean_pp, corrupt_pp = (src_pp, base_pp) if direction == "denoise" else (base_pp, src_pp)
        return PatchResult(
            values=per_prompt.mean(0), clean=clean_pp.mean(), corrupt=corrupt_pp.mean(),
            direction=direction, method="attribution", site=site, positions=positions,
            per_prompt=per_prompt, clean_per_prompt=clean_pp, corrupt_per_prompt=corrupt_pp,
            meta=meta)
    # Plain callable: chunk estimates summed over the chunk's prompts, chunks weighted by size.
    delta = sum(w * e.sum(0) for w, e in zip(weights, effects, strict=True))
    base_m = sum(w * float(v) for w, v in zip(weights, base_vals, strict=True))
    src_m = sum(w * float(v) for w, v in zip(weights, src_vals, strict=True))
    clean_m, corrupt_m = (src_m, base_m) if direction == "denoise" else (base_m, src_m)
    return PatchResult(
        values=base_m + delta, clean=clean_m, corrupt=corrupt_m, direction=direction,
        method="attribution", site=site, positions=positions, meta=meta)


def _zero_if_none(g: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if g is None else g


def _exact_cells(
    model: Any, clean_tokens: Tensor, corrupt_tokens: Tensor, metric: Metric, direction: str,
    site: str, positions: str, cells: list[tuple[int, ...]], rows: int,
) -> tuple[Tensor, Tensor | None]:
    """Exact patched metric for a list of (layer, head[, pos]) cells, by the exact engine.

    Cells of one layer are packed into one suffix forward, ``rows // n_prompts`` at a time.
    Returns (values [n_cells], per_prompt [n_prompts, n_cells] or None).
    """
    from circuitkit.patching.engine import ExactEngine, Sweep

    f = hooks.facts(model)
    n, seq = clean_tokens.shape
    is_pm = isinstance(metric, PromptMetric)
    sweep = Sweep("heads", site, direction, positions, f.n_layers, f.n_heads_at(site),
                  seq if positions == "each" else 1, n, seq, is_pm)
    engine = ExactEngine(model, clean_tokens, corrupt_tokens, metric, sweep)
    per_fwd = max(1, rows // n)
    out = torch.zeros(len(cells), n if is_pm else 1)
    by_layer: dict[int, list[int]] = {}
    for i, cell in enumerate(cells):
        by_layer.setdefault(cell[0], []).append(i)
    for layer, idx in by_layer.items():
        for s in range(0, len(idx), per_fwd):
            group = idx[s:s + per_fwd]
            variants = [cells[i][1] * sweep.n_pos + (cells[i][2] if len(cells[i]) == 3 else 0)
                        for i in group]
            out[group] = engine.run_variants(layer, variants, 0, n)
    return out.mean(1), (out.T.contiguous() if is_pm else None)


def attribution_plus_exact(
    model: Any,
    clean_tokens: Int[Tensor, "batch seq"],
    corrupt_tokens: Int[Tensor, "batch seq"],
    metric: Metric,
    direction: str = "denoise",
    site: str = "z",
    positions: str = "all",
    top_k: int = 20,
    atp_star: bool = True,
    batch_size: int | None = None,
    progress: bool = True,
) -> PatchResult:
    """Screen all heads by attribution; verify the ``top_k`` largest ``|estimated effect|`` exactly.

    ``values``: exact metric-after-patch for the verified cells, the attribution estimate for the
    rest; ``meta["verified"]``: nested-list bool mask shaped like ``values`` (``verified_mask()``
    below turns it back into a tensor); ``meta["attribution_values"]``: the screening estimate of
    every cell. ``atp_star`` is applied where supported (sites z, q, k). Exact verification costs
    ``top_k`` patched forwards per prompt, packed ``batch_size`` sequences per forward (default:
    ``max(n_prompts, 64)``).
    """
    clean_tokens, corrupt_tokens = _check_args(model, clean_tokens, corrupt_tokens, direction, site,
                                               positions)
    est = attribution_patch_heads(
        model, clean_tokens, corrupt_tokens, metric, direction=direction, site=site,
        positions=positions, atp_star=atp_star and site in ATP_STAR_SITES,
        batch_size=batch_size, progress=progress)
    base = est.corrupt if direction == "denoise" else est.clean
    effect = (est.values - base).abs().flatten()
    k = min(top_k, effect.numel())
    flat = torch.topk(effect, k).indices
    cells = [tuple(int(i) for i in torch.unravel_index(j, est.values.shape)) for j in flat]
    n = clean_tokens.shape[0]
    rows = batch_size or max(n, 64)
    exact, exact_pp = _exact_cells(model, clean_tokens, corrupt_tokens, metric, direction, site,
                                   positions, cells, rows)
    values = est.values.clone()
    per_prompt = est.per_prompt.clone() if est.per_prompt is not None else None
    verified = torch.zeros_like(values, dtype=torch.bool)
    for i, cell in enumerate(cells):
        values[cell] = exact[i]
        verified[cell] = True
        if per_prompt is not None and exact_pp is not None:
            per_prompt[(slice(None), *cell)] = exact_pp[:, i]
    meta = dict(est.meta, top_k=k, verified=verified.tolist(), verified_cells=cells,
                attribution_values=est.values.tolist(), atp_star=est.meta["atp_star"])
    return PatchResult(
        values=values, clean=est.clean, corrupt=est.corrupt, direction=direction,
        method="attribution+exact", site=site, positions=positions, per_prompt=per_prompt,
        clean_per_prompt=est.clean_per_prompt, corrupt_per_prompt=est.corrupt_per_prompt,
        meta=meta)


def verified_mask(result: PatchResult) -> Tensor:
    """``meta["verified"]`` of an ``attribution_plus_exact`` result as a bool tensor."""
    return torch.tensor(result.meta["verified"], dtype=torch.bool)
