"""ATTACK: the dashboard's query API (``GET /api/query/NAME``, dashboards/web.py) with
out-of-range and odd parameters: a 400 with the reason before any query runs, never a 500
(``since=99999999999d`` overflowed a datetime). ClickHouse is replaced by a query that
returns no rows; the server runs on the front-door tests' loop thread."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplane.dashboards.web import Dashboard
from loraplane.kernel.config import Settings
from loraplane.metrics import queries
from tests.unit.test_front_door_attacks import EXAMPLES, Loop, send, serve


class RowlessDashboard(Dashboard):
    """The dashboard with every query answered by no rows (no ClickHouse needed)."""

    def _run(self, name: str, params: queries.Params) -> Any:
        params.bound()
        return []


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Loop, int]]:
    loop = Loop()
    home = Path(tmp_path_factory.mktemp("dashboard"))
    runner, port = loop.run(serve(RowlessDashboard(Settings(home=home)).app()))
    yield loop, port
    loop.run(runner.cleanup())
    loop.close()


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    reply = send(port, path, [], method=b"GET")
    return reply.status, json.loads(reply.body)


@pytest.mark.parametrize(
    "query, reason",
    [
        ("since=99999999999d", "longer than the longest window"),
        ("since=999999999999w", "longer than the longest window"),
        ("since=3651d", "longer than the longest window"),
        ("since=1" + "0" * 30 + "s", "invalid duration"),
        ("since=%D9%A1h", "invalid duration"),  # an Arabic-Indic digit: no ASCII number
        ("since=1h%0A1h", "invalid duration"),
        ("limit=0", "limit must be"),
        ("limit=-1", "limit must be"),
        ("limit=100001", "limit must be"),
        ("limit=1" + "0" * 5000, "limit must be"),
        ("limit=1_000", "limit must be"),
        ("limit=%20100", "limit must be"),
        ("adapter_id=support-en%0A", "adapter_id must be an id"),
        ("tenant_id=T1", "tenant_id must be an id"),
        ("adapter_version=1%0A", "adapter_version must be a version"),
        ("base_model=%FF", "base_model must be an id"),
    ],
)
def test_attack_out_of_range_dashboard_parameters_are_400_with_the_reason(
    dashboard: tuple[Loop, int], query: str, reason: str
) -> None:
    status, body = get(dashboard[1], f"/api/query/adapter_summary?{query}")
    assert status == 400 and reason in body["error"], body


def test_the_longest_window_and_largest_limit_still_answer(dashboard: tuple[Loop, int]) -> None:
    status, body = get(
        dashboard[1],
        "/api/query/adapter_summary?since=3650d&limit=100000"
        "&adapter_id=support-en&adapter_version=v1.2",
    )
    assert status == 200 and body["rows"] == []


@EXAMPLES
@given(
    params=st.dictionaries(
        st.sampled_from(
            ["since", "limit", "base_model", "tenant_id", "adapter_id", "adapter_version", "other"]
        ),
        st.one_of(
            st.text(max_size=24),
            st.from_regex(r"[0-9]{1,14}[smhdw]", fullmatch=True),
            st.integers(-(2**70), 2**70).map(str),
        ),
    )
)
def test_attack_any_dashboard_parameters_get_200_or_400_with_a_reason(
    dashboard: tuple[Loop, int], params: dict[str, str]
) -> None:
    query = "&".join(f"{k}={quote(v, safe='', errors='surrogatepass')}" for k, v in params.items())
    status, body = get(dashboard[1], f"/api/query/adapter_summary?{query}")
    assert status in (200, 400), (status, body)
    if status == 400:
        assert isinstance(body["error"], str) and body["error"]


@pytest.mark.parametrize(
    "path",
    [
        "/static/app.js%00.png",
        "/static/" + "a" * 5000,
        "/static/%2e%2e/web.py",
        "/static/..%2fweb.py",
        "/static/%FF",
        "/api/query/" + "a" * 5000,
        "/api/query/adapter_summary%00",
        "/api/query/%2e%2e%2fqueries",
    ],
)
def test_attack_a_name_the_dashboard_does_not_have_is_a_404_or_400(
    dashboard: tuple[Loop, int], path: str
) -> None:
    """A static file or query name is looked up among those the dashboard has, never
    opened as the client spelled it: a NUL byte (ValueError) or a name longer than the
    file system takes (ENAMETOOLONG) was a 500."""
    status, body = get(dashboard[1], path)
    assert status in (400, 404), (status, body)
    assert isinstance(body["error"], str) and body["error"]


def test_the_dashboards_own_files_and_queries_are_served(dashboard: tuple[Loop, int]) -> None:
    reply = send(dashboard[1], "/static/app.js", [], method=b"GET")
    assert reply.status == 200 and reply.body
    status, body = get(dashboard[1], "/api/query/adapter_summary")
    assert status == 200 and body["rows"] == []


def _get_as(port: int, host: bytes) -> int:
    request = b"GET /api/query/adapter_summary HTTP/1.1\r\nHost: " + host + b"\r\n"
    request += b"Connection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize(
    "host",
    [b"evil.example", b"evil.example:%d", b"127.0.0.1.evil.example:%d", b"x", b"0.0.0.0:%d"],
)
def test_attack_a_page_of_another_site_cannot_read_the_dashboard(
    dashboard: tuple[Loop, int], host: bytes
) -> None:
    """DNS rebinding: a page of evil.example whose name comes to resolve to 127.0.0.1 asks
    the dashboard with its own name as Host; the browser lets it read the answer (the same
    origin), which held every tenant's request metrics. Only a loopback Host is served."""
    port = dashboard[1]
    assert _get_as(port, host.replace(b"%d", str(port).encode())) == 403


@pytest.mark.parametrize("host", [b"127.0.0.1:%d", b"localhost:%d", b"[::1]:%d", b"127.0.0.1"])
def test_the_dashboard_answers_a_loopback_host(dashboard: tuple[Loop, int], host: bytes) -> None:
    port = dashboard[1]
    assert _get_as(port, host.replace(b"%d", str(port).encode())) == 200
