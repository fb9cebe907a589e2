"""The OpenAI-compatible request path of one worker: the only way a request reaches an adapter.

Every request passes the one front door (``frontdoor.admission``: tenant, fields and caps,
ownership, the version decided once, tenant limits), reached directly or behind a fleet
router (whose signed tenant and version it then believes and serves exactly). A hot copy is
forwarded at once; a cold one follows its request class's budget (a wait, the base model's
fallback, or 429 + Retry-After; 424 when its artifact is refused for good; a batch-like
request also waits for the worker's cold-load budget when it frees within its wait); a
canary still warming up here is served by the stable version the same decision named. The
lora name is held for the whole request (``Serving.serving``), so a swap drains instead of
cutting it.
Every answer's one RequestLog is with the sink, journaled to disk, before the answer's last
bytes leave. The gateway sees its worker only through ``workers.serving.Serving``; the rules
and headers are in docs/worker.md, "The gateway".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from loraplane.eventlog.sink import EventSink
from loraplane.frontdoor.admission import Choice, FrontDoor, Keys, Refusal
from loraplane.frontdoor.forwarded import HOLD_HEADER, NOT_RUN_HEADER, PERMANENT_STATUS
from loraplane.frontdoor.gateway_proof import CHALLENGE_PARAM, PROOF_FIELD, is_challenge, proof
from loraplane.frontdoor.http import (
    admit_request,
    error_answer,
    error_response,
    head_check,
    refusal_response,
)
from loraplane.frontdoor.request_fields import (
    Endpoint,
    Refused,
    cache_salt,
    fit_context,
    header_token,
)
from loraplane.frontdoor.upstream_http import UpstreamError, UpstreamResponse
from loraplane.kernel.http_server import ERROR_ANSWER, HEAD_CHECK, expect_continue, metrics_app
from loraplane.kernel.log_burst import LogBurst
from loraplane.kernel.policy import RequestBudgets
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.base import now_utc
from loraplane.schemas.reasons import (
    ArtifactReason,
    LoadDeferral,
    ServingRefusal,
    VllmErrorCode,
    VllmFailure,
)
from loraplane.schemas.request_log import RequestClass, RequestLog, RequestStatus, Tier
from loraplane.workers.serving import LoadOutcome, Serving, unfit
from loraplane.workers.vllm_client import VllmError, classify

__all__ = [
    "CANARY_WARMING_HEADER",
    "CLIENT_PACED_SHARE",
    "FALLBACK_HEADER",
    "FALLBACK_PERMANENT_HEADER",
    "FALLBACK_REASON_HEADER",
    "PERMANENT_STATUS",
    "ColdBudget",
    "ColdLoadSlots",
    "Gateway",
    "client_message",
    "cold_budget",
    "permanent_message",
    "refused_here",
]

FALLBACK_HEADER = "X-Loraplane-Fallback"
FALLBACK_REASON_HEADER = "X-Loraplane-Fallback-Reason"
FALLBACK_PERMANENT_HEADER = "X-Loraplane-Fallback-Permanent"  # "true": retrying will not help
CANARY_WARMING_HEADER = "X-Loraplane-Canary-Warming"
_MAX_EVENT_BYTES = 1024 * 1024  # one SSE event buffered at most (to find the usage chunk)
CLIENT_PACED_SHARE = 0.05
"""A stream whose writes to the client waited longer than this share of its decode time was
paced by its client, not by vLLM: it gives no point of the load-stall estimate."""


log = logging.getLogger("loraplane.gateway")
_FAILURE_LOG_EVERY_S = 30.0
_PATH = re.compile(r"(?<![^\s`'\"(=])(?:[A-Za-z]:)?(?:[/\\][^\s`'\"/\\]+)+[/\\]?")
"""An absolute path in vLLM's words (a model folder, a host-tier copy): not the client's."""


_VLLM_FAILURES = frozenset(VllmFailure)
_ARTIFACT_REASONS = {r.value: r for r in ArtifactReason}


def refused_here(reason: str) -> bool:
    """Whether a permanent refusal (a 424) is this worker's own, which another worker may
    not share: its vLLM refused to load the version (``VllmFailure``: its
    ``--max-lora-rank``, a module it does not serve), or the artifact failed a check
    against this worker's limits (``ArtifactReason.against_worker``). Any other refusal is
    of the artifact itself, which every worker refuses alike."""
    if reason in _VLLM_FAILURES:
        return True
    artifact = _ARTIFACT_REASONS.get(reason)
    return artifact is not None and artifact.against_worker


def permanent_message(record: AdapterRecord, reason: str) -> str:
    """What a 424 tells the tenant heals it: a refused artifact heals by a re-upload; a
    version this worker's vLLM refused to load (``vllm_*``: its ``--max-lora-rank``, a module
    it does not serve) by a model server that can load it, whatever the bytes, and one past
    this worker's own limits by a worker whose limits take it; any by another version
    promoted."""
    heals = (
        "this worker's model server can load it"
        if reason in _VLLM_FAILURES
        else "a worker whose limits take it serves it"
        if refused_here(reason)
        else "it is re-uploaded"
    )
    return (
        f"version {record.version} of {record.adapter_id!r} cannot be loaded ({reason}); "
        f"retrying will not help until {heals} or another version is promoted"
    )


def client_message(error: VllmError, names: dict[str, str]) -> str:
    """What a client is told of vLLM's failure on its request. vLLM's refusal of the
    request (400: a prompt past the context, a token id out of the vocabulary; vLLM answers
    a 400 for a client-caused error only, a 5xx for its own) is the client's to fix (the
    gateway's 400 too), so its words go on, each internal name in ``names`` (the lora name,
    the base model's path) as the client's own and any other path elided; any other
    failure (vLLM's 5xx and tracebacks, the transport's trouble naming vLLM's address) is
    its reason only: the detail is the gateway's log line."""
    if error.reason != VllmErrorCode.bad_request:
        return f"the model server failed on this request ({error.reason.failure})"
    message = error.message
    for internal in sorted((n for n in names if n), key=len, reverse=True):
        message = message.replace(internal, names[internal])
    return "the model server refused the request: " + _PATH.sub("<path>", message)[:500]


class _ModelName:
    """vLLM names what it served as ``model``: the internal lora name, or on the base
    fallback the base model's local path. The client is told the adapter id it asked for
    (version and tier travel in headers), so neither a path nor a lora name leaks. A byte
    replace of the serialised field, not a re-encode: cheap per streamed event, and text
    inside a JSON string never matches (its quotes are escaped)."""

    def __init__(self, served: str, asked: str) -> None:
        old, new = json.dumps(served).encode(), json.dumps(asked).encode()
        self.pairs = [(sep + old, sep + new) for sep in (b'"model":', b'"model": ')]

    def __call__(self, raw: bytes) -> bytes:
        for old, new in self.pairs:
            raw = raw.replace(old, new)
        return raw


@dataclass
class _Trace:
    """What the RequestLog of one request says."""

    request_id: str
    tenant_id: str
    adapter_id: str
    request_class: RequestClass
    started: float
    record: AdapterRecord | None = None
    tier: Tier = Tier.cold
    lora_name: str | None = None
    queue_ms: float = 0.0
    swap_ms: float = 0.0
    ttft_ms: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    status: RequestStatus = RequestStatus.ok
    error: str | None = None
    canary_warming: str | None = None  # the canary version this session waits for
    prompts: int = 1
    stream: bool = False
    client_wants_usage: bool = False  # pass vLLM's usage chunk on (stream_options)
    reroute: bool = False  # a router has another worker for it (forwarded.REROUTE_HEADER)
    logged: bool = False  # its RequestLog is with the sink (one per request)


@dataclass(frozen=True)
class ColdBudget:
    """What a cold adapter costs one request class."""

    wait_s: float
    retry_after_s: int
    batch_like: bool  # counts against batch.max_concurrent_cold_loads


def cold_budget(budgets: RequestBudgets, request_class: RequestClass) -> ColdBudget:
    """Interactive has its own budget; batch, canary and shadow wait as long as batch does,
    and each class names its own Retry-After (shadow follows batch)."""
    if request_class == RequestClass.interactive:
        return ColdBudget(
            budgets.interactive.max_wait_ms / 1000, budgets.interactive.retry_after_s, False
        )
    retry = (
        budgets.canary.retry_after_s
        if request_class == RequestClass.canary
        else budgets.batch.retry_after_s
    )
    return ColdBudget(budgets.batch.max_wait_ms / 1000, retry, True)


class ColdLoadSlots:
    """Cold loads started by batch-like requests, at most ``limit`` at once. A slot is held
    until the agent reports the load's outcome; requests for a name already loading join it."""

    def __init__(self) -> None:
        self._loading: dict[str, asyncio.Future[LoadOutcome]] = {}
        self._freed = asyncio.Event()
        self.waiting = 0

    async def start(
        self,
        name: str,
        limit: int,
        request_load: Callable[[], asyncio.Future[LoadOutcome]],
        timeout_s: float,
    ) -> asyncio.Future[LoadOutcome] | None:
        """The load's future, or None when no slot freed within ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self.waiting += 1
        try:
            while name not in self._loading and len(self._loading) >= limit:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                try:
                    await asyncio.wait_for(self._freed.wait(), remaining)
                except TimeoutError:
                    return None
        finally:
            self.waiting -= 1
        fut = self._loading.get(name)
        if fut is None:
            fut = request_load()
            if not fut.done():
                self._loading[name] = fut
                fut.add_done_callback(lambda _: self._release(name))
        return fut

    def _release(self, name: str) -> None:
        self._loading.pop(name, None)
        self._freed.set()
        self._freed = asyncio.Event()


_NOT_USAGE = (ValueError, AttributeError, TypeError, OverflowError, RecursionError)
"""What vLLM's answer may raise where its usage record is read (not JSON, nested past the
recursion limit, a count of ``1e400``): read as no usage, never a 500 for a served answer."""


def _take_usage(usage: dict[str, Any], trace: _Trace) -> None:
    """vLLM's token counts into ``trace``, both or neither."""
    prompt = int(usage.get("prompt_tokens", 0))
    trace.output_tokens = int(usage.get("completion_tokens", 0))
    trace.prompt_tokens = prompt


class Gateway:
    def __init__(
        self,
        worker: Serving,
        *,
        api_keys: Keys,
        budgets: RequestBudgets,
        sink: EventSink,
        cache_secret: bytes | None = None,
        router_secret: bytes | None = None,
        max_body_bytes: int = 1024 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker = worker
        # the one front door (frontdoor.admission), with this worker's verified versions; a
        # tenant and version forwarded by a fleet router are believed only under the router
        # secret's HMAC (frontdoor.forwarded); without one, only API keys are
        self.door = FrontDoor(
            keys=api_keys,
            budgets=budgets,
            versions=worker.versions,
            router_secret=router_secret,
            worker_id=worker.worker_id,  # a forward signed for another worker's gateway: 401
            clock=clock,
        )
        self.sink = sink
        self.max_body_bytes = max_body_bytes
        # never logged; without one (tests) a random secret per process: salts still differ
        # per tenant, only the prefix cache does not survive a gateway restart
        self._cache_secret = cache_secret if cache_secret else os.urandom(32)
        self._salts: dict[str, str] = {}
        self.batch_loads = ColdLoadSlots()
        # ids of requests that came without one, and of request logs: a random prefix per
        # gateway and a counter, unique like uuid4 but without its urandom call per request.
        # The two never share a prefix: a request id goes back to the client, and an event id
        # someone could name is one whose ClickHouse row a writer of the requests topic could
        # replace (ReplacingMergeTree keeps the last row of an id), so event ids stay secret.
        self._id_prefix = uuid.uuid4().hex[:16]
        self._id_seq = itertools.count()
        self._event_prefix = secrets.token_hex(16)
        self._event_seq = itertools.count()
        self._failures = LogBurst("gateway", _FAILURE_LOG_EVERY_S, logger=log)

    @property
    def api_keys(self) -> Keys:
        return self.door.keys

    @api_keys.setter
    def api_keys(self, keys: Keys) -> None:  # a new key file
        self.door.keys = keys

    @property
    def budgets(self) -> RequestBudgets:
        return self.door.budgets

    @budgets.setter
    def budgets(self, budgets: RequestBudgets) -> None:  # a reload: the door follows
        self.door.budgets = budgets

    def _new_id(self) -> str:
        return f"{self._id_prefix}-{next(self._id_seq):x}"

    def _new_event_id(self) -> str:
        return f"{self._event_prefix}-{next(self._event_seq):x}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.add_routes(
            [
                web.post("/v1/completions", self.completions, expect_handler=expect_continue),
                web.post(
                    "/v1/chat/completions", self.chat_completions, expect_handler=expect_continue
                ),
                web.get("/healthz", self.healthz),
            ]
        )
        # refusals on the head (no key, a body declared over the cap) before any body is read
        app[HEAD_CHECK] = head_check(self.door, self.max_body_bytes)
        # every other answer of its server (no such route, an unreadable body) in the door's shape
        app[ERROR_ANSWER] = error_answer()
        return app

    def metrics_app(self) -> web.Application:
        """``/metrics`` alone, for the worker's ``--metrics-port`` listener: the gateway's
        port (the tenants' and the routers') answers it 404, so no tenant reads the other
        tenants' adapter ids, versions and counts (a worker without ``--metrics-port``
        serves no metrics)."""
        return metrics_app(self.metrics)

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=self.worker.metrics_exposition(),
            headers={"Content-Type": "text/plain; version=0.0.4"},
        )

    async def healthz(self, request: web.Request) -> web.Response:
        started = self.worker.started
        # the worker's id: a router's probe believes only an answer naming the worker it
        # asks about (router.liveness.probe_ok), with the proof of the router secret for its
        # challenge when this gateway holds the secret (frontdoor.gateway_proof)
        body: dict[str, object] = {"ok": started, "worker_id": self.worker.worker_id}
        if (why := unfit(self.worker)) is not None:  # up, and refusing requests as not run
            body["not_run"] = why.failure
        challenge = request.query.get(CHALLENGE_PARAM)
        secret = self.door.router_secret  # the one the forwarded tenants are checked with
        if secret and is_challenge(challenge) and self.worker.gateway_url:
            assert challenge is not None
            body[PROOF_FIELD] = proof(
                secret, challenge, self.worker.worker_id, self.worker.gateway_url
            )
        return web.json_response(body, status=200 if started else 503)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions")

    async def _handle(self, request: web.Request, path: str) -> web.StreamResponse:
        started = time.perf_counter()
        request_id = header_token(request.headers.get("X-Request-Id")) or self._new_id()
        admission, _ = await admit_request(
            self.door, request, Endpoint(path), request_id, self.max_body_bytes
        )
        if isinstance(admission, Refusal):
            if (
                admission.adapter_id is not None
                and admission.tenant_id is not None
                and admission.request_class is not None
            ):  # past `model`: logged
                trace = _Trace(
                    request_id,
                    admission.tenant_id,
                    admission.adapter_id,
                    admission.request_class,
                    started,
                )
                trace.status = (
                    RequestStatus.retry_later
                    if admission.retry_after_s is not None
                    else RequestStatus.refused
                )
                trace.error = admission.reason.value
                self._log(trace)
            return refusal_response(admission)
        trace = _Trace(
            request_id, admission.tenant_id, admission.adapter_id, admission.request_class, started
        )
        trace.prompts, trace.stream = admission.request.prompts, admission.request.stream
        trace.client_wants_usage = admission.request.client_wants_usage
        trace.reroute = admission.reroute
        try:
            try:
                fitted = fit_context(admission.request, self.worker.context_tokens)
            except Refused as exc:  # a bound past the model's context: vLLM would refuse it
                trace.status, trace.error = RequestStatus.refused, exc.reason.value
                return error_response(exc.status, exc.reason, exc.message, exc.field or None)
            return await self._route(request, path, fitted.body, trace, admission.choice)
        finally:
            self.door.leave(admission, trace.prompt_tokens + max(0, trace.output_tokens))
            self._log(trace)

    def cache_salt(self, tenant_id: str) -> str:
        salt = self._salts.get(tenant_id)
        if salt is None:
            salt = self._salts[tenant_id] = cache_salt(self._cache_secret, tenant_id)
        return salt

    async def _route(
        self, request: web.Request, path: str, body: dict[str, Any], trace: _Trace, choice: Choice
    ) -> web.StreamResponse:
        """Serve the version the front door chose, decided once: while it is a canary still
        warming up here, the stable (active) version the same decision named serves."""
        record = choice.record
        if self.worker.is_warming(record.lora_name):
            trace.canary_warming = record.version
            if choice.stable is None:
                trace.status = RequestStatus.retry_later
                trace.error = ServingRefusal.canary_warming
                retry = cold_budget(self.budgets, trace.request_class).retry_after_s
                return error_response(
                    429,
                    ServingRefusal.canary_warming,
                    "the canary version is warming up; retry later",
                    **{"Retry-After": str(retry)},
                )
            record = choice.stable
        trace.record, name = record, record.lora_name
        if (why := unfit(self.worker)) is not None:  # no load and no answer would come
            return self._not_run(trace, why)
        hot = self.worker.is_hot(name)
        trace.tier = Tier.gpu if hot else Tier.host if self.worker.is_on_host(name) else Tier.cold
        self.worker.count_request(name, hot=hot)
        if hot:
            return await self._forward(request, path, body, trace, name)
        return await self._cold(request, path, body, trace, record, choice)

    async def _cold(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        trace: _Trace,
        record: AdapterRecord,
        choice: Choice,
    ) -> web.StreamResponse:
        budget = cold_budget(self.budgets, trace.request_class)
        waited = time.perf_counter()

        def left() -> float:
            return budget.wait_s - (time.perf_counter() - waited)

        fut = await self._ask_load(record, budget, left())
        outcome = await _wait(fut, left()) if fut is not None else None
        while budget.batch_like and _budget_frees_in_time(outcome, left()):
            # the worker's cold-load budget is spent and frees within this request's own
            # wait: it waits for it, as its class may, instead of a 429 at once
            assert outcome is not None
            await asyncio.sleep(outcome.retry_after_s)
            fut = await self._ask_load(record, budget, left())
            outcome = await _wait(fut, left()) if fut is not None else None
        trace.swap_ms = (time.perf_counter() - waited) * 1000
        if outcome is not None and outcome.ok:
            if self.worker.is_warming(record.lora_name):  # a canary warming up: route again
                return await self._route(request, path, body, trace, choice)
            return await self._forward(request, path, body, trace, record.lora_name)
        if outcome is None:  # the wait ran out: the last fetch's failure, if any, says why
            outcome = self.worker.load_failure(record.lora_name)
        reason = (
            outcome.reason
            if outcome
            else LoadDeferral.load_queued
            if fut is not None
            else LoadDeferral.batch_cold_loads_busy
        )
        permanent = outcome is not None and outcome.permanent
        # this worker's own refusal, with another worker left to the router: its 424, so the
        # router sends the request there (the tenant's adapter) instead of the base model
        elsewhere = permanent and trace.reroute and refused_here(reason)
        retry_after = max(
            1,
            round(
                outcome.retry_after_s if outcome and outcome.retry_after_s else budget.retry_after_s
            ),
        )
        if (
            not budget.batch_like
            and self.budgets.interactive.on_cold == "fallback"
            and not elsewhere
        ):
            trace.tier = Tier.base_fallback
            return await self._forward(
                request,
                path,
                body,
                trace,
                self.worker.base_served,
                fallback_reason=reason,
                permanent=permanent,
            )
        if permanent:  # no Retry-After: the same request will be refused the same way
            assert outcome is not None
            trace.status, trace.error = RequestStatus.error, reason
            own = refused_here(reason)
            return error_response(
                PERMANENT_STATUS,
                # whose refusal: this worker's own, or the artifact's (frontdoor.forwarded)
                ServingRefusal.adapter_refused_by_worker
                if own
                else ServingRefusal.adapter_unavailable_permanent,
                permanent_message(record, reason),
                # this worker's own: how long it holds it, which a router remembers
                **({HOLD_HEADER: str(math.ceil(outcome.hold_s))} if own and outcome.hold_s else {}),
            )
        trace.status, trace.error = RequestStatus.retry_later, reason
        return error_response(
            429,
            ServingRefusal.adapter_cold,
            f"adapter is loading ({reason}); retry later",
            **{"Retry-After": str(retry_after)},
        )

    async def _ask_load(
        self, record: AdapterRecord, budget: ColdBudget, wait_s: float
    ) -> asyncio.Future[LoadOutcome] | None:
        """The load's future; a batch-like class's through its bounded cold loads (None: no
        slot of them freed within ``wait_s``)."""
        if budget.batch_like:
            return await self.batch_loads.start(
                record.lora_name,
                self.budgets.batch.max_concurrent_cold_loads,
                lambda: self.worker.request_load(record, wait_s=wait_s),
                wait_s,
            )
        return self.worker.request_load(record)

    async def _forward(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        trace: _Trace,
        served_name: str,
        fallback_reason: str | None = None,
        permanent: bool = False,
    ) -> web.StreamResponse:
        record = trace.record
        assert record is not None
        trace.lora_name = None if fallback_reason else served_name
        headers = {
            "X-Request-Id": trace.request_id,
            "X-Loraplane-Adapter-Version": record.version,
            "X-Loraplane-Tier": trace.tier.value,
        }
        if trace.canary_warming:
            headers[CANARY_WARMING_HEADER] = trace.canary_warming
        if fallback_reason:
            headers[FALLBACK_HEADER] = "base"
            headers[FALLBACK_REASON_HEADER] = fallback_reason
            headers[FALLBACK_PERMANENT_HEADER] = "true" if permanent else "false"
        else:
            headers["X-Loraplane-Lora-Name"] = served_name
        # the tenant's salt on every path (adapter and base fallback): no two tenants share
        # prefix-cache blocks; a client's own cache_salt never gets here (request_fields)
        upstream = {**body, "model": served_name, "cache_salt": self.cache_salt(trace.tenant_id)}
        if trace.stream:  # token counts come from vLLM's usage chunk
            upstream["stream_options"] = {"include_usage": True}
        trace.queue_ms = (time.perf_counter() - trace.started) * 1000
        if (why := unfit(self.worker)) is not None:  # since the route was chosen (a load's wait)
            return self._not_run(trace, why)
        with self.worker.serving(served_name):
            try:
                async with self.worker.upstream.completion(path, upstream) as resp:
                    rename = _ModelName(served_name, trace.adapter_id)
                    if trace.stream:
                        return await self._stream(request, resp, headers, trace, rename)
                    raw = rename(await resp.read())
                    trace.ttft_ms = (time.perf_counter() - trace.started) * 1000
                    self._usage(raw, trace)
                    return web.Response(
                        body=raw, status=200, headers=headers, content_type="application/json"
                    )
            except VllmError as exc:
                # vLLM's 400 is its refusal of the request (a prompt past the context, a token
                # id out of the vocabulary): the client's to fix, so the client's 400 and a
                # refused request, never an error of the adapter (error rates, canary gates)
                refused = exc.reason == VllmErrorCode.bad_request
                trace.status = RequestStatus.refused if refused else RequestStatus.error
                trace.error = exc.reason.failure
                self._failures.note(
                    exc.reason.failure, f"request {trace.request_id} as {served_name}: {exc}"
                )
                if exc.reason == VllmErrorCode.not_found:  # unloaded under us: ask again later
                    return error_response(
                        503,
                        ServingRefusal.adapter_unavailable,
                        "the adapter was unloaded while this request waited; retry",
                        **{"Retry-After": "1"},
                    )
                # vLLM is not there (dead, restarting): the request never ran. Not a wait for
                # a place in flight (also unsent): a busy vLLM is not a worker to park.
                if exc.unsent and exc.reason is VllmErrorCode.unreachable:
                    return self._not_run(trace, exc.reason)
                names = {served_name: trace.adapter_id, self.worker.base_served: trace.adapter_id}
                return error_response(
                    400 if refused else 502, exc.reason.failure, client_message(exc, names)
                )

    def _not_run(self, trace: _Trace, code: VllmErrorCode) -> web.Response:
        """The answer to a request this worker's vLLM never saw, as it is gone or hung: the
        router parks the worker and sends the request to another (docs/router.md)."""
        trace.status, trace.error = RequestStatus.error, code.failure
        return error_response(
            503,
            code.failure,
            "this worker's model server is not answering; retry",
            **{"Retry-After": "1", NOT_RUN_HEADER: code.failure},
        )

    async def _stream(
        self,
        request: web.Request,
        resp: UpstreamResponse,
        headers: dict[str, str],
        trace: _Trace,
        rename: _ModelName,
    ) -> web.StreamResponse:
        chunks = resp.iter_chunks()
        opening = await _first_event(chunks)  # vLLM's refusal there is the answer's (a 400)
        out = web.StreamResponse(
            status=200,
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        await out.prepare(request)
        pending, events, usage_seen, ended = b"", 0, False, False
        first = last = None
        held = 0.0  # seconds our writes waited for the client (its pace, not vLLM's)
        try:
            async for chunk in _chained(opening, chunks):
                last = time.perf_counter()
                if first is None:
                    first = last
                    trace.ttft_ms = (first - trace.started) * 1000
                *whole, pending = (pending + chunk).split(b"\n\n")
                passed: list[bytes] = []
                for event in whole:
                    failed = _error_event(event)
                    if failed is not None:  # vLLM failed mid-stream: cut, as if it were lost
                        if passed:
                            await out.write(b"".join(passed))
                        raise failed
                    if b'"usage"' in event and event.startswith(b"data: {"):
                        usage_only, found = self._stream_usage(event[6:], trace)
                        usage_seen = usage_seen or found
                        if usage_only and not trace.client_wants_usage:
                            continue  # we asked for it, the client did not
                    if event == b"data: [DONE]":
                        ended = True
                    elif event.startswith(b"data: "):
                        events += 1
                    passed.append(rename(event) + b"\n\n")
                if len(pending) > _MAX_EVENT_BYTES:  # not SSE as vLLM writes it: pass it on
                    passed.append(pending)
                    pending = b""
                if passed:
                    if ended:  # the stream's last event: its log goes first
                        self._end_stream(trace, events, usage_seen)
                    before = time.perf_counter()
                    await out.write(b"".join(passed))
                    held += time.perf_counter() - before
            self._end_stream(trace, events, usage_seen)
            if first is not None and last is not None:
                self._observe_decode(last - first, held, trace.output_tokens)
            if pending:
                await out.write(pending)
            await out.write_eof()
            return out
        except (VllmError, UpstreamError) as exc:
            # vLLM lost (the pool's own error: the client's context turns it into a
            # VllmError only past this handler) or failed after the 200 went out: no second
            # answer can follow the first, so the connection is cut without the stream's
            # end, and the client sees a cut stream, never a short one that looks whole
            trace.status, trace.error = RequestStatus.error, exc.reason.failure
            self._failures.note(exc.reason.failure, f"request {trace.request_id} mid-stream: {exc}")
            if request.transport is not None:
                request.transport.abort()
            return out
        finally:  # the client (or vLLM) left before the usage chunk: what streamed counts
            self._count_stream(trace, events, usage_seen)

    @staticmethod
    def _count_stream(trace: _Trace, events: int, usage_seen: bool) -> None:
        """Without vLLM's usage record (an upstream without one, or a stream cut before its
        last chunk), each event streamed counts as one output token: the log's count and
        the tenant's token charge."""
        if not trace.logged and not usage_seen:
            trace.output_tokens = events

    def _end_stream(self, trace: _Trace, events: int, usage_seen: bool) -> None:
        """The stream's counts are final: its RequestLog goes to the sink (once), before the
        stream's last bytes are written."""
        if not trace.logged:
            self._count_stream(trace, events, usage_seen)
            self._log(trace)

    def _observe_decode(self, seconds: float, held: float, tokens: int) -> None:
        """One point of the load-stall estimate, where vLLM's pace is what was measured: the
        tokens after the first over the time from the first streamed chunk to the last (no
        prefill: the prompt's length is the client's), and only when the client held the
        writes for at most ``CLIENT_PACED_SHARE`` of it (a slow reader paces the upstream read
        through us, and would make loads look costlier than they are). Called as the last
        chunk arrives, so the worker matches the span against its loads on its own clock."""
        if tokens > 1 and seconds > 0 and held <= CLIENT_PACED_SHARE * seconds:
            self.worker.observe_decode(seconds, tokens - 1)

    @staticmethod
    def _stream_usage(data: bytes, trace: _Trace) -> tuple[bool, bool]:
        """(is a usage-only chunk, carried usage) for one SSE event's JSON."""
        try:
            obj = json.loads(data)
            usage = obj.get("usage")
            if not isinstance(usage, dict):
                return False, False
            _take_usage(usage, trace)
            return not obj.get("choices"), True
        except _NOT_USAGE:
            return False, False

    @staticmethod
    def _usage(raw: bytes, trace: _Trace) -> None:
        with contextlib.suppress(*_NOT_USAGE):
            _take_usage(json.loads(raw).get("usage") or {}, trace)

    def _log(self, trace: _Trace) -> None:
        """Hand the request's one RequestLog to the sink (a second call does nothing)."""
        if trace.logged:
            return
        trace.logged = True
        record = trace.record
        if record is not None and trace.ttft_ms is not None:
            self.worker.observe_ttft(record.lora_name, trace.ttft_ms)
        log = RequestLog(
            event_id=self._new_event_id(),
            ts=now_utc(),
            request_id=trace.request_id,
            tenant_id=trace.tenant_id,
            base_model=self.worker.base_model,
            adapter_id=trace.adapter_id,
            adapter_version=record.version if record else None,
            lora_name=trace.lora_name,
            worker_id=self.worker.worker_id,
            request_class=trace.request_class,
            tier_at_arrival=trace.tier,
            ttft_ms=trace.ttft_ms,
            swap_ms=trace.swap_ms,
            queue_ms=trace.queue_ms,
            prompts=trace.prompts,
            prompt_tokens=_count(trace.prompt_tokens),
            output_tokens=_count(trace.output_tokens),
            status=trace.status,
            error=trace.error,
        )
        self.sink.emit("requests", trace.adapter_id, log)


def _error_event(event: bytes) -> VllmError | None:
    """vLLM's failure written as a stream's event (``data: {"error": {...}}``: it checks a
    prompt's token ids, and fails a generation, after the stream's 200), as the error its
    status answer would have been; None for any other event."""
    if not event.startswith(b"data: {") or b'"error"' not in event:
        return None
    try:
        error = json.loads(event[6:]).get("error")
    except _NOT_USAGE:
        return None
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    status = code if type(code) is int and 400 <= code <= 599 else 500
    return classify(status, event[6:].decode("utf-8", "replace"))


async def _first_event(chunks: AsyncIterator[bytes]) -> bytes:
    """The stream's bytes up to its first whole event (at most ``_MAX_EVENT_BYTES`` more);
    raises vLLM's error when that event is one, before any answer went to the client."""
    opening = b""
    async for chunk in chunks:
        opening += chunk
        if b"\n\n" in opening or len(opening) > _MAX_EVENT_BYTES:
            break
    failed = _error_event(opening.partition(b"\n\n")[0])
    if failed is not None:
        raise failed
    return opening


async def _chained(opening: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if opening:
        yield opening
    async for chunk in rest:
        yield chunk


def _count(tokens: int) -> int:
    """A token count as a RequestLog holds it (an upstream's odd number never fails a log)."""
    return min(max(0, tokens), 10_000_000)


def _budget_frees_in_time(outcome: LoadOutcome | None, remaining_s: float) -> bool:
    """The load was deferred only because the cold-load budget is spent
    (``LoadDeferral.busy_retry``), and the budget frees before ``remaining_s`` runs out."""
    return (
        outcome is not None
        and not outcome.ok
        and outcome.reason == LoadDeferral.busy_retry
        and 0 < outcome.retry_after_s < remaining_s
    )


async def _wait(fut: asyncio.Future[LoadOutcome], timeout_s: float) -> LoadOutcome | None:
    """The load's outcome if it is known within ``timeout_s`` (0: only if already known)."""
    if fut.done():
        return fut.result()
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout_s) if timeout_s > 0 else None
    except TimeoutError:
        return None
