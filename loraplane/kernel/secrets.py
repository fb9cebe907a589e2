"""Local service credentials: random secrets in mode-0600 files, made once, never logged.

The stack (``loraplane stack up``) and ``loraplane vllm serve`` create them; every client
reads them from the same files when it connects, so a rotated file takes effect on the next
connection. A file others can read is refused: a secret that leaked is not a secret.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


class SecretError(RuntimeError):
    """A secret file is missing, empty or readable by others; the message says what to do."""


def ensure_secret(path: Path, nbytes: int = 24) -> str:
    """The secret in ``path``, made (random, URL-safe, mode 0600) when the file is missing."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # made by a concurrent caller: read theirs
            return read_secret(path)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(nbytes))
    return read_secret(path)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` readable by its owner only, from the first byte on (no window in
    which the file exists with the umask's mode); replaces what was there."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _private(path: Path, hint: str) -> None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise SecretError(f"{path}: secret file missing ({hint})") from None
    if mode & 0o077:
        raise SecretError(f"{path}: must not be readable by others (mode {oct(mode & 0o777)};"
                          " chmod 600)")


def secret_key(path: Path, min_bytes: int = 16) -> bytes:
    """An HMAC key file's bytes (the gateway's cache-salt secret, the router secret), made
    like ``ensure_secret`` when missing; any bytes an operator wrote are kept as they are.
    SecretError when it is readable by others or shorter than ``min_bytes``."""
    if not path.exists():
        ensure_secret(path, 32)
    _private(path, "it is made when missing")
    key = path.read_bytes()
    if len(key) < min_bytes:
        raise SecretError(f"{path}: must be at least {min_bytes} bytes")
    return key


def read_secret(path: Path, hint: str = "run `loraplane stack up`") -> str:
    """The secret in ``path`` (stripped); SecretError when it is absent or not private."""
    _private(path, hint)
    value = path.read_text().strip()
    if not value:
        raise SecretError(f"{path}: secret file is empty ({hint})")
    return value
