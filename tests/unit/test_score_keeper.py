"""The scoring keeper's partition rules, without a broker: a score key and the unknown bucket
go to the partition their logs came from, logs of partitions the keeper does not own (given
up, or not read back yet) are never counted, a revoke forgets its keys, and tombstones go to
the key's own partition with that partition's committed offsets (KIP-447 fencing)."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from loraplane.kernel.config import Settings
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.request_log import RequestLog, Tier
from loraplane.schemas.score_snapshot import UnknownTally, is_unknown_key, unknown_key
from loraplane.streams import score_keeper
from loraplane.streams.score_admission import Known
from loraplane.streams.score_fold import RecentIds
from loraplane.streams.score_keeper import PartitionMismatch, ScoreKeeper, ScoresRead, _Owned
from tests.kafka_message import FakeMessage

T0 = 1_800_000_000.0
KNOWN = Known({"a1": frozenset({"1"}), "a2": frozenset({"1"})})


@dataclass
class Txn:
    produced: list[tuple[str, str, bytes | None, int]] = field(default_factory=list)
    keys: list[str | bytes | None] = field(default_factory=list)  # as given to ``produce``
    offsets: list[list[Any]] = field(default_factory=list)
    commits: int = 0

    def begin_transaction(self) -> None:
        pass

    def produce(
        self,
        topic: str,
        key: str | bytes | None = None,
        value: bytes | None = None,
        partition: int = -1,
    ) -> None:
        self.keys.append(key)
        k = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
        self.produced.append((topic, k, value, partition))

    def send_offsets_to_transaction(self, offsets: list[Any], meta: Any, timeout: float) -> None:
        self.offsets.append(offsets)

    def commit_transaction(self, timeout: float) -> None:
        self.commits += 1

    def abort_transaction(self, timeout: float) -> None:
        raise AssertionError("no abort expected")


class Consumer:
    def consumer_group_metadata(self) -> object:
        return object()


def msg(i: int, adapter: str, part: int, off: int) -> FakeMessage:
    x = RequestLog.model_validate(
        dict(
            event_id=f"e{i}",
            ts=datetime.fromtimestamp(T0 + i, UTC),
            request_id=f"r{i}",
            tenant_id="t1",
            base_model="b",
            adapter_id=adapter,
            adapter_version="1",
            worker_id="w1",
            tier_at_arrival=Tier.gpu,
            ttft_ms=40.0,
        )
    )
    return FakeMessage(encode(x), adapter.encode(), part=part, off=off, ts_ms=int((T0 + i) * 1000))


def keeper(tmp_path: Any, owned: list[int]) -> ScoreKeeper:
    k = ScoreKeeper(Settings(home=tmp_path), instance="t")
    k._registry_after = lambda: KNOWN  # type: ignore[method-assign]  # the tail's view, caught up
    for p in owned:
        k.owned[p] = _Owned({}, UnknownTally(logs=0), RecentIds(100), 0)
    return k


def test_keys_and_unknown_buckets_go_to_their_logs_partition(tmp_path: Any) -> None:
    k, txn = keeper(tmp_path, [1, 4]), Txn()
    batch = [
        msg(0, "a1", 1, 0),
        msg(1, "a2", 4, 0),
        msg(2, "zz", 4, 1),
        msg(3, "zz", 1, 1),
        msg(4, "a1", 2, 7),
    ]  # partition 2 is not owned: its owner counts it
    k._commit(txn, Consumer(), batch, KNOWN)
    scores = {(key, part) for topic, key, _, part in txn.produced if topic == k.scores}
    assert scores == {("a1@1", 1), ("a2@1", 4), (unknown_key(4), 4), (unknown_key(1), 1)}
    assert sorted((tp.partition, tp.offset) for tp in txn.offsets[0]) == [(1, 2), (4, 2)]
    assert {p: o.committed for p, o in k.owned.items()} == {1: 2, 4: 2}
    assert k.owned[4].unknown.logs == 1 and set(k.owned[4].states) == {"a2@1"}
    tally = [
        decode(UnknownTally, v)
        for _, key, v, _ in txn.produced
        if key == unknown_key(1) and v is not None
    ]
    assert [t.logs for t in tally] == [1]


def test_logs_before_the_committed_offset_are_not_counted_again(tmp_path: Any) -> None:
    k, txn = keeper(tmp_path, [1]), Txn()
    k.owned[1].committed = 5
    k._commit(txn, Consumer(), [msg(0, "a1", 1, 4), msg(1, "a1", 1, 5)], KNOWN)
    assert k.owned[1].states["a1@1"].requests_10m.value == pytest.approx(1.0)
    assert k.owned[1].committed == 6


def test_a_revoke_forgets_its_partitions_and_a_batch_of_them_commits_nothing(tmp_path: Any) -> None:
    k, txn = keeper(tmp_path, [1, 4]), Txn()
    k._commit(txn, Consumer(), [msg(0, "a1", 1, 0)], KNOWN)
    k._revoked(Consumer(), [TopicPartition(k.requests, 1)])
    assert k.partitions() == [4]
    k._commit(txn, Consumer(), [msg(1, "a1", 1, 1)], KNOWN)
    assert txn.commits == 1


def test_tombstones_go_to_their_own_partition_with_its_offsets(tmp_path: Any) -> None:
    k, txn = keeper(tmp_path, [1, 4]), Txn()
    k._commit(txn, Consumer(), [msg(0, "a1", 1, 0), msg(1, "a2", 4, 0)], KNOWN)
    txn.produced.clear()
    k._tombstone(txn, Consumer(), Known({"a2": frozenset({"1"})}))
    assert txn.produced == [(k.scores, "a1@1", None, 1)]
    assert [(tp.partition, tp.offset) for tp in txn.offsets[-1]] == [(1, 1)]
    assert set(k.owned[1].states) == set()


def test_requests_and_scores_must_have_the_same_partition_count(tmp_path: Any) -> None:
    k = keeper(tmp_path, [])

    @dataclass
    class Meta:
        partitions: dict[int, object]
        error: object = None

    class Lister:
        def __init__(self, counts: dict[str, int]) -> None:
            self.counts = counts

        def list_topics(self, topic: str, timeout: float) -> Any:
            meta = Meta(dict.fromkeys(range(self.counts[topic])))
            return type("M", (), {"topics": {topic: meta}})()

    k._check_layout(Lister({k.requests: 6, k.scores: 6}))
    with pytest.raises(PartitionMismatch, match="same count"):
        k._check_layout(Lister({k.requests: 6, k.scores: 3}))


def test_unknown_keys_are_one_per_partition_and_sum() -> None:
    assert unknown_key(3) == "(unknown)/3" and is_unknown_key(unknown_key(3))
    assert is_unknown_key("(unknown)") and not is_unknown_key("a1@1")
    total = UnknownTally.total(
        [UnknownTally(logs=2, last=T0), UnknownTally(logs=3), UnknownTally(logs=1, last=T0 + 5)]
    )
    assert (total.logs, total.last) == (6, T0 + 5)


class Cycle:
    """An object a weak reference can watch, kept alive only by a reference cycle."""

    def __init__(self, ring: list[Any]) -> None:
        self.ring = ring
        ring.append(self)


def test_what_a_read_back_leaves_alive_is_out_of_the_collectors_way(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full collection walks every object alive in the process and stops all its threads:
    a burst's logs waited behind it. What is alive once the keeper's partitions are read back
    (the worker's objects, the states) is frozen; a cycle frozen at an earlier read-back and
    dead since is collected at the next one, not kept for good."""
    monkeypatch.setattr(
        score_keeper, "read_back", lambda _s, parts: ScoresRead({p: {} for p in parts})
    )
    monkeypatch.setattr(
        score_keeper,
        "recent_ids",
        lambda _s, committed: {tp.partition: RecentIds(10) for tp in committed},
    )

    class Assigned(Consumer):
        def committed(self, tps: list[Any], timeout: float) -> list[Any]:
            return [TopicPartition(tp.topic, tp.partition, 3) for tp in tps]

    k = ScoreKeeper(Settings(home=tmp_path), instance="t")
    k._fresh = {2}
    gc.unfreeze()
    try:
        k._read_back(Assigned())
        assert k.partitions() == [2] and k.owned[2].committed == 3
        assert gc.get_freeze_count() > 0
        assert not any(o is k.owned[2] for o in gc.get_objects())  # frozen, not walked
        cycle: list[Any] = []
        cycle.append(cycle)
        dead = weakref.ref(Cycle(cycle))  # an object in a cycle, frozen, then unreachable
        gc.freeze()
        del cycle
        assert dead() is not None  # frozen: no collection frees it
        gc.collect()
        assert dead() is not None
        k._fresh = {3}
        k._read_back(Assigned())  # a rebalance's next read-back
        assert dead() is None and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
