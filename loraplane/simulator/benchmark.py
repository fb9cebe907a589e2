"""One benchmark run: build the request stream of a scenario, replay it with each policy,
bound it (the budgeted LP bound of each policy's deployment, and the budget-free offline
optimum), and return the result in the shape of ``loraplane simulate --json``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loraplane.simulator.bound import budget_bound
from loraplane.simulator.catalog import Catalog, build_catalog
from loraplane.simulator.engine import simulate
from loraplane.simulator.metrics import Counters
from loraplane.simulator.optimum import optimum
from loraplane.simulator.policies import policy_factory
from loraplane.simulator.requests import Requests, assign_adapters
from loraplane.simulator.scenario import Scenario
from loraplane.simulator.synthetic import arrivals
from loraplane.simulator.trace import load_trace


@dataclass(frozen=True)
class Workbench:
    scenario: Scenario
    catalog: Catalog
    requests: Requests


def prepare(scenario: Scenario) -> Workbench:
    """Catalog and request stream, both drawn from ``scenario.seed`` (deterministic)."""
    rng = np.random.default_rng(scenario.seed)
    catalog = build_catalog(scenario, rng)
    w = scenario.workload
    if w.source == "trace":
        assert w.trace is not None
        times, tokens = load_trace(Path(w.trace))
    else:
        times, tokens = arrivals(w, rng)
    return Workbench(scenario, catalog, assign_adapters(times, tokens, w, catalog, rng))


def run_policy(bench: Workbench, name: str, gpu_slots: int | None = None) -> Counters:
    """Replay with one policy; ``gpu_slots`` (per worker) overrides the scenario's."""
    scenario = bench.scenario.for_policy(name)
    if gpu_slots:
        scenario = scenario.with_gpu_slots(gpu_slots)
    return simulate(scenario, bench.catalog, bench.requests, policy_factory(name))


def pool_slots(scenario: Scenario) -> dict[int, int]:
    return {i: b.gpu_slots_per_worker * b.workers for i, b in enumerate(scenario.fleet.base_models)}


def run(bench: Workbench, policies: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {"scenario": bench.scenario.model_dump(mode="json"),
                              "requests": len(bench.requests), "policies": {}, "timing_s": {}}
    seed_columns: dict[str, dict[str, float]] = {}
    bounds: dict[tuple[object, ...], dict[str, float | int] | None] = {}
    result["bounds"] = {}
    for name in policies:
        started = time.perf_counter()
        counters = run_policy(bench, name)
        result["timing_s"][name] = round(time.perf_counter() - started, 3)
        result["policies"][name] = counters.summary()
        seed_columns[name] = counters.seed_columns()
    started = time.perf_counter()
    result["bound"] = _bound_of(bench, bench.scenario, bounds)
    for name in policies:
        result["bounds"][name] = _bound_of(bench, bench.scenario.for_policy(name), bounds)
    result["timing_s"]["bound"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    best = optimum(bench.scenario, bench.catalog, bench.requests, pool_slots(bench.scenario))
    result["timing_s"]["optimum"] = round(time.perf_counter() - started, 3)
    result["optimum"] = best.as_dict() if best else None
    if bench.scenario.seed_reference:
        result["seed_comparison"] = seed_comparison(bench.scenario, seed_columns)
    return result


def _bound_of(bench: Workbench, scenario: Scenario,
              cache: dict[tuple[object, ...], dict[str, float | int] | None],
              ) -> dict[str, float | int] | None:
    """The budgeted bound of one deployment (slots and load budget), computed once per
    deployment: policies with the scenario's own share it."""
    key = (tuple(b.gpu_slots_per_worker for b in scenario.fleet.base_models),
           scenario.policy.cold_loads_per_minute_per_worker)
    if key not in cache:
        found = budget_bound(scenario, bench.catalog, bench.requests)
        cache[key] = found.as_dict() if found else None
    return cache[key]


def seed_comparison(scenario: Scenario, ours: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The seed's columns for every policy the seed measured, absolute and relative to the
    seed's own reference row (the last listed: the pooled hot set), beside the seed's."""
    names = [n for n in scenario.seed_reference if n in ours]
    if not names:
        return {}
    ref = names[-1]
    rows: dict[str, Any] = {}
    for name in names:
        seed = scenario.seed_reference[name].model_dump()
        sim = ours[name]
        rows[name] = {
            "simulated": sim, "seed": seed,
            "simulated_relative": {k: _ratio(sim[k], ours[ref][k]) for k in sim},
            "seed_relative": {k: _ratio(seed[_seed_key(k)], scenario.seed_reference[ref]
                                        .model_dump()[_seed_key(k)]) for k in sim},
        }
    return {"reference": ref, "rows": rows}


def _seed_key(column: str) -> str:
    return {"hbm_peak_ratio": "hbm_peak", "swap_ms": "swap_ms",
            "p95_tokens_per_s": "p95_tokens_per_s"}[column]


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def sweep(bench: Workbench, policies: list[str]) -> dict[str, Any]:
    """Hit rate and weighted miss cost per policy at each GPU slot count of the sweep."""
    slots = bench.scenario.sweep.gpu_slots_per_worker
    out: dict[str, Any] = {"gpu_slots_per_worker": slots, "policies": {}, "optimum": []}
    for name in policies:
        rows = [run_policy(bench, name, s).summary() for s in slots]
        out["policies"][name] = {"gpu_hit_rate": [r["gpu_hit_rate"] for r in rows],
                                 "weighted_miss_cost": [r["weighted_miss_cost"] for r in rows]}
    out["bound"] = []
    for s in slots:
        best = optimum(bench.scenario, bench.catalog, bench.requests,
                       pool_slots(bench.scenario.with_gpu_slots(s)))
        out["optimum"].append(best.weighted_miss_cost if best else None)
        bound = budget_bound(bench.scenario.with_gpu_slots(s), bench.catalog, bench.requests)
        out["bound"].append(bound.weighted_miss_cost if bound else None)
    return out
