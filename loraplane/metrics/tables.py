"""Which Kafka topic fills which ClickHouse table, and how one message becomes one row.

Pure mapping code (no I/O): the sink decodes with ``schemas.codec.decode`` and hands the model
to ``Table.row``. Optional strings become '' so the tables need no Nullable string columns.
Integers the wire schema leaves unbounded are range-checked here because clickhouse-driver
silently wraps an out-of-range UInt64 (2**70 is stored as 0, even with ``types_check``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from loraplane.schemas.audit import AuditRecord
from loraplane.schemas.cache_event import CacheEvent
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.request_log import RequestLog

UINT64_MAX = 2**64 - 1


class RowError(ValueError):
    """A valid message that the table cannot represent faithfully."""


def _uint64(name: str, value: int) -> int:
    if not 0 <= value <= UINT64_MAX:
        raise RowError(f"{name}={value} does not fit UInt64")
    return value


@dataclass(frozen=True)
class Table:
    """One raw table: its source topic (by suffix), wire model, columns and row builder."""

    topic_suffix: str
    name: str
    model: type[BaseModel]
    columns: tuple[str, ...]
    row: Callable[[Any], tuple[Any, ...]]

    @property
    def insert_sql(self) -> str:
        return f"INSERT INTO {self.name} ({', '.join(self.columns)}) VALUES"


def _request_row(m: RequestLog) -> tuple[Any, ...]:
    return (m.event_id, m.ts, m.request_id, m.tenant_id, m.base_model, m.adapter_id,
            m.adapter_version or "", m.lora_name or "", m.worker_id, m.request_class.value,
            m.tier_at_arrival.value, m.ttft_ms, m.swap_ms, m.queue_ms, m.prompt_tokens,
            m.output_tokens, m.status.value, m.error or "")


def _cache_row(m: CacheEvent) -> tuple[Any, ...]:
    return (m.event_id, m.ts, m.worker_id, m.base_model, m.tenant_id, m.adapter_id,
            m.adapter_version, m.lora_name, m.kind.value, m.swap_ms, _uint64("bytes", m.bytes),
            str(m.reason), m.detail, m.command_id or "")


def _decision_row(m: CacheCommand) -> tuple[Any, ...]:
    return (m.command_id, m.issued_at, m.deadline, m.worker_id, m.action.value, m.base_model,
            m.tenant_id, m.adapter_id, m.version, m.sha256, m.lora_name, m.reason.rule.value,
            m.reason.score, m.reason.detail, m.warmup_requests)


def _audit_row(m: AuditRecord) -> tuple[Any, ...]:
    return (m.event_id, m.ts, m.component, m.action, m.decision, str(m.reason),
            m.subject_event_id or "", m.tenant_id or "", m.adapter_id or "", m.version or "",
            m.actor, m.detail)


def _dead_letter_row(m: DeadLetter) -> tuple[Any, ...]:
    return (m.event_id, m.ts, m.source_topic, m.partition, m.offset, m.component, m.reason.value,
            m.detail, m.key_b64 or "", m.raw_b64)


TABLES: tuple[Table, ...] = (
    Table("requests", "request_log", RequestLog,
          ("event_id", "ts", "request_id", "tenant_id", "base_model", "adapter_id",
           "adapter_version", "lora_name", "worker_id", "request_class", "tier", "ttft_ms",
           "swap_ms", "queue_ms", "prompt_tokens", "output_tokens", "status", "error"),
          _request_row),
    Table("cache-events", "cache_events", CacheEvent,
          ("event_id", "ts", "worker_id", "base_model", "tenant_id", "adapter_id",
           "adapter_version", "lora_name", "kind", "swap_ms", "bytes", "reason", "detail",
           "command_id"),
          _cache_row),
    Table("decisions", "decisions", CacheCommand,
          ("command_id", "ts", "deadline", "worker_id", "action", "base_model", "tenant_id",
           "adapter_id", "adapter_version", "sha256", "lora_name", "rule", "score", "detail",
           "warmup_requests"),
          _decision_row),
    Table("audit", "lifecycle_audit", AuditRecord,
          ("event_id", "ts", "component", "action", "decision", "reason", "subject_event_id",
           "tenant_id", "adapter_id", "adapter_version", "actor", "detail"),
          _audit_row),
    Table("dead-letters", "dead_letters", DeadLetter,
          ("event_id", "ts", "source_topic", "partition", "offset", "component", "reason",
           "detail", "key_b64", "raw_b64"),
          _dead_letter_row),
)
