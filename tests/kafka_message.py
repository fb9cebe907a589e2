"""A consumed confluent-kafka Message as far as our code reads it (topic, position, key,
value, timestamp), for unit tests of the parts that take one: folds and dead letters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class FakeMessage:
    raw: bytes | None
    k: bytes | None = b"k"
    t: str = "t.requests"
    part: int = 0
    off: int = 0
    ts_ms: int = 1_800_000_000_000

    def topic(self) -> str:
        return self.t

    def partition(self) -> int:
        return self.part

    def offset(self) -> int:
        return self.off

    def key(self) -> bytes | None:
        return self.k

    def value(self) -> bytes | None:
        return self.raw

    def timestamp(self) -> tuple[int, int]:
        return (1, self.ts_ms)

    def error(self) -> None:
        """A consumed message without a transport error."""
        return None


@dataclass
class PartitionMetadata:
    leader: int = 1
    """The broker leading the partition; -1 while none does."""


@dataclass
class TopicMetadata:
    """``list_topics``'s answer for one topic: its partitions, or the error the broker gave."""

    partitions: dict[int, PartitionMetadata]
    error: Any = None


@dataclass
class ClusterMetadata:
    topics: dict[str, TopicMetadata]


class AssignedConsumer:
    """What a consumer that assigns itself partitions calls besides poll and commit (the
    worker's command feed): the broker's partition count (``partitions``, changeable) and
    the assignment, kept as a set of partition numbers."""

    partitions = 64
    assigned: set[int]

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> ClusterMetadata:
        return ClusterMetadata(
            {topic or "": TopicMetadata({p: PartitionMetadata() for p in range(self.partitions)})}
        )

    def assign(self, partitions: list[Any]) -> None:
        self.assigned = {tp.partition for tp in partitions}

    def incremental_assign(self, partitions: list[Any]) -> None:
        self.assigned |= {tp.partition for tp in partitions}

    def incremental_unassign(self, partitions: list[Any]) -> None:
        self.assigned -= {tp.partition for tp in partitions}

    def close(self) -> None:
        self.closed = True
