"""The planner's score states: one thread writes them (the planner's tail of the scores
topic, ``streams.planner_agent``), the planner reads them on the event loop.

The scoring keepers keep their own (``streams.score_keeper``): nothing is shared between
scoring and planning but the topic. ``states`` takes its copy under the lock, so the planner
never sees half a reload (it would demote everything it did not see). The events are
asyncio's: the writing thread sets them through the loop (``call_soon_threadsafe``), never
directly.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from loraplane.schemas.score_snapshot import UnknownTally
from loraplane.streams.scores import ScoreState


@dataclass(eq=False)
class ScoreStore:
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the states were read back from the scores topic: the planner waits on it."""
    burst: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a request log started a burst: the planner re-plans now and clears it."""
    unknown_logs: UnknownTally = field(default_factory=lambda: UnknownTally(logs=0))
    """The unknown bucket as last committed (logs that hold no score key)."""
    _states: dict[str, ScoreState] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def states(self) -> dict[str, ScoreState]:
        """A consistent copy of every state (all keys when this worker runs alone)."""
        with self._lock:
            return dict(self._states)

    def live(self) -> Mapping[str, ScoreState]:
        """The states themselves, read-only, for the writing thread's own reads (the fold):
        nothing else changes them, so it needs no copy and no lock."""
        return MappingProxyType(self._states)

    def replace_all(self, states: Mapping[str, ScoreState]) -> None:
        """Every state as re-read from the scores topic, in one step."""
        with self._lock:
            self._states.clear()
            self._states.update(states)

    def update(self, touched: Mapping[str, ScoreState]) -> None:
        """The states a committed batch changed."""
        with self._lock:
            self._states.update(touched)

    def remove(self, keys: Iterable[str]) -> None:
        """Keys tombstoned on the scores topic (their versions left the registry)."""
        with self._lock:
            for key in keys:
                self._states.pop(key, None)
