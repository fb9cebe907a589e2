"""Gateway + agent against the FAKE vLLM (testing/fake_vllm.py), with an in-memory host tier.

The host tier here is a test double that copies local adapter folders; the real one
(workers/host_tier.py, S3 + verification) is exercised by the integration test.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import shutil
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from loraplane.artifact.refusal import ArtifactError
from loraplane.frontdoor.api_keys import (
    ApiKeys,
    ApiKeysFile,
    add_key,
    key_digest,
    load_api_keys,
)
from loraplane.frontdoor.forwarded import HOLD_HEADER, NOT_RUN_HEADER
from loraplane.frontdoor.upstream_http import UpstreamResponse
from loraplane.frontdoor.version_choice import canary_bucket
from loraplane.kernel.policy import (
    BatchBudget,
    CanaryBudget,
    InteractiveBudget,
    Policy,
    RequestBudgets,
    TenantLimits,
)
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Compatibility, Release
from loraplane.schemas.base import now_utc
from loraplane.schemas.cache_event import CacheEvent, CacheEventKind
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.schemas.reasons import CommandRule, ForeignChange, VllmErrorCode
from loraplane.schemas.request_log import RequestClass, RequestLog, RequestStatus, Tier
from loraplane.schemas.worker_state import CopyOrigin
from loraplane.testing.fake_vllm import FakeVllm
from loraplane.tiny_model import build_adapter
from loraplane.workers.agent import WorkerAgent, WorkerConfig
from loraplane.workers.applied_commands import (
    FILE_NAME,
    load_applied,
    load_remembered,
    save_applied,
)
from loraplane.workers.gateway import (
    CANARY_WARMING_HEADER,
    FALLBACK_HEADER,
    FALLBACK_PERMANENT_HEADER,
    FALLBACK_REASON_HEADER,
    PERMANENT_STATUS,
    Gateway,
    permanent_message,
)
from loraplane.workers.golden_set import GOLDEN_PROMPTS
from loraplane.workers.host_tier_entry import RESOLVER_COPIES
from loraplane.workers.serving import LoadOutcome, Serving
from loraplane.workers.vllm_client import VllmClient, VllmError, VllmUnguarded

pytestmark = pytest.mark.asyncio(loop_scope="session")
BASE = "tiny-llama"
KEYS = ApiKeys(
    {
        key_digest("key-a"): "tenant-a",
        key_digest("key-b"): "tenant-b",
        key_digest("key-a-here"): "tenant-a",
        key_digest("key-a-elsewhere"): "tenant-a",
    },
    {
        key_digest("key-a-here"): frozenset({"tiny-llama", "big-llama"}),
        key_digest("key-a-elsewhere"): frozenset({"big-llama"}),
    },
)
"""key-a and key-b: any base model; key-a-here: tiny-llama (and another); key-a-elsewhere:
a base model none of tenant-a's adapters here is for."""
AUTH_A = {"Authorization": "Bearer key-a"}


def record(
    adapter: str, version: str, status: AdapterStatus, tenant: str = "tenant-a", canary: float = 0.0
) -> AdapterRecord:
    sha = f"{adapter}{version}".encode().hex().ljust(64, "0")[:64]
    return AdapterRecord(
        adapter_id=adapter,
        base_model=BASE,
        version=version,
        rank=8,
        artifact_uri=f"s3://loraplane-artifacts/{adapter}/{version}/",
        sha256=sha,
        size_bytes=1000,
        status=status,
        tenant_id=tenant,
        compatibility=Compatibility(target_modules=["q_proj", "v_proj"], max_lora_rank=8),
        release=Release(canary_percent=canary),
    )


@dataclass
class Entry:
    lora_name: str
    path: Path
    sha256: str
    size_bytes: int = 1000

    def intact(self) -> bool:
        return True


@dataclass
class FolderHostTier:
    """Test double of workers/host_tier.HostTier: 'fetches' by copying a local folder."""

    root: Path
    sources: dict[str, Path]
    down: bool = False
    gone: set[str] = field(default_factory=set)  # lora names whose manifest the store lost
    gate: threading.Event | None = None  # when set: a fetch waits for it (a slow S3)
    entries_: dict[str, Entry] = field(default_factory=dict)

    def ensure(self, rec: AdapterRecord) -> Path:
        if rec.lora_name in self.entries_:
            return self.entries_[rec.lora_name].path
        if self.gate is not None:
            self.gate.wait(10)
        if self.down:
            raise ArtifactError.single(
                Reason.artifact_store_unavailable, rec.artifact_uri, "connection refused"
            )
        if rec.lora_name in self.gone:
            raise ArtifactError.single(Reason.manifest_missing, "manifest.json")
        dest = self.root / rec.lora_name
        shutil.copytree(self.sources[rec.adapter_id + rec.version], dest)
        self.entries_[rec.lora_name] = Entry(rec.lora_name, dest, rec.sha256)
        return dest

    def remove(self, name: str) -> bool:
        entry = self.entries_.pop(name, None)
        if entry:
            shutil.rmtree(entry.path)
        return entry is not None

    def entries(self) -> list[Entry]:
        return list(self.entries_.values())

    def stop_fetches(self) -> None:
        """A copy has no chunk to stop at: a fetch in flight ends by itself."""


@dataclass
class ListSink:
    events: list[tuple[str, str, Any]] = field(default_factory=list)

    def emit(self, topic_suffix: str, key: str, message: Any) -> None:
        self.events.append((topic_suffix, key, message))

    def messages(self, cls: type) -> list:
        return [m for _, _, m in self.events if isinstance(m, cls)]


RECORDS = [
    record("chat", "1", AdapterStatus.active),
    record("chat", "2", AdapterStatus.canary, canary=30.0),
    record("sql", "1", AdapterStatus.active),
    record("other", "1", AdapterStatus.active, tenant="tenant-b"),
]


@dataclass
class World:
    fake: FakeVllm
    agent: WorkerAgent
    tier: FolderHostTier
    sink: ListSink
    gateway: Gateway
    url: str  # the gateway's port
    http: ClientSession
    metrics_url: str  # the worker's --metrics-port listener (the gateway's port serves none)

    async def post(
        self, body: dict[str, Any], path: str = "/v1/completions", **headers: str
    ) -> tuple[int, dict[str, str], Any]:
        async with self.http.post(
            self.url + path, json=body, headers={**AUTH_A, **headers}
        ) as resp:
            raw = await resp.read()
            data = json.loads(raw) if raw.startswith(b"{") else raw.decode()
            return resp.status, dict(resp.headers), data


@pytest.fixture
async def world(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[World]:
    """A worker agent and its gateway on a fake vLLM; ``indirect`` params are policy fields."""
    sources = {
        r.adapter_id + r.version: build_adapter(tmp_path / "src" / r.lora_name, seed=i)
        for i, r in enumerate(RECORDS)
    }
    fake = FakeVllm(str(tmp_path / "model"), api_key="k-vllm")
    vllm_server = TestServer(fake.app(), host="127.0.0.1")
    await vllm_server.start_server()
    sink = ListSink()
    tier = FolderHostTier(tmp_path / "host", sources)
    agent = WorkerAgent(
        WorkerConfig(
            worker_id="w1",
            base_model=BASE,
            vllm_url=str(vllm_server.make_url("")),
            host_budget_bytes=10**9,
            tick_s=0.05,
            heartbeat_s=0.5,
            registry_poll_s=60,
            load_backoff_s=60,
            cold_loads_per_minute=6,
            policy=Policy(**getattr(request, "param", {})),
        ),
        vllm=VllmClient(str(vllm_server.make_url("")), timeout_s=2, api_key="k-vllm"),
        host_tier=tier,
        registry_loader=lambda: RECORDS,
        sink=sink,
    )
    budgets = RequestBudgets(
        interactive=InteractiveBudget(on_cold="fallback"), batch=BatchBudget(max_wait_ms=3000)
    )
    gateway = Gateway(agent, api_keys=KEYS, budgets=budgets, sink=sink)
    gw_server = TestServer(gateway.app(), host="127.0.0.1")
    await gw_server.start_server()
    metrics_server = TestServer(gateway.metrics_app(), host="127.0.0.1")
    await metrics_server.start_server()
    await agent.start()
    loop = asyncio.create_task(agent.run())
    async with ClientSession() as http:
        yield World(
            fake,
            agent,
            tier,
            sink,
            gateway,
            str(gw_server.make_url("")).rstrip("/"),
            http,
            str(metrics_server.make_url("")).rstrip("/"),
        )
    loop.cancel()
    await agent.vllm.close()
    await metrics_server.close()
    await gw_server.close()
    await vllm_server.close()


def cmd(rec: AdapterRecord, action: CommandAction, cid: str) -> CacheCommand:
    now = now_utc()
    return CacheCommand(
        command_id=cid,
        worker_id="w1",
        action=action,
        base_model=BASE,
        tenant_id=rec.tenant_id,
        adapter_id=rec.adapter_id,
        version=rec.version,
        sha256=rec.sha256,
        lora_name=rec.lora_name,
        reason=CommandReason(rule=CommandRule.hot_score),
        issued_at=now,
        deadline=now + timedelta(minutes=1),
    )


async def converge(agent: WorkerAgent) -> None:
    """A reconcile tick, then the ticks its fetches wake (each a task of its own) until
    none is in flight: what the tick loop reaches once every download has ended."""
    await agent.reconcile_once()
    while agent._rt.fetches:
        await asyncio.gather(*agent._rt.fetches.values())
        await agent.reconcile_once()


async def load(world: World, *records: AdapterRecord) -> None:
    for i, rec in enumerate(records):
        world.agent.apply(cmd(rec, CommandAction.load_gpu, f"load-{rec.lora_name}-{i}"))
    await converge(world.agent)
    assert all(world.agent.is_hot(r.lora_name) for r in records)


def session_for(adapter: str, canary: bool) -> str:
    return next(f"s{i}" for i in range(1000) if (canary_bucket(adapter, f"s{i}") < 30) == canary)


async def test_hot_adapter_is_served_by_its_version(world: World) -> None:
    v1, v2 = RECORDS[0], RECORDS[1]
    await load(world, v1, v2)
    texts = {}
    for canary, rec in ((False, v1), (True, v2)):
        key = session_for("chat", canary)
        for _ in range(2):  # sticky: the same session gets the same version
            status, headers, body = await world.post(
                {"model": "chat", "prompt": "hi"}, **{"X-Session-Key": key}
            )
            assert status == 200, body
            assert headers["X-Loraplane-Lora-Name"] == rec.lora_name
            texts[rec.version] = body["choices"][0]["text"]
    assert texts["1"] != texts["2"]
    logs = world.sink.messages(RequestLog)
    assert {(log.adapter_version, log.tier_at_arrival) for log in logs} == {
        ("1", Tier.gpu),
        ("2", Tier.gpu),
    }
    assert all(log.ttft_ms is not None and log.tenant_id == "tenant-a" for log in logs)


async def test_tenants_paths_and_keys_are_checked(world: World) -> None:
    assert (await world.post({"model": "other", "prompt": "x"}))[0] == 404
    for model in ("/tmp/lp/adapter", "../chat", "s3://loraplane-artifacts/chat/1/", 7):
        status, _, body = await world.post({"model": model, "prompt": "x"})
        assert (status, body["error"]["type"]) == (400, "model_not_adapter_id")
    assert (await world.post({"model": "nope", "prompt": "x"}))[0] == 404
    async with world.http.post(
        world.url + "/v1/completions",
        json={"model": "chat"},
        headers={"Authorization": "Bearer wrong"},
    ) as resp:
        assert resp.status == 401
    assert world.fake.load_calls == 0  # nothing refused ever reached vLLM


async def test_cold_interactive_falls_back_then_loads(world: World) -> None:
    sql = RECORDS[2]
    status, headers, body = await world.post({"model": "sql", "prompt": "q", "max_tokens": 4})
    assert status == 200 and headers[FALLBACK_HEADER] == "base"
    base_text = world.fake.generate("", "q", 4)
    assert body["choices"][0]["text"] == "".join(base_text)
    assert body["model"] == "sql"  # what the client asked for, never the base model's path
    for _ in range(100):
        if world.agent.is_hot(sql.lora_name):
            break
        await asyncio.sleep(0.02)
    status, headers, body = await world.post({"model": "sql", "prompt": "q"})
    assert status == 200 and headers["X-Loraplane-Lora-Name"] == sql.lora_name
    assert body["model"] == "sql"  # not the internal lora name
    tiers = [log.tier_at_arrival for log in world.sink.messages(RequestLog)]
    assert tiers == [Tier.base_fallback, Tier.gpu]


async def test_cold_interactive_retry_later_and_batch_waits(world: World) -> None:
    world.gateway.budgets = RequestBudgets(
        interactive=InteractiveBudget(on_cold="retry_later", retry_after_s=3),
        batch=BatchBudget(max_wait_ms=3000),
    )
    status, headers, _ = await world.post({"model": "sql", "prompt": "q"})
    assert status == 429 and headers["Retry-After"] == "3"
    status, headers, _ = await world.post(
        {"model": "chat", "prompt": "q"},
        **{"X-Request-Class": "batch", "X-Session-Key": session_for("chat", False)},
    )
    assert status == 200 and headers["X-Loraplane-Lora-Name"] == RECORDS[0].lora_name


async def _until_failure_known(world: World, rec: AdapterRecord) -> LoadOutcome:
    for _ in range(200):
        known = world.agent.load_failure(rec.lora_name)
        if known is not None:
            return known
        await asyncio.sleep(0.02)
    raise AssertionError("the agent never learnt of the failed fetch")


async def test_an_artifact_gone_from_the_store_is_told_as_permanent(world: World) -> None:
    """manifest_missing (the object is gone) is no 'adapter is loading': the fallback names
    it as permanent, a request without fallback gets 424 and no Retry-After, and no new
    fetch is tried while the refusal holds."""
    sql = RECORDS[2]
    world.tier.gone.add(sql.lora_name)
    await world.post({"model": "sql", "prompt": "q"})  # starts the fetch that fails
    known = await _until_failure_known(world, sql)
    assert (known.reason, known.permanent) == (Reason.manifest_missing, True)
    status, headers, _ = await world.post({"model": "sql", "prompt": "q"})
    assert status == 200 and headers[FALLBACK_HEADER] == "base"
    assert headers[FALLBACK_REASON_HEADER] == "manifest_missing"
    assert headers[FALLBACK_PERMANENT_HEADER] == "true"
    world.gateway.budgets = world.gateway.budgets.model_copy(
        update={"interactive": InteractiveBudget(on_cold="retry_later")}
    )
    for cls in ("interactive", "batch"):
        status, headers, body = await world.post(
            {"model": "sql", "prompt": "q"}, **{"X-Request-Class": cls}
        )
        assert status == PERMANENT_STATUS, body
        assert "Retry-After" not in headers
        assert body["error"]["type"] == "adapter_unavailable_permanent"
        assert "manifest_missing" in body["error"]["message"]
        assert "until it is re-uploaded or another version" in body["error"]["message"]
    fails = [e for e in world.sink.messages(CacheEvent) if e.reason == Reason.manifest_missing]
    assert len(fails) == 1  # held: the store was asked once, not once per request
    assert world.sink.messages(RequestLog)[-1].status == RequestStatus.error
    world.tier.gone.clear()  # re-uploaded: once the hold ends, the next request loads it
    world.agent._rt.last_failure.clear()
    await world.post({"model": "sql", "prompt": "q"}, **{"X-Request-Class": "batch"})
    assert world.agent.is_hot(sql.lora_name)


async def test_a_workers_own_424_says_how_long_the_worker_holds_it(world: World) -> None:
    """This worker's vLLM refuses to load the version (its --max-lora-rank): the 424
    ``adapter_refused_by_worker`` says, in whole seconds, how long the worker holds that
    refusal (its ``refusal_hold_s`` from the refusal, then what is left of it), which a
    router remembers; an artifact's own refusal, which a router does not remember, says
    none."""
    world.agent.config = replace(world.agent.config, refusal_hold_s=45.0)
    world.fake.max_lora_rank = 4  # the adapters are rank 8
    batch = {"X-Request-Class": "batch", "X-Session-Key": session_for("chat", False)}
    status, headers, body = await world.post({"model": "chat", "prompt": "q"}, **batch)
    assert status == PERMANENT_STATUS, body
    assert body["error"]["type"] == "adapter_refused_by_worker"
    assert headers[HOLD_HEADER] == "45" and "Retry-After" not in headers
    name = RECORDS[0].lora_name
    until = world.agent._rt.last_failure[name][1]
    world.agent._clock = lambda: until - 19.2  # the hold has 19.2 s left
    status, headers, body = await world.post({"model": "chat", "prompt": "q"}, **batch)
    assert (status, headers[HOLD_HEADER]) == (PERMANENT_STATUS, "20"), body
    world.tier.gone.add(RECORDS[2].lora_name)  # the artifact's own refusal
    await world.post({"model": "sql", "prompt": "q"})
    await _until_failure_known(world, RECORDS[2])
    status, headers, body = await world.post({"model": "sql", "prompt": "q"}, **batch)
    assert body["error"]["type"] == "adapter_unavailable_permanent"
    assert status == PERMANENT_STATUS and HOLD_HEADER not in headers


async def test_a_424_names_what_heals_a_refused_artifact_or_a_refused_load() -> None:
    """A re-upload heals a refused artifact, not a load this worker's vLLM refuses (its
    ``--max-lora-rank``): the message says which."""
    sql = RECORDS[2]
    gone = permanent_message(sql, "manifest_missing")
    refused = permanent_message(sql, "vllm_rank_too_large")
    assert "(manifest_missing)" in gone and "until it is re-uploaded" in gone
    assert "(vllm_rank_too_large)" in refused and "re-uploaded" not in refused
    assert "until this worker's model server can load it" in refused
    limits = permanent_message(sql, "rank_too_high")  # past this worker's max_lora_rank
    assert "re-uploaded" not in limits and "a worker whose limits take it" in limits


async def test_a_store_outage_stays_retriable_with_its_reason(world: World) -> None:
    sql = RECORDS[2]
    world.tier.down = True
    await world.post({"model": "sql", "prompt": "q"})
    known = await _until_failure_known(world, sql)
    assert (known.reason, known.permanent) == (Reason.artifact_store_unavailable, False)
    status, headers, _ = await world.post({"model": "sql", "prompt": "q"})
    assert status == 200 and headers[FALLBACK_REASON_HEADER] == "artifact_store_unavailable"
    assert headers[FALLBACK_PERMANENT_HEADER] == "false"
    world.gateway.budgets = world.gateway.budgets.model_copy(
        update={"batch": BatchBudget(max_wait_ms=200)}
    )
    status, headers, body = await world.post(
        {"model": "sql", "prompt": "q"}, **{"X-Request-Class": "batch"}
    )
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert "artifact_store_unavailable" in body["error"]["message"]


async def test_streaming_chat_passes_through(world: World) -> None:
    await load(world, RECORDS[2])
    async with world.http.post(
        world.url + "/v1/chat/completions",
        headers=AUTH_A,
        json={
            "model": "sql",
            "stream": True,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}],
        },
    ) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    chunks = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]" and len(chunks) == 5
    assert {json.loads(c)["model"] for c in chunks[:-1]} == {"sql"}
    log = world.sink.messages(RequestLog)[-1]
    # vLLM's usage record (asked for upstream, not passed on: the client did not ask):
    # 3 tokens, not the 4 SSE events (the role chunk carries none)
    assert log.output_tokens == 3 and log.prompt_tokens == 1 and log.ttft_ms is not None


async def test_s3_down_fails_fast_and_interactive_follows_budget(world: World) -> None:
    world.tier.down = True
    sql = RECORDS[2]
    gate = world.tier.gate = threading.Event()  # the failing fetch waits for the batch ask
    status, headers, _ = await world.post({"model": "sql", "prompt": "q"})
    assert status == 200 and headers[FALLBACK_HEADER] == "base"
    batch = asyncio.create_task(
        world.post({"model": "sql", "prompt": "q"}, **{"X-Request-Class": "batch"})
    )
    await until(
        lambda: len(world.agent._rt.waiters.get(sql.lora_name, [])) == 2,
        "the batch request waiting on the load",
    )
    gate.set()
    status, headers, body = await asyncio.wait_for(batch, 5)
    assert status == 429 and body["error"]["message"].count("artifact_store_unavailable")
    fails = [e for e in world.sink.messages(CacheEvent) if e.kind == CacheEventKind.fail]
    assert fails and fails[0].reason == "artifact_store_unavailable"
    world.tier.down = False  # S3 back: the next command loads
    world.agent._rt.backoff.clear()
    await load(world, RECORDS[2])


async def test_drain_keeps_old_version_until_idle(world: World) -> None:
    v1, v2 = RECORDS[0], RECORDS[1]
    await load(world, v1)
    with world.agent.serving(v1.lora_name):
        world.agent.apply(cmd(v2, CommandAction.load_gpu, "new"))
        world.agent.apply(cmd(v1, CommandAction.demote_to_host, "old"))
        await converge(world.agent)
        assert world.agent.is_hot(v2.lora_name) and world.agent.is_hot(v1.lora_name)
    await world.agent.reconcile_once()
    assert not world.agent.is_hot(v1.lora_name) and world.agent.is_on_host(v1.lora_name)
    # redelivery of the same commands changes nothing
    world.agent.apply(cmd(v1, CommandAction.demote_to_host, "old"))
    assert await world.agent.reconcile_once() == []


async def test_foreign_name_is_a_kv_conflict(world: World, tmp_path: Path) -> None:
    v1 = RECORDS[0]
    folder = build_adapter(tmp_path / "evil", seed=99)
    await world.agent.vllm.load(v1.lora_name, str(folder))  # not by the agent
    await world.agent.reconcile_once()
    assert v1.lora_name not in world.fake.adapters
    conflicts = [
        e for e in world.sink.messages(CacheEvent) if e.kind == CacheEventKind.kv_namespace_conflict
    ]
    assert [e.lora_name for e in conflicts] == [v1.lora_name]
    async with world.http.get(world.metrics_url + "/metrics") as resp:
        text = await resp.text()
    for name in (
        "loraplane_hot_adapter_hit_rate",
        "loraplane_adapter_swap_seconds",
        "loraplane_cold_load_fail_ratio",
        "loraplane_kv_namespace_conflict_total",
    ):
        assert name in text
    assert 'loraplane_kv_namespace_conflict_total{adapter_id="chat",adapter_version="1"' in text
    assert 'loraplane_vllm_foreign_changes_total{reason="unvouched_copy"} 1.0' in text
    (letter,) = world.sink.messages(DeadLetter)
    assert letter.reason == ForeignChange.unvouched_copy and letter.component == "worker-agent"
    assert json.loads(base64.b64decode(letter.raw_b64)) == {
        "lora_name": v1.lora_name,
        "path": str(folder),
        "worker_id": "w1",
    }


async def test_a_copy_unloaded_behind_the_agents_back_is_reported_within_a_tick(
    world: World,
) -> None:
    """vLLM's SageMaker DELETE /adapters/{name} (or a vLLM restart) removes a copy the agent
    loaded: the next tick counts it, dead-letters it with its reason and loads it again."""
    v1 = RECORDS[0]
    await load(world, v1)
    path = world.fake.adapters.pop(v1.lora_name)[0]  # what the route did, not the agent
    await world.agent.reconcile_once()
    (letter,) = world.sink.messages(DeadLetter)
    assert letter.reason == ForeignChange.copy_vanished
    assert json.loads(base64.b64decode(letter.raw_b64))["path"] == path
    async with world.http.get(world.metrics_url + "/metrics") as resp:
        assert 'loraplane_vllm_foreign_changes_total{reason="copy_vanished"} 1.0' in (
            await resp.text()
        )
    assert world.fake.adapters[v1.lora_name][0] == path  # its intent loaded it again
    assert world.agent.is_hot(v1.lora_name)
    await world.agent.reconcile_once()
    assert len(world.sink.messages(DeadLetter)) == 1  # reported once


async def test_the_agent_will_not_drive_an_unguarded_vllm(tmp_path: Path) -> None:
    """A vLLM without the route guard (404 for the probe path without the key, not 401):
    the agent refuses to start, naming the fix."""
    app = web.Application()
    app.router.add_get("/health", lambda _: web.Response())
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    vllm = VllmClient(str(server.make_url("")), timeout_s=2, api_key="k")
    agent = WorkerAgent(
        WorkerConfig(
            worker_id="w1", base_model=BASE, vllm_url=str(server.make_url("")), host_budget_bytes=1
        ),
        vllm=vllm,
        host_tier=FolderHostTier(tmp_path / "host", {}),
        registry_loader=lambda: RECORDS,
        sink=ListSink(),
    )
    try:
        with pytest.raises(VllmUnguarded, match=r"--middleware loraplane\.vllm_plugin"):
            await agent.start()
    finally:
        await vllm.close()
        await server.close()


async def test_a_copy_vllms_resolver_loaded_is_kept_on_the_gpu(world: World) -> None:
    """vLLM's host-tier resolver loaded an entry the agent holds on the host only (a request
    straight to vLLM asked for it): the agent vouches for the copy and keeps it on the GPU,
    neither a conflict nor demoted again; a later demote moves it as usual."""
    rec = RECORDS[0]
    world.agent.apply(cmd(rec, CommandAction.prewarm_host, "warm"))
    await converge(world.agent)
    entry = world.tier.entries_[rec.lora_name].path
    copy = entry.parent.parent / RESOLVER_COPIES / f"{rec.lora_name}.0a1b2c"
    shutil.copytree(entry, copy)
    await world.agent.vllm.load(rec.lora_name, str(copy))  # not by the agent: the resolver
    for _ in range(3):
        await world.agent.reconcile_once()
    assert world.fake.adapters.get(rec.lora_name) is not None
    assert [(a.lora_name, a.tier) for a in world.agent.worker_state().adapters] == [
        (rec.lora_name, "gpu")
    ]
    moved = [
        e
        for e in world.sink.messages(CacheEvent)
        if e.kind in (CacheEventKind.kv_namespace_conflict, CacheEventKind.unload)
    ]
    assert moved == []
    world.agent.apply(cmd(rec, CommandAction.demote_to_host, "demote"))
    await world.agent.reconcile_once()
    assert rec.lora_name not in world.fake.adapters


async def test_the_state_announces_the_commands_partition_its_feed_reads(world: World) -> None:
    assert world.agent.worker_state().command_partition is None  # no feed: the planner hashes
    slotted = WorkerAgent(
        world.agent.config,
        vllm=world.agent.vllm,
        host_tier=world.tier,
        registry_loader=lambda: RECORDS,
        sink=world.sink,
        command_partition=lambda: 9,
    )
    assert slotted.worker_state().command_partition == 9


async def test_restart_adopts_running_state(world: World) -> None:
    await load(world, RECORDS[2])
    again = WorkerAgent(
        world.agent.config,
        vllm=world.agent.vllm,
        host_tier=world.tier,
        registry_loader=lambda: RECORDS,
        sink=world.sink,
        hbm=lambda: 0.42,
    )
    loads_before = world.fake.load_calls
    await again.start()
    assert again.is_hot(RECORDS[2].lora_name)
    assert world.fake.load_calls == loads_before  # adopted, not reloaded
    state = again.worker_state()
    assert [(a.lora_name, a.tier) for a in state.adapters] == [(RECORDS[2].lora_name, "gpu")]
    # what it can hold: HBM from the probe (NVML on a GPU), bytes per copy from the manifest
    assert state.hbm_usage == 0.42
    assert [(a.size_bytes, a.rank) for a in state.adapters] == [
        (RECORDS[2].size_bytes, RECORDS[2].rank)
    ]
    assert RECORDS[2].size_bytes > 0


class GatedVllm(VllmClient):
    """The agent's vLLM client, holding completions for one lora name until ``gate`` is set:
    the test decides when the canary's warm-up may finish."""

    def __init__(self, base_url: str, gated: str, api_key: str) -> None:
        super().__init__(base_url, timeout_s=2, api_key=api_key)
        self.gated = gated
        self.gate = asyncio.Event()
        self.prompts: list[str] = []

    @asynccontextmanager
    async def completion(self, path: str, body: dict[str, Any]) -> AsyncIterator[UpstreamResponse]:
        if body.get("model") == self.gated:
            self.prompts.append(str(body.get("prompt")))
            await self.gate.wait()
        async with super().completion(path, body) as resp:
            yield resp


async def until(check: Any, what: str) -> None:
    for _ in range(250):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def test_canary_is_warmed_up_before_real_traffic(world: World) -> None:
    v1, v2 = RECORDS[0], RECORDS[1]
    await load(world, v1)
    plain = world.agent.vllm
    gated = world.agent.vllm = GatedVllm(plain.base_url, v2.lora_name, api_key="k-vllm")
    await plain.close()
    world.agent.apply(
        cmd(v2, CommandAction.load_gpu, "canary").model_copy(update={"warmup_requests": 3})
    )
    await converge(world.agent)
    assert world.agent.is_hot(v2.lora_name) and world.agent.is_warming(v2.lora_name)
    canary_session = {"X-Session-Key": session_for("chat", True)}
    for request_class in ("interactive", "canary"):  # the stable version serves meanwhile
        status, headers, body = await world.post(
            {"model": "chat", "prompt": "hi"},
            **canary_session,
            **{"X-Request-Class": request_class},
        )
        assert status == 200, body
        assert headers["X-Loraplane-Lora-Name"] == v1.lora_name
        assert headers[CANARY_WARMING_HEADER] == "2"
    gated.gate.set()
    await until(lambda: not world.agent.is_warming(v2.lora_name), "the warm-up")
    status, headers, _ = await world.post({"model": "chat", "prompt": "hi"}, **canary_session)
    assert status == 200 and headers["X-Loraplane-Lora-Name"] == v2.lora_name
    assert CANARY_WARMING_HEADER not in headers
    logs = world.sink.messages(RequestLog)
    shadow = [log for log in logs if log.request_class == RequestClass.shadow]
    assert [(log.lora_name, log.adapter_version, log.status) for log in shadow] == [
        (v2.lora_name, "2", RequestStatus.ok)
    ] * 3
    # the golden set went straight to vLLM first; the tenant's "hi" only after it
    assert gated.prompts == [*GOLDEN_PROMPTS[:3], "hi"]
    served = [log.lora_name for log in logs if log.request_class != RequestClass.shadow]
    assert served == [v1.lora_name, v1.lora_name, v2.lora_name]


async def test_batch_cold_loads_are_bounded_and_retry_after_is_per_class(world: World) -> None:
    world.gateway.budgets = RequestBudgets(
        batch=BatchBudget(max_wait_ms=300, max_concurrent_cold_loads=1, retry_after_s=7),
        canary=CanaryBudget(retry_after_s=9),
    )
    sql, chat = RECORDS[2], RECORDS[0]
    stable = {"X-Session-Key": session_for("chat", False)}
    gate = world.tier.gate = threading.Event()  # sql's fetch hangs until the gate opens
    try:
        first = asyncio.create_task(
            world.post({"model": "sql", "prompt": "q"}, **{"X-Request-Class": "batch"})
        )
        await until(lambda: sql.lora_name in world.agent.desired.intents, "sql's load")
        status, headers, body = await world.post(
            {"model": "chat", "prompt": "q"}, **stable, **{"X-Request-Class": "batch"}
        )
        assert (status, headers["Retry-After"]) == (429, "7")
        assert "batch_cold_loads_busy" in body["error"]["message"]
        assert chat.lora_name not in world.agent.desired.intents  # no second load started
        status, headers, body = await first  # its own load is still queued
        assert (status, headers["Retry-After"]) == (429, "7"), body  # batch's, not interactive's
        status, headers, _ = await world.post(
            {"model": "sql", "prompt": "q"}, **{"X-Request-Class": "canary"}
        )
        assert (status, headers["Retry-After"]) == (429, "9")
        world.gateway.budgets = RequestBudgets(
            batch=BatchBudget(max_wait_ms=5000, max_concurrent_cold_loads=1)
        )
        second = asyncio.create_task(
            world.post({"model": "chat", "prompt": "q"}, **stable, **{"X-Request-Class": "batch"})
        )
        await until(lambda: world.gateway.batch_loads.waiting == 1, "a waiting batch request")
        assert chat.lora_name not in world.agent.desired.intents
    finally:
        gate.set()
    status, headers, body = await second  # the slot freed within its budget: served
    assert status == 200 and headers["X-Loraplane-Lora-Name"] == chat.lora_name, body


async def test_api_key_file_is_reread_when_it_changes(
    world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys" / "api-keys.json"
    with caplog.at_level(logging.WARNING, logger="loraplane.worker"):
        keys = ApiKeysFile.open(path)
    assert "is missing" in caplog.text
    world.gateway.api_keys = keys
    key = add_key(path, "tenant-a")  # no restart
    async with world.http.post(
        world.url + "/v1/completions",
        json={"model": "sql", "prompt": "q"},
        headers={"Authorization": f"Bearer {key}"},
    ) as resp:
        assert resp.status == 200
    other = add_key(path, "tenant-b")
    assert (keys.grant(f"Bearer {key}"), keys.grant(f"Bearer {other}")) == (
        ("tenant-a", None),
        ("tenant-b", None),
    )
    path.write_text("{not json")
    assert keys.grant(f"Bearer {key}") is None  # a bad edit fails closed
    path.write_text(json.dumps({"keys": {}}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loraplane.worker"):
        ApiKeysFile.open(path)
    assert "holds no keys" in caplog.text
    path.write_text("[]")
    with pytest.raises(ValueError):  # a malformed file still stops the start
        ApiKeysFile.open(path)


async def test_redelivered_command_after_restart_changes_nothing(
    world: World, tmp_path: Path
) -> None:
    sql = RECORDS[2]
    path = tmp_path / "host" / FILE_NAME
    config = replace(world.agent.config, applied_commands_path=path)

    def started() -> WorkerAgent:
        return WorkerAgent(
            config,
            vllm=world.agent.vllm,
            host_tier=world.tier,
            registry_loader=lambda: RECORDS,
            sink=world.sink,
        )

    first = started()
    await first.start()
    demote = cmd(sql, CommandAction.demote_to_host, "demote-1")
    await first.handle(cmd(sql, CommandAction.load_gpu, "load-1"))
    await first.handle(demote)
    assert not first.is_hot(sql.lora_name) and first.is_on_host(sql.lora_name)
    assert set(load_applied(path, now_utc())) == {"load-1", "demote-1"}

    again = started()  # a restart: only the file remembers
    await again.start()
    await again.handle(cmd(sql, CommandAction.load_gpu, "load-2"))
    assert again.is_hot(sql.lora_name)
    assert await again.handle(demote) == "duplicate"
    assert again.is_hot(sql.lora_name) and await again.reconcile_once() == []


async def test_a_restart_reports_the_commands_it_applied_as_not_carried_out(
    world: World, tmp_path: Path
) -> None:
    """A command applied before a restart and not carried out by then (waiting for the
    cold-load budget, a fetch) loses its intent with the restart: the applied-commands file
    keeps only ids. The restarted agent reports those ids as not carried out until their
    deadline, so the planner stops expecting a copy that is not coming (it planned a load
    into that slot, which the worker then refused for want of one)."""
    path = tmp_path / "host" / FILE_NAME
    deadline = now_utc() + timedelta(seconds=50)
    save_applied(path, {"load-before": deadline, "gone-by": now_utc() - timedelta(seconds=1)})
    again = WorkerAgent(
        replace(world.agent.config, applied_commands_path=path),
        vllm=world.agent.vllm,
        host_tier=world.tier,
        registry_loader=lambda: RECORDS,
        sink=world.sink,
    )
    await again.start()
    assert again.worker_state().skipped_commands == ["load-before"]
    sql = RECORDS[2]
    assert await again.handle(cmd(sql, CommandAction.load_gpu, "load-before")) == "duplicate"


@pytest.mark.parametrize("world", [{"never_evict_when": ['status == "active"']}], indirect=True)
async def test_a_restart_keeps_the_copies_it_held_protected(world: World, tmp_path: Path) -> None:
    """Every active version is never-evict here and a worker of 2 slots protects 1: the one it
    held protected before a restart stays the one (the applied-commands file keeps it), not
    the first its restart happens to adopt."""
    chat, sql = RECORDS[0], RECORDS[2]
    path = tmp_path / "host" / FILE_NAME
    config = replace(world.agent.config, applied_commands_path=path)
    await load(world, sql, chat)
    assert world.agent.desired.protected == {sql.lora_name}
    save_applied(path, {}, [chat.lora_name])  # as if chat had been the first
    again = WorkerAgent(
        config,
        vllm=world.agent.vllm,
        host_tier=world.tier,
        registry_loader=lambda: RECORDS,
        sink=world.sink,
    )
    await again.start()
    assert again.desired.protected == {chat.lora_name}
    assert load_remembered(path, now_utc()).protected == {chat.lora_name}
    protected = {a.lora_name for a in again.worker_state().adapters if a.protected}
    assert protected == {chat.lora_name}


async def test_a_command_the_worker_will_not_carry_out_is_in_its_heartbeat(world: World) -> None:
    """A refused command (dead-lettered, counted) and a load with no slot it may take are
    listed in the heartbeat's skipped_commands until their deadline: the planner stops
    expecting them at once."""
    _, canary, sql, other = RECORDS
    await load(world, sql, canary)  # the canary is never-evict: protected, 1 of 2 slots
    refused = await world.agent.handle(cmd(canary, CommandAction.demote_to_host, "d-canary"))
    assert refused == "protected"
    no_slot = await world.agent.handle(cmd(other, CommandAction.load_gpu, "l-other"))
    assert no_slot == "min_residency"  # sql was loaded just now
    assert world.agent.worker_state().skipped_commands == ["d-canary", "l-other"]
    assert await world.agent.handle(cmd(other, CommandAction.load_gpu, "l-other")) == "duplicate"
    assert world.agent.worker_state().skipped_commands == ["d-canary", "l-other"]


async def test_a_refused_request_load_is_logged_once_a_burst_with_a_count(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    chat, sql, other = RECORDS[0], RECORDS[2], RECORDS[3]
    await load(world, sql, chat)
    await world.agent.request_load(other)  # fetched first, then refused: min_residency
    with caplog.at_level(logging.INFO, logger="loraplane.worker"):
        outcomes = [await world.agent.request_load(other) for _ in range(50)]
    assert outcomes == [LoadOutcome(False, "min_residency")] * 50
    lines = [r.getMessage() for r in caplog.records if "no GPU slot" in r.getMessage()]
    assert len(lines) == 1 and "min_residency" in lines[0]  # the other 49 count on the next


async def test_applied_ids_file_drops_expired_and_survives_corruption(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    now = now_utc()
    save_applied(path, {"old": now - timedelta(seconds=1), "new": now + timedelta(minutes=1)})
    assert list(load_applied(path, now)) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]  # no temp file left behind
    path.write_text('{"applied": {"x": "not a time"}}')
    assert load_applied(path, now) == {}
    assert load_applied(tmp_path / "absent.json", now) == {}


async def test_a_cold_request_load_shows_as_the_gateways_in_the_worker_state(world: World) -> None:
    sql = RECORDS[2]
    status, headers, _ = await world.post({"model": "sql", "prompt": "q"})
    assert status == 200 and headers[FALLBACK_HEADER] == "base"
    await until(lambda: world.agent.is_hot(sql.lora_name), "the gateway's load")
    (copy,) = world.agent.worker_state().adapters
    assert (copy.lora_name, copy.tier, copy.origin) == (
        sql.lora_name,
        "gpu",
        CopyOrigin.gateway_request,
    )
    world.agent.apply(cmd(sql, CommandAction.pin, "pin-sql"))  # the planner takes it over
    assert world.agent.worker_state().adapters[0].origin is CopyOrigin.planner


@dataclass
class Answer:
    """The part of an upstream response the gateway reads for a non-streaming request."""

    body: bytes

    async def read(self) -> bytes:
        return self.body


@dataclass
class FakeServing:
    """A worker as the gateway sees it (workers.serving.Serving), with no agent behind it:
    ``hot`` names are served at once, others load when asked."""

    hot: set[str] = field(default_factory=set)
    asked: list[str] = field(default_factory=list)
    counted: list[tuple[str, bool]] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    worker_id: str = "w9"
    gateway_url: str = ""
    base_model: str = BASE
    started: bool = True
    base_served: str = "/models/base"
    context_tokens: int | None = None
    upstream_stalled: bool = False
    wrong_base_model: bool = False
    refuses: dict[str, str] = field(default_factory=dict)  # lora name -> a permanent reason
    refusal_hold_s: float = 0.0  # how long a refusal holds, as the agent says (0: not said)

    @property
    def upstream(self) -> FakeServing:
        return self

    @asynccontextmanager
    async def completion(self, path: str, body: dict[str, Any]) -> AsyncIterator[Answer]:
        yield Answer(
            json.dumps({"model": body["model"], "usage": {"completion_tokens": 2}}).encode()
        )

    def versions(self, adapter_id: str) -> list[AdapterRecord]:
        return [r for r in RECORDS if r.adapter_id == adapter_id]

    def is_hot(self, name: str) -> bool:
        return name in self.hot

    def is_on_host(self, name: str) -> bool:
        return False

    def is_warming(self, name: str) -> bool:
        return False

    def load_failure(self, name: str) -> LoadOutcome | None:
        return None

    def request_load(
        self, record: AdapterRecord, *, wait_s: float = 0.0
    ) -> asyncio.Future[LoadOutcome]:
        self.asked.append(record.lora_name)
        fut: asyncio.Future[LoadOutcome] = asyncio.get_running_loop().create_future()
        refused = self.refuses.get(record.lora_name)
        if refused is not None:  # refused for good, as the agent tells a refusal
            fut.set_result(
                LoadOutcome(False, refused, permanent=True, hold_s=self.refusal_hold_s)  # type: ignore[arg-type]
            )
            return fut
        self.hot.add(record.lora_name)
        fut.set_result(LoadOutcome(True))
        return fut

    @contextmanager
    def serving(self, name: str) -> Iterator[None]:
        self.held.append(name)
        yield

    def count_request(self, name: str, *, hot: bool) -> None:
        self.counted.append((name, hot))

    def observe_ttft(self, name: str, ms: float) -> None:
        pass

    def observe_decode(self, seconds: float, tokens: int) -> None:
        pass

    def metrics_exposition(self) -> bytes:
        return b"# nothing\n"


async def test_the_gateway_needs_only_the_serving_interface() -> None:
    worker = FakeServing()
    serving: Serving = worker
    sink = ListSink()
    gateway = Gateway(serving, api_keys=KEYS, budgets=RequestBudgets(), sink=sink)
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    try:
        async with ClientSession() as http:
            url = str(server.make_url("/v1/completions"))
            async with http.post(url, json={"model": "sql", "prompt": "q"}, headers=AUTH_A) as resp:
                assert resp.status == 200
                assert (await resp.json())["model"] == "sql"  # upstream said the lora name
                assert resp.headers["X-Loraplane-Lora-Name"] == RECORDS[2].lora_name
    finally:
        await server.close()
    name = RECORDS[2].lora_name
    assert (worker.asked, worker.counted, worker.held) == ([name], [(name, False)], [name])
    (log,) = sink.messages(RequestLog)
    assert (log.worker_id, log.lora_name, log.output_tokens) == ("w9", name, 2)


@dataclass
class Streamed:
    """A streamed upstream answer: ``events`` SSE events of ``event_bytes`` each, ``gap_s``
    apart, then vLLM's usage chunk (``tokens`` completion tokens)."""

    events: int
    event_bytes: int
    gap_s: float
    tokens: int

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        text = "x" * self.event_bytes
        for _ in range(self.events):
            yield (
                b"data: "
                + json.dumps({"model": "m", "choices": [{"text": text}]}).encode()
                + b"\n\n"
            )
            await asyncio.sleep(self.gap_s)
        yield b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n\n' % self.tokens
        yield b"data: [DONE]\n\n"


@dataclass
class StreamingServing(FakeServing):
    """FakeServing whose upstream streams ``answer`` and which keeps the decode points the
    gateway reports (the load-stall estimate's input)."""

    answer: Streamed = field(default_factory=lambda: Streamed(5, 10, 0.05, 5))
    decoded: list[tuple[float, int]] = field(default_factory=list)

    @asynccontextmanager
    async def completion(
        self,
        path: str,
        body: dict[str, Any],  # type: ignore[override]
    ) -> AsyncIterator[Streamed]:
        yield self.answer

    def observe_decode(self, seconds: float, tokens: int) -> None:
        self.decoded.append((seconds, tokens))


async def _stream_through(worker: StreamingServing, stream: bool, read_after_s: float) -> int:
    """One request through a gateway in front of ``worker``; the client reads the answer only
    ``read_after_s`` after its headers came (a slow reader). The bytes it got."""
    gateway = Gateway(worker, api_keys=KEYS, budgets=RequestBudgets(), sink=ListSink())
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    try:
        async with (
            ClientSession() as http,
            http.post(
                str(server.make_url("/v1/completions")),
                headers=AUTH_A,
                json={"model": "sql", "prompt": "q", "stream": stream},
            ) as resp,
        ):
            assert resp.status == 200
            await asyncio.sleep(read_after_s)
            return len(await resp.read())
    finally:
        await server.close()


async def test_a_streamed_answer_gives_the_stall_estimate_vllms_decode_pace() -> None:
    """The point is the tokens after the first over vLLM's first to last chunk (no prefill:
    the prompt's length is the client's to choose); a non-streamed answer gives none (its
    time is prefill and decode together)."""
    worker = StreamingServing(hot={RECORDS[2].lora_name})
    await _stream_through(worker, stream=True, read_after_s=0.0)
    ((seconds, tokens),) = worker.decoded
    assert tokens == 4 and 0.2 <= seconds < 1.0  # 5 gaps of 50 ms, the usage chunk last
    plain = StreamingServing(hot={RECORDS[2].lora_name})
    plain.completion = FakeServing.completion.__get__(plain)  # type: ignore[method-assign]
    await _stream_through(plain, stream=False, read_after_s=0.0)
    assert plain.decoded == []


async def test_attack_a_slow_reader_cannot_make_loads_look_costly() -> None:
    """A client that stops reading holds the gateway's writes, and through them the upstream
    read: its stream would look slow to the stall estimate (and, timed with the loads a
    tenant can trigger, lower the worker's load budget for every tenant). Its answer is
    still served whole, but gives no point. Before: every request's whole time counted."""
    big = Streamed(events=48, event_bytes=256 * 1024, gap_s=0.0, tokens=48)  # 12 MiB
    worker = StreamingServing(hot={RECORDS[2].lora_name}, answer=big)
    got = await _stream_through(worker, stream=True, read_after_s=1.5)
    assert got > 48 * 256 * 1024 and worker.decoded == []


async def test_attack_a_stream_the_client_leaves_is_charged_what_it_streamed() -> None:
    """vLLM's token counts come in the stream's last chunk. A client that reads the tokens
    it wants and leaves before that chunk was logged and charged 0 output tokens, so the
    tenant's token-rate limit never saw its streams. Each event streamed counts as a token
    then (as for an upstream without usage), and the tenant's bucket is charged them."""
    answer = Streamed(events=400, event_bytes=16 * 1024, gap_s=0.005, tokens=400)
    worker = StreamingServing(hot={RECORDS[2].lora_name}, answer=answer)
    sink = ListSink()
    gateway = Gateway(worker, api_keys=KEYS, budgets=RequestBudgets(), sink=sink)
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    try:
        body = json.dumps({"model": "sql", "prompt": "q", "stream": True}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        got = b""
        while got.count(b"data: ") < 20:
            got += await reader.read(65536)
        writer.close()  # the client leaves mid-stream
        for _ in range(500):
            if sink.messages(RequestLog):
                break
            await asyncio.sleep(0.01)
        (log,) = sink.messages(RequestLog)
        assert 20 <= log.output_tokens < 400
        bucket = gateway.door.gate().buckets["tenant-a"]
        assert bucket.level <= bucket.size - log.output_tokens
    finally:
        await server.close()


@dataclass
class HeldStreaming(StreamingServing):
    """StreamingServing that says whether its upstream answer is still held open (the
    gateway's slot to vLLM and vLLM's request)."""

    open_upstreams: int = 0

    @asynccontextmanager
    async def completion(
        self,
        path: str,
        body: dict[str, Any],  # type: ignore[override]
    ) -> AsyncIterator[Streamed]:
        self.open_upstreams += 1
        try:
            yield self.answer
        finally:
            self.open_upstreams -= 1


async def test_attack_a_client_that_never_reads_frees_the_upstream_and_its_place() -> None:
    """A client that asks for a long stream and reads none of it held the gateway's write,
    and with it the upstream answer (one of the 64 slots to vLLM, and vLLM's request) and the
    tenant's place, for as long as it kept the connection: a few dozen such clients
    starved every tenant of the worker. The send deadline of the bounded server
    (``http.send_timeout_s``) cuts it; the request is logged with what it streamed."""
    from loraplane.kernel.config import HttpLimits
    from loraplane.kernel.http_server import bound_port, start_site

    endless = Streamed(events=100_000, event_bytes=64 * 1024, gap_s=0.0, tokens=100_000)
    worker = HeldStreaming(hot={RECORDS[2].lora_name}, answer=endless)
    sink = ListSink()
    gateway = Gateway(worker, api_keys=KEYS, budgets=RequestBudgets(), sink=sink)
    runner, _ = await start_site(
        gateway.app(), "127.0.0.1", 0, HttpLimits(send_timeout_s=0.3), name="gateway-test"
    )
    body = json.dumps({"model": "sql", "prompt": "q", "stream": True}).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", bound_port(runner), limit=1024)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )  # ... and never reads
        for _ in range(1000):
            if sink.messages(RequestLog):
                break
            await asyncio.sleep(0.01)
        (log,) = sink.messages(RequestLog)
        assert 0 < log.output_tokens < 100_000  # what streamed before the cut
        assert worker.open_upstreams == 0
        assert gateway.door.gate().in_flight == {}
    finally:
        writer.transport.abort()
        await runner.cleanup()


@dataclass
class NoDone(Streamed):
    """An upstream stream that ends without ``data: [DONE]``."""

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        async for chunk in super().iter_chunks():
            if chunk != b"data: [DONE]\n\n":
                yield chunk


@pytest.mark.parametrize("answer", ["stream", "stream without [DONE]", "whole"])
async def test_the_request_log_is_with_the_sink_before_the_answers_last_bytes(
    answer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sink journals a log before ``emit`` returns (loraplane/eventlog/journal.py), so a log
    handed over before the answer's end outlives a kill -9 right after the answer. Before, a
    stream's log was emitted after its end: a worker killed then lost it."""
    from aiohttp import web

    wire: list[tuple[str, bytes]] = []  # what the gateway did, in order
    write, write_eof = web.StreamResponse.write, web.StreamResponse.write_eof

    async def noted_write(self: web.StreamResponse, data: bytes) -> None:
        wire.append(("write", bytes(data)))
        await write(self, data)

    async def noted_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        wire.append(("eof", bytes(data)))
        await write_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", noted_write)
    monkeypatch.setattr(web.StreamResponse, "write_eof", noted_eof)

    class NotingSink(ListSink):
        def emit(self, topic_suffix: str, key: str, message: Any) -> None:
            wire.append(("log", b""))
            super().emit(topic_suffix, key, message)

    streamed = (NoDone if answer == "stream without [DONE]" else Streamed)(3, 10, 0.0, 3)
    worker = StreamingServing(hot={RECORDS[2].lora_name}, answer=streamed)
    if answer == "whole":
        worker.completion = FakeServing.completion.__get__(worker)  # type: ignore[method-assign]
    sink = NotingSink()
    gateway = Gateway(worker, api_keys=KEYS, budgets=RequestBudgets(), sink=sink)
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    try:
        async with (
            ClientSession() as http,
            http.post(
                str(server.make_url("/v1/completions")),
                headers=AUTH_A,
                json={"model": "sql", "prompt": "q", "stream": answer != "whole"},
            ) as resp,
        ):
            got = await resp.read()
    finally:
        await server.close()
    assert resp.status == 200 and len(sink.messages(RequestLog)) == 1
    logged = wire.index(("log", b""))
    last = next(i for i, (what, data) in enumerate(wire) if b"[DONE]" in data or what == "eof")
    assert logged < last, wire
    assert (b"data: [DONE]" in got) == (answer == "stream")
    assert sink.messages(RequestLog)[0].output_tokens == (2 if answer == "whole" else 3)


# ---- ATTACK tests: what a client's body may make vLLM do (frontdoor/request_fields.py) --------
AUTH_B = {"Authorization": "Bearer key-b"}


def forwarded(world: World) -> dict[str, Any]:
    """The last body vLLM got."""
    return world.fake.requests[-1]


async def test_costly_asks_are_refused_by_the_class_caps(world: World) -> None:
    await load(world, RECORDS[2])
    cases = [
        ({"n": 2048}, "too_many_choices", "n"),
        ({"best_of": 64}, "too_many_choices", "best_of"),
        ({"max_tokens": 100_000}, "max_tokens_too_large", "max_tokens"),
        ({"prompt": ["p"] * 1000}, "too_many_prompts", "prompt"),
        ({"logprobs": 20}, "logprobs_too_large", "logprobs"),
        ({"stop": ["a"] * 10}, "too_many_stop", "stop"),
        ({"n": "2"}, "bad_field", "n"),
        ({"max_tokens": True}, "bad_field", "max_tokens"),
    ]
    sent = len(world.fake.requests)
    for extra, code, param in cases:
        status, _, body = await world.post({"model": "sql", "prompt": "q", **extra})
        assert (status, body["error"]["type"], body["error"]["param"]) == (400, code, param)
    assert len(world.fake.requests) == sent  # none reached vLLM
    # batch has its own, larger caps (policy request_budgets.batch.caps)
    status, _, _ = await world.post(
        {"model": "sql", "prompt": "q", "max_tokens": 200}, **{"X-Request-Class": "batch"}
    )
    assert status == 200
    # no max_tokens: the class default is set, so the output is bounded anyway
    assert (await world.post({"model": "sql", "prompt": "q"}))[0] == 200
    assert forwarded(world)["max_tokens"] == RequestBudgets().interactive.caps.default_max_tokens
    status, _, body = await world.post({"model": "sql", "prompt": "q" * 2_000_000})
    assert status == 413 and body["error"]["type"] == "body_too_large"


async def test_max_tokens_past_the_models_context(world: World) -> None:
    """The base model's context (vLLM's ``max_model_len``, 256 here) bounds a choice's
    tokens: a ``max_tokens`` past it, within the class's cap, is the client's 400 naming
    the context (vLLM refuses it: it was the adapter's 502); a class default past it is
    lowered to it, so a request without ``max_tokens`` is served (vLLM then leaves room
    for the prompt)."""
    await load(world, RECORDS[2])
    default = RequestBudgets().batch.caps.default_max_tokens
    assert default > world.fake.max_model_len  # the tiny model's case
    sent = len(world.fake.requests)
    for field_name in ("max_tokens", "max_completion_tokens"):
        path = "/v1/completions" if field_name == "max_tokens" else "/v1/chat/completions"
        body: dict[str, Any] = {"model": "sql", field_name: 4096}
        body.update(
            prompt="q" if field_name == "max_tokens" else None,
            messages=None if field_name == "max_tokens" else [{"role": "user", "content": "q"}],
        )
        body = {k: v for k, v in body.items() if v is not None}
        status, _, answer = await world.post(body, path, **{"X-Request-Class": "batch"})
        assert (status, answer["error"]["type"], answer["error"]["param"]) == (
            400,
            "max_tokens_too_large",
            field_name,
        ), answer
        assert "context" in answer["error"]["message"]
    assert len(world.fake.requests) == sent  # none reached vLLM
    logs = world.sink.messages(RequestLog)[-2:]
    assert [(m.status, m.error) for m in logs] == [("refused", "max_tokens_too_large")] * 2
    batch = {"X-Request-Class": "batch"}
    assert (await world.post({"model": "sql", "prompt": "q"}, **batch))[0] == 200
    assert forwarded(world)["max_tokens"] == world.fake.max_model_len


async def test_attack_a_small_max_tokens_beside_the_bound_vllm_reads(world: World) -> None:
    """ATTACK: on chat vLLM bounds the output by ``max_completion_tokens`` when it is given
    and ignores ``max_tokens``; the gateway took the smaller of the two, so ``max_tokens: 1``
    beside a ``max_completion_tokens`` past the model's context passed its context check and
    reached vLLM (vLLM's 400 as a ``vllm_bad_request``, generation up to the larger bound
    otherwise). The gateway reads the bound vLLM reads: refused naming that field, and a
    ``max_completion_tokens`` within the context is what is sent, however large
    ``max_tokens`` is beside it."""
    await load(world, RECORDS[2])
    batch = {"X-Request-Class": "batch"}  # caps.max_tokens 4096, the context 256
    chat = {"model": "sql", "messages": [{"role": "user", "content": "q"}]}
    sent = len(world.fake.requests)
    status, _, answer = await world.post(
        {**chat, "max_tokens": 1, "max_completion_tokens": 4096}, "/v1/chat/completions", **batch
    )
    assert (status, answer["error"]["type"], answer["error"]["param"]) == (
        400,
        "max_tokens_too_large",
        "max_completion_tokens",
    ), answer
    assert len(world.fake.requests) == sent  # never reached vLLM
    log = world.sink.messages(RequestLog)[-1]
    assert (log.status, log.error) == ("refused", "max_tokens_too_large")
    status, _, answer = await world.post(
        {**chat, "max_tokens": 4096, "max_completion_tokens": 3}, "/v1/chat/completions", **batch
    )
    assert status == 200, answer
    assert forwarded(world)["max_completion_tokens"] == 3
    assert answer["usage"]["completion_tokens"] <= 3


async def test_smuggled_fields_never_reach_vllm(world: World) -> None:
    await load(world, RECORDS[2])
    for name, value in (
        ("priority", -100),
        ("kv_transfer_params", {"do_remote_prefill": True}),
        ("vllm_xargs", {"a": 1}),
        ("ignore_eos", True),
        ("guided_json", {"type": "object"}),
        ("chat_template", "{{x}}"),
        ("lora_request", {"lora_path": "/etc"}),
    ):
        status, _, body = await world.post({"model": "sql", "prompt": "q", name: value})
        assert (status, body["error"]["type"], body["error"]["param"]) == (
            400,
            "field_not_allowed",
            name,
        ), name
    # dropped without an error: the gateway's own to set
    status, _, _ = await world.post(
        {
            "model": "sql",
            "prompt": "q",
            "request_id": "victim-1",
            "user": "u",
            "cache_salt": "forged",
        }
    )
    assert status == 200
    sent = forwarded(world)
    assert "request_id" not in sent and "user" not in sent
    assert sent["cache_salt"] == world.gateway.cache_salt("tenant-a") != "forged"
    # chat: only text parts (no URL for vLLM to fetch), only role/content/name
    for message in (
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}],
        },
        {"role": "user", "content": "x", "tool_calls": []},
    ):
        status, _, body = await world.post(
            {"model": "sql", "messages": [message]}, path="/v1/chat/completions"
        )
        assert (status, body["error"]["type"]) == (400, "field_not_allowed")


async def test_cache_salt_keeps_tenants_apart_on_the_adapter_and_fallback_paths(
    world: World,
) -> None:
    prompt = "the same long shared system prompt of many words here"
    # both cold: both served by the BASE model (the path where blocks were shared)
    status_a, headers_a, body_a = await world.post({"model": "sql", "prompt": prompt})
    salt_a = forwarded(world)["cache_salt"]
    async with world.http.post(
        world.url + "/v1/completions",
        headers=AUTH_B,
        json={"model": "other", "prompt": prompt, "cache_salt": salt_a},
    ) as resp:  # B forges A's salt
        assert resp.status == 200 and resp.headers[FALLBACK_HEADER] == "base"
        body_b = await resp.json()
    salt_b = forwarded(world)["cache_salt"]
    assert headers_a[FALLBACK_HEADER] == "base" and status_a == 200
    assert salt_a != salt_b and salt_b == world.gateway.cache_salt("tenant-b")
    assert body_b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # none of A's blocks
    assert body_a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, _, _ = await world.post(
        {"model": "sql", "prompt": prompt}, **{"X-Request-Class": "batch"}
    )  # A again (now on its adapter): its own salt
    assert status == 200 and forwarded(world)["cache_salt"] == salt_a
    assert forwarded(world)["model"] == RECORDS[2].lora_name


async def test_tenant_limits_answer_429_with_retry_after(world: World) -> None:
    await load(world, RECORDS[2])
    world.gateway.budgets = RequestBudgets(tenants=TenantLimits(max_concurrent=1))
    world.fake.token_delay_s = 0.05
    slow = asyncio.create_task(world.post({"model": "sql", "prompt": "q", "max_tokens": 8}))
    await until(lambda: world.fake.running[RECORDS[2].lora_name] == 1, "the first in flight")
    status, headers, body = await world.post({"model": "sql", "prompt": "q"})
    assert (status, body["error"]["type"], headers["Retry-After"]) == (
        429,
        "tenant_concurrency",
        "1",
    )
    assert (await slow)[0] == 200
    world.fake.token_delay_s = 0
    world.gateway.budgets = RequestBudgets(
        tenants=TenantLimits(tokens_per_minute=60, burst_tokens=5)
    )
    assert (await world.post({"model": "sql", "prompt": "q", "max_tokens": 20}))[0] == 200
    status, headers, body = await world.post({"model": "sql", "prompt": "q"})
    assert (status, body["error"]["type"]) == (429, "tenant_token_rate")
    assert int(headers["Retry-After"]) >= 10  # 16 tokens over at 1 token/s
    logs = world.sink.messages(RequestLog)
    assert [log.error for log in logs[-4:]] == [
        "tenant_concurrency",
        None,
        None,
        "tenant_token_rate",
    ]


async def test_stream_usage_comes_from_vllm_and_reaches_the_client_only_if_asked(
    world: World,
) -> None:
    await load(world, RECORDS[2])
    for asked in (False, True):
        body = {"model": "sql", "prompt": "a b", "stream": True, "max_tokens": 3}
        if asked:
            body["stream_options"] = {"include_usage": True}
        async with world.http.post(
            world.url + "/v1/completions", headers=AUTH_A, json=body
        ) as resp:
            raw = (await resp.read()).decode()
        assert forwarded(world)["stream_options"] == {"include_usage": True}
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        usage = [e for e in events if e.get("usage")]
        assert len(usage) == (1 if asked else 0)
        log = world.sink.messages(RequestLog)[-1]
        assert (log.prompt_tokens, log.output_tokens, log.prompts) == (2, 3, 1)


@dataclass
class OddUsage(FakeServing):
    """An upstream whose usage counts are ``tokens`` (JSON), whole or streamed."""

    tokens: bytes = b"{}"
    stream: bool = False

    @asynccontextmanager
    async def completion(
        self,
        path: str,
        body: dict[str, Any],  # type: ignore[override]
    ) -> AsyncIterator[Any]:
        if self.stream:
            yield OddStream(1, 8, 0.0, 1, self.tokens)
        else:
            yield Answer(b'{"model": "m", "usage": ' + self.tokens + b"}")


@dataclass
class OddStream(Streamed):
    usage: bytes = b"{}"

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        yield b'data: {"model": "m", "choices": [{"text": "x"}]}\n\n'
        yield b'data: {"choices": [], "usage": ' + self.usage + b"}\n\n"
        yield b"data: [DONE]\n\n"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "count",
    [b"1e400", b"-1e400", b"-5", b"3.7", b"true", b'"12x"', b"null", b"[1]", b"[" * 50_000],
    ids=lambda count: count[:12].decode(),
)
async def test_an_upstreams_odd_token_count_never_fails_the_answer(
    stream: bool, count: bytes
) -> None:
    """vLLM's usage is the upstream's word: a count that is no count (``1e400`` parses as
    infinity, and ``int`` of it raised OverflowError; JSON nested past Python's recursion
    limit raised RecursionError: a 500 for an answer that was served, and no log) is read
    as none, and the answer and its one log go out."""
    tokens = b'{"prompt_tokens": %s, "completion_tokens": %s}' % (count, count)
    serving = OddUsage(hot={RECORDS[2].lora_name}, tokens=tokens, stream=stream)
    sink = ListSink()
    gateway = Gateway(serving, api_keys=KEYS, budgets=RequestBudgets(), sink=sink)
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    try:
        async with (
            ClientSession() as http,
            http.post(
                str(server.make_url("/v1/completions")),
                headers=AUTH_A,
                json={"model": "sql", "prompt": "q", "stream": stream},
            ) as resp,
        ):
            assert resp.status == 200
            await resp.read()
        (log,) = sink.messages(RequestLog)
        assert 0 <= log.output_tokens <= 10_000_000 and 0 <= log.prompt_tokens <= 10_000_000
    finally:
        await server.close()


async def test_one_request_log_per_request_counts_its_prompts(world: World) -> None:
    await load(world, RECORDS[2])
    before = len(world.sink.messages(RequestLog))
    status, _, _ = await world.post({"model": "sql", "prompt": ["a", "b", "c"]})
    assert status == 200
    logs = world.sink.messages(RequestLog)[before:]
    assert len(logs) == 1 and logs[0].prompts == 3


async def test_hostile_json_is_a_400_never_a_crash(world: World) -> None:
    for raw in (
        b"[" * 200_000 + b"]" * 200_000,
        b'{"model": "sql", "n": 1' + b"0" * 5000 + b"}",
        b'{"model": "sql", "prompt": "q", "temperature": NaN}',
        b"\xff\xfe",
        b'{"model": "sql", "prompt": "q", "' + b"k" * 10_000 + b'": 1}',
    ):
        async with world.http.post(world.url + "/v1/completions", data=raw, headers=AUTH_A) as resp:
            body = await resp.json()
            assert resp.status == 400, body
            assert body["error"]["type"] in ("invalid_json", "bad_field", "field_not_allowed")
            assert len(body["error"]["param"] or "") <= 64


@pytest.mark.parametrize("world", [{"min_residency_s": 0.0}], indirect=True)
async def test_a_cold_request_past_the_slots_takes_the_least_recently_used_slot(
    world: World,
) -> None:
    chat, sql, other = RECORDS[0], RECORDS[2], RECORDS[3]
    await load(world, sql, chat)  # 2 slots, both taken
    status, _, _ = await world.post({"model": "sql", "prompt": "q"})
    assert status == 200  # sql used since: chat is the least recently used
    status, headers, _ = await world.post(
        {"model": "other", "prompt": "q"}, Authorization="Bearer key-b"
    )
    assert status == 200 and headers[FALLBACK_HEADER] == "base"  # cold: falls back, loads
    for _ in range(100):
        if world.agent.is_hot(other.lora_name):
            break
        await asyncio.sleep(0.02)
    state = world.agent.worker_state()
    tiers = {a.lora_name: a.tier for a in state.adapters}
    assert tiers == {sql.lora_name: "gpu", other.lora_name: "gpu", chat.lora_name: "host"}
    assert state.gpu_slots_used == state.gpu_slots_total == 2
    unloads = [e for e in world.sink.messages(CacheEvent) if e.kind == CacheEventKind.unload]
    assert [(e.lora_name, e.reason, e.command_id) for e in unloads] == [
        (chat.lora_name, "slot_needed", None)
    ]
    # both slots busy: a third version is refused at once, nothing is unloaded
    with world.agent.serving(sql.lora_name), world.agent.serving(other.lora_name):
        outcome = await world.agent.request_load(chat)
        assert outcome == LoadOutcome(False, "no_free_slot")
        await world.agent.reconcile_once()
        assert world.agent.is_hot(sql.lora_name) and world.agent.is_hot(other.lora_name)


async def test_a_request_takes_no_slot_of_a_copy_loaded_within_the_minimum_residency(
    world: World,
) -> None:
    """min_residency_s (180 s by default): a cold version's request does not push out a copy
    loaded since; it gets its cold answer with reason min_residency and nothing unloads. The
    heartbeat carries each GPU copy's loaded_at, which the planner respects too."""
    chat, sql, other = RECORDS[0], RECORDS[2], RECORDS[3]
    await load(world, sql, chat)  # 2 slots, both taken just now
    loaded = {a.lora_name: a.loaded_at for a in world.agent.worker_state().adapters}
    assert loaded[sql.lora_name] is not None and loaded[chat.lora_name] is not None
    outcome = await world.agent.request_load(other)  # its bytes are fetched first
    assert outcome == LoadOutcome(False, "min_residency") and world.agent.is_on_host(
        other.lora_name
    )
    assert await world.agent.request_load(other) == LoadOutcome(False, "min_residency")
    await world.agent.reconcile_once()
    assert world.agent.is_hot(sql.lora_name) and world.agent.is_hot(chat.lora_name)
    assert not [e for e in world.sink.messages(CacheEvent) if e.kind == CacheEventKind.unload]


@pytest.mark.parametrize(
    "world", [{"demand_admission_tau_s": 600.0, "min_residency_s": 0.0}], indirect=True
)
async def test_with_demand_admission_a_one_off_request_does_not_push_a_busier_copy_out(
    world: World,
) -> None:
    """demand_admission_tau_s on, and a cold-load budget of 3 a minute of which the two
    loads below leave one, its reserve: an interactive request of a cold version takes a slot
    only once its version has had as many (priority-weighted) requests here as the least
    demanded copy; until then it falls back (the first while its bytes are fetched to the
    host tier, the next with reason busier_copies) and nothing is unloaded."""
    chat, sql, other = RECORDS[0], RECORDS[2], RECORDS[3]
    world.agent.config = replace(world.agent.config, cold_loads_per_minute=3)
    await load(world, sql, chat)
    stable = session_for("chat", canary=False)  # chat's active version, not its canary
    for model in ("chat", "sql") * 3:  # three requests each
        status, headers, _ = await world.post(
            {"model": model, "prompt": "q"}, **{"X-Session-Key": stable}
        )
        assert status == 200 and FALLBACK_HEADER not in headers
    reasons = []
    for _ in range(2):
        status, headers, _ = await world.post(
            {"model": "other", "prompt": "q"}, Authorization="Bearer key-b"
        )
        assert status == 200 and headers[FALLBACK_HEADER] == "base"
        reasons.append(headers[FALLBACK_REASON_HEADER])
        for _ in range(100):  # the first one fetches its bytes to the host tier first
            await world.agent.reconcile_once()
            if world.agent.is_on_host(other.lora_name):
                break
            await asyncio.sleep(0.02)
        assert world.agent.is_hot(chat.lora_name) and world.agent.is_hot(sql.lora_name)
    assert reasons == ["load_queued", "busier_copies"]
    assert not [e for e in world.sink.messages(CacheEvent) if e.kind == CacheEventKind.unload]
    # a third request: as many as chat, the least recently used, so it takes chat's slot
    await world.post({"model": "other", "prompt": "q"}, Authorization="Bearer key-b")
    for _ in range(100):
        if world.agent.is_hot(other.lora_name):
            break
        await asyncio.sleep(0.02)
    tiers = {a.lora_name: a.tier for a in world.agent.worker_state().adapters}
    assert tiers == {sql.lora_name: "gpu", other.lora_name: "gpu", chat.lora_name: "host"}


@pytest.mark.parametrize("world", [{"demand_admission_tau_s": 600.0}], indirect=True)
async def test_refused_requests_count_for_no_version_in_demand_admission(world: World) -> None:
    """Attack: only a request the gateway routes to a version counts towards it. A tenant
    naming another tenant's adapter or none that exists (404 both) adds to no count, so it
    can neither keep someone else's copy hot nor make room for its own."""
    chat, other = RECORDS[0], RECORDS[3]
    await load(world, chat)
    demand = world.agent._demand
    assert demand is not None
    for _ in range(20):
        assert (await world.post({"model": "chat", "prompt": "q"}, Authorization="Bearer key-b"))[
            0
        ] == 404
        assert (
            await world.post(
                {"model": "no-such-adapter", "prompt": "q"}, Authorization="Bearer key-b"
            )
        )[0] == 404
    assert len(demand._counts) == 0  # chat's copy is no busier for it
    await world.post({"model": "other", "prompt": "q"}, Authorization="Bearer key-b")
    assert list(demand._counts) == [other.lora_name]


@pytest.mark.parametrize("world", [{"load_stall_share": 0.02}], indirect=True)
async def test_a_worker_whose_loads_stall_its_batch_lowers_its_own_load_budget(
    world: World,
) -> None:
    """load_stall_share 0.02: loads may take 2% of decode time. Here a load takes 2 s and
    requests beside it decode at half the rate of the others (stall 0.5), so a load costs
    1 s of decode: one load a minute. The worker enforces it (the next load waits for the
    budget: busy_retry) and reports it, with what it measured, in its heartbeat."""
    chat, sql = RECORDS[0], RECORDS[2]
    agent = world.agent
    clock = [1000.0]
    agent._clock = lambda: clock[0]
    real_load = agent.vllm.load

    async def slow_load(name: str, path: str) -> float:
        clock[0] += 2.0  # the load runs 2 s on this worker
        return await real_load(name, path)

    agent.vllm.load = slow_load  # type: ignore[method-assign]
    assert agent.cold_load_budget() == 6  # nothing measured yet: the policy's
    await load(world, sql)  # ran over [1000, 1002]
    for _ in range(30):  # requests that ran beside it, at half the rate
        agent.observe_decode(2.0, 20)
    clock[0] += 10.0
    for _ in range(30):  # requests with no load beside them
        agent.observe_decode(2.0, 40)
    assert agent.cold_load_budget() == 1
    state = agent.worker_state()
    assert state.cold_load_budget == 1 and state.load_seconds == pytest.approx(2.0)
    assert state.load_stall == pytest.approx(0.5)
    outcome = await agent.request_load(chat)  # the minute's one load is spent
    assert outcome == LoadOutcome(False, "busy_retry", pytest.approx(48.0))
    assert not agent.is_hot(chat.lora_name)


async def test_a_cold_version_whose_artifact_is_gone_pushes_no_hot_copy_out(world: World) -> None:
    """On a full worker a cold version is fetched first; a copy gives its slot up only once
    the bytes are verified, so a version the store lost never costs a hot copy its slot (the
    real-vLLM prefix-cache test found a hot adapter demoted for a load that then failed)."""
    chat, sql, other = RECORDS[0], RECORDS[2], RECORDS[3]
    await load(world, sql, chat)  # 2 slots, both taken
    world.tier.gone.add(other.lora_name)
    for _ in range(3):
        status, headers, _ = await world.post(
            {"model": "other", "prompt": "q"}, Authorization="Bearer key-b"
        )
        assert status == 200 and headers[FALLBACK_HEADER] == "base"
        await world.agent.reconcile_once()
    assert world.agent.is_hot(sql.lora_name) and world.agent.is_hot(chat.lora_name)
    assert not [e for e in world.sink.messages(CacheEvent) if e.kind == CacheEventKind.unload]


async def test_a_batch_request_waits_for_the_cold_load_budget_that_frees_within_its_wait(
    world: World,
) -> None:
    """One load a minute, spent: the agent answers busy_retry at once, with the seconds until
    the budget frees. A batch request (3 s wait) whose budget frees in 0.3 s waits for it and
    is served by its adapter, not sent a 429; one whose budget frees only in a minute gets the
    429 with that Retry-After; an interactive request never waits for it (base model)."""
    chat, sql = RECORDS[0], RECORDS[2]
    agent = world.agent
    agent.config = replace(agent.config, cold_loads_per_minute=1)
    began, offset = time.monotonic(), [1000.0]
    agent._clock = lambda: offset[0] + time.monotonic() - began
    await load(world, sql)  # the minute's one load
    offset[0] += 59.7  # it frees in about 0.3 s
    stable = {"X-Session-Key": session_for("chat", False)}
    status, headers, body = await world.post(
        {"model": "chat", "prompt": "q"}, **stable, **{"X-Request-Class": "batch"}
    )
    assert status == 200 and headers["X-Loraplane-Lora-Name"] == chat.lora_name, body
    status, headers, body = await world.post(
        {"model": "other", "prompt": "q"},
        Authorization="Bearer key-b",
        **{"X-Request-Class": "batch"},
    )
    assert status == 429 and 55 <= int(headers["Retry-After"]) <= 60, body
    assert "busy_retry" in body["error"]["message"]
    status, headers, _ = await world.post(
        {"model": "other", "prompt": "q"}, Authorization="Bearer key-b"
    )
    assert status == 200 and headers["X-Loraplane-Fallback"] == "base"


@pytest.mark.parametrize(
    "world", [{"demand_admission_tau_s": 600.0, "min_residency_s": 0.0}], indirect=True
)
async def test_demand_admission_lets_a_load_in_while_the_budget_has_room_and_batch_always(
    world: World,
) -> None:
    """The budget (6 a minute) has room: a one-off interactive request of a cold version is
    let in, and the copy that gives its slot is the least demanded here (sql: one request),
    not the least recently used (chat: three, the last one earlier). With the budget tight
    (3 a minute, 2 spent: only the reserve left) an interactive request of sql, less
    demanded than both copies, is refused (busier_copies) but a batch one is let in: it has
    no other answer, and waits for the budget within its wait."""
    chat, sql, other = RECORDS[0], RECORDS[2], RECORDS[3]
    agent = world.agent
    await load(world, sql, chat)
    stable = {"X-Session-Key": session_for("chat", canary=False)}
    for _ in range(3):
        await world.post({"model": "chat", "prompt": "q"}, **stable)
    await world.post({"model": "sql", "prompt": "q"})
    agent._rt.touched[chat.lora_name] -= 100  # chat the least recently used
    agent._rt.touched[other.lora_name] = 0.0
    outcome = await _loaded(world, other)
    assert outcome.ok
    tiers = {a.lora_name: a.tier for a in agent.worker_state().adapters}
    assert tiers[chat.lora_name] == "gpu" and tiers[sql.lora_name] == "host"

    for _ in range(3):  # other as busy as chat: both busier than sql
        await world.post({"model": "other", "prompt": "q"}, Authorization="Bearer key-b")
    agent.config = replace(agent.config, cold_loads_per_minute=3)
    agent._rt.cold_loads = agent._rt.cold_loads[-2:]  # 2 spent: 1 left, the reserve
    assert (await _loaded(world, sql)).reason == "busier_copies"
    outcome = await _loaded(world, sql, wait_s=3.0)
    assert outcome.ok


async def _loaded(world: World, record: AdapterRecord, wait_s: float = 0.0) -> LoadOutcome:
    """A request's load of ``record`` (its bytes fetched first when it has none here)."""
    for _ in range(100):
        outcome = (
            await world.agent.request_load(record, wait_s=wait_s)
            if world.agent.is_on_host(record.lora_name)
            else None
        )
        if outcome is not None:
            return outcome
        world.agent.request_load(record, wait_s=wait_s)
        await world.agent.reconcile_once()
        await asyncio.sleep(0.02)
    raise AssertionError(f"{record.lora_name} never reached the host tier")


@dataclass
class FailingUpstream(FakeServing):
    """An upstream that fails every completion with ``error``, as vLLM or the pool would."""

    error: VllmError = field(default_factory=lambda: VllmError(VllmErrorCode.server_error, ""))

    @asynccontextmanager
    async def completion(
        self,
        path: str,
        body: dict[str, Any],  # type: ignore[override]
    ) -> AsyncIterator[Any]:
        raise self.error
        yield


_INTERNAL = "/srv/models/base-7b"
_FAILURES = [
    VllmError(VllmErrorCode.server_error, f"EngineCore at {_INTERNAL} died: Traceback ...", 500),
    VllmError(
        VllmErrorCode.unreachable, "POST /v1/completions: 127.0.0.1:18000: connection refused"
    ),
    VllmError(VllmErrorCode.timeout, "POST /v1/completions: connect to 127.0.0.1:18000 took"),
    VllmError(
        VllmErrorCode.bad_request,
        f"This model's maximum context length is 256 tokens (model `{RECORDS[2].lora_name}`, "
        f"base `{_INTERNAL}`)",
        400,
    ),
    VllmError(VllmErrorCode.not_found, f"The model `{RECORDS[2].lora_name}` does not exist.", 404),
]


async def _complete_once(serving: Any) -> tuple[int, Mapping[str, str], str, ListSink]:
    """One completion for ``sql`` through a gateway over ``serving``: the answer's status,
    headers and text, and what the gateway logged."""
    sink = ListSink()
    gateway = Gateway(serving, api_keys=KEYS, budgets=RequestBudgets(), sink=sink)
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    try:
        async with (
            ClientSession() as http,
            http.post(
                str(server.make_url("/v1/completions")),
                headers=AUTH_A,
                json={"model": "sql", "prompt": "q"},
            ) as resp,
        ):
            return resp.status, resp.headers.copy(), await resp.text(), sink
    finally:
        await server.close()


@pytest.mark.parametrize("error", _FAILURES, ids=lambda e: e.reason.value)
async def test_attack_a_vllm_failure_tells_the_client_nothing_internal(
    error: VllmError, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's failure reaches the client as its reason and, for vLLM's refusal of the
    request (400), vLLM's words with the adapter id for every internal name: never the
    lora name, the base model's path, vLLM's address or its traceback (they were the
    answer's message). The whole detail is the gateway's log line."""
    serving = FailingUpstream(hot={RECORDS[2].lora_name}, base_served=_INTERNAL, error=error)
    status, _, text, sink = await _complete_once(serving)
    refused = error.reason == VllmErrorCode.bad_request
    assert status in ((400,) if refused else (502, 503)), text
    assert json.loads(text)["error"]["type"] in (error.reason.failure, "adapter_unavailable")
    for secret in (RECORDS[2].lora_name, _INTERNAL, "127.0.0.1", "Traceback", "EngineCore"):
        assert secret not in text, text
    if refused:
        assert "maximum context length is 256 tokens" in text and "`sql`" in text
    assert any(error.message in r.getMessage() for r in caplog.records)
    # vLLM's refusal of the request is the client's, not an error of the adapter (its error
    # rate, a canary's gate): the log says refused
    (logged,) = sink.messages(RequestLog)
    assert (logged.status, logged.error) == (
        RequestStatus.refused if refused else RequestStatus.error,
        error.reason.failure,
    )


async def test_attack_a_request_id_names_no_request_log_event_id() -> None:
    """ATTACK: the ClickHouse row of a request log is kept by its event id, the last row of
    an id winning, and event ids shared the gateway's prefix and counter with the request
    ids it answers clients that send none: one answer named the ids of the logs around it,
    so a writer of the requests topic could replace those rows. Request ids and event ids
    share nothing now."""
    sink = ListSink()
    gateway = Gateway(
        FakeServing(hot={RECORDS[2].lora_name}), api_keys=KEYS, budgets=RequestBudgets(), sink=sink
    )
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    answered = []
    try:
        async with ClientSession() as http:
            for _ in range(3):
                async with http.post(
                    str(server.make_url("/v1/completions")),
                    headers=AUTH_A,
                    json={"model": "sql", "prompt": "q"},
                ) as resp:
                    assert resp.status == 200
                    answered.append(resp.headers["X-Request-Id"])
    finally:
        await server.close()
    logged = sink.messages(RequestLog)
    assert [log.request_id for log in logged] == answered
    request_prefixes = {rid.rsplit("-", 1)[0] for rid in answered}
    event_prefixes = {log.event_id.rsplit("-", 1)[0] for log in logged}
    assert len(request_prefixes) == len(event_prefixes) == 1
    assert not request_prefixes & event_prefixes
    assert all(len(p) == 32 for p in event_prefixes)  # 128 random bits
    assert len({log.event_id for log in logged}) == 3


async def test_a_vllm_that_is_not_there_is_a_retryable_503_saying_nothing_ran() -> None:
    """No connection to vLLM could be made (killed, restarting): the request never reached
    it, so the answer is a 503 with ``Retry-After`` and the not-run header a router reroutes
    on, and the one log names the failure."""
    error = VllmError(
        VllmErrorCode.unreachable,
        "POST /v1/completions: 127.0.0.1:18000: connection refused",
        unsent=True,
    )
    status, headers, text, sink = await _complete_once(
        FailingUpstream(hot={RECORDS[2].lora_name}, error=error)
    )
    body = json.loads(text)
    assert status == 503 and headers["Retry-After"] == "1"
    assert headers[NOT_RUN_HEADER] == "vllm_unreachable"
    assert body["error"]["type"] == "vllm_unreachable"
    assert "127.0.0.1" not in body["error"]["message"]
    (log,) = sink.messages(RequestLog)
    assert (log.status, log.error) == ("error", "vllm_unreachable")


async def test_a_hung_vllm_is_a_retryable_503_saying_nothing_ran_without_asking_it() -> None:
    """The agent found vLLM hung (it took the connection and answered nothing in time): the
    request is not sent to wait out the read timeout but answered at once as never run, with
    the not-run header a router reroutes on."""
    serving = FailingUpstream(hot={RECORDS[2].lora_name}, upstream_stalled=True)
    status, headers, text, sink = await _complete_once(serving)
    assert status == 503 and headers["Retry-After"] == "1", text
    assert headers[NOT_RUN_HEADER] == "vllm_timeout"
    assert json.loads(text)["error"]["type"] == "vllm_timeout"
    assert serving.held == []  # vLLM was never asked
    (log,) = sink.messages(RequestLog)
    assert (log.status, log.error) == ("error", "vllm_timeout")


async def test_a_hung_vllm_is_answered_before_a_cold_adapter_waits_for_a_load() -> None:
    """A request for an adapter not on the GPU asked the agent for a load and waited out its
    class's cold wait before it reached the stalled check; it is refused first, and no load
    is asked of a vLLM that answers nothing."""
    serving = FailingUpstream(upstream_stalled=True)  # nothing hot: sql is cold
    status, headers, text, _ = await _complete_once(serving)
    assert status == 503 and headers[NOT_RUN_HEADER] == "vllm_timeout", text
    assert serving.asked == [] and serving.counted == []


async def test_a_vllm_serving_another_base_model_gets_no_request() -> None:
    """The agent found vLLM serving another base model than the one adapters are checked
    against: a hot adapter's request and a cold one's are answered at once as never run
    (``vllm_wrong_base_model``, the not-run header a router reroutes on), no load is asked,
    vLLM is never asked, and /healthz says why."""
    hot = FailingUpstream(hot={RECORDS[2].lora_name}, wrong_base_model=True)
    status, headers, text, sink = await _complete_once(hot)
    assert status == 503 and headers["Retry-After"] == "1", text
    assert headers[NOT_RUN_HEADER] == "vllm_wrong_base_model"
    assert hot.held == []
    (log,) = sink.messages(RequestLog)
    assert (log.status, log.error) == ("error", "vllm_wrong_base_model")
    cold = FailingUpstream(wrong_base_model=True)
    status, headers, text, _ = await _complete_once(cold)
    assert status == 503 and headers[NOT_RUN_HEADER] == "vllm_wrong_base_model", text
    assert cold.asked == [] and cold.counted == []
    server = TestServer(
        Gateway(cold, api_keys=KEYS, budgets=RequestBudgets(), sink=ListSink()).app(),
        host="127.0.0.1",
    )
    await server.start_server()
    try:
        async with ClientSession() as http, http.get(server.make_url("/healthz")) as resp:
            assert (await resp.json())["not_run"] == "vllm_wrong_base_model"
    finally:
        await server.close()


async def test_attack_a_busy_vllm_is_not_answered_as_gone() -> None:
    """No place in flight to vLLM within the request's time (the pool's wait, also a request
    never sent) means vLLM is busy, not gone: no not-run header, which would make a router
    park a working worker and pile its requests on the others."""
    error = VllmError(
        VllmErrorCode.timeout, "no place in flight to 127.0.0.1:18000 within 300s", unsent=True
    )
    status, headers, text, _ = await _complete_once(
        FailingUpstream(hot={RECORDS[2].lora_name}, error=error)
    )
    assert NOT_RUN_HEADER not in headers, text
    assert status != 503 and json.loads(text)["error"]["type"] == "vllm_timeout"


@dataclass
class CutStream(Streamed):
    """A stream vLLM ends mid-answer: ``events`` events, then the connection to it is lost
    (the client's ``UpstreamResponse`` raises it as vLLM's error)."""

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        for _ in range(self.events):
            yield b'data: {"model": "m", "choices": [{"text": "x"}]}\n\n'
        raise VllmError(VllmErrorCode.unreachable, "POST /v1/completions: 127.0.0.1:1: reset")


async def test_a_stream_vllm_cuts_reaches_the_client_cut() -> None:
    """vLLM lost after the 200 went out: the client's stream ends without its last event
    and the connection is cut, never an error head written into the stream's body (the
    gateway answered a second response after the first was sent), and its one log says
    the error and counts what streamed."""
    worker = StreamingServing(hot={RECORDS[2].lora_name}, answer=CutStream(3, 1, 0.0, 3))
    sink = ListSink()
    gateway = Gateway(worker, api_keys=KEYS, budgets=RequestBudgets(), sink=sink)
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    try:
        body = json.dumps({"model": "sql", "prompt": "q", "stream": True}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        got = await asyncio.wait_for(reader.read(), 10)  # until the server closes
        writer.close()
    finally:
        await server.close()
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), got[:200]
    assert b"HTTP/1.1" not in rest and b"[DONE]" not in rest and b"0\r\n\r\n" not in rest, rest
    assert rest.count(b"data: {") == 3
    (log,) = sink.messages(RequestLog)
    assert (log.status, log.error, log.output_tokens) == ("error", "vllm_unreachable", 3)


def test_a_key_file_scopes_a_key_to_base_models(tmp_path: Path) -> None:
    """A key's entry is its tenant, or its tenant and the base models it may use; anything
    else (no tenant, an empty or non-id list, an unknown field) makes the file invalid."""
    path = tmp_path / "api-keys.json"
    key = add_key(path, "tenant-a", base_models=["tiny-llama"])
    plain = add_key(path, "tenant-b")
    keys = load_api_keys(path)
    assert keys.grant(f"Bearer {key}") == ("tenant-a", frozenset({"tiny-llama"}))
    assert keys.grant(f"Bearer {plain}") == ("tenant-b", None)  # every base model
    assert keys.grant("Bearer nope") is None
    digest = "a" * 64
    for entry in (
        {"tenant": "t"} | {"base_models": []},
        {"tenant": "t", "base_models": ["../x"]},
        {"tenant": "t", "base_models": "tiny-llama"},
        {"base_models": ["tiny-llama"]},
        {"tenant": "t", "base_models": ["b"], "admin": True},
    ):
        path.write_text(json.dumps({"keys": {digest: entry}}))
        with pytest.raises(ValueError):
            load_api_keys(path)


def test_attack_a_key_file_edit_between_reads_never_drops_a_keys_scope(tmp_path: Path) -> None:
    """ATTACK (a race an operator's edit opens): the door took a key's tenant and its scope
    in two reads of the key file, so an edit between them (the key removed, or the file left
    invalid) gave the tenant of the old file and no scope, "every base model", from the new
    one. Both now come from one read: a scoped key stays scoped, whatever the file does."""
    from loraplane.frontdoor.admission import FrontDoor, Head, Identity
    from loraplane.frontdoor.api_keys import ApiKeys, ApiKeysFile

    path = tmp_path / "api-keys.json"
    key = add_key(path, "tenant-a", base_models=["tiny-llama"])
    scoped = load_api_keys(path)

    class Edited(ApiKeysFile):
        """Each read after the first finds the file emptied (an edit in progress)."""

        reads = 0

        def current(self) -> ApiKeys:
            self.reads += 1
            return scoped if self.reads == 1 else ApiKeys({})

    keys = Edited(path)
    door = FrontDoor(
        keys=keys,
        budgets=RequestBudgets(),
        versions=lambda _a: [],
        clock=time.monotonic,
    )
    identity = door.identify(Head(request_id="r", authorization=f"Bearer {key}"))
    assert isinstance(identity, Identity), identity
    assert (identity.tenant_id, identity.base_models) == ("tenant-a", frozenset({"tiny-llama"}))
    assert keys.reads == 1


@dataclass
class ClientServing(FakeServing):
    """FakeServing whose upstream is the real vLLM client (``workers.vllm_client``) to
    ``url``: the lean pool, its errors and its stream, as the worker runs them."""

    url: str = ""
    client: VllmClient | None = None

    @property
    def upstream(self) -> VllmClient:  # type: ignore[override]
        if self.client is None:
            self.client = VllmClient(
                self.url, timeout_s=2.0, completion_timeout_s=10.0, api_key="vllm-key"
            )
        return self.client


async def _ask_raw(port: int, body: dict[str, Any]) -> bytes:
    """One request on a raw connection; every byte of the answer until the server closes."""
    raw = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
        b"Connection: close\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(raw) + raw
    )
    try:
        return await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_vllms_refusal_of_a_prompt_is_the_clients_400_streamed_or_not(stream: bool) -> None:
    """vLLM checks a prompt's token ids as its engine takes the prompt: for a stream, after
    its 200, as the stream's one event (``data: {"error": ...}``, then ``[DONE]``). The
    gateway passed that on as a 200 stream holding vLLM's own words, logged ``ok``; it is
    the client's 400 ``vllm_bad_request``, as the same refusal unstreamed is, logged
    refused. (The FAKE vLLM answers as vLLM 0.32 does; the real one: test_worker_e2e.)"""
    from loraplane.testing.fake_vllm import FakeVllm

    fake = FakeVllm(model="/models/base", api_key="vllm-key")
    fake.adapters[RECORDS[2].lora_name] = ("/srv/host/sql", "d")
    upstream = TestServer(fake.app(), host="127.0.0.1")
    await upstream.start_server()
    worker = ClientServing(hot={RECORDS[2].lora_name}, url=str(upstream.make_url("")))
    sink = ListSink()
    gateway = Gateway(worker, api_keys=KEYS, budgets=RequestBudgets(), sink=sink)
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    try:
        body = {"model": "sql", "prompt": [10, 99_999], "max_tokens": 2, "stream": stream}
        answer = await _ask_raw(server.port, body)
    finally:
        await server.close()
        await upstream.close()
        if worker.client is not None:
            await worker.client.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer
    error = json.loads(rest)["error"]
    assert (error["type"], error["code"]) == ("vllm_bad_request", 400), error
    assert "Token id 99999 is out of vocabulary" in error["message"]
    (logged,) = sink.messages(RequestLog)
    assert (logged.status, logged.error) == (RequestStatus.refused, "vllm_bad_request")


_MID_STREAM = [
    b'data: {"model": "m", "choices": [{"text": "x"}]}\n\n',  # then the connection is lost
    b'data: {"model": "m", "choices": [{"text": "x"}]}\n\n'
    b'data: {"error": {"message": "EngineCore at /srv/models/base-7b died", "type": '
    b'"InternalServerError", "param": null, "code": 500}}\n\ndata: [DONE]\n\n',
]


@pytest.mark.parametrize("after", _MID_STREAM, ids=["lost", "error-event"])
async def test_attack_vllm_failing_mid_stream_through_the_real_client_cuts_it(
    after: bytes,
) -> None:
    """vLLM fails after a stream's 200, through the worker's real client: its connection
    lost (the pool's own error), or its failure written as an event (vLLM's words, with its
    internal names). The client's stream is cut after what streamed: never a second answer
    head inside the body, never vLLM's words, never a clean end; the log says the error."""
    sse = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )

    async def vllm(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(sse + b"%x\r\n%s\r\n" % (len(after), after))
        await writer.drain()
        if b"[DONE]" in after:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    raw_vllm = await asyncio.start_server(vllm, "127.0.0.1", 0)
    port = raw_vllm.sockets[0].getsockname()[1]
    worker = ClientServing(hot={RECORDS[2].lora_name}, url=f"http://127.0.0.1:{port}")
    sink = ListSink()
    gateway = Gateway(worker, api_keys=KEYS, budgets=RequestBudgets(), sink=sink)
    server = TestServer(gateway.app(), host="127.0.0.1")
    await server.start_server()
    try:
        answer = await _ask_raw(server.port, {"model": "sql", "prompt": "q", "stream": True})
    finally:
        await server.close()
        raw_vllm.close()
        if worker.client is not None:
            await worker.client.close()
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert answer.count(b"HTTP/1.1") == 1, answer  # no second head in the body
    assert b'"text": "x"' in answer
    for leaked in (b"EngineCore", b"/srv/models", b"[DONE]", b"\r\n0\r\n\r\n"):
        assert leaked not in answer, answer
    (logged,) = sink.messages(RequestLog)
    assert logged.status == RequestStatus.error
