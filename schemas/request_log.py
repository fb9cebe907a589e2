"""One served (or refused) request, as the gateway saw it: the input of hot scores and metrics."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from schemas.base import Identifier, NonNegativeMs, StrictModel, Timestamp, Version


class RequestClass(StrEnum):
    interactive = "interactive"
    batch = "batch"
    canary = "canary"
    shadow = "shadow"


class Tier(StrEnum):
    """Where the adapter was when the request arrived."""

    gpu = "gpu"
    host = "host"
    cold = "cold"
    base_fallback = "base_fallback"


class RequestStatus(StrEnum):
    ok = "ok"
    error = "error"
    retry_later = "retry_later"  # 429 + Retry-After while a cold load is queued
    refused = "refused"  # 403 / unknown adapter / not allowed


class RequestLog(StrictModel):
    schema_version: Literal[1] = 1
    event_id: Identifier
    ts: Timestamp
    request_id: str = Field(min_length=1, max_length=128)
    tenant_id: Identifier
    base_model: Identifier
    adapter_id: Identifier
    adapter_version: Version | None = Field(None, description="None when none was chosen")
    lora_name: str | None = Field(None, max_length=200)
    worker_id: Identifier
    request_class: RequestClass = RequestClass.interactive
    tier_at_arrival: Tier
    ttft_ms: NonNegativeMs | None = None
    swap_ms: NonNegativeMs = 0.0
    queue_ms: NonNegativeMs = 0.0
    prompt_tokens: int = Field(0, ge=0, le=10_000_000)
    output_tokens: int = Field(0, ge=0, le=10_000_000)
    status: RequestStatus = RequestStatus.ok
    error: str | None = Field(None, max_length=1024)
