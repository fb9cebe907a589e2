"""The scoring keeper inside the Faust worker (``loraplane streams run``): one
``streams.score_keeper.ScoreKeeper`` in its own thread for as long as the worker runs.

It shares nothing with the other agents of the worker: the planner reads the ``scores``
topic like any other reader. More keepers may run beside it as their own processes
(``loraplane streams scoring``); the consumer group shares the requests partitions among all
of them (docs/scale.md, "Scoring processes").
"""

from __future__ import annotations

import logging
import threading

from loraplane.kernel.config import get_settings
from loraplane.streams.app import ThreadService, app
from loraplane.streams.score_keeper import PartitionMismatch, ScoreKeeper

__all__ = ["ScoringService"]

log = logging.getLogger(__name__)


@app.service
class ScoringService(ThreadService):
    """Runs a ScoreKeeper (instance host-pid) in a thread while the Faust worker runs."""

    thread_name = "scoring"

    def work(self, stop: threading.Event) -> None:
        try:
            ScoreKeeper(get_settings()).run(stop)
        except PartitionMismatch as exc:  # the topics need fixing, not a retry
            log.error("scoring stopped: %s", exc)
