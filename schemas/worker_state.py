"""A worker's heartbeat: what is actually loaded where (compacted topic, key = worker_id)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, StringConstraints, field_validator

from loraplane.schemas.adapter import MAX_RANK
from loraplane.schemas.base import Identifier, StrictModel, Timestamp, Version
from loraplane.schemas.commands import COMMAND_ID_PATTERN
from loraplane.schemas.reasons import VllmFailure

__all__ = [
    "GATEWAY_URL_PATTERN",
    "MAX_BYTES",
    "MAX_GPU_SLOTS",
    "MAX_IN_FLIGHT",
    "MAX_SKIPPED_REPORTED",
    "CopyOrigin",
    "LoadedAdapter",
    "ResidentTier",
    "WorkerState",
    "gateway_url_problem",
]

MAX_GPU_SLOTS = 100_000
MAX_BYTES = 2**62
MAX_IN_FLIGHT = 10_000_000
"""Bounds of a heartbeat's counts, far above any real worker's. Readers (the planner, the
router, fleet status) do arithmetic with them, floats included (the planner's protected-copy
cap is a float share of the slots), and a JSON integer decodes as a Python int of any size:
past these bounds a state is refused where it is read."""

MAX_SKIPPED_REPORTED = 256
"""The most skipped command ids one heartbeat carries (the latest ones)."""

ResidentTier = Literal["gpu", "host"]  # where a loaded adapter lives on a worker


GATEWAY_URL_PATTERN = (
    r"^(http://[A-Za-z0-9._-]+"
    r"(:(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4}))?/?)?$"
)
"""The gateway URLs the exported schema promises (none, or ``http://HOST[:PORT]``): a part
of what ``gateway_url_problem`` accepts, which the worker state's validator decides."""


def gateway_url_problem(url: str) -> str | None:
    """Why ``url`` is no ``http://HOST[:PORT]`` a router can send requests to (it speaks
    plain HTTP/1.1 and takes only the host and port), or None when it is one."""
    if not url.isascii() or not url.isprintable() or " " in url:
        return "not visible ASCII"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError past 65535 or for no number
    except ValueError as exc:
        return str(exc)
    if parts.scheme != "http" or not parts.hostname or parts.username is not None:
        return "not an http://HOST:PORT URL"
    return None


class CopyOrigin(StrEnum):
    """Who asked for a copy to be where it is."""

    planner = "planner"  # a cache command
    gateway_request = "gateway_request"  # a request found the adapter cold and asked to load it
    adopted = "adopted"  # found on the worker when its agent started, and vouched for


class LoadedAdapter(StrictModel):
    lora_name: str = Field(max_length=200)
    adapter_id: Identifier
    version: Version
    tenant_id: Identifier
    tier: ResidentTier
    pinned: bool = False
    protected: bool = Field(
        False,
        description="the worker holds this GPU copy never-evict by its own rule (its "
        "registry copy and policy): no command unpins, demotes or evicts it",
    )
    size_bytes: int = Field(0, ge=0, le=MAX_BYTES)
    rank: int = Field(0, ge=0, le=MAX_RANK)
    last_used: Timestamp | None = None
    loaded_at: Timestamp | None = Field(
        None,
        description="when this worker loaded the GPU copy into vLLM (policy "
        "min_residency_s counts from it); None: a host copy, or one found on vLLM at start",
    )
    in_flight: int = Field(0, ge=0, le=MAX_IN_FLIGHT)
    origin: CopyOrigin | None = Field(
        None, description="who asked for this copy; None: nobody now (it is being removed)"
    )


class WorkerState(StrictModel):
    schema_version: Literal[1] = 1
    worker_id: Identifier
    base_model: Identifier
    ts: Timestamp
    gateway_url: str = Field("", max_length=256, json_schema_extra={"pattern": GATEWAY_URL_PATTERN})
    gpu_slots_used: int = Field(ge=0, le=MAX_GPU_SLOTS)
    gpu_slots_total: int = Field(ge=0, le=MAX_GPU_SLOTS)
    host_bytes_used: int = Field(ge=0, le=MAX_BYTES)
    host_bytes_budget: int = Field(ge=0, le=MAX_BYTES)
    hbm_usage: float | None = Field(None, ge=0, le=1, description="None if vLLM hides it")
    max_lora_rank: int = Field(ge=1, le=MAX_RANK)
    cold_loads_last_minute: int = Field(0, ge=0, le=MAX_IN_FLIGHT)
    cold_load_budget: int | None = Field(
        None,
        ge=1,
        le=10_000,
        description="loads a rolling minute this worker allows itself "
        "now (policy.load_stall_share: adapted to what its loads cost; readers cap it at the "
        "policy's cold_loads_per_minute_per_worker). None: the policy's constant",
    )
    load_stall: float | None = Field(
        None,
        ge=0,
        le=1,
        description="the share of decode rate a load takes here, measured "
        "(None until enough requests ran beside a load and without one)",
    )
    load_seconds: float | None = Field(
        None, ge=0, le=3600, description="how long a GPU load takes here (average)"
    )
    adapters: list[LoadedAdapter] = Field(default_factory=list, max_length=100_000)
    skipped_commands: list[Annotated[str, StringConstraints(pattern=COMMAND_ID_PATTERN)]] = Field(
        default_factory=list,
        max_length=MAX_SKIPPED_REPORTED,
        description="ids of planner commands this worker will not carry out (refused by "
        "its rules, no slot it may take, a version its registry cannot back), until "
        "their deadline: the planner stops expecting them at once",
    )
    command_partition: int | None = Field(
        None,
        ge=0,
        le=2**31 - 1,  # Kafka's partition numbers are int32
        description="the commands partition this worker reads (its command slot, "
        "else the hash of its id); the planner sends there. None: an older worker, the hash",
    )
    not_run: VllmFailure | None = Field(
        None,
        description="why this worker's gateway refuses every request as not run (503 with "
        "X-Loraplane-Not-Run: vLLM hung, or serving another base model): the router does not "
        "route to it and the planner sends it no load. None: it serves (or an older worker)",
    )

    @field_validator("gateway_url")
    @classmethod
    def _usable_gateway_url(cls, v: str) -> str:
        problem = gateway_url_problem(v) if v else None
        if problem:
            raise ValueError(f"gateway_url {v[:64]!r}: {problem}")
        return v

    @property
    def serves(self) -> bool:
        """Whether its gateway answers requests: the one test the router, the planner and the
        fleet view apply (a worker whose state says ``not_run`` takes no request and no load,
        and its copies and slots count for nothing)."""
        return self.not_run is None

    def load_budget(self, ceiling: int) -> int:
        """Loads a rolling minute to plan with for this worker: the budget it reports, never
        above the policy's ``ceiling`` (a heartbeat may lower what is sent its way, not
        raise it past what the policy allows)."""
        return ceiling if self.cold_load_budget is None else min(ceiling, self.cold_load_budget)
