"""``evaluate`` and ``report``.
"""

from __future__ import annotations

from pathlib import Path

import typer

from circuitkit.cli import options as opt
from circuitkit.cli.app import app
from circuitkit.cli.checks import _check_suffix, _positive
from circuitkit.cli.console import _echo_json, _errors_as_lines, _fail
from circuitkit.cli.format import METRIC_MEANINGS
from circuitkit.cli.load import _load


@app.command(short_help="Task metrics: focus, confusion, F1, exact match.")
def evaluate(
    model: opt.Model = opt.DEFAULT_MODEL,
    task: opt.Task = opt.DEFAULT_TASK,
    n_examples: opt.N = None,
    split: opt.Split = "test",
    seed: opt.Seed = 0,
    batch_size: opt.BatchSize = 64,
    progress: opt.Progress = True,
    as_json: opt.Json = False,
) -> None:
    """Reasoning Focus, Near-Miss Confusion, confusion rate, Macro/micro-F1 and exact match."""
    import circuitkit as ck

    with _errors_as_lines():
        _positive("--batch-size", batch_size, "notes per forward pass")
    the_model, the_task = _load(model, task, n_examples, seed, split, 2, progress=progress)
    try:
        scores = ck.evaluate(the_model, the_task, batch_size=batch_size, progress=progress)
    except ValueError as e:  # a model with NaN weights: one line, not a table of NaN
        _fail(f"{model}: {e}")
    if as_json:
        return _echo_json(dict(model=model, task=task, n_examples=len(the_task), split=split,
                               seed=seed, metrics={k: round(v, 4) if isinstance(v, float) else v
                                                   for k, v in scores.items()},
                               meanings={k: METRIC_MEANINGS[k] for k in scores
                                         if k in METRIC_MEANINGS}))
    typer.echo(f"{model} on {task} ({len(the_task)} notes, split {split}, seed {seed})")
    width = max(15, *(len(k) + 1 for k in scores))
    for k, v in scores.items():
        shown = f"{v:7.4f}" if isinstance(v, float) else str(v)
        typer.echo(f"  {k:<{width}}{shown}   {METRIC_MEANINGS.get(k, '')}")


@app.command(short_help="Rewrite a results folder's report.html.")
def report(
    run_dir: Path = typer.Argument(..., help="Results folder (characterize --out or patch --out).",
                                   metavar="RUN_DIR"),
    out: Path = typer.Option(None, "--out", "-o",
                             help="Output file (default: RUN_DIR/report.html).", metavar="FILE"),
    attention: bool = typer.Option(True, "--attention/--no-attention", help="Attention views of "
                                   "the top heads (loads the model named in summary.json)."),
) -> None:
    """One self-contained report.html (all JavaScript inlined: opens offline, can be mailed)."""
    import time

    from circuitkit.experiments.report import describe_written, write_report

    t0 = time.perf_counter()
    with _errors_as_lines(ValueError, OSError):
        if out is not None and not out.is_dir() and out.suffix.lower() not in (".html",
                                                                              ".htm"):
            _check_suffix(out, ".html", "report writes one HTML page")
        path = write_report(run_dir, out, attention=attention)
    typer.echo(describe_written(path, time.perf_counter() - t0))
