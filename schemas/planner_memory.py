"""What the planner told one worker that the worker's state may not show yet, kept in the
``planner-memory`` table (key = worker_id) and flushed before any command leaves, so a
restarted planner neither re-decides nor reuses a command id.

The wire form of ``streams.planner.WorkerMemory``. A record is signed by the planner key
that wrote it (``signed_bytes``: every field but ``signature``, the worker id included,
behind a domain tag of its own): the next active planner re-signs its pending commands, so
it reads only records a planner key of the keyring signed for that worker. ``epoch`` (signed
too) is the planner session that wrote it: a takeover starts a newer one, refuses a record
older than one it read before for the worker (a replay), and puts its epoch in every command
id, so a counter set back still issues ids the worker never saw.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from loraplane.schemas.base import Identifier, StrictModel
from loraplane.schemas.commands import CacheCommand

__all__ = ["PLANNER_MEMORY_SIGNING_DOMAIN", "PlannerMemory"]

PLANNER_MEMORY_SIGNING_DOMAIN = "loraplane.planner-memory.v1"


class PlannerMemory(StrictModel):
    schema_version: Literal[1] = 1
    worker_id: Identifier | None = Field(
        None, description="the worker it is about, the record's key (signed with it)"
    )
    seq: int = Field(ge=0, le=2**62, description="commands issued to this worker so far (id epoch)")
    pending: tuple[CacheCommand, ...] = Field(
        max_length=100_000, description="issued, not yet visible in the worker's state"
    )
    loads: tuple[Annotated[float, Field(allow_inf_nan=False)], ...] = Field(
        max_length=100_000,
        description="issue times (epoch s) of load_gpu commands in the "
        "last minute: the cold-load budget",
    )
    epoch: int = Field(
        0,
        ge=0,
        le=2**62,
        description="the planner session that wrote it (0: none; its command ids carry it)",
    )
    key_id: str = Field("", max_length=200, description="the planner key that signed it")
    signature: str = Field("", max_length=128, description="base64 Ed25519 signature")

    def signed_bytes(self) -> bytes:
        """The domain tag and the record's JSON without ``signature``, as pydantic writes it
        (the fields in their declared order, so a decoded record gives the same bytes):
        only planners read these records, and a tick signs every changed one, at a fifth of
        the cost of canonical JSON. The epoch is signed whatever its value: no record's
        epoch can be changed, added or taken away under its signature."""
        body = self.model_dump_json(exclude={"signature"})
        return PLANNER_MEMORY_SIGNING_DOMAIN.encode("ascii") + b"\n" + body.encode("utf-8")
