"""ATTACK tests: compacted records off their key's partition, and scores keys that are not
text.

A compacted topic keeps the last record of each key *per partition*. A worker's (or a
router's) state written to a partition its key does not hash to (by whoever may write the
topic, or left behind when the topic grew) is never replaced by the worker's own records nor
removed by its tombstone, which go to the key's own partition: the readers showed it as the
worker's state, in place of its own when read after it, and forever after the worker was
tombstoned. Every reader of worker states (``latest_fleet_states``, ``plan show``, the
router's and the planner's live views) refuses it as ``wrong_partition``
(``worker_states.at_home``, on ``command_partition.partition_of``).

A scores record whose key is not UTF-8 text was read with replacement characters: the keeper
held it as another key, found that key stale and tombstoned the text, whose bytes are not the
record's, so the record stayed for ever (each read back tombstoned it "again"). Its readers
refuse it (``score_admission.score_key_of``) and the keeper tombstones it under its own
bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loraplane.kernel import worker_states
from loraplane.kernel.bus import MOVED_HEADER, KeyHomes, Record
from loraplane.kernel.command_partition import partition_of
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.router.routing import FleetIndex
from loraplane.router.server import Fleet
from loraplane.schemas.codec import SchemaError, encode
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.reasons import DecodeReason
from loraplane.schemas.score_snapshot import UnknownTally
from loraplane.streams import planner_runtime, score_keeper
from loraplane.streams.planner_runtime import ScoreView, WorkerStates
from loraplane.streams.score_admission import Known, score_key_of
from loraplane.streams.score_fold import RecentIds
from loraplane.streams.score_keeper import ScoreKeeper
from tests.kafka_message import (
    AssignedConsumer,
    ClusterMetadata,
    FakeMessage,
    PartitionMetadata,
    TopicMetadata,
)
from tests.unit.test_reader_keys import router, state
from tests.unit.test_router import NOW, POLICY, ListSink, at, worker
from tests.unit.test_score_keeper import Consumer, Txn

N = 6  # partitions of the worker-state topic


def home(key: str) -> int:
    return partition_of(key, N)


def away(key: str) -> int:
    return (home(key) + 1) % N


def rec(topic: str, part: int, off: int, key: bytes | None, value: bytes | None) -> Record:
    return Record(topic, part, off, key, value, {}, 0)


def reading(got: list[Record], counts: dict[str, int]) -> Callable[..., Iterator[Record]]:
    """A ``read_topic`` that fills ``partition_counts`` with ``counts`` and yields ``got``."""

    def read(
        *_a: Any, partition_counts: dict[str, int] | None = None, **_k: Any
    ) -> Iterator[Record]:
        assert partition_counts is not None
        partition_counts.update(counts)
        yield from got

    return read


def test_at_home_is_kafkas_partition_of_the_key() -> None:
    worker_states.at_home(b"w1", (home("w1"), N))
    worker_states.at_home(b"w1", None)  # not checked
    with pytest.raises(SchemaError) as exc:
        worker_states.at_home(b"w1", (away("w1"), N))
    assert exc.value.reason is DecodeReason.wrong_partition
    raw = b"\xff\xfe"  # a key that is not text hashes by its bytes
    with pytest.raises(SchemaError):
        worker_states.at_home(raw, ((partition_of(raw, N) + 1) % N, N))


def test_attack_a_ghost_state_off_its_partition_is_no_worker_in_the_fleet_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path)
    workers, routers = topic_name(settings, "worker-state"), topic_name(settings, "router-state")
    got = [
        rec(workers, home("w1"), 0, b"w1", state("w1")),
        rec(workers, away("w1"), 0, b"w1", state("w1", slots=99)),  # read after: took its place
        rec(workers, home("w2"), 1, b"w2", state("w2")),
        rec(workers, away("w2"), 1, b"w2", state("w2", slots=99)),  # the ghost
        rec(workers, home("w2"), 2, b"w2", None),  # w2 retired: its tombstone, at home
        rec(workers, home("w3"), 3, b"w3", state("w3")),
        rec(workers, away("w3"), 3, b"w3", None),  # a tombstone elsewhere removed w3
        rec(routers, away("r1"), 0, b"r1", router("r1")),
    ]
    monkeypatch.setattr(worker_states, "read_topic", reading(got, {workers: N, routers: N}))
    fleet = worker_states.latest_fleet_states(settings)
    assert {w: s.gpu_slots_total for w, s in fleet.workers.items()} == {"w1": 4, "w3": 4}
    assert fleet.routers == {} and fleet.malformed == 4


def test_attack_a_ghost_state_is_dead_lettered_by_the_router() -> None:
    sink = ListSink()
    fleet = Fleet(FleetIndex(POLICY, 5.0), sink, "router-t")
    state_ = at(worker("w1"), NOW)
    good = state_.model_dump_json().encode()
    fleet.take(rec("lp.worker-state", home("w1"), 7, b"w1", good), (home("w1"), N))
    fleet.proved("w1", state_.gateway_url, True, NOW)
    assert set(fleet.index.workers) == {"w1"}
    fleet.take(rec("lp.worker-state", away("w1"), 8, b"w1", None), (away("w1"), N))
    assert set(fleet.index.workers) == {"w1"}  # a tombstone elsewhere removes nothing
    fleet.take(rec("lp.worker-state", away("w1"), 9, b"w1", good), (away("w1"), N))
    letters = sink.messages(DeadLetter)
    assert [(d.reason, d.partition) for d in letters] == [
        (DecodeReason.wrong_partition, away("w1")),
        (DecodeReason.wrong_partition, away("w1")),
    ]
    fleet.take(rec("lp.worker-state", home("w1"), 10, b"w1", None), (home("w1"), N))
    assert not fleet.index.workers and fleet.dead_lettered == 2


def test_attack_a_ghost_state_is_not_planned_for() -> None:
    states = WorkerStates()
    states.apply(b"w1", state("w1"), placed=(home("w1"), N))
    states.apply(b"w1", None, placed=(away("w1"), N))  # elsewhere: removes nothing
    assert [s.worker_id for s in states.copy()] == ["w1"]
    states.apply(b"w1", None, placed=(home("w1"), N))
    states.apply(b"w1", state("w1"), placed=(away("w1"), N))  # the ghost after the tombstone
    assert states.copy() == [] and states.unreadable == 2


def test_attack_plan_show_skips_a_ghost_state(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path)
    workers = topic_name(settings, "worker-state")
    got = [
        rec(workers, home("w1"), 0, b"w1", state("w1")),
        rec(workers, home("w1"), 1, b"w1", None),
        rec(workers, away("w1"), 0, b"w1", state("w1")),
    ]
    monkeypatch.setattr(planner_runtime, "read_topic", reading(got, {workers: N}))
    assert planner_runtime.preview(settings, None).workers == 0


def test_a_scores_key_that_is_not_text_is_no_score_key() -> None:
    assert score_key_of(b"a1@1") == "a1@1"
    assert score_key_of(None) == ""
    assert score_key_of(b"\xffa1@1") is None
    view = ScoreView()
    assert not view.apply(b"\xffa1@1", encode(UnknownTally(logs=1)))
    assert view.copy() == {} and view.unreadable == 1


class _Reader:
    """The read-back consumer: ``messages`` on partition 2, then its end."""

    def __init__(self, topic: str, messages: list[FakeMessage]) -> None:
        self.topic, self.messages = topic, messages

    def list_topics(self, topic: str, timeout: float) -> ClusterMetadata:
        return ClusterMetadata({topic: TopicMetadata({2: PartitionMetadata()})})

    def assign(self, _parts: Any) -> None:
        pass

    def consume(self, num_messages: int, timeout: float) -> list[Any]:
        out, self.messages = [*self.messages, _Eof(2)], []
        return out

    def close(self) -> None:
        pass


class _Eof(FakeMessage):
    def __init__(self, part: int) -> None:
        super().__init__(None, None, part=part)

    def error(self) -> Any:  # type: ignore[override]
        from confluent_kafka import KafkaError

        return KafkaError(KafkaError._PARTITION_EOF)


def test_attack_a_scores_key_that_is_not_text_is_tombstoned_under_its_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path)
    topic = topic_name(settings, "scores")
    snapshot = encode(UnknownTally(logs=1))  # any value: it is never decoded
    messages = [
        FakeMessage(snapshot, b"\xffa1@1", t=topic, part=2, off=0),
        FakeMessage(snapshot, b"\xfea1@1", t=topic, part=2, off=1),
        FakeMessage(None, b"\xfea1@1", t=topic, part=2, off=2),  # already tombstoned
    ]
    monkeypatch.setattr(score_keeper.kafka, "consumer", lambda *_a, **_k: _Reader(topic, messages))
    read = score_keeper.read_back(settings, [2])
    assert read.states == {2: {}} and read.undecodable == {2: {b"\xffa1@1"}}
    k = ScoreKeeper(settings, instance="t")
    k.owned[2] = score_keeper._Owned(
        {}, UnknownTally(logs=0), RecentIds(100), 5, read.undecodable[2]
    )
    txn = Txn()
    k._tombstone(txn, Consumer(), Known({}))
    assert txn.keys == [b"\xffa1@1"] and [p[2:] for p in txn.produced] == [(None, 2)]
    assert [(tp.partition, tp.offset) for tp in txn.offsets[-1]] == [(2, 5)]
    assert k.undecodable_tombstoned == 1 and not k.owned[2].undecodable
    txn.keys.clear()
    k._tombstone(txn, Consumer(), Known({}))  # once: nothing is left to tombstone
    assert txn.keys == []


class _GrowingTopic(AssignedConsumer):
    """A broker whose worker-state topic has ``partitions`` partitions (changeable: it
    grows), counting the metadata queries."""

    partitions = 4
    asked = 0

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> ClusterMetadata:
        self.asked += 1
        return super().list_topics(topic, timeout)

    def get_watermark_offsets(self, tp: Any, timeout: float = -1) -> tuple[int, int]:
        return 0, 0


def test_a_state_on_its_home_after_the_topic_grew_is_taken() -> None:
    """A worker-state topic grown from 4 to 6 partitions while a tail reads it: a producer
    places a key by the new count once it refreshed its metadata, by the old one until
    then. A worker's genuine state on its new home is taken (it was refused as
    ``wrong_partition`` under the count the tail assigned: the worker left every running
    router and planner), so is one on its old home from a producer not yet refreshed; one
    on neither is refused, and a flood of those asks the broker for the count at most once
    a second."""
    from loraplane.kernel.topic_tail import TopicTail

    topic = "lp.worker-state"
    broker = _GrowingTopic()
    tail = TopicTail(Settings(), topic, component="router-t-worker-state", keep=False)
    tail._assign(broker)  # type: ignore[arg-type]
    tail._probe_consumer = broker  # type: ignore[assignment]
    broker.partitions = 6
    key = next(
        k
        for k in (f"w{i}" for i in range(1000))
        if partition_of(k, 6) < 4 and partition_of(k, 6) != partition_of(k, 4)
    )
    new_home, old_home = partition_of(key, 6), partition_of(key, 4)
    states = WorkerStates()
    for part, off in ((new_home, 3), (old_home, 4)):
        placed = tail.placed(rec(topic, part, off, key.encode(), state(key)))
        states.apply(key.encode(), state(key), placed=placed)
        assert set(states.states) == {key} and states.unreadable == 0
    asked = broker.asked
    elsewhere = next(p for p in range(6) if p not in (new_home, old_home))
    ghost = rec(topic, elsewhere, 2, key.encode(), None)  # a tombstone on neither home
    for _ in range(100):
        states.apply(ghost.key, ghost.value, placed=tail.placed(ghost))
    assert set(states.states) == {key} and states.unreadable == 100
    assert broker.asked == asked  # counted again within RECOUNT_S: not asked again


def test_a_topic_the_broker_does_not_know_leaves_the_others_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``read_topic(partition_counts=)`` over two topics, one never created (a fleet whose
    routers have not written ``router-state`` yet): the other is read to its end and
    counted; the read is not cut short for the missing one."""
    from types import SimpleNamespace

    from loraplane.kernel import bus

    class Eof:
        def error(self) -> Any:
            return SimpleNamespace(code=lambda: -191)

        def topic(self) -> str:
            return "p.worker-state"

        def partition(self) -> int:
            return 0

    class Consumer:
        def __init__(self) -> None:
            self.polls = [Eof()]

        def list_topics(self, topic: str, timeout: float) -> Any:
            known = {"p.worker-state": SimpleNamespace(error=None, partitions={0: None})}
            return SimpleNamespace(topics={t: m for t, m in known.items() if t == topic})

        def assign(self, partitions: list[Any]) -> None:
            assert [(tp.topic, tp.partition) for tp in partitions] == [("p.worker-state", 0)]

        def poll(self, timeout: float) -> Any:
            return self.polls.pop() if self.polls else None

        def assignment(self) -> list[Any]:
            return [SimpleNamespace(topic="p.worker-state", partition=0)]

        def close(self) -> None:
            pass

    monkeypatch.setattr(bus.kafka, "consumer", lambda *a, **k: Consumer())
    counts: dict[str, int] = {}
    records = list(
        bus.read_topic(
            Settings(),
            ["p.worker-state", "p.router-state"],
            timeout_s=2.0,
            to_end=True,
            partition_counts=counts,
        )
    )
    assert records == [] and counts == {"p.worker-state": 1}


class _MetaConsumer:
    """A consumer whose broker knows ``p.worker-state`` (one partition, at its end) and
    answers ``p.router-state``'s metadata with ``errors`` in turn (then none)."""

    def __init__(self, errors: list[int]) -> None:
        from types import SimpleNamespace

        self.errors = errors
        self.assigned: list[tuple[str, int]] = []
        self.ns = SimpleNamespace

    def list_topics(self, topic: str, timeout: float) -> Any:
        ns = self.ns
        if topic == "p.router-state":
            code = self.errors.pop(0) if self.errors else None
            error = None if code is None else ns(code=lambda: code)
            return ns(topics={topic: ns(error=error, partitions={0: None})})
        return ns(topics={topic: ns(error=None, partitions={0: None})})

    def assign(self, partitions: list[Any]) -> None:
        self.assigned = [(tp.topic, tp.partition) for tp in partitions]
        self.eofs = list(self.assigned)

    def poll(self, timeout: float) -> Any:
        ns = self.ns
        if not getattr(self, "eofs", None):
            return None
        topic, part = self.eofs.pop()
        return ns(error=lambda: ns(code=lambda: -191), topic=lambda: topic, partition=lambda: part)

    def assignment(self) -> list[Any]:
        return [self.ns(topic=t, partition=p) for t, p in self.assigned]

    def close(self) -> None:
        pass


def test_a_topic_the_broker_knows_but_cannot_list_now_is_not_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A topic whose metadata answers with an error other than "unknown topic" (its leader
    not elected yet, just created; a principal not let to describe it) holds records the
    read cannot leave out: a transient error is asked again, one that stays makes a read to
    the end incomplete, never a whole read of the other topic alone."""
    from loraplane.kernel import bus

    leader_not_available, not_authorized = 5, 29
    consumer = _MetaConsumer([leader_not_available])
    monkeypatch.setattr(bus.kafka, "consumer", lambda *a, **k: consumer)
    names = ["p.worker-state", "p.router-state"]
    list(bus.read_topic(Settings(), names, timeout_s=3.0, to_end=True))
    assert sorted(consumer.assigned) == [("p.router-state", 0), ("p.worker-state", 0)]

    consumer = _MetaConsumer([not_authorized] * 1000)
    with pytest.raises(bus.TopicReadIncomplete):
        list(bus.read_topic(Settings(), names, timeout_s=1.0, to_end=True))
    assert consumer.assigned == []


def moved(topic: str, part: int, off: int, key: bytes, to: int) -> Record:
    """The tombstone a writer leaves on its key's previous partition (``MOVED_HEADER``)."""
    return Record(topic, part, off, key, None, {MOVED_HEADER: str(to).encode()}, 0)


def test_a_writer_names_its_keys_previous_partition_once_it_moved() -> None:
    """``KeyHomes``: a key delivered to another partition than before names the one before
    (the sink leaves its tombstone there); a late report of an older send moves nothing
    back, and a tombstone of the writer's own forgets the key."""
    homes = KeyHomes()
    assert homes.delivered("ws", b"w1", 0, 1) is None
    assert homes.delivered("ws", b"w1", 0, 2) is None
    assert homes.delivered("ws", b"w1", 4, 4) == 0  # the topic grew: moved from 0
    assert homes.delivered("ws", b"w1", 0, 3) is None  # sent before the move, reported late
    assert homes.delivered("ws", b"w1", 4, 5) is None
    assert homes.delivered("ws", b"w1", 4, 6, tombstone=True) is None
    assert homes.delivered("ws", b"w1", 1, 7) is None  # forgotten: nothing to clear


class _Producer:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def produce(self, topic: str, **kw: Any) -> None:
        self.sent.append({"topic": topic, **kw})

    def poll(self, timeout: float = 0) -> int:
        return 0


def test_the_sink_leaves_a_tombstone_on_its_keys_previous_partition(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A worker's state delivered to a new partition after a grow: its event sink sends a
    tombstone with ``MOVED_HEADER`` to the partition its states went to before, so
    compaction removes the state left there; a failed one is not spooled (replayed to the
    key's home it would remove the worker's state)."""
    from loraplane.eventlog.sink import KafkaEventSink
    from loraplane.kernel import kafka

    producer = _Producer()
    monkeypatch.setattr(kafka, "producer", lambda *a, **k: producer)
    sink = KafkaEventSink(Settings(home=tmp_path, spool_dir=tmp_path / "spool"), "agent-t")
    topic = topic_name(sink.settings, "worker-state")
    for _ in range(3):
        sink.emit("worker-state", "w1", at(worker("w1"), NOW))
    first, second, third = (s["on_delivery"] for s in producer.sent)
    first(None, FakeMessage(b"s", b"w1", topic, part=1))
    second(None, FakeMessage(b"s", b"w1", topic, part=4))  # the topic grew
    tombstone = producer.sent[-1]
    assert tombstone["partition"] == 1 and tombstone["value"] is None
    assert tombstone["key"] == b"w1" and tombstone["headers"] == [(MOVED_HEADER, b"4")]
    tombstone["on_delivery"](object(), FakeMessage(None, b"w1", topic, part=1))
    third(None, FakeMessage(b"s", b"w1", topic, part=4))
    assert len(producer.sent) == 4 and sink.backlog == 0


def test_what_a_writer_cleared_after_a_grow_is_no_ghost_in_the_fleet_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``fleet status`` and ``plan show`` after a grow: a worker's old state left on its
    old partition counted as malformed at every read (a yellow line for ever); with the
    tombstone its sink left there after it, it is neither counted nor taken, and the
    tombstone removes nothing, wherever it is read. A ghost no tombstone follows is still
    counted."""
    settings = Settings(home=tmp_path)
    workers = topic_name(settings, "worker-state")
    got = [
        rec(workers, away("w1"), 0, b"w1", state("w1", slots=99)),  # left by the grow
        rec(workers, home("w1"), 0, b"w1", state("w1")),
        moved(workers, away("w1"), 1, b"w1", home("w1")),
        moved(workers, home("w1"), 1, b"w1", home("w1")),  # even on its home: not a removal
        rec(workers, away("w2"), 2, b"w2", state("w2")),  # a ghost nothing cleared
    ]
    read = reading(got, {workers: N})
    monkeypatch.setattr(worker_states, "read_topic", read)
    fleet = worker_states.latest_fleet_states(settings)
    assert {w: s.gpu_slots_total for w, s in fleet.workers.items()} == {"w1": 4}
    assert fleet.malformed == 1
    monkeypatch.setattr(planner_runtime, "read_topic", read)
    assert planner_runtime.preview(settings, None).workers == 1


def test_a_tombstone_left_by_a_move_removes_nothing_live() -> None:
    """The router and the planner read the topic across the grow: the tombstone on the old
    partition is at home under the old count, and removed the worker until its next state
    on the new partition was read; it is skipped, no dead letter."""
    sink = ListSink()
    fleet = Fleet(FleetIndex(POLICY, 5.0), sink, "router-t")
    state_ = at(worker("w1"), NOW)
    old = partition_of("w1", 3)
    fleet.take(rec("lp.worker-state", old, 7, b"w1", state_.model_dump_json().encode()), (old, 3))
    fleet.proved("w1", state_.gateway_url, True, NOW)
    fleet.take(moved("lp.worker-state", old, 8, b"w1", 4), (old, 3))
    assert set(fleet.index.workers) == {"w1"} and not sink.messages(DeadLetter)
    runtime = planner_runtime.PlannerRuntime(Settings())
    runtime.workers.apply(b"w1", state("w1"))
    runtime._state_record(moved("lp.worker-state", 1, 8, b"w1", 4))  # before state_tail
    assert [s.worker_id for s in runtime.workers.copy()] == ["w1"]


@pytest.mark.parametrize("fault", ["incomplete", "kafka"])
def test_a_grows_clear_that_cannot_read_the_topic_is_a_kafka_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fault: str
) -> None:
    """``topics apply`` and ``stack up`` report a ``KafkaUnavailable`` as an error line; the
    clear after a grow raised the read's own ``TopicReadIncomplete`` (or a
    ``KafkaException``), which both printed as a traceback, the grow done."""
    from confluent_kafka import KafkaError, KafkaException

    from loraplane.kernel.bus import TopicReadIncomplete
    from loraplane.kernel.kafka import KafkaUnavailable

    def read(*_a: Any, **_k: Any) -> Iterator[Record]:
        yield rec("p.worker-state", 0, 0, b"w1", state("w1"))
        if fault == "incomplete":
            raise TopicReadIncomplete("p.worker-state: the end was not reached within 30s")
        raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    monkeypatch.setattr(worker_states, "read_topic", read)
    with pytest.raises(KafkaUnavailable, match=r"p\.worker-state grew to 6 partitions"):
        worker_states.clear_left_behind(Settings(home=tmp_path), "p.worker-state", 6, 1.0)
