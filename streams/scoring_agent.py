"""The scoring keeper inside the Faust worker (``loraplane streams run``): one
``streams.score_keeper.ScoreKeeper`` in its own thread for as long as the worker runs.

It shares nothing with the other agents of the worker: the planner reads the ``scores``
topic like any other reader. More keepers may run beside it as their own processes
(``loraplane streams scoring``); the consumer group shares the requests partitions among all
of them (docs/scale.md, "Scoring processes").
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import mode
from loraplane.streams.app import app
from loraplane.streams.score_keeper import PartitionMismatch, ScoreKeeper

from loraplane.kernel.config import get_settings

log = logging.getLogger(__name__)


@app.service
class ScoringService(mode.Service):
    """Runs a ScoreKeeper (instance host-pid) in a thread while the Faust worker runs."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def on_start(self) -> None:
        keeper = ScoreKeeper(get_settings())

        def run() -> None:
            try:
                keeper.run(self._stop)
            except PartitionMismatch as exc:  # the topics need fixing, not a retry
                log.error("scoring stopped: %s", exc)

        self._thread = threading.Thread(target=run, name="scoring", daemon=True)
        self._thread.start()

    async def on_stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
