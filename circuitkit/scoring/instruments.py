"""Each head score beside the causal ranking and beside its null (issue 47): which scores
measure their names on this model. Formulas of the nulls: docs/scores.md ("Instruments against
their nulls"); ``score_heads`` computes the null columns, ``causal_table`` the causal ones.

``instrument_table(scores, k)``: one row per score column present, with

* ``spearman_causal``: Spearman over heads of the score with the head's needed share of its
  phase's gap (``causal.carried``, noising at every position: positive = the phase needs it);
* ``precision_at_k``: the share of the score's top ``k`` heads in the causal top ``k``;
* ``top_k``: the score's top ``k`` heads, best first;
* ``null`` and ``null_agreement``: what the null is and how much the score agrees with it
  (``key_preference*``: Spearman with ``key_preference_positional_null``; ``evidence_mass_own``:
  with its group-blind null; sharpness columns: the short-vs-long-row Spearman and the median
  correlation with ``1 / evidence words`` from ``score_heads``' ``attrs["instrument_nulls"]``);
* ``verdict``: in words, whether the score beats its null (``NULL_TRACKS`` / ``NULL_STABLE``).
"""

from __future__ import annotations

from typing import Any

# (column, phase, null kind); "paper" marks the paper's forms, beside circuitkit's
SCORES = (
    ("coarse_score", 1, None), ("coarse_score_tokens", 1, None),
    ("coarse_score_paper", 1, None),
    ("sharpness", 1, "rows"), ("sharpness_concentration", 1, "rows"),
    ("sharpness_evidence_normalised", 1, "rows"),
    ("evidence_mass", 1, None), ("evidence_mass_own", 1, "group"),
    ("evidence_mass_own_excess", 1, None),
    ("refine_score", 2, None), ("refine_score_siblings", 2, None),
    ("refine_score_paper", 2, None), ("margin_widening", 2, None),
    ("key_preference", 2, "position"), ("key_preference_nonadjacent", 2, "position"),
    ("key_preference_excess", 2, None), ("loopback", 2, None),
)
NULL_TRACKS = 0.7  # Spearman with the null at or above: the score mostly measures its null
NULL_STABLE = 0.8  # sharpness: heads ranked alike on short and long rows at or above
NULL_COUNT = 0.3  # sharpness: |median correlation with 1 / evidence words| at or above: tracks it


def _top(values: Any, heads: list[str], k: int) -> list[str]:
    import numpy as np

    v = np.nan_to_num(np.asarray(values, dtype=float), nan=-np.inf)
    return [heads[i] for i in np.argsort(-v, kind="stable")[:k]]


def _null(col: str, kind: str | None, scores: Any, nulls: dict[str, Any]
          ) -> tuple[str, float | None, str]:
    """``(what the null is, agreement, verdict)`` of one column."""
    from circuitkit.scoring.heads import spearman

    if kind == "position":
        rho = spearman(scores[col], scores["key_preference_positional_null"])
        verdict = (f"cannot beat its null: tracks entry order (Spearman {rho:+.2f} with the "
                   "positional head)" if rho >= NULL_TRACKS else
                   f"partly entry order (Spearman {rho:+.2f} with the positional head)"
                   if rho >= 0.4 else f"beyond entry order (Spearman {rho:+.2f})")
        return "positional head (mean attention per shortlist length and entry index)", rho, \
            verdict
    if kind == "group":
        rho = spearman(scores[col], scores["evidence_mass_own_null"])
        gain = float((scores[col] - scores["evidence_mass_own_null"]).max())
        verdict = (f"cannot beat its null: a group-blind head ranks alike (Spearman {rho:+.2f}),"
                   f" the largest excess {gain:+.3f}" if rho >= NULL_TRACKS or gain < 0.05 else
                   f"beats its null: excess up to {gain:+.3f} (Spearman {rho:+.2f})")
        return "group-blind head (its evidence mass spread evenly over all evidence words)", \
            rho, verdict
    if kind == "rows":
        entry = (nulls or {}).get(col) or {}
        rho, corr = entry.get("short_long_spearman"), entry.get("evidence_count_corr")
        if rho is None:
            return "row length and evidence count", None, "not measured (no per-row nulls)"
        ok = rho >= NULL_STABLE and (corr is None or abs(corr) < NULL_COUNT)
        verdict = ("beats its null" if ok else "cannot beat its null") + \
            f": short vs long rows Spearman {rho:+.2f}" + \
            (f", correlation with 1/evidence words {corr:+.2f}" if corr is not None else
             " (no evidence words: the count not checked)")
        return "row length and evidence count", rho, verdict
    return "-", None, "-"


def instrument_table(scores: Any, k: int = 5, nulls: dict[str, Any] | None = None,
                     direction: str = "noise"):
    """A DataFrame, one row per score column of ``scores`` (``SCORES``; module docstring).
    ``scores``: ``score_heads``' frame, with ``causal_table``'s columns merged for the causal
    agreement (NaN without them); ``nulls``: ``attrs["instrument_nulls"]`` (default: the
    frame's own attrs)."""
    import pandas as pd

    from circuitkit.hooks import head_name
    from circuitkit.scoring.causal import carried
    from circuitkit.scoring.heads import spearman

    nulls = nulls if nulls is not None else scores.attrs.get("instrument_nulls", {})
    heads = [head_name(int(la), int(h))
             for la, h in zip(scores["layer"], scores["head"], strict=True)]
    rows = []
    for col, phase, kind in SCORES:
        if col not in scores.columns or scores[col].nunique(dropna=True) < 2:
            continue  # absent, undefined or constant (no evidence words): ranks nothing
        try:
            need = carried(scores, phase, direction)
        except (KeyError, ValueError):
            need = None
        top = _top(scores[col], heads, k)
        row = dict(score=col, phase=phase, form="paper" if col.endswith("_paper") else
                   "circuitkit", spearman_causal=float("nan"), precision_at_k=float("nan"),
                   top_k=" ".join(top), causal_top_k="")
        if need is not None:
            causal_top = _top(need, heads, k)
            row.update(spearman_causal=spearman(scores[col], need),
                       precision_at_k=len(set(top) & set(causal_top)) / k,
                       causal_top_k=" ".join(causal_top))
        what, agreement, verdict = _null(col, kind, scores, nulls)
        row.update(null=what, null_agreement=agreement, verdict=verdict)
        rows.append(row)
    return pd.DataFrame(rows)
