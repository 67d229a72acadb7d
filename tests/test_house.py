"""The one house (issue 53), read from the source and walked at run time: narrow public entries,
short functions, and one door for every model run with patched or ablated activations.

Each rule is checked by a function that a planted violation makes fail (``*_can_fail``)."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch

import circuitkit
import circuitkit as ck

ROOT = Path(circuitkit.__file__).parent
MAX_PARAMS, MAX_PATCH_PARAMS, MAX_LINES = 10, 7, 120


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """A function's parameters as a caller sees them (``self``/``cls`` left out)."""
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return names + [f"*{x.arg}" for x in [a.vararg] if x] + [f"**{x.arg}" for x in [a.kwarg] if x]


def functions(source: str, path: str) -> list[tuple[str, ast.FunctionDef]]:
    """Every function and method of ``source``: (``path:line name``, node)."""
    return [(f"{path}:{n.lineno} {n.name}", n) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def wide(source: str, path: str) -> list[str]:
    """Public functions (no leading underscore) over ``MAX_PARAMS`` parameters."""
    return [f"{where} ({len(params(f))})" for where, f in functions(source, path)
            if not f.name.startswith("_") and len(params(f)) > MAX_PARAMS]


def long(source: str, path: str) -> list[str]:
    return [f"{where} ({f.end_lineno - f.lineno + 1} lines)" for where, f in functions(source, path)
            if f.end_lineno - f.lineno + 1 > MAX_LINES]


def sources() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT.parent)), p.read_text()) for p in sorted(ROOT.rglob("*.py"))]


def test_no_public_function_takes_more_than_ten_parameters():
    bad = [w for path, src in sources() for w in wide(src, path)]
    assert not bad, bad


def test_the_one_entry_takes_seven():
    import inspect

    assert len(inspect.signature(ck.patch).parameters) <= MAX_PATCH_PARAMS
    assert list(inspect.signature(ck.patch).parameters) == [
        "model", "clean_tokens", "corrupt_tokens", "metric", "units", "method", "options"]


def test_no_function_is_longer_than_120_lines():
    bad = [w for path, src in sources() for w in long(src, path)]
    assert not bad, bad


def test_the_source_rules_can_fail():
    planted = "def f(" + ", ".join(f"a{i}" for i in range(11)) + "):\n    pass\n"
    assert wide(planted, "x.py") and not wide(planted.replace("def f", "def _f"), "x.py")
    assert long("def g():\n" + "    x = 1\n" * 120, "x.py")
    assert not long("def g():\n" + "    x = 1\n" * 119, "x.py")


# --- one door: every entry reaches the same checks, engine family and checkpoint format ---------


def margin(logits):  # a plain callable: wrapped once by the entry, whichever road
    return logits[:, -1, 5] - logits[:, -1, 7]


def pair(n=4, seq=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, 60, (n, seq), generator=g)
    corrupt = clean.clone()
    corrupt[:, 1] = torch.randint(1, 60, (n,), generator=g)
    return clean, corrupt


@pytest.fixture
def door(monkeypatch):
    """Counts of the entry's check (``api._check``) and of the sweep checkpoint opened
    (``SweepCheckpoint.open``) while an entry runs."""
    from circuitkit.patching import api, checkpoint

    seen = dict(check=0, checkpoint=0)
    real_check, real_open = api._check, checkpoint.SweepCheckpoint.open.__func__

    def check(*a, **k):
        seen["check"] += 1
        return real_check(*a, **k)

    def open_(cls, *a, **k):
        seen["checkpoint"] += 1
        return real_open(cls, *a, **k)

    monkeypatch.setattr(api, "_check", check)
    monkeypatch.setattr(checkpoint.SweepCheckpoint, "open", classmethod(open_))
    return seen


def quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **k)


def test_patch_heads_and_patch_edges_take_the_door(tiny_llama, door, tmp_path):
    clean, corrupt = pair()
    quiet(ck.patch_heads, tiny_llama, clean, corrupt, margin,
          options=dict(progress=False, checkpoint=tmp_path / "h"))
    quiet(ck.patch_edges, tiny_llama, clean, corrupt, margin, inputs=("q",),
          options=dict(progress=False, checkpoint=tmp_path / "e"))
    assert door == dict(check=2, checkpoint=2)


def test_validation_ablation_and_bins_take_the_door(door, tmp_path):
    from tinymodels import TINY_LLAMA, make_model

    from circuitkit.experiments.bins import cumulative_bins

    model = make_model(TINY_LLAMA)
    task = ck.load_task("synthetic", n_examples=6, n_labels=8, children=4,
                        labels_per_note=(1, 1), split="test", seed=6)
    import pandas as pd

    f = ck.hooks.facts(model)
    n = f.n_layers * f.n_heads
    g = torch.Generator().manual_seed(1)
    scores = pd.DataFrame(dict(layer=[la for la in range(f.n_layers) for _ in range(f.n_heads)],
                               head=[h for _ in range(f.n_layers) for h in range(f.n_heads)]))
    for col in ("phase1_rank", "phase2_rank"):
        scores[col] = (torch.randperm(n, generator=g) + 1).tolist()
    opts = dict(progress=False, checkpoint=tmp_path / "v")
    quiet(ck.validate_heads, model, task, scores, k=2, n_random=2, options=opts)
    after_validation = dict(door)
    assert after_validation["check"] >= 1 and after_validation["checkpoint"] >= 1
    quiet(ck.ablate_heads, model, task, scores, k=2, n_random=2,
          options=dict(opts, checkpoint=tmp_path / "a"))
    assert door["check"] > after_validation["check"]
    ranking = {p: [(la, h) for la in range(f.n_layers) for h in range(f.n_heads)]
               for p in (1, 2)}
    before = dict(door)
    quiet(cumulative_bins, model, task, ranking, bins=(1, 2), n_random=1,
          checkpoint=tmp_path / "b")
    assert door["check"] > before["check"] and door["checkpoint"] > before["checkpoint"]
