"""Issue 53, "one door": every run with patched or ablated activations goes through the checked
road (``ck.patch``'s checks, ``exact.sweeps.run_sweep``'s checkpoints and progress), a result
file is written once, whole, and the model's facts are taken once per trip."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest
import torch
from tinymodels import TINY_LLAMA, make_model

import circuitkit as ck
from circuitkit.patching.results import DegenerateBaselineWarning


def _pair(n: int = 4, seq: int = 8):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 64, (n, seq), generator=g), torch.randint(0, 64, (n, seq), generator=g)


def margin(logits):
    return logits[:, -1, 3] - logits[:, -1, 5]


def test_a_saved_estimate_says_so_in_its_csv_as_written(tmp_path, monkeypatch):
    """The ``estimate`` column is in the CSV ``save`` writes (the CLI rewrote the file after
    ``save``, before): True for attribution, ``not verified`` for attribution+exact, absent for
    exact; the CSV is written once."""
    from circuitkit import files

    model = make_model(TINY_LLAMA)
    clean, corrupt = _pair()
    writes = []
    real = files.atomic_write
    monkeypatch.setattr(files, "atomic_write",
                        lambda path, *a, **k: (writes.append(str(path)), real(path, *a, **k))[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateBaselineWarning)  # random weights
        for method, kw in (("attribution", {}), ("attribution+exact", dict(top_k=3)),
                           ("exact", {})):
            res = ck.patch_edges(model, clean, corrupt, margin, senders=[(0, 1)],
                                 receivers=[(1, 0), (2, 1), "logits"], method=method,
                                 options=dict(progress=False, **kw))
            res.save(tmp_path / method / "edges")
            frame = pd.read_csv(tmp_path / method / "edges.csv")
            if method == "exact":
                assert "estimate" not in frame
            elif method == "attribution":
                assert frame["estimate"].all()
            else:
                assert frame["estimate"].tolist() == (~frame["verified"]).tolist()
                assert 0 < int((~frame["estimate"]).sum()) <= 3
            assert sum(w.endswith(f"/{method}/edges.csv") for w in writes) == 1


def test_edge_coverage_comes_from_the_sweeps_own_engine_and_checkpoint(tmp_path, monkeypatch):
    """An exact edge sweep's ``meta["coverage"]`` is measured by its own engine, as chunks of
    its own sweep (no second engine: ``PathEngine`` is never built), with the values the
    separate node runs give (``paths.edge_coverage``); its node chunks are checkpointed, and a
    checkpoint written before node chunks existed still resumes to the same coverage."""
    from circuitkit.patching.exact import edges as exact_edges
    from circuitkit.patching.exact.paths import PathEngine
    from circuitkit.patching.paths import edge_coverage
    from circuitkit.patching.sweep import make_edge_sweep

    model = make_model(TINY_LLAMA)
    clean, corrupt = _pair(n=6)
    nodes = dict(senders=["embed", (0, 1), (1, 2)], receivers=[(1, 0), (2, 1), "logits"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateBaselineWarning)  # random weights
        want = ck.patch_edges(model, clean, corrupt, margin, **nodes,
                              options=dict(progress=False, batch_size=4))
        by_hand = edge_coverage(model, clean, corrupt, margin, want)

        def refused(*a, **k):
            raise AssertionError("a second engine was built for the coverage")

        monkeypatch.setattr(PathEngine, "__init__", refused)
        for key in ("L0H1", "L1H2", "overall"):
            assert abs(want.meta["coverage"][key] - by_hand[key]) <= 1e-5 * max(
                1, abs(by_hand[key]))
        ckpt = tmp_path / "ck"
        got = ck.patch_edges(model, clean, corrupt, margin, **nodes,
                             options=dict(progress=False, batch_size=4, checkpoint=ckpt))
        assert got.meta["coverage"] == want.meta["coverage"]
        import json

        plan = json.loads((ckpt / "header.json").read_text())["chunks"]
        node_chunks = [i for i, c in enumerate(plan) if c[0] == 4]  # layer L + 1 (L = 3)
        assert len(node_chunks) == 4  # 2 head senders x prompts 0:4, 4:6
        assert all((ckpt / f"chunk_{i:06d}.safetensors").exists() for i in node_chunks)
        again = ck.patch_edges(model, clean, corrupt, margin, **nodes,
                               options=dict(progress=False, batch_size=4, checkpoint=ckpt))
        assert again.meta["coverage"] == want.meta["coverage"]
        # a folder an older circuitkit wrote: its plan has no node chunks
        monkeypatch.setattr(exact_edges, "edge_sweep", make_edge_sweep)
        old = tmp_path / "old"
        ck.patch_edges(model, clean, corrupt, margin, **nodes,
                       options=dict(progress=False, batch_size=4, checkpoint=old))
        monkeypatch.undo()
        monkeypatch.setattr(PathEngine, "__init__", refused)
        resumed = ck.patch_edges(model, clean, corrupt, margin, **nodes,
                                 options=dict(progress=False, batch_size=4, checkpoint=old))
        assert torch.equal(resumed.values.nan_to_num(), want.values.nan_to_num())
        for key in ("L0H1", "L1H2", "overall"):
            assert abs(resumed.meta["coverage"][key] - want.meta["coverage"][key]) <= 1e-6


def test_circuit_runs_take_the_exact_road(tmp_path, monkeypatch):
    """``ck.circuit``'s ablated runs are chunks of ``run_sweep`` (``CircuitEngine``): a stopped
    run resumes from its checkpoint to the same curve, another ablation in the same folder is
    refused, and the numbers are those of a run without checkpoint."""
    from circuitkit.patching.exact.circuits import CircuitEngine

    model = make_model(TINY_LLAMA)
    clean, corrupt = _pair(n=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateBaselineWarning)  # random weights
        edges = ck.patch_edges(model, clean, corrupt, margin, senders=["embed", (0, 1), (1, 2)],
                               options=dict(progress=False))
        kw = dict(sizes=[0.1, 0.5, 1.0], ablation="resample")
        opts = dict(progress=False, n_boot=20, batch_size=4, checkpoint=tmp_path / "ck")
        calls, real = [], CircuitEngine.run_chunk

        def failing(self, chunk):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real(self, chunk)

        monkeypatch.setattr(CircuitEngine, "run_chunk", failing)
        with pytest.raises(KeyboardInterrupt):
            ck.circuit(model, (clean, corrupt, margin), edges, **kw, options=opts)
        monkeypatch.setattr(CircuitEngine, "run_chunk", real)
        assert len(list((tmp_path / "ck").glob("chunk_*.safetensors"))) >= 2
        resumed = ck.circuit(model, (clean, corrupt, margin), edges, **kw, options=opts)
        fresh = ck.circuit(model, (clean, corrupt, margin), edges, **kw,
                           options=dict(opts, checkpoint=None))
        assert torch.equal(resumed.faithfulness, fresh.faithfulness)
        assert resumed.intervals == fresh.intervals and resumed.full == fresh.full
        with pytest.raises(ValueError, match="different sweep.*ablation"):
            ck.circuit(model, (clean, corrupt, margin), edges, sizes=kw["sizes"],
                       ablation="zero", options=opts)


def test_the_models_facts_are_taken_once_at_the_check(monkeypatch):
    """One ``ck.patch_edges`` asks ``hooks.facts(model)`` at most 8 times (13 before issue 53:
    a second engine for the coverage, the units' layout and meta asking again, the engine
    re-checking the model); none of them per layer (a 3-layer model: fewer calls than a
    per-layer question would make alone)."""
    from circuitkit import hooks

    model = make_model(TINY_LLAMA)
    clean, corrupt = _pair()
    real, calls = hooks.facts, []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateBaselineWarning)  # random weights
        ck.patch_edges(model, clean, corrupt, margin, options=dict(progress=False))  # warm
        monkeypatch.setattr(hooks, "facts", lambda m: (calls.append(1), real(m))[1])
        ck.patch_edges(model, clean, corrupt, margin, options=dict(progress=False))
    assert 0 < len(calls) <= 8


RANK = """
import os, sys, warnings
sys.path.insert(0, {tests!r})
warnings.simplefilter("ignore")
import torch
from tinymodels import TINY_LLAMA, make_model
import circuitkit as ck
model = make_model(TINY_LLAMA)
g = torch.Generator().manual_seed(0)
clean = torch.randint(0, 64, (5, 8), generator=g)
corrupt = torch.randint(0, 64, (5, 8), generator=g)
res = ck.patch_edges(model, clean, corrupt, lambda lg: lg[:, -1, 3] - lg[:, -1, 5],
                     senders=["embed", (0, 1), (1, 2)], receivers=[(2, 0), "logits"],
                     options=dict(progress=False, batch_size=2, checkpoint=sys.argv[2]))
res.save(sys.argv[1] + "/rank" + os.environ["RANK"])
"""


def test_edge_coverage_splits_over_ranks(tmp_path):
    """Under torchrun the node runs are chunks like the edges': split over the ranks, merged,
    and every rank states the single process's coverage."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "rank.py"
    script.write_text(RANK.format(tests=str(Path(__file__).parent)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), str(tmp_path / "ckpt")],
        env=dict(os.environ, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]
    model = make_model(TINY_LLAMA)
    clean, corrupt = _pair(n=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateBaselineWarning)  # random weights
        single = ck.patch_edges(model, clean, corrupt, margin, senders=["embed", (0, 1), (1, 2)],
                                receivers=[(2, 0), "logits"],
                                options=dict(progress=False, batch_size=2))
        for r in range(2):
            sharded = ck.EdgeResult.load(tmp_path / f"rank{r}")
            assert sharded.meta["world"] == 2
            assert torch.equal(sharded.values.nan_to_num(), single.values.nan_to_num())
            for key, v in single.meta["coverage"].items():
                assert abs(sharded.meta["coverage"][key] - v) <= 1e-6 * max(1, abs(v))
