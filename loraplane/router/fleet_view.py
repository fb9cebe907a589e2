"""What ops look at for the fleet (``loraplane fleet status`` and the dashboard's fleet panel,
``GET /api/fleet``): per base model and worker, slots used and free, adapter versions per
tier, replicas, in-flight work, queue depth and heartbeat age, from the latest worker state
of each worker (``kernel.worker_states``). Pure (no I/O): the callers read the topic.

Queue depth is the routers' (requests waiting per base model at the flow-control queues of
``router.server``, not a worker's): the sum over the routers heard lately of their
``RouterState``; None (shown as "-") when no router reports.

A worker is *live* by the router's own rule (``kernel.heartbeat.heard_lately``),
so the view and the routing agree on which workers take traffic; a live worker whose state
says ``not_run`` (its gateway refuses every request) takes none, and its row says why. The
base model's totals of what serves (``serving_workers``, free GPU slots, ``replicas``) count
only live workers without ``not_run``, as the router routes and the planner plans.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from loraplane.kernel.heartbeat import heard_lately
from loraplane.schemas.router_state import RouterState
from loraplane.schemas.worker_state import WorkerState

__all__ = ["BaseModelRow", "FleetView", "WorkerRow", "fleet_view"]


@dataclass(frozen=True)
class WorkerRow:
    worker_id: str
    live: bool
    heartbeat_age_s: float
    gpu_slots_used: int
    gpu_slots_free: int
    gpu_versions: int
    host_versions: int
    protected: int  # GPU copies the worker holds never-evict
    in_flight: int
    cold_loads_last_minute: int
    hbm_usage: float | None
    cold_load_budget: int | None = None  # the budget it reports (load_stall_share), if any
    load_stall: float | None = None  # the share of decode rate its loads take, measured
    gpu_loras: tuple[str, ...] = ()  # the versions (lora names) per tier, sorted
    host_loras: tuple[str, ...] = ()
    not_run: str | None = None  # why its gateway refuses every request (WorkerState.not_run)


@dataclass(frozen=True)
class BaseModelRow:
    base_model: str
    workers: tuple[WorkerRow, ...]
    live_workers: int
    gpu_slots_free: int  # on serving workers (live, no not_run)
    replicas: dict[str, int]  # lora name -> GPU copies on serving workers
    in_flight: int = 0  # on live workers
    queue_depth: int | None = None  # the routers' queues for this base model; None: unknown
    queued_by_band: dict[str, int] | None = None  # the same, per band
    routers: int = 0  # routers heard lately
    router_in_flight: int = 0  # forwarded by those routers, not yet answered
    serving_workers: int = 0  # live workers whose gateway serves (no not_run)


@dataclass(frozen=True)
class FleetView:
    base_models: tuple[BaseModelRow, ...]

    def as_json(self) -> dict[str, object]:
        return {"base_models": [asdict(b) for b in self.base_models]}


def fleet_view(
    states: Iterable[WorkerState],
    now: float,
    heartbeat_s: float,
    routers: Iterable[RouterState] = (),
) -> FleetView:
    """The view of the latest ``states`` (one per worker) and ``routers`` (one per router)
    at epoch seconds ``now``; a silent router's queues do not count."""
    live_routers = [r for r in routers if heard_lately(r, now, heartbeat_s)]
    queued: dict[str, Counter[str]] = {}
    in_flight: Counter[str] = Counter()
    for r in live_routers:
        for q in r.queues:
            queued.setdefault(q.base_model, Counter())[q.band] += q.queued
        in_flight.update(r.in_flight)
    by_base: dict[str, list[WorkerState]] = {}
    for s in states:
        by_base.setdefault(s.base_model, []).append(s)
    rows = []
    for base in sorted(by_base):
        workers, replicas = [], Counter[str]()
        for s in sorted(by_base[base], key=lambda s: s.worker_id):
            age = max(0.0, now - s.ts.timestamp())
            live = heard_lately(s, now, heartbeat_s)
            gpu = [a for a in s.adapters if a.tier == "gpu"]
            if live and s.serves:  # a not_run worker's copies serve nothing
                replicas.update(a.lora_name for a in gpu)
            workers.append(
                WorkerRow(
                    worker_id=s.worker_id,
                    live=live,
                    heartbeat_age_s=round(age, 3),
                    gpu_slots_used=len(gpu),
                    gpu_slots_free=max(0, s.gpu_slots_total - len(gpu)),
                    gpu_versions=len(gpu),
                    host_versions=len(s.adapters) - len(gpu),
                    protected=sum(1 for a in gpu if a.protected),
                    in_flight=sum(a.in_flight for a in s.adapters),
                    cold_loads_last_minute=s.cold_loads_last_minute,
                    hbm_usage=s.hbm_usage,
                    cold_load_budget=s.cold_load_budget,
                    load_stall=s.load_stall,
                    gpu_loras=tuple(sorted(a.lora_name for a in gpu)),
                    host_loras=tuple(sorted(a.lora_name for a in s.adapters if a.tier != "gpu")),
                    not_run=None if s.not_run is None else str(s.not_run),
                )
            )
        rows.append(
            BaseModelRow(
                base_model=base,
                workers=tuple(workers),
                live_workers=sum(1 for w in workers if w.live),
                gpu_slots_free=sum(w.gpu_slots_free for w in workers if _serving(w)),
                replicas=dict(sorted(replicas.items())),
                in_flight=sum(w.in_flight for w in workers if w.live),
                queue_depth=sum(queued.get(base, {}).values()) if live_routers else None,
                queued_by_band=dict(sorted(queued.get(base, Counter()).items()))
                if live_routers
                else None,
                routers=len(live_routers),
                router_in_flight=in_flight.get(base, 0),
                serving_workers=sum(1 for w in workers if _serving(w)),
            )
        )
    return FleetView(tuple(rows))


def _serving(w: WorkerRow) -> bool:
    """Live, and its gateway serves (its state says no ``not_run``)."""
    return w.live and w.not_run is None
