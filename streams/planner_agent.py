"""The planner inside ``loraplane streams run``: a ``mode.Service`` of the Faust app that
runs one ``streams.planner_runtime.PlannerRuntime`` (every base model) in a thread for as
long as the worker runs. The runtime reads only Kafka and holds the planner lease, so this
planner and any ``loraplane streams planner`` processes on the same prefix share one lease:
one of them plans, the others stand by (docs/reliability.md, "The planner lease").
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import mode
from loraplane.streams.app import app
from loraplane.streams.planner_runtime import PlannerRuntime

from loraplane.kernel.config import get_settings

runtime = PlannerRuntime(get_settings())
"""This worker's planner (its ``metrics()`` go on ``--metrics-port``)."""


@app.service
class PlannerService(mode.Service):
    """Starts the planning thread with the worker and stops it (leaving the lease group, so
    a standby takes over at once) with it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def on_start(self) -> None:
        self._thread = threading.Thread(target=runtime.run, args=(self._stop,),
                                        name="planner", daemon=True)
        self._thread.start()

    async def on_stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
