"""Keys, a keyring and signed lifecycle events for the registry's unit and integration tests."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from loraplane.lifecycle_events import signed_event, time_seq
from loraplane.schemas.adapter import (
    AdapterRecord,
    AdapterStatus,
    Compatibility,
    Priority,
    Release,
    expected_artifact_prefix,
)
from loraplane.schemas.base import version_key
from loraplane.schemas.keyring import KeyEntry, Keyring, KeyRole, Scopes, TenantPolicy
from loraplane.schemas.lifecycle import LifecycleAction, LifecycleEvent
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.signing import SigningKey

TENANT = "acme"
BASE = "tiny-llama"
CI_ACTIONS = ["publish", "canary", "promote", "rollback", "retire"]


@dataclass(frozen=True)
class Kit:
    keys: dict[str, SigningKey]
    keyring: Keyring

    def event(
        self,
        key: str,
        action: str,
        adapter_id: str,
        version: str,
        seq: int,
        now: datetime,
        **fields: Any,
    ) -> LifecycleEvent:
        fields.setdefault("tenant_id", TENANT)
        fields.setdefault("base_model", BASE)
        if action == "publish" and "record" not in fields:
            fields["record"] = record(
                adapter_id, version, fields["tenant_id"], fields["base_model"]
            )
        return signed_event(
            self.keys[key],
            LifecycleAction(action),
            adapter_id=adapter_id,
            version=version,
            seq=seq,
            now=now,
            **fields,
        )


def record(
    adapter_id: str, version: str, tenant: str = TENANT, base: str = BASE, rank: int = 8
) -> AdapterRecord:
    sha = hashlib.sha256(f"{adapter_id}@{version}".encode()).hexdigest()
    return AdapterRecord(
        adapter_id=adapter_id,
        base_model=base,
        version=version,
        rank=rank,
        artifact_uri=expected_artifact_prefix(
            "loraplane-artifacts", tenant, adapter_id, version, sha
        ),
        sha256=sha,
        size_bytes=1000,
        tenant_id=tenant,
        compatibility=Compatibility(target_modules=["q_proj", "v_proj"], max_lora_rank=rank),
    )


def make_kit(now: datetime, platinum: tuple[str, ...] = (TENANT,)) -> Kit:
    """ci: acme's CI (no revoke); ops: anything; beta: another tenant's CI; ci2: acme's
    rotated key; revoked / expired / future: keys that must not be trusted at ``now``;
    planner: the planner's command key (role planner: signs cache commands, never events).
    ``platinum``: the tenants whose ceiling is platinum (the others': gold)."""
    day = timedelta(days=1)
    specs = {  # name: (publisher, tenants, actions, not_before, not_after, revoked)
        "ci": ("ci-acme", [TENANT], CI_ACTIONS, now - day, now + 30 * day, False),
        "ci2": ("ci-acme", [TENANT], CI_ACTIONS, now - day, now + 60 * day, False),
        "ops": ("ops", "*", "*", now - day, now + 30 * day, False),
        "beta": ("ci-beta", ["beta"], "*", now - day, now + 30 * day, False),
        "revoked": ("ci-acme", [TENANT], "*", now - day, now + 30 * day, True),
        "expired": ("ci-acme", [TENANT], "*", now - 30 * day, now - day, False),
        "future": ("ci-acme", [TENANT], "*", now + day, now + 30 * day, False),
        "planner": ("planner", "*", "*", now - day, now + 30 * day, False),
    }
    keys: dict[str, SigningKey] = {}
    entries = []
    for name, (publisher, tenants, actions, nb, na, revoked) in specs.items():
        key = SigningKey.generate(publisher, f"{publisher}-{name}")
        keys[name] = key
        entries.append(
            KeyEntry(
                key_id=key.key_id,
                publisher=publisher,
                public_key=key.public_key_b64,
                not_before=nb,
                not_after=na,
                revoked=revoked,
                scopes=Scopes(tenants=tenants, actions=actions),
                role=KeyRole.planner if name == "planner" else KeyRole.publisher,
            )
        )
    return Kit(
        keys,
        Keyring(
            keys=entries,
            tenants={t: TenantPolicy(max_priority=Priority.platinum) for t in platinum},
        ),
    )


def signed_view(
    key: SigningKey, records: list[AdapterRecord], now: datetime, keyring: Keyring
) -> AdapterView:
    """The registry's view of one adapter whose versions end in ``records``' statuses, made
    the only way a worker accepts one: signed events folded by ``registry.fold`` (its
    evidence is those events). Publish every version, then canary / promote / retire /
    revoke to reach each status."""
    from loraplane.registry.fold import Accepted, AdapterState, evaluate

    ordered = sorted(records, key=lambda r: version_key(r.version))
    seq = time_seq()
    state: AdapterState | None = None
    count = 0

    def add(action: LifecycleAction, r: AdapterRecord, **fields: Any) -> None:
        nonlocal state, count
        event = signed_event(
            key,
            action,
            adapter_id=r.adapter_id,
            tenant_id=r.tenant_id,
            base_model=r.base_model,
            version=r.version,
            seq=seq + count,
            now=now,
            **fields,
        )
        count += 1
        decision = evaluate(event, keyring, lambda _a: state, now)
        assert isinstance(decision, Accepted), decision
        state = decision.state

    def status(r: AdapterRecord) -> AdapterStatus | None:
        found = state.view.version(r.version) if state else None
        return found.status if found else None

    for r in ordered:
        add(
            LifecycleAction.publish,
            r,
            record=r.model_copy(update={"status": AdapterStatus.published, "release": Release()}),
        )
    for r in ordered:
        if r.status is AdapterStatus.canary:
            add(LifecycleAction.canary, r, canary_percent=r.release.canary_percent)
        elif r.status in (AdapterStatus.active, AdapterStatus.retired):
            add(LifecycleAction.promote, r)
    for r in ordered:
        if r.status is AdapterStatus.retired and status(r) is not AdapterStatus.retired:
            add(LifecycleAction.retire, r)
        elif r.status is AdapterStatus.revoked:
            add(LifecycleAction.revoke, r)
    assert state is not None
    return state.view


def extended_view(
    key: SigningKey,
    view: AdapterView,
    action: LifecycleAction,
    version: str,
    keyring: Keyring,
    now: datetime,
    **fields: Any,
) -> AdapterView:
    """``view`` with one more signed event (a revoke, say) folded on top of its evidence:
    the only kind of newer view a worker that accepted ``view`` takes (its history must
    extend the one accepted before)."""
    from loraplane.registry.fold import Accepted, AdapterState, evaluate

    state: AdapterState | None = None

    def current(_adapter_id: str) -> AdapterState | None:
        return state

    for event in view.evidence:
        decision = evaluate(event, keyring, current, event.issued_at)
        assert isinstance(decision, Accepted), decision
        state = decision.state
    event = signed_event(
        key,
        action,
        adapter_id=view.adapter_id,
        tenant_id=view.tenant_id,
        base_model=view.base_model,
        version=version,
        seq=max(view.last_seq + 1, time_seq()),
        now=now,
        **fields,
    )
    decision = evaluate(event, keyring, current, now)
    assert isinstance(decision, Accepted), decision
    return decision.state.view
