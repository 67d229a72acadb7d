"""``circuitkit`` command line: a thin layer over the same public functions a notebook calls.

Heavy imports (torch, transformer_lens) happen inside commands, so ``circuitkit --help`` is fast.
"""

from __future__ import annotations

import sys

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


def main() -> None:  # console-script entry point
    try:
        app()
    except KeyboardInterrupt:
        typer.secho("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
