"""``evaluate`` and ``report``.
"""

from __future__ import annotations

import typer

from circuitkit.cli import options as o
from circuitkit.cli.checks import _check_suffix, _positive
from circuitkit.cli.command import Args, command
from circuitkit.cli.console import _echo_json, _errors_as_lines, _fail
from circuitkit.cli.format import METRIC_MEANINGS
from circuitkit.cli.load import _load

EVALUATE = (o.MODEL, o.TASK, o.N, o.SPLIT, o.SEED, o.BATCH_SIZE.with_default(64), o.PROGRESS,
            o.JSON)


@command(EVALUATE, short_help="Task metrics: focus, confusion, F1, exact match.")
def evaluate(a: Args) -> None:
    """Reasoning Focus, Near-Miss Confusion, confusion rate, Macro/micro-F1 and exact match."""
    import circuitkit as ck

    with _errors_as_lines():
        _positive("--batch-size", a.batch_size, "notes per forward pass")
    the_model, the_task = _load(a.model, a.task, a.n_examples, a.seed, a.split, 2,
                                progress=a.progress)
    try:
        scores = ck.evaluate(the_model, the_task, batch_size=a.batch_size, progress=a.progress)
    except ValueError as e:  # a model with NaN weights: one line, not a table of NaN
        _fail(f"{a.model}: {e}")
    if a.as_json:
        return _echo_json(dict(model=a.model, task=a.task, n_examples=len(the_task),
                               split=a.split, seed=a.seed,
                               metrics={k: round(v, 4) if isinstance(v, float) else v
                                        for k, v in scores.items()},
                               meanings={k: METRIC_MEANINGS[k] for k in scores
                                         if k in METRIC_MEANINGS}))
    typer.echo(f"{a.model} on {a.task} ({len(the_task)} notes, split {a.split}, seed {a.seed})")
    width = max(15, *(len(k) + 1 for k in scores))
    for k, v in scores.items():
        shown = f"{v:7.4f}" if isinstance(v, float) else str(v)
        typer.echo(f"  {k:<{width}}{shown}   {METRIC_MEANINGS.get(k, '')}")


@command((o.RUN_DIR, o.REPORT_OUT, o.ATTENTION), short_help="Rewrite a results folder's "
         "report.html.")
def report(a: Args) -> None:
    """One self-contained report.html (all JavaScript inlined: opens offline, can be mailed)."""
    import time

    from circuitkit.experiments.report import describe_written, write_report

    t0 = time.perf_counter()
    out = a.out
    with _errors_as_lines(ValueError, OSError):
        if out is not None and not out.is_dir() and out.suffix.lower() not in (".html",
                                                                              ".htm"):
            _check_suffix(out, ".html", "report writes one HTML page")
        path = write_report(a.run_dir, out, attention=a.attention)
    typer.echo(describe_written(path, time.perf_counter() - t0))
