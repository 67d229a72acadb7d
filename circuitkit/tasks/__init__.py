"""Tasks: token sequences with positions and labels (``Task``/``Example``) and built-in generators.

``load_task(name, n_examples, seed, split, phase, **kw)`` dispatches to a builder module; each
builder module exposes ``build(n_examples, seed, split, phase, **kw) -> Task``.
"""

from __future__ import annotations

import importlib
from typing import Any

from circuitkit.tasks.base import Example, Task, word_tokenizer

BUILDERS = {
    "icd10": "circuitkit.tasks.icd10",
    "synthetic": "circuitkit.tasks.synthetic",
    "induction": "circuitkit.tasks.induction",
}


def load_task(
    name: str,
    n_examples: int = 256,
    seed: int = 0,
    split: str = "train",
    phase: int = 2,
    **kw: Any,
) -> Task:
    """Build a task by name ("icd10", "synthetic", "induction") or load a JSONL file path.

    ``split="test"`` draws examples held out from ``"train"`` (disjoint generator streams).
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    if phase not in (1, 2):
        raise ValueError(f"phase must be 1 (anchors) or 2 (shortlist/answer), got {phase!r}.")
    if name.endswith(".jsonl"):
        return Task.from_jsonl(name).with_phase(phase)
    if name not in BUILDERS:
        raise ValueError(
            f"Unknown task {name!r}; built-in tasks: {sorted(BUILDERS)}, or a path to a .jsonl "
            f"file (see Task.from_jsonl for the schema)."
        )
    module = importlib.import_module(BUILDERS[name])
    return module.build(n_examples=n_examples, seed=seed, split=split, phase=phase, **kw)


__all__ = ["Example", "Task", "load_task", "word_tokenizer"]
