"""Stream throughput: request-log events/s through the hot-score Faust app on the real broker,
against raw confluent-kafka consumption of the same topic.

Each repetition gets a fresh topic prefix holding ``--events`` request logs (keyed by
adapter_id, Zipf over ``--adapters`` adapters). Then, on that same topic:

* ``raw``: a confluent-kafka consumer assigned every partition from the beginning (no group
  join) reads every message with ``consume(1000)`` and nothing else, timed from ``assign`` to
  the last message: the most this machine's Python gets out of the broker;
* ``raw_scored``: the same consumer doing the scoring agent's work in a plain loop
  (``score_fold.fold_batch`` of each consumed batch, states kept in a dict, no writes):
  the cost of the work itself;
* ``loraplane``: ``loraplane streams run --agent loraplane.streams.scoring_agent`` as its own
  process (the real agent: consumer group, one Kafka transaction per batch writing the scores topic
  and committing offsets). One sentinel log per partition follows the workload; the rate
  runs from the first committed message of the scores topic to the last sentinel's score
  write (broker timestamps), so start-up is not counted.

Every adapter of the workload (and each sentinel) is registered first: signed views on the
registry topic and the keyring they verify under in the worker's home, since the agent scores
only versions its own registry copy lists (streams.score_admission).

Rates are events/s; the ratio is loraplane / raw. CPU cost is events per CPU-second of the
whole process (every thread, librdkafka's included): ``time.process_time`` around the raw
loops, and for the agent its ``/proc/<pid>/stat`` utime+stime sampled every ~10 ms by a
thread of this process and interpolated to the same two instants as its rate.

    .venv/bin/python -m bench.stream_throughput                  # 20k events, 3 repetitions
    .venv/bin/python -m bench.stream_throughput --events 100000 --reps 5
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import os
import re
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.isolation import isolated, private_topics, produce_all
from bench.report import Row, Summary, emit, parse_args, times
from bench.streams_process import LORAPLANE, streams_run, streams_worker
from bench.workload import request_logs
from loraplane.kernel import kafka
from loraplane.kernel.command_partition import partition_of
from loraplane.kernel.config import Settings, get_settings
from loraplane.kernel.topics import topic_name
from loraplane.schemas.adapter import AdapterStatus
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import encode
from loraplane.schemas.keyring import save_keyring
from loraplane.streams.score_admission import Known
from loraplane.streams.score_fold import fold_batch
from loraplane.streams.scores import Flat

AGENT = "loraplane.streams.scoring_agent"
SENTINEL = "zzsentinel"
TOPICS = ("requests", "scores", "dead-letters", "registry")
CONSUMING = re.compile(r"consuming from epoch ([0-9.]+)")
"""The scoring agent's log line once its states are read back (streams.scoring_agent)."""


def register(settings: Settings, adapter_ids: list[str]) -> Known:
    """Version 1 of each adapter, active: signed views on the registry topic and their
    keyring as the worker's (``home/keyring.yaml``). Returns what the agent will know."""
    from tests.lifecycle_kit import make_kit, record, signed_view

    now = now_utc()
    kit = make_kit(now)
    save_keyring(kit.keyring, settings.home / "keyring.yaml")
    producer = kafka.producer(settings, linger_ms=20)
    records = [
        record(a, "1").model_copy(update={"status": AdapterStatus.active}) for a in adapter_ids
    ]
    for r in records:
        view = signed_view(kit.keys["ci"], [r], now, kit.keyring)
        producer.produce(topic_name(settings, "registry"), key=r.adapter_id, value=encode(view))
    if producer.flush(30):
        raise RuntimeError("registry views not acknowledged")
    return Known.from_records(records)


def raw_rate(
    settings: Settings, total: int, scored: bool, known: Known, timeout_s: float = 120
) -> tuple[float, float]:
    """(events/s, events per CPU-second) of a bare consumer (optionally doing the scoring
    work), from assign to the last message."""
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    topic = topic_name(settings, "requests")
    consumer = kafka.consumer(settings, f"bench-raw-{uuid.uuid4().hex[:8]}")
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    table: dict[str, Flat] = {}  # as the keeper holds them
    seen = 0
    deadline = time.monotonic() + timeout_s
    first, cpu_first = time.perf_counter(), time.process_time()
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    try:
        while seen < total and time.monotonic() < deadline:
            batch = consumer.consume(num_messages=1000, timeout=0.5)
            for msg in batch:
                if msg.error() is not None:
                    continue
                seen += 1
            if scored and batch:
                table.update(fold_batch(table, batch, known).flat)
        done, cpu_done = time.perf_counter(), time.process_time()
    finally:
        consumer.close()
    if seen < total:
        raise RuntimeError(f"raw consumer read {seen}/{total}")
    return total / (done - first), total / (cpu_done - cpu_first)


def partitions_of(settings: Settings) -> int:
    topic = topic_name(settings, "requests")
    return len(kafka.admin(settings).list_topics(topic, timeout=10).topics[topic].partitions)


def sentinel(partition: int, partitions: int) -> str:
    """The sentinel adapter id of ``partition``: one whose key hashes there (a keeper refuses
    a log on a partition its key does not hash to)."""
    return next(
        aid
        for n in itertools.count()
        if partition_of(aid := f"{SENTINEL}{partition}-{n}", partitions) == partition
    )


def produce_sentinels(settings: Settings, round_: int = 0) -> int:
    """One request log per partition of the requests topic, after the workload: the agent
    has scored everything once it has written all of their score keys. Returns how many.
    A later ``round_`` has new event ids (the same ones would be skipped as duplicates)."""
    topic = topic_name(settings, "requests")
    producer = kafka.producer(settings)
    partitions = producer.list_topics(topic, timeout=10).topics[topic].partitions
    for p in partitions:
        (log,) = request_logs(1, adapters=1, seed=p, prefix=f"sentinel{round_}-")
        log = log.model_copy(update={"adapter_id": sentinel(p, len(partitions))})
        producer.produce(topic, key=log.adapter_id, value=encode(log), partition=p)
    if producer.flush(20):
        raise RuntimeError("sentinels not acknowledged")
    return len(partitions)


class CpuSamples:
    """A process's CPU seconds (utime + stime of ``/proc/<pid>/stat``) against
    ``time.time()``, sampled every ``period_s`` by a thread until ``stop``."""

    def __init__(self, pid: int, period_s: float = 0.01) -> None:
        self.pid, self.period_s = pid, period_s
        self.at: list[float] = []
        self.cpu: list[float] = []
        self._stop = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")
        self.resolution_s = 1 / self._tick
        """The clock's tick: a span shorter than that reads as one tick, never zero."""

    def _read(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime, stime

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                cpu = self._read()
            except OSError:
                return
            self.at.append(time.time())
            self.cpu.append(cpu)
            self._stop.wait(self.period_s)

    @contextmanager
    def sampling(self) -> Iterator[CpuSamples]:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()

    def at_time(self, moment: float) -> float:
        """CPU seconds at ``moment``, interpolated between the samples around it."""
        i = bisect.bisect_left(self.at, moment)
        if i <= 0:
            return self.cpu[0]
        if i >= len(self.at):
            return self.cpu[-1]
        t0, t1, c0, c1 = self.at[i - 1], self.at[i], self.cpu[i - 1], self.cpu[i]
        return c0 + (c1 - c0) * (moment - t0) / (t1 - t0) if t1 > t0 else c1


def faust_rate(
    settings: Settings,
    total: int,
    log_path: Path,
    worker: list[str],
    profile: Path | None = None,
    timeout_s: float = 300,
) -> tuple[float, float, float]:
    """(events/s of the scoring agent, seconds from spawn to its first consumption, events
    per CPU-second of its process over the same span).

    Timed from the moment the agent starts consuming (its log says when, after reading
    back the score states) to the broker timestamp of the last sentinel's score write, so
    neither the worker's start-up nor this process's polling is counted."""
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    changelog = topic_name(settings, "scores")
    sentinels = produce_sentinels(settings)
    spawned = time.time()
    with (
        streams_worker(settings, worker, log_path, profile=profile) as proc,
        CpuSamples(proc.pid).sampling() as cpu,
    ):
        reader = kafka.consumer(settings, f"bench-probe-{uuid.uuid4().hex[:8]}")
        try:
            parts = reader.list_topics(changelog, timeout=10).topics[changelog].partitions
            reader.assign([TopicPartition(changelog, p, OFFSET_BEGINNING) for p in parts])
            first, last, seen = 0.0, 0.0, set()
            deadline = time.monotonic() + timeout_s
            while len(seen) < sentinels:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"scoring agent never got to the end; see {log_path}")
                for msg in reader.consume(num_messages=1000, timeout=0.2):
                    if msg.error() is not None:
                        continue
                    at = msg.timestamp()[1] / 1000
                    first = min(first or at, at)
                    if SENTINEL.encode() in (msg.key() or b""):
                        seen.add(msg.key())
                        last = max(last, at)
        finally:
            reader.close()
    started = max(float(m) for m in CONSUMING.findall(log_path.read_text()) if float(m) <= first)
    events = total + sentinels
    return (
        events / (last - started),
        started - spawned,
        events / max(cpu.at_time(last) - cpu.at_time(started), cpu.resolution_s),
    )


OWNING = re.compile(r"; owning \[([0-9, ]*)\]")
"""What a scoring keeper logs it owns after a read-back or a revoke (streams.score_keeper)."""
SETTLED_S = 3.0


def _owned(log_path: Path) -> set[int]:
    """The partitions a keeper owns by its last read-back or revoke (its log says)."""
    found = OWNING.findall(log_path.read_text())
    return {int(p) for p in found[-1].split(",") if p.strip()} if found else set()


def keepers_rate(
    settings: Settings,
    total: int,
    adapters: int,
    processes: int,
    round_: int,
    folder: Path,
    backlog: bool = True,
    timeout_s: float = 300,
) -> tuple[float, float, list[int]]:
    """(events/s, events per CPU-second of all of them, partitions each owned) of
    ``processes`` plain scoring keepers (``loraplane streams scoring``) sharing the group.

    They start first and the load is produced once the group settled (every requests
    partition read back by one of them, nothing moved for ``SETTLED_S``): a load already on
    the topic would be consumed by the first keeper before the others join. The load is a
    fresh one (new event ids, the same adapters). With ``backlog`` the keepers are stopped
    (SIGSTOP, well inside their group session) while it is produced and let go together
    (SIGCONT): they read a backlog, as the raw consume does, and the rate runs from then to
    the last sentinel's score write (broker timestamps). Without it they read the load as
    it is produced, in the smaller batches a live stream makes, and the rate runs from its
    first produce."""
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    changelog = topic_name(settings, "scores")
    partitions = partitions_of(settings)
    logs = request_logs(total, adapters=adapters, seed=1000 + round_, prefix=f"k{round_}-")
    with contextlib.ExitStack() as stack:
        procs = []
        for i in range(processes):
            log_path = folder / f"keeper{round_}-{i}.log"
            proc = stack.enter_context(
                streams_worker(
                    settings,
                    [LORAPLANE, "streams", "scoring", "--instance", f"bench{round_}-{i}"],
                    log_path,
                    ready="scoring keeper",
                )
            )
            procs.append((proc, log_path, stack.enter_context(CpuSamples(proc.pid).sampling())))
        deadline, stable_since, last_owned = time.monotonic() + 120, time.monotonic(), None
        while True:
            owned = [_owned(path) for _, path, _ in procs]
            if owned != last_owned:
                last_owned, stable_since = owned, time.monotonic()
            union = set().union(*owned)
            if (
                len(union) == partitions
                and sum(map(len, owned)) == partitions
                and time.monotonic() - stable_since >= SETTLED_S
            ):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the keepers' group did not settle: {owned}")
            time.sleep(0.2)
        if backlog:
            for proc, _, _ in procs:
                os.kill(proc.pid, signal.SIGSTOP)
        try:
            began = time.time()
            produce_all(settings, "requests", logs, key=lambda m: m.adapter_id)
            sentinels = produce_sentinels(settings, round_ + 1)
        finally:
            if backlog:
                began = time.time()
                for proc, _, _ in procs:
                    os.kill(proc.pid, signal.SIGCONT)
        reader = kafka.consumer(settings, f"bench-probe-{uuid.uuid4().hex[:8]}")
        try:
            parts = reader.list_topics(changelog, timeout=10).topics[changelog].partitions
            reader.assign([TopicPartition(changelog, p, OFFSET_BEGINNING) for p in parts])
            last, seen = 0.0, set()
            stop_at = time.monotonic() + timeout_s
            while len(seen) < sentinels:
                if time.monotonic() > stop_at:
                    raise RuntimeError(f"the keepers never got to the end; see {folder}")
                for msg in reader.consume(num_messages=1000, timeout=0.2):
                    if msg.error() is not None or (at := msg.timestamp()[1] / 1000) < began:
                        continue
                    if SENTINEL.encode() in (msg.key() or b""):
                        seen.add(msg.key())
                        last = max(last, at)
        finally:
            reader.close()
        cpu = sum(c.at_time(last) - c.at_time(began) for _, _, c in procs)
        events = total + sentinels
        return (
            events / (last - began),
            events / max(cpu, procs[0][2].resolution_s),
            [len(o) for o in last_owned],
        )


def run(
    base: Settings,
    total: int,
    adapters: int,
    reps: int,
    worker: list[str],
    profile: Path | None = None,
    processes: tuple[int, ...] = (),
    backlog: bool = True,
) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"loraplane": [], "raw": [], "raw_scored": []}
    per_cpu: dict[str, list[float]] = {k: [] for k in rates}
    startup: list[float] = []
    keepers: dict[int, dict[str, list[float]]] = {n: {"rate": [], "per_cpu": []} for n in processes}
    owned: dict[int, list[list[int]]] = {n: [] for n in processes}
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        for rep in range(reps):
            settings = isolated(base, "stream", home=Path(tmp) / f"home{rep}")
            settings.home.mkdir()
            with private_topics(settings, TOPICS):
                logs = request_logs(total, adapters=adapters, seed=rep)
                produce_all(settings, "requests", logs, key=lambda m: m.adapter_id)
                known = register(
                    settings,
                    sorted(
                        {x.adapter_id for x in logs}
                        | {sentinel(p, n) for n in [partitions_of(settings)] for p in range(n)}
                    ),
                )
                for name, scored in (("raw", False), ("raw_scored", True)):
                    rate, cpu_rate = raw_rate(settings, total, scored=scored, known=known)
                    rates[name].append(rate)
                    per_cpu[name].append(cpu_rate)
                rate, started, cpu_rate = faust_rate(
                    settings,
                    total,
                    settings.home / "streams.log",
                    worker,
                    profile if rep == 0 else None,
                )
                rates["loraplane"].append(rate)
                per_cpu["loraplane"].append(cpu_rate)
                startup.append(started)
                for round_, n in enumerate(processes, start=1):
                    rate, cpu_rate, split = keepers_rate(
                        settings, total, adapters, n, round_, settings.home, backlog
                    )
                    keepers[n]["rate"].append(rate)
                    keepers[n]["per_cpu"].append(cpu_rate)
                    owned[n].append(split)
    summary = {k: Summary.from_samples(v) for k, v in rates.items()}
    cpu = {k: Summary.from_samples(v) for k, v in per_cpu.items()}
    return {
        "unit": "events/s",
        "events": total,
        "adapters": adapters,
        "reps": reps,
        "loraplane_events_s": summary["loraplane"].as_dict(),
        "raw_consume_events_s": summary["raw"].as_dict(),
        "raw_consume_and_score_events_s": summary["raw_scored"].as_dict(),
        "loraplane_events_per_cpu_s": cpu["loraplane"].as_dict(),
        "raw_consume_events_per_cpu_s": cpu["raw"].as_dict(),
        "raw_consume_and_score_events_per_cpu_s": cpu["raw_scored"].as_dict(),
        "worker_start_to_consuming_s": Summary.from_samples(startup).as_dict(),
        "ratio": round(summary["loraplane"].median / summary["raw"].median, 4),
        "ratio_vs_raw_scored": round(summary["loraplane"].median / summary["raw_scored"].median, 3),
        "cpu_ratio": round(cpu["loraplane"].median / cpu["raw"].median, 4),
        "goal": ">= 0.15x per CPU-second",
        "scoring_processes_load": "backlog" if backlog else "live",
        "scoring_processes": {
            str(n): {
                "events_s": Summary.from_samples(k["rate"]).as_dict(),
                "events_per_cpu_s": Summary.from_samples(k["per_cpu"]).as_dict(),
                "ratio": round(Summary.from_samples(k["rate"]).median / summary["raw"].median, 4),
                "cpu_ratio": round(
                    Summary.from_samples(k["per_cpu"]).median / cpu["raw"].median, 4
                ),
                "partitions_owned": owned[n],
            }
            for n, k in keepers.items()
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--adapters", type=int, default=500)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--processes",
        default="",
        help="also N plain scoring keepers (`loraplane streams scoring`) "
        "sharing the group, e.g. 1,2 (each count on a fresh load)",
    )
    parser.add_argument(
        "--keepers-on-live-load",
        action="store_true",
        help="the plain keepers read the load while it is produced (smaller batches) "
        "instead of as a backlog, as the raw consume reads it",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="pyinstrument text report of the first repetition's Faust worker (slows it)",
    )
    args = parse_args(parser, "bench.stream_throughput", argv)
    worker = streams_run([AGENT])
    processes = tuple(int(n) for n in args.processes.split(",") if n.strip())
    result = run(
        get_settings(),
        args.events,
        args.adapters,
        args.reps,
        worker,
        args.profile,
        processes,
        backlog=not args.keepers_on_live_load,
    )
    result["worker"] = " ".join(worker[1:])
    emit(
        result,
        Row(
            "stream throughput (scoring agent)",
            Summary(**result["loraplane_events_per_cpu_s"]).text("events per CPU-s", 0)
            + "; "
            + Summary(**result["loraplane_events_s"]).text("events/s", 0),
            Summary(**result["raw_consume_events_per_cpu_s"]).text("events per CPU-s", 0)
            + " confluent-kafka consume; with the same scoring work in a plain loop: "
            + Summary(**result["raw_consume_and_score_events_per_cpu_s"]).text(
                "events per CPU-s", 0
            ),
            f"{times(result['cpu_ratio'])} per CPU-second ({times(result['ratio'])} wall)"
            + "".join(
                f"; {n} plain keeper{'s' if n != '1' else ''}: "
                f"{times(k['cpu_ratio'])} per CPU-second"
                for n, k in result["scoring_processes"].items()
            ),
            result["goal"],
        ),
        args,
    )


if __name__ == "__main__":
    main()
