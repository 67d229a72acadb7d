"""What a run found, in words: the sentences ``report.html`` leads with and ``circuitkit
characterize`` prints at its end.

``findings(summary, validation, scores, results)`` is a function of the run's data only (no HTML
here; ``report.py`` renders it, the CLI prints it). Each argument may be missing (None, empty);
a sentence needing it is then left out. Fields read:

===================  ==============================================================================
argument             fields
===================  ==============================================================================
``summary``          ``model``; ``task``; ``identity.n_examples``, ``identity.split``,
                     ``identity.seed`` (or the same keys at the top level); ``phases``;
                     ``skipped`` (lines: steps or ablations left out, e.g. resample on one
                     prompt)
``validation``       ``ck.validate_heads``' frame, one row per (phase, direction, quantity):
                     ``phase, direction, quantity, heads, k, n_random, n_prompts, clean, corrupt,
                     top_effect, top_low, top_high, random_mean, p_value, normalized``
                     and ``pool``/``overlap``: the headline reads the "all-layers" sets
                     (disjoint from the top set), a note the "same-layers" ones (a frame
                     without them, e.g. a hand-made long table, gives no validation sentence;
                     several rows per key: the first is read)
``scores``           ``ck.score_heads``' frame: ``layer, head`` and ``phase{1,2}_rank`` (else
                     ``coarse_score``/``refine_score``; ``scoring.heads.top_heads`` ranks)
``results``          ``{name: PatchResult}``; head sweeps (axes ``layer, head``) with
                     ``meta["phase"]`` (else a ``p1``/``p2`` in the name) and ``direction``:
                     ``normalized()``, ``confidence_interval()``, ``meta["metric"]``
``edges``            ``EdgeResult`` (``characterize --edges``): ``senders``, ``receivers``,
                     ``inputs``, ``top(1)``, ``meta`` ``metric``/``senders_from``/``receivers_from``
``head_ablation``    ``ck.ablate_heads``' frame (``head-ablation.csv``): ``phase, pool, ablation,
                     quantity, k, n_random, top_effect, p_value``; ``summary``'s ``stability``
                     (``phase{p}.unstable``, ``.k``) and the validation's ``n_prompts`` give
                     the caveats
``circuit``          its ``circuit.json`` (``read_circuit_json``): ``share``, ``share_ci``,
                     ``n_items``, ``n_kept``, ``ablation``, ``faithfulness``, ``cpr``, ``cmd``,
                     ``target``, ``target_reached``, ``degenerate``
===================  ==============================================================================

Per phase one ``Finding``: ``headline`` (which heads, which layers, whether they beat random head
sets with the p-value's floor ``1 / (n_random + 1)`` stated, the key measured effect) and
``notes`` (the strongest patching cell; why a strong cell is missing from the score ranking).
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from circuitkit import hooks

ALPHA = 0.05  # the level "beats random heads" is read at
# a candidate edge set carrying less than this share of the clean-corrupt gap is called small
# (its faithfulness is a share of that small part, and the report says so in a warning colour)
SMALL_SHARE = 0.05
PHASE_NAMES = {1: "Phase 1 (coarse: anchors)",
               2: "Phase 2 (refinement: target vs near-miss codes)"}
RANKED_BY = {
    1: ("coarse_score", "sharp attention \u00d7 a write aligned with the correct anchor"),
    2: ("refine_score", "the part of the head's direct write widening the target-vs-near-miss "
                        "margin that it writes from the shortlist entries it attends to"),
}
BEHAVIOUR = {"focus": "Reasoning Focus", "confusion": "Near-Miss Confusion"}
VALIDATION_FIELDS = ("phase", "direction", "quantity", "k", "n_random", "clean", "corrupt",
                     "top_effect", "top_low", "top_high", "random_mean", "p_value",
                     "normalized")


@dataclass
class Finding:
    """One phase's findings: ``headline`` (one or two sentences) and ``notes``."""

    phase: int | str  # 1, 2, or "edges"
    title: str  # "Phase 1 (coarse: anchors)"
    headline: str  # which heads, which layers, whether they beat random head sets (the floor)
    notes: list[str] = field(default_factory=list)  # key effect, strongest cell, why it is out
    heads: list[tuple[int, int]] = field(default_factory=list)

    def text(self) -> str:
        return " ".join([f"{self.title}:", self.headline, *self.notes])


def _g(x: float, digits: int = 3) -> str:
    """A number for a sentence: ``digits`` significant figures, a real minus sign."""
    if x is None or not math.isfinite(float(x)):
        return "n/a"
    return f"{float(x):.{digits}g}".replace("-", "\u2212")


def _signed(x: float) -> str:
    return ("+" if float(x) > 0 else "") + _g(x)


def _pct(x: float) -> str:
    return f"{abs(float(x)):.0%}"


def _heads_phrase(heads: list[tuple[int, int]]) -> str:
    """"L0H2, L0H3 and L2H1, in layers 0 (2 heads) and 2 (1)" style."""
    names = [hooks.head_name(*h) for h in heads]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    by_layer: dict[int, int] = {}
    for layer, _ in heads:
        by_layer[layer] = by_layer.get(layer, 0) + 1
    if len(by_layer) == 1:
        (layer,) = by_layer
        where = f"all in layer {layer}" if len(heads) > 1 else f"in layer {layer}"
    else:
        parts = [f"{layer} ({n} head{'s' if n > 1 else ''})" if i == 0 else f"{layer} ({n})"
                 for i, (layer, n) in enumerate(sorted(by_layer.items()))]
        where = "in layers " + ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{listed}, {where}"


def _rows(validation: Any, phase: int, pool: str = "all-layers") -> dict[tuple[str, str], Any]:
    """``{(quantity, direction): row}`` of ``phase`` in a ``validate_heads`` frame, for the
    random sets of ``pool`` (a frame from before the pools has one set of rows)."""
    if validation is None or not all(c in getattr(validation, "columns", ())
                                     for c in VALIDATION_FIELDS):
        return {}
    rows = validation[validation["phase"] == phase]
    if "pool" in rows.columns:
        rows = rows[rows["pool"] == pool]
    out = {}
    for _, r in rows.iterrows():
        out.setdefault((str(r["quantity"]), str(r["direction"])), r)
    return out


def same_layers_sentence(rows: dict[tuple[str, str], Any], asked: int | None = None) -> str:
    """The test against random sets drawn from the top heads' own layers (``pool``
    "same-layers"): how many heads each shares with the top set, and the outcome (``asked``:
    the ``n_random`` the run asked for, as ``floor_note``)."""
    if not rows:
        return ""
    first = next(iter(rows.values()))
    shared = int(first["overlap"]) if "overlap" in first and first["overlap"] == first[
        "overlap"] else 0
    return validation_sentence(rows, asked)[0].replace(
        "Patched together they", "Against sets drawn from the same layers"
        + (f" (each sharing {shared} heads with the top set, as those layers hold few others)"
           if shared else "") + ", they", 1)


def floor_note(n_random: int, asked: int | None = None) -> str:
    """The smallest p-value ``n_random`` random sets allow, said in words; ``asked``: the
    ``n_random`` the run asked for, when the pool held fewer distinct sets (rerunning with a
    larger ``--n-random`` cannot help then)."""
    floor, all_held = 1 / (n_random + 1), asked is not None and asked > n_random
    text = (f"With {n_random} random sets" + (f" (every distinct set this pool holds; {asked} "
            "were asked)" if all_held else "") + f" no p can be below 1/{n_random + 1} = "
            f"{floor:.2g}")
    if floor > ALPHA and all_held:
        return text + (f", so this test cannot reach p < {ALPHA:g} on this model: a larger "
                       "--n-random cannot help; the test against sets from all layers can.")
    if floor > ALPHA:
        return text + (f", so this test cannot reach p < {ALPHA:g}: rerun with --n-random "
                       f"{math.ceil(1 / ALPHA)} or more.")
    return text + ", the floor: the strongest result this test can give."


def format_p(p: float) -> str:
    """A p-value as every text and chart writes it (two significant figures: 0.12, 0.048)."""
    return f"{p:.2g}"


def _p_phrase(ps: dict[str, float], n_random: int) -> str:
    floor = 1 / (n_random + 1)
    mark = lambda p: ", the floor" if abs(p - floor) < 1e-9 else ""  # noqa: E731
    vals = list(ps.values())
    if len(vals) == 2 and abs(vals[0] - vals[1]) < 1e-12:
        return f"p = {format_p(vals[0])} in both directions{mark(vals[0])}"
    return "; ".join(f"p = {format_p(p)} {d}{mark(p)}" for d, p in ps.items())


def validation_sentence(rows: dict[tuple[str, str], Any], asked: int | None = None
                        ) -> tuple[str, bool | None]:
    """Whether the top set beats the random head sets, per quantity, with its p-values and
    their floor; and a verdict: True (beats on every quantity), False (on none), None (mixed,
    or at a floor above ``ALPHA``: larger than every random set, yet not significant)."""
    quantities = list(dict.fromkeys(q for q, _ in rows))
    if not quantities:
        return "", None
    first = next(iter(rows.values()))
    n_random, k = int(first["n_random"]), int(first["k"])
    floor = 1 / (n_random + 1)
    beats, tops, misses = [], [], []
    for q in quantities:
        ps = {d: float(rows[q, d]["p_value"]) for d in ("noise", "denoise") if (q, d) in rows}
        said = f"{q} ({_p_phrase(ps, n_random)})"
        won = [d for d, p in ps.items() if p <= ALPHA]
        if len(won) == len(ps):
            beats.append(said)
        elif won:
            lost = [d for d in ps if d not in won]
            beats.append(f"{q} when {' and '.join(won)}d, not {' and '.join(lost)}d "
                         f"({_p_phrase(ps, n_random)})")
        elif floor > ALPHA and all(abs(p - floor) < 1e-9 for p in ps.values()):
            tops.append(said)  # larger than every random set: as far as this test can go
        else:
            misses.append(said)
    sets = f"{n_random} random {k}-head sets"
    out = []
    if beats:
        out.append(f"beat {sets} on {' and '.join(beats)}")
    if tops:
        out.append(f"{'' if not beats else 'and '}have a larger effect than all {sets} on "
                   f"{' and '.join(tops)}, which is not significant")
    if misses:
        out.append(("not on " if beats or tops else f"do not beat {sets}: ")
                   + f"{' and '.join(misses)}, above {ALPHA:g}")
    verdict = True if beats and not (tops or misses) else False if misses and not (
        beats or tops) else None
    return f"Patched together they {', '.join(out)}. {floor_note(n_random, asked)}", verdict


def effect_sentence(rows: dict[tuple[str, str], Any]) -> str:
    """The key measured effect: the behaviour measure (Reasoning Focus / Near-Miss Confusion,
    else the first quantity) when the top heads are noised, and when denoised, against the
    random sets' mean effect."""
    quantities = list(dict.fromkeys(q for q, _ in rows))
    if not quantities:
        return ""
    q = next((q for q in quantities if q in BEHAVIOUR), quantities[0])
    parts = []
    for d in ("noise", "denoise"):
        if (q, d) not in rows:
            continue
        r = rows[q, d]
        share = float(r["normalized"])
        effect = f"{_signed(r['top_effect'])} [{_g(r['top_low'])}, {_g(r['top_high'])}]"
        if d == "noise":
            text = (f"noising them (corrupt activations into clean runs) moves {q} from "
                    f"{_g(r['clean'])} by {effect}")
            if math.isfinite(share) and share < 0:
                text += f", {_pct(share)} of the way to the corrupt run's {_g(r['corrupt'])}"
        else:
            text = f"denoising them (clean into corrupt runs) moves it by {effect}"
            if math.isfinite(share) and share > 0:
                text += f", restoring {_pct(share)} of the clean-corrupt gap"
        parts.append(text + f" (random sets: {_signed(r['random_mean'])} on average)")
    if not parts:
        return ""
    name = f" on {BEHAVIOUR[q]}" if q in BEHAVIOUR else ""
    return f"Key effect{name}: " + "; ".join(parts) + "."


PHASE_NAME = re.compile(r"(?:^|[-_])p(?:hase)?-?(?P<phase>[12])(?:$|[-_])")


def phase_of(name: str, result: Any) -> int | None:
    """The phase a result records (``meta["phase"]``), else one its name says (``p1-...``)."""
    phase = (result.meta or {}).get("phase")
    if phase is not None:
        return int(phase)
    m = PHASE_NAME.search(name)
    return int(m.group("phase")) if m else None


def _head_sweeps(results: dict[str, Any] | None, phase: int) -> dict[str, Any]:
    """``{direction: PatchResult}`` of this phase's head sweeps (layer x head)."""
    out = {}
    for name, res in (results or {}).items():
        if tuple(getattr(res, "axes", ())) == ("layer", "head") and phase_of(name, res) == phase:
            out.setdefault(res.direction, res)
    return out


def _normalized(res: Any):
    """``res.normalized()`` and its interval as numpy (NaN where undefined), quietly: the
    report and the sweep itself say why when they are undefined."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        norm = res.normalized().float().numpy()
        ci = res.confidence_interval()
    return norm, (None if ci is None else (ci[0].numpy(), ci[1].numpy()))


def _share(x: float) -> str:
    return f"{x:.0%}" if x >= 0 else f"\u2212{-x:.0%}"


def strongest_cell(sweeps: dict[str, Any]) -> tuple[tuple[int, int], dict[str, str]] | None:
    """The head with the largest ``|normalized|`` summed over the directions given, and per
    direction a phrase of its share of the clean-corrupt gap (restored by denoise, removed by
    noise) with its 95% interval. Where the corruption did not lower the metric (normalized
    values are then no shares of it), the largest ``|effect|`` and its raw change instead."""
    import numpy as np

    if not sweeps:
        return None
    shares = all(r.clean > r.corrupt and not getattr(r, "degenerate", False)
                 for r in sweeps.values())
    if shares:
        cells = {d: _normalized(r) for d, r in sweeps.items()}
    else:
        cells = {d: (r.effect().float().numpy(), None) for d, r in sweeps.items()}
    total = sum(np.nan_to_num(np.abs(n)) for n, _ in cells.values())
    if not np.isfinite(total).all() or float(np.max(total)) == 0.0:
        return None
    layer, head = np.unravel_index(int(np.argmax(total)), total.shape)
    said = {}
    for d, (n, ci) in cells.items():
        v = float(n[layer, head])
        if not math.isfinite(v):
            continue
        if not shares:
            said[d] = f"{d} changes the metric by {_signed(v)}"
            continue
        sign = 1.0 if d == "denoise" else -1.0  # a share restored, or removed
        text = f"{d} {'restores' if d == 'denoise' else 'removes'} {_share(sign * v)}"
        if ci is not None:
            lo, hi = sorted((sign * float(ci[0][layer, head]), sign * float(ci[1][layer, head])))
            text += f" [{_share(lo)}, {_share(hi)}]"
        said[d] = text
    return (int(layer), int(head)), said


def sweep_sentences(phase: int, sweeps: dict[str, Any], top: list[tuple[int, int]],
                    scores: Any, k: int) -> list[str]:
    """The strongest patching cell of the phase; when it is not among the ``top`` heads of the
    score ranking, why (the ranking is by a score, not by patching)."""
    found = strongest_cell(sweeps)
    if found is None:
        return []
    cell, said = found
    name = hooks.head_name(*cell)
    any_res = next(iter(sweeps.values()))
    metric = (any_res.meta or {}).get("metric") or "the metric"
    said = list(said.values())
    if "%" in said[0]:
        said[0] += f" of the clean-corrupt difference in {metric}"
    else:
        said.append(f"the corruption did not lower {metric}, so no share of it is given")
    out = [f"Strongest single head in the Phase-{phase} patching sweeps: {name} "
           f"({'; '.join(said)})."]
    if top and cell not in top and scores is not None:
        col, what = RANKED_BY[phase]
        rank_col = f"phase{phase}_rank"
        row = scores[(scores["layer"] == cell[0]) & (scores["head"] == cell[1])]
        rank = ""
        if len(row) and rank_col in scores.columns and row[rank_col].notna().all():
            rank = f"; {name} ranks {int(row[rank_col].iloc[0])} of {len(scores)}"
            if col in scores.columns:
                rank += f" ({col} {_g(row[col].iloc[0])})"
        early = "an early head" if cell[0] < min(layer for layer, _ in top) else "a head"
        out.append(
            f"Why {name}, the strongest Phase-{phase} patching cell, is not among the "
            f"top {k} Phase-{phase} heads: they are ranked by {col} ({what}), not by patching"
            f"{rank}. Patching measures a head's total effect, including what later heads "
            f"read from it, so {early} can move {metric} without scoring high on {col}.")
    return out


def _pct2(x: float) -> str:
    """``patching.results.gap_percent`` with a real minus sign: ``0.40%``, ``\u221212.5%``."""
    from circuitkit.patching.results import gap_percent

    return gap_percent(float(x)).replace("-", "\u2212")


def edge_finding(edges: Any = None, circuit: dict[str, Any] | None = None) -> Finding | None:
    """What ``characterize --edges`` found, in words: how many edges between which heads,
    their share of the whole clean-corrupt gap (``circuit["share"]``, ``(all kept - all
    ablated) / (clean - corrupt)``) read as small when it is below ``SMALL_SHARE``, the
    strongest single edge (``edges``: an ``EdgeResult``) and the circuit within them."""
    if edges is None and circuit is None:
        return None
    meta = (getattr(edges, "meta", None) or {}) if edges is not None else {}
    frm, to = meta.get("senders_from"), meta.get("receivers_from")
    title = "Edges" + (f" ({frm} heads into {to} heads)".replace("phase", "Phase-")
                       if frm and to else "")
    parts, notes = [], []
    if edges is not None:
        n = int(edges.edge_mask().sum())
        metric = meta.get("metric") or "the metric"
        parts.append(f"{n} edges from {len(edges.senders)} sender heads into "
                     f"{len(edges.receivers)} receiver heads' {'/'.join(edges.inputs)} inputs, "
                     f"on {metric}.")
    # the one degenerate-baseline rule: no shares of effects on a behaviour the corruption
    # does not remove (the coverage numbers stay in the files, NaN where their whole is noise)
    said_share = edges is None or not edges.degenerate
    cov = (meta.get("coverage") or {}) if said_share else {}
    if cov.get("overall") is not None and cov["overall"] == cov["overall"]:
        parts.append(f"Summed, these edges explain {_pct2(cov['overall'])} of their senders' own "
                     "effect (each sender patched alone, the same direction and metric).")
    routes = {g: v for g, v in (meta.get("path_coverage") or {}).items() if v == v} \
        if said_share else {}
    if routes.get("all") is not None:
        staged = ", ".join(f"{_pct2(v)} at the {g} positions" for g, v in routes.items()
                           if g != "all")
        parts.append(f"Through everything between them (MLPs, other heads, other positions: "
                     f"paths), the same senders reach the same receivers with "
                     f"{_pct2(routes['all'])} of their own effect"
                     + (f"; restricted to one stage, {staged}." if staged else "."))
    share = (circuit or {}).get("share")
    if circuit is not None and circuit.get("degenerate"):
        parts.append(f"No share of the behaviour can be given: {circuit['degenerate']}")
    elif share is not None:
        band = circuit.get("share_ci")
        iv = f" [{_pct2(band[0])}, {_pct2(band[1])}]" if band else ""
        parts.append(f"Ablating all {circuit['n_items']} together in the clean run "
                     f"({circuit['ablation']} ablation) removes {_pct2(share)}{iv} of the "
                     "clean\u2212corrupt gap.")
        if abs(share) < SMALL_SHARE:
            parts.append("That is a small share: these direct head-to-head edges carry little "
                         "of the behaviour by themselves. It does not say that the phases do "
                         "not communicate: paths through MLPs, other heads and the residual "
                         "stream into the logits are not among these edges.")
    if edges is not None and int(edges.edge_mask().sum()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            top = edges.top(1).iloc[0]
        # say the direction: the edges' own values are one patch alone (denoise: into the
        # corrupt run; noise: into the clean run), not the ablation the share above measures
        into = "the clean run (noise)" if edges.direction == "noise" else \
            "the corrupt run (denoise)"
        what = ("changes the metric by " + _signed(top[edges.value_column])) \
            if edges.degenerate else (f"{'removes' if edges.direction == 'noise' else 'restores'}"
                                      f" {_pct2(abs(float(top.normalized)))} of the gap")
        notes.append(f"Strongest single edge: {top.sender} \u2192 {top.receiver} "
                     f"({top.input}), which patched alone into {into} {what}; the edges are "
                     f"ranked by these {edges.direction} values.")
    if circuit is not None and not circuit.get("degenerate"):
        of = f" of these edges' {_pct2(share)}" if share is not None else ""
        text = (f"Within them, the top {circuit['n_kept']} of {circuit['n_items']} edges reach "
                f"faithfulness {_g(circuit['faithfulness'])}{of} (CPR {_g(circuit['cpr'])}, "
                f"CMD {_g(circuit['cmd'])})")
        if not circuit.get("target_reached", True):
            text += f"; no circuit of the curve reaches the target {_g(circuit['target'])}"
        notes.append(text + ".")
    if not parts:
        parts, notes = notes[:1], notes[1:]
    return Finding("edges", title, " ".join(parts), notes)


def findings(summary: dict | None = None, validation: Any = None, scores: Any = None,
             results: dict[str, Any] | None = None, edges: Any = None,
             circuit: dict[str, Any] | None = None, head_ablation: Any = None
             ) -> list[Finding]:
    """One ``Finding`` per phase the data speaks of, and one for the edges (``edges``: an
    ``EdgeResult``; ``circuit``: its ``circuit.json``, ``edge_finding``) (module
    docstring). Each phase's finding carries what weakens it: an unstable ranking
    (``stability_caveat``), a small validation sample (``sample_caveat``), the ablation's
    verdict (``ablation_sentence``, ``head_ablation``: ``ck.ablate_heads``' frame) and a
    correction for the several p-values it reports (``multiple_tests_note``)."""
    from circuitkit.scoring.heads import scored_phases, top_heads

    summary = summary or {}
    phases = [int(p) for p in summary.get("phases") or []]
    if validation is not None and "phase" in getattr(validation, "columns", ()):
        phases += [int(p) for p in validation["phase"].dropna().unique()]
    if scores is not None:
        phases += scored_phases(scores)
    phases += [p for p in (1, 2) if _head_sweeps(results, p)]
    # the causal picture leads (where, stable heads, the paper's scores, the claims table);
    # the descriptive ranks follow
    out = lead_findings(summary) + causal_finding(summary)
    for phase in sorted(set(phases)):
        rows = _rows(validation, phase)
        first = next(iter(rows.values()), None)
        k = int(first["k"]) if first is not None else int(
            (summary.get("validation_options") or {}).get("k", 5))
        top = hooks.heads_in(first["heads"]) if first is not None and "heads" in first else []
        if not top and scores is not None and phase in scored_phases(scores):
            top = top_heads(scores, phase, k)
        col = RANKED_BY[phase][0]
        parts = [f"The top {len(top)} heads by {col} are {_heads_phrase(top)}."] if top else []
        parts += [c for c in (stability_caveat(summary, phase),) if c]  # (beside the heads)
        said, _ = validation_sentence(rows)
        if said:
            parts.append(said)
        parts += [c for c in (sample_caveat(rows),) if c]
        effect = effect_sentence(rows)
        asked = (summary.get("validation_options") or {}).get("n_random")
        same_rows = _rows(validation, phase, "same-layers")
        same = same_layers_sentence(same_rows, int(asked) if asked is not None else None)
        ablated = ablation_sentence(head_ablation, phase)
        notes = ([effect] if effect else []) + ([same] if same else []) + (
            [ablated] if ablated else []) + [c for c in (multiple_tests_note(
                phase, rows, same_rows, head_ablation),) if c] + sweep_sentences(
            phase, _head_sweeps(results, phase), top, scores, len(top) or k)
        if not parts and not notes:
            continue
        if not parts:  # sweeps only (a patch folder): the strongest cell leads
            parts.append(notes.pop(0))
        out.append(Finding(phase, PHASE_NAMES[phase], " ".join(parts), notes, top))
    said = edge_finding(edges, circuit)
    return out + ([said] if said is not None else []) + skipped_finding(summary)


def lead_findings(summary: dict) -> list[Finding]:
    """``summary["lead"]`` and ``summary["claims"]`` (``characterize``'s stage sweeps;
    ``experiments.claims``) as one ``Finding`` per phase titled "Phase p: where the decision is
    made" (``claims.lead_sentences``) and one titled "The paper's claims" (one line per claim:
    reproduced / refuted / undecided / not testable here, numbers, n, power); [] without them."""
    from circuitkit.experiments.claims import claim_lines, lead_sentences

    picture = summary.get("lead")
    out = []
    if isinstance(picture, dict):
        for p, lines in lead_sentences(picture).items():
            out.append(Finding(f"lead{p}", f"Phase {p}: where the decision is made", lines[0],
                               lines[1:]))
    rows = summary.get("claims")
    if isinstance(rows, list) and rows:
        lines = claim_lines(rows)
        out.append(Finding("claims", "The paper's claims, checked in this run", lines[0],
                           lines[1:]))
    return out


# a validation on fewer examples than this is said to be small, with what its p-values can say
SMALL_SAMPLE = 32


def stability_caveat(summary: dict, phase: int) -> str:
    """``summary["stability"]``'s verdict on this phase's top set, in the finding itself: the
    top heads in fewer than ``STABLE_MIN`` of the bootstrap resamples of the examples."""
    st = (summary.get("stability") or {}).get(f"phase{phase}") or {}
    unstable = [h for h in st.get("unstable") or [] if isinstance(h, list | tuple)]
    if not unstable:
        return ""
    names = [hooks.head_name(int(la), int(h)) for la, h in unstable]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    k = st.get("k", len(st.get("top") or []))
    return (f"Caveat: the ranking is not stable: {listed} {'is' if len(names) == 1 else 'are'} "
            f"in the top {k} in fewer than 80% of the bootstrap resamples of the examples, so "
            f"another sample of examples would likely name other top-{k} heads.")


def sample_caveat(rows: dict[tuple[str, str], Any]) -> str:
    """A validation on fewer than ``SMALL_SAMPLE`` examples: their number, and what its
    p-values can and cannot say (the floor is set by the random sets, not by the examples)."""
    first = next(iter(rows.values()), None)
    if first is None or "n_prompts" not in first or first["n_prompts"] != first["n_prompts"]:
        return ""
    n, n_random = int(first["n_prompts"]), int(first["n_random"])
    if n >= SMALL_SAMPLE:
        return ""
    return (f"Caveat: validated on {n} example{'s' if n != 1 else ''} only: the p-values "
            f"compare head sets on these {n} (their floor, 1/{n_random + 1} = "
            f"{format_p(1 / (n_random + 1))}, is set by the number of random sets, not by the "
            "examples) and say nothing of other examples; the effect's interval says how much "
            f"{n} examples pin down. Run with more examples (-n) before relying on it.")


def _ablation_rows(frame: Any, phase: int) -> Any:
    """This phase's rows of ``ablate_heads``' frame against the all-layers pool (else every
    pool's), or None."""
    need = ("phase", "ablation", "quantity", "top_effect", "p_value", "k", "n_random")
    if frame is None or not all(c in getattr(frame, "columns", ()) for c in need):
        return None
    rows = frame[frame["phase"] == phase]
    if "pool" in rows.columns and (rows["pool"] == "all-layers").any():
        rows = rows[rows["pool"] == "all-layers"]
    return rows if len(rows) else None


def ablation_sentence(frame: Any, phase: int) -> str:
    """The head ablation's verdict in one sentence: what ablating the top set (zero, mean,
    resample) does to each quantity, and in how many of the tests it goes beyond random sets
    of as many heads (p <= ``ALPHA``)."""
    rows = _ablation_rows(frame, phase)
    if rows is None:
        return ""
    kinds = list(dict.fromkeys(str(a) for a in rows["ablation"]))
    effects = []
    for q in dict.fromkeys(str(x) for x in rows["quantity"]):
        vals = [float(v) for v in rows[rows["quantity"] == q]["top_effect"] if v == v]
        if vals:
            lo, hi = min(vals), max(vals)
            effects.append(f"{q} by {_signed(lo)}" if abs(hi - lo) < 1e-12 else
                           f"{q} by {_signed(lo)} to {_signed(hi)}")
    ps = [float(p) for p in rows["p_value"] if p == p]
    beyond = sum(p <= ALPHA for p in ps)
    k, n_random = int(rows["k"].iloc[0]), int(rows["n_random"].iloc[0])
    verdict = ("beyond random sets in every test" if ps and beyond == len(ps) else
               "no more than random sets do in any test" if not beyond else
               f"beyond random sets in {beyond} of {len(ps)} tests")
    return (f"Ablation verdict: ablating the top {k} ({', '.join(kinds)}) changes "
            f"{'; '.join(effects)}: {verdict} (p <= {ALPHA:g} against {n_random} random "
            f"{k}-head sets per test; floor {format_p(1 / (n_random + 1))}).")


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjustment of ``ps`` (in their order): each p times the number of
    hypotheses not yet rejected, made monotone, capped at 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [1.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def multiple_tests_note(phase: int, rows: dict, same_rows: dict, head_ablation: Any) -> str:
    """Several p-values reported for one phase (validation in both pools, the ablation):
    how many stay at or below ``ALPHA`` once corrected for their number (Holm), and the
    smallest corrected p (what ``n_random`` sets allow: floor x tests)."""
    ps = [float(r["p_value"]) for r in (*rows.values(), *same_rows.values())
          if r["p_value"] == r["p_value"]]
    abl = _ablation_rows(head_ablation, phase)
    if abl is not None:
        ps += [float(p) for p in abl["p_value"] if p == p]
    if len(ps) < 2:
        return ""
    adjusted = holm(ps)
    raw, kept = sum(p <= ALPHA for p in ps), sum(p <= ALPHA for p in adjusted)
    more = ("; more random sets (--n-random, --n-random-ablation) lower the floor each "
            "corrected p starts from" if raw and not kept else "")
    return (f"Multiple comparisons: this phase reports {len(ps)} p-values; {raw} are at or "
            f"below {ALPHA:g} as they stand, {kept} after Holm's correction for {len(ps)} "
            f"tests (smallest corrected p {format_p(min(adjusted))}){more}.")


def causal_finding(summary: dict) -> list[Finding]:
    """``summary["phase_table"]`` (``characterize --stages``: each head patched at each position
    group) as one ``Finding`` titled "Where each decision is made": ``causal.phase_sentences``,
    the samples selection and validation used (``summary["samples"]``); [] without a table."""
    table = summary.get("phase_table")
    if not isinstance(table, dict):
        return []
    from circuitkit.scoring.causal import phase_sentences

    lines = phase_sentences(table)
    if not lines:
        return []
    lines += causal_validation_lines(summary)
    samples = summary.get("samples") or {}
    if samples.get("held_out"):
        sel, val = samples["select"], samples["validate"]
        lines.append(f"Heads were selected on examples {sel['examples'][0]}-"
                     f"{sel['examples'][1] - 1} ({sel['n']}, hash {sel['hash']}) and validated "
                     f"on the disjoint {val['examples'][0]}-{val['examples'][1] - 1} ({val['n']}, "
                     f"hash {val['hash']}).")
    return [Finding("causal", "Where each decision is made (each head patched at each position "
                    "group)", lines[0], lines[1:])]


def causal_validation_lines(summary: dict) -> list[str]:
    """One sentence per phase of ``summary["causal_validation"]`` (the causal top set patched
    together on the validation notes, against random sets, p with its Monte Carlo interval)."""
    out = []
    for key, got in sorted((summary.get("causal_validation") or {}).items()):
        pools = "; ".join(f"against {v['n_random']} {pool} random sets p = {format_p(v['p'])} "
                          f"[{format_p(v['p_low'])}, {format_p(v['p_high'])}]"
                          for pool, v in got["pools"].items())
        norm = got.get("normalized")
        if norm is None or norm != norm:  # the one degenerate-baseline rule: no share
            moved = (f"by {_signed(got['effect'])} (raw; no share of the gap: the corruption "
                     f"does not lower {got['quantity']} by its margin)"
                     if got.get("effect") is not None else
                     "by no share of the gap (the corruption does not lower it by its margin)")
        else:
            moved = f"by {_pct2(norm)} of the gap"
        out.append(f"{key.replace('phase', 'Phase ')}'s causal top set ({got['heads']}) "
                   f"noised together on the {got['n_prompts']} validation examples moves "
                   f"{got['quantity']} {moved}; {pools}.")
    return out


def skipped_finding(summary: dict) -> list[Finding]:
    """``summary["skipped"]`` (what ``characterize`` left out and why, one line each, e.g. the
    resample ablation of a one-prompt run) as one ``Finding`` titled "Not run"; [] if none."""
    lines = summary.get("skipped")
    lines = [str(x) for x in lines if x] if isinstance(lines, list) else []
    if not lines:
        return []
    return [Finding("skipped", "Not run", " ".join(x[:1].upper() + x[1:] for x in lines))]


def run_line(summary: dict | None) -> str:
    """"icd-teacher on icd10: 128 test examples, seed 0, exact patching; heads selected on
    examples 0-63, validated on the held-out 64-127" from ``summary.json`` (or "")."""
    summary = summary or {}
    ident = {**summary, **(summary.get("identity") or {})}
    model, task = summary.get("model") or ident.get("model_name"), ident.get("task")
    if not model and not task:
        return ""
    n, split, seed = ident.get("n_examples"), ident.get("split"), ident.get("seed")
    bits = [f"{n} {split + ' ' if split else ''}example{'s' if n != 1 else ''}" if n else None,
            f"seed {seed}" if seed is not None else None,
            f"{ident['patch_method']} patching" if ident.get("patch_method") else None]
    said = ", ".join(b for b in bits if b)
    samples = summary.get("samples") or {}
    if samples.get("held_out"):
        sel, val = samples["select"]["examples"], samples["validate"]["examples"]
        said += (f"; heads selected on examples {sel[0]}-{sel[1] - 1}, validated on the "
                 f"held-out {val[0]}-{val[1] - 1}")
        left = samples["validate"].get("left_out") or []
        if left:  # examples that repeat a selection example are not held out
            said += (f" less {len(left)} that repeat selection examples "
                     f"({samples['validate'].get('n')} validated)")
    elif samples:
        said += "; heads selected and validated on the same examples"
    return f"{model or 'a model'} on {task or 'a task'}" + (f": {said}" if said else "")


def format_findings(found: list[Finding], line: str = "", width: int = 88) -> str:
    """The findings as console text, wrapped at ``width`` columns: one paragraph per phase,
    its notes indented under it."""
    import textwrap

    out = [f"findings ({line}):" if line else "findings:"]
    for f in found:
        out.append(textwrap.fill(f"{f.title}. {f.headline}", width))
        out += [textwrap.fill(n, width, initial_indent="  - ", subsequent_indent="    ")
                for n in f.notes]
    if not found:
        out.append("nothing to summarise (no sweeps, scores or validation)")
    return "\n".join(out)
