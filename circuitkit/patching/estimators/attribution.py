"""Attribution patching: gradient estimates of every head's (and edge's) patching effect, reached
through ``ck.patch(..., method="attribution")`` (or ``"attribution+exact"``'s screen), which
checks every argument once. This module keeps what the units call on checked arguments
(``estimate_heads``, ``_attribution_patch_edges``) and the names other modules import; each
estimator is one entry of ``estimators.registry`` (its per-batch function, cost, needs) run by
``estimators.driver``. What each computes, why, its cost and the evidence: docs/attribution.md
(edges: docs/edges.md); the hybrid: ``hybrid.py``.

A head's activation ``a`` at ``site`` is patched from the *base* run to the *source* run
(denoise: base = corrupt, source = clean; noise: the reverse). Every estimator returns ``values =
metric(base) + delta`` (mean over prompts), comparable with the exact sweep's ``values``:

* ``"atp"`` (Nanda 2023, Syed et al. 2023): ``delta = sum_{pos, d} (a_source - a_base) .
  dm/da_base``;
* ``"block"``: the head's own block exact, the rest linear: ``delta = g_l . [dr + MLP_l(r_mid +
  dr) - MLP_l(r_mid)]``, ``dr = (z_source - z_base) @ W_O[head]``, ``g_l = dm/d resid_post(l)``
  (sites q/k/v/pattern: the head's attention recomputed exactly first);
* ``"qk"`` (AtP*'s Q/K fix, Kramar et al. 2024; ``atp_star=True``): site z ``delta + sum_{l' >
  l} [(P_l'(r_l' + dr) - P_l'(r_l')) . dm/dP_l' - dr . d/dr (P_l'(r) . dm/dP_l')]``; q/k: the
  own pattern's softmax exact; optional exact tail (``exact_tail``);
* ``"graddrop"`` (AtP*'s GradDrop): ``|delta| = 1/(L-1) sum_{l'} |AtP with block l' dropped from
  the backward|``, the sign of the largest term, no per-prompt values; ``"atp*"``: both fixes;
* ``"ig"`` (as EAP-IG, Hanna et al. 2024): ``delta = (a_source - a_base) . mean_k
  dm/da(alpha_k)``, token embeddings interpolated at ``alpha_k = (k + 1/2) / m``.

``meta``: ``pass_equivalents`` (one prompt through the whole model; a backward counts 2),
``seconds`` and ``write_scale`` per cell, the patch's size relative to what it perturbs (site z
``|dr| / |resid_mid|``, ``hooks.resid_mid_of``; q/k/v ``|a_source - a_base| / |a_base|``;
pattern: the row's total variation): the unit of ``attribution+exact``'s error bound. A metric
without per-prompt values repeats its scalar ``m`` per prompt; the objective differentiated is
the sum of per-prompt values, ``n m``, so per-prompt estimates are shares of it and their mean
is ``m + sum_b delta_b`` (such a metric runs all prompts in one batch).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from circuitkit import hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching.estimators import driver, eap
from circuitkit.patching.estimators.block import (  # noqa: F401  (imported from here elsewhere)
    _head_mlp_z,
    _mlp_change,
    _parameters_as,
)
from circuitkit.patching.estimators.common import _head_writes  # noqa: F401
from circuitkit.patching.estimators.costs import head_mlp_pays  # noqa: F401
from circuitkit.patching.estimators.graddrop import _graddrop_combine
from circuitkit.patching.estimators.qk import (  # noqa: F401
    ATP_STAR_SITES,
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
    resolve_estimator,
    screening_estimator,
)
from circuitkit.patching.estimators.rerun import layer_reruns  # noqa: F401
from circuitkit.patching.inputs import (
    DIRECTIONS,
    check_gradient,
    check_metric_prompts,
    choice,
)
from circuitkit.patching.results.patch_result import PatchResult


def estimate_heads(model: Any, clean_tokens: Tensor, corrupt_tokens: Tensor, metric: Any,
                   estimator: str, site: str, positions: str, opts: Any,
                   tail: bool = False) -> PatchResult:
    """Estimate every head's patching effect at ``site`` by ``estimator`` (one of
    ``ESTIMATORS``; module docstring), on arguments ``ck.patch`` checked (``metric`` a
    ``PromptMetric`` fit for the tokens): a ``PatchResult``, method "attribution", ``values =
    metric(base) + delta`` (mean over prompts) ``[n_layers, n_heads]`` (``positions="all"``) or
    ``[n_layers, n_heads, seq]`` ("each"; for "pattern" the query position); ``meta``:
    estimator, pass_equivalents, seconds, write_scale, plan ("qk").

    ``opts`` (``PatchOptions``): ``direction``, ``batch_size`` (prompts per forward/backward;
    None: all; a metric without per-prompt values runs all at once), ``progress`` and
    ``ig_steps`` ("ig"'s interpolation steps ``m``; None: ``IG_STEPS``). ``tail``: with
    "qk"/"atp*" at site z, the last block and the readout exact for each head's direct write
    (``atp_star=True`` without an estimator named). The entry, the hybrid's screen and
    ``auto`` call this, so no check runs twice."""
    t_start = time.perf_counter()
    est = REGISTRY[estimator]
    check_model(model, est, site, clean_tokens)  # (what the estimator needs of the model)
    ig_steps = IG_STEPS if opts.ig_steps is None else opts.ig_steps
    if est.ig:
        _check_steps(ig_steps, "estimator 'ig'")
    tail = bool(est.qk and site == "z" and tail)
    n, seq = clean_tokens.shape
    steps = estimator_plan(hooks.facts(model).n_layers, site, est.qk, tail) if est.qk else None
    bs = opts.batch_size if (opts.batch_size and metric.per_prompt_values) else n
    base_all, src_all = driver.base_and_source(clean_tokens, corrupt_tokens, opts.direction)
    # what every batch shares (``common.Batch.head_args`` reads it)
    job = SimpleNamespace(site=site, positions=positions, steps=steps, tail=tail,
                          ig_steps=ig_steps)
    got = driver.run_batches(model, metric, base_all, src_all, bs,
                             lambda b: est.batch(job, b), opts.progress, "attribution")
    pp = metric.per_prompt_values and est.per_prompt
    if got.terms:  # GradDrop: magnitudes of prompt-mean estimates; no per-prompt values
        mean_terms = torch.cat([t.detach().float().cpu() for t in got.terms]).mean(0)
        delta_mean = _graddrop_combine(mean_terms)
    else:
        delta_mean = got.delta.mean(0)
    meta = driver.base_meta(model, metric, est.name, n, bs, estimator_passes(
        model, est.name, site, positions, seq, ig_steps, tail, batch=bs), t_start)
    meta.update(atp_star=est.qk, exact_tail=tail,
                passes="4 pass-equivalents per prompt (2 forwards + 1 backward, a backward "
                "counting 2)" if est.name == "atp" else f"see estimator {est.name!r}",
                write_scale=torch.cat(got.scales).mean(0).tolist())
    if est.ig:
        meta["ig_steps"] = ig_steps
    if steps is not None:
        meta["plan"] = [dict(layer=st.layer, own=st.own, downstream_qk=list(st.downstream_qk),
                             tail_correction=st.tail_correction) for st in steps]
    return driver.head_result(got, delta_mean, pp, opts.direction, site, positions, meta)


def _check_steps(ig_steps: Any, of: str) -> None:
    if isinstance(ig_steps, bool) or not isinstance(ig_steps, int) or ig_steps < 1:
        raise ValueError(f"ig_steps={ig_steps!r}: expected a positive integer (interpolation "
                         f"steps of {of}).")


def _attribution_patch_edges(model: Any, clean_tokens: Tensor, corrupt_tokens: Tensor,
                             metric: PromptMetric, layout: Any, opts: Any) -> Any:
    """Estimate every edge of ``layout`` (``sweep.EdgeLayout``) by ``opts.estimator`` (default
    "eap"; see ``estimators/eap.py``, docs/edges.md): ``ck.patch_edges(...,
    method="attribution")``'s estimate, on arguments it checked. An ``EdgeResult`` with
    ``method="attribution"``: ``values = metric(base) + delta`` (mean over prompts), ``meta``:
    estimator, ig_steps, pass_equivalents, seconds, write_scale (``|delta_s| / |x_r|``, mean
    over prompts and positions, per edge; None where no edge). ``opts`` (``PatchOptions``):
    direction, estimator, ig_steps, batch_size, progress; the direction, the estimator, its
    steps and the metric's prompts and gradient are checked again here, before any work."""
    direction, estimator, ig_steps, batch_size, progress = (
        opts.direction, opts.estimator, opts.ig_steps, opts.batch_size, opts.progress)
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
    meta = driver.base_meta(model, metric, est.name, n, bs, edge_estimator_passes(
        model, layout, est.name, m, clean_tokens.shape[1]), t_start)
    meta["write_scale"] = [[[None if v != v else v for v in row] for row in mat]
                           for mat in scale.tolist()]
    if est.ig:
        meta["ig_steps"] = m
    return driver.edge_result(got, metric.per_prompt_values, direction, layout, meta)
