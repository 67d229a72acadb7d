"""What each attribution estimator costs, in pass-equivalents per prompt (one prompt through the
whole model; a backward counts 2), from numbers alone: the one home of these formulas. Each
registry entry's ``passes`` is one of the ``*_passes`` functions below, read by the estimators'
own ``meta["pass_equivalents"]`` (``registry.estimator_passes``) and by the plans without weights
(``cost.sweep_plan``, ``cost.edge_plan``). What each estimator computes: docs/attribution.md."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostShape:
    """What an estimator's cost depends on. ``copies``: patched cells per layer (heads at the
    site, times positions for ``positions="each"``); ``s_attn``, ``s_mlp``: one attention / MLP
    call's FLOP share of a block (``block_flop_shares``); ``positions_per_call``: prompts x
    tokens per forward ("block" at site z; None: unknown); ``d_model``: given where the
    all-heads MLP formula covers the model (``head_mlp.covers``), else None; ``n_sender_groups``:
    sender layers of eap-ig-activations (the embeddings count as one); ``receiver_attn``:
    eap*'s receiver runs (``receiver_attn_passes``)."""

    n_layers: int
    n_heads: int = 0
    copies: int = 0
    site: str = "z"
    s_attn: float = 0.0
    s_mlp: float = 0.0
    ig_steps: int = 0
    exact_tail: bool = False
    positions_per_call: int | None = None
    d_model: int | None = None
    gated: bool = True
    n_sender_groups: int = 1
    receiver_attn: float = 0.0


def receiver_attn_passes(attn_share: float, n_layers: int, n_inputs: int, pairs: int) -> float:
    """Pass-equivalents per prompt of the eap* edge estimator's receiver runs: per (sender,
    receiver layer) pair, that layer's q/k/v projections once (a third of its attention) and
    its attention once per input, each ``attn_share / n_layers`` of a pass."""
    return pairs * (1 / 3 + n_inputs) * attn_share / n_layers


def block_flop_shares(d_model: int, d_mlp: int, d_head: int, n_heads: int, n_kv_heads: int,
                      seq: int, gated: bool = True) -> tuple[float, float]:
    """FLOP shares (attention, MLP) of one block per token: what one attention or one MLP call
    costs, in blocks. Attention: q/o and k/v projections plus scores over ``seq / 2`` keys on
    average; MLP: 3 matrices gated, 2 plain."""
    mlp = 2 * d_model * d_mlp * (3 if gated else 2)
    attn = 4 * d_model * d_head * (n_heads + n_kv_heads) + 2 * n_heads * d_head * seq
    return attn / (attn + mlp), mlp / (attn + mlp)


def head_mlp_pays(positions: int, heads: int, d_model: int) -> bool:
    """Whether the block estimator's all-heads MLP formula (``patching/exact/head_mlp.py``; its
    virtual weights cost ``d_model`` positions' worth of input projections per layer and call) beats
    one MLP call per head, at ``positions`` positions per call."""
    return positions * heads > 2 * d_model


def block_screen_passes(n_heads: int, copies: int, site: str, s_attn: float, s_mlp: float,
                        positions_per_call: int | None = None, d_model: int | None = None,
                        gated: bool = True) -> float:
    """Pass-equivalents per prompt of the "block" estimator (``attribution``): AtP's 4, plus
    one attention and MLP call per head copy at sites q/k/v/pattern, and at site z either one
    MLP call per head or, where ``head_mlp_pays`` (``positions_per_call`` and ``d_model`` given),
    the all-heads formula: per position k input projections shared, k for all heads' virtual
    products, one output projection, and the virtual weights spread over the call's positions,
    ``s_mlp ((2k + 1) + k d_model / positions) / (k + 1)`` (k = 2 gated, 1 plain)."""
    if site != "z":
        return 4.0 + copies * (s_attn + s_mlp)
    if positions_per_call and d_model and head_mlp_pays(positions_per_call, n_heads, d_model):
        k = 2 if gated else 1
        return 4.0 + s_mlp * ((2 * k + 1) + k * d_model / positions_per_call) / (k + 1)
    return 4.0 + n_heads * s_mlp


# --- one formula per estimator (heads) ------------------------------------------------------------


def atp_passes(c: CostShape) -> float:
    """Base forward with gradients, source forward, one backward."""
    return 4.0


def block_passes(c: CostShape) -> float:
    """``block_screen_passes``: AtP's 4 plus the head's own block run exactly."""
    return block_screen_passes(c.n_heads, c.copies, c.site, c.s_attn, c.s_mlp,
                               positions_per_call=c.positions_per_call, d_model=c.d_model,
                               gated=c.gated)


def ig_passes(c: CostShape) -> float:
    """Two plain forwards, then ``m`` interpolated forwards with a backward each."""
    return 2.0 + 3.0 * c.ig_steps


def graddrop_passes(c: CostShape) -> float:
    """A forward of each prompt pair and ``L + 1`` backwards (one per dropped block, one plain)."""
    return 2.0 + 2.0 * (c.n_layers + 1)


def _qk_fix(c: CostShape) -> float:
    """The Q/K fix on top of AtP. Site z: one attention call per head copy and (layer, later
    layer) pair, a VJP per later layer; q/k: one attention call per copy per layer. Exact tail:
    a block per copy."""
    L = c.n_layers
    if c.site == "z":
        qk = (c.copies * L * (L - 1) / 2 * c.s_attn + (L - 1) * 2 * c.s_attn) / L
    else:
        qk = c.copies * c.s_attn
    qk += c.copies if c.exact_tail else 0.0
    return qk


def qk_passes(c: CostShape) -> float:
    return 4.0 + _qk_fix(c) + 0.0


def atp_star_passes(c: CostShape) -> float:
    """Both fixes: GradDrop's backwards and the Q/K fix."""
    return 4.0 + _qk_fix(c) + (graddrop_passes(c) - 2.0)


# --- edges -------------------------------------------------------------------------------------


def eap_passes(c: CostShape) -> float:
    """The base run with gradients (each head's input split into its own residual copy: that
    forward costs more than a plain one and is not counted), the source run."""
    return 4.0


def eap_ig_inputs_passes(c: CostShape) -> float:
    return 2.0 + 3.0 * c.ig_steps


def eap_ig_activations_passes(c: CostShape) -> float:
    """``2 + 3 m`` per sender layer."""
    return 2.0 + 3.0 * c.ig_steps * c.n_sender_groups


def eap_star_passes(c: CostShape) -> float:
    """EAP's 4 plus the receiving layers' attention re-run per (sender, receiver layer) and
    input."""
    return 4.0 + c.receiver_attn
