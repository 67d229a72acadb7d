"""``score_heads``: Phase-1 (CoarseScore) and Phase-2 (RefineScore) scores of every head.

One row per (layer, head); columns (formulas in ``coarse.py``, ``refine.py`` and docs/scores.md):

=================  =========================================================================
sharpness          mean Fisher excess kurtosis of the head's attention row (keys ``0..q``) at
                   the Phase-1 query positions ``q = anchor_pos - 1``
anchor_alignment   mean ``cos(w, u_correct) - mean_other cos(w, u_a)`` of the head's write ``w``
                   at those positions with the centred anchor directions ``u``
coarse_score       ``tanh(max(sharpness, 0) / 3) * anchor_alignment``
loopback           mean attention mass on target shortlist positions minus near-miss ones at the
                   Phase-2 query positions ``q = answer_pos - 1``
margin_widening    mean direct effect of the head's write (through the run's final-norm scale) on
                   ``logit[target] - mean logit[near_misses]`` at those positions
refine_score       ``(1 + loopback) / 2 * margin_widening``
phase1_rank        rank of ``coarse_score`` (1 = highest; ties by (layer, head) order; empty
                   when the task has no steps of that phase, e.g. induction has no anchors)
phase2_rank        rank of ``refine_score``
=================  =========================================================================

Means are over an example's query positions, then over examples (as Reasoning Focus is).
A head's write at position ``q`` is ``z[q, h] @ W_O[h]`` (``hook_z`` [batch, pos, head, d_head]
and ``W_O`` [head, d_head, d_model]), the per-head output without the attention's output bias;
where the block normalises the attention output before the residual add (Gemma 2), that write
through the norm as the run scaled it (``refine.final_norm_linear``: the heads' shares of the
norm's output, exact for RMSNorm without bias);
``hook_z`` and ``hook_pattern`` are per *query* head, so GQA models need nothing special.
Models whose attention exposes no ``W_O`` use ``hook_result`` (``set_use_attn_result``);
without either, ``score_heads`` refuses.

Streaming: one ``run_with_cache`` per batch of examples, filtered to ``hook_pattern`` and
``hook_z`` of every layer and ``ln_final.hook_in``; only the rows at query positions are kept, so
memory is flat in the number of examples. The unembedding runs at one position only (its output
is not used).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from circuitkit import hooks
from circuitkit.scoring import coarse, refine
from circuitkit.tasks.base import Task, check_task

COLUMNS = ["layer", "head", "sharpness", "anchor_alignment", "coarse_score", "loopback",
           "margin_widening", "refine_score", "phase1_rank", "phase2_rank"]
BATCH_BYTES = 256 * 2**20  # cached activations per batch (patterns dominate: L*H*S^2 floats)


@dataclass
class QueryPlan:
    """Query rows of one batch. Phase 1: ``b1, q1`` (example in batch, position), ``anchor1``
    (correct anchor id), ``w1`` (1 / steps of that example). Phase 2: ``b2, q2, w2``,
    ``target_keys``/``near_keys`` [N2, S] (shortlist positions holding a target / near-miss
    token), ``target_tok`` [N2] and ``near_tok`` [N2, M] (padded -1)."""

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


def _correct_anchor(task: Task, e: Any, j: int, tok2anchor: dict[int, int]) -> int:
    if len(e.anchors) == len(e.anchor_pos):
        return int(e.anchors[j])
    tok = int(e.tokens[e.anchor_pos[j]])
    if tok not in tok2anchor:
        raise ValueError(f"task {task.name!r}: an example has {len(e.anchors)} anchors for "
                         f"{len(e.anchor_pos)} anchor positions and token {tok} at anchor_pos "
                         f"{e.anchor_pos[j]} is no anchor token; give one anchor per position.")
    return tok2anchor[tok]


def plan_queries(task: Task, examples: list[Any], seq: int) -> QueryPlan:
    """Query rows of ``examples`` (a batch) under the task layout (module docstring)."""
    tok2anchor = {int(t): i for i, t in enumerate(task.anchor_token_ids.tolist())}
    lt = task.label_token_ids
    b1, q1, a1, w1, b2, q2, w2, tt, nt = [], [], [], [], [], [], [], [], []
    tk = torch.zeros(0, seq)
    nk = torch.zeros(0, seq)
    tkeys, nkeys = [], []
    for b, e in enumerate(examples):
        steps = [(j, p - 1) for j, p in enumerate(e.anchor_pos) if p >= 1]
        for j, q in steps:
            b1.append(b)
            q1.append(q)
            a1.append(_correct_anchor(task, e, j, tok2anchor))
            w1.append(1.0 / len(steps))
        steps2 = [p - 1 for p in e.answer_pos if p >= 1]
        if not steps2:
            continue
        t_tok = set(lt[e.targets].tolist())
        n_tok = lt[e.near_misses].tolist()
        t_row, n_row = torch.zeros(seq), torch.zeros(seq)
        for s in e.shortlist_pos:
            tok = int(e.tokens[s])
            if tok in t_tok:
                t_row[s] = 1.0
            elif tok in n_tok:
                n_row[s] = 1.0
        for q in steps2:
            b2.append(b)
            q2.append(q)
            w2.append(1.0 / len(steps2))
            tt.append(int(e.tokens[q + 1]))
            nt.append(n_tok)
            # a key after the query is masked by causality; keep only keys <= q
            tkeys.append(t_row * (torch.arange(seq) <= q))
            nkeys.append(n_row * (torch.arange(seq) <= q))
    if tkeys:
        tk, nk = torch.stack(tkeys), torch.stack(nkeys)
    width = max([len(r) for r in nt], default=0)
    near = torch.full((len(nt), max(width, 1)), -1, dtype=torch.long)
    for i, r in enumerate(nt):
        near[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
    def ids(x: list[int]) -> Tensor:
        return torch.tensor(x, dtype=torch.long)

    return QueryPlan(ids(b1), ids(q1), ids(a1), torch.tensor(w1), ids(b2), ids(q2),
                     torch.tensor(w2), tk, nk, ids(tt), near)


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


def anchor_mode(task: Task, mode: str) -> str:
    """"auto" -> "tokens" if every anchor position holds an anchor token, else "labels"."""
    if mode != "auto":
        if mode not in ("tokens", "labels"):
            raise ValueError(f"anchor_directions={mode!r}; expected 'auto', 'tokens' or 'labels'.")
        return mode
    anchors = set(task.anchor_token_ids.tolist())
    ok = all(int(e.tokens[p]) in anchors for e in task.examples for p in e.anchor_pos)
    return "tokens" if ok else "labels"


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
    per_example = 4 * f.n_layers * (f.n_heads * seq * seq + seq * f.n_heads * f.d_head) \
        + 4 * seq * f.d_model * 4
    return max(1, min(256, BATCH_BYTES // max(1, per_example)))


@torch.no_grad()
def score_heads(model: Any, task: Task, batch_size: int | None = None, progress: bool = True,
                anchor_directions: str = "auto"):
    """Phase-1 and Phase-2 scores of every head (module docstring): a pandas DataFrame with
    columns ``COLUMNS``, one row per (layer, head), sorted by (layer, head).

    ``task``: a ``Task`` whose tokens the model reads (for a pretrained LLM, a text-rendered task:
    ``circuitkit.scoring.text.text_task``). ``anchor_directions``: "tokens" (anchor unembedding
    columns), "labels" (mean of the anchor's labels' columns) or "auto" (tokens when the CoT emits
    anchor tokens at ``anchor_pos``). ``batch_size``: examples per forward (default: from a
    256 MiB activation budget). ``df.attrs`` records the positions used and the write source.
    """
    import pandas as pd

    from circuitkit.patching import shortcuts

    check_task(task, "score_heads")
    if batch_size is not None and int(batch_size) < 1:
        raise ValueError(f"batch_size must be a positive integer or None; got {batch_size!r}.")
    task.check_model(model)
    n1 = sum(1 for e in task.examples for p in e.anchor_pos if p >= 1)
    n2 = sum(1 for e in task.examples for p in e.answer_pos if p >= 1)
    if n1 == 0 and n2 == 0:
        raise ValueError(f"task {task.name!r} has no anchor_pos and no answer_pos >= 1: no "
                         "Phase-1 or Phase-2 query positions to score heads at.")
    f = hooks.facts(model)
    L, H = f.n_layers, f.n_heads
    device = next(model.parameters()).device
    source = write_source(model)
    W_O = [b.attn.W_O.detach() for b in model.blocks] if source == "W_O" else None
    W_U = model.W_U.detach()
    mode = anchor_mode(task, anchor_directions)
    U = coarse.anchor_directions(W_U, task.anchor_token_ids, mode, task.label_token_ids,
                                 task.label_anchor) if n1 else None
    norm = refine.final_norm(model) if n2 else None
    post = {lay: refine.norm_params(model, n, f"block {lay}'s post-attention norm")
            for lay in range(L) if (n := hooks.post_norm(model, lay, "attn")) is not None}
    need = max(max(e.anchor_pos + e.answer_pos + e.shortlist_pos, default=0)
               for e in task.examples)
    seq = task.clean_tokens.shape[1]
    if f.causal:  # later positions cannot matter (a bidirectional model reads them all)
        seq = min(need + 1, seq)
    bs = int(batch_size) if batch_size else auto_batch(model, seq)
    names = {hooks.pattern(lay) for lay in range(L)}
    names |= {hooks.z(lay) if source == "W_O" else hooks.result(lay) for lay in range(L)}
    names |= {hooks.attn_module_out(lay) for lay in post}
    if n2:
        names.add(hooks.FINAL_NORM_IN)
    sums = {k: torch.zeros(L, H, dtype=torch.float64)
            for k in ("sharpness", "anchor_alignment", "loopback", "margin_widening")}
    ex1 = ex2 = 0
    starts = range(0, len(task), bs)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(task), desc="score heads", unit="example", file=sys.stderr,
                   dynamic_ncols=True)
    checked_norm = False
    for s in starts:
        sub = task.subset(range(s, min(s + bs, len(task))))
        tokens = sub.clean_tokens[:, :seq].to(device)
        plan = plan_queries(task, sub.examples, tokens.shape[1])
        ex1 += len(set(plan.b1.tolist()))
        ex2 += len(set(plan.b2.tolist()))
        first = torch.zeros(tokens.shape[0], 1, dtype=torch.long, device=device)
        result_ctx = shortcuts.attn_result_off(model) if source == "W_O" else _attn_result_on(model)
        with model.hooks(fwd_hooks=[(hooks.UNEMBED_IN, shortcuts.gather_rows(first))]), \
                result_ctx:
            _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
        if n2 and not checked_norm:
            _check_norm(model, cache[hooks.FINAL_NORM_IN][plan.b2[:4].to(device),
                                                           plan.q2[:4].to(device)], norm)
            checked_norm = True
        x2 = cache[hooks.FINAL_NORM_IN][plan.b2.to(device), plan.q2.to(device)] \
            if plan.b2.numel() else None
        margin_dir = margin_directions(W_U, plan.target_tok, plan.near_tok) \
            if plan.b2.numel() else None
        for lay in range(L):
            pat = cache[hooks.pattern(lay)]
            if pat.shape[1] != H:
                raise ValueError(f"hook_pattern of layer {lay} has {pat.shape[1]} heads; the cfg "
                                 f"says n_heads={H}.")
            for phase, b, q, w in ((1, plan.b1, plan.q1, plan.w1), (2, plan.b2, plan.q2, plan.w2)):
                if b.numel() == 0:
                    continue
                bd, qd = b.to(device), q.to(device)
                rows = pat[bd, :, qd, :].float()  # [N, H, S]
                writes = _writes(cache, lay, bd, qd, W_O)  # [N, H, D]
                if lay in post:  # the residual receives n(sum of heads): each head's share
                    writes = refine.final_norm_linear(
                        writes, cache[hooks.attn_module_out(lay)][bd, qd], *post[lay])
                wd = w.to(torch.float64)[:, None]
                if phase == 1:
                    valid = torch.arange(rows.shape[-1], device=device)[None, :] <= qd[:, None]
                    sharp = coarse.excess_kurtosis(rows, valid)
                    align = coarse.anchor_alignment(writes, U, plan.anchor1)
                    sums["sharpness"][lay] += (sharp.double().cpu() * wd).sum(0)
                    sums["anchor_alignment"][lay] += (align.double().cpu() * wd).sum(0)
                else:
                    lb = refine.loopback(rows, plan.target_keys.to(device),
                                         plan.near_keys.to(device))
                    scaled = refine.final_norm_linear(writes, x2, *norm)
                    mw = refine.margin_widening(scaled, margin_dir)
                    sums["loopback"][lay] += (lb.double().cpu() * wd).sum(0)
                    sums["margin_widening"][lay] += (mw.double().cpu() * wd).sum(0)
        del cache
        if bar is not None:
            bar.update(len(sub))
    if bar is not None:
        bar.close()
    nan = float("nan")
    mean = {k: (v / ex1 if ex1 else torch.full_like(v, nan)) if k in ("sharpness",
                                                                       "anchor_alignment")
            else (v / ex2 if ex2 else torch.full_like(v, nan)) for k, v in sums.items()}
    cs = coarse.coarse_score(mean["sharpness"], mean["anchor_alignment"])
    rs = refine.refine_score(mean["loopback"], mean["margin_widening"])
    layer, head = torch.meshgrid(torch.arange(L), torch.arange(H), indexing="ij")
    df = pd.DataFrame(dict(
        layer=layer.reshape(-1).numpy(), head=head.reshape(-1).numpy(),
        sharpness=mean["sharpness"].reshape(-1).numpy(),
        anchor_alignment=mean["anchor_alignment"].reshape(-1).numpy(),
        coarse_score=cs.reshape(-1).numpy(),
        loopback=mean["loopback"].reshape(-1).numpy(),
        margin_widening=mean["margin_widening"].reshape(-1).numpy(),
        refine_score=rs.reshape(-1).numpy()))
    for phase, col in ((1, "coarse_score"), (2, "refine_score")):
        values = df[col].dropna()
        if len(values) > 1 and values.max() == values.min():
            import warnings

            warnings.warn(f"every head has the same {col} ({values.max():.4g}): its ranks are "
                          "(layer, head) order, not a finding (Phase-1 sharpness needs query "
                          "rows long enough for kurtosis to exceed 0; docs/scores.md).",
                          stacklevel=2)
        # a phase the task has no steps for (induction: no anchors) gets no ranks, not row order
        rank = df[col].rank(ascending=False, method="first", na_option="bottom")
        df[f"phase{phase}_rank"] = rank.astype(int) if df[col].notna().any() \
            else pd.array([pd.NA] * len(df), dtype="Int64")
    df.attrs.update(task=task.name, task_fingerprint=task.fingerprint(), n_examples=len(task),
                    n_phase1_examples=ex1, n_phase2_examples=ex2, n_phase1_positions=n1,
                    n_phase2_positions=n2, anchor_directions=mode, write_source=source,
                    final_norm=norm[0] if norm else None,
                    model=str(getattr(model.cfg, "model_name", "")))
    return df[COLUMNS]


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


def _writes(cache: Any, layer: int, b: Tensor, q: Tensor, W_O: list[Tensor] | None
            ) -> Float[Tensor, "N H D"]:
    if W_O is None:
        return cache[hooks.result(layer)][b, q].float()
    z = cache[hooks.z(layer)][b, q].float()  # [N, H, d_head]
    return torch.einsum("nhd,hdm->nhm", z, W_O[layer].float())


@contextlib.contextmanager
def _attn_result_on(model: Any):
    """``hook_result`` on for the run (models scored through it), restored after."""
    was = bool(getattr(model.cfg, "use_attn_result", False))
    model.set_use_attn_result(True)
    try:
        yield
    finally:
        model.set_use_attn_result(was)


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
        raise ValueError(
            f"margin_widening: the final norm ({type(inner).__name__}) differs from its "
            f"{norm[0].upper()} form by {err:.2e}; this architecture's final norm is not "
            "supported (please report it).")
