"""No poison pill (issue #19, item 4): a message of any size or shape on ``commands`` can't
crash or stall the worker. Producing its dead letter never raises into the consumer loop
(the event sink counts and logs a refused message), every poison is committed, and a step of
the command loop that fails anyway is logged and counted, not fatal."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from loraplane.eventlog.sink import KafkaEventSink
from loraplane.kernel import kafka
from loraplane.kernel.config import Settings
from loraplane.kernel.thread_calls import ThreadCalls
from loraplane.schemas.codec import decode
from loraplane.schemas.dead_letter import MAX_DEAD_LETTER_BYTES, DeadLetter
from loraplane.schemas.keyring import KeyringFile
from loraplane.workers.agent import WorkerAgent, WorkerConfig
from loraplane.workers.command_feed import KafkaCommandFeed
from loraplane.workers.vllm_client import VllmClient
from tests.kafka_message import AssignedConsumer, FakeMessage

POISON: list[tuple[bytes | None, bytes | None]] = [
    (b"w1", None),
    (b"w1", b""),
    (b"w1", b"x" * 1_500_000),
    (b"w1", b"\xff\xfe\x80" * 1000),
    (b"w1", b"[" * 100_000),
    (b"w1", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    (b"w1", b'"a string"'),
    (b"w1", json.dumps({"command_id": 5}).encode()),
    (None, b"{}"),
    (b"w2", b"not mine"),
    (b"\xff" * 10, b"{}"),
]


class Producer:
    """librdkafka refusing what is over its 1 MB ``message.max.bytes``, as it does."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def produce(self, topic: str, key: Any, value: bytes, on_delivery: Any) -> None:
        if len(value) > 1_000_000:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        self.sent.append(value)

    def poll(self, _timeout: float) -> int:
        return 0


class Consumer(AssignedConsumer):
    def __init__(self, pending: list[FakeMessage]) -> None:
        self.pending, self.commits = pending, []  # type: list[FakeMessage], list[FakeMessage]

    def poll(self, timeout: float) -> FakeMessage | None:
        return self.pending.pop(0) if self.pending else None

    def commit(self, message: FakeMessage, asynchronous: bool) -> None:
        self.commits.append(message)


def test_the_event_sink_never_raises_for_a_message_the_client_refuses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    producer = Producer()
    monkeypatch.setattr(kafka, "producer", lambda *a, **k: producer)
    sink = KafkaEventSink(Settings(home=tmp_path), "w1")  # its journal and spool: the test's
    huge = DeadLetter.model_construct(event_id="dl-x", raw_b64="A" * 2_000_000)
    sink.emit("dead-letters", "w1", huge)  # built around the bound on purpose
    assert (sink.refused, producer.sent) == (1, [])


def test_every_poison_on_commands_is_committed_and_dead_lettered_within_the_bound(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    producer = Producer()
    monkeypatch.setattr(kafka, "producer", lambda *a, **k: producer)
    messages = [
        FakeMessage(v, k, "lp.commands", 0, n, 1_800_000_000_000) for n, (k, v) in enumerate(POISON)
    ]
    consumer = Consumer(list(messages))
    monkeypatch.setattr(kafka, "consumer", lambda *a, **k: consumer)
    sink = KafkaEventSink(Settings(home=tmp_path), "w1")
    feed = KafkaCommandFeed(Settings(), "w1", sink, keyring=KeyringFile(Path("/nonexistent")))

    async def drain() -> None:
        for _ in messages:
            assert await feed.next(0) is None

    asyncio.run(drain())
    assert consumer.commits == messages
    letters = [decode(DeadLetter, v) for v in producer.sent]
    mine = [m for m in messages if m.key() == b"w1"]
    assert [(d.offset, d.component) for d in letters] == [
        (m.offset(), "worker-agent") for m in mine
    ]
    assert sink.refused == 0 and max(map(len, producer.sent)) <= MAX_DEAD_LETTER_BYTES
    assert {d.raw_size for d in letters} == {len(m.value() or b"") for m in mine}


class FailingFeed:
    def __init__(self) -> None:
        self.calls = 0

    async def next(self, timeout_s: float = 0.5) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))
        await asyncio.sleep(0.01)
        return None

    async def commit(self, message: Any) -> None:
        pass

    def refuse(self, delivery: Any, reason: Any, detail: str) -> None:
        pass


def agent(loader: Any, threads: ThreadCalls | None = None) -> WorkerAgent:
    """An agent with nothing behind it but its registry ``loader`` (and ``threads``, its
    calls in threads, when a test watches them)."""
    return WorkerAgent(
        WorkerConfig(
            worker_id="w1", base_model="b", vllm_url="http://127.0.0.1:9", host_budget_bytes=1
        ),
        vllm=VllmClient("http://127.0.0.1:9"),
        host_tier=None,  # type: ignore[arg-type]
        registry_loader=loader,
        sink=KafkaEventSink.__new__(KafkaEventSink),
        threads=threads,
    )


async def test_a_failing_command_loop_step_is_counted_and_the_loop_goes_on() -> None:
    worker, feed = agent(lambda: []), FailingFeed()
    loop = asyncio.create_task(worker._command_loop(feed))
    await asyncio.sleep(1.3)
    assert not loop.done() and feed.calls > 2
    loop.cancel()
    assert worker.metrics.registry.get_sample_value("loraplane_command_loop_errors_total") == 1
    await worker.vllm.close()


async def test_a_registry_loader_that_raises_keeps_the_records() -> None:
    from loraplane.schemas.adapter import AdapterRecord
    from tests.lifecycle_kit import record as make_record

    record = make_record("a", "1")
    answers: list[Any] = [[record], RuntimeError("broker away")]

    def loader() -> list[AdapterRecord]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    worker = agent(loader)
    await worker.refresh_registry()
    await worker.refresh_registry()
    assert list(worker.records) == [record.lora_name]
    await worker.vllm.close()
