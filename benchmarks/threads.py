"""Benchmark torch's thread count on a shared machine: one exact head sweep with 1 and with 2
torch threads, interleaved (1, 2, 1, 2, ...), with and without a background load of busy
processes on the same cores.

    python benchmarks/threads.py [--n 16] [--rounds 5] [--load 2] [--cores 0,1]

* The work: ``ck.patch_heads`` (exact, denoise, site z) of the shipped ``icd-teacher`` on ``n``
  icd10 test notes, the unit of every characterize sweep.
* ``--load N``: N processes spinning in pure Python (the other jobs of a shared machine) run
  during the "loaded" rounds; 0 measures only what the machine already runs.
* ``--cores``: pin this process and its load to these cores (e.g. ``0,1`` on a many-core
  machine, to measure the two-core case); default: the cores this process may use.
* Printed: per condition and thread count, the minimum and median seconds and the ratio
  2 threads / 1 thread (above 1: two threads are slower), and the machine's load average
  before each condition. Interleaving keeps a load that changes over minutes from favouring
  one thread count; compare ratios, not seconds, between machines.

``models.default_threads`` (the count ``load_model`` sets) follows what this measures:
docs/speed.md, "Threads on a shared machine".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time


def _spin(parent: int, cores: list[int] | None) -> None:
    """A busy process (another job of the machine); stops when its parent is gone."""
    if cores:
        os.sched_setaffinity(0, cores)
    x = 0
    while True:
        for _ in range(200_000):
            x += 1
        if os.getppid() != parent:  # (the parent was killed: do not outlive it)
            return


def start_load(n: int, cores: list[int] | None) -> list[mp.Process]:
    procs = [mp.get_context("spawn").Process(target=_spin, args=(os.getpid(), cores),
                                             daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # (running before the first timing)
    return procs


def stop_load(procs: list[mp.Process]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(timeout=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16, help="icd10 test notes in the sweep")
    ap.add_argument("--rounds", type=int, default=5, help="timed sweeps per thread count")
    ap.add_argument("--load", type=int, default=2, help="busy processes in the loaded rounds")
    ap.add_argument("--cores", default=None, help="pin to these cores, e.g. 0,1")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    cores = [int(c) for c in args.cores.split(",")] if args.cores else None
    if cores:
        os.sched_setaffinity(0, cores)
    os.environ.setdefault("CIRCUITKIT_THREADS", "1")  # (load_model's rule; each timing sets)
    import torch

    import circuitkit as ck

    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=args.n, split="test")

    def sweep() -> float:
        t0 = time.perf_counter()
        ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric, method="exact",
                       options=dict(progress=False))
        return time.perf_counter() - t0

    sweep()  # warm-up (probes, caches)
    out = {}
    for condition, n_load in (("as found", 0), (f"+{args.load} busy", args.load)):
        if condition != "as found" and not n_load:
            continue
        procs = start_load(n_load, cores) if n_load else []
        try:
            load = os.getloadavg()[0]
            times: dict[int, list[float]] = {1: [], 2: []}
            for _ in range(args.rounds):  # interleaved: 1, 2, 1, 2, ...
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    times[threads].append(sweep())
        finally:
            stop_load(procs)
        out[condition] = dict(
            load_average=round(load, 2),
            **{f"{t}_thread{'s' if t > 1 else ''}": dict(
                min=round(min(v), 3), median=round(statistics.median(v), 3))
               for t, v in times.items()},
            ratio_2_over_1_min=round(min(times[2]) / min(times[1]), 2),
            ratio_2_over_1_median=round(statistics.median(times[2])
                                        / statistics.median(times[1]), 2))
    facts = dict(cores=len(os.sched_getaffinity(0)), n=args.n, rounds=args.rounds,
                 torch=torch.__version__, conditions=out)
    if args.json:
        print(json.dumps(facts, indent=1))
        return
    print(f"icd-teacher exact head sweep, {args.n} notes, {facts['cores']} cores, "
          f"{args.rounds} interleaved rounds")
    for cond, r in out.items():
        print(f"{cond:>10} (load average {r['load_average']}): 1 thread min "
              f"{r['1_thread']['min']} s median {r['1_thread']['median']} s; 2 threads min "
              f"{r['2_threads']['min']} s median {r['2_threads']['median']} s; 2/1: "
              f"{r['ratio_2_over_1_min']}x (min), {r['ratio_2_over_1_median']}x (median)")


if __name__ == "__main__":
    main()
