"""Re-measure the head scores over several samples of examples, with their stability.

For each sample (a different example seed): ``ck.score_heads`` (bootstrap rank intervals and
top-k inclusion inside the sample), then, across samples, how often each head is in each
phase's top k, the Spearman correlation of the two anchor-direction rankings (label centroids,
the default, against anchor-token columns), the top-k overlaps, how much each RefineScore part
moves the Phase-2 ranking, and the mechanisms of the Phase-2 top heads. With ``--validate``,
``ck.validate_heads`` and ``ck.ablate_heads`` on the first ``--validate`` samples.

    python examples/score_stability.py --model icd-teacher --n 64 --seeds 0 1 2 3 4 5 \\
        --validate 6 --out runs/teacher-stability.json
    python examples/score_stability.py --model smollm2-135m --n 16 --seeds 0 1 2 3 4 \\
        --validate 1 --val-n 8 --n-random 5 --out runs/smollm2-stability.json

Everything printed is also written to ``--out`` (JSON). docs/scores.md reports the results.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch


def _heads(frame, col: str, k: int) -> list[str]:
    best = frame.sort_values([col, "layer", "head"]).head(k)
    return [f"L{int(r.layer)}H{int(r.head)}" for r in best.itertuples()]


def main() -> None:
    import warnings

    import circuitkit as ck
    from circuitkit.scoring.heads import spearman
    from circuitkit.scoring.text import load_for

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="icd-teacher")
    ap.add_argument("--task", default="icd10")
    ap.add_argument("--n", type=int, default=64, help="examples per sample (scores)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--n-boot", type=int, default=50)
    ap.add_argument("--validate", type=int, default=0,
                    help="validate and ablate on this many of the samples (the first ones)")
    ap.add_argument("--val-n", type=int, default=None,
                    help="examples for validation/ablation (default --n)")
    ap.add_argument("--n-random", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model = ck.load_model(args.model)
    result: dict = dict(model=args.model, task=args.task, n=args.n, seeds=args.seeds, k=args.k,
                        n_boot=args.n_boot, samples=[])
    k = args.k
    for i, seed in enumerate(args.seeds):
        t0 = time.perf_counter()
        task, rendered = load_for(model, args.task, args.n, seed, "test", None)
        scores = ck.score_heads(model, task, progress=False, k=k, n_boot=args.n_boot, seed=seed)
        a = scores.attrs
        p2 = scores.sort_values("phase2_rank").head(k)
        sample = dict(
            seed=seed, n=len(task), rendered=rendered, anchor_directions=a["anchor_directions"],
            phase1_top=_heads(scores, "phase1_rank", k),
            phase1_top_tokens=_heads(scores, "phase1_rank_tokens", k),
            phase2_top=_heads(scores, "phase2_rank", k),
            phase1_inclusion=[round(float(x), 3) for x in
                              scores.sort_values("phase1_rank").head(k).phase1_inclusion],
            phase2_inclusion=[round(float(x), 3) for x in p2.phase2_inclusion],
            phase1_rank_interval=[[int(r.phase1_rank_low), int(r.phase1_rank_high)] for r in
                                  scores.sort_values("phase1_rank").head(k).itertuples()],
            phase2_rank_interval=[[int(r.phase2_rank_low), int(r.phase2_rank_high)]
                                  for r in p2.itertuples()],
            phase2_top_parts=[dict(head=f"L{int(r.layer)}H{int(r.head)}",
                                   **{c: round(float(getattr(r, c)), 4) for c in (
                                       "shortlist_share", "key_preference", "ov_copy",
                                       "loopback", "margin_widening", "refine_score",
                                       "margin_from_targets", "margin_from_near_misses",
                                       "refine_target_up", "refine_near_down",
                                       "refine_if_uniform", "ov_copy_targets",
                                       "ov_copy_near_misses")},
                                   mechanism=r.mechanism) for r in p2.itertuples()],
            anchor_agreement=a["anchor_agreement"], unstable=a["unstable"],
            refine_parts=a["refine_parts"],
            layer_profile=dict(
                coarse=[round(float(x), 4) for x in scores.groupby("layer").coarse_score.mean()],
                refine=[round(float(x), 5) for x in scores.groupby("layer").refine_score.mean()],
                share=[round(float(x), 3) for x in
                       scores.groupby("layer").shortlist_share.mean()]),
            mechanisms=dict(Counter(scores.mechanism)),
            scores=scores.to_dict(orient="list"))
        if i < args.validate:
            # the top sets of this sample's scores, tested on its first val_n examples
            vtask = task if args.val_n is None else task.subset(range(min(args.val_n,
                                                                           len(task))))
            val = ck.validate_heads(model, vtask, scores, k=k, n_random=args.n_random, seed=seed,
                                    options=dict(progress=False))
            abl = ck.ablate_heads(model, vtask, scores, k=k, n_random=args.n_random, seed=seed,
                                  options=dict(progress=False))
            sample.update(validation=val.to_dict(orient="records"),
                          ablation=abl.to_dict(orient="records"), val_n=len(vtask))
        sample["seconds"] = round(time.perf_counter() - t0, 1)
        result["samples"].append(sample)
        print(f"seed {seed} (n={len(task)}, {sample['seconds']} s): P1 {sample['phase1_top']} "
              f"(tokens {sample['phase1_top_tokens']}), P2 {sample['phase2_top']} "
              f"{[p['mechanism'] for p in sample['phase2_top_parts']]}", flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, default=str))
    s = result["samples"]
    across = {}
    for key in ("phase1_top", "phase1_top_tokens", "phase2_top"):
        counts = Counter(h for x in s for h in x[key])
        across[key] = {h: c / len(s) for h, c in counts.most_common()}
    # rank agreement between samples: Spearman of the score columns, pairwise
    for col in ("coarse_score", "coarse_score_tokens", "refine_score"):
        vals = [x["scores"][col] for x in s]
        pairs = [spearman(vals[i], vals[j]) for i in range(len(s)) for j in range(i + 1, len(s))]
        across[f"{col}_between_samples_spearman"] = dict(
            min=min(pairs, default=float("nan")), mean=sum(pairs) / max(1, len(pairs)))
    across["anchor_spearman"] = [x["anchor_agreement"] and x["anchor_agreement"]["spearman"]
                                 for x in s]
    across["anchor_top_k_overlap"] = [x["anchor_agreement"] and
                                      x["anchor_agreement"]["top_k_overlap"] for x in s]
    result["across"] = across
    print(json.dumps(across, indent=1, default=str))
    if args.out:
        Path(args.out).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
