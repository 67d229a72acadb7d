"""Edges: exact edge patching, edge attribution, circuit faithfulness.

References nobody here wrote or that share no code with the engine: TransformerLens's
``get_act_patch_direct_path_all_sources`` (exact edges, MHA q/k/v) and its edge-granularity
``attribution_patch`` (EAP); a hand loop of two full ``run_with_hooks`` forwards per edge (any
layout, GQA k/v on KV heads, the embeddings and the logits); the unhooked clean and corrupt
runs (faithfulness ends); a planted attention-only induction circuit (``planted_induction``).
Tolerances: 1e-5 absolute on metrics of size ~1-10 in float32 unless stated.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from planted_induction import (
    COPY_HEAD,
    INDUCTION,
    PREV_HEAD,
    planted_induction_model,
    planted_task,
)
from tinymodels import (
    ARCHS,
    NATIVE,
    SMALL,
    TINY_GPT2,
    TINY_LLAMA,
    autograd_at,
    make_model,
    native_model,
    with_random_post_norms,
)

import circuitkit as ck
from circuitkit import hooks
from circuitkit.metrics import token_logprob_metric
from circuitkit.patching import shortcuts
from circuitkit.patching.exact import EdgeEngine
from circuitkit.patching.results import DegenerateBaselineWarning
from circuitkit.patching.results.circuit_graph import CircuitGraph
from circuitkit.patching.units.circuits import CircuitUnits


def _model(name):
    return with_random_post_norms({**SMALL, **ARCHS[name]})


def _data(n=2, seq=8, vocab=64):
    """Random clean/corrupt tokens below ``vocab`` (a model's logits' width: the metric reads
    the clean tokens' log-probs) and that metric at positions 4 and 7."""
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, vocab, (n, seq), generator=g)
    corrupt = torch.randint(0, vocab, (n, seq), generator=g)
    metric = token_logprob_metric([[4, 7]] * n, [clean[i, [4, 7]].tolist() for i in range(n)])
    return clean, corrupt, metric


def _pair(seed: int = 0, n: int = 3, seq: int = 7):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(1, 64, (n, seq), generator=g),
            torch.randint(1, 64, (n, seq), generator=g))


def margin(logits):
    return logits[:, -1, 5] - logits[:, -1, 7]


def sharpened(model, factor: float = 4.0):
    """``model`` with its query weights scaled by ``factor``: attention far from uniform, where
    the softmax is far from linear (a random init attends almost uniformly)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"\.(q_proj|q)\._original_component\.weight$", name):
                p.mul_(factor)
    return model


def _writes(model, tokens):
    """Per sender (layer, head) and the embeddings: each one's residual write, from TL's
    per-head ``hook_result`` where the bridge has it (``z @ W_O`` by TL otherwise)."""
    f = hooks.facts(model)
    names = [hooks.resid_pre(0)] + [hooks.result(la) for la in range(f.n_layers)] + [
        hooks.z(la) for la in range(f.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    out = {(-1, -1): cache[hooks.resid_pre(0)]}
    for la in range(f.n_layers):
        for h in range(f.n_heads):
            if hooks.result(la) in cache:
                out[(la, h)] = cache[hooks.result(la)][:, :, h]
            else:
                out[(la, h)] = cache[hooks.z(la)][:, :, h] @ model.blocks[la].attn.W_O[h]
    return out


def hand_edges(model, base, source, metric, result):
    """The metric after each edge of ``result``, by hand: for a head receiver (l, u) at input
    i, a full forward of ``base`` with the sender's write added to the whole residual at
    ``resid_pre(l)`` gives the activation at ``hook_i(l)``; a second full forward of ``base``
    puts its head ``u`` slice in; for the logits, one forward with the write added at the last
    block's output."""
    wb, ws = _writes(model, base), _writes(model, source)
    f = hooks.facts(model)
    out = torch.full_like(result.values, float("nan"))
    for (s, r, i) in result.edge_mask().nonzero().tolist():
        snd, (rl, u) = result.senders[s], result.receivers[r]
        delta = ws[snd] - wb[snd]

        def add(t, hook, delta=delta):
            return t + delta

        with torch.no_grad():
            if rl == f.n_layers:
                out[s, r, i] = metric(model.run_with_hooks(
                    base, fwd_hooks=[(hooks.resid_post(rl - 1), add)])).mean()
                continue
            site = hooks.head_site(result.inputs[i], rl)
            got = {}

            def grab(t, hook, got=got):
                got["a"] = t.clone()
                return t

            model.run_with_hooks(base, fwd_hooks=[(hooks.resid_pre(rl), add), (site, grab)])

            def put(t, hook, got=got, u=u):
                t = t.clone()
                t[:, :, u] = got["a"][:, :, u]
                return t

            out[s, r, i] = metric(model.run_with_hooks(base, fwd_hooks=[(site, put)])).mean()
    return out


# --- exact edges -------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [TINY_GPT2, dict(TINY_LLAMA, num_key_value_heads=4)],
                         ids=["gpt2", "llama_mha"])
def test_exact_edges_equal_transformer_lens_direct_path(cfg):
    from transformer_lens.patching import get_act_patch_direct_path_all_sources

    model = make_model(cfg)
    clean, corrupt = _pair()
    res = ck.patch_edges(model, clean, corrupt, margin, options=dict(progress=False))
    with torch.no_grad():
        _, cc = model.run_with_cache(clean)
        _, xc = model.run_with_cache(corrupt)
    f = hooks.facts(model)
    heads = [res.senders.index((la, h)) for la in range(f.n_layers) for h in range(f.n_heads)]
    recv = [res.receivers.index((la, h)) for la in range(f.n_layers) for h in range(f.n_heads)]
    for i, name in enumerate(res.inputs):
        with torch.no_grad():
            ref = get_act_patch_direct_path_all_sources(
                model, corrupt, cc, xc, lambda lg: margin(lg).mean(), component=name,
                verbose=False).reshape(len(heads), len(recv))
        ours = res.values[heads][:, recv, i]
        later = torch.tensor([[rl > sl for rl in range(f.n_layers) for _ in range(f.n_heads)]
                              for sl in range(f.n_layers) for _ in range(f.n_heads)])
        assert torch.isnan(ours[~later]).all()  # no edge: NaN, not TL's 0.0 placeholder
        torch.testing.assert_close(ours[later], ref[later], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_exact_edges_equal_hand_loop_on_gqa(tiny_llama, direction):
    """GQA: k/v receivers are KV heads (TL refuses them); the embeddings and the logits too."""
    clean, corrupt = _pair(1)
    res = ck.patch_edges(tiny_llama, clean, corrupt, margin, direction=direction,
                         options=dict(progress=False, batch_size=7))  # several chunks per layer
    f = hooks.facts(tiny_llama)
    assert f.gqa and res.meta["kv_heads"]
    base, source = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
    want = hand_edges(tiny_llama, base, source, margin, res)
    torch.testing.assert_close(res.values, want, atol=1e-5, rtol=0, equal_nan=True)
    k = res.inputs.index("k")
    recv = {r: i for i, r in enumerate(res.receivers)}
    # a KV head g >= n_kv_heads is no receiver; a query head is, for q
    assert torch.isnan(res.values[:, recv[(1, f.n_kv_heads)], k]).all()
    assert not torch.isnan(res.values[0, recv[(1, f.n_kv_heads)], res.inputs.index("q")])


@pytest.mark.parametrize("name", list(ARCHS) + [f"native-{k}" for k in NATIVE])
def test_exact_edges_on_every_layout(name):
    """Every block layout (HF bridges and TransformerLens-native configs: attention-only, no
    norm, own output vocabulary, soft-caps, bidirectional ...): equal to the hand loop, or
    refused in one line naming the block."""
    model = native_model(**NATIVE[name[7:]]) if name.startswith("native-") else _model(name)
    clean, corrupt, metric = _data(vocab=hooks.facts(model).d_vocab_out)
    senders = ["embed", (0, 0), (0, 3)]
    receivers = [(1, 0), (1, 1), (1, 3), "logits"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hooks.post_norm(model, 0, "attn") is not None:
            with pytest.raises(ValueError, match=r"^blocks\.0 normalises [^\n]*$"):
                ck.patch_edges(model, clean, corrupt, metric, senders, receivers,
                               options=dict(progress=False))
            return
        res = ck.patch_edges(model, clean, corrupt, metric, senders, receivers, direction="noise",
                             options=dict(progress=False))
        want = hand_edges(model, clean, corrupt, metric, res)
    torch.testing.assert_close(res.values, want, atol=1e-5, rtol=0, equal_nan=True)


def hand_eap_star(model, base, source, metric, result):
    """eap*'s definition by hand: for a head receiver (l, u) at input i, the activation at
    ``hook_i(l)`` of a full forward of ``base`` with the sender's write added at
    ``resid_pre(l)``, its head-``u`` slice put into a second full forward of ``base``, whose
    ``hook_z(l)`` minus the base run's, dotted with the autograd gradient of the metric (full
    logits) at ``hook_z(l)`` (a KV head's: summed over its query heads); the logits receiver as
    EAP. Mean over prompts."""
    wb, ws = _writes(model, base), _writes(model, source)
    f = hooks.facts(model)
    names = [hooks.z(la) for la in range(f.n_layers)] + [hooks.resid_post(f.n_layers - 1)]
    kept = autograd_at(model, base, metric, names)
    out = torch.full_like(result.values, float("nan"))
    for (s, r, i) in result.edge_mask().nonzero().tolist():
        snd, (rl, u) = result.senders[s], result.receivers[r]
        delta = ws[snd] - wb[snd]
        if rl == f.n_layers:
            out[s, r, i] = (delta * kept[names[-1]].grad).sum()
            continue
        site, got = hooks.head_site(result.inputs[i], rl), {}

        def add(t, hook, delta=delta):
            return t + delta

        def grab(t, hook, got=got):
            got["a"] = t.clone()
            return t

        def put(t, hook, got=got, u=u):
            t = t.clone()
            t[:, :, u] = got["a"][:, :, u]
            return t

        def grab_z(t, hook, got=got):
            got["z"] = t.clone()
            return t

        with torch.no_grad():
            model.run_with_hooks(base, fwd_hooks=[(hooks.resid_pre(rl), add), (site, grab)])
            model.run_with_hooks(base, fwd_hooks=[(site, put), (hooks.z(rl), grab_z)])
        z = kept[hooks.z(rl)]
        heads = [u] if result.inputs[i] == "q" else [
            h for h in range(f.n_heads) if h // (f.n_heads // f.n_kv_heads) == u]
        out[s, r, i] = ((got["z"] - z.detach())[:, :, heads] * z.grad[:, :, heads]).sum()
    return out  # the gradient of the mean already averages over prompts


@pytest.mark.parametrize("name", list(ARCHS) + [f"native-{k}" for k in NATIVE])
def test_eap_star_equals_its_definition_on_every_layout(name):
    """eap* on every block layout equals its definition computed by hand with plain hooks and
    autograd (``hand_eap_star``), or is refused with the exact engine's one line (post-norm).
    It needs no per-head input fork, so native configs, GPT-J and OPT run it too."""
    model = native_model(**NATIVE[name[7:]]) if name.startswith("native-") else _model(name)
    clean, corrupt, metric = _data(vocab=hooks.facts(model).d_vocab_out)
    senders = ["embed", (0, 0), (0, 3)]
    receivers = [(0, 1), (1, 0), (1, 1), (1, 3), "logits"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hooks.post_norm(model, 0, "attn") is not None:
            with pytest.raises(ValueError, match=r"^blocks\.0 normalises [^\n]*$"):
                ck.patch_edges(model, clean, corrupt, metric, senders, receivers,
                               method="attribution", options=dict(estimator="eap*", progress=False))
            return
        res = ck.patch_edges(model, clean, corrupt, metric, senders, receivers,
                             method="attribution", options=dict(estimator="eap*", progress=False))
    want = hand_eap_star(model, corrupt, clean, metric, res)
    mask = res.edge_mask()
    assert int(mask.sum()) >= 19  # MQA: one KV head per layer receives k and v
    torch.testing.assert_close(res.effect()[mask], want[mask], atol=1e-5, rtol=1e-4)


def test_planted_induction_k_edge_is_the_top_edge():
    """Attention-only (no MLP module), no norms: the previous-token head feeds the induction
    head through K only; Q and V edges from it are exactly zero."""
    model = planted_induction_model()
    assert not hasattr(model.blocks[0], "mlp") or model.blocks[0].mlp is None
    task = planted_task(16)
    heads = [(la, h) for la in range(2) for h in range(2)]
    res = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric, senders=heads,
                         receivers=heads[2:], options=dict(progress=False))
    top = res.top(1).iloc[0]
    assert (top.sender, top.receiver, top.input) == ("L0H0", "L1H0", "k")
    assert abs(top.normalized) > 0.2
    s, r = res.senders.index(PREV_HEAD), res.receivers.index(INDUCTION)
    for name in ("q", "v"):
        assert abs(float(res.effect()[s, r, res.inputs.index(name)])) < 1e-6
    # the value path: the current-token head -> induction head V (restores what it copies)
    c = res.senders.index(COPY_HEAD)
    assert float(res.normalized()[c, r, res.inputs.index("v")]) > 0.05
    full = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                          options=dict(progress=False))
    # the embeddings -> previous-token head V edge carries the same information as the K edge
    # (the head's only token input; K is its only reader), and the induction head's direct
    # write to the logits is its whole output
    k = full.values[full.senders.index(PREV_HEAD), full.receivers.index(INDUCTION), 1]
    e = full.values[0, full.receivers.index(PREV_HEAD), 2]
    torch.testing.assert_close(e, k, atol=1e-5, rtol=0)
    top = full.top(1).iloc[0]
    assert (top.sender, top.receiver, top.input) == ("L1H0", "logits", "resid")
    assert top.normalized == pytest.approx(1.0, abs=1e-5)


# --- faithfulness -------------------------------------------------------------------------------


def _unhooked(model, tokens, metric):
    with torch.no_grad():
        return metric(model(tokens))


@pytest.mark.parametrize("which", ["gpt2", "llama_gqa", "gpt_neox", "native-attn-only",
                                   "native-bidirectional", "native-vocab-out"])
def test_faithfulness_all_edges_kept_is_the_clean_run_none_the_corrupt_run(which):
    """Every layout the edge engine runs (parallel blocks, attention-only, bidirectional, an
    own output vocabulary too): keeping every edge is the clean run, none the corrupt run."""
    if which.startswith("native-"):
        model = native_model(**NATIVE[which[7:]])
    else:
        model = _model(which) if which in ARCHS else make_model(
            TINY_GPT2 if which == "gpt2" else TINY_LLAMA)
    clean, corrupt = _pair(2, seq=7 if which != "native-attn-only" else 6)
    clean, corrupt = clean % hooks.facts(model).d_vocab_out, corrupt % hooks.facts(
        model).d_vocab_out
    res = ck.patch_edges(model, clean, corrupt, margin, options=dict(progress=False))
    pm = ck.as_metric(margin, *clean.shape, hooks.facts(model).d_vocab_out)
    graph = CircuitGraph.of(model, res)
    kept = torch.stack([torch.ones(graph.n_items, dtype=torch.bool),
                        torch.zeros(graph.n_items, dtype=torch.bool)])
    got = CircuitUnits(graph, kept).checked(model, clean, corrupt).exact(
        model, clean, corrupt, pm, ck.CircuitOptions(progress=False)).per
    torch.testing.assert_close(got[0], _unhooked(model, clean, margin), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], _unhooked(model, corrupt, margin), atol=1e-5, rtol=0)
    with warnings.catch_warnings():  # random weights: the gap may be noise (raw effects then)
        warnings.simplefilter("ignore", DegenerateBaselineWarning)
        circ = ck.circuit(model, (clean, corrupt, margin), res,
                          options=dict(progress=False, n_boot=50))
    # every edge kept: f = 1, or the raw effect full - empty of a degenerate baseline
    assert circ.faithfulness[-1] == pytest.approx(
        1.0 if circ.degenerate is None else circ.full - circ.empty, abs=1e-5)
    assert circ.full == pytest.approx(float(got[0].mean()), abs=1e-5)
    assert circ.empty == pytest.approx(float(got[1].mean()), abs=1e-5)


def test_faithfulness_of_heads_ablates_their_outputs(tiny_llama):
    """A head circuit: kept heads write, the others write their corrupt output everywhere
    (the reference: every ablated head's z replaced by the corrupt run's, by hand)."""
    clean, corrupt = _pair(3)
    heads = ck.patch_heads(tiny_llama, clean, corrupt, margin, options=dict(progress=False))
    circ = ck.circuit(tiny_llama, (clean, corrupt, margin), heads, sizes=[0.25, 0.5, 1.0],
                      options=dict(progress=False, n_boot=0))
    f = hooks.facts(tiny_llama)
    with torch.no_grad():
        _, cc = tiny_llama.run_with_cache(corrupt)
    for k, n_kept in enumerate(circ.n_kept):
        kept = {(h["layer"], h["head"]) for h in circ.items[:n_kept]}

        fwd = []
        for la in range(f.n_layers):
            dead = [h for h in range(f.n_heads) if (la, h) not in kept]

            def ablate(t, hook, la=la, dead=dead):
                t = t.clone()
                t[:, :, dead] = cc[hooks.z(la)][:, :, dead]
                return t

            fwd.append((hooks.z(la), ablate))
        with torch.no_grad():
            m = margin(tiny_llama.run_with_hooks(clean, fwd_hooks=fwd))
        torch.testing.assert_close(circ.per_prompt[k], m, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rank", ["abs", "signed"])
def test_faithfulness_is_monotone_on_the_planted_circuit(rank):
    model = planted_induction_model()
    task = planted_task(16)
    res = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                         options=dict(progress=False))
    circ = ck.circuit(model, task, res, rank=rank, options=dict(progress=False, n_boot=100))
    f = circ.faithfulness
    assert bool((f[1:] >= f[:-1] - 1e-5).all()), f
    assert float(f[0]) == pytest.approx(0.0, abs=1e-5)
    assert float(f[-1]) == pytest.approx(1.0, abs=1e-5)
    assert circ.full == pytest.approx(float(_unhooked(model, task.clean_tokens,
                                                      task.metric)), abs=1e-5)
    assert circ.empty == pytest.approx(float(_unhooked(model, task.corrupt_tokens,
                                                       task.metric)), abs=1e-5)
    if rank == "abs":  # the kept set is the planted circuit
        kept = {(e["sender"], e["receiver"], e["input"]) for e in circ.kept()}
        name = lambda node: ck.patching.results.node_name(node, 2)  # noqa: E731
        assert kept == {("embed", name(PREV_HEAD), "v"), (name(PREV_HEAD), name(INDUCTION), "k"),
                        ("embed", name(COPY_HEAD), "v"), (name(COPY_HEAD), name(INDUCTION), "v"),
                        (name(INDUCTION), "logits", "resid")}
        assert float(circ.faithfulness[circ.chosen]) == pytest.approx(1.0, abs=1e-5)
        lo, hi = circ.intervals["cpr"]
        assert lo - 1e-6 <= circ.cpr <= hi + 1e-6


def test_circuit_json_export(tmp_path):
    model = planted_induction_model()
    task = planted_task(8)
    res = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                         options=dict(progress=False))
    circ = ck.circuit(model, task, res, options=dict(progress=False, n_boot=20))
    data = json.loads(circ.save_json(tmp_path / "c.json").read_text())
    assert data["n_kept"] == len(data["edges"]) == 5
    names = {n["name"] for n in data["nodes"]}
    assert names == {"embed", "L0H0", "L0H1", "L1H0", "logits"}
    assert {"sender", "receiver", "input", "score"} <= set(data["edges"][0])


# --- attribution ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [TINY_GPT2, dict(TINY_LLAMA, num_key_value_heads=4)],
                         ids=["gpt2", "llama_mha"])
def test_eap_equals_transformer_lens_edge_attribution(cfg):
    """EAP = TransformerLens's edge-granularity ``attribution_patch`` (per position, summed)."""
    from transformer_lens.tools.analysis.attribution_patching import (
        EdgeAttributionConfig,
        attribution_patch,
    )

    model = make_model(cfg)
    clean, corrupt = _pair(4, n=2, seq=6)
    res = ck.patch_edges(model, clean, corrupt, margin, method="attribution",
                         options=dict(progress=False))
    tl = attribution_patch(model, clean, corrupt, lambda lg: margin(lg).mean(),
                           EdgeAttributionConfig(granularity="edge"))
    f = hooks.facts(model)
    want = torch.zeros_like(res.values)
    for (w, r), v in tl.edge_scores.items():
        if w.kind == "mlp_out" or r.kind == "mlp_in":
            continue
        s = res.senders.index((-1, -1) if w.kind == "embed" else (w.layer, w.head))
        rr = res.receivers.index((f.n_layers, -1) if r.kind == "logits" else (r.layer, r.head))
        want[s, rr, 0 if r.kind == "logits" else "qkv".index(r.kind[0])] += v
    mask = res.edge_mask()
    torch.testing.assert_close(res.effect()[mask], want[mask], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("cfg", [TINY_GPT2, dict(TINY_LLAMA, num_key_value_heads=4)],
                         ids=["gpt2", "llama_mha"])
def test_eap_on_uneven_reads_is_the_full_logits_gradient(cfg):
    """Prompts reading different numbers of positions: the engine computes the last MLP and
    the unembedding at each prompt's reads only, padded by repeating one (``PromptMetric.reads``);
    the gradient must count a repeated read once. Reference: autograd of the metric on full
    logits through the per-head input copies, dotted with each sender's write by hand.
    (TransformerLens's edge ``attribution_patch`` is left out: it agrees with this reference
    on a metric that reads one position only, the test above.)"""
    model = make_model(cfg)
    clean, corrupt = _pair(4, n=2, seq=6)
    pos = [[5], [2, 4, 5]]
    metric = token_logprob_metric(pos, [clean[i, p].tolist() for i, p in enumerate(pos)])
    assert len(set(metric.read_positions()[0].tolist())) == 1  # one read, repeated
    res = ck.patch_edges(model, clean, corrupt, metric, method="attribution",
                         options=dict(progress=False))
    f = hooks.facts(model)
    names = [hooks.edge_input(i, la) for la in range(f.n_layers) for i in "qkv"]
    names.append(hooks.resid_post(f.n_layers - 1))
    with shortcuts.split_qkv_inputs(model):
        grad = {n: t.grad for n, t in autograd_at(model, corrupt, metric, names).items()}
    wb, ws = _writes(model, corrupt), _writes(model, clean)
    want = torch.full_like(res.values, float("nan"))
    for s, r, i in res.edge_mask().nonzero().tolist():
        (rl, u), d = res.receivers[r], ws[res.senders[s]] - wb[res.senders[s]]
        if rl == f.n_layers:
            want[s, r, i] = (d * grad[hooks.resid_post(rl - 1)]).sum()
        else:
            want[s, r, i] = (d * grad[hooks.edge_input(res.inputs[i], rl)][:, :, u]).sum()
    mask = res.edge_mask()
    torch.testing.assert_close(res.effect()[mask], want[mask], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("kv", [4, 2], ids=["mha", "gqa"])
def test_eap_star_is_exact_where_the_downstream_is_linear(kv):
    """eap* runs the receiving head exactly and takes what follows it to first order. On an
    attention-only model without norms and a logit-difference metric everything after a
    last-layer head is linear, so eap*'s edges into last-layer heads are exact (q, k, v; k/v
    on KV heads under GQA) while eap, which linearises the receiver's softmax, is not. A
    native bridge has no per-head input fork; eap* needs none."""
    model = sharpened(native_model(attn_only=True, normalization_type=None,
                                   n_key_value_heads=kv), factor=8.0)
    clean, corrupt = _pair(6, n=3, seq=8)
    exact = ck.patch_edges(model, clean, corrupt, margin, options=dict(progress=False))
    star = ck.patch_edges(model, clean, corrupt, margin, method="attribution",
                          options=dict(estimator="eap*", progress=False))
    assert star.meta["estimator"] == "eap*" and star.meta["pass_equivalents"] > 4 * 3
    assert not star.values.requires_grad and len(star.to_frame()) == int(star.edge_mask().sum())
    last = [r for r, (rl, _) in enumerate(exact.receivers) if rl == 1]
    got, want = star.effect()[:, last], exact.effect()[:, last]
    edge = exact.edge_mask()[:, last]
    assert int(edge.sum()) == 5 * (4 + 2 * kv)  # embed + 4 layer-0 heads, into 4 q + kv k, v
    print(f"eap* into layer 1: max |error| {float((got - want)[edge].abs().max()):.2e}")
    torch.testing.assert_close(got[edge], want[edge], atol=2e-6, rtol=0)
    assert float(want[edge].abs().max()) > 1e-3  # not trivially zero
    # into layer 0, a layer-1 head's softmax follows the receiver and is linearised: not exact
    first = [r for r, (rl, _) in enumerate(exact.receivers) if rl == 0]
    e0 = exact.edge_mask()[:, first]
    err = (star.effect()[:, first][e0] - exact.effect()[:, first][e0]).abs().max()
    print(f"eap* into layer 0: max |error| {float(err):.2e}")
    assert float(err) > 1e-5  # > 5x the tolerance above


def test_eap_star_is_closer_to_exact_than_eap():
    """On a random Llama with sharp attention (norms, MLPs, GQA), eap* is closer to exact than
    eap on every input, and far closer on k edges, whose nonlinearity here is the receiving
    head's softmax (measured sums of |error| q/k/v: eap 0.180/0.011/0.176, eap* 0.165/0.0004/
    0.099)."""
    tiny_llama = sharpened(make_model(TINY_LLAMA))
    clean, corrupt = _pair(7, n=3, seq=8)
    exact = ck.patch_edges(tiny_llama, clean, corrupt, margin, options=dict(progress=False))
    mask = exact.edge_mask()
    err = {}
    for est in ("eap", "eap*"):
        res = ck.patch_edges(tiny_llama, clean, corrupt, margin, method="attribution",
                             options=dict(estimator=est, progress=False))
        d = (res.effect() - exact.effect()).abs()
        err[est] = [float(d[:, :, i][mask[:, :, i]].sum()) for i in range(3)]
    print("sum |estimate - exact| per input q, k, v:", err)
    assert all(a < b for a, b in zip(err["eap*"], err["eap"], strict=True))
    assert err["eap*"][1] < 0.2 * err["eap"][1]  # k: the softmax is (nearly) all of it
    assert sum(err["eap*"]) < 0.8 * sum(err["eap"])


def test_eap_ig_variants_agree_on_the_embedding_edges(tiny_gpt2):
    """Both EAP-IG variants interpolate the embeddings for the "embed" sender: its edges must
    be the same numbers; EAP-IG with more steps moves towards exact on the strongest edges."""
    clean, corrupt = _pair(5)
    a = ck.patch_edges(tiny_gpt2, clean, corrupt, margin, method="attribution",
                       options=dict(estimator="eap-ig-inputs", ig_steps=3, progress=False))
    b = ck.patch_edges(tiny_gpt2, clean, corrupt, margin, method="attribution",
                       options=dict(estimator="eap-ig-activations", ig_steps=3, progress=False))
    assert a.meta["ig_steps"] == b.meta["ig_steps"] == 3
    torch.testing.assert_close(a.values[0], b.values[0], atol=1e-6, rtol=0, equal_nan=True)
    assert not torch.allclose(a.values[1:].nan_to_num(), b.values[1:].nan_to_num())


def test_attribution_plus_exact_verifies_with_the_engine(tiny_llama):
    clean, corrupt = _pair(6)
    exact = ck.patch_edges(tiny_llama, clean, corrupt, margin, options=dict(progress=False))
    n = int(exact.edge_mask().sum())
    every = ck.patch_edges(tiny_llama, clean, corrupt, margin, method="attribution+exact",
                           options=dict(top_k=n, progress=False))
    torch.testing.assert_close(every.values, exact.values, atol=1e-6, rtol=0, equal_nan=True)
    some = ck.patch_edges(tiny_llama, clean, corrupt, margin, method="attribution+exact",
                          options=dict(top_k=5, progress=False))
    mask = torch.tensor(some.meta["verified"])
    assert int(mask.sum()) == 5 and some.meta["cost"]["verify_passes"] > 0
    torch.testing.assert_close(some.values[mask], exact.values[mask], atol=1e-6, rtol=0)
    auto = ck.patch_edges(tiny_llama, clean, corrupt, margin, method="attribution+exact",
                          options=dict(progress=False))
    assert auto.meta["budget"]["stopped"] in ("bound", "budget", "all")
    assert 0 < auto.meta["n_verified"] <= n


# --- results, checkpoints, bad input ------------------------------------------------------------


def test_edge_result_round_trip_and_strict_load(tiny_gpt2, tmp_path):
    clean, corrupt = _pair(7)
    res = ck.patch_edges(tiny_gpt2, clean, corrupt, margin, options=dict(progress=False))
    res.save(tmp_path / "e")
    back = ck.EdgeResult.load(tmp_path / "e")
    torch.testing.assert_close(back.values, res.values, equal_nan=True)
    torch.testing.assert_close(back.per_prompt, res.per_prompt, equal_nan=True)
    assert (back.senders, back.receivers, back.inputs) == (res.senders, res.receivers,
                                                           res.inputs)
    df = res.to_frame()
    assert list(df.columns[:7]) == ["sender_layer", "sender_head", "receiver_layer",
                                    "receiver_head", "input", "value", res.value_column]
    # (issue 44 item 1: a degenerate result's column is named raw_effect)
    assert res.value_column == ("raw_effect" if res.degenerate else "normalized")
    assert len(df) == int(res.edge_mask().sum())
    assert set(df[df.receiver == "logits"].input) == {"resid"}
    info = json.loads((tmp_path / "e.json").read_text())
    info["inputs"] = ["q", "x", "v"]
    (tmp_path / "e.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match="inputs"):
        ck.EdgeResult.load(tmp_path / "e")
    info["inputs"] = ["q", "k"]
    (tmp_path / "e.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"e.safetensors: tensor 'values' has shape \[9, 9, 3\]; "
                                         r"the fields of e.json .* give \[9, 9, 2\]"):
        ck.EdgeResult.load(tmp_path / "e")


def test_edge_checkpoint_resumes_the_same_numbers(tiny_llama, tmp_path, monkeypatch):
    clean, corrupt = _pair(8)
    kw = dict(options=dict(progress=False, batch_size=6, checkpoint=tmp_path / "ck"))
    calls = []
    real = EdgeEngine.run_chunk

    def failing(self, chunk):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(self, chunk)

    monkeypatch.setattr(EdgeEngine, "run_chunk", failing)
    with pytest.raises(KeyboardInterrupt):
        ck.patch_edges(tiny_llama, clean, corrupt, margin, **kw)
    monkeypatch.setattr(EdgeEngine, "run_chunk", real)
    stored = sorted((tmp_path / "ck").glob("chunk_*.safetensors"))
    assert len(stored) >= 3  # the memory probe's chunk and those finished before the stop
    resumed = ck.patch_edges(tiny_llama, clean, corrupt, margin, **kw)
    fresh = ck.patch_edges(tiny_llama, clean, corrupt, margin,
                           options=dict(progress=False, batch_size=6))
    assert torch.equal(resumed.values.nan_to_num(), fresh.values.nan_to_num())
    assert resumed.meta["coverage"] == fresh.meta["coverage"]  # (node runs: chunks too)
    with pytest.raises(ValueError, match="different sweep"):  # other edges, same folder
        ck.patch_edges(tiny_llama, clean, corrupt, margin, inputs=("q",), **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(inputs=("q", "x")), r"inputs='x' is not supported"),
    (dict(inputs=()), r"inputs=\(\): expected a non-empty list"),
    (dict(senders=[(2, 0)], receivers=[(1, 0)]), r"receiver L1H0 is not after any sender"),
    (dict(senders=[(7, 0)]), r"senders: \(7, 0\) is outside the model's 3 layers"),
    (dict(receivers=[(0, 9)]), r"receivers: \(0, 9\) is outside"),
    (dict(senders=["logits"]), r"senders: 'logits' is not a node"),
    (dict(method="auto"), r"method='auto' is not supported"),
    (dict(direction="up"), r"direction='up' is not supported"),
    # GQA: k/v receivers are KV heads (2 per layer): L2H3 receives only q
    (dict(receivers=["L2H3"], inputs=("k",)), r"receivers=\['L2H3'\] with inputs=\['k'\] give "
                                              r"no edge: .* 2 KV heads .*Add 'q' to inputs"),
    (dict(receivers=["L2H3"], inputs=("k", "v"), method="attribution"), r"give no edge"),
    (dict(receivers=["L1H2", "L2H3"], inputs="v", method="attribution+exact"), r"give no edge"),
])
def test_bad_input_gives_one_line(tiny_llama, kw, match):
    clean, corrupt = _pair()
    with pytest.raises(ValueError, match=match) as err:
        ck.patch_edges(tiny_llama, clean, corrupt, margin, **kw, options=dict(progress=False))
    assert "\n" not in str(err.value)


def test_attribution_without_per_head_inputs_is_refused_in_one_line():
    model = planted_induction_model()  # a native bridge: no use_split_qkv_input
    task = planted_task(4)
    with pytest.raises(ValueError, match=r"^this model's attention \(AttentionBridge[^\n]*"
                                         r"method='exact'"):
        ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                       method="attribution", options=dict(progress=False))


def test_circuit_bad_input_gives_one_line(tiny_gpt2):
    clean, corrupt = _pair()
    res = ck.patch_edges(tiny_gpt2, clean, corrupt, margin, inputs="q",
                         options=dict(progress=False))
    for kw, match in ((dict(sizes=[0.5, 0.1]), "sizes="), (dict(ablation="noise"),
                                                           "ablation='noise'"),
                      (dict(target=2.0), "target=")):
        with pytest.raises(ValueError, match=match) as err:
            ck.circuit(tiny_gpt2, (clean, corrupt, margin), res, options=dict(progress=False), **kw)
        assert "\n" not in str(err.value)


def test_pictures(tmp_path):
    model = planted_induction_model()
    task = planted_task(8)
    res = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                         options=dict(progress=False))
    fig = res.heatmap()
    # the logits in a panel of their own (issue 44.7: they were drawn inside "into q")
    assert [t.name for t in fig.data] == ["q", "k", "v", "logits"]
    assert list(fig.data[1].y) == res.sender_names()
    assert list(fig.data[1].x) == [r for r in res.receiver_names() if r != "logits"]
    assert list(fig.data[3].x) == ["logits"]
    circ = ck.circuit(model, task, res, options=dict(progress=False, n_boot=20))
    graph = ck.viz.circuit_graph(circ)
    lines = [t for t in graph.data if t.mode == "lines"]
    assert len(lines) == 5  # the kept set: one line per edge
    widest = max(lines, key=lambda t: t.line.width)
    assert widest.hovertemplate.startswith("L1H0 -> logits")
    curve = ck.viz.faithfulness_curve(circ)
    assert list(curve.data[-1].y) == pytest.approx(circ.faithfulness.tolist())
    with pytest.raises(TypeError, match="CircuitResult"):
        ck.viz.circuit_graph(task)


def test_characterize_edges_and_report(tiny_llama, tmp_path):
    """``characterize --edges``: the top Phase-1 heads into the top Phase-2 heads after them,
    on the Phase-2 metric; a step of its own (resumed), and a section of report.html."""
    import pandas as pd

    from circuitkit.experiments.characterize import characterize
    from circuitkit.scoring.heads import top_heads

    out = tmp_path / "run"
    kw = dict(n_examples=8, k=3, n_random=3, text=False, progress=False,
              task_kwargs=dict(n_labels=8, children=4, labels_per_note=(1, 1)))
    summary = characterize(tiny_llama, "synthetic", out, dict(kw, edges=True))
    assert summary["complete"] and "edges" in summary["steps"]
    scores = pd.read_csv(out / "scores.csv")
    res = ck.EdgeResult.load(out / "edges" / "edges")
    senders = top_heads(scores, 1, 3)
    first = min(la for la, _ in senders)
    assert set(res.senders) == set(senders)
    assert set(res.receivers) == {h for h in top_heads(scores, 2, 3) if h[0] > first}
    assert res.meta["phase"] == 2 and res.per_prompt is not None
    circ = json.loads((out / "edges" / "circuit.json").read_text())
    assert circ["n_items"] == int(res.edge_mask().sum()) and len(circ["curve"]) == 10
    # the same pairs as paths through everything, at every position and per stage group
    paths = ck.PatchResult.load(out / "edges" / "paths")
    assert paths.axes == ("sender", "receiver", "group")
    from circuitkit.experiments.characterize import stage_groups

    assert paths.meta["path_groups"] == list(stage_groups(ck.load_task(
        "synthetic", n_examples=8, split="test", **kw["task_kwargs"]).with_phase(2)))
    assert "all" in paths.meta["path_groups"] and "shortlist" in paths.meta["path_groups"]
    assert [tuple(ck.hooks.parse_head(s)) for s in paths.meta["senders"]] == list(res.senders)
    assert res.meta["path_coverage"] == {g: row["overall"]
                                         for g, row in paths.meta["coverage"].items()}
    html = (out / "report.html").read_text()
    assert "Edges: which heads feed which" in html and "CPR" in html
    # (issue 49 item 9: no coverage share is printed for a degenerate result)
    assert ("Through everything between them" in html) != res.degenerate
    again = characterize(tiny_llama, "synthetic", out, dict(kw, edges=True))
    assert again["steps"]["edges"] == summary["steps"]["edges"]  # reused, not rerun
    # a folder written before the edges step patched paths: its edges step is redone
    old = json.loads((out / "summary.json").read_text())
    del old["record_version"]  # (that version's record: no version, no step's depends)
    for entry in old["steps"].values():
        del entry["depends"]
    edges = old["steps"]["edges"]
    edges["files"] = [f for f in edges["files"] if not f.startswith("edges/paths")]
    edges["sha256"] = {f: d for f, d in edges["sha256"].items() if f in edges["files"]}
    (out / "summary.json").write_text(json.dumps(old))
    (out / "edges" / "paths.json").unlink()
    redone = characterize(tiny_llama, "synthetic", out, dict(kw, edges=True))
    assert "edges" in redone["steps_run_this_call"] and (out / "edges" / "paths.json").exists()


def test_cli_plans_70b_edges_offline_and_counts_them(monkeypatch, tmp_path):
    """``circuitkit edges --plan`` from the shipped config (no weights): the edge count is
    the one a hand count of Llama-3-70B's graph gives (q on 64 heads, k/v on 8 KV heads per
    layer, the embeddings as a sender, the logits as a receiver)."""
    from typer.testing import CliRunner

    from circuitkit.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    r = CliRunner().invoke(app, ["edges", "--model", "llama3-70b", "--task", "icd10", "-n", "8",
                                 "--plan", "--gpu", "H200"])
    assert r.exit_code == 0, r.output
    L, H, KV = 80, 64, 8
    senders_before = [1 + H * la for la in range(L)]
    n = sum(s * (H + 2 * KV) for s in senders_before) + (1 + L * H)
    assert f"{n:,} edges" in r.output and "no weights needed" in r.output
    for row in ("exact ", "TL direct-path loop", "eap ", "eap-ig-inputs (m=5)",
                "eap-ig-activations (m=5)", "eap* ", "attribution+exact@"):
        assert any(line.startswith(row) for line in r.output.splitlines()), row
    passes = {line.split()[0]: float(line.split()[1].replace(",", ""))
              for line in r.output.splitlines() if line.startswith(("eap ", "eap* ", "exact "))}
    # eap*: EAP's 4 per prompt plus one attention per (sender, receiver layer) and input
    assert passes["eap"] == 4 * 8 and passes["eap"] < passes["eap*"] < passes["exact"] / 100
    bad = CliRunner().invoke(app, ["edges", "--model", "llama3-70b", "--task", "icd10", "--plan",
                                   "--senders", "L90H0"])
    assert bad.exit_code == 2 and "outside the model's 80 layers" in bad.output
    none = CliRunner().invoke(app, ["edges", "--model", "llama3-70b", "--task", "icd10", "-n",
                                    "8", "--plan", "--receivers", "L2H20", "--inputs", "k"])
    assert none.exit_code == 2 and "give no edge" in none.output and "8 KV heads" in none.output


def test_cli_edges_writes_results_and_the_circuit(tmp_path):
    from typer.testing import CliRunner

    from circuitkit.cli import app

    out = tmp_path / "e"
    r = CliRunner().invoke(app, ["edges", "--model", "icd-teacher", "--task", "icd10", "-n", "4",
                                 "--senders", "embed,L0H2", "--receivers", "L2H6,logits",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = ck.EdgeResult.load(out / "edges")
    assert res.receivers == ((2, 6), (4, -1)) and res.senders == ((-1, -1), (0, 2))
    assert json.loads((out / "circuit.json").read_text())["n_items"] == 8
    assert {"edges.csv", "edges.html", "circuit.html", "faithfulness.html"} <= {
        p.name for p in out.iterdir()}
    assert "strongest edges" in r.output and "CPR" in r.output
    # beside CPR, the edges' share of the whole gap (issue 33.3)
    # (4 prompts: these 8 edges move the metric by less than its margin, and it says so)
    share = json.loads((out / "circuit.json").read_text())["share"]
    assert (f"they carry {share:.1%} of the clean-corrupt gap" if share is not None else
            "degenerate: no faithfulness, CPR or CMD") in r.output
