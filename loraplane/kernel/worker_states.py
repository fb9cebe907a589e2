"""The latest heartbeat of every worker and every fleet router, read from the compacted
worker-state and router-state topics (key = worker_id / router_id) in one pass of one
consumer, so both are as old as each other: for ``loraplane fleet status``, the dashboard's
fleet panel and the demo, which all show or wait on ``router.fleet_view`` of them. The
router keeps its own live consumer.

The read ends once every partition is at its end (live processes keep beating, so waiting
for the topics to go idle would never end before the timeout); past ``timeout_s`` what was
read so far is used and ``complete`` says it was cut.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from loraplane.kernel import kafka
from loraplane.kernel.bus import MOVED_HEADER, Record, TopicReadIncomplete, moved_away, read_topic
from loraplane.kernel.command_partition import partition_of
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.schemas.codec import SchemaError, decode
from loraplane.schemas.reasons import DecodeReason
from loraplane.schemas.router_state import RouterState
from loraplane.schemas.worker_state import WorkerState

__all__ = [
    "AtHome",
    "FleetStates",
    "Placed",
    "at_home",
    "clear_left_behind",
    "latest_fleet_states",
    "router_state_of",
    "worker_state_of",
]

Placed = tuple[int, int]
"""Where a record was read: its partition and its topic's partition count."""


def at_home(key: bytes | None, placed: Placed | None) -> None:
    """Raise ``SchemaError`` (``wrong_partition``) unless a record keyed ``key`` read at
    ``placed`` is on the partition its key hashes to (``command_partition.partition_of``,
    where Kafka's producers place a key; None: not checked). A compacted record elsewhere
    is never replaced or tombstoned by its key's own records, which go to that partition:
    it would stay a ghost of its id after the id's own tombstone, or outlive a newer state.
    Tombstones are checked too: one elsewhere would remove a state that still stands."""
    if placed is None:
        return
    partition, partitions = placed
    if partitions > 0 and partition != (home := partition_of(key or b"", partitions)):
        raise SchemaError(
            DecodeReason.wrong_partition,
            [
                (
                    "(partition)",
                    f"a record keyed {(key or b'')[:64]!r} is on {partition}, not {home}",
                )
            ],
        )


class AtHome:
    """The records of a whole read of the worker- and router-state topics that are on their
    key's partition (``at_home``) under each topic's count (``counts``: ``read_topic``'s
    ``partition_counts``, looked up as each record comes). A record off it is refused and
    counted in ``misplaced``, unless a tombstone its writer left on that partition after a
    grow (``bus.moved_away``) comes later: that key's record there is what the grow left
    behind, cleared (compaction removes it), and neither counts; such a tombstone removes
    nothing. ``only``: the topics checked (None: all); the others' records pass."""

    def __init__(self, counts: Mapping[str, int], only: Collection[str] | None = None) -> None:
        self._counts = counts
        self._only = only
        self._off: dict[tuple[str, int, bytes], None] = {}  # refused, not cleared since

    @property
    def misplaced(self) -> int:
        return len(self._off)

    def __call__(self, records: Iterable[Record]) -> Iterator[Record]:
        for record in records:
            if self._only is not None and record.topic not in self._only:
                yield record
                continue
            where = (record.topic, record.partition, record.key or b"")
            if moved_away(record):
                self._off.pop(where, None)
                continue
            try:
                at_home(record.key, (record.partition, self._counts.get(record.topic, 0)))
            except SchemaError:
                self._off[where] = None
                continue
            yield record


def worker_state_of(key: bytes | None, value: bytes, placed: Placed | None = None) -> WorkerState:
    """One worker-state record, decoded, whose Kafka key is its worker_id (a state under
    another worker's key would stand in for that worker) and which is on that key's
    partition (``at_home``); ``SchemaError`` with its reason otherwise. The router and the
    planner read the topic through this."""
    at_home(key, placed)
    state = decode(WorkerState, value)
    _under_own_key(key, "worker_id", state.worker_id)
    return state


def router_state_of(key: bytes | None, value: bytes, placed: Placed | None = None) -> RouterState:
    """One router-state record, decoded, whose Kafka key is its router_id (a record under
    another key is never replaced by that router's own) and which is on that key's partition
    (``at_home``); ``SchemaError`` otherwise."""
    at_home(key, placed)
    state = decode(RouterState, value)
    _under_own_key(key, "router_id", state.router_id)
    return state


def _under_own_key(key: bytes | None, field: str, own: str) -> None:
    """A compacted record counts only under its own id: one under another key is never
    replaced or tombstoned by that id's own records."""
    if (key or b"") != own.encode():
        raise SchemaError(
            DecodeReason.key_mismatch, [(field, f"message key {(key or b'')[:64]!r} is not {own}")]
        )


@dataclass(frozen=True)
class FleetStates:
    workers: dict[str, WorkerState]  # worker_id -> its last state (a tombstoned one is gone)
    routers: dict[str, RouterState] = field(default_factory=dict)  # router_id -> its last
    # records that did not decode, not under their own id, or not on their key's partition:
    # counted
    malformed: int = 0
    complete: bool = True  # False: the timeout cut the read short


def latest_fleet_states(settings: Settings, timeout_s: float = 10.0) -> FleetStates:
    """Each key's last record of both topics, on its key's partition (``AtHome``: one
    elsewhere is counted as malformed, and neither replaces nor removes the key's own,
    unless its writer cleared it after a grow)."""
    workers_topic = topic_name(settings, "worker-state")
    latest: dict[tuple[str, bytes], bytes | None] = {}
    complete = True
    counts: dict[str, int] = {}
    malformed = 0
    home = AtHome(counts)
    try:
        for record in home(
            read_topic(
                settings,
                [workers_topic, topic_name(settings, "router-state")],
                timeout_s=timeout_s,
                to_end=True,
                partition_counts=counts,
            )
        ):
            latest[(record.topic, record.key or b"")] = record.value
    except TopicReadIncomplete:
        complete = False
    malformed += home.misplaced
    workers: dict[str, WorkerState] = {}
    routers: dict[str, RouterState] = {}
    for (topic, key), value in latest.items():
        if value is None:
            continue
        try:
            if topic == workers_topic:
                w = worker_state_of(key, value)
                workers[w.worker_id] = w
            else:
                r = router_state_of(key, value)
                routers[r.router_id] = r
        except SchemaError:
            malformed += 1
    return FleetStates(workers, routers, malformed, complete)


def clear_left_behind(settings: Settings, topic: str, partitions: int, timeout: float) -> int:
    """After ``topic`` (worker or router states) grew to ``partitions``: a tombstone with
    ``bus.MOVED_HEADER`` on each partition for each key whose last record there is off its
    home under the new count (a state written before the grow, of workers not running
    too), so the readers, which refuse it (``at_home``), no longer meet it once compaction
    removed it; the tombstone removes nothing. A writer still hashing over the old count
    clears what it writes there itself (``bus.KeyHomes``). ``topics.apply``'s
    ``clear_grown``; returns how many were cleared. Raises ``kafka.KafkaUnavailable``
    (what ``topics apply`` and ``stack up`` report) when the topic is not read to its end
    or the tombstones are not acknowledged."""
    from confluent_kafka import KafkaException

    last: dict[tuple[int, bytes], bytes | None] = {}
    try:
        for record in read_topic(settings, topic, timeout_s=timeout, to_end=True, quiet=True):
            last[(record.partition, record.key or b"")] = record.value
    except (TopicReadIncomplete, KafkaException) as exc:
        raise kafka.KafkaUnavailable(
            f"{topic} grew to {partitions} partitions, but the states left off their new "
            f"partitions were not read to clear them: {exc}"
        ) from None
    left = [
        (p, key)
        for (p, key), value in last.items()
        if value is not None and p != partition_of(key, partitions)
    ]
    if left:
        producer = kafka.producer(settings, quiet=True)
        for p, key in left:
            home = str(partition_of(key, partitions)).encode()
            producer.produce(
                topic, key=key, value=None, partition=p, headers=[(MOVED_HEADER, home)]
            )
            producer.poll(0)
        if producer.flush(timeout):
            raise kafka.KafkaUnavailable(f"{topic}: the tombstones of a grow not acknowledged")
    return len(left)
