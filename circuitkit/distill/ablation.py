"""The ablation table: which supervision transfers the teacher's reasoning to the student.

``run_ablation(out, seeds=3, size="default")`` trains, per seed, five students from one teacher
signal store (``out/signals``, with the teacher's score table ``out/signals/scores.csv``):

=============  ==========================================================================
cot            CoT only (``lambda_p1 = lambda_p2 = 0``)
p1             + L_P1
p2             + L_P2
p1+p2          + L_P1 + L_P2
nonselective   CoT + L_NS: every teacher layer's mean attention over all its heads, matched
               uniformly (MiniLM-style), at the same query rows; no head selection, no writes
=============  ==========================================================================

Each run lives in ``out/runs/<variant>-seed<k>/`` (a resumable ``train_student`` folder, then
``metrics.json``, which also records ``eval_seconds``; ``distill.json`` has ``train_seconds``);
a finished run is skipped, so the command resumes where it stopped. Per
run, on held-out ``icd10`` test notes: ``focus``, ``confusion``, ``confusion_rate``,
``macro_f1``, ``exact_match`` (as ``ck.evaluate``; decoding through the HF model's KV cache),
``las`` (``evaluation.las``; the simulator is pre-fitted on gold notes of a third train draw
and fitted further on the student's outputs on train notes disjoint from the test notes), and
the student's own mechanism (``ck.score_heads`` of the student on test notes): ``sharpness``
and ``anchor_alignment`` of its rank-1 Phase-1 head, ``loopback`` and ``margin_widening`` of
its rank-1 Phase-2 head (rank 1 by ``coarse_score`` / ``refine_score``; a tie, as when no head
of a barely trained student is sharp enough to score, goes to the higher ``sharpness`` /
``loopback``).

Outputs:

* ``out/runs.csv``: ``variant, seed, metric, value`` (one row per run and metric);
* ``out/ablation.csv``: ``variant, metric, mean, ci_low, ci_high, n_seeds``: the mean over seeds
  and its 95% t-interval ``mean +- t_{0.975, n-1} s / sqrt(n)`` (``s`` the sample standard
  deviation; with one seed ``ci_low = ci_high = mean``). ``ck.viz.ablation_chart(frame)``
  reads this frame (``pandas.read_csv``).

Sizes (``SIZES``): ``default`` (the table of the issue; 53 min end to end on 2 shared CPU cores,
see docs/distill.md) and ``quick`` (CI: tiny pool, a dozen steps, a few dozen notes).
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from circuitkit.distill.train import DistillConfig, train_student

VARIANTS: dict[str, dict[str, float]] = {
    "cot": dict(lambda_p1=0.0, lambda_p2=0.0, lambda_ns=0.0),
    "p1": dict(lambda_p1=1.0, lambda_p2=0.0, lambda_ns=0.0),
    "p2": dict(lambda_p1=0.0, lambda_p2=1.0, lambda_ns=0.0),
    "p1+p2": dict(lambda_p1=1.0, lambda_p2=1.0, lambda_ns=0.0),
    "nonselective": dict(lambda_p1=0.0, lambda_p2=0.0, lambda_ns=1.0),
}
METRICS = ("focus", "confusion", "confusion_rate", "macro_f1", "exact_match", "las",
           "sharpness", "anchor_alignment", "loopback", "margin_widening")
SIZES: dict[str, dict[str, Any]] = {
    # 1000 steps x 64 rows = 64k CoT rows seen (4 passes over the 16384-note pool); ~0.15 s per
    # step on 2 cores: the whole table took 53 min end to end under load, ~40 min quiet
    # (docs/distill.md)
    "default": dict(pool_size=16384, shard_size=1024, steps=1000, batch_size=64, warmup=50,
                    save_every=100, score_examples=256, eval_examples=512, sim_examples=512,
                    sim_pretrain_examples=8192, fidelity_examples=256),
    "quick": dict(pool_size=64, shard_size=32, steps=8, batch_size=16, warmup=2,
                  save_every=4, score_examples=16, eval_examples=16, sim_examples=16,
                  sim_pretrain_examples=128, fidelity_examples=8),
}
# t_{0.975, df} for df = 1..30 (a 95% two-sided interval); 1.96 beyond
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def interval(values: list[float]) -> tuple[float, float, float]:
    """``(mean, ci_low, ci_high)``: the 95% t-interval of the mean (module docstring)."""
    v = [x for x in values if x == x]  # NaN-free
    if not v:
        return (math.nan, math.nan, math.nan)
    n, m = len(v), sum(v) / len(v)
    if n == 1:
        return (m, m, m)
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1))
    h = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * sd / math.sqrt(n)
    return (m, m - h, m + h)


def student_metrics(folder: Path, test: Any, sim_task: Any, simulator: Any,
                    fidelity_task: Any, batch_size: int = 64) -> dict[str, float]:
    """The ablation's metrics of the student saved in ``folder`` (module docstring)."""
    from transformers import AutoModelForCausalLM

    import circuitkit as ck
    from circuitkit import evaluation as ev
    from circuitkit.scoring.heads import score_heads

    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    focus, conf = [], []
    with torch.no_grad():
        for s in range(0, len(test), batch_size):
            sub = test.subset(range(s, min(s + batch_size, len(test))))
            logits = hf(sub.clean_tokens).logits
            focus.append(ev.focus_from_logits(logits, sub))
            conf.append(ev.confusion_from_logits(logits, sub))
    f, c = torch.cat(focus), torch.cat(conf)
    out = dict(focus=float(f.nanmean()), confusion=float(c.nanmean()))
    gens = decode(hf, test)
    out.update(ev.set_metrics([ev.parse_answer(g, test) for g in gens],
                              [set(e.targets) for e in test.examples],
                              [set(e.near_misses) for e in test.examples]))
    res = ev.las(None, test, sim_task, generations=gens, train_generations=decode(hf, sim_task),
                 simulator=simulator)
    out.update({k: float(v) for k, v in res.items()})
    with warnings.catch_warnings():
        # A barely trained student can score the same on every head (coarse_score is 0 while
        # no head's attention is sharp): its rank-1 head is then picked by the tie-break below,
        # not by (layer, head) order, so score_heads' warning about tied ranks does not apply.
        warnings.filterwarnings("ignore", message="every head has the same")
        scores = score_heads(ck.load_model(str(folder)), fidelity_task, progress=False)
    # rank-1 heads: by the phase's score, ties by its first component (the sharpest head when
    # none is sharp enough to score), then by (layer, head)
    p1 = scores.sort_values(["coarse_score", "sharpness", "layer", "head"],
                            ascending=[False, False, True, True]).iloc[0]
    p2 = scores.sort_values(["refine_score", "loopback", "layer", "head"],
                            ascending=[False, False, True, True]).iloc[0]
    out.update(sharpness=float(p1["sharpness"]), anchor_alignment=float(p1["anchor_alignment"]),
               loopback=float(p2["loopback"]), margin_widening=float(p2["margin_widening"]),
               phase1_head=f"{int(p1['layer'])}.{int(p1['head'])}",
               phase2_head=f"{int(p2['layer'])}.{int(p2['head'])}")
    return out


def decode(hf: Any, task: Any) -> list[list[int]]:
    """The student's greedy continuations of ``task``'s prompts, ``evaluate``'s length."""
    from circuitkit.evaluation import greedy_decode_cached, prompt_end

    think = task.vocab.index("<think>")
    ends = [prompt_end(e, think) for e in task.examples]
    new = max(len(e.tokens) - n for e, n in zip(task.examples, ends, strict=True)) + 4
    return greedy_decode_cached(hf, [e.tokens[:n] for e, n in zip(task.examples, ends,
                                                                   strict=True)],
                                task.eos_id, new, task.pad_id)


def run_ablation(out: str | Path, teacher: str = "icd-teacher", seeds: int = 3,
                 size: str = "default", student: Any = "student", lambda_p1: float = 1.0,
                 lambda_p2: float = 1.0, lambda_ns: float = 1.0, task: str = "icd10",
                 variants: tuple[str, ...] | None = None, progress: bool = True) -> Any:
    """Train and measure every variant for ``seeds`` seeds (module docstring); returns the
    ``ablation.csv`` frame. The lambdas scale the variants' mechanistic terms."""
    from circuitkit.files import check_writable_dir, lock_folder

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}.")
    if seeds < 1:
        raise ValueError(f"seeds must be a positive integer, got {seeds}.")
    variants = tuple(variants or VARIANTS)
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; choose from {list(VARIANTS)}.")
    out = check_writable_dir(out, "--out")
    with lock_folder(out, "--out folder"):  # one ablation per folder
        return _run_ablation(out, teacher, seeds, size, student, lambda_p1, lambda_p2,
                             lambda_ns, task, variants, progress)


def _run_ablation(out: Path, teacher: str, seeds: int, size: str, student: Any,
                  lambda_p1: float, lambda_p2: float, lambda_ns: float, task: str,
                  variants: tuple[str, ...], progress: bool) -> Any:
    import pandas as pd

    from circuitkit.evaluation import pretrained_simulator
    from circuitkit.files import write_json, write_text
    from circuitkit.models import hf_progress
    from circuitkit.tasks import load_task

    sz = SIZES[size]
    scale = dict(lambda_p1=lambda_p1, lambda_p2=lambda_p2, lambda_ns=lambda_ns)
    base = DistillConfig(
        teacher=teacher, task=task, student=student, store=str(out / "signals"),
        **{k: sz[k] for k in ("pool_size", "shard_size", "steps", "batch_size", "warmup",
                              "save_every", "score_examples")})
    write_json(out / "ablation.json", dict(size=size, sizes=sz, seeds=seeds, variants=variants,
                                           lambdas=scale, base=asdict(base)))
    test = load_task(task, n_examples=sz["eval_examples"], seed=0, split="test")
    sim_task = load_task(task, n_examples=sz["sim_examples"], seed=1, split="train")
    fidelity = test.subset(range(min(sz["fidelity_examples"], len(test))))
    simulator = None
    rows = []
    for seed in range(seeds):
        for v in variants:
            run = out / "runs" / f"{v}-seed{seed}"
            done = run / "metrics.json"
            if not done.exists():
                lam = {k: VARIANTS[v][k] * scale[k] for k in scale}
                cfg = DistillConfig(**{**asdict(base), **lam, "seed": seed})
                if progress:
                    print(f"[ablation] {v} seed {seed}", file=sys.stderr)
                train_student(cfg, run, progress=progress)
                t0 = time.perf_counter()
                if simulator is None:  # deterministic: pre-fitted once per process
                    simulator = pretrained_simulator(load_task(
                        task, n_examples=sz["sim_pretrain_examples"], seed=2, split="train"))
                with hf_progress(progress):  # its model loads show no bar unless asked
                    m = student_metrics(run, test, sim_task, simulator, fidelity)
                write_json(done, dict(variant=v, seed=seed, metrics=m, config=asdict(cfg),
                                      eval_seconds=round(time.perf_counter() - t0, 1)))
            m = json.loads(done.read_text())["metrics"]
            rows += [dict(variant=v, seed=seed, metric=k, value=float(m[k])) for k in METRICS]
    runs = pd.DataFrame(rows)
    write_text(out / "runs.csv", runs.to_csv(index=False))
    table = []
    for v in variants:
        for k in METRICS:
            vals = runs[(runs.variant == v) & (runs.metric == k)]["value"].tolist()
            mean, lo, hi = interval(vals)
            table.append(dict(variant=v, metric=k, mean=mean, ci_low=lo, ci_high=hi,
                              n_seeds=len(vals)))
    frame = pd.DataFrame(table, columns=["variant", "metric", "mean", "ci_low", "ci_high",
                                         "n_seeds"])
    write_text(out / "ablation.csv", frame.to_csv(index=False))
    return frame


def format_table(frame: Any) -> str:
    """``ablation.csv`` as text: one row per metric, one column per variant, each cell
    ``mean [ci_low, ci_high]``."""
    variants = list(dict.fromkeys(frame.variant))
    lines = [f"{'metric':<17}" + "".join(f"{v:>23}" for v in variants)]
    for m in dict.fromkeys(frame.metric):
        cells = []
        for v in variants:
            r = frame[(frame.variant == v) & (frame.metric == m)].iloc[0]
            cells.append(f"{r['mean']:.3f} [{r['ci_low']:.3f},{r['ci_high']:.3f}]")
        lines.append(f"{m:<17}" + "".join(f"{c:>23}" for c in cells))
    return "\n".join(lines)
