"""A load and fault test of the request log: `loraplane worker run` (beside the FAKE vLLM, which
answers at once, so the load is as dense as this machine allows) is SIGKILLed under load,
again and again, and started again each time as a supervisor would; the real Kafka of the
stack carries its request logs and the metrics sink (in this process) writes them into the
stack's ClickHouse (a database of the test's own). Every answer a client received whole (a
200 with its body; a stream with its ``data: [DONE]``) has exactly one ``request_log`` row
under FINAL, and no request has two.

The window this closes: an answer's log was in librdkafka's memory for up to ``linger.ms``
(20 ms) and until the broker's ack, so a kill right after the answer lost it (a live run:
1520 of 1521). Now the gateway hands the log to the sink before the answer's last bytes and
the sink journals it before ``emit`` returns (loraplane/eventlog/journal.py); the restarted worker
spools what the killed one's journal held without an ack."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from loraplane.kernel.config import Settings
from loraplane.metrics import migrations
from loraplane.metrics.clickhouse import connect
from loraplane.metrics.sink import Sink, SinkConfig
from tests.integration.fault_report import report_fault
from tests.integration.metrics_env import drop_database, isolated, require_stack
from tests.integration.router_env import Fleet, running_fleet
from tests.integration.test_worker_e2e import KEY_A, _healthz, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
KILLS = 4
CLIENTS = 4
ANSWERS_BETWEEN_KILLS = 150  # answered by each worker process before it is killed
SPOOL_EVENTS, RECOVERED = (
    "loraplane_event_sink_spool_events",
    "loraplane_event_sink_recovered_total",
)


@pytest.fixture
def clickhouse(stack: Settings) -> Iterator[Settings]:
    """The stack with a ClickHouse database of this test's own (dropped afterwards)."""
    require_stack(stack)
    settings = isolated(stack)
    try:
        yield settings
    finally:
        drop_database(settings)


def _rows(settings: Settings, prefix: str) -> tuple[Counter[str], int]:
    """request_log rows per request id of ours under FINAL, and the raw row count (a replay
    of an event Kafka had stored before the kill is a second raw row until a merge)."""
    client = connect(settings)
    try:
        per_id = Counter(
            {
                rid: int(n)
                for rid, n in client.execute(
                    "SELECT request_id, count() FROM request_log FINAL WHERE request_id LIKE %(p)s "
                    "GROUP BY request_id",
                    {"p": prefix + "%"},
                )
            }
        )
        raw = int(
            client.execute(
                "SELECT count() FROM request_log WHERE request_id LIKE %(p)s", {"p": prefix + "%"}
            )[0][0]
        )
        return per_id, raw
    finally:
        client.disconnect()


class Load:
    """CLIENTS threads asking the gateway back to back, alternately whole and streamed; each
    request has its own X-Request-Id. ``answered``: the ids of the answers received whole
    (any status: a refusal has its row too; a 200 stream up to its ``data: [DONE]``)."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url, self.prefix = url, prefix
        self.answered: list[str] = []
        self.statuses: Counter[int] = Counter()
        self.other: Counter[str] = Counter()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, args=(c,), daemon=True) for c in range(CLIENTS)
        ]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _client(self, c: int) -> None:
        session = requests.Session()
        i = 0
        while not self.stop.is_set():
            i += 1
            rid, stream = f"{self.prefix}{c}-{i}", i % 2 == 0
            try:
                resp = session.post(
                    self.url,
                    timeout=10,
                    json={"model": "sql", "prompt": "hello", "max_tokens": 2, "stream": stream},
                    headers={"Authorization": f"Bearer {KEY_A}", "X-Request-Id": rid},
                )
                whole = resp.status_code != 200 or not stream or (b"data: [DONE]" in resp.content)
            except requests.RequestException as exc:  # the worker is down or was killed
                self.other[type(exc).__name__] += 1
                session = requests.Session()
                time.sleep(0.05)
                continue
            if whole:
                self.answered.append(rid)
                self.statuses[resp.status_code] += 1
            else:
                self.other["a stream cut short"] += 1


def _sink_metric(port: int, name: str) -> int:
    """One of the worker's event-sink series on its /metrics."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return round(
        sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name
        )
    )


def _restart(f: Fleet) -> float:
    """SIGKILL the worker (its agent and gateway; vLLM stays) and start it again; the seconds
    until its gateway answers again."""
    f.kill("w1")
    down = time.monotonic()
    f.respawn("w1")
    wait_for(lambda: _healthz(f.gateways["w1"]), 90, "w1 /healthz after its restart")
    return time.monotonic() - down


def test_every_answer_keeps_exactly_one_row_across_repeated_kill_9_of_its_worker(
    clickhouse: Settings, tmp_path: Path
) -> None:
    with running_fleet(
        clickhouse, tmp_path, {"sql": (21, "tenant-a")}, workers=("w1",), router=False
    ) as f:
        settings = f.settings
        migrations.migrate(settings)
        sink = Sink(settings, SinkConfig(batch_size=500, max_wait_s=0.2))
        stop = threading.Event()
        runner = threading.Thread(target=sink.run, args=(stop,), name="sink", daemon=True)
        runner.start()
        f.load("w1", f.records["sql"])
        wait_for(
            lambda: f.records["sql"].lora_name in f.adapters_on("w1"), 30, "the adapter on the GPU"
        )
        prefix = f"kill9-{uuid.uuid4().hex[:8]}-"
        recovered, downs = [], []
        try:
            with Load(f"http://127.0.0.1:{f.gateways['w1']}/v1/completions", prefix) as load:
                port = f.worker_metrics["w1"]  # its --metrics-port
                for _ in range(KILLS):
                    before = len(load.answered)
                    wait_for(
                        lambda b=before: len(load.answered) >= b + ANSWERS_BETWEEN_KILLS,
                        120,
                        "answers before the kill",
                    )
                    # a spool left by the last kill is replayed first: until it is empty new
                    # logs join it (as durable), and this kill would not test the journal
                    wait_for(
                        lambda: _sink_metric(port, SPOOL_EVENTS) == 0,
                        60,
                        "the worker's spool replayed",
                    )
                    downs.append(_restart(f))
                    recovered.append(_sink_metric(port, RECOVERED))
                before = len(load.answered)
                wait_for(
                    lambda: len(load.answered) >= before + 50, 60, "answers after the last restart"
                )
            answered = list(load.answered)
            wait_for(
                lambda: set(answered) <= set(_rows(settings, prefix)[0]),
                120,
                f"a request_log row for each of the {len(answered)} answers",
            )
            time.sleep(2)  # what is still on its way (a replay) lands before the count
        finally:
            stop.set()
            runner.join(30)
        per_id, raw = _rows(settings, prefix)
        twice = {rid: n for rid, n in per_id.items() if n > 1}
        print(
            f"{KILLS} x kill -9 of the worker under {CLIENTS} clients: {len(answered)} "
            f"answers received whole, {len(per_id)} request ids in request_log "
            f"({len(per_id) - len(answered)} of requests cut by a kill), {raw} raw rows; "
            f"events recovered from the killed worker's journal at each start: {recovered}; "
            f"down {', '.join(f'{d:.1f}' for d in downs)} s; answers by status "
            f"{dict(load.statuses)}; not answered: {dict(load.other)}"
        )
        assert len(answered) == len(set(answered)) >= KILLS * ANSWERS_BETWEEN_KILLS
        assert all(per_id[rid] == 1 for rid in answered), [
            rid for rid in answered if per_id[rid] != 1
        ][:5]
        assert not twice, twice
        assert sum(recovered) > 0, "no kill fell inside the window the journal closes"
        report_fault(
            "worker (the real agent beside a FAKE vLLM) SIGKILL under load, "
            f"{KILLS} times, restarted by the test",
            answered=len(answered),
            stored=sum(1 for rid in answered if per_id[rid] == 1),
            lost=sum(1 for rid in answered if per_id[rid] == 0),
            duplicated=sum(n - 1 for n in per_id.values() if n > 1),
            recovered=True,
            down_s=max(downs),
            recovery_s=None,
            note=f"{CLIENTS} clients back to back, half streamed; answers by status "
            f"{dict(load.statuses)}; events recovered "
            f"from the killed worker's journal at each restart: {recovered}; "
            f"{raw - sum(per_id.values())} raw replays kept once under FINAL",
        )
