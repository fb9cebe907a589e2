"""When a worker or a router counts as heard lately: the one liveness rule the planner, the
fleet view and the router's liveness share. Pure."""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

__all__ = ["DRAIN_AFTER_HEARTBEATS", "Heartbeat", "beat_of", "heard_lately"]

DRAIN_AFTER_HEARTBEATS = 3
"""A worker silent for this many heartbeat intervals (of a current feed) is drained."""


class Heartbeat(Protocol):
    """A worker's or a router's state: when it was sent."""

    @property
    def ts(self) -> datetime: ...


def heard_lately(state: Heartbeat, now: float, heartbeat_s: float) -> bool:
    """The state's last heartbeat is at most ``DRAIN_AFTER_HEARTBEATS`` intervals old at
    epoch seconds ``now``."""
    return now - state.ts.timestamp() <= DRAIN_AFTER_HEARTBEATS * heartbeat_s


def beat_of(ts: float, arrived: float) -> float:
    """When a heartbeat counts from: its stamp, never later than it arrived (a state stamped
    in the future, forged or from a clock gone wrong, is never fresher than its arrival)."""
    return min(ts, arrived)
