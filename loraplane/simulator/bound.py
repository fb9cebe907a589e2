"""A lower bound on priority-weighted miss cost that keeps the cold-load budget and the slots:
an LP relaxation over time buckets, solved with HiGHS (``scipy.optimize.linprog``).

Why: the budget-free optimum (``optimum.py``) charges a miss no more than a swap, so where the
6-loads-a-minute budget binds (every bench scenario) it sits 200-600x below every policy. What
a policy really pays there is the request it cannot load: the base model (``fallback_cost_ms``)
or a retry. This bound charges exactly that.

Per base model, variables per adapter and bucket say whether a copy had started by the
bucket's start (``y``), how many loads start in it (``l``) and whether its requests reach a
copy (``z``); the slots bound ``y`` and the rolling-minute budget ``l``. Every run of the
engine gives a feasible point no dearer than the run, so the LP's optimum is below every
policy it replays, prefetching planners included. Requests no copy could be ready for (the
cold start) are charged outside the LP (``BoundResult.cold_start``), and ``binds`` says
whether the slots or the budget bound anything beyond them. The LP, the proof, and the
bucket size: docs/simulator.md, "The budgeted LP bound".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from loraplane.simulator.catalog import Catalog
from loraplane.simulator.fleet import CostModel
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import Scenario

__all__ = [
    "BUCKETS_S",
    "BUDGET_WINDOW_S",
    "NO_BINDING",
    "SEGMENT_BUCKET_S",
    "BoundNotSolved",
    "BoundResult",
    "PoolLimits",
    "Segment",
    "budget_bound",
    "lp_bound",
]

BUDGET_WINDOW_S = 60.0
BUCKETS_S = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


@dataclass(frozen=True)
class BoundResult:
    """``weighted_miss_cost`` None: not computed (``reason`` says why); else a lower bound,
    of which ``cold_start`` is the part charged to requests no copy could be ready for, and
    ``binds`` whether the slots or the budget bound anything beyond it (``reason``: why not)."""

    weighted_miss_cost: float | None
    bucket_s: float = 0.0
    cells: int = 0
    cold_start: float = 0.0
    binds: bool = False
    reason: str = ""

    @property
    def computed(self) -> bool:
        return self.weighted_miss_cost is not None

    def as_dict(self) -> dict[str, float | int | bool | str | None]:
        cost = self.weighted_miss_cost
        return {
            "weighted_miss_cost": None if cost is None else round(cost, 3),
            "bucket_s": self.bucket_s,
            "cells": self.cells,
            "cold_start": round(self.cold_start, 3),
            "binds": self.binds,
            "reason": self.reason,
        }


class BoundNotSolved(RuntimeError):
    """HiGHS did not reach an optimum (its message): no bound can be claimed."""


NO_BINDING = (
    "the GPU slots and the cold-load budget never bind: a planner that knew every "
    "arrival could start each request's copy before it, so only the cold start is "
    "bounded; an online policy's cost here comes from not knowing the arrivals "
    "(compare it with the hindsight per-window set)"
)


@dataclass(frozen=True)
class PoolLimits:
    workers: int
    slots_per_worker: int
    loads_per_minute: int


def budget_bound(
    scenario: Scenario, catalog: Catalog, requests: Requests, preloaded: bool = False
) -> BoundResult:
    """The LP bound of the scenario's deployment (its slots and load budget per pool);
    ``preloaded``: the deployment starts with copies in its slots (static merge), so neither
    the empty start nor the cold start is charged. Not computed above
    ``optimum.bound_max_requests`` or when HiGHS finds no optimum (the reason says which)."""
    if len(requests) > scenario.optimum.bound_max_requests:
        return BoundResult(
            None,
            reason=f"{len(requests)} requests: above "
            f"optimum.bound_max_requests ({scenario.optimum.bound_max_requests})",
        )
    cm = CostModel(scenario.fleet.costs, scenario.policy)
    budget = scenario.policy.cold_loads_per_minute_per_worker
    wait_s = (cm.max_wait_ms(False) / 1000.0, cm.max_wait_ms(True) / 1000.0)
    page_ms = scenario.fleet.interference.page_alloc_ms
    first: dict[int, float] = {}  # per pool: its first request, before which nothing loads
    for t, a in zip(requests.time_s, requests.adapter, strict=True):
        first.setdefault(catalog.adapters[a].base_model, t)
    cold_start = 0.0
    per_pool: dict[int, tuple[list[float], list[int], list[float], list[float], list[float]]] = {}
    for t, a, batch in zip(requests.time_s, requests.adapter, requests.batch, strict=True):
        spec = catalog.adapters[a]
        weight = cm.weight(spec.priority)
        if not preloaded:
            ready = first[spec.base_model] + (cm.swap_ms(spec.size_bytes) + page_ms) / 1000.0
            if t < ready:  # no copy of it can be ready yet: out of the LP, charged here
                cold_start += weight * cm.early_miss_ms((ready - t) * 1000.0, batch)
                continue
        ts, adapters, costs, waits, rates = per_pool.setdefault(
            spec.base_model, ([], [], [], [], [])
        )
        ts.append(t)
        adapters.append(a)
        costs.append(weight * cm.unloaded_miss_ms(batch))
        waits.append(wait_s[batch])
        rates.append(weight * 1000.0)  # a second's wait, charged in weighted ms
    batch_pools = {
        catalog.adapters[a].base_model
        for a, batch in zip(requests.adapter, requests.batch, strict=True)
        if batch
    }
    total, bucket, cells = 0.0, 0.0, 0
    for pool, (ts, adapters, costs, waits, rates) in per_pool.items():
        if pool not in batch_pools:
            waits = [0.0] * len(ts)  # no load starts after its decision (docstring)
        fleet = scenario.fleet.base_models[pool]
        limits = PoolLimits(fleet.workers, fleet.gpu_slots_per_worker, budget)
        cap = scenario.optimum.bound_max_cells
        for n_seg, (s_ts, s_adapters, s_costs, s_waits, s_rates) in enumerate(
            _segments(ts, adapters, costs, waits, rates, cap)
        ):
            try:
                cost, b, n = lp_bound(
                    s_ts,
                    s_adapters,
                    s_costs,
                    limits,
                    s_waits,
                    s_rates,
                    cap,
                    empty_start=not preloaded and n_seg == 0,
                    start_s=first[pool] if n_seg == 0 else None,
                )
            except BoundNotSolved as exc:
                return BoundResult(None, reason=str(exc))
            total += cost
            bucket = max(bucket, b)
            cells += n
    binds = total > 0
    return BoundResult(
        total + cold_start, bucket, cells, cold_start, binds, "" if binds else NO_BINDING
    )


SEGMENT_BUCKET_S = 15.0
"""A trace that would need buckets coarser than this to fit is cut into time segments that
each fit at it (a 600 s bucket lets one copy serve ten minutes of requests: no bound)."""

Segment = tuple[list[float], list[int], list[float], list[float], list[float]]


def _segments(
    ts: list[float],
    adapters: list[int],
    costs: list[float],
    waits: list[float],
    rates: list[float],
    max_cells: int,
) -> list[Segment]:
    """The pool's requests in consecutive time segments whose LPs each fit ``max_cells`` at
    ``SEGMENT_BUCKET_S`` (one segment when the whole trace does). The sum of the segments'
    bounds is a bound: each segment relaxes the state it starts with (any copies, in the
    slots) and the budget windows across its start; a request whose wait reaches past its
    segment's end may be served by a load in the next, so it is charged 0 there."""
    if not ts:
        return []
    t0, span = min(ts), max(ts) - min(ts)
    n_a = len(set(adapters))
    need = n_a * (math.floor(span / SEGMENT_BUCKET_S) + 1)
    k = max(1, math.ceil(need / max_cells))
    if k == 1:
        return [(ts, adapters, costs, waits, rates)]
    length = span / k
    t = np.asarray(ts)
    seg = np.minimum(k - 1, ((t - t0) // length).astype(np.int64))
    end = t0 + (seg + 1) * length
    crosses = (seg < k - 1) & (t + np.asarray(waits) >= end)
    cost = np.where(crosses, 0.0, np.asarray(costs))
    out: list[Segment] = []
    for i in range(k):
        rows = np.flatnonzero(seg == i)
        out.append(
            (
                t[rows].tolist(),
                np.asarray(adapters)[rows].tolist(),
                cost[rows].tolist(),
                np.asarray(waits)[rows].tolist(),
                np.asarray(rates)[rows].tolist(),
            )
        )
    return out


def lp_bound(
    times: list[float],
    adapters: list[int],
    costs: list[float],
    limits: PoolLimits,
    waits_s: list[float] | None = None,
    wait_cost_per_s: list[float] | None = None,
    max_cells: int = 120_000,
    bucket_s: float | None = None,
    empty_start: bool = False,
    start_s: float | None = None,
) -> tuple[float, float, int]:
    """(bound, bucket seconds, adapter-bucket cells) of one pool's requests: ``costs[j]`` is
    what request ``j`` is charged at least when it finds no copy and loads nothing,
    ``waits_s[j]`` how long after its arrival a copy's load may start and still serve it, and
    ``wait_cost_per_s[j]`` what each second of that wait is charged (none given: no wait).
    ``empty_start``: no copy before the first bucket, which begins at ``start_s`` (default: the
    first request), when the pool's first load may start. Raises ``BoundNotSolved``."""
    if not times:
        return 0.0, 0.0, 0
    ids = {a: k for k, a in enumerate(dict.fromkeys(adapters))}
    n_a = len(ids)
    t0 = min(times) if start_s is None else min(start_s, min(times))
    span = max(times) - t0
    if bucket_s is None:
        bucket_s = next(
            (b for b in BUCKETS_S if n_a * (math.floor(span / b) + 1) <= max_cells), BUCKETS_S[-1]
        )
    n_t = math.floor(span / bucket_s) + 1
    cells = n_a * n_t
    slots = limits.workers * limits.slots_per_worker
    if slots >= n_a and not empty_start:
        return 0.0, bucket_s, cells  # every adapter may keep a copy from the start
    u = np.zeros(cells)
    # lookahead: (request's row, cell of the later bucket, saving over not being served)
    look_req: list[int] = []
    look_cell: list[int] = []
    look_save: list[float] = []
    waits = waits_s or [0.0] * len(times)
    rates = wait_cost_per_s or [0.0] * len(times)
    n_j = 0
    req_cell: list[int] = []
    for t, a, c, w, rate in zip(times, adapters, costs, waits, rates, strict=True):
        first = min(n_t - 1, int((t - t0) // bucket_s))
        cell = ids[a] * n_t + first
        u[cell] += c
        k, found = first + 1, False
        while k < n_t:
            wait = t0 + k * bucket_s - t
            if wait > w or wait * rate >= c:
                break
            look_req.append(n_j)
            look_cell.append(cell + k - first)
            look_save.append(c - wait * rate)
            found = True
            k += 1
        if found:
            req_cell.append(cell)
            n_j += 1
    total = float(u.sum())
    covered = np.flatnonzero(u > 0)
    z_of = np.full(cells, -1, dtype=np.int64)
    z_of[covered] = np.arange(covered.size)
    n_z, n_x = covered.size, len(look_req)
    # variable layout: y (cells), l (cells), z (one per covered cell), x (lookahead)
    y0, l0, z0 = 0, cells, 2 * cells
    x0 = z0 + n_z
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    rhs: list[np.ndarray] = []
    row = 0

    def add(r: np.ndarray, c: np.ndarray, v: np.ndarray | float) -> None:
        rows.append(r)
        cols.append(c)
        vals.append(np.broadcast_to(np.asarray(v, dtype=float), r.shape))

    # z <= y + l
    r = row + np.arange(n_z)
    add(r, z0 + np.arange(n_z), 1.0)
    add(r, y0 + covered, -1.0)
    add(r, l0 + covered, -1.0)
    rhs.append(np.zeros(n_z))
    row += n_z
    if n_x:
        xs = np.arange(n_x)
        # x[j,k] <= l[a,k]
        add(row + xs, x0 + xs, 1.0)
        add(row + xs, l0 + np.asarray(look_cell), -1.0)
        rhs.append(np.zeros(n_x))
        row += n_x
        # z[a,t] + sum_k x[j,k] <= 1, one row per request with lookahead
        add(row + np.arange(n_j), z0 + z_of[np.asarray(req_cell)], 1.0)
        add(row + np.asarray(look_req), x0 + xs, 1.0)
        rhs.append(np.ones(n_j))
        row += n_j
    # y[a,t+1] <= y[a,t] + l[a,t]
    idx = np.arange(cells).reshape(n_a, n_t)
    nxt, cur = idx[:, 1:].ravel(), idx[:, :-1].ravel()
    r = row + np.arange(nxt.size)
    add(r, y0 + nxt, 1.0)
    add(r, y0 + cur, -1.0)
    add(r, l0 + cur, -1.0)
    rhs.append(np.zeros(nxt.size))
    row += nxt.size
    # slots at every bucket start
    r = row + np.repeat(np.arange(n_t), n_a)
    add(r, y0 + idx.T.ravel(), 1.0)
    rhs.append(np.full(n_t, float(slots)))
    row += n_t
    # the budget: starts inside any `run` consecutive buckets (at most 60 s); a bucket longer
    # than a minute gets its share. Through one total per bucket (n[t] >= sum_a l[a,t]), so a
    # window row has `run` entries.
    per_window = (
        limits.workers * limits.loads_per_minute * math.ceil(bucket_s / BUDGET_WINDOW_S - 1e-9)
    )
    run = max(1, math.floor(BUDGET_WINDOW_S / bucket_s + 1e-9))
    n0 = x0 + n_x
    n_vars = n0
    if per_window < n_a * run:  # else it never binds (no cell needs more than one load)
        n_vars += n_t
        add(row + np.repeat(np.arange(n_t), n_a), l0 + idx.T.ravel(), 1.0)
        add(row + np.arange(n_t), n0 + np.arange(n_t), -1.0)
        rhs.append(np.zeros(n_t))
        row += n_t
        starts = np.arange(n_t)
        for k in range(run):
            s = starts[starts + k < n_t]
            add(row + s, n0 + s + k, 1.0)
        rhs.append(np.full(n_t, float(per_window)))
        row += n_t
    a_ub = coo_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(row, n_vars)
    ).tocsr()
    objective = np.zeros(n_vars)
    objective[z0:x0] = -u[covered]
    objective[x0:n0] = -np.asarray(look_save, dtype=float)
    bounds = np.zeros((n_vars, 2))
    bounds[:, 1] = 1.0
    bounds[l0:z0, 1] = np.inf
    bounds[n0:, 1] = np.inf
    if empty_start:
        bounds[y0 + idx[:, 0], 1] = 0.0
    res = linprog(objective, A_ub=a_ub, b_ub=np.concatenate(rhs), bounds=bounds, method="highs")
    if res.status != 0 or res.fun is None:
        raise BoundNotSolved(f"not computed: HiGHS found no optimum ({res.message})")
    # The dual bound is what HiGHS proves; the primal objective of a solved LP equals it up to
    # its tolerance, which we give away (so the bound never exceeds the true LP optimum).
    saved = -float(res.fun)
    return max(0.0, total - saved * (1 + 1e-7) - 1e-6), bucket_s, cells
