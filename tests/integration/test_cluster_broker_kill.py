"""A 3-node cluster (``kafka.brokers`` 3: replication 3, min.insync.replicas 2) loses the
leader of the partition being written, SIGKILLed under steady event-sink load, and nothing
is lost: the same producer (never restarted) keeps going, what Kafka does not take in time
goes to the event spool and is replayed, and a consumer reads every event afterwards. A
cluster of the test's own (tmp home, free ports): never the shared stack."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, TopicPartition

from loraplane.eventlog.sink import KafkaEventSink
from loraplane.infra.kafka import Kafka
from loraplane.kernel import kafka, topics
from loraplane.kernel.config import Settings
from loraplane.schemas.codec import decode
from loraplane.schemas.request_log import RequestLog
from tests.integration.fault_report import report_fault
from tests.integration.private_kafka import SteadyLoad, kill, private_cluster

pytestmark = [pytest.mark.integration, pytest.mark.fault_long]

RATE_HZ = 50
BEFORE_S = 4.0
AFTER_KILL_S = 10.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Settings, list[Kafka]]]:
    with private_cluster(
        tmp_path, ("requests",), 3, topic_prefix=f"cluster-{uuid.uuid4().hex[:8]}"
    ) as found:
        yield found


def _rss_mb(node: Kafka) -> float:
    pid = node.process.pid()
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1]) / 1024


def _written_partition(settings: Settings, name: str) -> tuple[int, int]:
    """The partition our one key went to, and its leader (from the admin metadata)."""
    consumer = kafka.consumer(settings, f"probe-{uuid.uuid4()}", quiet=True)
    try:
        partitions = kafka.admin(settings).list_topics(name, timeout=10).topics[name].partitions
        for p in partitions.values():
            low, high = consumer.get_watermark_offsets(TopicPartition(name, p.id), timeout=10)
            if high > low:
                return p.id, p.leader
    finally:
        consumer.close()
    raise AssertionError("no partition holds the first events")


def _read_all(settings: Settings, name: str) -> Counter[str]:
    """Every event id on the topic, with how often it is there."""
    consumer = kafka.consumer(settings, f"reader-{uuid.uuid4()}", read_to_end=True, quiet=True)
    partitions = kafka.admin(settings).list_topics(name, timeout=10).topics[name].partitions
    consumer.assign([TopicPartition(name, p, 0) for p in partitions])
    seen: Counter[str] = Counter()
    at_end: set[int] = set()
    deadline = time.monotonic() + 60
    try:
        while len(at_end) < len(partitions) and time.monotonic() < deadline:
            msg = consumer.poll(1)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition())
                continue
            seen[decode(RequestLog, msg.value()).event_id] += 1
    finally:
        consumer.close()
    return seen


def test_a_leader_kill_loses_nothing(cluster: tuple[Settings, list[Kafka]]) -> None:
    settings, nodes = cluster
    name = topics.topic_name(settings, "requests")
    described = kafka.admin(settings).list_topics(name, timeout=10).topics[name]
    assert {len(p.replicas) for p in described.partitions.values()} == {3}
    events = KafkaEventSink(settings, "cluster-kill-test")
    delivered_at = [time.monotonic()]

    last = [0]

    def poll() -> None:
        """Serve reports; note when a new delivery arrives (for the longest gap)."""
        events.poll()
        if events.delivered != last[0]:
            last[0] = events.delivered
            delivered_at.append(time.monotonic())

    load = SteadyLoad(events, "c", RATE_HZ, poll)
    emit_for = load.run_for

    try:
        emit_for(BEFORE_S)
        partition, leader = _written_partition(settings, name)
        victim = next(node for node in nodes if node.node == leader)
        rss_mb = [_rss_mb(node) for node in nodes]
        t_kill = time.monotonic()
        kill(victim)
        emit_for(AFTER_KILL_S)
        emitted_at_end = load.n
        deadline = time.monotonic() + 45
        while (events.backlog or events.flush(0.2)) and time.monotonic() < deadline:
            poll()
        drained_s = time.monotonic() - t_kill
        gaps = [b - a for a, b in pairwise(delivered_at) if b > t_kill]
        longest_gap = max(gaps, default=0.0)
        assert events.backlog == 0 and events.dropped == 0 and events.failed == 0
        seen = _read_all(settings, name)
        after = kafka.admin(settings).list_topics(name, timeout=10).topics[name]
        new_leader = after.partitions[partition].leader
        print(
            f"3 brokers, leader {leader} of partition {partition} killed -9 under "
            f"{RATE_HZ}/s: {emitted_at_end} emitted ({events.delivered} delivered, "
            f"{events.counts.spooled} spooled, {events.counts.replayed} replayed), "
            f"{len(seen)} distinct read back ({sum(seen.values()) - len(seen)} duplicates); "
            f"no delivery for {longest_gap:.1f} s at most, new leader {new_leader}, "
            f"all delivered {drained_s:.1f} s after the kill; broker RSS before the kill "
            f"{'/'.join(f'{r:.0f}' for r in rss_mb)} MB"
        )
        assert len(seen) == emitted_at_end, (len(seen), emitted_at_end)
        assert set(seen) == {f"c{i}" for i in range(emitted_at_end)}
        assert new_leader not in (leader, -1)
        report_fault(
            "Kafka (3 brokers) partition leader SIGKILL under load",
            answered=emitted_at_end,
            stored=len(seen),
            lost=emitted_at_end - len(seen),
            duplicated=sum(seen.values()) - len(seen),
            recovered=True,
            down_s=longest_gap,
            recovery_s=drained_s,
            note=f"new leader {new_leader}; nothing restarted",
        )
    finally:
        events.close(5)
