"""Signed adapter lifecycle events: the only way an adapter version enters or leaves service.

What is signed: ``tagged(SIGNING_DOMAIN, event without "signature")`` — every other field,
including the nested record, event_id, seq and both timestamps. See schemas.canonical.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Literal

from pydantic import Field, model_validator

from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.base import Identifier, StrictModel, Timestamp, Version
from loraplane.schemas.canonical import tagged

__all__ = ["MAX_SEQ", "SIGNING_DOMAIN", "LifecycleAction", "LifecycleEvent", "seq_at"]

SIGNING_DOMAIN = "loraplane.lifecycle.v1"
MAX_SEQ = 2**62
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def seq_at(instant: datetime) -> int:
    """The time-based seq of ``instant``: whole microseconds since the Unix epoch (integer
    arithmetic, no float rounding). Publishers use it for ``seq``; the registry refuses a
    seq above ``seq_at(now + clock skew)``."""
    return (instant - _EPOCH) // timedelta(microseconds=1)


class LifecycleAction(StrEnum):
    publish = "publish"
    canary = "canary"
    promote = "promote"
    rollback = "rollback"
    retire = "retire"
    revoke = "revoke"


class LifecycleEvent(StrictModel):
    """One signed step of an adapter's history, as CI writes it to the registry topic.

    Read strictly, so that every reader sees the same event (docs/lifecycle.md, "Strict
    parsing of signed bytes"): besides this schema, an integer is written as one (``5``,
    never ``5.0`` or ``5e0``), and a duplicate key, ``NaN``, a lone surrogate or a byte-order
    mark is refused."""

    schema_version: Literal[1] = 1
    event_id: Identifier
    action: LifecycleAction
    seq: int = Field(ge=1, le=MAX_SEQ, description="strictly increasing per adapter_id")
    issued_at: Timestamp
    expires_at: Timestamp
    publisher: Identifier
    key_id: Identifier
    tenant_id: Identifier
    adapter_id: Identifier
    base_model: Identifier
    version: Version = Field(description="the version the action applies to")
    record: AdapterRecord | None = Field(None, description="publish only: the full entry")
    canary_percent: float | None = Field(None, ge=0, le=100, description="canary only")
    rollback_to: Version | None = Field(None, description="rollback only; default previous")
    reason: str = Field("", max_length=512)
    signature: str = Field("", max_length=128, description="base64 Ed25519 signature")

    @model_validator(mode="after")
    def _action_fields(self) -> LifecycleEvent:
        if self.action is LifecycleAction.publish:
            if self.record is None:
                raise ValueError("publish needs 'record'")
            r = self.record
            if (r.adapter_id, r.tenant_id, r.base_model, r.version) != (
                self.adapter_id,
                self.tenant_id,
                self.base_model,
                self.version,
            ):
                raise ValueError(
                    "record's adapter_id/tenant_id/base_model/version differ from the event's"
                )
        elif self.record is not None:
            raise ValueError(f"'record' is only allowed on publish, not {self.action}")
        if self.action is LifecycleAction.canary and self.canary_percent is None:
            raise ValueError("canary needs 'canary_percent'")
        if self.action is not LifecycleAction.canary and self.canary_percent is not None:
            raise ValueError("'canary_percent' is only allowed on canary")
        if self.action is not LifecycleAction.rollback and self.rollback_to is not None:
            raise ValueError("'rollback_to' is only allowed on rollback")
        if self.expires_at <= self.issued_at:
            raise ValueError("expires_at must be after issued_at")
        return self

    def signed_bytes(self) -> bytes:
        return tagged(SIGNING_DOMAIN, self.model_dump(mode="json", exclude={"signature"}))
