"""Attack tests: a planner key scoped to one tenant moves no copy of another tenant.

``check_command`` checks the key's ``tenants`` scope against the command's own
``tenant_id``; the copy it moves is named by ``lora_name``. A key scoped to ``t1`` can
therefore sign a command that says ``tenant_id: t1`` and names ``t2``'s copy: the worker
must compare that tenant with the tenant of the copy (its intent, its registry record),
whatever the action.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Compatibility
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.reasons import CommandRule, IntentRefusal
from loraplane.workers.reconcile import (
    ActualState,
    Ask,
    CommandSkip,
    DesiredState,
    Fetch,
    HostEntry,
    Load,
    LoadBudget,
    Refuse,
    RemoveHost,
    Unload,
    adopt,
    apply_command,
    ask,
    reconcile,
    registry_by_name,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
BASE = "tiny-llama"
WORKER = "w1"


def record(adapter: str, tenant: str) -> AdapterRecord:
    sha = adapter.encode().hex().ljust(64, "0")[:64]
    return AdapterRecord(
        adapter_id=adapter,
        base_model=BASE,
        version="1",
        rank=8,
        artifact_uri=f"s3://loraplane-artifacts/{tenant}/{adapter}/1-{sha[:8]}/",
        sha256=sha,
        size_bytes=1000,
        status=AdapterStatus.active,
        tenant_id=tenant,
        compatibility=Compatibility(target_modules=["q_proj"], max_lora_rank=8),
    )


VICTIM = record("victim", "t2")
REGISTRY = registry_by_name([VICTIM])


def forged(action: CommandAction, cid: str = "c1") -> CacheCommand:
    """What a planner key scoped to tenant t1 can sign: t1 as the tenant, t2's copy."""
    return CacheCommand(
        command_id=cid,
        worker_id=WORKER,
        action=action,
        base_model=BASE,
        tenant_id="t1",
        adapter_id=VICTIM.adapter_id,
        version=VICTIM.version,
        sha256=VICTIM.sha256,
        lora_name=VICTIM.lora_name,
        reason=CommandReason(rule=CommandRule.hot_score),
        issued_at=NOW,
        deadline=NOW + timedelta(minutes=1),
    )


def on_gpu() -> ActualState:
    name = VICTIM.lora_name
    return ActualState(
        gpu={name: "/h/victim"},
        host={name: HostEntry(name, "/h/victim", VICTIM.sha256)},
        loaded_by_agent={name: "/h/victim"},
    )


def on_host() -> ActualState:
    name = VICTIM.lora_name
    return ActualState(gpu={}, host={name: HostEntry(name, "/h/victim", VICTIM.sha256)})


def run(desired: DesiredState, actual: ActualState) -> list:
    return reconcile(desired, actual, REGISTRY, base_model=BASE, budget=LoadBudget(6), now=100.0)


def moved(actions: list) -> list:
    return [a for a in actions if isinstance(a, Unload | RemoveHost | Load | Fetch)]


@pytest.mark.parametrize("action", list(CommandAction))
@pytest.mark.parametrize("actual", [on_gpu(), on_host()], ids=["gpu", "host"])
def test_a_command_naming_another_tenants_held_copy_is_skipped(
    action: CommandAction, actual: ActualState
) -> None:
    """The copy has an intent of its tenant (adopted at start, or a request's load)."""
    desired = adopt(actual, REGISTRY)
    after, skipped = apply_command(
        desired, forged(action), worker_id=WORKER, base_model=BASE, now=NOW
    )
    assert skipped is CommandSkip.tenant_mismatch
    assert after.intents == desired.intents
    assert moved(run(after, actual)) == []


@pytest.mark.parametrize("action", list(CommandAction))
@pytest.mark.parametrize("actual", [on_gpu(), on_host()], ids=["gpu", "host"])
def test_an_intent_of_another_tenant_than_its_record_moves_nothing(
    action: CommandAction, actual: ActualState
) -> None:
    """No intent holds the copy yet: the command's intent carries t1, its record says t2,
    so reconcile refuses it instead of evicting, demoting, pinning or loading t2's copy."""
    after, _ = apply_command(
        DesiredState(), forged(action), worker_id=WORKER, base_model=BASE, now=NOW
    )
    actions = run(after, actual)
    assert moved(actions) == []
    if VICTIM.lora_name in after.intents:
        assert Refuse(VICTIM.lora_name, IntentRefusal.tenant_mismatch, "c1") in actions


def test_a_request_of_the_copys_own_tenant_still_moves_it() -> None:
    desired = adopt(on_host(), REGISTRY)
    after, skipped = apply_command(
        desired,
        forged(CommandAction.load_gpu).model_copy(update={"tenant_id": "t2"}),
        worker_id=WORKER,
        base_model=BASE,
        now=NOW,
    )
    assert skipped is None
    assert [type(a) for a in moved(run(after, on_host()))] == [Load]


def test_a_gateway_ask_of_the_records_tenant_is_not_refused() -> None:
    desired = adopt(on_gpu(), REGISTRY)
    after, skipped = ask(desired, Ask.gateway_load(VICTIM))
    assert skipped is CommandSkip.already_desired
    assert after.intents == desired.intents
