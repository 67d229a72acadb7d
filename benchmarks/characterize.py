"""Benchmark ``characterize``: each step's seconds (``summary.json``) on the default run, against
a reference checkout in the same process.

    OMP_NUM_THREADS=1 python benchmarks/characterize.py [--model icd-teacher] [--n 128]
        [--repeats 1] [--reference /work/main] [--report] [--evaluate] [--no-stages]

Each repeat runs ``characterize`` (this checkout, then the reference: interleaved) into a fresh
folder on the same model object, 1 torch thread, no report unless ``--report``. Printed per step:
the minimum over repeats for each checkout and the ratio reference / this; then the targets
(issue 45): the whole call with the stage sweeps (the default) <= 60 s, and validation +
ablation <= 2x the four patch sweeps.
Values are compared too: ``validation.csv`` and ``head-ablation.csv`` of the two checkouts must
agree to 1e-6 (max |difference| printed). ``--evaluate``: instead, ``ck.evaluate`` on the same
notes, seconds and notes/s per checkout, and whether the two give identical metrics.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import circuitkit as ck  # noqa: E402
from circuitkit.experiments.characterize import characterize  # noqa: E402


def run(fn, model, args, folder: Path) -> tuple[dict, float]:
    t0 = time.perf_counter()
    summary = fn(model, "icd10", out_dir=folder, n_examples=args.n, progress=False,
                 report=args.report, stages=not args.no_stages)
    return summary, time.perf_counter() - t0


def step_table(mins: dict[str, dict[str, float]], names: list[str]) -> list[str]:
    lines = ["| step | " + " | ".join(names) + (" | ratio |" if len(names) > 1 else " |"),
             "|---|" + "---:|" * (len(names) + (len(names) > 1))]
    steps = [s for s in mins[names[0]] if not s.startswith("_")]
    sweeps = [s for s in steps if s.startswith("patch-")]
    rows = [("four patch sweeps", sweeps), ("stages (selection + held out)", ["stages"]),
            ("scores", ["scores"]), ("validation", ["validation"]), ("bins", ["bins"]),
            ("ablation", ["ablation"]),
            ("validation + ablation", ["validation", "ablation"]), ("call (wall)", ["_wall"])]
    for label, keys in rows:
        vals = [sum(mins[n].get(k, float("nan")) for k in keys) for n in names]
        cells = " | ".join(f"{v:.1f}" for v in vals)
        ratio = f" | {vals[1] / vals[0]:.2f}x" if len(names) > 1 else ""
        lines.append(f"| {label} | {cells}{ratio} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="icd-teacher")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--reference", default=None, help="a circuitkit checkout to compare with")
    ap.add_argument("--report", action="store_true", help="also write report.html")
    ap.add_argument("--no-stages", action="store_true", help="without the stage sweeps (and "
                    "the bins and the lead they feed): characterize --no-stages")
    ap.add_argument("--evaluate", action="store_true",
                    help="time ck.evaluate (notes/s, both checkouts) instead of characterize")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = ck.load_model(args.model)
    fns = {"this": characterize}
    ref = None
    if args.reference:
        from _reference import import_checkout

        ref = import_checkout(args.reference)
        fns["reference"] = importlib_char(ref)
    if args.evaluate:
        return evaluate_rows(model, ref, args)
    mins: dict[str, dict[str, float]] = {name: {} for name in fns}
    frames: dict[str, Path] = {}
    for r in range(args.repeats):
        for name, fn in fns.items():
            folder = Path(tempfile.mkdtemp(prefix=f"bench-characterize-{name}-"))
            print(f"repeat {r + 1}/{args.repeats}: {name} -> {folder}", file=sys.stderr,
                  flush=True)
            summary, wall = run(fn, model, args, folder)
            frames[name] = folder
            got = {s: v["seconds"] for s, v in summary["steps"].items()} | {"_wall": wall}
            for s, v in got.items():
                mins[name][s] = min(mins[name].get(s, float("inf")), v)
            print("  " + ", ".join(f"{s} {v:.1f}" for s, v in got.items()), file=sys.stderr,
                  flush=True)
    names = list(fns)
    print(f"characterize --model {args.model} -n {args.n}, 1 thread, min of {args.repeats} "
          "(seconds):")
    print("\n".join(step_table(mins, names)))
    this = mins["this"]
    sweeps = sum(v for s, v in this.items() if s.startswith("patch-"))
    va = this.get("validation", 0) + this.get("ablation", 0)
    wall = this["_wall"]
    print(f"targets: call {wall:.1f} s (issue 45, with the stage sweeps: <= 60: "
          f"{'met' if wall <= 60 else 'missed'})"
          f"; validation + ablation = {va / sweeps:.2f}x the four sweeps "
          f"(<= 2x: {'met' if va <= 2 * sweeps else 'missed'})")
    if "reference" in frames:
        import pandas as pd

        for csv in ("validation.csv", "head-ablation.csv"):
            a, b = (pd.read_csv(frames[n] / csv) for n in ("this", "reference"))
            a = a[[c for c in a.columns if c in b.columns]]  # (columns this checkout added)
            b = b[a.columns]
            num = a.select_dtypes("number").columns
            diff = float((a[num] - b[num]).abs().max().max())
            same = a.drop(columns=num).equals(b.drop(columns=num))
            print(f"{csv}: max |this - reference| = {diff:.2e}, other columns "
                  f"{'equal' if same else 'DIFFER'}")


def evaluate_rows(model, ref, args) -> None:
    """``evaluate`` on ``--n`` icd10 test notes: seconds and notes/s of each checkout
    (interleaved, min of ``--repeats``), and whether the metrics are identical."""
    fns = {"this": ck} | ({"reference": ref} if ref is not None else {})
    tasks = {name: pkg.load_task("icd10", n_examples=args.n, seed=0, split="test")
             for name, pkg in fns.items()}  # (each checkout's own Task class)
    best, got = {}, {}
    for _ in range(args.repeats):
        for name, pkg in fns.items():
            t0 = time.perf_counter()
            got[name] = pkg.evaluate(model, tasks[name])
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
    print(f"evaluate --model {args.model} -n {args.n}, 1 thread, min of {args.repeats}:")
    print("| checkout | s | notes/s |\n|---|---:|---:|")
    for name, sec in best.items():
        print(f"| {name} | {sec:.2f} | {args.n / sec:.1f} |")
    if ref is not None:
        print(f"speed-up {best['reference'] / best['this']:.2f}x; metrics identical: "
              f"{got['this'] == got['reference']}")


def importlib_char(ref):
    import importlib

    return importlib.import_module(f"{ref.__name__}.characterize").characterize


if __name__ == "__main__":
    main()
