"""The request stream every policy replays: arrival times, adapters, tokens, request class.

How requests are mapped to adapters (the Azure traces have none), deterministically for a seed:
1. popularity: each request picks adapter ``i`` with probability ∝ ``(i + 1) ** -alpha``;
   with ``office_hours``, times its tenant's share at that hour (``OfficeHours``: a request
   drawn for a tenant outside its hours is kept with probability ``off_share``, else drawn
   again);
2. bursts: inside a burst window, each request goes to the burst adapter with probability
   ``share`` (an adapter that was cold becomes hot at once);
3. scheduled peaks: extra arrivals at ``qps`` (exponential gaps) for the peak adapter;
4. canaries: a request for an adapter with a canary version goes to the canary with
   probability ``percent / 100``;
5. class: a request is batch with probability ``batch_fraction``, interactive otherwise.
Tenant and priority come with the adapter (``catalog``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loraplane.simulator.catalog import Catalog
from loraplane.simulator.scenario import OfficeHours, Workload

__all__ = ["Requests", "assign_adapters", "popularity"]


@dataclass(frozen=True)
class Requests:
    """Column lists (not objects): the engine's loop reads them by index at a million rows."""

    time_s: list[float]
    adapter: list[int]
    output_tokens: list[int]
    batch: list[bool]

    def __len__(self) -> int:
        return len(self.time_s)


def popularity(n: int, alpha: float) -> np.ndarray:
    p = np.arange(1, n + 1, dtype=float) ** -alpha
    return p / p.sum()


def _in_office_hours(
    times: np.ndarray,
    adapter: np.ndarray,
    p: np.ndarray,
    hours: OfficeHours,
    catalog: Catalog,
    rng: np.random.Generator,
) -> np.ndarray:
    """Thinning: a draw outside its tenant's hours is kept with ``off_share``, else redrawn
    (by popularity) until kept, so each request's adapter has probability ∝ popularity x its
    tenant's share at that time."""
    tenants = sorted({a.tenant for a in catalog.adapters[: catalog.regular]})
    index = {t: k for k, t in enumerate(tenants)}
    offset = np.array(
        [
            hours.spread_s * index[a.tenant] / len(tenants)
            for a in catalog.adapters[: catalog.regular]
        ]
    )
    adapter = adapter.copy()
    todo = np.arange(len(times))
    for _ in range(10_000):
        local_h = np.mod(times[todo] + offset[adapter[todo]], 86_400.0) / 3600.0
        on = (local_h >= hours.start_h) & (local_h < hours.end_h)
        keep = on | (rng.random(len(todo)) < hours.off_share)
        todo = todo[~keep]
        if not todo.size:
            break
        adapter[todo] = rng.choice(catalog.regular, size=len(todo), p=p)
    return adapter


def assign_adapters(
    times: np.ndarray,
    tokens: np.ndarray,
    workload: Workload,
    catalog: Catalog,
    rng: np.random.Generator,
) -> Requests:
    """Map arrivals (seconds from start, sorted) to adapters as described in the module doc."""
    times = np.asarray(times, dtype=float)
    tokens = np.asarray(tokens, dtype=np.int64)
    p = popularity(catalog.regular, workload.alpha)
    adapter = rng.choice(catalog.regular, size=len(times), p=p)
    if workload.office_hours is not None:
        adapter = _in_office_hours(times, adapter, p, workload.office_hours, catalog, rng)
    for burst in workload.bursts:
        window = (times >= burst.at_s) & (times < burst.at_s + burst.duration_s)
        hit = window & (rng.random(len(times)) < burst.share)
        adapter[hit] = min(burst.rank, catalog.regular - 1)
    extra_t, extra_a = [times], [adapter]
    for peak in workload.peaks:
        n = rng.poisson(peak.qps * peak.duration_s)
        extra_t.append(np.sort(peak.at_s + rng.random(n) * peak.duration_s))
        extra_a.append(np.full(n, min(peak.rank, catalog.regular - 1)))
    extra_tokens = rng.choice(tokens, size=sum(len(t) for t in extra_t[1:]))
    times = np.concatenate(extra_t)
    adapter = np.concatenate(extra_a)
    tokens = np.concatenate([tokens, extra_tokens])
    order = np.argsort(times, kind="stable")
    times, adapter, tokens = times[order], adapter[order], tokens[order]
    if catalog.canary_of:
        lookup = np.full(len(catalog), -1)
        for parent, canary in catalog.canary_of.items():
            lookup[parent] = canary
        to_canary = (lookup[adapter] >= 0) & (
            rng.random(len(adapter)) < workload.canaries.percent / 100
        )
        adapter[to_canary] = lookup[adapter[to_canary]]
    batch = rng.random(len(times)) < workload.batch_fraction
    return Requests(
        times.tolist(), adapter.tolist(), np.maximum(tokens, 1).tolist(), batch.tolist()
    )
