"""The budgeted LP bound (loraplane/simulator/bound.py) stays below what any schedule pays:
below the exhaustive optimum of tiny budgeted traces at every bucket size, and below every
policy the engine replays, loraplane's prefetching planner included."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.simulator import bound as bound_module
from loraplane.simulator.bound import PoolLimits, budget_bound, lp_bound
from loraplane.simulator.engine import simulate
from loraplane.simulator.policies import policy_factory
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import Scenario
from tests.unit.simulator_tiny import catalog, scenario

WINDOW_S = 60.0
POLICIES = (
    "lru",
    "fifo",
    "s3-fifo",
    "sieve",
    "gdsf",
    "belady",
    "static-merge",
    "dynamo",
    "loraplane",
    "loraplane-cost",
)


def _exhaustive(
    times: tuple[float, ...],
    seq: tuple[int, ...],
    costs: tuple[float, ...],
    slots: int,
    budget: int,
) -> float:
    """One worker; at each request instant any one load (any adapter, evicting any copy)
    within ``budget`` loads a rolling minute, then the request is free if its adapter is in a
    slot and costs ``costs[j]`` if not; any initial cache."""
    adapters = sorted(set(seq))

    @functools.cache
    def f(j: int, cache: frozenset[int], recent: tuple[float, ...]) -> float:
        if j == len(seq):
            return 0.0
        t = times[j]
        recent = tuple(x for x in recent if x > t - WINDOW_S)
        states = [(cache, recent)]
        if len(recent) < budget:
            for b in adapters:
                if b in cache:
                    continue
                if len(cache) < slots:
                    states.append((cache | {b}, (*recent, t)))
                states += [((cache - {v}) | {b}, (*recent, t)) for v in cache]
        return min((0.0 if seq[j] in c else costs[j]) + f(j + 1, c, r) for c, r in states)

    starts = [frozenset(c) for c in _subsets(adapters, slots)]
    return min(f(0, s, ()) for s in starts)


def _subsets(items: list[int], most: int) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for x in items:
        out += [(*s, x) for s in out if len(s) < most]
    return out


tiny = st.integers(2, 4).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, n - 1), min_size=1, max_size=8),
        st.lists(st.floats(0.0, 40.0), min_size=8, max_size=8),
        st.lists(st.sampled_from([1.0, 2.0, 4.0, 8.0]), min_size=8, max_size=8),
    )
)


@settings(max_examples=80, deadline=None)
@given(
    trace=tiny,
    slots=st.integers(1, 2),
    budget=st.integers(1, 2),
    bucket=st.sampled_from([1.0, 5.0, 20.0, 60.0, 120.0]),
)
def test_bound_is_below_the_exhaustive_optimum(
    trace: tuple[list[int], list[float], list[float]], slots: int, budget: int, bucket: float
) -> None:
    seq, gaps, weights = trace
    times = [sum(gaps[: j + 1]) for j in range(len(seq))]
    costs = [1000.0 * w for w in weights[: len(seq)]]
    best = _exhaustive(tuple(times), tuple(seq), tuple(costs), slots, budget)
    bound, _, _ = lp_bound(times, seq, costs, PoolLimits(1, slots, budget), bucket_s=bucket)
    assert bound <= best + 1e-6


def test_bound_binds_when_the_budget_does() -> None:
    """Three adapters in turn on one slot with one load a minute: the exhaustive optimum pays
    for most requests, and the bound is strictly positive (the budget-free optimum says ~0)."""
    seq = [0, 1, 2] * 3
    times = [float(5 * j) for j in range(len(seq))]
    costs = [1000.0] * len(seq)
    best = _exhaustive(tuple(times), tuple(seq), tuple(costs), 1, 1)
    bound, _, _ = lp_bound(times, seq, costs, PoolLimits(1, 1, 1), bucket_s=5.0)
    assert 0 < bound <= best


def _budgeted(slots: int, workers: int, budget: int) -> Scenario:
    sc = scenario(slots, workers)
    return sc.model_copy(
        update={"policy": sc.policy.model_copy(update={"cold_loads_per_minute_per_worker": budget})}
    )


@settings(max_examples=25, deadline=None)
@given(
    seq=st.lists(st.integers(0, 5), min_size=1, max_size=30),
    gaps=st.lists(st.floats(0.0, 12.0), min_size=30, max_size=30),
    batch=st.lists(st.booleans(), min_size=30, max_size=30),
    prio=st.lists(
        st.sampled_from(["bronze", "silver", "gold", "platinum"]), min_size=6, max_size=6
    ),
    slots=st.integers(1, 2),
    workers=st.integers(1, 2),
    budget=st.integers(1, 3),
)
def test_every_policy_pays_at_least_the_bound(
    seq: list[int],
    gaps: list[float],
    batch: list[bool],
    prio: list[str],
    slots: int,
    workers: int,
    budget: int,
) -> None:
    times = [sum(gaps[: j + 1]) for j in range(len(seq))]
    reqs = Requests(times, list(seq), [180] * len(seq), batch[: len(seq)])
    sc, cat = _budgeted(slots, workers, budget), catalog(6, prio)
    cut_sc = sc.model_copy(
        update={"optimum": sc.optimum.model_copy(update={"bound_max_cells": 20})}
    )  # a cap of 20 cells cuts these into segments
    for preloaded in (False, True):
        bound = budget_bound(sc, cat, reqs, preloaded).weighted_miss_cost
        cut = budget_bound(cut_sc, cat, reqs, preloaded).weighted_miss_cost
        assert bound is not None and cut is not None
        for name in POLICIES:
            if preloaded != (name == "static-merge"):  # only a merged deployment preloads
                continue
            c = simulate(sc, cat, reqs, policy_factory(name))
            assert bound <= c.weighted_miss_cost + 1e-6, name
            assert cut <= c.weighted_miss_cost + 1e-6, name


def test_batch_waits_do_not_double_the_budget() -> None:
    """Three adapters, one request each, 20 s apart, one slot and one load a minute, all
    batch: with a copy there from the start (a merged deployment's preload) it serves one,
    and at most one load starts in the 40 s (waiting for the next allowed start costs more
    than the 5 s retry), so one request is not served. The bound that counted load decisions
    over 60 - 30 s fitted two loads and said 0. Starting empty, as every other deployment
    does, the first request also waits for its copy: the bound is higher by that wait."""
    seq = [0, 1, 2]
    times = [20.0 * j for j in range(len(seq))]
    reqs = Requests(times, seq, [180] * len(seq), [True] * len(seq))
    sc, cat = _budgeted(1, 1, 1), catalog(3)
    preloaded = budget_bound(sc, cat, reqs, preloaded=True).weighted_miss_cost
    empty = budget_bound(sc, cat, reqs).weighted_miss_cost
    assert preloaded is not None and empty is not None
    assert preloaded >= 5000.0 - 0.01  # HiGHS's tolerance, given away
    assert empty > preloaded
    for name in POLICIES:
        c = simulate(sc, cat, reqs, policy_factory(name))
        assert (preloaded if name == "static-merge" else empty) <= c.weighted_miss_cost + 1e-6


def test_a_wait_for_a_later_start_is_charged() -> None:
    """One slot, one load a minute, 10 s buckets: interactive requests of adapters 0 and 1
    at 0 s and 5 s (one is the initial copy, the other spends the minute's load), then a batch
    request of adapter 2 at 59 s. Its copy can start no earlier than 60 s, the next minute: it
    may be served, but it waits at least 1 s, and the bound charges that second."""
    times, seq = [0.0, 5.0, 59.0], [0, 1, 2]
    costs, waits, rates = [1000.0, 1000.0, 5000.0], [0.25, 0.25, 30.0], [1000.0] * 3
    bound, _, _ = lp_bound(times, seq, costs, PoolLimits(1, 1, 1), waits, rates, bucket_s=10.0)
    assert abs(bound - 1000.0) < 1e-3
    free, _, _ = lp_bound(times, seq, costs, PoolLimits(1, 1, 2), waits, rates, bucket_s=10.0)
    assert free < 1e-3  # with two loads a minute the third copy starts in time, no wait


def test_segments_of_a_long_trace_each_fit_and_bound_no_higher_than_the_whole() -> None:
    """Half an hour of one request a second over 12 adapters: at a cap of 300 cells the
    whole trace would need 72 s buckets; it is cut into segments that each fit at 15 s or
    finer, and their sum is positive and (here) below the whole trace's bound at 1 s
    buckets."""
    times = [float(j) for j in range(1800)]
    seq = [(j * 7) % 12 for j in range(1800)]
    reqs = Requests(times, seq, [180] * len(seq), [j % 5 == 0 for j in range(len(seq))])
    sc, cat = _budgeted(1, 2, 1), catalog(12)
    whole = budget_bound(sc, cat, reqs)
    cut = budget_bound(
        sc.model_copy(update={"optimum": sc.optimum.model_copy(update={"bound_max_cells": 300})}),
        cat,
        reqs,
    )
    assert whole.weighted_miss_cost is not None and cut.weighted_miss_cost is not None
    assert cut.bucket_s <= 15.0 and cut.cells > 300  # several segments of at most 300
    assert 0 < cut.weighted_miss_cost <= whole.weighted_miss_cost + 1e-3


@settings(max_examples=40, deadline=None)
@given(
    seq=st.lists(st.integers(0, 5), min_size=1, max_size=30),
    gaps=st.lists(st.floats(0.0, 12.0), min_size=30, max_size=30),
    batch=st.lists(st.booleans(), min_size=30, max_size=30),
    prio=st.lists(
        st.sampled_from(["bronze", "silver", "gold", "platinum"]), min_size=6, max_size=6
    ),
    slots=st.integers(1, 4),
    workers=st.integers(1, 3),
    budget=st.integers(1, 12),
)
def test_the_bound_is_below_beladys_cost_and_positive_whenever_a_policy_pays(
    seq: list[int],
    gaps: list[float],
    batch: list[bool],
    prio: list[str],
    slots: int,
    workers: int,
    budget: int,
) -> None:
    """Random small scenarios, tight budgets and generous ones: the bound is computed, at
    most what offline Belady pays, and never 0 while a policy pays something (every worker
    starts empty, so the first request waits for a copy at least). Where the slots and the
    budget bind nothing, it says so."""
    times = [sum(gaps[: j + 1]) for j in range(len(seq))]
    reqs = Requests(times, list(seq), [180] * len(seq), batch[: len(seq)])
    sc, cat = _budgeted(slots, workers, budget), catalog(6, prio)
    found = budget_bound(sc, cat, reqs)
    assert found.weighted_miss_cost is not None
    belady = simulate(sc, cat, reqs, policy_factory("belady")).weighted_miss_cost
    assert found.weighted_miss_cost <= belady + 1e-6
    paid = max(
        simulate(sc, cat, reqs, policy_factory(n)).weighted_miss_cost
        for n in ("lru", "belady", "loraplane")
    )
    if paid > 0:
        assert found.weighted_miss_cost > 0
    assert found.cold_start > 0 and found.binds == (found.reason == "")


def test_a_fleet_with_room_for_everything_gets_a_positive_bound_that_says_so() -> None:
    """8 workers x 16 slots and 12 loads a minute each, 40 adapters: the LP relaxation binds
    nothing (the bound printed 0 on such a fleet while every policy paid), so the bound is
    the cold start alone, positive, and marked as not binding, with the reason."""
    sc, cat = _budgeted(16, 8, 12), catalog(40)
    times = [0.5 * j for j in range(2000)]
    reqs = Requests(
        times, [(j * 7) % 40 for j in range(2000)], [180] * 2000, [j % 5 == 0 for j in range(2000)]
    )
    found = budget_bound(sc, cat, reqs)
    assert found.weighted_miss_cost is not None and found.weighted_miss_cost > 0
    assert not found.binds and "never bind" in found.reason
    assert found.weighted_miss_cost == found.cold_start
    for name in ("lru", "belady"):
        assert (
            found.weighted_miss_cost
            <= simulate(sc, cat, reqs, policy_factory(name)).weighted_miss_cost
        )


def test_a_bound_that_cannot_be_computed_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above bound_max_requests, or when HiGHS ends without an optimum (its status is read,
    not assumed), the result carries no number, and the reason."""
    sc, cat = _budgeted(1, 1, 1), catalog(3)
    reqs = Requests([0.0, 5.0, 6.0], [0, 1, 2], [180] * 3, [False] * 3)
    small = sc.model_copy(
        update={"optimum": sc.optimum.model_copy(update={"bound_max_requests": 2})}
    )
    over = budget_bound(small, cat, reqs)
    assert over.weighted_miss_cost is None and "bound_max_requests" in over.reason

    def stopped(*args: object, **kwargs: object) -> SimpleNamespace:
        return SimpleNamespace(status=1, fun=None, message="Iteration limit reached")

    monkeypatch.setattr(bound_module, "linprog", stopped)
    failed = budget_bound(sc, cat, reqs)
    assert failed.weighted_miss_cost is None and "Iteration limit" in failed.reason
