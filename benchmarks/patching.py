"""Benchmark head patching: TransformerLens's loop vs circuitkit's exact engine vs attribution.

    python benchmarks/patching.py [--model icd-teacher|tiny] [--batch 16] [--repeats 3]

One process, one model, the same inputs and metric for every method (denoise, site z):

* ``TL``: ``transformer_lens.patching.get_act_patch_attn_head_out_all_pos`` (its clean cache is
  part of its time);
* ``exact``: ``circuitkit.patch_heads(method="exact")``, the layer-suffix engine with its fast
  path (``circuitkit.patching.engine``), with the task's ``PromptMetric`` (``task.metric``), and
  with the same metric as a plain user lambda returning the mean (``lambda logits:
  metric(logits)``) or one value per prompt: the metric protocol makes all three equally fast;
* ``attribution``: ``attribution_patch_heads`` (4 pass-equivalents per prompt: 2 forwards +
  1 backward, a backward counting 2);
* ``AtP*``: the same with ``atp_star=True`` (Q/K correction + exact tail);
* the per-position sweeps (``positions="each"``) of exact and attribution.

Prints seconds, ratios, max |exact - TL|, agreement of attribution with exact (Spearman,
top-10 overlap) and the exact engine's achieved FLOP/s as a share of this machine's measured
fp32 matmul throughput. Model: the shipped ``icd-teacher`` with test prompts of
``load_task("icd10")``, or (``--model tiny``) a random Llama 4 layers x 8 heads, d_model 128,
seq 48. Then a scaling table: exact vs attribution on random Llamas of 4, 8 and 16 layers x 16
heads (``--scaling``). Targets: exact >= 3x faster than TL with max diff <= 1e-4 for every metric
form; attribution >= 20x faster than exact at >= 256 heads.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

import circuitkit as ck
from circuitkit import hooks
from circuitkit.models import configure_threads, shipped_path

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 128, "seed": 0}


def setup(name: str, batch: int, seq: int) -> tuple[Any, torch.Tensor, torch.Tensor, Any, str]:
    if name == "icd-teacher":
        model = ck.load_model("icd-teacher")
        task = ck.load_task("icd10", n_examples=batch, split="test")
        return (model, task.clean_tokens, task.corrupt_tokens, task.prompt_metric(),
                f"icd-teacher, {batch} icd10 test prompts")
    from circuitkit.metrics import token_logprob_metric

    model = ck.load_model(TINY)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(4, TINY["vocab_size"], (batch, seq), generator=g)
    corrupt = clean.clone()
    corrupt[:, 8:20] = torch.randint(4, TINY["vocab_size"], (batch, 12), generator=g)
    pos = list(range(seq - 8, seq))
    metric = token_logprob_metric([pos] * batch, [clean[i, pos].tolist() for i in range(batch)])
    return model, clean, corrupt, metric, f"random Llama 4L x 8H d128 (GQA 4 kv), batch {batch}"


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


def matmul_flop_s(n: int = 2048, reps: int = 5) -> float:
    """Measured fp32 matmul throughput of this machine (FLOP/s), best of ``reps``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    return 2 * n**3 / best_time(lambda: a @ b, reps)[0]


def exact_sweep_flops(model: Any, metric: Any, n_prompts: int, seq: int) -> float:
    """Matmul FLOPs of the exact all-positions z sweep as the engine runs it (gated MLP).

    One cached run of base and source (``2 n`` rows up to the last read position; unembedding
    at the ``k`` read positions of each prompt). Then each chunk of the engine's plan (prompts
    sorted by length, in length buckets; ``n_heads`` variants of a layer ``l``) runs, up to its
    bucket's last read ``c``: the heads' writes, block ``l``'s MLP (its attention comes from the
    cache), full blocks ``l+1..L-2``, the last block's keys/values at every position and queries
    at ``k``, its MLP and the unembedding at ``k`` (layer ``L-1``: MLP and unembedding at ``k``
    only). Causal attention counts half the score matrix.
    """
    from circuitkit.patching.sweep import Sweep, auto_rows, length_order, plan

    f = hooks.facts(model)
    L, H, d = f.n_layers, f.n_heads, f.d_model
    d_mlp = int(getattr(model.cfg, "d_mlp", None) or 4 * d)
    q_o, k_v = 2 * 2 * d * f.d_head * H, 2 * 2 * d * f.d_head * f.n_kv_heads
    mlp, unembed = 2 * 3 * d * d_mlp, 2 * d * f.d_vocab
    _, cuts = length_order(metric)
    cuts = cuts or [seq] * n_prompts
    k = metric.reads.shape[1] if getattr(metric, "reads", None) is not None else seq
    sweep = Sweep("heads", "z", "denoise", "all", L, H, 1, n_prompts, seq, True)
    sweep = plan(sweep, auto_rows(model, seq), cuts)

    def block(c: int) -> float:
        return q_o + k_v + 2 * 2 * H * f.d_head * c / 2 + mlp

    total = 2 * n_prompts * (cuts[-1] * L * block(cuts[-1]) + k * unembed)
    for layer, v0, v1, p0, p1 in sweep.chunks:
        c = max(cuts[p0:p1])
        work = k * (mlp + unembed) + c * 2 * f.d_head * d
        if layer < L - 1:
            work += (c * mlp + (L - 2 - layer) * c * block(c)
                     + c * k_v + k * (q_o + 2 * 2 * H * f.d_head * c))
        total += (v1 - v0) * (p1 - p0) * work
    return total


def random_llama_setting(n_layers: int, n_heads: int = 16):
    """(model, clean, corrupt, metric): a random Llama of ``n_layers`` x ``n_heads`` (d_model 256,
    GQA n_heads / 2), 8 prompts of 32 random tokens with tokens 4..12 corrupted; metric: log-prob
    of the last 8 tokens. Also ``benchmarks/attribution_quality.py``'s random Llamas."""
    from circuitkit.metrics import token_logprob_metric

    model = ck.load_model(dict(TINY, hidden_size=256, intermediate_size=1024,
                               num_hidden_layers=n_layers, num_attention_heads=n_heads,
                               num_key_value_heads=n_heads // 2))
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(4, TINY["vocab_size"], (8, 32), generator=g)
    corrupt = clean.clone()
    corrupt[:, 4:12] = torch.randint(4, TINY["vocab_size"], (8, 8), generator=g)
    pos = list(range(24, 32))
    metric = token_logprob_metric([pos] * 8, [clean[i, pos].tolist() for i in range(8)])
    return model, clean, corrupt, metric


def scaling(layers: Sequence[int], n_heads: int, repeats: int) -> None:
    """Exact vs attribution as the head count grows (random Llamas, d_model 256, 8 prompts of
    32 tokens, metric: log-prob of the last 8 tokens). Exact costs about ``n_heads * n_layers / 2``
    forward passes (each head's suffix run), attribution about 3 whatever the head count, so
    their ratio grows with the model."""
    from circuitkit.patching.attribution import attribution_patch_heads

    print(f"\nscaling: random Llama, {n_heads} heads per layer, d_model 256, 8 prompts x 32 "
          f"tokens, denoise z, all positions; best of {repeats}")
    print(f"{'layers':>6s} {'heads':>6s} {'exact s':>8s} {'attrib s':>9s} {'exact/attrib':>13s}")
    for n_layers in layers:
        model, clean, corrupt, metric = random_llama_setting(n_layers, n_heads)
        exact = partial(ck.patch_heads, model, clean, corrupt, metric, progress=False)
        attrib = partial(attribution_patch_heads, model, clean, corrupt, metric, progress=False)
        exact()  # warm-up (and the fast-path probe)
        t_ex, t_at = best_time(exact, repeats)[0], best_time(attrib, repeats)[0]
        print(f"{n_layers:6d} {n_layers * n_heads:6d} {t_ex:8.3f} {t_at:9.3f} "
              f"{t_ex / t_at:12.1f}x")


def agreement(est: torch.Tensor, ref: torch.Tensor, k: int = 10) -> tuple[float, int]:
    k = min(k, est.numel())
    top = lambda t: set(t.abs().flatten().topk(k).indices.tolist())
    return spearman(est, ref), len(top(est) & top(ref))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="icd-teacher | tiny (default: the teacher "
                    "when shipped)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=48, help="sequence length (tiny model only)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-each", action="store_true", help="skip the per-position rows")
    ap.add_argument("--scaling", default="4,8,16", help="layer counts of the exact-vs-"
                    "attribution scaling table (16 heads each); empty: skip it")
    args = ap.parse_args()
    configure_threads()
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    from circuitkit.patching.attribution import attribution_patch_heads

    name = args.model or ("icd-teacher" if shipped_path("icd-teacher") else "tiny")
    model, clean, corrupt, metric, desc = setup(name, args.batch, args.seq)
    f = hooks.facts(model)
    kw = dict(progress=False)
    with torch.no_grad():
        model(clean[:2])  # warm-up (allocator, lazy init)

    def tl() -> torch.Tensor:
        with torch.no_grad():
            _, cache = model.run_with_cache(clean)
            return get_act_patch_attn_head_out_all_pos(model, corrupt, cache, metric)

    runs: dict[str, tuple[Callable[[], Any], int]] = {
        "TL get_act_patch_attn_head_out_all_pos": (tl, args.repeats),  # alternating with exact
        "exact (all positions)": (lambda: ck.patch_heads(model, clean, corrupt, metric, **kw),
                                  args.repeats),
        "exact, plain lambda (mean)": (lambda: ck.patch_heads(
            model, clean, corrupt, lambda logits: metric(logits), **kw), args.repeats),
        "exact, plain lambda ([batch])": (lambda: ck.patch_heads(
            model, clean, corrupt, lambda logits: metric.per_prompt(logits), **kw),
            args.repeats),
        "attribution (all)": (lambda: attribution_patch_heads(
            model, clean, corrupt, metric, **kw), args.repeats),
        "AtP* (all)": (lambda: attribution_patch_heads(
            model, clean, corrupt, metric, atp_star=True, **kw), args.repeats),
        "exact (each position)": (lambda: ck.patch_heads(
            model, clean, corrupt, metric, positions="each", **kw), 2),
        "attribution (each)": (lambda: attribution_patch_heads(
            model, clean, corrupt, metric, positions="each", **kw), args.repeats),
    }
    ck.patch_heads(model, clean, corrupt, metric, **kw)  # warm-up of the engine's code paths
    tl_key, ex_key, each_key = ("TL get_act_patch_attn_head_out_all_pos",
                                "exact (all positions)", "exact (each position)")
    alternating = (tl_key, ex_key, "exact, plain lambda (mean)", "exact, plain lambda ([batch])")
    times, outs = dict.fromkeys(alternating, float("inf")), {}
    if args.skip_each:
        runs = {k: v for k, v in runs.items() if "each" not in k}
    # TL and exact alternate, so that a slow spell of a shared machine hits all alike.
    for _ in range(args.repeats):
        for k in alternating:
            t, outs[k] = best_time(runs[k][0], 1)
            times[k] = min(times[k], t)
    for k, (fn, reps) in runs.items():
        if k not in times:
            times[k], outs[k] = best_time(fn, reps)
    peak = matmul_flop_s()
    flops = exact_sweep_flops(model, metric, clean.shape[0], clean.shape[1])
    print(f"\nmodel: {desc} ({f.n_layers} layers x {f.n_heads} heads, d_model {f.d_model}, "
          f"vocab {f.d_vocab}), seq {clean.shape[1]}, torch threads {torch.get_num_threads()}; "
          f"denoise, site z; best of {args.repeats} (exact-each: best of 2)")
    print(f"{'method':40s} {'seconds':>9s} {'vs TL':>8s} {'vs exact':>9s}")
    for k in runs:
        ref = times[each_key] if "each" in k else times[ex_key]
        vs_tl = f"{times[tl_key] / times[k]:7.1f}x" if "each" not in k else f"{'':8s}"
        print(f"{k:40s} {times[k]:9.3f} {vs_tl} {ref / times[k]:8.1f}x")
    for k in alternating[1:]:
        print(f"max |{k} - TL| = {float((outs[k].values - outs[tl_key]).abs().max()):.2e} "
              "(target <= 1e-4)")
    print(f"exact engine: {flops / times[ex_key] / 1e9:.2f} GFLOP/s = "
          f"{100 * flops / times[ex_key] / peak:.1f}% of measured fp32 matmul "
          f"({peak / 1e9:.1f} GFLOP/s)")
    for k, ref_key in (("attribution (all)", ex_key), ("AtP* (all)", ex_key),
                       ("attribution (each)", each_key)):
        if k not in outs or ref_key not in outs:
            continue
        rho, ov = agreement(outs[k].values - outs[k].corrupt,
                            outs[ref_key].values - outs[ref_key].corrupt)
        print(f"{k}: Spearman vs exact {rho:.3f}, top-10 overlap {ov}/10")
    if args.scaling:
        scaling([int(x) for x in args.scaling.split(",")], 16, args.repeats)


if __name__ == "__main__":
    main()
