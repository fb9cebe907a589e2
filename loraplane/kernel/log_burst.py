"""The one rate-limited log of the project: a line that could repeat at request or tick rate
(a connection error, a refused load, a skipped command, an unreadable dependency) is logged
once per kind per interval, and the rest of the interval as a count on the next line. The
``total`` counts every note, so a caller can serve them as a metric as well."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

__all__ = ["LogBurst"]


class LogBurst:
    """Per kind, one line when a kind first shows in an interval, then one line with the
    count of the rest when the next interval opens (``flush`` writes the counts now)."""

    def __init__(
        self,
        name: str,
        interval_s: float,
        *,
        logger: logging.Logger,
        level: int = logging.WARNING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.interval_s = interval_s
        self.logger = logger
        self.level = level
        self.clock = clock
        self.total: Counter[str] = Counter()  # every note, for tests and metrics
        self._pending: Counter[str] = Counter()
        self._since: dict[str, float] = {}

    def note(self, kind: str, detail: str = "", *, exc_info: bool = False) -> bool:
        """Count one occurrence of ``kind``; True when this one was logged (``exc_info``:
        with the exception being handled, as ``logging`` writes it)."""
        self.total[kind] += 1
        now = self.clock()
        since = self._since.get(kind)
        if since is not None and now - since < self.interval_s:
            self._pending[kind] += 1
            return False
        self._since[kind] = now
        more = self._pending.pop(kind, 0)
        self.logger.log(
            self.level,
            "%s: %s%s%s",
            self.name,
            kind,
            f" ({detail})" if detail else "",
            f"; {more} more in the last {now - since:.0f}s" if more and since is not None else "",
            exc_info=exc_info,
        )
        return True

    def flush(self) -> None:
        for kind, more in sorted(self._pending.items()):
            self.logger.log(self.level, "%s: %d more %s", self.name, more, kind)
        self._pending.clear()
