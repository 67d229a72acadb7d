"""Held-out evaluation during training: the baseline's early stopping and learning curves
(docs/distill.md, the issue-35 grid).

``train_student(..., callback=fn)`` calls ``fn(step, hf)`` at every checkpoint step, ``hf`` a
plain copy of the student (``train.plain_model``). ``HeldoutLoss``: the CoT loss ``mean CE(tokens[p]
| logits[p-1])`` over a held-out signal store's CoT rows (``heldout_loss``), whose lowest point is
the grid's S* (``best_step``). ``Curve``: exact match, Macro-F1, output-level confusion,
focus, per-step focus and sibling confusion on a small held-out task (``task_point``). Each
writes its points to ``curve.json`` (``[{"step": s, ...}, ...]``) as it goes, so a resumed run
keeps them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from circuitkit import evaluation as ev
from circuitkit.files import write_json
from circuitkit.training import lm_loss

CURVE = "curve.json"


def _points(folder: Path) -> list[dict[str, Any]]:
    path = folder / CURVE
    return json.loads(path.read_text()) if path.exists() else []


def best_step(points: list[dict[str, Any]], key: str = "heldout_loss") -> int:
    """S*: the step of the lowest ``key`` (the earliest of equal ones); refused when empty."""
    pts = [p for p in points if p.get(key) == p.get(key)]  # NaN-free
    if not pts:
        raise ValueError("no held-out points to choose a step from: the early-stopping run "
                         "recorded none (its save_every exceeds its steps?).")
    return int(min(pts, key=lambda p: (p[key], p["step"]))["step"])


@torch.no_grad()
def heldout_loss(hf: Any, store: Any, batch_size: int = 64) -> float:
    """Example-weighted mean of ``training.lm_loss`` over the store's CoT rows (module
    docstring); ``hf``: a causal LM returning ``.logits`` [b, s, V]."""
    total, n = 0.0, 0
    for i, shard in enumerate(store.manifest["shards"]):
        for s in range(0, shard["n_examples"], batch_size):
            idx = list(range(s, min(s + batch_size, shard["n_examples"])))
            b = store.batch(i, idx)
            total += float(lm_loss(hf(b.tokens).logits, b.tokens, b.mask)) * len(idx)
            n += len(idx)
    return total / max(n, 1)


def decode(hf: Any, task: Any) -> list[list[int]]:
    """The model's greedy continuations of ``task``'s prompts, ``evaluate``'s length."""
    prompts, new = ev.task_prompts(task)
    return ev.greedy_decode_cached(hf, prompts, task.eos_id, new, task.pad_id)


@torch.no_grad()
def task_point(hf: Any, task: Any, batch_size: int = 64) -> dict[str, float]:
    """``exact_match``, ``macro_f1``, ``confusion_rate`` (free generation), ``focus``,
    ``focus_per_step``, ``confusion`` (teacher-forced) of ``hf`` on ``task`` (module docstring),
    and the embedding Focus / Confusion when the evaluation returns them (the lambda sweep
    chooses its weight on each of these definitions: issue 50)."""
    sets = ev.task_set_metrics(decode(hf, task), task)
    out = {k: float(sets[k]) for k in ("exact_match", "macro_f1", "confusion_rate",
                                       "focus_embedding", "confusion_embedding") if k in sets}
    return dict(out, **teacher_forced(hf, task, batch_size))


@torch.no_grad()
def teacher_forced(hf: Any, task: Any, batch_size: int = 64) -> dict[str, float]:
    """``focus``, ``focus_per_step`` and ``confusion`` of ``hf`` on ``task``'s own tokens
    (``evaluation.focus_from_logits`` / ``focus_per_step_from_logits`` /
    ``confusion_from_logits``, example means), ``batch_size`` notes per forward."""
    parts: dict[str, list[torch.Tensor]] = {"focus": [], "focus_per_step": [], "confusion": []}
    for s in range(0, len(task), batch_size):
        sub = task.subset(range(s, min(s + batch_size, len(task))))
        logits = hf(sub.clean_tokens).logits
        parts["focus"].append(ev.focus_from_logits(logits, sub))
        parts["focus_per_step"].append(ev.focus_per_step_from_logits(logits, sub))
        parts["confusion"].append(ev.confusion_from_logits(logits, sub))
    return {k: float(torch.cat(v).nanmean()) for k, v in parts.items()}


class _Callback:
    """A ``train_student`` callback writing one ``curve.json`` point per call (a step already
    there, from before a resume, is not measured again); the model is put in eval mode for the
    measurement and back in train mode after it (dropout-free presets: no effect on training)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def measure(self, hf: Any) -> dict[str, float]:
        raise NotImplementedError

    def __call__(self, step: int, hf: Any) -> None:
        points = _points(self.folder)
        if any(p["step"] == step for p in points):
            return
        hf.eval()
        try:
            points.append(dict(step=step, **self.measure(hf)))
        finally:
            hf.train()
        write_json(self.folder / CURVE, sorted(points, key=lambda p: p["step"]))


class HeldoutLoss(_Callback):
    def __init__(self, folder: str | Path, store: Any):
        super().__init__(folder)
        self.store = store

    def measure(self, hf: Any) -> dict[str, float]:
        return dict(heldout_loss=heldout_loss(hf, self.store))


class Curve(_Callback):
    def __init__(self, folder: str | Path, task: Any):
        super().__init__(folder)
        self.task = task

    def measure(self, hf: Any) -> dict[str, float]:
        return task_point(hf, self.task)
