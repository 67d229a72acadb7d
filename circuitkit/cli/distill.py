"""``distill``: one student, or the ablation grid (``--ablation``). Its options are declared
here, in one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from circuitkit.cli.app import app
from circuitkit.cli.checks import _claim_folder, _missing_folders
from circuitkit.cli.console import _fail, _given, _interrupted, _same_command
from circuitkit.cli.options import Out, Progress, _opt

Teacher = Annotated[str, _opt("--teacher", "Teacher: shipped toy, folder or hub id over the "
                                           "task's vocabulary.", "NAME")]
StudentConfig = Annotated[str, _opt(
    "--student-config", "Student preset (training.PRESETS: 'student', 2 layers x 4 heads, d "
    "128; 'student4', 4 layers x 4 heads, d 96, Phase 2 below its output layer) or a JSON file "
    "of Preset fields; --ablation: default both presets.", "NAME")]
CotTask = Annotated[str, _opt("--task", "Built-in CoT task.", "TASK", "-t")]
LambdaP1 = Annotated[float, _opt("--lambda-p1", "Weight of L_P1 (Phase-1 heads).", "WEIGHT")]
LambdaP2 = Annotated[float, _opt("--lambda-p2", "Weight of L_P2 (Phase-2 heads).", "WEIGHT")]
LambdaNS = Annotated[float, _opt("--lambda-ns", "Weight of the non-selective all-heads "
                                                "attention loss (baseline).", "WEIGHT")]
Steps = Annotated[int | None, _opt("--steps", "Training steps (default 1000; the ablation: "
                                              "each variant's, after --pretrain; its size's, "
                                              "120).", "N")]
RowsPerStep = Annotated[int, _opt("--batch-size", "CoT rows per step.", "N")]
PoolSize = Annotated[int, _opt("--pool-size", "Train notes in the signal store.", "N")]
StudentSeed = Annotated[int, _opt("--seed", "Student seed (init and batch order).", "SEED")]
Store = Annotated[Path | None, _opt("--store", "Signal-store folder (default OUT/signals).",
                                    "DIR")]
Balance = Annotated[str, _opt(
    "--balance", "How the terms' gradients combine (the CoT part clipped at 1 on its own in "
    "all but global_clip): 'share' (each mechanistic term scaled to lambda x the CoT part's "
    "norm: lambda is its share of the step), 'cap' (each term's gradient capped at "
    "--grad-ratio x the CoT part, then times its lambda: before issue 50), 'none' (the "
    "gradient of L_total, unscaled) or 'global_clip' (the total's gradient clipped at 1).",
    "share|cap|none|global_clip")]
GradRatio = Annotated[float, _opt("--grad-ratio", "--balance cap: the most a mechanistic "
                                                  "term's gradient counts for, as a multiple of "
                                                  "the CoT part's norm.", "R")]
Init = Annotated[str | None, _opt("--init", "Start the student from this HF folder's weights "
                                            "(or a shipped model, e.g. icd-student-cot) of the "
                                            "same preset, instead of a fresh initialisation.",
                                  "MODEL")]
Ablation = Annotated[bool, _opt("--ablation", "Train and measure CoT-only, +P1, +P2, +P1+P2 "
                                              "and non-selective students, for both student "
                                              "presets and two data sizes; write "
                                              "OUT/ablation.csv.")]
Seeds = Annotated[int, _opt("--seeds", "Ablation: seeds per variant.", "N")]
MaxSeeds = Annotated[int | None, _opt("--max-seeds", "Ablation: seeds for headline comparisons "
                                                     "whose intervals overlap (default "
                                                     "--seeds).", "N")]
Workers = Annotated[int, _opt("--workers", "Ablation: runs trained side by side (one thread "
                                           "each).", "N")]
Pretrain = Annotated[int | None, _opt("--pretrain", "Ablation: CoT-only steps of the one start "
                                                    "every run of a cell begins from (default "
                                                    "its size's: 800; 0: each seed's fresh "
                                                    "initialisation).", "N")]
Quick = Annotated[bool, _opt("--quick", "Tiny sizes (CI).")]
Size = Annotated[str | None, _opt("--size", "Ablation: the grid's size (ablation.SIZES: "
                                            "'default'; 'grid', issue 35's arms, early-stopped "
                                            "baseline and curves; 'sweep', issue 50's "
                                            "lambda sweep; 'grid-quick'; --quick is "
                                            "'quick').", "NAME")]
Variants = Annotated[str | None, _opt("--variants", "Ablation: comma-separated variants "
                                                    "(default cot,p1,p2,p1+p2,nonselective; "
                                                    "also p1+p2-causal: the causal heads; "
                                                    "V@W scales V's lambdas by W, e.g. "
                                                    "p1+p2@0.3).",
                                      "V,V")]
Overwrite = Annotated[bool, _opt("--overwrite", "Replace a finished student (or training "
                                                "state) of another configuration in --out; "
                                                "--ablation: start a grid of another "
                                                "configuration over.")]
ABLATION_ONLY = ("seeds", "max_seeds", "workers", "pretrain", "size", "variants")
STUDENT_ONLY = ("batch_size", "pool_size", "seed", "store", "init")


@app.command(short_help="Distil a teacher into a student (or the ablation).")
def distill(
    ctx: typer.Context, teacher: Teacher = "icd-teacher", student_config: StudentConfig = "student",
    task: CotTask = "icd10", lambda_p1: LambdaP1 = 1.0, lambda_p2: LambdaP2 = 1.0,
    lambda_ns: LambdaNS = 0.0, steps: Steps = None, batch_size: RowsPerStep = 64,
    pool_size: PoolSize = 16384, seed: StudentSeed = 0, store: Store = None,
    balance: Balance = "share", grad_ratio: GradRatio = 0.5, init: Init = None,
    ablation: Ablation = False, seeds: Seeds = 3, max_seeds: MaxSeeds = None,
    workers: Workers = 1, pretrain: Pretrain = None, quick: Quick = False, size: Size = None,
    variants: Variants = None, out: Out = Path("distill-out"), overwrite: Overwrite = False,
    progress: Progress = True,
) -> None:
    """Distil a teacher into a student with L_CoT + lambda_P1 L_P1 + lambda_P2 L_P2 (resumable:
    rerun the same command), or run the ablation table (--ablation)."""
    from circuitkit.files import check_writable_dir

    a = dict(locals())
    given = lambda name: _given(ctx, name)  # noqa: E731
    try:
        _check_distill_flags(given, ablation)
        made = _missing_folders(out)  # (removed again if the run is refused before it writes)
        check_writable_dir(out)
        _claim_folder(out, "distill", ctx, made=made)
        if ablation:
            return _grid(a, given)
        folder = _one_student(a, given)
    except (ValueError, OSError) as e:
        _fail(str(e) or type(e).__name__)
    except KeyboardInterrupt:
        _interrupted(f"rerun the same command to resume:\n  {_same_command(ctx)}")
    typer.echo(_distill_summary(folder))
    typer.echo(f"student saved to {folder}; evaluate it with: circuitkit evaluate --model "
               f"{folder}")


def _check_distill_flags(given, ablation: bool) -> None:
    """One line for a flag of the other mode (named as typed)."""
    if given("seeds") and not ablation:
        raise ValueError("--seeds is the ablation's seeds per variant: add --ablation, or use "
                         "--seed for one student.")
    for opt in ABLATION_ONLY[1:]:
        if given(opt) and not ablation:
            raise ValueError(f"--{opt.replace('_', '-')} is an ablation option: add --ablation.")
    for opt in STUDENT_ONLY[:-1]:
        if ablation and given(opt):
            raise ValueError(f"--{opt.replace('_', '-')} is a single student's option; the "
                             "ablation's sizes, seeds and stores are its own (--quick, "
                             "--seeds, --steps, --pretrain): drop it.")
    if ablation and given("init"):
        raise ValueError("--init starts one student from given weights; the ablation trains "
                         "every student from its seed's initialisation: drop --init.")


def _grid(a: dict, given) -> None:
    """``--ablation``: ``ablation.run_ablation`` of the flags, its table printed."""
    from circuitkit.experiments.distill_grid import (
        STUDENTS,
        GridOptions,
        format_table,
        run_ablation,
    )

    variants = tuple(v.strip() for v in a["variants"].split(",")) if a["variants"] else None
    frame = run_ablation(a["out"], GridOptions(
        teacher=a["teacher"], seeds=a["seeds"], max_seeds=a["max_seeds"],
        size="quick" if a["quick"] else (a["size"] or "default"), variants=variants,
        students=(a["student_config"],) if given("student_config") else STUDENTS,
        lambda_p1=a["lambda_p1"], lambda_p2=a["lambda_p2"], task=a["task"],
        workers=a["workers"], steps=a["steps"], balance=a["balance"],
        grad_ratio=a["grad_ratio"], pretrain=a["pretrain"], overwrite=a["overwrite"],
        progress=a["progress"], **({"lambda_ns": a["lambda_ns"]} if given("lambda_ns") else {})))
    out = a["out"]
    typer.echo(format_table(frame))
    typer.echo(f"wrote {out / 'ablation.csv'}, {out / 'comparisons.csv'} and {out / 'runs.csv'}")


def _one_student(a: dict, given) -> Path:
    """One student: ``train_student`` of the flags (``--quick`` sets the sizes left out)."""
    from circuitkit.distill.train import DistillConfig, train_student

    kw = dict(pool_size=96, shard_size=48, steps=12, batch_size=16, warmup=2, save_every=6,
              score_examples=32) if a["quick"] else {}
    kw.update({k: a[k] for k in ("pool_size", "batch_size") if not a["quick"] or given(k)})
    if a["steps"] is not None:
        kw["steps"] = a["steps"]
    cfg = DistillConfig(teacher=a["teacher"], task=a["task"], student=a["student_config"],
                        lambda_p1=a["lambda_p1"], lambda_p2=a["lambda_p2"],
                        lambda_ns=a["lambda_ns"], seed=a["seed"],
                        store=str(a["store"]) if a["store"] else None, balance=a["balance"],
                        grad_ratio=a["grad_ratio"], init=a["init"], **kw)
    return train_student(cfg, a["out"], overwrite=a["overwrite"], progress=a["progress"])


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
