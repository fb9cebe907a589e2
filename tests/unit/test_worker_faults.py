"""Faults at the worker agent's seams: a host tier whose disk refuses (permissions changed, a
folder that cannot be renamed), a vLLM that answers 200 to a load but does not serve the
adapter. The agent reports each with a reason and its tick loop goes on; nothing is marked
loaded that vLLM does not serve."""

from __future__ import annotations

import asyncio
import errno
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from loraplane.artifact.model_config import read_model_config
from loraplane.artifact.refusal import ArtifactError
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.cache_event import CacheEvent, CacheEventKind
from loraplane.schemas.commands import CommandAction
from loraplane.schemas.reasons import ArtifactReason, VllmErrorCode, VllmFailure
from loraplane.schemas.worker_state import WorkerState
from loraplane.testing.fake_vllm import FakeVllm
from loraplane.tiny_model import TinyLlama, build_adapter
from loraplane.workers.agent import WorkerAgent, WorkerConfig
from loraplane.workers.base_model import BaseModelWatch
from loraplane.workers.reconcile import Ask, CommandSkip
from loraplane.workers.vllm_client import VllmClient, VllmError, classify
from tests.unit.test_gateway import BASE, FolderHostTier, ListSink, cmd, converge, record

pytestmark = pytest.mark.asyncio(loop_scope="session")


@dataclass
class BrokenDiskTier(FolderHostTier):
    """A host tier whose disk refuses to delete (its permissions changed under it)."""

    refuse_remove: bool = False
    refuse_ensure: bool = False
    refuse_artifact: bool = False  # the verifier refuses the version (a refusal, not a failure)
    ensures: int = 0

    def remove(self, name: str) -> bool:
        if self.refuse_remove:
            raise PermissionError(13, "Permission denied", str(self.root / name))
        return super().remove(name)

    def ensure(self, rec: AdapterRecord) -> Path:
        self.ensures += 1
        if self.refuse_artifact:
            raise ArtifactError.single(
                ArtifactReason.tensor_value_nonfinite, "adapter_model.safetensors"
            )
        if self.refuse_ensure:
            raise PermissionError(13, "Permission denied", str(self.root / rec.lora_name))
        return super().ensure(rec)


@dataclass
class World:
    fake: FakeVllm
    agent: WorkerAgent
    tier: BrokenDiskTier
    sink: ListSink
    records: list[AdapterRecord]

    def events(self, name: str) -> list[CacheEvent]:
        return [e for e in self.sink.messages(CacheEvent) if e.lora_name == name]


@pytest.fixture
async def world(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[World]:
    """``indirect`` params are WorkerConfig fields."""
    records = [record("chat", "1", AdapterStatus.active), record("sql", "1", AdapterStatus.active)]
    sources = {
        r.adapter_id + r.version: build_adapter(tmp_path / "src" / r.lora_name, seed=i)
        for i, r in enumerate(records)
    }
    fake = FakeVllm(str(tmp_path / "model"), api_key="k")
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    sink, tier = ListSink(), BrokenDiskTier(tmp_path / "host", sources)
    agent = WorkerAgent(
        WorkerConfig(
            worker_id="w1",
            base_model=BASE,
            vllm_url=str(server.make_url("")),
            host_budget_bytes=10**9,
            **{"tick_s": 0.05, "registry_poll_s": 60, "load_backoff_s": 60}
            | getattr(request, "param", {}),
        ),
        vllm=VllmClient(str(server.make_url("")), timeout_s=2, api_key="k"),
        host_tier=tier,
        registry_loader=lambda: records,
        sink=sink,
    )
    await agent.start()
    yield World(fake, agent, tier, sink, records)
    await agent.vllm.close()
    await server.close()


async def test_a_host_tier_that_raises_neither_ends_the_tick_nor_stops_other_actions(
    world: World,
) -> None:
    """ATTACK: the host tier's folder lost its permissions. ``remove`` of a revoked version
    raised PermissionError out of ``reconcile_once``: the tick loop ended, and with it the
    worker and its gateway. Now the action fails with a ``host_io_error`` event (once, not
    every tick), the tick's other actions run, and a later tick retries it."""
    chat, sql = world.records
    world.agent._fold(Ask.gateway_prefetch(chat))
    await converge(world.agent)
    assert world.agent.is_on_host(chat.lora_name)
    world.records[0] = chat.model_copy(update={"status": AdapterStatus.revoked})
    await world.agent.refresh_registry()
    world.tier.refuse_remove = True
    world.agent._fold(Ask.gateway_load(sql))
    for _ in range(3):
        await converge(world.agent)
    assert world.agent.is_hot(sql.lora_name)  # the tick's other action ran
    failed = [e for e in world.events(chat.lora_name) if e.kind is CacheEventKind.fail]
    assert [(e.reason, "Permission denied" in e.detail) for e in failed] == [
        ("host_io_error", True)
    ]
    world.tier.refuse_remove = False
    await world.agent.reconcile_once()
    assert not world.agent.is_on_host(chat.lora_name)
    assert world.events(chat.lora_name)[-1].kind is CacheEventKind.evict


async def test_a_fetch_that_raises_an_os_error_is_a_failed_load_not_a_crash(
    world: World,
) -> None:
    """ATTACK: ``ensure`` raised PermissionError (not an ArtifactError): it escaped the
    agent's fetch and the tick. Now it is a retriable ``host_io_error`` whose waiter hears
    it, and the name backs off."""
    chat = world.records[0]
    world.tier.refuse_ensure = True
    waiter = world.agent.request_load(chat)
    await converge(world.agent)
    outcome = await asyncio.wait_for(waiter, 1)
    assert (outcome.ok, outcome.reason, outcome.permanent) == (False, "host_io_error", False)
    assert not world.agent.is_hot(chat.lora_name)
    assert chat.lora_name in world.agent._rt.backoff


async def _ticks_over(world: World, seconds: int, clock: list[float]) -> None:
    """One tick (and the fetches it wakes) per simulated second, for ``seconds``."""
    for _ in range(seconds):
        await converge(world.agent)
        clock[0] += 1.0


@pytest.mark.parametrize("world", [{"load_backoff_s": 5, "refusal_hold_s": 30}], indirect=True)
async def test_a_load_vllms_loader_refuses_is_held_like_a_refused_artifact(
    world: World,
) -> None:
    """ATTACK: a version the worker's verifier passes and vLLM's loader refuses (here a rank
    over vLLM's --max-lora-rank, which the worker's own limit does not know; the same for a
    module or weights file vLLM cannot load). Every refusal was a transient ``fail``: the
    version was copied from the host tier and loaded again every backoff, for as long as the
    command stood: 6 loads in 30 s. It is a refusal of that version now: one ``refuse``
    event naming vLLM's reason, the intent dropped, the waiting request answered as
    permanent at once, and requests told so without a new load until the hold ends."""
    chat = world.records[0]
    clock = [1000.0]
    world.agent._clock = lambda: clock[0]
    world.fake.max_lora_rank = 4  # the adapters are rank 8
    waiter = world.agent.request_load(chat)
    world.agent.apply(cmd(chat, CommandAction.load_gpu, "load-chat"))
    await _ticks_over(world, 29, clock)
    assert world.fake.load_calls == 1
    outcome = await asyncio.wait_for(waiter, 1)
    assert (outcome.ok, outcome.reason, outcome.permanent) == (False, "vllm_rank_too_large", True)
    assert chat.lora_name not in world.agent.desired.intents
    assert chat.lora_name not in world.agent._rt.backoff
    assert [(e.kind, e.reason) for e in world.events(chat.lora_name)] == [
        (CacheEventKind.fetch, ""),
        (CacheEventKind.refuse, "vllm_rank_too_large"),
    ]
    assert "max_lora_rank 4" in world.events(chat.lora_name)[-1].detail
    assert outcome.hold_s == 30  # the hold, from the refusal
    again = world.agent.request_load(chat)  # within the hold: at once, no new load
    assert again.done() and again.result() == replace(outcome, hold_s=1.0)  # 1 s left
    await _ticks_over(world, 2, clock)  # the hold ends: the next request tries once again
    world.fake.max_lora_rank = 8  # vLLM restarted with the worker's limit
    retried = world.agent.request_load(chat)
    await converge(world.agent)
    assert (await asyncio.wait_for(retried, 1)).ok
    assert world.agent.is_hot(chat.lora_name) and world.fake.load_calls == 2


@pytest.mark.parametrize("world", [{"load_backoff_s": 5, "refusal_hold_s": 30}], indirect=True)
async def test_attack_a_command_during_a_vllm_refusals_hold_never_reaches_vllm(
    world: World,
) -> None:
    """ATTACK: vLLM's loader refused a version; the planner (which had not heard yet, or
    sends again) commanded its load again within the hold. The command was folded like any
    other: the version was loaded again (a second call to vLLM, a second refusal event, the
    hold restarted), and neither command showed in ``skipped_commands``, so the planner
    kept expecting the copy. Now the refused command and each one during the hold are
    reported as skipped (``refusal_held``) without a call to vLLM; a move that loads
    nothing (a prewarm: its bytes are on the host) is carried out; and once the hold ends
    a command loads it again."""
    chat = world.records[0]
    clock = [1000.0]
    world.agent._clock = lambda: clock[0]
    world.fake.max_lora_rank = 4  # the adapters are rank 8: vLLM refuses them
    world.agent.apply(cmd(chat, CommandAction.load_gpu, "load-chat"))
    await _ticks_over(world, 1, clock)
    assert world.fake.load_calls == 1
    assert world.agent.worker_state().skipped_commands == ["load-chat"]
    events = len(world.events(chat.lora_name))
    for i in range(3):
        skipped = await world.agent.handle(cmd(chat, CommandAction.load_gpu, f"again-{i}"))
        assert skipped is CommandSkip.refusal_held
        await _ticks_over(world, 3, clock)
    assert world.fake.load_calls == 1 and len(world.events(chat.lora_name)) == events
    assert world.agent.worker_state().skipped_commands == [
        "load-chat",
        *(f"again-{i}" for i in range(3)),
    ]
    assert await world.agent.handle(cmd(chat, CommandAction.prewarm_host, "warm")) is None
    await _ticks_over(world, 19, clock)  # the prewarm's fetch leaves the hold as it is
    assert world.agent.is_on_host(chat.lora_name) and world.fake.load_calls == 1
    assert await world.agent.handle(cmd(chat, CommandAction.load_gpu, "late")) is (
        CommandSkip.refusal_held
    )
    await _ticks_over(world, 2, clock)  # 31 s since the refusal: the hold is over
    world.fake.max_lora_rank = 8
    assert await world.agent.handle(cmd(chat, CommandAction.load_gpu, "after")) is None
    await converge(world.agent)
    assert world.agent.is_hot(chat.lora_name) and world.fake.load_calls == 2


@pytest.mark.parametrize("world", [{"load_backoff_s": 5, "refusal_hold_s": 30}], indirect=True)
async def test_attack_a_command_during_an_artifact_refusals_hold_fetches_nothing(
    world: World,
) -> None:
    """ATTACK: the verifier refused a version's artifact; commands that would fetch it again
    within the hold (a load, a prewarm, a pin) were each folded, fetched from the artifact
    store and refused again, and none was reported as skipped. Now each is skipped as
    ``refusal_held`` (in ``skipped_commands`` with the refused one) without a fetch, and a
    request hears the refusal at once, as before; after the hold a command fetches again."""
    chat = world.records[0]
    clock = [1000.0]
    world.agent._clock = lambda: clock[0]
    world.tier.refuse_artifact = True
    world.agent.apply(cmd(chat, CommandAction.load_gpu, "load-chat"))
    await _ticks_over(world, 1, clock)
    assert world.tier.ensures == 1
    assert [(e.kind, e.reason) for e in world.events(chat.lora_name)] == [
        (CacheEventKind.refuse, "tensor_value_nonfinite")
    ]
    actions = [CommandAction.load_gpu, CommandAction.prewarm_host, CommandAction.pin]
    for i, action in enumerate(actions):
        assert await world.agent.handle(cmd(chat, action, f"again-{i}")) is (
            CommandSkip.refusal_held
        )
        await _ticks_over(world, 3, clock)
    assert world.tier.ensures == 1 and world.fake.load_calls == 0
    assert len(world.events(chat.lora_name)) == 1
    assert world.agent.worker_state().skipped_commands == [
        "load-chat",
        *(f"again-{i}" for i in range(3)),
    ]
    asked = world.agent.request_load(chat)
    assert asked.done() and asked.result().reason == "tensor_value_nonfinite"
    await _ticks_over(world, 21, clock)  # 31 s since the refusal: the hold is over
    world.tier.refuse_artifact = False
    assert await world.agent.handle(cmd(chat, CommandAction.load_gpu, "after")) is None
    await converge(world.agent)
    assert world.agent.is_hot(chat.lora_name) and world.tier.ensures > 1


@pytest.mark.parametrize("world", [{"load_backoff_s": 5, "refusal_hold_s": 30}], indirect=True)
async def test_a_load_vllm_fails_for_its_own_trouble_is_retried_after_the_backoff(
    world: World,
) -> None:
    """A 5xx that is vLLM's trouble (its engine died, it is shutting down) or a name it
    already holds is no refusal of the version: a ``fail`` event, the backoff, the waiter
    told to retry, and the load tried again once the backoff ends."""
    chat = world.records[0]
    clock = [1000.0]
    world.agent._clock = lambda: clock[0]
    failures = [(500, "EngineCore encountered an issue. See stack trace (above)")]
    real_load = world.agent.vllm.load

    async def failing(name: str, path: str, *, inplace: bool = False) -> float:
        if failures:
            status, message = failures.pop()
            raise classify(status, json.dumps({"error": {"message": message}}))
        return await real_load(name, path, inplace=inplace)

    world.agent.vllm.load = failing  # type: ignore[method-assign]
    waiter = world.agent.request_load(chat)
    world.agent.apply(cmd(chat, CommandAction.load_gpu, "load-chat"))
    await converge(world.agent)
    outcome = await asyncio.wait_for(waiter, 1)
    assert (outcome.ok, outcome.reason, outcome.permanent) == (False, "vllm_server_error", False)
    assert outcome.retry_after_s == 5
    assert chat.lora_name in world.agent.desired.intents
    await _ticks_over(world, 6, clock)
    assert world.agent.is_hot(chat.lora_name)
    kinds = [(e.kind, e.reason) for e in world.events(chat.lora_name)]
    assert kinds == [
        (CacheEventKind.fetch, ""),
        (CacheEventKind.fail, "vllm_server_error"),
        (CacheEventKind.load, ""),
    ]


class Forgetful(dict[str, tuple[str, str]]):
    """The FAKE's adapters when every load is answered 200 and registers nothing."""

    def __setitem__(self, name: str, value: tuple[str, str]) -> None:
        pass


async def test_a_load_vllm_says_200_to_but_does_not_list_is_not_marked_loaded(
    world: World,
) -> None:
    """ATTACK: a vLLM that answers 200 to load_lora_adapter and then does not serve the
    adapter. The agent marked it hot and told the waiting request so until the next tick
    found it gone. Now the load is checked against /v1/models: it fails as
    ``vllm_bad_response``, backs off, and nothing calls it loaded."""
    chat = world.records[0]
    world.fake.adapters = Forgetful()
    waiter = world.agent.request_load(chat)
    await converge(world.agent)
    outcome = await asyncio.wait_for(waiter, 1)
    assert (outcome.ok, outcome.reason) == (False, "vllm_bad_response")
    assert not world.agent.is_hot(chat.lora_name)
    assert chat.lora_name not in world.agent._rt.loaded_by_agent
    assert chat.lora_name in world.agent._rt.backoff
    kinds = [(e.kind, e.reason) for e in world.events(chat.lora_name)]
    assert (CacheEventKind.load, "") not in kinds
    assert (CacheEventKind.fail, "vllm_bad_response") in kinds


async def test_names_a_hostile_vllm_invents_add_no_metric_series(world: World) -> None:
    """ATTACK: a vLLM that lists new foreign names every tick. Each was unloaded as a
    conflict, as it must be, but labelled its counter with the adapter id and version parsed
    from the name: one Prometheus series per invented name, for good (unbounded memory and
    scrape size). A name the registry does not know is counted as ``unknown``."""
    for tick in range(5):
        for i in range(20):
            world.fake.adapters[f"evil{tick}x{i}@1-deadbeef"] = ("/tmp/evil", "d")
        await world.agent.reconcile_once()
        assert not world.fake.adapters  # every one unloaded at once
    conflicts = [
        s
        for metric in world.agent.metrics.registry.collect()
        if metric.name == "loraplane_kv_namespace_conflict"
        for s in metric.samples
        if s.name.endswith("_total")
    ]
    assert [(s.labels["adapter_id"], s.value) for s in conflicts] == [("unknown", 100.0)]


async def test_a_full_disk_under_the_applied_ids_fails_no_command(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ATTACK: the disk of the applied-command ids fills up. ``save_applied`` raised
    ENOSPC out of ``handle``: the command, already applied, failed its loop step, and the
    feed did not commit past it. Now the agent says the ids are not saved (a restart may
    apply them again), carries the command out, and saves them once the disk has room."""
    world.agent.config = replace(world.agent.config, applied_commands_path=world.tier.root / "ids")
    saved: list[dict[str, object]] = []

    def full(path: Path, applied: dict[str, object], protected: object = ()) -> None:
        if not saved:
            raise OSError(errno.ENOSPC, "No space left on device")
        saved.append(dict(applied))

    monkeypatch.setattr("loraplane.workers.agent.save_applied", full)
    chat, sql = world.records
    assert await world.agent.handle(cmd(chat, CommandAction.load_gpu, "c-1")) is None
    await converge(world.agent)  # its fetch, then its load
    assert world.agent.is_hot(chat.lora_name)
    assert "No space left on device" in caplog.text
    saved.append({})  # room again
    assert await world.agent.handle(cmd(sql, CommandAction.load_gpu, "c-2")) is None
    assert set(saved[-1]) == {"c-1", "c-2"}


async def test_foreign_names_vllm_will_not_unload_stay_out_of_the_heartbeat(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATTACK: a vLLM that lists names nobody loaded and refuses to unload them. Each was
    a copy in the heartbeat: past 100,000 the WorkerState could not be built, and the
    heartbeat loop (and the worker with it) ended; far fewer made it too large for Kafka.
    The heartbeat carries the copies this agent holds; the others count as used slots."""
    chat = world.records[0]
    world.agent._fold(Ask.gateway_load(chat))
    await converge(world.agent)
    for i in range(200):
        world.fake.adapters[f"evil{i}@1-deadbeef"] = ("/tmp/evil", "d")

    async def refuse(name: str) -> None:
        raise VllmError(VllmErrorCode.server_error, "no", 500)

    monkeypatch.setattr(world.agent.vllm, "unload", refuse)
    for _ in range(5):
        await world.agent.reconcile_once()
    state = world.agent.worker_state()
    assert [a.lora_name for a in state.adapters] == [chat.lora_name]
    assert state.gpu_slots_used == 201


async def test_a_heartbeat_that_cannot_be_built_does_not_end_the_loop(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A heartbeat that fails (a state the schema refuses) is logged; the loop goes on."""
    calls = 0

    def broken() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("a state the schema refuses")

    monkeypatch.setattr(world.agent, "publish_state", broken)
    world.agent.config = replace(world.agent.config, heartbeat_s=0.01)
    loop = asyncio.create_task(world.agent._heartbeat_loop())
    await asyncio.sleep(0.2)
    assert not loop.done() and calls > 2
    loop.cancel()


async def test_a_fetch_that_raises_anything_else_is_a_failed_load_that_backs_off(
    world: World,
) -> None:
    """ATTACK: ``ensure`` raised an error that is neither an ArtifactError nor an OSError (a
    library's parser meeting a hostile answer, a bug). It left the agent's fetch unmapped:
    no backoff (the install was tried again every tick), the waiting request was not
    answered until its own timeout, and the event had no reason. It is a retriable
    ``install_error`` now, heard by the waiter, and the name backs off."""
    chat = world.records[0]

    def broken(rec: AdapterRecord) -> Path:
        raise RuntimeError("Unable to calculate correct timezone offset")

    world.tier.ensure = broken  # type: ignore[method-assign]
    waiter = world.agent.request_load(chat)
    await world.agent.reconcile_once()
    outcome = await asyncio.wait_for(waiter, 1)
    assert (outcome.ok, outcome.reason, outcome.permanent) == (False, "install_error", False)
    assert chat.lora_name in world.agent._rt.backoff
    failed = [e for e in world.events(chat.lora_name) if e.kind is CacheEventKind.fail]
    assert [(e.reason, "RuntimeError" in e.detail) for e in failed] == [("install_error", True)]


def _announced(world: World) -> VllmFailure | None:
    """What the worker's latest heartbeat says of its gateway refusing requests as not run
    (one goes out at once when that changes: none is published here)."""
    states: list[WorkerState] = world.sink.messages(WorkerState)
    return states[-1].not_run if states else None


async def test_a_vllm_that_takes_connections_and_never_answers_is_served_around(
    world: World,
) -> None:
    """vLLM hung (SIGSTOPped, a wedged event loop): connections are taken by the kernel and
    nothing answers, so every request the gateway forwarded waited out its read timeout and
    the router, seeing a gateway answer, kept sending more. A listing of vLLM's models that
    times out marks it stalled (requests are refused as not run, ``Serving.upstream_stalled``)
    until a listing is answered; a refused connection does not (the request path sees it).
    The heartbeat says it (``not_run``: the router keeps it out of its view, the planner
    sends it no load) while it lasts."""
    held: list[asyncio.StreamWriter] = []

    async def take_and_say_nothing(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)

    hung = await asyncio.start_server(take_and_say_nothing, "127.0.0.1", 0)
    port = hung.sockets[0].getsockname()[1]
    real = world.agent.vllm
    assert not world.agent.upstream_stalled and _announced(world) is None
    try:
        world.agent.vllm = VllmClient(f"http://127.0.0.1:{port}", timeout_s=0.3, api_key="k")
        assert await world.agent.reconcile_once() == []
        assert world.agent.upstream_stalled
        assert _announced(world) is VllmFailure.vllm_timeout
        await world.agent.vllm.close()
        hung.close()
        await hung.wait_closed()
        for w in held:
            w.close()
        # nothing listens there now: refused, which is not a hang
        world.agent.vllm = VllmClient(f"http://127.0.0.1:{port}", timeout_s=0.3, api_key="k")
        assert await world.agent.reconcile_once() == []
        assert world.agent.upstream_stalled  # still: nothing has answered since
        await world.agent.vllm.close()
        world.agent.vllm = real
        await world.agent.reconcile_once()
        assert not world.agent.upstream_stalled and _announced(world) is None
        world.agent.vllm = VllmClient(f"http://127.0.0.1:{port}", timeout_s=0.3, api_key="k")
        await world.agent.reconcile_once()
        assert not world.agent.upstream_stalled  # refused: the request path says not run
    finally:
        if world.agent.vllm is not real:
            await world.agent.vllm.close()
        world.agent.vllm = real


def _model(folder: Path, arch: TinyLlama = TinyLlama()) -> str:
    """A base model's folder as vLLM would list it: its config.json (the shapes) alone."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(arch.hf_config(arch.vocab_size)))
    return str(folder)


async def test_attack_vllm_restarted_with_another_base_model_gets_no_load_or_request(
    world: World, tmp_path: Path
) -> None:
    """ATTACK: vLLM restarted under the running agent with another base model (other
    shapes). The agent kept the shapes it read at its start and went on loading adapters
    checked against them into the new model, where a wrong shape fails at activation. At
    the first listing that shows the other model it loads nothing (a gateway's load ask
    and a command alike) and refuses requests as not run; a root it cannot read the shapes
    of (a hub id) is another model too; a root with the verified shapes (the same model
    moved) is served, and loads go on."""
    chat, sql = world.records
    verified = _model(Path(world.fake.model))
    world.agent._base_watch = BaseModelWatch(read_model_config(Path(verified) / "config.json"))
    world.agent._base_watch.root = verified
    world.agent._fold(Ask.gateway_load(sql))
    await converge(world.agent)
    assert world.agent.is_hot(sql.lora_name) and not world.agent.wrong_base_model
    assert _announced(world) is None
    loads = world.fake.load_calls
    wide = _model(tmp_path / "wide", TinyLlama(hidden_size=256))
    for other in (wide, "org/other-model", str(tmp_path / "gone")):
        world.fake.model, world.fake.adapters = other, {}  # a restarted vLLM holds none
        assert await world.agent.reconcile_once() == []
        assert world.agent.wrong_base_model, other
        assert _announced(world) is VllmFailure.vllm_wrong_base_model
        world.agent._fold(Ask.gateway_load(chat))
        await converge(world.agent)
        assert world.fake.load_calls == loads  # nothing loaded into the other model
        assert not world.agent.is_hot(chat.lora_name)
    world.fake.model = _model(tmp_path / "moved")  # the verified shapes at another path
    await converge(world.agent)
    assert not world.agent.wrong_base_model and _announced(world) is None
    assert world.agent.is_hot(chat.lora_name)  # the load asked meanwhile goes on


async def test_when_one_agent_loop_fails_run_ends_after_the_others_have(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One of the agent's loops ends by an exception: ``run`` raises it only once the other
    loops have ended (``kernel.tasks.cancel_all``), their clean-up done. They were only
    asked to cancel, and were still pending, free to act, when ``run`` returned."""
    ended: list[str] = []

    async def waits(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.01)
            ended.append(name)

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("registry loop broke")

    monkeypatch.setattr(world.agent, "_tick_loop", lambda: waits("tick"))
    monkeypatch.setattr(world.agent, "_heartbeat_loop", lambda: waits("heartbeat"))
    monkeypatch.setattr(world.agent, "_registry_loop", fails)
    # a canary's warm-up in flight ends with them: it sends vLLM no golden request after
    world.agent._rt.warming["canary@2"] = asyncio.create_task(waits("warm-up"))
    with pytest.raises(RuntimeError, match="registry loop broke"):
        await world.agent.run()
    assert sorted(ended) == ["heartbeat", "tick", "warm-up"]
