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


def with_random_post_norms(cfg: dict, seed: int = 1):
    """``ck.load_model(cfg)`` with its post-attention/post-MLP norm gains (Gemma 2, OLMo 2)
    drawn from N(0, 1), seeded: near 1 a norm applied twice, or skipped, would hardly show."""
    import torch

    import circuitkit as ck

    model = ck.load_model(dict(cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            for norm in (getattr(block, "ln1_post", None), getattr(block, "ln2_post", None)):
                if norm is not None:
                    w = norm.original_component.weight
                    w.copy_(torch.randn(w.shape, generator=g))
    return model


def hand_patch_heads(model, base, source, metric, site="z"):
    """Metric after patching each head of ``base``'s run at every position with ``source``'s
    activation at ``site``: a plain ``run_with_hooks`` loop, the reference for head sweeps."""
    import torch

    from circuitkit import hooks

    _, cache = model.run_with_cache(source)
    f = hooks.facts(model)
    out = torch.zeros(f.n_layers, f.n_heads_at(site))
    ax = hooks.head_axis(site)
    for layer in range(f.n_layers):
        name = hooks.head_site(site, layer)
        for h in range(out.shape[1]):
            def patch(t, hook, h=h, name=name):
                t = t.clone()
                ix = [slice(None)] * t.ndim
                ix[ax] = h
                t[tuple(ix)] = cache[name][tuple(ix)]
                return t

            with torch.no_grad():
                out[layer, h] = metric(model.run_with_hooks(base, fwd_hooks=[(name, patch)]))
    return out
