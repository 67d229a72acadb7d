"""``score_heads``: Phase-1 (CoarseScore) and Phase-2 (RefineScore) scores of every head, with
their stability under resampling of the examples. Every column's formula (``COLUMNS``; the
components in ``coarse.py`` and ``refine.py``) and the bootstrap: docs/scores.md.

Means are over an example's query positions (Phase 1: ``q = anchor_pos - 1``; Phase 2:
``q = answer_pos - 1``), then over examples; a row where a component is undefined is left out of
its mean. ``loopback``, ``coarse_score`` and the ranks are computed from the head's means.

A head's write at ``q`` is ``z[q, h] @ W_O[h]`` (``hook_z`` [batch, pos, head, d_head], ``W_O``
[head, d_head, d_model]), without the output bias; through the post-attention norm as the run
scaled it where the block has one (Gemma 2). ``hook_z``/``hook_pattern`` are per query head;
``hook_v`` is per KV head: query head ``h`` reads KV head ``h // (n_heads / n_kv_heads)``.
Without ``W_O``, ``hook_result`` (per-key parts NaN); without either, ``score_heads`` refuses.

Streaming: one ``run_with_cache`` per batch, filtered to ``hook_pattern``, ``hook_z``, ``hook_v``
and ``ln_final.hook_in``; only the query rows and per-example means ([n_examples, n_layers,
n_heads] per component, for the bootstrap) are kept.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from circuitkit import hooks
from circuitkit._warn import warn
from circuitkit.scoring import coarse, refine
from circuitkit.tasks.base import Task, check_task

COLUMNS = ["layer", "head", "sharpness", "anchor_alignment", "coarse_score", "shortlist_share",
           "key_preference", "ov_copy", "mechanism", "loopback", "margin_widening",
           "refine_score", "phase1_rank", "phase2_rank", "phase1_inclusion", "phase2_inclusion",
           "phase1_rank_low", "phase1_rank_high", "phase2_rank_low", "phase2_rank_high",
           "anchor_alignment_tokens", "coarse_score_tokens", "phase1_rank_tokens",
           "ov_copy_targets", "ov_copy_near_misses", "margin_from_targets",
           "margin_from_near_misses", "refine_target_up", "refine_near_down",
           "refine_if_uniform", "sharpness_concentration", "evidence_mass",
           "key_preference_nonadjacent", "margin_widening_siblings", "refine_score_siblings",
           "margin_from_siblings", "ov_copy_siblings", "margin_from_targets_siblings",
           "refine_near_down_siblings", "refine_if_uniform_siblings",
           "coarse_score_paper", "refine_score_paper", "sharpness_evidence_normalised",
           "evidence_mass_own", "evidence_mass_own_null", "evidence_mass_own_excess",
           "key_preference_positional_null", "key_preference_excess"]
BATCH_BYTES = 256 * 2**20  # cached activations per batch (patterns dominate: L*H*S^2 floats)
N_BOOT = 50  # bootstrap resamples of the examples (rank intervals, top-k inclusion)
STABLE_MIN = 0.8  # a top-k head included in fewer resamples than this is flagged unstable
# per-example means kept for the bootstrap: Phase 1 / Phase 2 components
PHASE1_PARTS = ("sharpness", "anchor_alignment", "anchor_alignment_tokens")
# (the first of each is the one every example with steps of that phase has)
PHASE2_PARTS = ("shortlist_share", "key_preference", "margin_widening", "refine_score",
                "ov_copy", "ov_copy_targets", "ov_copy_near_misses", "margin_from_targets",
                "margin_from_near_misses", "refine_target_up", "refine_if_uniform")
# issue 34's instruments, each its own column beside the ones above (not in the bootstrap)
PHASE1_EXTRA = ("sharpness_concentration", "evidence_mass")
PHASE2_EXTRA = ("key_preference_nonadjacent", "margin_widening_siblings",
                "refine_score_siblings", "margin_from_siblings", "ov_copy_siblings",
                "margin_from_targets_siblings", "refine_near_down_siblings",
                "refine_if_uniform_siblings")
KEY_PARTS = PHASE2_PARTS[3:] + PHASE2_EXTRA[2:]  # need each key's write: NaN without W_O
# issue 47: the paper's score forms and the instruments' nulls, each its own column (not in the
# bootstrap); the positional null is computed after the pass (it needs every row's attention)
PAPER_EXTRA = ("coarse_score_paper", "sharpness_evidence_normalised", "evidence_mass_own",
               "evidence_mass_own_null", "refine_score_paper")
SHARPNESS_COLUMNS = ("sharpness", "sharpness_concentration", "sharpness_evidence_normalised")
NULL_EXTRA = ("key_preference_positional_null", "key_preference_excess")


@dataclass
class QueryPlan:
    """Query rows of one batch. Phase 1: ``b1, q1`` (example in batch, position), ``anchor1``
    (correct anchor id), ``w1`` (1 / steps of that example). Phase 2: ``b2, q2, w2``,
    ``target_keys``/``near_keys``/``shortlist_keys`` [N2, S] (shortlist positions <= q holding
    a target / a near-miss / any entry), ``key_pos``/``key_tok`` [N2, K] (those shortlist
    positions and their tokens, padded -1), ``target_tok`` [N2] and ``near_tok`` [N2, M]
    (padded -1). Issue 34's instruments: ``evidence_keys`` [N1, S] (the note's evidence
    positions <= q), ``nonadjacent_keys`` [N2, S] (near-miss entries not immediately before a
    target entry in the shortlist), ``sibling_tok`` [N2, M'] (the near-misses in the step's
    target's own category, padded -1) and ``sibling_keys`` [N2, S] (the entries holding them).
    Issue 47: ``own_keys`` [N1, S] (the step's own evidence group, ``evidence_groups``) and
    ``own_ok`` [N1] (whether the example says which group is the step's)."""

    b1: Int[Tensor, " N1"]
    q1: Int[Tensor, " N1"]
    anchor1: Int[Tensor, " N1"]
    w1: Float[Tensor, " N1"]
    b2: Int[Tensor, " N2"]
    q2: Int[Tensor, " N2"]
    w2: Float[Tensor, " N2"]
    target_keys: Float[Tensor, "N2 S"]
    near_keys: Float[Tensor, "N2 S"]
    target_tok: Int[Tensor, " N2"]
    near_tok: Int[Tensor, "N2 M"]
    shortlist_keys: Float[Tensor, "N2 S"]
    key_pos: Int[Tensor, "N2 K"]
    key_tok: Int[Tensor, "N2 K"]
    evidence_keys: Float[Tensor, "N1 S"] | None = None
    nonadjacent_keys: Float[Tensor, "N2 S"] | None = None
    sibling_tok: Int[Tensor, "N2 M"] | None = None
    sibling_keys: Float[Tensor, "N2 S"] | None = None
    own_keys: Float[Tensor, "N1 S"] | None = None
    own_ok: Bool[Tensor, " N1"] | None = None


def _correct_anchor(task: Task, e: Any, j: int, tok2anchor: dict[int, int]) -> int:
    if len(e.anchors) == len(e.anchor_pos):
        return int(e.anchors[j])
    tok = int(e.tokens[e.anchor_pos[j]])
    if tok not in tok2anchor:
        raise ValueError(f"task {task.name!r}: an example has {len(e.anchors)} anchors for "
                         f"{len(e.anchor_pos)} anchor positions and token {tok} at anchor_pos "
                         f"{e.anchor_pos[j]} is no anchor token; give one anchor per position.")
    return tok2anchor[tok]


def _padded(rows: Sequence[Sequence[int]]) -> Int[Tensor, "n k"]:
    """``rows`` as one [n, longest] tensor (at least 1 wide), padded with -1."""
    out = torch.full((len(rows), max([len(r) for r in rows], default=0) or 1), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return out


def evidence_groups(e: Any) -> list[list[int]] | None:
    """Each anchor step's own evidence group (positions), in ``anchor_pos`` order, or None when
    the example does not say: the note's evidence words split into contiguous runs (one per
    target, in note order ``meta["note_order"]``), step ``j``'s run the one of ``targets[j]``
    (anchors and answers follow the sorted targets: ``synthetic.make_examples``)."""
    order = list((e.meta or {}).get("note_order") or [])
    ev = sorted(e.evidence_pos)
    runs: list[list[int]] = []
    for p in ev:
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    if not order or len(runs) != len(order) or len(e.targets) != len(e.anchor_pos) \
            or sorted(order) != sorted(e.targets):
        return None
    return [runs[order.index(t)] for t in e.targets]


def plan_queries(task: Task, examples: list[Any], seq: int) -> QueryPlan:
    """Query rows of ``examples`` (a batch) under the task layout (module docstring)."""
    tok2anchor = {int(t): i for i, t in enumerate(task.anchor_token_ids.tolist())}
    lt = task.label_token_ids
    tok2label = {int(t): i for i, t in enumerate(lt.tolist())}
    label_anchor = task.label_anchor.tolist()
    b1, q1, a1, w1, b2, q2, w2, tt, nt = [], [], [], [], [], [], [], [], []
    tkeys, nkeys, skeys, kpos, ktok = [], [], [], [], []
    ekeys, akeys, sibtok, sibkeys, okeys, o_ok = [], [], [], [], [], []
    for b, e in enumerate(examples):
        steps = [(j, p - 1) for j, p in enumerate(e.anchor_pos) if p >= 1]
        ev_row = torch.zeros(seq)
        ev_row[[p for p in e.evidence_pos if p < seq]] = 1.0
        groups = evidence_groups(e)
        for j, q in steps:
            ekeys.append(ev_row * (torch.arange(seq) <= q))
            own = torch.zeros(seq)
            if groups is not None:
                own[[p for p in groups[j] if p <= q and p < seq]] = 1.0
            okeys.append(own)
            o_ok.append(groups is not None)
            b1.append(b)
            q1.append(q)
            a1.append(_correct_anchor(task, e, j, tok2anchor))
            w1.append(1.0 / len(steps))
        steps2 = [p - 1 for p in e.answer_pos if p >= 1]
        if not steps2:
            continue
        t_tok = set(lt[e.targets].tolist())
        n_tok = lt[e.near_misses].tolist()
        t_row, n_row, s_row = torch.zeros(seq), torch.zeros(seq), torch.zeros(seq)
        for s in e.shortlist_pos:
            tok = int(e.tokens[s])
            s_row[s] = 1.0
            if tok in t_tok:
                t_row[s] = 1.0
            elif tok in n_tok:
                n_row[s] = 1.0
        # near-miss entries not immediately before a target entry (shortlist order)
        order = sorted(set(e.shortlist_pos))
        a_row = n_row.clone()
        for i, s in enumerate(order[:-1]):
            if t_row[order[i + 1]] > 0:
                a_row[s] = 0.0
        for q in steps2:
            b2.append(b)
            q2.append(q)
            w2.append(1.0 / len(steps2))
            tt.append(int(e.tokens[q + 1]))
            nt.append(n_tok)
            # a key after the query is masked by causality; keep only keys <= q
            seen = torch.arange(seq) <= q
            tkeys.append(t_row * seen)
            nkeys.append(n_row * seen)
            akeys.append(a_row * seen)
            t_lab = tok2label.get(int(e.tokens[q + 1]))
            sib = [int(lt[m]) for m in e.near_misses if t_lab is not None
                   and label_anchor[int(m)] == label_anchor[t_lab]]
            sibtok.append(sib)
            sib_row = torch.zeros(seq)
            for s in e.shortlist_pos:
                if int(e.tokens[s]) in sib and s <= q:
                    sib_row[s] = 1.0
            sibkeys.append(sib_row)
            skeys.append(s_row * seen)
            keys = sorted(s for s in set(e.shortlist_pos) if s <= q)
            kpos.append(keys)
            ktok.append([int(e.tokens[s]) for s in keys])

    def ids(x: list[int]) -> Tensor:
        return torch.tensor(x, dtype=torch.long)

    def rows(x: list[Tensor]) -> Tensor:
        return torch.stack(x) if x else torch.zeros(0, seq)

    return QueryPlan(ids(b1), ids(q1), ids(a1), torch.tensor(w1), ids(b2), ids(q2),
                     torch.tensor(w2), rows(tkeys), rows(nkeys), ids(tt), _padded(nt), rows(skeys),
                     _padded(kpos), _padded(ktok), rows(ekeys), rows(akeys), _padded(sibtok),
                     rows(sibkeys), rows(okeys), torch.tensor(o_ok, dtype=torch.bool))


def margin_directions(W_U: Float[Tensor, "D V"], target_tok: Int[Tensor, " N"],
                      near_tok: Int[Tensor, "N M"]) -> Float[Tensor, "N D"]:
    """``W_U[:, t] - mean_m W_U[:, m]`` per row (the vocabulary mean when a row has no ``m``)."""
    W = W_U.float()
    tgt = W[:, target_tok.to(W.device)].T  # [N, D]
    valid = (near_tok >= 0).to(W.device)
    cols = W[:, near_tok.clamp(min=0).to(W.device)]  # [D, N, M]
    n = valid.sum(-1, keepdim=True)
    mean_near = (cols * valid).sum(-1).T / n.clamp(min=1)
    fallback = W.mean(1)[None, :].expand_as(mean_near)
    return tgt - torch.where(n > 0, mean_near, fallback)


def label_directions(W_U: Float[Tensor, "D V"], key_tok: Int[Tensor, "N K"]
                     ) -> Float[Tensor, "N K D"]:
    """``W_U[:, tok_k] - mean_v W_U[:, v]`` for each row's keys (0 where ``key_tok < 0``): the
    own-label directions ``ov_copy`` reads the entries' effects along (logit minus mean logit)."""
    W = W_U.float()
    valid = (key_tok >= 0).to(W.device)
    cols = W[:, key_tok.clamp(min=0).to(W.device)].permute(1, 2, 0)  # [N, K, D]
    return (cols - W.mean(1)[None, None, :]) * valid[..., None]


def anchor_mode(task: Task, mode: str) -> str:
    """"auto" -> "labels" when the task's label hierarchy gives every anchor a label (its
    centroid exists), else "tokens" (a text-rendered task: anchors and labels are single
    distinguishing tokens, without a hierarchy)."""
    if mode != "auto":
        if mode not in ("tokens", "labels"):
            raise ValueError(f"anchor_directions={mode!r}; expected 'auto', 'labels' or 'tokens'.")
        return mode
    have = set(task.label_anchor.tolist())
    return "labels" if all(a in have for a in range(len(task.anchor_token_ids))) else "tokens"


def write_source(model: Any) -> str:
    """"W_O" when every attention exposes ``W_O`` [head, d_head, d_model], else "result"
    (``hook_result``); ``ValueError`` when neither gives per-head writes."""
    f = hooks.facts(model)
    try:
        shapes = {tuple(b.attn.W_O.shape) for b in model.blocks}
    except (AttributeError, RuntimeError, NotImplementedError):
        shapes = set()
    if shapes == {(f.n_heads, f.d_head, f.d_model)}:
        return "W_O"
    if hasattr(model, "set_use_attn_result"):
        return "result"
    raise ValueError(
        f"score_heads needs each head's residual write: the model's attention exposes no W_O "
        f"[head, d_head, d_model] (got {sorted(shapes) or 'none'}) and no hook_result "
        "(set_use_attn_result); load it as a TransformerLens TransformerBridge.")


def auto_batch(model: Any, seq: int) -> int:
    f = hooks.facts(model)
    per_example = 4 * f.n_layers * (f.n_heads * seq * seq + seq * (f.n_heads + f.n_kv_heads)
                                     * f.d_head) + 4 * seq * f.d_model * 4
    return max(1, min(256, BATCH_BYTES // max(1, per_example)))


class _PerExample:
    """Per-example sums of one component: ``num`` [E, L, H] and ``den`` [E] (the weights of the rows
    where it is defined); ``means()`` gives the example means and which examples have any."""

    def __init__(self, n_examples: int, L: int, H: int):
        self.num = torch.zeros(n_examples, L, H, dtype=torch.float64)
        self.den = torch.zeros(n_examples, L, dtype=torch.float64)

    def add(self, layer: int, rows_ex: Tensor, values: Tensor, weights: Tensor) -> None:
        """``values`` [N, H] of rows of examples ``rows_ex`` [N] with ``weights`` [N]."""
        w = weights.double().cpu()
        self.num[:, layer].index_add_(0, rows_ex, values.double().cpu() * w[:, None])
        self.den[:, layer].index_add_(0, rows_ex, w)

    def means(self) -> tuple[Tensor, Tensor]:
        den = self.den[:, :1]  # every layer saw the same rows
        ok = den[:, 0] > 0
        return torch.where(ok[:, None, None], self.num / den[..., None].clamp(min=1e-300),
                           torch.zeros_like(self.num)), ok


@torch.no_grad()
def score_heads(model: Any, task: Task, batch_size: int | None = None, progress: bool = True,
                anchor_directions: str = "auto", k: int = 5, n_boot: int = N_BOOT,
                seed: int = 0):
    """Phase-1 and Phase-2 scores of every head (module docstring): a pandas DataFrame with
    columns ``COLUMNS``, one row per (layer, head), sorted by (layer, head).

    ``task``: a ``Task`` whose tokens the model reads (for a pretrained LLM, a text-rendered task:
    ``circuitkit.scoring.text.text_task``). ``anchor_directions``: "labels" (centroid of the
    anchor's labels' unembedding columns), "tokens" (the anchor tokens' own columns) or "auto"
    (default: labels wherever every anchor has labels, ``anchor_mode``). ``k``: the top set
    whose bootstrap inclusion is reported; ``n_boot`` resamples (>= 20, 0 for none), seeded by
    ``seed``. ``batch_size``: examples per forward (default: from a 256 MiB activation budget).
    ``df.attrs`` records the positions used, the write source and the stability summaries.
    """
    from circuitkit._progress import tqdm

    n1, n2 = _check_inputs(model, task, batch_size, k, n_boot)
    fr = _reading_frame(model, task, anchor_directions, n1, n2)
    bs = int(batch_size) if batch_size else auto_batch(model, fr.seq)
    acc = {c: _PerExample(len(task), fr.L, fr.H) for c in PHASE1_PARTS + PHASE2_PARTS
           + PHASE1_EXTRA + PHASE2_EXTRA + PAPER_EXTRA + NULL_EXTRA}
    # per-row values the nulls need after the pass (issue 47): Phase-1 sharpness columns with
    # each row's length and evidence count; Phase-2 attention at each shortlist entry
    rows1: list[dict[str, Any]] = []
    rows2: list[dict[str, Any]] = []
    bar = tqdm(total=len(task), desc="score heads", unit="example", file=sys.stderr,
               dynamic_ncols=True, disable=not progress)
    for s in range(0, len(task), bs):
        sub = task.subset(range(s, min(s + bs, len(task))))
        _score_batch(model, fr, task, sub, s, acc, rows1, rows2)
        bar.update(len(sub))
    bar.close()
    _positional_null(rows2, acc, fr.L, fr.H)
    per_ex = {c: a.means() for c, a in acc.items()}
    shortlist = any(e.shortlist_pos for e in task.examples)
    if n2 and not shortlist:
        warn(f"task {task.name!r} has no shortlist positions: Phase-2 heads cannot be scored on "
             "re-reading a shortlist, so refine_score is margin_widening alone and loopback is "
             "NaN (docs/scores.md).")
    if n2 and shortlist and fr.source != "W_O":
        warn("the model's attention exposes no W_O, so what a head writes per key is unknown: "
             "ov_copy and the margin parts are NaN and refine_score is shortlist_share * "
             "margin_widening (docs/scores.md).")
    df = _head_table(per_ex, shortlist, fr.L, fr.H)
    _add_ranks(df)
    _add_bootstrap(df, per_ex, int(k), int(n_boot), int(seed), shortlist)
    df = df[COLUMNS]
    df.attrs.update(task=task.name, task_fingerprint=task.fingerprint(), n_examples=len(task),
                    n_phase1_examples=int(per_ex["sharpness"][1].sum()),
                    n_phase2_examples=int(per_ex["shortlist_share"][1].sum()),
                    n_phase1_positions=n1, n_phase2_positions=n2, anchor_directions=fr.mode,
                    write_source=fr.source, final_norm=fr.norm[0] if fr.norm else None,
                    k=int(k), n_boot=int(n_boot), boot_seed=int(seed),
                    model=str(getattr(model.cfg, "model_name", "")))
    df.attrs.update(stability_summary(df, int(k)))
    df.attrs["instrument_nulls"] = sharpness_nulls(rows1)
    return df


def _check_inputs(model: Any, task: Task, batch_size: int | None, k: int, n_boot: int
                  ) -> tuple[int, int]:
    """Refuse what ``score_heads`` cannot score (one line each); ``(n1, n2)``: the Phase-1 /
    Phase-2 query positions of ``task`` (anchor / answer steps ``p >= 1``)."""
    check_task(task, "score_heads")
    if batch_size is not None and int(batch_size) < 1:
        raise ValueError(f"batch_size must be a positive integer or None; got {batch_size!r}.")
    if not (int(n_boot) == 0 or int(n_boot) >= 20):
        raise ValueError(f"n_boot must be 0 (no bootstrap) or >= 20 resamples; got {n_boot!r}.")
    task.check_model(model)
    n1 = sum(1 for e in task.examples for p in e.anchor_pos if p >= 1)
    n2 = sum(1 for e in task.examples for p in e.answer_pos if p >= 1)
    if n1 == 0 and n2 == 0:
        raise ValueError(f"task {task.name!r} has no anchor_pos and no answer_pos >= 1: no "
                         "Phase-1 or Phase-2 query positions to score heads at.")
    f = hooks.facts(model)
    if not 1 <= int(k) <= f.n_layers * f.n_heads:
        raise ValueError(f"k must be in 1..{f.n_layers * f.n_heads} (heads of the model); got "
                         f"{k!r}.")
    return n1, n2


@dataclass
class _Frame:
    """What every batch of ``score_heads`` is read in, fixed per model and task: ``L`` layers of
    ``H`` heads; ``source`` (``write_source``) with ``W_O`` (per layer [H, d_head, D]; None for
    "result") and ``kv_of`` [H] (the KV head each query head reads); ``W_U`` [D, V]; the anchor
    reading ``mode`` (``anchor_mode``) with its directions ``U[mode]`` and ``U["tokens"]`` [D, A]
    and ``centroids`` (Phase 1 only); the final norm ``norm`` (kind, weight, eps) and its module
    ``ln_module`` (Phase 2 only); ``post`` (layer -> its post-attention norm); ``seq`` (positions
    run: a causal model stops after the last one read) and ``names`` (the hooks cached)."""

    device: torch.device
    L: int
    H: int
    source: str
    W_O: list[Tensor] | None
    kv_of: Int[Tensor, " H"]
    W_U: Float[Tensor, "D V"]
    mode: str
    U: dict[str, Tensor]
    centroids: Tensor | None
    ln_module: Any
    norm: tuple[str, Tensor, float] | None
    post: dict[int, tuple[str, Tensor, float]]
    seq: int
    names: set[str]


def _reading_frame(model: Any, task: Task, anchor_directions: str, n1: int, n2: int) -> _Frame:
    """``score_heads``' ``_Frame`` of ``model`` on ``task`` (``n1``/``n2``: whether it has
    Phase-1 / Phase-2 positions: the anchor directions / the final norm only then)."""
    f = hooks.facts(model)
    L, H = f.n_layers, f.n_heads
    device = next(model.parameters()).device
    source = write_source(model)
    W_U = model.W_U.detach()
    mode = anchor_mode(task, anchor_directions)
    U = {m: coarse.anchor_directions(W_U, task.anchor_token_ids, m, task.label_token_ids,
                                     task.label_anchor) for m in {mode, "tokens"}} if n1 else {}
    centroids = coarse.anchor_centroids(W_U, task.anchor_token_ids, mode, task.label_token_ids,
                                        task.label_anchor) if n1 else None
    norm = refine.final_norm(model) if n2 else None
    post = {lay: refine.norm_params(model, n, f"block {lay}'s post-attention norm")
            for lay in range(L) if (n := hooks.post_norm(model, lay, "attn")) is not None}
    need = max(max(e.anchor_pos + e.answer_pos + e.shortlist_pos, default=0)
               for e in task.examples)
    seq = task.clean_tokens.shape[1]
    if f.causal:  # later positions cannot matter (a bidirectional model reads them all)
        seq = min(need + 1, seq)
    names = {hooks.pattern(lay) for lay in range(L)}
    names |= {hooks.z(lay) if source == "W_O" else hooks.result(lay) for lay in range(L)}
    names |= {hooks.attn_module_out(lay) for lay in post}
    if n2:
        names.add(hooks.FINAL_NORM_IN)
        if source == "W_O":
            names |= {hooks.v(lay) for lay in range(L)}
    return _Frame(
        device=device, L=L, H=H, source=source,
        W_O=[b.attn.W_O.detach() for b in model.blocks] if source == "W_O" else None,
        kv_of=torch.arange(H, device=device) // max(1, H // f.n_kv_heads), W_U=W_U, mode=mode,
        U=U, centroids=centroids,
        ln_module=getattr(model.ln_final, "original_component", model.ln_final) if n2 else None,
        norm=norm, post=post, seq=seq, names=names)


def _run_cached(model: Any, fr: _Frame, tokens: Int[Tensor, "b s"]) -> Any:
    """One ``run_with_cache`` of ``tokens`` keeping ``fr.names`` (``hook_result`` switched on
    only where the writes are read from it)."""
    from circuitkit.patching import shortcuts

    first = torch.zeros(tokens.shape[0], 1, dtype=torch.long, device=fr.device)
    result_ctx = shortcuts.attn_result(model, fr.source != "W_O")  # read by hook_result only
    # the unembedding at one position only: its output is not used
    with model.hooks(fwd_hooks=[(hooks.UNEMBED_IN, shortcuts.gather_rows(first))]), result_ctx:
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in fr.names)
    return cache


def _score_batch(model: Any, fr: _Frame, task: Task, sub: Task, start: int,
                 acc: dict[str, _PerExample], rows1: list[dict[str, Any]],
                 rows2: list[dict[str, Any]]) -> None:
    """Add the examples ``sub`` (``task``'s from ``start`` on) to ``acc``, layer by layer, and
    their per-row values to ``rows1`` / ``rows2`` (``score_heads``)."""
    tokens = sub.clean_tokens[:, :fr.seq].to(fr.device)
    plan = plan_queries(task, sub.examples, tokens.shape[1])
    cache = _run_cached(model, fr, tokens)
    if start == 0 and fr.norm is not None:  # once, on the first batch's first rows
        _check_norm(model, cache[hooks.FINAL_NORM_IN][plan.b2[:4].to(fr.device),
                                                       plan.q2[:4].to(fr.device)], fr.norm)
    ex1, ex2 = plan.b1 + start, plan.b2 + start  # rows' examples in the whole task
    p2 = _phase2_batch(fr, plan, cache) if plan.b2.numel() else None
    if p2 is not None:
        rows2.append(dict(ex=ex2, w=plan.w2 * p2.pref_ok, n=p2.key_ok.sum(-1).cpu(),
                          t=p2.key_t.cpu(), m=p2.key_m.cpu(), at=[]))
    if plan.b1.numel():
        rows1.append(dict(ex=ex1, w=plan.w1, length=plan.q1 + 1,
                          n_ev=plan.evidence_keys.sum(-1), **{c: [] for c in SHARPNESS_COLUMNS}))
    for lay in range(fr.L):
        pat = cache[hooks.pattern(lay)]
        if pat.shape[1] != fr.H:
            raise ValueError(f"hook_pattern of layer {lay} has {pat.shape[1]} heads; the cfg "
                             f"says n_heads={fr.H}.")
        if plan.b1.numel():
            _add_phase1(acc, fr, cache, lay, plan, ex1, rows1[-1])
        if p2 is not None:
            _add_phase2(acc, fr, cache, lay, plan, p2, ex2, rows2[-1])
    del cache


def _add_phase1(acc: dict[str, _PerExample], fr: _Frame, cache: Any, lay: int,
                plan: QueryPlan, ex: Tensor, row: dict[str, Any]) -> None:
    """Layer ``lay``'s Phase-1 components at the anchor rows (``coarse``; docs/scores.md), from
    each head's attention row ``A`` [N1, H, S] (keys ``<= q``) and write ``w`` [N1, H, D]:
    sharpness = excess kurtosis of ``A`` (with its concentration and evidence-normalised
    forms, kept per row in ``row`` for ``sharpness_nulls``), anchor_alignment of ``w`` in the
    anchor reading and in the tokens', the evidence mass (all / the step's own group against
    its null) and the paper's CoarseScore."""
    bd, qd = plan.b1.to(fr.device), plan.q1.to(fr.device)
    rows = cache[hooks.pattern(lay)][bd, :, qd, :].float()  # [N, H, S]
    writes = _head_writes(cache, lay, bd, qd, fr.W_O, fr.post)  # [N, H, D]
    valid = torch.arange(rows.shape[-1], device=fr.device)[None, :] <= qd[:, None]
    n_ev = row["n_ev"]
    kurt = coarse.excess_kurtosis(rows, valid)
    conc = coarse.concentration(rows, valid)
    normed = coarse.evidence_normalised(rows, valid, n_ev)
    acc["sharpness"].add(lay, ex, kurt, plan.w1)
    acc["sharpness_concentration"].add(lay, ex, conc, plan.w1)
    acc["sharpness_evidence_normalised"].add(lay, ex, normed.nan_to_num(), plan.w1 * (n_ev > 0))
    for c, v in zip(SHARPNESS_COLUMNS, (kurt, conc, normed), strict=True):
        row[c].append(v.float().cpu())
    own, own_null = coarse.group_mass(rows, plan.own_keys.to(fr.device),
                                      plan.evidence_keys.to(fr.device))
    acc["evidence_mass_own"].add(lay, ex, own, plan.w1 * plan.own_ok)
    acc["evidence_mass_own_null"].add(lay, ex, own_null, plan.w1 * plan.own_ok)
    acc["coarse_score_paper"].add(lay, ex, coarse.paper_coarse(
        kurt, writes, fr.centroids, plan.anchor1), plan.w1)
    acc["evidence_mass"].add(lay, ex, coarse.salient_mass(
        rows, plan.evidence_keys.to(fr.device)), plan.w1)
    acc["anchor_alignment"].add(lay, ex, coarse.anchor_alignment(
        writes, fr.U[fr.mode], plan.anchor1), plan.w1)
    acc["anchor_alignment_tokens"].add(lay, ex, coarse.anchor_alignment(
        writes, fr.U["tokens"], plan.anchor1), plan.w1)


@dataclass
class _Phase2Batch:
    """One batch's Phase-2 reading frame (``N`` answer rows, ``K`` shortlist keys, ``D``
    d_model): rows ``b``, ``q`` and the final norm's input there ``x`` [N, D]; the directions
    ``margin_dir`` (target minus near-miss mean, ``margin_directions``), ``sib_dir`` (the same
    against the target's own siblings) [N, D], ``label_dir`` [N, K, D] (each key's own label
    against the vocabulary mean) and ``per_key`` (margin, target against the vocabulary mean,
    sibling margin, each [N, K, D]); ``grad`` [N, D] (the margin's gradient through the final
    norm, ``refine.margin_gradient``); the keys ``key_pos`` [N, K] (clamped) with ``key_ok``,
    ``key_t`` / ``key_m`` / ``key_sib`` [N, K] (real / target / near-miss / sibling entries);
    the rows that have a key_preference (``pref_ok``: a target and a near-miss entry),
    a non-adjacent one (``adj_ok``) and a sibling near-miss (``sib_ok``) [N]."""

    b: Int[Tensor, " N"]
    q: Int[Tensor, " N"]
    x: Float[Tensor, "N D"]
    margin_dir: Float[Tensor, "N D"]
    sib_dir: Float[Tensor, "N D"]
    label_dir: Float[Tensor, "N K D"]
    per_key: list[Tensor]
    grad: Float[Tensor, "N D"]
    key_pos: Int[Tensor, "N K"]
    key_ok: Bool[Tensor, "N K"]
    key_t: Bool[Tensor, "N K"]
    key_m: Bool[Tensor, "N K"]
    key_sib: Bool[Tensor, "N K"]
    pref_ok: Bool[Tensor, " N"]
    adj_ok: Bool[Tensor, " N"]
    sib_ok: Bool[Tensor, " N"]


def _phase2_batch(fr: _Frame, plan: QueryPlan, cache: Any) -> _Phase2Batch:
    """The ``_Phase2Batch`` of ``plan``'s answer rows."""
    device, W_U = fr.device, fr.W_U
    b2, q2 = plan.b2.to(device), plan.q2.to(device)
    x2 = cache[hooks.FINAL_NORM_IN][b2, q2]
    margin_dir = margin_directions(W_U, plan.target_tok, plan.near_tok)
    vocab_mean = W_U.float().mean(1)[None, :]
    key_ok = (plan.key_pos >= 0).to(device)
    key_pos = plan.key_pos.clamp(min=0).to(device)
    target_dir = W_U.float()[:, plan.target_tok.to(W_U.device)].T - vocab_mean
    # issue 34: the target's own siblings; near-misses not just before a target
    sib_dir = margin_directions(W_U, plan.target_tok, plan.sibling_tok)
    # target, near-miss and sibling entries among each row's keys [N2, K]
    key_t, key_m, key_sib = ((at.gather(1, plan.key_pos.clamp(min=0)) > 0).to(device)
                             & key_ok for at in (plan.target_keys, plan.near_keys,
                                                 plan.sibling_keys))
    # the margin, the target (vs the vocab mean) and the sibling margin, per key
    kk = key_pos.shape[1]
    per_key = [d[:, None, :].expand(-1, kk, -1).to(device)
               for d in (margin_dir, target_dir, sib_dir)]
    return _Phase2Batch(
        b=b2, q=q2, x=x2, margin_dir=margin_dir, sib_dir=sib_dir,
        label_dir=label_directions(W_U, plan.key_tok),  # own label vs the vocab mean
        per_key=per_key, grad=refine.margin_gradient(fr.ln_module, x2, margin_dir.to(device)),
        key_pos=key_pos, key_ok=key_ok, key_t=key_t, key_m=key_m, key_sib=key_sib,
        # rows with a target and a near-miss entry (the others have no key_preference)
        pref_ok=(plan.target_keys.sum(-1) > 0) & (plan.near_keys.sum(-1) > 0),
        adj_ok=(plan.target_keys.sum(-1) > 0) & (plan.nonadjacent_keys.sum(-1) > 0),
        sib_ok=(plan.sibling_tok >= 0).any(-1))  # [N2] rows with a sibling near-miss


def _add_phase2(acc: dict[str, _PerExample], fr: _Frame, cache: Any, lay: int,
                plan: QueryPlan, p2: _Phase2Batch, ex: Tensor, row: dict[str, Any]) -> None:
    """Layer ``lay``'s Phase-2 components at the answer rows (``refine``; docs/scores.md), from
    each head's attention row ``A`` [N2, H, S] and write ``w`` [N2, H, D] through the final
    norm as the run scaled it (``n(w)``): margin_widening ``n(w) . margin_dir`` (and against
    the siblings), shortlist_share ``sum_{s in shortlist} A[s]``, key_preference (targets
    against near-misses, and against the non-adjacent ones), the paper's RefineScore; the
    attention at each key kept in ``row`` (``_positional_null``); then the per-key parts
    (``_add_key_parts``; NaN without ``W_O``)."""
    H = fr.H
    rows = cache[hooks.pattern(lay)][p2.b, :, p2.q, :].float()  # [N, H, S]
    writes = _head_writes(cache, lay, p2.b, p2.q, fr.W_O, fr.post)
    scaled = refine.final_norm_linear(writes, p2.x, *fr.norm)
    acc["margin_widening"].add(lay, ex, refine.margin_widening(scaled, p2.margin_dir), plan.w2)
    share = refine.shortlist_share(rows, plan.shortlist_keys.to(fr.device))
    acc["shortlist_share"].add(lay, ex, share, plan.w2)
    pref, _ = refine.key_preference(rows, plan.target_keys.to(fr.device),
                                    plan.near_keys.to(fr.device))
    acc["key_preference"].add(lay, ex, pref, plan.w2 * p2.pref_ok)
    pref_na, _ = refine.key_preference(rows, plan.target_keys.to(fr.device),
                                       plan.nonadjacent_keys.to(fr.device))
    acc["key_preference_nonadjacent"].add(lay, ex, pref_na, plan.w2 * p2.adj_ok)
    acc["margin_widening_siblings"].add(lay, ex, refine.margin_widening(
        scaled, p2.sib_dir), plan.w2 * p2.sib_ok)
    near_mass = refine.shortlist_share(rows, plan.near_keys.to(fr.device))
    acc["refine_score_paper"].add(lay, ex, refine.paper_refine(
        share, near_mass, writes, p2.grad), plan.w2)
    row["at"].append((rows.gather(2, p2.key_pos[:, None, :].expand(-1, H, -1))
                      * p2.key_ok[:, None, :]).cpu())
    if fr.W_O is None:  # no per-key writes: share-weighted margin (docs/scores.md)
        nan = torch.full((len(p2.b), H), float("nan"))
        for c in KEY_PARTS:
            acc[c].add(lay, ex, nan, plan.w2)
        return
    _add_key_parts(acc, fr, cache, lay, plan, p2, ex, rows, share)


def _add_key_parts(acc: dict[str, _PerExample], fr: _Frame, cache: Any, lay: int,
                   plan: QueryPlan, p2: _Phase2Batch, ex: Tensor,
                   rows: Float[Tensor, "N H S"], share: Float[Tensor, "N H"]) -> None:
    """Layer ``lay``'s per-key Phase-2 parts: head ``h``'s write per unit of attention to key
    ``k``, ``n(v[k, kv(h)] @ W_O[h])`` [N, K, H, D] (``_key_writes``), read along each key's
    own label (ov_copy: attention-weighted mean over all / target / near-miss / sibling
    entries) and along the per-key margins (refine_score = ``sum_k A[k] e_k`` over the keys,
    its parts from the targets / near-misses / siblings, the target's rise, the uniform-
    attention counterfactual ``refine_if_uniform``)."""
    H, ok = fr.H, p2.key_ok
    kk = p2.key_pos.shape[1]
    at_keys = rows.gather(2, p2.key_pos[:, None, :].expand(-1, H, -1))  # [N, H, K]
    key_writes = _key_writes(cache, lay, p2.b, p2.q, p2.key_pos, fr.kv_of, fr.W_O[lay], fr.post)
    n = p2.key_pos.shape[0]
    key_scaled = refine.final_norm_linear(
        key_writes.reshape(n, kk * H, -1), p2.x, *fr.norm).reshape(n, kk, H, -1)
    own = refine.key_effects(key_scaled, p2.label_dir.to(fr.device))  # [N, K, H]
    gain, up, gain_sib = (refine.key_effects(key_scaled, d) for d in p2.per_key)
    up_sum = refine.attended_sum(at_keys, up, ok)[0]
    acc["refine_target_up"].add(lay, ex, up_sum, plan.w2)
    for c, keys in (("", ok), ("_targets", p2.key_t), ("_near_misses", p2.key_m),
                    ("_siblings", p2.key_sib)):
        e_sum, mass = refine.attended_sum(at_keys, own, keys)
        acc["ov_copy" + c].add(lay, ex, e_sum / mass.clamp(min=1e-30), plan.w2 * keys.any(-1).cpu())
    for c, keys in (("refine_score", ok), ("margin_from_targets", p2.key_t),
                    ("margin_from_near_misses", p2.key_m)):
        acc[c].add(lay, ex, refine.attended_sum(at_keys, gain, keys)[0], plan.w2)
    acc["refine_if_uniform"].add(lay, ex, refine.uniform_sum(share, gain, ok), plan.w2)
    rs_sib, from_t, from_sib = (refine.attended_sum(at_keys, gain_sib, keys)[0]
                                for keys in (ok, p2.key_t, p2.key_sib))
    for c, value in (("refine_score_siblings", rs_sib),
                     ("refine_near_down_siblings", rs_sib - up_sum),
                     ("margin_from_targets_siblings", from_t),
                     ("refine_if_uniform_siblings", refine.uniform_sum(share, gain_sib, ok)),
                     ("margin_from_siblings", from_sib)):
        acc[c].add(lay, ex, value, plan.w2 * p2.sib_ok)


def _head_table(per_ex: dict[str, tuple[Tensor, Tensor]], shortlist: bool, L: int, H: int):
    """One row per (layer, head): each component's mean over the examples that have it
    (``per_ex[c] = (means [E, L, H], ok [E])``; NaN where none does), the scores from them
    (``_scores``), ``refine_near_down = refine_score - refine_target_up``,
    ``evidence_mass_own_excess = own - own_null`` and ``mechanism``."""
    import pandas as pd

    nan = float("nan")
    mean = {c: m[ok].mean(0) if ok.any() else torch.full((L, H), nan, dtype=torch.float64)
            for c, (m, ok) in per_ex.items()}
    scores = _scores(mean, shortlist)
    layer, head = torch.meshgrid(torch.arange(L), torch.arange(H), indexing="ij")
    flat = {c: v.reshape(-1).numpy() for c, v in {**mean, **scores}.items()}
    df = pd.DataFrame(dict(layer=layer.reshape(-1).numpy(), head=head.reshape(-1).numpy(), **flat))
    df["refine_near_down"] = df["refine_score"] - df["refine_target_up"]
    df["evidence_mass_own_excess"] = df["evidence_mass_own"] - df["evidence_mass_own_null"]
    if not shortlist:  # nothing to re-attend to: the paper's product is undefined, not 0
        df["refine_score_paper"] = nan
    df["mechanism"] = refine.mechanism(df["refine_score"], df["margin_from_targets"],
                                       df["margin_from_near_misses"], df["refine_target_up"],
                                       df["refine_near_down"])
    return df


def _add_ranks(df: Any) -> None:
    """``phase1_rank`` (by coarse_score), ``phase2_rank`` (refine_score) and ``phase1_rank_tokens``
    (coarse_score_tokens): 1 = highest (``ranks``); empty for a phase the task has no steps for. A
    score equal on every head is warned about: its ranks are (layer, head) order, not a finding."""
    import pandas as pd

    for phase, col in ((1, "coarse_score"), (2, "refine_score"), (1, "coarse_score_tokens")):
        values = df[col].dropna()
        if col != "coarse_score_tokens" and len(values) > 1 and values.max() == values.min():
            warn(f"every head has the same {col} ({values.max():.4g}): its ranks are "
                 "(layer, head) order, not a finding (Phase-1 sharpness needs query "
                 "rows long enough for kurtosis to exceed 0; docs/scores.md).")
        # a phase the task has no steps for (induction: no anchors) gets no ranks, not row order
        name = f"phase{phase}_rank" + ("_tokens" if col.endswith("_tokens") else "")
        df[name] = _int_or_na(ranks(torch.tensor(df[col].to_numpy()))) \
            if df[col].notna().any() else pd.array([pd.NA] * len(df), dtype="Int64")


def _add_bootstrap(df: Any, per_ex: dict[str, tuple[Tensor, Tensor]], k: int, n_boot: int,
                   seed: int, shortlist: bool) -> None:
    """Per phase, over ``n_boot`` resamples of the examples (``bootstrap_ranks``, seeded by
    ``seed + phase``): ``phase{p}_inclusion`` (share of resamples with the head in the top
    ``k``) and ``phase{p}_rank_low`` / ``_high`` (``_rank_interval``); NaN / NA without a
    bootstrap, a score or two examples."""
    import pandas as pd

    for phase, col, parts in ((1, "coarse_score", PHASE1_PARTS), (2, "refine_score", PHASE2_PARTS)):
        ok = per_ex[parts[0]][1]
        if n_boot and df[col].notna().any() and int(ok.sum()) > 1:
            boot = bootstrap_ranks({c: per_ex[c] for c in parts}, col, n_boot, seed + phase,
                                   shortlist)  # [n_boot, L*H]
            df[f"phase{phase}_inclusion"] = (boot <= k).double().mean(0).numpy()
            lo, hi = _rank_interval(boot)
            df[f"phase{phase}_rank_low"], df[f"phase{phase}_rank_high"] = lo, hi
        else:
            df[f"phase{phase}_inclusion"] = float("nan")
            for end in ("low", "high"):
                df[f"phase{phase}_rank_{end}"] = pd.array([pd.NA] * len(df), dtype="Int64")


def _positional_null(rows2: list[dict[str, Any]], acc: dict[str, _PerExample], L: int,
                     H: int) -> None:
    """Add ``key_preference_positional_null`` and ``key_preference_excess`` to ``acc``: per
    layer, every Phase-2 row's attention at its shortlist entries (``rows2``, padded to one
    width), replaced by ``refine.positional_null``, read with the row's own target / near-miss
    entries (module docstring of ``refine``)."""
    if not rows2 or not rows2[0]["at"]:
        return
    width = max(r["t"].shape[1] for r in rows2)

    def cat(key: str) -> Tensor:
        return torch.cat([torch.nn.functional.pad(r[key], (0, width - r[key].shape[-1]))
                          for r in rows2])

    t, m, n = cat("t").float(), cat("m").float(), torch.cat([r["n"] for r in rows2])
    ex, w = torch.cat([r["ex"] for r in rows2]), torch.cat([r["w"].float() for r in rows2])
    for lay in range(L):
        at = torch.cat([torch.nn.functional.pad(r["at"][lay], (0, width - r["at"][lay].shape[-1]))
                        for r in rows2])  # [R, H, K]
        real, null, ok = refine.key_preference_null(at, n, t, m)
        weight = w * ok
        acc["key_preference_positional_null"].add(lay, ex, null, weight)
        acc["key_preference_excess"].add(lay, ex, real - null, weight)


def sharpness_nulls(rows1: list[dict[str, Any]]) -> dict[str, Any]:
    """What each sharpness column measures beside its name (JSON-ready, ``attrs``), per column:
    ``short_long_spearman`` (the heads' means over the Phase-1 rows no longer than the median
    row against those over the longer ones: 1 when row length does not reorder the heads) and
    ``evidence_count_corr`` (over heads, the median Pearson correlation of a head's row values
    with ``1 / n_ev``, the note's number of evidence words: ~0 when the count does not drive
    it; None for a task without evidence words); ``{}`` without Phase-1 rows."""
    import numpy as np

    if not rows1 or not rows1[0][SHARPNESS_COLUMNS[0]]:
        return {}
    length = torch.cat([r["length"] for r in rows1]).double().numpy()
    n_ev = torch.cat([r["n_ev"] for r in rows1]).double().numpy()
    out: dict[str, Any] = {}
    short = length <= np.median(length)
    for c in SHARPNESS_COLUMNS:
        v = torch.cat([torch.stack(r[c], 1) for r in rows1]).double().numpy()  # [R, L, H]
        v = v.reshape(len(v), -1)
        fine = np.isfinite(v).all(1)
        ok = fine & (n_ev > 0)  # the count's correlation needs evidence words; the length not
        entry: dict[str, Any] = dict(short_long_spearman=None, evidence_count_corr=None)
        if (fine & short).sum() > 1 and (fine & ~short).sum() > 1:
            entry["short_long_spearman"] = spearman(v[fine & short].mean(0),
                                                    v[fine & ~short].mean(0))
        inv = 1.0 / n_ev[ok]
        if ok.sum() > 2 and inv.std() > 0:
            corr = [float(np.corrcoef(inv, v[ok, j])[0, 1]) for j in range(v.shape[1])
                    if v[ok, j].std() > 0]
            entry["evidence_count_corr"] = float(np.median(corr)) if corr else None
        out[c] = entry
    return out


def _scores(mean: dict[str, Tensor], shortlist: bool = True) -> dict[str, Tensor]:
    """coarse_score (both anchor readings), loopback and refine_score from the components' means
    (any leading shape: one per bootstrap resample). Without a shortlist in the task (``shortlist``
    False), loopback is NaN and refine_score is margin_widening; without per-key writes (no ``W_O``:
    refine_score NaN), refine_score is ``shortlist_share * margin_widening``."""
    out: dict[str, Tensor] = {}
    if "sharpness" in mean:
        out["coarse_score"] = coarse.coarse_score(mean["sharpness"], mean["anchor_alignment"])
        out["coarse_score_tokens"] = coarse.coarse_score(mean["sharpness"],
                                                         mean["anchor_alignment_tokens"])
    if "shortlist_share" in mean:
        lb = refine.loopback(mean["shortlist_share"], mean["key_preference"])
        rs = mean["refine_score"]
        rs = torch.where(rs.isnan(), mean["shortlist_share"] * mean["margin_widening"], rs)
        if not shortlist:
            lb, rs = torch.full_like(lb, float("nan")), mean["margin_widening"]
        out["loopback"], out["refine_score"] = lb, rs
    return out


def ranks(values: Tensor) -> Int[Tensor, "... n"]:
    """Rank of each entry along the last axis, 1 = highest, ties (and NaN, last) by index."""
    v = torch.nan_to_num(values.double(), nan=-math.inf)
    order = torch.argsort(-v, dim=-1, stable=True)
    out = torch.empty_like(order)
    out.scatter_(-1, order, torch.arange(1, v.shape[-1] + 1).expand_as(order).contiguous())
    return out


def _int_or_na(r: Tensor) -> Any:
    import pandas as pd

    return pd.array(r.tolist(), dtype="Int64")


def bootstrap_ranks(per_example: dict[str, tuple[Tensor, Tensor]], score: str, n_boot: int,
                    seed: int, shortlist: bool = True) -> Int[Tensor, "n_boot LH"]:
    """Ranks of ``score`` ("coarse_score" or "refine_score") in ``n_boot`` resamples of the
    examples: ``per_example[c] = (means [E, L, H], ok [E])`` of each component; a resample
    draws the examples that have the phase's first component, with replacement, and each
    component is re-averaged over the drawn examples where it is defined."""
    first = next(iter(per_example.values()))
    pool = torch.nonzero(first[1])[:, 0]
    g = torch.Generator().manual_seed(seed)
    draws = pool[torch.randint(0, len(pool), (n_boot, len(pool)), generator=g)]
    counts = torch.zeros(n_boot, len(first[1]), dtype=torch.float64)
    counts.scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64))
    means = {}
    for c, (m, ok) in per_example.items():
        w = counts * ok.double()  # [B, E]
        E, L, H = m.shape
        means[c] = ((w @ m.reshape(E, L * H)) / w.sum(1, keepdim=True).clamp(min=1e-300))
    return ranks(_scores(means, shortlist)[score])


def _rank_interval(boot: Tensor) -> tuple[Any, Any]:
    """2.5 / 97.5 percentiles of each head's bootstrap ranks (integers: lower / higher)."""
    b = boot.double()
    lo = torch.quantile(b, 0.025, dim=0, interpolation="lower").long()
    hi = torch.quantile(b, 0.975, dim=0, interpolation="higher").long()
    return _int_or_na(lo), _int_or_na(hi)


def stability_summary(scores: Any, k: int) -> dict[str, Any]:
    """What ``score_heads`` records in ``attrs`` (JSON-ready): ``unstable`` (per phase, the
    top-``k`` heads with inclusion below ``STABLE_MIN``), ``anchor_agreement`` (Spearman of
    ``coarse_score`` against ``coarse_score_tokens``, overlap of their top-``k`` sets; None
    when the ranking already reads the tokens or there is no Phase 1) and ``refine_parts``
    (``refine_part_influence`` as records; None without Phase 2)."""
    unstable = {}
    for phase in (1, 2):
        inc = f"phase{phase}_inclusion"
        if inc in scores.columns and scores[inc].notna().any():
            top = top_heads(scores, phase, k)
            idx = scores.set_index(["layer", "head"])[inc]
            unstable[f"phase{phase}"] = [[la, h] for la, h in top if idx[(la, h)] < STABLE_MIN]
    agreement = None
    if scores.attrs.get("anchor_directions") != "tokens" and scores["coarse_score"].notna().any():
        top_a = set(top_heads(scores, 1, k))
        top_b = {(int(r.layer), int(r.head)) for r in
                 scores.sort_values(["phase1_rank_tokens"]).head(k).itertuples()}
        agreement = dict(spearman=spearman(scores["coarse_score"], scores["coarse_score_tokens"]),
                         top_k_overlap=len(top_a & top_b), k=k)
    parts = None
    if scores["refine_score"].notna().any() and scores["loopback"].notna().any() \
            and scores["refine_if_uniform"].notna().any():
        parts = refine_part_influence(scores, k).to_dict(orient="records")
    return dict(unstable=unstable, anchor_agreement=agreement, refine_parts=parts)


def spearman(a: Any, b: Any) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant."""
    import numpy as np
    import pandas as pd

    ra = pd.Series(np.asarray(a, dtype=float)).rank().to_numpy()
    rb = pd.Series(np.asarray(b, dtype=float)).rank().to_numpy()
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def refine_part_influence(scores: Any, k: int = 5):
    """How much each part of RefineScore moves the Phase-2 ranking: a DataFrame, one row per
    part, with ``spearman_alone`` (refine_score against the part by itself), ``spearman_without``
    (against refine_score with the part taken out) and ``top_k_kept`` (heads of refine_score's
    top ``k`` still in the top ``k`` without it). Each part's "alone" and "without" (below, in
    that order): docs/scores.md."""
    import numpy as np
    import pandas as pd

    col = lambda c: scores[c].to_numpy(float)  # noqa: E731
    rs, share = col("refine_score"), col("shortlist_share")
    nan = np.full_like(rs, np.nan)
    full_top = set(np.argsort(-np.nan_to_num(rs, nan=-np.inf), kind="stable")[:k])
    per_unit = np.divide(rs, share, out=np.zeros_like(rs), where=share > 0)
    rows = []
    for part, alone, without in (
            ("margin_widening", col("margin_widening"), col("margin_widening") - rs),
            ("shortlist_share", share, per_unit),
            ("key_preference", np.abs(col("key_preference")), col("refine_if_uniform")),
            ("ov_copy", col("ov_copy"), share * np.abs(col("key_preference"))),
            ("loopback", col("loopback"), nan)):
        kept = np.nan
        if not np.isnan(without).all():
            kept = len(full_top & set(np.argsort(-np.nan_to_num(without, nan=-np.inf),
                                                 kind="stable")[:k]))
        rows.append(dict(part=part, spearman_alone=spearman(rs, alone),
                         spearman_without=spearman(rs, without), top_k_kept=kept, k=k))
    return pd.DataFrame(rows)


def top_heads(scores: Any, phase: int, k: int) -> list[tuple[int, int]]:
    """The ``k`` best heads of ``phase``, best first: by ``phase{phase}_rank`` (``score_heads``'
    frame), or, for a frame without ranks, by ``coarse_score`` / ``refine_score`` descending.
    Ties go to the lower ``(layer, head)``. A phase without ranks or scores is refused."""
    if phase not in (1, 2):
        raise ValueError(f"phase must be 1 or 2; got {phase!r}.")
    col, by = f"phase{phase}_rank", _ranked_by(scores, phase)
    missing = {"layer", "head", by} - set(scores.columns)
    if missing:
        raise ValueError(f"scores lacks columns {sorted(missing)} (and {col}); pass score_heads' "
                         "DataFrame.")
    if scores[by].isna().all():
        raise ValueError(f"scores have no {by}: the task they were computed on has no "
                         f"Phase-{phase} {'anchor' if phase == 1 else 'answer'} steps.")
    best = scores.sort_values([by, "layer", "head"], ascending=[by == col, True, True],
                              na_position="last").head(int(k))
    return [(int(r.layer), int(r.head)) for r in best.itertuples()]


def scored_phases(scores: Any) -> list[int]:
    """The phases (1, 2) ``scores`` ranks heads for: a task without anchor (or answer) steps
    leaves that phase's rank, or score, empty."""
    return [phase for phase in (1, 2) if (col := _ranked_by(scores, phase)) in scores.columns
            and scores[col].notna().any()]


def _ranked_by(scores: Any, phase: int) -> str:
    """The column ``phase``'s heads are ranked by: ``phase{phase}_rank``, or for a frame
    without it, the phase's score."""
    col = f"phase{phase}_rank"
    return col if col in scores.columns else ("coarse_score" if phase == 1 else "refine_score")


def _head_writes(cache: Any, layer: int, b: Tensor, q: Tensor, W_O: list[Tensor] | None,
                 post: dict[int, tuple[str, Tensor, float]]) -> Float[Tensor, "N H D"]:
    """Each head's write at rows ``(b, q)`` (``hook_result`` without ``W_O``); through the
    post-attention norm as the run scaled it where the block has one (the residual receives
    n(sum of heads): each head's share)."""
    if W_O is None:
        writes = cache[hooks.result(layer)][b, q].float()
    else:  # z [N, H, d_head]
        writes = torch.einsum("nhd,hdm->nhm", cache[hooks.z(layer)][b, q].float(),
                              W_O[layer].float())
    if layer in post:
        writes = refine.final_norm_linear(writes, cache[hooks.attn_module_out(layer)][b, q],
                                          *post[layer])
    return writes


def _key_writes(cache: Any, layer: int, b: Tensor, q: Tensor, key_pos: Int[Tensor, "N K"],
                kv_of: Int[Tensor, " H"], W_O: Float[Tensor, "H d D"],
                post: dict[int, tuple[str, Tensor, float]]) -> Float[Tensor, "N K H D"]:
    """``v[key, kv(h)] @ W_O[h]``: what head ``h`` writes per unit of attention to each key
    (``z = sum_s A[s] v[s]``), through the post-attention norm at ``q`` where there is one."""
    v = cache[hooks.v(layer)][b[:, None], key_pos].float()  # [N, K, KV, d_head]
    out = torch.einsum("nkhd,hdm->nkhm", v[:, :, kv_of], W_O.float())
    if layer in post:
        n, kk, H, D = out.shape
        out = refine.final_norm_linear(out.reshape(n, kk * H, D),
                                       cache[hooks.attn_module_out(layer)][b, q],
                                       *post[layer]).reshape(n, kk, H, D)
    return out


def _check_norm(model: Any, x: Tensor, norm: tuple[str, Tensor, float]) -> None:
    """Refuse when ``refine.final_norm`` does not reproduce the model's own final norm."""
    if x.numel() == 0:
        return
    ln = model.ln_final
    inner = getattr(ln, "original_component", ln)
    bias = getattr(inner, "bias", None)
    mine = refine.apply_final_norm(x, *norm, bias=bias)
    theirs = inner(x).float()
    err = float((mine - theirs).abs().max())
    if err > 1e-3 * max(1.0, float(theirs.abs().max())):
        raise ValueError(f"margin_widening: the final norm ({type(inner).__name__}) differs from "
                         f"its {norm[0].upper()} form by {err:.2e}; this architecture's final norm "
                         "is not supported (please report it).")
