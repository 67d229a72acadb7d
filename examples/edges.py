"""Which Phase-1 heads feed which Phase-2 heads, on the shipped teacher: every edge (exact), the
Phase-1 -> Phase-2 edges by input with 95% intervals, the circuits' faithfulness, and how well
EAP / EAP-IG / eap* recover the exact ranking (what ``circuitkit edges`` and ``characterize
--edges`` do, with the numbers printed).

    OMP_NUM_THREADS=1 python examples/edges.py [OUT] [--n 64] [--k 5]

Phase-1 and Phase-2 heads: the top ``k`` of ``ck.score_heads`` (coarse_score, refine_score).
Edges are measured on the Phase-2 task (target vs near-miss margin at the answer steps),
denoise, every head and the embeddings into every later head's q/k/v and the logits.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import circuitkit as ck
from circuitkit.scoring.heads import top_heads

ap = argparse.ArgumentParser()
ap.add_argument("out", nargs="?", default="runs/example-edges")
ap.add_argument("--n", type=int, default=64)
ap.add_argument("--k", type=int, default=5)
ap.add_argument("--ig-steps", type=int, default=5)
args = ap.parse_args()
out = Path(args.out)
model = ck.load_model("icd-teacher")
task = ck.load_task("icd10", n_examples=args.n, split="test")  # phase 2
t = time.perf_counter()
scores = ck.score_heads(model, task, progress=False)
p1, p2 = top_heads(scores, 1, args.k), top_heads(scores, 2, args.k)
print(f"score_heads {time.perf_counter() - t:.1f} s")
print("top Phase-1 heads (coarse_score):", " ".join(f"L{a}H{b}" for a, b in p1))
print("top Phase-2 heads (refine_score):", " ".join(f"L{a}H{b}" for a, b in p2))

t = time.perf_counter()
edges = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                       options=dict(checkpoint=out / "checkpoint", progress=False))
print(f"\nexact edges: {edges} in {time.perf_counter() - t:.1f} s")
edges.save(out / "edges")
cols = ["sender", "receiver", "input", "value", "normalized", "ci_low", "ci_high"]
fmt = dict(index=False, float_format=lambda v: f"{v:.3f}")
print("strongest edges over all heads (normalized: 1 = clean behaviour restored):")
print(edges.top(15)[cols].to_string(**fmt))
df = edges.to_frame()
names1, names2 = {f"L{a}H{b}" for a, b in p1}, {f"L{a}H{b}" for a, b in p2}
sub = df[df.sender.isin(names1) & df.receiver.isin(names2)]
print(f"\nPhase-1 -> Phase-2 edges ({len(sub)}), strongest by input:")
for name in edges.inputs:
    rows = sub[sub.input == name].reindex(sub[sub.input == name].normalized.abs()
                                          .sort_values(ascending=False).index).head(5)
    print(f"into {name}:\n" + rows[cols].to_string(**fmt))
print("\nsum of |normalized| by (sender phase set, receiver) input:",
      {name: round(float(sub[sub.input == name].normalized.abs().sum()), 3)
       for name in edges.inputs})

for label, result in (("all edges", edges),):
    t = time.perf_counter()
    circ = ck.circuit(model, task, result, progress=False)
    ci = circ.intervals or {}
    print(f"\ncircuit of {label}: {circ} ({time.perf_counter() - t:.1f} s)\n  CPR {circ.cpr:.3f}"
          f" {ci.get('cpr')}, CMD {circ.cmd:.3f} {ci.get('cmd')}")
    print(circ.to_frame().to_string(**fmt))
    circ.save_json(out / "circuit.json")
p12 = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric, senders=p1,
                     receivers=[h for h in p2 if h[0] > min(a for a, _ in p1)],
                     options=dict(progress=False))
circ = ck.circuit(model, task, p12, progress=False)
ci = circ.intervals or {}
print(f"\nPhase-1 -> Phase-2 edges only ({int(p12.edge_mask().sum())}; every other edge kept): "
      f"{circ}\n  CPR {circ.cpr:.3f} {ci.get('cpr')}, CMD {circ.cmd:.3f} {ci.get('cmd')}; "
      f"none of them kept: metric {circ.empty:.3f} vs all kept {circ.full:.3f}")


def quality(est, exact, k=20):
    mask = exact.edge_mask()
    out = {}
    for i, name in [(None, "all"), *enumerate(exact.inputs)]:
        m = mask.clone()
        if i is not None:
            m[:, :, [j for j in range(len(exact.inputs)) if j != i]] = False
            m[:, -1] = False
        a, b = est.effect()[m], exact.effect()[m]
        ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
        ra, rb = ra - ra.mean(), rb - rb.mean()
        rho = float((ra * rb).sum() / (ra.norm() * rb.norm()))
        top = lambda x: set(x.abs().topk(k).indices.tolist())  # noqa: E731
        out[name] = f"rho {rho:.3f}, top-{k} {len(top(a) & top(b))}/{k}"
    return out


print(f"\nattribution against exact over all {int(edges.edge_mask().sum())} edges:")
for est in ("eap", "eap*", "eap-ig-inputs", "eap-ig-activations"):
    t = time.perf_counter()
    res = ck.patch_edges(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                         method="attribution",
                         options=dict(estimator=est,
                                      ig_steps=args.ig_steps if est.startswith("eap-ig") else None,
                                      progress=False))
    print(f"  {est:<20s} {time.perf_counter() - t:6.1f} s  {quality(res, edges)}")
torch.save(dict(p1=p1, p2=p2), out / "phase_heads.pt")
