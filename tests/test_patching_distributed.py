"""Sharded sweep: 2 gloo ranks on CPU (the torchrun environment, set by hand) == 1 process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import circuitkit as ck
from circuitkit.patching.results import PatchResult

TESTS = Path(__file__).parent
SWEEP = dict(positions="each", site="v")
BATCH = 5

RANK = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from tinymodels import TINY_LLAMA, make_model
    import circuitkit as ck
    model = make_model(TINY_LLAMA)
    task = ck.load_task("induction", n_examples=3, seg_len=4, vocab_size=64, seed=3)
    res = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.prompt_metric(),
                         options=dict(checkpoint=sys.argv[2], progress=False, batch_size={batch}),
                         **{sweep!r})
    res.save(sys.argv[1] + "/rank" + os.environ["RANK"])
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_ranks_equal_single_process(tiny_llama, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(tests=str(TESTS), sweep=SWEEP, batch=BATCH))
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), str(tmp_path / "ckpt")], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out[-3000:]

    task = ck.load_task("induction", n_examples=3, seg_len=4, vocab_size=64, seed=3)
    single = ck.patch_heads(tiny_llama, task.clean_tokens, task.corrupt_tokens,
                            task.prompt_metric(), **SWEEP,
                            options=dict(progress=False, batch_size=BATCH))
    for rank in range(2):
        sharded = PatchResult.load(tmp_path / f"rank{rank}")
        assert sharded.meta["world"] == 2
        assert torch.equal(sharded.values, single.values)
        assert torch.equal(sharded.per_prompt, single.per_prompt)
    # both ranks wrote their chunks into one checkpoint folder: it is complete
    n_chunks = single.meta["n_chunks"]
    assert len(list((tmp_path / "ckpt").glob("chunk_*.safetensors"))) == n_chunks
