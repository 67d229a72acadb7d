"""``report.html``: one self-contained page of a results folder (opens offline, can be mailed).

``write_report(run_dir)`` reads what it finds in ``run_dir`` (every part optional; a missing part is
skipped with a note): ``summary.json`` (model, task, sizes, versions, timings; its ``model`` and
``task`` enable the attention views), every ``X.json`` + ``X.safetensors`` ``PatchResult`` (a
``-denoise``/``-noise`` pair is one side-by-side heatmap), ``scores.csv``, ``validation.csv``,
``head-ablation.csv``, the distillation's ``ablation.csv`` (or ``distill/ablation.csv``) and
``characterize --edges``' ``edges/``. The page leads with the findings in words
(``experiments.findings``), then the sweeps, scores, validation, attention and ablation; the
glossary lists only the quantities the page shows; fingerprints, versions and timings come last.

JavaScript: plotly.js (~4.8 MB) is inlined once in ``<head>``, every figure a ``<div>`` +
``Plotly.newPlot`` call; the circuitsvis bundle (~1.3 MB) likewise, only with attention views.
Nothing is loaded from a network.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from circuitkit import hooks
from circuitkit.experiments.findings import SMALL_SHARE, phase_of

# One line per quantity the report shows (what it means, in the report's own words).
METRIC_LINES: dict[str, str] = {
    "value": "the task metric named in each sweep's title after patching one component, mean "
             "over prompts. icd10 and synthetic: anchor_margin (Phase 1), logit of the correct "
             "anchor minus the mean logit of the corrupt evidence's anchors at anchor steps; "
             "sibling_margin (Phase 2), logit of the corrupted target minus the mean logit of "
             "its own shortlisted siblings at its answer step (all_near_miss_margin: every "
             "near-miss of the note, at every answer step, for rows without those fields); "
             "with a note-intact corruption, shortlist_anchor_margin (Phase 1) and "
             "edited_sibling_margin (Phase 2), docs/scores.md. answer_logprob: mean "
             "log-probability of the answer tokens.",
    "normalized": "denoise (clean activation into the corrupt run): (patched - corrupt) / "
                  "(clean - corrupt), 0 = no effect, 1 = clean behaviour restored; noise (corrupt "
                  "activation into the clean run): (patched - clean) / (clean - corrupt), "
                  "-1 = behaviour fully broken.",
    "raw_effect": "what a column holds in place of normalized when the corruption does not lower "
                  "the metric (a degenerate baseline): the patch's raw change of the metric, "
                  "value - baseline; no share of a gap can be taken.",
    "95% interval": "percentile bootstrap over prompts of the normalized value (prompts "
                    "resampled with replacement, 1000 resamples).",
    "sharpness": "excess kurtosis of the head's attention row at Phase-1 query positions "
                 "(one sharp peak high, a flat row low), mean over positions and examples.",
    "anchor_alignment": "cosine of the head's write with the correct anchor's (centred) "
                        "direction minus its mean cosine with the other anchors': by default "
                        "the centroid of the anchor's labels' unembeddings (the _tokens "
                        "columns use the anchor token's own unembedding).",
    "coarse_score": "Phase-1 score: high only when attention is sharp and the write is "
                    "anchor-aligned.",
    "shortlist_share": "attention mass at Phase-2 query positions on the shortlist entries.",
    "key_preference": "mean attention per target entry against per near-miss entry, "
                      "(a_T - a_M) / (a_T + a_M): count-balanced, 0 for a head uniform over "
                      "the shortlist, +1 targets only, -1 near-misses only.",
    "ov_copy": "what the head writes from the entries it reads, on their own label's logit "
               "(minus the mean logit), attention-weighted: + copies, - suppresses.",
    "mechanism": "for heads with a refine_score of at least a tenth of the largest: copy "
                 "(margin mostly from target entries, mostly raising the target), suppress "
                 "(from near-miss entries, lowering them) or retrieve (the two disagree, e.g. "
                 "reading near-miss entries and raising the target); - otherwise.",
    "loopback": "shortlist_share x key_preference: re-attending to the shortlist and to which "
                "side of it (+1 targets only, -1 near-misses only, 0 uniform or none).",
    "margin_widening": "the head's direct effect on the target-vs-near-miss logit margin "
                       "(its write through the final norm, dotted with W_U[target] - "
                       "W_U[near_miss]).",
    "refine_score": "Phase-2 score: the part of margin_widening the head writes from the "
                    "shortlist entries it reads (sum over entries of attention x that entry's "
                    "value through W_O on the margin).",
    "Phase 1 rank / Phase 2 rank": "rank of the head by coarse_score / refine_score (1 = best; "
                                   "scores.csv: phase1_rank / phase2_rank); [95%]: the "
                                   "bootstrap interval of that rank; (tokens): the Phase 1 rank "
                                   "with anchor-token directions.",
    "inclusion / rank interval": "share of bootstrap resamples of the examples in which the "
                                 "head is in the top k, and the 2.5-97.5 percentile of its "
                                 "rank there; a top head below 0.8 is flagged unstable.",
    "effect (validation)": "change of the measure when the head set is patched together (noise "
                           "or denoise), with its bootstrap 95% interval over prompts; p = "
                           "permutation p-value against random head sets of one pool: "
                           "same-layers (the top heads' layers, overlap = top heads every set "
                           "shares where a layer has too few others) or all-layers (disjoint).",
    "ablation": "the top-k set, or a random set, zero-, mean- or resample-ablated (z set to 0, "
                "to its mean over the prompts, or to another prompt's) on the clean run: "
                "exact_match (teacher-forced: every answer step's arg-max is a target), "
                "confusion and focus; effect = ablated - unablated, 95% intervals.",
    "focus": "Reasoning Focus: softmax mass on the correct anchors among all anchors at anchor "
             "steps (teacher-forced), mean over examples.",
    "confusion": "Near-Miss Confusion: softmax mass on near-misses among targets + near-misses "
                 "at answer steps (teacher-forced).",
    "confusion_rate": "share of notes whose greedily decoded answer contains a near-miss.",
    "macro_f1 / micro_f1 / exact_match": "F1 over labels (mean per label / pooled) and share of "
                                         "notes whose decoded label set equals the target set.",
    "las": "leakage-adjusted simulatability: how much the generated rationale helps a simulator "
           "predict the model's answer, averaged over leaking and non-leaking examples.",
}

# Which glossary entries a page needs: the sweeps' and the score table's by what it shows; the
# validation's and the ablation's also by the measures their frames name.
SWEEP_TERMS = ("value", "normalized", "95% interval")
SCORE_TERMS = {1: ("sharpness", "anchor_alignment", "coarse_score"),
               2: ("shortlist_share", "key_preference", "ov_copy", "mechanism", "loopback",
                   "margin_widening", "refine_score")}
MEASURE_TERMS = {"focus": "focus", "confusion": "confusion", "confusion_rate": "confusion_rate",
                 "macro_f1": "macro_f1 / micro_f1 / exact_match",
                 "micro_f1": "macro_f1 / micro_f1 / exact_match",
                 "exact_match": "macro_f1 / micro_f1 / exact_match", "las": "las"}

PAIR = re.compile(r"^(?P<base>.+)-(?P<direction>denoise|noise)$")

CSS = """
body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:0 auto;
max-width:1500px;padding:16px 28px;color:#222}
h1{margin-bottom:4px} h2{border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:36px}
nav a{margin-right:14px} .note{color:#666;font-size:13px} .skip{color:#a15c00}
.warn{color:#b00020;font-weight:600}
.tbl-box{max-width:100%;overflow-x:auto;margin:8px 0}
table.tbl{border-collapse:collapse;font-size:13px}
table.tbl th,table.tbl td{border:1px solid #ddd;padding:3px 8px;text-align:right}
table.tbl th{background:#f4f4f4} table.metrics td{padding:2px 10px;vertical-align:top}
table.metrics td:first-child{font-weight:600;white-space:nowrap}
.tables,.views{display:flex;gap:36px;flex-wrap:wrap} .views>div{flex:1 1 640px;max-width:720px}
.tables>div{min-width:0;max-width:100%}
.finding{max-width:1100px;margin:10px 0 18px;line-height:1.45}
.finding p{margin:4px 0} .finding ul{margin:4px 0;padding-left:22px;color:#333}
"""


def _esc(x: Any) -> str:
    return html.escape(str(x))


def read_summary(run_dir: Path) -> dict[str, Any]:
    """``run_dir/summary.json`` ({} when absent), after checking every file it records a
    SHA-256 for (``characterize``'s steps) against that digest: a file changed since the run
    wrote it is refused in one ``ValueError`` naming it, before anything of it reaches the page
    (a missing file is the page's "Missing files" note)."""
    from circuitkit import files

    path = run_dir / "summary.json"
    if not path.exists():
        return {}
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not readable ({e}).") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (truncated?) at line {e.lineno} column "
                         f"{e.colno}.") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{path}: expected a JSON object; got {type(summary).__name__}.")
    steps = summary.get("steps", {})
    if not isinstance(steps, dict) or not all(isinstance(r, dict) for r in steps.values()):
        raise ValueError(f"{path}: field 'steps' must map step names to records.")
    for step, record in steps.items():
        sums = record.get("sha256") or {}
        if not isinstance(sums, dict):
            raise ValueError(f"{path}: field 'steps.{step}.sha256' must map files to digests.")
        for name, digest in sums.items():
            file = run_dir / str(name)
            if files.modified(file, digest):
                raise ValueError(f"{file} was modified after characterize wrote it (its SHA-256 "
                                 f"differs from the one {path} records for step {step!r}); "
                                 "rerun the same characterize command to recompute it.")
    return summary


_TH = re.compile(r"<th>([^<]*)</th>")


def _table(frame: Any, floats: str = "{:.4g}") -> str:
    """``frame`` as a table in a box that scrolls sideways when the table is wider than the
    page (it never widens the page); column names may break after ``_``."""
    page = frame.to_html(index=False, border=0, classes="tbl", na_rep="",
                         float_format=lambda v: floats.format(v))
    page = _TH.sub(lambda m: "<th>" + m.group(1).replace("_", "_<wbr>") + "</th>", page)
    return f"<div class='tbl-box'>{page}</div>"


def _words(key: str) -> str:
    """A summary.json key for the page: ``phase1`` written ``Phase 1``."""
    return re.sub(r"phase(\d)", r"Phase \1", key)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, list | tuple):
            text = json.dumps(v, default=str)
            out[key] = text if len(text) <= 120 else text[:117] + "..."
        else:
            out[key] = v
    return out


def _patch_results(run_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """``name -> PatchResult`` of every ``name.json`` + ``name.safetensors`` pair in run_dir, and
    a line for each pair that is not a PatchResult (skipped: one stray file costs no report)."""
    from circuitkit.patching.results import PatchResult

    found, skipped = {}, []
    for js in sorted(run_dir.glob("*.json")):
        if js.with_suffix(".safetensors").exists():
            try:
                found[js.stem] = PatchResult.load(run_dir / js.stem)
            except (ValueError, OSError, KeyError) as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                skipped.append(f"{js.stem}: not a PatchResult ({first})")
    return found, skipped


def _sweep_sections(results: dict[str, Any], fig_html) -> list[str]:
    from circuitkit.patching.results import quiet_baseline
    from circuitkit.viz.heatmaps import patch_heatmap, patch_heatmaps

    out, done = [], set()
    with quiet_baseline():  # the page says it (_gap_warning): no console warning per figure
        for name, res in results.items():
            m = PAIR.match(name)
            if m and m.group("direction") == "denoise" and f"{m.group('base')}-noise" in results:
                other = f"{m.group('base')}-noise"
                phase = phase_of(m.group("base"), res)
                head = f"Phase {phase} sweep" if phase else m.group("base")
                out.append(f"<h3>{_esc(head)} <span class='note'>({_esc(name)}, {_esc(other)})"
                           f"</span></h3>" + _gap_warning(res)
                           + fig_html(patch_heatmaps(res, results[other])))
                done |= {name, other}
        for name, res in results.items():
            if name not in done:
                out.append(f"<h3>{_esc(sweep_heading(name, res))}</h3>" + _gap_warning(res)
                           + fig_html(patch_heatmap(res)))
    return out


def sweep_heading(name: str, result: Any) -> str:
    """A single sweep's heading: ``"Phase 2 sweep, noise: target_vs_near_miss_margin
    (result)"``; what it patched (heads, layers, per position) when it is not a head sweep."""
    phase = phase_of(name, result)
    what = {("layer", "head"): "", ("layer", "head", "pos"): " per position",
            ("layer", "pos"): f" of layer site {result.site}"}.get(tuple(result.axes), "")
    head = (f"Phase {phase} sweep" if phase else "Sweep") + what + f", {result.direction}"
    metric = (result.meta or {}).get("metric")
    return head + (f": {metric}" if metric else "") + f" ({name})"


def _gap_warning(res: Any) -> str:
    """A line when the corruption did not lower the metric by its margin
    (``PatchResult.degenerate``, the one rule): the figure then shows raw effects."""
    if not res.degenerate:
        return ""
    return (f"<p class='warn'>The corruption did not lower the metric here by its margin "
            f"(clean {res.clean:.4g}, corrupt {res.corrupt:.4g}, margin "
            f"{res.gap_margin:.3g}): the model does not show the behaviour this sweep measures, "
            "so the figure shows raw effects (value - baseline), not shares of it.</p>")


def glossary_terms(results: dict[str, Any], scores: Any, validation: Any,
                   ablation: Any, head_ablation: Any = None) -> list[str]:
    """The ``METRIC_LINES`` entries a page shows something of, in their order."""
    from circuitkit.scoring.heads import scored_phases

    want: set[str] = set()
    if results:
        want |= set(SWEEP_TERMS)
        if any(getattr(r, "degenerate", False) for r in results.values()):
            want.add("raw_effect")
    if scores is not None:
        phases = scored_phases(scores) if "layer" in scores.columns else []
        for phase in phases:
            want |= {t for t in SCORE_TERMS[phase] if t in scores.columns}
        if phases:
            want.add("Phase 1 rank / Phase 2 rank")
        if any(f"phase{p}_inclusion" in scores.columns for p in phases):
            want.add("inclusion / rank interval")
    for frame, extra in ((validation, "effect (validation)"), (head_ablation, "ablation"),
                         (ablation, None)):
        if frame is None:
            continue
        if extra:
            want.add(extra)
        for col in ("quantity", "measure", "metric"):
            if col in frame.columns:
                want |= {MEASURE_TERMS[m] for m in frame[col].astype(str) if m in MEASURE_TERMS}
    return [k for k in METRIC_LINES if k in want]


def findings_in(run_dir: str | Path) -> tuple[str, list]:
    """``(run line, experiments.findings)`` of a results folder: what ``findings_section``
    shows, for the console (``circuitkit characterize`` prints it)."""
    import pandas as pd

    from circuitkit.experiments.findings import findings, run_line

    run_dir = Path(run_dir)
    summary = read_summary(run_dir)
    read = lambda name: pd.read_csv(run_dir / name) if (run_dir / name).exists() else None
    results, _ = _patch_results(run_dir)
    edges, circ = _edge_files(run_dir)
    return run_line(summary), findings(summary, read("validation.csv"), read("scores.csv"),
                                       results, edges=edges, circuit=circ,
                                       head_ablation=read("head-ablation.csv"))


def findings_section(summary: dict, validation: Any, scores: Any,
                     results: dict[str, Any], edges: Any = None, circuit: Any = None,
                     head_ablation: Any = None) -> str:
    """The report's first section: ``experiments.findings`` rendered (one block per phase, one for
    the edges)."""
    from circuitkit.experiments.findings import findings, run_line

    found = [f for f in findings(summary, validation, scores, results, edges=edges,
                                 circuit=circuit, head_ablation=head_ablation)
             if f.phase not in ("causal", "lead1", "lead2", "claims")]  # (the sections above)
    line = run_line(summary)
    out = f"<p class='note'>{_esc(line)}</p>" if line else ""
    for f in found:
        notes = "".join(f"<li>{_esc(n)}</li>" for n in f.notes)
        out += (f"<div class='finding' data-phase='{_esc(f.phase)}'><p><b>{_esc(f.title)}.</b> "
                f"{_esc(f.headline)}</p>"
                + (f"<ul>{notes}</ul>" if notes else "") + "</div>")
    if not found:
        out += "<p class='skip'>Nothing to summarise: the folder holds no sweeps, scores or " \
               "validation.</p>"
    return out


def _n_layers(summary: dict, results: dict[str, Any], scores: Any) -> int:
    if isinstance(summary.get("n_layers"), int):
        return summary["n_layers"]
    for res in results.values():
        facts = (res.meta or {}).get("facts") or {}
        if "n_layers" in facts:
            return int(facts["n_layers"])
        return int(res.values.shape[0])
    return int(scores["layer"].max()) + 1


def _score_tables(scores: Any, k: int) -> str:
    from circuitkit.scoring.heads import scored_phases, top_heads

    parts = []
    cols = {1: ["sharpness", "anchor_alignment", "coarse_score", "phase1_rank",
                "phase1_rank_low", "phase1_rank_high", "phase1_inclusion",
                "phase1_rank_tokens"],
            2: ["shortlist_share", "key_preference", "ov_copy", "mechanism", "loopback",
                "margin_widening", "refine_score", "margin_from_targets",
                "margin_from_near_misses", "refine_target_up", "phase2_rank",
                "phase2_rank_low", "phase2_rank_high", "phase2_inclusion"]}
    for phase in scored_phases(scores):  # a phase the task has no steps for has no table
        heads = top_heads(scores, phase, k)
        idx = scores.set_index(["layer", "head"])
        rows = idx.loc[heads].reset_index()
        show = ["layer", "head"] + [c for c in cols[phase] if c in rows.columns]
        rows, show = _phase_columns(rows[show], phase)
        parts.append(f"<div><h4>Top {len(heads)} Phase-{phase} heads</h4>"
                     f"{_table(rows[show])}</div>")
    return "<div class='tables'>" + "".join(parts) + "</div>"


def _phase_columns(rows: Any, phase: int) -> tuple[Any, list[str]]:
    """The score table's ``phase{N}_*`` columns in words: ``Phase N rank [95%]`` (the rank
    with its bootstrap interval in one cell), ``Phase N inclusion``, ``Phase N rank (tokens)``."""
    rows = rows.copy()
    rank, low, high = (f"phase{phase}_rank{s}" for s in ("", "_low", "_high"))
    names = {f"phase{phase}_inclusion": f"Phase {phase} inclusion",
             f"phase{phase}_rank_tokens": f"Phase {phase} rank (tokens)",
             rank: f"Phase {phase} rank"}
    if {rank, low, high} <= set(rows.columns):
        rows[rank] = [f"{r:.0f} [{lo:.0f}, {hi:.0f}]" if lo == lo and hi == hi
                      else f"{r:.0f}" for r, lo, hi in zip(rows[rank], rows[low], rows[high],
                                                           strict=True)]
        names[rank] = f"Phase {phase} rank [95%]"
        rows = rows.drop(columns=[low, high])
    rows = rows.rename(columns=names)
    return rows, list(rows.columns)


def instrument_section(scores: Any, summary: dict, k: int) -> str | None:
    """Per score (circuitkit's and the paper's forms), its agreement with the causal ranking
    (Spearman, precision@k; needs ``characterize --stages``) and with its null, and the verdict
    in words (``scoring.instruments``); None for a scores.csv without the issue-47 columns."""
    from circuitkit.scoring.instruments import instrument_table

    if "key_preference_positional_null" not in scores.columns:
        return None
    nulls = (summary.get("scores_attrs") or {}).get("instrument_nulls") or {}
    table = instrument_table(scores, k, nulls=nulls)
    if table.empty:
        return None
    causal = table["spearman_causal"].notna().any()
    note = ("<p class='note'>spearman_causal: over heads, with each head's needed share of its "
            "phase's gap (noised at every position); precision_at_k: the score's top "
            f"{k} in the causal top {k}. null_agreement: Spearman with the null (sharpness: "
            "heads ranked on short rows against long rows). A score whose verdict says it "
            "cannot beat its null measures that null on this model as much as its name.</p>")
    if not causal:
        note += ("<p class='skip'>No causal columns in scores.csv (run characterize with "
                 "--stages): only the nulls are shown.</p>")
        table = table.drop(columns=["spearman_causal", "precision_at_k", "causal_top_k"])
    return note + _table(table, "{:+.3f}")


def _stability_lines(summary: dict, scores: Any) -> str:
    """Lines under the score tables: top-k heads whose bootstrap inclusion is below 0.8, the
    agreement of the two anchor-direction rankings, and how much each RefineScore part moves
    the Phase-2 ranking (``summary.json``'s ``stability`` / ``scores_attrs``)."""
    out = []
    for phase, st in (summary.get("stability") or {}).items():
        # (summary.json's fields: every one escaped, numbers too, as a file may hold anything)
        n, k = _esc(str(phase).removeprefix("phase")), _esc(st.get("k"))
        if st.get("unstable"):
            heads = ", ".join(hooks.head_name(la, h) for la, h in st["unstable"])
            out.append(f"<p class='warn'>Phase-{n} top-{k}: {_esc(heads)} in the top "
                       f"{k} in fewer than 80% of the bootstrap resamples of the "
                       "examples: the ranking there is not stable.</p>")
        elif st.get("top"):
            out.append(f"<p class='note'>Phase-{n} top-{k}: every head in the top "
                       f"{k} in at least 80% of the bootstrap resamples.</p>")
    attrs = summary.get("scores_attrs") or {}
    agree = attrs.get("anchor_agreement")
    if agree:
        sp = agree.get("spearman")
        sp = "n/a" if not isinstance(sp, int | float) else f"{sp:.3f}"
        out.append(f"<p class='note'>Phase-1 ranking with label-centroid anchor directions "
                   f"against anchor-token columns: Spearman {sp}, top-{_esc(agree.get('k'))} "
                   f"overlap {_esc(agree.get('top_k_overlap'))} of {_esc(agree.get('k'))}.</p>")
    parts = attrs.get("refine_parts")
    if parts:
        import pandas as pd

        out.append("<h4>How much each RefineScore part moves the Phase-2 ranking</h4>"
                   "<p class='note'>spearman_alone: refine_score against the part by itself; "
                   "spearman_without: against refine_score without the part (docs/scores.md); "
                   "top_k_kept: top-k heads still in the top k without it.</p>"
                   + _table(pd.DataFrame(parts)))
    return "".join(out)


def _validation_table(frame: Any) -> Any:
    """``validation.csv`` for the page: each estimate with its interval in one cell
    (``"value [low, high]"``), so the table fits the page; validation.csv keeps every column."""
    trios = (("top effect [95%]", "top_effect", "top_low", "top_high", "{:.3g}"),
             ("random effect [95%]", "random_mean", "random_low", "random_high", "{:.3g}"),
             ("p [95%]", "p_value", "p_low", "p_high", "{:.2g}"))
    show = frame.copy()
    done = []
    for name, mid, low, high, f in trios:
        if {mid, low, high} <= set(frame.columns):
            show[name] = [f"{f.format(m)}\u00a0[{f.format(lo)},\u00a0{f.format(hi)}]"
                          if m == m else ""  # (no-break spaces: one line per cell)
                          for m, lo, hi in zip(frame[mid], frame[low], frame[high],
                                               strict=True)]
            done += [mid, low, high]
    cols = [c for c in frame.columns if c not in done]
    named = [c for c in ("normalized", "raw_effect") if c in cols]
    at = cols.index(named[0]) if named else len(cols)
    return show[cols[:at] + [n for n, *parts in trios if parts[0] in done] + cols[at:]]


def _same_in_every_row(frame: Any, cols: tuple[str, ...] = ("k", "n_prompts", "overlap")) -> \
        tuple[Any, str]:
    """``frame`` without those of ``cols`` that hold one value in every row, and a note
    naming them (``"every row: k 5, n_prompts 128"``), so a wide table fits the page."""
    same = [c for c in cols if c in frame.columns and len(frame) and
            frame[c].nunique(dropna=False) == 1]
    if not same:
        return frame, ""
    said = ", ".join(f"{c} {frame[c].iloc[0]}" for c in same)
    return frame.drop(columns=same), f"<p class='note'>In every row: {_esc(said)}.</p>"


def _head_ablation_table(frame: Any) -> Any:
    """``head-ablation.csv`` as one row per (phase, pool, ablation, quantity) with
    ``"value [low, high]"`` cells for the top set's and the random sets' effects."""
    need = {"top_effect", "top_low", "top_high", "random_mean", "random_low", "random_high"}
    if not need <= set(frame.columns):
        return frame
    show = frame.copy()
    for name, mid, low, high in (("top effect [95%]", "top_effect", "top_low", "top_high"), (
            "random effect [95%]", "random_mean", "random_low", "random_high")):
        show[name] = [f"{m:+.3f}\u00a0[{lo:+.3f},\u00a0{hi:+.3f}]"  # (no-break spaces: one line)
                      for m, lo, hi in zip(frame[mid], frame[low], frame[high], strict=True)]
    keep = [c for c in ("phase", "pool", "ablation", "quantity", "heads", "n_random", "overlap",
                        "n_prompts", "base", "top_value") if c in show.columns]
    return show[keep + ["top effect [95%]", "random effect [95%]"]
                + [c for c in ("p_value",) if c in show.columns]]


def ablation_table(frame: Any) -> Any:
    """The ablation frame (long format, see ``charts.ablation_chart``) as variants x metrics,
    each cell ``"value [ci_low, ci_high]"``."""
    from circuitkit.experiments.charts import (
        _interval_columns,
        ablation_labels,
        check_ablation_frame,
    )

    value = check_ablation_frame(frame)
    frame = ablation_labels(frame)
    iv = _interval_columns(frame)
    cells = [f"{r[value]:.3g}" + (f" [{r[iv[0]]:.3g}, {r[iv[1]]:.3g}]" if iv else "")
             for _, r in frame.iterrows()]
    wide = frame.assign(cell=cells).pivot_table(index="variant", columns="metric", values="cell",
                                                aggfunc="first", sort=False)
    return wide.reset_index().rename_axis(columns=None)


def _attention_section(summary: dict, scores: Any, model: Any, task: Any, k: int,
                       views: list) -> str:
    """Attention views of the top ``k`` heads of each phase, or a line saying why not."""
    from circuitkit.scoring.heads import scored_phases, top_heads
    from circuitkit.viz.attention import attention

    summary = {**summary.get("identity", {}), **summary}  # characterize keeps them in identity
    try:
        if model is None:
            import circuitkit as ck

            # a local folder by its absolute path: the report may run from another folder
            name = summary.get("model_path") or summary.get("model") or summary.get("model_name")
            if not name:
                return "<p class='skip'>Attention views skipped: summary.json names no model.</p>"
            model = ck.load_model(str(name))
        if task is None:
            from circuitkit.scoring.text import load_for

            task_name = summary.get("task")
            if not task_name:
                return "<p class='skip'>Attention views skipped: summary.json names no task.</p>"
            # the task as the run saw it: rendered as text for a pretrained LLM's tokenizer when
            # the run was (the built task's ids mean other tokens to that model)
            text = summary.get("text")
            task, _ = load_for(model, str(task_name), 4, int(summary.get("seed", 0)),
                               str(summary.get("split", "test")),
                               None if text is None else bool(text),
                               **(summary.get("task_kwargs") or {}))
        out = []
        for phase in scored_phases(scores):
            view = attention(model, task, heads=top_heads(scores, phase, k), example=0)
            view.title = f"Top {k} Phase-{phase} heads on {view.title}"
            views.append(view)
            out.append(f"<div>{view.fragment()}</div>")
        return "<div class='views'>" + "".join(out) + "</div>"
    except Exception as e:  # a report without pictures beats no report: say why, keep going
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return (f"<p class='skip'>Attention views skipped: could not load the model or task "
                f"({_esc(type(e).__name__)}: {_esc(first)}).</p>")


@dataclass
class _RunFiles:
    """What ``build_report`` found in a results folder (each part None / empty when absent)."""

    run_dir: Path
    summary: dict[str, Any]
    results: dict[str, Any]  # name -> PatchResult
    skipped: list[str]  # a line per pair of files that is not a PatchResult
    edge_result: Any
    circ: dict[str, Any] | None
    scores: Any
    validation: Any
    ablation: Any
    head_ablation: Any

    @property
    def model_name(self) -> str | None:
        s = self.summary
        return s.get("model") or s.get("model_name") or s.get("identity", {}).get("model") or \
            next((r.meta.get("model_name") or r.meta.get("model")
                  for r in self.results.values()), None)

    @property
    def task_name(self) -> str | None:
        s = self.summary
        return s.get("task") or s.get("identity", {}).get("task") or next(
            (r.meta.get("task") for r in self.results.values() if r.meta.get("task")), None)


def _read_run(run_dir: Path) -> _RunFiles:
    """Every part of ``run_dir`` the page shows (``summary.json`` verified first); a folder
    with none of them is one ``ValueError``."""
    import pandas as pd

    if not run_dir.is_dir():
        raise ValueError(f"run_dir={str(run_dir)!r}: expected a results folder (as written by "
                         f"circuitkit characterize or patch --out).")
    summary = read_summary(run_dir)  # every recorded file verified first
    results, skipped = _patch_results(run_dir)
    edge_result, circ = _edge_files(run_dir)
    read = lambda name: pd.read_csv(run_dir / name) if (run_dir / name).exists() else None
    ablation = read("ablation.csv")
    if ablation is None and (run_dir / "distill" / "ablation.csv").exists():
        ablation = pd.read_csv(run_dir / "distill" / "ablation.csv")
    run = _RunFiles(run_dir, summary, results, skipped, edge_result, circ, read("scores.csv"),
                    read("validation.csv"), ablation, read("head-ablation.csv"))
    if not (summary or results or run.scores is not None or run.validation is not None
            or ablation is not None):
        raise ValueError(f"run_dir={str(run_dir)!r} holds none of summary.json, patch results "
                         f"(X.json + X.safetensors), scores.csv, validation.csv, ablation.csv.")
    return run


def build_report(run_dir: str | Path, *, model: Any = None, task: Any = None,
                 attention: bool = True, top_k: int = 10, attention_heads: int = 3) -> str:
    """The report's HTML text (see the module docstring); ``write_report`` writes it. The
    page's sections in order: what is missing (``_status_sections``), the lead and the
    findings (``_lead_sections``), the results (``_result_sections``), the attention views,
    the edges and the distillation grid (``_more_sections``), the glossary, and the
    summary's details last (``_details_section``)."""
    import plotly.io as pio

    run_dir = Path(run_dir)
    run = _read_run(run_dir)
    config = {"displaylogo": False, "responsive": False}
    fig_html = lambda fig: pio.to_html(fig, full_html=False, include_plotlyjs=False,
                                       config=config)
    views: list = []
    sections = _status_sections(run_dir, run.summary) + _lead_sections(run_dir, run)
    sections += _result_sections(run, fig_html, top_k)
    if attention and run.scores is not None:
        sections.append(("attention", "Attention of the top heads", _attention_section(
            run.summary, run.scores, model, task, attention_heads, views)))
    sections += _more_sections(run_dir, run, fig_html)
    sections += _glossary_section(run)
    details = _details_section(run.summary)  # fingerprints, versions, timings: the last one
    if details:
        sections.append(details)
    return _page(run_dir, run, sections, views)


def _chart(fig_html: Any, make: Any, *args: Any) -> str:
    """A chart, or one line saying why not (a frame whose columns a chart does not know still
    gets its table)."""
    try:
        return fig_html(make(*args))
    except ValueError as e:
        return f"<p class='skip'>Chart skipped: {_esc(e)}</p>"


def _status_sections(run_dir: Path, summary: dict) -> list[tuple[str, str, str]]:
    """``(id, heading, body)`` of what is missing: steps recorded as done whose files are
    gone (not silently left out of the page), and an unfinished run's missing steps."""
    sections = []
    recorded = summary.get("steps", {})
    missing = [s for s in summary.get("steps_expected", []) if s not in recorded]
    lost = {s: [f for f in r.get("files", []) if not (run_dir / f).is_file()]
            for s, r in recorded.items() if isinstance(r, dict)}
    lost = {s: f for s, f in lost.items() if f}
    if lost:  # recorded as done, files gone: not silently left out of the page
        sections.append(("lost", "Missing files", (
            "<p class='warn'>summary.json records these steps as done, but their files are "
            "missing: " + _esc("; ".join(f"{s} ({', '.join(f)})" for s, f in lost.items()))
            + ". Rerun the same <code>circuitkit characterize</code> command to recompute "
            "them.</p>")))
    if summary.get("complete") is False and missing:
        sections.append(("unfinished", "Unfinished run", (
            f"<p class='warn'>This characterize run stopped before {len(missing)} of its "
            f"{len(summary['steps_expected'])} steps: {_esc(', '.join(missing))} are missing "
            "below. Rerun the same <code>circuitkit characterize</code> command to finish it "
            "(finished steps are reused).</p>")))
    return sections


def _lead_sections(run_dir: Path, run: _RunFiles) -> list[tuple[str, str, str]]:
    """Where each decision is made and the paper's claims, the causal picture, the findings
    in words: the page leads with them."""
    from circuitkit.experiments.phases import causal_section, lead_section

    sections = []
    lead = lead_section(run_dir, run.summary, _table)  # where, stable heads, claims: first
    if lead:
        sections.append(("lead", "Where each decision is made, and the paper's claims", lead))
    causal = causal_section(run_dir, run.summary, _table)  # the causal picture leads the
    if causal:  # findings
        sections.append(("causal", "Where each phase's decision is made (causal)", causal))
    if run.results or run.scores is not None or run.validation is not None \
            or run.edge_result is not None or run.circ is not None:
        sections.append(("findings", "Findings", findings_section(
            run.summary, run.validation, run.scores, run.results, edges=run.edge_result,
            circuit=run.circ, head_ablation=run.head_ablation)))
    return sections


def _result_sections(run: _RunFiles, fig_html: Any, top_k: int
                     ) -> list[tuple[str, str, str]]:
    """The sweeps' heatmaps, the stage sweeps, the head scores (and the instruments), the
    causal validation and the head ablation."""
    from circuitkit.experiments import charts

    sections = []
    if run.results or run.skipped:
        sections.append(("sweeps", "Activation-patching sweeps",
                         "<p class='note'>Layer x head, colour = normalized effect on one scale "
                         "centred at zero per figure; hover for value and 95% interval.</p>"
                         + "".join(f"<p class='skip'>Skipped {_esc(line)}.</p>"
                                   for line in run.skipped)
                         + "".join(_sweep_sections(run.results, fig_html))))
    stages = _stages_section(run.run_dir)
    if stages:
        sections.append(("stages", "Heads by stage (position groups)", stages))
    scores, summary = run.scores, run.summary
    if scores is not None:
        body = _score_tables(scores, top_k)
        body += _stability_lines(summary, scores)
        body += _chart(fig_html, charts.score_scatter, scores)
        body += _chart(fig_html, charts.phase_profile, scores,
                       _n_layers(summary, run.results, scores))
        sections.append(("scores", "Head scores", body))
        instruments = instrument_section(scores, summary, min(5, len(scores)))
        if instruments:
            sections.append(("instruments", "Instruments: the causal ranking and their nulls",
                             instruments))
    if run.validation is not None:
        table, note = _same_in_every_row(_validation_table(run.validation))
        sections.append(("validation", "Causal validation",
                         _chart(fig_html, charts.validation_chart, run.validation) + note
                         + _table(table)))
    if run.head_ablation is not None:
        table, note = _same_in_every_row(_head_ablation_table(run.head_ablation))
        sections.append(("head-ablation", "Ablation of the top heads",
                         "<p class='note'>Each phase's top-k set and random sets ablated on "
                         "the clean run; effect = ablated - unablated, mean over prompts "
                         "[bootstrap 95% interval]; the random interval is where one random "
                         "set's effect falls; p against that pool's random sets.</p>"
                         + note + _table(table)))
    return sections


def _more_sections(run_dir: Path, run: _RunFiles, fig_html: Any) -> list[tuple[str, str, str]]:
    """The edges (``characterize --edges``) and the distillation grid's table."""
    from circuitkit.experiments import charts

    sections = []
    edges = _edges_section(run_dir, fig_html, run.circ)
    if edges:
        sections.append(("edges", "Edges: which heads feed which", edges))
    if run.ablation is not None:
        try:
            wide = ablation_table(run.ablation)
        except (ValueError, KeyError):  # a frame the table does not know: shown as it is
            wide = run.ablation
        sections.append(("distillation", "Distillation ablation",
                         _chart(fig_html, charts.ablation_chart, run.ablation)
                         + "<p class='note'>mean over seeds [95% interval]</p>" + _table(wide)))
    return sections


def _glossary_section(run: _RunFiles) -> list[tuple[str, str, str]]:
    """What the numbers mean: only the quantities the page shows."""
    terms = glossary_terms(run.results, run.scores, run.validation, run.ablation,
                           run.head_ablation)
    if not terms:
        return []
    lines = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(METRIC_LINES[k])}</td></tr>"
                    for k in terms)
    return [("metrics", "What the numbers mean", f"<table class='metrics'>{lines}</table>")]


def _details_section(summary: dict) -> tuple[str, str, str] | None:
    """``summary.json`` as a table: the headline first (what ran, on what, how long),
    everything else folded away; None without a summary."""
    import pandas as pd

    if not summary:
        return None
    flat = _flatten(summary)
    head_keys = [k for k in flat if k.startswith(("identity.", "versions.")) or
                 k.endswith(".seconds") or k in ("seconds_all_steps", "seconds_this_call")]
    rest = {k: v for k, v in flat.items() if k not in head_keys}
    head = pd.DataFrame([(_words(k.removeprefix("identity.").removeprefix("steps.")),
                          flat[k]) for k in head_keys], columns=["key", "value"])
    body = _table(head)
    if rest:
        body += ("<details><summary>full summary.json</summary>"
                 + _table(pd.DataFrame([(_words(k), v) for k, v in rest.items()],
                                       columns=["key", "value"]))
                 + "</details>")
    return ("summary", "Model, task and versions", body)


def _page(run_dir: Path, run: _RunFiles, sections: list[tuple[str, str, str]],
          views: list) -> str:
    """The self-contained page: title, navigation, the sections, plotly.js (and the
    circuitsvis bundle when there are attention views) inlined."""
    from plotly.offline import get_plotlyjs

    from circuitkit.viz.attention import circuitsvis_script

    model_name, task_name = run.model_name, run.task_name
    title = "circuitkit report" + (f": {model_name}" if model_name else "") + \
        (f" on {task_name}" if task_name else "")
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    nav = "".join(f"<a href='#{sid}'>{_esc(head)}</a>" for sid, head, _ in sections)
    body = "".join(f"<section id='{sid}'><h2>{_esc(head)}</h2>{text}</section>"
                   for sid, head, text in sections)
    scripts = f"<script>{get_plotlyjs()}</script>"
    if views:
        scripts += circuitsvis_script()
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{_esc(title)}</title><style>{CSS}</style>{scripts}</head><body>"
            f"<h1>{_esc(title)}</h1><p class='note'>{_esc(run_dir.resolve())} · generated "
            f"{stamp} · self-contained (no network needed)</p><nav>{nav}</nav>{body}"
            f"</body></html>")


def _stages_section(run_dir: Path, top: int = 10) -> str | None:
    """The position-group sweeps of ``run_dir/groups`` (``characterize``'s stages step): per phase,
    the strongest cell of each direction in words, then the ``top`` heads by their largest
    ``|normalized|`` over groups, one column per (direction, group). None without them."""
    import pandas as pd

    from circuitkit.hooks import head_name
    from circuitkit.patching.results import PatchResult, quiet_baseline

    folder = run_dir / "groups"
    if not folder.is_dir():
        return None
    out = ""
    for phase in (1, 2):
        got = {}
        for d in ("noise", "denoise"):
            path = folder / f"patch-p{phase}-{d}"
            if path.with_suffix(".json").exists():
                try:
                    got[d] = PatchResult.load(path)
                except ValueError as e:
                    out += f"<p class='skip'>Skipped {_esc(path.name)}: {_esc(e)}</p>"
        if not got:
            continue
        cols, lines = {}, []
        with quiet_baseline():
            for d, res in got.items():
                norm, names = res.normalized(), res.meta["group_names"]
                c = int(norm.abs().nan_to_num(0).flatten().argmax())
                L, H, G = norm.shape
                lines.append(f"{d}: strongest {head_name(c // (H * G), (c // G) % H)} at "
                             f"the {names[c % G]} positions ({float(norm.flatten()[c]):+.3f})")
                for g, name in enumerate(names):
                    cols[f"{d}: {name}"] = norm[..., g].flatten().numpy()
        frame = pd.DataFrame(cols)
        frame.insert(0, "head", [head_name(la, h) for la in range(L) for h in range(H)])
        order = frame.drop(columns="head").abs().max(axis=1).sort_values(
            ascending=False).index[:top]
        out += (f"<h3>Phase {phase}</h3><p>{_esc('; '.join(lines))}.</p>"
                + _table(frame.loc[order].reset_index(drop=True), "{:+.3f}"))
    if not out:
        return None
    return ("<p class='note'>Each head patched at one stage's positions of every note at once "
            "(normalized effect; evidence, anchor, shortlist and answer at those tokens' own "
            "positions, read at the positions the phase's metric reads).</p>" + out)


def _edge_files(run_dir: Path) -> tuple[Any, dict[str, Any] | None]:
    """``(EdgeResult or None, circuit.json checked by read_circuit_json or None)`` of
    ``run_dir/edges``; an edge result that does not load is None here (its section says why);
    a malformed ``circuit.json`` is refused (``ValueError`` naming the file and field)."""
    from circuitkit.patching.results import EdgeResult, read_circuit_json

    folder = run_dir / "edges"
    res = None
    if (folder / "edges.json").exists():
        try:
            res = EdgeResult.load(folder / "edges")
        except ValueError:
            res = None
    circ = read_circuit_json(folder / "circuit.json") if (folder / "circuit.json").exists() \
        else None
    return res, circ


def _edges_section(run_dir: Path, fig_html, circ: dict[str, Any] | None) -> str | None:
    """``characterize --edges``'s results (``run_dir/edges``): the sender x receiver heatmap
    per input, the strongest edges into each input with their intervals, and the circuit
    (graph, faithfulness curve as a table, CPR and CMD, beside the scored edges' share of the
    whole clean-corrupt gap); None when there are none."""
    import pandas as pd

    from circuitkit.patching.results import EdgeResult, gap_percent, share_phrase
    from circuitkit.viz.edges import circuit_graph

    folder = run_dir / "edges"
    if not (folder / "edges.json").exists():
        return None
    try:
        res = EdgeResult.load(folder / "edges")
    except ValueError as e:
        return f"<p class='skip'>Edges skipped: {_esc(e)}</p>"
    meta = res.meta or {}
    def phase(key: str) -> str:  # "phase1" -> "Phase-1"
        return _esc(re.sub(r"^phase(\d)$", r"Phase-\1", str(meta.get(key, ""))))

    body = (f"<p class='note'>Senders: the top {phase('senders_from')} heads; "
            f"receivers: the top {phase('receivers_from')} heads after them. An "
            "edge adds the sender's clean-minus-corrupt write to one receiver's q, k or v input "
            "only (every other reader keeps the corrupt run); value: the metric after that "
            "patch, normalized as the sweeps above (a share of the whole clean-corrupt gap; "
            "the heatmap's caption states its colour range in % of that gap).</p>")
    body += fig_html(res.heatmap())
    cols = ["sender", "receiver", "input", "value", res.value_column] + (
        ["ci_low", "ci_high"] if res.per_prompt is not None else [])
    tops = [res.top(5, input=name)[cols] for name in res.inputs]
    body += _table(pd.concat(tops, ignore_index=True), "{:.4g}")  # (0.0017 of the gap: not 0.000)
    if circ is not None:  # (read_circuit_json: checked)
        ci = lambda key: (f" [{circ[key][0]:.3f}, {circ[key][1]:.3f}]"  # noqa: E731
                          if circ.get(key) else "")
        pct = lambda key: (f" [{gap_percent(circ[key][0])}, "  # noqa: E731
                           f"{gap_percent(circ[key][1])}]" if circ.get(key) else "")
        share = circ.get("share")
        said = (f"All {_esc(circ['n_items'])} scored edges together: "
                f"{_esc(share_phrase(share))}{pct('share_ci')} (share = (all kept - all "
                "ablated) / (clean - corrupt)), so the faithfulness and CPR below are shares of "
                "that part only, not of the model's behaviour.")
        if circ.get("degenerate"):
            body += (f"<p class='warn'>Circuit ({_esc(circ['ablation'])} ablation): no "
                     f"faithfulness, CPR or CMD: {_esc(circ['degenerate'])}</p>")
        else:
            cls = "warn" if share is not None and abs(share) < SMALL_SHARE else "note"
            reached = "" if circ.get("target_reached", True) else (
                f" (none of the curve reaches the target {float(circ['target']):.3g}: this is the "
                "largest circuit)")
            body += (f"<p class='{cls}'>{said}</p><p>Circuit ({_esc(circ['ablation'])} ablation "
                     f"of the edges left out): the top {_esc(circ['n_kept'])} of "
                     f"{_esc(circ['n_items'])} edges reach faithfulness "
                     f"{circ['faithfulness']:.3f}{ci('faithfulness_ci')}{reached}; over the "
                     f"curve CPR {circ['cpr']:.3f}{ci('cpr_ci')} (area under it; 1 is best) and "
                     f"CMD {circ['cmd']:.3f}{ci('cmd_ci')} (area between it and 1; 0 is "
                     "best).</p>")
        if circ.get("curve"):
            body += _table(pd.DataFrame(circ["curve"]), "{:.3f}")
        if circ.get("edges"):
            body += fig_html(circuit_graph(circ))
    return body


def write_report(run_dir: str | Path, out: str | Path | None = None, **kw: Any) -> Path:
    """Write ``report.html`` for ``run_dir`` (default ``run_dir/report.html``); return its path.

    ``kw``: ``model=``/``task=`` (already loaded: skips reloading for the attention views),
    ``attention=False`` (no views), ``top_k`` (rows of the score tables), ``attention_heads``.
    """
    from circuitkit.files import atomic_write, check_writable_file, holds_lock, lock_folder

    path = Path(out) if out is not None else Path(run_dir) / "report.html"
    if path.is_dir():  # before the (slow) report is built
        check_writable_file(path, "out", "report.html")
    # the folder read is locked (not by a characterize run of this process: it holds it)
    lock = lock_folder(run_dir, "run_dir") if Path(run_dir).is_dir() and not holds_lock(
        run_dir) else None
    try:
        text = build_report(run_dir, **kw)
        check_writable_file(path, "out", "report.html")  # (makes its folder)
        return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
    finally:
        if lock is not None:
            lock.close()


def describe_written(path: Path, seconds: float) -> str:
    """``"wrote runs/x/report.html (6.3 MB) in 2.1 s"``: the line the CLI prints."""
    return f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) in {seconds:.1f} s"
