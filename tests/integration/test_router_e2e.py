"""The fleet router on the real stack: Kafka, our own S3 (s3proxy), three real worker processes
(`loraplane worker run`, each beside its own FAKE vLLM) and `loraplane router run` in front.
Registry views are signed as in test_worker_e2e (the router and the workers verify them with
the module's keyring); the router secret is a 0600 file of the shared LORAPLANE_HOME.

Bound stated and asserted: a killed worker is drained within 3 heartbeats + one drain pass
(heartbeat 1 s here: <= 5 s, asserted <= 8 s to leave room for a loaded machine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from loraplane.infra.processes import free_port
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.base import now_utc
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.keyring import save_keyring
from loraplane.schemas.reasons import CommandRule
from loraplane.workers.api_keys import key_digest

from loraplane.kernel import topics
from loraplane.kernel.bus import produce_sync
from loraplane.kernel.config import Settings
from loraplane.kernel.secrets import ensure_secret, secret_key
from loraplane.kernel.topics import topic_name
from loraplane.tiny_model import TINY_BASE_MODEL, build_adapter, build_model
from tests.integration.s3_env import PrivateS3
from tests.integration.test_worker_e2e import (
    KEY_A,
    KEY_B,
    KIT,
    _healthz,
    _up,
    publish,
    wait_for,
    write_registry,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
LORAPLANE = str(ROOT / ".venv/bin/loraplane")
WORKERS = ("w1", "w2", "w3")


@dataclass
class Fleet:
    settings: Settings
    env: dict[str, str]
    tmp: Path
    records: dict[str, AdapterRecord]
    router_url: str = ""
    gateways: dict[str, int] = field(default_factory=dict)
    vllms: dict[str, str] = field(default_factory=dict)
    vllm_keys: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def spawn(self, name: str, args: list[str]) -> None:
        log = (self.tmp / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(args, env=self.env, cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(20)

    def health(self) -> dict[str, Any]:
        try:
            return requests.get(self.router_url + "/healthz", timeout=2).json()
        except requests.RequestException:
            return {}

    def load(self, wid: str, rec: AdapterRecord) -> None:
        now = now_utc()
        produce_sync(self.settings, topic_name(self.settings, "commands"), wid,
                     KIT.keys["planner"].sign_command(CacheCommand(
                         command_id=f"load-{uuid.uuid4().hex[:12]}", worker_id=wid,
                         action=CommandAction.load_gpu, base_model=TINY_BASE_MODEL,
                         tenant_id=rec.tenant_id, adapter_id=rec.adapter_id,
                         version=rec.version, sha256=rec.sha256, lora_name=rec.lora_name,
                         reason=CommandReason(rule=CommandRule.hot_score), issued_at=now,
                         deadline=now + timedelta(minutes=1))))

    def adapters_on(self, wid: str) -> set[str]:
        data = requests.get(self.vllms[wid] + "/v1/models", timeout=5, headers={
            "Authorization": f"Bearer {self.vllm_keys[wid]}"}).json()["data"]
        return {m["id"] for m in data if m.get("parent")}

    def ask(self, adapter: str, key: str = KEY_A) -> requests.Response:
        return requests.post(self.router_url + "/v1/completions", timeout=30,
                             json={"model": adapter, "prompt": "hello", "max_tokens": 4},
                             headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def fleet(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("router")
    prefix = f"lp-router-{uuid.uuid4().hex[:8]}"
    settings = stack.model_copy(update={"topic_prefix": prefix})
    topics.apply(settings)
    s3 = PrivateS3(tmp / "home")
    s3.start()
    f: Fleet | None = None
    try:
        settings = settings.model_copy(update={"s3": s3.settings})
        model_dir = build_model(tmp / "model")
        records = {
            "sql": publish(settings, build_adapter(tmp / "src/sql", seed=21), "sql", "1",
                           "tenant-a", AdapterStatus.active),
            "chat": publish(settings, build_adapter(tmp / "src/chat", seed=22), "chat", "1",
                            "tenant-a", AdapterStatus.active),
            "other": publish(settings, build_adapter(tmp / "src/other", seed=23), "other", "1",
                             "tenant-b", AdapterStatus.active)}
        write_registry(settings, list(records.values()))
        home = tmp / "home"
        home.mkdir(exist_ok=True)
        keys = tmp / "api-keys.json"
        keys.write_text(f'{{"keys": {{"{key_digest(KEY_A)}": "tenant-a", '
                        f'"{key_digest(KEY_B)}": "tenant-b"}}}}')
        save_keyring(KIT.keyring, home / "keyring.yaml")
        secret_key(home / "secrets" / "router-secret")  # the routers' and gateways' one secret
        env = {**os.environ, "LORAPLANE_TOPIC_PREFIX": prefix, "LORAPLANE_HOME": str(home),
               "LORAPLANE_KEYRING_PATH": str(home / "keyring.yaml"),
               "LORAPLANE_S3__ENDPOINT_URL": s3.settings.endpoint_url,
               "LORAPLANE_S3__PORT": str(s3.port),
               "LORAPLANE_API_KEYS_FILE": str(keys), "PYTHONUNBUFFERED": "1"}
        f = Fleet(settings, env, tmp, records)
        for wid in WORKERS:
            port, gw = free_port(), free_port()
            f.vllms[wid], f.gateways[wid] = f"http://127.0.0.1:{port}", gw
            # where `worker run` looks for its vLLM's key (secrets_dir/vllm-PORT.key)
            f.vllm_keys[wid] = ensure_secret(home / "secrets" / f"vllm-{port}.key")
            f.spawn(f"vllm-{wid}", [sys.executable, "-m", "loraplane.workers.fake_vllm",
                                    "--model", str(model_dir), "--port", str(port),
                                    "--api-key-file", str(home / "secrets" / f"vllm-{port}.key")])
            wait_for(lambda u=f.vllms[wid]: _up(u + "/health"), 30, "FAKE vLLM")
            f.spawn(wid, [LORAPLANE, "worker", "run", "--worker-id", wid, "--base-model",
                          TINY_BASE_MODEL, "--vllm-url", f.vllms[wid], "--gateway-port",
                          str(gw), "--host-tier-dir", str(tmp / f"host-{wid}"),
                          "--model-dir", str(model_dir), "--tick-s", "0.2",
                          "--heartbeat-s", "1", "--registry-refresh-s", "1"])
        for wid in WORKERS:
            wait_for(lambda p=f.gateways[wid]: _healthz(p), 90, f"{wid} /healthz")
        rport = free_port()
        f.router_url = f"http://127.0.0.1:{rport}"
        f.spawn("router", [LORAPLANE, "router", "run", "--port", str(rport), "--router-id",
                           "t1", "--heartbeat-s", "1", "--registry-refresh-s", "1"])
        wait_for(lambda: f.health().get("workers") == 3 and f.health().get("adapters") == 3,
                 60, "the router's view of 3 workers and 3 adapters")
        f.load("w2", records["sql"])
        wait_for(lambda: f.health().get("gpu_copies", 0) >= 1, 60, "sql hot on w2, seen")
        yield f
    finally:
        if f is not None:
            for name in list(f.procs):
                f.kill(name)
        s3.stop()


def test_a_hot_adapter_is_served_where_it_is_hot(fleet: Fleet) -> None:
    for _ in range(10):
        resp = fleet.ask("sql")
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-Loraplane-Worker"] == "w2"
        assert resp.headers["X-Loraplane-Route"] == "gpu"
        assert resp.headers["X-Loraplane-Tier"] == "gpu"
    assert fleet.adapters_on("w1") == fleet.adapters_on("w3") == set()  # no cold load


def test_unknown_foreign_and_unauthenticated_requests_are_refused(fleet: Fleet) -> None:
    assert fleet.ask("no-such-adapter").status_code == 404
    assert fleet.ask("other").status_code == 403
    assert fleet.ask("sql", key="wrong").status_code == 401
    direct = requests.post(f"http://127.0.0.1:{fleet.gateways['w2']}/v1/completions",
                           json={"model": "sql", "prompt": "x"}, timeout=10,
                           headers={"X-Loraplane-Tenant": "tenant-a"})
    assert direct.status_code == 401  # a forwarded tenant without the router's signature


def test_the_official_openai_client(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=fleet.router_url + "/v1", api_key=KEY_A, max_retries=0)
    assert {m.id for m in client.models.list()} == {"sql", "chat"}
    done = client.completions.create(model="sql", prompt="hello", max_tokens=4)
    assert done.choices and done.choices[0].text
    assert done.model == "sql"  # the adapter id asked for: never a lora name or a path
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.content and chat.model == "sql"
    chunks = list(client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert not chunks[-1].choices
    assert {c.model for c in chunks} == {"sql"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2)


def test_fleet_status_shows_each_worker_and_the_hot_copy(fleet: Fleet) -> None:
    """``loraplane fleet status --json`` on the real topic: the three live workers, the
    hot copy of sql on w2 (one replica), and the same liveness rule as the router."""
    import json

    out = subprocess.run([LORAPLANE, "fleet", "status", "--json", "--heartbeat-s", "1"],
                         env=fleet.env, capture_output=True, text=True, timeout=60, check=True)
    (base,) = json.loads(out.stdout)["base_models"]
    assert [w["worker_id"] for w in base["workers"]] == list(WORKERS)
    assert all(w["live"] for w in base["workers"]) and base["live_workers"] == 3
    assert base["replicas"] == {fleet.records["sql"].lora_name: 1}
    w2 = next(w for w in base["workers"] if w["worker_id"] == "w2")
    assert w2["gpu_versions"] == 1


def test_a_stopped_worker_is_drained_within_the_bound(fleet: Fleet) -> None:
    fleet.kill("w3")
    start = time.monotonic()
    wait_for(lambda: fleet.health().get("workers") == 2, 15, "w3 drained")
    assert time.monotonic() - start <= 8
    assert fleet.ask("sql").headers["X-Loraplane-Worker"] == "w2"
