"""Claims decided per definition (issue 50): the paired intervals and minimal detectable effects
of ``experiments.verdicts`` equal a hand computation from a small ``runs.csv``; a definition not in
it is "not measured"; a claim refuted on one definition and open on another says so."""

from __future__ import annotations

import io
import math

import pandas as pd
import pytest

from circuitkit.experiments import verdicts

# 3 seeds; cot and p1+p2 on two confusion definitions and exact match (no embedding metrics)
VALUES = {
    ("cot", "confusion"): [0.20, 0.21, 0.19],
    ("p1+p2", "confusion"): [0.21, 0.21, 0.20],  # diffs +0.01, 0, +0.01
    ("cot", "confusion_rate"): [0.42, 0.44, 0.40],
    ("p1+p2", "confusion_rate"): [0.37, 0.43, 0.30],  # diffs -0.05, -0.01, -0.10
    ("cot", "exact_match"): [0.60, 0.62, 0.64],
    ("p1+p2", "exact_match"): [0.65, 0.66, 0.70],  # diffs +0.05, +0.04, +0.06
}


def _runs() -> pd.DataFrame:
    lines = ["student,data,variant,seed,metric,value"]
    for (v, m), vals in VALUES.items():
        lines += [f"student,main,{v},{k},{m},{x}" for k, x in enumerate(vals)]
    lines.append("student,low,p1+p2,0,confusion,0.9")  # another cell: not mixed in
    return pd.read_csv(io.StringIO("\n".join(lines)))


def _hand(diffs):
    n = len(diffs)
    m = sum(diffs) / n
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / (n - 1))
    half = 4.303 * sd / math.sqrt(n)  # t_{0.975, 2}
    return m, m - half, m + half, (4.303 + 1.061) * sd / math.sqrt(n)  # + t_{0.80, 2}


def test_paired_intervals_per_definition_equal_a_hand_computation():
    runs = _runs()
    rows = verdicts.claim_rows(runs, ["p1+p2"], data="main")
    by = {r["definition"]: r for r in rows}
    for metric in ("confusion", "confusion_rate", "exact_match"):
        diffs = [a - b for a, b in zip(VALUES[("p1+p2", metric)], VALUES[("cot", metric)],
                                       strict=True)]
        m, lo, hi, mde = _hand(diffs)
        r = by[metric]
        assert r["n"] == 3
        assert (r["diff"], r["ci_low"], r["ci_high"], r["mde"]) == pytest.approx(
            (m, lo, hi, mde), abs=1e-12), metric
    # confusion: [-0.008, +0.021] excludes -0.07; confusion_rate: [-0.165, +0.059] holds both
    assert by["confusion"]["verdict"].startswith("refuted")
    assert by["confusion_rate"]["verdict"].startswith("open")
    assert by["exact_match"]["verdict"] == "higher"
    for metric in ("confusion_embedding", "focus", "focus_embedding", "macro_f1"):
        assert by[metric]["verdict"] == "not measured" and by[metric]["n"] == 0
    text = verdicts.claim_summary(rows, "confusion -0.07", "p1+p2")
    assert "depends on the definition" in text
    assert "refuted on confusion (smaller than claimed); open on confusion_rate" in text
    assert "not measured on confusion_embedding" in text
    assert "not measured" in verdicts.fmt_row(by["focus_embedding"])
    # one seed: a difference but no interval, so nothing decided
    (one,) = [r for r in verdicts.claim_rows(runs[runs.seed == 0], ["p1+p2"], data="main")
              if r["definition"] == "confusion_rate"]
    assert one["n"] == 1 and one["diff"] == pytest.approx(-0.05)
    assert one["verdict"].startswith("open") and math.isnan(one["ci_low"])


def test_verdict_reads_the_claims_direction():
    assert verdicts.verdict(-0.10, -0.02, -0.07) == (
        "reproduced (the claimed size inside the interval)")
    assert verdicts.verdict(-0.05, -0.02, -0.07) == "reproduced (smaller than claimed)"
    assert verdicts.verdict(-0.03, 0.01, -0.07) == "refuted (smaller than claimed)"
    assert verdicts.verdict(0.01, 0.03, -0.07) == "refuted (the opposite effect)"
    assert verdicts.verdict(0.0, 0.03, -0.07) == "refuted (no effect in the claimed direction)"
    assert verdicts.verdict(-0.09, 0.01, -0.07).startswith("open")
    assert verdicts.verdict(0.10, 0.12, 0.09) == "reproduced (larger than claimed)"
    assert verdicts.verdict(-0.02, -0.01, None) == "lower"
    assert math.isnan(verdicts.mde(0.1, 1))


def test_the_weight_is_chosen_by_its_held_out_mean():
    pts = {"p1+p2@0.1": {0: 0.20, 1: 0.22}, "p1+p2@0.3": {0: 0.18, 1: 0.19},
           "p1+p2@1": {0: 0.25, 1: float("nan")}}
    assert verdicts.choose_weight(pts, -1) == ("p1+p2@0.3", pytest.approx(0.185))
    assert verdicts.choose_weight(pts, 1) == ("p1+p2@1", pytest.approx(0.25))
