"""Builds ``dashboards/grafana/loraplane.json`` from the query pack, so Grafana runs the very
same SQL as ``loraplane report`` and the built-in dashboard. Run
``python -m loraplane.dashboards.grafana_export`` after editing a query; a unit test fails on
drift."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraplane.metrics.queries import grafana_sql

OUT = Path(__file__).resolve().parent / "grafana" / "loraplane.json"
DATASOURCE = {"type": "grafana-clickhouse-datasource", "uid": "${datasource}"}

# (query, title, panel type, y fields) in display order.
PANELS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("timeseries_requests", "Hot adapter hit rate", "timeseries", ("hot_adapter_hit_rate",)),
    ("timeseries_requests", "TTFT ms p50 / p95 / p99", "timeseries",
     ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms")),
    ("timeseries_cache", "Adapter swap ms p50 / p95 / p99", "timeseries",
     ("swap_p50_ms", "swap_p95_ms", "swap_p99_ms")),
    ("timeseries_requests", "Cold arrivals / min", "timeseries", ("cold_n",)),
    ("timeseries_cache", "Cold load fail ratio", "timeseries", ("cold_load_fail_ratio",)),
    ("adapter_summary", "Per adapter (exact)", "table", ()),
    ("cache_summary", "Swaps, failures, KV conflicts", "table", ()),
    ("cold_start_cost", "Top adapters by cold-start cost", "table", ()),
    ("load_failures", "Load failures by reason", "table", ()),
    ("never_hot", "Adapters that never got hot", "table", ()),
    ("canary_vs_stable", "Canary vs stable TTFT", "table", ()),
    ("kv_conflicts", "KV namespace conflicts", "table", ()),
    ("decisions", "Planner decisions and why", "table", ()),
    ("worker_summary", "Per worker", "table", ()),
)


def _variable(name: str, label: str, column: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": f"SELECT DISTINCT {column} FROM request_log ORDER BY {column}",
            "includeAll": True, "allValue": "", "multi": False, "refresh": 2,
            "current": {"text": "All", "value": "$__all"}}


def _panel(i: int, query: str, title: str, kind: str, fields: tuple[str, ...],
           ) -> dict[str, Any]:
    sql = grafana_sql(query)
    if kind == "timeseries":
        keep = ", ".join(fields)
        sql = f"SELECT minute AS time, adapter_id, {keep} FROM (\n{sql}\n)"
    width = 12 if kind == "timeseries" else 24
    return {
        "id": i + 1, "title": title, "type": kind, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": width, "x": (i % 2) * 12 if kind == "timeseries" else 0,
                    "y": i * 8},
        "targets": [{"refId": "A", "datasource": DATASOURCE, "editorType": "sql",
                     "format": 0 if kind == "timeseries" else 1, "queryType": kind,
                     "rawSql": sql}],
        "transformations": ([{"id": "prepareTimeSeries", "options": {"format": "multi"}}]
                            if kind == "timeseries" else []),
        "description": f"dashboards/queries/{query}.sql",
    }


def build() -> dict[str, Any]:
    return {
        "title": "loraplane adapters", "uid": "loraplane-adapters", "schemaVersion": 39,
        "tags": ["loraplane"], "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "label": "ClickHouse", "type": "datasource",
             "query": "grafana-clickhouse-datasource"},
            _variable("base_model", "base model", "base_model"),
            _variable("tenant", "tenant", "tenant_id"),
            _variable("adapter", "adapter", "adapter_id"),
        ]},
        "panels": [_panel(i, *spec) for i, spec in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
