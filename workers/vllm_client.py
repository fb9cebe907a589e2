"""Async driver of vLLM's runtime LoRA API and completion endpoints.

vLLM answers a successful load/unload with a *plain-text* 200 and every failure with JSON
``{"error": {"message", "type", "param", "code"}}`` (see docs/worker.md). This
module turns those answers into a typed ``VllmError`` whose ``reason`` is a stable code the
agent can put on the cache-events topic, so callers never parse vLLM's prose themselves.
Completions (every proxied request) go through the lean keep-alive client of
``frontdoor.upstream_http``; the rare control calls keep aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from loraplane.frontdoor.upstream_http import UpstreamError, UpstreamPool, UpstreamResponse
from loraplane.schemas.reasons import VllmErrorCode
from loraplane.workers.vllm_guard import MIDDLEWARE, PROBE_PATH

__all__ = [
    "MAX_ANSWER_BYTES",
    "ServedModel",
    "VllmClient",
    "VllmError",
    "VllmUnguarded",
    "classify",
]

MAX_ANSWER_BYTES = 16 * 1024 * 1024
"""The most a control call (models, load, unload, health) reads of an answer: /v1/models of
a few thousand adapters is well under 2 MiB."""


class VllmError(RuntimeError):
    """vLLM refused or could not be reached. ``reason`` is a ``VllmErrorCode``:

    ``already_loaded`` (400, name taken and no load_inplace), ``bad_request`` (other 400),
    ``not_found`` (404: unknown name, or adapter folder / adapter_config.json missing),
    ``rank_too_large`` (500 naming max_lora_rank), ``adapter_refused`` (500: the engine's
    LoRA loader raised on the folder), ``server_error`` (other 5xx),
    ``unexpected_status`` (also 401: a missing or wrong API key), ``timeout``,
    ``unreachable``, ``bad_response`` (not the HTTP or JSON expected). ``unsent``: the request
    never reached vLLM (no connection could be made), so it did not run.
    """

    def __init__(
        self,
        reason: VllmErrorCode,
        message: str,
        status: int | None = None,
        *,
        unsent: bool = False,
    ) -> None:
        self.reason = VllmErrorCode(reason)
        self.status = status
        self.message = message
        self.unsent = unsent
        super().__init__(f"{reason}" + (f" (HTTP {status})" if status else "") + f": {message}")


class VllmUnguarded(RuntimeError):
    """The vLLM serves a route without its API key: anyone who reaches its port could load,
    unload or generate through routes vLLM does not guard itself (docs/security.md)."""


@dataclass(frozen=True)
class ServedModel:
    """One entry of ``GET /v1/models``: the base model has no parent, adapters do."""

    id: str
    root: str
    parent: str | None
    max_model_len: int | None = None  # the context vLLM lists for the base model

    @property
    def is_adapter(self) -> bool:
        return self.parent is not None


def _served_model(entry: object) -> ServedModel:
    if not isinstance(entry, dict):
        raise TypeError(f"an entry is a {type(entry).__name__}, not an object")
    id_, root, parent = entry["id"], entry.get("root"), entry.get("parent")
    if not isinstance(id_, str) or not all(v is None or isinstance(v, str) for v in (root, parent)):
        raise TypeError(f"an entry's id, root or parent is not a string: {entry!r}"[:300])
    context = entry.get("max_model_len")
    if not isinstance(context, int) or isinstance(context, bool) or context <= 0:
        context = None  # an adapter's null, or not vLLM's number: not known
    return ServedModel(id_, root or "", parent, context)


async def _read_text(resp: aiohttp.ClientResponse, what: str) -> str:
    """The answer's body as text, at most MAX_ANSWER_BYTES read (``bad_response`` past it,
    whatever Content-Length says), decoded as UTF-8 whatever charset it names: a byte that
    does not decode becomes U+FFFD instead of an exception no caller expects."""
    declared = resp.content_length
    if declared is not None and declared > MAX_ANSWER_BYTES:
        raise VllmError(
            VllmErrorCode.bad_response,
            f"{what}: a {declared}-byte answer is over {MAX_ANSWER_BYTES} bytes",
            resp.status,
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise VllmError(
                VllmErrorCode.bad_response,
                f"{what}: the answer is over {MAX_ANSWER_BYTES} bytes",
                resp.status,
            )
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def _error_message(text: str) -> str:
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the recursion limit
        return text.strip()[:500]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:500]
        if isinstance(err, str):  # the 401 of vLLM's API-key check: {"error": "Unauthorized"}
            return err[:500]
        if "message" in body:
            return str(body["message"])[:500]
    return text.strip()[:500]


_LOADER_FAILED = "call to add_lora method failed"
"""How vLLM's engine wraps any exception its ``add_lora`` raised (``v1/engine/core.py``), which
``/v1/load_lora_adapter`` answers as a 500 ``InternalServerError``: the loader refused the
folder (its config, its rank, a module or a weights file it cannot load)."""

_OUT_OF_MEMORY = ("out of memory", "can't allocate memory")
"""Words of an ``add_lora`` failure that is the host's trouble, not the adapter's."""


def classify(status: int, text: str) -> VllmError:
    """Map one non-200 answer of vLLM to a VllmError with a stable reason.
    ``VllmErrorCode.refuses_load`` says which of them a retried load cannot pass."""
    message = _error_message(text)
    lowered = message.lower()
    if status == 400:
        reason = (
            VllmErrorCode.already_loaded
            if "already been loaded" in lowered
            else VllmErrorCode.bad_request
        )
    elif status == 404:
        reason = VllmErrorCode.not_found
    elif status >= 500:
        if "max_lora_rank" in lowered:
            reason = VllmErrorCode.rank_too_large
        elif _LOADER_FAILED in lowered and not any(m in lowered for m in _OUT_OF_MEMORY):
            reason = VllmErrorCode.adapter_refused
        else:
            reason = VllmErrorCode.server_error
    else:
        reason = VllmErrorCode.unexpected_status
    return VllmError(reason, message, status)


class VllmClient:
    """One vLLM server. Share one instance per process: it keeps one connection pool."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 10.0,
        completion_timeout_s: float = 300.0,
        api_key: str | None = None,
    ) -> None:
        """``api_key``: vLLM's ``VLLM_API_KEY``, sent as a bearer token on every call (vLLM
        answers 401 on /v1/* without it); never logged."""
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(timeout_s, 3.0))
        url = urlsplit(self.base_url)
        if url.scheme != "http" or not url.hostname or url.path not in ("", "/"):
            raise ValueError(f"vLLM is reached over plain http://host:port: {base_url!r}")
        self._upstream = (url.hostname, url.port or 80)
        self._connect_timeout_s = min(timeout_s, 3.0)
        self._read_timeout_s = timeout_s * 6  # between two reads of one answer
        self._completion_timeout_s = completion_timeout_s
        self._pool: UpstreamPool | None = None
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64, force_close=False), headers=self._headers
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._pool is not None:
            self._pool.close()

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> str:
        try:
            async with self._http().request(
                method,
                self.base_url + path,
                json=body,
                timeout=self._timeout,
                allow_redirects=False,  # vLLM never redirects; a 3xx is unexpected_status
            ) as resp:
                text = await _read_text(resp, f"{method} {path}")
                if resp.status != 200:
                    raise classify(resp.status, text)
                return text
        except TimeoutError:
            raise VllmError(
                VllmErrorCode.timeout, f"{method} {path} took longer than {self._timeout.total}s"
            ) from None
        except aiohttp.ClientError as exc:
            raise VllmError(VllmErrorCode.unreachable, f"{method} {path}: {exc}") from None

    async def load(self, lora_name: str, lora_path: str, *, inplace: bool = False) -> float:
        """Register an adapter folder under ``lora_name``; returns the call's duration in ms."""
        body: dict[str, Any] = {"lora_name": lora_name, "lora_path": lora_path}
        if inplace:
            body["load_inplace"] = True
        started = time.perf_counter()
        await self._call("POST", "/v1/load_lora_adapter", body)
        return (time.perf_counter() - started) * 1000

    async def unload(self, lora_name: str) -> None:
        await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": lora_name})

    async def models(self) -> list[ServedModel]:
        """What vLLM serves. Any entry whose id, root or parent is not a string (or null) is
        not vLLM's answer: the whole list is refused as ``bad_response``, never guessed at."""
        text = await self._call("GET", "/v1/models")
        try:
            data = json.loads(text)["data"]
            if not isinstance(data, list):
                raise TypeError(f"data is a {type(data).__name__}, not a list")
            return [_served_model(m) for m in data]
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise VllmError(VllmErrorCode.bad_response, f"/v1/models: {exc}"[:500]) from None

    async def health(self) -> bool:
        try:
            await self._call("GET", "/health")
        except VllmError:
            return False
        return True

    async def require_guard(self) -> None:
        """Raise ``VllmUnguarded`` unless a path no vLLM serves answers 401 without the key
        (the route guard refuses it; an unguarded vLLM says 404)."""
        try:
            async with (
                aiohttp.ClientSession() as bare,
                bare.get(
                    self.base_url + PROBE_PATH, timeout=self._timeout, allow_redirects=False
                ) as resp,
            ):
                status = resp.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise VllmError(VllmErrorCode.unreachable, f"GET {PROBE_PATH}: {exc}") from None
        if status != 401:
            raise VllmUnguarded(
                f"the vLLM at {self.base_url} answered GET {PROBE_PATH} without its API key "
                f"with {status}, not 401: it serves routes to anyone who reaches it. Start it "
                f"with `--middleware {MIDDLEWARE}` and loraplane importable "
                "(`loraplane vllm serve` does; docs/security.md)"
            )

    async def wait_healthy(self, timeout_s: float, interval_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() > deadline:
                raise VllmError(
                    VllmErrorCode.timeout, f"{self.base_url} not healthy after {timeout_s}s"
                )
            await asyncio.sleep(interval_s)

    @asynccontextmanager
    async def completion(self, path: str, body: dict[str, Any]) -> AsyncIterator[UpstreamResponse]:
        """POST a completion request and hand back the open response, for streaming.

        Non-200 answers are raised as VllmError so callers see one error type; so are a
        timeout or a lost connection while the caller reads the body. Each wait for vLLM
        ends after the read timeout, and no wait ends later than ``completion_timeout_s``
        after the request.
        """
        if self._pool is None:
            self._pool = UpstreamPool(
                *self._upstream,
                connect_timeout_s=self._connect_timeout_s,
                read_timeout_s=self._read_timeout_s,
                headers=self._headers,
            )
        try:
            resp = await self._pool.request(
                "POST", path, json.dumps(body).encode(), total_timeout_s=self._completion_timeout_s
            )
            try:
                if resp.status != 200:
                    raise classify(resp.status, await resp.text())
                yield resp
            finally:
                resp.close()
        except UpstreamError as exc:
            raise VllmError(exc.reason, f"POST {path}: {exc.message}", unsent=exc.unsent) from None
