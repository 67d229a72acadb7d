"""Issue 45's science: where each phase's decision is made, with corruptions that edit the note
and with corruptions that keep it token-identical (``load_task(..., corruption=...)``).

Per model, seed ``s`` and corruption family, the task is ``ck.load_task("icd10", 2 n, seed=s,
split="test", corruption=C)``: its first ``n`` notes *select*, its other ``n`` *validate*, so
seeds 1-3 give 3 disjoint pairs. For each phase and its corruption (Phase 1: "note" with
``anchor_margin``, "anchor" with ``shortlist_anchor_margin``; Phase 2: "note" with
``sibling_margin``, "shortlist-sibling" and "shortlist-swap" with ``edited_sibling_margin``):

* ``gap``: ``m(clean_i) - m(corrupt_i)`` over all ``2 n`` notes, mean with its 95% normal
  interval, the share of notes it lowers, and the clean margin (the gap's scale);
* ``select``: every head noised alone at each position group (``ck.patch_heads(...,
  positions=causal_groups(tp), direction="noise")``, the road ``characterize --stages`` takes)
  on the select half; per layer x group the summed *needed* share ``sum_h -min(0, share_h)``
  with a 95% bootstrap interval over notes (2000 resamples, the ratio of means re-taken in
  each), and the top-5 heads by needed share at "all";
* ``validate``: on the validation half, a hand hook loop (``hook_z`` of the corrupt run written
  into the clean run at the group's positions, every head of the set at once) noising each
  whole layer at each group, and the select half's top-5 heads at every position: the share of
  the gap removed, with its 95% bootstrap interval.

Results: ``OUT/<model>-s<seed>-<corruption>-p<phase>.json`` (a finished file is kept: the run
resumes), then ``OUT/<model>.md`` (tables).

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


def one_run(model, model_name: str, seed: int, n: int, phase: int, corruption: str) -> dict:
    import time

    import torch

    import circuitkit as ck
    from circuitkit.scoring.causal import causal_groups
    from circuitkit.tasks.base import phase_task

    t0 = time.perf_counter()
    task = ck.load_task("icd10", n_examples=2 * n, seed=seed, split="test",
                        corruption=corruption)
    tp_all = phase_task(task, phase)
    assert tp_all.corruption == corruption
    m = tp_all.metric
    with torch.no_grad():
        clean = m.per_prompt(model(tp_all.clean_tokens)).double()
        corrupt = m.per_prompt(model(tp_all.corrupt_tokens)).double()
    d = clean - corrupt
    half = 1.96 * float(d.std()) / len(d) ** 0.5
    out = dict(model=model_name, seed=seed, n=n, phase=phase, corruption=corruption,
               metric=m.name, notes=len(d), gap=float(d.mean()),
               gap_interval=[float(d.mean()) - half, float(d.mean()) + half],
               lowered=float((d > 0).double().mean()), clean=float(clean.mean()),
               corrupt=float(corrupt.mean()))
    sel = phase_task(task.subset(range(n)), phase)
    val = phase_task(task.subset(range(n, 2 * n)), phase)
    groups = causal_groups(sel)
    res = ck.patch_heads(model, sel.clean_tokens, sel.corrupt_tokens, sel.metric,
                         direction="noise", positions=groups, progress=False)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    pp = res.per_prompt.double()  # [n, L, H, G]
    c0, k0 = res.clean_per_prompt.double(), res.corrupt_per_prompt.double()
    gap_sel = c0 - k0
    # needed share per head: -min(0, effect) of the mean effect; per prompt the effect itself
    eff = pp - c0[:, None, None, None]  # [n, L, H, G]; negative: the head is needed
    mean_share = eff.mean(0) / gap_sel.mean()  # [L, H, G]
    needed = (-mean_share).clamp(min=0)
    keep = (mean_share < 0).double()  # the heads counted in the needed sum (fixed by the mean)
    names = list(groups)
    layer_group = {}
    for g_i, g in enumerate(names):
        for layer in range(L):
            num = -(eff[:, layer, :, g_i] * keep[layer, :, g_i]).sum(-1)  # [n]
            point, lo, hi = _interval(num, gap_sel)
            layer_group[f"L{layer}|{g}"] = [float(point), float(lo), float(hi)]
    all_i = names.index("all")
    order = needed[..., all_i].flatten().argsort(descending=True)[:5].tolist()
    top = [(i // H, i % H) for i in order]
    out.update(select_gap=float(gap_sel.mean()), groups=names,
               group_sizes={g: int(groups[g].sum()) for g in names},
               layer_group=layer_group,
               head_needed={f"L{i // H}H{i % H}|{g}": float(needed.flatten(0, 1)[i, gi])
                            for gi, g in enumerate(names) for i in range(L * H)
                            if float(needed.flatten(0, 1)[i, gi]) >= 0.01},
               top5=[f"L{a}H{b}" for a, b in top])
    vg = causal_groups(val)
    with torch.no_grad():
        vc = val.metric.per_prompt(model(val.clean_tokens)).double()
        vk = val.metric.per_prompt(model(val.corrupt_tokens)).double()
    vgap = vc - vk
    validate = {}
    for g in vg:
        for layer in range(L):
            got = _joint_noise(model, val, {layer: list(range(H))}, vg[g]).double()
            point, lo, hi = _interval(vc - got, vgap)
            validate[f"L{layer}|{g}"] = [float(point), float(lo), float(hi)]
    by_layer: dict[int, list[int]] = {}
    for a, b in top:
        by_layer.setdefault(a, []).append(b)
    got = _joint_noise(model, val, by_layer, vg["all"]).double()
    point, lo, hi = _interval(vc - got, vgap)
    validate["top5|all"] = [float(point), float(lo), float(hi)]
    out.update(validate_gap=float(vgap.mean()), validate=validate,
               seconds=round(time.perf_counter() - t0, 1))
    return out


def run(models: list[str], seeds: list[int], n: int, out: Path) -> None:
    import circuitkit as ck
    from circuitkit.files import write_text

    out.mkdir(parents=True, exist_ok=True)
    for name in models:
        model = None
        for s in seeds:
            for phase, corruption in RUNS:
                path = out / f"{name}-s{s}-{corruption}-p{phase}.json"
                if path.exists():
                    continue
                model = model or ck.load_model(name)
                got = one_run(model, name, s, n, phase, corruption)
                write_text(path, json.dumps(got, indent=1))
                print(f"{path.name}: gap {got['gap']:.3g}, {got['seconds']} s", flush=True)


def _f(v: list[float], pct: bool = True) -> str:
    if pct:
        return f"{100 * v[0]:.1f}% [{100 * v[1]:.1f}, {100 * v[2]:.1f}]"
    return f"{v[0]:.3g} [{v[1]:.3g}, {v[2]:.3g}]"


def report(name: str, out: Path) -> str:
    rows = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-s*-p*.json"))]
    if not rows:
        return ""
    lines = [f"# {name}: where each phase's decision is made, note-editing and note-intact "
             "corruptions\n", "Generated by `benchmarks/phase_intact.py` (module docstring: "
             "what each column is).\n", "## Gaps (all 2n notes; 95% normal interval)\n",
             "| seed | phase | corruption | metric | clean | gap | gap / clean | lowered |",
             "|---|---|---|---|---|---|---|---|"]
    key = {(p, c): i for i, (p, c) in enumerate(RUNS)}
    rows.sort(key=lambda r: (key[(r["phase"], r["corruption"])], r["seed"]))
    for r in rows:
        lo, hi = r["gap_interval"]
        lines.append(f"| {r['seed']} | {r['phase']} | {r['corruption']} | {r['metric']} | "
                     f"{r['clean']:.3g} | {r['gap']:.3g} [{lo:.3g}, {hi:.3g}] | "
                     f"{100 * r['gap'] / r['clean']:.1f}% | {100 * r['lowered']:.0f}% |")
    lines += ["", "## Where: per layer x group, summed needed single-head shares on the select "
              "half (95% bootstrap) -> whole layer noised at the group on the validation half",
              "", "Cells with a select share >= 5% in any seed; `all` = every position.", ""]
    for phase, corruption in RUNS:
        rs = [r for r in rows if (r["phase"], r["corruption"]) == (phase, corruption)]
        if not rs:
            continue
        cells = sorted({c for r in rs for c, v in r["layer_group"].items() if v[0] >= 0.05},
                       key=lambda c: (c.split("|")[1] != "all", c))
        lines += [f"### Phase {phase}, corruption {corruption} ({rs[0]['metric']})", "",
                  "| cell | " + " | ".join(f"seed {r['seed']}: select -> validate"
                                           for r in rs) + " |",
                  "|---|" + "---|" * len(rs)]
        for c in cells:
            lines.append(f"| {c} | " + " | ".join(
                f"{_f(r['layer_group'][c])} -> {_f(r['validate'][c])}" for r in rs) + " |")
        lines.append("| top 5 (select) at all | " + " | ".join(
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
        text = report(name, a.out)
        if text:
            write_text(a.out / f"{name}.md", text)
            print(text)


if __name__ == "__main__":
    main()
