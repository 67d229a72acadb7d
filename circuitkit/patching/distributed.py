"""Sharding a sweep over ``torchrun`` processes: model replicas, chunk shares, merged results.

Two ways in:

* **library use under torchrun** (``rank_world``): active when ``torch.distributed`` is
  initialised, or when ``WORLD_SIZE > 1`` in the environment (then it is initialised here: NCCL on
  GPU, gloo on CPU). Every process is one replica.
* **replicas of several GPUs** (``init_replicas``, the CLI's ``--gpus-per-replica P``):
  ``torchrun --nnodes N --nproc-per-node M`` starts ``W = N x M`` processes, one per GPU; they
  form ``G = W / P`` replicas of ``P`` consecutive local ranks (one node each). The first process
  of a replica (its *leader*) loads the model over the replica's ``P`` GPUs and computes; the
  others lend their GPU and exit. Collectives run among the leaders only, over gloo (chunk results
  are small CPU tensors; gloo crosses nodes over TCP).

Replica ``r`` of ``G`` computes chunks ``r, r + G, ...``; ``all_gather_chunks`` merges the chunk
results on every leader, so each returns the same ``PatchResult`` a single process would, and
rank 0 writes it. Checkpoints: every replica saves its own chunks (one file per chunk, a lock per
replica) into one folder, which must be on a file system all nodes share.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class ReplicaLayout:
    """Where this process stands: global ``rank`` of ``world`` processes, ``local_rank`` of
    ``local_world`` on its node; a replica is ``procs_per_replica`` consecutive processes holding
    ``gpus_per_replica`` GPUs (equal under torchrun: one process per GPU; a single process
    holds all of its replica's GPUs)."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    procs_per_replica: int
    gpus_per_replica: int

    @property
    def replica(self) -> int:
        return self.rank // self.procs_per_replica

    @property
    def n_replicas(self) -> int:
        return self.world // self.procs_per_replica

    @property
    def leader(self) -> bool:
        return self.rank % self.procs_per_replica == 0

    @property
    def leaders(self) -> list[int]:
        return list(range(0, self.world, self.procs_per_replica))

    @property
    def local_gpus(self) -> list[int]:
        """CUDA ordinals (on this node) of this process's replica."""
        first = self.local_rank - self.local_rank % self.procs_per_replica
        return list(range(first, first + self.gpus_per_replica))


def replica_layout(rank: int, world: int, local_rank: int, local_world: int,
                   gpus_per_replica: int) -> ReplicaLayout:
    """The validated torchrun layout, one process per GPU (``ValueError`` naming
    ``--gpus-per-replica`` when it cannot be)."""
    p = gpus_per_replica
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"--gpus-per-replica must be a positive integer; got {p!r}.")
    if local_world % p:
        raise ValueError(
            f"--gpus-per-replica {p} must divide the processes per node ({local_world}, "
            "torchrun's --nproc-per-node): a replica's GPUs are on one node.")
    if world % local_world or not 0 <= rank < world or not 0 <= local_rank < local_world:
        raise ValueError(f"inconsistent torchrun environment: RANK={rank}, WORLD_SIZE={world}, "
                         f"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world}.")
    return ReplicaLayout(rank, world, local_rank, local_world, p, p)


_LAYOUT: ReplicaLayout | None = None
_GROUP: Any = None  # the leaders' process group (None: the default group)


def init_replicas(gpus_per_replica: int = 1) -> ReplicaLayout:
    """Set this process up as part of a replica (see module docstring) and return its layout.

    Outside torchrun: one replica of ``gpus_per_replica`` GPUs in this process. Under torchrun:
    the default process group is initialised (gloo: only CPU objects cross it), then the
    leaders' group; every process must call this (group creation is collective)."""
    global _LAYOUT, _GROUP
    import torch.distributed as dist

    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1 or not dist.is_available():
        if isinstance(gpus_per_replica, bool) or not isinstance(gpus_per_replica, int) \
                or gpus_per_replica < 1:
            raise ValueError(f"--gpus-per-replica must be a positive integer; got "
                             f"{gpus_per_replica!r}.")
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus_per_replica > 1 and gpus_per_replica > have:
            raise ValueError(f"--gpus-per-replica {gpus_per_replica} needs that many CUDA GPUs; "
                             f"this machine has {have}.")
        _LAYOUT, _GROUP = ReplicaLayout(0, 1, 0, 1, 1, gpus_per_replica), None
        return _LAYOUT
    layout = replica_layout(int(env["RANK"]), world, int(env.get("LOCAL_RANK", "0")),
                            int(env.get("LOCAL_WORLD_SIZE", str(world))), gpus_per_replica)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    _GROUP = dist.new_group(ranks=layout.leaders, backend="gloo")
    _LAYOUT = layout
    return layout


def rank_world() -> tuple[int, int]:
    """(this process's share index, number of shares): (replica, replicas) after ``init_replicas``;
    else (rank, world size), initialising the default process group under torchrun if needed."""
    import torch.distributed as dist

    if _LAYOUT is not None:
        return _LAYOUT.replica, _LAYOUT.n_replicas
    if not dist.is_available():
        return 0, 1
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return 0, 1
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def _active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and rank_world()[1] > 1


def barrier() -> None:
    import torch.distributed as dist

    if _active():
        dist.barrier(group=_GROUP)


def all_gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every share (replica), in share order; ``[obj]`` when not distributed."""
    import torch.distributed as dist

    if not _active():
        return [obj]
    parts: list[Any] = [None] * rank_world()[1]
    dist.all_gather_object(parts, obj, group=_GROUP)
    return parts


def all_gather_chunks(mine: dict[int, Tensor]) -> dict[int, Tensor]:
    """Every share's ``{chunk_id: result}`` merged, on every share (CPU tensors, exact bits)."""
    merged: dict[int, Tensor] = {}
    for p in all_gather_objects({k: v.cpu() for k, v in mine.items()}):
        merged.update(p or {})
    return merged


def agreed_min(value: int) -> int:
    """The smallest ``value`` over all shares (e.g. rows per forward: every share must cut the
    sweep into the same chunks)."""
    return min(all_gather_objects(int(value)))
