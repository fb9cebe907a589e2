"""Static merge (the seed's first strategy): each slot holds one adapter merged into its
instance's weights, chosen once (the most popular, dealt out over the workers: worker 0 the
first ``slots``, worker 1 the next), never swapped. Requests for any other
adapter are served by the base model. No swap cost and no LoRA compute overhead, no
flexibility."""

from __future__ import annotations

from loraplane.simulator.policies.base import BYPASS, WorkerCache

__all__ = ["StaticMerge"]


class StaticMerge(WorkerCache):
    name = "static-merge"
    merged = True

    def preload(self) -> list[int]:
        mine = [
            a.index
            for a in self.ctx.catalog.adapters
            if a.base_model == self.ctx.pool.index and not a.is_canary
        ]
        start = self.ctx.worker * self.capacity
        return mine[start : start + self.capacity]

    def on_hit(self, adapter: int, i: int, now: float) -> None:
        pass

    def on_miss(self, adapter: int, i: int, now: float, full: bool) -> int | None:
        return BYPASS
