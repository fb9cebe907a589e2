"""The front door over aiohttp, for the router and the gateway alike: read a request's head
and body into ``frontdoor.admission`` and answer a refusal in OpenAI's error shape."""

from __future__ import annotations

import time

from aiohttp import web

from loraplane.frontdoor.admission import Admission, FrontDoor, Head, Refusal
from loraplane.frontdoor.forwarded import (
    SIGNATURE_HEADER,
    STABLE_VERSION_HEADER,
    TENANT_HEADER,
    VERSION_HEADER,
    VERSION_REASON_HEADER,
    Forward,
)
from loraplane.frontdoor.request_fields import Endpoint, header_token
from loraplane.schemas.reasons import RequestRefusal

__all__ = ["READ_HEADERS", "admit_request", "error_response", "head_of", "refusal_response"]


def error_response(
    status: int, code: str, message: str, param: str | None = None, **headers: str
) -> web.Response:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": code, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def refusal_response(refusal: Refusal) -> web.Response:
    headers = (
        {"Retry-After": str(refusal.retry_after_s)} if refusal.retry_after_s is not None else {}
    )
    return error_response(refusal.status, refusal.reason, refusal.message, refusal.param, **headers)


READ_HEADERS = (
    "Authorization",
    "X-Request-Class",
    "X-Request-Id",
    "X-Session-Key",
    TENANT_HEADER,
    VERSION_HEADER,
    VERSION_REASON_HEADER,
    STABLE_VERSION_HEADER,
    SIGNATURE_HEADER,
)
"""Every header the front door reads. Each must come at most once: of two values, which
one counts would be the reader's choice (aiohttp's ``get`` takes the first, a proxy in front
may take the last), so a repeated one is refused before either is used."""


def head_of(request: web.Request, request_id: str) -> Head:
    """The front door's view of a request's head; a router's forwarded headers only when
    its tenant header is there (the signature then decides)."""
    headers = request.headers
    repeated = next((n for n in READ_HEADERS if len(headers.getall(n, ())) > 1), None)
    tenant = headers.get(TENANT_HEADER)
    forward = (
        None
        if tenant is None
        else Forward(
            tenant=tenant,
            request_class=headers.get("X-Request-Class", ""),
            version=headers.get(VERSION_HEADER, ""),
            reason=headers.get(VERSION_REASON_HEADER, ""),
            stable=headers.get(STABLE_VERSION_HEADER, ""),
        )
    )
    return Head(
        request_id=request_id,
        authorization=headers.get("Authorization"),
        request_class=headers.get("X-Request-Class"),
        session_key=header_token(headers.get("X-Session-Key")),
        forward=forward,
        signature=headers.get(SIGNATURE_HEADER),
        repeated=repeated,
    )


async def admit_request(
    door: FrontDoor, request: web.Request, endpoint: Endpoint, request_id: str, max_body_bytes: int
) -> tuple[Admission | Refusal, bytes]:
    """Identify, read the body (413 past ``max_body_bytes``, declared or read), admit: the
    admission (or the refusal) and the raw body."""
    head = head_of(request, request_id)
    identity = door.identify(head)
    if isinstance(identity, Refusal):
        return identity, b""
    declared = request.content_length
    if declared is not None and declared > max_body_bytes:  # never wait for what is refused
        return Refusal(
            413,
            RequestRefusal.body_too_large,
            f"the body is declared {declared} bytes, over {max_body_bytes}",
        ), b""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return Refusal(
            413, RequestRefusal.body_too_large, f"the body is over {max_body_bytes} bytes"
        ), b""
    return door.admit(identity, head, endpoint, raw, time.time()), raw
