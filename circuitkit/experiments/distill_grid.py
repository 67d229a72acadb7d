"""The ablation grid: which supervision transfers the teacher's reasoning to the student
(docs/distill.md, "The ablation": cells, seeds, workers, outputs, measured results).

``run_ablation(out, seeds=3, max_seeds=5)`` trains, for every cell (student preset ``STUDENTS`` x
data size ``DATA`` or a size's ``arms``) and seed, one student per variant (``VARIANTS``: ``cot``
CoT only; ``p1``, ``p2``, ``p1+p2`` + L_P1 / L_P2; ``nonselective`` + L_NS; opt-in ``p1+p2-causal``;
``V@W``: ``V`` with its lambdas times ``W``, ``variant_of``) from the teacher's signal store of that
data size, optionally after one shared CoT-only start per cell (``pretrain`` steps); then up to
``max_seeds`` seeds for every headline comparison (``HEADLINE``) whose 95% intervals overlap.

Files: ``out/runs/<student>-<data>/<variant>-seed<k>/`` (a resumable ``train_student`` folder,
then ``metrics.json``, written last: ``student_metrics``, ``SHARE_METRICS`` and, when measured,
``EMBEDDING_METRICS``); ``ablation.json`` (written first: ``grid_config``); ``runs.csv``;
``ablation.csv`` (mean over seeds and its 95% t-interval ``mean +- t_{0.975, n-1} s /
sqrt(n)``); ``comparisons.csv`` (paired differences against ``cot`` and ``nonselective``);
``teacher.json`` (the teacher's own metrics on the same notes).
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
from dataclasses import asdict, dataclass, field, replace
from functools import partial
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
from circuitkit.experiments.runner import (
    RECORD_VERSION,
    VERSION_KEY,
    Step,
    StepRecord,
    depends_hash,
    options_of,
    read_steps,
    run_steps,
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
# the paper's sentence-embedding Focus and Confusion: in runs.csv when measured (NaN without
# the embed extra); not required of a run (``measured``): a grid without them is not re-measured
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
    # issue 35 (docs/distill.md, the grid): arms of absolute pool sizes, each arm's S* by the
    # CoT-only baseline's held-out loss (es_max 2500: at 1250 both arms' held-out loss was
    # still falling and the baseline at exact match 0.30)
    "grid": dict(arms={"main": 16384, "low": 6144}, pool_size=16384, shard_size=1024,
                 steps=2500, batch_size=32, warmup=50, pretrain=0, save_every=250,
                 es_max=2500, es_every=250, heldout_examples=256, curve_examples=128,
                 curve_points=5, score_examples=256, eval_examples=512, sim_examples=1024,
                 gold_examples=4096, fidelity_examples=48),
    # issue 50: the lambda sweep, cut to what one thread on a machine shared by 8 jobs could
    # finish in about an hour (docs/distill.md, "The lambda sweep"): every run continues the
    # shipped CoT-only student (``init``: the seeds are batch orders), no early-stopping run
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
    reading's CoarseScore, Phase 2 by ``refine_score``); ties, as when no head of a barely trained
    student is sharp enough to score, go to the higher first component, then (layer, head)."""
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
    """The grid's metrics of the model saved in ``folder`` on the context's held-out notes:
    ``TASK_METRICS`` (``ck.evaluate``'s, decoded through the HF KV cache), ``LAS_METRICS``
    (``ev.las`` and the gold pre-fit) and ``FIDELITY_METRICS``."""
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
    """``SHARE_METRICS`` of the trained run in ``folder`` from ``distill.json``'s history (0 for
    a term that is off; NaN for a history without shares)."""
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
    """Whether ``folder/metrics.json`` holds every one of ``METRICS`` (a run measured by a
    version that measured less is measured again from its saved student, not trained)."""
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


@dataclass(frozen=True)
class GridOptions:
    """``run_ablation``'s options (a dict of these fields is accepted too).

    ``teacher``, ``task``: whose signals, on which notes; ``seeds``: per variant; ``max_seeds``
    (None: ``seeds``): seeds for headline comparisons whose intervals overlap; ``size``: one of
    ``SIZES``; ``students``: student presets (names or configs); ``data``: the data sizes or arms
    (None: every one of the size's); ``variants`` (None: ``DEFAULT_VARIANTS``); ``lambda_p1``,
    ``lambda_p2``, ``lambda_ns``: scale the variants' mechanistic terms; ``steps`` overrides the
    size's; ``balance``, ``grad_ratio``: how every run combines its terms' gradients
    (``loss.balanced_gradients``); ``pretrain`` overrides the size's CoT-only pre-training steps (0:
    every run starts from its seed's fresh initialisation); ``workers``: runs at a time, each in its
    own process; ``progress``: bars and one line per run on stderr; ``overwrite``: a grid of another
    configuration in ``out`` is started over instead of refused (``_check_grid``)."""

    teacher: str = "icd-teacher"
    seeds: int = 3
    size: str = "default"
    students: tuple[Any, ...] = STUDENTS
    data: tuple[str, ...] | None = None
    lambda_p1: float = 1.0
    lambda_p2: float = 1.0
    lambda_ns: float = 1.0
    task: str = "icd10"
    variants: tuple[str, ...] | None = None
    progress: bool = True
    max_seeds: int | None = None
    workers: int = 1
    steps: int | None = None
    balance: str = "share"
    grad_ratio: float = 0.5
    pretrain: int | None = None
    overwrite: bool = False


def run_ablation(out: str | Path, options: GridOptions | dict[str, Any] | None = None,
                 **overrides: Any) -> Any:
    """Train and measure the grid (module docstring) into ``out``; returns the ``ablation.csv``
    frame. ``options``: ``GridOptions`` (or a dict of its fields); ``overrides``: its fields, on top
    (``run_ablation(out, seeds=1, size="quick")``). Resumed from ``ablation.json``'s record
    (``experiments.runner.StepRecord``): finished runs are not trained or measured again."""
    o = _resolve(options_of(GridOptions, options, overrides, "run_ablation"))
    out = check_writable_dir(out, "--out")
    # one ablation per folder (the CLI's claim may hold the lock already)
    with contextlib.nullcontext() if holds_lock(out) else lock_folder(out, "--out folder"):
        return _run_ablation(out, o)


def _resolve(o: GridOptions) -> GridOptions:
    """``o`` checked (each bad value one line) with its defaults resolved: ``max_seeds``,
    ``variants``, ``data`` and ``students`` as tuples."""
    if o.size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {o.size!r}.")
    if o.seeds < 1:
        raise ValueError(f"seeds must be a positive integer, got {o.seeds}.")
    max_seeds = o.seeds if o.max_seeds is None else o.max_seeds
    if max_seeds < o.seeds:
        raise ValueError(f"max_seeds ({max_seeds}) must be >= seeds ({o.seeds}).")
    if o.workers < 1:
        raise ValueError(f"workers must be a positive integer, got {o.workers}.")
    if o.pretrain is not None and (not isinstance(o.pretrain, int) or o.pretrain < 0):
        raise ValueError(f"pretrain must be an integer >= 0 (CoT-only steps), got "
                         f"{o.pretrain!r}.")
    variants = tuple(o.variants or DEFAULT_VARIANTS)
    for v in variants:
        variant_of(v)
    known = arms(SIZES[o.size])
    data = tuple(known) if o.data is None else tuple(o.data)
    bad = [d for d in data if d not in known]
    if bad or not data:
        raise ValueError(f"unknown data size(s) {bad or data} for size {o.size!r}; choose from "
                         f"{list(known)}.")
    if not o.students:
        raise ValueError("students: name at least one student preset.")
    return replace(o, max_seeds=max_seeds, variants=variants, data=data,
                   students=tuple(o.students))


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


@dataclass
class _Grid:
    """One ``run_ablation`` call: its options and sizes, ``ablation.json``'s document ``doc``
    and resume record, and what its steps hand on (stores, S*, the teacher's metrics, the
    runs, the frame)."""

    out: Path
    o: GridOptions
    sz: dict[str, Any]
    names: dict[str, Any]  # student name -> preset
    scale: dict[str, float]  # the lambdas
    base: dict[str, Any]  # every run's config: teacher, task, balancing, the size's fields
    doc: dict[str, Any]
    record: StepRecord
    lc: Any
    t_start: float
    timings: dict[str, float] = field(default_factory=dict)
    stores: dict[Any, dict[str, Any]] = field(default_factory=dict)
    sel: dict[str, dict[str, Any]] = field(default_factory=dict)
    teacher_m: dict[str, Any] = field(default_factory=dict)
    planned: list[Run] = field(default_factory=list)
    extra: list[Run] = field(default_factory=list)
    frame: Any = None
    t0: float = 0.0

    @property
    def cells(self) -> list[tuple[str, str]]:
        return [(s, d) for s in self.names for d in self.o.data]

    @property
    def ctx_args(self) -> tuple:
        return (self.sz, self.o.task, self.lc.phase1_reading, (self.lc.top_k1, self.lc.top_k2))

    def save(self) -> None:
        self.record.save()


GRID_REMEDY = "pass --overwrite to start the grid over, or choose another --out"


def _open_grid(out: Path, o: GridOptions) -> _Grid:
    """The grid's sizes, its document (the configuration, checked against the one stored
    first: a changed configuration is refused, or with ``overwrite`` started over, before
    anything is built or trained) and its resume record, written."""
    sz = dict(SIZES[o.size])
    if o.steps is not None:
        sz["steps"] = int(o.steps)
    if o.pretrain is not None:
        sz["pretrain"] = o.pretrain
    names = {_student_name(s): s for s in o.students}
    scale = dict(lambda_p1=o.lambda_p1, lambda_p2=o.lambda_p2, lambda_ns=o.lambda_ns)
    base = dict(teacher=o.teacher, task=o.task, balance=o.balance, grad_ratio=o.grad_ratio,
                **{k: sz[k] for k in ("shard_size", "steps", "batch_size", "warmup",
                                      "save_every", "score_examples")})
    doc = json.loads(json.dumps(dict(
        size=o.size, sizes=sz, seeds=o.seeds, max_seeds=o.max_seeds, variants=o.variants,
        students={n: asdict(train.preset(s)) for n, s in names.items()}, data=list(o.data),
        lambdas=scale, base=base, workers=o.workers)))
    stored = _check_grid(out, doc, o.overwrite)
    if stored is not None:  # the presets of cells this call does not run stay on record
        doc["students"] = {**stored.get("students", {}), **doc["students"]}
        # and what earlier calls measured (read mid-call, the record stays whole)
        doc.update({k: stored[k] for k in ("teacher_metrics", "timings") if k in stored})
        doc["calls"] = stored.get("calls") or ([stored["timings"]] if "timings" in stored
                                               else [])
    doc["steps"] = (stored or {}).get("steps", {})
    doc[VERSION_KEY] = RECORD_VERSION
    record = StepRecord(out, doc["steps"], lambda: write_json(out / "ablation.json", doc),
                        "ablation grid", out / "ablation.json")
    record.save()
    return _Grid(out=out, o=o, sz=sz, names=names, scale=scale, base=base, doc=doc,
                 record=record, lc=DistillConfig().loss_config(), t_start=time.time())


def _run_ablation(out: Path, o: GridOptions) -> Any:
    """The grid's steps (``runner.run_steps``): stores, fidelity store, teacher, early stopping
    (sizes with ``es_max``), runs, tables."""
    g = _open_grid(out, o)
    steps = [Step("stores", partial(_stores, g)), Step("fidelity-store", partial(_fidelity, g)),
             Step("teacher", partial(_teacher, g), depends_hash(_eval_config(g)),
                  reuse=partial(_read_teacher, g), current=partial(_teacher_current, g))]
    if g.sz.get("es_max"):
        steps.append(Step("early-stopping", partial(_early_stopping, g)))
    steps += [Step("runs", partial(_runs, g)), Step("tables", partial(_tables, g))]
    run_steps(steps, g.record, lambda msg: None)  # (the runs say what they do themselves)
    return g.frame


def _stores(g: _Grid, at: str) -> list[str]:
    """The training stores: one per data size (scored once, the table shared), and a variant's
    own heads' store per data size (``VARIANT_LOSS``); each ``train.prepare_store``'s own
    resumable folder."""
    out, data = g.out, g.o.data

    def store(key: Any, name: str, cfg: dict[str, Any]) -> None:
        g.stores[key] = cfg
        t0 = time.perf_counter()
        with hf_progress(g.o.progress):
            train.prepare_store(DistillConfig(**cfg), out, progress=g.o.progress)
        g.timings[name] = round(time.perf_counter() - t0, 1)

    for d in data:
        folder = out / f"signals-{d}"
        _share_scores(out / f"signals-{data[0]}" / "scores.csv", folder)
        store(d, f"store_{d}", dict(g.base, pool_size=arms(g.sz)[d], store=str(folder)))
    for heads in sorted({VARIANT_LOSS[variant_of(v)[0]]["heads"] for v in g.o.variants
                         if variant_of(v)[0] in VARIANT_LOSS}):
        for d in data:  # a variant's own heads: its own store per data size, one score table
            folder = out / f"signals-{d}-{heads}"
            first = out / f"signals-{data[0]}-{heads}" / "scores.csv"
            # the causal columns are added once
            _share_scores(first if first.exists() else out / f"signals-{data[0]}" / "scores.csv",
                          folder)
            store((d, heads), f"store_{d}_{heads}",
                  dict(g.stores[d], store=str(folder), loss=dict(heads=heads)))
    return []


def _fidelity(g: _Grid, at: str) -> list[str]:
    g.t0 = time.perf_counter()
    _gap_store(g.out, g.o.teacher, g.o.task, g.sz, g.lc, g.stores[g.o.data[0]]["store"],
               g.o.progress)
    return []


def _eval_config(g: _Grid) -> dict[str, Any]:
    """What the teacher's metrics depend on: the teacher, the task, the evaluation sizes."""
    return dict(teacher=g.o.teacher, task=g.o.task, lc=asdict(g.lc),
                **{k: g.sz.get(k) for k in EVAL_KEYS if k not in ("teacher", "task")})


def _teacher_current(g: _Grid, entry: dict[str, Any]) -> bool:
    """A recorded ``teacher.json`` lacking one of ``METRICS`` (a version that measured less)
    is measured again, as a run's is (``measured``); a missing or unreadable one is the
    record's to name."""
    try:
        return _complete(json.loads((g.out / "teacher.json").read_text()))
    except (OSError, ValueError):
        return True


def _teacher(g: _Grid, at: str) -> list[str]:
    """The teacher's metrics (``teacher.json``): those of a folder from before the record
    (there, complete, not recorded) are taken as they are; else measured."""
    path = g.out / "teacher.json"
    if "teacher" not in g.record.dropped and path.exists():
        with contextlib.suppress(OSError, ValueError):
            got = json.loads(path.read_text())
            if _complete(got):
                g.teacher_m = got
    if not g.teacher_m:
        g.teacher_m = _teacher_metrics(g.out, g.o.teacher, g.o.task, g.sz, g.lc, g.o.progress)
    g.timings["teacher_and_fidelity_store"] = round(time.perf_counter() - g.t0, 1)
    return ["teacher.json"]


def _read_teacher(g: _Grid) -> None:
    g.teacher_m = json.loads((g.out / "teacher.json").read_text())
    g.timings["teacher_and_fidelity_store"] = round(time.perf_counter() - g.t0, 1)


def _early_stopping(g: _Grid, at: str) -> list[str]:
    """The held-out store (``heldout_examples`` train notes of pool seed 99: disjoint from the
    pools of seed 0 and from the test split), each arm's label coverage and ``_select_steps``,
    into ``ablation.json`` at once."""
    t0 = time.perf_counter()
    out, cells, sz = g.out, g.cells, g.sz
    folder = out / "signals-heldout"
    # the pools' score table: the same heads
    _share_scores(Path(g.stores[cells[0][1]]["store"]) / "scores.csv", folder)
    cfg = dict(g.stores[cells[0][1]], pool_size=sz["heldout_examples"], pool_seed=99,
               store=str(folder))
    with hf_progress(g.o.progress):
        train.prepare_store(DistillConfig(**cfg), out, progress=g.o.progress)
    test, _ = _test_notes(g.o.task, sz)
    g.doc["coverage"] = {d: coverage(g.o.task, arms(sz)[d], test) for _, d in cells}
    g.sel = _select_steps(g)
    g.doc["baseline_selection"] = g.sel
    g.save()
    g.timings["early_stopping"] = round(time.perf_counter() - t0, 1)
    return []


def _select_steps(g: _Grid) -> dict[str, dict[str, Any]]:
    """Per arm: S* and the held-out-loss curve of its early-stopping baseline (seed 0, the cot
    variant's config with ``es_max`` steps, measured every ``es_every``)."""
    heldout = str(g.out / "signals-heldout")
    tasks = []
    for s, d in g.cells:
        r = Run(s, d, "cot-es", 0)
        if not _finished(g, r, "early stopping"):
            tasks.append((_do_train, (str(g.out), r, _es_of(g, r), g.o.progress, heldout), r,
                          "early stopping"))
    if tasks:
        _dispatch(g.out, tasks, g.o.workers, g.o.progress, partial(_record_task, g))
    sel = {}
    for s, d in g.cells:
        pts = _points(Run(s, d, "cot-es", 0).folder(g.out))
        sel[f"{s}-{d}"] = dict(s_star=best_step(pts), curve=pts)
    return sel


def _student_name(student: Any) -> str:
    if isinstance(student, str) and "/" not in student and not student.endswith(".json"):
        return student
    p = train.preset(student)
    return f"L{p.n_layers}H{p.n_heads}D{p.d_model}"


def _cfg_of(g: _Grid, r: Run) -> dict[str, Any]:
    """Run ``r``'s config: its data size's store, its student and seed, its variant's lambdas
    (times the grid's and the variant's weight), its start, and its arm's S* when there is
    one (steps and schedule; curve points at its fifths)."""
    base_, weight = variant_of(r.variant)
    lam = {k: VARIANTS[base_][k] * g.scale[k] * weight for k in g.scale}
    init = str(r.pretrain_folder(g.out)) if g.sz["pretrain"] else g.sz.get("init")
    own = {}
    if r.cell in g.sel:
        n = g.sel[r.cell]["s_star"]
        own = dict(steps=n, save_every=max(1, n // g.sz["curve_points"]),
                   warmup=min(g.sz["warmup"], max(1, n // 10)))
    key = (r.data, VARIANT_LOSS[base_]["heads"]) if base_ in VARIANT_LOSS else r.data
    return dict(g.stores[key], student=g.names[r.student], seed=r.seed, init=init, **lam, **own)


def _pretrain_of(g: _Grid, r: Run, **kw: Any) -> dict[str, Any]:
    """The CoT-only start of ``r``'s cell (``pretrain`` steps, seed 0); ``kw`` on top."""
    return {**g.stores[r.data], "student": g.names[r.student], "seed": 0,
            "steps": g.sz["pretrain"], **VARIANTS["cot"], **kw}


def _es_of(g: _Grid, r: Run) -> dict[str, Any]:
    """The early-stopping baseline of ``r``'s arm: the cot config with ``es_max`` steps."""
    return _pretrain_of(g, r, steps=g.sz["es_max"], save_every=g.sz["es_every"])


# each recorded kind of grid step: (its folder, its config, the file it writes last)
_KINDS: dict[str, tuple[Any, Any, str]] = {
    "run": (lambda g, r: r.folder(g.out), _cfg_of, "metrics.json"),
    "pretrain": (lambda g, r: r.pretrain_folder(g.out), _pretrain_of, train.RECORD),
    "early stopping": (lambda g, r: r.folder(g.out), _es_of, train.RECORD),
}


def _sub_step(g: _Grid, r: Run, what: str) -> tuple[str, str, str]:
    """``(name, depends, file)`` of a recorded grid step: ``name`` its folder relative to the
    grid's, ``depends`` the hash of its config with the grid's own paths relative (a grid
    copied elsewhere resumes), ``file`` what it writes last."""
    folder_of, config_of, last = _KINDS[what]
    name = folder_of(g, r).relative_to(g.out).as_posix()
    prefix = str(g.out) + os.sep
    cfg = {k: "./" + v[len(prefix):].replace(os.sep, "/")
           if isinstance(v, str) and v.startswith(prefix) else v
           for k, v in config_of(g, r).items()}
    return name, depends_hash(cfg), f"{name}/{last}"


def _finished(g: _Grid, r: Run, what: str) -> bool:
    """Whether grid step ``what`` of ``r`` is done: recorded for this config with its file
    verified, or (a folder from before the record, or a run finished as the grid stopped) its
    last file there (``measured`` for a run). A recorded one whose file was modified is said
    and done again (a run measured again from its saved student; a training run verified by
    ``train_student``); one recorded for another config is refused (``overwrite``: its folder
    is deleted and it runs again)."""
    rec = g.record
    name, depends, file = _sub_step(g, r, what)
    folder = g.out / name
    if rec.forget_stale({name: depends}):
        if not g.o.overwrite:
            raise ValueError(f"{folder} was trained for another config than this call's (its "
                             f"recorded inputs differ); {GRID_REMEDY}.")
        shutil.rmtree(folder, ignore_errors=True)
    if rec.reusable(name):
        return True
    if name in rec.dropped:
        if what == "run":  # (metrics.json is derived: measured again, not trained)
            (g.out / file).unlink(missing_ok=True)
        return False
    if measured(folder) if what == "run" else (g.out / file).exists():
        rec.done(name, depends, 0.0, [file])
        return True
    return False


def _record_task(g: _Grid, r: Run, what: str, seconds: float) -> None:
    """A dispatched task's step recorded as it finishes (a task told to stop wrote nothing)."""
    name, depends, file = _sub_step(g, r, what)
    if (measured(g.out / name) if what == "run" else (g.out / file).exists()):
        g.record.done(name, depends, seconds, [file])


def _runs(g: _Grid, at: str) -> list[str]:
    """Every variant x seed of every cell, then the seeds added for overlapping headline
    comparisons (``_extra_runs``); finished ones are kept (``_finished``)."""
    t0 = time.perf_counter()
    g.planned = [Run(s, d, v, k) for s, d in g.cells for k in range(g.o.seeds)
                 for v in g.o.variants]
    _execute(g, g.planned)
    if g.o.max_seeds > g.o.seeds:
        g.extra = _extra_runs(g.out, g.cells, g.o.variants, g.o.seeds, g.o.max_seeds)
    _execute(g, g.extra)
    g.timings["runs"] = round(time.perf_counter() - t0, 1)
    return []


def _tables(g: _Grid, at: str) -> list[str]:
    """``runs.csv``, ``ablation.csv``, ``comparisons.csv`` of every run; this call's timings
    and the teacher's metrics into ``ablation.json``."""
    runs = g.planned + g.extra
    g.frame = _write_tables(g.out, runs)
    g.timings["total_this_call"] = round(time.time() - g.t_start, 1)
    g.doc.update(timings=g.timings, calls=[*g.doc.get("calls", []), g.timings],
                 n_runs=len(runs), teacher_metrics=g.teacher_m,
                 extra_runs=[asdict(r) for r in g.extra])
    g.save()
    return []


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
    """The stored ``ablation.json`` of ``out`` (None: none), its resume record read strictly
    (``runner.read_steps``), refused when it records another configuration than ``record`` (a
    single student's ``distill`` refuses so too: ``train._config_diff``); with ``overwrite``
    that grid is started over instead (an unreadable one too)."""
    path = out / "ablation.json"
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        if not overwrite:
            raise ValueError(f"{path} is unreadable ({e}); {GRID_REMEDY}.") from None
        _start_over(out, None)
        return None
    try:
        stored["steps"] = read_steps(stored, path, GRID_REMEDY)
    except ValueError:
        if not overwrite:
            raise
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


def _execute(g: _Grid, runs: list[Run]) -> None:
    """The unfinished ``runs`` (``_finished``), after the CoT-only starts they need (sizes
    with ``pretrain`` steps); a finished start is reused. Each recorded as it finishes."""
    out, progress, workers = g.out, g.o.progress, g.o.workers
    todo = [r for r in runs if not _finished(g, r, "run")]
    starts = list({r.cell: r for r in todo
                   if g.sz["pretrain"] and not _finished(g, r, "pretrain")}.values())
    if not todo:
        return
    done = partial(_record_task, g)
    _dispatch(out, [(_do_train, (str(out), r, _pretrain_of(g, r), progress), r, "pretrain")
                    for r in starts], workers, progress, done)
    _dispatch(out, [(_do_run, (str(out), r, _cfg_of(g, r), g.ctx_args, progress), r, "run")
                    for r in todo], workers, progress, done)


STOP_GRACE = 30.0  # seconds a stopped worker has to save its training state before it is killed


def _dispatch(out: Path, tasks: list[tuple], workers: int, progress: bool,
              on_done: Any = None) -> None:
    """Run ``tasks`` (``(fn, args, run, what)``) on ``workers`` spawned processes, at most one
    task per worker at a time (so a stop leaves nothing queued); ``on_done(run, what,
    seconds)`` as each finishes (the grid records it). On Ctrl-C, a worker's error or a
    worker's death: nothing more is dispatched, the running tasks are stopped at their last
    training state (``train_student`` saves it on SIGINT), and the grid says what is kept.
    One worker: each task in this process, in turn."""
    on_done = on_done or (lambda *a: None)
    if workers == 1:
        for fn, args, run, what in tasks:
            t0 = time.perf_counter()
            fn(*args)
            on_done(run, what, time.perf_counter() - t0)
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
                running[pool.submit(_task, fn, *args)] = (run, what, time.perf_counter())
                procs = list(getattr(pool, "_processes", {}).values()) or procs
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                f.result()  # a worker's error surfaces here, with its message
                run, what, t0 = running.pop(f)
                on_done(run, what, time.perf_counter() - t0)
    except BaseException as e:
        in_flight = [f"{r.cell} {r.variant if what == 'run' else 'pretrain'} seed {r.seed}"
                     for r, what, _ in running.values()]
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
    """The teacher's own metrics on the grid's notes, written to ``teacher.json`` (the grid's
    ``teacher`` step: recorded, measured again when it lacks one of ``METRICS``)."""
    path = out / "teacher.json"
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
