"""Cost of wrapping a plain callable metric: the probe, the behaviour check that reuses it, and
the check of probed read positions on the real logits.

    python benchmarks/metric_probe.py [--repeats 3] [--big-n 8 64]

Part 1, the teacher (``icd-teacher``, 64 icd10 test prompts, denoise, site z), interleaved
A, B, C, ... per repeat, min of each:

* ``exact, task metric``: ``patch_heads`` with the task's ``PromptMetric`` (the reference: no
  probe, no check);
* ``exact, lambda (probed)``: the same metric as a plain lambda, probe cache cleared first (the
  first call of a new function: probe + check of its reads on the real logits + sweep);
* ``exact, lambda (cached)``: the same lambda again (the behaviour check reuses the probe; the
  read-position check still runs, it depends on the tokens: in an exact sweep on the engine's
  cached runs, which then unembed every position);
* ``probe``, ``behaviour check``, ``real-logit check (forward)``: each piece alone, the last as
  the other methods run it (one unpatched forward of clean and corrupt).

Part 2, shapes without a model (the probe depends on the shape only): the teacher's
``[64, 35, 3516]`` and SmolLM2's vocabulary (49,152) at ``[n, 128, 49152]``: the full probe vs
the behaviour check, for a scalar lambda (``logits[:, -1, 5].mean()``) and a per-prompt one
(``log_softmax(logits)[:, -1, 5]``). Prints seconds and ratios. One thread.
"""

from __future__ import annotations

import argparse
import time

import torch

import circuitkit as ck
from circuitkit import metrics
from circuitkit.patching.inputs import checked_metric
from circuitkit.patching.results import quiet_baseline


def best(fn, repeats: int) -> float:
    return min(timed(fn) for _ in range(repeats))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def teacher_part(repeats: int) -> None:
    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=64, split="test")
    clean, corrupt, pm = task.clean_tokens, task.corrupt_tokens, task.prompt_metric()
    n, seq = clean.shape
    d_vocab = int(model.cfg.d_vocab)

    def lam(logits):
        return pm.per_prompt(logits)

    def sweep(metric):
        with quiet_baseline():
            ck.patch_heads(model, clean, corrupt, metric, options=dict(progress=False))

    def probed():
        metrics._PROBED.clear()
        sweep(lam)

    wrapped = ck.as_metric(lam, n, seq, d_vocab)
    runs = {
        "exact, task metric": lambda: sweep(pm),
        "exact, lambda (probed)": probed,
        "exact, lambda (cached)": lambda: sweep(lam),
        "probe": lambda: (metrics._PROBED.clear(), ck.as_metric(lam, n, seq, d_vocab)),
        "behaviour check": lambda: ck.as_metric(lam, n, seq, d_vocab),
        "real-logit check (forward)": lambda: checked_metric(model, clean, corrupt, wrapped),
    }
    times = {k: float("inf") for k in runs}
    sweep(pm)  # warm-up
    for _ in range(repeats):
        for k, fn in runs.items():
            times[k] = min(times[k], timed(fn))
    ref = times["exact, task metric"]
    print(f"icd-teacher, {n} prompts x {seq} tokens, vocabulary {d_vocab}")
    for k, t in times.items():
        print(f"  {k:26s} {t * 1e3:9.1f} ms   {t / ref:6.3f} x exact sweep (task metric)")


def shape_part(repeats: int, big_n: list[int]) -> None:
    forms = {"scalar": lambda logits: logits[:, -1, 5].mean(),
             "per prompt": lambda logits: logits.log_softmax(-1)[:, -1, 5]}
    shapes = [(64, 35, 3516)] + [(n, 128, 49152) for n in big_n]
    print("probe vs behaviour check, by shape [n, seq, vocab]")
    for shape in shapes:
        for name, fn in forms.items():
            def probe(fn=fn, shape=shape):
                metrics._PROBED.clear()
                ck.as_metric(fn, *shape)

            def check(fn=fn, shape=shape):
                ck.as_metric(fn, *shape)

            t_probe, t_check = float("inf"), float("inf")
            for _ in range(repeats):  # interleaved
                t_probe = min(t_probe, timed(probe))
                t_check = min(t_check, timed(check))
            print(f"  {str(list(shape)):18s} {name:10s} probe {t_probe * 1e3:9.1f} ms, "
                  f"behaviour check {t_check * 1e3:8.1f} ms ({t_check / t_probe:.2f} x probe)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--big-n", type=int, nargs="*", default=[8, 64])
    args = ap.parse_args()
    torch.set_num_threads(1)
    teacher_part(args.repeats)
    shape_part(args.repeats, args.big_n)


if __name__ == "__main__":
    main()
