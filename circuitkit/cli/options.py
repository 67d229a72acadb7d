"""The command line's option table: every option declared once, as an ``Option`` (its name,
flags, type, default, help; ``cli/command.py``). A command is the list of the options it takes
(``command(options, ...)``); an option several commands take is one row here, so it means the
same, and is described the same, everywhere. Where one command's default differs (``--out``:
``./<command>-out``; ``--method``: auto for patch), the command says so
(``Option.with_default``); where the same flag means another thing for one command (distill's
``--task``, ``--batch-size``, ``--seed``, ``--overwrite``, ``--ablation``; ``info``'s and
``score``'s), that is its own row, named for the command.
"""

from __future__ import annotations

from pathlib import Path

import typer

from circuitkit.cli.command import Option
from circuitkit.experiments.characterize import DEFAULT_N, N_RANDOM, N_RANDOM_ABLATION


def _split(value: str) -> str:
    if value not in ("test", "train"):  # at parse time, before any model loads
        raise typer.BadParameter(f"{value!r}: expected test or train.")
    return value


def _corruption(value: str) -> str:
    from circuitkit.corruptions import parse_corruption  # torch-free: checked at parse time

    try:
        parse_corruption(value)
    except ValueError as e:
        raise typer.BadParameter(str(e).replace("corruption=", "", 1)) from None
    return value


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

MODEL = Option("model", ("--model", "-m"), str, DEFAULT_MODEL, MODEL_HELP, "NAME")
TASK = Option("task", ("--task", "-t"), str, DEFAULT_TASK, "icd10, synthetic, induction or a "
              ".jsonl (characterize and score: a CoT task or a .jsonl).", "TASK")
N = Option("n_examples", ("--n-examples", "-n"), int | None, None, N_HELP, "N")
SPLIT = Option("split", ("--split",), str, "test", "Task split: test (held out) or train.",
               "SPLIT", callback=_split)
SEED = Option("seed", ("--seed",), int, 0, "Task seed (and the command's own random draws: "
              "bootstrap, random head sets).", "SEED")
PHASE = Option("phase", ("--phase",), int | None, None, "Task phase: 1 (anchors) or 2 (answers); "
               "default 2, or a .jsonl file's own phase.", "PHASE")
BATCH_SIZE = Option("batch_size", ("--batch-size",), int | None, None, "Sequences per forward "
                    "pass (default: from free memory; halved on out-of-memory; evaluate: 64).",
                    "N")
DIRECTION = Option("direction", ("--direction",), str, "denoise", "denoise (clean into corrupt) "
                   "or noise.", "DIRECTION")
METHOD = Option("method", ("--method",), str, "exact", METHOD_HELP, "METHOD")
PATCH_METHOD = Option("patch_method", ("--method", "--patch-method"), str, "exact", METHOD_HELP,
                      "METHOD")  # characterize's: its older name too
TOP_K = Option("top_k", ("--top-k",), int | None, None, "attribution+exact: verify exactly this "
               "many cells (edges: edges) instead of as many as the screen's error bound asks.",
               "K")
OUT = Option("out", ("--out", "-o"), Path, None, "Results folder (default ./<command>-out): one "
             "command's results; rerunning the same command resumes, another command there is "
             "refused.", "DIR")  # (each command gives its own default: with_default)
CHECKPOINT = Option("checkpoint", ("--checkpoint/--no-checkpoint",), bool, True, "Store "
                    "finished chunks in OUT/checkpoints/; rerunning the same command resumes.")
PLAN = Option("plan", ("--plan",), bool, False, "Print the cost and stop: measured on a "
              "one-chunk probe (patch) or from the task's own prompts (edges) when the weights "
              "are here, else planned from the config (passes, FLOPs, memory, GPUs, time on "
              "--gpu).")
GPU = Option("gpu", ("--gpu",), str, "H100", "--plan: GPU class whose time is printed (H100, "
             "H200, A100); there is no CPU class.", "GPU")
UTILISATION = Option("utilisation", ("--utilisation",), float, 0.4, "--plan: share of the GPU's "
                     "bf16 dense peak a sweep reaches.", "SHARE")
K = Option("k", ("-k",), int, 5, "Top heads per phase (characterize: patched together in "
           "validation; score: whose bootstrap inclusion is reported).", "K")
TEXT = Option("text", ("--text",), str, "auto", "Render the task as text for a pretrained LLM: "
              "auto (when the model's vocabulary cannot hold the task), yes or no.",
              "auto|yes|no")
PROGRESS = Option("progress", ("--progress/--no-progress",), bool, True,
                  "Progress bars on stderr.")
JSON = Option("as_json", ("--json",), bool, False, "Print one JSON object (what ran, what it "
              "found, the files written) instead of text.")
OVERWRITE = Option("overwrite", ("--overwrite",), bool, False, "Start again: remove what earlier "
                   "runs of this command wrote in --out (its results, its checkpoints) instead "
                   "of resuming them; without it, a run whose flags differ from the folder's is "
                   "refused.")
CORRUPTION = Option(
    "corruption", ("--corruption",), str, "note", "What the corrupt run edits: note (the "
    "evidence; default), anchor (Phase 1: the written anchor, note intact), shortlist-swap or "
    "shortlist-sibling (Phase 2: the shortlist, note intact), or one of each phase joined by a "
    "comma (docs/scores.md). icd10 and synthetic.", "NAME", callback=_corruption)
SEQ_LEN = Option("seq_len", ("--seq-len",), int | None, None, "--plan without weights: price N "
                 "prompts of this many tokens each instead of the task's own (as circuitkit "
                 "info does).", "TOKENS")

# --- patch's and edges' own ----------------------------------------------------------------------
POSITIONS = Option("positions", ("--positions",), str | None, None, "all (per head; the default "
                   "for head sites) or each (per head and position; the only one for layer "
                   "sites).", "POSITIONS")
SITE = Option("site", ("--site",), str, "z", "z, pattern, q, k, v (heads) or resid_pre, "
              "attn_out, mlp_out (layers x positions).", "SITE")
MAX_PASSES = Option("max_passes", ("--max-passes",), float | None, None, "attribution+exact "
                    "(and auto's hybrid): stop verifying before the run passes this many "
                    "pass-equivalents in all (screen included).", "PASSES")
HEAD_ESTIMATOR = Option("estimator", ("--estimator",), str | None, None, "attribution: atp "
                        "(default), block, qk, graddrop, atp*, ig; attribution+exact/auto screen "
                        "with block (docs/attribution.md).", "NAME")
GPUS_PER_REPLICA = Option("gpus_per_replica", ("--gpus-per-replica",), int, 1, "GPUs per model "
                          "copy. Under torchrun (one process per GPU) the processes form WORLD/P "
                          "replicas that share the chunks.", "N")
BACKEND = Option("backend", ("--backend",), str, "transformer_lens", "transformer_lens or nnsight "
                 "(exact head sweeps through nnsight's tracing).", "NAME")
REMOTE = Option("remote", ("--remote",), bool, False, "With --backend nnsight: run on NDIF (needs "
                "a hub id and NDIF_API_KEY in the environment).")
INPUTS = Option("inputs", ("--inputs",), str, "q,k,v", "Receiving heads' inputs, comma "
                "separated: q, k, v.", "INPUTS")
SENDERS = Option("senders", ("--senders",), str, "all", "all (every head and the embeddings) or "
                 "nodes, comma separated: embed, L0H3, ...", "NODES")
RECEIVERS = Option("receivers", ("--receivers",), str, "all", "all (every head and the logits) "
                   "or nodes, comma separated: L3H1, ..., logits.", "NODES")
EDGE_ESTIMATOR = Option("estimator", ("--estimator",), str | None, None, "attribution: eap "
                        "(default), eap-ig-inputs, eap-ig-activations, eap* (the receiving head "
                        "run exactly); attribution+exact screens with eap* unless given.", "NAME")
IG_STEPS = Option("ig_steps", ("--ig-steps",), int | None, None, "EAP-IG interpolation steps "
                  "(default 5).", "M")
CIRCUIT = Option("circuit", ("--circuit/--no-circuit",), bool, True, "Also measure the "
                 "faithfulness curve of the top edges (CPR, CMD, kept set).")
EDGE_ABLATION = Option("ablation", ("--ablation",), str, "corrupt", "--circuit: what an ablated "
                       "edge carries: corrupt, zero, position-mean (the clean prompts' mean per "
                       "position) or resample.", "KIND")

# --- info's: what it assumes for a plan (no task, no run) ---------------------------------------
INFO_MODEL = Option("model", ("--model", "-m"), str, None, "Shipped toy, alias, folder or hub "
                    "id; without it, the models circuitkit knows by name.", "NAME")
INFO_SEQ_LEN = Option("seq_len", ("--seq-len",), int, None, "Tokens per prompt assumed for the "
                      "costs (default 512, or the model's context if shorter).", "TOKENS")
INFO_PROMPTS = Option("prompts", ("--n-examples", "-n", "--prompts"), int, DEFAULT_N,
                      "Prompts per sweep assumed for the pass counts.", "N")

# --- score's and characterize's own ---------------------------------------------------------------
SCORE_OUT = Option("out", ("--out", "-o"), Path, Path("score-out/scores.csv"), "CSV file to write "
                   "(default ./score-out/scores.csv).", "FILE")
N_RANDOM_SETS = Option("n_random", ("--n-random",), int, N_RANDOM, "Random head sets per pool "
                       "the top set is validated against (the p-value's floor is 1/(N+1); 1000 "
                       "for the paper-grade null, ~5x the time).", "N")
N_RANDOM_ABLATION_SETS = Option("n_random_ablation", ("--n-random-ablation",), int,
                                N_RANDOM_ABLATION, "Random head sets per pool the top set is "
                                "ablated (zero, mean, resample) against.", "N")
EDGES = Option("edges", ("--edges",), bool, False, "Also patch the edges from the top -k Phase-1 "
               "heads into the top -k Phase-2 heads (q, k, v; the Phase-2 metric) and their "
               "circuit's faithfulness: OUT/edges/.")
STAGES = Option("stages", ("--stages/--no-stages",), bool, True, "Patch every head at each of the "
                "task's position groups (evidence, anchor, shortlist, answer, and the positions "
                "the metric reads), both directions, on the selection and the held-out notes: "
                "where each phase's decision is made, the stable heads and the claims table the "
                "findings lead with; OUT/groups/ (exact patching; on by default, --no-stages for "
                "a quick run).")
SELECT_N = Option("select_n", ("--select-n",), str, "half", "Held-out selection: score (select) "
                  "heads on the first N examples, validate on the rest; 'half' (the default): "
                  "the first half; 'none': select and validate on the same examples.",
                  "N|half|none")

# --- report's ------------------------------------------------------------------------------------
RUN_DIR = Option("run_dir", (), Path, ..., "Results folder (characterize --out or "
                 "patch --out).", "RUN_DIR", argument=True)
REPORT_OUT = Option("out", ("--out", "-o"), Path, None, "Output file (default: "
                    "RUN_DIR/report.html).", "FILE")
ATTENTION = Option("attention", ("--attention/--no-attention",), bool, True, "Attention views of "
                   "the top heads (loads the model named in summary.json).")

# --- distill's: a student's training and the ablation grid ---------------------------------------
TEACHER = Option("teacher", ("--teacher",), str, "icd-teacher", "Teacher: shipped toy, folder or "
                 "hub id over the task's vocabulary.", "NAME")
STUDENT_CONFIG = Option(
    "student_config", ("--student-config",), str, "student", "Student preset (training.PRESETS: "
    "'student', 2 layers x 4 heads, d 128; 'student4', 4 layers x 4 heads, d 96, Phase 2 below "
    "its output layer) or a JSON file of Preset fields; --ablation: default both presets.",
    "NAME")
COT_TASK = Option("task", ("--task", "-t"), str, "icd10", "Built-in CoT task.", "TASK")
LAMBDA_P1 = Option("lambda_p1", ("--lambda-p1",), float, 1.0, "Weight of L_P1 (Phase-1 heads).",
                   "WEIGHT")
LAMBDA_P2 = Option("lambda_p2", ("--lambda-p2",), float, 1.0, "Weight of L_P2 (Phase-2 heads).",
                   "WEIGHT")
LAMBDA_NS = Option("lambda_ns", ("--lambda-ns",), float, 0.0, "Weight of the non-selective "
                   "all-heads attention loss (baseline).", "WEIGHT")
STEPS = Option("steps", ("--steps",), int | None, None, "Training steps (default 1000; the "
               "ablation: each variant's, after --pretrain; its size's, 120).", "N")
ROWS_PER_STEP = Option("batch_size", ("--batch-size",), int, 64, "CoT rows per step.", "N")
POOL_SIZE = Option("pool_size", ("--pool-size",), int, 16384, "Train notes in the signal store.",
                   "N")
STUDENT_SEED = Option("seed", ("--seed",), int, 0, "Student seed (init and batch order).", "SEED")
STORE = Option("store", ("--store",), Path | None, None, "Signal-store folder (default "
               "OUT/signals).", "DIR")
BALANCE = Option(
    "balance", ("--balance",), str, "share", "How the terms' gradients combine (the CoT part "
    "clipped at 1 on its own in all but global_clip): 'share' (each mechanistic term scaled to "
    "lambda x the CoT part's norm: lambda is its share of the step), 'cap' (each term's gradient "
    "capped at --grad-ratio x the CoT part, then times its lambda: before issue 50), 'none' (the "
    "gradient of L_total, unscaled) or 'global_clip' (the total's gradient clipped at 1).",
    "share|cap|none|global_clip")
GRAD_RATIO = Option("grad_ratio", ("--grad-ratio",), float, 0.5, "--balance cap: the most a "
                    "mechanistic term's gradient counts for, as a multiple of the CoT part's "
                    "norm.", "R")
INIT = Option("init", ("--init",), str | None, None, "Start the student from this HF folder's "
              "weights (or a shipped model, e.g. icd-student-cot) of the same preset, instead of "
              "a fresh initialisation.", "MODEL")
GRID = Option("ablation", ("--ablation",), bool, False, "Train and measure CoT-only, +P1, +P2, "
              "+P1+P2 and non-selective students, for both student presets and two data sizes; "
              "write OUT/ablation.csv.")
SEEDS = Option("seeds", ("--seeds",), int, 3, "Ablation: seeds per variant.", "N")
MAX_SEEDS = Option("max_seeds", ("--max-seeds",), int | None, None, "Ablation: seeds for headline "
                   "comparisons whose intervals overlap (default --seeds).", "N")
WORKERS = Option("workers", ("--workers",), int, 1, "Ablation: runs trained side by side (one "
                 "thread each).", "N")
PRETRAIN = Option("pretrain", ("--pretrain",), int | None, None, "Ablation: CoT-only steps of the "
                  "one start every run of a cell begins from (default its size's: 800; 0: each "
                  "seed's fresh initialisation).", "N")
QUICK = Option("quick", ("--quick",), bool, False, "Tiny sizes (CI).")
SIZE = Option("size", ("--size",), str | None, None, "Ablation: the grid's size (ablation.SIZES: "
              "'default'; 'grid', issue 35's arms, early-stopped baseline and curves; 'sweep', "
              "issue 50's lambda sweep; 'grid-quick'; --quick is 'quick').", "NAME")
VARIANTS = Option("variants", ("--variants",), str | None, None, "Ablation: comma-separated "
                  "variants (default cot,p1,p2,p1+p2,nonselective; also p1+p2-causal: the causal "
                  "heads; V@W scales V's lambdas by W, e.g. p1+p2@0.3).", "V,V")
DISTILL_OVERWRITE = Option("overwrite", ("--overwrite",), bool, False, "Replace a finished "
                           "student (or training state) of another configuration in --out; "
                           "--ablation: start a grid of another configuration over.")
