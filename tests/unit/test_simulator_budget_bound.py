"""The budgeted LP bound (loraplane/simulator/bound.py) stays below what any schedule pays:
below the exhaustive optimum of tiny budgeted traces at every bucket size, and below every
policy the engine replays, loraplane's prefetching planner included."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.simulator.bound import PoolLimits, budget_bound, lp_bound
from loraplane.simulator.engine import simulate
from loraplane.simulator.policies import policy_factory
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import Scenario
from tests.unit.simulator_tiny import catalog, scenario

WINDOW_S = 60.0
POLICIES = ("lru", "fifo", "s3-fifo", "sieve", "gdsf", "belady", "static-merge", "dynamo",
            "loraplane", "loraplane-cost")


def _exhaustive(times: tuple[float, ...], seq: tuple[int, ...], costs: tuple[float, ...],
                slots: int, budget: int) -> float:
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


tiny = st.integers(2, 4).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, n - 1), min_size=1, max_size=8),
    st.lists(st.floats(0.0, 40.0), min_size=8, max_size=8),
    st.lists(st.sampled_from([1.0, 2.0, 4.0, 8.0]), min_size=8, max_size=8)))


@settings(max_examples=80, deadline=None)
@given(trace=tiny, slots=st.integers(1, 2), budget=st.integers(1, 2),
       bucket=st.sampled_from([1.0, 5.0, 20.0, 60.0, 120.0]))
def test_bound_is_below_the_exhaustive_optimum(
        trace: tuple[list[int], list[float], list[float]], slots: int, budget: int,
        bucket: float) -> None:
    seq, gaps, weights = trace
    times = [sum(gaps[:j + 1]) for j in range(len(seq))]
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
    return sc.model_copy(update={"policy": sc.policy.model_copy(
        update={"cold_loads_per_minute_per_worker": budget})})


@settings(max_examples=25, deadline=None)
@given(seq=st.lists(st.integers(0, 5), min_size=1, max_size=30),
       gaps=st.lists(st.floats(0.0, 12.0), min_size=30, max_size=30),
       batch=st.lists(st.booleans(), min_size=30, max_size=30),
       prio=st.lists(st.sampled_from(["bronze", "silver", "gold", "platinum"]), min_size=6,
                     max_size=6),
       slots=st.integers(1, 2), workers=st.integers(1, 2), budget=st.integers(1, 3))
def test_every_policy_pays_at_least_the_bound(seq: list[int], gaps: list[float],
                                              batch: list[bool], prio: list[str], slots: int,
                                              workers: int, budget: int) -> None:
    times = [sum(gaps[:j + 1]) for j in range(len(seq))]
    reqs = Requests(times, list(seq), [180] * len(seq), batch[: len(seq)])
    sc, cat = _budgeted(slots, workers, budget), catalog(6, prio)
    bound = budget_bound(sc, cat, reqs)
    assert bound is not None
    for name in POLICIES:
        c = simulate(sc, cat, reqs, policy_factory(name))
        assert bound.weighted_miss_cost <= c.weighted_miss_cost + 1e-6, name
