"""ATTACK: every id and header a client sends to the front door, with control characters,
other bytes and trailing newlines, through the fleet router and the worker gateway (on
FakeServing workers): a clean 4xx with its reason (or the request served when the odd value
was an optional header, which is then ignored), never a 500, and the gateway's one
RequestLog exactly when the request passed auth, class, JSON and ``model``. Worker states
whose ids carry the same characters are dead-lettered by the router.

The servers run on an event loop in a thread of their own, so hypothesis drives them from
plain blocking sockets that send any bytes, which aiohttp's own client would refuse to send.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from secrets import token_hex
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from loraplane.cli import app
from loraplane.frontdoor.forwarded import (
    SIGNATURE_HEADER,
    TENANT_HEADER,
    VERSION_HEADER,
    VERSION_REASON_HEADER,
    Forward,
    Target,
    sign,
)
from loraplane.frontdoor.request_fields import header_token
from loraplane.kernel.bus import Record
from loraplane.kernel.config import HttpLimits
from loraplane.kernel.http_server import bound_port, start_site
from loraplane.kernel.policy import RequestBudgets
from loraplane.router.routing import FleetIndex
from loraplane.router.server import Fleet, Router, serving_versions
from loraplane.schemas.base import is_id
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.reasons import AdmissionRefusal, RequestRefusal, ServerRefusal
from loraplane.schemas.request_log import RequestLog
from loraplane.workers.gateway import Gateway
from loraplane.workers.vllm_routes import ROUTES
from tests.unit.test_gateway import KEYS, RECORDS, FakeServing, ListSink
from tests.unit.test_http_server import REST, answers_past_a_refusal, assert_one_answer_then_closed
from tests.unit.test_planner import POLICY, worker

SECRET = b"r" * 32
COMPLETIONS = Target("POST", "/v1/completions")  # what a router signs a completion for
CONTROL = [chr(c) for c in (*range(0x20), 0x7F, 0x85, 0xA0, 0x2028, 0x2029, 0xFEFF)]
IDS = ["sql", "chat", "other", "nope"]  # served, canary split, another tenant's, unknown
UNLOGGED = (
    "unauthorized",
    "repeated_header",
    "bad_request_class",
    "invalid_json",
    "model_not_adapter_id",
    "malformed_request",
)
"""Refusals made before a RequestLog can be keyed (no tenant, class or adapter id yet)."""
EXAMPLES = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def hostile(base: str) -> st.SearchStrategy[str]:
    """``base`` with a control or separator character at its end, start or inside."""
    return st.builds(
        lambda c, at: {"end": base + c, "start": c + base, "inside": base[:1] + c + base[1:]}[at],
        st.sampled_from(CONTROL),
        st.sampled_from(["end", "start", "inside"]),
    )


def maybe_hostile(base: str) -> st.SearchStrategy[str]:
    return st.one_of(st.just(base), hostile(base))


def header_value() -> st.SearchStrategy[bytes | None]:
    """Absent, a plain token, or bytes no header should hold (controls, non-UTF-8, long)."""
    return st.one_of(
        st.none(),
        st.just(b"req-1"),
        st.just(b""),
        st.just(b"x" * 300),
        hostile("req-1").map(lambda s: s.encode("utf-8")),
        st.binary(min_size=1, max_size=12).filter(lambda b: b"\r" not in b and b"\n" not in b),
    )


@dataclass(frozen=True)
class Reply:
    status: int
    headers: bytes
    body: bytes

    def error_type(self) -> str:
        """The OpenAI error's ``type``: the reason of every 4xx the door answers, its
        handlers' and its server's own (``malformed_request`` for a head the parser
        refuses) alike."""
        assert b"application/json" in self.headers.lower(), (self.status, self.body)
        return str(json.loads(self.body)["error"]["type"])


def send(
    port: int, path: str, lines: list[bytes], body: bytes = b"", method: bytes = b"POST"
) -> Reply:
    """One request with exactly these header lines; the whole answer (the server closes)."""
    head = b"".join(line + b"\r\n" for line in lines)
    request = (
        method
        + b" "
        + path.encode()
        + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        + head
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    raw = b"".join(chunks)
    head_part, _, content = raw.partition(b"\r\n\r\n")
    return Reply(int(head_part.split(b" ", 2)[1]), head_part, content)


class Loop:
    """An event loop in a daemon thread; ``run`` waits for a coroutine's result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class FrontDoor:
    loop: Loop
    gateway: int  # ports
    router: int
    router_metrics: int  # the router's --metrics-port listener
    gateway_metrics: int  # the worker's --metrics-port listener
    sink: ListSink  # the gateway's: its RequestLogs
    router_sink: ListSink


class MeteredServing(FakeServing):
    """A worker whose ``/metrics`` names another tenant's adapter, as a real one does."""

    def metrics_exposition(self) -> bytes:
        return (
            b'loraplane_hot_adapter_requests_total{adapter_id="other",adapter_version="1",'
            b'tenant_id="tenant-b",base_model="base"} 7.0\n'
        )


LIMITS = HttpLimits(body_timeout_s=5.0)
"""The servers' bounds as they run (a short body deadline: a test that waits on one fails
in seconds, not half a minute)."""


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    """``app`` as the router and the gateway serve it: ``start_site``, with its middleware."""
    runner, _ = await start_site(app, "127.0.0.1", 0, LIMITS, name="front-door-test")
    return runner, bound_port(runner)


@pytest.fixture(scope="module")
def door() -> Iterator[FrontDoor]:
    loop = Loop()
    sql = RECORDS[2]
    sink, router_sink = ListSink(), ListSink()
    serving = MeteredServing(hot={sql.lora_name}, worker_id="w1")
    gateway = Gateway(
        serving, api_keys=KEYS, budgets=RequestBudgets(), sink=sink, router_secret=SECRET
    )
    gw, gw_port = loop.run(serve(gateway.app()))
    gm, gm_port = loop.run(serve(gateway.metrics_app()))
    fleet = Fleet(FleetIndex(POLICY, 3600.0), router_sink, "router-t")  # never stale here
    state = worker("w1", gpu=[sql], slots=4, base=sql.base_model)
    fleet.index.update(
        state.model_copy(
            update={"ts": datetime.now(UTC), "gateway_url": f"http://127.0.0.1:{gw_port}"}
        )
    )
    fleet.versions = serving_versions(list(RECORDS))
    router = Router(fleet, api_keys=KEYS, budgets=RequestBudgets(), secret=SECRET)
    rs, rs_port = loop.run(serve(router.app()))
    rm, rm_port = loop.run(serve(router.metrics_app()))
    yield FrontDoor(loop, gw_port, rs_port, rm_port, gm_port, sink, router_sink)
    loop.run(rm.cleanup())
    loop.run(rs.cleanup())
    loop.run(gm.cleanup())
    loop.run(gw.cleanup())
    loop.close()


def _lines(
    key: bytes | None, request_id: bytes | None, session: bytes | None, request_class: bytes | None
) -> list[bytes]:
    lines = [b"Content-Type: application/json"]
    for name, value in (
        (b"Authorization", None if key is None else b"Bearer " + key),
        (b"X-Request-Id", request_id),
        (b"X-Session-Key", session),
        (b"X-Request-Class", request_class),
    ):
        if value is not None:
            lines.append(name + b": " + value)
    return lines


def _refused_unless_an_id(reply: Reply, model: str) -> None:
    """A ``model`` that is not wholly an id is a 400 (or refused earlier), never looked up."""
    if not is_id(model):
        assert reply.status >= 400
        assert reply.error_type() in ("model_not_adapter_id", *UNLOGGED)


def _check_logs(new: list[RequestLog], reply: Reply, model: str) -> None:
    """One valid RequestLog exactly when the request got past the checks that key it."""
    kind = reply.error_type() if reply.status >= 400 else "ok"
    if kind in UNLOGGED:
        assert new == [], (kind, new)
        return
    assert len(new) == 1, (reply, new)
    (log,) = new
    assert log.adapter_id == model and is_id(log.tenant_id)
    assert header_token(log.request_id) == log.request_id
    RequestLog.model_validate_json(log.model_dump_json())  # the bytes Kafka would carry


REQUESTS = dict(
    model=st.one_of(st.sampled_from(IDS), st.sampled_from(IDS).flatmap(hostile)),
    key=st.one_of(st.just(b"key-a"), st.just(b"key-b"), st.none(), header_value()),
    request_id=header_value(),
    session=header_value(),
    request_class=st.one_of(st.none(), st.just(b"batch"), header_value()),
)


ISSUE_CASE = dict(
    model="sql\n", key=b"key-a", request_id=None, session=None, request_class=None
)  # Python's `$` matched before the final newline


@pytest.mark.parametrize("through", ["gateway", "router"])
@EXAMPLES
@given(**REQUESTS)
@example(**ISSUE_CASE)  # type: ignore[arg-type]
def test_attack_ids_and_headers_get_a_clean_answer(
    door: FrontDoor,
    through: str,
    model: str,
    key: bytes | None,
    request_id: bytes | None,
    session: bytes | None,
    request_class: bytes | None,
) -> None:
    before = len(door.sink.messages(RequestLog))
    body = json.dumps({"model": model, "prompt": "q"}).encode()
    reply = send(
        getattr(door, through),
        "/v1/completions",
        _lines(key, request_id, session, request_class),
        body,
    )
    assert reply.status < 500, reply
    _refused_unless_an_id(reply, model)
    new = door.sink.messages(RequestLog)[before:]
    if through == "gateway":
        _check_logs(new, reply, model)
    elif reply.status >= 400:  # the router's own refusals reach no gateway
        assert reply.error_type()
        assert new == [] or (len(new) == 1 and new[0].status != "ok")
    else:
        assert len(new) == 1 and new[0].adapter_id == model
        assert header_token(new[0].request_id) == new[0].request_id
    assert not door.router_sink.messages(RequestLog)


@EXAMPLES
@given(
    tenant=maybe_hostile("tenant-a"),
    request_id=maybe_hostile("r1"),
    signature=st.one_of(st.none(), st.sampled_from(["good", "junk", "non-ascii", "digits"])),
)
def test_attack_a_forwarded_tenant_is_believed_only_as_a_signed_id(
    door: FrontDoor, tenant: str, request_id: str, signature: str | None
) -> None:
    """Even signed with the router secret, a tenant that is no id (or a request id that is
    no header token) is a 401: the gateway never keys a log by it."""
    body = json.dumps({"model": "sql", "prompt": "q"}).encode()
    now = time.time()
    fwd = Forward(tenant, "interactive", "1", "active")
    value = {
        None: None,
        "good": sign(
            SECRET, fwd, COMPLETIONS, request_id, body, now, worker_id="w1", nonce=token_hex(16)
        ),
        "junk": "1.zz",
        "non-ascii": f"{int(now)}." + "é" * 64,
        "digits": "١٢٣." + "0" * 64,
    }[signature]
    lines = [
        b"Content-Type: application/json",
        TENANT_HEADER.encode() + b": " + tenant.encode(),
        b"X-Request-Id: " + request_id.encode(),
        b"X-Request-Class: interactive",
        VERSION_HEADER.encode() + b": 1",
        VERSION_REASON_HEADER.encode() + b": active",
    ]
    if value is not None:
        lines.append(SIGNATURE_HEADER.encode() + b": " + value.encode())
    before = len(door.sink.messages(RequestLog))
    reply = send(door.gateway, "/v1/completions", lines, body)
    assert reply.status < 500, reply
    clean = is_id(tenant) and header_token(request_id) == request_id and signature == "good"
    if clean:
        assert reply.status == 200
        (log,) = door.sink.messages(RequestLog)[before:]
        assert (log.tenant_id, log.request_id) == (tenant, request_id)
    else:
        assert reply.status in (400, 401), reply
        assert door.sink.messages(RequestLog)[before:] == []


def test_attack_two_api_keys_list_no_models(door: FrontDoor) -> None:
    """The router's model list reads the API key as the front door does: two are a 400."""
    lines = [b"Authorization: Bearer key-a", b"Authorization: Bearer key-b"]
    reply = send(door.router, "/v1/models", lines, method=b"GET")
    assert (reply.status, reply.error_type()) == (400, "repeated_header"), reply
    reply = send(door.router, "/v1/models", lines[:1], method=b"GET")
    assert reply.status == 200 and json.loads(reply.body)["data"]


def test_attack_a_forwarded_tenant_lists_no_models_at_the_router(door: FrontDoor) -> None:
    """The router believes no forwarded tenant on any route, and says so as a router."""
    lines = [b"Authorization: Bearer key-a", TENANT_HEADER.encode() + b": tenant-b"]
    reply = send(door.router, "/v1/models", lines, method=b"GET")
    assert (reply.status, reply.error_type()) == (401, "unauthorized"), reply
    assert json.loads(reply.body)["error"]["message"] == "a router takes no forwarded requests"


@pytest.mark.parametrize("through", ["gateway", "router"])
def test_attack_a_body_declared_over_the_cap_is_refused_before_it_is_read(
    door: FrontDoor, through: str
) -> None:
    """A Content-Length over the server's cap is a 413 at once, whether or not the bytes
    follow: the door does not wait for a body it would refuse."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Authorization: Bearer key-a\r\nContent-Type: application/json\r\n"
        b"Content-Length: 900000000\r\n\r\n{}"
    )
    with socket.create_connection(("127.0.0.1", getattr(door, through)), timeout=10) as sock:
        sock.sendall(head)
        answer = sock.recv(65536)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split(b" ")[1] == b"413", answer
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["type"] == "body_too_large"


@pytest.mark.parametrize("through", ["gateway", "router"])
@pytest.mark.parametrize("expect", [b"", b"Expect: 100-continue\r\n"])
def test_attack_a_request_without_a_key_is_refused_before_its_body(
    door: FrontDoor, through: str, expect: bytes
) -> None:
    """No API key: a 401 at once, however long the body it declares takes to come (the
    server read every body before its handler: the 401 waited for the body, and a body that
    never came was cut by its deadline with no answer at all)."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + expect
        + b"Content-Length: 500000\r\n\r\n{"
    )
    with socket.create_connection(("127.0.0.1", getattr(door, through)), timeout=10) as sock:
        sock.sendall(head)
        answer = b""
        while b"}}" not in answer:
            chunk = sock.recv(65536)
            assert chunk, answer  # closed without an answer
            answer += chunk
    assert answer.split(b" ", 2)[1] == b"401", answer  # never a 100 Continue first


@pytest.mark.parametrize("through", ["gateway", "router"])
@pytest.mark.parametrize(
    "auth, declared, status",
    [(b"", 50, b"401"), (b"Authorization: Bearer key-a\r\n", 900_000_000, b"413")],
)
def test_attack_expect_100_continue_is_not_told_to_send_a_refused_body(
    door: FrontDoor, through: str, auth: bytes, declared: int, status: bytes
) -> None:
    """``Expect: 100-continue`` asks whether to send the body: a request the head check
    refuses gets its refusal as the first answer (no ``100 Continue`` inviting a body it
    would refuse) and the connection closes, since the body it held back never comes."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + auth
        + b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % declared
    )
    with socket.create_connection(("127.0.0.1", getattr(door, through)), timeout=10) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):  # closed by the server, never by the deadline
            answer += chunk
    assert answer.split(b" ", 2)[1] == status, answer
    assert b"100 Continue" not in answer


METRICS_SPELLINGS = [
    "/metrics",
    "/metrics/",
    "/METRICS",
    "/metrics?x=1",
    "//metrics",
    "/./metrics",
    "/%6Detrics",
    "/%6detrics",
    "/metrics%2F",
    "/v1/../metrics",
    "/metrics;x",
    "/metrics#x",
]


@pytest.mark.parametrize("path", METRICS_SPELLINGS)
def test_attack_the_router_api_port_serves_no_metrics(door: FrontDoor, path: str) -> None:
    """ATTACK: the router's API port is the tenants' front door, and it answered /metrics:
    fleet size, queue depths per base model, every outcome count, to anyone who reaches it.
    Every spelling of it is not found there, with or without a key; the router's own
    metrics listener serves it."""
    for lines in ([], [b"Authorization: Bearer key-a"]):
        reply = send(door.router, path, lines, method=b"GET")
        assert reply.status == 404, (path, reply)
        assert b"loraplane_" not in reply.body
    served = send(door.router_metrics, "/metrics", [], method=b"GET")
    assert served.status == 200
    assert b"loraplane_router_requests_total" in served.body
    assert send(door.router_metrics, "/v1/models", [], method=b"GET").status == 404


@pytest.mark.parametrize("path", METRICS_SPELLINGS)
def test_attack_the_gateway_port_serves_no_metrics(door: FrontDoor, path: str) -> None:
    """ATTACK: a worker's gateway port is where tenants (directly) and routers reach it, and
    it answered /metrics: every adapter's series, other tenants' adapter ids, versions and
    request counts, to anyone holding any key or none. Every spelling of it, by every
    method, with a key or without one, is not found there; the worker's own metrics
    listener (``--metrics-port``) serves it."""
    for lines in ([], [b"Authorization: Bearer key-a"]):
        for method in (b"GET", b"HEAD", b"POST"):
            reply = send(door.gateway, path, lines, method=method)
            assert reply.status == 404, (path, method, reply)
            assert b"loraplane_" not in reply.body and b"tenant-b" not in reply.body
    served = send(door.gateway_metrics, "/metrics", [], method=b"GET")
    assert served.status == 200
    assert b"loraplane_hot_adapter_requests_total" in served.body
    for other in ("/v1/completions", "/healthz"):
        assert send(door.gateway_metrics, other, [], method=b"GET").status == 404


def _refusals_counted(door: FrontDoor, code: str) -> float:
    """The router's ``/metrics`` count of outcome ``code``."""
    text = send(door.router_metrics, "/metrics", [], method=b"GET").body.decode()
    line = f'loraplane_router_requests_total{{outcome="{code}"}} '
    return sum(float(row[len(line) :]) for row in text.splitlines() if row.startswith(line))


def test_a_refused_head_with_expect_is_counted_once(door: FrontDoor) -> None:
    """The head check runs once per request, whether the expect handler or the middleware
    asks first: the router counts each refusal once."""
    before = _refusals_counted(door, "unauthorized")
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"Content-Length: 5\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", door.router), timeout=10) as sock:
        sock.sendall(head)
        while sock.recv(65536):
            pass
    assert _refusals_counted(door, "unauthorized") == before + 1


@pytest.mark.parametrize("through", ["gateway", "router"])
def test_expect_100_continue_of_an_admissible_head_is_told_to_send(
    door: FrontDoor, through: str
) -> None:
    """A head the door takes is told ``100 Continue``, then served."""
    body = json.dumps({"model": "sql", "prompt": "q"}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Authorization: Bearer key-a\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    with socket.create_connection(("127.0.0.1", getattr(door, through)), timeout=10) as sock:
        sock.sendall(head)
        interim = sock.recv(65536)
        assert interim.startswith(b"HTTP/1.1 100 Continue"), interim
        sock.sendall(body)
        answer = interim.partition(b"\r\n\r\n")[2]
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.split(b" ", 2)[1] == b"200", answer[:300]


@pytest.mark.parametrize("through", ["gateway", "router"])
def test_an_expectation_other_than_100_continue_is_a_417(door: FrontDoor, through: str) -> None:
    """Only ``100-continue`` is an expectation the doors meet: another is a 417, as HTTP/1.1
    asks, before any body is read."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Authorization: Bearer key-a\r\nExpect: 200-ok\r\nContent-Length: 5\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", getattr(door, through)), timeout=10) as sock:
        sock.sendall(head)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 417"), answer[:300]


@pytest.mark.parametrize("through", ["gateway", "router"])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_keyless_client_that_sends_its_whole_body_reads_its_401(
    door: FrontDoor, through: str, chunked: bool
) -> None:
    """The 401 goes out before the body is read; the body that follows (within the cap) is
    read and dropped, so the client reads its answer instead of a reset from a socket
    closed on its unread bytes."""
    body = b'{"model": "sql", "prompt": "' + b"q" * 900_000 + b'"}'
    framing = (
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        if chunked
        else b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + framing
    with socket.create_connection(("127.0.0.1", getattr(door, through)), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.split(b" ", 2)[1] == b"401", answer[:200]


@pytest.mark.parametrize("through", ["gateway", "router"])
def test_a_refused_request_whose_body_is_in_keeps_its_connection(
    door: FrontDoor, through: str
) -> None:
    """A 401 for a request whose whole body came with it leaves the connection open for
    the next request (only a body still to come closes it)."""
    body = json.dumps({"model": "sql", "prompt": "q"}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with socket.create_connection(("127.0.0.1", getattr(door, through)), timeout=10) as sock:
        statuses = []
        for _ in range(2):
            sock.sendall(request)
            answer = b""
            while b'"code": 401}}' not in answer:
                chunk = sock.recv(65536)
                assert chunk, answer
                answer += chunk
            statuses.append(answer.split(b" ", 2)[1])
    assert statuses == [b"401", b"401"]


@pytest.mark.parametrize("through", ["gateway", "router"])
@pytest.mark.parametrize(
    "body, status",
    [
        (b'{"model":"sql","prompt":"a\\ud800b"}', 400),
        (b'{"model":"sql","prompt":["q","\\udfff"]}', 400),
        (b'{"model":"sql","prompt":"q","stop":"\\uDBFF"}', 400),
        (b'{"model":"sql","prompt":"a\xed\xa0\x80"}', 400),  # encoded: json takes it too
        ('{"model":"sql","prompt":"\ud800"}'.encode("utf-16-le", "surrogatepass"), 400),
        ('{"model":"sql","prompt":"d\u00e9j\u00e0"}'.encode(), 200),
        (b'{"model":"sql","prompt":"\\ud83d\\ude00"}', 200),  # a pair: one character
        (b'{"model":"sql","prompt":"\\\\ud800"}', 200),  # a backslash, then text
    ],
)
def test_attack_a_string_that_is_no_unicode_is_refused(
    door: FrontDoor, through: str, body: bytes, status: int
) -> None:
    """JSON's escapes can spell half a character (a lone surrogate), which no tokenizer
    takes (Hugging Face's raises TypeError): forwarded, it came back from vLLM as the
    gateway's 502 and an error counted against the version. It is the client's 400."""
    lines = [b"Content-Type: application/json", b"Authorization: Bearer key-a"]
    reply = send(getattr(door, through), "/v1/completions", lines, body)
    assert reply.status == status, reply
    if status == 400:
        assert reply.error_type() == "invalid_json"


@pytest.mark.parametrize("through", ["gateway", "router"])
@pytest.mark.parametrize(
    "first, second",
    [
        (b"Authorization: Bearer key-a", b"Authorization: Bearer key-b"),
        (b"Authorization: Bearer nope", b"Authorization: Bearer key-a"),
        (b"Authorization: Bearer key-a", b"authorization: Bearer key-a"),
        (b"X-Request-Class: interactive", b"X-Request-Class: batch"),
        (b"X-Request-Id: r1", b"X-Request-Id: r2"),
        (b"X-Session-Key: s1", b"X-Session-Key: s2"),
        (TENANT_HEADER.encode() + b": tenant-a", TENANT_HEADER.encode() + b": tenant-b"),
        (SIGNATURE_HEADER.encode() + b": 1.00", SIGNATURE_HEADER.encode() + b": 2.00"),
    ],
)
def test_attack_a_header_the_door_reads_sent_twice_is_refused(
    door: FrontDoor, through: str, first: bytes, second: bytes
) -> None:
    """Which of two values counts would be the reader's choice (a proxy may take the last,
    aiohttp takes the first): a header the front door reads, sent twice, is a 400 before
    anything is decided by either value, and nothing is logged."""
    lines = [b"Content-Type: application/json", first, second]
    if not first.lower().startswith(b"authorization"):
        lines.insert(1, b"Authorization: Bearer key-a")
    before = len(door.sink.messages(RequestLog))
    body = json.dumps({"model": "sql", "prompt": "q"}).encode()
    reply = send(getattr(door, through), "/v1/completions", lines, body)
    expected = (400, "repeated_header")
    if through == "router" and first.startswith(TENANT_HEADER.encode()):
        expected = (401, "unauthorized")  # a router takes no forwarded request at all
    assert (reply.status, reply.error_type()) == expected, reply
    assert door.sink.messages(RequestLog)[before:] == []


@EXAMPLES
@given(
    field=st.sampled_from(
        ["worker_id", "base_model", "lora_name", "adapter_id", "version", "tenant_id"]
    ),
    control=st.sampled_from(CONTROL),
    at=st.sampled_from(["end", "start", "inside"]),
)
def test_attack_worker_states_with_odd_ids_are_dead_lettered(
    field: str, control: str, at: str
) -> None:
    sink = ListSink()
    fleet = Fleet(FleetIndex(POLICY, 5.0), sink, "router-t")
    state = json.loads(worker("w1", gpu=[RECORDS[2]]).model_dump_json())
    state["gateway_url"] = "http://w1"
    where = state if field in ("worker_id", "base_model") else state["adapters"][0]
    value = where[field]
    where[field] = {
        "end": value + control,
        "start": control + value,
        "inside": value[:1] + control + value[1:],
    }[at]
    key = state["worker_id"].encode("utf-8")
    fleet.take(Record("lp.worker-state", 0, 7, key, json.dumps(state).encode(), {}, 0))
    if field == "lora_name":  # a name vLLM reports is data, not an id: only ever compared
        assert fleet.dead_lettered == 0  # with the registry's names, which it never equals
        fleet.proved("w1", state["gateway_url"], True, 0.0)  # its gateway proved itself
        assert RECORDS[2].lora_name not in fleet.index.workers["w1"].gpu
        return
    assert not fleet.index.workers and fleet.dead_lettered == 1
    assert len(sink.messages(DeadLetter)) == 1


@pytest.mark.parametrize(
    "url, kept",
    [
        ("http://127.0.0.1:8001", True),
        ("http://gw.example.svc.cluster.local:8001", True),
        ("", True),  # no gateway: not dead-lettered, never routed to
        ("http://127.0.0.1:99999", False),  # urlsplit's port raised ValueError: a 500
        ("http://127.0.0.1:abc", False),
        ("http://[::1", False),
        ("https://127.0.0.1:8001", False),  # the router speaks plain HTTP
        ("ftp://127.0.0.1:21", False),
        ("http://:8001", False),
        ("http://user@127.0.0.1:8001", False),
        ("http://127.0.0.1:8001 ", False),
    ],
)
def test_attack_a_worker_state_with_a_gateway_url_the_router_cannot_use_is_dead_lettered(
    url: str, kept: bool
) -> None:
    """ATTACK: a forged worker state announcing a ``gateway_url`` with no usable port. The
    router built its connection pool from it at routing time, where urlsplit raised a
    ValueError: every request routed to that worker was a 500. Such a state is not a
    worker state: dead-lettered where it is read."""
    sink = ListSink()
    fleet = Fleet(FleetIndex(POLICY, 5.0), sink, "router-t")
    state = json.loads(worker("w1", gpu=[RECORDS[2]]).model_dump_json())
    state["gateway_url"] = url
    fleet.take(Record("lp.worker-state", 0, 7, b"w1", json.dumps(state).encode(), {}, 0))
    assert fleet.dead_lettered == (0 if kept else 1)
    # a usable address waits for its gateway's proof; none (or a refused state) is never routed
    assert fleet.unproven == (1 if kept and url else 0)
    assert "w1" not in fleet.index.workers


@pytest.mark.parametrize(
    "args",
    [
        ["worker", "add-key", "--tenant", "tenant-a\n"],
        ["worker", "run", "--worker-id", "w1\n", "--base-model", "b", "--vllm-url", "http://x:1"],
        ["worker", "run", "--worker-id", "w1", "--base-model", "B", "--vllm-url", "http://x:1"],
        ["router", "run", "--router-id", "r\x001"],
    ],
)
def test_an_operators_id_that_is_not_wholly_an_id_is_a_usage_error(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It keys every log, state and path of the process: refused before anything starts
    (a tenant "tenant-a\\n" in the key file made every one of its requests a 500)."""
    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path))
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "is not an id" in result.output, result.output
    assert not (tmp_path / "api-keys.json").exists()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--gpu-slots", "0"),
        ("--gpu-slots", "100001"),
        ("--host-budget-bytes", "-1"),
        ("--host-budget-bytes", str(2**62 + 1)),
        ("--max-lora-rank", "0"),
        ("--max-lora-rank", "513"),
    ],
)
def test_a_worker_count_its_own_heartbeat_could_not_carry_is_a_usage_error(
    option: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every reader refuses a worker state whose counts are out of their bounds: a worker
    started with such a count would never be seen. Refused before anything starts."""
    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path))
    args = ["worker", "run", "--worker-id", "w1", "--base-model", "b", "--vllm-url", "http://x:1"]
    result = CliRunner().invoke(app, [*args, option, value])
    assert result.exit_code == 2 and option in result.output and " is not in " in result.output, (
        result.output
    )


def test_a_metrics_port_that_is_the_gateway_port_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway port serves no /metrics and one port takes one listener: a worker given
    the same port for both would fail at its start (after reading its key). Refused first."""
    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path))
    args = ["worker", "run", "--worker-id", "w1", "--base-model", "b", "--vllm-url", "http://x:1"]
    ports = ["--gateway-port", "18080", "--metrics-port", "18080"]
    result = CliRunner(env={"COLUMNS": "300"}).invoke(app, [*args, *ports])
    assert result.exit_code == 2 and "--metrics-port" in result.output, result.output
    assert "never serves /metrics" in result.output


@pytest.mark.parametrize("through", ["gateway", "router"])
def test_attack_a_key_scoped_to_other_base_models_serves_none_here(
    door: FrontDoor, through: str
) -> None:
    """A key scoped to base models serves only adapters of those: the tenant's own adapter
    of another base model is a 403 ``base_model_not_allowed`` (logged, as a 403 is), and
    the router lists only the adapters its base models hold."""
    body = json.dumps({"model": "sql", "prompt": "q"}).encode()
    port = getattr(door, through)
    before = len(door.sink.messages(RequestLog))
    reply = send(port, "/v1/completions", [b"Authorization: Bearer key-a-elsewhere"], body)
    assert (reply.status, reply.error_type()) == (403, "base_model_not_allowed"), reply
    if through == "gateway":
        (log,) = door.sink.messages(RequestLog)[before:]
        assert (log.status, log.error) == ("refused", "base_model_not_allowed")
    reply = send(port, "/v1/completions", [b"Authorization: Bearer key-a-here"], body)
    assert reply.status == 200, reply
    if through == "router":
        listed = {
            key: [
                m["id"]
                for m in json.loads(send(port, "/v1/models", [auth], method=b"GET").body)["data"]
            ]
            for key, auth in (
                ("elsewhere", b"Authorization: Bearer key-a-elsewhere"),
                ("here", b"Authorization: Bearer key-a-here"),
            )
        }
        assert listed["elsewhere"] == [] and "sql" in listed["here"], listed


@pytest.mark.parametrize("through", ["gateway", "router"])
@pytest.mark.parametrize(
    "auth, framing, sent, status",
    [
        (b"Authorization: Bearer key-a\r\n", b"Content-Length: 2000000\r\n\r\n", 3000, b"413"),
        (b"", b"Content-Length: 2000000\r\n\r\n", 3000, b"401"),
        (
            b"Authorization: Bearer key-a\r\n",
            b"Transfer-Encoding: chunked\r\n\r\n1e8480\r\n",
            1_100_000,  # past the cap as it is read
            b"413",
        ),
    ],
)
def test_attack_a_refused_body_is_never_read_as_a_next_request(
    door: FrontDoor, through: str, auth: bytes, framing: bytes, sent: int, status: bytes
) -> None:
    """A refusal answered before its body is in says ``Connection: close``, and the rest of
    the body (with a blank line and a whole request inside) gets no second answer: it was
    read as a next head, answered 431 before the close."""
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + framing + b"x" * sent
    first, after = answers_past_a_refusal(getattr(door, through), request, REST)
    assert_one_answer_then_closed(first, after, status)


def _head(method: bytes, path: bytes, extra: bytes = b"") -> bytes:
    return method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra


KEY_LINE = b"Authorization: Bearer key-a\r\n"
OVER_CAP = json.dumps({"model": "sql", "prompt": "x" * (2 << 20)}).encode()  # past 1 MiB
SERVED = {
    "gateway": {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/healthz")},
    "router": {
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/healthz"),
        ("GET", "/v1/models"),
    },
}
VLLM_ROUTES = sorted(
    {
        (r.method, r.path.replace("{response_id}", "r1").replace("{adapter_name}", "a"))
        for r in ROUTES
    }
)
"""Every route the real vLLM serves, its parameters filled in."""
SERVER_ANSWERS = {
    "an unknown route": (_head(b"POST", b"/v1/embeddings", KEY_LINE) + b"\r\n", 404),
    "a trailing slash": (_head(b"POST", b"/v1/completions/", KEY_LINE) + b"\r\n", 404),
    "a doubled slash": (_head(b"POST", b"//v1/completions", KEY_LINE) + b"\r\n", 404),
    "an encoded dot-dot": (_head(b"POST", b"/v1/x/%2e%2e/completions", KEY_LINE) + b"\r\n", 404),
    # (a declined CONNECT keeps its connection for the next request: the client closes it)
    "a CONNECT": (
        b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\nConnection: close\r\n\r\n",
        404,
    ),
    "a GET of a POST route": (_head(b"GET", b"/v1/completions", KEY_LINE) + b"\r\n", 405),
    "an OPTIONS": (_head(b"OPTIONS", b"/v1/chat/completions") + b"\r\n", 405),
    "a DELETE": (_head(b"DELETE", b"/v1/completions", KEY_LINE) + b"\r\n", 405),
    "a chunked body past the cap": (
        _head(b"POST", b"/v1/completions", KEY_LINE)
        + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(OVER_CAP)
        + OVER_CAP
        + b"\r\n0\r\n\r\n",
        413,
    ),
    "a gzip body that inflates past the cap": (
        _head(b"POST", b"/v1/completions", KEY_LINE)
        + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(gzip.compress(OVER_CAP))
        + gzip.compress(OVER_CAP),
        413,
    ),
    "a gzip body that does not inflate": (
        _head(b"POST", b"/v1/completions", KEY_LINE)
        + b"Content-Encoding: gzip\r\nContent-Length: 12\r\n\r\n\x1f\x8b garbage!",
        400,
    ),
    "Content-Length and Transfer-Encoding": (
        _head(b"POST", b"/v1/completions", KEY_LINE)
        + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
    "two Content-Lengths": (
        _head(b"POST", b"/v1/completions", KEY_LINE)
        + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        400,
    ),
    "a folded header": (
        _head(b"POST", b"/v1/completions", KEY_LINE)
        + b"X-Request-Class: batch\r\n interactive\r\nContent-Length: 2\r\n\r\n{}",
        400,
    ),
    "a bare CR in a header": (
        _head(b"POST", b"/v1/completions", KEY_LINE)
        + b"X-A: a\rX-Request-Class: batch\r\nContent-Length: 2\r\n\r\n{}",
        400,
    ),
    "a Transfer-Encoding not ending in chunked": (
        _head(b"POST", b"/v1/completions", KEY_LINE)
        + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
        400,
    ),
    "an encoding no decoder is installed for": (
        _head(b"POST", b"/v1/completions", KEY_LINE)
        + b"Content-Encoding: zstd\r\nContent-Length: 2\r\n\r\n{}",
        400,
    ),
    "a request line that is no HTTP": (
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
        400,
    ),
    "an Expect but 100-continue": (
        _head(b"POST", b"/v1/completions", KEY_LINE)
        + b"Expect: 200-ok\r\nContent-Length: 2\r\n\r\n{}",
        417,
    ),
}
SERVER_REASONS = {
    *ServerRefusal,
    RequestRefusal.body_too_large,
    AdmissionRefusal.invalid_json,
}


def _error_of(first: bytes, status: int) -> str:
    """The answer is ``status`` in OpenAI's error shape (the door's every refusal): its
    ``type``, a reason of the server's own answers."""
    head, _, body = first.partition(b"\r\n\r\n")
    assert int(head.split(b" ", 2)[1]) == status, first[:400]
    assert b"application/json" in head.lower(), first[:400]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and isinstance(error["message"], str), error
    assert error["type"] in SERVER_REASONS, error
    return str(error["type"])


@pytest.mark.parametrize("through", ["gateway", "router"])
@pytest.mark.parametrize("case", sorted(SERVER_ANSWERS))
def test_attack_what_the_server_answers_itself_is_in_the_doors_shape(
    door: FrontDoor, through: str, case: str
) -> None:
    """ATTACK: what the router's and the gateway's server answers outside their handlers
    (an unknown route or method, a body read past the cap or that does not inflate, a head
    the parser refuses: smuggling framings, folds, bare CRs, TLS bytes; an unknown Expect)
    was aiohttp's plain text, so an OpenAI client read no ``error`` and the router counted
    none of them. Each is OpenAI's error shape with a reason of ``schemas.reasons`` (a 4xx,
    never a 500), and the router counts it."""
    request, status = SERVER_ANSWERS[case]
    port = getattr(door, through)
    before = {r: _refusals_counted(door, r) for r in SERVER_REASONS}
    first, _ = answers_past_a_refusal(port, request, b"")
    reason = _error_of(first, status)
    if through == "router":
        assert _refusals_counted(door, reason) == before[reason] + 1


@pytest.mark.parametrize("through", ["gateway", "router"])
def test_attack_every_route_of_vllm_is_refused_at_the_door(door: FrontDoor, through: str) -> None:
    """ATTACK: each of vLLM's routes (its loads, unloads, SageMaker ones, tokenizer, docs,
    metrics) that the door does not serve itself, with a tenant's key or none, is a 404
    ``unknown_route`` (or 405 for a path the door serves by another method), in the door's
    error shape; nothing of it reaches a worker."""
    served = SERVED[through]
    before = len(door.sink.messages(RequestLog))
    for method, path in VLLM_ROUTES:
        if (method, path) in served:
            continue
        status = 405 if any(p == path for _, p in served) else 404
        for key in (KEY_LINE, b""):
            body = b"{}" if method != "GET" else b""
            request = (
                _head(method.encode(), path.encode(), key)
                + b"Content-Length: %d\r\n\r\n" % len(body)
                + body
            )
            first, _ = answers_past_a_refusal(getattr(door, through), request, b"")
            assert _error_of(first, status) == (
                ServerRefusal.method_not_allowed if status == 405 else ServerRefusal.unknown_route
            ), (method, path)
    assert len(door.sink.messages(RequestLog)) == before


@pytest.mark.parametrize("through", ["gateway", "router"])
@pytest.mark.parametrize("escape", [b"\\ud800", b"\\ud83d\\ude00"])  # lone, and a pair
def test_attack_a_body_nested_as_deep_as_the_parser_takes_is_a_4xx(
    door: FrontDoor, through: str, escape: bytes
) -> None:
    """ATTACK: a key holder's body with a surrogate escape (an emoji as ``json.dumps``
    writes it, or a lone one) and arrays nested as deep as ``json.loads`` still takes: the
    door's check that every string is Unicode text re-encoded the body, one level deeper
    than the parse, and its RecursionError was a 500 (at the router and the gateway). At
    every depth around the interpreter's limit the answer is a 4xx in the door's shape."""
    before = _refusals_counted(door, "internal_error")
    port = getattr(door, through)
    limit = sys.getrecursionlimit()
    for depth in range(limit - 120, limit + 10):  # the window is one level wide
        body = b'{"model":"sql","prompt":"' + escape + b'","x":' + b"[" * depth
        body += b"]" * depth + b"}"
        reply = send(port, "/v1/completions", [KEY_LINE.strip()], body)
        assert 400 <= reply.status < 500, (depth, reply)
        assert reply.error_type() in ("invalid_json", "field_not_allowed"), (depth, reply)
    assert _refusals_counted(door, "internal_error") == before
