"""Issue 44 item 2: the findings carry what weakens them: an unstable ranking, a small
validation sample (its size and what p can reach), the ablation's verdict in one sentence, and a
correction for the several p-values one phase reports (Holm). Each fails on the code before."""

from __future__ import annotations

import pandas as pd
import pytest

from circuitkit.experiments.findings import findings, format_findings, holm


def _validation(n_prompts: int, p: float, n_random: int = 200) -> pd.DataFrame:
    rows = []
    for pool in ("all-layers", "same-layers"):
        for q in ("exact_match", "confusion"):
            for d in ("noise", "denoise"):
                rows.append(dict(phase=2, pool=pool, direction=d, quantity=q,
                                 heads="L1H0, L1H1, L2H3", k=3, n_random=n_random, overlap=0,
                                 n_prompts=n_prompts, clean=0.9, corrupt=0.1, top_effect=-0.3,
                                 top_low=-0.4, top_high=-0.2, random_mean=-0.01, p_value=p,
                                 normalized=-0.4))
    return pd.DataFrame(rows)


def _ablation(ps: list[float]) -> pd.DataFrame:
    kinds = ("zero", "mean", "resample")
    return pd.DataFrame([dict(phase=2, pool="all-layers", ablation=a, quantity="exact_match",
                              heads="L1H0, L1H1, L2H3", k=3, n_random=20, top_effect=e,
                              p_value=p)
                         for a, e, p in zip(kinds, (-0.5, -0.25, -0.1), ps, strict=True)])


SUMMARY = dict(phases=[2], validation_options=dict(k=3, n_random=200),
               stability=dict(phase2=dict(k=3, top=[], unstable=[[1, 1], [2, 3]])))


def _phase2(**kw):
    (found,) = [f for f in findings(**kw) if f.phase == 2]
    return found


def test_an_unstable_ranking_is_said_in_the_finding_itself():
    f = _phase2(summary=SUMMARY, validation=_validation(64, 0.005))
    assert "ranking is not stable: L1H1 and L2H3 are in the top 3 in fewer than 80%" in \
        f.headline
    stable = dict(SUMMARY, stability=dict(phase2=dict(k=3, top=[], unstable=[])))
    assert "not stable" not in _phase2(summary=stable, validation=_validation(64, 0.005)).text()


def test_a_small_validation_sample_is_said_with_its_size_and_floor():
    f = _phase2(summary=SUMMARY, validation=_validation(8, 0.005))
    assert "validated on 8 examples only" in f.headline
    assert "1/201 = 0.005" in f.headline and "say nothing of other examples" in f.headline
    assert "validated on" not in _phase2(summary=SUMMARY, validation=_validation(64, 0.005)
                                         ).headline


def test_the_ablation_verdict_is_one_sentence():
    f = _phase2(summary=SUMMARY, validation=_validation(64, 0.005),
                head_ablation=_ablation([0.048, 0.2, 0.5]))
    (said,) = [n for n in f.notes if n.startswith("Ablation verdict")]
    assert said.count(". ") == 0 and said.endswith(").")
    assert "ablating the top 3 (zero, mean, resample) changes exact_match by \u22120.5 to " \
        "\u22120.1" in said
    assert "beyond random sets in 1 of 3 tests" in said and "20 random 3-head sets" in said
    none = _phase2(summary=SUMMARY, head_ablation=_ablation([0.3, 0.2, 0.5]))
    assert any("no more than random sets do in any test" in n for n in none.notes)


def test_several_p_values_are_corrected_for_their_number():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    f = _phase2(summary=SUMMARY, validation=_validation(64, 0.005),
                head_ablation=_ablation([0.048, 0.2, 0.5]))
    (said,) = [n for n in f.notes if n.startswith("Multiple comparisons")]
    # 8 validation p-values at the floor 0.005 and 3 ablation ones: 11 tests
    assert "reports 11 p-values; 9 are at or below 0.05 as they stand, 0 after Holm's " \
        "correction for 11 tests (smallest corrected p 0.055); more random sets" in said
    f = _phase2(summary=SUMMARY, validation=_validation(64, 0.001, n_random=1000))
    (said,) = [n for n in f.notes if n.startswith("Multiple comparisons")]
    assert "8 are at or below 0.05 as they stand, 8 after Holm's correction" in said
    # the console prints them too
    assert "Multiple comparisons" in format_findings([f])
    one = _validation(64, 0.005).iloc[:1]
    assert not [n for n in _phase2(validation=one).notes if "Multiple" in n]
