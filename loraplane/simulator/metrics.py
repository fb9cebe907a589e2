"""Per-policy results: the counters the engine keeps and their summary (the JSON shape of
``loraplane simulate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loraplane.simulator.scenario import PRIORITIES

__all__ = ["Counters"]


@dataclass
class Counters:
    requests: int = 0
    gpu_hits: int = 0
    host_hits: int = 0
    cold_loads: int = 0
    swaps: int = 0
    fallbacks: int = 0
    retries: int = 0
    """Requests told to retry later (429 + Retry-After): not served, charged the wait."""
    retry_wait_ms: float = 0.0
    """The Retry-After of those 429s, summed: what the tenants were told to wait."""
    declined: int = 0
    """Of the 429s and fallbacks, those the policy's admission gave (it would not load)."""
    queued: int = 0
    platinum_cold_starts: int = 0
    canary_cold_starts: int = 0
    weighted_miss_cost: float = 0.0
    swap_ms_total: float = 0.0
    demand_swaps: int = 0
    preloads: int = 0
    preload_ms_total: float = 0.0
    hbm_peak_ratio: float = 0.0
    ttft_penalty_ms: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    routes: dict[str, int] = field(default_factory=dict)
    """Requests per route kind of the router (``router.routing.RouteKind``)."""
    slo: dict[str, list[int]] = field(default_factory=dict)
    """Per request class (and ``canary``: the requests of canary versions, by their class's
    budget): [requests, requests within their class's TTFT budget] (``Costs.slo_ttft_ms``)."""
    slo_priority: dict[str, list[int]] = field(default_factory=dict)
    """The same per tenant priority tier (bronze, silver, gold, platinum)."""

    def summary(self) -> dict[str, Any]:
        n = max(1, self.requests)
        pct = (
            np.percentile(self.ttft_penalty_ms, [50, 95, 99])
            if self.ttft_penalty_ms
            else [0.0, 0.0, 0.0]
        )
        return {
            "gpu_hit_rate": round(self.gpu_hits / n, 6),
            "host_hit_rate": round(self.host_hits / n, 6),
            "cold_loads": self.cold_loads,
            "swaps": self.swaps,
            "fallbacks": self.fallbacks,
            "retries": self.retries,
            "retry_wait_s_mean": round(self.retry_wait_ms / self.retries / 1000.0, 3)
            if self.retries
            else 0.0,
            "declined": self.declined,
            "queued": self.queued,
            "ttft_penalty_ms": {
                k: round(float(v), 3) for k, v in zip(("p50", "p95", "p99"), pct, strict=True)
            },
            "weighted_miss_cost": round(self.weighted_miss_cost, 3),
            "platinum_cold_starts": self.platinum_cold_starts,
            "canary_cold_starts": self.canary_cold_starts,
            "routes": {str(k): v for k, v in sorted(self.routes.items())},
            "slo_attainment": {
                k: round(met / n_k, 6) for k, (n_k, met) in sorted(self.slo.items()) if n_k
            },
            "slo_attainment_by_priority": {
                k: round(met / n_k, 6)
                for k, (n_k, met) in sorted(
                    self.slo_priority.items(), key=lambda kv: PRIORITIES.index(kv[0])
                )
                if n_k
            },
        }

    def seed_columns(self) -> dict[str, float]:
        """The seed's columns: HBM peak / HBM, mean time of an on-demand swap (of the
        preloads where nothing loads on demand: static merge), and the tokens/s that 95% of
        requests reach (5th percentile of per-request tokens/s)."""
        tps = float(np.percentile(self.tokens_per_s, 5)) if self.tokens_per_s else 0.0
        if self.demand_swaps:
            demand = self.swap_ms_total / self.demand_swaps
        else:
            demand = self.preload_ms_total / self.preloads if self.preloads else 0.0
        return {
            "hbm_peak_ratio": round(self.hbm_peak_ratio, 4),
            "swap_ms": round(demand, 3),
            "p95_tokens_per_s": round(tps, 3),
        }
