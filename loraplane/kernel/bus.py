"""Synchronous produce and read-to-idle on Kafka, for CLI publishers, the worker agent and
tests (clients come from ``kernel.kafka``). confluent-kafka (librdkafka) is used because it
is the fastest Python client and gives real delivery reports for ``acks=all``.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from loraplane.kernel import kafka
from loraplane.kernel.command_partition import partition_of
from loraplane.kernel.config import Settings
from loraplane.schemas.codec import encode

__all__ = [
    "MOVED_HEADER",
    "READ_FETCH_WAIT_MS",
    "DeliveryError",
    "Headers",
    "KeyHomes",
    "ProducerSink",
    "Record",
    "TopicReadIncomplete",
    "end_offsets",
    "keys_on_several_partitions",
    "keys_spread",
    "latest_per_key",
    "moved_away",
    "produce_sync",
    "read_since",
    "read_topic",
    "record_of",
    "replaces",
]


class DeliveryError(RuntimeError):
    """The broker did not acknowledge a message (the text says why)."""


def produce_sync(
    settings: Settings,
    topic: str,
    key: str | bytes | None,
    value: BaseModel | bytes,
    headers: dict[str, str] | None = None,
    timeout_s: float = 20.0,
    *,
    producer: Any | None = None,
) -> tuple[int, int]:
    """Produce one message and wait for the broker's acknowledgement (acks=all).

    Returns ``(partition, offset)``; raises DeliveryError when not acknowledged in time.
    ``producer``: one from ``kernel.kafka.producer`` to send through, for a caller sending
    several; a fresh one is made otherwise, and a fresh idempotent producer needs ~0.5 s
    (its producer id from the broker) before its first message is acknowledged.
    """
    p = producer if producer is not None else kafka.producer(settings)
    result: dict[str, Any] = {}

    def on_delivery(err: Any, msg: Any) -> None:
        result["err"], result["msg"] = err, msg

    payload = value if isinstance(value, bytes) else encode(value)
    p.produce(
        topic,
        key=key,
        value=payload,
        headers=list((headers or {}).items()),
        on_delivery=on_delivery,
    )
    p.flush(timeout_s)
    if "err" not in result:
        raise DeliveryError(
            f"no acknowledgement from {settings.kafka.bootstrap} for {topic} "
            f"within {timeout_s:.0f}s (is the broker up? `loraplane stack status`)"
        )
    if result["err"] is not None:
        raise DeliveryError(f"broker refused message for {topic}: {result['err']}")
    return result["msg"].partition(), result["msg"].offset()


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]
    timestamp_ms: int


Headers = dict[str, str | bytes | None] | list[tuple[str, str | bytes | None]] | None


def _headers(raw: Headers) -> dict[str, bytes]:
    """A consumed message's headers as bytes (a header without a value reads as empty)."""
    pairs = raw.items() if isinstance(raw, dict) else raw or []
    return {k: v.encode() if isinstance(v, str) else v or b"" for k, v in pairs}


def record_of(msg: Any, topic: str = "") -> Record:
    """A consumed confluent-kafka message as a Record (``topic`` when it names none)."""
    return Record(
        msg.topic() or topic,
        msg.partition() or 0,
        msg.offset() or 0,
        msg.key(),
        msg.value(),
        _headers(msg.headers()),
        msg.timestamp()[1],
    )


READ_FETCH_WAIT_MS = 100
"""How long the broker holds ``read_topic``'s fetch that found nothing. The end of a
partition is seen (its EOF event) only when a fetch answers empty: at librdkafka's default
(500 ms) each read ended half a second after its last record, and a partition written
more often than every 500 ms (heartbeats of a few workers) never answered empty, so a read
of the worker states ran to its timeout (10 s) and reported itself incomplete."""


def replaces(record: Record, held: Record | None, partitions: int) -> bool:
    """Whether ``record`` stands for its key of a compacted topic instead of ``held``, the
    record of the same topic and key read before it (None: none), the topic having
    ``partitions`` partitions (0: not known). On one partition the later offset stands
    (a record read again stands too). Across partitions there is no order: after a grow a
    key's records before it stay on its old partition (compaction is per partition) and the
    later ones go to its home under the new count (``command_partition.partition_of``), so
    a record there is never replaced by one off it, whichever of them is read first; a
    record off its home stands while nothing of its home was read (a key not written since
    the grow, or a producer not yet hashing over the new count)."""
    if held is None:
        return True
    if held.partition == record.partition:
        return record.offset >= held.offset
    if partitions < 1:
        return True
    home = partition_of(record.key or b"", partitions)
    return not (held.partition == home and record.partition != home)


def keys_on_several_partitions(records: Iterable[Record]) -> int:
    """How many keys of a compacted topic read whole hold a record on more than one
    partition, one of them a value, as a grow leaves a key written since: its record before
    the grow on its old partition, its later ones on its home. A removal (a tombstone) last
    on a partition is held there (readers rank it as any record: a grow that makes another
    partition the key's home could rank an older value there over it); a moved tombstone
    (``moved_away``) leaves nothing of the key on its partition."""
    last: dict[tuple[bytes, int], Record] = {}
    for record in records:
        last[(record.key or b"", record.partition)] = record
    held: dict[bytes, list[Record]] = {}
    for (key, _), record in last.items():
        if not moved_away(record):
            held.setdefault(key, []).append(record)
    return sum(1 for rs in held.values() if len(rs) > 1 and any(r.value is not None for r in rs))


def keys_spread(settings: Settings, topic: str, timeout: float) -> int:
    """``keys_on_several_partitions`` of ``topic`` read whole now (``topics.apply``'s check
    before growing a ``grows_once`` topic). Raises ``kafka.KafkaUnavailable`` when the
    topic is not read to its end: nothing is grown on a guess."""
    from confluent_kafka import KafkaException

    try:
        return keys_on_several_partitions(
            read_topic(settings, topic, timeout_s=timeout, to_end=True, quiet=True)
        )
    except (TopicReadIncomplete, KafkaException) as exc:
        raise kafka.KafkaUnavailable(
            f"{topic} not grown: it was not read to its end to check that each key's "
            f"records lie on one partition: {exc}"
        ) from None


def latest_per_key(
    records: Iterable[Record], counts: Mapping[str, int], unhashed: Collection[str] = ()
) -> dict[tuple[str, bytes], Record]:
    """The record that stands for each (topic, key) of compacted topics read whole
    (``replaces``; a tombstone is the key's record too), in the order they were read.
    ``counts``: each topic's partition count, looked up as each record comes
    (``read_topic``'s ``partition_counts``, filled before the first); ``unhashed``: topics
    whose keys are not placed by their own hash (``scores``: on their adapter's requests
    partition), judged as if no count were known."""
    latest: dict[tuple[str, bytes], Record] = {}
    for record in records:
        key = (record.topic, record.key or b"")
        held = latest.get(key)
        count = 0 if record.topic in unhashed else counts.get(record.topic, 0)
        if replaces(record, held, count):
            latest.pop(key, None)
            latest[key] = record
    return latest


MOVED_HEADER = "loraplane-moved-to"
"""The header of a tombstone a writer leaves on its key's previous partition of a compacted
topic once its records go to another (a topic grown: ``KeyHomes``); its value is the new
partition's number. Compaction then removes the record left there; a reader skips such a
tombstone without a fault (``moved_away``): it removes nothing, its key lives on."""


def moved_away(record: Record) -> bool:
    """Whether ``record`` is a tombstone its key's writer left on the key's previous
    partition (``MOVED_HEADER``): not a removal of the key, nor a record off its home to
    refuse; it clears what its partition held of the key."""
    return record.value is None and MOVED_HEADER in record.headers


class KeyHomes:
    """Where a writer's records of compacted topics were last delivered, per (topic, key),
    so that a key's record delivered to another partition than its previous one (the
    producer learned a grown count) names that partition: the writer leaves a tombstone
    there (``MOVED_HEADER``) and compaction removes the records left behind. ``order``: the
    record's place in the writer's sends, so a report of an older send that comes late (the
    partitions answer apart) moves nothing back. Holds the keys the writer writes (a worker
    its id, a router its id); a tombstone of its own forgets the key. Not thread-safe."""

    def __init__(self) -> None:
        self._at: dict[tuple[str, bytes], tuple[int, int]] = {}  # -> (partition, order)

    def delivered(
        self, topic: str, key: bytes, partition: int, order: int, tombstone: bool = False
    ) -> int | None:
        """The key's record sent ``order``-th was delivered to ``partition``: the partition
        its previous record was delivered to when that is another one (None: none, the
        same, or this record was sent before that one)."""
        held = self._at.get((topic, key))
        if held is not None and held[1] > order:
            return None
        if tombstone:
            self._at.pop((topic, key), None)
            return None
        self._at[(topic, key)] = (partition, order)
        return held[0] if held is not None and held[0] != partition else None


class TopicReadIncomplete(RuntimeError):
    """A read that had to reach the end of a topic did not within its time (the broker is
    away, or slow): what was read is not the whole topic."""


def read_topic(
    settings: Settings,
    topic: str | Sequence[str],
    *,
    timeout_s: float = 10.0,
    idle_s: float = 1.5,
    to_end: bool = False,
    quiet: bool = False,
    partition_counts: dict[str, int] | None = None,
) -> Iterator[Record]:
    """Read a topic (or several at once, one consumer) from the beginning until every
    assigned partition has reached its end and nothing came for ``idle_s`` (or timeout).

    For CLIs and tests that need "everything so far"; every partition is assigned from its
    beginning (no group joined), no offsets are committed. Idle time
    alone never ends a read: on a loaded machine a 64-partition topic can take longer than
    ``idle_s`` to be assigned and fetched, and an early return then read as "no records". With
    ``to_end`` the read ends as soon as every partition has reached its end, and raises
    ``TopicReadIncomplete`` when that did not happen in ``timeout_s``: a caller that
    replaces state with what it read (the worker's registry) can tell a broker that is
    away from a topic that is empty. ``quiet``: librdkafka does not log every reconnect
    attempt (a CLI that reports the failure itself). ``partition_counts``: filled, before
    the first record, with each topic's partition count as the broker reports it (a reader
    that checks records are on their key's partition: ``worker_states.at_home``); a topic
    the broker does not know gets none (it holds no record to check).
    """
    from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

    consumer = kafka.consumer(
        settings,
        f"loraplane-reader-{time.monotonic_ns()}",  # never joined: partitions are assigned
        read_to_end=True,
        quiet=quiet,
        fetch_wait_ms=READ_FETCH_WAIT_MS,
    )
    at_end: set[tuple[str, int]] = set()
    try:
        names = [topic] if isinstance(topic, str) else list(topic)
        deadline = time.monotonic() + timeout_s
        try:
            known = _partitions(consumer, names, deadline)
        except KafkaException as exc:  # the broker away: nothing read, as a subscribe's
            if to_end or partition_counts is not None:
                raise TopicReadIncomplete(f"{topic}: no partitions: {exc}") from exc
            return
        if partition_counts is not None:
            partition_counts.update({name: len(parts) for name, parts in known.items()})
        # every partition assigned from its beginning: no group to join (a subscribe's join
        # and first rebalance took ~1 s of every read), nothing committed
        try:
            consumer.assign(
                [TopicPartition(n, p, OFFSET_BEGINNING) for n, ps in known.items() for p in ps]
            )
        except KafkaException as exc:
            if to_end:
                raise TopicReadIncomplete(f"{topic}: not assigned: {exc}") from exc
            return
        last = time.monotonic()
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                assigned = consumer.assignment()
                if (
                    assigned
                    and {(tp.topic, tp.partition) for tp in assigned} <= at_end
                    and (to_end or time.monotonic() - last > idle_s)
                ):
                    return
                continue
            if (err := msg.error()) is not None:
                if err.code() == -191:  # _PARTITION_EOF
                    at_end.add((msg.topic() or "", msg.partition() or 0))
                    continue
                raise KafkaException(err)
            last = time.monotonic()
            at_end.discard((msg.topic() or "", msg.partition() or 0))
            yield record_of(msg, names[0])
        if to_end:
            raise TopicReadIncomplete(
                f"{topic}: the end was not reached within {timeout_s:.0f}s "
                f"(is {settings.kafka.bootstrap} up?)"
            )
    finally:
        consumer.close()


def _partitions(consumer: Any, names: Sequence[str], deadline: float) -> dict[str, list[int]]:
    """The partitions of each topic in ``names`` the broker knows (one it does not know, or
    that has none, holds no record: left out, as a subscribe leaves it unassigned). Any
    other error of a topic's metadata (its leader not elected yet, just created; a describe
    not authorized) leaves out a topic that may hold records: it is asked again until
    ``deadline``, then raised (``KafkaException``, as a broker away)."""
    from confluent_kafka import KafkaError, KafkaException

    unknown = {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC}
    out: dict[str, list[int]] = {}
    for name in names:
        while True:
            left = max(deadline - time.monotonic(), 0.1)
            meta = consumer.list_topics(name, timeout=left).topics.get(name)
            if meta is None or (meta.error is not None and meta.error.code() in unknown):
                break
            if meta.error is None:
                if meta.partitions:
                    out[name] = sorted(meta.partitions)
                break
            if time.monotonic() >= deadline:
                raise KafkaException(meta.error)
            time.sleep(0.2)
    return out


def end_offsets(settings: Settings, topic: str, *, timeout_s: float = 10.0) -> dict[int, int]:
    """The next offset of every partition of ``topic`` now: where a read of only what is
    written from here on starts (``read_since``). Raises ``KafkaUnavailable`` when the
    broker does not answer within ``timeout_s``."""
    from confluent_kafka import KafkaException, TopicPartition

    consumer = kafka.consumer(settings, f"loraplane-reader-ends-{time.monotonic_ns()}", quiet=True)
    try:
        meta = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if meta is None or meta.error is not None:
            raise kafka.KafkaUnavailable(f"{topic}: {meta.error if meta else 'no such topic'}")
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)[1]
            for p in sorted(meta.partitions)
        }
    except KafkaException as exc:
        raise kafka.KafkaUnavailable(f"{settings.kafka.bootstrap}: {exc}") from None
    finally:
        consumer.close()


def read_since(
    settings: Settings, topic: str, offsets: dict[int, int], *, timeout_s: float
) -> Generator[Record]:
    """The records of ``topic`` from ``offsets`` (``end_offsets`` taken earlier) on, as
    they arrive, until the caller stops or ``timeout_s`` passed. Partitions are assigned,
    not subscribed: no group, nothing committed, no rebalance to wait for."""
    from confluent_kafka import KafkaException, TopicPartition

    consumer = kafka.consumer(
        settings, f"loraplane-reader-since-{time.monotonic_ns()}", read_to_end=True, quiet=True
    )
    try:
        consumer.assign([TopicPartition(topic, p, o) for p, o in offsets.items()])
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = consumer.poll(min(0.5, left))
            if msg is None:
                continue
            if (err := msg.error()) is not None:
                if err.code() == -191:  # _PARTITION_EOF: caught up, more may come
                    continue
                if err.fatal():
                    raise KafkaException(err)
                continue  # librdkafka retries a transient error by itself
            yield record_of(msg, topic)
    finally:
        consumer.close()


class ProducerSink:
    """An ``EventSink`` (``loraplane.registry.live``) straight onto Kafka, without a spool:
    for the stream processors, whose refused registry records are dead letters of a
    record that stays on its topic (a lost one is written again on the next refusal)."""

    def __init__(self, settings: Settings, client_id: str = kafka.CLIENT_ID) -> None:
        self.settings = settings
        self.producer = kafka.producer(settings, client_id=client_id)

    def emit(self, topic_suffix: str, key: str, message: BaseModel) -> None:
        from loraplane.kernel.topics import topic_name

        self.producer.produce(
            topic_name(self.settings, topic_suffix), key=key.encode(), value=encode(message)
        )
        self.producer.poll(0)
