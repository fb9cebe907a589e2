"""The slow-connection attack of the HTTP-bounds tests, shared by the in-process gateway and
dashboard runs (test_http_bounds.py) and the worker process as it runs (test_worker_e2e.py).

``attack(port, path)`` holds ``SLOW`` sockets that send nothing, half a request head, or a
head with a body that never comes; asserts a real GET of ``path`` is answered meanwhile and
every slow one is closed by its deadline; then opens ``max_connections + SLOW`` more (over
the cap: the ones waiting longest are shed) and asserts they are all closed and the server
still answers. The server must run
with ``LIMITS`` (``limits_env`` gives them as LORAPLANE_HTTP__* variables for a process).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import ClientSession

SLOW = 500
LIMITS = {
    "header_timeout_s": 2.0,
    "body_timeout_s": 2.0,
    "keepalive_timeout_s": 3.0,
    "max_connections": 800,
    "error_log_interval_s": 60,
}
PARTS = (
    b"",
    b"GET / HTTP/1.1\r\nHost: x\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9999\r\n\r\n{",
)
Conns = list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]


def limits_env() -> dict[str, str]:
    return {f"LORAPLANE_HTTP__{k.upper()}": str(v) for k, v in LIMITS.items()}


async def _open_slow(port: int, n: int) -> Conns:
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


async def _all_closed(conns: Conns, within_s: float) -> float:
    started = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(_closed(r) for r, _ in conns)), within_s)
    for _, writer in conns:
        writer.close()
    return time.monotonic() - started


async def attack(port: int, real_request: str) -> None:
    conns = await _open_slow(port, SLOW)
    async with ClientSession() as http, http.get(f"http://127.0.0.1:{port}{real_request}") as resp:
        assert resp.status == 200  # answered while 500 slow ones are held
    took = await _all_closed(conns, 10)
    assert took < 5, f"slow connections held {took:.1f}s"
    # over the cap: the oldest are shed as new ones come, the rest closed by their deadline
    conns = await _open_slow(port, int(LIMITS["max_connections"]) + SLOW)
    await _all_closed(conns, 10)
    async with ClientSession() as http, http.get(f"http://127.0.0.1:{port}{real_request}") as resp:
        assert resp.status == 200
