"""One identity: ``circuitkit.identity`` owns the one model fingerprint and the run identity
helpers that checkpoints, result files, the signal store and the experiments' folders store;
the names they had before (``patching.checkpoint``, ``distill.signals``) are the same objects."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import circuitkit
from circuitkit import identity


def test_one_fingerprint_and_one_home_for_the_identity_helpers():
    from circuitkit.distill import signals
    from circuitkit.patching import checkpoint

    for name in ("model_fingerprint", "tokens_hash", "identity_key", "identity_diff",
                 "sweep_identity", "IdentityMismatch", "FINGERPRINT_SAMPLE"):
        assert getattr(checkpoint, name) is getattr(identity, name), name
    assert signals.model_fingerprint is identity.model_fingerprint
    assert checkpoint.FORMAT_VERSION == identity.SWEEP_FORMAT == 2  # checkpoints still resume
    root = Path(circuitkit.__file__).parent
    defs = {name: [p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if re.search(rf"^def {name}\(", p.read_text(), re.M)]
            for name in ("model_fingerprint", "tokens_hash", "identity_key", "sweep_identity")}
    assert defs == {k: ["identity.py"] for k in defs}, defs


def test_same_weights_compares_a_bridge_with_a_plain_model(tiny_llama):
    from circuitkit.models import hf_model_of, plain_parameters

    hf = hf_model_of(tiny_llama)
    assert identity.same_weights(tiny_llama, hf) and identity.same_weights(hf, tiny_llama)
    w = next(iter(plain_parameters(hf).values()))
    before = w.detach().clone()
    try:
        with torch.no_grad():
            w.view(-1)[0] += 1.0
        assert not identity.same_weights(tiny_llama, _copy(hf, before))
    finally:
        with torch.no_grad():
            w.copy_(before)
    assert identity.same_weights(tiny_llama, _copy(hf, before))


def _copy(hf, first):
    """A fresh HF model of ``hf``'s config and weights, its first parameter ``first``."""
    from transformers import AutoModelForCausalLM

    from circuitkit.models import plain_parameters

    fresh = AutoModelForCausalLM.from_config(hf.config)
    state = {k: v.detach().clone() for k, v in plain_parameters(hf).items()}
    state[next(iter(state))] = first.clone()
    fresh.load_state_dict(state, strict=False)
    return fresh
