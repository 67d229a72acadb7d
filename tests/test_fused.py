"""The fused Llama-form suffix (``patching/exact/fused.py``): the engine's fast path on Llama (GQA),
Qwen2 (q/k/v biases) and Mistral blocks, checked against TransformerLens's own patching
functions on prompts built to exercise the packing: base and source share prefixes of different
lengths (rows start late), prompts read different positions (rows end at different places), one
prompt reads before its first difference. Also: the fused blocks equal the bridge's blocks, a
user's hook keeps the bridge path, and the probe catches a wrong fused suffix. Tolerance 1e-4
absolute on metrics of size ~1-10 (float32), as the conformance matrix."""

from __future__ import annotations

import pytest
import torch
from tinymodels import SMALL, call
from transformer_lens import patching as tlp

import circuitkit as ck
from circuitkit import hooks
from circuitkit.metrics import token_logprob_metric
from circuitkit.patching import exact as engine_module
from circuitkit.patching.exact import fused

# random tiny models barely separate clean from corrupt: that warning is not what these check
pytestmark = pytest.mark.filterwarnings("ignore::circuitkit.patching.results."
                                        "DegenerateBaselineWarning")
ATOL = 1e-4
FUSED_ARCHS = {
    "llama": dict(model_type="llama", intermediate_size=64, num_key_value_heads=2),
    "qwen2": dict(model_type="qwen2", intermediate_size=64, num_key_value_heads=2),
    "mistral": dict(model_type="mistral", intermediate_size=64, num_key_value_heads=2,
                    sliding_window=None),
    # a window shorter than the prompts: each query sees its last 3 positions only
    "mistral-window": dict(model_type="mistral", intermediate_size=64, num_key_value_heads=2,
                           sliding_window=3),
}
SEQ = 10
FIRST = [1, 3, 6, 8]  # where each prompt's corrupt tokens start to differ
ANSWERS = [[3, 4], [9], [6, 7, 8], [5]]  # answer positions: reads end at 4, 9, 8, 5
MODES = [("heads", "z", "all"), ("heads", "z", "each"), ("layers", "attn_out", "each"),
         ("layers", "mlp_out", "each"), ("layers", "resid_pre", "each")]
TL_FN = {("z", "all"): tlp.get_act_patch_attn_head_out_all_pos,
         ("z", "each"): tlp.get_act_patch_attn_head_out_by_pos,
         ("attn_out", "each"): tlp.get_act_patch_attn_out,
         ("mlp_out", "each"): tlp.get_act_patch_mlp_out,
         ("resid_pre", "each"): tlp.get_act_patch_resid_pre}


@pytest.fixture(scope="module", params=list(FUSED_ARCHS))
def arch(request):
    torch.set_num_threads(1)
    model = ck.load_model(dict(SMALL, **FUSED_ARCHS[request.param]))
    assert fused.fused_form(model) is not None, request.param
    return request.param, model


def shared_prefix_case(model):
    """4 prompts of 10 random tokens; the corrupt prompt resamples positions ``FIRST[i]..``;
    metric: log-prob of the clean tokens at ``ANSWERS[i]`` (prompt 3 reads position 4, before
    its first difference at 8)."""
    f = hooks.facts(model)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, f.d_vocab, (len(FIRST), SEQ), generator=g)
    corrupt = clean.clone()
    for i, first in enumerate(FIRST):
        corrupt[i, first:] = (clean[i, first:] + torch.randint(1, f.d_vocab, (SEQ - first,),
                                                                 generator=g)) % f.d_vocab
    metric = token_logprob_metric(ANSWERS, [clean[i, a].tolist() for i, a in enumerate(ANSWERS)])
    return clean, corrupt, metric


def count_fused(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = fused.suffix_logits

    def spy(form, pack, layer, *args, **kwargs):
        calls.append(layer)
        return real(form, pack, layer, *args, **kwargs)
    monkeypatch.setattr(fused, "suffix_logits", spy)
    return calls


@pytest.mark.parametrize("direction", ["denoise", "noise"])
@pytest.mark.parametrize("kind,site,positions", MODES)
def test_fused_suffix_equals_transformer_lens(arch, kind, site, positions, direction,
                                              monkeypatch):
    """Every mode the fused suffix serves equals TransformerLens's patching function (its base
    run patched with the source run's cache: denoise = corrupt run, clean cache; noise = the
    reverse), and the fused suffix did run, at every layer."""
    name, model = arch
    clean, corrupt, metric = shared_prefix_case(model)
    calls = count_fused(monkeypatch)
    fn = ck.patch_heads if kind == "heads" else ck.patch_layers
    res = call(fn, model, clean, corrupt, metric, site=site, positions=positions,
               direction=direction, progress=False)
    base, source = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
    with torch.no_grad():
        cache = model.run_with_cache(source)[1]
        ref = TL_FN[(site, positions)](model, base, cache, metric)
    if kind == "heads" and positions == "each":
        ref = ref.permute(0, 2, 1)  # TL: [layer, pos, head]; ours: [layer, head, pos]
    assert set(calls) == set(range(model.cfg.n_layers)), (name, calls)
    torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_fused_edges_equal_the_hand_loop(arch, direction, monkeypatch):
    """Exact edges on the fused path (the receiving head alone re-attends, or a KV head's query
    heads; the suffix packed): every edge of the default sweep (the embeddings and every head
    into every later head's q, k and v, GQA k/v on KV heads, and the logits) equals
    ``test_edges.hand_edges``, two full hooked forwards per edge; the fused path ran."""
    from test_edges import hand_edges

    _, model = arch
    clean, corrupt, metric = shared_prefix_case(model)
    seen: list[str] = []
    real = fused.FusedLlama.edge_attention

    def spy(self, b, resid, writes, z_base, sender, inputs, unit):
        seen.extend(inputs)
        return real(self, b, resid, writes, z_base, sender, inputs, unit)
    monkeypatch.setattr(fused.FusedLlama, "edge_attention", spy)
    res = ck.patch_edges(model, clean, corrupt, metric, direction=direction,
                         options=dict(progress=False,
                                      batch_size=9))  # several chunks per receiver layer
    base, source = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
    want = hand_edges(model, base, source, metric, res)
    assert set(seen) == {"q", "k", "v"}
    torch.testing.assert_close(res.values, want, atol=1e-5, rtol=0, equal_nan=True)


def test_fused_blocks_equal_the_bridge_blocks(arch):
    """Unpacked (every row from position 0), each fused block maps the bridge's cached
    ``resid_pre(j)`` to its ``resid_pre(j + 1)``, and the last block and unembedding at chosen
    positions give the bridge's logits there."""
    name, model = arch
    form = fused.fused_form(model)
    clean, _, _ = shared_prefix_case(model)
    n, L = clean.shape[0], model.cfg.n_layers
    with torch.no_grad():
        logits, cache = model.run_with_cache(clean)
        reads = torch.tensor([[0, 4, 0], [9, 9, 9], [7, 2, 7], [5, 1, 3]])  # repeats too
        pack = fused.Packing(torch.zeros(n, dtype=torch.long), torch.full((n,), SEQ),
                             torch.arange(n), reads, SEQ)
        for j in range(L - 1):
            resid = cache[hooks.resid_pre(j)]
            out = form.block(pack, pack.gather(resid), form.blocks[j], resid)
            torch.testing.assert_close(out, pack.gather(cache[hooks.resid_pre(j + 1)]),
                                       atol=1e-5, rtol=0)
        resid = cache[hooks.resid_pre(L - 1)]
        got = pack.spread(form.logits(form.last_block_at_reads(
            pack, pack.gather(resid), form.blocks[-1], resid)))
    want = logits[torch.arange(n)[:, None], reads]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("with_reads", [True, False])
def test_fused_cached_run_equals_the_bridge_cache(arch, with_reads):
    """The engine's cached runs as plain tensor code: every activation kind at every layer and
    the logits equal the bridge's ``run_with_cache``, at every position up to each row's last
    read (with reads; activations after it are zero) or at every position (without)."""
    _, model = arch
    form = fused.fused_form(model)
    clean, corrupt, _ = shared_prefix_case(model)
    tokens = torch.cat([clean, corrupt])
    kinds = fused.cache_kinds(model.cfg.n_layers)
    reads = torch.tensor([[0, 4], [9, 9], [2, 7], [5, 1]]).repeat(2, 1) if with_reads else None
    with torch.no_grad():
        logits, got = form.cached_run(tokens, kinds, reads)
        ref_logits, ref = model.run_with_cache(tokens)
    rows = torch.arange(tokens.shape[0])[:, None]
    last = reads.max(1).values if with_reads else torch.full((tokens.shape[0],), SEQ - 1)
    upto = torch.arange(SEQ)[None, :] <= last[:, None]
    torch.testing.assert_close(logits, ref_logits if reads is None else ref_logits[rows, reads],
                               atol=1e-5, rtol=0)
    for name in kinds:
        torch.testing.assert_close(got[name][upto], ref[name][upto], atol=1e-5, rtol=0)
        assert (got[name][~upto] == 0).all()


def test_a_wrong_fused_cached_run_is_caught(arch, monkeypatch):
    """Were the fused cached run wrong for some model, its one-time check against the bridge's
    run_with_cache would keep the bridge's, with a warning, and the sweep would stay exact."""
    _, model = arch
    clean, corrupt, metric = shared_prefix_case(model)
    real = fused.FusedLlama.cached_run

    def wrong(self, tokens, names, reads, devices=None):
        logits, cache = real(self, tokens, names, reads, devices)
        return logits, {name: t * 1.01 if name == hooks.z(0) else t for name, t in cache.items()}
    monkeypatch.setattr(fused.FusedLlama, "cached_run", wrong)
    monkeypatch.setitem(engine_module._FAST_PATH_VERDICTS, model, {})  # forget verdicts
    with pytest.warns(UserWarning, match="fused cached run differs"):
        res = ck.patch_heads(model, clean, corrupt, metric, options=dict(progress=False))
    with torch.no_grad():
        cache = model.run_with_cache(clean)[1]
        ref = tlp.get_act_patch_attn_head_out_all_pos(model, corrupt, cache, metric)
    torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0)


def test_a_user_hook_keeps_the_bridge_path(arch, monkeypatch):
    """Fused code fires no hook: with a user's hook attached the sweep takes the bridge path,
    and equals TransformerLens's function run under the same hook."""
    _, model = arch
    clean, corrupt, metric = shared_prefix_case(model)
    calls = count_fused(monkeypatch)
    scale = [(hooks.mlp_out(0), lambda t, hook: t * 0.5)]
    with model.hooks(fwd_hooks=scale):
        res = ck.patch_heads(model, clean, corrupt, metric, options=dict(progress=False))
        with torch.no_grad():
            cache = model.run_with_cache(clean)[1]
            ref = tlp.get_act_patch_attn_head_out_all_pos(model, corrupt, cache, metric)
    assert calls == []
    torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0)


def test_a_wrong_fused_suffix_is_caught_by_the_probe(arch, monkeypatch):
    """Were the fused suffix wrong for some model, the probe would fall back to the plain path
    with a warning, and the sweep would stay exact."""
    _, model = arch
    clean, corrupt, metric = shared_prefix_case(model)
    real = fused.FusedLlama.mlp
    monkeypatch.setattr(fused.FusedLlama, "mlp", lambda self, x, b: real(self, x, b) * 1.5)
    monkeypatch.setitem(engine_module._FAST_PATH_VERDICTS, model, {})  # forget verdicts
    with pytest.warns(UserWarning, match="fast exact-patching path differs"):
        res = ck.patch_heads(model, clean, corrupt, metric, options=dict(progress=False))
    with torch.no_grad():
        cache = model.run_with_cache(clean)[1]
        ref = tlp.get_act_patch_attn_head_out_all_pos(model, corrupt, cache, metric)
    torch.testing.assert_close(res.values, ref, atol=ATOL, rtol=0)


def test_layouts_outside_the_llama_form_are_not_fused():
    """Blocks the fused code does not reproduce keep the bridge: GPT-2 (LayerNorm, learned
    positions), Gemma 2 (post-norms, soft-caps), Mixtral (experts), OLMo 2 (post-norms, Q/K
    norms). And the attention-at-rows shortcut refuses a sliding window (Mistral's lives in its
    config, not on the module)."""
    from tinymodels import ARCHS

    from circuitkit.patching.shortcuts import supports_attention_at_rows

    for cfg in (ARCHS["gpt2"], ARCHS["gemma2"], ARCHS["mixtral"], ARCHS["olmo2"]):
        model = ck.load_model(dict(SMALL, **cfg))
        assert fused.fused_form(model) is None, cfg["model_type"]
    windowed = ck.load_model(dict(SMALL, **FUSED_ARCHS["mistral-window"]))
    assert not supports_attention_at_rows(windowed.blocks[-1].attn)
    assert fused.fused_form(windowed).blocks[0].window == 3


def test_silu_runs_in_place_only_where_it_is_plain_silu():
    """``fused._is_silu`` decides whether the MLP's activation runs as an in-place SiLU: true for
    torch's ``SiLU`` and transformers' ``SiLUActivation`` (what HF Llama-form MLPs hold), false
    for another activation or a ``SiLUActivation`` whose forward was replaced (a hub kernel);
    the in-place result equals the module's own."""
    from transformers.activations import ACT2FN

    silu = ACT2FN["silu"]
    assert fused._is_silu(silu) and fused._is_silu(torch.nn.SiLU())
    assert not fused._is_silu(ACT2FN["gelu"]) and not fused._is_silu(torch.nn.GELU())
    replaced = type(silu)()
    replaced.forward = lambda x: x  # an instance-level replacement, as a hub kernel would do
    assert not fused._is_silu(replaced)
    x = torch.randn(5, 7)
    assert torch.equal(torch.nn.functional.silu(x.clone(), inplace=True), silu(x))
