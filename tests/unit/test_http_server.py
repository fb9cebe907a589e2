"""ATTACK tests of the bounded HTTP listener (loraplane.kernel.http_server) on loopback.

Before it, every server ran aiohttp's or http.server's defaults: no deadline on a request
head or body (a slowloris held a connection forever), no connection cap (20,000 half-open
connections hit EMFILE) and one log line per failed accept.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import re
import resource
import socket
import sys
from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession, web

from loraplane.dashboards.web import Dashboard
from loraplane.kernel.config import HttpLimits, Settings
from loraplane.kernel.http_server import (
    ERROR_ANSWER,
    HEAD_CHECK,
    bound_port,
    connection_budget,
    expect_continue,
    log,
    open_connections,
    start_site,
)
from loraplane.kernel.log_burst import LogBurst
from loraplane.schemas.reasons import ServerRefusal

pytestmark = pytest.mark.asyncio(loop_scope="session")
LIMITS = HttpLimits(
    header_timeout_s=0.3,
    body_timeout_s=0.3,
    keepalive_timeout_s=0.5,
    max_connections=20,
    max_header_bytes=2048,
    error_log_interval_s=60,
)


async def _hello(request: web.Request) -> web.Response:
    body = await request.read()
    return web.Response(text=f"ok {len(body)}")


async def _slow_stream(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse()
    await out.prepare(request)
    for _ in range(8):  # longer than every deadline: a response in progress is never cut
        await out.write(b"x")
        await asyncio.sleep(0.1)
    await out.write_eof()
    return out


@pytest.fixture
async def site() -> AsyncIterator[tuple[int, web.AppRunner, LogBurst]]:
    app = web.Application(client_max_size=4096)
    app.router.add_route("*", "/", _hello)
    app.router.add_get("/stream", _slow_stream)
    runner, burst = await start_site(app, "127.0.0.1", 0, LIMITS, name="test")
    yield bound_port(runner), runner, burst
    await runner.cleanup()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    return await asyncio.wait_for(reader.read(), seconds)


async def _open_connections_become(runner: web.AppRunner, n: int, seconds: float = 5.0) -> int:
    """The server's open connections once they are ``n`` (or what they are after
    ``seconds``): accepting and closing run on the loop, a fixed sleep is a race on a busy
    machine."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while open_connections(runner) != n and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return open_connections(runner)


async def _get(port: int, path: str = "/") -> tuple[int, str]:
    async with ClientSession() as http, http.get(f"http://127.0.0.1:{port}{path}") as resp:
        return resp.status, await resp.text()


async def test_a_head_that_never_ends_is_closed_by_its_deadline(site) -> None:
    port, _, burst = site
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # ... and never the blank line
    for _ in range(2):
        await asyncio.sleep(0.1)
        writer.write(b"X-a: b\r\n")  # a slowloris keeps the connection busy
    assert await _closed_within(reader, 2) == b""
    assert burst.total["header_timeout"] == 1
    assert await _get(port) == (200, "ok 0")  # the server still answers
    writer.close()


async def test_a_body_that_never_ends_is_closed_by_its_deadline(site) -> None:
    port, _, burst = site
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
    assert await _closed_within(reader, 2) == b""
    assert burst.total["body_timeout"] == 1
    writer.close()


@pytest.mark.parametrize(
    "encoding, body",
    [
        (b"gzip", b"not gzip at all"),
        (b"deflate", b"\x00\x01\x02\x03"),
        (b"gzip", gzip.compress(b"x" * 100, mtime=0)[:10] + b"\xff" * 30),  # broken inside
    ],
)
async def test_a_body_that_cannot_be_decoded_is_a_400_not_a_500(
    site, caplog: pytest.LogCaptureFixture, encoding: bytes, body: bytes
) -> None:
    """A body whose ``Content-Encoding`` does not decode is the client's error: a 400 and
    the connection closed (where its next request starts is unknown), never a 500 and an
    unhandled exception in the server's log."""
    port, _, _ = site
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Encoding: %s\r\nContent-Length: %d\r\n\r\n"
        % (encoding, len(body))
        + body
    )
    answer = await _closed_within(reader, 2)
    writer.close()
    assert answer.split(b" ", 2)[1] == b"400", answer
    # a parser's refusal is aiohttp's rate-limited line; never an unhandled one
    assert not any("Unhandled" in r.getMessage() for r in caplog.records)
    assert await _get(port) == (200, "ok 0")


@pytest.mark.parametrize("head", [b"GET / HTTP/1.1\nHost: x\n\n", b"GET / HTTP/1.1\r\nHost: x\n\n"])
async def test_a_bare_lf_head_is_answered_400_not_held_to_its_deadline(site, head) -> None:
    """A head whose lines end in a bare LF (the blank line too) is refused by aiohttp's
    parser with a 400; the bounded server waited for a CRLF CRLF that never came and closed
    the connection at the head deadline without a word."""
    port, _, burst = site
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    answer = await asyncio.wait_for(reader.readline(), 2)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert burst.total["header_timeout"] == 0
    writer.close()


async def test_an_oversized_head_gets_431_and_is_closed(site) -> None:
    port, _, burst = site
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\n" + b"X-pad: " + b"a" * 4000 + b"\r\n")
    answer = await _closed_within(reader, 2)
    assert answer.startswith(b"HTTP/1.1 431")
    assert burst.total["header_too_large"] == 1
    writer.close()


async def test_an_idle_keepalive_connection_is_closed(site) -> None:
    port, _, _ = site
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"ok 0"), 2)
    assert head.startswith(b"HTTP/1.1 200")
    assert await _closed_within(reader, 3) == b""  # keep-alive, then nothing: closed
    writer.close()


@contextlib.asynccontextmanager
async def _server(limits: HttpLimits) -> AsyncIterator[tuple[int, web.AppRunner, LogBurst]]:
    app = web.Application(client_max_size=4096)
    app.router.add_route("*", "/", _hello)
    app.router.add_get("/stream", _slow_stream)
    runner, burst = await start_site(app, "127.0.0.1", 0, limits, name="test")
    try:
        yield bound_port(runner), runner, burst
    finally:
        await runner.cleanup()


async def _is_closed(reader: asyncio.StreamReader, seconds: float = 2.0) -> bool:
    """True when the server closed it (end of stream or a reset) within ``seconds``."""
    try:
        while await asyncio.wait_for(reader.read(65536), seconds):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


async def _open(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One GET / on a kept-alive connection; its whole answer."""
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return await asyncio.wait_for(reader.readuntil(b"ok 0"), 2)


SHEDDING = HttpLimits(
    header_timeout_s=30,
    body_timeout_s=30,
    keepalive_timeout_s=30,
    max_connections=4,
    error_log_interval_s=60,
)
HALF_HEAD = b"GET / HTTP/1.1\r\nHost: x\r\n"


async def test_at_the_cap_the_connection_waiting_longest_is_shed_not_the_new_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with _server(SHEDDING) as (port, runner, burst):
        held = [
            await _open(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        ]  # a body that trickles
        held += [await _open(port, data) for data in (b"", HALF_HEAD, HALF_HEAD)]
        assert await _open_connections_become(runner, 4) == 4
        with caplog.at_level(logging.WARNING, logger="loraplane.http"):
            held.append(await _open(port, HALF_HEAD))  # the fifth: the first is shed
            assert await _is_closed(held[0][0])
            assert not await _is_closed(held[1][0], 0.2)
            assert await _get(port) == (200, "ok 0")  # a real request: the second is shed
            assert await _is_closed(held[1][0])
        assert [await _is_closed(r, 0.2) for r, _ in held[2:]] == [False] * 3
        assert burst.total["connection_shed"] == 2 and not burst.total["connection_cap"]
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "connection_shed" in lines[0], lines  # no handler error
        for _, writer in held:
            writer.close()


async def test_a_keepalive_connection_waits_from_its_last_answer() -> None:
    """The order of shedding is how long each connection has kept the server waiting: a
    client that reuses its connection (the router's pool) is behind every slow one."""
    async with _server(SHEDDING) as (port, runner, burst):
        slow = [await _open(port, HALF_HEAD)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert (await _ask(reader, writer)).startswith(b"HTTP/1.1 200")
        slow += [await _open(port, HALF_HEAD) for _ in range(2)]
        assert await _open_connections_become(runner, 4) == 4
        assert (await _ask(reader, writer)).startswith(b"HTTP/1.1 200")  # waits anew
        slow += [await _open(port, HALF_HEAD) for _ in range(3)]  # three shed
        assert [await _is_closed(r, 0.5) for r, _ in slow] == [True] * 3 + [False] * 3
        assert (await _ask(reader, writer)).startswith(b"HTTP/1.1 200")
        assert burst.total["connection_shed"] == 3
        for _, w in [*slow, (reader, writer)]:
            w.close()


async def test_busy_connections_are_never_shed_a_new_one_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with _server(SHEDDING) as (port, runner, burst):
        async with ClientSession() as http:
            streams = [asyncio.create_task(_get(port, "/stream")) for _ in range(4)]
            assert await _open_connections_become(runner, 4) == 4
            await asyncio.sleep(0.1)  # every one is in its handler
            with caplog.at_level(logging.WARNING, logger="loraplane.http"):
                extra = [await _open(port, HALF_HEAD) for _ in range(30)]
                assert [await _is_closed(r) for r, _ in extra] == [True] * 30
            assert await asyncio.gather(*streams) == [(200, "x" * 8)] * 4
            async with http.get(f"http://127.0.0.1:{port}/") as resp:
                assert resp.status == 200
        assert burst.total["connection_cap"] == 30 and not burst.total["connection_shed"]
        assert len([r for r in caplog.records if "connection_cap" in r.getMessage()]) == 1
        for _, writer in extra:
            writer.close()


async def test_a_connection_that_sends_nothing_is_closed_by_the_head_deadline(site) -> None:
    port, _, burst = site
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await _is_closed(reader)
    assert burst.total["header_timeout"] == 1
    writer.close()


async def test_the_connection_budget_leaves_descriptors_to_the_rest() -> None:
    assert connection_budget(1024) == 768
    assert connection_budget(512) == 256
    assert connection_budget(200) == 100
    assert connection_budget(1_048_576) == 786_432


_LOW_LIMIT_SERVER = """
import asyncio, resource, sys
from aiohttp import web
from loraplane.kernel.config import HttpLimits
from loraplane.kernel.http_server import bound_port, start_site

async def hello(request):
    return web.Response(text="ok")

async def main():
    limits = HttpLimits(header_timeout_s=60)
    ports = []
    for name in ("a", "b"):
        app = web.Application()
        app.router.add_get("/", hello)
        runner, _ = await start_site(app, "127.0.0.1", 0, limits, name=name)
        ports.append(bound_port(runner))
    print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], *ports, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_a_low_descriptor_limit_is_raised_and_shared_by_the_listeners() -> None:
    """``ulimit -n`` 300 (hard 512): the soft limit is raised to 512, both listeners share
    the 256 connections it leaves; 400 slow ones on the first cannot keep a request out of
    either, and no accept fails for want of a descriptor."""

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 512))

    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _LOW_LIMIT_SERVER,
        preexec_fn=low_limit,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        soft, port_a, port_b = map(
            int, (await asyncio.wait_for(child.stdout.readline(), 30)).split()
        )
        assert soft == 512
        slow = [await _open(port_a, HALF_HEAD) for _ in range(400)]
        for port in (port_a, port_b):
            assert await _get(port) == (200, "ok")
        closed = [await _is_closed(r, 0.01) for r, _ in slow]
        assert 400 - 256 <= closed.count(True) < 400 - 200  # the oldest, shed
        assert closed.index(False) == closed.count(True)  # in the order they came
        for _, writer in slow:
            writer.close()
    finally:
        child.kill()
        _, err = await child.communicate()
    log = err.decode()
    assert "at most 256 connections, not max_connections=16384" in log, log
    assert "accept_error" not in log and "Traceback" not in log, log


async def test_a_long_response_is_not_cut_by_the_deadlines(site) -> None:
    port, _, burst = site
    assert await _get(port, "/stream") == (200, "x" * 8)
    assert not burst.total


async def test_error_burst_logs_a_count_not_a_line_each(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    burst = LogBurst("t", 10, logger=log, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="loraplane.http"):
        logged = [burst.note("accept_error") for _ in range(1000)]
        now[0] = 11
        burst.note("accept_error")
    assert logged.count(True) == 1 and burst.total["accept_error"] == 1001
    assert len(caplog.records) == 2 and "999 more" in caplog.records[-1].getMessage()


async def test_the_dashboard_is_served_within_the_same_bounds(tmp_path) -> None:
    settings = Settings(home=tmp_path, http=LIMITS)
    runner, burst = await start_site(
        Dashboard(settings).app(), "127.0.0.1", 0, settings.http, name="dashboard"
    )
    port = bound_port(runner)
    try:
        status, text = await _get(port, "/api/queries")
        assert status == 200 and text.startswith("[")
        assert (await _get(port, "/static/../../pyproject.toml"))[0] == 404
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\n")
        assert await _closed_within(reader, 2) == b""
        assert burst.total["header_timeout"] == 1
        writer.close()
    finally:
        await runner.cleanup()


async def test_a_client_that_never_reads_its_answer_is_closed_by_the_send_deadline() -> None:
    """A client that asks and then reads nothing held its connection, and the handler
    blocked in its write, for ever: a busy connection is never shed, and the gateway's
    upstream slot and the tenant's place stayed taken with it."""
    wrote: list[int] = []
    ended = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse()
        await out.prepare(request)
        try:
            while True:
                await out.write(b"x" * 65536)
                wrote.append(1)
        finally:
            ended.set()

    app = web.Application()
    app.router.add_get("/endless", endless)
    limits = LIMITS.model_copy(update={"send_timeout_s": 0.3})
    runner, burst = await start_site(app, "127.0.0.1", 0, limits, name="test")
    port = bound_port(runner)
    _, writer = await asyncio.open_connection("127.0.0.1", port, limit=1024)
    try:
        writer.write(b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")  # ... and never reads
        await asyncio.wait_for(ended.wait(), 10)
        assert wrote  # it did write, until the client's buffers were full
        assert burst.total["send_timeout"] == 1
        assert await _open_connections_become(runner, 0) == 0
    finally:
        writer.transport.abort()
        await runner.cleanup()


def answers_past_a_refusal(port: int, request: bytes, rest: bytes) -> tuple[bytes, bytes]:
    """Send ``request`` (a head and the start of its body), read its whole answer, then send
    ``rest`` (more of the body) and read whatever else comes until the connection closes:
    the first answer and the bytes after it (blocking: run it off the server's loop)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = sock.recv(65536)
            assert chunk, got  # closed without an answer
            got += chunk
        head, _, body = got.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
        while len(body) < length:
            chunk = sock.recv(65536)
            assert chunk, got
            body += chunk
        first, after = head + b"\r\n\r\n" + body[:length], body[length:]
        with contextlib.suppress(OSError):  # the server may close before it is all sent
            for at in range(0, len(rest), 16384):
                sock.sendall(rest[at : at + 16384])
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                after += chunk
    return first, after


def assert_one_answer_then_closed(first: bytes, after: bytes, status: bytes) -> None:
    """``first`` is a ``status`` answer that says ``Connection: close``, and no byte of a
    second answer follows it."""
    assert first.split(b" ", 2)[1] == status, first[:300]
    assert b"\r\nconnection: close\r\n" in first.partition(b"\r\n\r\n")[0].lower() + b"\r\n"
    assert after == b"", after[:300]


REST = b"y" * 40_000 + b"\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"z" * 40_000
"""More of a refused body: past the head bound, with a blank line and a whole request in it."""


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_413_for_a_body_read_past_the_cap_is_the_one_answer(site, chunked) -> None:
    """The body past ``client_max_size`` as it is read: its 413 says ``Connection: close`` and
    the rest of the body is never read as a next head (it was: a 431 followed the 413)."""
    port = site[0]
    start = b"x" * 5000
    framing = (
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % 200_000
        if chunked
        else b"Content-Length: %d\r\n\r\n" % 200_000
    )
    request = b"POST / HTTP/1.1\r\nHost: x\r\n" + framing + start
    first, after = await asyncio.to_thread(answers_past_a_refusal, port, request, REST)
    assert_one_answer_then_closed(first, after, b"413")


async def test_the_dashboard_answers_a_body_past_its_cap_once(tmp_path) -> None:
    settings = Settings(home=tmp_path, http=LIMITS)
    runner, _ = await start_site(
        Dashboard(settings).app(), "127.0.0.1", 0, settings.http, name="dashboard"
    )
    try:
        request = (
            b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 90000\r\n\r\n" + b"x" * 3000
        )
        first, after = await asyncio.to_thread(
            answers_past_a_refusal, bound_port(runner), request, REST
        )
        assert_one_answer_then_closed(first, after, b"413")
    finally:
        await runner.cleanup()


async def test_a_handler_that_fails_is_answered_in_the_apps_words_and_tells_nothing() -> None:
    """A handler that raises is the server's 500, worded by the app's ``ERROR_ANSWER``
    (``internal_error``) and naming nothing of the failure (aiohttp's text names its
    class, and with debug on its traceback); the connection closes."""

    async def fails(_: web.Request) -> web.Response:
        raise RuntimeError("secret detail /srv/models/base")

    told: list[tuple[int, str, str]] = []

    def answer(status: int, reason: object, message: str) -> web.StreamResponse:
        told.append((status, str(reason), message))
        return web.json_response({"error": {"type": str(reason)}}, status=status)

    app = web.Application()
    app.router.add_get("/", fails)
    app[ERROR_ANSWER] = answer
    runner, _ = await start_site(app, "127.0.0.1", 0, LIMITS, name="test")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", bound_port(runner))
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        got = await _closed_within(reader, 5)
        writer.close()
    finally:
        await runner.cleanup()
    assert got.startswith(b"HTTP/1.1 500 "), got
    assert b'"internal_error"' in got and b"secret" not in got and b"RuntimeError" not in got
    assert told == [(500, ServerRefusal.internal_error, "the server failed on this request")]


# ---- the framing of the answers given outside the handlers -----------------------------------
async def _fails(_: web.Request) -> web.Response:
    raise RuntimeError("a bug")


async def _times_out(_: web.Request) -> web.Response:
    raise TimeoutError


def _refuse_marked(request: web.Request) -> web.StreamResponse | None:
    if request.headers.get("X-Refuse") is None:
        return None
    return web.json_response({"error": "refused"}, status=401)


def _framed(raw: bytes) -> tuple[bytes, dict[bytes, list[bytes]], bytes]:
    """The status line, the headers (lower-case names) and the body of one answer."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep, raw[:300]
    status, *lines = head.split(b"\r\n")
    headers: dict[bytes, list[bytes]] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        assert colon and name == name.strip(), line
        headers.setdefault(name.lower(), []).append(value.strip())
    return status, headers, body


def _one_answer(port: int, request: bytes) -> bytes:
    """Everything the server writes for ``request`` until it closes (blocking: run it off
    the server's loop); fails when the server keeps the connection open."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        with contextlib.suppress(OSError):  # the server may answer and close mid-send
            sock.sendall(request)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    return got


_V10_FAIL = b"GET /fail HTTP/1.0\r\nHost: x\r\n\r\n"
OUTSIDE_HANDLERS = {
    # a head the parser refuses: no version known, the server's own
    "te-and-cl": (
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1",
        b"400",
    ),
    "two-cl": (
        b"POST / HTTP/1.0\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"HTTP/1.1",
        b"400",
    ),
    "folded": (b"GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", b"HTTP/1.1", b"400"),
    "bare-lf": (b"GET / HTTP/1.1\nHost: x\n\n", b"HTTP/1.1", b"400"),
    "bare-cr": (b"GET / HTTP/1.1\r\nHost: x\rY: z\r\n\r\n", b"HTTP/1.1", b"400"),
    "tls": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", b"HTTP/1.1", b"400"),
    "no-http": (b"HELLO\r\n\r\n", b"HTTP/1.1", b"400"),
    "version": (b"GET / HTTP/7.1\r\nHost: x\r\n\r\n", b"HTTP/1.1", b"400"),
    # a handler that fails, or times out: the request's own version
    "500": (b"GET /fail HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1", b"500"),
    "500-http/1.0": (_V10_FAIL, b"HTTP/1.0", b"500"),
    "500-http/1.0-keep-alive": (
        _V10_FAIL.replace(b"\r\n\r\n", b"\r\nConnection: keep-alive\r\n\r\n"),
        b"HTTP/1.0",
        b"500",
    ),
    "504": (b"GET /timeout HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1", b"504"),
    # answered before the body is read to its end
    "413": (
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 90000\r\n\r\n" + b"x" * 5000,
        b"HTTP/1.1",
        b"413",
    ),
    "413-http/1.0": (
        b"POST / HTTP/1.0\r\nContent-Length: 90000\r\n\r\n" + b"x" * 5000,
        b"HTTP/1.0",
        b"413",
    ),
    "bad-encoding": (
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\nnope",
        b"HTTP/1.1",
        b"400",
    ),
    "bad-encoding-http/1.0": (
        b"POST / HTTP/1.0\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\nnope",
        b"HTTP/1.0",
        b"400",
    ),
    "head-check": (
        b"POST / HTTP/1.1\r\nHost: x\r\nX-Refuse: 1\r\nContent-Length: 50\r\n\r\n",
        b"HTTP/1.1",
        b"401",
    ),
    "head-check-http/1.0": (
        b"POST / HTTP/1.0\r\nX-Refuse: 1\r\nContent-Length: 50\r\n\r\n",
        b"HTTP/1.0",
        b"401",
    ),
    "expectation": (
        b"POST / HTTP/1.1\r\nHost: x\r\nExpect: magic\r\nContent-Length: 5\r\n\r\n",
        b"HTTP/1.1",
        b"417",
    ),
    # the guard's own, for a head past max_header_bytes
    "431": (b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 4000 + b"\r\n\r\n", b"HTTP/1.1", b"431"),
}


@pytest.mark.parametrize("worded", [True, False], ids=["error-answer", "aiohttp-text"])
@pytest.mark.parametrize("case", sorted(OUTSIDE_HANDLERS))
async def test_every_answer_outside_the_handlers_is_framed_and_says_it_closes(
    worded: bool, case: str
) -> None:
    """Each answer the server gives outside its handlers that closes the connection (a head
    the parser refuses, a handler that fails, a body answered before it is read, the guard's
    431) is one whole HTTP/1.x answer: an HTTP/1.1 status line where no request version was
    read (aiohttp wrote a parser's 400 as HTTP/1.0), else the request's; ``Connection:
    close`` in its head whatever the version (an HTTP/1.0 one said nothing); a
    ``Content-Length`` its body matches; then the close, read by a raw socket client."""
    request, version, status = OUTSIDE_HANDLERS[case]
    app = web.Application(client_max_size=4096)
    app.router.add_route("*", "/", _hello, expect_handler=expect_continue)
    app.router.add_get("/fail", _fails)
    app.router.add_get("/timeout", _times_out)
    app[HEAD_CHECK] = _refuse_marked
    if worded:
        app[ERROR_ANSWER] = lambda code, reason, message: web.json_response(
            {"error": {"type": str(reason), "message": message}}, status=code
        )
    runner, _ = await start_site(app, "127.0.0.1", 0, LIMITS, name="test")
    try:
        raw = await asyncio.to_thread(_one_answer, bound_port(runner), request)
    finally:
        await runner.cleanup()
    line, headers, body = _framed(raw)
    assert line.split(b" ", 2)[:2] == [version, status], raw[:300]
    assert [v.lower() for v in headers.get(b"connection", [])] == [b"close"], raw[:300]
    assert headers.get(b"content-length") == [str(len(body)).encode()], raw[:300]
    assert b"transfer-encoding" not in headers, raw[:300]
