"""The router's stop (``router.server.serve_router``), in the order docs/router.md
("Stopping") gives: its listeners first, while every loop still runs (requests in flight
end with a live fleet view, registry and sink poller); then its loops, cancelled and
awaited; then the registry reads still in threads; then the worker-state tail, the takes it
queued on the loop, and the registry tail; the sink last, and nothing emits after it.

Every component is a recording stand-in but the listeners (``start_sites``, real, on
127.0.0.1) and the ``Router``/``Fleet`` themselves; the stop is the SIGTERM handler the
router installs, called directly."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web

from loraplane.eventlog import sink as event_sink
from loraplane.frontdoor import api_keys, hmac_keys
from loraplane.kernel import http_server, progress_metrics, topic_tail
from loraplane.kernel.bus import Record
from loraplane.kernel.config import Settings
from loraplane.kernel.thread_calls import ThreadCalls
from loraplane.registry import topic as registry_topic
from loraplane.router import server
from tests.unit.test_gateway import KEYS

pytestmark = pytest.mark.asyncio(loop_scope="session")

BAD_STATE = Record("worker-state", 0, 7, b"w9", b"not a worker state", {}, 0)


class Steps(list[str]):
    """What a stop did, in order; ``ports``: the listeners' bound ports."""

    def __init__(self) -> None:
        super().__init__()
        self.ports: list[int] = []

    def note(self, step: str) -> None:
        self.append(step)


class _Noted:
    """A started listener whose ``cleanup`` is noted; the rest is the real runner's."""

    def __init__(self, runner: web.AppRunner, steps: Steps) -> None:
        self.runner, self.steps = runner, steps

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    async def cleanup(self) -> None:
        self.steps.note("listener stopping")
        await self.runner.cleanup()
        self.steps.note("listener stopped")


def noted_sites(
    steps: Steps, start_sites: Callable[..., Awaitable[list[web.AppRunner]]]
) -> Callable[..., Awaitable[list[Any]]]:
    """``start_sites``, its listeners' stops noted in ``steps``."""

    async def started(*args: Any, **kwargs: Any) -> list[Any]:
        runners = await start_sites(*args, **kwargs)
        steps.ports.extend(http_server.bound_port(r) for r in runners)
        return [_Noted(r, steps) for r in runners]

    return started


class NoMetrics:
    def __init__(self, *_a: Any, **_k: Any) -> None:
        pass

    def collect(self) -> Iterator[Any]:
        return iter(())


def noted_sink(steps: Steps) -> type:
    """An event sink that notes its close, and any emit after it."""

    class Sink:
        def __init__(self, *_a: Any, **_k: Any) -> None:
            self.closed = False

        def emit(self, topic_suffix: str, _key: str, _message: Any) -> None:
            if self.closed:
                steps.note(f"emit {topic_suffix} after the sink closed")

        def close(self, _timeout_s: float = 5.0) -> int:
            self.closed = True
            steps.note("sink closed")
            return 0

    return Sink


def noted_poller(steps: Steps) -> Callable[[Any], Awaitable[None]]:
    """``poll_forever`` that notes its cancellation."""

    async def poll_forever(_sink: Any) -> None:
        await _cancelled(steps, "poller")

    return poll_forever


def _stand_ins(monkeypatch: pytest.MonkeyPatch, steps: Steps) -> dict[str, Callable[[], None]]:
    """Patch every component ``serve_router`` builds; the SIGTERM handler comes back."""
    handlers: dict[str, Callable[[], None]] = {}

    class StatesTail:
        def __init__(self, *_a: Any, on_record: Callable[[Record], object], **_k: Any) -> None:
            self.on_record, self.progress = on_record, None

        def start(self) -> StatesTail:
            return self

        def current_span(self) -> None:
            return None

        def placed(self, _record: Record) -> None:
            return None

        def stop(self) -> None:
            # a record its thread read just before it stopped: its take is queued on the
            # loop, and dead-letters (through the sink) when it runs
            self.on_record(BAD_STATE)
            steps.note("worker-state tail stopped")

    class RegistryTail:
        version, progress = 0, None

        def snapshot(self) -> list[Record]:
            return []

        def start(self) -> None:
            pass

        def wait_caught_up(self, _timeout_s: float) -> bool:
            return True

        def stop(self) -> None:
            steps.note("registry tail stopped")

    class Registry:
        def __init__(self, *_a: Any, **_k: Any) -> None:
            pass

        def records(self) -> list[Any]:
            return []

    class Reads(ThreadCalls):
        def drain(self, timeout_s: float = 5.0) -> bool:
            steps.note("registry reads drained")
            return super().drain(timeout_s)

    async def refresh(*_a: Any, **_k: Any) -> None:
        await _cancelled(steps, "registry refresh")

    async def watch(*_a: Any, **_k: Any) -> None:
        await _cancelled(steps, "fleet watch")

    async def beat(*_a: Any, **_k: Any) -> None:
        await _cancelled(steps, "heartbeat")

    loop = asyncio.get_running_loop()
    monkeypatch.setattr(
        loop, "add_signal_handler", lambda sig, cb: handlers.__setitem__(sig.name, cb)
    )
    monkeypatch.setattr(event_sink, "KafkaEventSink", noted_sink(steps))
    monkeypatch.setattr(event_sink, "SinkMetrics", NoMetrics)
    monkeypatch.setattr(event_sink, "poll_forever", noted_poller(steps))
    monkeypatch.setattr(api_keys.ApiKeysFile, "open", staticmethod(lambda _p: KEYS))
    monkeypatch.setattr(hmac_keys, "hmac_key", lambda *_a, **_k: b"r" * 32)
    monkeypatch.setattr(http_server, "start_sites", noted_sites(steps, http_server.start_sites))
    monkeypatch.setattr(progress_metrics, "ProgressMetrics", NoMetrics)
    monkeypatch.setattr(progress_metrics, "TailMetrics", NoMetrics)
    monkeypatch.setattr(topic_tail, "TopicTail", StatesTail)
    monkeypatch.setattr(registry_topic, "registry_tail", lambda *_a, **_k: RegistryTail())
    monkeypatch.setattr(server, "VerifiedRegistry", Registry)
    monkeypatch.setattr(server, "KeyringFile", lambda _p: None)
    monkeypatch.setattr(server, "ThreadCalls", Reads)
    monkeypatch.setattr(server, "_refresh_registry", refresh)
    monkeypatch.setattr(server, "_watch_fleet", watch)
    monkeypatch.setattr(server, "_beat", beat)
    return handlers


async def _cancelled(steps: Steps, what: str) -> None:
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        steps.note(f"{what} cancelled")
        raise


async def test_the_router_stops_its_listeners_then_loops_then_reads_tails_and_sink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = Steps()
    handlers = _stand_ins(monkeypatch, steps)
    ports: list[int] = []
    options = server.RouterOptions(port=0, router_id="r1", metrics_port=0)
    serving = asyncio.create_task(
        server.serve_router(Settings(home=tmp_path), options, ready=ports.append)
    )
    for _ in range(200):
        if ports or serving.done():
            break
        await asyncio.sleep(0.01)
    assert ports, serving
    async with (
        ClientSession() as http,
        http.get(f"http://127.0.0.1:{ports[0]}/healthz") as resp,
    ):
        assert resp.status in (200, 503)  # it serves
    handlers["SIGTERM"]()
    await asyncio.wait_for(serving, 10)
    loops = {"registry refresh cancelled", "fleet watch cancelled", "heartbeat cancelled"}
    loops.add("poller cancelled")
    assert steps[:2] == ["listener stopping", "listener stopped"], steps
    assert set(steps[2:6]) == loops, steps
    assert steps[6:] == [
        "registry reads drained",
        "worker-state tail stopped",
        "registry tail stopped",
        "sink closed",
    ], steps
    assert not [s for s in steps if "after the sink closed" in s]
