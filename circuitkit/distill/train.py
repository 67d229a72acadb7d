"""Train a student on the teacher-signal store: ``L_CoT + lambda_P1 L_P1 + lambda_P2 L_P2``.

``train_student(cfg, out_dir)``:

1. the teacher (``ck.load_model(cfg.teacher)``) is scored (``ck.score_heads`` on ``score_examples``
   train notes, cached as ``scores.csv`` beside the store) and its signals on ``pool_size`` train
   notes are written to the store (``signals.build_store``; resumable; refused on mismatch);
   then the teacher is dropped: training reads the store one shard at a time;
2. the student is a fresh HF ``LlamaForCausalLM`` (``training.build_model``, preset by name or
   fields) run through a ``TransformerBridge`` that wraps it (``ck.load_model(hf_model)``: the
   parameters are the HF model's), so its signals come from the same hook names as the
   teacher's; a CoT-only step (all lambdas 0) reads no hooks;
3. AdamW with linear warm-up and cosine decay, gradient clipping at 1 (as ``training.train``),
   batches from ``signals.BatchStream`` (batch ``i`` depends only on ``(seed, i)``);
4. resumable: every ``save_every`` steps (and on Ctrl-C) ``out_dir/train_state.safetensors``
   (``training.save_train_state``: safetensors + JSON, no pickle) holds model, optimiser,
   scheduler, step and history; the next call with the same config continues from it, and the
   final weights equal an uninterrupted run's bit for bit;
5. the student is saved as a plain HF folder (``save_pretrained`` + the task's tokenizer), loadable
   with ``ck.load_model(out_dir)``, with ``distill.json`` (config, history, time).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from circuitkit.distill.loss import LossConfig, student_terms

STATE_FILE = "train_state.safetensors"
COT_TASKS = ("icd10", "synthetic")  # built-in tasks whose rows hold a <think> ... CoT


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

    def check(self) -> None:
        for k in ("steps", "batch_size", "pool_size", "score_examples", "shard_size",
                  "save_every"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"{k} must be a positive integer, got {getattr(self, k)}.")
        for k in ("lambda_p1", "lambda_p2", "lambda_ns"):
            if not getattr(self, k) >= 0:  # NaN too
                raise ValueError(f"{k} must be a number >= 0, got {getattr(self, k)}.")
        if self.task not in COT_TASKS:
            raise ValueError(f"task {self.task!r}: distillation trains on a task's chain of "
                             f"thought; the built-in CoT tasks are {list(COT_TASKS)}.")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}.")
        bad = set(self.loss) - set(LossConfig.__dataclass_fields__)
        if bad:
            raise ValueError(f"loss options {sorted(bad)} are unknown; LossConfig has "
                             f"{sorted(LossConfig.__dataclass_fields__)}.")
        LossConfig(**self.loss).check()
        preset(self.student)

    def loss_config(self) -> LossConfig:
        return LossConfig(**self.loss)


def preset(student: Any):
    """A ``training.Preset`` from a preset name, a dict of its fields, or a JSON file of them."""
    from circuitkit.training import PRESETS, Preset

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
    """The teacher's score table, cached in ``folder/scores.csv`` (exact floats)."""
    import pandas as pd

    from circuitkit.files import write_text
    from circuitkit.scoring.heads import score_heads
    from circuitkit.tasks import load_task

    path = folder / "scores.csv"
    if path.exists():
        return pd.read_csv(path)
    task = load_task(cfg.task, n_examples=cfg.score_examples, seed=cfg.pool_seed + 1,
                     split="train", **cfg.task_kw)
    frame = score_heads(teacher, task, progress=False)
    folder.mkdir(parents=True, exist_ok=True)
    write_text(path, frame.to_csv(index=False, float_format="%.17g"))
    return pd.read_csv(path)  # as a later run reads it: one hash for both


def prepare_store(cfg: DistillConfig, out_dir: Path, scores: Any = None, progress: bool = True):
    """``(store, pool_task)``: the finished signal store of this config (built if needed);
    the teacher is loaded here and released on return."""
    import circuitkit as ck
    from circuitkit.distill.signals import StoreOptions, build_store
    from circuitkit.files import check_writable_dir
    from circuitkit.tasks import load_task

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
    if scores is None:
        scores = teacher_scores(teacher, cfg, folder)
    lc = cfg.loss_config()
    opts = StoreOptions(top_k1=lc.top_k1, top_k2=lc.top_k2, nonselective=True,
                        topk_logits=lc.topk_logits, shard_size=cfg.shard_size)
    store = build_store(teacher, pool, scores, folder, opts, teacher_name=cfg.teacher,
                        progress=progress)
    del teacher
    return store, pool


def build_student(cfg: DistillConfig, vocab: list[str], n_ctx: int):
    """``(hf_model, bridge)``: a fresh student and the bridge that runs it (shared weights)."""
    import circuitkit as ck
    from circuitkit.tasks.base import word_tokenizer
    from circuitkit.training import build_model

    hf = build_model(preset(cfg.student), len(vocab), n_ctx, cfg.seed)
    bridge = ck.load_model(hf, tokenizer=word_tokenizer(vocab), attn_result=False)
    return hf, bridge


def train_student(cfg: DistillConfig | None = None, out_dir: str | Path = "distill-out",
                  progress: bool = True, resume: bool = True, scores: Any = None,
                  **overrides: Any) -> Path:
    """Train a student (module docstring); returns ``out_dir`` (an HF folder). ``overrides``:
    ``DistillConfig`` fields (``train_student(out_dir=..., lambda_p1=0.5)``). ``progress``:
    this function's bars, and transformers' own (loading the teacher, saving the student)."""
    from circuitkit.models import hf_progress

    with hf_progress(progress):
        return _train_student(cfg, out_dir, progress, resume, scores, **overrides)


def _train_student(cfg: DistillConfig | None, out_dir: str | Path, progress: bool,
                   resume: bool, scores: Any, **overrides: Any) -> Path:
    from tqdm.auto import tqdm

    from circuitkit.distill.signals import BatchStream
    from circuitkit.files import check_writable_dir, write_text
    from circuitkit.models import configure_threads
    from circuitkit.training import load_train_state, save_train_state

    cfg = cfg or DistillConfig()
    if overrides:
        bad = set(overrides) - set(DistillConfig.__dataclass_fields__)
        if bad:
            raise ValueError(f"train_student got unknown option(s) {sorted(bad)}; DistillConfig "
                             f"has {sorted(DistillConfig.__dataclass_fields__)}.")
        cfg = DistillConfig(**{**asdict(cfg), **overrides})
    cfg.check()
    configure_threads()
    out = check_writable_dir(out_dir, "out_dir")
    store, pool = prepare_store(cfg, out, scores, progress)
    width = max(s["width"] for s in store.manifest["shards"])
    n_ctx = max(64, 2 ** math.ceil(math.log2(width + 1)))
    hf, student = build_student(cfg, pool.vocab, n_ctx)
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * s
                                                                          / cfg.steps)))
    stream = BatchStream(store, cfg.batch_size, cfg.seed)
    teacher_pool = store.pooling()
    anchors = store.anchor_token_ids
    lc = cfg.loss_config()
    state_path = out / STATE_FILE
    config = json.loads(json.dumps(asdict(cfg), default=str))
    step, elapsed, history = 0, 0.0, []
    if resume and state_path.exists():
        st = load_train_state(state_path)
        if st["config"] != config:
            raise ValueError(f"{state_path} belongs to a different distillation config; use "
                             "another out_dir or delete it to start over.")
        hf.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, elapsed, history = st["step"], st["elapsed"], st["history"]

    def checkpoint() -> None:
        save_train_state(state_path, dict(config=config, model=hf.state_dict(),
                                          opt=opt.state_dict(), sched=sched.state_dict(),
                                          step=step, elapsed=elapsed, history=history))

    student.train()
    name = "cot" if not (cfg.lambda_p1 or cfg.lambda_p2 or cfg.lambda_ns) else \
        f"p1={cfg.lambda_p1:g} p2={cfg.lambda_p2:g}" + (f" ns={cfg.lambda_ns:g}"
                                                        if cfg.lambda_ns else "")
    bar = tqdm(total=cfg.steps, initial=step, disable=not progress, desc=f"distill {name}")
    t0 = time.perf_counter() - elapsed
    try:
        while step < cfg.steps:
            terms = student_terms(student, stream[step], teacher_pool, anchors, lc,
                                  cfg.lambda_p1, cfg.lambda_p2, cfg.lambda_ns)
            opt.zero_grad(set_to_none=True)
            terms["total"].backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            elapsed = time.perf_counter() - t0
            if step % 25 == 0 or step == cfg.steps:
                history.append([step] + [round(float(terms[k].detach()), 5)
                                         for k in ("total", "cot", "p1", "p2", "ns")]
                               + [round(elapsed, 1)])
                bar.set_postfix({k: f"{float(terms[k].detach()):.3f}"
                                 for k in ("cot", "p1", "p2", "ns")})
            bar.update(1)
            if step % cfg.save_every == 0 and step < cfg.steps:
                checkpoint()
    except KeyboardInterrupt:
        checkpoint()
        print(f"\ninterrupted at step {step}; run the same command again to resume from "
              f"{state_path}")
        raise
    bar.close()
    student.eval()
    save_student(hf, cfg, pool.vocab, n_ctx, out)
    write_text(out / "distill.json", json.dumps(dict(
        config=config, train_seconds=round(elapsed, 1), history=history,
        history_columns=["step", "total", "cot", "p1", "p2", "ns", "seconds"],
        store=str(store.path), teacher_fingerprint=store.manifest["teacher_fingerprint"],
        scores_hash=store.manifest["scores_hash"], torch=torch.__version__), indent=1))
    state_path.unlink(missing_ok=True)  # finished: the HF folder is the artefact
    return out


def save_student(hf: Any, cfg: DistillConfig, vocab: list[str], n_ctx: int, out: Path) -> None:
    """The trained weights as a plain HF folder (a fresh model of the same preset holding them:
    the bridge-wrapped model's own ``save_pretrained`` would write wrapper names)."""
    from circuitkit.distill.signals import plain_parameters
    from circuitkit.files import write_files_into
    from circuitkit.tasks.base import word_tokenizer
    from circuitkit.training import build_model

    fresh = build_model(preset(cfg.student), len(vocab), n_ctx, cfg.seed)
    params = plain_parameters(hf)
    missing = fresh.load_state_dict({k: v.detach() for k, v in params.items()}, strict=False)
    if missing.missing_keys or missing.unexpected_keys:
        raise AssertionError(f"student weights do not map onto a fresh model: {missing}")
    fresh.eval()

    def final(folder: Path) -> None:
        fresh.save_pretrained(folder)
        word_tokenizer(vocab, str(folder))

    write_files_into(out, final)
