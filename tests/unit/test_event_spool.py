"""The event sink's durable spool (issue #19, item 1): events the broker did not take are kept
on disk and replayed in order; beyond the bound they are counted, never lost silently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from loraplane.eventlog.sink import KafkaEventSink, SinkMetrics
from loraplane.eventlog.spool import EventSpool, SpoolUnavailable
from loraplane.kernel import kafka
from loraplane.kernel.config import Settings
from loraplane.schemas.audit import AuditRecord


class Msg:
    def __init__(self, topic: str, key: bytes | None, value: bytes) -> None:
        self._t, self._k, self._v = topic, key, value

    def topic(self) -> str:
        return self._t

    def key(self) -> bytes | None:
        return self._k

    def value(self) -> bytes:
        return self._v


class Broker:
    """librdkafka as the sink sees it: a bounded queue whose reports are errors while the
    broker is away (``message.timeout.ms`` is compressed to the next poll)."""

    def __init__(self, queue_limit: int = 50) -> None:
        self.up = True
        self.queue: list[tuple[Msg, Any]] = []
        self.log: list[bytes] = []  # values the broker acknowledged, in order
        self.queue_limit = queue_limit

    def produce(
        self, topic: str, key: Any = None, value: bytes = b"", on_delivery: Any = None
    ) -> None:
        if len(self.queue) >= self.queue_limit:
            raise BufferError("queue full")
        k = key.encode() if isinstance(key, str) else key
        self.queue.append((Msg(topic, k, value), on_delivery))

    def poll(self, _timeout: float = 0) -> int:
        queue, self.queue = self.queue, []
        for msg, cb in queue:
            if self.up:
                self.log.append(msg.value())
                cb(None, msg)
            else:
                cb(KafkaError(KafkaError._MSG_TIMED_OUT), msg)
        return len(queue)

    def flush(self, _timeout: float = 0) -> int:
        self.poll()
        return len(self.queue)

    def purge(self, in_queue: bool = True, in_flight: bool = True) -> None:
        queue, self.queue = self.queue, []
        for msg, cb in queue:
            cb(KafkaError(KafkaError._PURGE_QUEUE), msg)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def event(n: int) -> AuditRecord:
    return AuditRecord.model_validate(
        {
            "event_id": f"e{n}",
            "ts": "2026-12-01T00:00:00Z",
            "component": "cli",
            "action": "test",
            "decision": "applied",
            "detail": str(n),
        }
    )


def sink_on(
    broker: Broker,
    home: Path,
    monkeypatch: pytest.MonkeyPatch,
    clock: Clock,
    max_bytes: int = 10_000_000,
) -> KafkaEventSink:
    monkeypatch.setattr(kafka, "producer", lambda *a, **k: broker)
    s = Settings(home=home, spool_max_bytes=max_bytes)
    return KafkaEventSink(s, "w1", clock=clock)


def details(values: list[bytes]) -> list[int]:
    return [int(AuditRecord.model_validate_json(v).detail) for v in values]


def drain(sink: KafkaEventSink, clock: Clock, rounds: int = 200) -> None:
    for _ in range(rounds):
        clock.t += 3
        sink.poll()
        if not sink.backlog and not sink._producer.queue:  # type: ignore[attr-defined]
            sink.poll()
            return
    raise AssertionError(f"spool not drained: {sink.backlog} left")


def step(op: str, sink: KafkaEventSink, broker: Broker, clock: Clock, n: int) -> int:
    """One operation of a property test (emit event ``n``, poll, the broker down or up, the
    clock on); the number of the next event."""
    if op == "emit":
        sink.emit("audit", f"k{n % 3}", event(n))
        return n + 1
    if op == "poll":
        sink.poll()
    elif op in ("down", "up"):
        broker.up = op == "up"
    else:
        clock.t += 1
    return n


# ---- the spool on its own ---------------------------------------------------------------------
def test_spool_keeps_order_across_segments_and_restarts(tmp_path: Path) -> None:
    spool = EventSpool(tmp_path / "s", 10**9, segment_bytes=300)
    for i in range(40):
        assert spool.append("t", f"k{i}".encode(), f"v{i}".encode())
    head = spool.peek(15)
    assert [e.value for e in head] == [f"v{i}".encode() for i in range(15)]
    spool.commit(head)
    spool.close()
    again = EventSpool(tmp_path / "s", 10**9, segment_bytes=300)
    assert again.records == 25
    rest = again.peek(100)
    assert [e.value for e in rest] == [f"v{i}".encode() for i in range(15, 40)]
    assert [e.key for e in rest][:1] == [b"k15"]
    again.commit(rest)
    assert again.records == again.bytes == 0
    assert not list((tmp_path / "s").glob("*.spool"))


def test_a_torn_last_line_is_cut_and_the_rest_replayed(tmp_path: Path) -> None:
    spool = EventSpool(tmp_path / "s", 10**9)
    for i in range(3):
        spool.append("t", None, f"v{i}".encode())
    spool.close()
    segment = next((tmp_path / "s").glob("*.spool"))
    with segment.open("ab") as fh:
        fh.write(b'{"t":"t","k":null,"v":"dj')  # a crash mid-write
    again = EventSpool(tmp_path / "s", 10**9)
    assert [e.value for e in again.peek(10)] == [b"v0", b"v1", b"v2"]
    again.append("t", None, b"v3")
    assert [e.value for e in again.peek(10)][-1] == b"v3"


def test_a_cursor_or_line_nested_past_the_recursion_limit_is_read_as_damage(
    tmp_path: Path,
) -> None:
    """A cursor or a spooled line that is JSON nested past the recursion limit (a damaged
    file) reads as one torn line or no cursor, never a RecursionError out of the sink."""
    from loraplane.eventlog.spool import CURSOR_FILE

    spool = EventSpool(tmp_path / "s", 10**9)
    for i in range(2):
        spool.append("t", None, f"v{i}".encode())
    spool.close()
    deep = b"[" * 100_000 + b"]" * 100_000
    (tmp_path / "s" / CURSOR_FILE).write_bytes(deep)
    segment = next((tmp_path / "s").glob("*.spool"))
    with segment.open("ab") as fh:
        fh.write(deep)
    again = EventSpool(tmp_path / "s", 10**9)
    assert [e.value for e in again.peek(10)] == [b"v0", b"v1"]


def test_the_spool_refuses_past_its_bound_and_a_second_process(tmp_path: Path) -> None:
    spool = EventSpool(tmp_path / "s", 200)
    taken = sum(spool.append("t", None, b"x" * 40) for _ in range(10))
    assert 0 < taken < 10 and spool.bytes <= 200
    with pytest.raises(SpoolUnavailable, match="in use"):
        EventSpool(tmp_path / "s", 200)


# ---- the sink over an outage --------------------------------------------------------------------
def test_an_outage_loses_nothing_and_keeps_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker, clock = Broker(), Clock()
    sink = sink_on(broker, tmp_path, monkeypatch, clock)
    for i in range(10):
        sink.emit("audit", "k", event(i))
    sink.poll()
    broker.up = False
    for i in range(10, 200):  # past librdkafka's queue: BufferError goes to the spool too
        sink.emit("audit", "k", event(i))
        if i % 7 == 0:
            sink.poll()
    sink.poll()
    assert sink.backlog == 190 and sink.dropped == 0
    broker.up = True
    drain(sink, clock)
    assert details(broker.log) == list(range(200))
    assert sink.counts.replayed == 190 and sink.backlog == 0


def test_a_stop_during_an_outage_spools_the_queue_for_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker, clock = Broker(), Clock()
    broker.up = False
    sink = sink_on(broker, tmp_path, monkeypatch, clock)
    broker.poll = lambda _t=0: 0  # type: ignore[method-assign]  # the timeout not yet reached
    for i in range(30):
        sink.emit("audit", "k", event(i))
    assert sink.backlog == 0 and len(broker.queue) == 30
    assert sink.close(0.1) == 30  # releases the spool's lock: a new sink may open it
    broker2 = Broker()
    restarted = sink_on(broker2, tmp_path, monkeypatch, clock)
    assert restarted.backlog == 30
    drain(restarted, clock)
    assert details(broker2.log) == list(range(30))


def test_past_the_bound_events_are_counted_and_exported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broker, clock = Broker(), Clock()
    broker.up = False
    sink = sink_on(broker, tmp_path, monkeypatch, clock, max_bytes=3000)
    for i in range(100):
        sink.emit("audit", "k", event(i))
        sink.poll()
    assert sink.dropped > 0 and sink.dropped + sink.backlog == 100
    assert "events dropped so far by w1" in caplog.text
    registry = CollectorRegistry()
    registry.register(SinkMetrics(sink))
    text = generate_latest(registry).decode()
    assert f'loraplane_event_sink_dropped_total{{client="w1"}} {float(sink.dropped)}' in text
    assert f'loraplane_event_sink_spool_events{{client="w1"}} {float(sink.backlog)}' in text
    broker.up = True
    drain(sink, clock)
    kept = details(broker.log)
    assert kept == sorted(kept) and len(kept) == 100 - sink.dropped


def test_a_healthy_broker_never_spools_and_leaves_no_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker, clock = Broker(), Clock()
    sink = sink_on(broker, tmp_path, monkeypatch, clock)
    for i in range(50):
        sink.emit("audit", "k", event(i))
        sink.poll()
    assert sink.delivered == 50 and sink.journal_pending == 0
    assert not list((tmp_path / "spool").rglob("*.spool"))
    sink.close(1.0)
    assert not list((tmp_path / "spool").rglob("*.journal"))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(["emit", "emit", "emit", "poll", "down", "up", "tick"]), max_size=120)
)
def test_any_outage_pattern_delivers_every_event_once_in_order(ops: list[str]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        broker, clock = Broker(queue_limit=5), Clock()
        sink = sink_on(broker, Path(tmp), mp, clock)
        n = 0
        for op in ops:
            n = step(op, sink, broker, clock, n)
        broker.up = True
        drain(sink, clock)
        assert details(broker.log) == list(range(n))
        assert sink.dropped == 0 and sink.delivered == n
