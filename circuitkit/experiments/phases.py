"""The report's causal picture: where each phase's decision is made (``scoring.causal``).

``causal_section(run_dir, summary, table_html)``: the phase table's sentences
(``phase_sentences``), the samples heads were selected and validated on, and per phase a
[head x position group] table of each head's share of the phase's clean-corrupt gap
(``carried``: noise, positive = the head helps) for the heads in any group's top k.
Every string taken from a file is escaped (``html.escape``; ``DataFrame.to_html`` escapes).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any


def _samples_line(samples: dict[str, Any]) -> str:
    """Both samples named: seed, n, examples and hash; whether they are disjoint."""
    def one(s: dict[str, Any]) -> str:
        ex = s.get("examples") or ["?", "?"]
        return (f"seed {s.get('seed')}, n {s.get('n')}, examples {ex[0]}..{ex[1]}, "
                f"hash {s.get('hash')}")
    sel, val = samples.get("select") or {}, samples.get("validate") or {}
    how = ("held out: heads selected on one sample, validated on a disjoint one"
           if samples.get("held_out") else
           "not held out: heads selected and validated on the same notes (--select-n N "
           "holds the rest out)")
    return html.escape(f"Samples ({how}). Selected on: {one(sel)}. Validated on: {one(val)}.")


def causal_frames(table: Any, phase_table: dict[str, Any]) -> dict[int, Any]:
    """Per phase a DataFrame: ``head`` then one column per group (``carried`` noise shares,
    rounded to 3 digits), rows the heads in any group's top k, ordered by "all"."""
    import pandas as pd

    from circuitkit.scoring.causal import ALL, carried

    direction = phase_table.get("direction", "noise")
    out = {}
    for p in (1, 2):
        ph = phase_table.get(f"phase{p}")
        if not ph:
            continue
        groups = list(ph["groups"])
        names = {n for g in groups for n, _ in ph["groups"][g]["top"]}
        rows = table[table["name"].isin(names)]
        frame = pd.DataFrame({"head": rows["name"]})
        for g in groups:
            frame[g] = carried(rows, p, direction, g).round(3)
        out[p] = frame.sort_values(ALL, ascending=False, kind="stable")
    return out


def causal_section(run_dir: Path, summary: dict[str, Any], table_html: Any) -> str:
    """The report's lead section (``""`` when the run has no phase table: stages not run)."""
    from circuitkit.scoring.causal import phase_sentences

    pt = summary.get("phase_table")
    if not pt:
        return ""
    from circuitkit.experiments.findings import causal_validation_lines

    body = "".join(f"<p><b>{html.escape(line)}</b></p>" for line in phase_sentences(pt))
    body += "".join(f"<p>{html.escape(line)}</p>" for line in causal_validation_lines(summary))
    if summary.get("samples"):
        body += f"<p class='note'>{_samples_line(summary['samples'])}</p>"
    path = Path(run_dir) / "causal.csv"
    if path.is_file():
        import pandas as pd

        frames = causal_frames(pd.read_csv(path), pt)
        for p, frame in frames.items():
            what = ("raw effect (no share: the corruption does not lower the metric by its "
                    "margin)" if (pt.get(f"phase{p}") or {}).get("degenerate") else
                    "share of the gap")  # (the one degenerate-baseline rule)
            body += (f"<h4>Phase {p}: {what} by head and position group "
                     f"({html.escape(str(pt.get('direction')))}"
                     f"{'' if what.startswith('raw') else ', 1 = the whole gap'})</h4>"
                     + table_html(frame))
    return body + ("<p class='note'>The descriptive scores below keep their formulas; the "
                   "causal columns above are exact patching at each position group "
                   "(scores.csv p{phase}_{direction}_{group}).</p>")


def lead_section(run_dir: Path, summary: dict[str, Any], table_html: Any) -> str:
    """The report's first section (``""`` without ``summary["lead"]``): per phase where the
    decision is made (held out, intervals), the stable heads and whether the paper's scores find
    them (``experiments.claims.lead_sentences``), a [layer x position group] table of held-out
    shares with their intervals, the claims table, and the paper's cumulative bins
    (``bins/summary.csv``, ``bins/bins.html``)."""
    import pandas as pd

    from circuitkit.experiments.claims import lead_sentences

    picture = summary.get("lead")
    if not isinstance(picture, dict):
        return ""
    body = ""
    for p, lines in lead_sentences(picture).items():
        body += f"<h4>Phase {p}</h4>" + "".join(
            f"<p>{'<b>' if i == 0 else ''}{html.escape(line)}{'</b>' if i == 0 else ''}</p>"
            for i, line in enumerate(lines))
        w = picture[f"phase{p}"]["where"]
        frame = pd.DataFrame({"layer": w["layers"]})
        for j, g in enumerate(w["groups"]):
            frame[g] = [f"{w['share'][la][j]:.0%} [{w['low'][la][j]:.0%}, {w['high'][la][j]:.0%}]"
                        for la in range(len(w["layers"]))]
        body += ("<p class='note'>Share of the gap carried by each layer's heads at each "
                 f"position group ({'held out' if picture.get('held_out') else 'selection'} "
                 f"notes, n = {w['n_held']}; single-head patches summed, 95% intervals)</p>"
                 + table_html(frame))
    rows = summary.get("claims")
    if isinstance(rows, list) and rows:
        frame = pd.DataFrame([dict(claim=r["statement"], verdict=r["verdict"],
                                   evidence=r["evidence"], n=r.get("n"), power=r.get("power"))
                              for r in rows])
        body += "<h4>The paper's claims, checked in this run</h4>" + table_html(frame)
    path = Path(run_dir) / "bins" / "summary.csv"
    if path.is_file():
        body += ("<h4>The paper's experiment: top heads by its scores patched together in "
                 "cumulative bins</h4><p class='note'>Normalized effect (denoise: share "
                 "restored; noise: minus the share removed) of the top, the lowest-ranked and "
                 "random heads of equal count (random: mean and 2.5-97.5% of the draws); "
                 "<a href='bins/bins.html'>the figure</a>, bins/bins.csv every set.</p>"
                 + table_html(pd.read_csv(path).round(3)))
    return body
