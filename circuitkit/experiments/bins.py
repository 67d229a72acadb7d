"""The paper's own experiment, computed: the top heads patched together in cumulative bins.

For each phase, site (``"pattern"``: the heads' attention patterns, the paper's; ``"z"``: their
outputs) and direction (``"denoise"``: clean activations into the corrupt run, does it restore?;
``"noise"``: corrupt into clean, does it degrade?), the top ``b`` heads of a ranking are patched
*together* for each bin size ``b`` in ``BINS`` (capped at the model's heads), beside two controls of
equal count: the ``b`` lowest-ranked heads, and ``n_random`` random ``b``-sets of all heads
(seeded). Every set runs through ``ck.patch`` over ``ck.HeadSetUnits`` (the door ``validate_heads``
uses: ``ExactEngine.run_head_sets``, checkpointed; site ``pattern`` on its hooked path).

``cumulative_bins(model, task, ranking)`` returns a DataFrame, one row per (phase, site,
direction, bin, control, draw): ``heads``, ``value`` (the metric's mean after the patch),
``clean``, ``corrupt``, ``normalized`` (denoise ``(value - corrupt) / (clean - corrupt)``: the
share restored; noise ``(value - clean) / (clean - corrupt)``: minus the share removed) and
``n_prompts``. ``bin_summary(frame)``: per (phase, site, direction, bin) the top and lowest sets'
``normalized`` and the random draws' mean with their 2.5 / 97.5 percentiles.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BINS = (3, 8, 16, 40, 100)  # the paper's cumulative bins
SITES = ("pattern", "z")
DIRECTIONS = ("denoise", "noise")
N_RANDOM = 5
COLUMNS = ["phase", "site", "direction", "bin", "control", "draw", "heads", "value", "clean",
           "corrupt", "normalized", "n_prompts"]


def bin_sizes(n_heads: int, bins: Sequence[int] = BINS) -> list[int]:
    """``bins`` capped at ``n_heads`` (the model's heads), without repeats, ascending."""
    return sorted({min(int(b), int(n_heads)) for b in bins if int(b) >= 1})


def bin_sets(ranking: Sequence[tuple[int, int]], n_heads: int, bins: Sequence[int] = BINS,
             n_random: int = N_RANDOM, seed: int = 0) -> list[tuple[int, str, int, list]]:
    """``(bin, control, draw, heads)`` for every bin: the top ``bin`` of ``ranking`` (best
    first; every head of the model), the ``bin`` last ones, and ``n_random`` seeded random
    ``bin``-sets of the ranked heads."""
    ranked = [tuple(h) for h in ranking]
    if len(ranked) != n_heads or len(set(ranked)) != n_heads:
        raise ValueError(f"ranking must hold every one of the model's {n_heads} heads once; got "
                         f"{len(ranked)} ({len(set(ranked))} distinct).")
    rng = random.Random(seed)
    out = []
    for b in bin_sizes(n_heads, bins):
        out.append((b, "top", 0, sorted(ranked[:b])))
        out.append((b, "lowest", 0, sorted(ranked[-b:])))
        for r in range(int(n_random)):
            out.append((b, "random", r, sorted(rng.sample(ranked, b))))
    return out


def cumulative_bins(model: Any, task: Any, rankings: dict[int, Sequence[tuple[int, int]]],
                    bins: Sequence[int] = BINS, sites: Sequence[str] = SITES,
                    directions: Sequence[str] = DIRECTIONS, n_random: int = N_RANDOM,
                    seed: int = 0, batch_size: int | None = None,
                    checkpoint: str | Path | None = None):
    """Module docstring. ``rankings``: per phase every head of the model, best first (e.g.
    ``scoring.heads.top_heads(scores, phase, n_heads)``); each phase runs on ``phase_task(task,
    phase)`` with its metric, one ``ck.patch`` per (phase, site, direction) over ``HeadSetUnits`` of
    its distinct sets. ``checkpoint``: a folder; each run's finished chunks kept in a sub-folder
    named by what it depends on (``HeadSetUnits.checkpoint_in``), so a rerun, or a run killed
    mid-way, computes only the chunks not finished."""
    import pandas as pd

    from circuitkit import hooks
    from circuitkit.experiments.validation import SetRuns, ValidationOptions
    from circuitkit.patching.exact.head_sets import HEAD_SET_SITES
    from circuitkit.patching.units.head_sets import HeadSetUnits
    from circuitkit.tasks.base import check_task, phase_task, task_phases

    bad = [s for s in sites if s not in HEAD_SET_SITES] + [
        d for d in directions if d not in DIRECTIONS]
    if bad or not sites or not directions:
        raise ValueError(f"sites must be among {list(HEAD_SET_SITES)} and directions among "
                         f"{list(DIRECTIONS)}; got sites={list(sites)}, "
                         f"directions={list(directions)}.")
    check_task(task, "cumulative_bins")
    task.check_model(model)
    f = hooks.facts(model)
    n_heads = f.n_layers * f.n_heads
    runs = SetRuns(model, ValidationOptions(batch_size=batch_size, checkpoint=checkpoint,
                                            progress=False))
    rows = []
    for phase in [p for p in task_phases(task) if p in rankings]:
        tp = phase_task(task, phase)
        sets = bin_sets(rankings[phase], n_heads, bins, n_random, seed + phase)
        # each distinct set once (the last bin is every head: top = lowest = random)
        distinct = list(dict.fromkeys(tuple(s) for *_, s in sets))
        for site in sites:
            for direction in directions:
                got, clean, corrupt = _means(runs.patch(
                    tp.clean_tokens, tp.corrupt_tokens, tp.metric,
                    HeadSetUnits([list(s) for s in distinct], site=site), direction,
                    f"bins-p{phase}-{site}-{direction}"))
                gap = clean - corrupt
                base = corrupt if direction == "denoise" else clean
                for (b, control, draw, heads), value in zip(
                        sets, (got[distinct.index(tuple(s))] for *_, s in sets), strict=True):
                    rows.append(dict(phase=phase, site=site, direction=direction, bin=b,
                                     control=control, draw=draw,
                                     heads=" ".join(hooks.head_name(*h) for h in heads),
                                     value=value, clean=clean, corrupt=corrupt,
                                     normalized=(value - base) / gap if gap else float("nan"),
                                     n_prompts=len(tp)))
    return pd.DataFrame(rows, columns=COLUMNS)


def _means(res: Any) -> tuple[list[float], float, float]:
    """Each set's mean value (float64 over prompts), and the clean and corrupt means."""
    if res.per_prompt is None:  # (a metric without per-prompt values: its means)
        return res.values.double().tolist(), res.clean, res.corrupt
    return (res.per_prompt.double().mean(0).tolist(), float(res.clean_per_prompt.double().mean()),
            float(res.corrupt_per_prompt.double().mean()))


def bin_summary(frame: Any):
    """Per (phase, site, direction, bin): ``top``, ``lowest`` (their ``normalized``),
    ``random_mean``, ``random_low``, ``random_high`` (2.5 / 97.5 percentiles of the draws) and
    ``n_random``."""
    import pandas as pd

    out = []
    for key, part in frame.groupby(["phase", "site", "direction", "bin"], sort=True):
        rnd = part[part["control"] == "random"]["normalized"]
        first = part.groupby("control")["normalized"].first()
        out.append(dict(zip(["phase", "site", "direction", "bin"], key, strict=True),
                        top=float(first["top"]), lowest=float(first["lowest"]),
                        random_mean=float(rnd.mean()) if len(rnd) else float("nan"),
                        random_low=float(rnd.quantile(0.025)) if len(rnd) else float("nan"),
                        random_high=float(rnd.quantile(0.975)) if len(rnd) else float("nan"),
                        n_random=len(rnd)))
    return pd.DataFrame(out)


def bins_figure(summary: Any, title: str = "Top heads patched together, cumulative bins"):
    """A plotly figure: one panel per (phase, direction), x the bin size, lines for the top and
    lowest sets and the random draws' mean with its 2.5-97.5% band, per site (dashed: z)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = sorted({(int(p), d) for p, d in zip(summary["phase"], summary["direction"],
                                                 strict=True)})
    fig = make_subplots(rows=1, cols=max(1, len(panels)), subplot_titles=[
        f"Phase {p}, {d} ({'share restored' if d == 'denoise' else 'minus share removed'})"
        for p, d in panels])
    colors = dict(top="#1f77b4", lowest="#d62728", random="#7f7f7f")
    for c, (p, d) in enumerate(panels, 1):
        part = summary[(summary["phase"] == p) & (summary["direction"] == d)]
        for site in sorted(set(part["site"])):
            s = part[part["site"] == site].sort_values("bin")
            dash = "solid" if site == "pattern" else "dash"
            x = s["bin"].tolist()
            fig.add_trace(go.Scatter(x=x + x[::-1], y=s["random_high"].tolist()
                                     + s["random_low"].tolist()[::-1], fill="toself",
                                     line=dict(width=0), fillcolor="rgba(127,127,127,0.15)",
                                     showlegend=False, hoverinfo="skip"), row=1, col=c)
            for ctl, col in (("top", "top"), ("lowest", "lowest"), ("random", "random_mean")):
                fig.add_trace(go.Scatter(x=x, y=s[col], mode="lines+markers",
                                         name=f"{ctl} ({site})", line=dict(
                                             color=colors[ctl], dash=dash),
                                         legendgroup=f"{ctl}{site}", showlegend=c == 1),
                              row=1, col=c)
        fig.update_xaxes(title_text="heads patched together", type="log", row=1, col=c)
    fig.update_layout(title=title, height=420, width=max(520, 460 * len(panels)))
    return fig
