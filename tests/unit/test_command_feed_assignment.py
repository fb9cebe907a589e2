"""The worker's command feed reads its one partition by assignment (workers/command_feed.py):
which partitions it assigns as the topic's count changes, what it counts as read, and that
a collision (another worker's key in its partition) is still dropped and committed past."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplane.kernel import kafka
from loraplane.kernel.command_partition import DRAIN_S, partition_of
from loraplane.kernel.config import Settings
from loraplane.schemas.keyring import KeyringFile
from loraplane.workers.command_feed import Assignment, CommandSlotError, KafkaCommandFeed
from loraplane.workers.worker_metrics import CommandBytesMetrics, WorkerMetrics
from tests.kafka_message import AssignedConsumer, FakeMessage


@dataclass
class Consumer(AssignedConsumer):
    pending: list[FakeMessage] = field(default_factory=list)
    commits: list[FakeMessage] = field(default_factory=list)
    configs: list[dict[str, object]] = field(default_factory=list)

    def poll(self, timeout: float) -> FakeMessage | None:
        return self.pending.pop(0) if self.pending else None

    def commit(self, message: FakeMessage, asynchronous: bool) -> None:
        self.commits.append(message)


class Sink:
    def emit(self, topic_suffix: str, key: str, message: object) -> None:
        pass


def _feed(
    monkeypatch: pytest.MonkeyPatch,
    consumer: Consumer,
    worker_id: str = "w1",
    slot: int | None = None,
) -> KafkaCommandFeed:
    def make(*args: object, **kwargs: object) -> Consumer:
        consumer.configs.append(dict(kwargs))
        return consumer

    monkeypatch.setattr(kafka, "consumer", make)
    return KafkaCommandFeed(
        Settings(),
        worker_id,
        Sink(),  # type: ignore[arg-type]
        keyring=KeyringFile(Path("/nonexistent")),
        slot=slot,
    )


def test_the_feed_assigns_its_own_partition_of_the_brokers_count_and_joins_no_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    consumer = Consumer()
    consumer.partitions = 64
    feed = _feed(monkeypatch, consumer)
    assert consumer.assigned == {partition_of("w1", 64)} == {15}
    assert "static_member" not in consumer.configs[0]  # nothing to re-join: no membership
    assert feed.assignment.own == 15


def test_a_grown_topic_adds_the_new_partition_and_drops_the_old_after_the_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    consumer = Consumer()
    consumer.partitions = 6
    feed = _feed(monkeypatch, consumer)
    old, new = partition_of("w1", 6), partition_of("w1", 64)
    assert consumer.assigned == {old}
    feed.regroup(64, now=100.0)
    assert consumer.assigned == {old, new}  # a command sent by the old count is still read
    feed.regroup(64, now=100.0 + DRAIN_S - 1)
    assert consumer.assigned == {old, new}
    feed.regroup(64, now=100.0 + DRAIN_S)
    assert consumer.assigned == {new}


def test_a_slotted_feed_reads_its_slot_and_does_not_move_when_the_topic_grows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    consumer = Consumer()
    consumer.partitions = 8
    feed = _feed(monkeypatch, consumer, slot=5)
    assert consumer.assigned == {5} and feed.partition == 5
    assert partition_of("w1", 8) != 5  # not the hash
    feed.regroup(64, now=100.0)
    feed.regroup(64, now=100.0 + DRAIN_S)
    assert consumer.assigned == {5} and feed.partition == 5


def test_a_slot_the_topic_has_no_partition_for_stops_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    consumer = Consumer()
    consumer.partitions = 8
    with pytest.raises(CommandSlotError, match=r"command slot 8 needs .* it has 8 \("):
        _feed(monkeypatch, consumer, slot=8)
    assert consumer.closed


def test_a_slot_is_trusted_while_the_broker_cannot_say_and_checked_once_it_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fleet grown past the declared 64 partitions must not fail its starts because one
    metadata call timed out: the slot is read at once and checked when the broker answers
    (seen in bench.fleet_scale at 200 workers under load)."""
    consumer = Consumer()
    consumer.partitions = 0  # the broker does not answer: no metadata
    feed = _feed(monkeypatch, consumer, slot=110)
    assert consumer.assigned == {110} and feed.partition == 110
    assert feed._checked == 0.0  # asks again at the next poll
    feed.regroup(200, now=1.0)  # the broker's answer: the slot exists
    assert consumer.assigned == {110}
    feed.regroup(100, now=2.0)  # a broker that says otherwise: held up, said out loud
    assert "command slot 110 has no partition" in feed.progress._why


def test_the_periodic_check_follows_the_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    consumer = Consumer()
    consumer.partitions = 6
    feed = _feed(monkeypatch, consumer)
    consumer.partitions = 64
    feed._checked = 0.0  # the last check is long ago
    assert asyncio.run(feed.next(0)) is None
    assert consumer.assigned == {partition_of("w1", 6), partition_of("w1", 64)}


@given(
    st.text(min_size=1, max_size=20),
    st.lists(st.integers(min_value=1, max_value=200), min_size=1, max_size=6),
)
def test_the_own_partition_is_always_assigned_and_drains_end(
    worker_id: str, counts: list[int]
) -> None:
    a = Assignment(worker_id, counts[0])
    assigned = set(a.assigned())
    now = 0.0
    for count in counts[1:]:
        now += 1.0
        add, drop = a.observe(count, now)
        assigned = (assigned - set(drop)) | set(add)
        assert assigned == set(a.assigned())
        assert a.own == partition_of(worker_id, count) and a.own in assigned
        assert all(p < count for p in assigned)
    add, drop = a.observe(a.partitions, now + DRAIN_S)
    assert (add, a.assigned()) == ([], [a.own])


def test_read_bytes_count_own_and_others_and_others_are_dropped_and_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    own_partition = partition_of("w1", 6)
    mine = FakeMessage(b"x" * 10, b"w1", "lp.commands", own_partition, 0)
    other = FakeMessage(b"y" * 30, b"w2", "lp.commands", own_partition, 1)  # w2 hashes alike
    consumer = Consumer(pending=[mine, other])
    consumer.partitions = 6
    feed = _feed(monkeypatch, consumer)
    assert asyncio.run(feed.next(0)) is None  # mine: undecodable, dead-lettered
    assert asyncio.run(feed.next(0)) is None
    assert (feed.read_bytes.own, feed.read_bytes.other) == (12, 32)
    assert consumer.commits == [mine, other]
    metrics = WorkerMetrics()
    metrics.registry.register(CommandBytesMetrics(feed.read_bytes))
    text = metrics.exposition().decode()
    assert 'loraplane_commands_read_bytes_total{own="true"} 12.0' in text
    assert 'loraplane_commands_read_bytes_total{own="false"} 32.0' in text
