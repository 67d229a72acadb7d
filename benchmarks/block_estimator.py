"""The "block" screening estimator with its all-heads MLP formula against one MLP call per head.

    python benchmarks/block_estimator.py [--sizes 4x21 16x64 32x128] [--repeats 3]
    python benchmarks/block_estimator.py --random-8b --sizes 8x128 16x256   # on a GPU
    python benchmarks/block_estimator.py --tiny --sizes 4x16                # that path, on CPU

SmolLM2-135M (30 layers x 9 heads, gated MLP, RMSNorm; ``--random-8b``: a random-init model of
Llama-3-8B shape in bf16 on the GPU, ``benchmarks/gpu_sweep.build``; ``--tiny``: its 4-layer
fp32 stand-in on CPU), random tokens with the middle third corrupted, metric: log-prob of each
prompt's last token; site z, noise direction, all prompts in one call (timings after CUDA
synchronisation). Per size: seconds of plain AtP, of ``block`` with the MLP called per head, and of
``block`` through ``patching/exact/head_mlp.py`` (the default when ``head_mlp_pays``), best of
``--repeats``, as ratios to AtP in the same process; the largest difference between the two
``block`` results (they must agree to rounding); and the pass-equivalents the cost formula
(``plan.block_screen_passes``) gives for each.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

import circuitkit as ck
from circuitkit.models import configure_threads
from circuitkit.patching.estimators import block
from circuitkit.patching.estimators.attribution import estimator_passes
from circuitkit.patching.exact import head_mlp


def setting(model, n: int, seq: int):
    g = torch.Generator().manual_seed(0)
    hi = min(40000, model.cfg.d_vocab)
    clean = torch.randint(10, hi, (n, seq), generator=g)
    corrupt = clean.clone()
    a, b = seq // 3, 2 * seq // 3
    corrupt[:, a:b] = torch.randint(10, hi, (n, b - a), generator=g)
    last = clean[:, -1]

    def metric(logits):
        return logits[:, -1].float().log_softmax(-1)[torch.arange(n), last.to(logits.device)]

    return clean, corrupt, metric


def best(fn, repeats: int) -> tuple[float, object]:
    out, times = None, []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["4x21", "16x64", "32x128"],
                   help="prompts x tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--random-8b", action="store_true", help="random Llama-3-8B shape, bf16, GPU")
    p.add_argument("--tiny", action="store_true", help="the --random-8b path with a tiny model")
    args = p.parse_args()
    configure_threads()
    if args.random_8b or args.tiny:
        sys.path.insert(0, str(Path(__file__).parent))
        from gpu_sweep import build  # this script's folder

        model, _ = build(args.tiny, "cuda" if args.random_8b else "cpu")
        print(f"model: random {'tiny Llama' if args.tiny else 'Llama-3-8B shape'}, "
              f"{next(model.parameters()).dtype}, {next(model.parameters()).device}"
              + (f" ({torch.cuda.get_device_name()})" if args.random_8b else ""))
    else:
        model = ck.load_model("smollm2-135m")
    real = block.head_mlp_pays
    used = []
    readout = head_mlp.HeadMLP.readout

    def spy(self, dz, *rest):
        used.append(dz.shape[0] * dz.shape[1])
        return readout(self, dz, *rest)

    head_mlp.HeadMLP.readout = spy
    print("| prompts x tokens | atp s | block, MLP per head: s (x AtP) | block, all-heads formula: "
          "s (x AtP) | speed-up | max diff / max effect | pass-eq per prompt (per head / "
          "formula) |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        n, seq = (int(x) for x in size.split("x"))
        clean, corrupt, metric = setting(model, n, seq)

        def run(est, clean=clean, corrupt=corrupt, metric=metric):
            return ck.patch_heads(model, clean, corrupt, metric, direction="noise",
                                  method="attribution",
                                  options=dict(estimator=est, progress=False))

        t_atp, _ = best(lambda: run("atp"), args.repeats)
        try:
            block.head_mlp_pays = lambda *a: False
            t_slow, slow = best(lambda: run("block"), args.repeats)
            block.head_mlp_pays = lambda *a: True
            used.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t_fast, fast = best(lambda: run("block"), args.repeats)
        finally:
            block.head_mlp_pays = real
        formula = sum(u == n * seq for u in used)  # whole-batch readouts: layers x repeats
        ours = [w for w in caught if str(w.message).startswith("block estimator")]
        if ours or formula < model.cfg.n_layers * args.repeats:
            print(f"  the formula was not used in every layer ({formula} whole-batch calls): "
                  + "; ".join(str(w.message) for w in ours[:1]))
        eff = slow.values - slow.values.mean()
        diff = float((fast.values - slow.values).abs().max()) / float(eff.abs().max())
        pe_slow = estimator_passes(model, "block", "z", "all", seq)
        pe_fast = estimator_passes(model, "block", "z", "all", seq, batch=n)
        print(f"| {n} x {seq} | {t_atp:.2f} | {t_slow:.2f} ({t_slow / t_atp:.1f}x) | "
              f"{t_fast:.2f} ({t_fast / t_atp:.1f}x) | {t_slow / t_fast:.2f}x | {diff:.1e} | "
              f"{pe_slow:.1f} / {pe_fast:.1f} |", flush=True)


if __name__ == "__main__":
    main()
