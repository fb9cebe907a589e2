"""The limits: Belady's hit rate bounds every demand-loading online policy from above, and
the min-cost-flow optimum bounds their priority-weighted miss cost from below.

loraplane's policy is not in these properties: its planner prefetches (loads before a
request), and a prefetching policy may legitimately beat a demand-paging bound.
"""

from __future__ import annotations

import functools
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.simulator.engine import simulate
from loraplane.simulator.optimum import optimum, weighted_paging_cost
from loraplane.simulator.policies import policy_factory
from tests.unit.simulator_tiny import catalog, requests, scenario

ONLINE = ("lru", "fifo", "s3-fifo", "sieve", "gdsf")
PRIORITIES = ("bronze", "silver", "gold", "platinum")

traces = st.integers(1, 6).flatmap(
    lambda n: st.lists(st.integers(0, n - 1), min_size=1, max_size=40)
)


@settings(max_examples=60, deadline=None)
@given(
    trace=traces,
    slots=st.integers(1, 4),
    prio=st.lists(st.sampled_from(PRIORITIES), min_size=6, max_size=6),
    batch=st.lists(st.booleans(), min_size=40, max_size=40),
)
def test_belady_and_optimum_bound_every_online_policy(
    trace: list[int], slots: int, prio: list[str], batch: list[bool]
) -> None:
    sc, cat = scenario(slots), catalog(6, prio)
    reqs = requests(trace, batch[: len(trace)])
    best_hits = simulate(sc, cat, reqs, policy_factory("belady")).gpu_hits
    best_cost = optimum(sc, cat, reqs, {0: slots})
    assert best_cost is not None and best_cost.exact
    for name in ONLINE:
        c = simulate(sc, cat, reqs, policy_factory(name))
        assert c.gpu_hits <= best_hits, name
        assert best_cost.weighted_miss_cost <= c.weighted_miss_cost + 1e-6, name


def _brute(seq: tuple[int, ...], costs: tuple[int, ...], k: int, free_start: bool) -> int:
    """Every choice at every miss (bypass, or load evicting any resident)."""

    @functools.cache
    def f(j: int, cache: frozenset[int]) -> int:
        if j == len(seq):
            return 0
        a = seq[j]
        if a in cache:
            return f(j + 1, cache)
        options = [f(j + 1, cache)]
        if len(cache) < k:
            options.append(f(j + 1, cache | {a}))
        options += [f(j + 1, (cache - {v}) | {a}) for v in cache]
        return costs[j] + min(options)

    starts = [frozenset()]
    if free_start:
        starts = [
            frozenset(c) for r in range(k + 1) for c in itertools.combinations(sorted(set(seq)), r)
        ]
    return min(f(0, s) for s in starts)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), k=st.integers(1, 3), free_start=st.booleans())
def test_min_cost_flow_equals_exhaustive_search(
    data: st.DataObject, k: int, free_start: bool
) -> None:
    seq = data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=9))
    costs = data.draw(st.lists(st.integers(0, 9), min_size=len(seq), max_size=len(seq)))
    assert weighted_paging_cost(seq, costs, k, free_start) == _brute(
        tuple(seq), tuple(costs), k, free_start
    )


def test_segmented_bound_is_below_the_exact_optimum() -> None:
    trace = [(i * 7 + i // 3) % 9 for i in range(120)]
    costs = [1 + (i * 5) % 4 for i in range(120)]
    exact = weighted_paging_cost(trace, costs, 3)
    bound = sum(
        weighted_paging_cost(trace[lo : lo + 30], costs[lo : lo + 30], 3, free_start=True)
        for lo in range(0, 120, 30)
    )
    assert bound <= exact
