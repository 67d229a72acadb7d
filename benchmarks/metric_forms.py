"""A TransformerLens-style plain metric against the same metric as a ``PromptMetric``.

    OMP_NUM_THREADS=1 python benchmarks/metric_forms.py [--repeats 7] [--n 16]

One process, one thread, the shipped ``induction-2l`` on ``--n`` induction prompts (``<bos> A A``,
every prompt the same length, so a metric may read ``logits[:, -1]`` as TransformerLens's
tutorials do), denoise, site z, exact. Rows, interleaved (A, B, C, A, B, C ...; the minimum of
each), each the whole ``ck.patch_heads`` call:

* ``PromptMetric``: ``ck.metrics.token_logprob_metric`` at the last position (no probe);
* ``plain lambda (mean)``: ``lambda logits: logits[:, -1].log_softmax(-1)[i, answer].mean()``,
  the TransformerLens form (probed once per call, its reads then checked on the real logits);
* ``plain lambda ([batch])``: the same returning one value per prompt.

Prints seconds and each row's ratio to the ``PromptMetric`` row (issue 53's target: <= 1.5x).
"""

from __future__ import annotations

import argparse
import time

import torch

import circuitkit as ck


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--seg-len", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = ck.load_model("induction-2l")
    task = ck.load_task("induction", n_examples=a.n, seed=0, seg_len=a.seg_len)  # one length
    # the prompt without its last token, which is the answer logits[:, -1] predicts
    clean, corrupt = task.clean_tokens[:, :-1], task.corrupt_tokens[:, :-1]
    answer = task.clean_tokens[:, -1]
    rows, seq = torch.arange(clean.shape[0]), clean.shape[1]
    pm = ck.metrics.token_logprob_metric([[seq]] * len(rows), answer[:, None].tolist())
    forms = {
        "PromptMetric": pm,
        "plain lambda (mean)": lambda logits: logits[:, -1].log_softmax(-1)[rows, answer].mean(),
        "plain lambda ([batch])": lambda logits: logits[:, -1].log_softmax(-1)[rows, answer],
    }
    opts = ck.PatchOptions(progress=False)
    best = {k: float("inf") for k in forms}
    values = {}
    for _ in range(a.repeats):
        for name, metric in forms.items():
            t0 = time.perf_counter()
            res = ck.patch_heads(model, clean, corrupt, metric, options=opts)
            best[name] = min(best[name], time.perf_counter() - t0)
            values[name] = res.values
    ref = best["PromptMetric"]
    print(f"induction-2l, {len(rows)} prompts x {seq} tokens, 1 thread, "
          f"min of {a.repeats} interleaved")
    for name, t in best.items():
        diff = float((values[name] - values["PromptMetric"]).abs().max())
        print(f"{name:24s} {t:8.4f} s  {t / ref:5.2f}x  max|diff| {diff:.2e}")


if __name__ == "__main__":
    main()
