"""The hindsight per-window set: a reference for an online policy, not a bound.

Per base model and per window of ``window_s`` seconds, the ``workers x slots`` versions worth
most to the window's own requests (priority weight x what each would be charged unserved,
``CostModel.unloaded_miss_ms``), chosen knowing every request of the window; every request
of a version outside the window's set is charged that, every other one nothing. Between two
windows the set changes by at most what the pool's cold-load budget allows in a window (the
most valuable newcomers first, the most valuable leavers kept). What it knows is each
window's demand, not each arrival: the most a perfect rate forecast could know, where the LP
bound (``bound.py``) knows the second of every request. An online policy that comes within a
small factor of it forecasts rates about as well as can be done; one that is far above it
loses to its own decisions, not to the traffic.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from loraplane.simulator.catalog import Catalog
from loraplane.simulator.fleet import CostModel
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import Scenario

__all__ = ["WINDOW_S", "HindsightResult", "hindsight_set"]

WINDOW_S = 600.0


@dataclass(frozen=True)
class HindsightResult:
    weighted_miss_cost: float
    window_s: float
    windows: int
    loads: int
    """Versions that entered a set, the first window's included."""

    def as_dict(self) -> dict[str, float | int]:
        return {
            "weighted_miss_cost": round(self.weighted_miss_cost, 3),
            "window_s": self.window_s,
            "windows": self.windows,
            "loads": self.loads,
        }


def hindsight_set(
    scenario: Scenario, catalog: Catalog, requests: Requests, window_s: float = WINDOW_S
) -> HindsightResult:
    """The per-window set's weighted cost over every pool of the scenario."""
    cm = CostModel(scenario.fleet.costs, scenario.policy)
    budget = scenario.policy.cold_loads_per_minute_per_worker
    # per pool, per window: version -> the weighted charge of its requests left unserved
    value: dict[int, dict[int, dict[int, float]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(float))
    )
    if not len(requests):
        return HindsightResult(0.0, window_s, 0, 0)
    t0 = requests.time_s[0]
    for t, a, batch in zip(requests.time_s, requests.adapter, requests.batch, strict=True):
        spec = catalog.adapters[a]
        value[spec.base_model][int((t - t0) // window_s)][a] += cm.weight(
            spec.priority
        ) * cm.unloaded_miss_ms(batch)
    total, windows, loads = 0.0, 0, 0
    for pool, per_window in value.items():
        fleet = scenario.fleet.base_models[pool]
        size = fleet.workers * fleet.gpu_slots_per_worker
        allowance = fleet.workers * budget * max(1, math.floor(window_s / 60.0))
        held: set[int] = set()
        for w in sorted(per_window):
            demand = per_window[w]
            now = _next_set(demand, held, size, allowance)
            loads += len(now - held)
            total += sum(v for a, v in demand.items() if a not in now)
            windows += 1
            held = now
    return HindsightResult(total, window_s, windows, loads)


def _next_set(demand: dict[int, float], before: set[int], size: int, allowance: int) -> set[int]:
    """The ``size`` most valuable versions of the window, of which at most ``allowance`` are
    not in ``before`` (the other places go to the most valuable of ``before``)."""
    best = sorted(demand, key=lambda a: (-demand[a], a))[:size]
    newcomers = [a for a in best if a not in before]
    if len(newcomers) <= allowance:
        return set(best)
    out = {a for a in best if a in before} | set(newcomers[:allowance])
    kept = sorted(before - out, key=lambda a: (-demand.get(a, 0.0), a))
    return out | set(kept[: size - len(out)])
