"""Which partition of the commands topic carries a worker's commands (issue #15 item 3).

One function, used by the planner when it sends and by the worker when it assigns itself
its partition, so the two can never disagree. A stable hash (crc32, not Python's salted
``hash``) of the worker id modulo the topic's partition count: with partitions well above
the fleet size a worker's partition carries about its own commands only.
"""

from __future__ import annotations

import zlib


def partition_of(worker_id: str, partitions: int) -> int:
    """The commands partition of ``worker_id`` on a topic of ``partitions`` partitions."""
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, not {partitions}")
    return zlib.crc32(worker_id.encode("utf-8")) % partitions
