"""The blocking calls one resource runs in threads, counted, so it is closed only after them.

``asyncio.to_thread`` cannot be cancelled: when the awaiting task is (``tasks.cancel_all`` at
a stop, ``asyncio.wait_for`` timing out), the task ends at once and its thread runs on to
its end. A resource closed then (a Kafka consumer inside ``poll`` or ``commit``, a folder
whose lock is released while a thread writes in it) is closed under that thread. A resource
that runs its blocking calls through its own ``ThreadCalls`` closes through
``close_when_drained``: after every call in flight has returned, up to a bound; past it, one
error line names the resource and the calls, and the resource is left open for the process
exit rather than closed under them.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["CALLS_WAIT_S", "ThreadCalls", "ThreadCallsClosed"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

CALLS_WAIT_S = 5.0
"""How long a resource's close waits for its calls still running in threads."""


class ThreadCallsClosed(RuntimeError):
    """A call asked of a resource whose close has begun: it is not started."""


class ThreadCalls:
    """The calls in threads on one resource (``what`` names it in the log line). A call is
    counted from ``run`` until its function returns in its thread, or until its task is
    cancelled before the thread took it (it then never runs)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._changed = threading.Condition()
        self._running: dict[int, str] = {}  # a call's number -> its function's name
        self._next = 0
        self._closing = False
        self._deadline: float | None = None  # the first drain's: later ones wait no longer

    @property
    def in_flight(self) -> int:
        """How many calls are started and not ended (their threads included)."""
        with self._changed:
            return len(self._running)

    async def run(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)`` in a thread, as ``asyncio.to_thread`` (context vars
        included), counted until it returns; ``ThreadCallsClosed`` once the close began."""
        with self._changed:
            if self._closing:
                raise ThreadCallsClosed(f"{self.what}: closed")
            number = self._next
            self._next += 1
            self._running[number] = getattr(fn, "__qualname__", repr(fn))
        taken = False
        lock = threading.Lock()  # who decides first: the thread taking it, or a cancel

        def call() -> _T:
            nonlocal taken
            with lock:
                if number not in self._running:  # cancelled before the thread took it
                    raise asyncio.CancelledError
                taken = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._end(number)

        context = contextvars.copy_context()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, context.run, call)
        except asyncio.CancelledError:
            with lock:
                if not taken:  # the thread never runs it: no longer in flight
                    self._end(number)
            raise

    def _end(self, number: int) -> None:
        with self._changed:
            self._running.pop(number, None)
            self._changed.notify_all()

    def drain(self, timeout_s: float = CALLS_WAIT_S) -> bool:
        """Refuse later calls and wait until none is in flight (True); past ``timeout_s``,
        an error line naming the calls still running, and False. Blocks the calling
        thread. A later drain of the same resource (a stop's, then its close's) waits only
        what is left of the first one's bound: a call stuck past it is not waited for twice."""
        with self._changed:
            self._closing = True
            started = time.monotonic()
            if self._deadline is None:
                self._deadline = started + timeout_s
            deadline = min(started + timeout_s, self._deadline)
            while self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    running = ", ".join(sorted(set(self._running.values())))
                    break
                self._changed.wait(left)
            else:
                return True
        log.error(
            "%s: %s still running in a thread after %.1f s",
            self.what,
            running,
            time.monotonic() - started,
        )
        return False

    def close_when_drained(
        self, close: Callable[[], object], timeout_s: float = CALLS_WAIT_S
    ) -> bool:
        """``close()`` once no call is in flight (``drain``), and True; past ``timeout_s``,
        ``close`` is not called, an error line says so, and False: the resource is left to
        the process exit rather than closed under a thread using it."""
        if self.drain(timeout_s):
            close()
            return True
        log.error("%s: not closed, left open until the process exits", self.what)
        return False
