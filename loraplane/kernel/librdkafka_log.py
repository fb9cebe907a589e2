"""librdkafka's own log lines, through the process's logging and rate-limited.

Left to itself, librdkafka writes to stderr in its own format (``%3|1796548342.9|FAIL|...``),
past the process's one-line formatter, and while a broker is away it writes a line for
every connection attempt: 3 a second from an idle producer, 19 from a consumer that polls
(measured against a closed port), so a worker or a router with a handful of clients writes
~100,000 lines an hour of an outage. Given to a client as its ``logger``, this object takes
those lines instead: each client and librdkafka facility (``FAIL``, ``ERROR``, ``REQTMOUT``)
logs its first line of an interval, at librdkafka's level, and the rest as a count when the
next interval opens (``kernel.log_burst``). librdkafka hands a client's lines to Python when
the client is polled; a client never polled keeps them queued until it is (~3 a second).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from loraplane.kernel.log_burst import LogBurst

__all__ = ["INTERVAL_S", "LIBRDKAFKA_LOG", "LibrdkafkaLog"]

INTERVAL_S = 30.0
"""A client's facility logs one line and one count line at most this often."""

log = logging.getLogger(__name__)


class LibrdkafkaLog:
    """A confluent-kafka ``logger``: it calls ``log(level, "%s [%s] %s", facility, client,
    text)`` from whichever thread polls the client."""

    def __init__(
        self,
        interval_s: float = INTERVAL_S,
        logger: logging.Logger = log,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.logger = logger
        self.clock = clock
        self._bursts: dict[int, LogBurst] = {}
        self._lock = threading.Lock()  # clients are polled from several threads

    def log(self, level: int, fmt: str, *args: object) -> None:
        if len(args) == 3:
            facility, client, text = (str(a) for a in args)
            kind = f"{client} {facility}"
        else:  # another shape than confluent-kafka's: the line as it is, one kind
            kind, text = "librdkafka", " ".join(map(str, args)) or fmt
        with self._lock:
            burst = self._bursts.get(level)
            if burst is None:
                burst = self._bursts[level] = LogBurst(
                    "librdkafka", self.interval_s, logger=self.logger, level=level, clock=self.clock
                )
            burst.note(kind, text)

    @property
    def total(self) -> int:
        """Every line librdkafka gave, logged or counted."""
        with self._lock:
            return sum(sum(b.total.values()) for b in self._bursts.values())


LIBRDKAFKA_LOG = LibrdkafkaLog()
"""The process's one: every client's lines go through the same rate limit."""
