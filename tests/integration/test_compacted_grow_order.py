"""A compacted, keyed topic grown on the real broker: a key's records before the grow stay on
its old partition (compaction is per partition) and its later ones go to its new partition,
and a reader has no order across partitions. A reader started after the grow takes each
key's record on its home under the topic's count, whatever order the partitions arrive in
(``kernel.compacted``): the planner's memory read by a fresh planner and by ``plan show``."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplane.kernel import kafka, topics
from loraplane.kernel.bus import keys_spread
from loraplane.kernel.command_partition import partition_of
from loraplane.kernel.config import Settings
from loraplane.kernel.topic_tail import TopicTail
from loraplane.schemas.codec import encode
from loraplane.schemas.keyring import save_keyring
from loraplane.streams.planner import WorkerMemory, plan
from loraplane.streams.planner_runtime import PREVIEW_TOPICS, memory_of, preview
from tests.integration.metrics_env import isolated
from tests.integration.registry_env import wait_partitions
from tests.unit.test_planner import NOW, POLICY, record, scores, views, worker
from tests.unit.test_planner_memory import KIT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

OLD, NEW = 3, 4  # the planner-memory topic's partitions before and after the grow
# keys that move, half of them to a lower partition, half to a higher one: whatever order a
# reader fetches the partitions in, some key's newer record comes first
_MOVED = [w for w in (f"gw{n}" for n in range(400)) if partition_of(w, NEW) != partition_of(w, OLD)]
WORKERS = [w for w in _MOVED if partition_of(w, NEW) < partition_of(w, OLD)][:4] + [
    w for w in _MOVED if partition_of(w, NEW) > partition_of(w, OLD)
][:4]
ADAPTERS = [record(f"a{i}") for i in range(24)]


@pytest.fixture
def settings(stack: Settings, tmp_path: Path) -> Iterator[Settings]:
    settings = isolated(stack).model_copy(
        update={"home": tmp_path, "keyring_path": tmp_path / "keyring.yaml"}
    )
    save_keyring(KIT.keyring, settings.keyring_path)
    names = [topics.topic_name(settings, t) for t in PREVIEW_TOPICS]
    topics.apply(settings, only=tuple(topics.spec(t) for t in PREVIEW_TOPICS))
    wait_partitions(settings, "planner-memory", OLD)
    try:
        yield settings
    finally:
        with contextlib.suppress(Exception):
            admin = kafka.admin(settings)
            for future in admin.delete_topics(names, operation_timeout=20).values():
                future.result(timeout=30)


def _write(settings: Settings, memories: dict[str, WorkerMemory]) -> None:
    """Each memory signed by the planner key, keyed by its worker, by a fresh producer (it
    hashes over the topic's count now)."""
    producer = kafka.producer(settings, quiet=True)
    topic = topics.topic_name(settings, "planner-memory")
    for wid, memory in memories.items():
        signed = KIT.keys["planner"].sign_memory(wid, memory.record())
        producer.produce(topic, key=wid.encode(), value=encode(signed))
    assert producer.flush(30) == 0


@pytest.fixture
def grown(settings: Settings) -> dict[str, WorkerMemory]:
    """Each worker's memory before the grow (a pending command) on its old partition, and
    its newer memory (the command seen done, a later session) on its new one."""
    assert len(WORKERS) >= 3
    before = plan(
        views(*ADAPTERS),
        scores(**{a.adapter_id: 1.0 for a in ADAPTERS}),
        [worker(w) for w in WORKERS],
        POLICY,
        NOW,
    ).memory
    assert all(before[w].pending for w in WORKERS)
    _write(settings, {w: before[w] for w in WORKERS})
    to_new = dataclasses.replace(topics.spec("planner-memory"), partitions=NEW)
    (change,) = topics.apply(settings, only=(to_new,), spread=keys_spread)
    assert change.action == "partitions", change  # every key on one partition: grown
    wait_partitions(settings, "planner-memory", NEW)
    after = {w: dataclasses.replace(m, pending=(), epoch=m.epoch + 1) for w, m in before.items()}
    _write(settings, after)
    return after


def test_a_fresh_planner_reads_each_workers_newest_memory_after_a_grow(
    settings: Settings, grown: dict[str, WorkerMemory]
) -> None:
    """The planner's memory tail started after the grow (a standby or a restarted planner)
    read each worker's old partition after its new one and held the old record as the
    worker's last: memory_of gave the pending commands already done, which the takeover
    resends (``_resend``), and the older epoch."""
    tail = TopicTail(
        settings, topics.topic_name(settings, "planner-memory"), component="test-grow-memory"
    ).start()
    try:
        assert tail.wait_read_to(tail.ends(), 60)
        read = memory_of(tail.snapshot(), KIT.keyring)
    finally:
        tail.stop()
    assert read == grown


def test_plan_show_reads_each_workers_newest_memory_after_a_grow(
    settings: Settings, grown: dict[str, WorkerMemory]
) -> None:
    """``plan show`` (``preview``) kept the record read last of each key: the pending
    commands of the old partition's memory were counted as still pending."""
    shown = preview(settings, None, timeout_s=30)
    assert shown.memory_workers == len(grown)
    assert shown.pending == 0


def test_a_second_grow_is_refused_while_a_key_lies_on_two_partitions(
    settings: Settings, grown: dict[str, WorkerMemory]
) -> None:
    """The first grow went through (every key on one partition); after it each worker's
    memory lies on its old partition and on its new home. A second grow could make the
    old partition a key's home again, where its record from before the first grow would
    outrank its newer one (``bus.replaces``): ``apply`` refuses it and grows nothing."""
    wider = dataclasses.replace(topics.spec("planner-memory"), partitions=NEW + 2)
    (change,) = topics.apply(settings, only=(wider,), spread=keys_spread)
    assert change.action == "refused" and f"{len(WORKERS)} key(s)" in change.detail, change
    (change,) = topics.apply(settings, only=(wider,))  # nothing to check its keys with
    assert change.action == "refused" and "without a check" in change.detail, change
    admin, name = kafka.admin(settings), topics.topic_name(settings, "planner-memory")
    assert len(admin.list_topics(name, timeout=5).topics[name].partitions) == NEW
