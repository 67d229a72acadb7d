"""What a run is, by content: one model fingerprint and the run identity helpers every stored
artefact checks before reuse (a checkpoint folder, the teacher-signal store, a result file's
``meta``, a validation or characterize run's folder).

* ``model_fingerprint``: THE hash of a model (its shape facts and every parameter's name,
  shape, dtype, a strided sample of its values and the integer sums of its bit patterns per
  row and column). Checkpoints (``sweep_identity``), result files (``meta["model_fingerprint"]``)
  and the signal store (``teacher_fingerprint``) all store this one.
* ``same_weights``: whether two models (a ``TransformerBridge`` and a plain HF model, say) hold
  the same parameters, compared exactly (names as ``models.plain_parameters`` gives them).
* ``tokens_hash``: the prompts; ``sweep_identity``: everything a resumed sweep must share;
  ``identity_key``: one short hash of an identity; ``identity_diff`` / ``IdentityMismatch``:
  the fields in which a stored identity differs from this run's (what a refusal names).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import Tensor

from circuitkit import hooks

SWEEP_FORMAT = 2  # a sweep identity's "format" (``checkpoint.FORMAT_VERSION``)


def tokens_hash(*tokens: Tensor) -> str:
    """sha256 (16 hex) of each token tensor's shape and values (as int64): the prompts a run
    read."""
    h = hashlib.sha256()
    for t in tokens:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().long().numpy().tobytes())
    return h.hexdigest()[:16]


FINGERPRINT_SAMPLE = 4096  # values per parameter
_INT_OF = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width views
_SUM_BLOCK = 1 << 22  # elements per integer block (bounds the int64 copy's memory)


def _bit_sums(p: Tensor) -> Tensor:
    """Row and column sums of a parameter's bit patterns (as integers, in int64, wrapping):
    ``[rows + cols]`` for ``p`` viewed as ``[p.shape[0], -1]``, ``[1]`` for a vector. Integer
    addition is associative, so the sums are exact whatever the device, thread count or order,
    and every row and column (an attention head's slice of ``W_O``, an MLP neuron) counts."""
    flat = p.detach().contiguous()
    bits = flat.view(_INT_OF[flat.element_size()]) if flat.is_floating_point() else flat
    if bits.ndim < 2:
        return bits.reshape(-1).to(torch.int64).sum().reshape(1)
    bits = bits.reshape(bits.shape[0], -1)
    rows, cols = bits.shape
    step = max(1, _SUM_BLOCK // max(cols, 1))
    row_sums, col_sums = [], torch.zeros(cols, dtype=torch.int64, device=bits.device)
    for r0 in range(0, rows, step):
        block = bits[r0:r0 + step].to(torch.int64)
        row_sums.append(block.sum(1))
        col_sums += block.sum(0)
    return torch.cat([*row_sums, col_sums])


def model_fingerprint(model: Any) -> str:
    """Hash of the shape facts and every parameter's name, shape, dtype, an evenly strided sample of
    ``FINGERPRINT_SAMPLE`` values and the integer sums of its bit patterns over each row and each
    column (``_bit_sums``). Every parameter: a fine-tune, a merged LoRA or an edit of one layer's
    weights changes it (the first and last parameter alone let a checkpoint of another model
    resume); every row and column: a strided sample of a large matrix sees a few of its columns only
    (70B's ``W_O``: head 0), so a head ablated by zeroing its slice would resume the unablated
    model's checkpoint. Exact values and integer sums, no float sums: a float reduction's rounding
    could differ between thread counts or ranks. One transfer per device."""
    # no name: the same weights loaded from another path (or cwd) are the same model
    h = hashlib.sha256(json.dumps(hooks.facts(model).to_dict(), sort_keys=True).encode())
    samples: list[Tensor] = []
    sums: list[Tensor] = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // FINGERPRINT_SAMPLE)
            samples.append(flat[::step][:FINGERPRINT_SAMPLE].float())
            sums.append(_bit_sums(p))
        for group in (samples, sums):
            on_cpu: list[Tensor | None] = [None] * len(group)
            for dev in {t.device for t in group}:  # placement-independent: order kept
                idx = [i for i, t in enumerate(group) if t.device == dev]
                for i, t in zip(idx, torch.cat([group[i] for i in idx]).cpu().split(
                        [group[i].numel() for i in idx]), strict=True):
                    on_cpu[i] = t
            for t in on_cpu:
                h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def same_weights(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` (a ``load_model`` result or a transformers model) hold the same
    parameters: the same names (``models.plain_parameters``: the HF names, a bridge's wrapper
    segments removed), shapes, dtypes and values, compared byte for byte, tensor by tensor (no hash:
    ``model_fingerprint`` reads a bridge's own names, which a plain HF model does not have)."""
    from circuitkit.models import plain_parameters

    pa, pb = plain_parameters(a), plain_parameters(b)
    return pa.keys() == pb.keys() and all(_same_tensor(x, pb[k]) for k, x in pa.items())


def _same_tensor(x: Tensor, y: Tensor) -> bool:
    """Same shape, dtype and bytes (bytes, not ``==``: a NaN weight equals itself)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    x, y = (t.detach().cpu().contiguous().reshape(-1) for t in (x, y))
    return torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.numel() else True


def sweep_identity(model: Any, sweep: Any, clean: Tensor, corrupt: Tensor, metric: Any,
                   **extra: Any) -> dict[str, Any]:
    """Everything a resumed sweep must share with the one that wrote the checkpoint, and
    ``extra`` (an edge sweep's layout, a hybrid's method and estimator)."""
    f = hooks.facts(model)
    out = dict(format=SWEEP_FORMAT, kind=sweep.kind, site=sweep.site, direction=sweep.direction,
               positions=sweep.positions, tokens=tokens_hash(clean, corrupt),
               model=model_fingerprint(model), metric=metric.name,
               metric_behaviour=metric.fingerprint(sweep.n_prompts, sweep.seq, f.d_vocab_out),
               split_prompts=sweep.split_prompts, prompt_order="by_length")
    if sweep.groups is not None:  # (absent otherwise: older checkpoints still resume)
        out["groups"] = sweep.groups.hash()
    return dict(out, **extra)


def identity_diff(stored: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``key -> (stored, now)`` for every field in which two identities differ (what a refused
    resume names)."""
    return {k: (stored.get(k), now.get(k)) for k in sorted(set(stored) | set(now))
            if stored.get(k) != now.get(k)}


class IdentityMismatch(ValueError):
    """A folder holding another run's work: ``differing`` names the fields (``identity_diff``),
    so a caller (the CLI) can say it in its own terms (its flags, ``--out``)."""

    def __init__(self, message: str, differing: dict[str, tuple[Any, Any]]):
        super().__init__(message)
        self.differing = differing


def identity_key(identity: dict[str, Any]) -> str:
    """sha256 (16 hex) of an identity as canonical JSON: what a checkpoint's files carry."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
