"""FIFO rotation: adapters leave in the order they arrived, hits do not matter (LoRAX-like
round-robin over its loaded adapters)."""

from __future__ import annotations

from collections import deque

from loraplane.simulator.policies.base import PolicyContext, WorkerCache

__all__ = ["FIFO"]


class FIFO(WorkerCache):
    name = "fifo"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.queue: deque[int] = deque()

    def on_hit(self, adapter: int, i: int, now: float) -> None:
        pass

    def on_miss(self, adapter: int, i: int, now: float, full: bool) -> int | None:
        victim = self.queue.popleft() if full else None
        self.queue.append(adapter)
        return victim
