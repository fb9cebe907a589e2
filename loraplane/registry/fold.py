"""The registry's trust boundary and state machine. Pure: no I/O, the clock is an argument.

``evaluate`` takes one lifecycle message (raw bytes as they came off Kafka, or a decoded
event), the keyring, the registry's current state of that adapter and ``now``, and returns
``Accepted`` (the adapter's new state) or ``Rejected`` (a stable
``schemas.reasons.RegistryRejection`` and a detail). The checks run in a fixed order (bytes
and key, the signing key and its signature, scopes and priority ceiling, freshness and seq,
ownership, the action's own rules, the new view's size), so each hostile event gets one
reason: the order and every reason are in docs/lifecycle.md, "Rejection reasons".

The new view carries every accepted event of the adapter (``AdapterView.evidence``), so a
consumer of the registry topic can fold them again through this function with its own
keyring (``registry.evidence.verify_view``) instead of trusting the topic. Redelivery after
a crash cannot double-apply an event: the replay set (each event id until the event
expires) and the seq check reject the second copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from pydantic import Field

from loraplane.kernel.command_partition import partition_of
from loraplane.schemas.adapter import (
    AdapterRecord,
    AdapterStatus,
    Release,
    artifact_uri_problem,
    priority_rank,
)
from loraplane.schemas.audit import AuditRecord
from loraplane.schemas.base import Identifier, StrictModel, Timestamp, version_key
from loraplane.schemas.codec import SchemaError, decode_signed, encode
from loraplane.schemas.keyring import Keyring, KeyRole, SignerRefusal, signer, window_refusal
from loraplane.schemas.lifecycle import LifecycleAction, LifecycleEvent, seq_at
from loraplane.schemas.reasons import NO_REASON
from loraplane.schemas.reasons import RegistryRejection as Reason
from loraplane.schemas.registry import (
    MAX_EVIDENCE,
    MAX_VIEW_BYTES,
    REVOKE_ROOM_BYTES,
    REVOKE_ROOM_EVENTS,
    AdapterView,
)

__all__ = [
    "CLOCK_SKEW",
    "MAX_EVENT_LIFETIME",
    "Accepted",
    "AdapterState",
    "Decision",
    "Rejected",
    "StateLookup",
    "evaluate",
]

MAX_EVENT_LIFETIME = timedelta(days=7)
"""Bounds the replay set: an event id is remembered until its event expires."""
CLOCK_SKEW = timedelta(minutes=5)
"""How far in the future ``issued_at`` may be (publishers' clocks are not ours)."""


class AdapterState(StrictModel):
    """What the registry table keeps per adapter: the public view plus the replay set."""

    view: AdapterView
    seen: dict[Identifier, Timestamp] = Field(
        default_factory=dict, description="accepted event_id -> its expires_at"
    )


@dataclass(frozen=True)
class Accepted:
    event: LifecycleEvent
    state: AdapterState
    audit: AuditRecord

    @property
    def adapter_id(self) -> str:
        return self.event.adapter_id


@dataclass(frozen=True)
class Rejected:
    reason: Reason
    detail: str
    audit: AuditRecord
    event: LifecycleEvent | None = None


Decision = Accepted | Rejected
StateLookup = Callable[[str], AdapterState | None]


class _Reject(Exception):
    def __init__(self, reason: Reason, detail: str) -> None:
        self.reason, self.detail = reason, detail


def evaluate(
    message: bytes | LifecycleEvent,
    keyring: Keyring | None,
    registry: StateLookup,
    now: datetime,
    key: bytes | None = None,
    *,
    admitting: bool = True,
    placed: tuple[int, int] | None = None,
) -> Decision:
    """Decide one lifecycle message. Never raises for any input bytes.

    ``registry(adapter_id)`` returns the adapter's current state or None; ``key`` is the
    Kafka message key (checked against adapter_id when given); ``keyring=None`` means the
    keyring could not be read, and then nothing is trusted. ``admitting``: the registry
    agent deciding a new event, which also applies the admission rules: refuse an event
    whose view would encode over ``MAX_VIEW_BYTES`` or, for anything but a revoke, leave
    less than ``REVOKE_ROOM_EVENTS`` events and ``REVOKE_ROOM_BYTES`` bytes for revokes; and
    a revoke signed over ``CLOCK_SKEW`` before its version's publish (``_check_revoke``). A
    consumer folding a view's evidence again turns them off: the view it holds was decoded
    within the message limit and the schema's ``MAX_EVIDENCE``, and views the registry
    accepted before these rules existed must still verify. ``placed``: the message's
    partition and the topic's partition count, checked against the partition its key hashes
    to (``wrong_partition``): the registry's state of an adapter lives on that partition
    (its table's changelog partition is the event's), and an event elsewhere would fold onto
    another shard's state of the adapter (none: a replay taken as new) and write a second
    one, either of which a restart may restore.
    """
    raw = message if isinstance(message, bytes) else encode(message)
    event = message if isinstance(message, LifecycleEvent) else None
    try:
        if event is None:
            event = _decode(raw)
        if key is not None and key != event.adapter_id.encode():
            raise _Reject(
                Reason.key_mismatch,
                f"message key {key[:64]!r} is not adapter_id {event.adapter_id!r}",
            )
        if placed is not None:
            partition, partitions = placed
            if partition != (home := partition_of(event.adapter_id, partitions)):
                raise _Reject(
                    Reason.wrong_partition,
                    f"an event of {event.adapter_id!r} is on partition {partition}, not {home}",
                )
        _check_trust(event, keyring, now)
        state = registry(event.adapter_id)
        _check_fresh(event, state, now, admitting)
        view = _apply(event, state.view if state else None, now)
        if admitting:
            _check_room(event, view)
            if state is not None and event.action is LifecycleAction.revoke:
                _check_revoke(event, state.view)
    except _Reject as r:
        return Rejected(r.reason, r.detail, _audit(raw, event, now, r.reason, r.detail), event)
    seen = {eid: exp for eid, exp in (state.seen if state else {}).items() if exp > now}
    seen[event.event_id] = event.expires_at
    return Accepted(
        event,
        # Built from parts validated already (the view by ``_apply``, each replay-set entry
        # when its event was): validating them again would cost a pass over the history on
        # every step of a fold.
        AdapterState.model_construct(view=view, seen=seen),
        _audit(raw, event, now, None, f"active={view.active_version}"),
    )


def _decode(raw: bytes) -> LifecycleEvent:
    try:
        return decode_signed(LifecycleEvent, raw)
    except SchemaError as exc:
        detail = "; ".join(f"{loc}: {msg}" for loc, msg in exc.errors)
        if any(
            loc == "canary_percent" and ("greater than" in msg or "less than" in msg)
            for loc, msg in exc.errors
        ):
            raise _Reject(Reason.canary_percent_out_of_range, detail) from None
        raise _Reject(Reason(exc.reason), detail) from None


def _check_trust(event: LifecycleEvent, keyring: Keyring | None, now: datetime) -> None:
    entry = signer(keyring, event, KeyRole.publisher, now, publisher=event.publisher)
    if isinstance(entry, SignerRefusal):
        raise _Reject(Reason(entry.problem.value), entry.detail)
    assert keyring is not None  # signer refuses a missing keyring
    # A consumer folds the event again at its issued_at (registry.evidence): the key must
    # be valid then too, or every later view of the adapter fails there.
    refused = window_refusal(entry, event.issued_at)
    if refused is not None:
        raise _Reject(
            Reason(refused.problem.value), f"at issued_at {event.issued_at}: {refused.detail}"
        )
    if not entry.scopes.allows_action(event.action):
        raise _Reject(Reason.action_out_of_scope, f"key {entry.key_id} may not sign {event.action}")
    if not entry.scopes.allows_tenant(event.tenant_id):
        raise _Reject(
            Reason.tenant_out_of_scope,
            f"key {entry.key_id} may not sign for tenant {event.tenant_id}",
        )
    if event.record is not None:
        ceiling = keyring.max_priority(event.tenant_id)
        if priority_rank(event.record.priority) > priority_rank(ceiling):
            raise _Reject(
                Reason.priority_above_ceiling,
                f"tenant {event.tenant_id} may publish at most {ceiling}, not "
                f"{event.record.priority}",
            )


def _check_fresh(
    event: LifecycleEvent, state: AdapterState | None, now: datetime, admitting: bool
) -> None:
    """The event's times, seq and id against ``now`` and the adapter's state. An event id of
    the adapter's history is never taken again when ``admitting`` (its replay set forgets
    an id once the event expires, but a consumer folding the evidence at each issued_at may
    still hold it)."""
    if event.expires_at <= now:
        raise _Reject(Reason.event_expired, f"expired at {event.expires_at}")
    if event.issued_at > now + CLOCK_SKEW:
        raise _Reject(Reason.event_from_future, f"issued_at {event.issued_at} is ahead of now")
    if event.expires_at - event.issued_at > MAX_EVENT_LIFETIME:
        raise _Reject(
            Reason.event_lifetime_too_long, f"lifetime over {MAX_EVENT_LIFETIME.days} days"
        )
    # The earlier of now and issued_at: a consumer folds the event again at its issued_at.
    ceiling = seq_at(min(now, event.issued_at) + CLOCK_SKEW)
    if event.seq > ceiling:
        raise _Reject(
            Reason.seq_from_future,
            f"seq {event.seq} > {ceiling}, microseconds since the epoch of now (or of "
            f"issued_at, when earlier) + {CLOCK_SKEW.seconds // 60} min",
        )
    if state is None:
        return
    if event.event_id in state.seen or (
        admitting and any(e.event_id == event.event_id for e in state.view.evidence)
    ):
        raise _Reject(Reason.replayed_event_id, f"event_id {event.event_id} was already accepted")
    if event.seq <= state.view.last_seq and event.action is not LifecycleAction.revoke:
        raise _Reject(Reason.stale_seq, f"seq {event.seq} <= last accepted {state.view.last_seq}")
    if event.tenant_id != state.view.tenant_id:
        raise _Reject(
            Reason.tenant_mismatch,
            f"adapter belongs to tenant {state.view.tenant_id}, not {event.tenant_id}",
        )
    if event.base_model != state.view.base_model:
        raise _Reject(
            Reason.base_model_mismatch,
            f"adapter is for {state.view.base_model}, not {event.base_model}",
        )


def _apply(event: LifecycleEvent, view: AdapterView | None, now: datetime) -> AdapterView:
    """The adapter's next view; raises _Reject when the action does not fit the state."""
    if event.action is LifecycleAction.publish:
        records = _publish(event, view)
    else:
        if view is None:
            raise _Reject(
                Reason.unknown_version, f"adapter {event.adapter_id} has no published version"
            )
        records = {r.version: r for r in view.versions}
        current = _known(view, event.version, Reason.unknown_version)
        _TRANSITIONS[event.action](event, view, current, records)
    evidence = [*(view.evidence if view else []), event]
    if len(evidence) > MAX_EVIDENCE:
        raise _Reject(
            Reason.history_full,
            f"adapter {event.adapter_id} already has {MAX_EVIDENCE} accepted events",
        )
    versions = sorted(records.values(), key=lambda r: version_key(r.version))
    active = next((r.version for r in versions if r.status is AdapterStatus.active), None)
    served = list(view.served_versions) if view else []
    listed = set(served)
    for r in versions:
        serving = r.status is AdapterStatus.active or (
            r.status is AdapterStatus.canary and r.release.canary_percent > 0
        )
        if serving and r.version not in listed:
            served.append(r.version)
            listed.add(r.version)
    # Validated without the evidence, which is then attached as it is: every event in it
    # was validated when it was decided, and validating the list again on each step made
    # folding a history (a consumer's ``verify_view``) quadratic in its length. The
    # evidence's consistency with last_seq and last_event_id holds by construction.
    return AdapterView(
        adapter_id=event.adapter_id,
        tenant_id=event.tenant_id,
        base_model=event.base_model,
        active_version=active,
        versions=versions,
        last_seq=max(event.seq, view.last_seq if view else 0),
        last_event_id=event.event_id,
        updated_at=now,
        served_versions=sorted(served, key=version_key),
    ).model_copy(update={"evidence": evidence})


def _check_room(event: LifecycleEvent, view: AdapterView) -> None:
    """The view fits the one registry message it must travel in (``MAX_VIEW_BYTES``) and,
    unless ``event`` is a revoke, leaves room for revokes."""
    revoke = event.action is LifecycleAction.revoke
    if not revoke and len(view.evidence) > MAX_EVIDENCE - REVOKE_ROOM_EVENTS:
        raise _Reject(
            Reason.history_full,
            f"adapter {event.adapter_id} already has {len(view.evidence) - 1} accepted "
            f"events; the last {REVOKE_ROOM_EVENTS} of {MAX_EVIDENCE} are for revokes",
        )
    limit = MAX_VIEW_BYTES - (0 if revoke else REVOKE_ROOM_BYTES)
    size = len(encode(view))
    if size > limit:
        raise _Reject(
            Reason.history_full,
            f"adapter {event.adapter_id}'s view would be {size} bytes, over the {limit} "
            f"one registry message carries for a {event.action}",
        )


def _check_revoke(event: LifecycleEvent, view: AdapterView) -> None:
    """A revoke signed before its version was published (more than ``CLOCK_SKEW`` before
    the publish's seq) is refused: revoke ignores the seq floor, so such a revoke, refused
    as ``unknown_version`` and readable in the dead letters, could otherwise be replayed
    within its lifetime once the version exists. An operator's revoke is never caught: a
    publish's seq is at most ``CLOCK_SKEW`` ahead of the time it was accepted."""
    wanted = version_key(event.version)
    published = next(
        (
            e.seq
            for e in view.evidence
            if e.action is LifecycleAction.publish and version_key(e.version) == wanted
        ),
        None,
    )
    skew = CLOCK_SKEW // timedelta(microseconds=1)  # seq counts microseconds
    if published is not None and event.seq < published - skew:
        raise _Reject(
            Reason.stale_seq,
            f"revoke seq {event.seq} was signed before version {event.version} was "
            f"published (seq {published})",
        )


def _publish(event: LifecycleEvent, view: AdapterView | None) -> dict[str, AdapterRecord]:
    record = event.record
    assert record is not None  # the model guarantees it for publish
    if record.status is not AdapterStatus.published or record.release != Release():
        raise _Reject(
            Reason.invalid,
            "record.status must be 'published' and record.release "
            "empty: canary and promote are their own events",
        )
    problem = artifact_uri_problem(record)
    if problem:
        raise _Reject(Reason.artifact_outside_prefix, problem)
    records = {r.version: r for r in view.versions} if view else {}
    same = view.version(event.version) if view else None
    if same is not None:
        raise _Reject(
            Reason.version_not_newer,
            f"{event.version} was already published ({same.status}); a version "
            f"number is never reused",
        )
    # Revoked versions do not count: a huge version published with a stolen key is undone
    # by revoking it, and the tenant publishes on from its newest unrevoked version.
    newest = max(
        (r for r in records.values() if r.status is not AdapterStatus.revoked),
        key=lambda r: version_key(r.version),
        default=None,
    )
    if newest is not None and version_key(event.version) <= version_key(newest.version):
        raise _Reject(
            Reason.version_not_newer,
            f"{event.version} is not newer than {newest.version}; going back is "
            f"only the explicit rollback action",
        )
    records[record.version] = record
    return records


def _known(view: AdapterView, version: str, unknown: Reason) -> AdapterRecord:
    record = view.version(version)
    if record is None:
        raise _Reject(unknown, f"version {version} was never published for {view.adapter_id}")
    if record.status is AdapterStatus.revoked:
        raise _Reject(Reason.version_revoked, f"version {record.version} is revoked")
    return record


def _set(
    records: dict[str, AdapterRecord],
    record: AdapterRecord,
    status: AdapterStatus,
    canary_percent: float = 0.0,
    rollback_to: str | None = None,
) -> None:
    records[record.version] = record.model_copy(
        update={
            "status": status,
            "release": Release(canary_percent=canary_percent, rollback_to=rollback_to),
        }
    )


def _refuse_status(record: AdapterRecord, *bad: AdapterStatus, hint: str = "") -> None:
    if record.status in bad:
        raise _Reject(
            Reason.invalid_transition, f"version {record.version} is {record.status}{hint}"
        )


def _canary(
    event: LifecycleEvent,
    view: AdapterView,
    current: AdapterRecord,
    records: dict[str, AdapterRecord],
) -> None:
    _refuse_status(
        current,
        AdapterStatus.active,
        AdapterStatus.retired,
        hint="; canary applies to published or canary versions",
    )
    _set(records, current, AdapterStatus.canary, event.canary_percent or 0.0)


def _promote(
    event: LifecycleEvent,
    view: AdapterView,
    current: AdapterRecord,
    records: dict[str, AdapterRecord],
) -> None:
    _refuse_status(
        current,
        AdapterStatus.active,
        AdapterStatus.retired,
        hint="; use rollback to re-activate a retired version",
    )
    previous = view.active
    if previous is not None:
        _set(records, previous, AdapterStatus.retired, rollback_to=previous.release.rollback_to)
    _set(records, current, AdapterStatus.active, rollback_to=previous.version if previous else None)


def _rollback(
    event: LifecycleEvent,
    view: AdapterView,
    current: AdapterRecord,
    records: dict[str, AdapterRecord],
) -> None:
    if current.status is not AdapterStatus.active:
        raise _Reject(
            Reason.invalid_transition,
            f"version {current.version} is {current.status}, not active; rollback "
            f"applies to the active version (retire a canary instead)",
        )
    wanted = event.rollback_to or current.release.rollback_to
    if wanted is None:
        raise _Reject(
            Reason.rollback_to_unknown,
            f"{current.version} has no previous version; name one in rollback_to",
        )
    target = _known(view, wanted, Reason.rollback_to_unknown)
    if target.version == current.version:
        raise _Reject(Reason.invalid_transition, "rollback_to is the active version")
    if not view.has_served(target.version):
        raise _Reject(
            Reason.rollback_to_never_served,
            f"version {target.version} never served (never active, never a canary "
            f"with traffic); releasing it is promote, not rollback",
        )
    _set(records, current, AdapterStatus.retired, rollback_to=current.release.rollback_to)
    _set(records, target, AdapterStatus.active, rollback_to=target.release.rollback_to)


def _retire(
    event: LifecycleEvent,
    view: AdapterView,
    current: AdapterRecord,
    records: dict[str, AdapterRecord],
) -> None:
    _refuse_status(current, AdapterStatus.retired)
    _set(records, current, AdapterStatus.retired, rollback_to=current.release.rollback_to)


def _revoke(
    event: LifecycleEvent,
    view: AdapterView,
    current: AdapterRecord,
    records: dict[str, AdapterRecord],
) -> None:
    _set(records, current, AdapterStatus.revoked)


_TRANSITIONS = {
    LifecycleAction.canary: _canary,
    LifecycleAction.promote: _promote,
    LifecycleAction.rollback: _rollback,
    LifecycleAction.retire: _retire,
    LifecycleAction.revoke: _revoke,
}


def _audit(
    raw: bytes, event: LifecycleEvent | None, now: datetime, reason: Reason | None, detail: str
) -> AuditRecord:
    """The audit record of one decision. Its id derives from the bytes and the outcome, so
    deciding the same message the same way twice yields one id readers can deduplicate."""
    outcome = str(reason or "accepted").encode()
    return AuditRecord(
        event_id=f"registry-{hashlib.sha256(outcome + b'|' + raw).hexdigest()[:40]}",
        ts=now,
        component="registry",
        action=str(event.action) if event else "unknown",
        decision="rejected" if reason else "accepted",
        reason=reason or NO_REASON,
        subject_event_id=event.event_id if event else None,
        tenant_id=event.tenant_id if event else None,
        adapter_id=event.adapter_id if event else None,
        version=event.version if event else None,
        actor=event.publisher if event else "",
        detail=detail[:2048],
    )
