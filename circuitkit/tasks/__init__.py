"""Tasks: token sequences with positions and labels (``Task``/``Example``) and built-in generators.

``load_task(name, n_examples, seed, split, phase, **kw)`` dispatches to a builder module; each
builder module exposes ``build(n_examples, seed, split, phase, **kw) -> Task``.
"""

from __future__ import annotations

import importlib
import numbers
from pathlib import Path
from typing import Any

from circuitkit.tasks.base import Example, Task, word_tokenizer

BUILDERS = {
    "icd10": "circuitkit.tasks.icd10",
    "synthetic": "circuitkit.tasks.synthetic",
    "induction": "circuitkit.tasks.induction",
    "capitals": "circuitkit.tasks.capitals",
}
# Built-in tasks written as text for a model's own tokenizer (``load_task(name, tokenizer=...)``:
# a tokenizer or a model name); the CLI and ``scoring.text.load_for`` pass the model's.
TOKENIZER_TASKS = ("capitals",)


def load_task(name: str | Path, n_examples: int | None = None, seed: int = 0,
              split: str = "train", phase: int | None = None, **kw: Any) -> Task:
    """Build a task by name ("icd10", "synthetic", "induction", "capitals") or load a JSONL file
    path. ``capitals`` is text for a pretrained LLM: ``tokenizer=`` (an HF tokenizer or a model
    name; default SmolLM2-135M's) (``circuitkit.tasks.capitals``).

    ``split="test"`` draws examples held out from ``"train"`` (disjoint generator streams).
    ``n_examples``: notes to build (default 256); for a JSONL file, its first ``n_examples``
    rows (default all; ``seed`` and ``split`` do not apply to a file). ``phase``: 1 or 2
    (default 2; for a file, the phase its header names). icd10 and synthetic take
    ``corruption=``: "note" (default), "anchor", "shortlist-swap", "shortlist-sibling", or
    one of each phase joined by a comma (``circuitkit.corruptions``).
    """
    name = str(name)
    if n_examples is not None and (not isinstance(n_examples, int) or n_examples < 1):
        raise ValueError(f"n_examples must be a positive integer (or None); got {n_examples!r}.")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) \
            or not -2**63 <= int(seed) < 2**63:
        raise ValueError(f"seed must be an integer in [-2**63, 2**63); got {seed!r}.")
    seed = int(seed)
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    if phase not in (None, 1, 2):
        raise ValueError(f"phase must be 1 (anchors) or 2 (shortlist/answer), got {phase!r}.")
    if kw.get("corruption", "note") != "note" and name not in ("icd10", "synthetic"):
        raise ValueError(f"corruption={kw['corruption']!r}: the chain-of-thought corruptions "
                         f"are built for icd10 and synthetic, not {name!r} (a .jsonl holds its "
                         "own corrupt_tokens); leave corruption out.")
    if name.endswith(".jsonl"):
        task = Task.from_jsonl(name)
        if n_examples is not None:
            if n_examples > len(task):
                raise ValueError(f"n_examples={n_examples} is more than the {len(task)} examples "
                                 f"in {name}; ask for at most {len(task)}, or leave it out for "
                                 "all of them.")
            task = task.subset(range(n_examples))
        return task if phase is None else task.with_phase(phase)  # None: the file's phase
    if name not in BUILDERS:
        raise ValueError(
            f"Unknown task {name!r}; built-in tasks: {sorted(BUILDERS)}, or a path to a .jsonl "
            f"file (see Task.from_jsonl for the schema)."
            + (f" {name} exists: a task file needs the .jsonl extension." if Path(name).is_file()
               else "")
        )
    module = importlib.import_module(BUILDERS[name])
    return module.build(n_examples=256 if n_examples is None else n_examples, seed=seed,
                        split=split, phase=2 if phase is None else phase, **kw)


__all__ = ["Example", "TOKENIZER_TASKS", "Task", "load_task", "word_tokenizer"]
