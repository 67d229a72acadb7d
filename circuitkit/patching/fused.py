"""The suffix of a patched run as plain tensor code on a Llama-form model, its rows packed.

A patched run re-enters the model at the patched layer ``l`` (``patching/engine.py``). Through
the bridge every block of that suffix pays for hook points nobody reads, a second normalisation
per norm, rotary embeddings through concatenations, eager attention, one module call per
projection. ``fused_form`` reads a bridge whose blocks are all *Llama-form* (HF
``LlamaDecoderLayer``, ``MistralDecoderLayer`` or ``Qwen2DecoderLayer``: pre-norm RMSNorm, rotary
softmax attention with optional GQA, q/k/v/o biases and a sliding window, gated MLP; no
soft-cap, Q/K norm, gate or processed weights) and runs a suffix as a
few tensor operations per block on the module's own weights (read in place, nothing copied):

    x = x + o(attention(rope(q(n1)), rope(k(n1)), v(n1)))      n1 = rms(x) * g1
    x = x + down(act(gate(n2)) * up(n2))                        n2 = rms(x) * g2

with the norms as ``F.rms_norm``, rotary as three in-place multiply-adds, attention as
``scaled_dot_product_attention``. ``suffix_logits`` is that suffix; the engine uses it on its
fast path (its probe compares it with the plain hooked path, like every fast-path piece).

**Packing.** Row ``r`` of a chunk (one variant's copy of one prompt) can differ from the base run
only at positions ``start[r] <= pos < end[r]``: ``end`` is the prompt's last read + 1 (causal),
``start`` the first position its base and source tokens differ (every activation before it is
the same in both runs, so a patch there writes the base value), or a per-position patch's
position if later, and never after the row's first read. Position-wise work (norms,
projections, MLP) runs on those tokens only, packed as ``[T, d_model]``, ``T = sum(end -
start)``: neither the positions every variant shares with the base run nor the ones a short
prompt does not need are computed. Attention reads every key: block ``j``'s keys and values
before ``start[r]`` are the base run's, computed once per prompt from the cached base
``resid_pre(j)``, and the packed tokens' own are written over them (``Packing``). The last block
computes its queries, MLP, final norm and unembedding at the read positions only.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from circuitkit import hooks

LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})
MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP"})
NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})


def _hf(module: Any) -> Any:
    """The HF module a bridge component wraps (the module itself when it wraps none)."""
    while getattr(module, "original_component", None) is not None:
        module = module.original_component
    return module


class Block(NamedTuple):
    """One Llama-form block's HF modules (``torch.nn.Linear`` projections, RMSNorm gains)."""

    ln1: Any
    q: Any
    k: Any
    v: Any
    o: Any
    ln2: Any
    gate: Any
    up: Any
    down: Any
    act: Any
    window: int | None  # sliding window: a query sees the last ``window`` positions only


class FusedLlama:
    """A Llama-form bridge's weights, read in place: ``blocks``, the final norm, the unembedding
    and the rotary table. ``n_heads``, ``n_kv`` (KV heads), ``d_head``, ``scale``."""

    def __init__(self, blocks: list[Block], final_norm: Any, lm_head: Any, rotary: Any,
                 n_heads: int, n_kv: int, d_head: int, scale: float):
        self.blocks, self.final_norm, self.lm_head, self.rotary = blocks, final_norm, lm_head, \
            rotary
        self.n_heads, self.n_kv, self.d_head, self.scale = n_heads, n_kv, d_head, scale
        self._tables: dict[tuple, tuple[Tensor, Tensor]] = {}

    # --- the pieces of a block -------------------------------------------------------------
    @staticmethod
    def norm(x: Tensor, module: Any) -> Tensor:
        """HF RMSNorm: ``g * (x * rsqrt(mean(x^2) + eps))``, normalised in float32."""
        w, eps = module.weight, module.variance_epsilon
        if x.dtype == torch.float32 and w.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    @staticmethod
    def linear(x: Tensor, module: Any) -> Tensor:
        return F.linear(x, module.weight, module.bias)

    def heads(self, x: Tensor, module: Any) -> Tensor:
        """``module(x)`` split into heads: ``[..., d_model] -> [..., heads, d_head]``."""
        return self.linear(x, module).unflatten(-1, (-1, self.d_head))

    @staticmethod
    def rope(t: Float[Tensor, "... h d"], cos: Tensor, sin: Tensor) -> Tensor:
        """HF's rotary embedding ``t * cos + rotate_half(t) * sin`` (``rotate_half(t) =
        cat(-t2, t1)``), as one product and two in-place multiply-adds on the halves.
        ``cos``/``sin``: ``[..., 1, d]``, broadcast over the head axis."""
        half = t.shape[-1] // 2
        out = t * cos
        out[..., :half].addcmul_(t[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(t[..., :half], sin[..., half:])
        return out

    def attend(self, q: Float[Tensor, "r sq h d"], k: Float[Tensor, "r sk g d"],
               v: Float[Tensor, "r sk g d"], mask: Bool[Tensor, "r 1 sq sk"]
               ) -> Float[Tensor, "r sq h_d"]:
        """Softmax attention (GQA: each KV head serves ``h / g`` query heads), merged heads."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return z.transpose(1, 2).flatten(-2)

    def mlp(self, x: Tensor, b: Block) -> Tensor:
        """``down(act(gate(x)) * up(x))``."""
        gate = self.linear(x, b.gate)
        act = F.silu(gate, inplace=True) if isinstance(b.act, torch.nn.SiLU) else b.act(gate)
        return self.linear(act.mul_(self.linear(x, b.up)), b.down)

    def table(self, seq: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Rotary ``cos, sin`` of positions ``0..seq-1``: ``[seq, d_head]`` (HF's module)."""
        key = (seq, like.dtype, like.device)
        if key not in self._tables:
            pos = torch.arange(seq, device=like.device)[None]
            cos, sin = self.rotary(like[:0], pos)
            self._tables = {key: (cos[0], sin[0])}  # one length at a time: chunks share it
        return self._tables[key]

    def token_table(self, pack: Packing, like: Tensor) -> tuple[Tensor, Tensor]:
        """Rotary ``cos, sin`` of each packed token's position: ``[T, 1, d_head]``."""
        key = ("rotary", like.dtype, like.device)
        if key not in pack.cache:
            cos, sin = self.table(pack.seq, like)
            pos = pack.pos_of(like.device)
            pack.cache[key] = (cos[pos][:, None], sin[pos][:, None])
        return pack.cache[key]

    # --- the suffix ------------------------------------------------------------------------
    def base_kv(self, resid: Float[Tensor, "n_p seq d"], b: Block
                ) -> tuple[Tensor, Tensor]:
        """Keys (rotated) and values of the base run at every position, per prompt:
        ``[n_p, seq, kv_heads, d_head]`` each."""
        h = self.norm(resid, b.ln1)
        cos, sin = self.table(resid.shape[1], resid)
        return self.rope(self.heads(h, b.k), cos[:, None], sin[:, None]), self.heads(h, b.v)

    def packed_kv(self, pack: Packing, base: tuple[Tensor, Tensor], k: Tensor, v: Tensor
                  ) -> tuple[Tensor, Tensor]:
        """Each row's keys/values at every position ``[R, seq, g, d]``: its prompt's base ones,
        with the packed tokens' own written over them."""
        out = []
        for b, t in zip(base, (k, v), strict=True):
            full = b.index_select(0, pack.prompt_of(b.device))  # [R, seq, g, d] (a copy)
            full.view(-1, *t.shape[1:]).index_copy_(0, pack.dense_of(t.device), t)
            out.append(full)
        return out[0], out[1]

    def block(self, pack: Packing, x: Float[Tensor, "T d"], b: Block,
              resid: Float[Tensor, "n_p seq d"], attn: Tensor | None = None,
              mlp: Tensor | None = None) -> Float[Tensor, "T d"]:
        """Block ``b`` on the packed tokens ``x`` (``resid``: its base input per prompt, for the
        keys and values before each row's start). ``attn``/``mlp``: the block's attention/MLP
        output at the packed tokens when already known (not recomputed)."""
        if attn is None:
            h = self.norm(x, b.ln1)
            cos, sin = self.token_table(pack, x)
            q = self.rope(self.heads(h, b.q), cos, sin)
            k, v = self.packed_kv(pack, self.base_kv(resid, b),
                                  self.rope(self.heads(h, b.k), cos, sin), self.heads(h, b.v))
            qp = q.new_zeros(pack.n_rows * pack.width, *q.shape[1:])
            qp.index_copy_(0, pack.slot_of(q.device), q)
            z = self.attend(qp.view(pack.n_rows, pack.width, *q.shape[1:]), k, v,
                            pack.mask_of(q.device, b.window))
            attn = self.linear(z.flatten(0, 1).index_select(0, pack.slot_of(q.device)), b.o)
        x = attn.add_(x)
        return x.add_(self.mlp(self.norm(x, b.ln2), b) if mlp is None else mlp)

    def last_block_at_reads(self, pack: Packing, x: Float[Tensor, "T d"], b: Block,
                            resid: Float[Tensor, "n_p seq d"]) -> Float[Tensor, "R k d"]:
        """The last block's output at each row's read positions only: keys/values everywhere,
        queries, output projection and MLP at the reads."""
        h = self.norm(x, b.ln1)
        cos, sin = self.token_table(pack, x)
        k, v = self.packed_kv(pack, self.base_kv(resid, b), self.rope(self.heads(h, b.k), cos, sin),
                              self.heads(h, b.v))
        at = pack.read_tok_of(x.device)  # [R, k_reads]
        q = self.rope(self.heads(h[at], b.q), cos[at], sin[at])
        y = self.linear(self.attend(q, k, v, pack.read_mask_of(x.device, b.window)),
                        b.o).add_(x[at])
        return y.add_(self.mlp(self.norm(y, b.ln2), b))

    def known_block_at_reads(self, pack: Packing, x: Float[Tensor, "T d"], b: Block,
                             attn: Tensor, mlp: Tensor | None = None) -> Float[Tensor, "R k d"]:
        """The last block's output at the reads when its attention output (and maybe its MLP
        output) at the packed tokens is known: the MLP at the reads only."""
        at = pack.read_tok_of(x.device)
        y = x[at].add_(attn.to(x.device)[at])
        return y.add_(self.mlp(self.norm(y, b.ln2), b) if mlp is None else mlp.to(x.device)[at])

    def logits(self, y: Float[Tensor, "R k d"]) -> Float[Tensor, "R k vocab"]:
        w = self.lm_head.weight
        return self.linear(self.norm(y.to(w.device), self.final_norm), self.lm_head)


# Llama-form readings by model (weakly: the entry goes with the model); None: not Llama-form.
_FORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fused_form(model: Any) -> FusedLlama | None:
    """The model read as Llama-form blocks (module docstring), or None when any part is not."""
    if model not in _FORMS:
        _FORMS[model] = _read(model)
    return _FORMS[model]


def unhooked(model: Any) -> bool:
    """Whether no hook point of ``model`` has a forward or backward hook: fused code fires
    none, so a user's hook (``model.add_hook``, ``model.hooks(...)``) keeps the bridge path."""
    if model not in _POINTS:
        _POINTS[model] = tuple(model.hook_dict.values())
    return not any(hp.fwd_hooks or hp.bwd_hooks for hp in _POINTS[model])


# Hook points by model (weakly), listed once: the bridge's hook_dict is rebuilt on each access.
_POINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _read(model: Any) -> FusedLlama | None:
    from circuitkit.patching.shortcuts import attention_window, rotary_softmax

    hf_model = getattr(model, "original_model", None)
    inner = getattr(hf_model, "model", None)
    cfg = getattr(hf_model, "config", None)
    if inner is None or cfg is None or not hooks.facts(model).causal:
        return None
    if any(getattr(cfg, a, None) for a in ("final_logit_softcapping", "logit_scale")):
        return None
    blocks = []
    for blk in model.blocks:
        layer = getattr(blk, "original_component", None)
        if type(layer).__name__ not in LAYERS or not rotary_softmax(blk.attn):
            return None
        if any(getattr(m, "_use_processed_weights", False) for m in blk.modules()):
            return None
        attn, mlp = _hf(blk.attn), _hf(blk.mlp)
        ln1, ln2 = _hf(blk.ln1), _hf(blk.ln2)
        if type(mlp).__name__ not in MLPS or {type(ln1).__name__, type(ln2).__name__} - NORMS:
            return None
        lin = [_hf(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] \
            + [_hf(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(m, torch.nn.Linear) for m in lin):
            return None
        blocks.append(Block(ln1, *lin[:4], ln2, *lin[4:], _hf(mlp.act_fn),
                            attention_window(blk.attn)))
    final, head = _hf(getattr(model, "ln_final", None)), _hf(getattr(model, "unembed", None))
    rotary = _hf(getattr(inner, "rotary_emb", None))
    if type(final).__name__ not in NORMS or not isinstance(head, torch.nn.Linear) \
            or rotary is None:
        return None
    attn = _hf(model.blocks[0].attn)
    d_head = int(attn.head_dim)
    n_heads = blocks[0].q.out_features // d_head
    n_kv = blocks[0].k.out_features // d_head
    return FusedLlama(blocks, final, head, rotary, n_heads, n_kv, d_head,
                      float(getattr(attn, "scaling", d_head ** -0.5)))


# --- packing -------------------------------------------------------------------------------------


class Packing:
    """Which positions of each of ``R`` rows a suffix computes, and the index tensors that move
    between packed tokens ``[T, ...]``, dense rows ``[R, seq, ...]`` and attention's padded
    query slots ``[R, width, ...]``.

    ``start``, ``end``: ``[R]``, row ``r`` computes positions ``start[r] <= pos < end[r]``;
    ``prompt``: ``[R]``, the prompt (index into per-prompt tensors) of each row; ``reads``:
    ``[R, k]`` positions whose logits are wanted, each in ``start[r]..end[r]-1``; ``seq``: the
    positions of the dense tensors.
    """

    def __init__(self, start: Int[Tensor, " R"], end: Int[Tensor, " R"],
                 prompt: Int[Tensor, " R"], reads: Int[Tensor, "R k"], seq: int):
        if bool((reads < start[:, None]).any() or (reads >= end[:, None]).any()):
            raise ValueError("Packing: every read must lie in its row's [start, end).")
        self.seq, self.n_rows = seq, int(start.shape[0])
        lengths = end - start
        self.width = int(lengths.max()) if self.n_rows else 0
        self.n_tokens = int(lengths.sum())
        row = torch.repeat_interleave(torch.arange(self.n_rows), lengths)  # [T]
        offset = torch.cumsum(lengths, 0) - lengths  # [R]
        within = torch.arange(self.n_tokens) - offset[row]  # [T], position - start
        pos = start[row] + within
        cpu = {"pos": pos, "dense": row * seq + pos,
               "by_prompt": prompt[row] * seq + pos,
               "slot": row * self.width + within, "prompt": prompt,
               # the position of query slot i of row r: start[r] + i
               "slot_pos": start[:, None] + torch.arange(self.width)[None, :],
               "reads": reads, "read_tok": offset[:, None] + reads - start[:, None]}
        self._on: dict[Any, dict[str, Tensor]] = {torch.device("cpu"): cpu}
        self.cache: dict[Any, Any] = {}  # per-run values the blocks share (FusedLlama)

    def _get(self, name: str, device: torch.device) -> Tensor:
        if device not in self._on:
            self._on[device] = {k: t.to(device) for k, t in self._on[torch.device("cpu")].items()}
        return self._on[device][name]

    def pos_of(self, device: torch.device) -> Tensor:
        """``[T]`` each packed token's position."""
        return self._get("pos", device)

    def dense_of(self, device: torch.device) -> Tensor:
        """``[T]`` each packed token's index in ``[R * seq]``."""
        return self._get("dense", device)

    def by_prompt_of(self, device: torch.device) -> Tensor:
        """``[T]`` each packed token's index in a per-prompt ``[n_p * seq]`` tensor."""
        return self._get("by_prompt", device)

    def slot_of(self, device: torch.device) -> Tensor:
        """``[T]`` each packed token's query slot in ``[R * width]``."""
        return self._get("slot", device)

    def prompt_of(self, device: torch.device) -> Tensor:
        return self._get("prompt", device)

    def _visible(self, at: str, device: torch.device, window: int | None) -> Tensor:
        """``[R, 1, q, seq]``: key ``j`` is visible to a query at position ``p`` (``at``:
        ``[R, q]`` positions) iff ``j <= p`` and, with a sliding window, ``j > p - window``."""
        key = (at, device, window)
        if key not in self.cache:
            p = self._get(at, device)[:, None, :, None]
            j = torch.arange(self.seq, device=device)
            seen = j <= p
            self.cache[key] = seen if window is None else seen & (j > p - window)
        return self.cache[key]

    def mask_of(self, device: torch.device, window: int | None = None) -> Tensor:
        """``[R, 1, width, seq]`` which keys each query slot sees."""
        return self._visible("slot_pos", device, window)

    def reads_of(self, device: torch.device) -> Tensor:
        return self._get("reads", device)

    def read_tok_of(self, device: torch.device) -> Tensor:
        """``[R, k]`` the packed token of each read."""
        return self._get("read_tok", device)

    def read_mask_of(self, device: torch.device, window: int | None = None) -> Tensor:
        """``[R, 1, k, seq]`` which keys each read's query sees."""
        return self._visible("reads", device, window)

    def gather(self, dense: Tensor) -> Tensor:
        """Dense rows ``[R, seq, ...]`` -> packed tokens ``[T, ...]``."""
        return dense.flatten(0, 1).index_select(0, self.dense_of(dense.device))

    def gather_prompts(self, per_prompt: Tensor) -> Tensor:
        """Per-prompt ``[n_p, seq, ...]`` -> packed tokens ``[T, ...]`` (each row's prompt)."""
        return per_prompt.flatten(0, 1).index_select(0, self.by_prompt_of(per_prompt.device))


def suffix_logits(form: FusedLlama, pack: Packing, layer: int, resid: list[Tensor],
                  x: Float[Tensor, "T d"], attn: Tensor | None = None,
                  mlp: Tensor | None = None, devices: list[torch.device] | None = None
                  ) -> Float[Tensor, "R k vocab"]:
    """Logits at each row's reads after blocks ``layer..L-1`` run on the packed residual ``x``
    entering block ``layer``. ``resid[j - layer]``: block ``j``'s base input per prompt
    ``[n_p, seq, d]`` (keys/values before each row's start). ``attn``/``mlp``: block
    ``layer``'s attention/MLP output at the packed tokens, when known. ``devices``: each
    block's device (a model split across GPUs)."""
    L = len(form.blocks)
    for j in range(layer, L):
        x = x.to(devices[j] if devices is not None else x.device)
        b, base = form.blocks[j], resid[j - layer]
        if j < L - 1:
            x = form.block(pack, x, b, base, *((attn, mlp) if j == layer else (None, None)))
        elif j > layer or attn is None:
            return form.logits(form.last_block_at_reads(pack, x, b, base))
    return form.logits(form.known_block_at_reads(pack, x, b, attn, mlp))
