"""A consumed confluent-kafka Message as far as our code reads it (topic, position, key,
value, timestamp), for unit tests of the parts that take one: folds and dead letters."""

from __future__ import annotations

from dataclasses import dataclass


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
