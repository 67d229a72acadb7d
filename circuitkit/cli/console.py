"""What a command says: one-line errors, warnings as lines, ``--json``, and the command line
that reruns it (for resuming).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import typer

RUN_FILE = ".circuitkit-run"  # {"command": ...}: which command's results a folder holds
# the folder this command claimed fresh (``checks._claim_folder``): (folder, the folders the
# claim made, outermost first)
FRESH_CLAIMS: list[tuple[Path, list[Path]]] = []
# the --out this command claimed with its flags (``checks._claim_out``): a refusal of the work
# in it is said in the command line's terms
CLAIMED: list[Path] = []


def _message(e: BaseException) -> str:
    """What the command says of ``e``: its message; a folder holding another run's work
    (``identity.IdentityMismatch``) in the command line's terms, when its flags matched."""
    differing = getattr(e, "differing", None)
    if not differing or not CLAIMED:
        return str(e) or type(e).__name__
    return (f"--out {CLAIMED[-1]} holds a run of the same flags on other inputs (differing: "
            f"{', '.join(differing)}: the task's file, the model's weights or circuitkit's "
            "version changed since): give another --out, or add --overwrite to start again "
            "there.")


def echo(text: object = "", err: bool = False) -> None:
    """``typer.echo`` of ``text`` with its control characters escaped (``escape.terminal_safe``):
    what the commands print holds names from the user's files (a task's, a group's)."""
    from circuitkit.escape import terminal_safe

    typer.echo(terminal_safe(text), err=err)


def _fail(msg: str) -> None:
    """End the command with the whole message (every line: which row, which file, what to do).
    A folder this command claimed and wrote nothing else to is released (a failed run does not
    keep another command out of it)."""
    from circuitkit.escape import terminal_safe

    _release_fresh_claims()
    typer.secho(f"error: {terminal_safe(msg)}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _release_fresh_claims() -> None:
    """Release this command's fresh claim (``checks._claim_folder``), under its lock only (a
    claim is never released by a process that does not hold the folder's lock: it would delete
    the claim and lock of the run that does): the claim and lock of a folder it wrote nothing
    else to, and every folder the claim made (``(folder, [made folders, outermost first])``),
    innermost first, while empty."""
    from circuitkit.files import LOCK_NAME, holds_lock

    while FRESH_CLAIMS:
        out, made = FRESH_CLAIMS.pop()
        if not holds_lock(out):
            continue
        try:
            names = {p.name for p in out.iterdir()}
            if names <= {RUN_FILE, LOCK_NAME}:  # (the claim and the run's lock: no result)
                for name in names:
                    (out / name).unlink()
                for folder in reversed([out] if made is True else made or []):
                    folder.rmdir()  # (OSError when not empty: kept)
        except OSError:
            pass  # (a folder another process writes to now keeps its claim)


@contextlib.contextmanager
def _errors_as_lines(*errors: type[Exception]):
    """Inside: an exception of ``errors`` (default ``ValueError``) ends the command in one line
    (``_fail``: its message, or its type's name when it has none)."""
    caught = errors or (ValueError,)
    try:
        yield
    except caught as e:
        _fail(_message(e))


def _interrupted(why: str) -> None:
    """Ctrl-C: ``interrupted; why`` (what was kept, how to resume) on a line of its own, and
    exit status 130. Open progress bars stop where they are (not redrawn after it)."""
    from circuitkit.escape import terminal_safe

    _stop_bars()
    typer.secho("interrupted; " + terminal_safe(why), err=True)
    raise typer.Exit(130) from None


def _stop_bars() -> None:
    """Every open progress bar stops drawing (a later ``close()`` prints nothing); a bar's line
    on stderr is ended, so what follows starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    bars = list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ())
    drawn = [b for b in bars if not b.disable]
    for bar in bars:
        bar.disable = True  # (tqdm's close() and refresh() return at once)
    if drawn:
        sys.stderr.write("\n")
        sys.stderr.flush()


@contextlib.contextmanager
def _warnings_as_lines():
    """Inside: a warning circuitkit raises (a ``DegenerateBaselineWarning``, or any warning
    from circuitkit's own code) prints as one ``warning:`` line, each distinct message once
    (Python's own format adds the file, line and source of the call), on a line of its own
    while progress bars run (``tqdm.write``); other warnings as Python prints them. Imports
    nothing heavy: ``COMMAND --help`` passes through here."""
    import warnings

    shown, said = warnings.showwarning, set()
    here = str(Path(__file__).resolve().parents[1])  # circuitkit/

    def raised_here() -> bool:
        """Whether the code that called ``warnings.warn`` is circuitkit's (the file a warning
        names is its ``stacklevel``'s, often the caller's)."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename == warnings.__file__:
            frame = frame.f_back
        return frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(
            here)

    def show(message, category, filename, lineno, file=None, line=None):
        results = sys.modules.get("circuitkit.patching.results")  # loaded if it can warn
        ours = raised_here() or (results is not None and issubclass(
            category, results.DegenerateBaselineWarning))
        if not ours:
            shown(message, category, filename, lineno, file, line)
            return
        text = " ".join(str(message).removeprefix("circuitkit: ").split())
        if text not in said:
            said.add(text)
            _say(f"warning: {text}", fg=typer.colors.YELLOW)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _say(line: str, fg: str | None = None) -> None:
    """``line`` on stderr, on a line of its own: above any open progress bar (``tqdm.write``),
    coloured ``fg`` on a terminal; its control characters escaped (``escape.terminal_safe``)."""
    from circuitkit.escape import terminal_safe

    line = terminal_safe(line)
    tqdm = sys.modules.get("tqdm")
    if tqdm is None:
        typer.secho(line, fg=fg, err=True)
        return
    tty = getattr(sys.stderr, "isatty", lambda: False)()
    tqdm.tqdm.write(typer.style(line, fg=fg) if fg and tty else line, file=sys.stderr)


def _same_command(ctx: typer.Context) -> str:
    """The command line that reruns the current command with the same options (for resuming)."""
    import shlex

    words = ["circuitkit", ctx.info_name]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        # (typer may bring its own click: ask the parameter what it is, not its class)
        if param.param_type_name != "option" or value == param.default or value is None \
                or param.name == "overwrite":  # (a resume never starts again)
            continue
        if param.is_flag:
            names = param.opts if value else param.secondary_opts
            words.append(names[0])
        else:
            words += [max(param.opts, key=len), shlex.quote(str(value))]
    return " ".join(words)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was typed on the command line (not left at its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


def _echo_json(obj) -> None:
    """``--json``: one strict JSON object (NaN and inf as null; tensors and paths as text)."""
    import json
    import math

    def plain(v):
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # numpy / torch scalars
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v if isinstance(v, (str, int, float, bool, type(None))) else str(v)

    typer.echo(json.dumps(plain(obj), indent=1, allow_nan=False))
