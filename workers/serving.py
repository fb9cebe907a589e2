"""What the gateway needs from the worker it serves for, and nothing more.

The gateway routes a request to a version, asks for a cold load, forwards to vLLM and
counts what it did; the agent (``workers.agent.WorkerAgent``) implements this. Keeping the
interface narrow keeps the gateway out of the agent's desired state, vLLM client and config:
it can only *ask* for a load, and the agent decides.
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from loraplane.frontdoor.upstream_http import UpstreamResponse
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.reasons import NO_REASON, CacheEventReason, VllmErrorCode

__all__ = ["LoadOutcome", "Serving", "Upstream", "unfit"]


@dataclass(frozen=True)
class LoadOutcome:
    """What a gateway waiting on a cold load learns."""

    ok: bool
    reason: CacheEventReason = NO_REASON
    retry_after_s: float = 0.0
    permanent: bool = False  # retrying will not help: the artifact is refused (gone, bad)
    hold_s: float = 0.0  # permanent: how long the worker still holds it (0: not said)


class Upstream(Protocol):
    """vLLM's completion endpoints; non-200 answers raise ``vllm_client.VllmError``."""

    def completion(
        self, path: str, body: dict[str, Any]
    ) -> AbstractAsyncContextManager[UpstreamResponse]: ...


class Serving(Protocol):
    """One worker as its gateway sees it."""

    @property
    def worker_id(self) -> str: ...

    @property
    def gateway_url(self) -> str:
        """The address this worker's state announces to the routers (the one a gateway's
        proof binds: ``frontdoor.gateway_proof``)."""
        ...

    @property
    def base_model(self) -> str: ...

    @property
    def started(self) -> bool: ...

    @property
    def base_served(self) -> str:
        """The name vLLM serves the base model under (the fallback target)."""
        ...

    @property
    def context_tokens(self) -> int | None:
        """The base model's context in tokens (vLLM's ``max_model_len``); None: not known."""
        ...

    @property
    def upstream(self) -> Upstream: ...

    @property
    def upstream_stalled(self) -> bool:
        """vLLM took the agent's connection and did not answer in time (a hung server): a
        request sent now would wait out the read timeout, so it is refused as not run."""
        ...

    @property
    def wrong_base_model(self) -> bool:
        """vLLM lists another base model than the one adapters are checked against
        (restarted with another model, ``workers.base_model``): a request is refused as not
        run until it serves that model again."""
        ...

    def versions(self, adapter_id: str) -> list[AdapterRecord]:
        """This base model's records of one adapter, newest first."""
        ...

    def is_hot(self, name: str) -> bool: ...

    def is_on_host(self, name: str) -> bool: ...

    def is_warming(self, name: str) -> bool: ...

    def request_load(
        self, record: AdapterRecord, *, wait_s: float = 0.0
    ) -> asyncio.Future[LoadOutcome]:
        """Ask for a cold version to be loaded; the future tells how it went (at once, as
        ``permanent``, while the version's artifact is known to be refused). ``wait_s``: how
        long the request may still wait for the cold-load budget (batch-like; 0: not)."""
        ...

    def load_failure(self, name: str) -> LoadOutcome | None:
        """Why the last fetch of ``name`` failed, while that still holds: the reason a
        request whose wait ran out is told instead of ``load_queued``."""
        ...

    def serving(self, name: str) -> AbstractContextManager[None]:
        """Hold ``name`` for one request (an unload drains it first)."""
        ...

    def count_request(self, name: str, *, hot: bool) -> None: ...

    def observe_ttft(self, name: str, ms: float) -> None: ...

    def observe_decode(self, seconds: float, tokens: int) -> None:
        """A streamed answer vLLM just finished: ``tokens`` decoded in its last ``seconds``, at
        vLLM's pace (what a load beside it costs is measured from these:
        ``workers.load_interference``)."""
        ...

    def metrics_exposition(self) -> bytes: ...


def unfit(worker: Serving) -> VllmErrorCode | None:
    """Why no request may go to ``worker``'s vLLM now: hung (``timeout``), or serving another
    base model than the one adapters are checked against (``wrong_base_model``). None: it
    serves. The gateway refuses requests as not run for it, says it in ``/healthz``, and the
    agent announces it in its state (``WorkerState.not_run``)."""
    if worker.upstream_stalled:
        return VllmErrorCode.timeout
    if worker.wrong_base_model:
        return VllmErrorCode.wrong_base_model
    return None
