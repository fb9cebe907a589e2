"""The front door over aiohttp, for the router and the gateway alike: read a request's head
and body into ``frontdoor.admission`` and answer a refusal in OpenAI's error shape.
``head_check`` is the same door's refusals of a head alone, for the bounded server
(``kernel.http_server.HEAD_CHECK``), which otherwise reads every body before a handler;
``error_answer`` words what that server answers outside the handlers (an unknown route, a
body it cannot read) in the same shape (``kernel.http_server.ERROR_ANSWER``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum

from aiohttp import web

from loraplane.frontdoor.admission import Admission, FrontDoor, Head, Identity, Refusal
from loraplane.frontdoor.forwarded import (
    REROUTE_HEADER,
    SESSION_HEADER,
    SIGNATURE_HEADER,
    STABLE_VERSION_HEADER,
    TENANT_HEADER,
    VERSION_HEADER,
    VERSION_REASON_HEADER,
    Forward,
    Target,
)
from loraplane.frontdoor.request_fields import Endpoint, header_token
from loraplane.kernel.http_server import ErrorAnswer, HeadCheck
from loraplane.schemas.reasons import RequestRefusal

__all__ = [
    "READ_HEADERS",
    "admit_request",
    "error_answer",
    "error_response",
    "head_check",
    "head_of",
    "refusal_response",
]
_ENDPOINTS = frozenset(e.value for e in Endpoint)


def error_response(
    status: int, code: str, message: str, param: str | None = None, **headers: str
) -> web.Response:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": code, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def error_answer(counted: Callable[[StrEnum], None] | None = None) -> ErrorAnswer:
    """The front door's ``ERROR_ANSWER``: what its server answers outside the handlers (a
    route or method it does not serve, vLLM's others included; a body read past the cap or
    that does not decode; a head the parser refuses) in OpenAI's error shape, its reason as
    ``type``, like every other refusal of the door. ``counted`` is told each reason (the
    router's outcome counts)."""

    def answer(status: int, reason: StrEnum, message: str) -> web.StreamResponse:
        if counted is not None:
            counted(reason)
        return error_response(status, reason, message)

    return answer


def refusal_response(refusal: Refusal) -> web.Response:
    headers = (
        {"Retry-After": str(refusal.retry_after_s)} if refusal.retry_after_s is not None else {}
    )
    return error_response(refusal.status, refusal.code, refusal.message, refusal.param, **headers)


READ_HEADERS = (
    "Authorization",
    "X-Request-Class",
    "X-Request-Id",
    SESSION_HEADER,
    TENANT_HEADER,
    VERSION_HEADER,
    VERSION_REASON_HEADER,
    STABLE_VERSION_HEADER,
    SIGNATURE_HEADER,
    REROUTE_HEADER,
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
            session=headers.get(SESSION_HEADER),  # as sent: its signature says if it may be
            reroute=headers.get(REROUTE_HEADER) == "1",
        )
    )
    return Head(
        request_id=request_id,
        authorization=headers.get("Authorization"),
        request_class=headers.get("X-Request-Class"),
        session_key=header_token(headers.get(SESSION_HEADER)),
        forward=forward,
        signature=headers.get(SIGNATURE_HEADER),
        # what a forward's signature must cover: the request line as this server read it
        target=Target(request.method, request.raw_path),
        repeated=repeated,
    )


def _identify(
    door: FrontDoor, request: web.Request, head: Head, max_body_bytes: int
) -> Identity | Refusal:
    """What the door decides on the head alone: the tenant, or a refusal (no key, a
    Content-Length over ``max_body_bytes``: never wait for what is refused)."""
    identity = door.identify(head)
    if isinstance(identity, Refusal):
        return identity
    declared = request.content_length
    if declared is not None and declared > max_body_bytes:
        return Refusal(
            413,
            RequestRefusal.body_too_large,
            f"the body is declared {declared} bytes, over {max_body_bytes}",
        )
    return identity


def head_check(
    door: FrontDoor, max_body_bytes: int, counted: Callable[[Refusal], None] | None = None
) -> HeadCheck:
    """The door's refusal of a completion request on its head (the same answer its handler
    would give), before the server reads or waits for the body; other routes pass.
    ``counted`` is told each refusal (the router's outcome counts)."""

    def check(request: web.Request) -> web.StreamResponse | None:
        route = request.match_info.route
        if (
            request.method != "POST"
            or route.resource is None
            or route.resource.canonical not in _ENDPOINTS
        ):
            return None
        request_id = header_token(request.headers.get("X-Request-Id")) or ""
        identity = _identify(door, request, head_of(request, request_id), max_body_bytes)
        if not isinstance(identity, Refusal):
            return None
        if counted is not None:
            counted(identity)
        return refusal_response(identity)

    return check


async def admit_request(
    door: FrontDoor, request: web.Request, endpoint: Endpoint, request_id: str, max_body_bytes: int
) -> tuple[Admission | Refusal, bytes]:
    """Identify, read the body (413 past ``max_body_bytes``, declared or read), admit: the
    admission (or the refusal) and the raw body."""
    head = head_of(request, request_id)
    identity = _identify(door, request, head, max_body_bytes)
    if isinstance(identity, Refusal):
        return identity, b""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return Refusal(
            413, RequestRefusal.body_too_large, f"the body is over {max_body_bytes} bytes"
        ), b""
    return door.admit(identity, head, endpoint, raw, time.time()), raw
