"""Sharding a sweep over ``torchrun`` ranks.

Active when ``torch.distributed`` is initialised, or when ``WORLD_SIZE > 1`` in the environment
(then it is initialised here: NCCL on GPU, gloo on CPU). Rank ``r`` computes chunks
``r, r + world, ...``; ``all_gather_chunks`` merges the chunk results on every rank, so each rank
returns the same ``PatchResult`` as a single-process run would.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor


def rank_world() -> tuple[int, int]:
    """(rank, world size); initialises the default process group under torchrun if needed."""
    import torch.distributed as dist

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


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_gather_chunks(mine: dict[int, Tensor]) -> dict[int, Tensor]:
    """Every rank's ``{chunk_id: result}`` merged, on every rank (CPU tensors, exact bits)."""
    import torch.distributed as dist

    parts: list[dict[int, Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.cpu() for k, v in mine.items()})
    merged: dict[int, Tensor] = {}
    for p in parts:
        merged.update(p or {})
    return merged
