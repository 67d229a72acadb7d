"""Resumable sweeps: a checkpoint folder that proves, before reuse, that it is the same sweep.

Layout: ``header.json`` (format version, the sweep's identity, its chunk plan) and one
``chunk_{i:06d}.safetensors`` per finished chunk, written atomically the moment it completes.

* **Identity** (``sweep_identity``): what was patched (kind, site, direction, positions), the
  tokens (hash), the model (fingerprint of its shape and weights) and the metric *by behaviour*
  (``PromptMetric.fingerprint``: its values on seeded random logits), not by name. A resume
  under anything else is refused with the differing fields.
* **Integrity**: each chunk file carries, in its safetensors metadata, the identity key, its chunk
  id and plan entry, and a SHA-256 of its values. A file that is unreadable, of another sweep,
  of another chunk (two files swapped), of the wrong shape, or whose values changed, is reported
  by name (a warning), deleted and recomputed.
* **Lock**: one process per rank works in a folder at a time (``files.lock_folder`` on
  ``lock.rank<r>``); a second one is told the folder is in use, and by which pid.

Several ranks can share a folder: chunk files never collide and only rank 0 writes the header.

``attribution+exact`` keeps its own files in the same kind of folder (``HybridCheckpoint``):
``hybrid.json`` (identity), ``hybrid-screen.*`` (the screen, a ``PatchResult`` or
``EdgeResult``) and ``hybrid-cells.safetensors`` (every verified cell's per-prompt exact values,
rewritten atomically after each verification forward, with the identity key and a checksum).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuitkit import files, hooks
from circuitkit.metrics import PromptMetric
from circuitkit.patching.sweep import Chunk, Sweep

FORMAT_VERSION = 2


def tokens_hash(*tokens: Tensor) -> str:
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
    """Hash of the shape facts and every parameter's name, shape, dtype, an
    evenly strided sample of ``FINGERPRINT_SAMPLE`` values and the integer sums of its bit
    patterns over each row and each column (``_bit_sums``). Every parameter: a fine-tune, a
    merged LoRA or an edit of one layer's weights changes it (the first and last parameter
    alone let a checkpoint of another model resume); every row and column: a strided sample of
    a large matrix sees a few of its columns only (70B's ``W_O``: head 0), so a head ablated by
    zeroing its slice would resume the unablated model's checkpoint. Exact values and integer
    sums, no float sums: a float reduction's rounding could differ between thread counts or
    ranks. One transfer per device."""
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


def sweep_identity(model: Any, sweep: Sweep, clean: Tensor, corrupt: Tensor,
                   metric: PromptMetric, **extra: Any) -> dict[str, Any]:
    """Everything a resumed sweep must share with the one that wrote the checkpoint, and
    ``extra`` (an edge sweep's layout, a hybrid's method and estimator)."""
    f = hooks.facts(model)
    out = dict(format=FORMAT_VERSION, kind=sweep.kind, site=sweep.site,
               direction=sweep.direction, positions=sweep.positions,
               tokens=tokens_hash(clean, corrupt), model=model_fingerprint(model),
               metric=metric.name,
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
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def default_dir(identity: dict[str, Any]) -> Path:
    """Where an interrupted sweep without a checkpoint folder saves what it finished."""
    from circuitkit.models import CACHE_DIR

    return (CACHE_DIR / "checkpoints"
            / f"patch-{identity['site']}-{identity['direction']}-{identity_key(identity)[:12]}")


def _values_digest(values: Tensor) -> str:
    return hashlib.sha256(values.contiguous().numpy().tobytes()).hexdigest()


class SweepCheckpoint:
    """An open checkpoint folder (``SweepCheckpoint.open``); see the module docstring."""

    HEADER = "header.json"

    @classmethod
    def stored_chunks(cls, path: str | Path) -> tuple[Chunk, ...] | None:
        """The chunk plan a folder's header already fixes (a resume), or None (no header yet).
        Read before ``open`` so a sweep does not re-plan what a checkpoint has fixed;
        ``open`` still checks the identity."""
        header = Path(path) / cls.HEADER
        if not header.exists():
            return None
        return tuple(Chunk(*c) for c in _read_header(header)["chunks"])

    def __init__(self, path: Path, identity: dict, chunks: tuple[Chunk, ...], lock: Any):
        self.path, self.identity, self.chunks = path, identity, chunks
        self.key = identity_key(identity)
        self._lock = lock

    @classmethod
    def open(cls, path: str | Path, identity: dict, chunks: tuple[Chunk, ...], rank: int = 0,
             world: int = 1) -> SweepCheckpoint:
        """Open (or create) ``path`` for this sweep; the stored chunk plan wins on resume."""
        from circuitkit.patching import distributed as dist

        path = _folder(path)
        header = path / cls.HEADER
        if rank == 0 and not header.exists():
            files.check_writable_dir(path, "checkpoint folder")
            files.write_json(header, dict(identity=identity, chunks=[list(c) for c in chunks]))
        if world > 1:
            dist.barrier()
        stored, lock = _locked(path, header, (), identity, rank, world, "sweep", "this one")
        return cls(path, identity, tuple(Chunk(*c) for c in stored["chunks"]), lock)

    def close(self) -> None:
        self._lock.close()

    def _file(self, cid: int) -> Path:
        return self.path / f"chunk_{cid:06d}.safetensors"

    def save_chunk(self, cid: int, values: Tensor) -> None:
        values = values.detach().float().cpu().contiguous()
        files.write_tensors(self._file(cid), {"values": values}, metadata=dict(
            sweep=self.key, chunk=str(cid), plan=json.dumps(list(self.chunks[cid])),
            sha256=_values_digest(values)))

    def load_done(self) -> dict[int, Tensor]:
        """Verified chunk results; every bad file is named in a warning, deleted, and left to be
        recomputed."""
        from safetensors import safe_open

        done = {}
        for cid, chunk in enumerate(self.chunks):
            p = self._file(cid)
            if not p.exists():
                continue
            try:
                with safe_open(str(p), "pt") as f:
                    meta, values = f.metadata() or {}, f.get_tensor("values")
                problem = _chunk_problem(meta, values, self.key, cid, chunk)
            except Exception as e:  # noqa: BLE001 - any unreadable file is recomputed
                problem = f"unreadable ({type(e).__name__}: {e})"
            if problem:
                warnings.warn(f"circuitkit: checkpoint chunk {p} is {problem}; recomputing it.",
                              stacklevel=2)
                p.unlink(missing_ok=True)
                continue
            done[cid] = values
        return done


def _screen_digest(res: Any) -> str:
    """SHA-256 of a screen's tensors and the meta the rule reads (write scales, cost)."""
    h = hashlib.sha256()
    for t in (res.values, res.per_prompt, res.clean_per_prompt, res.corrupt_per_prompt):
        if t is not None:
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    h.update(json.dumps([res.clean, res.corrupt, res.meta.get("write_scale"),
                         res.meta.get("pass_equivalents")], default=str).encode())
    return h.hexdigest()


def _chunk_problem(meta: dict, values: Tensor, key: str, cid: int, chunk: Chunk) -> str:
    if meta.get("sweep") != key:
        return "from another sweep"
    if meta.get("chunk") != str(cid) or meta.get("plan") != json.dumps(list(chunk)):
        return f"chunk {meta.get('chunk')}'s file under chunk {cid}'s name"
    want = (chunk.v1 - chunk.v0, chunk.p1 - chunk.p0)
    if tuple(values.shape) != want or values.dtype != torch.float32:
        return f"of shape {tuple(values.shape)} {values.dtype} (expected {want} float32)"
    if meta.get("sha256") != _values_digest(values):
        return "modified (its values do not match their checksum)"
    return ""


def _folder(path: str | Path) -> Path:
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"checkpoint {path} is a file, not a folder; pass a folder path.")
    return path


def _locked(path: Path, header: Path, keys: tuple[str, ...], identity: dict, rank: int,
            world: int, what: str, delete: str) -> tuple[dict, files.FolderLock]:
    """The stored ``header`` (holding ``keys``) and this rank's lock of the folder, once its
    identity is this run's (else one line naming the differing fields; the lock let go)."""
    lock = _take_lock(path, rank, world)
    try:
        stored = _read_header(header, *keys)
        if stored["identity"] != identity:
            diff = identity_diff(stored["identity"], identity)
            raise IdentityMismatch(
                f"checkpoint {path} belongs to a different {what}; differing fields (stored, "
                f"now): {diff}. Use a new checkpoint folder, or delete {delete} to start "
                "over.", diff)
        return stored, lock
    except BaseException:
        lock.close()
        raise


def _read_header(header: Path, *keys: str) -> dict:
    keys = keys or ("identity", "chunks")
    try:
        stored = json.loads(header.read_text())
        if not isinstance(stored.get("identity"), dict) or not all(
                isinstance(stored.get(k), dict | list) for k in keys):
            raise ValueError(f"missing {' or '.join(repr(k) for k in keys)}")
        return stored
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"checkpoint header {header} is unreadable ({e}); delete the folder "
                         f"{header.parent} to start the sweep over.") from None


def _take_lock(path: Path, rank: int, world: int = 1) -> files.FolderLock:
    """Rank ``rank``'s lock of a checkpoint folder (``files.lock_folder`` on ``lock.rank<r>``);
    a lone process also removes the temporaries dead writers left (ranks may run on other
    hosts, whose pids cannot be checked from here)."""
    return files.lock_folder(path, "checkpoint folder", f"lock.rank{rank}", clean=world == 1)


class HybridCheckpoint:
    """An ``attribution+exact`` run's folder: its screen and its verified cells (module
    docstring). A resumed run loads both and replays its budget rule, which picks the same
    cells from the same numbers, so only cells it never finished are computed."""

    IDENTITY, SCREEN, CELLS = "hybrid.json", "hybrid-screen", "hybrid-cells.safetensors"

    def __init__(self, path: Path, identity: dict, lock: Any):
        self.path, self.identity, self.key, self._lock = path, identity, identity_key(
            identity), lock

    @classmethod
    def open(cls, path: str | Path, identity: dict) -> HybridCheckpoint:
        path = _folder(path)
        files.check_writable_dir(path, "checkpoint folder")
        stored = path / cls.IDENTITY
        if not stored.exists():
            files.write_json(stored, dict(identity=identity))
        _, lock = _locked(path, stored, ("identity",), identity, 0, 1, "attribution+exact run",
                          f"{stored.name} and the hybrid-* files there")
        return cls(path, identity, lock)

    def close(self) -> None:
        self._lock.close()

    def load_screen(self, result_type: Any = None) -> Any:
        """The stored screening estimate (a ``result_type``: ``PatchResult`` unless given, or
        ``EdgeResult``), or None (none yet, or unreadable: warned)."""
        from circuitkit.patching.results.patch_result import PatchResult

        if not (self.path / f"{self.SCREEN}.json").exists():
            return None
        from circuitkit.patching.results.files import UncheckedResultWarning

        try:
            with warnings.catch_warnings():  # (an older screen file: its checksum below binds it)
                warnings.simplefilter("ignore", UncheckedResultWarning)
                res = (result_type or PatchResult).load(self.path / self.SCREEN)
            if res.meta.get("checkpoint_key") != self.key:
                raise ValueError("from another run")
            missing = [k for k in ("write_scale", "pass_equivalents", "estimator", "seconds")
                       if k not in res.meta]
            if missing:
                raise ValueError(f"its meta lacks {missing}")
            if res.meta.get("checkpoint_sha256") != _screen_digest(res):
                raise ValueError("modified: its values do not match their checksum")
            return replace(res, meta={k: v for k, v in res.meta.items()
                                      if k not in ("checkpoint_key", "checkpoint_sha256")})
        except ValueError as e:
            warnings.warn(f"circuitkit: checkpoint screen {self.path / self.SCREEN} is not "
                          f"usable ({e}); screening again.", stacklevel=2)
            return None

    def save_screen(self, res: Any) -> None:
        replace(res, meta=dict(res.meta, checkpoint_key=self.key,
                               checkpoint_sha256=_screen_digest(res))).save(
            self.path / self.SCREEN, views=False)

    def load_cells(self, n_cells: int, n_prompts: int) -> dict[int, Tensor]:
        """``cell -> [n_prompts]`` exact values stored so far ({} when none or unusable)."""
        from safetensors import safe_open

        p = self.path / self.CELLS
        if not p.exists():
            return {}
        try:
            with safe_open(str(p), "pt") as f:
                meta, cells, exact = f.metadata() or {}, f.get_tensor("cells"), f.get_tensor(
                    "exact")
            problem = ("from another run" if meta.get("run") != self.key else
                       "modified (its values do not match their checksum)"
                       if meta.get("sha256") != _values_digest(exact) else
                       f"of shape {tuple(exact.shape)}" if exact.shape != (len(cells), n_prompts)
                       or bool((cells < 0).any() | (cells >= n_cells).any()) else "")
        except Exception as e:  # noqa: BLE001 - any unreadable file is recomputed
            problem = f"unreadable ({type(e).__name__}: {e})"
        if problem:
            warnings.warn(f"circuitkit: checkpoint file {p} is {problem}; verifying its cells "
                          "again.", stacklevel=2)
            return {}
        return {int(c): exact[i] for i, c in enumerate(cells.tolist())}

    def save_cells(self, done: dict[int, Tensor]) -> None:
        if not done:
            return
        cells = torch.tensor(sorted(done), dtype=torch.long)
        exact = torch.stack([done[int(c)] for c in cells]).float().contiguous()
        files.write_tensors(self.path / self.CELLS, {"cells": cells, "exact": exact},
                            metadata=dict(run=self.key, sha256=_values_digest(exact)))
