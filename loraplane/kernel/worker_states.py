"""The latest heartbeat of every worker, read from the compacted worker-state topic (key =
worker_id): for ``loraplane fleet status``, the dashboard's fleet panel and the demo, which
all show or wait on ``workers.fleet_view`` of it. The router keeps its own live consumer.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplane.kernel.bus import read_topic
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.schemas.codec import SchemaError, decode
from loraplane.schemas.worker_state import WorkerState


@dataclass(frozen=True)
class LatestStates:
    states: dict[str, WorkerState]  # worker_id -> its last state (a tombstoned one is gone)
    malformed: int  # last records that did not decode: counted, never shown


def latest_worker_states(settings: Settings, timeout_s: float = 10.0,
                         idle_s: float = 1.5) -> LatestStates:
    """Read from the start until the topic is idle for ``idle_s`` or ``timeout_s`` passed
    (live workers keep beating, so "the end" is never reached for good), keeping each key's
    last record."""
    latest: dict[bytes, bytes | None] = {}
    for record in read_topic(settings, topic_name(settings, "worker-state"),
                             timeout_s=timeout_s, idle_s=idle_s):
        latest[record.key or b""] = record.value
    states: dict[str, WorkerState] = {}
    malformed = 0
    for value in latest.values():
        if value is None:
            continue
        try:
            state = decode(WorkerState, value)
        except SchemaError:
            malformed += 1
            continue
        states[state.worker_id] = state
    return LatestStates(states, malformed)
