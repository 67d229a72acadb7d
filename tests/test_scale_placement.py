"""Placement on CPU: a device_map'd bf16 load of a tiny 8:1 GQA Llama, and the out-of-memory
back-off (forced: the engine raises an OOM above a size), each equal to a plain run."""

from __future__ import annotations

import json

import pytest
import torch
from _scale import TINY_GQA8, induction, save_tiny

import circuitkit as ck
from circuitkit import models
from circuitkit.patching import api
from circuitkit.patching.exact import ExactEngine
from circuitkit.patching.sweep import Chunk, chunked, is_out_of_memory


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-gqa8"))


@pytest.fixture(scope="module")
def fp32(folder):
    return ck.load_model(str(folder), device="cpu")


def layer_map(n_layers: int, device: str = "cpu") -> dict[str, str]:
    """The shape of a 70B split (embedding, layers, norm, head each named), on ``device``."""
    dm = {"model.embed_tokens": device, "model.rotary_emb": device, "model.norm": device,
          "lm_head": device}
    dm.update({f"model.layers.{i}": device for i in range(n_layers)})
    return dm


def test_device_map_load_is_raw_bf16_and_sweeps_like_a_plain_load(folder):
    from safetensors.torch import load_file

    mapped = ck.load_model(str(folder), device_map=layer_map(2), dtype="bf16")
    plain = ck.load_model(str(folder), device="cpu", dtype="bf16")
    assert {p.dtype for p in mapped.parameters()} == {torch.bfloat16}  # nothing upcast to fp32
    f = ck.hooks.facts(mapped)
    assert (f.n_heads, f.n_kv_heads) == (16, 2)  # 8:1 as Llama-3-70B
    # raw weights: the saved tensors, only cast (no folding, centring or reordering)
    saved = load_file(str(folder / "model.safetensors"))
    q0 = mapped.original_model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q0, saved["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16))
    task = induction()
    kw = dict(options=dict(progress=False), site="z")
    a = ck.patch_heads(mapped, task.clean_tokens, task.corrupt_tokens, task.metric, **kw)
    b = ck.patch_heads(plain, task.clean_tokens, task.corrupt_tokens, task.metric, **kw)
    assert torch.equal(a.values, b.values)
    assert (a.values - a.corrupt).abs().max() > 1e-3  # the sweep sees real effects


def test_replica_placement_and_weights_here(folder, monkeypatch, tmp_path):
    assert models.replica_placement([0]) == dict(device="cpu")  # no CUDA on this machine
    assert models.weights_available(str(folder)) and models.weights_available("icd-teacher")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert not models.weights_available("llama3-70b")
    assert models.local_tokenizer("llama3-70b") is None
    assert models.local_tokenizer(str(folder)) is not None


def oom_above(limit_rows: int, limit_cached: int, monkeypatch) -> list[int]:
    """Make the engine raise torch.cuda.OutOfMemoryError for forwards of more than
    ``limit_rows`` patched sequences, or cached runs of more than ``limit_cached`` rows."""
    sizes: list[int] = []
    run, cached = ExactEngine.run_variants, ExactEngine._cached_runs

    def run_variants(self, layer, variants, p0, p1, fast=None):
        sizes.append(len(variants) * (p1 - p0))
        if sizes[-1] > limit_rows:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return run(self, layer, variants, p0, p1, fast)

    def cached_runs(self, token_sets, names, rows):
        if rows > limit_cached:
            raise RuntimeError("CUDA error: out of memory")
        return cached(self, token_sets, names, rows)

    monkeypatch.setattr(ExactEngine, "run_variants", run_variants)
    monkeypatch.setattr(ExactEngine, "_cached_runs", cached_runs)
    return sizes


def test_out_of_memory_backs_off_and_equals_a_run_without(fp32, monkeypatch):
    task = induction(n=4)
    kw = dict(options=dict(progress=False, batch_size=64), positions="each", site="z")
    ref = ck.patch_heads(fp32, task.clean_tokens, task.corrupt_tokens, task.metric, **kw)
    assert ref.meta["oom_backoffs"] == 0 and ref.meta["rows"] == 64
    sizes = oom_above(12, 16, monkeypatch)
    with pytest.warns(UserWarning, match="out of memory with 64 sequences"):
        res = ck.patch_heads(fp32, task.clean_tokens, task.corrupt_tokens, task.metric, **kw)
    assert res.meta["oom_backoffs"] == 3 and res.meta["rows"] == 8  # 64 -> 32 -> 16 -> 8
    assert max(s for s in sizes) > 12 and sizes[-1] <= 12
    assert torch.allclose(res.values, ref.values, atol=1e-6, rtol=0)
    assert torch.allclose(res.per_prompt, ref.per_prompt, atol=1e-6, rtol=0)


def test_a_chunk_that_does_not_fit_is_split(fp32, monkeypatch):
    task = induction(n=4)
    pm = task.metric
    sweep = api.make_sweep(fp32, "heads", "z", "denoise", "all", task.clean_tokens, pm)
    sweep = chunked(sweep, 64)
    engine = ExactEngine(fp32, task.clean_tokens, task.corrupt_tokens, pm, sweep, rows=64)
    chunk = Chunk(0, 0, 16, 0, 4)
    whole = engine.run_chunk(chunk)
    oom_above(6, 10**6, monkeypatch)
    splits = [0]
    fitted = api._chunk_fitting(engine, chunk, splits)
    assert splits[0] > 0 and fitted.shape == whole.shape == (16, 4)
    assert torch.allclose(fitted, whole, atol=1e-6, rtol=0)


def test_other_errors_are_not_retried(fp32, monkeypatch):
    def broken(self, *a, **k):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(ExactEngine, "run_variants", broken)
    task = induction(n=2)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        ck.patch_heads(fp32, task.clean_tokens, task.corrupt_tokens, task.metric,
                       options=dict(progress=False))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("x"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_tiny_config_has_the_70b_ratio():
    cfg = json.loads((models.CONFIGS_DIR / "meta-llama--Meta-Llama-3-70B.json").read_text())
    assert cfg["num_attention_heads"] // cfg["num_key_value_heads"] == \
        TINY_GQA8["num_attention_heads"] // TINY_GQA8["num_key_value_heads"] == 8
