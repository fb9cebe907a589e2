"""The cost of a durable request log: added p50/p99 latency and worker CPU per request of the
event journal (loraplane/eventlog/journal.py) against the path without it, in the same run.

Two `loraplane worker run` processes, each beside its own FAKE vLLM (it answers at once, so
what is measured is the worker's own cost), on a private topic prefix of the stack's Kafka: one with
the journal (the default), one with ``LORAPLANE_EVENT_JOURNAL=false`` (the path before: the
log only in librdkafka's memory until the broker's ack). Both serve the same hot adapter.
Each repetition sends ``--requests`` completions with ``--concurrency`` in flight to each
worker's gateway, whole answers and streamed ones, alternating which worker goes first. Per
kind: each path's latency p50/p99 (median over the repetitions), the journal's added p50/p99,
and the worker's CPU (user + system, /proc) per request, as a ratio to the path without it.

The end-to-end CPU figure moves in steps of the kernel's clock tick; ``emit`` gives the
journal's own cost precisely: two ``KafkaEventSink`` in this process on the same topics (the
real librdkafka and broker), with and without the journal, alternate blocks of
``--emit-events`` request logs, polled (and the journal fsynced) every 200 events as the
processes' poll task does; the process CPU (every thread: librdkafka's and the fsync) and the
wall time per event. Prints one JSON object; edits no file.

    .venv/bin/python -m bench.request_log_durability                 # 2000 x 3, concurrency 16
    .venv/bin/python -m bench.request_log_durability --requests 500 --reps 5 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.gateway_overhead import (
    PROMPT,
    TENANT,
    Run,
    child,
    load,
    publish,
    vllm_command,
    wait_hot,
    with_logs,
    worker_home,
)
from bench.isolation import delete_s3_prefix, private_topics
from bench.report import Summary, percentile
from loraplane.frontdoor.api_keys import add_key
from loraplane.infra.processes import free_port
from loraplane.kernel.config import Settings, get_settings
from loraplane.kernel.secrets import ensure_secret
from loraplane.kernel.topics import TOPICS
from loraplane.tiny_model import TINY_BASE_MODEL, build_model

PATHS = ("journal", "none")
KINDS = {"whole": {}, "stream": {"stream": True}}


def run(
    base: Settings, total: int, concurrency: int, reps: int, emit_events: int
) -> dict[str, Any]:
    adapter_id = f"bench-log-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="bench-log-") as tmp:
        work = Path(tmp)
        settings, env = worker_home(base, "log", work)
        suffixes = tuple(t.suffix for t in TOPICS if t.suffix != "stack-health")
        with private_topics(settings, suffixes):
            try:
                model = build_model(work / "model")
                publish(settings, work, adapter_id)
                key = add_key(settings.api_keys_path, TENANT)
                bin_dir = Path(sys.executable).parent
                ports = {p: free_port() for p in PATHS}
                vllm_ports = {p: free_port() for p in PATHS}
                keys = {p: work / f"vllm-{p}.key" for p in PATHS}

                def vllm(path: str) -> Any:
                    log = work / f"vllm-{path}.log"
                    command, vllm_env = vllm_command(
                        model, vllm_ports[path], False, log, ensure_secret(keys[path]), env
                    )
                    return child(command, log, vllm_env)

                def worker(path: str, extra: dict[str, str]) -> Any:
                    return child(
                        [
                            str(bin_dir / "loraplane"),
                            "worker",
                            "run",
                            "--worker-id",
                            f"bench-{path}",
                            "--base-model",
                            TINY_BASE_MODEL,
                            "--vllm-url",
                            f"http://127.0.0.1:{vllm_ports[path]}",
                            "--vllm-api-key-file",
                            str(keys[path]),
                            "--gateway-port",
                            str(ports[path]),
                            "--host-tier-dir",
                            str(work / f"tier-{path}"),
                            "--model-dir",
                            str(model),
                            "--tick-s",
                            "0.2",
                        ],
                        work / f"{path}.log",
                        {**env, **extra},
                    )

                with (
                    vllm("journal"),
                    vllm("none"),
                    worker("journal", {}) as journal_pid,
                    worker("none", {"LORAPLANE_EVENT_JOURNAL": "false"}) as none_pid,
                ):
                    pids = {"journal": journal_pid, "none": none_pid}
                    headers = {"Authorization": f"Bearer {key}"}
                    body = {**PROMPT, "model": adapter_id}
                    urls = {p: f"http://127.0.0.1:{ports[p]}/v1/completions" for p in PATHS}
                    try:
                        for path in PATHS:
                            asyncio.run(wait_hot(urls[path], body, headers, timeout_s=90))
                        results = asyncio.run(
                            measure(urls, pids, body, headers, total, concurrency, reps)
                        )
                        emits = measure_emit(settings, adapter_id, emit_events, reps)
                    except Exception as exc:
                        raise with_logs(exc, work, ("journal.log", "none.log")) from exc
            finally:
                delete_s3_prefix(settings, f"{TENANT}/{adapter_id}/")
    return {**summarise(results, total, concurrency, reps), "emit": emits}


async def measure(
    urls: dict[str, str],
    pids: dict[str, int],
    body: dict[str, Any],
    headers: dict[str, str],
    total: int,
    concurrency: int,
    reps: int,
) -> dict[str, dict[str, list[Run]]]:
    """kind -> path -> one Run per repetition."""
    for extra in KINDS.values():  # warm both paths
        for path in PATHS:
            await load(
                urls[path], {**body, **extra}, headers, min(total, 50), concurrency, pids[path]
            )
    results: dict[str, dict[str, list[Run]]] = {k: {p: [] for p in PATHS} for k in KINDS}
    for rep in range(reps):
        for kind, extra in KINDS.items():
            for path in PATHS if rep % 2 == 0 else PATHS[::-1]:
                results[kind][path].append(
                    await load(
                        urls[path], {**body, **extra}, headers, total, concurrency, pids[path]
                    )
                )
    return results


def measure_emit(settings: Settings, adapter_id: str, events: int, reps: int) -> dict[str, Any]:
    """CPU and wall microseconds per ``emit`` of a request log, with and without the
    journal (alternating blocks, median over ``reps``)."""
    from datetime import UTC, datetime

    from loraplane.eventlog.sink import KafkaEventSink
    from loraplane.schemas.request_log import RequestLog

    sinks = {
        p: KafkaEventSink(
            settings.model_copy(
                update={"event_journal": p == "journal", "spool_dir": settings.home / "spool"}
            ),
            f"bench-emit-{p}",
        )
        for p in PATHS
    }
    log = RequestLog(
        event_id="e",
        ts=datetime.now(UTC),
        request_id="r" * 24,
        tenant_id=TENANT,
        base_model=TINY_BASE_MODEL,
        adapter_id=adapter_id,
        adapter_version="1",
        lora_name=f"{adapter_id}@1-0123abcd",
        worker_id="bench-w1",
        tier_at_arrival="gpu",
        ttft_ms=3.2,
        prompt_tokens=12,
        output_tokens=8,
    )
    cpu: dict[str, list[float]] = {p: [] for p in PATHS}
    wall: dict[str, list[float]] = {p: [] for p in PATHS}
    for rep in range(reps + 1):  # the first round warms both up
        for path in PATHS if rep % 2 == 0 else PATHS[::-1]:
            sink = sinks[path]
            c0, w0 = time.process_time(), time.perf_counter()
            for i in range(events):
                sink.emit("requests", adapter_id, log.model_copy(update={"event_id": f"{i}"}))
                if i % 200 == 199:
                    sink.poll()
                    sink.sync()
            left = sink.flush(30)
            if left:
                raise RuntimeError(f"{left} events not acknowledged")
            if rep:
                cpu[path].append((time.process_time() - c0) / events * 1e6)
                wall[path].append((time.perf_counter() - w0) / events * 1e6)
    for sink in sinks.values():
        sink.close(5)
    c = {p: Summary.from_samples(v) for p, v in cpu.items()}
    w = {p: Summary.from_samples(v) for p, v in wall.items()}
    return {
        "events": events,
        "unit": "us per emit (process CPU, all threads; wall)",
        **{f"{p}_cpu_us": c[p].as_dict() for p in PATHS},
        **{f"{p}_wall_us": w[p].as_dict() for p in PATHS},
        "added_cpu_us": round(c["journal"].median - c["none"].median, 2),
        "cpu_ratio": round(c["journal"].median / c["none"].median, 3),
    }


def summarise(
    results: dict[str, dict[str, list[Run]]], total: int, concurrency: int, reps: int
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "benchmark": "request log durability (event journal vs none, FAKE vLLM)",
        "unit": "latency ms; worker CPU ms per request",
        "requests": total,
        "concurrency": concurrency,
        "reps": reps,
    }
    for kind, by_path in results.items():
        p50 = {
            p: Summary.from_samples([percentile(r.latencies, 50) for r in runs])
            for p, runs in by_path.items()
        }
        p99 = {
            p: Summary.from_samples([percentile(r.latencies, 99) for r in runs])
            for p, runs in by_path.items()
        }
        cpu = {
            p: Summary.from_samples([r.cpu_ms_per_request for r in runs])
            for p, runs in by_path.items()
        }
        rps = {p: Summary.from_samples([r.rps for r in runs]) for p, runs in by_path.items()}
        out[kind] = {
            **{f"{p}_p50_ms": p50[p].as_dict() for p in PATHS},
            **{f"{p}_p99_ms": p99[p].as_dict() for p in PATHS},
            **{f"{p}_cpu_ms_per_request": cpu[p].as_dict() for p in PATHS},
            **{f"{p}_rps": rps[p].as_dict() for p in PATHS},
            "added_p50_ms": round(p50["journal"].median - p50["none"].median, 3),
            "added_p99_ms": round(p99["journal"].median - p99["none"].median, 3),
            "added_cpu_ms_per_request": round(cpu["journal"].median - cpu["none"].median, 4),
            "cpu_ratio": round(cpu["journal"].median / cpu["none"].median, 3),
            "rps_ratio": round(rps["journal"].median / rps["none"].median, 3),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--emit-events", type=int, default=20000)
    args = parser.parse_args(argv)
    print(
        json.dumps(
            run(get_settings(), args.requests, args.concurrency, args.reps, args.emit_events)
        )
    )


if __name__ == "__main__":
    main()
