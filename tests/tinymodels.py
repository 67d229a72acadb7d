"""Tiny random models for tests (seeded, CPU). Imported as ``from tinymodels import ...``: a
module of its own, because ``conftest`` is ambiguous once notebooks/ has a conftest.py too.

``TINY_LLAMA``: 3 layers, 4 query heads sharing 2 KV heads (GQA), rotary, d_model 64, vocab 64.
``TINY_GPT2``: 2 layers, 4 heads, learned positions, d_model 32, vocab 64.
"""

from __future__ import annotations

TINY_LLAMA = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "seed": 0,
}
TINY_GPT2 = {
    "model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4,
    "n_positions": 64, "seed": 0,
}


def make_model(cfg: dict):
    import torch

    import circuitkit as ck

    torch.set_num_threads(1)
    return ck.load_model(dict(cfg))
