"""Turning an adapter folder into a published artifact: manifest, record, upload.

The folder (or an S3 prefix, downloaded first) is checked with the workers' own verifier
(``loraplane.artifact.verification``) against the record we are about to sign, so CI
refuses exactly what a worker would refuse: pickle weights, code, anything but
``adapter_config.json`` and ``adapter_model.safetensors``, inconsistent tensors, a rank or
base model that disagrees with adapter_config.json. Inert files PEFT writes beside them
(its ``README.md``) are left out and listed in the manifest's ``dropped``
(``loraplane.artifact.inert_files``). The upload goes to
the owner's prefix ``s3://BUCKET/TENANT_ID/ADAPTER_ID/VERSION-SHA8/``
(``loraplane.artifact.owner``, the same function the worker's fetcher checks) with
``manifest.json`` beside the files, so a worker fetches the manifest, checks its digest
against the signed ``sha256`` and then every file against the manifest.

A folder signed with OpenSSF model signing carries its bundle, ``model.sig``: it is verified
with the keyring's ``model_signers`` (``settings.keyring_path``; a signer allowed for the
tenant, files as signed: loraplane.artifact.model_signature), uploaded with the files and
named in the record (``model_signature``), and workers verify it again before loading.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from loraplane.artifact.directory import DirectoryArtifact
from loraplane.artifact.inert_files import Selection, select_for_publish
from loraplane.artifact.lora_config import parse_lora_config
from loraplane.artifact.model_shape import ModelShape
from loraplane.artifact.model_signature import Signed
from loraplane.artifact.model_signing_bundle import SIGNING_EXTRA, check_folder
from loraplane.artifact.refusal import ArtifactError as FetchRefused
from loraplane.artifact.refusal import Refusal
from loraplane.artifact.verification import (
    CONFIG_NAME,
    MANIFEST_NAME,
    MAX_JSON_FILE_BYTES,
    MAX_REFUSALS,
    MAX_TOTAL_BYTES,
    ArtifactReader,
    FileFacts,
    WorkerLimits,
    is_safe_relative_path,
    name_refusal,
    record_size_bytes,
    verify_artifact,
)
from loraplane.kernel.config import Settings
from loraplane.kernel.local_files import open_regular
from loraplane.kernel.log_lines import shown
from loraplane.schemas.adapter import (
    AdapterRecord,
    Compatibility,
    Priority,
    expected_artifact_prefix,
)
from loraplane.schemas.keyring import Keyring, KeyringError, load_keyring
from loraplane.schemas.manifest import MAX_FILES, DroppedFile, Manifest, ManifestFile
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.schemas.strict_json import strict_loads
from loraplane.workers.artifact_fetch import ArtifactFetcher, check_allowed, parse_s3_uri

__all__ = [
    "ArtifactError",
    "Prepared",
    "PublishRequest",
    "SigningUnavailable",
    "build_record",
    "local_folder",
    "prepare",
    "publish_keyring",
    "registered_version",
    "reupload",
    "s3_client",
    "upload",
]


class ArtifactError(ValueError):
    """The artifact cannot be published; the message says why, for CI logs, and
    ``refusals`` each reason of the verifier's, when it gave them."""

    def __init__(self, message: str, refusals: Sequence[Refusal] = ()) -> None:
        super().__init__(message)
        self.refusals = tuple(refusals)


class SigningUnavailable(ArtifactError):
    """The folder carries a model-signing bundle and the library to verify it is not
    installed here (``pip install 'loraplane[signing]'``)."""


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
    """The files we upload plus the manifest we computed, as the verifier's ArtifactReader."""

    def __init__(
        self, folder: DirectoryArtifact, kept: Sequence[FileFacts], manifest_bytes: bytes
    ) -> None:
        self.folder, self.kept, self.manifest_bytes = folder, kept, manifest_bytes

    def files(self) -> Sequence[FileFacts]:
        return [*self.kept, FileFacts(MANIFEST_NAME, "file", len(self.manifest_bytes))]

    def read(self, path: str, offset: int, length: int) -> bytes:
        if path == MANIFEST_NAME:
            return self.manifest_bytes[offset : offset + length]
        return self.folder.read(path, offset, length)

    def sha256(self, path: str) -> str:
        if path == MANIFEST_NAME:
            return hashlib.sha256(self.manifest_bytes).hexdigest()
        return self.folder.sha256(path)


@dataclass(frozen=True)
class Prepared:
    """A folder as publish would upload it: its manifest, and the reader a worker's view of
    the upload is verified through (kept files plus that manifest)."""

    manifest: Manifest
    reader: ArtifactReader
    selection: Selection


def prepare(folder: Path) -> Prepared:
    """Select what to upload and build its manifest, once the listing alone passed
    (``_listing_refusals``: nothing is hashed of a folder it refuses, which is an
    ArtifactError with its refusals); ValueError (pydantic's ValidationError included) when
    no manifest can describe the folder."""
    listing = DirectoryArtifact(folder)
    selection = select_for_publish(listing.files())
    unread = _listing_refusals(selection)
    if unread:
        raise _refused(unread)
    manifest = Manifest(
        files=[
            ManifestFile(path=f.path, sha256=listing.sha256(f.path), size=f.size)
            for f in selection.kept
            if f.kind == "file"
        ],
        dropped=[
            DroppedFile(path=f.path, sha256=listing.sha256(f.path), size=f.size, kind=kind)
            for f, kind in selection.dropped
        ],
    )
    return Prepared(
        manifest, _WithManifest(listing, selection.kept, manifest.canonical_bytes()), selection
    )


def publish_keyring(settings: Settings) -> Keyring | None:
    """The keyring a publish checks model-signing bundles with (``settings.keyring_path``);
    None when there is none to read (then a bundle is refused, and no tenant's
    ``require_model_signature`` is known here: the workers still apply it)."""
    try:
        return load_keyring(settings.keyring_path)
    except KeyringError:
        return None


def build_record(
    folder: Path,
    release: PublishRequest,
    bucket: str,
    *,
    base_model_aliases: Mapping[str, str] | None = None,
    model: ModelShape | None = None,
    keyring: Keyring | None = None,
) -> tuple[AdapterRecord, Manifest]:
    """Manifest and registry record of a local adapter folder, verified as a worker would
    (``model``: the base model's shapes, when the publisher has its config.json), its
    model-signing bundle, if any, with ``keyring``'s model signers."""
    listing = DirectoryArtifact(folder)
    odd = [f.path for f in listing.files() if f.kind != "file" and f.path != MANIFEST_NAME]
    if odd:
        raise ArtifactError(
            "not regular files (links are never followed, folders are never "
            f"part of an artifact): {', '.join(map(shown, odd))}"
        )
    try:
        prepared = prepare(folder)
        manifest = prepared.manifest
        # Strict, as the worker reads it (artifact.verification): deep nesting, duplicate
        # keys, NaN and an oversized file are a refusal here, not an exception of another kind.
        raw_config = listing.read(CONFIG_NAME, 0, MAX_JSON_FILE_BYTES + 1)
        config = parse_lora_config(strict_loads(raw_config, max_bytes=MAX_JSON_FILE_BYTES))
        record = AdapterRecord(
            adapter_id=release.adapter_id,
            base_model=release.base_model,
            version=release.version,
            rank=config.rank,
            artifact_uri=expected_artifact_prefix(
                bucket, release.tenant_id, release.adapter_id, release.version, manifest.digest
            ),
            sha256=manifest.digest,
            size_bytes=record_size_bytes(manifest),
            tenant_id=release.tenant_id,
            priority=release.priority,
            compatibility=Compatibility(
                tokenizer_revision=release.tokenizer_revision,
                target_modules=sorted(config.target_modules),
                max_lora_rank=config.rank,
            ),
        )
    except ArtifactError:
        raise  # the listing's refusals
    except FileNotFoundError:
        raise ArtifactError(f"{folder}: no {CONFIG_NAME}") from None
    except (ValueError, ValidationError) as exc:  # JSON, LoRA config and model errors
        raise ArtifactError(f"{folder}: {exc}") from None
    # The manifest was hashed from these very files, so the bundle is checked against it.
    signed = check_folder(folder, manifest, release.tenant_id, keyring)
    if isinstance(signed, tuple):
        if any(r.reason.is_failure for r in signed):
            raise SigningUnavailable(
                f"{folder} carries a model-signing bundle and the "
                "model-signing library is not installed: "
                f"pip install '{SIGNING_EXTRA}'"
            )
        raise _refused(signed)
    if isinstance(signed, Signed):
        record = record.model_copy(update={"model_signature": signed.signature})
    verdict = verify_artifact(
        prepared.reader,
        WorkerLimits(
            base_model=release.base_model,
            max_lora_rank=record.rank,
            model=model,
            base_model_aliases=base_model_aliases or {},
        ),
        record,
    )
    if not verdict.ok:
        raise _refused(verdict.refusals)
    return record, manifest


def _listing_refusals(selection: Selection) -> list[Refusal]:
    """What the folder's listing alone refuses, before a byte of it is read or hashed: a
    name no manifest can hold, more files than a manifest holds, more bytes than a worker
    takes (a sparse 200 GiB file is refused at once, not hashed for minutes first)."""
    out = [*selection.refusals]
    files = [f for f in selection.kept if f.kind == "file"]
    if len(files) > MAX_FILES:  # first: the names below may fill every place
        out.append(Refusal(Reason.too_large, detail=f"{len(files)} files > {MAX_FILES}"))
    total = sum(f.size for f in files)
    if total > MAX_TOTAL_BYTES:
        out.append(Refusal(Reason.too_large, detail=f"{total} bytes > {MAX_TOTAL_BYTES}"))
    out += [r for f in selection.kept if (r := name_refusal(f.path)) is not None]
    return out[:MAX_REFUSALS]


def _refused(refusals: Sequence[Refusal]) -> ArtifactError:
    return ArtifactError(
        "refused: "
        + "; ".join(
            f"{r.reason}"
            + (f" {shown(r.path)}" if r.path else "")
            + (f" ({r.detail})" if r.detail else "")
            for r in refusals
        ),
        refusals,
    )


def s3_client(settings: Settings) -> Any:
    from loraplane.infra.s3 import S3

    return S3(settings).client()


class _AsVerified:
    """A manifest file read for upload as it was verified: opened without following a link
    or waiting on a FIFO (``open_regular``), read up to its size and one byte more, hashed
    on the way. ``changed`` says how it differs from the manifest once read to its end."""

    def __init__(self, folder: Path, entry: ManifestFile) -> None:
        self.entry = entry
        self._fd = open_regular(folder / entry.path, follow_links=False)
        self._left = entry.size + 1
        self._digest = hashlib.sha256()
        self._size = 0

    def read(self, n: int = -1) -> bytes:
        n = self._left if n is None or n < 0 else min(n, self._left)
        chunk = os.read(self._fd, n) if n > 0 else b""
        self._left -= len(chunk)
        self._size += len(chunk)
        self._digest.update(chunk)
        return chunk

    def changed(self) -> str | None:
        while self.read(1 << 20):  # a short read by the uploader still hashes the rest
            pass
        if self._size != self.entry.size:
            return f"{self._size} bytes, verified as {self.entry.size}"
        if self._digest.hexdigest() != self.entry.sha256:
            return "its bytes are not the ones verified"
        return None

    def close(self) -> None:
        os.close(self._fd)


def upload(settings: Settings, folder: Path, record: AdapterRecord, manifest: Manifest) -> None:
    """Every manifest file, then manifest.json last: a prefix with a manifest is complete.
    Each file is uploaded from the bytes it has when read (``_AsVerified``): one swapped
    for a link, a FIFO or other bytes since it was verified is deleted from the store
    again and is an ArtifactError, and no manifest is written."""
    client = s3_client(settings)
    bucket, prefix = parse_s3_uri(record.artifact_uri)
    for f in manifest.files:
        try:
            body = _AsVerified(folder, f)
        except OSError as exc:
            raise ArtifactError(f"{shown(f.path)}: changed since it was verified: {exc}") from None
        try:
            client.upload_fileobj(body, bucket, prefix + f.path)
            changed = body.changed()
        finally:
            body.close()
        if changed is not None:
            client.delete_object(Bucket=bucket, Key=prefix + f.path)
            raise ArtifactError(f"{shown(f.path)}: changed since it was verified: {changed}")
    client.put_object(
        Bucket=bucket,
        Key=prefix + MANIFEST_NAME,
        Body=manifest.canonical_bytes(),
        ContentType="application/json",
    )


@contextmanager
def local_folder(settings: Settings, source: str) -> Iterator[Path]:
    """A local folder with the artifact: the folder itself, or an allowed S3 prefix
    downloaded (top-level objects only, each up to its listed size) into a temporary folder
    once its listing passed the checks a local folder's does before any byte is read
    (``_listing_refusals``)."""
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
        raise ArtifactError(str(exc), exc.refusals) from None
    client = s3_client(settings)
    with tempfile.TemporaryDirectory(prefix="loraplane-publish-") as tmp:
        listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix, Delimiter="/")
        objects = {o["Key"][len(prefix) :]: int(o["Size"]) for o in listing.get("Contents", [])}
        if not objects:
            raise ArtifactError(f"{uri}: no objects")
        unsafe = [name for name in objects if not is_safe_relative_path(name)]
        if unsafe:
            raise ArtifactError(f"{uri}: unsafe object name {shown(unsafe[0][:100])}")
        objects.pop(MANIFEST_NAME, None)
        # the listing's names, count and sizes first: nothing is downloaded of a prefix
        # publish would refuse (a 200 GiB object, a thousand files)
        facts = [FileFacts(name, "file", size) for name, size in objects.items()]
        unread = _listing_refusals(select_for_publish(facts))
        if unread:
            raise _refused(unread)
        # each object as listed: one grown since is cut off at its listed size, never
        # written to the end the store now gives it
        fetcher = ArtifactFetcher(settings.s3, client=client)
        for name, size in objects.items():
            try:
                fetcher.download_listed(bucket, prefix, name, Path(tmp), size)
            except FetchRefused as exc:
                raise ArtifactError(f"{uri}: {exc}", exc.refusals) from None
        yield Path(tmp)


def registered_version(settings: Settings, adapter_id: str, version: str) -> AdapterRecord:
    """The record of ``adapter_id`` ``version`` in the registry, from a view whose signed
    evidence verifies with this machine's keyring (``settings.keyring_path``), as a worker
    accepts it; ArtifactError otherwise."""
    from loraplane.registry.evidence import ViewRefused, verify_view
    from loraplane.registry.topic import RegistryUnreadable, load_registry
    from loraplane.schemas.base import now_utc
    from loraplane.schemas.keyring import KeyringError, load_keyring

    try:
        view = load_registry(settings).get(adapter_id)
    except RegistryUnreadable as exc:
        raise ArtifactError(str(exc)) from None
    if view is None:
        raise ArtifactError(f"{adapter_id} is not in the registry: nothing to re-upload")
    try:
        keyring = load_keyring(settings.keyring_path)
    except KeyringError as exc:
        raise ArtifactError(f"keyring: {exc}") from None
    verdict = verify_view(view, keyring, now_utc())
    if isinstance(verdict, ViewRefused):
        raise ArtifactError(
            f"the registry view of {adapter_id} does not verify "
            f"({verdict.reason}: {verdict.detail}); refusing to re-upload"
        )
    record = next((r for r in view.versions if r.version == version), None)
    if record is None:
        raise ArtifactError(
            f"{adapter_id} has no version {version} in the registry "
            f"(registered: {', '.join(r.version for r in view.versions)})"
        )
    return record


def reupload(
    settings: Settings, folder: Path, registered: AdapterRecord, *, model: ModelShape | None = None
) -> Manifest:
    """Put a registered version's bytes back in the store (after the store lost them):
    the folder is verified as ``publish`` verifies it, and its manifest digest must be the
    signed ``registered.sha256``, else ArtifactError and nothing is written. No lifecycle
    event: the registry already holds this version."""
    record, manifest = build_record(
        folder,
        PublishRequest(
            registered.adapter_id,
            registered.tenant_id,
            registered.base_model,
            registered.version,
            registered.priority,
            registered.compatibility.tokenizer_revision,
        ),
        settings.s3.bucket,
        base_model_aliases=settings.base_model_aliases,
        model=model,
        keyring=publish_keyring(settings),
    )
    if record.sha256 != registered.sha256 or record.artifact_uri != registered.artifact_uri:
        raise ArtifactError(
            f"{folder}: manifest digest {record.sha256} is not the registered (signed) digest "
            f"{registered.sha256} of {registered.adapter_id} {registered.version}: these are "
            "not its bytes; refusing to upload"
        )
    upload(settings, folder, registered, manifest)
    return manifest
