"""ATTACK on loopback: many slow and half-open connections against the servers loraplane runs.

The dashboard runs as its own process (``loraplane dashboard``, the real CLI, log captured);
the gateway app runs in-process on the same bounded site the worker uses
(``loraplane.kernel.http_server.start_site`` with ``settings.http``); the worker process's
own gateway and /metrics listeners get the same in test_worker_e2e.py. Each gets 500 sockets
that send nothing, half a request head, or a head with a body that never comes
(tests/integration/http_attack.py). Shown: every one is closed by its deadline, a real
request is answered meanwhile, at the cap the connections waiting longest are shed to make
room for new ones, and the log stays a few lines (counts, not a line per connection).
Bounded: 500-1,300 sockets, a few seconds. Needs no Kafka, ClickHouse or S3.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

from loraplane.frontdoor.api_keys import ApiKeys
from loraplane.infra.processes import free_port
from loraplane.kernel.config import HttpLimits, get_settings
from loraplane.kernel.http_server import bound_port, open_connections, start_site
from loraplane.kernel.policy import RequestBudgets
from loraplane.workers.gateway import Gateway
from tests.integration.http_attack import LIMITS, SLOW, attack, limits_env


def test_the_dashboard_process_sheds_slow_connections_and_logs_little(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "dashboard.log"
    env = {
        **os.environ,
        "LORAPLANE_HOME": str(tmp_path),
        "LORAPLANE_SECRETS_DIR": str(get_settings().secrets_dir),
        **limits_env(),
    }
    with log.open("wb") as out:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "loraplane"), "dashboard", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
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
        asyncio.run(attack(port, "/api/queries"))
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
    worker_id = "w-none"  # named by /healthz
    upstream_stalled = False  # /healthz says when requests are refused as not run
    wrong_base_model = False

    def metrics_exposition(self) -> bytes:
        return b"# nothing\n"

    def versions(self, adapter_id: str) -> list[object]:
        return []


@pytest.mark.asyncio
async def test_the_gateway_site_sheds_slow_connections(caplog: pytest.LogCaptureFixture) -> None:
    gateway = Gateway(
        _NoAdapters(),
        api_keys=ApiKeys({}),
        budgets=RequestBudgets(),  # type: ignore[arg-type]
        sink=None,
    )  # type: ignore[arg-type]
    limits = HttpLimits(**LIMITS)
    runner, burst = await start_site(gateway.app(), "127.0.0.1", 0, limits, name="gateway")
    try:
        with caplog.at_level("WARNING"):
            await attack(bound_port(runner), "/healthz")
        assert open_connections(runner) == 0
        assert burst.total["connection_shed"] > 0
        assert burst.total["header_timeout"] + burst.total["body_timeout"] >= SLOW
        assert len(caplog.records) < 10, [r.getMessage() for r in caplog.records]
    finally:
        await runner.cleanup()
    assert isinstance(runner, web.AppRunner)
