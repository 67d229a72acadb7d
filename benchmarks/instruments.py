"""Issue 47: the paper's score forms and metrics beside circuitkit's, each instrument against the
causal ranking and its null, on the shipped teacher.

Per seed: ``score_heads`` (no bootstrap) and ``causal_table`` (noising, each head at every
position) on the same ``n`` icd10 test notes; ``scoring.instruments.instrument_table`` (Spearman
and precision@k against the causal ranking, the null and its verdict); ``ck.evaluate`` of the
teacher and the CoT student (circuitkit's focus / confusion and the paper's sentence-embedding
ones side by side). One Markdown file ``OUT/<model>.md`` and the frames as CSV.

    python benchmarks/instruments.py [--model icd-teacher] [--seeds 0 1] [--n 128] [--k 5]
        [--out benchmarks/results/instruments] [--no-causal] [--student NAME|none]

A pretrained LLM reads the notes rendered as text (``scoring.text.load_for``). ``--no-causal``:
the nulls only (a real model's causal sweeps take hours on a CPU).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="icd-teacher")
    ap.add_argument("--student", default="icd-student-cot")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/instruments")
    ap.add_argument("--no-causal", action="store_true")
    a = ap.parse_args()

    import pandas as pd
    import torch

    import circuitkit as ck
    from circuitkit.scoring.causal import causal_table
    from circuitkit.scoring.instruments import instrument_table
    from circuitkit.scoring.text import load_for

    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = ck.load_model(a.model)
    lines = [f"# Instruments on {a.model}: the paper's forms, circuitkit's, their nulls", "",
             f"icd10 test notes, n = {a.n} per seed, k = {a.k}; causal ranking: each head noised "
             "at every position, its needed share of the phase's gap (Phase 1 anchor margin, "
             "Phase 2 target-vs-sibling margin). `python benchmarks/instruments.py`", ""]
    record = {}
    for seed in a.seeds:
        task, _ = load_for(model, "icd10", a.n, seed, "test", None)
        t0 = time.perf_counter()
        scores = ck.score_heads(model, task, progress=False, n_boot=0)
        t_scores = time.perf_counter() - t0
        t0 = time.perf_counter()
        merged = scores
        if not a.no_causal:
            causal = causal_table(model, task, directions=("noise",))
            merged = scores.merge(causal.drop(columns=["name"]), on=["layer", "head"])
        t_causal = time.perf_counter() - t0
        merged.attrs.update(scores.attrs)
        table = instrument_table(merged, a.k)
        merged.to_csv(out / f"{a.model}-s{seed}-scores.csv", index=False)
        table.to_csv(out / f"{a.model}-s{seed}-instruments.csv", index=False)
        record[seed] = dict(nulls=scores.attrs["instrument_nulls"], seconds_scores=t_scores,
                            seconds_causal=t_causal)
        lines += [f"## seed {seed} (scores {t_scores:.0f} s, causal {t_causal:.0f} s, 1 thread)",
                  "", table.to_markdown(index=False, floatfmt="+.3f"), ""]
        print(table.to_string(), flush=True)
    evals = []
    for name in [a.model] + ([a.student] if a.student != "none" else []):
        other = model if name == a.model else ck.load_model(name)
        task, _ = load_for(other, "icd10", a.n, a.seeds[0], "test", None)
        m = ck.evaluate(other, task)
        evals.append(dict(model=name, **m))
    ev = pd.DataFrame(evals)[["model", "focus", "focus_per_step", "focus_embedding", "confusion",
                              "confusion_embedding", "exact_match", "embedding_encoder"]]
    lines += [f"## Focus and Confusion, both definitions (seed {a.seeds[0]})", "",
              ev.to_markdown(index=False, floatfmt=".4f"), ""]
    print(ev.to_string(), flush=True)
    (out / f"{a.model}.md").write_text("\n".join(lines))
    (out / f"{a.model}.json").write_text(json.dumps(dict(record=record, evaluate=evals),
                                                    indent=1, default=str))


if __name__ == "__main__":
    main()
