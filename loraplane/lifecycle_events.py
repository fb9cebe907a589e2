"""Building signed lifecycle events, for the CLI (CI and ops) and for tests.

``seq`` is time-based: microseconds since the epoch when the event is built. Every CI job
and operator thus gets a larger seq than any event issued before it without sharing a
counter; two events for one adapter issued within the same microsecond, or by hosts whose
clocks disagree by more than the gap between them, are ordered by the clock and the later
arrival with the smaller seq is rejected as ``stale_seq`` (re-run the command).
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta

from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.base import now_utc
from loraplane.schemas.lifecycle import LifecycleAction, LifecycleEvent
from loraplane.schemas.signing import SigningKey

__all__ = ["DEFAULT_TTL", "signed_event", "time_seq"]

DEFAULT_TTL = timedelta(hours=1)


def time_seq() -> int:
    return time.time_ns() // 1000


def signed_event(
    key: SigningKey,
    action: LifecycleAction,
    *,
    adapter_id: str,
    tenant_id: str,
    base_model: str,
    version: str,
    record: AdapterRecord | None = None,
    canary_percent: float | None = None,
    rollback_to: str | None = None,
    reason: str = "",
    seq: int | None = None,
    now: datetime | None = None,
    ttl: timedelta = DEFAULT_TTL,
) -> LifecycleEvent:
    issued = now or now_utc()
    event = LifecycleEvent(
        event_id=f"{action}-{uuid.uuid4().hex}",
        action=action,
        seq=seq or time_seq(),
        issued_at=issued,
        expires_at=issued + ttl,
        publisher=key.publisher,
        key_id=key.key_id,
        tenant_id=tenant_id,
        adapter_id=adapter_id,
        base_model=base_model,
        version=version,
        record=record,
        canary_percent=canary_percent,
        rollback_to=rollback_to,
        reason=reason,
    )
    return key.sign(event)
