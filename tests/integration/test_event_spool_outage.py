"""A real broker killed with SIGKILL under steady load and started again (issue #19, item 1):
the event sink spools what Kafka did not take and replays it; every event emitted reaches
the topic, none is lost. Uses a throwaway single-broker Kafka of its own (tmp home, free
ports, started through loraplane.infra.kafka like the stack's), never the shared one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, TopicPartition
from loraplane.infra.kafka import Kafka
from loraplane.schemas.audit import AuditRecord
from loraplane.workers.event_sink import KafkaEventSink

from loraplane.kernel import kafka, topics
from loraplane.kernel.config import Settings
from tests.integration.private_kafka import kill, start
from tests.integration.private_kafka import private_kafka as private_kafka_of

pytestmark = pytest.mark.integration

RATE_HZ = 40
DOWN_S = 22.0  # past the producer's 15 s message.timeout.ms: reports turn into errors


@pytest.fixture
def private_kafka(tmp_path: Path) -> Iterator[tuple[Settings, Kafka]]:
    with private_kafka_of(tmp_path, ("audit",), topic_prefix="spooltest") as found:
        yield found


def _event(n: int) -> AuditRecord:
    return AuditRecord.model_validate({
        "event_id": f"e{n}", "ts": "2026-12-01T00:00:00Z", "component": "worker",
        "action": "spool-test", "decision": "applied", "detail": str(n)})


def _read_all(settings: Settings) -> list[int]:
    name = topics.topic_name(settings, "audit")
    consumer = kafka.consumer(settings, "spool-test-reader", read_to_end=True)
    try:
        partitions = kafka.admin(settings).list_topics(name, timeout=10).topics[name].partitions
        consumer.assign([TopicPartition(name, p, 0) for p in partitions])
        seen: list[int] = []
        at_end: set[int] = set()
        idle = time.monotonic()
        while time.monotonic() - idle < 10 and len(at_end) < len(partitions):
            msg = consumer.poll(1)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition())
                continue
            idle = time.monotonic()
            seen.append(int(AuditRecord.model_validate_json(msg.value()).detail))
        return seen
    finally:
        consumer.close()


def test_a_broker_killed_under_load_loses_no_event(
        private_kafka: tuple[Settings, Kafka]) -> None:
    settings, broker = private_kafka
    sink = KafkaEventSink(settings, "worker-spool-test")
    n = 0

    def emit_for(seconds: float, until: object = None) -> None:
        nonlocal n
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sink.emit("audit", "k", _event(n))
            n += 1
            sink.poll()
            time.sleep(1 / RATE_HZ)

    emit_for(3)
    kill(broker)
    t_down = time.monotonic()
    emit_for(DOWN_S)
    spooled_while_down = sink.counts.spooled
    start(broker)
    down_s = time.monotonic() - t_down
    emit_for(3)
    deadline = time.monotonic() + 120
    while (sink.backlog or sink.flush(0.5)) and time.monotonic() < deadline:
        sink.poll()
    assert sink.backlog == 0, f"{sink.backlog} events still spooled"
    seen = _read_all(settings)
    missing = set(range(n)) - set(seen)
    print(f"broker down {down_s:.0f} s under {RATE_HZ}/s: {n} emitted, "
          f"{spooled_while_down} spooled during the outage, {sink.counts.replayed} replayed, "
          f"{len(seen)} in the topic ({len(seen) - len(set(seen))} duplicates), "
          f"{len(missing)} lost")
    assert not missing, f"lost {len(missing)} events, e.g. {sorted(missing)[:10]}"
    assert spooled_while_down > 0, "the outage should have reached the spool"
    assert sink.dropped == 0 and sink.failed == 0
    sink.close(5)
