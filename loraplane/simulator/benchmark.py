"""One benchmark run: build the request stream of a scenario, replay it with each policy,
bound it (the budgeted LP bound of each policy's deployment, and the budget-free offline
optimum), and return the result in the shape of ``loraplane simulate --json``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loraplane.simulator.bound import budget_bound
from loraplane.simulator.catalog import Catalog, build_catalog
from loraplane.simulator.engine import simulate
from loraplane.simulator.hindsight import hindsight_set
from loraplane.simulator.metrics import Counters
from loraplane.simulator.optimum import optimum
from loraplane.simulator.policies import BASELINES, is_loraplane, policy_factory
from loraplane.simulator.requests import Requests, assign_adapters
from loraplane.simulator.scenario import Scenario
from loraplane.simulator.synthetic import arrivals
from loraplane.simulator.trace import load_trace

__all__ = [
    "Workbench",
    "kind",
    "pool_slots",
    "prepare",
    "run",
    "run_policy",
    "seed_comparison",
    "sweep",
]


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


def kind(scenario: Scenario, name: str) -> dict[str, bool]:
    """What a row stands for: ``online`` (decides without the future), ``baseline`` (not a
    loraplane row) and ``own_deployment`` (an override gives it other slots or budget, so its
    cost is not comparable row for row)."""
    cache = BASELINES.get(name)
    return {
        "online": cache.online if cache is not None else True,
        "baseline": not is_loraplane(name),
        "own_deployment": name in scenario.overrides,
        "preloads": bool(cache is not None and cache.merged),
    }


def run(
    bench: Workbench, policies: list[str], progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every policy on the workbench, the bounds of each deployment and the hindsight
    reference; ``progress`` is told each step as it starts."""
    tell = progress or (lambda _: None)
    result: dict[str, Any] = {
        "scenario": bench.scenario.model_dump(mode="json"),
        "requests": len(bench.requests),
        "policies": {},
        "timing_s": {},
        "kinds": {},
    }
    seed_columns: dict[str, dict[str, float]] = {}
    bounds: dict[tuple[object, ...], dict[str, Any]] = {}
    result["bounds"] = {}
    for n, name in enumerate(policies, 1):
        tell(f"policy {n}/{len(policies)}: {name}")
        started = time.perf_counter()
        counters = run_policy(bench, name)
        result["timing_s"][name] = round(time.perf_counter() - started, 3)
        result["policies"][name] = counters.summary()
        result["kinds"][name] = kind(bench.scenario, name)
        seed_columns[name] = counters.seed_columns()
    tell("the budgeted LP bound")
    started = time.perf_counter()
    result["bound"] = _bound_of(bench, bench.scenario, bounds, preloaded=False)
    for name in policies:
        result["bounds"][name] = _bound_of(
            bench,
            bench.scenario.for_policy(name),
            bounds,
            preloaded=result["kinds"][name]["preloads"],
        )
    result["timing_s"]["bound"] = round(time.perf_counter() - started, 3)
    tell("the hindsight per-window set")
    result["hindsight"] = hindsight_set(bench.scenario, bench.catalog, bench.requests).as_dict()
    tell("the budget-free optimum")
    started = time.perf_counter()
    best = optimum(bench.scenario, bench.catalog, bench.requests, pool_slots(bench.scenario))
    result["timing_s"]["optimum"] = round(time.perf_counter() - started, 3)
    result["optimum"] = best.as_dict() if best else None
    if bench.scenario.seed_reference:
        result["seed_comparison"] = seed_comparison(bench.scenario, seed_columns)
    return result


def _bound_of(
    bench: Workbench,
    scenario: Scenario,
    cache: dict[tuple[object, ...], dict[str, Any]],
    preloaded: bool,
) -> dict[str, Any]:
    """The budgeted bound of one deployment (slots, load budget, and whether its slots start
    filled), computed once per deployment: policies with the scenario's own share it."""
    key = (
        tuple(b.gpu_slots_per_worker for b in scenario.fleet.base_models),
        scenario.policy.cold_loads_per_minute_per_worker,
        preloaded,
    )
    if key not in cache:
        cache[key] = budget_bound(scenario, bench.catalog, bench.requests, preloaded).as_dict()
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
            "simulated": sim,
            "seed": seed,
            "simulated_relative": {k: _ratio(sim[k], ours[ref][k]) for k in sim},
            "seed_relative": {
                k: _ratio(
                    seed[_seed_key(k)], scenario.seed_reference[ref].model_dump()[_seed_key(k)]
                )
                for k in sim
            },
        }
    return {"reference": ref, "rows": rows}


def _seed_key(column: str) -> str:
    return {
        "hbm_peak_ratio": "hbm_peak",
        "swap_ms": "swap_ms",
        "p95_tokens_per_s": "p95_tokens_per_s",
    }[column]


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def sweep(bench: Workbench, policies: list[str]) -> dict[str, Any]:
    """Hit rate and weighted miss cost per policy at each GPU slot count of the sweep."""
    slots = bench.scenario.sweep.gpu_slots_per_worker
    out: dict[str, Any] = {"gpu_slots_per_worker": slots, "policies": {}, "optimum": []}
    for name in policies:
        rows = [run_policy(bench, name, s).summary() for s in slots]
        out["policies"][name] = {
            "gpu_hit_rate": [r["gpu_hit_rate"] for r in rows],
            "weighted_miss_cost": [r["weighted_miss_cost"] for r in rows],
        }
    out["bound"] = []
    for s in slots:
        best = optimum(
            bench.scenario,
            bench.catalog,
            bench.requests,
            pool_slots(bench.scenario.with_gpu_slots(s)),
        )
        out["optimum"].append(best.weighted_miss_cost if best else None)
        bound = budget_bound(bench.scenario.with_gpu_slots(s), bench.catalog, bench.requests)
        out["bound"].append(bound.weighted_miss_cost if bound.binds else None)
    return out
