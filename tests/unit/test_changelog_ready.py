"""``loraplane streams run`` waits for its changelog topics to show in the broker's metadata
with every partition led before Faust starts (a consumer that first sees a just-created
changelog without partitions fails every table write until its metadata refreshes)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from loraplane.commands import streams
from tests.kafka_message import ClusterMetadata, PartitionMetadata, TopicMetadata


@dataclass
class _Admin:
    """What the broker's metadata says, one answer per ``list_topics`` call."""

    answers: list[dict[str, TopicMetadata]]
    calls: int = 0
    asked: list[str] = field(default_factory=list)

    def list_topics(self, topic: str, timeout: float) -> ClusterMetadata:
        self.asked.append(topic)
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        return ClusterMetadata(answer)


def _led(n: int, leaderless: int = 0) -> TopicMetadata:
    return TopicMetadata({p: PartitionMetadata(-1 if p < leaderless else 1) for p in range(n)})


def test_it_waits_until_every_partition_has_a_leader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams.time, "sleep", lambda s: None)
    name = "p-streams-registry-changelog"
    admin = _Admin(
        [
            {},
            {name: TopicMetadata({}, error="UNKNOWN_TOPIC_OR_PART")},
            {name: _led(3, 2)},
            {name: _led(3)},
        ]
    )
    streams._wait_listed(admin, name, 3)  # type: ignore[arg-type]
    assert admin.calls == 4 and set(admin.asked) == {name}


def test_it_names_the_topic_and_what_it_saw_when_it_never_gets_ready() -> None:
    name = "p-streams-registry-changelog"
    admin = _Admin([{name: _led(2)}])
    with pytest.raises(
        RuntimeError,
        match=rf"{name} is not ready.*2 partitions, 2 with a "
        r"leader; want 3",
    ):
        streams._wait_listed(admin, name, 3, timeout_s=0.3)  # type: ignore[arg-type]


@dataclass
class _AwayThenBack:
    """A broker that refuses ``refusals`` metadata requests (Kafka not up yet), then lists."""

    refusals: int
    calls: int = 0

    def list_topics(self, timeout: float) -> ClusterMetadata:
        from confluent_kafka import KafkaError, KafkaException

        self.calls += 1
        if self.calls <= self.refusals:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Broker transport failure"))
        return ClusterMetadata({"lp.requests": _led(1)})


def test_a_worker_started_before_kafka_waits_for_it_a_line_each_attempt(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`streams run` started while Kafka is away ended on the first metadata request with
    a KafkaException traceback (exit 1) while every other runtime waits for the broker.
    It waits too, and says so on each attempt."""
    admin = _AwayThenBack(refusals=3)
    listed = streams._listed_once_kafka_answers(admin, "127.0.0.1:19092", attempt_s=0.01)  # type: ignore[arg-type]
    assert set(listed) == {"lp.requests"} and admin.calls == 4
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3
    assert all(ln.startswith("Kafka at 127.0.0.1:19092 does not answer (") for ln in lines)
    assert all("Traceback" not in ln for ln in lines)


def test_a_worker_kafka_refuses_ends_with_one_line_instead_of_waiting() -> None:
    """A wrong password or a missing grant looked like Kafka away: the start waited for
    good. Kafka's refusal ends it with one line naming the broker and the reason."""
    from confluent_kafka import KafkaError, KafkaException

    class Refusing:
        def list_topics(self, timeout: float) -> ClusterMetadata:
            raise KafkaException(
                KafkaError(KafkaError._AUTHENTICATION, "SASL authentication failed")
            )

    with pytest.raises(SystemExit, match=r"Kafka at 127\.0\.0\.1:19092 refused this client"):
        streams._listed_once_kafka_answers(Refusing(), "127.0.0.1:19092", attempt_s=0.01)  # type: ignore[arg-type]
