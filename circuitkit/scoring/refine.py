"""Phase-2 components: the loop-back decomposed, margin widening and RefineScore. Definitions,
the columns built from them (issue 34's included) and the rejected alternatives: docs/scores.md.

Shapes: ``N`` Phase-2 query rows (``q = answer_pos - 1``), ``H`` heads, ``S`` key positions,
``K`` shortlist keys of a row (padded), ``D`` = d_model. ``A[n, h, s]``: the attention row;
``SL`` the shortlist keys ``<= q``, ``T``/``M`` those holding a target / near-miss token.

* ``shortlist_share = sum_{s in SL} A[s]``; ``key_preference = (a_T - a_M) / (a_T + a_M)``,
  ``a_T``/``a_M`` the mean attention per target / near-miss entry (count-balanced, in [-1, 1];
  undefined without both); ``loopback = shortlist_share * key_preference``.
* Per key, ``w_s = v[s] @ W_O[h]`` through the final norm (``n``): own-label effect ``e[s] =
  n(w_s) . (W_U[:, tok(s)] - mean_v W_U[:, v])``, margin effect ``m[s] = n(w_s) . (W_U[:, t] -
  mean_m W_U[:, m])``. ``ov_copy = sum_SL A e / sum_SL A``; ``refine_score = sum_SL A m`` (the
  shortlist's part of ``margin_widening``, the same sum over every key);
  ``refine_if_uniform = shortlist_share * mean_SL m``.
* ``margin_widening = n(w) . (W_U[:, t] - mean_m W_U[:, m])`` (the vocabulary mean without
  near-misses, as the task metric).
* ``mechanism``: for a head with ``refine_score > 0`` and at least ``MECHANISM_MIN`` of the
  largest, "copy" (``margin_from_targets >= margin_from_near_misses`` and ``refine_target_up >=
  refine_near_down``), "suppress" (both the other way), "retrieve" (they disagree); "-" else.
* The paper's form beside them (issue 47): ``refine_score_paper = E_rows[(Sim_shortlist -
  Sim_near) * <w, grad_x margin>]``, ``Sim_shortlist = shortlist_share``, ``Sim_near = sum_{s in
  M} A[s]`` (raw masses), ``grad_x margin`` the gradient of ``n(x) . (W_U[:, t] - mean_m W_U[:,
  m])`` w.r.t. the residual ``x`` entering the final norm, through the model's own norm module
  (its scale's derivative included: not ``margin_widening``'s frozen scale).
* The positional null of ``key_preference`` (issue 47): the head's mean attention at each
  (number of shortlist entries, entry index) over the rows, read as a row
  (``positional_null``); ``key_preference_positional_null`` is ``key_preference`` of that row
  with the row's own target / near-miss entries, ``key_preference_excess`` the difference.

Final norm (``final_norm_linear``), ``x`` [N, D] the residual entering it at ``q``
(``hooks.FINAL_NORM_IN``), ``g`` its gain (weight; ``1 + weight`` for Gemma's RMSNorm; 1 for
``LNPre``/``RMSPre``): RMSNorm ``w * g / sqrt(mean(x^2) + eps)``; LayerNorm ``(w - mean(w)) * g /
sqrt(var(x) + eps)`` (the bias is no head's); none ``w``. The exact linearisation around the run
(the frozen scale of direct logit attribution); the margin is the one before a soft-cap (Gemma 2),
which shrinks it monotonically.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from circuitkit.scoring.coarse import salient_mass

MECHANISM_MIN = 0.1  # a head's refine_score, relative to the largest, to name its mechanism
# ``sum_{s in SL} A[s]``: the attention mass on the keys given, as Phase 1's (coarse.salient_mass)
shortlist_share = salient_mass


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


def loopback(share: Tensor, preference: Tensor) -> Tensor:
    """``shortlist_share * key_preference`` (module docstring)."""
    return share * preference


def key_effects(scaled_key_writes: Float[Tensor, "N K H D"], directions: Float[Tensor, "N K D"]
                ) -> Float[Tensor, "N K H"]:
    """``scaled_key_writes[n, k, h] . directions[n, k]``: what the head takes from key ``k``,
    along a direction per key (own label: ``e``) or per row (the margin: ``m``, expanded)."""
    return torch.einsum("nkhd,nkd->nkh", scaled_key_writes.float(), directions.float())


def attended_sum(rows_at_keys: Float[Tensor, "N H K"], effects: Float[Tensor, "N K H"],
                 keys: Bool[Tensor, "N K"]) -> tuple[Float[Tensor, "N H"], Float[Tensor, "N H"]]:
    """``(sum_k A e, sum_k A)`` over the keys ``keys`` of each row: ``refine_score`` and its
    parts are the sum, ``ov_copy`` the sum over the mass (0 where there is no key)."""
    a = rows_at_keys.float() * keys[:, None, :].float()
    return torch.einsum("nhk,nkh->nh", a, effects.float()), a.sum(-1)


def uniform_sum(share: Float[Tensor, "N H"], effects: Float[Tensor, "N K H"],
                keys: Bool[Tensor, "N K"]) -> Float[Tensor, "N H"]:
    """``share * mean_k effects`` over the valid keys: ``refine_if_uniform``."""
    k = keys.float()
    mean = torch.einsum("nkh,nk->nh", effects.float(), k) / k.sum(-1).clamp(min=1)[:, None]
    return share.float() * mean


def final_norm(model: Any) -> tuple[str, Tensor, float]:
    """``(kind, gain [D], eps)`` of the model's final norm; kind "rms", "ln" or "none" (a model
    without normalization: the identity).

    ``gain`` is the scale the norm applies: its weight, or ``1 + weight`` for an RMSNorm that
    stores the offset (Gemma, Gemma 2), told apart by running the module on a probe; ones for a
    norm without weight (TransformerLens's ``LNPre`` / ``RMSPre``) and for "none".
    Raises ``ValueError`` for a norm this module cannot linearise."""
    return norm_params(model, getattr(model, "ln_final", None), "the final norm")


def norm_params(model: Any, norm: Any, what: str) -> tuple[str, Tensor, float]:
    """``final_norm``'s ``(kind, gain, eps)`` for any of the model's norms (``what`` names it
    in errors), e.g. Gemma 2's post-attention norms (``hooks.post_norm``)."""
    kind = str(getattr(model.cfg, "normalization_type", "") or "").upper()
    inner = getattr(norm, "original_component", norm)
    weight = getattr(inner, "weight", None)
    eps = getattr(inner, "variance_epsilon", getattr(inner, "eps", getattr(model.cfg, "eps", None)))
    ones = torch.ones(int(model.cfg.d_model), dtype=next(model.parameters()).dtype)
    if not kind and isinstance(inner, torch.nn.Identity):  # no normalization at all
        return "none", ones, 0.0
    if weight is None and kind in ("LNPRE", "RMSPRE"):  # normalises, scales by nothing
        weight = ones
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
    if kind == "none":
        return w
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


def margin_gradient(norm_module: Any, x: Float[Tensor, "N D"], margin_dir: Float[Tensor, "N D"]
                    ) -> Float[Tensor, "N D"]:
    """``d/dx [norm_module(x) . margin_dir]`` per row: autograd through the model's own final
    norm (the unembedding bias does not depend on ``x``)."""
    with torch.enable_grad():
        xg = x.detach().clone().requires_grad_(True)
        out = norm_module(xg)
        (grad,) = torch.autograd.grad((out.float() * margin_dir.float().to(out.device)).sum(), xg)
    return grad.float()


def paper_refine(share: Float[Tensor, "N H"], near_mass: Float[Tensor, "N H"],
                 writes: Float[Tensor, "N H D"], grad: Float[Tensor, "N D"]
                 ) -> Float[Tensor, "N H"]:
    """The paper's RefineScore of each row: ``(share - near_mass) * <w, grad>``."""
    return (share.float() - near_mass.float()) * torch.einsum("nhd,nd->nh", writes.float(),
                                                              grad.float())


def positional_null(at_entries: Float[Tensor, "R H K"], n_entries: Int[Tensor, " R"]
                    ) -> Float[Tensor, "R H K"]:
    """Each row replaced by the mean over the rows with as many entries of the attention at each
    entry index: what a head attending by entry order alone would do (0 past ``n_entries``)."""
    out = torch.zeros_like(at_entries, dtype=torch.float64)
    for n in n_entries.unique().tolist():
        rows = n_entries == n
        out[rows] = at_entries[rows].double().mean(0, keepdim=True)
    width = torch.arange(at_entries.shape[-1])[None, None, :]
    return (out * (width < n_entries[:, None, None])).to(at_entries.dtype)


def key_preference_null(at_entries: Float[Tensor, "R H K"], n_entries: Int[Tensor, " R"],
                        target_entries: Float[Tensor, "R K"], near_entries: Float[Tensor, "R K"]
                        ) -> tuple[Float[Tensor, "R H"], Float[Tensor, "R H"], Bool[Tensor, " R"]]:
    """``(key_preference, its positional null, rows where defined)`` of rows given at their
    shortlist entries (entry order; ``n_entries`` valid per row): the null reads
    ``positional_null``'s row with the same row's target / near-miss entries."""
    real, ok = key_preference(at_entries, target_entries, near_entries)
    null, _ = key_preference(positional_null(at_entries, n_entries), target_entries, near_entries)
    return real, null, ok


def margin_widening(scaled_writes: Float[Tensor, "N H D"], margin_dir: Float[Tensor, "N D"]
                    ) -> Float[Tensor, "N H"]:
    """``scaled_writes[n, h] . margin_dir[n]`` with ``margin_dir = W_U[:, t] - mean W_U[:, m]``."""
    return torch.einsum("nhd,nd->nh", scaled_writes.float(), margin_dir.float())


def mechanism(refine: Any, from_targets: Any, from_near: Any, target_up: Any,
              near_down: Any) -> list[str]:
    """"copy" / "suppress" / "retrieve" / "-" per head (module docstring); array-likes of
    equal length (one entry per head of the model)."""
    values = [float(x) for x in refine]
    best = max([v for v in values if v == v], default=0.0)
    out = []
    for r, ft, fm, up, down in zip(values, from_targets, from_near, target_up, near_down,
                                   strict=True):
        if not (r > 0 and best > 0 and r >= MECHANISM_MIN * best) or any(
                x != x for x in (ft, fm, up, down)):
            out.append("-")
        elif (ft >= fm) == (up >= down):
            out.append("copy" if ft >= fm else "suppress")
        else:
            out.append("retrieve")
    return out
