"""LRU: evict the least recently used adapter. What vLLM (``max_loras``), NVIDIA NIM and
TensorRT-LLM do with their GPU LoRA slots."""

from __future__ import annotations

from collections import OrderedDict

from loraplane.simulator.policies.base import PolicyContext, WorkerCache

__all__ = ["LRU"]


class LRU(WorkerCache):
    name = "lru"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.order: OrderedDict[int, None] = OrderedDict()

    def on_hit(self, adapter: int, i: int, now: float) -> None:
        self.order.move_to_end(adapter)

    def on_miss(self, adapter: int, i: int, now: float, full: bool) -> int | None:
        victim = self.order.popitem(last=False)[0] if full else None
        self.order[adapter] = None
        return victim
