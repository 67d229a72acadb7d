"""The ablation grid's tables and verdicts as Markdown, from a finished ``distill --ablation``
folder (its ``runs.csv``): per cell (student x data size) one table with the task columns and
the mechanistic-fidelity columns side by side (mean [95% t-interval over seeds]), then, per
claim, the paired differences that decide it (seed ``k`` of two variants share their start).

    python benchmarks/distill_ablation_report.py DIR [--copy-to benchmarks/results/distill-ablation]

A claim holds in a cell when the paired difference's 95% interval excludes 0 in its direction.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pandas as pd

from circuitkit.experiments.distill_grid import interval

TASK = ["focus", "confusion", "confusion_rate", "macro_f1", "exact_match", "las",
        "las_gold_prefit"]
FIDELITY = ["p1_gap", "p2_gap", "sharpness", "anchor_alignment_tokens", "coarse_score_tokens",
            "shortlist_share", "key_preference", "loopback", "refine_score", "margin_widening"]
VARIANTS = ["cot", "p1", "p2", "p1+p2", "nonselective"]
# claim -> (metric, sign that supports it)
P1_FID = [("p1_gap", -1), ("sharpness", 1), ("anchor_alignment_tokens", 1),
          ("coarse_score_tokens", 1)]
P2_FID = [("p2_gap", -1), ("shortlist_share", 1), ("key_preference", 1), ("loopback", 1),
          ("refine_score", 1), ("margin_widening", 1)]


def paired(runs: pd.DataFrame, cell: tuple[str, str], metric: str, a: str, b: str):
    """Mean [95% t-interval] of ``a - b`` over the seeds both ran, and their number."""
    s, d = cell
    sub = runs[(runs.student == s) & (runs.data == d) & (runs.metric == metric)]
    va = dict(zip(sub[sub.variant == a].seed, sub[sub.variant == a].value, strict=True))
    vb = dict(zip(sub[sub.variant == b].seed, sub[sub.variant == b].value, strict=True))
    shared = sorted(set(va) & set(vb))
    return interval([va[k] - vb[k] for k in shared]), len(shared)


def fmt(m, lo, hi) -> str:
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def verdict(iv, sign: int) -> str:
    m, lo, hi = iv
    if sign * lo > 0 and sign * hi > 0:
        return "holds"
    if sign * lo < 0 and sign * hi < 0:
        return "reversed"
    return "no difference"


def report(folder: Path) -> str:
    runs = pd.read_csv(folder / "runs.csv")
    cells = list(dict.fromkeys(zip(runs.student, runs.data, strict=True)))
    out = []
    for cell in cells:
        s, d = cell
        sub = runs[(runs.student == s) & (runs.data == d)]
        n = sub.groupby("variant").seed.nunique()
        out.append(f"#### {s} x {d} data (seeds per variant: "
                   + ", ".join(f"{v} {int(n[v])}" for v in VARIANTS if v in n) + ")\n")
        out.append("| metric | " + " | ".join(VARIANTS) + " |")
        out.append("|---|" + "---|" * len(VARIANTS))
        for group, metrics in (("task", TASK), ("fidelity", FIDELITY)):
            for m in metrics:
                cells_ = []
                for v in VARIANTS:
                    vals = sub[(sub.variant == v) & (sub.metric == m)].value.tolist()
                    cells_.append(fmt(*interval(vals)) if vals else "")
                out.append(f"| {group}: {m} | " + " | ".join(cells_) + " |")
        out.append("")
    out.append("#### Claims: paired differences (variant - baseline), mean [95% t-interval]\n")
    out.append("| cell | claim | variant | vs cot | vs nonselective |")
    out.append("|---|---|---|---|---|")
    for cell in cells:
        name = f"{cell[0]} x {cell[1]}"
        for claim, metric, sign in (("Focus up", "focus", 1),
                                    ("Confusion down", "confusion", -1)):
            for v in ("p1", "p2", "p1+p2"):
                parts = []
                for b in ("cot", "nonselective"):
                    iv, k = paired(runs, cell, metric, v, b)
                    parts.append(f"{fmt(*iv)} n={k}: {verdict(iv, sign)}")
                out.append(f"| {name} | {claim} | {v} | " + " | ".join(parts) + " |")
        for v, fid in (("p1", P1_FID), ("p2", P2_FID), ("p1+p2", P1_FID + P2_FID)):
            for metric, sign in fid:
                parts = []
                for b in ("cot", "nonselective"):
                    iv, k = paired(runs, cell, metric, v, b)
                    parts.append(f"{fmt(*iv)}: {verdict(iv, sign)}")
                claim = f"fidelity {metric} {'up' if sign > 0 else 'down'}"
                out.append(f"| {name} | {claim} | {v} | " + " | ".join(parts) + " |")
        for metric, sign in (("focus", 1), ("confusion", -1)):
            parts = []
            for b in ("p1", "p2"):
                iv, k = paired(runs, cell, metric, "p1+p2", b)
                parts.append(f"vs {b}: {fmt(*iv)} n={k}: {verdict(iv, sign)}")
            out.append(f"| {name} | both phases needed ({metric}) | p1+p2 | "
                       + " | ".join(parts) + " |")
    return "\n".join(out)


def fidelity_summary(folder: Path) -> str:
    """Per cell and variant: which fidelity sub-metrics move the teacher's way beyond seed noise
    (paired 95% interval), against ``cot`` and against ``nonselective``."""
    runs = pd.read_csv(folder / "runs.csv")
    cells = list(dict.fromkeys(zip(runs.student, runs.data, strict=True)))
    out = ["| cell | variant | holds vs cot | reversed vs cot | holds vs nonselective | "
           "reversed vs nonselective |", "|---|---|---|---|---|---|"]
    for cell in cells:
        for v, fid in (("p1", P1_FID), ("p2", P2_FID), ("p1+p2", P1_FID + P2_FID),
                       ("nonselective", P1_FID + P2_FID)):
            row = [f"{cell[0]} x {cell[1]}", v]
            for b in ("cot", "nonselective"):
                if b == v:
                    row += ["", ""]
                    continue
                got = {"holds": [], "reversed": []}
                for metric, sign in fid:
                    verd = verdict(paired(runs, cell, metric, v, b)[0], sign)
                    if verd in got:
                        got[verd].append(metric)
                row += [", ".join(got["holds"]) or "-", ", ".join(got["reversed"]) or "-"]
            out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--copy-to", type=Path, default=None,
                    help="also copy ablation.csv, runs.csv, comparisons.csv, ablation.json and "
                         "teacher.json there")
    ap.add_argument("--fidelity-summary", action="store_true",
                    help="print only the per-variant summary of the fidelity claims")
    a = ap.parse_args()
    print(fidelity_summary(a.folder) if a.fidelity_summary else report(a.folder))
    if a.copy_to is not None:
        a.copy_to.mkdir(parents=True, exist_ok=True)
        for f in ("ablation.csv", "runs.csv", "comparisons.csv", "ablation.json",
                  "teacher.json"):
            shutil.copyfile(a.folder / f, a.copy_to / f)


if __name__ == "__main__":
    main()
