"""The bounds of what a live tail holds of refused records, on real Kafka
(kernel/topic_tail.py): a writer of the ``planner-memory`` topic inventing worker ids grows
the planner's memory tail only up to its bound, and a new keyring's re-read from the start
brings back what was forgotten, so a record that verifies with it is not lost."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from loraplane.kernel import kafka, topics
from loraplane.kernel.config import Settings
from loraplane.kernel.topic_tail import TopicTail
from tests.integration.metrics_env import isolated

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture
def settings(stack: Settings) -> Iterator[Settings]:
    settings = isolated(stack)
    topics.apply(settings, only=(topics.spec("planner-memory"),))
    try:
        yield settings
    finally:
        admin = kafka.admin(settings)
        with contextlib.suppress(Exception):
            name = topics.topic_name(settings, "planner-memory")
            for future in admin.delete_topics([name], operation_timeout=20).values():
                future.result(timeout=30)


def test_attack_forged_keys_are_held_within_bounds_and_a_rewind_reads_them_again(
    settings: Settings,
) -> None:
    """200 records under new keys, each refused by the tail's user as it arrives: 10 are
    held beside the genuine one, 190 forgotten; a rewind reads the topic again from its
    start and every key is back for its user to judge."""
    topic = topics.topic_name(settings, "planner-memory")
    producer = kafka.producer(settings, quiet=True)
    producer.produce(topic, key=b"genuine", value=b"signed")
    for i in range(200):
        producer.produce(topic, key=f"ghost-{i}".encode(), value=b"forged")
    assert producer.flush(30) == 0
    holder: list[TopicTail] = []
    judging = [True]

    def judge(record: object) -> None:
        if judging[0] and getattr(record, "value", None) == b"forged":
            holder[0].refuse(record)  # type: ignore[arg-type]

    tail = TopicTail(settings, topic, component="test-memory", on_record=judge, max_refused=10)
    holder.append(tail)
    tail.start()
    try:
        assert tail.wait_read_to(tail.ends(), 60)
        held = tail.snapshot()
        assert len(held) == 11 and b"genuine" in {r.key for r in held}
        assert tail.forgotten == 190 and tail.refused_held()[0] == 10
        judging[0] = False  # a new keyring: nothing is refused any more
        assert tail.rewind()
        assert tail.wait_read_to(tail.ends(), 60)
        assert len(tail.snapshot()) == 201 and tail.forgotten == 190
        assert not tail.rewind()  # nothing forgotten since
    finally:
        tail.stop()
