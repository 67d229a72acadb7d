"""CPU cost of SmolLM2-135M on the capitals task, one torch thread: one forward of 16 prompts and
one attribution sweep (every head, Phase 1, noise) of the same prompts, in this process's CPU
seconds (``time.process_time``: what the work costs whatever else the shared machine runs) and
wall seconds (what this run saw). The rate the characterize projections in docs/scores.md use.

    OMP_NUM_THREADS=1 nice python benchmarks/real_rate.py
"""
from __future__ import annotations

import json
import time

import torch


def main() -> None:
    import circuitkit as ck

    torch.set_num_threads(1)
    m = ck.load_model("smollm2-135m")
    t = ck.load_task("capitals", n_examples=16, split="test",
                     tokenizer=m.tokenizer).with_phase(1)
    out = {}
    with torch.no_grad():
        m(t.clean_tokens[:2])  # warm-up
        c0, w0 = time.process_time(), time.perf_counter()
        m(t.clean_tokens)
        out["forward16_cpu_s"] = time.process_time() - c0
        out["forward16_wall_s"] = time.perf_counter() - w0
    c0, w0 = time.process_time(), time.perf_counter()
    ck.patch_heads(m, t.clean_tokens, t.corrupt_tokens, t.metric, direction="noise",
                   method="attribution", options=dict(progress=False))
    out["attribution16_cpu_s"] = time.process_time() - c0
    out["attribution16_wall_s"] = time.perf_counter() - w0
    out["seq"] = t.clean_tokens.shape[1]
    print(json.dumps(out))
    with open("benchmarks/results/real-characterize/smollm2-135m-rate.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
