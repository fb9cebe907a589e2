"""Burst -> load_gpu latency of the planner on the real broker and Faust worker.

20 times: a burst of 5 request logs for a cold (registered, never requested) adapter; the
latency is from just before the burst's first log is produced to the moment the ``load_gpu``
command for it is read back from the commands topic (so it includes both Kafka hops, the
scoring agent, the planner tick and delivery). Prints JSON with p50/p99/max in ms.

Needs the local stack (``loraplane stack up``). Run from the repo root:
``.venv/bin/python -m bench.planner_burst_latency``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from loraplane.kernel import kafka
from loraplane.kernel.config import get_settings
from loraplane.schemas.codec import decode
from loraplane.schemas.commands import CacheCommand, CommandAction
from tests.integration.planner_env import PlannerEnv

BURSTS = 20
REQUESTS_PER_BURST = 5


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    home = Path(tempfile.mkdtemp(prefix="planner-bench-"))
    # A budget above the burst count: this measures latency, not the cold-load budget.
    env = PlannerEnv.create(
        get_settings(), home, cold_loads_per_minute_per_worker=100, command_deadline_s=600
    )
    base = f"bench-{uuid.uuid4().hex[:6]}"
    consumer = kafka.consumer(
        env.settings, f"bench-{uuid.uuid4().hex}", offset_reset=kafka.OffsetReset.latest
    )
    try:
        env.start()
        recs = [env.publish(f"burst{i:02d}-{uuid.uuid4().hex[:6]}", base) for i in range(BURSTS)]
        env.wait_registered(*((r, "active") for r in recs))
        env.heartbeat("bench-worker", base, slots=64)
        consumer.subscribe([env.topic("commands")])
        while not consumer.assignment():
            consumer.poll(0.2)
        latencies_ms: list[float] = []
        for rec in recs:
            start = time.monotonic()
            env.requests(rec, REQUESTS_PER_BURST)
            while time.monotonic() - start < 30:
                msg = consumer.poll(0.05)
                if msg is None or msg.error():
                    continue
                cmd = decode(CacheCommand, msg.value())
                if cmd.action is CommandAction.load_gpu and cmd.lora_name == rec.lora_name:
                    latencies_ms.append((time.monotonic() - start) * 1000)
                    break
            time.sleep(0.5)
        print(
            json.dumps(
                {
                    "bursts": BURSTS,
                    "answered": len(latencies_ms),
                    "requests_per_burst": REQUESTS_PER_BURST,
                    "p50_ms": round(statistics.median(latencies_ms), 1),
                    "p99_ms": round(_percentile(latencies_ms, 0.99), 1),
                    "max_ms": round(max(latencies_ms), 1),
                    "within_2s": sum(v <= 2000 for v in latencies_ms),
                }
            )
        )
        return 0 if len(latencies_ms) == BURSTS else 1
    finally:
        consumer.close()
        env.stop()
        env.delete_topics()


if __name__ == "__main__":
    sys.exit(main())
