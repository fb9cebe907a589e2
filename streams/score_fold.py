"""One batch of request-log messages folded into score states. Pure: the scoring agent
(streams.scoring_agent) consumes, calls ``fold_batch`` and writes what it returns.

Why per batch: each touched score key is written once per batch instead of once per
request log, and the per-request work is the cheapest the semantics allow (validate the
fields scores read, then ``scores.observe_many`` on floats). Refused messages come back
with their reason, for the dead-letter topic.

Request logs arrive at least once (the workers' event sink replays from its spool what the
broker may already have written when its acknowledgement was lost), so a log whose
``event_id`` is among the ``RecentIds`` of its partition, or earlier in the batch, is
skipped: a replayed duplicate sits behind its original on the same partition (same key).
A log that may hold no score key (``streams.score_admission``: not in the registry,
retired, revoked, refused) only adds to the batch's unknown count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from loraplane.schemas.codec import SchemaError, decode
from loraplane.schemas.dead_letter import KafkaMessage
from loraplane.schemas.reasons import DecodeReason
from loraplane.schemas.request_log import RequestDemand
from loraplane.schemas.score_snapshot import UnknownTally
from loraplane.streams.score_admission import Known
from loraplane.streams.scores import Sample, ScoreState, observe_many


@dataclass
class Folded:
    touched: dict[str, ScoreState] = field(default_factory=dict)
    """The new state of every score key the batch changed."""
    refused: list[tuple[KafkaMessage, SchemaError]] = field(default_factory=list)
    bursts: list[str] = field(default_factory=list)
    """Score keys where a request of this batch started a burst (``scores.is_burst``)."""
    counted: list[tuple[int, str]] = field(default_factory=list)
    """(partition, event_id) of every log counted, for ``RecentIds.add`` once committed."""
    duplicates: int = 0
    """Logs skipped because their event_id was already counted."""
    unknown: int = 0
    """Logs of this batch that hold no score key (``score_admission``)."""
    unknown_last: float | None = None
    """The latest event time among them."""

    def tally(self, before: UnknownTally) -> UnknownTally:
        """The unknown bucket after this batch."""
        if not self.unknown:
            return before
        last = [t for t in (before.last, self.unknown_last) if t is not None]
        return UnknownTally(logs=before.logs + self.unknown, last=max(last) if last else None)


class RecentIds:
    """The event ids of about the last ``size`` logs counted on each partition: a replayed
    duplicate further behind its original than that is counted again (the bound keeps the
    memory and the read-back after a rebalance finite)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ids: dict[int, set[str]] = {}
        self._order: dict[int, deque[str]] = {}

    def __contains__(self, item: tuple[int, str]) -> bool:
        partition, event_id = item
        return event_id in self._ids.get(partition, ())

    def add(self, items: Iterable[tuple[int, str]]) -> None:
        for partition, event_id in items:
            ids = self._ids.setdefault(partition, set())
            if event_id in ids:
                continue
            order = self._order.setdefault(partition, deque())
            ids.add(event_id)
            order.append(event_id)
            if len(order) > self.size:
                ids.discard(order.popleft())

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._ids.values())


def demand_of(message: KafkaMessage) -> RequestDemand:
    """The request's demand fields, validated; a log whose Kafka key is not its adapter_id is
    refused too (its score would live on the wrong partition)."""
    demand = decode(RequestDemand, message.value())
    key = message.key()
    if key != demand.adapter_id.encode():
        raise SchemaError(DecodeReason.key_mismatch, [
            ("(key)", f"Kafka key {key!r} is not adapter_id {demand.adapter_id}")])
    return demand


def fold_batch(states: Mapping[str, ScoreState], messages: Iterable[KafkaMessage],
               known: Known, recent: RecentIds | None = None) -> Folded:
    """Fold ``messages`` (in consumption order) into ``states``, which is not modified;
    only keys ``known`` admits are touched; ``recent`` is not modified either (the caller
    adds ``counted`` after its commit)."""
    out = Folded()
    samples: dict[str, list[Sample]] = {}
    in_batch: set[tuple[int, str]] = set()
    for message in messages:
        try:
            d = demand_of(message)
        except SchemaError as exc:
            out.refused.append((message, exc))
            continue
        seen = (message.partition() or 0, d.event_id)
        if seen in in_batch or (recent is not None and seen in recent):
            out.duplicates += 1
            continue
        in_batch.add(seen)
        out.counted.append(seen)
        sample = Sample.of(d)
        key = known.key_of(d.adapter_id, d.adapter_version, d.status)
        if key is None:
            out.unknown += 1
            if out.unknown_last is None or sample.ts > out.unknown_last:
                out.unknown_last = sample.ts
            continue
        if (group := samples.get(key)) is None:
            samples[key] = [sample]
        else:
            group.append(sample)
    for key, group in samples.items():
        out.touched[key], burst = observe_many(states.get(key) or ScoreState(), group)
        if burst:
            out.bursts.append(key)
    return out
