"""ATTACK tests of the bounded HTTP listener (loraplane.kernel.http_server) on loopback.

Before it, every server ran aiohttp's or http.server's defaults: no deadline on a request
head or body (a slowloris held a connection forever), no connection cap (20,000 half-open
connections hit EMFILE) and one log line per failed accept.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from aiohttp import ClientSession, web
from loraplane.dashboards.web import Dashboard

from loraplane.kernel.config import HttpLimits, Settings
from loraplane.kernel.http_server import ErrorBurst, bound_port, open_connections, start_site

pytestmark = pytest.mark.asyncio(loop_scope="session")
LIMITS = HttpLimits(header_timeout_s=0.3, body_timeout_s=0.3, keepalive_timeout_s=0.5,
                    max_connections=20, max_header_bytes=2048, error_log_interval_s=60)


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
async def site() -> AsyncIterator[tuple[int, web.AppRunner, ErrorBurst]]:
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


async def test_connections_over_the_cap_are_closed_and_counted_not_logged_each(
        site, caplog: pytest.LogCaptureFixture) -> None:
    port, runner, burst = site
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(LIMITS.max_connections)]
    assert await _open_connections_become(runner, LIMITS.max_connections) == \
        LIMITS.max_connections
    with caplog.at_level(logging.WARNING, logger="loraplane.http"):
        extra = [await asyncio.open_connection("127.0.0.1", port) for _ in range(30)]
        for reader, _ in extra:
            assert await _closed_within(reader, 2) == b""
    assert burst.total["connection_cap"] == 30
    assert len([r for r in caplog.records if "connection_cap" in r.getMessage()]) == 1
    for reader, writer in held:  # every held one dies by its head deadline
        assert await _closed_within(reader, 2) == b""
        writer.close()
    for _, writer in extra:
        writer.close()
    assert await _open_connections_become(runner, 0) == 0
    assert await _get(port) == (200, "ok 0")


async def test_a_long_response_is_not_cut_by_the_deadlines(site) -> None:
    port, _, burst = site
    assert await _get(port, "/stream") == (200, "x" * 8)
    assert not burst.total


async def test_error_burst_logs_a_count_not_a_line_each(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    burst = ErrorBurst("t", 10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="loraplane.http"):
        logged = [burst.note("accept_error") for _ in range(1000)]
        now[0] = 11
        burst.note("accept_error")
    assert logged.count(True) == 1 and burst.total["accept_error"] == 1001
    assert len(caplog.records) == 2 and "999 more" in caplog.records[-1].getMessage()


async def test_the_dashboard_is_served_within_the_same_bounds(tmp_path) -> None:
    settings = Settings(home=tmp_path, http=LIMITS)
    runner, burst = await start_site(Dashboard(settings).app(), "127.0.0.1", 0, settings.http,
                                     name="dashboard")
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
