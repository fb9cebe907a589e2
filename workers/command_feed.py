"""The planner's cache commands for one worker, from the Kafka commands topic.

A worker reads one partition: its command slot, else the hash of its id
(``kernel.command_partition``), announced in its worker state so the planner sends there.
It assigns itself that partition (no group membership, no rebalance), drops by key the
commands of workers that share it, and counts the bytes it reads, its own and others'
(``loraplane_commands_read_bytes_total{own}``). A hashed worker whose partition moved when
the topic grew keeps reading the old one for ``command_partition.DRAIN_S``.

Nothing reaches the fold unverified: every command goes through
``workers.command_trust.check_command`` first; a refused or undecodable one is dead-lettered
with its reason and committed, never applied. Offsets are committed by the caller only after
a command was applied, so a crash redelivers it and command_id dedup makes that harmless. No
call blocks without bound, and a feed that cannot reach Kafka says so (``progress``).
docs/architecture.md, "Command delivery", and docs/reliability.md, "Kafka away", give the
rules.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loraplane.eventlog.sink import EventSink
from loraplane.kernel import kafka
from loraplane.kernel.command_partition import DRAIN_S, REFRESH_S, broker_partitions, partition_of
from loraplane.kernel.config import Settings
from loraplane.kernel.progress import Progress
from loraplane.kernel.thread_calls import CALLS_WAIT_S, ThreadCalls
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import SchemaError, decode
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.dead_letter import dead_letter_for
from loraplane.schemas.keyring import Keyring, KeyringError, KeyringFile
from loraplane.schemas.reasons import CommandRejection
from loraplane.workers.command_trust import check_command

__all__ = [
    "COMMIT_TIMEOUT_S",
    "COMPONENT",
    "FETCH_WAIT_MS",
    "METADATA_TIMEOUT_S",
    "PARTITIONS_EVERY_S",
    "PROBE_EVERY_S",
    "START_METADATA_TIMEOUT_S",
    "Assignment",
    "CommandSlotError",
    "Delivery",
    "KafkaCommandFeed",
    "ReadBytes",
]

COMPONENT = "worker-agent"
COMMIT_TIMEOUT_S = 30.0
PROBE_EVERY_S = 5.0
"""How often a held-up feed asks the broker whether it is back."""
PARTITIONS_EVERY_S = REFRESH_S
"""How often the feed re-reads the topic's partition count (as often as a sender does)."""
METADATA_TIMEOUT_S = 2.0
FETCH_WAIT_MS = 40
"""The longest the broker holds the feed's empty fetch. A fetch parked while the planner's
transaction was open is now and then not answered when it commits, only when it expires:
the command then reaches the worker within this, not librdkafka's 500 ms. The price: an
idle worker fetches 25 times a second (25k empty fetches/s at 1,000 workers)."""
START_METADATA_TIMEOUT_S = 10.0
"""At start the feed waits longer for the count: guessing it is the worse outcome."""


class CommandSlotError(ValueError):
    """A command slot the commands topic has no partition for."""


@dataclass
class Assignment:
    """Which commands partitions a worker reads, as the partition count changes (pure, no
    client: the feed applies the ``(add, drop)`` it returns). ``own`` is the slot, or the
    hashed partition of the current count; ``draining`` the hashed ones of earlier counts,
    each with the monotonic time after which it is dropped."""

    worker_id: str
    partitions: int
    slot: int | None = None
    own: int = field(init=False)
    draining: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.slot is not None and not 0 <= self.slot < self.partitions:
            raise CommandSlotError(
                f"command slot {self.slot} needs a commands topic of more than {self.slot} "
                f"partitions; it has {self.partitions} (grow it, or give slots 0.."
                f"{self.partitions - 1})"
            )
        self.own = (
            self.slot if self.slot is not None else partition_of(self.worker_id, self.partitions)
        )

    def assigned(self) -> list[int]:
        return sorted({self.own, *self.draining})

    def observe(self, partitions: int, now: float) -> tuple[list[int], list[int]]:
        """The broker now says ``partitions``: what to assign and what to unassign."""
        add: list[int] = []
        if self.slot is not None:  # fixed: a grow does not move it
            self.partitions = partitions
            return add, []
        if partitions != self.partitions:
            self.partitions = partitions
            own = partition_of(self.worker_id, partitions)
            if own != self.own:
                if own not in self.draining:
                    add.append(own)
                self.draining.pop(own, None)
                self.draining[self.own] = now + DRAIN_S
                self.own = own
        drop = sorted(p for p, until in self.draining.items() if until <= now or p >= partitions)
        for p in drop:
            del self.draining[p]
        return add, drop


@dataclass
class ReadBytes:
    """Key + value bytes of every commands record this feed read: its own, others'."""

    own: int = 0
    other: int = 0


@dataclass(frozen=True)
class Delivery:
    command: CacheCommand
    message: Any  # the confluent_kafka.Message, for commit


def _partition_eof() -> int:
    from confluent_kafka import KafkaError

    return KafkaError._PARTITION_EOF


class KafkaCommandFeed:
    def __init__(
        self,
        settings: Settings,
        worker_id: str,
        sink: EventSink,
        *,
        keyring: KeyringFile,
        on_refused: Callable[[str], None] = lambda _: None,
        group_id: str | None = None,
        slot: int | None = None,
    ) -> None:
        """``slot``: the fixed partition to read (``--command-slot``); None: the hash."""
        from loraplane.kernel.topics import topic_name

        self.worker_id = worker_id
        self._sink = sink
        self._keyring = keyring
        self._on_refused = on_refused
        self._max_lifetime_s = settings.policy.command_deadline_s
        self._topic = topic_name(settings, "commands")
        self._key = worker_id.encode()
        # The group only keeps offsets: an assigned consumer never joins it, so there is no
        # membership (static or not) to take back after a restart.
        self._consumer = kafka.consumer(
            settings,
            group_id or f"{settings.topic_prefix}-worker-{worker_id}",
            fetch_wait_ms=FETCH_WAIT_MS,
        )
        # poll, commit and metadata run in threads: close waits for them (``close``)
        self._threads = ThreadCalls(f"command feed of worker {worker_id}")
        self.progress = Progress("worker-commands")
        self.read_bytes = ReadBytes()
        self._probed = self._checked = time.monotonic()
        try:
            count = self._partitions(START_METADATA_TIMEOUT_S)
        except Exception as exc:  # broker away at start: the declared count until it answers
            from loraplane.kernel.topics import spec

            self.progress.blocked(f"kafka: {exc}")
            # A slot is trusted until the broker answers (``regroup`` checks it then): the
            # declared count is only a guess, and the topic may have been grown for the fleet.
            count = (
                spec("commands").partitions
                if slot is None
                else max(spec("commands").partitions, slot + 1)
            )
            self._checked = 0.0
        try:
            self.assignment = Assignment(worker_id, count, slot)
        except CommandSlotError:
            self._consumer.close()
            raise
        self._consumer.assign([self._partition(p) for p in self.assignment.assigned()])

    @property
    def partition(self) -> int:
        """The partition this worker reads its commands from now (announced in its state)."""
        return self.assignment.own

    def _partition(self, p: int) -> Any:
        """Partition ``p`` at the group's committed offset (the reset policy without one)."""
        from confluent_kafka import TopicPartition

        return TopicPartition(self._topic, p)

    def _partitions(self, timeout_s: float = METADATA_TIMEOUT_S) -> int:
        return broker_partitions(self._consumer, self._topic, timeout_s)

    async def next(self, timeout_s: float = 0.5) -> Delivery | None:
        """The next command for this worker, or None when none arrived in ``timeout_s``."""
        msg = await self._threads.run(self._consumer.poll, timeout_s)
        await self._probe(idle=msg is None)
        if msg is None:
            return None
        if (err := msg.error()) is not None:
            if err.code() != _partition_eof():
                self.progress.blocked(f"kafka: {err}")
                self.progress.check()
            return None
        self.progress.advanced()
        key = msg.key()
        size = len(key or b"") + len(msg.value() or b"")
        if key != self._key:  # a worker whose id hashes to the same partition (or a stray)
            self.read_bytes.other += size
            self._consumer.commit(message=msg, asynchronous=True)
            return None
        self.read_bytes.own += size
        try:
            command = decode(CacheCommand, msg.value())
        except SchemaError as exc:
            self._sink.emit(
                "dead-letters",
                self.worker_id,
                dead_letter_for(msg, COMPONENT, exc.reason, str(exc)),
            )
            await self.commit(msg)
            return None
        rejected = check_command(
            command,
            self._current_keyring(),
            worker_id=self.worker_id,
            kafka_key=msg.key(),
            now=now_utc(),
            max_lifetime_s=self._max_lifetime_s,
        )
        if rejected is not None:
            self._dead_letter(msg, rejected.reason, rejected.detail)
            await self.commit(msg)
            return None
        return Delivery(command, msg)

    async def _probe(self, *, idle: bool) -> None:
        """Ask the broker for the topic's metadata every ``PARTITIONS_EVERY_S`` (has it
        grown?) and, while idle and held up, every ``PROBE_EVERY_S``: an idle feed has no
        message to prove it is connected again."""
        now = time.monotonic()
        stuck = idle and self.progress.stuck_s() > 0.0 and now - self._probed >= PROBE_EVERY_S
        if not stuck and now - self._checked < PARTITIONS_EVERY_S:
            return
        self._probed = self._checked = now
        try:
            count = await self._threads.run(self._partitions)
        except Exception as exc:
            self.progress.blocked(f"kafka: {exc}")
            self.progress.check()
            return
        if stuck:
            self.progress.advanced()
        self.regroup(count, now)

    def regroup(self, partitions: int, now: float) -> None:
        """Follow a new partition count: assign the new own partition, drop drained ones."""
        add, drop = self.assignment.observe(partitions, now)
        slot = self.assignment.slot
        if slot is not None and slot >= partitions:  # trusted at start, refuted by the broker
            self.progress.blocked(
                f"command slot {slot} has no partition: the commands topic "
                f"has {partitions}; grow it, or give slots 0..{partitions - 1}"
            )
            self.progress.check()
        if drop:
            self._consumer.incremental_unassign([self._partition(p) for p in drop])
        if add:
            self._consumer.incremental_assign([self._partition(p) for p in add])

    def _current_keyring(self) -> Keyring | None:
        try:
            return self._keyring.current()
        except KeyringError:
            return None

    def _dead_letter(self, msg: Any, reason: CommandRejection, detail: str) -> None:
        self._on_refused(reason)
        self._sink.emit(
            "dead-letters", self.worker_id, dead_letter_for(msg, COMPONENT, reason, detail)
        )

    def refuse(self, delivery: Delivery, reason: CommandRejection, detail: str) -> None:
        """A verified command the fold refused (a replay, a protected copy)."""
        self._dead_letter(delivery.message, reason, detail)

    async def commit(self, message: Any) -> None:
        """Commit past ``message``; bounded, so a broker away cannot hold the loop (the
        raised error is logged by the agent's loop and the next commit covers this one)."""
        try:
            await asyncio.wait_for(
                self._threads.run(self._consumer.commit, message=message, asynchronous=False),
                COMMIT_TIMEOUT_S,
            )
        except Exception as exc:
            self.progress.blocked(f"commit: {exc or type(exc).__name__}")
            raise

    def close(self, timeout_s: float = CALLS_WAIT_S) -> bool:
        """Close the consumer once no poll, commit or metadata read runs on it in a thread
        (the task awaiting one is cancelled at a stop, a commit past ``COMMIT_TIMEOUT_S`` runs
        on): librdkafka must not destroy a handle another thread is inside. Past
        ``timeout_s``, logged, and the consumer is left to the process exit (its group offsets
        are those committed). True when closed."""
        return self._threads.close_when_drained(self._consumer.close, timeout_s)
