"""Stall detection for consumers: a component that cannot make progress says so.

A consumer that waits on a broker or a database is not broken while it retries, but it must
not stay silent either: a sink or scoring thread that stalls for minutes while logging
nothing looks healthy. Each loop reports ``blocked(why)`` when an attempt fails or a blocking
call begins, and ``advanced()`` when work went through; ``check()`` logs one clearly named
``STALLED`` line (rate-limited) once a hold-up lasts past ``stall_after_s``, and a
``RECOVERED`` line with its length when it ends. ``stuck_s()`` is the health signal on
/metrics (``kernel.progress_metrics``); ``Watchdog`` calls ``check`` from its own thread
for loops whose thread may itself be stuck inside a C call.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator

__all__ = ["REPORT_EVERY_S", "STALL_AFTER_S", "Progress", "Watchdog", "every_progress"]

log = logging.getLogger("loraplane.progress")

STALL_AFTER_S = 30.0
"""Longer than any single bounded call (30 s transaction steps), shorter than an operator's
patience: a hold-up this long is no longer a hiccup."""
REPORT_EVERY_S = 30.0


class _Everyone:
    """Every live ``Progress`` of this process; iterating takes a snapshot (a component may
    be built on another thread while an endpoint reads them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: weakref.WeakSet[Progress] = weakref.WeakSet()

    def add(self, progress: Progress) -> None:
        with self._lock:
            self._all.add(progress)

    def __iter__(self) -> Iterator[Progress]:
        with self._lock:
            return iter(list(self._all))


_EVERY = _Everyone()


def every_progress() -> Iterable[Progress]:
    """Every live ``Progress`` of this process, read afresh at each iteration (for an
    endpoint that serves them all)."""
    return _EVERY


class Progress:
    """The hold-up state of one component's loop (thread-safe: the watchdog reads it)."""

    def __init__(
        self,
        component: str,
        *,
        stall_after_s: float = STALL_AFTER_S,
        report_every_s: float = REPORT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.component = component
        self.stall_after_s = stall_after_s
        self.report_every_s = report_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None
        self._why = ""
        self._reported_at: float | None = None
        self.stalls = 0
        """How many hold-ups grew into a reported stall (a counter for /metrics)."""
        _EVERY.add(self)

    def blocked(self, why: str) -> None:
        """A hold-up starts (or goes on, with a newer reason)."""
        with self._lock:
            if self._since is None:
                self._since = self._clock()
            self._why = why

    def advanced(self) -> None:
        """Work went through: any hold-up is over."""
        with self._lock:
            since, reported = self._since, self._reported_at
            self._since, self._why, self._reported_at = None, "", None
        if since is not None and reported is not None:
            log.warning(
                "RECOVERED %s: progressing again after %.0f s",
                self.component,
                self._clock() - since,
            )

    def stuck_s(self) -> float:
        """Seconds the current hold-up has lasted (0 when there is none)."""
        with self._lock:
            return 0.0 if self._since is None else self._clock() - self._since

    @property
    def reason(self) -> str:
        with self._lock:
            return self._why

    def stalled(self) -> bool:
        return self.stuck_s() >= self.stall_after_s

    def check(self) -> float:
        """Log ``STALLED <component>`` if stuck past the threshold (once per
        ``report_every_s``); returns ``stuck_s``."""
        now = self._clock()
        with self._lock:
            if self._since is None or now - self._since < self.stall_after_s:
                return 0.0 if self._since is None else now - self._since
            if self._reported_at is not None and now - self._reported_at < self.report_every_s:
                return now - self._since
            if self._reported_at is None:
                self.stalls += 1
            self._reported_at = now
            stuck, why = now - self._since, self._why
        log.error("STALLED %s: no progress for %.0f s (%s)", self.component, stuck, why)
        return stuck


class Watchdog:
    """Calls ``check`` on each ``Progress`` every ``every_s`` from a daemon thread, so a loop
    blocked inside librdkafka is still reported while it hangs."""

    def __init__(self, progress: Iterable[Progress], every_s: float = 5.0) -> None:
        self._progress = list(progress)
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            for p in self._progress:
                p.check()
