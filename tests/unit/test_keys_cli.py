"""``loraplane keys rotate | revoke``: keyring changes the registry and workers pick up from
the file (``KeyringFile`` re-reads it), checked through the registry's own decision."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from loraplane.cli import app
from loraplane.lifecycle_events import signed_event
from loraplane.registry.fold import Accepted, evaluate
from loraplane.schemas.keyring import KeyringFile, KeyRole, load_keyring, save_keyring
from loraplane.schemas.lifecycle import LifecycleAction
from loraplane.schemas.reasons import RegistryRejection
from loraplane.schemas.signing import SigningKey
from tests.lifecycle_kit import make_kit, record

RUN = CliRunner()


@pytest.fixture
def ring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from datetime import UTC, datetime

    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path / "home"))
    path = tmp_path / "keyring.yaml"
    save_keyring(make_kit(datetime.now(UTC)).keyring, path)
    return path


WATCHED: dict[Path, KeyringFile] = {}


def verdict(path: Path, key: SigningKey) -> str:
    """What the registry decides, now, on a publish signed by ``key``, through one
    ``KeyringFile`` per path that lives across the changes (the agents' hot reload)."""
    event = signed_event(
        key,
        LifecycleAction.publish,
        adapter_id="a1",
        tenant_id="acme",
        base_model="tiny-llama",
        version="1",
        record=record("a1", "1"),
    )
    keyring = WATCHED.setdefault(path, KeyringFile(path)).current()
    decision = evaluate(event, keyring, lambda _a: None, event.issued_at)
    return "accepted" if isinstance(decision, Accepted) else str(decision.reason)


def test_rotate_adds_a_key_with_the_same_publisher_scopes_and_role(
    ring: Path, tmp_path: Path
) -> None:
    old = load_keyring(ring).get("ci-acme-ci")
    assert old is not None
    out = tmp_path / "new.key"
    done = RUN.invoke(
        app,
        [
            "keys",
            "rotate",
            "--keyring",
            str(ring),
            "--key-id",
            "ci-acme-ci",
            "--new-key-id",
            "ci-2027",
            "--out",
            str(out),
            "--no-audit",
        ],
    )
    assert done.exit_code == 0, done.output
    new = load_keyring(ring).get("ci-2027")
    assert new is not None and (new.publisher, new.scopes, new.role) == (
        old.publisher,
        old.scopes,
        KeyRole.publisher,
    )
    assert out.stat().st_mode & 0o777 == 0o600
    assert verdict(ring, SigningKey.load(out)) == "accepted"
    assert not load_keyring(ring).get("ci-acme-ci").revoked  # both valid until CI has switched


def test_revoke_refuses_the_keys_events_from_the_next_read_and_keeps_the_entry(
    ring: Path, tmp_path: Path
) -> None:
    out = tmp_path / "new.key"
    RUN.invoke(
        app,
        [
            "keys",
            "rotate",
            "--keyring",
            str(ring),
            "--key-id",
            "ci-acme-ci",
            "--new-key-id",
            "ci-2027",
            "--out",
            str(out),
            "--no-audit",
        ],
    )
    key = SigningKey.load(out)
    assert verdict(ring, key) == "accepted"
    done = RUN.invoke(
        app, ["keys", "revoke", "--keyring", str(ring), "--key-id", "ci-2027", "--no-audit"]
    )
    assert done.exit_code == 0 and "revoked" in done.stdout, done.output
    assert verdict(ring, key) == RegistryRejection.key_revoked  # not unknown_key
    again = RUN.invoke(
        app, ["keys", "revoke", "--keyring", str(ring), "--key-id", "ci-2027", "--no-audit"]
    )
    assert again.exit_code == 0 and "already revoked" in again.stdout


def test_rotate_can_revoke_the_old_key_in_the_same_replace(ring: Path, tmp_path: Path) -> None:
    done = RUN.invoke(
        app,
        [
            "keys",
            "rotate",
            "--keyring",
            str(ring),
            "--key-id",
            "ops-ops",
            "--out",
            str(tmp_path / "n.key"),
            "--revoke-old",
            "--no-audit",
        ],
    )
    assert done.exit_code == 0, done.output
    assert load_keyring(ring).get("ops-ops").revoked


@pytest.mark.parametrize("cmd", [["revoke"], ["rotate"]])
def test_an_unknown_key_is_a_clear_error_and_the_keyring_is_untouched(
    ring: Path, cmd: list[str]
) -> None:
    before = ring.read_bytes()
    done = RUN.invoke(
        app, ["keys", *cmd, "--keyring", str(ring), "--key-id", "nobody", "--no-audit"]
    )
    assert done.exit_code == 1 and "nobody is not in" in done.stderr
    assert ring.read_bytes() == before


def test_a_cli_revoke_reaches_running_consumers_without_a_restart(
    ring: Path, tmp_path: Path
) -> None:
    """The objects a worker, the router and the planner keep for their whole life (one
    ``VerifiedRegistry``, one ``KeyringFile``) see ``keys revoke`` at their next read: the
    views a revoked publisher key signed are withdrawn, commands of a revoked planner key
    are refused."""
    from datetime import UTC, datetime

    from loraplane.kernel.bus import Record
    from loraplane.registry.live import VerifiedRegistry
    from loraplane.schemas.adapter import AdapterStatus
    from loraplane.schemas.codec import encode
    from loraplane.schemas.reasons import CommandRejection
    from loraplane.workers.command_trust import check_command
    from tests.lifecycle_kit import signed_view
    from tests.unit.test_command_trust import command

    key = {}
    for old, new in [("ops-ops", "ops-2027"), ("planner-planner", "planner-2027")]:
        out = tmp_path / f"{new}.key"
        done = RUN.invoke(
            app,
            [
                "keys",
                "rotate",
                "--keyring",
                str(ring),
                "--key-id",
                old,
                "--new-key-id",
                new,
                "--out",
                str(out),
                "--no-audit",
            ],
        )
        assert done.exit_code == 0, done.output
        key[new] = SigningKey.load(out)
    now = datetime.now(UTC)  # the new keys are valid from their rotation on
    rec = record("a1", "1").model_copy(update={"status": AdapterStatus.active})
    view = signed_view(key["ops-2027"], [rec], now, load_keyring(ring))
    topic = [Record("p.registry", 0, 0, b"a1", encode(view), {}, 0)]
    keyring = KeyringFile(ring)
    registry = VerifiedRegistry(keyring, lambda: topic, sink=_Unsent(), component="worker")
    signed = key["planner-2027"].sign_command(command(issued=now))

    def refusal() -> str | None:
        found = check_command(
            signed,
            keyring.current(),
            worker_id=signed.worker_id,
            kafka_key=signed.worker_id.encode(),
            now=now,
            max_lifetime_s=600,
        )
        return None if found is None else str(found.reason)

    assert registry.records() == view.versions and refusal() is None
    for key_id in ("ops-2027", "planner-2027"):
        done = RUN.invoke(
            app, ["keys", "revoke", "--keyring", str(ring), "--key-id", key_id, "--no-audit"]
        )
        assert done.exit_code == 0, done.output
    assert registry.records() == []
    assert refusal() == CommandRejection.key_revoked


class _Unsent:
    def emit(self, topic_suffix: str, key: str, message: object) -> None:
        pass


def test_a_new_key_takes_events_from_a_signer_whose_clock_is_a_little_behind(
    ring: Path, tmp_path: Path
) -> None:
    """The registry checks the key's window at the event's issued_at too (a consumer folds
    the event again there): a key made now is valid from the allowed skew before now, so
    CI's first event, dated by a clock a minute behind, is not refused."""
    from datetime import timedelta

    from loraplane.registry.fold import CLOCK_SKEW
    from loraplane.schemas.base import now_utc

    out = tmp_path / "new.key"
    done = RUN.invoke(
        app,
        [
            *("keys", "rotate", "--keyring", str(ring), "--key-id", "ci-acme-ci"),
            *("--new-key-id", "ci-2027", "--out", str(out), "--no-audit"),
        ],
    )
    assert done.exit_code == 0, done.output
    entry = load_keyring(ring).get("ci-2027")
    assert entry is not None and now_utc() - entry.not_before >= CLOCK_SKEW
    behind = now_utc() - timedelta(minutes=1)
    event = signed_event(
        SigningKey.load(out),
        LifecycleAction.publish,
        adapter_id="a1",
        tenant_id="acme",
        base_model="tiny-llama",
        version="1",
        record=record("a1", "1"),
        now=behind,
    )
    decision = evaluate(event, load_keyring(ring), lambda _a: None, now_utc())
    assert isinstance(decision, Accepted), decision
