"""Tiny hand-built workloads for the simulator tests: one pool, equal adapters, generous
budgets, requests one second apart by default (loads finish long before the next request)."""

from __future__ import annotations

from loraplane.kernel.policy import Policy
from loraplane.simulator.catalog import Adapter, Catalog
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import BaseModelFleet, Fleet, Scenario


def scenario(slots: int, workers: int = 1, max_concurrent: int = 256) -> Scenario:
    fleet = Fleet(
        base_models=[
            BaseModelFleet(
                workers=workers,
                gpu_slots_per_worker=slots,
                host_slots_per_worker=1000,
                base_weights_bytes=1e9,
                kv_reserved_bytes=1e9,
                max_concurrent_per_worker=max_concurrent,
            )
        ]
    )
    policy = Policy.model_validate(
        {
            "cold_loads_per_minute_per_worker": 10_000,
            "request_budgets": {"interactive": {"max_wait_ms": 60_000}},
        }
    )
    return Scenario(name="tiny", fleet=fleet, policy=policy)


def catalog(n: int, priorities: list[str] | None = None) -> Catalog:
    prio = priorities or ["bronze"] * n
    return Catalog(
        tuple(
            Adapter(
                index=i,
                adapter_id=f"a{i:04d}",
                version="1.0.0",
                base_model=0,
                tenant=f"t{i:03d}",
                priority=prio[i],
                rank=16,
                size_bytes=16 * 1.7e6,
            )
            for i in range(n)
        ),
        n,
        {},
    )


def requests(trace: list[int], batch: list[bool] | None = None, gap_s: float = 1.0) -> Requests:
    return Requests(
        [i * gap_s for i in range(len(trace))],
        list(trace),
        [180] * len(trace),
        batch or [False] * len(trace),
    )
