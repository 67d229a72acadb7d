"""``circuitkit`` command line: a thin layer over the same public functions a notebook calls.

Heavy imports (torch, transformer_lens) happen inside commands, so ``circuitkit --help`` is fast.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Find and distil the coarse-to-fine reasoning circuits of transformers over huge "
    "label spaces.",
)


@app.callback()
def _root() -> None:
    """circuitkit: characterize, then distill."""


def _fail(msg: str) -> None:
    """End the command with the whole message (every line: which row, which file, what to do)."""
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _resume_hint() -> str:
    import shlex

    return "circuitkit " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _load(model: str, task: str, n_examples: int | None, seed: int, split: str, phase: int):
    """(model, task) for a command; bad names or data end the command with one clear message.

    ``n_examples``: notes to build for a built-in task; for a ``.jsonl`` task, the first
    ``n_examples`` rows (None: all of them).
    """
    import circuitkit as ck
    from circuitkit.models import ModelNotAvailableError

    if n_examples is not None and n_examples < 1:
        _fail(f"--n-examples must be a positive integer (notes in the run); got {n_examples}.")
    try:
        if task.endswith(".jsonl"):
            the_task = ck.load_task(task, phase=phase)
            if n_examples is not None:
                if n_examples > len(the_task):
                    raise ValueError(f"--n-examples {n_examples} is more than the {len(the_task)} "
                                     f"examples in {task}; drop it to use them all.")
                the_task = the_task.subset(range(n_examples))
        else:
            the_task = ck.load_task(task, n_examples=n_examples or 64, seed=seed, split=split,
                                    phase=phase)
        the_model = ck.load_model(model)
        the_task.check_model(the_model)
        return the_model, the_task
    except (ModelNotAvailableError, FileNotFoundError, ValueError, OSError) as e:
        _fail(str(e) or type(e).__name__)


@app.command()
def info(
    model: str = typer.Option(..., "--model", "-m", help="Shipped toy, alias, folder or hub id."),
    seq_len: int = typer.Option(512, help="Prompt length assumed for per-position costs."),
    prompts: int = typer.Option(64, help="Prompts per sweep assumed for pass counts."),
    gpu_gb: float = typer.Option(80.0, help="Memory of one GPU, GB."),
) -> None:
    """Architecture and sweep cost plan, from the config alone (no weights needed)."""
    from circuitkit import models

    try:
        arch = models.architecture(model)
    except (models.ModelNotAvailableError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    plan = models.cost_plan(arch, seq_len=seq_len, n_prompts=prompts, gpu_gb=gpu_gb)
    gqa = f" (GQA, {arch.n_heads // arch.n_kv_heads} query heads per KV head)" \
        if arch.n_kv_heads != arch.n_heads else ""
    lines = [
        f"model        {arch.name}" + (f"  [{arch.hub_id}]" if arch.hub_id != arch.name else ""),
        f"layers       {arch.n_layers}",
        f"heads        {arch.n_heads}",
        f"kv heads     {arch.n_kv_heads}{gqa}",
        f"d_model      {arch.d_model}",
        f"d_head       {arch.d_head}",
        f"d_mlp        {arch.d_mlp}",
        f"vocab        {arch.d_vocab}",
        f"context      {arch.n_ctx}",
        f"parameters   {arch.n_params:,} ({arch.n_params / 1e9:.2f} B)",
        "",
        f"weights      {plan['weights_bf16_gib']:.1f} GiB bf16, "
        f"{plan['weights_fp32_gib']:.1f} GiB fp32",
        f"GPUs         >= {plan['min_gpus_80gb_bf16']} x {gpu_gb:g} GB (bf16)",
        "",
        f"sweep cost per direction, {prompts} prompts of {seq_len} tokens "
        "(1 pass = 1 prompt through the whole model):",
        f"  heads                      {plan['n_head_cells']:,}",
        f"  exact, all positions       {plan['exact_all_pos_naive']:,.0f} passes "
        f"(TransformerLens loop), {plan['exact_all_pos_suffix']:,.0f} pass-equivalents "
        "(layer-suffix engine)",
        f"  exact, per position        {plan['exact_each_pos_naive']:,.0f} passes, "
        f"{plan['exact_each_pos_suffix']:,.0f} pass-equivalents",
        f"  attribution (any heads)    {plan['attribution']:,.0f} pass-equivalents "
        "(2 forward + 1 backward per prompt)",
    ]
    typer.echo("\n".join(lines))


@app.command()
def patch(
    model: str = typer.Option(..., "--model", "-m", help="Shipped toy, alias, folder or hub id."),
    task: str = typer.Option(..., "--task", "-t", help="icd10, synthetic, induction or a .jsonl."),
    n_examples: int = typer.Option(None, "--n-examples", "-n", help="Prompts in the sweep "
                                   "(default 64; for a .jsonl: its first N rows, default all)."),
    direction: str = typer.Option("denoise", help="denoise (clean into corrupt) or noise."),
    method: str = typer.Option("exact", help="exact, attribution or attribution+exact."),
    positions: str = typer.Option("all", help="all (per head) or each (per head and position)."),
    site: str = typer.Option("z", help="z, pattern, q, k, v (heads) or resid_pre, attn_out, "
                             "mlp_out (layers x positions)."),
    phase: int = typer.Option(2, help="Task phase (1 anchors, 2 answers)."),
    split: str = typer.Option("test", help="Task split: train or test."),
    seed: int = typer.Option(0, help="Task seed."),
    batch_size: int = typer.Option(None, "--batch-size", help="Sequences per forward pass "
                                   "(default: from free memory)."),
    top_k: int = typer.Option(20, "--top-k", help="attribution+exact: cells verified exactly."),
    out: Path = typer.Option(Path("patch-out"), "--out", "-o", help="Output folder."),
    checkpoint: bool = typer.Option(True, "--checkpoint/--no-checkpoint", help="Store finished "
                                    "chunks in OUT/checkpoint; rerunning the same command "
                                    "resumes (exact method)."),
    plan: bool = typer.Option(False, "--plan", help="Print the cost (passes, memory, time from "
                              "a one-chunk probe) and stop."),
) -> None:
    """Activation-patching sweep over heads (or layers): writes OUT/result.{safetensors,json,csv,
    html} and prints the strongest cells."""
    from circuitkit import hooks
    from circuitkit.patching import api
    from circuitkit.patching.inputs import DIRECTIONS, METHODS, POSITIONS, check_batch_size, choice

    try:
        choice("direction", direction, DIRECTIONS)
        choice("method", method, METHODS)
        choice("positions", positions, POSITIONS)
        choice("site", site, hooks.PATCH_HEAD_SITES + hooks.PATCH_LAYER_SITES)
        check_batch_size(batch_size)
        if site in hooks.PATCH_LAYER_SITES and (method != "exact" or plan):
            raise ValueError(f"site={site!r} (a layer site) supports --method exact without "
                             "--plan only.")
        if not plan:
            from circuitkit.files import check_writable_dir

            check_writable_dir(out)  # before any work: a result is never lost at 100%
    except ValueError as e:
        _fail(str(e))
    the_model, the_task = _load(model, task, n_examples, seed, split, phase)
    clean, corrupt, metric = the_task.clean_tokens, the_task.corrupt_tokens, the_task.metric
    kw = dict(direction=direction, method=method, positions=positions, site=site,
              batch_size=batch_size)
    try:
        if plan:
            p = api.plan_patch(the_model, clean, corrupt, metric, top_k=top_k, **kw)
            typer.echo(format_plan(p))
            return
        run = api.patch_layers if site in hooks.PATCH_LAYER_SITES else api.patch_heads
        extra = {} if site in hooks.PATCH_LAYER_SITES else dict(top_k=top_k)
        ckpt = out / "checkpoint" if checkpoint and method == "exact" else None
        res = run(the_model, clean, corrupt, metric, progress=True,
                  task_hash=the_task.fingerprint(), checkpoint=ckpt, **kw, **extra)
    except ValueError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        resumable = checkpoint and method == "exact"
        typer.secho("interrupted; " + (f"finished chunks are in {out / 'checkpoint'}. Resume "
                                       f"with the same command:\n  {_resume_hint()}"
                                       if resumable else "nothing was saved (attribution "
                                       "runs are not checkpointed)."), err=True)
        raise typer.Exit(130) from None
    from circuitkit.patching.distributed import rank_world

    if rank_world()[0] != 0:  # under torchrun every rank holds the merged result; rank 0 writes
        return
    res.meta.update(model_name=model, task=task, n_examples=len(the_task), phase=phase,
                    split=split, seed=seed)
    written = res.save(out / "result")
    top = res.top(5)
    typer.echo(f"{res}\nstrongest cells (normalized: 1 = clean behaviour restored, -1 = fully "
               f"broken):\n{top.to_string(index=False, float_format=lambda v: f'{v:.3f}')}")
    typer.echo("wrote " + ", ".join(str(p) for p in written))


def format_plan(p: dict) -> str:
    """The ``--plan`` text of a ``plan_patch`` dict."""
    lines = [
        f"method       {p['method']}",
        f"sweep        {p['n_variants']:,} patches x {p['n_prompts']} prompts of {p['seq']} "
        "tokens",
        f"cost         {p['pass_equivalents']:,.0f} pass-equivalents (1 = one prompt through the "
        f"whole model; a naive loop needs {p['naive_passes']:,})",
        f"chunks       {p['n_chunks']:,} of <= {p['rows_per_forward']} sequences",
        f"memory       ~{p['bytes_per_chunk'] / 2**20:,.0f} MiB per chunk "
        f"({p['available_bytes'] / 2**30:,.1f} GiB usable)",
        f"time         ~{p['est_seconds']:,.1f} s (from a one-chunk probe)",
    ]
    if p.get("verified_cells"):
        lines.insert(2, f"verified     {p['verified_cells']} cells re-checked exactly")
    return "\n".join(lines)


METRIC_MEANINGS = {
    "focus": "Reasoning Focus: probability mass on the correct anchors at Phase-1 steps",
    "confusion": "Near-Miss Confusion: mass on near-miss siblings among target+near-miss "
                 "labels at answer steps",
    "confusion_rate": "share of notes whose decoded answer contains a near-miss",
    "macro_f1": "F1 per label, averaged over labels (decoded answers)",
    "micro_f1": "F1 pooled over all (note, label) decisions",
    "exact_match": "share of notes whose decoded label set equals the target set",
}


@app.command()
def evaluate(
    model: str = typer.Option(..., "--model", "-m", help="Shipped toy, alias, folder or hub id."),
    task: str = typer.Option("icd10", "--task", "-t", help="icd10, synthetic or a .jsonl."),
    n_examples: int = typer.Option(None, "--n-examples", "-n", help="Notes to evaluate "
                                   "(default 512; for a .jsonl: its first N rows, default all)."),
    split: str = typer.Option("test", help="Task split: test (held out) or train."),
    seed: int = typer.Option(0, help="Task seed."),
    batch_size: int = typer.Option(64, "--batch-size", help="Notes per forward pass."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable JSON instead of a "
                                 "table."),
) -> None:
    """Reasoning Focus, Near-Miss Confusion, confusion rate, Macro/micro-F1 and exact match."""
    import json

    import circuitkit as ck

    if batch_size < 1:
        _fail(f"--batch-size must be a positive integer; got {batch_size}.")
    the_model, the_task = _load(model, task, n_examples if n_examples is not None
                                else (None if task.endswith(".jsonl") else 512), seed, split, 2)
    scores = ck.evaluate(the_model, the_task, batch_size=batch_size, progress=True)
    if as_json:
        typer.echo(json.dumps(dict(model=model, task=task, n_examples=len(the_task), split=split,
                                   seed=seed, metrics={k: round(v, 4) for k, v in scores.items()},
                                   meanings=METRIC_MEANINGS), indent=1))
        return
    typer.echo(f"{model} on {task} ({len(the_task)} notes, split {split}, seed {seed})")
    for k, v in scores.items():
        typer.echo(f"  {k:<15}{v:7.4f}   {METRIC_MEANINGS.get(k, '')}")


@app.command()
def distill(
    teacher: str = typer.Option("icd-teacher", "--teacher", help="Teacher: shipped toy, folder or "
                                "hub id over the task's vocabulary."),
    student_config: str = typer.Option("student", "--student-config", help="Student preset "
                                       "(training.PRESETS) or a JSON file of Preset fields."),
    task: str = typer.Option("icd10", "--task", "-t", help="Built-in CoT task."),
    lambda_p1: float = typer.Option(1.0, "--lambda-p1", help="Weight of L_P1 (Phase-1 heads)."),
    lambda_p2: float = typer.Option(1.0, "--lambda-p2", help="Weight of L_P2 (Phase-2 heads)."),
    lambda_ns: float = typer.Option(0.0, "--lambda-ns", help="Weight of the non-selective "
                                    "all-heads attention loss (baseline)."),
    steps: int = typer.Option(None, "--steps", help="Training steps (default 1000; the "
                              "ablation's size sets its own)."),
    batch_size: int = typer.Option(64, "--batch-size", help="CoT rows per step."),
    pool_size: int = typer.Option(16384, "--pool-size", help="Train notes in the signal store."),
    seed: int = typer.Option(0, help="Student seed (init and batch order)."),
    store: Path = typer.Option(None, "--store", help="Signal-store folder (default OUT/signals)."),
    ablation: bool = typer.Option(False, "--ablation", help="Train and measure CoT-only, +P1, "
                                  "+P2, +P1+P2 and non-selective students; write "
                                  "OUT/ablation.csv."),
    seeds: int = typer.Option(3, "--seeds", help="Ablation: seeds per variant."),
    quick: bool = typer.Option(False, "--quick", help="Tiny sizes (CI)."),
    out: Path = typer.Option(Path("distill-out"), "--out", "-o", help="Output folder."),
) -> None:
    """Distil a teacher into a student with L_CoT + lambda_P1 L_P1 + lambda_P2 L_P2 (resumable:
    rerun the same command), or run the ablation table (--ablation)."""
    from circuitkit.files import check_writable_dir

    try:
        check_writable_dir(out)
        if ablation:
            from circuitkit.distill.ablation import format_table, run_ablation

            frame = run_ablation(out, teacher=teacher, seeds=seeds,
                                 size="quick" if quick else "default", student=student_config,
                                 lambda_p1=lambda_p1, lambda_p2=lambda_p2, task=task)
            typer.echo(format_table(frame))
            typer.echo(f"wrote {out / 'ablation.csv'} and {out / 'runs.csv'}")
            return
        from circuitkit.distill.train import DistillConfig, train_student

        kw = dict(pool_size=96, shard_size=48, steps=12, batch_size=16, warmup=2,
                  save_every=6, score_examples=32) if quick else \
            dict(pool_size=pool_size, batch_size=batch_size)
        if steps is not None:
            kw["steps"] = steps
        cfg = DistillConfig(teacher=teacher, task=task, student=student_config,
                            lambda_p1=lambda_p1, lambda_p2=lambda_p2, lambda_ns=lambda_ns,
                            seed=seed, store=str(store) if store else None, **kw)
        folder = train_student(cfg, out)
    except ValueError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        typer.secho(f"interrupted; rerun the same command to resume:\n  {_resume_hint()}",
                    err=True)
        raise typer.Exit(130) from None
    typer.echo(f"student saved to {folder}; evaluate it with: circuitkit evaluate --model "
               f"{folder}")


def main() -> None:  # console-script entry point
    try:
        app()
    except KeyboardInterrupt:
        typer.secho("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
