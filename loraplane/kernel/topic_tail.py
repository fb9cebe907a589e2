"""A live tail of compacted topics: the last record of every key, kept current by one
long-lived consumer instead of re-reading the whole topic every few seconds (the registry of
the worker agents, the router, the scoring keepers and the planner; the router's worker
states), so a change reaches them as soon as the broker delivers it.

The first view is complete (``snapshot`` raises ``TopicReadIncomplete`` until every
partition was read to its end once, so a broker that is away never reads as an empty
topic); then each record, tombstones too, replaces its key's last one, and ``version``
counts the changes. Partitions are assigned, not subscribed (no group, no rebalance;
positions live in the process). ``caught_up``, ``lag``, ``current`` and ``current_span``
say whether and since when the view is the topic's present (``router.liveness``). An
optional ``select`` keeps a consumer to its share: a key it holds nothing of is kept only
when selected; once in, every later record of it is kept. ``TailView`` is the pure part.
Partitions added after the start (a topic grown) are read from their beginning once the
tail's probe finds them (``TopicTail._add_partitions``).

Records the user refused (``refuse``) are held within bounds, the oldest forgotten first,
so keys written once cannot grow the view; ``rewind`` re-reads what was forgotten (a new
keyring may verify it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from loraplane.kernel import kafka
from loraplane.kernel.acls import READER_GROUP_PREFIX
from loraplane.kernel.bus import Record, TopicReadIncomplete, record_of, replaces
from loraplane.kernel.command_partition import broker_partitions, key_hash
from loraplane.kernel.config import Settings
from loraplane.kernel.progress import Progress

if TYPE_CHECKING:
    from confluent_kafka import Consumer

__all__ = [
    "MAX_REFUSED",
    "MAX_REFUSED_BYTES",
    "PARTITION_EOF",
    "PROBE_EVERY_S",
    "RECONNECT_S",
    "RECOUNT_S",
    "CurrentSpan",
    "Partition",
    "TailView",
    "TopicTail",
]

log = logging.getLogger(__name__)

Partition = tuple[str, int]  # (topic, partition)
RECONNECT_S = 1.0  # a consumer that failed is rebuilt after this long
PROBE_EVERY_S = 5.0  # an idle tail asks for metadata this often, to notice a broker away
PARTITION_EOF = -191  # librdkafka's _PARTITION_EOF
RECOUNT_S = 1.0
"""A record off its key's partition under every count held asks the broker for the count
again (``TopicTail.placed``) at most this often: misplaced records cost one metadata query a
second at most."""
MAX_REFUSED = 1000
"""Refused records a view keeps (a later keyring may verify them) before it forgets the
oldest: more than a fleet's keys rotate at once, far less than a writer can invent."""
MAX_REFUSED_BYTES = 16 * 1024 * 1024
"""And their bytes at most."""


class TailView:
    """The last record per (topic, key) and where each partition is read to. Not
    thread-safe: ``TopicTail`` holds its lock around it. ``select``: which records of a key
    not held yet are kept (None: all). ``keep=False``: no record is held, only positions
    (a tail whose user indexes each record itself: holding them too would keep every key
    ever written to a compacted topic, whatever the user forgets). ``max_refused`` and
    ``max_refused_bytes`` bound the records held that the user refused (``refuse``).
    ``partitions``: a topic's partition count now (0: not known), by which a record held
    on its key's home is not replaced by one off it (``bus.replaces``: a topic grown)."""

    def __init__(
        self,
        select: Callable[[Record], bool] | None = None,
        keep: bool = True,
        max_refused: int = MAX_REFUSED,
        max_refused_bytes: int = MAX_REFUSED_BYTES,
        partitions: Callable[[str], int] | None = None,
    ) -> None:
        self._select = select
        self._keep = keep
        self._partitions = partitions
        self.skipped = 0  # records read past: not selected, for a key not held
        self._latest: dict[tuple[str, bytes], Record] = {}
        self._refused: OrderedDict[tuple[str, bytes], int] = OrderedDict()  # key -> its bytes
        self._refused_bytes = 0
        self._max_refused = max_refused
        self._max_refused_bytes = max_refused_bytes
        self.forgotten = 0  # refused records dropped past the bounds, ever
        self._forgotten_since_rewind = 0
        self.rewind_due = False  # asked for, not yet begun by the reading thread
        self._next: dict[Partition, int] = {}  # the next offset to read
        self._end: dict[Partition, int] = {}  # the end as last learned from the broker
        self._reached: set[Partition] = set()  # partitions read to their end at least once
        self.caught_up = False
        self.version = 0  # changes since caught up (+1 on catching up); 0: no view yet

    def assign(self, ends: dict[Partition, int]) -> None:
        """The partitions to read and each one's end now; one with nothing to read before
        its end is reached at once."""
        for tp, end in ends.items():
            self._next.setdefault(tp, 0)
            self._end[tp] = end
            if self._next[tp] >= end:
                self._reached.add(tp)
        self._check_caught_up()

    def positions(self) -> dict[Partition, int]:
        """Where to resume each partition (a rebuilt consumer starts there)."""
        return dict(self._next)

    def apply(self, record: Record) -> bool:
        """One record in partition order: it replaces its key's last one, unless it is not
        selected and its key holds nothing (then only the position moves), or it does not
        stand for its key instead of the one held (``bus.replaces``: a re-read by
        ``rewind`` of an older record, or one off its key's home partition after a grow
        while one on it is held). True when kept."""
        tp = (record.topic, record.partition)
        key = (record.topic, record.key or b"")
        held = self._latest.get(key)
        count = self._partitions(record.topic) if self._partitions is not None else 0
        if not replaces(record, held, count):
            kept = False
        else:
            kept = (
                self._select is None
                or (held is not None and held.value is not None)
                or self._selects(record)
            )
        if kept and key in self._refused:  # a new record of it: the user judges it again
            self._refused_bytes -= self._refused.pop(key)
        if kept and self._keep:
            self._latest.pop(key, None)  # re-inserted last: the dict stays in arrival order
            self._latest[key] = record
        else:
            self.skipped += 1
        self._next[tp] = max(self._next.get(tp, 0), record.offset + 1)
        if self._next[tp] >= self._end.get(tp, 0):
            self._reached.add(tp)
        if self.caught_up:
            self.version += kept
        else:
            self._check_caught_up()
        return kept

    def refuse(self, record: Record) -> None:
        """The user refused ``record`` (if it is still its key's last one): it is kept among
        the refused, whose oldest are forgotten past ``max_refused`` or
        ``max_refused_bytes``."""
        key = (record.topic, record.key or b"")
        held = self._latest.get(key)
        if held is None or (held.partition, held.offset) != (record.partition, record.offset):
            return
        if key in self._refused:
            return
        size = len(record.key or b"") + len(record.value or b"")
        self._refused[key] = size
        self._refused_bytes += size
        while self._refused and (
            len(self._refused) > self._max_refused or self._refused_bytes > self._max_refused_bytes
        ):
            oldest, size = self._refused.popitem(last=False)
            self._refused_bytes -= size
            del self._latest[oldest]
            self.forgotten += 1
            self._forgotten_since_rewind += 1

    def refused_held(self) -> tuple[int, int]:
        """(records, bytes) held that the user refused."""
        return len(self._refused), self._refused_bytes

    def ask_rewind(self) -> bool:
        """Ask for a re-read from the start when a refused record was forgotten since the
        last one (a new keyring may verify it); whether one was asked. ``read_to`` is False
        until the reading thread began it (``rewind``)."""
        if not self._forgotten_since_rewind:
            return False
        self.rewind_due = True
        return True

    def rewind(self) -> None:
        """Begin the re-read: every partition from its start. The records held stay (an
        older one read again does not replace them); the view stays caught up."""
        self.rewind_due = False
        self._forgotten_since_rewind = 0
        for tp in self._next:
            self._next[tp] = 0

    def _selects(self, record: Record) -> bool:
        """``select``'s answer; a select that fails on a record keeps it (the consumer's own
        checks then refuse what it is), so no record can stop the tail."""
        assert self._select is not None
        try:
            return self._select(record)
        except Exception:  # a hostile record must not end the tail's thread
            log.exception(
                "topic tail: select failed on %s[%d]@%d; kept",
                record.topic,
                record.partition,
                record.offset,
            )
            return True

    def at_end(self, tp: Partition, offset: int) -> None:
        """The broker says the partition ends at ``offset`` (a transaction marker may sit
        between the last record and the end)."""
        self._next[tp] = max(self._next.get(tp, 0), offset)
        self._end[tp] = max(self._end.get(tp, 0), offset)
        self._reached.add(tp)
        self._check_caught_up()

    def set_end(self, tp: Partition, end: int) -> None:
        """A newer end learned from the broker (its high watermark)."""
        self._end[tp] = max(self._end.get(tp, 0), end)

    def read_to(self, ends: dict[Partition, int]) -> bool:
        """Whether every partition is read up to its offset in ``ends`` (offsets taken from
        the broker at some moment: the view then holds everything written before it)."""
        return (
            self.caught_up
            and not self.rewind_due
            and all(self._next.get(tp, 0) >= end for tp, end in ends.items())
        )

    def lag(self) -> int:
        """Records (offsets) between the read positions and the ends last learned."""
        return sum(max(0, end - self._next.get(tp, 0)) for tp, end in self._end.items())

    def snapshot(self) -> list[Record]:
        """The last record of every key, in arrival order."""
        if not self._keep:
            raise TypeError("this view holds no records (keep=False)")
        if not self.caught_up:
            raise TopicReadIncomplete("the topic has not been read to its end yet")
        return list(self._latest.values())

    def _check_caught_up(self) -> None:
        if not self.caught_up and self._end and self._reached >= set(self._end):
            self.caught_up = True
            self.version += 1


class CurrentSpan:
    """When a view was current without a gap: answers at its end (epoch seconds) no more
    than ``max_gap_s`` apart, from ``since`` to ``last``. Not thread-safe (``TopicTail``
    holds its lock)."""

    def __init__(self, max_gap_s: float) -> None:
        self.max_gap_s = max_gap_s
        self.since: float | None = None
        self.last: float | None = None

    def answered(self, at: float) -> None:
        if self.last is None or at - self.last > self.max_gap_s:
            self.since = at
        self.last = at if self.last is None else max(self.last, at)

    def value(self) -> tuple[float, float] | None:
        if self.since is None or self.last is None:
            return None
        return self.since, self.last


class TopicTail:
    """One consumer thread tailing ``topics`` into a ``TailView``. ``on_record`` (called on
    that thread, each record as it is applied) is for users that index records themselves
    (the router's fleet index). ``probe_every_s``: how often the tail asks the broker for
    its topics' partitions (added ones are read; an idle tail's proof the broker is there;
    the router's worker-state tail: twice per heartbeat). ``select``: which
    records of a key not held yet are kept (``TailView``; called on the tail's thread).
    ``prefetch_kbytes``: what its consumer may fetch ahead (``kafka.consumer_config``).
    ``keep=False``: the tail holds no record (``snapshot`` refuses), for an ``on_record``
    user that holds what it needs itself. ``max_refused``, ``max_refused_bytes``: the
    bounds of the records held that the user refused (``refuse``, ``TailView``)."""

    def __init__(
        self,
        settings: Settings,
        topics: str | Sequence[str],
        *,
        component: str,
        on_record: Callable[[Record], object] | None = None,
        probe_every_s: float = PROBE_EVERY_S,
        clock: Callable[[], float] = time.time,
        select: Callable[[Record], bool] | None = None,
        prefetch_kbytes: int | None = None,
        keep: bool = True,
        max_refused: int = MAX_REFUSED,
        max_refused_bytes: int = MAX_REFUSED_BYTES,
    ) -> None:
        self._settings = settings
        self._prefetch_kbytes = prefetch_kbytes
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        self.component = component
        self._on_record = on_record
        self._probe_every_s = probe_every_s
        self._clock = clock
        self._span = CurrentSpan(2 * probe_every_s + 1.0)
        self._view = TailView(
            select,
            keep,
            max_refused,
            max_refused_bytes,
            lambda topic: self._counts.get(topic, (0,))[0],  # under the lock, as the view
        )
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._probe_consumer: Consumer | None = None  # ``ends``'s own, made on first use
        # topic -> its partition counts seen, largest (the latest) first: ``placed``
        self._counts: dict[str, tuple[int, ...]] = {}
        self._recounted: dict[str, float] = {}  # topic -> when ``placed`` last asked the broker
        self._grew = False  # ``placed`` learned a count above the partitions read: add them
        self.progress = Progress(component)

    # ---- what users read ------------------------------------------------------------------
    def placed(self, record: Record) -> tuple[int, int] | None:
        """Where ``record`` was read: its partition and a partition count of its topic (None
        before the assignment), for a user that checks a record is on its key's partition
        (``worker_states.at_home``). A topic that grew while this tail reads it places keys
        by its new count, and by the old one at producers that have not refreshed their
        metadata: the count given is the first of those seen (the largest first) the record
        is at home under. A record at home under none asks the broker for the count again
        (at most every ``RECOUNT_S``) and is judged by the largest."""
        with self._lock:
            counts = self._counts.get(record.topic, ())
        if not counts:
            return None
        hashed = key_hash(record.key or b"")
        home = next((n for n in counts if hashed % n == record.partition), None)
        if home is None:
            counts = self._recount(record.topic, counts)
            home = next((n for n in counts if hashed % n == record.partition), counts[0])
        return (record.partition, home)

    def _recount(self, topic: str, counts: tuple[int, ...]) -> tuple[int, ...]:
        """``topic``'s partition counts seen, the broker's now among them, asked at most every
        ``RECOUNT_S`` (else, or when the broker does not answer, those held)."""
        now = time.monotonic()
        with self._lock:
            if now - self._recounted.get(topic, -RECOUNT_S) < RECOUNT_S:
                return self._counts.get(topic, counts)
            self._recounted[topic] = now
        try:
            fresh = broker_partitions(self._metadata_consumer(), topic, 5.0)
        except Exception as exc:  # LookupError, KafkaException: judged by the counts held
            log.warning("tail %s: no partition count of %s: %s", self.component, topic, exc)
            return counts
        with self._lock:
            read = sum(1 for t, _ in self._view.positions() if t == topic)
            self._grew = self._grew or fresh > read
            return self._counted(topic, fresh)

    def _counted(self, topic: str, count: int) -> tuple[int, ...]:
        """``count``, the broker's answer, among ``topic``'s counts seen, largest first (a
        topic never shrinks: a smaller answer is a broker's metadata behind the grow, and
        judging by it would keep a key's old partition's record over its new home's);
        under the lock."""
        held = self._counts.get(topic, ())
        self._counts[topic] = counts = tuple(sorted({count, *held}, reverse=True))
        return counts

    @property
    def version(self) -> int:
        with self._lock:
            return self._view.version

    @property
    def caught_up(self) -> bool:
        with self._lock:
            return self._view.caught_up

    @property
    def skipped(self) -> int:
        """Records read past because ``select`` did not keep them."""
        with self._lock:
            return self._view.skipped

    @property
    def forgotten(self) -> int:
        """Refused records forgotten past the bounds (``refuse``), ever."""
        with self._lock:
            return self._view.forgotten

    def refused_held(self) -> tuple[int, int]:
        """(records, bytes) held that the user refused."""
        with self._lock:
            return self._view.refused_held()

    def refuse(self, record: Record) -> None:
        """The user refused ``record`` (one of a ``snapshot``): it is held only within the
        bounds, the oldest refused forgotten first. Any thread."""
        with self._lock:
            self._view.refuse(record)

    def rewind(self) -> bool:
        """Re-read the topic from its start if a refused record was forgotten since the last
        re-read (a new keyring may verify it); whether it will. ``wait_read_to`` waits for
        the re-read. Any thread."""
        with self._changed:
            asked = self._view.ask_rewind()
        if asked:
            log.info(
                "%s: re-reading from the start: refused records were forgotten", self.component
            )
        return asked

    def lag(self) -> int:
        with self._lock:
            return self._view.lag()

    def current(self) -> bool:
        """Caught up, nothing known to be unread, and the broker answering."""
        with self._lock:
            fresh = self._view.caught_up and self._view.lag() == 0
        return fresh and self.progress.stuck_s() == 0.0

    def current_span(self) -> tuple[float, float] | None:
        """(since, last): the view was current without a gap from ``since`` to its latest
        answer ``last`` (epoch seconds); None before its first."""
        with self._lock:
            return self._span.value()

    def _answered(self) -> None:
        """The broker answered: a point of the current span if nothing is known unread."""
        with self._lock:
            if self._view.caught_up and self._view.lag() == 0:
                self._span.answered(self._clock())

    def snapshot(self) -> list[Record]:
        """The last record of every key; ``TopicReadIncomplete`` before the first complete
        read."""
        with self._lock:
            return self._view.snapshot()

    def wait_caught_up(self, timeout_s: float) -> bool:
        """Block until the first complete read (True) or ``timeout_s`` (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._view.caught_up, timeout_s)

    def ends(self, timeout_s: float = 5.0) -> dict[Partition, int]:
        """Every partition's end on the broker now (a fresh query, not the cached end);
        raises when the broker does not answer within ``timeout_s``."""
        from confluent_kafka import TopicPartition

        consumer = self._metadata_consumer()
        out: dict[Partition, int] = {}
        for topic in self.topics:
            meta = consumer.list_topics(topic, timeout=timeout_s).topics[topic]
            if meta.error is not None:
                raise RuntimeError(f"{topic}: {meta.error}")
            for p in meta.partitions:
                out[(topic, p)] = consumer.get_watermark_offsets(
                    TopicPartition(topic, p), timeout=timeout_s
                )[1]
        return out

    def _metadata_consumer(self) -> Consumer:
        """The consumer ``ends``, ``placed`` and the probe of added partitions ask the
        broker's metadata with (not the reading one), made on first use (one, whichever
        thread asks first)."""
        with self._lock:
            if self._probe_consumer is None:
                self._probe_consumer = kafka.consumer(
                    self._settings,
                    f"{READER_GROUP_PREFIX}ends",
                    client_id=self.component,
                    quiet=True,
                )
            return self._probe_consumer

    def wait_read_to(self, ends: dict[Partition, int], timeout_s: float) -> bool:
        """Block until the view holds everything before ``ends`` (True) or ``timeout_s``
        passed (False): a user that took ``ends()`` after an event then judges it on a view
        at least as new as the event."""
        with self._changed:
            return self._changed.wait_for(lambda: self._view.read_to(ends), timeout_s)

    # ---- the thread -------------------------------------------------------------------------
    def start(self) -> TopicTail:
        self._thread = threading.Thread(
            target=self._run, name=f"tail-{self.component}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._probe_consumer is not None:
            self._probe_consumer.close()
            self._probe_consumer = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                consumer = kafka.consumer(
                    self._settings,
                    f"{READER_GROUP_PREFIX}tail-{time.monotonic_ns()}",
                    client_id=self.component,
                    read_to_end=True,
                    quiet=True,
                    prefetch_kbytes=self._prefetch_kbytes,
                )
                try:
                    self._assign(consumer)
                    probed = counted = time.monotonic()
                    while not self._stop.is_set():
                        with self._lock:
                            rewind = self._view.rewind_due
                            if rewind:
                                self._view.rewind()
                            grew, self._grew = self._grew, False
                        if rewind:
                            self._assign(consumer)
                            counted = time.monotonic()
                        if self._step(consumer):
                            probed = time.monotonic()
                        elif time.monotonic() - probed > self._probe_every_s:
                            grew = True  # the probe's answer says the partitions too
                        if grew or time.monotonic() - counted > self._probe_every_s:
                            probed = counted = time.monotonic()
                            self._probe(consumer)
                finally:
                    consumer.close()
            except Exception as exc:  # KafkaException, a broker away at start, ...
                self.progress.blocked(f"kafka: {exc}")
                self.progress.check()
                self._stop.wait(RECONNECT_S)

    def _assign(self, consumer: Consumer) -> None:
        """Every partition of the topics, from the positions held (the beginning at first);
        raises while the broker cannot tell the partitions or their ends, or lists fewer
        than the view reads (its metadata behind a grow: assigned those, the others would
        never be asked for again, the probe taking them for read)."""
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        parts: list[Partition] = []
        for topic in self.topics:
            meta = consumer.list_topics(topic, timeout=5.0).topics[topic]
            if meta.error is not None:
                raise RuntimeError(f"{topic}: {meta.error}")
            parts += [(topic, p) for p in sorted(meta.partitions)]
        with self._lock:
            unlisted = set(self._view.positions()) - set(parts)
        if unlisted:  # a topic never shrinks: a broker's metadata behind a grow
            raise RuntimeError(
                f"the broker lists none of {sorted(unlisted)}, which this tail reads"
            )
        ends = {
            tp: consumer.get_watermark_offsets(TopicPartition(*tp), timeout=5.0)[1] for tp in parts
        }
        with self._changed:
            for t in self.topics:
                self._counted(t, sum(1 for pt, _ in parts if pt == t))
            self._view.assign(ends)
            at = self._view.positions()
            self._changed.notify_all()
        consumer.assign([TopicPartition(t, p, at[(t, p)] or OFFSET_BEGINNING) for t, p in parts])
        self.progress.advanced()

    def _step(self, consumer: Consumer) -> bool:
        """One batch; True when the broker answered with anything."""
        from confluent_kafka import KafkaException, TopicPartition

        messages = kafka.consume_ready(consumer, 500, 0.2)
        answered = False
        for msg in messages:
            tp = (msg.topic() or self.topics[0], msg.partition() or 0)
            if (err := msg.error()) is not None:
                if err.code() == PARTITION_EOF:
                    answered = True
                    with self._changed:
                        self._view.at_end(tp, msg.offset() or 0)
                        self._changed.notify_all()
                    continue
                if err.fatal():
                    raise KafkaException(err)
                self.progress.blocked(f"kafka: {err}")  # librdkafka retries by itself
                self.progress.check()
                continue
            answered = True
            record = record_of(msg, tp[0])
            with self._changed:
                kept = self._view.apply(record)
                self._changed.notify_all()
            if kept and self._on_record is not None:
                self._on_record(record)
        if answered:
            self.progress.advanced()
            with self._lock:
                parts = list(self._view.positions())
            for t, p in parts:
                _, high = consumer.get_watermark_offsets(TopicPartition(t, p), cached=True)
                if high >= 0:
                    with self._lock:
                        self._view.set_end((t, p), high)
            self._answered()
        return answered

    def _probe(self, consumer: Consumer) -> None:
        """Ask the broker for the topics' partitions: an idle tail has no message to prove
        the broker is there, and a topic grown has partitions the tail does not read yet."""
        try:
            self._add_partitions(consumer)
        except Exception as exc:
            self.progress.blocked(f"kafka: {exc}")
            self.progress.check()
        else:
            self.progress.advanced()
            self._answered()

    def _add_partitions(self, consumer: Consumer) -> None:
        """Assign the partitions of the topics that the broker has and the tail does not read
        yet (a topic grown), each from its beginning; the others keep their positions. Asked
        every ``probe_every_s``, busy or idle, and at once when ``placed`` learned a count
        above the partitions read. One
        without a leader yet is left to the next probe. Their ends are asked on the metadata
        consumer: on the reading one each query waits behind its fetch held by the broker
        (0.5 s a partition)."""
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        with self._lock:
            read = set(self._view.positions())
        new: list[Partition] = []
        counts: dict[str, int] = {}
        for topic in self.topics:
            meta = consumer.list_topics(topic, timeout=2.0).topics.get(topic)
            if meta is None or meta.error is not None or not meta.partitions:
                continue  # gone or not answered for: the records held stay
            counts[topic] = len(meta.partitions)
            new += [
                (topic, p)
                for p, part in sorted(meta.partitions.items())
                if (topic, p) not in read and part.leader >= 0
            ]
        ends: dict[Partition, int] = {}
        if new:  # asked with no fetch queued before them, by a client that knows the partitions
            asker = self._metadata_consumer()
            for topic in {t for t, _ in new}:
                asker.list_topics(topic, timeout=2.0)
            for tp in new:
                ends[tp] = asker.get_watermark_offsets(TopicPartition(*tp), timeout=2.0)[1]
        if new:  # assigned before the view holds them: one the consumer refused stays new
            consumer.incremental_assign([TopicPartition(*tp, OFFSET_BEGINNING) for tp in new])
        with self._changed:
            for topic, count in counts.items():
                if count not in self._counts.get(topic, ()):
                    self._counted(topic, count)
            if ends:
                self._view.assign(ends)
                self._changed.notify_all()
        if new:
            log.info(
                "tail %s: reading %d partition(s) added to %s",
                self.component,
                len(new),
                ", ".join(sorted({t for t, _ in new})),
            )
