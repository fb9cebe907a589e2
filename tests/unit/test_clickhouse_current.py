"""The migrations and every query of the pack on current ClickHouse, embedded by chdb.

The integration suite runs them on Debian's clickhouse-server 18.16; this runs the same files
(``migrations.apply``, ``queries.run``: no SQL is copied here) in-process on the ClickHouse
that chdb embeds, against the rows and answers of ``tests/pack_cases.py`` (which
tests/integration/test_metrics_pack_cases.py checks on 18.16). Parameters are bound by
clickhouse-driver's own escaping, as in the product. The server version is printed (``-s``)
and recorded in the migrations ledger.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
from chdb import session as chdb_session
from clickhouse_driver.util.escape import escape_param, escape_params

from loraplane.metrics import migrations, queries
from loraplane.metrics.sink import column_encoders
from loraplane.metrics.tables import STAMP_END, STAMP_MIN, TABLES, timestamp_encoder
from tests import pack_cases

DB = "loraplane_current"
# UTC, as the product's servers run; clickhouse-driver renders datetimes in this zone.
_CONTEXT = SimpleNamespace(server_info=SimpleNamespace(get_timezone=lambda: "UTC"))


class ChdbClient:
    """clickhouse-driver's ``execute`` over a chdb session: %(name)s parameters and VALUES
    rows are rendered by clickhouse-driver's escaping, results come back typed (DateTime as
    an aware datetime, 64-bit integers as int, nan as None, as JSON has no nan)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.session.query("SET output_format_json_quote_64bit_integers = 0")
        self.session.query("SET output_format_json_quote_denormals = 0")

    def execute(self, query: str, params: Any = None, with_column_types: bool = False) -> Any:
        if isinstance(params, list):  # INSERT ... VALUES with rows, as the driver takes them
            query = query + " " + ", ".join(str(escape_param(tuple(r), _CONTEXT)) for r in params)
        elif params:
            query = query % escape_params(params, _CONTEXT)
        text = str(self.session.query(query, "JSONCompact"))
        if not text.strip():
            return ([], []) if with_column_types else []
        result = json.loads(text)
        columns = [(m["name"], m["type"]) for m in result["meta"]]
        rows = [
            tuple(_typed(v, t) for v, (_, t) in zip(row, columns, strict=True))
            for row in result["data"]
        ]
        return (rows, columns) if with_column_types else rows


def _typed(value: Any, kind: str) -> Any:
    if isinstance(value, str) and "DateTime" in kind:
        return datetime.fromisoformat(value).replace(tzinfo=UTC)
    return value


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChdbClient]:
    session = chdb_session.Session(str(tmp_path_factory.mktemp("chdb")))
    try:
        c = ChdbClient(session)
        first = migrations.apply(c, DB)
        print(f"current ClickHouse (chdb): {first.server_version}")
        assert first.applied == [f"{m.version:03d}_{m.name}" for m in migrations.discover()]
        again = migrations.apply(c, DB)
        assert (again.applied, again.already) == ([], first.applied)  # idempotent
        c.execute(f"USE {DB}")
        pack_cases.load(c)
        yield c
    finally:
        session.close()


def test_migrations_record_current_clickhouse(client: ChdbClient) -> None:
    rows = client.execute("SELECT version, server_version FROM schema_migrations ORDER BY 1")
    assert [v for v, _ in rows] == [m.version for m in migrations.discover()]
    version = rows[0][1]
    assert migrations.ServerFeatures.parse(version).version >= (24, 0), version
    # Current ClickHouse gets the modern column types the templates ask for.
    types = dict(
        client.execute(
            "SELECT name, type FROM system.columns WHERE database = %(db)s "
            "AND table = 'request_log'",
            {"db": DB},
        )
    )
    assert types["ts"] == "DateTime64(3, 'UTC')"
    assert types["adapter_id"] == "LowCardinality(String)"
    assert client.execute("SELECT count() FROM request_log")[0][0] == 7  # replay included


def test_the_sink_writes_timestamps_as_current_clickhouse_columns_take_them(
    client: ChdbClient,
) -> None:
    """The sink reads the column types of every table from the server: on current ClickHouse
    each timestamp column is DateTime64(3), so it gets milliseconds, as the driver writes."""
    encoders = column_encoders(cast("Any", client))
    at = datetime(2026, 12, 5, 2, 28, 13, 479884, tzinfo=UTC)
    for table in TABLES:
        stamps = [c for c in table.columns if c in ("ts", "deadline")]
        assert stamps, table.name
        assert sorted(encoders[table.name]) == sorted(table.columns.index(c) for c in stamps)
        for encode in encoders[table.name].values():
            assert encode(at) == 1_796_437_693_479


def test_every_query_of_the_pack_has_a_check() -> None:
    assert sorted(pack_cases.CHECKS) == queries.names()


@pytest.mark.parametrize("name", queries.names())
def test_pack_query_on_current_clickhouse(client: ChdbClient, name: str) -> None:
    pack_cases.CHECKS[name](pack_cases.run(client, name))


def test_filters_bind_through_the_driver_escaping(client: ChdbClient) -> None:
    """A label filter narrows the rows, and a quote in it is data, not SQL."""
    params = pack_cases.window(adapter_id="beta")
    assert [r["adapter_id"] for r in queries.run(client, "adapter_summary", params)] == ["beta"]
    hostile = pack_cases.window(tenant_id="t0' OR '1'='1")
    assert queries.run(client, "adapter_summary", hostile) == []


def test_the_replays_read_on_current_clickhouse(client: ChdbClient) -> None:
    """``simulate --from-clickhouse`` reads its window with the same SQL on current ClickHouse
    as on 18.16 (tests/integration/test_loadtest.py): each request once (FINAL drops the
    sink's replayed row), oldest first, in ``ARRIVAL_COLUMNS``."""
    params = pack_cases.window()
    rows = client.execute(queries.ARRIVALS_SQL, params.bound())
    assert queries.count_arrivals(client, params) == len(rows) == len(pack_cases.REQUESTS)
    assert all(len(r) == len(queries.ARRIVAL_COLUMNS) for r in rows)
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)
    assert sorted(r[2] for r in rows) == sorted(x.adapter_id for x in pack_cases.REQUESTS)


def test_the_sink_s_stamp_range_reads_back_and_partitions_on_current_clickhouse(
    client: ChdbClient,
) -> None:
    """The sink refuses a ``ts`` outside ``STAMP_MIN``..``STAMP_END`` on every server (the
    range 18.16's ``DateTime`` reads back right: tests/integration/test_sink_stamp_range.py).
    On current ClickHouse the columns are ``DateTime64(3)`` (1900 to 2299), which hold that
    range whole: its first and last instants, as the sink's encoder writes them, read back
    and fall in their own day's partition. The range is not widened there: before 1970 the
    encoder's integer seconds (truncated toward zero) would move an instant."""
    encode = timestamp_encoder("DateTime64(3, 'UTC')")
    assert encode is not None
    ends = [STAMP_MIN, STAMP_END - timedelta(microseconds=1000)]
    for at in ends:
        ms = encode(at)
        read = client.execute(
            f"SELECT toUnixTimestamp64Milli(t), toYYYYMMDD(t) "
            f"FROM (SELECT fromUnixTimestamp64Milli(toInt64({ms}), 'UTC') AS t)"
        )
        assert read == [(ms, int(at.strftime("%Y%m%d")))], at
    early = datetime(1969, 12, 31, 23, 59, 59, 500_000, tzinfo=UTC)
    assert encode(early) != round(early.timestamp() * 1000)  # why the range starts at 1970


def test_attack_a_flood_of_adapter_ids_leaves_the_charts_their_latest_minute(
    client: ChdbClient,
) -> None:
    """ATTACK (``pack_cases.flood``): 5,000 adapter ids in an hour's first minute, from a
    tenant's refused requests. Before, the timeseries queries ordered by minute up to the
    page's 5,000 rows: every row was the flood's minute and the charts showed no genuine
    point (an hour of 84 adapters cut the newest minutes the same way). Now they chart the
    20 adapters with the most requests, newest minutes first."""
    pack_cases.insert(cast("Any", client), pack_cases.flood())
    pack_cases.flood_charted(queries.run(client, "timeseries_requests", pack_cases.flood_window()))
