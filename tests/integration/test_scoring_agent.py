"""The scoring agent on the real broker: a SIGKILL in the middle of a stream neither loses nor
double-counts a request log (one Kafka transaction per batch), and bad logs become exactly
one dead letter each."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.request_log import RequestLog
from loraplane.streams.scores import Sample, ScoreState, observe_many, score_key, snapshot
from loraplane.streams.scoring_agent import restore

from bench.workload import request_logs
from loraplane.kernel import kafka
from loraplane.kernel.config import Settings
from tests.integration.registry_env import Env

pytestmark = pytest.mark.integration
AGENT = ("loraplane.streams.scoring_agent",)


@pytest.fixture
def env(stack: Settings, tmp_path: Path) -> Iterator[Env]:
    e = Env.create(stack, tmp_path)
    try:
        yield e
    finally:
        e.stop()
        e.delete_topics()


def produce(env: Env, messages: list[tuple[bytes, bytes]]) -> None:
    p = kafka.producer(env.settings, linger_ms=20)
    for key, value in messages:
        p.produce(env.topic("requests"), key=key, value=value)
    assert p.flush(30) == 0


def committed(env: Env, suffix: str) -> list[bytes]:
    """Every committed value of a topic (aborted batches are not part of the record)."""
    topic = env.topic(suffix)
    reader = kafka.consumer(env.settings, f"{env.settings.topic_prefix}-probe", read_to_end=True)
    try:
        parts = reader.list_topics(topic, timeout=10).topics[topic].partitions
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        values, pending = [], set(parts)
        while pending:
            for msg in reader.consume(1000, timeout=1.0):
                if msg.error() is not None:
                    pending.discard(msg.partition())
                else:
                    values.append(msg.value())
        return values
    finally:
        reader.close()


def expected_states(logs: list[RequestLog]) -> dict[str, dict]:
    states: dict[str, ScoreState] = {}
    for x in logs:  # one adapter's logs share a partition, so the agent sees them in order
        key = score_key(x.adapter_id, x.adapter_version)
        states[key] = observe_many(states.get(key) or ScoreState(), [Sample.of(x)])[0]
    return {k: snapshot(v).model_dump() for k, v in states.items()}


def wait_states(env: Env, want: dict[str, dict], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        got = {k: snapshot(v).model_dump() for k, v in restore(env.settings).items()}
        if got == want:
            return
        assert time.monotonic() < deadline, (
            f"{sum(got.get(k) == v for k, v in want.items())}/{len(want)} states as expected")
        time.sleep(0.5)


def test_sigkill_mid_stream_neither_loses_nor_double_counts(env: Env) -> None:
    logs = request_logs(40_000, adapters=50, seed=7)
    first, second = logs[:10_000], logs[10_000:]
    produce(env, [(x.adapter_id.encode(), encode(x)) for x in first])
    env.start(AGENT)
    wait_states(env, expected_states(first))

    bad = [(b"a00001", b"{not json"),
            (b"not-the-adapter", encode(second[0]))]  # key is not its adapter_id
    produce(env, [*bad, *((x.adapter_id.encode(), encode(x)) for x in second)])
    time.sleep(0.3)  # mid-stream: the agent is folding and committing batches
    assert env.worker is not None
    env.worker.send_signal(signal.SIGKILL)
    env.worker.wait(10)
    env.worker = None
    env.start(AGENT)

    wait_states(env, expected_states(first + second))
    letters = [decode(DeadLetter, v) for v in committed(env, "dead-letters")]
    assert sorted((d.component, d.reason) for d in letters) == [
        ("scoring", "key_mismatch"), ("scoring", "malformed")]
