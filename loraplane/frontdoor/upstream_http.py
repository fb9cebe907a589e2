"""A lean HTTP/1.1 keep-alive client to one upstream: the gateway's hot path to vLLM.

aiohttp's client spends ~80 µs of CPU per request on this machine (request and response
objects, header merging, cookie/redirect/tracing hooks, a timer per phase), as much as the
whole rest of the gateway; proxying a completion needs none of it: one local host, a POST
with a JSON body, then a status and a body that may stream (chunked SSE). This client sends
each request with one ``write`` and parses the answer with httptools (llhttp, the parser of
uvicorn, which serves vLLM), for a few µs (``bench.gateway_overhead``).

An answer read whole is at most ``max_answer_bytes`` (a ``bad_response`` beyond), and all
of them held at once at most a shared ``AnswerBudget`` (``AnswersFull`` beyond); a streamed
one is passed on under flow control, at most ``_PAUSE_BYTES`` and one socket read held.
Every request asks for ``Accept-Encoding: identity``, and an answer with another
``Content-Encoding`` is a ``bad_response`` at its head: its callers pass bodies on as they
came (the router to its client, the gateway from vLLM), and a relayed body whose encoding
header was dropped is bytes the client cannot read.
Connections are kept alive and reused. A reused connection that the server closed before
answering a single byte (uvicorn drops idle keep-alive connections after 5 s) is retried
once on a fresh connection (headers made anew); any other failure is an ``UpstreamError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import httptools

from loraplane.schemas.reasons import VllmErrorCode

__all__ = [
    "MAX_HEAD_BYTES",
    "AnswerBudget",
    "AnswersFull",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
]

_PATH = re.compile(r"^/[!-~]*$")  # visible ASCII only: no space, CR or LF can be smuggled
_PAUSE_BYTES = 256 * 1024  # a stream buffered beyond this stops reading from the socket
MAX_HEAD_BYTES = 64 * 1024
"""An answer's status line and headers, at most (vLLM's and the gateway's are well under
1 KiB), and the most bytes of an answer that may pass without a byte of its body (chunk
framing, trailers); an upstream sending more is a ``bad_response``: httptools holds a
header's bytes in memory until it ends, and llhttp bounds neither their size nor their
number, nor a chunk's extensions."""


class AnswerBudget:
    """Bytes of answers read whole that may be held at once across every pool that shares
    it: ``max_answer_bytes`` bounds one answer, this bounds them all (a thousand answers in
    flight would otherwise hold a thousand times one). An answer is charged as its bytes
    arrive and refunded when it is closed."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.max_bytes:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class AnswersFull(Exception):
    """An answer read whole did not fit its pool's ``AnswerBudget``: the upstream is not at
    fault (the answers of others fill it), so it is no ``UpstreamError``."""


class UpstreamError(Exception):
    """``reason``: ``timeout``, ``unreachable`` (refused, reset, closed mid-answer) or
    ``bad_response`` (not HTTP/1.1), as the vLLM error codes they become. ``unsent``: no byte
    of the request left (no connection could be made, or no place in flight), so the
    upstream never saw it and sending it elsewhere cannot run it twice."""

    def __init__(self, reason: VllmErrorCode, message: str, *, unsent: bool = False) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.unsent = unsent


class _Stale(Exception):
    """The connection closed before any byte of the answer: safe to send again."""


class UpstreamResponse:
    """One answer: ``status`` and ``headers`` (lower-case names) once the head is in; the
    body is then read whole (``read``/``json``) or streamed (``iter_chunks``), once.
    ``close`` must follow (callers of ``UpstreamPool.request`` use try/finally)."""

    def __init__(self, conn: _Connection, pool: UpstreamPool, deadline: float) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._conn = conn
        self._pool = pool
        self._deadline = deadline  # loop time by which the whole answer must be in
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._charged = 0  # bytes taken from the pool's AnswerBudget, refunded at close
        self._whole = False  # read whole: never pause the socket
        self._head_done = False
        self._done = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    # ---- fed by the connection ----------------------------------------------------------
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, chunk: bytes) -> None:
        if self._done:
            return
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._whole:
            self._check_size()
        elif self._buffered > _PAUSE_BYTES:
            self._conn.pause()
        self._wake()

    def _check_size(self) -> None:
        """A whole answer is held in memory: at most the pool's ``max_answer_bytes``, and
        within its ``AnswerBudget`` with every other answer held (an answer that came in
        whole before it was read too)."""
        if self._error is not None:
            return
        error: Exception | None = None
        budget = self._pool.budget
        if self._buffered > self._pool.max_answer_bytes:
            error = UpstreamError(
                VllmErrorCode.bad_response,
                f"the answer is over {self._pool.max_answer_bytes} bytes",
            )
        elif budget is not None and self._buffered > self._charged:
            if budget.take(self._buffered - self._charged):
                self._charged = self._buffered
            else:
                error = AnswersFull(
                    f"{budget.held} bytes of answers held, at most {budget.max_bytes}"
                )
        if error is not None:
            self._chunks, self._buffered = [], 0
            if self._done:  # all in already (its connection may be back in the pool)
                self._error = error
                return
            self._finish(error)
            self._conn.drop()

    def _finish(self, error: Exception | None = None) -> None:
        if not self._done:
            self._done, self._error = True, error
        self._wake()

    # ---- read by the caller -------------------------------------------------------------
    def _time_out(self, waiter: asyncio.Future[None], total: bool) -> None:
        if not waiter.done():
            waiter.set_exception(
                UpstreamError(
                    VllmErrorCode.timeout,
                    "the answer was not complete by its deadline"
                    if total
                    else f"no answer within {self._pool.read_timeout_s}s",
                )
            )

    async def _wait(self) -> None:
        """Until the connection reports something, at most the read timeout and never past
        the deadline."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        left = self._deadline - loop.time()
        total = left < self._pool.read_timeout_s
        timer = loop.call_later(
            left if total else self._pool.read_timeout_s, self._time_out, waiter, total
        )
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    async def _head(self) -> None:
        while not self._head_done and not self._done:
            await self._wait()
        if not self._head_done:
            raise self._error or UpstreamError(
                VllmErrorCode.unreachable, "closed before the answer"
            )

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (whatever each socket read brought, not lines)."""
        while True:
            if self._chunks:
                chunks, self._chunks, self._buffered = self._chunks, [], 0
                if not self._done:
                    self._conn.resume()
                yield b"".join(chunks) if len(chunks) > 1 else chunks[0]
            elif self._done:
                if self._error is not None:
                    raise self._error
                return
            else:
                await self._wait()

    async def read(self) -> bytes:
        self._whole = True
        self._check_size()
        if not self._done:
            self._conn.resume()
        while not self._done:
            await self._wait()
        if self._error is not None:
            raise self._error
        chunks, self._chunks = self._chunks, []
        return b"".join(chunks)

    async def text(self) -> str:
        return (await self.read()).decode("utf-8", "replace")

    async def json(self) -> Any:
        return json.loads(await self.read())

    def close(self) -> None:
        """Ends the request: the connection goes back to the pool when the answer came in
        whole (it is there already), else it is dropped."""
        if self._closed:
            return
        self._closed = True
        self._chunks, self._buffered = [], 0
        if self._charged and self._pool.budget is not None:
            self._pool.budget.give(self._charged)
            self._charged = 0
        self._pool._slots.release()
        if not self._done or self._error is not None:
            self._conn.drop()


class _Connection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._response: UpstreamResponse | None = None
        self._got_bytes = False
        self._bare_bytes = 0  # of the current answer since its last head or body byte
        self._progress = 0  # the head's end and each piece of body, counted
        self._paused = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it
        self._transport = transport

    @property
    def usable(self) -> bool:
        """Open as far as this side can tell. The loop may close a transport (the peer
        reset it) a callback before ``connection_lost`` says so; uvloop's ``write`` then
        raises RuntimeError, so the transport's own state is asked too."""
        return not self.closed and self._transport is not None and not self._transport.is_closing()

    def send(self, request: bytes, deadline: float) -> UpstreamResponse:
        """Write ``request``; raises ``_Stale`` (nothing sent) when the connection turns out
        closed."""
        transport = self._transport
        if transport is None or not self.usable:
            self.drop()
            raise _Stale()
        try:
            transport.write(request)
        except RuntimeError:  # uvloop: the handle closed before connection_lost ran
            self.drop()
            raise _Stale() from None
        self._response = UpstreamResponse(self, self._pool, deadline)
        self._got_bytes = False
        self._bare_bytes = 0
        return self._response

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        response = self._response
        if response is None:  # nothing was asked: not an answer (it would be parsed unbounded)
            self.drop()
            return
        progress = self._progress
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self._response is not None:
                self._response._finish(
                    UpstreamError(VllmErrorCode.bad_response, f"{type(exc).__name__}: {exc}")
                )
            self.drop()
            return
        # Bytes that bring neither the head's end nor body (a head still coming, chunk
        # extensions, trailers) are bounded: httptools holds a header until it ends.
        self._bare_bytes = 0 if self._progress != progress else self._bare_bytes + len(data)
        if self._bare_bytes > MAX_HEAD_BYTES and not response._done:
            response._finish(
                UpstreamError(
                    VllmErrorCode.bad_response,
                    f"the answer's head is over {MAX_HEAD_BYTES} bytes"
                    if not response._head_done
                    else f"over {MAX_HEAD_BYTES} bytes of the answer brought no body "
                    "(chunk framing or trailers)",
                )
            )
            self.drop()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response, self._response = self._response, None
        if response is None:
            return
        if not self._got_bytes:
            response._finish(_Stale())
        elif (
            response._head_done
            and "content-length" not in response.headers
            and "chunked" not in response.headers.get("transfer-encoding", "")
        ):
            response._finish()  # a body that ends with the connection
        else:
            response._finish(
                UpstreamError(
                    VllmErrorCode.unreachable,
                    "connection closed mid-answer" + (f" ({exc})" if exc else ""),
                )
            )

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        """A header of the head; a trailer (after the head) is read past, never kept."""
        if self._response is not None and not self._response._head_done:
            self._response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        response = self._response
        if response is None:
            return
        status = self._parser.get_status_code()
        if not 200 <= status <= 599:  # an interim (1xx), upgrade or unknown status
            self._response = None
            response._finish(
                UpstreamError(VllmErrorCode.bad_response, f"status {status} is no final answer")
            )
            self.drop()
            return
        encoding = response.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):  # asked for none: no relay could decode it
            self._response = None
            response._finish(
                UpstreamError(
                    VllmErrorCode.bad_response,
                    f"an encoded answer (Content-Encoding: {encoding[:32]}) to a request "
                    "that accepts none",
                )
            )
            self.drop()
            return
        response.status = status
        response._head_done = True
        self._progress += 1
        response._wake()

    def on_body(self, body: bytes) -> None:
        self._progress += 1
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        response, self._response = self._response, None
        if response is None:
            return
        keep = self._parser.should_keep_alive() and not self._pool.closed
        response._finish()
        if keep:
            self.resume()  # a whole answer may have come in the read that paused it
            self._pool._idle.append(self)
        else:
            self.drop()

    # flow control and teardown
    def pause(self) -> None:
        if not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self._transport is not None and not self.closed:
            self._paused = False
            self._transport.resume_reading()

    def drop(self) -> None:
        self.closed = True
        if self._transport is not None:
            with contextlib.suppress(RuntimeError):  # uvloop: its handle is closed already
                self._transport.close()


class UpstreamPool:
    """Keep-alive connections to ``host:port``, at most ``limit`` requests in flight.
    Bound to the event loop it is first used in."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        limit: int = 64,
        max_answer_bytes: int = 64 * 1024 * 1024,
        headers: dict[str, str] | None = None,
        budget: AnswerBudget | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.max_answer_bytes = max_answer_bytes  # read whole (not streamed), at most
        self.budget = budget  # of every answer read whole at once, shared with other pools
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        fixed = {"Host": f"{host}:{port}", "Accept-Encoding": "identity", **(headers or {})}
        if any(c in part for k, v in fixed.items() for part in (k, v) for c in "\r\n"):
            raise ValueError("header names and values must be one line")
        # Sent with every request (Host, and e.g. vLLM's Authorization); built once.
        self._host_header = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self._idle: list[_Connection] = []
        self.closed = False  # a connection in flight is then dropped at its answer's end
        self._limit = limit
        self._slots = asyncio.Semaphore(limit)

    async def request(
        self,
        method: str,
        path: str,
        body: bytes,
        *,
        total_timeout_s: float,
        headers: bytes | Callable[[], bytes] = b"",
    ) -> UpstreamResponse:
        """Send ``body`` (JSON) and wait for the answer's head; the caller closes it. Every
        wait, for one of the ``limit`` places in flight and for the answer, head and body,
        ends by ``total_timeout_s`` from now: with every place held by slow answers, a
        request fails at its own deadline, not at theirs.
        ``headers``: extra header lines, each ending in CRLF (the caller's own values, which
        must hold no CR or LF), or a callable that makes them, called for each send: the
        first, and the one resend on a fresh connection when a reused one closed before the
        answer (the upstream may have taken the first), so a header that must never repeat
        (a router's forward signature, which a gateway takes once) is made anew."""
        if not _PATH.fullmatch(path):
            raise ValueError(f"not a request path: {path!r}")
        line = f"{method} {path} HTTP/1.1\r\n".encode("latin-1")
        tail = b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)

        def framed() -> bytes:
            extra = headers() if callable(headers) else headers
            return b"".join((line, self._host_header, extra, tail, body))

        request = framed()
        deadline = asyncio.get_running_loop().time() + total_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        except TimeoutError:
            raise UpstreamError(
                VllmErrorCode.timeout,
                f"no place in flight to {self.host}:{self.port} within {total_timeout_s}s "
                f"({self._limit} requests in flight)",
                unsent=True,
            ) from None
        try:
            conn, reused = await self._connection(fresh=False)
            while True:
                try:
                    response = conn.send(request, deadline)
                    await response._head()
                    return response
                except _Stale:
                    if not reused:
                        raise UpstreamError(
                            VllmErrorCode.unreachable, "closed before the answer"
                        ) from None
                except BaseException:
                    conn.drop()
                    raise
                conn, reused = await self._connection(fresh=True)  # it was closed while idle
                if callable(headers):
                    request = framed()  # signed anew: the upstream may have taken the first
        except BaseException:
            self._slots.release()
            raise

    async def _connection(self, *, fresh: bool) -> tuple[_Connection, bool]:
        while self._idle and not fresh:
            conn = self._idle.pop()
            if conn.usable:
                return conn, True
            conn.drop()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), self.host, self.port),
                self.connect_timeout_s,
            )
        except TimeoutError:
            raise UpstreamError(
                VllmErrorCode.timeout,
                f"connect to {self.host}:{self.port} took longer than {self.connect_timeout_s}s",
                unsent=True,
            ) from None
        except OSError as exc:
            raise UpstreamError(
                VllmErrorCode.unreachable, f"{self.host}:{self.port}: {exc}", unsent=True
            ) from None
        return conn, False

    def close(self) -> None:
        """Drop the idle connections now and each in flight when its answer ends."""
        self.closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.drop()
