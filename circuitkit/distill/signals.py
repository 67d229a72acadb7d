"""Teacher signals for mechanistic distillation, and the store that streams them to training.

A *signal* is what the teacher's top Phase-1 / Phase-2 heads do at the query positions of its own
chain of thought, pooled over those heads with weights from their scores (``ck.score_heads``).
The student's counterpart is read by the same code (``readout``) at the same hook names
(``hooks.pattern``, ``hooks.z``, ``hooks.FINAL_NORM_IN``), so a loss compares like with like.

Rows and positions (task layout: the token at ``p`` is predicted from the logits at ``p - 1``):

* a CoT row is ``<bos> note <think> anchors <sl> shortlist </think> answer <eos>`` (the teacher's
  greedy continuation of ``note <think>``); ``queries`` parses it;
* Phase-1 query rows ``(b1, q1)``: ``q1 = p - 1`` for each anchor token ``p`` between
  ``<think>`` and ``<sl>``; Phase-2 query rows ``(b2, q2)``: ``q2 = p - 1`` for each label
  token after ``</think>``; their keys ``keys2`` are the shortlist positions (label tokens
  between ``<sl>`` and ``</think>``) and ``tok2`` the tokens there;
* row weights ``w = 1 / (steps of that example)``: losses average over steps, then examples
  (as Reasoning Focus does).

Head weights (``head_weights``): phase ``k``'s top ``top_k`` heads by ``phase{k}_rank``, weight
``alpha = max(score, 0) / sum`` (``coarse_score`` / ``refine_score``; uniform over the top heads
when none is positive), an ``[L, H]`` matrix summing to 1. The student's matrix
(``student_weights``): the teacher's itself when the shapes agree; otherwise teacher layer ``l``
maps to student layer ``floor((l + 1/2) L_S / L_T)`` (same relative depth) and its mass spreads
uniformly over that layer's heads, since student heads have no identity to match.

Signals (``readout``; ``N1``/``N2`` query rows, ``S`` keys, ``A`` anchors, ``K`` shortlist keys,
``D`` d_model of the model read, ``alpha`` its ``[L, H]`` weights):

=============  ==========  =====================================================================
p1_attn        [N1, S]     ``sum_lh alpha1[l,h] pattern_l[b, h, q, :]``: where the Phase-1 heads
                           read (a distribution over keys ``0..q``)
p1_profile     [N1, A]     ``cos(w1, u_a)`` for every anchor ``a``, ``w1 = sum_lh alpha1[l,h]
                           z_l[b, q, h] @ W_O[l, h]`` the pooled write and ``u_a = W_U[:, tok(a)]
                           - mean_b W_U[:, tok(b)]`` the model's own centred anchor directions:
                           the write in anchor-alignment space (width-free)
p1_alignment   [N1]        ``cos(w1, u_c) - mean_{a != c} cos(w1, u_a)``, ``c`` the anchor
                           predicted at that step (the CoarseScore's alignment, pooled)
p2_loop        [N2, K+1]   ``(sum_lh alpha2 pattern_l[b, h, q, keys], 1 - that sum)``: loop-back
                           attention over the shortlist keys plus the mass elsewhere
p2_effect      [N2, K]     direct logit effect of the pooled write ``w2`` through the final norm
                           as the run scaled it (``rms(x)`` of ``hooks.FINAL_NORM_IN`` at ``q``,
                           frozen) on the shortlist tokens, centred over the shortlist:
                           ``e_k = n(w2) . W_U[:, tok_k] - mean_j n(w2) . W_U[:, tok_j]`` (logits:
                           comparable across models sharing a vocabulary)
ns_attn1/2     [N, L_T, S] non-selective baseline: per teacher layer the mean over *all* its heads
                           (student: over all heads of the mapped layer)
=============  ==========  =====================================================================

The unembedding ``W_U`` and final-norm weight are detached in signals (the reading frame is the
model's own and fixed within a step: a mechanistic loss moves writes, not the frame); ``W_O``,
patterns and ``z`` keep their gradients.

Store (``build_store``/``SignalStore``): a folder of safetensors shards (``shard-00000``...) of
``shard_size`` examples each, with the teacher's CoT rows, loss mask, query rows and signals (fp32)
and, optionally, the teacher's top-k logits at every position; ``manifest.json`` names the
teacher fingerprint (hash of its weights), the score-table hash, the task fingerprint, the options,
and each shard with its SHA-256. Building is resumable shard by shard (``manifest.partial.json``
lists the shards written so far, with their SHA-256: a resumed build keeps those that still
match, recomputes the rest); ``SignalStore.open`` refuses a store whose manifest is malformed
(each field's type and range checked, the field named), does not match the run, or whose shard
files do not match their SHA-256 (swapped, edited, truncated: the shard named). Training reads
one shard at a time (``BatchStream``), so the teacher never sits in memory beside the student.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from circuitkit import hooks
from circuitkit.models import hf_model_of, plain_parameters  # noqa: F401 (re-exported)
from circuitkit.scoring.heads import top_heads
from circuitkit.scoring.refine import final_norm, final_norm_linear, norm_params

FORMAT = "circuitkit.distill.signals/2"  # /2: a SHA-256 per shard
MANIFEST = "manifest.json"
PARTIAL = "manifest.partial.json"
SCORE_COLUMNS = ("layer", "head", "sharpness", "anchor_alignment", "coarse_score", "loopback",
                 "margin_widening", "refine_score", "phase1_rank", "phase2_rank")
_EPS = 1e-12


class StoreProblem(ValueError):
    """A store that cannot be used as it is: built for another run, or damaged (its manifest or
    a shard). The message names the file and says what to do."""


# --- query rows -------------------------------------------------------------------------------


@dataclass
class Queries:
    """Query rows of a batch of CoT rows (module docstring). ``keys2``/``tok2`` are padded with
    -1 (``valid2`` marks real keys)."""

    b1: Int[Tensor, " N1"]
    q1: Int[Tensor, " N1"]
    w1: Float[Tensor, " N1"]
    anchor1: Int[Tensor, " N1"]
    b2: Int[Tensor, " N2"]
    q2: Int[Tensor, " N2"]
    w2: Float[Tensor, " N2"]
    keys2: Int[Tensor, "N2 K"]
    tok2: Int[Tensor, "N2 K"]

    @property
    def valid2(self) -> Tensor:
        return self.keys2 >= 0


@dataclass(frozen=True)
class Layout:
    """Token ids a CoT row is parsed with (from a ``Task``)."""

    think: int
    sl: int
    end: int
    eos: int
    anchor_token_ids: tuple[int, ...]
    label_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, task: Any) -> Layout:
        missing = [w for w in ("<think>", "<sl>", "</think>") if w not in task.vocab]
        if missing:
            raise ValueError(f"task {task.name!r} has no {missing} token(s): distillation needs a "
                             "CoT task (<think> anchors <sl> shortlist </think> answer).")
        v = task.vocab
        return cls(v.index("<think>"), v.index("<sl>"), v.index("</think>"), task.eos_id,
                   tuple(task.anchor_token_ids.tolist()), tuple(task.label_token_ids.tolist()))


def parse_row(row: Sequence[int], lay: Layout) -> tuple[list[int], list[int], list[int]]:
    """(anchor, shortlist, answer) positions of one CoT row; empty lists where the row lacks
    the structure (a teacher that never wrote ``<sl>`` gives no shortlist)."""
    row = list(row)

    def find(tok: int, start: int) -> int | None:
        try:
            return row.index(tok, start)
        except ValueError:
            return None

    t = find(lay.think, 0)
    if t is None:
        return [], [], []
    s = find(lay.sl, t + 1)
    e = find(lay.end, (s if s is not None else t) + 1)
    stop = find(lay.eos, (e if e is not None else t) + 1)
    stop = len(row) if stop is None else stop
    anchors_set, labels_set = set(lay.anchor_token_ids), set(lay.label_token_ids)
    a_end = s if s is not None else (e if e is not None else stop)
    anchors = [p for p in range(t + 1, a_end) if row[p] in anchors_set]
    if s is None or e is None:
        return anchors, [], []
    short = [p for p in range(s + 1, e) if row[p] in labels_set]
    answer = [p for p in range(e + 1, stop) if row[p] in labels_set]
    return anchors, short, answer


def queries(tokens: Int[Tensor, "b s"], lay: Layout) -> Queries:
    """Phase-1 and Phase-2 query rows of CoT rows ``tokens`` (module docstring)."""
    tok2anchor = {t: i for i, t in enumerate(lay.anchor_token_ids)}
    b1, q1, w1, a1, b2, q2, w2, keys, toks = [], [], [], [], [], [], [], [], []
    for b, row in enumerate(tokens.tolist()):
        anchors, short, answer = parse_row(row, lay)
        for p in anchors:
            b1.append(b)
            q1.append(p - 1)
            w1.append(1.0 / len(anchors))
            a1.append(tok2anchor[row[p]])
        if short:
            for p in answer:
                b2.append(b)
                q2.append(p - 1)
                w2.append(1.0 / len(answer))
                keys.append(short)
                toks.append([row[s] for s in short])
    K = max((len(k) for k in keys), default=0)
    pad = lambda rows: torch.tensor([r + [-1] * (K - len(r)) for r in rows],  # noqa: E731
                                    dtype=torch.long).reshape(len(rows), K)
    lt = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return Queries(lt(b1), lt(q1), torch.tensor(w1), lt(a1), lt(b2), lt(q2), torch.tensor(w2),
                   pad(keys), pad(toks))


# --- head weights -----------------------------------------------------------------------------


def check_scores(scores: Any, n_layers: int, n_heads: int) -> None:
    """Refuse a score table that is not ``ck.score_heads``'s for a model of this shape."""
    cols = list(getattr(scores, "columns", []))
    missing = [c for c in SCORE_COLUMNS if c not in cols]
    if missing:
        raise ValueError(f"scores is missing column(s) {missing}; pass the DataFrame of "
                         f"ck.score_heads(teacher, task) (columns {list(SCORE_COLUMNS)}).")
    cells = set(zip(scores["layer"].astype(int), scores["head"].astype(int), strict=True))
    if len(scores) != n_layers * n_heads or cells != {(a, b) for a in range(n_layers)
                                                     for b in range(n_heads)}:
        raise ValueError(f"scores has {len(scores)} rows but the teacher has {n_layers} layers x "
                         f"{n_heads} heads; pass ck.score_heads(teacher, task) of this teacher.")


def head_weights(scores: Any, n_layers: int, n_heads: int, phase: int,
                 top_k: int) -> Float[Tensor, "L H"]:
    """``alpha``: the top ``top_k`` heads of ``phase`` weighted by their positive score
    (module docstring). Sums to 1."""
    if phase not in (1, 2):
        raise ValueError(f"phase must be 1 or 2, got {phase!r}.")
    if top_k < 1:
        raise ValueError(f"top_k must be a positive number of heads, got {top_k}.")
    check_scores(scores, n_layers, n_heads)
    col = "coarse_score" if phase == 1 else "refine_score"
    heads = top_heads(scores, phase, top_k)  # refuses a phase the scores have no ranks for
    value = dict(zip(zip(scores["layer"].astype(int), scores["head"].astype(int), strict=True),
                     scores[col].astype("float64"), strict=True))
    s = torch.tensor([value[h] for h in heads], dtype=torch.float64)
    if bool(s.isnan().any()):  # NaN passes clamp and would turn the weights uniform unseen
        bad = [h for h, v in zip(heads, s.tolist(), strict=True) if v != v]
        raise ValueError(f"scores[{col!r}] is NaN for head(s) (layer, head) {bad}: NaN weights or "
                         "activations in the teacher? Recompute ck.score_heads on a finite model.")
    s = s.clamp(min=0)
    s = s / s.sum() if float(s.sum()) > 0 else torch.full_like(s, 1.0 / len(s))
    w = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    for (lay, hd), v in zip(heads, s.tolist(), strict=True):
        w[lay, hd] = v
    return w.float()


def layer_map(n_teacher: int, n_student: int) -> list[int]:
    """Student layer of each teacher layer at the same relative depth:
    ``floor((l + 1/2) * n_student / n_teacher)``."""
    return [min(n_student - 1, math.floor((lay + 0.5) * n_student / n_teacher))
            for lay in range(n_teacher)]


def student_weights(alpha: Float[Tensor, "LT HT"], n_layers: int,
                    n_heads: int) -> Float[Tensor, "LS HS"]:
    """The student's pooling weights for the teacher's ``alpha`` (module docstring)."""
    if tuple(alpha.shape) == (n_layers, n_heads):
        return alpha.clone()
    out = torch.zeros(n_layers, n_heads, dtype=alpha.dtype)
    for lt, ls in enumerate(layer_map(alpha.shape[0], n_layers)):
        out[ls] += alpha[lt].sum() / n_heads
    return out


@dataclass
class Pooling:
    """How one model's heads are pooled: ``w1``/``w2`` ``[L, H]`` and, for the non-selective
    baseline, ``ns_layers`` (the model's layer read for each teacher layer; empty: off)."""

    w1: Tensor
    w2: Tensor
    ns_layers: tuple[int, ...] = ()

    @classmethod
    def teacher(cls, scores: Any, n_layers: int, n_heads: int, top_k1: int = 4,
                top_k2: int = 4, nonselective: bool = False) -> Pooling:
        return cls(head_weights(scores, n_layers, n_heads, 1, top_k1),
                   head_weights(scores, n_layers, n_heads, 2, top_k2),
                   tuple(range(n_layers)) if nonselective else ())

    def for_student(self, n_layers: int, n_heads: int) -> Pooling:
        lt = self.w1.shape[0]
        ns = tuple(layer_map(lt, n_layers)[i] for i in self.ns_layers) if self.ns_layers else ()
        return Pooling(student_weights(self.w1, n_layers, n_heads),
                       student_weights(self.w2, n_layers, n_heads), ns)

    def layers(self) -> list[int]:
        used = set((self.w1.abs().sum(1) > 0).nonzero()[:, 0].tolist())
        used |= set((self.w2.abs().sum(1) > 0).nonzero()[:, 0].tolist())
        return sorted(used | set(self.ns_layers))


# --- reading a model --------------------------------------------------------------------------


class attn_result_off:
    """Per-head ``hook_result`` off for a run (nothing here reads it; it costs an einsum)."""

    def __init__(self, model: Any):
        self.model = model
        self.on = bool(getattr(getattr(model, "cfg", None), "use_attn_result", False))

    def __enter__(self) -> None:
        if self.on:
            self.model.set_use_attn_result(False)

    def __exit__(self, *exc: Any) -> None:
        if self.on:
            self.model.set_use_attn_result(True)


def run_and_capture(model: Any, tokens: Tensor, layers: Sequence[int],
                    final_norm: bool = True) -> tuple[Tensor, dict[str, Tensor]]:
    """``(logits, acts)``: one forward of a ``TransformerBridge`` keeping, for ``layers``,
    ``hooks.pattern(l)`` [b, H, S, S] and ``hooks.z(l)`` [b, S, H, d_head] (and
    ``hooks.FINAL_NORM_IN`` [b, S, D]; ``hooks.attn_module_out(l)`` [b, S, D] where a
    post-attention norm follows) as the run produced them: differentiable when the run is."""
    acts: dict[str, Tensor] = {}

    def keep(t: Tensor, hook: Any, name: str = "") -> Tensor:
        acts[name] = t
        return t

    names = [f(lay) for lay in layers for f in (hooks.pattern, hooks.z)]
    names += [hooks.attn_module_out(lay) for lay in layers
              if hooks.post_norm(model, lay, "attn") is not None]
    if final_norm:
        names.append(hooks.FINAL_NORM_IN)
    # bind the public name: inside a hook, hook.name is the bridge's internal name (FIELD-NOTES)
    fwd = [(n, lambda t, hook, n=n: keep(t, hook, n)) for n in names]
    with attn_result_off(model):
        logits = model.run_with_hooks(tokens, fwd_hooks=fwd)
    return logits, acts


def anchor_directions(W_U: Float[Tensor, "D V"], anchor_token_ids: Tensor) -> Float[Tensor, "D A"]:
    """``u_a = W_U[:, tok(a)] - mean_b W_U[:, tok(b)]`` (detached)."""
    cols = W_U.detach()[:, anchor_token_ids.to(W_U.device)].float()
    return cols - cols.mean(1, keepdim=True)


def _cos(w: Float[Tensor, "N D"], u: Float[Tensor, "D A"]) -> Float[Tensor, "N A"]:
    wn = w / w.norm(dim=-1, keepdim=True).clamp(min=1e-30)
    un = u / u.norm(dim=0, keepdim=True).clamp(min=1e-30)
    return wn @ un


@dataclass
class Signals:
    """Pooled signals of one model on one batch (module docstring; ``None``: not read)."""

    p1_attn: Tensor
    p1_profile: Tensor
    p1_alignment: Tensor
    p2_loop: Tensor
    p2_effect: Tensor
    ns_attn1: Tensor | None = None
    ns_attn2: Tensor | None = None

    def detach(self) -> Signals:
        return Signals(**{f.name: None if getattr(self, f.name) is None
                          else getattr(self, f.name).detach() for f in fields(self)})


def _pooled(acts: dict[str, Tensor], w: Tensor, b: Tensor, q: Tensor, W_O: dict[int, Tensor],
            post: dict[int, tuple[str, Tensor, float]]) -> tuple[Tensor | None, Tensor | None]:
    """(attention rows [N, S], write [N, D]) pooled with ``w`` [L, H] at rows ``(b, q)``; a
    layer in ``post`` (Gemma 2's post-attention norm) writes through that norm as the run
    scaled it (its scale detached, as the final norm's)."""
    attn = write = None
    for lay in (w.abs().sum(1) > 0).nonzero()[:, 0].tolist():
        wl = w[lay].to(acts[hooks.z(lay)].dtype).to(acts[hooks.z(lay)].device)
        a = torch.einsum("nhs,h->ns", acts[hooks.pattern(lay)][b, :, q], wl)
        o = torch.einsum("nhd,h,hdm->nm", acts[hooks.z(lay)][b, q], wl, W_O[lay])
        if lay in post:
            x = acts[hooks.attn_module_out(lay)][b, q].detach()
            o = final_norm_linear(o[:, None], x, *post[lay])[:, 0].to(o.dtype)
        attn = a if attn is None else attn + a
        write = o if write is None else write + o
    return attn, write


def readout(model: Any, acts: dict[str, Tensor], qs: Queries, pool: Pooling,
            anchor_token_ids: Tensor) -> Signals:
    """The model's signals at ``qs`` pooled with ``pool`` (module docstring), from the
    activations of ``run_and_capture``."""
    S = acts[hooks.FINAL_NORM_IN].shape[1]
    dev = acts[hooks.FINAL_NORM_IN].device
    W_O = {lay: model.blocks[lay].attn.W_O for lay in pool.layers()}
    post = {lay: norm_params(model, n, f"block {lay}'s post-attention norm")
            for lay in pool.layers() if (n := hooks.post_norm(model, lay, "attn")) is not None}
    W_U = model.W_U.detach()
    U = anchor_directions(W_U, anchor_token_ids)
    n1, n2 = len(qs.b1), len(qs.b2)
    b1, q1, b2, q2 = (t.to(dev) for t in (qs.b1, qs.q1, qs.b2, qs.q2))
    attn1, write1 = _pooled(acts, pool.w1, b1, q1, W_O, post) if n1 else (None, None)
    if attn1 is None:
        attn1, profile, align = torch.zeros(n1, S), torch.zeros(n1, U.shape[1]), torch.zeros(n1)
    else:
        profile = _cos(write1.float(), U)  # [N1, A]
        A = profile.shape[1]
        own = profile.gather(1, qs.anchor1.to(dev)[:, None])[:, 0]
        align = own - (profile.sum(1) - own) / max(A - 1, 1)
    K = qs.keys2.shape[1]
    attn2, write2 = _pooled(acts, pool.w2, b2, q2, W_O, post) if n2 else (None, None)
    if attn2 is None:
        loop, effect = torch.zeros(n2, K + 1), torch.zeros(n2, K)
    else:
        valid = qs.valid2.to(dev)
        keys = qs.keys2.clamp(min=0).to(dev)
        on = attn2.gather(1, keys) * valid  # [N2, K]
        loop = torch.cat([on, (1 - on.sum(1, keepdim=True)).clamp(min=0)], 1)
        x = acts[hooks.FINAL_NORM_IN][b2, q2].detach()
        scaled = final_norm_linear(write2[:, None], x, *final_norm(model))[:, 0]  # [N2, D]
        cols = W_U.float()[:, qs.tok2.clamp(min=0).to(dev)]  # [D, N2, K]
        eff = torch.einsum("nd,dnk->nk", scaled, cols) * valid
        mean = eff.sum(1, keepdim=True) / valid.sum(1, keepdim=True).clamp(min=1)
        effect = (eff - mean) * valid
    ns1 = ns2 = None
    if pool.ns_layers:
        def ns(b: Tensor, q: Tensor) -> Tensor:
            return torch.stack([acts[hooks.pattern(lay)][b, :, q].mean(1)
                                for lay in pool.ns_layers], 1)  # [N, L_T, S]
        ns1, ns2 = ns(b1, q1), ns(b2, q2)
    return Signals(attn1, profile, align, loop, effect, ns1, ns2)


# --- fingerprints -----------------------------------------------------------------------------


def model_fingerprint(model: Any) -> str:
    """sha256 (16 hex) of every parameter: name, shape, dtype, bytes."""
    h = hashlib.sha256()
    for name, t in sorted(plain_parameters(model).items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def scores_hash(scores: Any) -> str:
    """sha256 (16 hex) of the score table's columns, rows ordered by (layer, head)."""
    frame = scores[list(SCORE_COLUMNS)].sort_values(["layer", "head"])
    return hashlib.sha256(frame.to_csv(index=False, float_format="%.17g").encode()
                          ).hexdigest()[:16]


# --- the store --------------------------------------------------------------------------------


@dataclass
class StoreOptions:
    """What a store holds: head counts pooled per phase, non-selective per-layer attention,
    the teacher's top-k logits (0: none), examples per shard."""

    top_k1: int = 4
    top_k2: int = 4
    nonselective: bool = True
    topk_logits: int = 0
    shard_size: int = 1024

    def check(self) -> None:
        for k in ("top_k1", "top_k2", "shard_size"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{k} must be a positive integer, got {getattr(self, k)}.")
        if self.topk_logits < 0:
            raise ValueError(f"topk_logits must be >= 0, got {self.topk_logits}.")


def _signal_tensors(sig: Signals, qs: Queries) -> dict[str, Tensor]:
    out = dict(p1_b=qs.b1.int(), p1_q=qs.q1.int(), p1_w=qs.w1.float(), p1_anchor=qs.anchor1.int(),
               p2_b=qs.b2.int(), p2_q=qs.q2.int(), p2_w=qs.w2.float(), p2_keys=qs.keys2.int(),
               p2_tok=qs.tok2.int())
    for f in fields(sig):
        v = getattr(sig, f.name)
        if v is not None:
            out[f.name] = v.detach().float().cpu()
    return out


@torch.no_grad()
def teacher_signals(teacher: Any, tokens: Tensor, pool: Pooling, lay: Layout,
                    topk_logits: int = 0, batch_size: int = 64) -> dict[str, Tensor]:
    """Signals of ``teacher`` on CoT rows ``tokens`` as the tensors a shard holds (query rows
    indexed into ``tokens``)."""
    dev = next(teacher.parameters()).device
    parts: list[dict[str, Tensor]] = []
    anchors = torch.tensor(lay.anchor_token_ids)
    for s in range(0, len(tokens), batch_size):
        chunk = tokens[s: s + batch_size]
        qs = queries(chunk, lay)
        logits, acts = run_and_capture(teacher, chunk.to(dev), pool.layers())
        t = _signal_tensors(readout(teacher, acts, qs, pool, anchors), qs)
        t["p1_b"] += s
        t["p2_b"] += s
        if topk_logits:
            v, i = logits.float().topk(topk_logits, dim=-1)
            t["topk_val"], t["topk_idx"] = v.cpu(), i.int().cpu()
        parts.append(t)
    out = {}
    for k in parts[0]:
        if k in ("p2_keys", "p2_tok"):
            K = max(p[k].shape[1] for p in parts)
            out[k] = torch.cat([torch.nn.functional.pad(p[k], (0, K - p[k].shape[1]), value=-1)
                                for p in parts])
        elif k in ("p2_loop", "p2_effect"):
            K = max(p["p2_keys"].shape[1] for p in parts)
            extra = 1 if k == "p2_loop" else 0
            out[k] = torch.cat([_pad_loop(p[k], K + extra, k == "p2_loop") for p in parts])
        else:
            out[k] = torch.cat([p[k] for p in parts])
    return out


def _pad_loop(t: Tensor, width: int, loop: bool) -> Tensor:
    """Widen shortlist columns to ``width`` keeping the last column (the "elsewhere" mass) of a
    loop distribution last."""
    if t.shape[1] == width:
        return t
    if not loop:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))
    return torch.cat([t[:, :-1], t.new_zeros(len(t), width - t.shape[1]), t[:, -1:]], 1)


@dataclass
class StoreSpec:
    """What a store must match: fingerprints of the teacher, the score table and the task."""

    teacher: str
    scores: str
    task: str
    options: dict[str, Any] = field(default_factory=dict)


def _manifest_mismatch(man: dict, spec: StoreSpec) -> list[str]:
    bad = []
    for key, want in (("teacher_fingerprint", spec.teacher), ("scores_hash", spec.scores),
                      ("task_fingerprint", spec.task)):
        if man.get(key) != want:
            bad.append(f"{key} {man.get(key)} != this run's {want}")
    if spec.options and man.get("options") != spec.options:
        bad.append(f"options {man.get('options')} != this run's {spec.options}")
    return bad


def teacher_folder(teacher: Any) -> Path | None:
    """The HF folder ``teacher`` was loaded from, if its weights there are the ones in memory
    (then its CoT can come from KV-cached ``generate``; the bridge's own HF model cannot
    ``generate``: its attention modules are wrapped)."""
    from transformers import AutoModelForCausalLM

    name = getattr(getattr(hf_model_of(teacher), "config", None), "_name_or_path", "") or ""
    path = Path(name)
    if not (path / "config.json").exists():
        return None
    try:
        fresh = AutoModelForCausalLM.from_pretrained(path)
    except (OSError, ValueError):
        return None
    return path if model_fingerprint(fresh) == model_fingerprint(teacher) else None


def teacher_rows(teacher: Any, task: Any, folder: Path | None = None
                 ) -> tuple[Int[Tensor, "b s"], Tensor]:
    """``(tokens, mask)``: rows ``note <think> + the teacher's greedy continuation`` and the
    continuation's positions, right-padded with ``task.pad_id``. From ``folder``
    (``training.teacher_cot``, KV cache) when given, else decoded through the bridge
    (``evaluation.greedy_decode``: no cache, same tokens)."""
    if folder is not None:
        from circuitkit.training import teacher_cot

        return teacher_cot(task, str(folder))
    from circuitkit.evaluation import greedy_decode, prompt_end

    think = task.vocab.index("<think>") if "<think>" in task.vocab else None
    prompts = [e.tokens[: prompt_end(e, think)] for e in task.examples]
    width = task.clean_tokens.shape[1] + 4
    gens = greedy_decode(teacher, prompts, task.eos_id, max(1, width - min(map(len, prompts))))
    tokens = torch.full((len(prompts), width), task.pad_id, dtype=torch.long)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        g = g[: width - len(p)]
        tokens[i, : len(p)] = p
        tokens[i, len(p): len(p) + len(g)] = torch.tensor(g, dtype=torch.long)
        mask[i, len(p): len(p) + len(g)] = True
    return tokens, mask


def build_store(teacher: Any, pool_task: Any, scores: Any, out: str | Path,
                options: StoreOptions | None = None, teacher_name: str | None = None,
                progress: bool = True, batch_size: int = 64) -> SignalStore:
    """Write the teacher-signal store of ``pool_task`` to ``out`` (or resume one, or return the
    finished one); see the module docstring. ``teacher``: a ``TransformerBridge``
    (``ck.load_model``); its CoT: ``teacher_rows``."""
    from circuitkit.files import check_writable_dir, lock_folder

    options = options or StoreOptions()
    options.check()
    out = check_writable_dir(out, "signal store folder")
    with lock_folder(out, "signal store folder"):  # one builder at a time
        return _build_store(teacher, pool_task, scores, out, options, teacher_name, progress,
                            batch_size)


def _build_store(teacher: Any, pool_task: Any, scores: Any, out: Path, options: StoreOptions,
                 teacher_name: str | None, progress: bool, batch_size: int) -> SignalStore:
    from circuitkit.files import sha256_file, write_json, write_tensors

    f = hooks.facts(teacher)
    pool = Pooling.teacher(scores, f.n_layers, f.n_heads, options.top_k1, options.top_k2,
                           options.nonselective)
    lay = Layout.of(pool_task)
    spec = StoreSpec(model_fingerprint(teacher), scores_hash(scores), pool_task.fingerprint(),
                     _options_dict(options))
    if (out / MANIFEST).exists():
        return SignalStore.open(out, spec)
    head = dict(format=FORMAT, teacher=teacher_name, teacher_fingerprint=spec.teacher,
                scores_hash=spec.scores, task_fingerprint=spec.task, options=spec.options,
                task_config=pool_task.config, n_vocab=len(pool_task.vocab),
                pad_id=int(pool_task.pad_id),
                teacher_shape=dict(n_layers=f.n_layers, n_heads=f.n_heads, d_model=f.d_model),
                anchor_token_ids=list(lay.anchor_token_ids),
                weights=dict(p1=_nonzero(pool.w1), p2=_nonzero(pool.w2)))
    partial = out / PARTIAL
    known: dict[str, dict] = {}  # shards a killed build finished: kept if they still match
    if partial.exists():
        old = _read_json(partial, out)
        if not isinstance(old, dict) or {k: old.get(k) for k in head} != head:
            raise StoreProblem(f"{out} holds a partly built signal store for another teacher, "
                               "score table, task or options; delete the folder or choose "
                               "another.")
        known = {e["file"]: e for e in old.get("shards", []) if isinstance(e, dict)
                 and isinstance(e.get("file"), str)}
    else:
        write_json(partial, head)
    n = len(pool_task)
    starts = list(range(0, n, options.shard_size))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc="teacher signals", unit="note", file=sys.stderr)
    shards = []
    folder = teacher_folder(teacher)
    for i, s in enumerate(starts):
        path = out / f"shard-{i:05d}.safetensors"
        sub = pool_task.subset(range(s, min(s + options.shard_size, n)))
        entry = known.get(path.name)
        if not (entry is not None and entry.get("n_examples") == len(sub) and path.is_file()
                and sha256_file(path) == entry.get("sha256")):
            tokens, mask = teacher_rows(teacher, sub, folder)
            t = teacher_signals(teacher, tokens, pool, lay, options.topk_logits, batch_size)
            t.update(tokens=tokens.int(), mask=mask.to(torch.uint8))
            write_tensors(path, t)
            entry = dict(file=path.name, n_examples=len(sub), width=_width(path),
                         bytes=path.stat().st_size, sha256=sha256_file(path))
        shards.append(entry)
        write_json(partial, dict(head, shards=shards))  # a kill from here on keeps this shard
        if bar is not None:
            bar.update(len(sub))
    if bar is not None:
        bar.close()
    man = dict(head, shards=shards, n_examples=n, bytes=sum(s["bytes"] for s in shards))
    write_json(out / MANIFEST, man)
    partial.unlink(missing_ok=True)
    steps = {k: sum(_shape(out / s["file"], k)[0] for s in shards) for k in ("p1_b", "p2_b")}
    if not steps["p1_b"] or not steps["p2_b"]:
        import warnings

        gone = [(p, t) for p, t, k in (("Phase-1 anchor steps", "L_P1", "p1_b"),
                                       ("Phase-2 answer steps", "L_P2", "p2_b")) if not steps[k]]
        warnings.warn(f"signal store {out}: the teacher's greedy CoT of these {n} notes has no "
                      f"{' and no '.join(p for p, _ in gone)}, so "
                      f"{' and '.join(t for _, t in gone)} will be 0 in training: is the teacher "
                      "trained on this task?", stacklevel=2)
    return SignalStore.open(out, spec)


def _read_json(file: Path, store: Path) -> Any:
    """``file`` parsed; a damaged one is one line naming it (and the folder to delete)."""
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise StoreProblem(f"{file}: not valid JSON (truncated?) at line {e.lineno} column "
                           f"{e.colno}; delete the folder {store} to rebuild the store.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise StoreProblem(f"{file} is unreadable ({e}); delete the folder {store} to rebuild the "
                           "store.") from None


_SHARD_NAME = re.compile(r"^shard-\d{5}\.safetensors$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_manifest(man: dict, store: Path) -> None:
    """Every field a store's ``manifest.json`` needs, of the right type and range; a bad one is
    a ``ValueError`` naming the file and the field."""
    file = store / MANIFEST

    def bad(field_: str, want: str, got: Any) -> StoreProblem:
        return StoreProblem(f"{file}: field {field_!r} must be {want}; got {got!r:.80}. The "
                            f"manifest is damaged: delete the folder {store} to rebuild the store.")

    def integer(v: Any, lo: int, hi: float = math.inf) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi

    def need(key: str, ok: Any, want: str) -> Any:
        v = man.get(key)
        if not ok(v):
            raise bad(key, want, v)
        return v

    for key in ("teacher_fingerprint", "scores_hash", "task_fingerprint"):
        need(key, lambda v: isinstance(v, str) and v != "", "a non-empty string")
    opts = need("options", lambda v: isinstance(v, dict), "an object")
    for key, lo in (("top_k1", 1), ("top_k2", 1), ("topk_logits", 0), ("shard_size", 1)):
        if not integer(opts.get(key), lo):
            raise bad(f"options.{key}", f"an integer >= {lo}", opts.get(key))
    if not isinstance(opts.get("nonselective"), bool):
        raise bad("options.nonselective", "true or false", opts.get("nonselective"))
    n_vocab = need("n_vocab", lambda v: integer(v, 1), "a positive integer")
    need("pad_id", lambda v: integer(v, 0, n_vocab), f"a token id in [0, {n_vocab})")
    shape = need("teacher_shape", lambda v: isinstance(v, dict), "an object")
    for key in ("n_layers", "n_heads", "d_model"):
        if not integer(shape.get(key), 1):
            raise bad(f"teacher_shape.{key}", "a positive integer", shape.get(key))
    need("anchor_token_ids", lambda v: isinstance(v, list) and v != [] and all(
        integer(t, 0, n_vocab) for t in v), f"a non-empty list of token ids in [0, {n_vocab})")
    weights = need("weights", lambda v: isinstance(v, dict), "an object")
    for k in ("p1", "p2"):
        rows = weights.get(k)
        if not isinstance(rows, list) or not all(
                isinstance(r, list) and len(r) == 3 and integer(r[0], 0, shape["n_layers"])
                and integer(r[1], 0, shape["n_heads"]) and _number(r[2])
                and math.isfinite(r[2]) and r[2] >= 0 for r in rows):
            raise bad(f"weights.{k}", f"a list of [layer < {shape['n_layers']}, head < "
                      f"{shape['n_heads']}, finite weight >= 0]", rows)
    shards = need("shards", lambda v: isinstance(v, list) and v != [], "a non-empty list")
    for i, e in enumerate(shards):
        if not isinstance(e, dict) or not isinstance(e.get("file"), str) or not \
                _SHARD_NAME.match(e["file"]):
            raise bad(f"shards[{i}].file", "a name shard-NNNNN.safetensors", e)
        for key in ("n_examples", "width", "bytes"):
            if not integer(e.get(key), 1):
                raise bad(f"shards[{i}].{key}", "a positive integer", e.get(key))
        if not isinstance(e.get("sha256"), str) or not _SHA256.match(e["sha256"]):
            raise bad(f"shards[{i}].sha256", "64 hex digits", e.get("sha256"))
    if len({e["file"] for e in shards}) != len(shards):
        raise bad("shards", "distinct files", [e["file"] for e in shards])
    total = sum(e["n_examples"] for e in shards)
    need("n_examples", lambda v: v == total, f"the sum of the shards' n_examples ({total})")
    need("bytes", lambda v: v == sum(e["bytes"] for e in shards), "the sum of the shards' bytes")


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def check_shards(man: dict, store: Path) -> None:
    """Each shard file exists, has the manifest's size and SHA-256; otherwise a ``ValueError``
    naming the shard (swapped, edited, truncated or missing)."""
    from circuitkit.files import sha256_file

    for e in man["shards"]:
        file = store / e["file"]
        if not file.is_file():
            problem = "is missing"
        elif file.stat().st_size != e["bytes"]:
            problem = (f"has {file.stat().st_size} bytes, the manifest says {e['bytes']} "
                       "(truncated, swapped or replaced)")
        elif sha256_file(file) != e["sha256"]:
            problem = ("does not match its SHA-256 in the manifest (edited, or swapped with "
                       "another shard)")
        else:
            continue
        raise StoreProblem(f"signal store shard {file} {problem}; delete the folder {store} to "
                           "rebuild the store.")


def _shape(path: Path, key: str) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.get_slice(key).get_shape())


def _width(path: Path) -> int:
    return _shape(path, "tokens")[1]


def _options_dict(o: StoreOptions) -> dict[str, Any]:
    return dict(top_k1=o.top_k1, top_k2=o.top_k2, nonselective=o.nonselective,
                topk_logits=o.topk_logits, shard_size=o.shard_size)


def _nonzero(w: Tensor) -> list[list[float]]:
    return [[int(a), int(b), float(w[a, b])] for a, b in (w != 0).nonzero().tolist()]


class SignalStore:
    """A finished store (``open`` checks its manifest); ``shard(i)`` loads one shard."""

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = Path(path), manifest
        self._cache: tuple[int, dict[str, Tensor]] | None = None

    @classmethod
    def open(cls, path: str | Path, spec: StoreSpec | None = None) -> SignalStore:
        """Open the store at ``path``; with ``spec``, refuse it unless its teacher fingerprint,
        score-table hash, task fingerprint (and options, when given) match."""
        path = Path(path)
        if not (path / MANIFEST).exists():
            hint = " (a build was interrupted: run it again to finish)" \
                if (path / PARTIAL).exists() else ""
            raise ValueError(f"{path} is not a finished teacher-signal store: no {MANIFEST}"
                             f"{hint}.")
        man = _read_json(path / MANIFEST, path)
        if not isinstance(man, dict) or man.get("format") != FORMAT:
            got = man.get("format") if isinstance(man, dict) else type(man).__name__
            raise StoreProblem(f"{path / MANIFEST} is format {got!r}, expected {FORMAT!r} (a "
                               f"SHA-256 per shard); delete the folder {path} to rebuild the "
                               "store.")
        check_manifest(man, path)
        if spec is not None:
            bad = _manifest_mismatch(man, spec)
            if bad:
                raise StoreProblem(f"teacher-signal store {path} does not match this run ("
                                   + "; ".join(bad) + "): it was built for another teacher, "
                                   "score table or task. Delete it or use another folder.")
        check_shards(man, path)
        return cls(path, man)

    @property
    def n_examples(self) -> int:
        return int(self.manifest["n_examples"])

    @property
    def anchor_token_ids(self) -> Tensor:
        return torch.tensor(self.manifest["anchor_token_ids"], dtype=torch.long)

    def pooling(self) -> Pooling:
        """The teacher's pooling weights as built."""
        sh = self.manifest["teacher_shape"]
        w = []
        for k in ("p1", "p2"):
            m = torch.zeros(sh["n_layers"], sh["n_heads"])
            for a, b, v in self.manifest["weights"][k]:
                m[a, b] = v
            w.append(m)
        ns = tuple(range(sh["n_layers"])) if self.manifest["options"]["nonselective"] else ()
        return Pooling(w[0], w[1], ns)

    def shard(self, i: int) -> dict[str, Tensor]:
        if self._cache is not None and self._cache[0] == i:
            return self._cache[1]
        from safetensors.torch import load_file

        file = self.path / self.manifest["shards"][i]["file"]
        try:
            data = load_file(str(file))
        except Exception as e:  # noqa: BLE001 - safetensors has its own error types
            raise StoreProblem(f"signal store shard {file} is unreadable ({type(e).__name__}: "
                               f"{e}); delete the folder {self.path} to rebuild the "
                               "store.") from None
        self._cache = (i, data)  # one shard in memory at a time
        return data

    def batch(self, shard: int, idx: Sequence[int]) -> Batch:
        """Examples ``idx`` (distinct) of one shard as a ``Batch``, trimmed to their longest
        row."""
        d = self.shard(shard)
        idx_t = torch.as_tensor(list(idx), dtype=torch.long)
        tokens = d["tokens"][idx_t].long()
        mask = d["mask"][idx_t].bool()
        width = int((tokens != self.manifest["pad_id"]).any(0).nonzero().max()) + 1
        tokens, mask = tokens[:, :width], mask[:, :width]
        inv = torch.full((len(d["tokens"]),), -1, dtype=torch.long)
        inv[idx_t] = torch.arange(len(idx_t))
        r1 = inv[d["p1_b"].long()] >= 0
        r2 = inv[d["p2_b"].long()] >= 0
        keys, tok = d["p2_keys"][r2].long(), d["p2_tok"][r2].long()
        K = int((keys >= 0).sum(1).max()) if len(keys) else 0
        qs = Queries(inv[d["p1_b"][r1].long()], d["p1_q"][r1].long(), d["p1_w"][r1],
                     d["p1_anchor"][r1].long(), inv[d["p2_b"][r2].long()],
                     d["p2_q"][r2].long(), d["p2_w"][r2], keys[:, :K], tok[:, :K])
        loop = d["p2_loop"][r2]
        loop = torch.cat([loop[:, :K], loop[:, -1:]], 1)
        sig = Signals(d["p1_attn"][r1][:, :width], d["p1_profile"][r1], d["p1_alignment"][r1],
                      loop, d["p2_effect"][r2][:, :K],
                      d["ns_attn1"][r1][..., :width] if "ns_attn1" in d else None,
                      d["ns_attn2"][r2][..., :width] if "ns_attn2" in d else None)
        topk = None
        if "topk_val" in d:
            topk = (d["topk_val"][idx_t][:, :width], d["topk_idx"][idx_t][:, :width].long())
        return Batch(tokens, mask, qs, sig, topk)


@dataclass
class Batch:
    """One training batch: CoT rows, their loss mask, query rows, the teacher's signals and
    (optionally) its top-k logits ``(values, indices)`` [b, s, k]."""

    tokens: Tensor
    mask: Tensor
    queries: Queries
    teacher: Signals
    topk: tuple[Tensor, Tensor] | None = None


class BatchStream:
    """Deterministic batches from a store: epoch ``e`` visits the shards in a permuted order
    (seeded by ``(seed, e)``) and each shard's examples in a permuted order (seeded by
    ``(seed, e, shard)``), ``batch_size`` at a time (a shard's remainder is dropped). Batch ``i``
    depends only on ``(seed, i)``, so a resumed run draws exactly the batches a whole one would.
    Holds one shard in memory."""

    def __init__(self, store: SignalStore, batch_size: int, seed: int):
        sizes = [s["n_examples"] for s in store.manifest["shards"]]
        self.per_shard = [n // batch_size for n in sizes]
        if sum(self.per_shard) == 0:
            raise ValueError(f"batch_size {batch_size} is larger than every shard of the store "
                             f"({max(sizes)} examples); lower it or use larger shards.")
        self.store, self.batch_size, self.seed = store, batch_size, seed
        self.per_epoch = sum(self.per_shard)

    def _gen(self, *key: int) -> torch.Generator:
        return torch.Generator().manual_seed(hash_ints(self.seed, *key))

    def locate(self, i: int) -> tuple[int, list[int]]:
        epoch, j = divmod(i, self.per_epoch)
        order = torch.randperm(len(self.per_shard), generator=self._gen(epoch)).tolist()
        for shard in order:
            if j < self.per_shard[shard]:
                n = self.store.manifest["shards"][shard]["n_examples"]
                perm = torch.randperm(n, generator=self._gen(epoch, shard + 1)).tolist()
                return shard, perm[j * self.batch_size: (j + 1) * self.batch_size]
            j -= self.per_shard[shard]
        raise AssertionError("unreachable")

    def __getitem__(self, i: int) -> Batch:
        return self.store.batch(*self.locate(i))

    def __iter__(self) -> Iterator[Batch]:
        i = 0
        while True:
            yield self[i]
            i += 1


def hash_ints(*xs: int) -> int:
    """A 63-bit seed from integers (stable across processes, unlike ``hash``)."""
    d = hashlib.sha256(json.dumps(list(xs)).encode()).digest()
    return int.from_bytes(d[:8], "little") & ((1 << 63) - 1)
