"""Phase-2 components: the loop-back decomposed, margin widening and RefineScore.

Shapes: ``N`` Phase-2 query rows (one per example and answer step), ``H`` heads, ``S`` key
positions, ``K`` shortlist keys of a row (padded), ``D`` = d_model. A Phase-2 query position is
``answer_pos - 1``: the position whose logits predict the answer label. ``A[n, h, s]`` is the
head's attention row; ``T``/``M`` the shortlist positions (keys ``<= q``) holding one of the
example's target / near-miss tokens, ``SL`` all its shortlist positions.

* ``shortlist_share = sum_{s in SL} A[n, h, s]`` in [0, 1]: how much the head re-reads the
  shortlist at all.
* ``key_preference = (a_T - a_M) / (a_T + a_M)`` in [-1, 1], with ``a_T = mean_{s in T} A`` and
  ``a_M = mean_{s in M} A`` the mean attention *per entry*: count-balanced (a head uniform over
  the shortlist scores 0 whatever the numbers of targets and near-misses), independent of the
  share, and equal to ``tanh(Delta / 2)`` where ``Delta = log a_T - log a_M`` is the difference
  of the (log-mean-exp) pre-softmax QK logits of the two groups, so it is the QK logit difference
  squashed onto [-1, 1]. Undefined (left out of the mean) for a row without a target or without
  a near-miss entry.
* ``ov_copy``: what the head does with the entries it reads. The write it takes from shortlist
  key ``s`` is ``A[n, h, s] v[s, h] @ W_O[h]`` (``v`` its value vector; ``z = sum_s A v``), and
  its own-label effect ``e[n, s, h] = n(v[s, h] @ W_O[h]) . (W_U[:, tok(s)] - mean_{s' in SL}
  W_U[:, tok(s')])``: the direct effect, through the final norm as the run scaled it, on the
  logit of the label at ``s`` relative to the shortlist's labels. ``ov_copy = sum_{s in SL} A e /
  sum_{s in SL} A``, the attention-weighted mean: > 0 the head copies what it reads, < 0 it
  suppresses it (logits per unit of attention; NaN where a model gives no per-head ``W_O``,
  and ``loopback`` then takes ``|key_preference|``).
* ``loopback = shortlist_share * key_preference * sign(ov_copy)`` in [-1, 1]: re-reading the
  shortlist, selectively, in the direction the OV circuit turns into margin. A head attending to
  target entries and copying them scores +1; one attending to near-miss entries and suppressing
  them scores +1 too; a uniform head, or one that never looks, scores 0; one that attends to
  targets and suppresses them (or to near-misses and copies them) scores -1.
* ``margin_widening``: the head's direct effect on the target-vs-near-miss logit margin,
  ``(norm_scale(w, x) @ (W_U[:, t] - mean_m W_U[:, m]))``: its write ``w`` [N, H, D] passed through
  the final norm *as that run scaled it* (``final_norm_linear``), dotted with the unembedding
  difference of the target token ``t`` predicted at that step and the example's near-miss tokens
  (their mean: "averaged over near-misses"; the vocabulary mean when an example has none, as the
  task metric does). Summed over every residual component, these direct effects add up to the
  metric's logit margin (up to the unembedding bias).
* ``refine_score = margin_widening * max(loopback, 0)``: high only when the head widens the margin
  *and* gets there by re-reading the shortlist selectively, whichever of the two ways (copying
  targets, suppressing near-misses). A head that widens the margin from elsewhere (the note) or
  reads the shortlist uniformly scores 0; a head that narrows the margin while re-reading scores
  below 0. (Rejected: the former ``(1 + mass_T - mass_M) / 2 * margin_widening`` gate, >= 0.3 for
  every head on the shipped teacher, so the ranking was margin_widening's (Spearman 0.99), and
  its count-confounded mass difference was negative even for a uniform head.)
* ``mechanism``: "copy" (``ov_copy > 0``) or "suppress" (``< 0``) for a head with
  ``margin_widening > 0`` and ``loopback >= MECHANISM_MIN_LOOPBACK``, else "-".

Final norm (``final_norm_linear``), with ``x`` [N, D] the residual entering the final norm at the
query position (``hooks.FINAL_NORM_IN``) and ``g`` the norm's gain (its weight; ``1 + weight``
for Gemma's RMSNorm):

* RMSNorm: ``w * g / sqrt(mean(x^2) + eps)``;
* LayerNorm: ``(w - mean(w)) * g / sqrt(var(x) + eps)`` (the bias is not part of any head's write).

The norm's input is the sum of all components' writes, so this is the exact linearisation of the
final norm around that run (the "frozen scale" of direct logit attribution). Logits a model caps
after the unembedding (Gemma 2's ``tanh`` soft-cap) are taken before the cap: the margin is then
the pre-cap one, which the cap shrinks monotonically.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

MECHANISM_MIN_LOOPBACK = 0.1  # below it a head's re-reading is too weak to name a mechanism


def shortlist_share(rows: Float[Tensor, "N H S"], shortlist_keys: Float[Tensor, "N S"]
                    ) -> Float[Tensor, "N H"]:
    """Attention mass on the shortlist positions."""
    return torch.einsum("nhs,ns->nh", rows.float(), shortlist_keys.float())


def key_preference(rows: Float[Tensor, "N H S"], target_keys: Float[Tensor, "N S"],
                   near_keys: Float[Tensor, "N S"]) -> tuple[Float[Tensor, "N H"],
                                                              Bool[Tensor, " N"]]:
    """``(a_T - a_M) / (a_T + a_M)`` per row and head (module docstring), and which rows have
    both a target and a near-miss entry (the others are 0 here and must be left out)."""
    t, m = target_keys.float(), near_keys.float()
    n_t, n_m = t.sum(-1), m.sum(-1)  # [N]
    valid = (n_t > 0) & (n_m > 0)
    a_t = torch.einsum("nhs,ns->nh", rows.float(), t) / n_t.clamp(min=1)[:, None]
    a_m = torch.einsum("nhs,ns->nh", rows.float(), m) / n_m.clamp(min=1)[:, None]
    pref = (a_t - a_m) / (a_t + a_m).clamp(min=1e-30)
    return torch.where(valid[:, None], pref, torch.zeros_like(pref)), valid


def own_label_effects(scaled_key_writes: Float[Tensor, "N K H D"],
                      label_dirs: Float[Tensor, "N K D"]) -> Float[Tensor, "N K H"]:
    """``e[n, k, h] = scaled_key_writes[n, k, h] . label_dirs[n, k]`` with ``label_dirs`` the
    shortlist-centred unembedding column of the label at key ``k``."""
    return torch.einsum("nkhd,nkd->nkh", scaled_key_writes.float(), label_dirs.float())


def ov_copy(rows_at_keys: Float[Tensor, "N H K"], effects: Float[Tensor, "N K H"],
            valid_keys: Bool[Tensor, "N K"]) -> Float[Tensor, "N H"]:
    """``sum_k A e / sum_k A`` over the row's valid shortlist keys (0 for a row without any)."""
    a = rows_at_keys.float() * valid_keys[:, None, :].float()
    num = torch.einsum("nhk,nkh->nh", a, effects.float())
    return num / a.sum(-1).clamp(min=1e-30)


def aligned_loopback(share: Tensor, preference: Tensor, copy: Tensor) -> Tensor:
    """``shortlist_share * key_preference * sign(ov_copy)`` (module docstring); where
    ``ov_copy`` is unknown (NaN: no per-head ``W_O``), ``shortlist_share * |key_preference|``:
    selective re-reading either way, the margin deciding the sign."""
    known = share * preference * torch.sign(copy.nan_to_num(0.0))
    return torch.where(copy.isnan(), share * preference.abs(), known)


def final_norm(model: Any) -> tuple[str, Tensor, float]:
    """``(kind, gain [D], eps)`` of the model's final norm; kind "rms" or "ln".

    ``gain`` is the scale the norm applies: its weight, or ``1 + weight`` for an RMSNorm that
    stores the offset (Gemma, Gemma 2), told apart by running the module on a probe.
    Raises ``ValueError`` for a norm this module cannot linearise."""
    return norm_params(model, getattr(model, "ln_final", None), "the final norm")


def norm_params(model: Any, norm: Any, what: str) -> tuple[str, Tensor, float]:
    """``final_norm``'s ``(kind, gain, eps)`` for any of the model's norms (``what`` names it
    in errors), e.g. Gemma 2's post-attention norms (``hooks.post_norm``)."""
    kind = str(getattr(model.cfg, "normalization_type", "") or "").upper()
    inner = getattr(norm, "original_component", norm)
    weight = getattr(inner, "weight", None)
    eps = getattr(inner, "variance_epsilon", getattr(inner, "eps", getattr(model.cfg, "eps", None)))
    if kind.startswith("RMS"):
        k = "rms"
    elif kind.startswith("LN"):
        k = "ln"
    else:
        raise ValueError(f"scoring needs {what}'s scale; the model's normalization_type is "
                         f"{kind or None!r} (expected RMS or LN).")
    if weight is None or eps is None:
        raise ValueError(f"scoring: {what} exposes no weight/eps ({type(inner).__name__}); "
                         "cannot reproduce its scale.")
    gain = weight.detach()
    if k == "rms":
        gain = _rms_gain(inner, gain, float(eps))
    return k, gain, float(eps)


_OFFSET: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # norm -> 1 + weight?


def _rms_gain(norm: Any, weight: Tensor, eps: float) -> Tensor:
    """``weight`` or ``1 + weight``, whichever the RMSNorm module ``norm`` applies. Which form a
    module has is probed once (the distillation signals ask every step, of a student whose
    weight changes); the gain is then read from the current weight."""
    if norm not in _OFFSET:
        probe = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            theirs = norm(probe.to(weight.device, weight.dtype)).float().cpu()
        unit = probe * (probe.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
        errs = [float((unit * g.float().cpu() - theirs).abs().max())
                for g in (weight, 1 + weight.float())]
        _OFFSET[norm] = errs[1] < errs[0]
    return (1 + weight.float()).to(weight.dtype) if _OFFSET[norm] else weight


def final_norm_linear(writes: Float[Tensor, "N H D"], x: Float[Tensor, "N D"], kind: str,
                      weight: Float[Tensor, " D"], eps: float) -> Float[Tensor, "N H D"]:
    """Each write through the final norm as the run scaled it (module docstring); any norm whose
    input ``x`` is the sum of the writes (Gemma 2's post-attention norm over its heads, too)."""
    x = x.float()
    w = writes.float()
    g = weight.float().to(w.device)
    if kind == "rms":
        scale = (x.pow(2).mean(-1) + eps).rsqrt()  # [N]
        return w * g * scale[:, None, None]
    xc = x - x.mean(-1, keepdim=True)
    scale = (xc.pow(2).mean(-1) + eps).rsqrt()
    return (w - w.mean(-1, keepdim=True)) * g * scale[:, None, None]


def apply_final_norm(x: Float[Tensor, "N D"], kind: str, weight: Tensor, eps: float,
                     bias: Tensor | None = None) -> Float[Tensor, "N D"]:
    """The final norm itself (to check ``final_norm`` against the model's own module)."""
    out = final_norm_linear(x[:, None, :], x, kind, weight, eps)[:, 0]
    return out if bias is None else out + bias.float().to(out.device)


def margin_widening(scaled_writes: Float[Tensor, "N H D"], margin_dir: Float[Tensor, "N D"]
                    ) -> Float[Tensor, "N H"]:
    """``scaled_writes[n, h] . margin_dir[n]`` with ``margin_dir = W_U[:, t] - mean W_U[:, m]``."""
    return torch.einsum("nhd,nd->nh", scaled_writes.float(), margin_dir.float())


def refine_score(loopback_: Tensor, margin: Tensor) -> Tensor:
    """``margin_widening * max(loopback, 0)`` (module docstring)."""
    return margin * loopback_.clamp(min=0)


def mechanism(loopback_: Any, margin: Any, copy: Any) -> list[str]:
    """"copy" / "suppress" / "-" per head (module docstring); array-likes of equal length."""
    out = []
    for lb, mw, ov in zip(loopback_, margin, copy, strict=True):
        named = mw > 0 and lb >= MECHANISM_MIN_LOOPBACK and ov == ov and ov != 0
        out.append(("copy" if ov > 0 else "suppress") if named else "-")
    return out
