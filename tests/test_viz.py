"""Figures on known inputs: cells, integer ticks, hover fields, one colour scale centred at zero,
facets per position, score/validation/ablation charts, attention views (offline HTML)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from circuitkit.experiments import charts
from circuitkit.patching.results import PatchResult
from circuitkit.viz import heatmaps

META = {"model_name": "icd-teacher", "task": "icd10", "phase": 2,
        "metric": "target_vs_near_miss_margin", "n_prompts": 6}


def result(values, direction="denoise", per_prompt=True, positions="all", axes=None, seed=0):
    """clean = 1, corrupt = 0, so normalized = values (denoise) or values - 1 (noise).
    With ``per_prompt``: 6 prompts whose mean is exactly ``values`` (intervals non-trivial)."""
    values = torch.as_tensor(values, dtype=torch.float32)
    pp = cpp = kpp = None
    if per_prompt:
        g = torch.Generator().manual_seed(seed)
        jitter = 0.1 * torch.randn(6, *values.shape, generator=g)
        pp = values + jitter - jitter.mean(0)
        cpp, kpp = torch.ones(6), torch.zeros(6)
    return PatchResult(values=values, clean=1.0, corrupt=0.0, direction=direction, method="exact",
                       site="z" if axes is None else "resid_pre", positions=positions,
                       per_prompt=pp, clean_per_prompt=cpp, corrupt_per_prompt=kpp, axes=axes,
                       meta=dict(META))


def test_import_is_light():
    import subprocess
    import sys

    code = ("import sys, circuitkit, circuitkit.viz; "
            "assert not {'torch', 'plotly'} & set(sys.modules), 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_heatmap_cells_integer_ticks_hover_and_title():
    vals = torch.arange(12.0).reshape(3, 4) / 10  # 3 layers x 4 heads, normalized = vals
    res = result(vals)
    fig = heatmaps.patch_heatmap(res)
    (tr,) = fig.data
    np.testing.assert_allclose(tr.z, vals.numpy(), rtol=0, atol=1e-6)
    assert list(tr.x) == [0, 1, 2, 3] and list(tr.y) == [0, 1, 2]
    # integer ticks on every cell (the old heatmap labelled rows -0.5, 0.5, ...)
    assert list(fig.layout.yaxis.tickvals) == [0, 1, 2]
    assert list(fig.layout.yaxis.ticktext) == ["0", "1", "2"]
    assert list(fig.layout.xaxis.tickvals) == [0, 1, 2, 3]
    assert fig.layout.yaxis.tickmode == "array" and fig.layout.yaxis.autorange == "reversed"
    assert fig.layout.xaxis.title.text == "head" and fig.layout.yaxis.title.text == "layer"
    for field in ("layer %{y}", "head %{x}", "value %{customdata[0]", "normalized %{z",
                  "95% interval [%{customdata[1]", "%{customdata[2]"):
        assert field in tr.hovertemplate
    lo, hi = res.confidence_interval()
    custom = np.asarray(tr.customdata)
    assert custom.shape == (3, 4, 3)
    np.testing.assert_allclose(custom[..., 0], vals.numpy(), atol=1e-6)
    np.testing.assert_allclose(custom[..., 1], lo.numpy(), atol=1e-6)
    np.testing.assert_allclose(custom[..., 2], hi.numpy(), atol=1e-6)
    assert (custom[..., 1] < custom[..., 2]).all()
    title = fig.layout.title.text
    for part in ("icd-teacher", "icd10 phase 2", "target_vs_near_miss_margin", "denoise",
                 "6 prompts"):
        assert part in title
    # colour centred at zero, symmetric range = the largest |normalized|
    ca = fig.layout.coloraxis
    assert ca.cmid == 0 and ca.cmax == pytest.approx(1.1) and ca.cmin == pytest.approx(-1.1)
    # PatchResult.heatmap delegates to the same function
    assert np.array_equal(res.heatmap().data[0].z, tr.z)


def test_heatmap_ticks_stay_integers_for_deep_models_and_no_interval_without_prompts():
    res = result(torch.zeros(80, 64), per_prompt=False)
    fig = heatmaps.patch_heatmap(res)
    ticks = list(fig.layout.yaxis.tickvals)
    assert ticks[0] == 0 and all(isinstance(t, int) for t in ticks)
    assert np.diff(ticks).min() == np.diff(ticks).max() >= 1 and len(ticks) <= 25
    assert "interval" not in fig.data[0].hovertemplate
    assert np.asarray(fig.data[0].customdata).shape == (80, 64, 1)
    assert fig.layout.coloraxis.cmin == -fig.layout.coloraxis.cmax  # all-zero: still symmetric


def test_heatmap_model_path_shortened_and_layer_sites():
    res = result(torch.zeros(2, 5), axes=("layer", "pos"), positions="each")
    res.meta = {"model": "/some/where/assets/icd-teacher", "metric": "m"}
    fig = heatmaps.patch_heatmap(res)
    assert fig.layout.title.text.startswith("icd-teacher · metric m · denoise")
    assert fig.layout.xaxis.title.text == "pos" and "pos %{x}" in fig.data[0].hovertemplate
    hub = result(torch.zeros(2, 2))
    hub.meta = {"model": "meta-llama/Llama-3.1-8B"}
    assert heatmaps.patch_heatmap(hub).layout.title.text.startswith("meta-llama/Llama-3.1-8B")


def test_side_by_side_share_one_scale_centred_at_zero():
    d = result(torch.tensor([[0.5, 0.0], [0.25, 0.1]]))           # normalized max 0.5
    n = result(torch.tensor([[0.2, 1.0], [1.0, 0.9]]), direction="noise")  # normalized min -0.8
    fig = heatmaps.patch_heatmaps(d, n)
    assert len(fig.data) == 2
    assert [t.coloraxis for t in fig.data] == ["coloraxis", "coloraxis"]
    assert all(t.zmin is None and t.zmax is None for t in fig.data)  # no per-panel scale
    ca = fig.layout.coloraxis
    assert ca.cmid == 0 and ca.cmax == pytest.approx(0.8) and ca.cmin == pytest.approx(-0.8)
    np.testing.assert_allclose(fig.data[1].z, [[-0.8, 0.0], [0.0, -0.1]], atol=1e-6)
    assert fig.data[0].xaxis == "x" and fig.data[1].xaxis == "x2"  # side by side
    titles = [a.text for a in fig.layout.annotations]
    assert titles[0].startswith("denoise") and titles[1].startswith("noise")
    assert list(fig.layout.yaxis2.tickvals) == [0, 1]
    with pytest.raises(ValueError, match="denoise= must be a PatchResult with direction"):
        heatmaps.patch_heatmaps(n, d)
    with pytest.raises(ValueError, match="same sweep"):
        heatmaps.patch_heatmaps(d, result(torch.zeros(3, 2), direction="noise"))


def test_facets_per_position():
    vals = torch.zeros(2, 3, 5)
    vals[1, 2, 3] = 0.9
    res = result(vals, positions="each")
    fig = heatmaps.patch_heatmap(res, tokens=["a", "b", "c", "d", "e"])
    assert len(fig.data) == 5
    for p, tr in enumerate(fig.data):
        np.testing.assert_allclose(tr.z, vals[..., p].numpy(), atol=1e-6)
        assert f"pos {p}" in tr.hovertemplate and tr.coloraxis == "coloraxis"
    assert [a.text for a in fig.layout.annotations] == [f"pos {p}: {t}"
                                                        for p, t in enumerate("abcde")]
    # more positions than facets: the strongest, in position order
    big = torch.zeros(2, 3, 30)
    big[0, 0, 7], big[1, 1, 21], big[0, 2, 3] = 0.5, -0.9, 0.1
    fig = heatmaps.patch_heatmap(result(big, positions="each", per_prompt=False), max_facets=2)
    assert [a.text for a in fig.layout.annotations] == ["pos 7", "pos 21"]
    assert "2 of 30 positions" in fig.layout.title.text
    fig = heatmaps.patch_heatmaps(result(big, positions="each", per_prompt=False),
                                  result(big, "noise", positions="each", per_prompt=False),
                                  positions=[3])
    assert len(fig.data) == 2 and fig.layout.coloraxis.cmax == pytest.approx(1.9)
    with pytest.raises(ValueError, match="positions="):
        heatmaps.patch_heatmap(result(big, positions="each", per_prompt=False), positions=[30])
    for kw in (dict(max_facets=0), dict(facet_cols=0)):  # were a ZeroDivisionError in plotly
        with pytest.raises(ValueError, match="expected a positive integer"):
            heatmaps.patch_heatmap(result(big, positions="each", per_prompt=False), **kw)
    with pytest.raises(ValueError, match="no per-position facets"):  # was silently ignored
        heatmaps.patch_heatmap(result(vals[..., 0]), positions=[0])


@pytest.fixture
def scores():
    rows = [dict(layer=la, head=h, sharpness=float(la + h), anchor_alignment=0.1,
                 coarse_score=float(4 - la) + 0.1 * h, loopback=0.0, margin_widening=1.0,
                 refine_score=float(la) + 0.01 * h) for la in range(4) for h in range(3)]
    df = pd.DataFrame(rows)
    df["phase1_rank"] = df["coarse_score"].rank(ascending=False).astype(int)
    df["phase2_rank"] = df["refine_score"].rank(ascending=False).astype(int)
    return df


def test_score_scatter(scores):
    fig = charts.score_scatter(scores, label_top=2)
    (tr,) = fig.data
    np.testing.assert_array_equal(tr.x, scores["coarse_score"])
    np.testing.assert_array_equal(tr.y, scores["refine_score"])
    np.testing.assert_array_equal(tr.marker.color, scores["layer"])
    assert tr.marker.colorbar.title.text == "layer"
    assert list(tr.marker.colorbar.tickvals) == [0, 1, 2, 3]
    labelled = sorted(a.text for a in fig.layout.annotations)
    assert labelled == sorted(["L0H2", "L0H1", "L3H2", "L3H1"])  # top 2 of each score
    for a in fig.layout.annotations:  # each label points at its own head
        la, h = int(a.text[1]), int(a.text[3])
        row = scores[(scores["layer"] == la) & (scores["head"] == h)].iloc[0]
        assert (a.x, a.y) == (row.coarse_score, row.refine_score)
    assert "coarse_score" in fig.layout.xaxis.title.text
    assert "refine_score" in fig.layout.yaxis.title.text
    assert "Phase 1 rank" in tr.hovertemplate and "phase1" not in tr.hovertemplate
    with pytest.raises(ValueError, match=r"missing \['refine_score'\]"):
        charts.score_scatter(scores.drop(columns="refine_score"))


def test_phase_profile_means_by_layer(scores):
    fig = charts.phase_profile(scores, n_layers=4)
    p1, p2 = fig.data
    np.testing.assert_allclose(p1.x, [0, 1, 2, 3])  # layers, ticked by layer number
    assert list(fig.layout.xaxis.tickvals) == [0, 1, 2, 3]
    assert fig.layout.xaxis.title.text.startswith("layer") and "depth" not in \
        fig.layout.xaxis.title.text
    np.testing.assert_allclose(p1.y, [4.1, 3.1, 2.1, 1.1])  # mean of 4 - l + 0.1 h, h = 0..2
    np.testing.assert_allclose(p2.y, [0.01, 1.01, 2.01, 3.01])
    np.testing.assert_allclose(p1.error_y.array, [0.1 / np.sqrt(3)] * 4)  # std 0.1 over 3 heads
    assert p1.yaxis == "y" and p2.yaxis == "y2"
    assert "Phase 1" in p1.name and "Phase 2" in p2.name
    with pytest.raises(ValueError, match="n_layers=3"):
        charts.phase_profile(scores, n_layers=3)


def test_validation_chart():
    rows = []
    for phase, measure in ((1, "focus"), (2, "confusion")):
        for direction in ("noise", "denoise"):
            for s, eff in (("top-3", -0.4), ("random", -0.02)):
                rows.append(dict(phase=phase, measure=measure, direction=direction, set=s,
                                 effect=eff, ci_low=eff - 0.1, ci_high=eff + 0.05,
                                 p_value=0.01 if s == "top-3" else np.nan))
    val = pd.DataFrame(rows)
    fig = charts.validation_chart(val)
    assert [a.text for a in fig.layout.annotations] == ["Phase 1, focus", "Phase 2, confusion"]
    assert len(fig.data) == 4  # 2 panels x 2 sets
    top = fig.data[0]
    # each direction's p-value under its name, not a label beside a marker (it ran into the
    # next set's error bar: issue 44.7)
    assert top.name == "top-3" and list(top.x) == ["noise<br>p = 0.01", "denoise<br>p = 0.01"]
    assert list(fig.data[1].x) == list(top.x) and top.mode == "markers"
    np.testing.assert_allclose(top.y, [-0.4, -0.4])
    np.testing.assert_allclose(top.error_y.array, [0.05, 0.05])
    np.testing.assert_allclose(top.error_y.arrayminus, [0.1, 0.1])
    # documented aliases, no optional columns
    alias = pd.DataFrame({"head_set": ["top", "random"], "effect_size": [1.0, 0.1]})
    fig = charts.validation_chart(alias)
    assert len(fig.data) == 2 and fig.data[0].error_y.array is None
    with pytest.raises(ValueError, match="expected a column 'effect'"):
        charts.validation_chart(pd.DataFrame({"set": ["a"], "x": [1.0]}))


def test_ablation_chart():
    rows = [dict(variant=v, metric=m, value=i + 0.1 * j, ci_low=i + 0.1 * j - 0.05,
                 ci_high=i + 0.1 * j + 0.05, n_seeds=3)
            for i, v in enumerate(["cot", "cot+p1", "cot+p1+p2"])
            for j, m in enumerate(["focus", "confusion"])]
    frame = pd.DataFrame(rows)
    fig = charts.ablation_chart(frame)
    assert [a.text for a in fig.layout.annotations] == ["focus", "confusion"]
    focus = fig.data[0]
    assert list(focus.x) == ["cot", "cot+p1", "cot+p1+p2"]
    np.testing.assert_allclose(focus.y, [0, 1, 2])
    np.testing.assert_allclose(focus.error_y.array, [0.05] * 3)
    np.testing.assert_allclose(fig.data[1].y, [0.1, 1.1, 2.1])
    assert list(fig.layout.xaxis.categoryarray) == ["cot", "cot+p1", "cot+p1+p2"]
    with pytest.raises(ValueError, match="variant"):
        charts.ablation_chart(frame.drop(columns="variant"))
    with pytest.raises(ValueError, match="n_cols=0: expected a positive integer"):
        charts.ablation_chart(frame, n_cols=0)  # was a ZeroDivisionError


@pytest.fixture(scope="module")
def teacher_and_task():
    import circuitkit as ck

    torch.set_num_threads(1)
    return ck.load_model("icd-teacher"), ck.load_task("icd10", n_examples=2, split="test")


def test_attention_view(teacher_and_task):
    from circuitkit import hooks
    from circuitkit.viz.attention import attention

    model, task = teacher_and_task
    view = attention(model, task, heads=[(0, 1), (3, 2)], example=1)
    ex = task.examples[1]
    seq = len(ex.tokens)
    assert view.patterns.shape == (2, seq, seq)
    # reference: TransformerLens's own full cache of the same run
    _, cache = model.run_with_cache(ex.tokens[None])
    for i, (layer, head) in enumerate([(0, 1), (3, 2)]):
        np.testing.assert_allclose(view.patterns[i],
                                   cache[hooks.pattern(layer)][0, head].numpy(), atol=1e-6)
    np.testing.assert_allclose(view.patterns.sum(-1), 1.0, atol=1e-5)
    assert np.triu(view.patterns, k=1).max() == 0  # causal
    words = [task.vocab[int(t)] for t in ex.tokens]
    assert view.words == words
    for span, marker in (("evidence", "✱"), ("anchor", "▲"), ("shortlist", "◆"),
                         ("answer", "★")):
        positions = {"evidence": ex.evidence_pos, "anchor": ex.anchor_pos,
                     "shortlist": ex.shortlist_pos, "answer": ex.answer_pos}[span]
        assert view.spans[span] == sorted(positions)
        assert all(view.labels[p] == marker + words[p] for p in positions)
    think = words.index("<think>")
    assert set(view.spans["note"]) | set(ex.evidence_pos) == set(range(1, think))
    # offline HTML: the bundle inlined as a classic script, nothing fetched
    html = view._repr_html_()
    assert html.startswith("<script>\"use strict\";var CircuitsVis=")  # the bundle, inlined
    assert "CircuitsVis.AttentionHeads" in html
    assert "unpkg" not in html and 'src="http' not in html and "type=\"module\"" not in html
    assert len(html) > 1_000_000 and len(view.fragment()) < 100_000
    assert '"attentionHeadNames": ["L0H1", "L3H2"]' in view.fragment()
    with pytest.raises(ValueError, match=r"heads=\[\(4, 0\)\]"):
        attention(model, task, heads=[(4, 0)])
    with pytest.raises(ValueError, match="example=5"):
        attention(model, task, heads=[(0, 0)], example=5)
    with pytest.raises(ValueError, match="task_or_example"):
        attention(model, "icd10", heads=[(0, 0)])
    # an Example alone: words from the model's tokenizer (the teacher's vocabulary is the task's)
    alone = attention(model, ex, heads=[(1, 1)])
    assert alone.words == words


def test_notebooks_are_stored_without_outputs():
    import json
    from pathlib import Path

    books = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
    assert [b.name for b in books][:2] == ["01_quickstart.ipynb", "02_characterize.ipynb"]
    for book in books:
        for cell in json.loads(book.read_text())["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, book.name


def test_validation_chart_reads_validate_heads_wide_frame():
    """``ck.validate_heads`` writes one row per phase x direction x quantity with top_* and
    random_* columns: the chart draws both sets with their intervals, p only on the top set."""
    import pandas as pd

    from circuitkit.experiments.charts import validation_chart

    rows = [dict(phase=p, direction=d, quantity=q, top_effect=e, top_low=e - 1, top_high=e + 1,
                 random_mean=e / 2, random_low=e / 2 - 1, random_high=e / 2 + 1, p_value=0.05)
            for p, q in ((1, "focus"), (2, "confusion")) for d, e in (("noise", -3.0),
                                                                      ("denoise", 3.0))]
    fig = validation_chart(pd.DataFrame(rows))
    names = [t.name for t in fig.data]
    assert names.count("top-k") == 2 and names.count("random") == 2  # one pair per panel
    top = next(t for t in fig.data if t.name == "top-k")
    assert list(top.y) == [-3.0, 3.0] and list(top.error_y.array) == [1.0, 1.0]
    rand = next(t for t in fig.data if t.name == "random")
    assert list(rand.y) == [-1.5, 1.5] and rand.text is None  # p: the x labels' (top set's)
    assert list(rand.x) == ["noise<br>p = 0.05", "denoise<br>p = 0.05"]


# --- found by review: figures that drew the wrong thing, or nothing, without a word ----------
def test_side_by_side_refuses_two_different_sweeps():
    a, b = result(torch.zeros(3, 4)), result(torch.zeros(3, 4), direction="noise")
    heatmaps.patch_heatmaps(a, b)  # the same sweep: fine
    b.meta.update(phase=1, metric="anchor_margin")
    with pytest.raises(ValueError, match="differ in metric .* phase"):
        heatmaps.patch_heatmaps(a, b)


def test_kv_head_axis_named_and_layer_positions_take_tokens():
    res = result(torch.zeros(3, 2))
    res.meta["head_axis"] = "kv_head"
    fig = heatmaps.patch_heatmap(res)
    assert fig.layout.xaxis.title.text == "kv head" and "kv head %{x}" in fig.data[0].hovertemplate
    layers = result(torch.zeros(3, 4), axes=("layer", "pos"))
    fig = heatmaps.patch_heatmap(layers, tokens=["<bos>", "a", "b", "c"])
    assert list(fig.layout.xaxis.ticktext) == ["0: <bos>", "1: a", "2: b", "3: c"]
    with pytest.raises(ValueError, match="tokens has 2 entries; the result has 4 positions"):
        heatmaps.patch_heatmap(layers, tokens=["a", "b"])


def test_hybrid_heatmap_says_which_cells_are_exact():
    res = result(torch.arange(12.0).reshape(3, 4) / 12)
    verified = torch.zeros(3, 4, dtype=torch.bool)
    verified[1, 2] = verified[0, 0] = True
    res.meta["verified"] = verified.tolist()
    (tr,) = heatmaps.patch_heatmap(res).data
    assert "exact (1) or estimate (0): %{customdata[3]" in tr.hovertemplate
    np.testing.assert_array_equal(np.asarray(tr.customdata)[..., 3], verified.float().numpy())
    (tr,) = heatmaps.patch_heatmap(res, interval=False).data
    assert "%{customdata[1]" in tr.hovertemplate
    np.testing.assert_array_equal(np.asarray(tr.customdata)[..., 1], verified.float().numpy())


def test_one_phase_scores_a_clear_skip_and_one_profile_line(scores):
    one = scores.assign(coarse_score=np.nan)
    with pytest.raises(ValueError, match="coarse_score is empty .* no Phase-1 steps"):
        charts.score_scatter(one)
    fig = charts.phase_profile(one, 4)
    assert [tr.name for tr in fig.data] == ["Phase 2: mean refine_score"]


def test_per_seed_ablation_rows_are_refused():
    runs = pd.DataFrame(dict(variant=["cot", "cot", "p1", "p1"], seed=[0, 1, 0, 1],
                             metric=["focus"] * 4, value=[0.1, 0.5, 0.2, 0.9]))
    with pytest.raises(ValueError, match="rows share a \\(variant, metric\\).*runs.csv"):
        charts.ablation_chart(runs)
    from circuitkit.experiments.report import ablation_table
    with pytest.raises(ValueError, match="rows share"):
        ablation_table(runs)


def test_bad_inputs_get_a_clear_error(scores):
    with pytest.raises(TypeError, match="expected a PatchResult"):
        heatmaps.patch_heatmap(None)
    with pytest.raises(TypeError, match="expected a PatchResult"):
        heatmaps.patch_heatmap(np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"columns \['layer'\] must hold numbers"):
        charts.score_scatter(scores.assign(layer="0"))
    frame = pd.DataFrame(dict(set=["top-5"], effect=[0.5], p_value=["0.01"]))
    with pytest.raises(ValueError, match=r"columns \['p_value'\] must hold numbers"):
        charts.validation_chart(frame)


def test_attention_view_text_repr_is_short(teacher_and_task):
    """The text fallback (a terminal, a notebook's text/plain) used to dump every pattern."""
    from circuitkit.viz.attention import attention

    model, task = teacher_and_task
    view = attention(model, task, heads=[(0, 1), (3, 2)], example=1)
    text = repr(view)
    assert text.startswith("AttentionView(") and "['L0H1', 'L3H2']" in text
    assert len(text) < 200 and "array" not in text


def test_a_task_metric_names_its_task_and_phase_in_the_title(teacher_and_task):
    """Notebooks and examples used to set ``res.meta`` by hand for a usable title."""
    import circuitkit as ck

    model, task = teacher_and_task
    t1 = task.with_phase(1)
    res = ck.patch_heads(model, t1.clean_tokens, t1.corrupt_tokens, t1.metric,
                         options=dict(progress=False))
    assert res.meta["task"] == "icd10" and res.meta["phase"] == 1
    assert heatmaps.describe(res).startswith("icd-teacher · icd10 phase 1 · metric anchor_margin")
    plain = ck.patch_heads(model, t1.clean_tokens, t1.corrupt_tokens, lambda lg: t1.metric(lg),
                           options=dict(progress=False))  # each reads its own)
    assert "task" not in plain.meta and "phase" not in plain.meta


def test_validation_chart_writes_p_as_the_findings_text_does():
    """issue 36.13: the chart said p=0.125 where the text said 0.12 (one rule: format_p)."""
    from circuitkit.experiments.findings import _p_phrase

    val = pd.DataFrame([dict(set="top-3", effect=-0.4, p_value=0.125),
                        dict(set="random", effect=-0.02, p_value=np.nan)])
    fig = charts.validation_chart(val)
    assert list(fig.data[0].x) == ["effect<br>p = 0.12"]
    assert "p = 0.12" in _p_phrase({"noise": 0.125}, 20)
