"""Issue 53, "one door": every run with patched or ablated activations goes through the checked
road (``ck.patch``'s checks, ``exact.sweeps.run_sweep``'s checkpoints and progress), a result
file is written once, whole, and the model's facts are taken once per trip."""

from __future__ import annotations

import warnings

import pandas as pd
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
