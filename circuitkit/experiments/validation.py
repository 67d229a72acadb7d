"""``validate_heads`` and ``ablate_heads``: do the top-scored heads carry the behaviour? Patch or
ablate them together and compare with random head sets. The pools, quantities, columns and
checkpoints in full: docs/scores.md (Causal validation, Ablation table).

Random sets (``random_head_sets``): ``n_random`` distinct ``k``-sets per pool, none equal to the
top set (all of them, with a warning, when fewer exist). ``same-layers``: per layer holding ``c``
top heads, ``c`` others of that layer (too few others: all of them plus that layer's top heads,
the ``overlap`` column); ``all-layers``: ``k`` of every non-top head; ``layer-stratified``: per
layer holding ``c`` top heads, ``c`` of all of that layer's heads.

Every model run is ``ck.patch`` over ``ck.HeadSetUnits`` (the sets patched together: its checks, the
exact engine's ``run_head_sets``, the sweep orchestration and checkpoints): validation per phase and
direction (noise: corrupt ``z`` into the clean run; denoise: the reverse), reading the phase's
metric and its behaviour measure (``evaluation.focus_metric`` / ``confusion_metric``) on the same
patched logits; ablation on the clean run with ``source`` "zero", "mean" or "resample", reading
``exact_match_metric``, ``confusion`` and ``focus``. This module draws the sets and does the
statistics. Per quantity, ``d_i = patched_i - base_i``:

* ``top_effect = mean_i d_i`` with its bootstrap 95% interval; ``random_mean`` and the 2.5 / 97.5
  percentiles of a random set's mean effect over the same resamples;
* ``p_value = (1 + #{r: |effect_r| >= |top_effect| - tol}) / (1 + n_random)``, ``tol = TIE_RTOL
  * max(1, |top_effect|)``; ``p_low``/``p_high``: its Clopper-Pearson interval (``mc_interval``);
* validation: ``normalized = top_effect / (clean - corrupt)``; ablation: ``base``, ``top_value``,
  ``random_value`` (means).

``ValidationOptions.checkpoint``: a folder; each run's chunks are kept in a sub-folder named by
all the run depends on (``HeadSetUnits.checkpoint_in``), verified before reuse, so a rerun, or
a run killed mid-way, computes only the chunks not finished.
"""

from __future__ import annotations

import math
import random
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks
from circuitkit._warn import warn
from circuitkit.evaluation import (  # noqa: F401 (restricted_mass_metric re-exported)
    confusion_metric,
    focus_metric,
    restricted_mass_metric,
    step_reads,
)
from circuitkit.metrics import PromptMetric
from circuitkit.scoring.heads import _padded as _pad
from circuitkit.scoring.heads import scored_phases, top_heads
from circuitkit.tasks.base import Task, check_task, phase_task, task_phases

# random sets per pool: with 20, the same top set's p-value swung 0.048..0.143 over disjoint
# batches on the teacher (issue 34); 1000 puts the floor at 1/1001 and the MC interval's width
# near +-0.014 at p = 0.05
N_RANDOM = 1000
N_RANDOM_ABLATION = 20  # ablate_heads' default: three ablations, each reading three quantities
POOLS = ("same-layers", "all-layers")  # the default pools
ALL_POOLS = (*POOLS, "layer-stratified")  # any of these may be asked for (``pools=``)
ABLATIONS = ("zero", "mean", "resample")
SELECTIONS = ("score", "causal")
TIE_RTOL = 1e-6  # a random set's effect this close to the top set's counts as as strong
VALIDATION_COLUMNS = ["phase", "pool", "direction", "quantity", "heads", "k", "n_random",
                      "overlap", "n_prompts", "clean", "corrupt", "top_effect", "top_low",
                      "top_high", "random_mean", "random_low", "random_high", "p_value",
                      "p_low", "p_high", "normalized"]
ABLATION_COLUMNS = ["phase", "pool", "ablation", "quantity", "heads", "k", "n_random", "overlap",
                    "n_prompts", "base", "top_value", "top_effect", "top_low", "top_high",
                    "random_value", "random_mean", "random_low", "random_high", "p_value",
                    "p_low", "p_high"]


@dataclass(frozen=True)
class ValidationOptions:
    """How ``validate_heads``, ``validate_selections`` and ``ablate_heads`` run, one frozen
    object (a dict of its fields is taken too).

    Statistics: ``n_boot`` (bootstrap resamples of every interval); ``pools`` (the random sets'
    pools, distinct names among ``ALL_POOLS``; ``validate_selections`` takes each selection's
    own); ``selection`` (the top ``k`` by "score": ``top_heads``, or "causal": ``causal_heads``
    of the ``causal_table`` columns merged into ``scores``); ``sequential`` (draw each pool's
    sets in stages, ``SEQUENTIAL`` then ``n_random``, and stop a pool once every p-value's Monte
    Carlo interval lies wholly below or above ``ALPHA_SETTLED``). Runs: ``batch_size``
    (sequences per forward; None: from free memory, halved on out-of-memory), ``checkpoint``
    (a folder: each run's finished chunks kept durably, a rerun or a killed run resumes them;
    module docstring), ``progress`` (a line per run and the sweep's bar, on stderr)."""

    n_boot: int = 2000
    pools: tuple[str, ...] = POOLS
    selection: str = "score"
    sequential: bool = False
    batch_size: int | None = None
    checkpoint: str | Path | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        from circuitkit.patching.inputs import check_batch_size

        object.__setattr__(self, "pools", _check_pools(self.pools))
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r}; expected one of "
                             f"{list(SELECTIONS)}.")
        if isinstance(self.n_boot, bool) or not isinstance(self.n_boot, int) or self.n_boot < 1:
            raise ValueError(f"n_boot={self.n_boot!r}: expected a positive integer.")
        check_batch_size(self.batch_size)
        for name in ("sequential", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected True or False.")


def as_validation_options(options: Any) -> ValidationOptions:
    """``options``: None, a ``ValidationOptions`` or a dict of its fields (one line
    otherwise, naming the unknown fields)."""
    names = [f.name for f in fields(ValidationOptions)]
    if options is None:
        return ValidationOptions()
    if isinstance(options, ValidationOptions):
        return options
    if isinstance(options, dict) and set(options) <= set(names):
        return ValidationOptions(**options)
    bad = sorted(set(options) - set(names)) if isinstance(options, dict) else None
    raise ValueError(f"options={options!r:.80}: expected ValidationOptions(...) or a dict of "
                     f"{names}" + (f" (unknown: {bad})." if bad else "."))


def exact_match_metric(task: Task) -> PromptMetric:
    """Teacher-forced exact match per prompt: 1 when at every answer step ``p`` the arg-max of
    ``logits[p - 1]`` over the whole vocabulary is a token of one of the example's targets, else
    0 (0 for a prompt without answer steps). Not differentiable: the engine reads it at its
    declared positions."""
    ex = task.examples
    pos = _pad([e.answer_pos for e in ex])
    targets = _pad([task.label_token_ids[e.targets].tolist() for e in ex])

    def fn(logits: Tensor, idx: Tensor, rows: Tensor) -> Tensor:
        dev = logits.device
        p, t = pos[idx].to(dev), targets[idx].to(dev)
        valid = p >= 1
        b = torch.arange(logits.shape[0], device=dev)[:, None]
        best = logits[b, rows[b, (p - 1).clamp(min=0)]].argmax(-1)  # [n, steps]
        hit = ((best[..., None] == t[:, None, :]) & (t >= 0)[:, None, :]).any(-1)
        ok = (hit | ~valid).all(-1) & valid.any(-1)
        return ok.float()

    return PromptMetric(fn, "exact_match", reads=step_reads(pos))


def _against(k: int, top: Any, pools: list[str]) -> str:
    """A progress line's words for one top set: against which random sets it runs now (none
    when every pool of it is settled already)."""
    if not pools:
        return f"top-{k} {_fmt(top)} (its random sets settled)"
    return f"top-{k} {_fmt(top)} vs " + ", ".join(pools) + " random sets"


def _reads_metric(task: Task, phases: Sequence[int]) -> PromptMetric:
    """A metric that reads the logits before every step of ``phases`` (anchor and answer
    steps): the engine's metric for ``ablate_heads``, whose quantities read subsets of them.
    Its value (the mass of one candidate among itself) is 1."""
    ex = task.examples
    steps = [[p for p in (e.anchor_pos if 1 in phases else []) + (e.answer_pos if 2 in phases
                                                                    else []) if p >= 1]
             for e in ex]
    first = [[int(e.tokens[s[0]])] if s else [0] for e, s in zip(ex, steps, strict=True)]
    return restricted_mass_metric(steps, first, first, "reads")


def random_head_sets(top: Sequence[tuple[int, int]], n_heads: int, n_random: int,
                     seed: int, n_layers: int | None = None,
                     pool: str = "same-layers", exclude: Sequence[tuple[int, int]] = ()
                     ) -> list[list[tuple[int, int]]]:
    """Up to ``n_random`` distinct head sets of ``len(top)`` heads from ``pool`` (module docstring),
    none equal to ``top``, each sorted. Fewer distinct sets than ``n_random`` exist: all of them
    (the p-value is then exact over them; a warning says how many); none (the top heads fill their
    layers, or the model): an empty list, with a warning. ``n_layers``: needed for the "all-layers"
    pool; ``exclude``: heads the "all-layers" pool never draws besides the top set's
    (``validate_selections``: every selection's top heads, so that one pool serves them all)."""
    want = sorted(top)
    top_set = set(want)
    counts = sorted(Counter(layer for layer, _ in want).items())
    # groups: (the heads drawn from, the top heads that fill in when too few, how many) per layer
    if pool == "same-layers":
        groups = [([(layer, h) for h in range(n_heads) if (layer, h) not in top_set],
                   [x for x in want if x[0] == layer], c) for layer, c in counts]
    elif pool == "all-layers":
        if n_layers is None:
            raise ValueError("random_head_sets(pool='all-layers') needs n_layers.")
        banned = top_set | {tuple(h) for h in exclude}
        groups = [([(la, h) for la in range(n_layers) for h in range(n_heads)
                    if (la, h) not in banned], want, len(want))]
    elif pool == "layer-stratified":  # the top set's per-layer counts, from all of each layer
        groups = [([(layer, h) for h in range(n_heads)], [], c) for layer, c in counts]
    else:
        raise ValueError(f"pool={pool!r}; expected one of {list(ALL_POOLS)}.")
    possible = math.prod(math.comb(len(others), c) if len(others) >= c
                         else math.comb(len(mine), c - len(others)) for others, mine, c in groups)
    if pool == "layer-stratified":
        possible -= 1  # (the top set itself is one of them)
    if not any(others for others, _, _ in groups) or possible < 1:
        warn(f"no {pool} random head set differs from the top set {want}: the top "
                      "heads fill every head there; that pool is left out.")
        return []

    def draw(rng: random.Random) -> list[tuple[int, int]]:
        out = []
        for others, mine, c in groups:
            if len(others) >= c:
                out += rng.sample(others, c)
            else:  # too few others: all of them, and the rest from the layer's top heads
                out += others + rng.sample(mine, c - len(others))
        return sorted(out)

    return _distinct(draw, possible, want, n_random, seed, pool)


def _distinct(draw: Any, possible: int, top: list[tuple[int, int]], n_random: int,
              seed: int, pool: str) -> list[list[tuple[int, int]]]:
    """``min(n_random, possible)`` distinct draws, none equal to ``top`` (a repeated set would
    count twice in the p-value as if it were independent evidence)."""
    if possible < n_random:
        warn(f"only {possible} {pool} random head sets differ from the top set "
                      f"(n_random={n_random} asked): all {possible} are used, and the "
                      f"p-value's floor is 1/{possible + 1}.")
    rng, seen, out = random.Random(seed), {tuple(top)}, []
    while len(out) < min(n_random, possible):
        s = draw(rng)
        if tuple(s) not in seen:
            seen.add(tuple(s))
            out.append(s)
    return out


def overlap(top: Sequence[tuple[int, int]], sets: Sequence[Sequence[tuple[int, int]]]) -> int:
    """The most top heads any of ``sets`` shares with ``top`` (0 for no sets)."""
    return max((len(set(map(tuple, s)) & set(map(tuple, top))) for s in sets), default=0)


def effect_stats(base: Float[Tensor, " n"], top: Float[Tensor, " n"],
                 random_sets: Float[Tensor, "r n"], n_boot: int, seed: int) -> dict[str, float]:
    """``top_effect`` with its interval, ``random_mean`` and interval, ``p_value`` (module
    docstring) of the per-prompt values ``top`` and ``random_sets`` against ``base``."""
    from circuitkit.patching.results.patch_result import resample_weights

    nan = float("nan")
    d = (torch.cat([top[None], random_sets]) - base[None]).double()  # [1 + r, n]
    w = resample_weights(d.shape[1], n_boot, seed)
    boot = w @ d.T  # [n_boot, 1 + r]
    q = torch.tensor([0.025, 0.975], dtype=torch.float64)
    top_lo, top_hi = torch.quantile(boot[:, 0], q).tolist()
    effects = d.mean(1)
    t = float(effects[0])
    out = dict(top_effect=t, top_low=top_lo, top_high=top_hi, random_mean=nan, random_low=nan,
               random_high=nan, p_value=nan, p_low=nan, p_high=nan)
    if len(random_sets):
        r_lo, r_hi = torch.quantile(boot[:, 1:].reshape(-1), q).tolist()
        tol = TIE_RTOL * max(1.0, abs(t))
        hits = int((effects[1:].abs() >= abs(t) - tol).sum())
        p_lo, p_hi = mc_interval(hits, len(random_sets))
        out.update(random_mean=float(d[1:].mean()), random_low=r_lo, random_high=r_hi,
                   p_value=(1 + hits) / len(effects), p_low=p_lo, p_high=p_hi)
    return out


def _binom_cdf(b: int, r: int, p: float) -> float:
    """``P(X <= b)`` for ``X ~ Binomial(r, p)`` (float64 log-space terms)."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if b >= r else 0.0
    i = torch.arange(b + 1, dtype=torch.float64)
    log = (torch.lgamma(torch.tensor(r + 1.0, dtype=torch.float64)) - torch.lgamma(i + 1)
           - torch.lgamma(r - i + 1) + i * math.log(p) + (r - i) * math.log1p(-p))
    return float(torch.logsumexp(log, 0).exp().clamp(max=1.0))


def mc_interval(hits: int, r: int, level: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson ``level`` interval of the probability ``q`` that a random set is as
    strong as the top one, from ``hits`` of ``r`` random sets: ``q_low`` solves ``P(X >= hits;
    q_low) = a/2`` (0 when ``hits = 0``), ``q_high`` solves ``P(X <= hits; q_high) = a/2`` (1
    when ``hits = r``), ``a = 1 - level``, by bisection (1e-12). The Monte Carlo interval of
    ``p_value``: the p-value an infinite random pool would give lies in it (at ``level``)."""
    a = (1.0 - level) / 2

    def solve(b: int, target: float) -> float:  # the q with P(X <= b; q) = target (decreasing)
        lo, hi = 0.0, 1.0
        while hi - lo > 1e-12:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _binom_cdf(b, r, mid) > target else (lo, mid)
        return (lo + hi) / 2

    low = 0.0 if hits == 0 else solve(hits - 1, 1 - a)  # P(X >= hits; q_low) = a
    high = 1.0 if hits >= r else solve(hits, a)
    return low, high


def summarize(values: Float[Tensor, "n_sets n"], clean: Tensor, corrupt: Tensor,
              n_boot: int, seed: int) -> dict[str, float]:
    """Effect statistics of one quantity (module docstring). ``values[0]``: base run,
    ``values[1]``: top set, ``values[2:]``: random sets; ``clean``/``corrupt``: [n]."""
    from circuitkit.patching.results.patch_result import baseline_margin, share

    stats = effect_stats(values[0], values[1], values[2:], n_boot, seed)
    c, x = float(clean.double().mean()), float(corrupt.double().mean())
    # the degenerate-baseline rule's margin: no share of a gap within the per-prompt noise (a
    # quantity where lower is better, e.g. confusion, has a negative gap: its sign is its own)
    margin = baseline_margin(c, x, clean.double() - corrupt.double())
    return dict(clean=float(clean.mean()), corrupt=float(corrupt.mean()), **stats,
                normalized=share(stats["top_effect"], c - x, margin))


def _check_call(model: Any, task: Task, scores: Any, k: int, n_random: int, caller: str
                ) -> Any:
    f = hooks.facts(model)
    check_task(task, caller)
    if not 1 <= int(k) < f.n_layers * f.n_heads:
        raise ValueError(f"k must be in 1..{f.n_layers * f.n_heads - 1} (heads of the model, "
                         f"leaving some for random sets); got {k!r}.")
    if int(n_random) < 1:
        raise ValueError(f"n_random must be >= 1; got {n_random!r}.")
    if len(scores) != f.n_layers * f.n_heads:
        raise ValueError(f"scores has {len(scores)} rows; the model has "
                         f"{f.n_layers * f.n_heads} heads (score_heads of this model?).")
    task.check_model(model)
    return f


def _pooled_sets(top: list[tuple[int, int]], f: Any, n_random: int, seed: int,
                 pools: Sequence[str] = POOLS, exclude: Sequence[tuple[int, int]] = ()
                 ) -> dict[str, list[list[tuple[int, int]]]]:
    """Random sets of each of ``pools`` for ``top`` (pool ``i`` of ``ALL_POOLS`` seeded
    ``seed + 10 i``; ``exclude``: ``random_head_sets``')."""
    return {pool: random_head_sets(top, f.n_heads, n_random, seed + 10 * ALL_POOLS.index(pool),
                                   f.n_layers, pool, exclude) for pool in pools}


def _check_pools(pools: Sequence[str]) -> tuple[str, ...]:
    pools = tuple(pools)
    if not pools or any(p not in ALL_POOLS for p in pools) or len(set(pools)) != len(pools):
        raise ValueError(f"pools={list(pools)!r}; expected distinct names among "
                         f"{list(ALL_POOLS)}.")
    return pools


def _sorted_by_length(tp: Task, metric: PromptMetric | None = None) -> Task:
    """Prompts sorted by the last position their metric (default ``tp.metric``) reads: the order
    of every per-prompt value the statistics read (their bootstrap resamples prompts by index),
    and of a resample's length buckets (``exact.head_sets.resample_pairing``)."""
    need = (metric or tp.metric).reads.max(1).values
    return tp.subset(torch.argsort(need, stable=True).tolist())


def validate_heads(model: Any, task: Task, scores: Any, k: int = 5, n_random: int = N_RANDOM,
                   seed: int = 0, options: ValidationOptions | dict | None = None):
    """Causal check of ``scores`` (``score_heads``' DataFrame) on ``task`` (module docstring): a
    pandas DataFrame with ``VALIDATION_COLUMNS``, one row per (phase, pool, direction,
    quantity); ``df.attrs["sets"]``: the top and random head sets per phase and pool;
    ``df.attrs["selection"]``: ``options.selection``. ``options``: ``ValidationOptions`` (or a dict
    of its fields). Held-out validation: ``scores`` from another sample of notes than ``task``'s.
    Several selections at once, sharing each run: ``validate_selections``."""
    opts = as_validation_options(options)
    return validate_selections(model, task, scores, {opts.selection: opts.pools}, k, n_random,
                               seed, opts)[opts.selection]


SEQUENTIAL = (50, 100)  # ValidationOptions(sequential=True): where a pool may stop early
ALPHA_SETTLED = 0.05  # ... once every p-value's Monte Carlo interval lies on one side of it


def _checkpoints(n_random: int, sequential: bool) -> list[int]:
    """The set counts at which a sequential validation decides whether to go on."""
    return sorted({c for c in SEQUENTIAL if c < n_random} | {int(n_random)}) if sequential \
        else [int(n_random)]


def _settled(runs: dict[str, Tensor], pick: list[int], base: int) -> bool:
    """Whether every p-value of the rows ``pick`` (``[base, top, *random]``) in both
    directions and both quantities has its Monte Carlo interval wholly on one side of
    ``ALPHA_SETTLED`` (``effect_stats``' p and ``mc_interval``)."""
    for r in runs.values():
        for qi in range(r.shape[0]):
            v = r[qi][pick].double()
            effects = (v[1:] - v[0]).mean(1)
            t = float(effects[0])
            hits = int((effects[1:].abs() >= abs(t) - TIE_RTOL * max(1.0, abs(t))).sum())
            lo, hi = mc_interval(hits, len(pick) - 2)
            if lo <= ALPHA_SETTLED <= hi:
                return False
    return True


def validate_selections(model: Any, task: Task, scores: Any,
                        selections: dict[str, Sequence[str]], k: int = 5,
                        n_random: int = N_RANDOM, seed: int = 0,
                        options: ValidationOptions | dict | None = None) -> dict[str, Any]:
    """``validate_heads`` of each selection in ``selections`` (``{selection: pools}``): per (phase,
    direction) one ``ck.patch`` over the distinct sets of every selection (a set in two selections'
    lists runs once). With several selections the "all-layers" pool is one pool for all: ``k`` of
    the heads in no selection's top set (a selection's frame otherwise equals its own
    ``validate_heads`` call's). ``options``: ``ValidationOptions`` (or a dict of its fields; its
    ``pools`` and ``selection`` are ``selections``'). ``sequential``: each pool's sets drawn in
    stages (``SEQUENTIAL``: 50, 100, then ``n_random``), one ``ck.patch`` per stage and direction
    over the sets not run yet; a pool stops once the Monte Carlo interval of every one of its
    p-values (both directions, both quantities) lies wholly below or above ``ALPHA_SETTLED``; its
    rows then hold the first ``n_random`` sets drawn (``n_random`` column: how many), the same
    values as a call with that ``n_random`` (the draws are one seeded sequence)."""
    import pandas as pd

    opts = as_validation_options(options)
    asked = {sel: _check_pools(pools) for sel, pools in selections.items()}
    f = _check_call(model, task, scores, k, n_random, "validate_heads")
    phases = task_phases(task)
    if not phases:
        raise ValueError(f"validate_heads: task {task.name!r} has no Phase-1 anchor steps and no "
                         "Phase-2 answer steps (anchor_pos / answer_pos >= 1): nothing to test.")
    picks = {sel: _selection(scores, sel) for sel in selections}
    # the sets of every phase first (a phase the task has no steps for is left out)
    plan = {phase: _phase_plan(task, phase, {sel: picks[sel](phase, k) for sel in asked}, asked,
                               f, n_random, seed) for phase in phases}
    runs = SetRuns(model, opts)
    rows: dict[str, list] = {sel: [] for sel in selections}
    sets_used: dict[str, dict] = {sel: {} for sel in selections}
    for phase, (tp, per_sel, union) in plan.items():
        # (tp: the examples with steps of this phase, sorted by length)
        quantities = (tp.metric, focus_metric(tp) if phase == 1 else confusion_metric(tp))
        got, used = _validate_phase(runs, phase, tp, quantities, per_sel, union, n_random,
                                    k)
        for sel, (top, pools, at) in per_sel.items():
            kept = {pool: rand[:used[sel, pool]] for pool, rand in pools.items()}
            sets_used[sel][phase] = dict(top=top, random=kept)
            rows[sel] += _validation_rows(phase, quantities, got, (top, pools, at), kept, k,
                                          opts.n_boot, seed)
    out = {}
    for sel in selections:
        df = pd.DataFrame(rows[sel], columns=VALIDATION_COLUMNS)
        df.attrs.update(seed=seed, n_boot=opts.n_boot, sets=_sets_json(sets_used[sel]),
                        selection=sel)
        out[sel] = df
    return out


def _phase_plan(task: Task, phase: int, tops: dict[str, list], asked: dict[str, tuple],
                f: Any, n_random: int, seed: int) -> tuple[Task, dict, list]:
    """One phase's task (its examples sorted by length), each selection's ``(top, pools, at)``
    (``at``: the rows of ``[[], top, *(each pool's sets)]`` in the union) and the union of
    every selection's distinct sets."""
    per_sel, union, index = {}, [], {}
    # one all-layers pool for every selection: heads in no selection's top set
    every_top = sorted({h for t in tops.values() for h in t}) if len(tops) > 1 else []
    for sel, pools_asked in asked.items():
        top = tops[sel]
        pools = _pooled_sets(top, f, n_random, seed + phase, pools_asked, every_top)
        mine = [[], top, *(s for p in pools_asked for s in pools[p])]
        for s in mine:
            key = tuple(sorted(tuple(h) for h in s))
            if key not in index:
                index[key] = len(union)
                union.append(s)
        per_sel[sel] = (top, pools, [index[tuple(sorted(tuple(h) for h in s))] for s in mine])
    return _sorted_by_length(phase_task(task, phase)), per_sel, union


def _validate_phase(runs: SetRuns, phase: int, tp: Task, quantities: tuple[PromptMetric, ...],
                    per_sel: dict, sets: list, n_random: int, k: int
                    ) -> tuple[dict[str, Tensor], dict[tuple[str, str], int]]:
    """Every quantity after each set of ``sets`` in both directions, ``{direction: [2, n_sets,
    n_prompts]}``, and how many of each (selection, pool)'s random sets are in use: all of
    them, or (``sequential``) the first ``c`` of them once every p-value of the pool is settled
    at ``ALPHA_SETTLED`` by its Monte Carlo interval. One ``ck.patch`` per stage and direction
    over the sets not run yet."""
    from circuitkit.patching.units.head_sets import HeadSetUnits

    n = len(tp)
    got = {d: torch.full((2, len(sets), n), float("nan")) for d in ("noise", "denoise")}
    done = torch.zeros(len(sets), dtype=torch.bool)
    used = {(sel, pool): len(rand) for sel, (_, pools, _) in per_sel.items()
            for pool, rand in pools.items()}
    active = set(used)
    marks = _checkpoints(n_random, runs.opts.sequential)
    for c in marks:
        need = set()
        for sel, (_, pools, at) in per_sel.items():
            need.update(at[:2])
            for pool in pools:
                if (sel, pool) in active:
                    need.update(at[r] for r in _pool_rows(pools, pool)[:c])
        todo = sorted(i for i in need if not bool(done[i]))
        units = HeadSetUnits([sets[i] for i in todo], metrics=quantities[1:]) if todo else None
        for direction in ("noise", "denoise") if todo else ():
            said = "; ".join(_against(k, top, [
                f"{min(len(s), c)} {p}" for p, s in pools.items() if (sel, p) in active])
                for sel, (top, pools, _) in per_sel.items())
            runs.say(f"validate: phase {phase} {direction}, {said}, {n} prompts ({len(todo)} "
                     "distinct sets)")
            got[direction][:, todo] = runs(tp.clean_tokens, tp.corrupt_tokens, quantities[0],
                                           units, direction, f"validate-p{phase}-{direction}")
        done[todo] = True
        if c == marks[-1]:
            break
        for sel, pool in sorted(active):
            _, pools, at = per_sel[sel]
            m = min(c, len(pools[pool]))
            pick = [at[0], at[1]] + [at[r] for r in _pool_rows(pools, pool)[:m]]
            if m == len(pools[pool]) or _settled(got, pick, at[0]):
                used[sel, pool] = m
                active.discard((sel, pool))
    return got, used


def _validation_rows(phase: int, quantities: tuple[PromptMetric, ...], got: dict[str, Tensor],
                     plan: tuple, kept: dict[str, list], k: int, n_boot: int, seed: int
                     ) -> list[dict]:
    """One selection's rows of ``phase``: per pool of ``kept`` (its random sets in use),
    direction and quantity, ``summarize`` of its sets' values (``plan``: its ``(top, pools,
    at)``); the base of noise is the clean run, of denoise the corrupt one."""
    top, pools, at = plan
    n, rows = got["noise"].shape[2], []
    for pool, rand in kept.items():
        pick = [at[0], at[1]] + [at[r] for r in _pool_rows(pools, pool)[:len(rand)]]
        for direction in ("noise", "denoise"):
            for qi, q in enumerate(quantities):
                stats = summarize(got[direction][qi][pick], got["noise"][qi, at[0]],
                                  got["denoise"][qi, at[0]], n_boot, seed)
                rows.append(dict(phase=phase, pool=pool, direction=direction, quantity=q.name,
                                 heads=_fmt(top), k=int(k), n_random=len(rand),
                                 overlap=overlap(top, rand), n_prompts=n, **stats))
    return rows


class SetRuns:
    """The model runs of the experiments on head sets (validation, ablation, the cumulative
    bins): each a ``ck.patch`` over ``HeadSetUnits`` (``method="exact"``; the baselines'
    degenerate-rule warning silenced: the statistics apply it), with ``opts``' run settings
    (``batch_size``, ``progress``) and, with ``checkpoint``, each run in its own folder under
    it (``HeadSetUnits.checkpoint_in``)."""

    def __init__(self, model: Any, opts: ValidationOptions):
        from circuitkit.identity import model_fingerprint

        self.model, self.opts, self.root, self.fingerprint = model, opts, None, None
        if opts.checkpoint is not None:
            from circuitkit.files import check_writable_dir

            self.root = check_writable_dir(opts.checkpoint, "checkpoint")
            if any(self.root.glob("validation-*.safetensors")):
                warn(f"circuitkit: {self.root} holds validation checkpoints of an older "
                     "circuitkit (validation-*.safetensors); they are not read: their runs are "
                     "recomputed.")
            self.fingerprint = model_fingerprint(model)  # (once: it reads every weight)

    def say(self, line: str) -> None:
        if self.opts.progress:
            print(line, file=sys.stderr)

    def patch(self, clean: Tensor, corrupt: Tensor, metric: PromptMetric, units: Any,
              direction: str, label: str) -> Any:
        """The ``PatchResult`` of ``units`` (its checkpoint folder under ``checkpoint`` named
        ``<label>-<key>``)."""
        from circuitkit.patching.api import patch
        from circuitkit.patching.results import quiet_baseline
        from circuitkit.patching.units.base import PatchOptions

        folder = None if self.root is None else units.checkpoint_in(
            self.root, label, self.model, clean, corrupt, metric, direction, self.fingerprint)
        with quiet_baseline():
            return patch(self.model, clean, corrupt, metric, units, "exact", PatchOptions(
                direction=direction, batch_size=self.opts.batch_size, checkpoint=folder,
                progress=self.opts.progress))

    def __call__(self, clean: Tensor, corrupt: Tensor, metric: PromptMetric, units: Any,
                 direction: str, label: str) -> Float[Tensor, "n_reads n_sets n_prompts"]:
        """Every metric of ``units`` (``metric`` first) after each of its sets."""
        from circuitkit.patching.units.head_sets import set_values

        res = self.patch(clean, corrupt, metric, units, direction, label)
        return torch.stack(list(set_values(res).values())).transpose(1, 2)


def _selection(scores: Any, selection: str):
    """``(phase, k) -> top heads`` of ``selection`` (``validate_heads``), checked up front."""
    if selection == "score":
        return lambda phase, k: top_heads(scores, phase, k)
    if selection != "causal":
        raise ValueError(f"selection={selection!r}; expected one of {list(SELECTIONS)}.")
    from circuitkit.scoring.causal import causal_heads, has_causal_columns

    if not has_causal_columns(scores):
        raise ValueError("selection='causal' needs the causal columns in scores "
                         "(scoring.causal.causal_table merged on layer, head; characterize "
                         "--stages writes them into scores.csv).")
    return lambda phase, k: causal_heads(scores, phase, k)


def _pool_rows(pools: dict[str, list], pool: str) -> list[int]:
    """Rows of ``pool``'s random sets in ``[[], top, *(each pool's sets, in order)]``."""
    names = list(pools)
    start = 2 + sum(len(pools[p]) for p in names[:names.index(pool)])
    return list(range(start, start + len(pools[pool])))


def _sets_json(sets_used: dict[int, dict]) -> dict[int, dict]:
    return {p: dict(top=[list(h) for h in d["top"]],
                    random={pool: [[list(h) for h in s] for s in rs]
                            for pool, rs in d["random"].items()},
                    overlap={pool: overlap(d["top"], rs) for pool, rs in d["random"].items()})
            for p, d in sets_used.items()}


def ablation_task(task: Task) -> Task:
    """The examples ``ablate_heads`` runs on: those with steps of every phase ``task`` has,
    sorted by the last position they read."""
    phases = task_phases(task)
    keep = [i for i, e in enumerate(task.examples)
            if all(any(p >= 1 for p in (e.anchor_pos if ph == 1 else e.answer_pos))
                   for ph in phases)]
    if not keep:
        raise ValueError(f"ablate_heads: no example of task {task.name!r} has steps of every "
                         f"phase it holds ({phases}); the metrics need them on the same prompts.")
    sub = task.subset(keep)
    return _sorted_by_length(sub, _reads_metric(sub, phases))


def ablate_heads(model: Any, task: Task, scores: Any, k: int = 5,
                 n_random: int = N_RANDOM_ABLATION, ablations: Sequence[str] = ABLATIONS,
                 seed: int = 0, options: ValidationOptions | dict | None = None):
    """Ablation table of ``scores``' top-``k`` heads of each phase against random head sets (module
    docstring): a pandas DataFrame with ``ABLATION_COLUMNS``, one row per (phase, pool, ablation,
    quantity). ``ablations``: any of "zero", "mean", "resample" (each one ``ck.patch`` per phase
    over ``HeadSetUnits(sets, source=ablation, seed=seed)``). Quantities: ``exact_match`` and
    ``confusion`` where the task has answer steps, ``focus`` where it has anchor steps, all on the
    same prompts (``ablation_task``). ``options``: ``ValidationOptions`` (or a dict of its fields):
    ``pools``, ``selection``, ``n_boot``, ``batch_size``, ``checkpoint``, ``progress``."""
    import pandas as pd

    from circuitkit.patching.units.head_sets import HeadSetUnits

    opts = as_validation_options(options)
    f = _check_call(model, task, scores, k, n_random, "ablate_heads")
    if isinstance(ablations, str) or not ablations or any(a not in ABLATIONS for a in ablations):
        raise ValueError(f"ablations={list(ablations)!r}; expected a non-empty subset of "
                         f"{list(ABLATIONS)}.")
    phases = task_phases(task)
    if not phases:
        raise ValueError(f"ablate_heads: task {task.name!r} has no anchor or answer steps.")
    tp = ablation_task(task)
    n = len(tp)
    if "resample" in ablations and n < 2:
        raise ValueError("ablate_heads: 'resample' takes z from another prompt; the task has "
                         f"{n} prompt with steps of every phase. Use more examples.")
    quantities = ([exact_match_metric(tp), confusion_metric(tp)] if 2 in phases else []) \
        + ([focus_metric(tp)] if 1 in phases else [])
    pick = _selection(scores, opts.selection)
    runs = SetRuns(model, opts)
    rows, sets_used = [], {}
    for phase in [p for p in phases if p in scored_phases(scores)]:
        top = pick(phase, k)
        pools = _pooled_sets(top, f, n_random, seed + phase, opts.pools)
        sets = [[], top, *(s for p in opts.pools for s in pools[p])]
        sets_used[phase] = dict(top=top, random=pools)
        for ablation in ablations:  # base = source = clean: "source" would change nothing
            runs.say(f"ablate: phase-{phase} top-{k} {_fmt(top)}, {ablation} ablation, "
                     f"{len(sets) - 1} sets, {n} prompts")
            units = HeadSetUnits(sets, source=ablation, seed=seed, metrics=quantities[1:])
            run = runs(tp.clean_tokens, tp.clean_tokens, quantities[0], units, "noise",
                       f"ablate-p{phase}-{ablation}")
            rows += _ablation_rows(phase, ablation, quantities, run, top, pools, k, opts.n_boot,
                                   seed)
    df = pd.DataFrame(rows, columns=ABLATION_COLUMNS)
    df.attrs.update(seed=seed, n_boot=opts.n_boot, sets=_sets_json(sets_used))
    return df


def _ablation_rows(phase: int, ablation: str, quantities: list[PromptMetric], run: Tensor,
                   top: list, pools: dict[str, list], k: int, n_boot: int, seed: int
                   ) -> list[dict]:
    """One (phase, ablation)'s rows, per pool and quantity: ``run`` ``[n_quantities, n_sets,
    n_prompts]`` over ``[[], top, *(each pool's sets)]``, the empty set the base run."""
    rows = []
    for pool, rand in pools.items():
        pick = [1] + _pool_rows(pools, pool)
        for qi, q in enumerate(quantities):
            v = run[qi]
            stats = effect_stats(v[0], v[1], v[pick[1:]], n_boot, seed)
            rows.append(dict(
                phase=phase, pool=pool, ablation=ablation, quantity=q.name, heads=_fmt(top),
                k=int(k), n_random=len(rand), overlap=overlap(top, rand),
                n_prompts=v.shape[1], base=float(v[0].mean()), top_value=float(v[1].mean()),
                random_value=float(v[pick[1:]].mean()) if len(rand) else float("nan"),
                **stats))
    return rows


def _fmt(heads: Sequence[tuple[int, int]]) -> str:
    return " ".join(hooks.head_name(layer, h) for layer, h in heads)
