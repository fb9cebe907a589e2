"""Every simulated policy by name. ``loraplane`` and ``loraplane-demand`` (the real scorer and
planner; the second with platinum pinning conditioned on demand) are imported lazily so the
baselines work even while the streams package is incomplete."""

from __future__ import annotations

from loraplane.simulator.policies.base import BYPASS, CachePolicy, Plan, PolicyContext
from loraplane.simulator.policies.belady import Belady
from loraplane.simulator.policies.fifo import FIFO
from loraplane.simulator.policies.gdsf import GDSF
from loraplane.simulator.policies.lru import LRU
from loraplane.simulator.policies.s3fifo import S3FIFO
from loraplane.simulator.policies.sieve import SIEVE
from loraplane.simulator.policies.static import StaticMerge

BASELINES: dict[str, type[CachePolicy]] = {
    p.name: p for p in (LRU, FIFO, S3FIFO, SIEVE, GDSF, Belady, StaticMerge)}
ALL = ("lru", "fifo", "s3-fifo", "sieve", "gdsf", "loraplane", "loraplane-demand", "belady")


def policy_class(name: str) -> type[CachePolicy]:
    if name in ("loraplane", "loraplane-demand"):
        from loraplane.simulator.policies.loraplane import Loraplane, LoraplaneDemand

        return Loraplane if name == "loraplane" else LoraplaneDemand
    try:
        return BASELINES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join((*ALL, 'static-merge'))}"
                         ) from None


def resolve(names: list[str]) -> list[str]:
    """``["all"]`` -> every policy; otherwise the names, checked."""
    out: list[str] = []
    for name in names:
        for n in (ALL if name == "all" else (name,)):
            policy_class(n)
            if n not in out:
                out.append(n)
    return out


__all__ = ["ALL", "BYPASS", "CachePolicy", "Plan", "PolicyContext", "policy_class", "resolve"]
