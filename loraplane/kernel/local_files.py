"""Reading a local file that a component re-reads while it runs (keyring, API keys,
schedules, its own small state files), whatever has been put at its path.

A plain ``read_text`` blocks forever on a FIFO without a writer and reads a link to
``/dev/zero`` until memory runs out; a reader that polls its file (every 0.2 s for the
keyring) would hang or die. ``read_regular`` opens without blocking, refuses anything but a
regular file, and reads at most ``max_bytes`` + 1 bytes, refusing a longer file rather than
handing back a prefix of it. Every refusal is an ``OSError``, which these readers already
treat as "the file is unusable now". A private file (a signing key, a secret) is also
refused when group or others may read it (``TooOpen``), checked on the file it reads, not
on the path before opening it.

``open_regular`` is the same open for a reader or writer that streams the file itself (a
spool segment, a trace): the descriptor of a regular file, or an ``OSError``, never a wait.
``read_json`` reads a JSON file strictly (``schemas.strict_json``): a hostile one is one
``ValueError`` naming it. ``locked_folder`` is the one-writer rule for a folder of local
state (journal, spool, host tier): an ``flock`` the kernel drops when its process dies.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import IO, Any

__all__ = [
    "MAX_JSON_BYTES",
    "TooOpen",
    "locked_folder",
    "open_regular",
    "read_json",
    "read_regular",
]

MAX_JSON_BYTES = 64 * 1024 * 1024
"""The most ``read_json`` reads unless told less."""


class TooOpen(PermissionError):
    """A private file that group or others may read; ``strerror`` says the fix."""


def read_regular(
    path: Path | str,
    max_bytes: int,
    *,
    follow_links: bool = True,
    dir_fd: int | None = None,
    private: bool = False,
) -> bytes:
    """The bytes of the regular file at ``path`` (relative to the folder ``dir_fd`` when
    given); OSError when it cannot be read, is no regular file, holds more than
    ``max_bytes``, or is a link and ``follow_links`` is False (a folder whose files are
    trusted only as they are, such as a host-tier entry, never follows one). ``private``:
    ``TooOpen`` when the file read lets group or others read it."""
    fd = open_regular(path, follow_links=follow_links, dir_fd=dir_fd)
    try:
        found = os.fstat(fd)
        mode = found.st_mode
        if found.st_size > max_bytes:  # refused unread; one that grows is cut by the read below
            raise OSError(errno.EFBIG, f"over {max_bytes} bytes", str(path))
        if private and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise TooOpen(
                errno.EACCES,
                f"mode {stat.filemode(mode)} lets others read it; run `chmod 600 {path}`",
            )
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    if left <= 0:
        raise OSError(errno.EFBIG, f"over {max_bytes} bytes", str(path))
    return b"".join(chunks)


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES, max_depth: int = 64) -> Any:
    """The one strict JSON value in the regular file ``path`` (at most ``max_bytes``, nested
    at most ``max_depth``); ``ValueError`` naming ``path`` for anything else."""
    from loraplane.schemas.strict_json import strict_loads

    try:
        raw = read_regular(path, max_bytes)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    try:
        return strict_loads(raw, max_bytes=max_bytes, max_depth=max_depth)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def open_regular(
    path: Path | str,
    flags: int = os.O_RDONLY,
    *,
    follow_links: bool = True,
    dir_fd: int | None = None,
    mode: int = 0o666,
) -> int:
    """A descriptor of the regular file at ``path`` opened with ``flags`` (``O_CREAT``
    makes it with ``mode``); OSError when it is anything else, or a link and
    ``follow_links`` is False. Opened with ``O_NONBLOCK``, which a FIFO with no peer
    answers at once (ENXIO for a writer) and a regular file ignores, then checked with
    ``fstat`` on what was opened, so no swap after a check can slip a FIFO in."""
    flags |= os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    fd = os.open(path, flags, mode, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def locked_folder(directory: Path, unavailable: type[Exception]) -> IO[str]:
    """``directory`` (made 0700 when missing), locked with ``flock`` for this process until
    the returned lock file is closed; ``unavailable`` when another process holds it or it
    cannot be made. One writer per folder: a second process must not interleave."""
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        # a FIFO or a link at the path is refused, not waited on
        fd = open_regular(
            directory / ".lock",
            os.O_WRONLY | os.O_CREAT | os.O_APPEND,
            follow_links=False,
            mode=0o600,
        )
    except OSError as exc:
        raise unavailable(f"{directory}: {exc}") from None
    lock = os.fdopen(fd, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        lock.close()
        why = "is in use by another process" if isinstance(exc, BlockingIOError) else exc
        raise unavailable(f"{directory} {why}") from None
    return lock
