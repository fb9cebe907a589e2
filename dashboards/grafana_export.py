"""Builds ``dashboards/grafana/loraplane.json`` from the query pack with Grafana's own
``grafana-foundation-sdk`` (typed builders of the dashboard schema), so Grafana runs the very
same SQL as ``loraplane report`` and the built-in dashboard and the JSON is whatever Grafana's
schema says, not a hand-kept copy. Run ``python -m loraplane.dashboards.grafana_export``
after editing a query; a unit test fails on drift.

The panels query the ClickHouse plugin Grafana users install, ``grafana-clickhouse-datasource``.
The SDK ships no builder for that plugin's query, so ``ClickHouseQuery`` is one, in the SDK's
own shape (a ``Dataquery`` variant with ``to_json``).
"""

from __future__ import annotations

import enum
import json
import typing
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, table, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    DataTransformerConfig,
    VariableOption,
    VariableRefresh,
)

from loraplane.metrics.queries import grafana_sql

__all__ = [
    "DATASOURCE",
    "OUT",
    "PANELS",
    "PLUGIN",
    "ROWS",
    "ClickHouseFormat",
    "ClickHouseQuery",
    "ClickHouseQueryBuilder",
    "build",
    "render",
]

OUT = Path(__file__).resolve().parent / "grafana" / "loraplane.json"
PLUGIN = "grafana-clickhouse-datasource"
DATASOURCE = DataSourceRef(type_val=PLUGIN, uid="${datasource}")


class ClickHouseFormat(enum.IntEnum):
    """The plugin's result formats (its ``Format`` enum)."""

    TIME_SERIES = 0
    TABLE = 1


class ClickHouseQuery(cogvariants.Dataquery):
    """One SQL-editor target of grafana-clickhouse-datasource (plugin v4)."""

    def __init__(
        self,
        ref_id: str = "A",
        raw_sql: str = "",
        format_val: ClickHouseFormat = ClickHouseFormat.TABLE,
        query_type: str = "table",
        datasource: DataSourceRef | None = None,
    ) -> None:
        self.ref_id = ref_id
        self.raw_sql = raw_sql
        self.format_val = format_val
        self.query_type = query_type
        self.datasource = datasource

    def to_json(self) -> dict[str, object]:
        payload: dict[str, object] = {
            "refId": self.ref_id,
            "editorType": "sql",
            "format": self.format_val,
            "queryType": self.query_type,
            "rawSql": self.raw_sql,
        }
        if self.datasource is not None:
            payload["datasource"] = self.datasource
        return payload


class ClickHouseQueryBuilder(cogbuilder.Builder[ClickHouseQuery]):
    """Builder of ``ClickHouseQuery``, like the SDK's builders of other plugins' queries."""

    def __init__(self) -> None:
        self._internal = ClickHouseQuery()

    def build(self) -> ClickHouseQuery:
        return self._internal

    def ref_id(self, ref_id: str) -> typing.Self:
        self._internal.ref_id = ref_id
        return self

    def raw_sql(self, raw_sql: str) -> typing.Self:
        self._internal.raw_sql = raw_sql
        return self

    def format(self, format_val: ClickHouseFormat) -> typing.Self:
        self._internal.format_val = format_val
        return self

    def query_type(self, query_type: str) -> typing.Self:
        self._internal.query_type = query_type
        return self

    def datasource(self, datasource: DataSourceRef) -> typing.Self:
        self._internal.datasource = datasource
        return self


# (query, title, y fields) in display order: with y fields a time series of the rollup
# query, without them the whole query as a table.
PANELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("timeseries_requests", "Hot adapter hit rate", ("hot_adapter_hit_rate",)),
    (
        "timeseries_requests",
        "TTFT ms p50 / p95 / p99",
        ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms"),
    ),
    (
        "timeseries_cache",
        "Adapter swap ms p50 / p95 / p99",
        ("swap_p50_ms", "swap_p95_ms", "swap_p99_ms"),
    ),
    ("timeseries_requests", "Cold arrivals / min", ("cold_n",)),
    ("timeseries_cache", "Cold load fail ratio", ("cold_load_fail_ratio",)),
    ("adapter_summary", "Per adapter (exact)", ()),
    ("cache_summary", "Swaps, failures, KV conflicts", ()),
    ("cold_start_cost", "Top adapters by cold-start cost", ()),
    ("load_failures", "Load failures by reason", ()),
    ("never_hot", "Adapters that never got hot", ()),
    ("canary_vs_stable", "Canary vs stable TTFT", ()),
    ("kv_conflicts", "KV namespace conflicts", ()),
    ("decisions", "Planner decisions and why", ()),
    ("worker_summary", "Per worker", ()),
)


ROWS = {
    True: "Per minute (rollups; percentiles are t-digest estimates)",
    False: "Exact (raw tables read with FINAL)",
}


def _variable(name: str, label: str, column: str) -> dashboard.QueryVariable:
    """A label filter; its "All" is '' (the pack's "no filter")."""
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(f"SELECT DISTINCT {column} FROM request_log ORDER BY {column}")
        .include_all(True)
        .all_value("")
        .multi(False)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .current(VariableOption(text="All", value="$__all"))
    )


def _panel(
    i: int,
    query: str,
    title: str,
    fields: tuple[str, ...],
) -> cogbuilder.Builder[typing.Any]:
    sql = grafana_sql(query)
    target = ClickHouseQueryBuilder().ref_id("A").datasource(DATASOURCE)
    panel: timeseries.Panel | table.Panel
    if fields:
        # the pack keeps the newest minutes (ORDER BY minute DESC, LIMIT); Grafana turns a
        # long frame into series only when it is sorted by time, ascending
        sql = (
            f"SELECT minute AS time, adapter_id, {', '.join(fields)} FROM (\n{sql}\n)\n"
            "ORDER BY time, adapter_id"
        )
        target.format(ClickHouseFormat.TIME_SERIES).query_type("timeseries")
        panel = (
            timeseries.Panel()
            .span(12)
            .legend(
                common.VizLegendOptions()
                .show_legend(True)
                .display_mode(LegendDisplayMode.LIST)
                .placement(LegendPlacement.BOTTOM)
            )
            .tooltip(
                common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)
            )
            .with_transformation(
                DataTransformerConfig(id_val="prepareTimeSeries", options={"format": "multi"})
            )
        )
    else:
        target.format(ClickHouseFormat.TABLE).query_type("table")
        panel = table.Panel().span(24).show_header(True)
    # Height and width only: the SDK's dashboard builder lays the panels out left to right.
    return (
        panel.id(i + 1)
        .height(8)
        .title(title)
        .description(f"dashboards/queries/{query}.sql")
        .datasource(DATASOURCE)
        .with_target(target.raw_sql(sql))
    )


def build() -> dashboard.Dashboard:
    board = (
        dashboard.Dashboard("loraplane adapters")
        .uid("loraplane-adapters")
        .tags(["loraplane"])
        .time("now-6h", "now")
        .refresh("30s")
        .with_variable(dashboard.DatasourceVariable("datasource").label("ClickHouse").type(PLUGIN))
        .with_variable(_variable("base_model", "base model", "base_model"))
        .with_variable(_variable("tenant", "tenant", "tenant_id"))
        .with_variable(_variable("adapter", "adapter", "adapter_id"))
    )
    for i, spec in enumerate(PANELS):
        if i == 0 or bool(spec[2]) != bool(PANELS[i - 1][2]):  # a row per kind of panel
            board.with_row(dashboard.Row(ROWS[bool(spec[2])]).id(100 + i))
        board.with_panel(_panel(i, *spec))
    return board


def render() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
