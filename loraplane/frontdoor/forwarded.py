"""The tenant a fleet router forwards to a worker gateway, signed so no one else can claim it.

The router authenticates the client's API key itself and forwards the request without it;
the gateway then believes ``X-Loraplane-Tenant`` only with a valid
``X-Loraplane-Forwarded: <unix ts>.<hex HMAC-SHA256>`` over
``tenant \\n request id \\n ts \\n sha256(body)`` keyed with the router secret (a file of
mode 0600 that the routers and the gateways of a fleet hold, ``settings.router_secret_path``).
The signature binds the body and the request id, and ``ts`` must be within ``MAX_SKEW_S`` of
the gateway's clock, so a captured header pair serves no other body and expires. Anything
else a client puts in these headers (a tenant that is no id, a request id that is no header
token, a signature that is not ``digits.hex``, bytes that are not ASCII) is refused before
any HMAC is computed. Pure: the secret and the time are passed in.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from loraplane.frontdoor.request_fields import header_token
from loraplane.schemas.base import is_id

TENANT_HEADER = "X-Loraplane-Tenant"
SIGNATURE_HEADER = "X-Loraplane-Forwarded"
MAX_SKEW_S = 30
_SIGNATURE = re.compile(r"([0-9]{1,12})\.([0-9a-f]{64})")


def _mac(secret: bytes, tenant: str, request_id: str, ts: int, body: bytes) -> str:
    digest = hashlib.sha256(body).hexdigest()
    message = f"{tenant}\n{request_id}\n{ts}\n{digest}".encode()
    return hmac.digest(secret, message, "sha256").hex()  # one-shot: no HMAC object per call


def sign(secret: bytes, tenant: str, request_id: str, body: bytes, now: float) -> str:
    """The ``X-Loraplane-Forwarded`` value for one forwarded request."""
    ts = int(now)
    return f"{ts}.{_mac(secret, tenant, request_id, ts, body)}"


def verify(secret: bytes | None, tenant: str, request_id: str, body: bytes,
           signature: str | None, now: float) -> bool:
    """True when ``signature`` vouches for ``tenant`` on this request now."""
    if not secret or not signature or not is_id(tenant) or not header_token(request_id):
        return False
    parts = _SIGNATURE.fullmatch(signature)
    if parts is None:
        return False
    ts, mac = int(parts[1]), parts[2]
    if abs(now - ts) > MAX_SKEW_S:
        return False
    return hmac.compare_digest(mac, _mac(secret, tenant, request_id, ts, body))
