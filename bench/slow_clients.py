"""Slow clients at the front door: legitimate requests answered, and the latency they add,
while ``--connections`` (10,000) slow connections are held against the router and against
a worker gateway from the same loopback address.

Two processes as ``bench.router_overhead`` runs them (``--serve``): the real
``workers.gateway.Gateway`` over a worker whose vLLM answers at once (on asyncio's loop, as
``loraplane worker run``) and the real ``Router`` with that gateway as its fleet (on uvloop,
as ``loraplane router run``), each within ``settings.http`` (the shipped defaults unless
``LORAPLANE_HTTP__*`` is set, e.g. ``--max-connections``). The attack is
tests/integration/slow_clients.py in its own process: connections that never send a byte,
trickle a head or a body one byte every 3 s, stop halfway through a head, or idle on
keep-alive after one request, each reopened as soon as the server closes it.

For each target, in the same run: ``--requests`` legitimate completions (a new connection
each, one every ``--interval-ms``) with no attack, then the same with the attack held
(every connection opened once); through the router for both targets, and straight to the
gateway too when the gateway is attacked (the router's keep-alive pool to it is in the
path). Printed: the share answered 200, p50 / p99 with and without the attack and the
difference (added), the attacker's counts, and each server's CPU seconds during the attack.
Goal: >= 95% answered and p99 under 1 s added. Prints JSON; edits no file.

    nice .venv/bin/python -m bench.slow_clients [--connections 10000 --requests 300]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.router_overhead import BODY, KEY, _cpu_s, _pct
from loraplane.infra.processes import free_port
from loraplane.kernel.config import LOOPBACK
from tests.integration.slow_clients import slow_clients

HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def _ask(port: int) -> tuple[float | None, float]:
    """One completion on a new connection: seconds to the whole answer (None unless 200),
    and seconds its connect took."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=30)
    connected = started
    try:
        conn.connect()
        connected = time.perf_counter()
        conn.request("POST", "/v1/completions", BODY, HEADERS)
        resp = conn.getresponse()
        resp.read()
        return (time.perf_counter() - started if resp.status == 200 else None, connected - started)
    except OSError:
        return None, connected - started
    finally:
        conn.close()


def _listen_overflows() -> int:
    """The host's count of connections its accept queues could not take (a SYN dropped, the
    client retries after 1 s): every process's, not only the bench's."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split(), values.split(), strict=True))["ListenOverflows"])
    return 0


def _legit(
    ports: dict[str, int], n: int, interval_s: float
) -> dict[str, list[tuple[float | None, float]]]:
    """``n`` requests to each of ``ports`` (by way), interleaved, one every ``interval_s``."""
    out: dict[str, list[tuple[float | None, float]]] = {way: [] for way in ports}
    for _ in range(n):
        for way, port in ports.items():
            started = time.perf_counter()
            out[way].append(_ask(port))
            time.sleep(max(0.0, interval_s - (time.perf_counter() - started)))
    return out


def _summary(
    base: list[tuple[float | None, float]], attacked: list[tuple[float | None, float]]
) -> dict[str, Any]:
    ok_base = [s * 1000 for s, _ in base if s is not None]
    ok = [s * 1000 for s, _ in attacked if s is not None]
    row: dict[str, Any] = {
        "requests": len(attacked),
        "answered_ratio": round(len(ok) / len(attacked), 4),
        "baseline_answered_ratio": round(len(ok_base) / len(base), 4),
    }
    if ok and ok_base:
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            row[f"baseline_{name}_ms"] = round(_pct(ok_base, q), 2)
            row[f"attack_{name}_ms"] = round(_pct(ok, q), 2)
            row[f"added_{name}_ms"] = round(_pct(ok, q) - _pct(ok_base, q), 2)
        row["attack_max_ms"] = round(max(ok), 2)
    row["connects_over_1s"] = sum(c >= 1.0 for _, c in attacked)  # a SYN dropped, retried
    row["passed"] = row["answered_ratio"] >= 0.95 and row.get("added_p99_ms", 1e9) < 1000
    return row


@contextmanager
def _servers(env: dict[str, str]) -> Any:
    gw_port, rt_port = free_port(), free_port()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
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
                stderr=subprocess.DEVNULL,
                env=env,
                cwd=Path(__file__).resolve().parents[1],
            )
            assert procs[role].stdout is not None
            assert procs[role].stdout.readline() == b"ready\n"
        yield {"gateway": gw_port, "router": rt_port}, procs
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(20)


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    if args.max_connections:
        env["LORAPLANE_HTTP__MAX_CONNECTIONS"] = str(args.max_connections)
    interval_s = args.interval_ms / 1000
    out: dict[str, Any] = {
        "connections": args.connections,
        "descriptor_limit": resource.getrlimit(resource.RLIMIT_NOFILE),
        "max_connections": args.max_connections or "default",
        "load_average": os.getloadavg(),
    }
    with _servers(env) as (ports, procs):
        _legit({"router": ports["router"], "gateway": ports["gateway"]}, 50, 0)  # warm
        for target in ("router", "gateway"):
            ways = {"router": ports["router"]}
            if target == "gateway":
                ways["gateway"] = ports["gateway"]
            base = _legit(ways, args.requests, interval_s)
            with slow_clients(ports[target], args.connections) as attack:
                cpu = {role: _cpu_s(p.pid) for role, p in procs.items()}
                overflows = _listen_overflows()
                started = time.monotonic()
                attacked = _legit(ways, args.requests, interval_s)
                took = time.monotonic() - started
                cpu = {
                    role: round((_cpu_s(p.pid) - cpu[role]) / took, 3) for role, p in procs.items()
                }
                overflows = _listen_overflows() - overflows
                counts = dict(attack.counts)
            out[f"attack_on_{target}"] = {
                **{f"legit_via_{way}": _summary(base[way], attacked[way]) for way in ways},
                "attacker": counts,
                "server_cpu_s_per_s": cpu,
                "host_listen_overflows": overflows,
                "load_average": os.getloadavg(),
            }
    out["passed"] = all(
        row["passed"]
        for key, attack in out.items()
        if key.startswith("attack_on_")
        for way, row in attack.items()
        if way.startswith("legit_via_")
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--interval-ms", type=float, default=50)
    parser.add_argument(
        "--max-connections",
        type=int,
        default=0,
        help="the servers' cap (LORAPLANE_HTTP__MAX_CONNECTIONS); 0: default",
    )
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(json.dumps(_bench(args), indent=2))


if __name__ == "__main__":
    main()
