"""The one admission of a request, at the fleet router and at a worker's gateway alike.

In order, each step refusing with its reason (``AdmissionRefusal``, a field's
``RequestRefusal``, a ``TenantLimit``): the tenant (an API key, or at a gateway a router's
signed forward: ``identify``, before the body is read) and the request class; with the body
(``admit``) the forward's signature, ``model`` wholly an adapter id, the fields and the
class's caps; the adapter known here and the tenant's own (one answer for both failures,
``NO_SUCH_ADAPTER``: no caller learns which ids other tenants have); the version, decided
once (at the first door ``version_choice.choose_version``; behind a router exactly the
version the router signed, or ``version_unknown`` / ``version_revoked``, never another); the
tenant's limits (``TenantGate``), which the caller leaves when the request is done.
docs/router.md, "How it picks", and docs/worker.md, "The gateway", give each step.

Pure: the keys, the versions and the clock are passed in; the HTTP side is
``frontdoor.http``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from loraplane.frontdoor.forwarded import Forward, Replays, Target, outdated, verify
from loraplane.frontdoor.request_fields import (
    Admitted,
    Endpoint,
    Refused,
    TenantGate,
    admit,
    request_caps,
)
from loraplane.frontdoor.version_choice import choose_version, serves
from loraplane.kernel.policy import RequestBudgets
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.base import is_id
from loraplane.schemas.reasons import AdmissionRefusal, RequestRefusal, TenantLimit
from loraplane.schemas.request_log import RequestClass
from loraplane.schemas.strict_json import unicode_text

__all__ = [
    "NO_SUCH_ADAPTER",
    "Admission",
    "Choice",
    "FrontDoor",
    "Grant",
    "Head",
    "Identity",
    "Keys",
    "Refusal",
    "VersionReason",
    "owned",
]

_CLASSES = {c.value: c for c in RequestClass}


class VersionReason(StrEnum):
    """Why a version serves a request (``X-Loraplane-Version-Reason``)."""

    active = "active"  # the adapter's active version
    canary = "canary"  # the canary, for its share of sessions or a canary-class request


Grant = tuple[str, frozenset[str] | None]
"""What a key allows: its tenant and the base models it is scoped to (None: every one)."""


class Keys(Protocol):
    """The grant of an ``Authorization`` header (``frontdoor.api_keys``): its key's tenant
    and the base models it is scoped to (None: every one); None when the key is unknown."""

    def grant(self, authorization: str | None) -> Grant | None: ...


@dataclass(frozen=True)
class Head:
    """What the front door reads before the body."""

    request_id: str
    authorization: str | None = None
    request_class: str | None = None  # X-Request-Class as sent; None: interactive
    session_key: str | None = None  # a header token, else None
    forward: Forward | None = None  # a router's forwarded headers
    signature: str | None = None  # X-Loraplane-Forwarded
    target: Target | None = None  # the method and request target as received (a forward's)
    repeated: str | None = None  # a header the door reads that was sent more than once


_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""Where a lone surrogate can come from in a UTF-8 body: a ``\\uD800``-``\\uDFFF`` escape,
or the surrogate's own UTF-8 bytes (``ED A0``-``ED BF``), which ``json.loads`` decodes with
``surrogatepass``. Only a body where one of these occurs (or one that is not UTF-8:
``json.loads`` takes UTF-16 and UTF-32 too) is walked whole."""


def _may_hold_surrogate(raw: bytes) -> bool:
    return (
        _MAY_HOLD_SURROGATE.search(raw) is not None
        or b"\x00" in raw[:4]  # UTF-16 or UTF-32, as json.detect_encoding tells them
        or raw[:2] in (b"\xff\xfe", b"\xfe\xff")
    )


def _unicode(body: object) -> bool:
    """Every string of a parsed body is Unicode text: no lone surrogate (a pair of escapes
    is one character after parsing, and encodes). The C encoder's pass, or for a body
    nested past what it walks (the parser takes one level more: its RecursionError was a
    500) the walk with its own stack."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    except RecursionError:
        return unicode_text(body)
    return True


@dataclass(frozen=True)
class Refusal:
    """An answer without a worker: ``status`` and ``reason`` (what ops see: the request log,
    the router's counts); ``shown``, when set, the reason the caller is told instead (see
    ``NO_SUCH_ADAPTER``); ``adapter_id`` once ``model`` was read (the gateway logs such a
    request); ``retry_after_s`` for a retryable one."""

    status: int
    reason: AdmissionRefusal | RequestRefusal | TenantLimit
    message: str
    param: str | None = None
    retry_after_s: int | None = None
    tenant_id: str | None = None
    request_class: RequestClass | None = None
    adapter_id: str | None = None
    shown: AdmissionRefusal | None = None

    @property
    def code(self) -> AdmissionRefusal | RequestRefusal | TenantLimit:
        """The reason the caller is told."""
        return self.reason if self.shown is None else self.shown


NO_SUCH_ADAPTER = (404, AdmissionRefusal.unknown_adapter)
"""The one answer (status, reason told) to a tenant naming an adapter it may not use because
it has none of that id: no version here at all, or another tenant's (any status, any
version a forward names). The two differ only in the reason ops see (``unknown_adapter``,
``forbidden``); the caller gets the same status, body and headers, so no key holder learns
which adapter ids other tenants have."""


def _no_such_adapter(model: str) -> str:
    return f"the adapter {model!r} does not exist or is not yours"


@dataclass(frozen=True)
class Identity:
    tenant_id: str
    request_class: RequestClass
    forward: Forward | None = None
    base_models: frozenset[str] | None = None  # the key's scope; None: every base model

    def may_use(self, base_model: str) -> bool:
        return self.base_models is None or base_model in self.base_models


@dataclass(frozen=True)
class Choice:
    """The version decision, made once: ``record`` serves; while it is a canary still warming
    up on the worker, ``stable`` (the active version) serves instead, if there is one."""

    record: AdapterRecord
    reason: VersionReason
    stable: AdapterRecord | None = None


@dataclass(frozen=True)
class Admission:
    tenant_id: str
    request_class: RequestClass
    adapter_id: str
    request: Admitted  # the body to forward and what it may cost
    choice: Choice
    versions: tuple[AdapterRecord, ...]  # every version of the adapter in this view
    forwarded: bool  # a router decided the version
    reroute: bool = False  # the router has another worker for it (forwarded.REROUTE_HEADER)


def owned(tenant: str, versions: Sequence[AdapterRecord]) -> bool:
    """Whether ``tenant`` owns the adapter of these versions (there is at least one and
    every one is the tenant's)."""
    return bool(versions) and all(r.tenant_id == tenant for r in versions)


class FrontDoor:
    """The admission rules of one door. ``versions`` maps an adapter id to its verified
    versions in this door's view (the router's registry, or the worker's); ``router_secret``
    (a gateway's) lets a router's signed forward stand in for an API key; ``budgets`` may be
    replaced while serving (a reload): the tenant gate follows it. ``worker_id`` is a
    gateway's own worker: a forward is believed only when signed for it, and once
    (``replays``)."""

    def __init__(
        self,
        *,
        keys: Keys,
        budgets: RequestBudgets,
        versions: Callable[[str], Sequence[AdapterRecord]],
        router_secret: bytes | None = None,
        worker_id: str | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.keys = keys
        self.budgets = budgets
        self.versions = versions
        self.router_secret = router_secret
        self.worker_id = worker_id
        self.replays = Replays()  # the forwards taken here, within their window
        self._clock = clock
        self._gate = TenantGate(budgets.tenants, clock)

    def gate(self) -> TenantGate:
        """The gate of the current budgets."""
        if self._gate.limits is not self.budgets.tenants:
            self._gate = TenantGate(self.budgets.tenants, self._clock)
        return self._gate

    def identify(self, head: Head) -> Identity | Refusal:
        """Step 1: the tenant and the class, before the body is read."""
        if head.repeated is not None:
            return Refusal(
                400,
                AdmissionRefusal.repeated_header,
                f"{head.repeated} was sent more than once",
                head.repeated,
            )
        if head.forward is not None:
            if self.router_secret is None:
                return Refusal(
                    401, AdmissionRefusal.unauthorized, "this gateway takes no forwarded requests"
                )
            tenant: str | None = head.forward.tenant
            class_name: str | None = head.forward.request_class
            scope: frozenset[str] | None = None  # the router applied the key's scope
        else:
            grant = self.keys.grant(head.authorization)
            tenant, scope = grant if grant is not None else (None, None)
            class_name = head.request_class
        if tenant is None:
            return Refusal(401, AdmissionRefusal.unauthorized, "missing or unknown API key")
        request_class = _CLASSES.get(class_name or RequestClass.interactive.value)
        if request_class is None:
            return Refusal(
                400,
                AdmissionRefusal.bad_request_class,
                "X-Request-Class must be interactive, batch, canary or shadow",
            )
        return Identity(tenant, request_class, head.forward, scope)

    def admit(
        self, identity: Identity, head: Head, endpoint: Endpoint, raw: bytes, now: float
    ) -> Admission | Refusal:
        """Steps 2 to 5 (``now``: epoch seconds, for a forward's signature). An
        ``Admission`` holds a place in the tenant gate: ``leave`` it when done."""
        tenant, request_class = identity.tenant_id, identity.request_class
        forward = identity.forward
        if forward is not None and (
            head.target is None
            or not verify(
                self.router_secret,
                forward,
                head.target,
                head.request_id,
                raw,
                head.signature,
                now,
                worker_id=self.worker_id,
            )
        ):
            if outdated(head.signature):  # a router older than this gateway
                return Refusal(
                    401,
                    AdmissionRefusal.forward_outdated,
                    "the router's signature is of an older form: "
                    "upgrade the router to this gateway's forward format",
                )
            return Refusal(
                401,
                AdmissionRefusal.unauthorized,
                "a forwarded request needs a valid router signature for this worker, "
                "method and path",
            )
        if forward is not None and not self.replays.first(head.signature or "", now):
            return Refusal(
                401,
                AdmissionRefusal.forward_replayed,
                "this forward was taken before: a router signs each forward once",
            )
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, too deep, a huge integer
            return Refusal(400, AdmissionRefusal.invalid_json, "the body is not JSON")
        if _may_hold_surrogate(raw) and not _unicode(body):
            return Refusal(
                400,
                AdmissionRefusal.invalid_json,
                "the body holds a string that is not Unicode text (a lone surrogate escape)",
            )
        model = body.get("model") if isinstance(body, dict) else None
        if not is_id(model):
            return Refusal(
                400,
                AdmissionRefusal.model_not_adapter_id,
                "model must be an adapter_id (lower-case id, never a path)",
            )

        def refuse(
            status: int,
            reason: AdmissionRefusal | RequestRefusal | TenantLimit,
            message: str,
            param: str | None = None,
            retry_after_s: int | None = None,
            shown: AdmissionRefusal | None = None,
        ) -> Refusal:
            return Refusal(
                status, reason, message, param, retry_after_s, tenant, request_class, model, shown
            )

        try:
            request = admit(endpoint, body, request_caps(self.budgets, request_class), len(raw))
        except Refused as exc:
            return refuse(exc.status, exc.reason, exc.message, exc.field or None)
        versions = tuple(self.versions(model))
        if not owned(tenant, versions):  # none, or another tenant's: one answer for both
            status, shown = NO_SUCH_ADAPTER
            ops_reason = (
                AdmissionRefusal.forbidden if versions else AdmissionRefusal.unknown_adapter
            )
            return refuse(status, ops_reason, _no_such_adapter(model), shown=shown)
        if not identity.may_use(versions[0].base_model):  # one base model per adapter
            return refuse(
                403,
                AdmissionRefusal.base_model_not_allowed,
                f"this API key is not for adapter {model!r}'s base model",
            )
        choice = (
            self._forwarded(forward, versions)
            if forward is not None
            else self._choose(versions, head.session_key or head.request_id, request_class)
        )
        if isinstance(choice, Refusal):
            return refuse(
                choice.status, choice.reason, choice.message, retry_after_s=choice.retry_after_s
            )
        limited = self.gate().enter(tenant)
        if limited is not None:
            reason, retry_after = limited
            return refuse(
                429,
                reason,
                f"tenant limit reached ({reason}); retry later",
                retry_after_s=retry_after,
            )
        return Admission(
            tenant,
            request_class,
            model,
            request,
            choice,
            versions,
            forwarded=forward is not None,
            reroute=forward is not None and forward.reroute,
        )

    def listed(self, identity: Identity, versions: Sequence[AdapterRecord]) -> bool:
        """Whether a tenant's model list shows this adapter: exactly when ``admit`` would
        get past ownership, the key's base models and a serving version for it."""
        return (
            owned(identity.tenant_id, versions)
            and identity.may_use(versions[0].base_model)
            and serves(list(versions))
        )

    def leave(self, admission: Admission, tokens: int) -> None:
        """The request is done: its place in the gate is free, ``tokens`` charged."""
        self.gate().leave(admission.tenant_id, tokens)

    @staticmethod
    def _choose(
        versions: Sequence[AdapterRecord], session_key: str, request_class: RequestClass
    ) -> Choice | Refusal:
        record = choose_version(
            list(versions), session_key=session_key, request_class=request_class
        )
        if record is None:
            return Refusal(
                404,
                AdmissionRefusal.no_serving_version,
                "the adapter has no active or canary version",
            )
        active = next((r for r in versions if r.status == AdapterStatus.active), None)
        reason = (
            VersionReason.canary if record.status == AdapterStatus.canary else VersionReason.active
        )
        return Choice(record, reason, active if record is not active else None)

    @staticmethod
    def _forwarded(forward: Forward, versions: Sequence[AdapterRecord]) -> Choice | Refusal:
        """Exactly the router's version, or a refusal that says why not."""
        by_version = {r.version: r for r in versions}
        record = by_version.get(forward.version)
        if record is None:
            return Refusal(
                503,
                AdmissionRefusal.version_unknown,
                f"version {forward.version!r} is not in this worker's registry yet; retry",
                retry_after_s=1,
            )
        if record.status == AdapterStatus.revoked:
            return Refusal(
                410, AdmissionRefusal.version_revoked, f"version {forward.version!r} was revoked"
            )
        try:
            reason = VersionReason(forward.reason)
        except ValueError:
            reason = VersionReason.active
        stable = by_version.get(forward.stable) if forward.stable else None
        if stable is not None and (stable.status == AdapterStatus.revoked or stable is record):
            stable = None
        return Choice(record, reason, stable)
