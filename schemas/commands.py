"""Cache commands from the planner to one worker (Kafka key = worker_id).

``command_id`` makes a command idempotent: a worker that sees the same id twice does
nothing the second time, so redelivery after a crash is harmless.

A command is signed by the planner's key (a keyring entry with role ``planner``): what is
signed is ``tagged(COMMAND_SIGNING_DOMAIN, command without "signature")``, every other field
including ``worker_id``, ``key_id`` and both timestamps. The domain differs from the
lifecycle one (``schemas.lifecycle.SIGNING_DOMAIN``), so a signature made for one kind of
message never verifies as the other. Workers verify before they fold
(``workers.command_trust``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from loraplane.schemas.base import Identifier, Sha256, StrictModel, Timestamp, Version
from loraplane.schemas.canonical import tagged
from loraplane.schemas.reasons import CommandRule

__all__ = [
    "COMMAND_ID_PATTERN",
    "COMMAND_SIGNING_DOMAIN",
    "CacheCommand",
    "CommandAction",
    "CommandReason",
]

COMMAND_SIGNING_DOMAIN = "loraplane.command.v1"


class CommandAction(StrEnum):
    prewarm_host = "prewarm_host"  # S3 -> verified host tier
    load_gpu = "load_gpu"  # host -> vLLM (implies prewarm_host when missing)
    pin = "pin"  # never evict while pinned (platinum, active canary)
    unpin = "unpin"
    demote_to_host = "demote_to_host"  # unload from vLLM, keep on host
    evict = "evict"  # unload from vLLM and delete from host


class CommandReason(StrictModel):
    rule: CommandRule = Field(description="which planner rule fired")
    score: float | None = Field(
        None,
        allow_inf_nan=False,
        description="finite: a command's signed bytes are canonical JSON, which has no NaN "
        "or infinity, so a command holding one could never be signed or verified",
    )
    detail: str = Field("", max_length=512)


COMMAND_ID_PATTERN = r"^[a-z0-9][a-z0-9._:@-]{0,199}$"


class CacheCommand(StrictModel):
    schema_version: Literal[1] = 1
    command_id: str = Field(pattern=COMMAND_ID_PATTERN)
    worker_id: Identifier
    action: CommandAction
    base_model: Identifier
    tenant_id: Identifier
    adapter_id: Identifier
    version: Version
    sha256: Sha256
    lora_name: str = Field(max_length=200)
    reason: CommandReason
    issued_at: Timestamp
    deadline: Timestamp
    warmup_requests: int = Field(
        0, ge=0, le=1000, description="shadow/golden-set requests to send after load"
    )
    key_id: str = Field("", max_length=200, description="the planner key that signed it")
    signature: str = Field("", max_length=128, description="base64 Ed25519 signature")

    def signed_bytes(self) -> bytes:
        return tagged(COMMAND_SIGNING_DOMAIN, self.model_dump(mode="json", exclude={"signature"}))
