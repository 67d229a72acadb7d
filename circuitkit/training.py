"""Train small models on a task: plain torch on a HF ``LlamaForCausalLM`` built from a config.

The trained model is saved with ``save_pretrained`` (plus the task's word-level tokenizer) and is
then loaded through ``ck.load_model(folder)``: the same code path as Llama-3-70B, every hook
included. Training is resumable: a checkpoint (model, optimiser, scheduler, step, RNG) is written
atomically every ``save_every`` steps to ``out_dir/train_state.safetensors`` and picked up by the
next call with the same ``out_dir``. It holds no pickle: tensors in safetensors, everything else
as JSON in the file's header, so a crafted checkpoint cannot run code (``torch.load`` would).

Loss is next-token cross-entropy on the positions a model can predict: the chain of thought and
answer for CoT tasks (from the first anchor step to ``<eos>``), the second copy for induction.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from circuitkit._progress import tqdm
from circuitkit.evaluation import greedy_decode_cached, prompt_end
from circuitkit.files import write_files_into, write_tensors, write_text
from circuitkit.models import configure_threads, hf_progress, shipped_path
from circuitkit.tasks import Task, load_task
from circuitkit.tasks.base import word_tokenizer


@dataclass
class Preset:
    n_layers: int
    n_heads: int
    d_model: int
    d_mlp: int
    n_kv_heads: int | None = None
    attn_only: bool = False
    rope_theta: float = 10000.0


PRESETS: dict[str, Preset] = {
    "teacher": Preset(n_layers=4, n_heads=8, d_model=192, d_mlp=768),
    # twice the teacher's depth, its heads, two thirds of its width (what one shared CPU thread
    # trains in an hour), so "early", "mid" and "late" layers are distinct places (issue 45)
    "teacher-deep": Preset(n_layers=8, n_heads=8, d_model=128, d_mlp=512),
    "student": Preset(n_layers=2, n_heads=4, d_model=128, d_mlp=512),
    # room for both phases: the teacher's depth at half its width; its layers map one to one, so
    # the Phase-2 heads (teacher layer 2) land below the output layer (docs/distill.md)
    "student4": Preset(n_layers=4, n_heads=4, d_model=96, d_mlp=384),
    "induction": Preset(n_layers=2, n_heads=4, d_model=64, d_mlp=1, attn_only=True),
}


@dataclass
class TrainConfig:
    task: str = "icd10"
    task_kw: dict[str, Any] = field(default_factory=dict)
    preset: str = "teacher"
    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 100
    weight_decay: float = 0.01
    seed: int = 0
    pool_size: int = 20000  # examples generated once, sampled with replacement (a .jsonl
    # task: all of its rows)
    save_every: int = 250
    # CoT source: None = the task's own CoT; else a model (name or folder) whose greedy CoT and
    # answer replace it (sequence-level distillation: the baseline student of the paper).
    teacher: str | None = None


def hf_config(preset: Preset, vocab_size: int, n_ctx: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=preset.d_model, intermediate_size=preset.d_mlp,
        num_hidden_layers=preset.n_layers, num_attention_heads=preset.n_heads,
        num_key_value_heads=preset.n_kv_heads or preset.n_heads,
        max_position_embeddings=n_ctx, rope_theta=preset.rope_theta, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")


def build_model(preset: Preset, vocab_size: int, n_ctx: int, seed: int):
    """A fresh ``LlamaForCausalLM``. ``attn_only``: every MLP's output projection is zero and
    frozen, so the MLPs add exactly 0 (Llama has no MLP-free variant)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config(preset, vocab_size, n_ctx))
    if preset.attn_only:
        for layer in model.model.layers:
            for p in layer.mlp.parameters():
                torch.nn.init.zeros_(p)
                p.requires_grad_(False)
    return model


def context_length(width: int) -> int:
    """``n_ctx`` for rows of ``width`` tokens: the next power of two above ``width``, >= 64."""
    return max(64, 2 ** math.ceil(math.log2(width + 1)))


def optimizer(params: list[Tensor], cfg: Any) -> tuple[Any, Any]:
    """``(AdamW, LambdaLR)``: ``cfg.lr``, ``cfg.weight_decay``; the rate at step ``s`` times
    ``min(1, (s + 1) / warmup) * (1 + cos(pi s / steps)) / 2`` (linear warm-up, cosine decay)."""
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup)
                                                  * 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))


def restore(state: dict[str, Any], model: Any, opt: Any, sched: Any) -> tuple[int, float, list]:
    """Load a training state's model, optimiser and scheduler; returns its step, elapsed
    seconds and history."""
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    return state["step"], state["elapsed"], state["history"]


def loss_mask(task: Task) -> Bool[Tensor, "batch seq"]:
    """Target positions whose prediction is trained (see module docstring)."""
    toks = task.clean_tokens
    mask = torch.zeros_like(toks, dtype=torch.bool)
    for i, e in enumerate(task.examples):
        if e.anchor_pos or e.shortlist_pos:
            start = min(e.anchor_pos + e.shortlist_pos + e.answer_pos)
            end = int((e.tokens != task.pad_id).nonzero().max()) + 1
            mask[i, start:end] = True
        else:
            mask[i, e.answer_pos] = True
    return mask


@torch.no_grad()
def teacher_cot(pool: Task, teacher: str, batch_size: int = 512) -> tuple[Tensor, Tensor]:
    """Rows ``note <think> + teacher's greedy continuation`` and their loss mask (the
    continuation's positions), right-padded with ``pool.pad_id``.

    Decodes with the HF model and its KV cache (``generate``), prompts grouped by length so no
    padding enters a batch: re-running the bridge on the whole prefix at every step would cost
    ~20x more on a 100k-note pool.
    """
    from transformers import AutoModelForCausalLM

    path = shipped_path(teacher) or Path(teacher)
    with hf_progress(False):  # a small copy for decoding: its bar would cut into the caller's
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    think = pool.vocab.index("<think>")
    prompts = [e.tokens[: prompt_end(e, think)] for e in pool.examples]
    width = pool.clean_tokens.shape[1] + 4
    gens = greedy_decode_cached(model, prompts, pool.eos_id, lambda n: width - n, pool.pad_id,
                                batch_size)
    return cot_rows(prompts, gens, width, pool.pad_id)


def cot_rows(prompts: list[Tensor], gens: list[list[int]], width: int, pad_id: int
             ) -> tuple[Tensor, Tensor]:
    """``(tokens, mask)`` ``[n, width]``: each prompt followed by its generation (cut at
    ``width``), right-padded with ``pad_id``; ``mask`` marks the generated positions."""
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for i, (p, g) in enumerate(zip(prompts, gens, strict=True)):
        g = g[: width - len(p)]
        tokens[i, : len(p) + len(g)] = torch.cat([p, torch.tensor(g, dtype=torch.long)])
        mask[i, len(p): len(p) + len(g)] = True
    return tokens, mask


def lm_loss(logits: Tensor, tokens: Int[Tensor, "b s"], mask: Bool[Tensor, "b s"]) -> Tensor:
    """Mean cross-entropy of predicting ``tokens[:, p]`` from ``logits[:, p - 1]`` where mask."""
    pred, tgt, m = logits[:, :-1], tokens[:, 1:], mask[:, 1:]
    return torch.nn.functional.cross_entropy(pred[m], tgt[m])


STATE_FILE = "train_state.safetensors"
LEGACY_STATE_FILE = "train_state.pt"  # pickled by older versions: refused, never loaded
_STATE_KEY = "circuitkit.train_state"


def _split_tensors(obj: Any, key: str, tensors: dict[str, Tensor]) -> Any:
    """``obj`` as JSON-able data, each tensor replaced by ``{"__tensor__": name}`` and stored in
    ``tensors[name]``. Dicts with non-string keys (an optimiser's ``state``) become
    ``{"__items__": [[key, value], ...]}`` so int keys survive JSON; tuples become lists."""
    if isinstance(obj, Tensor):
        tensors[key] = obj.detach().clone()  # clone: safetensors refuses shared storage
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _split_tensors(v, f"{key}.{k}", tensors) for k, v in obj.items()}
        return {"__items__": [[k, _split_tensors(v, f"{key}.{k}", tensors)]
                              for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [_split_tensors(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"training state: cannot store {type(obj).__name__} at {key}")


def _join_tensors(obj: Any, tensors: dict[str, Tensor]) -> Any:
    """Inverse of ``_split_tensors`` (tuples come back as lists)."""
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__items__"}:
            return {k: _join_tensors(v, tensors) for k, v in obj["__items__"]}
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors) for v in obj]
    return obj


def save_train_state(path: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` (nested dicts/lists of tensors and JSON values) as one safetensors file,
    atomically (``files.write_tensors``: umask mode, fsync, rename)."""
    tensors: dict[str, Tensor] = {}
    tree = _split_tensors(state, "s", tensors)
    return write_tensors(path, tensors, metadata={_STATE_KEY: json.dumps(tree)})


def load_train_state(path: str | Path) -> dict[str, Any]:
    """Read a state written by ``save_train_state``; no code runs. ``ValueError`` naming the
    file if it is not one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        tree = json.loads(meta[_STATE_KEY])
        return _join_tensors(tree, tensors)
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{path} is not a readable circuitkit training state ({e}); delete it "
                         "to start training over.") from None


def train(cfg: TrainConfig, out_dir: str | Path, progress: bool = True,
          resume: bool = True) -> Path:
    """Train ``cfg.preset`` on ``cfg.task``; write a HF folder to ``out_dir``; return its path.

    Killed or interrupted runs continue from ``out_dir/train_state.safetensors`` on the next
    call. A pickled ``train_state.pt`` (older versions) is refused, not loaded.
    """
    configure_threads()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    legacy = out / LEGACY_STATE_FILE
    if resume and legacy.exists():
        raise ValueError(f"{legacy} is a pickled training state (older circuitkit); it is not "
                         "loaded, since unpickling a file can run arbitrary code. Delete it to "
                         "start this run over, or use another out_dir.")
    # a .jsonl file is its own pool: all its rows (pool_size builds that many of a built-in)
    pool = load_task(cfg.task, n_examples=None if str(cfg.task).endswith(".jsonl")
                     else cfg.pool_size, seed=cfg.seed, split="train",
                     **cfg.task_kw)
    tokens, mask = (teacher_cot(pool, cfg.teacher) if cfg.teacher
                    else (pool.clean_tokens, loss_mask(pool)))
    preset = PRESETS[cfg.preset]
    model = build_model(preset, len(pool.vocab), context_length(tokens.shape[1]), cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, sched = optimizer(params, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    state_path = out / STATE_FILE
    config = json.loads(json.dumps(asdict(cfg)))  # as stored: tuples become lists
    step, elapsed, history = 0, 0.0, []
    if resume and state_path.exists():
        st = load_train_state(state_path)
        if st["config"] != config:
            raise ValueError(f"{state_path} belongs to a different training config; use another "
                             "out_dir or delete it to start over.")
        step, elapsed, history = restore(st, model, opt, sched)
        gen.set_state(st["gen"])

    def checkpoint() -> None:
        save_train_state(state_path, dict(
            config=config, model=model.state_dict(), opt=opt.state_dict(),
            sched=sched.state_dict(), gen=gen.get_state(), step=step, elapsed=elapsed,
            history=history))

    model.train()
    bar = tqdm(total=cfg.steps, initial=step, disable=not progress, desc=f"train {cfg.preset}")
    t0 = time.perf_counter() - elapsed
    try:
        while step < cfg.steps:
            idx = torch.randint(0, len(tokens), (cfg.batch_size,), generator=gen)
            logits = model(tokens[idx]).logits
            loss = lm_loss(logits, tokens[idx], mask[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            elapsed = time.perf_counter() - t0
            if step % 50 == 0 or step == cfg.steps:
                history.append((step, round(loss.item(), 5), round(elapsed, 1)))
                bar.set_postfix(loss=f"{loss.item():.4f}")
            bar.update(1)
            if step % cfg.save_every == 0:
                checkpoint()
    except KeyboardInterrupt:
        checkpoint()
        print(f"\ninterrupted at step {step}; run the same command again to resume "
              f"from {state_path}")
        raise
    bar.close()
    model.eval()

    def final(folder: Path) -> None:
        model.save_pretrained(folder)
        word_tokenizer(pool.vocab, str(folder))

    write_files_into(out, final)  # each file atomic, umask mode (safetensors writes 0600)
    write_text(out / "training.json", json.dumps(dict(
        config=asdict(cfg), preset=asdict(preset), train_seconds=round(elapsed, 1),
        final_loss=history[-1][1] if history else None, history=history,
        torch=torch.__version__), indent=1))
    state_path.unlink(missing_ok=True)  # finished: the HF folder is the artefact
    return out
