"""Benchmark ``score_heads``: time against one plain forward with the full cache, and peak memory
against the number of examples.

    python benchmarks/scoring.py [--n 256] [--repeats 3] [--sizes 64 128 256] [--batch 32]

* Time (one process, the shipped ``icd-teacher``, ``n`` icd10 test examples): best-of-``repeats``
  seconds of ``score_heads(model, task)`` (default batching) and of one
  ``model.run_with_cache(task.clean_tokens)`` (every hook cached, one batch of all ``n``
  examples). Target: ratio <= 3.
* Memory (a fresh subprocess per point): peak RSS above the RSS just before the call (Linux:
  the peak is reset through ``/proc/self/clear_refs`` and read as ``VmHWM``), for
  ``score_heads(..., batch_size=--batch)`` and, as the reference that grows with ``n``, the
  full-cache forward of all ``n`` examples. Target: flat for ``score_heads``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import circuitkit as ck
from circuitkit.models import configure_threads
from circuitkit.scoring.heads import score_heads


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM)
        f.write("5")


def peak_rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def measure_memory(kind: str, n: int, batch: int) -> dict:
    """In this process: peak RSS (MiB) above the current RSS during one call of ``kind``."""
    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=n, split="test")
    score_heads(model, task.subset(range(4)), progress=False)  # warm up lazy allocations
    with torch.no_grad():
        model.run_with_cache(task.clean_tokens[:4])
    reset_peak_rss()
    base = peak_rss()
    if kind == "score_heads":
        score_heads(model, task, batch_size=batch, progress=False)
    else:
        with torch.no_grad():
            _, cache = model.run_with_cache(task.clean_tokens)
        del cache
    return dict(kind=kind, n=n, peak_mib=max(0, peak_rss() - base) / 2**20)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--memory-point", nargs=2, metavar=("KIND", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    configure_threads()
    if args.memory_point:
        print(json.dumps(measure_memory(args.memory_point[0], int(args.memory_point[1]),
                                        args.batch)))
        return
    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=args.n, split="test")
    print(f"icd-teacher, {args.n} icd10 test examples, seq {task.clean_tokens.shape[1]}, "
          f"{torch.get_num_threads()} threads")

    def full_cache():
        with torch.no_grad():
            model.run_with_cache(task.clean_tokens)

    full_cache()  # warm-up
    t_full = best_of(full_cache, args.repeats)
    t_score = best_of(lambda: score_heads(model, task, progress=False), args.repeats)
    print(f"time   run_with_cache (full cache)  {t_full:7.3f} s")
    print(f"time   score_heads                  {t_score:7.3f} s   ratio {t_score / t_full:.2f}x "
          "(target <= 3x)")
    print(f"memory: peak RSS above the pre-call RSS, MiB (score_heads batch_size={args.batch})")
    print(f"{'n':>6} {'score_heads':>12} {'full cache':>12}")
    for n in args.sizes:
        row = []
        for kind in ("score_heads", "full_cache"):
            out = subprocess.run([sys.executable, __file__, "--batch", str(args.batch),
                                  "--memory-point", kind, str(n)], capture_output=True,
                                 text=True, check=True, env=dict(os.environ))
            row.append(json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"])
        print(f"{n:>6} {row[0]:>12.1f} {row[1]:>12.1f}")


if __name__ == "__main__":
    main()
