"""The worker's side of "an artifact lives under its owner's prefix". Pure.

The layout itself (``s3://BUCKET/<tenant_id>/<adapter_id>/<version>-<sha8>/``) has one owner,
``schemas.adapter.expected_artifact_prefix``: publishing uploads there
(loraplane.artifact_publish), the registry refuses a publish whose URI is elsewhere
(registry.fold) and a worker fetches only from there (workers/artifact_fetch.py), so a
record can never point a worker at another tenant's or another adapter's objects, even a
record that carries genuine signatures for the wrong place: the check is made again where
the bytes are fetched, on the record being loaded.
"""

from __future__ import annotations

from loraplane.artifact.refusal import ArtifactError
from loraplane.schemas.adapter import AdapterRecord, artifact_uri_problem
from loraplane.schemas.reasons import ArtifactReason as Reason

__all__ = ["check_owner"]


def check_owner(record: AdapterRecord, bucket: str) -> None:
    """Refuse (``outside_owner_prefix``) a record whose ``artifact_uri`` is not exactly the
    owner's prefix in ``bucket`` (the bucket the URI names, after the allowlist check)."""
    problem = artifact_uri_problem(record, bucket)
    if problem is not None:
        raise ArtifactError.single(Reason.outside_owner_prefix, record.artifact_uri[:200], problem)
