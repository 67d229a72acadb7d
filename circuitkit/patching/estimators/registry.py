"""The estimator registry: one ``Estimator`` entry per attribution estimator, as auto-circuit
registers its ``PruneAlgo``s. An entry says which units it estimates (heads or edges), its
per-batch function (``driver`` runs the batches), its cost in pass-equivalents per prompt
(a formula of ``costs``: the one source the estimators' meta and ``plan`` read), the sites it
applies to, and what it needs of the model, each need with its one-line refusal. Adding an
estimator is adding one entry to ``ENTRIES``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from circuitkit import hooks
from circuitkit.patching import shortcuts
from circuitkit.patching.estimators import atp, block, costs, eap, graddrop, ig
from circuitkit.patching.estimators.qk import ATP_STAR_SITES
from circuitkit.patching.estimators.rerun import layer_reruns
from circuitkit.patching.exact import head_mlp
from circuitkit.patching.inputs import choice

HEAD_SITES = ("z", "q", "k", "v", "pattern")
IG_STEPS = 4
EDGE_IG_STEPS = 5
# What ``attribution+exact`` screens heads with by default: docs/attribution.md has the evidence.
SCREENING_ESTIMATOR = "block"
# What it screens edges with: eap* ranks single edges closest to exact (benchmarks/edges.py):
# the nonlinearity of a q/k edge is the receiving head's softmax, which eap* computes and eap /
# EAP-IG linearise (docs/edges.md, "Which screen")
EDGE_SCREENING_ESTIMATOR = "eap*"

# What an estimator may need of the model, and the one line that refuses a model without it
# ({est}: the estimator's name). "split_qkv" is refused by ``shortcuts.split_qkv_inputs`` itself.
NEEDS = {
    "attn_rerun": "estimator {est!r} re-runs single layers ({parts}) with the model's own "
                  "modules, which this architecture's bridge does not allow (e.g. OPT's MLP is "
                  "no module of its own, Bloom's needs the residual); use estimator 'atp', "
                  "'ig' or 'graddrop'.",
    "pattern_grad": "estimator {est!r} (AtP*'s Q/K fix) needs the gradient at the attention "
                    "pattern, and this model's bridge fires hook_pattern after the attention "
                    "ran (e.g. GPT-J), so that gradient is zero and the fix would do nothing: "
                    "use estimator 'block' or 'atp'.",
    # its one line is shortcuts.split_qkv_inputs' own (it names eap* and exact), raised by
    # ``check_edge_needs`` before any batch
    "split_qkv": "each head's q/k/v input as its own residual copy (use_split_qkv_input)",
}


@dataclass(frozen=True)
class Estimator:
    """One registered estimator. ``units``: "heads" or "edges"; ``batch(job, batch) ->
    common.BatchOut``; ``passes(costs.CostShape) -> float`` per prompt; ``sites``: the head
    sites it applies to (edges: the receiving inputs); ``reruns``: the one-layer re-runs it
    needs per site kind (``"z"`` and ``"other"``; ``rerun.layer_reruns``); ``needs``: keys of
    ``NEEDS``; ``per_prompt``: whether it gives per-prompt values (GradDrop does not);
    ``ig``: whether it takes ``ig_steps``; ``qk``: whether it walks the Q/K fix's plan."""

    name: str
    units: str
    batch: Callable[..., Any]
    passes: Callable[[costs.CostShape], float]
    summary: str
    sites: tuple[str, ...] = HEAD_SITES
    reruns: dict[str, tuple[str, ...]] | None = None
    needs: tuple[str, ...] = ()
    per_prompt: bool = True
    ig: bool = False
    qk: bool = False


_QK_RERUNS = {"z": ("attn",), "other": ("attn",)}
ENTRIES = (
    Estimator("atp", "heads", atp.batch, costs.atp_passes,
              "plain attribution: (a_source - a_base) . dm/da"),
    Estimator("block", "heads", block.batch, costs.block_passes,
              "the head's own block exactly, the rest linear",
              reruns={"z": ("mlp",), "other": ("attn", "mlp")}),
    Estimator("qk", "heads", atp.batch, costs.qk_passes, "AtP*'s Q/K fix: softmax effects exact",
              sites=ATP_STAR_SITES, reruns=_QK_RERUNS, needs=("pattern_grad",), qk=True),
    Estimator("graddrop", "heads", graddrop.batch, costs.graddrop_passes,
              "AtP*'s GradDrop: mean magnitude over dropped blocks", per_prompt=False),
    Estimator("atp*", "heads", graddrop.batch_atp_star, costs.atp_star_passes,
              "Q/K fix and GradDrop", sites=ATP_STAR_SITES, reruns=_QK_RERUNS,
              needs=("pattern_grad",), per_prompt=False, qk=True),
    Estimator("ig", "heads", ig.batch, costs.ig_passes,
              "integrated gradients along the embedding path", ig=True),
    Estimator("eap", "edges", eap.batch, costs.eap_passes,
              "sender write . gradient at the receiver's own input copy", sites=("q", "k", "v"),
              needs=("split_qkv",)),
    Estimator("eap-ig-inputs", "edges", eap.batch, costs.eap_ig_inputs_passes,
              "eap's gradient averaged over interpolated token embeddings",
              sites=("q", "k", "v"), needs=("split_qkv",), ig=True),
    Estimator("eap-ig-activations", "edges", eap.batch, costs.eap_ig_activations_passes,
              "eap's gradient averaged over each sender layer's interpolated output",
              sites=("q", "k", "v"), needs=("split_qkv",), ig=True),
    Estimator("eap*", "edges", eap.batch, costs.eap_star_passes,
              "the receiving head run exactly, the rest first order", sites=("q", "k", "v")),
)
REGISTRY: dict[str, Estimator] = {e.name: e for e in ENTRIES}
ESTIMATORS = tuple(e.name for e in ENTRIES if e.units == "heads")
EDGE_ESTIMATORS = tuple(e.name for e in ENTRIES if e.units == "edges")


def names(units: str) -> tuple[str, ...]:
    """The registered estimators of ``units`` ("heads" or "edges"), in registration order."""
    return tuple(e.name for e in REGISTRY.values() if e.units == units)


def get(name: str, units: str) -> Estimator:
    """The entry ``name`` estimating ``units``; an unknown name is one ``choice`` error."""
    choice("estimator", name, names(units))
    return REGISTRY[name]


# --- cost ----------------------------------------------------------------------------------------


def block_shares(model: Any, seq: int) -> tuple[float, float]:
    """FLOP shares (attention, MLP) of one block per token (attention scores over ``seq``/2 keys
    on average): what one attention or one MLP call costs, in blocks."""
    f = hooks.facts(model)
    d_mlp = int(getattr(model.cfg, "d_mlp", None) or 4 * f.d_model) if hooks.has_mlp(model) \
        else 0
    return costs.block_flop_shares(f.d_model, d_mlp, f.d_head, f.n_heads, f.n_kv_heads, seq,
                                   gated=bool(getattr(model.cfg, "gated_mlp", False)))


def estimator_passes(model: Any, estimator: str, site: str, positions: str, seq: int,
                     ig_steps: int = IG_STEPS, exact_tail: bool = False,
                     batch: int | None = None) -> float:
    """Pass-equivalents per prompt of head estimator ``estimator`` on ``model`` (its entry's
    ``passes``), with ``batch`` prompts per forward where the cost depends on it ("block",
    site z)."""
    f = hooks.facts(model)
    s_attn, s_mlp = block_shares(model, seq)
    shape = costs.CostShape(n_layers=f.n_layers, n_heads=f.n_heads,
                            copies=f.n_heads_at(site) * (seq if positions == "each" else 1),
                            site=site, s_attn=s_attn, s_mlp=s_mlp, ig_steps=ig_steps,
                            exact_tail=exact_tail, positions_per_call=batch and batch * seq,
                            d_model=f.d_model if head_mlp.covers(model) else None,
                            gated=bool(getattr(model.cfg, "gated_mlp", False)))
    return REGISTRY[estimator].passes(shape)


def edge_estimator_passes(model: Any, layout: Any, estimator: str, ig_steps: int,
                          seq: int) -> float:
    """Pass-equivalents per prompt of edge estimator ``estimator`` over ``layout``'s edges
    (``sweep.EdgeLayout``; its entry's ``passes``): eap 4, eap-ig-inputs 2 + 3 m,
    eap-ig-activations 2 + 3 m per sender layer, eap* 4 + its receiver runs per (sender,
    receiver layer) pair (``costs.receiver_attn_passes``)."""
    L = layout.n_layers
    recv = {la for la, _ in layout.receivers if la < L}
    pairs = sum(1 for la in recv for sl, _ in layout.senders if sl < la)
    attn = costs.receiver_attn_passes(block_shares(model, seq)[0], L, len(layout.inputs),
                                      pairs) if estimator == "eap*" else 0.0
    groups = len({max(sl, -1) for sl, _ in layout.senders}) \
        if estimator == "eap-ig-activations" else 1
    return REGISTRY[estimator].passes(costs.CostShape(
        n_layers=0, ig_steps=ig_steps, n_sender_groups=groups, receiver_attn=attn))


# --- what an estimator needs of the model -------------------------------------------------------


def resolve_estimator(estimator: str | None, atp_star: bool) -> str:
    """``estimator`` checked, or the legacy choice: ``"qk"`` for ``atp_star=True``, else
    ``"atp"``."""
    if estimator is None:
        return "qk" if atp_star else "atp"
    if not get(estimator, "heads").qk and atp_star:
        raise ValueError(f"atp_star=True selects AtP*'s Q/K fix (estimator 'qk'); it cannot be "
                         f"combined with estimator={estimator!r}. Pass one of the two.")
    return estimator


def missing_reruns(model: Any, estimator: str, site: str, tokens: Tensor) -> list[str]:
    """The one-layer re-runs (``"attn"``, ``"mlp"``) ``estimator`` needs at ``site`` that this
    model cannot do (``rerun.layer_reruns``); empty where it can run."""
    reruns = REGISTRY[estimator].reruns
    need = reruns["z" if site == "z" else "other"] if reruns else ()
    return [part for part in need if not layer_reruns(model, tokens)[part]] if need else []


def check_model(model: Any, est: Estimator, site: str, tokens: Tensor) -> None:
    """Refuse, in one line, a site the estimator does not apply to or a model lacking what it
    needs (a gradient at the pattern, one-layer re-runs); warn where it degenerates (``block``
    on attention-only blocks)."""
    if site not in est.sites:
        raise NotImplementedError(
            f"estimator {est.name!r} (AtP*'s Q/K fix) corrects softmax effects for sites "
            f"{est.sites}; site={site!r} acts linearly on its own head's output: use "
            "estimator 'atp', 'block', 'graddrop' or 'ig'.")
    if "pattern_grad" in est.needs:
        try:
            hooks.check_patchable(model, "pattern", tokens)
        except ValueError:
            raise ValueError(NEEDS["pattern_grad"].format(est=est.name)) from None
    missing = missing_reruns(model, est.name, site, tokens)
    if missing:
        raise ValueError(NEEDS["attn_rerun"].format(est=est.name, parts=" and ".join(missing)))
    if est.name == "block" and not hooks.has_mlp(model):
        warnings.warn(f"estimator 'block': this model's blocks have no MLP (attention-only), so "
                      f"nothing after a head's write is run exactly: the estimate is "
                      f"{'plain AtP' if site == 'z' else 'the head attention exact, then linear'}"
                      ".", RuntimeWarning, stacklevel=3)


def check_edge_needs(model: Any, est: Estimator) -> None:
    """Refuse, in one line and before any batch, a model without what edge estimator ``est``
    needs: the per-head input fork of eap and EAP-IG (switched on and back off here)."""
    if "split_qkv" in est.needs:
        with shortcuts.split_qkv_inputs(model):
            pass


def screening_estimator(model: Any, site: str, tokens: Tensor) -> str:
    """``SCREENING_ESTIMATOR`` where the model can run it, else plain ``"atp"`` (with a
    ``RuntimeWarning``): what ``attribution+exact`` and ``method="auto"`` screen with."""
    if not missing_reruns(model, SCREENING_ESTIMATOR, site, tokens):
        return SCREENING_ESTIMATOR
    warnings.warn(f"this architecture's layers cannot be re-run alone (attribution."
                  f"layer_reruns), so the screen is plain AtP instead of "
                  f"{SCREENING_ESTIMATOR!r}; the verification rule is the same.",
                  RuntimeWarning, stacklevel=3)
    return "atp"
