"""Characterize the shipped teacher: both phases' patching sweeps, head scores, causal validation,
one results folder and its report (what ``circuitkit characterize`` does).

    python examples/characterize.py [OUT]   # default runs/example-characterize
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import circuitkit as ck
from circuitkit.experiments.report import write_report

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/example-characterize")
out.mkdir(parents=True, exist_ok=True)
model = ck.load_model("icd-teacher")
for phase in (1, 2):
    task = ck.load_task("icd10", n_examples=64, split="test", phase=phase)
    for direction in ("denoise", "noise"):
        res = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                             direction=direction)
        res.save(out / f"patch-p{phase}-{direction}")
scores = ck.score_heads(model, task)
scores.to_csv(out / "scores.csv", index=False)
print(scores.sort_values("phase1_rank").head(5).to_string(index=False))
print(scores.sort_values("phase2_rank").head(5).to_string(index=False))
checks = ck.validate_heads(model, task, scores, k=5, n_random=20)
checks.to_csv(out / "validation.csv", index=False)
print(checks.to_string(index=False))
(out / "summary.json").write_text(json.dumps(dict(model="icd-teacher", task="icd10",
                                                  n_examples=64, split="test", seed=0)))
print(f"wrote {write_report(out)}")
