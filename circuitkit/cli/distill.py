"""``distill``: one student, or the ablation grid (``--ablation``).
"""

from __future__ import annotations

from pathlib import Path

import typer

from circuitkit.cli import options as o
from circuitkit.cli.checks import _claim_folder, _missing_folders
from circuitkit.cli.command import Args, command
from circuitkit.cli.console import _fail, _given, _interrupted, _same_command

ABLATION_ONLY = ("seeds", "max_seeds", "workers", "pretrain", "size", "variants")
STUDENT_ONLY = ("batch_size", "pool_size", "seed", "store", "init")
DISTILL = (o.TEACHER, o.STUDENT_CONFIG, o.COT_TASK, o.LAMBDA_P1, o.LAMBDA_P2, o.LAMBDA_NS,
           o.STEPS, o.ROWS_PER_STEP, o.POOL_SIZE, o.STUDENT_SEED, o.STORE, o.BALANCE,
           o.GRAD_RATIO, o.INIT, o.GRID, o.SEEDS, o.MAX_SEEDS, o.WORKERS, o.PRETRAIN, o.QUICK,
           o.SIZE, o.VARIANTS, o.OUT.with_default(Path("distill-out")), o.DISTILL_OVERWRITE,
           o.PROGRESS)


@command(DISTILL, short_help="Distil a teacher into a student (or the ablation).")
def distill(a: Args) -> None:
    """Distil a teacher into a student with L_CoT + lambda_P1 L_P1 + lambda_P2 L_P2 (resumable:
    rerun the same command), or run the ablation table (--ablation)."""
    from circuitkit.files import check_writable_dir

    given = lambda name: _given(a.ctx, name)  # noqa: E731
    try:
        _check_distill_flags(given, a.ablation)
        made = _missing_folders(a.out)  # (removed again if the run is refused before it writes)
        check_writable_dir(a.out)
        _claim_folder(a.out, "distill", a.ctx, made=made)
        if a.ablation:
            return _grid(vars(a), given)
        folder = _one_student(vars(a), given)
    except (ValueError, OSError) as e:
        _fail(str(e) or type(e).__name__)
    except KeyboardInterrupt:
        _interrupted(f"rerun the same command to resume:\n  {_same_command(a.ctx)}")
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
