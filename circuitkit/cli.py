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
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _load(model: str, task: str, n_examples: int, seed: int, split: str, phase: int):
    """(model, task) for a command; bad names end the command with one clear line."""
    import circuitkit as ck
    from circuitkit.models import ModelNotAvailableError

    try:
        the_task = ck.load_task(task, n_examples=n_examples, seed=seed, split=split, phase=phase)
        the_model = ck.load_model(model)
        the_task.check_model(the_model)
        return the_model, the_task
    except (ModelNotAvailableError, FileNotFoundError, ValueError, OSError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


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
    n_examples: int = typer.Option(64, "--n-examples", "-n", help="Prompts in the sweep."),
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
    out: Path = typer.Option(Path("patch-out"), "--out", "-o", help="Output folder."),
    checkpoint: bool = typer.Option(False, "--checkpoint", help="Store finished chunks in "
                                    "OUT/checkpoint; rerunning the same command resumes."),
    plan: bool = typer.Option(False, "--plan", help="Print the cost (passes, memory, time from "
                              "a one-chunk probe) and stop."),
) -> None:
    """Activation-patching sweep over heads (or layers): result.safetensors/.json, .csv, heatmap."""
    from circuitkit.patching import engine
    from circuitkit.patching.inputs import (
        DIRECTIONS,
        HEAD_SITES,
        LAYER_SITES,
        METHODS,
        POSITIONS,
        choice,
    )

    try:
        choice("direction", direction, DIRECTIONS)
        choice("method", method, METHODS)
        choice("positions", positions, POSITIONS)
        choice("site", site, HEAD_SITES + LAYER_SITES)
        if site in LAYER_SITES and method != "exact":
            raise ValueError(f"site={site!r} (a layer site) supports --method exact only.")
    except ValueError as e:
        _fail(str(e))
    the_model, the_task = _load(model, task, n_examples, seed, split, phase)
    clean, corrupt, metric = the_task.clean_tokens, the_task.corrupt_tokens, \
        the_task.prompt_metric()
    try:
        if plan:
            p = engine.plan_patch(the_model, clean, corrupt, metric, site=site,
                                  direction=direction, positions=positions,
                                  batch_size=batch_size) if site in HEAD_SITES else None
            if p is None:
                _fail("--plan supports head sites (z, pattern, q, k, v).")
            typer.echo("\n".join([
                f"sweep        {site} {direction} positions={positions}: "
                f"{p['n_variants']:,} patches x {p['n_prompts']} prompts of {p['seq']} tokens",
                f"passes       {p['pass_equivalents']:,.0f} pass-equivalents (layer-suffix "
                f"engine); {p['naive_passes']:,} full passes for a naive loop",
                f"chunks       {p['n_chunks']:,} of <= {p['rows_per_forward']} sequences",
                f"memory       ~{p['bytes_per_chunk'] / 2**20:,.0f} MiB per chunk "
                f"({p['available_bytes'] / 2**30:,.1f} GiB usable)",
                f"time         ~{p['est_seconds']:,.1f} s (from a one-chunk probe)",
            ]))
            return
        kw = dict(direction=direction, batch_size=batch_size, progress=True,
                  checkpoint=out / "checkpoint" if checkpoint else None,
                  task_hash=the_task.fingerprint())
        if site in LAYER_SITES:
            res = engine.patch_layers(the_model, clean, corrupt, metric, site=site, **kw)
        else:
            res = engine.patch_heads(the_model, clean, corrupt, metric, method=method,
                                     positions=positions, site=site, **kw)
    except ValueError as e:
        _fail(str(e))
    from circuitkit.patching.distributed import rank_world

    if rank_world()[0] != 0:  # under torchrun every rank holds the merged result; rank 0 writes
        return
    res.meta.update(model_name=model, task=task, n_examples=n_examples, phase=phase,
                    split=split, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    res.save(out / "result")
    res.to_frame().to_csv(out / "result.csv", index=False)
    # plotly.js inlined: clusters and laptops on planes have no CDN
    res.heatmap().write_html(out / "heatmap.html", include_plotlyjs=True)
    typer.echo(f"{res}\nwrote {out}/result.safetensors, result.json, result.csv, heatmap.html")


@app.command()
def evaluate(
    model: str = typer.Option(..., "--model", "-m", help="Shipped toy, alias, folder or hub id."),
    task: str = typer.Option("icd10", "--task", "-t", help="icd10, synthetic or a .jsonl."),
    n_examples: int = typer.Option(512, "--n-examples", "-n", help="Notes to evaluate."),
    split: str = typer.Option("test", help="Task split: test (held out) or train."),
    seed: int = typer.Option(0, help="Task seed."),
    batch_size: int = typer.Option(64, "--batch-size", help="Notes per forward pass."),
) -> None:
    """Reasoning Focus, Near-Miss Confusion, Macro/micro-F1 and exact match, as JSON."""
    import json

    import circuitkit as ck

    the_model, the_task = _load(model, task, n_examples, seed, split, 2)
    scores = ck.evaluate(the_model, the_task, batch_size=batch_size)
    typer.echo(json.dumps({k: round(v, 4) for k, v in scores.items()}, indent=1))


# --- scores and the main job (circuitkit.scoring, circuitkit.characterize) ------------------------
def _text_flag(text: str) -> bool | None:
    if text not in ("auto", "yes", "no"):
        _fail(f"--text must be auto, yes or no; got {text!r}.")
    return None if text == "auto" else text == "yes"


@app.command()
def score(
    model: str = typer.Option(..., "--model", "-m", help="Shipped toy, alias, folder or hub id."),
    task: str = typer.Option("icd10", "--task", "-t", help="icd10, synthetic or a .jsonl."),
    n_examples: int = typer.Option(256, "--n-examples", "-n", help="Examples to score on."),
    split: str = typer.Option("test", help="Task split: test or train."),
    seed: int = typer.Option(0, help="Task seed."),
    text: str = typer.Option("auto", help="Render the task as text for a pretrained LLM: auto "
                             "(when the model's vocabulary cannot hold the task), yes or no."),
    batch_size: int = typer.Option(None, "--batch-size", help="Examples per forward pass."),
    out: Path = typer.Option(Path("scores.csv"), "--out", "-o", help="CSV file to write."),
) -> None:
    """Phase-1 (CoarseScore) and Phase-2 (RefineScore) scores of every head, as CSV."""
    import circuitkit as ck
    from circuitkit import files
    from circuitkit.characterize import load_for
    from circuitkit.models import ModelNotAvailableError
    from circuitkit.scoring.heads import score_heads

    flag = _text_flag(text)
    try:
        files.check_writable_dir(out.parent if str(out.parent) else Path("."), "--out folder")
        the_model = ck.load_model(model)
        the_task, _ = load_for(the_model, task, n_examples, seed, split, flag)
        df = score_heads(the_model, the_task, batch_size=batch_size, progress=True)
    except (ModelNotAvailableError, FileNotFoundError, ValueError, OSError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    files.write_text(out, df.to_csv(index=False))
    cols = ["layer", "head", "sharpness", "anchor_alignment", "coarse_score"]
    typer.echo("top Phase-1 heads (coarse_score):\n"
               + df.sort_values("phase1_rank").head(5)[cols].to_string(index=False))
    cols = ["layer", "head", "loopback", "margin_widening", "refine_score"]
    typer.echo("top Phase-2 heads (refine_score):\n"
               + df.sort_values("phase2_rank").head(5)[cols].to_string(index=False))
    typer.echo(f"wrote {out}")


@app.command()
def characterize(
    model: str = typer.Option("icd-teacher", "--model", "-m", help="Shipped toy, alias, folder "
                              "or hub id."),
    task: str = typer.Option("icd10", "--task", "-t", help="icd10, synthetic or a .jsonl."),
    out: Path = typer.Option(Path("characterize-out"), "--out", "-o", help="Results folder "
                             "(rerunning the same command resumes)."),
    n_examples: int = typer.Option(128, "--n-examples", "-n", help="Prompts per step."),
    split: str = typer.Option("test", help="Task split: test or train."),
    seed: int = typer.Option(0, help="Task seed (and validation's random head sets)."),
    k: int = typer.Option(5, "-k", help="Top heads per phase patched together in validation."),
    n_random: int = typer.Option(20, "--n-random", help="Random head sets to compare with."),
    patch_method: str = typer.Option("exact", "--patch-method", help="exact, attribution or "
                                     "attribution+exact."),
    text: str = typer.Option("auto", help="Render the task as text: auto, yes or no."),
    batch_size: int = typer.Option(None, "--batch-size", help="Sequences per forward pass."),
) -> None:
    """The main job: head patching (both directions, both phases), scores, causal validation,
    one results folder (scores.csv, validation.csv, summary.json, patch-p{1,2}-{denoise,noise})."""
    from circuitkit.characterize import characterize as run
    from circuitkit.models import ModelNotAvailableError
    from circuitkit.patching.inputs import METHODS, choice

    flag = _text_flag(text)
    try:
        choice("patch_method", patch_method, METHODS)
        summary = run(model, task, out, n_examples=n_examples, seed=seed, split=split, k=k,
                      n_random=n_random, batch_size=batch_size, patch_method=patch_method,
                      text=flag, progress=True)
    except (ModelNotAvailableError, FileNotFoundError, ValueError, OSError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    tops = summary.get("top_heads", {})
    for phase in ("phase1", "phase2"):
        if phase in tops:
            typer.echo(f"top {phase} heads: " + " ".join(f"L{la}H{h}" for la, h in tops[phase]))
    typer.echo(f"wrote {out}/scores.csv, validation.csv, summary.json, patch-p{{1,2}}-"
               "{denoise,noise}.safetensors/.json")


def main() -> None:  # console-script entry point
    try:
        app()
    except KeyboardInterrupt:
        typer.secho("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
