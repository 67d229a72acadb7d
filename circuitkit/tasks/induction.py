"""Induction task: ``<bos> A A`` where A is a random token segment.

The second copy is predictable only by induction (attend to the token after the previous
occurrence of the current token). The corrupt run resamples the first copy only
(``<bos> B A``), so the second copy can no longer be predicted; the default metric is the mean
log-prob of the correct next token over the second copy (``answer_pos``), which, unlike a logit
difference, rises only when the correct prediction is restored.
"""

from __future__ import annotations

import torch

from circuitkit.tasks.base import SPECIAL_TOKENS, Example, Task

SPLIT_SEED_OFFSET = {"train": 0, "test": 1_000_003}


def vocabulary(vocab_size: int) -> list[str]:
    return SPECIAL_TOKENS + [f"t{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]


def build(n_examples: int = 256, seed: int = 0, split: str = "train", phase: int = 2,
          seg_len: int | tuple[int, int] = (6, 15), vocab_size: int = 64,
          unique: bool = True) -> Task:
    """``n_examples`` sequences ``<bos> A A`` over ``vocab_size`` tokens, right-padded.

    ``seg_len``: length of A, or a (min, max) range drawn per example. A varying length matters:
    with one fixed length a model can "copy" by attending at a fixed relative offset (rotary)
    instead of forming previous-token and induction heads.

    ``unique``: segments have no repeated token (each "previous occurrence" is unique); with
    ``unique=False`` tokens are drawn with replacement, which rewards a sharp previous-token head.
    ``answer_pos`` = second-copy positions except its first token (the predictable ones);
    ``evidence_pos`` = first-copy positions.
    """
    vocab = vocabulary(vocab_size)
    n_special = len(SPECIAL_TOKENS)
    n_plain = vocab_size - n_special
    lo, hi = (seg_len, seg_len) if isinstance(seg_len, int) else seg_len
    if not 2 <= lo <= hi <= n_plain:
        raise ValueError(f"seg_len={seg_len} must lie in [2, {n_plain}] (plain vocab tokens).")
    g = torch.Generator().manual_seed(seed + SPLIT_SEED_OFFSET[split])
    examples = []
    for _ in range(n_examples):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        a, b = (_segment(n_plain, n, unique, g) + n_special for _ in range(2))
        bos = torch.tensor([1])
        clean = torch.cat([bos, a, a])
        corrupt = torch.cat([bos, b, a])
        first = list(range(1, 1 + n))
        second = list(range(2 + n, 1 + 2 * n))
        examples.append(Example(
            tokens=clean, corrupt_tokens=corrupt, evidence_pos=first, anchor_pos=[],
            shortlist_pos=[], answer_pos=second, targets=(clean[second] - n_special).tolist(),
            near_misses=[], anchors=[]))
    labels = vocab[n_special:]
    return Task(
        name="induction", examples=examples, label_names=labels, anchor_names=[],
        label_token_ids=torch.arange(n_special, vocab_size), anchor_token_ids=torch.zeros(0,
        dtype=torch.long), label_anchor=torch.zeros(len(labels), dtype=torch.long), vocab=vocab,
        phase=phase, config=dict(  # a range as a list: what a JSONL round trip gives back
            name="induction", seg_len=seg_len if isinstance(seg_len, int) else [lo, hi],
            vocab_size=vocab_size, unique=unique, seed=seed, split=split, metric="logprob"))


def _segment(n: int, length: int, unique: bool, g: torch.Generator) -> torch.Tensor:
    if unique:
        return torch.randperm(n, generator=g)[:length]
    return torch.randint(0, n, (length,), generator=g)
