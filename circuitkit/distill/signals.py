"""Teacher signals for mechanistic distillation, and the store that streams them to training.
docs/distill.md is the reference (query rows, which heads, the student's head map, the store).

A *signal* is what one of the teacher's top Phase-1 / Phase-2 heads (``phase_heads``) does at the
query positions of its own chain of thought. Each teacher head is matched by its own student head
(``head_map``), read by the same code (``readout``) at the same hook names (``hooks.pattern``,
``hooks.z``, ``hooks.v``, ``hooks.FINAL_NORM_IN``), so a loss compares like with like.

Rows (the token at ``p`` is predicted from the logits at ``p - 1``; ``queries`` parses a CoT row
``<bos> note <think> anchors <sl> shortlist </think> answer <eos>``): Phase-1 rows ``(b1, q1)``,
``q1 = p - 1`` for each anchor token ``p``; Phase-2 rows ``(b2, q2)``, ``q2 = p - 1`` for each
answer label ``p`` (``heads="causal"``: each shortlist entry; entries after ``q2`` masked), keys
``keys2`` the shortlist positions, ``tok2`` their tokens; row weights ``w = 1 / (steps of that
example)``.

Signals (``N1``/``N2`` query rows, ``k1``/``k2`` heads, ``S`` keys, ``A`` anchors, ``K``
shortlist keys, ``D`` d_model of the model read; ``w = z[b, q, h] @ W_O[l, h]`` a head's write):

=============  ===========  ====================================================================
p1_attn        [N1, k1, S]  ``pattern_l[b, h, q, :]``: where the head reads (keys ``0..q``)
p1_profile     [N1, k1, A]  ``cos(w, u_a)`` for every anchor ``a``, ``u`` the model's own centred
                            anchor directions of the reading (``scoring.coarse.
                            anchor_directions``): the write in anchor-alignment space
p1_alignment   [N1, k1]     ``cos(w, u_c) - mean_{a != c} cos(w, u_a)``, ``c`` the anchor
                            predicted at that step (the head's anchor_alignment at that row)
p2_loop        [N2, k2,     ``(pattern_l[b, h, q, keys], 1 - their sum)``: attention over the
               K+1]         shortlist entries plus the mass elsewhere
p2_effect      [N2, k2, K]  ``e_k = n(w_SL) . W_U[:, tok_k] - mean_j n(w_SL) . W_U[:, tok_j]``,
                            ``w_SL = sum_{s in keys} A[s] v[b, s, h] @ W_O[l, h]``: what the head
                            writes from the shortlist entries it reads, as logits of the
                            shortlist labels through the frozen final norm ``n``, centred
ns_attn1/2     [N, L_T, S]  non-selective baseline: per teacher layer the mean over *all* its
                            heads (student: over all heads of the mapped layer)
=============  ===========  ====================================================================

``W_U``, the final-norm weight and the run's norm scales are detached (the reading frame);
``W_O``, patterns, ``z`` and ``v`` keep their gradients, so a signal's gradient reaches its own
head's weights and what they read, never another head of that layer.

Store (``build_store``/``SignalStore``): safetensors shards of ``shard_size`` examples (CoT rows,
loss mask, query rows, signals, optionally the teacher's top-k logits) and ``manifest.json``
(fingerprints of teacher, score table and task, options, heads, a SHA-256 per shard and per
field); resumable shard by shard (``manifest.partial.json``); ``SignalStore.open`` refuses a
malformed, mismatched or damaged store naming the field or shard. Training reads one shard at a
time (``BatchStream``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from circuitkit import hooks
from circuitkit._progress import tqdm
from circuitkit.evaluation import greedy_decode, task_prompts
from circuitkit.files import check_writable_dir, lock_folder, sha256_file, write_json, write_tensors
from circuitkit.identity import model_fingerprint, same_weights  # the one model fingerprint
from circuitkit.models import hf_model_of, hf_progress, plain_parameters  # noqa: F401 (re-exported)
from circuitkit.patching.shortcuts import attn_result_off  # nothing here reads hook_result
from circuitkit.scoring.coarse import anchor_directions, cosines
from circuitkit.scoring.refine import final_norm, final_norm_linear, norm_params
from circuitkit.training import cot_rows, teacher_cot

FORMAT = "circuitkit.distill.signals/5"  # /2: a SHA-256 per shard; /3: per-head signals;
# /4: a SHA-256 per manifest field (``manifest_checksums``); /5: FORMAT_CHANGE
FORMAT_CHANGE = ("since /5 teacher_fingerprint is identity.model_fingerprint, the one checkpoints "
                 "and result files store, not the store's own hash: a store built before cannot "
                 "be matched to its teacher")
MANIFEST = "manifest.json"
PARTIAL = "manifest.partial.json"
SCORE_COLUMNS = ("layer", "head", "sharpness", "anchor_alignment", "coarse_score",
                 "anchor_alignment_tokens", "coarse_score_tokens", "shortlist_share",
                 "key_preference", "loopback", "margin_widening", "refine_score", "phase1_rank",
                 "phase1_rank_tokens", "phase2_rank")


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


def queries(tokens: Int[Tensor, "b s"], lay: Layout, heads: str = "scores") -> Queries:
    """Phase-1 and Phase-2 query rows of CoT rows ``tokens`` (module docstring); Phase 2 at
    the answer steps, or at the shortlist steps for ``heads="causal"``."""
    at_shortlist = check_heads(heads) == "causal"
    tok2anchor = {t: i for i, t in enumerate(lay.anchor_token_ids)}
    b1, q1, w1, a1, b2, q2, w2, keys, toks = [], [], [], [], [], [], [], [], []
    for b, row in enumerate(tokens.tolist()):
        anchors, short, answer = parse_row(row, lay)
        b1 += [b] * len(anchors)
        q1 += [p - 1 for p in anchors]
        w1 += [1.0 / len(anchors) for _ in anchors]
        a1 += [tok2anchor[row[p]] for p in anchors]
        rows = (short if at_shortlist else answer) if short else []
        b2 += [b] * len(rows)
        q2 += [p - 1 for p in rows]
        w2 += [1.0 / len(rows) for _ in rows]
        keys += [short] * len(rows)
        toks += [[row[s] for s in short]] * len(rows)
    K = max((len(k) for k in keys), default=0)
    pad = lambda rows: torch.tensor([r + [-1] * (K - len(r)) for r in rows],  # noqa: E731
                                    dtype=torch.long).reshape(len(rows), K)
    lt = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return Queries(lt(b1), lt(q1), torch.tensor(w1), lt(a1), lt(b2), lt(q2), torch.tensor(w2),
                   pad(keys), pad(toks))


# --- heads ------------------------------------------------------------------------------------

READINGS = ("tokens", "labels")  # Phase-1 anchor directions: the anchor tokens' columns, or the
# label centroids (scoring.coarse.anchor_directions)
HEAD_SHARE = 0.5  # at most this share of a student layer's heads is supervised (the rest free)
HEAD_CHOICES = ("scores", "causal")  # heads by the descriptive scores, or by causal columns
CAUSAL_GROUPS = {1: "anchor", 2: "shortlist"}  # where each phase's causal heads are ranked


def check_heads(heads: str) -> str:
    if heads not in HEAD_CHOICES:
        raise ValueError(f"heads must be one of {list(HEAD_CHOICES)}, got {heads!r}.")
    return heads


def causal_columns(phase: int) -> tuple[str, str]:
    """``(share, rank)`` columns of ``causal_table`` that rank ``phase``'s causal heads."""
    g = CAUSAL_GROUPS[phase]
    return f"p{phase}_noise_{g}", f"p{phase}_noise_rank_{g}"


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


def check_reading(reading: str) -> str:
    if reading not in READINGS:
        raise ValueError(f"phase1_reading must be one of {list(READINGS)}, got {reading!r}.")
    return reading


def phase_column(phase: int, reading: str = "tokens", heads: str = "scores"
                 ) -> tuple[str, str]:
    """``(score, rank)`` columns ``phase``'s heads are chosen by: Phase 2 ``refine_score``,
    Phase 1 the reading's CoarseScore; ``heads="causal"``: ``causal_columns``."""
    if phase not in (1, 2):
        raise ValueError(f"phase must be 1 or 2, got {phase!r}.")
    if check_heads(heads) == "causal":
        return causal_columns(phase)
    if phase == 2:
        return "refine_score", "phase2_rank"
    return (("coarse_score_tokens", "phase1_rank_tokens") if check_reading(reading) == "tokens"
            else ("coarse_score", "phase1_rank"))


def phase_heads(scores: Any, n_layers: int, n_heads: int, phase: int, top_k: int,
                reading: str = "tokens", heads: str = "scores"
                ) -> tuple[list[tuple[int, int]], Float[Tensor, " k"]]:
    """``(heads, alpha)``: ``phase``'s top ``top_k`` heads ``(layer, head)``, best first (by the
    phase's rank; ties by (layer, head)), and their weights ``max(score, 0) / sum`` (uniform
    when none is positive; sums to 1); ``heads="causal"``: by the causal columns, the score
    ``-share`` (a noised head the phase needs has a negative share)."""
    if top_k < 1:
        raise ValueError(f"top_k must be a positive number of heads, got {top_k}.")
    check_scores(scores, n_layers, n_heads)
    causal = check_heads(heads) == "causal"
    col, rank = phase_column(phase, reading, heads)
    missing = [c for c in (col, rank) if c not in scores.columns]
    if missing:
        raise ValueError(f"scores have no causal column(s) {missing}: merge "
                         "ck.causal_table(teacher, task, directions=('noise',)) into the score "
                         "table (characterize --stages writes them into scores.csv).")
    if scores[col].isna().all():
        raise ValueError(f"scores have no {col}: the task they were computed on has no "
                         f"Phase-{phase} {'anchor' if phase == 1 else 'answer'} steps.")
    best = scores.sort_values([rank, "layer", "head"], na_position="last").head(int(top_k))
    chosen = [(int(r.layer), int(r.head)) for r in best.itertuples()]
    s = torch.tensor(best[col].astype("float64").tolist(), dtype=torch.float64)
    if causal:
        s = -s
    if bool(s.isnan().any()):  # NaN passes clamp and would turn the weights uniform unseen
        bad = [h for h, v in zip(chosen, s.tolist(), strict=True) if v != v]
        raise ValueError(f"scores[{col!r}] is NaN for head(s) (layer, head) {bad}: NaN weights or "
                         "activations in the teacher? Recompute ck.score_heads on a finite model.")
    s = s.clamp(min=0)
    s = s / s.sum() if float(s.sum()) > 0 else torch.full_like(s, 1.0 / len(s))
    return chosen, s.float()


def head_weights(scores: Any, n_layers: int, n_heads: int, phase: int, top_k: int,
                 reading: str = "tokens", heads: str = "scores") -> Float[Tensor, "L H"]:
    """``phase_heads``' weights as an ``[L, H]`` matrix (0 off the top heads; sums to 1)."""
    return _matrix((n_layers, n_heads),
                   *phase_heads(scores, n_layers, n_heads, phase, top_k, reading, heads))


def _matrix(shape: tuple[int, int], heads: Sequence[tuple[int, int]], alpha: Tensor
            ) -> Float[Tensor, "L H"]:
    """``alpha`` of each head at its ``(layer, head)`` (summed where one repeats), else 0."""
    w = torch.zeros(shape)
    for (lay, hd), a in zip(heads, alpha.tolist(), strict=True):
        w[lay, hd] += a
    return w


def layer_map(n_teacher: int, n_student: int) -> list[int]:
    """Student layer of each teacher layer at the same relative depth:
    ``floor((l + 1/2) * n_student / n_teacher)``."""
    return [min(n_student - 1, math.floor((lay + 0.5) * n_student / n_teacher))
            for lay in range(n_teacher)]


def head_map(heads: Sequence[tuple[int, int]], teacher_shape: tuple[int, int], n_layers: int,
             n_heads: int, share: float = HEAD_SHARE) -> dict[tuple[int, int], tuple[int, int]]:
    """The student head ``(layer, head)`` of each teacher head in ``heads`` (docs/distill.md):
    the identity for a student of the teacher's shape; otherwise the mapped layer's heads
    ``0, 1, ...`` in the order ``heads`` lists them, at most ``max(1, floor(share * n_heads))``
    per layer (round robin past that)."""
    if not 0 < share <= 1:
        raise ValueError(f"head share must be in (0, 1], got {share}.")
    if tuple(teacher_shape) == (n_layers, n_heads):
        return {tuple(h): tuple(h) for h in heads}
    cap = max(1, math.floor(share * n_heads))
    depth = layer_map(teacher_shape[0], n_layers)
    out: dict[tuple[int, int], tuple[int, int]] = {}
    used: dict[int, int] = {}
    for lay, hd in heads:
        if (lay, hd) in out:
            continue
        ls = depth[lay]
        out[(lay, hd)] = (ls, used.get(ls, 0) % cap)
        used[ls] = used.get(ls, 0) + 1
    return out


@dataclass
class Pooling:
    """Which heads a model's signals are read from: ``heads1``/``heads2`` ``((layer, head),
    ...)``, one per teacher head of that phase in the teacher's order (best first), with the
    teacher's weights ``alpha1``/``alpha2`` [k]; ``ns_layers`` (the model's layer read for each
    teacher layer by the non-selective baseline; empty: off); ``shape`` ``(n_layers, n_heads)``
    of the model."""

    heads1: tuple[tuple[int, int], ...]
    alpha1: Tensor
    heads2: tuple[tuple[int, int], ...]
    alpha2: Tensor
    shape: tuple[int, int]
    ns_layers: tuple[int, ...] = ()

    @classmethod
    def teacher(cls, scores: Any, n_layers: int, n_heads: int, top_k1: int = 2,
                top_k2: int = 2, nonselective: bool = False, reading: str = "tokens",
                heads: str = "scores") -> Pooling:
        h1, a1 = phase_heads(scores, n_layers, n_heads, 1, top_k1, reading, heads)
        h2, a2 = phase_heads(scores, n_layers, n_heads, 2, top_k2, heads=heads)
        return cls(tuple(h1), a1, tuple(h2), a2, (n_layers, n_heads),
                   tuple(range(n_layers)) if nonselective else ())

    def for_student(self, n_layers: int, n_heads: int, share: float = HEAD_SHARE) -> Pooling:
        """The student's pooling: each teacher head replaced by its ``head_map`` head."""
        m = head_map(self.heads1 + self.heads2, self.shape, n_layers, n_heads, share)
        ns = tuple(layer_map(self.shape[0], n_layers)[i] for i in self.ns_layers)
        return Pooling(tuple(m[h] for h in self.heads1), self.alpha1,
                       tuple(m[h] for h in self.heads2), self.alpha2, (n_layers, n_heads), ns)

    def only(self, p1: bool, p2: bool, ns: bool) -> Pooling:
        """This pooling with the phases not asked for removed (nothing of them is read)."""
        e = self.alpha1.new_zeros(0)
        return Pooling(self.heads1 if p1 else (), self.alpha1 if p1 else e,
                       self.heads2 if p2 else (), self.alpha2 if p2 else e, self.shape,
                       self.ns_layers if ns else ())

    @property
    def w1(self) -> Tensor:
        """Phase 1 as an ``[L, H]`` weight matrix (a head standing for several teacher heads
        holds their sum)."""
        return _matrix(self.shape, self.heads1, self.alpha1)

    @property
    def w2(self) -> Tensor:
        return _matrix(self.shape, self.heads2, self.alpha2)

    def layers(self) -> list[int]:
        return sorted({lay for lay, _ in self.heads1 + self.heads2} | set(self.ns_layers))

    def p2_layers(self) -> list[int]:
        return sorted({lay for lay, _ in self.heads2})


# --- reading a model --------------------------------------------------------------------------


def run_and_capture(model: Any, tokens: Tensor, layers: Sequence[int], final_norm: bool = True,
                    v_layers: Sequence[int] = ()) -> tuple[Tensor, dict[str, Tensor]]:
    """``(logits, acts)``: one forward of a ``TransformerBridge`` keeping, for ``layers``,
    ``hooks.pattern(l)`` [b, H, S, S] and ``hooks.z(l)`` [b, S, H, d_head], for ``v_layers``
    ``hooks.v(l)`` [b, S, H_kv, d_head] (and ``hooks.FINAL_NORM_IN`` [b, S, D];
    ``hooks.attn_module_out(l)`` [b, S, D] where a post-attention norm follows) as the run
    produced them: differentiable when the run is."""
    acts: dict[str, Tensor] = {}

    def keep(t: Tensor, hook: Any, name: str = "") -> Tensor:
        acts[name] = t
        return t

    names = [f(lay) for lay in layers for f in (hooks.pattern, hooks.z)]
    names += [hooks.v(lay) for lay in v_layers]
    names += [hooks.attn_module_out(lay) for lay in layers
              if hooks.post_norm(model, lay, "attn") is not None]
    if final_norm:
        names.append(hooks.FINAL_NORM_IN)
    # bind the public name: inside a hook, hook.name is the bridge's internal name (FIELD-NOTES)
    fwd = [(n, lambda t, hook, n=n: keep(t, hook, n)) for n in names]
    with attn_result_off(model):
        logits = model.run_with_hooks(tokens, fwd_hooks=fwd)
    return logits, acts


@dataclass(frozen=True)
class Anchors:
    """The anchor directions a Phase-1 write profile is read in: ``reading`` (``READINGS``),
    the anchor tokens and, for ``"labels"``, every label's token and anchor."""

    reading: str
    anchor_token_ids: tuple[int, ...]
    label_token_ids: tuple[int, ...] = ()
    label_anchor: tuple[int, ...] = ()

    @classmethod
    def of(cls, task: Any, reading: str = "tokens") -> Anchors:
        labels = check_reading(reading) == "labels"
        return cls(reading, tuple(task.anchor_token_ids.tolist()),
                   tuple(task.label_token_ids.tolist()) if labels else (),
                   tuple(task.label_anchor.tolist()) if labels else ())

    def directions(self, W_U: Float[Tensor, "D V"]) -> Float[Tensor, "D A"]:
        """Centred anchor directions of this reading (detached), ``[D, A]``."""
        lt = lambda t: torch.tensor(t, dtype=torch.long)
        return anchor_directions(W_U.detach(), lt(self.anchor_token_ids), self.reading,
                                 lt(self.label_token_ids) if self.label_token_ids else None,
                                 lt(self.label_anchor) if self.label_anchor else None)


@dataclass
class Signals:
    """Signals of one model on one batch, one slot per teacher head (module docstring;
    ``None``: not read)."""

    p1_attn: Tensor
    p1_profile: Tensor
    p1_alignment: Tensor
    p2_loop: Tensor
    p2_effect: Tensor
    ns_attn1: Tensor | None = None
    ns_attn2: Tensor | None = None


def _through_post(o: Tensor, acts: dict[str, Tensor], lay: int, b: Tensor, q: Tensor,
                  post: dict[int, tuple[str, Tensor, float]]) -> Tensor:
    """A head's write ``o`` [N, D] through layer ``lay``'s post-attention norm (Gemma 2) as the
    run scaled it (scale detached, as the final norm's); unchanged without one."""
    if lay not in post:
        return o
    x = acts[hooks.attn_module_out(lay)][b, q].detach()
    return final_norm_linear(o[:, None], x, *post[lay])[:, 0].to(o.dtype)


def _head_reads(acts: dict[str, Tensor], heads: Sequence[tuple[int, int]], b: Tensor, q: Tensor,
                W_O: dict[int, Tensor], post: dict[int, tuple[str, Tensor, float]]
                ) -> tuple[Float[Tensor, "N k S"], Float[Tensor, "N k D"]]:
    """Each head's attention row and write at rows ``(b, q)``."""
    attn, write = [], []
    for lay, hd in heads:
        attn.append(acts[hooks.pattern(lay)][b, hd, q])
        o = acts[hooks.z(lay)][b, q, hd] @ W_O[lay][hd]
        write.append(_through_post(o, acts, lay, b, q, post))
    return torch.stack(attn, 1), torch.stack(write, 1)


def _shortlist_writes(acts: dict[str, Tensor], heads: Sequence[tuple[int, int]], b: Tensor,
                      q: Tensor, on: Float[Tensor, "N k K"], keys: Int[Tensor, "N K"],
                      W_O: dict[int, Tensor], post: dict[int, tuple[str, Tensor, float]],
                      n_heads: int) -> Float[Tensor, "N k D"]:
    """``w_SL = sum_k on[n, j, k] v[b, keys[n, k], kv(h)] @ W_O[l, h]`` per head ``j = (l, h)``:
    the part of its write taken from the shortlist entries (``on``: its attention there, 0 at
    padding). GQA: query head ``h`` reads KV head ``h // (n_heads / n_kv_heads)``."""
    out = []
    for j, (lay, hd) in enumerate(heads):
        v = acts[hooks.v(lay)]  # [B, S, H_kv, d_head]
        kv = hd // max(1, n_heads // v.shape[2])
        vk = v[b[:, None], keys, kv]  # [N, K, d_head]
        z = torch.einsum("nk,nkd->nd", on[:, j].to(vk.dtype), vk)
        out.append(_through_post(z @ W_O[lay][hd], acts, lay, b, q, post))
    return torch.stack(out, 1)


def readout(model: Any, acts: dict[str, Tensor], qs: Queries, pool: Pooling,
            anchors: Anchors) -> Signals:
    """The model's signals at ``qs`` for the heads of ``pool`` (module docstring), from the
    activations of ``run_and_capture`` (with ``v_layers=pool.p2_layers()``)."""
    S = acts[hooks.FINAL_NORM_IN].shape[1]
    dev = acts[hooks.FINAL_NORM_IN].device
    H = hooks.facts(model).n_heads
    W_O = {lay: model.blocks[lay].attn.W_O for lay in pool.layers()}
    post = {lay: norm_params(model, n, f"block {lay}'s post-attention norm")
            for lay in pool.layers() if (n := hooks.post_norm(model, lay, "attn")) is not None}
    W_U = model.W_U.detach()
    n1, n2, k1, k2 = len(qs.b1), len(qs.b2), len(pool.heads1), len(pool.heads2)
    b1, q1, b2, q2 = (t.to(dev) for t in (qs.b1, qs.q1, qs.b2, qs.q2))
    A = len(anchors.anchor_token_ids)
    if n1 and k1:
        attn1, write1 = _head_reads(acts, pool.heads1, b1, q1, W_O, post)
        profile = cosines(write1.float(), anchors.directions(W_U))  # [N1, k1, A]
        own = profile.gather(2, qs.anchor1.to(dev)[:, None, None].expand(-1, k1, 1))[..., 0]
        align = own - (profile.sum(2) - own) / max(A - 1, 1)
    else:
        attn1, profile, align = torch.zeros(n1, k1, S), torch.zeros(n1, k1, A), \
            torch.zeros(n1, k1)
    K = qs.keys2.shape[1]
    if n2 and k2:
        attn2, _ = _head_reads(acts, pool.heads2, b2, q2, W_O, post)
        valid = qs.valid2.to(dev)
        keys = qs.keys2.clamp(min=0).to(dev)
        on = attn2.gather(2, keys[:, None].expand(-1, k2, -1)) * valid[:, None]  # [N2, k2, K]
        loop = torch.cat([on, (1 - on.sum(2, keepdim=True)).clamp(min=0)], 2)
        w_sl = _shortlist_writes(acts, pool.heads2, b2, q2, on, keys, W_O, post, H)
        x = acts[hooks.FINAL_NORM_IN][b2, q2].detach()
        scaled = final_norm_linear(w_sl, x, *final_norm(model))  # [N2, k2, D]
        cols = W_U.float()[:, qs.tok2.clamp(min=0).to(dev)]  # [D, N2, K]
        eff = torch.einsum("njd,dnk->njk", scaled.float(), cols) * valid[:, None]
        mean = eff.sum(2, keepdim=True) / valid.sum(1)[:, None, None].clamp(min=1)
        effect = (eff - mean) * valid[:, None]
    else:
        loop, effect = torch.zeros(n2, k2, K + 1), torch.zeros(n2, k2, K)
    ns1 = ns2 = None
    if pool.ns_layers:
        def ns(b: Tensor, q: Tensor) -> Tensor:
            return torch.stack([acts[hooks.pattern(lay)][b, :, q].mean(1)
                                for lay in pool.ns_layers], 1)  # [N, L_T, S]
        ns1, ns2 = ns(b1, q1), ns(b2, q2)
    return Signals(attn1, profile, align, loop, effect, ns1, ns2)


# --- fingerprints -----------------------------------------------------------------------------


def scores_hash(scores: Any, heads: str = "scores") -> str:
    """sha256 (16 hex) of the score table's columns (and, for ``heads="causal"``, the causal
    columns the heads are chosen by), rows ordered by (layer, head)."""
    cols = list(SCORE_COLUMNS)
    if heads == "causal":
        cols += [c for p in (1, 2) for c in causal_columns(p)]
    frame = scores[cols].sort_values(["layer", "head"])
    return hashlib.sha256(frame.to_csv(index=False, float_format="%.17g").encode()).hexdigest()[:16]


# --- the store --------------------------------------------------------------------------------


@dataclass
class StoreOptions:
    """What a store holds: teacher heads per phase, the Phase-1 reading (``READINGS``),
    non-selective per-layer attention, the teacher's top-k logits (0: none), examples per shard."""

    top_k1: int = 2
    top_k2: int = 2
    nonselective: bool = True
    topk_logits: int = 0
    shard_size: int = 1024
    phase1_reading: str = "tokens"
    heads: str = "scores"  # HEAD_CHOICES

    def check(self) -> None:
        for k in ("top_k1", "top_k2", "shard_size"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{k} must be a positive integer, got {getattr(self, k)}.")
        if self.topk_logits < 0:
            raise ValueError(f"topk_logits must be >= 0, got {self.topk_logits}.")
        check_reading(self.phase1_reading)
        check_heads(self.heads)


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
def read_teacher(teacher: Any, tokens: Tensor, qs: Queries, pool: Pooling, anchors: Anchors,
                 topk_logits: int = 0) -> tuple[Signals, tuple[Tensor, Tensor] | None]:
    """``(signals, topk)``: the teacher's signals at ``qs`` on CoT rows ``tokens`` and, with
    ``topk_logits``, its top-k logits ``(values, indices)`` [b, s, k] (else None)."""
    dev = next(teacher.parameters()).device
    logits, acts = run_and_capture(teacher, tokens.to(dev), pool.layers(),
                                   v_layers=pool.p2_layers())
    topk = logits.float().topk(topk_logits, dim=-1) if topk_logits else None
    return readout(teacher, acts, qs, pool, anchors), topk


def teacher_signals(teacher: Any, tokens: Tensor, pool: Pooling, lay: Layout, anchors: Anchors,
                    topk_logits: int = 0, batch_size: int = 64, heads: str = "scores"
                    ) -> dict[str, Tensor]:
    """Signals of ``teacher`` on CoT rows ``tokens`` as the tensors a shard holds (query rows
    indexed into ``tokens``; the shortlist axis padded to the widest batch's, -1 for keys and
    tokens, 0 for signals, a loop's "elsewhere" mass kept last)."""
    parts: list[dict[str, Tensor]] = []
    for s in range(0, len(tokens), batch_size):
        chunk = tokens[s: s + batch_size]
        qs = queries(chunk, lay, heads)
        sig, topk = read_teacher(teacher, chunk, qs, pool, anchors, topk_logits)
        t = _signal_tensors(sig, qs)
        t["p1_b"] += s
        t["p2_b"] += s
        if topk is not None:
            t["topk_val"], t["topk_idx"] = topk[0].cpu(), topk[1].int().cpu()
        parts.append(t)
    K = max(p["p2_keys"].shape[1] for p in parts)
    width = {"p2_keys": K, "p2_tok": K, "p2_effect": K, "p2_loop": K + 1}
    return {k: torch.cat([_pad_keys(p[k], width[k], k) if k in width else p[k] for p in parts])
            for k in parts[0]}


def _pad_keys(t: Tensor, width: int, key: str) -> Tensor:
    """Widen the shortlist axis (the last) of field ``key`` to ``width``: -1 for keys and
    tokens, 0 for signals, keeping the last column (the "elsewhere" mass) of a loop last."""
    if t.shape[-1] == width:
        return t
    if key != "p2_loop":
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]),
                                       value=-1 if key in ("p2_keys", "p2_tok") else 0)
    pad = t.new_zeros(*t.shape[:-1], width - t.shape[-1])
    return torch.cat([t[..., :-1], pad, t[..., -1:]], -1)


@dataclass
class StoreSpec:
    """What a store must match: fingerprints of the teacher, the score table and the task."""

    teacher: str
    scores: str
    task: str
    options: dict[str, Any] = field(default_factory=dict)


def _manifest_mismatch(man: dict, spec: StoreSpec) -> list[str]:
    want = dict(teacher_fingerprint=spec.teacher, scores_hash=spec.scores,
                task_fingerprint=spec.task, **({"options": spec.options} if spec.options else {}))
    return [f"{k} {man.get(k)} != this run's {v}" for k, v in want.items() if man.get(k) != v]


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
        with hf_progress(False):  # a probe, not a load the user asked for: no bar
            fresh = AutoModelForCausalLM.from_pretrained(path)
    except (OSError, ValueError):
        return None
    return path if same_weights(fresh, teacher) else None


def teacher_rows(teacher: Any, task: Any, folder: Path | None = None
                 ) -> tuple[Int[Tensor, "b s"], Tensor]:
    """``(tokens, mask)``: rows ``note <think> + the teacher's greedy continuation`` and the
    continuation's positions, right-padded with ``task.pad_id``. From ``folder``
    (``training.teacher_cot``, KV cache) when given, else decoded through the bridge
    (``evaluation.greedy_decode``: no cache, same tokens)."""
    if folder is not None:
        return teacher_cot(task, str(folder))
    prompts, _ = task_prompts(task)
    width = task.clean_tokens.shape[1] + 4
    gens = greedy_decode(teacher, prompts, task.eos_id, max(1, width - min(map(len, prompts))))
    return cot_rows(prompts, gens, width, task.pad_id)


def build_store(teacher: Any, pool_task: Any, scores: Any, out: str | Path,
                options: StoreOptions | None = None, teacher_name: str | None = None,
                progress: bool = True, batch_size: int = 64) -> SignalStore:
    """Write the teacher-signal store of ``pool_task`` to ``out`` (or resume one, or return the
    finished one). ``teacher``: a ``TransformerBridge``
    (``ck.load_model``); its CoT: ``teacher_rows``."""
    options = options or StoreOptions()
    options.check()
    out = check_writable_dir(out, "signal store folder")
    # one builder at a time; a finished store is read without the builders' lock, so runs
    # sharing it (the ablation's workers) never refuse each other: the manifest is written last
    # and atomically, and open() verifies every shard's SHA-256
    with nullcontext() if (out / MANIFEST).exists() else lock_folder(out, "signal store folder"):
        return _build_store(teacher, pool_task, scores, out, options, teacher_name, progress,
                            batch_size)


def _build_store(teacher: Any, pool_task: Any, scores: Any, out: Path, options: StoreOptions,
                 teacher_name: str | None, progress: bool, batch_size: int) -> SignalStore:
    f = hooks.facts(teacher)
    pool = Pooling.teacher(scores, f.n_layers, f.n_heads, options.top_k1, options.top_k2,
                           options.nonselective, options.phase1_reading, options.heads)
    lay = Layout.of(pool_task)
    anchors = Anchors.of(pool_task, options.phase1_reading)
    spec = StoreSpec(model_fingerprint(teacher), scores_hash(scores, options.heads),
                     pool_task.fingerprint(), _options_dict(options))
    head = dict(format=FORMAT, teacher=teacher_name, teacher_fingerprint=spec.teacher,
                scores_hash=spec.scores, task_fingerprint=spec.task, options=spec.options,
                task_config=pool_task.config, n_vocab=len(pool_task.vocab),
                pad_id=int(pool_task.pad_id),
                teacher_shape=dict(n_layers=f.n_layers, n_heads=f.n_heads, d_model=f.d_model),
                anchor_token_ids=list(lay.anchor_token_ids),
                label_token_ids=list(anchors.label_token_ids),
                label_anchor=list(anchors.label_anchor),
                weights=dict(p1=_ranked(pool.heads1, pool.alpha1),
                             p2=_ranked(pool.heads2, pool.alpha2)))
    if (out / MANIFEST).exists():
        return _derived_match(SignalStore.open(out, spec), head)
    partial = out / PARTIAL
    known: dict[str, dict] = {}  # shards a killed build finished: kept if they still match
    if partial.exists():
        old = _read_json(partial, out)
        if not isinstance(old, dict) or {k: old.get(k) for k in head} != head:
            raise StoreProblem(f"{out} holds a partly built signal store for another teacher, "
                               "score table, task or options; delete the folder or choose another.")
        known = {e["file"]: e for e in old.get("shards", []) if isinstance(e, dict)
                 and isinstance(e.get("file"), str)}
    else:
        write_json(partial, head)
    n = len(pool_task)
    bar = tqdm(total=n, desc="teacher signals", unit="note", file=sys.stderr, disable=not progress)
    shards = []
    folder = teacher_folder(teacher)
    for i, s in enumerate(range(0, n, options.shard_size)):
        path = out / f"shard-{i:05d}.safetensors"
        sub = pool_task.subset(range(s, min(s + options.shard_size, n)))
        old = known.get(path.name, {})
        # a shard a killed build finished is kept: its width and size come from the file itself
        digest = sha256_file(path) if old.get("n_examples") == len(sub) and path.is_file() \
            else None
        if digest is None or digest != old.get("sha256"):
            tokens, mask = teacher_rows(teacher, sub, folder)
            t = teacher_signals(teacher, tokens, pool, lay, anchors, options.topk_logits,
                                batch_size, options.heads)
            t.update(tokens=tokens.int(), mask=mask.to(torch.uint8))
            write_tensors(path, t)
            digest = sha256_file(path)
        shards.append(dict(file=path.name, n_examples=len(sub), width=_shape(path, "tokens")[1],
                           bytes=path.stat().st_size, sha256=digest))
        write_json(partial, dict(head, shards=shards))  # a kill from here on keeps this shard
        bar.update(len(sub))
    bar.close()
    man = dict(head, shards=shards, n_examples=n, bytes=sum(s["bytes"] for s in shards))
    man = json.loads(json.dumps(man))  # as it reads back: the checksums are of that
    man["checksums"] = manifest_checksums(man)
    write_json(out / MANIFEST, man)
    partial.unlink(missing_ok=True)
    gone = [(p, t) for p, t, k in (("Phase-1 anchor steps", "L_P1", "p1_b"),
                                   ("Phase-2 answer steps", "L_P2", "p2_b"))
            if not sum(_shape(out / s["file"], k)[0] for s in shards)]
    if gone:
        warnings.warn(f"signal store {out}: the teacher's greedy CoT of these {n} notes has no "
                      f"{' and no '.join(p for p, _ in gone)}, so "
                      f"{' and '.join(t for _, t in gone)} will be 0 in training: is the teacher "
                      "trained on this task?", stacklevel=2)
    return _derived_match(SignalStore.open(out, spec), head)


def _derived_match(store: SignalStore, head: dict) -> SignalStore:
    """``store``, refused unless each manifest field this run derives itself (the teacher's
    heads and weights from the score table, the anchor and label ids from the task, the task
    config, the teacher's shape) equals this run's: a checksummed manifest can still have been
    rewritten whole."""
    want = json.loads(json.dumps(head))
    for key, value in want.items():
        if key != "teacher" and store.manifest.get(key) != value:  # (the name is a label)
            raise StoreProblem(f"{store.path / MANIFEST}: field {key!r} is not what this run "
                               f"derives from its teacher, score table and task "
                               f"({store.manifest.get(key)!r:.60} != {value!r:.60}); delete the "
                               f"folder {store.path} to rebuild the store.")
    return store


def manifest_checksums(man: dict) -> dict[str, str]:
    """SHA-256 (16 hex) of each field of a manifest, as canonical JSON: ``key`` for a top-level
    field, ``key.sub`` for each entry of an object, ``shards[i]`` for each shard; the
    ``checksums`` field itself excluded."""
    def digest(v: Any) -> str:
        text = json.dumps(v, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    out = {}
    for key, value in man.items():
        if key == "checksums":
            continue
        if isinstance(value, dict) and value:
            out.update({f"{key}.{k}": digest(v) for k, v in value.items()})
        elif key == "shards" and isinstance(value, list) and value:
            out.update({f"shards[{i}]": digest(v) for i, v in enumerate(value)})
        else:
            out[key] = digest(value)
    return out


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
    if opts.get("phase1_reading") not in READINGS:
        raise bad("options.phase1_reading", f"one of {list(READINGS)}", opts.get("phase1_reading"))
    if opts.get("heads", "scores") not in HEAD_CHOICES:  # stores before /4's heads: scores
        raise bad("options.heads", f"one of {list(HEAD_CHOICES)}", opts.get("heads"))
    if not isinstance(opts.get("nonselective"), bool):
        raise bad("options.nonselective", "true or false", opts.get("nonselective"))
    n_vocab = need("n_vocab", lambda v: integer(v, 1), "a positive integer")
    need("pad_id", lambda v: integer(v, 0, n_vocab), f"a token id in [0, {n_vocab})")
    shape = need("teacher_shape", lambda v: isinstance(v, dict), "an object")
    for key in ("n_layers", "n_heads", "d_model"):
        if not integer(shape.get(key), 1):
            raise bad(f"teacher_shape.{key}", "a positive integer", shape.get(key))
    n_anchors = len(need("anchor_token_ids", lambda v: isinstance(v, list) and v != [] and all(
        integer(t, 0, n_vocab) for t in v) and len(set(v)) == len(v),
        f"a non-empty list of distinct token ids in [0, {n_vocab})"))
    labels = opts["phase1_reading"] == "labels"
    n_labels = len(need("label_token_ids", lambda v: isinstance(v, list) and (v != []) == labels
                        and all(integer(t, 0, n_vocab) for t in v),
                        f"a list of token ids in [0, {n_vocab}), non-empty exactly for the "
                        "'labels' reading"))
    need("label_anchor", lambda v: isinstance(v, list) and len(v) == n_labels and all(
        integer(t, 0, n_anchors) for t in v), f"a list of {n_labels} anchor ids < {n_anchors}")
    weights = need("weights", lambda v: isinstance(v, dict), "an object")
    for k in ("p1", "p2"):
        rows = weights.get(k)
        if not isinstance(rows, list) or rows == [] or not all(
                isinstance(r, list) and len(r) == 3 and integer(r[0], 0, shape["n_layers"])
                and integer(r[1], 0, shape["n_heads"]) and _number(r[2])
                and math.isfinite(r[2]) and r[2] >= 0 for r in rows) or len(
                    {(r[0], r[1]) for r in rows}) != len(rows) or abs(
                    sum(r[2] for r in rows) - 1) > 1e-5:
            raise bad(f"weights.{k}", f"a non-empty list of distinct [layer < "
                      f"{shape['n_layers']}, head < {shape['n_heads']}, finite weight >= 0] "
                      "whose weights sum to 1", rows)
        if len(rows) > opts[f"top_k{k[1]}"]:
            raise bad(f"weights.{k}", f"at most options.top_k{k[1]} "
                      f"({opts[f'top_k{k[1]}']}) heads", rows)
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
    need("bytes", lambda v: integer(v, 1) and v == sum(e["bytes"] for e in shards),
         "the sum of the shards' bytes")
    need("task_config", lambda v: isinstance(v, dict), "an object")
    need("teacher", lambda v: v is None or isinstance(v, str), "a name or null")
    # every field as built: a SHA-256 per field, so an edit that keeps the types and ranges
    # (reversed heads, rescaled weights, rotated anchor ids) is refused too, by name
    sums = need("checksums", lambda v: isinstance(v, dict) and all(
        isinstance(x, str) and re.fullmatch(r"[0-9a-f]{16}", x) for x in v.values()),
        "an object of 16-hex SHA-256 prefixes, one per field")
    want = manifest_checksums(man)
    for key in sorted(set(want) | set(sums), key=lambda k: (k not in want, k)):
        if key not in sums:
            raise bad(key, "a field the store was built with (it has no checksum: added or "
                      "renamed since)", _at(man, key))
        if key not in want:
            raise bad(key, "present (its checksum is recorded: removed since)", None)
        if sums[key] != want[key]:
            raise bad(key, f"the value it was built with (its SHA-256 differs from "
                      f"checksums[{key!r}]: edited since)", _at(man, key))


def _at(man: dict, key: str) -> Any:
    """The value of field ``key`` (``manifest_checksums``' names) in ``man``."""
    m = re.fullmatch(r"shards\[(\d+)\]", key)
    if m:
        return man["shards"][int(m.group(1))]
    top, _, sub = key.partition(".")
    v = man.get(top)
    return v.get(sub) if sub and isinstance(v, dict) else v


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def check_shards(man: dict, store: Path) -> None:
    """Each shard file exists, has the manifest's size and SHA-256; otherwise a ``ValueError``
    naming the shard (swapped, edited, truncated or missing)."""
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
        elif _shape_or_none(file) != [e["n_examples"], e["width"]]:
            problem = (f"holds tokens of shape {_shape_or_none(file)}, the manifest says "
                       f"[{e['n_examples']}, {e['width']}] (n_examples, width)")
        else:
            continue
        raise StoreProblem(f"signal store shard {file} {problem}; delete the folder {store} to "
                           "rebuild the store.")


def _shape(path: Path, key: str) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.get_slice(key).get_shape())


def _shape_or_none(path: Path) -> list[int] | None:
    try:
        return _shape(path, "tokens")
    except Exception:  # noqa: BLE001 - safetensors has its own error types
        return None


def _options_dict(o: StoreOptions) -> dict[str, Any]:
    out = asdict(o)
    if o.heads == "scores":  # stores of the default choice keep their manifests
        del out["heads"]
    return out


def _ranked(heads: Sequence[tuple[int, int]], alpha: Tensor) -> list[list[float]]:
    """``[[layer, head, weight], ...]`` best first (the order the student's heads follow)."""
    return [[int(a), int(b), float(w)] for (a, b), w in zip(heads, alpha.tolist(), strict=True)]


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
            raise ValueError(f"{path} is not a finished teacher-signal store: no {MANIFEST}{hint}.")
        man = _read_json(path / MANIFEST, path)
        if not isinstance(man, dict) or man.get("format") != FORMAT:
            got = man.get("format") if isinstance(man, dict) else type(man).__name__
            raise StoreProblem(f"{path / MANIFEST}: field 'format' is {got!r:.60}, expected "
                               f"{FORMAT!r} ({FORMAT_CHANGE}); "
                               f"delete the folder {path} to rebuild the store.")
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

    @property
    def anchors(self) -> Anchors:
        """The anchor directions the store's Phase-1 profiles were read in."""
        m = self.manifest
        return Anchors(m["options"]["phase1_reading"], tuple(m["anchor_token_ids"]),
                       tuple(m["label_token_ids"]), tuple(m["label_anchor"]))

    def pooling(self) -> Pooling:
        """The teacher's heads and weights as built."""
        sh, w = self.manifest["teacher_shape"], self.manifest["weights"]
        ns = tuple(range(sh["n_layers"])) if self.manifest["options"]["nonselective"] else ()

        def phase(k: str) -> tuple[tuple[tuple[int, int], ...], Tensor]:
            return (tuple((a, b) for a, b, _ in w[k]),
                    torch.tensor([v for *_, v in w[k]], dtype=torch.float32))
        return Pooling(*phase("p1"), *phase("p2"), (sh["n_layers"], sh["n_heads"]), ns)

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
        """Examples ``idx`` (distinct) of one shard as a ``Batch``, trimmed to their longest row."""
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
        loop = torch.cat([loop[..., :K], loop[..., -1:]], -1)
        sig = Signals(d["p1_attn"][r1][..., :width], d["p1_profile"][r1], d["p1_alignment"][r1],
                      loop, d["p2_effect"][r2][..., :K],
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
        return map(self.__getitem__, itertools.count())


def hash_ints(*xs: int) -> int:
    """A 63-bit seed from integers (stable across processes, unlike ``hash``)."""
    d = hashlib.sha256(json.dumps(list(xs)).encode()).digest()
    return int.from_bytes(d[:8], "little") & ((1 << 63) - 1)
