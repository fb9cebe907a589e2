"""Routing decision time (router/routing.py) at fleet scale: 1,000 workers x 10,000 resident
copies by default. Prints JSON: µs per decision (p50 / p99 / mean) for each path — a GPU copy,
a host copy, a new copy (the planner's free-slot worker) — and the cost of one heartbeat
(``FleetIndex.update``) and of the first decision after it (the free-slot order is rebuilt).
Goal: ≤ 50 µs per decision.

    .venv/bin/python -m bench.router_decision [--workers 1000 --copies 10000]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from datetime import UTC, datetime

from loraplane.kernel.policy import Policy
from loraplane.router.routing import FleetIndex
from loraplane.schemas.adapter import AdapterRecord, Compatibility
from loraplane.schemas.worker_state import LoadedAdapter, WorkerState

BASE = "llama"


def adapter(i: int) -> AdapterRecord:
    return AdapterRecord(
        adapter_id=f"a{i}",
        base_model=BASE,
        version="1",
        rank=8,
        artifact_uri=f"s3://loraplane-artifacts/a{i}/",
        sha256=f"{i:064x}",
        size_bytes=1,
        tenant_id="t",
        compatibility=Compatibility(target_modules=["q_proj"], max_lora_rank=64),
    )


def fleet(
    workers: int, copies: int, now: float
) -> tuple[FleetIndex, list[WorkerState], list[AdapterRecord]]:
    per = max(1, copies // workers)
    records = [adapter(i) for i in range(copies + 1000)]
    states = []
    for w in range(workers):
        loaded = [
            LoadedAdapter(
                lora_name=r.lora_name,
                adapter_id=r.adapter_id,
                version="1",
                tenant_id="t",
                tier="gpu" if j % 2 == 0 else "host",
            )
            for j, r in enumerate(records[w * per : (w + 1) * per])
        ]
        states.append(
            WorkerState(
                worker_id=f"w{w:04d}",
                base_model=BASE,
                ts=datetime.fromtimestamp(now, UTC),
                gateway_url=f"http://127.0.0.1:{20000 + w}",
                gpu_slots_used=per // 2 + 1,
                gpu_slots_total=per // 2 + 1 + w % 3,
                host_bytes_used=0,
                host_bytes_budget=1,
                max_lora_rank=64,
                adapters=loaded,
            )
        )
    index = FleetIndex(Policy(), 5.0)
    for s in states:
        index.update(s)
    return index, states, records


def timed(fn: object, n: int) -> dict[str, float]:
    samples = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()  # type: ignore[operator]
        samples.append((time.perf_counter_ns() - t) / 1000)
    samples.sort()
    return {
        "p50_us": round(samples[n // 2], 2),
        "p99_us": round(samples[int(n * 0.99)], 2),
        "mean_us": round(sum(samples) / n, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--copies", type=int, default=10_000)
    parser.add_argument("--decisions", type=int, default=20_000)
    args = parser.parse_args()
    now = time.time()
    index, states, records = fleet(args.workers, args.copies, now)
    rng = random.Random(0)
    per = max(1, args.copies // args.workers)
    gpu = [r for i, r in enumerate(records[: args.copies]) if (i % per) % 2 == 0]
    host = [r for i, r in enumerate(records[: args.copies]) if (i % per) % 2 == 1]
    cold = records[args.copies :]
    in_flight = {s.worker_id: rng.randrange(8) for s in states}
    out = {"workers": args.workers, "resident_copies": args.copies, "goal_us": 50}
    for name, pool in (("gpu_copy", gpu), ("host_copy", host), ("new_copy", cold)):
        picks = [rng.choice(pool) for _ in range(args.decisions)]
        it = iter(picks)
        out[name] = timed(lambda it=it: index.route(next(it), now, in_flight), args.decisions)
    beats = iter(rng.choice(states) for _ in range(2000))
    out["heartbeat_update"] = timed(lambda: index.update(next(beats)), 2000)
    for kind, slots in (("same_slots", 0), ("slots_changed", 1)):
        changed = iter(
            s.model_copy(update={"gpu_slots_total": s.gpu_slots_total + slots * (1 + i % 2)})
            for i, s in enumerate(rng.choice(states) for _ in range(200))
        )

        def beat_then_new_copy(changed: object = changed) -> None:
            index.update(next(changed))  # type: ignore[call-overload]
            index.route(cold[0], now, in_flight)

        out[f"heartbeat_{kind}_then_new_copy"] = timed(beat_then_new_copy, 200)
    out["passed"] = all(out[k]["p50_us"] <= 50 for k in ("gpu_copy", "host_copy", "new_copy"))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
