"""Pure parts of the metrics package: migration rendering, the query pack, row mapping and
the sink's decoding into rows and dead letters (no Kafka, no ClickHouse here)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplane.dashboards import grafana_export
from loraplane.kernel.config import Settings
from loraplane.metrics import migrations, queries
from loraplane.metrics.sink import COMPONENT, Sink
from loraplane.metrics.tables import TABLES
from loraplane.schemas.cache_event import CacheEvent
from loraplane.schemas.codec import encode
from loraplane.schemas.dead_letter import dead_letter_for
from loraplane.schemas.reasons import DecodeReason
from loraplane.schemas.request_log import RequestLog

OLD, NEW = migrations.ServerFeatures.parse("18.16.1"), migrations.ServerFeatures.parse("24.8.4.13")


def rendered(features: migrations.ServerFeatures) -> str:
    return "\n".join(s for m in migrations.discover() for s in m.render("db_x", features))


def test_old_server_gets_no_ttl_lowcardinality_or_datetime64() -> None:
    sql = rendered(OLD)
    assert "TTL" not in sql and "LowCardinality" not in sql and "DateTime64" not in sql
    assert "{" not in sql  # every placeholder filled


def test_current_server_gets_ttl_lowcardinality_and_datetime64() -> None:
    sql = rendered(NEW)
    assert "TTL ts + INTERVAL 30 DAY" in sql and "TTL minute + INTERVAL 400 DAY" in sql
    assert "LowCardinality(String)" in sql and "DateTime64(3, 'UTC')" in sql
    assert sql.count("CREATE MATERIALIZED VIEW") == 4


def test_both_dialects_render_the_same_statements() -> None:
    for migration in migrations.discover():
        old, new = migration.render("d", OLD), migration.render("d", NEW)
        assert len(old) == len(new)
        assert [s.split("(")[0] for s in old] == [s.split("(")[0] for s in new]


def test_bad_migration_names_and_databases_are_refused(tmp_path: Path) -> None:
    (tmp_path / "1_x.sql").write_text("SELECT 1")
    with pytest.raises(migrations.MigrationError, match="NNN_lower_snake"):
        migrations.discover(tmp_path)
    with pytest.raises(ValueError, match="invalid ClickHouse database"):
        migrations.discover()[0].render("x`; DROP", OLD)


@given(st.integers(min_value=0, max_value=10**15), st.sampled_from("smhdw"))
def test_durations_parse_up_to_the_longest_window(n: int, unit: str) -> None:
    seconds = n * {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[unit]
    if seconds <= queries.MAX_WINDOW.total_seconds():
        assert queries.parse_duration(f"{n}{unit}") == timedelta(seconds=seconds)
    else:  # a ValueError with the reason, never an OverflowError (a datetime's range)
        with pytest.raises(ValueError, match=r"longer than the longest window|invalid"):
            queries.parse_duration(f"{n}{unit}")


@given(st.text(max_size=8))
def test_anything_else_is_not_a_duration(text: str) -> None:
    if not re.fullmatch(r"\s*[0-9]+[smhdw]\s*", text):
        with pytest.raises(ValueError):
            queries.parse_duration(text)


@given(st.text(max_size=8) | st.integers(-(10**9), 10**9).map(str))
def test_a_limit_is_1_to_the_cap_in_ascii_digits(text: str) -> None:
    if re.fullmatch(r"[0-9]{1,6}", text) and 1 <= int(text) <= queries.MAX_LIMIT:
        assert queries.parse_limit(text) == int(text)
    else:
        with pytest.raises(ValueError, match="limit must be"):
            queries.parse_limit(text)


def test_every_pack_query_is_documented_and_uses_only_known_parameters() -> None:
    names = queries.names()
    assert len(names) >= 10
    bound = set(queries.window("1h").bound())
    for name in names:
        q = queries.load(name)
        assert q.summary != name, f"{name}: first header line must say what it answers"
        assert "Answers:" in q.header and "Params:" in q.header, name
        assert set(re.findall(r"%\((\w+)\)s", q.sql)) <= bound, name
        assert "{" not in q.sql, f"{name}: no string formatting in the pack"


def test_unknown_or_path_like_query_names_are_refused() -> None:
    for bad in ("nope", "../secret", "adapter_summary.sql"):
        with pytest.raises(KeyError):
            queries.load(bad)


def test_grafana_dashboard_is_generated_from_the_pack() -> None:
    assert grafana_export.OUT.read_text() == grafana_export.render(), (
        "run: python -m loraplane.dashboards.grafana_export"
    )
    for name in queries.names():
        assert "%(" not in queries.grafana_sql(name)


def test_grafana_panels_run_the_pack_on_the_clickhouse_plugin() -> None:
    """Built with grafana-foundation-sdk: every pack query is a panel whose one target is the
    pack's SQL for grafana-clickhouse-datasource, and no two panels overlap on the grid."""
    board = json.loads(grafana_export.OUT.read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert {
        p["description"].removeprefix("dashboards/queries/").removesuffix(".sql") for p in panels
    } == set(queries.names())
    for panel in panels:
        [target] = panel["targets"]
        name = panel["description"].removeprefix("dashboards/queries/").removesuffix(".sql")
        assert queries.grafana_sql(name) in target["rawSql"]
        assert (
            panel["datasource"]["type"]
            == target["datasource"]["type"]
            == "grafana-clickhouse-datasource"
        )
        assert target["format"] == (0 if panel["type"] == "timeseries" else 1)
    cells = [
        (x, y)
        for p in board["panels"]
        for g in [p["gridPos"]]
        for x in range(g["x"], g["x"] + g["w"])
        for y in range(g["y"], g["y"] + g["h"])
    ]
    assert len(cells) == len(set(cells)) and max(x for x, _ in cells) < 24
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "grafana-clickhouse-datasource"
    assert all(variables[v]["allValue"] == "" for v in ("base_model", "tenant", "adapter"))


def test_adapter_view_joins_request_and_cache_rows() -> None:
    labels = {"base_model": "b", "adapter_id": "a", "adapter_version": "1", "tenant_id": "t"}
    cache_only = {**labels, "adapter_id": "z"}
    cache = {k: 1 for k in queries.CACHE_COLUMNS}
    view = queries.merge_adapter_view(
        [{**labels, "requests": 5}], [{**labels, **cache}, {**cache_only, **cache}]
    )
    assert [(r["adapter_id"], r["requests"], r["loads"]) for r in view] == [
        ("a", 5, 1),
        ("z", 0, 1),
    ]


@dataclass
class FakeMessage:
    """Stand-in for confluent_kafka.Message in the pure decode step."""

    _topic: str
    _value: bytes | None
    _offset: int = 0

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> bytes | None:
        return b"k"

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)


def request(i: int) -> RequestLog:
    return RequestLog(
        event_id=f"e{i}",
        ts=datetime.now(UTC),
        request_id="r",
        tenant_id="t",
        base_model="b",
        adapter_id="a",
        worker_id="w",
        tier_at_arrival="gpu",
    )


def test_decode_splits_rows_from_dead_letters() -> None:
    sink = Sink(Settings())
    ce = CacheEvent(
        event_id="c",
        ts=datetime.now(UTC),
        worker_id="w",
        base_model="b",
        tenant_id="t",
        adapter_id="a",
        adapter_version="1",
        lora_name="n",
        kind="load",
        bytes=2**64,
    )
    batch = sink.decode(
        [
            FakeMessage("loraplane.requests", encode(request(1)), 5),
            FakeMessage("loraplane.requests", b"\xff\xfe", 6),
            FakeMessage("loraplane.requests", b'{"event_id": "x"}', 7),
            FakeMessage("loraplane.cache-events", encode(ce), 3),
        ]
    )
    assert [row[0] for row in batch.rows["request_log"].rows] == ["e1"]
    assert [d.reason for d in batch.dead] == ["malformed", "invalid", "out_of_range"]
    assert batch.offsets == {("loraplane.requests", 0): 7, ("loraplane.cache-events", 0): 3}


def test_dead_letters_are_deterministic_per_message() -> None:
    msg = FakeMessage("loraplane.requests", b"x" * 10, 9)
    reason = DecodeReason.malformed
    first, again = (dead_letter_for(msg, COMPONENT, reason, "d") for _ in range(2))
    assert first == again
    big = dead_letter_for(FakeMessage("t", b"x" * (600 * 1024)), COMPONENT, reason, "d")
    assert "raw truncated" in big.detail and len(big.raw_b64) < 700 * 1024


def test_every_table_row_matches_its_columns() -> None:
    rows = {t.name: t for t in TABLES}
    assert len(rows["request_log"].row(request(1))) == len(rows["request_log"].columns)
    for table in TABLES:
        assert len(set(table.columns)) == len(table.columns)
