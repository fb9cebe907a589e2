"""`bench.router_overhead` runs end to end on a tiny size: its router and gateway (real
processes on loopback, no stack) answer every request 200, and it prints its JSON. The
bench's stand-in worker must keep up with what the gateway asks of a worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_router_overhead_bench_runs_and_prints_both_ways() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.router_overhead", "--requests", "20", "--repeat", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["requests_per_way"] == 20
    assert out["direct_p50_ms"] > 0 and out["router_p50_ms"] > 0
    assert {"added_p50_ms", "latency_ratio_p50", "router_cpu_us_per_request"} <= set(out)
