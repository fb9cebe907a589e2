"""The discrete-event engine: replays one request stream against one policy per base model,
on a fleet of workers that each have their own slots, host tier, budgets and capacity.

Events are the requests (in time order) and, for planner policies, their timer ticks. There
is no randomness here: the stream and the catalog carry the seed, so a run is a pure
function of the scenario. Every request is routed by the router's own code
(``router.routing.pick_worker``), with the engine's truth as the router's view; on its worker
it is a hit, a delayed hit (a copy still loading) or a miss, where the worker's load budget,
the policy's victim and the request-class budget (``fleet``) decide what it gets. Then it
takes one of the worker's serving places for its decode time, or queues for one. Optional
interference (``fleet.interference``) makes loads slow the decode beside them and adapter
HBM shrink the batch, to first order so one pass stays linear. The rules: docs/simulator.md,
"The engine".
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from loraplane.router.routing import free_slot_order, pick_worker
from loraplane.simulator.catalog import Catalog
from loraplane.simulator.fleet import CostModel, Outcome, Pool
from loraplane.simulator.metrics import Counters
from loraplane.simulator.policies import PolicyFactory
from loraplane.simulator.policies.base import BYPASS, CachePolicy, Copy, Plan, PolicyContext
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import PRIORITIES, Interference, Scenario

__all__ = ["WINDOW_S", "PolicyContractError", "simulate"]

WINDOW_S = 60.0


class PolicyContractError(RuntimeError):
    """A policy answered something impossible (evicting an adapter that is not resident)."""


class _Worker:
    """One worker's tiers, load budget, load lane and serving places during a run."""

    def __init__(self, index: int, fleet: _Fleet) -> None:
        self.index = index
        self.fleet = fleet
        pool = fleet.pool
        self.resident: set[int] = set()
        self.ready: dict[int, float] = {}
        self.host: OrderedDict[int, float] = OrderedDict()
        self.host_bytes = 0.0
        self.loads: list[float] = []  # start times of GPU loads, sorted
        self.lane = 0.0  # a worker copies one adapter at a time
        self.resident_bytes = 0.0
        self.staged: list[tuple[float, float]] = []  # (ready time, bytes) of loads
        self.places = [0.0] * pool.max_concurrent  # heap: when each serving place frees
        self.finishing: list[float] = []  # heap: when each in-flight request ends
        self.windows: list[tuple[float, float]] = []  # load windows, disjoint, in order
        self.running: list[tuple[float, float, int]] = []  # heap: (decode end, start, request)

    def busy(self, now: float) -> int:
        """In-flight requests (the router's count): dispatched and not yet answered."""
        f = self.finishing
        while f and f[0] <= now:
            heapq.heappop(f)
        return len(f)

    def running_at(self, when: float) -> int:
        """Requests dispatched so far that are still in flight at ``when`` (which may lie
        ahead: a load waiting for the budget); unlike ``busy`` it changes nothing."""
        return sum(1 for end in self.finishing if end > when)

    def serve(self, ready: float, service_s: float) -> float:
        """Take a serving place from ``ready`` for ``service_s``; returns the queue wait."""
        start = max(ready, heapq.heappop(self.places))
        end = start + service_s
        heapq.heappush(self.places, end)
        heapq.heappush(self.finishing, end)
        return start - ready

    def host_put(self, adapter: int) -> None:
        fl = self.fleet
        if adapter in self.host:
            self.host.move_to_end(adapter)
            return
        self.host[adapter] = fl.sizes[adapter]
        self.host_bytes += fl.sizes[adapter]
        fl.host_holders.setdefault(adapter, set()).add(self.index)
        while len(self.host) > fl.pool.host_slots or self.host_bytes > fl.pool.host_bytes:
            gone, size = self.host.popitem(last=False)
            self.host_bytes -= size
            fl.host_holders[gone].discard(self.index)

    def recent_loads(self, now: float) -> int:
        loads = self.loads
        cut = bisect.bisect_right(loads, now - WINDOW_S)
        if cut:
            del loads[:cut]
        return len(loads)

    def budget(self) -> int:
        """This worker's loads per rolling minute: the pool's, or what the policy adapted."""
        return self.fleet.policy.loads_per_minute(self.index) or self.fleet.pool.loads_per_minute

    def budget_start(self, now: float) -> float:
        """The earliest time a new GPU load may start under the rolling-minute budget."""
        over = self.recent_loads(now) - self.budget()
        return now if over < 0 else max(now, self.loads[over] + WINDOW_S)

    def _add(self, adapter: int, ready: float) -> None:
        self.resident.add(adapter)
        self.ready[adapter] = ready
        self.resident_bytes += self.fleet.sizes[adapter]
        self.fleet.gpu_holders.setdefault(adapter, set()).add(self.index)

    def preload(self, adapter: int) -> None:
        """In a slot before the first request; its load time is counted, not waited for."""
        fl = self.fleet
        fl.c.preloads += 1
        fl.c.preload_ms_total += fl.costs.swap_ms(fl.sizes[adapter]) + fl.interference.page_alloc_ms
        self._add(adapter, 0.0)
        self.host_put(adapter)

    def load(self, adapter: int, start: float, demand: bool) -> float:
        """Put ``adapter`` in a slot; returns when it is ready."""
        fl, c, inf = self.fleet, self.fleet.c, self.fleet.interference
        size = fl.sizes[adapter]
        gpu_ms = fl.costs.swap_ms(size) + inf.page_alloc_ms
        if inf.load_slowdown_per_request:
            gpu_ms *= 1.0 + inf.load_slowdown_per_request * self.running_at(start)
        ms = gpu_ms
        if adapter not in self.host:
            ms += fl.costs.fetch_ms(size)
            c.cold_loads += 1
        self.host_put(adapter)
        c.swaps += 1
        ready = max(start, self.lane) + ms / 1000.0
        self.lane = ready
        if demand:
            c.swap_ms_total += (ready - start) * 1000.0
            c.demand_swaps += 1
        bisect.insort(self.loads, start)
        self._add(adapter, ready)
        self.staged = [x for x in self.staged if x[0] > start]
        self.staged.append((ready, size + inf.staging_bytes_per_load))
        self.hbm_check(sum(x[1] for x in self.staged))
        if fl.stall:
            self._stall_running(ready - ms / 1000.0, ready)
        fl.policy.on_loaded(self.index, ready - ms / 1000.0, ready)
        return ready

    def _stall_running(self, lo: float, hi: float) -> None:
        """A load window ``[lo, hi]``: requests already decoding here pay their overlap."""
        self.windows.append((lo, hi))
        run, fl = self.running, self.fleet
        while run and run[0][0] <= lo:
            heapq.heappop(run)
        for end, begin, i in run:
            overlap = min(end, hi) - max(begin, lo)
            if overlap > 0:
                fl.stall_request(i, overlap)

    def decode(self, i: int, now: float, begin: float, end: float) -> None:
        """Request ``i``, arrived at ``now``, decodes here over ``[begin, end]``: it pays its
        overlap with the load windows already planned, and later ones as they are planned.
        Windows over by ``now`` are dropped (a later request begins no earlier than it
        arrives; begins themselves are not in order)."""
        w, fl = self.windows, self.fleet
        while w and w[0][1] <= now:
            w.pop(0)
        for lo, hi in w:
            if lo >= end:
                break
            overlap = min(end, hi) - max(begin, lo)
            if overlap > 0:
                fl.stall_request(i, overlap)
        heapq.heappush(self.running, (end, begin, i))

    def hbm_check(self, staged: float = 0.0) -> None:
        pool = self.fleet.pool
        adapters = self.fleet.slot_reserve or self.resident_bytes
        ratio = (pool.base_bytes + pool.kv_bytes + adapters + staged) / pool.hbm_bytes
        if ratio > self.fleet.c.hbm_peak_ratio:
            self.fleet.c.hbm_peak_ratio = ratio

    def evict(self, adapter: int) -> None:
        if adapter not in self.resident:
            raise PolicyContractError(
                f"{self.fleet.policy.name} evicted adapter {adapter}, which is not resident on "
                f"worker {self.index}"
            )
        self.resident.remove(adapter)
        del self.ready[adapter]
        self.resident_bytes -= self.fleet.sizes[adapter]
        self.fleet.gpu_holders[adapter].discard(self.index)
        self.host_put(adapter)


class _Fleet:
    """One base model's workers, who holds what (the router's indexes) and its policy."""

    def __init__(
        self,
        pool: Pool,
        catalog: Catalog,
        costs: CostModel,
        counters: Counters,
        interference: Interference,
        decode_s: list[float],
    ) -> None:
        self.pool = pool
        self.sizes = [a.size_bytes for a in catalog.adapters]
        self.costs = costs
        self.c = counters
        self.interference = interference
        self.stall = interference.stall_fraction > 0
        self.slot_reserve = 0.0  # HBM the slots reserve (set once the policy is known)
        self.decode_s = decode_s  # per request: time in service, stalls included
        self.gpu_holders: dict[int, set[int]] = {}  # adapter -> workers with a GPU copy
        self.host_holders: dict[int, set[int]] = {}  # adapter -> workers with a host copy
        self.workers = [_Worker(w, self) for w in range(pool.workers)]
        self.ids = tuple(range(pool.workers))
        self.turns = [0] * pool.workers  # the route that last chose each worker (``turn``)
        self.routes = 0
        self.policy: CachePolicy
        self.next_tick = float("inf")

    def stall_request(self, i: int, overlap_s: float) -> None:
        self.decode_s[i] += self.interference.stall_fraction * overlap_s

    def size_workers(self) -> None:
        """Slot reservations and the batch they leave (merged weights reserve no slot)."""
        pool, inf = self.pool, self.interference
        if not self.policy.merged:
            self.slot_reserve = pool.gpu_slots * inf.slot_reserved_bytes
        if inf.kv_bytes_per_sequence > 0:
            free = pool.hbm_bytes - pool.base_bytes - self.slot_reserve
            batch = max(1, min(pool.max_concurrent, int(free // inf.kv_bytes_per_sequence)))
            for wk in self.workers:
                wk.places = [0.0] * batch

    def route(self, adapter: int, now: float) -> tuple[int, str]:
        """The router's choice for a request of ``adapter`` at ``now``."""
        ws = self.workers
        picked = pick_worker(
            self.gpu_holders.get(adapter, ()),
            self.host_holders.get(adapter, ()),
            self._free_order(),
            self.ids,
            fits=_always,
            may_load=lambda w: ws[w].recent_loads(now) < ws[w].budget(),
            busy=lambda w: ws[w].busy(now),
            turn=self.turns.__getitem__,
        )
        assert picked is not None  # every simulated worker fits every adapter
        self.routes += 1
        self.turns[picked[0]] = self.routes
        return picked

    def recent_loads(self, worker: int, now: float) -> int:
        return self.workers[worker].recent_loads(now)

    def _free_order(self) -> Iterator[int]:
        """Lazy: sorted only when no worker holds a copy (``pick_worker`` reaches it)."""
        slots, ws = self.pool.gpu_slots, self.workers
        yield from free_slot_order(self.ids, lambda w: slots - len(ws[w].resident))

    def apply(self, plan: Plan, now: float) -> None:
        evicted: list[Copy] = []
        ws = self.workers
        for w, a in dict.fromkeys(plan.evict):
            if a in ws[w].resident:
                ws[w].evict(a)
                evicted.append((w, a))
        for w, a in plan.prewarm:
            if a not in ws[w].host:
                self.c.cold_loads += 1
                ws[w].host_put(a)
        loaded: list[Copy] = []
        for w, a in plan.load:
            wk = ws[w]
            if (
                a in wk.resident
                or len(wk.resident) >= self.pool.gpu_slots
                or wk.budget_start(now) > now
            ):
                continue
            wk.load(a, now, demand=False)
            loaded.append((w, a))
        self.policy.on_planned(loaded, evicted, now)


def _always(worker: int) -> bool:
    return True


def simulate(
    scenario: Scenario, catalog: Catalog, requests: Requests, factory: PolicyFactory
) -> Counters:
    """Replay ``requests`` with one policy (one instance per base model)."""
    c = Counters(requests=len(requests))
    decode = [0.0] * len(requests)  # per request: time in service, stalls included
    costs = CostModel(scenario.fleet.costs, scenario.policy)
    fleets: list[_Fleet] = []
    for index, spec in enumerate(scenario.fleet.base_models):
        pool = Pool.of(index, spec, scenario.policy)
        fl = _Fleet(pool, catalog, costs, c, scenario.fleet.interference, decode)
        ws = fl.workers
        fl.policy = factory(
            PolicyContext(
                pool,
                pool.gpu_slots,
                catalog,
                costs,
                scenario.policy,
                requests,
                tuple(w.resident for w in ws),
                tuple(w.host for w in ws),
                tuple(scenario.workload.peaks),
                recent_loads=fl.recent_loads,
                stall_fraction=scenario.fleet.interference.stall_fraction,
            )
        )
        fl.size_workers()
        for w, a in fl.policy.preload():
            ws[w].preload(a)
        for wk in ws:
            wk.hbm_check()
        if fl.policy.tick_s:
            fl.next_tick = requests.time_s[0] if len(requests) else 0.0
        fleets.append(fl)

    adapters = catalog.adapters
    pool_of = [a.base_model for a in adapters]
    weight = [costs.weight(a.priority) for a in adapters]
    platinum = [a.priority == "platinum" for a in adapters]
    tier_rows = {p: c.slo_priority.setdefault(p, [0, 0]) for p in PRIORITIES}
    tier_of = [tier_rows[a.priority] for a in adapters]
    canary = [a.is_canary for a in adapters]
    base_tps = scenario.fleet.costs.decode_tokens_per_s
    lora_tps = base_tps * (1 - scenario.fleet.costs.lora_decode_overhead)
    hit_s = scenario.fleet.costs.gpu_hit_ms / 1000.0
    penalties = c.ttft_penalty_ms = [0.0] * len(requests)
    routes = c.routes
    slo_ms = scenario.fleet.costs.slo_ttft_ms
    budget_ms = (slo_ms["interactive"] - hit_s * 1000.0, slo_ms["batch"] - hit_s * 1000.0)
    slo = c.slo
    attained = (slo.setdefault("interactive", [0, 0]), slo.setdefault("batch", [0, 0]))
    canary_attained = [0, 0]
    times, reqs, tokens, batches = (
        requests.time_s,
        requests.adapter,
        requests.output_tokens,
        requests.batch,
    )

    def ask(fl: _Fleet, i: int, w: int, t: float) -> Outcome:
        """Request ``i``'s miss on worker ``w`` at ``t``: its load, waited for or not, or its
        class's answer. A batch request whose load can start within its wait takes its slot
        now and waits for the budget (the agent folds its load at once; the load starts when
        the budget frees)."""
        a, batch = reqs[i], batches[i]
        wk, pol = fl.workers[w], fl.policy
        start = wk.budget_start(t)
        budget_wait_ms = (start - t) * 1000.0  # > 0: the budget is spent until start
        full = len(wk.resident) >= fl.pool.gpu_slots
        if start > t and not costs.may_wait(batch, budget_wait_ms):
            # the gateway's 429 says to come back once the budget frees: that long, unless
            # admission refuses the load anyway (it is asked first): the class's answer
            declined = pol.declines(w, a, i, t, full)
            c.declined += declined
            return costs.miss(0.0, batch, True, 0.0 if declined else budget_wait_ms)
        victim = pol.on_miss(w, a, i, t, full)
        if victim == BYPASS:
            c.declined += 1
            return costs.bypass(batch)
        if full:
            if victim is None:
                raise PolicyContractError(f"{pol.name} gave no victim on a full worker {w}")
            wk.evict(victim)
        ready = wk.load(a, start, demand=True)
        return costs.miss((ready - t) * 1000.0, batch, False)

    def finish(fl: _Fleet, i: int, w: int, outcome: Outcome | None, tier: str, now: float) -> None:
        """Serve (or answer) request ``i`` on worker ``w`` as ``outcome`` says, and count it."""
        t, a, batch = times[i], reqs[i], batches[i]
        wk, pol = fl.workers[w], fl.policy
        if outcome is None:
            penalty = 0.0
            rate = base_tps if pol.merged else lora_tps
        else:
            penalty = outcome.ttft_penalty_ms
            if outcome.fallback:
                c.fallbacks += 1
                tier = "base_fallback"
            if outcome.retry:
                c.retries += 1
                c.retry_wait_ms += outcome.charged_ms
            c.weighted_miss_cost += weight[a] * outcome.charged_ms
            rate = base_tps if (outcome.fallback or pol.merged) else lora_tps
        service = hit_s + tokens[i] / rate
        decode[i] = service
        if outcome is None or not outcome.retry:
            begin = t + penalty / 1000.0
            queued = wk.serve(begin, service)
            if queued > 0:
                c.queued += 1
                penalty += queued * 1000.0
                c.weighted_miss_cost += weight[a] * queued * 1000.0
            if fl.stall:
                wk.decode(i, t, begin + queued, begin + queued + service)
        penalties[i] = penalty
        met = (outcome is None or not (outcome.fallback or outcome.retry)) and penalty <= budget_ms[
            batch
        ]
        row = attained[batch]
        row[0] += 1
        row[1] += met
        row = tier_of[a]
        row[0] += 1
        row[1] += met
        if canary[a]:
            canary_attained[0] += 1
            canary_attained[1] += met
        if pol.observes:
            pol.observe(w, a, i, t, tier, penalty)
            if pol.replan_now:
                fl.apply(pol.tick(now), now)

    for i in range(len(requests)):
        t = times[i]
        a = reqs[i]
        batch = batches[i]
        fl = fleets[pool_of[a]]
        pol = fl.policy
        while fl.next_tick <= t:
            fl.apply(pol.tick(fl.next_tick), fl.next_tick)
            fl.next_tick += pol.tick_s  # type: ignore[operator]
        w, kind = fl.route(a, t)
        routes[kind] = routes.get(kind, 0) + 1
        wk = fl.workers[w]
        outcome: Outcome | None = None
        tier = "gpu"
        if a in wk.resident:
            c.gpu_hits += 1
            pol.on_hit(w, a, i, t)
            wait = wk.ready[a] - t
            if wait > 0:
                outcome = costs.miss(wait * 1000.0, batch, False)
            if a in wk.host:
                wk.host.move_to_end(a)
        else:
            if platinum[a]:
                c.platinum_cold_starts += 1
            if canary[a]:
                c.canary_cold_starts += 1
            if a in wk.host:
                c.host_hits += 1
                tier = "host"
            else:
                tier = "cold"
            outcome = ask(fl, i, w, t)
        finish(fl, i, w, outcome, tier, t)
    if canary_attained[0]:
        slo["canary"] = canary_attained
    c.tokens_per_s = (
        np.asarray(tokens, dtype=float) / (np.asarray(penalties) / 1000.0 + np.asarray(decode))
    ).tolist()
    return c
