"""Attack tests: the private files a component reads by path (a signing key, a service
secret, an HMAC key). Whatever sits at the path, the read ends in the reader's own error,
never hangs (a FIFO with no writer), never reads without end (a huge or endless file), is
checked for its mode on the very file it reads, and never puts a byte of the file into
its message (CI logs and dead letters are read by others)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from loraplane.kernel.kafka import KafkaAuthError, read_password
from loraplane.kernel.local_files import TooOpen, read_regular
from loraplane.kernel.secrets import SecretError, read_secret, secret_key
from loraplane.schemas.signing import KEY_FILE_FORMAT, KeyFileError, SigningKey

Plant = Callable[[Path], None]


def _private_bytes(data: bytes) -> Plant:
    def plant(path: Path) -> None:
        path.write_bytes(data)
        path.chmod(0o600)

    return plant


def _fifo(path: Path) -> None:
    os.mkfifo(path, 0o600)


def _huge(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate(512 * 1024 * 1024)  # sparse: no disk used
    path.chmod(0o600)


HOSTILE: dict[str, Plant] = {
    "fifo": _fifo,
    "endless-device": lambda p: p.symlink_to("/dev/zero"),
    "folder": lambda p: p.mkdir(mode=0o700),
    "huge": _huge,
}
SECRET_BYTE = b"\x9c"  # what a raw (DER, binary) key starts with, say: no UTF-8
SECRET_CHAR = "\u00e9"


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_key_file_that_is_no_bounded_regular_file_is_refused(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "ci.key"
    HOSTILE[kind](path)
    with pytest.raises(KeyFileError):
        SigningKey.load(path)


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_secret_that_is_no_bounded_regular_file_is_refused(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "secret"
    HOSTILE[kind](path)
    with pytest.raises(SecretError):
        read_secret(path)
    with pytest.raises(SecretError):
        secret_key(path)
    with pytest.raises(KafkaAuthError):
        read_password(path)


def _leaks(message: str) -> bool:
    return any(
        token in message for token in ("0x9c", "\\x9c", SECRET_CHAR, "\\xe9", "position", "codec")
    )


def test_a_key_file_of_raw_bytes_is_refused_without_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "raw.key"
    _private_bytes(SECRET_BYTE + os.urandom(31))(path)
    with pytest.raises(KeyFileError) as caught:
        SigningKey.load(path)
    assert not _leaks(str(caught.value)), str(caught.value)


def test_a_private_key_that_is_no_base64_is_refused_without_its_characters(
    tmp_path: Path,
) -> None:
    path = tmp_path / "edited.key"
    body = {
        "format": KEY_FILE_FORMAT,
        "publisher": "ci",
        "key_id": "k1",
        "private_key": "AAAA" + SECRET_CHAR + "A" * 39,
    }
    _private_bytes(json.dumps(body, ensure_ascii=False).encode())(path)
    with pytest.raises(KeyFileError) as caught:
        SigningKey.load(path)
    assert not _leaks(str(caught.value)), str(caught.value)


def test_a_secret_of_raw_bytes_is_refused_without_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    _private_bytes(b"abc" + SECRET_BYTE + b"def")(path)
    with pytest.raises(SecretError) as caught:
        read_secret(path)
    assert not _leaks(str(caught.value)), str(caught.value)
    with pytest.raises(KafkaAuthError) as refused:
        read_password(path)
    assert not _leaks(str(refused.value)), str(refused.value)


def test_the_mode_is_checked_on_the_file_read(tmp_path: Path) -> None:
    """A private file behind a link is read (a Kubernetes Secret volume's files are
    links); an open file behind a private-looking link is refused."""
    key = SigningKey.generate("ci", "k1")
    target = tmp_path / "k1.key"
    key.save(target)
    link = tmp_path / "link.key"
    link.symlink_to(target)
    assert SigningKey.load(link).public_key_b64 == key.public_key_b64
    target.chmod(0o640)
    with pytest.raises(KeyFileError, match="chmod 600"):
        SigningKey.load(link)
    with pytest.raises(TooOpen):
        read_regular(link, 1024, private=True)


def test_private_files_still_read_as_before(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _private_bytes(b"  hunter2-but-longer\n")(path)
    assert read_secret(path) == "hunter2-but-longer"
    assert secret_key(path) == b"  hunter2-but-longer\n"
    assert read_password(path) == "hunter2-but-longer"
