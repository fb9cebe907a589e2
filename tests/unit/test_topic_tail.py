"""The pure part of the live topic tail (kernel/topic_tail.py ``TailView``): a first view
only once every partition was read to its end, then record by record with tombstones; and
the verified registry re-reading its source only when the tail moved or the keyring
changed."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from confluent_kafka import KafkaException
from hypothesis import given
from hypothesis import strategies as st

from loraplane.kernel.bus import (
    MOVED_HEADER,
    Record,
    TopicReadIncomplete,
    keys_on_several_partitions,
    latest_per_key,
)
from loraplane.kernel.topic_tail import CurrentSpan, TailView, TopicTail
from loraplane.registry.live import VerifiedRegistry
from loraplane.schemas.keyring import KeyringFile, save_keyring
from tests.unit.test_registry_evidence import KIT, NOW, VIEW_A
from tests.unit.test_registry_trust import Sink, Topic


def rec(partition: int, offset: int, key: str, value: bytes | None = b"v") -> Record:
    return Record("reg", partition, offset, key.encode(), value, {}, 0)


def test_no_view_until_every_partition_reached_its_end() -> None:
    """A partial first read must not look like a registry that lacks the rest."""
    view = TailView()
    view.assign({("reg", 0): 2, ("reg", 1): 1})
    view.apply(rec(0, 0, "a"))
    view.apply(rec(0, 1, "b"))
    assert not view.caught_up and view.version == 0 and view.lag() == 1
    with pytest.raises(TopicReadIncomplete):
        view.snapshot()
    view.apply(rec(1, 0, "c"))
    assert view.caught_up and view.version == 1 and view.lag() == 0
    assert [r.key for r in view.snapshot()] == [b"a", b"b", b"c"]


def test_empty_partitions_are_at_their_end_at_once() -> None:
    view = TailView()
    view.assign({("reg", 0): 0, ("reg", 1): 0})
    assert view.caught_up and view.snapshot() == []


def test_no_partitions_known_yet_is_not_a_view() -> None:
    view = TailView()
    view.assign({})
    assert not view.caught_up


def test_a_transaction_marker_before_the_end_is_crossed_by_the_brokers_eof() -> None:
    """read_committed: the last record sits below the end (the commit marker's offset);
    the partition-EOF event says where the end is."""
    view = TailView()
    view.assign({("reg", 0): 3})
    view.apply(rec(0, 1, "a"))
    assert not view.caught_up
    view.at_end(("reg", 0), 3)
    assert view.caught_up and view.lag() == 0


def test_each_change_replaces_its_key_and_counts_tombstones_included() -> None:
    view = TailView()
    view.assign({("reg", 0): 1})
    view.apply(rec(0, 0, "a", b"a1"))
    first = view.version
    view.apply(rec(0, 1, "b", b"b1"))
    view.apply(rec(0, 2, "a", b"a2"))
    view.apply(rec(0, 3, "b", None))  # a tombstone stays, as the last word on its key
    assert view.version == first + 3
    assert [(r.key, r.value) for r in view.snapshot()] == [(b"a", b"a2"), (b"b", None)]


def test_a_selecting_view_reads_past_what_it_does_not_select_for_keys_it_holds_nothing_of() -> None:
    """``select`` decides only for a key the view holds nothing of (no record, or a
    tombstone); once a key is in, the view follows the topic for it."""
    view = TailView(select=lambda r: r.value == b"ours")
    view.assign({("reg", 0): 2})
    view.apply(rec(0, 0, "a", b"ours"))
    view.apply(rec(0, 1, "b", b"theirs"))  # read past, yet the first read is complete
    assert view.caught_up and view.skipped == 1 and view.lag() == 0
    first = view.version
    assert not view.apply(rec(0, 2, "b", b"theirs"))
    assert view.version == first  # nothing changed for its users
    assert view.apply(rec(0, 3, "a", b"theirs"))  # a key held: kept, whatever it says
    view.apply(rec(0, 4, "a", None))
    assert not view.apply(rec(0, 5, "a", b"theirs"))  # after its tombstone: not held
    assert view.version == first + 2 and view.positions() == {("reg", 0): 6}
    assert [(r.key, r.value) for r in view.snapshot()] == [(b"a", None)]


def test_lag_follows_the_end_learned_from_the_broker() -> None:
    view = TailView()
    view.assign({("reg", 0): 1})
    view.apply(rec(0, 0, "a"))
    view.set_end(("reg", 0), 5)
    assert view.caught_up and view.lag() == 4
    view.set_end(("reg", 0), 2)  # an older answer never moves the end back
    assert view.lag() == 4


def test_positions_resume_where_the_tail_was() -> None:
    """A rebuilt consumer (after a failure) starts at the positions held, not the start."""
    view = TailView()
    view.assign({("reg", 0): 2})
    view.apply(rec(0, 0, "a"))
    view.apply(rec(0, 1, "b"))
    view.assign({("reg", 0): 4})  # the broker again, after a restart: more was written
    assert view.positions() == {("reg", 0): 2}
    assert view.caught_up  # the view it had stays a view
    assert view.lag() == 2


def test_the_verified_registry_reads_only_after_the_tail_moved(tmp_path: Path) -> None:
    """With ``version`` the source is read once per change (and once per new keyring), and
    a failed first read is not retried until the tail moves."""
    path = tmp_path / "keyring.yaml"
    save_keyring(KIT.keyring, path)
    topic, reads, version = Topic(), [0], [0]

    def read() -> list[Record]:
        reads[0] += 1
        if version[0] == 0:
            raise TopicReadIncomplete("not at the end yet")
        return topic.latest()

    registry = VerifiedRegistry(
        KeyringFile(path),
        read,
        sink=Sink(),
        component="worker-w1",
        clock=lambda: NOW + timedelta(minutes=10),
        version=lambda: version[0],
    )
    assert registry.records() == [] and registry.read_failures == 1
    registry.records()
    assert reads[0] == 1 and registry.read_failures == 1  # not once per poll
    topic.write(VIEW_A.adapter_id, VIEW_A)
    version[0] = 1
    assert registry.records() == VIEW_A.versions and reads[0] == 2
    registry.records()
    assert reads[0] == 2
    save_keyring(KIT.keyring, path)  # rewritten: a new keyring re-judges the whole view
    path.touch()
    registry.records()
    assert reads[0] == 3


def test_a_tail_that_never_reached_the_broker_says_so_on_metrics() -> None:
    """Not started: no view, not current (the worker's and the router's /metrics)."""
    from prometheus_client import CollectorRegistry

    from loraplane.kernel.config import Settings
    from loraplane.kernel.progress_metrics import TailMetrics
    from loraplane.kernel.topic_tail import TopicTail

    tail = TopicTail(Settings(), "lp-registry", component="worker-w1-registry")
    registry = CollectorRegistry()
    registry.register(TailMetrics([tail]))
    labels = {"component": "worker-w1-registry"}
    assert registry.get_sample_value("loraplane_topic_tail_caught_up", labels) == 0.0
    assert registry.get_sample_value("loraplane_topic_tail_current", labels) == 0.0
    assert registry.get_sample_value("loraplane_topic_tail_lag", labels) == 0.0
    with pytest.raises(TopicReadIncomplete):
        tail.snapshot()
    assert not tail.wait_caught_up(0.05)


def test_wait_read_to_waits_for_every_offset_asked_for() -> None:
    """The planner's "memory read to its end": True only once each partition is read up to
    the end it was given, woken by the record that gets it there."""
    import threading

    from loraplane.kernel.config import Settings
    from loraplane.kernel.topic_tail import TopicTail

    tail = TopicTail(Settings(), "lp-memory", component="planner-memory")
    tail._view.assign({("m", 0): 0, ("m", 1): 0})  # caught up on an empty topic
    assert tail.wait_read_to({("m", 0): 0}, 0.01)
    assert not tail.wait_read_to({("m", 1): 1}, 0.01)

    def arrive() -> None:
        with tail._changed:
            tail._view.apply(Record("m", 1, 0, b"w1", b"{}", {}, 0))
            tail._changed.notify_all()

    threading.Timer(0.05, arrive).start()
    assert tail.wait_read_to({("m", 0): 0, ("m", 1): 1}, 5.0)


def test_read_to_holds_only_once_the_view_reached_ends_taken_later() -> None:
    """The scoring keeper judges a batch on a view that has read up to the ends it took
    after the batch: not before the tail applied everything below them."""
    view = TailView()
    view.assign({("reg", 0): 1, ("reg", 1): 0})
    view.apply(rec(0, 0, "a", b"1"))
    assert view.read_to({("reg", 0): 1, ("reg", 1): 0})
    later = {("reg", 0): 2, ("reg", 1): 0}  # a record written after the first catch-up
    view.set_end(("reg", 0), 2)
    assert not view.read_to(later)
    view.apply(rec(0, 1, "b", b"2"))
    assert view.read_to(later)


def test_the_current_span_restarts_after_a_gap() -> None:
    """Since when the view has been current without a gap (the router judges heartbeat ages
    by it, loraplane/router/liveness.py): a gap longer than the bound starts a new span."""
    span = CurrentSpan(max_gap_s=1.5)
    assert span.value() is None
    for at_s in (10.0, 11.0, 12.4):
        span.answered(at_s)
    assert span.value() == (10.0, 12.4)
    span.answered(80.0)  # the broker was away in between
    assert span.value() == (80.0, 80.0)
    span.answered(79.0)  # an answer noted late never moves it back
    assert span.value() == (80.0, 80.0)


def test_a_tail_answers_only_while_nothing_is_known_unread() -> None:
    from loraplane.kernel.config import Settings
    from loraplane.kernel.topic_tail import TopicTail

    clock = iter([100.0, 101.0, 102.0])
    tail = TopicTail(
        Settings(), "lp-ws", component="router-ws", probe_every_s=0.5, clock=lambda: next(clock)
    )
    tail._answered()  # no view yet
    assert tail.current_span() is None
    tail._view.assign({("lp-ws", 0): 2})
    tail._view.set_end(("lp-ws", 0), 2)
    tail._answered()  # reading its first records
    assert tail.current_span() is None
    tail._view.at_end(("lp-ws", 0), 2)
    tail._answered()
    assert tail.current_span() == (100.0, 100.0)


def test_attack_a_tail_whose_user_indexes_records_holds_none_of_them() -> None:
    """The planner's scores and worker-state tails and the router's worker-state tail hand
    each record to their user, who forgets what it does not plan or route; the view held
    every key ever written besides (100k score keys: 38.6 MB). With ``keep=False`` it holds
    positions only, and every record is still handed over."""
    view = TailView(keep=False)
    view.assign({("reg", 0): 1000})
    assert all(view.apply(rec(0, n, f"ghost-{n}")) for n in range(1000))
    assert view.caught_up and view.positions() == {("reg", 0): 1000}
    assert view._latest == {}
    with pytest.raises(TypeError):
        view.snapshot()


def test_the_tails_indexed_by_their_users_hold_no_records() -> None:
    """Which tails are built ``keep=False``: those read through ``on_record`` alone."""
    import ast

    root = Path(__file__).resolve().parents[2]
    for path, name in (
        ("streams/planner_runtime.py", "_score_record"),
        ("streams/planner_runtime.py", "_state_record"),
        ("loraplane/router/server.py", "fleet.take"),
    ):
        tree = ast.parse((root / path).read_text())
        calls = [
            c
            for c in ast.walk(tree)
            if isinstance(c, ast.Call)
            and getattr(c.func, "id", None) == "TopicTail"
            and name in ast.unparse(c)
        ]
        assert len(calls) == 1, (path, name)
        keep = {k.arg: ast.unparse(k.value) for k in calls[0].keywords}.get("keep")
        assert keep == "False", (path, name)


class _GrownConsumer:
    """A consumer whose topic has grown from 2 to 4 partitions: partition 2 has a leader and
    3 records, partition 3 no leader yet (the reading and the metadata consumer both)."""

    def __init__(self) -> None:
        from tests.kafka_message import ClusterMetadata, PartitionMetadata, TopicMetadata

        parts = {0: PartitionMetadata(), 1: PartitionMetadata(), 2: PartitionMetadata()}
        parts[3] = PartitionMetadata(leader=-1)
        self.metadata = ClusterMetadata({"ws": TopicMetadata(parts)})
        self.added: list[tuple[str, int, int]] = []

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> object:
        return self.metadata

    def get_watermark_offsets(self, tp: object, timeout: float = -1) -> tuple[int, int]:
        return (0, 3)

    def incremental_assign(self, partitions: list[object]) -> None:
        self.added += [(tp.topic, tp.partition, tp.offset) for tp in partitions]  # type: ignore[attr-defined]


def _tail_of_two() -> TopicTail:
    """A tail of topic ``ws`` reading its 2 partitions, each at its end (nothing on them)."""
    from loraplane.kernel.config import Settings

    tail = TopicTail(Settings(), "ws", component="router-ws")
    with tail._lock:
        tail._view.assign({("ws", 0): 0, ("ws", 1): 0})
        tail._counted("ws", 2)
    return tail


def test_partitions_added_after_the_start_are_read_from_their_beginning() -> None:
    """A topic grown under a running tail (``topics apply``, kafka-topics --alter): its new
    partitions were never assigned, so records keyed onto them were never read. The probe
    assigns each one with a leader from its beginning, leaves the partitions already read at
    their positions, and places keys by the new count first."""
    from confluent_kafka import OFFSET_BEGINNING

    from loraplane.kernel.config import Settings
    from loraplane.kernel.topic_tail import TopicTail

    tail = TopicTail(Settings(), "ws", component="router-ws")
    with tail._lock:
        tail._view.assign({("ws", 0): 1, ("ws", 1): 0})
        tail._view.apply(Record("ws", 0, 0, b"w1", b"{}", {}, 0))
        tail._counted("ws", 2)
    assert tail.caught_up and tail.lag() == 0
    consumer = _GrownConsumer()
    tail._metadata_consumer = lambda: consumer  # type: ignore[assignment,method-assign,return-value]
    tail._probe(consumer)  # type: ignore[arg-type]
    assert consumer.added == [("ws", 2, OFFSET_BEGINNING)]  # not 3: no leader yet
    assert tail._view.positions() == {("ws", 0): 1, ("ws", 1): 0, ("ws", 2): 0}
    assert tail.lag() == 3 and not tail.wait_read_to({("ws", 2): 3}, 0.01)
    assert tail._counts["ws"] == (4, 2)
    tail._probe(consumer)  # type: ignore[arg-type]
    assert consumer.added == [("ws", 2, OFFSET_BEGINNING)]  # nothing assigned twice
    consumer.metadata.topics["ws"].partitions[3].leader = 1  # type: ignore[attr-defined]
    tail._probe(consumer)  # type: ignore[arg-type]
    assert consumer.added[1:] == [("ws", 3, OFFSET_BEGINNING)]


def test_a_partition_the_consumer_refused_to_add_is_asked_for_again() -> None:
    """An ``incremental_assign`` that raises (the broker away between the metadata and the
    assignment) leaves the new partition out of the view, so the next probe adds it; a view
    that held it already would never ask again, the tail not caught up until rebuilt."""

    tail, consumer = _tail_of_two(), _GrownConsumer()
    tail._metadata_consumer = lambda: consumer  # type: ignore[assignment,method-assign,return-value]
    assign = consumer.incremental_assign

    def refuse(partitions: list[object]) -> None:
        raise KafkaException("_TRANSPORT")

    consumer.incremental_assign = refuse  # type: ignore[method-assign]
    tail._probe(consumer)  # type: ignore[arg-type]
    assert ("ws", 2) not in tail._view.positions()
    consumer.incremental_assign = assign  # type: ignore[method-assign]
    tail._probe(consumer)  # type: ignore[arg-type]
    assert [tp[:2] for tp in consumer.added] == [("ws", 2)]
    assert ("ws", 2) in tail._view.positions()


def test_a_count_placed_learns_above_the_partitions_read_asks_for_them_at_once() -> None:
    """``placed`` asks the broker again on a record off its key's partition; a count above
    the partitions the tail reads makes the reading thread probe at its next turn."""
    from loraplane.kernel.command_partition import key_hash

    tail = _tail_of_two()
    tail._metadata_consumer = lambda: _GrownConsumer()  # type: ignore[method-assign]
    key = next(k for n in range(100) if key_hash(k := f"w{n}".encode()) % 2 == 0)
    off_home = Record("ws", 1, 0, key, b"{}", {}, 0)
    assert not tail._grew
    assert tail.placed(off_home) == (1, 4) and tail._grew


@st.composite
def _grown_reads(draw: st.DrawFn) -> tuple[list[Record], Record]:
    """One key's records on its partition under 3 (before a grow to 4), then on its home
    under 4 (tombstones among both), read in any order that keeps each partition's own:
    with the record that stands for the key, the last on its new home."""
    from loraplane.kernel.command_partition import partition_of

    key = draw(
        st.sampled_from(
            [k for k in (f"k{n}" for n in range(50)) if partition_of(k, 4) != partition_of(k, 3)]
        )
    )
    values = st.one_of(st.none(), st.binary(min_size=1, max_size=3))
    old = [
        Record("t", partition_of(key, 3), o, key.encode(), v, {}, 0)
        for o, v in enumerate(draw(st.lists(values, max_size=4)))
    ]
    new = [
        Record("t", partition_of(key, 4), o, key.encode(), v, {}, 0)
        for o, v in enumerate(draw(st.lists(values, min_size=1, max_size=4)))
    ]
    order = draw(st.permutations([0] * len(old) + [1] * len(new)))
    queues = [list(old), list(new)]
    return [queues[i].pop(0) for i in order], new[-1]


@given(_grown_reads())
def test_a_keys_record_on_its_new_home_stands_in_any_order_of_partitions(
    reads: tuple[list[Record], Record],
) -> None:
    """After a grow a key's records before it stay on its old partition (compaction is per
    partition) and its later ones are on its new home; a reader has no order across them.
    The live tail's view and a whole read (``latest_per_key``: ``plan show``, the
    registry's) held the key's record read last, an old one over a newer one when the old
    partition came later: the planner took memory it had replaced."""
    records, newest = reads
    assert latest_per_key(records, {"t": 4}) == {("t", newest.key or b""): newest}
    view = TailView(partitions=lambda topic: 4)
    view.assign({("t", 0): 0})
    for record in records:
        view.apply(record)
    assert view.snapshot() == [newest]


def test_a_record_off_its_home_stands_while_none_on_it_was_read() -> None:
    """A key not written since the grow has only its old partition's record: it stands (the
    planner's memory of an idle worker), and one on the home replaces it."""
    from loraplane.kernel.command_partition import partition_of

    key = next(k for k in (f"k{n}" for n in range(50)) if partition_of(k, 4) != partition_of(k, 3))
    old = Record("t", partition_of(key, 3), 7, key.encode(), b"old", {}, 0)
    home = Record("t", partition_of(key, 4), 0, key.encode(), b"new", {}, 0)
    assert list(latest_per_key([old], {"t": 4}).values()) == [old]
    assert list(latest_per_key([old, home], {"t": 4}).values()) == [home]
    assert list(latest_per_key([home, old], {"t": 0}).values()) == [old]  # count unknown


def test_a_stale_count_from_the_broker_never_judges_a_grown_topics_records() -> None:
    """A topic never shrinks, but a broker's metadata can lag the grow (another broker of
    the cluster learned it first): such an answer to a probe put the smaller count first,
    and the view then judged the key's record on its new home as off it and kept its old
    partition's record (the planner's memory, a registry view) until the key's next write.
    Counts are held largest first whatever the order of the answers."""
    from loraplane.kernel.command_partition import partition_of

    tail, consumer = _tail_of_two(), _GrownConsumer()
    tail._metadata_consumer = lambda: consumer  # type: ignore[assignment,method-assign,return-value]
    tail._probe(consumer)  # type: ignore[arg-type]
    assert tail._counts["ws"] == (4, 2)
    stale = _GrownConsumer()
    del stale.metadata.topics["ws"].partitions[3]  # type: ignore[attr-defined]
    del stale.metadata.topics["ws"].partitions[2]  # type: ignore[attr-defined]
    tail._probe(stale)  # type: ignore[arg-type]
    assert tail._counts["ws"] == (4, 2)
    key = next(
        k
        for k in (f"w{n}".encode() for n in range(100))
        if partition_of(k, 4) == 2 and partition_of(k, 2) == 0
    )
    home = Record("ws", 2, 0, key, b"new", {}, 0)
    old = Record("ws", 0, 5, key, b"old", {}, 0)
    with tail._lock:
        tail._view.apply(home)
        tail._view.apply(old)
        tail._view.at_end(("ws", 2), 1)
    assert tail.placed(home) == (2, 4)
    assert tail.snapshot() == [home]


def test_a_rebuilt_consumer_is_not_assigned_fewer_partitions_than_the_view_reads() -> None:
    """A consumer rebuilt (the broker away) whose metadata lags a grow lists fewer
    partitions than the tail reads: assigned those alone, the others were never read again
    (the probe adds only partitions the view does not hold) while the tail said it was
    current. The assignment is refused until the broker lists them all, and then takes
    every one from its position."""
    from loraplane.kernel.config import Settings
    from loraplane.kernel.topic_tail import TopicTail

    tail = TopicTail(Settings(), "ws", component="router-ws")
    with tail._lock:
        tail._view.assign({("ws", p): 0 for p in range(4)})
        tail._counted("ws", 4)
    assigned: list[list[tuple[str, int]]] = []

    def assign(partitions: list[object]) -> None:
        assigned.append([(tp.topic, tp.partition) for tp in partitions])  # type: ignore[attr-defined]

    stale = _GrownConsumer()
    del stale.metadata.topics["ws"].partitions[3]  # type: ignore[attr-defined]
    del stale.metadata.topics["ws"].partitions[2]  # type: ignore[attr-defined]
    stale.assign = assign  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"\('ws', 2\), \('ws', 3\)"):
        tail._assign(stale)  # type: ignore[arg-type]
    assert assigned == []
    fresh = _GrownConsumer()
    fresh.assign = assign  # type: ignore[attr-defined]
    tail._assign(fresh)  # type: ignore[arg-type]
    assert assigned == [[("ws", p) for p in range(4)]]


def test_a_key_counts_as_spread_while_two_partitions_hold_a_record_of_it() -> None:
    """What ``topics apply`` asks before growing a topic its readers rank by home
    (``grows_once``): a key whose last record on each of two partitions is a value is
    spread; a moved tombstone (``bus.MOVED_HEADER``) last on a partition leaves nothing of
    the key there."""
    a, b, c = b"a", b"b", b"c"
    moved = {MOVED_HEADER: b"2"}
    records = [
        Record("t", 0, 0, a, b"1", {}, 0),
        Record("t", 1, 0, a, b"2", {}, 0),  # a: on 0 and 1
        Record("t", 0, 1, b, b"1", {}, 0),
        Record("t", 2, 0, b, b"2", {}, 0),
        Record("t", 0, 2, b, None, moved, 0),  # b: its record on 0 moved away, only on 2
        Record("t", 1, 1, c, b"1", {}, 0),
        Record("t", 1, 2, c, b"2", {}, 0),  # c: twice on one partition
    ]
    assert keys_on_several_partitions(records) == 1
    assert keys_on_several_partitions([*records, Record("t", 0, 3, a, None, moved, 0)]) == 0
    assert keys_on_several_partitions([]) == 0


def test_a_removal_on_one_partition_and_a_value_on_another_is_spread() -> None:
    """A key removed (a plain tombstone, which readers rank like any record) on one
    partition while its record from before a grow lies on another: a second grow that makes
    that other partition its home again would rank the old value over the removal (a
    revoked adapter's record standing again), so the key counts as spread. Removals alone
    on two partitions leave no value to stand again."""
    a = b"a"
    before = Record("t", 0, 0, a, b"1", {}, 0)  # under the first count, its home 0
    removal = Record("t", 1, 0, a, None, {}, 0)  # under the grown count, its home 1
    assert keys_on_several_partitions([before, removal]) == 1
    assert keys_on_several_partitions([removal, before]) == 1
    assert keys_on_several_partitions([Record("t", 0, 1, a, None, {}, 0), removal]) == 0
