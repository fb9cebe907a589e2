"""The metrics sink across rebalances (issue 19: it stalled for good after a broker
outage). A fake consumer with librdkafka's semantics that matter here: a partition's pause
flag survives a revoke and a re-assign, a (re)assigned partition starts at the committed
offset, and a paused partition returns nothing."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any

from clickhouse_driver import errors as ch_errors
from confluent_kafka import TopicPartition

from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.metrics.sink import Sink, SinkConfig, _Batch
from loraplane.schemas.codec import encode
from loraplane.schemas.request_log import RequestLog
from tests.kafka_message import FakeMessage

TP = tuple[str, int]


class FakeConsumer:
    def __init__(self, logs: dict[TP, list[bytes]]) -> None:
        self.logs = logs
        self.lock = threading.Lock()
        self.assigned: list[TP] = []
        self.paused: set[TP] = set()
        self.pos: dict[TP, int] = {}
        self.committed: dict[TP, int] = {}
        self.rebalances = 1  # the first consume joins the group
        self.on_assign: Any = None
        self.on_revoke: Any = None

    def subscribe(self, topics: list[str], on_assign: Any, on_revoke: Any) -> None:
        self.on_assign, self.on_revoke = on_assign, on_revoke

    def _tps(self, tps: list[TP]) -> list[TopicPartition]:
        return [TopicPartition(t, p) for t, p in tps]

    def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
        if self.rebalances:
            self.rebalances -= 1
            if self.assigned:
                self.on_revoke(self, self._tps(self.assigned))
                self.assigned = []
            self.on_assign(self, self._tps(sorted(self.logs)))
        out: list[FakeMessage] = []
        with self.lock:
            for tp in self.assigned:
                if tp in self.paused:
                    continue
                log = self.logs[tp]
                while self.pos[tp] < len(log) and len(out) < num_messages:
                    out.append(
                        FakeMessage(log[self.pos[tp]], t=tp[0], part=tp[1], off=self.pos[tp])
                    )
                    self.pos[tp] += 1
        if not out:
            time.sleep(min(timeout, 0.005))
        return out

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned = [(tp.topic, tp.partition) for tp in partitions]
        for tp in self.assigned:
            self.pos[tp] = self.committed.get(tp, 0)

    def assignment(self) -> list[TopicPartition]:
        return self._tps(self.assigned)

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused |= {(tp.topic, tp.partition) for tp in partitions}

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused -= {(tp.topic, tp.partition) for tp in partitions}

    def seek(self, tp: TopicPartition) -> None:
        self.pos[(tp.topic, tp.partition)] = tp.offset

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        for tp in offsets:
            self.committed[(tp.topic, tp.partition)] = tp.offset

    def close(self) -> None:
        pass


class FlakySink(Sink):
    """Writes rows into a dict by event id (ClickHouse's ReplacingMergeTree under FINAL);
    ``failures`` writes raise a network error first, and ``during_failure`` runs at the
    first of them (the test's rebalance)."""

    def __init__(self, consumer: FakeConsumer, failures: int) -> None:
        super().__init__(
            Settings(),
            SinkConfig(batch_size=50, max_wait_s=0.02, backoff_initial_s=0.05, backoff_max_s=0.1),
        )
        self.fake = consumer
        self.failures = failures
        self.stored: dict[str, int] = {}
        self.writes = 0

    def _consumer(self) -> Any:
        self.fake.subscribe([], on_assign=self._on_assign, on_revoke=self._on_revoke)
        return self.fake

    def _write(self, batch: _Batch) -> None:
        self.writes += 1
        if self.failures > 0:
            self.failures -= 1
            self.fake.rebalances += 1  # a broker restart moves the coordinator: rebalance
            raise ch_errors.NetworkError("clickhouse away")
        for rows in batch.rows.values():
            for row in rows.rows:
                self.stored[row[0]] = self.stored.get(row[0], 0) + 1
        self.stats.rows += sum(len(r) for r in batch.rows.values())


def _log(n: int, start: int = 0) -> list[bytes]:
    return [
        encode(
            RequestLog(
                event_id=f"e{i}",
                ts=datetime(2026, 1, 1, tzinfo=UTC),
                request_id=f"r{i}",
                tenant_id="t",
                base_model="m",
                adapter_id="a",
                adapter_version="1",
                worker_id="w",
                tier_at_arrival="gpu",
                ttft_ms=1.0,
            )
        )
        for i in range(start, start + n)
    ]


def _run_until(sink: FlakySink, done: Any, timeout: float = 10.0) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=sink.run, args=(stop,), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()


def test_a_rebalance_during_a_backoff_does_not_leave_partitions_paused() -> None:
    topic = topic_name(Settings(), "requests")
    logs = {(topic, 0): _log(30), (topic, 1): _log(30, 30)}
    consumer = FakeConsumer(logs)
    sink = FlakySink(consumer, failures=2)
    first_done = threading.Event()

    def more_arrives() -> bool:
        # after the failed writes, new messages arrive: they must still be consumed
        if sink.failures == 0 and not first_done.is_set():
            first_done.set()
            with consumer.lock:
                logs[(topic, 0)] += _log(20, 60)
                logs[(topic, 1)] += _log(20, 80)
        return consumer.committed == {(topic, 0): 50, (topic, 1): 50}

    _run_until(sink, more_arrives)
    assert sink.writes >= 3 and sink.stats.retries >= 1
    assert consumer.committed == {(topic, 0): 50, (topic, 1): 50}, consumer.committed
    assert not consumer.paused
    assert set(sink.stored) == {f"e{i}" for i in range(100)}  # every row, none skipped


def test_messages_read_while_backing_off_after_a_rebalance_are_read_again() -> None:
    """The rebalance resumes the partitions at once, so the backoff's polls fetch
    messages; they must be rewound, not dropped (their offsets get committed later)."""
    topic = topic_name(Settings(), "requests")
    logs = {(topic, 0): _log(200)}  # more than one batch: some remain to be fetched
    consumer = FakeConsumer(logs)
    sink = FlakySink(consumer, failures=1)
    _run_until(sink, lambda: consumer.committed.get((topic, 0)) == 200)
    assert consumer.committed == {(topic, 0): 200}
    assert set(sink.stored) == {f"e{i}" for i in range(200)}
    assert not consumer.paused
