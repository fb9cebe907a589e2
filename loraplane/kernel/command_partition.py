"""Which partition of the commands topic carries a worker's commands.

A worker either has a fixed command slot (``loraplane worker run --command-slot N``, e.g. a
StatefulSet ordinal) and reads partition N, or, without one, the hash ``partition_of``:
Kafka's own key hash (murmur2, where Java clients, Faust and our producers place a key; not
Python's salted ``hash``) of the worker id modulo the partition count, so a keyed write by
any of them lands where the rule says. The worker announces its partition in its
``WorkerState``; the planner sends there through ``partition_for``. Both sides take the
count from the broker's metadata (``PartitionCount``, re-read every ``REFRESH_S``), never
from the declaration, and a hashed worker keeps its old partition for ``DRAIN_S`` after a
grow. docs/architecture.md, "Command delivery"; docs/scale.md sizes the topic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    pass

__all__ = [
    "DRAIN_S",
    "REFRESH_S",
    "MetadataClient",
    "PartitionCount",
    "broker_partitions",
    "commands_partitions",
    "key_hash",
    "murmur2",
    "partition_for",
    "partition_of",
]

REFRESH_S = 30.0
"""How stale a sender's partition count may be: the broker's metadata is asked again after."""
DRAIN_S = 2 * REFRESH_S
"""How long a worker keeps reading its old partition after the topic grew: longer than any
sender can go on using the old count."""


def murmur2(data: bytes) -> int:
    """Kafka's key hash (``org.apache.kafka.common.utils.Utils.murmur2``), unsigned 32 bits."""
    m, length = 0x5BD1E995, len(data)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = data[length - length % 4 :]
    if tail:
        h ^= int.from_bytes(tail, "little")
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    return h ^ (h >> 15)


def key_hash(key: str | bytes) -> int:
    """``toPositive(murmur2(key))``: what Kafka's default partitioner takes modulo the count
    (a text key as its UTF-8 bytes, a key as read off a message as it is)."""
    return murmur2(key.encode("utf-8") if isinstance(key, str) else key) & 0x7FFFFFFF


def partition_of(key: str | bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives ``key`` on a topic of ``partitions``
    partitions (``toPositive(murmur2(key)) % n``): a worker id's commands partition, and
    the partition an adapter id's request logs and lifecycle events, and a worker's or a
    router's state records, must be on."""
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, not {partitions}")
    return key_hash(key) % partitions


def partition_for(worker_id: str, announced: int | None, partitions: int) -> int:
    """Where the planner sends ``worker_id``'s commands: the partition the worker announced
    in its latest state when it is in range, else ``partition_of``. A forged announcement
    can only misdirect that one worker's commands (each is signed for its worker)."""
    if announced is not None and 0 <= announced < partitions:
        return announced
    return partition_of(worker_id, partitions)


class MetadataClient(Protocol):
    """What of a confluent-kafka Producer, Consumer or AdminClient is used here."""

    def list_topics(self, topic: str | None = ..., timeout: float = ...) -> Any: ...


def broker_partitions(client: MetadataClient, topic: str, timeout: float) -> int:
    """``topic``'s partition count as the broker reports it now. Ask the client that sends
    or reads: librdkafka refreshes its own metadata cache with the answer. Raises
    ``LookupError`` when the broker does not know the topic (a KafkaException when it
    cannot be reached)."""
    metadata = client.list_topics(topic, timeout=timeout).topics.get(topic)
    if metadata is None or metadata.error is not None or not metadata.partitions:
        why = metadata.error if metadata is not None else "absent"
        raise LookupError(f"topic {topic} has no partitions in the broker's metadata ({why})")
    return len(metadata.partitions)


class PartitionCount:
    """A sender's view of the commands topic's partition count: ``read`` (the broker's
    metadata) at first use, then again once the value is ``refresh_s`` old. A read that
    fails keeps the last count (retried at the next call) so a broker hiccup does not stop
    sending; with no count yet the error is raised."""

    def __init__(
        self,
        read: Callable[[], int],
        *,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._refresh_s = refresh_s
        self._clock = clock
        self._count: int | None = None
        self._read_at = 0.0

    def current(self) -> int:
        """The count, re-read from the broker when stale (may block for one metadata call:
        an async caller runs it in a thread once per tick, then ``partition_of`` is cached)."""
        now = self._clock()
        if self._count is None or now - self._read_at >= self._refresh_s:
            try:
                self._count = self._read()
            except Exception:
                if self._count is None:
                    raise
            self._read_at = now
        return self._count

    def partition_of(self, worker_id: str) -> int:
        """Where a command for ``worker_id`` goes now."""
        return partition_of(worker_id, self.current())


def commands_partitions(
    topic: str, client: MetadataClient, *, timeout: float = 5.0
) -> PartitionCount:
    """The commands topic's count (``topic``: its full name) as ``client`` (the sender's
    own producer, or an admin client) learns it from the broker."""
    return PartitionCount(lambda: broker_partitions(client, topic, timeout))
