"""Patch every head of the shipped teacher, both directions; print what it found; write the
results and their report (what ``circuitkit patch`` + ``circuitkit report`` do).

    python examples/patch.py [OUT]        # default runs/example-patch
"""

from __future__ import annotations

import sys
from pathlib import Path

import circuitkit as ck
from circuitkit.experiments.report import write_report

out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/example-patch")
model = ck.load_model("icd-teacher")
task = ck.load_task("icd10", n_examples=32, split="test")  # Phase 2: target vs near-miss margin
for direction in ("denoise", "noise"):
    res = ck.patch_heads(model, task.clean_tokens, task.corrupt_tokens, task.metric,
                         direction=direction)
    res.save(out / f"patch-p2-{direction}")
    print(f"{res}\ntop heads ({direction}):\n{res.top(5).to_string(index=False)}\n")
print(f"wrote {write_report(out, attention=False)}")
