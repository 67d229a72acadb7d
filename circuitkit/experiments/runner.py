"""The experiments' runner: a job is a list of named steps (``Step``) that ``run_steps`` runs in
order, and one resume record (``StepRecord``) says which are done, so a rerun skips them.
``characterize`` keeps its record in ``summary.json``, the distillation grid in
``ablation.json``: the same record type in both.

The record, in its document (``RECORD_VERSION`` under ``"record_version"``)::

    "steps": {NAME: {"seconds": S, "files": [F, ...], "sha256": {F: HEX, ...},
                     "depends": HEX}}

``files`` are relative to the job's folder; ``sha256`` is each file's SHA-256 as the step wrote
it; ``depends`` is ``depends_hash`` of what the step depends on (its inputs and options; null:
a step of an older version that this one does not run, kept as it was, never reused). A
recorded step is reused only while its ``depends`` is the current one and every file is there
with its recorded digest (``step_problem``); otherwise it is run again. A document without
``"record_version"`` was written before the record had one (version 0: no ``depends``; its
job derives them from what the document stored, ``legacy``); a newer version is refused in
one line naming it. The record is read back strictly (``read_steps``): every field is checked
for its type and every file name for staying inside the folder.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

RECORD_VERSION = 1
VERSION_KEY = "record_version"
_HEX = re.compile(r"^[0-9a-f]{64}$")
_FIELDS = {"seconds", "files", "sha256", "depends"}


def depends_hash(what: Any) -> str:
    """Hex SHA-256 of ``what`` as canonical JSON (sorted keys, no spaces; a value JSON cannot
    hold by its ``str``): equal inputs, equal hash, on any machine."""
    text = json.dumps(what, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def options_of(cls: type, options: Any, overrides: dict[str, Any], what: str) -> Any:
    """An options dataclass ``cls`` from ``options`` (None: the defaults; an instance; or a dict
    of its fields) with ``overrides`` (more fields) on top. An unknown field is one
    ``ValueError`` naming it and the valid ones."""
    names = [f.name for f in fields(cls)]
    if options is None:
        options = {}
    if isinstance(options, cls):
        base, given = options, dict(overrides)
    elif isinstance(options, dict):
        base, given = cls(), {**options, **overrides}
    else:
        raise ValueError(f"{what} options must be a {cls.__name__} or a dict of its fields; got "
                         f"{type(options).__name__}.")
    bad = [k for k in given if k not in names]
    if bad:
        raise ValueError(f"unknown {what} option{'s' if len(bad) > 1 else ''} "
                         f"{', '.join(map(repr, bad))}; the options are: {', '.join(names)}.")
    return replace(base, **given)


@dataclass(frozen=True)
class Step:
    """One named step of a job. ``run(at)`` does its work (``at``: "[i/n]", its place among
    the recorded steps) and returns the files it wrote, relative to the job's folder.
    ``depends``: ``depends_hash`` of its inputs; None: the step is not recorded and runs every
    time (a view of the others' results). ``reuse()``: what a reused step reads back.
    ``current(entry)``: False when a recorded entry was written by a version whose step did
    less (it is then run again, silently)."""

    name: str
    run: Callable[[str], list[str] | None]
    depends: str | None = None
    reuse: Callable[[], None] | None = None
    current: Callable[[dict[str, Any]], bool] | None = None


def _bad(path: Path, where: str, why: str, remedy: str) -> ValueError:
    return ValueError(f"{path}: {where} {why}; {remedy}.")


def _inside(name: Any) -> bool:
    """Whether a recorded file name stays inside the job's folder (relative, no ``..``)."""
    if not isinstance(name, str) or not name:
        return False
    p = Path(name)
    return not p.is_absolute() and ".." not in p.parts and "\\" not in name


def _check_entry(path: Path, name: str, entry: Any, version: int, remedy: str) -> None:
    """One recorded step, strictly: its fields and their types (version 0: no ``depends``;
    ``sha256`` may be missing or name fewer than its files: a folder from before checksums
    were recorded, whose files are then verified by loading, ``step_problem``)."""
    at = f"steps.{name}"
    if not isinstance(entry, dict):
        raise _bad(path, at, "must be a record (seconds, files, sha256, depends)", remedy)
    if version >= 1 and set(entry) != _FIELDS:
        extra, missing = sorted(set(entry) - _FIELDS), sorted(_FIELDS - set(entry))
        raise _bad(path, at, "has " + ", ".join(
            ([f"unknown field(s) {extra}"] if extra else [])
            + ([f"no {missing}"] if missing else [])), remedy)
    seconds = entry.get("seconds", 0)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
        raise _bad(path, f"{at}.seconds", f"must be a number >= 0; got {seconds!r}", remedy)
    files_ = entry.get("files")
    if not isinstance(files_, list) or not all(_inside(f) for f in files_):
        raise _bad(path, f"{at}.files", "must list file names inside the folder; got "
                   f"{files_!r}"[:200], remedy)
    sums = (entry.get("sha256") or {}) if version == 0 else entry.get("sha256")
    if not isinstance(sums, dict) or not all(
            isinstance(v, str) and _HEX.match(v) for v in sums.values()) or (
            not set(sums) <= set(files_)):
        raise _bad(path, f"{at}.sha256", "must map its files to their SHA-256 (64 hex "
                   "digits)", remedy)
    depends = entry.get("depends")
    if version >= 1 and depends is not None and not (isinstance(depends, str)
                                                     and _HEX.match(depends)):
        raise _bad(path, f"{at}.depends", "must be a SHA-256 (64 hex digits) or null", remedy)


def read_steps(doc: Any, path: Path, remedy: str,
               legacy: Callable[[str], str | None] | None = None) -> dict[str, dict[str, Any]]:
    """The steps recorded in ``doc`` (the parsed ``path``), read strictly (module docstring):
    anything malformed is one ``ValueError`` naming the file and the field, ending with
    ``remedy``. A version-0 record (no ``"record_version"``) gets each step's ``depends`` from
    ``legacy(name)`` (None: it is run again); a newer version is refused, named."""
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object; got {type(doc).__name__}; {remedy}.")
    version = doc.get(VERSION_KEY, 0)
    if isinstance(version, bool) or version not in (0, RECORD_VERSION):
        raise ValueError(f"{path}: resume record version {version!r} is not one this circuitkit "
                         f"reads (it reads version {RECORD_VERSION} and the unversioned records "
                         f"before it); resume it with the circuitkit that wrote it, or {remedy}.")
    steps = doc.get("steps", {})
    if not isinstance(steps, dict):
        raise _bad(path, "field 'steps'", "must map step names to records", remedy)
    for name, entry in steps.items():
        _check_entry(path, name, entry, version, remedy)
    if version == 0:
        for name, entry in steps.items():
            entry["sha256"] = entry.get("sha256") or {}
            entry["depends"] = legacy(name) if legacy is not None else None
    return steps


def step_problem(out: Path, record: dict[str, Any]) -> str:
    """Why a recorded step cannot be reused ("" when it can): one of its files is missing, or
    differs from the SHA-256 recorded with it (a folder from before checksums were recorded:
    its patch results must load, ``PatchResult.load``)."""
    from circuitkit import files

    sums = record.get("sha256") or {}
    for name in record.get("files", []):
        path = out / name
        if not path.is_file():
            return f"its file {path} is missing"
        if name in sums and files.modified(path, sums[name]):
            return f"its file {path} was modified (its SHA-256 differs from the one recorded)"
        if not sums and name.endswith(".json") and (out / (name[:-5] + ".safetensors")).exists():
            from circuitkit.patching.results import PatchResult

            try:
                PatchResult.load(out / name)
            except ValueError as e:
                return str(e)
    return ""


class StepRecord:
    """The resume record of one job: ``steps`` (the document's own dict, read by ``read_steps``)
    of the folder ``out``; ``save()`` writes the document (called after every step recorded);
    ``job`` and ``path`` name them in what is said; ``ran``: the steps done by this call;
    ``dropped``: the recorded steps whose files did not verify (said, to be done again)."""

    def __init__(self, out: Path, steps: dict[str, dict[str, Any]], save: Callable[[], None],
                 job: str, path: Path) -> None:
        self.out, self.steps, self.save, self.job, self.path = out, steps, save, job, path
        self.ran: list[str] = []
        self.dropped: set[str] = set()

    def forget_stale(self, depends: dict[str, str]) -> list[str]:
        """Drop the recorded steps of ``depends``' names whose inputs changed (their
        ``depends`` is not the current one); returns their names."""
        stale = [n for n, d in depends.items() if n in self.steps
                 and self.steps[n].get("depends") != d]
        for name in stale:
            self.steps.pop(name)
        return stale

    def reusable(self, name: str, current: Callable[[dict[str, Any]], bool] | None = None
                 ) -> bool:
        """Whether step ``name`` is recorded, ``current`` and its files verify; a recorded step
        whose files do not is said in a warning, dropped, and False."""
        entry = self.steps.get(name)
        if entry is None:
            return False
        if current is not None and not current(entry):
            self.steps.pop(name)
            return False
        problem = step_problem(self.out, entry)
        if problem:
            warnings.warn(f"circuitkit: {self.job} step {name} is recorded as done in "
                          f"{self.path}, but {problem}; recomputing it.", stacklevel=3)
            self.steps.pop(name)
            self.dropped.add(name)
            return False
        if set(entry["sha256"]) != set(entry["files"]):  # a folder from before checksums: its
            from circuitkit import files  # files verified by loading, their digests taken now

            entry["sha256"] = {f: entry["sha256"].get(f) or files.sha256_file(self.out / f)
                               for f in entry["files"]}
        return True

    def done(self, name: str, depends: str, seconds: float, written: list[str]) -> None:
        """Record step ``name`` as done (its files' SHA-256 taken now) and save the record."""
        from circuitkit import files

        self.steps.pop(name, None)  # (a step done again goes last, as it ran)
        self.steps[name] = dict(seconds=round(float(seconds), 3), files=list(written),
                                sha256={f: files.sha256_file(self.out / f) for f in written},
                                depends=depends)
        self.ran.append(name)
        self.save()


def run_steps(steps: list[Step], record: StepRecord, log: Callable[[str], None]) -> None:
    """Run ``steps`` in order: a recorded step that ``record`` can reuse is not run again
    (its ``reuse()`` reads it back; "[i/n] NAME: reused" is logged); the others run and are
    recorded with their time and files; an unrecorded step (``depends`` None) always runs."""
    total = sum(s.depends is not None for s in steps)
    i = 0
    for step in steps:
        if step.depends is None:
            step.run("")
            continue
        i += 1
        at = f"[{i}/{total}]"
        if record.reusable(step.name, step.current):
            log(f"{at} {step.name}: reused")
            if step.reuse is not None:
                step.reuse()
            continue
        t0 = time.perf_counter()
        written = step.run(at) or []
        record.done(step.name, step.depends, time.perf_counter() - t0, written)
