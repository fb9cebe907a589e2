"""ATTACK on loopback: many slow and half-open connections against the servers loraplane runs.

The dashboard runs as its own process (``loraplane dashboard``, the real CLI, log captured);
the gateway app runs in-process on the same bounded site the worker uses
(``loraplane.kernel.http_server.start_site`` with ``settings.http``). Each gets 500 sockets
that send nothing, half a request head, or a head with a body that never comes. Shown: every
one is closed by its deadline, a real request is answered meanwhile, connections over the cap
are closed at once, and the log stays a few lines (counts, not a line per connection).
Bounded: 500-1,300 sockets, a few seconds. Needs no Kafka, ClickHouse or S3.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from aiohttp import ClientSession, web
from loraplane.workers.api_keys import ApiKeys
from loraplane.workers.gateway import Gateway

from loraplane.kernel.config import HttpLimits, get_settings
from loraplane.kernel.http_server import bound_port, open_connections, start_site
from loraplane.kernel.policy import RequestBudgets

SLOW = 500
LIMITS = {"header_timeout_s": 2.0, "body_timeout_s": 2.0, "keepalive_timeout_s": 3.0,
          "max_connections": 800, "error_log_interval_s": 60}
PARTS = (b"", b"GET / HTTP/1.1\r\nHost: x\r\n",
         b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9999\r\n\r\n{")


async def _open_slow(port: int, n: int) -> list[tuple[asyncio.StreamReader,
                                                      asyncio.StreamWriter]]:
    conns = []
    for i in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(PARTS[i % len(PARTS)])
        conns.append((reader, writer))
    return conns


async def _closed(reader: asyncio.StreamReader) -> None:
    """Until the server closes it (a FIN or a reset, as abort sends)."""
    with contextlib.suppress(ConnectionResetError):
        await reader.read()


async def _all_closed(conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
                      within_s: float) -> float:
    started = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(_closed(r) for r, _ in conns)), within_s)
    for _, writer in conns:
        writer.close()
    return time.monotonic() - started


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _attack(port: int, real_request: str) -> None:
    conns = await _open_slow(port, SLOW)
    async with ClientSession() as http, \
            http.get(f"http://127.0.0.1:{port}{real_request}") as resp:
        assert resp.status == 200  # answered while 500 slow ones are held
    took = await _all_closed(conns, 10)
    assert took < 5, f"slow connections held {took:.1f}s"
    # over the cap: the extra ones are closed at once, the held ones by their deadline
    conns = await _open_slow(port, LIMITS["max_connections"] + SLOW)
    await _all_closed(conns, 10)
    async with ClientSession() as http, \
            http.get(f"http://127.0.0.1:{port}{real_request}") as resp:
        assert resp.status == 200


def test_the_dashboard_process_sheds_slow_connections_and_logs_little(tmp_path: Path) -> None:
    port = _free_port()
    log = tmp_path / "dashboard.log"
    env = {**os.environ, "LORAPLANE_HOME": str(tmp_path),
           "LORAPLANE_SECRETS_DIR": str(get_settings().secrets_dir),
           **{f"LORAPLANE_HTTP__{k.upper()}": str(v) for k, v in LIMITS.items()}}
    with log.open("wb") as out:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "loraplane"), "dashboard", "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as resp:
                    assert resp.status == 200
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        asyncio.run(_attack(port, "/api/queries"))
        assert server.poll() is None  # still up
    finally:
        server.terminate()
        server.wait(10)
    text = log.read_text()
    assert len(text) < 4096, text[-2000:]  # ~1,800 closed connections: a few lines
    assert "Traceback" not in text, text


class _NoAdapters:
    """A worker with nothing on it: enough for /healthz and the gateway's own refusals."""

    started = True

    def metrics_exposition(self) -> bytes:
        return b"# nothing\n"


@pytest.mark.asyncio
async def test_the_gateway_site_sheds_slow_connections(caplog: pytest.LogCaptureFixture) -> None:
    gateway = Gateway(_NoAdapters(), api_keys=ApiKeys({}), budgets=RequestBudgets(),  # type: ignore[arg-type]
                      sink=None)  # type: ignore[arg-type]
    limits = HttpLimits(**LIMITS)
    runner, burst = await start_site(gateway.app(), "127.0.0.1", 0, limits, name="gateway")
    try:
        with caplog.at_level("WARNING"):
            await _attack(bound_port(runner), "/healthz")
        assert open_connections(runner) == 0
        assert burst.total["connection_cap"] > 0
        assert burst.total["header_timeout"] + burst.total["body_timeout"] >= SLOW
        assert len(caplog.records) < 10, [r.getMessage() for r in caplog.records]
    finally:
        await runner.cleanup()
    assert isinstance(runner, web.AppRunner)
