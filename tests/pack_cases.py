"""One set of realistic rows and the answers every query of the pack must give on them.

The same checks run on Debian's ClickHouse 18.16 (tests/integration/test_metrics_pack_cases.py,
through clickhouse-driver) and on current ClickHouse embedded by chdb
(tests/unit/test_clickhouse_current.py): one SQL text, the same answers on both. Rows are built
from the wire models by the sink's own row builders (``metrics.tables``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from pydantic import BaseModel

from loraplane.metrics import queries, tables
from loraplane.schemas.audit import AuditRecord
from loraplane.schemas.cache_event import CacheEvent, CacheEventKind
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.reasons import ArtifactReason, CommandRule, DecodeReason
from loraplane.schemas.request_log import RequestLog, RequestStatus

BASE = "llama-3-1-8b"


class Client(Protocol):
    def execute(self, query: str, params: Any = None) -> Any: ...


def insert(client: Client, models: list[BaseModel]) -> None:
    """One INSERT per table, each row from the sink's own builder for the model's topic."""
    for table in tables.TABLES:
        rows = [table.row(m) for m in models if isinstance(m, table.model)]
        if rows:
            client.execute(table.insert_sql, rows)


MINUTE = (datetime.now(UTC) - timedelta(minutes=3)).replace(second=0, microsecond=0)


def request(
    i: int,
    adapter: str,
    version: str,
    tenant: str,
    tier: str,
    ttft: float,
    worker: str,
    request_class: str = "interactive",
) -> RequestLog:
    return RequestLog(
        event_id=f"r-{i}",
        ts=MINUTE + timedelta(seconds=i),
        request_id=f"q{i}",
        tenant_id=tenant,
        base_model=BASE,
        adapter_id=adapter,
        adapter_version=version,
        worker_id=worker,
        tier_at_arrival=tier,
        ttft_ms=ttft,
        request_class=request_class,
    )


def cache(
    i: int, kind: CacheEventKind, worker: str, swap_ms: float = 0.0, reason: str = ""
) -> CacheEvent:
    return CacheEvent(
        event_id=f"c-{i}",
        ts=MINUTE + timedelta(seconds=i),
        worker_id=worker,
        base_model=BASE,
        tenant_id="t0",
        adapter_id="alpha",
        adapter_version="1",
        lora_name="alpha@1-0123abcd",
        kind=kind,
        swap_ms=swap_ms,
        bytes=1 << 20,
        reason=reason,
        detail=f"{kind} on {worker}",
    )


def command(i: int, worker: str, score: float) -> CacheCommand:
    return CacheCommand(
        command_id=f"cmd-{i}",
        worker_id=worker,
        action=CommandAction.load_gpu,
        base_model=BASE,
        tenant_id="t0",
        adapter_id="alpha",
        version="1",
        sha256="ab" * 32,
        lora_name="alpha@1-0123abcd",
        reason=CommandReason(rule=CommandRule.hot_score, score=score, detail="qps up"),
        issued_at=MINUTE + timedelta(seconds=i),
        deadline=MINUTE + timedelta(seconds=i + 60),
    )


# alpha@1 (tenant t0) is hot on both workers; beta@2 (tenant t1) was never served from GPU.
REQUESTS = [
    request(1, "alpha", "1", "t0", "gpu", 40.0, "w0"),
    request(2, "alpha", "1", "t0", "gpu", 50.0, "w1"),
    request(3, "alpha", "1", "t0", "host", 120.0, "w0"),
    request(4, "alpha", "1", "t0", "cold", 900.0, "w1", request_class="canary"),
    request(5, "beta", "2", "t1", "cold", 800.0, "w0"),
    request(6, "beta", "2", "t1", "base_fallback", 60.0, "w1"),
]
OTHERS: list[BaseModel] = [
    cache(1, CacheEventKind.load, "w0", swap_ms=100.0),
    cache(2, CacheEventKind.load, "w1", swap_ms=300.0),
    cache(3, CacheEventKind.fail, "w0", reason=ArtifactReason.fetch_failed),
    cache(4, CacheEventKind.kv_namespace_conflict, "w1"),
    cache(5, CacheEventKind.evict, "w0"),
    command(1, "w0", 0.8),
    command(2, "w1", 0.4),
    AuditRecord(
        event_id="a-1",
        ts=MINUTE,
        component="planner",
        action="load_gpu",
        decision="issued",
        reason=CommandRule.hot_score,
        adapter_id="alpha",
    ),
    DeadLetter(
        event_id="d-1",
        ts=MINUTE,
        source_topic="loraplane.requests",
        component="metrics-sink",
        reason=DecodeReason.malformed,
        raw_b64="e30=",
    ),
]


def load(client: Client) -> None:
    """Every row once, and one request twice (a sink replay: the pack must count it once)."""
    insert(client, [*REQUESTS, *OTHERS])
    insert(client, [REQUESTS[0]])


FLOOD_START = datetime(2031, 1, 1, tzinfo=UTC)


def flood() -> list[BaseModel]:
    """ATTACK rows for the charts: in the first minute of an hour, a tenant's refused
    requests name 5,000 adapter ids, one request each (a refused request is logged with the
    id it sent); a genuine adapter is served every 20 s after, through minute 57."""
    refused = [
        request(i, f"x{i}", "1", "mallory", "cold", 0.0, "w0").model_copy(
            update={"event_id": f"flood-{i}", "ts": FLOOD_START, "status": RequestStatus.refused}
        )
        for i in range(5000)
    ]
    served = [
        request(i, "alpha", "1", "t0", "gpu", 40.0, "w0").model_copy(
            update={"event_id": f"real-{i}", "ts": FLOOD_START + timedelta(seconds=60 + 20 * i)}
        )
        for i in range(170)
    ]
    return [*refused, *served]


def flood_window() -> queries.Params:
    """The flood's hour, at the dashboard's row limit."""
    return queries.Params(since=FLOOD_START, until=FLOOD_START + timedelta(hours=1), limit=5000)


def flood_charted(rows: list[dict[str, Any]]) -> None:
    """The charts keep the genuine adapter's every minute, the latest included, and chart
    20 adapters, not 5,001."""
    alpha = sorted(r["minute"] for r in rows if r["adapter_id"] == "alpha")
    assert alpha[-1:] == [(FLOOD_START + timedelta(minutes=57)).isoformat()]
    assert len(alpha) == 57
    assert len({r["adapter_id"] for r in rows}) == 20


def window(**filters: Any) -> queries.Params:
    """Two hours around the rows, however long after import the test runs."""
    return queries.Params(
        since=MINUTE - timedelta(hours=1), until=MINUTE + timedelta(hours=1), **filters
    )


def run(client: Client, name: str) -> list[dict[str, Any]]:
    return queries.run(client, name, window())


def by(rows: list[dict[str, Any]], *keys: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {tuple(r[k] for k in keys): r for r in rows}


def check_adapter_summary(rows: list[dict[str, Any]]) -> None:
    got = by(rows, "adapter_id", "adapter_version", "tenant_id")
    alpha, beta = got["alpha", "1", "t0"], got["beta", "2", "t1"]
    assert [r["adapter_id"] for r in rows] == ["alpha", "beta"]  # most requests first
    assert (alpha["requests"], alpha["gpu_hits"], alpha["host_hits"], alpha["cold"]) == (
        4,
        2,
        1,
        1,
    )  # the replay counted once (FINAL)
    assert alpha["hot_adapter_hit_rate"] == 0.5
    # quantileExact: the element at floor(q * n) of the sorted values [40, 50, 120, 900]
    assert (alpha["ttft_p50_ms"], alpha["ttft_p95_ms"], alpha["ttft_p99_ms"]) == (
        120.0,
        900.0,
        900.0,
    )
    assert (beta["requests"], beta["gpu_hits"], beta["base_fallbacks"]) == (2, 0, 1)


def check_cache_summary(rows: list[dict[str, Any]]) -> None:
    [alpha] = rows
    assert (
        alpha["loads"],
        alpha["load_failures"],
        alpha["evictions"],
        alpha["kv_namespace_conflicts"],
    ) == (2, 1, 1, 1)
    assert (alpha["swap_p50_ms"], alpha["swap_p99_ms"]) == (300.0, 300.0)
    assert alpha["cold_load_fail_ratio"] == 0.3333


def check_cold_start_cost(rows: list[dict[str, Any]]) -> None:
    # alpha: 900 cold minus its hot p50 (50); beta has no GPU hit, so nothing is subtracted.
    assert [(r["adapter_id"], r["cold_requests"], r["cold_cost_ms"]) for r in rows] == [
        ("alpha", 1, 850.0),
        ("beta", 1, 800.0),
    ]
    assert rows[1]["hot_ttft_p50_ms"] is None  # nan: a percentile of nothing


def check_load_failures(rows: list[dict[str, Any]]) -> None:
    assert [(r["kind"], r["reason"], r["failures"], r["workers"]) for r in rows] == [
        ("fail", "fetch_failed", 1, 1)
    ]
    assert rows[0]["example_detail"] == "fail on w0"


def check_never_hot(rows: list[dict[str, Any]]) -> None:
    assert [(r["adapter_id"], r["requests"], r["cold"], r["base_fallbacks"]) for r in rows] == [
        ("beta", 2, 1, 1)
    ]


def check_canary_vs_stable(rows: list[dict[str, Any]]) -> None:
    got = {(r["adapter_id"], r["track"]): r for r in rows}
    assert set(got) == {("alpha", "canary"), ("alpha", "stable"), ("beta", "stable")}
    assert got["alpha", "canary"]["requests"] == 1
    assert got["alpha", "canary"]["ttft_p50_ms"] == 900.0
    assert (got["alpha", "stable"]["requests"], got["alpha", "stable"]["ttft_p50_ms"]) == (3, 50.0)


def check_kv_conflicts(rows: list[dict[str, Any]]) -> None:
    assert [(r["adapter_id"], r["worker_id"], r["conflicts"]) for r in rows] == [("alpha", "w1", 1)]
    assert rows[0]["first_seen"] == (MINUTE + timedelta(seconds=4)).isoformat()


def check_decisions(rows: list[dict[str, Any]]) -> None:
    [row] = rows
    assert (row["action"], row["rule"], row["commands"], row["workers"]) == (
        "load_gpu",
        "hot_score",
        2,
        2,
    )
    assert (row["avg_score"], row["max_score"]) == (0.6, 0.8)


def check_timeseries_requests(rows: list[dict[str, Any]]) -> None:
    got = by(rows, "adapter_id")
    assert {r["minute"] for r in rows} == {MINUTE.isoformat()}
    assert (got["alpha",]["requests_n"], got["alpha",]["gpu_hits_n"], got["alpha",]["cold_n"]) == (
        4,
        2,
        1,
    )  # uniqExact states: the replay counts once
    assert got["alpha",]["hot_adapter_hit_rate"] == 0.5
    assert (got["beta",]["requests_n"], got["beta",]["base_fallbacks_n"]) == (2, 1)


def check_timeseries_cache(rows: list[dict[str, Any]]) -> None:
    [alpha] = rows
    assert (alpha["loads_n"], alpha["load_failures_n"], alpha["kv_namespace_conflicts_n"]) == (
        2,
        1,
        1,
    )
    assert alpha["cold_load_fail_ratio"] == 0.3333
    assert 100.0 <= alpha["swap_p50_ms"] <= 300.0  # a t-digest estimate


def check_worker_summary(rows: list[dict[str, Any]]) -> None:
    got = by(rows, "worker_id")
    assert set(got) == {("w0",), ("w1",)}
    w0, w1 = got["w0",], got["w1",]
    assert (
        w0["requests_n"],
        w0["cold_n"],
        w0["loads_n"],
        w0["load_failures_n"],
        w0["kv_namespace_conflicts_n"],
    ) == (3, 1, 1, 1, 0)
    assert (w1["requests_n"], w1["loads_n"], w1["kv_namespace_conflicts_n"]) == (3, 1, 1)
    assert w0["hot_adapter_hit_rate"] == round(1 / 3, 4)


CHECKS = {
    name.removeprefix("check_"): check
    for name, check in globals().items()
    if name.startswith("check_")
}
