"""A compacted topic grown under its readers and writers, on the real broker
(``topics apply`` with a larger count): a live tail (kernel/topic_tail.py) reads the
partitions added after its start, from their beginning, without reading again what it had;
and a worker's state producer (the event sink) hashes its key over the new count within
``kafka.METADATA_REFRESH_MS``, so readers that know only the new count (``fleet status``, a
router started after the grow) refuse its states as off their partition only that long."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest

from loraplane.eventlog.sink import KafkaEventSink
from loraplane.kernel import kafka, topics
from loraplane.kernel.bus import MOVED_HEADER, Record, moved_away, read_topic
from loraplane.kernel.command_partition import partition_of
from loraplane.kernel.config import Settings
from loraplane.kernel.topic_tail import TopicTail
from loraplane.kernel.worker_states import clear_left_behind, latest_fleet_states
from loraplane.router.routing import FleetIndex
from loraplane.router.server import Fleet
from loraplane.schemas.base import now_utc
from loraplane.schemas.worker_state import WorkerState
from tests.integration.metrics_env import isolated
from tests.integration.registry_env import wait_for, wait_partitions

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

OLD, NEW = 3, 6  # the worker-state topic's partitions before and after the grow


@pytest.fixture
def settings(stack: Settings) -> Iterator[Settings]:
    settings = isolated(stack)
    small = dataclasses.replace(topics.spec("worker-state"), partitions=OLD)
    topics.apply(settings, only=(small, topics.spec("router-state")))
    wait_partitions(settings, "worker-state", OLD)
    try:
        yield settings
    finally:
        admin = kafka.admin(settings)
        with contextlib.suppress(Exception):
            names = [topics.topic_name(settings, t) for t in ("worker-state", "router-state")]
            for future in admin.delete_topics(names, operation_timeout=20).values():
                future.result(timeout=30)


def _topic(settings: Settings) -> str:
    return topics.topic_name(settings, "worker-state")


def _grow(settings: Settings, clear: bool = True) -> list[topics.Change]:
    """``topics apply`` with the topic's count grown; ``clear=False``: as a topic whose
    readers take records off their home (nothing left behind is tombstoned)."""
    grown = dataclasses.replace(topics.spec("worker-state"), partitions=NEW, clear_on_grow=clear)
    changes = topics.apply(settings, only=(grown,), clear_grown=clear_left_behind)
    wait_partitions(settings, "worker-state", NEW)
    return changes


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
        _grow(settings, clear=False)
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


def _state(worker_id: str) -> WorkerState:
    return WorkerState(
        worker_id=worker_id,
        base_model="b",
        ts=now_utc(),
        gpu_slots_used=0,
        gpu_slots_total=4,
        host_bytes_used=0,
        host_bytes_budget=10**9,
        max_lora_rank=16,
    )


def test_a_workers_states_reach_their_new_partition_soon_after_a_grow(
    settings: Settings,
) -> None:
    """A worker beating every 0.5 s through its event sink (the agent's producer) while the
    topic grows from 3 to 6: a tail started after the grow (a fresh router, knowing only 6)
    gets the worker's first state on its new partition within ``METADATA_REFRESH_MS`` and a
    beat, and ``latest_fleet_states`` (``fleet status``) then has the worker. librdkafka's
    default refresh kept the old count 299.8 s (measured), so fresh readers refused every
    state as ``wrong_partition`` and had no such worker for 5 minutes."""
    topic = _topic(settings)
    worker = _moved_key("w")
    sink = KafkaEventSink(settings, f"test-grow-{uuid.uuid4().hex[:8]}")
    try:
        sink.emit("worker-state", worker, _state(worker))
        assert sink.flush(20) == 0
        assert worker in latest_fleet_states(settings).workers
        _grow(settings)
        grown = time.monotonic()
        at_home: list[float] = []

        def arrived(record: Record) -> None:
            if record.key == worker.encode() and record.partition == partition_of(worker, NEW):
                at_home.append(time.monotonic())

        tail = TopicTail(settings, topic, component="test-fresh", on_record=arrived).start()
        try:
            while not at_home and time.monotonic() - grown < 60:
                sink.emit("worker-state", worker, _state(worker))
                sink.poll()
                time.sleep(0.5)
        finally:
            tail.stop()
        assert at_home, "no state on the worker's new partition within 60 s"
        window = at_home[0] - grown
        print(f"the worker's states reached its new partition {window:.1f}s after the grow")
        assert window < kafka.METADATA_REFRESH_MS / 1000 + 5.0
        assert sink.flush(20) == 0
        fleet = latest_fleet_states(settings)
        assert worker in fleet.workers
        # the sink left a tombstone on the worker's old partition: what the grow left there
        # is cleared (compaction removes it), not a malformed state at every fresh read
        assert fleet.malformed == 0
        old = partition_of(worker, OLD)
        moved = [
            r
            for r in read_topic(settings, topic, timeout_s=20, to_end=True)
            if r.key == worker.encode() and moved_away(r)
        ]
        # by `topics apply` and by the sink once its state moved
        assert moved and {(r.partition, r.headers[MOVED_HEADER]) for r in moved} == {
            (old, str(partition_of(worker, NEW)).encode())
        }
        # a router that read the topic across the grow places it at home under the old count:
        # the tombstone still removes nothing, and is no dead letter
        letters = _Letters()
        router = Fleet(FleetIndex(settings.policy, 5.0), letters, "router-t")
        router.forget = lambda wid: pytest.fail(f"{wid} forgotten")  # type: ignore[method-assign]
        router.take(moved[0], (old, OLD))
        assert router.dead_lettered == 0 and not letters.sent
    finally:
        sink.close()


class _Letters:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def emit(self, topic_suffix: str, key: str, message: object) -> None:
        self.sent.append(message)


def test_what_a_grow_left_behind_is_compacted_away(settings: Settings) -> None:
    """The worker-state topic compacts within ``max_compaction_lag_ms`` (an hour; 2 s here):
    once a worker's sink left its tombstone on the old partition, the state left there is
    gone at the broker's next clean while other workers beat on that partition, and a
    router started then reads no such state (no ``wrong_partition`` dead letter per start,
    as long as the broker kept it: the default lag never forces a clean)."""
    topic = _topic(settings)
    worker = _moved_key("w")
    old = partition_of(worker, OLD)
    stayer = next(  # beats on the old partition under both counts
        k for n in range(10_000) if partition_of(k := f"s{n}", OLD) == partition_of(k, NEW) == old
    )
    sink = KafkaEventSink(settings, f"test-grow-{uuid.uuid4().hex[:8]}")
    try:
        sink.emit("worker-state", worker, _state(worker))
        assert sink.flush(20) == 0
        short = dataclasses.replace(
            topics.spec("worker-state"), partitions=NEW, max_compaction_lag_ms=2000
        )
        changes = topics.apply(settings, only=(short,))
        assert {c.action for c in changes} == {"partitions", "config"}
        wait_partitions(settings, "worker-state", NEW)
        started = time.monotonic()

        def left_behind() -> bool | None:
            for key in (worker, stayer):
                sink.emit("worker-state", key, _state(key))
            sink.flush(5)
            read = list(read_topic(settings, topic, timeout_s=20, to_end=True))
            kept = [r for r in read if r.key == worker.encode() and r.partition == old]
            return True if kept and all(moved_away(r) for r in kept) else None

        wait_for(left_behind, "the old partition cleared of the worker's state", timeout_s=150)
        print(f"the grow's leftover compacted away {time.monotonic() - started:.1f}s after it")
        letters = _Letters()
        router = Fleet(FleetIndex(settings.policy, 5.0), letters, "router-t")
        for record in read_topic(settings, topic, timeout_s=20, to_end=True):
            router.take(record, (record.partition, NEW))
        assert router.dead_lettered == 0 and not letters.sent
    finally:
        sink.close()


def test_a_grow_clears_the_states_of_workers_not_running(settings: Settings) -> None:
    """A worker retired (or stopped) before the grow never writes again: its last state,
    off its home under the new count, was refused by every fresh reader for ever
    (``fleet status``: malformed; a router: a dead letter per start). ``topics apply``
    tombstones it where it lies (``topics.clear_left_behind``)."""
    topic = _topic(settings)
    gone = _moved_key("retired")
    kept = next(k for n in range(10_000) if partition_of(k := f"k{n}", OLD) == partition_of(k, NEW))
    producer = kafka.producer(settings, quiet=True)  # hashes over 3
    for key in (gone, kept):
        producer.produce(topic, key=key.encode(), value=_state(key).model_dump_json().encode())
    assert producer.flush(20) == 0
    changes = _grow(settings)
    assert [c.detail for c in changes if c.action == "partitions"] == [
        f"partitions {OLD} -> {NEW}; 1 left behind cleared"
    ]
    fleet = latest_fleet_states(settings)
    assert fleet.malformed == 0 and set(fleet.workers) == {kept}
    letters = _Letters()
    router = Fleet(FleetIndex(settings.policy, 5.0), letters, "router-t")
    for record in read_topic(settings, topic, timeout_s=20, to_end=True):
        if moved_away(record):
            assert record.partition == partition_of(gone, OLD) and record.key == gone.encode()
        router.take(record, (record.partition, NEW))
    assert router.dead_lettered == 1  # the state itself until compaction (within the hour)
