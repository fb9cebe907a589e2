"""What a GPU load costs the batch running beside it, measured on the worker, and the
cold-load budget that follows from it (``policy.load_stall_share``). Pure: the caller passes
the clock and the measurements.

Why: a load slows every request decoding on its worker while it runs (vLLM loads inside its
step loop), and a constant "N loads a minute" is right for one model, GPU and adapter size
only. The worker measures ``stall`` (the share of decode rate lost while a load runs: a
decayed least-squares line ``rate = r0 (1 - stall x overlap)`` through the streamed answers
whose pace was vLLM's) and ``load_s`` (a load's seconds, a moving average). A load costs
``stall x load_s`` seconds of decode; the budget is the most loads a minute that keep that
under ``share`` of the minute, between one and the policy's constant. docs/worker.md, "The
reconcile loop" (the cold-load budget), gives the rules.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

__all__ = [
    "LOAD_SMOOTHING",
    "MAX_LOAD_S",
    "MIN_POINTS",
    "TAU_S",
    "WINDOW_MEMORY_S",
    "LoadWindows",
    "StallEstimate",
    "adapted_budget",
]

TAU_S = 1800.0
"""Memory of both measurements: about the last half hour counts."""
MIN_POINTS = 20.0
"""Decayed requests needed before the line is trusted (each side of it: some overlapped a
load, some did not), else no stall is known and the budget stays the policy's."""
LOAD_SMOOTHING = 0.2
WINDOW_MEMORY_S = 3600.0
"""Load windows kept to match requests against: longer than any request runs."""
MAX_LOAD_S = 600.0
"""No load runs longer (the agent gives up on it first): where a request's scan starts."""


@dataclass
class StallEstimate:
    """Decayed sums of (overlap share x, tokens/s y) over finished requests: ``n``, ``x``,
    ``y``, ``xx``, ``xy``, as of ``at``. Points with ``x > 0`` are counted apart (``n_over``)
    so that a worker that never loaded while serving reports no stall rather than 0."""

    tau_s: float = TAU_S
    n: float = 0.0
    n_over: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    at: float = 0.0

    def observe(self, overlap: float, tokens_per_s: float, now: float) -> None:
        """One finished request: ``overlap`` in [0, 1] of its time ran beside a load."""
        if not (math.isfinite(overlap) and math.isfinite(tokens_per_s)) or tokens_per_s <= 0:
            return
        overlap = min(1.0, max(0.0, overlap))
        k = math.exp(-max(0.0, now - self.at) / self.tau_s) if self.n else 0.0
        self.n = self.n * k + 1.0
        self.n_over = self.n_over * k + (1.0 if overlap > 0 else 0.0)
        self.x = self.x * k + overlap
        self.y = self.y * k + tokens_per_s
        self.xx = self.xx * k + overlap * overlap
        self.xy = self.xy * k + overlap * tokens_per_s
        self.at = max(self.at, now)

    def stall(self) -> float | None:
        """The share of decode rate a load takes, in [0, 1]; None until enough requests
        with and without a load beside them were seen."""
        if self.n_over < MIN_POINTS or self.n - self.n_over < MIN_POINTS:
            return None
        spread = self.xx - self.x * self.x / self.n
        if spread <= 1e-12 * self.n:
            return None
        slope = (self.xy - self.x * self.y / self.n) / spread
        intercept = (self.y - slope * self.x) / self.n
        if intercept <= 0:
            return None
        return min(1.0, max(0.0, -slope / intercept))


@dataclass
class LoadWindows:
    """When this worker's loads ran (monotonic seconds), for matching finished requests
    against them, and how long a load takes (``load_s``, a moving average)."""

    windows: list[tuple[float, float]] = field(default_factory=list)  # by start
    load_s: float | None = None

    def add(self, start: float, end: float) -> None:
        if end < start:
            return
        bisect.insort(self.windows, (start, end))
        seconds = end - start
        self.load_s = (
            seconds
            if self.load_s is None
            else self.load_s + LOAD_SMOOTHING * (seconds - self.load_s)
        )
        cut = bisect.bisect_left(self.windows, (end - WINDOW_MEMORY_S, -math.inf))
        if cut:
            del self.windows[:cut]

    def overlap(self, start: float, end: float) -> float:
        """The share of ``[start, end]`` that ran beside some load (windows may overlap each
        other: their union counts once)."""
        if end <= start:
            return 0.0
        covered, reach = 0.0, start
        first = bisect.bisect_left(self.windows, (start - MAX_LOAD_S, -math.inf))
        for lo, hi in self.windows[first:]:
            if lo >= end:
                break
            lo, hi = max(lo, reach), min(hi, end)
            if hi > lo:
                covered += hi - lo
                reach = hi
        return covered / (end - start)


def adapted_budget(ceiling: int, share: float, stall: float | None, load_s: float | None) -> int:
    """Loads a minute such that ``stall x load_s`` seconds of decode lost per load stay
    under ``share`` of a minute; the policy's ``ceiling`` when the share is 0 (off) or
    nothing is measured yet; never below 1 (a worker that may not load at all serves only
    what it holds)."""
    if share <= 0 or stall is None or load_s is None or stall * load_s <= 0:
        return ceiling
    allowed = share * 60.0 / (stall * load_s)
    return ceiling if not allowed < ceiling else max(1, math.floor(allowed))
