"""The fleet router (``loraplane router run``): one OpenAI-compatible endpoint for every worker.

A runtime of its own beside the worker agents, stateless apart from what it reads: the
worker-state topic (into ``router.routing.FleetIndex``) and the registry topic, believed
only through its own verification (``loraplane.registry.live.VerifiedRegistry``). Several
routers run side by side behind any L4 balancer and decide alike.

Per request: the front door's one admission (``frontdoor.admission``, the gateway's too:
tenant, fields and caps, ownership, the version decided once, tenant limits), the queues
(``router.flow_control``), then the worker (``FleetIndex.route``). The request goes to that
worker's gateway with the tenant and version signed (``frontdoor.forwarded``) instead of the
API key, and the gateway's answer comes back as it is, plus ``X-Loraplane-Worker`` and
``X-Loraplane-Route``; the gateway writes the request's one RequestLog. Which workers are in
the view is ``router.liveness``. docs/router.md gives every refusal, the parking of a
gateway that fails, and the rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import math
import secrets
import signal
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from loraplane.eventlog.sink import EventSink
from loraplane.frontdoor.admission import FrontDoor, Keys, Refusal
from loraplane.frontdoor.forwarded import (
    HOLD_HEADER,
    NOT_RUN_HEADER,
    PERMANENT_STATUS,
    SESSION_HEADER,
    TENANT_HEADER,
    UNSIGNED_STATUS,
    VERSION_HEADER,
    Forward,
    Target,
    refusal_hold,
    refusal_type,
    refused_by_worker,
)
from loraplane.frontdoor.forwarded import headers as forward_headers
from loraplane.frontdoor.gateway_proof import CHALLENGE_PARAM, PROOF_FIELD, proven
from loraplane.frontdoor.http import (
    admit_request,
    error_answer,
    error_response,
    head_check,
    head_of,
    refusal_response,
)
from loraplane.frontdoor.request_fields import (
    Endpoint,
    header_token,
)
from loraplane.frontdoor.upstream_http import (
    AnswerBudget,
    AnswersFull,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from loraplane.kernel import metric_names as m
from loraplane.kernel.bus import Record, moved_away
from loraplane.kernel.config import Settings
from loraplane.kernel.heartbeat import DRAIN_AFTER_HEARTBEATS
from loraplane.kernel.http_server import ERROR_ANSWER, HEAD_CHECK, expect_continue, metrics_app
from loraplane.kernel.log_burst import LogBurst
from loraplane.kernel.policy import RequestBudgets
from loraplane.kernel.tasks import cancel_all
from loraplane.kernel.thread_calls import ThreadCalls
from loraplane.kernel.worker_states import Placed, at_home, worker_state_of
from loraplane.registry.live import CHECKPOINTS_FILE, VerifiedRegistry
from loraplane.router.flow_control import FlowControl, Step, Ticket, TicketState, band_of
from loraplane.router.liveness import Feed, probe_ok
from loraplane.router.routing import FleetIndex, Route
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.base import version_key
from loraplane.schemas.codec import SchemaError
from loraplane.schemas.dead_letter import dead_letter_at
from loraplane.schemas.keyring import KeyringFile
from loraplane.schemas.reasons import (
    AdmissionRefusal,
    QueueRefusal,
    RouterRefusal,
    ServingRefusal,
    VllmErrorCode,
)
from loraplane.schemas.request_log import RequestClass
from loraplane.schemas.router_state import QueueDepth, RouterState
from loraplane.schemas.strict_json import StrictJsonError, strict_loads
from loraplane.schemas.worker_state import WorkerState

__all__ = [
    "ANSWER_BUFFER_BYTES",
    "FIRST_READ_S",
    "MAX_REFUSALS",
    "MAX_UNPROVEN",
    "PROBE_ANSWER_BYTES",
    "PROBE_TIMEOUT_S",
    "PROOFS_IN_FLIGHT",
    "PROOF_RETRY_S",
    "REFUSAL_MEMORY_S",
    "REGISTRY_POLL_S",
    "ROUTE_HEADER",
    "WORKER_HEADER",
    "Fleet",
    "Refusals",
    "Router",
    "RouterMetrics",
    "RouterOptions",
    "attempt_id",
    "serve_router",
    "serving_versions",
]

log = logging.getLogger("loraplane.router")
REGISTRY_POLL_S = 0.2  # how often the verified registry is asked (in memory: a live tail)
FIRST_READ_S = 10.0  # how long a start waits for the whole registry before serving
WORKER_HEADER = "X-Loraplane-Worker"
ROUTE_HEADER = "X-Loraplane-Route"
_PASSED = ("content-type", "retry-after", "cache-control")  # besides x-loraplane-*
_OWN_HEADERS = frozenset(
    h.lower() for h in (WORKER_HEADER, ROUTE_HEADER, VERSION_HEADER, NOT_RUN_HEADER, HOLD_HEADER)
)
"""Set by the router on every answer it relays, or a gateway's word to the router alone (its
vLLM not run, its refusal's hold): a gateway's copy never passes to the client."""
_CLASSES = {c.value: c for c in RequestClass}
_DOOR_REASONS = frozenset(AdmissionRefusal)
_WORKER_OWN = ServingRefusal.adapter_refused_by_worker.value  # a worker's own 424's label
_ATTEMPTS = 2  # a request goes to a second worker at most once (then back to the first once)
_GONE_POLL_S = 0.1  # how often a queued request checks that its client is still there
PROBE_TIMEOUT_S = 2.0  # a gateway's /healthz probe (liveness) answers within this
PROBE_ANSWER_BYTES = 64 * 1024
"""A gateway's ``/healthz`` answer, at most: a probe reads it whole, and every gateway a
worker state announces may be probed at once."""
_WHY_CHARS = 200  # of a parked gateway's reason, in its log line
ANSWER_BUFFER_BYTES = 256 * 1024 * 1024
"""Bytes of gateways' answers read whole (not streamed) that the router holds at once, from
their first byte until they are written to their clients: each is at most 64 MiB, and a
new answer past this bound is a 503 ``answers_full`` + Retry-After (the gateway is not
parked: the answers of others fill it). A stream holds at most a 256 KiB window plus one
socket read, so streams in flight hold at most their number times that."""
MAX_UNPROVEN = 1024
"""Worker states held while their gateway's proof is asked, at most (the oldest dropped
first): a forger writing states under many ids fills this, never the routed view."""
_REFUSAL_LOG_EVERY_S = 30.0
PROOFS_IN_FLIGHT = 32
"""Gateway proofs asked at once, at most (each ends by ``PROBE_TIMEOUT_S``)."""
PROOF_RETRY_S = 5.0
"""A (worker, gateway) whose proof failed is asked again no sooner (a gateway still
starting, or a forged address asked once a heartbeat at most)."""
REFUSAL_MEMORY_S = 30.0
"""How long the router remembers a worker's own refusal of a version (a 424
``adapter_refused_by_worker``) whose gateway does not say how long its worker holds it
(``forwarded.HOLD_HEADER``): the worker's default refusal hold
(``WorkerConfig.refusal_hold_s``, 30 s), within which it answers every request for the
version with that 424 at once, without trying to load it again. A gateway's refusal of the
router's forward (its 401) is remembered as long, for every version."""
MAX_REFUSALS = 4096
"""(worker, version) refusals remembered at once, at most (the oldest forgotten first): a
gateway that refuses everything it is sent fills this, never more."""
_EVERY = ""  # a refusal of every version (no lora name is empty): the router's forward


def _by_band(item: tuple[tuple[Any, ...], Any]) -> tuple[str, int]:
    """Metric lines by base model, then band rank (keys start ``(base, band, ...)``)."""
    return item[0][0], item[0][1].rank


def serving_versions(records: list[AdapterRecord]) -> dict[str, list[AdapterRecord]]:
    """adapter_id -> its records, newest first (as ``Serving.versions`` gives them)."""
    out: dict[str, list[AdapterRecord]] = {}
    for r in records:
        out.setdefault(r.adapter_id, []).append(r)
    for versions in out.values():
        versions.sort(key=lambda r: version_key(r.version), reverse=True)
    return out


class Fleet:
    """The router's view: the fleet index, fed worker states, and the verified registry.

    A worker state is routed on only once the gateway at the address it announces has
    proved the router secret for that worker and address (``frontdoor.gateway_proof``);
    until then it is held (``MAX_UNPROVEN`` at most) and its proof asked by the runtime
    (``to_prove``, ``proved``). A proof holds for the worker while its address stays."""

    def __init__(
        self,
        index: FleetIndex,
        sink: EventSink,
        component: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.sink = sink
        self.component = component
        self.versions: dict[str, list[AdapterRecord]] = {}
        self.dead_lettered = 0
        self._clock = clock
        self.proven: dict[str, str] = {}  # worker id -> the gateway URL it proved
        # (worker id, URL) pairs that proved themselves to this router, most recent last:
        # asked first and evicted last when they come back (MAX_UNPROVEN at most)
        self._known: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._unproven: OrderedDict[str, tuple[WorkerState, float]] = OrderedDict()
        self._asking: set[tuple[str, str]] = set()
        self._failed: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.proofs_failed = 0
        self._refusals = LogBurst(
            "worker state not routed: its gateway did not prove the router secret",
            _REFUSAL_LOG_EVERY_S,
            logger=log,
        )

    def take(self, record: Record, placed: Placed | None = None) -> None:
        """One worker-state record, read at ``placed`` (its partition and the topic's
        partition count; None: not checked): indexed (arrived now) or held for its
        gateway's proof, or dead-lettered, a record off its key's partition too, tombstones
        included (``worker_states.at_home``), but for the tombstone a worker left on its
        previous partition after a grow (``bus.moved_away``: it removes nothing); never
        raises."""
        if moved_away(record):
            return
        try:
            if record.value is None:  # a tombstone: the worker is gone
                at_home(record.key, placed)
                wid = (record.key or b"").decode("utf-8", "replace")
                self.forget(wid)
                self.index.forget(wid)
                return
            state = worker_state_of(record.key, record.value, placed)
        except SchemaError as exc:
            self.dead_lettered += 1
            log.warning(
                "worker state at %s@%s dead-lettered: %s",
                record.partition,
                record.offset,
                str(exc)[:200],
            )
            letter = dead_letter_at(
                record.topic,
                record.partition,
                record.offset,
                record.key,
                record.value or b"",  # a misplaced tombstone's letter holds no bytes
                record.timestamp_ms / 1000,
                self.component,
                exc.reason,
                str(exc)[:2048],
            )
            self.sink.emit("dead-letters", (record.key or b"").decode("utf-8", "replace"), letter)
            return
        self.offer(state, self._clock())

    def offer(self, state: WorkerState, arrived: float) -> None:
        """A decoded worker state that arrived at epoch seconds ``arrived``: into the index
        when its gateway proved itself at that address, else held for the proof."""
        wid, url = state.worker_id, state.gateway_url
        if self.proven.get(wid) == url:
            self._unproven.pop(wid, None)
            self.index.update(state, arrived)
            return
        held = self._unproven.get(wid)
        if held is not None and held[0].gateway_url == url:
            # the same worker and address again (its next heartbeat): newer, in its place in
            # the queue, so a flood of fresh forged ids never pushes it back to the end
            self._unproven[wid] = (state, arrived)
            return
        self._unproven.pop(wid, None)
        if not url:  # no gateway to prove itself, none to route to
            return
        self._unproven[wid] = (state, arrived)
        if len(self._unproven) > MAX_UNPROVEN:
            self._evict_one()

    def _evict_one(self) -> None:
        """Drop the oldest held state whose proof is not being asked (one being asked is
        answered within the probe timeout) and whose (worker, address) never proved itself
        to this router; only when every held state is such a one, the oldest unasked."""
        fallback = None
        for wid, (state, _) in self._unproven.items():
            key = (wid, state.gateway_url)
            if key in self._asking:
                continue
            if key not in self._known:
                del self._unproven[wid]
                return
            fallback = fallback or wid
        if fallback is not None:
            del self._unproven[fallback]

    def forget(self, worker_id: str) -> None:
        """The worker is gone (a tombstone, drained, or its gateway failed a proof): its
        proof goes too, so a state naming that address again (an address handed to another
        host meanwhile) is asked anew."""
        self.proven.pop(worker_id, None)
        self._unproven.pop(worker_id, None)

    @property
    def unproven(self) -> int:
        """Worker states held for their gateway's proof now."""
        return len(self._unproven)

    def to_prove(self, now: float, room: int) -> list[tuple[str, str]]:
        """At most ``room`` (worker id, gateway URL) of held states whose proof to ask now:
        those that proved themselves to this router before (a worker tombstoned, drained or
        parked, then back) first, then the oldest; each is marked as being asked until
        ``proved``. Forged states under fresh ids, however many, queue behind known ones."""
        due: list[tuple[str, str]] = []
        for wid, (state, _) in self._unproven.items():
            key = (wid, state.gateway_url)
            failed = self._failed.get(key)
            if key in self._asking or (failed is not None and now - failed < PROOF_RETRY_S):
                continue
            due.append(key)
        due.sort(key=lambda k: k not in self._known)  # stable: oldest first within each
        asked = due[:room]
        self._asking.update(asked)
        return asked

    def proved(self, worker_id: str, url: str, ok: bool, now: float) -> None:
        """The gateway at ``url`` proved the router secret for ``worker_id``, or did not: the
        held state naming that address is routed on, or dropped."""
        key = (worker_id, url)
        self._asking.discard(key)
        held = self._unproven.get(worker_id)
        if not ok:
            self.proofs_failed += 1
            self._failed.pop(key, None)
            self._failed[key] = now
            while len(self._failed) > MAX_UNPROVEN:
                self._failed.popitem(last=False)
            if held is not None and held[0].gateway_url == url:
                del self._unproven[worker_id]
            self._refusals.note("not routed", f"worker {worker_id!r} at {url!r}")
            return
        self._failed.pop(key, None)
        indexed = self.index.workers.get(worker_id) or self.index.parked.get(worker_id)
        if held is not None and held[0].gateway_url == url:
            del self._unproven[worker_id]
            self.index.update(*held)
        elif indexed is None or indexed.state.gateway_url != url:
            return  # no state names that address any more (forgotten meanwhile)
        self.proven[worker_id] = url
        self._known.pop(key, None)
        self._known[key] = None
        while len(self._known) > MAX_UNPROVEN:
            self._known.popitem(last=False)


class Refusals:
    """The router's short memory of the workers that refused what it sent them: a version
    refused as the worker's own (a 424 ``adapter_refused_by_worker``, (worker id, lora
    name)), for as long as the worker says it holds that refusal (``note``'s ``ttl_s``,
    ``forwarded.refusal_hold``: bounded), or the router's forward itself (a gateway's 401,
    ``note_forwards``: the worker, for every version), for ``ttl_s``; ``cap`` at most, the
    oldest noted forgotten first. Routing chooses such a worker only when no other fits
    (``FleetIndex.route(avoid=)``). Time is passed in."""

    def __init__(self, ttl_s: float = REFUSAL_MEMORY_S, cap: int = MAX_REFUSALS) -> None:
        self.ttl_s = ttl_s
        self.cap = cap
        # (worker id, lora name or _EVERY) -> until; in the order noted (a refusal noted
        # again moves to the end), which is the order the cap forgets them in
        self._until: OrderedDict[tuple[str, str], float] = OrderedDict()
        # (until, key) of every note, soonest first; a note since replaced or dropped is
        # skipped when it comes up, and the heap is rebuilt when such notes outnumber the
        # entries, so it holds at most twice the cap
        self._expiry: list[tuple[float, tuple[str, str]]] = []
        self._by_name: dict[str, set[str]] = {}  # lora name -> worker ids
        self._by_worker: dict[str, set[str]] = {}  # worker id -> lora names

    def __len__(self) -> int:
        return len(self._until)

    def note(self, worker_id: str, lora_name: str, now: float, ttl_s: float | None = None) -> None:
        """``worker_id`` refused ``lora_name`` as its own at ``now``, and holds that
        refusal ``ttl_s`` (the worker's word, bounded by its reader; None: ``self.ttl_s``)."""
        key = (worker_id, lora_name)
        until = now + (self.ttl_s if ttl_s is None else ttl_s)
        self._until.pop(key, None)
        self._until[key] = until
        heapq.heappush(self._expiry, (until, key))
        self._by_name.setdefault(lora_name, set()).add(worker_id)
        self._by_worker.setdefault(worker_id, set()).add(lora_name)
        while len(self._until) > self.cap:
            self._drop(next(iter(self._until)))
        if len(self._expiry) > 2 * len(self._until) + 16:
            self._expiry = [(u, k) for k, u in self._until.items()]
            heapq.heapify(self._expiry)

    def note_forwards(self, worker_id: str, now: float) -> None:
        """``worker_id``'s gateway refused the router's forward at ``now`` (its 401: a
        router secret or forward form it does not share): avoided for every version."""
        self.note(worker_id, _EVERY, now)

    def of(self, lora_name: str, now: float) -> frozenset[str]:
        """The workers whose refusal of ``lora_name``, or of the router's forwards, they
        still hold at ``now``."""
        self._expire(now)
        return frozenset((*self._by_name.get(lora_name, ()), *self._by_name.get(_EVERY, ())))

    def forget(self, worker_id: str) -> None:
        """The worker left the view: its refusals go with it."""
        for name in list(self._by_worker.get(worker_id, ())):
            self._drop((worker_id, name))

    def keep_only(self, worker_ids: Collection[str]) -> None:
        """Forget the refusals of every worker not in ``worker_ids`` (the view)."""
        for wid in [w for w in self._by_worker if w not in worker_ids]:
            self.forget(wid)

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            until, key = heapq.heappop(expiry)
            if self._until.get(key) == until:
                self._drop(key)

    def _drop(self, key: tuple[str, str]) -> None:
        del self._until[key]
        wid, name = key
        for index, k, v in ((self._by_name, name, wid), (self._by_worker, wid, name)):
            held = index[k]
            held.discard(v)
            if not held:
                del index[k]


@dataclass
class _Pools:
    """One keep-alive pool per worker gateway URL; an answer read whole is at most
    ``max_answer_bytes``, and all of them at once at most ``budget``."""

    read_timeout_s: float
    pools: dict[str, UpstreamPool]
    max_answer_bytes: int = 64 * 1024 * 1024
    budget: AnswerBudget | None = None

    def get(self, url: str) -> UpstreamPool:
        pool = self.pools.get(url)
        if pool is None:
            parts = urlsplit(url)
            pool = self.pools[url] = UpstreamPool(
                parts.hostname or "127.0.0.1",
                parts.port or 80,
                connect_timeout_s=2.0,
                read_timeout_s=self.read_timeout_s,
                limit=256,
                max_answer_bytes=self.max_answer_bytes,
                budget=self.budget,
            )
        return pool

    def keep_only(self, urls: set[str]) -> None:
        """Close the pools of every other URL: a gateway no worker of the view names any
        more (forgotten, or announced elsewhere) keeps no connection open."""
        for url in [u for u in self.pools if u not in urls]:
            self.pools.pop(url).close()


@dataclass(frozen=True)
class _Whole:
    """A gateway's answer read whole: its status, headers (lower-case names) and body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


class Router:
    def __init__(
        self,
        fleet: Fleet,
        *,
        api_keys: Keys,
        budgets: RequestBudgets,
        secret: bytes,
        max_body_bytes: int = 1024 * 1024,
        read_timeout_s: float = 300.0,
        retry_after_s: int = 5,
        clock: Callable[[], float] = time.time,
        answer_buffer_bytes: int = ANSWER_BUFFER_BYTES,
        refusal_memory_s: float = REFUSAL_MEMORY_S,
    ) -> None:
        self.fleet = fleet
        # the one front door (frontdoor.admission), with the router's verified versions
        self.door = FrontDoor(
            keys=api_keys,
            budgets=budgets,
            versions=lambda model: self.fleet.versions.get(model, ()),
            clock=time.monotonic,
        )
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s
        self._secret = secret
        self._clock = clock
        self._monotonic = time.monotonic
        queues = budgets.queues
        batch_ttl_s = budgets.batch.max_wait_ms / 1000
        self.flow = FlowControl(
            max_queued_per_band=queues.max_queued_per_band,
            max_queued_per_tenant=queues.max_queued_per_tenant,
            ttl_s={
                RequestClass.interactive: queues.interactive_ttl_ms / 1000,
                RequestClass.canary: batch_ttl_s,
                RequestClass.batch: batch_ttl_s,
                RequestClass.shadow: batch_ttl_s,
            },
        )
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}
        self.answer_budget = AnswerBudget(answer_buffer_bytes)
        self._pools = _Pools(read_timeout_s, {}, budget=self.answer_budget)
        # apart: never queued behind requests; a /healthz answer is well under 1 KiB
        self._probes = _Pools(PROBE_TIMEOUT_S, {}, PROBE_ANSWER_BYTES)
        self.in_flight: dict[str, int] = {}
        # the versions workers refused as their own moments ago, and the workers whose
        # gateway refused the router's forward: routed elsewhere first
        self.refusals = Refusals(refusal_memory_s)
        self._unsigned_log = LogBurst(
            "gateway refused the router's forward", _REFUSAL_LOG_EVERY_S, logger=log
        )
        self.outcomes: Counter[str] = Counter()  # refusal codes and route kinds, bounded sets
        # gateways' refusals the router met (routed around, or a 424 the answer): its 401 by the
        # front door's reason (or "other"), a worker's own 424; a bounded set of labels
        self.gateway_refusals: Counter[str] = Counter()
        self._id_prefix = "rt-" + uuid.uuid4().hex[:12]
        self._id_seq = itertools.count()
        # each forward's nonce (a gateway takes a signature once): a random prefix per
        # router and a counter, so no two forwards of any routers share one
        self._nonce_prefix = secrets.token_hex(8)
        self._nonce_seq = itertools.count()
        self.collectors = CollectorRegistry(auto_describe=True)  # + the event sink's, when run
        self.collectors.register(RouterMetrics(self))

    @property
    def budgets(self) -> RequestBudgets:
        return self.door.budgets

    @budgets.setter
    def budgets(self, budgets: RequestBudgets) -> None:
        self.door.budgets = budgets

    @property
    def api_keys(self) -> Keys:
        return self.door.keys

    @api_keys.setter
    def api_keys(self, keys: Keys) -> None:
        self.door.keys = keys

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.add_routes(
            [
                web.post("/v1/completions", self.completions, expect_handler=expect_continue),
                web.post(
                    "/v1/chat/completions", self.chat_completions, expect_handler=expect_continue
                ),
                web.get("/v1/models", self.models),
                web.get("/healthz", self.healthz),
            ]
        )
        door_check = head_check(self.door, self.max_body_bytes, self._count_refusal)

        def check(request: web.Request) -> web.StreamResponse | None:
            if request.headers.get(TENANT_HEADER) is not None and request.method == "POST":
                return self._forward_refused()
            return door_check(request)

        # refusals on the head (no key, a body declared over the cap) before any body is read
        app[HEAD_CHECK] = check
        # every other answer of its server (no such route, an unreadable body) in the door's
        # shape, and counted
        app[ERROR_ANSWER] = error_answer(self._count_outcome)
        return app

    def _count_refusal(self, refusal: Refusal) -> None:
        self.outcomes[refusal.reason] += 1

    def _count_outcome(self, reason: str) -> None:
        self.outcomes[reason] += 1

    def _forward_refused(self) -> web.Response:
        """Only gateways take forwards: a router never believes a forwarded tenant."""
        return self._refuse(
            401, AdmissionRefusal.unauthorized, "a router takes no forwarded requests"
        )

    async def healthz(self, _: web.Request) -> web.Response:
        index = self.fleet.index
        return web.json_response(
            {
                "ok": True,
                "workers": len(index.workers),
                "parked": len(index.parked),
                "gpu_copies": sum(len(w.gpu) for w in index.workers.values()),
                "adapters": len(self.fleet.versions),
            }
        )

    def metrics_app(self) -> web.Application:
        """``/metrics`` alone, for the ``--metrics-port`` listener: the API port (the
        tenants' front door) answers it 404, so outcome counts and queue depths never reach
        a tenant (its ``/healthz`` still counts the workers, GPU copies and adapters)."""
        return metrics_app(self.metrics)

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.collectors), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    def state(self, router_id: str, now: float) -> RouterState:
        """This router's heartbeat (``router-state``): what ops see of its queues."""
        flow = self.flow
        return RouterState(
            router_id=router_id,
            ts=datetime.fromtimestamp(now, UTC),
            in_flight={b: n for b, n in flow.in_flight.items() if n > 0},
            queues=[
                QueueDepth(base_model=b, band=band.label, queued=n)
                for (b, band), n in sorted(flow.depth.items(), key=_by_band)
                if n > 0
            ],
        )

    async def models(self, request: web.Request) -> web.Response:
        """The adapters the tenant may use (``id`` is the adapter id, never a lora name)."""
        if request.headers.get(TENANT_HEADER) is not None:
            return self._forward_refused()
        identity = self.door.identify(head_of(request, ""))  # the front door's own reading
        if isinstance(identity, Refusal):
            return refusal_response(identity)
        tenant = identity.tenant_id
        data = [
            {"id": aid, "object": "model", "created": 0, "owned_by": tenant}
            for aid, versions in sorted(self.fleet.versions.items())
            if self.door.listed(identity, versions)
        ]
        return web.json_response({"object": "list", "data": data})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, Endpoint.completions)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, Endpoint.chat_completions)

    def _refuse(
        self,
        status: int,
        code: AdmissionRefusal | QueueRefusal | RouterRefusal,
        message: str,
        param: str | None = None,
        **headers: str,
    ) -> web.Response:
        self.outcomes[code] += 1
        return error_response(status, code, message, param, **headers)

    async def _handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        request_id = (
            header_token(request.headers.get("X-Request-Id"))
            or f"{self._id_prefix}-{next(self._id_seq):x}"
        )
        if request.headers.get(TENANT_HEADER) is not None:
            return self._forward_refused()
        admission, raw = await admit_request(
            self.door, request, endpoint, request_id, self.max_body_bytes
        )
        if isinstance(admission, Refusal):
            self._count_refusal(admission)
            return refusal_response(admission)
        choice, tenant = admission.choice, admission.tenant_id
        ticket: Ticket | None = None
        try:
            admitted = await self._admit(request, choice.record, tenant, admission.request_class)
            if isinstance(admitted, web.StreamResponse):
                return admitted
            ticket = admitted
            forward = Forward(
                tenant,
                admission.request_class.value,
                choice.record.version,
                choice.reason.value,
                choice.stable.version if choice.stable is not None else "",
                header_token(request.headers.get(SESSION_HEADER)),
            )

            def head(target: Target, attempt_id: str, worker_id: str, reroute: bool) -> bytes:
                # signed after the wait: the signature's time is when the gateway gets it
                return forward_headers(
                    self._secret,
                    replace(forward, reroute=True) if reroute else forward,
                    target,
                    attempt_id,
                    raw,
                    self._clock(),
                    worker_id=worker_id,
                    nonce=f"{self._nonce_prefix}{next(self._nonce_seq):x}",
                )

            falls_back = admission.request_class is RequestClass.interactive
            return await self._forward(
                request, endpoint, raw, choice.record, request_id, head, falls_back=falls_back
            )
        finally:
            if ticket is not None and ticket.state is TicketState.admitted:
                self._wake(self.flow.release(ticket, self._limit(ticket.base), self._monotonic()))
            self.door.leave(admission, 0)  # tokens are the gateway's to charge (its usage)

    # ---- flow control (router/flow_control.py) -----------------------------------------------
    def _limit(self, base: str) -> int:
        """A base model's requests in flight through this router: a per-worker share times
        the workers of the base model in the view (drained ones leave it)."""
        return self.budgets.queues.max_in_flight_per_worker * self.fleet.index.worker_count(base)

    def _wake(self, step: Step) -> None:
        for ticket in (*step.admitted, *step.expired):
            waiter = self._waiters.pop(ticket, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def _admit(
        self, request: web.Request, record: AdapterRecord, tenant: str, request_class: RequestClass
    ) -> Ticket | web.StreamResponse | None:
        """An admitted ticket (at once when nothing queues), a refusal, or None when the base
        model has no worker in the view (forwarding answers that 503)."""
        base = record.base_model
        limit = self._limit(base)
        if not limit:
            return None
        band = band_of(request_class, record.priority)
        now = self._monotonic()
        got = self.flow.offer(base, band, tenant, limit, now)
        if isinstance(got, QueueRefusal):
            return self._queue_refusal(got, request_class)
        if got.state is TicketState.queued:
            self._wake(self.flow.pump(base, limit, now))
        if got.state is TicketState.queued:
            waiter = self._waiters[got] = asyncio.get_running_loop().create_future()
            try:
                while not waiter.done():
                    left = got.deadline - self._monotonic()
                    if left <= 0:
                        self.flow.withdraw(got, self._monotonic())
                        break
                    await asyncio.wait((waiter,), timeout=min(left, _GONE_POLL_S))
                    transport = request.transport
                    if not waiter.done() and (transport is None or transport.is_closing()):
                        self.flow.withdraw(got, self._monotonic())  # the client left
                        break
            finally:
                self._waiters.pop(got, None)
                if got.state is TicketState.queued:  # cancelled while it waited
                    self.flow.withdraw(got, self._monotonic())
        if got.state is TicketState.admitted:
            return got
        if got.state is TicketState.expired:
            return self._queue_refusal(QueueRefusal.queue_timeout, request_class)
        return self._refuse(499, RouterRefusal.client_gone, "the client left while queued")

    def _queue_refusal(self, reason: QueueRefusal, request_class: RequestClass) -> web.Response:
        retry_after = {
            RequestClass.interactive: self.budgets.interactive.retry_after_s,
            RequestClass.canary: self.budgets.canary.retry_after_s,
        }.get(request_class, self.budgets.batch.retry_after_s)
        status = 503 if reason is QueueRefusal.queue_timeout else 429
        return self._refuse(
            status,
            reason,
            f"the {request_class.value} queue of this base "
            f"model is {'busy' if status == 503 else 'full'} ({reason}); "
            "retry later",
            **{"Retry-After": str(retry_after)},
        )

    async def _forward(
        self,
        request: web.Request,
        endpoint: Endpoint,
        raw: bytes,
        record: AdapterRecord,
        request_id: str,
        head: Callable[[Target, str, str, bool], bytes],
        *,
        falls_back: bool = False,
    ) -> web.StreamResponse:
        """Forward to the worker the index names; one that did not answer leaves the view
        and the request goes to the next. A second attempt carries its own request id
        (``attempt_id``): the first worker may have run it and logged it before it died,
        and the answer the client gets must name exactly one request_log row.

        A 424 that is the worker's own refusal to load the version
        (``forwarded.refused_by_worker``: its vLLM, its limits) sends the request to another
        worker of the base model, within the same attempts, the refusing worker staying in
        the view (it serves other versions); that 424 is the answer only when no other
        worker serves it. Nothing of it has reached the client then: an answer relayed,
        streamed or whole, is never sent again. The refusal is remembered
        (``Refusals``): the version's later requests go to another worker first while the
        refusing worker's hold lasts, and to it only when no other fits.

        ``falls_back``: the request's gateway answers a cold version it cannot load with the
        base model's fallback (an interactive one). A first attempt with another worker left
        is signed ``REROUTE_HEADER``, so its worker's own refusal comes back as its 424;
        when no other worker serves the request then (none fits any more, it does not
        answer, it refuses the forward), the refusing worker is asked once more without the
        header, as the last worker tried, and its fallback is the answer, never that 424.

        A gateway's 401 (``forwarded.UNSIGNED_STATUS``) refuses the router's own forward
        (its signature: a secret rotated, a form of another version, a replay), never the
        tenant, whose key passed here: it is logged and the request goes to another worker
        within the same attempts; when none takes it the answer is the router's own 502
        ``forward_refused``, never the gateway's 401. The worker is remembered
        (``Refusals.note_forwards``): later requests, of any version, go to another worker
        first, and to it only when no other fits."""
        target = Target("POST", endpoint.value)  # what is sent is what is signed
        refused: tuple[_Whole, Route] | None = None  # a worker's own 424, held
        withheld: Route | None = None  # the worker whose 424 stood for its fallback (reroute)
        skip: list[str] = []  # workers that refused this request: its version, or the forward
        unsigned = False  # a gateway refused the router's forward
        avoid = self.refusals.of(record.lora_name, self._clock())
        attempt = -1
        while True:
            attempt += 1
            route = (
                self.fleet.index.route(
                    record, self._clock(), self.in_flight, skip=skip, avoid=avoid
                )
                if attempt < _ATTEMPTS
                else None
            )
            if route is None and withheld is not None:  # its fallback, as the last worker
                route, withheld = withheld, None
                reroute = False
            elif route is None:
                if refused is not None:  # no other worker: the worker's own 424 is the answer
                    return await self._relay_refused(request, *refused, record.version)
                if unsigned:
                    return self._not_taken()
                return self._refuse(
                    503,
                    RouterRefusal.no_live_worker,
                    f"no live worker serves base model {record.base_model}"
                    if attempt < _ATTEMPTS
                    else "the chosen workers did not answer",
                    **{"Retry-After": str(self.retry_after_s)},
                )
            else:
                reroute = (
                    falls_back
                    and attempt < _ATTEMPTS - 1
                    and self.fleet.index.serves_elsewhere(
                        record, self._clock(), {*skip, *avoid, route.worker_id}
                    )
                )
            wid = route.worker_id
            self.in_flight[wid] = self.in_flight.get(wid, 0) + 1
            try:
                try:
                    resp = await self._pools.get(route.gateway_url).request(
                        target.method,
                        target.path,
                        raw,
                        total_timeout_s=self._pools.read_timeout_s,
                        # signed for each send: the pool's resend on a fresh connection
                        # (the gateway may have taken the first) is a forward of its own
                        headers=functools.partial(
                            head, target, attempt_id(request_id, attempt), wid, reroute
                        ),
                    )
                except UpstreamError as exc:
                    self._drop(route, exc)
                    continue
                if resp.status == 503 and (why := resp.headers.get(NOT_RUN_HEADER.lower())):
                    # the gateway is up but its vLLM is not: nothing ran, another may serve it
                    resp.close()
                    self._drop(route, why, "has no vLLM answering")
                    continue
                if not _gateway_status(resp.status):
                    resp.close()
                    self._drop(
                        route,
                        UpstreamError(
                            VllmErrorCode.bad_response,
                            f"status {resp.status} is no answer of a gateway",
                        ),
                    )
                    continue
                if resp.status in (PERMANENT_STATUS, UNSIGNED_STATUS):
                    try:
                        whole = await self._read_whole(resp, route)
                        if isinstance(whole, web.Response):  # the router's own refusal
                            return whole
                        content_type = whole.headers.get("content-type", "")
                        if whole.status == UNSIGNED_STATUS:  # the router's forward refused
                            self._unsigned(route, refusal_type(content_type, whole.body))
                            skip.append(wid)
                            self.refusals.note_forwards(wid, self._clock())
                            unsigned = True
                            continue
                        if refused_by_worker(whole.status, content_type, whole.body):
                            refused = (whole, route)  # held (small): another may load it
                            withheld = route if reroute else None
                            skip.append(wid)
                            hold = refusal_hold(whole.headers.get(HOLD_HEADER.lower()))
                            self.gateway_refusals[_WORKER_OWN] += 1
                            self.refusals.note(wid, record.lora_name, self._clock(), hold)
                            continue
                        self.outcomes[route.kind.value] += 1
                        return await self._relay_whole(request, whole, route, record.version)
                    finally:
                        resp.close()
                self.outcomes[route.kind.value] += 1
                try:
                    return await self._relay(request, resp, route, record.version)
                finally:
                    resp.close()
            finally:
                left = self.in_flight.get(wid, 1) - 1
                if left > 0:
                    self.in_flight[wid] = left
                else:
                    self.in_flight.pop(wid, None)

    def _unsigned(self, route: Route, reason: str | None) -> None:
        """A gateway refused the router's forward (its 401): logged, at most one line per
        ``_REFUSAL_LOG_EVERY_S`` and reason, the reason one of the front door's or
        ``other`` (a gateway's body is anyone's bytes: no reason of its own is kept)."""
        kind = reason if reason in _DOOR_REASONS else "other"
        self.gateway_refusals[kind] += 1
        self._unsigned_log.note(kind, f"worker {route.worker_id} gateway {route.gateway_url}")

    def _not_taken(self) -> web.Response:
        """No gateway took the router's forward: the router's own answer, never theirs."""
        return self._refuse(
            502,
            RouterRefusal.forward_refused,
            "the workers refused this router's forward (a router secret or forward format "
            "they do not share); retry later",
            **{"Retry-After": str(self.retry_after_s)},
        )

    async def _relay_refused(
        self, request: web.Request, whole: _Whole, route: Route, version: str
    ) -> web.StreamResponse:
        """A worker's own 424, held while another worker was tried, as the answer."""
        self.outcomes[route.kind.value] += 1
        return await self._relay_whole(request, whole, route, version)

    @staticmethod
    def _passed_headers(gateway: Mapping[str, str], route: Route, version: str) -> dict[str, str]:
        """The gateway's headers (lower-case names) a client gets, and the router's own."""
        headers = {
            k: v
            for k, v in gateway.items()
            if (k in _PASSED or k.startswith("x-loraplane-") or k == "x-request-id")
            and k not in _OWN_HEADERS
        }
        headers[WORKER_HEADER] = route.worker_id
        headers[ROUTE_HEADER] = route.kind.value
        headers[VERSION_HEADER] = version  # decided here; the gateway serves exactly it
        return headers

    async def _read_whole(self, resp: UpstreamResponse, route: Route) -> _Whole | web.Response:
        """A gateway's answer read whole (within the answer budget), or the router's own
        refusal when it cannot be (the budget full, the worker gone mid-answer: parked)."""
        try:
            return _Whole(resp.status, resp.headers, await resp.read())
        except AnswersFull as exc:
            log.warning("answer of worker %s not held: %s", route.worker_id, exc)
            return self._refuse(
                503,
                RouterRefusal.answers_full,
                "the router holds as many answers as it may; try again",
                **{"Retry-After": str(self.retry_after_s)},
            )
        except UpstreamError as exc:
            # The worker died after its head (killed mid-answer): the client gets a
            # retryable answer, not a 500. Not sent again here: the worker may have
            # run it already, which only the client can judge.
            self._drop(route, exc, "closed mid-answer")
            return self._refuse(
                503,
                RouterRefusal.worker_lost,
                f"worker {route.worker_id} closed mid-answer; try again",
                **{"Retry-After": str(self.retry_after_s)},
            )

    async def _relay_whole(
        self, request: web.Request, whole: _Whole, route: Route, version: str
    ) -> web.StreamResponse:
        """Write a gateway's answer read whole to the client."""
        headers = self._passed_headers(whole.headers, route, version)
        out = web.Response(body=whole.body, status=whole.status, headers=headers)
        with contextlib.suppress(ConnectionError):
            await out.prepare(request)
            await out.write_eof()
        return out

    async def _relay(
        self, request: web.Request, resp: UpstreamResponse, route: Route, version: str
    ) -> web.StreamResponse:
        if not resp.headers.get("content-type", "").startswith("text/event-stream"):
            # written before the answer is closed, which frees its place in the budget
            whole = await self._read_whole(resp, route)
            if isinstance(whole, web.Response):
                return whole
            return await self._relay_whole(request, whole, route, version)
        headers = self._passed_headers(resp.headers, route, version)
        out = web.StreamResponse(status=resp.status, headers=headers)
        await out.prepare(request)
        try:
            async for chunk in resp.iter_chunks():
                await out.write(chunk)
        except UpstreamError as exc:
            # the status is sent: end the connection without the stream's end, so the client
            # sees a cut stream, never a short one that looks whole
            self._drop(route, exc, "closed mid-stream")
            if request.transport is not None:
                request.transport.abort()
            return out
        await out.write_eof()
        return out

    def _drop(self, route: Route, why: object, when: str = "did not answer") -> None:
        """A gateway that failed a request, or answered that its vLLM is not there, leaves the
        view until its next heartbeat or its next good probe. ``why`` is logged cut to
        ``_WHY_CHARS``: it may be a gateway's own header, anyone's bytes."""
        log.warning(
            "worker %s gateway %s %s: %s; parked out of the view",
            route.worker_id,
            route.gateway_url,
            when,
            str(why)[:_WHY_CHARS],
        )
        self.fleet.index.failed(route.worker_id, self._clock())

    def forget_gateways(self) -> None:
        """Close the connections to gateways no worker in the view or parked names: forged
        worker states announcing a new address each time would otherwise leave a pool with
        its open connections per address, for ever."""
        index = self.fleet.index
        named = {
            w.state.gateway_url for held in (index.workers, index.parked) for w in held.values()
        }
        self._pools.keep_only(named)
        self._probes.keep_only(named)

    async def probe(self, worker_id: str, url: str, *, serving: bool = True) -> bool:
        """Whether the gateway at ``url`` answers ``/healthz`` as ``worker_id``
        (``liveness.probe_ok``, ``serving`` passed on) within ``PROBE_TIMEOUT_S``, with the
        proof of the router secret for a fresh challenge, that worker and that address
        (``frontdoor.gateway_proof``)."""
        challenge = secrets.token_hex(16)
        try:
            resp = await self._probes.get(url).request(
                "GET",
                f"/healthz?{CHALLENGE_PARAM}={challenge}",
                b"",
                total_timeout_s=PROBE_TIMEOUT_S,
            )
            try:
                # the project's bounded reader: a gateway's address is whatever a worker state
                # named, so its answer is anyone's (deep nesting, duplicate keys, NaN)
                body = strict_loads(await resp.read(), max_bytes=PROBE_ANSWER_BYTES)
            finally:
                resp.close()
        except (UpstreamError, StrictJsonError) as exc:
            log.warning("worker %s gateway %s probe failed: %s", worker_id, url, exc)
            return False
        return probe_ok(worker_id, resp.status, body, serving=serving) and proven(
            self._secret, challenge, worker_id, url, body.get(PROOF_FIELD)
        )


def _gateway_status(status: int) -> bool:
    """A status a gateway answers: 200, or a refusal or failure (4xx, 5xx). Another 2xx or a
    3xx (no body, a redirect, a cache's "not modified") is no answer to a completion: an
    address a forged worker state announces, not a gateway."""
    return status == 200 or 400 <= status <= 599


def attempt_id(request_id: str, attempt: int) -> str:
    """The request id of a forwarding attempt: the request's own for the first, with
    ``-rN`` for the N-th re-route (cut to stay within a request id's 128 characters)."""
    if not attempt:
        return request_id
    suffix = f"-r{attempt}"
    return request_id[: 128 - len(suffix)] + suffix


# ---- the process ----------------------------------------------------------------------------
async def _beat(
    router: Router,
    sink: EventSink,
    router_id: str,
    every_s: float,
    clock: Callable[[], float] = time.time,
) -> None:
    """Publish the router's state every heartbeat (``fleet status``, the fleet panel)."""
    while True:
        try:
            sink.emit("router-state", router_id, router.state(router_id, clock()))
        except Exception:  # a bug here must not stop routing
            log.exception("router state not published")
        await asyncio.sleep(every_s)


async def _refresh_registry(
    registry: VerifiedRegistry,
    fleet: Fleet,
    threads: ThreadCalls | None = None,
    poll_s: float = REGISTRY_POLL_S,
) -> None:
    """Take the verified registry (fed by the live tail: in memory, re-verified only on a
    change) into the fleet's versions. Its reads run in ``threads``: a read dead-letters the
    views it refuses through the sink, which is closed only after them."""
    threads = threads if threads is not None else ThreadCalls("registry reads")
    while True:
        try:
            records = await threads.run(registry.records)
            fleet.versions = serving_versions(records)
        except Exception as exc:  # a bug here keeps the last verified view
            log.warning("registry refresh failed, keeping the last view: %s", exc)
        await asyncio.sleep(poll_s)


async def _watch_fleet(
    router: Router,
    span: Callable[[], tuple[float, float] | None],
    heartbeat_s: float,
    poll_s: float = REGISTRY_POLL_S,
) -> None:
    """Keep the fleet index's view of its feed (``span``: the worker-state tail's
    ``current_span``) up to date, and every heartbeat drain it (``liveness``): forget the
    workers a current feed shows silent, probe the gateways it cannot vouch for."""
    index = router.fleet.index
    probes: set[asyncio.Task[None]] = set()

    async def probe(wid: str, url: str) -> None:
        try:
            ok = await router.probe(wid, url)
        except Exception:  # a bug: counted as a failed probe, and the next pass asks again
            log.exception("probe of worker %s failed", wid)
            ok = False
        was_parked = wid in index.parked
        index.probed(wid, url, ok, time.time())
        if ok:  # the probe asked a fresh proof too
            router.fleet.proved(wid, url, True, time.time())
        elif router.fleet.proven.get(wid) == url:
            router.fleet.forget(wid)  # its next state proves itself again before a request
        if was_parked and wid in index.workers:
            log.info("worker %s back in the view: its gateway answered a probe", wid)

    proofs: set[asyncio.Task[None]] = set()

    async def prove(wid: str, url: str) -> None:
        try:
            ok = await router.probe(wid, url, serving=False)
        except Exception:  # a bug: counted as a failed proof, asked again after a pause
            log.exception("proof of worker %s failed", wid)
            ok = False
        router.fleet.proved(wid, url, ok, time.time())
        if ok:
            log.info("worker %s: its gateway %s proved the router secret; routed", wid, url)

    last_drain = 0.0
    unvouched = 0  # workers kept on their gateways' probes at the last pass: logged on a change
    try:
        while True:
            try:
                for wid, url in router.fleet.to_prove(time.time(), PROOFS_IN_FLIGHT - len(proofs)):
                    task = asyncio.create_task(prove(wid, url))
                    proofs.add(task)
                    task.add_done_callback(proofs.discard)
                got = span()
                index.feed = None if got is None else Feed(*got)
                router.refusals.keep_only(index.workers)  # a worker out of the view: forgotten
                if time.monotonic() - last_drain >= heartbeat_s:
                    last_drain = time.monotonic()
                    now = time.time()
                    drained = index.drain(now)
                    router.forget_gateways()
                    for wid in drained.gone:
                        router.fleet.forget(wid)
                        log.info(
                            "worker %s drained: no heartbeat for %d intervals of a current "
                            "worker-state feed",
                            wid,
                            DRAIN_AFTER_HEARTBEATS,
                        )
                    for wid, url in drained.probe:
                        task = asyncio.create_task(probe(wid, url))
                        probes.add(task)
                        task.add_done_callback(probes.discard)
                    if drained.unvouched != unvouched:
                        if drained.unvouched:
                            log.warning(
                                "worker-state feed (last current %s) cannot vouch for "
                                "%d worker(s): routing on their gateways' probes",
                                "never" if got is None else f"{now - got[1]:.0f} s ago",
                                drained.unvouched,
                            )
                        else:
                            log.info("every worker heard again: heartbeats decide")
                        unvouched = drained.unvouched
            except Exception:  # a bug here must not stop routing
                log.exception("fleet watch pass failed")
            await asyncio.sleep(poll_s)
    finally:  # no proof or probe outlives the watch: none is asked once the router stops
        await cancel_all(proofs | probes)


@dataclass(frozen=True)
class RouterOptions:
    port: int
    router_id: str
    metrics_port: int = 0  # /metrics on listen_host:metrics_port (0: none)
    heartbeat_s: float = 5.0  # the workers' heartbeat interval: silent for 3 is drained
    base_models: tuple[str, ...] = ()  # the registry views it holds (empty: every one)


async def serve_router(
    settings: Settings, options: RouterOptions, ready: Callable[[int], None] | None = None
) -> None:
    from loraplane.eventlog.sink import KafkaEventSink, SinkMetrics, poll_forever
    from loraplane.frontdoor.api_keys import ApiKeysFile
    from loraplane.frontdoor.hmac_keys import hmac_key
    from loraplane.kernel.http_server import Listener, bound_port, start_sites
    from loraplane.kernel.progress_metrics import ProgressMetrics, TailMetrics
    from loraplane.kernel.topic_tail import TopicTail
    from loraplane.kernel.topics import topic_name
    from loraplane.registry.topic import RegistryScope, registry_tail

    component = f"router-{options.router_id}"
    sink = KafkaEventSink(settings, component)
    fleet = Fleet(FleetIndex(settings.policy, options.heartbeat_s), sink, component)
    loop = asyncio.get_running_loop()
    # Worker states: every record to the index, on the loop (the index is only touched there);
    # probed twice a heartbeat when idle, so its current span shows a broker away at once.
    states = TopicTail(
        settings,
        topic_name(settings, "worker-state"),
        component=f"{component}-worker-state",
        on_record=lambda r: loop.call_soon_threadsafe(fleet.take, r, states.placed(r)),
        probe_every_s=options.heartbeat_s / 2,
        keep=False,  # the fleet index holds what is routed
    )
    states.start()
    scope = RegistryScope(options.base_models or None)  # registry/topic.py
    tail = registry_tail(settings, component, scope, start=False)
    registry = VerifiedRegistry(
        KeyringFile(settings.keyring_path),
        tail.snapshot,
        sink=sink,
        component=component,
        checkpoints_path=settings.home / "router" / options.router_id / CHECKPOINTS_FILE,
        version=lambda: tail.version,
        scope=scope,
        source=tail,
    )
    tail.start()
    await asyncio.to_thread(tail.wait_caught_up, FIRST_READ_S)
    router = Router(
        fleet,
        api_keys=ApiKeysFile.open(settings.api_keys_path),
        budgets=settings.policy.request_budgets,
        secret=hmac_key(settings.router_secret_path, "router secret"),
        max_body_bytes=settings.http.max_body_bytes,
        retry_after_s=max(1, math.ceil(options.heartbeat_s)),
    )
    router.collectors.register(SinkMetrics(sink))
    router.collectors.register(TailMetrics([tail, states]))
    router.collectors.register(ProgressMetrics([tail.progress, states.progress]))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    registry_reads = ThreadCalls(f"router {options.router_id} registry reads")
    refresher = asyncio.create_task(_refresh_registry(registry, fleet, registry_reads))
    watcher = asyncio.create_task(_watch_fleet(router, states.current_span, options.heartbeat_s))
    poller = asyncio.create_task(poll_forever(sink))  # replays the spool after an outage
    beat = asyncio.create_task(_beat(router, sink, options.router_id, options.heartbeat_s))
    runners: list[web.AppRunner] = []
    try:  # a step that fails closes what the earlier ones opened
        listeners = [Listener(router.app(), options.port, "router", "--port")]
        if options.metrics_port:
            listeners.append(
                Listener(
                    router.metrics_app(), options.metrics_port, "router-metrics", "--metrics-port"
                )
            )
        runners = await start_sites(  # a port taken: one line, the ones started closed
            listeners, settings.listen_host, settings.http, process=f"router {options.router_id}"
        )
        port = bound_port(runners[0])
        log.info("router %s on %s:%d", options.router_id, settings.listen_host, port)
        if options.metrics_port:
            log.info(
                "router %s /metrics on %s:%d",
                options.router_id,
                settings.listen_host,
                bound_port(runners[1]),
            )
        if ready is not None:
            ready(port)
        await stop.wait()
    finally:  # in this order: docs/router.md, "Stopping"
        # the listeners first: requests in flight end with the fleet view, the registry
        # refresh and the sink's poller still running
        for each in runners:
            await each.cleanup()
        # awaited, not only cancelled: the watch's proofs and probes end with it
        await cancel_all({refresher, watcher, poller, beat})
        registry_reads.drain()  # a read's thread runs on, and emits to the sink closed below
        states.stop()
        # the takes its thread queued on the loop before it stopped (one dead-letters a bad
        # state through the sink) run now, not after the sink closed
        await asyncio.sleep(0)
        tail.stop()
        sink.close(5.0)


class RouterMetrics(Collector):
    """The router's own series (``kernel.metric_names``): outcomes, fleet size, dead
    letters and its flow-control queues, read from the router at each scrape."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        router, flow = self.router, self.router.flow
        requests = CounterMetricFamily(
            m.ROUTER_REQUESTS,
            "Requests by outcome (a refusal code or a route kind)",
            labels=["outcome"],
        )
        for outcome, n in sorted(router.outcomes.items()):
            requests.add_metric([outcome], n)
        yield requests
        yield GaugeMetricFamily(
            m.ROUTER_WORKERS,
            "Workers in the router's fleet index",
            value=len(router.fleet.index.workers),
        )
        yield GaugeMetricFamily(
            m.ROUTER_WORKERS_UNPROVEN,
            "Worker states held, not routed, until their gateway proves the router secret",
            value=router.fleet.unproven,
        )
        yield CounterMetricFamily(
            m.ROUTER_GATEWAY_PROOFS_FAILED,
            "Gateways asked to prove the router secret that did not",
            value=router.fleet.proofs_failed,
        )
        refusals = CounterMetricFamily(
            m.ROUTER_GATEWAY_REFUSALS,
            "Gateways' refusals the router met: of its forward (401, by reason) "
            "or a worker's own of a version (424)",
            labels=["reason"],
        )
        for reason, n in sorted(router.gateway_refusals.items()):
            refusals.add_metric([reason], n)
        yield refusals
        yield GaugeMetricFamily(
            m.ROUTER_ANSWER_BYTES_HELD,
            "Bytes of gateways' answers read whole that the router holds now "
            "(at most ANSWER_BUFFER_BYTES)",
            value=router.answer_budget.held,
        )
        yield CounterMetricFamily(
            m.ROUTER_DEAD_LETTERS,
            "Records the router could not read, sent to dead letters",
            value=router.fleet.dead_lettered,
        )
        in_flight = GaugeMetricFamily(
            m.ROUTER_IN_FLIGHT,
            "Requests forwarded and not done, per base model",
            labels=["base_model"],
        )
        for b, n in sorted(flow.in_flight.items()):
            in_flight.add_metric([b], n)
        yield in_flight
        banded = ["base_model", "band"]
        depth = GaugeMetricFamily(
            m.ROUTER_QUEUE_DEPTH, "Requests waiting in a queue", labels=banded
        )
        for (b, band), n in sorted(flow.depth.items(), key=_by_band):
            depth.add_metric([b, band.label], n)
        yield depth
        wait = HistogramMetricFamily(
            m.ROUTER_QUEUE_WAIT_SECONDS,
            "Seconds waited in a queue by the requests admitted from it",
            labels=banded,
        )
        for (b, band), w in sorted(flow.waits.items(), key=_by_band):
            buckets = [(floatToGoString(le), n) for le, n in w.cumulative()]
            wait.add_metric([b, band.label], [*buckets, ("+Inf", w.total)], w.sum_s)
        yield wait
        rejected = CounterMetricFamily(
            m.ROUTER_QUEUE_REJECTIONS,
            "Requests a queue refused, by reason",
            labels=[*banded, "reason"],
        )
        for (b, band, reason), n in sorted(
            flow.refused.items(), key=lambda kv: (*_by_band(kv), kv[0][2])
        ):
            rejected.add_metric([b, band.label, str(reason)], n)
        yield rejected
        withdrawn = CounterMetricFamily(
            m.ROUTER_QUEUE_WITHDRAWN,
            "Queued requests withdrawn (the client left, or the router gave up)",
            labels=banded,
        )
        for (b, band), n in sorted(flow.withdrawn.items(), key=_by_band):
            withdrawn.add_metric([b, band.label], n)
        yield withdrawn
