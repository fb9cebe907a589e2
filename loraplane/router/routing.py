"""Which worker serves a request's version: the fleet router's view of the fleet
(``FleetIndex``) and its rule (``pick_worker``). Pure (no I/O), time passed in. The version
is chosen before, once (``loraplane.frontdoor.version_choice``).

The rule, among the live workers of the version's base model whose rank fits: a GPU copy
(least in flight, idle copies taking turns), else a host-warm copy, else a free GPU slot
where the planner would place a new copy, else the least busy worker, whose gateway applies
the class's cold budget. A version just sent to a worker without a copy is *placed* there
until a heartbeat shows it, so the requests in the heartbeat's lag follow it instead of
filling another worker's slots. A worker that refused the version as its own moments ago
(the router remembers it) is chosen only when no other fits. Which workers count as live is
``router.liveness``.
docs/router.md, "How it picks", gives each step and why.

``pick_worker`` (and ``free_slot_order``) work over bare worker ids and callables, so the
policy simulator routes its simulated fleet with the same code.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

from loraplane.kernel.heartbeat import DRAIN_AFTER_HEARTBEATS
from loraplane.kernel.policy import Policy
from loraplane.router.liveness import (
    Feed,
    Gateway,
    Verdict,
    beat_of,
    verdict,
)
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.worker_state import WorkerState

__all__ = [
    "Drained",
    "FleetIndex",
    "Route",
    "RouteKind",
    "W",
    "free_slot_order",
    "least_busy",
    "pick_worker",
]


class RouteKind(StrEnum):
    """Why a worker was chosen (``X-Loraplane-Route``)."""

    gpu = "gpu"  # it holds the version on GPU
    host = "host"  # it holds the version in its host tier
    free_slot = "free_slot"  # it has a free GPU slot: where the planner would load it
    cold_budget = "cold_budget"  # no copy, no free slot: its gateway's cold budget applies
    placed = "placed"  # this router sent the version there moments ago (rule 3 or 4)


W = TypeVar("W", str, int)
"""A worker id: the router's ``worker_id``, the simulator's worker index."""


def _never(_: object) -> int:
    return 0


def least_busy(
    ids: Iterable[W],
    fits: Callable[[W], bool],
    busy: Callable[[W], int],
    turn: Callable[[W], int] = _never,
) -> W | None:
    """The fitting worker with the fewest in-flight requests; ties to the lowest ``turn``
    (when the caller last chose it: least recently first), then to the lowest id."""
    best: tuple[int, int, W] | None = None
    for wid in ids:
        if fits(wid):
            key = (busy(wid), turn(wid), wid)
            if best is None or key < best:
                best = key
    return best[2] if best else None


def free_slot_order(ids: Iterable[W], free: Callable[[W], int]) -> list[W]:
    """Workers with a free GPU slot as the planner fills them (rule 5): most free first,
    ties to the lowest id."""
    return sorted((wid for wid in ids if free(wid) > 0), key=lambda wid: (-free(wid), wid))


def pick_worker(
    gpu: Iterable[W],
    host: Iterable[W],
    free_order: Iterable[W],
    fleet: Iterable[W],
    *,
    fits: Callable[[W], bool],
    may_load: Callable[[W], bool],
    busy: Callable[[W], int],
    turn: Callable[[W], int] = _never,
) -> tuple[W, RouteKind] | None:
    """The routing rule (module doc) on worker ids: holders of a GPU copy, of a host copy,
    workers in free-slot order, and the whole fleet of the base model. ``fits``: live and
    rank-fit; ``may_load``: within cold-load budget and HBM watermark; ``busy``: in-flight;
    ``turn``: when the caller last chose the worker (higher is later; default: never, so
    ties go to the lowest id). ``free_order`` is consumed only when no copy fits, so it may
    be lazy."""
    for kind, holders in ((RouteKind.gpu, gpu), (RouteKind.host, host)):
        best = least_busy(holders, fits, busy, turn)
        if best is not None:
            return best, kind
    for wid in free_order:
        if fits(wid) and may_load(wid):
            return wid, RouteKind.free_slot
    best = least_busy(fleet, fits, busy, turn)
    return None if best is None else (best, RouteKind.cold_budget)


@dataclass(frozen=True)
class Drained:
    """One drain pass: the workers forgotten, the (worker id, gateway URL) to probe, and
    how many kept workers have a heartbeat too old to count (their gateways decide)."""

    gone: list[str]
    probe: list[tuple[str, str]]
    unvouched: int = 0


@dataclass(frozen=True)
class Route:
    worker_id: str
    gateway_url: str
    kind: RouteKind


@dataclass
class _IndexedWorker:
    """One worker as the index holds it: its last state, when its heartbeat counts from, the
    lora names resident on its GPU and host tier, and its gateway's health."""

    state: WorkerState
    beat: float  # epoch seconds the heartbeat counts from (``liveness.beat_of``)
    gpu: frozenset[str]
    host: frozenset[str]
    gateway: Gateway = field(default_factory=Gateway)

    @property
    def free_slots(self) -> int:
        return self.state.gpu_slots_total - len(self.gpu)


@dataclass
class FleetIndex:
    """The latest WorkerState of every worker, indexed by base model and lora name."""

    policy: Policy
    heartbeat_s: float
    workers: dict[str, _IndexedWorker] = field(default_factory=dict)
    _gpu: dict[str, set[str]] = field(default_factory=dict)  # lora -> worker ids
    _host: dict[str, set[str]] = field(default_factory=dict)
    _by_base: dict[str, set[str]] = field(default_factory=dict)
    _free_order: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    """base -> (-free slots, id) of its workers with a free slot, sorted; cached."""
    _placed: dict[str, tuple[str, float]] = field(default_factory=dict)  # lora -> (id, until)
    _placed_on: dict[str, set[str]] = field(default_factory=dict)  # worker id -> loras
    _turns: dict[str, int] = field(default_factory=dict)
    """worker id -> the number of this index's route that last chose it (``turn``)."""
    _routes: int = 0
    feed: Feed | None = None
    """Where the worker-state feed answered without a gap (the router sets it from its tail);
    None: the heartbeat alone decides (``liveness.verdict``)."""
    parked: dict[str, _IndexedWorker] = field(default_factory=dict)
    """Workers whose gateway failed since their last heartbeat (``Verdict.out``), or whose
    last state says their gateway refuses requests as not run (``WorkerState.not_run``): not
    routed, their last state kept, probed until they answer or go."""

    # ---- fed by the worker-state topic ----------------------------------------------------
    def update(self, state: WorkerState, arrived: float | None = None) -> None:
        """Take a worker's newer state, which arrived at epoch seconds ``arrived`` (None:
        its own ``ts``); one whose heartbeat counts from earlier than the held one's (a
        replay) is ignored."""
        ts = state.ts.timestamp()
        wid = state.worker_id
        now = ts if arrived is None else arrived
        beat = beat_of(ts, now)
        held = self.workers.get(wid) or self.parked.get(wid)
        if held is not None and held.beat > beat:
            return
        gpu = frozenset(a.lora_name for a in state.adapters if a.tier == "gpu")
        host = frozenset(a.lora_name for a in state.adapters if a.tier == "host") - gpu
        same_gateway = held is not None and held.state.gateway_url == state.gateway_url
        w = _IndexedWorker(
            state, beat, gpu, host, held.gateway if same_gateway and held else Gateway()
        )
        self.parked.pop(wid, None)
        # sent before its gateway failed, or the worker says its gateway refuses every
        # request as not run (vLLM hung, another base model): parked until a state without
        # it, or a probe whose /healthz has no ``not_run`` (``liveness.probe_ok``)
        if not state.serves or self._verdict(w, now) is Verdict.out:
            self.remove(wid)
            self.parked[wid] = w
            return
        self._insert(w)

    def _insert(self, w: _IndexedWorker) -> None:
        state, wid, gpu, host = w.state, w.state.worker_id, w.gpu, w.host
        old = self.workers.get(wid)
        order = self._free_order.get(state.base_model)
        self.remove(wid, keep_order=True)
        self.workers[wid] = w
        for name in gpu:
            self._gpu.setdefault(name, set()).add(wid)
        for name in host:
            self._host.setdefault(name, set()).add(wid)
        self._by_base.setdefault(state.base_model, set()).add(wid)
        for name in self._placed_on.get(wid, set()) & gpu:  # the copy shows: a plain holder
            self._unplace(name)
            order = None  # rebuilt: its keys were of the older state
        # the free-slot order depends on (free slots, id) only: most heartbeats keep it
        if (
            old is None
            or old.free_slots != w.free_slots
            or old.state.base_model != state.base_model
            or order is None
        ):
            self._free_order.pop(state.base_model, None)
            if old is not None:
                self._free_order.pop(old.state.base_model, None)

    def forget(self, worker_id: str) -> None:
        """The worker is gone (a tombstone, or a current feed shows it silent)."""
        self.parked.pop(worker_id, None)
        self.remove(worker_id)

    def remove(self, worker_id: str, *, keep_order: bool = False) -> None:
        w = self.workers.pop(worker_id, None)
        if w is None:
            return
        for names, index in ((w.gpu, self._gpu), (w.host, self._host)):
            for name in names:
                holders = index.get(name)
                if holders is not None:
                    holders.discard(worker_id)
                    if not holders:
                        del index[name]
        base = w.state.base_model
        self._by_base.get(base, set()).discard(worker_id)
        if not keep_order:
            self._turns.pop(worker_id, None)
            for name in list(self._placed_on.get(worker_id, ())):
                self._unplace(name)
            self._free_order.pop(base, None)

    def _unplace(self, name: str) -> None:
        placed = self._placed.pop(name, None)
        if placed is None:
            return
        wid = placed[0]
        names = self._placed_on.get(wid)
        if names is not None and name in names:
            before = self._free_slots(wid) if wid in self.workers else 0
            names.discard(name)
            if not names:
                del self._placed_on[wid]
            if wid in self.workers:
                self._shift(wid, before)

    def _place(self, name: str, wid: str, now: float) -> None:
        self._unplace(name)
        before = self._free_slots(wid)
        self._placed[name] = (wid, now + DRAIN_AFTER_HEARTBEATS * self.heartbeat_s)
        self._placed_on.setdefault(wid, set()).add(name)
        self._shift(wid, before)

    def _shift(self, wid: str, before: int) -> None:
        """Move ``wid`` in its cached free-slot order after its free count changed from
        ``before`` (a bisect, not a re-sort: a new copy's decision stays a few µs)."""
        order = self._free_order.get(self.workers[wid].state.base_model)
        if order is None:
            return
        if before > 0:
            i = bisect.bisect_left(order, (-before, wid))
            if i == len(order) or order[i] != (-before, wid):  # out of step: rebuild
                del self._free_order[self.workers[wid].state.base_model]
                return
            del order[i]
        after = self._free_slots(wid)
        if after > 0:
            bisect.insort(order, (-after, wid))

    def _expire(self, now: float) -> None:
        """Forget placements past their time. They all last as long, and ``_place`` re-inserts,
        so the dict is in expiry order: only the expired ones are looked at."""
        while self._placed:
            name, (_, until) = next(iter(self._placed.items()))
            if until >= now:
                return
            self._unplace(name)

    # ---- fed by the router: its gateways' own answers --------------------------------------
    def failed(self, worker_id: str, now: float) -> None:
        """The worker's gateway failed a request or a probe at ``now``: parked."""
        w = self.workers.get(worker_id) or self.parked.get(worker_id)
        if w is None:
            return
        w.gateway.failed_at = now
        if worker_id in self.workers:
            self.remove(worker_id)
            self.parked[worker_id] = w

    def probed(self, worker_id: str, url: str, ok: bool, now: float) -> None:
        """A probe of the worker's gateway at ``url`` answered (``liveness.probe_ok``) or
        not; a good one brings a parked worker back on its last state. A probe of a URL the
        worker no longer has is ignored."""
        w = self.workers.get(worker_id) or self.parked.get(worker_id)
        if w is None or w.state.gateway_url != url:
            return
        w.gateway.probing = False
        if not ok:
            self.failed(worker_id, now)
            return
        w.gateway.ok_at = now
        if self.parked.pop(worker_id, None) is not None:
            self._insert(w)

    def drain(self, now: float) -> Drained:
        """Forget the workers gone (``liveness.verdict``), and name the gateways to probe now
        (verdict ``check`` or ``out``, none already being probed; each marked as being)."""
        gone: list[str] = []
        probe: list[tuple[str, str]] = []
        unvouched = 0
        limit = DRAIN_AFTER_HEARTBEATS * self.heartbeat_s
        for held in (self.workers, self.parked):
            for wid, w in held.items():
                v = self._verdict(w, now)
                if v is Verdict.gone:
                    gone.append(wid)
                    continue
                if now - w.beat > limit:
                    unvouched += 1
                if (
                    v in (Verdict.check, Verdict.out)
                    and not w.gateway.probing
                    and w.state.gateway_url
                ):
                    w.gateway.probing = True
                    probe.append((wid, w.state.gateway_url))
        for wid in gone:
            self.forget(wid)
        self._expire(now)
        return Drained(gone, probe, unvouched)

    # ---- deciding -------------------------------------------------------------------------
    def _verdict(self, w: _IndexedWorker, now: float) -> Verdict:
        return verdict(w.beat, now, self.heartbeat_s, self.feed, w.gateway)

    def _live(self, w: _IndexedWorker, now: float) -> bool:
        """Routed: ``live`` or ``check`` (the quick case first: a fresh heartbeat and no
        failed gateway)."""
        if (
            w.gateway.failed_at is None
            and now - w.beat <= DRAIN_AFTER_HEARTBEATS * self.heartbeat_s
        ):
            return True
        return self._verdict(w, now) in (Verdict.live, Verdict.check)

    def worker_count(self, base_model: str) -> int:
        """Workers of ``base_model`` in the view (parked and forgotten ones are not)."""
        return len(self._by_base.get(base_model, ()))

    def serves_elsewhere(self, record: AdapterRecord, now: float, skip: Collection[str]) -> bool:
        """Whether a live worker not in ``skip`` fits ``record`` (its base model, its rank):
        one a request for it may be sent to once the chosen worker refuses the version as
        its own. Chooses nothing (no turn, no placement)."""
        base, rank, workers = record.base_model, record.rank, self.workers
        return any(
            wid not in skip and self._fits(workers[wid], base, rank, now)
            for wid in self._by_base.get(base, ())
        )

    def route(
        self,
        record: AdapterRecord,
        now: float,
        in_flight: Mapping[str, int],
        skip: Collection[str] = (),
        avoid: Collection[str] = (),
    ) -> Route | None:
        """Where ``record`` is served now; None when no live worker of its base model can
        hold its rank. ``skip``: workers that refused this request's version as their own
        (``frontdoor.forwarded.refused_by_worker``), never chosen for it again. ``avoid``:
        workers that refused the version as their own moments ago (the router's memory of
        refusals): chosen only when no other worker fits, so the request still gets the
        worker's real answer when nothing else serves it."""
        if self._placed:
            self._expire(now)
        if avoid:
            route = self._route(record, now, in_flight, {*skip, *avoid})
            if route is not None:
                return route
        return self._route(record, now, in_flight, skip)

    def _route(
        self,
        record: AdapterRecord,
        now: float,
        in_flight: Mapping[str, int],
        skip: Collection[str],
    ) -> Route | None:
        """``route`` among the workers not in ``skip``; a choice is recorded (its turn, and
        the version placed there when it has no copy yet), a None changes nothing."""
        name, base, rank = record.lora_name, record.base_model, record.rank
        workers = self.workers

        def fits(wid: str) -> bool:
            return wid not in skip and self._fits(workers[wid], base, rank, now)

        picked = pick_worker(
            self._gpu.get(name, ()),
            self._host.get(name, ()),
            self._free_candidates(base),
            self._by_base.get(base, ()),
            fits=fits,
            may_load=lambda wid: self._may_load(workers[wid]),
            busy=lambda wid: in_flight.get(wid, 0),
            turn=lambda wid: self._turns.get(wid, 0),
        )
        if picked is None:
            return None
        wid, kind = picked
        if kind is not RouteKind.gpu:
            placed = self._placed.get(name)
            if placed is not None and fits(placed[0]):
                wid, kind = placed[0], RouteKind.placed
            elif kind in (RouteKind.free_slot, RouteKind.cold_budget):
                self._place(name, wid, now)
        self._routes += 1
        self._turns[wid] = self._routes
        return Route(wid, workers[wid].state.gateway_url, kind)

    def _fits(self, w: _IndexedWorker, base: str, rank: int, now: float) -> bool:
        return (
            w.state.base_model == base
            and w.state.max_lora_rank >= rank
            and bool(w.state.gateway_url)
            and self._live(w, now)
        )

    def _free_candidates(self, base: str) -> Iterator[str]:
        """The cached free-slot order of ``base``, built on first use after a change."""
        order = self._free_order.get(base)
        if order is None:
            order = self._free_order[base] = [
                (-self._free_slots(wid), wid)
                for wid in free_slot_order(self._by_base.get(base, ()), self._free_slots)
            ]
        for _, wid in order:
            yield wid

    def _free_slots(self, wid: str) -> int:
        """Free GPU slots in the worker's heartbeat, less this router's placements there."""
        return self.workers[wid].free_slots - len(self._placed_on.get(wid, ()))

    def _may_load(self, w: _IndexedWorker) -> bool:
        hbm = w.state.hbm_usage
        loads = w.state.cold_loads_last_minute + len(self._placed_on.get(w.state.worker_id, ()))
        return loads < w.state.load_budget(self.policy.cold_loads_per_minute_per_worker) and (
            hbm is None or hbm <= self.policy.hbm_low_watermark
        )
