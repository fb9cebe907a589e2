"""Which Kafka topic fills which ClickHouse table, and how one message becomes one row.

Pure mapping code (no I/O): the sink decodes with ``schemas.codec.decode`` and hands the model
to ``Table.row``; a table with ``fast_columns`` (the request log: most of the sink's rows)
first hands it the raw bytes of a whole batch, and a compiled decoder fills the insert's
columns straight from them, each row as ``row`` would build it, leaving to pydantic only what
it cannot prove valid. Optional strings become '' so the tables need no Nullable string
columns. Timestamps go to clickhouse-driver as the integers it would compute itself
(``timestamp_encoder``): its own conversion of an aware datetime costs about 3 us a value.
Integers the wire schema leaves unbounded are range-checked here because clickhouse-driver
silently wraps an out-of-range UInt64 (2**70 is stored as 0, even with ``types_check``).
Timestamps are checked against ClickHouse 18.16's ``DateTime``, the narrowest timestamp column
the sink writes: UInt32 seconds, of which 18.16 reads back (and partitions) only those before
2106-02-07 right; the last day's instants read as the epoch's day. The driver cannot pack one
outside UInt32, and refusing it here names it ``out_of_range`` without bisecting a whole
insert for it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel

from loraplane.schemas.audit import AuditRecord
from loraplane.schemas.cache_event import CacheEvent
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.dead_letter import STAMP_END, STAMP_MIN, DeadLetter
from loraplane.schemas.fast_decode import fast_request_logs
from loraplane.schemas.request_log import RequestLog

__all__ = [
    "STAMP_END",
    "STAMP_MIN",
    "TABLES",
    "UINT64_MAX",
    "Columns",
    "Encoders",
    "FastColumns",
    "RowError",
    "Table",
    "add_row",
    "columns_of",
    "encoded",
    "encoders_for",
    "timestamp_encoder",
]

UINT64_MAX = 2**64 - 1


class RowError(ValueError):
    """A valid message that the table cannot represent faithfully."""


def _uint64(name: str, value: int) -> int:
    if not 0 <= value <= UINT64_MAX:
        raise RowError(f"{name}={value} does not fit UInt64")
    return value


def _signed(name: str, value: int, bits: int) -> int:
    if not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
        raise RowError(f"{name}={value} does not fit Int{bits}")
    return value


def _stamp(name: str, value: datetime) -> datetime:
    if not STAMP_MIN <= value < STAMP_END:
        raise RowError(f"{name}={value.isoformat()} is outside ClickHouse's DateTime range")
    return value


Columns = list[list[Any]]
"""One list of values per column of a table, in its column order."""

FastColumns = Callable[[Sequence[bytes | None]], tuple[Columns, list[int]]]
"""Many messages' bytes -> the columns of those it decodes, in their order, and the indices
of those it leaves to the slow way."""


@dataclass(frozen=True)
class Table:
    """One raw table: its source topic (by suffix), wire model, columns and row builder."""

    topic_suffix: str
    name: str
    model: type[BaseModel]
    columns: tuple[str, ...]
    row: Callable[[Any], tuple[Any, ...]]
    fast_columns: FastColumns | None = None
    """The columns straight from a batch of message bytes, each row as
    ``row(decode(model, raw))`` would build it; the messages it leaves (those it cannot prove
    valid) go the slow way, which takes them after all or names a refusal's reason."""

    @property
    def insert_sql(self) -> str:
        return f"INSERT INTO {self.name} ({', '.join(self.columns)}) VALUES"

    def fast_row(self, raw: bytes | None) -> tuple[Any, ...] | None:
        """One message through ``fast_columns``: its row, or None where the slow way must
        decide."""
        if self.fast_columns is None:
            return None
        columns, left = self.fast_columns([raw])
        return None if left else tuple(column[0] for column in columns)


def _request_row(m: RequestLog) -> tuple[Any, ...]:
    return (
        m.event_id,
        _stamp("ts", m.ts),
        m.request_id,
        m.tenant_id,
        m.base_model,
        m.adapter_id,
        m.adapter_version or "",
        m.lora_name or "",
        m.worker_id,
        m.request_class.value,
        m.tier_at_arrival.value,
        m.ttft_ms,
        m.swap_ms,
        m.queue_ms,
        m.prompt_tokens,
        m.output_tokens,
        m.status.value,
        m.error or "",
    )


def _fast_request_columns(raws: Sequence[bytes | None]) -> tuple[Columns, list[int]]:
    """``_request_row``'s columns, built a column at a time from the compiled decoder's
    structs (a tuple a row, transposed, costs about twice as much)."""
    logs, stamps, left = fast_request_logs(raws)
    if stamps and not (min(stamps) >= STAMP_MIN and max(stamps) < STAMP_END):
        logs, stamps, left = _stamps_in_range(len(raws), logs, stamps, left)
    columns: Columns = [
        [m.event_id for m in logs],
        stamps,
        [m.request_id for m in logs],
        [m.tenant_id for m in logs],
        [m.base_model for m in logs],
        [m.adapter_id for m in logs],
        [m.adapter_version or "" for m in logs],
        [m.lora_name or "" for m in logs],
        [m.worker_id for m in logs],
        [m.request_class._value_ for m in logs],
        [m.tier_at_arrival._value_ for m in logs],
        [m.ttft_ms for m in logs],
        [m.swap_ms for m in logs],
        [m.queue_ms for m in logs],
        [m.prompt_tokens for m in logs],
        [m.output_tokens for m in logs],
        [m.status._value_ for m in logs],
        [m.error or "" for m in logs],
    ]
    return columns, left


def _stamps_in_range(
    count: int, logs: list[Any], stamps: list[datetime], left: list[int]
) -> tuple[list[Any], list[datetime], list[int]]:
    """The decoded logs whose ``ts`` a ``DateTime`` holds; the others join ``left``, where
    ``_request_row`` refuses them by name."""
    leave = set(left)
    taken = [i for i in range(count) if i not in leave]
    keep = [j for j, stamp in enumerate(stamps) if STAMP_MIN <= stamp < STAMP_END]
    kept = set(keep)
    out = sorted(leave | {taken[j] for j in range(len(stamps)) if j not in kept})
    return [logs[j] for j in keep], [stamps[j] for j in keep], out


def _cache_row(m: CacheEvent) -> tuple[Any, ...]:
    return (
        m.event_id,
        _stamp("ts", m.ts),
        m.worker_id,
        m.base_model,
        m.tenant_id,
        m.adapter_id,
        m.adapter_version,
        m.lora_name,
        m.kind.value,
        m.swap_ms,
        _uint64("bytes", m.bytes),
        str(m.reason),
        m.detail,
        m.command_id or "",
    )


def _decision_row(m: CacheCommand) -> tuple[Any, ...]:
    return (
        m.command_id,
        _stamp("issued_at", m.issued_at),
        _stamp("deadline", m.deadline),
        m.worker_id,
        m.action.value,
        m.base_model,
        m.tenant_id,
        m.adapter_id,
        m.version,
        m.sha256,
        m.lora_name,
        m.reason.rule.value,
        m.reason.score,
        m.reason.detail,
        m.warmup_requests,
    )


def _audit_row(m: AuditRecord) -> tuple[Any, ...]:
    return (
        m.event_id,
        _stamp("ts", m.ts),
        m.component,
        m.action,
        m.decision,
        str(m.reason),
        m.subject_event_id or "",
        m.tenant_id or "",
        m.adapter_id or "",
        m.version or "",
        m.actor,
        m.detail,
    )


def _dead_letter_row(m: DeadLetter) -> tuple[Any, ...]:
    return (
        m.event_id,
        _stamp("ts", m.ts),
        m.source_topic,
        _signed("partition", m.partition, 32),
        _signed("offset", m.offset, 64),
        m.component,
        m.reason.value,
        m.detail,
        m.key_b64 or "",
        m.raw_b64,
    )


TABLES: tuple[Table, ...] = (
    Table(
        "requests",
        "request_log",
        RequestLog,
        (
            "event_id",
            "ts",
            "request_id",
            "tenant_id",
            "base_model",
            "adapter_id",
            "adapter_version",
            "lora_name",
            "worker_id",
            "request_class",
            "tier",
            "ttft_ms",
            "swap_ms",
            "queue_ms",
            "prompt_tokens",
            "output_tokens",
            "status",
            "error",
        ),
        _request_row,
        _fast_request_columns,
    ),
    Table(
        "cache-events",
        "cache_events",
        CacheEvent,
        (
            "event_id",
            "ts",
            "worker_id",
            "base_model",
            "tenant_id",
            "adapter_id",
            "adapter_version",
            "lora_name",
            "kind",
            "swap_ms",
            "bytes",
            "reason",
            "detail",
            "command_id",
        ),
        _cache_row,
    ),
    Table(
        "decisions",
        "decisions",
        CacheCommand,
        (
            "command_id",
            "ts",
            "deadline",
            "worker_id",
            "action",
            "base_model",
            "tenant_id",
            "adapter_id",
            "adapter_version",
            "sha256",
            "lora_name",
            "rule",
            "score",
            "detail",
            "warmup_requests",
        ),
        _decision_row,
    ),
    Table(
        "audit",
        "lifecycle_audit",
        AuditRecord,
        (
            "event_id",
            "ts",
            "component",
            "action",
            "decision",
            "reason",
            "subject_event_id",
            "tenant_id",
            "adapter_id",
            "adapter_version",
            "actor",
            "detail",
        ),
        _audit_row,
    ),
    Table(
        "dead-letters",
        "dead_letters",
        DeadLetter,
        (
            "event_id",
            "ts",
            "source_topic",
            "partition",
            "offset",
            "component",
            "reason",
            "detail",
            "key_b64",
            "raw_b64",
        ),
        _dead_letter_row,
    ),
)


_DATETIME_RE = re.compile(r"DateTime(64\((?P<scale>[0-9]+)[,)].*|\(.*\))?")


def timestamp_encoder(column_type: str) -> Callable[[Any], Any] | None:
    """For a ``DateTime`` or ``DateTime64(s)`` column type (as ``system.columns`` names it),
    the integer clickhouse-driver itself writes for an aware datetime (seconds, or units of
    10^-s seconds, with its rounding); None for any other type. Naive datetimes (no table
    gets any) and values that are not datetimes pass through to the driver unchanged."""
    found = _DATETIME_RE.fullmatch(column_type)
    if found is None:
        return None
    if found["scale"] is None:

        def seconds(value: Any) -> Any:
            if type(value) is datetime and value.tzinfo is not None:
                return int(value.timestamp())
            return value

        return seconds
    scale = int(found["scale"])
    if scale > 6:  # beyond the driver's microseconds: leave it to the driver
        return None
    units, per_unit = 10**scale, 10 ** (6 - scale)

    def scaled(value: Any) -> Any:
        if type(value) is datetime and value.tzinfo is not None:
            return int(value.timestamp()) * units + int(value.microsecond / per_unit)
        return value

    return scaled


Encoders = dict[int, Callable[[Any], Any]]
"""Column index -> what that column's values become for clickhouse-driver."""


def encoders_for(table: Table, types: Mapping[str, str]) -> Encoders:
    """The encoders of ``table``'s columns, given the server's type of each (by name)."""
    found = {i: timestamp_encoder(types.get(name, "")) for i, name in enumerate(table.columns)}
    return {i: encode for i, encode in found.items() if encode is not None}


def add_row(columns: Columns, row: Sequence[Any]) -> None:
    """Append one row's values to ``columns``."""
    for column, value in zip(columns, row, strict=True):
        column.append(value)


def encoded(columns: Columns, encoders: Encoders) -> Columns:
    """The columns as the driver should get each value (a new list: ``columns`` stays as it
    was, for a retry)."""
    if not encoders:
        return columns
    out = list(columns)
    for i, encode in encoders.items():
        out[i] = list(map(encode, out[i]))
    return out


def columns_of(rows: Sequence[tuple[Any, ...]], encoders: Encoders) -> Columns:
    """Rows -> the columns of a columnar insert, each value as the driver should get it."""
    return encoded([list(c) for c in zip(*rows, strict=True)], encoders)
