"""Attribution patching of attention heads: gradient estimates of every head's patching effect.

A head's activation ``a`` at ``site`` is patched from the *base* run to the *source* run
(denoise: base = corrupt, source = clean; noise: base = clean, source = corrupt). Every estimator
returns ``values = metric(base) + delta`` (mean over prompts), an estimate of the metric *after*
patching, directly comparable with the exact sweep's ``values``. ``estimator=`` selects one;
``docs/attribution.md`` gives the evidence for each on a 30-layer model. Cost is in
pass-equivalents per prompt: one prompt through the whole model; a backward counts 2
(``meta["pass_equivalents"]`` is the total for the prompts given, ``meta["seconds"]`` the time).

* ``"atp"`` (plain attribution; Nanda 2023, Syed et al. 2023), the cheapest::

      delta(head) = sum_{pos, d} (a_source - a_base)[pos, head, d] * dm/da_base[pos, head, d]

  Cost 4 (base forward with gradients, source forward, one backward).

* ``"block"`` (the default for screening): the head's own block completed exactly, the rest
  linear. The patched head's write ``dr = (z_source - z_base) @ W_O[head]`` enters the block's
  MLP exactly, and the change of the block's output is dotted with the base gradient there::

      delta(head) = g_l . [dr + MLP_l(r_mid + dr) - MLP_l(r_mid)],   g_l = dm/d resid_post(l)

  (``MLP_l`` includes its norm; parallel attention/MLP blocks have no MLP after the head, so the
  estimate is plain AtP there. A block that normalises the attention and MLP outputs before the
  residual add, Gemma 2's, is completed through those norms too: ``dr = n_attn(a + dz W_O) -
  n_attn(a)`` around the base attention output ``a``, and ``MLP_l`` ends in ``n_mlp``.) For
  sites q/k/v/pattern the head's attention is first recomputed exactly with the patched
  activation (own softmax exact), then the same. Why: on SmolLM2 the
  linearised MLP right after a head answers its write with a large opposite response that the
  exact MLP does not give (L16H0: +2.5 of linear cancellation, AtP -0.14 vs exact -4.18; this
  estimator -2.38). Cost, site z: 4 + H * s_mlp with one MLP call per head and layer (the MLP
  being a share ``s_mlp`` of a block; rows are position-wise, so ``positions="each"`` costs the
  same), or, from ``2 d_model / H`` positions per call on, 4 + s_mlp ((2k + 1) + k d_model / N) /
  (k + 1) with all heads at once (``head_mlp``: virtual weights, N positions per call, k input
  projections): independent of H in FLOPs. Other sites: 4 + C * (s_attn + s_mlp) (C copies).

* ``"qk"`` (AtP*'s Q/K fix, Kramar et al. 2024 section 3.1.1; ``atp_star=True``): the effect of
  the patch on attention logits taken as it is and the softmax recomputed exactly, the rest
  linear. Sites q/k: the head's own pattern ``sum (P(q_source) - P_base) * dm/dP``. Site z: the
  head's direct residual write enters every later layer's queries and keys exactly, and its
  linearisation is swapped out::

      delta*(head) = delta(head) + sum_{l' > l} [ (P_l'(r_l' + dr) - P_l'(r_l')) . dm/dP_l'
                                                  - dr . d/dr (P_l'(r) . dm/dP_l') ]

  Cost: 4 + (H * pairs * s_attn + (L - 1) * 2 s_attn) / L with ``pairs`` = L(L-1)/2 (site z):
  it grows with heads times layers squared. Optional exact tail (``exact_tail=True``; default
  on only for the legacy ``atp_star=True``): the last block and the readout evaluated exactly
  for each head's direct write, + H * L last-block calls / L.

* ``"graddrop"`` (AtP*'s GradDrop, Kramar et al. 2024 section 3.1.2): plain AtP with the gradient
  through each layer's residual contribution (attention and MLP outputs of block ``l'``) zeroed,
  one estimate per ``l'``; the score is their mean magnitude, so paths that cancel in plain AtP
  no longer hide each other::

      |delta_GD(head)| = 1/(L-1) sum_{l'} | AtP with block l' dropped from the backward |

  The sign is that of the largest single-``l'`` estimate. Defined on the prompt mean (no
  per-prompt values). Cost: 2 + 2 (L + 1).

* ``"atp*"``: both fixes (``"qk"``'s correction added to every GradDrop term). Cost: the sum.

* ``"ig"`` (integrated gradients along the clean-corrupt path, as EAP-IG, Hanna et al. 2024): the
  token embeddings interpolated ``e(alpha) = e_base + alpha (e_source - e_base)`` and the site
  gradient averaged over ``m = ig_steps`` midpoints ``alpha_k = (k + 1/2) / m``::

      delta(head) = (a_source - a_base) . mean_k dm/da(alpha_k)

  The path is the same for both directions (reversed), so noise and denoise estimates are
  mirror images: it cannot see that breaking one head of a circuit (noise) costs more than
  restoring it (denoise). Cost: 2 + 3 m.

Every estimator also returns ``meta["write_scale"]`` (per cell, mean over prompts): the size of
the patch relative to what it perturbs (site z: ``|dr| / |resid_mid|`` per position, the block
input for parallel blocks, ``hooks.resid_mid_of``; q/k/v:
``|a_source - a_base| / |a_base|``; pattern: total variation of the row). The nonlinear error of
an estimate grows with it; ``attribution+exact`` uses it as the unit of its error bound.

Metrics: a ``PromptMetric`` (``circuitkit.metrics``). A metric without per-prompt values (a
wrapped scalar callable) repeats its scalar ``m`` for every prompt; the objective differentiated
is the sum of per-prompt values, ``n * m``, so per-prompt estimates are ``n`` times each prompt's
share and their mean is ``m + sum_b delta_b``: the same formula, no special case (such a metric
runs all prompts in one batch).

The hybrid (an estimator, then exact verification) lives in ``patching/api.py``.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import einops
import torch
from einops import einsum
from jaxtyping import Float, Int
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric, as_metric
from circuitkit.patching import head_mlp, shortcuts
from circuitkit.patching.inputs import (
    DIRECTIONS,
    POSITIONS,
    NoGradientError,
    check_gradient,
    check_metric_prompts,
    check_tokens,
    checked_metric,
    choice,
    no_gradient_message,
)
from circuitkit.patching.plan import (
    block_flop_shares,
    block_screen_passes,
    head_mlp_pays,
    receiver_attn_passes,
)
from circuitkit.patching.results import PatchResult
from circuitkit.patching.sweep import auto_rows

ATP_STAR_SITES = ("z", "q", "k")
ATTRIBUTION_COST = "4 pass-equivalents per prompt (2 forwards + 1 backward, a backward counting 2)"
# Sequences per attention-layer call of the AtP* correction (bounds its memory).
ATP_STAR_CHUNK = 2048
# Sequences per last-block + unembedding call of the exact tail (logits are [n, pos, vocab]).
EXACT_TAIL_CHUNK = 512
ESTIMATORS = ("atp", "block", "qk", "graddrop", "atp*", "ig")
# What ``attribution+exact`` screens with by default: see the module docstring and
# docs/attribution.md for the evidence.
SCREENING_ESTIMATOR = "block"
IG_STEPS = 4
# Rows (positions x copies) per MLP call of the block estimator (bounds [rows, d_mlp] memory).
MLP_ROW_CHUNK = 8192
# Positions on which the block estimator's all-heads MLP formula is checked against the module.
CHECK_ROWS = 8


# --- helpers ---------------------------------------------------------------------------------


def _progress(it: Sequence[Any], on: bool, desc: str):
    if not on:
        return it
    from circuitkit._progress import tqdm

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
        if not v.requires_grad and logits.requires_grad:
            # no gradient reaches the logits (.item(), numpy, .detach(), an argmax): every
            # first-order estimate would be 0. (A PromptMetric built by hand is only known here.)
            raise NoGradientError(no_gradient_message(self.metric.name, "attribution"))
        if not v.requires_grad:  # a run without gradients (the source run): its value only
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


def _copy_masks(n_heads: int, seq: int, positions: str, device: Any,
                dtype: torch.dtype = torch.float32) -> Float[Tensor, "c pos h"]:
    """One 0/1 mask per patched cell: head h at every position ("all") or at one ("each")."""
    eye_h = torch.eye(n_heads, device=device, dtype=dtype)
    if positions == "all":
        return einops.repeat(eye_h, "c h -> c p h", p=seq).contiguous()
    eye_p = torch.eye(seq, device=device, dtype=dtype)
    return einops.rearrange(eye_h[:, None, None, :] * eye_p[None, :, :, None],
                            "ch cp p h -> (ch cp) p h")


def _atp_star_qk_own(model, layer, site, a_src, r_base, kwargs, g_pat, positions,
                     batch) -> Tensor:
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


def _head_writes(model: Any, layer: int, dz: Tensor, a_raw: dict[int, Tensor] | None = None
                 ) -> Float[Tensor, "b pos h d_model"]:
    """Each head's residual-stream write: ``dz[:, :, h] @ W_O[h]``; on a block with a
    post-attention norm ``n`` (Gemma 2), ``n(a + dz_h W_O[h]) - n(a)`` with ``a`` the base run's
    attention output (``a_raw[layer]``, [b, pos, d_model])."""
    W_O = model.blocks[layer].attn.W_O.detach()  # [h, d_head, d_model]
    return _residual_write(model, layer, einops.einsum(dz, W_O, "b p h d, h d m -> b p h m"),
                           a_raw)


def _residual_write(model: Any, layer: int, dr: Float[Tensor, "b pos c d_model"],
                    a_raw: dict[int, Tensor] | None) -> Float[Tensor, "b pos c d_model"]:
    """Attention-output changes ``dr`` as the residual stream receives them: unchanged, or
    through block ``layer``'s post-attention norm around the base output ``a_raw[layer]``."""
    post = hooks.post_norm(model, layer, "attn")
    if post is None:
        return dr
    if a_raw is None or layer not in a_raw:
        raise RuntimeError(f"block {layer} has a post-attention norm: its writes need the base "
                           "attention output (hooks.attn_module_out) kept in the run.")
    a = a_raw[layer].detach().to(dr.dtype)
    with torch.no_grad():
        return post(a[:, :, None] + dr) - post(a)[:, :, None]


def _raw_attn_names(model: Any) -> list[str]:
    """The attention modules' own outputs ``_head_writes`` needs (post-norm blocks only)."""
    return [hooks.attn_module_out(lay) for lay in range(len(model.blocks))
            if hooks.post_norm(model, lay, "attn") is not None]


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


# --- the block estimator ------------------------------------------------------------------------


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


def _relative(num: Tensor, den: Tensor) -> Tensor:
    return num / den.clamp_min(1e-6 * float(den.abs().max().clamp_min(1e-30)))


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
            warnings.warn("block estimator: the all-heads MLP formula (patching/head_mlp.py) does "
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
    return eff_all if positions == "all" else einops.rearrange(eff_all, "b (h p) -> b h p",
                                                               p=seq)


def _site_scale(delta: Tensor, a_base: Tensor, site: str, positions: str) -> Tensor:
    """Write scale of sites q/k/v (|delta| / |a_base| per position) and pattern (total variation
    of the query row): ``[b, h]`` or ``[b, h, pos]``."""
    if site == "pattern":  # [b, h, q, k]
        r = delta.abs().sum(-1) / 2
        return r.mean(-1) if positions == "all" else r
    r = _relative(delta.norm(dim=-1), a_base.norm(dim=-1))  # [b, p, h]
    return r.mean(1) if positions == "all" else r.transpose(1, 2)


def _z_scale(model, layer, dz, r_mid, positions, a_raw) -> Tensor:
    dr = _head_writes(model, layer, dz, a_raw)
    r = _relative(dr.norm(dim=-1), r_mid.norm(dim=-1)[:, :, None])
    return r.mean(1) if positions == "all" else r.transpose(1, 2)


# --- forward runs that keep activations in the autograd graph ------------------------------------


def _grad_run(model: Any, tokens: Tensor, stash: _MetricStash, keep: Sequence[str],
              embed: Tensor | None = None, extra: Sequence[tuple[str, Callable]] = ()
              ) -> tuple[Tensor, dict[str, Tensor]]:
    """Forward of ``tokens`` (token embedding replaced by ``embed`` if given) keeping the
    activations at ``keep``; returns the objective (``stash``: sum of per-prompt metrics) and
    them, for ``torch.autograd.grad`` (parameters' ``.grad`` are left alone)."""
    kept: dict[str, Tensor] = {}

    def keep_hook(name: str) -> Callable:
        def f(t: Tensor, hook: Any) -> Tensor:
            kept[name] = t
            return t
        return f

    def emb(t: Tensor, hook: Any) -> Tensor:
        x = t if embed is None else embed
        # frozen weights: the graph must still start here for activation gradients
        return x if x.requires_grad else x.detach().requires_grad_(True)

    fwd = [(hooks.EMBED, emb)] + [(n, keep_hook(n)) for n in keep] + list(extra)
    with torch.enable_grad(), model.hooks(fwd_hooks=fwd):
        obj = stash(model(tokens))
    return obj, kept


def _grads(obj: Tensor, kept: dict[str, Tensor], names: Sequence[str], retain: bool
           ) -> list[Tensor]:
    got = torch.autograd.grad(obj, [kept[n] for n in names], retain_graph=retain,
                              allow_unused=True)
    return [torch.zeros_like(kept[n]) if g is None else g for n, g in zip(names, got, strict=True)]


def _plain_run(model: Any, tokens: Tensor, stash: _MetricStash, names: Sequence[str]
               ) -> dict[str, Tensor]:
    """No-grad forward caching ``names``; ``stash`` records the metric."""
    want = set(names)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n in want)
        stash(logits)
    return {n: cache[n] for n in names}


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


# --- cost ----------------------------------------------------------------------------------------


def block_shares(model: Any, seq: int) -> tuple[float, float]:
    """FLOP shares (attention, MLP) of one block per token (attention scores over ``seq``/2 keys
    on average): what one attention or one MLP call costs, in blocks."""
    f = hooks.facts(model)
    d_mlp = int(getattr(model.cfg, "d_mlp", None) or 4 * f.d_model) if hooks.has_mlp(model) \
        else 0
    return block_flop_shares(f.d_model, d_mlp, f.d_head, f.n_heads, f.n_kv_heads, seq,
                             gated=bool(getattr(model.cfg, "gated_mlp", False)))


def estimator_passes(model: Any, estimator: str, site: str, positions: str, seq: int,
                     ig_steps: int = IG_STEPS, exact_tail: bool = False,
                     batch: int | None = None) -> float:
    """Pass-equivalents per prompt of ``estimator`` (formulas in the module docstring), with
    ``batch`` prompts per forward where the cost depends on it ("block", site z)."""
    f = hooks.facts(model)
    L, s_attn, s_mlp = f.n_layers, *block_shares(model, seq)
    copies = f.n_heads_at(site) * (seq if positions == "each" else 1)
    if estimator == "atp":
        return 4.0
    if estimator == "block":
        return block_screen_passes(f.n_heads, copies, site, s_attn, s_mlp,
                                   positions_per_call=batch and batch * seq,
                                   d_model=f.d_model if head_mlp.covers(model) else None,
                                   gated=bool(getattr(model.cfg, "gated_mlp", False)))
    if estimator == "ig":
        return 2.0 + 3.0 * ig_steps
    graddrop = 2.0 + 2.0 * (L + 1)
    if estimator == "graddrop":
        return graddrop
    # Q/K fix: z: one attention call per head copy and (layer, later layer) pair, a VJP per
    # later layer; q/k: one attention call per copy per layer. Exact tail: a block per copy.
    if site == "z":
        qk = (copies * L * (L - 1) / 2 * s_attn + (L - 1) * 2 * s_attn) / L
    else:
        qk = copies * s_attn
    qk += copies if exact_tail else 0.0
    return 4.0 + qk + (graddrop - 2.0 if estimator == "atp*" else 0.0)


def resolve_estimator(estimator: str | None, atp_star: bool) -> str:
    """``estimator`` checked, or the legacy choice: ``"qk"`` for ``atp_star=True``, else
    ``"atp"``."""
    if estimator is None:
        return "qk" if atp_star else "atp"
    choice("estimator", estimator, ESTIMATORS)
    if atp_star and estimator not in ("qk", "atp*"):
        raise ValueError(f"atp_star=True selects AtP*'s Q/K fix (estimator 'qk'); it cannot be "
                         f"combined with estimator={estimator!r}. Pass one of the two.")
    return estimator


# --- public API ------------------------------------------------------------------------------


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


def missing_reruns(model: Any, estimator: str, site: str, tokens: Tensor) -> list[str]:
    """The one-layer re-runs (``"attn"``, ``"mlp"``) ``estimator`` needs at ``site`` that this
    model cannot do (``layer_reruns``); empty where it can run."""
    need = {"block": ("mlp",) if site == "z" else ("attn", "mlp"),
            "qk": ("attn",), "atp*": ("attn",)}.get(estimator, ())
    return [part for part in need if not layer_reruns(model, tokens)[part]] if need else []


def screening_estimator(model: Any, site: str, tokens: Tensor) -> str:
    """``SCREENING_ESTIMATOR`` where the model can run it, else plain ``"atp"`` (with a
    ``RuntimeWarning``): what ``attribution+exact`` and ``method="auto"`` screen with."""
    if not missing_reruns(model, SCREENING_ESTIMATOR, site, tokens):
        return SCREENING_ESTIMATOR
    warnings.warn(f"this architecture's layers cannot be re-run alone (attribution."
                  f"layer_reruns), so the screen is plain AtP instead of "
                  f"{SCREENING_ESTIMATOR!r}; the verification rule is the same.",
                  RuntimeWarning, stacklevel=3)
    return "atp"


def _agrees(got: Tensor, want: Tensor) -> bool:
    """Equal up to the rounding of ``want``'s dtype (a batch of two may take other kernels:
    bf16 differs in its last bits), relative to the largest value: a layout a re-run cannot
    reproduce is off by O(1) or fails outright."""
    tol = max(1e-3, 16 * torch.finfo(want.dtype).eps)
    err = float((got.float() - want.float()).abs().max())
    return err <= tol * float(want.float().abs().max()) + 1e-6


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
    estimator: str | None = None,
    ig_steps: int = IG_STEPS,
) -> PatchResult:
    """Estimate every head's patching effect by attribution; see the module docstring.

    Args:
        model: a TransformerBridge (eval mode).
        clean_tokens, corrupt_tokens: [batch, seq], aligned position by position.
        metric: a ``PromptMetric`` or any callable ``logits -> scalar | [batch]``
            (``circuitkit.metrics.as_metric``).
        direction: "denoise" (clean -> corrupt run) or "noise" (corrupt -> clean run).
        site: "z", "q", "k", "v" (k/v: KV heads under GQA) or "pattern".
        positions: "all" -> values [n_layers, n_heads]; "each" -> [n_layers, n_heads, seq]
            (for "pattern" the position is the query position).
        estimator: one of ``ESTIMATORS`` (default: "qk" with ``atp_star``, else "atp").
        atp_star: legacy switch for estimator "qk" (sites z, q, k), with the exact tail on.
        batch_size: prompts per forward/backward (default: all; a metric without per-prompt
            values always runs all prompts at once).
        exact_tail: estimators "qk"/"atp*", site z: evaluate the last block and the readout
            exactly for each head's direct write (default: on with ``atp_star`` only).
        ig_steps: interpolation steps ``m`` of estimator "ig".

    Returns:
        PatchResult, method "attribution"; ``values = metric(base) + delta`` (mean over
        prompts); ``meta``: estimator, pass_equivalents, seconds, write_scale, plan ("qk").
    """
    t_start = time.perf_counter()
    choice("direction", direction, DIRECTIONS)
    choice("site", site, hooks.PATCH_HEAD_SITES)
    choice("positions", positions, POSITIONS)
    est = resolve_estimator(estimator, atp_star)
    if isinstance(ig_steps, bool) or not isinstance(ig_steps, int) or ig_steps < 1:
        raise ValueError(f"ig_steps={ig_steps!r}: expected a positive integer (interpolation "
                         "steps of estimator 'ig').")
    clean_tokens, corrupt_tokens = check_tokens(clean_tokens, corrupt_tokens, model)
    hooks.check_patchable(model, site, clean_tokens)
    f = hooks.facts(model)
    n, seq = clean_tokens.shape
    metric = as_metric(metric, n, seq, f.d_vocab_out)
    check_metric_prompts(metric, n)
    check_gradient(metric, "attribution")
    metric = checked_metric(model, clean_tokens, corrupt_tokens, metric, batch_size)
    qk = est in ("qk", "atp*")
    if qk and site not in ATP_STAR_SITES:
        raise NotImplementedError(
            f"estimator {est!r} (AtP*'s Q/K fix) corrects softmax effects for sites "
            f"{ATP_STAR_SITES}; site={site!r} acts linearly on its own head's output: use "
            "estimator 'atp', 'block', 'graddrop' or 'ig'.")
    if qk:
        try:
            hooks.check_patchable(model, "pattern", clean_tokens)
        except ValueError:
            raise ValueError(
                f"estimator {est!r} (AtP*'s Q/K fix) needs the gradient at the attention "
                "pattern, and this model's bridge fires hook_pattern after the attention ran "
                "(e.g. GPT-J), so that gradient is zero and the fix would do nothing: use "
                "estimator 'block' or 'atp'.") from None
    missing = missing_reruns(model, est, site, clean_tokens)
    if missing:
        raise ValueError(
            f"estimator {est!r} re-runs single layers ({' and '.join(missing)}) with the "
            "model's own modules, which this architecture's bridge does not allow (e.g. OPT's "
            "MLP is no module of its own, Bloom's needs the residual); use estimator 'atp', "
            "'ig' or 'graddrop'.")
    if est == "block" and not hooks.has_mlp(model):
        warnings.warn(f"estimator 'block': this model's blocks have no MLP (attention-only), so "
                      f"nothing after a head's write is run exactly: the estimate is "
                      f"{'plain AtP' if site == 'z' else 'the head attention exact, then linear'}"
                      ".", RuntimeWarning, stacklevel=2)
    if exact_tail and (site != "z" or not qk):
        raise NotImplementedError("exact_tail is implemented for site='z' with estimator 'qk' "
                                  "or 'atp*' only.")
    tail = bool(qk and site == "z" and (atp_star and estimator is None
                                        if exact_tail is None else exact_tail))
    steps = estimator_plan(f.n_layers, site, qk, tail) if qk else None
    device = next(model.parameters()).device
    bs = batch_size if (batch_size and metric.per_prompt_values) else n
    base_all, src_all = ((corrupt_tokens, clean_tokens) if direction == "denoise"
                         else (clean_tokens, corrupt_tokens))
    reads = metric.read_positions()

    effects, scales, base_vals, src_vals, gd_terms = [], [], [], [], []
    # No per-head hook_result einsum: nothing here reads it (the writes come from W_O).
    with shortcuts.attn_result_off(model):
        for start in _progress(range(0, n, bs), progress and n > bs, "attribution"):
            idx = torch.arange(start, min(start + bs, n))
            base, src = base_all[idx].to(device), src_all[idx].to(device)
            at = None if reads is None else reads[idx].to(device)
            stash_base, stash_src = _MetricStash(metric, idx, at), _MetricStash(metric, idx, at)
            args = (model, base, src, stash_base, stash_src, site, positions, at)
            if est in ("atp", "qk"):
                eff, scale = _batch_atp_qk(*args, steps, tail)
            elif est == "block":
                eff, scale = _batch_block(*args)
            elif est == "ig":
                eff, scale = _batch_ig(*args, ig_steps)
            else:  # graddrop, atp*: terms [b, L(dropped), L, H(, P)], mean over prompts later
                terms, scale = _batch_graddrop(*args)
                if est == "atp*":
                    # the Q/K correction (qk - plain) added to every GradDrop term
                    qk_eff, _ = _batch_atp_qk(*args, steps, tail)
                    terms = terms + (qk_eff - terms[:, -1])[:, None]
                gd_terms.append(terms)
                eff = terms[:, -1]  # nothing dropped after the last layer: plain (+ Q/K fix)
            effects.append(eff.detach().float().cpu())
            scales.append(scale.detach().float().cpu())
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
    pp = metric.per_prompt_values
    if gd_terms:  # GradDrop: magnitudes of prompt-mean estimates; no per-prompt values
        mean_terms = torch.cat([t.detach().float().cpu() for t in gd_terms]).mean(0)
        delta_mean, pp = _graddrop_combine(mean_terms), False
    else:
        delta_mean = delta.mean(0)
    per_prompt = base_pp.reshape(-1, *([1] * (delta.ndim - 1))) + delta
    clean_pp, corrupt_pp = (src_pp, base_pp) if direction == "denoise" else (base_pp, src_pp)
    meta = dict(**dict(metric.labels), model=str(getattr(model.cfg, "model_name", "")),
                metric=metric.name,
                estimator=est, atp_star=qk, exact_tail=tail, n_prompts=n, batch_size=bs,
                passes=ATTRIBUTION_COST if est == "atp" else f"see estimator {est!r}",
                pass_equivalents=n * estimator_passes(model, est, site, positions, seq,
                                                      ig_steps, tail, batch=bs),
                seconds=time.perf_counter() - t_start,
                write_scale=torch.cat(scales).mean(0).tolist())
    if est == "ig":
        meta["ig_steps"] = ig_steps
    if steps is not None:
        meta["plan"] = [dict(layer=st.layer, own=st.own, downstream_qk=list(st.downstream_qk),
                             tail_correction=st.tail_correction) for st in steps]
    res = PatchResult(
        values=base_pp.mean() + delta_mean, clean=clean_pp.mean(), corrupt=corrupt_pp.mean(),
        direction=direction, method="attribution", site=site, positions=positions,
        per_prompt=per_prompt if pp else None, clean_per_prompt=clean_pp if pp else None,
        corrupt_per_prompt=corrupt_pp if pp else None, meta=meta)
    res.warn_if_degenerate()
    return res


# --- one batch of prompts, per estimator ----------------------------------------------------------
# Each returns per-prompt effects [b, L, H] ([b, L, H, P] for positions "each") and the write
# scale of the same shape; the stashes record the base and source metrics.


def _lean(model: Any, at: Tensor | None) -> Any:
    """With known read positions: the last MLP and the unembedding computed there only."""
    return contextlib.nullcontext() if at is None else shortcuts.reads_only(model, at)


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
                            capture.kwargs[layer], g_post[layer], positions, base.shape[0],
                            a_raw)
            s = _site_scale(a_s - a_b, a_b, site, positions)
        eff.append(e)
        scale.append(s)
    return torch.stack(eff, dim=1), torch.stack(scale, dim=1)


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
            for acc, g in zip(mean_grad, _grads(obj, kept, site_names, retain=False),
                              strict=True):
                acc += g / ig_steps
    a_raw = {hooks.layer_of(n): b_acts[n] for n in raws}
    eff, scale = [], []
    for layer, name in enumerate(site_names):
        delta = s_acts[name] - b_acts[name]
        eff.append(_head_effect(delta, mean_grad[layer], site, positions))
        scale.append(_z_scale(model, layer, delta, b_acts[mids[layer]], positions, a_raw)
                     if site == "z" else _site_scale(delta, b_acts[name], site, positions))
    return torch.stack(eff, dim=1), torch.stack(scale, dim=1)


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
        obj, kept = _grad_run(model, base, stash_base, [*site_names, *mids, *raws],
                              extra=gates)
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


def _zero_if_none(g: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if g is None else g


# --- edges ---------------------------------------------------------------------------------------
# An edge (sender s, receiver r, input i) is estimated as its sender's write dotted with the
# gradient of the metric at the receiver's own copy of the residual at that input
# (``hooks.q_input`` ..., under ``shortcuts.split_qkv_inputs``), summed over positions:
#
#     eap:                 delta(s, r, i) = sum_{pos, d} delta_s[pos, d] * dm/dx_{r,i}[pos, d]
#     eap-ig-inputs:       the gradient averaged over m runs with the token embeddings
#                          interpolated base -> source, alpha_k = (k + 1/2) / m (Hanna et al. 2024)
#     eap-ig-activations:  for the senders of layer a, the gradient averaged over m runs with
#                          layer a's attention output (the embeddings for "embed") interpolated
#                          base -> source, everything else the base run (Marks et al. 2024)
#     eap*:                the receiving head run exactly (AtP*'s QK fix at edge level, Kramar
#                          et al. 2024): delta(s, r, i) = sum_{pos, d} (z'_r - z_r) * dm/dz_r,
#                          z'_r the head's output with delta_s in its input i alone; the logits
#                          receiver as eap
#
# ``delta_s`` = source minus base write (a head's ``dz[:, :, h] @ W_O[h]``, the embeddings'
# ``resid_pre(0)`` difference); the logits' gradient is taken at the final residual. Gradients
# are those of the base run (denoise: corrupt), as for heads. Docs: docs/edges.md.

EDGE_ESTIMATORS = ("eap", "eap-ig-inputs", "eap-ig-activations", "eap*")
EDGE_IG_STEPS = 5
# What attribution+exact screens edges with by default: eap* ranks single edges closest to exact
# (benchmarks/edges.py): the nonlinearity of a q/k edge is the receiving head's softmax, which
# eap* computes and eap / EAP-IG linearise (docs/edges.md, "Which screen")
EDGE_SCREENING_ESTIMATOR = "eap*"


def edge_estimator_passes(estimator: str, ig_steps: int, n_sender_groups: int,
                          receiver_attn: float = 0.0) -> float:
    """Pass-equivalents per prompt of an edge estimator (a backward counts 2): eap 4 (the base
    run with gradients, the source run); eap-ig-inputs 2 + 3 m; eap-ig-activations 2 + 3 m per
    sender layer (the embeddings count as one); eap* 4 + ``receiver_attn``, the receiving
    layers' attention re-run per (sender, receiver layer) and input (``plan.receiver_attn_passes``).
    The split-input forward, each head's norm on its own residual copy, costs more than a plain
    one and is not counted."""
    if estimator == "eap":
        return 4.0
    if estimator == "eap*":
        return 4.0 + receiver_attn
    if estimator == "eap-ig-inputs":
        return 2.0 + 3.0 * ig_steps
    return 2.0 + 3.0 * ig_steps * n_sender_groups


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


def attribution_patch_edges(model: Any, clean_tokens: Tensor, corrupt_tokens: Tensor,
                            metric: PromptMetric, layout: Any, direction: str = "denoise",
                            estimator: str | None = None, ig_steps: int | None = None,
                            batch_size: int | None = None, progress: bool = True) -> Any:
    """Estimate every edge of ``layout`` (``sweep.EdgeLayout``) by ``estimator`` (see the
    comment above, docs/edges.md); an ``EdgeResult`` with ``method="attribution"``:
    ``values = metric(base) + delta`` (mean over prompts), ``meta``: estimator, ig_steps,
    pass_equivalents, seconds, write_scale (``|delta_s| / |x_r|``, mean over prompts and
    positions, per edge; None where no edge). Arguments are checked by ``api.patch_edges``."""
    from circuitkit.patching.results import EdgeResult

    t_start = time.perf_counter()
    est = estimator or EDGE_ESTIMATORS[0]
    choice("estimator", est, EDGE_ESTIMATORS)
    m = EDGE_IG_STEPS if ig_steps is None else ig_steps
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"ig_steps={ig_steps!r}: expected a positive integer (interpolation "
                         "steps of the eap-ig estimators).")
    L, n = layout.n_layers, clean_tokens.shape[0]
    n_s, n_r, n_i = len(layout.senders), len(layout.receivers), len(layout.inputs)
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
    device = next(model.parameters()).device
    bs = batch_size if (batch_size and metric.per_prompt_values) else n
    base_all, src_all = ((corrupt_tokens, clean_tokens) if direction == "denoise"
                         else (clean_tokens, corrupt_tokens))
    reads = metric.read_positions()
    if exact_receiver:
        f = hooks.facts(model)
        q_per_kv = f.n_heads // f.n_kv_heads
        block_arity = shortcuts.output_arity(model, base_all[:1].to(device))[0]
        max_rows = auto_rows(model, clean_tokens.shape[1])
    scores, scales, base_vals, src_vals = [], [], [], []
    # cells: for each receiver layer, the senders before it
    before = {la: [s for s, (sl, _) in enumerate(layout.senders) if sl < la]
              for la in [*recv_layers, L]}
    with shortcuts.attn_result_off(model):
        for start in _progress(range(0, n, bs), progress and n > bs, f"edges {est}"):
            idx = torch.arange(start, min(start + bs, n))
            base, src = base_all[idx].to(device), src_all[idx].to(device)
            at = None if reads is None else reads[idx].to(device)
            stash_base, stash_src = _MetricStash(metric, idx, at), _MetricStash(metric, idx, at)
            with _lean(model, at):
                b_acts = _plain_run(model, base, stash_base, plain)
                s_acts = _plain_run(model, src, stash_src, plain)
            delta = _sender_writes(model, layout.senders, b_acts, s_acts)  # [S, b, pos, d]
            b = base.shape[0]
            score = torch.full((b, n_s, n_r, n_i), float("nan"))
            scale = torch.full((n_s, n_r, n_i), float("nan"))
            for group in groups:
                grads = _edge_grads(model, base, stash_base, idx, at, grad_names, est, m, group,
                                    b_acts, s_acts, split=not exact_receiver)
                mine = [s for s, (sl, _) in enumerate(layout.senders)
                        if group is None or max(sl, -1) == group]
                layers = [*recv_layers, *([L] if logits else [])]
                # eap* re-runs each receiving layer's attention per sender: the long part
                for la in _progress(layers, progress and exact_receiver,
                                    f"eap* receiver layers, prompts {start}-{start + b - 1}"):
                    ss = [s for s in before[la] if s in mine]
                    if not ss:
                        continue
                    d = delta[ss]
                    x = b_acts[hooks.resid_pre(la) if la < L else hooks.resid_post(L - 1)]
                    rel = (d.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12)).mean((1, 2))
                    st = torch.tensor(ss)
                    if la == L:
                        g = grads[hooks.resid_post(L - 1)]
                        score[:, st, r_index[(L, -1)], 0] = einsum(
                            d, g, "s b p m, b p m -> b s").float().cpu()
                        scale[st, r_index[(L, -1)], 0] = rel.float().cpu()
                        continue
                    if exact_receiver:
                        effects = _receiver_effects(model, la, layout.inputs, x, d,
                                                    grads[hooks.z(la)], block_arity, max_rows)
                    for i, name in enumerate(layout.inputs):
                        units = layout.units(la, name)
                        if not units:
                            continue
                        rt = torch.tensor([r_index[(la, u)] for u in units])
                        if exact_receiver:
                            e = effects[name]
                            if name in hooks.KV_SITES:  # a KV head: its query heads' sum
                                e = einops.reduce(e, "b s (g r) -> b s g", "sum", r=q_per_kv)
                            e = e[:, :, units]
                        else:
                            g = grads[hooks.edge_input(name, la)][:, :, units]
                            e = einsum(d, g, "s b p m, b p h m -> b s h").float().cpu()
                        score[:, st[:, None], rt[None, :], i] = e
                        scale[st[:, None], rt[None, :], i] = rel.float().cpu()[:, None]
            scores.append(score)
            scales.append(scale)
            base_vals.append(stash_base.value.float().cpu())
            src_vals.append(stash_src.value.float().cpu())
    delta = torch.cat(scores)
    base_pp, src_pp = torch.cat(base_vals), torch.cat(src_vals)
    edge = ~torch.isnan(delta[0])
    if not (torch.isfinite(base_pp).all() and torch.isfinite(src_pp).all()
            and torch.isfinite(delta[:, edge]).all()):
        raise ValueError(f"metric {metric.name!r} or its gradient is not finite on these prompts "
                         f"(base {base_pp.tolist()[:4]}, source {src_pp.tolist()[:4]}); "
                         "attribution cannot estimate effects.")
    pp = metric.per_prompt_values
    per_prompt = base_pp[:, None, None, None] + delta
    clean_pp, corrupt_pp = (src_pp, base_pp) if direction == "denoise" else (base_pp, src_pp)
    scale = torch.stack(scales).mean(0)
    n_groups = len(groups) if est == "eap-ig-activations" else 1
    receiver_attn = receiver_attn_passes(
        block_shares(model, clean_tokens.shape[1])[0], L, n_i,
        sum(len(before[la]) for la in recv_layers)) if exact_receiver else 0.0
    meta = dict(**dict(metric.labels), model=str(getattr(model.cfg, "model_name", "")),
                metric=metric.name, estimator=est, n_prompts=n, batch_size=bs,
                pass_equivalents=n * edge_estimator_passes(est, m, n_groups, receiver_attn),
                seconds=time.perf_counter() - t_start,
                write_scale=[[[None if v != v else v for v in row] for row in mat]
                             for mat in scale.tolist()])
    if est.startswith("eap-ig"):
        meta["ig_steps"] = m
    return EdgeResult(
        values=base_pp.mean() + delta.mean(0), clean=clean_pp.mean(), corrupt=corrupt_pp.mean(),
        direction=direction, method="attribution", senders=layout.senders,
        receivers=layout.receivers, inputs=layout.inputs, n_layers=L,
        per_prompt=per_prompt if pp else None, clean_per_prompt=clean_pp if pp else None,
        corrupt_per_prompt=corrupt_pp if pp else None, meta=meta)


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
