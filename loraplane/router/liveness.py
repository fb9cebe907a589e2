"""Whether the router routes to a worker: its heartbeat, judged only as far as the feed that
carries it can tell, and else its gateway's own answer. Pure (no I/O); times are epoch
seconds of the router's clock, passed in.

Heartbeats (``WorkerState``) reach the router through Kafka. A broker that is away stops
every heartbeat at once, so a heartbeat's age alone would drain every healthy worker within
three intervals of an outage. A worker is therefore *silent* only relative to a feed that
was current: ``Feed`` is the span over which the router's worker-state tail answered without
a gap (``kernel.topic_tail.TopicTail.current_span``), and the verdict (``verdict``) is:

- ``out``: its gateway failed (a refused or cut request, a failed probe) after its last
  heartbeat and answered no probe since: not routed; probed every interval; back on its
  next heartbeat or its next good probe;
- ``live``: its heartbeat is at most ``DRAIN_AFTER_HEARTBEATS`` intervals old, or, while the
  feed cannot vouch for it, its gateway answered a probe within the last interval;
- ``gone``: the feed shows it silent: the feed answered without a gap from the heartbeat on
  for more than three intervals (when the feed came back after the heartbeat: from its
  return, plus ``RECONNECT_GRACE_S`` for the worker's own producer to reconnect and send).
  Forgotten until its next heartbeat;
- ``check``: its heartbeat is old but the feed cannot vouch for that (away, or back too
  recently): routed on its last known residency, and its gateway is probed now.

A heartbeat counts from ``min(ts, arrival)`` (``beat_of``): a state stamped in the future
(forged, or a skewed clock) is as fresh as one that just arrived, never fresher, so it
cannot keep a dead worker in the view beyond three intervals of a current feed, nor hold
back the worker's own later states (``FleetIndex.update`` orders states by this beat). A
replayed old state is as old as its ``ts``. A probe counts only when the gateway names the
worker (``probe_ok``): a state pointing at another worker's gateway does not pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from loraplane.kernel.heartbeat import DRAIN_AFTER_HEARTBEATS

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


def beat_of(ts: float, arrived: float) -> float:
    """When a heartbeat counts from: its stamp, never later than it arrived."""
    return min(ts, arrived)


def silent(feed: Feed | None, beat: float, limit_s: float) -> bool:
    """The feed shows no heartbeat for over ``limit_s`` after ``beat`` (``gone``)."""
    if feed is None:
        return True  # no feed to doubt: the heartbeat's age decides (the caller's check)
    start = beat if feed.since <= beat else feed.since + RECONNECT_GRACE_S
    return feed.last - start > limit_s


def verdict(beat: float, now: float, heartbeat_s: float, feed: Feed | None,
            gateway: Gateway) -> Verdict:
    """The module doc's rule for a worker whose heartbeat counts from ``beat``."""
    limit = DRAIN_AFTER_HEARTBEATS * heartbeat_s
    failed = gateway.failed_at
    if failed is not None and failed >= beat and (gateway.ok_at is None
                                                  or failed >= gateway.ok_at):
        return Verdict.gone if now - beat > limit and silent(feed, beat, limit) \
            else Verdict.out
    if now - beat <= limit:
        return Verdict.live
    if silent(feed, beat, limit):
        return Verdict.gone
    if gateway.ok_at is not None and now - gateway.ok_at <= heartbeat_s:
        return Verdict.live
    return Verdict.check


def probe_ok(worker_id: str, status: int, body: Any) -> bool:
    """A gateway's ``/healthz`` answer vouches for ``worker_id``: 200, ok, and its own id."""
    return (status == 200 and isinstance(body, dict) and body.get("ok") is True
            and body.get("worker_id") == worker_id)
