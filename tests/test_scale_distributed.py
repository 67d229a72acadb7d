"""Replicas under torchrun, on CPU with gloo: 2 ranks as 2 replicas (and as 1 replica of 2
"GPUs") through the CLI give the single-process result; the replica layout of N nodes x M
processes; the Slurm script."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _scale import save_tiny

import circuitkit as ck
from circuitkit.patching.distributed import replica_layout
from circuitkit.patching.results import PatchResult

ROOT = Path(__file__).parents[1]
N = "4"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cli(*runs: list[str], world: int = 2) -> list[list[str]]:
    """Each of ``runs`` (CLI arguments) by ``world`` processes in the environment torchrun gives
    them; all runs at once. Returns each run's outputs by rank."""
    started = []
    for args in runs:
        port, procs = free_port(), []
        for rank in range(world):
            env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen([sys.executable, "-m", "circuitkit.cli", *args],
                                          env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        started.append(procs)
    outs = []
    for procs in started:
        outs.append([])
        for p in procs:
            out, _ = p.communicate(timeout=240)
            assert p.returncode == 0, out[-3000:]
            outs[-1].append(out)
    return outs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    folder = save_tiny(tmp / "model")
    base = ["patch", "--model", str(folder), "--task", "induction", "-n", N, "--method",
            "exact", "--batch-size", "8"]  # 16 heads x 4 prompts per layer: 8 chunks per layer
    two, one = torchrun_cli([*base, "--gpus-per-replica", "1", "--out", str(tmp / "two")],
                            [*base, "--gpus-per-replica", "2", "--out", str(tmp / "one")])
    task = ck.load_task("induction", n_examples=int(N), split="test", phase=2)
    single = ck.patch_heads(ck.load_model(str(folder)), task.clean_tokens, task.corrupt_tokens,
                            task.metric, options=dict(batch_size=8, progress=False))
    return tmp, two, one, single


def test_two_replicas_equal_one_process(runs):
    tmp, outs, _, single = runs
    res = PatchResult.load(tmp / "two" / "result")
    assert res.meta["world"] == 2  # two replicas shared the chunks
    assert torch.equal(res.values, single.values)
    assert torch.equal(res.per_prompt, single.per_prompt)
    # each replica checkpointed its own chunks into the shared folder: together, all of them
    chunks = list((tmp / "two" / "checkpoints" / "result").glob("chunk_*.safetensors"))
    assert len(chunks) == res.meta["n_chunks"] > 2
    assert {p.name for p in (tmp / "two" / "checkpoints" / "result").glob("lock.rank*")} == {
        "lock.rank0", "lock.rank1"}
    assert "wrote" in outs[0] and "wrote" not in outs[1]  # rank 0 writes the merged result


def test_two_processes_as_one_replica_of_two(runs):
    tmp, _, outs, single = runs
    res = PatchResult.load(tmp / "one" / "result")
    assert res.meta["world"] == 1
    assert torch.equal(res.values, single.values)
    assert "GPU lent to replica 0 (led by rank 0)" in outs[1]


def test_layout_of_nodes_and_replicas():
    # 2 nodes x 4 processes, 2 GPUs per replica: 4 replicas led by ranks 0, 2, 4, 6
    lay = [replica_layout(r, 8, r % 4, 4, 2) for r in range(8)]
    assert [x.replica for x in lay] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [x.leader for x in lay] == [True, False] * 4
    assert lay[0].leaders == [0, 2, 4, 6] and lay[0].n_replicas == 4
    assert lay[5].local_gpus == [0, 1] and lay[6].local_gpus == [2, 3]
    with pytest.raises(ValueError, match="--gpus-per-replica 3 must divide"):
        replica_layout(0, 8, 0, 4, 3)
    with pytest.raises(ValueError, match="--gpus-per-replica must be a positive integer"):
        replica_layout(0, 8, 0, 4, 0)


def test_slurm_script_runs_torchrun_over_replicas():
    script = ROOT / "examples" / "slurm_patch.sbatch"
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for must in ("#SBATCH --nodes", "#SBATCH --gpus-per-node", "srun", "torchrun",
                 '--nnodes "$SLURM_NNODES"', "--nproc-per-node", "--rdzv-backend c10d",
                 "-m circuitkit.cli patch", "--gpus-per-replica"):
        assert must in text, must
