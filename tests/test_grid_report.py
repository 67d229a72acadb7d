"""benchmarks/distill_grid_report.py's verdict and curve arithmetic, by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest

_spec = importlib.util.spec_from_file_location(
    "distill_grid_report", Path(__file__).parents[1] / "benchmarks" / "distill_grid_report.py")
R = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(R)


@pytest.mark.parametrize("iv, effect, want", [
    ((0.10, 0.05, 0.15), 0.09, "reproduced"),
    ((-0.10, -0.15, -0.05), -0.07, "reproduced"),
    ((0.01, -0.01, 0.03), 0.09, "refuted (smaller than claimed)"),
    ((-0.02, -0.04, -0.01), 0.09, "refuted (no effect in the claimed direction)"),
    ((0.002, -0.007, 0.012), -0.07, "refuted (smaller than claimed)"),
    ((0.0, -0.10, 0.10), 0.09, "not resolvable at this power"),
    ((-0.03, -0.09, 0.03), -0.07, "not resolvable at this power"),
])
def test_verdicts_read_the_interval_in_the_claims_direction(iv, effect, want):
    assert R.verdict(iv, effect) == want


def test_auc_and_paired_differences_by_hand():
    pts = [dict(step=0, f=0.0), dict(step=2, f=1.0), dict(step=4, f=1.0)]
    assert R.auc(pts, "f") == pytest.approx((1.0 + 2.0) / 4)
    runs = pd.DataFrame(dict(data="main", metric="m", variant=["cot"] * 3 + ["v"] * 3,
                             seed=[0, 1, 2] * 2, value=[0.1, 0.2, 0.3, 0.2, 0.4, 0.4]))
    (m, lo, hi), n = R.paired(runs, "main", "m", "v", "cot")
    assert n == 3 and m == pytest.approx(0.4 / 3) and lo < m < hi
