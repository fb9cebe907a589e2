"""What a fleet router forwards to a worker gateway, signed so no one else can claim it: the
tenant, the request class and the version the router chose, for one worker, method and
target.

The gateway believes the forwarded headers only under a valid ``X-Loraplane-Forwarded:
v3.<ts>.<nonce>.<hex HMAC-SHA256>`` keyed with the router secret over the destination
worker's id (checked against the gateway's own), the method and request target as its
request line carries them, the tenant, request id, ``ts``, nonce, body digest, class,
versions, ``X-Session-Key`` or its absence, and ``REROUTE_HEADER`` (``_mac``): a captured
forward serves on no other worker's gateway (one secret for the fleet), endpoint, method,
query, body, class, version or session, only while ``ts`` is within ``MAX_SKEW_S`` of the
gateway's clock, and once (``Replays``). A header that is no id or token, or a signature
not of that form, is refused before any HMAC; the older forms ``v2.digits.hex`` and
``digits.hex`` are told apart (``outdated``). docs/router.md, "The forwarded tenant and
version". Pure: the secret, the nonce and the time are passed in.

Back the other way, for the router alone: ``NOT_RUN_HEADER`` on a gateway's 503 whose request
never reached vLLM; a 424 (``PERMANENT_STATUS``) says whose refusal it is
(``refused_by_worker``) and how long it holds (``HOLD_HEADER``); a 401 (``UNSIGNED_STATUS``)
refuses the router's own forward."""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from dataclasses import dataclass

from loraplane.frontdoor.request_fields import header_token
from loraplane.schemas.base import is_id
from loraplane.schemas.reasons import ServingRefusal
from loraplane.schemas.strict_json import StrictJsonError, strict_loads

__all__ = [
    "HOLD_HEADER",
    "MAX_REFUSAL_HOLD_S",
    "MAX_SKEW_S",
    "NOT_RUN_HEADER",
    "PERMANENT_STATUS",
    "REFUSAL_ANSWER_BYTES",
    "REROUTE_HEADER",
    "SESSION_HEADER",
    "SIGNATURE_HEADER",
    "STABLE_VERSION_HEADER",
    "TENANT_HEADER",
    "UNSIGNED_STATUS",
    "VERSION_HEADER",
    "VERSION_REASON_HEADER",
    "Forward",
    "Replays",
    "Target",
    "headers",
    "outdated",
    "refusal_hold",
    "refusal_type",
    "refused_by_worker",
    "sign",
    "verify",
]

TENANT_HEADER = "X-Loraplane-Tenant"
SIGNATURE_HEADER = "X-Loraplane-Forwarded"
VERSION_HEADER = "X-Loraplane-Version"  # the version to serve
VERSION_REASON_HEADER = "X-Loraplane-Version-Reason"  # why: active, or its canary share
STABLE_VERSION_HEADER = "X-Loraplane-Stable-Version"  # the active one, while a canary warms
SESSION_HEADER = "X-Session-Key"  # the client's, as the router read it (a header token)
REROUTE_HEADER = "X-Loraplane-Reroute"
"""``1`` when the router has another worker to send an interactive request to if this one
refuses the version as its own (``refused_by_worker``): the gateway then answers that
refusal (its 424) instead of the base fallback, so the tenant gets its adapter from another
worker; absent on the last worker the router tries, which falls back as without a router
(the refusing worker asked again, when the other did not serve it)."""
NOT_RUN_HEADER = "X-Loraplane-Not-Run"
"""On a gateway's 503, back to the router: its vLLM could not be reached, so the request never
reached vLLM (the header's value is the reason). A router parks that worker and sends the
request to another, at most once per request (``router.server``), so a gateway that sends it
on every answer costs a request one more try, never a loop."""
PERMANENT_STATUS = 424
"""A gateway's answer for a version it cannot load, retrying will not help (Failed
Dependency). Its ``error.type`` says whose refusal it is: ``adapter_unavailable_permanent``,
the artifact's (gone from the store, hostile, ...: every worker refuses it alike), or
``adapter_refused_by_worker``, that worker's own (its vLLM's loader, its ``max_lora_rank``,
its host-tier budget), which another worker may load: a router sends the request there
(``refused_by_worker``), within its one re-route of a request, and passes the 424 on only
when no other worker serves it."""
HOLD_HEADER = "X-Loraplane-Refusal-Hold"
"""On a gateway's 424 of its worker's own refusal (``refused_by_worker``): the whole seconds
its worker still holds that refusal (``WorkerConfig.refusal_hold_s`` from the refusal),
within which it answers the version's requests with that 424 at once. A router remembers
the refusal that long (``refusal_hold``), at most ``MAX_REFUSAL_HOLD_S``."""
MAX_REFUSAL_HOLD_S = 300
"""The longest a router takes a gateway's word (``HOLD_HEADER``) for: a longer hold is
remembered this long, so no gateway's bytes keep its worker passed over for hours."""
_HOLD = re.compile(r"[0-9]{1,9}")
REFUSAL_ANSWER_BYTES = 64 * 1024
"""A refusal whose reason the router reads (a 424, a 401) is at most this long (the
gateway's is ~300 bytes)."""
UNSIGNED_STATUS = 401
"""A gateway's answer to a forward it does not take (``unauthorized``: its signature does
not verify there, a secret rotated on one side; ``forward_outdated``: a router of an older
form; ``forward_replayed``): always a refusal of the router's own forward, never of the
tenant, whose key the router checked. A router never passes it on: it sends the request
to another worker, or answers ``RouterRefusal.forward_refused`` itself."""
MAX_SKEW_S = 30
_FORM = "v3"  # the signature's form: what its HMAC covers (the worker and session included)
_SIGNATURE = re.compile(_FORM + r"\.([0-9]{1,12})\.([0-9a-f]{16,32})\.([0-9a-f]{64})")
"""``v3.ts.nonce.hex``: the nonce is the router's, one per forward it signs, so no two
forwards share a signature (the same request sent again within one second included)."""
_OUTDATED = re.compile(r"(?:v2\.)?[0-9]{1,12}\.[0-9a-f]{64}")
"""The older forms: ``v2.ts.hex``, whose HMAC covered neither the destination worker nor the
session key, and ``ts.hex``, which covered neither the method nor the target either."""
_METHOD = re.compile(r"[A-Z]{1,16}")
_TARGET = re.compile(r"/[\x21-\x7e]{0,2047}")
"""A request target as the router sends it and the gateway reads it: origin-form, visible
ASCII (what is signed is never a byte the request line could not carry)."""


@dataclass(frozen=True)
class Forward:
    """The router's decisions about one request, as they travel to the gateway."""

    tenant: str
    request_class: str
    version: str
    reason: str
    stable: str = ""  # "" when there is no active version to fall back to
    session: str | None = None  # X-Session-Key as sent; None when it is not sent
    reroute: bool = False  # REROUTE_HEADER: another worker remains for this request


@dataclass(frozen=True)
class Target:
    """Where a forward goes on its gateway: the method and the request target (path, and
    query if any) of its request line, as the router writes it and the gateway reads it."""

    method: str
    path: str


def _mac(
    secret: bytes,
    worker_id: str,
    request_id: str,
    ts: int,
    nonce: str,
    body: bytes,
    forward: Forward,
    target: Target,
) -> str:
    digest = hashlib.sha256(body).hexdigest()
    # the session key sent ("+" and its value, a token) or not ("-"): never the same line
    session = "-" if forward.session is None else "+" + forward.session
    # every field but the last is a token without a line feed, the last is visible ASCII:
    # one message has one reading
    message = (
        f"{_FORM}\n{worker_id}\n{target.method}\n{forward.tenant}\n{request_id}\n{ts}\n"
        f"{nonce}\n{digest}\n{forward.request_class}\n{forward.version}\n{forward.reason}\n"
        f"{forward.stable}\n{session}\n{int(forward.reroute)}\n{target.path}"
    ).encode()
    return hmac.digest(secret, message, "sha256").hex()  # one-shot: no HMAC object per call


def sign(
    secret: bytes,
    forward: Forward,
    target: Target,
    request_id: str,
    body: bytes,
    now: float,
    *,
    worker_id: str,
    nonce: str,
) -> str:
    """The ``X-Loraplane-Forwarded`` value for one forwarded request to ``target`` on the
    gateway of ``worker_id``; ``nonce`` (16 to 32 lower-case hex digits) is this forward's
    alone: a gateway serves a signature once."""
    ts = int(now)
    mac = _mac(secret, worker_id, request_id, ts, nonce, body, forward, target)
    return f"{_FORM}.{ts}.{nonce}.{mac}"


def outdated(signature: str | None) -> bool:
    """Whether ``signature`` has an older form (``v2.ts.hex``, or ``ts.hex``: a router older
    than this gateway): refused like any other that does not verify, under a reason of its
    own."""
    return signature is not None and _OUTDATED.fullmatch(signature) is not None


def headers(
    secret: bytes,
    forward: Forward,
    target: Target,
    request_id: str,
    body: bytes,
    now: float,
    *,
    worker_id: str,
    nonce: str,
) -> bytes:
    """The header lines (CRLF-ended) the router adds to a request it forwards to ``target``
    on the gateway of ``worker_id``, signed with this forward's own ``nonce``."""
    signature = sign(
        secret, forward, target, request_id, body, now, worker_id=worker_id, nonce=nonce
    )
    head = (
        f"X-Request-Id: {request_id}\r\nX-Request-Class: {forward.request_class}\r\n"
        f"{TENANT_HEADER}: {forward.tenant}\r\n{VERSION_HEADER}: {forward.version}\r\n"
        f"{VERSION_REASON_HEADER}: {forward.reason}\r\n{SIGNATURE_HEADER}: {signature}\r\n"
    )
    if forward.stable:
        head += f"{STABLE_VERSION_HEADER}: {forward.stable}\r\n"
    if forward.session is not None:
        head += f"{SESSION_HEADER}: {forward.session}\r\n"
    if forward.reroute:
        head += f"{REROUTE_HEADER}: 1\r\n"
    return head.encode("latin-1")


def verify(
    secret: bytes | None,
    forward: Forward,
    target: Target,
    request_id: str,
    body: bytes,
    signature: str | None,
    now: float,
    *,
    worker_id: str | None,
) -> bool:
    """True when ``signature`` vouches for ``forward`` on this request, as received (its
    method and request target) by the gateway of ``worker_id`` (None: a door that is no
    worker's takes no forward), now."""
    if (
        not secret
        or not signature
        or worker_id is None
        or not is_id(worker_id)
        or not _METHOD.fullmatch(target.method)
        or not _TARGET.fullmatch(target.path)
        or not is_id(forward.tenant)
        or not header_token(request_id)
        or not header_token(forward.version)
        or not header_token(forward.request_class)
        or not header_token(forward.reason)
        or (forward.stable and not header_token(forward.stable))
        or (forward.session is not None and not header_token(forward.session))
    ):
        return False
    parts = _SIGNATURE.fullmatch(signature)
    if parts is None:
        return False
    ts, nonce, mac = int(parts[1]), parts[2], parts[3]
    if abs(now - ts) > MAX_SKEW_S:
        return False
    return hmac.compare_digest(
        mac, _mac(secret, worker_id, request_id, ts, nonce, body, forward, target)
    )


class Replays:
    """The forwards a gateway has taken, each until its ``ts`` is out of the window
    (``MAX_SKEW_S``): a signature seen before is a replay. Only signatures that verified are
    noted (``first`` after ``verify``), so no one without the router secret adds to it, and
    it holds what the routers forwarded here within ``2 * MAX_SKEW_S + 1`` seconds, never
    more. A ``ts`` at or below the last one forgotten is refused too, so a clock set back
    reopens nothing. Pure: the time is passed in."""

    def __init__(self, window_s: int = MAX_SKEW_S) -> None:
        self.window_s = window_s
        self._seen: dict[int, set[bytes]] = {}  # ts -> the signatures' MACs (128 bits)
        self._horizon = -1  # every ts at or below it is forgotten, so refused

    def __len__(self) -> int:
        return sum(len(held) for held in self._seen.values())

    def first(self, signature: str, now: float) -> bool:
        """Whether the verified ``signature`` is new (then noted), not a replay."""
        parts = _SIGNATURE.fullmatch(signature)
        if parts is None:
            return False
        ts, key = int(parts[1]), bytes.fromhex(parts[3][:32])
        limit = math.ceil(now - self.window_s) - 1  # every ts up to it fails ``verify``
        if limit > self._horizon:
            self._horizon = limit
            for old in [t for t in self._seen if t <= limit]:
                del self._seen[old]
        if ts <= self._horizon:
            return False
        held = self._seen.setdefault(ts, set())
        if key in held:
            return False
        held.add(key)
        return True


def refusal_type(content_type: str, body: bytes) -> str | None:
    """The ``error.type`` of a gateway's whole answer in OpenAI's error shape (JSON within
    ``REFUSAL_ANSWER_BYTES``); None for anything else (a stream, bytes that are no such
    JSON, a type that is no string)."""
    if not content_type.startswith("application/json"):
        return None
    try:
        answer = strict_loads(body, max_bytes=REFUSAL_ANSWER_BYTES)
    except StrictJsonError:
        return None
    error = answer.get("error") if isinstance(answer, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else None


def refusal_hold(value: str | None) -> float | None:
    """The seconds a gateway's ``HOLD_HEADER`` value says its worker holds its refusal, at
    most ``MAX_REFUSAL_HOLD_S`` (a longer one is clamped: the header is the gateway's
    bytes); None for a value that is no whole number of seconds in at most 9 ASCII digits
    (absent, empty, signed, a fraction, an exponent, other digits), which the router's own
    memory then stands for."""
    if value is None:
        return None
    value = value.strip(" \t")
    if not _HOLD.fullmatch(value):
        return None
    return float(min(int(value), MAX_REFUSAL_HOLD_S))


def refused_by_worker(status: int, content_type: str, body: bytes) -> bool:
    """Whether a gateway's whole answer is a 424 of that worker's own refusal to load the
    version (``ServingRefusal.adapter_refused_by_worker`` as its ``error.type``,
    ``refusal_type``), which another worker may load. Anything else (another status or
    type, a stream, bytes that are no such JSON) is not."""
    return (
        status == PERMANENT_STATUS
        and refusal_type(content_type, body) == ServingRefusal.adapter_refused_by_worker
    )
