"""The route guard of the vLLM a worker starts, its judged route table, and the FAKE vLLM's
fidelity to both (the real vLLM's side: tests/integration/test_vllm_routes.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from loraplane.testing.fake_vllm import FakeVllm, route_table
from loraplane.workers.vllm_guard import UNAUTHORIZED, RouteGuard, admits, key_digest
from loraplane.workers.vllm_routes import DANGEROUS, OPEN_ROUTES, ROUTES

KEY = "k-0123456789"
DIGEST = key_digest(KEY)
METHODS = st.sampled_from(
    ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "WEBSOCKET", "get", "TRACE"]
)
PATHS = st.one_of(
    st.sampled_from([r.path for r in ROUTES]),
    st.sampled_from([r.path for r in ROUTES]).map(lambda p: p + "/"),
    st.sampled_from([r.path for r in ROUTES]).map(lambda p: "/" + p),
    st.text(min_size=0, max_size=40),
)


def test_nothing_that_loads_unloads_generates_or_changes_state_is_open() -> None:
    assert all(not r.open for r in ROUTES if r.effect in DANGEROUS)
    assert {m for m, _ in OPEN_ROUTES} == {"GET"}
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES)


@given(METHODS, PATHS, st.one_of(st.none(), st.text(max_size=40)))
def test_without_the_key_only_an_open_probe_passes(
    method: str, path: str, authorization: str | None
) -> None:
    open_probe = method in ("GET", "HEAD") and ("GET", path) in OPEN_ROUTES
    assert admits(method, path, authorization, None) == open_probe
    if authorization is not None and authorization.partition(" ")[2] != KEY:
        assert admits(method, path, authorization, DIGEST) == open_probe


@given(METHODS, PATHS, st.sampled_from(["Bearer", "bearer", "BEARER"]))
def test_the_key_opens_every_route(method: str, path: str, scheme: str) -> None:
    assert admits(method, path, f"{scheme} {KEY}", DIGEST)
    assert not admits(method, path, f"Basic {KEY}", DIGEST) or (
        method in ("GET", "HEAD") and ("GET", path) in OPEN_ROUTES
    )


def _scope(kind: str, method: str, path: str, auth: str | None) -> dict[str, Any]:
    headers = [(b"authorization", auth.encode())] if auth is not None else []
    return {"type": kind, "method": method, "path": path, "headers": headers}


def _call(guard: RouteGuard, scope: dict[str, Any]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        sent.append(dict(message))

    asyncio.run(guard(scope, receive, send))
    return sent


def test_the_guard_answers_vllms_401_and_passes_the_rest_on_unchanged() -> None:
    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(f"{scope['type']} {scope.get('path', '')}")

    guard = RouteGuard(app, KEY)
    sent = _call(guard, _scope("http", "POST", "/adapters", None))
    assert sent[0]["status"] == 401 and json.loads(sent[1]["body"]) == json.loads(UNAUTHORIZED)
    assert _call(guard, _scope("websocket", "GET", "/v1/realtime", None)) == [
        {"type": "websocket.close", "code": 1008}
    ]
    assert _call(guard, _scope("http", "DELETE", "/adapters/x", f"Bearer {KEY}x")) != []
    assert reached == []
    assert _call(guard, _scope("http", "POST", "/adapters", f"Bearer {KEY}")) == []
    assert _call(guard, _scope("http", "GET", "/health", None)) == []
    assert _call(guard, {"type": "lifespan"}) == []
    assert reached == ["http /adapters", "http /health", "lifespan "]
    keyless = RouteGuard(app, None)  # no key configured: only the open probes
    assert _call(keyless, _scope("http", "POST", "/v1/completions", "Bearer ")) != []
    assert _call(keyless, _scope("http", "GET", "/metrics", None)) == []


def test_the_fake_serves_exactly_the_real_vllms_route_table() -> None:
    table = route_table(FakeVllm("m", api_key=KEY).app())
    assert {(m, p) for p, methods in table.items() for m in methods} == {
        (r.method, r.path) for r in ROUTES
    }


@pytest.mark.parametrize("key", [KEY, None])
async def test_the_fake_refuses_every_route_the_way_the_guarded_vllm_does(key: str | None) -> None:
    async with TestClient(TestServer(FakeVllm("m", api_key=key).app())) as client:
        for route in ROUTES:
            path = route.path.replace("{adapter_name}", "a").replace("{response_id}", "r")
            for auth in (None, "Bearer wrong", "Basic " + KEY):
                headers = {"Authorization": auth} if auth else {}
                resp = await client.request(route.method, path, headers=headers, json={})
                if route.open:
                    assert resp.status == 200, route
                else:
                    assert resp.status == 401, route
                    assert json.loads(await resp.read()) == json.loads(UNAUTHORIZED)
            resp = await client.request("POST", "/not-a-vllm-route")
            assert resp.status == 401
