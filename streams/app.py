"""The one Faust application. Agents live in their own modules (AGENT_MODULES) and attach to
``app``; ``loraplane streams run`` imports them all and starts the worker. The agents share
no state in memory: each reads the topics it needs (the scoring keeper may run in other
processes too, ``loraplane streams scoring``).

Tables use Faust's in-memory store backed by changelog topics: on restart a worker rebuilds
them from the changelog, so state survives a kill without a local RocksDB to manage.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from collections.abc import Iterable
from typing import Any

import faust
import mode

from loraplane.kernel import topics
from loraplane.kernel.config import get_settings
from loraplane.kernel.kafka import faust_broker
from loraplane.schemas.dead_letter import DeadLetter, dead_letter_at
from loraplane.schemas.reasons import DeadLetterReason

__all__ = ["AGENT_MODULES", "ThreadService", "app", "dead_letter_of", "load_agents", "raw_topic"]

AGENT_MODULES: tuple[str, ...] = (
    "loraplane.streams.registry_agent",  # lifecycle topic -> verified registry table (+ audit, DLQ)
    "loraplane.streams.scoring_agent",  # request logs -> per-adapter-version score inputs
    "loraplane.streams.planner_agent",  # timer + significant events -> cache commands
)


def _make_app() -> faust.App:
    s = get_settings()
    return faust.App(
        f"{s.topic_prefix}-streams",
        **faust_broker(s),
        store="memory://",
        datadir=str(s.home / "faust"),
        topic_replication_factor=topics.replicas(s),
        topic_partitions=3,
        web_enabled=False,
    )


app = _make_app()


class ThreadService(mode.Service):
    """A blocking ``work(stop)`` (the scoring keeper, the planner runtime: confluent-kafka
    loops, not asyncio) in its own thread for as long as the Faust worker runs; stopping the
    worker sets ``stop`` and waits for the loop to end (so it leaves its groups cleanly)."""

    thread_name = "service"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def work(self, stop: threading.Event) -> None:
        raise NotImplementedError

    async def on_start(self) -> None:
        self._thread = threading.Thread(
            target=self.work, args=(self._stop,), name=self.thread_name, daemon=True
        )
        self._thread.start()

    async def on_stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)


def raw_topic(suffix: str) -> faust.TopicT:
    """A declared topic (infra.topics) with bytes in and out: agents decode with
    loraplane.schemas.codec themselves, so hostile bytes become dead letters instead of crashes."""
    from loraplane.kernel.topics import topic_name

    return app.topic(
        topic_name(get_settings(), suffix), key_serializer="raw", value_serializer="raw"
    )


def dead_letter_of(
    message: faust.types.Message, component: str, reason: DeadLetterReason, detail: str
) -> DeadLetter:
    """The dead letter of a message an agent consumed from a ``raw_topic`` (its key and value
    are the bytes on the wire); the same record on every replay (``dead_letter_at``)."""
    return dead_letter_at(
        message.topic,
        message.partition,
        message.offset,
        message.key if isinstance(message.key, bytes) else None,
        message.value if isinstance(message.value, bytes) else b"",
        message.timestamp or 0.0,
        component,
        reason,
        detail,
    )


def load_agents(modules: Iterable[str] = AGENT_MODULES) -> None:
    """Import agent modules (all by default) so their agents, tables and timers register on
    ``app``; a subset runs one concern alone (e.g. only the registry, in its tests)."""
    for name in modules:
        importlib.import_module(name)
