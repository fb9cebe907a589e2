"""The 3-broker cluster under the real agents: `loraplane worker run` (beside the FAKE vLLM,
tests/integration/router_env.py) and the metrics sink (in this process, the shared stack's
ClickHouse with a database of the test's own) run against a private 3-node cluster
(tests/integration/private_kafka.py). Steady requests go through the worker's gateway; the
leader of the request-log partition being written is SIGKILLed; every answered request is
then exactly one request_log row, the worker answered throughout, nothing was restarted."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from loraplane.infra.kafka import Kafka
from loraplane.kernel import kafka, topics
from loraplane.kernel.config import Settings
from loraplane.metrics import migrations
from loraplane.metrics.clickhouse import connect
from loraplane.metrics.sink import Sink, SinkConfig
from tests.integration.fault_report import report_fault
from tests.integration.metrics_env import drop_database, isolated_clickhouse, wait_for
from tests.integration.private_kafka import kill, private_cluster
from tests.integration.router_env import running_fleet
from tests.integration.test_cluster_broker_kill import _written_partition
from tests.integration.test_worker_e2e import KEY_A

# long (bench.faults runs it, docs/reliability.md): not in ./run test
pytestmark = [pytest.mark.integration, pytest.mark.timeout(400), pytest.mark.fault_long]
RATE_HZ = 20
BEFORE_S = 4.0
AFTER_KILL_S = 12.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Settings, list[Kafka]]]:
    shared = isolated_clickhouse()
    (tmp_path / "kafka").mkdir()
    with private_cluster(
        tmp_path / "kafka",
        ("requests",),
        3,
        topic_prefix=shared.topic_prefix,
        clickhouse=shared.clickhouse,
    ) as found:
        try:
            yield found
        finally:
            drop_database(shared)


def _stored(settings: Settings, prefix: str) -> tuple[int, int]:
    """request_log rows of our requests under FINAL, and their distinct request ids."""
    client = connect(settings)
    try:
        rows, distinct = client.execute(
            "SELECT count(), uniqExact(request_id) FROM request_log FINAL "
            "WHERE request_id LIKE %(p)s",
            {"p": prefix + "%"},
        )[0]
        return int(rows), int(distinct)
    finally:
        client.disconnect()


def test_a_leader_kill_under_the_real_agents_loses_no_request_log(
    cluster: tuple[Settings, list[Kafka]], tmp_path: Path
) -> None:
    base, nodes = cluster
    (tmp_path / "fleet").mkdir()
    with running_fleet(
        base, tmp_path / "fleet", {"sql": (21, "tenant-a")}, workers=("w1",), router=False
    ) as f:
        settings = f.settings
        migrations.migrate(settings)
        sink = Sink(
            settings,
            SinkConfig(batch_size=500, max_wait_s=0.2, backoff_max_s=2.0, session_timeout_ms=6000),
        )
        stop = threading.Event()
        runner = threading.Thread(target=sink.run, args=(stop,), name="sink", daemon=True)
        runner.start()
        agent = f.procs["w1"]
        f.load("w1", f.records["sql"])
        wait_for(
            lambda: f.records["sql"].lora_name in f.adapters_on("w1"), 30, "the adapter on the GPU"
        )
        prefix = f"k3-{uuid.uuid4().hex[:8]}-"
        answered: list[str] = []
        failed: list[str] = []
        slowest = [0.0]  # the longest answer after the kill (s)
        session = requests.Session()

        def ask_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                rid = f"{prefix}{len(answered) + len(failed)}"
                sent = time.monotonic()
                try:
                    resp = session.post(
                        f"http://127.0.0.1:{f.gateways['w1']}/v1/completions",
                        timeout=10,
                        json={"model": "sql", "prompt": "hello", "max_tokens": 2},
                        headers={"Authorization": f"Bearer {KEY_A}", "X-Request-Id": rid},
                    )
                    (answered if resp.status_code == 200 else failed).append(rid)
                    slowest[0] = max(slowest[0], time.monotonic() - sent)
                except requests.RequestException:
                    failed.append(rid)
                time.sleep(1 / RATE_HZ)

        try:
            ask_for(BEFORE_S)
            name = topics.topic_name(settings, "requests")
            partition, leader = _written_partition(settings, name)
            victim = next(node for node in nodes if node.node == leader)
            t_kill = time.monotonic()
            kill(victim)
            slowest[0] = 0.0
            ask_for(AFTER_KILL_S)
            wait_for(
                lambda: _stored(settings, prefix)[1] >= len(answered),
                90,
                f"all {len(answered)} answered requests in request_log",
            )
            stored_s = time.monotonic() - t_kill
            rows, distinct = _stored(settings, prefix)
            new_leader = kafka_leader(settings, name, partition)
            print(
                f"3 brokers, leader {leader} of requests partition {partition} killed -9 "
                f"under {RATE_HZ} requests/s through the gateway: {len(answered)} answered, "
                f"{len(failed)} not, {rows} request_log rows ({distinct} distinct), all "
                f"stored {stored_s:.1f} s after the kill; slowest answer after it "
                f"{slowest[0] * 1000:.0f} ms; new leader {new_leader}; sink retries "
                f"{sink.stats.retries}"
            )
            assert not failed, failed[:5]
            assert rows == distinct == len(answered), (rows, distinct, len(answered))
            assert new_leader not in (leader, -1)
            assert agent.poll() is None and f.procs["w1"] is agent, "the worker restarted"
            assert runner.is_alive(), "the metrics sink died"
            report_fault(
                "Kafka (3 brokers) request-log leader SIGKILL under the real worker "
                "and metrics sink",
                answered=len(answered),
                stored=distinct,
                lost=len(answered) - distinct,
                duplicated=rows - distinct,
                recovered=True,
                down_s=None,
                recovery_s=stored_s,
                note=f"{RATE_HZ} requests/s through the gateway, every one answered "
                f"(slowest after the kill {slowest[0] * 1000:.0f} ms); new "
                f"leader {new_leader}; worker and sink never restarted",
            )
        finally:
            stop.set()
            runner.join(30)


def kafka_leader(settings: Settings, name: str, partition: int) -> int:
    return int(
        kafka.admin(settings)
        .list_topics(name, timeout=10)
        .topics[name]
        .partitions[partition]
        .leader
    )
