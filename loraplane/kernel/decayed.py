"""An exponentially decayed event count: the demand memory of the hot scores and of the
worker's demand admission. Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Decayed"]


@dataclass(frozen=True)
class Decayed:
    """An exponentially decayed event count with time constant ``tau`` seconds."""

    tau: float
    value: float = 0.0
    at: float = 0.0

    def at_time(self, now: float) -> float:
        if not self.value:
            return 0.0  # an empty counter (most of a large registry): no exp
        return self.value * math.exp(-max(0.0, now - self.at) / self.tau)

    def add(self, ts: float, amount: float = 1.0) -> Decayed:
        # The constructor, not ``dataclasses.replace``: this runs once per request log.
        if ts >= self.at:
            return Decayed(self.tau, self.at_time(ts) + amount, ts)
        return Decayed(
            self.tau, self.value + amount * math.exp(-(self.at - ts) / self.tau), self.at
        )

    def rate(self, now: float) -> float:
        """Events per second over the last ~tau seconds."""
        return self.at_time(now) / self.tau
