"""Belady's MIN (offline): evict the resident whose next request is farthest in the future,
and do not load at all when the requested adapter's own next use is farther still (bypass).
With equal miss costs this maximises the GPU hit rate of any policy that loads only on
demand; it needs the future, so it is a bound, not a policy you can run. Behind the router
each worker runs its own MIN over the fleet-wide next request of each adapter (where that
request will be routed is not known ahead): a strong offline heuristic, no longer a bound."""

from __future__ import annotations

import heapq

from loraplane.simulator.policies.base import BYPASS, PolicyContext, WorkerCache

__all__ = ["NEVER", "Belady", "next_uses"]

NEVER = 1 << 62


def next_uses(adapters: list[int]) -> list[int]:
    """For each request index, the index of the next request for the same adapter."""
    nxt = [NEVER] * len(adapters)
    seen: dict[int, int] = {}
    for i in range(len(adapters) - 1, -1, -1):
        nxt[i] = seen.get(adapters[i], NEVER)
        seen[adapters[i]] = i
    return nxt


_last: tuple[list[int], list[int]] | None = None


def _next_of(adapters: list[int]) -> list[int]:
    """``next_uses`` of the stream being replayed, computed once for all its workers."""
    global _last
    if _last is None or _last[0] is not adapters:
        _last = (adapters, next_uses(adapters))
    return _last[1]


class Belady(WorkerCache):
    name = "belady"
    online = False

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.next = _next_of(ctx.requests.adapter)
        self.due: dict[int, int] = {}
        self.heap: list[tuple[int, int]] = []  # (-next use, adapter), stale entries skipped

    def _set(self, adapter: int, i: int) -> None:
        self.due[adapter] = self.next[i]
        heapq.heappush(self.heap, (-self.next[i], adapter))

    def on_hit(self, adapter: int, i: int, now: float) -> None:
        self._set(adapter, i)

    def on_miss(self, adapter: int, i: int, now: float, full: bool) -> int | None:
        if not full:
            self._set(adapter, i)
            return None
        while True:
            neg, node = self.heap[0]
            if self.due.get(node) == -neg:
                break
            heapq.heappop(self.heap)
        if self.next[i] >= -neg:
            return BYPASS
        heapq.heappop(self.heap)
        del self.due[node]
        self._set(adapter, i)
        return node
