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
# "auto": exact below a cost threshold, else attribution+exact (``patching.cost.auto_method``).
METHODS = ("exact", "attribution", "attribution+exact", "auto")
BACKENDS = ("transformer_lens", "nnsight")
EDGE_METHODS = ("exact", "attribution", "attribution+exact")


def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """``value`` one of ``allowed`` (strings); else one short line (never a whole array)."""
    simple = isinstance(value, str | int | float | bool | type(None))
    if not simple or value not in allowed:  # (a numpy array's ``in``: "ambiguous", before)
        shown = repr(value) if simple else f"a {type(value).__name__}"
        extra = (" (a position group is a bool torch.Tensor [batch, seq] or {name: mask}; "
                 "convert a numpy array with torch.from_numpy, a list with torch.tensor)"
                 if name == "positions" and not simple else "")
        raise ValueError(f"{name}={shown[:80]} is not supported; expected one of "
                         f"{list(allowed)}{extra}.")


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
        raise ValueError(f"clean_tokens {tuple(clean.shape)} and corrupt_tokens "
                         f"{tuple(corrupt.shape)} must have the same shape [batch, seq]; pad both "
                         "to one length (task.clean_tokens and task.corrupt_tokens already are).")
    if clean.shape[0] == 0 or clean.shape[1] == 0:
        raise ValueError(f"clean_tokens and corrupt_tokens are empty (shape {tuple(clean.shape)}); "
                         "a sweep needs at least one prompt of at least one token.")
    low = int(min(clean.min(), corrupt.min()))
    if low < 0:
        raise ValueError(f"token ids must be >= 0; got {low}. Negative ids usually mean padding "
                         "or an unfilled mask: replace them with the pad token id.")
    if model is not None:
        from circuitkit import hooks

        problem = hooks.context_problem(model, clean.shape[1], "clean_tokens")
        if problem:  # (rotary models ran past it: values silently meaningless, before)
            raise ValueError(problem)
        d_vocab = int(model.cfg.d_vocab)
        top = int(max(clean.max(), corrupt.max()))
        pad = pad_token_id(model)
        if top >= d_vocab and pad is not None and pad >= d_vocab and all(
                bool(((t < d_vocab) | (t == pad)).all()) and _pad_at_ends(t, pad)
                for t in (clean, corrupt)):
            rows = ((clean == pad) | (corrupt == pad)).any(1).nonzero()[:, 0].tolist()
            raise ValueError(
                f"clean_tokens: {len(rows)} of {clean.shape[0]} prompts are padded with pad "
                f"token id {pad} (prompts {rows[:4]}{' ...' if len(rows) > 4 else ''}), which "
                f"is no token of this model's vocabulary (ids 0..{d_vocab - 1}: the tokenizer "
                "circuitkit builds for a model made from a config pads outside it, so that no "
                "prompt token reads as padding). Give prompts of one length.")
        if top >= d_vocab:
            raise ValueError(
                f"token ids must lie in [0, {d_vocab}) for this model's vocabulary; got ids up "
                f"to {top}. Were the tokens made for another model or task vocabulary?")
    return clean.long(), corrupt.long()


def _pad_at_ends(t: Tensor, pad: int) -> bool:
    """Whether every ``pad`` id of each row of ``t`` lies in a run at its end or its start
    (right or left padding), not among its tokens."""
    is_pad = (t == pad).long().cpu()
    count = is_pad.sum(1)
    trail, lead = is_pad.flip(1).cumprod(1).sum(1), is_pad.cumprod(1).sum(1)
    return bool(((count == trail) | (count == lead)).all())


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


def checked_inputs(inputs: Any) -> tuple[str, ...]:
    """A receiver's ``inputs`` (edges and paths): distinct names from ``hooks.EDGE_INPUTS`` (a
    list, or one string "q,k"), in that order; a bad one is one line."""
    from circuitkit import hooks

    if isinstance(inputs, str):
        inputs = [p.strip() for p in inputs.split(",") if p.strip()]
    if not isinstance(inputs, list | tuple) or not inputs:
        raise ValueError(f"inputs={inputs!r}: expected a non-empty list of head inputs from "
                         f"{list(hooks.EDGE_INPUTS)}, e.g. ('q', 'k', 'v').")
    for name in inputs:
        choice("inputs", name, hooks.EDGE_INPUTS)
    if len(set(inputs)) != len(inputs):
        raise ValueError(f"inputs={list(inputs)!r} names an input twice; give each once.")
    return tuple(n for n in hooks.EDGE_INPUTS if n in inputs)


def check_path_nodes(model: Any, senders: Any, receivers: Any, inputs: Any
                     ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...],
                                tuple[str, ...]]:
    """Validated ``(senders, receivers, inputs)`` of a path sweep (``patch_paths``): heads as
    ``(layer, head)`` or ``"L3H2"``, in the caller's order (None: every head), at least one
    receiver after a sender; ``inputs`` distinct names from ``hooks.EDGE_INPUTS`` (only "q"
    under GQA, whose k/v inputs are shared by several query heads)."""
    from circuitkit import hooks

    f = hooks.facts(model)
    ins = checked_inputs(inputs)
    if f.gqa and set(ins) & hooks.KV_SITES:
        raise ValueError("patch_paths: under grouped-query attention a k/v input is shared by "
                         "several query heads; pass inputs=('q',).")
    nodes = []
    every = [(la, h) for la in range(f.n_layers) for h in range(f.n_heads)]
    for what, got in (("senders", senders), ("receivers", receivers)):
        given = every if got is None else [got] if isinstance(got, str) else list(got)
        try:
            got = [(int(a), int(b)) for a, b in (
                hooks.parse_head(n) or n if isinstance(n, str) else n for n in given)]
        except (TypeError, ValueError):
            raise ValueError(f"{what}={given!r}: give heads as (layer, head) pairs or names "
                             "such as 'L3H2'.") from None
        bad = [g for g, n in zip(given, got, strict=True)
               if not (0 <= n[0] < f.n_layers and 0 <= n[1] < f.n_heads)]
        if not got or bad:
            raise ValueError(f"{what}: give (layer, head) pairs within the model's "
                             f"{f.n_layers} layers x {f.n_heads} heads; got {bad or 'none'}.")
        nodes.append(tuple(got))
    if not any(r[0] > s[0] for s in nodes[0] for r in nodes[1]):
        raise ValueError("patch_paths: no receiver is in a layer after any sender: no path.")
    return nodes[0], nodes[1], ins


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
    inputs = checked_inputs(inputs)
    embed, logits = hooks.EMBED_NODE, hooks.logits_node(f.n_layers)
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
        name = hooks.node_name(late[0], f.n_layers)
        raise ValueError(f"receiver {name} is not after any sender (the earliest sender is in "
                         f"{'the embeddings' if first < 0 else f'layer {first}'}): an edge "
                         "runs from a sender to a receiver in a later layer; drop it or add "
                         "an earlier sender.")
    # Every receiver follows a sender (above); under GQA a k/v receiver must also be a KV head
    # (h < n_kv_heads), so a request can still hold no edge at all: refuse it here, not as an
    # empty sweep deep in the engine.
    def receives(node: tuple[int, int]) -> bool:
        return node[0] == f.n_layers or any(
            node[1] < (f.n_kv_heads if name in hooks.KV_SITES else f.n_heads) for name in inputs)

    if not any(receives(r) for r in out[1]):
        names = [hooks.node_name(r, f.n_layers) for r in out[1]]
        raise ValueError(
            f"receivers={names} with inputs={list(inputs)} give no edge: this model's k/v "
            f"inputs are its {f.n_kv_heads} KV heads per layer (GQA: heads 0..{f.n_kv_heads - 1}"
            f" of each layer receive k and v), and these receivers are none of them. Add 'q' to "
            f"inputs, or name KV heads (e.g. {hooks.head_name(out[1][0][0], 0)}) as receivers.")
    return out[0], out[1], inputs


def _node(role: str, node: Any, f: Any, special: str, special_node: tuple[int, int]
          ) -> tuple[int, int]:
    """One sender or receiver as ``(layer, head)``; ``special`` ("embed"/"logits") as
    ``special_node``."""
    from circuitkit import hooks

    if isinstance(node, str):
        if node == special:
            return special_node
        parsed = hooks.parse_head(node)
        if parsed is None:
            raise ValueError(f"{role}: {node!r} is not a node; expected (layer, head), 'L3H2' "
                             f"or {special!r}.")
        node = parsed
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


def check_edge_model(model: Any) -> None:
    """``ValueError`` (one line, naming the block) where an edge is not defined: a block that
    normalises its attention output before the residual add (post-norm, e.g. Gemma 2), where a
    head's residual write is not ``z @ W_O``."""
    from circuitkit import hooks

    for layer in range(hooks.facts(model).n_layers):
        post = hooks.post_norm(model, layer, "attn")
        if post is not None:
            raise ValueError(f"blocks.{layer} normalises its attention output before the residual "
                             f"add ({type(post).__name__}, a post-attention norm as in Gemma 2): a "
                             "head's residual write is not z @ W_O there, so edges are not defined "
                             "on this model; patch heads (patch_heads) instead.")


# Methods whose estimate is a gradient of the metric (``auto`` screens only when it does not
# run the exact sweep: ``auto.run`` skips its informational screen for such a metric).
GRADIENT_METHODS = ("attribution", "attribution+exact")


class NoGradientError(ValueError):
    """A gradient method asked of a metric without a gradient (``check_gradient``)."""


def check_gradient(pm: Any, method: str) -> None:
    """Refuse a gradient method for a metric whose value carries no gradient to the logits
    (``PromptMetric.gradient is False``: ``.item()``, numpy, ``.detach()``, an argmax): every
    estimate would be exactly 0. A metric of unknown gradient (``None``) is checked where it
    runs (``attribution``)."""
    if method in GRADIENT_METHODS and pm.gradient is False:
        raise NoGradientError(no_gradient_message(pm.name, method))


def no_gradient_message(name: str, method: str) -> str:
    return (f"metric {name!r} carries no gradient to the logits (it calls .item(), numpy or "
            f".detach(), or is an argmax), so method={method!r} would estimate 0 for every "
            "head; use method='exact', or return a torch expression of the logits.")


class ReadsDoNotHold(ValueError):
    """A probed metric's read positions do not give its value on the real ``which`` ("clean"
    or "corrupt") logits (raised by ``ExactEngine``, which checks them on its cached runs; the
    sweep restarts with ``without_probed_reads``)."""

    def __init__(self, name: str, which: str):
        super().__init__(f"metric {name!r}: the read positions a probe found do not give its "
                         f"value on the real {which} logits; wrap it again (as_metric) or declare "
                         "its reads in a PromptMetric.")
        self.which = which


def without_probed_reads(pm: Any, which: str) -> Any:
    """``pm`` reading every position, its note saying why (``ReadsDoNotHold``)."""
    return pm.reading_every_position(
        f"metric {pm.name!r}: the read positions the probe found do not give its value on the "
        f"real {which} logits (it reads where the logits decide, e.g. through torch.where): "
        "every position was computed")


def model_logits(model: Any, rows: int | None = None):
    """``tokens -> logits [batch, seq, vocab]`` of an unpatched TransformerLens run, ``rows``
    sequences per forward (default all), on the model's device."""
    from circuitkit.patching import shortcuts

    device = next(model.parameters()).device

    def logits_of(tokens: Tensor) -> Tensor:
        step = rows or tokens.shape[0]
        with torch.no_grad(), shortcuts.attn_result_off(model):
            return torch.cat([model(tokens[r:r + step].to(device))
                              for r in range(0, tokens.shape[0], step)])

    return logits_of


def pad_token_id(model: Any) -> int | None:
    """The pad token id of the model's tokenizer, or None (no tokenizer, or none set)."""
    pad = getattr(getattr(model, "tokenizer", None), "pad_token_id", None)
    return pad if isinstance(pad, int) and not isinstance(pad, bool) else None


def padded_lengths(clean: Tensor, corrupt: Tensor, pad_id: int | None) -> Tensor | None:
    """Tokens before each prompt's right padding, ``[batch]``, or None when no prompt is
    right-padded. Padding: a prompt's trailing run of ``pad_id`` (in clean or corrupt) longer
    than the shortest such run of any prompt (a run every prompt ends with, e.g. one EOS that is
    also the pad token, is text, not padding)."""
    if pad_id is None:
        return None
    seq = clean.shape[1]
    tail = torch.zeros(clean.shape[0], dtype=torch.long)
    for t in (clean, corrupt):
        is_pad = (t == pad_id).long().flip(1).cpu()
        tail = torch.maximum(tail, is_pad.cumprod(1).sum(1))  # trailing run of pad_id
    extra = tail - tail.min()
    return None if not bool((extra > 0).any()) else seq - extra


def check_padding(clean: Tensor, corrupt: Tensor, pm: Any, real: Tensor | None,
                  pad_id: int | None, runs: Any = None) -> None:
    """Refuse right-padded prompts whose metric reads logits at their padding: there the logits
    follow pad tokens, not the prompt (``model.to_tokens`` of prompts of different lengths, with
    a metric reading position -1). ``real``: ``padded_lengths``.

    Reads known per prompt (a task's metric, declared or probed reads): fine where each prompt's
    reads lie before its padding. Reads unknown: with ``runs`` (``runs(which) -> logits`` of the
    clean or corrupt run) fine where the values on both runs stay put when the logits at the
    padding are replaced by zeros, by the prompt's last real position's logits, or by the other
    run's; refused without ``runs``."""
    if real is None:
        return
    n, seq = clean.shape
    padded = (real < seq).nonzero()[:, 0].tolist()
    shown = ", ".join(f"{i} ({int(real[i])} tokens)" for i in padded[:4]) + (
        " ..." if len(padded) > 4 else "")
    head = (f"clean_tokens: {len(padded)} of {n} prompts are right-padded with pad token id "
            f"{pad_id} (prompts {shown})")
    fix = ("Give prompts of one length, or pass a PromptMetric whose reads are each prompt's "
           "own positions (as a task's metric is; left padding is no way out: sweeps pass no "
           "attention mask): for a task's tokens, ck.metrics.at_answers(reading, "
           "task.answer_positions, task.answer_tokens) reads each prompt's answer steps, and "
           "logits[torch.arange(n), task.last_positions] each prompt's own last position in "
           "place of logits[:, -1] (docs/metrics.md).")
    reads = pm.read_positions()
    if reads is not None:
        reads = reads.expand(n, -1).cpu()
        bad = (reads >= real[:, None]).any(1).nonzero()[:, 0].tolist()
        if bad:
            i = bad[0]
            p = int(reads[i][reads[i] >= real[i]].max())
            raise ValueError(
                f"{head}, and metric {pm.name!r} reads {len(bad)} of them there (prompt {i} "
                f"has {int(real[i])} tokens and the metric reads logit position {p}, {p - seq} "
                f"from the end), so their values would follow pad tokens. {fix}")
        return
    if runs is None or _reads_padding(pm, real, runs):
        seen = "" if runs is None else ", and its values change with the logits at the padding"
        raise ValueError(f"{head}, and metric {pm.name!r} reads positions that are unknown (it is "
                         f"not differentiable, or reads everywhere){seen}, so its values may "
                         f"follow pad tokens. {fix}")


def check_left_padding(clean: Tensor, corrupt: Tensor, pad_id: int | None) -> None:
    """Refuse left-padded prompts: sweeps pass no attention mask, so a prompt's leading pad tokens
    are attended to and shift its positions, and its values are not the unpadded prompt's (up to
    0.49 logits off, as issue 49 measured); a metric reading there reads pad tokens. Left padding: a
    prompt's leading run of ``pad_id`` (in clean or corrupt) longer than the shortest such run of
    any prompt (a run every prompt starts with, e.g. a BOS that is also the pad token, is text)."""
    if pad_id is None:
        return
    lead = torch.zeros(clean.shape[0], dtype=torch.long)
    for t in (clean, corrupt):
        lead = torch.maximum(lead, (t == pad_id).long().cpu().cumprod(1).sum(1))
    extra = lead - lead.min()
    padded = (extra > 0).nonzero()[:, 0].tolist()
    if padded:
        shown = ", ".join(f"{i} ({int(extra[i])} pad tokens)" for i in padded[:4]) + (
            " ..." if len(padded) > 4 else "")
        raise ValueError(
            f"clean_tokens: {len(padded)} of {clean.shape[0]} prompts are left-padded with pad "
            f"token id {pad_id} (prompts {shown}); sweeps pass no attention mask, so the pad "
            "tokens are attended to and the values are not the unpadded prompts'. Give prompts "
            "of one length, or right-pad them (tokenizer.padding_side = 'right') with a metric "
            "that reads each prompt's own positions (ck.metrics.at_answers, "
            "task.last_positions; docs/metrics.md).")


def _reads_padding(pm: Any, real: Tensor, runs: Any) -> bool:
    """Whether ``pm``'s values on the clean or corrupt run change when the logits at each
    prompt's padding are replaced (``check_padding``)."""
    n, seq = len(real), runs("clean").shape[1]
    pad = (torch.arange(seq)[None, :] >= real[:, None])[..., None]  # [n, seq, 1]
    last = (real - 1).clamp(min=0)
    with torch.no_grad():
        for which, other in (("clean", "corrupt"), ("corrupt", "clean")):
            logits = runs(which)
            mask = pad.to(logits.device)
            full = pm.per_prompt(logits)
            at_last = logits[torch.arange(n, device=logits.device), last.to(logits.device)]
            for fill in (torch.zeros_like(logits[:1, :1]), at_last[:, None], runs(other)):
                if not _same_values(pm.per_prompt(torch.where(mask, fill, logits)), full):
                    return True
    return False


def _same_values(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


def checked_metric(model: Any, clean: Tensor, corrupt: Tensor, pm: Any,
                   batch_size: int | None = None, logits_of: Any = None,
                   engine_checks: bool = False) -> Any:
    """``pm`` fit for these tokens, before any sweep work (docs/metrics.md, sections 3 and 6):
    read positions a probe found on random logits (``pm.probed``) checked on the real clean and
    corrupt logits (``PromptMetric.reads_hold``; where they do not hold, every position is read
    and the note says so; ``engine_checks``: left to the exact engine's cached runs,
    ``ReadsDoNotHold``), and right padding the metric would read refused (``check_padding``).

    ``logits_of(tokens) -> [batch, seq, vocab]`` (default ``model_logits(model, batch_size)``) runs
    the unpatched model: once per token set, only for probed metrics (unless ``engine_checks``) or
    right-padded prompts under a metric whose reads are unknown; ``logits_of=False``: never (the
    probe's reads stand, unknown reads on padded prompts are refused)."""
    pm.check_reads(clean.shape[1])  # every position the metric reads exists
    pad = pad_token_id(model)
    check_left_padding(clean, corrupt, pad)
    real = padded_lengths(clean, corrupt, pad)
    if pm.read_positions() is not None:
        check_padding(clean, corrupt, pm, real, pad)  # before any forward: it needs none
    if logits_of is False:
        if pm.read_positions() is None:
            check_padding(clean, corrupt, pm, real, pad)
        return pm
    get = logits_of or model_logits(model, batch_size)
    tokens, got = {"clean": clean, "corrupt": corrupt}, {}

    def runs(which: str) -> Tensor:
        if which not in got:
            got[which] = get(tokens[which])
        return got[which]

    if getattr(pm, "probed", False) and not engine_checks:
        from dataclasses import replace

        bad = next((w for w in ("clean", "corrupt") if not pm.reads_hold(runs(w))), None)
        pm = replace(pm, probed=False) if bad is None else without_probed_reads(pm, bad)
    if pm.read_positions() is None:
        check_padding(clean, corrupt, pm, real, pad, runs)
    return pm
