"""Fetch one adapter artifact from the S3 cold tier into a local folder.

Trust flows from the signed registry record: its ``artifact_uri`` must lie under an
allowlisted prefix (never a path from a request) and be exactly its owner's prefix
``s3://BUCKET/<tenant_id>/<adapter_id>/<version>-<sha8>/`` (``loraplane.artifact.owner``),
its ``sha256`` pins ``manifest.json``, fetched first, which pins every other file by size and
sha256, their total the record's ``size_bytes`` (what the planner places by). Only files the
manifest lists are ever downloaded; each is streamed to disk with its sha256 computed in
the same pass, and a file that grows past its listed size is cut off at once.

Speed: a second thread hashes and writes each chunk while the next one is read from the
network. hashlib, file writes and socket reads all release the GIL on large buffers, so the
three proceed at once instead of in turn (sha256 alone runs at well under twice the speed of
a local S3 download).

Failure is bounded: small connect/read timeouts, a few retries with exponential backoff,
and one deadline for the whole fetch, so "S3 is down" becomes
``artifact_store_unavailable`` within seconds instead of a hung load; the deadline and
``stop`` (the worker's shutdown) are checked after every socket read (``_arrivals``).
"""

from __future__ import annotations

import hashlib
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, TypeVar

from pydantic import ValidationError

from loraplane.artifact.owner import check_owner
from loraplane.artifact.refusal import ArtifactError, Refusal
from loraplane.artifact.verification import (
    MANIFEST_NAME,
    MAX_JSON_FILE_BYTES,
    name_refusal,
    record_size_refusal,
)
from loraplane.kernel.config import S3Settings
from loraplane.kernel.local_files import read_regular
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.manifest import Manifest
from loraplane.schemas.reasons import ArtifactReason as Reason

__all__ = [
    "ArtifactFetcher",
    "FetchPolicy",
    "FetchStopped",
    "FetchedArtifact",
    "T",
    "check_allowed",
    "parse_s3_uri",
    "s3_client",
]

T = TypeVar("T")
_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,62})/(?P<prefix>([A-Za-z0-9._@=-]+/)*)$")
_TRANSIENT_CODES = {
    "500",
    "502",
    "503",
    "504",
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
}
_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}


class FetchStopped(Exception):
    """The fetcher was stopped (``ArtifactFetcher.stop``): the worker is shutting down, so
    nothing is refused and there is nothing to record."""


@dataclass(frozen=True)
class FetchPolicy:
    """Worst case for a store that accepts connections and never answers:
    ``attempts * (connect + read timeout) + backoffs`` (defaults: about 10 s); a refused
    connection fails in about ``sum(backoffs)`` (0.6 s)."""

    connect_timeout_s: float = 1.0
    read_timeout_s: float = 2.0
    attempts: int = 3
    backoff_s: float = 0.2  # doubled after each failed attempt
    max_backoff_s: float = 2.0
    deadline_s: float = 60.0  # for the whole artifact, large weights included
    chunk_bytes: int = 1024 * 1024
    chunks_ahead: int = 4  # read ahead of the hashing writer (memory: chunk_bytes each)


@dataclass(frozen=True)
class FetchedArtifact:
    root: Path
    manifest: Manifest
    digests: dict[str, str]  # sha256 of every file written, computed while streaming
    bytes: int
    elapsed_ms: float


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ``("bucket", "a/b/")``; ArtifactError for anything else."""
    m = _URI.fullmatch(uri)
    if m is None or any(seg in (".", "..") for seg in m.group("prefix").split("/")):
        raise ArtifactError.single(
            Reason.source_not_allowed, uri[:200], "not an s3://bucket/prefix/ folder URI"
        )
    return m.group("bucket"), m.group("prefix")


def check_allowed(uri: str, allowed_prefixes: list[str]) -> tuple[str, str]:
    """Bucket and key prefix of ``uri`` if it lies under an allowlisted prefix, else refuse."""
    bucket, prefix = parse_s3_uri(uri)
    if not any(uri.startswith(p if p.endswith("/") else p + "/") for p in allowed_prefixes):
        raise ArtifactError.single(
            Reason.source_not_allowed, uri[:200], "outside settings.s3.allowed_prefixes"
        )
    return bucket, prefix


def s3_client(s3: S3Settings, policy: FetchPolicy = FetchPolicy()) -> Any:
    """A boto3 S3 client with our timeouts and no retries of its own (callers retry), that
    never chases a redirect (``kernel.s3_redirects``: ``RedirectRefused``, a
    ``fetch_failed``)."""
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3",
        endpoint_url=s3.endpoint_url,
        region_name=s3.region,
        aws_access_key_id=s3.access_key_id,
        aws_secret_access_key=s3.secret(),
        config=Config(
            connect_timeout=policy.connect_timeout_s,
            read_timeout=policy.read_timeout_s,
            retries={"total_max_attempts": 1, "mode": "standard"},
            s3={"addressing_style": "path"},
        ),
    )
    from loraplane.kernel.s3_redirects import refusing_redirects

    return refusing_redirects(client)


class ArtifactFetcher:
    """Thread-safe; one boto3 client per fetcher (made on first use unless ``client`` is
    given). ``sleep``/``clock`` are injectable so tests control time (the default sleep is
    a wait that ``stop`` ends)."""

    def __init__(
        self,
        s3: S3Settings,
        policy: FetchPolicy = FetchPolicy(),
        *,
        sleep: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        client: Any = None,
    ) -> None:
        self.s3 = s3
        self.policy = policy
        self._stopped = threading.Event()
        self._sleep: Callable[[float], object] = sleep or self._stopped.wait
        self._clock = clock
        self._client = client
        self._client_lock = threading.Lock()

    def stop(self) -> None:
        """End every download in flight at its next chunk or backoff, and every later
        ``fetch`` at once, with ``FetchStopped`` (the worker's shutdown: its threads end
        within about one socket read instead of running on to the fetch deadline)."""
        self._stopped.set()

    def _check_stopped(self, path: str) -> None:
        if self._stopped.is_set():
            raise FetchStopped(f"{path}: the fetcher was stopped")

    def _s3(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = s3_client(self.s3, self.policy)
            return self._client

    def fetch(
        self,
        artifact_uri: str,
        dest: Path,
        *,
        expected_sha256: str | None,
        max_total_bytes: int,
        owner: AdapterRecord | None,
    ) -> FetchedArtifact:
        """Download the artifact at ``artifact_uri`` (a registry record's) into the new
        folder ``dest``. ``expected_sha256`` is the record's manifest digest and ``owner``
        the record itself (both None only for offline inspection): the URI must then be
        the record's own and exactly its owner's prefix (``loraplane.artifact.owner``),
        checked before any byte is read. Raises ArtifactError; may leave a partial
        ``dest`` behind, which the caller owns and removes."""
        started = self._clock()
        deadline = started + self.policy.deadline_s
        self._check_stopped(artifact_uri[:200])
        bucket, prefix = check_allowed(artifact_uri, self.s3.allowed_prefixes)
        if owner is not None:
            if artifact_uri != owner.artifact_uri:
                raise ArtifactError.single(
                    Reason.outside_owner_prefix, artifact_uri[:200], "not the record's artifact_uri"
                )
            check_owner(owner, bucket)
        dest.mkdir(parents=True, exist_ok=False)
        digests: dict[str, str] = {}
        manifest_sha, manifest_size = self._download(
            bucket, prefix, MANIFEST_NAME, dest, MAX_JSON_FILE_BYTES, deadline, exact=False
        )
        digests[MANIFEST_NAME] = manifest_sha
        manifest = _load_manifest(dest / MANIFEST_NAME)
        refusals = [r for f in manifest.files if (r := name_refusal(f.path)) is not None]
        if expected_sha256 is not None and manifest.digest != expected_sha256:
            refusals.append(Refusal(Reason.manifest_digest_mismatch, MANIFEST_NAME))
        if owner is not None and (size := record_size_refusal(manifest, owner)) is not None:
            refusals.append(size)  # before a byte of the files is downloaded
        if manifest.total_size > max_total_bytes:
            refusals.append(
                Refusal(Reason.too_large, detail=f"{manifest.total_size} bytes > {max_total_bytes}")
            )
        if refusals:
            raise ArtifactError(refusals)
        for mf in manifest.files:
            sha, _ = self._download(bucket, prefix, mf.path, dest, mf.size, deadline, exact=True)
            if sha != mf.sha256:
                raise ArtifactError.single(Reason.sha256_mismatch, mf.path)
            digests[mf.path] = sha
        return FetchedArtifact(
            dest,
            manifest,
            digests,
            manifest_size + manifest.total_size,
            (self._clock() - started) * 1000,
        )

    def download_listed(self, bucket: str, prefix: str, path: str, dest: Path, size: int) -> str:
        """The object ``prefix + path`` into ``dest/path`` as a listing gave its ``size``:
        its sha256. One that has grown or shrunk since (the store's answer announces another
        size, or more bytes arrive) is an ArtifactError ``size_mismatch``, cut off at the
        first byte past ``size``; retries and the deadline are the policy's."""
        deadline = self._clock() + self.policy.deadline_s
        sha, _ = self._download(bucket, prefix, path, dest, size, deadline, exact=True)
        return sha

    def _download(
        self,
        bucket: str,
        prefix: str,
        path: str,
        dest: Path,
        size: int,
        deadline: float,
        *,
        exact: bool,
    ) -> tuple[str, int]:
        """One object to ``dest/path``: ``(sha256, bytes)``. ``size`` is the exact size
        (``exact``) or the most that may be read."""
        target = dest / path
        oversize = Reason.size_mismatch if exact else Reason.manifest_invalid

        def attempt() -> tuple[str, int]:
            self._check_stopped(path)
            response = self._get_object(bucket, prefix + path, path)
            announced = response.get("ContentLength")
            if announced is not None and (announced != size if exact else announced > size):
                response["Body"].close()
                raise ArtifactError.single(
                    oversize, path, f"store has {announced} bytes, expected {size}"
                )
            written = 0
            with open(target, "wb") as out, _HashingWriter(out, self.policy.chunks_ahead) as sink:
                try:
                    for chunk in _arrivals(response["Body"], announced, self.policy.chunk_bytes):
                        self._check_stopped(path)
                        written += len(chunk)
                        if written > size:
                            raise ArtifactError.single(oversize, path, f"over {size} bytes")
                        if self._clock() > deadline:
                            raise ArtifactError.single(
                                Reason.artifact_store_unavailable,
                                path,
                                "fetch deadline passed while streaming",
                            )
                        sink.write(chunk)
                finally:
                    response["Body"].close()
            if exact and written != size:
                raise ArtifactError.single(Reason.size_mismatch, path, f"{written} != {size}")
            return sink.hexdigest(), written

        missing = Reason.manifest_missing if path == MANIFEST_NAME else Reason.file_missing
        return self._with_retries(attempt, path, deadline, missing)

    def _get_object(self, bucket: str, key: str, path: str) -> Any:
        """``get_object``'s answer. One whose head botocore cannot parse (a Content-Length,
        date or count that is no number or date: its parsers raise ValueError,
        RuntimeError, ...) is a ``fetch_failed``, a store answer like a 403, instead of an
        exception the agent cannot map to a reason and a backoff."""
        from botocore.exceptions import BotoCoreError, ClientError
        from urllib3.exceptions import HTTPError as Urllib3Error

        from loraplane.kernel.s3_redirects import RedirectRefused

        try:
            return self._s3().get_object(Bucket=bucket, Key=key)
        except (BotoCoreError, ClientError, Urllib3Error, RedirectRefused, OSError):
            raise  # mapped by _with_retries
        except Exception as exc:
            raise ArtifactError.single(
                Reason.fetch_failed, path, f"unreadable answer: {type(exc).__name__}: {exc}"[:200]
            ) from None

    def _with_retries(self, op: Callable[[], T], what: str, deadline: float, missing: Reason) -> T:
        from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from urllib3.exceptions import HTTPError as Urllib3Error

        from loraplane.kernel.s3_redirects import RedirectRefused

        attempt, delay = 0, self.policy.backoff_s
        while True:
            attempt += 1
            try:
                return op()
            except RedirectRefused as exc:
                raise ArtifactError.single(Reason.fetch_failed, what, str(exc)) from None
            except ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                if code in _MISSING_CODES:
                    raise ArtifactError.single(missing, what) from None
                if code not in _TRANSIENT_CODES:
                    raise ArtifactError.single(Reason.fetch_failed, what, code[:60]) from None
                error: Exception = exc
            except (
                BotoConnectionError,
                HTTPClientError,
                IncompleteReadError,
                Urllib3Error,  # from the body's raw stream (_arrivals): timeout, cut short
            ) as exc:
                error = exc
            if attempt >= self.policy.attempts or self._clock() + delay > deadline:
                raise ArtifactError.single(
                    Reason.artifact_store_unavailable,
                    what,
                    f"{type(error).__name__} after {attempt} attempt(s)",
                ) from None
            self._sleep(delay)
            delay = min(delay * 2, self.policy.max_backoff_s)


def _arrivals(body: Any, announced: int | None, most: int) -> Iterator[bytes]:
    """The chunks of an S3 body as they arrive, each at most ``most`` bytes. One socket read
    per chunk (urllib3's ``read1`` under botocore's StreamingBody): ``read(most)`` would
    wait until ``most`` bytes came, so a body sent a byte per read timeout would hold a
    fetch for days between two deadline checks. A body that ends short of its
    Content-Length is an ``IncompleteReadError`` (retried), as botocore's own read says."""
    from botocore.exceptions import IncompleteReadError

    raw = getattr(body, "_raw_stream", None)
    read = getattr(raw, "read1", None) or body.read
    got = 0
    while chunk := read(most):
        got += len(chunk)
        yield chunk
    if announced is not None and got != announced:
        raise IncompleteReadError(actual_bytes=got, expected_bytes=announced)


class _HashingWriter:
    """sha256 + write of a stream of chunks, in a thread of its own so that the caller's
    next read overlaps them. Bounded (``depth`` chunks queued). A write error (disk full)
    is raised from the next ``write`` or from leaving the ``with`` block; leaving it always
    stops the thread."""

    def __init__(self, out: BinaryIO, depth: int) -> None:
        self._out = out
        self._digest = hashlib.sha256()
        self._chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=max(depth, 1))
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._drain, name="artifact-hash", daemon=True)

    def __enter__(self) -> _HashingWriter:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._chunks.put(None)
        self._thread.join()
        if kind is None and self._error is not None:
            raise self._error

    def _drain(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            if self._error is None:  # after an error, only empty the queue
                try:
                    self._digest.update(chunk)
                    self._out.write(chunk)
                except OSError as exc:
                    self._error = exc

    def write(self, chunk: bytes) -> None:
        if self._error is not None:
            raise self._error
        self._chunks.put(chunk)

    def hexdigest(self) -> str:
        """The digest of everything written; only after the ``with`` block."""
        return self._digest.hexdigest()


def _load_manifest(path: Path) -> Manifest:
    try:
        return Manifest.model_validate_json(
            read_regular(path, MAX_JSON_FILE_BYTES, follow_links=False)
        )
    except ValidationError as exc:
        raise ArtifactError.single(
            Reason.manifest_invalid, MANIFEST_NAME, f"{exc.error_count()} schema errors"
        ) from None
