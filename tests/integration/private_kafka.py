"""A throwaway Kafka of a test's own (tmp home, free ports, started through
loraplane.infra.kafka like the stack's), for tests that kill and restart brokers: never
the shared one. One node, or a cluster of several (``private_cluster``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaException

from loraplane.eventlog.sink import KafkaEventSink
from loraplane.infra.kafka import Kafka, kafka_nodes
from loraplane.infra.processes import free_port, port_in_use, wait_until
from loraplane.kernel import topics
from loraplane.kernel.config import KafkaSettings, Settings
from loraplane.schemas.request_log import RequestLog


@dataclass
class SteadyLoad:
    """Request logs (ids ``<prefix><n>``) at ``rate_hz`` through one event sink, as the
    broker-kill tests send them; ``poll`` serves the sink after each (default: its own).
    Keyed by their adapter, as workers send them (the scoring agent refuses other keys)."""

    events: KafkaEventSink
    prefix: str
    rate_hz: float
    poll: Callable[[], None] | None = None
    adapter_id: str = "a"
    n: int = 0  # sent so far

    def log(self, n: int) -> RequestLog:
        return RequestLog(
            event_id=f"{self.prefix}{n}",
            ts=datetime.now(UTC),
            request_id=f"r{n}",
            tenant_id="t",
            base_model="m",
            adapter_id=self.adapter_id,
            adapter_version="1",
            worker_id="w",
            tier_at_arrival="gpu",
            ttft_ms=1.0,
        )

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.events.emit("requests", self.adapter_id, self.log(self.n))
            self.n += 1
            (self.poll or self.events.poll)()
            time.sleep(1 / self.rate_hz)

    def drain(self, timeout_s: float = 60) -> None:
        """Serve the sink until its spool is replayed and Kafka acknowledged everything;
        fails if anything was dropped or failed."""
        deadline = time.monotonic() + timeout_s
        while (self.events.backlog or self.events.flush(0.5)) and time.monotonic() < deadline:
            self.events.poll()
        assert self.events.backlog == 0 and self.events.dropped == 0 and self.events.failed == 0, (
            self.events.backlog,
            self.events.counts,
        )


def start(broker: Kafka) -> None:
    broker.process.start(broker.prepare())
    assert wait_until(broker.ready, 150, alive=broker.process.running), (
        f"throwaway Kafka did not start: {broker.process.tail(30)}"
    )


def kill(broker: Kafka) -> None:
    """SIGKILL the broker's process group and wait until it is gone."""
    pid = broker.process.pid()
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    assert wait_until(lambda: not broker.process.running(), 20)


def _free_run(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports (node n takes port + 2(n-1)
    and the controller port after it)."""
    for _ in range(50):
        base = free_port()
        if base + count < 65536 and not any(
            port_in_use("127.0.0.1", base + i) for i in range(count)
        ):
            return base
    raise RuntimeError(f"no {count} consecutive free ports")


@contextmanager
def private_cluster(
    tmp_path: Path, suffixes: tuple[str, ...], brokers: int, **settings: Any
) -> Iterator[tuple[Settings, list[Kafka]]]:
    """``brokers`` started nodes with ``suffixes``' topics; ``settings`` go into its
    Settings. The nodes start together (a quorum needs a majority), as ``stack up`` does."""
    cache = Settings().state_dir / "cache"
    if not any(cache.glob("kafka_*")):
        pytest.skip("no Kafka jars yet (loraplane stack up fetches them)")
    home = tmp_path / "home"
    home.mkdir()
    (home / "cache").symlink_to(cache)
    if brokers == 1:
        k = KafkaSettings(port=free_port(), controller_port=free_port())
    else:
        base = _free_run(2 * brokers)
        k = KafkaSettings(port=base, controller_port=base + 1, brokers=brokers)
    ours = Settings(home=home, kafka=k, **settings)
    nodes = kafka_nodes(ours)
    try:
        for node in nodes:
            node.process.start(node.prepare())
        for node in nodes:
            assert wait_until(node.ready, 150, alive=node.process.running), (
                f"throwaway {node.label} did not start: {node.process.tail(30)}"
            )
            node.after_start()
        for attempt in range(3):  # a fresh quorum may drop the first admin call
            try:
                topics.apply(ours, only=tuple(topics.spec(s) for s in suffixes))
                break
            except KafkaException:
                if attempt == 2:
                    raise
                time.sleep(2)
        yield ours, nodes
    finally:
        for node in nodes:
            node.process.stop(10)


@contextmanager
def private_kafka(
    tmp_path: Path, suffixes: tuple[str, ...], **settings: Any
) -> Iterator[tuple[Settings, Kafka]]:
    """A started broker with ``suffixes``' topics; ``settings`` go into its Settings."""
    with private_cluster(tmp_path, suffixes, 1, **settings) as (ours, [broker]):
        yield ours, broker
