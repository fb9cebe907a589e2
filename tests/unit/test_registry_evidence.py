"""ATTACK tests of the registry view's evidence (registry.evidence.verify_view).

Before this change a consumer believed any AdapterView on the registry topic; each test here
builds what a topic writer can build (from genuine signed events too) and checks the verdict.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.registry.evidence import (
    Checkpoint,
    ViewRefused,
    ViewVerified,
    verify_view,
)
from loraplane.registry.fold import Accepted, AdapterState, evaluate
from loraplane.schemas.keyring import Keyring, Scopes
from loraplane.schemas.lifecycle import LifecycleEvent
from loraplane.schemas.reasons import RegistryViewRejection as ViewReason
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.signing import SigningKey
from tests.lifecycle_kit import make_kit, record

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
KIT = make_kit(NOW)
A, B = "support-bot", "sql-bot"


def history(adapter_id: str, start: int = 1) -> list[LifecycleEvent]:
    """publish 1, canary 1, promote 1, publish 2, promote 2, rollback to 1, revoke 2."""
    steps: list[tuple[str, str, dict[str, Any]]] = [
        ("publish", "1", {}),
        ("canary", "1", {"canary_percent": 10.0}),
        ("promote", "1", {}),
        ("publish", "2", {}),
        ("promote", "2", {}),
        ("rollback", "2", {}),
        ("revoke", "2", {}),
    ]
    return [
        KIT.event(
            "ops" if action == "revoke" else "ci",
            action,
            adapter_id,
            version,
            start + n,
            NOW + timedelta(seconds=n),
            **fields,
        )
        for n, (action, version, fields) in enumerate(steps)
    ]


def fold(events: list[LifecycleEvent], keyring: Keyring = KIT.keyring) -> AdapterView | None:
    """What the registry would publish after ``events`` (None once one is refused)."""
    state: AdapterState | None = None
    for e in events:
        d = evaluate(
            e, keyring, lambda a, s=state: s if s and s.view.adapter_id == a else None, e.issued_at
        )
        if not isinstance(d, Accepted):
            return None
        state = d.state
    return state.view if state else None


HIST_A, HIST_B = history(A), history(B, start=100)
VIEW_A = fold(HIST_A)
assert VIEW_A is not None


def refused(verdict: object) -> ViewReason:
    assert isinstance(verdict, ViewRefused), verdict
    return verdict.reason


def edited(view: AdapterView, change: Any) -> AdapterView:
    """The view as JSON, changed by ``change`` and parsed again (what a topic writer sends)."""
    data = json.loads(view.model_dump_json())
    change(data)
    return AdapterView.model_validate(data)


def test_a_view_the_registry_published_verifies_even_after_its_events_expired() -> None:
    for n in range(1, len(HIST_A) + 1):
        view = fold(HIST_A[:n])
        assert view is not None
        assert isinstance(verify_view(view, KIT.keyring, NOW + timedelta(days=20)), ViewVerified)


def test_a_view_without_evidence_is_refused() -> None:
    bare = VIEW_A.model_copy(update={"evidence": []})
    assert refused(verify_view(bare, KIT.keyring, NOW)) is ViewReason.no_evidence


def test_no_keyring_trusts_nothing() -> None:
    assert refused(verify_view(VIEW_A, None, NOW)) is ViewReason.keyring_unavailable


def _set_version(field: str, value: object, version: str = "1") -> Any:
    def change(d: dict[str, Any]) -> None:
        for r in d["versions"]:
            if r["version"] == version:
                r[field] = value

    return change


def _tenant(d: dict[str, Any]) -> None:
    d["tenant_id"] = "evil"
    for r in d["versions"]:
        r["tenant_id"] = "evil"


def _reactivate_revoked(d: dict[str, Any]) -> None:
    for r in d["versions"]:
        r["status"] = "active" if r["version"] == "2" else "retired"
    d["active_version"] = "2"


@pytest.mark.parametrize(
    "change",
    [
        _set_version("sha256", "0" * 64),
        _set_version("artifact_uri", "s3://loraplane-artifacts/evil/support-bot/1-00000000/"),
        _set_version("size_bytes", 1),
        _set_version("rank", 4),
        _tenant,
        _reactivate_revoked,
        lambda d: d.update(last_seq=d["last_seq"] + 1),
    ],
    ids=["sha256", "artifact_uri", "size", "rank", "tenant_id", "status", "last_seq"],
)
def test_an_edited_field_is_refused(change: Any) -> None:
    """ATTACK: genuine evidence, an edited view. The edit no longer folds from the events."""
    try:
        forged = edited(VIEW_A, change)
    except ValueError:
        return  # the schema already refuses it: the worker dead-letters it as malformed
    assert refused(verify_view(forged, KIT.keyring, NOW)) is ViewReason.mismatch


def test_an_edited_event_is_refused() -> None:
    """ATTACK: edit the signed publish record itself (sha256 and uri of the attacker's
    upload) and the view to match: the signature no longer verifies."""
    evil = record(A, "1").model_copy(update={"sha256": "f" * 64})
    publish = HIST_A[0].model_copy(update={"record": evil})
    forged_view = fold([publish], Keyring())  # nobody's key: just for the shape
    assert forged_view is None
    bad = VIEW_A.model_copy(update={"evidence": [publish, *VIEW_A.evidence[1:]]})
    verdict = verify_view(bad, KIT.keyring, NOW)
    assert refused(verdict) is ViewReason.evidence_rejected
    assert "bad_signature" in verdict.detail


@pytest.mark.parametrize(
    ("signer", "inner"),
    [
        (SigningKey.generate("ci-acme", "ci-acme-ci"), "bad_signature"),  # same id, other key
        (SigningKey.generate("mallory", "mallory-1"), "unknown_key"),
        (KIT.keys["revoked"], "key_revoked"),
        (KIT.keys["beta"], "tenant_out_of_scope"),
    ],
)
def test_forged_evidence_is_refused(signer: SigningKey, inner: str) -> None:
    """ATTACK: the attacker signs its own events (and folds them with its own keyring, so
    the view is exactly what they fold into): our keyring does not vouch for them."""
    events = [e.model_copy(update={"signature": ""}) for e in HIST_A[:3]]
    signed = [signer.sign(e) for e in events]
    own = Keyring(
        keys=[
            k.model_copy(
                update={
                    "key_id": signer.key_id,
                    "public_key": signer.public_key_b64,
                    "revoked": False,
                    "scopes": Scopes(tenants="*", actions="*"),
                    "publisher": signer.publisher,
                }
            )
            for k in KIT.keyring.keys[:1]
        ]
    )
    view = fold(signed, own)
    assert view is not None
    verdict = verify_view(view, KIT.keyring, NOW)
    assert refused(verdict) is ViewReason.evidence_rejected
    assert inner in verdict.detail


def test_evidence_of_another_adapter_is_refused() -> None:
    """ATTACK: B's genuine evidence under A's name, or one of B's events spliced into A's."""
    view_b = fold(HIST_B)
    assert view_b is not None
    as_a = view_b.model_copy(update={"adapter_id": A})
    assert refused(verify_view(as_a, KIT.keyring, NOW)) is ViewReason.foreign_evidence
    spliced = VIEW_A.model_copy(update={"evidence": [*VIEW_A.evidence[:-1], HIST_B[-1]]})
    assert refused(verify_view(spliced, KIT.keyring, NOW)) is ViewReason.foreign_evidence


def test_a_replayed_older_view_is_refused_once_a_newer_one_was_accepted() -> None:
    """ATTACK (TUF rollback/freeze): before the revoke of 2, version 2 was active. The
    genuine older view is replayed after the worker accepted the revoke."""
    old = fold(HIST_A[:5])
    assert old is not None and old.active_version == "2"
    fresh = verify_view(old, KIT.keyring, NOW)
    assert isinstance(fresh, ViewVerified)  # alone it is genuine (the residual risk)
    seen = Checkpoint.from_view(VIEW_A)
    assert refused(verify_view(old, KIT.keyring, NOW, seen)) is ViewReason.rollback
    assert isinstance(verify_view(VIEW_A, KIT.keyring, NOW, seen), ViewVerified)


def test_a_truncated_or_forked_history_is_refused() -> None:
    """ATTACK: drop a middle event (the canary) and fold the rest: a genuine-looking view
    whose history does not extend the accepted one."""
    accepted = Checkpoint.from_view(fold(HIST_A[:3]))  # type: ignore[arg-type]
    skipped = fold([HIST_A[0], *HIST_A[2:]])
    assert skipped is not None
    assert refused(verify_view(skipped, KIT.keyring, NOW, accepted)) is ViewReason.rollback
    truncated = VIEW_A.model_copy(update={"evidence": VIEW_A.evidence[:-1]})
    assert refused(verify_view(truncated, KIT.keyring, NOW)) is ViewReason.mismatch


def test_a_key_revoked_later_withdraws_what_it_signed() -> None:
    keyring = Keyring(
        keys=[
            k.model_copy(update={"revoked": True}) if k.key_id == KIT.keys["ci"].key_id else k
            for k in KIT.keyring.keys
        ]
    )
    assert refused(verify_view(VIEW_A, keyring, NOW)) is ViewReason.evidence_rejected


def test_evidence_from_the_future_is_refused() -> None:
    late = fold(history(A)[:1])
    assert late is not None
    assert (
        refused(verify_view(late, KIT.keyring, NOW - timedelta(hours=1)))
        is ViewReason.evidence_rejected
    )


POOL = [*HIST_A, *HIST_B]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.sampled_from(range(len(POOL))), min_size=1, max_size=10),
    st.sampled_from([A, B]),
    st.booleans(),
)
def test_mix_and_match_of_two_adapters_never_verifies_into_a_foreign_state(
    picks: list[int], claimed: str, with_checkpoint: bool
) -> None:
    """PROPERTY: any sequence of genuine events from two adapters, folded by the attacker
    into a view (or not foldable at all, then sent with A's honest view's fields): an
    accepted view has only the claimed adapter's events, is exactly their fold, and (given
    the full history as checkpoint) extends that history."""
    events = [POOL[i] for i in picks]
    view = fold(events)
    if view is None or view.adapter_id != claimed:
        base = VIEW_A if claimed == A else fold(HIST_B)
        assert base is not None
        view = base.model_copy(update={"evidence": events})
    full = HIST_A if claimed == A else HIST_B
    previous = (
        Checkpoint(claimed, full[-1].seq, tuple(e.event_id for e in full))
        if with_checkpoint
        else None
    )
    verdict = verify_view(view, KIT.keyring, NOW, previous)
    if isinstance(verdict, ViewVerified):
        assert all(e.adapter_id == claimed for e in view.evidence)
        assert fold(list(view.evidence)) == view.model_copy(
            update={"updated_at": fold(list(view.evidence)).updated_at}
        )  # type: ignore[union-attr]
        if previous is not None:
            assert [e.event_id for e in view.evidence][: len(full)] == list(previous.event_ids)


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=1, max_value=len(HIST_A) - 1))
def test_every_genuine_prefix_is_a_rollback_after_the_full_history(n: int) -> None:
    """PROPERTY (truncated evidence): every shorter genuine history is refused against a
    checkpoint of the full one."""
    view = fold(HIST_A[:n])
    assert view is not None
    assert (
        refused(verify_view(view, KIT.keyring, NOW, Checkpoint.from_view(VIEW_A)))
        is ViewReason.rollback
    )


RAW_A = VIEW_A.model_dump_json().encode()


@settings(max_examples=150, deadline=None)
@given(
    st.integers(min_value=0, max_value=len(RAW_A) - 1),
    st.sampled_from(b'0123456789abcdef"{}[],:-. xyzAZ'),
)
def test_any_one_byte_edit_of_a_genuine_view_is_refused_or_changes_nothing(
    at: int, byte: int
) -> None:
    """PROPERTY (edited fields, the whole class): change any one byte of a genuine view's
    JSON. Either it is no view any more (the worker dead-letters it as malformed), or it is
    the same view, or it is refused."""
    from loraplane.schemas.codec import SchemaError, decode

    raw = RAW_A[:at] + bytes([byte]) + RAW_A[at + 1 :]
    try:
        view = decode(AdapterView, raw)
    except SchemaError:
        return
    same = view.model_copy(update={"updated_at": VIEW_A.updated_at}) == VIEW_A
    verdict = verify_view(view, KIT.keyring, NOW)
    assert same or isinstance(verdict, ViewRefused), (at, bytes([byte]), verdict)


def _calls(run: Any, name: str) -> int:
    """How many times a function whose name contains ``name`` ran during ``run()``: a
    count of work done, not a time."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.runcall(run)
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return sum(calls for (_file, _line, func), (calls, *_rest) in stats.items() if name in func)


def _long_history(events: int) -> AdapterView:
    """A genuine history of one publish and ``events - 1`` canary steps."""
    steps = [KIT.event("ci", "publish", "long-bot", "1", 1, NOW)] + [
        KIT.event(
            "ci",
            "canary",
            "long-bot",
            "1",
            1 + n,
            NOW + timedelta(seconds=n),
            canary_percent=n % 100,
        )
        for n in range(1, events)
    ]
    view = fold(steps)
    assert view is not None
    return view


def test_attack_copies_of_a_long_genuine_history_cost_work_in_proportion_to_it() -> None:
    """ATTACK: whoever may write the registry topic sends copies of a genuine 200-event
    history (each a new record every consumer folds again). Before, each step of the fold
    validated the whole history so far (~n^2/2 event validations) and every copy verified
    every signature again (an Ed25519 verification per event): ~85 ms of every consumer's
    CPU per 118 KB record. Now a fold validates each event a bounded number of times, and
    signatures verified once are not verified again."""
    view = _long_history(200)
    assert isinstance(verify_view(view, KIT.keyring, NOW), ViewVerified)
    copy = AdapterView.model_validate_json(view.model_dump_json())
    assert _calls(lambda: verify_view(copy, KIT.keyring, NOW), "_action_fields") <= 2 * 200
    assert _calls(lambda: verify_view(copy, KIT.keyring, NOW), "verify' of") == 0


def test_attack_a_remembered_signature_vouches_for_its_own_bytes_only() -> None:
    """ATTACK: a genuine event's signature, once verified and remembered, pasted onto an
    edited event (another version, another key's id, another adapter) never verifies."""
    from loraplane.schemas.signing import public_key, verify

    event = HIST_A[0]
    key = public_key(KIT.keys["ci"].public_key_b64)
    assert verify(event, key) and verify(event, key)  # the second from memory
    for change in ({"version": "9"}, {"adapter_id": B}, {"reason": "x"}):
        forged = event.model_copy(update=change)
        assert not verify(forged, key), change
    other = public_key(KIT.keys["ops"].public_key_b64)
    assert not verify(event, other)
