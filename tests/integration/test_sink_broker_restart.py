"""The metrics sink heals from a broker SIGKILL by itself (issue 19 item 3: it used to stall
for good), and the worker's event sink loses nothing over the outage (item 1: what Kafka did
not take is spooled on disk and replayed). A throwaway Kafka of the test's own is killed -9
for ~20 s under steady request-log load and started again; the sink (in this process, never
restarted) keeps consuming and every request log lands in ClickHouse exactly once (the
shared stack's ClickHouse, a database of the test's own)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplane.eventlog.sink import KafkaEventSink
from loraplane.infra.kafka import Kafka
from loraplane.kernel.config import Settings
from loraplane.metrics import migrations
from loraplane.metrics.clickhouse import connect
from loraplane.metrics.sink import Sink, SinkConfig
from tests.integration.fault_report import report_fault
from tests.integration.metrics_env import (
    SINK_TOPICS,
    drop_database,
    isolated_clickhouse,
    wait_for,
)
from tests.integration.private_kafka import SteadyLoad, kill, private_kafka, start

pytestmark = [pytest.mark.integration, pytest.mark.fault_long]

RATE_HZ = 50
DOWN_S = float(os.environ.get("LORAPLANE_FAULT_DOWN_S", "20"))
"""How long the broker stays dead under load (``bench.faults --outage-s`` for the long form)."""


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[Settings, Kafka]]:
    shared = isolated_clickhouse()
    with private_kafka(
        tmp_path, SINK_TOPICS, topic_prefix=shared.topic_prefix, clickhouse=shared.clickhouse
    ) as (settings, broker):
        migrations.migrate(settings)
        try:
            yield settings, broker
        finally:
            drop_database(settings)


def _stored(settings: Settings) -> tuple[int, int, int]:
    """Rows under FINAL, distinct event ids, and raw rows (replays before a merge)."""
    client = connect(settings)
    try:
        final, distinct = client.execute(
            "SELECT count(), uniqExact(event_id) FROM request_log FINAL"
        )[0]
        raw = client.execute("SELECT count() FROM request_log")[0][0]
        return int(final), int(distinct), int(raw)
    finally:
        client.disconnect()


def test_the_sink_keeps_consuming_after_a_broker_kill(env: tuple[Settings, Kafka]) -> None:
    settings, broker = env
    sink = Sink(
        settings,
        SinkConfig(batch_size=500, max_wait_s=0.2, backoff_max_s=2.0, session_timeout_ms=6000),
    )
    stop = threading.Event()
    runner = threading.Thread(target=sink.run, args=(stop,), name="sink", daemon=True)
    runner.start()
    events = KafkaEventSink(settings, "worker-sink-restart-test")
    load = SteadyLoad(events, "b", RATE_HZ)
    emit_for = load.run_for

    try:
        emit_for(5)
        wait_for(lambda: _stored(settings)[0] > 0, 60, "the sink's first rows")
        kill(broker)
        t_down = time.monotonic()
        emit_for(DOWN_S)
        start(broker)
        down_s = time.monotonic() - t_down
        t_up = time.monotonic()
        emit_for(5)
        load.drain()
        wait_for(lambda: _stored(settings)[1] >= load.n, 120, f"all {load.n} request logs stored")
        caught_up_s = time.monotonic() - t_up
        final, distinct, raw = _stored(settings)
        print(
            f"broker down {down_s:.0f} s under {RATE_HZ}/s: {load.n} emitted, "
            f"{events.counts.spooled} spooled by the event sink and "
            f"{events.counts.replayed} replayed, {final} rows "
            f"under FINAL ({distinct} distinct, {raw} raw), caught up {caught_up_s:.0f} s "
            f"after the restart; sink retries {sink.stats.retries}, "
            f"stalls reported {sink.progress.stalls}"
        )
        assert final == distinct == load.n, (final, distinct, load.n)
        assert events.counts.spooled > 0, "the outage should have reached the event spool"
        report_fault(
            "Kafka (1 broker) SIGKILL under load, restarted",
            answered=load.n,
            stored=distinct,
            lost=load.n - distinct,
            duplicated=final - distinct,
            recovered=runner.is_alive(),
            down_s=down_s,
            recovery_s=caught_up_s,
            note=f"{events.counts.spooled} events spooled and replayed by the "
            f"worker's event sink; the metrics sink never restarted",
        )
        assert runner.is_alive(), "the sink died"
    finally:
        stop.set()
        runner.join(30)
        events.close(5)
