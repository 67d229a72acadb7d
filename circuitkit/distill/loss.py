"""Distillation losses: ``L_total = L_CoT + lambda_P1 L_P1 + lambda_P2 L_P2 (+ lambda_NS L_NS)``.

Signals (``T``: teacher, ``S``: student) are ``signals.readout``'s, read at the same hook names
of both models, one slot per teacher head ``j`` of a phase, the student's from that head's own
student head (``signals.head_map``). Row weights ``w_n = 1 / steps`` of row ``n``'s example;
``mean_w(x) = sum_n w_n x_n / sum_n w_n`` is a mean over an example's steps, then over examples;
``alpha_j`` the teacher heads' weights (sum 1). ``KL(p || q) = sum_i p_i (log p_i - log q_i)``
over ``p_i > 0`` (``q`` clamped at 1e-12 inside the log only), so ``KL(p || p) = 0`` exactly.

* ``L_CoT = CE(student logits[:, p - 1], tokens[:, p])`` over the teacher's CoT and answer
  positions (``training.lm_loss``), plus, with ``kd_weight > 0`` and the teacher's top-k logits
  ``(v, i)`` [b, s, k]: ``kd_weight * tau^2 * mean_p KL(softmax(v_p / tau) || softmax(z^S_p /
  tau)[i_p])`` (student normalised over the whole vocabulary, teacher over its top k).
* ``L_P1 = mean_w sum_j alpha1_j [ KL(p1_attn^T_j || p1_attn^S_j) + c1 * mean_a (p1_profile^T_j
  - p1_profile^S_j)^2 ]``: where each Phase-1 head reads ([N1, k1, S] over keys) and what it
  writes, compared in anchor-alignment space ([N1, k1, A]: the cosine of the write with each
  anchor's centred direction, each model against its own unembedding).
* ``L_P2 = mean_w sum_j alpha2_j [ KL(p2_loop^T_j || p2_loop^S_j) + c2 * mean_k (p2_effect^T_j
  - p2_effect^S_j)^2 ]``: each Phase-2 head's attention over the shortlist entries plus
  "elsewhere" ([N2, k2, K+1]) and what it writes from those entries as centred logits of the
  shortlist labels ([N2, k2, K]).
* ``L_NS`` (non-selective baseline, MiniLM-style): ``mean_w mean_l KL(ns^T[:, l] || ns^S[:, l])``
  over Phase-1 and Phase-2 rows, ``ns[:, l]`` the mean attention of *all* heads of teacher layer
  ``l`` (student: of the mapped layer), no head selection and no write terms.

The writes are compared in anchor-alignment space and as logits (no parameters: ``p1`` is exactly
0 for the teacher itself), and ``p1``/``p2`` reach only the mapped heads' own weights and what
they read; why, and the gradient mask: docs/distill.md ("Losses"). Combining the terms'
gradients in training: ``balanced_gradients``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from circuitkit import hooks
from circuitkit.distill import signals
from circuitkit.distill.signals import Batch, Pooling, Signals
from circuitkit.tasks.base import check_task
from circuitkit.training import lm_loss, loss_mask

_LOG_FLOOR = 1e-12


@dataclass
class LossConfig:
    """Loss options (module docstring): teacher heads per phase (``top_k1``, ``top_k2``), the
    Phase-1 reading (``signals.READINGS``), how the heads are chosen (``heads``: "scores", the
    descriptive ranks, or "causal", the causal columns with Phase 2 at the shortlist steps:
    ``signals`` module docstring), the share of a student layer's heads that may be
    supervised (``head_share``), write-term weights ``c1`` (anchor-alignment MSE) and ``c2``
    (logit-effect MSE), top-k logit KD.

    ``c1``, ``c2``: docs/distill.md gives the measurement they come from (each write term of
    the order of its attention term)."""

    top_k1: int = 2
    top_k2: int = 2
    phase1_reading: str = "tokens"
    heads: str = "scores"  # signals.HEAD_CHOICES: by the scores, or by causal columns
    head_share: float = signals.HEAD_SHARE
    c1: float = 10.0
    c2: float = 5.0
    kd_weight: float = 0.0
    temperature: float = 2.0
    topk_logits: int = 0

    def check(self) -> None:
        for k in ("c1", "c2", "kd_weight"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k} must be >= 0, got {getattr(self, k)}.")
        signals.check_reading(self.phase1_reading)
        signals.check_heads(self.heads)
        if not 0 < self.head_share <= 1:
            raise ValueError(f"head_share must be in (0, 1], got {self.head_share}.")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}.")
        if self.kd_weight > 0 and self.topk_logits < 1:
            raise ValueError("kd_weight > 0 needs topk_logits >= 1 (the teacher's top-k logits).")


def kl(p: Tensor, q: Tensor) -> Tensor:
    """``sum_i p_i (log p_i - log q_i)`` over the last axis, terms with ``p_i = 0`` dropped."""
    pos = p > 0
    terms = p * (torch.where(pos, p, 1.0).log() - q.clamp(min=_LOG_FLOOR).log())
    return torch.where(pos, terms, torch.zeros_like(terms)).sum(-1)


def wmean(x: Tensor, w: Tensor) -> Tensor:
    """``sum w x / sum w`` (0 for no rows)."""
    if x.numel() == 0:
        return x.new_zeros(())
    w = w.to(x.device, x.dtype)
    return (x * w).sum() / w.sum()


def loss_p1(t: Signals, s: Signals, alpha: Tensor, w: Tensor, c1: float) -> Tensor:
    att = kl(t.p1_attn.to(s.p1_attn), s.p1_attn)  # [N1, k1]
    prof = (t.p1_profile.to(s.p1_profile) - s.p1_profile).pow(2).mean(-1) \
        if t.p1_profile.shape[-1] else torch.zeros_like(att)
    return wmean(((att + c1 * prof) * alpha.to(att)).sum(-1), w)


def loss_p2(t: Signals, s: Signals, alpha: Tensor, w: Tensor, valid: Tensor, c2: float) -> Tensor:
    loop = kl(t.p2_loop.to(s.p2_loop), s.p2_loop)  # [N2, k2]
    v = valid.to(s.p2_effect)[:, None]
    sq = ((t.p2_effect.to(s.p2_effect) - s.p2_effect).pow(2) * v).sum(-1) \
        / v.sum(-1).clamp(min=1)
    return wmean(((loop + c2 * sq) * alpha.to(loop)).sum(-1), w)


def loss_ns(t: Signals, s: Signals, w1: Tensor, w2: Tensor) -> Tensor:
    if t.ns_attn1 is None or s.ns_attn1 is None:
        raise ValueError("the non-selective loss needs per-layer attention of all heads: build "
                         "the signal store with nonselective=True.")
    k1 = kl(t.ns_attn1.to(s.ns_attn1), s.ns_attn1).mean(-1)  # mean over teacher layers
    k2 = kl(t.ns_attn2.to(s.ns_attn2), s.ns_attn2).mean(-1)
    return wmean(torch.cat([k1, k2]), torch.cat([w1, w2]))


def loss_cot(logits: Tensor, tokens: Tensor, mask: Tensor, topk: tuple[Tensor, Tensor] | None,
             cfg: LossConfig) -> Tensor:
    ce = lm_loss(logits, tokens, mask)
    if cfg.kd_weight <= 0 or topk is None:
        return ce
    m = mask[:, 1:].to(logits.device)
    tv, ti = (x[:, :-1].to(logits.device)[m] for x in topk)  # [M, k]
    k = min(cfg.topk_logits, tv.shape[-1])
    tau = cfg.temperature
    pt = (tv[:, :k].float() / tau).softmax(-1)
    ls = (logits[:, :-1][m].float() / tau).log_softmax(-1).gather(-1, ti[:, :k])
    return ce + cfg.kd_weight * tau * tau * kl(pt, ls.exp()).mean()


def student_terms(student: Any, batch: Batch, teacher_pool: Pooling, anchors: signals.Anchors,
                  cfg: LossConfig, lambda_p1: float, lambda_p2: float,
                  lambda_ns: float = 0.0) -> dict[str, Tensor]:
    """``cot, p1, p2, ns, total`` of ``student`` (a ``TransformerBridge``) on one batch whose
    teacher signals are given. A term whose lambda is 0 is not computed (its value is 0): a
    CoT-only step reads no hooks."""
    f = hooks.facts(student)
    dev = next(student.parameters()).device
    tokens = batch.tokens.to(dev)
    mech = (lambda_p1 > 0 or lambda_p2 > 0 or lambda_ns > 0)
    zero = torch.zeros((), device=dev)
    if not mech:
        logits = student(tokens)
        cot = loss_cot(logits, tokens, batch.mask, batch.topk, cfg)
        return dict(cot=cot, p1=zero, p2=zero, ns=zero, total=cot)
    # the head map first, then the phases asked for: a head's student head never depends on
    # which terms are on
    pool = teacher_pool.for_student(f.n_layers, f.n_heads, cfg.head_share).only(
        lambda_p1 > 0, lambda_p2 > 0, lambda_ns > 0)
    logits, acts = signals.run_and_capture(student, tokens, pool.layers(),
                                           v_layers=pool.p2_layers())
    s = signals.readout(student, acts, batch.queries, pool, anchors)
    t, qs = batch.teacher, batch.queries
    cot = loss_cot(logits, tokens, batch.mask, batch.topk, cfg)
    p1 = loss_p1(t, s, pool.alpha1, qs.w1, cfg.c1) if lambda_p1 > 0 else zero
    p2 = loss_p2(t, s, pool.alpha2, qs.w2, qs.valid2, cfg.c2) if lambda_p2 > 0 else zero
    ns = loss_ns(t, s, qs.w1, qs.w2) if lambda_ns > 0 else zero
    total = cot + lambda_p1 * p1 + lambda_p2 * p2 + lambda_ns * ns
    return dict(cot=cot, p1=p1, p2=p2, ns=ns, total=total)


BALANCES = ("share", "cap", "global_clip", "none")
MECH = ("p1", "p2", "ns")


def _norm(grads: list[Tensor | None]) -> Tensor:
    sq = [g.detach().float().pow(2).sum() for g in grads if g is not None]
    return torch.stack(sq).sum().sqrt() if sq else torch.zeros(())


def balanced_gradients(terms: dict[str, Tensor], lambdas: dict[str, float],
                       params: list[Tensor], balance: str = "share", ratio: float = 0.5,
                       clip: float = 1.0) -> dict[str, float]:
    """Set ``p.grad`` of every parameter in ``params`` to one step's gradient from the terms
    ``student_terms`` returned; returns what the run's history logs: ``gn_<term>`` the norm of
    each term's own gradient ``|grad L_term|`` (unweighted; 0 for a term that is off),
    ``s_<term>`` the factor its ``lambda * grad`` entered with, ``sh_<term>`` its **effective
    share** ``|lambda_k s_k g_k| / |c g_CoT|`` (the norm of what the term added to the step over
    the norm of the step's CoT part; 0 for a term that is off), ``cos`` the cosine between the
    CoT part and the mechanistic part of the step, ``norm`` the step gradient's norm (NaN when
    any gradient is not finite: then no ``.grad`` is set).

    All rules: ``g = c g_CoT + sum_k lambda_k s_k g_k`` with ``c = min(1, clip / |g_CoT|)``
    (CoT-only's own clip, so the CoT part of the step is exactly CoT-only's), and

    * ``"share"`` (the default, issue 50): ``s_k = c |g_CoT| / |g_k|``: term ``k`` enters at
      exactly ``lambda_k`` times the CoT part's norm, its effective share is ``lambda_k``
      (lambda is the term's share of the step, whatever the scale of its loss);
    * ``"cap"`` (issues 25-35): ``s_k = min(1, ratio c |g_CoT| / |g_k|)``: no term's own
      gradient counts for more than ``ratio`` times the CoT part (effective share
      ``lambda_k min(|g_k| / (c |g_CoT|), ratio)``: the cap, not lambda, sets it when it binds);
    * ``"none"``: ``s_k = c``: the gradient of ``L_CoT + sum_k lambda_k L_k`` under the CoT
      part's clip (effective share ``lambda_k |g_k| / |g_CoT|``);
    * ``"global_clip"`` (before issue 25): the gradient of the total, clipped to ``clip`` as a
      whole (a large mechanistic gradient shrinks the CoT part of the step)."""
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {list(BALANCES)}, got {balance!r}.")
    on = [k for k in MECH if lambdas.get(k, 0.0) > 0]
    names = ["cot"] + on
    grads = {k: list(torch.autograd.grad(terms[k], params, retain_graph=i < len(names) - 1,
                                         allow_unused=True)) for i, k in enumerate(names)}
    norms = {k: _norm(g) for k, g in grads.items()}
    out = {f"gn_{k}": float(norms.get(k, 0.0)) for k in ("cot",) + MECH}
    if not all(bool(torch.isfinite(n)) for n in norms.values()):
        return dict(out, **{f"s_{k}": float("nan") for k in MECH},
                    **{f"sh_{k}": float("nan") for k in MECH}, cos=float("nan"), norm=float("nan"))
    c_cot = min(1.0, clip / max(float(norms["cot"]), 1e-30))
    part = c_cot * float(norms["cot"])  # the norm of the CoT part of the step
    scale = {}
    for k in on:
        size = float(norms[k])
        if balance == "cap":
            scale[k] = lambdas[k] * (min(1.0, ratio * part / size) if size > 0 else 1.0)
        elif balance == "share":  # a term with no gradient adds nothing whatever its factor
            scale[k] = lambdas[k] * (part / size if size > 0 else 0.0)
        elif balance == "none":
            scale[k] = lambdas[k] * c_cot
        else:
            scale[k] = lambdas[k]
    mech: list[Tensor | None] = [None] * len(params)
    for k in on:
        for i, g in enumerate(grads[k]):
            if g is not None:
                mech[i] = scale[k] * g if mech[i] is None else mech[i] + scale[k] * g
    cot = list(grads["cot"])
    if balance == "global_clip":
        total = [None if a is None and m is None else (a if a is not None else 0) +
                 (m if m is not None else 0) for a, m in zip(cot, mech, strict=True)]
        c = min(1.0, clip / max(float(_norm(total)), 1e-30))
        c_cot, scale = c, {k: v * c for k, v in scale.items()}
        part = c * float(norms["cot"])
        mech = [None if m is None else m * c for m in mech]
    cot = [None if g is None else g * c_cot for g in cot]
    dot = sum(float((a.float() * m.float()).sum()) for a, m in zip(cot, mech, strict=True)
              if a is not None and m is not None)
    n_cot, n_mech = float(_norm(cot)), float(_norm(mech))
    for p, a, m in zip(params, cot, mech, strict=True):
        g = a if m is None else (m if a is None else a + m)
        p.grad = None if g is None else g.detach().to(p.dtype)
    out.update({f"s_{k}": (scale[k] / lambdas[k] if k in scale else 0.0) for k in MECH})
    out.update({f"sh_{k}": (scale[k] * float(norms[k]) / part if k in scale and part > 0
                            else 0.0) for k in MECH})
    out["cos"] = dot / (n_cot * n_mech) if n_cot > 0 and n_mech > 0 else 0.0
    out["norm"] = float(_norm([p.grad for p in params]))
    return out


def losses(teacher: Any, student: Any, task: Any, scores: Any, lambda_p1: float = 1.0,
           lambda_p2: float = 1.0, *, cot: Any = "teacher", lambda_ns: float = 0.0,
           config: LossConfig | None = None) -> dict[str, Tensor]:
    """One batch of distillation losses for a custom training loop (module docstring).

    Args:
        teacher, student: ``TransformerBridge`` models (``ck.load_model``) over one vocabulary;
            they may differ in layers, heads and width. The student runs with autograd; wrap
            an HF model being trained with ``ck.load_model(hf_model, tokenizer=...)`` (its
            parameters are shared, not copied).
        task: the batch (its notes; ``cot`` decides the rows).
        scores: ``ck.score_heads(teacher, task)`` (one row per teacher head).
        cot: ``"teacher"`` (the teacher's greedy CoT of each note, decoded here), ``"task"``
            (the task's own CoT rows) or a ``(tokens, mask)`` pair of CoT rows and their loss
            mask.

    Returns ``{"cot", "p1", "p2", "ns", "total"}``: scalar tensors, differentiable in the
    student; ``p1 == p2 == 0`` exactly when the student is the teacher.
    """
    cfg = config or LossConfig()
    cfg.check()
    for name, lam in (("lambda_p1", lambda_p1), ("lambda_p2", lambda_p2),
                      ("lambda_ns", lambda_ns)):
        if not lam >= 0:  # NaN too
            raise ValueError(f"{name} must be a number >= 0, got {lam}.")
    ft, fs = hooks.facts(teacher), hooks.facts(student)
    if ft.d_vocab != fs.d_vocab:
        raise ValueError(f"teacher and student must share a vocabulary: d_vocab {ft.d_vocab} vs "
                         f"{fs.d_vocab}.")
    check_task(task, "losses")
    task.check_model(student)
    lay = signals.Layout.of(task)
    if isinstance(cot, str):
        if cot == "teacher":
            tokens, mask = signals.teacher_rows(teacher, task)
        elif cot == "task":
            tokens, mask = task.clean_tokens, loss_mask(task)
        else:
            raise ValueError(f"cot must be 'teacher', 'task' or (tokens, mask); got {cot!r}.")
    else:
        tokens, mask = _cot_pair(cot)
    pool = Pooling.teacher(scores, ft.n_layers, ft.n_heads, cfg.top_k1, cfg.top_k2,
                           nonselective=lambda_ns > 0, reading=cfg.phase1_reading, heads=cfg.heads)
    qs = signals.queries(tokens, lay, cfg.heads)
    _warn_no_steps(qs, lambda_p1, lambda_p2, cot)
    anchors = signals.Anchors.of(task, cfg.phase1_reading)
    t_sig, topk = signals.read_teacher(teacher, tokens, qs, pool, anchors, cfg.topk_logits)
    batch = Batch(tokens, mask.bool(), qs, t_sig, topk)
    return student_terms(student, batch, pool, anchors, cfg, lambda_p1, lambda_p2, lambda_ns)


def _cot_pair(cot: Any) -> tuple[Tensor, Tensor]:
    """``cot=(tokens, mask)`` checked: integer rows and a loss mask of the same shape."""
    try:
        tokens, mask = cot
    except (TypeError, ValueError):
        raise ValueError("cot must be 'teacher', 'task' or a (tokens, mask) pair; got "
                         f"{type(cot).__name__}.") from None
    if not (isinstance(tokens, Tensor) and tokens.ndim == 2 and not tokens.is_floating_point()):
        raise ValueError("cot=(tokens, mask): tokens must be an integer tensor [batch, seq]; got "
                         f"{getattr(tokens, 'shape', type(tokens).__name__)}.")
    if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(tokens.shape):
        got = getattr(mask, "shape", type(mask).__name__)
        raise ValueError(f"cot=(tokens, mask): mask must have the tokens' shape "
                         f"{tuple(tokens.shape)}; got {got}.")
    return tokens, mask


def _warn_no_steps(qs: Any, lambda_p1: float, lambda_p2: float, cot: Any) -> None:
    """p1/p2 are 0 when the CoT rows hold no anchor steps / no shortlist and answer: say so
    instead of training on L_CoT alone without a word."""
    gone = [n for n, lam, rows in (("p1", lambda_p1, len(qs.b1)), ("p2", lambda_p2, len(qs.b2)))
            if lam > 0 and rows == 0]
    if gone:
        why = ("the teacher's greedy CoT has no such steps (is it trained on this task? "
               "cot='task' uses the task's own CoT)" if isinstance(cot, str) and cot == "teacher"
               else "these CoT rows have no such steps")
        warnings.warn(f"losses: {' and '.join(gone)} = 0 for this batch: {why}. Phase-1 needs "
                      "anchor steps, Phase-2 a shortlist and answer steps.", stacklevel=3)
