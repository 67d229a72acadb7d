"""Benchmark head patching: TransformerLens's sweep vs circuitkit's exact engine vs attribution.

One process, one model, the same inputs and metric for every method:

* ``TL``: ``transformer_lens.patching.get_act_patch_attn_head_out_all_pos`` (denoise, site z,
  all positions; its clean cache is part of its time);
* ``exact``: ``circuitkit.patch_heads(method="exact")`` (the engine);
* ``attribution``: ``attribution_patch_heads`` (2 forwards + 1 backward);
* ``AtP*``: the same with ``atp_star=True`` (Q/K correction + exact tail).

Model: the shipped ``icd-teacher`` with 16 test prompts of ``load_task("icd10")`` when it
exists, else a random Llama (4 layers x 8 heads, d_model 128, seq 48, batch 16). Run with
``python benchmarks/patching.py [--model icd-teacher|tiny] [--repeats 3]``; the best of
``--repeats`` runs is reported. Target: attribution >= 20x faster than exact.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

import circuitkit as ck
from circuitkit.models import shipped_path

TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
        "max_position_embeddings": 128}


def tiny_setup(batch: int, seq: int) -> tuple[Any, torch.Tensor, torch.Tensor, Any, str]:
    from circuitkit.patching.metrics import token_logprob_metric

    model = ck.load_model(TINY)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(1, TINY["vocab_size"], (batch, seq), generator=g)
    corrupt = clean.clone()
    corrupt[:, : seq // 2] = torch.randint(1, TINY["vocab_size"], (batch, seq // 2), generator=g)
    pos = list(range(seq - 8, seq))
    metric = token_logprob_metric([pos] * batch, [clean[i, pos].tolist() for i in range(batch)])
    return model, clean, corrupt, metric, "random Llama 4L x 8H, d_model 128"


def teacher_setup(batch: int) -> tuple[Any, torch.Tensor, torch.Tensor, Any, str]:
    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=batch, split="test")
    return (model, task.clean_tokens, task.corrupt_tokens, task.prompt_metric(),
            "icd-teacher, icd10 test prompts")


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.flatten().argsort().argsort().double()
    rb = b.flatten().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="icd-teacher | tiny (default: teacher if "
                    "shipped, else tiny)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=48, help="sequence length (tiny model only)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    from circuitkit.patching.attribution import attribution_patch_heads

    name = args.model or ("icd-teacher" if shipped_path("icd-teacher") else "tiny")
    model, clean, corrupt, metric, desc = (teacher_setup(args.batch) if name == "icd-teacher"
                                           else tiny_setup(args.batch, args.seq))
    f = ck.hooks.facts(model)
    with torch.no_grad():  # warm-up (allocator, lazy init)
        model(clean[:2])

    def tl() -> torch.Tensor:
        with torch.no_grad():
            _, cache = model.run_with_cache(clean)
            return get_act_patch_attn_head_out_all_pos(model, corrupt, cache, metric)

    runs = {
        "TL get_act_patch_attn_head_out_all_pos": tl,
        "circuitkit exact (patch_heads)": lambda: ck.patch_heads(
            model, clean, corrupt, metric, method="exact", progress=False),
        "attribution": lambda: attribution_patch_heads(
            model, clean, corrupt, metric, progress=False),
        "AtP* (Q/K + exact tail)": lambda: attribution_patch_heads(
            model, clean, corrupt, metric, atp_star=True, progress=False),
    }
    times, outs = {}, {}
    for k, fn in runs.items():
        times[k], outs[k] = best_time(fn, args.repeats)
    keys = list(runs)
    tl_v, ex = outs[keys[0]], outs[keys[1]]
    print(f"\nmodel: {desc} ({f.n_layers} layers x {f.n_heads} heads), batch "
          f"{clean.shape[0]}, seq {clean.shape[1]}, torch threads {torch.get_num_threads()}, "
          f"denoise, site z, all positions; best of {args.repeats}")
    print(f"{'method':40s} {'seconds':>9s} {'vs TL':>8s} {'vs exact':>9s}")
    for k in keys:
        print(f"{k:40s} {times[k]:9.3f} {times[keys[0]] / times[k]:7.1f}x "
              f"{times[keys[1]] / times[k]:8.1f}x")
    print(f"max |exact - TL| = {float((ex.values - tl_v).abs().max()):.2e}")
    e = ex.values - ex.corrupt
    for k in keys[2:]:
        a = outs[k].values - outs[k].corrupt
        top = min(10, a.numel())
        ov = len(set(a.abs().flatten().topk(top).indices.tolist())
                 & set(e.abs().flatten().topk(top).indices.tolist()))
        print(f"{k}: Spearman vs exact {spearman(a, e):.3f}, top-{top} overlap {ov}/{top}, "
              f"speed-up vs exact {times[keys[1]] / times[k]:.1f}x (target >= 20x for "
              f"attribution)")


if __name__ == "__main__":
    main()
