"""Is this cache command the planner's, for this worker, and fresh? Decided by the worker,
where the command is used, before it is folded into the desired state (pure: no I/O).

Anyone who can write to the commands topic can put bytes there, so a decoded command is
trusted only when it is for this worker (the Kafka key and ``worker_id`` both name it),
signed by a ``planner`` key of the keyring that is valid now and whose tenants scope covers
the command (a CI key cannot sign commands; the signature's domain keeps a lifecycle
signature from verifying), and fresh (not from the future, a bounded lifetime, its deadline
not passed, its id not applied before). The checks run in a fixed order and the first
failure is the reason (``schemas.reasons.CommandRejection``): docs/worker.md, "Authenticated
commands", lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.keyring import Keyring, KeyRole, SignerRefusal, signer
from loraplane.schemas.reasons import CommandRejection as Reason

__all__ = ["CLOCK_SKEW_S", "Rejected", "check_command"]

CLOCK_SKEW_S = 30.0
"""How far the planner's clock may run ahead of a worker's."""


@dataclass(frozen=True)
class Rejected:
    reason: Reason
    detail: str


def check_command(
    cmd: CacheCommand,
    keyring: Keyring | None,
    *,
    worker_id: str,
    kafka_key: bytes | None,
    now: datetime,
    max_lifetime_s: float,
    skew_s: float = CLOCK_SKEW_S,
) -> Rejected | None:
    """None when ``cmd`` may be folded; else why not."""
    if kafka_key != worker_id.encode() or cmd.worker_id != worker_id:
        return Rejected(
            Reason.wrong_worker,
            f"command for {cmd.worker_id!r} (key {kafka_key!r}), this is {worker_id!r}",
        )
    if not cmd.signature or not cmd.key_id:
        return Rejected(Reason.unsigned, "command carries no signature")
    entry = signer(keyring, cmd, KeyRole.planner, now)
    if isinstance(entry, SignerRefusal):
        return Rejected(Reason(entry.problem.value), entry.detail)
    if not entry.scopes.allows_tenant(cmd.tenant_id):
        return Rejected(
            Reason.tenant_out_of_scope, f"key {entry.key_id} may not command tenant {cmd.tenant_id}"
        )
    skew = timedelta(seconds=skew_s)
    if cmd.issued_at > now + skew:
        return Rejected(Reason.command_from_future, f"issued_at {cmd.issued_at} is ahead of {now}")
    if cmd.deadline - cmd.issued_at > timedelta(seconds=max_lifetime_s) + skew:
        return Rejected(
            Reason.command_lifetime_too_long,
            f"deadline {cmd.deadline} is more than {max_lifetime_s:.0f}s after "
            f"issued_at {cmd.issued_at}",
        )
    if cmd.deadline < now:
        return Rejected(Reason.command_expired, f"deadline {cmd.deadline} has passed")
    return None
