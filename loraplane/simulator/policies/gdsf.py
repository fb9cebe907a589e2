"""GDSF (Greedy-Dual-Size-Frequency, Cherkasova 1998): priority ``L + frequency * cost / size``;
evict the lowest and raise the clock ``L`` to it, so old priorities age out.

Cost-aware in this benchmark's terms: cost is the priority-weighted time a miss of this
adapter costs (tenant weight x host→GPU swap ms), size is one slot (vLLM slots are uniform,
padded to ``max_lora_rank``)."""

from __future__ import annotations

import heapq

from loraplane.simulator.policies.base import PolicyContext, WorkerCache

__all__ = ["GDSF"]


class GDSF(WorkerCache):
    name = "gdsf"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        costs = ctx.costs
        self.value = [
            costs.weight(a.priority) * costs.swap_ms(a.size_bytes) for a in ctx.catalog.adapters
        ]
        self.clock = 0.0
        self.freq: dict[int, int] = {}
        self.priority: dict[int, float] = {}
        self.heap: list[tuple[float, int]] = []

    def _touch(self, adapter: int) -> None:
        self.freq[adapter] = self.freq.get(adapter, 0) + 1
        p = self.clock + self.freq[adapter] * self.value[adapter]
        self.priority[adapter] = p
        heapq.heappush(self.heap, (p, adapter))

    def on_hit(self, adapter: int, i: int, now: float) -> None:
        self._touch(adapter)

    def on_miss(self, adapter: int, i: int, now: float, full: bool) -> int | None:
        victim = None
        if full:
            while True:
                p, node = heapq.heappop(self.heap)
                if self.priority.get(node) == p:
                    break
            victim = node
            self.clock = p
            del self.priority[node], self.freq[node]
        self._touch(adapter)
        return victim
