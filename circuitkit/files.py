"""Durable file writes: the one atomic-write helper every durable write in circuitkit uses.

``atomic_write(path, write)`` calls ``write(tmp_path)``, fsyncs the file, renames it over
``path`` and fsyncs the folder: a crash (SIGKILL included) leaves either the old state or the
complete new file, never a partial one under the final name. The file gets the mode a plain
``open(path, "w")`` would give (``0o666 & ~umask``): some writers (``safetensors.save_file``)
create files ``0600``, which would leave result files unreadable to a group that can read the
JSON beside them.

This module imports nothing heavy.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` then fsync, chmod to ``0o666 & ~umask``, rename over ``path``, fsync the
    folder. Returns ``path``. The temporary file is removed if ``write`` raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def write_json(path: str | Path, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=1, default=str))


def write_tensors(path: str | Path, tensors: dict[str, Any],
                  metadata: dict[str, str] | None = None) -> Path:
    """``safetensors`` file of ``tensors`` (contiguous CPU copies), written atomically."""
    from safetensors.torch import save_file

    flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    return atomic_write(path, lambda p: save_file(flat, str(p), metadata=metadata))


def check_writable_dir(path: str | Path, what: str = "--out") -> Path:
    """Create ``path`` (a folder) if needed and prove a file can be written there, *before*
    any work whose result would go there. Raises ``ValueError`` with one actionable line."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is an existing file, not a folder; choose a folder path.")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{what} {path} is not writable ({e.strerror}); choose a folder you "
                         "can write to.") from None
    return path


def check_writable_file(path: str | Path, what: str = "--out", example: str = "out") -> Path:
    """``path`` names a file we can write (its folder made if needed): a folder there, or an
    unwritable folder, is refused before any work. Raises ``ValueError`` with one line."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; give a file path, e.g. {path / example}.")
    check_writable_dir(path.parent if str(path.parent) else Path("."), f"{what} folder")
    return path


def _move_file(src: Path, dest: Path) -> None:
    """``src`` -> ``dest`` through ``atomic_write``: fsynced, mode ``0o666 & ~umask``
    (``safetensors`` writes ``0600``), renamed into place. Same file system: no copy."""
    atomic_write(dest, lambda tmp: os.replace(src, tmp))


def write_folder(out: Path, write: Callable[[Path], Any]) -> Path:
    """``write(staging)`` fills a fresh folder beside ``out``; every file is made durable with
    ``atomic_write`` (umask mode), then the folder is renamed to ``out`` (an old ``out`` is
    removed first). A crash never leaves a half-written folder under the name ``out``."""
    out = Path(out)
    stage = out.with_name(f".{out.name}.{os.getpid()}.partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        write(stage)
        for f in sorted(stage.rglob("*")):
            if f.is_file():
                _move_file(f, f)
        if out.exists():
            shutil.rmtree(out)
        stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    return out


def write_files_into(out: Path, write: Callable[[Path], Any]) -> Path:
    """``write(staging)`` fills a staging folder inside ``out``; each of its files then replaces
    ``out/<name>`` through ``atomic_write`` (umask mode, fsync, atomic rename). For a
    folder that holds other state (a training run's checkpoint), which cannot be renamed whole."""
    out = Path(out)
    stage = out / f".staging.{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        write(stage)
        for f in sorted(stage.iterdir()):
            if not f.is_file():
                raise ValueError(f"write_files_into: {f} is not a file; only flat folders.")
            _move_file(f, out / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out
