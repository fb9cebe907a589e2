"""The adapters of a scenario: who owns each, its priority, rank, size and base model.

Adapter ``i`` (for ``i < workload.adapters``) is the i-th most popular; canary versions of the
``canaries.count`` most popular adapters follow. Everything is drawn from the scenario seed, so
the same file always yields the same catalog.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from loraplane.simulator.scenario import PRIORITIES, PriorityName, Scenario

__all__ = ["Adapter", "Catalog", "K", "build_catalog"]

K = TypeVar("K")


@dataclass(frozen=True)
class Adapter:
    index: int
    adapter_id: str
    version: str
    base_model: int
    tenant: str
    priority: PriorityName
    rank: int
    size_bytes: float
    canary_percent: float = 0.0
    stable_of: int | None = None

    @property
    def is_canary(self) -> bool:
        return self.stable_of is not None


@dataclass(frozen=True)
class Catalog:
    adapters: tuple[Adapter, ...]
    regular: int
    canary_of: dict[int, int]

    def __len__(self) -> int:
        return len(self.adapters)


def _weighted_choice(rng: np.random.Generator, weights: Mapping[K, float], n: int) -> list[K]:
    keys = list(weights)
    p = np.asarray([weights[k] for k in keys], dtype=float)
    return [keys[i] for i in rng.choice(len(keys), size=n, p=p / p.sum())]


def build_catalog(scenario: Scenario, rng: np.random.Generator) -> Catalog:
    w = scenario.workload
    mix = {k: v for k, v in w.priority_mix.items() if k in PRIORITIES}
    tenant_priority = _weighted_choice(rng, mix, w.tenants)
    shares = {i: b.share for i, b in enumerate(scenario.fleet.base_models)}
    base_models = _weighted_choice(rng, shares, w.adapters)
    ranks = _weighted_choice(rng, w.ranks, w.adapters)
    bytes_per_rank = scenario.fleet.costs.adapter_bytes_per_rank
    adapters: list[Adapter] = []
    for i in range(w.adapters):
        tenant = i % w.tenants
        adapters.append(
            Adapter(
                index=i,
                adapter_id=f"a{i:04d}",
                version="1.0.0",
                base_model=int(base_models[i]),
                tenant=f"t{tenant:03d}",
                priority=tenant_priority[tenant],
                rank=int(ranks[i]),
                size_bytes=int(ranks[i]) * bytes_per_rank,
            )
        )
    canary_of: dict[int, int] = {}
    for parent in adapters[: min(w.canaries.count, w.adapters)]:
        index = len(adapters)
        adapters.append(
            Adapter(
                index=index,
                adapter_id=parent.adapter_id,
                version="1.1.0",
                base_model=parent.base_model,
                tenant=parent.tenant,
                priority=parent.priority,
                rank=parent.rank,
                size_bytes=parent.size_bytes,
                canary_percent=w.canaries.percent,
                stable_of=parent.index,
            )
        )
        canary_of[parent.index] = index
    return Catalog(tuple(adapters), w.adapters, canary_of)
