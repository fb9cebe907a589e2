"""S3-FIFO (Yang et al., SOSP 2023): a small probation FIFO (10% of slots), a main FIFO with
2-bit frequency counters and reinsertion, and a ghost FIFO of recently evicted ids. One-hit
wonders leave from the small queue without disturbing the main one."""

from __future__ import annotations

from collections import OrderedDict, deque

from loraplane.simulator.policies.base import PolicyContext, WorkerCache

__all__ = ["S3FIFO"]


class S3FIFO(WorkerCache):
    name = "s3-fifo"
    small_share = 0.1

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.small_target = max(1, round(self.capacity * self.small_share))
        self.small: deque[int] = deque()
        self.main: deque[int] = deque()
        self.freq: dict[int, int] = {}
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.ghost_size = max(1, self.capacity - self.small_target)

    def on_hit(self, adapter: int, i: int, now: float) -> None:
        self.freq[adapter] = min(3, self.freq[adapter] + 1)

    def _remember(self, adapter: int) -> None:
        self.ghost[adapter] = None
        if len(self.ghost) > self.ghost_size:
            self.ghost.popitem(last=False)

    def _evict(self) -> int:
        while True:
            if self.small and (len(self.small) >= self.small_target or not self.main):
                node = self.small.popleft()
                if self.freq[node] > 0:
                    self.freq[node] = 0
                    self.main.append(node)
                    continue
                del self.freq[node]
                self._remember(node)
                return node
            node = self.main.popleft()
            if self.freq[node] > 0:
                self.freq[node] -= 1
                self.main.append(node)
                continue
            del self.freq[node]
            return node

    def on_miss(self, adapter: int, i: int, now: float, full: bool) -> int | None:
        victim = self._evict() if full else None
        self.freq[adapter] = 0
        if adapter in self.ghost:
            del self.ghost[adapter]
            self.main.append(adapter)
        else:
            self.small.append(adapter)
        return victim
