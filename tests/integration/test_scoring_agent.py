"""The scoring agent on the real broker: a SIGKILL in the middle of a stream neither loses nor
double-counts a request log (one Kafka transaction per batch), and bad logs become exactly
one dead letter each."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.dead_letter import DeadLetter

from bench.workload import request_logs
from loraplane.kernel import kafka
from loraplane.kernel.config import Settings
from tests.integration.registry_env import Env
from tests.integration.scores_env import committed, expected_states, wait_states

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
