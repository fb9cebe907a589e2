"""Attack tests: the artifact fetcher against an S3 endpoint that answers hostile things.

A tiny HTTP server on 127.0.0.1 speaks just enough S3 for boto3's ``get_object`` (any GET
is a 200 with the head and body a case chooses), so the real botocore/urllib3 read path is
the one under test: a body that drips a byte at a time, stops short of its
Content-Length, announces more than the manifest allows, or is an XML error under a 200.
Every case ends in a refusal with its reason, never a hang or an unmapped exception.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from loraplane.artifact.refusal import ArtifactError
from loraplane.kernel.config import S3Settings
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.workers.artifact_fetch import ArtifactFetcher, FetchPolicy, FetchStopped

Answer = Callable[[socket.socket], None]
URI = "s3://bucket/acme/chat/"


def _head(length: int) -> bytes:
    return (
        f"HTTP/1.1 200 OK\r\nContent-Length: {length}\r\n"
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk


@pytest.fixture
def store() -> Iterator[Callable[[Answer], str]]:
    """``store(answer)`` starts a server that answers every request with ``answer``."""
    stop = threading.Event()
    servers: list[socket.socket] = []

    def start(answer: Answer) -> str:
        server = socket.create_server(("127.0.0.1", 0))
        server.settimeout(0.2)
        servers.append(server)

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except OSError:
                    continue
                with conn:
                    try:
                        _read_request(conn)
                        answer(conn)
                    except OSError:
                        pass

        threading.Thread(target=serve, daemon=True).start()
        return f"http://127.0.0.1:{server.getsockname()[1]}"

    yield start
    stop.set()
    for server in servers:
        server.close()


class StepClock:
    """Every reading is one second later than the last: the deadline arrives after a
    fixed number of the fetcher's checks, whatever the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Dripping:
    """An endpoint that sends a head of 10,000 bytes, then a byte every 10 ms until
    ``stop`` is set (each within any read timeout); ``began`` is set at its first answer."""

    settings: S3Settings
    began: threading.Event
    stop: threading.Event


def dripping(store: Callable[[Answer], str]) -> Dripping:
    began, stop = threading.Event(), threading.Event()

    def drip(conn: socket.socket) -> None:
        conn.sendall(_head(10_000))
        began.set()
        while not stop.wait(0.01):
            conn.sendall(b" ")

    settings = S3Settings(
        endpoint_url=store(drip), allowed_prefixes=["s3://bucket/"], secret_access_key="secret"
    )
    return Dripping(settings, began, stop)


def _fetch(endpoint: str, tmp_path: Path, policy: FetchPolicy) -> ArtifactError:
    clock = StepClock()
    settings = S3Settings(
        endpoint_url=endpoint, allowed_prefixes=["s3://bucket/"], secret_access_key="secret"
    )
    fetcher = ArtifactFetcher(settings, policy, sleep=clock.sleep, clock=clock)
    with pytest.raises(ArtifactError) as refused:
        fetcher.fetch(
            URI, tmp_path / "dest", expected_sha256=None, max_total_bytes=10**6, owner=None
        )
    return refused.value


def test_a_body_that_drips_is_cut_off_at_the_fetch_deadline(
    store: Callable[[Answer], str], tmp_path: Path
) -> None:
    """A byte at a time, each within the read timeout: only the whole fetch's deadline can
    stop it, so it must be checked between socket reads, not after a whole chunk."""
    stop = threading.Event()

    def drip(conn: socket.socket) -> None:
        conn.sendall(_head(400))
        for _ in range(400):
            if stop.wait(0.01):
                return
            conn.sendall(b" ")

    try:
        error = _fetch(store(drip), tmp_path, FetchPolicy(deadline_s=5.0, attempts=1))
    finally:
        stop.set()
    assert error.reasons == (Reason.artifact_store_unavailable,)
    assert "deadline" in str(error)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda c: c.sendall(_head(1000) + b"{" * 10), id="short-of-content-length"),
        pytest.param(
            lambda c: (
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0"),
                c.sendall(_head(1000) + b"{}"),
            ),
            id="reset-mid-body",
        ),
    ],
)
def test_a_body_cut_short_is_retried_then_the_store_unavailable(
    answer: Answer, store: Callable[[Answer], str], tmp_path: Path
) -> None:
    error = _fetch(store(answer), tmp_path, FetchPolicy(attempts=2))
    assert error.reasons == (Reason.artifact_store_unavailable,)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        pytest.param(
            lambda c: c.sendall(_head(10**9) + b"{}"), Reason.manifest_invalid, id="too-long"
        ),
        pytest.param(
            lambda c: c.sendall(
                _head(120) + b'<?xml version="1.0"?><Error><Code>NoSuchKey</Code>'.ljust(120, b" ")
            ),
            Reason.manifest_invalid,
            id="xml-error-under-200",
        ),
        pytest.param(
            lambda c: c.sendall(_head(2) + b"{}" + b"x" * 5000), Reason.manifest_invalid, id="more"
        ),
        pytest.param(
            lambda c: c.sendall(b"HTTP/1.1 200 OK\r\nContent-Le"),
            Reason.manifest_invalid,
            id="cut-head",
        ),
    ],
)
def test_what_the_store_claims_is_refused_with_its_reason(
    answer: Answer, reason: Reason, store: Callable[[Answer], str], tmp_path: Path
) -> None:
    error = _fetch(store(answer), tmp_path, FetchPolicy(attempts=1))
    assert error.reasons == (reason,)


def _redirect(status: str, extra: str = "", body: bytes = b"") -> Answer:
    head = (
        f"HTTP/1.1 {status}\r\nLocation: http://127.0.0.1:9/elsewhere\r\n{extra}"
        f"Content-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return lambda c: c.sendall(head.encode() + body)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(_redirect("307 Temporary Redirect"), id="307"),
        pytest.param(_redirect("302 Found"), id="302"),
        pytest.param(
            _redirect(
                "301 Moved Permanently",
                "x-amz-bucket-region: eu-west-1\r\n",
                b"<Error><Code>PermanentRedirect</Code><Endpoint>127.0.0.1:9</Endpoint></Error>",
            ),
            id="301-to-another-region",
        ),
    ],
)
def test_a_redirect_is_a_fetch_failure_and_never_followed(
    answer: Answer, store: Callable[[Answer], str], tmp_path: Path
) -> None:
    """botocore answers an S3 redirect by asking the store for the bucket's region
    (HEAD /bucket), and a store that redirects that too made it recurse until
    RecursionError: the fetcher asks for objects only, and a redirect is a refusal."""
    requests: list[bytes] = []

    def recorded(conn: socket.socket) -> None:
        requests.append(b"")
        answer(conn)

    error = _fetch(store(recorded), tmp_path, FetchPolicy(attempts=1))
    assert error.reasons == (Reason.fetch_failed,)
    assert len(requests) <= 2  # the GET, and at most botocore's one re-signed retry


def test_publishs_client_refuses_a_redirect_as_a_botocore_error(
    store: Callable[[Answer], str], tmp_path: Path
) -> None:
    """The other S3 client (publish, reupload, the local stack) is given the same guard:
    a redirect ends as a botocore error its callers report, never a RecursionError."""
    from botocore.exceptions import BotoCoreError

    from loraplane.infra.s3 import S3
    from loraplane.kernel.config import Settings

    requests: list[bytes] = []

    def recorded(conn: socket.socket) -> None:
        requests.append(b"")
        _redirect("307 Temporary Redirect")(conn)

    settings = Settings(
        home=tmp_path,
        s3=S3Settings(endpoint_url=store(recorded), secret_access_key="secret"),
    )
    with pytest.raises(BotoCoreError, match="redirect"):
        S3(settings).client().get_object(Bucket="bucket", Key="acme/chat/manifest.json")
    assert len(requests) <= 2


def _bad_head(header: str) -> Answer:
    return lambda c: c.sendall(
        f"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n{header}\r\n\r\n{{}}".encode()
    )


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(
            lambda c: c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2e0\r\n\r\n{}"),
            id="content-length-no-integer",
        ),
        pytest.param(_bad_head("Last-Modified: 99999999999999999999999"), id="date-overflow"),
        pytest.param(_bad_head("Last-Modified: Mon, 99 Foo 9 99:99:99 GMT"), id="date-garbage"),
        pytest.param(_bad_head("x-amz-mp-parts-count: many"), id="count-no-integer"),
        pytest.param(_bad_head("x-amz-object-lock-retain-until-date: no"), id="lock-date"),
    ],
)
def test_an_answer_head_the_client_cannot_parse_is_a_fetch_failure(
    answer: Answer, store: Callable[[Answer], str], tmp_path: Path
) -> None:
    """ATTACK: a store (or whoever answers for it) sends a head whose Content-Length, date or
    count botocore cannot parse. Its ValueError or RuntimeError left the fetch unmapped: the
    agent set no backoff (a GET of the hostile store every tick), answered none of the
    requests waiting for the load and reported no reason. It is a ``fetch_failed`` now."""
    error = _fetch(store(answer), tmp_path, FetchPolicy(attempts=1))
    assert error.reasons == (Reason.fetch_failed,)
    assert error.is_failure


def test_a_stopped_fetch_ends_at_its_next_chunk_and_a_later_one_at_once(
    store: Callable[[Answer], str], tmp_path: Path
) -> None:
    """``stop`` (the worker's shutdown) ends a download that a store drips for ever at its
    next chunk, with ``FetchStopped``, instead of at the fetch deadline; a fetch after it
    fails before it connects."""
    drip = dripping(store)
    fetcher = ArtifactFetcher(drip.settings, FetchPolicy(attempts=1, deadline_s=60.0))
    ended: list[BaseException] = []

    def fetch(dest: Path) -> None:
        try:
            fetcher.fetch(URI, dest, expected_sha256=None, max_total_bytes=10**6, owner=None)
        except BaseException as exc:
            ended.append(exc)

    worker = threading.Thread(target=fetch, args=(tmp_path / "first",), daemon=True)
    try:
        worker.start()
        assert drip.began.wait(10)
        fetcher.stop()
        worker.join(10)  # a socket read (2 s) at most; the deadline is 60 s
        assert not worker.is_alive()
        drip.began.clear()  # set again by a request the second fetch makes
        fetch(tmp_path / "second")
    finally:
        drip.stop.set()
    assert [type(e) for e in ended] == [FetchStopped, FetchStopped]
    assert not drip.began.is_set() and not (tmp_path / "second").exists()
