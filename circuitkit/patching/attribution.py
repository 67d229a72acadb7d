"""Attribution patching of attention heads: gradient estimates of every head's patching effect.

A head's activation ``a`` at ``site`` is patched from the *base* run to the *source* run
(denoise: base = corrupt, source = clean; noise: base = clean, source = corrupt). Every estimator
returns ``values = metric(base) + delta`` (mean over prompts), an estimate of the metric *after*
patching, directly comparable with the exact sweep's ``values``. ``estimator=`` selects one;
``docs/attribution.md`` gives the evidence for each on a 30-layer model. Cost is in
pass-equivalents per prompt: one prompt through the whole model; a backward counts 2
(``meta["pass_equivalents"]`` is the total for the prompts given, ``meta["seconds"]`` the time).

* ``"atp"`` (plain attribution; Nanda 2023, Syed et al. 2023), the cheapest::

      delta(head) = sum_{pos, d} (a_source - a_base)[pos, head, d] * dm/da_base[pos, head, d]

  Cost 4 (base forward with gradients, source forward, one backward).

* ``"block"`` (the default for screening): the head's own block completed exactly, the rest
  linear. The patched head's write ``dr = (z_source - z_base) @ W_O[head]`` enters the block's
  MLP exactly, and the change of the block's output is dotted with the base gradient there::

      delta(head) = g_l . [dr + MLP_l(r_mid + dr) - MLP_l(r_mid)],   g_l = dm/d resid_post(l)

  (``MLP_l`` includes its norm; parallel attention/MLP blocks have no MLP after the head, so the
  estimate is plain AtP there. A block that normalises the attention and MLP outputs before the
  residual add, Gemma 2's, is completed through those norms too: ``dr = n_attn(a + dz W_O) -
  n_attn(a)`` around the base attention output ``a``, and ``MLP_l`` ends in ``n_mlp``.) For
  sites q/k/v/pattern the head's attention is first recomputed exactly with the patched
  activation (own softmax exact), then the same. Why: on SmolLM2 the
  linearised MLP right after a head answers its write with a large opposite response that the
  exact MLP does not give (L16H0: +2.5 of linear cancellation, AtP -0.14 vs exact -4.18; this
  estimator -2.38). Cost, site z: 4 + H * s_mlp with one MLP call per head and layer (the MLP
  being a share ``s_mlp`` of a block; rows are position-wise, so ``positions="each"`` costs the
  same), or, from ``2 d_model / H`` positions per call on, 4 + s_mlp ((2k + 1) + k d_model / N) /
  (k + 1) with all heads at once (``head_mlp``: virtual weights, N positions per call, k input
  projections): independent of H in FLOPs. Other sites: 4 + C * (s_attn + s_mlp) (C copies).

* ``"qk"`` (AtP*'s Q/K fix, Kramar et al. 2024 section 3.1.1; ``atp_star=True``): the effect of
  the patch on attention logits taken as it is and the softmax recomputed exactly, the rest
  linear. Sites q/k: the head's own pattern ``sum (P(q_source) - P_base) * dm/dP``. Site z: the
  head's direct residual write enters every later layer's queries and keys exactly, and its
  linearisation is swapped out::

      delta*(head) = delta(head) + sum_{l' > l} [ (P_l'(r_l' + dr) - P_l'(r_l')) . dm/dP_l'
                                                  - dr . d/dr (P_l'(r) . dm/dP_l') ]

  Cost: 4 + (H * pairs * s_attn + (L - 1) * 2 s_attn) / L with ``pairs`` = L(L-1)/2 (site z):
  it grows with heads times layers squared. Optional exact tail (``exact_tail=True``; default
  on only for the legacy ``atp_star=True``): the last block and the readout evaluated exactly
  for each head's direct write, + H * L last-block calls / L.

* ``"graddrop"`` (AtP*'s GradDrop, Kramar et al. 2024 section 3.1.2): plain AtP with the gradient
  through each layer's residual contribution (attention and MLP outputs of block ``l'``) zeroed,
  one estimate per ``l'``; the score is their mean magnitude, so paths that cancel in plain AtP
  no longer hide each other::

      |delta_GD(head)| = 1/(L-1) sum_{l'} | AtP with block l' dropped from the backward |

  The sign is that of the largest single-``l'`` estimate. Defined on the prompt mean (no
  per-prompt values). Cost: 2 + 2 (L + 1).

* ``"atp*"``: both fixes (``"qk"``'s correction added to every GradDrop term). Cost: the sum.

* ``"ig"`` (integrated gradients along the clean-corrupt path, as EAP-IG, Hanna et al. 2024): the
  token embeddings interpolated ``e(alpha) = e_base + alpha (e_source - e_base)`` and the site
  gradient averaged over ``m = ig_steps`` midpoints ``alpha_k = (k + 1/2) / m``::

      delta(head) = (a_source - a_base) . mean_k dm/da(alpha_k)

  The path is the same for both directions (reversed), so noise and denoise estimates are
  mirror images: it cannot see that breaking one head of a circuit (noise) costs more than
  restoring it (denoise). Cost: 2 + 3 m.

Every estimator also returns ``meta["write_scale"]`` (per cell, mean over prompts): the size of
the patch relative to what it perturbs (site z: ``|dr| / |resid_mid|`` per position, the block
input for parallel blocks, ``hooks.resid_mid_of``; q/k/v:
``|a_source - a_base| / |a_base|``; pattern: total variation of the row). The nonlinear error of
an estimate grows with it; ``attribution+exact`` uses it as the unit of its error bound.

Metrics: a ``PromptMetric`` (``circuitkit.metrics``). A metric without per-prompt values (a
wrapped scalar callable) repeats its scalar ``m`` for every prompt; the objective differentiated
is the sum of per-prompt values, ``n * m``, so per-prompt estimates are ``n`` times each prompt's
share and their mean is ``m + sum_b delta_b``: the same formula, no special case (such a metric
runs all prompts in one batch).

Layout: each estimator is one entry of ``estimators.registry`` (units, per-batch function, cost,
what it needs of the model); ``estimators.driver`` runs every one of them, heads and edges. This
module keeps the public entry points and the names other modules import. The hybrid (an
estimator, then exact verification) lives in ``patching/api.py``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric, as_metric
from circuitkit.patching.estimators import driver, eap
from circuitkit.patching.estimators.block import (  # noqa: F401  (imported from here elsewhere)
    _head_mlp_z,
    _mlp_change,
    _parameters_as,
)
from circuitkit.patching.estimators.common import _head_writes  # noqa: F401
from circuitkit.patching.estimators.costs import (
    head_mlp_pays,  # noqa: F401
    receiver_attn_passes,
)
from circuitkit.patching.estimators.graddrop import _graddrop_combine
from circuitkit.patching.estimators.qk import (  # noqa: F401
    ATP_STAR_SITES,
    LayerStep,
    estimator_plan,
)
from circuitkit.patching.estimators.registry import (  # noqa: F401
    EDGE_ESTIMATORS,
    EDGE_IG_STEPS,
    EDGE_SCREENING_ESTIMATOR,
    ESTIMATORS,
    IG_STEPS,
    REGISTRY,
    SCREENING_ESTIMATOR,
    block_shares,
    check_edge_needs,
    check_model,
    edge_estimator_passes,
    estimator_passes,
    get,
    missing_reruns,
    resolve_estimator,
    screening_estimator,
)
from circuitkit.patching.estimators.rerun import layer_reruns  # noqa: F401
from circuitkit.patching.inputs import (
    DIRECTIONS,
    POSITIONS,
    check_gradient,
    check_metric_prompts,
    check_tokens,
    checked_metric,
    choice,
)
from circuitkit.patching.patch_result import PatchResult

ATTRIBUTION_COST = "4 pass-equivalents per prompt (2 forwards + 1 backward, a backward counting 2)"


class _HeadJob:
    """What every batch of a head estimate shares (``common.Batch.head_args`` reads it)."""

    def __init__(self, site: str, positions: str, steps: Any, tail: bool, ig_steps: int):
        self.site, self.positions, self.steps, self.tail = site, positions, steps, tail
        self.ig_steps = ig_steps


def attribution_patch_heads(
    model: Any,
    clean_tokens: Int[Tensor, "batch seq"],
    corrupt_tokens: Int[Tensor, "batch seq"],
    metric: Any,
    direction: str = "denoise",
    site: str = "z",
    positions: str = "all",
    atp_star: bool = False,
    batch_size: int | None = None,
    progress: bool = True,
    exact_tail: bool | None = None,
    estimator: str | None = None,
    ig_steps: int = IG_STEPS,
) -> PatchResult:
    """Estimate every head's patching effect by attribution; see the module docstring.

    Args:
        model: a TransformerBridge (eval mode).
        clean_tokens, corrupt_tokens: [batch, seq], aligned position by position.
        metric: a ``PromptMetric`` or any callable ``logits -> scalar | [batch]``
            (``circuitkit.metrics.as_metric``).
        direction: "denoise" (clean -> corrupt run) or "noise" (corrupt -> clean run).
        site: "z", "q", "k", "v" (k/v: KV heads under GQA) or "pattern".
        positions: "all" -> values [n_layers, n_heads]; "each" -> [n_layers, n_heads, seq]
            (for "pattern" the position is the query position).
        estimator: one of ``ESTIMATORS`` (default: "qk" with ``atp_star``, else "atp").
        atp_star: legacy switch for estimator "qk" (sites z, q, k), with the exact tail on.
        batch_size: prompts per forward/backward (default: all; a metric without per-prompt
            values always runs all prompts at once).
        exact_tail: estimators "qk"/"atp*", site z: evaluate the last block and the readout
            exactly for each head's direct write (default: on with ``atp_star`` only).
        ig_steps: interpolation steps ``m`` of estimator "ig".

    Returns:
        PatchResult, method "attribution"; ``values = metric(base) + delta`` (mean over
        prompts); ``meta``: estimator, pass_equivalents, seconds, write_scale, plan ("qk").
    """
    t_start = time.perf_counter()
    est, clean_tokens, corrupt_tokens, metric = _checked_heads(
        model, clean_tokens, corrupt_tokens, metric, direction, site, positions, atp_star,
        batch_size, exact_tail, estimator, ig_steps)
    return estimate_heads(model, clean_tokens, corrupt_tokens, metric, est.name, direction,
                          site, positions, atp_star, batch_size, progress, exact_tail, ig_steps,
                          t_start, explicit=estimator is not None)


def estimate_heads(model: Any, clean_tokens: Tensor, corrupt_tokens: Tensor, metric: Any,
                   estimator: str, direction: str = "denoise", site: str = "z",
                   positions: str = "all", atp_star: bool = False,
                   batch_size: int | None = None, progress: bool = True,
                   exact_tail: bool | None = None, ig_steps: int = IG_STEPS,
                   t_start: float | None = None, explicit: bool = True) -> PatchResult:
    """``attribution_patch_heads`` on arguments already checked (``patch``'s entry checks
    them once; ``metric`` a ``PromptMetric`` fit for the tokens): the screen of the hybrid and
    ``auto`` call this, so no check runs twice. ``explicit``: the estimator was asked for by
    name (the exact tail then follows ``exact_tail`` only, not ``atp_star``)."""
    t_start = time.perf_counter() if t_start is None else t_start
    est = REGISTRY[estimator]
    check_model(model, est, site, clean_tokens)  # (what the estimator needs of the model)
    tail = bool(est.qk and site == "z" and (atp_star and not explicit
                                            if exact_tail is None else exact_tail))
    n, seq = clean_tokens.shape
    steps = estimator_plan(hooks.facts(model).n_layers, site, est.qk, tail) if est.qk else None
    bs = batch_size if (batch_size and metric.per_prompt_values) else n
    base_all, src_all = driver.base_and_source(clean_tokens, corrupt_tokens, direction)
    job = _HeadJob(site, positions, steps, tail, ig_steps)
    got = driver.run_batches(model, metric, base_all, src_all, bs,
                             lambda b: est.batch(job, b), progress, "attribution")
    pp = metric.per_prompt_values and est.per_prompt
    if got.terms:  # GradDrop: magnitudes of prompt-mean estimates; no per-prompt values
        mean_terms = torch.cat([t.detach().float().cpu() for t in got.terms]).mean(0)
        delta_mean = _graddrop_combine(mean_terms)
    else:
        delta_mean = got.delta.mean(0)
    meta = driver.base_meta(model, metric, est.name, n, bs, estimator_passes(
        model, est.name, site, positions, seq, ig_steps, tail, batch=bs), t_start)
    meta.update(atp_star=est.qk, exact_tail=tail,
                passes=ATTRIBUTION_COST if est.name == "atp" else f"see estimator {est.name!r}",
                write_scale=torch.cat(got.scales).mean(0).tolist())
    if est.ig:
        meta["ig_steps"] = ig_steps
    if steps is not None:
        meta["plan"] = [dict(layer=st.layer, own=st.own, downstream_qk=list(st.downstream_qk),
                             tail_correction=st.tail_correction) for st in steps]
    return driver.head_result(got, delta_mean, pp, direction, site, positions, meta)


def _checked_heads(model, clean_tokens, corrupt_tokens, metric, direction, site, positions,
                   atp_star, batch_size, exact_tail, estimator, ig_steps):
    """Every argument of ``attribution_patch_heads`` checked, in one place: the entry, the
    tokens and the metric (wrapped once, with a gradient)."""
    choice("direction", direction, DIRECTIONS)
    choice("site", site, hooks.PATCH_HEAD_SITES)
    choice("positions", positions, POSITIONS)
    est = REGISTRY[resolve_estimator(estimator, atp_star)]
    _check_steps(ig_steps, "estimator 'ig'")
    clean_tokens, corrupt_tokens = check_tokens(clean_tokens, corrupt_tokens, model)
    hooks.check_patchable(model, site, clean_tokens)
    n, seq = clean_tokens.shape
    metric = as_metric(metric, n, seq, hooks.facts(model).d_vocab_out)
    check_metric_prompts(metric, n)
    check_gradient(metric, "attribution")
    metric = checked_metric(model, clean_tokens, corrupt_tokens, metric, batch_size)
    if exact_tail and (site != "z" or not est.qk):
        raise NotImplementedError("exact_tail is implemented for site='z' with estimator 'qk' "
                                  "or 'atp*' only.")
    return est, clean_tokens, corrupt_tokens, metric


def _check_steps(ig_steps: Any, of: str) -> None:
    if isinstance(ig_steps, bool) or not isinstance(ig_steps, int) or ig_steps < 1:
        raise ValueError(f"ig_steps={ig_steps!r}: expected a positive integer (interpolation "
                         f"steps of {of}).")


def attribution_patch_edges(model: Any, clean_tokens: Tensor, corrupt_tokens: Tensor,
                            metric: PromptMetric, layout: Any, direction: str = "denoise",
                            estimator: str | None = None, ig_steps: int | None = None,
                            batch_size: int | None = None, progress: bool = True) -> Any:
    """Estimate every edge of ``layout`` (``sweep.EdgeLayout``) by ``estimator`` (see
    ``estimators/eap.py``, docs/edges.md); an ``EdgeResult`` with ``method="attribution"``:
    ``values = metric(base) + delta`` (mean over prompts), ``meta``: estimator, ig_steps,
    pass_equivalents, seconds, write_scale (``|delta_s| / |x_r|``, mean over prompts and
    positions, per edge; None where no edge). The model, nodes and tokens are checked by
    ``api.patch_edges``; the direction, the estimator, its steps and the metric's prompts and
    gradient here, before any work (as ``attribution_patch_heads`` checks them)."""
    t_start = time.perf_counter()
    choice("direction", direction, DIRECTIONS)
    est = get(estimator or EDGE_ESTIMATORS[0], "edges")
    m = EDGE_IG_STEPS if ig_steps is None else ig_steps
    _check_steps(m, "the eap-ig estimators")
    n = clean_tokens.shape[0]
    check_metric_prompts(metric, n)
    check_gradient(metric, "attribution")
    check_edge_needs(model, est)
    bs = batch_size if (batch_size and metric.per_prompt_values) else n
    base_all, src_all = driver.base_and_source(clean_tokens, corrupt_tokens, direction)
    job = eap.edge_job(model, layout, est.name, m, base_all, progress)
    got = driver.run_batches(model, metric, base_all, src_all, bs,
                             lambda b: est.batch(job, b), progress, f"edges {est.name}",
                             edges=True)
    scale = torch.stack(got.scales).mean(0)
    receiver_attn = receiver_attn_passes(
        block_shares(model, clean_tokens.shape[1])[0], layout.n_layers, len(layout.inputs),
        sum(len(job.before[la]) for la in job.recv_layers)) if job.exact_receiver else 0.0
    n_groups = len(job.groups) if est.name == "eap-ig-activations" else 1
    meta = driver.base_meta(model, metric, est.name, n, bs,
                            edge_estimator_passes(est.name, m, n_groups, receiver_attn), t_start)
    meta["write_scale"] = [[[None if v != v else v for v in row] for row in mat]
                           for mat in scale.tolist()]
    if est.ig:
        meta["ig_steps"] = m
    return driver.edge_result(got, metric.per_prompt_values, direction, layout, meta)
