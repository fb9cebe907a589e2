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
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.workers.artifact_fetch import (
    ArtifactFetcher,
    FetchPolicy,
    _HashingWriter,
    check_allowed,
)

from loraplane.artifact.refusal import ArtifactError
from loraplane.kernel.config import S3Settings

ALLOWED = ["s3://loraplane-artifacts/", "s3://shared/tenants/acme"]


@pytest.mark.parametrize("uri", [
    "s3://loraplane-artifacts/a/1/",
    "s3://loraplane-artifacts/",
    "s3://shared/tenants/acme/x/",
])
def test_allowed_sources(uri: str) -> None:
    check_allowed(uri, ALLOWED)


@pytest.mark.parametrize("uri", [
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
])
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


def fetch_with(error: Exception, policy: FetchPolicy, tmp_path: Path) -> tuple[ArtifactError,
                                                                              FailingClient,
                                                                              Clock]:
    clock, client = Clock(), FailingClient(error)
    fetcher = ArtifactFetcher(S3Settings(), policy, sleep=clock.sleep, clock=lambda: clock.now,
                              client=client)
    with pytest.raises(ArtifactError) as failed:
        fetcher.fetch("s3://loraplane-artifacts/a/1/", tmp_path / "dest",
                      expected_sha256=None, max_total_bytes=10**6)
    return failed.value, client, clock


def test_unreachable_store_is_retried_with_backoff_then_reported(tmp_path: Path) -> None:
    down = EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    error, client, clock = fetch_with(down, FetchPolicy(attempts=4, backoff_s=0.1,
                                                        max_backoff_s=0.3), tmp_path)
    assert error.reasons == (Reason.artifact_store_unavailable,) and error.is_failure
    assert client.calls == 4
    assert clock.sleeps == [0.1, 0.2, 0.3]


def test_the_deadline_stops_retrying_early(tmp_path: Path) -> None:
    down = EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    error, client, _ = fetch_with(down, FetchPolicy(attempts=10, backoff_s=1.0,
                                                    max_backoff_s=1.0, deadline_s=2.5), tmp_path)
    assert error.reasons == (Reason.artifact_store_unavailable,)
    assert client.calls == 3


@pytest.mark.parametrize(("code", "reason", "calls"), [
    ("NoSuchKey", Reason.manifest_missing, 1),
    ("AccessDenied", Reason.fetch_failed, 1),
    ("SlowDown", Reason.artifact_store_unavailable, 3),
    ("503", Reason.artifact_store_unavailable, 3),
])
def test_store_answers_map_to_reasons(code: str, reason: Reason, calls: int,
                                      tmp_path: Path) -> None:
    answer = ClientError({"Error": {"Code": code, "Message": "x"}}, "GetObject")
    error, client, _ = fetch_with(answer, FetchPolicy(attempts=3), tmp_path)
    assert error.reasons == (reason,)
    assert client.calls == calls


@given(st.lists(st.binary(max_size=300), max_size=12), st.integers(1, 3))
def test_hashing_writer_writes_and_hashes_every_chunk_in_order(chunks: list[bytes],
                                                              depth: int) -> None:
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
