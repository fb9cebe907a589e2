"""The numbers of a run, computed from the rows ClickHouse recorded and what the client saw.
Pure: no I/O.

Definitions (the same words the report and the dashboards use):
- hit rate: requests that arrived with their adapter on a GPU / all requests;
- cold loads: host -> GPU loads (cache events ``load``); swap ms: their ``swap_ms``;
- fallbacks: requests served by the base model (tier ``base_fallback``);
- refusals: refused or deferred requests (by error), failed or refused loads (by reason)
  and rejected lifecycle events (dead letters, by reason);
- percentiles are exact and match ClickHouse's ``quantileExact``: the value at index
  ``floor(q * n)`` of the sorted sample.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from loraplane.demo.measure import CacheRow, Recorded, RequestRow

__all__ = [
    "ClassStats",
    "Summary",
    "by_class",
    "max_loads_per_minute",
    "quantile_exact",
    "refusals",
    "summarize",
]


def quantile_exact(values: Iterable[float], q: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class ClassStats:
    request_class: str
    requests: int
    ttft_p95_ms: float | None
    ttft_p99_ms: float | None


@dataclass(frozen=True)
class Summary:
    requests: int
    gpu_hits: int
    hit_rate: float
    cold_loads: int
    swap_p95_ms: float | None
    fallbacks: int
    errors: int
    by_class: list[ClassStats]
    refusals: dict[str, int]  # "request:<error>" / "load:<kind>:<reason>" / "registry:<reason>"
    evictions: int
    max_loads_per_minute: int  # most loads by one worker in any 60 s
    client_status: dict[int, int] = field(default_factory=dict)  # 0: no response

    def to_json(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "gpu_hits": self.gpu_hits,
            "hit_rate": round(self.hit_rate, 4),
            "cold_loads": self.cold_loads,
            "swap_p95_ms": self.swap_p95_ms,
            "fallbacks": self.fallbacks,
            "errors": self.errors,
            "ttft_by_class": {
                c.request_class: {
                    "requests": c.requests,
                    "ttft_p95_ms": c.ttft_p95_ms,
                    "ttft_p99_ms": c.ttft_p99_ms,
                }
                for c in self.by_class
            },
            "refusals": dict(sorted(self.refusals.items())),
            "evictions": self.evictions,
            "max_loads_per_minute": self.max_loads_per_minute,
            "client_status": {str(k): v for k, v in sorted(self.client_status.items())},
        }


def by_class(rows: Sequence[RequestRow]) -> list[ClassStats]:
    out = []
    for cls in sorted({r.request_class for r in rows}):
        ttfts = [r.ttft_ms for r in rows if r.request_class == cls and r.ttft_ms is not None]
        out.append(
            ClassStats(
                cls,
                sum(r.request_class == cls for r in rows),
                quantile_exact(ttfts, 0.95),
                quantile_exact(ttfts, 0.99),
            )
        )
    return out


def max_loads_per_minute(cache: Sequence[CacheRow]) -> int:
    """The most ``load`` events one worker had in any sliding 60 s window."""
    best = 0
    by_worker: dict[str, list[datetime]] = {}
    for row in cache:
        if row.kind == "load":
            by_worker.setdefault(row.worker_id, []).append(row.ts)
    for stamps in by_worker.values():
        stamps.sort()
        lo = 0
        for hi, ts in enumerate(stamps):
            while ts - stamps[lo] >= timedelta(seconds=60):
                lo += 1
            best = max(best, hi - lo + 1)
    return best


def refusals(recorded: Recorded) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for r in recorded.requests:
        if r.status in ("refused", "retry_later", "error"):
            counts[f"request:{r.status}:{r.error or '-'}"] += 1
    for c in recorded.cache:
        if c.kind in ("refuse", "fail"):
            counts[f"load:{c.kind}:{c.reason or '-'}"] += 1
    for d in recorded.dead_letters:
        counts[f"{d.component or 'unknown'}:{d.reason}"] += 1
    return dict(counts)


def summarize(recorded: Recorded, client_status: dict[int, int] | None = None) -> Summary:
    rows = recorded.requests
    hits = sum(r.tier == "gpu" for r in rows)
    loads = [c for c in recorded.cache if c.kind == "load"]
    return Summary(
        requests=len(rows),
        gpu_hits=hits,
        hit_rate=hits / len(rows) if rows else 0.0,
        cold_loads=len(loads),
        swap_p95_ms=quantile_exact((c.swap_ms for c in loads), 0.95),
        fallbacks=sum(r.tier == "base_fallback" for r in rows),
        errors=sum(r.status == "error" for r in rows),
        by_class=by_class(rows),
        refusals=refusals(recorded),
        evictions=sum(c.kind in ("unload", "evict") for c in recorded.cache),
        max_loads_per_minute=max_loads_per_minute(recorded.cache),
        client_status=dict(client_status or {}),
    )
