"""The worker's start (``workers.runner._serve_worker``) with the broker away: the registry's
first read (``FIRST_READ_S``) and the command feed's partition probe
(``START_METADATA_TIMEOUT_S``) each wait to their bound, side by side, so a worker restarted
in a Kafka outage serves its saved views after one bound, not after both.

The components are the recording stand-ins of test_worker_stop but the registry tail and the
command feed: the tail's first read ends as soon as the feed is built, or at its bound."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from loraplane.workers import runner
from tests.unit.test_router_stop import Steps
from tests.unit.test_worker_stop import _stand_ins, started_worker

pytestmark = pytest.mark.asyncio(loop_scope="session")

READ_BOUND_S = 5.0


async def test_the_command_feed_is_built_while_the_registry_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handlers = _stand_ins(monkeypatch, Steps())
    built = threading.Event()
    read: list[tuple[bool, float]] = []  # (the feed built during the read, the read's seconds)

    class Tail:
        progress = None

        def wait_caught_up(self, timeout_s: float) -> bool:
            t0 = time.monotonic()
            read.append((built.wait(READ_BOUND_S), time.monotonic() - t0))
            return False  # never caught up: the broker is away

        def stop(self) -> None:
            pass

    class Feed:
        partition, progress = 0, None

        def __init__(self, *_a: Any, **_k: Any) -> None:
            built.set()

        def read_bytes(self) -> int:
            return 0

        def close(self) -> None:
            pass

    registry = type("Registry", (), {"records": list})()
    monkeypatch.setattr(runner, "worker_registry", lambda *_a: (Tail(), registry))
    monkeypatch.setattr(runner, "KafkaCommandFeed", Feed)
    serving = await started_worker(tmp_path, handlers)
    handlers["SIGTERM"]()
    await asyncio.wait_for(serving, 10)
    ((beside, seconds),) = read
    assert beside and seconds < READ_BOUND_S, read
