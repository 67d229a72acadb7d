"""How a command is built from its options: ``Option`` (one row of the option table,
``cli/options.py``), ``Args`` (what a command's body reads: its parsed arguments) and
``command`` (registers a body, taking one ``Args``, as a typer command whose signature is its
options').

typer reads a command's options from ``inspect.signature`` of its function; ``command`` gives
the function it registers a ``__signature__`` built from the table, so each option is declared
once, in the table, and a command is the list of the options it takes (the body's one
parameter is the parsed arguments, however many options the command has).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Annotated, Any

import typer

from circuitkit.cli.app import app


@dataclass(frozen=True)
class Option:
    """One option of the command line: ``name`` (the parameter, read as ``args.name``; the key
    of the run's flags in ``OUT/.circuitkit-run``), ``flags`` (as typed; ``--x/--no-x``: a
    switch), ``type`` (what the value is parsed as), ``default``, ``help`` (what ``--help``
    prints), ``metavar``, ``callback`` (checks the value at parse time, before any model loads)
    and ``argument`` (a positional argument instead of a flag; default ``...``: required)."""

    name: str
    flags: tuple[str, ...]
    type: Any
    default: Any
    help: str
    metavar: str | None = None
    callback: Callable[[Any], Any] | None = None
    argument: bool = False

    def with_default(self, default: Any) -> Option:
        """The same option with one command's own default (``--out``: ``./<command>-out``)."""
        return replace(self, default=default)

    def parameter(self) -> inspect.Parameter:
        """This option as the keyword parameter typer reads (``Annotated[type, typer.Option]``)."""
        if self.argument:
            info = typer.Argument(help=self.help, metavar=self.metavar)
        else:
            info = typer.Option(*self.flags, help=self.help, metavar=self.metavar,
                                callback=self.callback)
        default = inspect.Parameter.empty if self.default is ... else self.default  # required
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                 annotation=Annotated[self.type, info])


class Args(SimpleNamespace):
    """A command's parsed arguments: one attribute per option (``a.model``, ``a.out``, ...),
    and ``a.ctx``, the click context (what was typed, the claim's flags, resources closed when
    the command ends)."""

    ctx: typer.Context


def command(options: Sequence[Option], short_help: str) -> Callable[[Callable], Callable]:
    """Register ``body(args: Args)`` on ``app`` as the command of its name, with ``options`` in
    that order (``--help`` lists them so) and ``body``'s docstring as its help. Returns the
    registered function (called by typer with one keyword per option)."""
    names = [o.name for o in options]
    if len(set(names)) != len(names):
        raise ValueError(f"options named twice: {sorted({n for n in names if names.count(n) > 1})}")

    def register(body: Callable[[Args], Any]) -> Callable:
        def run(ctx: typer.Context, **params: Any) -> Any:
            return body(Args(ctx=ctx, **params))

        ctx = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation=typer.Context)
        run.__signature__ = inspect.Signature([ctx, *(o.parameter() for o in options)])
        run.__annotations__ = {}  # (typer reads the signature; no string annotations to resolve)
        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            setattr(run, attr, getattr(body, attr))
        run.__wrapped__ = body  # (inspect.getsource: the body; the signature stays the table's)
        return app.command(short_help=short_help)(run)

    return register
