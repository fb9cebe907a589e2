"""A resource is not closed under a blocking call a cancelled task left running in its thread
(loraplane/kernel/thread_calls.py): the worker's command feed (poll, commit, metadata on
one librdkafka handle), the worker's host-tier claim (the agent's installs, removals, saved
views and applied ids), the router's registry reads (they emit to the sink). Each fake call
blocks on an event: the task awaiting it is cancelled (a stop's ``cancel_all``, a commit's
``wait_for``), close runs, and the call is still inside."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from loraplane.kernel import kafka
from loraplane.kernel.config import Settings
from loraplane.kernel.thread_calls import ThreadCalls, ThreadCallsClosed
from loraplane.schemas.keyring import KeyringFile
from loraplane.workers import command_feed, runner
from loraplane.workers.command_feed import KafkaCommandFeed
from tests.kafka_message import AssignedConsumer, FakeMessage

WAIT_S = 5.0  # the longest a test waits for a thread it released (never reached when green)


@dataclass
class BlockingConsumer(AssignedConsumer):
    """``poll``, ``commit`` or ``list_topics`` (once armed) blocks until ``release``; it
    notes whether its ``close`` came while a call was inside."""

    blocks: str = "poll"
    armed: bool = False
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    inside: int = 0
    closes: list[int] = field(default_factory=list)  # calls inside at each close

    def _call(self, name: str) -> None:
        if self.armed and name == self.blocks:
            self.inside += 1
            self.entered.set()
            try:
                self.release.wait(WAIT_S)
            finally:
                self.inside -= 1

    def poll(self, timeout: float) -> FakeMessage | None:
        self._call("poll")
        return None

    def commit(self, message: FakeMessage, asynchronous: bool) -> None:
        self._call("commit")

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        self._call("list_topics")
        return super().list_topics(topic, timeout)

    def close(self) -> None:
        self.closes.append(self.inside)


class Sink:
    def emit(self, topic_suffix: str, key: str, message: object) -> None:
        pass


def _feed(monkeypatch: pytest.MonkeyPatch, consumer: BlockingConsumer) -> KafkaCommandFeed:
    monkeypatch.setattr(kafka, "consumer", lambda *a, **k: consumer)
    feed = KafkaCommandFeed(
        Settings(),
        "w1",
        Sink(),  # type: ignore[arg-type]
        keyring=KeyringFile(Path("/nonexistent")),
    )
    consumer.armed = True
    return feed


async def _entered(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, WAIT_S)


async def _blocked_call(
    feed: KafkaCommandFeed, consumer: BlockingConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start the blocking call, let its task end as a stop or a timeout ends it."""
    if consumer.blocks == "poll":
        task = asyncio.create_task(feed.next(0.5))
        await _entered(consumer.entered)
        task.cancel()  # the worker's stop: cancel_all
        with pytest.raises(asyncio.CancelledError):
            await task
    elif consumer.blocks == "commit":
        monkeypatch.setattr(command_feed, "COMMIT_TIMEOUT_S", 0.05)
        with pytest.raises(TimeoutError):  # wait_for gave up; the commit runs on
            await feed.commit(FakeMessage(b"w1", b""))
        assert consumer.entered.is_set()
    else:  # the metadata read of the partition-count check
        feed._checked = 0.0
        task = asyncio.create_task(feed.next(0.5))
        await _entered(consumer.entered)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("blocks", ["poll", "commit", "list_topics"])
async def test_the_feed_closes_its_consumer_only_after_a_call_still_in_its_thread(
    blocks: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    consumer = BlockingConsumer(blocks=blocks)
    feed = _feed(monkeypatch, consumer)
    try:
        await _blocked_call(feed, consumer, monkeypatch)
        assert consumer.inside == 1
        closing = asyncio.create_task(asyncio.to_thread(feed.close))
        await asyncio.sleep(0.1)
        assert consumer.closes == []  # not while librdkafka is inside the call
        consumer.release.set()
        await closing
        assert consumer.closes == [0]  # closed, once the call had returned
    finally:
        consumer.release.set()


async def test_a_call_that_does_not_return_leaves_the_consumer_open(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = BlockingConsumer(blocks="poll")
    feed = _feed(monkeypatch, consumer)
    try:
        await _blocked_call(feed, consumer, monkeypatch)
        started = time.monotonic()
        with caplog.at_level(logging.ERROR, "loraplane.kernel.thread_calls"):
            assert feed.close(0.2) is False
        assert time.monotonic() - started < 1.0
        assert consumer.closes == []  # left to the process exit, not destroyed under poll
        text = caplog.text
        assert "command feed of worker w1" in text and "poll" in text
        assert "left open until the process exits" in text
        with pytest.raises(ThreadCallsClosed):  # nothing new starts on it
            await feed.next(0.01)
    finally:
        consumer.release.set()


async def test_a_call_cancelled_before_its_thread_took_it_never_runs_and_is_not_waited_for() -> (
    None
):
    from concurrent.futures import ThreadPoolExecutor

    loop = asyncio.get_running_loop()
    one = ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(one)
    calls, ran = ThreadCalls("a resource"), []
    busy, release = threading.Event(), threading.Event()

    def block() -> None:
        busy.set()
        release.wait(WAIT_S)

    try:
        first = asyncio.create_task(calls.run(block))
        while not busy.is_set():
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(calls.run(ran.append, 1))  # behind ``block``
        await asyncio.sleep(0.01)
        assert calls.in_flight == 2
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert calls.in_flight == 1  # only ``block``: the queued one will never run
        release.set()
        await first
        assert calls.drain(WAIT_S) is True and ran == []
    finally:
        release.set()
        one.shutdown(wait=False)


async def test_the_host_tier_stays_claimed_until_the_agents_calls_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's stop: the agent's task is cancelled while an install (or a saved view, or
    the applied ids) still writes in the host tier; the folder's claim outlives it."""
    release, entered = threading.Event(), threading.Event()
    claimed_at_end: list[bool] = []
    folder = tmp_path / "tier"

    def install() -> None:  # a host-tier write, ending after serve_worker's own part returned
        entered.set()
        release.wait(WAIT_S)
        try:
            runner.claim_host_tier(folder).close()
            claimed_at_end.append(False)
        except SystemExit:
            claimed_at_end.append(True)

    async def serve(settings: Settings, options: Any, threads: ThreadCalls | None = None) -> None:
        run = threads.run if threads is not None else asyncio.to_thread
        task = asyncio.create_task(run(install))
        await _entered(entered)
        task.cancel()  # cancel_all at the stop
        threading.Timer(0.2, release.set).start()

    monkeypatch.setattr(runner, "_serve_worker", serve)
    options = runner.WorkerOptions(
        worker_id="w1",
        base_model="b",
        vllm_url="http://127.0.0.1:9",
        gateway_port=9,
        host_tier_dir=folder,
        host_budget_bytes=1,
        metrics_port=None,
    )
    try:
        await runner.serve_worker(Settings(home=tmp_path), options)
        for _ in range(100):
            if claimed_at_end:
                break
            await asyncio.sleep(0.05)
        assert claimed_at_end == [True]  # the install ended inside the claim
        runner.claim_host_tier(folder).close()  # and the claim is released after it
    finally:
        release.set()


async def test_the_router_waits_for_a_registry_read_its_stop_left_in_a_thread() -> None:
    from types import SimpleNamespace

    from loraplane.router.server import _refresh_registry

    entered, release = threading.Event(), threading.Event()

    class Registry:
        def records(self) -> list[Any]:
            entered.set()
            release.wait(WAIT_S)
            return []

    reads = ThreadCalls("router registry reads")
    refresher = asyncio.create_task(
        _refresh_registry(Registry(), SimpleNamespace(), reads)  # type: ignore[arg-type]
    )
    try:
        await _entered(entered)
        refresher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await refresher
        assert reads.in_flight == 1  # the read's thread runs on: the sink must stay open
        threading.Timer(0.1, release.set).start()
        assert await asyncio.to_thread(reads.drain, WAIT_S) is True
    finally:
        release.set()


async def test_the_agents_blocking_calls_are_the_ones_its_owner_waits_for() -> None:
    """The worker agent runs its host-tier and registry calls in the ``threads`` the runner
    drains before closing the sink and releasing the host tier."""
    from tests.unit.test_poison_pills import agent

    entered, release = threading.Event(), threading.Event()

    def loader() -> list[Any]:
        entered.set()
        release.wait(WAIT_S)
        return []

    threads = ThreadCalls("worker w1 host tier")
    worker = agent(loader, threads)
    refresh = asyncio.create_task(worker.refresh_registry())
    try:
        await _entered(entered)
        refresh.cancel()
        with pytest.raises(asyncio.CancelledError):
            await refresh
        assert threads.in_flight == 1
        release.set()
        assert await asyncio.to_thread(threads.drain, WAIT_S) is True
    finally:
        release.set()
        await worker.vllm.close()


async def test_a_second_drain_waits_only_what_is_left_of_the_first() -> None:
    """A worker's stop drains the agent's calls, then its close drains them again before it
    releases the host tier: a call stuck past the first bound is not waited for twice."""
    calls = ThreadCalls("a resource")
    busy, release = threading.Event(), threading.Event()

    def block() -> None:
        busy.set()
        release.wait(WAIT_S)

    stuck = asyncio.create_task(calls.run(block))
    try:
        while not busy.is_set():
            await asyncio.sleep(0.01)
        started = time.monotonic()
        assert calls.drain(0.3) is False
        closed: list[bool] = []
        assert calls.close_when_drained(lambda: closed.append(True), 0.3) is False
        assert time.monotonic() - started < 0.5  # 0.3 s in all, not 0.6
        assert closed == []  # still not closed under the stuck call
    finally:
        release.set()
        await stuck
    assert calls.drain(0.3) is True  # the call ended: nothing left to wait for
