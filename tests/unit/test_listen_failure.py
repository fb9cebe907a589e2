"""A start whose port is taken ends with one line and closes what it opened: ``worker run
--metrics-port`` binds /metrics before the gateway, and a gateway port held by another
process left the metrics listener (and the sink, the feed, the tail) open behind the error.
The same for the router's two listeners (``kernel.http_server.start_sites``)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from loraplane.kernel.config import LOOPBACK, HttpLimits, Settings
from loraplane.kernel.http_server import Listener, start_sites
from loraplane.workers import runner


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def bindable(port: int) -> bool:
    """Whether a new listener could take ``port`` now (nothing listens on it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process's listener holds."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        s.listen()
        yield int(s.getsockname()[1])


class NoMetrics:
    def __init__(self, *_: Any) -> None:
        pass

    def collect(self) -> list[Any]:
        return []


class Closable:
    """A Kafka-side part of the worker, recording whether it was closed."""

    def __init__(self, name: str, closed: list[str]) -> None:
        self.name, self.closed = name, closed
        self.progress = SimpleNamespace()
        self.read_bytes = lambda: 0
        self.partition = None

    def close(self, *_: Any) -> None:
        self.closed.append(self.name)

    def stop(self) -> None:
        self.closed.append(self.name)

    def wait_caught_up(self, _: float) -> bool:
        return True

    def start(self) -> Closable:
        return self

    def records(self) -> list[Any]:
        return []

    def poll(self) -> None:
        pass


async def test_a_taken_gateway_port_closes_the_metrics_listener_and_the_rest(
    taken: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[str] = []
    monkeypatch.setattr(runner, "KafkaEventSink", lambda *_a, **_k: Closable("sink", closed))
    for name in ("SinkMetrics", "TailMetrics", "ProgressMetrics", "CommandBytesMetrics"):
        monkeypatch.setattr(runner, name, NoMetrics)
    monkeypatch.setattr(
        runner,
        "worker_registry",
        lambda *_a: (Closable("tail", closed), Closable("registry", closed)),
    )
    monkeypatch.setattr(runner, "KafkaCommandFeed", lambda *_a, **_k: Closable("feed", closed))
    monkeypatch.setattr(runner, "base_model_shape", lambda *_a: None)
    monkeypatch.setattr(runner, "build_host_tier", lambda *_a: None)
    settings = Settings(home=tmp_path)
    metrics_port = free_port()
    options = runner.WorkerOptions(
        worker_id="w1",
        base_model="b",
        vllm_url="http://127.0.0.1:9",
        gateway_port=taken,
        metrics_port=metrics_port,
        host_tier_dir=tmp_path / "tier",
        host_budget_bytes=1 << 20,
        model_dir=tmp_path,
    )
    with pytest.raises(SystemExit) as exc:
        await runner.serve_worker(settings, options)
    message = str(exc.value.code)
    assert message == (
        f"worker w1: cannot listen on {LOOPBACK}:{taken} (--gateway-port): Address already in use"
    )
    assert bindable(metrics_port)  # the metrics listener was closed
    assert sorted(closed) == ["feed", "sink", "tail"]


@pytest.mark.parametrize("fails", [0, 1])
async def test_start_sites_is_all_or_none(taken: int, fails: int) -> None:
    """The router's order (API port, then metrics) and either one taken: none stays open."""
    ports = [free_port(), free_port()]
    ports[fails] = taken
    names = [("router", "--port"), ("router-metrics", "--metrics-port")]
    listeners = [
        Listener(web.Application(), p, n, o) for p, (n, o) in zip(ports, names, strict=True)
    ]
    with pytest.raises(SystemExit) as exc:
        await start_sites(listeners, LOOPBACK, HttpLimits(), process="router r1")
    assert str(exc.value.code).startswith(f"router r1: cannot listen on {LOOPBACK}:{taken} (")
    assert all(bindable(p) for p in ports if p != taken)
    await asyncio.sleep(0)


def test_the_process_exits_1_with_one_line(taken: int) -> None:
    """As ``worker run`` and ``router run`` end: exit 1, the one line on stderr."""
    script = (
        "import asyncio\n"
        "from aiohttp import web\n"
        "from loraplane.kernel.config import HttpLimits\n"
        "from loraplane.kernel.http_server import Listener, start_sites\n"
        f"ls = [Listener(web.Application(), {taken}, 'gateway', '--gateway-port')]\n"
        "asyncio.run(start_sites(ls, '127.0.0.1', HttpLimits(), process='worker w1'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    lines = done.stderr.splitlines()  # a warning may come first (the descriptor limit)
    assert lines[-1] == (
        f"worker w1: cannot listen on 127.0.0.1:{taken} (--gateway-port): Address already in use"
    )
    assert "Traceback" not in done.stderr
