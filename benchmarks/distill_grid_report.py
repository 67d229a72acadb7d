"""The issue-35 grid's tables and verdicts as Markdown, from a finished
``distill --ablation --size grid`` folder (``runs.csv``, ``ablation.json``, each run's
``curve.json``):

* per arm: label coverage, S* (the CoT-only baseline's held-out-loss optimum), every variant's
  metrics (mean [95% t-interval over seeds]) beside the teacher's and chance;
* the CoT-distillation gap ``teacher - cot`` of exact match (and as the baseline's relative drop,
  the paper's 35-38%), and the share of it each variant closes, ``mean_k (v_k - cot_k) / gap``
  with the paired interval divided by the gap;
* each paper claim (focus +0.09, confusion -0.07) per arm and variant: reproduced (the paired
  interval excludes 0 in the claimed direction), refuted (it excludes the claimed effect), or
  not resolvable at this power (the interval holds both 0 and the claimed effect); the interval's
  half-width is the power statement;
* learning curves: the seed mean of held-out exact match, per-step focus and sibling confusion
  at each curve point, and the paired area-under-curve difference (a sample-efficiency gap shows
  even where final values tie).

Chance confusion: a uniform guess over each note's targets and near-misses puts
``|near-misses| / (|targets| + |near-misses|)`` of the restricted mass on near-misses
(``evaluation.confusion_from_logits``); its mean over the grid's test notes.

    python benchmarks/distill_grid_report.py DIR [--copy-to DEST] [--write FILE]
        [--curve-keys exact_match,focus,confusion]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from circuitkit.experiments.distill_grid import interval

METRICS = ["exact_match", "confusion", "confusion_rate", "focus", "focus_per_step", "macro_f1",
           "las", "las_gold_prefit", "p1_gap", "p2_gap"]
# the paper's reported effects of p1+p2; focus read both ways (any of the note's anchors, and the
# step's own anchor: the first saturates near 1)
CLAIMS = {"focus": 0.09, "focus_per_step": 0.09, "confusion": -0.07}
CURVE_KEYS = ("exact_match", "focus", "focus_per_step", "confusion")
# (a grid run before ``train.plain_model`` decoded its curves' exact match through the
# bridge-wrapped training model, wrongly: report it with ``--curve-keys focus,confusion``)


def fmt(iv) -> str:
    m, lo, hi = iv
    return f"{m:.3f} [{lo:.3f}, {hi:.3f}]"


def values(runs: pd.DataFrame, data: str, variant: str, metric: str) -> dict[int, float]:
    sub = runs[(runs.data == data) & (runs.variant == variant) & (runs.metric == metric)]
    return dict(zip(sub.seed.astype(int), sub.value.astype(float), strict=True))


def paired(runs, data, metric, a, b) -> tuple[tuple[float, float, float], int]:
    va, vb = values(runs, data, a, metric), values(runs, data, b, metric)
    shared = sorted(set(va) & set(vb))
    return interval([va[k] - vb[k] for k in shared]), len(shared)


def verdict(iv, effect: float) -> str:
    """The paired interval read in the claim's direction: reproduced when it excludes 0 on
    the claimed side, refuted when it excludes the claimed effect, else not resolvable."""
    _, lo, hi = iv
    s = 1 if effect > 0 else -1
    low, high = sorted((s * lo, s * hi))
    if low > 0:
        return "reproduced"
    if high < abs(effect):
        return "refuted" + (" (no effect in the claimed direction)" if high <= 0 else
                            " (smaller than claimed)")
    return "not resolvable at this power"


def chance_confusion(n_test: int) -> float:
    from circuitkit.tasks import load_task

    test = load_task("icd10", n_examples=n_test, seed=0, split="test")
    shares = [len(e.near_misses) / (len(e.targets) + len(e.near_misses)) for e in test.examples]
    return sum(shares) / len(shares)


def curves(folder: Path, data: str, variant: str, seeds: list[int]) -> dict[int, list[dict]]:
    """Each seed's curve points: its run's ``curve.json``, else the folder's ``curves.csv``
    (``--copy-to`` writes it: the runs' curves without their models)."""
    table = folder / "curves.csv"
    if not (folder / "runs").exists() and table.exists():
        frame = pd.read_csv(table)
        frame = frame[(frame.data == data) & (frame.variant == variant)]
        return {int(k): g.drop(columns=["data", "variant", "seed"]).to_dict("records")
                for k, g in frame.groupby("seed") if int(k) in seeds}
    out = {}
    for k in seeds:
        path = folder / "runs" / f"student-{data}" / f"{variant}-seed{k}" / "curve.json"
        if path.exists():
            out[k] = json.loads(path.read_text())
    return out


def copy_results(folder: Path, dest: Path) -> None:
    """The grid's tables, ``ablation.json``, ``teacher.json`` and every run's curve points
    (``curves.csv``) into ``dest``: what is committed (no models, no stores)."""
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("ablation.json", "runs.csv", "ablation.csv", "comparisons.csv", "teacher.json"):
        shutil.copyfile(folder / name, dest / name)
    rows = []
    for path in sorted(folder.glob("runs/student-*/*-seed*/curve.json")):
        variant, seed = path.parent.name.rsplit("-seed", 1)
        data = path.parent.parent.name.split("-", 1)[1]
        rows += [dict(data=data, variant=variant, seed=int(seed), **p)
                 for p in json.loads(path.read_text())]
    pd.DataFrame(rows).to_csv(dest / "curves.csv", index=False)


def auc(points: list[dict], key: str) -> float:
    """Trapezoid mean of ``key`` over the run's curve points (steps as the axis)."""
    pts = sorted(points, key=lambda p: p["step"])
    if len(pts) < 2:
        return pts[0][key] if pts else float("nan")
    area = sum((b["step"] - a["step"]) * (a[key] + b[key]) / 2
               for a, b in zip(pts, pts[1:], strict=False))
    return area / (pts[-1]["step"] - pts[0]["step"])


def report(folder: Path, curve_keys: tuple[str, ...] = CURVE_KEYS) -> str:
    runs = pd.read_csv(folder / "runs.csv")
    record = json.loads((folder / "ablation.json").read_text())
    teacher = record["teacher_metrics"]
    variants = [v for v in record["variants"] if v in set(runs.variant)]
    others = [v for v in variants if v != "cot"]
    chance = chance_confusion(int(record["sizes"]["eval_examples"]))
    out = [f"Grid `{folder}`: {len(runs[['data', 'variant', 'seed']].drop_duplicates())} runs, "
           f"variants {', '.join(variants)}; test notes {record['sizes']['eval_examples']}; "
           f"chance sibling confusion (uniform over targets + near-misses) {chance:.3f}.\n"]
    for data in dict.fromkeys(runs.data):
        seeds = sorted(values(runs, data, "cot", "exact_match"))
        cov = record.get("coverage", {}).get(data, {})
        sel = record.get("baseline_selection", {}).get(f"student-{data}", {})
        pool = record["sizes"].get("arms", {}).get(data)
        held = ", ".join(f"{p['step']}: {p['heldout_loss']:.3f}" for p in sel.get("curve", []))
        out.append(f"### Arm `{data}`: {pool} train notes; test targets seen >= 1 / >= 3 times: "
                   f"{cov.get('seen_ge1', float('nan')):.1%} / "
                   f"{cov.get('seen_ge3', float('nan')):.1%}; S* = {sel.get('s_star')} steps "
                   f"(held-out loss {held}); "
                   f"seeds {seeds}\n")
        out.append("| metric | teacher | chance | " + " | ".join(variants) + " |")
        out.append("|---|---|---|" + "---|" * len(variants))
        for m in [m for m in METRICS if m in set(runs.metric)]:  # (older grids: fewer)
            cells = [fmt(interval(list(values(runs, data, v, m).values()))) for v in variants]
            ch = f"{chance:.3f}" if m == "confusion" else ""
            t = teacher.get(m)
            out.append(f"| {m} | {t:.3f} | {ch} | " if isinstance(t, int | float) else
                       f"| {m} | | {ch} | ")
            out[-1] += " | ".join(cells) + " |"
        cot_em = interval(list(values(runs, data, "cot", "exact_match").values()))[0]
        gap = teacher["exact_match"] - cot_em
        out.append(f"\nCoT-distillation gap (exact match): teacher {teacher['exact_match']:.3f} - "
                   f"CoT-only {cot_em:.3f} = {gap:.3f} (the baseline's drop: "
                   f"{gap / teacher['exact_match']:.1%} of the teacher's; the paper: 35-38%).\n")
        claims = {m: e for m, e in CLAIMS.items() if m in set(runs.metric)}
        out.append("| variant | Δ exact match (paired) | share of the gap closed | "
                   + " | ".join(f"Δ {m} | {m} claim ({e:+g})" for m, e in claims.items())
                   + " | n |")
        out.append("|---|---|---|" + "---|---|" * len(claims) + "---|")
        for v in others:
            em, n = paired(runs, data, "exact_match", v, "cot")
            share = tuple(x / gap for x in em) if gap > 0 else (float("nan"),) * 3
            row = [v, fmt(em), fmt(share)]
            for metric, effect in claims.items():
                iv, _ = paired(runs, data, metric, v, "cot")
                row += [fmt(iv), f"{verdict(iv, effect)} (±{(iv[2] - iv[1]) / 2:.3f})"]
            out.append("| " + " | ".join(row + [str(n)]) + " |")
        if len(others) > 1:
            iv, n = paired(runs, data, "exact_match", others[-1], others[0])
            ic, _ = paired(runs, data, "confusion", others[-1], others[0])
            out.append(f"\n{others[-1]} - {others[0]} (the two head choices), exact match: "
                       f"{fmt(iv)}; confusion: {fmt(ic)} (n={n}).\n")
        out.append("\nLearning curves (seed mean at each point; AUC = trapezoid mean over the "
                   "run, paired against cot):\n")
        out.append("| variant | key | " + "points (step: value) | AUC Δ vs cot |")
        out.append("|---|---|---|---|")
        base = curves(folder, data, "cot", seeds)
        for v in variants:
            cv = curves(folder, data, v, seeds)
            if not cv:
                continue
            for key in [k for k in curve_keys if all(k in p for pts in cv.values()
                                                       for p in pts)]:
                steps = sorted({p["step"] for pts in cv.values() for p in pts})
                mean = [sum(p[key] for pts in cv.values() for p in pts if p["step"] == s)
                        / sum(1 for pts in cv.values() for p in pts if p["step"] == s)
                        for s in steps]
                d = "" if v == "cot" else fmt(interval([auc(cv[k], key) - auc(base[k], key)
                                                        for k in cv if k in base]))
                out.append(f"| {v} | {key} | " + ", ".join(f"{s}: {m:.3f}" for s, m in
                                                         zip(steps, mean, strict=True))
                           + f" | {d} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--write", type=Path, help="Also write the Markdown to this file.")
    ap.add_argument("--copy-to", type=Path, help="Copy the tables and curves here first.")
    ap.add_argument("--curve-keys", default=",".join(CURVE_KEYS),
                    help="Curve columns to report (comma-separated).")
    a = ap.parse_args()
    if a.copy_to:
        copy_results(a.folder, a.copy_to)
    text = report(a.folder, tuple(a.curve_keys.split(",")))
    print(text)
    if a.write:
        a.write.write_text(text + "\n")


if __name__ == "__main__":
    main()
