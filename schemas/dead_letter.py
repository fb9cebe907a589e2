"""A message we could not accept, kept with its raw bytes and the reason, and the one way
every component builds it (``dead_letter_at``; ``dead_letter_for`` for a confluent-kafka
message, ``streams.app.dead_letter_of`` for a Faust one)."""

from __future__ import annotations

import base64
import hashlib
from datetime import UTC, datetime
from typing import Literal, Protocol

from pydantic import Field

from loraplane.schemas.base import Identifier, StrictModel, Timestamp
from loraplane.schemas.reasons import DeadLetterReason

__all__ = [
    "MAX_DEAD_LETTER_BYTES",
    "MAX_DEAD_LETTER_RAW",
    "MAX_DETAIL_CHARS",
    "MAX_KEY_BYTES",
    "STAMP_END",
    "STAMP_MIN",
    "DeadLetter",
    "KafkaMessage",
    "dead_letter_at",
    "dead_letter_for",
    "dead_letter_id",
    "dead_letter_of_observation",
]

STAMP_MIN = datetime.fromtimestamp(0, UTC)
STAMP_END = datetime(2106, 2, 7, tzinfo=UTC)
"""The instants ClickHouse's ``DateTime`` column holds, from ``STAMP_MIN`` up to, not
including, ``STAMP_END``: UInt32 seconds reach 2106-02-07 06:28:15, but 18.16's date table
ends the day before (later instants are stored and read back as the epoch's day). Every
metrics row is stamped within them (``metrics.tables``), a dead letter's own stamp too."""

_LAST_SECOND = int(STAMP_END.timestamp()) - 1


class DeadLetter(StrictModel):
    schema_version: Literal[1] = 1
    event_id: Identifier
    ts: Timestamp
    source_topic: str = Field(max_length=249)
    partition: int = Field(-1, ge=-1)
    offset: int = Field(-1, ge=-1)
    component: str = Field(max_length=64)
    reason: DeadLetterReason = Field(description="machine-readable code")
    detail: str = Field("", max_length=4096, description="human-readable, field-level")
    key_b64: str | None = Field(None, max_length=4096)
    raw_b64: str = Field(
        max_length=16 * 1024 * 1024,
        description="the original value bytes, at most the first 64 KiB",
    )
    raw_size: int = Field(0, ge=0, description="the original value's whole length in bytes")
    raw_sha256: str = Field(
        "", max_length=64, description="sha256 of the whole original value (hex)"
    )


MAX_DEAD_LETTER_RAW = 64 * 1024
"""Raw bytes kept in a dead letter. With the other fields' caps (``MAX_DEAD_LETTER_BYTES``)
no letter can come near the broker's 1 MiB ``max.message.bytes``, whatever it was built
from: a poison message must not make a poison dead letter (a letter the broker refuses
would crash-loop the component that writes it)."""
MAX_DETAIL_CHARS = 4096
MAX_KEY_BYTES = 3 * 1024  # 4 KiB of base64
MAX_DEAD_LETTER_BYTES = 128 * 1024
"""The encoded size no dead letter exceeds (checked by tests/unit/test_dead_letters.py)."""


def dead_letter_id(topic: str, partition: int, offset: int, component: str) -> str:
    """The id of ``component``'s dead letter of the message at ``topic:partition:offset``."""
    where = f"{topic}:{partition}:{offset}:{component}"
    return "dl-" + hashlib.sha256(where.encode()).hexdigest()[:32]


class KafkaMessage(Protocol):
    """What a consumed message offers (confluent-kafka's ``Message``)."""

    def topic(self) -> str | None: ...
    def partition(self) -> int | None: ...
    def offset(self) -> int | None: ...
    def key(self) -> bytes | None: ...
    def value(self) -> bytes | None: ...
    def timestamp(self) -> tuple[int, int]: ...


def dead_letter_for(
    msg: KafkaMessage, component: str, reason: DeadLetterReason, detail: str
) -> DeadLetter:
    """A dead letter whose id and timestamp depend only on the message, so a replayed batch
    produces the same record (and it collapses in ClickHouse)."""
    return dead_letter_at(
        msg.topic() or "",
        msg.partition() or 0,
        msg.offset() or 0,
        msg.key(),
        msg.value() or b"",
        msg.timestamp()[1] / 1000,
        component,
        reason,
        detail,
    )


def dead_letter_at(
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    raw: bytes,
    ts: float,
    component: str,
    reason: DeadLetterReason,
    detail: str,
) -> DeadLetter:
    """``component``'s dead letter of the message at ``topic:partition:offset``, consumed by
    any client; ``ts`` is the message's timestamp in epoch seconds.

    Id and timestamp depend only on where the message was and who refused it, never on the
    clock: a batch replayed after a crash produces the same record, which collapses in
    ClickHouse (ReplacingMergeTree by id, partitioned by ``ts``). The component is part of
    the id because several consumers read one topic (the scoring agent and the metrics sink
    both refuse a malformed request log): each one's letter is kept."""
    digest = hashlib.sha256(raw).hexdigest()
    detail = _printable(detail)[: MAX_DETAIL_CHARS - 128]
    if len(raw) > MAX_DEAD_LETTER_RAW:  # said in the text too: ClickHouse keeps the detail
        detail = f"{detail} [raw truncated from {len(raw)} bytes, sha256 {digest}]"
    return DeadLetter(
        event_id=dead_letter_id(topic, partition, offset, component),
        ts=datetime.fromtimestamp(min(max(ts, 0), _LAST_SECOND), UTC),
        source_topic=topic[:249],
        partition=max(partition, -1),
        offset=max(offset, -1),
        component=component[:64],
        reason=reason,
        detail=detail,
        key_b64=base64.b64encode(key[:MAX_KEY_BYTES]).decode() if key else None,
        raw_b64=base64.b64encode(raw[:MAX_DEAD_LETTER_RAW]).decode(),
        raw_size=len(raw),
        raw_sha256=digest,
    )


def dead_letter_of_observation(
    source: str,
    subject: str,
    raw: bytes,
    ts: float,
    component: str,
    reason: DeadLetterReason,
    detail: str,
) -> DeadLetter:
    """``component``'s dead letter of something it observed rather than consumed (vLLM
    serving a copy the worker did not load): ``source`` says where (``vllm:/v1/models``),
    ``subject`` what (a lora name), ``raw`` the observation. Its id is derived from all of
    them and ``ts``, so the letter of one observation is one record."""
    where = f"{source}:{subject}:{ts:.6f}:{component}:{reason}"
    letter = dead_letter_at(
        source, -1, -1, subject.encode()[:MAX_KEY_BYTES], raw, ts, component, reason, detail
    )
    return letter.model_copy(
        update={"event_id": "dl-" + hashlib.sha256(where.encode()).hexdigest()[:32]}
    )


def _printable(text: str) -> str:
    """``text`` as valid UTF-8 (an exception's text may carry lone surrogates from the
    bytes it quotes, which JSON encoding would refuse)."""
    return text.encode("utf-8", "replace").decode("utf-8")
