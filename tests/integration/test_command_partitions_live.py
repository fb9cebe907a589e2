"""Per-worker command delivery (issue #15 item 3) on the real broker: eight workers' command
feeds (``workers.command_feed.KafkaCommandFeed``, not whole agents) on a 64-partition
commands topic, commands produced the way the planner sends them (``kernel.command_partition``
by the broker's count). Each feed gets exactly its own commands, reads at most twice their
bytes (one feed shares its partition with an offline worker's commands: the collision is
read, dropped and counted as ``own=false``), and a feed closed with commands read but not
committed gets them again after a restart, and nothing older. With command slots, eight
workers whose ids all hash to one partition each read exactly their own bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from loraplane.kernel import kafka, topics
from loraplane.kernel.bus import produce_sync, read_topic
from loraplane.kernel.command_partition import (
    DRAIN_S,
    PartitionCount,
    commands_partitions,
    partition_for,
    partition_of,
)
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import spec, topic_name
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import encode
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.keyring import KeyringFile
from loraplane.schemas.reasons import CommandRule
from loraplane.workers.command_feed import CommandSlotError, KafkaCommandFeed
from tests.integration.registry_env import Env, wait_partitions

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
WORKERS = [f"w{i}" for i in range(8)]  # eight distinct partitions of 64
PER_WORKER = 20


def _offline_neighbour(of: str, partitions: int) -> str:
    """A worker id (not one of the feeds) whose commands land in ``of``'s partition."""
    return next(
        w
        for n in range(10_000)
        if (w := f"gone{n}") not in WORKERS
        and partition_of(w, partitions) == partition_of(of, partitions)
    )


class Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, Any]] = []

    def emit(self, topic_suffix: str, key: str, message: Any) -> None:
        self.sent.append((topic_suffix, key, message))


class Planner:
    """Sends signed commands as the planner does: the worker's partition by the count the
    broker reports (``commands_partitions`` on the sender's own producer)."""

    def __init__(self, env: Env, settings: Settings | None = None) -> None:
        self.env = env
        settings = settings or env.settings
        self.producer = kafka.producer(settings)
        self.topic = topic_name(settings, "commands")
        self.partitions: PartitionCount = commands_partitions(self.topic, self.producer)
        self.sent: dict[str, list[tuple[str, int]]] = {}  # worker -> (command_id, bytes)
        self.announced: dict[str, int] = {}  # worker -> the partition its state announced

    def send(self, worker_id: str, count: int) -> None:
        now = now_utc()
        for _ in range(count):
            cid = f"load_gpu-{uuid.uuid4().hex[:12]}"
            cmd = self.env.kit.keys["planner"].sign_command(
                CacheCommand(
                    command_id=cid,
                    worker_id=worker_id,
                    action=CommandAction.load_gpu,
                    base_model="tiny-base",
                    tenant_id="acme",
                    adapter_id="support-bot",
                    version="1",
                    sha256="a" * 64,
                    lora_name="acme--support-bot--1",
                    reason=CommandReason(rule=CommandRule.hot_score),
                    issued_at=now,
                    deadline=now + timedelta(minutes=1),
                )
            )
            value, key = encode(cmd), worker_id.encode()
            self.producer.produce(
                self.topic,
                key=key,
                value=value,
                partition=partition_for(
                    worker_id, self.announced.get(worker_id), self.partitions.current()
                ),
            )
            self.sent.setdefault(worker_id, []).append((cid, len(key) + len(value)))
        assert self.producer.flush(20) == 0


def _feed(settings: Settings, worker_id: str, slot: int | None = None) -> KafkaCommandFeed:
    return KafkaCommandFeed(
        settings,
        worker_id,
        Sink(),  # type: ignore[arg-type]
        keyring=KeyringFile(settings.keyring_path),
        slot=slot,
    )


async def _take(
    feed: KafkaCommandFeed, count: int, *, commit: bool, timeout_s: float = 60.0
) -> list[str]:
    """The next ``count`` commands of ``feed`` (committed after each when ``commit``)."""
    got: list[str] = []
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(got) < count:
        assert asyncio.get_running_loop().time() < deadline, (
            f"{feed.worker_id}: {len(got)} of {count} commands"
        )
        delivery = await feed.next(0.5)
        if delivery is None:
            continue
        got.append(delivery.command.command_id)
        if commit:
            await feed.commit(delivery.message)
    return got


async def _quiet(feed: KafkaCommandFeed, for_s: float = 2.0) -> list[str]:
    """Whatever else the feed delivers within ``for_s`` (nothing, when it is right)."""
    extra = []
    deadline = asyncio.get_running_loop().time() + for_s
    while asyncio.get_running_loop().time() < deadline:
        delivery = await feed.next(0.3)
        if delivery is not None:
            extra.append(delivery.command.command_id)
    return extra


def test_each_worker_reads_its_own_commands_and_resumes_from_its_commits(
    stack: Settings, tmp_path: Path
) -> None:
    env = Env.create(stack, tmp_path)
    feeds: dict[str, KafkaCommandFeed] = {}
    try:
        wait_partitions(env.settings, "commands", 64)
        planner = Planner(env)
        assert planner.partitions.current() == spec("commands").partitions == 64
        neighbour = _offline_neighbour(WORKERS[0], 64)
        feeds = {w: _feed(env.settings, w) for w in WORKERS}
        assert {w: f.assignment.assigned() for w, f in feeds.items()} == {
            w: [partition_of(w, 64)] for w in WORKERS
        }
        for w in WORKERS:
            planner.send(w, PER_WORKER)
        planner.send(neighbour, PER_WORKER // 2)

        async def first_round() -> dict[str, tuple[list[str], list[str]]]:
            got = await asyncio.gather(*(_take(feeds[w], PER_WORKER, commit=True) for w in WORKERS))
            extra = await asyncio.gather(*(_quiet(feeds[w]) for w in WORKERS))
            return {w: (g, e) for w, g, e in zip(WORKERS, got, extra, strict=True)}

        delivered = asyncio.run(first_round())
        ratios = {}
        for w in WORKERS:
            got, extra = delivered[w]
            assert got == [cid for cid, _ in planner.sent[w]] and extra == []
            read, own = feeds[w].read_bytes, sum(size for _, size in planner.sent[w])
            assert read.own == own
            ratios[w] = (read.own + read.other) / own
        neighbours = sum(size for _, size in planner.sent[neighbour])
        assert feeds[WORKERS[0]].read_bytes.other == neighbours  # read and dropped
        assert all(feeds[w].read_bytes.other == 0 for w in WORKERS[1:])
        print(
            "bytes read / own commands' bytes: "
            + ", ".join(f"{w} {r:.2f}" for w, r in ratios.items())
        )
        assert max(ratios.values()) <= 2.0

        # A restart: 5 applied (committed), 3 read and not committed, then closed.
        w = WORKERS[0]
        planner.send(w, 10)
        planner.send(neighbour, 3)
        second = [cid for cid, _ in planner.sent[w][PER_WORKER:]]
        assert asyncio.run(_take(feeds[w], 5, commit=True)) == second[:5]
        assert asyncio.run(_take(feeds[w], 3, commit=False)) == second[5:8]
        feeds.pop(w).close()
        feeds[w] = _feed(env.settings, w)

        async def after_restart() -> tuple[list[str], list[str]]:
            return (await _take(feeds[w], 5, commit=True), await _quiet(feeds[w]))

        resumed, extra = asyncio.run(after_restart())
        assert resumed == second[5:] and extra == []  # from the commit: nothing lost or old
        print(f"after restart {w} read {feeds[w].read_bytes}")

        # A keyed write by our producer factory (murmur2_random, Kafka's own hash) lands where
        # the rule says: tools that produce keyed records agree with the planner.
        partition, _ = produce_sync(env.settings, planner.topic, "w5", b"{}")
        assert partition == partition_of("w5", 64)
    finally:
        for feed in feeds.values():
            feed.close()
        env.delete_topics()


def test_reading_everything_so_far_waits_for_every_partitions_end(
    stack: Settings, tmp_path: Path
) -> None:
    """``read_topic`` on the 64-partition commands topic returns every record written, even
    with no idle time to wait: a read ends at every partition's end, never on idle time
    alone (a 64-partition assignment and fetch can outlast ``idle_s`` on a loaded machine,
    and a test then read "no commands": the CI failure of stop 24)."""
    env = Env.create(stack, tmp_path)
    try:
        wait_partitions(env.settings, "commands", 64)
        topic = topic_name(env.settings, "commands")
        written = {
            produce_sync(
                env.settings, topic, w, f'{{"w": "{w}"}}'.encode(), producer=env.producer()
            )
            for w in WORKERS
        }
        for _ in range(3):
            got = {(r.partition, r.offset) for r in read_topic(env.settings, topic, idle_s=0.0)}
            assert got == written
    finally:
        env.delete_topics()


def test_with_command_slots_each_worker_reads_exactly_its_own_bytes(
    stack: Settings, tmp_path: Path
) -> None:
    """Eight workers whose ids all hash to one partition (hashing: each would read 8x its
    own bytes) with slots 0..7: each reads its slot, announces it, the planner sends there,
    and every feed reads its own commands and nothing else (ratio 1.00). A slot the topic
    has no partition for stops the feed's start."""
    env = Env.create(stack, tmp_path)
    feeds: dict[str, KafkaCommandFeed] = {}
    try:
        wait_partitions(env.settings, "commands", 64)
        planner = Planner(env)
        assert planner.partitions.current() == 64
        shared = partition_of("s0", 64)
        workers = [w for n in range(100_000) if partition_of(w := f"s{n}", 64) == shared][:8]
        feeds = {w: _feed(env.settings, w, slot) for slot, w in enumerate(workers)}
        assert [f.assignment.assigned() for f in feeds.values()] == [[i] for i in range(8)]
        planner.announced = {w: f.partition for w, f in feeds.items()}  # their worker states
        for w in workers:
            planner.send(w, PER_WORKER)

        async def take_all() -> dict[str, tuple[list[str], list[str]]]:
            got = await asyncio.gather(*(_take(feeds[w], PER_WORKER, commit=True) for w in workers))
            extra = await asyncio.gather(*(_quiet(feeds[w]) for w in workers))
            return {w: (g, e) for w, g, e in zip(workers, got, extra, strict=True)}

        delivered = asyncio.run(take_all())
        ratios = {}
        for w in workers:
            got, extra = delivered[w]
            assert got == [cid for cid, _ in planner.sent[w]] and extra == []
            read, own = feeds[w].read_bytes, sum(size for _, size in planner.sent[w])
            assert (read.own, read.other) == (own, 0)
            ratios[w] = (read.own + read.other) / own
        print(
            "slotted: bytes read / own commands' bytes: "
            + ", ".join(f"{w} {r:.2f}" for w, r in ratios.items())
        )
        assert set(ratios.values()) == {1.0}
        with pytest.raises(CommandSlotError, match="command slot 64 "):
            _feed(env.settings, "s-too-far", 64)
    finally:
        for feed in feeds.values():
            feed.close()
        env.delete_topics()


def test_a_grown_topic_moves_the_feed_to_its_new_partition_without_losing_one_in_flight(
    stack: Settings, tmp_path: Path
) -> None:
    """The commands topic grows from 6 to 64 partitions (``topics apply``) under a running
    feed: a command the planner still sends by the old count (its cache is up to 30 s old)
    and one by the new count both arrive; after the drain window only the new partition is
    assigned."""
    env = Env.create(stack, tmp_path)
    settings = env.settings.model_copy(update={"topic_prefix": env.settings.topic_prefix + "g"})
    small = dataclasses.replace(spec("commands"), partitions=6)
    topics.apply(settings, only=(small,))
    feed: KafkaCommandFeed | None = None
    try:
        wait_partitions(settings, "commands", 6)
        worker = "w1"  # partition 4 of 6, 52 of 64
        feed = _feed(settings, worker)
        assert feed.assignment.assigned() == [partition_of(worker, 6)]
        stale = Planner(env, settings)
        assert stale.partitions.current() == 6
        stale.send(worker, 1)
        assert asyncio.run(_take(feed, 1, commit=True)) == [stale.sent[worker][0][0]]

        topics.apply(settings, only=(spec("commands"),))
        wait_partitions(settings, "commands", 64)
        fresh = Planner(env, settings)
        assert fresh.partitions.current() == 64
        feed._checked = 0.0  # the periodic metadata check is due
        assert asyncio.run(_quiet(feed, 1.0)) == []
        assert feed.assignment.assigned() == sorted(
            {partition_of(worker, 6), partition_of(worker, 64)}
        )
        stale.send(worker, 1)  # by the old count: in flight on the old partition
        fresh.send(worker, 1)
        expected = {stale.sent[worker][1][0], fresh.sent[worker][0][0]}
        assert set(asyncio.run(_take(feed, 2, commit=True))) == expected

        feed.regroup(64, time.monotonic() + DRAIN_S)
        assert feed.assignment.assigned() == [partition_of(worker, 64)]
        fresh.send(worker, 1)
        assert asyncio.run(_take(feed, 1, commit=True)) == [fresh.sent[worker][1][0]]
    finally:
        if feed is not None:
            feed.close()
        admin = kafka.admin(settings)
        admin.delete_topics([topic_name(settings, "commands")], request_timeout=10)
        env.delete_topics()
