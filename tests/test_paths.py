"""``ck.patch_paths``: path patching through MLPs and later positions (patching/paths.py).

Checked against a hand-written path patch on per-head residual copies (``use_split_qkv_input``:
a different hook than the q/k/v outputs ``patch_paths`` edits), and on a planted model whose
only route from sender to receiver is the MLP between them (the direct q/k/v edge is 0)."""

from __future__ import annotations

import pytest
import torch

from circuitkit import hooks

TOL = 1e-5  # float32 forwards of the same values in another order of hooks


def _random_llama():
    from tinymodels import make_model

    return make_model({"model_type": "llama", "vocab_size": 32, "hidden_size": 32,
                       "intermediate_size": 48, "num_hidden_layers": 3,
                       "num_attention_heads": 4, "num_key_value_heads": 4,
                       "max_position_embeddings": 32, "seed": 3})


def _tokens(n=6, seq=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, 32, (n, seq), generator=g)
    corrupt = clean.clone()
    corrupt[:, 2] = torch.randint(1, 32, (n,), generator=g)
    return clean, corrupt


def _metric(logits):
    return logits[:, -1, 5] - logits[:, -1, 7]


def _hand_path(model, src_t, base_t, sender, receiver, mask=None):
    """Path sender -> receiver by plain ``run_with_hooks`` on split q/k/v inputs: the sender's
    source z in the base run, the receiver's three residual copies recorded; then the base run
    with those copies (at ``mask``) for the receiver only. Mean metric."""
    from circuitkit.patching.shortcuts import split_qkv_inputs

    (ls, hs), (lr, hr) = sender, receiver
    names = [hooks.q_input(lr), hooks.k_input(lr), hooks.v_input(lr)]
    with torch.no_grad(), split_qkv_inputs(model):
        _, cache = model.run_with_cache(src_t, names_filter=[hooks.z(ls)])
        src = cache[hooks.z(ls)]
        got = {}

        def put_z(t, hook):
            t = t.clone()
            t[:, :, hs] = src[:, :, hs]
            return t

        def keep(name):
            def fn(t, hook):
                got[name] = t.clone()
            return fn

        model.run_with_hooks(base_t, fwd_hooks=[(hooks.z(ls), put_z)]
                             + [(n, keep(n)) for n in names])

        def put(name):
            def fn(t, hook):
                t = t.clone()
                new = got[name][:, :, hr]
                if mask is not None:
                    new = torch.where(mask[..., None], new, t[:, :, hr])
                t[:, :, hr] = new
                return t
            return fn

        logits = model.run_with_hooks(base_t, fwd_hooks=[(n, put(n)) for n in names])
    return float(_metric(logits).mean())


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_paths_match_hand_written_reference(direction):
    import circuitkit as ck

    model = _random_llama()
    clean, corrupt = _tokens()
    mask = torch.zeros_like(clean, dtype=torch.bool)
    mask[:, 4:7] = True  # a later-position group: the route through those residuals only
    senders, receivers = [(0, 1), (1, 2)], [(1, 0), (2, 3)]
    res = ck.patch_paths(model, clean, corrupt, _metric, senders, receivers,
                         positions={"all": torch.ones_like(mask), "mid": mask},
                         direction=direction,
                         options=dict(batch_size=4))  # 6 prompts: two forwards each
    src_t, base_t = (clean, corrupt) if direction == "denoise" else (corrupt, clean)
    assert tuple(res.values.shape) == (2, 2, 2) and res.axes == ("sender", "receiver", "group")
    for si, s in enumerate(senders):
        for ri, r in enumerate(receivers):
            if r[0] <= s[0]:
                assert torch.isnan(res.values[si, ri]).all()
                continue
            for gi, m in enumerate((None, mask)):
                want = _hand_path(model, src_t, base_t, s, r, m)
                assert abs(float(res.values[si, ri, gi]) - want) < TOL * max(1, abs(want))
    # the coverage denominator: each sender's node effect is the exact head sweep's
    heads = ck.patch_heads(model, clean, corrupt, _metric, direction=direction,
                           options=dict(progress=False))
    base = heads.corrupt if direction == "denoise" else heads.clean
    for s in senders:
        want = float(heads.values[s]) - base
        assert abs(res.meta["node"][hooks.head_name(*s)] - want) < TOL
    with torch.no_grad():
        assert abs(res.corrupt - float(_metric(model(corrupt)).mean())) < TOL


def _route_model():
    """Sender L0H0 -> MLP 0 -> receiver L1H0, and no direct route.

    Tokens one-hot in dims 0..7, dim 11 a constant 1. Clean prompts hold token X = 3 where
    corrupt ones hold Y = 4. L0H0 attends uniformly (q = k = 0), reads X into dim 10 and Y into
    dim 9: the swap keeps the residual's norm, so RMSNorm scales are unchanged. MLP 0 writes
    ``silu(5 x10) x11`` into dim 12; L1H0 attends uniformly, reads dim 12 only and writes dim 13;
    the logit of token 5 reads dim 13. The receiver's inputs never read what the sender writes
    (dims 9, 10): its direct edge is 0; the path through the MLP is not."""
    from planted_circuit import blank_llama

    model, hf = blank_llama({"model_type": "llama", "vocab_size": 8, "hidden_size": 16,
                            "intermediate_size": 4, "num_hidden_layers": 2,
                            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 4,
                            "max_position_embeddings": 32, "rope_theta": 1e12,
                            "tie_word_embeddings": False, "seed": 0}, n_ids=8)
    with torch.no_grad():
        emb = hf.model.embed_tokens.weight
        emb[:, 11] = 1.0
        a0, a1 = hf.model.layers[0].self_attn, hf.model.layers[1].self_attn
        a0.v_proj.weight[0, 3] = a0.v_proj.weight[1, 4] = 1.0
        a0.o_proj.weight[10, 0] = a0.o_proj.weight[9, 1] = 1.0
        mlp = hf.model.layers[0].mlp
        mlp.gate_proj.weight[0, 10] = 5.0
        mlp.up_proj.weight[0, 11] = 1.0
        mlp.down_proj.weight[12, 0] = 1.0
        a1.v_proj.weight[0, 12] = 1.0
        a1.o_proj.weight[13, 0] = 1.0
        hf.lm_head.weight[5, 13] = 10.0
    return model


def test_path_through_mlp_found_where_direct_edge_is_zero():
    import circuitkit as ck

    model = _route_model()
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(5, 8, (8, 7), generator=g)
    clean[:, 2] = 3
    corrupt = clean.clone()
    corrupt[:, 2] = 4

    def metric(logits):
        return logits[:, -1, 5]

    res = ck.patch_paths(model, clean, corrupt, metric, [(0, 0)], [(1, 0)], inputs=("v",))
    gap = res.clean - res.corrupt
    assert gap > 0.5  # the planted route moves the metric
    path = float(res.values[0, 0]) - res.corrupt
    node = res.meta["node"]["L0H0"]
    # the sender run is the clean run wherever anything reads it: its node effect is the gap
    assert node == pytest.approx(gap, rel=1e-4)
    # the route through the MLP carries it (more than the gap: in the path run the MLP's own
    # write stays corrupt, so the final RMSNorm scale is smaller than in the clean run)
    assert path > 0.5 * gap
    assert res.meta["coverage"]["all"]["L0H0"] == pytest.approx(path / node, rel=1e-6)
    edges = ck.patch_edges(model, clean, corrupt, metric, senders=[(0, 0)], receivers=[(1, 0)],
                           inputs=("v",), options=dict(progress=False))
    direct = float(edges.effect()[0, 0, 0])
    assert abs(direct) < 1e-4 * gap  # no direct write reaches the receiver's value input
    from circuitkit.patching.paths import edge_coverage

    cov = edge_coverage(model, clean, corrupt, metric, edges)
    assert abs(cov["L0H0"]) < 1e-4 and abs(cov["overall"]) < 1e-4


def test_bad_input_is_one_line():
    import circuitkit as ck

    model = _random_llama()
    clean, corrupt = _tokens()
    with pytest.raises(ValueError, match="no receiver is in a layer after"):
        ck.patch_paths(model, clean, corrupt, _metric, [(2, 0)], [(1, 0)])
    with pytest.raises(ValueError, match="inputs="):
        ck.patch_paths(model, clean, corrupt, _metric, [(0, 0)], [(1, 0)], inputs=("x",))
    with pytest.raises(ValueError, match="within the model"):
        ck.patch_paths(model, clean, corrupt, _metric, [(0, 9)], [(1, 0)])


@pytest.mark.filterwarnings("ignore::circuitkit.patching.results.patch_result.DegenerateBaselineWarning")
def test_a_path_result_saves_and_loads(tmp_path):
    import circuitkit as ck
    from circuitkit.patching.results import PatchResult

    model = _random_llama()
    clean, corrupt = _tokens()
    res = ck.patch_paths(model, clean, corrupt, _metric, [(1, 1)], [(0, 0), (2, 3)],
                         options=dict(batch_size=6))  # L0H0 is not after L1H1: a NaN cell
    assert torch.isnan(res.values[0, 0]) and not torch.isnan(res.values[0, 1])
    res.save(tmp_path / "paths")
    back = PatchResult.load(tmp_path / "paths")
    assert back.axes == res.axes == ("sender", "receiver")
    assert back.meta["coverage"] == res.meta["coverage"]
    assert torch.equal(torch.isnan(back.values), torch.isnan(res.values))
    assert torch.allclose(torch.nan_to_num(back.values), torch.nan_to_num(res.values))


@pytest.mark.parametrize("method", ["exact", "attribution"])
def test_every_edge_result_states_its_senders_coverage(method):
    import circuitkit as ck

    model = _random_llama()
    clean, corrupt = _tokens()
    edges = ck.patch_edges(model, clean, corrupt, _metric, senders=[(0, 1), (1, 2)],
                           receivers=[(2, 0), (2, 3)], method=method, options=dict(progress=False))
    cov = edges.meta["coverage"]
    heads = ck.patch_heads(model, clean, corrupt, _metric, options=dict(progress=False))
    node = {s: float(heads.values[s]) - heads.corrupt for s in [(0, 1), (1, 2)]}
    eff = edges.effect()
    for si, s in enumerate(edges.senders):  # the share, recomputed from both results
        want = float(eff[si].nansum()) / node[tuple(s)]
        assert abs(cov[hooks.head_name(*s)] - want) < 1e-4 * max(1, abs(want))
    overall = float(eff.nansum()) / sum(node.values())
    assert abs(cov["overall"] - overall) < 1e-4 * max(1, abs(overall))


def test_a_path_sweep_takes_the_one_road(tmp_path, monkeypatch):
    """Paths go through ``ck.patch`` (``PathUnits``) like every unit: the entry's metric check,
    the exact orchestration's checkpoint (a stopped sweep resumes to the same numbers; another
    request in the same folder is refused), the cost plan, and one-line refusals of methods
    that do not apply."""
    import circuitkit as ck
    from circuitkit.models import architecture
    from circuitkit.patching.exact.paths import PathEngine

    model = _random_llama()
    clean, corrupt = _tokens(n=8)
    units = ck.PathUnits([(0, 1), "L1H2"], [(1, 0), (2, 3), (2, 1)],
                         positions={"all": torch.ones_like(clean, dtype=torch.bool)})
    kw = dict(options=dict(progress=False, batch_size=4, checkpoint=tmp_path / "ck"))
    calls, real = [], PathEngine.run_chunk

    def failing(self, chunk):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, chunk)

    monkeypatch.setattr(PathEngine, "run_chunk", failing)
    with pytest.raises(KeyboardInterrupt):
        ck.patch(model, clean, corrupt, _metric, units, **kw)
    monkeypatch.setattr(PathEngine, "run_chunk", real)
    assert len(sorted((tmp_path / "ck").glob("chunk_*.safetensors"))) >= 2
    resumed = ck.patch(model, clean, corrupt, _metric, units, **kw)
    fresh = ck.patch_paths(model, clean, corrupt, _metric, [(0, 1), (1, 2)],
                           [(1, 0), (2, 3), (2, 1)], positions=units.positions,
                           options=dict(batch_size=4, progress=False))
    assert torch.equal(resumed.values.nan_to_num(), fresh.values.nan_to_num())
    assert resumed.meta["coverage"] == fresh.meta["coverage"]
    with pytest.raises(ValueError, match="different sweep"):
        ck.patch(model, clean, corrupt, _metric, ck.PathUnits([(0, 1)], [(1, 0)]), **kw)
    with pytest.raises(ValueError, match="paths are patched exactly only"):
        ck.patch(model, clean, corrupt, _metric, units, method="attribution")
    with pytest.raises(ValueError, match="padded with pad token id"):  # the entry checks tokens
        padded = clean.clone()
        padded[:, -1] = model.cfg.d_vocab  # the built tokenizer's pad id
        ck.patch(model, padded, corrupt, _metric, units, options=dict(progress=False))
    arch = architecture("llama3-8b")  # priced from the shipped config, no weights

    def price(units):  # the exact row of the units' plan (cost.path_plan): exact only
        methods = units.cost_plan(arch, [64] * 16)["methods"]
        assert list(methods) == ["exact"]
        return methods["exact"]

    few = price(ck.PathUnits(["L0H0"], ["L8H0"], "q"))
    more = price(ck.PathUnits(["L0H0", "L4H1"], ["L8H0", "L9H2"], "q"))
    assert 0 < few["pass_equivalents"] < more["pass_equivalents"]
    mask = torch.zeros(16, 64, dtype=torch.bool)
    mask[:, 3] = True
    one = price(ck.PathUnits(["L0H0"], ["L8H0"], "q", positions=mask))
    two = price(ck.PathUnits(["L0H0"], ["L8H0"], "q", positions={"a": mask, "b": mask}))
    assert one["pass_equivalents"] == few["pass_equivalents"]  # one mask: one group
    assert two["pass_equivalents"] > one["pass_equivalents"]


@pytest.mark.filterwarnings("ignore::circuitkit.patching.results.patch_result.DegenerateBaselineWarning")
def test_a_path_result_reads_by_name_and_refuses_in_one_line():
    """Its frame names senders, receivers and groups (``labels``); ``top`` leaves out the
    no-route cells; a method other than exact, and a head outside the model, are one line
    naming what was given."""
    import circuitkit as ck

    model = _random_llama()
    clean, corrupt = _tokens()
    mask = torch.zeros_like(clean, dtype=torch.bool)
    mask[:, 4:7] = True
    res = ck.patch_paths(model, clean, corrupt, _metric, ["L1H1"], ["L0H0", (2, 3)],
                         positions={"mid": mask}, options=dict(progress=False))
    frame = res.to_frame()
    assert set(frame["sender"]) == {"L1H1"} and set(frame["receiver"]) == {"L0H0", "L2H3"}
    assert set(frame["group"]) == {"mid"}
    top = res.top(5)
    assert len(top) == 1 and top.loc[0, "receiver"] == "L2H3"  # L0H0 is no path from L1H1
    with pytest.raises(ValueError, match="paths are patched exactly only; got "
                                         "method='attribution'"):
        ck.patch(model, clean, corrupt, _metric, ck.PathUnits([(0, 0)], [(1, 0)]),
                 method="attribution")
    with pytest.raises(ValueError, match=r"receivers: .* got \['L9H0'\]"):
        ck.patch_paths(model, clean, corrupt, _metric, [(0, 0)], ["L9H0"])
