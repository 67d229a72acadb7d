"""Position groups: ``positions=`` as a bool mask ``[batch, seq]`` or ``{name: mask}``.

A group patches a head at the group's positions of each prompt at once (each prompt its own
positions: a task's stages or any user mask): one variant per (head, group), values
``[n_layers, n_heads, n_groups]``, ``meta["group_names"]`` and ``["groups_hash"]``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ONE_GROUP = "group"  # the name of a single mask's group


@dataclass(frozen=True, eq=False)
class PositionGroups:
    """``names`` (one per group) and ``masks``: bool ``[n_groups, n_prompts, seq]`` (CPU), in
    the caller's prompt order unless ``reordered``."""

    names: tuple[str, ...]
    masks: Tensor

    def __len__(self) -> int:
        return len(self.names)

    def hash(self) -> str:
        """16 hex digits of the names and masks (caller's order): what results and checkpoints
        record."""
        h = hashlib.sha256(repr(self.names).encode())
        h.update(repr(tuple(self.masks.shape)).encode())
        h.update(self.masks.to(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    def reordered(self, order: Tensor) -> PositionGroups:
        """The same groups over the prompts in ``order``."""
        return PositionGroups(self.names, self.masks[:, order.cpu()])

    def sizes(self) -> list[float]:
        """Mean positions per prompt of each group."""
        return [float(m.sum(1).double().mean()) for m in self.masks]


def is_groups(positions: Any) -> bool:
    """Whether ``positions`` is a position group (a tensor or a mapping), not "all"/"each"."""
    return isinstance(positions, Tensor | dict | PositionGroups)


def position_groups(positions: Any, clean: Tensor, real: Tensor | None = None) -> PositionGroups:
    """``positions`` (a bool mask ``[batch, seq]`` or ``{name: mask}``) checked against the
    tokens ``clean`` ``[batch, seq]``: every mask bool of that shape, no group empty for every
    prompt, none at a position of a prompt's right padding (``real``: tokens before it, per
    prompt). A bad one is one ``ValueError`` line."""
    if isinstance(positions, PositionGroups):
        return positions
    named = {ONE_GROUP: positions} if isinstance(positions, Tensor) else positions
    if not isinstance(named, dict) or not named:
        raise ValueError("positions as a position group must be a bool mask [batch, seq] or a "
                         f"non-empty dict {{name: mask}}; got {type(positions).__name__}.")
    n, seq = clean.shape
    out = []
    for name, mask in named.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"position group names must be non-empty strings; got {name!r}.")
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise ValueError(f"position group {name!r} must be a bool torch.Tensor [batch, seq]; "
                             f"got {type(mask).__name__} {getattr(mask, 'dtype', '')}.")
        if tuple(mask.shape) != (n, seq):
            raise ValueError(f"position group {name!r} has shape {list(mask.shape)}; the tokens "
                             f"are [{n}, {seq}] (one mask row per prompt).")
        mask = mask.detach().cpu()
        if not bool(mask.any()):
            raise ValueError(f"position group {name!r} is empty (no position of any prompt).")
        if real is not None:
            pad = mask & (torch.arange(seq)[None] >= real.cpu()[:, None])
            if bool(pad.any()):
                i = int(pad.any(1).nonzero()[0, 0])
                raise ValueError(f"position group {name!r} marks padding: prompt {i} has "
                                 f"{int(real[i])} tokens before its right padding but the mask "
                                 f"holds position(s) {pad[i].nonzero()[:, 0].tolist()[:5]}.")
        out.append(mask)
    return PositionGroups(tuple(named), torch.stack(out))


def summed_over(each: Any, groups: PositionGroups) -> Any:
    """A per-position attribution result (``positions="each"``, per-prompt values) as position
    groups: each prompt's estimate summed over its group's positions (plain attribution is
    linear in the patch: ``delta . grad`` over the group's positions), ``values [n_layers,
    n_heads, n_groups]``."""
    from circuitkit.patching.results.patch_result import PatchResult

    if each.per_prompt is None:
        raise NotImplementedError("method='attribution' with position groups needs a metric with "
                                  "per-prompt values (each prompt has its own positions).")
    base = (each.corrupt_per_prompt if each.direction == "denoise"
            else each.clean_per_prompt).double()
    delta = each.per_prompt.double() - base[:, None, None, None]  # [n, layer, head, seq]
    masks = groups.masks.to(delta.dtype)  # [group, n, seq]
    pp = (base[:, None, None, None] + torch.einsum("nlhs,gns->nlhg", delta, masks)).to(
        each.per_prompt.dtype)
    return PatchResult(values=pp.mean(0), clean=each.clean, corrupt=each.corrupt,
                       direction=each.direction, method=each.method, site=each.site,
                       positions="groups", per_prompt=pp, clean_per_prompt=each.clean_per_prompt,
                       corrupt_per_prompt=each.corrupt_per_prompt, axes=("layer", "head", "group"),
                       meta=dict(each.meta, group_names=list(groups.names)))
