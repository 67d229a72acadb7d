"""The estimator registry: complete (every estimator the docs name is one entry, and nothing
else chooses estimators), one entry is all an estimator needs, and every entry's cost is what
the estimate reports and what the plans without weights price."""

from __future__ import annotations

import pytest
import torch
from tinymodels import TINY_LLAMA, attribution_heads

import circuitkit as ck
from circuitkit import models
from circuitkit.patching import api, cost
from circuitkit.patching.estimators import attribution, registry
from circuitkit.patching.estimators.common import BatchOut, _plain_run
from circuitkit.patching.estimators.costs import CostShape

HEADS = ("atp", "block", "qk", "graddrop", "atp*", "ig")
EDGES = ("eap", "eap-ig-inputs", "eap-ig-activations", "eap*")


def test_every_estimator_is_one_entry():
    assert registry.ESTIMATORS == attribution.ESTIMATORS == HEADS
    assert registry.EDGE_ESTIMATORS == attribution.EDGE_ESTIMATORS == EDGES
    assert list(registry.REGISTRY) == [*HEADS, *EDGES]
    for name, e in registry.REGISTRY.items():
        assert e.name == name and e.units in ("heads", "edges") and e.summary
        assert callable(e.batch) and callable(e.passes)
        assert set(e.needs) <= set(registry.NEEDS), name
        assert e.passes(CostShape(4, 4, 4, "z", 0.2, 0.6, ig_steps=3)) >= 4.0 or e.ig, name
    assert registry.SCREENING_ESTIMATOR in HEADS and registry.EDGE_SCREENING_ESTIMATOR in EDGES
    # the refusals a need stands for are one line each
    assert all("\n" not in msg for msg in registry.NEEDS.values())


def prompts(model, n=4, seq=8):
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(1, model.cfg.d_vocab, (n, seq), generator=g)
    corrupt = clean.clone()
    corrupt[:, 1:4] = torch.randint(1, model.cfg.d_vocab, (n, 3), generator=g)

    def metric(logits):
        return logits[:, -1].log_softmax(-1)[torch.arange(n), clean[:, -1]]

    return clean, corrupt, metric


def test_one_entry_is_a_new_estimator(tiny_llama, monkeypatch):
    """An entry registered at run time is estimated by the one driver (batches, stashes, the
    finite check, meta) with nothing else added."""
    def zero(job, b):  # the base and source metrics (the stashes), no effect anywhere
        _plain_run(b.model, b.base, b.stash_base, [])
        _plain_run(b.model, b.src, b.stash_src, [])
        f = ck.hooks.facts(b.model)
        shape = (b.base.shape[0], f.n_layers, f.n_heads)
        return BatchOut(torch.zeros(shape), torch.ones(shape))

    entry = registry.Estimator("zero", "heads", zero, lambda c: 2.0, "nothing moves")
    monkeypatch.setitem(registry.REGISTRY, "zero", entry)
    clean, corrupt, metric = prompts(tiny_llama)
    res = attribution_heads(tiny_llama, clean, corrupt, metric, estimator="zero", batch_size=3,
                            progress=False)
    assert torch.equal(res.values, torch.full_like(res.values, float(res.corrupt)))
    assert res.meta["estimator"] == "zero" and res.meta["pass_equivalents"] == 2.0 * 4
    assert res.meta["write_scale"] == torch.ones(3, 4).tolist()
    with pytest.raises(ValueError, match="estimator"):
        attribution_heads(tiny_llama, clean, corrupt, metric, estimator="none-such",
                          progress=False)


def test_entry_costs_are_what_estimates_report_and_plans_price(tiny_llama):
    """Per estimator: ``meta["pass_equivalents"]`` of a real estimate equals ``n`` times its
    entry's ``passes``, and ``cost.sweep_plan`` / ``cost.edge_plan`` (config only, no weights)
    price the same figure for the same shape."""
    n, seq = 4, 8
    clean, corrupt, metric = prompts(tiny_llama, n, seq)
    arch = models.architecture_from_config(dict(TINY_LLAMA), name="tiny")
    sp = cost.sweep_plan(arch, [seq] * n)
    for est in HEADS:
        res = attribution_heads(tiny_llama, clean, corrupt, metric, estimator=est,
                                progress=False)
        per = registry.estimator_passes(tiny_llama, est, "z", "all", seq, batch=n)
        assert res.meta["pass_equivalents"] == n * per, est
    assert sp["methods"]["attribution"]["pass_equivalents"] == n * registry.estimator_passes(
        tiny_llama, "atp", "z", "all", seq)
    # plans price the block screen per head (no batch known): the same formula without a batch
    assert sp["methods"]["attribution+exact"]["screening_passes"] == pytest.approx(
        n * registry.estimator_passes(tiny_llama, "block", "z", "all", seq), rel=1e-12)
    layout = api.edge_layout(tiny_llama)
    ep = cost.edge_plan(arch, [seq] * n, layout)
    for est in EDGES:
        res = ck.patch_edges(tiny_llama, clean, corrupt, metric, method="attribution",
                             options=dict(estimator=est, progress=False))
        assert ep["methods"][est]["pass_equivalents"] == pytest.approx(
            res.meta["pass_equivalents"], rel=1e-12), est


def test_edges_check_the_metric_gradient_before_any_batch(tiny_gpt2, monkeypatch):
    """Both drivers' entry points check their arguments: a metric without a gradient is refused
    before the first batch for edges too (it was found inside the first backward)."""
    import dataclasses

    def boom(job, b):
        raise AssertionError("a batch ran")

    monkeypatch.setitem(registry.REGISTRY, "eap",
                        dataclasses.replace(registry.REGISTRY["eap"], batch=boom))
    clean, corrupt, _ = prompts(tiny_gpt2)
    with pytest.raises(ValueError, match="carries no gradient"):
        ck.patch_edges(tiny_gpt2, clean, corrupt, lambda logits: logits[:, -1].argmax(-1).float(),
                       method="attribution", options=dict(estimator="eap", progress=False))
    with pytest.raises(ValueError, match="direction"):
        ck.patch_edges(tiny_gpt2, clean, corrupt, lambda logits: logits[:, -1, 0],
                       direction="sideways", method="attribution", options=dict(progress=False))
