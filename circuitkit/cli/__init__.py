"""``circuitkit`` command line: a thin layer over the same public functions a notebook calls.

Heavy imports (torch, transformer_lens) happen inside commands, so ``circuitkit --help`` and
every ``circuitkit COMMAND --help`` are fast. Every option is declared once, one row of the option
table (``cli/options.py``: ``MODEL``, ``TASK``, ``N``, ...); a command is the list of the options
it takes (``cli/command.py``'s ``command`` builds its signature from them) and a body that takes
one parsed-arguments object (``Args``) and hands the work to helpers. The command line's own
arguments are checked (``cli/checks.py``), naming the flag, before any model loads.

Layout: ``options`` (the option table), ``command`` (``Option``, ``Args``, ``command``),
``console`` (one-line errors, warnings, ``--json``), ``checks`` (flag checks, the ``--out``
claim), ``load`` (model, task, sweep inputs), ``format`` (CLI-only text), ``plan`` (``--plan``),
and one module per command family: ``patch`` (info, patch, edges), ``report`` (evaluate,
report), ``characterize`` (score, characterize), ``distill``. The package binds each command's
name to its function (``circuitkit.cli.patch`` is the command; the module is
``sys.modules["circuitkit.cli.patch"]``).
"""

from __future__ import annotations

import sys

import typer

from circuitkit.cli.app import app


def main() -> None:  # console-script entry point
    try:
        code = app(standalone_mode=False)
    except KeyboardInterrupt:
        typer.secho("interrupted", err=True)
        sys.exit(130)
    except Exception as e:
        # a usage error (a value its flag's type refuses, no such option or command): one line,
        # as every other bad argument, instead of the parser's usage block
        if not callable(getattr(e, "format_message", None)) or not isinstance(
                getattr(e, "exit_code", None), int):
            raise
        if type(e).__name__ == "Abort":  # Ctrl-C at a prompt
            typer.secho("interrupted", err=True)
            sys.exit(130)
        if type(e).__name__ == "NoArgsIsHelpError":  # no command: the help, as before
            typer.echo(e.format_message(), err=True)
            sys.exit(e.exit_code)
        ctx = getattr(e, "ctx", None)
        hint = f"{ctx.command_path} --help" if ctx is not None else "circuitkit --help"
        typer.secho(f"error: {e.format_message()} (see {hint})", fg=typer.colors.RED, err=True)
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


# the commands register on ``app`` in the order ``--help`` lists them
# isort: off
from circuitkit.cli.console import _warnings_as_lines  # noqa: E402 (tests import it here)
from circuitkit.cli.load import _check_vocabulary, _sweep_inputs  # noqa: E402
from circuitkit.cli.patch import edges, info, patch  # noqa: E402
from circuitkit.cli.report import evaluate, report  # noqa: E402
from circuitkit.cli.characterize import characterize, score  # noqa: E402
from circuitkit.cli.distill import distill  # noqa: E402
# isort: on

__all__ = ["app", "main", "info", "patch", "edges", "evaluate", "report", "score",
           "characterize", "distill", "_check_vocabulary", "_sweep_inputs", "_warnings_as_lines"]
