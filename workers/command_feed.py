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

Broker restarts and rebalances heal inside librdkafka (the consumer rejoins and resumes from
the committed offsets); what this module adds is that no call blocks without bound (a poll
has its timeout, a commit gives up after ``COMMIT_TIMEOUT_S`` and the agent's loop logs it)
and that a feed that cannot reach Kafka says so: ``progress`` (``kernel.progress``: a
``STALLED worker-commands`` log line, ``consumer_stuck_seconds`` on the worker's /metrics).
"""

from __future__ import annotations

import asyncio
import time
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
from loraplane.kernel.progress import Progress

COMPONENT = "worker-agent"
COMMIT_TIMEOUT_S = 30.0
PROBE_EVERY_S = 5.0


@dataclass(frozen=True)
class Delivery:
    command: CacheCommand
    message: Any  # the confluent_kafka.Message, for commit


def _partition_eof() -> int:
    from confluent_kafka import KafkaError

    return KafkaError._PARTITION_EOF


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
        self.progress = Progress("worker-commands")
        self._probed = 0.0

    async def next(self, timeout_s: float = 0.5) -> Delivery | None:
        """The next command for this worker, or None when none arrived in ``timeout_s``."""
        msg = await asyncio.to_thread(self._consumer.poll, timeout_s)
        if msg is None:
            await self._probe()
            return None
        if (err := msg.error()) is not None:
            if err.code() != _partition_eof():
                self.progress.blocked(f"kafka: {err}")
                self.progress.check()
            return None
        self.progress.advanced()
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

    async def _probe(self) -> None:
        """While held up, ask the broker for the topic's metadata now and then: an idle
        feed has no message to prove it is connected again."""
        if self.progress.stuck_s() == 0.0 or time.monotonic() - self._probed < PROBE_EVERY_S:
            return
        self._probed = time.monotonic()
        try:
            await asyncio.to_thread(self._consumer.list_topics, self._topic, timeout=2.0)
        except Exception as exc:
            self.progress.blocked(f"kafka: {exc}")
            self.progress.check()
        else:
            self.progress.advanced()

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
        """Commit past ``message``; bounded, so a broker away cannot hold the loop (the
        raised error is logged by the agent's loop and the next commit covers this one)."""
        try:
            await asyncio.wait_for(asyncio.to_thread(
                self._consumer.commit, message=message, asynchronous=False), COMMIT_TIMEOUT_S)
        except Exception as exc:
            self.progress.blocked(f"commit: {exc or type(exc).__name__}")
            raise

    def close(self) -> None:
        self._consumer.close()
