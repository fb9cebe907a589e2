"""ATTACK tests: a request log on a partition its Kafka key does not hash to is refused.

A score key's record lives on the scores partition numbered as its logs' requests partition,
written by the keeper that owns it. A writer of the requests topic (the ``worker``
principal) who puts a log keyed ``a1`` on another partition made the keeper of that
partition keep a second state of ``a1@1`` and write it to a second scores partition: the
compacted topic then had two records of the key, and the planner's score view took
whichever it read last, so a forged trickle replaced the key's genuine demand, and a log
replayed on another partition was counted twice (duplicates are found per partition)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.kernel.command_partition import partition_of
from loraplane.schemas.codec import decode
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.reasons import DecodeReason
from loraplane.streams.score_fold import fold_batch
from tests.unit.test_score_keeper import KNOWN, Consumer, Txn, keeper, msg

HOME = partition_of("a1", 6)
OTHER = (HOME + 1) % 6


@settings(max_examples=200, deadline=None)
@given(
    adapter=st.sampled_from(["a1", "a2"]) | st.text("abc019._-", min_size=1, max_size=12),
    partition=st.integers(0, 15),
    counts=st.lists(st.integers(1, 16), min_size=1, max_size=3, unique=True),
)
def test_attack_a_log_is_counted_only_on_its_keys_partition(
    adapter: str, partition: int, counts: list[int]
) -> None:
    if not adapter[0].isalnum():
        adapter = "a" + adapter
    m = msg(0, adapter, partition, 0)
    out = fold_batch({}, [m], KNOWN, counts=counts)
    if partition in {partition_of(adapter, n) for n in counts}:
        assert out.refused == [] and out.ids == {partition: ["e0"]}
    else:
        ((refused, exc),) = out.refused
        assert refused is m and exc.reason is DecodeReason.wrong_partition
        assert out.flat == {} and out.ids == {} and out.unknown == 0


def test_without_counts_no_partition_is_checked() -> None:
    out = fold_batch({}, [msg(0, "a1", OTHER, 0)], KNOWN)
    assert out.refused == [] and set(out.flat) == {"a1@1"}


def test_attack_a_forged_log_on_another_partition_is_dead_lettered_not_scored(
    tmp_path: Any,
) -> None:
    k, txn = keeper(tmp_path, [HOME, OTHER]), Txn()
    k.counts = (6,)
    genuine, forged = msg(0, "a1", HOME, 0), msg(0, "a1", OTHER, 0)  # a replay elsewhere
    k._commit(txn, Consumer(), [genuine, forged], KNOWN)
    scores = [(key, part) for topic, key, _, part in txn.produced if topic == k.scores]
    assert scores == [("a1@1", HOME)]
    letters = [decode(DeadLetter, v) for t, _, v, _ in txn.produced if t == k.dead_letters]
    assert [(d.reason, d.partition) for d in letters] == [(DecodeReason.wrong_partition, OTHER)]
    assert k.owned[OTHER].flat == {} and k.owned[OTHER].committed == 1  # committed, not lost
    assert k.owned[HOME].states["a1@1"].requests_10m.value == 1.0


class Grown(Consumer):
    def __init__(self, partitions: int) -> None:
        self.partitions, self.asked = partitions, 0

    def list_topics(self, topic: str, timeout: float) -> Any:
        self.asked += 1
        meta = SimpleNamespace(error=None, partitions=dict.fromkeys(range(self.partitions)))
        return SimpleNamespace(topics={topic: meta})


def test_a_log_placed_by_a_grown_topics_count_is_counted(tmp_path: Any) -> None:
    """Producers follow a grown topic's count: the keeper asks the broker again on a refusal
    and keeps the earlier count too (producers learn of a grow minutes later)."""
    moved = next(a for a in ("a1", "a2") if partition_of(a, 8) != partition_of(a, 6))
    at, before = partition_of(moved, 8), partition_of(moved, 6)
    k, txn, consumer = keeper(tmp_path, list(range(8))), Txn(), Grown(8)
    k.counts = (6,)
    k._commit(txn, consumer, [msg(0, moved, at, 0)], KNOWN)
    assert consumer.asked == 1 and k.counts == (8, 6)
    assert [t for t, *_ in txn.produced if t == k.dead_letters] == []
    assert f"{moved}@1" in k.owned[at].states
    k._commit(txn, consumer, [msg(1, moved, before, 0)], KNOWN)
    assert [t for t, *_ in txn.produced if t == k.dead_letters] == []
    elsewhere = next(p for p in range(8) if p not in (at, before))
    k._commit(txn, consumer, [msg(2, moved, elsewhere, 0)], KNOWN)
    letters = [decode(DeadLetter, v) for t, _, v, _ in txn.produced if t == k.dead_letters]
    assert [d.reason for d in letters] == [DecodeReason.wrong_partition]
    assert consumer.asked == 1  # a refusal asks the broker at most every PARTITIONS_EVERY_S
