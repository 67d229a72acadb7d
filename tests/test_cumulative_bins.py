"""The paper's cumulative-bin experiment (``experiments.bins``): the top heads of a ranking patched
together in bins 3, 8, 16, ... (capped at the model's heads) beside the lowest-ranked and random
heads of equal count, at the attention pattern and at z, both directions; every value equal to
a plain TransformerLens hook loop on a tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import circuitkit as ck
from circuitkit import hooks
from circuitkit.experiments.bins import (
    bin_sets,
    bin_sizes,
    bin_summary,
    bins_figure,
    cumulative_bins,
)
from circuitkit.tasks.base import phase_task


def hand_value(model, base, source, heads, metric, site):
    """Mean metric of ``base`` with ``heads``' ``site`` activation taken from ``source``'s run,
    by ``run_with_hooks`` (pattern: ``[batch, head, q, k]``; z: ``[batch, pos, head, d]``)."""
    names = {hooks.head_site(site, la) for la, _ in heads}
    with torch.no_grad():
        _, cache = model.run_with_cache(source, names_filter=lambda n: n in names)
    fwd = []
    for layer in sorted({la for la, _ in heads}):
        hs = [h for la, h in heads if la == layer]
        name = hooks.head_site(site, layer)

        def hook(act, hook, name=name, hs=hs):
            if site == "pattern":
                act[:, hs] = cache[name][:, hs]
            else:
                act[:, :, hs] = cache[name][:, :, hs]
            return act
        fwd.append((name, hook))
    with torch.no_grad():
        return float(metric.per_prompt(model.run_with_hooks(base, fwd_hooks=fwd)).double().mean())


def test_bins_are_capped_and_controls_have_equal_counts():
    assert bin_sizes(12) == [3, 8, 12] and bin_sizes(200) == [3, 8, 16, 40, 100]
    ranking = [(la, h) for la in range(3) for h in range(4)]
    sets = bin_sets(ranking, 12, n_random=3, seed=1)
    assert {(b, c) for b, c, _, _ in sets} == {(b, c) for b in (3, 8, 12)
                                               for c in ("top", "lowest", "random")}
    assert all(len(s) == b and len(set(s)) == b for b, _, _, s in sets)
    assert sets[0][3] == ranking[:3] and sets[1][3] == ranking[-3:]
    with pytest.raises(ValueError, match="every one of the model's 12 heads"):
        bin_sets(ranking[:5], 12)


@pytest.mark.slow
def test_cumulative_bins_equal_a_hand_hook_loop(tiny_llama):
    task = ck.load_task("synthetic", n_examples=6, n_labels=8, children=4,
                        labels_per_note=(1, 1), split="test", seed=3)
    f = hooks.facts(tiny_llama)
    heads = [(la, h) for la in range(f.n_layers) for h in range(f.n_heads)]
    g = torch.Generator().manual_seed(0)
    rankings = {p: [heads[i] for i in torch.randperm(len(heads), generator=g).tolist()]
                for p in (1, 2)}
    frame = cumulative_bins(tiny_llama, task, rankings, bins=(3, 8, 100), n_random=2)
    assert set(frame["bin"]) == {3, 8, 12} and set(frame["site"]) == {"pattern", "z"}
    assert len(frame) == 2 * 2 * 2 * 3 * 4  # phases x sites x directions x bins x (1+1+2)
    for phase in (1, 2):
        tp = phase_task(task, phase)
        for direction in ("denoise", "noise"):
            base, source = ((tp.corrupt_tokens, tp.clean_tokens) if direction == "denoise"
                            else (tp.clean_tokens, tp.corrupt_tokens))
            for site in ("pattern", "z"):
                part = frame[(frame["phase"] == phase) & (frame["site"] == site)
                             & (frame["direction"] == direction)]
                for r in part.itertuples():
                    want = hand_value(tiny_llama, base, source, hooks.heads_in(r.heads),
                                      tp.metric, site)
                    assert r.value == pytest.approx(want, abs=2e-5), (phase, site, r)
                # all 12 heads: the whole source run's pattern / z; top = lowest = random
                full = part[part["bin"] == 12]["value"]
                assert float(full.max() - full.min()) < 1e-5
    summ = bin_summary(frame)
    assert len(summ) == 2 * 2 * 2 * 3 and (summ["n_random"] == 2).all()
    assert bins_figure(summ).data


CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import torch
    from tinymodels import TINY_LLAMA, make_model
    import circuitkit as ck
    from circuitkit.experiments.bins import cumulative_bins
    from circuitkit.patching.exact.set_engine import HeadSetEngine
    real = HeadSetEngine.run_chunk
    def slow(self, chunk):
        time.sleep(0.05)  # slow enough for the parent to kill us mid-way
        return real(self, chunk)
    HeadSetEngine.run_chunk = slow
    model = make_model(TINY_LLAMA)
    task = ck.load_task("synthetic", n_examples=6, n_labels=8, children=4,
                        labels_per_note=(1, 1), split="test", seed=3)
    cumulative_bins(model, task, {rankings!r}, bins=(3, 8, 100), n_random=2, batch_size=6,
                    checkpoint=sys.argv[1])
    print("FINISHED")
""")


def test_killed_bins_resume_without_recomputing_finished_chunks(tiny_llama, tmp_path,
                                                                monkeypatch):
    """cumulative_bins with ``checkpoint``: SIGKILLed mid-way (no cleanup runs), the rerun
    computes only the chunks not saved (each (phase, site, direction) run a ck.patch over
    HeadSetUnits, its chunks saved as they finish) and gives the uninterrupted frame."""
    from circuitkit.patching.exact.set_engine import HeadSetEngine

    task = ck.load_task("synthetic", n_examples=6, n_labels=8, children=4,
                        labels_per_note=(1, 1), split="test", seed=3)
    heads = [(la, h) for la in range(3) for h in range(4)]
    rankings = {1: heads, 2: heads[::-1]}
    calls: list[int] = []
    real = HeadSetEngine.run_chunk

    def counted(self, chunk):
        calls.append(1)
        return real(self, chunk)

    monkeypatch.setattr(HeadSetEngine, "run_chunk", counted)
    run = lambda **kw: cumulative_bins(tiny_llama, task, rankings, bins=(3, 8, 100),  # noqa
                                       n_random=2, batch_size=6, **kw)
    want = run()
    total = len(calls)
    ckpt = tmp_path / "ckpt"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(Path(__file__).parent), rankings=rankings))
    child = subprocess.Popen([sys.executable, str(script), str(ckpt)],
                             env=dict(os.environ, OMP_NUM_THREADS="1"),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(ckpt.glob("*/chunk_*.safetensors"))) < total // 3:
        assert child.poll() is None, "child ended before it could be killed"
        time.sleep(0.02)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    saved = len(list(ckpt.glob("*/chunk_*.safetensors")))
    assert child.returncode == -signal.SIGKILL and 0 < saved < total
    calls.clear()
    got = run(checkpoint=ckpt)
    assert len(calls) == total - saved  # only the chunks the killed run had not saved
    pd.testing.assert_frame_equal(got, want)
    calls.clear()
    run(checkpoint=ckpt)
    assert not calls
