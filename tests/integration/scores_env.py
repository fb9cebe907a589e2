"""Exactness checks of the scoring agent on a live broker: what a topic holds (committed
records only) and the score states its request logs must fold to, each counted once.
Shared by test_scoring_agent and test_streams_broker_kill."""

from __future__ import annotations

import time

from confluent_kafka import OFFSET_BEGINNING, Message, TopicPartition

from loraplane.kernel import kafka
from loraplane.schemas.request_log import RequestLog
from loraplane.streams.score_keeper import restore
from loraplane.streams.scores import Sample, ScoreState, observe_many, score_key, snapshot
from tests.integration.registry_env import Env


def committed(env: Env, suffix: str) -> list[bytes]:
    """Every committed value of a topic (aborted batches are not part of the record)."""
    return [m.value() for m in committed_records(env, suffix)]


def committed_records(env: Env, suffix: str) -> list[Message]:
    """Every committed record of a topic, tombstones included."""
    topic = env.topic(suffix)
    reader = kafka.consumer(env.settings, f"{env.settings.topic_prefix}-probe", read_to_end=True)
    try:
        parts = reader.list_topics(topic, timeout=10).topics[topic].partitions
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        out, pending = [], set(parts)
        while pending:
            for msg in reader.consume(1000, timeout=1.0):
                if msg.error() is not None:
                    pending.discard(msg.partition())
                else:
                    out.append(msg)
        return out
    finally:
        reader.close()


def expected_states(logs: list[RequestLog]) -> dict[str, dict]:
    states: dict[str, ScoreState] = {}
    for x in logs:  # one adapter's logs share a partition, so the agent sees them in order
        key = score_key(x.adapter_id, x.adapter_version)
        states[key] = observe_many(states.get(key) or ScoreState(), [Sample.from_demand(x)])[0]
    return {k: snapshot(v).model_dump() for k, v in states.items()}


def wait_states(env: Env, want: dict[str, dict], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        got = {k: snapshot(v).model_dump() for k, v in restore(env.settings).items()}
        if got == want:
            return
        assert time.monotonic() < deadline, (
            f"{sum(got.get(k) == v for k, v in want.items())}/{len(want)} states as expected"
        )
        time.sleep(0.5)
