"""Train a student on the teacher-signal store: ``L_CoT + lambda_P1 L_P1 + lambda_P2 L_P2``
(docs/distill.md, "Training").

``train_student(cfg, out_dir)``: score the teacher and write its store (``prepare_store``), drop
it; train a fresh HF ``LlamaForCausalLM`` (``training.build_model``) through a
``TransformerBridge`` that wraps it (same hook names as the teacher's) with AdamW, warm-up and
cosine decay (``training.optimizer``), batches from ``signals.BatchStream`` and each term's
gradient combined by ``loss.balanced_gradients``; every step's terms and gradient norms go into
the history (``HISTORY_COLUMNS``). Resumable from ``out_dir/train_state.safetensors`` (every
``save_every`` steps and on Ctrl-C) bit for bit; a non-finite step stops the run with nothing of
it applied. The student is saved as a plain HF folder with ``distill.json`` (config, history, the
SHA-256 of every student file) written last: a finished folder of the same config is a no-op (or
rewritten from the kept state when damaged), another config is refused unless ``overwrite``.
One run per ``out_dir`` at a time (``files.lock_folder``).
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import circuitkit as ck
from circuitkit import training
from circuitkit.distill import signals
from circuitkit.distill.loss import BALANCES, LossConfig, balanced_gradients, student_terms
from circuitkit.evaluation import non_finite_parameters
from circuitkit.files import check_writable_dir, holds_lock, lock_folder, sha256_file, write_text
from circuitkit.models import configure_threads, hf_progress, shipped_path
from circuitkit.tasks import load_task
from circuitkit.tasks.base import word_tokenizer
from circuitkit.training import PRESETS, STATE_FILE, Preset, build_model

RECORD = "distill.json"  # written last: the folder holds a finished student
# one history row per step: the terms, each term's own gradient norm, the factor its
# lambda * gradient entered the step with, the cosine of the CoT and mechanistic parts, the
# step gradient's norm, each term's effective share of the step (loss.balanced_gradients), the
# learning rate, seconds since the start
HISTORY_COLUMNS = ["step", "total", "cot", "p1", "p2", "ns", "gn_cot", "gn_p1", "gn_p2", "gn_ns",
                   "s_p1", "s_p2", "s_ns", "cos", "norm", "sh_p1", "sh_p2", "sh_ns", "lr",
                   "seconds"]
COT_TASKS = ("icd10", "synthetic")  # built-in tasks whose rows hold a <think> ... CoT
# a cooperative stop, for the ablation's workers: a signal handler sets "requested" while
# "training" (the step loop, its Ctrl-C checkpoint included) runs, and the loop stops before its
# next step as on Ctrl-C (an exception raised by a handler can land in a destructor and be lost)
STOP = {"requested": False, "training": False}


@dataclass
class DistillConfig:
    """One student run. ``student``: a ``training.PRESETS`` name or a dict of ``Preset`` fields.
    ``store``: the signal-store folder (default ``<out_dir>/signals``); several runs on one
    teacher, pool and score table share it."""

    teacher: str = "icd-teacher"
    task: str = "icd10"
    task_kw: dict[str, Any] = field(default_factory=dict)
    student: Any = "student"
    lambda_p1: float = 1.0
    lambda_p2: float = 1.0
    lambda_ns: float = 0.0
    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    pool_size: int = 16384
    pool_seed: int = 0
    score_examples: int = 256
    shard_size: int = 1024
    save_every: int = 100
    loss: dict[str, Any] = field(default_factory=dict)  # LossConfig fields
    store: str | None = None
    balance: str = "share"  # loss.BALANCES ("cap" with grad_ratio 0.5: before issue 50)
    init: str | None = None  # start from this HF folder's weights (same preset) instead of fresh
    grad_ratio: float = 0.5  # cap: a term's own gradient counts as <= grad_ratio x the CoT part

    def check(self) -> None:
        for k in ("steps", "batch_size", "pool_size", "score_examples", "shard_size",
                  "save_every"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{k} must be a positive integer, got {getattr(self, k)}.")
        for k in ("lambda_p1", "lambda_p2", "lambda_ns", "weight_decay"):
            v = getattr(self, k)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):  # NaN, inf
                raise ValueError(f"{k} must be a number >= 0 (finite), got {v}.")
        if self.task not in COT_TASKS:
            raise ValueError(f"task {self.task!r}: distillation trains on a task's chain of "
                             f"thought; the built-in CoT tasks are {list(COT_TASKS)}.")
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a number > 0 (finite), got {self.lr}.")
        if self.balance not in BALANCES:
            raise ValueError(f"balance must be one of {list(BALANCES)}, got {self.balance!r}.")
        if not (isinstance(self.grad_ratio, int | float) and math.isfinite(self.grad_ratio)
                and self.grad_ratio > 0):
            raise ValueError(f"grad_ratio must be a number > 0 (finite), got {self.grad_ratio}.")
        bad = set(self.loss) - set(LossConfig.__dataclass_fields__)
        if bad:
            raise ValueError(f"loss options {sorted(bad)} are unknown; LossConfig has "
                             f"{sorted(LossConfig.__dataclass_fields__)}.")
        LossConfig(**self.loss).check()
        preset(self.student)
        if self.init is not None:
            init_folder(self.init)

    def loss_config(self) -> LossConfig:
        return LossConfig(**self.loss)


def preset(student: Any):
    """A ``training.Preset`` from a preset name, a dict of its fields, or a JSON file of them."""
    if isinstance(student, str) and student in PRESETS:
        return PRESETS[student]
    if isinstance(student, (str, Path)) and Path(student).is_file():
        try:
            student = json.loads(Path(student).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"student config file {student} is not JSON ({e}); write a JSON "
                             "object of Preset fields, or name a preset.") from None
    if isinstance(student, dict):
        try:
            return Preset(**student)
        except TypeError as e:
            raise ValueError(f"student config {student} is not a Preset ({e}); fields: "
                             f"{sorted(Preset.__dataclass_fields__)}.") from None
    raise ValueError(f"student={student!r}: expected a preset name ({sorted(PRESETS)}), a dict "
                     "of Preset fields, or a JSON file of them.")


def teacher_scores(teacher: Any, cfg: DistillConfig, folder: Path) -> Any:
    """The teacher's score table, cached in ``folder/scores.csv`` (exact floats); for
    ``heads="causal"`` with ``causal_table``'s noise columns merged in."""
    import pandas as pd

    from circuitkit.scoring.heads import score_heads

    path = folder / "scores.csv"
    causal = cfg.loss_config().heads == "causal"
    old = pd.read_csv(path) if path.exists() else None
    needed = [c for p in (1, 2) for c in signals.causal_columns(p)] if causal else []
    if old is not None and all(c in old.columns for c in needed):
        return old
    task = load_task(cfg.task, n_examples=cfg.score_examples, seed=cfg.pool_seed + 1,
                     split="train", **cfg.task_kw)
    frame = old if old is not None else score_heads(teacher, task, progress=False)
    if causal:  # the causal columns, on the same notes (scoring.causal)
        from circuitkit.scoring.causal import causal_table

        table = causal_table(teacher, task, directions=("noise",))
        frame = frame.merge(table.drop(columns=["name"]), on=["layer", "head"])
    folder.mkdir(parents=True, exist_ok=True)
    write_text(path, frame.to_csv(index=False, float_format="%.17g"))
    return pd.read_csv(path)  # as a later run reads it: one hash for both


def prepare_store(cfg: DistillConfig, out_dir: Path, scores: Any = None, progress: bool = True,
                  overwrite: bool = False):
    """``(store, pool_task)``: the finished signal store of this config (built if needed);
    the teacher is loaded here and released on return. ``overwrite``: a default store
    (``out_dir/signals``) built for another config is deleted and rebuilt (a ``cfg.store`` is
    the caller's: never deleted)."""
    teacher = ck.load_model(cfg.teacher)
    pool = load_task(cfg.task, n_examples=cfg.pool_size, seed=cfg.pool_seed, split="train",
                     **cfg.task_kw)
    if int(teacher.cfg.d_vocab) != len(pool.vocab):  # the student is built on the task's words
        raise ValueError(f"teacher {cfg.teacher!r} has a {teacher.cfg.d_vocab}-token vocabulary "
                         f"but task {cfg.task!r} has {len(pool.vocab)} words: the teacher must be "
                         "a model trained on this task (icd-teacher for icd10; for synthetic, "
                         "train one with circuitkit.training).")
    folder = check_writable_dir(Path(cfg.store) if cfg.store else out_dir / "signals",
                                "signal store folder (--store)")
    lc = cfg.loss_config()
    opts = signals.StoreOptions(top_k1=lc.top_k1, top_k2=lc.top_k2, nonselective=True,
                                topk_logits=lc.topk_logits, shard_size=cfg.shard_size,
                                phase1_reading=lc.phase1_reading, heads=lc.heads)
    for attempt in (0, 1):
        try:
            table = scores if scores is not None else teacher_scores(teacher, cfg, folder)
            store = signals.build_store(teacher, pool, table, folder, opts,
                                        teacher_name=cfg.teacher, progress=progress)
            break
        except signals.StoreProblem:
            if attempt or not (overwrite and cfg.store is None):
                raise
            import shutil

            shutil.rmtree(folder)  # another config's (or a damaged) default store: --overwrite
            check_writable_dir(folder, "signal store folder")
    del teacher
    return store, pool


def build_student(cfg: DistillConfig, vocab: list[str], n_ctx: int):
    """``(hf_model, bridge)``: a fresh student and the bridge that runs it (shared weights)."""
    hf = build_model(preset(cfg.student), len(vocab), n_ctx, cfg.seed)
    if cfg.init is not None:
        load_init(hf, cfg.init)
    bridge = ck.load_model(hf, tokenizer=word_tokenizer(vocab), attn_result=False)
    return hf, bridge


def init_folder(init: str) -> Path:
    """The HF folder ``init`` names: a folder with ``config.json`` and ``model.safetensors``, or
    a shipped model (``icd-student-cot``)."""
    folder = Path(init) if (Path(init) / "config.json").is_file() else shipped_path(str(init))
    if folder is None or not (folder / "model.safetensors").is_file():
        raise ValueError(f"init={init!r}: expected an HF model folder (config.json and "
                         "model.safetensors) or a shipped model name such as icd-student-cot.")
    return folder


def load_init(hf: Any, init: str) -> None:
    """Copy the weights of the HF folder (or shipped model) ``init`` into the fresh student
    ``hf``; refused unless every weight has the student's name and shape."""
    from safetensors.torch import load_file

    weights = load_file(str(init_folder(init) / "model.safetensors"))
    own = hf.state_dict()
    bad = sorted(k for k in set(own) | set(weights)
                 if k not in own or k not in weights or own[k].shape != weights[k].shape)
    if bad:
        raise ValueError(f"init={init!r}: its weights do not fit the student preset (e.g. "
                         f"{bad[:3]}); give a folder of a student of that preset.")
    hf.load_state_dict(weights)


def train_student(cfg: DistillConfig | None = None, out_dir: str | Path = "distill-out",
                  progress: bool = True, resume: bool = True, scores: Any = None,
                  overwrite: bool = False, callback: Any = None, **overrides: Any) -> Path:
    """Train a student (module docstring); returns ``out_dir`` (an HF folder). ``overrides``:
    ``DistillConfig`` fields (``train_student(out_dir=..., lambda_p1=0.5)``). ``progress``:
    this function's bars, and transformers' own (loading the teacher, saving the student).
    ``overwrite``: a finished student or training state of another config in ``out_dir`` is
    deleted first (otherwise refused). ``callback(step, hf_model)``: called after every
    ``save_every``-th step and the last (held-out curves, early stopping: ``experiments.curves``);
    not part of the config, so it never changes what is trained."""
    cfg = cfg or DistillConfig()
    if overrides:
        bad = set(overrides) - set(DistillConfig.__dataclass_fields__)
        if bad:
            raise ValueError(f"train_student got unknown option(s) {sorted(bad)}; DistillConfig "
                             f"has {sorted(DistillConfig.__dataclass_fields__)}.")
        cfg = DistillConfig(**{**asdict(cfg), **overrides})
    cfg.check()
    out = check_writable_dir(out_dir, "out_dir")
    # one run per folder (dead writers' temporaries removed); transformers' bars follow progress
    with (nullcontext() if holds_lock(out) else lock_folder(out, "out_dir")), \
            hf_progress(progress):  # (the CLI's claim may hold the lock already)
        return _train_student(cfg, out, progress, resume, scores, overwrite, callback)


def finished_problem(out: Path, record: dict) -> str:
    """Why a finished folder's student is not intact ("" when it is): a file listed in
    ``distill.json`` is missing or differs from its recorded SHA-256."""
    sums = record.get("files")
    if not isinstance(sums, dict) or not sums:
        return f"{out / RECORD} lists no student files (an older circuitkit wrote it)"
    for name, digest in sums.items():
        if not (out / name).is_file():
            return f"{out / name} is missing"
        if sha256_file(out / name) != digest:
            return f"{out / name} was modified (its SHA-256 differs from {RECORD}'s)"
    return ""


def _clear(out: Path, record: dict | None) -> None:
    """Delete a finished student (the files ``distill.json`` lists, then it) and the training
    state: ``overwrite``."""
    (out / RECORD).unlink(missing_ok=True)  # first: the folder no longer claims a student
    listed = (record or {}).get("files")
    for name in listed if isinstance(listed, dict) else {}:
        if isinstance(name, str) and Path(name).name == name and name not in (
                ".", "..", STATE_FILE) and (out / name).is_file():
            (out / name).unlink()
    (out / STATE_FILE).unlink(missing_ok=True)


def _read_record(out: Path) -> dict | None:
    path = out / RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is unreadable ({e}); delete it (and the student files beside "
                         "it) or pass --overwrite to train this folder's student again.") from None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise ValueError(f"{path} holds no distillation config; delete it or pass --overwrite.")
    return record


def _config_diff(stored: dict, now: dict) -> str:
    return ", ".join(f"{k}: {stored.get(k)!r} -> {now.get(k)!r}" for k in sorted(
        set(stored) | set(now)) if stored.get(k) != now.get(k))


def _train_student(cfg: DistillConfig, out: Path, progress: bool, resume: bool, scores: Any,
                   overwrite: bool, callback: Any = None) -> Path:
    configure_threads()
    config = json.loads(json.dumps(asdict(cfg), default=str))
    finished, stored = _kept_state(out, config, resume, overwrite, progress)
    if finished:
        return out
    store, pool = prepare_store(cfg, out, scores, progress, overwrite)
    run = _Training.start(cfg, config, out / STATE_FILE, store, pool.vocab, stored)
    run.train(progress, callback)
    files_ = save_student(run.hf, cfg, pool.vocab, run.n_ctx, out)
    write_text(out / RECORD, json.dumps(dict(
        config=config, train_seconds=round(run.elapsed, 1), history=run.history,
        history_columns=HISTORY_COLUMNS,
        store=str(store.path), teacher_fingerprint=store.manifest["teacher_fingerprint"],
        scores_hash=store.manifest["scores_hash"], torch=torch.__version__, files=files_),
        indent=1))
    return out


def _kept_state(out: Path, config: dict, resume: bool, overwrite: bool, progress: bool
                ) -> tuple[bool, dict | None]:
    """What ``out`` holds for ``config``: ``(True, None)``, its finished student, intact (nothing to
    do); else ``(False, state)``: the training state to resume from (None: start afresh). Another
    config's student or state (or an unreadable ``distill.json``) is deleted with ``overwrite``,
    else refused; a damaged student is trained again, from its state where one is kept."""
    state_path = out / STATE_FILE
    try:
        record = _read_record(out)
    except ValueError:
        if not overwrite:
            raise
        _clear(out, None)  # an unreadable distill.json: --overwrite starts over
        record = None
    if record is not None and record["config"] != config:
        if not overwrite:
            raise ValueError(f"{out} holds a finished student of another distillation config "
                             f"({_config_diff(record['config'], config)}); pass --overwrite "
                             "(overwrite=True) to replace it, or choose another --out.")
        _clear(out, record)
        record = None
    if record is not None and resume:
        problem = finished_problem(out, record)
        if not problem:
            if progress:
                print(f"{out} already holds this student (distill.json and its files verify); "
                      "nothing to do.", file=sys.stderr)
            return True, None
        how = ("rewriting it from the kept training state" if state_path.exists() else
               "training it again (no training state kept)")
        warnings.warn(f"circuitkit: finished student in {out} is damaged ({problem}); {how}.",
                      stacklevel=4)  # (the caller of train_student)
    stored = training.load_train_state(state_path) if resume and state_path.exists() else None
    if stored is not None and stored["config"] != config:
        if not overwrite:
            raise ValueError(f"{state_path} belongs to a different distillation config "
                             f"({_config_diff(stored['config'], config)}); pass --overwrite "
                             "(overwrite=True) to start over, or use another out_dir.")
        _clear(out, record)
        stored = None
    return False, stored


@dataclass
class _Training:
    """One student's training (module docstring): the HF model ``hf`` and the bridge
    ``student`` that runs it (shared weights, ``n_ctx`` positions, words ``vocab``), AdamW
    ``opt`` and its schedule ``sched`` over ``params``, the batches ``stream``, the
    teacher's heads and anchors from the store and the ``loss`` options; ``step``,
    ``elapsed`` seconds and ``history`` (``HISTORY_COLUMNS`` rows) so far, and the step of
    the training state on disk at ``state_path`` (``saved``; 0: none)."""

    cfg: DistillConfig
    config: dict
    state_path: Path
    hf: Any
    student: Any
    vocab: list[str]
    n_ctx: int
    params: list[torch.Tensor]
    opt: Any
    sched: Any
    stream: signals.BatchStream
    teacher_pool: signals.Pooling
    anchors: signals.Anchors
    loss: LossConfig
    step: int = 0
    elapsed: float = 0.0
    history: list = field(default_factory=list)
    saved: int = 0

    @classmethod
    def start(cls, cfg: DistillConfig, config: dict, state_path: Path, store: Any,
              vocab: list[str], stored: dict | None) -> _Training:
        """A fresh student (``build_student``) for rows of ``store``'s width, at ``stored``'s
        step, weights, optimiser and schedule when given."""
        n_ctx = training.context_length(max(s["width"] for s in store.manifest["shards"]))
        hf, student = build_student(cfg, vocab, n_ctx)
        params = [p for p in hf.parameters() if p.requires_grad]
        opt, sched = training.optimizer(params, cfg)
        run = cls(cfg, config, state_path, hf, student, vocab, n_ctx, params, opt, sched,
                  signals.BatchStream(store, cfg.batch_size, cfg.seed), store.pooling(),
                  store.anchors, cfg.loss_config())
        if stored is not None:
            run.step, run.elapsed, run.history = training.restore(stored, hf, opt, sched)
        run.saved = run.step
        return run

    def checkpoint(self) -> None:
        """Save the training state (never replacing a good one with weights holding NaN/inf:
        refused, naming the last good one)."""
        bad = non_finite_parameters(self.hf)
        if bad:  # never replace a good state with a broken one
            raise ValueError(_diverged(self.step, self.cfg, f"weights {bad[:3]} hold NaN/inf",
                                       self.saved, self.state_path))
        training.save_train_state(self.state_path, dict(
            config=self.config, model=self.hf.state_dict(), opt=self.opt.state_dict(),
            sched=self.sched.state_dict(), step=self.step, elapsed=self.elapsed,
            history=self.history))
        self.saved = self.step

    def take_step(self, t0: float) -> dict[str, torch.Tensor]:
        """One step on batch ``step`` of the stream: the terms of
        ``L_CoT + lambda_P1 L_P1 + lambda_P2 L_P2 + lambda_NS L_NS`` (``student_terms``), their
        gradients combined by ``balanced_gradients``, AdamW and the schedule; its history row.
        A non-finite loss or gradient stops the run before anything of the step is applied."""
        cfg = self.cfg
        terms = student_terms(self.student, self.stream[self.step], self.teacher_pool, self.anchors,
                              self.loss, cfg.lambda_p1, cfg.lambda_p2, cfg.lambda_ns)
        if not bool(torch.isfinite(terms["total"].detach())):
            raise ValueError(_diverged(self.step + 1, cfg, "the loss is not finite ("
                                       + _terms(terms) + ")", self.saved, self.state_path))
        self.opt.zero_grad(set_to_none=True)
        lambdas = dict(p1=cfg.lambda_p1, p2=cfg.lambda_p2, ns=cfg.lambda_ns)
        g = balanced_gradients(terms, lambdas, self.params, cfg.balance, cfg.grad_ratio)
        if not math.isfinite(g["norm"]):  # before opt.step: nothing of it is applied
            raise ValueError(_diverged(self.step + 1, cfg, f"the gradient is not finite (norm "
                                       f"{g['norm']}; {_terms(terms)})", self.saved,
                                       self.state_path))
        lr = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.step += 1
        self.elapsed = time.perf_counter() - t0
        self.history.append([self.step] + [round(float(terms[k].detach()), 5)
                                           for k in ("total", "cot", "p1", "p2", "ns")]
                            + [round(g[k], 5) for k in HISTORY_COLUMNS[6:-2]]
                            + [float(f"{lr:.6g}"), round(self.elapsed, 1)])
        return terms

    def train(self, progress: bool, callback: Any) -> None:
        """Steps up to ``cfg.steps``: the training state saved every ``save_every`` steps, on
        Ctrl-C (or a cooperative ``STOP``) and at the end; ``callback(step, plain model)``
        after every ``save_every``-th step and the last."""
        from circuitkit._progress import tqdm

        cfg = self.cfg
        self.student.train()
        name = "cot" if not (cfg.lambda_p1 or cfg.lambda_p2 or cfg.lambda_ns) else \
            f"p1={cfg.lambda_p1:g} p2={cfg.lambda_p2:g}" + (f" ns={cfg.lambda_ns:g}"
                                                            if cfg.lambda_ns else "")
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not progress, desc=f"distill {name}")
        t0 = time.perf_counter() - self.elapsed
        STOP["training"] = True
        try:
            while self.step < cfg.steps:
                if STOP["requested"]:
                    raise KeyboardInterrupt
                terms = self.take_step(t0)
                step = self.step
                if step % 25 == 0 or step == cfg.steps:
                    bar.set_postfix({k: f"{float(terms[k].detach()):.3f}"
                                     for k in ("cot", "p1", "p2", "ns")})
                bar.update(1)
                if step % cfg.save_every == 0 and step < cfg.steps:
                    self.checkpoint()
                if callback is not None and (step % cfg.save_every == 0 or step == cfg.steps):
                    # after the checkpoint (a resumed run re-measures nothing), on a plain copy:
                    # the bridge-wrapped model does not generate what its weights predict
                    callback(step, plain_model(self.hf, cfg, self.vocab, self.n_ctx))
        except KeyboardInterrupt:
            self.checkpoint()
            print(f"\ninterrupted at step {self.step}; run the same command again to resume "
                  f"from {self.state_path}")
            raise
        finally:
            STOP["training"] = False
        bar.close()
        self.student.eval()
        if self.saved != self.step:
            self.checkpoint()  # the final state is kept: a rerun of this config is a no-op


def _terms(terms: dict) -> str:
    return ", ".join(f"{k} {float(terms[k].detach()):.4g}" for k in ("total", "cot", "p1", "p2",
                                                                      "ns") if k in terms)


def _diverged(step: int, cfg: DistillConfig, what: str, saved: int, state: Path) -> str:
    kept = (f"the last good training state (step {saved}) is kept in {state}" if saved else
            "no training state was saved before it")
    return (f"distillation stopped at step {step} of {cfg.steps}: {what}; nothing of this step "
            f"was applied and no student was saved ({kept}). Lower the learning rate (lr "
            f"{cfg.lr:g}) or the lambdas (p1 {cfg.lambda_p1:g}, p2 {cfg.lambda_p2:g}, ns "
            f"{cfg.lambda_ns:g}), check the signal store, and rerun with --overwrite (or "
            "another --out).")


def plain_model(hf: Any, cfg: DistillConfig, vocab: list[str], n_ctx: int) -> Any:
    """A fresh HF model of the student's preset holding ``hf``'s weights (copies, eval mode):
    what ``save_student`` writes and what a training callback measures."""
    fresh = build_model(preset(cfg.student), len(vocab), n_ctx, cfg.seed)
    params = signals.plain_parameters(hf)
    missing = fresh.load_state_dict({k: v.detach().clone() for k, v in params.items()},
                                    strict=False)
    if missing.missing_keys or missing.unexpected_keys:
        raise AssertionError(f"student weights do not map onto a fresh model: {missing}")
    return fresh.eval()


def save_student(hf: Any, cfg: DistillConfig, vocab: list[str], n_ctx: int,
                 out: Path) -> dict[str, str]:
    """The trained weights as a plain HF folder (a fresh model of the same preset holding them:
    the bridge-wrapped model's own ``save_pretrained`` would write wrapper names). Returns
    ``{file name: SHA-256}`` of the files written. Refuses (``ValueError``) weights holding
    NaN or inf: a broken student is never saved."""
    from circuitkit.files import write_files_into

    fresh = plain_model(hf, cfg, vocab, n_ctx)
    bad = non_finite_parameters(fresh)
    if bad:
        raise ValueError(f"student weights {bad[:3]} hold NaN/inf: not saved to {out}.")
    names: list[str] = []

    def final(folder: Path) -> None:
        fresh.save_pretrained(folder)
        word_tokenizer(vocab, str(folder))
        names.extend(sorted(f.name for f in folder.iterdir()))

    write_files_into(out, final)
    return {name: sha256_file(out / name) for name in names}
