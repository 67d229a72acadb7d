"""``score`` and ``characterize``: head scores and the main job.
"""

from __future__ import annotations

from pathlib import Path

import typer

from circuitkit.cli import options as opt
from circuitkit.cli.app import app
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
from circuitkit.experiments.characterize import N_RANDOM, N_RANDOM_ABLATION

STAGES_HELP = ("Patch every head at each of the task's position groups (evidence, anchor, "
               "shortlist, answer, and the positions the metric reads), both directions, on the "
               "selection and the held-out notes: where each phase's decision is made, the "
               "stable heads and the claims table the findings lead with; OUT/groups/ (exact "
               "patching; on by default, --no-stages for a quick run).")


@app.command(short_help="Phase-1 and Phase-2 scores of every head (CSV).")
def score(
    model: opt.Model = opt.DEFAULT_MODEL,
    task: opt.Task = opt.DEFAULT_TASK,
    n_examples: opt.N = None,
    split: opt.Split = "test",
    seed: opt.Seed = 0,
    k: opt.K = 5,
    text: opt.Text = "auto",
    batch_size: opt.BatchSize = None,
    out: Path = typer.Option(Path("score-out/scores.csv"), "--out", "-o", help="CSV file to "
                             "write (default ./score-out/scores.csv).", metavar="FILE"),
    progress: opt.Progress = True,
    as_json: opt.Json = False,
) -> None:
    """Phase-1 (CoarseScore) and Phase-2 (RefineScore) scores of every head, as CSV."""
    import circuitkit as ck
    from circuitkit import files
    from circuitkit.models import ModelNotAvailableError, check_available, hf_progress
    from circuitkit.scoring.heads import score_heads
    from circuitkit.scoring.text import load_for

    flag = _text_flag(text)
    with _errors_as_lines(ModelNotAvailableError, FileNotFoundError, ValueError, OSError):
        _positive("--batch-size", batch_size, "examples per forward pass")
        _check_k(model, k)
        check_available(model)  # missing weights: before any model loads or --out is made
        n_examples = _n_for(task, n_examples)
        if not out.is_dir():  # (a folder: check_writable_file says so)
            _check_suffix(out, ".csv", "score writes CSV", "or --json to print JSON")
        made = _missing_folders(out.parent)
        files.check_writable_file(out, "--out", "scores.csv")
        if made:  # (removed again if the run is refused before it writes)
            FRESH_CLAIMS[:] = [(out.parent, made)]
        with hf_progress(progress):  # --no-progress: transformers' bars too
            the_model = ck.load_model(model)
        the_task, _ = load_for(the_model, task, n_examples, seed, split, flag)
        df = score_heads(the_model, the_task, batch_size=batch_size, progress=progress, k=k,
                         seed=seed)  # as characterize scores: the same table for the same flags
        files.write_text(out, df.to_csv(index=False))
    if as_json:
        return _echo_json(dict(command="score", n_examples=len(the_task), split=split, seed=seed,
                               heads=df.to_dict("records"), files=[str(out)]))
    _print_scores(df, k, the_task, split, seed)
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


@app.command(short_help="The main job: sweeps, scores, validation, report.")
def characterize(
    ctx: typer.Context,
    model: opt.Model = opt.DEFAULT_MODEL,
    task: opt.Task = opt.DEFAULT_TASK,
    out: opt.Out = Path("characterize-out"),
    n_examples: opt.N = None,
    split: opt.Split = "test",
    seed: opt.Seed = 0,
    k: opt.K = 5,
    n_random: opt.NRandom = N_RANDOM,
    n_random_ablation: opt.NRandomAblation = N_RANDOM_ABLATION,
    patch_method: opt.PatchMethod = "exact",
    text: opt.Text = "auto",
    batch_size: opt.BatchSize = None,
    edges: bool = typer.Option(False, "--edges", help="Also patch the edges from the top -k "
                               "Phase-1 heads into the top -k Phase-2 heads (q, k, v; the "
                               "Phase-2 metric) and their circuit's faithfulness: OUT/edges/."),
    stages: bool = typer.Option(True, "--stages/--no-stages", help=STAGES_HELP),
    select_n: opt.SelectN = "half",
    corruption: opt.Corruption = "note",
    overwrite: opt.Overwrite = False,
    progress: opt.Progress = True,
    as_json: opt.Json = False,
) -> None:
    """The main job: head patching (both directions, each phase the task has steps for),
    scores, causal validation, one results folder (scores.csv, validation.csv, summary.json,
    patch-p{1,2}-{denoise,noise}, report.html)."""
    from circuitkit.experiments.characterize import CharacterizeOptions
    from circuitkit.experiments.characterize import characterize as run
    from circuitkit.models import ModelNotAvailableError, check_available, hf_progress
    from circuitkit.patching.inputs import METHODS

    flag = _text_flag(text)
    try:
        _one_of("--method", patch_method, METHODS)
        _positive("--batch-size", batch_size, "sequences per forward pass")
        _positive("--n-random", n_random, "random head sets")
        _positive("--n-random-ablation", n_random_ablation, "random head sets")
        _check_k(model, k)
        n_examples = _n_for(task, n_examples)
        select_n = _select_n_flag(select_n, n_examples)
        check_available(model)  # missing weights: before any model loads or --out is made
        _claim_out(ctx, "characterize", out, overwrite, n_examples=n_examples,
                   select_n=select_n)
        with hf_progress(progress):  # --no-progress: transformers' bars too
            summary = run(model, task, out, CharacterizeOptions(
                n_examples=n_examples, seed=seed, split=split, k=k, n_random=n_random,
                n_random_ablation=n_random_ablation, batch_size=batch_size,
                patch_method=patch_method, text=flag, progress=progress, edges=edges,
                stages=stages, select_n=select_n,
                task_kwargs=None if corruption == "note" else {"corruption": corruption}))
    except (ModelNotAvailableError, FileNotFoundError, ValueError, OSError) as e:
        _fail(_message(e))
    except KeyboardInterrupt:
        _interrupted("finished steps (and finished chunks of the current sweep) are in "
                     f"{out}. Resume with the same command:\n  {_same_command(ctx)}")
    if as_json:
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
