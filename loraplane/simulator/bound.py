"""A lower bound on priority-weighted miss cost that keeps the cold-load budget and the slots:
an LP relaxation over time buckets, solved with HiGHS (``scipy.optimize.linprog``).

Why: the budget-free optimum (``optimum.py``) charges a miss no more than a swap, so where the
6-loads-a-minute budget binds (every bench scenario) it sits 200-600x below every policy. What
a policy really pays there is the request it cannot load: the base model (``fallback_cost_ms``)
or a retry. This bound charges exactly that.

Per base model with ``W`` workers of ``S`` slots and ``L`` loads a minute each, the trace is cut
into buckets of ``B`` seconds. Variables per adapter ``a`` and bucket ``t``: ``y`` (a has a GPU
copy on some worker at the bucket's start), ``l`` (GPU loads of a decided in the bucket, all
workers) and ``z`` (a's requests in the bucket that reach a copy). Constraints::

    z[a,t] <= y[a,t] + l[a,t],  z <= 1          a request reaches a copy only if one was there
                                                 or a load of a was decided in the bucket
    y[a,t+1] <= y[a,t] + l[a,t]                  a copy at t+1 was there at t or loaded in t
    sum_a y[a,t] <= W * S                        slots (y <= 1: any copy counts once)
    sum of l over buckets inside any span of
      60 - D seconds <= W * L                    the rolling-minute budget, by decision time

Cost ``sum U[a,t] (1 - z[a,t])``, ``U`` = the weighted least charge of a request that neither
finds a copy nor triggers a load (``CostModel.unloaded_miss_ms``). Why it is a lower bound of
every policy the engine replays, prefetching planners included: take any run and set ``y`` to
1 where the adapter was resident (a copy still loading counts) at a bucket start, ``l`` to the
loads decided in the bucket and ``z`` to 1 where ``y + l >= 1``. That satisfies every
constraint: the router sends a request to a GPU copy whenever one exists, so a request without
one was not resident anywhere; a load needs a slot only from its decision on; and the engine
lets a load *start* only with fewer than ``L`` starts in the minute before it, so any 60 s of
starts holds at most ``L`` per worker, and a load starts at most ``D`` after its decision
(``D`` = the batch class's wait, 0 without batch requests), so decisions inside ``60 - D``
seconds start inside 60 s. Its cost is at most the run's: requests with ``z = 1`` are charged
0 here (>= 0 in the run), the others found no copy and triggered no load, so the run charged
each of them a fallback, a retry or a bypass, at least ``U``. The LP's optimum is at most that
point's cost. Relaxed away (so it stays below): load times, queueing, which worker, what a
loading request pays, evictions inside a bucket (coverage by ``y`` lasts the whole bucket).

Size: ``B`` is the smallest of ``BUCKETS_S`` that keeps adapters x buckets under
``optimum.bound_max_cells``; coarser buckets only loosen the bound.
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

BUDGET_WINDOW_S = 60.0
BUCKETS_S = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


@dataclass(frozen=True)
class BoundResult:
    weighted_miss_cost: float
    bucket_s: float
    cells: int

    def as_dict(self) -> dict[str, float | int]:
        return {"weighted_miss_cost": round(self.weighted_miss_cost, 3),
                "bucket_s": self.bucket_s, "cells": self.cells}


@dataclass(frozen=True)
class PoolLimits:
    workers: int
    slots_per_worker: int
    loads_per_minute: int


def budget_bound(scenario: Scenario, catalog: Catalog, requests: Requests) -> BoundResult | None:
    """The LP bound of the scenario's deployment (its slots and load budget per pool);
    ``None`` above ``optimum.bound_max_requests``."""
    if len(requests) > scenario.optimum.bound_max_requests:
        return None
    cm = CostModel(scenario.fleet.costs, scenario.policy)
    budget = scenario.policy.cold_loads_per_minute_per_worker
    has_batch = any(requests.batch)
    wait_s = scenario.policy.request_budgets.batch.max_wait_ms / 1000.0 if has_batch else 0.0
    per_pool: dict[int, tuple[list[float], list[int], list[float]]] = {}
    for t, a, batch in zip(requests.time_s, requests.adapter, requests.batch, strict=True):
        spec = catalog.adapters[a]
        ts, adapters, costs = per_pool.setdefault(spec.base_model, ([], [], []))
        ts.append(t)
        adapters.append(a)
        costs.append(cm.weight(spec.priority) * cm.unloaded_miss_ms(batch))
    total, bucket, cells = 0.0, 0.0, 0
    for pool, (ts, adapters, costs) in per_pool.items():
        fleet = scenario.fleet.base_models[pool]
        limits = PoolLimits(fleet.workers, fleet.gpu_slots_per_worker, budget)
        cost, b, n = lp_bound(ts, adapters, costs, limits, wait_s,
                              scenario.optimum.bound_max_cells)
        total += cost
        bucket = max(bucket, b)
        cells += n
    return BoundResult(total, bucket, cells)


def lp_bound(times: list[float], adapters: list[int], costs: list[float], limits: PoolLimits,
             batch_wait_s: float = 0.0, max_cells: int = 60_000,
             bucket_s: float | None = None) -> tuple[float, float, int]:
    """(bound, bucket seconds, adapter-bucket cells) of one pool's requests; ``costs[j]`` is
    what request ``j`` is charged at least when it finds no copy and loads nothing."""
    if not times:
        return 0.0, 0.0, 0
    ids = {a: k for k, a in enumerate(dict.fromkeys(adapters))}
    n_a = len(ids)
    t0, span = min(times), max(times) - min(times)
    if bucket_s is None:
        bucket_s = next((b for b in BUCKETS_S if n_a * (math.floor(span / b) + 1) <= max_cells),
                        BUCKETS_S[-1])
    n_t = math.floor(span / bucket_s) + 1
    u = np.zeros((n_a, n_t))
    for t, a, c in zip(times, adapters, costs, strict=True):
        u[ids[a], min(n_t - 1, int((t - t0) // bucket_s))] += c
    total = float(u.sum())
    slots = limits.workers * limits.slots_per_worker
    if slots >= n_a:
        return 0.0, bucket_s, n_a * n_t  # every adapter may keep a copy from the start
    cells = n_a * n_t
    covered = np.flatnonzero(u.ravel() > 0)
    # variable layout: y (cells), l (cells), z (one per covered cell)
    n_z = covered.size
    y0, l0, z0 = 0, cells, 2 * cells
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
    # the budget: buckets inside a span of (60 - D) seconds; a longer bucket gets its share.
    # Through one total per bucket (n[t] >= sum_a l[a,t]), so a window row has `run` entries.
    span_s = max(BUDGET_WINDOW_S - batch_wait_s, 1e-9)
    per_window = limits.workers * limits.loads_per_minute * math.ceil(bucket_s / span_s - 1e-9)
    run = max(1, math.floor(span_s / bucket_s + 1e-9))
    n0 = 2 * cells + n_z
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
    a_ub = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                      shape=(row, n_vars)).tocsr()
    objective = np.zeros(n_vars)
    objective[z0:n0] = -u.ravel()[covered]
    bounds = np.zeros((n_vars, 2))
    bounds[:, 1] = 1.0
    bounds[l0:z0, 1] = np.inf
    bounds[n0:, 1] = np.inf
    res = linprog(objective, A_ub=a_ub, b_ub=np.concatenate(rhs), bounds=bounds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"LP bound: HiGHS says {res.message}")
    # The dual bound is what HiGHS proves; the primal objective of a solved LP equals it up to
    # its tolerance, which we give away (so the bound never exceeds the true LP optimum).
    saved = -float(res.fun)
    return max(0.0, total - saved * (1 + 1e-7) - 1e-6), bucket_s, cells
