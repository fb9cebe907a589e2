"""Whether the router routes to a worker: its heartbeat, judged only as far as the feed that
carries it can tell, and else its gateway's own answer. Pure (no I/O); times are epoch
seconds of the router's clock, passed in.

Heartbeats reach the router through Kafka, and a broker that is away stops them all at
once, so a heartbeat's age alone would drain every healthy worker within three intervals of
an outage. A worker is *silent* only relative to a ``Feed`` that was current (the span over
which the worker-state tail answered without a gap). ``verdict`` says ``live``, ``gone`` (the
feed shows it silent), ``check`` (old, but the feed cannot vouch: routed on its last known
residency while its gateway is probed) or ``out`` (its gateway failed since its heartbeat).
A heartbeat counts from ``min(ts, arrival)`` (``beat_of``), so a state stamped in the future
is never fresher than its arrival, and a probe counts only when the gateway names the
worker (``probe_ok``). docs/router.md, "Kafka away", gives the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from loraplane.kernel.heartbeat import DRAIN_AFTER_HEARTBEATS, beat_of

__all__ = [
    "RECONNECT_GRACE_S",
    "Feed",
    "Gateway",
    "Verdict",
    "beat_of",
    "probe_ok",
    "silent",
    "verdict",
]

RECONNECT_GRACE_S = 15.0
"""After the feed comes back, how long a worker's own producer may take to reconnect
(librdkafka backs off up to 10 s between attempts) and send a heartbeat before the feed's
silence counts against it; its gateway decides meanwhile."""


class Verdict(StrEnum):
    live = "live"
    check = "check"  # routed, and its gateway probed now: the feed cannot vouch
    out = "out"  # not routed: its gateway failed since its last heartbeat
    gone = "gone"  # forgotten: a current feed shows it silent


@dataclass(frozen=True)
class Feed:
    """The worker-state feed answered without a gap from ``since`` to ``last`` (its latest
    answer at its end). None where the router holds no feed to judge by (a bare index):
    the heartbeat alone decides."""

    since: float
    last: float


@dataclass
class Gateway:
    """What the router saw of a worker's gateway itself (epoch seconds, None: never)."""

    ok_at: float | None = None  # its last good probe
    failed_at: float | None = None  # its last failed request or probe
    probing: bool = False  # a probe is under way (the runtime's: one at a time)


def silent(feed: Feed | None, beat: float, limit_s: float) -> bool:
    """The feed shows no heartbeat for over ``limit_s`` after ``beat`` (``gone``)."""
    if feed is None:
        return True  # no feed to doubt: the heartbeat's age decides (the caller's check)
    start = beat if feed.since <= beat else feed.since + RECONNECT_GRACE_S
    return feed.last - start > limit_s


def verdict(
    beat: float, now: float, heartbeat_s: float, feed: Feed | None, gateway: Gateway
) -> Verdict:
    """The module doc's rule for a worker whose heartbeat counts from ``beat``."""
    limit = DRAIN_AFTER_HEARTBEATS * heartbeat_s
    failed = gateway.failed_at
    if failed is not None and failed >= beat and (gateway.ok_at is None or failed >= gateway.ok_at):
        return Verdict.gone if now - beat > limit and silent(feed, beat, limit) else Verdict.out
    if now - beat <= limit:
        return Verdict.live
    if silent(feed, beat, limit):
        return Verdict.gone
    if gateway.ok_at is not None and now - gateway.ok_at <= heartbeat_s:
        return Verdict.live
    return Verdict.check


def probe_ok(worker_id: str, status: int, body: Any, *, serving: bool = True) -> bool:
    """A gateway's ``/healthz`` answer vouches for ``worker_id``: 200, ok, its own id, and
    (``serving``) no ``not_run``: a gateway up but refusing every request as not run serves
    nothing. A proof of the router secret asks without ``serving``: such a gateway is
    genuine, and its state (``WorkerState.not_run``) keeps it out of the view meanwhile."""
    return (
        status == 200
        and isinstance(body, dict)
        and body.get("ok") is True
        and body.get("worker_id") == worker_id
        and not (serving and body.get("not_run"))
    )
