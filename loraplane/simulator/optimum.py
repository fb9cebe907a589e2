"""The best any demand-loading policy could do: the exact offline optimum of priority-weighted
miss cost on small traces, and a lower bound on large ones.

Weighted caching with bypass is an interval problem: keeping an adapter in a slot between two
of its requests saves the second one's miss, and choosing the most valuable set of kept
intervals with at most ``k`` over every gap is a min-cost flow. A miss is worth the least the
engine can charge it (``CostModel.min_miss_ms``, weighted) and budgets and load times are
relaxed away, so the optimum is a lower bound of every policy that loads only on demand.
Large traces are solved in segments, each with a free initial cache, whose sum is a lower
bound. The formulation: docs/simulator.md, "The budget-free optimum".
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from loraplane.simulator.catalog import Catalog
from loraplane.simulator.fleet import CostModel
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import Scenario

__all__ = ["SCALE", "OptimumResult", "optimum", "weighted_paging_cost"]

SCALE = 1000  # costs in microseconds as integers: network simplex wants exact arithmetic


@dataclass(frozen=True)
class OptimumResult:
    weighted_miss_cost: float
    exact: bool
    segments: int

    def as_dict(self) -> dict[str, float | bool | int]:
        return {
            "weighted_miss_cost": round(self.weighted_miss_cost, 3),
            "exact": self.exact,
            "segments": self.segments,
        }


def weighted_paging_cost(
    adapters: list[int], costs: list[int], capacity: int, free_start: bool = False
) -> int:
    """Minimum total cost (integers) of serving ``adapters`` in order with ``capacity`` slots,
    where a miss of request ``j`` costs ``costs[j]``; ``free_start``: the cache starts holding
    any adapters we like."""
    n = len(adapters)
    if n == 0:
        return 0
    total = sum(costs)
    g = nx.DiGraph()
    start = -1
    g.add_node(start, demand=-capacity)
    g.add_node(n - 1, demand=capacity)
    g.add_edge(start, 0, capacity=capacity, weight=0)
    for r in range(n - 1):
        g.add_edge(r, r + 1, capacity=capacity, weight=0)
    last: dict[int, int] = {}
    extra = 0
    for j, a in enumerate(adapters):
        i = last.get(a, start if free_start else None)
        if i is not None and costs[j] > 0:
            if g.has_edge(i, j):  # parallel arc (i == start, j == 0): keep it as a side node
                extra += 1
                side = ("via", extra)
                g.add_edge(i, side, capacity=1, weight=-costs[j])
                g.add_edge(side, j, capacity=1, weight=0)
            else:
                g.add_edge(i, j, capacity=1, weight=-costs[j])
        last[a] = j
    return total + nx.min_cost_flow_cost(g)


def optimum(
    scenario: Scenario, catalog: Catalog, requests: Requests, gpu_slots: dict[int, int]
) -> OptimumResult | None:
    """Exact when the trace has at most ``optimum.exact_max_requests`` requests, else the
    segmented lower bound; ``None`` above ``optimum.bound_max_requests`` (it would take
    minutes). ``gpu_slots``: pool index -> slots."""
    if len(requests) > scenario.optimum.bound_max_requests:
        return None
    cm = CostModel(scenario.fleet.costs, scenario.policy)
    exact = len(requests) <= scenario.optimum.exact_max_requests
    seg = len(requests) if exact else scenario.optimum.segment_requests
    per_pool: dict[int, tuple[list[int], list[int]]] = {}
    for a, batch in zip(requests.adapter, requests.batch, strict=True):
        spec = catalog.adapters[a]
        cost = int(cm.weight(spec.priority) * cm.min_miss_ms(spec.size_bytes, batch) * SCALE)
        seq, cs = per_pool.setdefault(spec.base_model, ([], []))
        seq.append(a)
        cs.append(cost)
    total = 0
    segments = 0
    for pool, (seq, cs) in per_pool.items():
        for lo in range(0, len(seq), max(1, seg)):
            total += weighted_paging_cost(
                seq[lo : lo + seg], cs[lo : lo + seg], gpu_slots[pool], free_start=not exact
            )
            segments += 1
    return OptimumResult(total / SCALE, exact, segments)
