"""ATTACK tests: an Ed25519 public key of small order in the keyring.

A small-order point (the identity, the point of order 2, those of order 4 and 8, in any
encoding) is a "key" nobody holds and everybody can sign for: with the signature's R a
small-order point and S = 0, verification holds for a fixed share of all messages, so a
forger only varies a free field (the event id) until one does. A placeholder of zeros
pasted into the keyring, or a key a tenant hands in on purpose, would let anyone who can
write the lifecycle or commands topic act with that key's scopes.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from loraplane.schemas.keyring import KeyEntry, Scopes
from loraplane.schemas.lifecycle import LifecycleAction, LifecycleEvent
from loraplane.schemas.signing import SigningKey, b64, small_order, verify
from loraplane.schemas.signing import public_key as load_public_key

NOW = datetime(2026, 6, 1, tzinfo=UTC)
_HIGH = [0xFF] * 30 + [0x7F]
SMALL_ORDER = {
    "identity": b"\x01" + bytes(31),
    "order-4": bytes(32),
    "order-8a": bytes.fromhex("26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05"),
    "order-8b": bytes.fromhex("c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a"),
    "order-2": bytes([0xEC, *_HIGH]),
}
NOT_CANONICAL = {
    "y = p": bytes([0xED, *_HIGH]),  # non-canonical 0
    "y = p + 1": bytes([0xEE, *_HIGH]),  # non-canonical 1
    "x = 0, sign 1": b"\x01" + bytes(30) + b"\x80",
}


P = 2**255 - 19
D = -121665 * pow(121666, -1, P) % P


def eight_times_is_identity(raw: bytes) -> bool:
    """The oracle: decode (RFC 8032, 5.1.3), double three times in affine coordinates."""
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    x2 = (y * y - 1) * pow(D * y * y + 1, -1, P) % P
    x = pow(x2, (P + 3) // 8, P)
    if (x * x - x2) % P:
        x = x * pow(2, (P - 1) // 4, P) % P
    assert (x * x - x2) % P == 0, "not on the curve"
    for _ in range(3):
        t = D * x * x * y * y % P
        x, y = 2 * x * y * pow(1 + t, -1, P) % P, (y * y + x * x) * pow(1 - t, -1, P) % P
    return (x, y) == (0, 1)


def entry(raw: bytes) -> KeyEntry:
    return KeyEntry(
        key_id="ops-placeholder",
        publisher="ops",
        public_key=b64(raw),
        not_before=NOW - timedelta(days=1),
        not_after=NOW + timedelta(days=30),
        scopes=Scopes(tenants="*", actions="*"),
    )


def test_a_zero_key_lets_anyone_sign() -> None:
    """Why: 64 zero bytes verify as a signature of about one event in four."""
    key = load_public_key(b64(bytes(32)))
    forged = 0
    for n in range(64):
        event = LifecycleEvent(
            event_id=f"forged-{n}",
            action=LifecycleAction.revoke,
            seq=1,
            issued_at=NOW,
            expires_at=NOW + timedelta(hours=1),
            publisher="ops",
            key_id="ops-placeholder",
            tenant_id="acme",
            adapter_id="support-bot",
            base_model="tiny-llama",
            version="1",
            signature=b64(bytes(64)),
        )
        forged += verify(event, key)
    assert forged > 0


@pytest.mark.parametrize("name", sorted(SMALL_ORDER) + sorted(NOT_CANONICAL))
def test_a_small_order_or_invalid_point_is_no_keyring_key(name: str) -> None:
    raw = {**SMALL_ORDER, **NOT_CANONICAL}[name]
    assert small_order(raw)
    assert name in NOT_CANONICAL or eight_times_is_identity(raw)
    with pytest.raises(ValidationError, match="public_key"):
        entry(raw)
    flipped = raw[:31] + bytes([raw[31] ^ 0x80])  # the other sign bit: the same y
    assert small_order(flipped)
    with pytest.raises(ValidationError, match="public_key"):
        entry(flipped)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32))
def test_a_generated_key_is_a_keyring_key(_n: int) -> None:
    key = SigningKey.generate("ci", "k1")
    raw = key.private_key.public_key().public_bytes_raw()
    assert not small_order(raw) and not eight_times_is_identity(raw)
    assert entry(raw).public_key == key.public_key_b64
