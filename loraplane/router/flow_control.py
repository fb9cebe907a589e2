"""Flow control in front of the fleet router's forwarding (router/server.py). Pure: no I/O,
time passed in; the router owns the asyncio waiting.

A request is admitted at once while its base model has fewer requests in flight (through
this router) than its limit and nothing of it is queued: the fast path. Otherwise it waits
in the queue of its (base model, band): bands (request class, adapter priority) are served
in strict order, tenants take turns inside a band, a band and a tenant's share of it are
bounded (``queue_full``, ``tenant_queue_full``), and a request waits at most its class's TTL
(``queue_timeout``); one whose client left is withdrawn, never forwarded. Each ticket moves
``queued -> admitted -> done`` or ``queued -> expired / withdrawn``, once. docs/router.md,
"Flow control".
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from loraplane.schemas.adapter import Priority
from loraplane.schemas.reasons import QueueRefusal
from loraplane.schemas.request_log import RequestClass

__all__ = [
    "BANDS",
    "CLASS_ORDER",
    "PRIORITY_ORDER",
    "WAIT_BUCKETS_S",
    "Band",
    "FlowControl",
    "Step",
    "Ticket",
    "TicketState",
    "WaitStats",
    "band_of",
]

CLASS_ORDER = (
    RequestClass.interactive,
    RequestClass.canary,
    RequestClass.batch,
    RequestClass.shadow,
)
PRIORITY_ORDER = (Priority.platinum, Priority.gold, Priority.silver, Priority.bronze)
WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class Band:
    rank: int  # 0 is served first
    request_class: RequestClass
    priority: Priority

    @property
    def label(self) -> str:
        return f"{self.request_class.value}-{self.priority.value}"


BANDS: dict[tuple[RequestClass, Priority], Band] = {
    (c, p): Band(i * len(PRIORITY_ORDER) + j, c, p)
    for i, c in enumerate(CLASS_ORDER)
    for j, p in enumerate(PRIORITY_ORDER)
}


def band_of(request_class: RequestClass, priority: Priority) -> Band:
    return BANDS[(request_class, priority)]


class TicketState(StrEnum):
    queued = "queued"
    admitted = "admitted"  # counted in flight until ``release``
    done = "done"
    expired = "expired"  # its TTL passed in the queue
    withdrawn = "withdrawn"  # its client left, or the router gave up on it


@dataclass(eq=False)
class Ticket:
    base: str
    band: Band
    tenant: str
    arrived: float
    deadline: float
    state: TicketState


@dataclass
class WaitStats:
    """Seconds waited in a queue by the requests admitted from it (a histogram)."""

    counts: list[int] = field(default_factory=lambda: [0] * len(WAIT_BUCKETS_S))
    total: int = 0
    sum_s: float = 0.0

    def observe(self, waited_s: float) -> None:
        self.total += 1
        self.sum_s += waited_s
        for i, le in enumerate(WAIT_BUCKETS_S):
            if waited_s <= le:
                self.counts[i] += 1
                break

    def cumulative(self) -> list[tuple[float, int]]:
        out, running = [], 0
        for le, n in zip(WAIT_BUCKETS_S, self.counts, strict=True):
            running += n
            out.append((le, running))
        return out


@dataclass
class Step:
    """What one call changed: tickets admitted now, tickets found past their deadline."""

    admitted: list[Ticket] = field(default_factory=list)
    expired: list[Ticket] = field(default_factory=list)


class FlowControl:
    """The queues of one router, for every base model."""

    def __init__(
        self,
        *,
        max_queued_per_band: int,
        max_queued_per_tenant: int,
        ttl_s: Mapping[RequestClass, float],
    ) -> None:
        self.max_queued_per_band = max_queued_per_band
        self.max_queued_per_tenant = max_queued_per_tenant
        self.ttl_s = dict(ttl_s)
        self.in_flight: dict[str, int] = {}  # base -> admitted, not yet released
        self.queued: dict[str, int] = {}  # base -> queued
        # base -> band -> tenant -> that tenant's tickets, oldest first; dict order is the
        # round-robin turn (a tenant served goes to the back)
        self._bands: dict[str, dict[Band, dict[str, deque[Ticket]]]] = {}
        self.depth: dict[tuple[str, Band], int] = {}  # every (base, band) ever queued in
        self.waits: dict[tuple[str, Band], WaitStats] = {}
        self.refused: Counter[tuple[str, Band, QueueRefusal]] = Counter()
        self.withdrawn: Counter[tuple[str, Band]] = Counter()

    # ---- arrivals ---------------------------------------------------------------------------
    def offer(
        self, base: str, band: Band, tenant: str, limit: int, now: float
    ) -> Ticket | QueueRefusal:
        """Admitted at once (fast path), queued, or refused. A queued ticket may be admitted
        by the ``pump`` the caller runs next."""
        if not self.queued.get(base) and self.in_flight.get(base, 0) < limit:
            self.in_flight[base] = self.in_flight.get(base, 0) + 1
            return Ticket(
                base, band, tenant, now, now + self.ttl_s[band.request_class], TicketState.admitted
            )
        key = (base, band)
        tenants = self._bands.setdefault(base, {}).setdefault(band, {})
        mine = tenants.get(tenant)
        refusal = None
        if self.depth.get(key, 0) >= self.max_queued_per_band:
            refusal = QueueRefusal.queue_full
        elif mine is not None and len(mine) >= self.max_queued_per_tenant:
            refusal = QueueRefusal.tenant_queue_full
        if refusal is not None:
            self.refused[(base, band, refusal)] += 1
            return refusal
        ticket = Ticket(
            base, band, tenant, now, now + self.ttl_s[band.request_class], TicketState.queued
        )
        if mine is None:
            mine = tenants[tenant] = deque()
        mine.append(ticket)
        self.depth[key] = self.depth.get(key, 0) + 1
        self.queued[base] = self.queued.get(base, 0) + 1
        return ticket

    # ---- moving the queues -------------------------------------------------------------------
    def pump(self, base: str, limit: int, now: float) -> Step:
        """Drop the tickets of ``base`` past their deadline, then admit queued tickets, best
        band first and tenants in turn, while fewer than ``limit`` are in flight."""
        step = Step()
        bands = self._bands.get(base)
        if not bands:
            return step
        for band in sorted(bands, key=lambda b: b.rank):
            tenants = bands[band]
            for tenant in list(tenants):
                tickets = tenants[tenant]
                while tickets and tickets[0].deadline <= now:  # one TTL per band: in order
                    step.expired.append(
                        self._take(base, band, tenants, tenant, now, TicketState.expired)
                    )
        for band in sorted(bands, key=lambda b: b.rank):
            tenants = bands[band]
            while tenants and self.in_flight.get(base, 0) < limit:
                tenant = next(iter(tenants))
                ticket = self._take(base, band, tenants, tenant, now, TicketState.admitted)
                if tenant in tenants:  # still queued: to the back of the turn
                    tenants[tenant] = tenants.pop(tenant)
                self.in_flight[base] = self.in_flight.get(base, 0) + 1
                self.waits.setdefault((base, band), WaitStats()).observe(now - ticket.arrived)
                step.admitted.append(ticket)
            if tenants:
                break  # a band still waiting: no lower band goes before it
        for band in [b for b, t in bands.items() if not t]:
            del bands[band]
        if not bands:
            del self._bands[base]
        return step

    def release(self, ticket: Ticket, limit: int, now: float) -> Step:
        """An admitted request is finished: its slot goes to the next queued one."""
        if ticket.state is not TicketState.admitted:
            raise ValueError(f"release of a {ticket.state} ticket")
        ticket.state = TicketState.done
        left = self.in_flight.get(ticket.base, 1) - 1
        if left > 0:
            self.in_flight[ticket.base] = left
        else:
            self.in_flight.pop(ticket.base, None)
        return self.pump(ticket.base, limit, now)

    def withdraw(self, ticket: Ticket, now: float) -> bool:
        """Take a queued ticket out (its client left, or its deadline passed while waiting):
        True if it was still queued. An admitted one is the caller's to ``release``."""
        if ticket.state is not TicketState.queued:
            return False
        tenants = self._bands[ticket.base][ticket.band]
        tickets = tenants[ticket.tenant]
        tickets.remove(ticket)
        tickets.appendleft(ticket)  # so _take finds it first
        expired = ticket.deadline <= now
        self._take(
            ticket.base,
            ticket.band,
            tenants,
            ticket.tenant,
            now,
            TicketState.expired if expired else TicketState.withdrawn,
        )
        if not expired:
            self.withdrawn[(ticket.base, ticket.band)] += 1
        if not tenants:
            del self._bands[ticket.base][ticket.band]
            if not self._bands[ticket.base]:
                del self._bands[ticket.base]
        return True

    def _take(
        self,
        base: str,
        band: Band,
        tenants: dict[str, deque[Ticket]],
        tenant: str,
        now: float,
        state: TicketState,
    ) -> Ticket:
        tickets = tenants[tenant]
        ticket = tickets.popleft()
        if not tickets:
            del tenants[tenant]
        ticket.state = state
        self.depth[(base, band)] -= 1
        self.queued[base] -= 1
        if not self.queued[base]:
            del self.queued[base]
        if state is TicketState.expired:
            self.refused[(base, band, QueueRefusal.queue_timeout)] += 1
        return ticket
