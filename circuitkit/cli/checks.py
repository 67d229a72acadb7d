"""The command line's own checks, one line naming the flag, before any model loads; the
one-run-per-folder claim on ``--out``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from circuitkit.cli.console import CLAIMED, FRESH_CLAIMS, RUN_FILE, _fail
from circuitkit.experiments.characterize import DEFAULT_N


# --- the command line's own checks: one line naming the flag, before any model loads ----------
def _one_of(flag: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{flag} {value}: not one of {', '.join(map(str, allowed))}; choose one "
                         "of those.")


def _positive(flag: str, value, what: str) -> None:
    """``value`` (None: the default) a positive integer."""
    if value is not None and value < 1:
        raise ValueError(f"{flag} {value}: expected a positive integer ({what}); give {flag} 1 "
                         "or more.")


def _select_n_flag(value: str, n: int) -> int | str | None:
    """``--select-n``: a number of examples in ``1..n - 1`` (``n``: the run's notes), "half" or
    "none" (None)."""
    if value.lower() in ("half", "none"):
        return None if value.lower() == "none" else "half"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--select-n {value}: expected a positive integer (examples to select "
                         "heads on), 'half' or 'none'.")
    if int(value) >= n:
        raise ValueError(f"--select-n {value}: expected 1..{n - 1} (the run has {n} notes; the "
                         "rest validate), 'half' or 'none'.")
    return int(value)


def _check_sweep_flags(a) -> None:
    """The flags patch and edges share: -n, --batch-size, --top-k, --direction, --gpu,
    --utilisation (``a``: the command's parameters)."""
    _positive("--n-examples", a.n_examples, "notes in the run")
    _positive("--batch-size", a.batch_size, "sequences per forward pass")
    _positive("--top-k", a.top_k, "cells verified exactly")
    from circuitkit.patching.inputs import DIRECTIONS

    _one_of("--direction", a.direction, DIRECTIONS)
    if a.plan:
        from circuitkit.patching.cost import GPU_CLASSES

        _one_of("--gpu", a.gpu.upper(), sorted(GPU_CLASSES))
        if not 0 < a.utilisation <= 1:
            raise ValueError(f"--utilisation {a.utilisation}: expected a share of the GPU's "
                             "peak in (0, 1].")


def _check_k(model: str, k: int, flag: str = "-k") -> None:
    """``-k``: a positive number of heads, at most the model's (from its config, when it has
    one: no weights loaded)."""
    _positive(flag, k, "top heads per phase")
    from circuitkit import models

    try:
        arch = models.architecture(model)
    except Exception:  # noqa: BLE001 - loading the model says what is wrong with it
        return
    heads = arch.n_layers * arch.n_heads
    if k > heads:
        raise ValueError(f"{flag} {k}: expected 1..{heads} (heads of {arch.name}); give a "
                         f"smaller {flag}.")


def _check_suffix(out: Path, suffix: str, writes: str, instead: str = "") -> None:
    """``--out FILE``: its suffix is what the command writes (``score --out x.json`` wrote CSV
    into a .json file)."""
    if out.suffix.lower() != suffix:
        raise ValueError(f"--out {out}: {writes}; give a {suffix} file (e.g. "
                         f"{out.with_suffix(suffix)}){', ' + instead if instead else ''}.")


# what older folders (before RUN_FILE) hold, by the file each command writes
RUN_SIGNS = (("summary.json", "characterize"), ("result.json", "patch"),
             ("edges.json", "edges"), ("distill.json", "distill"), ("ablation.csv", "distill"))


# flags that choose how a run goes, not what it computes: a rerun into the same --out may change
# them (and each command's own that redo a step from the same sweeps: ``REDO_FLAGS``)
HOW_FLAGS = frozenset({"out", "progress", "as_json", "batch_size", "checkpoint", "overwrite",
                       "plan", "seq_len", "gpu", "utilisation", "gpus_per_replica", "backend",
                       "remote", "ctx"})
REDO_FLAGS = {"characterize": frozenset({"k", "n_random", "n_random_ablation", "edges",
                                         "stages"}),
              "edges": frozenset({"circuit", "ablation"})}


def run_flags(ctx, command: str, **resolved) -> dict[str, dict]:
    """What a run computes, by its flags: ``{name: {"value": v, "text": "-n 64"}}`` for every
    option of ``ctx`` outside ``HOW_FLAGS`` and ``REDO_FLAGS[command]`` (``resolved``: values
    the command worked out from its defaults, e.g. ``-n`` of a built-in task). ``text`` is the
    flag as typed on the command line (``sys.argv``), else its shortest spelling."""
    import sys

    skip = HOW_FLAGS | REDO_FLAGS.get(command, frozenset())
    argv = [w.split("=", 1)[0] for w in sys.argv[1:]]
    flags = {}
    for param in ctx.command.params:
        if param.param_type_name != "option" or param.name in skip:
            continue
        value = resolved.get(param.name, ctx.params.get(param.name))
        value = str(value) if isinstance(value, Path) else value
        if param.is_flag:
            text = (param.opts if value else param.secondary_opts or ["no " + param.opts[0]])[0]
        else:
            typed = [o for o in param.opts if o in argv]
            flag = typed[-1] if typed else min(param.opts, key=len)
            text = f"{flag} {value}" if value is not None else f"no {flag}"
        flags[param.name] = dict(value=value, text=text)
    return flags


def _claim_folder(out: Path, command: str, ctx: Any = None, flags: dict | None = None,
                  overwrite: bool = False, made: list[Path] | None = None) -> Any:
    """One run per folder, one rule for its claim and its lock: ``out`` (made if needed,
    writable) is first locked (``files.lock_folder``; another run holding it is refused in one
    line), and only then read and claimed, so a run refused by the lock never touches another
    run's claim or lock. A folder holding another command's results is refused in one line. A
    claim that holds nothing (only the claim and the lock: its command was killed before it
    wrote anything, e.g. ``kill -9``) is stale and taken over. ``flags`` (``run_flags``):
    recorded with a fresh claim; a folder holding this command's run with other flags is
    refused before any model loads, naming the flags that differ, unless ``overwrite`` (then
    what earlier runs wrote there is removed: a fresh start). A fresh claim, and every folder
    it made (``made``; default: those this call makes), is released when the command fails
    before writing anything (``console._fail``, under the lock). Returns the lock this call
    took (None if this process held it already); with the command's ``ctx`` (a click context)
    it is closed when the command ends (after ``_fail``'s release), else by the caller."""
    from circuitkit import files

    made = _missing_folders(out) if made is None else made
    files.check_writable_dir(out)  # before any work: a result is never lost at 100%
    lock = None
    if not files.holds_lock(out):
        lock = files.lock_folder(out, "--out folder")  # (removes dead writers' temporaries)
        if ctx is not None:
            ctx.call_on_close(lock.close)
    try:
        _claim_locked(out, command, flags, overwrite, made)
    except BaseException:
        FRESH_CLAIMS[:] = [(out, made)]  # (the folders made for it: released by _fail)
        if lock is not None and ctx is None:
            lock.close()
        raise
    return lock


def _claim_locked(out: Path, command: str, flags: dict | None, overwrite: bool,
                  made: list[Path]) -> None:
    """``_claim_folder``'s claim, under the folder's lock."""
    import json

    from circuitkit import files

    marker = out / RUN_FILE
    record: dict = {}
    try:
        record = json.loads(marker.read_text())
        held = record["command"]
    except (OSError, ValueError, KeyError, TypeError):
        held, record = next((cmd for name, cmd in RUN_SIGNS if (out / name).exists()), None), {}
    if {p.name for p in out.iterdir()} <= {RUN_FILE, files.LOCK_NAME}:
        held, record = None, {}  # a claim with nothing behind it: its command died before writing
    if held not in (None, command):
        raise ValueError(f"--out {out} holds the results of `circuitkit {held}`; a folder holds "
                         f"one command's results: give this {command} another --out (e.g. "
                         f"{out.parent / (out.name + '-' + command)}).")
    stored = record.get("flags") if isinstance(record.get("flags"), dict) else None
    if held == command and overwrite:
        _clear(out, record, held)
        held, stored = None, None
    elif held == command and stored is not None and flags is not None:
        differ = [(stored[k].get("text"), f["text"]) for k, f in flags.items()
                  if k in stored and isinstance(stored[k], dict)
                  and stored[k].get("value") != f["value"]]
        if differ:
            said = "; ".join(f"{old} there, {new} now" for old, new in differ)
            raise ValueError(f"--out {out} holds a {command} run with other flags ({said}): "
                             "rerun with its flags to resume it, give another --out, or add "
                             "--overwrite to start again there.")
    if held is None or not marker.exists():
        kept = sorted(p.name for p in out.iterdir()
                      if p.name not in (RUN_FILE, files.LOCK_NAME)) if held is None else None
        files.write_text(marker, json.dumps(dict(
            command=command, **({} if flags is None else dict(flags=flags)),
            **({} if kept is None else dict(kept=kept)))) + "\n")
        if held is None:  # released again if the command fails before writing a result
            FRESH_CLAIMS[:] = [(out, made)]  # (one claim a command)


def _claim_out(ctx, command: str, out: Path, overwrite: bool, **resolved) -> None:
    """``command``'s claim of ``--out`` with the run's flags (``run_flags(ctx, command,
    **resolved)``), before any model loads: ``_claim_folder``, its lock held until the command
    ends (the library's own lock of the folder sees this process holds it)."""
    flags = run_flags(ctx, command, **resolved)
    _claim_folder(out, command, ctx, flags, overwrite)
    CLAIMED[:] = [out]


def _missing_folders(path: Path) -> list[Path]:
    """The folders ``mkdir(parents=True)`` would make for ``path``, outermost first (what a
    refused run removes again)."""
    missing = []
    for p in (Path(path), *Path(path).parents):
        if p.exists() or p.is_symlink():
            break
        missing.append(p)
    return missing[::-1]


def _clear(out: Path, record: dict, command: str) -> None:
    """``--overwrite``: remove what earlier runs of ``command`` wrote in ``out`` (everything
    but the entries the folder held before its first claim, its claim and its lock)."""
    import shutil

    from circuitkit import files

    if not isinstance(record.get("kept"), list):  # (a folder claimed before claims said so)
        raise ValueError(f"--overwrite: --out {out} was claimed by an older circuitkit, which "
                         f"did not record what else the folder held; delete its {command} "
                         "results yourself, or give another --out.")
    keep = {RUN_FILE, files.LOCK_NAME, *record["kept"]}
    for p in out.iterdir():
        if p.name in keep:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


# --- scores and the main job (circuitkit.scoring, circuitkit.experiments.characterize)
# ------------------------
def _text_flag(text: str) -> bool | None:
    if text not in ("auto", "yes", "no"):
        _fail(f"--text {text}: not one of auto, yes, no; choose one of those.")
    return None if text == "auto" else text == "yes"


def _n_for(task: str, n_examples: int | None) -> int:
    """The number of notes a command runs on: ``-n``, else ``DEFAULT_N`` for a built-in task and
    every row of a .jsonl (the same rule for every command)."""
    if n_examples is not None:
        _positive("--n-examples", n_examples, "notes in the run")
        return n_examples
    if not task.endswith(".jsonl"):
        return DEFAULT_N
    import circuitkit as ck
    from circuitkit.tasks import pairs

    if pairs.is_pairs_file(task):  # (a Task loader refuses a pairs file: its own line, later)
        return len(pairs.read_pairs(task))
    return len(ck.load_task(task))

