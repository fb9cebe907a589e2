"""A Dynamo-style baseline (NVIDIA Dynamo's LoRA allocation, as its design describes it):
replicas in proportion to smoothed demand, placed by rendezvous hashing, with scale-down
hysteresis and a churn penalty. Our reading of the design, not its code.

Every ``TICK_S`` each adapter's smoothed request rate (EWMA, ``SMOOTHING``) sets its replica
count (a share of the pool's slots; an adapter holding copies counts its demand ``1 + CHURN``
times, and a lower count waits ``DOWN_TICKS`` ticks), and its copies go to the first workers
with room in its rendezvous order, so the same adapter lands on the same workers tick after
tick. Between ticks a miss loads on demand, evicting the least demanded copy not assigned to
that worker. The rules: docs/simulator.md, "The Dynamo-style baseline".
"""

from __future__ import annotations

import hashlib
import math

from loraplane.simulator.policies.base import CachePolicy, Copy, Plan, PolicyContext

__all__ = ["CHURN", "DOWN_TICKS", "FORGET_QPS", "SMOOTHING", "TICK_S", "Dynamo"]

TICK_S = 10.0
SMOOTHING = 0.3
DOWN_TICKS = 6
CHURN = 0.25
FORGET_QPS = 1e-4  # smoothed demand below this is dropped


class Dynamo(CachePolicy):
    name = "dynamo"
    observes = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.tick_s = TICK_S
        self.workers = ctx.pool.workers
        self.counts: dict[int, int] = {}
        self.demand: dict[int, float] = {}
        self.replicas: dict[int, int] = {}
        self.below: dict[int, int] = {}
        self.assigned: list[set[int]] = [set() for _ in range(self.workers)]
        self.order: dict[int, list[int]] = {}
        self.last: float | None = None

    def hrw(self, adapter: int) -> list[int]:
        """Workers in rendezvous order for ``adapter`` (highest hash first)."""
        order = self.order.get(adapter)
        if order is None:
            aid = self.ctx.catalog.adapters[adapter]
            key = f"{aid.adapter_id}@{aid.version}"

            def weight(w: int) -> bytes:
                return hashlib.blake2b(f"{key}\x00{w}".encode(), digest_size=8).digest()

            order = self.order[adapter] = sorted(range(self.workers), key=weight, reverse=True)
        return order

    def observe(
        self, worker: int, adapter: int, i: int, now: float, tier: str, ttft_ms: float
    ) -> None:
        self.counts[adapter] = self.counts.get(adapter, 0) + 1

    def on_hit(self, worker: int, adapter: int, i: int, now: float) -> None:
        pass

    def on_miss(self, worker: int, adapter: int, i: int, now: float, full: bool) -> int | None:
        if not full:
            return None
        mine = self.assigned[worker]
        d = self.demand
        return min(self.ctx.residents[worker], key=lambda r: (r in mine, d.get(r, 0.0), r))

    def tick(self, now: float) -> Plan:
        if self.last is None or now <= self.last:
            self.last = now
            return Plan()
        dt, self.last = now - self.last, now
        demand = self.demand
        for a in set(demand) | set(self.counts):
            rate = self.counts.get(a, 0) / dt
            value = (1 - SMOOTHING) * demand.get(a, 0.0) + SMOOTHING * rate
            if value < FORGET_QPS:
                demand.pop(a, None)
            else:
                demand[a] = value
        self.counts.clear()
        slots = self.capacity * self.workers
        total = sum(demand.values())
        held = {a for res in self.ctx.residents for a in res}
        ranked = sorted(demand, key=lambda a: (-demand[a] * (1 + CHURN * (a in held)), a))
        room = [self.capacity] * self.workers
        assigned: list[set[int]] = [set() for _ in range(self.workers)]
        replicas: dict[int, int] = {}
        left = slots
        for a in ranked:
            if left <= 0:
                break
            want = min(self.workers, max(1, math.ceil(slots * demand[a] / total)))
            now_r = self.replicas.get(a, 0)
            if want < now_r:
                self.below[a] = self.below.get(a, 0) + 1
                if self.below[a] < DOWN_TICKS:
                    want = now_r
                else:
                    self.below.pop(a, None)
            else:
                self.below.pop(a, None)
            placed = 0
            for w in self.hrw(a):
                if placed >= want or left <= 0:
                    break
                if room[w] > 0:
                    assigned[w].add(a)
                    room[w] -= 1
                    left -= 1
                    placed += 1
            replicas[a] = placed
        self.replicas, self.assigned = replicas, assigned
        plan = Plan()
        for w, res in enumerate(self.ctx.residents):
            missing = sorted(assigned[w] - res, key=lambda a: (-demand[a], a))
            spare = self.capacity - len(res)
            if len(missing) > spare:
                extra = sorted(res - assigned[w], key=lambda a: (demand.get(a, 0.0), a))
                plan.evict += [(w, a) for a in extra[: len(missing) - spare]]
            plan.load += [(w, a) for a in missing]
        return plan

    def on_planned(self, loaded: list[Copy], evicted: list[Copy], now: float) -> None:
        pass
