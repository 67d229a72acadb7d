"""Exact head patching: circuitkit's layer-suffix engine vs TransformerLens's loop.

    python benchmarks/patching_exact.py [--threads N]

Same model, inputs and metric in one process. Uses the shipped ``icd-teacher`` (16 test
prompts of ``icd10``) when present, else a tiny random Llama (4 layers x 8 heads, d_model 128,
seq 48, batch 16). Prints both times, the speed-up, the max abs difference, and the engine's
achieved FLOP/s as a share of this machine's measured fp32 matmul throughput.
``bench_exact(model, clean, corrupt, metric) -> dict`` is importable (benchmarks/patching.py).
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def matmul_flops(n: int = 2048, reps: int = 5) -> float:
    """Measured fp32 matmul throughput (FLOP/s), best of ``reps``."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def forward_flops_per_token(model: Any, seq: int, n_blocks: int) -> float:
    """Matmul FLOPs of one token through ``n_blocks`` blocks plus the unembedding."""
    from circuitkit import hooks

    f = hooks.facts(model)
    d_mlp = int(getattr(model.cfg, "d_mlp", None) or 4 * f.d_model)
    gated = 3 if getattr(model.cfg, "gated_mlp", False) or "llama" in str(
        getattr(model.cfg, "architecture", "")).lower() else 2
    proj = 2 * f.d_model * f.d_head * (2 * f.n_heads + 2 * f.n_kv_heads)  # q, o + k, v
    attn = 2 * 2 * f.n_heads * f.d_head * seq / 2  # QK^T and AV, causal half on average
    mlp = 2 * gated * f.d_model * d_mlp
    return n_blocks * (proj + attn + mlp) + 2 * f.d_model * f.d_vocab


def engine_flops(model: Any, n_prompts: int, seq: int) -> float:
    """FLOPs the exact all-positions z sweep performs: 2 cached runs + per-layer suffix runs."""
    from circuitkit import hooks

    f = hooks.facts(model)
    full = n_prompts * seq * forward_flops_per_token(model, seq, f.n_layers)
    rows = f.n_heads * n_prompts * seq  # tokens run per layer of patches
    suffix = sum(rows * forward_flops_per_token(model, seq, f.n_layers - layer)
                 for layer in range(f.n_layers))
    return 2 * full + suffix


def bench_exact(model: Any, clean: Any, corrupt: Any, metric: Any, repeats: int = 3) -> dict:
    """Time TL's ``get_act_patch_attn_head_out_all_pos`` and ``patch_heads`` (exact, z, all).

    Returns seconds (best of ``repeats`` for ours, one run for TL), speed-up, max abs diff,
    achieved FLOP/s of the engine and its share of measured matmul throughput.
    """
    import torch
    from transformer_lens import patching as tlp

    from circuitkit.patching.engine import patch_heads

    with torch.no_grad():
        t = time.perf_counter()
        _, cache = model.run_with_cache(clean)
        ref = tlp.get_act_patch_attn_head_out_all_pos(model, corrupt, cache, metric)
        t_tl = time.perf_counter() - t
    patch_heads(model, clean, corrupt, metric, progress=False)  # warm-up
    t_ours = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        res = patch_heads(model, clean, corrupt, metric, progress=False)
        t_ours = min(t_ours, time.perf_counter() - t)
    n, seq = clean.shape
    flops = engine_flops(model, n, seq)
    peak = matmul_flops()
    return dict(tl_seconds=t_tl, exact_seconds=t_ours, speedup=t_tl / t_ours,
                max_abs_diff=float((res.values - ref).abs().max()), engine_flops=flops,
                engine_flop_s=flops / t_ours, matmul_flop_s=peak,
                flop_share=flops / t_ours / peak, threads=torch.get_num_threads())


def default_setup() -> tuple[Any, Any, Any, Any, str]:
    import torch

    import circuitkit as ck
    from circuitkit.models import shipped_path
    from circuitkit.patching.metrics import token_logprob_metric

    if shipped_path("icd-teacher") is not None:
        model = ck.load_model("icd-teacher")
        task = ck.load_task("icd10", n_examples=16, split="test")
        return (model, task.clean_tokens, task.corrupt_tokens, task.prompt_metric(),
                "icd-teacher, icd10 test x 16")
    model = ck.load_model({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 128, "seed": 0})
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(4, 512, (16, 48), generator=g)
    corrupt = clean.clone()
    corrupt[:, 8:20] = torch.randint(4, 512, (16, 12), generator=g)
    answer_pos = [list(range(40, 48))] * 16
    metric = token_logprob_metric(answer_pos, clean[:, 40:48].tolist())
    return model, clean, corrupt, metric, "random Llama 4L x 8H d128 (GQA 4 kv), seq 48, batch 16"


def main() -> None:
    import torch

    from circuitkit.models import configure_threads

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    else:
        configure_threads()
    model, clean, corrupt, metric, desc = default_setup()
    r = bench_exact(model, clean, corrupt, metric)
    print(f"setup          {desc}; {r['threads']} threads")
    print(f"TransformerLens get_act_patch_attn_head_out_all_pos  {r['tl_seconds']:.3f} s")
    print(f"circuitkit exact patch_heads (z, all)                {r['exact_seconds']:.3f} s")
    print(f"speed-up       {r['speedup']:.1f}x   (target >= 3x)")
    print(f"max abs diff   {r['max_abs_diff']:.2e}   (target <= 1e-4)")
    print(f"engine         {r['engine_flop_s'] / 1e9:.2f} GFLOP/s = {100 * r['flop_share']:.1f}% "
          f"of measured fp32 matmul {r['matmul_flop_s'] / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
