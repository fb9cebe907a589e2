"""Turning an adapter folder into a published artifact: manifest, record, upload.

The folder (or an S3 prefix, downloaded first) is checked with the workers' own verifier
(``loraplane.artifact.verification.verify_artifact``) against the record we are about to sign, so CI
refuses exactly what a worker would refuse: pickle weights, anything but
``adapter_config.json`` and top-level ``*.safetensors``, inconsistent tensors, a rank or
base model that disagrees with adapter_config.json. The upload goes to
``s3://BUCKET/ADAPTER_ID/VERSION-SHA8/`` with ``manifest.json`` beside the files, so a
worker fetches the manifest, checks its digest against the signed ``sha256`` and then every
file against the manifest.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from loraplane.artifact.directory import DirectoryArtifact
from loraplane.artifact.refusal import ArtifactError as FetchRefused
from loraplane.artifact.verification import (
    CONFIG_NAME,
    MANIFEST_NAME,
    FileFacts,
    WorkerLimits,
    is_safe_relative_path,
    parse_lora_config,
    verify_artifact,
)
from loraplane.kernel.config import Settings
from loraplane.schemas.adapter import AdapterRecord, Compatibility, Priority
from loraplane.schemas.manifest import Manifest, ManifestFile
from loraplane.workers.artifact_fetch import check_allowed, parse_s3_uri


class ArtifactError(ValueError):
    """The artifact cannot be published; the message says why, for CI logs."""


@dataclass(frozen=True)
class PublishRequest:
    """What the publisher says about the artifact (the rest comes from its files)."""

    adapter_id: str
    tenant_id: str
    base_model: str
    version: str
    priority: Priority
    tokenizer_revision: str = ""


class _WithManifest:
    """The folder plus the manifest we computed, as the verifier's ArtifactReader."""

    def __init__(self, folder: DirectoryArtifact, manifest_bytes: bytes) -> None:
        self.folder, self.manifest_bytes = folder, manifest_bytes

    def files(self) -> Sequence[FileFacts]:
        return [*(f for f in self.folder.files() if f.path != MANIFEST_NAME),
                FileFacts(MANIFEST_NAME, "file", len(self.manifest_bytes))]

    def read(self, path: str, offset: int, length: int) -> bytes:
        if path == MANIFEST_NAME:
            return self.manifest_bytes[offset:offset + length]
        return self.folder.read(path, offset, length)

    def sha256(self, path: str) -> str:
        import hashlib

        if path == MANIFEST_NAME:
            return hashlib.sha256(self.manifest_bytes).hexdigest()
        return self.folder.sha256(path)


def build_record(folder: Path, release: PublishRequest,
                 bucket: str) -> tuple[AdapterRecord, Manifest]:
    """Manifest and registry record of a local adapter folder, verified as a worker would."""
    reader = DirectoryArtifact(folder)
    files = [f for f in reader.files() if f.path != MANIFEST_NAME]
    odd = [f.path for f in files if f.kind != "file"]
    if odd:
        raise ArtifactError(f"not regular files (links are never followed): {', '.join(odd)}")
    try:
        manifest = Manifest(files=[ManifestFile(path=f.path, sha256=reader.sha256(f.path),
                                                size=f.size) for f in files])
        config = parse_lora_config(json.loads(reader.read(CONFIG_NAME, 0, 256 * 1024)))
        record = AdapterRecord(
            adapter_id=release.adapter_id, base_model=release.base_model,
            version=release.version, rank=config.rank,
            artifact_uri=f"s3://{bucket}/{release.adapter_id}/"
                         f"{release.version}-{manifest.digest[:8]}/",
            sha256=manifest.digest, size_bytes=max(manifest.total_size, 1),
            tenant_id=release.tenant_id, priority=release.priority,
            compatibility=Compatibility(tokenizer_revision=release.tokenizer_revision,
                                        target_modules=sorted(config.target_modules),
                                        max_lora_rank=config.rank))
    except FileNotFoundError:
        raise ArtifactError(f"{folder}: no {CONFIG_NAME}") from None
    except (ValueError, ValidationError) as exc:  # JSON, LoRA config and model errors
        raise ArtifactError(f"{folder}: {exc}") from None
    verdict = verify_artifact(_WithManifest(reader, manifest.canonical_bytes()),
                              WorkerLimits(base_model=release.base_model,
                                           max_lora_rank=record.rank), record)
    if not verdict.ok:
        raise ArtifactError("refused: " + "; ".join(
            f"{r.reason}" + (f" {r.path}" if r.path else "") + (f" ({r.detail})" if r.detail
                                                                   else "")
            for r in verdict.refusals))
    return record, manifest


def s3_client(settings: Settings) -> Any:
    from loraplane.infra.s3 import S3

    return S3(settings).client()


def upload(settings: Settings, folder: Path, record: AdapterRecord, manifest: Manifest) -> None:
    """Every manifest file, then manifest.json last: a prefix with a manifest is complete."""
    client = s3_client(settings)
    bucket, prefix = parse_s3_uri(record.artifact_uri)
    for f in manifest.files:
        client.upload_file(str(folder / f.path), bucket, prefix + f.path)
    client.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME, Body=manifest.canonical_bytes(),
                      ContentType="application/json")


@contextmanager
def local_folder(settings: Settings, source: str) -> Iterator[Path]:
    """A local folder with the artifact: the folder itself, or an allowed S3 prefix
    downloaded (top-level objects only) into a temporary folder."""
    if not source.startswith("s3://"):
        path = Path(source)
        if not path.is_dir():
            raise ArtifactError(f"{source}: not a folder")
        yield path
        return
    uri = source if source.endswith("/") else source + "/"
    try:
        bucket, prefix = check_allowed(uri, settings.s3.allowed_prefixes)
    except FetchRefused as exc:
        raise ArtifactError(str(exc)) from None
    client = s3_client(settings)
    with tempfile.TemporaryDirectory(prefix="loraplane-publish-") as tmp:
        listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix, Delimiter="/")
        keys = [o["Key"] for o in listing.get("Contents", [])]
        if not keys:
            raise ArtifactError(f"{uri}: no objects")
        for key in keys:
            name = key[len(prefix):]
            if not is_safe_relative_path(name):
                raise ArtifactError(f"{uri}: unsafe object name {name[:100]!r}")
            if name != MANIFEST_NAME:
                client.download_file(bucket, key, str(Path(tmp) / name))
        yield Path(tmp)
