"""Why an adapter artifact was refused, or could not be fetched.

Every reason is a stable code: the agent puts it on the cache-events topic
(``CacheEvent.reason``), ops grep for it, and tests assert on it. A refusal means the bytes
are not acceptable and retrying will not help; a failure (``Reason.is_failure``) means the
artifact store misbehaved and a later retry may succeed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum


class Reason(StrEnum):
    # where the artifact comes from
    source_not_allowed = "source_not_allowed"
    artifact_store_unavailable = "artifact_store_unavailable"
    fetch_failed = "fetch_failed"
    adapter_revoked = "adapter_revoked"
    host_budget_exceeded = "host_budget_exceeded"
    host_io_error = "host_io_error"
    # the manifest and the files it pins
    manifest_missing = "manifest_missing"
    manifest_invalid = "manifest_invalid"
    manifest_digest_mismatch = "manifest_digest_mismatch"
    file_missing = "file_missing"
    file_not_in_manifest = "file_not_in_manifest"
    size_mismatch = "size_mismatch"
    sha256_mismatch = "sha256_mismatch"
    too_large = "too_large"
    # names and kinds of files
    unsafe_path = "unsafe_path"
    symlink = "symlink"
    pickle_weights = "pickle_weights"
    disallowed_file = "disallowed_file"
    # adapter_config.json against the worker and the registry record
    config_missing = "config_missing"
    config_invalid = "config_invalid"
    rank_too_high = "rank_too_high"
    record_mismatch = "record_mismatch"
    base_model_mismatch = "base_model_mismatch"
    # safetensors weights
    weights_missing = "weights_missing"
    header_too_large = "header_too_large"
    header_invalid = "header_invalid"
    tensor_dtype_invalid = "tensor_dtype_invalid"
    tensor_offsets_invalid = "tensor_offsets_invalid"
    tensor_name_invalid = "tensor_name_invalid"
    tensor_shape_mismatch = "tensor_shape_mismatch"
    module_not_targeted = "module_not_targeted"
    module_not_in_model = "module_not_in_model"
    target_module_missing = "target_module_missing"
    lora_pair_incomplete = "lora_pair_incomplete"

    @property
    def is_failure(self) -> bool:
        """True for transient I/O trouble (CacheEvent kind ``fail``), False for a refusal."""
        return self in (Reason.artifact_store_unavailable, Reason.fetch_failed,
                        Reason.host_io_error)


@dataclass(frozen=True)
class Refusal:
    reason: Reason
    path: str = ""
    detail: str = ""

    def __str__(self) -> str:
        where = f" {self.path}" if self.path else ""
        what = f": {self.detail}" if self.detail else ""
        return f"{self.reason.value}{where}{what}"


class ArtifactError(Exception):
    """An artifact was refused or could not be fetched; ``refusals`` says every reason."""

    def __init__(self, refusals: Iterable[Refusal]) -> None:
        self.refusals = tuple(refusals)
        if not self.refusals:
            raise ValueError("ArtifactError needs at least one refusal")
        super().__init__("; ".join(str(r) for r in self.refusals))

    @classmethod
    def single(cls, reason: Reason, path: str = "", detail: str = "") -> ArtifactError:
        return cls([Refusal(reason, path, detail)])

    @property
    def reasons(self) -> tuple[Reason, ...]:
        """Distinct reasons in first-seen order."""
        return tuple(dict.fromkeys(r.reason for r in self.refusals))

    @property
    def is_failure(self) -> bool:
        """Only transient failures: retrying later may succeed."""
        return all(r.is_failure for r in self.reasons)
