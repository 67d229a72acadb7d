"""Phase-2 components: loopback attention, margin widening and their combination (RefineScore).

Shapes: ``N`` Phase-2 query rows (one per example and answer step), ``H`` heads, ``S`` key
positions, ``D`` = d_model. A Phase-2 query position is ``answer_pos - 1``: the position whose
logits predict the answer label.

* ``loopback = sum_s rows[n, h, s] * (target_keys - near_keys)[n, s]`` [N, H]:
  attention mass on the shortlist positions that hold one of the example's target labels minus the
  mass on those holding one of its near-miss labels (each in [0, 1], so loopback is in [-1, 1]).
* ``margin_widening``: the head's direct effect on the target-vs-near-miss logit margin,
  ``(norm_scale(w, x) @ (W_U[:, t] - mean_m W_U[:, m]))``: its write ``w`` [N, H, D] passed through
  the final norm *as that run scaled it* (``final_norm_linear``), dotted with the unembedding
  difference of the target token ``t`` predicted at that step and the example's near-miss tokens
  (their mean: "averaged over near-misses"; the vocabulary mean when an example has none, as the
  task metric does). Summed over every residual component, these direct effects add up to the
  metric's logit margin (up to the unembedding bias).
* ``refine_score = (1 + loopback) / 2 * margin_widening``: the loopback mapped monotonically
  from [-1, 1] onto a gate in [0, 1], times the margin effect. High only when the head pushes the
  margin in the target's favour *and* its attention favours the targets' shortlist entries; a
  head that attends there but writes off the margin direction scores ~0, a head that looks only
  at near-miss entries scores 0, and one that does not look back at the shortlist at all gets
  half weight. (A clipped ``max(loopback, 0)`` gate was rejected: a shortlist holds up to three
  near-misses per target, so even a uniform look-back has negative loopback, and on the shipped
  teacher every head's loopback is negative, which would zero every score.)

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
from jaxtyping import Float
from torch import Tensor


def loopback(rows: Float[Tensor, "N H S"], target_keys: Float[Tensor, "N S"],
             near_keys: Float[Tensor, "N S"]) -> Float[Tensor, "N H"]:
    """Attention mass on target shortlist positions minus mass on near-miss ones."""
    return torch.einsum("nhs,ns->nh", rows.float(), (target_keys - near_keys).float())


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


def refine_score(loopback_: Tensor, margin: Tensor) -> Tensor:
    """``(1 + loopback) / 2 * margin_widening`` (module docstring)."""
    return (1 + loopback_) / 2 * margin
