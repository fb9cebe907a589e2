"""Where the agent, the gateway and the router put their Kafka events without waiting for
the broker, and without losing them when it is away or the process is killed.

``emit`` enqueues into librdkafka (acks=all, idempotent), so a request never waits on
Kafka. An event of a log topic (request logs, cache events, dead letters, audits) is first
appended to the client's write-ahead journal (``eventlog.journal``), so a process killed -9
right after loses none; states on compacted topics are not journaled (the next one replaces
them). An event the broker did not take goes to the client's durable spool
(``eventlog.spool``) and is replayed, oldest first, once the broker answers; while the spool
holds anything new events join its tail, so none overtakes an older one. What cannot be
kept is counted and logged (``dropped``, ``refused``, ``unjournaled``, ``after_close``), and
``emit`` never raises, so no caller can be crashed by the event it reports. After ``close``
nothing is reopened (the journal's and the spool's folder locks stay released): an event
emitted then is not sent and is counted as ``after_close``; a runtime stops every emitter
before it closes its sink. Delivery is at least once; an
event sent twice keeps its ``event_id``, by which ClickHouse and the scoring fold keep it
once. docs/worker.md ("The event journal", "The event spool") and docs/reliability.md give
the rules.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel

from loraplane.eventlog.journal import EventJournal, JournalUnavailable
from loraplane.eventlog.spool import EventSpool, SpooledEvent, SpoolUnavailable
from loraplane.kernel import kafka
from loraplane.kernel import metric_names as m
from loraplane.kernel.bus import MOVED_HEADER, KeyHomes
from loraplane.kernel.config import Settings
from loraplane.schemas.codec import encode

__all__ = [
    "DROP_LOG_S",
    "REPLAY_BATCH",
    "RETRY_S",
    "EventSink",
    "KafkaEventSink",
    "SinkMetrics",
    "poll_forever",
]

log = logging.getLogger(__name__)

REPLAY_BATCH = 500
"""Spooled events produced per replay round; the next round waits for their reports."""
RETRY_S = 2.0
"""Pause after a replay round with a failure (the broker is still away)."""
DROP_LOG_S = 10.0
"""At most one 'dropped' log line per this many seconds (each says the running count)."""


def _permanent_codes() -> frozenset[int]:
    from confluent_kafka import KafkaError

    names = (
        "MSG_SIZE_TOO_LARGE",
        "_MSG_SIZE_TOO_LARGE",
        "INVALID_MSG",
        "INVALID_MSG_SIZE",
        "INVALID_RECORD",
        "RECORD_LIST_TOO_LARGE",
        "_INVALID_ARG",
    )
    return frozenset(getattr(KafkaError, n) for n in names if hasattr(KafkaError, n))


class EventSink(Protocol):
    def emit(self, topic_suffix: str, key: str, message: BaseModel) -> None: ...


@dataclass
class _Round:
    """One replay round: the spool's head as peeked, and its delivery reports so far."""

    events: list[SpooledEvent]
    pending: int = 0
    failed: int = 0
    to_tail: bool = False  # it holds the whole spool, and nothing was spooled since


@dataclass
class _Counts:
    delivered: int = 0  # delivery reports without error (replayed ones included)
    failed: int = 0  # delivery reports with a permanent error: lost, logged
    refused: int = 0  # produce refused outright (too large, unknown topic): lost, logged
    spooled: int = 0  # written to the spool
    replayed: int = 0  # taken from the spool and delivered
    dropped: int = 0  # not taken by the spool (bound, disk): lost, counted, logged
    corrupt: int = 0  # spool lines that no longer parse: skipped, logged
    recovered: int = 0  # left in the journal by a killed process: spooled at this start
    unjournaled: int = 0  # sent without a journal record (disk error): a kill may lose them
    after_close: int = 0  # emitted after ``close``: not sent, lost, logged


@dataclass
class KafkaEventSink:
    """The one producer of a process's fire-and-forget events (``EventSink``)."""

    settings: Settings
    client_id: str
    clock: Callable[[], float] = time.monotonic
    counts: _Counts = field(default_factory=_Counts)

    def __post_init__(self) -> None:
        from loraplane.kernel.topics import TOPICS, topic_name

        self._topic_name = topic_name
        self._journaled = frozenset(
            t.suffix for t in TOPICS if t.cleanup_policy == "delete" and self.settings.event_journal
        )
        self._compacted = frozenset(
            topic_name(self.settings, t.suffix) for t in TOPICS if t.cleanup_policy == "compact"
        )
        self._homes = KeyHomes()  # where each key of a compacted topic was last delivered
        self._sends = 0  # compacted records sent: their order for ``KeyHomes``
        self._producer = kafka.producer(self.settings, client_id=self.client_id, linger_ms=20)
        self._permanent = _permanent_codes()
        self._spool_dir = self.settings.spool_dir / self.client_id
        self._spool: EventSpool | None = None
        self._spool_broken = False
        self._journal: EventJournal | None = None
        self._journal_broken = False
        self._round: _Round | None = None
        self._done: set[int] = set()  # head indices delivered in a round that failed
        self._next_round = 0.0
        self._last_drop_log = self._last_journal_log = self._last_closed_log = -math.inf
        self._closed = False  # by ``close``: nothing is sent, journaled or spooled after it
        self._lock = threading.RLock()  # delivery reports run in whichever thread polls
        if any(self._spool_dir.glob("*.spool")):  # a previous run's backlog: replay it
            self._open_spool()
        if any((self._spool_dir / "journal").glob("*.journal")):  # a killed run's events
            with self._lock:
                self._open_journal()

    # ---- counters the callers and tests read ----------------------------------------------
    @property
    def delivered(self) -> int:
        return self.counts.delivered

    @property
    def failed(self) -> int:
        return self.counts.failed

    @property
    def refused(self) -> int:
        return self.counts.refused

    @property
    def dropped(self) -> int:
        return self.counts.dropped

    @property
    def backlog(self) -> int:
        """Events in the spool, not yet delivered."""
        return self._spool.records if self._spool is not None else 0

    @property
    def backlog_bytes(self) -> int:
        return self._spool.bytes if self._spool is not None else 0

    @property
    def journal_pending(self) -> int:
        """Journaled events Kafka has not acknowledged (nor the spool taken) yet."""
        return self._journal.pending if self._journal is not None else 0

    # ---- sending --------------------------------------------------------------------------
    def emit(self, topic_suffix: str, key: str, message: BaseModel) -> None:
        try:
            value = encode(message)
            topic = self._topic_name(self.settings, topic_suffix)
            raw_key = key.encode()
        except Exception as exc:
            self._refuse(topic_suffix, key, exc)
            return
        with self._lock:
            if self._closed:
                self._refuse_closed(topic_suffix, key)
                return
            if self.backlog and not self._replaying_to_tail():
                self._to_spool(topic, raw_key, value)  # nothing overtakes the spool
                return
            seq = (
                self._journal_append(topic, raw_key, value)
                if topic_suffix in self._journaled
                else None
            )
            order = None
            if topic in self._compacted:
                self._sends += 1
                order = self._sends
            try:
                self._producer.produce(
                    topic,
                    key=raw_key,
                    value=value,
                    on_delivery=partial(self._on_delivery, seq, order),
                )
            except BufferError:  # librdkafka's queue is full: the broker is long away
                self._to_spool(topic, raw_key, value)
                self._journal_done(seq)
            except Exception as exc:  # KafkaException (MSG_SIZE_TOO_LARGE, ...)
                self._refuse(topic_suffix, key, exc)
                self._journal_done(seq)
            self._producer.poll(0)
            if self._journal is not None:
                self._journal.write_acks()

    def _replaying_to_tail(self) -> bool:
        """The spool's every event is produced, in a round without a failure so far: a new
        event produced now queues behind them (librdkafka keeps a partition's order), and
        if the broker fails it after all, it is spooled behind them. Without this, a steady
        load kept the sink in the spool for good after an outage or a restart (new events
        joined the tail faster than a round could find it empty)."""
        r = self._round
        return r is not None and r.to_tail and not r.failed

    def _refuse(self, topic_suffix: str, key: str, exc: Exception) -> None:
        self.counts.refused += 1
        log.error(
            "%s event for key %.64r not sent (%d refused so far): %s",
            topic_suffix,
            key,
            self.counts.refused,
            exc,
        )

    def _refuse_closed(self, topic_suffix: str, key: str) -> None:
        self.counts.after_close += 1
        now = self.clock()
        if now - self._last_closed_log >= DROP_LOG_S:
            self._last_closed_log = now
            log.error(
                "%s event for key %.64r emitted after %s's sink closed: not sent (%d so far); "
                "its emitter outlived the sink",
                topic_suffix,
                key,
                self.client_id,
                self.counts.after_close,
            )

    def _on_delivery(self, seq: int | None, order: int | None, err: Any, msg: Any) -> None:
        """A delivery report; ``order``: the send's place among those of compacted topics
        (``_moved``), None for another topic."""
        with self._lock:
            if err is None:
                self.counts.delivered += 1
                if order is not None and msg is not None:
                    self._moved(msg, order)
            elif err.code() in self._permanent:
                self._lose(msg, err)
            else:
                self._to_spool(msg.topic(), msg.key(), msg.value())
            self._journal_done(seq)

    def _moved(self, msg: Any, order: int) -> None:
        """A compacted record delivered: when its key's previous one went to another
        partition (the topic grew), leave a tombstone there (``bus.MOVED_HEADER``) so
        compaction removes what is left of the key on it; readers skip that tombstone. It is
        sent to that partition only, never spooled (a spooled tombstone would be replayed to
        the key's home and remove its state)."""
        key = msg.key() or b""
        before = self._homes.delivered(
            msg.topic(), key, msg.partition(), order, tombstone=msg.value() is None
        )
        if before is None:
            return
        try:
            self._producer.produce(
                msg.topic(),
                key=key,
                value=None,
                partition=before,
                headers=[(MOVED_HEADER, str(msg.partition()).encode())],
                on_delivery=self._on_moved,
            )
        except Exception as exc:  # BufferError, KafkaException: the record stays behind
            log.warning("no tombstone left on %s[%d]: %s", msg.topic(), before, exc)
            return
        log.info(
            "%s: key %.64r moved from partition %d to %d; tombstone left on %d",
            msg.topic(),
            key,
            before,
            msg.partition(),
            before,
        )

    @staticmethod
    def _on_moved(err: Any, msg: Any) -> None:
        if err is not None:
            log.warning(
                "tombstone on %s[%s] not delivered (the record there stays): %s",
                msg.topic(),
                msg.partition(),
                err,
            )

    def _lose(self, msg: Any, err: Any) -> None:
        self.counts.failed += 1
        log.error(
            "event on %s not delivered for good (%d so far): %s",
            msg.topic(),
            self.counts.failed,
            err,
        )

    # ---- the journal ----------------------------------------------------------------------
    def _open_journal(self) -> EventJournal | None:
        """The journal, opened on first use; a killed run's leftovers go to the spool. None
        after ``close``: its folder lock stays released."""
        if self._journal is None and not self._journal_broken and not self._closed:
            try:
                journal = EventJournal(self._spool_dir / "journal")
            except JournalUnavailable as exc:
                self._journal_broken = True
                log.error(
                    "no event journal for %s (a kill -9 loses the events Kafka has not "
                    "acknowledged yet; counted as unjournaled): %s",
                    self.client_id,
                    exc,
                )
                return None
            taken = self._spool_recovered(journal)
            if taken < len(journal.recovered):
                log.error(
                    "event journal %s: the spool took %d of the %d events a stopped process "
                    "had not delivered; its segments stay for the next start",
                    journal.directory,
                    taken,
                    len(journal.recovered),
                )
                journal.keep()
            else:
                journal.forget()
            self._journal = journal
        return self._journal

    def _spool_recovered(self, journal: EventJournal) -> int:
        """Spool a killed run's leftovers, oldest first, until the spool refuses one (its
        bound, a full disk, no spool): how many it took. The journal keeps all of them
        unless it took every one, so none is lost (those it took come back once more at
        the next start: at least once, kept once downstream by their event id)."""
        events = journal.recovered
        if not events:
            return 0
        spool = self._open_spool()
        taken = 0
        while (
            spool is not None
            and taken < len(events)
            and spool.append(events[taken].topic, events[taken].key, events[taken].value)
        ):
            taken += 1
        self.counts.spooled += taken
        self.counts.recovered += taken
        if taken and self._round is not None:
            self._round.to_tail = False
        if spool is not None:
            spool.sync()
        if taken:
            log.warning(
                "event journal %s: %d events a stopped process had not delivered, "
                "spooled for replay",
                journal.directory,
                taken,
            )
        return taken

    def _journal_append(self, topic: str, key: bytes, value: bytes) -> int | None:
        journal = self._open_journal()
        if journal is not None:
            try:
                return journal.append(topic, key, value)
            except OSError as exc:
                error: object = exc
        else:
            error = "no journal"
        self.counts.unjournaled += 1
        now = self.clock()
        if now - self._last_journal_log >= DROP_LOG_S:
            self._last_journal_log = now
            log.error(
                "%d events sent without a journal record so far by %s (%s)",
                self.counts.unjournaled,
                self.client_id,
                error,
            )
        return None

    def _journal_done(self, seq: int | None) -> None:
        if seq is not None and self._journal is not None:
            self._journal.done(seq)

    @property
    def unsynced(self) -> bool:
        """The journal has writes that are not fsynced yet."""
        return self._journal is not None and self._journal.unsynced

    def sync(self) -> None:
        """fsync the journal's writes since the last call (safe from another thread)."""
        journal = self._journal
        if journal is not None:
            journal.sync()

    # ---- the spool ------------------------------------------------------------------------
    def _open_spool(self) -> EventSpool | None:
        """The spool, opened on first use; None after ``close`` (its folder lock stays
        released: a report served later is counted as dropped)."""
        if self._spool is None and not self._spool_broken and not self._closed:
            try:
                self._spool = EventSpool(self._spool_dir, self.settings.spool_max_bytes)
            except SpoolUnavailable as exc:
                self._spool_broken = True
                log.error(
                    "no event spool for %s (events Kafka does not take will be "
                    "dropped and counted): %s",
                    self.client_id,
                    exc,
                )
            else:
                if self._spool.records:
                    log.warning(
                        "event spool %s: %d events (%d bytes) to replay",
                        self._spool_dir,
                        self._spool.records,
                        self._spool.bytes,
                    )
        return self._spool

    def _to_spool(self, topic: str, key: bytes | None, value: bytes) -> None:
        spool = self._open_spool()
        if spool is not None and spool.append(topic, key, value):
            self.counts.spooled += 1
            if self._round is not None:
                self._round.to_tail = False
            return
        self.counts.dropped += 1
        now = self.clock()
        if now - self._last_drop_log >= DROP_LOG_S:
            self._last_drop_log = now
            why = (
                "the sink is closed"
                if self._closed
                else "no spool"
                if spool is None
                else f"spool full: {spool.bytes} of {spool.max_bytes} bytes"
            )
            log.error(
                "%d events dropped so far by %s (%s)", self.counts.dropped, self.client_id, why
            )

    def poll(self) -> None:
        """Serve delivery reports, make the spool durable, and replay from it."""
        self._producer.poll(0)
        with self._lock:
            if self._journal is not None:
                self._journal.write_acks()
            if self._spool is not None:
                self._spool.sync()
                self._replay()

    def _replay(self) -> None:
        spool = self._spool
        assert spool is not None
        r = self._round
        if r is not None:
            if r.pending:
                return
            self._round = None
            if r.failed:
                self._next_round = self.clock() + RETRY_S
            else:
                spool.commit(r.events)
                self._done.clear()
        if not spool.records or self.clock() < self._next_round:
            return
        r = self._round = _Round(spool.peek(REPLAY_BATCH))
        r.to_tail = len(r.events) == spool.records
        for i, event in enumerate(r.events):
            if i in self._done:
                continue
            if not event.topic:
                self.counts.corrupt += 1
                log.error("event spool %s: skipped a line that does not parse", spool.directory)
                self._done.add(i)
                continue
            try:
                self._producer.produce(
                    event.topic,
                    key=event.key,
                    value=event.value,
                    on_delivery=partial(self._on_replayed, r, i),
                )
            except BufferError:
                r.failed += 1
                break
            except Exception as exc:
                self._done.add(i)
                self._refuse(event.topic, repr(event.key), exc)
                continue
            r.pending += 1

    def _on_replayed(self, r: _Round, i: int, err: Any, msg: Any) -> None:
        with self._lock:
            r.pending -= 1
            if err is None:
                self.counts.delivered += 1
                self.counts.replayed += 1
                self._done.add(i)
            elif err.code() in self._permanent:
                self._lose(msg, err)
                self._done.add(i)
            else:
                r.failed += 1

    # ---- stopping -------------------------------------------------------------------------
    def flush(self, timeout_s: float = 5.0) -> int:
        """Wait for outstanding deliveries and the spool's replay; returns how many events
        are still undelivered (queued in librdkafka or spooled)."""
        deadline = time.monotonic() + timeout_s
        while True:
            queued = self._producer.flush(max(0.0, min(0.5, deadline - time.monotonic())))
            self.poll()
            left = queued + self.backlog
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)

    def close(self, timeout_s: float = 5.0) -> int:
        """``flush``, then spool what librdkafka still holds (so it survives the stop), then
        close the journal once its writes are on the disk (after a sync still running in
        ``poll_forever``'s thread, up to ``timeout_s``); returns how many events are spooled
        for the next start. From then on nothing is reopened: ``emit`` counts the event as
        ``after_close`` and sends nothing."""
        if self.flush(timeout_s):
            try:
                self._producer.purge(in_queue=True, in_flight=True)
            except Exception as exc:  # a fake or an old client: keep what we have
                log.warning("could not purge the producer queue: %s", exc)
            self._producer.flush(1.0)  # serves the purge's reports: they go to the spool
        with self._lock:
            self._closed = True
            left = self.backlog
            if self._spool is not None:  # its lock goes too: a later sink may open it
                self._spool.close()
                self._spool = None
            if self._journal is not None:  # what is still pending stays for the next start
                # after a sync still running in poll_forever's thread (its task cancelled)
                self._journal.close(timeout_s)
                self._journal = None
            if left:
                log.warning("%d events spooled in %s for the next start", left, self._spool_dir)
        return left


async def poll_forever(sink: KafkaEventSink, every_s: float = 0.2) -> None:
    """A process's background task: delivery reports, spool durability and replay, and the
    journal's group commit (its fsync, in a thread: the event loop never waits on the
    disk)."""
    import asyncio

    failures = 0
    while True:
        try:
            sink.poll()
            if sink.unsynced:
                await asyncio.to_thread(sink.sync)
        except Exception:  # one bad poll must not end polling for the process's life
            failures += 1
            if failures & (failures - 1) == 0:  # the 1st, 2nd, 4th, 8th...: never a flood
                log.exception("event sink poll failed (%d so far)", failures)
        await asyncio.sleep(every_s)


class SinkMetrics(Collector):
    """The sink's counters and spool on a process's ``/metrics``: a loss is never silent."""

    def __init__(self, sink: KafkaEventSink) -> None:
        self.sink = sink

    def collect(self) -> Iterator[Metric]:
        c, labels = self.sink.counts, ["client"]
        for name, value, text in (
            (m.SINK_DELIVERED, c.delivered, "Events Kafka acknowledged"),
            (m.SINK_SPOOLED, c.spooled, "Events written to the local spool"),
            (m.SINK_REPLAYED, c.replayed, "Spooled events delivered later"),
            (m.SINK_DROPPED, c.dropped, "Events lost: the spool could not take them"),
            (
                m.SINK_REFUSED,
                c.refused + c.failed + c.after_close,
                "Events lost: Kafka refused them for good (too large, invalid), or they were "
                "emitted after the sink closed",
            ),
            (
                m.SINK_RECOVERED,
                c.recovered,
                "Events a killed process left in its journal, spooled at this start",
            ),
            (
                m.SINK_UNJOURNALED,
                c.unjournaled,
                "Events sent without a journal record (a disk error): a kill -9 before "
                "Kafka's ack would lose them",
            ),
        ):
            family = CounterMetricFamily(name, text, labels=labels)
            family.add_metric([self.sink.client_id], value)
            yield family
        for name, value, text in (
            (m.SINK_SPOOL_EVENTS, self.sink.backlog, "Events waiting in the spool"),
            (m.SINK_SPOOL_BYTES, self.sink.backlog_bytes, "Bytes of the spool"),
            (
                m.SINK_JOURNAL_EVENTS,
                self.sink.journal_pending,
                "Journaled events not yet acknowledged by Kafka",
            ),
        ):
            gauge = GaugeMetricFamily(name, text, labels=labels)
            gauge.add_metric([self.sink.client_id], value)
            yield gauge
