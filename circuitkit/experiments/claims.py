"""The causal picture ``characterize`` leads with, and the paper's claims checked against it.

``decision_picture(sweeps, held, scores, k, note_edited)`` reads the stage sweeps (``[layer,
head, group]`` ``PatchResult``s per ``(phase, direction)``: ``sweeps`` on the selection notes,
``held`` on the held-out notes, or None) and returns per phase:

* ``where``: per (layer, position group) the summed single-head share of the phase's gap
  (``stability.share_interval`` of the layer's heads' summed helpful values; additive, not a
  joint patch), the cells chosen on the selection notes (the largest, and every one >=
  ``causal.GROUP_SHARE``) and their shares on the held-out notes with 95% intervals;
* ``heads``: the causal top ``k`` (group "all", selection notes) with bootstrap inclusion per
  head and its ``stability.stable_core``; the depth ("early"/"mid"/"late") shares, held out;
* ``precision``: precision@k of the paper's descriptive score (``coarse_score`` for Phase 1,
  ``refine_score`` for Phase 2: ``heads.top_heads``) against the causal top ``k``, beside the
  precision a random ``k``-set has on average (``k / n_heads``);
* ``note_edited``: whether the phase's corruption changes any note (evidence) token.

``claims(picture, validation, causal_validation, summary)``: one row per claim of the paper
(``CLAIMS``) with ``verdict`` in ``VERDICTS``, ``evidence`` (numbers with intervals), ``n``
(prompts) and ``power`` (the smallest effect the test finds with 80% power, or the p-value floor
of its null). ``lead_sentences`` / ``claim_lines``: the same in words.
"""

from __future__ import annotations

from typing import Any

from circuitkit.experiments.stability import (
    bootstrap_inclusion,
    core_phrase,
    gaps,
    helpful,
    layer_of_depth,
    power_share,
    share_interval,
    stable_core,
    top_units,
)
from circuitkit.scoring.causal import ALL, GROUP_SHARE

VERDICTS = ("reproduced", "refuted", "undecided", "not testable here")
DESCRIPTIVE = {1: "coarse_score", 2: "refine_score"}
CLAIMS = {
    "early-phase1": "Phase 1 (choosing the category) is made by early heads",
    "late-phase2": "Phase 2 (rejecting siblings) is made by mid/late heads re-reading the "
                   "shortlist at the answer",
    "separate-heads": "Separate heads carry the two phases",
    "restore-degrade": "Patching the paper's top heads restores the behaviour when denoised and "
                       "degrades it when noised (beyond any k heads of the same layers)",
    "distill": "Mechanistic distillation beats CoT distillation",
}
CONFOUND = ("the corruption edits the note, so the first layer that routes note evidence "
            "carries the gap whatever chooses the category or rejects the siblings (an "
            "evidence-routing confound); a corruption that keeps the note token-identical "
            "(task option corruption=) can test it")
ALPHA = 0.05


def note_edited(task: Any) -> bool:
    """Whether ``task``'s corrupt run changes any note token: clean and corrupt tokens differ at
    an ``evidence`` position (``position_groups("tokens")``)."""
    groups = task.position_groups(at="tokens")
    if "evidence" not in groups:
        return False
    mask = groups["evidence"]
    return bool(((task.clean_tokens != task.corrupt_tokens) & mask).any())


def _r(x: Any) -> float:
    return round(float(x), 4)


def _heads_share(h: Any, gap: Any, pick: Any, seed: int) -> dict[str, float]:
    """The summed share of the units ``pick`` (bool over the flattened units) with its interval."""
    s, lo, hi = share_interval(h[:, pick].sum(1, keepdim=True), gap, seed=seed)
    return dict(share=_r(s[0]), low=_r(lo[0]), high=_r(hi[0]))


def decision_picture(sweeps: dict[tuple[int, str], Any], held: dict[tuple[int, str], Any] | None,
                     scores: Any, k: int, edited: dict[int, bool] | None = None,
                     direction: str = "noise", seed: int = 0) -> dict[str, Any]:
    """Module docstring. ``sweeps`` / ``held``: ``{(phase, direction): PatchResult}`` with axes
    ``layer, head, group`` and per-prompt values; ``held`` None: the selection notes stand in
    (``held_out`` False in the result)."""
    import torch

    from circuitkit.hooks import head_name

    out: dict[str, Any] = dict(direction=direction, k=int(k), share=GROUP_SHARE,
                               held_out=held is not None)
    for p in sorted({p for p, _ in sweeps}):
        d = direction if (p, direction) in sweeps else next(dd for pp, dd in sweeps if pp == p)
        sel, ho = sweeps[(p, d)], (held or sweeps).get((p, d))
        hs, ht = helpful(sel), helpful(ho) if ho is not None else None
        if hs is None or ht is None:
            continue
        L, H, G = sel.values.shape
        names = list(sel.meta["group_names"])
        g_all = names.index(ALL) if ALL in names else G - 1
        stages = [i for i, g in enumerate(names) if g != ALL]
        gs, gt = gaps(sel), gaps(ho)
        # where: per (layer, group) the layer's heads summed, chosen on selection, held-out CI
        per_layer_s = hs.sum(2) / gs.mean()  # [n, L, G] / scalar -> mean over n is the share
        sel_map = per_layer_s.mean(0)  # [L, G]
        lay = ht.sum(2).reshape(ht.shape[0], L * G)
        sh, lo, hi = share_interval(lay, gt, seed=seed)
        sh, lo, hi = (t.reshape(L, G) for t in (sh, lo, hi))
        cells = sorted(((float(sel_map[la, g]), la, g) for la in range(L) for g in stages),
                       reverse=True)
        chosen = [c for c in cells if c[0] >= GROUP_SHARE] or cells[:1]
        where = dict(groups=[names[g] for g in stages], layers=list(range(L)),
                     share=[[_r(sh[la, g]) for g in stages] for la in range(L)],
                     low=[[_r(lo[la, g]) for g in stages] for la in range(L)],
                     high=[[_r(hi[la, g]) for g in stages] for la in range(L)],
                     chosen=[dict(layer=la, group=names[g], selection=_r(v), share=_r(sh[la, g]),
                                  low=_r(lo[la, g]), high=_r(hi[la, g])) for v, la, g in chosen],
                     n_select=int(hs.shape[0]), n_held=int(ht.shape[0]))
        # heads: causal top k at "all", bootstrap inclusion on the selection notes
        flat_s = hs[..., g_all].reshape(hs.shape[0], L * H)
        top = top_units(flat_s, k)
        inc = bootstrap_inclusion(flat_s, k, seed=seed)
        hnames = [head_name(la, h) for la in range(L) for h in range(H)]
        core = stable_core(hnames, inc.tolist(), top)
        flat_t = ht[..., g_all].reshape(ht.shape[0], L * H)
        depth = {}
        for part in ("early", "mid", "late"):
            pick = torch.tensor([layer_of_depth(u // H, L) == part for u in range(L * H)])
            if bool(pick.any()):
                depth[part] = _heads_share(flat_t, gt, pick, seed)
        at_answer = None
        if "answer" in names:
            a = names.index("answer")
            pick = torch.tensor([layer_of_depth(u // H, L) != "early" for u in range(L * H)])
            if bool(pick.any()):
                at_answer = _heads_share(ht[..., a].reshape(ht.shape[0], L * H), gt, pick, seed)
        top_set = torch.zeros(L * H, dtype=torch.bool)
        top_set[top] = True
        heads = dict(top=[hnames[u] for u in top], core=core,
                     top_share=_heads_share(flat_t, gt, top_set, seed))
        prec = None
        if scores is not None and DESCRIPTIVE[p] in getattr(scores, "columns", ()):
            from circuitkit.scoring.heads import top_heads

            try:
                desc = [head_name(*h) for h in top_heads(scores, p, k)]
            except ValueError:
                desc = []
            if desc:
                hit = [x for x in desc if x in heads["top"]]
                prec = dict(score=DESCRIPTIVE[p], top=desc, hits=hit,
                            precision=_r(len(hit) / int(k)), chance=_r(int(k) / (L * H)))
                inc_col = f"phase{p}_inclusion"  # (score_heads' bootstrap over the notes)
                if inc_col in scores.columns and scores[inc_col].notna().all():
                    by = {head_name(int(r.layer), int(r.head)): float(getattr(r, inc_col))
                          for r in scores.itertuples()}
                    prec["core"] = stable_core(hnames, [by.get(x, 0.0) for x in hnames],
                                               [hnames.index(x) for x in desc])
        out[f"phase{p}"] = dict(direction=d, metric=(sel.meta or {}).get("metric"),
                                degenerate=bool(sel.degenerate or ho.degenerate),
                                gap=_r(sel.gap), gap_held=_r(ho.gap), where=where, heads=heads,
                                depth=depth, mid_late_at_answer=at_answer, precision=prec,
                                note_edited=None if edited is None else edited.get(p),
                                n_layers=L, n_heads=H, _helpful=flat_t, _gap=gt)
    # each phase's top heads' share of the other phase's gap (held out): shared machinery?
    if "phase1" in out and "phase2" in out:
        for a, b in ((1, 2), (2, 1)):
            pa, pb = out[f"phase{a}"], out[f"phase{b}"]
            H = pb["n_heads"]
            pick = torch.zeros(pb["_helpful"].shape[1], dtype=torch.bool)
            for name in pa["heads"]["top"]:
                la, h = (int(x) for x in name[1:].split("H"))
                pick[la * H + h] = True
            pb[f"by_phase{a}_heads"] = _heads_share(pb["_helpful"], pb["_gap"], pick, seed)
    for p in (1, 2):
        if f"phase{p}" in out:
            out[f"phase{p}"].pop("_helpful")
            out[f"phase{p}"].pop("_gap")
    return out


def _removed(no: dict) -> str:
    """The share of the gap a noised set removes (``-share``) with its interval; "no share" when
    the degenerate-baseline rule left it undefined (``None``/NaN: the corruption does not lower
    the metric beyond noise on these notes)."""
    vals = [no.get(k) for k in ("share", "low", "high")]
    if any(v is None or v != v for v in vals):
        return "no share (a degenerate baseline)"
    return _iv(dict(share=-vals[0], low=-vals[2], high=-vals[1]))


def _iv(d: dict[str, float] | None) -> str:
    if not d:
        return "n/a"
    return f"{_pc(d['share'])} [{_pc(d['low'])}, {_pc(d['high'])}]"


def _pc(x: float) -> str:
    return f"{float(x):.0%}".replace("-", "\u2212")


def _fp(p: float) -> str:
    return f"{float(p):.2g}"


def validation_facts(frame: Any, phase: int) -> dict[str, Any] | None:
    """From a ``validate_heads`` frame, the phase's own metric (its first quantity): per
    direction the joint share (``normalized``) with its interval (``top_low/high`` over the
    gap), and per pool ``p`` [MC interval], ``n_random`` and the random sets' mean share (the
    baseline a set must beat: for "layer-stratified", any ``k`` heads of the same layers)."""
    if frame is None or not len(frame) or "pool" not in frame.columns:
        return None
    rows = frame[frame["phase"] == phase]
    if not len(rows):
        return None
    rows = rows[rows["quantity"] == rows["quantity"].iloc[0]]
    out: dict[str, Any] = dict(heads=str(rows["heads"].iloc[0]), quantity=str(
        rows["quantity"].iloc[0]), n=int(rows["n_prompts"].iloc[0]), k=int(rows["k"].iloc[0]))
    for d in ("noise", "denoise"):
        part = rows[rows["direction"] == d]
        if not len(part):
            continue
        r = part.iloc[0]
        gap = float(r["clean"]) - float(r["corrupt"])
        scale = 1 / gap if gap else float("nan")
        lo, hi = sorted((float(r["top_low"]) * scale, float(r["top_high"]) * scale))
        out[d] = dict(share=_r(r["normalized"]), low=_r(lo), high=_r(hi), pools={
            str(q["pool"]): dict(p=_r(q["p_value"]), p_low=_r(q["p_low"]),
                                 p_high=_r(q["p_high"]), n_random=int(q["n_random"]),
                                 random_share=_r(float(q["random_mean"]) * scale))
            for _, q in part.iterrows()})
    return out


def _p_text(v: dict[str, Any], pool: str, what: str) -> str:
    got = v["pools"].get(pool)
    if not got:
        return ""
    if any(got.get(k) is None or got.get(k) != got.get(k) for k in ("p", "p_low", "p_high")):
        return f"no p against {what} (no share of a gap: a degenerate baseline)"
    mean = got.get("random_share")
    mean = "n/a" if mean is None or mean != mean else _pc(mean)
    return (f"p = {_fp(got['p'])} [{_fp(got['p_low'])}, {_fp(got['p_high'])}] against "
            f"{got['n_random']} {what} (their mean {mean})")


def claims(picture: dict[str, Any], validation: Any = None, causal_validation: Any = None,
           summary: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The claims table (module docstring): rows ``claim``, ``statement``, ``verdict``,
    ``evidence``, ``n``, ``power``."""
    summary = summary or {}
    rows = []
    p1, p2 = picture.get("phase1"), picture.get("phase2")

    def row(key: str, verdict: str, evidence: str, n: Any = None, power: str = "") -> None:
        rows.append(dict(claim=key, statement=CLAIMS[key], verdict=verdict, evidence=evidence,
                         n=n, power=power))

    def depth_claim(key: str, ph: dict | None, phase: int, part: dict | None, label: str) -> None:
        if ph is None:
            return row(key, "not testable here", f"the task has no Phase-{phase} steps")
        if ph.get("degenerate"):
            return row(key, "not testable here", f"the Phase-{phase} corruption does not lower "
                       "its metric beyond noise: no share of a gap to locate")
        if ph["n_layers"] < 3:
            return row(key, "not testable here", f"a {ph['n_layers']}-layer model has no early, "
                       "mid and late layers")
        n = ph["where"]["n_held"]
        power = f"finds a share >= {_pc(power_share(part['low'], part['high']))}" if part else ""
        ev = f"{label}: {_iv(part)} of the Phase-{phase} gap (held out, {ph['direction']})"
        if ph.get("note_edited"):
            return row(key, "not testable here", f"{ev}; but {CONFOUND}", n, power)
        if part is None:
            return row(key, "undecided", ev, n, power)
        if part["low"] >= GROUP_SHARE:
            return row(key, "reproduced", ev, n, power)
        if part["high"] < GROUP_SHARE:
            return row(key, "refuted", ev + f" (below {_pc(GROUP_SHARE)})", n, power)
        return row(key, "undecided", ev + f" (the interval spans {_pc(GROUP_SHARE)})", n, power)

    depth_claim("early-phase1", p1, 1, (p1 or {}).get("depth", {}).get("early"),
                "early-layer heads carry")
    depth_claim("late-phase2", p2, 2, (p2 or {}).get("mid_late_at_answer"),
                "mid/late-layer heads at the answer steps carry")
    # separate heads per phase
    if not (p1 and p2):
        row("separate-heads", "not testable here", "the task has steps of one phase only")
    else:
        c1 = {n for n, _ in p1["heads"]["core"]["core"]}
        c2 = {n for n, _ in p2["heads"]["core"]["core"]}
        both = sorted(c1 & c2)
        cross = p2.get("by_phase1_heads")
        ev = (f"stable cores: Phase 1 {core_phrase(p1['heads']['core'])}; Phase 2 "
              f"{core_phrase(p2['heads']['core'])}; shared: {', '.join(both) or 'none'}; "
              f"Phase 1's top heads carry {_iv(cross)} of Phase 2's gap (held out)")
        n = p2["where"]["n_held"]
        power = f"finds a share >= {_pc(power_share(cross['low'], cross['high']))}" if cross \
            else ""
        if p1.get("degenerate") or p2.get("degenerate"):
            row("separate-heads", "not testable here", f"{ev}; but a phase's corruption does "
                "not lower its metric beyond noise", n, power)
        elif p1.get("note_edited") or p2.get("note_edited"):
            row("separate-heads", "not testable here", f"{ev}; but {CONFOUND}", n, power)
        elif both:
            row("separate-heads", "refuted", ev, n, power)
        elif cross and cross["high"] < GROUP_SHARE:
            row("separate-heads", "reproduced", ev, n, power)
        else:
            row("separate-heads", "undecided", ev, n, power)
    # denoising restores / noising degrades: the paper's (descriptive) top heads, validated
    for phase in (1, 2):
        v = validation_facts(validation, phase)
        if v is None or "noise" not in v or "denoise" not in v:
            continue
        no, de = v["noise"], v["denoise"]
        if any(x.get(k) is None or x.get(k) != x.get(k) for x in (no, de)
               for k in ("share", "low", "high")):  # the degenerate-baseline rule: no shares
            rows.append(dict(claim="restore-degrade", statement=CLAIMS["restore-degrade"]
                             + f" (Phase {phase})", verdict="not testable here",
                             evidence=f"Phase {phase}'s corruption does not lower "
                             f"{v['quantity']} beyond noise on these notes: no share of a gap",
                             n=v["n"], power=""))
            continue
        pool = "layer-stratified" if "layer-stratified" in no["pools"] else next(iter(no["pools"]))
        ps = [_p_text(x, pool, "random sets of the same layers" if pool == "layer-stratified"
                      else f"{pool} random sets") for x in (no, de)]
        ev = (f"Phase {phase}'s top {v['k']} by {DESCRIPTIVE[phase]} ({v['heads']}), "
              f"{v['quantity']}: denoised restore {_iv(de)}, {ps[1]}; noised remove "
              f"{_removed(no)}, {ps[0]}")
        restores, degrades = de["low"] > 0, no["high"] < 0
        beyond = all(x["pools"].get(pool, {}).get("p", 1) <= ALPHA for x in (no, de))
        floor = 1 / (no["pools"][pool]["n_random"] + 1)
        power = (f"p floor {_fp(floor)} ({no['pools'][pool]['n_random']} sets); finds a share "
                 f">= {_pc(power_share(de['low'], de['high']))}")
        if restores and degrades and beyond:
            verdict = "reproduced"
        elif de["high"] < 0 or no["low"] > 0:
            verdict = "refuted"
        elif restores and degrades and floor > ALPHA:
            verdict, ev = "not testable here", ev + (f"; the same layers hold too few other "
                                                     f"sets for p < {ALPHA:g}")
        elif restores and degrades:  # (not refuted: these heads are not shown to matter
            # more than their layers do)
            verdict, ev = "undecided", ev + (f"; they restore and degrade, but no more than any "
                                             f"{v['k']} heads of the same layers (p > "
                                             f"{ALPHA:g}): specific to these heads not shown")
        else:
            verdict = "undecided"
        rows.append(dict(claim="restore-degrade", statement=CLAIMS["restore-degrade"]
                         + f" (Phase {phase})", verdict=verdict, evidence=ev, n=v["n"],
                         power=power))
    dist = summary.get("distill")
    if not dist:
        row("distill", "not testable here", "no distillation results in this run "
            "(circuitkit distill writes them)")
    else:
        row("distill", str(dist.get("verdict", "undecided")), str(dist.get("evidence", "")),
            dist.get("n"), str(dist.get("power", "")))
    return rows


def lead_sentences(picture: dict[str, Any]) -> dict[int, list[str]]:
    """Per phase, the lead in words: where the decision is made (held out, intervals), the
    stable heads carrying it (and their joint validation against layer-matched sets), and
    whether the paper's descriptive score finds them. ``picture[f"phase{p}"]["validated"]``:
    ``validation_facts`` of the causal top set's validation (``characterize`` adds it)."""
    out: dict[int, list[str]] = {}
    held = "held out" if picture.get("held_out") else "on the selection notes (none held out)"
    for p in (1, 2):
        ph = picture.get(f"phase{p}")
        if not ph:
            continue
        w = ph["where"]
        cells = "; ".join(f"layer {c['layer']} at the {c['group']} positions carries "
                          f"{_pc(c['share'])} [{_pc(c['low'])}, {_pc(c['high'])}]"
                          for c in w["chosen"])
        lines = [f"{cells[:1].upper()}{cells[1:]} of the gap in {ph['metric']} ({held}: chosen on "
                 f"{w['n_select']} notes, measured on {w['n_held']}; the layer's heads patched "
                 f"one at a time at those positions, {ph['direction']}, shares summed)."]
        if ph.get("degenerate"):
            lines.append("Caution: the corruption does not lower the metric beyond noise on "
                         "these notes (a degenerate baseline): the shares above are no shares of "
                         "a behaviour.")
        if ph.get("note_edited"):
            lines.append(f"Caution: {CONFOUND}.")
        hd = ph["heads"]
        lines.append(f"Heads: the causal top {picture['k']} are {', '.join(hd['top'])}; stable "
                     f"over note resamples: {core_phrase(hd['core'])} (bootstrap inclusion in "
                     f"the top {picture['k']}); together, one at a time, they carry "
                     f"{_iv(hd['top_share'])} held out.")
        v = ph.get("validated")  # (validation_facts of the causal top set, held out)
        if v and "noise" in v:
            no = v["noise"]
            pool = "layer-stratified"
            said = _p_text(no, pool, "random sets of the same layers")
            other = _p_text(no, "all-layers", "all-layer random sets")
            lines.append(f"Patched together (noise) on the {v['n']} held-out notes they remove "
                         f"{_removed(no)}; "
                         + "; ".join(x for x in (said, other) if x) + ".")
        pr = ph.get("precision")
        if pr:
            top = (f"its top, stable over note resamples: {core_phrase(pr['core'])}"
                   if pr.get("core") else f"its top: {', '.join(pr['top'])}")
            lines.append(f"The paper's {pr['score']} finds {len(pr['hits'])} of them: "
                         f"precision@{picture['k']} = {pr['precision']:.2f} (a random "
                         f"{picture['k']}-set: {pr['chance']:.2f} on average; {top}).")
        b = ph.get("bins")
        if b:
            lines.append(bins_sentence(b, p))
        out[p] = lines
    return out


def claim_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The claims table as one line per claim."""
    return [f"{r['statement']}: {r['verdict'].upper()}. {r['evidence']}"
            + (f" (n = {r['n']}" + (f"; power: {r['power']}" if r['power'] else "") + ")"
               if r.get("n") else "") + "." for r in rows]


def bins_facts(summary: Any, phase: int, site: str = "pattern") -> list[dict[str, Any]] | None:
    """``experiments.bins.bin_summary`` rows of ``phase`` at ``site`` as plain dicts (both
    directions, bins ascending), for ``bins_sentence``; None without rows."""
    if summary is None or not len(summary):
        return None
    part = summary[(summary["phase"] == phase) & (summary["site"] == site)]
    if not len(part):
        return None
    return [dict(direction=str(r.direction), bin=int(r.bin), top=_r(r.top), lowest=_r(r.lowest),
                 random_mean=_r(r.random_mean), random_low=_r(r.random_low),
                 random_high=_r(r.random_high), n_random=int(r.n_random), site=site)
            for r in part.sort_values(["direction", "bin"]).itertuples()]


def bins_sentence(rows: list[dict[str, Any]], phase: int) -> str:
    """The paper's cumulative-bin experiment in words: per direction the top bins' shares
    beside the lowest-ranked and random heads of equal count."""
    parts = []
    for d in ("denoise", "noise"):
        mine = [r for r in rows if r["direction"] == d]
        if not mine:
            continue
        sign = 1 if d == "denoise" else -1
        bins = "/".join(str(r["bin"]) for r in mine)
        fmt = lambda key, mine=mine, sign=sign: "/".join(  # noqa: E731
            _pc(sign * r[key]) for r in mine)
        parts.append(f"{'denoised' if d == 'denoise' else 'noised'}, the top {bins} "
                     f"{'restore' if d == 'denoise' else 'remove'} {fmt('top')} (lowest-ranked: "
                     f"{fmt('lowest')}; random, mean of {mine[0]['n_random']}: "
                     f"{fmt('random_mean')})")
    site = rows[0].get("site", "pattern")
    return (f"The paper's experiment ({site}s of its top heads by "
            f"{DESCRIPTIVE[phase]} patched together in cumulative bins, held out): "
            + "; ".join(parts) + " (bins/).")
