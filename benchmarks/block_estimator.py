"""The "block" screening estimator with its all-heads MLP formula against one MLP call per head.

    python benchmarks/block_estimator.py [--sizes 4x21 16x64 32x128] [--repeats 3]

SmolLM2-135M (30 layers x 9 heads, gated MLP, RMSNorm), random tokens with the middle third
corrupted, metric: log-prob of each prompt's last token; site z, noise direction, all prompts in
one call. Per size: seconds of plain AtP, of ``block`` with the MLP called per head, and of
``block`` through ``patching/head_mlp.py`` (the default when ``head_mlp_pays``), best of
``--repeats``, as ratios to AtP in the same process; the largest difference between the two
``block`` results (they must agree to rounding); and the pass-equivalents the cost formula
(``plan.block_screen_passes``) gives for each.
"""

from __future__ import annotations

import argparse
import time

import torch

import circuitkit as ck
from circuitkit.models import configure_threads
from circuitkit.patching import attribution
from circuitkit.patching.attribution import attribution_patch_heads, estimator_passes


def setting(model, n: int, seq: int):
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(100, 40000, (n, seq), generator=g)
    corrupt = clean.clone()
    a, b = seq // 3, 2 * seq // 3
    corrupt[:, a:b] = torch.randint(100, 40000, (n, b - a), generator=g)
    last = clean[:, -1]

    def metric(logits):
        return logits[:, -1].log_softmax(-1)[torch.arange(n), last]

    return clean, corrupt, metric


def best(fn, repeats: int) -> tuple[float, object]:
    out, times = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["4x21", "16x64", "32x128"],
                   help="prompts x tokens")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    configure_threads()
    model = ck.load_model("smollm2-135m")
    real = attribution.head_mlp_pays
    print("| prompts x tokens | atp s | block, MLP per head: s (x AtP) | block, all-heads formula: "
          "s (x AtP) | speed-up | max diff | pass-eq per prompt (per head / formula) |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        n, seq = (int(x) for x in size.split("x"))
        clean, corrupt, metric = setting(model, n, seq)

        def run(est, clean=clean, corrupt=corrupt, metric=metric):
            return attribution_patch_heads(model, clean, corrupt, metric, direction="noise",
                                           estimator=est, progress=False)

        t_atp, _ = best(lambda: run("atp"), args.repeats)
        try:
            attribution.head_mlp_pays = lambda *a: False
            t_slow, slow = best(lambda: run("block"), args.repeats)
            attribution.head_mlp_pays = lambda *a: True
            t_fast, fast = best(lambda: run("block"), args.repeats)
        finally:
            attribution.head_mlp_pays = real
        diff = float((fast.values - slow.values).abs().max())
        pe_slow = estimator_passes(model, "block", "z", "all", seq)
        pe_fast = estimator_passes(model, "block", "z", "all", seq, batch=n)
        print(f"| {n} x {seq} | {t_atp:.2f} | {t_slow:.2f} ({t_slow / t_atp:.1f}x) | "
              f"{t_fast:.2f} ({t_fast / t_atp:.1f}x) | {t_slow / t_fast:.2f}x | {diff:.1e} | "
              f"{pe_slow:.1f} / {pe_fast:.1f} |", flush=True)


if __name__ == "__main__":
    main()
