"""``distill``: one student, or the ablation grid (``--ablation``). Its options are declared
here, in one place.
"""

from __future__ import annotations

from pathlib import Path

import typer

from circuitkit.cli.app import app
from circuitkit.cli.checks import _claim_folder
from circuitkit.cli.console import _fail, _given, _same_command
from circuitkit.cli.options import Out, Progress


@app.command(short_help="Distil a teacher into a student (or the ablation).")
def distill(
    ctx: typer.Context,
    teacher: str = typer.Option("icd-teacher", "--teacher", help="Teacher: shipped toy, folder or "
                                "hub id over the task's vocabulary.", metavar="NAME"),
    student_config: str = typer.Option("student", "--student-config", help="Student preset "
                                       "(training.PRESETS: 'student', 2 layers x 4 heads, d 128; "
                                       "'student4', 4 layers x 4 heads, d 96, Phase 2 below its "
                                       "output layer) or a JSON file of Preset fields; "
                                       "--ablation: default both presets.", metavar="NAME"),
    task: str = typer.Option("icd10", "--task", "-t", help="Built-in CoT task.", metavar="TASK"),
    lambda_p1: float = typer.Option(1.0, "--lambda-p1", help="Weight of L_P1 (Phase-1 heads).",
                                    metavar="WEIGHT"),
    lambda_p2: float = typer.Option(1.0, "--lambda-p2", help="Weight of L_P2 (Phase-2 heads).",
                                    metavar="WEIGHT"),
    lambda_ns: float = typer.Option(0.0, "--lambda-ns", help="Weight of the non-selective "
                                    "all-heads attention loss (baseline).", metavar="WEIGHT"),
    steps: int = typer.Option(None, "--steps", help="Training steps (default 1000; the "
                              "ablation: each variant's, after --pretrain; its size's, 120).",
                              metavar="N"),
    batch_size: int = typer.Option(64, "--batch-size", help="CoT rows per step.", metavar="N"),
    pool_size: int = typer.Option(16384, "--pool-size", help="Train notes in the signal store.",
                                  metavar="N"),
    seed: int = typer.Option(0, help="Student seed (init and batch order).", metavar="SEED"),
    store: Path = typer.Option(None, "--store", help="Signal-store folder (default OUT/signals).",
                               metavar="DIR"),
    balance: str = typer.Option("cap", "--balance", help="How the terms' gradients combine: "
                                "'cap' (the CoT part clipped at 1 on its own, each mechanistic "
                                "term's gradient capped at --grad-ratio x it, then times its "
                                "lambda) or 'global_clip' (the total's gradient clipped at 1, "
                                "which lets the mechanistic terms shrink the CoT step).",
                                metavar="cap|global_clip"),
    grad_ratio: float = typer.Option(0.5, "--grad-ratio", help="--balance cap: the most a "
                                     "mechanistic term's gradient counts for, as a multiple of "
                                     "the CoT part's norm.", metavar="R"),
    init: str = typer.Option(None, "--init", help="Start the student from this HF folder's "
                             "weights (or a shipped model, e.g. icd-student-cot) of the same "
                             "preset, instead of a fresh initialisation.", metavar="MODEL"),
    ablation: bool = typer.Option(False, "--ablation", help="Train and measure CoT-only, +P1, "
                                  "+P2, +P1+P2 and non-selective students, for both student "
                                  "presets and two data sizes; write OUT/ablation.csv."),
    seeds: int = typer.Option(3, "--seeds", help="Ablation: seeds per variant.", metavar="N"),
    max_seeds: int = typer.Option(None, "--max-seeds", help="Ablation: seeds for headline "
                                  "comparisons whose intervals overlap (default --seeds).",
                                  metavar="N"),
    workers: int = typer.Option(1, "--workers", help="Ablation: runs trained side by side (one "
                                "thread each).", metavar="N"),
    pretrain: int = typer.Option(None, "--pretrain", help="Ablation: CoT-only steps of the one "
                                 "start every run of a cell begins from (default its size's: "
                                 "800; 0: each seed's fresh initialisation).", metavar="N"),
    quick: bool = typer.Option(False, "--quick", help="Tiny sizes (CI)."),
    size: str = typer.Option(None, "--size", help="Ablation: the grid's size (ablation.SIZES: "
                             "'default'; 'grid', issue 35's arms, early-stopped baseline and "
                             "curves; 'grid-quick'; --quick is 'quick').", metavar="NAME"),
    variants: str = typer.Option(None, "--variants", help="Ablation: comma-separated variants "
                                 "(default cot,p1,p2,p1+p2,nonselective; also "
                                 "p1+p2-causal: the causal heads).",
                                 metavar="V,V"),
    out: Out = Path("distill-out"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished student (or "
                                   "training state) of another configuration in --out; "
                                   "--ablation: start a grid of another configuration over."),
    progress: Progress = True,
) -> None:
    """Distil a teacher into a student with L_CoT + lambda_P1 L_P1 + lambda_P2 L_P2 (resumable:
    rerun the same command), or run the ablation table (--ablation)."""
    from circuitkit.files import check_writable_dir

    given = lambda name: _given(ctx, name)  # noqa: E731

    try:
        if given("seeds") and not ablation:
            raise ValueError("--seeds is the ablation's seeds per variant: add --ablation, or "
                             "use --seed for one student.")
        for opt in ("max_seeds", "workers", "pretrain", "size", "variants"):
            if given(opt) and not ablation:
                raise ValueError(f"--{opt.replace('_', '-')} is an ablation option: add "
                                 "--ablation.")
        for opt in ("batch_size", "pool_size", "seed", "store"):
            if ablation and given(opt):
                raise ValueError(f"--{opt.replace('_', '-')} is a single student's option; the "
                                 "ablation's sizes, seeds and stores are its own (--quick, "
                                 "--seeds, --steps, --pretrain): drop it.")
        if ablation and given("init"):
            raise ValueError("--init starts one student from given weights; the ablation "
                             "trains every student from its seed's initialisation: drop --init.")
        check_writable_dir(out)
        _claim_folder(out, "distill")
        if ablation:
            from circuitkit.distill.ablation import STUDENTS, format_table, run_ablation

            frame = run_ablation(out, teacher=teacher, seeds=seeds, max_seeds=max_seeds,
                                 size="quick" if quick else (size or "default"),
                                 variants=tuple(v.strip() for v in variants.split(","))
                                 if variants else None,
                                 students=(student_config,) if given("student_config")
                                 else STUDENTS, lambda_p1=lambda_p1, lambda_p2=lambda_p2,
                                 task=task, workers=workers, steps=steps, balance=balance,
                                 grad_ratio=grad_ratio, pretrain=pretrain,
                                 overwrite=overwrite, progress=progress,
                                 **({"lambda_ns": lambda_ns} if given("lambda_ns") else {}))
            typer.echo(format_table(frame))
            typer.echo(f"wrote {out / 'ablation.csv'}, {out / 'comparisons.csv'} and "
                       f"{out / 'runs.csv'}")
            return
        from circuitkit.distill.train import DistillConfig, train_student

        kw = dict(pool_size=96, shard_size=48, steps=12, batch_size=16, warmup=2,
                  save_every=6, score_examples=32) if quick else {}
        # --quick sets sizes the command line leaves out; what it names wins
        kw.update({k: v for k, v in (("pool_size", pool_size), ("batch_size", batch_size))
                   if not quick or given(k)})
        if steps is not None:
            kw["steps"] = steps
        cfg = DistillConfig(teacher=teacher, task=task, student=student_config,
                            lambda_p1=lambda_p1, lambda_p2=lambda_p2, lambda_ns=lambda_ns,
                            seed=seed, store=str(store) if store else None,
                            balance=balance, grad_ratio=grad_ratio, init=init, **kw)
        folder = train_student(cfg, out, overwrite=overwrite, progress=progress)
    except (ValueError, OSError) as e:
        _fail(str(e) or type(e).__name__)
    except KeyboardInterrupt:
        typer.secho("interrupted; rerun the same command to resume:\n  "
                    f"{_same_command(ctx)}", err=True)
        raise typer.Exit(130) from None
    typer.echo(_distill_summary(folder))
    typer.echo(f"student saved to {folder}; evaluate it with: circuitkit evaluate --model "
               f"{folder}")


def _distill_summary(folder: Path) -> str:
    """One line of what training did, from the student's ``distill.json``: steps, time, the
    last step's loss terms."""
    import json

    from circuitkit.distill.train import RECORD

    try:
        record = json.loads((Path(folder) / RECORD).read_text())
        cols, last = record["history_columns"], record["history"][-1]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return f"trained; no training record in {folder} to summarise"
    row = dict(zip(cols, last, strict=False))
    terms = ", ".join(f"{k} {row[k]:.4g}" for k in ("total", "cot", "p1", "p2", "ns")
                      if isinstance(row.get(k), (int, float)))
    return (f"trained {int(row.get('step', len(record['history'])))} steps in "
            f"{record.get('train_seconds', 0):.1f} s; last step's loss: {terms}")
