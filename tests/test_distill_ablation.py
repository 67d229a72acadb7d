"""The ablation grid: ``circuitkit distill --ablation --quick`` writes the tables for every cell,
variant and metric and resumes without retraining; its per-run metrics agree with
``ck.evaluate`` and the teacher measured against its own signals has no gap; the seeds added
for overlapping comparisons, the intervals and the paired differences by hand."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from typer.testing import CliRunner

import circuitkit as ck
from circuitkit.cli import app
from circuitkit.experiments import distill_grid as A
from circuitkit.experiments.distill_grid import (
    DEFAULT_VARIANTS,
    EMBEDDING_METRICS,
    METRICS,
    SHARE_METRICS,
    interval,
)


def test_quick_grid_writes_the_tables_and_resumes(tmp_path):
    out = tmp_path / "abl"
    args = ["distill", "--ablation", "--quick", "--seeds", "1", "--student-config", "student",
            "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    frame = pd.read_csv(out / "ablation.csv")
    assert list(frame.columns) == ["student", "data", "variant", "metric", "mean", "ci_low",
                                   "ci_high", "n_seeds"]
    assert list(dict.fromkeys(frame.variant)) == list(DEFAULT_VARIANTS)
    assert set(zip(frame.student, frame.data, strict=True)) == {("student", "full"),
                                                                ("student", "small")}
    # (plus the paper's embedding metrics where they are defined and the embed extra is there)
    core = frame[frame.metric.isin(METRICS + SHARE_METRICS)]
    assert len(core) == 2 * len(DEFAULT_VARIANTS) * (len(METRICS) + len(SHARE_METRICS))
    assert set(METRICS + SHARE_METRICS) <= set(frame.metric) <= set(
        METRICS + SHARE_METRICS + EMBEDDING_METRICS) and (frame.n_seeds == 1).all()
    # each term's effective share (balance "share"): its lambda, 0 when off
    share = frame[frame.metric.isin(SHARE_METRICS)].set_index(["data", "variant", "metric"])
    for v in DEFAULT_VARIANTS:
        for k in ("p1", "p2", "ns"):
            on = A.VARIANTS[v][f"lambda_{k}"]
            assert share.loc[("full", v, f"share_{k}"), "mean"] == pytest.approx(
                on, rel=1e-3, abs=1e-6), (v, k)
    assert frame[["mean", "ci_low", "ci_high"]].notna().all().all()
    runs = pd.read_csv(out / "runs.csv")
    assert list(runs.columns) == ["student", "data", "variant", "seed", "metric", "value"]
    comp = pd.read_csv(out / "comparisons.csv")
    assert set(comp.baseline) == {"cot", "nonselective"} and (comp.n_seeds == 1).all()
    assert "exact_match" in res.output and "nonselective" in res.output
    # the teacher against its own signals: no gap; the small store holds a tenth of the pool
    teacher = json.loads((out / "teacher.json").read_text())
    assert teacher["p1_gap"] == 0.0 and teacher["p2_gap"] == 0.0
    man = {d: json.loads((out / f"signals-{d}" / "manifest.json").read_text())
           for d in ("full", "small")}
    assert man["full"]["n_examples"] == A.SIZES["quick"]["pool_size"]
    assert man["small"]["n_examples"] == A.SIZES["quick"]["pool_size"] // 10
    assert man["full"]["scores_hash"] == man["small"]["scores_hash"]  # one score table
    # every run's history logs each term's gradient norm at every step
    hist = json.loads((out / "runs" / "student-full" / "p1+p2-seed0" / "distill.json")
                      .read_text())
    cols = hist["history_columns"]
    assert [r[0] for r in hist["history"]] == list(range(1, A.SIZES["quick"]["steps"] + 1))
    assert all(r[cols.index("gn_p1")] > 0 and r[cols.index("gn_p2")] > 0
               and r[cols.index("gn_cot")] > 0 for r in hist["history"])
    # every run of a cell starts from the cell's CoT-only pre-training
    for cell in ("student-full", "student-small"):
        start = out / "runs" / cell / "pretrain"
        pre = json.loads((start / "distill.json").read_text())["config"]
        assert pre["steps"] == A.SIZES["quick"]["pretrain"]
        assert pre["lambda_p1"] == pre["lambda_p2"] == pre["lambda_ns"] == 0
        for v in DEFAULT_VARIANTS:
            cfg = json.loads((out / "runs" / cell / f"{v}-seed0" / "distill.json").read_text())
            assert cfg["config"]["init"] == str(start), (cell, v)
    # rerunning finds every run finished: nothing is trained again, the table is the same
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/*/metrics.json")}
    assert len(stamps) == 2 * len(DEFAULT_VARIANTS)
    res2 = CliRunner().invoke(app, args)
    assert res2.exit_code == 0, res2.output
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    pd.testing.assert_frame_equal(pd.read_csv(out / "ablation.csv"), frame)
    # the report's chart and table read the grid: one bar / row per variant and cell
    from circuitkit.experiments import charts
    from circuitkit.experiments.report import ablation_table

    assert len(ablation_table(frame)) == 2 * len(DEFAULT_VARIANTS)
    assert len(charts.ablation_chart(frame).data[0].x) == 2 * len(DEFAULT_VARIANTS)


def test_student_metrics_agree_with_evaluate(tmp_path):
    from circuitkit.models import shipped_path

    sz = dict(A.SIZES["quick"], eval_examples=10, sim_examples=10, gold_examples=64,
              fidelity_examples=4)
    lc = ck.distill.LossConfig()
    A._gap_store(tmp_path, "icd-teacher", "icd10", sz, lc, _scores_folder(tmp_path), False)
    ctx = A.context(tmp_path, sz, "icd10", "tokens", (2, 2))
    got = A.student_metrics(shipped_path("icd-student-cot"), ctx)
    ref = ck.evaluate(ck.load_model("icd-student-cot"), ctx.test)
    for k in ("focus", "confusion", "confusion_rate", "macro_f1", "exact_match"):
        assert got[k] == pytest.approx(ref[k], abs=1e-5), k
    for k in ("las", "las_gold_prefit"):
        assert got[f"{k}_ci_low"] <= got[k] <= got[f"{k}_ci_high"]
    assert set(METRICS) <= set(got) and got["p1_gap"] > 0 and got["p2_gap"] > 0
    assert got["phase2_heads"].count("L") == 2


def _scores_folder(tmp_path):
    """A folder holding the teacher's score table (scores.csv), as a training store has."""
    from circuitkit.distill.train import DistillConfig, teacher_scores

    folder = tmp_path / "scores"
    folder.mkdir()
    teacher_scores(ck.load_model("icd-teacher"), DistillConfig(score_examples=16), folder)
    return str(folder)


def test_interval_overlap_and_top_parts_by_hand():
    m, lo, hi = interval([1.0, 2.0, 3.0])
    h = 4.303 * 1.0 / math.sqrt(3)  # t_{0.975, 2} * s / sqrt(n), s = 1
    assert (m, lo, hi) == pytest.approx((2.0, 2.0 - h, 2.0 + h))
    assert interval([0.5]) == (0.5, 0.5, 0.5)
    assert all(math.isnan(v) for v in interval([]))
    assert A.overlap((1, 0.5, 1.5), (2, 1.4, 2.6)) and not A.overlap((1, 0.5, 1.5),
                                                                      (2, 1.6, 2.4))
    scores = pd.DataFrame(dict(
        layer=[0, 0, 1, 1], head=[0, 1, 0, 1], sharpness=[1.0, 3.0, 2.0, 0.0],
        anchor_alignment=[0.1, 0.2, 0.3, 0.4], anchor_alignment_tokens=[0.0] * 4,
        coarse_score_tokens=[0.0, 0.5, 0.0, 0.2], coarse_score=[0.0] * 4,
        shortlist_share=[0.1, 0.9, 0.5, 0.3], key_preference=[0.0, -0.2, 0.4, 0.0],
        loopback=[0.0] * 4, refine_score=[0.0, 0.0, 0.0, 0.0], margin_widening=[1.0] * 4))
    p1 = A.top_parts(scores, 1, 2)
    assert p1["phase1_heads"] == "L0H1 L1H1" and p1["sharpness"] == pytest.approx(1.5)
    p2 = A.top_parts(scores, 2, 2)  # refine ties: by shortlist_share
    assert p2["phase2_heads"] == "L0H1 L1H0" and p2["key_preference"] == pytest.approx(0.1)


def _fake_runs(out, values):
    """metrics.json files holding ``values[(variant, seed)] = (focus, confusion)``."""
    for (v, k), (f, c) in values.items():
        folder = A.Run("student", "full", v, k).folder(out)
        folder.mkdir(parents=True)
        m = {name: 0.0 for name in METRICS} | dict(focus=f, confusion=c)
        (folder / "metrics.json").write_text(json.dumps(dict(metrics=m)))


def test_overlapping_comparisons_get_more_seeds_and_differences_are_paired(tmp_path):
    """After 3 seeds, p1 against cot overlaps on confusion (and p1 against nonselective does
    not on either): seeds 3 and 4 of p1 and cot are added, nothing else. The paired difference
    is the t-interval of the per-seed differences."""
    vals = {("cot", k): (0.50 + 0.01 * k, 0.40 + 0.02 * k) for k in range(3)}
    vals |= {("p1", k): (0.60 + 0.01 * k, 0.41 + 0.02 * k) for k in range(3)}
    vals |= {("nonselective", k): (0.90 + 0.01 * k, 0.90 + 0.01 * k) for k in range(3)}
    _fake_runs(tmp_path, vals)
    extra = A._extra_runs(tmp_path, [("student", "full")], ("cot", "p1", "nonselective"), 3, 5)
    assert {(r.variant, r.seed) for r in extra} == {(v, k) for v in ("cot", "p1")
                                                    for k in (3, 4)}
    runs = [A.Run("student", "full", v, k) for v, k in vals]
    A._write_tables(tmp_path, runs)
    comp = pd.read_csv(tmp_path / "comparisons.csv")
    row = comp[(comp.variant == "p1") & (comp.baseline == "cot") & (comp.metric == "focus")]
    assert row["diff"].item() == pytest.approx(0.10)  # identical differences: a zero-width
    assert row["ci_low"].item() == pytest.approx(0.10)  # interval
    row = comp[(comp.variant == "p1") & (comp.baseline == "nonselective")
               & (comp.metric == "confusion")]
    d = [vals[("p1", k)][1] - vals[("nonselective", k)][1] for k in range(3)]
    assert (row["diff"].item(), row["ci_low"].item()) == pytest.approx(interval(d)[:2])


def test_progress_false_prints_no_bars_and_ties_warn_nothing(tmp_path, capfd):
    """03_distill printed five "every head has the same coarse_score" warnings and ~30 bars
    (transformers' loading and saving bars) under progress=False. A barely trained student,
    whose heads all score 0, gets its top heads by the stated tie-break instead."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        frame = A.run_ablation(tmp_path / "abl", A.GridOptions(
            seeds=1, size="quick", variants=("cot",), students=("student",), data=("full",),
            progress=False))
    out, err = capfd.readouterr()
    assert "%|" not in out + err and "Loading weights" not in err, err[-2000:]
    assert not [str(w.message) for w in caught if "every head has the same" in str(w.message)]
    assert set(METRICS + SHARE_METRICS) <= set(frame.metric) <= set(
        METRICS + SHARE_METRICS + EMBEDDING_METRICS)
    m = json.loads((tmp_path / "abl" / "runs" / "student-full" / "cot-seed0" / "metrics.json")
                   .read_text())
    fid = ck.load_task("icd10", n_examples=A.SIZES["quick"]["eval_examples"], seed=0,
                       split="test").subset(range(A.SIZES["quick"]["fidelity_examples"]))
    with pytest.warns(UserWarning, match="every head has the same"):
        scores = ck.score_heads(  # the case this guards: every head ties
            ck.load_model(str(tmp_path / "abl" / "runs" / "student-full" / "cot-seed0")), fid,
            progress=False, n_boot=0)
    assert m["metrics"]["phase1_heads"] == A.top_parts(scores, 1, 2)["phase1_heads"]


def test_bad_grid_arguments_are_named(tmp_path):
    for kw, msg in ((dict(seeds=3, max_seeds=2), "max_seeds \\(2\\) must be >= seeds"),
                    (dict(data=("tiny",)), "unknown data size"),
                    (dict(variants=("p3",)), "unknown variant"),
                    (dict(workers=0), "workers must be a positive integer")):
        with pytest.raises(ValueError, match=msg):
            A.run_ablation(tmp_path, dict(kw, size="quick"))
    r = CliRunner().invoke(app, ["distill", "--workers", "2", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "--workers is an ablation option" in r.output
