"""The block estimator's all-heads MLP formula (``patching/exact/head_mlp.py``) against the MLP
module
called once per head: the same numbers (float32, rtol 1e-4), on a gated RMSNorm Llama and a
LayerNorm GELU GPT-2 with biases; the guard that falls back to the module when the formula does
not describe the block; and whole block estimates with the formula on and off."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from tinymodels import TINY_LLAMA, attribution_heads

import circuitkit as ck
from circuitkit.patching.estimators import attribution
from circuitkit.patching.estimators import block as block_estimator
from circuitkit.patching.estimators.attribution import _head_writes, _mlp_change
from circuitkit.patching.exact import head_mlp


def module_readout(model, layer, dz, r, g, dr=None):
    """Reference: ``g . [MLP(r + dr_h) - MLP(r)]`` with the block's own modules, head by head."""
    dr = _head_writes(model, layer, dz) if dr is None else dr
    return torch.einsum("bphm,bpm->bph", _mlp_change(model, layer, r, dr), g)


def random_inputs(model, seed: int, b: int = 3, p: int = 7):
    g = torch.Generator().manual_seed(seed)
    c = model.cfg
    return (torch.randn(b, p, c.n_heads, c.d_head, generator=g),
            3 * torch.randn(b, p, c.d_model, generator=g),
            torch.randn(b, p, c.d_model, generator=g))


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
def test_readout_equals_the_mlp_module_per_head(arch, request):
    model = request.getfixturevalue(arch)
    for layer in range(model.cfg.n_layers):
        dz, r, g = random_inputs(model, seed=layer)
        fast = head_mlp.head_mlp(model, layer)
        assert fast is not None, f"{arch}: the formula should cover this block"
        want = module_readout(model, layer, dz, r, g)
        got = fast.readout(dz, r, g)
        assert want.abs().max() > 1e-4  # not a comparison of zeros
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_readout_chunks_agree(tiny_llama, monkeypatch):
    dz, r, g = random_inputs(tiny_llama, seed=5, b=2, p=9)
    fast = head_mlp.head_mlp(tiny_llama, 1)
    dr = _head_writes(tiny_llama, 1, dz)
    whole = fast.readout(dz, r, g, dr)
    monkeypatch.setattr(head_mlp, "ROW_CHUNK", 5)  # 1 position x 4 heads per chunk
    torch.testing.assert_close(fast.readout(dz, r, g, dr), whole, rtol=1e-6, atol=1e-8)


def test_a_block_the_formula_does_not_describe_falls_back_to_the_module(tiny_llama, monkeypatch):
    """A norm scaled by ``1 + gamma`` (as Gemma's) is not ``gamma``: the check on the largest
    writes sees the difference and the module's numbers are returned."""
    real = head_mlp.head_mlp

    def gemma_like(model, layer):
        h = real(model, layer)
        return dataclasses.replace(h, gamma=h.gamma + 1.0)

    monkeypatch.setattr(head_mlp, "head_mlp", gemma_like)
    monkeypatch.setattr(block_estimator, "head_mlp_pays", lambda *a: True)
    dz, r, g = random_inputs(tiny_llama, seed=1)
    dr = _head_writes(tiny_llama, 0, dz)
    wrong = gemma_like(tiny_llama, 0).readout(dz, r, g, dr)
    want = module_readout(tiny_llama, 0, dz, r, g)
    assert (wrong - want).abs().max() > 1e-2 * want.abs().max()  # the fake really is wrong
    with pytest.warns(RuntimeWarning, match="once per head"):
        got = attribution._head_mlp_z(tiny_llama, 0, dz, dr, r, g)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
@pytest.mark.parametrize("direction", ["noise", "denoise"])
def test_block_estimates_with_and_without_the_formula(arch, direction, request, monkeypatch):
    model = request.getfixturevalue(arch)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(1, model.cfg.d_vocab, (4, 12), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2:5] = torch.randint(1, model.cfg.d_vocab, (4, 3), generator=g)

    def metric(logits):
        return logits[:, -1].log_softmax(-1)[torch.arange(4), clean[:, -1]]

    calls = []
    readout = head_mlp.HeadMLP.readout

    def spy(self, dz, *rest):
        calls.append(dz.shape[:2])
        return readout(self, dz, *rest)

    monkeypatch.setattr(head_mlp.HeadMLP, "readout", spy)
    monkeypatch.setattr(block_estimator, "head_mlp_pays", lambda *a: True)
    on = attribution_heads(model, clean, corrupt, metric, direction=direction,
                           estimator="block", progress=False)
    assert (4, 12) in calls  # the whole batch went through the formula
    monkeypatch.setattr(block_estimator, "head_mlp_pays", lambda *a: False)
    calls.clear()
    off = attribution_heads(model, clean, corrupt, metric, direction=direction,
                            estimator="block", progress=False)
    assert not calls
    spread = float((off.values - off.values.mean()).abs().max())
    assert spread > 1e-5  # estimates that differ by head
    torch.testing.assert_close(on.values, off.values, rtol=0, atol=1e-2 * spread)


def test_when_it_pays():
    assert not attribution.head_mlp_pays(84, 9, 576)  # SmolLM2, 4 prompts x 21 tokens
    assert attribution.head_mlp_pays(2048, 9, 576)
    assert attribution.head_mlp_pays(2048, 64, 8192)  # a 70B, 16 prompts x 128 tokens


def test_block_cost_follows_the_path_taken(tiny_llama, monkeypatch):
    """Pass-equivalents per prompt: H MLP calls below the threshold or without a batch; the
    all-heads formula's cost above it (gated: k = 2), independent of H; per head again for a
    model the formula does not cover."""
    c = tiny_llama.cfg  # 4 heads, d_model 64: the formula pays from 33 positions per call
    s_attn, s_mlp = attribution.block_shares(tiny_llama, 12)
    per_head = 4 + c.n_heads * s_mlp
    passes = attribution.estimator_passes
    assert passes(tiny_llama, "block", "z", "all", 12) == pytest.approx(per_head)
    assert passes(tiny_llama, "block", "z", "all", 12, batch=2) == pytest.approx(per_head)
    n = 4 * 12
    assert passes(tiny_llama, "block", "z", "all", 12, batch=4) == pytest.approx(
        4 + s_mlp * (5 + 2 * c.d_model / n) / 3)
    monkeypatch.setattr(head_mlp, "covers", lambda model: False)
    assert passes(tiny_llama, "block", "z", "all", 12, batch=4) == pytest.approx(per_head)


def test_bf16_model_gets_float32_estimates_and_keeps_its_weights(monkeypatch):
    """In bf16, ``MLP(r + dr) - MLP(r)`` run by the module loses most of its digits to rounding
    (12% of the largest effect here, against a float64 run of the module); the formula keeps its
    products in bf16 and the rest in float32 (0.4%: bf16's rounding of the products), and the
    model keeps its own bf16 weight tensors (the check upcasts copies and puts them back)."""
    torch.manual_seed(0)
    model = ck.load_model(dict(TINY_LLAMA), dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    storage = {k: v.data_ptr() for k, v in model.state_dict().items()}
    monkeypatch.setattr(block_estimator, "head_mlp_pays", lambda *a: True)
    dz, r, g = (t.to(torch.bfloat16) for t in random_inputs(model, seed=2, b=2, p=9))
    layer = 1
    dr = _head_writes(model, layer, dz)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the check must pass: no fallback
        got = attribution._head_mlp_z(model, layer, dz, dr, r, g)
    assert got.dtype == torch.float32
    block = model.blocks[layer]
    with attribution._parameters_as(torch.float64, block.ln2, block.mlp):
        dr64 = torch.einsum("bphd,hdm->bphm", dz.double(), block.attn.W_O.double())
        truth = module_readout(model, layer, None, r.double(), g.double(), dr=dr64)
    scale = float(truth.abs().max())
    err_formula = float((got.double() - truth).abs().max()) / scale
    monkeypatch.setattr(block_estimator, "head_mlp_pays", lambda *a: False)
    per_head = attribution._head_mlp_z(model, layer, dz, dr, r, g)
    err_bf16 = float((per_head.double() - truth).abs().max()) / scale
    assert err_formula < 1e-2 and err_formula < err_bf16 / 10  # measured: 0.004 and 0.12
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert all(after[k].data_ptr() == ptr for k, ptr in storage.items())  # the same tensors


def test_compiled_chunk_equals_eager(tiny_gpt2, monkeypatch):
    """What runs on a GPU: ``_chunk_readout`` through ``torch.compile`` (here its CPU backend) gives
    the eager numbers, for a LayerNorm GELU MLP with biases, on two chunk sizes."""
    try:
        torch.compile(lambda x: x * 2)(torch.ones(2))
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"torch.compile does not run here: {type(e).__name__}")
    fast = head_mlp.head_mlp(tiny_gpt2, 1)
    dz, r, g = random_inputs(tiny_gpt2, seed=4, b=2, p=6)
    eager = fast.readout(dz, r, g)
    compiled = torch.compile(head_mlp._chunk_readout, dynamic=True)
    monkeypatch.setattr(head_mlp, "_chunk_function", lambda device, act: compiled)
    monkeypatch.setattr(head_mlp, "ROW_CHUNK", 12)  # 3 positions x 4 heads per chunk
    torch.testing.assert_close(fast.readout(dz, r, g), eager, rtol=1e-5,
                               atol=1e-5 * float(eager.abs().max()))


def test_a_compile_failure_falls_back_to_eager_once(tiny_llama, monkeypatch):
    def broken(*args):
        raise RuntimeError("no Triton here")

    monkeypatch.setattr(head_mlp, "_COMPILED", {"fn": broken})
    fast = head_mlp.head_mlp(tiny_llama, 0)
    dz, r, g = random_inputs(tiny_llama, seed=6)
    eager = fast.readout(dz, r, g)  # on CPU: never compiled
    dr = _head_writes(tiny_llama, 0, dz)
    chunk = head_mlp._chunk_function(torch.device("cuda"), fast.act)  # SiLU: would compile
    args = ([torch.bmm(dz.reshape(-1, *dz.shape[2:]).transpose(0, 1), V) for V in fast.V],
            [(fast.gamma * r.reshape(-1, r.shape[-1])) @ W for W in fast.W],
            (r.reshape(-1, 1, r.shape[-1]) + dr.reshape(-1, *dr.shape[2:])).transpose(0, 1),
            r.reshape(1, -1, r.shape[-1]), g.reshape(-1, g.shape[-1]) @ fast.W_out.T,
            fast.gW, fast.bW, fast.centered, fast.eps, fast.act)
    with pytest.warns(RuntimeWarning, match="running it eagerly"):
        got = chunk(*args)
    torch.testing.assert_close(got.reshape(eager.shape), eager, rtol=1e-5, atol=1e-9)
    assert head_mlp._COMPILED["failed"]
    assert head_mlp._chunk_function(torch.device("cuda"), fast.act) is head_mlp._chunk_readout


def test_parallel_block_has_no_mlp_after_the_head(monkeypatch):
    """GPT-NeoX with a parallel residual: attention and MLP both read the block input, so the
    block estimate is plain AtP, with the formula on or off; the write scale's denominator is the
    block input (there is no ``resid_mid`` to read)."""
    model = ck.load_model({"model_type": "gpt_neox", "vocab_size": 64, "hidden_size": 32,
                           "intermediate_size": 64, "num_hidden_layers": 3,
                           "num_attention_heads": 4, "max_position_embeddings": 64,
                           "use_parallel_residual": True, "seed": 0})
    assert model.cfg.parallel_attn_mlp and not head_mlp.covers(model)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(1, 64, (4, 12), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2:5] = torch.randint(1, 64, (4, 3), generator=g)

    def metric(logits):
        return logits[:, -1].log_softmax(-1)[torch.arange(4), clean[:, -1]]

    atp = attribution_heads(model, clean, corrupt, metric, direction="noise",
                            progress=False)
    assert (atp.values - atp.clean).abs().max() > 1e-4
    for pays in (False, True):
        monkeypatch.setattr(block_estimator, "head_mlp_pays", lambda *a, pays=pays: pays)
        block = attribution_heads(model, clean, corrupt, metric, direction="noise",
                                  estimator="block", progress=False)
        torch.testing.assert_close(block.values, atp.values, rtol=0, atol=1e-6)
        assert block.meta["write_scale"] == atp.meta["write_scale"]
