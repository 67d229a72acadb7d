"""Durable file writes and folder locks (docs/durability.md).

``atomic_write(path, write)``: the one atomic-write helper every durable write in circuitkit
uses (a crash leaves the old state or the complete new file, with the mode ``open`` would give;
a failure for want of space or permission is one-line ``WriteError``). ``lock_folder(path)``:
the one lock of a folder that a run writes. This module imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import errno as errno_
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOCK_NAME = ".circuitkit.lock"


class WriteError(OSError):
    """A durable write that failed (disk full, no permission): its message is one line naming
    the file and what to do. ``errno`` is the underlying error's."""

    def __str__(self) -> str:
        return str(self.strerror)


def _raise_write_error(e: BaseException, path: Path) -> None:
    """Raise ``e`` as a ``WriteError`` naming ``path`` when it is an I/O failure (an ``OSError``,
    or a ``SafetensorError`` wrapping one: safetensors reports ``No space left on device`` that
    way); return for anything else (a bug is not a disk problem: the caller re-raises it)."""
    if isinstance(e, WriteError):
        raise e from None
    if isinstance(e, OSError):
        code, reason = e.errno, e.strerror or str(e)
    elif type(e).__name__ == "SafetensorError" and ("I/O error" in str(e) or "os error" in str(e)
                                                     or "IoError" in str(e)):
        m = re.search(r"os error (\d+)|code: (\d+)", str(e))
        code = int(next(g for g in m.groups() if g)) if m else None
        reason = os.strerror(code) if code else str(e)
    else:
        return
    what = {errno_.ENOSPC: "free some space", errno_.EDQUOT: "free some space",
            errno_.EACCES: "make the folder writable", errno_.EROFS: "choose a writable folder",
            errno_.EPERM: "make the folder writable"}.get(code, "fix that")
    raise WriteError(code or errno_.EIO, f"could not write {path}: {reason}; {what} and rerun "
                     "the same command (files written completely are kept; nothing is left "
                     "half-written under its name).") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync(path: str | Path) -> None:
    """fsync a file or a folder."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` then fsync, chmod to ``0o666 & ~umask`` (some writers, such as
    ``safetensors.save_file``, create ``0600`` files a group reading the folder could not read),
    rename over ``path``, fsync the folder. Returns ``path``. The temporary file is removed if
    ``write`` raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        _fsync(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        _raise_write_error(e, path)
        raise
    _fsync(path.parent)
    return path


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def modified(path: str | Path, digest: Any) -> bool:
    """Whether ``path`` is a file whose bytes no longer have the SHA-256 ``digest`` recorded for
    it (a missing file is not "modified": each caller says in its own words that it is
    missing). The one check of a file against its recorded digest (``characterize``'s
    reusable steps, the report's ``read_summary``)."""
    path = Path(path)
    return path.is_file() and sha256_file(path) != digest


def read_json(path: str | Path, noun: str) -> Any:
    """The parsed JSON of ``path``; a file that cannot be read, or is not JSON (a truncated
    one), is one ``ValueError`` naming it: "PATH is not a readable NOUN (why)" or "PATH is not
    a readable NOUN: not valid JSON (truncated?) at line L column C" (``noun``: "result file",
    "circuit file", ...)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a readable {noun} ({e}).") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a readable {noun}: not valid JSON (truncated?) at line "
                         f"{e.lineno} column {e.colno}.") from None


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
    for p in (path, *path.parents):  # mkdir would say "File exists"
        if p.is_symlink() and not p.exists():
            raise ValueError(f"{what} {path}: {p} is a symbolic link to {os.readlink(p)}, which "
                             "does not exist; create that folder, remove the link, or choose "
                             "another path.")
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
        _staged(write, stage, out)
        for f in sorted(stage.rglob("*")):
            if f.is_file():
                _move_file(f, f)
        if out.exists():
            shutil.rmtree(out)
        stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _fsync(out.parent)
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
        _staged(write, stage, out)
        for f in sorted(stage.iterdir()):
            if not f.is_file():
                raise ValueError(f"write_files_into: {f} is not a file; only flat folders.")
            _move_file(f, out / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def _staged(write: Callable[[Path], Any], stage: Path, out: Path) -> None:
    """``write(stage)``, its I/O failures raised as a ``WriteError`` naming ``out``."""
    try:
        write(stage)
    except Exception as e:
        _raise_write_error(e, out)
        raise


# --- one lock per folder, and what dead writers left there ---------------------------------------

_HELD: dict[str, int] = {}  # lock file (real path) -> fd, for the locks this process holds
_TEMPORARY = re.compile(r"^\.(?:.+\.(\d+)\.(?:tmp|partial)|staging\.(\d+)|write-test\.(\d+))$")


class FolderLock:
    """A held ``lock_folder`` lock; ``close()`` (or leaving its ``with``) releases it."""

    def __init__(self, key: str | None):
        self.key = key

    def close(self) -> None:
        key, self.key = self.key, None
        fd = _HELD.pop(key, None) if key is not None else None
        if fd is not None:
            os.close(fd)  # closing releases the flock

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def lock_folder(path: str | Path, what: str = "folder", name: str = LOCK_NAME,
                clean: bool = True) -> FolderLock:
    """Hold ``path``'s lock (the file ``path/name``) until ``close()``. Another process holding it
    (or this one, through another ``lock_folder`` call: ``holds_lock`` tells): ``ValueError`` naming
    the folder and the holder's pid. A lock left by a process that died is free (``flock`` ends with
    its process) and taken over. Taking it removes the temporary files of dead writers in ``path``
    (``clean_temporaries``) unless ``clean=False``: a folder that processes on other hosts write too
    (torchrun ranks sharing a checkpoint), whose pids this host cannot see."""
    path = Path(path)
    lock_file = path / name
    key = os.path.realpath(lock_file)
    try:
        import fcntl
    except ImportError:  # no flock on this platform: no protection
        return FolderLock(None)
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = ""
        with contextlib.suppress(OSError):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise ValueError(f"{what} {path} is in use by another process (pid {holder or '?'}); wait "
                         f"for it to finish, or use another {what}.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD[key] = fd
    if clean:
        clean_temporaries(path)
    return FolderLock(key)


def holds_lock(path: str | Path, name: str = LOCK_NAME) -> bool:
    """Whether this process holds ``lock_folder(path)`` (``characterize`` writing its report
    under its own lock)."""
    return os.path.realpath(Path(path) / name) in _HELD


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # under our own lock, nothing of ours is being written now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_temporaries(folder: str | Path) -> list[str]:
    """Remove what writers that died left in ``folder`` (not below it): ``atomic_write``'s
    ``.NAME.PID.tmp``, ``write_folder``'s ``.NAME.PID.partial``, ``write_files_into``'s
    ``.staging.PID``, ``check_writable_dir``'s ``.write-test.PID``, when no process PID runs.
    Returns the names removed."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            m = _TEMPORARY.match(entry.name)
            if not m or _alive(int(next(g for g in m.groups() if g))):
                continue
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(entry.name)
    return removed
