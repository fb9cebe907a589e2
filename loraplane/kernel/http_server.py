"""The one way loraplane listens for HTTP: an aiohttp app behind connection bounds.

Every server the project runs (the router, the gateway, the worker's /metrics listener, the
dashboard) starts through ``start_site`` with the shared ``settings.http`` limits
(``HttpLimits``): deadlines on a request's head and body (slowloris), on an answer the
client stops reading (its write stalls: the handler would wait for ever, holding what it
holds), a bound on a head's size (431), and at most ``max_connections`` per server within
the process's descriptor budget (``connection_budget``). At a cap a new connection is not
refused: the one that has kept the server waiting longest is shed instead. Legitimate
clients send their request at once, so slow or idle ones go first, however many an
attacker opens from the same address. Connection errors are logged through
``kernel.log_burst.LogBurst``. An app's ``ANSWER_HEADERS`` go on every answer its server
gives (its own, aiohttp's, the guard's 431); its ``ERROR_ANSWER`` words the answers the
server gives outside its handlers.

The timers and the order of waiting live in a thin protocol around aiohttp's
``RequestHandler`` (``_Guard``), which makes the handler only once a first head is whole; a
middleware tells it when a request's body was read and its answer written. The limits, the
shedding and why: docs/worker.md, "Bounded HTTP servers".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

from aiohttp import HttpVersion11, hdrs, web
from aiohttp.web_protocol import ERROR, RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest

from loraplane.kernel import collector
from loraplane.kernel.config import HttpLimits
from loraplane.kernel.log_burst import LogBurst
from loraplane.schemas.reasons import AdmissionRefusal, RequestRefusal, ServerRefusal

__all__ = [
    "ANSWER_HEADERS",
    "ERROR_ANSWER",
    "HEAD_CHECK",
    "ErrorAnswer",
    "HeadCheck",
    "Listener",
    "bound_port",
    "connection_budget",
    "expect_continue",
    "metrics_app",
    "open_connections",
    "raise_fd_limit",
    "run_serving",
    "start_site",
    "start_sites",
]

log = logging.getLogger("loraplane.http")
_HEAD_END = b"\r\n\r\n"
_BACKLOG = 4096  # the kernel's accept queue (capped by net.core.somaxconn): absorbs bursts
_FD_RESERVE = 256  # descriptors left to everything but listeners (Kafka, pools, files)
_GC_OLDEST_AFTER = 1000  # middle-generation collections between full ones (CPython: 10)
HeadCheck = Callable[[web.Request], web.StreamResponse | None]
HEAD_CHECK: web.AppKey[HeadCheck] = web.AppKey("loraplane_head_check")
"""An app's refusal of a request on its head alone, or None. The server reads a request's
body before its handler runs (so a connection counts as waiting until its body is in); an
app whose handlers refuse some requests before their body (no API key, a Content-Length over
the cap) sets this, and such a request is answered without its body being read or waited
for."""
ANSWER_HEADERS: web.AppKey[Mapping[str, str]] = web.AppKey("loraplane_answer_headers")
"""Headers an app's server puts on every answer it gives (a security policy): its handlers'
answers and the refusals, and the ones no handler writes, aiohttp's 400 for a head it cannot
parse and the 431 for a head past ``max_header_bytes``. Read once, by ``start_site``."""
ErrorAnswer = Callable[[int, StrEnum, str], web.StreamResponse]
ERROR_ANSWER: web.AppKey[ErrorAnswer] = web.AppKey("loraplane_error_answer")
"""How an app words the answers its server gives outside its handlers, from a status, a
reason (``schemas.reasons``) and a message: no route for the path (404
``unknown_route``) or for the method (405 ``method_not_allowed``, with ``Allow``), an
``Expect`` but 100-continue (417 ``bad_expectation``), a body past ``client_max_size`` as
it is read (413 ``body_too_large``) or whose ``Content-Encoding`` does not decode (400
``invalid_json``), a head the parser refuses (400 ``malformed_request``), a handler that
failed (500 ``internal_error``). The front door's apps answer them in their own error shape;
without it, aiohttp's text. The head past ``max_header_bytes`` stays the guard's bare 431.
Read once, by ``start_site``."""
_ROUTING = {
    web.HTTPNotFound.status_code: ServerRefusal.unknown_route,
    web.HTTPMethodNotAllowed.status_code: ServerRefusal.method_not_allowed,
}


_UNPARSED = ERROR._replace(version=HttpVersion11)
"""The request aiohttp's handler answers a head that does not parse for, in the server's own
version: aiohttp's ``ERROR`` says HTTP/1.0, so its answer would be an HTTP/1.0 one without
``Connection: close`` to a client whose version was never read."""


def _closing(response: web.StreamResponse) -> web.StreamResponse:
    """``response`` closes its connection and says so: ``Connection: close`` in its head
    whatever the request's version (aiohttp writes it only for HTTP/1.1, so an HTTP/1.0
    client was not told), the one framing of every answer the server closes after."""
    response.force_close()
    response.headers[hdrs.CONNECTION] = "close"
    return response


def _too_large(headers: Mapping[str, str]) -> bytes:
    """The 431 the guard writes itself, for a head past ``max_header_bytes``."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (
        "HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
        f"Connection: close\r\n{extra}\r\n"
    ).encode("latin-1")


class _BurstFilter(logging.Filter):
    """aiohttp's server logger through an LogBurst (its message is the kind)."""

    def __init__(self, burst: LogBurst) -> None:
        super().__init__()
        self.burst = burst

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False  # aiohttp's debug lines (bad requests, disconnects) are not kept
        return self.burst.note(str(record.msg).replace(" from %s", "")[:80])


class _Table:
    """The connections the listeners of this process hold, within the descriptor budget.

    A connection is *waiting* while the server waits on its client (no complete request yet,
    a body still coming, or idle between keep-alive requests) and *busy* from the moment its
    request is read until its answer is written. ``waiting`` is in the order the waits began,
    so its first is the connection that has kept the server waiting longest."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.open = 0
        self.waiting: OrderedDict[_Guard, None] = OrderedDict()


class _State:
    """One listener: its limits, its cap, its connections."""

    def __init__(
        self,
        limits: HttpLimits,
        burst: LogBurst,
        table: _Table,
        answer_headers: Mapping[str, str],
        error_answer: ErrorAnswer | None = None,
    ) -> None:
        self.limits = limits
        self.answer_headers = answer_headers
        self.error_answer = error_answer
        self.too_large = _too_large(answer_headers)
        self.burst = burst
        self.table = table
        self.cap = min(limits.max_connections, table.budget)
        self.open = 0
        self.guards: dict[asyncio.BaseTransport, _Guard] = {}
        self.waiting: OrderedDict[_Guard, None] = OrderedDict()

    def make_room(self) -> bool:
        """Room for one more connection: at the cap (this listener's, or the process's
        descriptor budget), the connection waiting longest is shed. False when every held
        connection is busy."""
        if self.open >= self.cap:
            waiting = self.waiting
        elif self.table.open >= self.table.budget:
            waiting = self.table.waiting
        else:
            return True
        if not waiting:
            return False
        next(iter(waiting)).shed()
        return True


class _Guard(asyncio.Protocol):
    """Deadlines, caps and shedding around one aiohttp RequestHandler, which is made when the
    connection's first request head is whole: until then a connection costs this object, its
    bytes and one timer, not aiohttp's handler, task and timers (the collector scans every
    object of every held connection, so thousands of slow ones would lengthen its pauses)."""

    def __init__(self, make_inner: Callable[[], asyncio.Protocol], state: _State) -> None:
        self._make_inner = make_inner
        self._inner: asyncio.Protocol | None = None
        self._state = state
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None  # armed while writing is paused
        self._held = False  # counted in the caps (from accepted to lost or shed)
        self._pending = bytearray()  # a first head, until it is whole
        self._in_head = True
        self._head_bytes = 0
        self._tail = b""
        self._closing = False  # an answer said Connection: close: nothing more is parsed

    # ---- asyncio.Protocol -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it
        state = self._state
        if not state.make_room():
            state.burst.note("connection_cap", f"{state.cap} open, all busy")
            transport.abort()
            return
        self._held = True
        state.open += 1
        state.table.open += 1
        state.guards[transport] = self
        self._wait()
        self._transport = transport
        self._arm(state.limits.header_timeout_s, "header_timeout")

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if not self._held or transport is None or transport.is_closing() or self._closing:
            return
        if self._in_head:
            window = self._tail + data
            end, mark = _head_end(window)
            self._head_bytes += len(data) if end < 0 else end + mark - len(self._tail)
            if self._head_bytes > self._state.limits.max_header_bytes:
                self._state.burst.note("header_too_large")
                self._cancel()
                transport.write(self._state.too_large)
                transport.close()
                return
            if end < 0:
                self._tail = window[-(len(_HEAD_END) - 1) :]
                if self._inner is None:  # held here until the head is whole
                    self._pending += data
                    return
            else:
                self._in_head, self._tail = False, b""
                self._arm(self._state.limits.body_timeout_s, "body_timeout")
        if self._inner is None:
            self._inner = self._make_inner()
            self._inner.connection_made(transport)
            if self._pending:
                data, self._pending = bytes(self._pending) + data, bytearray()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._inner is None:
            return None  # nothing was asked: close
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        """The client is not taking the answer as fast as it is written: unless it takes
        some within ``send_timeout_s``, the connection is dropped (its handler's write
        then fails instead of waiting for ever, and what the handler holds is freed)."""
        if self._held and self._send_timer is None:
            loop = asyncio.get_running_loop()
            self._send_timer = loop.call_later(self._state.limits.send_timeout_s, self._expire_send)
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._cancel_send()
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        if self._inner is not None:
            self._inner.connection_lost(exc)

    # ---- told by the middleware -------------------------------------------------------
    def body_read(self) -> None:
        """Busy: the request is in; its answer is being made."""
        self._cancel()
        self._state.waiting.pop(self, None)
        self._state.table.waiting.pop(self, None)

    def response_done(self, *, closing: bool) -> None:
        """The next request's head is due within keep-alive + header timeout; or, after an
        answer that closes the connection (``closing``: its body unread, or ``Connection:
        close``), no byte that follows is read as a head (the rest of a refused body would
        be: a second, unasked answer such as a 431 before the close)."""
        if not self._held:
            return
        limits = self._state.limits
        self._wait()  # sheddable until it is closed
        if closing:
            self._closing = True
            self._arm(limits.header_timeout_s, "header_timeout")
            return
        self._in_head, self._head_bytes, self._tail = True, 0, b""
        self._arm(limits.keepalive_timeout_s + limits.header_timeout_s, "header_timeout")

    # ---- shedding ---------------------------------------------------------------------
    def _wait(self) -> None:
        self._state.waiting[self] = None
        self._state.table.waiting[self] = None

    def shed(self) -> None:
        """Closed to make room for a new connection: it kept the server waiting longest."""
        self._state.burst.note("connection_shed", "at the cap, the longest waiting")
        self.drop()

    def drop(self) -> None:
        transport = self._transport
        self._release()
        if transport is not None:
            transport.abort()

    def _release(self) -> None:
        if not self._held:
            return
        self._held = False
        self._cancel()
        self._cancel_send()
        state = self._state
        state.open -= 1
        state.table.open -= 1
        state.waiting.pop(self, None)
        state.table.waiting.pop(self, None)
        if self._transport is not None:
            state.guards.pop(self._transport, None)

    # ---- timers -----------------------------------------------------------------------
    def _arm(self, delay_s: float, kind: str) -> None:
        self._cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(delay_s, self._expire, kind)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cancel_send(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _expire_send(self) -> None:
        self._send_timer = None
        self._expire("send_timeout")

    def _expire(self, kind: str) -> None:
        self._timer = None
        if self._transport is not None and not self._transport.is_closing():
            self._state.burst.note(kind)
            self.drop()


def _head_end(window: bytes) -> tuple[int, int]:
    """Where a head ends in ``window`` and its end's length, or (-1, 0): a blank line,
    CRLF CRLF or a bare LF's LF LF. aiohttp's parser refuses a bare-LF head with a 400, so
    it must get the head to answer it, not wait here for a CRLF CRLF that never comes."""
    ends = [(i, len(m)) for m in (_HEAD_END, b"\n\n") if (i := window.find(m)) >= 0]
    return min(ends) if ends else (-1, 0)


def raise_fd_limit() -> int:
    """Raise this process's soft descriptor limit to its hard one; the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # e.g. a sandbox that forbids it
            log.warning("the descriptor limit stays at %d (hard %d): %s", soft, hard, exc)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_budget(soft_limit: int) -> int:
    """Connections all the listeners of a process may hold: its descriptor limit less what
    everything else it opens may need (a quarter, at least ``_FD_RESERVE`` but at most
    half)."""
    return max(1, soft_limit - max(soft_limit // 4, min(_FD_RESERVE, soft_limit // 2)))


def _collect_the_oldest_rarely() -> None:
    """A full collection scans every object of every held connection: with thousands of
    slow ones held and reopened, CPython's default (a full collection after ten young ones,
    once a quarter of the old objects are new) ran one or two a second, each stalling the
    loop for hundreds of milliseconds. The young generations keep CPython's thresholds; the
    oldest is collected about a hundred times less often (cyclic garbage that reached it
    waits longer)."""
    collector.collect_the_oldest_after(_GC_OLDEST_AFTER)


_tables: dict[asyncio.AbstractEventLoop, _Table] = {}


def _table() -> _Table:
    """The process's connection table (one per event loop: tests run several loops)."""
    loop = asyncio.get_running_loop()
    table = _tables.get(loop)
    if table is None:
        for old in [old for old in _tables if old.is_closed()]:
            del _tables[old]
        table = _tables[loop] = _Table(connection_budget(raise_fd_limit()))
        _collect_the_oldest_rarely()
    return table


def _middleware(state: _State) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def bounded(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        transport = request.transport
        guard = state.guards.get(transport) if transport is not None else None
        response: web.StreamResponse | None = None
        try:
            refused = _head_refusal(request)
            if refused is not None:
                response = await _answer_unread(
                    request, refused, guard, state.limits.max_body_bytes
                )
                return response
            if request.can_read_body:
                try:
                    await request.read()  # cached: the handler's own read() returns it
                except ConnectionResetError:  # the body deadline closed it (or the peer did)
                    return web.Response(status=408)
                except RuntimeError:  # aiohttp's "Connection closed.": shed mid-body
                    if transport is not None and not transport.is_closing():
                        raise
                    return web.Response(status=408)
                except RequestPayloadError:  # a Content-Encoding that does not decode
                    broken = _error(
                        state.error_answer,
                        400,
                        AdmissionRefusal.invalid_json,
                        "the body could not be read: its encoding is broken",
                    )
                    response = await _answer_early(request, broken, unread=True)
                    return response
                except web.HTTPRequestEntityTooLarge as exc:  # past client_max_size, as read
                    over = _error(
                        state.error_answer,
                        exc.status,
                        RequestRefusal.body_too_large,
                        exc.text or "",
                    )
                    response = await _answer_early(request, over, unread=True)
                    return response
            if guard is not None:
                guard.body_read()
            try:
                response = await handler(request)
            except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:  # no route for it
                if state.error_answer is None:
                    raise
                response = _error(
                    state.error_answer, exc.status, _ROUTING[exc.status], _routing(request, exc)
                )
                if allow := exc.headers.get("Allow"):
                    response.headers["Allow"] = allow
            if guard is not None and not response.prepared:
                # Written here, not after the middleware returns, so the connection counts
                # as busy (never shed) until its answer is out. aiohttp's own prepare and
                # write_eof that follow find it sent.
                with contextlib.suppress(ConnectionError):
                    await response.prepare(request)
                    await response.write_eof()
            return response
        finally:
            closing = _closes(request, response)
            if closing:
                request.protocol.force_close()
            if guard is not None:
                guard.response_done(closing=closing)

    return bounded


def _error(
    answer: ErrorAnswer | None, status: int, reason: StrEnum, message: str
) -> web.StreamResponse:
    """An answer the server gives outside the app's handlers, in the app's own words
    (``ERROR_ANSWER``), else as text."""
    if answer is not None:
        return answer(status, reason, message)
    return web.Response(status=status, text=message)


def _routing(request: web.Request, exc: web.HTTPException) -> str:
    """What a client is told of a path or method no route serves (never the path sent)."""
    if exc.status == web.HTTPMethodNotAllowed.status_code:
        allowed = ", ".join(sorted(exc.headers.get("Allow", "").split(",")))
        return f"this route takes {allowed or 'no method'}, not {request.method[:16]}"
    return "no such route here: this server serves only the routes of its API"


def _expects_continue(request: web.Request) -> bool:
    return request.headers.get("Expect", "").lower() == "100-continue"


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The ``expect_handler`` of a route under a head check: aiohttp answers ``Expect:
    100-continue`` before any middleware runs, which would invite the body of a request the
    head check then refuses. A head the check refuses gets no ``100 Continue`` (the
    middleware answers its refusal and closes, the body never asked for); any other is
    answered as aiohttp does (``100 Continue``, or 417 for another expectation)."""
    if request.version != HttpVersion11:
        return None
    if not _expects_continue(request):
        message = "unknown Expect: " + request.headers["Expect"][:64]
        answer = request.app.get(ERROR_ANSWER)
        # its body is never asked for: nothing after it is parsed
        return _closing(
            _error(
                answer,
                web.HTTPExpectationFailed.status_code,
                ServerRefusal.bad_expectation,
                message,
            )
        )
    if _head_refusal(request) is not None:
        return None
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim answer is no part of the response's body
    return None


_HEAD_VERDICT: web.RequestKey[web.StreamResponse | None] = web.RequestKey("loraplane_head")


def _head_refusal(request: web.Request) -> web.StreamResponse | None:
    """The app's head check of ``request``, run once (the expect handler and the middleware
    both ask; a check may count what it refuses)."""
    if _HEAD_VERDICT not in request:
        check = request.app.get(HEAD_CHECK)
        request[_HEAD_VERDICT] = check(request) if check is not None else None
    return request[_HEAD_VERDICT]


def _closes(request: web.Request, response: web.StreamResponse | None) -> bool:
    """Whether the connection closes after ``response``: the one place that decides it.
    It does when some of the request's body was never read (the rest would be parsed as a
    next request's head, and answered), or when the answer sent says ``Connection: close``
    (``_answer_early``, or a client that asked for it)."""
    said_close = response is not None and response.prepared and not response.keep_alive
    return said_close or not request.content.is_eof()


async def _answer_early(
    request: web.Request, response: web.StreamResponse, *, unread: bool
) -> web.StreamResponse:
    """Write ``response`` before the request's body was read to its end. ``unread``: the
    body will not be read to its end (it does not decode, it is past ``client_max_size``,
    or it is still to come), so the answer says ``Connection: close`` and the connection
    closes after it (``_closes``)."""
    if unread:
        _closing(response)
    with contextlib.suppress(ConnectionError):
        await response.prepare(request)
        await response.write_eof()
    return response


async def _answer_unread(
    request: web.Request, response: web.StreamResponse, guard: _Guard | None, cap: int
) -> web.StreamResponse:
    """Write a head check's refusal before any of the body is read. The rest of a body
    within ``cap`` is then read and dropped, never held, under the body deadline (the
    connection still waits on its client, so it may be shed), and the client reads its
    answer rather than a reset; a body past ``cap``, declared or sent, or one held back
    for a ``100 Continue`` that never came (``expect_continue``), closes the connection
    instead of being waited for. An answer given before its body is in says ``Connection:
    close``, and the connection closes after it: nothing that follows is parsed."""
    await _answer_early(request, response, unread=not request.content.is_eof())
    declared = request.content_length
    if (declared is None or declared <= cap) and not _expects_continue(request):
        dropped = 0
        # closed (the deadline, the peer) or undecodable: dropped either way
        with contextlib.suppress(ConnectionError, RuntimeError, RequestPayloadError):
            while dropped <= cap and (chunk := await request.content.readany()):
                dropped += len(chunk)
    if guard is not None:
        guard.body_read()
    return response


class _Handler(RequestHandler):
    """aiohttp's handler of one connection, whose own error answers (a head it cannot parse,
    a failure outside the app) carry the listener's ``ANSWER_HEADERS`` and are worded by its
    ``ERROR_ANSWER``: no app hook sees them (aiohttp writes them before any route is
    matched). Each closes the connection and says so (``_closing``); the answer to a head
    that did not parse is HTTP/1.1 (``_UNPARSED``)."""

    __slots__ = ("_answer_headers", "_error_answer")

    def __init__(
        self,
        manager: web.Server,
        answer_headers: Mapping[str, str],
        error_answer: ErrorAnswer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._answer_headers = answer_headers
        self._error_answer = error_answer
        self._request_factory = _unparsed_as_http11(manager.request_factory)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        response = super().handle_error(request, status, exc, message)  # logged, closing
        if self._error_answer is not None:
            if status >= 500:  # a bug of ours: nothing of it is the client's to read
                reason, told = ServerRefusal.internal_error, "the server failed on this request"
            else:  # the parser's reason, never the bytes it quotes
                reason = ServerRefusal.malformed_request
                told = "the request could not be parsed: " + _first_line(message or "")
            response = self._error_answer(status, reason, told)
        _closing(response)
        response.headers.update(self._answer_headers)
        return response


def _unparsed_as_http11(
    make: Callable[..., BaseRequest],
) -> Callable[..., BaseRequest]:
    """A connection's request factory that makes the request of a head that did not parse
    (aiohttp's ``ERROR`` message) as ``_UNPARSED``; every other as it is."""

    def request(message: Any, *rest: Any) -> BaseRequest:
        return make(_UNPARSED if message is ERROR else message, *rest)

    return request


def _first_line(message: str) -> str:
    """The parser's reason without the request bytes it quotes after it."""
    return message.split("\n", 1)[0].split(":", 1)[0][:120]


class _BoundedSite(web.TCPSite):
    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        state: _State,
        handler_args: Mapping[str, Any],
    ) -> None:
        super().__init__(runner, host, port, backlog=min(_BACKLOG, state.cap))
        self._state = state
        self._handler_args = handler_args  # the runner's server makes its handlers with them

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        state, args = self._state, self._handler_args

        def handler() -> asyncio.Protocol:
            return _Handler(server, state.answer_headers, state.error_answer, loop=loop, **args)

        self._server = await loop.create_server(
            lambda: _Guard(handler, state),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await super().stop()
        for guard in list(self._state.guards.values()):
            if guard._inner is None:  # aiohttp's shutdown closes the ones it handles
                guard.drop()


def _throttle_loop_errors(loop: asyncio.AbstractEventLoop, burst: LogBurst) -> None:
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


async def start_site(
    app: web.Application, host: str, port: int, limits: HttpLimits, *, name: str
) -> tuple[web.AppRunner, LogBurst]:
    """Serve ``app`` on ``host:port`` (0: any free port, see ``bound_port``) within
    ``limits``. The caller ends it with ``runner.cleanup()``."""
    burst = LogBurst(name, limits.error_log_interval_s, logger=log)
    given: Mapping[str, str] | None = app.get(ANSWER_HEADERS)
    answer_headers = dict(given) if given is not None else {}
    state = _State(limits, burst, _table(), answer_headers, app.get(ERROR_ANSWER))
    if state.cap < limits.max_connections:
        log.warning(
            "%s: at most %d connections, not max_connections=%d: the descriptor "
            "limit (ulimit -n) allows %d to all listeners; raise it",
            name,
            state.cap,
            limits.max_connections,
            state.table.budget,
        )
    app.middlewares.insert(0, _middleware(state))
    if answer_headers:

        async def add_headers(_: web.Request, response: web.StreamResponse) -> None:
            response.headers.update(answer_headers)

        app.on_response_prepare.append(add_headers)
    server_log = logging.getLogger(f"loraplane.http.{name}")
    server_log.addFilter(_BurstFilter(burst))
    line = min(8190, limits.max_header_bytes)
    handler_args: dict[str, Any] = {
        "access_log": None,
        "keepalive_timeout": limits.keepalive_timeout_s,
        "max_line_size": line,
        "max_field_size": line,
        "max_headers": limits.max_headers,
        "logger": server_log,
    }
    runner = web.AppRunner(app, handle_signals=False, **handler_args)
    await runner.setup()
    try:
        await _BoundedSite(runner, host, port, state, handler_args).start()
    except BaseException:
        await runner.cleanup()
        raise
    _throttle_loop_errors(asyncio.get_running_loop(), burst)
    return runner, burst


@dataclass(frozen=True)
class Listener:
    """One of a process's listeners: its app, its port and the option that gave the port."""

    app: web.Application
    port: int
    name: str
    option: str  # "--gateway-port": what the operator changes when the port is taken


async def start_sites(
    listeners: Sequence[Listener], host: str, limits: HttpLimits, *, process: str
) -> list[web.AppRunner]:
    """A serving process's listeners (``process``: "worker W", "router R"), started in
    order, all or none: when one cannot bind (a port taken), the ones already started are
    cleaned up (their ports free again) and the start ends with one line (``SystemExit``:
    exit 1) naming the port, the option that gave it and the system's reason."""
    runners: list[web.AppRunner] = []
    try:
        for each in listeners:
            try:
                runner, _ = await start_site(each.app, host, each.port, limits, name=each.name)
            except OSError as exc:
                reason = os.strerror(exc.errno) if exc.errno else str(exc)
                raise SystemExit(
                    f"{process}: cannot listen on {host}:{each.port} ({each.option}): {reason}"
                ) from None
            runners.append(runner)
    except BaseException:
        for runner in reversed(runners):
            await runner.cleanup()
        raise
    return runners


def metrics_app(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> web.Application:
    """A listener's app that answers ``GET /metrics`` with ``handler`` and nothing else (no
    request body): a runtime's ``--metrics-port``, a port apart from the one its clients
    use, which a network policy can keep to the scraper (the router's API port and a
    worker's gateway port answer ``/metrics`` 404)."""
    app = web.Application(client_max_size=1024)
    app.router.add_get("/metrics", handler)
    return app


def bound_port(runner: web.AppRunner) -> int:
    address = runner.addresses[0]
    return int(address[1])


def open_connections(runner: web.AppRunner) -> int:
    """Connections the guard holds open now (for tests and metrics)."""
    for site in runner.sites:
        if isinstance(site, _BoundedSite):
            return site._state.open
    return 0


def run_serving(main: Coroutine[Any, Any, None]) -> None:
    """Run a serving process's loop (the router's, a worker's) on uvloop: the default
    asyncio loop's own Python (timers, handles, selector, accepts) takes a sixth of the
    router's CPU per request (bench/router_overhead.py) and accepts slow-client floods
    several times slower (bench/slow_clients.py)."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)
