"""experiments.findings: the run's findings in words, read from the frames a run writes
(validate_heads,
score_heads, PatchResult), with the p-value's floor stated and a strong patching cell outside the
score ranking explained."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import circuitkit as ck
from circuitkit.experiments.findings import (
    findings,
    floor_note,
    strongest_cell,
    validation_sentence,
)
from circuitkit.patching.results import PatchResult


def rows(ps: dict[tuple[str, str], float], n_random: int = 20, k: int = 3) -> dict:
    return {(q, d): pd.Series(dict(phase=1, direction=d, quantity=q, k=k, n_random=n_random,
                                   p_value=p)) for (q, d), p in ps.items()}


def test_the_floor_is_said_and_a_test_that_cannot_reach_it_says_what_to_do():
    assert "no p can be below 1/21 = 0.048" in floor_note(20)
    assert "cannot reach" not in floor_note(20) and "cannot reach" not in floor_note(19)
    low = floor_note(4)  # 1/5 = 0.2: no p below 0.05 is possible
    assert "1/5 = 0.2" in low and "cannot reach p < 0.05" in low and "--n-random 20" in low


def test_a_pool_with_fewer_distinct_sets_than_asked_is_not_told_to_ask_for_more():
    # the teacher's Phase-2 top set fills half of layer 2: its same-layer pool holds 7 sets
    said = floor_note(7, asked=20)
    assert "1/8 = 0.12" in said and "20 were asked" in said and "cannot help" in said
    assert "rerun with --n-random" not in said
    assert "20 were asked" not in floor_note(20, asked=20)  # the pool held every set asked
    text, _ = validation_sentence(rows({("focus", "noise"): 1 / 8}, n_random=7), asked=20)
    assert "cannot help" in text and "rerun with" not in text


def test_beats_mixed_and_not_are_said_per_quantity_and_direction():
    text, verdict = validation_sentence(rows({("focus", "noise"): 1 / 21,
                                              ("focus", "denoise"): 1 / 21}))
    assert verdict is True
    assert "beat 20 random 3-head sets on focus (p = 0.048 in both directions, the floor)" in text
    text, verdict = validation_sentence(rows({("focus", "noise"): 0.01, ("focus", "denoise"): 0.3,
                                              ("margin", "noise"): 0.5,
                                              ("margin", "denoise"): 0.6}))
    assert verdict is None
    assert "on focus when noised, not denoised (p = 0.01 noise; p = 0.3 denoise)" in text
    assert "not on margin (p = 0.5 noise; p = 0.6 denoise), above 0.05" in text
    text, verdict = validation_sentence(rows({("focus", "noise"): 0.4}, n_random=4))
    assert verdict is False and "do not beat 4 random 3-head sets" in text
    assert "cannot reach p < 0.05" in text
    # at a floor above 0.05 the top set outdid every random set: said so, and not significant
    text, verdict = validation_sentence(rows({("focus", "noise"): 0.2}, n_random=4))
    assert verdict is None and "have a larger effect than all 4 random 3-head sets on focus " \
        "(p = 0.2 noise, the floor), which is not significant" in text


def _result(values: torch.Tensor, direction: str, phase: int = 2) -> PatchResult:
    return PatchResult(values=values, clean=1.0, corrupt=0.0, direction=direction,
                       method="exact", site="z", positions="all",
                       meta=dict(phase=phase, metric="margin"))


def test_the_strongest_cell_sums_both_directions_and_a_cell_outside_the_ranking_is_explained():
    de = torch.zeros(3, 4)
    no = torch.ones(3, 4)
    de[0, 1], no[0, 1] = 0.3, 0.75  # restores 30%, removes 25%: 0.55 in all
    de[2, 2], no[2, 2] = 0.5, 1.0  # restores 50% only: 0.5
    cell, said = strongest_cell({"denoise": _result(de, "denoise"),
                                 "noise": _result(no, "noise")})
    assert cell == (0, 1)
    assert said == {"denoise": "denoise restores 30%", "noise": "noise removes 25%"}
    scores = pd.DataFrame([dict(layer=la, head=h, coarse_score=0.0, refine_score=float(la))
                           for la in range(3) for h in range(4)])
    scores["phase2_rank"] = scores["refine_score"].rank(ascending=False,
                                                        method="first").astype(int)
    scores["phase1_rank"] = scores["coarse_score"].rank(ascending=False,
                                                        method="first").astype(int)
    (f1, f2) = findings({"validation_options": {"k": 2}}, None, scores,
                        {"p2-denoise": _result(de, "denoise"), "p2-noise": _result(no, "noise")})
    assert f2.heads == [(2, 0), (2, 1)]
    assert f2.headline == "The top 2 heads by refine_score are L2H0 and L2H1, all in layer 2."
    why = f2.notes[-1]
    assert why.startswith("Why L0H1, the strongest Phase-2 patching cell, is not among the top "
                          "2 Phase-2 heads: they are ranked by refine_score")
    assert "L0H1 ranks 10 of 12" in why and "an early head can move margin" in why
    assert f1.phase == 1 and not f1.notes  # no Phase-1 sweep: no sentence about one


def test_findings_read_what_validate_heads_and_score_heads_write(tiny_llama):
    """The field names findings reads are the ones validate_heads writes today (n_random: the
    distinct sets used; the floor follows from it)."""
    task = ck.load_task("synthetic", n_examples=6, n_labels=8, children=4,
                        labels_per_note=(1, 1))
    scores = ck.score_heads(tiny_llama, task, progress=False)
    val = ck.validate_heads(tiny_llama, task, scores, k=2, n_random=3, options=dict(progress=False))
    found = findings({}, val, scores, {})
    assert [f.phase for f in found] == [1, 2]
    for f in found:
        rows = val[val.phase == f.phase]
        top = rows[rows["pool"] == "all-layers"].iloc[0]  # the headline: sets disjoint from top
        same = rows[rows["pool"] == "same-layers"].iloc[0]
        assert f.heads == [tuple(int(x) for x in h[1:].split("H")) for h in top.heads.split()]
        assert f"{int(top.n_random)} random 2-head sets" in f.headline
        assert f"1/{int(top.n_random) + 1}" in f.headline and "cannot reach" in f.headline
        assert f.notes[0].startswith("Key effect on ")
        said = [n for n in f.notes if n.startswith("Against sets drawn from the same layers")]
        assert len(said) == 1 and f"{int(same.n_random)} random 2-head sets" in said[0]
        assert f"1/{int(same.n_random) + 1}" in said[0]


@pytest.mark.parametrize("bad", [None, pd.DataFrame({"set": ["top"], "effect": [1.0]})])
def test_frames_findings_cannot_read_give_no_validation_sentence(bad):
    assert findings({}, bad, None, None) == []


def test_a_sweep_whose_corruption_raised_the_metric_gets_raw_changes_not_shares():
    de, no = torch.zeros(2, 2), torch.zeros(2, 2)
    de[1, 0], no[1, 0] = 0.8, -0.5
    raised = {d: PatchResult(values=v, clean=0.0, corrupt=0.3, direction=d, method="exact",
                             site="z", positions="all", meta=dict(phase=1, metric="m"))
              for d, v in (("denoise", de), ("noise", no))}
    cell, said = strongest_cell(raised)
    assert cell == (1, 0)  # |effect|: 0.5 + 0.5 (denoise baseline 0.3, noise baseline 0)
    assert said == {"denoise": "denoise changes the metric by +0.5",
                    "noise": "noise changes the metric by \u22120.5"}
    (f,) = findings({}, None, None, {"p1-denoise": raised["denoise"], "p1-noise": raised["noise"]})
    assert "the corruption did not lower m, so no share of it is given" in f.headline
    assert "%" not in f.text()
