"""Why first-order attribution misses heads on SmolLM2: the evidence of docs/attribution.md.

    python benchmarks/attribution_why.py [--seeds 0] [--direction noise] [--heads 10]

On the repeated-tokens setting of ``attribution_quality.py`` (same tokens, metric and exact-sweep
cache), for exact's top heads and the ``block`` estimator's top head, measured with exact forward
runs (site z, all positions):

* **scaling** (section 1): the metric change when a fraction ``alpha`` of the head's change is
  patched, ``z_base + alpha (z_source - z_base)``; a first-order estimate is the slope at 0;
* **frozen patterns** (section 2): the full patch with every later layer's attention pattern held
  at its base value; what is left is the effect that does not go through later patterns;
* **budgets** (section 7): the screening estimator with some cells replaced by their exact
  value, chosen three ways (every head of the first ``m`` layers; the ``n`` cells with the largest
  error unit ``u = w (L - l) / L``; the hybrid's rule within what ``<= 5x AtP`` leaves; and
  ``attribution+exact`` itself run with ``max_passes`` at 5x and 7x AtP), with
  top-10 recall, exact's top-3 within the top-20 and the cost in pass-equivalents per prompt
  (AtP = 4; an exact head at layer l costs ``(L - l) / L``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from attribution_quality import cached_exact, quality, repeated_tokens  # this script's folder

import circuitkit as ck
from circuitkit import hooks
from circuitkit.models import configure_threads
from circuitkit.patching.estimators.attribution import SCREENING_ESTIMATOR, estimator_passes

ALPHAS = (0.1, 0.25, 0.5, 0.75, 1.0)


def patched_metric(model: Any, tokens, metric, base, source, layer: int, head: int,
                   alpha: float = 1.0, freeze_after: bool = False) -> float:
    """Mean metric with head (layer, head)'s z moved by ``alpha`` of its change; optionally every
    later layer's attention pattern held at its value in ``base`` (an ActivationCache)."""
    zname = hooks.z(layer)

    def move(z, hook):
        z = z.clone()
        z[:, :, head] = base[zname][:, :, head] + alpha * (source[zname][:, :, head]
                                                          - base[zname][:, :, head])
        return z

    fwd = [(zname, move)]
    if freeze_after:
        fwd += [(hooks.pattern(lp), lambda p, hook, nm=hooks.pattern(lp): base[nm])
                for lp in range(layer + 1, model.cfg.n_layers)]
    with torch.no_grad():
        return float(metric(model.run_with_hooks(tokens, fwd_hooks=fwd)).mean())


def budget_rows(est: torch.Tensor, exact: torch.Tensor, write_scale: torch.Tensor,
                base_passes: float) -> list[tuple[str, int, dict[str, Any], float]]:
    """(rule, cells, quality, pass-equivalents per prompt) with some cells made exact."""
    L, H = exact.shape
    depth = ((L - torch.arange(L)) / L)[:, None].expand(L, H)
    rules: list[tuple[str, torch.Tensor]] = [("none", torch.zeros(L, H, dtype=torch.bool))]
    for m in (1, 2, 3):
        mask = torch.zeros(L, H, dtype=torch.bool)
        mask[:m] = True
        rules.append((f"every head of the first {m} layer(s)", mask))
    u = write_scale * depth
    for n in (9, 18, 27):
        mask = torch.zeros(L * H, dtype=torch.bool)
        mask[u.flatten().topk(n).indices] = True
        rules.append((f"the {n} cells with the largest u", mask.reshape(L, H)))
    # what 5x AtP leaves after this estimator, and what it would leave after one costing AtP's 4
    for spend in (20.0 - base_passes, 16.0):
        rules.append((f"adaptive, {spend:.1f} pass-eq (3 largest u, then by upper bound)",
                      adaptive_mask(est, exact, u, depth, spend)))
    out = []
    for name, mask in rules:
        mixed = torch.where(mask, exact, est)
        out.append((name, int(mask.sum()), quality(mixed, exact),
                    base_passes + float(depth[mask].sum())))
    return out


def adaptive_mask(est: torch.Tensor, exact: torch.Tensor, u: torch.Tensor, depth: torch.Tensor,
                  spend: float, first: int = 3, q: float = 0.9) -> torch.Tensor:
    """The hybrid's rule on a fixed budget: the ``first`` largest-u cells, then one cell at a time
    by the upper bound ``|e| + k u`` (k: the q-quantile of ``|x - e| / u`` over verified cells)
    while the exact cost ``sum (L - l) / L`` stays within ``spend``."""
    e, x, u, cost = est.flatten(), exact.flatten(), u.flatten(), depth.flatten()
    mask = torch.zeros_like(e, dtype=torch.bool)
    mask[u.topk(first).indices] = True
    while True:
        k = torch.quantile((x[mask] - e[mask]).abs() / u[mask], q)
        bound = torch.where(mask, -1.0, e.abs() + k * u)
        bound[cost + cost[mask].sum() > spend] = -1.0
        i = int(bound.argmax())
        if bound[i] < 0:
            return mask.reshape(exact.shape)
        mask[i] = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--direction", choices=["noise", "denoise"], default="noise")
    p.add_argument("--heads", type=int, default=10, help="exact's top heads to diagnose")
    p.add_argument("--skip-budgets", action="store_true")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "circuitkit"
                                          / "attribution_quality"))
    args = p.parse_args()
    configure_threads()
    model = ck.load_model("smollm2-135m")
    L, H = model.cfg.n_layers, model.cfg.n_heads
    names = [hooks.z(lay) for lay in range(L)] + [hooks.pattern(lay) for lay in range(L)]
    for seed in args.seeds:
        clean, corrupt, metric = repeated_tokens(model, seed)
        label = f"SmolLM2 repeated tokens, seed {seed}"
        exact, _ = cached_exact(label, model, clean, corrupt, metric, args.direction,
                                Path(args.cache))
        with torch.no_grad():
            _, cc = model.run_with_cache(clean, names_filter=lambda n: n in names)
            _, kc = model.run_with_cache(corrupt, names_filter=lambda n: n in names)
        noise = args.direction == "noise"
        base, source, tokens = (cc, kc, clean) if noise else (kc, cc, corrupt)
        m0 = exact.clean if noise else exact.corrupt
        x = exact.values - m0
        res = {e: ck.patch_heads(model, clean, corrupt, metric, direction=args.direction,
                                 method="attribution", options=dict(estimator=e, progress=False))
               for e in ("atp", SCREENING_ESTIMATOR)}
        est = {e: r.values - m0 for e, r in res.items()}
        print(f"\n## {label}, {args.direction} (metric at base {m0:.2f})\n")
        heads = x.flatten().abs().topk(args.heads).indices.tolist()
        top_block = int(est[SCREENING_ESTIMATOR].flatten().abs().argmax())
        heads += [top_block] if top_block not in heads else []
        rank = {e: v.flatten().abs().argsort(descending=True).argsort() + 1
                for e, v in est.items()}
        print("| head | exact | atp (rank) | block (rank) | "
              + " | ".join(f"alpha {a}" for a in ALPHAS) + " | later patterns frozen |")
        print("|---|---|---|---|" + "---|" * (len(ALPHAS) + 1))
        for i in heads:
            lay, h = divmod(i, H)
            scaled = [patched_metric(model, tokens, metric, base, source, lay, h, a) - m0
                      for a in ALPHAS]
            frozen = patched_metric(model, tokens, metric, base, source, lay, h,
                                    freeze_after=True) - m0
            print(f"| L{lay}H{h} | {x.flatten()[i]:+.2f} | {est['atp'].flatten()[i]:+.2f} "
                  f"({int(rank['atp'][i])}) | {est[SCREENING_ESTIMATOR].flatten()[i]:+.2f} "
                  f"({int(rank[SCREENING_ESTIMATOR][i])}) | "
                  + " | ".join(f"{s:+.2f}" for s in scaled) + f" | {frozen:+.2f} |", flush=True)
        if args.skip_budgets:
            continue
        ws = torch.as_tensor(res[SCREENING_ESTIMATOR].meta["write_scale"]).reshape(L, H)
        base_passes = estimator_passes(model, SCREENING_ESTIMATOR, "z", "all", clean.shape[1],
                                       batch=clean.shape[0])
        print(f"\n{SCREENING_ESTIMATOR} with cells replaced by exact values:\n")
        print("| exact cells | cells | top-10 recall | top-3 in top-20 | pass-eq/prompt (x AtP) |")
        print("|---|---|---|---|---|")
        for name, n, q, passes in budget_rows(est[SCREENING_ESTIMATOR], x, ws, base_passes):
            print(f"| {name} | {n} | {q['recall10']}/10 | {q['top3_in_top20']}/3 | {passes:.1f} "
                  f"({passes / 4:.1f}x) |", flush=True)
        for mult in (5.0, 7.0):  # the library's own rule, run for real, within a pass budget
            n = clean.shape[0]
            hyb = ck.patch_heads(model, clean, corrupt, metric, direction=args.direction,
                                 method="attribution+exact",
                                 options=dict(max_passes=mult * 4 * n, progress=False))
            q = quality(hyb.values - m0, x)
            passes = hyb.meta["cost"]["total_passes"] / n
            print(f"| attribution+exact, max_passes {mult:.0f}x AtP (engine's 2 cached runs "
                  f"included) | {hyb.meta['n_verified']} | {q['recall10']}/10 | "
                  f"{q['top3_in_top20']}/3 | {passes:.1f} ({passes / 4:.1f}x) |", flush=True)


if __name__ == "__main__":
    main()
