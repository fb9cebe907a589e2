"""The one Faust application. Agents live in their own modules (AGENT_MODULES) and attach to
``app``; ``loraplane streams run`` imports them all and starts the worker.

Tables use Faust's in-memory store backed by changelog topics: on restart a worker rebuilds
them from the changelog, so state survives a kill without a local RocksDB to manage.
"""

from __future__ import annotations

import importlib

import faust

from loraplane.config import get_settings

AGENT_MODULES: tuple[str, ...] = (
    "streams.registry_agent",  # lifecycle topic -> verified registry table (+ audit, DLQ)
    "streams.scoring_agent",  # request logs -> per-adapter-version score inputs
    "streams.planner_agent",  # timer + significant events -> cache commands
)


def _make_app() -> faust.App:
    s = get_settings()
    return faust.App(
        f"{s.topic_prefix}-streams",
        broker=f"kafka://{s.kafka.bootstrap}",
        store="memory://",
        datadir=str(s.home / "faust"),
        topic_replication_factor=1,
        topic_partitions=3,
        web_enabled=False,
        producer_acks=-1,
        consumer_auto_offset_reset="earliest",
    )


app = _make_app()


def load_agents() -> None:
    """Import every agent module so its agents, tables and timers register on ``app``."""
    for name in AGENT_MODULES:
        importlib.import_module(name)
