"""Artifact fetches run beside the agent's ticks, never inside one: a download that hangs (a
large artifact, an S3 that drips up to the fetch deadline) holds up no unload, revoke or load
of bytes already in the host tier, is not started twice, and what it brings is judged by the
desired state as it is when it lands."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp.test_utils import TestServer

from loraplane.artifact.model_shape import ModelShape
from loraplane.artifact.refusal import ArtifactError
from loraplane.artifact.verification import WorkerLimits
from loraplane.artifact_publish import PublishRequest, build_record
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Priority
from loraplane.schemas.cache_event import CacheEvent, CacheEventKind
from loraplane.schemas.commands import CommandAction
from loraplane.schemas.manifest import Manifest
from loraplane.schemas.reasons import ArtifactReason
from loraplane.testing.fake_vllm import FakeVllm
from loraplane.tiny_model import TINY_BASE_MODEL, TinyLlama, build_adapter
from loraplane.workers.agent import WorkerAgent, WorkerConfig
from loraplane.workers.artifact_fetch import (
    ArtifactFetcher,
    FetchedArtifact,
    FetchPolicy,
    FetchStopped,
)
from loraplane.workers.host_tier import Fetcher, HostTier
from loraplane.workers.reconcile import Ask
from loraplane.workers.vllm_client import VllmClient
from tests.unit.test_artifact_fetch_hostile_store import Answer, dripping, store  # noqa: F401
from tests.unit.test_gateway import BASE, FolderHostTier, ListSink, cmd, converge, record
from tests.unit.test_vllm_resolver import LocalFetcher

pytestmark = pytest.mark.asyncio(loop_scope="session")
T = TypeVar("T")
HANG_S = 30.0  # a test that fails must not hang the suite: the gate opens by itself then


@dataclass
class GatedTier(FolderHostTier):
    """A host tier whose download of the ``slow`` names blocks until ``release`` is set."""

    slow: set[str] = field(default_factory=set)
    release: threading.Event = field(default_factory=threading.Event)
    calls: Counter[str] = field(default_factory=Counter)
    waiting: Counter[str] = field(default_factory=Counter)  # blocked in ensure now

    def ensure(self, rec: AdapterRecord) -> Path:
        self.calls[rec.lora_name] += 1
        if rec.lora_name in self.slow and rec.lora_name not in self.entries_:
            self.waiting[rec.lora_name] += 1
            try:
                self.release.wait(HANG_S)
            finally:
                self.waiting[rec.lora_name] -= 1
        return super().ensure(rec)


@dataclass
class World:
    fake: FakeVllm
    agent: WorkerAgent
    tier: GatedTier
    sink: ListSink
    records: list[AdapterRecord]

    def kinds(self, rec: AdapterRecord) -> list[CacheEventKind]:
        return [e.kind for e in self.sink.messages(CacheEvent) if e.lora_name == rec.lora_name]

    async def revoke(self, rec: AdapterRecord) -> None:
        i = self.records.index(rec)
        self.records[i] = rec.model_copy(update={"status": AdapterStatus.revoked})
        await self.agent.refresh_registry()


@asynccontextmanager
async def running_agent(
    tmp_path: Path, tier: Any, records: list[AdapterRecord], base_model: str, **config: Any
) -> AsyncIterator[tuple[FakeVllm, WorkerAgent, ListSink]]:
    """An agent, started, on the FAKE vLLM; after, its fetches stopped, its clients closed."""
    fake = FakeVllm(str(tmp_path / "model"), api_key="k")
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    url, sink = str(server.make_url("")), ListSink()
    agent = WorkerAgent(
        WorkerConfig(
            worker_id="w1", base_model=base_model, vllm_url=url, host_budget_bytes=10**9, **config
        ),
        vllm=VllmClient(url, timeout_s=2, api_key="k"),
        host_tier=tier,
        registry_loader=lambda: records,
        sink=sink,
    )
    try:
        await agent.start()
        yield fake, agent, sink
    finally:
        await agent.stop_fetches()
        await agent.vllm.close()
        await server.close()


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    records = [record(a, "1", AdapterStatus.active) for a in ("hot", "warm", "slow", "late")]
    sources = {
        r.adapter_id + r.version: build_adapter(tmp_path / "src" / r.lora_name, seed=i)
        for i, r in enumerate(records)
    }
    tier = GatedTier(tmp_path / "host", sources)
    config = {"gpu_slots": 4, "tick_s": 60, "registry_poll_s": 60, "load_backoff_s": 60}
    async with running_agent(tmp_path, tier, records, BASE, **config) as (fake, agent, sink):
        yield World(fake, agent, tier, sink, records)
        tier.release.set()  # a thread still blocked in ensure ends


async def soon(step: Awaitable[T]) -> T:
    """``step``, which must not wait on a download: a regression fails here, not hangs."""
    return await asyncio.wait_for(step, HANG_S / 2)


async def blocked(world: World, rec: AdapterRecord) -> None:
    """Until the fetch of ``rec`` sits in the tier's ``ensure``."""
    while not world.tier.waiting[rec.lora_name]:
        await asyncio.sleep(0.01)


async def test_a_revoke_an_unload_and_a_host_resident_load_go_on_while_a_fetch_hangs(
    world: World,
) -> None:
    """ATTACK: an S3 object that drips. The tick awaited its download inline, under the
    agent's lock: every other action of the worker waited behind it, a revoke included, up
    to the fetch deadline. Now the download is a task of its own and the tick goes on."""
    hot, warm, slow, late = world.records
    world.agent.apply(cmd(hot, CommandAction.load_gpu, "hot"))
    world.agent.apply(cmd(late, CommandAction.load_gpu, "late"))
    world.agent.apply(cmd(warm, CommandAction.prewarm_host, "warm"))
    await converge(world.agent)
    assert world.agent.is_hot(hot.lora_name) and world.agent.is_hot(late.lora_name)
    assert world.agent.is_on_host(warm.lora_name)

    world.tier.slow.add(slow.lora_name)
    world.agent._fold(Ask.gateway_load(slow))
    await soon(world.agent.reconcile_once())  # starts the fetch, does not wait for it
    await blocked(world, slow)

    await world.revoke(hot)
    world.agent.apply(cmd(late, CommandAction.demote_to_host, "late-down"))
    world.agent._fold(Ask.gateway_load(warm))
    await soon(world.agent.reconcile_once())
    assert hot.lora_name not in world.fake.adapters  # revoked: unloaded and removed
    assert not world.agent.is_on_host(hot.lora_name)
    assert world.kinds(hot)[-3:] == [
        CacheEventKind.unload,
        CacheEventKind.evict,
        CacheEventKind.refuse,  # its intent, too
    ]
    assert not world.agent.is_hot(late.lora_name) and world.agent.is_on_host(late.lora_name)
    assert world.agent.is_hot(warm.lora_name)  # loaded from the host tier meanwhile
    assert not world.agent.is_hot(slow.lora_name) and world.tier.waiting[slow.lora_name] == 1

    world.tier.release.set()
    await soon(converge(world.agent))
    assert world.agent.is_hot(slow.lora_name)
    assert world.kinds(slow) == [CacheEventKind.fetch, CacheEventKind.load]


async def test_a_second_tick_starts_no_second_fetch_and_fetches_are_bounded(
    world: World,
) -> None:
    """A tick while a name's fetch is in flight does not fetch it again, and no more than
    ``fetch_concurrency`` (2 here) downloads run at once; one that ends wakes the tick,
    which starts the next."""
    _, warm, slow, late = world.records
    world.tier.slow |= {warm.lora_name, slow.lora_name, late.lora_name}
    for rec in (warm, slow, late):
        world.agent._fold(Ask.gateway_load(rec))
    for _ in range(3):
        await soon(world.agent.reconcile_once())
    await blocked(world, warm)
    await blocked(world, slow)
    assert world.tier.calls == Counter({warm.lora_name: 1, slow.lora_name: 1})
    assert set(world.agent._rt.fetches) == {warm.lora_name, slow.lora_name}

    world.tier.release.set()
    await soon(converge(world.agent))
    assert all(world.agent.is_hot(r.lora_name) for r in (warm, slow, late))
    # each downloaded once; the load then asks the tier for the verified folder again
    assert world.tier.calls == Counter({r.lora_name: 2 for r in (warm, slow, late)})


@pytest.mark.parametrize("meanwhile", ["revoked", "demoted", "evicted"])
async def test_a_version_moved_down_during_its_fetch_is_not_loaded_after_it(
    world: World, meanwhile: str
) -> None:
    """The fetch lands after its version was revoked (or demoted, or evicted): the next
    tick decides from the desired state as it is now. A revoked version is refused (its
    waiter hears it at once) and its fetched bytes removed; a demoted one stays on the host
    tier; an evicted one is deleted from it. None of them is loaded."""
    slow = world.records[2]
    world.tier.slow.add(slow.lora_name)
    world.agent.apply(cmd(slow, CommandAction.load_gpu, "up"))
    waiter = world.agent.request_load(slow)  # a request found it cold meanwhile
    await soon(world.agent.reconcile_once())
    await blocked(world, slow)

    if meanwhile == "revoked":
        await world.revoke(slow)
    else:
        action = CommandAction.demote_to_host if meanwhile == "demoted" else CommandAction.evict
        world.agent.apply(cmd(slow, action, "down"))
    await soon(world.agent.reconcile_once())
    outcome = await soon(waiter)
    assert not outcome.ok
    assert outcome.reason == ("revoked" if meanwhile == "revoked" else "superseded_by_command")

    world.tier.release.set()
    await soon(converge(world.agent))
    await soon(converge(world.agent))
    assert slow.lora_name not in world.fake.adapters
    assert CacheEventKind.load not in world.kinds(slow)
    assert world.agent.is_on_host(slow.lora_name) == (meanwhile == "demoted")


async def test_stopping_the_agent_cancels_its_fetches_and_records_none(world: World) -> None:
    """Shutdown while a download hangs: the agent's run ends without waiting for it, its
    fetch task is cancelled, and nothing of the fetch is recorded (no entry, no event); the
    tier's own install is all or nothing (``HostTier.ensure``), and the next tick reads it."""
    slow = world.records[2]
    world.tier.slow.add(slow.lora_name)
    world.agent.request_load(slow)  # wakes the tick loop
    run = asyncio.create_task(world.agent.run())
    await blocked(world, slow)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await soon(run)
    assert world.agent._rt.fetches == {}
    assert not world.agent.is_on_host(slow.lora_name)
    assert world.kinds(slow) == []


async def test_a_load_asked_after_the_agent_stopped_starts_no_fetch(world: World) -> None:
    """The stop has cancelled the fetches (``stop_fetches``, in the run's end); a load a
    request asks for after it, acted on by any reconcile still running (a tick, a command,
    the start), starts no fetch task: none would be cancelled, and its thread would hold the
    host tier's claim until the download's deadline."""
    slow = world.records[2]
    world.tier.slow.add(slow.lora_name)
    await world.agent.stop_fetches()
    world.agent.request_load(slow)  # a request its gateway still took
    await soon(world.agent.reconcile_once())
    await asyncio.sleep(0.05)  # a thread started would be in ``ensure`` by now
    assert world.agent._rt.fetches == {}
    assert world.tier.calls[slow.lora_name] == 0


async def test_an_agent_stopped_while_it_starts_stops_its_fetches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop while the agent still starts (waiting for vLLM, reading it, its first
    reconcile, which can start fetches): the run's end stops the host tier's downloads and
    cancels the fetch tasks as it does for a started agent."""
    tier = GatedTier(tmp_path / "host", {})
    stopped: list[bool] = []
    monkeypatch.setattr(tier, "stop_fetches", lambda: stopped.append(True))
    agent = WorkerAgent(
        WorkerConfig(
            worker_id="w1", base_model=BASE, vllm_url="http://127.0.0.1:9", host_budget_bytes=1
        ),
        vllm=VllmClient("http://127.0.0.1:9", timeout_s=2, api_key="k"),
        host_tier=tier,
        registry_loader=list,
        sink=ListSink(),
    )
    waiting = asyncio.Event()

    async def wait_healthy(*_a: Any, **_k: Any) -> None:
        waiting.set()
        await asyncio.Event().wait()  # vLLM not up yet

    monkeypatch.setattr(agent.vllm, "wait_healthy", wait_healthy)
    run = asyncio.create_task(agent.run())
    try:
        await soon(waiting.wait())
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await soon(run)
        assert stopped == [True] and agent._rt.fetches == {}
    finally:
        await agent.vllm.close()


def published(tmp_path: Path, name: str, seed: int) -> tuple[AdapterRecord, Path, Manifest]:
    """An active version of adapter ``name``: its record, folder and manifest."""
    folder = build_adapter(tmp_path / "src" / name, seed=seed)
    rec, manifest = build_record(
        folder, PublishRequest(name, "t1", TINY_BASE_MODEL, "1", Priority.silver), "bucket"
    )
    return rec.model_copy(update={"status": AdapterStatus.active}), folder, manifest


def real_tier(cls: type[HostTier], root: Path, fetcher: Fetcher) -> HostTier:
    shape = ModelShape.from_hf_config(TinyLlama().hf_config(1000))
    limits = WorkerLimits(base_model=TINY_BASE_MODEL, max_lora_rank=8, model=shape)
    return cls(root, budget_bytes=10**8, limits=limits, fetcher=fetcher)


class GatedFetcher(LocalFetcher):
    """The S3 stand-in: a published artifact's download waits for ``gate``, then lands or
    fails; any other goes through the real S3 fetcher ``s3``."""

    def __init__(self, s3: ArtifactFetcher | None = None) -> None:
        super().__init__()
        self.s3 = s3
        self.gate, self.entered = threading.Event(), threading.Event()
        self.fail = False

    def fetch(
        self,
        artifact_uri: str,
        dest: Path,
        *,
        expected_sha256: str | None,
        max_total_bytes: int,
        owner: AdapterRecord | None,
    ) -> FetchedArtifact:
        fetcher: Fetcher = super()
        if artifact_uri not in self.sources and self.s3 is not None:
            fetcher = self.s3
        else:
            self.entered.set()
            self.gate.wait(HANG_S)
        if self.fail:
            dest.mkdir(parents=True)
            (dest / "half-written").write_bytes(b"x")
            raise ArtifactError.single(ArtifactReason.artifact_store_unavailable, artifact_uri)
        return fetcher.fetch(
            artifact_uri,
            dest,
            expected_sha256=expected_sha256,
            max_total_bytes=max_total_bytes,
            owner=owner,
        )

    def stop(self) -> None:
        if self.s3 is not None:
            self.s3.stop()


class WatchedTier(HostTier):
    """The real host tier, saying when an ``ensure`` has ended (its thread is done)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.ended = threading.Event()
        super().__init__(*args, **kwargs)

    def ensure(self, record: AdapterRecord) -> Path:
        try:
            return super().ensure(record)
        finally:
            self.ended.set()


@pytest.mark.parametrize("install", ["lands", "fails"])
async def test_a_fetch_stopped_mid_install_leaves_the_host_tier_whole(
    tmp_path: Path, install: str
) -> None:
    """The agent stops while the real host tier installs an artifact. Its fetch task ends at
    once and records nothing; the install in its thread runs on to its own end, all or
    nothing: a complete, verified entry (which a later tick loads without fetching it again)
    or none, and never a ``.partial-`` folder left behind."""
    rec, folder, manifest = published(tmp_path, "a1", seed=1)
    fetcher = GatedFetcher()
    fetcher.sources[rec.artifact_uri] = (folder, manifest)
    fetcher.fail = install == "fails"
    tier = real_tier(WatchedTier, tmp_path / "tier", fetcher)
    assert isinstance(tier, WatchedTier)
    async with running_agent(tmp_path, tier, [rec], TINY_BASE_MODEL) as (_, agent, sink):
        try:
            agent._fold(Ask.gateway_load(rec))
            await soon(agent.reconcile_once())
            assert await asyncio.to_thread(fetcher.entered.wait, HANG_S)
            assert [p.name[:9] for p in tier.root.iterdir()] == [".partial-"]
            await soon(agent.stop_fetches())
            assert agent._rt.fetches == {} and sink.messages(CacheEvent) == []
        finally:
            fetcher.gate.set()
        assert await asyncio.to_thread(tier.ended.wait, HANG_S)
        left = sorted(p.name for p in tier.root.iterdir())
        if install == "fails":
            assert left == [] and tier.get(rec.lora_name) is None
            return
        assert left == [rec.lora_name]
        entry = tier.get(rec.lora_name)
        assert entry is not None and entry.intact()
        await soon(converge(agent))
        assert agent.is_hot(rec.lora_name)
        assert [e.kind for e in sink.messages(CacheEvent)] == [CacheEventKind.load]


async def test_a_revoke_goes_on_while_the_real_fetcher_reads_a_store_that_drips(
    tmp_path: Path,
    store: Callable[[Answer], str],  # noqa: F811 (the hostile store's fixture)
) -> None:
    """ATTACK, on the real fetch path (botocore, ``ArtifactFetcher``, ``HostTier``): an S3
    endpoint that drips the manifest a byte at a time, each within the read timeout. A
    revoke of a hot version on the same worker is carried out while the download goes on;
    when the store gives up, the waiting request hears the retriable failure and the name
    backs off, as before."""
    drip = dripping(store)
    fetcher = GatedFetcher(
        ArtifactFetcher(drip.settings, FetchPolicy(attempts=1, deadline_s=HANG_S))
    )
    fetcher.gate.set()
    (hot, folder, manifest), (slow, _, _) = (
        published(tmp_path, n, i) for i, n in enumerate(("hot", "slow"))
    )
    fetcher.sources[hot.artifact_uri] = (folder, manifest)  # the other from the store
    records = [hot, slow]
    tier = real_tier(HostTier, tmp_path / "tier", fetcher)
    try:
        async with running_agent(tmp_path, tier, records, TINY_BASE_MODEL) as (fake, agent, _):
            agent._fold(Ask.gateway_load(hot))
            await soon(converge(agent))
            assert agent.is_hot(hot.lora_name)

            waiter = agent.request_load(slow)
            await soon(agent.reconcile_once())
            assert await asyncio.to_thread(drip.began.wait, HANG_S)
            records[0] = hot.model_copy(update={"status": AdapterStatus.revoked})
            await agent.refresh_registry()
            await soon(agent.reconcile_once())
            assert hot.lora_name not in fake.adapters and tier.get(hot.lora_name) is None
            assert not waiter.done() and slow.lora_name in agent._rt.fetches

            drip.stop.set()  # the store gives up: the body ends short
            outcome = await soon(waiter)
            assert (outcome.ok, outcome.reason, outcome.permanent) == (
                False,
                "artifact_store_unavailable",
                False,
            )
            assert slow.lora_name in agent._rt.backoff and tier.get(slow.lora_name) is None
            assert not any(p.name.startswith(".partial-") for p in tier.root.iterdir())
    finally:
        drip.stop.set()


async def test_stopping_the_agent_ends_a_download_from_a_store_that_drips(
    tmp_path: Path,
    store: Callable[[Answer], str],  # noqa: F811 (the hostile store's fixture)
) -> None:
    """ATTACK, on the real fetch path: an S3 endpoint that drips an artifact a byte at a
    time, for ever, each within the read timeout. Stopping the agent ends the download in
    its thread at its next chunk (``ArtifactFetcher.stop``), long before the fetch deadline
    (30 s here, 60 s by default) to which it ran on, holding the worker's exit. The host tier
    is left whole: no entry, no ``.partial-`` folder, nothing recorded; a later install
    needing a download fails at once."""
    drip = dripping(store)
    fetcher = ArtifactFetcher(drip.settings, FetchPolicy(attempts=1, deadline_s=HANG_S))
    rec, _, _ = published(tmp_path, "slow", 1)
    tier = real_tier(WatchedTier, tmp_path / "tier", fetcher)
    assert isinstance(tier, WatchedTier)
    try:
        async with running_agent(tmp_path, tier, [rec], TINY_BASE_MODEL) as (_, agent, sink):
            agent._fold(Ask.gateway_load(rec))
            await soon(agent.reconcile_once())
            assert await asyncio.to_thread(drip.began.wait, HANG_S)
            assert [p.name[:9] for p in tier.root.iterdir()] == [".partial-"]
            await soon(agent.stop_fetches())
            # the thread ends within a socket read (2 s), not at the deadline (30 s)
            assert await asyncio.to_thread(tier.ended.wait, HANG_S / 3)
            assert list(tier.root.iterdir()) == [] and tier.get(rec.lora_name) is None
            assert agent._rt.fetches == {} and sink.messages(CacheEvent) == []
            with pytest.raises(FetchStopped):
                await asyncio.to_thread(tier.ensure, rec)
    finally:
        drip.stop.set()
