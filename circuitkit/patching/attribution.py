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

Cost: plain = 4 pass-equivalents per prompt (2 forwards + 1 backward, a backward counting 2);
AtP* adds, per pair of layers ``l < l'``, one attention-layer call over ``n_heads``
(``n_heads * seq`` for ``positions="each"``) copies of the batch, plus one attention-layer
backward per layer, plus the exact tail (above).

The estimator walks a per-layer plan (``estimator_plan``, a list of ``LayerStep``): for each layer,
how its own heads' effect is taken (linear, exact own-layer pattern for q/k, exact last block) and
which corrections are added (the downstream Q/K fix over which layers, the exact-tail correction).

Metrics: a ``PromptMetric`` (``circuitkit.metrics``). A metric without per-prompt values (a wrapped
scalar callable) repeats its scalar ``m`` for every prompt; the objective differentiated is the sum
of per-prompt values, ``n * m``, so per-prompt estimates are ``n`` times each prompt's share and
their mean is ``m + sum_b delta_b``: the same formula, no special case (such a metric runs all
prompts in one batch).

The hybrid (attribution, then exact verification of the top cells) lives in ``patching/api.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import einops
import torch
from jaxtyping import Float, Int
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric, as_metric
from circuitkit.patching import shortcuts
from circuitkit.patching.inputs import DIRECTIONS, POSITIONS, check_tokens, choice
from circuitkit.patching.results import PatchResult

ATP_STAR_SITES = ("z", "q", "k")
ATTRIBUTION_COST = "4 pass-equivalents per prompt (2 forwards + 1 backward, a backward counting 2)"
# Sequences per attention-layer call of the AtP* correction (bounds its memory).
ATP_STAR_CHUNK = 2048
# Sequences per last-block + unembedding call of the exact tail (logits are [n, pos, vocab]).
EXACT_TAIL_CHUNK = 512



# --- helpers ---------------------------------------------------------------------------------


def _progress(it: Sequence[Any], on: bool, desc: str):
    if not on:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, leave=False)


class _MetricStash:
    """The metric as the scalar ``cache_activation_and_gradient`` differentiates: the *sum* of
    per-prompt values (prompts do not interact, so its gradient at prompt ``b``'s activations is
    ``d metric_b / d a_b``). Keeps the per-prompt values of the last call."""

    def __init__(self, metric: PromptMetric, idx: Tensor, at: Tensor | None = None):
        self.metric = metric.select(idx)
        self.at = at  # the logits hold only these positions (``shortcuts.reads_only``)
        self.value: Tensor | None = None  # [batch]

    def __call__(self, logits: Tensor) -> Tensor:
        v = self.metric.per_prompt(logits, at=self.at)
        self.value = v.detach()
        if not v.requires_grad:
            # A locally constant (e.g. argmax-based) metric: its gradient is zero, so every
            # first-order estimate is "no effect" (metric.note says it is not differentiable).
            v = v + 0 * logits.flatten()[0]
        return v.sum()


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
                           layers: Sequence[int]) -> Tensor:
    """AtP* Q/K correction of head outputs (site z) of ``layer``, summed over ``layers`` (all
    after ``layer``).

    For each such layer l': (exact pattern change - its linearisation) . dm/dP_l'.
    ``dz``: [b, p, h, d_head]; returns [b, h] or [b, h, pos].
    """
    d_r = _head_writes(model, layer, dz)
    seq, n_h = d_r.shape[1], d_r.shape[2]
    masks = _copy_masks(n_h, seq, positions, d_r.device)  # [c, p, h]
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


def _tail_metric(model: Any, x: Tensor, block_kw: dict[str, Any], stash: _MetricStash,
                 idx: Tensor, batch: int, fwd_hooks: Sequence[tuple[str, Callable]] = ()
                 ) -> Float[Tensor, "b c"]:
    """Metric after running the last block, final norm and unembedding on ``x`` ([c*b, pos, d]).

    Returns [b, c]: per-prompt values of each copy.
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
    vals = stash.metric.select(torch.arange(batch).repeat(n_c)).per_prompt(logits, at=at)
    return einops.rearrange(vals, "(c b) -> b c", c=n_c)


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
    m_base = stash.value.to(dz.device)[:, None]
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


# --- the per-layer plan ------------------------------------------------------------------------


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
    """The per-layer plan of ``attribution_patch_heads`` (see ``LayerStep``)."""
    last = n_layers - 1
    if not atp_star and not exact_tail:
        return [LayerStep(layer) for layer in range(n_layers)]
    if site in ("q", "k"):
        return [LayerStep(layer, own="qk_exact") for layer in range(n_layers)]
    # site z: downstream patterns of every later layer, except the last when the exact tail
    # runs it (the tail subsumes that layer's Q/K fix)
    qk_layers = range(1, last if exact_tail else n_layers) if atp_star else range(0)
    return [LayerStep(layer,
                      own="exact_tail" if exact_tail and layer == last else "linear",
                      downstream_qk=tuple(lp for lp in qk_layers if lp > layer),
                      tail_correction=exact_tail and layer < last)
            for layer in range(n_layers)]


# --- public API ------------------------------------------------------------------------------


def attribution_patch_heads(
    model: Any,
    clean_tokens: Int[Tensor, "batch seq"],
    corrupt_tokens: Int[Tensor, "batch seq"],
    metric: Any,
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
        metric: a ``PromptMetric`` or any callable ``logits -> scalar | [batch]``
            (``circuitkit.metrics.as_metric``).
        direction: "denoise" (clean -> corrupt run) or "noise" (corrupt -> clean run).
        site: "z", "q", "k", "v" (k/v: KV heads under GQA) or "pattern".
        positions: "all" -> values [n_layers, n_heads]; "each" -> [n_layers, n_heads, seq]
            (for "pattern" the position is the query position).
        atp_star: apply the AtP* Q/K correction (sites z, q, k).
        batch_size: prompts per forward/backward (default: all; a metric without per-prompt
            values always runs all prompts at once).
        exact_tail: evaluate the last block and the readout exactly for each head's direct
            write (site z; default: on with ``atp_star``); see the module docstring.

    Returns:
        PatchResult, method "attribution" (``meta["atp_star"]``, ``meta["plan"]``);
        ``values = metric(base) + delta`` (mean over prompts).
    """
    choice("direction", direction, DIRECTIONS)
    choice("site", site, hooks.PATCH_HEAD_SITES)
    choice("positions", positions, POSITIONS)
    clean_tokens, corrupt_tokens = check_tokens(clean_tokens, corrupt_tokens, model)
    f = hooks.facts(model)
    n, seq = clean_tokens.shape
    metric = as_metric(metric, n, seq, f.d_vocab)
    if atp_star and site not in ATP_STAR_SITES:
        raise NotImplementedError(
            f"atp_star=True corrects Q/K (softmax) effects for sites {ATP_STAR_SITES}; "
            f"site={site!r} acts linearly on its own head's output, use atp_star=False.")
    if exact_tail and site != "z":
        raise NotImplementedError("exact_tail is implemented for site='z' only.")
    from transformer_lens.tools.analysis.attribution_patching import (
        cache_activation_and_gradient,
    )

    tail = (atp_star if exact_tail is None else exact_tail) and site == "z"
    steps = estimator_plan(f.n_layers, site, atp_star, tail)
    last = f.n_layers - 1
    device = next(model.parameters()).device
    bs = batch_size if (batch_size and metric.per_prompt_values) else n
    base_all, src_all = ((corrupt_tokens, clean_tokens) if direction == "denoise"
                         else (clean_tokens, corrupt_tokens))
    site_names = [hooks.head_site(site, layer) for layer in range(f.n_layers)]
    # What the plan needs cached: patterns (and their gradients) of the layers it recomputes,
    # the residual inputs there and at the last block, and those modules' call arguments.
    attn_layers = sorted({lp for st in steps for lp in st.downstream_qk}
                         | {st.layer for st in steps if st.own == "qk_exact"})
    resid_layers = sorted(set(attn_layers) | ({last} if tail else set()))
    extra = [hooks.pattern(lay) for lay in attn_layers] + [hooks.resid_pre(lay)
                                                           for lay in resid_layers]
    modules: dict[Any, Any] = {lay: model.blocks[lay].attn for lay in attn_layers}
    if tail:
        modules["block"] = model.blocks[last]
    reads = metric.read_positions()

    def lean(at: Tensor | None) -> Any:  # with known read positions: compute only there
        return contextlib.nullcontext() if at is None else shortcuts.reads_only(model, at)

    effects, base_vals, src_vals = [], [], []
    # No per-head hook_result einsum: nothing here reads it (the writes come from W_O).
    with shortcuts.attn_result_off(model):
        for start in _progress(range(0, n, bs), progress and n > bs, "attribution"):
            idx = torch.arange(start, min(start + bs, n))
            base, src, b = base_all[idx].to(device), src_all[idx].to(device), len(idx)
            at = None if reads is None else reads[idx].to(device)
            stash_base, stash_src = _MetricStash(metric, idx, at), _MetricStash(metric, idx, at)
            capture = _Inputs(modules)
            with torch.enable_grad(), capture, lean(at):
                # hook_embed is cached too: TL's backward stops at the most upstream cached point,
                # whose own backward hook never fires, and a converted point (hook_z, hook_q ...)
                # cannot be backfilled, so layer 0's site gradient would be lost without it.
                gc = cache_activation_and_gradient(model, base, stash_base,
                                                   names_filter=[hooks.EMBED, *site_names, *extra])
            with torch.no_grad(), lean(at):
                sc = cache_activation_and_gradient(model, src, stash_src, names_filter=site_names,
                                                   compute_gradient=False)
            acts, grads = gc.activations, gc.gradients
            r_base = {lp: acts[hooks.resid_pre(lp)] for lp in resid_layers}
            g_pat = {lp: _zero_if_none(grads[hooks.pattern(lp)], acts[hooks.pattern(lp)])
                     for lp in attn_layers}
            eff = []
            for st in steps:
                name = site_names[st.layer]
                a_b, a_s = acts[name], sc.activations[name]
                delta = a_s - a_b
                if st.own == "exact_tail":
                    e = _exact_tail(model, st.layer, delta, r_base[last], capture.kwargs["block"],
                                    None, stash_base, idx, positions, b)
                elif st.own == "qk_exact":
                    e = _atp_star_qk_own(model, st.layer, site, a_s, r_base[st.layer],
                                         capture.kwargs[st.layer], g_pat[st.layer], positions, b)
                else:
                    e = _head_effect(delta, _zero_if_none(grads[name], a_b), site, positions)
                if st.downstream_qk:
                    e = e + _atp_star_z_downstream(model, st.layer, delta, r_base,
                                                   capture.kwargs, g_pat, positions, b,
                                                   st.downstream_qk)
                if st.tail_correction:
                    e = e + _exact_tail(model, st.layer, delta, r_base[last],
                                        capture.kwargs["block"], grads[hooks.resid_pre(last)],
                                        stash_base, idx, positions, b)
                eff.append(e.detach().float().cpu())
            effects.append(torch.stack(eff, dim=1))  # [b, L, H(, P)]
            base_vals.append(stash_base.value.float().cpu())
            src_vals.append(stash_src.value.float().cpu())

    delta = torch.cat(effects)  # [n, L, H(, P)]
    base_pp, src_pp = torch.cat(base_vals), torch.cat(src_vals)
    if not (torch.isfinite(base_pp).all() and torch.isfinite(src_pp).all()
            and torch.isfinite(delta).all()):
        raise ValueError(
            f"metric {metric.name!r} or its gradient is not finite on these prompts "
            f"(base {base_pp.tolist()[:4]}, source {src_pp.tolist()[:4]}); attribution cannot "
            "estimate effects. Check the answer positions/tokens the metric reads.")
    per_prompt = base_pp.reshape(-1, *([1] * (delta.ndim - 1))) + delta
    clean_pp, corrupt_pp = (src_pp, base_pp) if direction == "denoise" else (base_pp, src_pp)
    pp = metric.per_prompt_values
    meta = dict(atp_star=atp_star, exact_tail=tail, n_prompts=n, batch_size=bs,
                passes=ATTRIBUTION_COST,
                plan=[dict(layer=st.layer, own=st.own, downstream_qk=list(st.downstream_qk),
                           tail_correction=st.tail_correction) for st in steps])
    return PatchResult(
        values=per_prompt.mean(0), clean=clean_pp.mean(), corrupt=corrupt_pp.mean(),
        direction=direction, method="attribution", site=site, positions=positions,
        per_prompt=per_prompt if pp else None, clean_per_prompt=clean_pp if pp else None,
        corrupt_per_prompt=corrupt_pp if pp else None, meta=meta)


def _zero_if_none(g: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if g is None else g
