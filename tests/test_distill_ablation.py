"""The ablation table: ``circuitkit distill --ablation --quick`` writes the CSV with every variant
and metric, resumes without retraining, and its per-run metrics agree with ``ck.evaluate``."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from typer.testing import CliRunner

import circuitkit as ck
from circuitkit.cli import app
from circuitkit.distill.ablation import METRICS, VARIANTS, interval


def test_quick_ablation_writes_the_table_and_resumes(tmp_path):
    out = tmp_path / "abl"
    res = CliRunner().invoke(app, ["distill", "--ablation", "--quick", "--seeds", "1",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    frame = pd.read_csv(out / "ablation.csv")
    assert list(frame.columns) == ["variant", "metric", "mean", "ci_low", "ci_high", "n_seeds"]
    assert list(dict.fromkeys(frame.variant)) == list(VARIANTS)
    assert len(frame) == len(VARIANTS) * len(METRICS)
    assert set(frame.metric) == set(METRICS) and (frame.n_seeds == 1).all()
    assert frame[["mean", "ci_low", "ci_high"]].notna().all().all()
    runs = pd.read_csv(out / "runs.csv")
    assert list(runs.columns) == ["variant", "seed", "metric", "value"]
    assert "exact_match" in res.output and "nonselective" in res.output
    # rerunning finds every run finished: nothing is trained again, the table is the same
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/metrics.json")}
    assert len(stamps) == len(VARIANTS)
    res2 = CliRunner().invoke(app, ["distill", "--ablation", "--quick", "--seeds", "1",
                                    "--out", str(out)])
    assert res2.exit_code == 0, res2.output
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    pd.testing.assert_frame_equal(pd.read_csv(out / "ablation.csv"), frame)


def test_student_metrics_agree_with_evaluate(tmp_path):
    from circuitkit.distill.ablation import student_metrics
    from circuitkit.evaluation import pretrained_simulator
    from circuitkit.models import shipped_path

    test = ck.load_task("icd10", n_examples=10, seed=0, split="test")
    sim_task = ck.load_task("icd10", n_examples=10, seed=1, split="train")
    sim = pretrained_simulator(ck.load_task("icd10", n_examples=64, seed=2, split="train"))
    got = student_metrics(shipped_path("icd-student-cot"), test, sim_task, sim, test)
    ref = ck.evaluate(ck.load_model("icd-student-cot"), test)
    for k in ("focus", "confusion", "confusion_rate", "macro_f1", "exact_match"):
        assert got[k] == pytest.approx(ref[k], abs=1e-5), k
    assert got["las_ci_low"] <= got["las"] <= got["las_ci_high"]
    assert {"sharpness", "anchor_alignment", "loopback", "margin_widening"} <= set(got)


def test_interval_by_hand():
    m, lo, hi = interval([1.0, 2.0, 3.0])
    h = 4.303 * 1.0 / math.sqrt(3)  # t_{0.975, 2} * s / sqrt(n), s = 1
    assert (m, lo, hi) == pytest.approx((2.0, 2.0 - h, 2.0 + h))
    assert interval([0.5]) == (0.5, 0.5, 0.5)
    assert all(math.isnan(v) for v in interval([]))


def test_progress_false_prints_no_bars_and_ties_warn_nothing(tmp_path, capfd):
    """03_distill printed five "every head has the same coarse_score" warnings and ~30 bars
    (transformers' loading and saving bars) under progress=False. A barely trained student,
    whose heads all score 0, gets its rank-1 head by the stated tie-break instead."""
    import warnings

    from circuitkit.distill.ablation import run_ablation

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        frame = run_ablation(tmp_path / "abl", seeds=1, size="quick", variants=("cot",),
                             progress=False)
    out, err = capfd.readouterr()
    assert "%|" not in out + err and "Loading weights" not in err, err[-2000:]
    assert not [str(w.message) for w in caught if "every head has the same" in str(w.message)]
    assert set(frame.metric) == set(METRICS)
    import json

    m = json.loads((tmp_path / "abl" / "runs" / "cot-seed0" / "metrics.json").read_text())
    with pytest.warns(UserWarning, match="every head has the same coarse_score"):
        scores = ck.score_heads(  # the case this guards: every head ties
            ck.load_model(str(tmp_path / "abl" / "runs" / "cot-seed0")),
            ck.load_task("icd10", n_examples=16, seed=0, split="test").subset(range(8)),
            progress=False)
    best = scores.sort_values(["coarse_score", "sharpness"], ascending=False).iloc[0]
    assert m["metrics"]["phase1_head"] == f"{int(best.layer)}.{int(best['head'])}"
