"""Attack tests: values the wire schemas accept but ClickHouse 18.16's columns cannot hold.

Each must cost the sink one dead letter naming the value (``out_of_range``), never a stall,
a crash, or the rows beside it. The client here packs timestamps as clickhouse-driver does
for a ``DateTime`` column (struct "I") and refuses what does not fit the same way."""

from __future__ import annotations

import struct
from datetime import UTC, datetime
from typing import Any

import pytest
from clickhouse_driver import errors as ch_errors
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.metrics.sink import Sink, SinkConfig
from loraplane.metrics.tables import TABLES, encoders_for, timestamp_encoder
from loraplane.schemas.cache_event import CacheEventKind
from loraplane.schemas.codec import encode
from loraplane.schemas.dead_letter import STAMP_END, STAMP_MIN, dead_letter_at
from loraplane.schemas.reasons import ConsumerFault, DecodeReason
from tests.kafka_message import FakeMessage
from tests.pack_cases import cache
from tests.wire_strategies import T0, raw_of, whole

REQUESTS = next(t for t in TABLES if t.name == "request_log")
DEAD = next(t for t in TABLES if t.name == "dead_letters")
SECONDS = timestamp_encoder("DateTime")

OUT_OF_DATETIME = [
    "1900-01-01T00:00:00Z",
    "1969-12-31T23:59:59Z",
    "2106-02-07T00:00:00Z",  # in UInt32, but 18.16 reads it back as 1970-01-01
    "2106-02-07T06:28:16Z",  # 2**32 seconds: one past UInt32
    "2200-01-01T00:00:00Z",
    "9999-12-31T23:59:59Z",
]


class PackingClient:
    """Inserts as clickhouse-driver packs a ``DateTime`` column: a value outside UInt32 is
    its ``TypeMismatchError``. Counts the inserts tried."""

    def __init__(self) -> None:
        self.tries = 0
        self.inserted: list[str] = []

    def execute(self, sql: str, columns: list[list[Any]], columnar: bool) -> None:
        self.tries += 1
        try:
            struct.pack(f"<{len(columns[1])}I", *columns[1])
        except struct.error as exc:
            raise ch_errors.TypeMismatchError(f"Type mismatch in VALUES section: {exc}") from exc
        self.inserted += columns[0]


@pytest.mark.parametrize("ts", OUT_OF_DATETIME)
def test_attack_a_request_log_stamped_outside_datetime_is_out_of_range(ts: str) -> None:
    topic = topic_name(Settings(), "requests")
    raws = [raw_of(whole(i)) for i in range(8)]
    raws[5] = raw_of(whole(5, ts=ts))
    msgs = [FakeMessage(raw, t=topic, part=0, off=i) for i, raw in enumerate(raws)]
    sink = Sink(Settings())
    batch = sink.decode(msgs, now=T0)  # type: ignore[arg-type]
    assert [(d.offset, d.reason) for d in batch.dead] == [(5, ConsumerFault.out_of_range)]
    rows = batch.rows[REQUESTS.name]
    assert [m.offset() for m in rows.messages] == [0, 1, 2, 3, 4, 6, 7]
    assert rows.columns[0] == [f"e{i}" for i in (0, 1, 2, 3, 4, 6, 7)]
    client = PackingClient()
    encoders = encoders_for(REQUESTS, {"ts": "DateTime"})
    refused = sink._insert(client, REQUESTS, encoders, rows.columns, rows.messages)  # type: ignore[arg-type]
    assert refused == []
    assert client.tries == 1  # one insert: no bisection for a value known not to fit
    assert sorted(client.inserted) == sorted(rows.columns[0])


def test_attack_every_table_refuses_a_stamp_outside_datetime_by_name() -> None:
    far = datetime(2200, 1, 1, tzinfo=UTC)
    event = cache(1, CacheEventKind.load, "w1").model_copy(update={"ts": far})
    topic = topic_name(Settings(), "cache-events")
    batch = Sink(Settings()).decode([FakeMessage(encode(event), t=topic, part=0, off=0)])  # type: ignore[list-item]
    assert [(d.reason, "2200" in d.detail) for d in batch.dead] == [
        (ConsumerFault.out_of_range, True)
    ]


@pytest.mark.parametrize("ts", [-1e9, 0.0, 4_294_944_000.0, 2.0**32 - 0.5, 2.0**32, 1e12])
def test_a_dead_letter_of_any_message_timestamp_fits_a_datetime(ts: float) -> None:
    letter = dead_letter_at(
        "t", 0, 1, None, b"x", ts, "metrics-sink", DecodeReason.malformed, "bad"
    )
    row = DEAD.row(letter)
    assert SECONDS is not None
    struct.pack("<I", SECONDS(row[1]))  # the driver's packing of a DateTime value


@pytest.mark.parametrize(("field", "value"), [("partition", 2**31), ("offset", 2**63)])
def test_attack_a_dead_letter_position_past_its_column_is_out_of_range(
    field: str, value: int
) -> None:
    letter = dead_letter_at(
        "t", 0, 1, None, b"x", 0.0, "metrics-sink", DecodeReason.malformed, "bad"
    ).model_copy(update={field: value})
    topic = topic_name(Settings(), "dead-letters")
    batch = Sink(Settings()).decode([FakeMessage(encode(letter), t=topic, part=0, off=0)])  # type: ignore[list-item]
    assert [(d.reason, field in d.detail) for d in batch.dead] == [
        (ConsumerFault.out_of_range, True)
    ]


def test_rows_out_of_range_and_rows_left_to_pydantic_keep_their_own_messages() -> None:
    topic = topic_name(Settings(), "requests")
    raws = [raw_of(whole(i)) for i in range(7)]
    raws[1] = raw_of(whole(1, error="café"))  # an escape: the slow way, taken
    raws[2] = raw_of(whole(2, ts="9999-12-31T23:59:59Z"))  # the fast way, then refused
    raws[4] = raw_of(whole(4, extra=1))  # the slow way, refused
    raws[5] = raw_of(whole(5, ts="1900-01-01T00:00:00Z"))
    msgs = [FakeMessage(raw, t=topic, part=0, off=i) for i, raw in enumerate(raws)]
    batch = Sink(Settings()).decode(msgs, now=T0)  # type: ignore[arg-type]
    assert sorted((d.offset, str(d.reason)) for d in batch.dead) == [
        (2, "out_of_range"),
        (4, "invalid"),
        (5, "out_of_range"),
    ]
    rows = batch.rows[REQUESTS.name]
    assert sorted(
        (m.offset(), row[0]) for m, row in zip(rows.messages, rows.rows, strict=True)
    ) == [(i, f"e{i}") for i in (0, 1, 3, 6)]


DAY = 86_400.0


def test_attack_rows_stamped_across_the_decades_cost_dead_letters_not_partitions() -> None:
    """ATTACK: a writer of the requests topic stamps each log on another day between 1970
    and 2106, all inside ``DateTime``: before, each was inserted, and every insert made a
    daily partition per row (18.16 has no per-insert limit). Now a row outside the sink's
    window (``max_row_age_s`` before its clock, ``max_row_ahead_s`` after) is a dead letter
    ``outside_window`` naming its ts, and the rows inside keep their own messages."""
    topic = topic_name(Settings(), "requests")
    now = T0
    offsets = {  # seconds from now, by offset
        0: 0.0,
        1: -399 * DAY,  # a backlog of a year: kept
        2: -401 * DAY,
        3: -20 * 365 * DAY,
        4: 0.9 * DAY,  # a clock ahead: kept
        5: 1.0 * DAY,  # the window's end is not in it
        6: 50 * 365 * DAY,
        7: -1.0,
    }
    raws = [
        raw_of(whole(i, ts=datetime.fromtimestamp(now + delta, UTC).isoformat()))
        for i, delta in offsets.items()
    ]
    raws[3] = raw_of(
        whole(3, error="café", ts=datetime.fromtimestamp(now - 7300 * DAY, UTC).isoformat())
    )  # slow way
    msgs = [FakeMessage(raw, t=topic, part=0, off=i) for i, raw in enumerate(raws)]
    batch = Sink(Settings()).decode(msgs, now=now)  # type: ignore[arg-type]
    assert sorted((d.offset, d.reason) for d in batch.dead) == [
        (i, ConsumerFault.outside_window) for i in (2, 3, 5, 6)
    ]
    assert all("outside the sink's window" in d.detail for d in batch.dead)
    rows = batch.rows[REQUESTS.name]
    assert [(m.offset(), row[0]) for m, row in zip(rows.messages, rows.rows, strict=True)] == [
        (i, f"e{i}") for i in (0, 1, 4, 7)
    ]


def test_every_table_keeps_to_the_window_and_none_applies_without_one() -> None:
    event = cache(1, CacheEventKind.load, "w1")
    topic = topic_name(Settings(), "cache-events")
    msg = FakeMessage(encode(event), t=topic, part=0, off=0)
    now = event.ts.timestamp()
    assert Sink(Settings()).decode([msg], now=now).dead == []  # type: ignore[list-item]
    far = Sink(Settings()).decode([msg], now=now + 500 * DAY)  # type: ignore[list-item]
    assert [d.reason for d in far.dead] == [ConsumerFault.outside_window]
    unbounded = Sink(Settings(), SinkConfig(max_row_age_s=None, max_row_ahead_s=None))
    assert unbounded.decode([msg], now=now + 500 * DAY).dead == []  # type: ignore[list-item]


@settings(max_examples=200, deadline=None)
@given(deltas=st.lists(st.floats(-1e9, 1e9, allow_nan=False), min_size=1, max_size=12))
def test_a_row_is_kept_exactly_when_its_stamp_is_in_the_window(deltas: list[float]) -> None:
    topic = topic_name(Settings(), "requests")
    stamps = [
        datetime.fromtimestamp(round(T0 + d, 6), UTC)
        for d in deltas
        if STAMP_MIN.timestamp() <= T0 + d < STAMP_END.timestamp() - 1
    ]
    raws = [raw_of(whole(i, ts=ts.isoformat())) for i, ts in enumerate(stamps)]
    msgs = [FakeMessage(raw, t=topic, part=0, off=i) for i, raw in enumerate(raws)]
    batch = Sink(Settings()).decode(msgs, now=T0)  # type: ignore[arg-type]
    lo, hi = T0 - 400 * DAY, T0 + DAY
    kept = [m.offset() for m in batch.rows[REQUESTS.name].messages] if stamps else []
    assert kept == [i for i, ts in enumerate(stamps) if lo <= ts.timestamp() < hi]
    assert sorted(kept + [d.offset for d in batch.dead]) == list(range(len(stamps)))


class CountingProducers:
    """Stands in for ``kafka.producer``: counts the producers made; each acknowledges what
    it is given, unless ``fail_next`` says its next flush leaves one message undelivered."""

    def __init__(self) -> None:
        self.made = 0
        self.sent = 0
        self.fail_next = False

    def __call__(self, settings: Settings) -> Any:
        self.made += 1
        return self

    def produce(self, topic: str, key: str, value: bytes, on_delivery: Any) -> None:
        self.sent += 1
        on_delivery(None, None)

    def flush(self, timeout: float) -> int:
        failed, self.fail_next = self.fail_next, False
        return 1 if failed else 0


def test_attack_one_bad_message_a_batch_costs_no_producer_a_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ATTACK: one malformed message in every batch. Before, each batch's dead letter was
    sent by a new idempotent producer (a SASL login and a producer-id round trip a batch,
    about 1 ms of work turned into tens); now one producer serves the sink, and only a
    delivery that failed makes the retry start a fresh one."""
    from loraplane.kernel import kafka
    from loraplane.kernel.bus import DeliveryError

    producers = CountingProducers()
    monkeypatch.setattr(kafka, "producer", producers)
    sink = Sink(Settings())
    topic = topic_name(Settings(), "requests")
    for batch in range(5):
        msg = FakeMessage(b'{"event_id": ', t=topic, part=0, off=batch)
        sink._send_dead_letters(sink.decode([msg], now=T0).dead)  # type: ignore[list-item]
    assert (producers.made, producers.sent, sink.stats.dead_letters) == (1, 5, 5)
    producers.fail_next = True
    letter = sink.decode([FakeMessage(b"x", t=topic, off=9)], now=T0).dead  # type: ignore[list-item]
    with pytest.raises(DeliveryError):
        sink._send_dead_letters(letter)
    sink._send_dead_letters(letter)  # the batch's retry
    assert producers.made == 2


class BoundedQueue(CountingProducers):
    """A producer whose queue holds ``room`` messages, as librdkafka's holds 100,000 or
    1 GiB: one more is its BufferError until a flush delivers what it holds."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room
        self.queued = 0

    def produce(self, topic: str, key: str, value: bytes, on_delivery: Any) -> None:
        if self.queued >= self.room:
            raise BufferError("Local: Queue full")
        self.queued += 1
        super().produce(topic, key, value, on_delivery)

    def flush(self, timeout: float) -> int:
        self.queued = 0
        return super().flush(timeout)


def test_attack_more_dead_letters_than_the_producer_queue_holds_are_all_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ATTACK: a batch whose dead letters overfill the producer's queue (measured on the
    local broker: the 12,227th letter of a 64 KiB raw, 1 GiB queued; or the 100,001st of
    any size under ``--batch-size`` 200,000). Before, produce's BufferError left the writer
    thread, crashed the sink, and the batch, never committed, crashed it again on every
    restart; now the queue is flushed and every letter sent."""
    from loraplane.kernel import kafka

    producers = BoundedQueue(room=3)
    monkeypatch.setattr(kafka, "producer", producers)
    sink = Sink(Settings())
    topic = topic_name(Settings(), "requests")
    msgs = [FakeMessage(b"{", t=topic, part=0, off=i) for i in range(10)]
    sink._send_dead_letters(sink.decode(msgs, now=T0).dead)  # type: ignore[arg-type]
    assert (producers.sent, sink.stats.dead_letters, sink.stats.dead_letters_lost) == (10, 10, 0)


def test_attack_a_batch_of_bad_messages_is_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ATTACK: a batch of 2,000 malformed messages. Before, each letter was a warning line
    of its own (a writer of the topic chose how many lines the sink wrote, and a journal's
    rate limit then dropped the sink's other lines); now the batch is one line, with the
    count by reason and the first letter's position (every letter is in the dead-letters
    topic and table)."""
    from loraplane.kernel import kafka

    monkeypatch.setattr(kafka, "producer", CountingProducers())
    sink = Sink(Settings())
    topic = topic_name(Settings(), "requests")
    msgs = [FakeMessage(b"{" if i % 2 else b"{}", t=topic, part=1, off=i) for i in range(2000)]
    with caplog.at_level("WARNING", logger="loraplane.metrics.sink"):
        sink._send_dead_letters(sink.decode(msgs, now=T0).dead)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records if r.name == "loraplane.metrics.sink"]
    assert lines == [
        f"dead-lettered 2000 message(s) (invalid 1000, malformed 1000), the first {topic}:1:0"
    ]


class HoldingProducer(CountingProducers):
    """A producer that holds what it accepts until a flush delivers it (a broker that
    acknowledges only then); ``fail_at`` makes that produce call raise ``error``, and
    ``room`` bounds what one flush delivers (a slow broker)."""

    def __init__(self, fail_at: int | None = None, error: Exception | None = None) -> None:
        super().__init__()
        self.fail_at, self.error = fail_at, error
        self.held: list[Any] = []
        self.delivered = 0
        self.room: int | None = None

    def produce(self, topic: str, key: str, value: bytes, on_delivery: Any) -> None:
        if self.error is not None and self.sent + len(self.held) + 1 == self.fail_at:
            raise self.error
        self.held.append(on_delivery)

    def flush(self, timeout: float) -> int:
        n = len(self.held) if self.room is None else min(self.room, len(self.held))
        for report in self.held[:n]:
            report(None, None)
        del self.held[:n]
        self.delivered += n
        return len(self.held)


def test_attack_the_dead_letter_producer_is_flushed_before_it_is_dropped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ATTACK: a letter the producer accepted is acknowledged only by a later flush. A
    produce that raised past the sink's handling (the writer's failure ends the sink)
    left two accepted letters in the producer, and the sink ended without flushing it:
    they were dropped unsaid. The sink's close flushes the producer it drops. A producer
    dropped after a failed flush says how many letters it still held (their batch is not
    committed and is sent again), and a fresh one carries the retry."""
    from loraplane.kernel import kafka
    from loraplane.kernel.bus import DeliveryError

    topic = topic_name(Settings(), "requests")
    msgs = [FakeMessage(b"{", t=topic, part=0, off=i) for i in range(4)]
    stuck = HoldingProducer(fail_at=3, error=RuntimeError("a bug in a library"))
    monkeypatch.setattr(kafka, "producer", lambda _settings: stuck)
    sink = Sink(Settings())
    with pytest.raises(RuntimeError):
        sink._send_dead_letters(sink.decode(msgs, now=T0).dead)  # type: ignore[arg-type]
    assert (len(stuck.held), stuck.delivered) == (2, 0)
    sink.close()
    assert (len(stuck.held), stuck.delivered) == (0, 2)
    sink.close()  # nothing held: nothing to do

    slow = HoldingProducer()
    slow.room = 1  # each flush delivers one letter: the 20 s flush leaves three
    fresh = HoldingProducer()
    made = iter([slow, fresh])
    monkeypatch.setattr(kafka, "producer", lambda _settings: next(made))
    sink = Sink(Settings())
    dead = sink.decode(msgs, now=T0).dead  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="loraplane.metrics.sink"), pytest.raises(DeliveryError):
        sink._send_dead_letters(dead)
    assert slow.delivered == 2 and len(slow.held) == 2  # flushed again as it was dropped
    assert any("holding 2 unacknowledged letter(s)" in r.getMessage() for r in caplog.records)
    sink._send_dead_letters(dead)  # the batch's retry: a fresh producer
    assert (fresh.delivered, sink.stats.dead_letters) == (4, 4)


def test_the_sink_run_ends_by_flushing_its_dead_letter_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``run`` ends with ``close``: a producer holding accepted letters is flushed."""
    import threading

    held = HoldingProducer()
    sink = Sink(Settings())
    sink._producer = held  # type: ignore[assignment]
    held.held = [lambda err, msg: None] * 3

    class Idle:
        def close(self) -> None:
            pass

    monkeypatch.setattr(sink, "_consumer", lambda: Idle())
    stop = threading.Event()
    stop.set()
    sink.run(stop)
    assert (held.delivered, held.held, sink._producer) == (3, [], None)
