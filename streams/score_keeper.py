"""The scoring keeper: request logs in, per adapter-version score state out, in batches, on
as many processes as there are requests partitions to share.

It consumes and produces with confluent-kafka itself, not Faust: it is the busiest consumer
of the system. It runs as its own process (``loraplane streams scoring``) or as a thread of
the Faust worker (``streams.scoring_agent``), every keeper in the consumer group
``{prefix}-scoring``. Each batch of up to ``BATCH`` logs is folded by the pure
``streams.score_fold.fold_batch`` (event time: the log's own ``ts``); then one Kafka
transaction writes every touched score key once to the compacted ``scores`` topic, refused
logs to the dead-letter topic, and the batch's offsets. A score key lives on the scores
partition numbered as its logs' requests partition, so a keeper owns exactly the keys of
its assigned partitions and reads back only those; only versions its own verified registry
tail lists get a key (``streams.score_admission``).

docs/planner.md (the keeper and its bounded state), docs/scale.md ("Scoring processes") and
docs/reliability.md ("A scoring process joins, leaves or is killed -9 under load", "Kafka
broker restarted") give the rules: exactly once across handovers, fencing, broker restarts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import groupby
from operator import methodcaller
from typing import TYPE_CHECKING, Any

from loraplane.kernel import collector, kafka
from loraplane.kernel.bus import ProducerSink
from loraplane.kernel.command_partition import broker_partitions
from loraplane.kernel.config import Settings
from loraplane.kernel.progress import Progress, Watchdog
from loraplane.kernel.topics import topic_name
from loraplane.kernel.transactions import STEP_TIMEOUT_S, send_offsets, transact
from loraplane.registry.live import CHECKPOINTS_FILE, VerifiedRegistry
from loraplane.registry.topic import registry_tail
from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.dead_letter import dead_letter_for
from loraplane.schemas.keyring import KeyringFile
from loraplane.schemas.reasons import DecodeReason
from loraplane.schemas.score_snapshot import (
    ScoreSnapshot,
    UnknownTally,
    is_unknown_key,
    unknown_key,
)
from loraplane.streams.score_admission import Known, score_key_of, stale_keys
from loraplane.streams.score_fold import Folded, RecentIds, demand_of, fold_batch
from loraplane.streams.scores import Flat, ScoreState, from_snapshot

if TYPE_CHECKING:
    from loraplane.kernel.topic_tail import TopicTail

__all__ = [
    "BATCH",
    "CLIENT_ID",
    "COMPONENT",
    "KEYRING_CHECK_S",
    "LINGER_S",
    "PARTITIONS_EVERY_S",
    "POLL_S",
    "RECENT",
    "REGISTRY_WAIT_S",
    "RESTORE_TIMEOUT_S",
    "RETRY_S",
    "SESSION_TIMEOUT_MS",
    "TRANSACTION_TIMEOUT_MS",
    "PartitionMismatch",
    "ScoreKeeper",
    "ScoresRead",
    "default_instance",
    "read_back",
    "recent_ids",
    "restore",
]

log = logging.getLogger(__name__)

BATCH = 10_000
"""Most logs per batch (one transaction); a batch is its first log and whatever arrives
within LINGER_S after it (a backlog: at once)."""
POLL_S = 0.05
"""How long an idle keeper waits for a log before its other duties (registry, progress)."""
LINGER_S = 0.01
"""How long a batch gathers logs after its first: the most a burst's first log waits to be
folded, against one transaction per batch."""
RETRY_S = 2.0
"""Pause before a new session after a Kafka error (broker down, fenced, rebalanced)."""
CLIENT_ID = "loraplane-scoring"
COMPONENT = "scoring"
RESTORE_TIMEOUT_S = 120.0
"""Reading the scores topic back gives up (and the session restarts) after this long."""
RECENT = 20_000
"""Event ids remembered per requests partition (``RecentIds``): a duplicate at most this many
logs of its partition behind its original is counted once."""
REGISTRY_WAIT_S = 10.0
"""How long a batch with unknown logs waits for the registry tail to reach the topic's ends
as of after the batch; past it the session restarts (never judged on an older view)."""
KEYRING_CHECK_S = 1.0
"""How often the registry is re-verified without a change on the topic (a new keyring)."""
TRANSACTION_TIMEOUT_MS = 15_000
"""The broker aborts a transaction left open this long (a keeper killed mid-batch): the
longest a handover to another process waits for a dead one's batch. Not below the
producer's ``message.timeout.ms`` (librdkafka refuses that)."""
SESSION_TIMEOUT_MS = 10_000
"""A killed keeper's partitions move to the others after this long."""


PARTITIONS_EVERY_S = 5.0
"""How often, at most, a log refused as ``wrong_partition`` makes the keeper ask the broker
for the requests topic's partition count again (a grown topic: the batch is folded again)."""

_PARTITION = methodcaller("partition")
_ERROR = methodcaller("error")


class PartitionMismatch(RuntimeError):
    """The requests and scores topics have different partition counts: the scores of
    requests partition p could not live on scores partition p. Not retried."""


def default_instance() -> str:
    """``host-pid``: unique among running keepers (a restart is a new instance, its
    predecessor's open transaction ends by ``TRANSACTION_TIMEOUT_MS``)."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class ScoresRead:
    """What ``read_back`` found, by scores partition (== requests partition)."""

    states: dict[int, dict[str, ScoreState]] = field(default_factory=dict)
    unknown: dict[int, UnknownTally] = field(default_factory=dict)
    # keys that are not UTF-8 text (``score_key_of``) whose last record is not a tombstone:
    # refused, and tombstoned under their own bytes by the partition's keeper
    undecodable: dict[int, set[bytes]] = field(default_factory=dict)

    def merged(self) -> dict[str, ScoreState]:
        """Every score key's state, whichever partition holds it."""
        return {k: s for part in self.states.values() for k, s in part.items()}

    def unknown_total(self) -> UnknownTally:
        """The unknown buckets of every partition read, summed."""
        return UnknownTally.total(self.unknown.values())


def restore(settings: Settings, timeout_s: float = RESTORE_TIMEOUT_S) -> dict[str, ScoreState]:
    """The committed state of every score key (``read_back`` of all partitions, merged)."""
    return read_back(settings, timeout_s=timeout_s).merged()


def read_back(
    settings: Settings,
    partitions: Iterable[int] | None = None,
    timeout_s: float = RESTORE_TIMEOUT_S,
) -> ScoresRead:
    """The committed score states and unknown buckets of ``partitions`` of the scores topic
    (all by default), each read to its end (a RuntimeError past ``timeout_s``: a broker away
    must not hang the read forever). The single unknown key of before this layout is
    ignored (its count stays on the topic, no keeper adds to it)."""
    from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

    topic = topic_name(settings, "scores")
    reader = kafka.consumer(settings, f"{settings.topic_prefix}-scoring-restore", read_to_end=True)
    try:
        if partitions is None:
            meta = reader.list_topics(topic, timeout=15).topics[topic]
            if meta.error is not None or not meta.partitions:
                raise RuntimeError(
                    f"cannot read {topic}: {meta.error or 'no partitions'}; "
                    "run `loraplane topics apply`"
                )
            partitions = meta.partitions
        pending = set(partitions)
        out = ScoresRead({p: {} for p in pending}, {})
        if not pending:
            return out
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in pending])
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{topic} not read to its end within {timeout_s:.0f} s "
                    f"({len(pending)} partitions left)"
                )
            for msg in reader.consume(num_messages=BATCH, timeout=1.0):
                p = msg.partition() or 0
                if (err := msg.error()) is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"reading {topic}: {err}")
                    pending.discard(p)
                    continue
                states = out.states.setdefault(p, {})
                key = score_key_of(msg.key())
                if key is None:
                    foreign = out.undecodable.setdefault(p, set())
                    (foreign.discard if msg.value() is None else foreign.add)(msg.key() or b"")
                    continue
                if (value := msg.value()) is None:
                    states.pop(key, None)
                    if key == unknown_key(p):
                        out.unknown.pop(p, None)
                    continue
                try:
                    if key == unknown_key(p):
                        out.unknown[p] = decode(UnknownTally, value)
                    elif not is_unknown_key(key):
                        states[key] = from_snapshot(decode(ScoreSnapshot, value))
                except SchemaError as exc:
                    log.error("scores %s@%s unreadable, skipped: %s", p, msg.offset(), exc)
        return out
    finally:
        reader.close()


def recent_ids(
    settings: Settings, committed: list[Any], timeout_s: float = RESTORE_TIMEOUT_S
) -> dict[int, RecentIds]:
    """Per requests partition, the event ids of the last ``RECENT`` logs before its
    ``committed`` offset (TopicPartitions of the requests topic): what the previous owner
    counted last, so a replayed duplicate of it is not counted again after a handover."""
    from confluent_kafka import KafkaError, TopicPartition

    recent = {tp.partition: RecentIds(RECENT) for tp in committed}
    ends = {tp.partition: tp.offset for tp in committed if tp.offset > 0}
    if not ends:
        return recent
    topic = topic_name(settings, "requests")
    reader = kafka.consumer(settings, f"{settings.topic_prefix}-scoring-restore", read_to_end=True)
    try:
        reader.assign([TopicPartition(topic, p, max(0, end - RECENT)) for p, end in ends.items()])
        deadline = time.monotonic() + timeout_s
        while ends:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{topic} not read back within {timeout_s:.0f} s")
            for msg in reader.consume(num_messages=BATCH, timeout=1.0):
                p, offset = msg.partition() or 0, msg.offset() or 0
                if (err := msg.error()) is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"reading {topic}: {err}")
                    ends.pop(p, None)
                    continue
                if p not in ends or offset >= ends[p]:
                    ends.pop(p, None)
                    continue
                with contextlib.suppress(SchemaError):  # refused then, never counted
                    recent[p].add([(p, demand_of(msg).event_id)])
                if offset + 1 >= ends[p]:
                    del ends[p]
        return recent
    finally:
        reader.close()


class _Owned:
    """One assigned requests partition, read back: its keys are this keeper's alone.

    Its score states are held as ``Flat``s (``flat``): the fold reads and returns them,
    the records are written from them, and a ``ScoreState`` is built only where one is
    read (``states``)."""

    def __init__(
        self,
        states: Mapping[str, ScoreState],
        unknown: UnknownTally,
        recent: RecentIds,
        committed: int,
        undecodable: set[bytes] | None = None,
    ) -> None:
        self.flat: dict[str, Flat] = {key: Flat.of(s) for key, s in states.items()}
        self.undecodable = set(undecodable or ())
        """Keys on the partition that are not UTF-8 text, to be tombstoned (``ScoresRead``)."""
        self.unknown = unknown
        self.recent = recent
        self.committed = committed
        """The partition's committed offset (the next log to count; < 0: none committed
        yet)."""

    @property
    def states(self) -> dict[str, ScoreState]:
        """Every owned key's state, as a (new) ``ScoreState``."""
        return {key: flat.state() for key, flat in self.flat.items()}


class ScoreKeeper:
    """The consume -> fold -> transact loop of one process. ``run`` blocks (a thread) until
    ``stop``; ``owned`` is read by that thread only (``partitions`` copies it)."""

    def __init__(self, settings: Settings, instance: str | None = None) -> None:
        self.settings = settings
        self.instance = instance or default_instance()
        self.requests = topic_name(settings, "requests")
        self.scores = topic_name(settings, "scores")
        self.dead_letters = topic_name(settings, "dead-letters")
        self.progress = Progress(COMPONENT)
        self.owned: dict[int, _Owned] = {}
        self._fresh: set[int] = set()
        """Assigned, not read back yet: their logs wait."""
        self._tail: TopicTail | None = None  # the registry's, started by ``run``
        self._verified: VerifiedRegistry | None = None
        self._known: Known | None = None
        self._known_version = -1
        self._known_at = 0.0
        self.applied: Known | None = None
        """The registry the owned keys were last checked against (tombstones)."""
        self.undecodable_tombstoned = 0
        """Scores keys that were not UTF-8 text, tombstoned (``score_key_of``)."""
        self.restored = 0
        """Partitions read back so far (every assignment counts)."""
        self.counts: tuple[int, ...] = ()
        """The requests topic's partition counts seen (the broker's latest first): a log's
        partition must be its key's under one of them (``fold_batch``). Empty: unchecked."""
        self._counted_at = -PARTITIONS_EVERY_S

    @property
    def tail(self) -> TopicTail:
        assert self._tail is not None, "started by run()"
        return self._tail

    def partitions(self) -> list[int]:
        """The requests partitions this keeper owns now (read back)."""
        return sorted(self.owned)

    # ---- the loop -------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        from confluent_kafka import KafkaException

        watchdog = Watchdog([self.progress]).start()
        tail = self._tail = registry_tail(self.settings, f"{COMPONENT}-{self.instance}")
        self._verified = VerifiedRegistry(
            KeyringFile(self.settings.keyring_path),
            tail.snapshot,
            sink=ProducerSink(self.settings),
            component=COMPONENT,
            checkpoints_path=self.settings.home / "scoring" / CHECKPOINTS_FILE,
            version=lambda: tail.version,
            source=tail,
        )
        try:
            while not stop.is_set():
                try:
                    self._session(stop)
                except PartitionMismatch:
                    raise
                except (KafkaException, RuntimeError) as exc:  # ProducerBroken included
                    self.progress.blocked(f"session ended: {exc}")
                    log.error("scoring session ended (%s); restarting in %.0f s", exc, RETRY_S)
                    stop.wait(RETRY_S)
        finally:
            watchdog.stop()
            tail.stop()

    def _session(self, stop: threading.Event) -> None:
        prefix = self.settings.topic_prefix
        txn = kafka.transactional_producer(
            self.settings,
            f"{prefix}-scoring-{self.instance}",
            client_id=CLIENT_ID,
            transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
        )
        self.progress.blocked("init_transactions")
        # Fences this instance's previous producer (a restart) and aborts its open batch.
        txn.init_transactions(STEP_TIMEOUT_S)
        consumer = kafka.consumer(
            self.settings,
            f"{prefix}-scoring",
            client_id=CLIENT_ID,
            session_timeout_ms=SESSION_TIMEOUT_MS,
            cooperative=True,
        )
        self.owned, self._fresh, self.applied = {}, set(), None
        try:
            self._check_layout(consumer)
            self.progress.blocked("reading the registry")
            while not self.tail.wait_caught_up(0.2):  # unknown until then: nothing scored
                if stop.is_set():
                    return
            consumer.subscribe(
                [self.requests],
                on_assign=self._assigned,
                on_revoke=self._revoked,
                on_lost=self._revoked,
            )
            while not stop.is_set():
                batch = kafka.consume_ready(consumer, BATCH, POLL_S, LINGER_S)
                if self._fresh:  # new partitions: their states as last committed
                    self._read_back(consumer)
                known = self._registry()
                if known is not self.applied:
                    self._tombstone(txn, consumer, known)
                if batch:
                    self._commit(txn, consumer, batch, known)
                self.progress.advanced()
        finally:
            consumer.close()  # revokes (the callbacks forget) and leaves the group at once
            self.owned, self._fresh = {}, set()
            txn.flush(5)

    def _check_layout(self, consumer: Any) -> None:
        counts = {}
        for topic in (self.requests, self.scores):
            meta = consumer.list_topics(topic, timeout=15).topics[topic]
            if meta.error is not None or not meta.partitions:
                raise RuntimeError(
                    f"cannot read {topic}: {meta.error or 'no partitions'}; "
                    "run `loraplane topics apply`"
                )
            counts[topic] = len(meta.partitions)
        self._count(counts[self.requests])
        if counts[self.requests] != counts[self.scores]:
            raise PartitionMismatch(
                f"{self.requests} has {counts[self.requests]} partitions and {self.scores} "
                f"{counts[self.scores]}: the scores of requests partition p live on scores "
                "partition p, so both need the same count (kernel/topics.py)"
            )

    def _count(self, partitions: int) -> bool:
        """Note the requests topic's count from the broker; True when it is a new one."""
        self._counted_at = time.monotonic()
        if self.counts[:1] == (partitions,):
            return False
        fresh = partitions not in self.counts
        self.counts = (partitions, *(n for n in self.counts if n != partitions))
        return fresh

    def _recount(self, consumer: Any) -> bool:
        """Ask the broker for the requests topic's count again (at most every
        ``PARTITIONS_EVERY_S``); True when it is one not seen before: a log refused as on
        the wrong partition may follow it."""
        if time.monotonic() - self._counted_at < PARTITIONS_EVERY_S:
            return False
        try:
            partitions = broker_partitions(consumer, self.requests, STEP_TIMEOUT_S)
        except Exception as exc:  # the broker away: the refusal stands, asked again later
            self._counted_at = time.monotonic()
            log.warning("scoring: requests partition count unknown: %s", exc)
            return False
        return self._count(partitions)

    # ---- rebalances (called inside consume, between batches: no transaction is open) -----
    def _assigned(self, consumer: Any, partitions: list[Any]) -> None:
        self._fresh |= {tp.partition for tp in partitions}
        log.info(
            "scoring %s: assigned requests partitions %s",
            self.instance,
            sorted(tp.partition for tp in partitions),
        )

    def _revoked(self, consumer: Any, partitions: list[Any]) -> None:
        gone = {tp.partition for tp in partitions}
        self._fresh -= gone
        for p in gone:
            self.owned.pop(p, None)
        log.info(
            "scoring %s: gave up requests partitions %s; owning %s",
            self.instance,
            sorted(gone),
            self.partitions(),
        )

    def _read_back(self, consumer: Any) -> None:
        """The fresh partitions' states as their last owner committed them: the committed
        offsets first (stable: after any open transaction of theirs ended), then the scores
        partitions to their ends, then the event ids counted last."""
        from confluent_kafka import TopicPartition

        fresh = sorted(self._fresh)
        self.progress.blocked(f"reading partitions {fresh} back")
        committed = consumer.committed(
            [TopicPartition(self.requests, p) for p in fresh], timeout=STEP_TIMEOUT_S
        )
        read = read_back(self.settings, fresh)
        recent = recent_ids(self.settings, committed)
        for tp in committed:
            p = tp.partition
            self.owned[p] = _Owned(
                read.states.get(p, {}),
                read.unknown.get(p, UnknownTally(logs=0)),
                recent[p],
                tp.offset,
                read.undecodable.get(p),
            )
        self._fresh.clear()
        # What the process holds now (a Faust worker's objects, the states read back) lives
        # on: out of the collector's way, or each full collection stalls every batch.
        collector.freeze_survivors()
        self.applied = None  # the new keys are checked against the registry
        self.restored += len(fresh)
        log.info(
            "scoring %s: partitions %s read back: %d score states and %d recent event "
            "ids; owning %s; consuming from epoch %.3f",
            self.instance,
            fresh,
            sum(len(read.states.get(p, {})) for p in fresh),
            sum(len(recent[p]) for p in fresh),
            self.partitions(),
            time.time(),
        )

    # ---- the registry ---------------------------------------------------------------------
    def _registry(self) -> Known:
        """The live versions of the verified registry, re-derived when the tail moved (or
        every ``KEYRING_CHECK_S``, for a new keyring)."""
        assert self._verified is not None, "started by run()"
        version = self.tail.version
        now = time.monotonic()
        if (
            self._known is None
            or version != self._known_version
            or now - self._known_at > KEYRING_CHECK_S
        ):
            try:
                self._verified.refresh()
            except Exception as exc:  # the views accepted before stay (registry_trust)
                log.warning("scoring: registry refresh failed, keeping the last: %s", exc)
            known = Known.from_records(
                r for v in self._verified.accepted.values() for r in v.versions
            )
            if self._known is None or known != self._known:
                self._known = known
            self._known_version, self._known_at = version, now
        return self._known

    def _registry_after(self) -> Known:
        """The registry as of now or later: the tail has read up to the ends the topic has
        now (RuntimeError past ``REGISTRY_WAIT_S``: the batch is never judged on an older
        view; the session restarts)."""
        self.progress.blocked("waiting for the registry tail")
        ends = self.tail.ends()
        if not self.tail.wait_read_to(ends, REGISTRY_WAIT_S):
            raise RuntimeError(f"registry tail not at {ends} within {REGISTRY_WAIT_S:.0f} s")
        self._known_version = -1  # re-derive
        return self._registry()

    # ---- writing ----------------------------------------------------------------------------
    def _offsets(self, parts: Iterable[int]) -> list[Any]:
        from confluent_kafka import TopicPartition

        return [
            TopicPartition(self.requests, p, self.owned[p].committed)
            for p in parts
            if self.owned[p].committed >= 0
        ]

    def _tombstone(self, txn: Any, consumer: Any, known: Known) -> None:
        """Tombstone every owned score key ``known`` no longer backs, and every key read back
        that is not UTF-8 text (under its own bytes: ``score_key_of``), each on its own
        partition, in one transaction that also re-sends those partitions' committed offsets
        (a keeper that lost them is fenced)."""
        stale = {
            p: keys for p, part in self.owned.items() if (keys := stale_keys(known, part.flat))
        }
        foreign = {
            p: sorted(part.undecodable) for p, part in self.owned.items() if part.undecodable
        }
        if stale or foreign:

            def fill() -> None:
                for p, keys in stale.items():
                    for key in keys:
                        txn.produce(self.scores, key=key, value=None, partition=p)
                for p, raws in foreign.items():
                    for raw in raws:
                        txn.produce(self.scores, key=raw, value=None, partition=p)
                if offsets := self._offsets({*stale, *foreign}):
                    send_offsets(txn, offsets, consumer.consumer_group_metadata(), STEP_TIMEOUT_S)

            transact(txn, fill, on_step=self.progress.blocked)
            names = [k for keys in stale.values() for k in keys]
            for p, keys in stale.items():
                for key in keys:
                    self.owned[p].flat.pop(key, None)
            for p in foreign:
                self.owned[p].undecodable.clear()
            if names:
                log.info(
                    "scoring: %d score keys tombstoned (%s)", len(names), ", ".join(names[:10])
                )
            if undecodable := sum(len(raws) for raws in foreign.values()):
                self.undecodable_tombstoned += undecodable
                log.warning(
                    "scoring: %d scores keys that are not UTF-8 text tombstoned (%s)",
                    undecodable,
                    ", ".join(repr(r[:64]) for raws in foreign.values() for r in raws[:10]),
                )
        self.applied = known

    def _fold(self, by_part: dict[int, list[Any]], known: Known) -> dict[int, Folded]:
        now = time.time()
        return {
            p: fold_batch(
                self.owned[p].flat, msgs, known, self.owned[p].recent, now=now, counts=self.counts
            )
            for p, msgs in by_part.items()
        }

    def _commit(self, txn: Any, consumer: Any, batch: list[Any], known: Known) -> None:
        from confluent_kafka import TopicPartition

        by_part: dict[int, list[Any]] = {}
        ends: dict[int, int] = {}
        # A batch is runs of one partition's logs in offset order: each run is checked
        # as a whole, and its logs one by one only where it holds an error or a log
        # before the committed offset (given up, or not read back: its owner counts it).
        for p, run in groupby(batch, key=_PARTITION):
            msgs = list(run)
            if any(map(_ERROR, msgs)):
                for err in filter(None, map(_ERROR, msgs)):
                    log.warning("requests consumer: %s", err)
                msgs = [m for m in msgs if m.error() is None]
            owned = self.owned.get(p)
            if owned is None or not msgs:
                continue
            if msgs[0].offset() < owned.committed:
                msgs = [m for m in msgs if m.offset() >= owned.committed]
                if not msgs:
                    continue
            by_part.setdefault(p, []).extend(msgs)
            ends[p] = msgs[-1].offset() + 1
        if not by_part:
            return
        folded = self._fold(by_part, known)
        if (
            any(f.unknown for f in folded.values())
            and (fresh := self._registry_after()) is not known
        ):
            # a log may have come right after its version's publish: judge the batch again
            # on a registry view as new as the batch (streams.score_admission, "Ordering")
            self._tombstone(txn, consumer, fresh)
            folded = self._fold(by_part, fresh)
            known = fresh
        if any(
            exc.reason is DecodeReason.wrong_partition
            for f in folded.values()
            for _, exc in f.refused
        ) and self._recount(consumer):
            # the topic grew: a log may be on its key's partition under the new count
            folded = self._fold(by_part, known)
        duplicates = sum(f.duplicates for f in folded.values())
        if duplicates:
            log.info("scoring: %d request logs delivered again, counted once", duplicates)
        unknown = {p: f.tally(self.owned[p].unknown) for p, f in folded.items()}
        for f in folded.values():
            for msg, exc in f.refused:
                log.warning("request log p%s@%s refused: %s", msg.partition(), msg.offset(), exc)

        def fill() -> None:
            for p, f in folded.items():
                for key, state in f.flat.items():
                    txn.produce(self.scores, key=key, value=state.snapshot_bytes(), partition=p)
                if unknown[p] is not self.owned[p].unknown:
                    txn.produce(
                        self.scores, key=unknown_key(p), value=encode(unknown[p]), partition=p
                    )
                for msg, exc in f.refused:
                    txn.produce(
                        self.dead_letters,
                        key=msg.key(),
                        value=encode(dead_letter_for(msg, COMPONENT, exc.reason, str(exc))),
                    )
            self.progress.blocked("send_offsets_to_transaction")
            send_offsets(
                txn,
                [TopicPartition(self.requests, p, end) for p, end in ends.items()],
                consumer.consumer_group_metadata(),
                STEP_TIMEOUT_S,
            )

        attempts = transact(txn, fill, on_step=self.progress.blocked)
        if attempts > 1:
            log.info(
                "scoring batch of %d committed after %d attempts",
                sum(map(len, by_part.values())),
                attempts,
            )
        bursts: list[str] = []
        for p, f in folded.items():
            owned = self.owned[p]
            owned.flat.update(f.flat)
            for partition, ids in f.ids.items():
                owned.recent.add_run(partition, ids)
            owned.unknown = unknown[p]
            owned.committed = ends[p]
            bursts += f.bursts
        if bursts:
            log.info("burst for %s", ", ".join(bursts[:10]))
