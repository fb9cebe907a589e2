"""The registry's trust checks and state machine (registry.fold), without Kafka."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.registry.fold import Accepted, AdapterState, Decision, Rejected, evaluate
from loraplane.schemas.adapter import AdapterStatus
from loraplane.schemas.codec import encode
from loraplane.schemas.keyring import Keyring
from loraplane.schemas.lifecycle import LifecycleEvent
from loraplane.schemas.reasons import RegistryRejection as Reason
from tests.lifecycle_kit import Kit, make_kit, record

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
KIT = make_kit(NOW)
A = "support-bot"


class Registry:
    """Applies decisions the way the agent does: accepted states replace the adapter's."""

    def __init__(self, kit: Kit = KIT, keyring: Keyring | None = None) -> None:
        self.kit = kit
        self.keyring = kit.keyring if keyring is None else keyring
        self.states: dict[str, AdapterState] = {}
        self.seq = 0

    def send(
        self, message: LifecycleEvent | bytes, now: datetime = NOW, key: bytes | None = None
    ) -> Decision:
        decision = evaluate(message, self.keyring, self.states.get, now, key=key)
        if isinstance(decision, Accepted):
            self.states[decision.adapter_id] = decision.state
        return decision

    def event(
        self,
        action: str,
        version: str,
        key: str = "ci",
        adapter_id: str = A,
        seq: int | None = None,
        now: datetime = NOW,
        **fields: object,
    ) -> LifecycleEvent:
        self.seq += 1
        return self.kit.event(key, action, adapter_id, version, seq or self.seq, now, **fields)

    def do(self, action: str, version: str, now: datetime = NOW, **kw: object) -> Accepted:
        decision = self.send(self.event(action, version, now=now, **kw), now=now)
        assert isinstance(decision, Accepted), decision
        return decision

    def view(self, adapter_id: str = A):
        return self.states[adapter_id].view


def rejected(decision: Decision) -> Reason:
    assert isinstance(decision, Rejected), decision
    assert decision.audit.decision == "rejected" and decision.audit.reason == decision.reason
    return decision.reason


def test_release_flow_publish_canary_promote_publish_promote_rollback() -> None:
    reg = Registry()
    reg.do("publish", "1.0")
    assert reg.view().versions[0].status is AdapterStatus.published
    reg.do("canary", "1.0", canary_percent=10)
    assert reg.view().version("1.0").release.canary_percent == 10
    assert reg.view().version("1.0").status is AdapterStatus.canary
    reg.do("promote", "1.0")
    reg.do("publish", "2.0")
    accepted = reg.do("promote", "2.0")
    view = reg.view()
    assert view.active_version == "2.0" and view.version("1.0").status is AdapterStatus.retired
    assert view.version("2.0").release.rollback_to == "1.0"
    assert accepted.audit.decision == "accepted" and accepted.audit.adapter_id == A
    reg.do("rollback", "2.0")
    view = reg.view()
    assert view.active_version == "1.0"
    assert view.version("2.0").status is AdapterStatus.retired
    assert view.last_seq == reg.seq and len(reg.states[A].seen) == 6


def test_retire_and_revoke_take_versions_out_and_revoke_is_final() -> None:
    reg = Registry()
    reg.do("publish", "1")
    reg.do("promote", "1")
    reg.do("retire", "1")
    assert reg.view().active_version is None  # requests fall back to the base model
    reg.do("revoke", "1", key="ops")
    assert reg.view().must_evict == [record(A, "1").lora_name]
    for action, extra in (
        ("promote", {}),
        ("canary", {"canary_percent": 5.0}),
        ("retire", {}),
        ("revoke", {}),
    ):
        assert (
            rejected(reg.send(reg.event(action, "1", key="ops", **extra))) is Reason.version_revoked
        )


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda r: r.event("publish", "1", key="ci"), None),
        (lambda r: r.kit.event("ci", "revoke", A, "1", 99, NOW), Reason.action_out_of_scope),
        (
            lambda r: r.kit.event("ci", "publish", "other", "1", 99, NOW, tenant_id="beta"),
            Reason.tenant_out_of_scope,
        ),
        (lambda r: r.kit.event("revoked", "publish", "x", "1", 99, NOW), Reason.key_revoked),
        (lambda r: r.kit.event("expired", "publish", "x", "1", 99, NOW), Reason.key_expired),
        (lambda r: r.kit.event("future", "publish", "x", "1", 99, NOW), Reason.key_not_yet_valid),
        (
            lambda r: r.kit.event("ci", "publish", "x", "1", 99, NOW - timedelta(hours=2)),
            Reason.event_expired,
        ),
        (
            lambda r: r.kit.event("ci", "publish", "x", "1", 99, NOW + timedelta(hours=1)),
            Reason.event_from_future,
        ),
        (
            lambda r: r.kit.event("ci", "publish", "x", "1", 99, NOW, ttl=timedelta(days=8)),
            Reason.event_lifetime_too_long,
        ),
    ],
)
def test_trust_and_freshness_reasons(mutate, reason) -> None:
    reg = Registry()
    decision = reg.send(mutate(reg))
    if reason is None:
        assert isinstance(decision, Accepted)
    else:
        assert rejected(decision) is reason


def test_rotation_two_keys_of_one_publisher_both_valid() -> None:
    reg = Registry()
    reg.do("publish", "1", key="ci")
    reg.do("promote", "1", key="ci2")


def test_signature_covers_every_field() -> None:
    reg = Registry()
    event = reg.event("publish", "1")
    for field, value in (
        ("seq", event.seq + 1),
        ("version", "2"),
        ("reason", "x"),
        ("expires_at", event.expires_at + timedelta(seconds=1)),
    ):
        forged = event.model_copy(update={field: value})
        if field == "version":
            forged = forged.model_copy(update={"record": record(A, "2")})
        assert rejected(reg.send(forged)) is Reason.bad_signature
    tampered = event.model_copy(update={"record": event.record.model_copy(update={"rank": 4})})
    assert rejected(reg.send(tampered)) is Reason.bad_signature
    assert rejected(reg.send(event.model_copy(update={"signature": "!!"}))) is Reason.bad_signature
    assert isinstance(reg.send(event), Accepted)


def test_unknown_key_and_publisher_binding() -> None:
    reg = Registry()
    event = reg.event("publish", "1")
    assert rejected(reg.send(event.model_copy(update={"key_id": "nobody"}))) is Reason.unknown_key
    assert (
        rejected(reg.send(event.model_copy(update={"publisher": "ops"})))
        is Reason.key_publisher_mismatch
    )
    assert rejected(Registry(keyring=Keyring()).send(event)) is Reason.unknown_key


def test_replay_stale_seq_and_no_silent_rollback() -> None:
    reg = Registry()
    publish = reg.event("publish", "2")
    reg.send(publish)
    assert rejected(reg.send(publish)) is Reason.replayed_event_id
    assert rejected(reg.send(encode(publish))) is Reason.replayed_event_id
    assert rejected(reg.send(reg.event("promote", "2", seq=1))) is Reason.stale_seq
    assert rejected(reg.send(reg.event("publish", "1.9"))) is Reason.version_not_newer
    assert rejected(reg.send(reg.event("publish", "2.0"))) is Reason.version_not_newer
    reg.do("publish", "2.0.1")


def test_replayed_id_is_forgotten_after_expiry_but_stays_rejected() -> None:
    reg = Registry()
    publish = reg.event("publish", "1")
    reg.send(publish)
    later = NOW + timedelta(hours=3)
    reg.do("promote", "1", now=later)
    assert publish.event_id not in reg.states[A].seen  # pruned: the set stays bounded
    assert rejected(reg.send(publish, now=later)) is Reason.event_expired


def test_ownership_and_registry_rules() -> None:
    reg = Registry()
    reg.do("publish", "1")
    assert (
        rejected(
            reg.send(
                reg.event(
                    "publish",
                    "2",
                    key="ops",
                    tenant_id="beta",
                    record=record(A, "2", tenant="beta"),
                )
            )
        )
        is Reason.tenant_mismatch
    )
    assert (
        rejected(
            reg.send(
                reg.event(
                    "publish",
                    "2",
                    base_model="other-base",
                    record=record(A, "2", base="other-base"),
                )
            )
        )
        is Reason.base_model_mismatch
    )
    assert rejected(reg.send(reg.event("promote", "7"))) is Reason.unknown_version
    assert (
        rejected(reg.send(reg.event("canary", "1", adapter_id="never", canary_percent=5.0)))
        is Reason.unknown_version
    )
    assert rejected(reg.send(reg.event("rollback", "1"))) is Reason.invalid_transition
    reg.do("promote", "1")
    assert rejected(reg.send(reg.event("promote", "1"))) is Reason.invalid_transition
    assert rejected(reg.send(reg.event("rollback", "1"))) is Reason.rollback_to_unknown
    assert (
        rejected(reg.send(reg.event("rollback", "1", rollback_to="0.5")))
        is Reason.rollback_to_unknown
    )
    assert (
        rejected(reg.send(reg.event("canary", "1", canary_percent=5.0)))
        is Reason.invalid_transition
    )


def test_publish_may_not_smuggle_a_status() -> None:
    reg = Registry()
    active = record(A, "1").model_copy(update={"status": AdapterStatus.active})
    assert rejected(reg.send(reg.event("publish", "1", record=active))) is Reason.invalid


def test_decode_reasons_and_key_mismatch() -> None:
    reg = Registry()
    event = reg.event("canary", "1", canary_percent=10.0)
    data = json.loads(encode(event))
    data["canary_percent"] = 150
    assert rejected(reg.send(json.dumps(data).encode())) is Reason.canary_percent_out_of_range
    data["canary_percent"] = -1
    assert rejected(reg.send(json.dumps(data).encode())) is Reason.canary_percent_out_of_range
    data["canary_percent"], data["surprise"] = 10, 1
    decision = reg.send(json.dumps(data).encode())
    assert rejected(decision) is Reason.invalid and "surprise" in decision.detail
    assert rejected(reg.send(b"\xff\x00not json")) is Reason.malformed
    assert rejected(reg.send(b"x" * (1024 * 1024 + 1))) is Reason.too_large
    assert rejected(reg.send(reg.event("publish", "1"), key=b"other")) is Reason.key_mismatch


def test_no_keyring_trusts_nobody() -> None:
    reg = Registry()
    reg.keyring = None  # type: ignore[assignment]
    decision = evaluate(reg.event("publish", "1"), None, reg.states.get, NOW)
    assert rejected(decision) is Reason.keyring_unavailable


# --- properties -------------------------------------------------------------------------

ACTIONS = st.sampled_from(["publish", "canary", "promote", "rollback", "retire", "revoke"])
VERSIONS = st.sampled_from(["1", "2", "3", "4"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(ACTIONS, VERSIONS, st.floats(0, 100), st.booleans()), max_size=25))
def test_any_sequence_keeps_the_registry_consistent(steps) -> None:
    """Whatever signed events arrive, in whatever order: at most one active version, seq
    grows, a revoked version stays revoked, the view always re-validates."""
    reg = Registry()
    revoked: set[str] = set()
    last_seq = 0
    for action, version, percent, explicit_target in steps:
        extra: dict[str, object] = {}
        if action == "canary":
            extra["canary_percent"] = percent
        if action == "rollback" and explicit_target:
            extra["rollback_to"] = "1"
        decision = reg.send(reg.event(action, version, key="ops", **extra))
        if A not in reg.states:
            continue
        view = reg.view()
        type(view).model_validate(view.model_dump())
        assert sum(r.status is AdapterStatus.active for r in view.versions) <= 1
        assert view.last_seq >= last_seq
        last_seq = view.last_seq
        now_revoked = {r.version for r in view.versions if r.status is AdapterStatus.revoked}
        assert revoked <= now_revoked
        revoked = now_revoked
        if isinstance(decision, Accepted) and action == "publish":
            # newer than every version still standing: a revoked one no longer blocks
            # (anti-lockout, docs/lifecycle.md), so it is the newest unrevoked version
            standing = [r.version for r in view.versions if r.status is not AdapterStatus.revoked]
            assert standing[-1] == version


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=512))
def test_arbitrary_bytes_are_rejected_never_raised(raw: bytes) -> None:
    assert isinstance(evaluate(raw, KIT.keyring, {}.get, NOW), Rejected)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(
    mutation=st.dictionaries(
        st.sampled_from(list(LifecycleEvent.model_fields)), JSON, min_size=1, max_size=3
    )
)
def test_mutated_signed_events_are_rejected_with_a_reason(mutation) -> None:
    """Any change to a signed event's fields: rejected (decode, signature or rules), no
    exception escapes."""
    reg = Registry()
    data = json.loads(encode(reg.event("publish", "1")))
    if all(data.get(k) == v for k, v in mutation.items()):
        return
    data.update(mutation)
    try:
        raw = json.dumps(data).encode()
    except ValueError:
        return
    assert isinstance(reg.send(raw), Rejected)
