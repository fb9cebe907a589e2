"""The artifact manifest: every file with its own sha256 and size.

The registry's ``sha256`` is the digest of the manifest's canonical bytes, so one signed
value pins every byte of every file, and a worker can check files one by one while they
stream in.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from loraplane.schemas.base import Sha256, StrictModel
from loraplane.schemas.canonical import canonical_json
from pydantic import Field, field_validator

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


class Manifest(StrictModel):
    format: Literal["loraplane.manifest.v1"] = "loraplane.manifest.v1"
    files: list[ManifestFile] = Field(min_length=1, max_length=64)

    @field_validator("files")
    @classmethod
    def _sorted_unique(cls, v: list[ManifestFile]) -> list[ManifestFile]:
        paths = [f.path for f in v]
        if len(set(paths)) != len(paths):
            raise ValueError("duplicate paths in manifest")
        return sorted(v, key=lambda f: f.path)

    def canonical_bytes(self) -> bytes:
        return canonical_json(self.model_dump(mode="json"))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> ManifestFile | None:
        return next((f for f in self.files if f.path == path), None)
