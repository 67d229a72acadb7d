"""Training: resumable after SIGKILL with bit-identical results; the shipped induction model."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import circuitkit as ck
from circuitkit import hooks

TRAIN_SCRIPT = """
import sys
from circuitkit.training import TrainConfig, train
cfg = TrainConfig(task="induction", task_kw=dict(vocab_size=32, seg_len=(4, 8)),
                  preset="induction", steps=60, batch_size=8, lr=3e-3, warmup=5,
                  weight_decay=0.0, seed=3, pool_size=256, save_every=10)
train(cfg, sys.argv[1], progress=False)
"""


def _run(out, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAIN_SCRIPT, str(out)],
                            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, **kw)


def test_killed_training_resumes_to_identical_weights(tmp_path):
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    assert _run(ref).wait(timeout=300) == 0
    proc = _run(killed)
    state = killed / "train_state.pt"
    deadline = time.time() + 240
    while not state.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if proc.poll() is not None:
        pytest.skip("training finished before it could be killed (machine too fast)")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "model.safetensors").exists()
    step = torch.load(state, weights_only=False)["step"]
    assert 0 < step < 60
    assert _run(killed).wait(timeout=300) == 0  # resumes from the checkpoint
    a, b = load_file(ref / "model.safetensors"), load_file(killed / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_shipped_induction_model_has_previous_token_and_induction_heads():
    model = ck.load_model("induction-2l")
    task = ck.load_task("induction", n_examples=64, seed=123, split="test", seg_len=10)
    with torch.no_grad():
        logits, cache = model.run_with_cache(task.clean_tokens)
    # accuracy on the predictable second copy, fresh seed
    pos = torch.tensor(task.examples[0].answer_pos)
    acc = (logits[:, pos - 1].argmax(-1) == task.clean_tokens[:, pos]).float().mean()
    assert acc > 0.95, acc
    q = pos - 1  # query positions inside the second copy
    induction = cache[hooks.pattern(1)][:, :, q, q - 10 + 1].mean((0, 2))
    assert (induction > 0.5).sum() >= 1, induction
    p0 = cache[hooks.pattern(0)]
    allq = torch.arange(1, p0.shape[-1])
    prev = p0[:, :, allq, allq - 1].mean((0, 2))
    assert prev.max() > 0.4, prev  # one layer-0 head attends mostly to the previous token


def test_teacher_cot_rows_are_prompt_plus_the_teachers_greedy_continuation():
    from circuitkit.evaluation import greedy_decode, prompt_end
    from circuitkit.training import teacher_cot

    pool = ck.load_task("icd10", n_examples=12, seed=5)
    tokens, mask = teacher_cot(pool, "icd-teacher", batch_size=5)
    think = pool.vocab.index("<think>")
    prompts = [e.tokens[: prompt_end(e, think)] for e in pool.examples]
    # reference: the bridge, no KV cache (evaluate's decoder)
    ref = greedy_decode(ck.load_model("icd-teacher"), prompts, pool.eos_id, 40)
    for i, (p, g) in enumerate(zip(prompts, ref, strict=True)):
        n = len(p)
        assert torch.equal(tokens[i, :n], p) and not mask[i, :n].any()
        assert tokens[i, mask[i]].tolist() == g and g[-1] == pool.eos_id
        assert mask[i].nonzero().max() == n + len(g) - 1
