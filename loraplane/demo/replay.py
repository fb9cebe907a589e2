"""Replaying a trace through the fleet router (``loraplane router run``): real HTTP, real API
keys, request classes, a burst and a scheduled peak, at a bounded rate.

The request stream is the simulator's own (``loraplane.simulator``): arrival times and
output tokens from an Azure LLM trace (or synthetic arrivals when no trace is at hand), and
its request -> adapter mapping (power-law popularity, bursts, scheduled peaks, batch share),
so the demo drives exactly the traffic the policy benchmarks model. The first arrivals of
the trace are stretched or squeezed onto the run's duration, keeping their burstiness, and
capped at ``max_qps`` on average (peaks come on top). The canary split and the worker are
not planned here: the router picks both per request (sticky per session), as it would for
real users; the replayer knows only the router's URL and the tenants' API keys.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loraplane.demo.catalog import Adapter
from loraplane.router.server import WORKER_HEADER
from loraplane.simulator.catalog import Catalog as SimCatalog
from loraplane.simulator.requests import assign_adapters
from loraplane.simulator.scenario import Burst, Peak, Workload
from loraplane.simulator.synthetic import arrivals
from loraplane.simulator.trace import load_trace

__all__ = [
    "Action",
    "Outcome",
    "Planned",
    "Progress",
    "Replayer",
    "TrafficShape",
    "plan",
    "status_counts",
    "trace_arrivals",
]


@dataclass(frozen=True)
class TrafficShape:
    """What to replay: how long, how fast, and what is mixed into the trace."""

    duration_s: float
    max_qps: float = 3.0
    alpha: float = 1.0  # power-law popularity over the adapters, in catalog order
    batch_fraction: float = 0.2
    bursts: tuple[Burst, ...] = ()
    peaks: tuple[Peak, ...] = ()
    max_tokens: int = 16  # the tiny model serves 256 positions; outputs are capped here
    seed: int = 0


@dataclass(frozen=True)
class Planned:
    at_s: float
    adapter_id: str
    tenant_id: str
    request_class: str  # interactive | batch
    max_tokens: int
    session: str


def trace_arrivals(
    trace: Path | None, shape: TrafficShape, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(seconds from start, output tokens) of the base arrivals: the trace's first
    ``duration * max_qps`` requests spread over the duration, or synthetic ones."""
    wanted = max(1, int(shape.duration_s * shape.max_qps))
    if trace is None:
        workload = Workload(requests=wanted, rate_qps=shape.max_qps, cv=1.5)
        times, tokens = arrivals(workload, rng)
    else:
        times, tokens = load_trace(trace)
        times, tokens = times[:wanted], tokens[:wanted]
    n, span = len(times), float(times[-1])
    if span > 0:  # n arrivals over [0, duration): the last one a mean gap before the end
        times = times * (shape.duration_s * (n - 1) / (n * span))
    return times, tokens


def plan(adapters: Sequence[Adapter], shape: TrafficShape, trace: Path | None) -> list[Planned]:
    """The request stream, deterministic for ``shape.seed``; burst and peak ranks index
    ``adapters`` (0 = the most popular)."""
    rng = np.random.default_rng(shape.seed)
    times, tokens = trace_arrivals(trace, shape, rng)
    workload = Workload(
        adapters=len(adapters),
        alpha=shape.alpha,
        batch_fraction=shape.batch_fraction,
        bursts=list(shape.bursts),
        peaks=list(shape.peaks),
    )
    mapped = assign_adapters(
        times, tokens, workload, SimCatalog(adapters=(), regular=len(adapters), canary_of={}), rng
    )
    out: list[Planned] = []
    for i in range(len(mapped)):
        if mapped.time_s[i] >= shape.duration_s:
            continue
        adapter = adapters[mapped.adapter[i]]
        out.append(
            Planned(
                at_s=float(mapped.time_s[i]),
                adapter_id=adapter.adapter_id,
                tenant_id=adapter.tenant_id,
                request_class="batch" if mapped.batch[i] else "interactive",
                max_tokens=max(1, min(shape.max_tokens, int(mapped.output_tokens[i]))),
                session=f"s{int(rng.integers(0, 10_000))}",
            )
        )
    return out


@dataclass(frozen=True)
class Outcome:
    """What the client saw for one request."""

    planned: Planned
    lag_s: float  # how late it was sent (the concurrency bound holds requests back)
    status: int  # HTTP status; 0 = no response (connection error or timeout)
    latency_ms: float
    tier: str | None = None
    fallback: bool = False
    version: str | None = None
    error: str | None = None
    worker: str | None = None  # the worker that answered; None: refused by the router itself

    @property
    def reached_worker(self) -> bool:
        """A worker's gateway answered (and wrote the request's RequestLog); the router's
        own refusals (401/404/429/503 before any worker) are logged nowhere."""
        return self.worker is not None


def status_counts(outcomes: Sequence[Outcome]) -> dict[int, int]:
    """HTTP status -> requests (0: no response), in status order."""
    counts: dict[int, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    return dict(sorted(counts.items()))


@dataclass
class Progress:
    sent: int = 0
    done: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    fallbacks: int = 0


Action = tuple[float, Callable[[], Awaitable[None]]]
"""Something to do at a second of the replay (a promote, a rollback)."""


class Replayer:
    def __init__(
        self,
        router_url: str,
        api_keys: Mapping[str, str],
        *,
        concurrency: int = 8,
        timeout_s: float = 60.0,
    ) -> None:
        self.url = router_url.rstrip("/") + "/v1/completions"
        self.api_keys = dict(api_keys)  # tenant -> API key
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.progress = Progress()

    async def run(
        self,
        planned: Sequence[Planned],
        actions: Sequence[Action] = (),
        on_tick: Callable[[float, Progress], None] | None = None,
    ) -> list[Outcome]:
        import aiohttp

        start = time.monotonic()
        limit = asyncio.Semaphore(self.concurrency)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            side = [asyncio.create_task(self._at(start, at_s, act)) for at_s, act in actions]
            ticker = asyncio.create_task(self._ticks(start, on_tick)) if on_tick else None
            tasks = []
            for p in planned:
                await _sleep_until(start + p.at_s)
                await limit.acquire()
                tasks.append(asyncio.create_task(self._one(session, p, start, limit)))
                self.progress.sent += 1
            outcomes = list(await asyncio.gather(*tasks))
            await asyncio.gather(*side)
            if ticker:
                ticker.cancel()
        return outcomes

    async def _at(self, start: float, at_s: float, act: Callable[[], Awaitable[None]]) -> None:
        await _sleep_until(start + at_s)
        await act()

    async def _ticks(self, start: float, on_tick: Callable[[float, Progress], None]) -> None:
        while True:
            on_tick(time.monotonic() - start, self.progress)
            await asyncio.sleep(1.0)

    async def _one(
        self, session: object, p: Planned, start: float, limit: asyncio.Semaphore
    ) -> Outcome:
        import aiohttp

        assert isinstance(session, aiohttp.ClientSession)
        lag = time.monotonic() - start - p.at_s
        t0 = time.perf_counter()
        headers = {
            "Authorization": f"Bearer {self.api_keys[p.tenant_id]}",
            "X-Request-Class": p.request_class,
            "X-Session-Key": p.session,
            "X-Request-Id": uuid.uuid4().hex,
        }
        body = {
            "model": p.adapter_id,
            "prompt": f"replayed request for {p.adapter_id}",
            "max_tokens": p.max_tokens,
            "temperature": 0,
        }
        try:
            async with session.post(self.url, json=body, headers=headers) as resp:
                await resp.read()
                outcome = Outcome(
                    p,
                    lag,
                    resp.status,
                    (time.perf_counter() - t0) * 1000,
                    tier=resp.headers.get("X-Loraplane-Tier"),
                    fallback=resp.headers.get("X-Loraplane-Fallback") == "base",
                    version=resp.headers.get("X-Loraplane-Adapter-Version"),
                    worker=resp.headers.get(WORKER_HEADER),
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome = Outcome(
                p, lag, 0, (time.perf_counter() - t0) * 1000, error=type(exc).__name__
            )
        finally:
            limit.release()
        self.progress.done += 1
        self.progress.by_status[outcome.status] = self.progress.by_status.get(outcome.status, 0) + 1
        self.progress.fallbacks += outcome.fallback
        return outcome


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
