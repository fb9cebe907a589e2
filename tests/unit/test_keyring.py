"""Keyring files, key files and their reload (schemas.keyring, loraplane.schemas.signing)."""

from __future__ import annotations

import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.commands.keys import parse_scopes
from loraplane.schemas.keyring import (
    MAX_KEYRING_CHARS,
    KeyringError,
    KeyringFile,
    load_keyring,
    parse_keyring,
    save_keyring,
)
from loraplane.schemas.lifecycle import LifecycleAction
from loraplane.schemas.signing import KeyFileError, SigningKey, verify
from tests.lifecycle_kit import make_kit

NOW = datetime(2026, 6, 1, tzinfo=UTC)


def test_round_trip_yaml_and_json(tmp_path: Path) -> None:
    ring = make_kit(NOW).keyring
    path = tmp_path / "keyring.yaml"
    save_keyring(ring, path)
    assert load_keyring(path) == ring
    assert parse_keyring(ring.model_dump_json()) == ring  # JSON is YAML too


def test_scopes_and_windows() -> None:
    ring = make_kit(NOW).keyring
    ci = ring.get("ci-acme-ci")
    assert ci.scopes.allows_tenant("acme") and not ci.scopes.allows_tenant("beta")
    assert ci.scopes.allows_action(LifecycleAction.publish)
    assert not ci.scopes.allows_action(LifecycleAction.revoke)
    assert ring.get("ops-ops").scopes.allows_tenant("anyone")
    assert ci.window_problem(NOW) is None
    assert ring.get("ci-acme-expired").window_problem(NOW) == "expired"
    assert ring.get("ci-acme-future").window_problem(NOW) == "not_yet_valid"


PUBLIC = SigningKey.generate("p", "a").public_key_b64  # a real point: other fields fail


@pytest.mark.parametrize(
    "text, field",
    [
        (
            "keys: [{key_id: a, publisher: p, public_key: 'AAAA', not_before: 2026-01-01T00:00:00Z,"
            " not_after: 2027-01-01T00:00:00Z, scopes: {tenants: '*', actions: '*'}}]",
            "public_key",
        ),
        ("keys: [{key_id: A!, publisher: p}]", "key_id"),
        (
            "keys: [{key_id: a, publisher: p, public_key: '" + PUBLIC + "', not_before: "
            "2027-01-01T00:00:00Z, not_after: 2026-01-01T00:00:00Z, scopes: {tenants: '*', "
            "actions: [publish]}}]",
            "not_after",
        ),
        (
            "keys: [{key_id: a, publisher: p, public_key: '" + PUBLIC + "', not_before: "
            "2026-01-01T00:00:00Z, not_after: 2027-01-01T00:00:00Z, scopes: {tenants: '*', "
            "actions: [deploy]}}]",
            "actions",
        ),
        ("keys: [[", "YAML"),
    ],
)
def test_invalid_keyrings_say_which_field(text: str, field: str) -> None:
    with pytest.raises(KeyringError, match=field):
        parse_keyring(text)


def test_duplicate_key_ids_are_refused() -> None:
    ring = make_kit(NOW).keyring
    with pytest.raises(KeyringError):
        ring.with_key(ring.keys[0])


def test_keyring_file_reloads_on_change_and_fails_closed(tmp_path: Path) -> None:
    path = tmp_path / "keyring.yaml"
    ring = make_kit(NOW).keyring
    save_keyring(ring, path)
    watched = KeyringFile(path)
    assert watched.current() == ring
    revoked = ring.model_copy(
        update={"keys": [k.model_copy(update={"revoked": True}) for k in ring.keys]}
    )
    save_keyring(revoked, path)
    assert all(k.revoked for k in watched.current().keys)
    path.write_text("keys: [[")
    with pytest.raises(KeyringError):
        watched.current()
    path.unlink()
    with pytest.raises(KeyringError):
        watched.current()


@pytest.mark.parametrize("kind", ["fifo", "endless-device", "over-the-cap", "truncated", "binary"])
def test_a_hostile_keyring_file_fails_closed_at_start_and_on_reload(
    kind: str, tmp_path: Path
) -> None:
    """Whatever sits at the keyring's path, reading it ends in a KeyringError: a FIFO
    without a writer, a link to an endless device or an oversized file is never read whole
    (a worker re-reads its keyring every 0.2 s; none may hang or exhaust its memory)."""
    path = tmp_path / "keyring.yaml"
    save_keyring(make_kit(NOW).keyring, path)
    watched = KeyringFile(path)
    watched.current()
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "endless-device":
        path.symlink_to("/dev/zero")
    elif kind == "over-the-cap":
        with path.open("wb") as f:
            f.truncate(MAX_KEYRING_CHARS + 1)  # sparse: no disk used
    elif kind == "truncated":
        save_keyring(make_kit(NOW).keyring, path)
        path.write_bytes(path.read_bytes()[:100])
    else:
        path.write_bytes(b"keys:\n- key_id: \xff\xfe\n")
    for read in (lambda: load_keyring(path), watched.current):
        with pytest.raises(KeyringError):
            read()


def test_key_file_is_private_and_never_overwritten(tmp_path: Path) -> None:
    key = SigningKey.generate("ci-acme", "k1")
    path = tmp_path / "k1.key"
    key.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):
        key.save(path)
    loaded = SigningKey.load(path)
    assert loaded.public_key_b64 == key.public_key_b64 and loaded.key_id == "k1"
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        SigningKey.load(path)
    other = tmp_path / "junk.key"
    other.write_text("{}")
    other.chmod(0o600)
    with pytest.raises(KeyFileError):
        SigningKey.load(other)


def test_sign_and_verify() -> None:
    kit = make_kit(NOW)
    event = kit.event("ci", "promote", "a", "1", 5, NOW)
    public = kit.keys["ci"].private_key.public_key()
    assert verify(event, public)
    assert not verify(event, kit.keys["ops"].private_key.public_key())
    assert not verify(event.model_copy(update={"seq": 6}), public)


@settings(max_examples=100, deadline=None)
@given(signature=st.text(max_size=100))
def test_any_signature_text_is_false_not_an_error(signature: str) -> None:
    kit = make_kit(NOW)
    event = kit.event("ci", "promote", "a", "1", 5, NOW + timedelta(seconds=1))
    assert not verify(
        event.model_copy(update={"signature": signature}), kit.keys["ci"].private_key.public_key()
    )


def test_cli_scope_syntax() -> None:
    assert parse_scopes(["tenant:acme", "action:publish", "action:canary"]) == {
        "tenants": ["acme"],
        "actions": ["publish", "canary"],
    }
    assert parse_scopes(["tenant:*", "action:*"]) == {"tenants": "*", "actions": "*"}
    import typer

    with pytest.raises(typer.BadParameter):
        parse_scopes(["team:x"])


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=-40 * 24 * 60, max_value=40 * 24 * 60),
    st.integers(min_value=-40 * 24 * 60, max_value=40 * 24 * 60),
)
def test_retiring_only_ever_shortens_a_window(at_min: int, t_min: int) -> None:
    """PROPERTY: a retired key signs at an instant only if it signed there before and the
    instant is before the retirement; what it could sign before then is unchanged, so the
    views it signed keep verifying. No other key changes."""
    ring = make_kit(NOW).keyring
    ci = ring.get("ci-acme-ci")
    assert ci is not None
    at, t = NOW + timedelta(minutes=at_min), NOW + timedelta(minutes=t_min)
    if at <= ci.not_before:
        with pytest.raises(KeyringError, match="revoke it instead"):
            ring.with_retired(ci.key_id, at)
        return
    retired = ring.with_retired(ci.key_id, at)
    after = retired.get(ci.key_id)
    assert after is not None and not after.revoked
    assert after.not_after == min(ci.not_after, at)
    assert (after.window_problem(t) is None) == (ci.window_problem(t) is None and t < at)
    assert [k for k in retired.keys if k.key_id != ci.key_id] == [
        k for k in ring.keys if k.key_id != ci.key_id
    ]
    assert parse_keyring(retired.to_yaml()) == retired


def test_retiring_an_unknown_key_is_an_error() -> None:
    with pytest.raises(KeyringError, match="nobody is not in"):
        make_kit(NOW).keyring.with_retired("nobody", NOW)
