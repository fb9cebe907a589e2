"""The built-in dashboard in headless Chromium, against ClickHouse rows we know."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from loraplane.kernel.config import Settings
from loraplane.metrics.clickhouse import connect
from loraplane.metrics.tables import TABLES
from tests.headless_chromium import chromium_argv, require_chromium
from tests.integration.metrics_env import (
    REPO,
    cache_event,
    env_for,
    metrics_env,
    request_events,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.browser]

ARTIFACTS = REPO / "test-artifacts"


def insert(settings: Settings, table_name: str, models: list) -> None:
    table = next(t for t in TABLES if t.name == table_name)
    client = connect(settings)
    client.execute(table.insert_sql, [table.row(m) for m in models], types_check=True)
    client.disconnect()


def chromium(*args: str, tmp: Path) -> str:
    done = subprocess.run(
        chromium_argv(tmp, "--virtual-time-budget=8000", "--window-size=1400,1050", *args),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def dashboard() -> Iterator[tuple[str, list]]:
    require_chromium()
    with metrics_env(Settings()) as settings:
        start = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=4)
        events = request_events(120, seed=5, adapters=("alpha", "beta"), start=start)
        insert(settings, "request_log", events)
        insert(
            settings,
            "cache_events",
            [cache_event(i, "load", swap_ms=20.0 * i) for i in range(1, 9)],
        )
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "loraplane"), "dashboard", "--port", str(port)],
            cwd=REPO,
            env=env_for(settings),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}/"
        try:
            wait_for(
                lambda: urllib.request.urlopen(url, timeout=2).status == 200, 30, "dashboard server"
            )
            yield url, events
        finally:
            server.terminate()
            server.wait(10)


def test_charts_and_table_show_the_known_rows(dashboard, tmp_path: Path) -> None:
    url, events = dashboard
    dom = chromium("--dump-dom", f"{url}?since=1h", tmp=tmp_path / "profile")
    status = re.search(r'id="status"[^>]*>([^<]*)<', dom)
    assert 'data-loaded="true"' in dom, f"page status: {status and status.group(1)}"
    # Hit-rate chart: one point per (adapter, minute) with gpu / requests of that minute.
    expected: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for e in events:
        key = (e.adapter_id, e.ts.replace(second=0, microsecond=0).strftime("%Y-%m-%dT%H:%M"))
        expected[key][0] += e.tier_at_arrival == "gpu"
        expected[key][1] += 1
    chart = dom[dom.index('id="chart-hit-rate"') : dom.index('id="chart-ttft"')]
    points = re.findall(
        r'data-series="(\w+)" data-t="([\d\-T:]{16})[^"]*" data-y="([\d.]+)"', chart
    )
    assert len(points) == len(expected)
    for adapter, minute, value in points:
        gpu, total = expected[(adapter, minute)]
        assert float(value) == round(gpu / total, 4)
    # Every chart has both adapters; the swap chart only alpha (the only adapter loaded).
    for chart_id in ("chart-ttft", "chart-cold"):
        section = dom[dom.index(f'id="{chart_id}"') :]
        assert 'class="series" data-series="alpha"' in section.split("</section>")[0]
        assert 'class="series" data-series="beta"' in section.split("</section>")[0]
    swap = dom[dom.index('id="chart-swap"') :].split("</section>")[0]
    assert 'data-series="alpha"' in swap and 'data-series="beta"' not in swap
    # Summary table: exact per-adapter requests.
    for adapter in ("alpha", "beta"):
        rows = re.findall(rf'<tr data-adapter="{adapter}">.*?data-col="requests">(\d+)<', dom)
        assert sum(map(int, rows)) == sum(e.adapter_id == adapter for e in events)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    chromium(f"--screenshot={shot}", f"{url}?since=1h", tmp=tmp_path / "profile2")
    assert shot.stat().st_size > 10_000


def test_api_rejects_unknown_queries_and_bad_windows(dashboard) -> None:
    url, _ = dashboard
    for path in (
        "api/query/nope",
        "api/query/adapter_summary?since=forever",
        "api/query/..%2Fsecret",
        "api/query/adapter_summary?since=99999999999d",
        "api/query/adapter_summary?limit=0",
        "api/query/adapter_summary?limit=10" + "0" * 30,
        "api/query/adapter_summary?adapter_id=alpha%0A",
    ):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + path, timeout=5)
        assert err.value.code in (400, 404)
