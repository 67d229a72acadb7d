"""Every option of the command line that several commands share, declared once as an
``Annotated`` type; a command lists the ones it takes (one command's own options sit at the
top of its module).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from circuitkit.experiments.characterize import DEFAULT_N


def _opt(flag: str, help: str, metavar: str | None = None, *alias: str):
    """``typer.Option(flag, *alias, help=help, metavar=metavar)``: every option's one form."""
    return typer.Option(flag, *alias, help=help, metavar=metavar)


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

Model = Annotated[str, _opt("--model", MODEL_HELP, "NAME", "-m")]
Task = Annotated[str, _opt("--task", "icd10, synthetic, induction or a .jsonl (characterize "
                           "and score: a CoT task or a .jsonl).", "TASK", "-t")]
N = Annotated[int | None, _opt("--n-examples", N_HELP, "N", "-n")]
def _split(value: str) -> str:
    if value not in ("test", "train"):  # at parse time, before any model loads
        raise typer.BadParameter(f"{value!r}: expected test or train.")
    return value


Split = Annotated[str, typer.Option("--split", help="Task split: test (held out) or train.",
                                    metavar="SPLIT", callback=_split)]
Seed = Annotated[int, _opt("--seed", "Task seed (and the command's own random draws: bootstrap, "
                           "random head sets).", "SEED")]
Phase = Annotated[int | None, _opt("--phase", "Task phase: 1 (anchors) or 2 (answers); default "
                                   "2, or a .jsonl file's own phase.", "PHASE")]
BatchSize = Annotated[int | None, _opt("--batch-size", "Sequences per forward pass (default: "
                                       "from free memory; halved on out-of-memory; evaluate: "
                                       "64).", "N")]
Direction = Annotated[str, _opt("--direction", "denoise (clean into corrupt) or noise.",
                                "DIRECTION")]
Method = Annotated[str, _opt("--method", METHOD_HELP, "METHOD")]
PatchMethod = Annotated[str, _opt("--method", METHOD_HELP, "METHOD",
                                  "--patch-method")]  # characterize's older name too
TopK = Annotated[int | None, _opt("--top-k", "attribution+exact: verify exactly this many cells "
                                  "(edges: edges) instead of as many as the screen's error "
                                  "bound asks.", "K")]
Out = Annotated[Path, _opt("--out", "Results folder (default ./<command>-out): one command's "
                           "results; rerunning the same command resumes, another command "
                           "there is refused.", "DIR", "-o")]
Checkpoint = Annotated[bool, _opt("--checkpoint/--no-checkpoint", "Store finished chunks in "
                                  "OUT/checkpoints/; rerunning the same command resumes.")]
Plan = Annotated[bool, _opt("--plan", "Print the cost and stop: measured on a one-chunk probe "
                            "(patch) or from the task's own prompts (edges) when the weights "
                            "are here, else planned from the config (passes, FLOPs, memory, "
                            "GPUs, time on --gpu).")]
Gpu = Annotated[str, _opt("--gpu", "--plan: GPU class whose time is printed (H100, H200, A100); "
                          "there is no CPU class.", "GPU")]
Utilisation = Annotated[float, _opt("--utilisation", "--plan: share of the GPU's bf16 dense "
                                    "peak a sweep reaches.", "SHARE")]
K = Annotated[int, _opt("-k", "Top heads per phase (characterize: patched together in "
                        "validation; score: whose bootstrap inclusion is reported).", "K")]
Text = Annotated[str, _opt("--text", "Render the task as text for a pretrained LLM: auto (when "
                           "the model's vocabulary cannot hold the task), yes or no.",
                           "auto|yes|no")]
Progress = Annotated[bool, _opt("--progress/--no-progress", "Progress bars on stderr.")]
Json = Annotated[bool, _opt("--json", "Print one JSON object (what ran, what it found, the "
                            "files written) instead of text.")]
Overwrite = Annotated[bool, _opt("--overwrite", "Start again: remove what earlier runs of this "
                                 "command wrote in --out (its results, its checkpoints) "
                                 "instead of resuming them; without it, a run whose flags "
                                 "differ from the folder's is refused.")]
NRandom = Annotated[int, _opt("--n-random", "Random head sets per pool the top set is "
                              "validated against (the p-value's floor is 1/(N+1); 1000 for the "
                              "paper-grade null, ~5x the time).", "N")]
NRandomAblation = Annotated[int, _opt("--n-random-ablation", "Random head sets per pool the top "
                                      "set is ablated (zero, mean, resample) against.", "N")]
def _corruption(value: str) -> str:
    from circuitkit.corruptions import parse_corruption  # torch-free: checked at parse time

    try:
        parse_corruption(value)
    except ValueError as e:
        raise typer.BadParameter(str(e).replace("corruption=", "", 1)) from None
    return value


Corruption = Annotated[str, typer.Option(
    "--corruption", help="What the corrupt run edits: note (the evidence; default), anchor "
    "(Phase 1: the written anchor, note intact), shortlist-swap or shortlist-sibling (Phase 2: "
    "the shortlist, note intact), or one of each phase joined by a comma (docs/scores.md). "
    "icd10 and synthetic.", metavar="NAME", callback=_corruption)]
SelectN = Annotated[str, _opt("--select-n", "Held-out selection: score (select) heads on the "
                              "first N examples, validate on the rest; 'half' (the default): "
                              "the first half; 'none': select and validate on the same "
                              "examples.", "N|half|none")]


# --- options of one sweep command (declared here, so each command is its list of options) -------
Positions = Annotated[str | None, _opt("--positions", "all (per head; the default for head "
                                       "sites) or each (per head and position; the only one "
                                       "for layer sites).", "POSITIONS")]
Site = Annotated[str, _opt("--site", "z, pattern, q, k, v (heads) or resid_pre, attn_out, "
                           "mlp_out (layers x positions).", "SITE")]
MaxPasses = Annotated[float | None, _opt("--max-passes", "attribution+exact (and auto's "
                                         "hybrid): stop verifying before the run passes this "
                                         "many pass-equivalents in all (screen included).",
                                         "PASSES")]
HeadEstimator = Annotated[str | None, _opt("--estimator", "attribution: atp (default), block, "
                                           "qk, graddrop, atp*, ig; attribution+exact/auto "
                                           "screen with block (docs/attribution.md).", "NAME")]
SeqLen = Annotated[int | None, _opt("--seq-len", "--plan without weights: price N prompts of "
                                    "this many tokens each instead of the task's own (as "
                                    "circuitkit info does).", "TOKENS")]
GpusPerReplica = Annotated[int, _opt("--gpus-per-replica", "GPUs per model copy. Under torchrun "
                                     "(one process per GPU) the processes form WORLD/P "
                                     "replicas that share the chunks.", "N")]
Backend = Annotated[str, _opt("--backend", "transformer_lens or nnsight (exact head sweeps "
                              "through nnsight's tracing).", "NAME")]
Remote = Annotated[bool, _opt("--remote", "With --backend nnsight: run on NDIF (needs a hub id "
                              "and NDIF_API_KEY in the environment).")]
Inputs = Annotated[str, _opt("--inputs", "Receiving heads' inputs, comma separated: q, k, v.",
                             "INPUTS")]
Senders = Annotated[str, _opt("--senders", "all (every head and the embeddings) or nodes, comma "
                              "separated: embed, L0H3, ...", "NODES")]
Receivers = Annotated[str, _opt("--receivers", "all (every head and the logits) or nodes, comma "
                                "separated: L3H1, ..., logits.", "NODES")]
EdgeEstimator = Annotated[str | None, _opt("--estimator", "attribution: eap (default), "
                                           "eap-ig-inputs, eap-ig-activations, eap* (the "
                                           "receiving head run exactly); attribution+exact "
                                           "screens with eap* unless given.", "NAME")]
IgSteps = Annotated[int | None, _opt("--ig-steps", "EAP-IG interpolation steps (default 5).",
                                     "M")]
Circuit = Annotated[bool, _opt("--circuit/--no-circuit", "Also measure the faithfulness curve "
                               "of the top edges (CPR, CMD, kept set).")]
Ablation = Annotated[str, _opt("--ablation", "--circuit: what an ablated edge carries: corrupt, "
                               "zero, position-mean (the clean prompts' mean per position) or "
                               "resample.", "KIND")]
