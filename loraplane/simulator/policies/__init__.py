"""Every simulated policy by name, as a factory the engine calls once per base model.

Demand-loading caches run one instance per worker (``PerWorker``); ``dynamo`` and the
``loraplane`` policies plan the whole pool. ``loraplane`` (the real scorer and planner with
the policy file as it is: the product's default policy when the file names none),
``loraplane-seed`` (the seed's hot score), ``loraplane-demand`` (platinum pinning conditioned
on demand) and ``loraplane-cost`` (the cost-aware hot score whatever the file names) are
imported lazily so the baselines work even while the streams package is incomplete."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from loraplane.simulator.policies.base import (
    BYPASS,
    CachePolicy,
    PerWorker,
    Plan,
    PolicyContext,
    WorkerCache,
)
from loraplane.simulator.policies.belady import Belady
from loraplane.simulator.policies.dynamo import Dynamo
from loraplane.simulator.policies.fifo import FIFO
from loraplane.simulator.policies.gdsf import GDSF
from loraplane.simulator.policies.lru import LRU
from loraplane.simulator.policies.s3fifo import S3FIFO
from loraplane.simulator.policies.sieve import SIEVE
from loraplane.simulator.policies.static import StaticMerge

PolicyFactory = Callable[[PolicyContext], CachePolicy]
BASELINES: dict[str, type[WorkerCache]] = {
    p.name: p for p in (LRU, FIFO, S3FIFO, SIEVE, GDSF, Belady, StaticMerge)
}
ALL = (
    "lru",
    "fifo",
    "s3-fifo",
    "sieve",
    "gdsf",
    "dynamo",
    "loraplane",
    "loraplane-seed",
    "loraplane-demand",
    "belady",
)
_LORAPLANE = ("loraplane", "loraplane-seed", "loraplane-demand", "loraplane-cost")


def policy_factory(name: str) -> PolicyFactory:
    if name in _LORAPLANE:
        from loraplane.simulator.policies.loraplane import (
            Loraplane,
            LoraplaneCost,
            LoraplaneDemand,
            LoraplaneSeed,
        )

        return {
            "loraplane": Loraplane,
            "loraplane-seed": LoraplaneSeed,
            "loraplane-demand": LoraplaneDemand,
            "loraplane-cost": LoraplaneCost,
        }[name]
    if name == Dynamo.name:
        return Dynamo
    try:
        return partial(PerWorker, cache=BASELINES[name])
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known: {', '.join((*ALL, 'loraplane-cost', 'static-merge'))}"
        ) from None


def is_loraplane(name: str) -> bool:
    """A row of loraplane's own planner (any variant), not a baseline."""
    return name in _LORAPLANE


def resolve(names: list[str]) -> list[str]:
    """``["all"]`` -> every policy; otherwise the names, checked."""
    out: list[str] = []
    for name in names:
        for n in ALL if name == "all" else (name,):
            policy_factory(n)
            if n not in out:
                out.append(n)
    return out


__all__ = [
    "ALL",
    "BASELINES",
    "BYPASS",
    "CachePolicy",
    "Plan",
    "PolicyContext",
    "PolicyFactory",
    "WorkerCache",
    "is_loraplane",
    "policy_factory",
    "resolve",
]
