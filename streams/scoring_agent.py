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
from loraplane.schemas.score_snapshot import ScoreSnapshot
from loraplane.streams.app import app, score_store
from loraplane.streams.score_fold import RecentIds, demand_of, fold_batch
from loraplane.streams.score_store import ScoreStore
from loraplane.streams.scores import ScoreState, from_snapshot, snapshot

from loraplane.kernel import kafka
from loraplane.kernel.config import Settings, get_settings
from loraplane.kernel.progress import Progress, Watchdog
from loraplane.kernel.topics import topic_name
from loraplane.kernel.transactions import STEP_TIMEOUT_S, transact

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

def restore(settings: Settings, timeout_s: float = RESTORE_TIMEOUT_S) -> dict[str, ScoreState]:
    """The committed state of every score key: the scores topic read to its end (a
    RuntimeError past ``timeout_s``: a broker away must not hang the read forever)."""
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
                    states.pop((msg.key() or b"").decode(), None)
                else:
                    try:
                        states[(msg.key() or b"").decode()] = from_snapshot(
                            decode(ScoreSnapshot, value))
                    except (SchemaError, UnicodeDecodeError) as exc:
                        log.error("scores %s@%s unreadable, skipped: %s", msg.partition(),
                                  msg.offset(), exc)
        return states
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

    def run(self, stop: threading.Event) -> None:
        from confluent_kafka import KafkaException

        watchdog = Watchdog([self.progress]).start()
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
            while not stop.is_set():
                batch = consumer.consume(num_messages=BATCH, timeout=POLL_S)
                if self.reload:  # new partitions: their states as last committed
                    self.progress.blocked("reading the scores topic back")
                    committed = restore(self.settings)
                    self.recent = recent_ids(self.settings, consumer.committed(
                        consumer.assignment(), timeout=STEP_TIMEOUT_S))
                    self.store.replace_all(committed)
                    self.reload = False
                    log.info("scoring: %d score states and %d recent event ids read back; "
                             "consuming from epoch %.3f", len(committed), len(self.recent),
                             time.time())
                    self.on_ready()
                    self.progress.advanced()
                if batch:
                    self._commit(txn, consumer, batch)
                    self.progress.advanced()
        finally:
            consumer.close()
            txn.flush(5)

    def _assigned(self, consumer: Any, partitions: list[Any]) -> None:
        self.reload = True

    def _commit(self, txn: Any, consumer: Any, batch: list[Any]) -> None:
        from confluent_kafka import TopicPartition

        messages, ends = [], {}
        for msg in batch:
            if (err := msg.error()) is not None:
                log.warning("requests consumer: %s", err)
                continue
            messages.append(msg)
            ends[msg.partition()] = msg.offset() + 1
        folded = fold_batch(self.store.live(), messages, self.recent)
        if folded.duplicates:
            log.info("scoring: %d request logs delivered again, counted once",
                     folded.duplicates)
        for msg, exc in folded.refused:
            log.warning("request log p%s@%s refused: %s", msg.partition(), msg.offset(), exc)

        def fill() -> None:
            for key, state in folded.touched.items():
                txn.produce(self.scores, key=key, value=encode(snapshot(state)))
            for msg, exc in folded.refused:
                txn.produce(self.dead_letters, key=msg.key(), value=encode(
                    dead_letter_for(msg, COMPONENT, exc.reason, str(exc))))
            self.progress.blocked("send_offsets_to_transaction")
            txn.send_offsets_to_transaction(
                [TopicPartition(self.requests, p, end) for p, end in ends.items()],
                consumer.consumer_group_metadata(), STEP_TIMEOUT_S)

        attempts = transact(txn, fill, on_step=self.progress.blocked)
        if attempts > 1:
            log.info("scoring batch of %d committed after %d attempts", len(messages),
                     attempts)
        self.store.update(folded.touched)
        self.recent.add(folded.counted)
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
