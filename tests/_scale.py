"""Shared by the tests/test_scale_*.py files: a tiny random Llama with Llama-3-70B's
query-to-KV head ratio (8:1; 70B: 64 query heads, 8 KV heads), saved as a plain HF folder."""

from __future__ import annotations

from pathlib import Path

# 2 layers x 16 query heads sharing 2 KV heads, d_head 8 (q_proj 64 -> 128, as 70B's 8192 -> 8192)
TINY_GQA8 = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
}


def save_tiny(folder: Path, seed: int = 0, qk_scale: float = 1.0) -> Path:
    """``TINY_GQA8`` with seeded random weights and the numbered tokenizer (``t0 .. t63``),
    written with ``save_pretrained`` (fp32). ``qk_scale`` multiplies the query and key weights:
    sharper attention, so q/k patches have effects well above float noise."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from circuitkit.models import _numbered_tokenizer

    cfg = dict(TINY_GQA8)
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    model.save_pretrained(folder)
    _numbered_tokenizer(TINY_GQA8["vocab_size"]).save_pretrained(folder)
    return Path(folder)


def induction(n: int = 4, seed: int = 3):
    import circuitkit as ck

    return ck.load_task("induction", n_examples=n, seg_len=4, vocab_size=64, seed=seed)
