"""The sink builds each table's insert as one list per column: rows the compiled decoder
takes and rows pydantic takes land in the same columns, each beside the message it came
from; refusals become dead letters with their reason; a rejected insert is bisected down to
its bad rows through the columns."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from clickhouse_driver import errors as ch_errors

from loraplane.kernel import collector
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.metrics.sink import Sink
from loraplane.metrics.tables import TABLES, columns_of
from loraplane.schemas.cache_event import CacheEventKind
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.request_log import RequestLog
from tests.kafka_message import FakeMessage
from tests.pack_cases import cache
from tests.wire_strategies import T0, raw_of, whole

REQUESTS = next(t for t in TABLES if t.name == "request_log")
CACHE = next(t for t in TABLES if t.name == "cache_events")


def _batch() -> tuple[Sink, list[FakeMessage]]:
    settings = Settings()
    requests, caches = topic_name(settings, "requests"), topic_name(settings, "cache-events")
    big = cache(2, CacheEventKind.load, "w1").model_copy(update={"bytes": 2**70})
    values = [
        (requests, 0, raw_of(whole(0))),  # the fast way
        (requests, 1, raw_of(whole(1, error="café"))),  # an escape: the slow way, taken
        (requests, 0, b'{"event_id": '),  # malformed
        (caches, 2, encode(cache(1, CacheEventKind.load, "w1"))),  # a table without a fast way
        (requests, 1, raw_of(whole(2, extra=1))),  # an unknown field: refused the slow way
        (caches, 2, encode(big)),  # valid, but no UInt64 holds it
        (requests, 0, raw_of(whole(3))),
    ]
    offsets: dict[tuple[str, int], int] = {}
    msgs = []
    for topic, partition, raw in values:
        offset = offsets[(topic, partition)] = offsets.get((topic, partition), 9) + 1
        msgs.append(FakeMessage(raw, t=topic, part=partition, off=offset))
    return Sink(settings), msgs


def test_fast_and_slow_rows_fill_the_same_columns_beside_their_messages() -> None:
    sink, msgs = _batch()
    batch = sink.decode(msgs, now=T0)  # type: ignore[arg-type]
    requests = batch.rows[REQUESTS.name]
    assert len(requests.columns) == len(REQUESTS.columns)
    assert {len(c) for c in requests.columns} == {len(requests)} == {3}
    for row, msg in zip(requests.rows, requests.messages, strict=True):
        assert row == REQUESTS.row(decode(RequestLog, msg.value()))
    assert sorted(row[0] for row in requests.rows) == ["e0", "e1", "e3"]
    caches = batch.rows[CACHE.name]
    assert [row[0] for row in caches.rows] == ["c-1"]
    assert sorted((d.partition, d.offset, str(d.reason)) for d in batch.dead) == [
        (0, 11, "malformed"),
        (1, 11, "invalid"),
        (2, 11, "out_of_range"),
    ]
    assert batch.offsets == {(m.topic(), m.partition()): m.offset() for m in msgs}


def test_the_columns_are_what_the_rows_transposed_give() -> None:
    raws = [raw_of(whole(i)) for i in range(5)]
    assert REQUESTS.fast_columns is not None
    columns, left = REQUESTS.fast_columns(raws)
    assert left == []
    rows = [REQUESTS.row(decode(RequestLog, raw)) for raw in raws]
    assert columns == columns_of(rows, {})


class RejectingClient:
    """Refuses, as ClickHouse does a value it cannot parse, any insert holding ``bad``."""

    def __init__(self, bad: str) -> None:
        self.bad = bad
        self.inserted: list[str] = []

    def execute(self, sql: str, columns: list[list[Any]], columnar: bool) -> None:
        assert columnar
        if self.bad in columns[0]:
            raise ch_errors.ServerException("Cannot parse input", code=27)
        self.inserted += columns[0]


def test_a_rejected_row_is_bisected_out_through_the_columns() -> None:
    sink = Sink(Settings())
    msgs = [FakeMessage(raw_of(whole(i)), t="t", part=0, off=i) for i in range(7)]
    assert REQUESTS.fast_columns is not None
    columns, _ = REQUESTS.fast_columns([m.value() for m in msgs])
    client = RejectingClient("e4")
    refused = sink._insert(client, REQUESTS, {}, columns, msgs)  # type: ignore[arg-type]
    assert [(m.offset(), why.split(":")[0]) for m, why in refused] == [(4, "ServerException")]
    assert sorted(client.inserted) == sorted(f"e{i}" for i in range(7) if i != 4)
    assert columns[0] == [f"e{i}" for i in range(7)]  # kept whole, for a retry


class PartitionLimitClient:
    """Refuses, as current ClickHouse does past ``max_partitions_per_insert_block``, an
    insert whose rows fall in more than ``most`` partitions (here: distinct event ids)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.inserted: list[str] = []

    def execute(self, sql: str, columns: list[list[Any]], columnar: bool) -> None:
        if len(set(columns[0])) > self.most:
            raise ch_errors.ServerException(
                "Too many partitions for single INSERT block (more than 2). The limit is "
                "controlled by 'max_partitions_per_insert_block' setting.",
                code=252,
            )
        self.inserted += columns[0]


def test_rows_over_too_many_partitions_are_inserted_in_parts_and_none_refused() -> None:
    sink = Sink(Settings())
    msgs = [FakeMessage(raw_of(whole(i)), t="t", part=0, off=i) for i in range(9)]
    assert REQUESTS.fast_columns is not None
    columns, _ = REQUESTS.fast_columns([m.value() for m in msgs])
    client = PartitionLimitClient(2)
    refused = sink._insert(client, REQUESTS, {}, columns, msgs)  # type: ignore[arg-type]
    assert refused == []
    assert sorted(client.inserted) == sorted(f"e{i}" for i in range(9))


class DayLimitClient:
    """Current ClickHouse's ``max_partitions_per_insert_block`` (100) on daily partitions:
    refuses an insert whose ``ts`` fall on more than 100 days; counts the inserts tried and
    the parts the accepted ones made (one per day an insert holds)."""

    def __init__(self) -> None:
        self.tries = 0
        self.parts = 0
        self.inserted: list[str] = []

    def execute(self, sql: str, columns: list[list[Any]], columnar: bool) -> None:
        self.tries += 1
        days = {ts.date() for ts in columns[1]}
        if len(days) > 100:
            raise ch_errors.ServerException(
                f"Too many partitions for single INSERT block (more than 100): {len(days)}",
                code=252,
            )
        self.parts += len(days)
        self.inserted += columns[0]


def test_attack_rows_over_the_window_s_days_are_inserted_a_hundred_days_at_a_time() -> None:
    """ATTACK on current ClickHouse: a writer of the requests topic stamps a batch's 20,000
    logs on the window's 401 days in turn (all inside it, so none is refused). Before, the
    insert was halved until each half spanned at most 100 days: 511 inserts a batch, whose
    256 accepted ones made about 20,000 parts (one per day per insert), until merges fell
    behind (code 252, "too many parts": the batch retried without end). Now the rows are
    grouped by day, 100 days an insert: 6 inserts, one part per day."""
    sink = Sink(Settings())
    start = T0 - 400 * 86_400
    raws = [
        raw_of(whole(i, ts=datetime.fromtimestamp(start + (i * 7 % 401) * 86_400, UTC).isoformat()))
        for i in range(20_000)
    ]
    msgs = [FakeMessage(raw, t="t", part=0, off=i) for i, raw in enumerate(raws)]
    assert REQUESTS.fast_columns is not None
    columns, left = REQUESTS.fast_columns(raws)
    assert left == []
    client = DayLimitClient()
    refused = sink._insert(client, REQUESTS, {}, columns, msgs)  # type: ignore[arg-type]
    assert refused == []
    assert sorted(client.inserted) == sorted(f"e{i}" for i in range(20_000))
    assert (client.tries, client.parts) == (6, 401)


def test_too_many_parts_is_not_a_rejection_but_a_retry() -> None:
    """Code 252 worded as merges falling behind: transient, the batch is retried whole."""

    class Behind:
        def execute(self, sql: str, columns: list[list[Any]], columnar: bool) -> None:
            raise ch_errors.ServerException(
                "Too many parts (300). Merges are processing significantly slower than inserts",
                code=252,
            )

    sink = Sink(Settings())
    msgs = [FakeMessage(raw_of(whole(i)), t="t", part=0, off=i) for i in range(3)]
    assert REQUESTS.fast_columns is not None
    columns, _ = REQUESTS.fast_columns([m.value() for m in msgs])
    with pytest.raises(ch_errors.ServerException):
        sink._insert(Behind(), REQUESTS, {}, columns, msgs)  # type: ignore[arg-type]


@pytest.fixture
def thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_the_collector_thresholds_only_ever_rise(thresholds: None) -> None:
    gc.set_threshold(700, 10, 10)
    collector.collect_the_young_after(80_000)
    collector.collect_the_young_after(200)
    collector.collect_the_oldest_after(1000)
    collector.collect_the_oldest_after(5)
    assert gc.get_threshold() == (80_000, 10, 1000)
