"""Kafka -> ClickHouse: the consumer group that fills the raw metric tables.

A confluent-kafka consumer, not a Faust agent: the sink is a pure batch mover, and
``consume(num_messages, timeout)`` hands over batches in the shape of a columnar insert with
explicit, synchronous offset commits. Batches close by size or age; offsets are committed
only after every row of the batch was inserted (or dead-lettered), in order, so a crash
replays a batch whose rows collapse under ``FINAL`` (ReplacingMergeTree by event id): counts
stay exact. One batch is inserted in a writer thread while the next is decoded. Rows go
straight into one list per column (no row tuples to transpose); request logs (most rows) are
decoded a batch at a time by a compiled decoder that fills the columns from the bytes
(``Table.fast_columns``), pydantic deciding whatever it leaves; timestamp columns go to the
driver as integers, by the column types read from the server at each (re)connection. ClickHouse
or Kafka away: the partitions are paused and the batch retried with backoff, and every
(re)assignment resumes what it hands over, so a rebalance never leaves one paused. A message
that does not decode or a row ClickHouse rejects goes to the dead-letters topic with its
reason. docs/reliability.md, "The metrics sink: every row once", gives the rules.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from clickhouse_driver import errors as ch_errors

from loraplane.kernel import collector, kafka
from loraplane.kernel.bus import DeliveryError
from loraplane.kernel.progress import Progress, Watchdog
from loraplane.kernel.topics import topic_name
from loraplane.metrics.clickhouse import connect
from loraplane.metrics.tables import (
    TABLES,
    Columns,
    Encoders,
    RowError,
    Table,
    add_row,
    encoded,
    encoders_for,
)
from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.dead_letter import STAMP_END, STAMP_MIN, DeadLetter, dead_letter_for
from loraplane.schemas.reasons import ConsumerFault

if TYPE_CHECKING:
    from clickhouse_driver import Client
    from confluent_kafka import Consumer, Message, Producer

    from loraplane.kernel.config import Settings

__all__ = ["COMPONENT", "DATA_ERROR_CODES", "Sink", "SinkConfig", "SinkStats", "column_encoders"]

log = logging.getLogger("loraplane.metrics.sink")

COMPONENT = "metrics-sink"
# Batches alive at once: the one being read, the one being decoded, the one being inserted,
# and slack for a rebalance's overlap.
_BATCHES_ALIVE = 4
# How long a close waits for the dead-letter producer to deliver what it holds.
_CLOSE_FLUSH_S = 20.0
# ClickHouse error codes that mean "this data is wrong", not "try again later".
DATA_ERROR_CODES = frozenset({6, 26, 27, 32, 38, 41, 53, 69, 70, 72, 117, 131, 321})


@dataclass(frozen=True)
class SinkConfig:
    batch_size: int = 20_000  # fewer, larger inserts: docs/benchmarks.md, "Metrics sink"
    max_wait_s: float = 1.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 15.0
    group_id: str | None = None  # default: "<topic_prefix>.metrics-sink"
    # A dead member holds its partitions until this expires (librdkafka's default is 45 s);
    # a restarted sink resumes sooner with a shorter one. The broker's minimum is 6 s.
    session_timeout_ms: int = 10_000
    # How far from the sink's clock a row's ``ts`` may be (None: no bound). The raw tables
    # are partitioned by day and 18.16 has no per-insert partition limit: a topic writer
    # stamping rows across decades would make a partition per day. Rows outside go to the
    # dead letters as ``outside_window``; a year and more covers any backlog Kafka keeps.
    max_row_age_s: float | None = 400 * 86_400.0
    max_row_ahead_s: float | None = 86_400.0


@dataclass
class SinkStats:
    batches: int = 0
    rows: int = 0
    dead_letters: int = 0
    dead_letters_lost: int = 0  # refused by the broker for good (logged): never a stall
    retries: int = 0
    by_table: dict[str, int] = field(default_factory=dict)


@dataclass
class _Rows:
    """One table's rows of a batch, as the insert's columns, and the message each row came
    from (for its dead letter), in the same order."""

    columns: Columns
    messages: list[Message]

    def __len__(self) -> int:
        return len(self.messages)

    @property
    def rows(self) -> list[tuple[Any, ...]]:
        """The rows, a tuple each (a view built on demand; the insert takes the columns)."""
        return list(zip(*self.columns, strict=True))


@dataclass
class _Batch:
    """One batch, decoded: rows per table and dead letters."""

    rows: dict[str, _Rows] = field(default_factory=dict)
    dead: list[DeadLetter] = field(default_factory=list)
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)


@dataclass
class _InFlight:
    """A decoded batch whose first insert attempt runs in the writer thread."""

    messages: list[Message]
    batch: _Batch
    insert: Future[None]


def _transient() -> tuple[type[BaseException], ...]:
    """Failures that mean "not now": the batch is retried, never dead-lettered."""
    from confluent_kafka import KafkaException

    return ch_errors.Error, OSError, EOFError, DeliveryError, KafkaException


_TOO_MANY_PARTITIONS = "partitions for single insert block"
"""How current ClickHouse words code 252 when one insert's rows fall in more partitions
(days, here) than ``max_partitions_per_insert_block`` (100) allows. The same code also means
"too many parts" (merges behind inserts), which is transient."""


def _too_many_partitions(exc: BaseException) -> bool:
    """An insert refused for spanning too many partitions: fewer rows at a time fit."""
    return (
        isinstance(exc, ch_errors.ServerException)
        and exc.code == 252
        and _TOO_MANY_PARTITIONS in str(exc).lower()
    )


_DAYS_PER_INSERT = 100
"""Current ClickHouse's default ``max_partitions_per_insert_block``: the days (partitions)
one insert may hold when a batch's rows span more."""


def _by_day(stamps: list[datetime]) -> list[list[int]]:
    """The indices of ``stamps`` in groups of at most ``_DAYS_PER_INSERT`` days (UTC, the
    tables' partitions), days in order, each day's rows in their own order."""
    days: dict[Any, list[int]] = {}
    for i, ts in enumerate(stamps):
        days.setdefault(ts.date(), []).append(i)
    ordered = [days[day] for day in sorted(days)]
    return [
        [i for day in ordered[at : at + _DAYS_PER_INSERT] for i in day]
        for at in range(0, len(ordered), _DAYS_PER_INSERT)
    ]


def _is_rejection(exc: BaseException) -> bool:
    if isinstance(exc, ch_errors.ServerException):
        return exc.code in DATA_ERROR_CODES
    return isinstance(
        exc, ch_errors.TypeMismatchError | ValueError | OverflowError | TypeError | struct.error
    )


def _position(msg: Message) -> tuple[str, int, int]:
    """Topic, partition and offset of a consumed message. confluent-kafka types them optional
    (a message being produced has none yet); every message a poll returns has all three."""
    topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
    if topic is None or partition is None or offset is None:
        raise ValueError(f"consumed message without a position: {topic}:{partition}:{offset}")
    return topic, partition, offset


def column_encoders(client: Client) -> dict[str, Encoders]:
    """Per table, how its values are written (``tables.encoders_for``), from the column types
    of the connected database."""
    types: dict[str, dict[str, str]] = {}
    for table, name, kind in client.execute(
        "SELECT table, name, type FROM system.columns WHERE database = currentDatabase()"
    ):
        types.setdefault(table, {})[name] = kind
    return {t.name: encoders_for(t, types.get(t.name, {})) for t in TABLES}


def _instant(seconds: float) -> datetime:
    """Epoch seconds as an aware UTC datetime, clamped to ``DateTime``'s range."""
    bounded = min(max(seconds, STAMP_MIN.timestamp()), STAMP_END.timestamp())
    return datetime.fromtimestamp(bounded, UTC)


def _within(
    rows: _Rows, table: Table, window: tuple[datetime, datetime], dead: list[DeadLetter]
) -> _Rows:
    """``rows`` whose ``ts`` lies in ``window``; the others' messages join ``dead`` as
    ``outside_window``. One min/max pass when every row is inside (the usual batch)."""
    lo, hi = window
    stamps = rows.columns[table.columns.index("ts")]
    if not stamps or (lo <= min(stamps) and max(stamps) < hi):
        return rows
    keep = [i for i, ts in enumerate(stamps) if lo <= ts < hi]
    kept = set(keep)
    for i, ts in enumerate(stamps):
        if i not in kept:
            detail = (
                f"ts={ts.isoformat()} is outside the sink's window "
                f"[{lo.isoformat()}, {hi.isoformat()})"
            )
            dead.append(
                dead_letter_for(rows.messages[i], COMPONENT, ConsumerFault.outside_window, detail)
            )
    return _Rows(
        [[column[i] for i in keep] for column in rows.columns],
        [rows.messages[i] for i in keep],
    )


class Sink:
    """One member of the metrics-sink consumer group. ``run`` blocks until ``stop`` is set."""

    def __init__(
        self,
        settings: Settings,
        config: SinkConfig = SinkConfig(),
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.settings = settings
        self.config = config
        self.stats = SinkStats()
        self._sleep = sleep
        self._tables: dict[str, Table] = {topic_name(settings, t.topic_suffix): t for t in TABLES}
        self._dead_letter_topic = topic_name(settings, "dead-letters")
        self._client: Client | None = None
        self._producer: Producer | None = None
        self._encoders: dict[str, Encoders] = {}
        self._revoked = False
        self.progress = Progress(COMPONENT)

    @property
    def group_id(self) -> str:
        return self.config.group_id or f"{self.settings.topic_prefix}.metrics-sink"

    def _consumer(self) -> Consumer:
        consumer = kafka.consumer(
            self.settings,
            self.group_id,
            client_id=COMPONENT,
            session_timeout_ms=self.config.session_timeout_ms,
            quiet=True,
        )
        consumer.subscribe(list(self._tables), on_assign=self._on_assign, on_revoke=self._on_revoke)
        return consumer

    def _on_revoke(self, consumer: Consumer, partitions: list[Any]) -> None:
        # Called inside consume(); the loop reacts once consume returns (see _rewind).
        self._revoked = True

    @staticmethod
    def _on_assign(consumer: Consumer, partitions: list[Any]) -> None:
        """Take the partitions and resume them: librdkafka keeps a partition's pause flag
        across a revoke and a re-assign, so partitions paused by a backoff that a rebalance
        interrupted would otherwise never be fetched again."""
        consumer.assign(partitions)
        if partitions:
            consumer.resume(partitions)

    def run(self, stop: threading.Event | None = None) -> SinkStats:
        stop = stop or threading.Event()
        # Every consumed message is an object the cyclic collector tracks: at CPython's
        # threshold (700) a young collection ran every 700 rows, and the middle and full ones
        # after them, each scanning the batches alive, about 1 us a row in all. Above what
        # the sink holds alive, a collection runs when garbage does pile up.
        collector.collect_the_young_after(_BATCHES_ALIVE * self.config.batch_size)
        consumer = self._consumer()
        writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics-sink-insert")
        watchdog = Watchdog([self.progress]).start()
        pending: list[Message] = []
        inflight: _InFlight | None = None
        opened = 0.0
        try:
            while not stop.is_set():
                wait = (
                    self.config.max_wait_s
                    if not pending
                    else max(0.0, opened + self.config.max_wait_s - time.monotonic())
                )
                if inflight is not None:
                    wait = min(wait, 0.05)  # look at the insert soon: commit it, or retry it
                got = self._messages(
                    consumer.consume(
                        num_messages=self.config.batch_size - len(pending), timeout=min(wait, 0.5)
                    )
                )
                if self._revoked:
                    self._settle(inflight)
                    self._rewind(consumer, (inflight.messages if inflight else []) + pending + got)
                    inflight, pending, got = None, [], []
                if got and not pending:
                    opened = time.monotonic()
                pending += got
                if inflight is not None and inflight.insert.done():
                    if not self._deliver(consumer, inflight, stop, later=pending):
                        pending = []  # rewound, or stopping: replayed after the earlier batch
                    inflight = None
                due = time.monotonic() >= opened + self.config.max_wait_s
                if pending and (len(pending) >= self.config.batch_size or due):
                    inflight = self._hand_over(consumer, inflight, pending, writer, stop)
                    pending = []
            if pending:
                inflight = self._hand_over(consumer, inflight, pending, writer, stop)
            if inflight is not None:
                self._deliver(consumer, inflight, stop, later=[])
        finally:
            watchdog.stop()
            writer.shutdown(wait=True)
            consumer.close()
            self.close()
        return self.stats

    def close(self, flush_s: float = _CLOSE_FLUSH_S) -> None:
        """End the sink's connections: the dead-letter producer flushed first
        (``_drop_producer``), then ClickHouse's client. ``run`` ends with it."""
        self._drop_producer(flush_s)
        if self._client is not None:
            self._client.disconnect()
            self._client = None

    def _hand_over(
        self,
        consumer: Consumer,
        inflight: _InFlight | None,
        messages: list[Message],
        writer: ThreadPoolExecutor,
        stop: threading.Event,
    ) -> _InFlight | None:
        """Decode ``messages`` (while the previous batch is still being inserted), deliver
        the previous batch, then start inserting this one. None when the previous batch was
        not committed: this one is then dropped too and read again after it."""
        batch = self.decode(messages, time.time())
        if inflight is not None and not self._deliver(consumer, inflight, stop, later=messages):
            return None
        return _InFlight(messages, batch, writer.submit(self._write, batch))

    @staticmethod
    def _settle(inflight: _InFlight | None) -> None:
        """Wait for an insert whose batch is about to be dropped (after a rebalance). Its
        rows may have landed; they collapse when the batch is replayed."""
        if inflight is not None:
            with contextlib.suppress(*_transient()):
                inflight.insert.result()

    def _rewind(self, consumer: Consumer, dropped: list[Message]) -> None:
        """Forget uncommitted messages after a rebalance without skipping them: partitions we
        still own are sought back to the first dropped offset; the others are re-read by
        their new owner from the committed offset."""
        self._revoked = False
        self._seek_first(consumer, dropped)

    @staticmethod
    def _seek_first(consumer: Consumer, dropped: list[Message]) -> None:
        """Seek each owned partition of ``dropped`` back to its first dropped offset."""
        from confluent_kafka import KafkaException, TopicPartition

        first: dict[tuple[str, int], int] = {}
        for msg in dropped:
            topic, partition, offset = _position(msg)
            first.setdefault((topic, partition), offset)
        owned = {(tp.topic, tp.partition) for tp in consumer.assignment()}
        for (topic, partition), offset in first.items():
            if (topic, partition) in owned:
                # Not yet fetching (just assigned) means it starts at the committed offset.
                with contextlib.suppress(KafkaException):
                    consumer.seek(TopicPartition(topic, partition, offset))

    @staticmethod
    def _messages(got: list[Message]) -> list[Message]:
        from confluent_kafka import KafkaException

        good = []
        for msg in got:
            err = msg.error()
            if err is None:
                good.append(msg)
            elif err.fatal():
                raise KafkaException(err)
            else:
                log.warning("kafka: %s", err)
        return good

    def decode(self, messages: list[Message], now: float | None = None) -> _Batch:
        """Pure but for the clock (``now``, epoch seconds: by default the time of the call):
        messages -> rows per table and dead letters (no I/O). A table's ``fast_columns``
        fills most rows' columns straight from the bytes; what it leaves is validated by the
        wire schema, which builds the row or names the reason for the dead letter. A row
        stamped outside the config's window around ``now`` is a dead letter too."""
        batch = _Batch()
        window = self._window(time.time() if now is None else now)
        # Grouped by topic, the last offset per partition: a consumed batch comes in runs of
        # one partition, so the run's list and offsets are looked up once a run, and no
        # object is made a message.
        by_topic: dict[str | None, tuple[list[Message], dict[int | None, int | None]]] = {}
        topic: str | None = None
        same: list[Message] = []
        last: dict[int | None, int | None] = {}
        for msg in messages:
            if msg.topic() != topic:
                topic = msg.topic()
                group = by_topic.get(topic)
                if group is None:
                    group = by_topic[topic] = ([], {})
                same, last = group
            same.append(msg)
            last[msg.partition()] = msg.offset()
        for name, (got, at) in by_topic.items():
            for partition, offset in at.items():
                if name is None or partition is None or offset is None:
                    raise ValueError(f"consumed message without a position: {name}:{partition}")
                batch.offsets[(name, partition)] = offset
            if name is not None:  # checked above: every group holds a message
                table = self._tables[name]
                rows = self._rows(table, got, batch.dead)
                batch.rows[table.name] = _within(rows, table, window, batch.dead)
        return batch

    def _window(self, now: float) -> tuple[datetime, datetime]:
        """The instants a row's ``ts`` may take at ``now``: from ``max_row_age_s`` before it
        up to, not including, ``max_row_ahead_s`` after it (within ``DateTime``'s range)."""
        age, ahead = self.config.max_row_age_s, self.config.max_row_ahead_s
        lo = STAMP_MIN if age is None else _instant(now - age)
        hi = STAMP_END if ahead is None else _instant(now + ahead)
        return lo, hi

    @staticmethod
    def _rows(table: Table, messages: list[Message], dead: list[DeadLetter]) -> _Rows:
        """One table's messages -> its rows; refusals are appended to ``dead``."""
        slow = messages
        if table.fast_columns is not None:
            columns, left = table.fast_columns([msg.value() for msg in messages])
            if not left:
                return _Rows(columns, messages)
            leave = set(left)
            rows = _Rows(columns, [m for i, m in enumerate(messages) if i not in leave])
            slow = [messages[i] for i in left]
        else:
            rows = _Rows([[] for _ in table.columns], [])
        for msg in slow:
            try:
                row = table.row(decode(table.model, msg.value()))
            except SchemaError as exc:
                dead.append(dead_letter_for(msg, COMPONENT, exc.reason, str(exc)))
                continue
            except RowError as exc:
                dead.append(dead_letter_for(msg, COMPONENT, ConsumerFault.out_of_range, str(exc)))
                continue
            add_row(rows.columns, row)
            rows.messages.append(msg)
        return rows

    def _deliver(
        self, consumer: Consumer, flight: _InFlight, stop: threading.Event, later: list[Message]
    ) -> bool:
        """Finish the batch's insert (the writer's attempt, then retries here), commit it.
        On transient failure pause and retry the same batch. False when it was not committed
        (a rebalance, or ``stop`` during retries); after a rebalance it and ``later`` (the
        messages read after it) are rewound."""
        messages, batch = flight.messages, flight.batch
        attempt: Future[None] | None = flight.insert
        delay = self.config.backoff_initial_s
        paused: list[Any] = []
        try:
            while True:
                try:
                    if attempt is not None:
                        first, attempt = attempt, None
                        first.result()
                    else:
                        self._write(batch)
                    if self._revoked:
                        self._rewind(consumer, messages + later)
                        return False
                    self._commit(consumer, batch)
                    break
                except _transient() as exc:
                    if self._client is not None:
                        self._client.disconnect()
                        self._client = None  # reconnect, and read the column types again
                    self.stats.retries += 1
                    why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    self.progress.blocked(f"batch of {len(messages)} not delivered: {why}")
                    log.warning(
                        "batch of %d not delivered (%s); retrying in %.1fs",
                        len(messages),
                        why,
                        delay,
                    )
                    if not paused:
                        paused = consumer.assignment()
                        consumer.pause(paused)
                    waited = self._wait(consumer, delay)
                    delay = min(delay * 2, self.config.backoff_max_s)
                    if self._revoked:
                        self._rewind(consumer, messages + later + waited)
                        return False
                    self._seek_first(consumer, waited)  # read while paused: read it again
                    if stop.is_set():
                        return False  # uncommitted: replayed by whoever owns them next
        finally:
            if paused:
                self._resume_owned(consumer, paused)
        self.stats.batches += 1
        self.progress.advanced()
        return True

    @staticmethod
    def _resume_owned(consumer: Consumer, paused: list[Any]) -> None:
        """Resume what we paused and still own (a rebalance may have taken some away;
        those it gave back were resumed on assignment already)."""
        from confluent_kafka import KafkaException

        owned = {(tp.topic, tp.partition) for tp in consumer.assignment()}
        mine = [tp for tp in paused if (tp.topic, tp.partition) in owned]
        if mine:
            with contextlib.suppress(KafkaException):
                consumer.resume(mine)

    def _wait(self, consumer: Consumer, seconds: float) -> list[Message]:
        """Back off while still polling, so the group keeps us (and rebalances reach us).
        Ends early at a rebalance. Returns the messages it read anyway (a partition the
        rebalance assigned, resumed, is fetched at once): the caller rewinds them, so no
        message is skipped."""
        deadline = time.monotonic() + seconds
        read: list[Message] = []
        while (left := deadline - time.monotonic()) > 0 and not self._revoked:
            read += [
                msg
                for msg in consumer.consume(num_messages=100, timeout=min(left, 0.5))
                if msg.error() is None
            ]
        return read

    def _write(self, batch: _Batch) -> None:
        client, encoders = self._connected()
        rejected: list[DeadLetter] = []
        for table in TABLES:
            rows = batch.rows.get(table.name)
            if not rows:
                continue
            for msg, why in self._insert(
                client, table, encoders.get(table.name, {}), rows.columns, rows.messages
            ):
                if msg.topic() == self._dead_letter_topic:
                    log.error(
                        "dead letter %s:%d:%d rejected by ClickHouse: %s",
                        msg.topic(),
                        msg.partition(),
                        msg.offset(),
                        why,
                    )
                else:
                    rejected.append(
                        dead_letter_for(msg, COMPONENT, ConsumerFault.clickhouse_rejected, why)
                    )
            self.stats.by_table[table.name] = self.stats.by_table.get(table.name, 0) + len(rows)
        self._send_dead_letters(batch.dead + rejected)
        self.stats.rows += sum(len(v) for v in batch.rows.values())

    def _insert(
        self,
        client: Client,
        table: Table,
        encoders: Encoders,
        columns: Columns,
        messages: list[Message],
    ) -> list[tuple[Message, str]]:
        """Insert all rows; when ClickHouse rejects the data, bisect to find the bad rows and
        return their messages with the reason (everything else is inserted). Rows that span
        more days than one insert may hold (a backlog, or logs stamped on every day of the
        window by whoever may write the topic) are inserted 100 days at a time, day by day
        (halves of rows in arrival order made hundreds of inserts of a batch, and a part
        per day each), then in halves should the server's limit be lower: one row is in one
        partition, so none is refused for it and the batch is never retried forever."""
        try:
            # No types_check: every row was validated by its wire schema and range-checked by
            # Table.row, so the driver's per-value Python checks (a quarter of the insert's
            # client time) are redundant; worse, they mask out-of-range ints into range. The
            # driver still refuses any value its binary packing cannot hold (TypeMismatchError).
            client.execute(table.insert_sql, encoded(columns, encoders), columnar=True)
            return []
        except Exception as exc:
            split = _too_many_partitions(exc) and len(messages) > 1
            if not split and not _is_rejection(exc):
                raise
            if len(messages) == 1:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                return [(messages[0], f"{type(exc).__name__}: {first}")]
            if split and len(groups := _by_day(columns[table.columns.index("ts")])) > 1:
                refused: list[tuple[Message, str]] = []
                for rows in groups:
                    part = [[column[i] for i in rows] for column in columns]
                    refused += self._insert(
                        client, table, encoders, part, [messages[i] for i in rows]
                    )
                return refused
            mid = len(messages) // 2
            head, tail = [c[:mid] for c in columns], [c[mid:] for c in columns]
            return self._insert(client, table, encoders, head, messages[:mid]) + self._insert(
                client, table, encoders, tail, messages[mid:]
            )

    def _send_dead_letters(self, letters: list[DeadLetter]) -> None:
        """Produce the batch's dead letters before its offsets are committed. A broker that
        is away (a timeout, a retriable error) fails the batch, which is retried; a letter
        the broker refuses for good (which the size bound of ``dead_letter_at`` should make
        impossible) is counted in ``dead_letters_lost`` and logged instead, so one bad
        letter can never stall the sink. One producer serves every batch (an idempotent
        producer's set-up is a SASL login and a producer-id round trip: one bad message a
        batch must not cost that a batch); a failed delivery drops it, and the retry starts
        a fresh one."""
        from confluent_kafka import KafkaError, KafkaException

        if not letters:
            return
        if self._producer is None:
            self._producer = kafka.producer(self.settings)
        p = self._producer
        failures: list[str] = []
        lost: list[tuple[DeadLetter, str]] = []

        def on_delivery(letter: DeadLetter) -> Any:
            def report(err: Any, _msg: Any) -> None:
                if err is None:
                    return
                if err.retriable() or err.code() == KafkaError._MSG_TIMED_OUT:
                    failures.append(str(err))
                else:
                    lost.append((letter, str(err)))

            return report

        for letter in letters:
            sent: dict[str, Any] = {
                "key": letter.source_topic,
                "value": encode(letter),
                "on_delivery": on_delivery(letter),
            }
            try:
                try:
                    p.produce(self._dead_letter_topic, **sent)
                except BufferError:
                    # librdkafka's queue is full (100,000 messages or 1 GiB: 12,227 letters
                    # of 64 KiB raws): once what it holds is delivered, this one fits.
                    if p.flush(20.0) > 0:
                        self._drop_producer(0.0)
                        raise DeliveryError("dead letters not acknowledged: queue full") from None
                    p.produce(self._dead_letter_topic, **sent)
            except KafkaException as exc:
                lost.append((letter, str(exc)))
        if p.flush(20.0) > 0 or failures:
            self._drop_producer(0.0)  # what it still holds is produced again by the retry
            raise DeliveryError(f"dead letters not acknowledged: {failures[:3] or 'timeout'}")
        if lost:
            self._drop_producer(0.0)  # a fatal error would refuse every later letter
        for letter, why in lost:
            log.error(
                "dead letter of %s:%d:%d (%s) refused by the broker, lost: %s",
                letter.source_topic,
                letter.partition,
                letter.offset,
                letter.reason,
                why,
            )
        self.stats.dead_letters_lost += len(lost)
        self.stats.dead_letters += len(letters) - len(lost)
        # One line a batch, not a letter: whoever may write a topic chooses how many letters
        # there are, and each letter is in the dead-letters topic and table already.
        reasons = Counter(str(letter.reason) for letter in letters)
        first = letters[0]
        log.warning(
            "dead-lettered %d message(s) (%s), the first %s:%d:%d",
            len(letters),
            ", ".join(f"{reason} {n}" for reason, n in sorted(reasons.items())),
            first.source_topic,
            first.partition,
            first.offset,
        )

    def _drop_producer(self, flush_s: float) -> None:
        """Stop using the dead-letter producer, flushed first for up to ``flush_s`` (0: the
        delivery reports it has are served): every letter it accepted reaches the broker or
        has its report read. What it still holds then is logged with its count, never
        dropped unsaid: a batch is committed only once its letters are all acknowledged,
        so those letters' batch is sent again by its retry, or by the partitions' next
        owner. The next batch with letters starts a fresh producer."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        left = producer.flush(flush_s)
        if left:
            log.warning(
                "dead-letter producer dropped holding %d unacknowledged letter(s): their "
                "batch is not committed, and is sent again",
                left,
            )

    def _commit(self, consumer: Consumer, batch: _Batch) -> None:
        from confluent_kafka import TopicPartition

        consumer.commit(
            offsets=[TopicPartition(t, p, o + 1) for (t, p), o in batch.offsets.items()],
            asynchronous=False,
        )

    def _connected(self) -> tuple[Client, dict[str, Encoders]]:
        """The client, and per table how its timestamp columns are written (read from the
        server once a connection: DateTime on 18.16, DateTime64(3) on current ClickHouse)."""
        if self._client is None:
            client = connect(self.settings)
            self._encoders = column_encoders(client)
            self._client = client
        return self._client, self._encoders
