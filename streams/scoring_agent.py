"""The scoring agent: request logs in, per adapter-version score state out, in batches.

It runs inside the Faust worker (``ScoringService``, so the planner reads the states in
memory: ``streams.app.score_store``) but consumes and produces with confluent-kafka itself,
because it is the busiest consumer of the system: as a per-event Faust agent it scored
~1.5k logs/s (Faust's fetcher and one changelog write per log dominated;
docs/benchmarks.md). Each batch of up to
``BATCH`` logs is folded by the pure ``streams.score_fold.fold_batch``; then, in one Kafka
transaction, every touched score key is written once to the compacted ``scores`` topic,
refused logs go to the dead-letter topic with their reason, and the batch's consumer
offsets are committed. So a crash at any point neither loses nor double-counts a log: on
start (and on every partition reassignment) the states are re-read from the ``scores``
topic (read-committed; records are ``schemas.score_snapshot.ScoreSnapshot``, an unreadable
one is skipped with its reason) and consumption resumes from the committed offsets.
A log the event sink delivered twice (at least once: a replay of what the broker took but
did not acknowledge) is counted once: the fold skips event ids among the last ``RECENT``
counted on the partition, which are read back from the requests topic, up to the committed
offsets, with the states (``recent_ids``).

Time is the log's own ``ts`` (event time), so replayed or late logs count as of when they
happened and tests control time by the timestamps they write. A batch in which a log
starts a burst (``scores.is_burst``) sets the store's ``burst`` event so the planner
re-plans now.

One consumer thread owns the consumer and producer and is the only writer of the
``ScoreStore`` (streams.score_store: the planner reads consistent copies of it). The
transactional id is per topic prefix: a second scoring worker on the same prefix fences
the first (the planner assumes one worker).

Broker restarts heal by themselves: every transaction call is bounded, a transaction that
fails or times out is aborted and retried with the same batch (``kernel.transactions``:
the store is updated only after the commit), a fatal or fenced producer ends the session
and the next one builds a new producer and consumer (and reads the states back); reading
the states back is bounded too (``RESTORE_TIMEOUT_S``). A watchdog thread logs
``STALLED scoring: no progress for N s (step)`` while a batch cannot be committed, even
if the thread hangs inside librdkafka (``kernel.progress``).

Bounded state (``streams.score_admission``): the agent learns the registry itself, from the
compacted ``registry`` topic, through ``loraplane.registry_trust.VerifiedRegistry`` with its
own keyring (so N scoring processes apart from the planner need no in-process registry); a
``RegistryWatch`` thread re-reads it every ``REGISTRY_REFRESH_S``, and a batch with unknown
logs is judged on a read that began after the batch was consumed, so a version published
before its first log (as every served one is) is never counted unknown; a flood of unknown
ids costs at most one registry read per batch. A log whose version is not live in it writes
no score key: it adds to the one ``UNKNOWN_KEY`` record
(``UnknownTally``) of the batch's transaction. A key the registry no longer backs (retired,
revoked, withdrawn) is tombstoned on the scores topic and dropped from the store. Nothing is
consumed before the first registry read succeeded (an empty registry would tombstone all).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import mode
from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.dead_letter import dead_letter_for
from loraplane.schemas.keyring import KeyringFile
from loraplane.schemas.score_snapshot import UNKNOWN_KEY, ScoreSnapshot, UnknownTally
from loraplane.streams.app import app, score_store
from loraplane.streams.score_admission import NOBODY, Known, stale_keys
from loraplane.streams.score_fold import RecentIds, demand_of, fold_batch
from loraplane.streams.score_store import ScoreStore
from loraplane.streams.scores import ScoreState, from_snapshot, snapshot
from pydantic import BaseModel

from loraplane.kernel import kafka
from loraplane.kernel.config import Settings, get_settings
from loraplane.kernel.progress import Progress, Watchdog
from loraplane.kernel.registry_view import latest_registry_records
from loraplane.kernel.topics import topic_name
from loraplane.kernel.transactions import STEP_TIMEOUT_S, send_offsets, transact
from loraplane.registry_trust import CHECKPOINTS_FILE, VerifiedRegistry

log = logging.getLogger(__name__)
settings = get_settings()

BATCH = 10_000
"""Most logs per batch (one transaction); a batch is whatever arrived within POLL_S."""
POLL_S = 0.05
RETRY_S = 2.0
"""Pause before a new session after a Kafka error (broker down, fenced, rebalanced)."""
CLIENT_ID = "loraplane-scoring"
COMPONENT = "scoring"
RESTORE_TIMEOUT_S = 120.0
"""Reading the scores topic back gives up (and the session restarts) after this long."""
RECENT = 20_000
"""Event ids remembered per requests partition (``RecentIds``): a duplicate at most this many
logs of its partition behind its original is counted once."""
REGISTRY_REFRESH_S = 1.0
"""How often the registry topic is re-read in the background; a batch with unknown logs is
judged again on a read that began after it was consumed (``RegistryWatch.known_since``)."""


class _DeadLetters:
    """The ``EventSink`` of the registry copy: refused registry records, dead-lettered."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.producer = kafka.producer(settings)

    def emit(self, topic_suffix: str, key: str, message: BaseModel) -> None:
        self.producer.produce(topic_name(self.settings, topic_suffix), key=key.encode(),
                              value=encode(message))
        self.producer.poll(0)


class RegistryWatch:
    """The live versions of the verified registry, re-read every ``REGISTRY_REFRESH_S`` in
    its own thread and on demand (``known_since``). ``known`` is replaced, never changed;
    ``ready`` is set after the first read that reached the end of the topic."""

    def __init__(self, settings: Settings) -> None:
        self.registry = VerifiedRegistry(
            KeyringFile(settings.keyring_path), lambda: latest_registry_records(settings),
            sink=_DeadLetters(settings), component=COMPONENT,
            checkpoints_path=settings.home / "scoring" / CHECKPOINTS_FILE)
        self.known: Known = NOBODY
        self.read_from = -1.0
        """``time.monotonic()`` when the read behind ``known`` began."""
        self.ready = threading.Event()
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """One read of the registry topic; raises when it could not be read to its end."""
        with self._lock:
            began = time.monotonic()
            self.registry.refresh()
            self.known = Known.of(r for v in self.registry.accepted.values()
                                  for r in v.versions)
            self.read_from = began
        self.ready.set()

    def known_since(self, moment: float) -> Known:
        """The registry as read by a read that began after ``moment`` (monotonic): any view
        on the topic by then is in it. Reads now if the last read is older (it raises when
        the topic cannot be read: the batch is then retried, never judged on old views)."""
        if self.read_from < moment:
            self.refresh()
        return self.known

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.refresh()
            except Exception as exc:  # KafkaException, TopicReadIncomplete, OSError, ...
                log.warning("scoring: registry read failed, keeping the last one: %s", exc)
            stop.wait(REGISTRY_REFRESH_S)


def restore(settings: Settings, timeout_s: float = RESTORE_TIMEOUT_S) -> dict[str, ScoreState]:
    """The committed state of every score key (``read_back`` without the unknown bucket)."""
    return read_back(settings, timeout_s)[0]


def read_back(settings: Settings, timeout_s: float = RESTORE_TIMEOUT_S
              ) -> tuple[dict[str, ScoreState], UnknownTally]:
    """The committed state of every score key and the unknown bucket: the scores topic read
    to its end (a RuntimeError past ``timeout_s``: a broker away must not hang the read
    forever)."""
    from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

    topic = topic_name(settings, "scores")
    reader = kafka.consumer(settings, f"{settings.topic_prefix}-scoring-restore",
                            read_to_end=True)
    try:
        meta = reader.list_topics(topic, timeout=15).topics[topic]
        if meta.error is not None or not meta.partitions:
            raise RuntimeError(f"cannot read {topic}: {meta.error or 'no partitions'}; "
                               "run `loraplane topics apply`")
        partitions = meta.partitions
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        states: dict[str, ScoreState] = {}
        tally = UnknownTally(logs=0)
        pending = set(partitions)
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{topic} not read to its end within {timeout_s:.0f} s "
                                   f"({len(pending)} partitions left)")
            for msg in reader.consume(num_messages=BATCH, timeout=1.0):
                if (err := msg.error()) is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"reading {topic}: {err}")
                    pending.discard(msg.partition())
                elif (value := msg.value()) is None:
                    states.pop((msg.key() or b"").decode("utf-8", "replace"), None)
                else:
                    try:
                        key = (msg.key() or b"").decode()
                        if key == UNKNOWN_KEY:
                            tally = decode(UnknownTally, value)
                        else:
                            states[key] = from_snapshot(decode(ScoreSnapshot, value))
                    except (SchemaError, UnicodeDecodeError) as exc:
                        log.error("scores %s@%s unreadable, skipped: %s", msg.partition(),
                                  msg.offset(), exc)
        return states, tally
    finally:
        reader.close()


def recent_ids(settings: Settings, committed: list[Any],
               timeout_s: float = RESTORE_TIMEOUT_S) -> RecentIds:
    """The event ids of the last ``RECENT`` logs before each partition's ``committed``
    offset (TopicPartitions of the requests topic): what the previous session counted last,
    so a replayed duplicate of it is not counted again after a restart or a rebalance."""
    from confluent_kafka import KafkaError, TopicPartition

    recent = RecentIds(RECENT)
    ends = {tp.partition: tp.offset for tp in committed if tp.offset > 0}
    if not ends:
        return recent
    topic = topic_name(settings, "requests")
    reader = kafka.consumer(settings, f"{settings.topic_prefix}-scoring-restore",
                            read_to_end=True)
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
                    recent.add([(p, demand_of(msg).event_id)])
                if offset + 1 >= ends[p]:
                    del ends[p]
        return recent
    finally:
        reader.close()


class ScoreKeeper:
    """The consume -> fold -> transact loop. ``run`` blocks (a thread) until ``stop``."""

    def __init__(self, settings: Settings, store: ScoreStore,
                 on_burst: Callable[[list[str]], object],
                 on_ready: Callable[[], object]) -> None:
        self.settings = settings
        self.store = store
        self.on_burst = on_burst
        self.on_ready = on_ready
        self.requests = topic_name(settings, "requests")
        self.scores = topic_name(settings, "scores")
        self.dead_letters = topic_name(settings, "dead-letters")
        self.reload = False
        self.recent = RecentIds(RECENT)
        self.progress = Progress(COMPONENT)
        self.watch = RegistryWatch(settings)
        self.applied: Known | None = None
        """The registry the store's keys were last checked against (tombstones)."""
        self.unknown = UnknownTally(logs=0)

    def run(self, stop: threading.Event) -> None:
        from confluent_kafka import KafkaException

        watchdog = Watchdog([self.progress]).start()
        threading.Thread(target=self.watch.run, args=(stop,), name="scoring-registry",
                         daemon=True).start()
        try:
            while not stop.is_set():
                try:
                    self._session(stop)
                except (KafkaException, RuntimeError) as exc:  # ProducerBroken included
                    self.progress.blocked(f"session ended: {exc}")
                    log.error("scoring session ended (%s); restarting in %.0f s", exc,
                              RETRY_S)
                    stop.wait(RETRY_S)
        finally:
            watchdog.stop()

    def _session(self, stop: threading.Event) -> None:
        prefix = self.settings.topic_prefix
        txn = kafka.transactional_producer(self.settings, f"{prefix}-scoring",
                                           client_id=CLIENT_ID)
        self.progress.blocked("init_transactions")
        # Fences a previous instance (or this process's broken producer) and aborts its
        # open batch.
        txn.init_transactions(STEP_TIMEOUT_S)
        consumer = kafka.consumer(self.settings, f"{prefix}-scoring", client_id=CLIENT_ID,
                                  session_timeout_ms=10_000)
        try:
            self.reload = True
            consumer.subscribe([self.requests], on_assign=self._assigned)
            self.progress.blocked("reading the registry")
            while not self.watch.ready.wait(0.2):  # unknown until then: nothing scored
                if stop.is_set():
                    return
            while not stop.is_set():
                batch = consumer.consume(num_messages=BATCH, timeout=POLL_S)
                consumed_at = time.monotonic()
                if self.reload:  # new partitions: their states as last committed
                    self.progress.blocked("reading the scores topic back")
                    committed, self.unknown = read_back(self.settings)
                    self.recent = recent_ids(self.settings, consumer.committed(
                        consumer.assignment(), timeout=STEP_TIMEOUT_S))
                    self.store.replace_all(committed)
                    self.store.unknown_logs = self.unknown
                    self.applied = None
                    self.reload = False
                    log.info("scoring: %d score states and %d recent event ids read back; "
                             "consuming from epoch %.3f", len(committed), len(self.recent),
                             time.time())
                    self.on_ready()
                    self.progress.advanced()
                if (known := self.watch.known) is not self.applied:
                    self._tombstone(txn, known)
                if batch:
                    self._commit(txn, consumer, batch, known, consumed_at)
                    self.progress.advanced()
        finally:
            consumer.close()
            txn.flush(5)

    def _assigned(self, consumer: Any, partitions: list[Any]) -> None:
        self.reload = True

    def _tombstone(self, txn: Any, known: Known) -> None:
        """Tombstone every score key ``known`` no longer backs, in one transaction."""
        stale = stale_keys(known, self.store.live())
        if stale:
            def fill() -> None:
                for key in stale:
                    txn.produce(self.scores, key=key, value=None)

            transact(txn, fill, on_step=self.progress.blocked)
            self.store.remove(stale)
            log.info("scoring: %d score keys tombstoned (%s)", len(stale),
                     ", ".join(stale[:10]))
        self.applied = known

    def _commit(self, txn: Any, consumer: Any, batch: list[Any], known: Known,
                consumed_at: float) -> None:
        from confluent_kafka import TopicPartition

        messages, ends = [], {}
        for msg in batch:
            if (err := msg.error()) is not None:
                log.warning("requests consumer: %s", err)
                continue
            messages.append(msg)
            ends[msg.partition()] = msg.offset() + 1
        folded = fold_batch(self.store.live(), messages, known, self.recent)
        if folded.unknown and (fresh := self.watch.known_since(consumed_at)) is not known:
            # a log may have come right after its version's publish: judge the batch again
            # on a registry read after it was consumed (streams.score_admission, "Ordering")
            self._tombstone(txn, fresh)
            folded = fold_batch(self.store.live(), messages, fresh, self.recent)
        if folded.duplicates:
            log.info("scoring: %d request logs delivered again, counted once",
                     folded.duplicates)
        unknown = folded.tally(self.unknown)
        for msg, exc in folded.refused:
            log.warning("request log p%s@%s refused: %s", msg.partition(), msg.offset(), exc)

        def fill() -> None:
            for key, state in folded.touched.items():
                txn.produce(self.scores, key=key, value=encode(snapshot(state)))
            if unknown is not self.unknown:
                txn.produce(self.scores, key=UNKNOWN_KEY, value=encode(unknown))
            for msg, exc in folded.refused:
                txn.produce(self.dead_letters, key=msg.key(), value=encode(
                    dead_letter_for(msg, COMPONENT, exc.reason, str(exc))))
            self.progress.blocked("send_offsets_to_transaction")
            send_offsets(txn, [TopicPartition(self.requests, p, end) for p, end in ends.items()],
                         consumer.consumer_group_metadata(), STEP_TIMEOUT_S)

        attempts = transact(txn, fill, on_step=self.progress.blocked)
        if attempts > 1:
            log.info("scoring batch of %d committed after %d attempts", len(messages),
                     attempts)
        self.store.update(folded.touched)
        self.recent.add(folded.counted)
        if unknown is not self.unknown:
            self.unknown = self.store.unknown_logs = unknown
        if folded.bursts:
            log.info("burst for %s", ", ".join(folded.bursts[:10]))
            self.on_burst(folded.bursts)


@app.service
class ScoringService(mode.Service):
    """Runs the ScoreKeeper in its own thread for as long as the Faust worker runs, keeping
    the worker's ``score_store``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def on_start(self) -> None:
        loop = asyncio.get_running_loop()
        keeper = ScoreKeeper(
            settings, score_store,
            on_burst=lambda keys: loop.call_soon_threadsafe(score_store.burst.set),
            on_ready=lambda: loop.call_soon_threadsafe(score_store.ready.set))
        self._thread = threading.Thread(target=keeper.run, args=(self._stop,),
                                        name="scoring", daemon=True)
        self._thread.start()

    async def on_stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
