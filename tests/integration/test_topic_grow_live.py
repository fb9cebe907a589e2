"""A compacted topic grown under its readers and writers, on the real broker
(``topics apply`` with a larger count): a live tail (kernel/topic_tail.py) reads the
partitions added after its start, from their beginning, without reading again what it had."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from loraplane.kernel import kafka, topics
from loraplane.kernel.bus import Record
from loraplane.kernel.command_partition import partition_of
from loraplane.kernel.config import Settings
from loraplane.kernel.topic_tail import TopicTail
from tests.integration.metrics_env import isolated
from tests.integration.registry_env import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

OLD, NEW = 3, 6  # the worker-state topic's partitions before and after the grow


@pytest.fixture
def settings(stack: Settings) -> Iterator[Settings]:
    settings = isolated(stack)
    topics.apply(settings, only=(dataclasses.replace(topics.spec("worker-state"), partitions=OLD),))
    _wait_partitions(settings, OLD)  # a topic just made is not in every metadata answer yet
    try:
        yield settings
    finally:
        admin = kafka.admin(settings)
        with contextlib.suppress(Exception):
            name = topics.topic_name(settings, "worker-state")
            for future in admin.delete_topics([name], operation_timeout=20).values():
                future.result(timeout=30)


def _topic(settings: Settings) -> str:
    return topics.topic_name(settings, "worker-state")


def _wait_partitions(settings: Settings, count: int) -> None:
    admin, topic = kafka.admin(settings), _topic(settings)
    wait_for(
        lambda: (
            True
            if len(admin.list_topics(topic, timeout=5).topics[topic].partitions) == count
            else None
        ),
        f"{topic} with {count} partitions",
        timeout_s=30,
    )


def _grow(settings: Settings) -> None:
    topics.apply(settings, only=(dataclasses.replace(topics.spec("worker-state"), partitions=NEW),))
    _wait_partitions(settings, NEW)


def _moved_key(prefix: str) -> str:
    """A key whose home under the new count is one of the added partitions."""
    return next(k for n in range(10_000) if partition_of(k := f"{prefix}{n}", NEW) >= OLD)


def test_a_tail_reads_the_partitions_added_after_its_start(settings: Settings) -> None:
    """A tail caught up on 3 partitions; the topic grows to 6; a record keyed onto a new
    partition (a fresh producer hashes over 6) is read, placed under the new count, and no
    record of the old partitions is handed over twice."""
    topic = _topic(settings)
    producer = kafka.producer(settings, quiet=True)
    for p in range(OLD):
        producer.produce(topic, key=f"old{p}".encode(), value=b"before", partition=p)
    assert producer.flush(30) == 0
    seen: list[Record] = []
    tail = TopicTail(
        settings, topic, component="test-grow", on_record=seen.append, probe_every_s=1.0
    ).start()
    try:
        assert tail.wait_read_to(tail.ends(), 60)
        assert len(seen) == OLD
        _grow(settings)
        fresh = kafka.producer(settings, quiet=True)  # its first metadata says 6
        key = _moved_key("w")
        fresh.produce(topic, key=key.encode(), value=b"after")
        fresh.produce(topic, key=b"old0", value=b"after", partition=0)
        assert fresh.flush(30) == 0
        written = time.monotonic()
        got = wait_for(
            lambda: next((r for r in tail.snapshot() if r.key == key.encode()), None),
            f"{key} on partition {partition_of(key, NEW)}",
            timeout_s=30,
        )
        print(f"read {time.monotonic() - written:.2f}s after it was written")
        assert got.partition == partition_of(key, NEW) >= OLD
        assert tail.placed(got) == (got.partition, NEW)
        assert tail.wait_read_to(tail.ends(), 30)
        handed = Counter((r.partition, r.offset) for r in seen)
        assert len(seen) == OLD + 2 and max(handed.values()) == 1  # nothing read twice
        assert tail.current()
    finally:
        tail.stop()
