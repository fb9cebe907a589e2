"""Shared set-up of the metrics integration tests: a private topic prefix and ClickHouse
database per test module on the shared stack, the sink as a subprocess, bulk producing."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import BaseModel

from loraplane.infra.processes import wait_until
from loraplane.kernel import kafka, topics
from loraplane.kernel.config import Settings
from loraplane.metrics import migrations
from loraplane.metrics.clickhouse import connect
from loraplane.schemas.cache_event import CacheEvent
from loraplane.schemas.codec import encode
from loraplane.schemas.request_log import RequestLog

SINK_TOPICS = ("requests", "cache-events", "decisions", "audit", "dead-letters")
REPO = Path(__file__).resolve().parents[2]


def isolated(base: Settings, tag: str | None = None) -> Settings:
    """The same endpoints, with our own topic prefix and database (uuid suffixed)."""
    tag = tag or uuid.uuid4().hex[:8]
    return base.model_copy(
        update={
            "topic_prefix": f"lpt{tag}",
            "clickhouse": base.clickhouse.model_copy(update={"database": f"loraplane_t_{tag}"}),
        }
    )


def isolated_clickhouse() -> Settings:
    """``isolated`` on the local stack's ClickHouse, for a test that brings its own Kafka;
    skips the test when that ClickHouse does not answer."""
    shared = isolated(Settings())
    try:
        connect(shared, database="", timeout_s=3).execute("SELECT 1")
    except Exception as exc:
        pytest.skip(f"no ClickHouse of the local stack (loraplane stack up): {exc}")
    return shared


def require_stack(settings: Settings) -> None:
    try:
        client = connect(settings, database="", timeout_s=3)
        client.execute("SELECT 1")
        client.disconnect()
        kafka.admin(settings).list_topics(timeout=3)
    except Exception as exc:
        pytest.skip(f"local stack not running (loraplane stack up): {exc}")


def create_topics(settings: Settings) -> None:
    topics.apply(settings, only=tuple(topics.spec(s) for s in SINK_TOPICS))


def delete_topics(settings: Settings) -> None:
    names = [topics.topic_name(settings, s) for s in SINK_TOPICS]
    admin = kafka.admin(settings)  # must outlive the futures
    with contextlib.suppress(Exception):
        for future in admin.delete_topics(names, operation_timeout=20).values():
            future.result(timeout=30)


@contextlib.contextmanager
def metrics_env(base: Settings) -> Iterator[Settings]:
    """Topics + migrated database for one test module; both removed afterwards."""
    require_stack(base)
    settings = isolated(base)
    create_topics(settings)
    migrations.migrate(settings)
    try:
        yield settings
    finally:
        drop_database(settings)
        delete_topics(settings)


DROP_TIMEOUT_S = 120.0
"""How long a test's clean-up waits for ClickHouse to drop a database: on a loaded machine a
drop of a database with a run's tables takes longer than a query's 10 s."""


def drop_database(settings: Settings, database: str | None = None) -> None:
    """Remove a test's own ClickHouse database (default ``settings.clickhouse.database``)."""
    client = connect(settings, database="", timeout_s=DROP_TIMEOUT_S)
    try:
        client.execute(f"DROP DATABASE IF EXISTS `{database or settings.clickhouse.database}`")
    finally:
        client.disconnect()


def env_for(settings: Settings) -> dict[str, str]:
    c = settings.clickhouse
    return {
        **os.environ,
        "LORAPLANE_TOPIC_PREFIX": settings.topic_prefix,
        "LORAPLANE_CLICKHOUSE__DATABASE": c.database,
        "LORAPLANE_CLICKHOUSE__TCP_PORT": str(c.tcp_port),
        "LORAPLANE_KAFKA__PORT": str(settings.kafka.port),
    }


def start_sink(settings: Settings, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """``loraplane metrics sink`` as its own process (so a test can SIGKILL it)."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [str(Path(sys.executable).parent / "loraplane"), "metrics", "sink", *args],
            cwd=REPO,
            env=env_for(settings),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def committed(settings: Settings, suffix: str, group_id: str) -> int:
    """Sum of the group's committed offsets on one topic (what a restart resumes from)."""
    from confluent_kafka import TopicPartition

    topic = topics.topic_name(settings, suffix)
    consumer = kafka.consumer(settings, group_id)
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        offsets = consumer.committed([TopicPartition(topic, p) for p in parts], timeout=10)
        return sum(max(tp.offset, 0) for tp in offsets)
    finally:
        consumer.close()


def produce_all(
    settings: Settings,
    suffix: str,
    messages: list[BaseModel | bytes],
    key: Callable[[BaseModel | bytes], str] = lambda m: "k",
) -> None:
    """Produce many messages with one producer and wait for every acknowledgement."""
    p = kafka.producer(settings)
    errors: list[str] = []
    topic = topics.topic_name(settings, suffix)
    for message in messages:
        payload = message if isinstance(message, bytes) else encode(message)
        p.produce(
            topic,
            key=key(message),
            value=payload,
            on_delivery=lambda err, _m: errors.append(str(err)) if err else None,
        )
        p.poll(0)
    assert p.flush(30) == 0, "producer did not drain"
    assert not errors, errors[:3]


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    if not wait_until(check, timeout, interval=0.3):
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def count(settings: Settings, table: str, final: bool = True) -> int:
    client = connect(settings)
    try:
        return int(client.execute(f"SELECT count() FROM {table}{' FINAL' if final else ''}")[0][0])
    finally:
        client.disconnect()


TIERS = ("gpu", "gpu", "gpu", "host", "cold", "base_fallback")


def request_events(
    n: int,
    *,
    seed: int,
    adapters: tuple[str, ...] = ("alpha", "beta", "gamma"),
    start: datetime | None = None,
    prefix: str = "e",
) -> list[RequestLog]:
    """``n`` request logs with known tiers and TTFTs, spread over a few minutes."""
    rng = random.Random(seed)
    start = start or datetime.now(UTC) - timedelta(minutes=5)
    events = []
    for i in range(n):
        tier = rng.choice(TIERS)
        base = {"gpu": 40.0, "host": 120.0, "cold": 900.0, "base_fallback": 60.0}[tier]
        events.append(
            RequestLog(
                event_id=f"{prefix}{seed}-{i}",
                ts=start + timedelta(seconds=i * 240 / max(n, 1)),
                request_id=f"r{i}",
                tenant_id=f"t{i % 2}",
                base_model="llama-3.1-8b",
                adapter_id=rng.choice(adapters),
                adapter_version="1",
                worker_id=f"w{i % 3}",
                tier_at_arrival=tier,
                ttft_ms=round(base + rng.expovariate(1 / base), 3),
                request_class="canary" if i % 10 == 0 else "interactive",
            )
        )
    return events


def cache_event(
    i: int, kind: str, swap_ms: float = 0.0, size: int = 0, reason: str = ""
) -> CacheEvent:
    return CacheEvent(
        event_id=f"c-{i}",
        ts=datetime.now(UTC) - timedelta(minutes=2),
        worker_id="w0",
        base_model="llama-3.1-8b",
        tenant_id="t0",
        adapter_id="alpha",
        adapter_version="1",
        lora_name="alpha@1-0123abcd",
        kind=kind,
        swap_ms=swap_ms,
        bytes=size,
        reason=reason,
    )
