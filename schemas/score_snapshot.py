"""One score key's state as committed to the compacted ``scores`` topic (key = score key,
``adapter_id@version`` or ``adapter_id@*``), on the scores partition equal to the requests
partition of its logs: a scoring process reads back only the partitions it owns.

The wire form of ``streams.scores.ScoreState``: each decayed counter is a ``[value, at]``
pair (its time constant is implied by the field), short field names because ~100k of these
are written and re-read. Counts are never negative and nothing is NaN or infinite: a record
that says otherwise was not written by us and is skipped on read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

from pydantic import Field, model_validator

from loraplane.schemas.base import NonNegativeMs, StrictModel

__all__ = [
    "MAX_UNKNOWN_LOGS",
    "UNKNOWN_KEY",
    "Count",
    "DailySums",
    "DecayedPair",
    "Epoch",
    "Harmonic",
    "ScoreSnapshot",
    "UnknownTally",
    "is_unknown_key",
    "unknown_key",
]

Count = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A decayed event count (as of its ``at``)."""
Epoch = Annotated[float, Field(allow_inf_nan=False)]
"""Seconds since the epoch."""
DecayedPair = tuple[Count, Epoch]
"""``(value, at)`` of an exponentially decayed counter."""
Harmonic = Annotated[float, Field(allow_inf_nan=False)]
DailySums = tuple[Count, Harmonic, Harmonic, Harmonic, Harmonic, Epoch]
"""``(n, c1, s1, c2, s2, at)`` of ``streams.scores.Daily``: decayed sums of 1 and of the cos and
sin of each request's phase of day (one and two cycles), as of ``at``."""


class ScoreSnapshot(StrictModel):
    schema_version: Literal[1] = 1
    r10: DecayedPair = Field(description="requests, 10-minute time constant")
    r1: DecayedPair = Field(description="requests, 1-minute time constant")
    last: Epoch | None = Field(description="time of the last request (None: never)")
    cold: NonNegativeMs | None = Field(description="moving average TTFT when not on GPU")
    hot: NonNegativeMs | None = Field(description="moving average TTFT when on GPU")
    served: DecayedPair = Field(description="requests served after a load (10 min)")
    errors: DecayedPair = Field(description="of which errors (10 min)")
    classes: dict[Annotated[str, Field(max_length=64)], DecayedPair] = Field(
        max_length=64, description="requests per request class (10 min)"
    )
    armed: bool = Field(True, description="the next burst may fire (absent in old records)")
    day: DailySums | None = Field(
        None,
        description="daily profile: requests over the time of day, 3-day decay (absent "
        "in old records: no profile yet)",
    )
    since: Epoch | None = Field(None, description="time of the first request in the profile")

    @model_validator(mode="after")
    def _harmonics_within_count(self) -> ScoreSnapshot:
        # each sum of cos or sin of n requests is at most n in size: more would forecast a
        # rate no request stream can produce
        if self.day is not None and any(
            abs(h) > self.day[0] * (1 + 1e-9) + 1e-9 for h in self.day[1:5]
        ):
            raise ValueError("day: a harmonic exceeds the request count")
        return self


UNKNOWN_KEY = "(unknown)"
"""The prefix of the scores topic's keys for request logs that hold no score key (an adapter
or version not in the registry, or a refused request): one key per partition,
``unknown_key(p)``. No adapter id can take it: ids match ``schemas.base.ID_PATTERN``, which
has no parentheses."""


MAX_UNKNOWN_LOGS = 2**62
"""The most an unknown bucket counts: a count read back at it (a record the keeper did not
write) stays there instead of making a tally its own schema refuses."""


def unknown_key(partition: int) -> str:
    """The unknown bucket of one requests partition, ``"(unknown)/{partition}"``: each scoring
    process writes only the buckets of the partitions it owns (to the scores partition of
    the same number), so N processes never overwrite each other's count. Readers sum them
    (``UnknownTally.total``)."""
    return f"{UNKNOWN_KEY}/{partition}"


def is_unknown_key(key: str) -> bool:
    """Whether a scores key is an unknown bucket (any key starting "(unknown)", the single
    bucket of before included), never an adapter key."""
    return key.startswith(UNKNOWN_KEY)


class UnknownTally(StrictModel):
    """The value under ``unknown_key(p)``: how many request logs of partition p were counted
    as unknown, so hostile or stale ids cost one record per partition, not one key each
    (docs/planner.md, "Bounded state")."""

    schema_version: Literal[1] = 1
    logs: int = Field(
        ge=0, le=MAX_UNKNOWN_LOGS, description="request logs counted unknown, ever (saturates)"
    )
    last: Epoch | None = Field(None, description="event time of the last one (None: never)")

    @classmethod
    def total(cls, tallies: Iterable[UnknownTally]) -> UnknownTally:
        """The sum of the per-partition buckets (the whole unknown count)."""
        logs, last = 0, None
        for t in tallies:
            logs += t.logs
            if t.last is not None and (last is None or t.last > last):
                last = t.last
        return cls(logs=min(logs, MAX_UNKNOWN_LOGS), last=last)

    def plus(self, logs: int, last: float | None) -> UnknownTally:
        """This bucket with ``logs`` more, the latest at ``last``; the count saturates at
        ``MAX_UNKNOWN_LOGS``."""
        latest = [t for t in (self.last, last) if t is not None]
        return UnknownTally(
            logs=min(self.logs + logs, MAX_UNKNOWN_LOGS), last=max(latest) if latest else None
        )
