"""Pictures of edges and circuits (plotly): ``circuit_graph`` (a ``CircuitResult``'s kept edges,
or an ``EdgeResult``'s top ones) and ``faithfulness_curve`` (MIB's CPR and CMD in its title). The
sender x receiver heatmap is ``viz.heatmaps.edge_heatmap`` (``EdgeResult.heatmap()``).
"""

from __future__ import annotations

import html
from typing import Any

from circuitkit.viz.heatmaps import place_title

INPUT_COLORS = {"q": "#1f77b4", "k": "#d62728", "v": "#2ca02c", "resid": "#7f7f7f"}


def _edges_of(source: Any, top: int, index: int | None) -> tuple[list[dict], int, str]:
    """(edges as dicts with sender/receiver [layer, head], input, score; n_layers; title)."""
    if hasattr(source, "kept") and hasattr(source, "faithfulness"):  # a CircuitResult
        if source.kind != "edges":
            raise ValueError("circuit_graph: this CircuitResult keeps heads, not edges; draw "
                             "the heads with a head heatmap (PatchResult.heatmap()).")
        source = source.to_dict(index)  # one road: what circuit.json holds
    if isinstance(source, dict) and "edges" in source and "nodes" in source:  # circuit.json
        from circuitkit.patching.results import share_phrase

        where = {n["name"]: [n["layer"], n["head"]] for n in source["nodes"]}
        edges = [dict(e, sender=where[e["sender"]], receiver=where[e["receiver"]])
                 for e in source["edges"]]
        if source.get("degenerate"):
            said = "no faithfulness (degenerate)"
        else:
            said = (f"faithfulness {source['faithfulness']:.3f}; "
                    f"{share_phrase(source.get('share'))}")
        return (edges, int(source["n_layers"]),
                f"circuit: {source['n_kept']} of {source['n_items']} edges, {said} "
                f"({html.escape(str(source['ablation']))} ablation)")
    if hasattr(source, "edge_mask") and hasattr(source, "top"):  # an EdgeResult
        df = source.top(top)
        base = source.corrupt if source.direction == "denoise" else source.clean
        edges = [dict(sender=[int(r.sender_layer), int(r.sender_head)],
                      receiver=[int(r.receiver_layer), int(r.receiver_head)], input=r.input,
                      score=float(r.value - base)) for r in df.itertuples()]
        return edges, source.n_layers, f"top {len(edges)} edges ({source.method}, " \
            f"{source.direction})"
    raise TypeError(f"circuit_graph: expected a CircuitResult (ck.circuit) or an EdgeResult "
                    f"(ck.patch_edges); got {type(source).__name__}.")


def circuit_graph(source: Any, title: str | None = None, *, top: int = 30,
                  index: int | None = None, max_width: float = 10.0):
    """The edges of a circuit (``CircuitResult``: its kept set, or circuit ``index`` of its curve;
    or its ``to_dict()``, e.g. a loaded ``circuit.json``) or the ``top`` edges of an ``EdgeResult``
    as a graph: x = layer (embeddings -1, logits n_layers), y = head; line width proportional to
    ``|score|`` (at most ``max_width``), colour by input, dashed when the score is negative."""
    import plotly.graph_objects as go

    from circuitkit.hooks import node_name

    edges, n_layers, what = _edges_of(source, top, index)
    if not edges:
        raise ValueError("circuit_graph: no edges to draw (the kept set is empty).")
    peak = max(abs(e["score"]) for e in edges) or 1.0

    def place(node: list[int]) -> tuple[float, float]:
        layer, head = node
        return (float(layer), -1.0 if head < 0 else float(head))

    fig = go.Figure()
    nodes: dict[str, tuple[float, float]] = {}
    shown: set[str] = set()
    for e in sorted(edges, key=lambda e: abs(e["score"])):
        (x0, y0), (x1, y1) = place(e["sender"]), place(e["receiver"])
        a, b = node_name(e["sender"], n_layers), node_name(e["receiver"], n_layers)
        nodes[a], nodes[b] = (x0, y0), (x1, y1)
        inp = e["input"]
        fig.add_trace(go.Scatter(
            x=[x0, x1], y=[y0, y1], mode="lines", name=f"into {inp}",
            legendgroup=inp, showlegend=inp not in shown,
            line=dict(color=INPUT_COLORS.get(inp, "#444"),
                      width=max(0.5, max_width * abs(e["score"]) / peak),
                      dash="dash" if e["score"] < 0 else "solid"),
            hovertemplate=f"{a} -> {b} ({inp})<br>score {e['score']:.4g}<extra></extra>"))
        shown.add(inp)
    fig.add_trace(go.Scatter(
        x=[p[0] for p in nodes.values()], y=[p[1] for p in nodes.values()],
        mode="markers+text", text=list(nodes), textposition="top center", showlegend=False,
        marker=dict(size=12, color="white", line=dict(color="#333", width=1.5)),
        hovertemplate="%{text}<extra></extra>"))
    ticks = list(range(-1, n_layers + 1))
    fig.update_xaxes(tickmode="array", tickvals=ticks,
                     ticktext=["embed", *[str(t) for t in ticks[1:-1]], "logits"],
                     title_text="layer")
    fig.update_yaxes(title_text="head", zeroline=False)
    fig.update_layout(title=dict(text=title or what, x=0.01, xanchor="left"),
                      plot_bgcolor="white", height=520, width=max(560, 150 * (n_layers + 2)),
                      legend=dict(title="input"))
    return place_title(fig, room=20)


def faithfulness_curve(circ: Any, title: str | None = None):
    """Faithfulness of each circuit of a ``CircuitResult`` against its size (share of items
    kept, log axis), with the 95% bootstrap band over prompts when present."""
    import plotly.graph_objects as go

    if not (hasattr(circ, "faithfulness") and hasattr(circ, "sizes")):
        raise TypeError(f"faithfulness_curve: expected a CircuitResult (ck.circuit); got "
                        f"{type(circ).__name__}.")
    x = list(circ.sizes)
    y = circ.faithfulness.float().tolist()
    fig = go.Figure()
    band = (circ.intervals or {}).get("faithfulness")
    if band:
        fig.add_trace(go.Scatter(x=x + x[::-1], y=[b[1] for b in band] + [b[0] for b in
                                                                          band][::-1],
                                 fill="toself", fillcolor="rgba(31,119,180,0.15)",
                                 line=dict(width=0), name="95% interval", hoverinfo="skip"))
    fig.add_trace(go.Scatter(
        x=x, y=y, mode="lines+markers", name="faithfulness",
        customdata=list(circ.n_kept),
        hovertemplate="kept %{x:.1%} (%{customdata} items)<br>faithfulness %{y:.3f}"
                      "<extra></extra>"))
    fig.add_hline(y=1.0, line=dict(color="#999", dash="dot"))
    ci = circ.intervals or {}

    def fmt(v: float, band: Any) -> str:
        return f"{v:.3f}" + (f" [{band[0]:.3f}, {band[1]:.3f}]" if band else "")

    from circuitkit.patching.results import share_phrase

    fig.update_xaxes(type="log", title_text=f"share of {circ.kind} kept")
    if circ.degenerate:  # raw effects: no share, no CPR/CMD (CircuitResult.degenerate)
        fig.update_yaxes(title_text="raw effect m(C) - m(all ablated)")
        what = "<br><sup>degenerate: raw effects, no faithfulness, CPR or CMD</sup>"
    else:
        fig.update_yaxes(title_text="faithfulness (0 = all ablated, 1 = all kept)")
        what = (f"<br><sup>CPR {fmt(circ.cpr, ci.get('cpr'))} (higher is better), CMD "
                f"{fmt(circ.cmd, ci.get('cmd'))} (lower is better); the scored {circ.kind}: "
                f"{share_phrase(circ.share)}</sup>")
    fig.update_layout(
        title=dict(text=title or (f"circuit faithfulness ({circ.kind}, {circ.ablation} "
                                  f"ablation, ranked by {circ.rank} score){what}"),
                   x=0.01, xanchor="left"),
        plot_bgcolor="white", height=460, width=760)
    return place_title(fig, room=20)
