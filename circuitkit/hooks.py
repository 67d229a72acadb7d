"""The one place hook names, site names and node names ("L2H0", "embed", "logits") are spelled.

Every module that touches a TransformerLens ``TransformerBridge`` asks this module for hook names
and for the model facts a sweep needs; no other file writes a hook-name string. The names are those
of TransformerLens 4.3's bridge (``blocks.{l}.attn.hook_z`` ...), which match HookedTransformer's.

Shapes (TransformerLens convention):

=========  =======================================  ==========
site       activation                               head axis
=========  =======================================  ==========
q          [batch, pos, n_heads, d_head]            2
k, v       [batch, pos, n_kv_heads, d_head] (GQA)   2
z          [batch, pos, n_heads, d_head]            2
result     [batch, pos, n_heads, d_model]           2
pattern    [batch, n_heads, query_pos, key_pos]     1
scores     [batch, n_heads, query_pos, key_pos]     1
q_input    [batch, pos, n_heads, d_model]           2 (split inputs only)
k_input    [batch, pos, n_kv_heads, d_model]        2 (split inputs only)
=========  =======================================  ==========

This module imports nothing heavy: it is safe to use from ``circuitkit --help``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


def _per_layer(hook: str) -> Callable[[int], str]:
    """``layer -> "blocks.{layer}.{hook}"``: the hook name of a per-layer site."""
    def name(layer: int) -> str:
        return f"blocks.{layer}.{hook}"
    return name


# --- per-layer residual-stream sites --------------------------------------------------------
resid_pre = _per_layer("hook_resid_pre")
resid_mid = _per_layer("hook_resid_mid")
resid_post = _per_layer("hook_resid_post")
attn_out = _per_layer("hook_attn_out")
# the attention module's own output, before any post-attention norm (Gemma 2); the same value as
# attn_out where the block has none
attn_module_out = _per_layer("attn.hook_out")
mlp_out = _per_layer("hook_mlp_out")


def resid_mid_of(model: Any, layer: int) -> str:
    """The residual a head's write joins before the block's MLP: ``resid_mid``; a parallel block
    (attention and MLP both read the block input, ``parallel``) has none, so ``resid_pre``; a
    block without an MLP (``has_mlp``: attention-only) ends there, so ``resid_post``."""
    if not has_mlp(model, layer):
        return resid_post(layer)
    return resid_pre(layer) if parallel(model) else resid_mid(layer)


# --- per-head attention sites ---------------------------------------------------------------
q = _per_layer("attn.hook_q")
k = _per_layer("attn.hook_k")
v = _per_layer("attn.hook_v")
z = _per_layer("attn.hook_z")
# each head's residual write; fires only with ``model.set_use_attn_result(True)``
result = _per_layer("attn.hook_result")
pattern = _per_layer("attn.hook_pattern")
scores = _per_layer("attn.hook_attn_scores")
# each head's own copy of the residual its queries (keys, values: a copy per KV head) read,
# [batch, pos, n_heads (n_kv_heads), d_model], before the block's norm; they fire only under
# use_split_qkv_input (patching.shortcuts.split_qkv_inputs)
q_input = _per_layer("attn.hook_q_input")
k_input = _per_layer("attn.hook_k_input")
v_input = _per_layer("attn.hook_v_input")

EMBED = "hook_embed"
FINAL_NORM_IN = "ln_final.hook_in"
UNEMBED_IN = "unembed.hook_in"  # normalised final residual [batch, pos, d_model]
LOGITS = "unembed.hook_out"

HEAD_SITES: dict[str, Callable[[int], str]] = {
    "z": z, "q": q, "k": k, "v": v, "result": result, "pattern": pattern, "scores": scores,
}
LAYER_SITES: dict[str, Callable[[int], str]] = {
    "resid_pre": resid_pre, "resid_mid": resid_mid, "resid_post": resid_post,
    "attn_out": attn_out, "mlp_out": mlp_out,
}
KV_SITES = frozenset({"k", "v"})
# The sites a patching sweep can patch: the one table the engine, results, scoring and the CLI use.
PATCH_HEAD_SITES = ("z", "pattern", "q", "k", "v")
PATCH_LAYER_SITES = ("resid_pre", "attn_out", "mlp_out")
# The inputs an edge can feed in a receiving head (``patching.api.patch_edges``).
EDGE_INPUTS = ("q", "k", "v")
INPUT_SITES: dict[str, Callable[[int], str]] = {"q": q_input, "k": k_input, "v": v_input}


def edge_input(name: str, layer: int) -> str:
    """Hook name of the per-head residual copy a head's input ``name`` ("q", "k", "v") reads
    (``q_input`` ...)."""
    if name not in INPUT_SITES:
        raise ValueError(f"input={name!r} is not a head input; expected one of "
                         f"{list(EDGE_INPUTS)}.")
    return INPUT_SITES[name](layer)


def head_site(site: str, layer: int) -> str:
    """Hook name of a per-head ``site`` ("z", "q", "k", "v", "result", "pattern", "scores")."""
    if site not in HEAD_SITES:
        raise ValueError(f"site={site!r} is not a per-head site; expected one of "
                         f"{sorted(HEAD_SITES)}.")
    return HEAD_SITES[site](layer)


def layer_site(site: str, layer: int) -> str:
    """Hook name of a per-layer ``site`` ("resid_pre", "attn_out", "mlp_out", ...)."""
    if site not in LAYER_SITES:
        raise ValueError(f"site={site!r} is not a per-layer site; expected one of "
                         f"{sorted(LAYER_SITES)}.")
    return LAYER_SITES[site](layer)


def head_axis(site: str) -> int:
    """Axis of the head dimension in the activation at ``site`` (see the table above)."""
    return 1 if site in ("pattern", "scores") else 2


# --- node names: heads and the ends of edges -------------------------------------------------
# A node is ``(layer, head)``; an edge's senders add the embeddings, its receivers the logits
# (the final residual the unembedding reads). The one spelling of their names: "L2H0", "embed",
# "logits" (results, circuit.json, figures, the CLI's --senders/--receivers all use these).

EMBED_NODE = (-1, -1)  # the sender "embed": the embeddings' write (resid_pre of block 0)
HEAD_NAME = re.compile(r"L(\d+)H(\d+)")  # "L2H0"; found in text by ``heads_in``


def logits_node(n_layers: int) -> tuple[int, int]:
    """The receiver "logits": the final residual the unembedding reads (after every block)."""
    return (n_layers, -1)


def head_name(layer: Any, head: Any) -> str:
    """``"L{layer}H{head}"``: a head's name (the values as given: a caller casts)."""
    return f"L{layer}H{head}"


def node_name(node: Any, n_layers: int) -> str:
    """``"embed"`` (layer -1), ``"logits"`` (layer ``n_layers``) or ``"L{layer}H{head}"``."""
    layer, head = int(node[0]), int(node[1])
    return "embed" if layer < 0 else "logits" if layer >= n_layers else head_name(layer, head)


def parse_head(name: Any) -> tuple[int, int] | None:
    """``"L2H5"`` -> (2, 5); None for anything else (no range check: the caller's)."""
    m = HEAD_NAME.fullmatch(name) if isinstance(name, str) else None
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def parse_node(name: Any, n_layers: int) -> tuple[int, int]:
    """``node_name``'s inverse: ``"embed"`` -> (-1, -1), ``"logits"`` -> (n_layers, -1), ``"L2H5"``
    -> (2, 5); a ``ValueError`` for anything else (a layer outside the model included)."""
    if name == "embed":
        return EMBED_NODE
    if name == "logits":
        return logits_node(n_layers)
    node = parse_head(str(name))
    if node is None or node[0] >= n_layers:
        raise ValueError(f"{name!r} is not a node of a {n_layers}-layer model (embed, logits or "
                         "L<layer>H<head>).")
    return node


def heads_in(text: Any) -> list[tuple[int, int]]:
    """Every head named in ``text`` (``"L0H1 L2H3"`` -> [(0, 1), (2, 3)]), in order."""
    return [(int(a), int(b)) for a, b in HEAD_NAME.findall(str(text))]


def layer_of(hook_name: str) -> int:
    """``"blocks.3.attn.hook_z"`` -> 3."""
    parts = hook_name.split(".")
    if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
        raise ValueError(f"{hook_name!r} is not a per-layer hook name (blocks.<layer>.<...>).")
    return int(parts[1])


# --- model facts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """What every sweep needs to know about a model's shape."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    d_vocab: int  # token ids the embedding reads
    n_ctx: int
    d_vocab_out: int  # logits the unembedding writes (smaller for Tracr models)
    causal: bool  # a position attends to earlier ones only (False: bidirectional, Tracr)

    @property
    def gqa(self) -> bool:
        return self.n_kv_heads != self.n_heads

    def n_heads_at(self, site: str) -> int:
        """Size of the head axis at ``site``: the KV-head count for k/v (GQA), else n_heads."""
        return self.n_kv_heads if site in KV_SITES else self.n_heads

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def vocab_out(model_or_cfg: Any) -> int:
    """Logits the unembedding writes: the config's own output vocabulary where it sets one
    (``d_vocab_out > 0``, e.g. a Tracr model's), else ``d_vocab``."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    out = getattr(cfg, "d_vocab_out", None)
    return int(out) if isinstance(out, int) and out > 0 else int(cfg.d_vocab)


def context_problem(model_or_cfg: Any, seq: int, what: str = "the prompts") -> str | None:
    """Why prompts of ``seq`` tokens do not fit the model's context (``n_ctx``; None when they
    do, or when the config records none): one rule for every entry (a sweep's tokens, a task's
    notes, the plan's ``--seq-len``). Past ``n_ctx``, learned position embeddings do not exist
    and rotary ones were never trained: values there mean nothing, whatever the model runs."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    n_ctx = getattr(cfg, "n_ctx", None)
    if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx < 1 or seq <= n_ctx:
        return None
    return (f"{what} have {seq} tokens but the model's context is n_ctx={n_ctx} tokens: "
            "positions past it were never trained (or do not exist), so its values there mean "
            f"nothing. Shorten them (or keep their last {n_ctx} tokens), or use a model with a "
            "longer context.")


def facts(model_or_cfg: Any) -> ModelFacts:
    """ModelFacts of a TransformerBridge (or of its ``cfg``)."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    try:
        n_heads = int(cfg.n_heads)
        # (a TransformerLens cfg says n_key_value_heads; models.Architecture, n_kv_heads)
        kv = getattr(cfg, "n_key_value_heads", None) or getattr(cfg, "n_kv_heads", None)
        return ModelFacts(
            n_layers=int(cfg.n_layers),
            n_heads=n_heads,
            n_kv_heads=int(kv) if kv else n_heads,
            d_head=int(cfg.d_head),
            d_model=int(cfg.d_model),
            d_vocab=int(cfg.d_vocab),
            n_ctx=int(cfg.n_ctx),
            d_vocab_out=vocab_out(cfg),
            causal=getattr(cfg, "attention_dir", "causal") != "bidirectional",
        )
    except AttributeError as e:
        raise TypeError("facts() needs a TransformerBridge or its cfg (with n_layers, n_heads, "
                        f"d_head, d_model, d_vocab, n_ctx); got {type(model_or_cfg).__name__}: "
                        f"{e}") from None


def has_mlp(model: Any, layer: int = 0) -> bool:
    """Whether block ``layer`` has an MLP (an attention-only model's blocks have none; the
    config's ``attn_only`` is not asked: a model may keep zeroed MLPs under that flag)."""
    return "mlp" in model.blocks[layer]._modules


def parallel(model: Any) -> bool:
    """Whether the MLP reads the block input rather than the residual after attention
    (GPT-NeoX, GPT-J, Phi, Falcon, Cohere). The config's ``parallel_attn_mlp`` says so, and the
    bridge then has no ``hook_resid_mid``; where it has one the block adds the attention output
    before its MLP whatever the config says (a TransformerLens-native model runs its blocks in
    sequence with ``parallel_attn_mlp=True``)."""
    return bool(getattr(model.cfg, "parallel_attn_mlp", False)) and has_mlp(model) \
        and resid_mid(0) not in model.hook_dict


def owner(model: Any, hook_name: str) -> Any:
    """The module whose output hook ``hook_name`` is (an alias resolved: Gemma 2's
    ``hook_attn_out`` is its post-attention norm's output, not the attention's); None where
    the model has no such hook."""
    point = model.hook_dict.get(hook_name)
    return None if point is None else model.get_submodule(point.name.rsplit(".", 1)[0])


def pre_norm(model: Any, layer: int, part: str) -> Any:
    """The norm block ``layer`` applies to the residual before its ``part`` ("attn" or "mlp"),
    or None (OLMo 2 normalises after instead)."""
    return getattr(model.blocks[layer], "ln1" if part == "attn" else "ln2", None)


def post_norm(model: Any, layer: int, part: str) -> Any:
    """The norm block ``layer`` applies to its ``part`` ("attn" or "mlp") output before the
    residual add, or None (pre-norm blocks): the module owning ``attn_out``/``mlp_out`` when
    that is not the attention/MLP itself."""
    block = model.blocks[layer]
    if part == "mlp" and not has_mlp(model, layer):
        return None
    module, name = (block.attn, attn_out(layer)) if part == "attn" else (block.mlp,
                                                                          mlp_out(layer))
    found = owner(model, name)
    return None if found is module else found


# --- which sites an edit reaches -------------------------------------------------------------


def probe_tokens(model: Any, device: Any = None) -> Any:
    """``[1, min(8, n_ctx)]`` seeded random token ids (from 1 where the vocabulary allows) for
    the per-model probes whose verdict is cached (``check_patchable``, attribution's
    ``layer_reruns``): never the caller's prompts, so a verdict is the architecture's, not a
    prompt length's (a 1-token prompt's only key makes every query alike)."""
    import torch

    seq = min(8, int(getattr(model.cfg, "n_ctx", None) or 8))
    d_vocab = int(model.cfg.d_vocab)
    ids = torch.randint(min(1, d_vocab - 1), d_vocab, (1, seq),
                        generator=torch.Generator().manual_seed(0))
    return ids if device is None else ids.to(device)


_PATCHABLE: Any = None  # WeakKeyDictionary model -> {site: bool}, made on first use


def check_patchable(model: Any, site: str, tokens: Any) -> None:
    """``ValueError`` when an edit at head site ``site`` does not reach the model's output, or
    when the model has no hook for layer site ``site`` (``mlp_out`` of an attention-only model).

    TransformerLens fires some hooks after the fact, on attention it leaves to the HF module
    (GPT-J's ``hook_pattern``): it discards an edit there, so a sweep would report no effect for
    every head. Probed once per model and site: noise added to the site in every layer at once
    (a layer may legitimately write nothing, e.g. a planted circuit's) on ``probe_tokens``
    (on ``tokens``' device; never the caller's prompts: a 1-token prompt does not decide it),
    the logits compared bit for bit."""
    global _PATCHABLE
    if site in LAYER_SITES and hasattr(model, "hook_dict") \
            and layer_site(site, 0) not in model.hook_dict:
        why = ("its blocks have no MLP (an attention-only model)" if site == "mlp_out"
               and not has_mlp(model) else "TransformerLens gives this model no such hook")
        others = " or ".join(repr(s) for s in PATCH_LAYER_SITES if s != site
                             and layer_site(s, 0) in model.hook_dict)
        raise ValueError(f"site={site!r}: this model has no {layer_site(site, 0)!r}: {why}; "
                         f"patch {others} instead.")
    if site not in HEAD_SITES or not hasattr(model, "run_with_hooks"):
        return
    import warnings
    import weakref

    import torch

    if _PATCHABLE is None:
        _PATCHABLE = weakref.WeakKeyDictionary()
    known = _PATCHABLE.setdefault(model, {})
    if site not in known:
        probe = probe_tokens(model, tokens.device)

        def edit(t: Any, hook: Any) -> Any:
            # seeded noise at the activation's own scale: no site is invariant to it (a shift
            # would leave keys alone under the softmax, a head swap would with one KV head)
            g = torch.Generator().manual_seed(0)
            noise = torch.randn(t.shape, generator=g).to(t.device, t.dtype)
            return t + noise * (t.float().std() + 1).to(t.dtype)

        names = [head_site(site, layer) for layer in range(facts(model).n_layers)]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TransformerLens warns that it discards the edit
            base = model(probe)
            edited = model.run_with_hooks(probe, fwd_hooks=[(n, edit) for n in names])
        known[site] = not torch.equal(base, edited)
    if not known[site]:
        others = " or ".join(repr(s) for s in ("z", "v") if s != site)
        raise ValueError(f"site={site!r}: an edit of {head_site(site, 0)!r} (or of any layer's) "
                         "does not change this model's output (TransformerLens fires that hook "
                         "after the attention ran, e.g. on GPT-J); patching it would report no "
                         f"effect for every head. Patch another site instead, e.g. {others}.")
