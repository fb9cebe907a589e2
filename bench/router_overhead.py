"""Router overhead: added p50 / p99 latency and the router's CPU µs per request, through the
fleet router (loraplane/router/server.py) versus straight to the worker gateway behind it.

Two processes, so the router's CPU is its own (user + system from /proc): a worker gateway
(the real ``workers.gateway.Gateway``) over a worker that holds the adapter hot and whose
"vLLM" answers at once, in the same process (so only the gateway's and the router's own
costs are left), and the real ``Router`` with that worker as its whole fleet, on the loop
``loraplane router run`` uses (``kernel.http_server.run_serving``: uvloop). The client
sends ``--requests`` sequential completions each way per repetition, alternating which goes
first. Goal: <= 0.5 ms added p50. Prints JSON.

    .venv/bin/python -m bench.router_overhead [--requests 2000 --repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loraplane.frontdoor.api_keys import ApiKeys, key_digest
from loraplane.frontdoor.upstream_http import UpstreamPool
from loraplane.kernel.config import LOOPBACK, get_settings
from loraplane.kernel.policy import Policy, RequestBudgets, TenantLimits
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Compatibility
from loraplane.schemas.worker_state import LoadedAdapter, WorkerState
from loraplane.workers.serving import LoadOutcome

KEY, TENANT, BASE, SECRET = "bench-key", "tenant-a", "llama", b"r" * 32
BODY = json.dumps({"model": "sql", "prompt": "hello", "max_tokens": 4}).encode()
ANSWER = json.dumps(
    {
        "id": "x",
        "object": "text_completion",
        "model": "sql",
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
    }
).encode()
RECORD = AdapterRecord(
    adapter_id="sql",
    base_model=BASE,
    version="1",
    rank=8,
    artifact_uri="s3://loraplane-artifacts/sql/",
    sha256="ab" * 32,
    size_bytes=1,
    status=AdapterStatus.active,
    tenant_id=TENANT,
    compatibility=Compatibility(target_modules=["q_proj"], max_lora_rank=64),
)
KEYS = ApiKeys({key_digest(KEY): TENANT})
# the bench measures the proxies, not the tenant limits
BUDGETS = RequestBudgets(
    tenants=TenantLimits(max_concurrent=10_000, tokens_per_minute=10**9, burst_tokens=10**9)
)


class _Answer:
    async def read(self) -> bytes:
        return ANSWER


class InstantWorker:
    """``workers.serving.Serving`` with the adapter hot and a vLLM that answers at once."""

    worker_id, base_model, started, base_served = "w1", BASE, True, "base"
    gateway_url, upstream_stalled, wrong_base_model = "", False, False
    context_tokens: int | None = None  # vLLM's context not known: requests are not fitted

    @property
    def upstream(self) -> InstantWorker:
        return self

    @asynccontextmanager
    async def completion(self, path: str, body: dict[str, Any]) -> AsyncIterator[_Answer]:
        yield _Answer()

    def versions(self, adapter_id: str) -> list[AdapterRecord]:
        return [RECORD] if adapter_id == "sql" else []

    def is_hot(self, name: str) -> bool:
        return True

    def is_on_host(self, name: str) -> bool:
        return False

    def is_warming(self, name: str) -> bool:
        return False

    def request_load(
        self, record: AdapterRecord, *, wait_s: float = 0.0
    ) -> asyncio.Future[LoadOutcome]:
        raise AssertionError("the adapter is hot")

    @contextmanager
    def serving(self, name: str) -> Iterator[None]:
        yield

    def count_request(self, name: str, *, hot: bool) -> None:
        pass

    def observe_ttft(self, name: str, ms: float) -> None:
        pass

    def observe_decode(self, seconds: float, tokens: int) -> None:
        pass

    def metrics_exposition(self) -> bytes:
        return b""


class NoSink:
    def emit(self, topic_suffix: str, key: str, message: Any) -> None:
        pass


async def _serve(role: str, port: int, gateway_port: int) -> None:
    from loraplane.kernel.http_server import start_site
    from loraplane.router.routing import FleetIndex
    from loraplane.router.server import Fleet, Router, serving_versions
    from loraplane.workers.gateway import Gateway

    if role == "gateway":
        app = Gateway(
            InstantWorker(), api_keys=KEYS, budgets=BUDGETS, sink=NoSink(), router_secret=SECRET
        ).app()
    else:
        fleet = Fleet(FleetIndex(Policy(), 3600.0), NoSink(), "router-bench")
        fleet.index.update(
            WorkerState(
                worker_id="w1",
                base_model=BASE,
                ts=datetime.now(UTC),
                gateway_url=f"http://{LOOPBACK}:{gateway_port}",
                gpu_slots_used=1,
                gpu_slots_total=2,
                host_bytes_used=0,
                host_bytes_budget=1,
                max_lora_rank=64,
                adapters=[
                    LoadedAdapter(
                        lora_name=RECORD.lora_name,
                        adapter_id="sql",
                        version="1",
                        tenant_id=TENANT,
                        tier="gpu",
                    )
                ],
            )
        )
        fleet.versions = serving_versions([RECORD])
        app = Router(fleet, api_keys=KEYS, budgets=BUDGETS, secret=SECRET).app()
    await start_site(app, LOOPBACK, port, get_settings().http, name=role)  # LORAPLANE_HTTP__*
    print("ready", flush=True)
    await asyncio.Event().wait()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _run(pool: UpstreamPool, n: int, headers: bytes) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        resp = await pool.request(
            "POST", "/v1/completions", BODY, total_timeout_s=10, headers=headers
        )
        try:
            await resp.read()
            assert resp.status == 200, resp.status
        finally:
            resp.close()
        out.append((time.perf_counter() - t) * 1000)
    return out


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))]


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from loraplane.infra.processes import free_port

    gw_port, rt_port = free_port(), free_port()
    procs = {}
    for role, port in (("gateway", gw_port), ("router", rt_port)):
        procs[role] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.router_overhead",
                "--serve",
                role,
                "--port",
                str(port),
                "--gateway-port",
                str(gw_port),
            ],
            stdout=subprocess.PIPE,
        )
        assert procs[role].stdout is not None and procs[role].stdout.readline() == b"ready\n"
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    direct = UpstreamPool(LOOPBACK, gw_port, connect_timeout_s=2, read_timeout_s=10)
    routed = UpstreamPool(LOOPBACK, rt_port, connect_timeout_s=2, read_timeout_s=10)
    lat: dict[str, list[float]] = {"direct": [], "router": []}
    router_cpu = 0.0
    try:
        await _run(direct, 200, auth)
        await _run(routed, 200, auth)  # warm: connections, caches
        for rep in range(args.repeat):
            for way in ("direct", "router") if rep % 2 == 0 else ("router", "direct"):
                if way == "router":
                    before = _cpu_s(procs["router"].pid)
                    lat[way] += await _run(routed, args.requests, auth)
                    router_cpu += _cpu_s(procs["router"].pid) - before
                else:
                    lat[way] += await _run(direct, args.requests, auth)
    finally:
        direct.close()
        routed.close()
        for p in procs.values():
            p.terminate()
            p.wait(10)
    n = args.requests * args.repeat
    p50 = {k: _pct(v, 0.5) for k, v in lat.items()}
    p99 = {k: _pct(v, 0.99) for k, v in lat.items()}
    added = round(p50["router"] - p50["direct"], 3)
    return {
        "requests_per_way": n,
        "concurrency": 1,
        "direct_p50_ms": round(p50["direct"], 3),
        "router_p50_ms": round(p50["router"], 3),
        "direct_p99_ms": round(p99["direct"], 3),
        "router_p99_ms": round(p99["router"], 3),
        "added_p50_ms": added,
        "added_p99_ms": round(p99["router"] - p99["direct"], 3),
        "latency_ratio_p50": round(p50["router"] / p50["direct"], 2),
        "router_cpu_us_per_request": round(router_cpu / n * 1e6, 1),
        "goal_added_p50_ms": 0.5,
        "passed": added <= 0.5,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--serve", choices=["gateway", "router"])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--gateway-port", type=int, default=0)
    args = parser.parse_args()
    if args.serve == "router":
        from loraplane.kernel.http_server import run_serving

        run_serving(_serve(args.serve, args.port, args.gateway_port))  # as `router run` does
        return
    if args.serve:
        asyncio.run(_serve(args.serve, args.port, args.gateway_port))
        return
    print(json.dumps(asyncio.run(_bench(args)), indent=2))


if __name__ == "__main__":
    main()
