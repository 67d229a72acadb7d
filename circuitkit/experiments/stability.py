"""Stability of a reported head set and where a decision is made, stated as the evidence allows.

Everything here is a function of per-prompt patching values (``PatchResult.per_prompt``) and
validation rows; no model runs here. ``helpful`` values are per prompt and per unit, positive
when the unit helps the phase: noise ``clean_i - patched_i`` (removing the head's clean
activation lowers the metric), denoise ``patched_i - corrupt_i``.

* ``bootstrap_inclusion(helpful, k)``: resample the prompts with replacement (``n_boot``
  resamples, ``patch_result.resample_weights``), re-rank the units by their resampled mean, and
  count the fraction of resamples in which each unit is among the top ``k`` (ties to the lower
  unit index, as ``causal.causal_heads`` orders them).
* ``stable_core(names, inclusion, top)``: a reported top set as its stable core (inclusion >=
  ``CORE_MIN``) plus, for the slots that rotate, "one of" the heads that fill them in the
  resamples (inclusion >= ``ROTATE_MIN``), each with its inclusion.
* ``share_interval(helpful, gap)``: a ratio of means ``mean(helpful) / mean(gap)`` with its
  percentile bootstrap interval (the same resamples for numerator and denominator).
* ``power_share(low, high)``: the smallest share a test of this size detects with 80% power at
  5% (two-sided): ``2.8 * SE``, ``SE = (high - low) / 3.92``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

CORE_MIN = 0.9  # a head in at least this share of the resamples' top k is in the stable core
ROTATE_MIN = 0.1  # a head filling a rotating slot in at least this share is named ("one of")
N_BOOT = 1000
Z_POWER = 2.8  # 1.96 + 0.84: a share this many SEs from 0 is found with 80% power at 5%


def helpful(res: Any) -> Float[Tensor, "n_prompts ..."] | None:
    """Per-prompt helpful values of a ``PatchResult`` (module docstring), values-shaped after the
    prompt axis; None without per-prompt values."""
    if res is None or res.per_prompt is None or res.clean_per_prompt is None:
        return None
    pp = res.per_prompt.double()
    extra = (slice(None),) + (None,) * (pp.dim() - 1)
    if res.direction == "noise":
        return res.clean_per_prompt.double()[extra] - pp
    return pp - res.corrupt_per_prompt.double()[extra]


def gaps(res: Any) -> Float[Tensor, " n_prompts"]:
    """Per-prompt clean - corrupt of a ``PatchResult``."""
    return res.clean_per_prompt.double() - res.corrupt_per_prompt.double()


def bootstrap_inclusion(helpful: Float[Tensor, "n units"], k: int, n_boot: int = N_BOOT,
                        seed: int = 0) -> Float[Tensor, " units"]:
    """Fraction of ``n_boot`` prompt resamples in which each unit is among the top ``k`` by its
    resampled mean helpful value (module docstring). ``helpful``: ``[n_prompts, n_units]``."""
    from circuitkit.patching.results.patch_result import resample_weights

    n, u = helpful.shape
    if not 1 <= int(k) <= u:
        raise ValueError(f"k must be in 1..{u} (units); got {k!r}.")
    means = resample_weights(n, n_boot, seed) @ helpful.double()  # [n_boot, units]
    # stable sort on -mean: ties go to the lower unit index
    order = torch.sort(-means, dim=1, stable=True).indices[:, :int(k)]
    counts = torch.zeros(u, dtype=torch.float64)
    counts.scatter_add_(0, order.reshape(-1), torch.ones(order.numel(), dtype=torch.float64))
    return counts / n_boot


def top_units(helpful: Float[Tensor, "n units"], k: int) -> list[int]:
    """The ``k`` units with the largest mean helpful value (ties to the lower index)."""
    return torch.sort(-helpful.double().mean(0), stable=True).indices[:int(k)].tolist()


def stable_core(names: Sequence[str], inclusion: Sequence[float], top: Sequence[int],
                core_min: float = CORE_MIN, rotate_min: float = ROTATE_MIN) -> dict[str, Any]:
    """A top set (``top``: unit indices into ``names``/``inclusion``) as its stable ``core``
    (inclusion >= ``core_min``), the number of ``slots`` that rotate (``len(top) - len(core)``)
    and the heads that fill them (``one_of``: every other unit with inclusion >= ``rotate_min``,
    most often first), each ``[name, inclusion]``; ``top`` with each head's inclusion."""
    inc = [float(x) for x in inclusion]
    core = [i for i in top if inc[i] >= core_min]
    rest = sorted((i for i in range(len(names)) if i not in core and inc[i] >= rotate_min),
                  key=lambda i: (-inc[i], i))
    slots = len(top) - len(core)
    return dict(top=[[names[i], round(inc[i], 3)] for i in top],
                core=[[names[i], round(inc[i], 3)] for i in core], slots=slots,
                one_of=[[names[i], round(inc[i], 3)] for i in rest] if slots else [],
                core_min=core_min, rotate_min=rotate_min)


def core_phrase(core: dict[str, Any]) -> str:
    """``stable_core``'s dict in words: "L0H2 (1.00), L0H5 (0.97) plus 2 of L0H4 (0.92), L0H1
    (0.73), L0H7 (0.12)" (bootstrap inclusion in brackets)."""
    fmt = lambda pairs: ", ".join(f"{n} ({v:.2f})" for n, v in pairs)  # noqa: E731
    said = fmt(core["core"]) if core["core"] else "no head"
    if core["slots"]:
        said += (f" plus {core['slots']} of {fmt(core['one_of'])}" if core["one_of"] else
                 f" plus {core['slots']} slot{'s' if core['slots'] > 1 else ''} no head fills "
                 f"in {core['rotate_min']:.0%} of the resamples")
    return said


def share_interval(helpful: Float[Tensor, "n units"], gap: Float[Tensor, " n"],
                   n_boot: int = N_BOOT, seed: int = 0, level: float = 0.95
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """``(share, low, high)``, each ``[units]``: ``mean(helpful) / mean(gap)`` and its
    percentile bootstrap interval (ratio of means per resample)."""
    from circuitkit.patching.results.patch_result import resample_weights

    h, g = helpful.double(), gap.double()
    w = resample_weights(h.shape[0], n_boot, seed)
    ratio = (w @ h) / (w @ g)[:, None]  # [n_boot, units]
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(ratio, q, dim=0)
    return h.mean(0) / g.mean(), lo, hi


def power_share(low: float, high: float) -> float:
    """The smallest share a test with this 95% interval finds with 80% power at 5%."""
    return Z_POWER * (float(high) - float(low)) / 3.92


def layer_of_depth(layer: int, n_layers: int) -> str:
    """"early" (the first third of the layers), "mid" or "late" (the last third)."""
    if 3 * layer < n_layers:
        return "early"
    return "mid" if 3 * layer < 2 * n_layers else "late"
