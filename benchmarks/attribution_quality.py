"""How well each attribution estimator finds what exact patching finds, and at what cost.

    python benchmarks/attribution_quality.py [--seeds 0 1 2] [--quick] [--out results.json]

One run, every estimator of ``circuitkit.patching.estimators.attribution`` (``ESTIMATORS``), both
directions,
site z, all positions, on:

* SmolLM2-135M (30 layers x 9 heads), repeated random tokens: 4 prompts, clean ``[BOS, A, A]``,
  corrupt ``[BOS, B, A]``, halves of 10 tokens drawn from ids 100..40000 (one setting per seed);
  metric: mean log-prob of the second copy (``token_logprob_metric``);
* SmolLM2-135M on the text-rendered icd10 task (``render_text``; the test examples whose clean and
  corrupt texts tokenize to the same length, shortest first); metric: mean log-prob of the
  answer tokens;
* the shipped ``icd-teacher`` (4 layers x 8 heads) on icd10 test prompts with ``task.metric``;
* random Llamas of 64, 128 and 256 heads (4/8/16 layers x 16 heads, d_model 256, 8 prompts of 32
  tokens, tokens 4..12 corrupted; metric: log-prob of the last 8 tokens).

Per estimator: Spearman (signed effects) and top-10 recall against exact, sign agreement on
exact's top-10, the rank of exact's top-1 in the estimator's ``|effect|`` order, whether exact's
top-3 lie in its top-20, cost in pass-equivalents per prompt (one prompt through the whole model;
a backward counts 2) and seconds, both also as a ratio to plain attribution measured in the same
process. Then ``attribution+exact`` with its automatic budget (default estimator): cells
verified, recall of exact's top-10, total pass-equivalents against the full exact sweep.

Exact sweeps are cached on disk (``--cache``, keyed by model, tokens and direction), so a rerun
only recomputes the estimators. Targets (issue 13), SmolLM2, both directions: the default
screening estimator's top-10 recall >= 8 and exact's top-3 within its top-20 at <= 5x plain
attribution's cost; ``attribution+exact`` recovers exact's top-10 verifying <= 20% of heads.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch

import circuitkit as ck
from circuitkit.metrics import token_logprob_metric
from circuitkit.models import configure_threads
from circuitkit.patching.estimators.attribution import (
    ESTIMATORS,
    SCREENING_ESTIMATOR,
    estimator_passes,
)

# --- settings ----------------------------------------------------------------------------------

def repeated_tokens(model: Any, seed: int, n: int = 4, half: int = 10):
    g = torch.Generator().manual_seed(seed)
    A = torch.randint(100, 40000, (n, half), generator=g)
    B = torch.randint(100, 40000, (n, half), generator=g)
    bos = getattr(model.tokenizer, "bos_token_id", None)
    pre = (torch.full((n, 1), bos) if bos is not None else torch.zeros(n, 0, dtype=torch.long))
    clean, corrupt = torch.cat([pre, A, A], 1), torch.cat([pre, B, A], 1)
    pos = list(range(pre.shape[1] + half, pre.shape[1] + 2 * half))
    metric = token_logprob_metric([pos] * n, [clean[i, pos].tolist() for i in range(n)])
    return clean, corrupt, metric


def icd_text(model: Any, n: int):
    from circuitkit.tasks.text import render_text

    task = ck.load_task("icd10", n_examples=48, split="test", seed=0)
    ok = []
    for i in range(len(task)):
        try:
            tt = render_text(task.subset([i]), model.tokenizer)
        except ValueError:  # clean and corrupt tokenize to different lengths: not patchable
            continue
        ok.append((tt.clean_tokens.shape[1], i))
    chosen = [i for _, i in sorted(ok)[:n]]
    tt = render_text(task.subset(chosen), model.tokenizer)
    metric = token_logprob_metric(tt.answer_pos, [[int(tt.clean_tokens[b, p]) for p in pos]
                                                  for b, pos in enumerate(tt.answer_pos)])
    return tt.clean_tokens, tt.corrupt_tokens, metric


def random_llama(n_layers: int):
    from patching import random_llama_setting  # benchmarks/patching.py (this script's folder)

    return random_llama_setting(n_layers)


def settings(args: argparse.Namespace):
    """Yields (label, model, clean, corrupt, metric)."""
    smol = ck.load_model("smollm2-135m")
    for seed in args.seeds:
        yield (f"SmolLM2 repeated tokens, seed {seed}", smol, *repeated_tokens(smol, seed))
    if not args.quick:
        yield (f"SmolLM2 icd10 text, {args.text_prompts} prompts", smol,
               *icd_text(smol, args.text_prompts))
    del smol
    teacher = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=16, split="test")
    yield "icd-teacher, icd10 task.metric", teacher, task.clean_tokens, task.corrupt_tokens, \
        task.metric
    for n_layers in ([4] if args.quick else [4, 8, 16]):
        model, clean, corrupt, metric = random_llama(n_layers)
        yield f"random Llama {n_layers}L x 16H ({16 * n_layers} heads)", model, clean, corrupt, \
            metric


# --- measurements ------------------------------------------------------------------------------

def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.flatten().argsort().argsort().double()
    rb = b.flatten().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def quality(est: torch.Tensor, exact: torch.Tensor, k: int = 10) -> dict[str, Any]:
    e, x = est.flatten(), exact.flatten()
    k = min(k, x.numel())
    top_x = x.abs().topk(k).indices
    top_e = set(e.abs().topk(k).indices.tolist())
    top20 = set(e.abs().topk(min(20, e.numel())).indices.tolist())
    rank = e.abs().argsort(descending=True).argsort() + 1
    return dict(spearman=spearman(e, x), recall10=len(top_e & set(top_x.tolist())),
                sign10=int((torch.sign(e[top_x]) == torch.sign(x[top_x])).sum()),
                rank_top1=int(rank[top_x[0]]),
                top3_in_top20=sum(int(i) in top20 for i in top_x[:3].tolist()))


def cached_exact(label: str, model: Any, clean, corrupt, metric, direction: str,
                 cache: Path) -> tuple[ck.PatchResult, float]:
    key = hashlib.sha256(b"|".join([label.encode(), direction.encode(),
                                    clean.numpy().tobytes(), corrupt.numpy().tobytes()]))
    folder = cache / key.hexdigest()[:16]
    if (folder / "seconds.txt").exists():
        return ck.PatchResult.load(folder), float((folder / "seconds.txt").read_text())
    t0 = time.perf_counter()
    res = ck.patch_heads(model, clean, corrupt, metric, direction=direction,
                         options=dict(progress=False))
    seconds = time.perf_counter() - t0
    folder.mkdir(parents=True, exist_ok=True)
    res.save(folder)
    (folder / "seconds.txt").write_text(f"{seconds}")
    return res, seconds


def run_setting(label, model, clean, corrupt, metric, args) -> list[dict[str, Any]]:
    rows = []
    n, seq = clean.shape
    L = model.cfg.n_layers
    for direction in ("noise", "denoise"):
        exact, ex_seconds = cached_exact(label, model, clean, corrupt, metric, direction,
                                         Path(args.cache))
        base = exact.clean if direction == "noise" else exact.corrupt
        x = exact.values - base
        ex_passes = L * model.cfg.n_heads * (L + 1) / (2 * L) + 2  # per prompt, suffix engine
        ref_seconds = None
        for est in ESTIMATORS:
            if est in args.skip:
                continue
            t0 = time.perf_counter()
            res = ck.patch_heads(model, clean, corrupt, metric, direction=direction,
                                 method="attribution",
                                 options=dict(estimator=est, progress=False))
            seconds = time.perf_counter() - t0
            ref_seconds = seconds if est == "atp" else ref_seconds
            passes = estimator_passes(model, est, "z", "all", seq, batch=n)
            rows.append(dict(setting=label, direction=direction, estimator=est,
                             **quality(res.values - base, x), passes=passes,
                             passes_x_atp=passes / 4.0, seconds=seconds,
                             seconds_x_atp=seconds / ref_seconds if ref_seconds else None,
                             exact_seconds=ex_seconds, exact_passes=ex_passes,
                             n_heads=x.numel()))
            print(_fmt(rows[-1]), flush=True)
        t0 = time.perf_counter()
        hyb = ck.patch_heads(model, clean, corrupt, metric, direction=direction,
                             method="attribution+exact", options=dict(
                                 progress=False, budget=dict(exact_when_cheaper=False)))
        seconds = time.perf_counter() - t0
        mask = torch.tensor(hyb.meta["verified"]).flatten()
        top10 = x.flatten().abs().topk(min(10, x.numel())).indices
        cost = hyb.meta["cost"]
        rows.append(dict(setting=label, direction=direction,
                         estimator=f"attribution+exact ({SCREENING_ESTIMATOR}, auto)",
                         verified=int(mask.sum()), verified_fraction=float(mask.float().mean()),
                         recall10=int(mask[top10].sum()), stopped=hyb.meta["budget"]["stopped"],
                         passes=cost["total_passes"] / n,
                         passes_x_atp=cost["total_passes"] / n / 4.0,
                         exact_passes=cost["exact_sweep_passes"] / n, seconds=seconds,
                         seconds_x_atp=seconds / ref_seconds if ref_seconds else None,
                         exact_seconds=ex_seconds, n_heads=x.numel()))
        print(_fmt(rows[-1]), flush=True)
    return rows


def _fmt(r: dict[str, Any]) -> str:
    head = f"{r['setting'][:34]:34s} {r['direction']:7s} {r['estimator'][:30]:30s}"
    if "verified" in r:
        return (f"{head} verified {r['verified']:3d}/{r['n_heads']} ({r['verified_fraction']:.0%})"
                f" recall10 {r['recall10']:2d}/10 [{r['stopped']}] passes {r['passes']:.1f} "
                f"(exact {r['exact_passes']:.1f}) {r['seconds']:.1f}s (exact "
                f"{r['exact_seconds']:.1f}s)")
    return (f"{head} rho {r['spearman']:+.2f} recall10 {r['recall10']:2d} sign10 "
            f"{r['sign10']:2d} rank1 {r['rank_top1']:3d} top3in20 {r['top3_in_top20']} passes "
            f"{r['passes']:.1f} ({r['passes_x_atp']:.1f}x) {r['seconds']:.1f}s "
            f"({(r['seconds_x_atp'] or 0):.1f}x)")


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| setting | dir | estimator | Spearman | top-10 recall | sign top-10 | rank of "
             "exact top-1 | top-3 in top-20 | pass-eq/prompt (x AtP) | seconds (x AtP) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "verified" in r:
            lines.append(f"| {r['setting']} | {r['direction']} | {r['estimator']} | verified "
                         f"{r['verified']}/{r['n_heads']} ({r['verified_fraction']:.0%}), "
                         f"{r['stopped']} | {r['recall10']}/10 | | | | {r['passes']:.1f} "
                         f"(exact sweep {r['exact_passes']:.1f}) | {r['seconds']:.1f} (exact "
                         f"{r['exact_seconds']:.1f}) |")
        else:
            lines.append(f"| {r['setting']} | {r['direction']} | {r['estimator']} | "
                         f"{r['spearman']:+.2f} | {r['recall10']}/10 | {r['sign10']}/10 | "
                         f"{r['rank_top1']} | {r['top3_in_top20']}/3 | {r['passes']:.1f} "
                         f"({r['passes_x_atp']:.1f}x) | {r['seconds']:.1f} "
                         f"({(r['seconds_x_atp'] or 0):.1f}x) |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--text-prompts", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one seed's worth of small settings")
    p.add_argument("--skip", nargs="*", default=[], help="estimators to leave out")
    p.add_argument("--cache", default=str(Path(os.environ.get("XDG_CACHE_HOME",
                                                             Path.home() / ".cache"))
                                         / "circuitkit" / "attribution_quality"))
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    configure_threads()
    rows: list[dict[str, Any]] = []
    for label, model, clean, corrupt, metric in settings(args):
        print(f"\n== {label}: {clean.shape[0]} prompts x {clean.shape[1]} tokens", flush=True)
        rows += run_setting(label, model, clean, corrupt, metric, args)
    print("\n" + markdown(rows))
    if args.out:
        from circuitkit.files import write_json

        write_json(args.out, rows)


if __name__ == "__main__":
    main()
