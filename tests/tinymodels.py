"""Tiny random models for tests (seeded, CPU). Imported as ``from tinymodels import ...``: a
module of its own, because ``conftest`` is ambiguous once notebooks/ has a conftest.py too.

``TINY_LLAMA``: 3 layers, 4 query heads sharing 2 KV heads (GQA), rotary, d_model 64, vocab 64.
``TINY_GPT2``: 2 layers, 4 heads, learned positions, d_model 32, vocab 64.
``ARCHS`` (with ``SMALL``): the HF block layouts TransformerLens bridges, 2 layers, d_model 32.
``NATIVE``: TransformerLens-native layouts (``TransformerBridgeConfig`` + ``boot_native``).
``hooked_sweep``: the reference every exact sweep is checked against (a plain hooked forward).
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


def autograd_at(model, tokens, metric, names):
    """A plain ``run_with_hooks`` forward of ``tokens`` on full logits, differentiated by hand:
    ``{name: activation}`` at hooks ``names``, each with ``.grad`` the gradient of
    ``metric(logits).mean()`` there (the reference for attribution estimates). Stored under
    the name registered: a bridge hook's ``hook.name`` need not be it."""
    kept = {}

    def keep(name):
        def hook(t, hook):
            t.retain_grad()
            kept[name] = t
            return t
        return hook

    metric(model.run_with_hooks(tokens, fwd_hooks=[(n, keep(n)) for n in names])).mean() \
        .backward()
    return kept


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


# HF layouts TransformerLens bridges: pre-norm (Llama with GQA, Mixtral), GPT-2 (learned
# positions, LayerNorm), parallel attention/MLP (GPT-NeoX, GPT-J, Phi, Falcon, Cohere), post-norm
# (Gemma 2 and 3: pre and post; OLMo 2: post only), multi-query (GPT-BigCode) and bridges that leave
# attention to HF (GPT-J, OPT: a post-hoc ``hook_pattern``; OPT's MLP is no module of its own).
SMALL = dict(vocab_size=64, num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
             max_position_embeddings=64, seed=0)
ARCHS = {
    "llama": dict(model_type="llama", intermediate_size=64, num_key_value_heads=2),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "gpt_neox": dict(model_type="gpt_neox", intermediate_size=64),
    "gptj": dict(model_type="gptj", n_embd=32, n_layer=2, n_head=4, n_positions=64,
                 rotary_dim=4),
    "phi": dict(model_type="phi", intermediate_size=64),
    "falcon": dict(model_type="falcon"),
    "cohere": dict(model_type="cohere", intermediate_size=64, num_key_value_heads=2),
    "gemma2": dict(model_type="gemma2", intermediate_size=64, num_key_value_heads=2,
                   head_dim=8),
    "olmo2": dict(model_type="olmo2", intermediate_size=64, num_key_value_heads=2),
    # Gemma 3 (gemma3-270m's layout): pre and post norms, q/k norms, a sliding-window layer (4
    # tokens: shorter than the tests' 8-token prompts) before a full-attention one
    "gemma3": dict(model_type="gemma3_text", intermediate_size=64, num_key_value_heads=2,
                   head_dim=8, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"]),
    "mixtral": dict(model_type="mixtral", intermediate_size=64, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2),
    "gpt_bigcode": dict(model_type="gpt_bigcode", n_embd=32, n_layer=2, n_head=4,
                        n_positions=64, multi_query=True),
    "opt": dict(model_type="opt", ffn_dim=64, word_embed_proj_dim=32),
}
POST_HOC_PATTERN = {"gptj", "opt"}

# TransformerLens-native layouts, on NATIVE_BASE (2 layers, 4 heads, d_model 32, vocab 64, LN).
NATIVE_BASE = dict(n_layers=2, d_model=32, n_heads=4, d_head=8, n_ctx=16, d_vocab=64,
                   act_fn="gelu", seed=0)
NATIVE = {
    "attn-only": dict(attn_only=True, normalization_type=None),
    "attn-only-ln": dict(attn_only=True, normalization_type="LN"),
    "no-norm": dict(normalization_type=None),
    "ln": dict(normalization_type="LN"),
    "rms": dict(normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True,
                n_key_value_heads=2, act_fn="silu"),
    "lnpre": dict(normalization_type="LNPre"),
    "rmspre": dict(normalization_type="RMSPre"),
    "vocab-out": dict(d_vocab_out=24),
    # TL runs native blocks in sequence whatever parallel_attn_mlp says (no norm: the block
    # estimator is then exact on the last layer, which tells the two readings apart)
    "parallel": dict(parallel_attn_mlp=True, normalization_type=None),
    "softcap": dict(attn_scores_soft_cap=2.0, output_logits_soft_cap=3.0),
    "bidirectional": dict(attention_dir="bidirectional"),
}


def native_model(**over):
    """``ck.load_model(TransformerBridgeConfig(**NATIVE_BASE, **over))``: a TransformerLens-native
    bridge (random init, seeded), in eval mode."""
    from transformer_lens.config import TransformerBridgeConfig

    import circuitkit as ck

    return ck.load_model(TransformerBridgeConfig(**{**NATIVE_BASE, **over}))


def hooked_sweep(model, base, source, metric, kind="heads", site="z", positions="all"):
    """Metric (mean over prompts) after patching each cell of ``base``'s run with ``source``'s
    activation: ``[n_layers, n_heads]`` (heads, positions "all"), ``[n_layers, n_heads, seq]``
    (heads, "each"; pattern: the query row) or ``[n_layers, seq]`` (layers). One plain
    ``run_with_hooks`` forward of the whole model per layer, every cell's copy of the prompts
    stacked in the batch: the reference for exact sweeps, written apart from the engine."""
    import torch

    from circuitkit import hooks

    f = hooks.facts(model)
    n, seq = base.shape
    with torch.no_grad():
        _, cache = model.run_with_cache(source)
    units = f.n_heads_at(site) if kind == "heads" else 1
    cells = [(u, p) for u in range(units)
             for p in (range(seq) if kind == "layers" or positions == "each" else [None])]
    out = torch.zeros(f.n_layers, len(cells))
    for layer in range(f.n_layers):
        name = hooks.head_site(site, layer) if kind == "heads" else hooks.layer_site(site, layer)
        src = cache[name]

        def patch(t, hook, src=src):
            t = t.clone()
            view = t.view(len(cells), n, *t.shape[1:])
            for i, (u, p) in enumerate(cells):
                ix = [slice(None)] * src.ndim
                if kind == "heads":
                    ix[hooks.head_axis(site)] = u
                if p is not None:
                    ix[2 if site == "pattern" else 1] = p
                view[i][tuple(ix)] = src[tuple(ix)]
            return t

        with torch.no_grad():
            logits = model.run_with_hooks(base.repeat(len(cells), 1), fwd_hooks=[(name, patch)])
        for i in range(len(cells)):
            out[layer, i] = torch.as_tensor(metric(logits[i * n:(i + 1) * n])).float().mean()
    if kind == "layers":
        return out
    return out.view(f.n_layers, units, -1).squeeze(-1) if positions == "all" else \
        out.view(f.n_layers, units, seq)


def call(fn, *args, **kw):
    """``fn(*args, **kw)`` with the keywords ``fn`` does not take but ``ck.PatchOptions`` has
    (progress, batch_size, checkpoint, the method's options...) moved into ``options``: the
    tests' shorthand for the patching entries, whose run settings live in one options object."""
    import inspect
    from dataclasses import fields

    from circuitkit.patching.units import PatchOptions

    takes = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        return fn(*args, **kw)  # (a test's own runner: it passes them on)
    names = {f.name for f in fields(PatchOptions)}
    moved = {k: kw.pop(k) for k in list(kw) if k in names and k not in takes}
    if moved:
        given = kw.get("options") or {}
        given = given if isinstance(given, dict) else {
            f.name: getattr(given, f.name) for f in fields(given)}
        kw["options"] = {**given, **moved}
    return fn(*args, **kw)


def attribution_heads(model, clean, corrupt, metric, **kw):
    """``ck.patch_heads(..., method="attribution")``, the door to the head estimators, with
    ``call``'s shorthand (progress, batch_size, estimator, atp_star, ig_steps moved into
    ``options``)."""
    import circuitkit as ck

    return call(ck.patch_heads, model, clean, corrupt, metric, method="attribution", **kw)


BUDGET = ("recall_top", "quantile", "max_fraction", "exact_when_cheaper")


def hybrid_heads(model, clean, corrupt, metric, **kw):
    """``ck.patch_heads(..., method="attribution+exact")`` with ``call``'s shorthand, the
    automatic budget's keywords (``BUDGET``) moved into ``options["budget"]``."""
    import circuitkit as ck

    budget = {k: kw.pop(k) for k in BUDGET if k in kw}
    if budget:
        kw["budget"] = budget
    return call(ck.patch_heads, model, clean, corrupt, metric, method="attribution+exact", **kw)
