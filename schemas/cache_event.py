"""What a worker did to its tiers, and what it refused: the input of cache metrics."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from loraplane.schemas.base import Identifier, NonNegativeMs, StrictModel, Timestamp, Version
from loraplane.schemas.reasons import CacheEventReason

__all__ = ["CacheEvent", "CacheEventKind"]


class CacheEventKind(StrEnum):
    fetch = "fetch"  # S3 -> host tier
    load = "load"  # host -> GPU (vLLM)
    unload = "unload"  # GPU -> host (demote)
    evict = "evict"  # removed from host tier
    refuse = "refuse"  # verification, policy or vLLM's loader refused the artifact
    fail = "fail"  # I/O failure (S3 down, vLLM error)
    kv_namespace_conflict = "kv_namespace_conflict"


class CacheEvent(StrictModel):
    schema_version: Literal[1] = 1
    event_id: Identifier
    ts: Timestamp
    worker_id: Identifier
    base_model: Identifier
    tenant_id: Identifier
    adapter_id: Identifier
    adapter_version: Version
    lora_name: str = Field(max_length=200)
    kind: CacheEventKind
    swap_ms: NonNegativeMs = 0.0
    bytes: int = Field(0, ge=0)
    reason: CacheEventReason = Field("", description="refusal/failure code, else empty")
    detail: str = Field("", max_length=1024)
    command_id: str | None = Field(None, max_length=200)
