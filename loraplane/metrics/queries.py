"""The ops query pack: one documented SQL file per question in ``dashboards/queries/``.

Every query takes the same parameters (``since``/``until`` as unix seconds, the four label
filters where '' means "all", and ``limit``) and they are always bound through
clickhouse-driver's parameter substitution, which quotes and escapes each value: user input
is never formatted into SQL text. The same files feed ``loraplane report``, the built-in
dashboard and the Grafana dashboard (``grafana_sql`` rewrites the parameters into Grafana's
macros and variables).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime, timedelta
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplane.schemas.base import VERSION_PATTERN, is_id

if TYPE_CHECKING:
    from clickhouse_driver import Client

__all__ = [
    "ARRIVALS_COUNT_SQL",
    "ARRIVALS_SQL",
    "ARRIVAL_COLUMNS",
    "CACHE_COLUMNS",
    "DURATION_RE",
    "FILTERS",
    "GRAFANA_REPLACEMENTS",
    "LABELS",
    "MAX_LIMIT",
    "MAX_WINDOW",
    "NAME_RE",
    "QUERIES_DIR",
    "Params",
    "Query",
    "adapter_view",
    "check_filters",
    "count_arrivals",
    "grafana_sql",
    "load",
    "merge_adapter_view",
    "names",
    "parse_duration",
    "parse_limit",
    "request_arrivals",
    "run",
    "window",
]

# The query pack is data of the dashboards folder (ops read it there), found as package data.
QUERIES_DIR = Path(str(files("loraplane.dashboards") / "queries"))
NAME_RE = re.compile(r"[a-z][a-z0-9_]*")
DURATION_RE = re.compile(r"(?P<n>[0-9]{1,12})(?P<unit>[smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
MAX_WINDOW = timedelta(days=3650)
"""The longest ``since``: ten years, past any retention, and always after 1970 (ClickHouse's
DateTime starts there; a longer window would overflow a datetime or that type)."""
MAX_LIMIT = 100_000


@dataclass(frozen=True)
class Query:
    name: str
    summary: str  # first header line: what the query answers
    header: str  # the whole leading comment block
    sql: str


@dataclass(frozen=True)
class Params:
    """The parameters every query of the pack accepts."""

    since: datetime
    until: datetime
    base_model: str = ""
    tenant_id: str = ""
    adapter_id: str = ""
    adapter_version: str = ""
    limit: int = 1000

    def bound(self) -> dict[str, Any]:
        values = asdict(self)
        values["since"] = int(self.since.timestamp())
        values["until"] = int(self.until.timestamp())
        values["limit"] = max(1, min(int(self.limit), MAX_LIMIT))
        return values


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``1h``, ``7d``, ``2w`` -> timedelta, at most ``MAX_WINDOW``;
    ValueError with the reason for anything else."""
    m = DURATION_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"invalid duration {text[:40]!r}: use e.g. 15m, 1h, 7d")
    seconds = int(m["n"]) * _UNIT_SECONDS[m["unit"]]
    if seconds > MAX_WINDOW.total_seconds():
        raise ValueError(
            f"duration {text.strip()!r} is longer than the longest window, {MAX_WINDOW.days}d"
        )
    return timedelta(seconds=seconds)


def parse_limit(text: str) -> int:
    """A row limit from 1 to ``MAX_LIMIT`` written in ASCII digits; ValueError otherwise."""
    if not re.fullmatch(r"[0-9]{1,6}", text) or not 1 <= int(text) <= MAX_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {MAX_LIMIT}, not {text[:40]!r}")
    return int(text)


FILTERS = ("base_model", "tenant_id", "adapter_id", "adapter_version")
_VERSION = re.compile(VERSION_PATTERN)


def check_filters(filters: dict[str, Any]) -> None:
    """ValueError naming the first filter that is neither '' (all) nor what its column can
    hold (``schemas.base``'s id and version patterns): such a value matches no row, and one
    an argv could not decode (a lone surrogate) fails inside the driver's encoding."""
    for name in FILTERS:
        value = filters.get(name, "")
        version = name == "adapter_version"
        if value and not (_VERSION.fullmatch(value) if version else is_id(value)):
            what = "a version" if version else "an id"
            raise ValueError(f"{name} must be {what} or empty, not {value[:40]!r}")


def window(since: str, now: datetime | None = None, **filters: Any) -> Params:
    """Params for "the last <since>" (e.g. ``1h``) up to now; the filters checked
    (``check_filters``)."""
    check_filters(filters)
    until = now or datetime.now(UTC)
    return Params(
        since=until - parse_duration(since), until=until + timedelta(seconds=1), **filters
    )


def load(name: str, directory: Path = QUERIES_DIR) -> Query:
    """The query ``name`` of the pack, looked up among the pack's names (KeyError for any
    other: a name is never opened as a caller spelled it)."""
    if not NAME_RE.fullmatch(name):
        raise KeyError(f"invalid query name {name[:64]!r}")
    have = names(directory)
    if name not in have:
        raise KeyError(f"no query {name[:64]!r} in {directory}; have: {', '.join(have)}")
    path = directory / f"{name}.sql"
    text = path.read_text()
    lines = text.splitlines()
    header = [ln[2:].strip() for ln in lines if ln.startswith("--")]
    body = "\n".join(ln for ln in lines if not ln.startswith("--")).strip()
    summary = header[0].split(":", 1)[1].strip() if header and ":" in header[0] else name
    return Query(name, summary, "\n".join(header), body)


def names(directory: Path = QUERIES_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.sql"))


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # ClickHouse returns nan for a percentile of nothing
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat() if value.tzinfo else value.isoformat() + "Z"
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def run(client: Client, name: str, params: Params) -> list[dict[str, Any]]:
    """Run one query of the pack; rows as dicts with JSON-safe values (nan -> None)."""
    query = load(name)
    rows, columns = client.execute(query.sql, params.bound(), with_column_types=True)
    keys = [c for c, _ in columns]
    return [{k: _json_safe(v) for k, v in zip(keys, row, strict=True)} for row in rows]


LABELS = ("base_model", "adapter_id", "adapter_version", "tenant_id")
CACHE_COLUMNS = (
    "loads",
    "swap_p50_ms",
    "swap_p95_ms",
    "swap_p99_ms",
    "load_failures",
    "cold_load_fail_ratio",
    "kv_namespace_conflicts",
)


def merge_adapter_view(
    requests: list[dict[str, Any]],
    cache: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Pure: adapter_summary rows joined with cache_summary rows on the four labels; an
    adapter with cache events but no requests still appears (with zero requests)."""
    by_label = {tuple(r[k] for k in LABELS): dict(r) for r in requests}
    for row in cache:
        key = tuple(row[k] for k in LABELS)
        target = by_label.setdefault(key, {**dict(zip(LABELS, key, strict=True)), "requests": 0})
        target.update({k: row[k] for k in CACHE_COLUMNS})
    return sorted(
        by_label.values(),
        key=lambda r: (
            -r.get("requests", 0),
            r["adapter_id"],
            r["adapter_version"],
            r["tenant_id"],
        ),
    )


def adapter_view(client: Client, params: Params) -> list[dict[str, Any]]:
    """The per-adapter view of ``loraplane report``: requests, tiers and TTFT from
    adapter_summary, swaps, failures and kv conflicts from cache_summary."""
    return merge_adapter_view(
        run(client, "adapter_summary", params), run(client, "cache_summary", params)
    )


GRAFANA_REPLACEMENTS = (
    ("toDateTime(%(since)s)", "$__fromTime"),
    ("toDateTime(%(until)s)", "$__toTime"),
    ("%(base_model)s", "${base_model:sqlstring}"),
    ("%(tenant_id)s", "${tenant:sqlstring}"),
    ("%(adapter_id)s", "${adapter:sqlstring}"),
    ("%(adapter_version)s", "''"),
    ("%(limit)s", "1000"),
)


def grafana_sql(name: str) -> str:
    """The query rewritten for grafana-clickhouse-datasource: time range macros and the
    dashboard's variables (whose "All" value is '')."""
    sql = load(name).sql
    for ours, theirs in GRAFANA_REPLACEMENTS:
        sql = sql.replace(ours, theirs)
    if "%(" in sql:
        raise ValueError(f"{name}: parameter without a Grafana equivalent: {sql}")
    return sql


# The replay's read (``loraplane simulate --from-clickhouse``): every request row of a window,
# in arrival order, streamed. Plain SQL that Debian's 18.16 and current ClickHouse both run;
# FINAL so that an event the sink delivered twice replays once.
_ARRIVALS_WHERE = (
    "FROM request_log FINAL WHERE ts >= toDateTime(%(since)s) AND ts < toDateTime(%(until)s)"
)
ARRIVALS_SQL = (
    "SELECT ts, base_model, adapter_id, adapter_version, tenant_id, worker_id, "
    "request_class, prompt_tokens, output_tokens " + _ARRIVALS_WHERE + " ORDER BY ts, event_id"
)
ARRIVALS_COUNT_SQL = "SELECT count() " + _ARRIVALS_WHERE
ARRIVAL_COLUMNS = (
    "ts",
    "base_model",
    "adapter_id",
    "adapter_version",
    "tenant_id",
    "worker_id",
    "request_class",
    "prompt_tokens",
    "output_tokens",
)


def count_arrivals(client: Client, params: Params) -> int:
    """How many request rows the window holds (the replay's progress total)."""
    rows = client.execute(ARRIVALS_COUNT_SQL, params.bound())
    return int(rows[0][0])


def request_arrivals(client: Client, params: Params) -> Iterator[tuple[Any, ...]]:
    """The window's request rows (``ARRIVAL_COLUMNS``; ``ts`` a datetime, UTC), oldest first,
    streamed in blocks so a day of traffic is never one result in memory."""
    yield from client.execute_iter(
        ARRIVALS_SQL, params.bound(), settings={"max_block_size": 65_536}
    )
