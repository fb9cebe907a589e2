"""ClickHouse goes away under load and comes back: nothing is lost, nothing counted twice.

Uses a throwaway ClickHouse server of its own (tmp data dir, free ports, started through
loraplane.infra.clickhouse like the stack's), never the shared one.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplane.infra.clickhouse import ClickHouse
from loraplane.infra.processes import free_port, wait_until
from loraplane.kernel.config import Settings
from loraplane.metrics import migrations
from tests.integration.fault_report import report_fault
from tests.integration.metrics_env import (
    count,
    create_topics,
    delete_topics,
    isolated,
    produce_all,
    request_events,
    require_stack,
    start_sink,
    stop,
    wait_for,
)

pytestmark = pytest.mark.integration

N = 2400
CHUNKS = 12


def start(server: ClickHouse) -> None:
    server.process.start(server.prepare())
    assert wait_until(server.healthy, 60, alive=lambda: server.process.pid() is not None), (
        f"throwaway ClickHouse did not start: {server.process.tail(20)}"
    )


@pytest.fixture
def private_clickhouse(tmp_path: Path) -> Iterator[tuple[Settings, ClickHouse]]:
    base = Settings()
    require_stack(base)
    settings = isolated(base).model_copy(update={"home": tmp_path / "home"})
    settings = settings.model_copy(
        update={
            "clickhouse": settings.clickhouse.model_copy(
                update={
                    "tcp_port": free_port(),
                    "http_port": free_port(),
                    "interserver_port": free_port(),
                }
            )
        }
    )
    server = ClickHouse(settings)
    start(server)
    create_topics(settings)
    try:
        yield settings, server
    finally:
        server.process.stop()
        delete_topics(settings)


@pytest.mark.parametrize(
    "outage",
    ["stopped", pytest.param("hung", marks=pytest.mark.fault_long)],
)
def test_clickhouse_down_under_load_then_back_counts_exact(
    private_clickhouse: tuple[Settings, ClickHouse], tmp_path: Path, outage: str
) -> None:
    """``stopped``: the server is stopped for 4 s under load, then started again.
    ``hung``: it is SIGSTOPped for 25 s (the kernel still takes connections, nothing
    answers; past the sink's 10 s send/receive timeout, so an insert it may yet apply is
    retried), then SIGCONTed. Either way every row is in ClickHouse exactly once."""
    settings, server = private_clickhouse
    down_s = 4.0 if outage == "stopped" else 25.0
    migrations.migrate(settings)
    events = request_events(N, seed=23)
    size = N // CHUNKS
    log = tmp_path / "sink.log"
    sink = start_sink(settings, log, "--batch-size", "200", "--max-wait-s", "0.2")
    restarted = threading.Event()

    def produce_steadily() -> None:
        for i in range(CHUNKS):
            produce_all(
                settings, "requests", events[i * size : (i + 1) * size], key=lambda m: m.adapter_id
            )
            if i == CHUNKS // 2:
                restarted.wait(60)  # the second half arrives while ClickHouse is back ...
            elif i > 2 and not restarted.is_set():
                threading.Event().wait(0.2)  # ... the middle part while it is down

    producer = threading.Thread(target=produce_steadily, daemon=True)
    try:
        producer.start()
        wait_for(lambda: count(settings, "request_log") > 0, 60, f"first rows (log: {log})")
        pid = server.process.pid()
        assert pid is not None
        if outage == "stopped":
            server.process.stop()
        else:
            os.kill(pid, signal.SIGSTOP)
        before_outage = sink.poll()
        threading.Event().wait(down_s)  # down for a while, under load
        if outage == "stopped":
            start(server)
        else:
            os.kill(pid, signal.SIGCONT)
        restarted.set()
        wait_for(
            lambda: count(settings, "request_log") == N,
            120,
            f"all {N} rows after ClickHouse came back (log: {log})",
        )
        producer.join(30)
        assert before_outage is None, "the sink must survive the outage"
        assert sink.poll() is None
        assert count(settings, "request_log") == N
        retries = log.read_text().count("not delivered")
        print(
            f"ClickHouse {outage} ~{down_s:.0f}s under load: {retries} retried batch attempts, "
            f"{count(settings, 'request_log', final=False)} raw rows, {N} FINAL"
        )
        assert retries > 0, f"the outage should have been noticed: {log.read_text()[-3000:]}"
        report_fault(
            f"ClickHouse {outage} under load, then back",
            answered=N,
            stored=count(settings, "request_log"),
            lost=N - count(settings, "request_log"),
            duplicated=0,
            recovered=sink.poll() is None,
            down_s=down_s,
            note=f"{retries} batch retries; duplicates collapse under FINAL",
        )
    finally:
        stop(sink)
