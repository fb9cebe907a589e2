"""The sink's timestamp range (``tables.STAMP_MIN``/``STAMP_END``) on the stack's ClickHouse:
both ends are read back and partitioned as written; on a ``DateTime`` column (18.16) the first
instant past it is not, which is why rows there are refused as ``out_of_range``."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.metrics import migrations
from loraplane.metrics.clickhouse import connect
from loraplane.metrics.sink import Sink, SinkConfig, column_encoders
from loraplane.metrics.tables import STAMP_END, STAMP_MIN, TABLES
from tests.integration.metrics_env import drop_database, isolated_clickhouse
from tests.kafka_message import FakeMessage
from tests.wire_strategies import raw_of, whole

pytestmark = pytest.mark.integration

REQUESTS = next(t for t in TABLES if t.name == "request_log")
LAST = STAMP_END - timedelta(seconds=1)


@pytest.fixture
def settings() -> Iterator[Settings]:
    settings = isolated_clickhouse()
    migrations.migrate(settings)
    yield settings
    drop_database(settings)


def test_the_ends_of_the_stamp_range_read_back_as_written(settings: Settings) -> None:
    stamps = {"e0": STAMP_MIN, "e1": LAST, "e2": STAMP_END}
    topic = topic_name(settings, "requests")
    msgs = [
        FakeMessage(raw_of(whole(i, ts=ts.isoformat())), t=topic, part=0, off=i)
        for i, ts in enumerate(stamps.values())
    ]
    sink = Sink(settings, SinkConfig(max_row_age_s=None, max_row_ahead_s=None))  # both ends
    batch = sink.decode(msgs)  # type: ignore[arg-type]
    assert [(d.offset, str(d.reason)) for d in batch.dead] == [(2, "out_of_range")]
    client = connect(settings)
    rows = batch.rows[REQUESTS.name]
    encoders = column_encoders(client)["request_log"]
    assert sink._insert(client, REQUESTS, encoders, rows.columns, rows.messages) == []  # type: ignore[arg-type]
    read = client.execute("SELECT event_id, toUnixTimestamp(ts), toYYYYMMDD(ts) FROM request_log")
    assert sorted(read) == [
        (i, int(stamps[i].timestamp()), int(stamps[i].strftime("%Y%m%d"))) for i in ("e0", "e1")
    ]
    kind = client.execute(
        "SELECT type FROM system.columns WHERE database = currentDatabase() "
        "AND table = 'request_log' AND name = 'ts'"
    )[0][0]
    if not kind.startswith("DateTime64"):
        past = client.execute(f"SELECT toYYYYMMDD(toDateTime({int(STAMP_END.timestamp())}))")
        assert past != [(int(STAMP_END.strftime("%Y%m%d")),)]  # the day 18.16 gets wrong
    assert datetime.fromtimestamp(int(LAST.timestamp()), UTC) == LAST


def test_rows_stamped_across_the_decades_make_no_partitions_of_their_own(
    settings: Settings,
) -> None:
    """ATTACK on the real ClickHouse: 200 request logs, each stamped on another day between
    1971 and 2100 (all inside ``DateTime``), beside 20 of today. Before, the sink inserted
    them all, one daily partition per row; now those outside its window are dead letters
    and the table gains today's partition only."""
    topic = topic_name(settings, "requests")
    now = datetime.now(UTC)
    span = (datetime(2100, 1, 1, tzinfo=UTC) - datetime(1971, 1, 1, tzinfo=UTC)).days
    far = [datetime(1971, 1, 1, tzinfo=UTC) + timedelta(days=span * i // 200) for i in range(200)]
    far = [ts for ts in far if abs((ts - now).days) > 400]
    stamps = far + [now - timedelta(seconds=i) for i in range(20)]
    msgs = [
        FakeMessage(raw_of(whole(i, ts=ts.isoformat())), t=topic, part=0, off=i)
        for i, ts in enumerate(stamps)
    ]
    sink = Sink(settings)
    batch = sink.decode(msgs)  # type: ignore[arg-type]
    assert len(batch.dead) == len(far)
    assert {str(d.reason) for d in batch.dead} == {"outside_window"}
    client = connect(settings)
    rows = batch.rows[REQUESTS.name]
    encoders = column_encoders(client)["request_log"]
    assert sink._insert(client, REQUESTS, encoders, rows.columns, rows.messages) == []  # type: ignore[arg-type]
    parts = client.execute(
        "SELECT DISTINCT partition FROM system.parts WHERE database = currentDatabase() "
        "AND table = 'request_log' AND active"
    )
    days = {(now - timedelta(seconds=i)).strftime("%Y%m%d") for i in range(20)}
    assert {p for (p,) in parts} == days
