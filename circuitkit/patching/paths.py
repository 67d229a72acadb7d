"""Path patching through everything between a sender and a receiver (``ck.patch_paths``:
``PathUnits`` through ``ck.patch``, its engine ``patching/exact/paths.py``; docs/edges.md,
"Paths"); here, each sender's node effect and the share of it that paths or edges carry. A q/k/v
edge carries a sender's *direct* write only; a path carries all of it (MLPs, other heads, other
positions in between).

For sender ``s = (l_s, h_s)``, receiver ``r = (l_r, h_r)``, ``l_r > l_s`` (denoise: base =
corrupt run, source = clean run; noise: the reverse): the *sender run* is the base run with
``s``'s ``z`` from the source at every position, everything downstream recomputed; the *path
run* is the base run with ``r``'s q/k/v (position-wise functions of its ``resid_pre(l_r)``)
taken from the sender run at the positions of group ``g`` (all without ``positions``), base
elsewhere, the layers from ``l_r`` on recomputed. ``path(s, r, g) = M(path run) - M(base)``
(``values`` hold ``M(path run)``) and, as for edges,

    node(s)     = M(sender run) - M(base)
    coverage(s) = sum_r path(s, r) / node(s),   overall = sum_{s, r} path(s, r) / sum_s node(s)

(per group; paths into several receivers overlap, so coverage is a share, not a partition).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks


def node_effects(model: Any, clean: Tensor, corrupt: Tensor, metric: Any,
                 senders: Sequence[tuple[int, int]], direction: str,
                 batch_size: int | None = None) -> Float[Tensor, " sender"]:
    """``node(s) = mean_i M(sender run_i) - M(base_i)`` of each head sender: the base run with
    ``s``'s ``z`` from the source at every position, everything after it recomputed (the
    denominator of ``coverage``; ``metric``: a checked ``PromptMetric``): ``PathEngine``'s
    ``node_effects`` on a layout of these senders and no receiver (a path sweep reuses its own
    engine instead)."""
    from circuitkit.patching.exact.paths import PathEngine
    from circuitkit.patching.sweep import PathLayout, make_path_sweep

    layout = PathLayout(hooks.facts(model).n_layers, tuple(senders), (), ("q",))
    return PathEngine(model, clean, corrupt, metric, make_path_sweep(
        layout, direction, clean, metric), layout, rows=batch_size).node_effects()


def coverage(effect: Float[Tensor, "sender receiver group"], node: Float[Tensor, " sender"],
             senders: Sequence[tuple[int, int]], groups: Sequence[str] = ("all",),
             margin: float = 0.0) -> dict[str, dict[str, float]]:
    """The share of the senders' node effect that their edges or paths explain, per group:
    ``{group: {sender name: sum_r effect[s, r] / node[s], ..., "overall": sum_{s, r}
    effect / sum_s node}}`` (NaN cells, non-edges, left out). The degenerate-baseline rule
    (``patch_result.share``): NaN where the node effect is within ``margin`` (the result's
    ``noise_floor``: with a corruption identical to clean every effect is rounding, and
    266.7% / 133.3% were printed before). ``effect``: each cell's effect over its base
    (``values - base``), ``[senders, receivers, groups]`` (an edge result's ``[senders,
    receivers, inputs]`` summed over inputs first)."""
    from circuitkit.patching.results.patch_result import share

    out = {}
    summed = torch.nan_to_num(effect.double(), nan=0.0).sum(1)  # [senders, groups]
    node = node.double()
    for gi, g in enumerate(groups):
        row = {hooks.head_name(*s): share(float(summed[si, gi]), float(node[si]), margin)
               for si, s in enumerate(senders)}
        row["overall"] = share(float(summed[:, gi].sum()), float(node.sum()), margin)
        out[g] = row
    return out


def edge_coverage(model: Any, clean: Tensor, corrupt: Tensor, metric: Any, edges: Any,
                  batch_size: int | None = None) -> dict[str, float]:
    """``coverage`` of an ``EdgeResult`` (``patch_edges``): each head sender's edge effects
    (summed over receivers and inputs) over its node effect, the sender's ``z`` patched alone
    in the same direction under the same metric (the sender run of ``patch_paths``); the
    embeddings sender is left out. ``{sender: share, "overall": share}``. An exact edge sweep
    states it already (``meta["coverage"]``, from its own node runs); this runs the node runs
    of an estimate (attribution), or of a result given by hand, on an engine of their own."""
    from circuitkit.metrics import as_metric

    heads = [s for s in edges.senders if s[0] >= 0]
    if not heads:
        raise ValueError("edge_coverage: the edge result has no head sender.")
    n, seq = clean.shape
    metric = as_metric(metric, n, seq, hooks.vocab_out(model))
    return edge_coverage_of(edges, node_effects(model, clean, corrupt, metric, heads,
                                                edges.direction, batch_size))


def edge_coverage_of(edges: Any, node: Float[Tensor, " sender"]) -> dict[str, float]:
    """``edge_coverage`` of ``edges`` given the node effects ``node`` of its head senders (in
    its order, the embeddings left out): the degenerate-baseline rule's margin is the edge
    result's ``noise_floor`` (a node effect within rounding is no whole to share)."""
    from circuitkit.patching.results.patch_result import noise_floor

    heads = [i for i, s in enumerate(edges.senders) if s[0] >= 0]
    effect = edges.effect()[heads].nansum(-1, keepdim=True)
    margin = noise_floor(edges.clean, edges.corrupt)
    return coverage(effect, node, [edges.senders[i] for i in heads], margin=margin)["all"]
