"""``score`` and ``characterize``: head scores and the main job.
"""

from __future__ import annotations

from pathlib import Path

import typer

from circuitkit.cli import options as o
from circuitkit.cli.checks import (
    _check_k,
    _check_suffix,
    _claim_out,
    _missing_folders,
    _n_for,
    _one_of,
    _positive,
    _select_n_flag,
    _text_flag,
)
from circuitkit.cli.command import Args, command
from circuitkit.cli.console import (
    FRESH_CLAIMS,
    _echo_json,
    _errors_as_lines,
    _fail,
    _interrupted,
    _message,
    _same_command,
    echo,
)
from circuitkit.cli.format import _run_words

SCORE = (o.MODEL, o.TASK, o.N, o.SPLIT, o.SEED, o.K, o.TEXT, o.BATCH_SIZE, o.SCORE_OUT,
         o.PROGRESS, o.JSON)


@command(SCORE, short_help="Phase-1 and Phase-2 scores of every head (CSV).")
def score(a: Args) -> None:
    """Phase-1 (CoarseScore) and Phase-2 (RefineScore) scores of every head, as CSV."""
    import circuitkit as ck
    from circuitkit import files
    from circuitkit.models import ModelNotAvailableError, check_available, hf_progress
    from circuitkit.scoring.heads import score_heads
    from circuitkit.scoring.text import load_for

    out = a.out
    flag = _text_flag(a.text)
    with _errors_as_lines(ModelNotAvailableError, FileNotFoundError, ValueError, OSError):
        _positive("--batch-size", a.batch_size, "examples per forward pass")
        _check_k(a.model, a.k)
        check_available(a.model)  # missing weights: before any model loads or --out is made
        n_examples = _n_for(a.task, a.n_examples)
        if not out.is_dir():  # (a folder: check_writable_file says so)
            _check_suffix(out, ".csv", "score writes CSV", "or --json to print JSON")
        made = _missing_folders(out.parent)
        files.check_writable_file(out, "--out", "scores.csv")
        if made:  # (removed again if the run is refused before it writes)
            FRESH_CLAIMS[:] = [(out.parent, made)]
        with hf_progress(a.progress):  # --no-progress: transformers' bars too
            the_model = ck.load_model(a.model)
        the_task, _ = load_for(the_model, a.task, n_examples, a.seed, a.split, flag)
        df = score_heads(the_model, the_task, batch_size=a.batch_size, progress=a.progress,
                         k=a.k, seed=a.seed)  # as characterize: the same table, same flags
        files.write_text(out, df.to_csv(index=False))
    if a.as_json:
        return _echo_json(dict(command="score", n_examples=len(the_task), split=a.split,
                               seed=a.seed, heads=df.to_dict("records"), files=[str(out)]))
    _print_scores(df, a.k, the_task, a.split, a.seed)
    typer.echo(f"wrote {out}")


def _print_scores(df, k: int, the_task, split: str, seed: int) -> None:
    from circuitkit.scoring.heads import scored_phases, top_heads

    for phase, cols in ((1, ["layer", "head", "sharpness", "anchor_alignment",
                             "phase1_inclusion", "coarse_score"]),
                        (2, ["layer", "head", "shortlist_share", "key_preference", "ov_copy",
                             "mechanism", "margin_widening", "phase2_inclusion",
                             "refine_score"])):
        if phase not in scored_phases(df):  # not five NaN rows under a "top" title
            typer.echo(f"no Phase-{phase} scores: the task has no Phase-{phase} steps")
            continue
        best = df.set_index(["layer", "head"]).loc[top_heads(df, phase, k)].reset_index()
        echo(f"top Phase-{phase} heads by {cols[-1]} ({_run_words(the_task, split, seed)}):"
             "\n" + best[cols].to_string(index=False))


CHARACTERIZE = (o.MODEL, o.TASK, o.OUT.with_default(Path("characterize-out")), o.N, o.SPLIT,
                o.SEED, o.K, o.N_RANDOM_SETS, o.N_RANDOM_ABLATION_SETS, o.PATCH_METHOD, o.TEXT,
                o.BATCH_SIZE, o.EDGES, o.STAGES, o.SELECT_N, o.CORRUPTION, o.OVERWRITE,
                o.PROGRESS, o.JSON)


@command(CHARACTERIZE, short_help="The main job: sweeps, scores, validation, report.")
def characterize(a: Args) -> None:
    """The main job: head patching (both directions, each phase the task has steps for),
    scores, causal validation, one results folder (scores.csv, validation.csv, summary.json,
    patch-p{1,2}-{denoise,noise}, report.html)."""
    from circuitkit.experiments.characterize import CharacterizeOptions
    from circuitkit.experiments.characterize import characterize as run
    from circuitkit.models import ModelNotAvailableError, check_available, hf_progress
    from circuitkit.patching.inputs import METHODS

    out = a.out
    flag = _text_flag(a.text)
    try:
        _one_of("--method", a.patch_method, METHODS)
        _positive("--batch-size", a.batch_size, "sequences per forward pass")
        _positive("--n-random", a.n_random, "random head sets")
        _positive("--n-random-ablation", a.n_random_ablation, "random head sets")
        _check_k(a.model, a.k)
        n_examples = _n_for(a.task, a.n_examples)
        select_n = _select_n_flag(a.select_n, n_examples)
        check_available(a.model)  # missing weights: before any model loads or --out is made
        _claim_out(a.ctx, "characterize", out, a.overwrite, n_examples=n_examples,
                   select_n=select_n)
        with hf_progress(a.progress):  # --no-progress: transformers' bars too
            summary = run(a.model, a.task, out, CharacterizeOptions(
                n_examples=n_examples, seed=a.seed, split=a.split, k=a.k, n_random=a.n_random,
                n_random_ablation=a.n_random_ablation, batch_size=a.batch_size,
                patch_method=a.patch_method, text=flag, progress=a.progress, edges=a.edges,
                stages=a.stages, select_n=select_n, task_kwargs=None if a.corruption == "note"
                else {"corruption": a.corruption}))
    except (ModelNotAvailableError, FileNotFoundError, ValueError, OSError) as e:
        _fail(_message(e))
    except KeyboardInterrupt:
        _interrupted("finished steps (and finished chunks of the current sweep) are in "
                     f"{out}. Resume with the same command:\n  {_same_command(a.ctx)}")
    if a.as_json:
        return _echo_json(dict(command="characterize", out=str(out),
                               findings=_findings_json(out), summary=summary))
    _print_characterize(out, summary)


def _findings_json(out: Path) -> dict:
    """The findings ``--json`` prints: the run's line and each finding's title and sentences."""
    from circuitkit.experiments.report import findings_in

    line, found = findings_in(out)
    return dict(run=line, items=[dict(title=f.title, headline=f.headline, notes=list(f.notes))
                                 for f in found])


def _print_characterize(out: Path, summary: dict) -> None:
    """The findings, then one line per step's files (each file named once)."""
    import shutil

    from circuitkit.experiments.findings import format_findings
    from circuitkit.experiments.report import findings_in

    width = min(100, max(60, shutil.get_terminal_size((88, 24)).columns - 1))
    line, found = findings_in(out)
    echo(format_findings(found, line, width))  # (names from files: escaped)
    steps, ran = summary.get("steps", {}), summary.get("steps_run_this_call", [])
    for step in ran:
        names = steps[step]["files"]
        stems = {Path(n).stem for n in names}
        if len(stems) == 1 and len(names) > 1:
            suffixes = ",".join(Path(n).suffix[1:] for n in names)
            typer.echo(f"wrote {out / stems.pop()}.{{{suffixes}}}")
        else:
            typer.echo("wrote " + ", ".join(str(out / n) for n in names))
    reused = [s for s in steps if s not in ran]
    if reused:
        typer.echo(f"kept (finished by an earlier run): {', '.join(reused)}")
    typer.echo(f"wrote {out / 'summary.json'}")
    report = out / "report.html"
    if report.exists():
        typer.echo(f"wrote {report} ({report.stat().st_size / 1e6:.1f} MB): open it in a "
                   "browser, offline")
