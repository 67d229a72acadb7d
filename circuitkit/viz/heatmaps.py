"""Layer x head heatmaps of ``PatchResult``s (plotly).

Colour is ``result.normalized()`` on a diverging scale centred at zero with a symmetric range
``[-m, m]``, ``m = max |normalized|`` over every panel of the figure (so denoise and noise side by
side share one scale). Where a result is ``degenerate`` (the corruption does not lower the
metric by its margin, ``PatchResult.degenerate``), colour is the raw effect ``value - baseline``
instead, for every panel of the figure, and the title, colour bar and hover say so.

Rows are layers (layer 0 at the top), columns heads (or positions, for layer sites; "kv head" for a
k/v sweep of a grouped-query model); ticks are integers, or the prompt's tokens across a layer x
position map when ``tokens`` is given. Hover shows layer, head (position), the raw metric value, the
normalized value and its 95% bootstrap interval over prompts (when the result holds per-prompt
values); for ``attribution+exact`` results, whether the cell was verified exactly or is the
estimator's value (the interval of an estimate says nothing about the estimator's error).

``positions="each"`` results (``values [n_layers, n_heads, seq]``) get one layer x head facet per
position: all positions up to ``max_facets``, else the ``max_facets`` positions with the largest
``|normalized|`` (in position order, the title says how many of how many).
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

COLORSCALE = "RdBu"  # red = negative (noise breaks the behaviour), blue = positive (restores it)
MAX_FACETS = 24
DIRECTION_NOTE = {
    "denoise": "denoise: clean activation into the corrupt run (1 = clean behaviour restored)",
    "noise": "noise: corrupt activation into the clean run (-1 = behaviour fully broken)",
}
PANEL_TITLE = {"denoise": "denoise (1 = restored)", "noise": "noise (-1 = broken)"}
SAME_SWEEP = ("tokens_hash", "task_hash", "metric", "phase", "task", "head_axis")
RAW_NOTE = ("colour = raw effect (value - baseline): the corruption does not lower the metric "
            "by its margin, so normalized values mean nothing")
RAW_PANEL = {"denoise": "denoise (raw effect)", "noise": "noise (raw effect)"}


def int_ticks(n: int, max_ticks: int = 25) -> dict[str, Any]:
    """Axis settings labelling ``0 .. n-1`` with integers (every ``ceil(n / max_ticks)``-th)."""
    step = max(1, math.ceil(n / max_ticks))
    vals = list(range(0, n, step))
    return dict(tickmode="array", tickvals=vals, ticktext=[str(v) for v in vals])


def model_label(meta: dict[str, Any]) -> str | None:
    """Short model name from a result's ``meta``: ``model_name`` (as the user typed it), else the
    folder name of a local ``model`` path, else ``model`` (a hub id) as is."""
    name = meta.get("model_name") or meta.get("model")
    if not name:
        return None
    name = str(name)
    if os.path.isabs(name) or name.startswith((".", "~")):
        return os.path.basename(os.path.normpath(name)) or name
    return name


def method_label(method: str) -> str:
    """A result's method as a figure's title says it: estimates labelled as estimates."""
    return {"attribution": "attribution ESTIMATES (not patched)",
            "attribution+exact": "attribution+exact (unverified cells are estimates)"}.get(
        method, method)


def describe(result: Any, raw: bool | None = None, sub: list | None = None,
             escape: Any = str) -> str:
    """Title naming the model, the task (and phase), the metric and the direction, from ``meta``
    (each through ``escape``); a second, smaller line (``sub``: its parts, else method, site,
    positions, the number of prompts and what colour shows; ``raw``: the raw effect, default for
    a ``degenerate`` result)."""
    raw = bool(getattr(result, "degenerate", False)) if raw is None else raw
    meta = result.meta or {}
    task = meta.get("task")
    if task and meta.get("phase") is not None:
        task = f"{task} phase {meta['phase']}"
    metric = meta.get("metric")
    head = [model_label(meta), task, f"metric {metric}" if metric else None, result.direction]
    n = meta.get("n_prompts") or meta.get("n_examples")
    if sub is None:
        sub = [method_label(result.method), f"site {result.site}",
               f"positions {result.positions}", f"{n} prompts" if n else None,
               RAW_NOTE if raw else "colour = normalized effect"]
    return (" · ".join(escape(str(p)) for p in head if p)
            + "<br><sup>" + ", ".join(str(p) for p in sub if p) + "</sup>")


def _raw(*results: Any) -> bool:
    """Whether a figure of ``results`` shows raw effects: one of them is ``degenerate`` (each
    warns once)."""
    return any([r.warn_if_degenerate() if hasattr(r, "warn_if_degenerate") else False
                for r in results])


def _cells(result: Any, interval: bool, raw: bool = False) -> dict[str, np.ndarray | None]:
    """numpy views of a result: value, the colour (``normalized``: normalized values, or the
    raw effect when ``raw``), the 95% interval of that (or None), and which cells are exact
    (``attribution+exact``; else None)."""
    if not all(hasattr(result, a) for a in ("values", "normalized", "confidence_interval")):
        raise TypeError(f"expected a PatchResult (ck.patch_heads / ck.patch_layers / "
                        f"ck.PatchResult.load); got {type(result).__name__}.")
    ci = result.confidence_interval(raw=raw) if interval else None
    verified = getattr(result, "verified", None)
    return dict(
        value=result.values.float().numpy(),
        normalized=(result.effect() if raw else result.normalized()).float().numpy(),
        low=None if ci is None else ci[0].float().numpy(),
        high=None if ci is None else ci[1].float().numpy(),
        exact=None if verified is None else verified.float().numpy(),
    )


def _abs_max(*arrays: np.ndarray) -> float:
    finite = [np.abs(a[np.isfinite(a)]) for a in arrays]
    m = max((float(f.max()) for f in finite if f.size), default=0.0)
    return max(m, 1e-9)


def _trace(c: dict, index: tuple, x_name: str, y_name: str, extra: str = "", name: str = "",
           raw: bool = False):
    """One heatmap of the cells ``c[...][index]`` (2-D: rows = layers), on the shared coloraxis."""
    import plotly.graph_objects as go

    z = c["normalized"][index]
    parts = [c["value"][index]]
    hover = (f"{y_name} %{{y}}<br>{x_name} %{{x}}{extra}<br>value %{{customdata[0]:.4g}}"
             + ("<br>raw effect %{z:.4g}" if raw else "<br>normalized %{z:.3f}"))
    if c["low"] is not None:
        parts += [c["low"][index], c["high"][index]]
        hover += "<br>95% interval [%{customdata[1]:.3f}, %{customdata[2]:.3f}]"
    if c["exact"] is not None:  # 1 = verified exactly, 0 = the estimator's value
        hover += f"<br>exact (1) or estimate (0): %{{customdata[{len(parts)}]:.0f}}"
        parts.append(c["exact"][index])
    return go.Heatmap(
        z=z, x=np.arange(z.shape[1]), y=np.arange(z.shape[0]),
        customdata=np.stack(parts, axis=-1), coloraxis="coloraxis", name=name,
        hovertemplate=hover + f"<extra>{name}</extra>", xgap=1, ygap=1,
    )


def check_counts(**counts: int) -> None:
    """Refuse a count argument (facets, columns) below 1, naming it."""
    bad = {k: v for k, v in counts.items() if not (isinstance(v, int) and v >= 1)}
    if bad:
        raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in bad.items())}: expected a "
                         "positive integer.")


def _pick_positions(norms: Sequence[np.ndarray], positions: Sequence[int] | None,
                    max_facets: int) -> list[int]:
    seq = norms[0].shape[-1]
    if positions is not None:
        picked = [int(p) for p in positions]
        bad = [p for p in picked if not 0 <= p < seq]
        if bad or not picked:
            raise ValueError(f"positions={list(positions)!r}: expected a non-empty list of "
                             f"positions in 0..{seq - 1}.")
        return picked
    if seq <= max_facets:
        return list(range(seq))
    strength = np.max([np.nan_to_num(np.abs(n)).max(axis=(0, 1)) for n in norms], axis=0)
    return sorted(np.argsort(-strength, kind="stable")[:max_facets].tolist())


def _axis_names(result: Any) -> tuple[str, str]:
    """(x name, y name) of a panel: heads (KV heads of a GQA k/v sweep) or positions across,
    layers down."""
    axes = tuple(result.axes)
    x = axes[1] if len(axes) >= 2 else "head"
    if x == "head" and (result.meta or {}).get("head_axis") == "kv_head":
        x = "kv head"
    return x, "layer"


def _token_ticks(fig, tokens: Sequence[str] | None, n: int) -> None:
    """Label a position axis with the prompt's tokens."""
    if tokens is None:
        return
    if len(tokens) != n:
        raise ValueError(f"tokens has {len(tokens)} entries; the result has {n} positions.")
    fig.update_xaxes(tickmode="array", tickvals=list(range(n)),
                     ticktext=[f"{p}: {t}" for p, t in enumerate(tokens)], tickangle=-60)


def _grid(n_panels: int, n_cols: int, titles: list[str], shape: tuple[int, int],
          x_name: str, y_name: str):
    """A subplot grid of heatmap panels (``shape`` = rows x cols of one panel) with integer
    ticks, layer 0 on top, and sizes that keep the cells readable."""
    from plotly.subplots import make_subplots

    n_rows = math.ceil(n_panels / n_cols)
    fig = make_subplots(
        rows=n_rows, cols=n_cols, subplot_titles=titles,
        horizontal_spacing=min(0.08, 0.6 / max(n_cols - 1, 1)) if n_cols > 1 else 0.02,
        vertical_spacing=min(0.1, 0.6 / max(n_rows - 1, 1)) if n_rows > 1 else 0.02,
    )
    fig.update_yaxes(autorange="reversed", **int_ticks(shape[0]))
    fig.update_xaxes(**int_ticks(shape[1]))
    for r in range(1, n_rows + 1):
        fig.update_yaxes(title_text=y_name, row=r, col=1)
    for c in range(1, n_cols + 1):
        fig.update_xaxes(title_text=x_name, row=n_rows, col=c)
    panel_h = min(480, max(220, 26 * shape[0]))
    panel_w = min(760, max(320, 28 * shape[1]))
    fig.update_layout(height=n_rows * panel_h + 190, width=n_cols * panel_w + 220,
                      margin=dict(t=150, l=70, r=40, b=60))
    return fig


# Title fonts (px: plotly's default title size, and a <sup> line's) and the width of one
# character in em, generous, so that an estimated line is never narrower than the drawn one.
TITLE_PX, SUP_PX, CHAR_EM = 17.0, 12.0, 0.6
SUBPLOT_TITLE_ROOM = 70  # px between the title's last line and the panels (panel titles)


def _wrap_words(text: str, max_chars: int) -> list[str]:
    """Greedy word wrap; a " · " separator stays at the end of the line it follows."""
    lines: list[str] = []
    for word in text.split(" "):
        if lines and (len(lines[-1]) + 1 + len(word) <= max_chars or word == "\u00b7"):
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines


def wrap_title(title: str, width: float) -> tuple[str, float]:
    """``title`` (plotly text: lines split by ``<br>``, small lines in ``<sup>``) with line
    breaks so that no line is wider than ``width`` px, and the wrapped title's height in px."""
    out, height = [], 0.0
    for line in title.split("<br>"):
        sup = line.startswith("<sup>") and line.endswith("</sup>")
        text = line[5:-6] if sup else line
        px = SUP_PX if sup else TITLE_PX
        for part in _wrap_words(text, max(12, int(width / (CHAR_EM * px)))):
            out.append(f"<sup>{part}</sup>" if sup else part)
            height += px * 1.3
    return "<br>".join(out), height


# plotly's toolbar (mode bar: zoom, pan, download) sits in the figure's top 30 px at the right,
# shown on hover: a title starts below it instead of running under it
TOOLBAR_ROOM = 40


def place_title(fig, room: int = SUBPLOT_TITLE_ROOM):
    """``fig``'s title wrapped to the figure's width (a long one used to be cut at its edge),
    left-aligned, starting below plotly's toolbar (``TOOLBAR_ROOM``), with the top margin (and
    the height) grown to hold it and ``room`` px below it (the panels' own titles)."""
    text = fig.layout.title.text
    if not text:
        return fig
    title, height = wrap_title(text, (fig.layout.width or 700) - 30)
    top = fig.layout.margin.t if fig.layout.margin.t is not None else 100
    need = int(TOOLBAR_ROOM + height + room)
    if need > top:
        fig.update_layout(margin=dict(t=need), height=(fig.layout.height or 450) + need - top)
    fig.update_layout(title=dict(text=title, x=0.01, xanchor="left", yanchor="top",
                                 y=1 - TOOLBAR_ROOM / (fig.layout.height or 450)))
    return fig


def _finish(fig, m: float, title: str, raw: bool = False):
    fig.update_layout(title_text=title)
    place_title(fig)
    fig.update_layout(
        coloraxis=dict(colorscale=COLORSCALE, cmid=0.0, cmin=-m, cmax=m,
                       colorbar=dict(title=dict(text="raw effect" if raw else "normalized"))),
        plot_bgcolor="white",
    )
    return fig


def _facet_title(p: int, tokens: Sequence[str] | None) -> str:
    return f"pos {p}" + (f": {tokens[p]}" if tokens is not None and p < len(tokens) else "")


def patch_heatmap(result: Any, title: str | None = None, *, interval: bool = True,
                  positions: Sequence[int] | None = None, tokens: Sequence[str] | None = None,
                  max_facets: int = MAX_FACETS, facet_cols: int = 4):
    """Heatmap of one ``PatchResult``: ``normalized()`` per layer x head (or layer x position).

    ``positions="each"`` results: one layer x head facet per position (``positions`` picks them;
    ``tokens[p]`` labels facet ``p``); layer x position results: ``tokens`` label the position
    axis. ``interval=False`` skips the bootstrap (faster, no interval in the hover). Returns a
    ``plotly.graph_objects.Figure``.
    """
    check_counts(max_facets=max_facets, facet_cols=facet_cols)
    raw = _raw(result)
    c = _cells(result, interval, raw)
    m = _abs_max(c["normalized"])
    x_name, y_name = _axis_names(result)
    title = title or describe(result, raw)
    if c["value"].ndim == 2:
        if positions is not None:
            raise ValueError("positions= picks facets of a positions='each' result; this result "
                             f"has axes {tuple(result.axes)} (no per-position facets).")
        fig = _grid(1, 1, [""], c["value"].shape, x_name, y_name)
        fig.add_trace(_trace(c, (slice(None), slice(None)), x_name, y_name,
                             name=result.direction, raw=raw), row=1, col=1)
        if x_name == "pos":
            _token_ticks(fig, tokens, c["value"].shape[1])
        return _finish(fig, m, title, raw)
    picked = _pick_positions([c["normalized"]], positions, max_facets)
    seq = c["value"].shape[-1]
    if len(picked) < seq:
        title += f"<br><sup>{len(picked)} of {seq} positions (largest |normalized| first " \
                 "picked, shown in position order)</sup>"
    cols = min(facet_cols, len(picked))
    groups = (result.meta or {}).get("group_names") if "group" in tuple(result.axes) else None
    label = (lambda p: f"group {groups[p]}") if groups else (lambda p: f"pos {p}")
    fig = _grid(len(picked), cols, [label(p) if groups else _facet_title(p, tokens)
                                    for p in picked],
                c["value"].shape[:2], x_name, "layer")
    for i, p in enumerate(picked):
        fig.add_trace(_trace(c, (slice(None), slice(None), p), x_name, "layer",
                             extra=f"<br>{label(p)}", name=label(p), raw=raw),
                      row=i // cols + 1, col=i % cols + 1)
    return _finish(fig, m, title, raw)


def patch_heatmaps(denoise: Any, noise: Any, title: str | None = None, *, interval: bool = True,
                   positions: Sequence[int] | None = None, tokens: Sequence[str] | None = None,
                   max_facets: int = MAX_FACETS // 2):
    """Denoise (left) and noise (right) heatmaps of the same sweep on ONE colour scale centred at
    zero (range ``[-m, m]``, ``m`` the largest ``|normalized|`` of both).

    ``positions="each"`` results: one row per position, denoise and noise side by side.
    Returns a ``plotly.graph_objects.Figure``.
    """
    check_counts(max_facets=max_facets)
    for arg, res, want in (("denoise", denoise, "denoise"), ("noise", noise, "noise")):
        if getattr(res, "direction", None) != want:
            raise ValueError(f"{arg}= must be a PatchResult with direction={want!r}; got "
                             f"{getattr(res, 'direction', type(res).__name__)!r}.")
    if tuple(denoise.values.shape) != tuple(noise.values.shape) or \
            tuple(denoise.axes) != tuple(noise.axes):
        raise ValueError(f"denoise and noise must be the same sweep; got shapes "
                         f"{tuple(denoise.values.shape)} {denoise.axes} and "
                         f"{tuple(noise.values.shape)} {noise.axes}.")
    # one figure, one title: the two must be the same prompts, metric, site and phase
    differ = {k: (denoise.meta.get(k), noise.meta.get(k)) for k in SAME_SWEEP
              if k in (denoise.meta or {}) and k in (noise.meta or {})
              and denoise.meta[k] != noise.meta[k]}
    differ.update({k: (getattr(denoise, k), getattr(noise, k)) for k in ("site", "positions")
                   if getattr(denoise, k) != getattr(noise, k)})
    if differ:
        raise ValueError(f"denoise and noise must be the same sweep; they differ in "
                         f"{', '.join(f'{k} ({a!r} vs {b!r})' for k, (a, b) in differ.items())}. "
                         "Draw them apart with patch_heatmap.")
    raw = _raw(denoise, noise)  # one scale: both raw where either is degenerate
    cs = [_cells(r, interval, raw) for r in (denoise, noise)]
    m = _abs_max(*(c["normalized"] for c in cs))
    x_name, y_name = _axis_names(denoise)
    title = title or describe(denoise, raw).replace(" · denoise", " · denoise and noise")
    if not raw:
        title += "<br><sup>" + "; ".join(DIRECTION_NOTE[r.direction]
                                         for r in (denoise, noise)) + "</sup>"
    panel = RAW_PANEL if raw else PANEL_TITLE
    if cs[0]["value"].ndim == 2:
        fig = _grid(2, 2, [panel[r.direction] for r in (denoise, noise)],
                    cs[0]["value"].shape, x_name, y_name)
        for j, (c, r) in enumerate(zip(cs, (denoise, noise), strict=True)):
            fig.add_trace(_trace(c, (slice(None), slice(None)), x_name, y_name,
                                 name=r.direction, raw=raw), row=1, col=j + 1)
        if x_name == "pos":
            _token_ticks(fig, tokens, cs[0]["value"].shape[1])
        return _finish(fig, m, title, raw)
    picked = _pick_positions([c["normalized"] for c in cs], positions, max_facets)
    titles = [f"{_facet_title(p, tokens)}, {r.direction}" for p in picked
              for r in (denoise, noise)]
    fig = _grid(2 * len(picked), 2, titles, cs[0]["value"].shape[:2], x_name, "layer")
    for i, p in enumerate(picked):
        for j, (c, r) in enumerate(zip(cs, (denoise, noise), strict=True)):
            fig.add_trace(_trace(c, (slice(None), slice(None), p), x_name, "layer",
                                 extra=f"<br>pos {p}", name=f"{r.direction} pos {p}", raw=raw),
                          row=i + 1, col=j + 1)
    return _finish(fig, m, title, raw)


PAGE_WIDTH = 1280  # px a figure must fit (a laptop's window): panels wrap, then stack


def edge_heatmap(result: Any, title: str | None = None, *, inputs: Sequence[str] | None = None,
                 interval: bool = True, n_cols: int = 3):
    """Sender x receiver heatmap of an ``EdgeResult``'s ``normalized()``, one panel per input
    (q, k, v) over the receiving heads, and the logits (one input: the residual stream they
    read) in a narrow panel of their own beside the first. Rows: senders (the embeddings
    first), every one labelled; columns: receivers, every one labelled; blank where (sender,
    receiver, input) is no edge. Panels wrap (at most ``n_cols`` a row), then stack, so the
    figure fits ``PAGE_WIDTH`` px. Hover: the names, raw value, normalized value and its 95%
    bootstrap interval over prompts (when the result holds per-prompt values)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if not all(hasattr(result, a) for a in ("values", "senders", "receivers", "inputs")):
        raise TypeError(f"expected an EdgeResult (ck.patch_edges / ck.EdgeResult.load); got "
                        f"{type(result).__name__}.")
    check_counts(n_cols=n_cols)
    names = list(result.inputs if inputs is None else inputs)
    bad = [i for i in names if i not in result.inputs]
    if bad or not names:
        raise ValueError(f"inputs={names!r}: expected some of the result's inputs "
                         f"{list(result.inputs)}.")
    raw = _raw(result)
    c = _cells(result, interval, raw)
    senders, receivers = result.sender_names(), result.receiver_names()
    heads = [j for j, r in enumerate(receivers) if r != "logits"]
    logits = [j for j, r in enumerate(receivers) if r == "logits"]
    # the logits' one input: the index their values sit at (the first input's, by the format)
    at = next((i for i in range(len(result.inputs)) if logits and np.isfinite(
        c["normalized"][:, logits[0], i]).any()), 0)
    pw = min(760, max(320, 28 * len(heads)))  # one panel's width: cells stay readable
    lw = 150 if logits else 0  # (one column, its colour bar room is the figure's)
    room = PAGE_WIDTH - 40 - 220 - lw
    cols = max(1, min(n_cols, len(names), room // pw)) if heads else 0
    pw = min(pw, room // max(cols, 1))
    rows = max(1, math.ceil(len(names) / cols)) if heads else 1
    specs, titles = [], []
    for r in range(rows):
        line = [{} if heads and r * cols + k < len(names) else None for k in range(cols)]
        titles += [f"into {names[r * cols + k]}" for k in range(cols) if line[k] is not None]
        if logits:
            line.append({} if r == 0 else None)
            titles += ["into the logits"] if r == 0 else []
        specs.append(line)
    widths = [pw] * cols + ([lw] if logits else [])
    fig = make_subplots(rows=rows, cols=len(widths), specs=specs, subplot_titles=titles,
                        column_widths=[w / sum(widths) for w in widths],
                        horizontal_spacing=min(0.08, 60 / sum(widths)),
                        vertical_spacing=min(0.1, 120 / (rows * max(220, 18 * len(senders))))
                        if rows > 1 else 0.02)
    small = dict(tickfont=dict(size=10 if len(senders) > 20 else 12))
    for k, name in enumerate(names if heads else []):
        i = list(result.inputs).index(name)
        trace = _trace(c, (slice(None), heads, i), "receiver", "sender",
                       extra=f"<br>input {name}", name=name, raw=raw)
        trace.update(x=[receivers[j] for j in heads], y=senders)
        fig.add_trace(trace, row=k // cols + 1, col=k % cols + 1)
    if logits:
        trace = _trace(c, (slice(None), logits, at), "receiver", "sender",
                       extra="<br>input: the residual stream the unembedding reads",
                       name="logits", raw=raw)
        trace.update(x=["logits"], y=senders)
        fig.add_trace(trace, row=1, col=cols + 1)
    # every sender and receiver labelled (plotly's automatic ticks skip every other one)
    fig.update_yaxes(autorange="reversed", tickmode="array", tickvals=senders,
                     ticktext=senders, **small)
    fig.update_xaxes(tickmode="array", tickangle=-60, **small)
    for k in range(cols):
        fig.update_xaxes(tickvals=[receivers[j] for j in heads],
                         ticktext=[receivers[j] for j in heads], col=k + 1)
        fig.update_xaxes(title_text="receiver", row=min(rows, (len(names) - 1 - k) // cols
                                                        + 1), col=k + 1)
    for r in range(1, rows + 1):
        fig.update_yaxes(title_text="sender", row=r, col=1)
    if logits:
        fig.update_xaxes(tickvals=["logits"], ticktext=["logits"], col=cols + 1)
    panel_h = max(220, 18 * len(senders))
    fig.update_layout(height=rows * panel_h + 190, width=sum(widths) + 220,
                      margin=dict(t=150, l=70, r=40, b=60))
    m = _abs_max(c["normalized"])
    # auto-scaled colour makes a 0.2%-of-the-gap edge look saturated: say the range in % of
    # the gap wherever it is drawn (subtitle and colour bar)
    scale = None if raw else f"full colour = \u00b1{m:.2%} of the clean\u2212corrupt gap"
    if title is None:
        n = (result.meta or {}).get("n_prompts")
        # (the direction note sits in the subtitle: below the plot it overlapped the tilted
        # receiver labels)
        title = describe(result, raw, escape=html.escape, sub=[
            method_label(result.method), "edges: a sender's write into one receiver's input",
            f"{n} prompts" if n else None,
            RAW_NOTE if raw else f"colour = normalized effect, {scale}",
            DIRECTION_NOTE.get(result.direction)])
    fig = _finish(fig, m, title, raw)
    if scale is not None:
        fig.update_layout(coloraxis_colorbar_title_text=f"normalized<br>(\u00b1{m:.2%}<br>of gap)")
    return go.Figure(fig)
