"""Plain clean/corrupt prompt pairs (IOI-style, no chain-of-thought schema) from a JSONL file.

One JSON object a line, no header (docs/from-transformerlens.md, "A plain clean/corrupt
dataset")::

    {"clean": "t3 t7 t9 t3", "corrupt": "t3 t8 t9 t3", "answer": "t7", "wrong": "t8"}

``clean``/``corrupt``: a string (tokenized as ``model.to_tokens`` does, BOS included where the
model prepends one) or a list of token ids (used as given); one row's two prompts must have the
same token count. ``answer``/``wrong``: one token each (a string that is a single token, or a
token id). The metric is IOI's logit difference, ``logit[answer] - logit[wrong]`` at each
prompt's last token, mean over prompts. Rows of different lengths are right-padded; the metric
reads each prompt at its own last token, never at the padding.

``read_pairs`` checks the file's structure without a model (every bad row reported together,
``path:line: reason``); ``pairs_inputs`` tokenizes the rows for a model; ``load_pairs`` does both.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

PROMPT_FIELDS = ("clean", "corrupt")
TOKEN_FIELDS = ("answer", "wrong")
FIELDS = (*PROMPT_FIELDS, *TOKEN_FIELDS, "meta")


def _first_object(path: str | Path) -> Any:
    """The first non-blank line of ``path`` parsed as JSON, or None (unreadable, not JSON)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            for line in f:
                if line.strip():
                    return json.loads(line)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return None


def is_pairs_file(path: str | Path) -> bool:
    """Whether ``path`` is a pairs file: its first line is an object with ``clean`` or
    ``corrupt`` (a task file's first line is its header, with ``vocab``)."""
    head = _first_object(path)
    return isinstance(head, dict) and ("clean" in head or "corrupt" in head) \
        and "vocab" not in head


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x)


def _row_problems(row: Any) -> list[str]:
    if not isinstance(row, dict):
        return ["row is not a JSON object"]
    bad = [f"missing field {k!r}" for k in (*PROMPT_FIELDS, *TOKEN_FIELDS) if k not in row]
    unknown = sorted(set(row) - set(FIELDS))
    if unknown:  # a typo would otherwise be dropped silently
        bad.append(f"unknown field(s) {unknown}; known: {list(FIELDS)} (free-form data goes "
                   "in 'meta')")
    for k in PROMPT_FIELDS:
        if k in row and not (isinstance(row[k], str) and row[k].strip() or _is_ids(row[k])):
            bad.append(f"{k!r} must be a non-empty string or a list of token ids")
    for k in TOKEN_FIELDS:
        v = row.get(k)
        if k in row and not (isinstance(v, str) and v or
                             isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            bad.append(f"{k!r} must be one token: a string or a token id")
    if not bad and type(row["clean"]) is not type(row["corrupt"]):
        bad.append("'clean' and 'corrupt' must both be strings or both token ids")
    return bad


def read_pairs(path: str | Path, n_examples: int | None = None) -> list[dict[str, Any]]:
    """The rows of a pairs file (the first ``n_examples``; None: all), each checked for its
    fields and their types (no model needed). Every bad row is reported in one ``ValueError``."""
    path = str(path)
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read pairs file {path}: {e}") from None
    from circuitkit.tasks.jsonl import checked_lines, problems

    rows, errors = checked_lines(lines, 1, path, _row_problems)
    if errors:  # (the first few, the rest counted)
        raise ValueError(problems(errors, path))
    if not rows:
        raise ValueError(f"{path} holds no pairs; write one JSON object a line: "
                         '{"clean": ..., "corrupt": ..., "answer": ..., "wrong": ...}.')
    if n_examples is not None:
        if n_examples > len(rows):
            raise ValueError(f"n_examples={n_examples} is more than the {len(rows)} pairs in "
                             f"{path}; ask for at most {len(rows)}, or leave it out for all.")
        rows = rows[:n_examples]
    return [dict(r, _line=lineno) for lineno, r in rows]


@dataclass
class Pairs:
    """Clean/corrupt prompt pairs ready for ``ck.patch_heads``: ``clean_tokens`` and
    ``corrupt_tokens`` ``[batch, seq]`` (right-padded), ``metric`` the logit difference at each
    prompt's last token (``last_positions [batch]``), ``answer_tokens``/``wrong_tokens``
    ``[batch]``."""

    name: str
    clean_tokens: Tensor
    corrupt_tokens: Tensor
    answer_tokens: Tensor
    wrong_tokens: Tensor
    last_positions: Tensor
    metric: Any
    phase: None = None  # no CoT phases: what a Task's phase is, for the commands that print it

    def __len__(self) -> int:
        return len(self.clean_tokens)

    def fingerprint(self) -> str:
        """Short hash of the tokens and answers (as ``Task.fingerprint``: ties a result or a
        checkpoint to its inputs)."""
        h = hashlib.sha256(json.dumps(["pairs", self.name]).encode())
        for t in (self.clean_tokens, self.corrupt_tokens, self.answer_tokens, self.wrong_tokens):
            h.update(t.numpy().tobytes())
        return h.hexdigest()[:16]


def _tokens(model: Any, text: str) -> list[int]:
    """``model.to_tokens(text)`` (TransformerLens's own: BOS as the model prepends it), or the
    tokenizer's ids for a model without it (nnsight's)."""
    if hasattr(model, "to_tokens"):
        return model.to_tokens(text)[0].tolist()
    return list(model.tokenizer(text)["input_ids"])


def _one_token(model: Any, value: str | int, where: str, d_vocab: int) -> int:
    if isinstance(value, int):
        tok = value
    else:
        tok_ids = model.tokenizer(value, add_special_tokens=False)["input_ids"]
        if len(tok_ids) != 1:
            raise ValueError(f"{where}: {value!r} is {len(tok_ids)} tokens for this model's "
                             "tokenizer; it must be one (mind a leading space), or give a token "
                             "id.")
        tok = tok_ids[0]
    if not 0 <= tok < d_vocab:
        raise ValueError(f"{where}: token id {tok} is outside the model's vocabulary "
                         f"[0, {d_vocab}).")
    return tok


def pairs_inputs(rows: list[dict[str, Any]], model: Any, name: str = "pairs") -> Pairs:
    """``Pairs`` of ``read_pairs`` rows for ``model`` (its tokenizer and vocabulary size). A
    row whose prompts differ in token count, or whose answer is not one token, is refused
    (every such row in one ``ValueError``)."""
    from circuitkit import hooks
    from circuitkit.metrics import at_answers

    d_vocab = hooks.facts(model).d_vocab
    clean, corrupt, answer, wrong, errors = [], [], [], [], []
    for row in rows:
        where = f"{name}:{row.get('_line', '?')}"
        try:
            c, x = ((row[k] if isinstance(row[k], list) else _tokens(model, row[k]))
                    for k in PROMPT_FIELDS)
            if len(c) != len(x):
                raise ValueError(f"{where}: clean is {len(c)} tokens and corrupt {len(x)}; a "
                                 "pair must have the same token count (patching swaps "
                                 "activations position by position).")
            if max(c + x) >= d_vocab:
                raise ValueError(f"{where}: token id {max(c + x)} is outside the model's "
                                 f"vocabulary [0, {d_vocab}).")
            a, w = (_one_token(model, row[k], f"{where}: {k!r}", d_vocab) for k in TOKEN_FIELDS)
        except ValueError as e:
            errors.append(str(e))
            continue
        clean.append(c), corrupt.append(x), answer.append(a), wrong.append(w)
    if errors:
        raise ValueError(f"{len(errors)} problem(s) in {name}:\n" + "\n".join(errors))
    tok = getattr(model, "tokenizer", None)
    pad = getattr(tok, "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    width = max(len(c) for c in clean)
    pad_to = lambda seqs: torch.tensor([s + [pad] * (width - len(s)) for s in seqs])  # noqa: E731
    last = torch.tensor([len(c) - 1 for c in clean])
    answer_t, wrong_t = torch.tensor(answer), torch.tensor(wrong)

    def logit_diff(step: Tensor, a: Tensor, w: Tensor) -> Tensor:
        """``step [b, 1, vocab]`` at each prompt's last token -> ``[b]``."""
        at = step[:, 0]
        return at.gather(-1, a[:, None])[:, 0] - at.gather(-1, w[:, None])[:, 0]

    metric = at_answers(logit_diff, last, answer_t, wrong_t, name="logit_diff")
    return Pairs(name, pad_to(clean), pad_to(corrupt), answer_t, wrong_t, last, metric)


def load_pairs(path: str | Path, model: Any, n_examples: int | None = None) -> Pairs:
    """``Pairs`` of a pairs file for ``model`` (``read_pairs`` then ``pairs_inputs``)."""
    return pairs_inputs(read_pairs(path, n_examples), model, name=str(path))
