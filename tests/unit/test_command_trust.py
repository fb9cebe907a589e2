"""ATTACK tests of the worker's command trust boundary (workers.command_trust) and of the
worker's own never-evict and warm-up rules (workers.reconcile.Guard): a command written
straight into the commands topic is folded only when the planner's key signed exactly it,
for this worker, recently; even then it cannot unprotect a never-evict copy or drive more
golden-set requests than the policy allows."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.kernel.command_effects import never_evict_rule
from loraplane.kernel.policy import Policy
from loraplane.schemas.adapter import AdapterStatus, Priority, Release
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.keyring import KeyEntry, Keyring, KeyRole, Scopes
from loraplane.schemas.reasons import CommandRejection as R
from loraplane.schemas.reasons import CommandRule, RegistryRejection
from loraplane.schemas.signing import SigningKey, verify
from loraplane.workers.command_trust import check_command
from loraplane.workers.reconcile import (
    ActualState,
    Change,
    CommandSkip,
    DesiredState,
    Guard,
    GuardChanged,
    HostEntry,
    Intent,
    LoadBudget,
    reconcile,
    registry_by_name,
)
from loraplane.workers.reconcile import fold as reduce
from tests.lifecycle_kit import make_kit
from tests.lifecycle_kit import record as kit_record

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
WORKER = "w1"
BASE = "tiny-llama"
POLICY = Policy(max_protected_gpu_share=0.5)  # the seed's share: half the slots protected
KIT = make_kit(NOW)
PLANNER = KIT.keys["planner"]
CI = KIT.keys["ci"]


def entry(key: SigningKey, **kw: object) -> KeyEntry:
    fields: dict[str, object] = dict(
        key_id=key.key_id,
        publisher=key.publisher,
        public_key=key.public_key_b64,
        not_before=NOW - timedelta(days=1),
        not_after=NOW + timedelta(days=1),
        scopes=Scopes(tenants="*", actions="*"),
        role=KeyRole.planner,
    )
    fields.update(kw)
    return KeyEntry.model_validate(fields)


def rec(
    adapter: str = "a1",
    priority: Priority = Priority.silver,
    status: AdapterStatus = AdapterStatus.active,
    canary: float = 0.0,
):
    r = kit_record(adapter, "1")
    return r.model_copy(
        update={"priority": priority, "status": status, "release": Release(canary_percent=canary)}
    )


def command(
    action: CommandAction = CommandAction.load_gpu,
    *,
    r=None,
    cid: str = "c1",
    worker: str = WORKER,
    issued: datetime = NOW,
    life_s: float = 60.0,
    warmup: int = 0,
) -> CacheCommand:
    r = r or rec()
    return CacheCommand(
        command_id=cid,
        worker_id=worker,
        action=action,
        base_model=BASE,
        tenant_id=r.tenant_id,
        adapter_id=r.adapter_id,
        version=r.version,
        sha256=r.sha256,
        lora_name=r.lora_name,
        reason=CommandReason(rule=CommandRule.hot_score),
        issued_at=issued,
        deadline=issued + timedelta(seconds=life_s),
        warmup_requests=warmup,
    )


def check(
    cmd: CacheCommand,
    keyring: Keyring | None = KIT.keyring,
    *,
    key: bytes | None = WORKER.encode(),
    now: datetime = NOW,
) -> R | None:
    got = check_command(
        cmd,
        keyring,
        worker_id=WORKER,
        kafka_key=key,
        now=now,
        max_lifetime_s=POLICY.command_deadline_s,
    )
    return None if got is None else got.reason


def test_a_planner_signed_command_for_this_worker_is_accepted() -> None:
    assert check(PLANNER.sign_command(command())) is None


def test_an_unsigned_command_is_refused() -> None:
    assert check(command()) is R.unsigned


def test_a_command_signed_with_a_ci_key_is_refused_as_the_wrong_role() -> None:
    assert check(CI.sign_command(command())) is R.key_role_mismatch


def test_a_command_signed_with_an_unknown_key_is_refused() -> None:
    stranger = SigningKey.generate("planner", "planner-stranger")
    assert check(stranger.sign_command(command())) is R.unknown_key


def test_a_key_claiming_a_trusted_key_id_does_not_verify() -> None:
    impostor = SigningKey(
        PLANNER.publisher, PLANNER.key_id, SigningKey.generate("x", "x").private_key
    )
    assert check(impostor.sign_command(command())) is R.bad_signature


def test_revoked_expired_and_future_planner_keys_are_refused() -> None:
    for kw, reason in [
        ({"revoked": True}, R.key_revoked),
        (
            {"not_before": NOW - timedelta(days=9), "not_after": NOW - timedelta(days=1)},
            R.key_expired,
        ),
        (
            {"not_before": NOW + timedelta(days=1), "not_after": NOW + timedelta(days=9)},
            R.key_not_yet_valid,
        ),
    ]:
        ring = Keyring(keys=[entry(PLANNER, **kw)])
        assert check(PLANNER.sign_command(command()), ring) is reason


def test_a_missing_keyring_refuses_everything() -> None:
    assert check(PLANNER.sign_command(command()), None) is R.keyring_unavailable


def test_a_planner_key_scoped_to_other_tenants_cannot_command_this_one() -> None:
    ring = Keyring(keys=[entry(PLANNER, scopes=Scopes(tenants=["beta"], actions="*"))])
    assert check(PLANNER.sign_command(command()), ring) is R.tenant_out_of_scope


def test_a_signed_command_replayed_to_another_worker_is_refused() -> None:
    theirs = PLANNER.sign_command(command(worker="w2"))
    assert check(theirs) is R.wrong_worker  # written under our key
    assert check(PLANNER.sign_command(command()), key=b"w2") is R.wrong_worker


@pytest.mark.parametrize(
    "field,value",
    [
        ("action", CommandAction.evict),
        ("worker_id", "w1x"),
        ("warmup_requests", 1000),
        ("deadline", NOW + timedelta(seconds=59)),
        ("command_id", "c2"),
        ("key_id", "ci-acme-ci"),
    ],
)
def test_any_field_edited_after_signing_breaks_the_signature(field: str, value: object) -> None:
    signed = PLANNER.sign_command(command())
    edited = signed.model_copy(update={field: value})
    assert check(edited, key=edited.worker_id.encode()) in (
        R.bad_signature,
        R.unknown_key,
        R.wrong_worker,
        R.key_role_mismatch,
    )
    assert not verify(edited, PLANNER.private_key.public_key())


def test_stale_future_and_long_lived_commands_are_refused() -> None:
    old = PLANNER.sign_command(command(issued=NOW - timedelta(minutes=5)))
    assert check(old) is R.command_expired
    ahead = PLANNER.sign_command(command(issued=NOW + timedelta(minutes=5)))
    assert check(ahead) is R.command_from_future
    forever = PLANNER.sign_command(command(life_s=7 * 86_400))
    assert check(forever) is R.command_lifetime_too_long


def test_a_lifecycle_signature_never_verifies_as_a_command_signature() -> None:
    """Same key, same bytes but the domain tag: no cross-protocol replay either way."""
    event = KIT.event("planner", "promote", "a1", "1", 1, NOW)
    cmd = command().model_copy(update={"key_id": PLANNER.key_id, "signature": event.signature})
    assert check(cmd) is R.bad_signature
    signed = PLANNER.sign_command(command())
    assert event.model_copy(update={"signature": signed.signature}).signature
    assert not verify(
        event.model_copy(update={"signature": signed.signature}), PLANNER.private_key.public_key()
    )


def test_the_registry_refuses_an_event_signed_by_the_planner_key() -> None:
    from loraplane.registry.fold import evaluate

    event = KIT.event("planner", "publish", "a1", "1", 1, NOW)
    decision = evaluate(event, KIT.keyring, {}.get, NOW)
    assert getattr(decision, "reason", None) == RegistryRejection.key_role_mismatch


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=90), st.text(max_size=40))
def test_garbage_signatures_and_key_ids_are_refused_never_raise(raw: bytes, kid: str) -> None:
    cmd = command().model_copy(update={"signature": base64.b64encode(raw).decode(), "key_id": kid})
    assert check(cmd) in (R.unsigned, R.unknown_key, R.bad_signature, R.key_role_mismatch)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(list(CommandAction)), st.integers(0, 1000), st.sampled_from(["w1", "w2"]))
def test_only_the_exact_signed_command_for_this_worker_passes(
    action: CommandAction, warmup: int, worker: str
) -> None:
    signed = PLANNER.sign_command(command(action, worker=worker, warmup=warmup))
    assert (check(signed) is None) == (worker == WORKER)


# ---- the worker's own rules: never-evict derived, warm-up clamped -------------------------

PLATINUM = rec("plat", Priority.platinum)
CANARY = rec("can", status=AdapterStatus.canary, canary=10.0)
DARK_CANARY = rec("dark", status=AdapterStatus.canary, canary=0.0)
PLAIN = rec("plain")
REVOKED_PLATINUM = rec("gone", Priority.platinum, AdapterStatus.revoked)
REGISTRY = registry_by_name([PLATINUM, CANARY, DARK_CANARY, PLAIN, REVOKED_PLATINUM])
GUARD = Guard.of(REGISTRY, POLICY, gpu_slots=4)  # protected_cap 0.5 x 4 = 2


def test_the_guard_derives_never_evict_from_the_registry_and_the_policy() -> None:
    assert set(GUARD.never_evict) == {PLATINUM.lora_name, CANARY.lora_name}
    assert GUARD.never_evict[PLATINUM.lora_name] == 'tenant_priority == "platinum"'
    assert GUARD.max_protected == 2
    assert never_evict_rule(REVOKED_PLATINUM, POLICY.never_evict) is None
    nobody = Policy(never_evict_when=[])
    assert Guard.of(REGISTRY, nobody, 4).never_evict == {}


def fold(state: DesiredState, change: Change, guard: Guard = GUARD):
    return reduce(state, change, worker_id=WORKER, base_model=BASE, now=NOW, guard=guard)


def on_gpu(*records, guard: Guard = GUARD) -> DesiredState:
    """``records`` meant for the GPU, in this order, protection decided by ``guard``."""
    state = DesiredState(
        {
            r.lora_name: Intent(r.lora_name, r.adapter_id, r.version, r.tenant_id, "gpu", False)
            for r in records
        }
    )
    return fold(state, GuardChanged(), guard)[0]


@pytest.mark.parametrize("r", [PLATINUM, CANARY])
@pytest.mark.parametrize(
    "action", [CommandAction.unpin, CommandAction.demote_to_host, CommandAction.evict]
)
def test_no_signed_command_unprotects_a_never_evict_copy(r, action) -> None:
    """The forged unpin+evict of a platinum copy: even correctly signed, refused."""
    state = on_gpu(r)
    assert state.protected == {r.lora_name}
    after, why = fold(state, command(action, r=r))
    assert why is CommandSkip.protected
    assert after.intents == state.intents
    gpu = {r.lora_name: f"/host/{r.lora_name}"}
    actual = ActualState(
        gpu=gpu,
        loaded_by_agent=gpu,
        host={r.lora_name: HostEntry(r.lora_name, gpu[r.lora_name], r.sha256)},
    )
    assert reconcile(after, actual, REGISTRY, base_model=BASE, budget=LoadBudget(6), now=0.0) == []


def test_unpin_then_evict_of_a_platinum_copy_leaves_it_on_the_gpu() -> None:
    state, why1 = fold(on_gpu(PLATINUM), command(CommandAction.unpin, r=PLATINUM, cid="u"))
    state, why2 = fold(state, command(CommandAction.evict, r=PLATINUM, cid="e"))
    assert (why1, why2) == (CommandSkip.protected, CommandSkip.protected)
    assert state.intents[PLATINUM.lora_name].tier == "gpu"


def test_a_copy_loaded_by_command_is_protected_from_the_next_one() -> None:
    state, _ = fold(DesiredState(), command(CommandAction.load_gpu, r=PLATINUM, cid="l"))
    assert state.protected == {PLATINUM.lora_name}
    _, why = fold(state, command(CommandAction.evict, r=PLATINUM, cid="e"))
    assert why is CommandSkip.protected


def platinum(n: int) -> list:
    return [rec(f"p{i}", Priority.platinum) for i in range(n)]


def test_at_most_the_cap_is_protected_the_first_to_reach_the_gpu_keep_it() -> None:
    """No tenant's keys can fill a worker with immovable copies: 5 platinum versions on a
    4-slot worker (cap 2) leave 3 that commands still move."""
    recs = platinum(5)
    guard = Guard.of(registry_by_name(recs), POLICY, gpu_slots=4)
    state = on_gpu(*recs, guard=guard)
    assert state.protected == {recs[0].lora_name, recs[1].lora_name}
    for r in recs[2:]:
        assert fold(state, command(CommandAction.evict, r=r, cid=r.adapter_id), guard)[1] is None
    # a newly published platinum version does not take the guarantee from one that holds it
    newer = rec("p-new", Priority.platinum)
    guard2 = Guard.of(registry_by_name([newer, *recs]), POLICY, gpu_slots=4)
    state, _ = fold(state, command(CommandAction.load_gpu, r=newer, cid="new"), guard2)
    assert state.protected == {recs[0].lora_name, recs[1].lora_name}


def test_protection_lapses_when_the_registry_no_longer_makes_it_never_evict() -> None:
    state = on_gpu(CANARY)
    ended = CANARY.model_copy(update={"status": AdapterStatus.active})  # promoted
    guard = Guard.of(registry_by_name([ended]), POLICY, gpu_slots=4)
    state, _ = fold(state, GuardChanged(), guard)
    assert state.protected == frozenset()
    assert fold(state, command(CommandAction.evict, r=CANARY), guard)[1] is None
    # and the freed guarantee goes to the next never-evict copy meant for the GPU
    guard = Guard.of(registry_by_name([ended, PLATINUM]), POLICY, gpu_slots=2)  # cap 1
    state = on_gpu(CANARY, PLATINUM, guard=Guard.of(REGISTRY, POLICY, gpu_slots=2))
    assert state.protected == {CANARY.lora_name}
    state, _ = fold(state, GuardChanged(), guard)
    assert state.protected == {PLATINUM.lora_name}


@pytest.mark.parametrize("r", [PLAIN, DARK_CANARY])
def test_unprotected_copies_still_follow_commands(r) -> None:
    _, why = fold(on_gpu(r), command(CommandAction.evict, r=r))
    assert why is None


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 1000), st.integers(0, 1000))
def test_warmup_requests_never_exceed_the_policy(asked: int, cap: int) -> None:
    guard = Guard({}, 0, cap)
    state, _ = fold(DesiredState(), command(CommandAction.load_gpu, r=CANARY, warmup=asked), guard)
    assert state.intents[CANARY.lora_name].warmup_requests == min(asked, cap)


def test_a_forged_thousand_request_warmup_is_clamped_to_the_policy() -> None:
    state, _ = fold(DesiredState(), command(CommandAction.load_gpu, r=CANARY, warmup=1000))
    assert (
        state.intents[CANARY.lora_name].warmup_requests
        == POLICY.request_budgets.canary.warmup_requests
        == 3
    )


def test_the_shared_signer_check_speaks_both_callers_reasons() -> None:
    """``Keyring.signer`` is the one key check of events and commands; each caller turns its
    problem into its own reason by value, so each enum must hold every value it can get."""
    from loraplane.schemas.reasons import SignerProblem

    values = {p.value for p in SignerProblem}
    assert values <= {r.value for r in RegistryRejection}
    # commands name no publisher, so key_publisher_mismatch never reaches the worker
    assert values - {"key_publisher_mismatch"} <= {r.value for r in R}


@pytest.mark.parametrize("score", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_attack_a_command_with_a_non_finite_score_is_invalid_at_decode(score: str) -> None:
    """No planner can sign a non-finite score (canonical JSON has none), so the worker's
    decoder refuses it as ``invalid``, the reason the dead letter then names."""
    from loraplane.schemas.codec import SchemaError, decode, encode

    raw = encode(PLANNER.sign_command(command())).replace(
        b'"score":null', f'"score":{score}'.encode()
    )
    assert f'"score":{score}'.encode() in raw
    with pytest.raises(SchemaError) as err:
        decode(CacheCommand, raw)
    assert err.value.reason == "invalid"
