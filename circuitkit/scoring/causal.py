"""Causal columns per head: each head patched at each position group, per phase and direction.

``causal_table`` runs ``ck.patch_heads(..., positions=groups)`` (the one public road) on each
phase's task (``tasks.base.phase_task(task, p)``: the examples with that phase's steps; its
metric ``phase_task(task, p).metric`` is the one ``characterize``'s sweeps and stages patch:
Phase 1 the anchor margin, Phase 2 the target-vs-sibling margin) and writes, for phase ``p``,
direction ``d`` and group ``g`` of ``task.position_groups(at)`` plus ``"all"`` (every real
position of each prompt: the whole head):

* ``p{p}_{d}_{g}`` = ``PatchResult.normalized()`` of the head at ``g``: denoise
  ``(v - corrupt) / (clean - corrupt)``, noise ``(v - clean) / (clean - corrupt)`` (a share of
  the phase's clean-corrupt gap; noise values are negative for a head the phase needs);
* ``p{p}_{d}_rank_{g}`` = 1 for the most helpful head at ``g`` (denoise: the largest value;
  noise: the most negative, the most harmful to remove), ties sharing the lower rank.

``carried(table, p, d, g)`` is the share of the gap a head carries with the sign made positive
for helpful in both directions; ``phase_table`` summarises where each phase's decision is made.
"""

from __future__ import annotations

import re
from typing import Any

DIRECTIONS = ("noise", "denoise")
ALL = "all"  # the group of every real position: the whole head
GROUP_SHARE = 0.1  # a group (a layer) "carries" a phase when its heads' shares sum to >= this


def causal_groups(task: Any, at: str = "steps") -> dict[str, Any]:
    """``task.position_groups(at)`` plus ``"all"``: each prompt's real positions (before its
    right padding), bool ``[batch, seq]``. Patching a head at "all" equals whole-head patching
    in a causal model (positions after the last read change nothing)."""
    import torch

    groups = dict(task.position_groups(at=at))
    seq = task.clean_tokens.shape[1]
    groups[ALL] = torch.arange(seq)[None] < (task.last_positions + 1)[:, None]
    return groups


def causal_table(model: Any, task: Any, *, n: int | None = None,
                 directions: tuple[str, ...] = DIRECTIONS, at: str = "steps",
                 batch_size: int | None = None, progress: bool = False):
    """One row per head (``layer``, ``head``, ``name``) with the module docstring's columns for
    each phase the task has steps of (``task_phases``). ``n``: the first ``n`` examples only.
    ``df.attrs``: per phase the metric name, prompts, clean, corrupt, gap, whether degenerate
    (then the columns are raw effects, ``PatchResult.normalized``), group names and sizes."""
    import circuitkit as ck
    from circuitkit.patching.results import quiet_baseline
    from circuitkit.tasks.base import phase_task, task_phases

    bad = [d for d in directions if d not in DIRECTIONS]
    if bad or not directions:
        raise ValueError(f"directions must be a non-empty subset of {DIRECTIONS}; got "
                         f"{tuple(directions)!r}.")
    if n is not None:
        if int(n) < 1:
            raise ValueError(f"n must be >= 1 examples; got {n!r}.")
        task = task.subset(range(min(int(n), len(task))))
    phases = [p for p in task_phases(task) if p in (1, 2)]
    if not phases:
        raise ValueError(f"causal_table: task {task.name!r} has no Phase-1 anchor steps and no "
                         "Phase-2 answer steps: no metric to patch.")
    sweeps = {}
    for p in phases:
        tp = phase_task(task, p)
        groups = causal_groups(tp, at)
        for d in directions:
            with quiet_baseline():  # the caller's sweeps say a degenerate baseline once
                sweeps[(p, d)] = (ck.patch_heads(model, tp.clean_tokens, tp.corrupt_tokens,
                                                 tp.metric, direction=d, positions=groups,
                                                 options=dict(batch_size=batch_size,
                                                              progress=progress,
                                                              task_hash=tp.fingerprint())), tp)
    return causal_frame(model.cfg.n_layers, model.cfg.n_heads, sweeps, at)


def causal_frame(n_layers: int, n_heads: int, sweeps: dict[tuple[int, str], Any],
                 at: str = "steps"):
    """``causal_table``'s frame from its sweeps: ``sweeps[(phase, direction)] = (result, phase
    task)``, each result a ``[layer, head, group]`` ``patch_heads`` over ``causal_groups``
    (``characterize --stages`` passes the sweeps it saved, so they run once)."""
    import pandas as pd

    from circuitkit.hooks import head_name

    L, H = n_layers, n_heads
    df = pd.DataFrame(dict(layer=[ly for ly in range(L) for _ in range(H)],
                           head=[h for _ in range(L) for h in range(H)]))
    df["name"] = [head_name(int(r.layer), int(r.head)) for r in df.itertuples()]
    info: dict[str, Any] = dict(at=at, phases=sorted({p for p, _ in sweeps}))
    for (p, d), (res, tp) in sweeps.items():
        norm = res.normalized().double()  # [layer, head, group]
        for g, name in enumerate(res.meta["group_names"]):
            col = norm[..., g].flatten().numpy()
            df[f"p{p}_{d}_{name}"] = col
            helpful = pd.Series(-col if d == "noise" else col)
            df[f"p{p}_{d}_rank_{name}"] = helpful.rank(ascending=False, method="min").astype(int)
        info[f"phase{p}"] = dict(
            metric=tp.metric.name, n_prompts=len(tp), clean=float(res.clean),
            corrupt=float(res.corrupt), gap=float(res.gap), degenerate=bool(res.degenerate),
            groups=list(res.meta["group_names"]),
            group_sizes=[round(s, 3) for s in res.meta.get("group_sizes", [])])
    df.attrs.update(info)
    return df


def _column(table: Any, phase: int, group: str, direction: str, rank: bool) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}; got {direction!r}.")
    col = f"p{phase}_{direction}_{'rank_' if rank else ''}{group}"
    if col not in table.columns:
        have = sorted({c.split("_", 2)[2] for c in table.columns
                       if c.startswith(f"p{phase}_{direction}_") and "_rank_" not in c})
        raise ValueError(f"no causal column {col!r}: phase {phase}, direction {direction!r} has "
                         f"groups {have or 'none (not in this table)'}.")
    return col


def carried(table: Any, phase: int, direction: str = "noise", group: str = ALL):
    """Each head's share of phase ``phase``'s gap at ``group``, positive when the head helps:
    ``-p{phase}_noise_{group}`` or ``p{phase}_denoise_{group}`` (a pandas Series by row)."""
    col = table[_column(table, phase, group, direction, rank=False)]
    return -col if direction == "noise" else col


def has_causal_columns(table: Any) -> bool:
    """Whether ``table`` holds ``causal_table``'s rank columns (``p{phase}_{direction}_rank_*``)."""
    return any(re.fullmatch(r"p[12]_(noise|denoise)_rank_.+", str(c)) for c in table.columns)


def causal_heads(table: Any, phase: int, k: int, group: str = ALL,
                 direction: str = "noise") -> list[tuple[int, int]]:
    """The ``k`` heads ranked best by ``p{phase}_{direction}_rank_{group}``, helpful first (ties
    to the lower ``(layer, head)``), as ``[(layer, head), ...]``."""
    if int(k) < 1:
        raise ValueError(f"k must be >= 1; got {k!r}.")
    col = _column(table, phase, group, direction, rank=True)
    best = table.sort_values([col, "layer", "head"]).head(int(k))
    return [(int(r.layer), int(r.head)) for r in best.itertuples()]


def phase_table(table: Any, k: int = 5, share: float = GROUP_SHARE,
                direction: str = "noise") -> dict[str, Any]:
    """Where each phase's decision is made, from ``causal_table``'s columns (``direction``'s;
    the other one if the table lacks it). Per phase: ``gap`` (clean - corrupt of its metric);
    ``groups``: per position group its top ``k`` heads ``[name, share]`` (``carried``) and
    ``sum`` (the sum of its heads' positive shares: additive, not a joint patch);
    ``carrying_groups``: the groups (not "all") whose ``sum`` is >= ``share``;
    ``layers``: per layer the sum of its heads' positive shares at "all", and
    ``carrying_layers``: those >= ``share``; ``top_heads``: the top ``k`` at "all". With both
    phases, ``same_heads``: ``overlap`` (heads in both top-``k`` sets), and each phase's gap
    share carried by the other phase's top ``k`` heads (summed single-head shares)."""
    have = {c.split("_")[1] for c in table.columns if c[:1] == "p" and c[1:2].isdigit()}
    if direction not in have:
        direction = next(iter(sorted(have)), direction)
    out: dict[str, Any] = dict(direction=direction, k=int(k), share=float(share))
    tops = {}
    for p in table.attrs.get("phases", [1, 2]):
        info = table.attrs.get(f"phase{p}", {})
        groups = [g for g in info.get("groups", []) if g != ALL] + [ALL]
        said: dict[str, Any] = {}
        for g in groups:
            s = carried(table, p, direction, g)
            top = s.sort_values(ascending=False, kind="stable").head(int(k))
            said[g] = dict(top=[[table.loc[i, "name"], round(float(v), 4)]
                                for i, v in top.items()],
                           sum=round(float(s.clip(lower=0).sum()), 4))
        whole = carried(table, p, direction, ALL).clip(lower=0)
        layers = {int(ly): round(float(v), 4)
                  for ly, v in whole.groupby(table["layer"]).sum().items()}
        tops[p] = causal_heads(table, p, k, ALL, direction)
        out[f"phase{p}"] = dict(
            metric=info.get("metric"), gap=info.get("gap"), degenerate=info.get("degenerate"),
            groups=said, carrying_groups=[g for g in groups if g != ALL
                                          and said[g]["sum"] >= share],
            layers=layers, carrying_layers=[ly for ly, v in layers.items() if v >= share],
            top_heads=[n for n, _ in said[ALL]["top"]])
    if 1 in tops and 2 in tops:
        from circuitkit.hooks import head_name

        def by(p: int, heads: list[tuple[int, int]]) -> float:
            s = carried(table, p, direction, ALL)
            pick = table[["layer", "head"]].apply(tuple, axis=1).isin(heads)
            return round(float(s[pick].sum()), 4)
        both = [h for h in tops[1] if h in tops[2]]
        out["same_heads"] = dict(overlap=[head_name(*h) for h in both], n_overlap=len(both),
                                 phase1_by_phase2_heads=by(1, tops[2]),
                                 phase2_by_phase1_heads=by(2, tops[1]),
                                 phase1_by_own_heads=by(1, tops[1]),
                                 phase2_by_own_heads=by(2, tops[2]))
    return out


def phase_sentences(table: dict[str, Any]) -> list[str]:
    """``phase_table``'s findings in words: where each phase's decision is made, and whether
    the same heads carry both phases."""
    lines, d = [], table.get("direction", "noise")
    for p in (1, 2):
        ph = table.get(f"phase{p}")
        if not ph:
            continue
        if ph.get("degenerate"):  # the one degenerate-baseline rule: no share of a gap
            lines.append(f"Phase {p}'s decision ({ph['metric']}, {d}) cannot be placed: the "
                         "corruption does not lower the metric by its margin, so no head, "
                         "layer or position group carries a share of a gap (the causal "
                         "columns hold raw effects). Use a corruption that removes the "
                         "behaviour, or more examples.")
            continue
        # (a name the table does not hold, e.g. a summary.json edited by hand, is left out)
        groups = [g for g in ph["carrying_groups"] if g in ph["groups"]]
        where = ", ".join(f"{g} ({ph['groups'][g]['sum']:.0%}; top {ph['groups'][g]['top'][0][0]}"
                          f" {ph['groups'][g]['top'][0][1]:.0%})" for g in groups)
        carrying = {str(ly) for ly in ph["carrying_layers"]}  # JSON keys are strings
        layers = ", ".join(f"layer {ly} ({v:.0%})" for ly, v in ph["layers"].items()
                           if str(ly) in carrying)
        lines.append(f"Phase {p}'s decision ({ph['metric']}, {d}) is made in "
                     f"{layers or 'no single layer'} at the "
                     f"{where or 'no single position group'} positions (summed single-head shares "
                     f"of the gap, >= {table['share']:.0%} shown; the group's top head).")
    same = table.get("same_heads")
    if same and any((table.get(f"phase{p}") or {}).get("degenerate") for p in (1, 2)):
        if same["n_overlap"]:  # (no shares of a gap a corruption does not open)
            lines.append(f"The same heads are among the top {table['k']} of both phases: "
                         f"{', '.join(same['overlap'])} (no shares: a phase's corruption does "
                         "not lower its metric).")
        same = None
    if same:
        if same["n_overlap"]:
            lines.append(
                f"The same heads carry both phases: {', '.join(same['overlap'])} "
                f"{'is' if same['n_overlap'] == 1 else 'are'} among the top {table['k']} of "
                f"each; Phase 2's top heads carry {same['phase1_by_phase2_heads']:.0%} of "
                f"Phase 1's gap and Phase 1's carry {same['phase2_by_phase1_heads']:.0%} of "
                "Phase 2's (summed single-head shares).")
        else:
            lines.append(
                f"No head is among the top {table['k']} of both phases; Phase 2's top heads "
                f"carry {same['phase1_by_phase2_heads']:.0%} of Phase 1's gap and Phase 1's "
                f"{same['phase2_by_phase1_heads']:.0%} of Phase 2's (summed single-head shares).")
    return lines
