"""SIEVE (Zhang et al., NSDI 2024): a FIFO queue with a visited bit and a hand that moves
from the oldest towards the newest, clearing bits and evicting the first unvisited entry.
Survivors stay in place (no reordering), which keeps hits O(1) and lock-free in real caches."""

from __future__ import annotations

from loraplane.simulator.policies.base import PolicyContext, WorkerCache

__all__ = ["SIEVE"]


class SIEVE(WorkerCache):
    name = "sieve"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.newer: dict[int, int | None] = {}  # towards the head (newest)
        self.older: dict[int, int | None] = {}  # towards the tail (oldest)
        self.visited: dict[int, bool] = {}
        self.head: int | None = None
        self.tail: int | None = None
        self.hand: int | None = None

    def on_hit(self, adapter: int, i: int, now: float) -> None:
        self.visited[adapter] = True

    def _unlink(self, node: int) -> None:
        newer, older = self.newer.pop(node), self.older.pop(node)
        del self.visited[node]
        if newer is None:
            self.head = older
        else:
            self.older[newer] = older
        if older is None:
            self.tail = newer
        else:
            self.newer[older] = newer

    def _evict(self) -> int:
        node = self.hand if self.hand is not None else self.tail
        while node is not None and self.visited[node]:
            self.visited[node] = False
            node = self.newer[node]
            if node is None:
                node = self.tail
        assert node is not None
        self.hand = self.newer[node]
        self._unlink(node)
        return node

    def on_miss(self, adapter: int, i: int, now: float, full: bool) -> int | None:
        victim = self._evict() if full else None
        self.older[adapter] = self.head
        self.newer[adapter] = None
        self.visited[adapter] = False
        if self.head is not None:
            self.newer[self.head] = adapter
        self.head = adapter
        if self.tail is None:
            self.tail = adapter
        return victim
