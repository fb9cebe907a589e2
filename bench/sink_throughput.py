"""Metrics sink: rows/s from Kafka into ClickHouse, against raw clickhouse-driver inserts.

loraplane's path is ``loraplane.metrics.sink.Sink`` (its own consumer group: consume,
decode and validate, build rows, columnar insert, commit offsets) on a private requests topic
that already holds ``--rows`` request logs. Its rate is taken from the end of its first batch
to the last row, so the consumer-group join is not counted (it is reported separately as
``sink_first_batch_s``). The raw baseline inserts the very same rows with
``client.execute(..., columnar=True)`` in batches of the sink's batch size, every batch's
columns built before the clock starts (``tables.columns_of``, timestamps already the integers
the driver would compute): the best clickhouse-driver does with no Kafka, no decoding, no
checks and no row building. The two run back to back, alternating which goes first, into two
private databases that are dropped afterwards. The sink's CPU is also split by part (from
``/proc``, per thread: its loop, which consumes, decodes and commits; its insert thread, which
encodes timestamps and runs the driver; librdkafka's threads; and the collector's share of
them all), so a missed goal comes with where the time goes.

    .venv/bin/python -m bench.sink_throughput                 # 200k rows, 3 repetitions
    .venv/bin/python -m bench.sink_throughput --rows 500000 --reps 5
"""

from __future__ import annotations

import argparse
import gc
import os
import threading
import time
import uuid
from collections import defaultdict
from typing import Any

from bench.isolation import isolated, private_topics, produce_all
from bench.report import Row, Summary, emit, parse_args, times
from bench.workload import request_logs
from loraplane.kernel.config import Settings, get_settings
from loraplane.metrics import migrations
from loraplane.metrics.clickhouse import connect
from loraplane.metrics.sink import Sink, SinkConfig, column_encoders
from loraplane.metrics.tables import TABLES, columns_of

SINK_TOPICS = tuple(t.topic_suffix for t in TABLES)
REQUESTS = next(t for t in TABLES if t.topic_suffix == "requests")
SLOW_SERVER_S = 120.0  # a loaded 2-core machine: dropping a database can take a while


def raw_insert(
    settings: Settings,
    rows: list[tuple[Any, ...]],
    batch: int,
) -> tuple[float, float]:
    """(seconds, CPU seconds of this process) to insert ``rows`` in batches with the bare
    driver, each batch's columns built beforehand."""
    client = connect(settings, timeout_s=SLOW_SERVER_S)
    try:
        encoders = column_encoders(client)[REQUESTS.name]
        batches = [columns_of(rows[i : i + batch], encoders) for i in range(0, len(rows), batch)]
        started, cpu = time.perf_counter(), time.process_time()
        for columns in batches:
            client.execute(REQUESTS.insert_sql, columns, columnar=True)
        return time.perf_counter() - started, time.process_time() - cpu
    finally:
        client.disconnect()


PARTS = ("loop", "insert", "librdkafka", "gc", "rest")
"""The sink's CPU by part: its loop thread (consume, decode, commit), its insert thread
(timestamps, the driver), librdkafka's threads, the garbage collector in any of them (also
counted in its thread's part), and the rest of the process (this harness)."""


def _task_cpu() -> dict[int, tuple[str, float]]:
    """Each thread of this process: its name as the kernel has it and its CPU seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        out[int(task)] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return out


def _parts(before: dict[int, tuple[str, float]], loop: int | None) -> dict[str, float]:
    """CPU seconds by part (``PARTS``, but gc) since ``before``."""
    insert = {t.native_id for t in threading.enumerate() if t.name.startswith("metrics-sink")}
    spent: dict[str, float] = defaultdict(float)
    for task, (name, cpu) in _task_cpu().items():
        used = cpu - before.get(task, (name, 0.0))[1]
        if task == loop:
            spent["loop"] += used
        elif task in insert:
            spent["insert"] += used
        elif name.startswith("rdk:"):
            spent["librdkafka"] += used
        else:
            spent["rest"] += used
    return spent


class _Collections:
    """The thread CPU spent in the garbage collector while it is installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started: dict[int, float] = {}

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started[threading.get_ident()] = time.thread_time()
        elif (began := self._started.pop(threading.get_ident(), None)) is not None:
            self.seconds += time.thread_time() - began


def sink_rate(
    settings: Settings,
    total: int,
    batch: int,
    timeout_s: float,
) -> tuple[float, float, float, dict[str, float]]:
    """(rows/s after the first batch, seconds from start to the first batch, CPU seconds of
    this process a row after the first batch: the sink's threads and librdkafka's, and those
    CPU seconds a row by part)."""
    sink = Sink(
        settings,
        SinkConfig(batch_size=batch, max_wait_s=0.5, group_id=f"bench-sink-{uuid.uuid4().hex[:8]}"),
    )
    stop = threading.Event()
    thread = threading.Thread(target=sink.run, args=(stop,), daemon=True)
    started = time.perf_counter()
    thread.start()
    first_at, first_rows, cpu = 0.0, 0, 0.0
    deadline = started + timeout_s
    tasks: dict[int, tuple[str, float]] = {}
    collections = _Collections()
    try:
        while sink.stats.rows < total:
            if time.perf_counter() > deadline or not thread.is_alive():
                raise RuntimeError(f"sink delivered {sink.stats.rows}/{total} rows")
            if not first_at and sink.stats.rows:
                first_at, first_rows = time.perf_counter(), sink.stats.rows
                cpu, tasks = time.process_time(), _task_cpu()
                gc.callbacks.append(collections)
            time.sleep(0.002)
        done, cpu = time.perf_counter(), time.process_time() - cpu
        parts = _parts(tasks, thread.native_id)
    finally:
        if collections in gc.callbacks:
            gc.callbacks.remove(collections)
        stop.set()
        thread.join(timeout=30)
    if sink.stats.dead_letters:
        raise RuntimeError(f"{sink.stats.dead_letters} rows dead-lettered")
    if first_rows >= total:
        raise RuntimeError("everything arrived in one batch: use more --rows")
    rows = total - first_rows
    parts["gc"] = collections.seconds
    return (
        rows / (done - first_at),
        first_at - started,
        cpu / rows,
        {part: parts[part] / rows for part in PARTS},
    )


def run(base: Settings, total: int, reps: int, batch: int) -> dict[str, Any]:
    settings = isolated(base, "sink")
    raw_db = settings.model_copy(
        update={
            "clickhouse": settings.clickhouse.model_copy(
                update={"database": settings.clickhouse.database + "_raw"}
            )
        }
    )
    logs = request_logs(total, seed=1)
    rows = [REQUESTS.row(m) for m in logs]
    sink_rates: list[float] = []
    raw_rates: list[float] = []
    joins: list[float] = []
    sink_cpu: list[float] = []
    sink_parts: dict[str, list[float]] = {part: [] for part in PARTS}
    load_at_start = os.getloadavg()[0]
    raw_cpu: list[float] = []
    with private_topics(settings, SINK_TOPICS):
        try:
            migrations.migrate(settings)
            migrations.migrate(raw_db)
            produce_all(settings, "requests", logs, key=lambda m: m.adapter_id)
            del logs
            # The rows held for the raw path are this harness's, not either path's: out of the
            # collector's sight, or every full collection the sink's allocations set off
            # (consumed messages, row tuples) would scan them too.
            gc.freeze()
            for rep in range(reps):
                for path in ("raw", "sink") if rep % 2 == 0 else ("sink", "raw"):
                    if path == "raw":
                        seconds, cpu = raw_insert(raw_db, rows, batch)
                        raw_rates.append(total / seconds)
                        raw_cpu.append(cpu / total * 1e6)
                    else:
                        rate, join_s, cpu, parts = sink_rate(settings, total, batch, timeout_s=300)
                        sink_rates.append(rate)
                        joins.append(join_s)
                        sink_cpu.append(cpu * 1e6)
                        for part, seconds in parts.items():
                            sink_parts[part].append(seconds * 1e6)
        finally:
            gc.unfreeze()
            client = connect(settings, database="", timeout_s=SLOW_SERVER_S)
            for db in (settings.clickhouse.database, raw_db.clickhouse.database):
                client.execute(f"DROP DATABASE IF EXISTS `{db}`")
            client.disconnect()
    lp, raw = Summary.from_samples(sink_rates), Summary.from_samples(raw_rates)
    return {
        "unit": "rows/s",
        "rows": total,
        "batch_size": batch,
        "reps": reps,
        "sink_rows_s": lp.as_dict(),
        "raw_insert_rows_s": raw.as_dict(),
        "sink_first_batch_s": Summary.from_samples(joins).as_dict(),
        # client CPU (this process, all threads) a row; ClickHouse's and Kafka's own not counted
        "sink_cpu_us_per_row": Summary.from_samples(sink_cpu).as_dict(),
        # medians; gc is also counted in the thread it ran in
        "sink_cpu_us_per_row_by_part": {
            part: round(Summary.from_samples(v).median, 2) for part, v in sink_parts.items()
        },
        "raw_insert_cpu_us_per_row": Summary.from_samples(raw_cpu).as_dict(),
        "load_average_1m": {"start": round(load_at_start, 2), "end": round(os.getloadavg()[0], 2)},
        "ratio": round(lp.median / raw.median, 3),
        "goal": ">= 0.8x",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)  # 10 batches of the default size
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=SinkConfig.batch_size)
    args = parse_args(parser, "bench.sink_throughput", argv)
    result = run(get_settings(), args.rows, args.reps, args.batch)
    emit(
        result,
        Row(
            f"metrics sink (Kafka -> ClickHouse), {args.batch}-row inserts",
            Summary(**result["sink_rows_s"]).text("rows/s", 0),
            Summary(**result["raw_insert_rows_s"]).text("rows/s", 0)
            + " clickhouse-driver columnar insert",
            times(result["ratio"]),
            result["goal"],
        ),
        args,
    )


if __name__ == "__main__":
    main()
