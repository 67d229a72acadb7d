"""Path patching through everything between a sender and a receiver (``ck.patch_paths``;
docs/edges.md, "Paths"). A q/k/v edge carries a sender's *direct* write only; a path carries all
of it (MLPs, other heads, other positions in between).

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

INPUT_SITES = {"q": hooks.q, "k": hooks.k, "v": hooks.v}


def _check(model: Any, clean: Tensor, corrupt: Tensor, senders: Sequence, receivers: Sequence,
           inputs: Sequence[str], direction: str) -> tuple[list, list, tuple[str, ...]]:
    f = hooks.facts(model)
    if direction not in ("denoise", "noise"):
        raise ValueError(f"direction={direction!r}; expected 'denoise' or 'noise'.")
    if not isinstance(clean, Tensor) or not isinstance(corrupt, Tensor) \
            or clean.shape != corrupt.shape or clean.ndim != 2:
        raise ValueError("clean and corrupt must be token tensors [batch, seq] of one shape.")
    ins = tuple(i for i in hooks.EDGE_INPUTS if i in tuple(inputs))
    if not ins or len(ins) != len(tuple(inputs)):
        raise ValueError(f"inputs={list(inputs)!r}; expected distinct names among "
                         f"{list(hooks.EDGE_INPUTS)}.")
    if f.gqa and set(ins) & hooks.KV_SITES:
        raise ValueError("patch_paths: under grouped-query attention a k/v input is shared by "
                         "several query heads; pass inputs=('q',).")
    nodes = []
    for what, given in (("senders", senders), ("receivers", receivers)):
        got = [(int(a), int(b)) for a, b in given]
        bad = [n for n in got if not (0 <= n[0] < f.n_layers and 0 <= n[1] < f.n_heads)]
        if not got or bad:
            raise ValueError(f"{what}: give (layer, head) pairs within the model's "
                             f"{f.n_layers} layers x {f.n_heads} heads; got {bad or 'none'}.")
        nodes.append(got)
    if not any(r[0] > s[0] for s in nodes[0] for r in nodes[1]):
        raise ValueError("patch_paths: no receiver is in a layer after any sender: no path.")
    return nodes[0], nodes[1], ins


def _forward(model: Any, tokens: Tensor, fwd_hooks: list, names: Sequence[str] = ()
             ) -> tuple[Tensor, dict[str, Tensor]]:
    """Logits of ``tokens`` under ``fwd_hooks``, and the activations at ``names`` (after the
    hooks' edits)."""
    from circuitkit.patching.shortcuts import hooked

    got: dict[str, Tensor] = {}

    def grab(name: str):
        def fn(t: Tensor, hook: Any) -> Tensor:  # (keyed by the name we bound: FIELD-NOTES)
            got[name] = t.detach().clone()
            return t
        return fn

    with torch.no_grad(), hooked(model, [*fwd_hooks, *((n, grab(n)) for n in names)]):
        logits = model(tokens)
    return logits, got


def _set_head(name: str, head: int, value: Tensor, mask: Tensor | None):
    """A hook writing ``value`` ``[batch, pos, d_head]`` into ``head`` of the activation at
    ``name`` (``[batch, pos, heads, d_head]``), at ``mask``'s positions (all when None)."""
    def fn(act: Tensor, hook: Any) -> Tensor:
        act = act.clone()
        new = value.to(act.dtype)
        if mask is not None:
            new = torch.where(mask[..., None].to(act.device), new, act[:, :, head])
        act[:, :, head] = new
        return act
    return name, fn


def patch_paths(model: Any, clean: Tensor, corrupt: Tensor, metric: Any,
                senders: Sequence[tuple[int, int]], receivers: Sequence[tuple[int, int]],
                inputs: Sequence[str] = ("q", "k", "v"), direction: str = "denoise",
                positions: Any = None, batch_size: int | None = None):
    """Path effects of every ``senders x receivers`` pair (module docstring): a
    ``PatchResult`` with ``values [n_senders, n_receivers]`` or, with ``positions`` (position
    groups, ``patching.groups``), ``[n_senders, n_receivers, n_groups]``; NaN where the
    receiver's layer is not after the sender's; ``per_prompt``; ``meta``: senders, receivers,
    inputs, ``node``, ``coverage`` and, with groups, ``path_groups`` (their names).
    ``batch_size``: prompts per forward."""
    from circuitkit.metrics import as_metric
    from circuitkit.patching.results import PatchResult

    senders, receivers, ins = _check(model, clean, corrupt, senders, receivers, inputs,
                                     direction)
    n, seq = clean.shape
    metric = as_metric(metric, n, seq, hooks.vocab_out(model))
    if positions is None:
        names, masks = ["all"], [None]
    else:
        from circuitkit.patching.groups import position_groups

        pg = position_groups(positions, clean)
        names, masks = list(pg.names), list(pg.masks)
    base_t, src_t = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
    rows = batch_size or n
    shape = (len(senders), len(receivers), len(names))
    per = torch.full((n, *shape), float("nan"))
    node = torch.zeros(n, len(senders))
    ends = {"clean": [], "corrupt": []}
    for p0 in range(0, n, rows):
        sl = slice(p0, min(n, p0 + rows))
        m = metric.select(list(range(sl.start, sl.stop)))
        for end, toks in (("clean", clean), ("corrupt", corrupt)):
            ends[end].append(m.per_prompt(_forward(model, toks[sl], [])[0]).float().cpu())
        _, src = _forward(model, src_t[sl], [], sorted({hooks.z(s[0]) for s in senders}))
        for si, (ls, hs) in enumerate(senders):
            after = [r for r in receivers if r[0] > ls]
            grabs = sorted({INPUT_SITES[i](r[0]) for r in after for i in ins})
            logits, sent = _forward(model, base_t[sl], [_set_head(
                hooks.z(ls), hs, src[hooks.z(ls)][:, :, hs], None)], grabs)
            node[sl, si] = m.per_prompt(logits).float().cpu()
            for ri, (lr, hr) in enumerate(receivers):
                if lr <= ls:
                    continue
                for gi, mask in enumerate(masks):
                    mk = None if mask is None else mask[sl]
                    edits = [_set_head(INPUT_SITES[i](lr), hr, sent[INPUT_SITES[i](lr)][:, :, hr],
                                       mk) for i in ins]
                    per[sl, si, ri, gi] = m.per_prompt(
                        _forward(model, base_t[sl], edits)[0]).float().cpu()
    clean_pp, corrupt_pp = torch.cat(ends["clean"]), torch.cat(ends["corrupt"])
    base_pp = corrupt_pp if direction == "denoise" else clean_pp
    node_effect = (node - base_pp[:, None]).mean(0)
    values = per.mean(0)
    effect = values - base_pp.mean()
    meta = dict(kind="paths", senders=[hooks.head_name(*s) for s in senders],
                receivers=[hooks.head_name(*r) for r in receivers], inputs=list(ins),
                node={hooks.head_name(*s): float(v) for s, v in zip(senders, node_effect,
                                                                     strict=True)},
                coverage=coverage(effect, node_effect, senders, names),
                metric=getattr(metric, "name", None))
    if positions is None:
        values, per = values[..., 0], per[..., 0]
        axes = ("sender", "receiver")
    else:
        axes = ("sender", "receiver", "group")
        meta["path_groups"] = names
    return PatchResult(values=values, clean=float(clean_pp.mean()),
                       corrupt=float(corrupt_pp.mean()), direction=direction, method="exact",
                       site="z", positions="all", per_prompt=per, clean_per_prompt=clean_pp,
                       corrupt_per_prompt=corrupt_pp, axes=axes, meta=meta)


def coverage(effect: Float[Tensor, "sender receiver group"], node: Float[Tensor, " sender"],
             senders: Sequence[tuple[int, int]], groups: Sequence[str] = ("all",)
             ) -> dict[str, dict[str, float]]:
    """The share of the senders' node effect that their edges or paths explain, per group:
    ``{group: {sender name: sum_r effect[s, r] / node[s], ..., "overall": sum_{s, r}
    effect / sum_s node}}`` (NaN cells, non-edges, left out; NaN where the node effect is 0).
    ``effect``: each cell's effect over its base (``values - base``), ``[senders, receivers,
    groups]`` (an edge result's ``[senders, receivers, inputs]`` summed over inputs first)."""
    out = {}
    summed = torch.nan_to_num(effect.double(), nan=0.0).sum(1)  # [senders, groups]
    node = node.double()
    for gi, g in enumerate(groups):
        row = {hooks.head_name(*s): _share(float(summed[si, gi]), float(node[si]))
               for si, s in enumerate(senders)}
        row["overall"] = _share(float(summed[:, gi].sum()), float(node.sum()))
        out[g] = row
    return out


def _share(part: float, whole: float) -> float:
    return part / whole if whole != 0 else float("nan")


def edge_coverage(model: Any, clean: Tensor, corrupt: Tensor, metric: Any, edges: Any,
                  batch_size: int | None = None) -> dict[str, float]:
    """``coverage`` of an ``EdgeResult`` (``patch_edges``): each head sender's edge effects
    (summed over receivers and inputs) over its node effect, the sender's ``z`` patched alone
    in the same direction under the same metric (the sender run of ``patch_paths``); the
    embeddings sender is left out. ``{sender: share, "overall": share}``."""
    from circuitkit.metrics import as_metric

    heads = [(i, s) for i, s in enumerate(edges.senders) if s[0] >= 0]
    if not heads:
        raise ValueError("edge_coverage: the edge result has no head sender.")
    n, seq = clean.shape
    metric = as_metric(metric, n, seq, hooks.vocab_out(model))
    base_t, src_t = (corrupt, clean) if edges.direction == "denoise" else (clean, corrupt)
    rows = batch_size or n
    node = torch.zeros(len(heads))
    for p0 in range(0, n, rows):
        sl = slice(p0, min(n, p0 + rows))
        m = metric.select(list(range(sl.start, sl.stop)))
        base = m.per_prompt(_forward(model, base_t[sl], [])[0]).double()
        _, src = _forward(model, src_t[sl], [], sorted({hooks.z(s[0]) for _, s in heads}))
        for j, (_, (ls, hs)) in enumerate(heads):
            logits, _ = _forward(model, base_t[sl], [_set_head(
                hooks.z(ls), hs, src[hooks.z(ls)][:, :, hs], None)])
            node[j] += float((m.per_prompt(logits).double() - base).sum())
    node /= n
    effect = edges.effect()[[i for i, _ in heads]].nansum(-1, keepdim=True)
    return coverage(effect, node, [s for _, s in heads])["all"]
