"""The planner's cache commands for one worker, from the Kafka commands topic.

Commands are keyed by worker_id on a shared topic; every worker reads it in its own consumer
group and keeps the messages with its key. Offsets are committed by the caller only after a
command has been applied (folded into the desired state and reconciled once), so a crash in
between redelivers it, and command_id dedup plus idempotent actions make that harmless.
Undecodable messages go to the dead-letter topic with their reason and are committed.

Nothing reaches the fold unverified: every decoded command goes through
``workers.command_trust.check_command`` (this worker's key, a planner signature from the
keyring file, fresh) first; a refused one is counted (``commands_refused{reason}``),
dead-lettered with its ``CommandRejection`` and committed, never applied. The keyring is
re-read when the file changes (``KeyringFile``); if it is missing or invalid every command
is refused (``keyring_unavailable``): fail closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import SchemaError, decode
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.dead_letter import dead_letter_for
from loraplane.schemas.keyring import Keyring, KeyringError, KeyringFile
from loraplane.schemas.reasons import CommandRejection
from loraplane.workers.command_trust import check_command
from loraplane.workers.event_sink import EventSink

from loraplane.kernel import kafka
from loraplane.kernel.config import Settings

COMPONENT = "worker-agent"


@dataclass(frozen=True)
class Delivery:
    command: CacheCommand
    message: Any  # the confluent_kafka.Message, for commit


class KafkaCommandFeed:
    def __init__(self, settings: Settings, worker_id: str, sink: EventSink, *,
                 keyring: KeyringFile, on_refused: Callable[[str], None] = lambda _: None,
                 group_id: str | None = None) -> None:
        from loraplane.kernel.topics import topic_name

        self.worker_id = worker_id
        self._sink = sink
        self._keyring = keyring
        self._on_refused = on_refused
        self._max_lifetime_s = settings.policy.command_deadline_s
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
            command = decode(CacheCommand, msg.value())
        except SchemaError as exc:
            self._sink.emit("dead-letters", self.worker_id,
                            dead_letter_for(msg, COMPONENT, exc.reason, str(exc)))
            await self.commit(msg)
            return None
        rejected = check_command(command, self._current_keyring(), worker_id=self.worker_id,
                                 kafka_key=msg.key(), now=now_utc(),
                                 max_lifetime_s=self._max_lifetime_s)
        if rejected is not None:
            self._dead_letter(msg, rejected.reason, rejected.detail)
            await self.commit(msg)
            return None
        return Delivery(command, msg)

    def _current_keyring(self) -> Keyring | None:
        try:
            return self._keyring.current()
        except KeyringError:
            return None

    def _dead_letter(self, msg: Any, reason: CommandRejection, detail: str) -> None:
        self._on_refused(reason)
        self._sink.emit("dead-letters", self.worker_id,
                        dead_letter_for(msg, COMPONENT, reason, detail))

    def refuse(self, delivery: Delivery, reason: CommandRejection, detail: str) -> None:
        """A verified command the fold refused (a replay, a protected copy)."""
        self._dead_letter(delivery.message, reason, detail)

    async def commit(self, message: Any) -> None:
        await asyncio.to_thread(self._consumer.commit, message=message, asynchronous=False)

    def close(self) -> None:
        self._consumer.close()
