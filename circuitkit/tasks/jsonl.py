"""JSONL import/export of a ``Task`` (schema also in docs/jsonl.md).

Line 1, the header (an object)::

    {"format": "circuitkit.task", "version": 1, "name": str, "phase": 1|2,
     "vocab": [str, ...],                      # token id -> token; starts <pad> <bos> <eos> <unk>
     "label_names": [str, ...], "anchor_names": [str, ...],
     "label_token_ids": [int, ...],            # label id -> token id   (len = len(label_names))
     "anchor_token_ids": [int, ...],           # anchor id -> token id  (len = len(anchor_names))
     "label_anchor": [int, ...],               # label id -> anchor id
     "pad_id": 0, "bos_id": 1, "eos_id": 2, "config": {...}}

Then one object per example::

    {"tokens": [int, ...], "corrupt_tokens": [int, ...],            # same length, ids < len(vocab)
     "evidence_pos": [int, ...], "anchor_pos": [...], "shortlist_pos": [...], "answer_pos": [...],
     "targets": [int, ...],                   # label ids, non-empty
     "near_misses": [int, ...], "anchors": [int, ...],               # label ids / anchor ids
     "meta": {...}}                           # optional; corrupt_tokens_p1/_p2 lists if present

Positions index ``tokens`` and must satisfy ``1 <= p < len(tokens)`` (a prediction of the token at p
is read from logits at p - 1). Blank lines are skipped. Every bad row (malformed JSON, missing
field, unknown label/anchor id, empty ``targets``, clean/corrupt length mismatch, position out of
range, token id out of the vocabulary) is reported together in one ``ValueError`` as
``file:line: reason``; no row is silently dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from circuitkit.tasks.base import Example, Task

FORMAT = "circuitkit.task"
POS_FIELDS = ("evidence_pos", "anchor_pos", "shortlist_pos", "answer_pos")
INT_LIST_FIELDS = ("tokens", "corrupt_tokens", *POS_FIELDS, "targets", "near_misses", "anchors")
HEADER_FIELDS = ("name", "label_names", "anchor_names", "label_token_ids", "anchor_token_ids",
                 "label_anchor", "vocab")


def write_jsonl(task: Task, path: str | Path) -> None:
    head = dict(format=FORMAT, version=1, name=task.name, phase=task.phase, vocab=task.vocab,
                label_names=task.label_names, anchor_names=task.anchor_names,
                label_token_ids=task.label_token_ids.tolist(),
                anchor_token_ids=task.anchor_token_ids.tolist(),
                label_anchor=task.label_anchor.tolist(), pad_id=task.pad_id, bos_id=task.bos_id,
                eos_id=task.eos_id, config=task.config)
    with open(path, "w") as f:
        f.write(json.dumps(head) + "\n")
        for e in task.examples:
            row = {k: getattr(e, k) for k in INT_LIST_FIELDS}
            row["tokens"], row["corrupt_tokens"] = e.tokens.tolist(), e.corrupt_tokens.tolist()
            row["meta"] = e.meta
            f.write(json.dumps(row) + "\n")


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in x)


def _check_row(row: Any, n_vocab: int, n_labels: int, n_anchors: int) -> list[str]:
    if not isinstance(row, dict):
        return ["example row is not a JSON object"]
    bad = [f"missing field {k!r}" for k in INT_LIST_FIELDS if k not in row]
    bad += [f"{k!r} is not a list of integers" for k in INT_LIST_FIELDS
            if k in row and not _is_int_list(row[k])]
    if bad:
        return bad
    n = len(row["tokens"])
    if len(row["corrupt_tokens"]) != n:
        bad.append(f"clean/corrupt length mismatch ({n} vs {len(row['corrupt_tokens'])})")
    for k in ("tokens", "corrupt_tokens"):
        if any(not 0 <= t < n_vocab for t in row[k]):
            bad.append(f"{k!r} has token ids outside the vocabulary [0, {n_vocab})")
    for k in POS_FIELDS:
        out = [p for p in row[k] if not 1 <= p < n]
        if out:
            bad.append(f"{k!r} positions out of range [1, {n}): {out}")
    if not row["targets"]:
        bad.append("empty label set ('targets' is [])")
    for k, lim, what in (("targets", n_labels, "label"), ("near_misses", n_labels, "label"),
                         ("anchors", n_anchors, "anchor")):
        unknown = [v for v in row[k] if not 0 <= v < lim]
        if unknown:
            bad.append(f"unknown {what} id in {k!r}: {unknown}")
    if "meta" in row and not isinstance(row["meta"], dict):
        bad.append("'meta' is not an object")
    return bad


def read_jsonl(path: str | Path) -> Task:
    path = str(path)
    lines = Path(path).read_text().splitlines()
    errors: list[str] = []
    try:
        head = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError as err:
        head = None
        errors.append(f"{path}:1: malformed JSON in header ({err.msg})")
    if not isinstance(head, dict) or any(k not in head for k in HEADER_FIELDS):
        missing = [k for k in HEADER_FIELDS if not isinstance(head, dict) or k not in head]
        raise ValueError("\n".join(errors or [f"{path}:1: header lacks fields {missing}"]))
    n_vocab, n_labels, n_anchors = (len(head["vocab"]), len(head["label_names"]),
                                    len(head["anchor_names"]))
    for k, n in (("label_token_ids", n_labels), ("anchor_token_ids", n_anchors),
                 ("label_anchor", n_labels)):
        if not _is_int_list(head[k]) or len(head[k]) != n:
            errors.append(f"{path}:1: header {k!r} must be {n} integers")
    examples = []
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            errors.append(f"{path}:{lineno}: malformed JSON ({err.msg})")
            continue
        bad = _check_row(row, n_vocab, n_labels, n_anchors)
        errors += [f"{path}:{lineno}: {b}" for b in bad]
        if not bad:
            examples.append(Example(
                tokens=torch.tensor(row["tokens"], dtype=torch.long),
                corrupt_tokens=torch.tensor(row["corrupt_tokens"], dtype=torch.long),
                **{k: row[k] for k in INT_LIST_FIELDS[2:]}, meta=row.get("meta", {})))
    if errors:
        raise ValueError(f"{len(errors)} problem(s) in {path}:\n" + "\n".join(errors))
    return Task(
        name=head["name"], examples=examples, label_names=head["label_names"],
        anchor_names=head["anchor_names"],
        label_token_ids=torch.tensor(head["label_token_ids"], dtype=torch.long),
        anchor_token_ids=torch.tensor(head["anchor_token_ids"], dtype=torch.long),
        label_anchor=torch.tensor(head["label_anchor"], dtype=torch.long), vocab=head["vocab"],
        phase=head.get("phase", 2), pad_id=head.get("pad_id", 0), bos_id=head.get("bos_id", 1),
        eos_id=head.get("eos_id", 2), config=head.get("config", {}))
