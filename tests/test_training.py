"""Training: resumable after SIGKILL with bit-identical results; checkpoints hold no pickle;
files respect the umask; the shipped induction model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from killing import kill_at_first_checkpoint
from safetensors.torch import load_file

import circuitkit as ck
from circuitkit import hooks
from circuitkit.training import TrainConfig, load_train_state, save_train_state, train

TINY_RUN = dict(task="induction", task_kw=dict(vocab_size=32, seg_len=(4, 8)), preset="induction",
                steps=6, batch_size=4, lr=3e-3, warmup=2, weight_decay=0.0, seed=1,
                pool_size=32, save_every=3)

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
    state = killed / "train_state.safetensors"
    kill_at_first_checkpoint(proc, state, timeout=240, poll=0.05)
    assert not (killed / "model.safetensors").exists()
    step = load_train_state(state)["step"]
    assert 0 < step < 60
    assert _run(killed).wait(timeout=300) == 0  # resumes from the checkpoint
    a, b = load_file(ref / "model.safetensors"), load_file(killed / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class _Payload:
    """Unpickling this runs ``os.system("touch <marker>")``: a crafted checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickled_train_state_is_refused_not_executed(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "pwned"
    out.mkdir()
    torch.save({"step": 1, "x": _Payload(marker)}, out / "train_state.pt")
    with pytest.raises(ValueError, match="train_state.pt is a pickled training state.*not loaded"):
        train(TrainConfig(**TINY_RUN), out, progress=False)
    assert not marker.exists()
    assert not (out / "model.safetensors").exists()
    # the payload is real: the old loader (torch.load, weights_only=False) would have run it
    probe = tmp_path / "probe"
    torch.save({"step": 1, "x": _Payload(probe)}, tmp_path / "probe.pt")
    subprocess.run([sys.executable, "-c", "import sys, torch; "
                    "torch.load(sys.argv[1], weights_only=False)", str(tmp_path / "probe.pt")],
                   check=True, timeout=120)
    assert probe.exists()


def test_unreadable_train_state_is_named(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_state.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match="train_state.safetensors is not a readable circuitkit "
                                         "training state"):
        train(TrainConfig(**TINY_RUN), out, progress=False)


def test_train_state_round_trip_continues_identically(tmp_path):
    """Model, AdamW (int-keyed state, betas tuple), LambdaLR and generator state survive the
    safetensors + JSON file: one more step from the reloaded state equals one more step from
    the live one, bit for bit."""

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        return model, opt, sched, torch.Generator().manual_seed(5)

    def step(model, opt, sched, gen):
        x = torch.randn(4, 5, generator=gen)
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
        sched.step()

    live = setup()
    for _ in range(3):
        step(*live)
    m, o, s, g = live
    save_train_state(tmp_path / "st.safetensors", dict(
        model=m.state_dict(), opt=o.state_dict(), sched=s.state_dict(), gen=g.get_state(),
        step=3, history=[(1, 0.5, 0.1)], config={"seg_len": (4, 8)}))
    st = load_train_state(tmp_path / "st.safetensors")
    assert st["step"] == 3 and st["history"] == [[1, 0.5, 0.1]]
    assert sorted(st["opt"]["state"]) == sorted(o.state_dict()["state"])  # int keys kept
    fresh = setup()
    fresh[0].load_state_dict(st["model"])
    fresh[1].load_state_dict(st["opt"])
    fresh[2].load_state_dict(st["sched"])
    fresh[3].set_state(st["gen"])
    step(*live)
    step(*fresh)
    for a, b in zip(live[0].parameters(), fresh[0].parameters(), strict=True):
        assert torch.equal(a, b)
    assert live[2].get_last_lr() == fresh[2].get_last_lr()


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640)])
def test_training_files_respect_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        save_train_state(tmp_path / "state.safetensors", {"w": torch.ones(2), "step": 1})
        out = train(TrainConfig(**TINY_RUN), tmp_path / "run", progress=False)
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "state.safetensors").st_mode & 0o777) == oct(mode)
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in files and "training.json" in files
    assert "train_state.safetensors" not in files and not any(f.startswith(".") for f in files)
    modes = {f: oct(os.stat(out / f).st_mode & 0o777) for f in files}
    assert set(modes.values()) == {oct(mode)}, modes
    model = ck.load_model(str(out))
    assert hooks.facts(model).n_layers == 2


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
