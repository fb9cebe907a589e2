"""Three real worker processes (`loraplane worker run`, each beside its own FAKE vLLM) and
`loraplane router run` in front, on the real stack (Kafka, our own S3: an s3proxy). Registry views
are signed as in test_worker_e2e (the router and the workers verify them with its keyring);
the router secret is a 0600 file of the fleet's LORAPLANE_HOME. Shared by test_router_e2e and
test_router_fleet; ``Answer`` / ``ask`` (one request as the client saw it) also by
test_planner_fleet."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from loraplane.frontdoor.api_keys import key_digest
from loraplane.infra.processes import free_port
from loraplane.kernel import kafka, topics
from loraplane.kernel.bus import produce_sync
from loraplane.kernel.config import Settings
from loraplane.kernel.secrets import ensure_secret, secret_key
from loraplane.kernel.topics import topic_name
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.commands import CommandAction
from loraplane.schemas.keyring import save_keyring
from loraplane.tiny_model import TINY_BASE_MODEL, build_adapter, build_model
from tests.integration.s3_env import PrivateS3
from tests.integration.test_worker_e2e import (
    KEY_A,
    KEY_B,
    KIT,
    _healthz,
    _up,
    command_for,
    publish,
    wait_for,
    write_registry,
)

ROOT = Path(__file__).resolve().parents[2]
LORAPLANE = str(ROOT / ".venv/bin/loraplane")
WORKERS = ("w1", "w2", "w3")
Spec = tuple[int, str]  # (adapter build seed, tenant)
E2E_ADAPTERS: dict[str, Spec] = {
    "sql": (21, "tenant-a"),
    "chat": (22, "tenant-a"),
    "other": (23, "tenant-b"),
}


@dataclass(frozen=True)
class Answer:
    """What the client saw for one request through the router (or a gateway)."""

    adapter: str
    status: int  # 0: no reply at all
    worker: str | None
    tier: str | None
    fallback: bool
    retry_after: bool
    at: float  # monotonic time of the answer
    request_id: str | None = None  # the gateway's X-Request-Id (its request_log row's)
    detail: str = ""  # the start of a non-200 answer's body: what a failure report shows

    @property
    def miss(self) -> bool:
        """The adapter was not on the answering worker's GPU: a cold/host load or the base
        model."""
        return self.status == 200 and (
            self.fallback or self.tier in ("cold", "host", "base_fallback")
        )

    @property
    def kind(self) -> str:
        """ok, retryable (429/503 with Retry-After), no reply, or failed STATUS."""
        return (
            "ok"
            if self.status == 200
            else "retryable"
            if self.status in (429, 503) and self.retry_after
            else "no reply"
            if self.status == 0
            else f"failed {self.status}"
        )


def ask(
    url: str, adapter: str, session: requests.Session, *, key: str = KEY_A, max_tokens: int = 2
) -> Answer:
    """One interactive completion; a request that got no reply at all is status 0."""
    try:
        resp = session.post(
            url + "/v1/completions",
            timeout=30,
            headers={"Authorization": f"Bearer {key}", "X-Request-Class": "interactive"},
            json={"model": adapter, "prompt": "hello", "max_tokens": max_tokens},
        )
    except requests.RequestException:
        return Answer(adapter, 0, None, None, False, False, time.monotonic())
    return Answer(
        adapter,
        resp.status_code,
        resp.headers.get("X-Loraplane-Worker"),
        resp.headers.get("X-Loraplane-Tier"),
        resp.headers.get("X-Loraplane-Fallback") == "base",
        "Retry-After" in resp.headers,
        time.monotonic(),
        resp.headers.get("X-Request-Id"),
        "" if resp.status_code == 200 else resp.text[:300],
    )


@dataclass
class Fleet:
    settings: Settings
    env: dict[str, str]
    tmp: Path
    records: dict[str, AdapterRecord]
    router_url: str = ""
    router_metrics_url: str = ""  # its --metrics-port listener (the API port serves none)
    gateways: dict[str, int] = field(default_factory=dict)
    worker_metrics: dict[str, int] = field(default_factory=dict)  # --metrics-port (not gateway)
    vllms: dict[str, str] = field(default_factory=dict)
    vllm_keys: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)

    def spawn(self, name: str, args: list[str]) -> None:
        log = (self.tmp / f"{name}.log").open("ab")
        self.commands[name] = args
        self.procs[name] = subprocess.Popen(
            args,
            env=self.env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tracebacks(self) -> str:
        """Every traceback the fleet's processes logged (what a failed assertion shows)."""
        found = []
        for log in sorted(self.tmp.glob("*.log")):
            text = log.read_text(errors="replace")
            for start in (m.start() for m in re.finditer(r"Traceback \(most recent", text)):
                found.append(f"--- {log.name}:\n{text[max(0, start - 300) : start + 3000]}")
        return "\n".join(found) or "no traceback in the fleet's logs"

    def respawn(self, name: str) -> None:
        """Start ``name`` again with its first command line (as a supervisor would after a
        kill): the same id, ports and home, so it finds what the killed one left."""
        self.spawn(name, self.commands[name])

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

    def load(
        self, wid: str, rec: AdapterRecord, action: CommandAction = CommandAction.load_gpu
    ) -> None:
        produce_sync(
            self.settings,
            topic_name(self.settings, "commands"),
            wid,
            KIT.keys["planner"].sign_command(
                command_for(rec, wid, action, f"load-{uuid.uuid4().hex[:12]}")
            ),
        )

    def adapters_on(self, wid: str) -> set[str]:
        data = requests.get(
            self.vllms[wid] + "/v1/models",
            timeout=5,
            headers={"Authorization": f"Bearer {self.vllm_keys[wid]}"},
        ).json()["data"]
        return {m["id"] for m in data if m.get("parent")}

    def cold_loads(self) -> int:
        """Cold loads attempted so far by the live workers (their
        ``loraplane_cold_loads_total``)."""
        total = 0.0
        for wid, port in self.worker_metrics.items():
            if wid not in self.procs:
                continue
            text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            total += sum(
                s.value
                for f in text_string_to_metric_families(text)
                if f.name == "loraplane_cold_loads"
                for s in f.samples
                if s.name == "loraplane_cold_loads_total"
            )
        return round(total)

    def ask(self, adapter: str, key: str = KEY_A) -> requests.Response:
        return requests.post(
            self.router_url + "/v1/completions",
            timeout=30,
            json={"model": adapter, "prompt": "hello", "max_tokens": 4},
            headers={"Authorization": f"Bearer {key}"},
        )


@contextlib.contextmanager
def running_fleet(
    stack: Settings,
    tmp: Path,
    adapters: dict[str, Spec],
    *,
    gpu_slots: int = 2,
    heartbeat_s: float = 1.0,
    workers: tuple[str, ...] = WORKERS,
    router: bool = True,
) -> Iterator[Fleet]:
    """The fleet with ``adapters`` (all active), ready once the router sees ``workers`` and
    every adapter (without ``router``: once every gateway is up); every process it started
    is SIGKILLed (by group) on the way out. Worker ``w``'s host tier is ``tmp/host-w`` (a
    test may mount something there first)."""
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
            name: publish(
                settings,
                build_adapter(tmp / f"src/{name}", seed=seed),
                name,
                "1",
                tenant,
                AdapterStatus.active,
            )
            for name, (seed, tenant) in adapters.items()
        }
        write_registry(settings, list(records.values()))
        home = tmp / "home"
        home.mkdir(exist_ok=True)
        keys = tmp / "api-keys.json"
        keys.write_text(
            f'{{"keys": {{"{key_digest(KEY_A)}": "tenant-a", "{key_digest(KEY_B)}": "tenant-b"}}}}'
        )
        save_keyring(KIT.keyring, home / "keyring.yaml")
        secret_key(home / "secrets" / "router-secret")  # the routers' and gateways' one secret
        env = {
            **os.environ,
            "LORAPLANE_TOPIC_PREFIX": prefix,
            "LORAPLANE_HOME": str(home),
            "LORAPLANE_KEYRING_PATH": str(home / "keyring.yaml"),
            "LORAPLANE_S3__ENDPOINT_URL": s3.settings.endpoint_url,
            "LORAPLANE_S3__PORT": str(s3.port),
            "LORAPLANE_API_KEYS_FILE": str(keys),
            "PYTHONUNBUFFERED": "1",
            # the Kafka of ``stack`` (the shared one, or a test's private cluster)
            **kafka.credentials_env(settings),
            "LORAPLANE_KAFKA__PORT": str(settings.kafka.port),
            "LORAPLANE_KAFKA__CONTROLLER_PORT": str(settings.kafka.controller_port),
            "LORAPLANE_KAFKA__BROKERS": str(settings.kafka.brokers),
        }
        f = Fleet(settings, env, tmp, records)
        for wid in workers:
            port, gw = free_port(), free_port()
            f.vllms[wid], f.gateways[wid] = f"http://127.0.0.1:{port}", gw
            f.worker_metrics[wid] = free_port()
            # where `worker run` looks for its vLLM's key (secrets_dir/vllm-PORT.key)
            f.vllm_keys[wid] = ensure_secret(home / "secrets" / f"vllm-{port}.key")
            f.spawn(
                f"vllm-{wid}",
                [
                    sys.executable,
                    "-m",
                    "loraplane.testing.fake_vllm",
                    "--model",
                    str(model_dir),
                    "--port",
                    str(port),
                    "--max-loras",
                    str(gpu_slots),
                    "--api-key-file",
                    str(home / "secrets" / f"vllm-{port}.key"),
                ],
            )
            wait_for(lambda u=f.vllms[wid]: _up(u + "/health"), 30, "FAKE vLLM")
            f.spawn(
                wid,
                [
                    LORAPLANE,
                    "worker",
                    "run",
                    "--worker-id",
                    wid,
                    "--base-model",
                    TINY_BASE_MODEL,
                    "--vllm-url",
                    f.vllms[wid],
                    "--gateway-port",
                    str(gw),
                    "--metrics-port",
                    str(f.worker_metrics[wid]),
                    "--host-tier-dir",
                    str(tmp / f"host-{wid}"),
                    "--model-dir",
                    str(model_dir),
                    "--tick-s",
                    "0.2",
                    "--gpu-slots",
                    str(gpu_slots),
                    "--heartbeat-s",
                    f"{heartbeat_s:g}",
                ],
            )
        for wid in workers:
            wait_for(lambda p=f.gateways[wid]: _healthz(p), 90, f"{wid} /healthz")
        if not router:
            yield f
            return
        rport = free_port()
        f.router_url = f"http://127.0.0.1:{rport}"
        mport = free_port()
        f.router_metrics_url = f"http://127.0.0.1:{mport}"
        f.spawn(
            "router",
            [
                LORAPLANE,
                "router",
                "run",
                "--port",
                str(rport),
                "--metrics-port",
                str(mport),
                "--router-id",
                "t1",
                "--heartbeat-s",
                f"{heartbeat_s:g}",
            ],
        )
        wait_for(
            lambda: (
                f.health().get("workers") == len(workers)
                and f.health().get("adapters") == len(adapters)
            ),
            60,
            f"the router's view of {len(workers)} workers and {len(adapters)} adapters",
        )
        yield f
    finally:
        if f is not None:
            for name in list(f.procs):
                f.kill(name)
        s3.stop()
