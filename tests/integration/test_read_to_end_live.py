"""``read_topic(to_end=True)`` on the real broker while the topics keep being written, as the
worker-state and router-state topics are by every live worker and router: the read ends once
it has caught up, not at its timeout. The end of a partition is an EOF event, which comes
only from a fetch that answers empty; at librdkafka's fetch wait (500 ms) a partition written
more often than that never answered empty, and ``fleet status`` or a demo's look at the
worker states read for their whole timeout and called the read incomplete."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from loraplane.kernel import kafka, topics
from loraplane.kernel.bus import read_topic
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name

pytestmark = pytest.mark.integration
BEAT_S = 0.3  # three workers and a router heartbeating, faster than a fetch's 500 ms wait
KEYS = {"worker-state": [b"w1", b"w2", b"w3"], "router-state": [b"r1"]}


def test_a_read_to_the_end_ends_while_heartbeats_keep_coming(stack: Settings) -> None:
    settings = stack.model_copy(update={"topic_prefix": f"lp-eof-{uuid.uuid4().hex[:8]}"})
    topics.apply(settings)
    producer = kafka.producer(settings)
    stop, beats = threading.Event(), [0]

    def beat() -> None:
        while not stop.is_set():
            for suffix, keys in KEYS.items():
                for key in keys:
                    producer.produce(topic_name(settings, suffix), key=key, value=b"beat")
            producer.flush(10)
            beats[0] += 1
            time.sleep(BEAT_S)

    writer = threading.Thread(target=beat, name="heartbeats", daemon=True)
    writer.start()
    try:
        deadline = time.monotonic() + 30
        while beats[0] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert beats[0] >= 3, "the heartbeats were not acknowledged"
        for _ in range(3):
            t0 = time.monotonic()
            read = list(
                read_topic(
                    settings,
                    [topic_name(settings, suffix) for suffix in KEYS],
                    timeout_s=10,
                    to_end=True,  # TopicReadIncomplete when the end is not reached in time
                )
            )
            took = time.monotonic() - t0
            assert {r.key for r in read} == {k for keys in KEYS.values() for k in keys}
            assert writer.is_alive() and took < 10, took
    finally:
        stop.set()
        writer.join(10)
