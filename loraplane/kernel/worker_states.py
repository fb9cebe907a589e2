"""The latest heartbeat of every worker and every fleet router, read from the compacted
worker-state and router-state topics (key = worker_id / router_id): for ``loraplane fleet
status``, the dashboard's fleet panel and the demo, which all show or wait on
``workers.fleet_view`` of them. The router keeps its own live consumer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel

from loraplane.kernel.bus import read_topic
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.schemas.codec import SchemaError, decode
from loraplane.schemas.router_state import RouterState
from loraplane.schemas.worker_state import WorkerState

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Latest(Generic[M]):
    states: dict[str, M]  # key -> its last state (a tombstoned one is gone)
    malformed: int  # last records that did not decode: counted, never shown


LatestStates = Latest[WorkerState]


def _latest(settings: Settings, suffix: str, model: type[M], timeout_s: float,
            idle_s: float) -> Latest[M]:
    """Read from the start until the topic is idle for ``idle_s`` or ``timeout_s`` passed
    (live processes keep beating, so "the end" is never reached for good), keeping each
    key's last record."""
    latest: dict[bytes, bytes | None] = {}
    for record in read_topic(settings, topic_name(settings, suffix),
                             timeout_s=timeout_s, idle_s=idle_s):
        latest[record.key or b""] = record.value
    states: dict[str, M] = {}
    malformed = 0
    for key, value in latest.items():
        if value is None:
            continue
        try:
            states[key.decode("utf-8", "replace")] = decode(model, value)
        except SchemaError:
            malformed += 1
    return Latest(states, malformed)


def latest_worker_states(settings: Settings, timeout_s: float = 10.0,
                         idle_s: float = 1.5) -> Latest[WorkerState]:
    found = _latest(settings, "worker-state", WorkerState, timeout_s, idle_s)
    return Latest({s.worker_id: s for s in found.states.values()}, found.malformed)


def latest_router_states(settings: Settings, timeout_s: float = 5.0,
                         idle_s: float = 1.0) -> Latest[RouterState]:
    found = _latest(settings, "router-state", RouterState, timeout_s, idle_s)
    return Latest({s.router_id: s for s in found.states.values()}, found.malformed)
