"""The commands partition rule (kernel.command_partition): the planner and every worker
compute it apart, so it must be stable across processes and in range; the sender's cache of
the partition count re-reads the broker when stale and survives a failed read."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplane.kernel.command_partition import (
    PartitionCount,
    broker_partitions,
    murmur2,
    partition_for,
    partition_of,
)


def test_the_rule_is_pinned_so_planner_and_workers_of_any_version_agree() -> None:
    assert [partition_of(w, 64) for w in ("w1", "w2", "worker-0")] == [15, 2, 10]
    assert partition_of("w1", 6) == partition_of("w6", 6) == 5  # a collision at 6


# Kafka's own test vectors of Utils.murmur2 (clients/src/test/.../UtilsTest.java), as Java ints
KAFKA_MURMUR2 = {
    "21": -973932308,
    "foobar": -790332482,
    "a-little-bit-long-string": -985981536,
    "a-little-bit-longer-string": -1486304829,
    "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    "abc": 479470107,
}


def test_the_hash_is_kafkas_own() -> None:
    """murmur2 as Kafka's Java client, aiokafka (Faust's producer) and librdkafka's
    ``murmur2_random`` compute it, so a keyed record from any of them lands where the rule
    says (against the broker itself: test_command_partitions_live and
    test_registry_trust_live's partition check)."""
    assert {k: murmur2(k.encode()) for k in KAFKA_MURMUR2} == {
        k: v & 0xFFFFFFFF for k, v in KAFKA_MURMUR2.items()
    }


def test_the_planner_sends_to_the_announced_partition_when_in_range_else_the_hash() -> None:
    assert partition_for("w1", 3, 64) == 3  # a slot
    assert partition_for("w1", None, 64) == partition_of("w1", 64) == 15  # an older worker
    assert partition_for("w1", 64, 64) == 15  # a slot the topic has no partition for: hash


@given(
    st.text(min_size=1, max_size=64),
    st.none() | st.integers(min_value=0, max_value=20_000),
    st.integers(min_value=1, max_value=10_000),
)
def test_partition_for_is_in_range_and_is_the_announcement_or_the_hash(
    worker_id: str, announced: int | None, partitions: int
) -> None:
    got = partition_for(worker_id, announced, partitions)
    assert 0 <= got < partitions
    if announced is not None and announced < partitions:
        assert got == announced
    else:
        assert got == partition_of(worker_id, partitions)


def test_the_rule_does_not_depend_on_the_process_hash_seed() -> None:
    code = "from loraplane.kernel.command_partition import partition_of as p; print(p('w-7', 64))"
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert seen == {f"{partition_of('w-7', 64)}\n"}


@given(st.text(min_size=1, max_size=64), st.integers(min_value=1, max_value=10_000))
def test_every_worker_id_lands_in_range(worker_id: str, partitions: int) -> None:
    assert 0 <= partition_of(worker_id, partitions) < partitions
    assert partition_of(worker_id, partitions) == partition_of(worker_id, partitions)


@given(st.integers(min_value=-5, max_value=0))
def test_a_topic_without_partitions_is_refused(partitions: int) -> None:
    with pytest.raises(ValueError):
        partition_of("w1", partitions)


def test_a_thousand_workers_spread_over_64_partitions() -> None:
    counts = [0] * 64
    for n in range(1000):
        counts[partition_of(f"worker-{n}", 64)] += 1
    assert max(counts) <= 3 * 1000 / 64  # no partition carries many workers' commands


@dataclass
class Clock:
    t: float = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_count_is_read_once_per_refresh_and_kept_when_a_read_fails() -> None:
    answers: list[int | Exception] = [6, 64, RuntimeError("broker away"), 64]
    reads: list[int] = []

    def read() -> int:
        answer = answers.pop(0)
        reads.append(1)
        if isinstance(answer, Exception):
            raise answer
        return answer

    clock = Clock()
    count = PartitionCount(read, refresh_s=30.0, clock=clock)
    assert count.current() == 6 and count.current() == 6 and len(reads) == 1
    clock.t = 29.9
    assert count.partition_of("w1") == partition_of("w1", 6) and len(reads) == 1
    clock.t = 30.0
    assert count.partition_of("w1") == partition_of("w1", 64) and len(reads) == 2
    clock.t = 60.0
    assert count.current() == 64 and len(reads) == 3  # failed: the last count goes on
    clock.t = 61.0
    assert count.current() == 64 and len(reads) == 3  # and is not re-read at every call


def test_with_no_count_yet_a_failed_read_is_an_error() -> None:
    def read() -> int:
        raise RuntimeError("broker away")

    with pytest.raises(RuntimeError):
        PartitionCount(read).current()


class Client:
    def __init__(self, topics: dict[str, Any]) -> None:
        self.topics = topics

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        return SimpleNamespace(topics=self.topics)


def test_the_broker_count_is_the_metadata_partitions_and_an_unknown_topic_is_an_error() -> None:
    ok = SimpleNamespace(error=None, partitions=dict.fromkeys(range(64)))
    assert broker_partitions(Client({"p.commands": ok}), "p.commands", 1.0) == 64
    missing = SimpleNamespace(error="UNKNOWN_TOPIC_OR_PART", partitions={})
    for topics in ({}, {"p.commands": missing}):
        with pytest.raises(LookupError):
            broker_partitions(Client(topics), "p.commands", 1.0)
