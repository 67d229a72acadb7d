"""GPU benchmark, prepared to fit in 8 minutes on one H200: a random-init model of Llama-3-8B
shape in bf16 (no download), the exact head sweep with circuitkit's engine vs TransformerLens's
patching loop on the same inputs, attribution time, achieved TFLOP/s vs the GPU's bf16 peak.

    python benchmarks/gpu_sweep.py                 # on a GPU (H100/H200/A100 peaks known)
    python benchmarks/gpu_sweep.py --tiny          # the same steps on CPU, a tiny Llama (check)

Steps (one process, one model, one set of inputs; timings after CUDA synchronisation):

1. the model: ``meta-llama/Meta-Llama-3-8B``'s shipped config, weights drawn on the device in
   bf16 (``--tiny``: 4 layers x 8 heads, fp32, on CPU), loaded through ``ck.load_model``;
2. inputs: ``--prompts`` prompts of ``--seq`` random tokens; the corrupt run resamples a span
   in the middle; metric: log-prob of the last 8 tokens (``token_logprob_metric``);
3. ``circuitkit.patch_heads`` (exact, all positions, site z; rows from free GPU memory, with the
   out-of-memory back-off) and ``patching.cost.sweep_plan``'s prediction of its time;
4. TransformerLens's loop (``generic_activation_patch`` with ``layer_head_vector_patch_setter``
   on ``hook_z``, i.e. ``get_act_patch_attn_head_out_all_pos``) on the same inputs. It runs one
   full forward per head; when all heads would not fit the time budget (``--budget-s``), it runs
   the first layers' heads only and its time is extrapolated per head (said so in the output);
   the max difference is over the heads both computed;
5. attribution (AtP, and AtP*) over all heads;
6. achieved FLOP/s of the exact sweep: its matmul FLOPs as the engine runs them
   (``benchmarks/patching.exact_sweep_flops``) / its time, as a share of the bf16 dense peak
   (``patching.cost.GPU_CLASSES``) when the GPU is known.

Prints one table; nothing is written. Default sizes (8 prompts x 128 tokens, 1,024 heads) take
about 3-5 minutes on an H100-class GPU, most of it TransformerLens's loop.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/patching.py: exact_sweep_flops

import circuitkit as ck  # noqa: E402
from circuitkit import hooks, models  # noqa: E402
from circuitkit.patching import cost as costs  # noqa: E402

TINY = {"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 448,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rope_theta": 500000.0, "tie_word_embeddings": False}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def build(tiny: bool, device: str) -> tuple[Any, dict]:
    """A random-init model of Llama-3-8B shape in bf16, drawn on ``device`` (no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY) if tiny else models.shipped_config(models.ALIASES["llama3-8b"])
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    dtype = torch.float32 if tiny else torch.bfloat16
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    hf_cfg._attn_implementation = "eager"  # as TransformerLens's bridge runs it
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    tok = models._numbered_tokenizer(hf_cfg.vocab_size)
    return ck.load_model(hf, tokenizer=tok), cfg


def inputs(n: int, seq: int, vocab: int, device: torch.device):
    from circuitkit.metrics import token_logprob_metric

    g = torch.Generator().manual_seed(0)
    clean = torch.randint(10, vocab, (n, seq), generator=g)
    corrupt = clean.clone()
    span = slice(seq // 4, seq // 2)
    corrupt[:, span] = torch.randint(10, vocab, (n, span.stop - span.start), generator=g)
    pos = list(range(seq - 8, seq))
    metric = token_logprob_metric([pos] * n, [clean[i, pos].tolist() for i in range(n)])
    return clean, corrupt, metric


def tl_loop(model: Any, clean: torch.Tensor, corrupt: torch.Tensor, metric: Any,
            layers: list[int], device: torch.device) -> tuple[float, torch.Tensor]:
    """TransformerLens's head-z patching loop over the heads of ``layers``: [len(layers), H]."""
    import pandas as pd
    from transformer_lens.patching import generic_activation_patch, layer_head_vector_patch_setter

    H = hooks.facts(model).n_heads
    df = pd.DataFrame([(layer, h) for layer in layers for h in range(H)],
                      columns=["layer", "head"])

    def run() -> torch.Tensor:
        with torch.no_grad():
            _, cache = model.run_with_cache(clean.to(device),
                                            names_filter=lambda name: name.endswith("hook_z"))
            return generic_activation_patch(
                model, corrupt.to(device), cache, metric,
                patch_setter=layer_head_vector_patch_setter, activation_name="z",
                index_df=df).float().cpu().view(len(layers), H)

    return timed(run, device)


def gpu_class(device: torch.device) -> costs.GPUClass | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((g for k, g in costs.GPU_CLASSES.items() if k in name), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 Llama on CPU (a check)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="time allowed for TransformerLens's loop (extrapolated beyond)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    models.configure_threads()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        sys.exit("no CUDA GPU here: run with --tiny to check the script on CPU")
    t0 = time.perf_counter()
    model, cfg = build(args.tiny, str(device))
    f = hooks.facts(model)
    L, H, n, seq = f.n_layers, f.n_heads, args.prompts, args.seq
    clean, corrupt, metric = inputs(n, seq, f.d_vocab, device)
    n_params = sum(p.numel() for p in model.parameters())
    dtype = next(model.parameters()).dtype
    build_s = time.perf_counter() - t0
    print(f"model   random Llama-3-8B shape{' (tiny)' if args.tiny else ''}: {L} layers x {H} "
          f"heads ({f.n_kv_heads} KV), {n_params / 1e9:.2f} B params, {dtype}, {device}"
          f"{' ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}; "
          f"built in {build_s:.0f} s")
    print(f"inputs  {n} prompts x {seq} tokens, metric: log-prob of the last 8 tokens")

    with torch.no_grad():  # warm-up: allocator, kernels, the fast-path probe's first forward
        model(clean[:1, :16].to(device))
    ex_s, exact = timed(lambda: ck.patch_heads(model, clean, corrupt, metric,
                                               options=dict(progress=False)),
                        device)
    from patching import exact_sweep_flops

    flops = exact_sweep_flops(model, metric, n, seq)
    gpu = gpu_class(device)
    arch = models.Architecture("bench", "", L, H, f.n_kv_heads, f.d_model, f.d_head,
                               int(cfg["intermediate_size"]), f.d_vocab, f.n_ctx, n_params)
    predicted = None
    if gpu is not None:
        p = costs.sweep_plan(arch, [seq] * n, options=dict(
            gpu=next(k for k, g in costs.GPU_CLASSES.items() if g is gpu), n_gpus=1))
        predicted = p["methods"]["exact"]["seconds"]

    # TransformerLens's loop: time one layer's heads, then as many layers as the budget allows
    one_s, first = tl_loop(model, clean, corrupt, metric, [0], device)
    n_layers = max(1, min(L, int(args.budget_s / max(one_s, 1e-9))))
    if n_layers > 1:
        tl_s, tl_vals = tl_loop(model, clean, corrupt, metric, list(range(n_layers)), device)
    else:
        tl_s, tl_vals = one_s, first
    tl_total = tl_s * L / n_layers
    diff = float((exact.values[:n_layers] - tl_vals).abs().max())
    spread = float(exact.values.max() - exact.values.min())

    at_s, _ = timed(lambda: ck.patch_heads(model, clean, corrupt, metric, method="attribution",
                                           options=dict(progress=False)), device)
    star_s, _ = timed(lambda: ck.patch_heads(model, clean, corrupt, metric, method="attribution",
                                             options=dict(atp_star=True, progress=False)), device)
    achieved = flops / ex_s
    rows = [
        ("exact sweep (circuitkit engine)", ex_s, f"{L * H} heads, rows/forward "
                                                   f"{exact.meta['rows']}, {exact.meta['n_chunks']}"
                                                   f" chunks, OOM back-offs "
                                                   f"{exact.meta['oom_backoffs']}"),
        ("TransformerLens patching loop", tl_total,
         "measured" if n_layers == L else f"extrapolated from {n_layers} of {L} layers "
                                           f"({tl_s:.1f} s)"),
        ("attribution (AtP)", at_s, "all heads"),
        ("attribution (AtP*)", star_s, "all heads"),
    ]
    print(f"\n{'run':<34}{'seconds':>10}  note")
    for name, s, note in rows:
        print(f"{name:<34}{s:>10.2f}  {note}")
    print(f"\nTL / exact            {tl_total / ex_s:.1f}x")
    print(f"max |exact - TL|      {diff:.3g} over {n_layers * H} heads (values span {spread:.3g};"
          f" {dtype})")
    print(f"exact / AtP           {ex_s / at_s:.1f}x")
    print(f"exact sweep FLOPs     {flops / 1e12:,.1f} TFLOP -> {achieved / 1e12:,.1f} TFLOP/s")
    if gpu is not None:
        print(f"share of bf16 peak    {achieved / gpu.bf16_dense_flops:.1%} of "
              f"{gpu.bf16_dense_flops / 1e12:.0f} TFLOP/s ({gpu.name})")
        print(f"plan predicted        {predicted:.1f} s at {costs.UTILISATION:.0%} utilisation "
              f"(measured {ex_s:.1f} s)")
    else:
        print("share of bf16 peak    n/a (not a known GPU class)")
    print(f"total wall time       {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(dict(
            device=str(device), gpu=None if gpu is None else gpu.name, layers=L, heads=H,
            prompts=n, seq=seq, exact_s=ex_s, tl_s=tl_total, tl_layers=n_layers, max_diff=diff,
            value_span=spread, atp_s=at_s, atp_star_s=star_s, flops=flops,
            achieved_tflops=achieved / 1e12, predicted_s=predicted), indent=1))


if __name__ == "__main__":
    main()
