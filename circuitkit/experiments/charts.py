"""Charts of head scores, causal validation and the distillation ablation (plotly).

Inputs are pandas DataFrames (``ck.score_heads``, ``ck.validate_heads``, the ablation CSV); each
function names the columns it needs and raises one ``ValueError`` when they are missing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from circuitkit.experiments.findings import format_p
from circuitkit.viz.heatmaps import check_counts, int_ticks, place_title

PHASE_COLORS = {1: "#1f77b4", 2: "#d62728"}  # Phase 1 (coarse, anchors) blue, Phase 2 red


def _require(frame: Any, columns: Sequence[str], arg: str, numeric: bool = False) -> None:
    """Refuse a frame without ``columns`` (and, ``numeric``, one where they hold no numbers)."""
    missing = [c for c in columns if c not in getattr(frame, "columns", ())]
    if missing:
        have = list(getattr(frame, "columns", []))
        raise ValueError(f"{arg}: expected a DataFrame with columns {list(columns)}; missing "
                         f"{missing} (has {have}).")
    if numeric:
        _numeric(frame, columns, arg)


def _pick(frame: Any, names: Sequence[str], arg: str, required: bool = True) -> str | None:
    """The first of ``names`` that is a column of ``frame`` (the documented name comes first)."""
    for n in names:
        if n in frame.columns:
            return n
    if required:
        raise ValueError(f"{arg}: expected a column {names[0]!r} (or one of {list(names[1:])}); "
                         f"has {list(frame.columns)}.")
    return None


def _numeric(frame: Any, columns: Sequence[str], arg: str) -> None:
    """Refuse a column that does not hold numbers (a CSV read with a stray header row, say)."""
    import pandas as pd

    bad = [c for c in columns if c in frame.columns
           and not pd.api.types.is_numeric_dtype(frame[c].dtype)]
    if bad:
        raise ValueError(f"{arg}: columns {bad} must hold numbers; got dtypes "
                         f"{[str(frame[c].dtype) for c in bad]} (e.g. {frame[bad[0]].iloc[0]!r}).")


def _interval_columns(frame: Any) -> tuple[str, str] | None:
    for lo, hi in (("ci_low", "ci_high"), ("low", "high"), ("ci_lo", "ci_hi"),
                   ("lower", "upper")):
        if lo in frame.columns and hi in frame.columns:
            return lo, hi
    return None


def _error_bars(frame: Any, value: str, interval: tuple[str, str] | None) -> dict | None:
    if interval is None:
        return None
    v = frame[value].to_numpy(dtype=float)
    return dict(type="data", symmetric=False, array=frame[interval[1]].to_numpy(float) - v,
                arrayminus=v - frame[interval[0]].to_numpy(float), thickness=1.5, width=4)


# --- head scores ----------------------------------------------------------------------------


# The scatter's geometry in pixels (fixed, so labels can be placed where they do not overlap):
# the plot area is SCATTER_W x SCATTER_H inside fixed margins (no automatic margin growth).
SCATTER_MARGIN = dict(l=80, r=130, t=90, b=70)
SCATTER_W, SCATTER_H = 560, 360
LABEL_FONT = 10  # px; a label's box is estimated at LABEL_CHAR_W px per character
LABEL_CHAR_W, LABEL_H, MARKER_R = 7.0, 15.0, 6.0


def _overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    """Overlap area of two boxes ``(x0, y0, x1, y1)``."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return max(w, 0.0) * max(h, 0.0)


def place_labels(points: np.ndarray, labelled: Sequence[int], texts: Sequence[str],
                 width: float, height: float) -> list[tuple[float, float]]:
    """Pixel offsets ``(dx, dy)`` (y down) of a label's centre from its point, one per index in
    ``labelled`` (``points``: ``[n, 2]`` pixel positions of every point, y down).

    Greedy, in the order given: the first candidate (the box beside the point in 8 directions,
    straight up first, at growing gaps) that stays inside ``width x height`` and overlaps
    neither a label placed before nor any point's marker; when none is free, the candidate of
    least overlap."""
    placed: list[tuple[float, float, float, float]] = []
    points = np.asarray(points, float).reshape(-1, 2)
    lo, hi = points - MARKER_R, points + MARKER_R  # every marker's box, [n, 2] corners
    angles = [-90, -45, -135, 0, 180, 45, 135, 90]  # degrees, y down: -90 is straight up
    out = []
    for i, text in zip(labelled, texts, strict=True):
        w, h = LABEL_CHAR_W * len(text) + 6, LABEL_H
        x, y = points[i]
        best, best_cost = (0.0, -(h / 2 + MARKER_R + 3)), math.inf
        for gap in (3, 8, 15, 24, 35, 48, 64, 84):
            for a in angles:  # the box beside the point, ``gap`` px away, in direction a
                dx = round(math.cos(math.radians(a)), 6) * (w / 2 + MARKER_R + gap)
                dy = round(math.sin(math.radians(a)), 6) * (h / 2 + MARKER_R + gap)
                box = (x + dx - w / 2, y + dy - h / 2, x + dx + w / 2, y + dy + h / 2)
                outside = max(0, -box[0]) + max(0, box[2] - width) + max(0, -box[1]) + \
                    max(0, box[3] - height)
                on_markers = (np.clip(np.minimum(hi[:, 0], box[2]) - np.maximum(lo[:, 0], box[0]),
                                      0, None)
                              * np.clip(np.minimum(hi[:, 1], box[3]) - np.maximum(lo[:, 1], box[1]),
                                        0, None)).sum()
                cost = (sum(_overlap(box, b) for b in placed) * 4 + float(on_markers)
                        + outside * h * 10)
                if cost < best_cost:
                    best, best_cost = (dx, dy), cost
                if cost == 0:
                    break
            if best_cost == 0:
                break
        dx, dy = best
        placed.append((x + dx - w / 2, y + dy - h / 2, x + dx + w / 2, y + dy + h / 2))
        out.append((dx, dy))
    return out


def _padded_range(values: np.ndarray, pad: float = 0.08) -> list[float]:
    finite = values[np.isfinite(values)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    span = hi - lo or max(abs(hi), 1.0) * 0.1
    return [lo - pad * span, hi + pad * span]


def score_scatter(scores: Any, label_top: int = 5):
    """``coarse_score`` (x, Phase 1) vs ``refine_score`` (y, Phase 2), one point per head,
    coloured by layer; the ``label_top`` best heads of each score are labelled ``L{layer}H{head}``
    (annotations placed by ``place_labels`` so that no two overlap; a label moved away from its
    point keeps a thin line to it).

    ``scores``: ``ck.score_heads`` DataFrame (columns ``layer, head, coarse_score,
    refine_score``; ``phase1_rank``/``phase2_rank`` and the component scores go in the hover).
    """
    import plotly.graph_objects as go

    _require(scores, ["layer", "head", "coarse_score", "refine_score"], "scores", numeric=True)
    for col, phase in (("coarse_score", 1), ("refine_score", 2)):
        if scores[col].isna().all():  # a task without this phase's steps (induction: anchors)
            raise ValueError(f"scores: {col} is empty (the task has no Phase-{phase} steps); "
                             "the scatter of the two scores needs both. phase_profile shows "
                             "the other phase alone.")
    df = scores.reset_index(drop=True)
    from circuitkit import hooks

    names = [hooks.head_name(int(r.layer), int(r.head)) for r in df.itertuples()]
    # best first, each score's top in turn: the strongest heads get the nearest places
    firsts = [list(df["coarse_score"].nlargest(label_top).index),
              list(df["refine_score"].nlargest(label_top).index)]
    top = list(dict.fromkeys(i for pair in zip(*firsts, strict=False) for i in pair))
    top += [i for f in firsts for i in f if i not in top]
    extra = [c for c in ("sharpness", "anchor_alignment", "shortlist_share", "key_preference",
                         "ov_copy", "loopback", "margin_widening", "phase1_rank", "phase2_rank",
                         "phase1_inclusion", "phase2_inclusion") if c in df.columns]
    words = {c: c.replace("phase1_", "Phase 1 ").replace("phase2_", "Phase 2 ") for c in extra}
    hover = "<b>%{hovertext}</b><br>coarse_score %{x:.4g}<br>refine_score %{y:.4g}" + "".join(
        f"<br>{words[c]} %{{customdata[{i}]:.4g}}" for i, c in enumerate(extra))
    n_layers = int(df["layer"].max()) + 1 if len(df) else 1
    x, y = df["coarse_score"].to_numpy(float), df["refine_score"].to_numpy(float)
    xr, yr = _padded_range(x), _padded_range(y)
    px = np.stack([(np.nan_to_num(x, nan=xr[0]) - xr[0]) / (xr[1] - xr[0]) * SCATTER_W,
                   (yr[1] - np.nan_to_num(y, nan=yr[0])) / (yr[1] - yr[0]) * SCATTER_H], axis=-1)
    offsets = place_labels(px, top, [names[i] for i in top], SCATTER_W, SCATTER_H)
    fig = go.Figure(go.Scatter(
        x=x, y=y, mode="markers", hovertext=names,
        customdata=df[extra].to_numpy(float) if extra else None,
        marker=dict(color=df["layer"], colorscale="Viridis", cmin=0, cmax=max(n_layers - 1, 1),
                    size=9, line=dict(width=0.5, color="black"),
                    colorbar=dict(title=dict(text="layer"), **int_ticks(n_layers, 10))),
        hovertemplate=hover + "<extra></extra>",
    ))
    for i, (dx, dy) in zip(top, offsets, strict=True):
        fig.add_annotation(x=x[i], y=y[i], text=names[i], ax=dx, ay=dy, showarrow=True,
                           arrowhead=0, arrowwidth=0.7, arrowcolor="#888", standoff=4,
                           font=dict(size=LABEL_FONT), bgcolor="rgba(255,255,255,0.7)",
                           borderpad=0)
    fig.update_layout(
        title="Head scores: Phase 1 (coarse) vs Phase 2 (refine)<br><sup>one point per head, "
        "colour = layer; top heads of each score labelled</sup>",
        xaxis_title="coarse_score (Phase 1: sharp attention x anchor-aligned write)",
        yaxis_title="refine_score (Phase 2: margin written from the shortlist)",
        height=SCATTER_H + SCATTER_MARGIN["t"] + SCATTER_MARGIN["b"],
        width=SCATTER_W + SCATTER_MARGIN["l"] + SCATTER_MARGIN["r"], plot_bgcolor="white",
        margin=dict(**SCATTER_MARGIN, autoexpand=False),
        xaxis=dict(showgrid=True, gridcolor="#eee", zerolinecolor="#bbb", range=xr),
        yaxis=dict(showgrid=True, gridcolor="#eee", zerolinecolor="#bbb", range=yr),
    )
    return fig


def phase_profile(scores: Any, n_layers: int):
    """Mean Phase-1 (``coarse_score``) and Phase-2 (``refine_score``) score per layer against
    the layer (x ticks at layer numbers, ``0 .. n_layers - 1``, the whole depth shown), error
    bars = standard error over the layer's heads. The two-phase picture: Phase 1 peaks earlier
    than Phase 2.

    The two scores have different units, so each has its own y axis (Phase 1 left, Phase 2 right).
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    _require(scores, ["layer", "coarse_score", "refine_score"], "scores", numeric=True)
    present = [(p, c, second) for p, c, second in ((1, "coarse_score", False),
                                                    (2, "refine_score", True))
               if scores[c].notna().any()]  # a phase the task has no steps for: no line
    if not present:
        raise ValueError("scores: coarse_score and refine_score are both empty (a task with "
                         "neither Phase-1 nor Phase-2 steps).")
    top = int(scores["layer"].max()) if len(scores) else 0
    if not isinstance(n_layers, int | np.integer) or n_layers < 1 or n_layers <= top:
        raise ValueError(f"n_layers={n_layers!r}: expected an int > the largest layer in "
                         f"scores ({top}).")
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for phase, column, second in present:
        m = scores.groupby("layer")[column].agg(["mean", "std", "count"]).reset_index()
        m["sem"] = (m["std"] / np.sqrt(m["count"])).fillna(0.0)  # standard error over heads
        fig.add_trace(go.Scatter(
            x=m["layer"].to_numpy(), y=m["mean"], mode="lines+markers",
            name=f"Phase {phase}: mean {column}", line=dict(color=PHASE_COLORS[phase], width=2),
            error_y=dict(type="data", array=m["sem"], thickness=1, width=3),
            customdata=np.stack([m["layer"], m["count"]], axis=-1),
            hovertemplate=f"Phase {phase}<br>layer %{{customdata[0]}} of {n_layers}<br>"
            f"mean {column} %{{y:.4g}} over %{{customdata[1]}} heads<extra></extra>",
        ), secondary_y=second)
    fig.update_xaxes(title_text=f"layer (0 = first, {n_layers - 1} = last)",
                     range=[-0.3, n_layers - 0.7], showgrid=True, gridcolor="#eee",
                     **int_ticks(n_layers))
    fig.update_yaxes(title_text="Phase 1: mean coarse_score", color=PHASE_COLORS[1],
                     secondary_y=False, zerolinecolor="#bbb", gridcolor="#eee")
    fig.update_yaxes(title_text="Phase 2: mean refine_score", color=PHASE_COLORS[2],
                     secondary_y=True, showgrid=False, tickmode="auto")
    fig.update_layout(
        title="Phase profile: where each phase's heads sit<br><sup>mean score per layer "
        "(error bars: standard error over heads); Phase 1 is expected earlier than Phase 2</sup>",
        height=440, width=760, plot_bgcolor="white",
        legend=dict(orientation="h", y=-0.2),
    )
    return place_title(fig, room=20)


# --- causal validation ----------------------------------------------------------------------

VALIDATION_COLUMNS = dict(
    set=("set", "head_set", "heads", "kind", "group"),
    effect=("effect", "effect_size", "mean_effect", "delta", "change"),
    measure=("measure", "metric", "quantity"),
    p_value=("p_value", "p", "pvalue"),
)


def _long_validation(validation: Any) -> Any:
    """``ck.validate_heads``' wide frame (one row per phase x direction x quantity, with
    ``top_effect/top_low/top_high`` and ``random_mean/random_low/random_high``) as the long
    frame below (one row per set); any other frame unchanged."""
    import pandas as pd

    wide = ("top_effect", "top_low", "top_high", "random_mean", "random_low", "random_high")
    if not all(c in validation.columns for c in wide):
        return validation
    keep = [c for c in ("phase", "direction", "quantity", "p_value") if c in validation.columns]
    pooled = "pool" in validation.columns  # random sets of several pools: one series each
    parts = []
    for label, (e, lo, hi) in (("top-k", wide[:3]), ("random", wide[3:])):
        part = validation[keep].copy()
        part["set"], part["effect"] = label, validation[e]
        part["ci_low"], part["ci_high"] = validation[lo], validation[hi]
        if label == "random":
            if pooled:
                part["set"] = "random (" + validation["pool"].astype(str) + ")"
            if "p_value" in part:  # the p-value belongs to the top-k set
                part["p_value"] = float("nan")
        elif pooled:  # the top set's effect is the same in every pool: once, p of the first
            part = part.loc[~validation[[c for c in ("phase", "direction", "quantity")
                                         if c in validation.columns]].duplicated()]
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def validation_chart(validation: Any):
    """Top-k heads vs random head sets: the patched effect of each set with its 95% interval.

    ``validation``: ``ck.validate_heads`` DataFrame, one row per set (or per random draw):

    ======================  ======================================================
    ``set``                 ``"top-k"`` / ``"random"`` (any labels; required)
    ``effect``              change of the measure when the set is patched (required)
    ``ci_low``, ``ci_high`` 95% interval of ``effect`` (optional)
    ``phase``               1 or 2 (optional: one panel per phase and measure)
    ``measure``             what changed, e.g. ``focus``, ``anchor_margin`` (optional)
    ``direction``           ``noise`` / ``denoise`` (optional: the x axis)
    ``p_value``             permutation p-value against the random sets (optional, shown)
    ======================  ======================================================

    ``ck.validate_heads``' own wide frame (``top_effect``, ``random_mean`` ...) is accepted as
    is. Aliases accepted: ``head_set``/``kind``/``group`` for ``set``; ``effect_size``/``delta``
    for ``effect``; ``metric`` for ``measure``; ``low``/``high`` for the interval.
    """
    import pandas as pd
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if len(getattr(validation, "columns", ())) == 0 or len(validation) == 0:
        raise ValueError("validation: expected a non-empty DataFrame (ck.validate_heads).")
    validation = _long_validation(validation)
    set_col = _pick(validation, VALIDATION_COLUMNS["set"], "validation")
    eff = _pick(validation, VALIDATION_COLUMNS["effect"], "validation")
    measure = _pick(validation, VALIDATION_COLUMNS["measure"], "validation", required=False)
    p_col = _pick(validation, VALIDATION_COLUMNS["p_value"], "validation", required=False)
    direction = "direction" if "direction" in validation.columns else None
    phase = "phase" if "phase" in validation.columns else None
    interval = _interval_columns(validation)
    _numeric(validation, [eff, *([p_col] if p_col else []), *(interval or ())], "validation")
    df = validation.reset_index(drop=True)
    panel_keys = [c for c in (phase, measure) if c]
    panels = list(df.groupby(panel_keys, sort=False)) if panel_keys else [((), df)]
    n_cols = min(len(panels), 2)
    n_rows = math.ceil(len(panels) / n_cols)

    def panel_name(key: Any) -> str:
        key = key if isinstance(key, tuple) else (key,)
        return ", ".join(f"Phase {k}" if c == "phase" else str(k)
                         for c, k in zip(panel_keys, key, strict=True)) or eff

    fig = make_subplots(rows=n_rows, cols=n_cols, subplot_titles=[panel_name(k) for k, _ in panels],
                        horizontal_spacing=0.12,
                        vertical_spacing=min(0.15, 0.6 / max(n_rows - 1, 1)))
    sets = list(dict.fromkeys(df[set_col].astype(str)))
    palette = ["#d62728", "#7f7f7f", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e"]
    for i, (_, part) in enumerate(panels):
        row, col = i // n_cols + 1, i % n_cols + 1
        # each x category's p-value under its name (as the text says it): a label beside a
        # marker ran into the next set's error bar
        x_of = part[direction].astype(str) if direction else pd.Series([eff] * len(part),
                                                                           index=part.index)
        said = {x: f"{x}<br>p = {format_p(float(p))}" for x, p in zip(
            x_of, part[p_col] if p_col else [np.nan] * len(part), strict=True)
            if np.isfinite(p)}
        for j, s in enumerate(sets):
            rows = part[part[set_col].astype(str) == s]
            if rows.empty:
                continue
            x = [said.get(v, v) for v in x_of[rows.index]]
            fig.add_trace(go.Scatter(
                x=x, y=rows[eff], mode="markers", name=s, legendgroup=s,
                showlegend=i == 0, offsetgroup=s, marker=dict(size=11, color=palette[j % 6]),
                error_y=_error_bars(rows, eff, interval),
                hovertemplate=f"{s}<br>%{{x}}<br>{eff} %{{y:.4g}}"
                + (" [%{customdata[0]:.4g}, %{customdata[1]:.4g}]" if interval else "")
                + "<extra></extra>",
                customdata=rows[list(interval)].to_numpy(float) if interval else None,
            ), row=row, col=col)
        fig.update_yaxes(title_text=eff if col == 1 else None, zeroline=True,
                         zerolinecolor="#888", gridcolor="#eee", row=row, col=col)
    fig.update_layout(
        title="Causal validation: top-k heads vs random head sets<br><sup>effect of patching "
        "the set together, 95% intervals; p = permutation p-value against the random sets</sup>",
        scattermode="group", height=330 * n_rows + 150, width=420 * n_cols + 200,
        plot_bgcolor="white", legend=dict(title=dict(text="head set")),
    )
    return place_title(fig, room=30)


# --- distillation ablation ------------------------------------------------------------------


ABLATION_CELLS = ("student", "data")  # the grid's cell columns (experiments.distill_grid)


def ablation_labels(frame: Any) -> Any:
    """The frame with each variant labelled by its grid cell (``"cot (student, full)"``) when
    it has the grid's cell columns (``ABLATION_CELLS``); unchanged otherwise."""
    cells = [c for c in ABLATION_CELLS if c in frame.columns]
    if not cells:
        return frame
    label = frame["variant"].astype(str) + " (" + frame[cells].astype(str).agg(
        ", ".join, axis=1) + ")"
    return frame.drop(columns=cells).assign(variant=label)


def check_ablation_frame(frame: Any) -> str:
    """Refuse a frame that is not one row per variant x metric (per grid cell, when it has the
    cell columns; one row per seed would be drawn as overlapping bars, or read as the mean);
    returns the value column's name."""
    _require(frame, ["variant", "metric"], "frame")
    value = _pick(frame, ("value", "mean"), "frame")
    if len(frame) == 0:
        raise ValueError("frame: expected at least one variant x metric row.")
    _numeric(frame, [value], "frame")
    keys = [c for c in ABLATION_CELLS if c in frame.columns] + ["variant", "metric"]
    dup = frame[frame.duplicated(keys, keep=False)]
    if len(dup):
        pairs = list(dict.fromkeys(zip(dup["variant"].astype(str), dup["metric"].astype(str),
                                       strict=True)))
        raise ValueError(f"frame: {len(dup)} rows share a (variant, metric): {pairs[:3]}... One "
                         "row per seed (runs.csv)? Pass the aggregated ablation.csv, or "
                         "frame.groupby(['variant', 'metric'], sort=False)['value'].mean()"
                         ".reset_index().")
    return value


def ablation_chart(frame: Any, n_cols: int = 3):
    """Distillation ablation: one panel per metric, one bar per variant with its 95% interval.

    ``frame`` (long format, one row per variant x metric; the ablation CSV):

    =====================  =============================================================
    ``variant``            e.g. ``cot``, ``p1``, ``p2``, ``p1+p2``, ``nonselective``
    ``metric``             e.g. ``focus``, ``confusion_rate``, ``macro_f1``, ``exact_match``,
                           ``las``, ``sharpness``, ``loopback`` ...
    ``value``              mean over seeds (alias ``mean``)
    ``ci_low``, ``ci_high``  95% interval over seeds (optional)
    ``n_seeds``            (optional, shown in the hover)
    =====================  =============================================================

    The grid's ``student`` and ``data`` columns, when present, label each bar
    ``"variant (student, data)"``. Variants and metrics keep their order of first appearance.
    One row per seed (``runs.csv``) is refused: aggregate first (``ablation.csv`` is).
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    check_counts(n_cols=n_cols)
    value = check_ablation_frame(frame)
    frame = ablation_labels(frame)
    interval = _interval_columns(frame)
    metrics = list(dict.fromkeys(frame["metric"].astype(str)))
    variants = list(dict.fromkeys(frame["variant"].astype(str)))
    n_cols = min(n_cols, len(metrics))
    n_rows = math.ceil(len(metrics) / n_cols)
    fig = make_subplots(rows=n_rows, cols=n_cols, subplot_titles=metrics,
                        horizontal_spacing=0.08,
                        vertical_spacing=min(0.14, 0.6 / max(n_rows - 1, 1)))
    palette = ["#7f7f7f", "#1f77b4", "#d62728", "#9467bd", "#2ca02c", "#ff7f0e"]
    colors = {v: palette[i % len(palette)] for i, v in enumerate(variants)}
    for i, m in enumerate(metrics):
        rows = frame[frame["metric"].astype(str) == m]
        seeds = rows["n_seeds"].to_numpy() if "n_seeds" in rows.columns else None
        fig.add_trace(go.Bar(
            x=rows["variant"].astype(str), y=rows[value],
            marker_color=[colors[v] for v in rows["variant"].astype(str)],
            error_y=_error_bars(rows, value, interval), name=m, showlegend=False,
            customdata=seeds,
            hovertemplate=f"%{{x}}<br>{m} %{{y:.4g}}"
            + (" (%{customdata} seeds)" if seeds is not None else "") + "<extra></extra>",
        ), row=i // n_cols + 1, col=i % n_cols + 1)
    fig.update_xaxes(categoryorder="array", categoryarray=variants, tickangle=-30)
    fig.update_yaxes(gridcolor="#eee")
    fig.update_layout(
        title="Distillation ablation: variants x metrics<br><sup>mean over seeds, error bars "
        "95% interval over seeds</sup>",
        height=300 * n_rows + 140, width=340 * n_cols + 120, plot_bgcolor="white",
    )
    return place_title(fig)
