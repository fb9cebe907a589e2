"""The planner inside ``loraplane streams run``: a ``mode.Service`` of the Faust app that
runs one ``streams.planner_runtime.PlannerRuntime`` (every base model) in a thread for as
long as the worker runs. The runtime reads only Kafka and holds the planner lease, so this
planner and any ``loraplane streams planner`` processes on the same prefix share one lease:
one of them plans, the others stand by (docs/reliability.md, "The planner lease").
"""

from __future__ import annotations

import threading

from loraplane.kernel.config import get_settings
from loraplane.streams.app import ThreadService, app
from loraplane.streams.planner_runtime import PlannerRuntime

__all__ = ["PlannerService", "runtime"]

runtime = PlannerRuntime(get_settings())
"""This worker's planner (its ``metrics()`` go on ``--metrics-port``)."""


@app.service
class PlannerService(ThreadService):
    """Runs the planning thread with the worker and stops it (leaving the lease group, so
    a standby takes over at once) with it."""

    thread_name = "planner"

    def work(self, stop: threading.Event) -> None:
        runtime.run(stop)
