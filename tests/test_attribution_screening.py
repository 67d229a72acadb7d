"""Attribution estimators and screening on planted circuits whose answers are known by construction.

Planted models: a 6-layer Llama (float64, d_model 32, 2 heads of 16) with every weight zero
except the planted ones. Every token embedding carries a large constant ``PAD`` component, so
each RMSNorm divides by an (almost) constant ``rms``: a unit in residual dimension ``j`` reads as
``S = sqrt(d_model) / PAD`` after the norm, and planted weights divide by ``S``. What remains
nonlinear is only what a test plants (a softmax, a SiLU, a product of gate and up), so each
estimator's assumption either holds exactly or fails by a known amount. Rotary embeddings act on
a q/k dimension whose frequency is ~1e-11 per position (``rope_theta`` 1e12): no rotation.

Prompts: ``[BOS, X, 3, 3|5, 3, 3|5, 4, 6]``, clean X = token 1, corrupt X = token 2; the metric is
the logit of token 5 minus the mean logit, read at position 6 (answer position 7).
Exact references come from the exact engine (``ck.patch_heads``), independent of attribution.
"""

from __future__ import annotations

import math

import pytest
import torch
from planted_circuit import blank_llama
from tinymodels import attribution_heads, call, hybrid_heads

import circuitkit as ck
from circuitkit import hooks
from circuitkit.metrics import token_logprob_metric, token_margin_metric
from circuitkit.patching.api import verified_mask
from circuitkit.patching.estimators import attribution
from circuitkit.patching.estimators.attribution import ESTIMATORS

D, N_HEADS, D_HEAD, VOCAB, LAYERS = 32, 2, 16, 16, 6
PAD, ONE, BOS, F, G, U = 0, 9, 10, 11, 12, 13  # residual dimensions; tokens t use dim 1 + t
PAD_SIZE = 1e4
S = math.sqrt(D) / PAD_SIZE
QK = 7  # rotary pair 7 of 8: frequency rope_theta ** (-14 / 16) ~ 3e-11
ANSWER = 5

CLEAN = torch.tensor([[0, 1, 3, 3, 3, 3, 4, 6], [0, 1, 3, 5, 3, 5, 4, 6]])
CORRUPT = CLEAN.clone()
CORRUPT[:, 1] = 2
METRIC = token_margin_metric([[7], [7]], [[ANSWER], [ANSWER]], [[], []])
READ = 6  # the metric reads logits here; a uniform head sees positions 0..6 (7 of them)


def tok(t: int) -> int:
    return 1 + t


def blank(d_mlp: int = 4):
    torch.manual_seed(0)
    model, hf = blank_llama({"model_type": "llama", "vocab_size": VOCAB, "hidden_size": D,
                            "intermediate_size": d_mlp, "num_hidden_layers": LAYERS,
                            "num_attention_heads": N_HEADS, "num_key_value_heads": N_HEADS,
                            "max_position_embeddings": 32, "rope_theta": 1e12,
                            "tie_word_embeddings": False}, dtype=torch.float64)
    with torch.no_grad():
        E = hf.model.embed_tokens.weight
        E[:, PAD] = PAD_SIZE
        E[:, ONE] = 1.0
        for t in range(8):
            E[t, tok(t)] = 1.0
        E[0, BOS] = 1.0
    return model


def _attn(model, layer: int, head: int):
    return model.original_model.model.layers[layer].self_attn, head * D_HEAD


def copy_head(model, layer: int, head: int, read: int, write: int, gain: float) -> None:
    """Uniform causal attention (query 0); value = x[read]; writes ``gain * z`` to ``write``."""
    a, h0 = _attn(model, layer, head)
    with torch.no_grad():
        a.v_proj.weight[h0, read] = 1.0 / S
        a.o_proj.weight[write, h0] = gain


def query_head(model, layer: int, head: int, keys: dict[int, float], beta: float, read: int,
               write: int, gain: float) -> None:
    """Constant query; score of key position j = ``beta * sum_d keys[d] * x_j[d]``; value and
    output as ``copy_head``."""
    a, h0 = _attn(model, layer, head)
    with torch.no_grad():
        a.q_proj.weight[h0 + QK, ONE] = beta / S * math.sqrt(D_HEAD)
        for d, w in keys.items():
            a.k_proj.weight[h0 + QK, d] = w / S
        a.v_proj.weight[h0, read] = 1.0 / S
        a.o_proj.weight[write, h0] = gain


def mlp_neuron(model, layer: int, gate: dict[int, float], up: dict[int, float], write: int,
               gain: float, neuron: int = 0) -> None:
    """``out[write] += gain * silu(sum gate_d x[d]) * (sum up_d x[d])``."""
    mm = model.original_model.model.layers[layer].mlp
    with torch.no_grad():
        for d, w in gate.items():
            mm.gate_proj.weight[neuron, d] = w / S
        for d, w in up.items():
            mm.up_proj.weight[neuron, d] = w / S
        mm.down_proj.weight[write, neuron] = gain


def readout(model, dim: int, gain: float = 1.0) -> None:
    with torch.no_grad():
        model.original_model.lm_head.weight[ANSWER, dim] = gain / S


def effects(model, direction: str, positions: str = "all", **kw) -> tuple[torch.Tensor, ...]:
    """(exact, estimate) effects, metric after patch minus the base metric."""
    ex = ck.patch_heads(model, CLEAN, CORRUPT, METRIC, direction=direction, positions=positions,
                        options=dict(progress=False))
    est = attribution_heads(model, CLEAN, CORRUPT, METRIC, direction=direction,
                            positions=positions, progress=False, **kw)
    base = ex.clean if direction == "noise" else ex.corrupt
    return ex.values - base, est.values - base


# --- failure modes of plain AtP, and what sees them --------------------------------------------

def saturated_model():
    """A = L1H0 copies "token 1 is here" into F; B = L4H0 attends from every position to the
    position with the most F (beta 40: saturated), else to BOS (key 0.8 * BOS), and copies
    "token 1" into U, which the readout turns into the answer logit. Layers 2, 3, 5: empty."""
    model = blank()
    copy_head(model, 1, 0, tok(1), F, 2.0)
    query_head(model, 4, 0, {F: 1.0, BOS: 0.8}, 40.0, tok(1), U, 1.0)
    readout(model, U)
    return model


def test_deep_saturated_attention_missed_by_atp_seen_by_qk_and_by_screening():
    """Noising A moves B's attention off token 1 (clean: saturated on it, p > 0.999), so A's
    exact effect is the whole answer logit; B's softmax gradient is ~0 there, so plain AtP (and
    the block estimator, which is exact only up to A's own MLP) sees < 5% of it. AtP*'s Q/K fix
    recomputes B's softmax for A's write: exact here (1e-6). The default screening,
    ``attribution+exact`` with the automatic budget, verifies A: its calibration round takes the
    cells with the largest patches, and A's error there opens the bound."""
    model = saturated_model()
    _, cache = model.run_with_cache(CLEAN, names_filter=[hooks.pattern(4)])
    assert float(cache[hooks.pattern(4)][:, 0, READ, 1].min()) > 0.999  # premise: saturated
    exact, atp = effects(model, "noise")
    a = (1, 0)
    assert exact[a] < -0.9 and exact[4, 0] < -0.9  # A and B each carry the whole effect
    assert abs(atp[a]) < 0.05 * abs(exact[a])
    _, block = effects(model, "noise", estimator="block")
    assert abs(block[a]) < 0.05 * abs(exact[a])
    _, qk = effects(model, "noise", estimator="qk")
    torch.testing.assert_close(qk, exact, atol=1e-6, rtol=1e-6)
    res = hybrid_heads(model, CLEAN, CORRUPT, METRIC, direction="noise",
                       recall_top=2, exact_when_cheaper=False, progress=False)
    assert res.meta["budget"]["rule"] == "auto" and res.meta["estimator"] == "block"
    assert verified_mask(res)[a] and verified_mask(res)[4, 0]
    assert res.values[a] == pytest.approx(float(exact[a] + res.clean), abs=1e-6)


def cancelling_model(mlp_layer: int):
    """C = L1H0 copies "token 1 is here" into G, read directly as the answer logit; a SiLU
    neuron in layer ``mlp_layer`` reads G and writes -silu(w G) to U (also read as the answer).
    At the clean read position G = 1/7 and w G = -1, where the gain makes the neuron's *linear*
    response cancel the direct path exactly (silu'(-1) w gain = -1); the neuron's actual response
    to removing G is silu(-1) - silu(0) = -0.269 of its gain, 3.7 times the linear one."""
    model = blank()
    copy_head(model, 1, 0, tok(1), G, 1.0)
    readout(model, G)
    g_read, w = 1 / 7, -7.0
    sig = 1 / (1 + math.e)  # sigmoid(-1)
    silu_prime = sig * (1 - (1 - sig))  # d/dx x sigmoid(x) at x = -1
    mlp_neuron(model, mlp_layer, {G: w}, {ONE: 1.0}, U, g_read / silu_prime)
    readout(model, U)
    return model


@pytest.mark.parametrize("all_heads", [False, True], ids=["mlp-per-head", "all-heads-formula"])
def test_own_mlp_cancellation_hides_the_head_from_atp_not_from_block(all_heads, monkeypatch):
    """The SmolLM2 L16H0 mechanism (docs/attribution.md): the linearised MLP of the head's own
    block cancels its write, the exact MLP does not. Plain AtP ~0 (the two linear paths cancel to
    1e-3 of the effect), exact +0.36; "block" runs that MLP exactly and equals exact (1e-6),
    with the MLP called per head or through ``head_mlp``'s all-heads formula."""
    monkeypatch.setattr(attribution, "head_mlp_pays", lambda *a: all_heads)
    model = cancelling_model(mlp_layer=1)
    exact, atp = effects(model, "noise")
    c = (1, 0)
    assert exact[c] > 0.3 and abs(atp[c]) < 1e-3 * exact[c]
    _, block = effects(model, "noise", estimator="block")
    torch.testing.assert_close(block, exact, atol=1e-6, rtol=1e-6)


def test_planted_cancellation_exposed_by_graddrop_and_ig():
    """Two paths of opposite sign: C's direct path and a later (layer 3) SiLU neuron cancel in
    AtP (~0); dropping layer 3 from the backward leaves the direct path, so GradDrop's magnitude
    is nonzero and C is its top cell; IG integrates the neuron's response along the path and
    lands within 1% of exact. ("block" stays at AtP: the neuron is not in C's block.)"""
    model = cancelling_model(mlp_layer=3)
    c = (1, 0)
    exact, atp = effects(model, "noise")
    assert exact[c] > 0.3 and abs(atp[c]) < 1e-3 * exact[c]
    _, gd = effects(model, "noise", estimator="graddrop")
    assert abs(gd[c]) > 50 * abs(atp[c])
    assert int(gd.abs().flatten().argmax()) == c[0] * N_HEADS + c[1]
    _, ig = effects(model, "noise", estimator="ig")
    assert ig[c] == pytest.approx(float(exact[c]), rel=0.01)


# --- each estimator is exact where its assumption holds ----------------------------------------

def linear_model():
    """Heads copy token identity straight into the answer logit (no MLP, no later reader):
    everything downstream of every head is linear (up to the PAD-fixed norms)."""
    model = blank()
    copy_head(model, 1, 0, tok(1), G, 1.0)
    copy_head(model, 2, 1, tok(2), U, -2.0)
    copy_head(model, 4, 0, tok(1), U, 0.5)
    readout(model, G)
    readout(model, U)
    return model


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_every_estimator_is_exact_on_a_linear_downstream(direction):
    """Linear downstream: every estimator must equal exact patching (1e-6), per head and per
    (head, position). GradDrop too: with one path per head each dropped layer leaves either the
    whole estimate or (its own layer) nothing, so its mean magnitude 1/(L-1) sum is |AtP|."""
    model = linear_model()
    for positions in ("all", "each"):
        exact, _ = effects(model, direction, positions)
        assert float(exact.abs().max()) > 0.1  # three heads with nonzero effects
        for estimator in ESTIMATORS:
            kw = dict(estimator=estimator)
            if estimator in ("graddrop", "atp*") and positions == "each":
                continue  # magnitude estimators: checked per head
            _, est = effects(model, direction, positions, **kw)
            torch.testing.assert_close(est, exact, atol=1e-6, rtol=1e-6,
                                       msg=f"{estimator}, {positions}")
    for estimator in ("graddrop", "atp*"):
        _, est = effects(model, direction, "all", estimator=estimator)
        torch.testing.assert_close(est, effects(model, direction)[0], atol=1e-6, rtol=1e-6)


def test_ig_is_exact_on_a_quadratic_downstream():
    """C's output is linear along the embedding path (uniform attention reading token 1) and the
    metric is quadratic in it (a gated neuron in its linear SiLU regime: (40 + 40 G) * 40 G). The
    midpoint rule integrates a linear gradient exactly, so IG equals exact for any number of
    steps (1e-6); AtP misses the quadratic term (by > 5% here) in both directions."""
    model = blank()
    copy_head(model, 1, 0, tok(1), G, 1.0)
    readout(model, G)
    mlp_neuron(model, 3, {ONE: 40.0, G: 40.0}, {G: 40.0}, U, 0.05)
    readout(model, U)
    c = (1, 0)
    for direction in ("noise", "denoise"):
        exact, atp = effects(model, direction)
        assert abs(atp[c] - exact[c]) > 0.05 * abs(exact[c])
        for steps in (1, 3):
            _, ig = effects(model, direction, estimator="ig", ig_steps=steps)
            torch.testing.assert_close(ig, exact, atol=1e-6, rtol=1e-6)


# --- screening with the automatic budget --------------------------------------------------------

@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_automatic_budget_follows_its_rule(direction, tiny_llama):
    """Random 3-layer Llama (12 heads; recall_top 3): verified values are exact; the stop obeys
    the stated rule (every unverified upper bound |e| + k u below tau, the recall_top-th verified
    |exact effect|, unless the budget cap stopped it); and the stated recall holds whenever the
    bound holds. The default of ``patch_heads(method="attribution+exact")`` is this rule with
    estimator "block"."""
    model = tiny_llama
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 64, (4, 12), generator=g)
    corrupt = torch.randint(0, 64, (4, 12), generator=g)
    pos = [5, 8, 11]
    metric = token_logprob_metric([pos] * 4, [clean[i, pos].tolist() for i in range(4)])
    ex = ck.patch_heads(model, clean, corrupt, metric, direction=direction,
                        options=dict(progress=False))
    default = ck.patch_heads(model, clean, corrupt, metric, direction=direction,
                             method="attribution+exact", options=dict(progress=False))
    # 12 heads: the hybrid's floor (two rounds, 8 of 12 cells) plus its screen costs more than
    # every cell exactly, so the entry patches exactly and says why
    assert default.method == "exact" and default.meta["hybrid"]["ran"] == "exact"
    assert default.meta["hybrid"]["passes"] >= default.meta["hybrid"]["exact_passes"]
    torch.testing.assert_close(default.values, ex.values, atol=0, rtol=0)
    res = hybrid_heads(model, clean, corrupt, metric, direction=direction,
                       recall_top=3, max_fraction=0.75, exact_when_cheaper=False,
                       progress=False)
    mask = verified_mask(res)
    budget = res.meta["budget"]
    torch.testing.assert_close(res.values[mask], ex.values[mask], atol=1e-5, rtol=0)
    base = ex.corrupt if direction == "denoise" else ex.clean
    e = torch.tensor(res.meta["attribution_values"]) - base
    # the error unit: write scale times the share of the model downstream of the cell's layer
    L = model.cfg.n_layers
    u = torch.tensor(res.meta["write_scale"]) * ((L - torch.arange(L)) / L)[:, None]
    torch.testing.assert_close(torch.tensor(res.meta["error_unit"]), u.clamp_min(1e-12))
    x = ex.values - base
    tau, k = budget["tau"], budget["error_scale"]
    print(f"{direction}: verified {int(mask.sum())}/12, stopped by {budget['stopped']}, "
          f"k {k:.3g}, tau {tau:.3g}")
    assert tau == pytest.approx(float(x[mask].abs().topk(budget["recall_top"]).values[-1]),
                                abs=1e-5)
    if budget["stopped"] == "bound":
        assert bool(((e.abs() + k * u)[~mask] < tau).all())
    if bool(((x - e).abs() <= k * u)[~mask].all()):
        assert mask.flatten()[x.abs().flatten().topk(budget["recall_top"]).indices].all()
    cost = res.meta["cost"]
    assert cost["total_passes"] == pytest.approx(cost["estimator_passes"] + cost["verify_passes"])
    assert res.meta["n_verified"] == int(mask.sum()) == len(res.meta["verified_cells"])
    frame = res.to_frame()  # the CSV and the printed table say which values are exact
    assert frame["verified"].tolist() == mask.flatten().tolist()
    assert "verified" not in ex.to_frame().columns


def test_options_of_another_method_are_said_to_do_nothing(tiny_llama):
    toks = torch.zeros(1, 4, dtype=torch.long)
    run = lambda **kw: call(ck.patch_heads, tiny_llama, toks, toks,
                            lambda lg: lg[:, -1, 0].mean(), progress=False, **kw)
    for method, kw in (("exact", dict(top_k=3)), ("exact", dict(estimator="block")),
                       ("exact", dict(atp_star=True)), ("attribution", dict(top_k=3)),
                       ("auto", dict(estimator="atp"))):
        with pytest.warns(UserWarning, match=f"does nothing with method='{method}'"):
            run(method=method, **kw)
    with pytest.raises(ValueError, match="estimator"):  # a bad value is an error whatever runs
        run(method="exact", estimator="nonsense")
    # was dropped without a word (attribution+exact checkpoints: tests/test_scale_hybrid.py)
    with pytest.warns(UserWarning, match="is not used: method=.* is not checkpointed"):
        run(method="attribution", checkpoint="unused-folder")


def test_pass_budget_caps_the_verification(tiny_llama):
    """``max_passes``: the automatic rule verifies in its own priority order while the total
    cost (estimator + verification, pass-equivalents) stays within the budget, and says it
    stopped there; with a budget it never reaches it is the unbudgeted run, cell for cell."""
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 64, (4, 12), generator=g)
    corrupt = torch.randint(0, 64, (4, 12), generator=g)
    pos = [5, 8, 11]
    metric = token_logprob_metric([pos] * 4, [clean[i, pos].tolist() for i in range(4)])
    kw = dict(direction="noise", recall_top=3, max_fraction=1.0, exact_when_cheaper=False,
              progress=False)
    free = hybrid_heads(tiny_llama, clean, corrupt, metric, **kw)
    cost = free.meta["cost"]
    assert hybrid_heads(tiny_llama, clean, corrupt, metric, max_passes=1e9, **kw
                        ).meta["verified_cells"] == free.meta["verified_cells"]
    # room for the engine's two cached runs and about three cells of the first layer
    limit = cost["estimator_passes"] + 4 * (2 + 3)
    capped = hybrid_heads(tiny_llama, clean, corrupt, metric, max_passes=limit, **kw)
    spent = capped.meta["cost"]["total_passes"]
    print(f"free: {free.meta['n_verified']} cells, {cost['total_passes']:.1f} pass-eq; "
          f"capped at {limit:.1f}: {capped.meta['n_verified']} cells, {spent:.1f}")
    assert spent <= limit + 1e-9 and capped.meta["budget"]["stopped"] == "passes"
    assert 0 < capped.meta["n_verified"] < free.meta["n_verified"]
    ex = ck.patch_heads(tiny_llama, clean, corrupt, metric, direction="noise",
                        options=dict(progress=False))
    done = verified_mask(capped)
    torch.testing.assert_close(capped.values[done], ex.values[done], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="max_passes"):
        hybrid_heads(tiny_llama, clean, corrupt, metric, max_passes=0, **kw)


def test_estimator_argument_is_checked(tiny_llama):
    toks = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="estimator"):
        attribution_heads(tiny_llama, toks, toks, lambda lg: lg[:, -1, 0].mean(),
                          estimator="bogus", progress=False)
    with pytest.raises(ValueError, match="atp_star"):
        attribution_heads(tiny_llama, toks, toks, lambda lg: lg[:, -1, 0].mean(),
                          estimator="ig", atp_star=True, progress=False)
    with pytest.raises(ValueError, match="ig_steps"):
        attribution_heads(tiny_llama, toks, toks, lambda lg: lg[:, -1, 0].mean(),
                          estimator="ig", ig_steps=0, progress=False)


def test_plan_prices_verified_cells_as_the_run_counts_them(tiny_llama):
    """plan_patch priced a verified cell at half a pass; the run counts (L - l) / L. Verifying
    every cell must cost what the run reports (and its exact part the exact sweep's)."""
    from circuitkit.patching.api import plan_patch

    g = torch.Generator().manual_seed(0)
    clean, corrupt = (torch.randint(0, 64, (3, 6), generator=g) for _ in range(2))
    metric = lambda lg: lg[:, -1, 3]  # noqa: E731
    n_cells = tiny_llama.cfg.n_layers * tiny_llama.cfg.n_heads
    plan = plan_patch(tiny_llama, clean, corrupt, metric, method="attribution+exact",
                      options=dict(top_k=n_cells))
    run = ck.patch_heads(tiny_llama, clean, corrupt, metric, method="attribution+exact",
                         options=dict(top_k=n_cells, progress=False))
    assert plan["pass_equivalents"] == pytest.approx(run.meta["cost"]["total_passes"], rel=1e-9)
    exact = plan_patch(tiny_llama, clean, corrupt, metric, method="exact")
    assert run.meta["cost"]["verify_passes"] == pytest.approx(exact["pass_equivalents"])
