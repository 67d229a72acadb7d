"""The ablation grid: which supervision transfers the teacher's reasoning to the student
(docs/distill.md, "The ablation": cells, seeds, workers, outputs, measured results).

``run_ablation(out, seeds=3, max_seeds=5)`` trains, for every cell (student preset ``STUDENTS``
x data size ``DATA`` or a size's ``arms``) and seed, one student per variant (``VARIANTS``: ``cot``
CoT only; ``p1``, ``p2``, ``p1+p2`` + L_P1 / L_P2 of the teacher's heads, each matched by its own
student head; ``nonselective`` + L_NS, every teacher layer's mean attention; opt-in
``p1+p2-causal``, ``LossConfig(heads="causal")``) from the teacher's signal store of that data
size, optionally after one shared CoT-only start per cell (``pretrain`` steps). Seeds: ``seeds``
per variant, then up to ``max_seeds`` for every headline comparison (``HEADLINE``) whose 95%
intervals overlap.

Runs live in ``out/runs/<student>-<data>/<variant>-seed<k>/`` (a resumable ``train_student``
folder, then ``metrics.json``, written last: ``student_metrics``); ``ablation.json`` (written
first) records the grid's configuration (``grid_config``). Tables: ``runs.csv``,
``ablation.csv`` (mean over seeds and its 95% t-interval ``mean +- t_{0.975, n-1} s /
sqrt(n)``), ``comparisons.csv`` (paired differences against ``cot`` and ``nonselective``),
``teacher.json`` (the teacher's own metrics on the same notes).

A variant ``V@W`` is ``V`` with its lambdas times ``W`` (``variant_of``: a lambda sweep in one
grid, issue 50); every run's ``metrics.json`` and ``runs.csv`` rows hold each term's effective
share of the step (``SHARE_METRICS``, ``run_shares``), and the embedding Focus / Confusion
when the evaluation returns them (``EMBEDDING_METRICS``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import circuitkit as ck
from circuitkit import evaluation as ev
from circuitkit import hooks
from circuitkit.distill import train
from circuitkit.distill.loss import LossConfig, student_terms
from circuitkit.distill.signals import SignalStore, StoreOptions, build_store
from circuitkit.distill.train import DistillConfig, train_student
from circuitkit.experiments.curves import (
    Curve,
    HeldoutLoss,
    _points,
    best_step,
    decode,
    teacher_forced,
)
from circuitkit.files import check_writable_dir, holds_lock, lock_folder, write_json, write_text
from circuitkit.models import hf_progress, shipped_path
from circuitkit.tasks import load_task

VARIANTS: dict[str, dict[str, float]] = {
    "cot": dict(lambda_p1=0.0, lambda_p2=0.0, lambda_ns=0.0),
    "p1": dict(lambda_p1=1.0, lambda_p2=0.0, lambda_ns=0.0),
    "p2": dict(lambda_p1=0.0, lambda_p2=1.0, lambda_ns=0.0),
    "p1+p2": dict(lambda_p1=1.0, lambda_p2=1.0, lambda_ns=0.0),
    "nonselective": dict(lambda_p1=0.0, lambda_p2=0.0, lambda_ns=1.0),
    "p1+p2-causal": dict(lambda_p1=1.0, lambda_p2=1.0, lambda_ns=0.0),
}
DEFAULT_VARIANTS = ("cot", "p1", "p2", "p1+p2", "nonselective")


def variant_of(name: str) -> tuple[str, float]:
    """``(variant, weight)`` of a grid variant name: ``"p1+p2"`` is ``("p1+p2", 1.0)``;
    ``"p1+p2@0.3"`` is ``p1+p2`` with its lambdas times 0.3 (a lambda sweep, issue 50: with
    ``balance="share"`` the weight is each term's effective share of the CoT gradient)."""
    base, _, w = str(name).partition("@")
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; choose from {list(VARIANTS)}, optionally "
                         "with @WEIGHT (e.g. p1+p2@0.3).")
    if not w:
        return base, 1.0
    try:
        weight = float(w)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and weight > 0) or base == "cot":
        raise ValueError(f"variant {name!r}: @WEIGHT takes a mechanistic variant and a number "
                         "> 0 (e.g. p1+p2@0.3).")
    return base, weight



# a variant's LossConfig options beside its lambdas; its own store (``signals-<data>-<heads>``)
VARIANT_LOSS: dict[str, dict[str, str]] = {"p1+p2-causal": dict(heads="causal")}
STUDENTS = ("student", "student4")
DATA = {"full": 1, "small": 10}  # pool divisor
TASK_METRICS = ("focus", "focus_per_step", "confusion", "confusion_rate", "macro_f1",
                "exact_match")
# the paper's sentence-embedding Focus and Confusion: in runs.csv when the evaluation returns
# them (``evaluation.embedding_keys``; NaN without the embed extra: "not measured"); not required of
# a run (``measured``), so a grid measured without them is not measured again
EMBEDDING_METRICS = ("focus_embedding", "confusion_embedding")
# each mechanistic term's effective share of the step (``loss.balanced_gradients``' ``sh_k``),
# the mean over the run's steps, from its history (``run_shares``)
SHARE_METRICS = ("share_p1", "share_p2", "share_ns")
LAS_METRICS = ("las", "las_gold_prefit")
FIDELITY_METRICS = ("p1_gap", "p2_gap", "sharpness", "anchor_alignment",
                    "anchor_alignment_tokens", "coarse_score_tokens", "shortlist_share",
                    "key_preference", "loopback", "refine_score", "margin_widening")
METRICS = TASK_METRICS + LAS_METRICS + FIDELITY_METRICS
P1_PARTS = ("sharpness", "anchor_alignment", "anchor_alignment_tokens", "coarse_score_tokens",
            "coarse_score")
P2_PARTS = ("shortlist_share", "key_preference", "loopback", "refine_score", "margin_widening")
HEADLINE = (("focus", "confusion"), ("p1", "p2", "p1+p2"), ("cot", "nonselective"))
SIZES: dict[str, dict[str, Any]] = {
    # measured budget in docs/distill.md: the whole grid (2 students x 2 data sizes x 5 variants
    # x 3-5 seeds) on 2 CPU cores
    "default": dict(pool_size=2048, shard_size=1024, steps=120, batch_size=32, warmup=12,
                    pretrain=800, save_every=60, score_examples=256, eval_examples=256,
                    sim_examples=1024, gold_examples=4096, fidelity_examples=48),
    # issue 35: arms of absolute pool sizes, every run from its seed's own initialisation
    # (pretrain 0), each arm's steps S* chosen by the CoT-only baseline's held-out loss (seed 0,
    # up to es_max steps, measured every es_every), learning curves at curve_points points on
    # curve_examples held-out notes; timings in docs/distill.md
    # (es_max 2500: at 1250 both arms' held-out loss was still falling and the baseline at
    # exact match 0.30; 2 arms x 3 variants x 5 seeds at 0.15 s a step, 2 workers: < 2 hours)
    "grid": dict(arms={"main": 16384, "low": 6144}, pool_size=16384, shard_size=1024,
                 steps=2500, batch_size=32, warmup=50, pretrain=0, save_every=250,
                 es_max=2500, es_every=250, heldout_examples=256, curve_examples=128,
                 curve_points=5, score_examples=256, eval_examples=512, sim_examples=1024,
                 gold_examples=4096, fidelity_examples=48),
    # issue 50: the lambda sweep, cut to what one thread on a machine shared by 8 jobs could
    # finish in about an hour (docs/distill.md, "The lambda sweep"): every run continues the
    # shipped CoT-only student (``init``: one initialisation, the seeds are batch orders) for
    # ``steps`` on 4,096 train notes of pool seed 0 (the main arm's seed; 120 x 32 rows draw
    # 3,840 of them), no early-stopping run; held-out curves (pool seed 99, the grid's held-out
    # notes) at the end choose the weight, the test notes give the verdict
    "sweep": dict(arms={"main": 4096}, pool_size=4096, shard_size=1024, steps=120,
                  batch_size=32, warmup=10, pretrain=0, init="icd-student-cot",
                  save_every=120, es_max=0, curve_examples=128, curve_points=1,
                  score_examples=256, eval_examples=256, sim_examples=128, gold_examples=4096,
                  fidelity_examples=48),
    "grid-quick": dict(arms={"main": 160, "low": 96}, pool_size=160, shard_size=80, steps=6,
                       batch_size=8, warmup=2, pretrain=0, save_every=2, es_max=6, es_every=2,
                       heldout_examples=16, curve_examples=8, curve_points=2,
                       score_examples=16, eval_examples=12, sim_examples=16,
                       gold_examples=64, fidelity_examples=6),
    "quick": dict(pool_size=160, shard_size=80, steps=4, batch_size=8, warmup=2, pretrain=2,
                  save_every=2, score_examples=16, eval_examples=12, sim_examples=16,
                  gold_examples=64, fidelity_examples=6),
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


def overlap(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    """Whether two ``interval``s overlap (a NaN interval overlaps everything)."""
    if any(x != x for x in a + b):
        return True
    return not (a[2] < b[1] or b[2] < a[1])


# --- the evaluation context and one run's metrics -------------------------------------------


@dataclass
class Context:
    """What every run is measured on: test notes, the simulator's train notes, the gold
    pre-fitted simulator, the fidelity notes and the teacher's signals on them."""

    test: Any
    sim_task: Any
    gold_sim: Any
    fidelity: Any
    gap_store: Any
    top_k1: int
    top_k2: int
    reading: str


def context(out: Path, sz: dict[str, Any], task: str, reading: str, top_k: tuple[int, int]
            ) -> Context:
    """The evaluation context (the gap store must exist: ``_gap_store``)."""
    test, fidelity = _test_notes(task, sz)
    sim_task = load_task(task, n_examples=sz["sim_examples"], seed=1, split="train")
    gold = ev.gold_prefit_simulator(load_task(task, n_examples=sz["gold_examples"], seed=2,
                                              split="train"))
    return Context(test, sim_task, gold, fidelity, SignalStore.open(out / "signals-fidelity"),
                   top_k[0], top_k[1], reading)


def _test_notes(task: str, sz: dict[str, Any]) -> tuple[Any, Any]:
    """``(test, fidelity)``: the held-out test notes and the first ``fidelity_examples``."""
    test = load_task(task, n_examples=sz["eval_examples"], seed=0, split="test")
    return test, test.subset(range(min(sz["fidelity_examples"], len(test))))


def top_parts(scores: Any, phase: int, k: int, reading: str = "tokens") -> dict[str, float]:
    """Mean of each component over a model's own top ``k`` heads of ``phase`` (Phase 1 by the
    reading's CoarseScore, Phase 2 by ``refine_score``); ties, as when no head of a barely
    trained student is sharp enough to score, go to the higher first component, then (layer,
    head)."""
    if phase == 1:
        col = "coarse_score_tokens" if reading == "tokens" else "coarse_score"
        order, parts = [col, "sharpness"], P1_PARTS
    else:
        order, parts = ["refine_score", "shortlist_share"], P2_PARTS
    best = scores.sort_values(order + ["layer", "head"],
                              ascending=[False, False, True, True]).head(k)
    out = {p: float(best[p].astype(float).mean()) for p in parts}
    out[f"phase{phase}_heads"] = " ".join(hooks.head_name(int(r.layer), int(r.head))
                                          for r in best.itertuples())
    return out


def fidelity_metrics(model: Any, ctx: Context) -> dict[str, Any]:
    """A model's (``TransformerBridge``) own scores of its top heads (``top_parts``)."""
    from circuitkit.scoring.heads import score_heads

    with warnings.catch_warnings():
        # A barely trained student can score the same on every head (coarse_score is 0 while
        # no head's attention is sharp): ``top_parts`` breaks the tie as stated, so
        # score_heads' warning about tied ranks does not apply.
        warnings.filterwarnings("ignore", message="every head has the same")
        scores = score_heads(model, ctx.fidelity, progress=False, n_boot=0)
    out = top_parts(scores, 1, ctx.top_k1, ctx.reading)
    out.update(top_parts(scores, 2, ctx.top_k2))
    return out


@torch.no_grad()
def mechanism_gaps(model: Any, store: Any, batch_size: int = 64) -> dict[str, float]:
    """``p1_gap``, ``p2_gap``: L_P1 and L_P2 of ``model``'s mapped heads against the teacher's
    signals in ``store`` (held-out notes), example-weighted over batches."""
    pool, anchors = store.pooling(), store.anchors
    lc = LossConfig(top_k1=len(pool.heads1), top_k2=len(pool.heads2),
                    phase1_reading=anchors.reading)
    sums, n = {"p1": 0.0, "p2": 0.0}, 0
    for i, shard in enumerate(store.manifest["shards"]):
        for s in range(0, shard["n_examples"], batch_size):
            idx = list(range(s, min(s + batch_size, shard["n_examples"])))
            t = student_terms(model, store.batch(i, idx), pool, anchors, lc, 1.0, 1.0)
            for k in sums:
                sums[k] += float(t[k]) * len(idx)
            n += len(idx)
    return {f"{k}_gap": v / max(n, 1) for k, v in sums.items()}


def student_metrics(folder: str | Path, ctx: Context, batch_size: int = 64) -> dict[str, Any]:
    """The grid's metrics of the model saved in ``folder``: ``TASK_METRICS`` as ``ck.evaluate``
    (decoding through the HF KV cache), ``LAS_METRICS`` (``ev.las``, Hase et al., and with the
    gold pre-fit simulator) and ``FIDELITY_METRICS`` (``mechanism_gaps``, ``fidelity_metrics``)
    on the context's held-out notes."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    test = ctx.test
    out: dict[str, Any] = teacher_forced(hf, test, batch_size)
    gens = decode(hf, test)
    out.update(ev.task_set_metrics(gens, test))
    # the paper's Focus / Confusion (sentence-embedding cosines; NaN without the embed extra)
    out.update({k: v for k, v in ev.embedding_keys(test, gens).items()
                if k in EMBEDDING_METRICS and v == v})  # (measured only: a NaN is left out)
    sim_gens = decode(hf, ctx.sim_task)
    for name, sim in (("las", None), ("las_gold_prefit", ctx.gold_sim)):
        res = ev.las(None, test, ctx.sim_task, generations=gens, train_generations=sim_gens,
                     simulator=sim)
        out.update({k.replace("las", name, 1) if k.startswith("las") else f"{name}_{k}": v
                    for k, v in res.items()})
    bridge = ck.load_model(str(folder))
    out.update(mechanism_gaps(bridge, ctx.gap_store))
    out.update(fidelity_metrics(bridge, ctx))
    return out


# --- running the grid -------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    student: str
    data: str
    variant: str
    seed: int

    @property
    def cell(self) -> str:
        return f"{self.student}-{self.data}"

    def folder(self, out: Path) -> Path:
        return out / "runs" / self.cell / f"{self.variant}-seed{self.seed}"

    def pretrain_folder(self, out: Path) -> Path:
        return out / "runs" / self.cell / "pretrain"


def _do_train(out: str, run: Run, cfg: dict[str, Any], progress: bool,
              heldout: str | None = None) -> str:
    """A CoT-only run with no metrics of its own, in a worker: the start of ``run``'s cell
    (``pretrain``), or, with the ``heldout`` store, its arm's early-stopping baseline (its
    held-out loss, ``HeldoutLoss``, picks S*)."""
    folder = run.pretrain_folder(Path(out)) if heldout is None else run.folder(Path(out))
    if progress:
        print(f"[ablation] {run.cell} {'pretrain' if heldout is None else 'early stopping'}",
              file=sys.stderr, flush=True)
    train_student(DistillConfig(**cfg), folder, progress=progress, callback=None
                  if heldout is None else HeldoutLoss(folder, SignalStore.open(heldout)))
    return str(folder)


_CTX: dict[str, Context] = {}  # one evaluation context per (worker) process
# a worker's state (``_init_worker``): the grid's pid, whether a task is running, and whether the
# worker was told to stop (SIGINT: finish the current step's checkpoint; SIGTERM: then exit)
_WORKER: dict[str, Any] = dict(parent=None, in_task=False, stop=False, term=False)


def _do_run(out: str, run: Run, cfg: dict[str, Any], ctx_args: tuple, progress: bool) -> str:
    """Train and measure one run (skipped when its ``metrics.json`` exists); in a worker."""
    folder = run.folder(Path(out))
    done = folder / "metrics.json"
    if measured(folder):
        return str(done)
    config = DistillConfig(**cfg)
    if progress:
        print(f"[ablation] {run.cell} {run.variant} seed {run.seed}", file=sys.stderr,
              flush=True)
    sz, task = ctx_args[0], ctx_args[1]
    callback = None
    if sz.get("curve_examples"):  # learning curves on held-out notes (pool seed 99's first)
        callback = Curve(folder, load_task(task, n_examples=sz["curve_examples"], seed=99,
                                           split="train"))
    train_student(config, folder, progress=progress, callback=callback)
    t0 = time.perf_counter()
    if "ctx" not in _CTX:  # deterministic: built once per process
        _CTX["ctx"] = context(Path(out), *ctx_args)
    with hf_progress(progress):
        m = student_metrics(folder, _CTX["ctx"])
    _parent_check()  # never write into a grid whose process is gone (its lock is free)
    m.update(run_shares(folder))
    write_json(done, dict(run=asdict(run), metrics=m, config=asdict(config),
                          eval_seconds=round(time.perf_counter() - t0, 1)))
    return str(done)


def run_shares(folder: str | Path) -> dict[str, float]:
    """``SHARE_METRICS`` of the trained run in ``folder``: each term's effective share of the
    step (``sh_k`` of ``loss.balanced_gradients``), its mean over the run's steps, from
    ``distill.json``'s history (0 for a term that is off; NaN for a history without shares)."""
    record = json.loads((Path(folder) / train.RECORD).read_text())
    cols, hist = record["history_columns"], record["history"]
    out = {}
    for k in ("p1", "p2", "ns"):
        if f"sh_{k}" not in cols or not hist:
            out[f"share_{k}"] = math.nan
            continue
        i = cols.index(f"sh_{k}")
        out[f"share_{k}"] = sum(float(r[i]) for r in hist) / len(hist)
    return out


def measured(folder: Path) -> bool:
    """Whether ``folder/metrics.json`` holds every one of ``METRICS``: a run measured by a
    version that measured less is measured again from its saved student (``train_student``
    finds it there and does not train)."""
    try:
        return _complete(json.loads((Path(folder) / "metrics.json").read_text())["metrics"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _complete(metrics: Any) -> bool:
    """Whether ``metrics`` (a run's or the teacher's) holds every one of ``METRICS``."""
    return isinstance(metrics, dict) and all(k in metrics for k in METRICS)


def _task(fn: Any, *args: Any) -> Any:
    """Run ``fn(*args)`` in a worker as one grid task: nothing when the worker was told to stop;
    a SIGTERM (the pool ending after another worker died) exits once ``train_student`` has
    saved its training state."""
    if _WORKER["stop"]:
        return None  # told to stop: nothing more runs here
    _WORKER["in_task"] = True
    try:
        return fn(*args)
    except KeyboardInterrupt:
        if _WORKER["term"]:
            os._exit(143)
        raise
    finally:
        _WORKER["in_task"] = False


def _parent_check() -> None:
    """In a worker: exit at once (no cleanup, no write) when the grid's process is gone."""
    if _WORKER["parent"] is not None and os.getppid() != _WORKER["parent"]:
        os._exit(1)


def _on_signal(signum: int, frame: Any) -> None:
    """A worker's SIGINT / SIGTERM. While ``train_student`` trains: stop before the next step,
    saving the training state (``train.STOP``). In another part of a task (loading, measuring:
    nothing there to save): exit now. An idle worker: SIGINT is noted (nothing more will run),
    SIGTERM exits."""
    _WORKER["stop"] = True
    term = signum == signal.SIGTERM
    _WORKER["term"] = _WORKER["term"] or term
    if train.STOP["training"]:
        train.STOP["requested"] = True
    elif _WORKER["in_task"] or term:
        os._exit(143 if term else 130)


def _init_worker(parent: int | None = None) -> None:
    # one thread per worker: train_student's configure_threads keeps an explicit
    # OMP_NUM_THREADS (two workers with two threads each on two shared cores ran 10-20x slower)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    _WORKER["parent"] = parent
    from tqdm import tqdm

    # tqdm's default lock is a named multiprocessing semaphore: a worker that is killed leaves
    # it behind (the resource tracker's "leaked semaphore" warning); a thread lock is enough here
    tqdm.set_lock(threading.RLock())
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    # die with the grid's process: the kernel's parent-death signal (Linux), and a thread that
    # polls the parent for other systems (a SIGKILLed grid left its workers training for good)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # (it fires when the thread that spawned the worker ends: ``_dispatch``'s caller, which
        # waits for the pool before it returns)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    _parent_check()  # the parent may have died before prctl

    def watch() -> None:
        while True:
            _parent_check()
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True, name="circuitkit-parent-watch").start()


def run_ablation(out: str | Path, teacher: str = "icd-teacher", seeds: int = 3,
                 size: str = "default", students: tuple[Any, ...] = STUDENTS,
                 data: tuple[str, ...] | None = None, lambda_p1: float = 1.0,
                 lambda_p2: float = 1.0, lambda_ns: float = 1.0, task: str = "icd10",
                 variants: tuple[str, ...] | None = None, progress: bool = True,
                 max_seeds: int | None = None, workers: int = 1,
                 steps: int | None = None, balance: str = "share",
                 grad_ratio: float = 0.5, pretrain: int | None = None,
                 overwrite: bool = False) -> Any:
    """Train and measure the grid (module docstring); returns the ``ablation.csv`` frame. The
    lambdas scale the variants' mechanistic terms; ``max_seeds`` (default ``seeds``): seeds
    for headline comparisons whose intervals overlap; ``steps`` overrides the size's;
    ``balance``, ``grad_ratio``: how every run combines its terms' gradients
    (``loss.balanced_gradients``); ``pretrain`` overrides the size's CoT-only pre-training steps
    (0: every run starts from its seed's fresh initialisation). ``overwrite``: a grid of another
    configuration in ``out`` is started over instead of refused (``_check_grid``)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}.")
    if seeds < 1:
        raise ValueError(f"seeds must be a positive integer, got {seeds}.")
    max_seeds = seeds if max_seeds is None else max_seeds
    if max_seeds < seeds:
        raise ValueError(f"max_seeds ({max_seeds}) must be >= seeds ({seeds}).")
    if workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers}.")
    if pretrain is not None and (not isinstance(pretrain, int) or pretrain < 0):
        raise ValueError(f"pretrain must be an integer >= 0 (CoT-only steps), got {pretrain!r}.")
    variants = tuple(variants or DEFAULT_VARIANTS)
    for v in variants:
        variant_of(v)
    known = arms(SIZES[size])
    data = tuple(known) if data is None else tuple(data)
    bad = [d for d in data if d not in known]
    if bad or not data:
        raise ValueError(f"unknown data size(s) {bad or data} for size {size!r}; choose from "
                         f"{list(known)}.")
    if not students:
        raise ValueError("students: name at least one student preset.")
    out = check_writable_dir(out, "--out")
    # one ablation per folder (the CLI's claim may hold the lock already)
    with contextlib.nullcontext() if holds_lock(out) else lock_folder(out, "--out folder"):
        return _run_ablation(out, teacher, seeds, max_seeds, size, tuple(students), tuple(data),
                             dict(lambda_p1=lambda_p1, lambda_p2=lambda_p2,
                                  lambda_ns=lambda_ns), task, variants, progress, workers,
                             steps, dict(balance=balance, grad_ratio=grad_ratio), pretrain,
                             overwrite)


def arms(sz: dict[str, Any]) -> dict[str, int]:
    """Each data arm's pool of train notes: a size's ``arms`` (absolute), else ``DATA``'s
    divisors of its ``pool_size``."""
    return dict(sz["arms"]) if sz.get("arms") else {
        d: max(sz["batch_size"], sz["pool_size"] // k) for d, k in DATA.items()}


def coverage(task: str, pool_size: int, test: Any) -> dict[str, float]:
    """Label coverage of an arm: the share of the test notes' targets (each target of each note
    counted once) seen in at least 1 and at least 3 of the pool's notes' targets."""
    pool = load_task(task, n_examples=pool_size, seed=0, split="train")
    seen = Counter(t for e in pool.examples for t in e.targets)
    targets = [t for e in test.examples for t in e.targets]
    return {f"seen_ge{k}": sum(seen[t] >= k for t in targets) / max(len(targets), 1)
            for k in (1, 3)}


def _early_stopping(out: Path, cells: list[tuple[str, str]], stores: dict[str, dict],
                    names: dict[str, Any], sz: dict[str, Any], task: str, progress: bool,
                    workers: int, record: dict) -> dict[str, dict[str, Any]]:
    """The held-out store (``heldout_examples`` train notes of pool seed 99: disjoint from the
    pools of seed 0 and from the test split), each arm's label coverage, then ``_select_steps``;
    S*, curves and coverage go into ``ablation.json`` at once."""
    folder = out / "signals-heldout"
    # the pools' score table: the same heads
    _share_scores(Path(stores[cells[0][1]]["store"]) / "scores.csv", folder)
    cfg = dict(stores[cells[0][1]], pool_size=sz["heldout_examples"], pool_seed=99,
               store=str(folder))
    with hf_progress(progress):
        train.prepare_store(DistillConfig(**cfg), out, progress=progress)
    test, _ = _test_notes(task, sz)
    record["coverage"] = {d: coverage(task, arms(sz)[d], test) for _, d in cells}
    sel = _select_steps(out, cells, stores, names, sz, progress, workers)
    record["baseline_selection"] = sel
    write_json(out / "ablation.json", record)
    return sel


def _select_steps(out: Path, cells: list[tuple[str, str]], stores: dict[str, dict],
                  names: dict[str, Any], sz: dict[str, Any], progress: bool, workers: int
                  ) -> dict[str, dict[str, Any]]:
    """Per arm: S* and the held-out-loss curve of its early-stopping baseline (seed 0, the cot
    variant's config with ``es_max`` steps, measured every ``es_every``)."""
    heldout = str(out / "signals-heldout")
    tasks = []
    for s, d in cells:
        r = Run(s, d, "cot-es", 0)
        cfg = dict(stores[d], student=names[s], seed=0, steps=sz["es_max"],
                   save_every=sz["es_every"], lambda_p1=0.0, lambda_p2=0.0, lambda_ns=0.0)
        if not (r.folder(out) / "distill.json").exists():
            tasks.append((_do_train, (str(out), r, cfg, progress, heldout), r, "early stopping"))
    if tasks:
        _dispatch(out, tasks, workers, progress)
    sel = {}
    for s, d in cells:
        pts = _points(Run(s, d, "cot-es", 0).folder(out))
        sel[f"{s}-{d}"] = dict(s_star=best_step(pts), curve=pts)
    return sel


def _student_name(student: Any) -> str:
    if isinstance(student, str) and "/" not in student and not student.endswith(".json"):
        return student
    p = train.preset(student)
    return f"L{p.n_layers}H{p.n_heads}D{p.d_model}"


def _run_ablation(out: Path, teacher: str, seeds: int, max_seeds: int, size: str,
                  students: tuple[Any, ...], data: tuple[str, ...], scale: dict[str, float],
                  task: str, variants: tuple[str, ...], progress: bool, workers: int,
                  steps: int | None, balancing: dict[str, Any], pretrain: int | None,
                  overwrite: bool = False) -> Any:
    sz = dict(SIZES[size])
    if steps is not None:
        sz["steps"] = int(steps)
    if pretrain is not None:
        sz["pretrain"] = pretrain
    t_start = time.time()
    names = {_student_name(s): s for s in students}
    base = dict(teacher=teacher, task=task, **balancing, **{k: sz[k] for k in (
        "shard_size", "steps", "batch_size", "warmup", "save_every", "score_examples")})
    timings: dict[str, float] = {}
    record = json.loads(json.dumps(dict(
        size=size, sizes=sz, seeds=seeds, max_seeds=max_seeds, variants=variants,
        students={n: asdict(train.preset(s)) for n, s in names.items()}, data=list(data),
        lambdas=scale, base=base, workers=workers)))
    # the grid's identity first, before anything is built or trained: a changed configuration
    # is refused (or, with overwrite, started over), never mixed into the runs already there
    stored = _check_grid(out, record, overwrite)
    if stored is not None:  # the presets of cells this call does not run stay on record
        record["students"] = {**stored.get("students", {}), **record["students"]}
        # and what earlier calls measured (read mid-call, the record stays whole)
        record.update({k: stored[k] for k in ("teacher_metrics", "timings") if k in stored})
        record["calls"] = stored.get("calls") or ([stored["timings"]] if "timings" in stored
                                                  else [])
    write_json(out / "ablation.json", record)
    # stores: one per data size (scored once, the table shared), then the held-out notes'
    stores: dict[Any, dict[str, Any]] = {}

    def store(key: Any, name: str, cfg: dict[str, Any]) -> None:
        stores[key] = cfg
        t0 = time.perf_counter()
        with hf_progress(progress):
            train.prepare_store(DistillConfig(**cfg), out, progress=progress)
        timings[name] = round(time.perf_counter() - t0, 1)

    for d in data:
        folder = out / f"signals-{d}"
        _share_scores(out / f"signals-{data[0]}" / "scores.csv", folder)
        store(d, f"store_{d}", dict(base, pool_size=arms(sz)[d], store=str(folder)))
    for heads in sorted({VARIANT_LOSS[variant_of(v)[0]]["heads"] for v in variants
                         if variant_of(v)[0] in VARIANT_LOSS}):
        for d in data:  # a variant's own heads: its own store per data size, one score table
            folder = out / f"signals-{d}-{heads}"
            first = out / f"signals-{data[0]}-{heads}" / "scores.csv"
            # the causal columns are added once
            _share_scores(first if first.exists() else out / f"signals-{data[0]}" / "scores.csv",
                          folder)
            store((d, heads), f"store_{d}_{heads}",
                  dict(stores[d], store=str(folder), loss=dict(heads=heads)))
    lc = DistillConfig().loss_config()
    t0 = time.perf_counter()
    _gap_store(out, teacher, task, sz, lc, stores[data[0]]["store"], progress)
    teacher_m = _teacher_metrics(out, teacher, task, sz, lc, progress)
    timings["teacher_and_fidelity_store"] = round(time.perf_counter() - t0, 1)
    ctx_args = (sz, task, lc.phase1_reading, (lc.top_k1, lc.top_k2))
    cells = [(s, d) for s in names for d in data]
    sel: dict[str, dict[str, Any]] = {}
    if sz.get("es_max"):
        t0 = time.perf_counter()
        sel = _early_stopping(out, cells, stores, names, sz, task, progress, workers, record)
        timings["early_stopping"] = round(time.perf_counter() - t0, 1)

    def cfg_of(r: Run) -> dict[str, Any]:
        base_, weight = variant_of(r.variant)
        lam = {k: VARIANTS[base_][k] * scale[k] * weight for k in scale}
        init = str(r.pretrain_folder(out)) if sz["pretrain"] else sz.get("init")
        own = {}
        if r.cell in sel:  # S* fixes steps and schedule; curve points at its fifths
            n = sel[r.cell]["s_star"]
            own = dict(steps=n, save_every=max(1, n // sz["curve_points"]),
                       warmup=min(sz["warmup"], max(1, n // 10)))
        key = (r.data, VARIANT_LOSS[base_]["heads"]) if base_ in VARIANT_LOSS else r.data
        return dict(stores[key], student=names[r.student], seed=r.seed, init=init, **lam,
                    **own)

    def pretrain_of(r: Run) -> dict[str, Any]:
        return dict(stores[r.data], student=names[r.student], seed=0, steps=sz["pretrain"],
                    lambda_p1=0.0, lambda_p2=0.0, lambda_ns=0.0)

    planned = [Run(s, d, v, k) for s, d in cells for k in range(seeds) for v in variants]
    t0 = time.perf_counter()
    pre = pretrain_of if sz["pretrain"] else None
    _execute(out, planned, cfg_of, pre, ctx_args, progress, workers)
    extra = _extra_runs(out, cells, variants, seeds, max_seeds) if max_seeds > seeds else []
    _execute(out, extra, cfg_of, pre, ctx_args, progress, workers)
    timings["runs"] = round(time.perf_counter() - t0, 1)
    runs = planned + extra
    frame = _write_tables(out, runs)
    timings["total_this_call"] = round(time.time() - t_start, 1)
    record.update(timings=timings, calls=[*record.get("calls", []), timings], n_runs=len(runs),
                  teacher_metrics=teacher_m,
                  extra_runs=[asdict(r) for r in extra])
    write_json(out / "ablation.json", record)
    return frame


def _share_scores(src: Path, folder: Path) -> None:
    """Copy the score table ``src`` into the store ``folder`` unless it has one (or there is
    none to copy): stores built on one table choose the same heads."""
    if src.exists() and not (folder / "scores.csv").exists():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, folder / "scores.csv")


GRID_FILES = ("ablation.json", "runs.csv", "ablation.csv", "comparisons.csv")
# what a training store depends on; and, with these, the held-out notes' store and teacher.json
STORE_KEYS = ("teacher", "task", "pool_size", "shard_size", "score_examples", "batch_size")
EVAL_KEYS = STORE_KEYS + ("eval_examples", "sim_examples", "gold_examples",
                          "fidelity_examples")


def grid_config(record: dict) -> dict[str, Any]:
    """A grid's identity, flat, from its ``ablation.json`` record: the size and its fields
    (steps, pretrain, ...), the lambdas, the teacher, task and balancing, and each student
    preset by name. Not in it: seeds, max_seeds, variants, data and workers (more seeds or
    cells extend a grid; each run's own config does not change)."""
    base = record.get("base") or {}
    out = dict(size=record.get("size"), **(record.get("sizes") or {}),
               **(record.get("lambdas") or {}),
               **{k: base.get(k) for k in ("teacher", "task", "balance", "grad_ratio")})
    out.update({f"student {n}": p for n, p in (record.get("students") or {}).items()})
    return out


def _check_grid(out: Path, record: dict, overwrite: bool) -> dict | None:
    """The stored ``ablation.json`` of ``out`` (None: none), refused when it records another
    configuration than ``record`` (a single student's ``distill`` refuses so too:
    ``train._config_diff``); with ``overwrite`` that grid is started over instead."""
    path = out / "ablation.json"
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        if not overwrite:
            raise ValueError(f"{path} is unreadable ({e}); pass --overwrite to start the grid "
                             "over, or choose another --out.") from None
        _start_over(out, None)
        return None
    old, now = grid_config(stored), grid_config(record)
    for key in [k for k in set(old) ^ set(now) if k.startswith("student ")]:
        old.pop(key, None)  # a cell only one side runs: nothing to mix
        now.pop(key, None)
    diff = train._config_diff(old, now)
    if not diff:
        return stored
    if not overwrite:
        raise ValueError(f"{out} holds an ablation grid of another configuration ({diff}); "
                         "pass --overwrite to start it over, or choose another --out.")
    _start_over(out, {k for k in set(old) | set(now) if old.get(k) != now.get(k)})
    return None


def _start_over(out: Path, changed: set[str] | None) -> None:
    """``overwrite``: delete the grid's runs and tables; its held-out notes' store and
    ``teacher.json`` too when an evaluation size (``EVAL_KEYS``) changed, and the training
    stores when what they hold (``STORE_KEYS``) changed (``changed`` None: everything)."""
    def gone(keys: tuple[str, ...]) -> bool:
        return changed is None or bool(changed & set(keys))

    (out / "ablation.json").unlink(missing_ok=True)  # first: the folder claims no grid
    for name in GRID_FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "runs", ignore_errors=True)
    if gone(EVAL_KEYS):
        (out / "teacher.json").unlink(missing_ok=True)
        shutil.rmtree(out / "signals-fidelity", ignore_errors=True)
    if gone(STORE_KEYS):  # every arm's store and the held-out one
        for d in [p for p in out.glob("signals-*") if p.name != "signals-fidelity"]:
            shutil.rmtree(d, ignore_errors=True)


class GridStopped(ValueError):
    """The grid stopped before its runs finished (a worker died); the message says what is kept
    and how to resume."""


def _execute(out: Path, runs: list[Run], cfg_of: Any, pretrain_of: Any, ctx_args: tuple,
             progress: bool, workers: int) -> None:
    """The unfinished ``runs``, after the CoT-only starts they need (``pretrain_of``: their
    configs; None: no pre-training); a finished start (its ``distill.json``) is reused."""
    todo = [r for r in runs if not measured(r.folder(out))]
    starts = list({r.cell: r for r in todo
                   if pretrain_of is not None
                   and not (r.pretrain_folder(out) / train.RECORD).exists()}.values())
    if not todo:
        return
    _dispatch(out, [(_do_train, (str(out), r, pretrain_of(r), progress), r, "pretrain")
                    for r in starts], workers, progress)
    _dispatch(out, [(_do_run, (str(out), r, cfg_of(r), ctx_args, progress), r, "run")
                    for r in todo], workers, progress)


STOP_GRACE = 30.0  # seconds a stopped worker has to save its training state before it is killed


def _dispatch(out: Path, tasks: list[tuple], workers: int, progress: bool) -> None:
    """Run ``tasks`` (``(fn, args, run, what)``) on ``workers`` spawned processes, at most one
    task per worker at a time (so a stop leaves nothing queued). On Ctrl-C, a worker's error or
    a worker's death: nothing more is dispatched, the running tasks are stopped at their last
    training state (``train_student`` saves it on SIGINT), and the grid says what is kept.
    One worker: each task in this process, in turn."""
    if workers == 1:
        for fn, args, _, _ in tasks:
            fn(*args)
        return
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(os.getpid(),))
    running: dict[Any, tuple] = {}
    queue = list(tasks)
    procs: list[Any] = []
    try:
        while queue or running:
            while queue and len(running) < workers:
                fn, args, run, what = queue.pop(0)
                running[pool.submit(_task, fn, *args)] = (run, what)
                procs = list(getattr(pool, "_processes", {}).values()) or procs
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                f.result()  # a worker's error surfaces here, with its message
                running.pop(f)
    except BaseException as e:
        in_flight = [f"{r.cell} {r.variant if what == 'run' else 'pretrain'} seed {r.seed}"
                     for r, what in running.values()]
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:  # stop the running tasks: each saves its training state
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError, OSError):
                    os.kill(p.pid, signal.SIGINT)
        deadline = time.time() + STOP_GRACE
        for p in procs:
            p.join(max(0.0, deadline - time.time()))
            if p.is_alive():
                p.kill()
                p.join(5)
        finished = len(list(out.glob("runs/*/*/metrics.json")))
        kept = (f"{finished} finished run(s) are kept in {out}; "
                + (f"the run(s) in flight ({', '.join(in_flight)}) were stopped at their last "
                   "training state; " if in_flight else "")
                + "rerun the same command to resume.")
        dead = [f"pid {p.pid} ({_how(p.exitcode)})" for p in procs
                if p.exitcode is not None and p.exitcode not in (0, 130, 143, -2, -15)]
        if isinstance(e, BrokenProcessPool) and not dead:
            e = KeyboardInterrupt()  # a worker that ended on Ctrl-C before the grid saw it
        if isinstance(e, BrokenProcessPool):
            if progress:
                print(file=sys.stderr, flush=True)  # the error's line starts after a worker's bar
            raise GridStopped(f"an ablation worker died ({', '.join(dead) or 'killed'}; out of "
                              f"memory, or killed), so the grid stopped: {kept}") from None
        if isinstance(e, KeyboardInterrupt):
            print(f"\n[ablation] interrupted: stopped dispatching; {kept}", file=sys.stderr,
                  flush=True)
            raise KeyboardInterrupt from None
        raise
    pool.shutdown(wait=True)


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _gap_store(out: Path, teacher: str, task: str, sz: dict[str, Any], lc: Any,
               train_store: str, progress: bool) -> Any:
    """The teacher's signals on the fidelity notes (held out), with the training stores'
    score table and options."""
    import pandas as pd

    folder = out / "signals-fidelity"
    if (folder / "manifest.json").exists():
        return SignalStore.open(folder)
    _, fid = _test_notes(task, sz)
    scores = pd.read_csv(Path(train_store) / "scores.csv")
    opts = StoreOptions(top_k1=lc.top_k1, top_k2=lc.top_k2, nonselective=False,
                        shard_size=len(fid), phase1_reading=lc.phase1_reading)
    with hf_progress(progress):  # the teacher's CoT decoding loads a plain HF copy of it
        model = ck.load_model(teacher)
        return build_store(model, fid, scores, folder, opts, teacher_name=teacher,
                           progress=False)


def _teacher_metrics(out: Path, teacher: str, task: str, sz: dict[str, Any], lc: Any,
                     progress: bool) -> dict[str, Any]:
    """The teacher's own metrics on the grid's notes (``teacher.json``; computed once, and
    again when it lacks one of ``METRICS``, as a run's are: ``measured``)."""
    path = out / "teacher.json"
    if path.exists():
        got = json.loads(path.read_text())
        if _complete(got):
            return got
    ctx = context(out, sz, task, lc.phase1_reading, (lc.top_k1, lc.top_k2))
    folder = shipped_path(teacher) if not Path(teacher).is_dir() else Path(teacher)
    with hf_progress(progress):
        m = student_metrics(folder, ctx)
    write_json(path, m)
    return m


def _extra_runs(out: Path, cells: list[tuple[str, str]], variants: tuple[str, ...],
                seeds: int, max_seeds: int) -> list[Run]:
    """Seeds ``seeds .. max_seeds - 1`` of both variants of every headline comparison whose
    intervals overlap after ``seeds`` seeds (module docstring)."""
    metrics, mech, bases = HEADLINE
    extra: set[Run] = set()
    for s, d in cells:
        vals = {}
        for v in variants:
            for k in range(seeds):
                m = json.loads((Run(s, d, v, k).folder(out) / "metrics.json").read_text())
                for name in metrics:
                    vals.setdefault((v, name), []).append(float(m["metrics"][name]))
        for v in (x for x in mech if x in variants):
            for b in (x for x in bases if x in variants):
                if any(overlap(interval(vals[(v, n)]), interval(vals[(b, n)]))
                       for n in metrics):
                    extra |= {Run(s, d, x, k) for x in (v, b) for k in range(seeds, max_seeds)}
    order = {v: i for i, v in enumerate(variants)}
    return sorted(extra, key=lambda r: (r.student, r.data, r.seed, order[r.variant]))


def _write_tables(out: Path, runs: list[Run]) -> Any:
    import pandas as pd

    rows = []
    for r in runs:
        m = json.loads((r.folder(out) / "metrics.json").read_text())["metrics"]
        rows += [dict(student=r.student, data=r.data, variant=r.variant, seed=r.seed, metric=k,
                      value=float(m[k])) for k in METRICS + EMBEDDING_METRICS + SHARE_METRICS
                 if k in m]
    runs_f = pd.DataFrame(rows, columns=["student", "data", "variant", "seed", "metric",
                                         "value"])
    write_text(out / "runs.csv", runs_f.to_csv(index=False))
    table, comp = [], []
    keys = ["student", "data", "variant", "metric"]
    for (s, d, v, k), g in runs_f.groupby(keys, sort=False):
        mean, lo, hi = interval(g["value"].tolist())
        table.append(dict(student=s, data=d, variant=v, metric=k, mean=mean, ci_low=lo,
                          ci_high=hi, n_seeds=len(g)))
    frame = pd.DataFrame(table, columns=keys + ["mean", "ci_low", "ci_high", "n_seeds"])
    write_text(out / "ablation.csv", frame.to_csv(index=False))
    by = {key: dict(zip(g["seed"], g["value"], strict=True))
          for key, g in runs_f.groupby(keys, sort=False)}
    for (s, d, v, k), vals in by.items():
        for b in ("cot", "nonselective"):
            if v == b or (s, d, b, k) not in by:
                continue
            base = by[(s, d, b, k)]
            shared = sorted(set(vals) & set(base))
            mean, lo, hi = interval([vals[i] - base[i] for i in shared])
            comp.append(dict(student=s, data=d, metric=k, variant=v, baseline=b, diff=mean,
                             ci_low=lo, ci_high=hi, n_seeds=len(shared)))
    write_text(out / "comparisons.csv", pd.DataFrame(comp).to_csv(index=False))
    return frame


def format_table(frame: Any) -> str:
    """``ablation.csv`` as text: per cell, one row per metric, one column per variant, each
    cell ``mean [ci_low, ci_high]``."""
    lines = []
    cells = list(dict.fromkeys(zip(frame.student, frame.data, strict=True))) \
        if "student" in frame.columns else [(None, None)]
    for s, d in cells:
        sub = frame if s is None else frame[(frame.student == s) & (frame.data == d)]
        variants = list(dict.fromkeys(sub.variant))
        if s is not None:
            lines.append(f"{s} x {d} data ({int(sub.n_seeds.min())}-{int(sub.n_seeds.max())} "
                         "seeds)")
        lines.append(f"{'metric':<24}" + "".join(f"{v:>23}" for v in variants))
        for m in dict.fromkeys(sub.metric):
            cells_ = []
            for v in variants:
                rows = sub[(sub.variant == v) & (sub.metric == m)]
                if not len(rows):  # (a metric measured for some variants only: the embeddings)
                    cells_.append("not measured")
                    continue
                r = rows.iloc[0]
                cells_.append(f"{r['mean']:.3f} [{r['ci_low']:.3f},{r['ci_high']:.3f}]")
            lines.append(f"{m:<24}" + "".join(f"{c:>23}" for c in cells_))
        lines.append("")
    return "\n".join(lines).rstrip()
