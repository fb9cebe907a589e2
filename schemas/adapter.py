"""The registry entry of one adapter version: what may load, where, and how it is kept."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from loraplane.schemas.base import Identifier, Sha256, StrictModel, Version
from pydantic import Field, model_validator

MAX_RANK = 512


class Priority(StrEnum):
    bronze = "bronze"
    silver = "silver"
    gold = "gold"
    platinum = "platinum"


class AdapterStatus(StrEnum):
    published = "published"  # known and verified, not serving traffic yet
    canary = "canary"  # serving canary_percent of the adapter's traffic
    active = "active"  # the serving version (one per adapter)
    retired = "retired"  # taken out of service; may be re-activated by rollback
    revoked = "revoked"  # must never load again; workers evict it


class Compatibility(StrictModel):
    tokenizer_revision: str = Field("", max_length=128)
    target_modules: list[Identifier] = Field(min_length=1, max_length=64)
    max_lora_rank: int = Field(ge=1, le=MAX_RANK)


class Release(StrictModel):
    canary_percent: float = Field(0.0, ge=0, le=100)
    rollback_to: Version | None = None


class AdapterRecord(StrictModel):
    """Field names follow the seed's registry table."""

    schema_version: Literal[1] = 1
    adapter_id: Identifier
    base_model: Identifier
    version: Version
    rank: int = Field(ge=1, le=MAX_RANK)
    format: Literal["peft"] = "peft"
    artifact_uri: str = Field(pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,62}/([A-Za-z0-9._@=-]+/)*$",
                              max_length=1024)
    sha256: Sha256 = Field(description="sha256 of the artifact's canonical manifest")
    size_bytes: int = Field(ge=1, le=64 * 1024**3)
    status: AdapterStatus = AdapterStatus.published
    tenant_id: Identifier
    priority: Priority = Priority.silver
    compatibility: Compatibility
    release: Release = Field(default_factory=Release)

    @model_validator(mode="after")
    def _rank_fits(self) -> AdapterRecord:
        if self.rank > self.compatibility.max_lora_rank:
            raise ValueError(f"rank {self.rank} exceeds compatibility.max_lora_rank "
                             f"{self.compatibility.max_lora_rank}")
        return self

    @property
    def lora_name(self) -> str:
        from loraplane.schemas.base import lora_name

        return lora_name(self.adapter_id, self.version, self.sha256)
