"""A fleet router's heartbeat: its own in-flight work and flow-control queues (compacted
topic ``router-state``, key = router_id). Routers are otherwise stateless; this is what ops
see of them in ``loraplane fleet status`` and the dashboard's fleet panel, summed over the
routers heard lately (``kernel.heartbeat.heard_lately``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from loraplane.schemas.base import Identifier, StrictModel, Timestamp
from loraplane.schemas.worker_state import MAX_IN_FLIGHT

__all__ = ["QueueDepth", "RouterState"]


class QueueDepth(StrictModel):
    base_model: Identifier
    band: str = Field(max_length=64, description="request class / adapter priority")
    queued: int = Field(ge=0, le=MAX_IN_FLIGHT)


class RouterState(StrictModel):
    schema_version: Literal[1] = 1
    router_id: Identifier
    ts: Timestamp
    in_flight: dict[Identifier, Annotated[int, Field(ge=0, le=MAX_IN_FLIGHT)]] = Field(
        default_factory=dict,
        max_length=10_000,
        description="base model -> requests this router has forwarded and not yet answered",
    )
    queues: list[QueueDepth] = Field(
        default_factory=list, max_length=10_000, description="non-empty queues only"
    )
