"""What every attribution estimator shares: the metric stash the backward differentiates, forward
runs that keep activations (with or without gradients), a head's residual write, write scales."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import einops
import torch
from jaxtyping import Float
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching import shortcuts
from circuitkit.patching.inputs import NoGradientError, no_gradient_message

# Sequences per attention-layer call of a copied re-run (AtP*'s correction, block's attention
# sites; bounds its memory).
ATP_STAR_CHUNK = 2048


def _progress(it: Sequence[Any], on: bool, desc: str):
    if not on:
        return it
    from circuitkit._progress import tqdm

    return tqdm(it, desc=desc, leave=False)


class _MetricStash:
    """The metric as the scalar ``cache_activation_and_gradient`` differentiates: the *sum* of
    per-prompt values (prompts do not interact, so its gradient at prompt ``b``'s activations is
    ``d metric_b / d a_b``). Keeps the per-prompt values of the last call."""

    def __init__(self, metric: PromptMetric, idx: Tensor, at: Tensor | None = None):
        self.metric = metric.select(idx)
        self.at = at  # the logits hold only these positions (``shortcuts.reads_only``)
        self.value: Tensor | None = None  # [batch]

    def __call__(self, logits: Tensor) -> Tensor:
        v = self.metric.per_prompt(logits, at=self.at)
        self.value = v.detach()
        if not v.requires_grad and logits.requires_grad:
            # no gradient reaches the logits (.item(), numpy, .detach(), an argmax): every
            # first-order estimate would be 0. (A PromptMetric built by hand is only known here.)
            raise NoGradientError(no_gradient_message(self.metric.name, "attribution"))
        if not v.requires_grad:  # a run without gradients (the source run): its value only
            v = v + 0 * logits.flatten()[0]
        return v.sum()


def _head_effect(delta: Tensor, grad: Tensor, site: str, positions: str) -> Tensor:
    """Per-prompt, per-head sum of ``delta * grad``: [b, h] ("all") or [b, h, pos] ("each").

    For ``pattern`` the position is the query (destination) position.
    """
    prod = delta * grad
    if site == "pattern":  # [b, h, q, k]
        return einops.reduce(prod, "b h q k -> b h" if positions == "all" else "b h q k -> b h q",
                             "sum")
    return einops.reduce(prod, "b p h d -> b h" if positions == "all" else "b p h d -> b h p",
                         "sum")


def _copy_masks(n_heads: int, seq: int, positions: str, device: Any,
                dtype: torch.dtype = torch.float32) -> Float[Tensor, "c pos h"]:
    """One 0/1 mask per patched cell: head h at every position ("all") or at one ("each")."""
    eye_h = torch.eye(n_heads, device=device, dtype=dtype)
    if positions == "all":
        return einops.repeat(eye_h, "c h -> c p h", p=seq).contiguous()
    eye_p = torch.eye(seq, device=device, dtype=dtype)
    return einops.rearrange(eye_h[:, None, None, :] * eye_p[None, :, :, None],
                            "ch cp p h -> (ch cp) p h")


def _head_writes(model: Any, layer: int, dz: Tensor, a_raw: dict[int, Tensor] | None = None
                 ) -> Float[Tensor, "b pos h d_model"]:
    """Each head's residual-stream write: ``dz[:, :, h] @ W_O[h]``; on a block with a
    post-attention norm ``n`` (Gemma 2), ``n(a + dz_h W_O[h]) - n(a)`` with ``a`` the base run's
    attention output (``a_raw[layer]``, [b, pos, d_model])."""
    W_O = model.blocks[layer].attn.W_O.detach()  # [h, d_head, d_model]
    return _residual_write(model, layer, einops.einsum(dz, W_O, "b p h d, h d m -> b p h m"), a_raw)


def _residual_write(model: Any, layer: int, dr: Float[Tensor, "b pos c d_model"],
                    a_raw: dict[int, Tensor] | None) -> Float[Tensor, "b pos c d_model"]:
    """Attention-output changes ``dr`` as the residual stream receives them: unchanged, or
    through block ``layer``'s post-attention norm around the base output ``a_raw[layer]``."""
    post = hooks.post_norm(model, layer, "attn")
    if post is None:
        return dr
    if a_raw is None or layer not in a_raw:
        raise RuntimeError(f"block {layer} has a post-attention norm: its writes need the base "
                           "attention output (hooks.attn_module_out) kept in the run.")
    a = a_raw[layer].detach().to(dr.dtype)
    with torch.no_grad():
        return post(a[:, :, None] + dr) - post(a)[:, :, None]


def _raw_attn_names(model: Any) -> list[str]:
    """The attention modules' own outputs ``_head_writes`` needs (post-norm blocks only)."""
    return [hooks.attn_module_out(lay) for lay in range(len(model.blocks))
            if hooks.post_norm(model, lay, "attn") is not None]


def _relative(num: Tensor, den: Tensor) -> Tensor:
    return num / den.clamp_min(1e-6 * float(den.abs().max().clamp_min(1e-30)))


def _site_scale(delta: Tensor, a_base: Tensor, site: str, positions: str) -> Tensor:
    """Write scale of sites q/k/v (|delta| / |a_base| per position) and pattern (total variation
    of the query row): ``[b, h]`` or ``[b, h, pos]``."""
    if site == "pattern":  # [b, h, q, k]
        r = delta.abs().sum(-1) / 2
        return r.mean(-1) if positions == "all" else r
    r = _relative(delta.norm(dim=-1), a_base.norm(dim=-1))  # [b, p, h]
    return r.mean(1) if positions == "all" else r.transpose(1, 2)


def _z_scale(model, layer, dz, r_mid, positions, a_raw) -> Tensor:
    dr = _head_writes(model, layer, dz, a_raw)
    r = _relative(dr.norm(dim=-1), r_mid.norm(dim=-1)[:, :, None])
    return r.mean(1) if positions == "all" else r.transpose(1, 2)


def _grad_run(model: Any, tokens: Tensor, stash: _MetricStash, keep: Sequence[str],
              embed: Tensor | None = None, extra: Sequence[tuple[str, Callable]] = ()
              ) -> tuple[Tensor, dict[str, Tensor]]:
    """Forward of ``tokens`` (token embedding replaced by ``embed`` if given) keeping the
    activations at ``keep``; returns the objective (``stash``: sum of per-prompt metrics) and
    them, for ``torch.autograd.grad`` (parameters' ``.grad`` are left alone)."""
    kept: dict[str, Tensor] = {}

    def keep_hook(name: str) -> Callable:
        def f(t: Tensor, hook: Any) -> Tensor:
            kept[name] = t
            return t
        return f

    def emb(t: Tensor, hook: Any) -> Tensor:
        x = t if embed is None else embed
        # frozen weights: the graph must still start here for activation gradients
        return x if x.requires_grad else x.detach().requires_grad_(True)

    fwd = [(hooks.EMBED, emb)] + [(n, keep_hook(n)) for n in keep] + list(extra)
    with torch.enable_grad(), model.hooks(fwd_hooks=fwd):
        obj = stash(model(tokens))
    return obj, kept


def _grads(obj: Tensor, kept: dict[str, Tensor], names: Sequence[str], retain: bool
           ) -> list[Tensor]:
    got = torch.autograd.grad(obj, [kept[n] for n in names], retain_graph=retain, allow_unused=True)
    return [torch.zeros_like(kept[n]) if g is None else g for n, g in zip(names, got, strict=True)]


def _plain_run(model: Any, tokens: Tensor, stash: _MetricStash, names: Sequence[str]
               ) -> dict[str, Tensor]:
    """No-grad forward caching ``names``; ``stash`` records the metric."""
    want = set(names)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n in want)
        stash(logits)
    return {n: cache[n] for n in names}


def _lean(model: Any, at: Tensor | None) -> Any:
    """With known read positions: the last MLP and the unembedding computed there only."""
    return contextlib.nullcontext() if at is None else shortcuts.reads_only(model, at)


def _zero_if_none(g: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if g is None else g


class Batch(NamedTuple):
    """One batch of prompts as the driver hands it to an estimator: the model, base and source
    tokens, their metric stashes (``stash_base`` differentiated), the prompts' indices in the
    run (``idx``, from ``start``) and their read positions (``at``; None: every position)."""

    model: Any
    base: Tensor
    src: Tensor
    stash_base: _MetricStash
    stash_src: _MetricStash
    idx: Tensor
    at: Tensor | None
    start: int

    def head_args(self, job: Any) -> tuple:
        """The positional arguments every head estimator's batch function starts with."""
        return (self.model, self.base, self.src, self.stash_base, self.stash_src, job.site,
                job.positions, self.at)


class BatchOut(NamedTuple):
    """What an estimator's batch function returns: per-prompt ``effects`` ([b, L, H(, P)] for
    heads, [b, S, R, I] for edges), the write ``scale`` (heads: per prompt, same shape; edges:
    [S, R, I] for the batch) and, for GradDrop, its per-drop ``terms``."""

    effects: Tensor
    scale: Tensor
    terms: Tensor | None = None
