"""A throwaway Kafka of a test's own (tmp home, free ports, started through
loraplane.infra.kafka like the stack's), for tests that kill and restart the broker: never
the shared one."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from loraplane.infra.kafka import Kafka
from loraplane.infra.processes import free_port, wait_until

from loraplane.kernel import topics
from loraplane.kernel.config import KafkaSettings, Settings


def start(broker: Kafka) -> None:
    broker.process.start(broker.prepare())
    assert wait_until(broker.ready, 150, alive=broker.process.running), \
        f"throwaway Kafka did not start: {broker.process.tail(30)}"


def kill(broker: Kafka) -> None:
    """SIGKILL the broker's process group and wait until it is gone."""
    pid = broker.process.pid()
    assert pid is not None
    os.killpg(pid, signal.SIGKILL)
    assert wait_until(lambda: not broker.process.running(), 20)


@contextmanager
def private_kafka(tmp_path: Path, suffixes: tuple[str, ...],
                  **settings: Any) -> Iterator[tuple[Settings, Kafka]]:
    """A started broker with ``suffixes``' topics; ``settings`` go into its Settings."""
    cache = Settings().state_dir / "cache"
    if not any(cache.glob("kafka_*")):
        pytest.skip("no Kafka jars yet (loraplane stack up fetches them)")
    home = tmp_path / "home"
    home.mkdir()
    (home / "cache").symlink_to(cache)
    k = KafkaSettings(port=free_port(), controller_port=free_port())
    ours = Settings(home=home, kafka=k, **settings)
    broker = Kafka(ours)
    start(broker)
    try:
        broker.after_start()
        topics.apply(ours, only=tuple(topics.spec(s) for s in suffixes))
        yield ours, broker
    finally:
        broker.process.stop(10)
