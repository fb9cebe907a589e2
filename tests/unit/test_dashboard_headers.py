"""ATTACK: the dashboard's answers against framing, sniffing, injected script and leaked
URLs: every answer carries ``SECURITY_HEADERS``, and the page still draws its charts,
legends and tables in headless Chromium under that policy, with no violation reported.

Before, no answer carried any of them (a page of another site could frame the dashboard;
the legend's swatches were inline ``style`` attributes, which the policy blocks)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from loraplane.dashboards.web import SECURITY_HEADERS, Dashboard
from loraplane.kernel.config import Settings
from loraplane.kernel.http_server import bound_port, start_site
from loraplane.metrics import queries
from tests.headless_chromium import chromium_argv, require_chromium
from tests.unit.test_http_server import LIMITS, answers_past_a_refusal

pytestmark = pytest.mark.asyncio(loop_scope="session")
ADAPTERS = ("alpha", "beta")


class CannedDashboard(Dashboard):
    """The dashboard with rows made up here instead of ClickHouse's, and no fleet."""

    def _run(self, name: str, params: queries.Params) -> Any:
        start = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=3)
        minutes = [(start + timedelta(minutes=m)).strftime("%Y-%m-%dT%H:%M:%S") for m in range(3)]
        rows: list[dict[str, Any]] = []
        for i, adapter in enumerate(ADAPTERS):
            for m, minute in enumerate(minutes):
                rows.append(
                    {
                        "minute": minute,
                        "adapter_id": adapter,
                        "adapter_version": "1",
                        "tenant_id": "t",
                        "requests": 10 + m,
                        "hot_adapter_hit_rate": 0.5 + 0.1 * i,
                        "ttft_p50_ms": 10.0 + m,
                        "ttft_p95_ms": 20.0 + m,
                        "ttft_p99_ms": 30.0 + m,
                        "swap_p50_ms": 5.0,
                        "swap_p95_ms": 6.0,
                        "swap_p99_ms": 7.0,
                        "cold_n": m,
                    }
                )
        return rows

    def _read_fleet(self) -> dict[str, Any]:
        return {"base_models": [], "malformed_states": 0, "complete": True, "heartbeat_s": 1}


@pytest.fixture
async def dashboard(tmp_path: Path) -> AsyncIterator[int]:
    settings = Settings(home=tmp_path, http=LIMITS)
    runner, _ = await start_site(
        CannedDashboard(settings).app(), "127.0.0.1", 0, settings.http, name="dashboard"
    )
    yield bound_port(runner)
    await runner.cleanup()


def _headers(answer: bytes) -> dict[str, str]:
    head = answer.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]
    return {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head)}


async def _ask(port: int, request: bytes) -> bytes:
    def talk() -> bytes:
        return answers_past_a_refusal(port, request, b"")[0]

    return await asyncio.to_thread(talk)


@pytest.mark.parametrize(
    "request_line, host, status",
    [
        (b"GET / HTTP/1.1", b"127.0.0.1", b"200"),
        (b"GET /static/app.js HTTP/1.1", b"127.0.0.1", b"200"),
        (b"GET /static/style.css HTTP/1.1", b"127.0.0.1", b"200"),
        (b"GET /api/queries HTTP/1.1", b"localhost", b"200"),
        (b"GET /api/query/adapter_summary?since=1h HTTP/1.1", b"127.0.0.1", b"200"),
        (b"GET /api/query/adapter_summary?since=99y HTTP/1.1", b"127.0.0.1", b"400"),
        (b"GET /nothing HTTP/1.1", b"127.0.0.1", b"404"),
        (b"GET / HTTP/1.1", b"evil.example", b"403"),
        (b"DELETE / HTTP/1.1", b"127.0.0.1", b"405"),
    ],
)
async def test_every_dashboard_answer_carries_the_security_headers(
    dashboard: int, request_line: bytes, host: bytes, status: bytes
) -> None:
    answer = await _ask(dashboard, request_line + b"\r\nHost: " + host + b"\r\n\r\n")
    assert answer.split(b" ", 2)[1] == status, answer[:300]
    headers = _headers(answer)
    for name, value in SECURITY_HEADERS.items():
        assert headers.get(name.lower()) == value, (name, headers)


async def test_a_refusal_past_the_body_cap_carries_them_too(dashboard: int) -> None:
    request = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000
    answer = await _ask(dashboard, request)
    assert answer.split(b" ", 2)[1] == b"413"
    assert (
        _headers(answer).get("content-security-policy")
        == SECURITY_HEADERS["Content-Security-Policy"]
    )


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        # aiohttp's own answers: a head it cannot parse
        (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n", b"400"),
        (b"GET / HTTP/1.1\nHost: 127.0.0.1\n\n", b"400"),  # a bare-LF head
        (b"\x16\x03\x01\x02\x00 not http\r\n\r\n", b"400"),  # TLS to a plain port
        (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: x\r\n\r\n", b"400"),
        # the connection guard's: a head past max_header_bytes
        (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 3000 + b"\r\n\r\n", b"431"),
    ],
)
async def test_attack_a_connection_level_answer_carries_them_too(
    dashboard: int, request_bytes: bytes, status: bytes
) -> None:
    """ATTACK: answers that no handler of the app writes (aiohttp's 400 for a head it cannot
    parse, the guard's 431 for one past the bound) carry the same headers, read on the raw
    socket: a page of another site that frames or sniffs a malformed request's answer gets
    the policy too."""
    answer = await _ask(dashboard, request_bytes)
    assert answer.split(b" ", 2)[1] == status, answer[:300]
    headers = _headers(answer)
    for name, value in SECURITY_HEADERS.items():
        assert headers.get(name.lower()) == value, (name, headers)


def test_the_page_loads_no_inline_script_or_style() -> None:
    """What the policy would block: an inline script, a handler attribute, a ``style``
    attribute or element, or an asset from another origin, in the page or set by its
    script as markup."""
    from loraplane.dashboards.web import STATIC

    page = (STATIC / "index.html").read_text()
    assert re.findall(r"<script\b[^>]*>", page) == ['<script src="/static/app.js">']
    assert not re.search(r"<style\b|\sstyle=|\son\w+=|https?://", page)
    script = (STATIC / "app.js").read_text()
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script
    assert not re.search(r"\beval\(|new Function\(|setAttribute\(\"?style", script)


@pytest.mark.browser
async def test_the_page_draws_everything_under_its_policy(dashboard: int, tmp_path: Path) -> None:
    """Headless Chromium loads the page with the headers on: the charts, their legends
    (coloured swatches) and the table are drawn, and Chromium reports no policy violation
    (the legend's inline ``style`` attributes were one)."""
    require_chromium()
    proc = await asyncio.create_subprocess_exec(
        *chromium_argv(
            tmp_path / "profile",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            "--dump-dom",
            f"http://127.0.0.1:{dashboard}/?since=1h",
        ),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    dom, log = out.decode(), err.decode()
    assert proc.returncode == 0, log[-2000:]
    assert "Content Security Policy" not in log, [
        line for line in log.splitlines() if "Content Security Policy" in line
    ]
    assert 'data-loaded="true"' in dom, dom[:2000]
    for adapter in ADAPTERS:
        assert f'<tr data-adapter="{adapter}">' in dom
        assert f'class="series" data-series="{adapter}"' in dom
    swatches = re.findall(r'data-series="\w+"><i style="background: ([^;"]+);?"', dom)
    assert len(swatches) == 4 * len(ADAPTERS), dom[:3000]  # four charts, one per adapter
