"""Benchmark distillation: time per training step of the full mechanistic loss vs CoT-only, and
the bytes of stored teacher signal per example.

    python benchmarks/distill.py [--batch 64] [--steps 20] [--pool 512] [--student student]

One process, one student (a fresh ``training.PRESETS`` student run through its bridge), the same
batches from one signal store of the shipped ``icd-teacher`` on ``icd10`` train notes, for every
mode: ``cot`` (all lambdas 0: a plain forward, no hooks read), ``p1+p2`` (the full mechanistic
loss), and the non-selective baseline ``ns``. A step is forward + one backward per term
(``loss.balanced_gradients``, as ``train_student``) + AdamW step.
Modes are interleaved step by step (so drift of a shared machine hits all alike) after one
warm-up step each; the median step time of each mode is reported with its ratio to ``cot``.
Target: ``p1+p2`` <= 1.3x ``cot``.

Bytes: the store's shard files over its examples, and per group of tensors (CoT rows + loss mask;
Phase-1 signals; Phase-2 signals; non-selective per-layer attention; query-row indices).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    ap.add_argument("--pool", type=int, default=512, help="notes in the signal store")
    ap.add_argument("--student", default="student", help="training.PRESETS name")
    ap.add_argument("--store", default=None, help="store folder (default: a temporary one)")
    args = ap.parse_args()

    import circuitkit as ck
    from circuitkit.distill.loss import LossConfig, balanced_gradients, student_terms
    from circuitkit.distill.signals import BatchStream, StoreOptions, build_store
    from circuitkit.distill.train import DistillConfig, build_student, teacher_scores
    from circuitkit.models import configure_threads

    threads = configure_threads()
    tmp = tempfile.TemporaryDirectory()
    folder = Path(args.store or tmp.name)
    cfg = DistillConfig(pool_size=args.pool, score_examples=128, student=args.student)
    teacher = ck.load_model("icd-teacher")
    scores = teacher_scores(teacher, cfg, folder)
    pool = ck.load_task("icd10", n_examples=args.pool, seed=0, split="train")
    t0 = time.perf_counter()
    store = build_store(teacher, pool, scores, folder, StoreOptions(shard_size=args.pool),
                        progress=False)
    build_s = time.perf_counter() - t0
    del teacher
    width = max(s["width"] for s in store.manifest["shards"])
    hf, student = build_student(cfg, pool.vocab, max(64, width + 1))
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    stream = BatchStream(store, args.batch, 0)
    pool_w, anchors, lc = store.pooling(), store.anchors, LossConfig()
    modes = {"cot": (0.0, 0.0, 0.0), "p1+p2": (1.0, 1.0, 0.0), "ns": (0.0, 0.0, 1.0)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    student.train()
    for i in range(args.steps + 1):
        batch = stream[i]
        for m, (l1, l2, ln) in modes.items():
            t = time.perf_counter()
            terms = student_terms(student, batch, pool_w, anchors, lc, l1, l2, ln)
            opt.zero_grad(set_to_none=True)
            balanced_gradients(terms, dict(p1=l1, p2=l2, ns=ln), params)  # as train_student
            opt.step()
            if i:  # step 0 warms up
                times[m].append(time.perf_counter() - t)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"student {args.student}, batch {args.batch}, {args.steps} timed steps per mode, "
          f"{threads} torch threads")
    for m in modes:
        print(f"  {m:<7} {1e3 * med[m]:8.1f} ms/step   {med[m] / med['cot']:5.2f}x cot")
    target = "meets" if med["p1+p2"] / med["cot"] <= 1.3 else "MISSES"
    print(f"full mechanistic loss / CoT-only = {med['p1+p2'] / med['cot']:.2f}x "
          f"({target} the <= 1.3x target)")

    groups = {"CoT rows + mask": ("tokens", "mask"),
              "Phase-1 signals": ("p1_attn", "p1_profile", "p1_alignment"),
              "Phase-2 signals": ("p2_loop", "p2_effect"),
              "non-selective": ("ns_attn1", "ns_attn2"),
              "query rows": ("p1_b", "p1_q", "p1_w", "p1_anchor", "p2_b", "p2_q", "p2_w",
                             "p2_keys", "p2_tok"),
              "top-k logits": ("topk_val", "topk_idx")}
    n = store.n_examples
    sizes = {g: 0 for g in groups}
    for i in range(len(store.manifest["shards"])):
        d = store.shard(i)
        for g, keys in groups.items():
            sizes[g] += sum(d[k].numel() * d[k].element_size() for k in keys if k in d)
    total = store.manifest["bytes"]
    print(f"stored teacher signal: {total / n:,.0f} bytes per example ({n} examples, "
          f"{total / 2**20:.2f} MiB; built in {build_s:.1f} s, {n / build_s:.0f} notes/s)")
    for g, b in sizes.items():
        if b:
            print(f"  {g:<16} {b / n:8,.0f} B/example")
    mech = total - sizes["non-selective"] - sizes["top-k logits"]
    print(f"  without the non-selective baseline's attention: {mech / n:,.0f} B/example")


if __name__ == "__main__":
    main()
