"""``report.html``: one self-contained page of a results folder (opens offline, can be mailed).

``write_report(run_dir)`` reads what it finds in ``run_dir`` (the folder ``circuitkit characterize``
writes; every part is optional, a missing part is skipped with a note):

==============================================  ===============================================
``summary.json``                                model, task, sizes, versions, timings (a table);
                                                ``model`` (a name ``ck.load_model`` takes) and
                                                ``task`` (``ck.load_task``) enable attention views
``patch-p1-denoise`` / ``patch-p1-noise`` ...   ``PatchResult`` files (``.safetensors`` +
                                                ``.json``): a ``-denoise``/``-noise`` pair is one
                                                side-by-side heatmap; any other ``X.json`` +
                                                ``X.safetensors`` (e.g. ``result``) its own
``scores.csv``                                  ``ck.score_heads``: top-head tables, score scatter,
                                                phase profile
``validation.csv``                              ``ck.validate_heads``: chart and table
``ablation.csv`` (or ``distill/ablation.csv``)  distillation ablation (``charts.ablation_chart``)
==============================================  ===============================================

JavaScript: plotly.js (~4.8 MB) is inlined once in ``<head>`` and every figure is a
``<div>`` + ``Plotly.newPlot`` call; the circuitsvis bundle (~1.3 MB) likewise, only when the page
has attention views. Nothing is loaded from a network.
"""

from __future__ import annotations

import html
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# One line per quantity the report shows (what it means, in the report's own words).
METRIC_LINES: dict[str, str] = {
    "value": "the task metric named in each sweep's title after patching one component, mean "
             "over prompts. icd10 and synthetic: anchor_margin (Phase 1), logit of the correct "
             "anchor minus the mean logit of the corrupt evidence's anchors at anchor steps; "
             "target_vs_near_miss_margin (Phase 2), logit of the target minus the mean logit of "
             "its near-miss siblings at answer steps. answer_logprob: mean log-probability of "
             "the answer tokens.",
    "normalized": "denoise (clean activation into the corrupt run): (patched - corrupt) / "
                  "(clean - corrupt), 0 = no effect, 1 = clean behaviour restored; noise (corrupt "
                  "activation into the clean run): (patched - clean) / (clean - corrupt), "
                  "-1 = behaviour fully broken.",
    "95% interval": "percentile bootstrap over prompts of the normalized value (prompts "
                    "resampled with replacement, 1000 resamples).",
    "sharpness": "excess kurtosis of the head's attention row at Phase-1 query positions "
                 "(one sharp peak high, a flat row low), mean over positions and examples.",
    "anchor_alignment": "cosine of the head's write with the correct anchor's (centred) "
                        "unembedding direction minus its mean cosine with the other anchors'.",
    "coarse_score": "Phase-1 score: high only when attention is sharp and the write is "
                    "anchor-aligned.",
    "loopback": "attention mass at Phase-2 query positions on the shortlist entries of target "
                "labels minus that on near-miss labels.",
    "margin_widening": "the head's direct effect on the target-vs-near-miss logit margin "
                       "(its write through the final norm, dotted with W_U[target] - "
                       "W_U[near_miss]).",
    "refine_score": "Phase-2 score: combines loop-back and margin widening.",
    "phase1_rank / phase2_rank": "rank of the head by coarse_score / refine_score (1 = best).",
    "effect (validation)": "change of the measure when the head set is patched together (noise "
                           "or denoise), with its bootstrap 95% interval over prompts; p = "
                           "permutation p-value against sets of random heads from the same "
                           "layers.",
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

PAIR = re.compile(r"^(?P<base>.+)-(?P<direction>denoise|noise)$")
PHASE_NAME = re.compile(r"(?:^|[-_])p(?:hase)?-?(?P<phase>[12])(?:$|[-_])")

CSS = """
body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:0 auto;
max-width:1500px;padding:16px 28px;color:#222}
h1{margin-bottom:4px} h2{border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:36px}
nav a{margin-right:14px} .note{color:#666;font-size:13px} .skip{color:#a15c00}
.warn{color:#b00020;font-weight:600}
table.tbl{border-collapse:collapse;font-size:13px;margin:8px 0}
table.tbl th,table.tbl td{border:1px solid #ddd;padding:3px 8px;text-align:right}
table.tbl th{background:#f4f4f4} table.metrics td{padding:2px 10px;vertical-align:top}
table.metrics td:first-child{font-weight:600;white-space:nowrap}
.tables,.views{display:flex;gap:36px;flex-wrap:wrap} .views>div{flex:1 1 640px;max-width:720px}
"""


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _table(frame: Any, floats: str = "{:.4g}") -> str:
    return frame.to_html(index=False, border=0, classes="tbl", na_rep="",
                         float_format=lambda v: floats.format(v))


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


def _phase_of(name: str, result: Any) -> int | None:
    """The phase a result records (``meta["phase"]``), else one its name says (``p1-...``)."""
    phase = (result.meta or {}).get("phase")
    if phase is not None:
        return int(phase)
    m = PHASE_NAME.search(name)
    return int(m.group("phase")) if m else None


def _sweep_sections(results: dict[str, Any], fig_html) -> list[str]:
    from circuitkit.patching.results import quiet_baseline

    with quiet_baseline():  # the page says it (_gap_warning): no console warning per figure
        return _sweep_figures(results, fig_html)


def _sweep_figures(results: dict[str, Any], fig_html) -> list[str]:
    from circuitkit.viz.heatmaps import patch_heatmap, patch_heatmaps

    out, done = [], set()
    for name, res in results.items():
        m = PAIR.match(name)
        if m and m.group("direction") == "denoise" and f"{m.group('base')}-noise" in results:
            other = f"{m.group('base')}-noise"
            phase = _phase_of(m.group("base"), res)
            head = f"Phase {phase} sweep" if phase else m.group("base")
            out.append(f"<h3>{_esc(head)} <span class='note'>({_esc(name)}, {_esc(other)})"
                       f"</span></h3>" + _gap_warning(res)
                       + fig_html(patch_heatmaps(res, results[other])))
            done |= {name, other}
    for name, res in results.items():
        if name not in done:
            out.append(f"<h3>{_esc(name)}</h3>" + _gap_warning(res) + fig_html(patch_heatmap(res)))
    return out


def _gap_warning(res: Any) -> str:
    """A line when the corruption did not lower the metric by its margin
    (``PatchResult.degenerate``, the one rule): the figure then shows raw effects."""
    if not res.degenerate:
        return ""
    return (f"<p class='warn'>The corruption did not lower the metric here by its margin "
            f"(clean {res.clean:.4g}, corrupt {res.corrupt:.4g}, margin "
            f"{res.gap_margin:.3g}): the model does not show the behaviour this sweep measures, "
            "so the figure shows raw effects (value - baseline), not shares of it.</p>")


def _n_layers(summary: dict, results: dict[str, Any], scores: Any) -> int:
    for key in ("n_layers",):
        if isinstance(summary.get(key), int):
            return summary[key]
    for res in results.values():
        facts = (res.meta or {}).get("facts") or {}
        if "n_layers" in facts:
            return int(facts["n_layers"])
        return int(res.values.shape[0])
    return int(scores["layer"].max()) + 1


def _score_tables(scores: Any, k: int) -> str:
    from circuitkit.scoring.heads import scored_phases, top_heads

    parts = []
    cols = {1: ["sharpness", "anchor_alignment", "coarse_score", "phase1_rank"],
            2: ["loopback", "margin_widening", "refine_score", "phase2_rank"]}
    for phase in scored_phases(scores):  # a phase the task has no steps for has no table
        heads = top_heads(scores, phase, k)
        idx = scores.set_index(["layer", "head"])
        rows = idx.loc[heads].reset_index()
        show = ["layer", "head"] + [c for c in cols[phase] if c in rows.columns]
        parts.append(f"<div><h4>Top {len(heads)} Phase-{phase} heads</h4>"
                     f"{_table(rows[show])}</div>")
    return "<div class='tables'>" + "".join(parts) + "</div>"


def ablation_table(frame: Any) -> Any:
    """The ablation frame (long format, see ``charts.ablation_chart``) as variants x metrics,
    each cell ``"value [ci_low, ci_high]"``."""
    from circuitkit.viz.charts import _interval_columns, check_ablation_frame

    value = check_ablation_frame(frame)
    iv = _interval_columns(frame)
    cells = [f"{r[value]:.3g}" + (f" [{r[iv[0]]:.3g}, {r[iv[1]]:.3g}]" if iv else "")
             for _, r in frame.iterrows()]
    wide = frame.assign(cell=cells).pivot_table(index="variant", columns="metric", values="cell",
                                                aggfunc="first", sort=False)
    return wide.reset_index().rename_axis(columns=None)


def _or_raw(make, frame: Any) -> Any:
    try:
        return make(frame)
    except (ValueError, KeyError):
        return frame


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


def build_report(run_dir: str | Path, *, model: Any = None, task: Any = None,
                 attention: bool = True, top_k: int = 10, attention_heads: int = 3) -> str:
    """The report's HTML text (see the module docstring); ``write_report`` writes it."""
    import pandas as pd
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    from circuitkit.viz import charts
    from circuitkit.viz.attention import circuitsvis_script

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run_dir={str(run_dir)!r}: expected a results folder (as written by "
                         f"circuitkit characterize or patch --out).")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    results, skipped = _patch_results(run_dir)
    read = lambda name: pd.read_csv(run_dir / name) if (run_dir / name).exists() else None
    scores, validation = read("scores.csv"), read("validation.csv")
    ablation = read("ablation.csv")
    if ablation is None and (run_dir / "distill" / "ablation.csv").exists():
        ablation = pd.read_csv(run_dir / "distill" / "ablation.csv")
    if not (summary or results or scores is not None or validation is not None
            or ablation is not None):
        raise ValueError(f"run_dir={str(run_dir)!r} holds none of summary.json, patch results "
                         f"(X.json + X.safetensors), scores.csv, validation.csv, ablation.csv.")

    config = {"displaylogo": False, "responsive": False}
    fig_html = lambda fig: pio.to_html(fig, full_html=False, include_plotlyjs=False,
                                       config=config)

    def chart(make, *args) -> str:
        """A chart, or one line saying why not (a frame whose columns a chart does not know
        still gets its table)."""
        try:
            return fig_html(make(*args))
        except ValueError as e:
            return f"<p class='skip'>Chart skipped: {_esc(e)}</p>"
    sections: list[tuple[str, str, str]] = []  # (id, heading, body)

    model_name = summary.get("model") or summary.get("model_name") or summary.get(
        "identity", {}).get("model") or next(
        (r.meta.get("model_name") or r.meta.get("model") for r in results.values()), None)
    task_name = summary.get("task") or summary.get("identity", {}).get("task") or next(
        (r.meta.get("task") for r in results.values() if r.meta.get("task")), None)
    missing = [s for s in summary.get("steps_expected", []) if s not in summary.get("steps", {})]
    if summary.get("complete") is False and missing:
        sections.append(("unfinished", "Unfinished run", (
            f"<p class='warn'>This characterize run stopped before {len(missing)} of its "
            f"{len(summary['steps_expected'])} steps: {_esc(', '.join(missing))} are missing "
            "below. Rerun the same <code>circuitkit characterize</code> command to finish it "
            "(finished steps are reused).</p>")))
    if summary:
        flat = _flatten(summary)
        # the headline first (what ran, on what, how long); everything else folded away
        head_keys = [k for k in flat if k.startswith(("identity.", "versions.")) or
                     k.endswith(".seconds") or k in ("seconds_all_steps", "seconds_this_call")]
        rest = {k: v for k, v in flat.items() if k not in head_keys}
        head = pd.DataFrame([(k.removeprefix("identity.").removeprefix("steps."), flat[k])
                             for k in head_keys], columns=["key", "value"])
        body = _table(head)
        if rest:
            body += ("<details><summary>full summary.json</summary>"
                     + _table(pd.DataFrame(list(rest.items()), columns=["key", "value"]))
                     + "</details>")
        sections.append(("summary", "Model and task", body))
    lines = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>"
                    for k, v in METRIC_LINES.items())
    sections.append(("metrics", "What the numbers mean", f"<table class='metrics'>{lines}</table>"))
    if results or skipped:
        sections.append(("sweeps", "Activation-patching sweeps",
                         "<p class='note'>Layer x head, colour = normalized effect on one scale "
                         "centred at zero per figure; hover for value and 95% interval.</p>"
                         + "".join(f"<p class='skip'>Skipped {_esc(line)}.</p>"
                                   for line in skipped)
                         + "".join(_sweep_sections(results, fig_html))))
    views: list = []
    if scores is not None:
        body = _score_tables(scores, top_k)
        body += chart(charts.score_scatter, scores)
        body += chart(charts.phase_profile, scores, _n_layers(summary, results, scores))
        sections.append(("scores", "Head scores", body))
    if validation is not None:
        sections.append(("validation", "Causal validation",
                         chart(charts.validation_chart, validation) + _table(validation)))
    if attention and scores is not None:
        sections.append(("attention", "Attention of the top heads",
                         _attention_section(summary, scores, model, task, attention_heads,
                                            views)))
    if ablation is not None:
        sections.append(("distillation", "Distillation ablation",
                         chart(charts.ablation_chart, ablation)
                         + "<p class='note'>mean over seeds [95% interval]</p>"
                         + _table(_or_raw(ablation_table, ablation))))

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


def write_report(run_dir: str | Path, out: str | Path | None = None, **kw: Any) -> Path:
    """Write ``report.html`` for ``run_dir`` (default ``run_dir/report.html``); return its path.

    ``kw``: ``model=``/``task=`` (already loaded: skips reloading for the attention views),
    ``attention=False`` (no views), ``top_k`` (rows of the score tables), ``attention_heads``.
    """
    from circuitkit.files import atomic_write, check_writable_file

    path = Path(out) if out is not None else Path(run_dir) / "report.html"
    if path.is_dir():  # before the (slow) report is built
        check_writable_file(path, "out", "report.html")
    text = build_report(run_dir, **kw)
    check_writable_file(path, "out", "report.html")  # (makes its folder)
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def describe_written(path: Path, seconds: float) -> str:
    """``"wrote runs/x/report.html (6.3 MB) in 2.1 s"``: the line the CLI prints."""
    return f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) in {seconds:.1f} s"
