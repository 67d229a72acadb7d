"""Verdicts per definition and per lambda (issue 50), as Markdown, from a grid folder: a lambda
sweep (``distill --ablation --size sweep --variants cot,p1+p2@0.1,...``), finished or not (the
runs measured so far: each run's ``metrics.json``), or any committed grid's ``runs.csv``.

* each mechanistic variant's effective share of the CoT gradient per term (``share_p1``,
  ``share_p2``: the mean over the run's steps of ``|lambda_k s_k g_k| / |c g_CoT|``,
  ``loss.balanced_gradients``), mean [95% interval over seeds];
* every claim on every definition (``experiments.verdicts``): the paired difference against CoT-only
  [95% t-interval], the 80%-power minimal detectable effect, the verdict; "not measured" for a
  definition the runs lack (the embedding-cosine Focus / Confusion until the evaluation returns
  them); one line per claim and variant saying whether the definitions agree;
* the weight chosen on held-out notes (each run's last ``curve.json`` point: pool seed 99, not
  the test notes) per definition and mechanistic variant, and the test-note verdict at it;
* the budget: each run's training and measuring seconds.

    python benchmarks/distill_sweep_report.py DIR [--copy-to DEST] [--write FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pandas as pd

from circuitkit.experiments import verdicts
from circuitkit.experiments.distill_grid import (
    EMBEDDING_METRICS,
    METRICS,
    SHARE_METRICS,
    interval,
    variant_of,
)


def collect(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(runs, curves, times)`` of the runs measured so far in ``folder/runs`` (the rows
    ``ablation._write_tables`` writes, whatever the grid's progress), else the committed
    ``runs.csv`` / ``curves.csv`` / ``times.csv`` beside it (``--copy-to``)."""
    rows, pts, times = [], [], []
    for path in sorted(folder.glob("runs/*/*-seed*/metrics.json")):
        rec = json.loads(path.read_text())
        r, m = rec["run"], rec["metrics"]
        rows += [dict(student=r["student"], data=r["data"], variant=r["variant"],
                      seed=r["seed"], metric=k, value=float(m[k]))
                 for k in METRICS + EMBEDDING_METRICS + SHARE_METRICS if k in m]
        curve = path.parent / "curve.json"
        if curve.exists():
            pts += [dict(data=r["data"], variant=r["variant"], seed=r["seed"], **p)
                    for p in json.loads(curve.read_text())]
        dist = json.loads((path.parent / "distill.json").read_text())
        times.append(dict(variant=r["variant"], seed=r["seed"],
                          train_seconds=dist.get("train_seconds"),
                          eval_seconds=rec.get("eval_seconds")))
    if rows:
        return pd.DataFrame(rows), pd.DataFrame(pts), pd.DataFrame(times)

    def read(name: str) -> pd.DataFrame:
        return pd.read_csv(folder / name) if (folder / name).exists() else pd.DataFrame()

    return read("runs.csv"), read("curves.csv"), read("times.csv")


def copy_results(folder: Path, dest: Path) -> None:
    """What is committed: the grid's record and teacher metrics, and the runs measured so far
    as ``runs.csv``, ``curves.csv``, ``times.csv`` (no models, no stores)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("ablation.json", "teacher.json"):
        if (folder / name).exists():
            shutil.copyfile(folder / name, dest / name)
    runs, curves, times = collect(folder)
    runs.to_csv(dest / "runs.csv", index=False)
    curves.to_csv(dest / "curves.csv", index=False)
    times.to_csv(dest / "times.csv", index=False)


def fmt(iv) -> str:
    m, lo, hi = iv
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def report(folder: Path) -> str:
    runs, curves, times = collect(folder)
    record = (json.loads((folder / "ablation.json").read_text())
              if (folder / "ablation.json").exists() else {})
    out = []
    for data in dict.fromkeys(runs.data):
        sub = runs[runs.data == data]
        order = record.get("variants") or list(dict.fromkeys(sub.variant))
        variants = [v for v in order if v in set(sub.variant)]
        mech = [v for v in variants if v != "cot"]
        seeds = {v: sorted(set(sub[sub.variant == v].seed)) for v in variants}
        out.append(f"### Arm `{data}`: runs measured per variant: "
                   + ", ".join(f"{v} {len(s)}" for v, s in seeds.items()) + "\n")
        # test-note means
        metrics = [m for m in list(verdicts.DEFINITIONS) + ["las", "p1_gap", "p2_gap"]
                   if m in set(sub.metric)]
        out.append("| metric | " + " | ".join(variants) + " |")
        out.append("|---|" + "---|" * len(variants))
        for m in metrics:
            cells = [fmt(interval(sub[(sub.variant == v) & (sub.metric == m)].value.tolist()))
                     for v in variants]
            out.append(f"| {m} | " + " | ".join(cells) + " |")
        for m in (x for x in EMBEDDING_METRICS if x not in set(sub.metric)):
            out.append(f"| {m} | " + " | ".join("not measured" for _ in variants) + " |")
        out.append("\nEffective share of each term (mean over the run's steps of "
                   "|lambda_k s_k g_k| / |c g_CoT|), mean [95% interval over seeds]:\n")
        out.append("| variant | " + " | ".join(SHARE_METRICS) + " |")
        out.append("|---|" + "---|" * len(SHARE_METRICS))
        for v in mech:
            cells = []
            for k in SHARE_METRICS:
                vals = sub[(sub.variant == v) & (sub.metric == k)].value.tolist()
                cells.append(fmt(interval(vals)) if vals else "not recorded")
            out.append(f"| {v} | " + " | ".join(cells) + " |")
        rows = verdicts.claim_rows(sub, mech, "cot")
        out.append("\nClaims per definition, paired against `cot` over the seeds both ran "
                   "(difference [95% t-interval]; MDE: the 80%-power minimal detectable "
                   "effect):\n")
        for claim in verdicts.CLAIMS:
            out.append(f"**{claim}**\n")
            out.append("| definition | variant | n | Δ vs cot | MDE | verdict |")
            out.append("|---|---|---|---|---|---|")
            out += [verdicts.fmt_row(r) for r in rows if r["claim"] == claim]
            out.append("")
            out += [f"* {verdicts.claim_summary(rows, claim, v)}" for v in mech]
            out.append("")
        out += _chosen(sub, curves[curves.data == data] if len(curves) else curves, mech)
        if len(times):
            t = times[times.variant.isin(variants)]
            out.append(f"\nBudget: {len(t)} runs, training {t.train_seconds.sum():.0f} s "
                       f"(per run {t.train_seconds.min():.0f}-{t.train_seconds.max():.0f} s), "
                       f"measuring {t.eval_seconds.sum():.0f} s "
                       f"({t.eval_seconds.min():.0f}-{t.eval_seconds.max():.0f} s a run).\n")
    return "\n".join(out)


def _chosen(sub: pd.DataFrame, curves: pd.DataFrame, mech: list[str]) -> list[str]:
    """The weight chosen on held-out notes per definition and mechanistic variant, and the
    test-note verdict at it."""
    if not len(curves) or not any("@" in v for v in mech):
        return []
    last = curves.sort_values("step").groupby(["variant", "seed"]).tail(1)
    out = ["Weight chosen on held-out notes (each run's last curve point, 128 train notes of "
           "pool seed 99; the seed mean, best in the claim's direction), verdict on the test "
           "notes at that weight:\n",
           "| variant | definition | chosen | held-out mean (cot's) | Δ vs cot on test | MDE | "
           "verdict |", "|---|---|---|---|---|---|---|"]
    for base in dict.fromkeys(variant_of(v)[0] for v in mech):
        weights = [v for v in mech if variant_of(v)[0] == base]
        for spec in verdicts.CLAIMS.values():
            direction = spec.get("direction") or (1 if spec["effect"] > 0 else -1)
            for metric in spec["definitions"]:
                if metric not in last.columns:
                    out.append(f"| {base} | {metric} | not measured on held-out notes | | | "
                               "| |")
                    continue
                pts = {v: dict(zip(last[last.variant == v].seed, last[last.variant == v][metric],
                                   strict=True)) for v in weights}
                best, value = verdicts.choose_weight(pts, direction)
                if not best:
                    continue
                cot = last[(last.variant == "cot") & last.seed.isin(list(pts[best]))]
                base_v = cot[metric].mean()  # over the chosen weight's seeds
                r = [x for x in verdicts.claim_rows(sub, [best], "cot")
                     if x["definition"] == metric][0]
                if r["verdict"] == "not measured":
                    out.append(f"| {base} | {metric} | {best} | {value:.3f} ({base_v:.3f}) | "
                               "not measured | | |")
                    continue
                ci = (f" [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] | {r['mde']:.3f}"
                      if r["n"] > 1 else " | ")
                out.append(f"| {base} | {metric} | {best} | {value:.3f} ({base_v:.3f}) | "
                           f"{r['diff']:+.3f}{ci} | {r['verdict']} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--write", type=Path, help="Also write the Markdown to this file.")
    ap.add_argument("--copy-to", type=Path, help="Copy the tables and curves here first.")
    a = ap.parse_args()
    if a.copy_to:
        copy_results(a.folder, a.copy_to)
    text = report(a.folder)
    print(text)
    if a.write:
        a.write.write_text(text + "\n")


if __name__ == "__main__":
    main()
