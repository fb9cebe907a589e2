"""A private corner of the shared stack for one benchmark run: its own topic prefix (and
ClickHouse database when asked), created on entry and deleted on exit, so benchmarks run
beside the other engineers' tests without touching their topics or tables."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from pydantic import BaseModel

from loraplane.kernel import kafka, topics
from loraplane.kernel.bus import DeliveryError
from loraplane.kernel.config import Settings
from loraplane.schemas.codec import encode


def isolated(base: Settings, name: str, home: Path | None = None) -> Settings:
    """Same endpoints; topic prefix ``bench<name><uuid>``, database ``bench_<...>`` and
    (for child processes) state dir ``home``."""
    tag = f"{name}{uuid.uuid4().hex[:8]}"
    return base.model_copy(
        update={
            "home": home or base.home,
            "topic_prefix": f"bench{tag}",
            "clickhouse": base.clickhouse.model_copy(update={"database": f"bench_{tag}"}),
        }
    )


@contextlib.contextmanager
def private_topics(settings: Settings, suffixes: Sequence[str]) -> Iterator[Settings]:
    """Declared topics ``suffixes`` for the prefix; on exit every topic of the prefix is
    deleted, including those a Faust app made for itself (changelogs, assignor)."""
    topics.apply(settings, only=tuple(topics.spec(s) for s in suffixes))
    try:
        yield settings
    finally:
        admin = kafka.admin(settings)  # must outlive the futures
        with contextlib.suppress(Exception):
            names = [
                n
                for n in admin.list_topics(timeout=10).topics
                if n.startswith(settings.topic_prefix)
            ]
            for future in admin.delete_topics(names, operation_timeout=20).values():
                future.result(timeout=30)


def produce_all(
    settings: Settings, suffix: str, messages: Sequence[BaseModel], key: Callable[[BaseModel], str]
) -> None:
    """Produce every message with one producer and wait for every acknowledgement."""
    p = kafka.producer(settings, linger_ms=20, batch_messages=10_000)
    errors: list[str] = []
    topic = topics.topic_name(settings, suffix)
    for message in messages:
        while True:
            try:
                p.produce(
                    topic,
                    key=key(message),
                    value=encode(message),
                    on_delivery=lambda err, _m: errors.append(str(err)) if err else None,
                )
                break
            except BufferError:  # local queue full: let deliveries drain
                p.poll(0.05)
        p.poll(0)
    if p.flush(60) or errors:
        raise DeliveryError(f"{topic}: not every message acknowledged: {errors[:3]}")


def delete_s3_prefix(settings: Settings, prefix: str) -> None:
    """Every object under ``prefix`` in the artifact bucket."""
    from loraplane.workers.artifact_fetch import s3_client

    client = s3_client(settings.s3)
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=settings.s3.bucket, Prefix=prefix
    ):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=settings.s3.bucket, Key=obj["Key"])
