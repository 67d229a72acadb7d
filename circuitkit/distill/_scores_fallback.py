"""TEMPORARY stand-in for ``ck.score_heads`` (branch ``scoring``), used only while
``circuitkit.scoring`` is not importable. The lead deletes this file when merging ``scoring``;
``score_heads_fn`` is the one place distillation asks for a scorer.

Same columns and definitions as the scoring branch's docstrings (its ``heads.py``), computed
plainly (no streaming, no GQA/LayerNorm special cases beyond what ``signals.readout`` handles):

* sharpness: Fisher excess kurtosis of each head's attention row over keys ``0..q`` at Phase-1
  query positions ``q = anchor_pos - 1`` (a zero-variance row: -2);
* anchor_alignment: ``cos(w, u_c) - mean_{a != c} cos(w, u_a)`` of the head's write
  ``w = z[q, h] @ W_O[h]`` with the centred anchor unembedding directions;
* coarse_score = ``tanh(max(sharpness, 0) / 3) * anchor_alignment``;
* loopback: attention mass on the shortlist positions holding a target minus those holding a
  near-miss, at Phase-2 query positions ``q = answer_pos - 1``;
* margin_widening: the head write's direct effect, through the final norm as the run scaled it,
  on ``logit[target] - mean logit[near_misses]`` (target = the token predicted at that step);
* refine_score = ``(1 + loopback) / 2 * margin_widening``; ranks 1 = highest score.

Means over an example's query positions, then over examples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from circuitkit import hooks
from circuitkit.distill import signals


def score_heads_fn() -> Callable[[Any, Any], Any]:
    """``circuitkit.scoring.score_heads`` when importable, else ``fallback_score_heads``."""
    try:
        from circuitkit.scoring import score_heads

        return score_heads
    except ImportError:
        return fallback_score_heads


def _kurtosis(rows: Tensor, valid: Tensor) -> Tensor:
    """Excess kurtosis of ``rows`` [N, H, S] over ``valid`` [N, S] keys (float64)."""
    a, m = rows.double(), valid[:, None, :].double()
    n = m.sum(-1).clamp(min=1)
    mean = (a * m).sum(-1) / n
    d = (a - mean[..., None]) * m
    m2, m4 = d.pow(2).sum(-1) / n, d.pow(4).sum(-1) / n
    flat = m2 <= 1e-12 * mean.pow(2)
    k = m4 / torch.where(flat, torch.ones_like(m2), m2).pow(2) - 3.0
    return torch.where(flat, torch.full_like(k, -2.0), k)


@torch.no_grad()
def fallback_score_heads(model: Any, task: Any, batch_size: int = 64) -> Any:
    """The score table (module docstring) of ``model`` on ``task``'s own tokens."""
    import pandas as pd

    f = hooks.facts(model)
    L, H = f.n_layers, f.n_heads
    lay = signals.Layout.of(task)
    W_U = model.W_U.detach().float()
    U = signals.anchor_directions(W_U, task.anchor_token_ids)
    kind, g, eps = signals.final_norm(model)
    lt = task.label_token_ids
    sums = {k: torch.zeros(L, H, dtype=torch.float64) for k in ("sharp", "align", "loop", "mw")}
    n1 = n2 = 0.0
    for s in range(0, len(task), batch_size):
        sub = task.subset(range(s, min(s + batch_size, len(task))))
        toks = sub.clean_tokens
        qs = signals.queries(toks, lay)
        _, acts = signals.run_and_capture(model, toks, range(L))
        S = toks.shape[1]
        n1 += float(qs.w1.sum())
        n2 += float(qs.w2.sum())
        if len(qs.b1):
            valid = torch.arange(S)[None, :] <= qs.q1[:, None]
        if len(qs.b2):
            x = acts[hooks.FINAL_NORM_IN][qs.b2, qs.q2].float()
            scale = (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() if kind == "rms" else \
                (x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True).add(eps).rsqrt()
            tgt_keys = torch.zeros(len(qs.b2), S)
            near_keys = torch.zeros(len(qs.b2), S)
            mdir = []
            for n, (b, q) in enumerate(zip(qs.b2.tolist(), qs.q2.tolist(), strict=True)):
                e = sub.examples[b]
                t_tok, n_tok = set(lt[e.targets].tolist()), lt[e.near_misses].tolist()
                for p in e.shortlist_pos:
                    tok = int(e.tokens[p])
                    if p <= q and tok in t_tok:
                        tgt_keys[n, p] = 1.0
                    elif p <= q and tok in n_tok:
                        near_keys[n, p] = 1.0
                other = W_U[:, n_tok].mean(1) if n_tok else W_U.mean(1)
                mdir.append(W_U[:, int(toks[b, q + 1])] - other)
            mdir = torch.stack(mdir)  # [N2, D]
        for layer in range(L):
            pat, z = acts[hooks.pattern(layer)], acts[hooks.z(layer)]
            W_O = model.blocks[layer].attn.W_O.detach().float()
            if len(qs.b1):
                rows = pat[qs.b1, :, qs.q1].float()  # [N1, H, S]
                sums["sharp"][layer] += (_kurtosis(rows, valid) * qs.w1[:, None]).sum(0)
                w = torch.einsum("nhd,hdm->nhm", z[qs.b1, qs.q1].float(), W_O)
                cos = signals._cos(w.reshape(-1, w.shape[-1]), U).reshape(len(qs.b1), H, -1)
                own = cos.gather(2, qs.anchor1[:, None, None].expand(-1, H, 1))[..., 0]
                al = own - (cos.sum(-1) - own) / max(cos.shape[-1] - 1, 1)
                sums["align"][layer] += (al * qs.w1[:, None]).sum(0).double()
            if len(qs.b2):
                rows = pat[qs.b2, :, qs.q2].float()
                lb = (rows * (tgt_keys - near_keys)[:, None, :]).sum(-1)
                sums["loop"][layer] += (lb * qs.w2[:, None]).sum(0).double()
                w = torch.einsum("nhd,hdm->nhm", z[qs.b2, qs.q2].float(), W_O)
                if kind != "rms":
                    w = w - w.mean(-1, keepdim=True)
                eff = torch.einsum("nhd,nd->nh", w * g.float() * scale[:, None, :], mdir)
                sums["mw"][layer] += (eff * qs.w2[:, None]).sum(0).double()
    sharp = sums["sharp"] / max(n1, 1e-30)
    align = sums["align"] / max(n1, 1e-30)
    loop = sums["loop"] / max(n2, 1e-30)
    mw = sums["mw"] / max(n2, 1e-30)
    coarse = torch.tanh(sharp.clamp(min=0) / 3.0) * align
    refine = (1 + loop) / 2 * mw
    rows = []
    for layer in range(L):
        for h in range(H):
            rows.append(dict(layer=layer, head=h, sharpness=float(sharp[layer, h]),
                             anchor_alignment=float(align[layer, h]),
                             coarse_score=float(coarse[layer, h]),
                             loopback=float(loop[layer, h]), margin_widening=float(mw[layer, h]),
                             refine_score=float(refine[layer, h])))
    frame = pd.DataFrame(rows)
    for phase, col in ((1, "coarse_score"), (2, "refine_score")):
        order = sorted(range(len(frame)), key=lambda i: (-_finite(frame[col][i]), i))
        rank = [0] * len(frame)
        for r, i in enumerate(order):
            rank[i] = r + 1
        frame[f"phase{phase}_rank"] = rank
    return frame


def _finite(v: float) -> float:
    return v if math.isfinite(v) else -math.inf
