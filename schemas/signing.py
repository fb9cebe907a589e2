"""Ed25519 signatures of lifecycle events, cache commands and planner-memory records, and the
private key files CI and the planner hold.

What is signed is exactly the message's ``signed_bytes()`` (every field except
``signature``, canonical JSON behind a domain tag of its own: a lifecycle signature never
verifies as a command's, nor the reverse); the signature travels
base64-encoded in ``signature``. A key file is JSON (publisher, key_id, raw private key in
base64) readable by its owner only: it is refused when group or others may read it, as ssh does.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.lifecycle import LifecycleEvent
from loraplane.schemas.planner_memory import PlannerMemory

__all__ = [
    "KEY_FILE_FORMAT",
    "MAX_KEY_FILE_BYTES",
    "VERIFIED_CAP",
    "KeyFileError",
    "SigningKey",
    "b64",
    "public_key",
    "small_order",
    "unb64",
    "verify",
    "verify_raw",
]

KEY_FILE_FORMAT = "loraplane.ed25519.v1"
MAX_KEY_FILE_BYTES = 64 * 1024  # a key file is about 200 bytes


class KeyFileError(ValueError):
    """A private key file that is missing, unreadable, too open or not ours."""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str, length: int) -> bytes:
    """Strict, canonical base64 of exactly ``length`` bytes; ValueError otherwise.

    Canonical: the one encoding ``b64`` gives those bytes. The unused low bits of the last
    character before ``=`` are otherwise ignored by decoders, so several strings would carry
    one signature, and an edited signature string would still verify."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"not base64: {exc}") from None
    if len(raw) != length:
        raise ValueError(f"expected {length} bytes, got {len(raw)}")
    if b64(raw) != text:
        raise ValueError("not the canonical base64 of its bytes")
    return raw


def public_key(text: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(unb64(text, 32))


_P = 2**255 - 19
# The y of the eight points of order dividing 8 (the identity, order 2, the two of order 4,
# the four of order 8): 1, -1, 0 and +-y8 (tests/unit/test_weak_keys.py checks 8P = O).
_Y8 = int.from_bytes(
    bytes.fromhex("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05"), "little"
)
_SMALL_ORDER_Y = frozenset({0, 1, _P - 1, _Y8, _P - _Y8})


def small_order(raw: bytes) -> bool:
    """True when the 32 bytes encode a point of small order (8P is the identity), or are
    not a canonical encoding (y >= p). Nobody holds such a key and anyone can sign for it:
    with R a small-order point and S = 0 a signature verifies for a fixed share of all
    messages, so a forger varies a free field until one does. (An encoding off the curve
    verifies nothing at all: OpenSSL refuses it at every verification.)"""
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    return y >= _P or y in _SMALL_ORDER_Y


@dataclass(frozen=True)
class SigningKey:
    publisher: str
    key_id: str
    private_key: Ed25519PrivateKey = field(repr=False)

    @classmethod
    def generate(cls, publisher: str, key_id: str) -> SigningKey:
        return cls(publisher, key_id, Ed25519PrivateKey.generate())

    @property
    def public_key_b64(self) -> str:
        return b64(
            self.private_key.public_key().public_bytes(
                serialization.Encoding.Raw, serialization.PublicFormat.Raw
            )
        )

    def sign(self, event: LifecycleEvent) -> LifecycleEvent:
        """The event with this key's publisher, key_id and signature filled in."""
        unsigned = event.model_copy(
            update={"publisher": self.publisher, "key_id": self.key_id, "signature": ""}
        )
        signature = self.private_key.sign(unsigned.signed_bytes())
        return unsigned.model_copy(update={"signature": b64(signature)})

    def sign_command(self, cmd: CacheCommand) -> CacheCommand:
        """The command with this key's key_id and signature filled in (``model_copy``: the
        planner's fields are already validated, and a cold tick signs ~30k of them)."""
        unsigned = cmd.model_copy(update={"key_id": self.key_id, "signature": ""})
        signature = self.private_key.sign(unsigned.signed_bytes())
        return unsigned.model_copy(update={"signature": b64(signature)})

    def sign_memory(self, worker_id: str, memory: PlannerMemory) -> PlannerMemory:
        """The planner-memory record of ``worker_id``, naming it, signed by this key
        (``model_copy``: the planner's own record, its commands validated when built)."""
        unsigned = memory.model_copy(
            update={"worker_id": worker_id, "key_id": self.key_id, "signature": ""}
        )
        signature = self.private_key.sign(unsigned.signed_bytes())
        return unsigned.model_copy(update={"signature": b64(signature)})

    def save(self, path: Path) -> None:
        """Write the key file with mode 0600 from its first byte, whole or not at all (a
        crash leaves no torn key); never overwrites an existing file (FileExistsError)."""
        raw = self.private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        body = (
            json.dumps(
                {
                    "format": KEY_FILE_FORMAT,
                    "publisher": self.publisher,
                    "key_id": self.key_id,
                    "private_key": b64(raw),
                },
                indent=2,
            )
            + "\n"
        )
        from loraplane.kernel.atomic_file import write_new

        write_new(path, body, mode=0o600)

    @classmethod
    def load(cls, path: Path) -> SigningKey:
        """The key in the private regular file at ``path`` (``read_regular``: a FIFO, a
        device, a file over ``MAX_KEY_FILE_BYTES`` or one others may read is refused). A
        refusal never quotes the file: not a byte or character of the key reaches a log."""
        from loraplane.kernel.local_files import read_regular

        try:
            raw = read_regular(path, MAX_KEY_FILE_BYTES, private=True)
        except OSError as exc:
            raise KeyFileError(f"{path}: {exc.strerror or type(exc).__name__}") from None
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):
            raise KeyFileError(f"{path}: not a {KEY_FILE_FORMAT} key file (no JSON)") from None
        if not isinstance(data, dict) or data.get("format") != KEY_FILE_FORMAT:
            raise KeyFileError(f"{path}: not a {KEY_FILE_FORMAT} key file")
        fields = [data.get(name) for name in ("publisher", "key_id", "private_key")]
        if not all(isinstance(value, str) for value in fields):
            raise KeyFileError(f"{path}: publisher, key_id and private_key must be strings")
        publisher, key_id, private = (str(value) for value in fields)
        try:
            key = Ed25519PrivateKey.from_private_bytes(unb64(private, 32))
        except ValueError:
            raise KeyFileError(
                f"{path}: private_key is not the base64 of 32 bytes of an Ed25519 key"
            ) from None
        return cls(publisher, key_id, key)


def verify(event: LifecycleEvent | CacheCommand, key: Ed25519PublicKey) -> bool:
    """True only for a well-formed signature of exactly ``event.signed_bytes()`` (a lifecycle
    event or a cache command, each under its own domain tag).

    A (key, signature, bytes) triple that verified is remembered by its SHA-256
    (``VERIFIED_CAP`` of them, then forgotten at once): a registry view carries every event
    of its adapter's history, and whoever may write the registry topic can send copies of a
    genuine history, each making every consumer fold it again; the events it verified
    before then cost a hash, not an Ed25519 verification. A key's revocation and window are
    checked before this (``keyring.signer``), never remembered."""
    try:
        message = event.signed_bytes()
    except ValueError:
        return False
    return _verifies(message, event.signature, key)


def verify_raw(message: bytes, signature: str, public_key_text: str) -> bool:
    """``verify`` of bytes already in hand (a planner-memory record's, read off its raw
    JSON before it is decoded: ``streams.planner_runtime.memory_refusal``), with the
    keyring's text of the public key. Not remembered: each such record is verified once as
    it arrives, and remembering the planner's own writes would push the registry's events
    out of the memory of verified signatures."""
    try:
        key = public_key(public_key_text)
    except ValueError:
        return False
    return _verifies(message, signature, key, remember=False)


def _verifies(
    message: bytes, signature_text: str, key: Ed25519PublicKey, *, remember: bool = True
) -> bool:
    try:
        signature = unb64(signature_text, 64)
        proof = hashlib.sha256(key.public_bytes_raw() + signature + message).digest()
        if proof in _verified:
            return True
        key.verify(signature, message)
    except (ValueError, InvalidSignature):
        return False
    if not remember:
        return True
    if len(_verified) >= VERIFIED_CAP:
        _verified.clear()
    _verified.add(proof)
    return True


VERIFIED_CAP = 16_384
"""Verified signatures remembered per process (about 100 bytes each)."""
_verified: set[bytes] = set()
