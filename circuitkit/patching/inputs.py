"""Argument checks shared by every patching entry point (engine, attribution, CLI).

One place defines what ``direction``/``site``/``positions``/``method`` may be and what token
tensors must look like, so every entry point refuses bad input with the same clear message.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

DIRECTIONS = ("denoise", "noise")
POSITIONS = ("all", "each")
# "auto": exact below a cost threshold, else attribution+exact (``patching.plan.auto_method``).
METHODS = ("exact", "attribution", "attribution+exact", "auto")
BACKENDS = ("transformer_lens", "nnsight")
EDGE_METHODS = ("exact", "attribution", "attribution+exact")


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {list(allowed)}.")


def check_batch_size(batch_size: Any) -> None:
    """``None`` (from free memory) or a positive integer."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ValueError(f"batch_size={batch_size!r}: expected a positive integer (sequences per "
                         "forward pass), or None to size it from free memory.")


def check_top_k(top_k: Any) -> None:
    """``None`` (the automatic verification budget) or a positive integer (cells verified)."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"top_k={top_k!r}: expected a positive integer (cells verified), or "
                         "None to choose the budget from the estimator's error.")


def check_tokens(clean: Tensor, corrupt: Tensor, model: Any = None) -> tuple[Tensor, Tensor]:
    """Validated ``(clean, corrupt)`` as long tensors ``[batch, seq]`` (a 1-D prompt gets a batch
    axis); with ``model``, token ids must lie inside its vocabulary."""
    for name, t in (("clean_tokens", clean), ("corrupt_tokens", corrupt)):
        if not isinstance(t, Tensor) or t.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer torch.Tensor [batch, seq] of token ids; "
                             f"got {type(t).__name__}{getattr(t, 'dtype', '')}.")
    clean = clean[None] if clean.ndim == 1 else clean
    corrupt = corrupt[None] if corrupt.ndim == 1 else corrupt
    for name, t in (("clean_tokens", clean), ("corrupt_tokens", corrupt)):
        if t.ndim != 2:
            raise ValueError(f"{name} must be 2-D [batch, seq] (or one 1-D prompt); got shape "
                             f"{tuple(t.shape)}.")
    if clean.shape != corrupt.shape:
        raise ValueError(
            f"clean_tokens {tuple(clean.shape)} and corrupt_tokens {tuple(corrupt.shape)} must "
            "have the same shape [batch, seq]; pad both to one length (task.clean_tokens and "
            "task.corrupt_tokens already are).")
    if clean.shape[0] == 0 or clean.shape[1] == 0:
        raise ValueError(f"clean_tokens and corrupt_tokens are empty (shape "
                         f"{tuple(clean.shape)}); a sweep needs at least one prompt of at least "
                         "one token.")
    low = int(min(clean.min(), corrupt.min()))
    if low < 0:
        raise ValueError(f"token ids must be >= 0; got {low}. Negative ids usually mean padding "
                         "or an unfilled mask: replace them with the pad token id.")
    if model is not None:
        n_ctx = getattr(model.cfg, "n_ctx", None)
        learned = getattr(model.cfg, "positional_embedding_type", None) == "standard"
        if learned and n_ctx and clean.shape[1] > int(n_ctx):  # rotary models run past it
            raise ValueError(f"clean_tokens has {clean.shape[1]} positions but this model's "
                             f"learned position embeddings stop at n_ctx={n_ctx}; shorten the "
                             "prompts (or keep their last n_ctx tokens).")
        d_vocab = int(model.cfg.d_vocab)
        top = int(max(clean.max(), corrupt.max()))
        if top >= d_vocab:
            raise ValueError(
                f"token ids must lie in [0, {d_vocab}) for this model's vocabulary; got ids up "
                f"to {top}. Were the tokens made for another model or task vocabulary?")
    return clean.long(), corrupt.long()


def check_metric_prompts(pm: Any, n: int) -> None:
    """Refuse a ``PromptMetric`` made for another number of prompts than the tokens hold (a
    task's metric on a subset of its prompts failed with an IndexError deep in a sweep)."""
    reads = pm.read_positions()
    if pm.prompt_idx is not None:  # a selection
        made_for = len(pm.prompt_idx)
    elif pm.n_prompts is not None:  # a wrapped callable
        made_for = pm.n_prompts
    elif reads is not None and reads.shape[0] != 1:  # one row of reads serves any prompt count
        made_for = reads.shape[0]
    else:
        return
    if made_for != n:
        raise ValueError(f"metric {pm.name!r} was made for {made_for} prompts but "
                         f"clean_tokens has {n}; build the metric for these prompts (a task's "
                         "metric: task.subset(...).metric for a subset of its prompts).")


def check_edge_nodes(model: Any, senders: Any, receivers: Any, inputs: Any
                     ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...],
                                tuple[str, ...]]:
    """Validated ``(senders, receivers, inputs)`` of an edge sweep (``patch_edges``).

    A node is ``(layer, head)`` (or ``"L3H2"``), ``"embed"`` (a sender: the embeddings) or
    ``"logits"`` (a receiver: the final residual the unembedding reads). ``None``: every head,
    with the embeddings first (senders) or the logits last (receivers). Returned sorted, the
    embeddings as ``(-1, -1)`` and the logits as ``(n_layers, -1)``; every receiver must lie
    after at least one sender."""
    import numbers

    from circuitkit import hooks

    f = hooks.facts(model)
    heads = [(la, h) for la in range(f.n_layers) for h in range(f.n_heads)]
    if isinstance(inputs, str):
        inputs = [p.strip() for p in inputs.split(",") if p.strip()]
    if not isinstance(inputs, list | tuple) or not inputs:
        raise ValueError(f"inputs={inputs!r}: expected a non-empty list of head inputs from "
                         f"{list(hooks.EDGE_INPUTS)}, e.g. ('q', 'k', 'v').")
    for name in inputs:
        choice("inputs", name, hooks.EDGE_INPUTS)
    if len(set(inputs)) != len(inputs):
        raise ValueError(f"inputs={list(inputs)!r} names an input twice; give each once.")
    inputs = tuple(n for n in hooks.EDGE_INPUTS if n in inputs)
    embed, logits = (-1, -1), (f.n_layers, -1)
    out = []
    for role, given, default, special in (("senders", senders, [embed, *heads], "embed"),
                                          ("receivers", receivers, [*heads, logits], "logits")):
        if given is None:
            out.append(tuple(default))
            continue
        if isinstance(given, str) or (isinstance(given, tuple) and len(given) == 2 and all(
                isinstance(x, numbers.Integral) for x in given)):
            given = [given]  # one node
        try:
            nodes = list(given)
        except TypeError:
            raise ValueError(f"{role}={given!r}: expected a list of (layer, head) pairs (or "
                             f"{special!r}), or None for every head.") from None
        if not nodes:
            raise ValueError(f"{role}=[]: give at least one node, or None for every head.")
        parsed = {_node(role, n, f, special, embed if special == "embed" else logits)
                  for n in nodes}
        out.append(tuple(sorted(parsed)))
    first = min(la for la, _ in out[0])
    late = [r for r in out[1] if r[0] <= first]
    if late:
        name = _node_name(late[0], f.n_layers)
        raise ValueError(f"receiver {name} is not after any sender (the earliest sender is in "
                         f"{'the embeddings' if first < 0 else f'layer {first}'}): an edge "
                         "runs from a sender to a receiver in a later layer; drop it or add "
                         "an earlier sender.")
    return out[0], out[1], inputs


def _node(role: str, node: Any, f: Any, special: str, special_node: tuple[int, int]
          ) -> tuple[int, int]:
    """One sender or receiver as ``(layer, head)``; ``special`` ("embed"/"logits") as
    ``special_node``."""
    import re

    if isinstance(node, str):
        if node == special:
            return special_node
        m = re.fullmatch(r"L(\d+)H(\d+)", node)
        if m is None:
            raise ValueError(f"{role}: {node!r} is not a node; expected (layer, head), 'L3H2' "
                             f"or {special!r}.")
        node = (int(m.group(1)), int(m.group(2)))
    try:
        layer, head = (int(x) for x in node)
        if isinstance(node, str) or any(isinstance(x, bool | float) for x in node):
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"{role}: {node!r} is not a node; expected (layer, head), 'L3H2' or "
                         f"{special!r}.") from None
    if not (0 <= layer < f.n_layers and 0 <= head < f.n_heads):
        raise ValueError(f"{role}: ({layer}, {head}) is outside the model's {f.n_layers} layers "
                         f"x {f.n_heads} heads (layers 0..{f.n_layers - 1}, heads "
                         f"0..{f.n_heads - 1}).")
    return layer, head


def _node_name(node: tuple[int, int], n_layers: int) -> str:
    layer, head = node
    return "embed" if layer < 0 else "logits" if layer >= n_layers else f"L{layer}H{head}"


def check_edge_model(model: Any) -> None:
    """``ValueError`` (one line, naming the block) where an edge is not defined: a block that
    normalises its attention output before the residual add (post-norm, e.g. Gemma 2), where a
    head's residual write is not ``z @ W_O``."""
    from circuitkit import hooks

    for layer in range(hooks.facts(model).n_layers):
        post = hooks.post_norm(model, layer, "attn")
        if post is not None:
            raise ValueError(
                f"blocks.{layer} normalises its attention output before the residual add "
                f"({type(post).__name__}, a post-attention norm as in Gemma 2): a head's "
                "residual write is not z @ W_O there, so edges are not defined on this model; "
                "patch heads (patch_heads) instead.")
