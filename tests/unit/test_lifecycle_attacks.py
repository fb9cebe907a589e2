"""ATTACK tests: each class of wrong verdict an independent signer found, through the real
``evaluate``. Every hostile event here is *correctly signed* by a key the keyring trusts,
so the old registry accepted it (or, for lockout, refused the honest event that follows);
each test fails on the code before strict parsing and the anti-lockout rules."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from loraplane.kernel.command_partition import partition_of
from loraplane.registry.fold import CLOCK_SKEW, Accepted, AdapterState, Decision, Rejected
from loraplane.registry.fold import evaluate as real_evaluate
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Priority
from loraplane.schemas.codec import encode
from loraplane.schemas.keyring import Keyring
from loraplane.schemas.lifecycle import MAX_SEQ, LifecycleEvent, seq_at
from loraplane.schemas.reasons import RegistryRejection as Reason
from tests.lifecycle_kit import Kit, make_kit, record

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
KIT = make_kit(NOW)
A = "support-bot"
NOW_SEQ = seq_at(NOW)


class Registry:
    def __init__(self, kit: Kit = KIT, keyring: Keyring | None = None) -> None:
        self.kit = kit
        self.keyring = kit.keyring if keyring is None else keyring
        self.states: dict[str, AdapterState] = {}
        self.seq = NOW_SEQ - 1_000_000

    def send(self, message: LifecycleEvent | bytes, now: datetime = NOW) -> Decision:
        decision = real_evaluate(message, self.keyring, self.states.get, now)
        if isinstance(decision, Accepted):
            self.states[decision.adapter_id] = decision.state
        return decision

    def event(
        self, action: str, version: str, key: str = "ci", seq: int | None = None, **fields: object
    ) -> LifecycleEvent:
        self.seq += 1
        return self.kit.event(
            key,
            action,
            fields.pop("adapter_id", A),
            version,  # type: ignore[arg-type]
            seq or self.seq,
            NOW,
            **fields,
        )

    def do(self, action: str, version: str, **kw: object) -> Accepted:
        decision = self.send(self.event(action, version, **kw))
        assert isinstance(decision, Accepted), decision
        return decision

    def view(self):  # type: ignore[no-untyped-def]
        return self.states[A].view


def rejected(decision: Decision) -> Reason:
    assert isinstance(decision, Rejected), decision
    assert decision.audit.reason == decision.reason
    return decision.reason


def wire(event: LifecycleEvent) -> str:
    return encode(event).decode()


# --- 1. strict parsing: what is applied is what every reader sees --------------------------


def test_duplicate_key_is_refused_not_last_wins() -> None:
    """A first-key reader sees version 9; the old parser applied (and verified) the last."""
    reg = Registry()
    raw = wire(reg.event("publish", "1")).replace(
        '{"schema_version"', '{"version":"9","schema_version"', 1
    )
    assert rejected(reg.send(raw.encode())) is Reason.malformed
    assert A not in reg.states


def test_duplicate_key_nested_in_the_record_is_refused() -> None:
    reg = Registry()
    raw = wire(reg.event("publish", "1")).replace('"rank":8', '"rank":64,"rank":8', 1)
    assert rejected(reg.send(raw.encode())) is Reason.malformed


@pytest.mark.parametrize(
    "field, old, new",
    [
        ("seq", None, '"{seq}"'),  # a string for an integer
        ("seq", None, "{seq}.0"),  # a float for an integer
        ("schema_version", "1", "true"),  # a boolean for an integer
        ("schema_version", "1", "1.0"),
        ("rank", "8", '"8"'),
        ("size_bytes", "1000", "1000.0"),
        ("canary_percent", None, '"10"'),  # a string for a number
        ("issued_at", None, "{issued}"),  # a number for a timestamp
    ],
)
def test_type_coercion_is_refused(field: str, old: str | None, new: str) -> None:
    reg = Registry()
    action = "canary" if field == "canary_percent" else "publish"
    if action == "canary":
        reg.do("publish", "1")
        event = reg.event("canary", "1", canary_percent=10.0)
    else:
        event = reg.event("publish", "1")
    raw = wire(event)
    data = json.loads(raw)
    value = {
        "seq": str(event.seq),
        "canary_percent": "10.0",
        "issued_at": json.dumps(data["issued_at"]),
    }.get(field, old)
    replacement = new.format(seq=event.seq, issued=int(event.issued_at.timestamp()))
    needle = f'"{field}":{value}'
    assert needle in raw, needle
    hostile = raw.replace(needle, f'"{field}":{replacement}', 1)
    assert rejected(reg.send(hostile.encode())) is Reason.invalid


@pytest.mark.parametrize(
    "payload",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    ],
)
def test_deep_nesting_is_malformed_not_recursion_error(payload: bytes) -> None:
    assert rejected(Registry().send(payload)) is Reason.malformed


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: "\ufeff" + r,  # BOM
        lambda r: r + "garbage",  # trailing garbage
        lambda r: r + "\n{}",  # a second value
        lambda r: r.replace('"reason":""', '"reason":"\\ud800"'),  # lone surrogate
        lambda r: r.replace('"rank":8', '"rank":NaN'),
        lambda r: r.replace('"rank":8', '"rank":Infinity'),
        lambda r: r.replace('"rank":8', '"rank":1e999'),
        lambda r: r.replace('"rank":8', '"rank":' + "9" * 5000),
    ],
)
def test_hostile_json_forms_are_malformed(mutate) -> None:  # type: ignore[no-untyped-def]
    reg = Registry()
    raw = wire(reg.event("publish", "1"))
    hostile = mutate(raw)
    assert hostile != raw
    assert rejected(reg.send(hostile.encode("utf-8", "surrogatepass"))) is Reason.malformed


@pytest.mark.parametrize(
    "uri",
    [
        "s3://loraplane-artifacts/acme/{a}/1-{s}/../../beta/x/",
        "s3://loraplane-artifacts/acme/{a}/./1-{s}/",
        "s3://loraplane-artifacts/acme/{a}/1-{s}/./",
    ],
)
def test_dot_segments_in_artifact_uri_are_refused(uri: str) -> None:
    """Signed with the record built unvalidated (as a hostile signer would): the registry
    refuses to parse it, though the URI textually starts with the right prefix."""
    reg = Registry()
    good = record(A, "1")
    bad = AdapterRecord.model_construct(
        **{**dict(good), "artifact_uri": uri.format(a=A, s=good.sha256[:8])}
    )
    event = LifecycleEvent.model_construct(**{**dict(reg.event("publish", "1")), "record": bad})
    signed = KIT.keys["ci"].sign(event)
    assert rejected(reg.send(encode(signed))) is Reason.invalid


# --- 2. anti-lockout ------------------------------------------------------------------------


def test_seq_far_in_the_future_is_refused_and_cannot_lock_out() -> None:
    reg = Registry()
    reg.do("publish", "1")
    assert rejected(reg.send(reg.event("promote", "1", seq=MAX_SEQ))) is Reason.seq_from_future
    assert reg.view().last_seq < MAX_SEQ
    reg.do("promote", "1")  # the honest event after it still lands


def test_seq_ceiling_is_now_plus_skew() -> None:
    reg = Registry()
    ceiling = seq_at(NOW + CLOCK_SKEW)
    assert isinstance(reg.send(reg.event("publish", "1", seq=ceiling)), Accepted)
    assert rejected(reg.send(reg.event("publish", "2", seq=ceiling + 1))) is Reason.seq_from_future


def test_ops_revoke_lands_below_a_stolen_keys_seq_floor() -> None:
    """A stolen tenant key pushes seq to the ceiling; the ops revoke signed now, with a
    smaller seq, still lands (revoke is exempt from the seq floor)."""
    reg = Registry()
    reg.do("publish", "1")
    reg.do("publish", "2", seq=seq_at(NOW + CLOCK_SKEW))
    revoke = reg.do("revoke", "2", key="ops", seq=NOW_SEQ)
    assert revoke.state.view.version("2").status is AdapterStatus.revoked  # type: ignore[union-attr]
    assert revoke.state.view.last_seq == seq_at(NOW + CLOCK_SKEW)  # the floor never goes down
    # a replayed revoke is still refused (its event_id is remembered)
    assert rejected(reg.send(revoke.event)) is Reason.replayed_event_id


def test_attack_a_revoke_signed_before_its_version_exists_is_not_replayed_onto_it() -> None:
    """ATTACK: a revoke of version 2 signed an hour before 2 existed was refused
    (``unknown_version``) and sits in the dead letters. Revoke ignores the seq floor, so
    whoever read it there replayed it, within its lifetime, once 2 was published, and 2
    was revoked. A revoke signed over ``CLOCK_SKEW`` before its version's publish is
    refused; one signed later (the operator's) still lands."""
    reg = Registry()
    reg.do("publish", "1")
    early = reg.event("revoke", "2", key="ops", seq=NOW_SEQ - 3_600_000_000)
    assert rejected(reg.send(early)) is Reason.unknown_version
    reg.do("publish", "2", seq=NOW_SEQ)
    assert rejected(reg.send(early)) is Reason.stale_seq
    assert reg.view().version("2").status is AdapterStatus.published
    reg.do("revoke", "2", key="ops", seq=NOW_SEQ - 60_000_000)  # a minute's clock skew
    assert reg.view().version("2").status is AdapterStatus.revoked


def test_huge_version_is_undone_by_revoking_it() -> None:
    """Rule: a publish must be newer than every *unrevoked* version, and a version number
    is never reused. A stolen key's 999999999 is revoked; the tenant publishes on."""
    reg = Registry()
    reg.do("publish", "1")
    reg.do("publish", "999999999.999999999")
    assert rejected(reg.send(reg.event("publish", "2"))) is Reason.version_not_newer
    reg.do("revoke", "999999999.999999999", key="ops")
    reg.do("publish", "2")
    assert (
        rejected(reg.send(reg.event("publish", "999999999.999999999"))) is Reason.version_not_newer
    )  # the revoked number is never reused
    assert rejected(reg.send(reg.event("publish", "1.5"))) is Reason.version_not_newer


@pytest.mark.parametrize(
    "setup",
    [
        [],  # 2 only published
        [("canary", {"canary_percent": 0.0})],  # a canary with no traffic never served
        [("retire", {})],  # retired straight from published
    ],
)
def test_rollback_to_a_never_released_version_is_refused(setup: list) -> None:  # type: ignore[type-arg]
    reg = Registry()
    reg.do("publish", "1")
    reg.do("promote", "1")
    reg.do("publish", "2")
    for action, fields in setup:
        reg.do(action, "2", **fields)
    # an ops key may roll back (and has no promote scope in this attack's spirit)
    assert (
        rejected(reg.send(reg.event("rollback", "1", key="ops", rollback_to="2")))
        is Reason.rollback_to_never_served
    )
    assert reg.view().active_version == "1"


def test_rollback_to_a_version_that_served_still_works() -> None:
    reg = Registry()
    reg.do("publish", "1")
    reg.do("canary", "1", canary_percent=5.0)  # served through the canary
    reg.do("retire", "1")
    reg.do("publish", "2")
    reg.do("promote", "2")
    assert reg.do("rollback", "2", key="ops", rollback_to="1").state.view.active_version == "1"
    assert reg.view().served_versions == ["1", "2"]


def test_legacy_view_without_served_versions_still_rolls_back_to_its_previous() -> None:
    reg = Registry()
    reg.do("publish", "1")
    reg.do("promote", "1")
    reg.do("publish", "2")
    reg.do("promote", "2")
    state = reg.states[A]
    reg.states[A] = state.model_copy(
        update={"view": state.view.model_copy(update={"served_versions": []})}
    )
    assert reg.do("rollback", "2").state.view.active_version == "1"


def test_priority_above_the_tenant_ceiling_is_refused() -> None:
    """beta is not listed in the keyring's tenants: its ceiling is gold, so its key cannot
    make an adapter never-evicted; acme is granted platinum."""
    reg = Registry()
    beta = dict(tenant_id="beta", adapter_id="beta-bot")
    plat = record("beta-bot", "1", tenant="beta").model_copy(update={"priority": Priority.platinum})
    assert (
        rejected(reg.send(reg.event("publish", "1", key="beta", record=plat, **beta)))
        is Reason.priority_above_ceiling
    )
    gold = plat.model_copy(update={"priority": Priority.gold})
    assert isinstance(
        reg.send(reg.event("publish", "1", key="beta", record=gold, **beta)), Accepted
    )
    mine = record(A, "1").model_copy(update={"priority": Priority.platinum})
    assert isinstance(reg.send(reg.event("publish", "1", record=mine)), Accepted)


# --- 3. artifacts bound to their owner ------------------------------------------------------


@pytest.mark.parametrize(
    "uri",
    [
        "s3://loraplane-artifacts/beta/{a}/1-{s}/",  # another tenant's prefix
        "s3://loraplane-artifacts/acme/other-bot/1-{s}/",  # another adapter's
        "s3://loraplane-artifacts/acme/{a}/2-{s}/",  # another version's
        "s3://loraplane-artifacts/acme/{a}/1-00000000/",  # other bytes
        "s3://loraplane-artifacts/{a}/1-{s}/",  # the old layout, without tenant
    ],
)
def test_publish_outside_the_adapters_own_prefix_is_refused(uri: str) -> None:
    reg = Registry()
    good = record(A, "1")
    bad = good.model_copy(update={"artifact_uri": uri.format(a=A, s=good.sha256[:8])})
    assert (
        rejected(reg.send(reg.event("publish", "1", record=bad))) is Reason.artifact_outside_prefix
    )


def test_publish_under_its_own_prefix_is_accepted_in_any_bucket() -> None:
    reg = Registry()
    good = record(A, "1")
    other = good.model_copy(
        update={"artifact_uri": good.artifact_uri.replace("loraplane-artifacts", "tenant-bucket")}
    )
    assert isinstance(reg.send(reg.event("publish", "1", record=other)), Accepted)


def test_time_seq_is_seq_at_now() -> None:
    from loraplane.lifecycle_events import time_seq

    before = seq_at(datetime.now(UTC))
    assert before <= time_seq() <= seq_at(datetime.now(UTC) + timedelta(seconds=1))


def test_a_non_canonical_signature_string_is_refused() -> None:
    """Base64 decoders ignore the unused low bits of the last character before ``=``: a
    64-byte signature has four spellings. Only the canonical one verifies, so a signature
    string cannot be edited into another that still verifies (found by the hypothesis test
    of registry_evidence: one-byte edits of a genuine view)."""
    from loraplane.schemas.signing import verify

    now = datetime(2026, 12, 1, tzinfo=UTC)
    kit = make_kit(now)
    event = kit.event("ci", "publish", "sql", "1", 1, now)
    assert event.signature.endswith("==")
    key = kit.keys["ci"].private_key.public_key()
    assert verify(event, key)
    last = event.signature[-3]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    base = alphabet.index(last) & ~0b1111
    for alias in alphabet[base : base + 16]:
        if alias == last:
            continue
        edited = event.model_copy(update={"signature": event.signature[:-3] + alias + "=="})
        assert not verify(edited, key), alias


def _fat_record(version: str) -> AdapterRecord:
    """A record as large as the schema lets a publish carry: 64 long module names."""
    modules = [f"m{i:02d}" + "x" * 125 for i in range(64)]
    base = record(A, version)
    return base.model_copy(
        update={"compatibility": base.compatibility.model_copy(update={"target_modules": modules})}
    )


def test_attack_no_accepted_view_is_larger_than_its_consumers_read() -> None:
    """Correctly signed publishes whose records are as large as the schema allows: the view
    carries every record and every event, so within the 256-event bound it outgrew the 1 MiB
    that Kafka carries and every consumer decodes. The registry accepted it into its table
    and could then never mirror it (nor any later event of that adapter, a revoke
    included): accepted state no worker would ever see. A view that would not fit is
    refused before it is accepted, and the last accepted one can still be revoked."""
    from loraplane.registry.evidence import ViewVerified, verify_view
    from loraplane.schemas.codec import MAX_MESSAGE_BYTES, decode
    from loraplane.schemas.registry import AdapterView

    reg = Registry()
    refused: Rejected | None = None
    for n in range(1, 200):
        fat = _fat_record(str(n))
        decision = reg.send(reg.event("publish", str(n), record=fat))
        if isinstance(decision, Rejected):
            refused = decision
            break
        assert len(encode(decision.state.view)) <= MAX_MESSAGE_BYTES
    assert refused is not None and refused.reason is Reason.history_full, refused
    assert "bytes" in refused.detail
    last = reg.view().versions[-1].version
    revoked = reg.send(reg.event("revoke", last, key="ops"))
    assert isinstance(revoked, Accepted), revoked
    view = decode(AdapterView, encode(revoked.state.view))  # what a consumer reads
    assert isinstance(verify_view(view, KIT.keyring, NOW), ViewVerified)


def test_attack_a_history_filled_by_one_key_can_still_be_revoked() -> None:
    """A CI key (it may not revoke) fills the adapter's history with canary steps up to
    the 256-event bound: the operator's revoke of the version, the one way to take it out
    of service without revoking keys, was refused as history_full. The last events are
    kept for revokes."""
    from loraplane.schemas.registry import MAX_EVIDENCE

    reg = Registry()
    reg.do("publish", "1")
    refused: Rejected | None = None
    for n in range(MAX_EVIDENCE):
        decision = reg.send(reg.event("canary", "1", canary_percent=float(n % 100)))
        if isinstance(decision, Rejected):
            refused = decision
            break
    assert refused is not None and refused.reason is Reason.history_full, refused
    revoked = reg.send(reg.event("revoke", "1", key="ops"))
    assert isinstance(revoked, Accepted), revoked
    assert revoked.state.view.versions[0].status is AdapterStatus.revoked


def test_attack_an_event_on_another_partition_than_its_keys_is_refused() -> None:
    """The registry's state of an adapter lives on the partition its key hashes to (the
    table's changelog partition is the event's). A genuine event put on another partition
    folded onto another shard's state of the adapter (none: a publish replayed after a
    revoke published the version again) and wrote a second state a restart could restore."""
    reg = Registry()
    publish = reg.event("publish", "1")
    home = partition_of(A, 3)
    elsewhere = (home + 1) % 3
    raw, key = encode(publish), A.encode()
    decision = real_evaluate(raw, reg.keyring, reg.states.get, NOW, key, placed=(elsewhere, 3))
    assert isinstance(decision, Rejected) and decision.reason is Reason.wrong_partition
    assert decision.audit.reason is Reason.wrong_partition
    decision = real_evaluate(raw, reg.keyring, reg.states.get, NOW, key, placed=(home, 3))
    assert isinstance(decision, Accepted)
    # the key is checked first: a key that is not the adapter's is that, wherever it is
    other = real_evaluate(raw, reg.keyring, reg.states.get, NOW, b"x", placed=(elsewhere, 3))
    assert isinstance(other, Rejected) and other.reason is Reason.key_mismatch
