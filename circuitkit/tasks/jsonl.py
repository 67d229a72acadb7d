"""JSONL file format of a task: validation and (de)serialisation of plain rows. The schema, the
validation rules and the version-1 reading: docs/jsonl.md.

This module knows the file format only; it imports nothing from ``tasks.base`` (``Task`` builds
itself from what ``read_jsonl`` returns and hands ``write_jsonl`` its rows), so there is no cycle.
Line 1 is the header (``HEADER_FIELDS``, ``HEADER_OPTIONAL``), each further line one example
(``ROW_FIELDS``). One source of truth per field: ``corrupt_tokens`` is the corruption for the
header's phase (a ``corrupt_tokens_p{phase}`` duplicating it is refused). Positions satisfy
``1 <= p < len(tokens)``. Every bad row is reported together in one ``ValueError`` as
``file:line: reason``; no row is silently dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = "circuitkit.task"
VERSION = 2
POS_FIELDS = ("evidence_pos", "anchor_pos", "shortlist_pos", "answer_pos")
INT_LIST_FIELDS = ("tokens", "corrupt_tokens", *POS_FIELDS, "targets", "near_misses", "anchors")
PHASE_CORRUPT = {1: "corrupt_tokens_p1", 2: "corrupt_tokens_p2"}
OPTIONAL_INT_LISTS = (*PHASE_CORRUPT.values(), "corrupt_anchors")
HEADER_FIELDS = ("name", "label_names", "anchor_names", "label_token_ids", "anchor_token_ids",
                 "label_anchor", "vocab")


def write_jsonl(path: str | Path, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Header line + one line per row (rows as ``read_jsonl`` returns them), atomically."""
    from circuitkit.files import write_text

    head = dict(format=FORMAT, version=VERSION, **header)
    lines = [json.dumps(head)] + [json.dumps(r) for r in rows]
    write_text(path, "\n".join(lines) + "\n")


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in x)


HEADER_OPTIONAL = ("phase", "pad_id", "bos_id", "eos_id", "config")
ROW_FIELDS = (*INT_LIST_FIELDS, *OPTIONAL_INT_LISTS, "meta")


def _is_str_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def _check_header(head: dict[str, Any]) -> list[str]:
    """Types and ranges of the header's fields; an unknown key (a typo) is named."""
    unknown = sorted(set(head) - set(HEADER_FIELDS) - set(HEADER_OPTIONAL))
    bad = [f"header has unknown field(s) {unknown}; known: "
           f"{sorted({*HEADER_FIELDS, *HEADER_OPTIONAL, 'format', 'version'})}"] if unknown else []
    if not isinstance(head["name"], str):
        bad.append("header 'name' must be a string")
    for k in ("vocab", "label_names", "anchor_names"):
        if not _is_str_list(head[k]):
            bad.append(f"header {k!r} must be a list of strings")
    if "config" in head and not isinstance(head["config"], dict):
        bad.append("header 'config' must be an object")
    if bad:
        return bad
    n_vocab, n_labels, n_anchors = (len(head["vocab"]), len(head["label_names"]),
                                    len(head["anchor_names"]))
    for k, n, lim, what in (("label_token_ids", n_labels, n_vocab, "token"),
                            ("anchor_token_ids", n_anchors, n_vocab, "token"),
                            ("label_anchor", n_labels, n_anchors, "anchor")):
        if not _is_int_list(head[k]) or len(head[k]) != n:
            bad.append(f"header {k!r} must be {n} integers")
        elif lim and any(not 0 <= v < lim for v in head[k]):  # (no anchors: placeholders)
            bad.append(f"header {k!r} holds {what} ids outside [0, {lim}): "
                       f"{[v for v in head[k] if not 0 <= v < lim][:5]}")
    for k in ("pad_id", "bos_id", "eos_id"):
        if k in head and (type(head[k]) is not int or not 0 <= head[k] < n_vocab):
            bad.append(f"header {k!r} must be a token id in [0, {n_vocab}), got {head[k]!r}")
    for k, what in (("label_token_ids", "labels"), ("anchor_token_ids", "anchors")):
        ids = head[k] if _is_int_list(head[k]) else []
        shared = sorted({v for v in ids if ids.count(v) > 1})
        if shared:  # no metric could tell such labels apart
            bad.append(f"header {k!r}: {what} share token ids {shared[:5]}; every one needs a "
                       "token of its own")
    return bad


def _check_row(row: Any, phase: int, n_vocab: int, n_labels: int, n_anchors: int,
               version: int, head: dict[str, Any] | None = None) -> list[str]:
    if not isinstance(row, dict):
        return ["example row is not a JSON object"]
    unknown = sorted(set(row) - set(ROW_FIELDS))
    if unknown:  # a typo ("corrupt_anchor") would otherwise drop what the user meant silently
        return [f"unknown field(s) {unknown}; known: {list(ROW_FIELDS)} (free-form data goes "
                "in 'meta')"]
    if "meta" in row and not isinstance(row["meta"], dict):
        return ["'meta' is not an object"]
    meta = row.get("meta", {})
    if version < 2:  # version 1 kept these in meta: lift them, validated like the rest
        for k in OPTIONAL_INT_LISTS:
            if k in meta:
                if k in row:
                    return [f"{k!r} is given both as a field and in 'meta'"]
                row[k] = meta.pop(k)
    elif any(k in meta for k in OPTIONAL_INT_LISTS):
        return [f"'meta' holds {[k for k in OPTIONAL_INT_LISTS if k in meta]}: in version "
                f"{VERSION} files they are top-level fields"]
    bad = [f"missing field {k!r}" for k in INT_LIST_FIELDS if k not in row]
    bad += [f"{k!r} is not a list of integers" for k in (*INT_LIST_FIELDS, *OPTIONAL_INT_LISTS)
            if k in row and not _is_int_list(row[k])]
    if bad:
        return bad
    n = len(row["tokens"])
    own = PHASE_CORRUPT[phase]
    if own in row:
        if row[own] != row["corrupt_tokens"]:
            return [f"{own!r} disagrees with 'corrupt_tokens' (this is a phase-{phase} file, so "
                    f"'corrupt_tokens' is the phase-{phase} corruption): keep one of them"]
        if version >= 2:
            return [f"{own!r} duplicates 'corrupt_tokens' in a phase-{phase} file: remove it"]
    if n == 0:
        bad.append("'tokens' is empty")
    for k in ("corrupt_tokens", *PHASE_CORRUPT.values()):
        if k in row and len(row[k]) != n:
            bad.append(f"clean/corrupt length mismatch ({k!r}: {len(row[k])} vs {n})")
    for k in ("tokens", "corrupt_tokens", *PHASE_CORRUPT.values()):
        if k in row and any(not 0 <= t < n_vocab for t in row[k]):
            bad.append(f"{k!r} has token ids outside the vocabulary [0, {n_vocab})")
    for k in POS_FIELDS:
        out = [p for p in row[k] if not 1 <= p < n]
        if out:
            bad.append(f"{k!r} positions out of range [1, {n}): {out}")
    if not row["targets"]:
        bad.append("empty label set ('targets' is [])")
    both = sorted(set(row["targets"]) & set(row["near_misses"]))
    if both:
        bad.append(f"label(s) {both} are both targets and near_misses (a near-miss is a "
                   "plausible wrong label, never a target)")
    for k, lim, what in (("targets", n_labels, "label"), ("near_misses", n_labels, "label"),
                         ("anchors", n_anchors, "anchor"),
                         ("corrupt_anchors", n_anchors, "anchor")):
        unknown = [v for v in row.get(k, []) if not 0 <= v < lim]
        if unknown:
            bad.append(f"unknown {what} id in {k!r}: {unknown}")
    if bad or head is None:
        return bad
    return _check_steps(row, head)


def _check_steps(row: dict[str, Any], head: dict[str, Any]) -> list[str]:
    """The tokens at the step positions are what the row says they are: at each ``answer_pos``
    the token of one of its ``targets``, at ``anchor_pos[j]`` the token of ``anchors[j]``.
    An off-by-one position would otherwise make every metric read the wrong token."""
    tokens, vocab, bad = row["tokens"], head["vocab"], []
    hint = ("(positions count from 0 at the first token; the logits at p - 1 predict the "
            "token at p: is the position off by one?)")
    want = {head["label_token_ids"][t] for t in row["targets"]}
    wrong = [p for p in row["answer_pos"] if tokens[p] not in want]
    if wrong:
        p = wrong[0]
        bad.append(f"'answer_pos' {wrong} hold(s) token(s) that are no target's: position {p} "
                   f"holds {vocab[tokens[p]]!r}, the targets' tokens are "
                   f"{sorted(vocab[t] for t in want)} {hint}")
    if row["anchor_pos"]:
        if len(row["anchors"]) != len(row["anchor_pos"]):
            bad.append(f"'anchors' has {len(row['anchors'])} entries and 'anchor_pos' "
                       f"{len(row['anchor_pos'])}: anchors[j] is the anchor written at "
                       "anchor_pos[j]")
        else:
            ids = head["anchor_token_ids"]
            wrong = [(p, a) for p, a in zip(row["anchor_pos"], row["anchors"], strict=True)
                     if tokens[p] != ids[a]]
            if wrong:
                (p, a) = wrong[0]
                bad.append(f"'anchor_pos' {[w[0] for w in wrong]}: position {p} holds "
                           f"{vocab[tokens[p]]!r}, not anchor {a}'s token "
                           f"{vocab[ids[a]]!r} {hint}")
    return bad



MAX_PROBLEMS = 20  # lines of a file's problems shown (a 100,000-row file: a 9 MB error, before)


def checked_lines(lines: list[str], first: int, path: Any,
                  check: Any) -> tuple[list[tuple[int, Any]], list[str]]:
    """The JSON objects of ``lines`` (numbered from ``first``; blank ones skipped) that
    ``check(row) -> [problems]`` accepts, as ``(line number, row)``, and every problem as
    ``path:line: problem`` (malformed JSON included): the one row loop of every JSONL reader."""
    rows, errors = [], []
    for lineno, line in enumerate(lines, start=first):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            errors.append(f"{path}:{lineno}: malformed JSON ({err.msg})")
            continue
        bad = check(row)
        errors += [f"{path}:{lineno}: {b}" for b in bad]
        if not bad:
            rows.append((lineno, row))
    return rows, errors


def problems(errors: list[str], path: Any) -> str:
    """The refusal of a file with ``errors``: their count and the first ``MAX_PROBLEMS`` (the
    rest counted, never all printed)."""
    shown = errors[:MAX_PROBLEMS]
    more = len(errors) - len(shown)
    return (f"{len(errors)} problem(s) in {path}:\n" + "\n".join(shown)
            + (f"\n... and {more} more (fix these and load again to see the rest)" if more
               else ""))


def read_jsonl(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, rows) of a task file, every field validated (module docstring). In the rows
    returned, ``corrupt_tokens_p{phase}`` of the header's phase is absent (it is
    ``corrupt_tokens``)."""
    path = str(path)
    try:
        # "\n" only: splitlines() also breaks at U+2028, NEL or form feed inside a JSON string
        lines = Path(path).read_text(encoding="utf-8-sig").split("\n")  # (a BOM is fine)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read task file {path}: {e}") from None
    errors: list[str] = []
    if not any(line.strip() for line in lines):
        raise ValueError(f"{path} is empty: line 1 must be the header object and every further "
                         "line one example (schema: docs/jsonl.md).")
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:1: malformed JSON in header ({err.msg})") from None
    if not isinstance(head, dict):
        raise ValueError(f"{path}:1: the header must be a JSON object; got a "
                         f"{type(head).__name__} (schema: docs/jsonl.md).")
    if ("clean" in head or "corrupt" in head) and "vocab" not in head:
        raise ValueError(f"{path} holds plain clean/corrupt pairs: `circuitkit patch` and "
                         "`edges` take it as --task, Python reads it with "
                         "circuitkit.tasks.pairs.load_pairs(path, model); a Task (characterize, "
                         "score, evaluate, distill) needs the header and chain-of-thought fields "
                         "of docs/jsonl.md (docs/from-transformerlens.md).")
    if "tokens" in head and "vocab" not in head:
        raise ValueError(f"{path}:1: line 1 is an example row; the file needs its header first "
                         "(name, vocab, label_names, ...; schema: docs/jsonl.md).")
    fmt = head.pop("format", FORMAT)
    if fmt != FORMAT:
        raise ValueError(f"{path}:1: header 'format' is {fmt!r}, not {FORMAT!r}: not a "
                         "circuitkit task file.")
    missing = [k for k in HEADER_FIELDS if k not in head]
    if missing:  # every header problem that can be named without those fields
        unknown = sorted(set(head) - set(HEADER_FIELDS) - set(HEADER_OPTIONAL) - {"version"})
        errors = [f"{path}:1: header lacks fields {missing}"] + (
            [f"{path}:1: header has unknown field(s) {unknown}"] if unknown else [])
        raise ValueError("\n".join(errors))
    version, phase = head.pop("version", 1), head.get("phase", 2)
    if type(phase) is not int or phase not in (1, 2):
        raise ValueError(f"{path}:1: header 'phase' must be 1 or 2, got {phase!r}")
    if type(version) is not int or version < 1:
        raise ValueError(f"{path}:1: header 'version' must be an integer >= 1, got {version!r}")
    if version > VERSION:
        raise ValueError(f"{path}:1: format version {version} is newer than this circuitkit "
                         f"reads ({VERSION}); upgrade circuitkit")
    errors += [f"{path}:1: {b}" for b in _check_header(head)]
    if errors:  # the rows cannot be checked against a header that is wrong
        raise ValueError(problems(errors, path))
    n_vocab, n_labels, n_anchors = (len(head["vocab"]), len(head["label_names"]),
                                    len(head["anchor_names"]))
    good, errors = checked_lines(lines[1:], 2, path, lambda row: _check_row(
        row, phase, n_vocab, n_labels, n_anchors, version, head))
    rows = [row for _, row in good]
    for row in rows:
        row.pop(PHASE_CORRUPT[phase], None)
    if errors:
        raise ValueError(problems(errors, path))
    if not rows:
        raise ValueError(f"{path} holds no examples (only a header); add one JSON object per "
                         "example after line 1 (schema: docs/jsonl.md).")
    return head, rows
