"""The interfaces every simulated cache policy implements.

The engine owns the truth (which adapters sit in the GPU slots of each worker) and routes
every request to a worker as the fleet router does; a policy only answers, per worker, in
O(1) or O(log n) so a million requests stay fast:
- ``on_miss``: a request routed to ``worker`` missed there; return that worker's resident to
  evict (it is full), ``None`` (a slot is free: load into it) or ``BYPASS`` (do not load; the
  base model serves it);
- ``tick`` (only when ``tick_s`` is set): a planner's placement changes, per worker, applied
  by the engine within slot and load budgets, as a planner on a timer would.
A policy keeps its own bookkeeping in step with its own answers; the engine checks them.

``CachePolicy`` is what the engine drives, one per base model. A demand-loading cache (LRU,
GDSF, ...) is a ``WorkerCache``, one instance per worker behind ``PerWorker``, so every
policy manages each worker's own slots behind the same routing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from loraplane.kernel.policy import Policy
from loraplane.simulator.catalog import Catalog
from loraplane.simulator.fleet import CostModel, Pool
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import Peak

__all__ = ["BYPASS", "CachePolicy", "Copy", "PerWorker", "Plan", "PolicyContext", "WorkerCache"]

BYPASS = -1
Copy = tuple[int, int]
"""(worker index, adapter index): one GPU or host copy."""


@dataclass(frozen=True)
class PolicyContext:
    pool: Pool
    capacity: int
    """GPU slots of one worker."""
    catalog: Catalog
    costs: CostModel
    policy: Policy
    requests: Requests
    residents: Sequence[frozenset[int] | set[int]] = ()
    """Per worker: its GPU residents (read-only for policies)."""
    hosts: Sequence[Mapping[int, float]] = ()
    """Per worker: its host tier (adapter -> bytes), read-only for policies."""
    peaks: tuple[Peak, ...] = ()
    """Scheduled peaks, known ahead like a schedule file."""
    recent_loads: Callable[[int, float], int] = lambda worker, now: 0
    """GPU loads a worker started in the rolling minute before ``now`` (its load budget)."""
    worker: int = 0
    """The worker a ``WorkerCache`` manages."""
    stall_fraction: float = 0.0
    """The share of decode rate a load takes (``Interference.stall_fraction``): what a worker
    measures of its loads (``workers.load_interference``), here known."""

    @property
    def resident(self) -> frozenset[int] | set[int]:
        return self.residents[self.worker] if self.residents else frozenset()

    @property
    def host(self) -> Mapping[int, float]:
        return self.hosts[self.worker] if self.hosts else {}

    def for_worker(self, worker: int) -> PolicyContext:
        return replace(self, worker=worker)


@dataclass
class Plan:
    """A planner's wish for this tick, per copy: evictions first, then loads (best first)."""

    evict: list[Copy] = field(default_factory=list)
    load: list[Copy] = field(default_factory=list)
    prewarm: list[Copy] = field(default_factory=list)
    """S3 -> host tier only."""


class CachePolicy:
    """What the engine drives: one instance per base model, told the worker of each event."""

    name: str = ""
    online: bool = True
    merged: bool = False
    """Serves merged weights (no LoRA compute overhead, no swaps): the seed's static merge."""
    tick_s: float | None = None
    observes: bool = False
    replan_now: bool = False
    """Set by ``observe`` to ask for a tick at once (a burst), as the app re-plans on events."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.capacity = ctx.capacity

    def preload(self) -> list[Copy]:
        """Copies resident before the first request (free)."""
        return []

    def observe(
        self, worker: int, adapter: int, i: int, now: float, tier: str, ttft_ms: float
    ) -> None:
        """Every request once served, with where its adapter was (``gpu``, ``host``, ``cold``
        or ``base_fallback``) and its TTFT: the request log. Called only if ``observes``."""

    def on_hit(self, worker: int, adapter: int, i: int, now: float) -> None:
        raise NotImplementedError

    def on_miss(self, worker: int, adapter: int, i: int, now: float, full: bool) -> int | None:
        raise NotImplementedError

    def tick(self, now: float) -> Plan:
        return Plan()

    def declines(self, worker: int, adapter: int, i: int, now: float, full: bool) -> bool:
        """Would the policy refuse this miss's load whatever the budget (the worker's
        admission, which the gateway asks before it looks at the budget)? Asked only when the
        budget is spent: a declined request gets its class's own answer, not the wait for the
        budget. No side effects beyond what ``on_miss`` would do first (demand counting)."""
        return False

    def loads_per_minute(self, worker: int) -> int | None:
        """The worker's cold-load budget now, when the policy adapts it (None: the pool's)."""
        return None

    def on_loaded(self, worker: int, start: float, end: float) -> None:
        """A GPU load ran on ``worker`` over ``[start, end]`` (its fetch included)."""

    def on_planned(self, loaded: list[Copy], evicted: list[Copy], now: float) -> None:
        """The part of the last ``tick``'s plan that the engine applied."""


class WorkerCache:
    """A demand-loading cache of one worker's GPU slots (``ctx.worker``, ``ctx.capacity``)."""

    name: str = ""
    online: bool = True
    merged: bool = False

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.capacity = ctx.capacity

    def preload(self) -> list[int]:
        return []

    def on_hit(self, adapter: int, i: int, now: float) -> None:
        raise NotImplementedError

    def on_miss(self, adapter: int, i: int, now: float, full: bool) -> int | None:
        raise NotImplementedError


class PerWorker(CachePolicy):
    """One ``WorkerCache`` per worker: each worker's policy loads what is routed to it."""

    def __init__(self, ctx: PolicyContext, cache: type[WorkerCache]) -> None:
        super().__init__(ctx)
        self.caches = [cache(ctx.for_worker(w)) for w in range(ctx.pool.workers)]
        self.name, self.online, self.merged = cache.name, cache.online, cache.merged

    def preload(self) -> list[Copy]:
        return [(w, a) for w, c in enumerate(self.caches) for a in c.preload()]

    def on_hit(self, worker: int, adapter: int, i: int, now: float) -> None:
        self.caches[worker].on_hit(adapter, i, now)

    def on_miss(self, worker: int, adapter: int, i: int, now: float, full: bool) -> int | None:
        return self.caches[worker].on_miss(adapter, i, now, full)
