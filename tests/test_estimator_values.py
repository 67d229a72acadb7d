"""Every attribution estimator's values against a fixture written by the code before the
estimator registry (``circuitkit/patching/estimators/attribution.py`` at main 0ca20da).

The fixture was written on another machine: float32 results differ between CPUs (vector widths,
fused multiply-adds, SLEEF kernels; FIELD-NOTES measured <= 2.4e-7 on an AVX-512 EPYC), so the
values are compared within a tolerance fitted to float32 (``close``), not bit for bit. The
tolerance is far below any change of formula: ``test_the_tolerance_can_fail`` checks that a
relative change of 1e-4 fails it.

The fixture ``tests/fixtures/estimator-values.safetensors`` holds, per case, ``values``,
``per_prompt`` (where the estimator has them), ``write_scale`` and the base/source metrics on
two tiny seeded models (GQA Llama, GPT-2). Rewrite it (only on purpose, from a known-good
tree) with ``python tests/test_estimator_values.py --write``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).parent / "fixtures" / "estimator-values.safetensors"

# (name, estimator, site, positions, direction, extra keyword arguments)
HEAD_CASES = [
    ("atp-z", "atp", "z", "all", "denoise", {}),
    ("atp-z-each-noise", "atp", "z", "each", "noise", {}),
    ("atp-v", "atp", "v", "all", "noise", {}),
    ("atp-pattern", "atp", "pattern", "all", "denoise", {}),
    ("block-z", "block", "z", "all", "noise", {}),
    ("block-z-each", "block", "z", "each", "denoise", {}),
    ("block-q", "block", "q", "all", "denoise", {}),
    ("block-pattern", "block", "pattern", "all", "noise", {}),
    ("qk-z", "qk", "z", "all", "noise", {}),
    ("qk-z-tail", None, "z", "all", "denoise", {"atp_star": True}),  # qk, the exact tail on
    ("qk-k-each", "qk", "k", "each", "noise", {}),
    ("atp_star-legacy", None, "z", "all", "noise", {"atp_star": True}),
    ("graddrop-z", "graddrop", "z", "all", "noise", {}),
    ("graddrop-q", "graddrop", "q", "all", "denoise", {}),
    ("atp*-z", "atp*", "z", "all", "noise", {}),
    ("atp*-q-each", "atp*", "q", "each", "denoise", {}),
    ("ig-z", "ig", "z", "all", "noise", {"ig_steps": 3}),
    ("ig-v-each", "ig", "v", "each", "denoise", {}),
]
EDGE_CASES = [
    ("eap", "eap", "denoise", {}),
    ("eap-noise", "eap", "noise", {}),
    ("eap-ig-inputs", "eap-ig-inputs", "denoise", {"ig_steps": 2}),
    ("eap-ig-activations", "eap-ig-activations", "noise", {"ig_steps": 2}),
    ("eap*", "eap*", "denoise", {}),
    ("eap*-noise", "eap*", "noise", {}),
]
MODELS = ("tiny_llama", "tiny_gpt2")


def prompts(model):
    """4 prompts of 8 tokens, 3 corrupted positions, and a metric reading a different position
    per prompt (so the read-position paths run)."""
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(1, model.cfg.d_vocab, (4, 8), generator=g)
    corrupt = clean.clone()
    corrupt[:, 1:4] = torch.randint(1, model.cfg.d_vocab, (4, 3), generator=g)
    pos = torch.tensor([7, 6, 7, 5])
    target = clean[torch.arange(4), pos]

    def metric(logits):
        return logits[torch.arange(4), pos].log_softmax(-1)[torch.arange(4), target]

    return clean, corrupt, metric


def head_values(model, case) -> dict[str, torch.Tensor]:
    import circuitkit as ck

    _, est, site, positions, direction, kw = case
    clean, corrupt, metric = prompts(model)
    res = ck.patch_heads(model, clean, corrupt, metric, direction=direction, site=site,
                         positions=positions, method="attribution",
                         options=dict(estimator=est, batch_size=2, progress=False, **kw))
    return _tensors(res)


def edge_values(model, case) -> dict[str, torch.Tensor]:
    import circuitkit as ck

    _, est, direction, kw = case
    clean, corrupt, metric = prompts(model)
    res = ck.patch_edges(model, clean, corrupt, metric, direction=direction, method="attribution",
                         options=dict(estimator=est, batch_size=2, progress=False, **kw))
    return _tensors(res)


def _tensors(res) -> dict[str, torch.Tensor]:
    scale = torch.tensor([float("nan") if v is None else v
                          for v in _flat(res.meta["write_scale"])], dtype=torch.float64)
    out = {"values": res.values, "clean": torch.as_tensor(res.clean),
           "corrupt": torch.as_tensor(res.corrupt), "write_scale": scale,
           "pass_equivalents": torch.tensor(float(res.meta["pass_equivalents"]),
                                            dtype=torch.float64)}
    for k in ("per_prompt", "clean_per_prompt", "corrupt_per_prompt"):
        if getattr(res, k) is not None:
            out[k] = getattr(res, k)
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def _flat(x):
    if isinstance(x, list):
        for v in x:
            yield from _flat(v)
    else:
        yield x


def all_cases():
    for m in MODELS:
        for case in HEAD_CASES:
            yield f"{m}/heads/{case[0]}", m, "heads", case
        for case in EDGE_CASES:
            yield f"{m}/edges/{case[0]}", m, "edges", case


def compute(model, kind, case):
    return head_values(model, case) if kind == "heads" else edge_values(model, case)


@pytest.fixture(scope="module")
def golden():
    from safetensors.torch import load_file

    return load_file(FIXTURE)


@pytest.mark.parametrize("key,model_name,kind,case", list(all_cases()),
                         ids=[c[0] for c in all_cases()])
def test_values_are_the_old_codes_to_float32_rounding(key, model_name, kind, case, golden,
                                                       request):
    model = request.getfixturevalue(model_name)
    got = compute(model, kind, case)
    want = {k.split(":", 1)[1]: v for k, v in golden.items() if k.split(":", 1)[0] == key}
    assert want, f"no fixture entry for {key}"
    assert sorted(got) == sorted(want), key
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, (key, name)
        assert close(g, w), (key, name, float((g - w).abs().nan_to_num().max()))


# The values are computed in float32 whatever dtype they are stored in (write scales and metrics
# are float64 copies of float32 numbers): 64 ulps of float32, relative to the tensor's scale.
# A sum over a few hundred terms reordered by another CPU's kernels stays well inside this.
F32_ULPS = 64 * torch.finfo(torch.float32).eps  # 7.6e-6


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal NaN masks (NaN marks no-edge cells) and, elsewhere, |got - want| <= F32_ULPS *
    max(1, max |want|): float32 rounding of values of that scale, not a change of formula."""
    if not torch.equal(got.isnan(), want.isnan()):
        return False
    g, w = got.double().nan_to_num(), want.double().nan_to_num()
    scale = max(1.0, float(w.abs().max())) if w.numel() else 1.0
    return bool(((g - w).abs() <= F32_ULPS * scale).all())


def test_the_tolerance_can_fail(golden):
    """The comparison is not vacuous: a relative change of 1e-4 anywhere, or a NaN moved, fails."""
    values = [v for k, v in golden.items() if k.endswith(":values") and v.isfinite().any()]
    assert values
    for w in values[:8]:
        assert close(w.clone(), w)
        bumped = w.clone()
        i = int(w.nan_to_num().abs().flatten().argmax())
        bumped.view(-1)[i] = bumped.view(-1)[i] * (1 + 1e-4) + 1e-4
        assert not close(bumped, w)
        nan_moved = w.clone()
        nan_moved.view(-1)[i] = float("nan")
        assert not close(nan_moved, w)


if __name__ == "__main__" and "--write" in sys.argv:
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).parent))
    from safetensors.torch import save_file
    from tinymodels import TINY_GPT2, TINY_LLAMA, make_model

    models = {"tiny_llama": make_model(TINY_LLAMA), "tiny_gpt2": make_model(TINY_GPT2)}
    out = {}
    for key, m, kind, case in all_cases():
        for name, t in compute(models[m], kind, case).items():
            out[f"{key}:{name}"] = t
        print(key, flush=True)
    FIXTURE.parent.mkdir(exist_ok=True)
    save_file(out, FIXTURE)
    print(f"wrote {len(out)} tensors to {FIXTURE}")
