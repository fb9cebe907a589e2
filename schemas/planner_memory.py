"""What the planner told one worker that the worker's state may not show yet, kept in the
``planner-memory`` table (key = worker_id) and flushed before any command leaves, so a
restarted planner neither re-decides nor reuses a command id.

The wire form of ``streams.planner.WorkerMemory``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from loraplane.schemas.base import StrictModel
from loraplane.schemas.commands import CacheCommand

__all__ = ["PlannerMemory"]


class PlannerMemory(StrictModel):
    schema_version: Literal[1] = 1
    seq: int = Field(ge=0, le=2**62, description="commands issued to this worker so far (id epoch)")
    pending: tuple[CacheCommand, ...] = Field(
        max_length=100_000, description="issued, not yet visible in the worker's state"
    )
    loads: tuple[Annotated[float, Field(allow_inf_nan=False)], ...] = Field(
        max_length=100_000,
        description="issue times (epoch s) of load_gpu commands in the "
        "last minute: the cold-load budget",
    )
