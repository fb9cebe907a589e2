"""The one way loraplane listens for HTTP: an aiohttp app behind connection bounds.

Every server the project runs (the gateway, the worker's /metrics listener, the dashboard)
starts through ``start_site`` with the shared ``settings.http`` limits (``HttpLimits``):

* a request head (request line + headers) must be complete within ``header_timeout_s`` of
  the connection opening, or of the previous response ending plus ``keepalive_timeout_s``,
  and be at most ``max_header_bytes`` (else the connection is closed: 431 is written first);
* a request body must be complete within ``body_timeout_s`` of its head (slowloris);
* an idle keep-alive connection is closed after ``keepalive_timeout_s`` (aiohttp's own);
* at most ``max_connections`` are open; a connection over the cap is closed at once, so
  file descriptors are never exhausted by one peer;
* errors of connections (caps, deadlines, oversized heads, accept failures such as EMFILE,
  aiohttp's parse and handler errors) are logged through ``ErrorBurst``: the first of a kind
  in an interval is logged, the rest of the interval only as a count.

The timers live in a thin protocol around aiohttp's ``RequestHandler`` (``_Guard``); a
middleware tells it when a request's head was dispatched and its body read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiohttp import web

from loraplane.kernel.config import HttpLimits

log = logging.getLogger("loraplane.http")
_HEAD_END = b"\r\n\r\n"
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
              b"Connection: close\r\n\r\n")


class ErrorBurst:
    """Rate-limited error log: per kind, one line when a kind first shows in an interval,
    then one line with the count of the rest when the next interval opens."""

    def __init__(self, name: str, interval_s: float, *, logger: logging.Logger = log,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.interval_s = interval_s
        self.logger = logger
        self.clock = clock
        self.total: Counter[str] = Counter()  # every note, for tests and metrics
        self._pending: Counter[str] = Counter()
        self._since: dict[str, float] = {}

    def note(self, kind: str, detail: str = "") -> bool:
        """Count one error; True when this one was logged."""
        self.total[kind] += 1
        now = self.clock()
        since = self._since.get(kind)
        if since is not None and now - since < self.interval_s:
            self._pending[kind] += 1
            return False
        self._since[kind] = now
        more = self._pending.pop(kind, 0)
        self.logger.warning("%s: %s%s%s", self.name, kind, f" ({detail})" if detail else "",
                            f"; {more} more in the last {now - since:.0f}s" if more and since
                            is not None else "")
        return True

    def flush(self) -> None:
        for kind, more in sorted(self._pending.items()):
            self.logger.warning("%s: %d more %s", self.name, more, kind)
        self._pending.clear()


class _BurstFilter(logging.Filter):
    """aiohttp's server logger through an ErrorBurst (its message is the kind)."""

    def __init__(self, burst: ErrorBurst) -> None:
        super().__init__()
        self.burst = burst

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False  # aiohttp's debug lines (bad requests, disconnects) are not kept
        return self.burst.note(str(record.msg).replace(" from %s", "")[:80])


class _State:
    def __init__(self, limits: HttpLimits, burst: ErrorBurst) -> None:
        self.limits = limits
        self.burst = burst
        self.open = 0
        self.guards: dict[asyncio.BaseTransport, _Guard] = {}


class _Guard(asyncio.Protocol):
    """Deadlines and caps around one aiohttp RequestHandler."""

    def __init__(self, inner: asyncio.Protocol, state: _State) -> None:
        self._inner = inner
        self._state = state
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_head = True
        self._head_bytes = 0
        self._tail = b""
        self._refused = False

    # ---- asyncio.Protocol -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it
        state = self._state
        if state.open >= state.limits.max_connections:
            self._refused = True
            state.burst.note("connection_cap", f"{state.limits.max_connections} open")
            transport.abort()
            return
        state.open += 1
        state.guards[transport] = self
        self._transport = transport
        self._inner.connection_made(transport)
        self._arm(state.limits.header_timeout_s, "header_timeout")

    def data_received(self, data: bytes) -> None:
        if self._refused or self._transport is None or self._transport.is_closing():
            return
        if self._in_head:
            window = self._tail + data
            end = window.find(_HEAD_END)
            self._head_bytes += (len(data) if end < 0 else end + len(_HEAD_END) - len(self._tail))
            if self._head_bytes > self._state.limits.max_header_bytes:
                self._state.burst.note("header_too_large")
                self._cancel()
                self._transport.write(_TOO_LARGE)
                self._transport.close()
                return
            if end < 0:
                self._tail = window[-(len(_HEAD_END) - 1):]
            else:
                self._in_head, self._tail = False, b""
                self._arm(self._state.limits.body_timeout_s, "body_timeout")
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._refused:
            return None
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        if not self._refused:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._cancel()
        self._state.open -= 1
        if self._transport is not None:
            self._state.guards.pop(self._transport, None)
        self._inner.connection_lost(exc)

    # ---- told by the middleware -------------------------------------------------------
    def body_read(self) -> None:
        self._cancel()

    def response_done(self) -> None:
        """The next request's head is due within keep-alive + header timeout."""
        self._in_head, self._head_bytes, self._tail = True, 0, b""
        limits = self._state.limits
        self._arm(limits.keepalive_timeout_s + limits.header_timeout_s, "header_timeout")

    # ---- timers -----------------------------------------------------------------------
    def _arm(self, delay_s: float, kind: str) -> None:
        self._cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(delay_s, self._expire, kind)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, kind: str) -> None:
        self._timer = None
        if self._transport is not None and not self._transport.is_closing():
            self._state.burst.note(kind)
            self._transport.abort()


def _middleware(state: _State) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def bounded(request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        transport = request.transport
        guard = state.guards.get(transport) if transport is not None else None
        try:
            if request.can_read_body:
                try:
                    await request.read()  # cached: the handler's own read() returns it
                except ConnectionResetError:  # the body deadline closed it (or the peer did)
                    return web.Response(status=408)
            if guard is not None:
                guard.body_read()
            return await handler(request)
        finally:
            if guard is not None:
                guard.response_done()

    return bounded


class _BoundedSite(web.TCPSite):
    def __init__(self, runner: web.AppRunner, host: str, port: int, state: _State) -> None:
        super().__init__(runner, host, port, backlog=min(1024, state.limits.max_connections))
        self._state = state

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        state = self._state
        self._server = await loop.create_server(
            lambda: _Guard(server(), state), self._host, self._port,
            backlog=self._backlog, reuse_address=self._reuse_address)
        self._bound_port = self._server.sockets[0].getsockname()[1]


def _throttle_loop_errors(loop: asyncio.AbstractEventLoop, burst: ErrorBurst) -> None:
    """asyncio logs every failed accept (EMFILE: one line a second per listener, each with a
    traceback); count them instead."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if message.startswith("socket.accept() out of system resource"):
            burst.note("accept_error", str(context.get("exception", ""))[:80])
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


async def start_site(app: web.Application, host: str, port: int, limits: HttpLimits, *,
                     name: str) -> tuple[web.AppRunner, ErrorBurst]:
    """Serve ``app`` on ``host:port`` (0: any free port, see ``bound_port``) within
    ``limits``. The caller ends it with ``runner.cleanup()``."""
    burst = ErrorBurst(name, limits.error_log_interval_s)
    state = _State(limits, burst)
    app.middlewares.insert(0, _middleware(state))
    server_log = logging.getLogger(f"loraplane.http.{name}")
    server_log.addFilter(_BurstFilter(burst))
    line = min(8190, limits.max_header_bytes)
    runner = web.AppRunner(app, access_log=None, handle_signals=False,
                           keepalive_timeout=limits.keepalive_timeout_s,
                           max_line_size=line, max_field_size=line,
                           max_headers=limits.max_headers, logger=server_log)
    await runner.setup()
    await _BoundedSite(runner, host, port, state).start()
    _throttle_loop_errors(asyncio.get_running_loop(), burst)
    return runner, burst


def bound_port(runner: web.AppRunner) -> int:
    address = runner.addresses[0]
    return int(address[1])


def open_connections(runner: web.AppRunner) -> int:
    """Connections the guard holds open now (for tests and metrics)."""
    for site in runner.sites:
        if isinstance(site, _BoundedSite):
            return site._state.open
    return 0
