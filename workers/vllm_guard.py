"""The API key in front of every vLLM route: an ASGI middleware that vLLM loads itself.

vLLM checks ``VLLM_API_KEY`` only under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``. Its
SageMaker routes load (``POST /adapters``), unload (``DELETE /adapters/{name}``) and generate
(``POST /invocations``) for anyone who reaches the port, as do ``/generative_scoring`` and
``/scale_elastic_ep``. The vLLM a worker starts runs this class as ``--middleware``
(``MIDDLEWARE``): every request without the key is refused with vLLM's own 401 answer, but a
GET (or HEAD) of a route ``workers.vllm_routes`` judges open (health, version, metrics).
Deny by default: a route that a later vLLM adds, an unknown path, a websocket or an OPTIONS
request is refused too. Without a configured key nothing but the open routes is served.

vLLM builds it through ``loraplane.vllm_plugin.RouteGuard`` (``MIDDLEWARE``), which hands
it the key from vLLM's environment. The worker agent checks at start that the vLLM it drives
is guarded (``PROBE_PATH`` must answer 401 without the key), so a vLLM started by other means
is noticed. Pure and standard library only: it runs in vLLM's Python.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from loraplane.workers.vllm_routes import OPEN_ROUTES

__all__ = [
    "MIDDLEWARE",
    "PROBE_PATH",
    "UNAUTHORIZED",
    "ASGIApp",
    "Message",
    "Receive",
    "RouteGuard",
    "Scope",
    "Send",
    "admits",
    "key_digest",
]

MIDDLEWARE = "loraplane.vllm_plugin.RouteGuard"
"""The import path handed to vLLM's ``--middleware``."""
PROBE_PATH = "/loraplane-route-guard-probe"
"""A path no vLLM serves: 401 without the key when guarded, 404 when not."""
UNAUTHORIZED = b'{"error":"Unauthorized"}'  # vLLM's own 401 body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def key_digest(key: str) -> bytes:
    """sha256 of the key; a header's undecodable bytes (aiohttp keeps them as surrogates)
    hash as themselves instead of raising."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def admits(method: str, path: str, authorization: str | None, key: bytes | None) -> bool:
    """Whether a request may reach vLLM: an open route's GET/HEAD, or the bearer key whose
    sha256 is ``key`` (compared in constant time). ``key`` None: only open routes."""
    if method in ("GET", "HEAD") and ("GET", path) in OPEN_ROUTES:
        return True
    if key is None or not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key_digest(token), key)


def _authorization(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"authorization":
            try:
                return str(value.decode("latin-1"))
            except AttributeError:
                return None
    return None


class RouteGuard:
    """Pure ASGI: refuses what ``admits`` refuses, passes everything else on unchanged."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = key_digest(api_key) if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        method = "WEBSOCKET" if kind == "websocket" else str(scope.get("method", ""))
        if admits(method, str(scope.get("path", "")), _authorization(scope), self.key):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(UNAUTHORIZED)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": UNAUTHORIZED})
