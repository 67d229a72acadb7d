"""One price: ``cost.price`` is what every route calls (the CLI's --plan through ``sweep_plan`` /
``edge_plan`` / ``path_plan``, ``plan_patch``, the hybrid's budget, ``method="auto"``), its
formulas checked by hand, and the routes agree where they price the same sweep."""

from __future__ import annotations

import inspect

import pytest
import torch
from tinymodels import TINY_LLAMA

import circuitkit as ck
from circuitkit import models
from circuitkit.patching import api, auto, cost, hybrid


def test_price_by_hand():
    # 3 prompts, 8 cells whose shares sum to 3.0, 2 per round, the screen 30 passes in all
    w = cost.Work(3, n_cells=8, shares=3.0, per_round=2, read_share=0.5,
                  per_prompt={"atp": 4.0}, screen=30.0, n_params=1000)
    p = cost.price(w)
    assert p["passes"] == {"exact": 3 * 3.0 * 0.5 + 2 * 3, "atp": 12.0}
    h = p["hybrid"]  # floor: 2 rounds of 2, then rounds until 10 (all 8): capped at 4 (50%)
    assert (h["cells"], h["cells_max"]) == (4, 4)
    assert h["passes"] == h["passes_max"] == 30.0 + 3 * (4 * 3.0 / 8 + 2)
    assert h["exact_passes"] == p["passes"]["exact"] and h["screen_passes"] == 30.0
    assert h["runs"] == "exact"  # the automatic budget costs more than the exact sweep's 10.5
    assert cost.price(w, cost.Budget(top_k=1))["hybrid"]["runs"] == "attribution+exact"
    capped = cost.price(w, cost.Budget(max_passes=31.0))["hybrid"]
    assert capped["passes"] == 31.0 and capped["runs"] == "attribution+exact"
    assert cost.price(w, cost.Budget(max_passes=1.0))["hybrid"]["passes"] == 30.0  # the screen
    assert p["auto"] == dict(chose="exact", exact_flops_per_token=2.0 * 1000 * 3.0,
                             threshold=cost.AUTO_EXACT_MAX_FLOPS_PER_TOKEN)
    # a chunk-measured suffix replaces the cells' sum; no screen, no n_params: no rows for them
    q = cost.price(cost.Work(3, suffix=7.0, cached=5))
    assert q == dict(passes={"exact": 7.0 + 5 * 3}, hybrid=None, auto=None)


def prompts(n=3, seq=6):
    g = torch.Generator().manual_seed(0)
    clean, corrupt = (torch.randint(0, 64, (n, seq), generator=g) for _ in range(2))
    return clean, corrupt, lambda lg: lg[:, -1, 3]


def test_every_route_calls_the_one_price(tiny_llama, monkeypatch):
    calls: list[str] = []
    real = cost.price

    def counted(work, budget=None):
        calls.append("hybrid" if work.screen is not None else "auto"
                     if work.n_params is not None else "exact")
        return real(work, budget)

    monkeypatch.setattr(cost, "price", counted)
    arch = models.architecture("icd-teacher")
    routes = {
        "sweep_plan": lambda: cost.sweep_plan(arch, [12] * 4),
        "edge_plan": lambda: ck.EdgeUnits(inputs=("q",)).cost_plan(arch, [12] * 4),
        "path_plan": lambda: ck.PathUnits(["L0H0"], ["L1H0"], "q").cost_plan(arch, [12] * 4),
        "plan_patch": lambda: [api.plan_patch(tiny_llama, *prompts(), method=m, options=dict(
            top_k=2)) for m in ("exact", "attribution", "attribution+exact")],
        "auto.choice": lambda: auto.choice(tiny_llama, 6, "z", "all"),
        "the hybrid's budget": lambda: ck.patch_heads(
            tiny_llama, *prompts(), method="attribution+exact",
            options=dict(top_k=2, progress=False)),
    }
    for name, route in routes.items():
        calls.clear()
        route()
        assert calls, name


def test_the_routes_agree_on_one_sweep(tiny_llama):
    """The plan and the run price the hybrid the same (``plan_patch``'s ``hybrid`` is the run's
    prediction), and the config and the loaded model give ``auto`` the same FLOPs per
    parameter."""
    clean, corrupt, metric = prompts()
    for top_k in (None, 2):
        plan = api.plan_patch(tiny_llama, clean, corrupt, metric, method="attribution+exact",
                              options=dict(top_k=top_k))
        run = ck.patch_heads(tiny_llama, clean, corrupt, metric, method="attribution+exact",
                             options=dict(top_k=top_k, progress=False))
        said = {k: v for k, v in run.meta["hybrid"].items() if k not in ("ran", "why",
                                                                          "summary")}
        assert plan["hybrid"] == said, top_k
        assert plan["method"] == run.method
    arch = models.architecture_from_config(dict(TINY_LLAMA), name="tiny")
    for positions in ("all", "each"):
        from_config = cost.sweep_plan(arch, [6] * 3, positions=positions)
        from_model = auto.choice(tiny_llama, 6, "z", positions)
        assert from_config["exact_flops_per_token"] / arch.n_params == pytest.approx(
            from_model["exact_flops_per_token"] / from_model["n_params"], rel=1e-12)
        assert from_config["auto"] == from_model["chose"]


def test_the_pricing_functions_take_at_most_ten_parameters():
    for f in (cost.sweep_plan, cost.edge_plan, cost.path_plan, cost.basis, cost.price,
              cost.hybrid_cells, hybrid.budget_rule, hybrid.screen_then_verify, api.plan_patch):
        assert len(inspect.signature(f).parameters) <= 10, f.__name__
