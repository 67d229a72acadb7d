"""The paper's distillation claims, decided per definition of each measure (issue 50).

A grid's ``runs.csv`` (``ablation._write_tables``: one row per student, data, variant, seed,
metric) holds, per run, several definitions of one quantity. A claim is decided on each
definition separately, paired by seed against a baseline variant (``cot``):

* ``diff_k = value(variant, seed k) - value(baseline, seed k)`` over the seeds both ran;
* the 95% t-interval of their mean, ``mean +- t_{0.975, n-1} sd / sqrt(n)`` (``ablation.interval``);
* the **power**: the minimal detectable effect at 80% power of the two-sided 5% paired t-test,
  ``MDE = (t_{0.975, n-1} + t_{0.80, n-1}) sd / sqrt(n)`` (the usual normal-approximation form with
  t quantiles; NaN below 2 seeds);
* the verdict (``verdict``): *reproduced* when the interval excludes 0 on the claimed side (with
  whether the claimed size is inside it, above or below it), *refuted* when it excludes the claimed
  effect (0 inside it: "smaller than claimed"; all of it on the other side of 0: "the opposite
  effect"), *open* (not resolvable at this power) when it holds both; for a claim with no size
  (exact match and Macro-F1: "distillation helps"), *higher* / *lower* / *no difference detected*. A
  definition the grid did not measure (its metric absent from ``runs.csv``) is *not measured*.

``claim_summary`` states one claim across its definitions, and says so when they disagree (e.g.
refuted on the teacher-forced confusion and open on the output-level one).
"""

from __future__ import annotations

import math
from typing import Any

from circuitkit.experiments.distill_grid import T975, interval

# t_{0.80, df} for df = 1..30 (the one-sided 80% quantile: 80% power); 0.8416 beyond
T80 = (1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873,
       0.870, 0.868, 0.866, 0.865, 0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857,
       0.856, 0.856, 0.855, 0.855, 0.854, 0.854)

# claim -> (the paper's effect, None: a direction only (+1 up); its definitions, in order)
DEFINITIONS = {
    "confusion": "teacher-forced sibling confusion (restricted softmax mass on near-misses)",
    "confusion_rate": "output-level confusion (share of generated labels that are near-misses)",
    "confusion_embedding": "the paper's embedding-cosine Confusion",
    "focus": "teacher-forced focus on any of the note's anchors",
    "focus_per_step": "teacher-forced focus on each step's own anchor",
    "focus_embedding": "the paper's embedding-cosine Focus",
    "exact_match": "exact match of the generated label set",
    "macro_f1": "Macro-F1 of the generated labels",
}
CLAIMS: dict[str, dict[str, Any]] = {
    "confusion -0.07": dict(effect=-0.07, definitions=("confusion", "confusion_rate",
                                                       "confusion_embedding")),
    "focus +0.09": dict(effect=0.09, definitions=("focus", "focus_per_step",
                                                  "focus_embedding")),
    "accuracy up": dict(effect=None, direction=1, definitions=("exact_match", "macro_f1")),
}


def mde(sd: float, n: int) -> float:
    """The 80%-power minimal detectable paired effect of ``n`` pairs whose differences have
    standard deviation ``sd`` (module docstring); NaN below 2 pairs."""
    if n < 2 or sd != sd:
        return math.nan
    df = n - 1
    t1 = T975[df - 1] if df <= len(T975) else 1.96
    t2 = T80[df - 1] if df <= len(T80) else 0.8416
    return (t1 + t2) * sd / math.sqrt(n)


def paired(runs: Any, metric: str, variant: str, baseline: str = "cot",
           **cell: Any) -> dict[str, float] | None:
    """The paired comparison of ``variant`` against ``baseline`` on ``metric`` (module docstring) in
    the rows of ``runs`` (a ``runs.csv`` frame) matching ``cell`` (e.g. ``data="main"``): ``n, diff,
    ci_low, ci_high, half_width, sd, mde``; None when the metric was not measured for both."""
    sub = runs[runs.metric == metric]
    for k, v in cell.items():
        sub = sub[sub[k] == v]
    a = dict(zip(sub[sub.variant == variant].seed.astype(int),
                 sub[sub.variant == variant].value.astype(float), strict=True))
    b = dict(zip(sub[sub.variant == baseline].seed.astype(int),
                 sub[sub.variant == baseline].value.astype(float), strict=True))
    shared = sorted(set(a) & set(b))
    diffs = [a[k] - b[k] for k in shared if a[k] == a[k] and b[k] == b[k]]
    if not diffs:
        return None
    m, lo, hi = interval(diffs)
    n = len(diffs)
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / (n - 1)) if n > 1 else math.nan
    return dict(n=n, diff=m, ci_low=lo, ci_high=hi, half_width=(hi - lo) / 2, sd=sd,
                mde=mde(sd, n))


def verdict(lo: float, hi: float, effect: float | None, direction: int = 1) -> str:
    """A paired interval ``[lo, hi]`` read against a claim (module docstring)."""
    if lo != lo or hi != hi:
        return "not measured"
    if effect is None:
        low, high = sorted((direction * lo, direction * hi))
        return "higher" if low > 0 else "lower" if high < 0 else "no difference detected"
    s = 1 if effect > 0 else -1
    low, high = sorted((s * lo, s * hi))
    if low > 0:  # the direction holds; how its size stands against the claimed one
        return "reproduced" + (" (smaller than claimed)" if high < abs(effect) else
                               " (larger than claimed)" if low > abs(effect) else
                               " (the claimed size inside the interval)")
    if high < abs(effect):
        return "refuted" + (" (the opposite effect)" if high < 0 else
                            " (no effect in the claimed direction)" if high <= 0 else
                            " (smaller than claimed)")
    return "open (not resolvable at this power)"


def claim_rows(runs: Any, variants: list[str], baseline: str = "cot",
               **cell: Any) -> list[dict[str, Any]]:
    """One row per claim, definition and variant: the paired comparison against ``baseline``
    and its verdict; an unmeasured definition gives ``verdict="not measured"`` and NaNs."""
    rows = []
    for claim, spec in CLAIMS.items():
        for metric in spec["definitions"]:
            for v in variants:
                p = paired(runs, metric, v, baseline, **cell)
                nan = math.nan
                p = p or dict(n=0, diff=nan, ci_low=nan, ci_high=nan, half_width=nan, sd=nan,
                              mde=nan)
                said = verdict(p["ci_low"], p["ci_high"], spec["effect"],
                               spec.get("direction", 1))
                if p["n"] == 1:  # one pair: no interval, nothing decided
                    p.update(ci_low=nan, ci_high=nan, half_width=nan)
                    said = "open (one seed: no interval)"
                rows.append(dict(claim=claim, definition=metric, variant=v, baseline=baseline,
                                 **p, verdict=said))
    return rows


def claim_summary(rows: list[dict[str, Any]], claim: str, variant: str) -> str:
    """One sentence for ``claim`` and ``variant`` across its definitions: the common verdict,
    or each definition's when they differ ("refuted on confusion; open on confusion_rate;
    not measured on confusion_embedding")."""
    mine = [r for r in rows if r["claim"] == claim and r["variant"] == variant]
    measured = [r for r in mine if r["verdict"] != "not measured"]
    missing = [r["definition"] for r in mine if r["verdict"] == "not measured"]
    kinds = {r["verdict"].split(" (")[0] for r in measured}
    tail = f"; not measured on {', '.join(missing)}" if missing else ""
    if not measured:
        return f"{claim}, {variant}: not measured on any definition"
    if len(kinds) == 1:
        return (f"{claim}, {variant}: {kinds.pop()} on every measured definition "
                f"({', '.join(r['definition'] for r in measured)}){tail}")
    parts = []
    for r in measured:
        kind, _, why = r["verdict"].partition(" (")
        parts.append(f"{kind} on {r['definition']}" + (f" ({why}" if why else ""))
    return f"{claim}, {variant}: depends on the definition: {'; '.join(parts)}{tail}"


def fmt_row(r: dict[str, Any]) -> str:
    """A ``claim_rows`` row as a Markdown table row: definition, variant, n, paired
    difference [95% CI], MDE, verdict."""
    if r["verdict"] == "not measured":
        return f"| {r['definition']} | {r['variant']} | 0 | not measured | | not measured |"
    if r["n"] < 2:
        return (f"| {r['definition']} | {r['variant']} | {r['n']} | {r['diff']:+.3f} | | "
                f"{r['verdict']} |")
    return (f"| {r['definition']} | {r['variant']} | {r['n']} | {r['diff']:+.3f} "
            f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] | {r['mde']:.3f} | {r['verdict']} |")


def choose_weight(points: dict[str, dict[int, float]], direction: int) -> tuple[str, float]:
    """The variant (one weight of a lambda sweep) with the best seed mean of a held-out
    measure, ``points[variant][seed]``, in the claim's ``direction`` (+1: higher is better);
    ties go to the first listed. Returns ``(variant, its seed mean)``."""
    best, value = "", math.nan
    for v, by_seed in points.items():
        vals = [x for x in by_seed.values() if x == x]
        if not vals:
            continue
        m = sum(vals) / len(vals)
        if value != value or direction * m > direction * value:
            best, value = v, m
    return best, value
