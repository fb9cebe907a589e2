"""The planner's cache commands for one worker, from the Kafka commands topic.

Commands are keyed by worker_id on a shared topic; every worker reads it in its own consumer
group and keeps the messages with its key. Offsets are committed by the caller only after a
command has been applied (folded into the desired state and reconciled once), so a crash in
between redelivers it, and command_id dedup plus idempotent actions make that harmless.
Undecodable messages go to the dead-letter topic with their reason and are committed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from loraplane.schemas.codec import SchemaError, decode
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.dead_letter import dead_letter_for
from loraplane.workers.event_sink import EventSink

from loraplane.kernel import kafka
from loraplane.kernel.config import Settings

COMPONENT = "worker-agent"


@dataclass(frozen=True)
class Delivery:
    command: CacheCommand
    message: Any  # the confluent_kafka.Message, for commit


class KafkaCommandFeed:
    def __init__(self, settings: Settings, worker_id: str, sink: EventSink,
                 group_id: str | None = None) -> None:
        from loraplane.kernel.topics import topic_name

        self.worker_id = worker_id
        self._sink = sink
        self._topic = topic_name(settings, "commands")
        # Static membership: a restarted agent takes its partitions back at once instead of
        # waiting for the killed one's session to time out.
        self._consumer = kafka.consumer(
            settings, group_id or f"{settings.topic_prefix}-worker-{worker_id}",
            static_member=f"worker-{worker_id}", session_timeout_ms=15_000)
        self._consumer.subscribe([self._topic])

    async def next(self, timeout_s: float = 0.5) -> Delivery | None:
        """The next command for this worker, or None when none arrived in ``timeout_s``."""
        msg = await asyncio.to_thread(self._consumer.poll, timeout_s)
        if msg is None or msg.error():
            return None
        if msg.key() != self.worker_id.encode():
            self._consumer.commit(message=msg, asynchronous=True)
            return None
        try:
            return Delivery(decode(CacheCommand, msg.value()), msg)
        except SchemaError as exc:
            self._sink.emit("dead-letters", self.worker_id,
                            dead_letter_for(msg, COMPONENT, exc.reason, str(exc)))
            await self.commit(msg)
            return None

    async def commit(self, message: Any) -> None:
        await asyncio.to_thread(self._consumer.commit, message=message, asynchronous=False)

    def close(self) -> None:
        self._consumer.close()
