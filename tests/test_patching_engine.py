"""Exact engine vs TransformerLens's reference sweeps (tiny seeded random models, CPU).

Tolerance: 1e-4 absolute on the metric (the engine is bit-equal in practice; batching may
reorder float sums on other BLAS builds).
"""

from __future__ import annotations

import pytest
import torch
from tinymodels import with_random_post_norms
from transformer_lens import patching as tlp

import circuitkit as ck
from circuitkit import hooks
from circuitkit.patching import exact as engine_module
from circuitkit.patching.exact import ExactEngine
from circuitkit.patching.sweep import Sweep, chunked

ATOL = 1e-4

TL_HEADS = {
    "z": (tlp.get_act_patch_attn_head_out_all_pos, tlp.get_act_patch_attn_head_out_by_pos),
    "q": (tlp.get_act_patch_attn_head_q_all_pos, tlp.get_act_patch_attn_head_q_by_pos),
    "k": (tlp.get_act_patch_attn_head_k_all_pos, tlp.get_act_patch_attn_head_k_by_pos),
    "v": (tlp.get_act_patch_attn_head_v_all_pos, tlp.get_act_patch_attn_head_v_by_pos),
    "pattern": (tlp.get_act_patch_attn_head_pattern_all_pos,
                tlp.get_act_patch_attn_head_pattern_by_pos),
}


@pytest.fixture(scope="module")
def task():
    return ck.load_task("induction", n_examples=3, seg_len=4, vocab_size=64, seed=1)


@pytest.fixture(scope="module")
def clean_cache(tiny_llama, task):
    return tiny_llama.run_with_cache(task.clean_tokens)[1]


@pytest.mark.parametrize("site", list(TL_HEADS))
@pytest.mark.parametrize("positions", ["all", "each"])
def test_denoise_matches_transformerlens(tiny_llama, task, clean_cache, site, positions):
    metric = task.prompt_metric()
    res = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, metric, site=site,
                         positions=positions, options=dict(progress=False))
    tl_fn = TL_HEADS[site][0 if positions == "all" else 1]
    ref = tl_fn(tiny_llama, task.corrupt_tokens, clean_cache, metric)
    if positions == "each" and site != "pattern":
        ref = ref.permute(0, 2, 1)  # TL: [layer, pos, head]; ours: [layer, head, pos]
    f = hooks.facts(tiny_llama)
    assert res.values.shape == ref.shape
    assert res.values.shape[1] == f.n_heads_at(site)
    torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0)
    assert res.meta["head_axis"] == ("kv_head" if site in ("k", "v") else "head")
    # baselines are the unpatched runs
    with torch.no_grad():
        clean = metric(tiny_llama(task.clean_tokens))
        corrupt = metric(tiny_llama(task.corrupt_tokens))
    assert res.clean == pytest.approx(float(clean), abs=1e-5)
    assert res.corrupt == pytest.approx(float(corrupt), abs=1e-5)


def _noise_reference(model, task, metric, site, positions):
    """Hand-written: patch each head's corrupt activation into the clean run, one full run each."""
    f = hooks.facts(model)
    _, corrupt_cache = model.run_with_cache(task.corrupt_tokens)
    seq = task.clean_tokens.shape[1]
    n_heads = f.n_heads_at(site)
    axis = hooks.head_axis(site)
    out = torch.zeros(f.n_layers, n_heads, *([seq] if positions == "each" else []))
    for layer in range(f.n_layers):
        name = hooks.head_site(site, layer)
        src = corrupt_cache[name]
        for h in range(n_heads):
            for p in (range(seq) if positions == "each" else [None]):
                def hook(act, hook, h=h, p=p, src=src):
                    idx = [slice(None)] * act.ndim
                    idx[axis] = h
                    if p is not None:
                        idx[2 if site == "pattern" else 1] = p
                    act[tuple(idx)] = src[tuple(idx)]
                    return act
                logits = model.run_with_hooks(task.clean_tokens, fwd_hooks=[(name, hook)])
                out[(layer, h) + ((p,) if p is not None else ())] = metric(logits)
    return out


@pytest.mark.parametrize("site,positions", [("z", "all"), ("v", "each"), ("pattern", "all")])
def test_noise_matches_hand_loop(tiny_llama, task, site, positions):
    metric = task.prompt_metric()
    res = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, metric,
                         direction="noise", site=site, positions=positions,
                         options=dict(progress=False))
    ref = _noise_reference(tiny_llama, task, metric, site, positions)
    torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0)
    # noising breaks the behaviour: normalized is (v - clean)/(clean - corrupt), 0 = no effect
    span = res.clean - res.corrupt  # the values' tolerance, scaled as normalized() scales them
    torch.testing.assert_close(res.normalized(), (ref - res.clean) / span,
                               atol=ATOL / abs(span), rtol=0)


@pytest.mark.parametrize("site,tl_fn", [("resid_pre", tlp.get_act_patch_resid_pre),
                                        ("attn_out", tlp.get_act_patch_attn_out),
                                        ("mlp_out", tlp.get_act_patch_mlp_out)])
def test_layers_match_transformerlens(tiny_llama, task, clean_cache, site, tl_fn):
    metric = task.prompt_metric()
    res = ck.patch_layers(tiny_llama, task.clean_tokens, task.corrupt_tokens, metric, site=site,
                          options=dict(progress=False))
    ref = tl_fn(tiny_llama, task.corrupt_tokens, clean_cache, metric)
    assert res.values.shape == (3, task.clean_tokens.shape[1])
    torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0)
    assert res.axes == ("layer", "pos")


def test_gpt2_matches_transformerlens(tiny_gpt2, task):
    metric = task.prompt_metric()
    _, cache = tiny_gpt2.run_with_cache(task.clean_tokens)
    res = ck.patch_heads(tiny_gpt2, task.clean_tokens, task.corrupt_tokens, metric,
                         options=dict(progress=False))
    ref = tlp.get_act_patch_attn_head_out_all_pos(tiny_gpt2, task.corrupt_tokens, cache, metric)
    torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0)


def test_chunking_does_not_change_results(tiny_llama, task):
    metric = task.prompt_metric()
    args = (tiny_llama, task.clean_tokens, task.corrupt_tokens, metric)
    big = ck.patch_heads(*args, positions="each", options=dict(progress=False))
    one = ck.patch_heads(*args, positions="each", options=dict(batch_size=1,
                                                               progress=False))  # splits prompts
    five = ck.patch_heads(*args, positions="each", options=dict(batch_size=5, progress=False))
    torch.testing.assert_close(one.values, big.values, atol=ATOL, rtol=0)
    torch.testing.assert_close(five.per_prompt, big.per_prompt, atol=ATOL, rtol=0)
    assert big.per_prompt.shape == (3, *big.values.shape)
    torch.testing.assert_close(big.per_prompt.mean(0), big.values)


def test_plain_callable_metric(tiny_llama, task):
    pm = task.prompt_metric()
    res = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens,
                         lambda logits: pm(logits), options=dict(batch_size=2, progress=False))
    ref = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, pm,
                         options=dict(progress=False))
    assert res.per_prompt is None and res.confidence_interval() is None
    torch.testing.assert_close(res.values, ref.values, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fast", [False, True])
def test_suffix_runs_skip_earlier_blocks(tiny_llama, task, fast, monkeypatch):
    """The whole point of the engine: a patch at layer l runs blocks l.. only, as bridge blocks
    (plain path) or as fused blocks (the fast path on a Llama-form model)."""
    from circuitkit.patching.exact import fused

    calls: list[int] = []
    handles = [b.original_component.register_forward_pre_hook(
        lambda m, a, i=i: calls.append(i)) for i, b in enumerate(tiny_llama.blocks)]
    for name in ("block", "last_block_at_reads", "known_block_at_reads"):
        def record(self, pack, x, b, *a, real=getattr(fused.FusedLlama, name), **k):
            calls.append(self.blocks.index(b))
            return real(self, pack, x, b, *a, **k)
        monkeypatch.setattr(fused.FusedLlama, name, record)
    try:
        sweep = chunked(Sweep("heads", "z", "denoise", "all", 3, 4, 1, 3,
                              task.clean_tokens.shape[1], True), 100)
        engine = ExactEngine(tiny_llama, task.clean_tokens, task.corrupt_tokens,
                             task.prompt_metric(), sweep, fast=fast)
        assert (engine.fused is not None) and engine.fast == fast
        calls.clear()
        engine.run_chunk((2, 0, 4, 0, 3))
        assert calls == [2]
        calls.clear()
        engine.run_chunk((1, 0, 4, 0, 3))
        assert calls == [1, 2]
        calls.clear()
        tiny_llama(task.clean_tokens)  # and the model is intact afterwards
        assert calls == [0, 1, 2]
    finally:
        for h in handles:
            h.remove()


# --- bad inputs ---------------------------------------------------------------------------------


def test_bad_inputs(tiny_llama, task):
    c, k, m = task.clean_tokens, task.corrupt_tokens, task.prompt_metric()
    with pytest.raises(ValueError, match="same shape"):
        ck.patch_heads(tiny_llama, c, k[:, :-1], m, options=dict(progress=False))
    with pytest.raises(ValueError, match="site='nope'.*expected one of"):
        ck.patch_heads(tiny_llama, c, k, m, site="nope", options=dict(progress=False))
    with pytest.raises(ValueError, match="direction="):
        ck.patch_heads(tiny_llama, c, k, m, direction="up", options=dict(progress=False))
    with pytest.raises(ValueError, match="positions="):
        ck.patch_heads(tiny_llama, c, k, m, positions="some", options=dict(progress=False))
    with pytest.raises(ValueError, match="site="):
        ck.patch_layers(tiny_llama, c, k, m, site="z", options=dict(progress=False))
    with pytest.raises(ValueError, match="scalar"):
        ck.patch_heads(tiny_llama, c, k, lambda lg: lg[:, -1, :2], options=dict(progress=False))
    with pytest.raises(ValueError, match="non-finite"):
        ck.patch_heads(tiny_llama, c, k, lambda lg: lg.sum() * float("nan"),
                       options=dict(progress=False))
    with pytest.raises(ValueError, match="integer"):
        ck.patch_heads(tiny_llama, c.float(), k, m, options=dict(progress=False))
    too_big = c.clone()
    too_big[0, 1] = tiny_llama.cfg.d_vocab  # one id past the vocabulary
    for method in ("exact", "attribution"):  # one shared check for every entry point
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, "):
            ck.patch_heads(tiny_llama, too_big, k, m, method=method, options=dict(progress=False))


def test_kv_without_gqa_info_is_refused(tiny_llama, task):
    cfg = tiny_llama.cfg
    saved = cfg.n_key_value_heads
    cfg.n_key_value_heads = None  # the cfg now claims 4 KV heads; the activation has 2
    try:
        with pytest.raises(ValueError, match="GQA info"):
            ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens,
                           task.prompt_metric(), site="k", options=dict(progress=False))
    finally:
        cfg.n_key_value_heads = saved


def test_attribution_methods_dispatch(tiny_llama, task, monkeypatch):
    """patch_heads forwards method="attribution"/"attribution+exact" with its arguments (the
    hybrid: the head units' ``Screenable`` to ``hybrid.screen_then_verify``)."""
    from circuitkit.patching import hybrid
    from circuitkit.patching.estimators import attribution

    seen = {}
    args = (tiny_llama, task.clean_tokens, task.corrupt_tokens, task.prompt_metric())
    patched = ck.PatchResult(torch.zeros(3, 4), 0.0, 0.0, "denoise", "attribution", "k", "all")
    fake_result = {"atp": patched, "hybrid": patched}

    def fake(name):
        def fn(model, clean, corrupt, metric, estimator, site, positions, opts, tail=False):
            seen[name] = dict(estimator=estimator, site=site, positions=positions, tail=tail,
                              direction=opts.direction, atp_star=opts.atp_star,
                              batch_size=opts.batch_size, progress=opts.progress)
            return fake_result[name]
        return fn

    def screen_then_verify(units, checkpoint, **kw):
        seen["hybrid"] = dict(kw, kind=units.kind, cell_ndim=units.index.shape[1])
        return patched

    monkeypatch.setattr(attribution, "estimate_heads", fake("atp"))
    monkeypatch.setattr(hybrid, "screen_then_verify", screen_then_verify)
    assert ck.patch_heads(*args, method="attribution", site="k",
                          options=dict(atp_star=True)) is patched
    assert seen["atp"] == dict(estimator="qk", direction="denoise", site="k", positions="all",
                               atp_star=True, batch_size=None, progress=True, tail=True)
    assert ck.patch_heads(*args, method="attribution+exact", positions="each",
                          options=dict(top_k=5)) is patched
    assert seen["hybrid"]["top_k"] == 5 and seen["hybrid"]["kind"] == "heads"
    assert seen["hybrid"]["cell_ndim"] == 3  # (layer, head, pos): positions="each"


def test_unembedding_only_read_positions_changes_nothing(tiny_llama, task):
    """The engine unembeds only ``metric.reads``; a metric without ``reads`` gets full logits."""
    from circuitkit.metrics import PromptMetric

    pm = task.prompt_metric()
    n, seq = task.clean_tokens.shape
    assert pm.reads is not None and pm.reads.shape[0] == n and pm.reads.shape[1] < seq
    with torch.no_grad():
        logits = tiny_llama(task.clean_tokens)
    at_reads = logits[torch.arange(n)[:, None], pm.reads]  # [n, k, vocab]
    torch.testing.assert_close(pm.per_prompt(at_reads, at=pm.reads),
                               pm.per_prompt(logits), atol=1e-6, rtol=0)
    sub = pm.select([2, 0])
    torch.testing.assert_close(sub.per_prompt(at_reads[[2, 0]], at=sub.read_positions()),
                               pm.per_prompt(logits)[[2, 0]], atol=1e-6, rtol=0)
    blind = PromptMetric(pm.per_prompt_fn, pm.name)  # reads unknown -> full logits
    for direction in ("denoise", "noise"):
        fast = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, pm,
                              direction=direction, options=dict(progress=False))
        full = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, blind,
                              direction=direction, options=dict(progress=False))
        torch.testing.assert_close(fast.per_prompt, full.per_prompt, atol=1e-5, rtol=0)


# --- the fast path --------------------------------------------------------------------------------

FAST_CASES = [("heads", "z", "all"), ("heads", "z", "each"), ("heads", "q", "all"),
              ("layers", "attn_out", "each"), ("layers", "mlp_out", "each"),
              ("layers", "resid_pre", "each")]


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_gpt2"])
@pytest.mark.parametrize("kind,site,positions", FAST_CASES)
def test_fast_path_is_used_and_equals_plain_path(request, model_name, task, kind, site,
                                                 positions):
    """On Llama (rotary, GQA) and GPT-2 blocks the probe accepts the fast path (cached attention
    output + the z write; last MLP and unembedding at read positions only), and every layer's
    chunk equals the plain hooked path."""
    model = request.getfixturevalue(model_name)
    f = hooks.facts(model)
    n, seq = task.clean_tokens.shape
    units = f.n_heads_at(site) if kind == "heads" else 1
    sweep = Sweep(kind, site, "noise", positions, f.n_layers, units,
                  seq if positions == "each" else 1, n, seq, True)
    engine = ExactEngine(model, task.clean_tokens, task.corrupt_tokens, task.prompt_metric(),
                         sweep)
    assert engine.fast and engine.length < seq  # the induction metric never reads the last logit
    assert engine.attn_at_rows == (model_name == "tiny_llama")  # rotary Llama form only
    variants = range(sweep.n_variants)
    for layer in range(f.n_layers):
        fast = engine.run_variants(layer, variants, 0, n, fast=True)
        plain = engine.run_variants(layer, variants, 0, n, fast=False)
        torch.testing.assert_close(fast, plain, atol=ATOL, rtol=0)


def test_a_wrong_fast_path_is_caught_by_the_probe(tiny_llama, task, clean_cache, monkeypatch):
    """Were the fast path wrong for some architecture, the probe would fall back to the plain
    path with a warning, and the sweep would stay exact."""
    real = ExactEngine._attn_output
    monkeypatch.setattr(ExactEngine, "_attn_output", lambda self, *a: real(self, *a) * 1.5)
    monkeypatch.setitem(engine_module._FAST_PATH_VERDICTS, tiny_llama, {})  # forget verdicts
    metric = task.prompt_metric()
    with pytest.warns(UserWarning, match="fast exact-patching path differs"):
        res = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, metric,
                             options=dict(progress=False))
    ref = tlp.get_act_patch_attn_head_out_all_pos(tiny_llama, task.corrupt_tokens, clean_cache,
                                                  metric)
    torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0)


def test_attention_at_rows_equals_the_bridge_attention(tiny_llama):
    """Queries at chosen positions only (GQA, rotary): equal to the bridge's attention there,
    zero elsewhere."""
    from circuitkit.patching import shortcuts

    attn = tiny_llama.blocks[-1].attn
    assert shortcuts.supports_attention_at_rows(attn)
    seen = {}
    handle = attn.register_forward_hook(
        lambda m, args, kwargs, out: seen.update(args=args, kwargs=kwargs, out=out),
        with_kwargs=True)
    tokens = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            tiny_llama(tokens)
    finally:
        handle.remove()
    idx = torch.tensor([[0, 5], [11, 11], [3, 7]])
    with torch.no_grad():
        out = shortcuts.attention_at_rows(attn, idx, 2)(*seen["args"], **seen["kwargs"])[0]
    rows = torch.arange(3)[:, None]
    torch.testing.assert_close(out[rows, idx], seen["out"][0][rows, idx], atol=1e-5, rtol=0)
    elsewhere = torch.ones(3, 12, dtype=torch.bool)
    elsewhere[rows, idx] = False
    assert out.abs().sum() > 0 and (out[elsewhere] == 0).all()


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_gpt2"])
def test_native_norms_skip_hooked_norms_and_change_nothing(request, model_name, task):
    """The fast path runs unhooked norms as their HF module (no second normalisation for hook
    points): every norm of the suffix and the final norm, equal outputs (bit-equal for RMSNorm;
    GPT-2's LayerNorm rounds its reductions differently, ~2e-7); a norm with a user's hook keeps
    the bridge forward, so the hook still fires."""
    from circuitkit.patching.shortcuts import native_norms

    model = request.getfixturevalue(model_name)
    L = model.cfg.n_layers
    norms = native_norms(model, 1)
    assert len(norms) == 2 * (L - 1) + 1
    x = torch.randn(2, 5, model.cfg.d_model)
    for bridge, hf_forward in norms:
        torch.testing.assert_close(hf_forward(x), bridge(x), atol=1e-6, rtol=0)
    name = "blocks.1.ln2.hook_normalized"
    with model.hooks(fwd_hooks=[(name, lambda t, hook: t)]):
        kept = native_norms(model, 1)
        assert len(kept) == len(norms) - 1 and model.blocks[1].ln2 not in [m for m, _ in kept]
    assert len(native_norms(model, 1)) == len(norms)  # the hook is gone: bypassed again
    # a hook point about to be hooked (a cache's names) keeps its norm too
    assert len(native_norms(model, 1, keep=["ln_final.hook_in"])) == len(norms) - 1


def test_post_norm_blocks_gemma2_fast_path_matches_transformerlens(task):
    """Gemma 2 normalises the attention and MLP outputs before the residual add, and its
    ``hook_attn_out``/``hook_mlp_out`` are those norms' outputs: the fast path returns the cached
    hook value from the attention/MLP and must not pass it through the norm again. With random
    post-norm gains (so a second pass is not close to a no-op), the probe accepts the fast path,
    every layer's chunk equals the plain hooked path, and the sweeps equal TransformerLens's."""
    model = with_random_post_norms({"model_type": "gemma2", "vocab_size": 64,
                                    "hidden_size": 32, "intermediate_size": 64,
                                    "num_hidden_layers": 3, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "head_dim": 8,
                                    "max_position_embeddings": 64, "seed": 0})
    f = hooks.facts(model)
    n, seq = task.clean_tokens.shape
    metric = task.prompt_metric()
    for kind, site, positions in FAST_CASES:
        units = f.n_heads_at(site) if kind == "heads" else 1
        sweep = Sweep(kind, site, "noise", positions, f.n_layers, units,
                      seq if positions == "each" else 1, n, seq, True)
        engine = ExactEngine(model, task.clean_tokens, task.corrupt_tokens, metric, sweep)
        assert engine.fast, (kind, site, positions)
        for layer in range(f.n_layers):
            fast = engine.run_variants(layer, range(sweep.n_variants), 0, n, fast=True)
            plain = engine.run_variants(layer, range(sweep.n_variants), 0, n, fast=False)
            torch.testing.assert_close(fast, plain, atol=ATOL, rtol=0)
    clean_cache = model.run_with_cache(task.clean_tokens)[1]
    for site, tl_fn in (("attn_out", tlp.get_act_patch_attn_out),
                        ("mlp_out", tlp.get_act_patch_mlp_out)):
        res = ck.patch_layers(model, task.clean_tokens, task.corrupt_tokens, metric, site=site,
                              options=dict(progress=False))
        ref = tl_fn(model, task.corrupt_tokens, clean_cache, metric)
        torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0)
