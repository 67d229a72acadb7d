"""Checkpointed sweeps: SIGKILL mid-sweep then resume == uninterrupted, bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import circuitkit as ck
from circuitkit.metrics import PromptMetric
from circuitkit.patching.exact import ExactEngine

TESTS = Path(__file__).parent
SWEEP = dict(positions="each", site="z")  # (batch_size=6: BATCH)
BATCH = 6  # 3 layers x 24 chunks, 2 variants each

CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from tinymodels import TINY_LLAMA, make_model
    import circuitkit as ck
    from circuitkit.metrics import PromptMetric
    model = make_model(TINY_LLAMA)
    task = ck.load_task("induction", n_examples=3, seg_len=5, vocab_size=64, seed=2)
    pm = task.prompt_metric()
    def slow(logits, idx, rows):
        time.sleep(0.05)  # slow enough for the parent to kill us mid-sweep
        return pm.per_prompt_fn(logits, idx, rows)
    ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, PromptMetric(slow, pm.name),
                   options=dict(checkpoint=sys.argv[1], progress=False, batch_size=6),
                   **{sweep!r})
    print("FINISHED")
""")


@pytest.fixture(scope="module")
def task():
    return ck.load_task("induction", n_examples=3, seg_len=5, vocab_size=64, seed=2)


def counting_chunks(monkeypatch, calls: list[int], fail_at: int | None = None) -> None:
    """Count ``ExactEngine.run_chunk`` calls; raise KeyboardInterrupt at call ``fail_at``."""
    real = ExactEngine.run_chunk

    def run_chunk(self, chunk):
        calls.append(1)
        if fail_at is not None and len(calls) == fail_at:
            raise KeyboardInterrupt
        return real(self, chunk)

    monkeypatch.setattr(ExactEngine, "run_chunk", run_chunk)


def test_sigkill_then_resume_is_bit_identical(tiny_llama, task, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(TESTS), sweep=SWEEP))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, str(script), str(ckpt)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and len(list(ckpt.glob("chunk_*.safetensors"))) < 4:
        assert child.poll() is None, "child ended before it could be killed"
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    n_saved = len(list(ckpt.glob("chunk_*.safetensors")))
    assert child.returncode == -signal.SIGKILL and n_saved >= 4

    pm = task.prompt_metric()
    pm = PromptMetric(pm.per_prompt_fn, pm.name)  # as in the child: no declared reads
    calls: list[int] = []
    counting_chunks(monkeypatch, calls)
    resumed = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, pm, **SWEEP,
                             options=dict(batch_size=BATCH, checkpoint=ckpt, progress=False))
    n_chunks = resumed.meta["n_chunks"]
    assert n_saved < n_chunks
    assert len(calls) == n_chunks - n_saved  # only the missing chunks are computed
    full = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, pm, **SWEEP,
                          options=dict(batch_size=BATCH, progress=False))
    assert torch.equal(resumed.values, full.values)
    assert torch.equal(resumed.per_prompt, full.per_prompt)

    with pytest.raises(ValueError, match="different sweep.*direction"):
        ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, pm, direction="noise",
                       **SWEEP, options=dict(batch_size=BATCH, checkpoint=ckpt, progress=False))
    with pytest.raises(ValueError, match="different sweep.*tokens"):
        ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens.flip(0), pm, **SWEEP,
                       options=dict(batch_size=BATCH, checkpoint=ckpt, progress=False))


def test_a_model_edited_in_a_middle_layer_does_not_resume_another_models_checkpoint(
        task, tmp_path):
    """The fingerprint hashed the first and last parameters only: a copy of the model with one
    middle layer changed resumed the original's checkpoint and got its values, bit for bit."""
    from tinymodels import TINY_LLAMA, make_model

    from circuitkit.identity import model_fingerprint

    a, b = make_model(TINY_LLAMA), make_model(TINY_LLAMA)
    assert model_fingerprint(a) == model_fingerprint(b)  # same weights, same fingerprint
    with torch.no_grad():
        next(b.blocks[1].mlp.parameters()).add_(0.5)  # layer 1 of 3: neither end
    assert model_fingerprint(a) != model_fingerprint(b)
    ck.patch_heads(a, task.clean_tokens, task.corrupt_tokens, task.metric,
                   options=dict(batch_size=BATCH, checkpoint=tmp_path, progress=False))
    with pytest.raises(ValueError, match="different sweep.*model"):
        ck.patch_heads(b, task.clean_tokens, task.corrupt_tokens, task.metric,
                       options=dict(batch_size=BATCH, checkpoint=tmp_path, progress=False))


def test_a_head_ablated_in_a_wide_matrix_changes_the_fingerprint():
    """A strided sample of a large W_O sees a few of its columns only (70B: head 0's): zeroing
    head 1's slice of a 1024-wide model resumed the unablated model's checkpoint (values off by
    0.06, new baselines). The row and column bit sums see every head."""
    from circuitkit.identity import FINGERPRINT_SAMPLE, model_fingerprint

    cfg = dict(model_type="llama", vocab_size=64, hidden_size=1024, intermediate_size=256,
               num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=16, head_dim=64,
               max_position_embeddings=64, seed=0)
    model = ck.load_model(cfg)
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before  # deterministic
    name, w = next((n, p) for n, p in model.named_parameters() if "o_proj" in n)
    step = w.numel() // FINGERPRINT_SAMPLE
    sampled_cols = {i * step % w.shape[1] for i in range(FINGERPRINT_SAMPLE)}
    assert not sampled_cols & set(range(64, 128))  # the sample alone cannot see head 1
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w[:, 64:128] = 0  # ablate head 1 of layer 0
        assert model_fingerprint(model) != before, name
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert model_fingerprint(model) == before


def test_ctrl_c_saves_and_reraises(tiny_llama, task, tmp_path, monkeypatch, capsys):
    import circuitkit.models

    monkeypatch.setattr(circuitkit.models, "CACHE_DIR", tmp_path)
    pm = task.prompt_metric()
    counting_chunks(monkeypatch, [], fail_at=5)
    with pytest.raises(KeyboardInterrupt):
        ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, pm, **SWEEP,
                       options=dict(batch_size=BATCH, progress=False))
    err = capsys.readouterr().err
    assert "interrupted: 4/" in err and "checkpoint=" in err
    saved = next((tmp_path / "checkpoints").iterdir())
    assert len(list(saved.glob("chunk_*.safetensors"))) == 4
    resumed = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, pm, **SWEEP,
                             options=dict(batch_size=BATCH, checkpoint=saved, progress=False))
    full = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens, pm, **SWEEP,
                          options=dict(batch_size=BATCH, progress=False))
    assert torch.equal(resumed.values, full.values)
