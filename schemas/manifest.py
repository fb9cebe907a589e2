"""The artifact manifest: every file with its own sha256 and size.

The registry's ``sha256`` is the digest of the manifest's canonical bytes, so one signed
value pins every byte of every file, and a worker can check files one by one while they
stream in.

Files that training tools write beside an adapter and that serve nothing (PEFT's model card)
are left out at publish time; ``dropped`` records which, with their digests, so the signed
manifest says what the publisher saw and kept out. It is omitted from the canonical bytes
when empty: a manifest with nothing dropped keeps its digest.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from loraplane.schemas.base import Sha256, StrictModel
from loraplane.schemas.canonical import canonical_json

__all__ = ["MAX_FILES", "SAFE_PATH", "DroppedFile", "InertKind", "Manifest", "ManifestFile"]

MAX_FILES = 64

SAFE_PATH = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}){0,3}$"


class ManifestFile(StrictModel):
    path: str = Field(pattern=SAFE_PATH, description="relative, '/'-separated, no '..'")
    sha256: Sha256
    size: int = Field(ge=0, le=64 * 1024**3)

    @field_validator("path")
    @classmethod
    def _no_dot_segments(cls, v: str) -> str:
        if any(part in (".", "..") for part in v.split("/")):
            raise ValueError("path segments '.' and '..' are not allowed")
        return v


class InertKind(StrEnum):
    """Why a file beside the adapter was left out of the artifact."""

    model_card = "model_card"  # README.md, written by PEFT's save_pretrained


class DroppedFile(ManifestFile):
    """A file the publisher saw and did not upload: never fetched, never served."""

    kind: InertKind


class Manifest(StrictModel):
    format: Literal["loraplane.manifest.v1"] = "loraplane.manifest.v1"
    files: list[ManifestFile] = Field(min_length=1, max_length=MAX_FILES)
    dropped: list[DroppedFile] = Field(default_factory=list, max_length=16)

    @field_validator("files")
    @classmethod
    def _sorted_unique(cls, v: list[ManifestFile]) -> list[ManifestFile]:
        paths = [f.path for f in v]
        if len(set(paths)) != len(paths):
            raise ValueError("duplicate paths in manifest")
        return sorted(v, key=lambda f: f.path)

    @field_validator("dropped")
    @classmethod
    def _sorted_dropped(cls, v: list[DroppedFile]) -> list[DroppedFile]:
        return sorted(v, key=lambda f: f.path)

    @model_validator(mode="after")
    def _kept_or_dropped(self) -> Manifest:
        both = {f.path for f in self.files} & {f.path for f in self.dropped}
        if both:
            raise ValueError(f"kept and dropped at once: {sorted(both)}")
        return self

    def canonical_bytes(self) -> bytes:
        data: dict[str, Any] = self.model_dump(mode="json")
        if not data["dropped"]:
            del data["dropped"]
        return canonical_json(data)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> ManifestFile | None:
        return next((f for f in self.files if f.path == path), None)
