"""Every option of the command line that several commands share, declared once as an
``Annotated`` type; a command lists the ones it takes (one command's own options sit at the
top of its module).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from circuitkit.characterize import DEFAULT_N

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
