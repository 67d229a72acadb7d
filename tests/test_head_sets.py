"""ck.HeadSetUnits: head sets patched together through the one entry (ck.patch): values equal a
plain TransformerLens hook loop, every metric read on the same logits, any chunking gives the
same values, the result saves and loads strictly, and bad input is one line."""

from __future__ import annotations

import json

import pytest
import torch
from test_validate import reference

import circuitkit as ck
from circuitkit import hooks
from circuitkit.experiments.validation import confusion_metric, focus_metric
from circuitkit.patching.exact.head_sets import derangement, resample_pairing
from circuitkit.patching.units.head_sets import set_values


@pytest.fixture(scope="module")
def synth():
    return ck.load_task("synthetic", n_examples=10, n_labels=8, children=4,
                        labels_per_note=(1, 1), split="test", seed=5)


SETS = [[], [(0, 1)], [(0, 0), (2, 3)], [(1, 2), (1, 0), (0, 3)], [(2, 1)]]


@pytest.mark.parametrize("direction", ["noise", "denoise"])
def test_sets_through_ck_patch_equal_a_hand_hook_loop(tiny_llama, synth, direction):
    """values [n_sets] and per_prompt [n_prompts, n_sets] of the metric, the extra metric's on
    the same patched logits (meta), baselines as patch_heads'; a 3-row batch (many chunks,
    prompts split) gives the same values as one chunk per lowest layer."""
    clean, corrupt, metric = synth.clean_tokens, synth.corrupt_tokens, synth.metric
    conf = confusion_metric(synth)
    units = ck.HeadSetUnits(SETS, metrics=[conf])
    res = ck.patch(tiny_llama, clean, corrupt, metric, units,
                   options=dict(direction=direction, progress=False))
    n = clean.shape[0]
    assert res.axes == ("set",) and res.values.shape == (5,) and res.per_prompt.shape == (n, 5)
    assert res.meta["sets"][2] == [[0, 0], [2, 3]] and res.meta["set_source"] == "source"
    base, source = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
    torch.testing.assert_close(res.per_prompt.T, reference(tiny_llama, base, source, SETS,
                                                           metric), atol=1e-5, rtol=0)
    every = set_values(res)
    assert list(every) == [metric.name, "confusion"]
    torch.testing.assert_close(every["confusion"].T, reference(tiny_llama, base, source, SETS,
                                                               conf), atol=1e-5, rtol=0)
    heads = ck.patch_heads(tiny_llama, clean, corrupt, metric, direction=direction,
                           options=dict(progress=False))
    assert res.clean == pytest.approx(heads.clean, abs=1e-6)
    assert res.corrupt == pytest.approx(heads.corrupt, abs=1e-6)
    small = ck.patch(tiny_llama, clean, corrupt, metric, units,
                     options=dict(direction=direction, progress=False, batch_size=3))
    assert small.meta["n_chunks"] > res.meta["n_chunks"]
    torch.testing.assert_close(small.per_prompt, res.per_prompt, atol=1e-5, rtol=0)
    torch.testing.assert_close(set_values(small)["confusion"], every["confusion"], atol=1e-5,
                               rtol=0)


def test_ablation_sources_pair_prompts_once_whatever_the_chunks(tiny_llama, synth):
    """zero / mean / resample of the base run through ck.patch equal run_head_sets' (resample:
    ``resample_pairing``, prompts in length order, however many chunks); the pairing is a
    derangement within each length bucket, seeded by seed + its first prompt."""
    clean, metric = synth.clean_tokens, focus_metric(synth)
    pair = resample_pairing(10, 7)
    assert not bool((pair == torch.arange(10)).any())
    # buckets [0, 2), [2, 5), [5, 8), [8, 10) (round(10 i / 4): 2, 5, 8, 10)
    assert torch.equal(pair[:2], derangement(2, 7))
    assert torch.equal(pair[5:8], derangement(3, 12) + 5)
    for source in ("zero", "mean", "resample"):
        got = [ck.patch(tiny_llama, clean, clean, metric,
                        ck.HeadSetUnits(SETS, source=source, seed=7),
                        options=dict(direction="noise", progress=False, batch_size=b))
               for b in (None, 4)]
        torch.testing.assert_close(got[0].per_prompt, got[1].per_prompt, atol=1e-5, rtol=0)


def test_resample_pairing_buckets():
    """Buckets of ``round(n i / 4)``; one of a single prompt joins its neighbour."""
    assert resample_pairing(10, 0).tolist() != list(range(10))
    p5 = resample_pairing(5, 3)  # bounds 0, 1, 2, 4, 5: singles join -> [0, 2), [2, 5)
    assert sorted(p5[:2].tolist()) == [0, 1] and sorted(p5[2:].tolist()) == [2, 3, 4]
    with pytest.raises(ValueError, match="at least 2"):
        resample_pairing(1, 0)


def test_a_head_set_result_saves_and_loads_strictly(tiny_llama, synth, tmp_path):
    res = ck.patch(tiny_llama, synth.clean_tokens, synth.corrupt_tokens, synth.metric,
                   ck.HeadSetUnits(SETS, metrics=[confusion_metric(synth)]),
                   options=dict(progress=False))
    res.save(tmp_path / "r")
    back = ck.PatchResult.load(tmp_path / "r")
    assert back.axes == ("set",) and torch.equal(back.values, res.values)
    assert torch.equal(set_values(back)["confusion"], set_values(res)["confusion"])
    assert back.to_frame()["set"].tolist()[:2] == ["none", "L0H1"]
    assert "L0H0 L2H3" in (tmp_path / "r.csv").read_text()
    info = json.loads((tmp_path / "r.json").read_text())
    for edit, field in ((lambda m: (m["sets"].pop(), [row.pop() for row in m[
                            "extra_per_prompt"]["confusion"]]), "tensor 'values' has shape"),
                        (lambda m: m["sets"][1].append([0, 99]), "meta.sets"),
                        (lambda m: m["extra_per_prompt"]["confusion"][0].pop(),
                         "meta.extra_per_prompt"),
                        (lambda m: m["extra_per_prompt"]["confusion"].pop(),
                         "extra_per_prompt"),
                        (lambda m: m["sets"][1].__setitem__(0, [0, 2]), "digest")):
        bad = json.loads(json.dumps(info))
        edit(bad["meta"])
        (tmp_path / "r.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("'", ".")):
            ck.PatchResult.load(tmp_path / "r")


def test_head_set_units_refuse_bad_input_in_one_line(tiny_llama, synth):
    clean, corrupt, metric = synth.clean_tokens, synth.corrupt_tokens, synth.metric
    for kw, match in ((dict(sets=[]), "non-empty list of head sets"),
                      (dict(sets="L0H1"), "non-empty list of head sets"),
                      (dict(sets=[[(0, 1)]], site="q"), "site="),
                      (dict(sets=[[(0, 1)]], source="shuffle"), "source="),
                      (dict(sets=[[(0, 1)]], site="pattern", source="zero"), "ablates z"),
                      (dict(sets=[[(0, 1)]], metrics=[lambda x: x]), r"metrics\[0\]"),
                      (dict(sets=[[(0, 1)]], metrics=[focus_metric(synth)] * 2), "distinct")):
        with pytest.raises(ValueError, match=match):
            ck.HeadSetUnits(**kw)
    f = hooks.facts(tiny_llama)
    with pytest.raises(ValueError, match="outside the model"):
        ck.patch(tiny_llama, clean, corrupt, metric, ck.HeadSetUnits([[(f.n_layers, 0)]]),
                 options=dict(progress=False))
    with pytest.raises(ValueError, match="exactly"):
        ck.patch(tiny_llama, clean, corrupt, metric, ck.HeadSetUnits([[(0, 0)]]),
                 "attribution", options=dict(progress=False))
    with pytest.raises(ValueError, match="at least 2"):
        ck.patch(tiny_llama, clean[:1], clean[:1], synth.subset([0]).metric,
                 ck.HeadSetUnits([[(0, 0)]], source="resample"), options=dict(progress=False))
    with pytest.raises(ValueError, match="made for"):
        ck.patch(tiny_llama, clean, corrupt, metric,
                 ck.HeadSetUnits([[(0, 0)]], metrics=[synth.subset([0, 1]).metric]),
                 options=dict(progress=False))


def test_a_plain_callable_metric_goes_through_the_entry(tiny_llama):
    """A plain callable ``logits -> [batch]`` is wrapped once by the entry (its reads probed and
    checked on the engine's cached runs), as for every other unit: same values as a hand hook
    loop; a scalar one (the mean) gives the same values without per-prompt values."""
    from circuitkit.patching.results import quiet_baseline

    g = torch.Generator().manual_seed(3)
    clean, corrupt = (torch.randint(1, 64, (4, 6), generator=g) for _ in range(2))

    def margin(logits):
        return logits[:, -1, 5] - logits[:, -1, 7]

    sets = [[], [(0, 0)], [(1, 1), (2, 3)]]
    with quiet_baseline():  # (a random model: its baselines need not differ)
        res = ck.patch(tiny_llama, clean, corrupt, margin, ck.HeadSetUnits(sets),
                       options=dict(progress=False))
        scalar = ck.patch(tiny_llama, clean, corrupt, lambda lg: margin(lg).mean(),
                          ck.HeadSetUnits(sets), options=dict(progress=False))
    pm = ck.as_metric(margin, 4, 6, hooks.facts(tiny_llama).d_vocab_out)
    torch.testing.assert_close(res.per_prompt.T, reference(tiny_llama, corrupt, clean, sets, pm),
                               atol=1e-5, rtol=0)
    assert scalar.per_prompt is None
    torch.testing.assert_close(scalar.values, res.values, atol=1e-5, rtol=0)


def test_a_head_set_result_keeps_its_prompts_together(tiny_llama, synth, tmp_path):
    """select_prompts keeps the extra metrics' values of the same prompts, and the selection
    saves and loads."""
    res = ck.patch(tiny_llama, synth.clean_tokens, synth.corrupt_tokens, synth.metric,
                   ck.HeadSetUnits(SETS, metrics=[confusion_metric(synth)]),
                   options=dict(progress=False))
    some = res.select_prompts(torch.tensor([1, 4, 7]))
    assert torch.equal(set_values(some)["confusion"], set_values(res)["confusion"][[1, 4, 7]])
    some.save(tmp_path / "s", views=False)
    back = ck.PatchResult.load(tmp_path / "s")
    assert torch.equal(set_values(back)["confusion"], set_values(some)["confusion"])
