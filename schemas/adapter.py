"""The registry entry of one adapter version: what may load, where, and how it is kept."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field, field_validator, model_validator

from loraplane.schemas.base import Identifier, Sha256, StrictModel, Version

__all__ = [
    "ARTIFACT_URI_PATTERN",
    "MAX_ADAPTER_BYTES",
    "MAX_RANK",
    "PRIORITY_ORDER",
    "AdapterRecord",
    "AdapterStatus",
    "Compatibility",
    "ModelSignature",
    "Priority",
    "Release",
    "artifact_key_prefix",
    "artifact_uri_problem",
    "expected_artifact_prefix",
    "owner_prefix",
    "priority_rank",
    "s3_uri_problem",
]

MAX_RANK = 512
MAX_ADAPTER_BYTES = 64 * 1024**3
"""An adapter artifact's largest size (a rank-512 LoRA of a large model is a few GiB)."""

_SEGMENT = (
    r"([A-Za-z0-9_@=-][A-Za-z0-9._@=-]*|\.[A-Za-z0-9_@=-][A-Za-z0-9._@=-]*|\.\.[A-Za-z0-9._@=-]+)"
)
ARTIFACT_URI_PATTERN = rf"^s3://[a-z0-9][a-z0-9.-]{{1,62}}/({_SEGMENT}/)*$"
"""A canonical ``s3://BUCKET/SEG/.../`` folder (``s3_uri_problem``): a segment is never
``.`` or ``..``, so the exported schema promises no URI the record refuses."""


class Priority(StrEnum):
    bronze = "bronze"
    silver = "silver"
    gold = "gold"
    platinum = "platinum"


PRIORITY_ORDER: tuple[Priority, ...] = (
    Priority.bronze,
    Priority.silver,
    Priority.gold,
    Priority.platinum,
)
"""Lowest first: a keyring's per-tenant ceiling allows a priority and everything below."""


def priority_rank(priority: Priority) -> int:
    return PRIORITY_ORDER.index(priority)


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


class ModelSignature(StrictModel):
    """The OpenSSF model-signing bundle publish verified: ``model.sig`` in the artifact
    (pinned by the manifest like every file), who signed it, as the keyring names them.
    Workers verify the bundle again before the bytes are used
    (loraplane.artifact.model_signature)."""

    bundle_sha256: Sha256 = Field(description="sha256 of the bundle file, model.sig")
    signer_id: Identifier = Field(description="the keyring's model_signers entry that verified it")
    identity: str = Field(
        min_length=1,
        max_length=1024,
        description="sha256:<hex> of the signing key's PEM, or the signing certificate's subject",
    )


class AdapterRecord(StrictModel):
    """Field names follow the seed's registry table. ``model_signature`` is left out of the
    bytes when absent, so the signatures of records that predate it still verify."""

    schema_version: Literal[1] = 1
    adapter_id: Identifier
    base_model: Identifier
    version: Version
    rank: int = Field(ge=1, le=MAX_RANK)
    format: Literal["peft"] = "peft"
    artifact_uri: str = Field(pattern=ARTIFACT_URI_PATTERN, max_length=1024)
    sha256: Sha256 = Field(description="sha256 of the artifact's canonical manifest")
    size_bytes: int = Field(ge=1, le=MAX_ADAPTER_BYTES)
    status: AdapterStatus = AdapterStatus.published
    tenant_id: Identifier
    priority: Priority = Priority.silver
    compatibility: Compatibility
    release: Release = Field(default_factory=Release)
    model_signature: ModelSignature | None = Field(None, exclude_if=lambda v: v is None)

    @field_validator("artifact_uri")
    @classmethod
    def _canonical_uri(cls, v: str) -> str:
        problem = s3_uri_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _rank_fits(self) -> AdapterRecord:
        if self.rank > self.compatibility.max_lora_rank:
            raise ValueError(
                f"rank {self.rank} exceeds compatibility.max_lora_rank "
                f"{self.compatibility.max_lora_rank}"
            )
        return self

    @property
    def lora_name(self) -> str:
        from loraplane.schemas.base import lora_name

        return lora_name(self.adapter_id, self.version, self.sha256)


def s3_uri_problem(uri: str) -> str | None:
    """Why ``uri`` is not a canonical ``s3://BUCKET/SEG/.../`` folder, or None. Every reader
    must resolve it to the same objects, so no ``.`` or ``..`` segment, no empty segment,
    no percent-encoding, no backslash, and it ends with ``/``."""
    if not uri.startswith("s3://"):
        return "not an s3:// URI"
    if not uri.endswith("/"):
        return "an artifact URI is a folder: it ends with '/'"
    bucket, _, path = uri.removeprefix("s3://").partition("/")
    if not bucket:
        return "no bucket"
    for bad in ("%", "\\", "?", "#"):
        if bad in uri:
            return f"non-canonical character {bad!r} in the URI"
    segments = path.split("/")[:-1]
    for segment in segments:
        if segment in ("", ".", ".."):
            return f"non-canonical path segment {segment!r}"
    return None


def artifact_key_prefix(tenant_id: str, adapter_id: str, version: str, sha256: str) -> str:
    """The object-key prefix of one adapter version: ``TENANT/ADAPTER/VERSION-SHA8/``.

    The one layout shared by the publisher (where it uploads), the registry (a publish
    whose ``artifact_uri`` is elsewhere is refused) and workers (refuse to fetch elsewhere);
    per-tenant S3 credentials are scoped to ``TENANT/`` (docs/lifecycle.md)."""
    return f"{tenant_id}/{adapter_id}/{version}-{sha256[:8]}/"


def expected_artifact_prefix(
    bucket: str, tenant_id: str, adapter_id: str, version: str, sha256: str
) -> str:
    """``s3://BUCKET/TENANT/ADAPTER/VERSION-SHA8/``: where an artifact must lie."""
    return f"s3://{bucket}/{artifact_key_prefix(tenant_id, adapter_id, version, sha256)}"


def owner_prefix(record: AdapterRecord, bucket: str) -> str:
    """The owner's prefix of ``record``'s version in ``bucket``."""
    return expected_artifact_prefix(
        bucket, record.tenant_id, record.adapter_id, record.version, record.sha256
    )


def artifact_uri_problem(record: AdapterRecord, bucket: str | None = None) -> str | None:
    """Why ``record.artifact_uri`` is not exactly the record's own prefix (in any bucket, or
    ``bucket`` when given), or None. Exactly, not "somewhere under": the registry and the
    workers apply this one rule, so a record one accepts the other never refuses."""
    uri_bucket = record.artifact_uri.removeprefix("s3://").partition("/")[0]
    if bucket is not None and uri_bucket != bucket:
        return f"artifact bucket {uri_bucket!r} is not {bucket!r}"
    expected = owner_prefix(record, uri_bucket)
    if record.artifact_uri != expected:
        return f"artifact_uri {record.artifact_uri[:200]} is not the owner's prefix {expected}"
    return None
