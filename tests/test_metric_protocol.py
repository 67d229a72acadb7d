"""One metric protocol: whatever form a metric takes (PromptMetric, plain lambda returning the mean,
one value per prompt, non-differentiable), sweeps give the same values under every method.

Tolerance: 1e-5 absolute (same arithmetic; only the order of float additions may differ).
"""

from __future__ import annotations

import pytest
import torch

import circuitkit as ck
from circuitkit.metrics import PromptMetric, as_metric

ATOL = 1e-5
METHODS = ("exact", "attribution", "attribution+exact")


def last_position_pair(seq: int, a: int, b: int) -> tuple:
    """``logit[a] - logit[b]`` at the last position, as a plain lambda and as a PromptMetric."""
    def lam(logits):
        return (logits[:, -1, a] - logits[:, -1, b]).mean()

    def fn(logits, idx, rows):
        at = rows[:, seq - 1]
        step = logits[torch.arange(logits.shape[0]), at]
        return step[:, a] - step[:, b]

    return lam, PromptMetric(fn, "last_margin", reads=torch.full((1, 1), seq - 1))


def argmax_pair(seq: int, a: int) -> tuple:
    """Non-differentiable: is token ``a`` the argmax at the last position (per prompt)."""
    def lam(logits):
        return (logits[:, -1].argmax(-1) == a).float()

    def fn(logits, idx, rows):
        return (logits[torch.arange(logits.shape[0]), rows[:, seq - 1]].argmax(-1) == a).float()

    return lam, PromptMetric(fn, "argmax")


def forms(task, seq: int, a: int, b: int) -> dict[str, tuple]:
    pm = task.metric
    n = len(task)
    lam_last, pm_last = last_position_pair(seq, a, b)
    pm_last = PromptMetric(pm_last.per_prompt_fn, "last_margin",
                           reads=torch.full((n, 1), seq - 1))
    lam_arg, pm_arg = argmax_pair(seq, a)
    return {
        "last position, scalar": (lam_last, pm_last),
        "answer positions, scalar": (lambda logits: pm(logits), pm),
        "answer positions, per prompt": (lambda logits: pm.per_prompt(logits), pm),
        "argmax, per prompt": (lam_arg, pm_arg),
    }


def one_length(task, n: int):
    """``n`` examples of ``task`` of one token length (the commonest): a metric reading position
    -1 then reads every prompt's own last token (right-padded prompts are refused,
    tests/test_metric_staleness.py)."""
    from collections import Counter

    length = Counter(len(e.tokens) for e in task.examples).most_common(1)[0][0]
    return task.subset([i for i, e in enumerate(task.examples) if len(e.tokens) == length][:n])


@pytest.fixture(scope="module", params=["icd-teacher", "tiny_gqa_llama"])
def setup(request):
    if request.param == "icd-teacher":
        model = ck.load_model("icd-teacher")
        task = one_length(ck.load_task("icd10", n_examples=40, split="test", seed=4), 5)
    else:
        model = request.getfixturevalue("tiny_llama")  # 3 layers, GQA 4/2, rotary
        task = ck.load_task("induction", n_examples=4, seg_len=5, vocab_size=64, seed=1)
    seq = task.clean_tokens.shape[1]
    return model, task, seq


@pytest.mark.parametrize("method", METHODS)
def test_every_metric_form_gives_the_same_sweep(setup, method):
    model, task, seq = setup
    a, b = int(task.clean_tokens[0, -2]), int(task.clean_tokens[0, 1])
    args = (model, task.clean_tokens, task.corrupt_tokens)
    for name, (lam, pm) in forms(task, seq, a, b).items():
        for direction in ("denoise", "noise"):
            kw = dict(direction=direction, method=method, options=dict(
                progress=False, **({"top_k": 6} if method == "attribution+exact" else {})))
            if "argmax" in name and method != "exact":  # no gradient: refused, in either form
                for form in (lam, pm):
                    with pytest.raises(ValueError, match="carries no gradient"):
                        ck.patch_heads(*args, form, **kw)
                continue
            plain = ck.patch_heads(*args, lam, **kw)
            ref = ck.patch_heads(*args, pm, **kw)
            torch.testing.assert_close(plain.values, ref.values, atol=ATOL, rtol=0,
                                       msg=f"{name}, {method}, {direction}")
            assert plain.clean == pytest.approx(ref.clean, abs=ATOL)
            assert plain.corrupt == pytest.approx(ref.corrupt, abs=ATOL)
            per_prompt = "per prompt" in name
            assert (plain.per_prompt is not None) == per_prompt, name
            if per_prompt:
                torch.testing.assert_close(plain.per_prompt, ref.per_prompt, atol=ATOL, rtol=0)


def test_probe_finds_read_positions_and_says_when_it_cannot(setup):
    model, task, seq = setup
    n, V = len(task), int(model.cfg.d_vocab)
    a, b = int(task.clean_tokens[0, -2]), int(task.clean_tokens[0, 1])
    f = forms(task, seq, a, b)
    last = as_metric(f["last position, scalar"][0], n, seq, V)
    assert not last.per_prompt_values and torch.equal(last.reads, torch.full((n, 1), seq - 1))
    answers = as_metric(f["answer positions, per prompt"][0], n, seq, V)
    assert answers.per_prompt_values
    for got, want in zip(answers.reads, task.metric.reads, strict=True):
        assert set(got.tolist()) == set(want.tolist())
    arg = as_metric(f["argmax, per prompt"][0], n, seq, V)
    assert arg.reads is None and "not differentiable" in arg.note
    res = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, f["argmax, per prompt"][0],
                         options=dict(progress=False))
    assert "not differentiable" in res.meta["metric_note"]


def test_a_wrapped_metric_is_wrapped_once_and_checks_its_shape(setup):
    model, task, seq = setup
    pm = task.metric
    assert as_metric(pm) is pm
    with pytest.raises(ValueError, match=r"expected a scalar \(mean over prompts\) or"):
        as_metric(lambda logits: logits[:, -1, :3], len(task), seq, int(model.cfg.d_vocab))
    with pytest.raises(ValueError, match="needs n_prompts"):
        as_metric(lambda logits: logits.sum())
    with pytest.raises(ValueError, match="callable"):
        as_metric(3)


def test_scalar_metric_cannot_be_split_over_prompts(setup):
    """A scalar metric sees all prompts at once: a small batch_size never splits them."""
    model, task, seq = setup
    lam = forms(task, seq, 5, 6)["answer positions, scalar"][0]
    small = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, lam,
                           options=dict(batch_size=1, progress=False))
    big = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                         options=dict(progress=False))
    torch.testing.assert_close(small.values, big.values, atol=ATOL, rtol=0)


def test_a_metric_vmap_cannot_run_takes_the_plain_loop(setup):
    """A callable that calls ``.item()`` cannot be batched by torch.vmap: the wrapper notices at
    the probe and calls it once per copy, with the same values."""
    model, task, seq = setup
    a, b = int(task.clean_tokens[0, -2]), int(task.clean_tokens[0, 1])
    lam, pm = forms(task, seq, a, b)["last position, scalar"]

    def stubborn(logits):
        scale = 1.0 + 0.0 * float(logits[0, 0, 0].item())  # .item(): no vmap
        return lam(logits) * scale

    args = (model, task.clean_tokens, task.corrupt_tokens)
    got = ck.patch_heads(*args, stubborn, options=dict(progress=False))
    ref = ck.patch_heads(*args, pm, options=dict(progress=False))
    torch.testing.assert_close(got.values, ref.values, atol=ATOL, rtol=0)


def _hand_denoise(model, task, metric, layer: int, head: int) -> float:
    """Metric of the corrupt run with one head's z taken from the clean run (a hooks loop)."""
    from circuitkit import hooks

    name = hooks.z(layer)
    with torch.no_grad():
        _, cache = model.run_with_cache(task.clean_tokens, names_filter=lambda n: n == name)

    def put(z, hook):
        z = z.clone()
        z[:, :, head] = cache[name][:, :, head]
        return z

    with torch.no_grad():
        return float(metric(model.run_with_hooks(task.corrupt_tokens,
                                                 fwd_hooks=[(name, put)])).mean())


def test_a_metric_reading_where_it_has_no_gradient_gets_every_position(setup):
    """A max over positions passes gradient to its argmax only: the probe's gradient alone
    declared one position read, and sweeps handed the metric zeros elsewhere (wrong values,
    baselines included). The value check sees it."""
    model, task, seq = setup
    a = int(task.clean_tokens[0, -2])

    def best(logits):
        return logits.log_softmax(-1)[:, :, a].max(dim=1).values

    pm = as_metric(best, len(task), seq, int(model.cfg.d_vocab))
    assert pm.reads is None and "no gradient" in pm.note and pm.per_prompt_values
    res = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, best,
                         options=dict(progress=False))
    with torch.no_grad():
        assert res.clean == pytest.approx(float(best(model(task.clean_tokens)).mean()), abs=ATOL)
    last = model.cfg.n_layers - 1
    for lay, h in ((0, 0), (last, 1)):
        assert float(res.values[lay, h]) == pytest.approx(_hand_denoise(model, task, best, lay, h),
                                                          abs=ATOL)


def test_a_metric_mixing_prompts_is_never_split(setup):
    """``x - x.mean()``: one value per prompt, but each depends on every prompt. Split over
    chunks it saw zeros for the other prompts and its values changed with batch_size."""
    model, task, seq = setup
    a = int(task.clean_tokens[0, -2])

    def centred(logits):
        x = logits[:, -1, a]
        return x - 0.5 * x.mean()

    pm = as_metric(centred, len(task), seq, int(model.cfg.d_vocab))
    assert not pm.per_prompt_values and "depends on other prompts" in pm.note
    assert torch.equal(pm.reads, torch.full((len(task), 1), seq - 1))  # reads still known
    runs = [ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, centred,
                           options=dict(batch_size=bs, progress=False)) for bs in (None, 1)]
    torch.testing.assert_close(runs[0].values, runs[1].values, atol=ATOL, rtol=0)
    assert runs[0].per_prompt is None
    assert float(runs[0].values[0, 0]) == pytest.approx(
        _hand_denoise(model, task, centred, 0, 0), abs=ATOL)
    # prompts that each read their own logits stay per prompt, by every bit of their index
    own = as_metric(lambda logits: logits[:, -1, a] * 2.0, len(task), seq,
                    int(model.cfg.d_vocab))
    assert own.per_prompt_values
