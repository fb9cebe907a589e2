"""Synthetic arrivals: gamma inter-arrival gaps with a chosen coefficient of variation, bent
by a diurnal cycle.

Gaps are drawn in "operational time" (mean rate 1/rate_qps) and mapped to wall time through
the inverse of the cumulative diurnal rate (time rescaling), which keeps the burstiness (CV)
and imposes the daily shape. Bursts, peaks, canaries and tenants are added by
``requests.assign_adapters``, the same as for traces.
"""

from __future__ import annotations

import numpy as np

from loraplane.simulator.scenario import Diurnal, Workload

__all__ = ["arrivals"]


def _warp(u: np.ndarray, diurnal: Diurnal) -> np.ndarray:
    """Wall times t with Λ(t) = u, where Λ' = 1 + A sin(2π (t + φ) / P)."""
    if diurnal.amplitude == 0 or len(u) == 0:
        return u
    a, p, phi = diurnal.amplitude, diurnal.period_s, diurnal.phase_s
    grid = np.linspace(0.0, u[-1] / (1 - a) + p / 100, 200_000)
    cum = grid - a * p / (2 * np.pi) * (
        np.cos(2 * np.pi * (grid + phi) / p) - np.cos(2 * np.pi * phi / p)
    )
    return np.interp(u, cum, grid)


def arrivals(workload: Workload, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(seconds from start, output tokens) for ``workload.requests`` arrivals."""
    shape = 1.0 / workload.cv**2
    gaps = rng.gamma(shape, (1.0 / workload.rate_qps) / shape, size=workload.requests)
    times = _warp(np.cumsum(gaps) - gaps[0], workload.diurnal)
    tokens = np.maximum(
        1, rng.gamma(2.0, workload.output_tokens / 2.0, size=workload.requests).round()
    ).astype(np.int64)
    return times, tokens
