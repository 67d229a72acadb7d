"""The main job on a real pretrained model: ``characterize`` on the ``capitals`` task, timed, and
the screen-then-verify path's recall against an exact sweep on a subset.

    OMP_NUM_THREADS=1 nice python benchmarks/real_characterize.py [--model smollm2-135m]
        [--n 32] [--method attribution+exact] [--n-random 50] [--recall-n 8] [--out DIR]

Steps (each printed with its wall seconds, and written to ``OUT/benchmark.json``):

1. on the run's prompts, teacher-forced: anchor (continent) and answer (capital) accuracy
   against chance and the majority class (``evaluation.step_accuracy``, as ``ck.evaluate``), and
   each phase's gap (its metric clean minus corrupt, mean with a 95% bootstrap interval);
2. ``characterize(model, "capitals", n_examples=n, patch_method=method)`` into ``OUT/run``
   (report, findings, held-out validation; its ``summary.json`` has every step's seconds);
3. recall: on the first ``--recall-n`` prompts, per phase (noise direction), an exact sweep of
   every head and the same sweep by ``method``: the share of the exact top-k heads (by
   |effect|) among the heads ``method`` verified, and among the screen's top k.

Not a timed test: the machine is shared, so the seconds are what this run saw (say so).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def top(values: torch.Tensor, base: float, k: int) -> set[tuple[int, int]]:
    flat = torch.topk((values - base).abs().flatten(), k).indices
    n_heads = values.shape[1]
    return {(int(i) // n_heads, int(i) % n_heads) for i in flat}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--method", default="attribution+exact")
    ap.add_argument("--n-random", type=int, default=50)
    ap.add_argument("--n-random-ablation", type=int, default=5)
    ap.add_argument("--recall-n", type=int, default=8)
    ap.add_argument("--k", type=int, default=10, help="top-k heads for the recall")
    ap.add_argument("--skip", default="", help="comma list of steps to skip: evaluate,run,recall")
    ap.add_argument("--out", default="benchmarks/results/real-characterize")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import circuitkit as ck
    from circuitkit.experiments.characterize import characterize

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "benchmark.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record.update(model=args.model, n=args.n, method=args.method, n_random=args.n_random,
                  torch_threads=1, note="shared 2-core machine under load from other jobs: "
                  "wall seconds are what this run saw, not the model's speed alone")
    skip = set(filter(None, args.skip.split(",")))

    def save() -> None:
        record_path.write_text(json.dumps(record, indent=1))

    t0 = time.perf_counter()
    model = ck.load_model(args.model)
    record["load_seconds"] = round(time.perf_counter() - t0, 1)
    task = ck.load_task("capitals", n_examples=args.n, split="test", tokenizer=model.tokenizer)
    print(f"model {args.model} loaded in {record['load_seconds']} s; task {task}", flush=True)
    if "evaluate" not in skip:
        t0, c0 = time.perf_counter(), time.process_time()
        from circuitkit.evaluation import accuracy_baselines, step_accuracy

        hits: dict[str, list[bool]] = {}
        gaps: dict[int, list[float]] = {1: [], 2: []}
        with torch.no_grad():
            for s in range(0, len(task), 16):  # teacher-forced (no decoding)
                sub = task.subset(range(s, min(s + 16, len(task))))
                clean = model(sub.clean_tokens)
                for k, v in step_accuracy(clean, sub).items():
                    hits.setdefault(k, []).extend(v)
                for phase in (1, 2):  # the phase's metric, clean minus corrupt, per prompt
                    tp = sub.with_phase(phase)
                    m = tp.metric
                    gaps[phase] += (m.per_prompt(clean) - m.per_prompt(model(tp.corrupt_tokens))
                                    ).tolist()
        record["accuracy"] = {k: round(v, 4) for k, v in accuracy_baselines(task, hits).items()}
        g = torch.Generator().manual_seed(0)
        for phase, vals in gaps.items():
            v = torch.tensor(vals)
            boot = v[torch.randint(0, len(v), (2000, len(v)), generator=g)].mean(1)
            record[f"phase{phase}_gap"] = dict(
                mean=round(float(v.mean()), 3), ci95=[round(float(boot.quantile(q)), 3)
                                                      for q in (0.025, 0.975)],
                share_positive=round(float((v > 0).float().mean()), 3))
        record["evaluate_seconds"] = round(time.perf_counter() - t0, 1)
        record["evaluate_cpu_seconds"] = round(time.process_time() - c0, 1)  # this process's
        print("accuracy", record["accuracy"], "gaps", record["phase1_gap"], record["phase2_gap"],
              f"({record['evaluate_seconds']} s)", flush=True)
        save()
    if "run" not in skip:
        t0, c0 = time.perf_counter(), time.process_time()
        summary = characterize(model, "capitals", out / "run", dict(
            n_examples=args.n, patch_method=args.method, n_random=args.n_random,
            n_random_ablation=args.n_random_ablation, progress=True))
        record["characterize_seconds"] = round(time.perf_counter() - t0, 1)
        record["characterize_cpu_seconds"] = round(time.process_time() - c0, 1)
        record["steps_seconds"] = {k: v["seconds"] for k, v in summary["steps"].items()}
        print(f"characterize: {record['characterize_seconds']} s", record["steps_seconds"],
              flush=True)
        save()
    if "recall" not in skip:
        sub = task.subset(range(min(args.recall_n, len(task))))
        record["recall"] = {}
        for phase in (1, 2):
            tp = sub.with_phase(phase)
            runs = {}
            for method in ("exact", args.method):
                t0 = time.perf_counter()
                res = ck.patch_heads(model, tp.clean_tokens, tp.corrupt_tokens, tp.metric,
                                     direction="noise", method=method, options=dict(progress=False))
                runs[method] = (res, round(time.perf_counter() - t0, 1))
            ex, screened = runs["exact"][0], runs[args.method][0]
            base = float(ex.clean)
            truth = top(ex.values, base, args.k)
            verified = {tuple(c) for c in screened.meta.get("verified_cells", [])}
            row = dict(k=args.k, exact_seconds=runs["exact"][1],
                       method_seconds=runs[args.method][1], n_prompts=len(sub),
                       exact_top=sorted(truth), n_verified=len(verified),
                       recall_in_verified=(len(truth & {c[:2] for c in verified}) / args.k
                                           if verified else None),  # (a hybrid's only)
                       recall_top_k=len(truth & top(screened.values, base, args.k)) / args.k)
            record["recall"][f"phase{phase}"] = row
            print(f"phase {phase} recall", row, flush=True)
            save()
    save()
    print(f"wrote {record_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
