"""SIGKILL the sink mid-batch, restart it: ClickHouse holds exactly the events produced.

Rows inserted but not yet committed when the kill lands are consumed again after the
restart; the ReplacingMergeTree + FINAL reading makes them count once."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from loraplane.kernel.config import Settings
from tests.integration.metrics_env import (
    committed,
    count,
    metrics_env,
    produce_all,
    request_events,
    start_sink,
    stop,
    wait_for,
)

pytestmark = pytest.mark.integration

N = 3000


def test_sink_killed_mid_batch_then_restarted_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    with metrics_env(Settings()) as settings:
        produce_all(settings, "requests", request_events(N, seed=11), key=lambda m: m.adapter_id)
        log = tmp_path / "sink.log"
        # Small batches so that inserts run well ahead of the kill.
        args = ("--batch-size", "100", "--max-wait-s", "0.2", "--session-timeout-ms", "6000")
        sink = start_sink(settings, log, *args)
        try:
            wait_for(
                lambda: count(settings, "request_log", final=False) >= 300,
                60,
                f"first batches (log: {log})",
            )
            sink.send_signal(signal.SIGKILL)
            sink.wait(10)
            landed = count(settings, "request_log")
            assert 0 < landed < N, "the kill should land mid-stream"
            resume_from = committed(settings, "requests", f"{settings.topic_prefix}.metrics-sink")
            sink = start_sink(settings, log, *args)
            wait_for(
                lambda: count(settings, "request_log") == N,
                90,
                f"all {N} events after restart (log: {log})",
            )
            assert count(settings, "request_log") == N
            raw = count(settings, "request_log", final=False)
            print(
                f"killed with {landed}/{N} rows in ClickHouse, {resume_from} committed "
                f"({landed - resume_from} to replay); raw rows {raw}, FINAL {N}"
            )
        finally:
            stop(sink)
