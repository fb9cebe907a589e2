"""The discrete-event engine: replays one request stream against one policy per base model.

Events are the requests (in time order) and, for planner policies, their timer ticks (run
before the first request at or after each tick time). There is no randomness here: the
stream and the catalog carry the seed, so a run is a pure function of the scenario.

A request's adapter is a GPU hit if it is resident (or already being loaded: a delayed hit,
charged the time left). Otherwise it is a miss: the load budget (rolling minute) is checked,
the policy picks a victim (the victim is demoted to the host tier), the adapter is copied from
host (swap) or fetched from S3 first (cold load), and the request-class budget decides what the
request experiences (see ``fleet``). The host tier is an LRU over slots and bytes for every
policy (vLLM's ``max_cpu_loras``).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable

from loraplane.simulator.catalog import Catalog
from loraplane.simulator.fleet import CostModel, Outcome, Pool
from loraplane.simulator.metrics import Counters
from loraplane.simulator.policies.base import BYPASS, CachePolicy, Plan, PolicyContext
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import Scenario

PolicyFactory = Callable[[PolicyContext], CachePolicy]
WINDOW_S = 60.0


class PolicyContractError(RuntimeError):
    """A policy answered something impossible (evicting an adapter that is not resident)."""


class _PoolState:
    """One base model's tiers, load budget and HBM accounting during a run."""

    def __init__(self, pool: Pool, capacity: int, catalog: Catalog, costs: CostModel,
                 counters: Counters) -> None:
        self.pool = pool
        self.capacity = capacity
        self.sizes = [a.size_bytes for a in catalog.adapters]
        self.costs = costs
        self.c = counters
        self.resident: set[int] = set()
        self.ready: dict[int, float] = {}
        self.host: OrderedDict[int, float] = OrderedDict()
        self.host_bytes = 0.0
        self.loads: list[float] = []  # start times of GPU loads, sorted
        self.lanes = [0.0] * pool.workers  # each worker copies one adapter at a time
        self.resident_bytes = 0.0
        self.in_flight: list[tuple[float, float]] = []  # (ready time, bytes) of loads
        self.fixed_bytes = pool.base_bytes + pool.kv_bytes
        self.policy: CachePolicy
        self.next_tick = float("inf")

    def host_put(self, adapter: int) -> None:
        if adapter in self.host:
            self.host.move_to_end(adapter)
            return
        self.host[adapter] = self.sizes[adapter]
        self.host_bytes += self.sizes[adapter]
        while len(self.host) > self.pool.host_slots or self.host_bytes > self.pool.host_bytes:
            _, size = self.host.popitem(last=False)
            self.host_bytes -= size

    def budget_start(self, now: float) -> float:
        """The earliest time a new GPU load may start under the rolling-minute budget."""
        loads = self.loads
        cut = bisect.bisect_right(loads, now - WINDOW_S)
        if cut:
            del loads[:cut]
        over = len(loads) - self.pool.loads_per_minute
        return now if over < 0 else max(now, loads[over] + WINDOW_S)

    def load(self, adapter: int, start: float, demand: bool) -> float:
        """Put ``adapter`` in a slot; returns when it is ready."""
        size = self.sizes[adapter]
        ms = self.costs.swap_ms(size)
        if adapter not in self.host:
            ms += self.costs.fetch_ms(size)
            self.c.cold_loads += 1
        self.host_put(adapter)
        self.c.swaps += 1
        lane = min(range(len(self.lanes)), key=self.lanes.__getitem__)
        ready = max(start, self.lanes[lane]) + ms / 1000.0
        self.lanes[lane] = ready
        if demand:
            self.c.swap_ms_total += (ready - start) * 1000.0
            self.c.demand_swaps += 1
        bisect.insort(self.loads, start)
        self.resident.add(adapter)
        self.ready[adapter] = ready
        self.resident_bytes += size
        self.in_flight = [x for x in self.in_flight if x[0] > start]
        self.in_flight.append((ready, size))
        staged = sum(x[1] for x in self.in_flight)
        ratio = (self.fixed_bytes + self.resident_bytes + staged) / self.pool.hbm_bytes
        if ratio > self.c.hbm_peak_ratio:
            self.c.hbm_peak_ratio = ratio
        return ready

    def evict(self, adapter: int) -> None:
        if adapter not in self.resident:
            raise PolicyContractError(
                f"{self.policy.name} evicted adapter {adapter}, which is not resident")
        self.resident.remove(adapter)
        del self.ready[adapter]
        self.resident_bytes -= self.sizes[adapter]
        self.host_put(adapter)

    def apply(self, plan: Plan, now: float) -> None:
        evicted: list[int] = []
        for a in dict.fromkeys(plan.evict):
            if a in self.resident:
                self.evict(a)
                evicted.append(a)
        for a in plan.prewarm:
            if a not in self.host:
                self.c.cold_loads += 1
                self.host_put(a)
        loaded: list[int] = []
        for a in plan.load:
            if a in self.resident:
                continue
            if len(self.resident) >= self.capacity or self.budget_start(now) > now:
                break
            self.load(a, now, demand=False)
            loaded.append(a)
        self.policy.on_planned(loaded, evicted, now)


def simulate(scenario: Scenario, catalog: Catalog, requests: Requests,
             factory: PolicyFactory) -> Counters:
    """Replay ``requests`` with one policy (one instance per base model)."""
    c = Counters(requests=len(requests))
    costs = CostModel(scenario.fleet.costs, scenario.policy)
    states: list[_PoolState] = []
    for index, spec in enumerate(scenario.fleet.base_models):
        pool = Pool.of(index, spec, scenario.policy)
        st = _PoolState(pool, pool.gpu_slots, catalog, costs, c)
        st.policy = factory(PolicyContext(pool, pool.gpu_slots, catalog, costs, scenario.policy,
                                          requests, st.resident, st.host,
                                          tuple(scenario.workload.peaks)))
        for a in st.policy.preload():
            st.resident.add(a)
            st.ready[a] = 0.0
            st.resident_bytes += st.sizes[a]
            st.host_put(a)
        c.hbm_peak_ratio = max(c.hbm_peak_ratio,
                               (st.fixed_bytes + st.resident_bytes) / pool.hbm_bytes)
        if st.policy.tick_s:
            st.next_tick = requests.time_s[0] if len(requests) else 0.0
        states.append(st)

    adapters = catalog.adapters
    pool_of = [a.base_model for a in adapters]
    weight = [costs.weight(a.priority) for a in adapters]
    platinum = [a.priority == "platinum" for a in adapters]
    canary = [a.is_canary for a in adapters]
    base_tps = scenario.fleet.costs.decode_tokens_per_s
    lora_tps = base_tps * (1 - scenario.fleet.costs.lora_decode_overhead)
    hit_s = scenario.fleet.costs.gpu_hit_ms / 1000.0
    penalties = c.ttft_penalty_ms
    tps = c.tokens_per_s
    times, reqs, tokens, batches = (requests.time_s, requests.adapter, requests.output_tokens,
                                    requests.batch)
    for i in range(len(requests)):
        t = times[i]
        a = reqs[i]
        batch = batches[i]
        st = states[pool_of[a]]
        pol = st.policy
        while st.next_tick <= t:
            st.apply(pol.tick(st.next_tick), st.next_tick)
            st.next_tick += pol.tick_s  # type: ignore[operator]
        outcome: Outcome | None = None
        tier = "gpu"
        if a in st.resident:
            c.gpu_hits += 1
            pol.on_hit(a, i, t)
            wait = st.ready[a] - t
            if wait > 0:
                outcome = costs.miss(wait * 1000.0, batch, False)
            if a in st.host:
                st.host.move_to_end(a)
        else:
            if platinum[a]:
                c.platinum_cold_starts += 1
            if canary[a]:
                c.canary_cold_starts += 1
            if a in st.host:
                c.host_hits += 1
                tier = "host"
            else:
                tier = "cold"
            start = st.budget_start(t)
            if start > t and not costs.may_wait(batch, (start - t) * 1000.0):
                outcome = costs.miss(0.0, batch, True)
            else:
                full = len(st.resident) >= st.capacity
                victim = pol.on_miss(a, i, t, full)
                if victim == BYPASS:
                    outcome = costs.bypass()
                else:
                    if full:
                        if victim is None:
                            raise PolicyContractError(f"{pol.name} gave no victim in a full pool")
                        st.evict(victim)
                    ready = st.load(a, start, demand=True)
                    outcome = costs.miss((ready - t) * 1000.0, batch, False)
        out = tokens[i]
        if outcome is None:
            penalty = 0.0
            tps.append(out / (hit_s + out / (base_tps if pol.merged else lora_tps)))
        else:
            penalty = outcome.ttft_penalty_ms
            if outcome.fallback:
                c.fallbacks += 1
                tier = "base_fallback"
            c.weighted_miss_cost += weight[a] * outcome.charged_ms
            rate = base_tps if (outcome.fallback or pol.merged) else lora_tps
            tps.append(out / (penalty / 1000.0 + out / rate))
        penalties.append(penalty)
        if pol.observes:
            pol.observe(a, i, t, tier, penalty)
            if pol.replan_now:
                st.apply(pol.tick(t), t)
    return c
