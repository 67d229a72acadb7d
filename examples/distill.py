"""Distil the shipped teacher into a small student with the mechanistic losses, then evaluate it
(what ``circuitkit distill`` does; ``--ablation`` runs the whole table).

    python examples/distill.py [OUT] [--quick]   # default runs/example-distill
"""

from __future__ import annotations

import sys
from pathlib import Path

import circuitkit as ck
from circuitkit.distill.train import DistillConfig, train_student

args = [a for a in sys.argv[1:] if not a.startswith("--")]
out = Path(args[0] if args else "runs/example-distill")
quick = "--quick" in sys.argv
size = dict(pool_size=96, shard_size=48, steps=12, batch_size=16, warmup=2, save_every=6,
            score_examples=32) if quick else {}
cfg = DistillConfig(teacher="icd-teacher", task="icd10", student="student", lambda_p1=1.0,
                    lambda_p2=1.0, **size)
folder = train_student(cfg, out)  # resumable: rerun after an interruption
student = ck.load_model(str(folder))
task = ck.load_task("icd10", n_examples=32 if quick else 256, split="test")
print(ck.evaluate(student, task, progress=True))
