"""The typer ``app`` every command registers on, and its root callback."""

from __future__ import annotations

import typer

from circuitkit.cli.console import CLAIMED, FRESH_CLAIMS, _warnings_as_lines

app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,
    no_args_is_help=True,
    help="Find and distil the coarse-to-fine reasoning circuits of transformers over huge "
    "label spaces.",
)


@app.callback()
def _root(ctx: typer.Context) -> None:
    """circuitkit: characterize, then distill."""
    FRESH_CLAIMS.clear()  # (what an earlier command of this process claimed is not this one's)
    CLAIMED.clear()
    ctx.with_resource(_warnings_as_lines())  # for the whole command
