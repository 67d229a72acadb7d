"""Issue 34's science: where each phase's decision is made, on several pairs of disjoint samples.

For each seed ``s``, ``characterize(model, n_examples=2 n, select_n=n, seed=s, stages=True,
edges=True, n_random=R)`` (resumable; its folder ``OUT/<model>-s<s>``): heads are selected on
the seed's first ``n`` notes and validated on its other ``n``, so the seeds give ``2 x seeds``
disjoint samples. Then, from each folder's ``summary.json``, ``validation*.csv`` and
``edges/``, one Markdown table per question:

* where each phase's decision is made (``phase_table``: summed single-head noising shares per
  layer and per position group, the causal top set);
* the held-out null: the causal top set (``validation-causal.csv``) and the descriptive top set
  (``validation.csv``) noised together on the validation notes, as a share of the gap, with
  ``p`` and its Monte Carlo interval per pool;
* whether the same heads carry both phases (``same_heads``);
* how much of the Phase-1 senders' effect reaches the Phase-2 receivers: direct q/k/v edges
  (``coverage``) and paths through everything, per position group (``path_coverage``);
* agreement between pairs: how often each head is in a phase's causal top set.

    python benchmarks/phase_evidence.py [--model icd-teacher] [--seeds 1 2 3] [--n 128]
        [--n-random 1000] [--out benchmarks/results/phase-evidence] [--report-only] [--gaps]

``--gaps``: first ask whether there is anything to locate. Per seed and phase, the phase's
clean-corrupt gap ``mean_i (m(clean_i) - m(corrupt_i))`` over the ``2 n`` notes ``characterize``
would use (``scoring.text.load_for``: rendered as text for a pretrained LLM), with its normal 95%
interval and the share of notes whose corruption lowers the metric; one forward per note and
run, into ``OUT/<model>-gaps.md``. A gap whose interval holds 0 leaves a sweep nothing to
attribute (every share of it is noise), so the phase's claims are not testable on that model.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pandas as pd


def run(model: str, seeds: list[int], n: int, n_random: int, out: Path, text: str | None
        ) -> list[Path]:
    from circuitkit.experiments.characterize import characterize

    folders = []
    for s in seeds:
        folder = out / f"{model.replace('/', '_')}-s{s}"
        characterize(model, "icd10", folder, dict(
            n_examples=2 * n, select_n=n, seed=s, n_random=n_random, stages=True, edges=True,
            progress=False, text={"yes": True, "no": False}.get(text)))
        folders.append(folder)
    return folders


def gaps(model_name: str, seeds: list[int], n: int, text: str | None) -> str:
    """``--gaps``: each phase's clean-corrupt gap with its 95% interval (module docstring)."""
    import torch

    import circuitkit as ck
    from circuitkit.scoring.text import load_for
    from circuitkit.tasks.base import phase_task, task_phases

    model = ck.load_model(model_name)
    rows = []
    for s in seeds:
        task, rendered = load_for(model, "icd10", 2 * n, s, "test",
                                  {"yes": True, "no": False}.get(text))
        for p in task_phases(task):
            tp = phase_task(task, p)
            d = torch.cat([_gap_rows(model, tp, range(i, min(i + 8, len(tp))))
                           for i in range(0, len(tp), 8)]).double()
            half = 1.96 * float(d.std()) / len(d) ** 0.5
            rows.append([s, p, tp.metric.name, len(tp), "text" if rendered else "tokens",
                         f"{float(d.mean()):+.4f} [{float(d.mean()) - half:+.4f}, "
                         f"{float(d.mean()) + half:+.4f}]",
                         f"{float((d > 0).double().mean()):.2f}"])
    return "## Clean-corrupt gap per phase (95% normal interval over notes)\n\n" + _md(
        ["seed", "phase", "metric", "notes", "rendered as", "gap", "share of notes lowered"],
        rows) + "\n"


def _gap_rows(model, tp, rows: range):
    """``m(clean_i) - m(corrupt_i)`` of the notes ``rows`` of the phase task ``tp``."""
    import torch

    m = tp.metric.select(rows)
    with torch.no_grad():
        return (m.per_prompt(model(tp.clean_tokens[rows.start:rows.stop]))
                - m.per_prompt(model(tp.corrupt_tokens[rows.start:rows.stop])))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _p(row: dict) -> str:
    return f"{row['p']:.2g} [{row['p_low']:.2g}, {row['p_high']:.2g}] (n={row['n_random']})"


def report(folders: list[Path]) -> str:
    rows, nulls, same, reach, tops = [], [], [], [], {1: Counter(), 2: Counter()}
    for f in folders:
        s = json.loads((f / "summary.json").read_text())
        name = f.name
        pt = s["phase_table"]
        for p in (1, 2):
            ph = pt.get(f"phase{p}")
            if not ph:
                continue
            tops[p].update(ph["top_heads"])
            layers = ", ".join(f"L{ly} {_pct(v)}" for ly, v in ph["layers"].items()
                               if v >= 0.05)
            groups = ", ".join(f"{g} {_pct(v['sum'])} (top {v['top'][0][0]})"
                               for g, v in ph["groups"].items() if g != "all"
                               and v["sum"] >= 0.05)
            rows.append([name, p, ph["metric"], f"{ph['gap']:.3g}", layers, groups,
                         " ".join(ph["top_heads"])])
            cv = (s.get("causal_validation") or {}).get(f"phase{p}")
            val = pd.read_csv(f / "validation.csv")
            d = val[(val.phase == p) & (val.direction == "noise")]
            d = d[d.quantity == d.quantity.iloc[0]]
            desc = {r.pool: dict(p=r.p_value, p_low=r.p_low, p_high=r.p_high,
                                 n_random=r.n_random) for r in d.itertuples()}
            nulls.append([name, p, "causal", cv["heads"] if cv else "",
                          _pct(cv["normalized"]) if cv else "",
                          _p(cv["pools"]["layer-stratified"]) if cv else "",
                          _p(cv["pools"]["all-layers"]) if cv else ""])
            nulls.append([name, p, "score", d.heads.iloc[0], _pct(d.normalized.iloc[0]), "",
                          _p(desc["all-layers"])])
        sh = pt.get("same_heads") or {}
        same.append([name, " ".join(sh.get("overlap", [])),
                     _pct(sh.get("phase1_by_phase2_heads", float("nan"))),
                     _pct(sh.get("phase2_by_phase1_heads", float("nan"))),
                     _pct(sh.get("phase1_by_own_heads", float("nan"))),
                     _pct(sh.get("phase2_by_own_heads", float("nan")))])
        ej = json.loads((f / "edges" / "edges.json").read_text()) \
            if (f / "edges" / "edges.json").exists() else {}
        em = ej.get("meta", {})
        cov, paths = em.get("coverage") or {}, em.get("path_coverage") or {}
        reach.append([name, _heads(ej.get("senders", [])), _heads(ej.get("receivers", [])),
                      _pct(cov.get("overall", float("nan"))),
                      ", ".join(f"{g} {_pct(v)}" for g, v in paths.items())])
    out = ["## Where each phase's decision is made (noising shares of the gap; select notes)",
           _md(["run", "phase", "metric", "gap", "layers (>= 5%)", "groups (>= 5%)",
                "causal top 5"], rows),
           "## Held-out null: the top set noised together on the validation notes",
           _md(["run", "phase", "selected by", "heads", "share of the gap",
                "p layer-stratified [MC 95%]", "p all-layers [MC 95%]"], nulls),
           "## The same heads in both phases? (summed single-head shares)",
           _md(["run", "in both top 5", "P1 gap by P2 heads", "P2 gap by P1 heads",
                "P1 gap by own", "P2 gap by own"], same),
           "## Phase-1 senders into Phase-2 receivers: share of the senders' own effect",
           _md(["run", "senders (Phase-1 score top 5)", "receivers (Phase-2 score top 5 after)",
                "direct q/k/v edges", "paths (per position group)"], reach),
           f"## Agreement over {len(folders)} pairs: times in the causal top 5",
           "\n".join(f"- Phase {p}: " + ", ".join(f"{h} {c}/{len(folders)}"
                                                  for h, c in tops[p].most_common())
                     for p in (1, 2))]
    return "\n\n".join(out) + "\n"


def _heads(nodes: list) -> str:
    return " ".join(f"L{a}H{b}" for a, b in nodes if a >= 0)  # (the embeddings: layer -1)


def _md(cols: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="icd-teacher")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--n", type=int, default=128, help="notes per sample (2 samples per seed)")
    ap.add_argument("--n-random", type=int, default=1000)
    ap.add_argument("--text", choices=["auto", "yes", "no"], default="auto")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/phase-evidence"))
    ap.add_argument("--report-only", action="store_true",
                    help="only collate the folders already in --out")
    ap.add_argument("--gaps", action="store_true",
                    help="only measure each phase's clean-corrupt gap (is there an effect?)")
    args = ap.parse_args()
    if args.gaps:
        text = gaps(args.model, args.seeds, args.n, args.text)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.model.replace('/', '_')}-gaps.md").write_text(text)
        print(text)
        return
    if args.report_only:
        folders = sorted(p for p in args.out.glob(f"{args.model.replace('/', '_')}-s*")
                         if (p / "summary.json").exists())
    else:
        folders = run(args.model, args.seeds, args.n, args.n_random, args.out, args.text)
    text = report(folders)
    (args.out / f"{args.model.replace('/', '_')}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
