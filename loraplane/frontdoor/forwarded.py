"""What a fleet router forwards to a worker gateway, signed so no one else can claim it: the
tenant, the request class and the version the router chose.

The router authenticates the client's API key itself and forwards the request without it;
the gateway then believes the ``X-Loraplane-Tenant``, ``X-Request-Class`` and the version
headers only with a valid ``X-Loraplane-Forwarded: <unix ts>.<hex HMAC-SHA256>`` over
``tenant \\n request id \\n ts \\n sha256(body) \\n class \\n version \\n reason \\n stable``
keyed with the router secret (a file of mode 0600 that the routers and the gateways of a
fleet hold, ``settings.router_secret_path``). The version is decided once, at the router
(``frontdoor.admission``): the gateway serves exactly it, or refuses. The signature binds
the body and the request id, and ``ts`` must be within ``MAX_SKEW_S`` of the gateway's clock,
so a captured header set serves no other body, class or version, and expires. Anything else
a client puts in these headers (a tenant that is no id, a request id or version that is no
header token, a signature that is not ``digits.hex``, bytes that are not ASCII) is refused
before any HMAC is computed. Pure: the secret and the time are passed in.

Back the other way, a gateway's answer names one header of these for the router alone:
``NOT_RUN_HEADER``, on a 503 whose request never reached vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from loraplane.frontdoor.request_fields import header_token
from loraplane.schemas.base import is_id

__all__ = [
    "MAX_SKEW_S",
    "NOT_RUN_HEADER",
    "SIGNATURE_HEADER",
    "STABLE_VERSION_HEADER",
    "TENANT_HEADER",
    "VERSION_HEADER",
    "VERSION_REASON_HEADER",
    "Forward",
    "headers",
    "sign",
    "verify",
]

TENANT_HEADER = "X-Loraplane-Tenant"
SIGNATURE_HEADER = "X-Loraplane-Forwarded"
VERSION_HEADER = "X-Loraplane-Version"  # the version to serve
VERSION_REASON_HEADER = "X-Loraplane-Version-Reason"  # why: active, or its canary share
STABLE_VERSION_HEADER = "X-Loraplane-Stable-Version"  # the active one, while a canary warms
NOT_RUN_HEADER = "X-Loraplane-Not-Run"
"""On a gateway's 503, back to the router: its vLLM could not be reached, so the request never
reached vLLM (the header's value is the reason). A router parks that worker and sends the
request to another, at most once per request (``router.server``), so a gateway that sends it
on every answer costs a request one more try, never a loop."""
MAX_SKEW_S = 30
_SIGNATURE = re.compile(r"([0-9]{1,12})\.([0-9a-f]{64})")


@dataclass(frozen=True)
class Forward:
    """The router's decisions about one request, as they travel to the gateway."""

    tenant: str
    request_class: str
    version: str
    reason: str
    stable: str = ""  # "" when there is no active version to fall back to


def _mac(secret: bytes, request_id: str, ts: int, body: bytes, forward: Forward) -> str:
    digest = hashlib.sha256(body).hexdigest()
    message = (
        f"{forward.tenant}\n{request_id}\n{ts}\n{digest}\n{forward.request_class}\n"
        f"{forward.version}\n{forward.reason}\n{forward.stable}"
    ).encode()
    return hmac.digest(secret, message, "sha256").hex()  # one-shot: no HMAC object per call


def sign(secret: bytes, forward: Forward, request_id: str, body: bytes, now: float) -> str:
    """The ``X-Loraplane-Forwarded`` value for one forwarded request."""
    ts = int(now)
    return f"{ts}.{_mac(secret, request_id, ts, body, forward)}"


def headers(
    secret: bytes,
    forward: Forward,
    request_id: str,
    body: bytes,
    now: float,
    session_key: str | None,
) -> bytes:
    """The header lines (CRLF-ended) the router adds to a forwarded request."""
    head = (
        f"X-Request-Id: {request_id}\r\nX-Request-Class: {forward.request_class}\r\n"
        f"{TENANT_HEADER}: {forward.tenant}\r\n{VERSION_HEADER}: {forward.version}\r\n"
        f"{VERSION_REASON_HEADER}: {forward.reason}\r\n"
        f"{SIGNATURE_HEADER}: {sign(secret, forward, request_id, body, now)}\r\n"
    )
    if forward.stable:
        head += f"{STABLE_VERSION_HEADER}: {forward.stable}\r\n"
    if session_key:
        head += f"X-Session-Key: {session_key}\r\n"
    return head.encode("latin-1")


def verify(
    secret: bytes | None,
    forward: Forward,
    request_id: str,
    body: bytes,
    signature: str | None,
    now: float,
) -> bool:
    """True when ``signature`` vouches for ``forward`` on this request now."""
    if (
        not secret
        or not signature
        or not is_id(forward.tenant)
        or not header_token(request_id)
        or not header_token(forward.version)
        or not header_token(forward.request_class)
        or not header_token(forward.reason)
        or (forward.stable and not header_token(forward.stable))
    ):
        return False
    parts = _SIGNATURE.fullmatch(signature)
    if parts is None:
        return False
    ts, mac = int(parts[1]), parts[2]
    if abs(now - ts) > MAX_SKEW_S:
        return False
    return hmac.compare_digest(mac, _mac(secret, request_id, ts, body, forward))
