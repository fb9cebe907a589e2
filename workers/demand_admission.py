"""Which request may take a GPU slot by loading on demand, and which copy gives its slot up:
a worker-local admission by the cold-load budget and by priority-weighted demand.

A request's own load spends a slot and one load of the worker's rolling-minute cold-load
budget (a load not spent within the minute is lost), so the budget goes first to the
requests that cannot fall back. A request that may wait (batch, canary, shadow) is admitted
whenever the budget has a load for it within its wait: its adapter is its only answer. An
interactive request, which has the base model to fall back on, is admitted while the budget
keeps a reserve for those (``any_slot``). Otherwise a load takes only the slot of a copy with
no more priority-weighted requests here than its version (``DemandCounts.admits``, in the
spirit of TinyLFU): the slot keeps the busier copy. The copy that gives up its slot
(``give_up_order``): a request's before the planner's, then the least demanded here, then the
least recently used. A load the planner orders is not subject to any of this. The rules:
docs/worker.md, "Demand admission". Pure: the caller passes the clock and the load times.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loraplane.kernel.decayed import Decayed

__all__ = [
    "MAX_NAMES",
    "WINDOW_S",
    "DemandCounts",
    "WaitingMisses",
    "any_slot",
    "give_up_order",
    "has_room",
]

MAX_NAMES = 4096
"""Lora names remembered; over it the least-demanded half is forgotten (a forgotten name
counts 0 again: it was among the least demanded anyway)."""
WINDOW_S = 60.0
"""The cold-load budget's rolling window."""


@dataclass
class DemandCounts:
    """Per lora name, the priority-weighted count of requests seen, each decaying with time
    constant ``tau_s`` (``tau_s`` x the weighted request rate, in steady traffic): the
    scores' ``Decayed`` counter, one per name."""

    tau_s: float
    max_names: int = MAX_NAMES
    _counts: dict[str, Decayed] = field(default_factory=dict)

    def count(self, name: str, now: float) -> float:
        """The decayed weighted count of ``name`` at ``now`` (0 for a name never seen)."""
        seen = self._counts.get(name)
        return 0.0 if seen is None else seen.at_time(now)

    def observe(self, name: str, weight: float, now: float) -> None:
        """One request for ``name`` worth ``weight`` (the tenant's priority value)."""
        seen = self._counts.get(name) or Decayed(self.tau_s)
        self._counts[name] = seen.add(now, max(0.0, weight))
        if len(self._counts) > self.max_names:
            ranked = sorted(self._counts, key=lambda k: self.count(k, now))
            for k in ranked[: len(ranked) // 2]:
                del self._counts[k]

    def admits(self, challenger: str, name: str, now: float) -> bool:
        """May a demand load of ``challenger`` take the slot of ``name``? When ``name``'s count
        is not above the challenger's (ties admit: an idle copy's slot goes to a newcomer)."""
        return self.count(name, now) <= self.count(challenger, now)


@dataclass
class WaitingMisses:
    """When requests that may wait needed a load here: the budget's reserve for them."""

    window_s: float = WINDOW_S
    _times: deque[float] = field(default_factory=deque)

    def add(self, now: float) -> None:
        self._times.append(now)

    def count(self, now: float) -> int:
        """Those in the window before ``now``."""
        times = self._times
        while times and times[0] <= now - self.window_s:
            times.popleft()
        return len(times)


def has_room(used: int, per_minute: int, keep: int) -> bool:
    """Does the rolling-minute budget (``per_minute`` loads, ``used`` of them started in the
    last minute or to start) leave more than ``keep`` loads?"""
    return used + keep < per_minute


def any_slot(*, may_wait: bool, in_time: bool, used: int, per_minute: int, waiting: int) -> bool:
    """May a request's load take the slot of any copy that may move, without the demand
    comparison? ``waiting``: the requests that may wait and needed a load here in the last
    minute (this one included). One that ``may_wait`` when the budget has a load for it
    within its wait (``in_time``); an interactive one while the budget leaves more than its
    reserve: their loads, plus one."""
    if may_wait:
        return in_time
    return has_room(used, per_minute, waiting + 1)


def give_up_order(
    name: str, *, planned: bool, demand: float, last_used: float
) -> tuple[bool, float, float, str]:
    """The sort key of the copies that may give up their slot to a request's load, first
    first: copies loaded for requests before the planner's, then the least demanded here,
    then the least recently used (then by name, so the order is total)."""
    return (planned, demand, last_used, name)
