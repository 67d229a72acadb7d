"""The suffix of a patched run as plain tensor code on a Llama-form model, its rows packed
(docs/speed.md: what it skips, how it is checked, what it measures).

``fused_form`` reads a bridge whose blocks are all *Llama-form* (HF ``LlamaDecoderLayer``,
``MistralDecoderLayer`` or ``Qwen2DecoderLayer``: pre-norm RMSNorm, rotary softmax attention with
optional GQA, q/k/v/o biases and a sliding window, gated MLP; no soft-cap, Q/K norm, gate or
processed weights) and runs a suffix as a few tensor operations per block on the module's own
weights (read in place, nothing copied):

    x = x + o(attention(rope(q(n1)), rope(k(n1)), v(n1)))      n1 = rms(x) * g1
    x = x + down(act(gate(n2)) * up(n2))                        n2 = rms(x) * g2

``suffix_logits`` is that suffix, the engine's fast path. **Packing**: row ``r`` (one variant's
copy of one prompt) can differ from the base run only at ``start[r] <= pos < end[r]`` (``end``:
its last read + 1; ``start``: the first position its base and source tokens differ, or a
per-position patch's position if later, never after its first read). Position-wise work runs
on those ``T = sum(end - start)`` tokens only, ``[T, d_model]``; attention reads the base run's
keys and values before ``start[r]`` (from the cached ``resid_pre(j)``) with the packed tokens'
own written over them (``Packing``); the last block computes its queries, MLP, final norm and
unembedding at the read positions only.
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


def _is_silu(act: Any) -> bool:
    """Whether ``act`` is plain SiLU: torch's, or transformers' ``SiLUActivation`` (what HF's
    Llama-form MLPs hold) unless a hub kernel replaced its forward. Then it runs in place on
    the fresh gate projection (an out-of-place SiLU allocated a ``[T, d_mlp]`` tensor per block:
    ~6% of a teacher sweep)."""
    if isinstance(act, torch.nn.SiLU):
        return True
    return type(act).__name__ == "SiLUActivation" and "forward" not in vars(act) and \
        getattr(type(act).forward, "__module__", "") == "transformers.activations"


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
    """A Llama-form bridge's weights, read in place: the token embedding, ``blocks``, the final
    norm, the unembedding and the rotary table. ``n_heads``, ``n_kv`` (KV heads), ``d_head``,
    ``scale``."""

    def __init__(self, embed: Any, blocks: list[Block], final_norm: Any, lm_head: Any,
                 rotary: Any, n_heads: int, n_kv: int, d_head: int, scale: float):
        self.embed, self.blocks, self.final_norm, self.lm_head, self.rotary = \
            embed, blocks, final_norm, lm_head, rotary
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
        act = F.silu(gate, inplace=True) if _is_silu(b.act) else b.act(gate)
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

    def packed_kv(self, pack: Packing, base: tuple[Tensor, Tensor] | None, k: Tensor,
                  v: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's keys/values at every position ``[R, seq, g, d]``: its prompt's base ones
        (``base``; None: zeros, for rows that start at 0), with the packed tokens' own written
        over them."""
        out = []
        for i, t in enumerate((k, v)):
            full = (t.new_zeros(pack.n_rows, pack.seq, *t.shape[1:]) if base is None else
                    base[i].index_select(0, pack.prompt_of(t.device)))  # [R, seq, g, d]
            full.view(-1, *t.shape[1:]).index_copy_(0, pack.dense_of(t.device), t)
            out.append(full)
        return out[0], out[1]

    def packed_z(self, pack: Packing, x: Float[Tensor, "T d"], b: Any,
                 resid: Float[Tensor, "n_p seq d"] | None) -> Float[Tensor, "T merged"]:
        """Block ``b``'s merged head outputs ``z`` (before the output projection) at the packed
        tokens ``x``: norm, q/k/v, rotary, each row's keys and values (``resid``: the base
        input per prompt, for the positions before the row's start; None: rows start at 0),
        attention under the row's mask (sliding window included)."""
        h = self.norm(x, b.ln1)
        cos, sin = self.token_table(pack, x)
        q = self.rope(self.heads(h, b.q), cos, sin)
        k, v = self.packed_kv(pack, None if resid is None else self.base_kv(resid, b),
                              self.rope(self.heads(h, b.k), cos, sin), self.heads(h, b.v))
        qp = q.new_zeros(pack.n_rows * pack.width, *q.shape[1:])
        qp.index_copy_(0, pack.slot_of(q.device), q)
        z = self.attend(qp.view(pack.n_rows, pack.width, *q.shape[1:]), k, v,
                        pack.mask_of(q.device, b.window))
        return z.flatten(0, 1).index_select(0, pack.slot_of(q.device))

    def block(self, pack: Packing, x: Float[Tensor, "T d"], b: Block,
              resid: Float[Tensor, "n_p seq d"] | None, attn: Tensor | None = None,
              mlp: Tensor | None = None, keep: dict[str, Tensor] | None = None
              ) -> Float[Tensor, "T d"]:
        """Block ``b`` on the packed tokens ``x`` (``resid``: its base input per prompt, for the
        keys and values before each row's start; None: rows start at 0). ``attn``/``mlp``: the
        block's attention/MLP output at the packed tokens when already known (not recomputed).
        ``keep``: filled with the packed ``z``, ``attn_out`` and ``mlp_out``."""
        if attn is None:
            z = self.packed_z(pack, x, b, resid)
            attn = self.linear(z, b.o)
            if keep is not None:
                keep.update(z=z.unflatten(-1, (-1, self.d_head)), attn_out=attn.clone())
        x = attn.add_(x)
        mlp = self.mlp(self.norm(x, b.ln2), b) if mlp is None else mlp
        if keep is not None:
            keep["mlp_out"] = mlp.clone()
        return x.add_(mlp)

    def edge_attention(self, b: Block, resid: Float[Tensor, "n_p seq d"],
                       writes: Float[Tensor, "n_s n_p seq d"],
                       z_base: Float[Tensor, "n_p seq h dh"], sender: Int[Tensor, " n_v"],
                       inputs: list[str], unit: Int[Tensor, " n_v"]
                       ) -> Float[Tensor, "n_v_x_n_p seq d"]:
        """Block ``b``'s attention output for each edge (variant ``i``: sender row
        ``sender[i]`` of ``writes``, into input ``inputs[i]`` of head ``unit[i]``; a KV head
        for k/v), rows variant-major. The edge gives one input of one head the block's own
        projection of ``norm(resid + write)``; every other input is the base run's. So only
        that head (a q edge) or the query heads sharing that KV head (k/v) attend anew, and

            attn = o(z_base) + sum_h (z'_h - z_base_h) @ W_O[h]       (h: the heads that moved)
        """
        seq, d = resid.shape[1], resid.shape[-1]
        cos, sin = (t[:, None] for t in self.table(seq, resid))  # [seq, 1, dh]
        base = self.norm(resid, b.ln1)
        patched = self.norm(resid[None] + writes, b.ln1)  # [n_s, n_p, seq, d]
        proj = {"q": (b.q, True), "k": (b.k, True), "v": (b.v, False)}

        def project(h: Tensor, name: str) -> Tensor:
            t = self.heads(h, proj[name][0])
            return self.rope(t, cos, sin) if proj[name][1] else t

        own = {name: project(base, name) for name in proj}  # [n_p, seq, heads, dh]
        given = {name: project(patched, name) for name in set(inputs)}  # [n_s, n_p, seq, ...]
        W_O = b.o.weight.T.unflatten(0, (self.n_heads, self.d_head))  # [h, dh, d]
        group = self.n_heads // self.n_kv
        visible = torch.arange(seq, device=resid.device)
        visible = visible[None, :] <= visible[:, None]
        if b.window is not None:
            visible &= visible.new_ones(seq, seq).tril(-b.window).logical_not()
        out = self.linear(z_base.flatten(-2), b.o).repeat(len(inputs), 1, 1)
        view = out.view(len(inputs), *resid.shape)
        for name in sorted(set(inputs)):
            rows = torch.tensor([i for i, n in enumerate(inputs) if n == name], device=resid.device)
            s, u = sender.to(rows.device)[rows], unit.to(rows.device)[rows]  # [m]
            if name == "q":  # head u alone, with its KV head's base keys and values
                heads = u[:, None]  # [m, 1]
                q = given["q"][s, :, :, u][:, :, :, None]  # [m, n_p, seq, 1, dh]
                kv = (u // group)[:, None]
            else:  # KV head u and every query head reading it
                heads = u[:, None] * group + torch.arange(group, device=u.device)  # [m, g]
                q = own["q"][:, :, heads].permute(2, 0, 1, 3, 4)  # [m, n_p, seq, g, dh]
                kv = u[:, None]
            k, v = ((given[n][s, :, :, u] if n == name else
                     own[n][:, :, kv[:, 0]].permute(2, 0, 1, 3))[:, :, :, None]
                    for n in ("k", "v"))  # [m, n_p, seq, 1, dh]
            m, n_h = heads.shape
            z = torch.nn.functional.scaled_dot_product_attention(
                q.flatten(0, 1).transpose(1, 2), *(t.flatten(0, 1).transpose(1, 2)
                                                   .expand(-1, n_h, -1, -1) for t in (k, v)),
                attn_mask=visible, scale=self.scale).transpose(1, 2)  # [m*n_p, seq, n_h, dh]
            dz = z.unflatten(0, (m, -1)) - z_base[:, :, heads].permute(2, 0, 1, 3, 4)
            view[rows] += torch.einsum("mpshe,mhed->mpsd", dz, W_O[heads])
        return out.view(-1, seq, d)

    def cached_run(self, tokens: Int[Tensor, "R seq"], names: dict[str, tuple[str, int]],
                   reads: Int[Tensor, "R k"] | None, devices: list[torch.device] | None = None
                   ) -> tuple[Tensor, dict[str, Tensor]]:
        """An unpatched run of ``tokens`` with its activations at ``names`` (``{hook name:
        (kind, layer)}``, kinds ``resid_pre``, ``z``, ``attn_out``, ``mlp_out``,
        ``resid_post``; dense ``[R, seq, ...]``) and its logits at ``reads`` ``[R, k, vocab]``
        (None: every position, ``[R, seq, vocab]``). With reads, each row runs up to its last
        read only: activations after it are zero (nothing the engine computes reads them)."""
        n, seq = tokens.shape
        every = torch.arange(seq, device=tokens.device).expand(n, -1)
        at = every if reads is None else reads.to(tokens.device)
        pack = Packing(torch.zeros(n, dtype=torch.long), at.max(1).values.cpu() + 1,
                       torch.arange(n), at.cpu(), seq)
        x = F.embedding(tokens.flatten().index_select(0, pack.dense_of(tokens.device)),
                        self.embed.weight)
        wanted: dict[tuple, list[str]] = {}
        for name, key in names.items():
            wanted.setdefault(key, []).append(name)
        out: dict[str, Tensor] = {}

        def store(kind: str, layer: int, packed: Tensor) -> None:
            for name in wanted.get((kind, layer), ()):
                dense = packed.new_zeros(n * seq, *packed.shape[1:])
                out[name] = dense.index_copy_(0, pack.dense_of(packed.device), packed).view(
                    n, seq, *packed.shape[1:])

        for j, b in enumerate(self.blocks):
            x = x.to(devices[j] if devices is not None else x.device)
            store("resid_pre", j, x)
            keep: dict[str, Tensor] = {}
            x = self.block(pack, x, b, None, keep=keep)
            for kind, t in keep.items():
                store(kind, j, t)
            store("resid_post", j, x)
        return pack.spread(self.logits(x[pack.read_tok_of(x.device)])), out

    def last_block_at_reads(self, pack: Packing, x: Float[Tensor, "T d"], b: Block,
                            resid: Float[Tensor, "n_p seq d"]) -> Float[Tensor, "N d"]:
        """The last block's output at each row's distinct reads only (``Packing``: ``N`` in
        all): keys/values everywhere, queries, output projection and MLP at the reads."""
        z, at = self.reads_z(pack, x, b, resid)
        y = self.linear(z, b.o).add_(x[at])
        return y.add_(self.mlp(self.norm(y, b.ln2), b))

    def reads_z(self, pack: Packing, x: Float[Tensor, "T d"], b: Block,
                resid: Float[Tensor, "n_p seq d"]) -> tuple[Float[Tensor, "N merged"], Tensor]:
        """(block ``b``'s merged ``z`` at each row's distinct reads, the packed token index of
        each read ``[N]``): keys and values at every packed token, queries at the reads only."""
        h = self.norm(x, b.ln1)
        cos, sin = self.token_table(pack, x)
        k, v = self.packed_kv(pack, self.base_kv(resid, b), self.rope(self.heads(h, b.k), cos, sin),
                              self.heads(h, b.v))
        at, slot = pack.read_tok_of(x.device), pack.read_slot_of(x.device)  # [N] each
        q = self.rope(self.heads(h[at], b.q), cos[at], sin[at])
        qp = q.new_zeros(pack.n_rows * pack.read_width, *q.shape[1:])
        qp.index_copy_(0, slot, q)
        z = self.attend(qp.view(pack.n_rows, pack.read_width, *q.shape[1:]), k, v,
                        pack.read_mask_of(x.device, b.window))
        return z.flatten(0, 1).index_select(0, slot), at

    def known_block_at_reads(self, pack: Packing, x: Float[Tensor, "T d"], b: Block,
                             attn: Tensor, mlp: Tensor | None = None) -> Float[Tensor, "N d"]:
        """The last block's output at the reads when its attention output (and maybe its MLP
        output) at the packed tokens is known: the MLP at the reads only."""
        at = pack.read_tok_of(x.device)
        y = x[at].add_(attn.to(x.device)[at])
        return y.add_(self.mlp(self.norm(y, b.ln2), b) if mlp is None else mlp.to(x.device)[at])

    def logits(self, y: Float[Tensor, "N d"]) -> Float[Tensor, "N vocab"]:
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
    rotary, embed = _hf(getattr(inner, "rotary_emb", None)), getattr(model, "embed", None)
    if type(final).__name__ not in NORMS or not isinstance(head, torch.nn.Linear) \
            or rotary is None or not isinstance(_hf(embed), torch.nn.Embedding) \
            or getattr(embed, "_use_processed_weights", False):
        return None
    attn = _hf(model.blocks[0].attn)
    d_head = int(attn.head_dim)
    n_heads = blocks[0].q.out_features // d_head
    n_kv = blocks[0].k.out_features // d_head
    return FusedLlama(_hf(embed), blocks, final, head, rotary, n_heads, n_kv, d_head,
                      float(getattr(attn, "scaling", d_head ** -0.5)))


def cache_kinds(n_layers: int) -> dict[str, tuple[str, int]]:
    """The hook names ``FusedLlama.cached_run`` computes: ``{name: (kind, layer)}``."""
    out = {}
    for layer in range(n_layers):
        out.update({hooks.resid_pre(layer): ("resid_pre", layer), hooks.z(layer): ("z", layer),
                    hooks.attn_out(layer): ("attn_out", layer),
                    hooks.mlp_out(layer): ("mlp_out", layer),
                    hooks.resid_post(layer): ("resid_post", layer)})
    return out


# --- packing -------------------------------------------------------------------------------------


class Packing:
    """Which positions of each of ``R`` rows a suffix computes, and the index tensors that move
    between packed tokens ``[T, ...]``, dense rows ``[R, seq, ...]`` and attention's padded
    query slots ``[R, width, ...]``.

    ``start``, ``end``: ``[R]``, row ``r`` computes positions ``start[r] <= pos < end[r]``;
    ``prompt``: ``[R]``, the prompt (index into per-prompt tensors) of each row; ``reads``:
    ``[R, k]`` positions whose logits are wanted, each in ``start[r]..end[r]-1`` (a row's
    repeated reads are computed once: ``N`` distinct (row, read) pairs, ``spread`` puts them
    back); ``seq``: the positions of the dense tensors.
    """

    def __init__(self, start: Int[Tensor, " R"], end: Int[Tensor, " R"],
                 prompt: Int[Tensor, " R"], reads: Int[Tensor, "R k"], seq: int):
        if not start.shape == end.shape == prompt.shape == reads.shape[:1]:
            raise ValueError(f"Packing: start, end, prompt and reads must give one row each; got "
                             f"{start.shape[0]}, {end.shape[0]}, {prompt.shape[0]} and "
                             f"{reads.shape[0]} rows.")
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
               **self._distinct_reads(reads, start, offset)}
        self._on: dict[Any, dict[str, Tensor]] = {torch.device("cpu"): cpu}
        self.cache: dict[Any, Any] = {}  # per-run values the blocks share (FusedLlama)

    def _distinct_reads(self, reads: Tensor, start: Tensor, offset: Tensor) -> dict[str, Tensor]:
        """Index tensors of each row's distinct reads, row-major (``N``): their packed token,
        their query slot in ``[R * read_width]``, the slot positions ``[R, read_width]``
        (padding: 0), and where each of the ``[R, k]`` reads finds its own (``inverse``)."""
        ordered, order = reads.sort(1)
        new = torch.ones_like(ordered, dtype=torch.bool)
        new[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        count = new.sum(1)  # [R] distinct reads per row
        self.read_width = int(count.max()) if self.n_rows else 0
        self.n_reads = int(count.sum())
        row = torch.repeat_interleave(torch.arange(self.n_rows), count)  # [N]
        pos = ordered[new]  # [N]
        first = torch.cumsum(count, 0) - count  # [R]
        within = torch.arange(self.n_reads) - first[row]
        rank = torch.cumsum(new.long(), 1) - 1 + first[:, None]  # [R, k] in sorted order
        inverse = torch.empty_like(rank).scatter_(1, order, rank)
        slot_pos = torch.zeros(self.n_rows, self.read_width, dtype=torch.long)
        slot_pos[row, within] = pos
        return {"read_tok": offset[row] + pos - start[row], "read_dense": row * self.seq + pos,
                "read_slot": row * self.read_width + within, "read_slot_pos": slot_pos,
                "read_inverse": inverse}

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

    def read_tok_of(self, device: torch.device) -> Tensor:
        """``[N]`` the packed token of each distinct read."""
        return self._get("read_tok", device)

    def read_dense_of(self, device: torch.device) -> Tensor:
        """``[N]`` each distinct read's index in dense rows ``[R * seq]``."""
        return self._get("read_dense", device)

    def read_slot_of(self, device: torch.device) -> Tensor:
        """``[N]`` each distinct read's query slot in ``[R * read_width]``."""
        return self._get("read_slot", device)

    def read_mask_of(self, device: torch.device, window: int | None = None) -> Tensor:
        """``[R, 1, read_width, seq]`` which keys each read slot's query sees."""
        return self._visible("read_slot_pos", device, window)

    def spread(self, per_read: Tensor) -> Tensor:
        """Values at the distinct reads ``[N, ...]`` -> at every read ``[R, k, ...]``."""
        inverse = self._get("read_inverse", per_read.device)
        return per_read.index_select(0, inverse.flatten()).view(*inverse.shape, *per_read.shape[1:])

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
            return pack.spread(form.logits(form.last_block_at_reads(pack, x, b, base)))
    return pack.spread(form.logits(form.known_block_at_reads(pack, x, b, attn, mlp)))
