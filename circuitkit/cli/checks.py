"""The command line's own checks, one line naming the flag, before any model loads; the
one-run-per-folder claim on ``--out``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from circuitkit.characterize import DEFAULT_N
from circuitkit.cli.console import FRESH_CLAIMS, RUN_FILE, _fail


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
        from circuitkit.patching.plan import GPU_CLASSES

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


# what older folders (before RUN_FILE) hold, by the file each command writes
RUN_SIGNS = (("summary.json", "characterize"), ("result.json", "patch"),
             ("edges.json", "edges"), ("distill.json", "distill"), ("ablation.csv", "distill"))


def _claim_folder(out: Path, command: str, ctx: Any = None) -> Any:
    """One run per folder, one rule for its claim and its lock: ``out`` (made if needed,
    writable) is first locked (``files.lock_folder``, held until the command ends; another
    run holding it is refused in one line), and only then read and claimed: a folder holding
    another command's results is refused in one line. A claim is written, read and released
    under the lock only, so a run refused by the lock never touches another run's claim or
    lock. A claim that holds nothing (only the claim and the lock: its command was killed
    before it wrote anything, e.g. ``kill -9``) is stale and taken over. A fresh claim is
    released when the command fails before writing anything (``console._fail``). Returns the
    lock this call took (None if this process held it already); with the command's ``ctx``
    (a click context) it is closed when the command ends, else by the caller."""

    from circuitkit import files

    made = not out.exists()
    files.check_writable_dir(out)
    lock = None
    if not files.holds_lock(out):
        lock = files.lock_folder(out, "--out folder")  # (removes dead writers' temporaries)
        if ctx is not None:
            ctx.call_on_close(lock.close)  # after _fail's release: that runs under the lock
    try:
        _claim_locked(out, command, made)
    except BaseException:
        if lock is not None and ctx is None:
            lock.close()  # (a command closes it when it ends)
        raise
    return lock


def _claim_locked(out: Path, command: str, made: bool) -> None:
    """``_claim_folder``'s claim, under the folder's lock."""
    import json

    from circuitkit import files

    marker = out / RUN_FILE
    try:
        held = json.loads(marker.read_text())["command"]
    except (OSError, ValueError, KeyError, TypeError):
        held = next((cmd for name, cmd in RUN_SIGNS if (out / name).exists()), None)
    stale = {p.name for p in out.iterdir()} <= {RUN_FILE, files.LOCK_NAME}
    if stale:  # a claim with nothing behind it: its command died before writing a result
        held = None
    if held not in (None, command):
        raise ValueError(f"--out {out} holds the results of `circuitkit {held}`; a folder holds "
                         f"one command's results: give this {command} another --out (e.g. "
                         f"{out.parent / (out.name + '-' + command)}).")
    if held is None or not marker.exists():
        files.write_text(marker, json.dumps({"command": command}) + "\n")
        if held is None:  # released again if the command fails before writing a result
            FRESH_CLAIMS[:] = [(out, made)]  # (one claim a command)


# --- scores and the main job (circuitkit.scoring, circuitkit.characterize) ------------------------
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

    return len(ck.load_task(task))

