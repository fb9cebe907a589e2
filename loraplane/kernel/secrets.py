"""Local service credentials: random secrets in mode-0600 files, made once, never logged.

The stack (``loraplane stack up``) and ``loraplane vllm serve`` create them; every client
reads them from the same files when it connects, so a rotated file takes effect on the next
connection. A file others can read is refused: a secret that leaked is not a secret.

Every secret file is made whole or not at all (a temporary file, fsynced, then linked or
renamed into place), so a kill -9 of ``stack up`` leaves no empty secret behind; an empty
one an older version left is made again (nothing can have used it).
"""

from __future__ import annotations

import contextlib
import secrets
import stat
from pathlib import Path

from loraplane.kernel.atomic_file import write_atomic, write_new
from loraplane.kernel.local_files import TooOpen, read_regular

__all__ = [
    "MAX_SECRET_BYTES",
    "SecretError",
    "ensure_secret",
    "install_private",
    "make_secret",
    "read_secret",
    "secret_key",
    "write_private",
]


class SecretError(RuntimeError):
    """A secret file is missing, empty or readable by others; the message says what to do."""


def make_secret(path: Path, nbytes: int = 24) -> None:
    """Make ``path`` a new random secret (URL-safe, mode 0600, folder 0700) when it is
    missing or an empty regular file, whole or not at all; a concurrent maker's is kept."""
    try:
        found = path.lstat()
    except FileNotFoundError:
        empty = False
    else:
        if found.st_size or not stat.S_ISREG(found.st_mode):
            return  # a secret, or what its reader refuses with a message
        empty = True
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    secret = secrets.token_urlsafe(nbytes)
    if empty:
        write_atomic(path, secret, mode=0o600)
        return
    with contextlib.suppress(FileExistsError):  # a concurrent caller made it first: theirs stays
        write_new(path, secret, mode=0o600)


def ensure_secret(path: Path, nbytes: int = 24) -> str:
    """The secret in ``path``, made (``make_secret``) when the file is missing or empty."""
    make_secret(path, nbytes)
    return read_secret(path)


def write_private(path: Path, text: str | bytes) -> None:
    """Write ``text`` readable by its owner only, from the first byte on (no window in
    which the file exists with the umask's mode); replaces what was there, whole (a kill
    leaves the old file or the new one)."""
    write_atomic(path, text, mode=0o600)


MAX_SECRET_BYTES = 64 * 1024
"""A secret file holds a password or a key of a few dozen bytes."""


def _read_private(path: Path, hint: str) -> bytes:
    """The bytes of the private regular file at ``path`` (``read_regular``: never a FIFO's
    wait, an endless read, or a mode checked on another file than the one read)."""
    try:
        return read_regular(path, MAX_SECRET_BYTES, private=True)
    except FileNotFoundError:
        raise SecretError(f"{path}: secret file missing ({hint})") from None
    except TooOpen as exc:
        raise SecretError(f"{path}: must not be readable by others ({exc.strerror})") from None
    except OSError as exc:
        raise SecretError(f"{path}: {exc.strerror or type(exc).__name__}") from None


def secret_key(path: Path, min_bytes: int = 16) -> bytes:
    """An HMAC key file's bytes (the gateway's cache-salt secret, the router secret), made
    like ``ensure_secret`` when missing; any bytes an operator wrote are kept as they are.
    SecretError when it is readable by others or shorter than ``min_bytes``."""
    try:
        make_secret(path, 32)
    except OSError as exc:
        raise SecretError(f"{path}: {exc.strerror or type(exc).__name__}") from None
    key = _read_private(path, "it is made when missing")
    if len(key) < min_bytes:
        raise SecretError(f"{path}: must be at least {min_bytes} bytes")
    return key


def read_secret(path: Path, hint: str = "run `loraplane stack up`") -> str:
    """The secret in ``path`` (stripped); SecretError when it is absent, not private or not
    UTF-8 text (the message never quotes a byte of it)."""
    try:
        value = _read_private(path, hint).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise SecretError(f"{path}: secret file is not UTF-8 text") from None
    if not value:
        raise SecretError(f"{path}: secret file is empty ({hint})")
    return value


def install_private(source: Path, target: Path) -> list[Path]:
    """Copy every secret file under ``source`` to the same relative path under ``target``,
    each readable by its owner only (folders 0700); returns the paths written.

    For a Kubernetes Secret volume, whose files are links into a ``..data`` folder and
    readable by the pod's group (``fsGroup``), which ``read_secret`` refuses: the copies, on
    a memory-backed emptyDir, are the files the runtimes read. Entries whose names start
    with ``..`` (the volume's own bookkeeping) are skipped, and so is a link that leads out
    of ``source`` or to anything but a file or folder."""
    root = source.resolve()
    if not root.is_dir():
        raise SecretError(f"{source}: not a folder of secret files")
    written: list[Path] = []

    def walk(folder: Path, rel: Path) -> None:
        for entry in sorted(folder.iterdir()):
            if entry.name.startswith(".."):
                continue
            real = entry.resolve()
            if not real.is_relative_to(root):
                continue
            if real.is_dir():
                walk(real, rel / entry.name)
            elif real.is_file():
                dest = target / rel / entry.name
                dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                try:
                    data = read_regular(real, MAX_SECRET_BYTES)
                except OSError as exc:
                    raise SecretError(f"{entry}: {exc.strerror or exc}") from None
                write_private(dest, data)
                written.append(dest)

    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    walk(root, Path())
    return written
