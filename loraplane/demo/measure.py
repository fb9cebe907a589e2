"""What ClickHouse recorded for a run's window: the raw request, cache-event, lifecycle-audit
and dead-letter rows (a load test's window holds thousands of rows at most).

Rows are read with ``FINAL`` (replayed Kafka messages count once) and every value is bound
through clickhouse-driver's parameters. Aggregation is left to the pure ``results`` module,
so the numbers a load test prints are computed by tested code from exactly these rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from loraplane.kernel.config import Settings

__all__ = [
    "AUDIT_SQL",
    "CACHE_SQL",
    "COUNT_SQL",
    "DEAD_LETTERS_SQL",
    "REQUESTS_SQL",
    "SHADOW_COUNT_SQL",
    "AuditRow",
    "CacheRow",
    "DeadLetterRow",
    "Recorded",
    "RequestRow",
    "fetch",
    "request_count",
    "wait_for_rows",
]


@dataclass(frozen=True)
class RequestRow:
    adapter_id: str
    adapter_version: str
    worker_id: str
    request_class: str
    tier: str
    status: str
    error: str
    ttft_ms: float | None
    swap_ms: float


@dataclass(frozen=True)
class CacheRow:
    ts: datetime  # UTC, whole seconds (the table's resolution on ClickHouse 18)
    worker_id: str
    adapter_id: str
    adapter_version: str
    lora_name: str
    kind: str
    swap_ms: float
    reason: str
    detail: str


@dataclass(frozen=True)
class DeadLetterRow:
    component: str
    reason: str
    detail: str


@dataclass(frozen=True)
class AuditRow:
    ts: datetime  # UTC, whole seconds
    action: str
    adapter_id: str
    decision: str  # accepted | rejected


@dataclass(frozen=True)
class Recorded:
    requests: list[RequestRow]
    cache: list[CacheRow]
    dead_letters: list[DeadLetterRow]
    audit: list[AuditRow]


_FILTER = """ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)
    AND (%(all)s = 1 OR adapter_id IN %(ids)s)"""

REQUESTS_SQL = f"""SELECT adapter_id, adapter_version, worker_id, request_class, tier, status,
    error, ttft_ms, swap_ms FROM request_log FINAL WHERE {_FILTER}"""
CACHE_SQL = f"""SELECT toUnixTimestamp(ts), worker_id, adapter_id, adapter_version, lora_name,
    kind, swap_ms, reason, detail FROM cache_events FINAL WHERE {_FILTER} ORDER BY ts"""
AUDIT_SQL = f"""SELECT toUnixTimestamp(ts), action, adapter_id, decision FROM lifecycle_audit
    FINAL WHERE {_FILTER} ORDER BY ts"""
DEAD_LETTERS_SQL = """SELECT component, reason, detail FROM dead_letters FINAL
    WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)"""
COUNT_SQL = f"SELECT count() FROM request_log FINAL WHERE {_FILTER}"
SHADOW_COUNT_SQL = COUNT_SQL + " AND request_class = 'shadow'"
"""The agent's own golden-set requests (``workers.golden_set``): logged, never a client's."""


def _params(since: datetime, until: datetime, adapter_ids: Sequence[str]) -> dict[str, Any]:
    return {
        "since": int(since.timestamp()),
        "until": int(until.timestamp()) + 1,
        "all": 0 if adapter_ids else 1,
        "ids": tuple(adapter_ids) or ("",),
    }


def fetch(
    settings: Settings, since: datetime, until: datetime, adapter_ids: Sequence[str] = ()
) -> Recorded:
    """Every row of the window; ``adapter_ids`` limits all but the dead letters
    (dead letters have no adapter column: all of the window's)."""
    from loraplane.metrics.clickhouse import connect

    params = _params(since, until, adapter_ids)
    client = connect(settings, reader=True)
    try:
        return Recorded(
            requests=[RequestRow(*r) for r in client.execute(REQUESTS_SQL, params)],
            cache=[
                CacheRow(datetime.fromtimestamp(r[0], UTC), *r[1:])
                for r in client.execute(CACHE_SQL, params)
            ],
            dead_letters=[DeadLetterRow(*r) for r in client.execute(DEAD_LETTERS_SQL, params)],
            audit=[
                AuditRow(datetime.fromtimestamp(r[0], UTC), *r[1:])
                for r in client.execute(AUDIT_SQL, params)
            ],
        )
    finally:
        client.disconnect()


def request_count(
    settings: Settings,
    since: datetime,
    until: datetime,
    adapter_ids: Sequence[str] = (),
    *,
    shadow_only: bool = False,
) -> int:
    """Request-log rows of the window (of ``adapter_ids`` only, when given; only the
    agents' own golden-set requests with ``shadow_only``)."""
    from loraplane.metrics.clickhouse import connect

    client = connect(settings, reader=True)
    try:
        sql = SHADOW_COUNT_SQL if shadow_only else COUNT_SQL
        return int(client.execute(sql, _params(since, until, adapter_ids))[0][0])
    finally:
        client.disconnect()


def wait_for_rows(
    count: Callable[[], int], expected: int, timeout_s: float = 60.0, settle_s: float = 3.0
) -> int:
    """Poll ``count`` until it reaches ``expected`` (the sink is asynchronous) or stops
    growing for ``settle_s`` after the timeout; returns the last count."""
    deadline = time.monotonic() + timeout_s
    last, changed = -1, time.monotonic()
    while True:
        n = count()
        if n >= expected:
            return n
        if n != last:
            last, changed = n, time.monotonic()
        if time.monotonic() > deadline and time.monotonic() - changed > settle_s:
            return n
        time.sleep(1.0)
