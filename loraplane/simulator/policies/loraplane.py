"""loraplane's policy in the simulator: the real ``streams.scores`` and ``streams.planner``
code, driven with simulated time (``SIM_EPOCH + t``), not a re-implementation.

Served requests become request logs folded into their versions' ``ScoreState`` as the
scoring keeper folds them; every ``policy.planner_interval_s`` (and at once on a burst) the
pool's registry views, scores and one ``WorkerState`` per simulated worker go through one
``streams.planner.Planner``, whose commands become the engine's plan on the worker they
name. A request routed to a worker without a copy is loaded there on demand by the worker
agent's own rules (``workers.demand_admission``; only a copy the agent's ``make_room`` may
move gives its slot), and scheduled peaks become ``streams.schedules`` entries.
So the simulated rows decide what the product decides. The details: docs/simulator.md, "The
loraplane rows".
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime

from loraplane.kernel.command_effects import never_evict_rule, protected_cap, protected_copies
from loraplane.kernel.policy import COST_FORMULA, SEED_FORMULA
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Compatibility, Priority, Release
from loraplane.schemas.commands import CommandAction
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.request_log import RequestClass, RequestStatus, Tier
from loraplane.schemas.worker_state import LoadedAdapter, ResidentTier, WorkerState
from loraplane.simulator.catalog import Adapter
from loraplane.simulator.policies.base import BYPASS, CachePolicy, Copy, Plan, PolicyContext
from loraplane.streams import planner
from loraplane.streams.schedules import Schedule, ScheduleEntry, warmup_scores
from loraplane.streams.scores import SampleRow, ScoreState, observe_many, score_key
from loraplane.workers.demand_admission import (
    DemandCounts,
    WaitingMisses,
    any_slot,
    give_up_order,
)
from loraplane.workers.load_interference import LoadWindows, adapted_budget

__all__ = [
    "KEEPER_BATCH_S",
    "PLATINUM",
    "PLATINUM_WITH_DEMAND",
    "SIM_EPOCH",
    "Loraplane",
    "LoraplaneCost",
    "LoraplaneDemand",
    "LoraplaneSeed",
]

SIM_EPOCH = 1_704_067_200.0  # 2024-01-01T00:00:00Z: simulated t = 0
_EMPTY = ScoreState()
_TIERS = {t.value: t for t in Tier}
_CLASS = {False: RequestClass.interactive.value, True: RequestClass.batch.value}
KEEPER_BATCH_S = 1.0
"""The request logs the scoring keeper folds at once: about a second's worth (it polls up to
10,000 logs at a time, and a burst reaches the planner with the batch that fired it)."""


def _record(a: Adapter, base_model: str) -> AdapterRecord:
    sha = hashlib.sha256(f"{a.adapter_id}@{a.version}".encode()).hexdigest()
    return AdapterRecord(
        adapter_id=a.adapter_id,
        base_model=base_model,
        version=a.version,
        rank=a.rank,
        artifact_uri=f"s3://loraplane-artifacts/{a.adapter_id}/{a.version}/",
        sha256=sha,
        size_bytes=max(1, int(a.size_bytes)),
        status=AdapterStatus.canary if a.is_canary else AdapterStatus.active,
        tenant_id=a.tenant,
        priority=Priority(a.priority),
        compatibility=Compatibility(target_modules=["q_proj", "v_proj"], max_lora_rank=512),
        release=Release(canary_percent=a.canary_percent),
    )


def _schedule(ctx: PolicyContext) -> Schedule:
    entries = []
    for n, peak in enumerate(ctx.peaks):
        at = datetime.fromtimestamp(SIM_EPOCH + peak.at_s, UTC)
        adapter = ctx.catalog.adapters[min(peak.rank, ctx.catalog.regular - 1)]
        entries.append(
            ScheduleEntry(
                name=f"peak-{n}",
                cron=f"{at.minute} {at.hour} {at.day} {at.month} *",
                adapter_id=adapter.adapter_id,
                lead_minutes=peak.lead_s / 60,
                duration_minutes=max(1.0, peak.duration_s / 60),
            )
        )
    return Schedule(schedules=entries)


class Loraplane(CachePolicy):
    name = "loraplane"
    observes = True

    def __init__(self, ctx: PolicyContext) -> None:
        pool = ctx.pool
        # The simulated host tier holds at most host_slots copies per worker, its GPU copies
        # among them (vLLM's max_cpu_loras): the planner is told that many host-only copies,
        # or each tick's prewarm pushes out a copy it wanted, to be fetched again next tick
        host_only = pool.workers * max(1, pool.host_slots - pool.gpu_slots)
        if ctx.policy.host_slots_per_base_model > host_only:
            ctx = _with_policy(ctx, host_slots_per_base_model=host_only)
        super().__init__(ctx)
        self.tick_s = ctx.policy.planner_interval_s
        self.workers = [f"{pool.name}-w{n}" for n in range(pool.workers)]
        self.worker_index = {w: n for n, w in enumerate(self.workers)}
        mine = [a for a in ctx.catalog.adapters if a.base_model == pool.index]
        self.records = {a.index: _record(a, pool.name) for a in mine}
        by_id: dict[str, list[AdapterRecord]] = {}
        for r in self.records.values():
            by_id.setdefault(r.adapter_id, []).append(r)
        stamp = datetime.fromtimestamp(SIM_EPOCH, UTC)
        self.views = [
            AdapterView(
                adapter_id=aid,
                tenant_id=rs[0].tenant_id,
                base_model=pool.name,
                active_version=next(r.version for r in rs if r.status is AdapterStatus.active),
                versions=rs,
                last_seq=1,
                last_event_id=f"sim-{aid}",
                updated_at=stamp,
            )
            for aid, rs in by_id.items()
        ]
        self.index_of = {r.lora_name: i for i, r in self.records.items()}
        self.key = {i: score_key(r.adapter_id, r.version) for i, r in self.records.items()}
        self.pairs = sorted({(r.adapter_id, r.tenant_id) for r in self.records.values()})
        self.schedule = _schedule(ctx)
        self.batch = ctx.requests.batch
        self.scores: dict[str, ScoreState] = {}
        self.logs: dict[str, list[SampleRow]] = {}  # request logs not folded yet, per key
        self.folded_at = -math.inf
        self.lora_of = {i: r.lora_name for i, r in self.records.items()}
        self.memory: dict[str, planner.WorkerMemory] = {}
        # one planner for the run, as the product's runtime keeps one: a tick re-derives
        # only the score rows whose state changed (the same plan as a fresh one)
        self.planner = planner.Planner()
        self.pinned: set[Copy] = set()
        self.touched: dict[Copy, float] = {}  # the agent's ``touched``: last load or request
        self.loaded_at: dict[Copy, float] = {}  # the agent's load times (min_residency_s)
        self.planned: set[Copy] = set()  # copies the planner loaded (origin planner)
        conditions = ctx.policy.never_evict
        self.never_evict = {
            r.lora_name
            for r in self.records.values()
            if never_evict_rule(r, conditions) is not None
        }
        self.protect_cap = protected_cap(ctx.policy, pool.gpu_slots)
        self.held: list[frozenset[str]] = [frozenset() for _ in self.workers]
        self.hbm_fixed = pool.base_bytes + pool.kv_bytes
        self.loaded: dict[tuple[int, ResidentTier, bool, bool, float | None], LoadedAdapter] = {}
        tau = ctx.policy.demand_admission_tau_s
        self.demand = [DemandCounts(tau) for _ in self.workers] if tau > 0 else None
        self.waiting = [WaitingMisses() for _ in self.workers]  # batch misses, per worker
        self.demand_weight = {
            i: ctx.policy.priority_value(r.priority) for i, r in self.records.items()
        }
        self.counted = -1  # the request on_miss counted already (observe skips it)
        self.asked = -1  # the request that last asked for a load (counted once as waiting)
        # load_stall_share on: each worker's budget follows what its loads cost, as the agent's
        # does (the stall is the interference model's, which a worker would measure)
        self.stall_share = ctx.policy.load_stall_share
        self.loads = [LoadWindows() for _ in self.workers]

    # --- the request log -------------------------------------------------------------------

    def observe(
        self, worker: int, adapter: int, i: int, now: float, tier: str, ttft_ms: float
    ) -> None:
        self.logs.setdefault(self.key[adapter], []).append(
            (SIM_EPOCH + now, _CLASS[self.batch[i]], _TIERS[tier], RequestStatus.ok, ttft_ms)
        )
        self.touched[(worker, adapter)] = now
        if i != self.counted:
            self._count(worker, adapter, now)
        if now - self.folded_at >= KEEPER_BATCH_S and self._fold_logs(now):
            self.replan_now = True

    def _fold_logs(self, now: float) -> bool:
        """The request logs not folded yet, per version, in time order; whether a burst
        fired among them."""
        scores, fired = self.scores, False
        for key, rows in self.logs.items():
            scores[key], burst = observe_many(scores.get(key, _EMPTY), rows)
            fired |= burst
        self.logs.clear()
        self.folded_at = now
        return fired

    # --- the request path between ticks -----------------------------------------------------

    def on_hit(self, worker: int, adapter: int, i: int, now: float) -> None:
        pass

    def on_miss(self, worker: int, adapter: int, i: int, now: float, full: bool) -> int | None:
        self._asked(worker, i, now)
        if not full:
            self._demand_load(worker, adapter, now)
            return None
        evictable = self._evictable(worker, adapter, i, now, in_time=True)
        if not evictable:
            return BYPASS
        self.touched[(worker, adapter)] = now
        self._demand_load(worker, adapter, now)
        victim = min(evictable, key=self._give_up(worker, now))
        self.planned.discard((worker, victim))
        return victim

    def _demand_load(self, worker: int, adapter: int, now: float) -> None:
        self.loaded_at[(worker, adapter)] = now
        self.planned.discard((worker, adapter))

    def declines(self, worker: int, adapter: int, i: int, now: float, full: bool) -> bool:
        self._asked(worker, i, now)  # asked only when the budget is spent beyond the wait
        return full and not self._evictable(worker, adapter, i, now, in_time=False)

    def _asked(self, worker: int, i: int, now: float) -> None:
        """A request asked for a load here (once per request): a batch one counts towards
        the budget's reserve for the requests that may wait, as the agent counts it."""
        if self.batch[i] and self.asked != i:
            self.waiting[worker].add(now)
        self.asked = i

    def _give_up(self, worker: int, now: float) -> Callable[[int], tuple[object, ...]]:
        """The order the agent's ``make_room`` gives slots up in."""
        touched, lora = self.touched, self.lora_of
        if self.demand is None:
            return lambda r: (touched.get((worker, r), -math.inf), lora[r])
        counts, planned = self.demand[worker], self.planned
        return lambda r: give_up_order(
            lora[r],
            planned=(worker, r) in planned,
            demand=counts.count(lora[r], now),
            last_used=touched.get((worker, r), -math.inf),
        )

    def _evictable(self, worker: int, adapter: int, i: int, now: float, in_time: bool) -> list[int]:
        """The residents of a full ``worker`` whose slot a request's load of ``adapter`` may
        take: neither pinned nor protected, past the minimum residency if the planner loaded
        it (unless ``adapter`` is never-evict and would be protected); and (demand admission
        on) any of those when ``any_slot`` says so (``in_time``: the budget has a load for it
        within its class's wait), else those no busier here than its version, with the
        request counted first, as the gateway counts it before it asks for the load."""
        protected, name = self._protected(worker), self.lora_of[adapter]
        urgent = name in self.never_evict and (
            name in protected or len(protected) < self.protect_cap
        )
        evictable = [
            r
            for r in self.ctx.residents[worker]
            if (worker, r) not in self.pinned
            and self.lora_of[r] not in protected
            and (urgent or (worker, r) not in self.planned or self._settled(worker, r, now))
        ]
        if self.demand is not None and evictable:
            if self.counted != i:
                self._count(worker, adapter, now)
                self.counted = i
            budget = self.loads_per_minute(worker) or self.ctx.pool.loads_per_minute
            if any_slot(
                may_wait=self.batch[i],
                in_time=in_time,
                used=self.ctx.recent_loads(worker, now),
                per_minute=budget,
                waiting=self.waiting[worker].count(now),
            ):
                return evictable
            counts, name = self.demand[worker], self.lora_of[adapter]
            evictable = [r for r in evictable if counts.admits(name, self.lora_of[r], now)]
        return evictable

    def _settled(self, worker: int, adapter: int, now: float) -> bool:
        """Loaded on ``worker`` at least ``min_residency_s`` ago (or at an unknown time)?"""
        at = self.loaded_at.get((worker, adapter))
        return at is None or now - at >= self.ctx.policy.min_residency_s

    def _protected(self, worker: int) -> frozenset[str]:
        """The copies ``worker``'s agent protects (``command_effects.protected_copies``, its
        GPU copies in the order they were loaded), kept sticky as the agent keeps them."""
        loaded_at = self.loaded_at
        residents = sorted(
            self.ctx.residents[worker], key=lambda a: (loaded_at.get((worker, a), -math.inf), a)
        )
        held = protected_copies(
            self.held[worker],
            map(self.lora_of.__getitem__, residents),
            self.never_evict,
            self.protect_cap,
        )
        self.held[worker] = held
        return held

    def _count(self, worker: int, adapter: int, now: float) -> None:
        """One request routed to ``worker`` in its demand counts (demand admission on)."""
        if self.demand is not None:
            self.demand[worker].observe(self.lora_of[adapter], self.demand_weight[adapter], now)

    # --- the cold-load budget -----------------------------------------------------------------

    def loads_per_minute(self, worker: int) -> int | None:
        if not self.stall_share:
            return None
        load_s = self.loads[worker].load_s
        return adapted_budget(
            self.ctx.pool.loads_per_minute,
            self.stall_share,
            None if load_s is None else self.ctx.stall_fraction,
            load_s,
        )

    def on_loaded(self, worker: int, start: float, end: float) -> None:
        if self.stall_share:
            self.loads[worker].add(start, end)

    # --- the planner tick -------------------------------------------------------------------

    def _loaded(
        self,
        adapter: int,
        tier: ResidentTier,
        pinned: bool,
        protected: bool = False,
        loaded_at: float | None = None,
    ) -> LoadedAdapter:
        """The worker-state entry of an adapter; immutable, so built once per (tier, pin,
        protection, load time)."""
        key = (adapter, tier, pinned, protected, loaded_at)
        entry = self.loaded.get(key)
        if entry is None:
            r = self.records[adapter]
            entry = self.loaded[key] = LoadedAdapter.model_construct(
                lora_name=r.lora_name,
                adapter_id=r.adapter_id,
                version=r.version,
                tenant_id=r.tenant_id,
                tier=tier,
                pinned=pinned,
                protected=protected,
                size_bytes=r.size_bytes,
                rank=r.rank,
                last_used=None,
                in_flight=0,
                loaded_at=None
                if loaded_at is None
                else datetime.fromtimestamp(SIM_EPOCH + loaded_at, UTC),
                origin=None,
            )
        return entry

    def _states(self, now: float) -> list[WorkerState]:
        ts = datetime.fromtimestamp(SIM_EPOCH + now, UTC)
        pool = self.ctx.pool
        states = []
        for n, wid in enumerate(self.workers):
            protected = self._protected(n)
            gpu = [
                self._loaded(
                    a,
                    "gpu",
                    (n, a) in self.pinned,
                    self.lora_of[a] in protected,
                    self.loaded_at.get((n, a)),
                )
                for a in sorted(self.ctx.residents[n])
            ]
            host = [
                self._loaded(a, "host", False)
                for a in self.ctx.hosts[n]
                if a not in self.ctx.residents[n]
            ]
            used = sum(x.size_bytes for x in gpu)
            states.append(
                WorkerState.model_construct(
                    schema_version=1,
                    worker_id=wid,
                    base_model=pool.name,
                    ts=ts,
                    gateway_url="",
                    gpu_slots_used=len(gpu),
                    gpu_slots_total=pool.gpu_slots,
                    host_bytes_used=sum(x.size_bytes for x in host) + used,
                    host_bytes_budget=int(pool.host_bytes),
                    hbm_usage=min(1.0, (self.hbm_fixed + used) / pool.hbm_bytes),
                    max_lora_rank=512,
                    cold_loads_last_minute=self.ctx.recent_loads(n, now),
                    cold_load_budget=self.loads_per_minute(n),
                    adapters=gpu + host,
                )
            )
        return states

    def tick(self, now: float) -> Plan:
        self.replan_now = False
        self._fold_logs(now)
        at = SIM_EPOCH + now
        scheduled = warmup_scores(self.schedule, self.pairs, at) if self.schedule.schedules else {}
        result = self.planner.tick(
            self.views, self.scores, self._states(now), self.ctx.policy, at, self.memory, scheduled
        )
        self.memory = result.memory
        out = Plan()
        for cmd in result.commands:
            copy = (self.worker_index[cmd.worker_id], self.index_of[cmd.lora_name])
            match cmd.action:
                case CommandAction.load_gpu:
                    out.load.append(copy)
                case CommandAction.demote_to_host | CommandAction.evict:
                    if copy[1] in self.ctx.residents[copy[0]]:
                        out.evict.append(copy)
                case CommandAction.prewarm_host:
                    out.prewarm.append(copy)
                case CommandAction.pin:
                    self.pinned.add(copy)
                case CommandAction.unpin:
                    self.pinned.discard(copy)
        return out

    def on_planned(self, loaded: list[Copy], evicted: list[Copy], now: float) -> None:
        self.pinned.difference_update(evicted)
        for copy in evicted:
            self.loaded_at.pop(copy, None)
        self.planned.difference_update(evicted)
        self.planned.update(loaded)
        for copy in loaded:
            self.touched[copy] = now
            self.loaded_at[copy] = now


def _with_policy(ctx: PolicyContext, **update: object) -> PolicyContext:
    """The context with some policy fields replaced: a variant row of the same planner."""
    return replace(ctx, policy=ctx.policy.model_copy(update=update))


PLATINUM = 'tenant_priority == "platinum"'
PLATINUM_WITH_DEMAND = 'tenant_priority == "platinum" and no_request_for_minutes < 60'


class LoraplaneDemand(Loraplane):
    """loraplane with the seed's platinum guard conditioned on demand: a platinum version
    keeps a pinned GPU copy only while it was requested in the last hour. The seed's
    ``tenant_priority == "platinum"`` pins every platinum version, idle or not, which costs
    hit rate wherever platinum versions outnumber a pool's GPU slots."""

    name = "loraplane-demand"

    def __init__(self, ctx: PolicyContext) -> None:
        guards = [
            PLATINUM_WITH_DEMAND if c.strip() == PLATINUM else c
            for c in ctx.policy.never_evict_when
        ]
        super().__init__(_with_policy(ctx, never_evict_when=guards))


class LoraplaneCost(Loraplane):
    """loraplane ranking by what a miss costs (``kernel.policy.COST_FORMULA``, the default),
    whatever the scenario's policy file names: ``weighted_demand`` (forecast rate times the
    tenant's priority value) instead of the seed's sum of rate, TTFT penalty and priority;
    schedules keep their term. Every guard, budget and rule is the policy file's."""

    name = "loraplane-cost"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(_with_policy(ctx, hot_score_formula=COST_FORMULA))


class LoraplaneSeed(Loraplane):
    """loraplane with the seed's hot score (``kernel.policy.SEED_FORMULA``: rate, cold TTFT
    penalty and priority added up), the default before the cost-aware one; every guard,
    budget and rule is the policy file's."""

    name = "loraplane-seed"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(_with_policy(ctx, hot_score_formula=SEED_FORMULA))
