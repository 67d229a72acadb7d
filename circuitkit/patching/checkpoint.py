"""Resumable sweeps: a checkpoint folder that proves, before reuse, that it is the same sweep.

Layout: ``header.json`` (format version, the sweep's identity, its chunk plan) and one
``chunk_{i:06d}.safetensors`` per finished chunk, written atomically the moment it completes.

* **Identity** (``circuitkit.identity.sweep_identity``): what was patched (kind, site,
  direction, positions), the tokens (hash), the model (``identity.model_fingerprint``, the one
  fingerprint of its shape and weights) and the metric *by behaviour*
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

from circuitkit import files
from circuitkit.identity import (  # noqa: F401 (their home before circuitkit.identity)
    FINGERPRINT_SAMPLE,
    SWEEP_FORMAT,
    IdentityMismatch,
    identity_diff,
    identity_key,
    model_fingerprint,
    sweep_identity,
    tokens_hash,
)
from circuitkit.patching.sweep import Chunk

FORMAT_VERSION = SWEEP_FORMAT  # (its name here before: a sweep identity's "format")


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
