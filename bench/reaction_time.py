"""Reaction time: from the first request log of a burst to the ``load_gpu`` command for that
adapter consumed by the worker agent's command feed, p50/p99 over ``--bursts`` bursts, with
a steady background of request logs for other adapters.

The streams app runs on a private topic prefix (``tests/integration/planner_env.PlannerEnv``:
signed publish + promote of ``--bursts`` adapters, all never requested, so none is wanted):
the registry and scoring agents in ``loraplane streams run``, the planner as a process of
its own (``loraplane streams planner``, as docs/scale.md deploys it; ``--planner-in-worker``
runs it inside the streams worker, sharing a GIL with the scoring keeper). The
"agent" is ``workers.command_feed.KafkaCommandFeed``, the consumer the worker agent polls,
for a worker that heartbeats 64 free GPU slots (and, after each load, the adapters loaded
so far, as a real agent would). The per-worker cold-load budget is raised so that 50 loads
in a minute are allowed; everything else is the default policy. Bursts are sequential: one
adapter gets ``--burst-size`` logs at once, the clock stops when its ``load_gpu`` arrives.

The baseline is the floor under any event-driven reaction: one message produced and
consumed through the same broker by a subscribed confluent-kafka consumer, timed the same
way and interleaved with the bursts. The ratio is baseline p99 / reaction p99.

``stages_ms`` splits each reaction where the time goes, from record timestamps (the
producer's clock, this machine's): ``keeper`` from the first log to the scoring keeper
producing the adapter's new score (its batching and fold), ``scores_commit`` from then to a
read-committed reader of the scores topic (the bench's own, as the planner's tail) seeing
it (the keeper's transaction and the fetch), ``planner`` from then to the planner producing
the ``load_gpu`` (its trigger and tick), ``delivery`` from then to the worker feed handing it
over (the planner's transaction and the feed's fetch). Each is a distribution over bursts.

    .venv/bin/python -m bench.reaction_time                       # 50 bursts, 500 ev/s behind
    .venv/bin/python -m bench.reaction_time --bursts 100 --background-rate 50000
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import tempfile
import threading
import time
import uuid
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from bench.report import Row, emit, parse_args, percentile, times
from bench.streams_process import LORAPLANE, streams_worker
from bench.workload import request_logs
from loraplane.eventlog.sink import KafkaEventSink
from loraplane.kernel.config import Settings, get_settings
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import encode
from loraplane.schemas.commands import CommandAction
from loraplane.schemas.keyring import KeyringFile
from loraplane.schemas.request_log import RequestLog, Tier
from loraplane.streams.scores import score_key
from loraplane.workers.command_feed import KafkaCommandFeed
from tests.integration.planner_env import ALL_AGENTS, PlannerEnv

WORKER = "bench-w1"
SLOTS = 64
WITHOUT_PLANNER = ("loraplane.streams.registry_agent", "loraplane.streams.scoring_agent")
GOAL_P99_MS = 200.0  # first log -> load_gpu consumed
GOAL_DELIVERY_P99_MS = 50.0  # load_gpu issued -> consumed
PLANNER_READY = "memory of"
"""What the planner logs once it took the lease and read its memory."""


_SPAWN = multiprocessing.get_context("spawn")  # no fork of a process running Kafka clients


class Background(_SPAWN.Process):  # type: ignore[name-defined]
    """Request logs for adapters outside the registry at ``rate``/s: work for the scoring
    agent (each one a count in its unknown bucket, no score key) that the planner never
    acts on. A process of its own: producing 50k logs/s from the bench's process would hold
    the GIL the measuring feed needs, which no worker agent shares."""

    def __init__(self, settings: Settings, topic: str, rate: float) -> None:
        super().__init__(daemon=True)
        self.settings, self.topic, self.rate = settings, topic, rate
        self.halt = _SPAWN.Event()
        self.producing = _SPAWN.Event()  # set when its clock starts: a spawn takes seconds
        self.count = _SPAWN.Value("q", 0)

    @property
    def sent(self) -> int:
        return int(self.count.value)

    def wait_at_rate(self, timeout_s: float = 60.0, hold_s: float = 2.0) -> None:
        """Until the process produces and has held its rate for ``hold_s``: a burst timed
        before then would have no load behind it."""
        if not self.producing.wait(timeout_s):
            raise RuntimeError(f"the background did not start producing in {timeout_s:.0f}s")
        time.sleep(hold_s)

    def stop(self) -> None:
        self.halt.set()
        if self.pid is not None:  # started
            self.join(15)

    def run(self) -> None:
        from loraplane.kernel import kafka

        p = kafka.producer(self.settings, linger_ms=20)
        logs = request_logs(5000, adapters=300, prefix="bg")
        pool = [(m.adapter_id.encode(), encode(m)) for m in logs]
        started, sent = time.monotonic(), 0
        self.producing.set()
        while not self.halt.is_set():
            due = int((time.monotonic() - started) * self.rate)
            while sent < due:
                key, value = pool[sent % len(pool)]
                p.produce(self.topic, key=key, value=value)
                sent += 1
            self.count.value = sent
            p.poll(0)
            time.sleep(0.01)
        p.flush(10)


class ScoresWatch(threading.Thread):
    """When each record of the scores topic was produced (its timestamp) and read by a
    read-committed consumer, by score key, from now on."""

    def __init__(self, settings: Settings, topic: str) -> None:
        super().__init__(daemon=True)
        from loraplane.kernel import kafka

        self.consumer = kafka.consumer(
            settings, f"bench-scores-{uuid.uuid4().hex[:8]}", offset_reset=kafka.OffsetReset.latest
        )
        self.consumer.subscribe([topic])
        self.stop = threading.Event()
        self.seen: dict[str, list[tuple[float, float]]] = {}
        self.lock = threading.Lock()

    def run(self) -> None:
        from loraplane.kernel import kafka

        while not self.stop.is_set():
            for msg in kafka.consume_ready(self.consumer, 1000, 0.05):
                if msg.error() is not None:
                    continue
                read = time.time()
                key = (msg.key() or b"").decode("utf-8", "replace")
                with self.lock:
                    self.seen.setdefault(key, []).append((msg.timestamp()[1] / 1000, read))
        self.consumer.close()

    def first_after(self, key: str, t: float) -> tuple[float, float] | None:
        """(produced, read) of the first record of ``key`` produced at or after ``t``."""
        with self.lock:
            return next((r for r in self.seen.get(key, []) if r[0] >= t), None)


def burst(producer: Any, topic: str, rec: AdapterRecord, n: int) -> float:
    """Produce ``n`` logs for ``rec`` at once; returns the time the first was handed over."""
    ts = now_utc()
    started = time.time()
    for i in range(n):
        log = RequestLog(
            event_id=f"burst-{uuid.uuid4().hex}",
            ts=ts,
            request_id=f"r{i}",
            tenant_id=rec.tenant_id,
            base_model=rec.base_model,
            adapter_id=rec.adapter_id,
            adapter_version=rec.version,
            worker_id="gw",
            tier_at_arrival=Tier.cold,
            ttft_ms=900.0,
        )
        producer.produce(topic, key=rec.adapter_id.encode(), value=encode(log))
    producer.flush(10)
    return started


async def wait_load(
    feed: KafkaCommandFeed, lora_name: str, timeout_s: float
) -> tuple[float, float]:
    """(time the feed handed it over, time the planner produced it) of ``lora_name``'s
    load_gpu."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = await feed.next(timeout_s=0.1)
        if got is None:
            continue
        handed_over = time.time()  # the agent commits only after applying it
        await feed.commit(got.message)
        if got.command.action is CommandAction.load_gpu and got.command.lora_name == lora_name:
            return handed_over, got.message.timestamp()[1] / 1000
    raise RuntimeError(f"no load_gpu for {lora_name} within {timeout_s:.0f}s")


def kafka_round_trip(producer: Any, consumer: Any, topic: str) -> float:
    """Seconds from producing one message to a subscribed consumer receiving it."""
    marker = uuid.uuid4().hex.encode()
    started = time.time()
    producer.produce(topic, key=b"probe", value=marker)
    producer.flush(10)
    while True:
        msg = consumer.poll(5)
        if msg is None:
            raise RuntimeError("round-trip probe lost")
        if msg.error() is None and msg.value() == marker:
            return time.time() - started


async def measure(
    env: PlannerEnv, recs: list[AdapterRecord], burst_size: int, rate: float
) -> dict[str, list[float]]:
    from loraplane.kernel import kafka

    settings = env.settings
    sink = KafkaEventSink(settings, "bench-reaction")
    feed = KafkaCommandFeed(
        settings,
        WORKER,
        sink,
        keyring=KeyringFile(settings.keyring_path),
        group_id=f"bench-{uuid.uuid4().hex[:8]}",
    )
    probe_topic = env.topic("audit")  # any private topic: the probe is one opaque message
    probe = kafka.consumer(
        settings, f"bench-probe-{uuid.uuid4().hex[:8]}", offset_reset=kafka.OffsetReset.latest
    )
    probe.subscribe([probe_topic])
    producer = kafka.producer(settings, linger_ms=0)
    background = Background(settings, env.topic("requests"), rate)
    watch = ScoresWatch(settings, env.topic("scores"))
    out: dict[str, list[float]] = {
        "reaction": [],
        "to_issue": [],
        "floor": [],
        "keeper": [],
        "scores_commit": [],
        "planner": [],
        "delivery": [],
    }
    try:
        env.heartbeat(WORKER, recs[0].base_model, slots=SLOTS)
        while await feed.next(timeout_s=1.0) is not None:  # nothing wanted yet: drain
            pass
        probe.poll(2)  # join the probe's group before timing it
        watch.consumer.poll(2)  # and the scores watch's
        watch.start()
        background.start()
        await asyncio.to_thread(background.wait_at_rate)
        window = (time.monotonic(), background.sent)
        loaded: list[AdapterRecord] = []
        for rec in recs:
            out["floor"].append(kafka_round_trip(producer, probe, probe_topic))
            started = burst(producer, env.topic("requests"), rec, burst_size)
            consumed, issued = await wait_load(feed, rec.lora_name, timeout_s=30)
            out["reaction"].append(consumed - started)
            out["to_issue"].append(issued - started)
            score = watch.first_after(score_key(rec.adapter_id, rec.version), started - 0.005)
            if score is not None:  # the clock stamps whole milliseconds
                produced, read = score
                out["keeper"].append(max(0.0, produced - started))
                out["scores_commit"].append(read - produced)
                out["planner"].append(issued - read)
                out["delivery"].append(consumed - issued)
            loaded.append(rec)
            env.heartbeat(WORKER, rec.base_model, gpu=loaded, slots=SLOTS)
        # the rate the bursts had behind them: the background's own, over their window
        sent_s = time.monotonic() - window[0]
        out["background_held"] = [(background.sent - window[1]) / sent_s if sent_s else 0.0]
    finally:
        background.stop()
        watch.stop.set()
        watch.join(5)
        probe.close()
        feed.close()
    out["background_events"] = [float(background.sent)]
    return out


def own_planner(env: PlannerEnv) -> AbstractContextManager[Any]:
    """``loraplane streams planner`` as a process of its own (as docs/scale.md deploys it),
    once it holds the lease and read its memory."""
    return streams_worker(
        env.settings,
        [LORAPLANE, "streams", "planner"],
        env.home / "planner.log",
        ready=PLANNER_READY,
        env=env.env,
    )


def run(
    stack: Settings, bursts: int, burst_size: int, rate: float, planner_process: bool
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-reaction-") as tmp:
        env = PlannerEnv.create(
            stack, Path(tmp), cold_loads_per_minute_per_worker=max(60, bursts * 2)
        )
        try:
            env.start(WITHOUT_PLANNER if planner_process else ALL_AGENTS)
            with own_planner(env) if planner_process else nullcontext():
                recs = [env.publish(f"rt{i:04d}", "tiny-llama") for i in range(bursts)]
                env.wait_registered(*((r, "active") for r in recs))
                samples = asyncio.run(measure(env, recs, burst_size, rate))
        finally:
            env.stop()
            env.delete_topics()
    counts = ("background_events", "background_held")
    ms = {k: [v * 1000 for v in vs] for k, vs in samples.items() if k not in counts}

    def dist(values: list[float]) -> dict[str, float]:
        return {
            "p50": round(percentile(values, 50), 1),
            "p99": round(percentile(values, 99), 1),
            "max": round(max(values), 1),
            "min": round(min(values), 1),
        }

    return {
        "unit": "ms",
        "bursts": bursts,
        "burst_size": burst_size,
        "background_rate_events_s": rate,
        "background_events_sent": int(samples["background_events"][0]),
        "background_rate_held_events_s": round(samples["background_held"][0]),
        "planner": "own process" if planner_process else "in the streams worker",
        "first_event_to_load_gpu_consumed_ms": dist(ms["reaction"]),
        "first_event_to_load_gpu_issued_ms": dist(ms["to_issue"]),
        "kafka_round_trip_floor_ms": dist(ms["floor"]),
        "stages_ms": {
            k: dist(ms[k]) for k in ("keeper", "scores_commit", "planner", "delivery") if ms[k]
        },
        "stages_timed": len(ms["keeper"]),
        "ratio": round(percentile(ms["floor"], 99) / percentile(ms["reaction"], 99), 4),
        "goal": f"p99 <= {GOAL_P99_MS:.0f} ms, issued -> consumed p99 <= "
        f"{GOAL_DELIVERY_P99_MS:.0f} ms",
        "goal_met": {
            "reaction": percentile(ms["reaction"], 99) <= GOAL_P99_MS,
            "delivery": bool(ms["delivery"])
            and percentile(ms["delivery"], 99) <= GOAL_DELIVERY_P99_MS,
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=50)
    parser.add_argument("--burst-size", type=int, default=5)
    parser.add_argument(
        "--background-rate",
        type=float,
        default=500.0,
        help="request logs/s for other adapters during the bursts",
    )
    parser.add_argument(
        "--planner-in-worker",
        action="store_true",
        help="run the planner inside the streams worker (loraplane streams "
        "run), not as its own process (loraplane streams planner)",
    )
    args = parse_args(parser, "bench.reaction_time", argv)
    result = run(
        get_settings(),
        args.bursts,
        args.burst_size,
        args.background_rate,
        not args.planner_in_worker,
    )
    r, f = result["first_event_to_load_gpu_consumed_ms"], result["kafka_round_trip_floor_ms"]
    emit(
        result,
        Row(
            f"reaction time ({args.bursts} bursts, {args.background_rate:.0f} ev/s behind)",
            f"p50 {r['p50']:.0f} ms, p99 {r['p99']:.0f} ms (max {r['max']:.0f}), "
            f"{result['background_rate_held_events_s']} ev/s held behind; "
            + ", ".join(
                f"{stage} p50 {d['p50']:.0f} / p99 {d['p99']:.0f}"
                for stage, d in result["stages_ms"].items()
            ),
            f"p50 {f['p50']:.1f} ms, p99 {f['p99']:.1f} ms Kafka produce->consume",
            times(result["ratio"]) + " (floor p99 / reaction p99)",
            result["goal"],
        ),
        args,
    )


if __name__ == "__main__":
    main()
