"""One batch of request-log messages folded into score states. Pure: the scoring keeper
consumes, calls ``fold_batch`` and writes what it returns.

Why per batch: each touched score key is written once per batch instead of once per log,
and the per-log work is the cheapest the semantics allow. Refused messages come back with
their reason, for the dead-letter topic. Logs arrive at least once, so a log whose
``event_id`` is among the ``RecentIds`` of its partition, or earlier in the batch, is
skipped (a replay sits behind its original on the same partition). A log that may hold no
score key (``streams.score_admission``) only adds to the batch's unknown count. A log on a
partition its Kafka key does not hash to is refused (``wrong_partition``): its key would get
a second state on another scores partition, which a reader could take for the key's.

The fast path: a compiled msgspec decoder (``_Demand``) reads only the fields scores need,
with RequestDemand's constraints, from plain ASCII flat JSON. It may refuse more than
pydantic does, never less, and never decodes a value differently
(tests/unit/test_score_fast_path.py); whatever it refuses goes through ``demand_of``, the
full pydantic validator, which accepts it after all or names the reason. Why: pydantic
validation was most of the per-log cost (docs/benchmarks.md, "Scoring throughput").
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import groupby
from operator import itemgetter
from typing import Annotated, Any, Literal

import msgspec

from loraplane.kernel.command_partition import key_hash, partition_of
from loraplane.schemas.base import ID_PATTERN, VERSION_PATTERN, NonNegativeMs
from loraplane.schemas.codec import MAX_MESSAGE_BYTES, SchemaError, decode
from loraplane.schemas.dead_letter import KafkaMessage
from loraplane.schemas.reasons import DecodeReason
from loraplane.schemas.request_log import RequestClass, RequestDemand, RequestStatus, Tier
from loraplane.schemas.score_snapshot import UnknownTally
from loraplane.streams.score_admission import Known
from loraplane.streams.scores import Flat, SampleRow, ScoreState, score_key

__all__ = ["Folded", "RecentIds", "Row", "demand_of", "fast_demand", "fold_batch", "row_of"]


@dataclass
class Folded:
    flat: dict[str, Flat] = field(default_factory=dict)
    """The new state of every score key the batch changed."""
    refused: list[tuple[KafkaMessage, SchemaError]] = field(default_factory=list)
    bursts: list[str] = field(default_factory=list)
    """Score keys where a request of this batch started a burst (``scores.is_burst``)."""
    ids: dict[int, list[str]] = field(default_factory=dict)
    """Per partition, the event_id of every log counted, in order: for ``RecentIds.add_run``
    once committed."""
    duplicates: int = 0
    """Logs skipped because their event_id was already counted."""
    unknown: int = 0
    """Logs of this batch that hold no score key (``score_admission``)."""
    unknown_last: float | None = None
    """The latest event time among them."""

    @property
    def touched(self) -> dict[str, ScoreState]:
        """``flat`` as ``ScoreState``s."""
        return {key: flat.state() for key, flat in self.flat.items()}

    @property
    def counted(self) -> list[tuple[int, str]]:
        """(partition, event_id) of every log counted, partition by partition."""
        return [(p, event_id) for p, ids in self.ids.items() for event_id in ids]

    def tally(self, before: UnknownTally) -> UnknownTally:
        """The unknown bucket after this batch."""
        if not self.unknown:
            return before
        return before.plus(self.unknown, self.unknown_last)


class RecentIds:
    """The event ids of about the last ``size`` logs counted on each partition: a replayed
    duplicate further behind its original than that is counted again (the bound keeps the
    memory and the read-back after a rebalance finite)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ids: dict[int, set[str]] = {}
        self._order: dict[int, list[str]] = {}

    def __contains__(self, item: tuple[int, str]) -> bool:
        partition, event_id = item
        return event_id in self._ids.get(partition, ())

    def ids_on(self, partition: int) -> Set[str]:
        """The ids remembered for one partition (read-only; empty if none)."""
        return self._ids.get(partition, _NONE)

    def add(self, items: Iterable[tuple[int, str]]) -> None:
        """Remember (partition, event_id) pairs, in order."""
        for partition, run in groupby(items, key=itemgetter(0)):
            self.add_run(partition, [event_id for _, event_id in run])

    def add_run(self, partition: int, event_ids: Sequence[str]) -> None:
        """Remember ids counted on one partition, in order; one already remembered is
        skipped, and past ``size`` the oldest are forgotten.

        Why whole runs: the keeper adds every log it counted, and ids that are new and
        distinct (what a fold counts) go in with set and list operations, not one by one."""
        ids = self._ids.get(partition)
        if ids is None:
            ids = self._ids[partition] = set()
            self._order[partition] = []
        order = self._order[partition]
        if ids.isdisjoint(event_ids) and len(set(event_ids)) == len(event_ids):
            ids.update(event_ids)
            order.extend(event_ids)
            if (excess := len(order) - self.size) > 0:
                ids.difference_update(order[:excess])
                del order[:excess]
            return
        for event_id in event_ids:  # some seen before: in order, one at a time
            if event_id in ids:
                continue
            ids.add(event_id)
            order.append(event_id)
            if len(order) > self.size:
                ids.discard(order.pop(0))

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._ids.values())


_NONE: frozenset[str] = frozenset()
_EMPTY = Flat()
"""The state of a key never seen (immutable, so shared: a fold returns a new one)."""


def _unanchored(pattern: str) -> str:
    """A pydantic (Rust regex) ``^...$`` pattern for Python's ``re.fullmatch``: in
    ``re.search``, ``$`` also matches before a final newline."""
    return pattern.removeprefix("^").removesuffix("$")


def _bounds(annotated: Any) -> dict[str, float]:
    """The ge/le bounds of a pydantic ``Annotated[float, Field(...)]``, for msgspec."""
    return {
        name: getattr(m, name)
        for info in annotated.__metadata__
        for m in info.metadata
        for name in ("ge", "le")
        if hasattr(m, name)
    }


_ID = re.compile(_unanchored(ID_PATTERN)).fullmatch
_VERSION = re.compile(_unanchored(VERSION_PATTERN)).fullmatch
_TS = re.compile(
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    r"T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?"
    r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
).fullmatch
"""The RFC 3339 form the gateway writes (pydantic's), every part in its range (for the
offset too: ``fromisoformat`` takes "+00:60", pydantic does not); other forms pydantic takes
(a space, seven fraction digits, a number) go the slow way, where they decode as pydantic
decodes them (msgspec's own datetime rounds a seventh digit, pydantic truncates)."""

_VALID_CAP = 100_000
_valid_ids: dict[str, bytes] = {}
"""Adapter ids that matched their pattern, each with its UTF-8 form (the log's Kafka key
must equal it); they repeat on every log of an adapter."""
_valid_versions: dict[str, None] = {}
"""Versions that matched theirs. Both emptied when full, so hostile ids cost a pattern
each, not memory."""
_seconds: dict[str, int] = {}
"""The gateway's ``ts`` up to the second (``YYYY-MM-DDTHH:MM:SS``) that matched ``_TS`` with
a ``Z``, each with its microseconds since the epoch: the logs of one second share it, so
most logs skip the pattern and the parse (``fast_demand``). Emptied when full too."""
_US = 1_000_000
_hashes: dict[str, int] = {}
"""Adapter ids with Kafka's partition hash of their key (``toPositive(murmur2(key))``), which a
log's partition must follow. Emptied when full too."""


class _Demand(msgspec.Struct, gc=False):
    """RequestDemand's fields, types and defaults for msgspec (checked against RequestDemand
    in the tests); the string patterns are checked after decoding (``fast_demand``): msgspec's
    own pattern check costs ~1 us a field. Other fields are ignored, as there."""

    ts: str
    event_id: str
    adapter_id: str
    tier_at_arrival: Tier
    schema_version: Literal[1] = 1
    adapter_version: str | None = None
    request_class: RequestClass = RequestClass.interactive
    ttft_ms: Annotated[float, msgspec.Meta(**_bounds(NonNegativeMs))] | None = None
    status: RequestStatus = RequestStatus.ok


_decode_fast = msgspec.json.Decoder(_Demand).decode
_fromisoformat = datetime.fromisoformat

Row = tuple[str, str, str | None, SampleRow]
"""One decoded log as the fold reads it: event_id, adapter_id, adapter_version, the sample
(``ts`` as epoch seconds)."""


def fast_demand(raw: bytes | None, key: bytes | None) -> Row | None:
    """The fields of a log, or None where the fast path cannot prove them valid (the caller
    asks ``demand_of``). Never accepts what ``demand_of`` refuses, key mismatch included."""
    # A request log is flat ASCII JSON: one "{", no "[". Anything else goes the slow way,
    # where pydantic refuses what msgspec would take: invalid UTF-8 in an ignored field, an
    # ignored field nested deeper than pydantic's recursion limit.
    if (
        raw is None
        or len(raw) > MAX_MESSAGE_BYTES
        or not raw.isascii()
        or b"[" in raw
        or raw.find(b"{", 1) != -1
    ):
        return None
    try:
        d = _decode_fast(raw)
    except msgspec.MsgspecError:
        return None
    adapter_id, version, stamp = d.adapter_id, d.adapter_version, d.ts
    if (encoded := _valid_ids.get(adapter_id)) is None:
        if not _ID(adapter_id):
            return None
        encoded = _remember(_valid_ids, adapter_id, adapter_id.encode())
    if key != encoded:
        return None
    if version is not None and version not in _valid_versions:
        if not _VERSION(version):
            return None
        _remember(_valid_versions, version, None)
    if not _ID(d.event_id):
        return None
    # The gateway's form, ``YYYY-MM-DDTHH:MM:SS.ffffffZ``: its second looked up, its
    # fraction added as ``timestamp()`` does (integer microseconds / 10**6, so the same
    # float). Any other form: the pattern and the parse.
    if (
        len(stamp) == 27
        and stamp[19] == "."
        and stamp[26] == "Z"
        and (frac := stamp[20:26]).isdigit()
        and frac.isascii()
        and (second := _seconds.get(stamp[:19]) or _second_of(stamp[:19])) is not None
    ):
        ts = (second + int(frac)) / _US
    elif not _TS(stamp):
        return None
    else:
        try:
            ts = _fromisoformat(stamp).timestamp()
        except ValueError:  # a day or an hour out of range
            return None
    return (
        d.event_id,
        adapter_id,
        version,
        (ts, d.request_class._value_, d.tier_at_arrival, d.status, d.ttft_ms),
    )


def _second_of(prefix: str) -> int | None:
    """Microseconds since the epoch of ``prefix`` + ``Z`` (None where ``_TS`` or the
    parse refuses it), remembered in ``_seconds``."""
    stamp = prefix + "Z"
    if not _TS(stamp):
        return None
    try:
        moment = _fromisoformat(stamp)
    except ValueError:
        return None
    micros: int = (moment - _EPOCH) // _MICROSECOND
    _remember(_seconds, prefix, micros)
    return micros


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def _remember(valid: dict[str, Any], value: str, form: Any) -> Any:
    if len(valid) >= _VALID_CAP:
        valid.clear()
    valid[value] = form
    return form


def row_of(d: RequestDemand) -> Row:
    """The row of a log pydantic validated (what ``fast_demand`` returns for it)."""
    return (
        d.event_id,
        d.adapter_id,
        d.adapter_version,
        (d.ts.timestamp(), d.request_class.value, d.tier_at_arrival, d.status, d.ttft_ms),
    )


def demand_of(message: KafkaMessage) -> RequestDemand:
    """The request's demand fields, validated; a log whose Kafka key is not its adapter_id is
    refused too (its score would live on the wrong partition)."""
    demand = decode(RequestDemand, message.value())
    key = message.key()
    if key != demand.adapter_id.encode():
        raise SchemaError(
            DecodeReason.key_mismatch,
            [("(key)", f"Kafka key {key!r} is not adapter_id {demand.adapter_id}")],
        )
    return demand


def _wrong_partition(adapter_id: str, partition: int, counts: Sequence[int]) -> SchemaError:
    where = " or ".join(str(p) for p in dict.fromkeys(partition_of(adapter_id, n) for n in counts))
    return SchemaError(
        DecodeReason.wrong_partition,
        [("(partition)", f"a log keyed {adapter_id} is on partition {partition}, not {where}")],
    )


def fold_batch(
    states: Mapping[str, Flat | ScoreState],
    messages: Iterable[KafkaMessage],
    known: Known,
    recent: RecentIds | None = None,
    *,
    now: float | None = None,
    counts: Sequence[int] = (),
) -> Folded:
    """Fold ``messages`` (in consumption order) into ``states`` (the keeper's ``Flat``
    states, or ``ScoreState``s, converted once per touched key), which is not modified;
    only keys ``known`` admits are touched; ``recent`` is not modified either (the caller
    adds ``counted`` after its commit). A log stamped after ``now`` (epoch seconds of the
    folder's clock; None: no bound) counts as of ``now``: one stamp years ahead would
    otherwise set the counters' time past every later log's and freeze the score.
    ``counts``: the requests topic's partition counts a log's partition may follow (its
    key's hash modulo one of them: the broker's count, and the counts before a grow, which
    producers go on using until they refresh their metadata); a log on another partition
    is refused as ``wrong_partition``. Empty: no check.

    Why one loop with local lookups: this runs per request log; the samples are grouped
    per (adapter, version) and each group is folded once (``Flat.observe_many``), and the key of
    a group is asked of ``known`` once per batch (a group's key is ``score_key`` of its
    pair, one key per pair, so grouping by pair is grouping by key)."""
    out = Folded()
    groups: dict[tuple[str, str | None], list[SampleRow]] = {}
    seen_before: dict[int, Set[str]] = {}
    in_batch: dict[int, set[str]] = {}
    counted_on, refused_logs, fast, hashes = out.ids, out.refused, fast_demand, _hashes
    refused = RequestStatus.refused
    last_partition: int | None = None
    before: Set[str] = _NONE
    batch_ids: set[str] = set()
    counted: list[str] = []
    duplicates, unknown, unknown_last = 0, 0, None
    latest_ts = math.inf if now is None else now
    count, earlier = (counts[0], counts[1:]) if counts else (0, ())
    for message in messages:
        row = fast(message.value(), message.key())
        if row is None:
            try:
                row = row_of(demand_of(message))
            except SchemaError as exc:
                refused_logs.append((message, exc))
                continue
        event_id, adapter_id, version, sample = row
        partition = message.partition() or 0
        if counts:
            if (hashed := hashes.get(adapter_id)) is None:
                hashed = _remember(hashes, adapter_id, key_hash(adapter_id))
            if hashed % count != partition and all(hashed % n != partition for n in earlier):
                refused_logs.append((message, _wrong_partition(adapter_id, partition, counts)))
                continue
        if sample[0] > latest_ts:
            sample = (latest_ts, *sample[1:])
        if partition != last_partition:
            last_partition = partition
            if partition not in seen_before:
                seen_before[partition] = _NONE if recent is None else recent.ids_on(partition)
                in_batch[partition], counted_on[partition] = set(), []
            before, batch_ids = seen_before[partition], in_batch[partition]
            counted = counted_on[partition]
        if event_id in batch_ids or event_id in before:
            duplicates += 1
            continue
        batch_ids.add(event_id)
        counted.append(event_id)
        if sample[3] is refused:
            unknown += 1
            if unknown_last is None or sample[0] > unknown_last:
                unknown_last = sample[0]
        elif (group := groups.get((adapter_id, version))) is None:
            groups[adapter_id, version] = [sample]
        else:
            group.append(sample)
    for (adapter_id, version), group in groups.items():
        if not known.admits(adapter_id, version):
            unknown += len(group)
            latest = max(sample[0] for sample in group)
            if unknown_last is None or latest > unknown_last:
                unknown_last = latest
            continue
        key = score_key(adapter_id, version)
        if (state := states.get(key)) is None:
            state = _EMPTY
        elif isinstance(state, ScoreState):
            state = Flat.of(state)
        out.flat[key], burst = state.observe_many(group)
        if burst:
            out.bursts.append(key)
    out.duplicates, out.unknown, out.unknown_last = duplicates, unknown, unknown_last
    return out
