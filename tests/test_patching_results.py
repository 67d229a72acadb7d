"""PatchResult: normalisation formulas, bootstrap interval, frames, heatmap, save/load."""

from __future__ import annotations

import pytest
import torch

from circuitkit.patching.results import PatchResult


def make(direction="denoise", n=40, seed=0, shape=(2, 3)):
    g = torch.Generator().manual_seed(seed)
    clean_pp = 2.0 + 0.1 * torch.randn(n, generator=g)
    corrupt_pp = 0.0 + 0.1 * torch.randn(n, generator=g)
    frac = torch.linspace(0, 1, shape[0] * shape[1]).reshape(shape)  # cell effect in [0, 1]
    noise = 0.05 * torch.randn(n, *shape, generator=g)
    if direction == "denoise":
        pp = corrupt_pp[:, None, None] + frac * (clean_pp - corrupt_pp)[:, None, None] + noise
    else:
        pp = clean_pp[:, None, None] - frac * (clean_pp - corrupt_pp)[:, None, None] + noise
    return PatchResult(values=pp.mean(0), clean=clean_pp.mean(), corrupt=corrupt_pp.mean(),
                       direction=direction, method="exact", site="z", positions="all",
                       per_prompt=pp, clean_per_prompt=clean_pp, corrupt_per_prompt=corrupt_pp,
                       meta={"model": "toy", "task_hash": "abc"})


def test_normalized_denoise_and_noise():
    d = make("denoise")
    torch.testing.assert_close(d.normalized(), (d.values - d.corrupt) / (d.clean - d.corrupt))
    # the built-in effect: cell fraction 0 -> ~0, 1 -> ~1
    assert abs(float(d.normalized()[0, 0])) < 0.05 and abs(float(d.normalized()[-1, -1]) - 1) < 0.05
    n = make("noise")
    torch.testing.assert_close(n.normalized(), (n.values - n.clean) / (n.clean - n.corrupt))
    # fully breaking the behaviour gives -1
    assert abs(float(n.normalized()[-1, -1]) + 1) < 0.05 and abs(float(n.normalized()[0, 0])) < 0.05


def test_confidence_interval_brackets_estimate_and_is_seeded():
    r = make()
    lo, hi = r.confidence_interval(level=0.95, n_boot=500, seed=0)
    est = r.normalized()
    assert lo.shape == hi.shape == est.shape
    assert (lo <= est + 1e-6).all() and (est <= hi + 1e-6).all() and (hi > lo).all()
    lo2, hi2 = r.confidence_interval(level=0.95, n_boot=500, seed=0)
    assert torch.equal(lo, lo2) and torch.equal(hi, hi2)
    lo50, hi50 = r.confidence_interval(level=0.5, n_boot=500, seed=0)
    assert ((hi50 - lo50) < (hi - lo)).all()
    # width shrinks like 1/sqrt(n): 4x the prompts -> roughly half the width
    wide = make(n=40, seed=1).confidence_interval(n_boot=500)
    narrow = make(n=640, seed=1).confidence_interval(n_boot=500)
    ratio = float(((narrow[1] - narrow[0]) / (wide[1] - wide[0])).mean())
    assert 0.15 < ratio < 0.4


def test_frame_top_heatmap():
    r = make()
    df = r.to_frame()
    assert list(df.columns) == ["layer", "head", "value", "normalized", "ci_low", "ci_high"]
    assert len(df) == 6
    row = df[(df["layer"] == 1) & (df["head"] == 2)].iloc[0]
    assert row.value == pytest.approx(float(r.values[1, 2]))
    top = r.top(2)
    assert list(zip(top["layer"], top["head"], strict=True)) == [(1, 2), (1, 1)]
    fig = r.heatmap()
    assert fig.data[0].z.shape == (2, 3)
    assert "normalized" in fig.data[0].hovertemplate
    each = PatchResult(values=torch.zeros(2, 3, 5), clean=1, corrupt=0, direction="denoise",
                       method="exact", site="z", positions="each")
    assert each.axes == ("layer", "head", "pos") and len(each.to_frame()) == 30
    assert [t.z.shape for t in each.heatmap().data] == [(2, 3)] * 5  # one facet per position


def test_save_load_roundtrip(tmp_path):
    r = make()
    written = r.save(tmp_path / "out" / "result")
    assert sorted(p.name for p in written) == ["result.csv", "result.html", "result.json",
                                               "result.safetensors"]
    assert all(p.exists() for p in written)
    back = PatchResult.load(tmp_path / "out" / "result.safetensors")
    assert torch.equal(PatchResult.load(tmp_path / "out").values, r.values)  # the folder
    for k in ("values", "per_prompt", "clean_per_prompt", "corrupt_per_prompt"):
        assert torch.equal(getattr(back, k), getattr(r, k))
    assert (back.clean, back.corrupt, back.direction, back.site, back.axes, back.meta) == (
        r.clean, r.corrupt, r.direction, r.site, r.axes, r.meta)
    bare = PatchResult(values=torch.ones(2, 4), clean=1, corrupt=0, direction="noise",
                       method="attribution", site="v", positions="all")
    bare.save(tmp_path / "bare")
    assert PatchResult.load(tmp_path / "bare").per_prompt is None
