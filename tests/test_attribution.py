"""Attribution patching (plain and AtP*) and the attribution+exact hybrid, against exact patching.

Exact references are independent of the code under test: TransformerLens's
``get_act_patch_attn_head_out_all_pos`` (denoise) and a hand-written ``run_with_hooks`` loop.
All randomness is seeded; tolerances are stated at each assertion.
"""

from __future__ import annotations

import pytest
import torch
from tinymodels import (
    attribution_heads,
    autograd_at,
    hand_patch_heads,
    hybrid_heads,
    with_random_post_norms,
)

import circuitkit as ck
from circuitkit import hooks
from circuitkit.metrics import token_logprob_metric
from circuitkit.patching.api import verified_mask

TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64}


def tiny_model(**over):
    return ck.load_model({**TINY, **over})  # random init, seed 0


def exact_heads(model, clean, corrupt, metric, direction, site="z"):
    """Metric after patching each head at every position: a plain run_with_hooks loop."""
    base, src = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
    return hand_patch_heads(model, base, src, metric, site)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.flatten().argsort().argsort().double()
    rb = b.flatten().argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def near_tokens(model, eps, seed=0, n=4, seq=12):
    """clean tokens in [0, 32); corrupt = clean + 32, where token t+32's embedding is set to
    token t's plus eps * unit-RMS noise: a corrupt run eps away from the clean one."""
    g = torch.Generator().manual_seed(seed)
    W = model.embed.W_E
    with torch.no_grad():
        noise = torch.randn(32, W.shape[1], generator=g) * W[:32].pow(2).mean().sqrt()
        W[32:] = W[:32] + eps * noise
    clean = torch.randint(0, 32, (n, seq), generator=g)
    return clean, clean + 32


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 64, (4, 12), generator=g)
    corrupt = torch.randint(0, 64, (4, 12), generator=g)
    pos = [5, 8, 11]
    metric = token_logprob_metric([pos] * 4, [clean[i, pos].tolist() for i in range(4)])
    return clean, corrupt, metric


# --- (a) first-order exactness: attribution -> exact as the clean/corrupt gap shrinks -----------

@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_attribution_converges_to_exact(direction):
    """RMSNorm and log-softmax make no site exactly linear, so test the first-order property:
    the relative error of the estimated effects is O(eps)."""
    m = tiny_model()
    errs = []
    for eps in (0.2, 0.05):
        clean, corrupt = near_tokens(m, eps)
        pos = [5, 8, 11]
        metric = token_logprob_metric([pos] * 4, [clean[i, pos].tolist() for i in range(4)])
        res = attribution_heads(m, clean, corrupt, metric, direction=direction,
                                progress=False)
        ex = exact_heads(m, clean, corrupt, metric, direction)
        base = res.corrupt if direction == "denoise" else res.clean
        d_attr, d_exact = res.values - base, ex - base
        errs.append(float((d_attr - d_exact).norm() / d_exact.norm()))
    print(f"{direction}: relative error eps=0.2: {errs[0]:.4f}, eps=0.05: {errs[1]:.4f}")
    assert errs[1] < 0.05  # close to exact for a small perturbation
    assert errs[1] < errs[0] / 2  # and converging (first order: ~ /4 for eps / 4)


def test_denoise_matches_transformerlens_sign_and_scale(model, data):
    """Attribution vs TransformerLens's exact sweep on a random model (effects are small, so
    the estimate is good): Spearman >= 0.8 and the same clean/corrupt baselines."""
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    clean, corrupt, metric = data
    _, cache = model.run_with_cache(clean)
    tl = get_act_patch_attn_head_out_all_pos(model, corrupt, cache, metric)
    res = attribution_heads(model, clean, corrupt, metric, progress=False)
    assert res.values.shape == tl.shape == (3, 4)
    assert res.method == "attribution" and res.per_prompt.shape == (4, 3, 4)
    with torch.no_grad():
        assert res.corrupt == pytest.approx(float(metric(model(corrupt))), abs=1e-5)
        assert res.clean == pytest.approx(float(metric(model(clean))), abs=1e-5)
    rho = spearman(res.values - res.corrupt, tl - res.corrupt)
    print(f"random model: Spearman(attribution, TL exact) = {rho:.3f}")
    assert rho >= 0.8


def test_atp_on_uneven_reads_is_the_full_logits_gradient(model):
    """Prompts reading different numbers of positions (reads padded by repeating one, where
    the last MLP and the unembedding run): AtP equals the hand first-order estimate, the
    autograd gradient of the metric on full logits at each head's ``z`` dotted with its
    source-minus-base ``z``, mean over prompts (1e-6 absolute)."""
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(0, 64, (3, 10), generator=g)
    corrupt = torch.randint(0, 64, (3, 10), generator=g)
    pos = [[9], [4, 9], [3, 6, 9]]
    metric = token_logprob_metric(pos, [clean[i, p].tolist() for i, p in enumerate(pos)])
    res = attribution_heads(model, clean, corrupt, metric, progress=False)
    names = [hooks.z(la) for la in range(3)]
    kept = autograd_at(model, corrupt, metric, names)
    with torch.no_grad():
        _, src = model.run_with_cache(clean)
        want = torch.stack([((src[n] - kept[n]) * kept[n].grad).sum((0, 1, 3)) for n in names])
    torch.testing.assert_close(res.values - res.corrupt, want, atol=1e-6, rtol=1e-4)


def test_each_position_sums_to_all_and_batching(model, data):
    """Plain attribution is linear in the patch: per-position estimates sum to the all-position
    one; chunking prompts (batch_size=3 of 4) changes nothing (tolerance 1e-5)."""
    clean, corrupt, metric = data
    res_all = attribution_heads(model, clean, corrupt, metric, direction="noise",
                                site="v", progress=False)
    res_each = attribution_heads(model, clean, corrupt, metric, direction="noise",
                                 site="v", positions="each", batch_size=3,
                                 progress=False)
    assert res_each.values.shape == (3, 2, 12)  # v: KV heads (GQA)
    summed = (res_each.values - res_each.clean).sum(-1)
    torch.testing.assert_close(summed, res_all.values - res_all.clean, atol=1e-5, rtol=1e-4)


def test_atp_star_qk_own_softmax_is_near_exact(model, data):
    """For q/k, AtP* recomputes the head's own softmax exactly; the remaining (post-pattern)
    linearisation is tiny here: max abs error <= 2e-5 and at most the plain error."""
    clean, corrupt, metric = data
    for site in ("q", "k"):
        ex = exact_heads(model, clean, corrupt, metric, "noise", site)
        plain = attribution_heads(model, clean, corrupt, metric, direction="noise",
                                  site=site, progress=False)
        star = attribution_heads(model, clean, corrupt, metric, direction="noise",
                                 site=site, atp_star=True, progress=False)
        e_plain = float((plain.values - ex).abs().max())
        e_star = float((star.values - ex).abs().max())
        print(f"site {site}: max |err| plain {e_plain:.2e}, AtP* {e_star:.2e}")
        assert e_star <= 2e-5 and e_star <= e_plain


def test_atp_star_z_correction_vanishes_for_small_patches():
    """The AtP* correction is second order: for a corrupt run eps=0.01 from the clean one,
    AtP* and plain agree to within 1% of the effects' scale."""
    m = tiny_model()
    clean, corrupt = near_tokens(m, 0.01, seed=1)
    pos = [5, 8, 11]
    metric = token_logprob_metric([pos] * 4, [clean[i, pos].tolist() for i in range(4)])
    plain = attribution_heads(m, clean, corrupt, metric, direction="noise", progress=False)
    star = attribution_heads(m, clean, corrupt, metric, direction="noise", atp_star=True,
                             progress=False)
    scale = float((plain.values - plain.clean).abs().max())
    assert float((star.values - plain.values).abs().max()) <= 0.01 * scale


# --- (d) hybrid -------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_hybrid_verified_values_are_exact(model, data, direction):
    clean, corrupt, metric = data
    res = hybrid_heads(model, clean, corrupt, metric, direction=direction, top_k=5,
                       batch_size=8, progress=False)  # 2 cells per forward: packing
    ex = exact_heads(model, clean, corrupt, metric, direction)
    mask = verified_mask(res)
    assert res.method == "attribution+exact" and int(mask.sum()) == 5
    torch.testing.assert_close(res.values[mask], ex[mask], atol=1e-5, rtol=0)
    # unverified cells keep the attribution estimate
    est = torch.tensor(res.meta["attribution_values"])
    torch.testing.assert_close(res.values[~mask], est[~mask])
    # per-prompt exact values are consistent with the means
    torch.testing.assert_close(res.per_prompt.mean(0), res.values, atol=1e-5, rtol=0)
    # the verified cells are the top-5 by |estimated effect|
    base = res.corrupt if direction == "denoise" else res.clean
    top = (est - base).abs().flatten().topk(5).indices
    assert mask.flatten()[top].all()


def test_hybrid_per_position_cells_are_exact(model, data):
    clean, corrupt, metric = data
    res = hybrid_heads(model, clean, corrupt, metric, positions="each", top_k=6,
                       batch_size=8, progress=False)
    ex = ck.patch_heads(model, clean, corrupt, metric, positions="each",
                        options=dict(progress=False))
    mask = verified_mask(res)
    assert mask.shape == ex.values.shape and int(mask.sum()) == 6
    torch.testing.assert_close(res.values[mask], ex.values[mask], atol=1e-5, rtol=0)


# --- (b) Spearman on the shipped teacher --------------------------------------------------------

def _spearman_check(model, task_clean, task_corrupt, metric, threshold):
    res = attribution_heads(model, task_clean, task_corrupt, metric, progress=False)
    ex = ck.patch_heads(model, task_clean, task_corrupt, metric, method="exact",
                        options=dict(progress=False))
    a, e = res.values - res.corrupt, ex.values - ex.corrupt
    rho = spearman(a, e)
    k = min(10, a.numel())
    overlap = len(set(a.abs().flatten().topk(k).indices.tolist())
                  & set(e.abs().flatten().topk(k).indices.tolist()))
    print(f"Spearman(attribution, exact) = {rho:.3f}; top-{k} overlap = {overlap}/{k}")
    if threshold is not None:
        assert rho >= threshold
    return rho


def test_spearman_on_icd_teacher():
    model = ck.load_model("icd-teacher")
    task = ck.load_task("icd10", n_examples=16, split="test")
    _spearman_check(model, task.clean_tokens, task.corrupt_tokens, task.prompt_metric(), 0.8)


# --- (c) AtP* finds the previous-token head on the shipped induction-2l model ---------------------

def prev_token_head(model, tokens) -> int:
    """Layer-0 head with the most attention mass on position p - 1."""
    _, cache = model.run_with_cache(tokens, names_filter=[hooks.pattern(0)])
    pat = cache[hooks.pattern(0)]  # [b, h, q, k]
    return int(pat.diagonal(offset=-1, dim1=-2, dim2=-1).mean((0, -1)).argmax())


def test_atp_star_ranks_previous_token_head_first_on_induction_2l():
    model = ck.load_model("induction-2l")
    task = ck.load_task("induction", n_examples=32, split="test")
    metric = task.prompt_metric()
    clean, corrupt = task.clean_tokens, task.corrupt_tokens
    prev = prev_token_head(model, clean)
    ranks = {}
    for name, kw in [("plain", dict(atp_star=False)),
                     ("AtP* Q/K only (no exact tail)", dict(estimator="qk")),
                     ("AtP* (default: Q/K + exact tail)", dict(atp_star=True))]:
        res = attribution_heads(model, clean, corrupt, metric, direction="noise",
                                progress=False, **kw)
        norm = res.normalized().flatten()  # noise: -1 = behaviour fully broken
        ranks[name] = int((norm < norm[prev]).sum()) + 1  # 1 = most negative
        print(f"{name}: previous-token head L0H{prev} normalised {float(norm[prev]):+.2e}, "
              f"rank {ranks[name]} of {norm.numel()} (most negative first)")
    ex = exact_heads(model, clean, corrupt, metric, "noise")
    ex_norm = ((ex - res.clean) / (res.clean - res.corrupt)).flatten()
    print(f"exact: L0H{prev} normalised {float(ex_norm[prev]):+.3f}, rank "
          f"{int((ex_norm < ex_norm[prev]).sum()) + 1}")
    assert int((ex_norm < ex_norm[prev]).sum()) == 0  # the premise: exact ranks it first
    assert ranks["AtP* (default: Q/K + exact tail)"] == 1


def test_exact_tail_is_exact_for_last_layer_heads(model, data):
    """With the exact tail, last-layer heads (site z) are patched exactly (tolerance 1e-5)."""
    clean, corrupt, metric = data
    for direction in ("denoise", "noise"):
        star = attribution_heads(model, clean, corrupt, metric, direction=direction,
                                 atp_star=True, progress=False)
        ex = exact_heads(model, clean, corrupt, metric, direction)
        torch.testing.assert_close(star.values[-1], ex[-1], atol=1e-5, rtol=0)


def test_plain_callable_metric_matches_prompt_metric(model, data):
    """A plain ``logits -> scalar`` metric gives the same means as the PromptMetric (1e-5),
    with AtP* and the exact tail on, and no per-prompt values."""
    clean, corrupt, metric = data
    a = attribution_heads(model, clean, corrupt, metric, direction="noise",
                          atp_star=True, progress=False)
    b = attribution_heads(model, clean, corrupt, lambda lg: metric(lg), direction="noise",
                          atp_star=True, progress=False)
    assert b.per_prompt is None
    torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=0)


def test_atp_star_z_correction_moves_estimates_toward_exact_through_saturated_attention():
    """Shipped induction-2l: the layer-0 previous-token head acts through layer 1's saturated
    induction attention (K-composition). With a non-saturating readout (answer logit minus the
    mean logit), plain AtP misestimates layer-0 heads; AtP*'s Q/K fix (the exact tail off, so
    only the downstream-pattern correction acts) must cut the error at least in half, and move
    the previous-token head's noising estimate toward exact. Fails if the correction is zero."""
    from circuitkit.metrics import token_margin_metric

    model = ck.load_model("induction-2l")
    task = ck.load_task("induction", n_examples=8, vocab_size=64, split="test", seed=0)
    ex = task.examples
    metric = token_margin_metric([e.answer_pos for e in ex],
                                 [e.tokens[e.answer_pos].tolist() for e in ex], [[] for _ in ex])
    args = (model, task.clean_tokens, task.corrupt_tokens, metric)
    for direction in ("denoise", "noise"):
        exact = ck.patch_heads(*args, direction=direction, options=dict(progress=False)).values[0]
        plain = attribution_heads(*args, direction=direction, progress=False).values[0]
        star = attribution_heads(*args, direction=direction, estimator="qk",
                                 progress=False).values[0]  # (named: no exact tail)
        if direction == "denoise":
            assert (star - exact).abs().sum() < 0.5 * (plain - exact).abs().sum()
        else:
            h = int((exact - exact.median()).abs().argmax())  # the previous-token head
            assert (star[h] - exact[h]).abs() < (plain[h] - exact[h]).abs() - 0.3


def test_one_layer_reruns_on_a_parallel_block_ignore_its_kv_cache():
    """GPT-NeoX hands its attention the run's KV cache as ``layer_past``; re-running one layer
    (q/k sites: ``block``, ``qk``; z: ``qk``'s downstream patterns) must not append to it.
    Against exact on a random NeoX with effects of 0.05-0.17 (init range 0.2): recomputing the
    softmax exactly leaves q/k errors at most 0.7x plain AtP's (measured 0.4-0.6x), and in the
    last layer, where only the unembedding stays linearised, for q at most 0.2x (measured 0.08x);
    ``qk``'s correction on z does not make it worse than plain."""
    m = ck.load_model({"model_type": "gpt_neox", "vocab_size": 64, "hidden_size": 32,
                       "intermediate_size": 64, "num_hidden_layers": 3,
                       "num_attention_heads": 4, "max_position_embeddings": 64,
                       "initializer_range": 0.2, "seed": 0})
    assert m.cfg.parallel_attn_mlp
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 64, (4, 12), generator=g)
    corrupt = torch.randint(0, 64, (4, 12), generator=g)
    pos = [5, 8, 11]
    metric = token_logprob_metric([pos] * 4, [clean[i, pos].tolist() for i in range(4)])

    def err(site, est, ex):
        got = attribution_heads(m, clean, corrupt, metric, direction="noise", site=site,
                                estimator=est, progress=False)
        return (got.values - ex).abs().amax(1)  # [layer]

    for site in ("q", "k", "z"):
        ex = exact_heads(m, clean, corrupt, metric, "noise", site)
        plain = err(site, "atp", ex)
        for est in ("qk",) if site == "z" else ("block", "qk"):
            e = err(site, est, ex)
            print(f"NeoX site {site} {est}: max |err| per layer {e.tolist()} (plain "
                  f"{plain.tolist()})")
            assert e.max() <= (1.0 if site == "z" else 0.7) * plain.max()
            if site == "q":
                assert e[-1] <= 0.2 * plain[-1]
    hybrid = hybrid_heads(m, clean, corrupt, metric, direction="noise", site="k",
                          top_k=3, progress=False)
    ex = exact_heads(m, clean, corrupt, metric, "noise", "k")
    done = verified_mask(hybrid)
    assert int(done.sum()) >= 3
    torch.testing.assert_close(hybrid.values[done], ex[done], rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["gemma2", "olmo2", "llama"])
def test_block_estimate_is_its_definition_on_post_norm_blocks(model_type):
    """``block`` (site z) = ``dm/d resid_post_l . (resid_post_l with the head patched - base)``:
    the head's own block run exactly, first order after it. The reference takes both factors
    from the model's own runs (a hooked forward for the change, autograd for the gradient), so
    it holds whatever the block does with the write: Gemma 2 normalises the attention and MLP
    outputs before the residual add (random post-norm gains here), OLMo 2 only there (no norm
    before the MLP); Llama does not. Max error <= 1e-4 of the largest effect."""
    m = with_random_post_norms({"model_type": model_type, "vocab_size": 64, "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 3,
                                "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 8, "max_position_embeddings": 64, "seed": 0})
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 64, (3, 10), generator=g)
    corrupt = torch.randint(0, 64, (3, 10), generator=g)
    pos = [4, 9]
    metric = token_logprob_metric([pos] * 3, [clean[i, pos].tolist() for i in range(3)])
    got = attribution_heads(m, clean, corrupt, metric, direction="noise",
                            estimator="block", progress=False)
    _, src = m.run_with_cache(corrupt)
    want = torch.zeros(3, 4)
    kept = {}
    for layer in range(3):
        post = hooks.resid_post(layer)

        def grab(t, hook):
            t.requires_grad_(True)
            kept["r"] = t
            return t

        with torch.enable_grad():
            out = metric(m.run_with_hooks(clean, fwd_hooks=[(post, grab)]))
            (grad,) = torch.autograd.grad(out, kept["r"])
        base = kept["r"].detach()
        for h in range(4):
            def patch(t, hook, h=h, layer=layer):
                t = t.clone()
                t[:, :, h] = src[hooks.z(layer)][:, :, h]
                return t

            def keep(t, hook):
                kept["p"] = t.detach()

            with torch.no_grad():
                m.run_with_hooks(clean, fwd_hooks=[(hooks.z(layer), patch), (post, keep)])
            want[layer, h] = (grad * (kept["p"] - base)).sum()
    err = float((got.values - got.clean - want).abs().max())
    print(f"{model_type}: max |block - reference| {err:.2e} of {float(want.abs().max()):.2e}")
    assert err <= 1e-4 * float(want.abs().max())


def test_architectures_whose_layers_cannot_rerun_alone_fall_back_to_atp():
    """OPT's MLP is no module of its own in TransformerLens, so ``block`` (which re-runs the
    head's MLP) cannot run there: asking for it is a clear ValueError, and ``attribution+exact``
    screens with plain AtP instead (a RuntimeWarning says so), its verified cells still exact;
    so does ``method="auto"`` after its exact sweep."""
    from circuitkit.patching.estimators.attribution import layer_reruns

    m = ck.load_model({"model_type": "opt", "vocab_size": 64, "hidden_size": 32, "ffn_dim": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 4,
                       "max_position_embeddings": 64, "word_embed_proj_dim": 32, "seed": 0})
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 64, (3, 10), generator=g)
    corrupt = torch.randint(0, 64, (3, 10), generator=g)
    metric = token_logprob_metric([[9]] * 3, [[int(clean[i, 9])] for i in range(3)])
    assert layer_reruns(m, clean) == {"attn": True, "mlp": False}
    # a layout that can re-run its layers passes in bf16 too (a batch of two rounds differently)
    bf16 = ck.load_model({**TINY, "seed": 0}, dtype="bfloat16")
    assert layer_reruns(bf16, clean) == {"attn": True, "mlp": True}
    with pytest.raises(ValueError, match="estimator 'block' re-runs single layers"):
        attribution_heads(m, clean, corrupt, metric, estimator="block", progress=False)
    with pytest.warns(RuntimeWarning, match="screen is plain AtP"):
        res = hybrid_heads(m, clean, corrupt, metric, direction="noise", top_k=3,
                           progress=False)
    assert res.meta["estimator"] == "atp"
    ex = exact_heads(m, clean, corrupt, metric, "noise")
    done = verified_mask(res)
    assert int(done.sum()) == 3
    torch.testing.assert_close(res.values[done], ex[done], rtol=0, atol=1e-5)
    # method="auto" screens the same way: its exact sweep is not lost to the screen's refusal
    with pytest.warns(RuntimeWarning, match="screen is plain AtP"):
        auto = ck.patch_heads(m, clean, corrupt, metric, direction="noise", method="auto",
                              options=dict(progress=False, screening_recall=True))
    assert auto.meta["auto"]["screening"]["estimator"] == "atp"
    torch.testing.assert_close(auto.values, ex, rtol=0, atol=1e-5)
