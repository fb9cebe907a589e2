"""The lean upstream client of the gateway (frontdoor/upstream_http.py) against scripted raw
HTTP servers: keep-alive reuse, streaming, a stale keep-alive connection, every failure as
an UpstreamError with its reason, flow control, and no slot leaked by a failure."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.frontdoor.upstream_http import UpstreamError, UpstreamPool, _Connection
from loraplane.schemas.reasons import VllmErrorCode

session_loop = pytest.mark.asyncio(loop_scope="session")
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head + Content-Length body), b"" when the client went away."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await reader.readexactly(length)


def answer(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n".encode() + extra + b"\r\n" + body


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[UpstreamPool, list[int]]]:
    """A raw server calling ``handler(reader, writer, n)`` for its n-th connection; yields a
    pool to it and the list of connection numbers seen."""
    seen: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(len(seen))
        try:
            await handler(reader, writer, seen[-1])
        except ConnectionError:
            pass  # the client dropped a connection it gave up on
        finally:
            writer.close()

    srv = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    pool = UpstreamPool("127.0.0.1", port, connect_timeout_s=1, read_timeout_s=0.5, limit=1)
    try:
        yield pool, seen
    finally:
        pool.close()
        srv.close()


async def echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
    while request := await read_request(reader):
        writer.write(answer(request.rpartition(b"\r\n\r\n")[2]))
        await writer.drain()


async def fetch(pool: UpstreamPool, body: bytes, total_s: float = 5) -> tuple[int, bytes]:
    resp = await pool.request("POST", "/v1/completions", body, total_timeout_s=total_s)
    try:
        return resp.status, await resp.read()
    finally:
        resp.close()


@session_loop
async def test_keep_alive_connection_is_reused() -> None:
    async with server(echo_forever) as (pool, seen):
        for i in range(5):
            assert await fetch(pool, b'{"n": %d}' % i) == (200, b'{"n": %d}' % i)
        assert seen == [0]


@session_loop
async def test_stream_chunks_arrive_before_the_answer_ends() -> None:
    more = asyncio.Event()

    async def sse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\n")
        await writer.drain()
        await more.wait()
        writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        await writer.drain()
        await read_request(reader)

    async with server(sse) as (pool, _):
        resp = await pool.request("POST", "/v1/chat/completions", b"{}", total_timeout_s=5)
        chunks = resp.iter_chunks()
        assert await anext(chunks) == b"data: a\n\n"  # while the server still holds the rest
        more.set()
        assert [c async for c in chunks] == [b"data: [DONE]\n\n"]
        resp.close()


@session_loop
async def test_a_keep_alive_connection_closed_while_idle_is_retried_once() -> None:
    async def close_second(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        if n > 0:
            return await echo_forever(reader, writer, n)
        await read_request(reader)
        writer.write(answer(b"first", extra=b"Connection: keep-alive\r\n"))
        await read_request(reader)  # the next request arrives as the server drops the socket

    async with server(close_second) as (pool, seen):
        assert await fetch(pool, b"1") == (200, b"first")
        assert await fetch(pool, b"2") == (200, b"2")
        assert seen == [0, 1]


@session_loop
async def test_a_resend_on_a_fresh_connection_makes_its_headers_anew() -> None:
    """A caller's headers given as a maker are made for each send: the resend after a kept
    connection closed under a request (the server may have taken it) carries its own, so a
    header that must never repeat (a forward's signature) does not; bytes are sent as
    they are, each time."""
    got: list[bytes] = []

    async def take_then_drop(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        while request := await read_request(reader):
            got.append(request)
            if n == 0 and len(got) == 2:
                return  # taken, and closed with no answer
            writer.write(answer(b"ok"))
            await writer.drain()

    made = itertools.count()

    def signed() -> bytes:
        return b"X-Sig: %d\r\n" % next(made)

    async with server(take_then_drop) as (pool, seen):
        for _ in range(2):
            resp = await pool.request(
                "POST", "/v1/completions", b"{}", total_timeout_s=5, headers=signed
            )
            assert (resp.status, await resp.read()) == (200, b"ok")
            resp.close()
        assert seen == [0, 1]
        assert [r.split(b"X-Sig: ")[1][:1] for r in got] == [b"0", b"1", b"2"]
        got.clear()
        for _ in range(2):  # bytes: the same each send
            resp = await pool.request(
                "POST", "/v1/completions", b"{}", total_timeout_s=5, headers=b"X-Sig: b\r\n"
            )
            resp.close()
        assert [r.count(b"X-Sig: b\r\n") for r in got] == [1, 1]


class _ClosedHandle:
    """A transport the loop closed a callback before ``connection_lost`` ran: uvloop's
    ``write`` (and ``close``) then raise RuntimeError; ``is_closing`` may say either."""

    def __init__(self, real: asyncio.Transport, says_closing: bool) -> None:
        self.real, self.says_closing = real, says_closing

    def is_closing(self) -> bool:
        return self.says_closing

    def write(self, data: bytes) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport>; the handler is closed")

    def close(self) -> None:
        self.real.close()
        raise RuntimeError("the handler is closed")


@pytest.mark.parametrize("says_closing", [False, True])
@session_loop
async def test_a_kept_connection_whose_transport_closed_unannounced_is_replaced(
    says_closing: bool,
) -> None:
    async with server(echo_forever) as (pool, seen):
        assert await fetch(pool, b"1") == (200, b"1")
        (idle,) = pool._idle
        assert idle._transport is not None
        idle._transport = cast(asyncio.Transport, _ClosedHandle(idle._transport, says_closing))
        assert await asyncio.wait_for(fetch(pool, b"2"), 3) == (200, b"2")  # no RuntimeError
        assert seen == [0, 1] and idle.closed
        assert await asyncio.wait_for(fetch(pool, b"3"), 3) == (200, b"3")  # no slot leaked


@session_loop
async def test_failures_have_reasons_and_leak_no_slot() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n > 4:
            return await echo_forever(reader, writer, n)
        await read_request(reader)
        if n == 0:
            return  # fresh connection closed without an answer
        if n == 1:
            await asyncio.sleep(2)  # no answer within the read timeout
        elif n == 2:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten..")
        elif n == 3:
            writer.write(b"SMTP ready\r\n\r\n")
        elif n == 4:  # a chunk every 0.1 s, never ending: the total deadline stops it
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                writer.write(b"1\r\nx\r\n")
                await writer.drain()
                await asyncio.sleep(0.1)
        await writer.drain()
        await asyncio.sleep(0.1)

    async with server(script) as (pool, _):  # limit=1: a leaked slot would hang the next
        for reason, total_s in (
            ("unreachable", 5),
            ("timeout", 5),
            ("unreachable", 5),
            ("bad_response", 5),
            ("timeout", 0.8),
        ):
            with pytest.raises(UpstreamError) as err:
                await asyncio.wait_for(fetch(pool, b"x", total_s), 3)
            assert err.value.reason == reason, err.value
            assert not err.value.unsent  # the server had the request: it may have run it
        assert await asyncio.wait_for(fetch(pool, b"ok"), 3) == (200, b"ok")


@session_loop
async def test_a_request_waiting_for_a_place_in_flight_ends_at_its_own_deadline() -> None:
    """ATTACK: every place in flight held by an answer that drips for a long time. A request
    queued behind it waited for that answer's deadline, then failed at once; it now fails
    at its own, as a timeout, and leaks no place."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n > 0:
            return await echo_forever(reader, writer, n)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:  # a chunk every 0.1 s until the client gives up
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)

    async with server(script) as (pool, _):  # limit=1
        holder = asyncio.ensure_future(fetch(pool, b"slow", total_s=30))
        await asyncio.sleep(0.3)  # it holds the one place
        with pytest.raises(UpstreamError) as err:
            await asyncio.wait_for(fetch(pool, b"queued", total_s=0.3), 5)
        assert err.value.reason == "timeout" and "in flight" in str(err.value), err.value
        assert err.value.unsent
        holder.cancel()
        with contextlib.suppress(asyncio.CancelledError, UpstreamError):
            await holder
        assert await asyncio.wait_for(fetch(pool, b"ok"), 3) == (200, b"ok")


@session_loop
async def test_refused_and_bad_paths() -> None:
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    pool = UpstreamPool("127.0.0.1", port, connect_timeout_s=1, read_timeout_s=1)
    with pytest.raises(UpstreamError) as err:
        await fetch(pool, b"{}")
    assert err.value.reason == "unreachable"
    assert err.value.unsent  # refused: no byte left, so sending it elsewhere runs it once
    for path in ("v1/x", "/v1 x", "/v1\r\nHost: evil", ""):
        with pytest.raises(ValueError):
            await pool.request("POST", path, b"{}", total_timeout_s=1)


@session_loop
async def test_large_answers_stream_and_read_whole_under_flow_control() -> None:
    big = bytes(range(256)) * 4096  # 1 MiB, four times the pause threshold

    async def send_big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader):
            writer.write(answer(big))
            await writer.drain()

    async with server(send_big) as (pool, seen):
        resp = await pool.request("POST", "/v1/completions", b"{}", total_timeout_s=5)
        streamed = []
        async for chunk in resp.iter_chunks():
            streamed.append(chunk)
            await asyncio.sleep(0)  # a slow reader: the socket is paused and resumed
        resp.close()
        assert b"".join(streamed) == big
        assert await fetch(pool, b"{}") == (200, big)
        assert seen == [0]


@session_loop
async def test_a_body_ended_by_close_is_whole() -> None:
    async def close_delimited(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
    ) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        await writer.drain()

    async with server(close_delimited) as (pool, _):
        assert await fetch(pool, b"{}") == (200, b"until the end")


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.sent = b""

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.sent += data

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def close(self) -> None: ...


@settings(max_examples=60, deadline=None)
@given(
    body=st.binary(max_size=3000),
    cuts=st.lists(st.integers(0, 4000), max_size=8),
    chunked=st.booleans(),
)
def test_any_split_of_an_answer_reads_the_same_body(
    body: bytes, cuts: list[int], chunked: bool
) -> None:
    if chunked:
        pieces = [body[i : i + 700] for i in range(0, len(body), 700)]
        raw = (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
            + b"0\r\n\r\n"
        )
    else:
        raw = answer(body)
    bounds = sorted({0, len(raw), *(c for c in cuts if c < len(raw))})

    async def run() -> bytes:
        pool = UpstreamPool("127.0.0.1", 1, connect_timeout_s=1, read_timeout_s=1)
        conn = _Connection(pool)
        conn.connection_made(_Transport())
        await pool._slots.acquire()
        resp = conn.send(b"request", asyncio.get_running_loop().time() + 5)
        for start, end in itertools.pairwise(bounds):
            conn.data_received(raw[start:end])
        try:
            assert resp.status == 200 and pool._idle == [conn]  # kept alive
            return await resp.read()
        finally:
            resp.close()

    assert asyncio.run(run()) == body


@session_loop
async def test_an_answer_read_whole_is_bounded() -> None:
    big = b"x" * (3 * 1024 * 1024)

    async def send_big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader):
            writer.write(answer(big))
            await writer.drain()

    async with server(send_big) as (pool, _):
        pool.max_answer_bytes = 1024 * 1024  # ATTACK: an upstream that never stops answering
        with pytest.raises(UpstreamError) as err:
            await fetch(pool, b"{}")
        assert err.value.reason == VllmErrorCode.bad_response
        pool.max_answer_bytes = len(big)
        assert await fetch(pool, b"{}") == (200, big)  # a fresh connection; the slot was freed


@session_loop
async def test_an_answers_head_is_bounded() -> None:
    """ATTACK: an upstream (a gateway URL a forged worker state announces) that sends header
    after header. Each was kept in the answer's dict until the head's read timeout, as fast
    as the socket brought them: memory without a bound. A head over ``MAX_HEAD_BYTES`` is a
    ``bad_response``, and the connection is dropped."""
    from loraplane.frontdoor.upstream_http import MAX_HEAD_BYTES

    async def endless_head(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        if n > 0:
            return await echo_forever(reader, writer, n)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in itertools.count():
            writer.write(b"".join(b"X-H%d: %s\r\n" % (i * 100 + j, b"v" * 64) for j in range(100)))
            await writer.drain()

    async with server(endless_head) as (pool, _):
        with pytest.raises(UpstreamError) as err:
            await asyncio.wait_for(fetch(pool, b"x"), 3)
        assert err.value.reason == VllmErrorCode.bad_response
        assert str(MAX_HEAD_BYTES) in err.value.message
        assert await asyncio.wait_for(fetch(pool, b"ok"), 3) == (200, b"ok")


_BARE = {
    "many trailers": lambda i: b"X-T%d: %s\r\n" % (i, b"v" * 200),
    "one endless trailer": lambda i: b"v" * 4096 if i else b"X-T: ",
    "endless chunk extensions": lambda i: b"a" * 4096 if i else b"2;ext=",
}


@session_loop
@pytest.mark.parametrize("kind", list(_BARE))
async def test_attack_an_answers_bytes_without_body_are_bounded(kind: str) -> None:
    """ATTACK: an upstream (a gateway URL a forged worker state announces) that ends a
    chunked body's last chunk and then sends trailer after trailer, one trailer that never
    ends, or a chunk's extension that never ends. Trailers were kept in the answer's dict
    (and a header's bytes in httptools) as fast as the socket brought them, up to the
    answer's deadline: 300 s of memory growth per request. Past ``MAX_HEAD_BYTES`` with no
    body byte it is a ``bad_response``, the connection dropped and the slot freed."""
    from loraplane.frontdoor.upstream_http import MAX_HEAD_BYTES

    piece = _BARE[kind]
    sent = [0]

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        if n > 0:
            return await echo_forever(reader, writer, n)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n")
        if kind != "endless chunk extensions":
            writer.write(b"0\r\n")
        for i in itertools.count():
            writer.write(b"".join(piece(i * 16 + j) for j in range(16)))
            sent[0] += 1
            await writer.drain()
            if sent[0] > 10_000:  # 40 MiB and more: the client took it all (then cut short)
                return

    async with server(endless) as (pool, _):
        with pytest.raises(UpstreamError) as err:
            await asyncio.wait_for(fetch(pool, b"x"), 10)
        assert err.value.reason == VllmErrorCode.bad_response
        assert str(MAX_HEAD_BYTES) in err.value.message
        assert await asyncio.wait_for(fetch(pool, b"ok"), 3) == (200, b"ok")


@session_loop
async def test_a_few_trailers_end_an_answer_and_are_not_its_headers() -> None:
    async def trailers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        while await read_request(reader):
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
                b"Content-Type: text/event-stream\r\nX-T: 1\r\n\r\n"
            )
            await writer.drain()

    async with server(trailers) as (pool, seen):
        for _ in range(2):
            resp = await pool.request("POST", "/v1/completions", b"x", total_timeout_s=3)
            try:
                assert (resp.status, await resp.read()) == (200, b"{}")
                assert resp.headers["content-type"] == "application/json"
                assert "x-t" not in resp.headers
            finally:
                resp.close()
        assert seen == [0]  # kept alive


@session_loop
async def test_attack_bytes_sent_on_an_idle_connection_drop_it() -> None:
    """ATTACK: an upstream that, between answers, sends a head that never ends on the
    kept-alive connection. With no request in flight the bytes went to the parser
    unbounded (httptools holds the header until it ends); the connection is dropped at
    the first byte and the next request gets a fresh one."""

    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(answer(b"{}"))
        if n == 0:
            writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
            for _ in range(1000):
                writer.write(b"v" * 65536)
                await writer.drain()
        else:
            await echo_forever(reader, writer, n)

    async with server(chatty) as (pool, seen):
        assert await fetch(pool, b"x") == (200, b"{}")
        await asyncio.sleep(0.2)
        assert all(not c.usable for c in pool._idle)
        assert await asyncio.wait_for(fetch(pool, b"ok"), 3) == (200, b"{}")
        assert seen == [0, 1]


@session_loop
async def test_a_closed_pool_keeps_no_connection_of_an_answer_in_flight() -> None:
    """A pool closed while a request is in flight (its gateway left the router's view)
    drops that connection when the answer ends, not keeps it idle in a pool no one uses."""
    released, gone = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        await released.wait()
        writer.write(answer(b"{}"))
        await writer.drain()
        if not await reader.read(1):
            gone.set()

    async with server(slow) as (pool, _):
        asking = asyncio.create_task(fetch(pool, b"x"))
        await asyncio.sleep(0.1)
        pool.close()
        released.set()
        assert await asking == (200, b"{}")
        await asyncio.wait_for(gone.wait(), 3)
        assert pool._idle == []


@session_loop
@pytest.mark.parametrize("encoding", [b"gzip", b"br", b"deflate, gzip", b"GZIP ", b"x" * 100])
async def test_attack_an_encoded_answer_is_a_bad_response(encoding: bytes) -> None:
    """ATTACK: an upstream (a gateway URL a forged worker state announces) answering with a
    ``Content-Encoding`` nothing asked for. The router dropped the header and relayed the
    compressed body: bytes its client could not read. It is a ``bad_response`` at its head
    (the router parks that gateway and tries another); ``identity`` is no encoding."""
    body = gzip.compress(b'{"ok": true}', mtime=0)
    asked: list[bytes] = []

    async def encoded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        while request := await read_request(reader):
            asked.append(request)
            extra = b"Content-Encoding: " + (encoding if n == 0 else b"identity") + b"\r\n"
            writer.write(answer(body if n == 0 else b"ok", extra=extra))
            await writer.drain()

    async with server(encoded) as (pool, seen):
        with pytest.raises(UpstreamError) as err:
            await asyncio.wait_for(fetch(pool, b"x"), 3)
        assert err.value.reason == VllmErrorCode.bad_response
        assert "Content-Encoding" in err.value.message
        assert await asyncio.wait_for(fetch(pool, b"ok"), 3) == (200, b"ok")
        assert seen == [0, 1]  # the connection of the encoded answer was dropped
    assert all(b"\r\nAccept-Encoding: identity\r\n" in request for request in asked)


@session_loop
async def test_answers_read_whole_share_one_budget() -> None:
    """Pools that share an ``AnswerBudget`` hold at most its bytes of answers read whole at
    once: one past it is ``AnswersFull`` (the upstream is not at fault: no UpstreamError),
    its connection dropped; closing an answer gives its bytes back, failed or not."""
    from loraplane.frontdoor.upstream_http import AnswerBudget, AnswersFull

    big = b"x" * 300_000

    async def answer_big(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
    ) -> None:
        while await read_request(reader):
            writer.write(answer(big))
            await writer.drain()

    budget = AnswerBudget(500_000)
    async with server(answer_big) as (one, _), server(answer_big) as (two, _):
        one.budget = two.budget = budget
        first = await one.request("POST", "/v1/completions", b"x", total_timeout_s=3)
        assert await first.read() == big and budget.held == len(big)
        second = await two.request("POST", "/v1/completions", b"x", total_timeout_s=3)
        with pytest.raises(AnswersFull):
            await second.read()
        assert not isinstance(AnswersFull(""), UpstreamError)
        second.close()
        assert budget.held == len(big)
        first.close()
        assert budget.held == 0
        assert await asyncio.wait_for(fetch(two, b"x"), 3) == (200, big)
        assert budget.held == 0


@session_loop
async def test_a_stream_its_reader_does_not_take_holds_one_window() -> None:
    """A streamed answer whose reader takes nothing (its client stalls) holds at most
    ``_PAUSE_BYTES`` plus one socket read, however much the upstream has to send: streams
    in flight hold at most their number times that (the router's answers read whole are
    bounded by its ``AnswerBudget``)."""
    from loraplane.frontdoor.upstream_http import _PAUSE_BYTES

    sent = [0]

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%s\r\n" % (65536, b"d" * 65536)
        while sent[0] < 64 * 1024 * 1024:
            writer.write(piece)
            sent[0] += 65536
            await writer.drain()

    async with server(flood) as (pool, _):
        resp = await pool.request("POST", "/v1/completions", b"{}", total_timeout_s=30)
        try:
            held = []
            for _ in range(50):  # the upstream writes until the kernel's buffers are full
                await asyncio.sleep(0.01)
                held.append(resp._buffered)
            assert max(held) <= _PAUSE_BYTES + 256 * 1024, max(held)
            assert sent[0] < 64 * 1024 * 1024  # the upstream was held back, not drained
        finally:
            resp.close()
