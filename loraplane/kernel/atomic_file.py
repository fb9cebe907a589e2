"""Replacing a small state file so that a crash leaves the old or the new one, never half."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

__all__ = ["sync_folder", "write_atomic", "write_temporary"]

_NAME_TRIES = 16


def _token() -> str:
    return secrets.token_hex(8)


def write_atomic(path: Path, data: str | bytes, mode: int = 0o666) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, rename it over ``path``
    and fsync the folder (the worker's applied command ids, registry checkpoints, last
    verified views, secret files). ``mode`` is the new file's from its first byte (less
    the umask)."""
    os.replace(write_temporary(path, data, mode), path)
    sync_folder(path.parent)


def write_temporary(path: Path, data: str | bytes, mode: int = 0o666) -> Path:
    """A new file beside ``path`` holding ``data``, fsynced, for the caller to move into
    place. Its name is random per call (``.<name>.<random>.tmp``), so two threads or
    processes writing the same ``path`` at once never share a temporary file, and made with
    O_EXCL and O_NOFOLLOW, so whatever already sits at a name (a planted link) is never
    written through: another name is drawn. A failed write (a full disk) removes it: the
    half-written file would hold on to the very space that ran out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_NAME_TRIES):
        tmp = path.with_name(f".{path.name}.{_token()}.tmp")
        try:
            fd = os.open(tmp, flags, mode)
        except FileExistsError:
            continue
        break
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name beside it", str(path))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def sync_folder(folder: Path) -> None:
    """fsync ``folder``, so a rename or link in it outlives a host crash."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
