"""Files the project writes itself (state, config it hands a service, keys, models it
builds): a crash leaves the old file or the new one, never half of one, and a link planted
at the path or beside it is never written through.

``write_atomic`` replaces whatever is at the path (a planted link is replaced, not followed);
``write_new`` makes a file that must not exist yet (a signing key, a secret), whole or not
at all, and leaves whatever is there alone.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

__all__ = ["sync_folder", "write_atomic", "write_new", "write_temporary"]

_NAME_TRIES = 16


def _token() -> str:
    return secrets.token_hex(8)


def write_atomic(path: Path, data: str | bytes, mode: int = 0o666) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, rename it over ``path``
    and fsync the folder (the worker's applied command ids, registry checkpoints, last
    verified views, secret files). ``mode`` is the new file's from its first byte (less
    the umask). A rename that fails (``path`` is a folder) removes the temporary file: its
    random name is never drawn again, so nothing else would."""
    tmp = write_temporary(path, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


def write_new(path: Path, data: str | bytes, mode: int = 0o666) -> None:
    """Make ``path`` holding ``data``, fsynced, whole or not at all: ``FileExistsError`` when
    anything (a file, a link, a concurrent maker's file) is there, which is left as it is."""
    tmp = write_temporary(path, data, mode)
    try:
        os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
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
