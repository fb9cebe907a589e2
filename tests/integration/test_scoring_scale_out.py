"""Scoring on N processes, on the real broker: under a steady load of event-time request logs,
a second scoring process (``loraplane streams scoring``) joins the Faust worker's keeper,
takes partitions and later leaves on SIGTERM; a third joins and is SIGKILLed mid-load. Every
log is counted exactly once across the four handovers: the final committed states are those
of folding each log once, in order (a lost or twice-counted log changes the decayed
counters), and the unknown buckets stay empty."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench.workload import request_logs
from loraplane.kernel import kafka
from loraplane.kernel.config import Settings
from loraplane.schemas.codec import encode
from loraplane.schemas.request_log import RequestLog
from loraplane.streams.score_keeper import read_back
from tests.integration.planner_env import PlannerEnv as Env
from tests.integration.registry_env import LORAPLANE, wait_for
from tests.integration.scores_env import expected_states, wait_states
from tests.lifecycle_kit import BASE

pytestmark = pytest.mark.integration
AGENT = ("loraplane.streams.registry_agent", "loraplane.streams.scoring_agent")
RATE = 90  # logs/s
SECONDS = 90  # at most: the load stops AFTER_TAKEOVER_S after the takeover (30-50 s in)
# Each phase below holds the load for a few seconds: at RATE, 2 s is ~180 logs spread over
# the 12 adapters' partitions, enough for every keeper to score logs mid-stream.
BEFORE_JOIN_S = 2  # the worker's keeper alone, before the second process starts
BOTH_S = 4  # the worker's keeper and the second, side by side
BEFORE_KILL_S = 2  # the third scoring, before its SIGKILL
AFTER_TAKEOVER_S = 2  # of load once the worker's keeper took the partitions back
READ_BACK = re.compile(r"partitions \[([0-9, ]+)\] read back")


@pytest.fixture
def env(stack: Settings, tmp_path: Path) -> Iterator[Env]:
    with Env.create(stack, tmp_path).owned() as e:
        yield e


class Load(threading.Thread):
    """``logs`` at RATE per second, in order (one producer: an adapter's logs stay in order
    on its partition), until the last or ``stop()``; ``sent()``: the logs it produced;
    ``partitions``: those that carried any."""

    def __init__(self, env: Env, logs: list[RequestLog]) -> None:
        super().__init__(daemon=True)
        self.env, self.logs = env, logs
        self.partitions: set[int] = set()
        self.failed: list[str] = []
        self.produced = 0
        self.stopping = threading.Event()

    def _delivered(self, err: object, msg: object) -> None:
        if err is not None:
            self.failed.append(str(err))
        else:
            self.partitions.add(msg.partition())  # type: ignore[attr-defined]

    def stop(self) -> None:
        self.stopping.set()

    def sent(self) -> list[RequestLog]:
        assert not self.is_alive()
        return self.logs[: self.produced]

    def run(self) -> None:
        p = kafka.producer(self.env.settings)
        topic = self.env.topic("requests")
        step = 10
        began = time.monotonic()
        for i in range(0, len(self.logs), step):
            for x in self.logs[i : i + step]:
                p.produce(
                    topic, key=x.adapter_id.encode(), value=encode(x), on_delivery=self._delivered
                )
            self.produced = min(i + step, len(self.logs))
            p.poll(0)
            if self.stopping.wait(max(0.0, began + (i + step) / RATE - time.monotonic())):
                break
        assert p.flush(30) == 0


def keeper(env: Env, instance: str) -> tuple[subprocess.Popen, Path]:
    log_path = env.home / f"scoring-{instance}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [LORAPLANE, "streams", "scoring", "--instance", instance],
            env=env.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc, log_path


def taken(log_path: Path) -> list[set[int]]:
    """The partitions a keeper read back, one set per assignment, from its log."""
    return [
        {int(p) for p in m.group(1).split(",")} for m in READ_BACK.finditer(log_path.read_text())
    ]


def test_a_second_and_third_process_join_and_leave_under_load_each_log_counted_once(
    env: Env,
) -> None:
    env.start(AGENT)
    logs = request_logs(
        RATE * SECONDS, adapters=12, seed=11, start=datetime.now(UTC), span_s=SECONDS
    )
    adapters = sorted({x.adapter_id for x in logs})
    records = [env.publish(a, BASE) for a in adapters]
    env.wait_registered(*((r, "active") for r in records))
    main_log = env.home / "streams.log"
    wait_for(lambda: True if taken(main_log) else None, "the worker's keeper to read back")
    load = Load(env, logs)
    load.start()
    procs: list[subprocess.Popen] = []
    try:
        time.sleep(BEFORE_JOIN_S)
        second, second_log = keeper(env, "second")
        procs.append(second)
        wait_for(
            lambda: True if taken(second_log) else None,
            "the second keeper's partitions",
            timeout_s=60,
        )
        time.sleep(BOTH_S)  # both score under load
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0, second_log.read_text()[-3000:]

        third, third_log = keeper(env, "third")
        procs.append(third)
        wait_for(
            lambda: True if taken(third_log) else None,
            "the third keeper's partitions",
            timeout_s=60,
        )
        time.sleep(BEFORE_KILL_S)
        assert load.is_alive(), "the load ended before the SIGKILL: make SECONDS longer"
        third.send_signal(signal.SIGKILL)  # mid-batch, perhaps inside a transaction
        third.wait(10)
        killed_at = len(taken(main_log))
        # the worker's keeper takes the dead one's partitions back while the load goes on
        # (after its session timeout; their offsets once the broker aborted its transaction)
        wait_for(
            lambda: True if len(taken(main_log)) > killed_at else None,
            "the worker's keeper to take the partitions back",
            timeout_s=60,
        )
        assert load.is_alive(), "the load ended before the takeover: make SECONDS longer"
        time.sleep(AFTER_TAKEOVER_S)  # the worker's keeper scores the live load too
        load.stop()
        load.join(SECONDS + 60)
        assert not load.is_alive() and not load.failed, load.failed[:3]

        wait_states(env, expected_states(load.sent()), timeout_s=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    read = read_back(env.settings)
    assert read.unknown_total().logs == 0
    # each process did take partitions that carried logs, and the worker's keeper gave them
    # up and took them back
    assert set().union(*taken(second_log)) & load.partitions
    assert set().union(*taken(third_log)) & load.partitions
    main = main_log.read_text()
    assert "gave up requests partitions" in main
    # its first read-back, and the one after the SIGKILL; the second's partitions on its
    # SIGTERM go to the worker's keeper or straight to the third, as the rebalance falls
    assert len(taken(main_log)) >= 2, main[-3000:]
    assert len(load.partitions) >= 4, load.partitions
