"""Phase-2 components: the loop-back decomposed, margin widening and RefineScore.

Shapes: ``N`` Phase-2 query rows (one per example and answer step), ``H`` heads, ``S`` key
positions, ``K`` shortlist keys of a row (padded), ``D`` = d_model. A Phase-2 query position is
``answer_pos - 1``: the position whose logits predict the answer label. ``A[n, h, s]`` is the
head's attention row; ``SL`` the row's shortlist positions (keys ``<= q``), ``T``/``M`` those
holding one of the example's target / near-miss tokens.

Attention only:

* ``shortlist_share = sum_{s in SL} A[s]`` in [0, 1]: how much the head re-reads the shortlist.
* ``key_preference = (a_T - a_M) / (a_T + a_M)`` in [-1, 1], with ``a_T = mean_{s in T} A`` and
  ``a_M = mean_{s in M} A`` the mean attention *per entry*: count-balanced (a head uniform over
  the shortlist scores 0 whatever the numbers of targets and near-misses), independent of the
  share, and equal to ``tanh(Delta / 2)`` where ``Delta = log a_T - log a_M`` is the difference
  of the (log-mean-exp) pre-softmax QK logits of the two groups: the QK logit difference
  squashed onto [-1, 1]. Undefined (left out of the mean) for a row without a target or without
  a near-miss entry.
* ``loopback = shortlist_share * key_preference`` in [-1, 1]: re-attending to the shortlist, and
  to which side of it: +1 all attention on target entries, -1 all on near-miss entries, 0 a
  uniform look-back or none.

What the head writes from what it reads. The head's write is ``z @ W_O = sum_s A[s] v[s] @ W_O``,
so the part it takes from key ``s`` per unit of attention is ``w_s = v[s] @ W_O[h]`` (``v`` its
value vector), read through the final norm as the run scaled it (``n``, ``final_norm_linear``):

* ``ov_copy``: the own-label effect ``e[s] = n(w_s) . (W_U[:, tok(s)] - mean_v W_U[:, v])``
  (the logit of the label at ``s`` relative to the mean logit over the vocabulary, the usual
  direct-logit-attribution baseline), attention-weighted over ``SL``: ``sum A e / sum A``. > 0
  the head copies what it reads, < 0 it suppresses it (logits per unit of attention).
  ``ov_copy_targets`` / ``ov_copy_near_misses``: the same over ``T`` / ``M`` only.
* ``refine_score = sum_{s in SL} A[s] m[s]`` with ``m[s] = n(w_s) . (W_U[:, t] - mean_m W_U[:, m])``
  the margin effect of what key ``s`` gives the head: the part of ``margin_widening`` the head
  writes from the shortlist entries it reads (exact: ``margin_widening`` is the same sum over
  every key). ``margin_from_targets`` / ``margin_from_near_misses``: the sum over ``T`` / ``M``.
  ``refine_target_up``: the part that raises the target, ``sum_SL A n(w_s) . (W_U[:, t] -
  mean_v W_U[:, v])``; ``refine_near_down = refine_score - refine_target_up``, the part that
  lowers the near-misses. It is high for a head that re-reads the shortlist and turns what it
  reads into margin, in any of the ways: copying the targets it attends to, suppressing the
  near-misses it attends to, or reading target information stored at other entries; 0 for a
  uniform look-back with a copying OV (the targets' gain and the near-misses' cancel), a head
  that never looks, or one that widens the margin from elsewhere (the note).
  ``refine_if_uniform``: the same with the head's shortlist attention spread evenly over the
  entries (``shortlist_share * mean_{s in SL} m[s]``): what selection among the entries adds is
  ``refine_score - refine_if_uniform``.
* ``margin_widening``: the head's direct effect on the target-vs-near-miss logit margin,
  ``(norm_scale(w, x) @ (W_U[:, t] - mean_m W_U[:, m]))``: its write ``w`` [N, H, D] passed through
  the final norm *as that run scaled it* (``final_norm_linear``), dotted with the unembedding
  difference of the target token ``t`` predicted at that step and the example's near-miss tokens
  (their mean: "averaged over near-misses"; the vocabulary mean when an example has none, as the
  task metric does). Summed over every residual component, these direct effects add up to the
  metric's logit margin (up to the unembedding bias).
* ``mechanism`` (``mechanism``): for a head whose ``refine_score`` is positive and at least
  ``MECHANISM_MIN`` of the largest, where its shortlist margin comes from and what it moves:
  "copy" (mostly from target entries, mostly raising the target: ``margin_from_targets >=
  margin_from_near_misses`` and ``refine_target_up >= refine_near_down``), "suppress" (mostly
  from near-miss entries, mostly lowering the near-misses), "retrieve" (the two disagree: e.g.
  reading near-miss entries and raising the target from what is stored there); "-" for the
  other heads. (Comparing the two sides of the margin, not the sign of ``ov_copy``: a head that
  writes the target from a near-miss entry lowers that entry's logit relative to any mean that
  includes the target.)

Beside these, each its own column (issue 34; the columns above keep their formulas):

* ``key_preference_nonadjacent``: ``key_preference`` with ``M`` replaced by ``M'``, the near-miss
  entries that do not stand immediately before a target entry in the shortlist (the entry at the
  previous shortlist position of a target). A head with an off-by-one habit (attention on the
  entry before the one it copies) makes today's ``key_preference`` negative while it prefers the
  target over the other near-misses. Undefined for a row without a target or an ``M'`` entry.
* Sibling margins: the same quantities along ``W_U[:, t] - mean_{m in sib(t)} W_U[:, m]``, with
  ``sib(t)`` the example's near-misses in the target's *own* category (``label_anchor[m] ==
  label_anchor[t]``); today's near-miss margin averages over every near-miss of the note, other
  categories' included. ``margin_widening_siblings`` (the direct effect), ``refine_score_siblings``
  (``sum_{s in SL} A[s] m_sib[s]``) and ``margin_from_siblings`` (that sum over the shortlist
  entries holding ``sib(t)``), ``margin_from_targets_siblings`` (over ``T``),
  ``refine_near_down_siblings`` (``refine_score_siblings - refine_target_up``, row by row) and
  ``refine_if_uniform_siblings``; ``ov_copy_siblings``: ``ov_copy`` over those entries. Undefined
  (left out of the means) for a row whose target has no sibling among the near-misses: no
  vocabulary-mean fallback.

Rejected (issue 23): ``loopback = mass_T - mass_M`` (negative for a uniform look-back, as a
shortlist holds more near-misses than targets) and ``refine_score = (1 + loopback) / 2 *
margin_widening`` (a gate >= 0.3 for every head of the shipped teacher: the ranking was
margin_widening's); and a product ``margin_widening * max(share * key_preference *
sign(ov_copy), 0)``, which assumes a head writes about the label it attends to: the shipped
teacher's strongest shortlist readers attend mostly to near-miss entries and copy them a little,
yet write the target, and that product gave them 0.

Final norm (``final_norm_linear``), with ``x`` [N, D] the residual entering the final norm at the
query position (``hooks.FINAL_NORM_IN``) and ``g`` the norm's gain (its weight; ``1 + weight``
for Gemma's RMSNorm; 1 for TransformerLens's weightless ``LNPre`` / ``RMSPre``):

* RMSNorm: ``w * g / sqrt(mean(x^2) + eps)``;
* LayerNorm: ``(w - mean(w)) * g / sqrt(var(x) + eps)`` (the bias is not part of any head's write);
* no normalization (``normalization_type=None``): ``w``.

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

MECHANISM_MIN = 0.1  # a head's refine_score, relative to the largest, to name its mechanism


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
