"""A message we could not accept, kept with its raw bytes and the reason."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import Identifier, StrictModel, Timestamp


class DeadLetter(StrictModel):
    schema_version: Literal[1] = 1
    event_id: Identifier
    ts: Timestamp
    source_topic: str = Field(max_length=249)
    partition: int = Field(-1, ge=-1)
    offset: int = Field(-1, ge=-1)
    component: str = Field(max_length=64)
    reason: str = Field(min_length=1, max_length=64, description="machine-readable code")
    detail: str = Field("", max_length=4096, description="human-readable, field-level")
    key_b64: str | None = Field(None, max_length=4096)
    raw_b64: str = Field(max_length=16 * 1024 * 1024, description="the original value bytes")
