"""``loraplane keys rotate | retire | revoke``: keyring changes the registry and workers pick
up from the file (``KeyringFile`` re-reads it), checked through the registry's own decision."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from loraplane.cli import app
from loraplane.lifecycle_events import signed_event
from loraplane.registry.fold import Accepted, evaluate
from loraplane.schemas.keyring import KeyringFile, KeyRole, load_keyring, save_keyring
from loraplane.schemas.lifecycle import LifecycleAction
from loraplane.schemas.reasons import RegistryRejection
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.signing import SigningKey
from tests.lifecycle_kit import make_kit, record

RUN = CliRunner()


KIT_KEYS: dict[Path, dict[str, SigningKey]] = {}
"""The private keys of each ``ring`` file's entries."""


@pytest.fixture
def ring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from datetime import UTC, datetime

    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path / "home"))
    path = tmp_path / "keyring.yaml"
    kit = make_kit(datetime.now(UTC))
    save_keyring(kit.keyring, path)
    KIT_KEYS[path] = kit.keys
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


def rotate(ring: Path, out: Path, *extra: str) -> str:
    """``keys rotate`` of acme's CI key (ci-acme-ci) to ci-2027 at ``out``; its stdout."""
    done = RUN.invoke(
        app,
        [
            *("keys", "rotate", "--keyring", str(ring), "--key-id", "ci-acme-ci"),
            *("--new-key-id", "ci-2027", "--out", str(out), "--no-audit", *extra),
        ],
    )
    assert done.exit_code == 0, done.output
    return done.stdout


def ci_view(ring: Path, minutes_ago: int = 1) -> AdapterView:
    """A view of adapter a1 whose events CI's current key signed ``minutes_ago``."""
    from datetime import timedelta

    from loraplane.schemas.adapter import AdapterStatus
    from loraplane.schemas.base import now_utc
    from tests.lifecycle_kit import signed_view

    ci = KIT_KEYS[ring]["ci"]
    rec = record("a1", "1").model_copy(update={"status": AdapterStatus.active})
    return signed_view(ci, [rec], now_utc() - timedelta(minutes=minutes_ago), load_keyring(ring))


def test_rotate_retires_the_old_key_so_its_views_stay_and_it_signs_nothing_new(
    ring: Path, tmp_path: Path
) -> None:
    """Routine rotation: the views the old key signed keep verifying at a running consumer
    (the registry consumers keep across keyring changes), while an event it signs after
    the rotation is refused as ``key_expired``, and the new key signs."""
    from loraplane.kernel.bus import Record
    from loraplane.registry.evidence import ViewVerified, verify_view
    from loraplane.registry.live import VerifiedRegistry
    from loraplane.schemas.base import now_utc
    from loraplane.schemas.codec import encode

    view = ci_view(ring)
    topic = [Record("p.registry", 0, 0, b"a1", encode(view), {}, 0)]
    registry = VerifiedRegistry(
        KeyringFile(ring), lambda: topic, sink=_Unsent(), component="worker"
    )
    assert registry.records() == view.versions
    out = rotate(ring, tmp_path / "new.key")
    assert "ci-acme-ci retired from" in out and "stays valid" in out
    old = load_keyring(ring).get("ci-acme-ci")
    assert old is not None and not old.revoked and old.not_after <= now_utc()
    assert isinstance(verify_view(view, load_keyring(ring), now_utc()), ViewVerified)
    assert registry.records() == view.versions  # the adapter stays online
    assert verdict(ring, KIT_KEYS[ring]["ci"]) == RegistryRejection.key_expired
    assert verdict(ring, SigningKey.load(tmp_path / "new.key")) == "accepted"


def test_an_overlap_lets_the_old_key_sign_until_it_ends(ring: Path, tmp_path: Path) -> None:
    from datetime import timedelta

    from loraplane.schemas.base import now_utc

    rotate(ring, tmp_path / "new.key", "--overlap-s", "3600")
    old = load_keyring(ring).get("ci-acme-ci")
    assert old is not None
    assert now_utc() + timedelta(minutes=59) < old.not_after <= now_utc() + timedelta(hours=1)
    assert verdict(ring, KIT_KEYS[ring]["ci"]) == "accepted"
    assert verdict(ring, SigningKey.load(tmp_path / "new.key")) == "accepted"


def test_retire_never_lengthens_a_key_and_says_what_it_did(ring: Path) -> None:
    from datetime import timedelta

    from loraplane.schemas.base import now_utc

    def retire(key_id: str, *extra: str) -> Result:
        return RUN.invoke(
            app,
            ["keys", "retire", "--keyring", str(ring), "--key-id", key_id, "--no-audit", *extra],
        )

    before = load_keyring(ring).get("ci-acme-ci")
    assert before is not None
    done = retire("ci-acme-ci", "--overlap-s", "600")
    assert done.exit_code == 0 and "ci-acme-ci retired from" in done.stdout, done.output
    after = load_keyring(ring).get("ci-acme-ci")
    assert after is not None and after.not_after < before.not_after
    assert after.not_after <= now_utc() + timedelta(minutes=10)
    assert verdict(ring, KIT_KEYS[ring]["ci"]) == "accepted"  # inside the overlap
    untouched = ring.read_bytes()
    longer = retire("ci-acme-ci", "--overlap-s", "86400")
    assert longer.exit_code == 0 and "already ends at" in longer.stdout
    assert ring.read_bytes() == untouched
    assert retire("ci-acme-ci").exit_code == 0
    assert verdict(ring, KIT_KEYS[ring]["ci"]) == RegistryRejection.key_expired
    revoked = retire("ci-acme-revoked")
    assert revoked.exit_code == 0 and "already revoked" in revoked.stdout
    future = retire("ci-acme-future")  # valid only from tomorrow: nothing to end
    assert future.exit_code == 1 and "revoke it instead" in future.stderr
    missing = retire("nobody")
    assert missing.exit_code == 1 and "nobody is not in" in missing.stderr
    bad = retire("ci-acme-ci", "--overlap-s", "-1")
    assert bad.exit_code == 2


def test_revoke_old_warns_that_it_withdraws_what_the_key_signed(ring: Path, tmp_path: Path) -> None:
    from loraplane.registry.evidence import ViewRefused, verify_view
    from loraplane.schemas.base import now_utc

    view = ci_view(ring)
    done = RUN.invoke(
        app,
        [
            *("keys", "rotate", "--keyring", str(ring), "--key-id", "ci-acme-ci"),
            *("--out", str(tmp_path / "n.key"), "--revoke-old", "--no-audit"),
        ],
    )
    assert done.exit_code == 0, done.output
    assert "ci-acme-ci revoked" in done.stdout and "withdraws every registry view" in done.stderr
    assert isinstance(verify_view(view, load_keyring(ring), now_utc()), ViewRefused)
    both = RUN.invoke(
        app,
        [
            *("keys", "rotate", "--keyring", str(ring), "--key-id", "ops-ops"),
            *("--revoke-old", "--overlap-s", "60", "--no-audit"),
        ],
    )
    assert both.exit_code == 1 and "--revoke-old" in both.stderr


def test_revoke_counts_the_views_it_withdraws_from_a_registry_state(
    ring: Path, tmp_path: Path
) -> None:
    """``--state`` (the ``registry list --json`` output): the adapters whose evidence holds
    an event of the key, said before (``--dry-run``, nothing changed) and when revoking."""
    import json

    from loraplane.schemas.base import now_utc
    from loraplane.schemas.registry import views_to_json
    from tests.lifecycle_kit import signed_view

    ops = KIT_KEYS[ring]["ops"]
    other = signed_view(ops, [record("b1", "1")], now_utc(), load_keyring(ring))
    state = tmp_path / "registry.json"
    state.write_text(views_to_json({"a1": ci_view(ring), "b1": other}))

    def revoke(*extra: str) -> Result:
        return RUN.invoke(
            app,
            [
                *("keys", "revoke", "--keyring", str(ring), "--key-id", "ci-acme-ci"),
                *("--state", str(state), "--no-audit", *extra),
            ],
        )

    before = ring.read_bytes()
    dry = revoke("--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.stdout) == {
        "key_id": "ci-acme-ci",
        "publisher": "ci-acme",
        "role": "publisher",
        "revoked": False,
        "already_revoked": False,
        "dry_run": True,
        "withdrawn_adapters": ["a1"],
        "withdrawn_count": 1,
    }
    assert ring.read_bytes() == before
    done = revoke()
    assert done.exit_code == 0 and "ci-acme-ci: revoked" in done.stdout, done.output
    assert "withdraws the views of 1 adapter(s)" in done.stderr and "a1" in done.stderr
    assert load_keyring(ring).get("ci-acme-ci").revoked  # type: ignore[union-attr]
    again = revoke("--json")
    assert json.loads(again.stdout)["already_revoked"] is True
    state.write_text("[1, 2]")
    bad = revoke()
    assert bad.exit_code == 1 and "not a registry" in bad.stderr


def test_revoke_without_a_state_warns_what_it_withdraws(ring: Path) -> None:
    done = RUN.invoke(
        app,
        ["keys", "revoke", "--keyring", str(ring), "--key-id", "ops-ops", "--no-audit"],
    )
    assert done.exit_code == 0, done.output
    assert "withdraws every registry view" in done.stderr and "keys retire" not in done.stdout
