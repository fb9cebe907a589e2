"""The one interface every simulated cache policy implements.

The engine owns the truth (which adapters sit in the GPU slots of a pool); a policy only
answers two questions, in O(1) or O(log n) so a million requests stay fast:
- ``on_miss``: a request missed; return the resident to evict (the pool is full), ``None``
  (a slot is free: load into it) or ``BYPASS`` (do not load; the base model serves it);
- ``tick`` (only when ``tick_s`` is set): a planner's placement changes, applied by the engine
  within slot and load budgets, as a planner on a timer would.
A policy keeps its own bookkeeping in step with its own answers; the engine checks them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from loraplane.kernel.policy import Policy
from loraplane.simulator.catalog import Catalog
from loraplane.simulator.fleet import CostModel, Pool
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import Peak

BYPASS = -1


@dataclass(frozen=True)
class PolicyContext:
    pool: Pool
    capacity: int
    catalog: Catalog
    costs: CostModel
    policy: Policy
    requests: Requests
    resident: frozenset[int] | set[int] = field(default_factory=set)
    host: Mapping[int, float] = field(default_factory=dict)
    """The pool's host tier (adapter -> bytes), read-only for policies."""
    peaks: tuple[Peak, ...] = ()
    """Scheduled peaks, known ahead like a schedule file."""


@dataclass
class Plan:
    """A planner's wish for this tick: evictions first, then loads (best first)."""

    evict: list[int] = field(default_factory=list)
    load: list[int] = field(default_factory=list)
    prewarm: list[int] = field(default_factory=list)
    """S3 -> host tier only."""


class CachePolicy:
    name: ClassVar[str]
    online: ClassVar[bool] = True
    merged: ClassVar[bool] = False
    """Serves merged weights (no LoRA compute overhead, no swaps): the seed's static merge."""
    tick_s: float | None = None
    observes: ClassVar[bool] = False
    replan_now: bool = False
    """Set by ``observe`` to ask for a tick at once (a burst), as the app re-plans on events."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.capacity = ctx.capacity

    def preload(self) -> list[int]:
        """Adapters resident before the first request (free)."""
        return []

    def observe(self, adapter: int, i: int, now: float, tier: str, ttft_ms: float) -> None:
        """Every request once served, with where its adapter was (``gpu``, ``host``, ``cold``
        or ``base_fallback``) and its TTFT: the request log. Called only if ``observes``."""

    def on_hit(self, adapter: int, i: int, now: float) -> None:
        raise NotImplementedError

    def on_miss(self, adapter: int, i: int, now: float, full: bool) -> int | None:
        raise NotImplementedError

    def tick(self, now: float) -> Plan:
        return Plan()

    def on_planned(self, loaded: list[int], evicted: list[int], now: float) -> None:
        """The part of the last ``tick``'s plan that the engine applied."""
