"""``circuitkit`` command line: a thin layer over the same public functions a notebook calls.

Heavy imports (torch, transformer_lens) happen inside commands, so ``circuitkit --help`` and
every ``circuitkit COMMAND --help`` are fast. Each option that several commands share is
declared once (``cli/options.py``: ``Model``, ``Task``, ``N``, ...); a command lists the ones it
takes and hands the work to helpers. The command line's own arguments are checked
(``cli/checks.py``), naming the flag, before any model loads.

Layout: ``options`` (shared options), ``console`` (one-line errors, warnings, ``--json``),
``checks`` (flag checks, the ``--out`` claim), ``load`` (model, task, sweep inputs), ``format``
(CLI-only text), ``plan`` (``--plan``), and one module per command family: ``patch`` (info,
patch, edges), ``report`` (evaluate, report), ``characterize`` (score, characterize),
``distill``. The package binds each command's name to its function (``circuitkit.cli.patch`` is
the command; the module is ``sys.modules["circuitkit.cli.patch"]``).
"""

from __future__ import annotations

import sys

import typer

from circuitkit.cli.app import app


def main() -> None:  # console-script entry point
    try:
        app()
    except KeyboardInterrupt:
        typer.secho("interrupted", err=True)
        sys.exit(130)


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
