"""The registry's current view of one adapter: every version it has seen and which one serves.

This is the value of the compacted registry topic (key = adapter_id). One message per adapter
holds all its versions because several serve at once (the active one and canaries), and the
planner needs the revoked ones to order evictions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Literal

from pydantic import Field, model_validator

from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.base import Identifier, StrictModel, Timestamp, Version, version_key
from loraplane.schemas.lifecycle import LifecycleEvent

__all__ = [
    "MAX_EVIDENCE",
    "MAX_VIEWS_BYTES",
    "MAX_VIEW_BYTES",
    "REVOKE_ROOM_BYTES",
    "REVOKE_ROOM_EVENTS",
    "AdapterView",
    "signed_views_json",
    "views_from_json",
    "views_to_json",
]

MAX_EVIDENCE = 256
"""Accepted events one adapter's view carries (a publish is about 1.5 KB: the record stays
well under the 1 MiB message limit). The registry refuses more (``history_full``)."""

MAX_VIEW_BYTES = 1024 * 1024 - 16 * 1024
"""The most one encoded view may hold: it is one message of the registry topic, which Kafka
carries and every consumer decodes only up to 1 MiB (``codec.MAX_MESSAGE_BYTES``), key,
headers and record overhead beside it. Publishes with records as large as the schema allows
reach it within ``MAX_EVIDENCE``; the registry refuses an event whose view would not fit
(``history_full``) instead of accepting what it could never deliver."""
REVOKE_ROOM_BYTES = 64 * 1024
"""Bytes below ``MAX_VIEW_BYTES`` that only revokes may use, so a view that is full for
every other event can still take the revocations of its versions (a revoke is ~1-3 KB)."""
REVOKE_ROOM_EVENTS = 16
"""The last events of ``MAX_EVIDENCE`` that only revokes may use: a key that may not revoke
(a CI key) cannot fill an adapter's history so that its versions can no longer be revoked."""


class AdapterView(StrictModel):
    schema_version: Literal[1] = 1
    adapter_id: Identifier
    tenant_id: Identifier = Field(description="owner: the first publish decides, never changes")
    base_model: Identifier
    active_version: Version | None = Field(None, description="None: requests use the base model")
    versions: list[AdapterRecord] = Field(
        min_length=1, max_length=10_000, description="ordered by version, oldest first"
    )
    last_seq: int = Field(ge=1, le=2**62, description="highest seq accepted so far")
    last_event_id: Identifier
    updated_at: Timestamp
    evidence: list[LifecycleEvent] = Field(
        default_factory=list,
        max_length=MAX_EVIDENCE,
        description="every signed lifecycle event accepted for this adapter, in order: "
        "consumers re-derive the view from them with their own keyring",
    )
    served_versions: list[Version] = Field(
        default_factory=list,
        max_length=10_000,
        description="versions that have served traffic (active, or canary with percent > 0)"
        ": the only rollback targets",
    )

    @model_validator(mode="after")
    def _consistent(self) -> AdapterView:
        keys = [version_key(r.version) for r in self.versions]
        if keys != sorted(set(keys)):
            raise ValueError("versions must be unique and ordered oldest first")
        for r in self.versions:
            if (r.adapter_id, r.tenant_id, r.base_model) != (
                self.adapter_id,
                self.tenant_id,
                self.base_model,
            ):
                raise ValueError(f"version {r.version} belongs to another adapter/tenant/base")
        # last_seq is the highest seq accepted (a revoke may land below it), last_event_id the
        # last event applied: the evidence must say the same.
        if self.evidence and (max(e.seq for e in self.evidence), self.evidence[-1].event_id) != (
            self.last_seq,
            self.last_event_id,
        ):
            raise ValueError(
                "the evidence's highest seq / last event is not last_seq/last_event_id"
            )
        active = [r.version for r in self.versions if r.status is AdapterStatus.active]
        if active != ([self.active_version] if self.active_version else []):
            raise ValueError(f"active_version {self.active_version} but active records {active}")
        return self

    def version(self, version: str) -> AdapterRecord | None:
        """The record of ``version`` (``1`` and ``1.0`` are the same version)."""
        key = version_key(version)
        return next((r for r in self.versions if version_key(r.version) == key), None)

    def has_served(self, version: str) -> bool:
        """Whether ``version`` ever served traffic. Views written before served_versions
        existed are read by what they still show: serving now, or named as a
        ``rollback_to`` (only promote sets it, to the version that was active)."""
        key = version_key(version)
        if any(version_key(v) == key for v in self.served_versions):
            return True
        record = self.version(version)
        if record is not None and (
            record.status is AdapterStatus.active
            or (record.status is AdapterStatus.canary and record.release.canary_percent > 0)
        ):
            return True
        return any(
            r.release.rollback_to is not None and version_key(r.release.rollback_to) == key
            for r in self.versions
        )

    @property
    def active(self) -> AdapterRecord | None:
        return self.version(self.active_version) if self.active_version else None

    @property
    def serving(self) -> list[AdapterRecord]:
        """Versions that may load: the active one and canaries."""
        return [
            r for r in self.versions if r.status in (AdapterStatus.active, AdapterStatus.canary)
        ]

    @property
    def must_evict(self) -> list[str]:
        """LoRA names of revoked versions: workers must unload and delete them."""
        return [r.lora_name for r in self.versions if r.status is AdapterStatus.revoked]


MAX_VIEWS_BYTES = 256 * 1024 * 1024
"""The most a saved views file (``views_to_json``) may hold: what its readers accept."""


def views_to_json(views: dict[str, AdapterView]) -> str:
    """The whole registry as one JSON object, adapter_id -> view (``registry list --json``,
    the agent's saved views that the host-tier resolver reads too)."""
    return json.dumps(
        {aid: v.model_dump(mode="json") for aid, v in sorted(views.items())}, indent=2
    )


def signed_views_json(signed: Mapping[str, bytes]) -> str:
    """``views_to_json``'s object written from each view's own encoded bytes
    (``schemas.codec.encode``: canonical UTF-8 JSON) instead of re-encoding every view:
    what ``views_from_json`` reads back, for a consumer that keeps its views as bytes."""
    return (
        "{"
        + ",\n".join(f"{json.dumps(aid)}:{raw.decode()}" for aid, raw in sorted(signed.items()))
        + "}"
    )


def views_from_json(data: bytes) -> dict[str, AdapterView]:
    """The inverse of views_to_json; ValueError (pydantic's included) when it is not one."""
    from loraplane.schemas.strict_json import strict_loads

    raw = strict_loads(data, max_bytes=MAX_VIEWS_BYTES)  # StrictJsonError is a ValueError
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object adapter_id -> view")
    views = {
        aid: AdapterView.model_validate_json(json.dumps(v), strict=True) for aid, v in raw.items()
    }
    for aid, view in views.items():
        if view.adapter_id != aid:
            raise ValueError(f"{aid}: holds the view of {view.adapter_id}")
    return views
