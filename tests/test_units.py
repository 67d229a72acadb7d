"""One entry for every unit: ``ck.patch(model, clean, corrupt, metric, units, ...)`` over
``HeadUnits`` / ``LayerUnits`` / ``EdgeUnits`` equals the ``patch_*`` wrapper bit for bit, the
wrappers go through it, and a bad ``units`` or ``options`` is one line. (The stages every unit
shares, screen-then-verify with checkpoint, resume, Ctrl-C and out-of-memory halving, are run
for heads through ``ck.patch`` and for edges through ``ck.patch_edges`` in
``tests/test_hybrid_units.py``.)"""

from __future__ import annotations

import warnings

import pytest
import torch
from tinymodels import call

import circuitkit as ck
from circuitkit.patching import api
from circuitkit.patching.results import DegenerateBaselineWarning


def margin(logits):  # a plain callable: wrapped once by the entry, whichever road
    return logits[:, -1, 5] - logits[:, -1, 7]


def pair(n=3, seq=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(1, 64, (n, seq), generator=g),
            torch.randint(1, 64, (n, seq), generator=g))


def quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateBaselineWarning)  # random models
        return call(fn, *a, **kw)


def stage_mask(clean):
    mask = torch.zeros(clean.shape, dtype=torch.bool)
    mask[:, 1:3] = True
    return {"early": mask, "last": torch.zeros_like(mask).index_fill_(1, torch.tensor([5]), 1)}


# (wrapper, its keywords, the units, ck.patch's keywords): the same request both ways
CASES = {
    "heads exact": (ck.patch_heads, {}, ck.HeadUnits(), {}),
    "heads each": (ck.patch_heads, dict(positions="each", site="k"),
                   ck.HeadUnits("k", "each"), {}),
    "heads attribution": (ck.patch_heads, dict(method="attribution", estimator="block"),
                          ck.HeadUnits(), dict(method="attribution",
                                               options=ck.MethodOptions(estimator="block"))),
    "heads hybrid": (ck.patch_heads, dict(method="attribution+exact", top_k=3),
                     ck.HeadUnits(), dict(method="attribution+exact", options=dict(top_k=3))),
    "layers": (ck.patch_layers, dict(site="attn_out"), ck.LayerUnits("attn_out"), {}),
    "edges exact": (ck.patch_edges, dict(receivers=["L2H0", "logits"]),
                    ck.EdgeUnits(receivers=["L2H0", "logits"]), {}),
    "edges attribution": (ck.patch_edges, dict(method="attribution", estimator="eap"),
                          ck.EdgeUnits(), dict(method="attribution",
                                               options=dict(estimator="eap"))),
    "edges hybrid": (ck.patch_edges, dict(method="attribution+exact", top_k=4),
                     ck.EdgeUnits(inputs=("q",)), dict(method="attribution+exact",
                                                       options=dict(top_k=4))),
    "paths": (ck.patch_paths, dict(senders=["L0H1", (1, 2)], receivers=["L2H0", (1, 3)],
                                   inputs=("q",)),
              ck.PathUnits(["L0H1", (1, 2)], ["L2H0", (1, 3)], ("q",)), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_patch_equals_the_wrapper_bit_for_bit(tiny_llama, case):
    wrapper, kw, units, patch_kw = CASES[case]
    clean, corrupt = pair()
    if case == "edges hybrid":
        kw = dict(kw, inputs=("q",))
    want = quiet(wrapper, tiny_llama, clean, corrupt, margin, progress=False, **kw)
    got = quiet(ck.patch, tiny_llama, clean, corrupt, margin, units, progress=False, **patch_kw)
    assert type(got) is type(want) and got.method == want.method
    assert torch.equal(got.values.nan_to_num(7.0), want.values.nan_to_num(7.0))
    assert torch.equal(got.per_prompt.nan_to_num(7.0), want.per_prompt.nan_to_num(7.0))
    assert (got.clean, got.corrupt) == (want.clean, want.corrupt)
    if hasattr(units, "positions") and not isinstance(got, ck.EdgeResult):
        assert tuple(got.axes) == units.axes
    if "hybrid" in case:
        assert got.meta["verified_cells"] == want.meta["verified_cells"]


def test_position_groups_through_patch_equal_patch_heads(tiny_llama):
    clean, corrupt = pair()
    groups = stage_mask(clean)
    want = quiet(ck.patch_heads, tiny_llama, clean, corrupt, margin, positions=groups,
                 progress=False)
    got = quiet(ck.patch, tiny_llama, clean, corrupt, margin, ck.HeadUnits(positions=groups),
                progress=False)
    assert torch.equal(got.values, want.values) and got.values.shape[-1] == 2
    assert got.meta["groups_hash"] == want.meta["groups_hash"]
    assert tuple(got.axes) == ("layer", "head", "group")


@pytest.mark.parametrize("wrapper,kind", [(ck.patch_heads, "heads"), (ck.patch_layers, "layers"),
                                          (ck.patch_edges, "edges"), (ck.patch_paths, "paths")])
def test_every_wrapper_goes_through_the_one_entry(tiny_llama, monkeypatch, wrapper, kind):
    seen = []
    real = api.patch

    def spy(*a, **k):
        seen.append(a[4].kind)
        return real(*a, **k)
    monkeypatch.setattr(api, "patch", spy)
    kw = dict(inputs=("q",)) if kind == "paths" else {}  # (tiny_llama: GQA)
    quiet(wrapper, tiny_llama, *pair(), margin, progress=False, **kw)
    assert seen == [kind]


@pytest.mark.parametrize("units", [ck.HeadUnits(), ck.EdgeUnits(inputs=("q",))])
def test_the_entry_checks_the_metric_once(tiny_llama, monkeypatch, units):
    """The hybrid's metric is wrapped and fit for the tokens once at the entry (the head hybrid
    did it twice there, patch_heads then attribution_plus_exact)."""
    calls = []
    real = api.checked_metric
    monkeypatch.setattr(api, "checked_metric",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    quiet(ck.patch, tiny_llama, *pair(), margin, units, method="attribution+exact",
          options=dict(top_k=2), progress=False)
    assert calls == [1]


@pytest.mark.parametrize("bad,match", [
    (42, "units=42: expected ck.HeadUnits"),
    ("neurons", "units='neurons': expected ck.HeadUnits"),
    (ck.PatchResult, "expected ck.HeadUnits"),
])
def test_a_bad_units_argument_is_one_actionable_line(tiny_llama, bad, match):
    with pytest.raises(ValueError, match=match) as e:
        ck.patch(tiny_llama, *pair(), margin, bad)
    assert "\n" not in str(e.value) and "EdgeUnits" in str(e.value)


def test_bad_unit_fields_and_options_are_one_line_each(tiny_llama):
    with pytest.raises(ValueError, match="site") as e:
        ck.HeadUnits(site="mlp_out")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="site"):
        ck.LayerUnits(site="z")
    with pytest.raises(ValueError, match="options=.*expected ck.PatchOptions"):
        ck.patch(tiny_llama, *pair(), margin, "heads", options=dict(topk=3))
    with pytest.raises(ValueError, match="patch_layers is exact only"):
        ck.patch(tiny_llama, *pair(), margin, ck.LayerUnits(), method="attribution")
    with pytest.raises(ValueError, match="method"):
        ck.patch(tiny_llama, *pair(), margin, ck.EdgeUnits(), method="auto")
    with pytest.raises(ValueError, match="plan_patch measures head sweeps"):
        ck.plan_patch(tiny_llama, *pair(), margin, units=ck.EdgeUnits())


def test_an_option_the_method_does_not_use_is_said_once(tiny_llama):
    with pytest.warns(UserWarning, match="top_k does nothing with method='exact'") as got:
        quiet(ck.patch, tiny_llama, *pair(), margin, "heads", options=dict(top_k=3),
              progress=False)
    assert sum("does nothing" in str(w.message) for w in got) == 1


def test_the_hybrids_budget_is_one_option_of_patch(tiny_llama):
    """The automatic budget's knobs (``ck.BudgetRule``, once ``attribution_plus_exact``'s own
    keywords) are one ``PatchOptions`` field: a dict of its fields is taken, a bad value or
    field is one line, another method says it does nothing, and the hybrid uses it."""
    opts = ck.PatchOptions(budget=dict(recall_top=3, max_fraction=1.0))
    assert opts.budget == ck.BudgetRule(recall_top=3, max_fraction=1.0) and opts.given() == [
        "budget"]
    for bad, said in ((dict(recall_top=0), "recall_top"), (dict(quantile=2.0), "quantile"),
                      (dict(recall=3), "expected ck.BudgetRule"), (3, "expected ck.BudgetRule"),
                      (dict(exact_when_cheaper="no"), "exact_when_cheaper")):
        with pytest.raises(ValueError, match=said) as e:
            ck.PatchOptions(budget=bad)
        assert "\n" not in str(e.value)
    with pytest.warns(UserWarning, match="budget does nothing with method='attribution'"):
        quiet(ck.patch_heads, tiny_llama, *pair(), margin, method="attribution",
              budget=dict(recall_top=3), progress=False)
    res = quiet(ck.patch_heads, tiny_llama, *pair(), margin, method="attribution+exact",
                budget=ck.BudgetRule(recall_top=3, max_fraction=1.0, exact_when_cheaper=False),
                progress=False)
    assert res.method == "attribution+exact"
    assert res.meta["budget"]["recall_top"] == 3 and res.meta["budget"]["max_fraction"] == 1.0


def test_units_know_their_plan_from_the_config():
    from circuitkit import models

    arch = models.architecture("icd-teacher")
    heads = ck.HeadUnits().cost_plan(arch, [12] * 4)
    edges = ck.EdgeUnits(inputs=("q",)).cost_plan(arch, [12] * 4)
    assert heads["n_cells"] == arch.n_layers * arch.n_heads
    assert edges["inputs"] == ["q"] and edges["n_edges"] > 0
    assert set(heads["methods"]) >= {"exact", "attribution", "attribution+exact"}


def test_a_checkpoint_of_patch_heads_resumes_through_patch(tiny_llama, tmp_path, monkeypatch):
    """The same sweep identity whichever road wrote it: ``ck.patch`` over ``HeadUnits`` reuses
    every chunk ``patch_heads`` stored (no engine chunk runs) and gives the same values."""
    from circuitkit.patching.exact import ExactEngine

    clean, corrupt = pair()
    want = quiet(ck.patch_heads, tiny_llama, clean, corrupt, margin, checkpoint=tmp_path,
                 batch_size=4, progress=False)
    calls = []
    real = ExactEngine.run_chunk
    monkeypatch.setattr(ExactEngine, "run_chunk",
                        lambda self, chunk: calls.append(chunk) or real(self, chunk))
    got = quiet(ck.patch, tiny_llama, clean, corrupt, margin, ck.HeadUnits(),
                checkpoint=tmp_path, batch_size=4, progress=False)
    assert calls == [] and torch.equal(got.values, want.values)


@pytest.mark.parametrize("case", [c for c in CASES if c != "layers"])
def test_one_result_type_for_every_unit(tiny_llama, case):
    """Every unit's result is a ``PatchResult`` (edges: its subclass ``EdgeResult``), with its
    axes and their labels, and PatchResult's own normalisation, intervals and prompt selection
    (the edges used to reshape themselves into a second object for each of these)."""
    clean, corrupt = pair()
    if case == "paths":
        res = quiet(ck.patch_paths, tiny_llama, clean, corrupt, margin, senders=[(0, 0), (0, 1)],
                    receivers=[(1, 0)], inputs=("q",), positions=stage_mask(clean),
                    progress=False)
        want = dict(sender=["L0H0", "L0H1"], receiver=["L1H0"], group=["early", "last"])
    else:
        wrapper, kw, _, _ = CASES[case]
        if "positions" in kw or case.startswith("heads"):
            kw = dict(kw, positions=stage_mask(clean)) if case == "heads exact" else kw
        res = quiet(wrapper, tiny_llama, clean, corrupt, margin, progress=False, **kw)
        want = dict(group=["early", "last"]) if case == "heads exact" else {}
    assert isinstance(res, ck.PatchResult) and len(res.axes) == res.values.ndim
    if isinstance(res, ck.EdgeResult):
        assert res.axes == ("sender", "receiver", "input")
        assert res.labels == dict(sender=res.sender_names(), receiver=res.receiver_names(),
                                  input=list(res.inputs))
        assert len(res.labels["sender"]) == res.values.shape[0]
    else:
        assert res.labels == want
    norm = quiet(res.normalized)
    ref = (res.values - (res.corrupt if res.direction == "denoise" else res.clean)) / (
        res.clean - res.corrupt)
    if not res.degenerate:
        torch.testing.assert_close(norm, ref, equal_nan=True)
    if res.per_prompt is not None:
        low, high = quiet(res.confidence_interval, n_boot=50)
        assert low.shape == res.values.shape == high.shape
        one = res.select_prompts(torch.tensor([1]))
        assert type(one) is type(res) and torch.allclose(one.values, res.per_prompt[1],
                                                         equal_nan=True)
