"""Wires one worker process together: vLLM client, host tier, registry, Kafka, agent, gateway.

Kept apart from the agent so the agent and gateway stay testable with injected parts; this
module is the only place that picks the real Kafka/S3/registry implementations.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from aiohttp import web

from loraplane.artifact.model_shape import ModelShape
from loraplane.artifact.model_signing_bundle import SIGNING_EXTRA, SignatureCheck, signing_installed
from loraplane.artifact.verification import WorkerLimits
from loraplane.eventlog.sink import EventSink, KafkaEventSink, SinkMetrics, poll_forever
from loraplane.frontdoor.api_keys import ApiKeysFile
from loraplane.frontdoor.hmac_keys import hmac_key, router_secret
from loraplane.kernel.config import LOOPBACK, Settings
from loraplane.kernel.http_server import Listener, start_sites
from loraplane.kernel.local_files import locked_folder
from loraplane.kernel.progress_metrics import ProgressMetrics, TailMetrics
from loraplane.kernel.tasks import cancel_all
from loraplane.kernel.thread_calls import ThreadCalls
from loraplane.kernel.topic_tail import TopicTail
from loraplane.registry.live import CHECKPOINTS_FILE, VerifiedRegistry
from loraplane.registry.topic import RegistryScope, registry_tail
from loraplane.schemas.keyring import Keyring, KeyringError, KeyringFile
from loraplane.workers.agent import WorkerAgent, WorkerConfig
from loraplane.workers.applied_commands import FILE_NAME as APPLIED_COMMANDS_FILE
from loraplane.workers.artifact_fetch import ArtifactFetcher
from loraplane.workers.base_model import BaseModelWatch, base_model_shape
from loraplane.workers.command_feed import CommandSlotError, KafkaCommandFeed
from loraplane.workers.gateway import Gateway
from loraplane.workers.host_tier import HostTier
from loraplane.workers.host_tier_entry import VIEWS_FILE
from loraplane.workers.vllm_client import VllmClient, VllmError, VllmUnguarded
from loraplane.workers.worker_metrics import CommandBytesMetrics, WorkerMetrics

__all__ = [
    "AGENT_CALLS_WAIT_S",
    "FIRST_READ_S",
    "HostTierInUse",
    "WorkerOptions",
    "base_model_shape",
    "build_host_tier",
    "claim_host_tier",
    "model_signers",
    "serve_worker",
    "served_base_root",
    "verified_registry",
    "worker_registry",
]

log = logging.getLogger("loraplane.worker")
FIRST_READ_S = 10.0  # how long a start waits for the whole registry
AGENT_CALLS_WAIT_S = 10.0
"""How long a stop waits for the agent's calls still running in threads (an install ends at
its download's next chunk, then removes its partial folder) before what they use closes."""


@dataclass(frozen=True)
class WorkerOptions:
    worker_id: str
    base_model: str
    vllm_url: str
    gateway_port: int
    metrics_port: int | None
    host_tier_dir: Path
    host_budget_bytes: int
    max_lora_rank: int = 8
    gpu_slots: int = 2
    tick_s: float = 1.0
    fetch_concurrency: int = 2  # artifact downloads at once (WorkerConfig)
    heartbeat_s: float = 5.0
    model_dir: Path | None = None  # the base model's folder, for shape checks of adapters
    vllm_api_key: str | None = field(default=None, repr=False)  # vLLM's VLLM_API_KEY
    command_slot: int | None = None  # the commands partition to read (None: the id's hash)
    gateway_url: str | None = None  # announced to the routers (None: the loopback gateway)
    vllm_start_timeout_s: float = 120.0  # vLLM healthy by then at the start, else exit


async def served_base_root(vllm: VllmClient, timeout_s: float) -> str | None:
    """The root vLLM lists for its base model in ``/v1/models`` once it is healthy (within
    ``timeout_s``, else VllmError); None when it lists no base model."""
    await vllm.wait_healthy(timeout_s)
    base = next((m for m in await vllm.models() if not m.is_adapter), None)
    return base.root if base is not None else None


def build_host_tier(
    settings: Settings,
    options: WorkerOptions,
    is_protected: Callable[[str], bool],
    shape: ModelShape,
) -> HostTier:
    """The verified host tier, fetching from the allowlisted S3 of ``settings``; adapters
    are checked against the base model's ``shape`` (``base_model_shape``), never loaded
    without them."""
    limits = WorkerLimits(
        base_model=options.base_model,
        max_lora_rank=options.max_lora_rank,
        model=shape,
        base_model_aliases=settings.base_model_aliases,
        require_model=True,
    )
    return HostTier(
        options.host_tier_dir,
        budget_bytes=options.host_budget_bytes,
        limits=limits,
        fetcher=ArtifactFetcher(settings.s3),
        is_protected=is_protected,
        check_signature=SignatureCheck(model_signers(settings.keyring_path)),
    )


def model_signers(path: Path) -> Callable[[], Keyring | None]:
    """The worker's keyring for model-signing bundles, re-read when the file changes; None
    (signed artifacts refused) while it cannot be read. Says at start when the keyring
    trusts model signers but the library is not installed (their artifacts then fail with
    ``model_signing_unavailable`` until it is)."""
    keyring = KeyringFile(path)

    def current() -> Keyring | None:
        try:
            return keyring.current()
        except KeyringError:
            return None

    ring = current()
    if ring is not None and ring.model_signers and not signing_installed():
        log.error(
            "the keyring trusts %d model signer(s) but the model-signing library is "
            "not installed: signed adapters will not load; pip install '%s'",
            len(ring.model_signers),
            SIGNING_EXTRA,
        )
    return current


def verified_registry(
    options: WorkerOptions,
    tail: TopicTail,
    sink: EventSink,
    metrics: WorkerMetrics,
    keyring: KeyringFile,
    scope: RegistryScope | None = None,
) -> VerifiedRegistry:
    """The registry topic as this worker believes it: only views whose signed evidence
    verifies with its own keyring copy (``settings.keyring_path``); the rest is
    dead-lettered and counted (loraplane/registry/live.py). Fed by the live ``tail``
    (scoped to the worker's base model: ``scope``, registry/topic.py); the last verified
    views are kept in the host tier, so the agent serves them while Kafka is away,
    restarts included."""
    return VerifiedRegistry(
        keyring,
        tail.snapshot,
        sink=sink,
        component=f"worker-{options.worker_id}",
        checkpoints_path=options.host_tier_dir / CHECKPOINTS_FILE,
        views_path=options.host_tier_dir / VIEWS_FILE,
        on_refused=metrics.view_refused,
        on_read_failed=metrics.registry_read_failed,
        version=lambda: tail.version,
        scope=scope,
        source=tail,
    )


def worker_registry(
    settings: Settings, options: WorkerOptions, sink: EventSink, metrics: WorkerMetrics
) -> tuple[TopicTail, VerifiedRegistry]:
    """The worker's registry, its base model's views only (registry/topic.py): the scoped
    tail, started once the ``verified_registry`` over it has loaded the saved views, so no
    record of an adapter held from before a restart is read past."""
    scope = RegistryScope([options.base_model])
    tail = registry_tail(settings, f"worker-{options.worker_id}", scope, start=False)
    registry = verified_registry(
        options, tail, sink, metrics, KeyringFile(settings.keyring_path), scope
    )
    return tail.start(), registry


async def _sites(
    settings: Settings, worker_id: str, listeners: list[Listener]
) -> list[web.AppRunner]:
    """Every listener within the shared ``settings.http`` bounds, on ``settings.listen_host``,
    all or none: a port taken ends the start with one line naming it (``SystemExit``), the
    listeners started before it closed."""
    return await start_sites(
        listeners, settings.listen_host, settings.http, process=f"worker {worker_id}"
    )


class HostTierInUse(Exception):
    """Another process holds the host-tier folder (``claim_host_tier``)."""


def claim_host_tier(folder: Path) -> IO[str]:
    """Lock ``folder`` for this worker until the returned file is closed (or the process
    dies); SystemExit naming it when another process holds it. Two agents on one host
    tier would delete each other's installs in flight at their startup scan and overwrite
    each other's applied command ids and saved views."""
    folder.mkdir(parents=True, exist_ok=True)  # its mode as the tier makes it: vLLM reads it
    try:
        return locked_folder(folder, HostTierInUse)
    except HostTierInUse as exc:
        raise SystemExit(f"host tier {exc}: one worker agent per host-tier folder") from None


async def serve_worker(settings: Settings, options: WorkerOptions) -> None:
    """The worker until its stop. The host-tier claim is released only after the agent's
    calls in threads (installs, removals, the saved views, the applied ids) have ended: one
    still writing in the folder past ``AGENT_CALLS_WAIT_S`` keeps it claimed until the
    process exits, so the next agent's start does not scan it under the writer."""
    claim = claim_host_tier(options.host_tier_dir)
    threads = ThreadCalls(f"worker {options.worker_id} host tier {options.host_tier_dir}")
    try:
        await _serve_worker(settings, options, threads)
    finally:
        threads.close_when_drained(claim.close, AGENT_CALLS_WAIT_S)


async def _serve_worker(settings: Settings, options: WorkerOptions, threads: ThreadCalls) -> None:
    vllm = VllmClient(options.vllm_url, api_key=options.vllm_api_key)
    served_root = None
    if options.model_dir is None:  # the shapes of the folder vLLM serves from, if it can say
        try:
            served_root = await served_base_root(vllm, options.vllm_start_timeout_s)
        except VllmError as exc:
            await vllm.close()
            raise SystemExit(f"worker {options.worker_id}: {exc}") from None
    try:
        shape = base_model_shape(options.model_dir, served_root)
    except ValueError as exc:
        await vllm.close()
        raise SystemExit(f"worker {options.worker_id}: {exc}") from None
    sink = KafkaEventSink(settings, f"worker-{options.worker_id}")
    metrics = WorkerMetrics()
    metrics.registry.register(SinkMetrics(sink))
    tail, registry = worker_registry(settings, options, sink, metrics)
    metrics.registry.register(TailMetrics([tail]))
    # The command feed asks the broker for the commands topic's partitions while the registry
    # is read: with the broker away each waits its own bound (FIRST_READ_S,
    # START_METADATA_TIMEOUT_S), side by side rather than one after the other.
    caught_up, built = await asyncio.gather(
        asyncio.to_thread(tail.wait_caught_up, FIRST_READ_S),
        asyncio.to_thread(
            KafkaCommandFeed,
            settings,
            options.worker_id,
            sink,
            keyring=KeyringFile(settings.keyring_path),
            on_refused=metrics.command_refused,
            slot=options.command_slot,
        ),
        return_exceptions=True,
    )
    if isinstance(caught_up, BaseException):
        if not isinstance(built, BaseException):
            built.close()
        raise caught_up
    if not caught_up:
        log.warning(
            "registry not read to its end within %.0f s; serving the saved views until it is",
            FIRST_READ_S,
        )
    if isinstance(built, CommandSlotError):
        tail.stop()
        sink.close(1.0)
        raise SystemExit(f"--command-slot: {built}") from None
    if isinstance(built, BaseException):
        raise built
    feed = built
    # from here every step that fails closes what the earlier ones opened (the listeners
    # started, the tasks, the sink, the feed, the tail, the vLLM client)
    runners: list[web.AppRunner] = []
    tasks: set[asyncio.Future[Any]] = set()
    started = False
    try:
        agent = WorkerAgent(
            WorkerConfig(
                worker_id=options.worker_id,
                base_model=options.base_model,
                vllm_url=options.vllm_url,
                host_budget_bytes=options.host_budget_bytes,
                max_lora_rank=options.max_lora_rank,
                gpu_slots=options.gpu_slots,
                cold_loads_per_minute=settings.policy.cold_loads_per_minute_per_worker,
                gateway_url=options.gateway_url or f"http://{LOOPBACK}:{options.gateway_port}",
                tick_s=options.tick_s,
                fetch_concurrency=options.fetch_concurrency,
                heartbeat_s=options.heartbeat_s,
                start_timeout_s=options.vllm_start_timeout_s,
                applied_commands_path=options.host_tier_dir / APPLIED_COMMANDS_FILE,
                policy=settings.policy,
            ),
            vllm=vllm,
            host_tier=build_host_tier(settings, options, lambda n: agent.is_hot(n), shape),
            registry_loader=registry.records,
            sink=sink,
            metrics=metrics,
            command_partition=lambda: feed.partition,
            # vLLM restarted with another base model is not served: adapters were checked
            # against this one's shapes
            base_watch=BaseModelWatch(shape, root=served_root, model_dir=options.model_dir),
            threads=threads,
        )
        gateway = Gateway(
            agent,
            api_keys=ApiKeysFile.open(settings.api_keys_path),
            budgets=settings.policy.request_budgets,
            sink=sink,
            cache_secret=hmac_key(settings.gateway_secret_path),
            router_secret=router_secret(settings),
            max_body_bytes=settings.http.max_body_bytes,
        )
        metrics.registry.register(ProgressMetrics([feed.progress, tail.progress]))
        metrics.registry.register(CommandBytesMetrics(feed.read_bytes))
        # /metrics on its own port only (the gateway's answers it 404), up before the
        # gateway: a gateway that answers /healthz has its metrics served
        listeners = [Listener(gateway.app(), options.gateway_port, "gateway", "--gateway-port")]
        if options.metrics_port is not None:
            listeners.insert(
                0,
                Listener(gateway.metrics_app(), options.metrics_port, "metrics", "--metrics-port"),
            )
        runners = await _sites(settings, options.worker_id, listeners)
        started = True
        log.info(
            "worker %s: gateway on %s:%d, %s",
            options.worker_id,
            settings.listen_host,
            options.gateway_port,
            "no /metrics (no --metrics-port)"
            if options.metrics_port is None
            else f"/metrics on port {options.metrics_port}",
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        run = asyncio.create_task(agent.run(feed))
        flusher = asyncio.create_task(poll_forever(sink))
        stopped = asyncio.create_task(stop.wait())
        tasks = {run, flusher, stopped}
        done, _ = await asyncio.wait({run, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if run in done:
            try:
                run.result()  # surface a crash of the loop
            except VllmUnguarded as exc:  # a start refused with its reason, no traceback
                raise SystemExit(f"worker {options.worker_id}: {exc}") from None
    finally:  # in this order: docs/worker.md, "`loraplane worker run`"
        # the listeners first: a request in flight ends with the agent still running, so a
        # load it asks for is the agent's, and its fetch is cancelled with the agent's run
        for runner in reversed(runners):
            await runner.cleanup()
        # the agent's loops and fetches have ended before its last state is published
        await cancel_all(tasks)
        # their calls in threads too (no request or loop starts one now): a registry read
        # emits dead letters to the sink
        threads.drain(AGENT_CALLS_WAIT_S)
        if started:  # a worker that never served announces no state
            agent.publish_state()
        sink.close(5.0)
        feed.close()
        tail.stop()
        await vllm.close()
