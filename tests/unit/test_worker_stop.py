"""The worker's stop (``workers.runner._serve_worker``), in the order docs/worker.md
("``loraplane worker run``") gives: its listeners first, while the agent still runs (a
request in flight, a cold one included, ends with a live agent: any fetch it causes is the
agent's, cancelled with it); then the agent's run and the sink's poller, cancelled and
awaited; then the agent's calls still in threads; its last state; the sink; the command
feed, the registry tail and the vLLM client.

Every component is a recording stand-in but the listeners (``start_sites``, real, on
127.0.0.1); the stop is the SIGTERM handler the worker installs, called directly."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web

from loraplane.kernel.config import Settings
from loraplane.kernel.thread_calls import ThreadCalls
from loraplane.workers import runner
from tests.unit.test_gateway import KEYS
from tests.unit.test_router_stop import (
    NoMetrics,
    Steps,
    _cancelled,
    noted_poller,
    noted_sink,
    noted_sites,
)

pytestmark = pytest.mark.asyncio(loop_scope="session")


def worker_options(tmp_path: Path) -> runner.WorkerOptions:
    """A worker's options whose every port and path is its own or unused."""
    return runner.WorkerOptions(
        worker_id="w1",
        base_model="b",
        vllm_url="http://127.0.0.1:9",
        gateway_port=0,
        metrics_port=None,
        host_tier_dir=tmp_path / "tier",
        host_budget_bytes=1,
        model_dir=tmp_path / "model",
    )


async def started_worker(
    tmp_path: Path, handlers: dict[str, Callable[[], None]], within_s: float = 10.0
) -> asyncio.Task[None]:
    """``runner.serve_worker`` running with ``worker_options``, once it has installed its
    SIGTERM handler (it serves then)."""
    options = worker_options(tmp_path)
    serving = asyncio.create_task(runner.serve_worker(Settings(home=tmp_path), options))
    for _ in range(int(within_s / 0.01)):
        if "SIGTERM" in handlers or serving.done():
            break
        await asyncio.sleep(0.01)
    assert "SIGTERM" in handlers, serving
    return serving


def _stand_ins(monkeypatch: pytest.MonkeyPatch, steps: Steps) -> dict[str, Callable[[], None]]:
    """Patch every component ``_serve_worker`` builds; the SIGTERM handler comes back."""
    handlers: dict[str, Callable[[], None]] = {}

    class Vllm:
        def __init__(self, *_a: Any, **_k: Any) -> None:
            pass

        async def close(self) -> None:
            steps.note("vLLM client closed")

    class Tail:
        progress = None

        def wait_caught_up(self, _timeout_s: float) -> bool:
            return True

        def stop(self) -> None:
            steps.note("registry tail stopped")

    class Feed:
        partition, progress = 0, None

        def __init__(self, *_a: Any, **_k: Any) -> None:
            pass

        def read_bytes(self) -> int:
            return 0

        def close(self) -> None:
            steps.note("command feed closed")

    class Agent:
        def __init__(self, _config: Any, *, sink: Any, **_k: Any) -> None:
            self.sink = sink

        async def run(self, _feed: Any) -> None:
            await _cancelled(steps, "agent run")

        def publish_state(self) -> None:
            self.sink.emit("worker-state", "w1", None)
            steps.note("last state published")

    class Gateway:
        def __init__(self, agent: Agent, **_k: Any) -> None:
            self.agent = agent

        def app(self) -> web.Application:
            async def healthz(_r: web.Request) -> web.Response:
                return web.json_response({"ok": True})

            app = web.Application()
            app.router.add_get("/healthz", healthz)
            return app

        def metrics_app(self) -> web.Application:
            return web.Application()

    real_drain = ThreadCalls.drain

    def drain(self: ThreadCalls, timeout_s: float = 5.0) -> bool:
        steps.note("agent calls drained")
        return real_drain(self, timeout_s)

    loop = asyncio.get_running_loop()
    monkeypatch.setattr(
        loop, "add_signal_handler", lambda sig, cb: handlers.__setitem__(sig.name, cb)
    )
    monkeypatch.setattr(ThreadCalls, "drain", drain)
    monkeypatch.setattr(runner, "VllmClient", Vllm)
    monkeypatch.setattr(runner, "base_model_shape", lambda *_a: None)
    monkeypatch.setattr(runner, "KafkaEventSink", noted_sink(steps))
    monkeypatch.setattr(runner, "SinkMetrics", NoMetrics)
    registry = type("Registry", (), {"records": list})()
    monkeypatch.setattr(runner, "worker_registry", lambda *_a: (Tail(), registry))
    monkeypatch.setattr(runner, "TailMetrics", NoMetrics)
    monkeypatch.setattr(runner, "ProgressMetrics", NoMetrics)
    monkeypatch.setattr(runner, "CommandBytesMetrics", NoMetrics)
    monkeypatch.setattr(runner, "KafkaCommandFeed", Feed)
    monkeypatch.setattr(runner, "KeyringFile", lambda _p: None)
    monkeypatch.setattr(runner, "WorkerAgent", Agent)
    monkeypatch.setattr(runner, "build_host_tier", lambda *_a: None)
    monkeypatch.setattr(runner, "BaseModelWatch", lambda *_a, **_k: None)
    monkeypatch.setattr(runner, "Gateway", Gateway)
    monkeypatch.setattr(runner.ApiKeysFile, "open", staticmethod(lambda _p: KEYS))
    monkeypatch.setattr(runner, "hmac_key", lambda *_a, **_k: b"g" * 32)
    monkeypatch.setattr(runner, "router_secret", lambda _s: None)
    monkeypatch.setattr(runner, "start_sites", noted_sites(steps, runner.start_sites))
    monkeypatch.setattr(runner, "poll_forever", noted_poller(steps))
    return handlers


async def test_the_worker_stops_its_listeners_then_its_agent_then_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = Steps()
    handlers = _stand_ins(monkeypatch, steps)
    serving = await started_worker(tmp_path, handlers)
    (port,) = steps.ports
    async with ClientSession() as http, http.get(f"http://127.0.0.1:{port}/healthz") as resp:
        assert resp.status == 200  # it serves
    handlers["SIGTERM"]()
    await asyncio.wait_for(serving, 10)
    assert steps[:2] == ["listener stopping", "listener stopped"], steps
    assert set(steps[2:4]) == {"agent run cancelled", "poller cancelled"}, steps
    assert steps[4:] == [
        "agent calls drained",
        "last state published",
        "sink closed",
        "command feed closed",
        "registry tail stopped",
        "vLLM client closed",
        "agent calls drained",  # serve_worker's: the host-tier claim is released after them
    ], steps
