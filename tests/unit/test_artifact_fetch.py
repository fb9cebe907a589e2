"""Source allowlist and the retry/backoff/deadline arithmetic of the fetcher (no network:
the client is a stub that fails like botocore does; the real S3 paths are in
tests/integration/test_host_tier.py)."""

from __future__ import annotations

import errno
import hashlib
import io
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from hypothesis import given
from hypothesis import strategies as st

from loraplane.artifact.refusal import ArtifactError
from loraplane.kernel.config import S3Settings
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.workers.artifact_fetch import (
    ArtifactFetcher,
    FetchPolicy,
    _HashingWriter,
    check_allowed,
)

ALLOWED = ["s3://loraplane-artifacts/", "s3://shared/tenants/acme"]


@pytest.mark.parametrize(
    "uri",
    [
        "s3://loraplane-artifacts/a/1/",
        "s3://loraplane-artifacts/",
        "s3://shared/tenants/acme/x/",
    ],
)
def test_allowed_sources(uri: str) -> None:
    check_allowed(uri, ALLOWED)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://loraplane-artifacts-evil/a/1/",  # a prefix of the bucket name is not the bucket
        "s3://shared/tenants/acme-evil/x/",  # nor a prefix of a folder name
        "s3://shared/tenants/",
        "s3://loraplane-artifacts/../other/",
        "s3://loraplane-artifacts/a/./b/",
        "s3://loraplane-artifacts/a/1",  # not a folder
        "/etc/passwd",
        "file:///etc/passwd",
        "https://loraplane-artifacts.s3.amazonaws.com/a/",
        "s3://loraplane-artifacts//a/",
    ],
)
def test_refused_sources(uri: str) -> None:
    with pytest.raises(ArtifactError) as refused:
        check_allowed(uri, ALLOWED)
    assert refused.value.reasons == (Reason.source_not_allowed,)


class FailingClient:
    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def get_object(self, **_: Any) -> Any:
        self.calls += 1
        raise self.error


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def fetch_with(
    error: Exception, policy: FetchPolicy, tmp_path: Path
) -> tuple[ArtifactError, FailingClient, Clock]:
    clock, client = Clock(), FailingClient(error)
    fetcher = ArtifactFetcher(
        S3Settings(), policy, sleep=clock.sleep, clock=lambda: clock.now, client=client
    )
    with pytest.raises(ArtifactError) as failed:
        fetcher.fetch(
            "s3://loraplane-artifacts/a/1/",
            tmp_path / "dest",
            expected_sha256=None,
            max_total_bytes=10**6,
            owner=None,
        )
    return failed.value, client, clock


def test_unreachable_store_is_retried_with_backoff_then_reported(tmp_path: Path) -> None:
    down = EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    error, client, clock = fetch_with(
        down, FetchPolicy(attempts=4, backoff_s=0.1, max_backoff_s=0.3), tmp_path
    )
    assert error.reasons == (Reason.artifact_store_unavailable,) and error.is_failure
    assert client.calls == 4
    assert clock.sleeps == [0.1, 0.2, 0.3]


def test_the_deadline_stops_retrying_early(tmp_path: Path) -> None:
    down = EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    error, client, _ = fetch_with(
        down, FetchPolicy(attempts=10, backoff_s=1.0, max_backoff_s=1.0, deadline_s=2.5), tmp_path
    )
    assert error.reasons == (Reason.artifact_store_unavailable,)
    assert client.calls == 3


@pytest.mark.parametrize(
    ("code", "reason", "calls"),
    [
        ("NoSuchKey", Reason.manifest_missing, 1),
        ("AccessDenied", Reason.fetch_failed, 1),
        ("SlowDown", Reason.artifact_store_unavailable, 3),
        ("503", Reason.artifact_store_unavailable, 3),
    ],
)
def test_store_answers_map_to_reasons(
    code: str, reason: Reason, calls: int, tmp_path: Path
) -> None:
    answer = ClientError({"Error": {"Code": code, "Message": "x"}}, "GetObject")
    error, client, _ = fetch_with(answer, FetchPolicy(attempts=3), tmp_path)
    assert error.reasons == (reason,)
    assert client.calls == calls


@given(st.lists(st.binary(max_size=300), max_size=12), st.integers(1, 3))
def test_hashing_writer_writes_and_hashes_every_chunk_in_order(
    chunks: list[bytes], depth: int
) -> None:
    out = io.BytesIO()
    with _HashingWriter(out, depth) as sink:
        for chunk in chunks:
            sink.write(chunk)
    assert out.getvalue() == b"".join(chunks)
    assert sink.hexdigest() == hashlib.sha256(b"".join(chunks)).hexdigest()


class FullDisk(io.BytesIO):
    def write(self, _data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_write_error_in_the_hashing_thread_reaches_the_caller() -> None:
    with pytest.raises(OSError) as caught, _HashingWriter(FullDisk(), 1) as sink:
        for _ in range(50):  # the error surfaces on a later write or on leaving the block
            sink.write(b"x" * 4096)
    assert caught.value.errno == errno.ENOSPC


# ---- the owner's prefix (loraplane.artifact.owner) ---------------------------------------
def _owned(tenant: str = "acme", adapter: str = "chat", version: str = "1") -> Any:
    from tests.lifecycle_kit import record

    return record(adapter, version, tenant)


def test_the_owner_prefix_is_tenant_adapter_version_sha8() -> None:
    from loraplane.schemas.adapter import owner_prefix

    rec = _owned()
    assert owner_prefix(rec, "b") == f"s3://b/acme/chat/1-{rec.sha256[:8]}/"
    assert rec.artifact_uri == owner_prefix(rec, "loraplane-artifacts")  # what publish writes


@pytest.mark.parametrize(
    "uri",
    [
        "s3://loraplane-artifacts/beta/chat/1-{sha8}/",  # another tenant's prefix
        "s3://loraplane-artifacts/acme/sql/1-{sha8}/",  # another adapter of the same tenant
        "s3://loraplane-artifacts/acme/chat/2-{sha8}/",  # another version
        "s3://loraplane-artifacts/acme/chat/1-00000000/",  # another artifact
        "s3://loraplane-artifacts/acme/chat/1-{sha8}/sub/",  # below it
        "s3://loraplane-artifacts/acme/chat/",  # above it
        "s3://loraplane-artifacts/chat/1-{sha8}/",  # the old layout, without the tenant
    ],
)
def test_a_record_pointing_outside_its_owners_prefix_is_never_fetched(
    uri: str, tmp_path: Path
) -> None:
    """ATTACK: a record (genuinely signed or not) whose artifact_uri names objects that are
    not its own. Refused before a single S3 call."""
    rec = _owned()
    rec = rec.model_copy(update={"artifact_uri": uri.format(sha8=rec.sha256[:8])})
    client = FailingClient(AssertionError("no S3 call may happen"))
    fetcher = ArtifactFetcher(S3Settings(), client=client)
    with pytest.raises(ArtifactError) as refused:
        fetcher.fetch(
            rec.artifact_uri,
            tmp_path / "dest",
            expected_sha256=rec.sha256,
            max_total_bytes=10**6,
            owner=rec,
        )
    assert refused.value.reasons == (Reason.outside_owner_prefix,)
    assert client.calls == 0 and not (tmp_path / "dest").exists()


def test_a_uri_other_than_the_records_own_is_refused(tmp_path: Path) -> None:
    rec, other = _owned(), _owned("beta")
    client = FailingClient(AssertionError("no S3 call may happen"))
    with pytest.raises(ArtifactError) as refused:
        ArtifactFetcher(S3Settings(), client=client).fetch(
            other.artifact_uri,
            tmp_path / "d",
            expected_sha256=rec.sha256,
            max_total_bytes=10**6,
            owner=rec,
        )
    assert refused.value.reasons == (Reason.outside_owner_prefix,)
    assert client.calls == 0


ID = st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True)


@given(ID, ID, ID, ID, st.sampled_from(["1", "2", "1.1"]))
def test_owner_check_accepts_exactly_the_owners_prefix(
    tenant: str, adapter: str, other_tenant: str, other_adapter: str, version: str
) -> None:
    """PROPERTY: a record is accepted under its own prefix only; moved to any other
    tenant's or adapter's prefix it is refused."""
    from loraplane.artifact.owner import check_owner
    from loraplane.schemas.adapter import expected_artifact_prefix

    rec = _owned(tenant, adapter, version)
    check_owner(rec, "loraplane-artifacts")
    moved = rec.model_copy(
        update={
            "artifact_uri": expected_artifact_prefix(
                "loraplane-artifacts", other_tenant, other_adapter, version, rec.sha256
            )
        }
    )
    if (other_tenant, other_adapter) == (tenant, adapter):
        check_owner(moved, "loraplane-artifacts")
    else:
        with pytest.raises(ArtifactError) as refused:
            check_owner(moved, "loraplane-artifacts")
        assert refused.value.reasons == (Reason.outside_owner_prefix,)


class Store:
    """A bucket's objects by key; every key asked for is kept in ``asked``."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.asked: list[str] = []

    def get_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:
        self.asked.append(Key)
        data = self.objects[Key]
        return {"Body": io.BytesIO(data), "ContentLength": len(data)}


@pytest.mark.parametrize("lie", [-1, +1, 10**9])
def test_attack_a_record_whose_size_is_not_the_artifacts_is_never_downloaded(
    lie: int, tmp_path: Path
) -> None:
    """ATTACK: a signed record that pins a genuine manifest but says another ``size_bytes``
    (the planner places it by that size: 1 KiB said of 900 MiB overfills a host tier). The
    whole artifact was downloaded, up to the worker's global bound, and installed; it is
    refused as ``size_mismatch`` once the manifest is read, before a file of it."""
    from loraplane.artifact.verification import MANIFEST_NAME, record_size_bytes
    from loraplane.schemas.adapter import expected_artifact_prefix
    from loraplane.tiny_model import build_adapter
    from tests.hostile_corpus import record_for, write_manifest

    folder = build_adapter(tmp_path / "src", seed=3)
    manifest = write_manifest(folder)
    uri = expected_artifact_prefix("loraplane-artifacts", "t1", "hostile", "1", manifest.digest)
    prefix = uri.removeprefix("s3://loraplane-artifacts/")
    store = Store({prefix + p.name: p.read_bytes() for p in folder.iterdir()})
    honest = record_for(manifest, artifact_uri=uri)
    assert honest.size_bytes == record_size_bytes(manifest)
    fetcher = ArtifactFetcher(S3Settings(), client=store)
    got = fetcher.fetch(
        uri, tmp_path / "ok", expected_sha256=manifest.digest, max_total_bytes=10**8, owner=honest
    )
    assert got.manifest == manifest  # the genuine record fetches
    store.asked.clear()
    lying = honest.model_copy(update={"size_bytes": max(1, honest.size_bytes + lie)})
    with pytest.raises(ArtifactError) as refused:
        fetcher.fetch(
            uri,
            tmp_path / "lie",
            expected_sha256=manifest.digest,
            max_total_bytes=10**8,
            owner=lying,
        )
    assert refused.value.reasons == (Reason.size_mismatch,)
    assert store.asked == [prefix + MANIFEST_NAME]
