"""What ``loraplane publish`` prints: one JSON object, a stable interface for CI scripts.

Every outcome has its own exit code (``PublishOutcome.exit_code``), so a script can branch
on the code alone and read the object for details. The object is exported as
``schemas/json/publish_result.schema.json``. Within ``schema_version`` 1 fields are only
added, never removed or retyped: the model ignores unknown keys (its schema allows them),
so a consumer written against this version keeps reading later outputs.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.lifecycle import LifecycleAction
from loraplane.schemas.reasons import ArtifactReason, AuditReason, PublishFailure

__all__ = [
    "EXIT_CODE",
    "FAILURE_OUTCOME",
    "ArtifactRefusal",
    "PublishError",
    "PublishOutcome",
    "PublishResult",
    "RegistryDecision",
    "SentEvent",
]


class PublishOutcome(StrEnum):
    """What happened, as far as a CI job needs to know to decide its next step."""

    published = "published"
    internal_error = "internal_error"
    invalid_input = "invalid_input"
    artifact_refused = "artifact_refused"
    registry_rejected = "registry_rejected"
    unavailable = "unavailable"
    undecided = "undecided"

    @property
    def exit_code(self) -> int:
        return EXIT_CODE[self]


EXIT_CODE: dict[PublishOutcome, int] = {
    PublishOutcome.published: 0,  # every event acknowledged (and accepted, with --wait-s)
    PublishOutcome.internal_error: 1,  # a bug; also Python's own code for an uncaught error
    PublishOutcome.invalid_input: 2,  # fix the options or the key file (click's usage code)
    PublishOutcome.artifact_refused: 3,  # fix the artifact: a worker would refuse it too
    PublishOutcome.registry_rejected: 4,  # the registry said no (reason in `registry`)
    PublishOutcome.unavailable: 5,  # S3 or Kafka failed before any event: re-run as is
    PublishOutcome.undecided: 6,  # events sent, outcome unknown: look before re-running
}


FAILURE_OUTCOME: dict[PublishFailure, PublishOutcome] = {
    PublishFailure.options_invalid: PublishOutcome.invalid_input,
    PublishFailure.key_unusable: PublishOutcome.invalid_input,
    PublishFailure.settings_invalid: PublishOutcome.invalid_input,
    PublishFailure.release_invalid: PublishOutcome.invalid_input,
    PublishFailure.model_config_invalid: PublishOutcome.invalid_input,
    PublishFailure.extra_missing: PublishOutcome.invalid_input,
    PublishFailure.artifact_refused: PublishOutcome.artifact_refused,
    PublishFailure.artifact_store_unavailable: PublishOutcome.unavailable,
    PublishFailure.bus_unavailable: PublishOutcome.unavailable,
    PublishFailure.follow_up_not_acknowledged: PublishOutcome.undecided,
    PublishFailure.registry_rejected: PublishOutcome.registry_rejected,
    PublishFailure.registry_undecided: PublishOutcome.undecided,
    PublishFailure.internal_error: PublishOutcome.internal_error,
}


class _Output(BaseModel):
    """Output models: keys a later version adds are ignored on reading, never an error; the
    schema describes what is written, where every key is present (defaults included)."""

    model_config = ConfigDict(
        extra="ignore",
        frozen=True,
        json_schema_mode_override="serialization",
        json_schema_serialization_defaults_required=True,
    )


class SentEvent(_Output):
    """A lifecycle event the broker acknowledged (acks=all)."""

    action: LifecycleAction
    event_id: str = Field(max_length=128)
    seq: int
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)


class RegistryDecision(_Output):
    """The registry agent's decision on one sent event, from its audit record."""

    event_id: str = Field(max_length=128)
    action: str = Field(max_length=64)
    decision: Literal["accepted", "rejected"]
    reason: AuditReason = Field("", description="the rejection reason; empty when accepted")
    detail: str = Field("", max_length=2048)

    @property
    def why(self) -> str:
        """The reason with its detail, for a log line."""
        return f"{self.reason} ({self.detail})" if self.detail else str(self.reason)


class ArtifactRefusal(_Output):
    """One reason the workers' verifier (or publish itself) refused the artifact."""

    reason: ArtifactReason
    path: str = ""
    detail: str = ""


class PublishError(_Output):
    code: PublishFailure
    message: str
    refusals: list[ArtifactRefusal] = Field(
        default_factory=list, description="artifact_refused: every reason, when known"
    )


class PublishResult(_Output):
    """The one object ``loraplane publish`` writes to stdout (with ``--json``: always)."""

    schema_version: Literal[1] = 1
    ok: bool = Field(description="outcome is published")
    outcome: PublishOutcome
    exit_code: int = Field(ge=0, le=255, description="the process's exit code")
    adapter_id: str = Field(max_length=256, description="as given (maybe invalid)")
    version: str = Field(max_length=256, description="as given (maybe invalid)")
    tenant_id: str | None = None
    base_model: str | None = None
    sha256: str | None = Field(None, description="the manifest digest the event signs")
    artifact_uri: str | None = None
    lora_name: str | None = Field(None, description="the name vLLM serves it under")
    event_id: str | None = Field(None, description="the publish event, once signed")
    seq: int | None = None
    canary_event_id: str | None = None
    promote_event_id: str | None = None
    events: list[SentEvent] = Field(
        default_factory=list, description="what the broker acknowledged, in order"
    )
    registry: list[RegistryDecision] | None = Field(
        None, description="with --wait-s: the decisions seen; null when not waited for"
    )
    error: PublishError | None = None

    @model_validator(mode="after")
    def _consistent(self) -> PublishResult:
        if self.ok != (self.outcome is PublishOutcome.published):
            raise ValueError("ok must say whether the outcome is published")
        if self.exit_code != self.outcome.exit_code:
            raise ValueError(f"exit_code of {self.outcome} is {self.outcome.exit_code}")
        if self.ok == (self.error is not None):
            raise ValueError("an error exactly when not ok")
        if self.error is not None and FAILURE_OUTCOME[self.error.code] is not self.outcome:
            raise ValueError(f"{self.error.code} is a {FAILURE_OUTCOME[self.error.code]}")
        return self

    @classmethod
    def build(
        cls,
        adapter_id: str,
        version: str,
        *,
        error: PublishError | None = None,
        record: AdapterRecord | None = None,
        **fields: object,
    ) -> PublishResult:
        """A result whose ok, outcome and exit code follow from ``error`` (None: published)
        and whose artifact fields come from ``record``."""
        outcome = PublishOutcome.published if error is None else FAILURE_OUTCOME[error.code]
        if record is not None:
            fields |= {
                "tenant_id": record.tenant_id,
                "base_model": record.base_model,
                "sha256": record.sha256,
                "artifact_uri": record.artifact_uri,
                "lora_name": record.lora_name,
            }
        return cls.model_validate(
            {
                "adapter_id": adapter_id,
                "version": version,
                "ok": error is None,
                "outcome": outcome,
                "exit_code": outcome.exit_code,
                "error": error,
                **fields,
            }
        )
