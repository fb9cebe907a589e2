"""One served (or refused) request, as the gateway saw it: the input of hot scores and metrics."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import AwareDatetime, ConfigDict, Field

from loraplane.schemas.base import Identifier, NonNegativeMs, StrictModel, Timestamp, Version

__all__ = ["RequestClass", "RequestDemand", "RequestLog", "RequestStatus", "Tier"]


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


class RequestDemand(StrictModel):
    """The fields of a request log that hot scores read, and all the scoring agent validates
    (other fields are ignored there): half the cost of validating a whole log on the
    busiest consumer. The metrics sink validates whole ``RequestLog``s and dead-letters the
    rest, so a log with, say, a negative token count still counts as demand but is refused
    as a metrics row. ``ts`` is not normalised to UTC here (an instant is an instant; the
    normalisation was a fifth of the validation's cost); ``RequestLog`` does normalise it."""

    model_config = ConfigDict(extra="ignore")

    schema_version: Literal[1] = 1
    ts: AwareDatetime
    event_id: Identifier = Field(
        description="a log delivered twice (the event sink's at-least-"
        "once replay) is counted once by this id"
    )
    adapter_id: Identifier
    adapter_version: Version | None = Field(None, description="None when none was chosen")
    request_class: RequestClass = RequestClass.interactive
    tier_at_arrival: Tier
    ttft_ms: NonNegativeMs | None = None
    status: RequestStatus = RequestStatus.ok


class RequestLog(RequestDemand):
    """One request log as the gateway writes it: unknown fields are errors here."""

    model_config = ConfigDict(extra="forbid")

    ts: Timestamp
    request_id: str = Field(min_length=1, max_length=128)
    tenant_id: Identifier
    base_model: Identifier
    lora_name: str | None = Field(None, max_length=200)
    worker_id: Identifier
    swap_ms: NonNegativeMs = 0.0
    queue_ms: NonNegativeMs = 0.0
    prompts: int = Field(
        1, ge=0, le=100_000, description="prompts in the request (a list prompt counts each)"
    )
    prompt_tokens: int = Field(0, ge=0, le=10_000_000)
    output_tokens: int = Field(0, ge=0, le=10_000_000)
    error: str | None = Field(None, max_length=1024)
