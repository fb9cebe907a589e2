"""Every decision of the control plane, accepted or not, for people to read later."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loraplane.schemas.base import Identifier, StrictModel, Timestamp
from loraplane.schemas.reasons import AuditReason

__all__ = ["AuditRecord"]


class AuditRecord(StrictModel):
    schema_version: Literal[1] = 1
    event_id: Identifier
    ts: Timestamp
    component: Literal["registry", "planner", "worker", "gateway", "cli"]
    action: str = Field(min_length=1, max_length=64)
    decision: Literal["accepted", "rejected", "issued", "applied", "refused"]
    reason: AuditReason = ""
    subject_event_id: str | None = Field(None, max_length=128)
    tenant_id: Identifier | None = None
    adapter_id: Identifier | None = None
    version: str | None = Field(None, max_length=64)
    actor: str = Field("", max_length=128, description="publisher, worker_id or command_id")
    detail: str = Field("", max_length=2048)
