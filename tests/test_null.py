"""The validation null can fail: planted models with known head effects through the code
``validate_heads`` runs (``random_head_sets`` -> ``ExactEngine.run_head_sets`` ->
``effect_stats``).

Planted model (Llama, 2 layers x 16 heads, q = k = 0 so every head attends uniformly): each head
reads token X (clean; Y in the corrupt run) at position 2 and writes ``w_h`` times it into the
dimension the metric's logit reads, so a set's noising effect is ``-sum_h w_h / len`` up to the
final RMSNorm (the residual's norm is dominated by a constant dimension: effects are nearly
additive). Layer-0 heads are strong (``w ~ 1``), layer-1 heads weak (``w ~ 0.05``): a set's
effect is set by how many layer-0 heads it holds, as on the teacher (issue 34, item 6).
"""

from __future__ import annotations

import pytest
import torch

N_LAYERS, N_HEADS, DH, D = 2, 16, 4, 64
X, Y, T, CONST, OUT = 3, 4, 5, 40, 41
N_RANDOM = 1000  # the default of validate_heads


def _model(weights):
    from planted_circuit import blank_llama

    model, hf = blank_llama({"model_type": "llama", "vocab_size": 16, "hidden_size": D,
                             "intermediate_size": 4, "num_hidden_layers": N_LAYERS,
                             "num_attention_heads": N_HEADS, "num_key_value_heads": N_HEADS,
                             "head_dim": DH, "max_position_embeddings": 32, "rope_theta": 1e12,
                             "tie_word_embeddings": False, "seed": 0}, n_ids=16)
    with torch.no_grad():
        emb = hf.model.embed_tokens.weight
        emb[:, CONST] = 4.0  # dominates every RMSNorm scale
        for la in range(N_LAYERS):
            attn = hf.model.layers[la].self_attn
            for h in range(N_HEADS):
                attn.v_proj.weight[h * DH, X] = 1.0
                attn.o_proj.weight[OUT, h * DH] = float(weights[la, h])
        hf.lm_head.weight[T, OUT] = 20.0
    return model


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.empty(N_LAYERS, N_HEADS)
    w[0] = 1.0 + 0.3 * torch.rand(N_HEADS, generator=g)
    w[1] = 0.05 * torch.rand(N_HEADS, generator=g)
    return w


def _null(model, top, pools, direction="noise"):
    """Per pool: ``effect_stats`` of ``top`` against ``N_RANDOM`` random sets of that pool."""
    from circuitkit.experiments.validation import effect_stats, random_head_sets
    from circuitkit.metrics import as_metric
    from circuitkit.patching.exact import ExactEngine
    from circuitkit.patching.sweep import Sweep

    g = torch.Generator().manual_seed(0)
    clean = torch.randint(6, 16, (12, 8), generator=g)
    clean[:, 2] = X
    corrupt = clean.clone()
    corrupt[:, 2] = Y
    n, seq = clean.shape
    metric = as_metric(lambda logits: logits[:, -1, T], n, seq, 16)
    engine = ExactEngine(model, clean, corrupt, metric,
                         Sweep("heads", "z", direction, "all", N_LAYERS, N_HEADS, 1, n, seq, True))
    out = {}
    for pool in pools:
        sets = random_head_sets(top, N_HEADS, N_RANDOM, seed=1, n_layers=N_LAYERS, pool=pool)
        runs = engine.run_head_sets([[], top, *sets])[0]
        out[pool] = effect_stats(runs[0], runs[1], runs[2:], n_boot=200, seed=0)
    return out


def test_top_set_no_better_than_random_under_the_stratified_null():
    """The top set: the four layer-0 heads of median weight. Against sets of the same layers'
    heads it is ordinary (p >= 0.2); against all-layers sets, mostly of weak layer-1 heads,
    it looks special (p < 0.05): the confound the stratified null removes."""
    w = _weights(0)
    order = torch.argsort(w[0]).tolist()
    top = sorted((0, h) for h in order[6:10])  # ranks 7..10 of 16: the middle of the layer
    got = _null(_model(w), top, ("layer-stratified", "all-layers"))
    strat, every = got["layer-stratified"], got["all-layers"]
    assert strat["top_effect"] < 0  # noising X's readers lowers the logit
    assert strat["p_value"] >= 0.2, strat
    assert every["p_value"] < 0.05, every
    assert strat["p_low"] <= strat["p_value"] <= strat["p_high"]


def test_truly_special_top_set_beats_the_stratified_null():
    """Four layer-0 heads with three times any other head's weight: no random set of four
    layer-0 heads comes near, so p is the floor 1/(n+1) < 0.01 and the Monte Carlo interval's
    upper end (Clopper-Pearson, 0 hits of ``N_RANDOM``) stays below 0.05."""
    w = _weights(1)
    top = [(0, 2), (0, 7), (0, 11), (0, 13)]  # C(16, 4) - 1 = 1819 other sets
    for _, h in top:
        w[0, h] = 4.0
    got = _null(_model(w), top, ("layer-stratified",))["layer-stratified"]
    assert got["p_value"] == pytest.approx(1 / (N_RANDOM + 1))
    assert got["p_value"] < 0.01
    assert got["p_high"] < 0.05


def test_validate_default_draws_1000_sets():
    import inspect

    from circuitkit.experiments.validation import validate_heads

    assert inspect.signature(validate_heads).parameters["n_random"].default >= 1000
