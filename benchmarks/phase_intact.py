"""Issue 45's science: where each phase's decision is made, with corruptions that edit the note
and with corruptions that keep it token-identical (``load_task(..., corruption=...)``).

Per model, seed ``s`` and corruption family, the task is ``ck.load_task("icd10", 2 n, seed=s,
split="test", corruption=C)``: its first ``n`` notes *select*, its other ``n`` *validate*, so
seeds 1-3 give 3 disjoint pairs. For each phase and its corruption (Phase 1: "note" with
``anchor_margin``, "anchor" with ``shortlist_anchor_margin``; Phase 2: "note" with
``sibling_margin``, "shortlist-sibling" and "shortlist-swap" with ``edited_sibling_margin``):

* ``gap`` (``-gap.json``): ``m(clean_i) - m(corrupt_i)`` over all ``2 n`` notes, mean with
  its 95% normal interval, the share of notes it lowers, and the clean margin (its scale);
* ``where`` (``-where.json``): on the select half, every head noised alone at every position
  (``ck.patch_heads(..., direction="noise")``) and its top 5 by needed share ``-min(0,
  share)``; on both halves, each whole layer noised at each position group
  (``task.position_groups(at="steps")`` plus "all"; a hand hook loop writing the corrupt run's
  ``hook_z`` into the clean run at the group's positions): the share of the gap removed with a
  95% bootstrap interval over notes (2000 resamples, the ratio of means re-taken in each); on
  the validation half, the select half's top 5 noised together.

All gaps run first, then the location runs (note-intact ones first), seed by seed; a gap whose
interval holds 0 is not located (every share of it would be noise).
Results: ``OUT/<model>-s<seed>-<corruption>-p<phase>-{gap,where}.json`` (a finished file is
kept: the run resumes), then ``OUT/<model>.md`` (tables).

    python benchmarks/phase_intact.py [--models icd-teacher icd-teacher-deep] [--seeds 1 2 3]
        [--n 128] [--out benchmarks/results/phase-intact] [--report-only]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RUNS = ((1, "note"), (1, "anchor"), (2, "note"), (2, "shortlist-sibling"), (2, "shortlist-swap"))
N_BOOT = 2000


def _interval(num, den, n_boot: int = N_BOOT, seed: int = 0):
    """``mean(num) / mean(den)`` and its 95% percentile bootstrap interval over prompts
    (``num`` ``[..., n]``, ``den`` ``[n]``)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = den.shape[-1]
    idx = torch.randint(0, n, (n_boot, n), generator=g)
    point = num.mean(-1) / den.mean()
    boot = num[..., idx].mean(-1) / den[idx].mean(-1)  # [..., n_boot]
    lo, hi = boot.quantile(0.025, dim=-1), boot.quantile(0.975, dim=-1)
    return point, lo, hi


def _joint_noise(model, tp, heads_by_layer: dict[int, list[int]], mask):
    """Per-prompt metric of the clean run with the corrupt run's ``hook_z`` written in at
    ``mask`` ``[n, seq]`` for the heads ``{layer: [head, ...]}`` (a hand hook loop)."""
    import torch

    from circuitkit import hooks

    names = [hooks.z(layer) for layer in heads_by_layer]
    with torch.no_grad():
        _, cache = model.run_with_cache(tp.corrupt_tokens, names_filter=lambda x: x in names)

        def fix(layer):
            hs, src = torch.tensor(heads_by_layer[layer]), cache[hooks.z(layer)]

            def fn(z, hook):
                sel = mask[:, : z.shape[1], None, None] & torch.isin(
                    torch.arange(z.shape[2]), hs)[None, None, :, None]
                return torch.where(sel, src, z)
            return fn

        logits = model.run_with_hooks(tp.clean_tokens, fwd_hooks=[
            (hooks.z(layer), fix(layer)) for layer in heads_by_layer])
    return tp.metric.per_prompt(logits)


def _task(model_name: str, seed: int, n: int, phase: int, corruption: str):
    import circuitkit as ck
    from circuitkit.tasks.base import phase_task

    task = ck.load_task("icd10", n_examples=2 * n, seed=seed, split="test",
                        corruption=corruption)
    assert phase_task(task, phase).corruption == corruption
    return task


def gap_run(model, model_name: str, seed: int, n: int, phase: int, corruption: str) -> dict:
    """The clean-corrupt gap over all ``2 n`` notes (module docstring)."""
    import torch

    from circuitkit.tasks.base import phase_task

    tp = phase_task(_task(model_name, seed, n, phase, corruption), phase)
    m = tp.metric
    with torch.no_grad():
        clean = m.per_prompt(model(tp.clean_tokens)).double()
        corrupt = m.per_prompt(model(tp.corrupt_tokens)).double()
    d = clean - corrupt
    half = 1.96 * float(d.std()) / len(d) ** 0.5
    return dict(model=model_name, seed=seed, n=n, phase=phase, corruption=corruption,
                metric=m.name, notes=len(d), gap=float(d.mean()),
                gap_interval=[float(d.mean()) - half, float(d.mean()) + half],
                lowered=float((d > 0).double().mean()), clean=float(clean.mean()),
                corrupt=float(corrupt.mean()))


def _layer_groups(model, tp) -> dict:
    """Each whole layer noised at each position group (hand hook loop): ``{"L|g": [share,
    low, high]}``, the share of ``tp``'s gap removed with its 95% bootstrap interval."""
    import torch

    from circuitkit.scoring.causal import causal_groups

    groups = causal_groups(tp)
    with torch.no_grad():
        c = tp.metric.per_prompt(model(tp.clean_tokens)).double()
        k = tp.metric.per_prompt(model(tp.corrupt_tokens)).double()
    out = {}
    H = model.cfg.n_heads
    for g, mask in groups.items():
        for layer in range(model.cfg.n_layers):
            got = _joint_noise(model, tp, {layer: list(range(H))}, mask).double()
            out[f"L{layer}|{g}"] = [float(x) for x in _interval(c - got, c - k)]
    return out, c - k, groups


def where_run(model, model_name: str, seed: int, n: int, phase: int, corruption: str) -> dict:
    """Select half: every head noised alone (all positions; ``ck.patch_heads``), its top 5 by
    needed share, and each whole layer noised at each group; validation half: the same layer x
    group cells and the top 5 noised together (module docstring)."""
    import time

    import circuitkit as ck
    from circuitkit.tasks.base import phase_task

    t0 = time.perf_counter()
    task = _task(model_name, seed, n, phase, corruption)
    sel = phase_task(task.subset(range(n)), phase)
    val = phase_task(task.subset(range(n, 2 * n)), phase)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    res = ck.patch_heads(model, sel.clean_tokens, sel.corrupt_tokens, sel.metric,
                         direction="noise", options=dict(progress=False))
    share = (res.values.double() - res.clean) / (res.clean - res.corrupt)  # [L, H]
    needed = (-share).clamp(min=0)
    order = needed.flatten().argsort(descending=True)[:5].tolist()
    top = [(i // H, i % H) for i in order]
    select, sel_gap, groups = _layer_groups(model, sel)
    validate, val_gap, vg = _layer_groups(model, val)
    by_layer: dict[int, list[int]] = {}
    for a, b in top:
        by_layer.setdefault(a, []).append(b)
    import torch

    with torch.no_grad():
        c = val.metric.per_prompt(model(val.clean_tokens)).double()
    got = _joint_noise(model, val, by_layer, vg["all"]).double()
    validate["top5|all"] = [float(x) for x in _interval(c - got, val_gap)]
    return dict(model=model_name, seed=seed, n=n, phase=phase, corruption=corruption,
                metric=sel.metric.name, select_gap=float(sel_gap.mean()),
                validate_gap=float(val_gap.mean()), groups=list(groups),
                group_sizes={g: int(m.sum()) for g, m in groups.items()},
                head_needed={f"L{i // H}H{i % H}": float(needed.flatten()[i])
                             for i in range(L * H) if float(needed.flatten()[i]) >= 0.01},
                top5=[f"L{a}H{b}" for a, b in top], top5_select=float(needed.flatten()[
                    order].sum()), layer_group=select, validate=validate,
                seconds=round(time.perf_counter() - t0, 1))


WHERE_ORDER = ((1, "anchor"), (2, "shortlist-sibling"), (2, "note"), (1, "note"),
               (2, "shortlist-swap"))


def run(models: list[str], seeds: list[int], n: int, out: Path) -> None:
    import circuitkit as ck
    from circuitkit.files import write_text

    out.mkdir(parents=True, exist_ok=True)
    for name in models:
        model = None
        stem = Path(name).name
        jobs = [("gap", s, p, c) for s in seeds for p, c in RUNS] + \
            [("where", s, p, c) for p, c in WHERE_ORDER for s in seeds]
        for stage, s, phase, corruption in jobs:
            path = out / f"{stem}-s{s}-{corruption}-p{phase}-{stage}.json"
            if path.exists():
                continue
            gap_file = out / f"{stem}-s{s}-{corruption}-p{phase}-gap.json"
            if stage == "where" and gap_file.exists():
                lo, hi = json.loads(gap_file.read_text())["gap_interval"]
                if lo <= 0 <= hi:  # no gap to locate: every share of it would be noise
                    continue
            model = model or ck.load_model(name)
            fn = gap_run if stage == "gap" else where_run
            got = fn(model, stem, s, n, phase, corruption)
            write_text(path, json.dumps(got, indent=1))
            print(f"{path.name}: {got.get('gap', got.get('select_gap')):.3g}, "
                  f"{got.get('seconds', '')} s", flush=True)


def _f(v: list[float], pct: bool = True) -> str:
    if pct:
        return f"{100 * v[0]:.1f}% [{100 * v[1]:.1f}, {100 * v[2]:.1f}]"
    return f"{v[0]:.3g} [{v[1]:.3g}, {v[2]:.3g}]"


def report(name: str, out: Path) -> str:
    gaps = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-s*-gap.json"))]
    wheres = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-s*-where.json"))]
    if not gaps:
        return ""
    lines = [f"# {name}: where each phase's decision is made, note-editing and note-intact "
             "corruptions\n", "Generated by `benchmarks/phase_intact.py` (module docstring: "
             "what each column is).\n", "## Gaps (all 2n notes; 95% normal interval)\n",
             "| seed | phase | corruption | metric | clean | gap | gap / clean | lowered |",
             "|---|---|---|---|---|---|---|---|"]
    key = {(p, c): i for i, (p, c) in enumerate(RUNS)}
    gaps.sort(key=lambda r: (key[(r["phase"], r["corruption"])], r["seed"]))
    for r in gaps:
        lo, hi = r["gap_interval"]
        lines.append(f"| {r['seed']} | {r['phase']} | {r['corruption']} | {r['metric']} | "
                     f"{r['clean']:.3g} | {r['gap']:.3g} [{lo:.3g}, {hi:.3g}] | "
                     f"{100 * r['gap'] / r['clean']:.1f}% | {100 * r['lowered']:.0f}% |")
    lines += ["", "## Where: each whole layer noised at each position group, share of the gap "
              "removed (95% bootstrap over notes): select half -> validation half", "",
              "Cells removing >= 5% on a select half; `all` = every position. Last row: the "
              "select half's top 5 single heads (needed share), noised together on the "
              "validation half.", ""]
    for phase, corruption in RUNS:
        rs = sorted((r for r in wheres if (r["phase"], r["corruption"]) == (phase, corruption)),
                    key=lambda r: r["seed"])
        if not rs:
            continue
        cells = sorted({c for r in rs for c, v in r["layer_group"].items() if v[0] >= 0.05},
                       key=lambda c: (c.split("|")[1] != "all", c))
        lines += [f"### Phase {phase}, corruption {corruption} ({rs[0]['metric']}; gap select "
                  + " / ".join(f"{r['select_gap']:.3g}" for r in rs) + ")", "",
                  "| cell | " + " | ".join(f"seed {r['seed']}: select -> validate"
                                           for r in rs) + " |",
                  "|---|" + "---|" * len(rs)]
        for c in cells:
            lines.append(f"| {c} | " + " | ".join(
                f"{_f(r['layer_group'][c])} -> {_f(r['validate'][c])}" for r in rs) + " |")
        lines.append("| top 5 heads together | " + " | ".join(
            f"{' '.join(r['top5'])} -> {_f(r['validate']['top5|all'])}" for r in rs) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["icd-teacher"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/phase-intact"))
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    if not a.report_only:
        run(a.models, a.seeds, a.n, a.out)
    from circuitkit.files import write_text

    for name in a.models:
        name = Path(name).name
        text = report(name, a.out)
        if text:
            write_text(a.out / f"{name}.md", text)
            print(text)


if __name__ == "__main__":
    main()
