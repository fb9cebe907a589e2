"""Where an adapter version's artifact must live: its owner's prefix. Pure.

``s3://BUCKET/<tenant_id>/<adapter_id>/<version>-<sha8>/``, sha8 being the first 8 hex
digits of the record's manifest digest. Publishing uploads there (loraplane.artifact_publish)
and a worker fetches only from there (workers/artifact_fetch.py), so a record can never
point a worker at another tenant's or another adapter's objects, even a record that
carries genuine signatures for the wrong place: the check is made where the bytes are
fetched, on the record being loaded.
"""

from __future__ import annotations

from loraplane.artifact.refusal import ArtifactError
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.reasons import ArtifactReason as Reason


def owner_prefix_of(bucket: str, tenant_id: str, adapter_id: str, version: str,
                    sha256: str) -> str:
    """The one folder URI an artifact with these coordinates may be published under."""
    return f"s3://{bucket}/{tenant_id}/{adapter_id}/{version}-{sha256[:8]}/"


def owner_prefix(record: AdapterRecord, bucket: str) -> str:
    """``owner_prefix_of`` for a registry record's tenant, adapter, version and digest."""
    return owner_prefix_of(bucket, record.tenant_id, record.adapter_id, record.version,
                           record.sha256)


def check_owner(record: AdapterRecord, bucket: str) -> None:
    """Refuse (``outside_owner_prefix``) a record whose ``artifact_uri`` is not exactly the
    owner's prefix in ``bucket`` (the bucket the URI names, after the allowlist check)."""
    expected = owner_prefix(record, bucket)
    if record.artifact_uri != expected:
        raise ArtifactError.single(Reason.outside_owner_prefix, record.artifact_uri[:200],
                                   f"not the owner's prefix {expected}")
