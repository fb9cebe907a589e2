"""The worker agent: the only thing that touches one vLLM server's LoRA state.

A controller loop, and the only writer of its desired state: commands (from the planner),
loads its gateway asks for on a cold request (``request_load``) and what executing an action
found out (an ``Outcome``) all go through ``_fold``, i.e. ``reconcile.fold``. Every tick
reads the actual state from vLLM (``/v1/models``) and the host tier, asks ``reconcile`` for
actions and executes them; the executor changes vLLM and the host tier, never the desired
state. An artifact download is never awaited by a tick: it runs as a task beside them
(``_start_fetch``, at most ``fetch_concurrency``) and wakes the tick when it ends. On start
it reads vLLM *first* and adopts what it can vouch for, so a restarted agent converges
instead of assuming an empty server. A command it will not carry out is reported in the
heartbeat's ``skipped_commands``, so the planner stops expecting it. Every change is
reported: CacheEvents, a WorkerState heartbeat and Prometheus series; lines that could
repeat at request or tick rate go through ``kernel.log_burst``. The agent is its gateway's
``workers.serving.Serving``. The rules: docs/worker.md, "The reconcile loop".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from loraplane.artifact.refusal import ArtifactError
from loraplane.eventlog.sink import EventSink
from loraplane.kernel.command_effects import Tier
from loraplane.kernel.log_burst import LogBurst
from loraplane.kernel.policy import Policy
from loraplane.kernel.tasks import cancel_all
from loraplane.kernel.thread_calls import ThreadCalls
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.base import LORA_NAME_RE, now_utc, version_key
from loraplane.schemas.cache_event import CacheEvent, CacheEventKind
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.dead_letter import dead_letter_of_observation
from loraplane.schemas.reasons import (
    NO_REASON,
    ArtifactReason,
    CacheEventReason,
    CommandRejection,
    ForeignChange,
    LoadDeferral,
    UnloadReason,
    VllmErrorCode,
)
from loraplane.schemas.worker_state import MAX_SKIPPED_REPORTED, LoadedAdapter, WorkerState
from loraplane.workers.applied_commands import Remembered, load_remembered, save_applied
from loraplane.workers.base_model import BaseModelWatch
from loraplane.workers.demand_admission import DemandCounts, WaitingMisses, any_slot
from loraplane.workers.golden_set import send_golden_set
from loraplane.workers.hbm import HbmProbe
from loraplane.workers.load_interference import LoadWindows, StallEstimate, adapted_budget
from loraplane.workers.reconcile import (
    Action,
    ActualState,
    Ask,
    BusyRetry,
    Change,
    CommandSkip,
    Conflict,
    DesiredState,
    Fetch,
    Guard,
    GuardChanged,
    HostEntry,
    Load,
    LoadBudget,
    Outcome,
    Refuse,
    RemoveHost,
    Settled,
    Unload,
    Usage,
    Vanished,
    adopt,
    fold,
    overridden,
    reconcile,
    registry_by_name,
    settled_by,
    vouched,
)
from loraplane.workers.serving import LoadOutcome, unfit
from loraplane.workers.vllm_client import VllmClient, VllmError
from loraplane.workers.worker_metrics import (
    AdapterLabels,
    ResidencyMetrics,
    Resident,
    WorkerMetrics,
)

__all__ = [
    "LOG_EVERY_S",
    "REFUSED_SKIPS",
    "REGISTRY_GRACE_S",
    "CommandFeed",
    "HostTier",
    "WorkerAgent",
    "WorkerConfig",
]

REGISTRY_GRACE_S = 15.0
"""How long a commanded name unknown to our registry copy waits before it is refused."""
LOG_EVERY_S = 30.0
"""A line that could repeat at request or tick rate is logged once per kind this often, with
a count of the rest (``kernel.log_burst``)."""
log = logging.getLogger("loraplane.worker")


class HostTier(Protocol):
    """The host warm tier (workers/host_tier.py): verified folders by lora name."""

    def ensure(self, record: AdapterRecord) -> Path: ...

    def remove(self, lora_name: str) -> Any: ...

    def entries(self) -> Iterable[Any]: ...  # each as TierEntry: name, path, sha256, intact()

    def stop_fetches(self) -> None: ...  # the downloads in flight end at their next chunk


class CommandFeed(Protocol):
    """Verified commands for this worker (workers/command_feed.py: it refuses, counts and
    dead-letters what ``workers.command_trust`` does not accept, before the fold)."""

    async def next(self, timeout_s: float = 0.5) -> Any: ...

    async def commit(self, message: Any) -> None: ...

    def refuse(self, delivery: Any, reason: CommandRejection, detail: str) -> None: ...


REFUSED_SKIPS: dict[CommandSkip, CommandRejection] = {
    CommandSkip.duplicate: CommandRejection.replayed_command,
    CommandSkip.protected: CommandRejection.protected_copy,
    CommandSkip.pinned: CommandRejection.pinned_copy,
}
"""The fold's skips that are refusals of the command (dead-lettered, counted): a replay, and
a move down the command effects refuse, which the planner predicts and never sends (one is
a disagreement between planner and worker, and pages: dashboards/prometheus)."""


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    base_model: str  # the registry's base_model id this worker serves
    vllm_url: str
    host_budget_bytes: int
    max_lora_rank: int = 8
    gpu_slots: int = 2  # vLLM --max-loras
    cold_loads_per_minute: int = 6
    gateway_url: str = ""
    tick_s: float = 1.0
    heartbeat_s: float = 5.0
    registry_poll_s: float = 0.2  # how often the loader is asked (in memory: a live tail)
    load_backoff_s: float = 5.0
    fetch_concurrency: int = 2  # artifact fetches at once, each a task beside the ticks
    refusal_hold_s: float = 30.0  # an artifact refusal answers requests at once this long
    start_timeout_s: float = 120.0
    # applied command ids and the protected copies survive restarts here
    applied_commands_path: Path | None = None
    policy: Policy = field(default_factory=Policy)  # never-evict rules, warm-up cap


_NOT_LOADED = {
    CommandSkip.no_free_slot: LoadDeferral.no_free_slot,
    CommandSkip.busier_copies: LoadDeferral.busier_copies,
    CommandSkip.min_residency: LoadDeferral.min_residency,
}


def _not_loaded(skip: CommandSkip | None) -> LoadDeferral | None:
    """What a gateway waiter is told when its load ask found no slot to take (else None)."""
    return None if skip is None else _NOT_LOADED.get(skip)


def _install_error(name: str, exc: Exception) -> ArtifactError:
    """An error the host tier let escape, as a retriable refusal: a disk error as the
    ``host_io_error`` the tier makes of its own, anything else (a library meeting a hostile
    answer, a bug; logged with its trace) as ``install_error``, so the load still backs off
    and its waiters hear it."""
    if isinstance(exc, ArtifactError):
        return exc
    what = f"{type(exc).__name__}: {exc}"[:300]
    if isinstance(exc, OSError):
        return ArtifactError.single(ArtifactReason.host_io_error, name, what)
    log.error("installing %s raised %s", name[:80], what, exc_info=exc)
    return ArtifactError.single(ArtifactReason.install_error, name, what)


@dataclass
class _Runtime:
    """Mutable facts the agent learns by acting (not recoverable from vLLM alone)."""

    gpu: dict[str, str] = field(default_factory=dict)
    loaded_by_agent: dict[str, str] = field(default_factory=dict)
    in_flight: Counter[str] = field(default_factory=Counter)
    last_used: dict[str, datetime] = field(default_factory=dict)
    touched: dict[str, float] = field(default_factory=dict)  # last load or request (clock)
    # name -> when this agent loaded it into vLLM (clock, wall): policy.min_residency_s
    loaded_at: dict[str, tuple[float, datetime]] = field(default_factory=dict)
    draining: set[str] = field(default_factory=set)
    cold_loads: list[float] = field(default_factory=list)
    backoff: dict[str, float] = field(default_factory=dict)
    # name -> (the last fetch's or load's outcome, until when requests get it at once, no
    # new fetch; for a refusal, the lowest tier it refuses: host for the artifact, gpu for
    # vLLM's loader: ``Usage.held``, so no command or ask fetches or loads it meanwhile)
    last_failure: dict[str, tuple[LoadOutcome, float, Tier | None]] = field(default_factory=dict)
    awaiting_registry: dict[str, float] = field(default_factory=dict)  # name -> refuse after
    busy_reported: set[str] = field(default_factory=set)
    # planner commands that will not be carried out -> their deadline (the heartbeat's
    # skipped_commands: the planner stops expecting them)
    skipped: dict[str, datetime] = field(default_factory=dict)
    waiters: dict[str, list[asyncio.Future[LoadOutcome]]] = field(default_factory=dict)
    warming: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # canary warm-ups
    fetches: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # in flight, by name
    # the run ended (or ``stop_fetches`` ran): no fetch task or warm-up starts after it, so
    # none outlives the stop's cancel_all (a fetch's thread would hold the host-tier claim)
    stopped: bool = False
    resolved: set[tuple[str, str]] = field(default_factory=set)  # vLLM's resolver copies seen
    failing: set[tuple[str, str]] = field(default_factory=set)  # (action, name) that raised
    # vLLM took its connection and did not answer the last listing of its models in time (a
    # hung server): requests are refused as not run until a listing is answered again
    vllm_stalled: bool = False
    # why the base model vLLM lists is not the one adapters are checked against (None: it
    # is): nothing is loaded and requests are refused as not run until it is again
    wrong_base: str | None = None


class WorkerAgent:
    def __init__(
        self,
        config: WorkerConfig,
        *,
        vllm: VllmClient,
        host_tier: HostTier,
        registry_loader: Callable[[], Iterable[AdapterRecord]],
        sink: EventSink,
        metrics: WorkerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        hbm: Callable[[], float | None] | None = None,
        command_partition: Callable[[], int | None] = lambda: None,
        base_watch: BaseModelWatch | None = None,
        threads: ThreadCalls | None = None,
    ) -> None:
        """``hbm``: the GPU's HBM in use (``workers.hbm``: NVML, None without a GPU).
        ``command_partition``: the commands partition its feed reads now, announced in its
        state so the planner sends there (None: no feed, the planner hashes).
        ``base_watch``: the base model the host tier checks adapters' shapes against
        (``workers.base_model``), compared with the one vLLM lists at each listing (None:
        not compared). ``threads``: where its blocking calls run (the host tier's reads,
        installs and removals, the registry's reads, the applied ids' file), so its owner
        releases the host tier only after them (``workers.runner``)."""
        self.config = config
        self.threads = threads if threads is not None else ThreadCalls("worker agent")
        self._base_watch = base_watch
        self._command_partition = command_partition
        self._hbm = hbm if hbm is not None else HbmProbe().usage
        self.vllm = vllm
        self.host_tier = host_tier
        self.sink = sink
        self.metrics = metrics or WorkerMetrics()
        self.metrics.registry.register(ResidencyMetrics(self.resident))
        self._registry_loader = registry_loader
        self._clock = clock
        self._desired = DesiredState()
        self.records: dict[str, AdapterRecord] = {}
        self.guard = Guard.of({}, config.policy, config.gpu_slots)  # records + policy
        self._rt = _Runtime()
        tau = config.policy.demand_admission_tau_s
        self._demand = DemandCounts(tau) if tau > 0 else None  # None: admission off
        self._waiting = WaitingMisses()  # requests that may wait and needed a load here
        self._stall = StallEstimate()  # what a load costs the batch beside it, measured
        self._loads = LoadWindows()  # when this worker's loads ran, and how long they take
        self._host: dict[str, HostEntry] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._warnings = LogBurst("worker", LOG_EVERY_S, logger=log, clock=clock)
        self._skipped_log = LogBurst(
            "command skipped", LOG_EVERY_S, logger=log, level=logging.INFO, clock=clock
        )
        self._no_slot_log = LogBurst(
            "no GPU slot may be freed for a request's load",
            LOG_EVERY_S,
            logger=log,
            level=logging.INFO,
            clock=clock,
        )
        self._saved_protected: frozenset[str] = frozenset()
        self.started = False
        self.base_served = ""  # the id vLLM serves the base model under (its model path)
        self.context_tokens: int | None = None  # vLLM's max_model_len, once listed

    # ---- serving (workers/serving.py) -------------------------------------------------
    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    @property
    def gateway_url(self) -> str:
        return self.config.gateway_url

    @property
    def base_model(self) -> str:
        return self.config.base_model

    @property
    def upstream(self) -> VllmClient:
        return self.vllm

    def count_request(self, name: str, *, hot: bool) -> None:
        """Every request the gateway routes to a version here, before its load is asked."""
        self.metrics.request(self.labels(name), hot=hot)
        if self._demand is not None:
            record = self.records.get(name)
            weight = 0.0 if record is None else self.config.policy.priority_value(record.priority)
            self._demand.observe(name, weight, self._clock())

    def observe_ttft(self, name: str, ms: float) -> None:
        self.metrics.ttft(self.labels(name), ms)

    def observe_decode(self, seconds: float, tokens: int) -> None:
        """A finished request: one point of the stall estimate (its tokens per second
        against the share of its time that ran beside a load here)."""
        if seconds <= 0 or tokens <= 0:
            return
        now = self._clock()
        self._stall.observe(self._loads.overlap(now - seconds, now), tokens / seconds, now)

    def cold_load_budget(self) -> int:
        """Loads a rolling minute this worker allows itself now: the policy's constant, or
        with ``load_stall_share`` the budget its measured load cost leaves
        (``load_interference.adapted_budget``)."""
        return adapted_budget(
            self.config.cold_loads_per_minute,
            self.config.policy.load_stall_share,
            self._stall.stall(),
            self._loads.load_s,
        )

    def metrics_exposition(self) -> bytes:
        return self.metrics.exposition()

    # ---- registry -------------------------------------------------------------------
    async def refresh_registry(self) -> None:
        """Take the loader's records (``VerifiedRegistry.records``: the last good view,
        merged per adapter, never emptied by a read that failed). A loader that raises
        anyway leaves the current records as they are: serving never depends on Kafka.
        Unchanged records change nothing (the loader is asked every ``registry_poll_s``)."""
        try:
            records = await self.threads.run(lambda: list(self._registry_loader()))
        except Exception as exc:
            self._warnings.note(
                "registry unreadable",
                f"keeping the {len(self.records)} records we have: {exc}"[:300],
            )
            return
        by_name = registry_by_name(records)
        if by_name != self.records or not self.started:
            self.records = by_name
            self.guard = Guard.of(self.records, self.config.policy, self.config.gpu_slots)
            if self.started:
                self._fold(GuardChanged())
        now = self._clock()
        for name, until in list(self._rt.awaiting_registry.items()):
            if name in self.records or until <= now:  # known now, or refused by reconcile
                del self._rt.awaiting_registry[name]
                self._wake.set()

    def versions(self, adapter_id: str) -> list[AdapterRecord]:
        """This base model's records of one adapter, newest first."""
        found = [
            r
            for r in self.records.values()
            if r.adapter_id == adapter_id and r.base_model == self.config.base_model
        ]
        return sorted(found, key=lambda r: version_key(r.version), reverse=True)

    # ---- actual state ---------------------------------------------------------------
    def _read_host(self, gpu: Mapping[str, str], to_load: frozenset[str]) -> dict[str, HostEntry]:
        """The host tier's entries. Only an entry vLLM serves a copy from (``gpu``: lora
        name -> vLLM's root) or one a GPU intent may load now (``to_load``) has its folder's
        fingerprint read: those are the answers ``reconcile.vouched`` and ``_ready`` read,
        and a scan of every entry each tick would cost a directory listing and a stat per
        file for nothing."""
        entries = {}
        for e in self.host_tier.entries():
            looked = gpu.get(e.lora_name) == str(e.path) or e.lora_name in to_load
            entries[e.lora_name] = HostEntry(
                e.lora_name,
                str(e.path),
                e.sha256,
                int(getattr(e, "size_bytes", 0)),
                e.intact() if looked else True,
            )
        return entries

    async def read_actual(self) -> ActualState:
        models = await self.vllm.models()
        self._rt.gpu = {m.id: m.root for m in models if m.is_adapter}
        for gone in self._rt.loaded_at.keys() - self._rt.gpu.keys():
            del self._rt.loaded_at[gone]
        base = next((m for m in models if not m.is_adapter), None)
        if base is not None:
            self.base_served = base.id
            self.context_tokens = base.max_model_len or self.context_tokens
        if self._base_watch is not None:
            root = None if base is None else base.root
            self._note_base(await self.threads.run(self._base_watch.check, root))
        to_load = frozenset(
            n for n, i in self.desired.intents.items() if i.tier == "gpu" and n not in self._rt.gpu
        )
        self._host = await self.threads.run(self._read_host, dict(self._rt.gpu), to_load)
        return ActualState(
            gpu=dict(self._rt.gpu),
            host=dict(self._host),
            loaded_by_agent=dict(self._rt.loaded_by_agent),
            in_flight=dict(self._rt.in_flight),
        )

    def _note_base(self, wrong: str | None) -> None:
        """Whether vLLM serves the base model adapters are checked against, logged when it
        changes."""
        if wrong == self._rt.wrong_base:
            return
        self._rt.wrong_base = wrong
        if wrong is not None:
            log.warning(
                "%s: no adapter is loaded and requests are refused as not run until vLLM "
                "serves the base model again",
                wrong,
            )
        else:
            log.warning("vLLM serves the base model adapters are checked against: serving")

    async def start(self) -> None:
        """Read vLLM's actual state first and adopt what this agent can vouch for."""
        await self.vllm.wait_healthy(self.config.start_timeout_s)
        await self.vllm.require_guard()
        await self.refresh_registry()
        actual = await self.read_actual()
        kept = (
            Remembered()
            if self.config.applied_commands_path is None
            else await self.threads.run(
                load_remembered, self.config.applied_commands_path, now_utc()
            )
        )
        self._desired = replace(
            adopt(actual, self.records), seen_commands=kept.applied, protected=kept.protected
        )  # the fold keeps what still holds
        self._saved_protected = kept.protected
        # A command applied before this start and not carried out by then lost its intent
        # with the restart (the applied file keeps only ids): the planner would expect it
        # until its deadline and plan on a copy that is not coming. Reported as not carried
        # out, it stops being expected; what the ones carried out did is in the state.
        for command_id, deadline in kept.applied.items():
            self._not_carried_out(command_id, deadline)
        # the copies it vouches for are its own from now on: one that vanishes is reported
        self._rt.loaded_by_agent.update(
            (name, root)
            for name, root in actual.gpu.items()
            if vouched(name, root, actual, self.records)
        )
        self._fold(GuardChanged())
        self.started = True
        log.info(
            "worker %s adopted %d adapters (%d on GPU)",
            self.config.worker_id,
            len(self.desired.intents),
            len(actual.gpu),
        )
        await self.reconcile_once()
        self.publish_state()

    # ---- desired state --------------------------------------------------------------
    @property
    def desired(self) -> DesiredState:
        """Read-only outside ``_fold``."""
        return self._desired

    def _fold(self, change: Change, wait_s: float = 0.0) -> CommandSkip | None:
        """The one place the desired state changes (``start`` only sets its first value);
        ``wait_s``: a request's own load may wait that long for the cold-load budget."""
        demand, now = self._demand, self._clock()
        usage = Usage(
            dict(self._rt.in_flight),
            self._rt.touched,
            self._admits(wait_s, now),
            demand=None if demand is None else lambda n: demand.count(n, now),
            loaded_at={n: at for n, (at, _) in self._rt.loaded_at.items()},
            now=now,
            held={
                n: tier
                for n, (_, until, tier) in self._rt.last_failure.items()
                if tier is not None and until > now
            },
        )
        before = self._desired
        self._desired, skipped = fold(
            before,
            change,
            worker_id=self.config.worker_id,
            base_model=self.config.base_model,
            now=now_utc(),
            guard=self.guard,
            usage=usage,
        )
        for cid in overridden(before, self._desired):
            deadline = self._desired.seen_commands.get(cid)
            if deadline is not None:
                self._not_carried_out(cid, deadline)
        return skipped

    def _admits(self, wait_s: float, now: float) -> Callable[[str, str], bool] | None:
        """Demand admission of a request's load (``workers.demand_admission``): None (any
        copy that may move) when ``any_slot`` says so, else a version may replace only a
        copy no busier here."""
        demand = self._demand
        if demand is None:
            return None
        budget = LoadBudget(self.cold_load_budget(), tuple(self._rt.cold_loads))
        in_time = budget.remaining(now) > 0 or budget.retry_after_s(now) <= wait_s
        if any_slot(
            may_wait=wait_s > 0,
            in_time=in_time,
            used=len(budget.used(now)),
            per_minute=budget.per_minute,
            waiting=self._waiting.count(now),
        ):
            return None
        return lambda c, n: demand.admits(c, n, now)

    def _report(self, done: Action) -> None:
        """Feed what a carried-out action found out back into the desired state."""
        outcome = settled_by(done)
        if outcome is not None:
            self._fold(outcome)

    def apply(self, cmd: CacheCommand) -> CommandSkip | None:
        skipped = self._fold(cmd)
        if skipped:
            self._skipped_log.note(
                skipped.value, f"{cmd.command_id}: {cmd.action} {cmd.lora_name[:80]}"
            )
        if skipped is not None and skipped is not CommandSkip.duplicate:
            self._not_carried_out(cmd.command_id, cmd.deadline)
        intent = self.desired.intents.get(cmd.lora_name)
        if intent is None or intent.tier != "gpu":  # a gateway waiter must not wait forever
            self._resolve(cmd.lora_name, LoadOutcome(False, LoadDeferral.superseded_by_command))
        self._rt.busy_reported.discard(cmd.lora_name)
        self._wake.set()
        return skipped

    async def handle(self, cmd: CacheCommand) -> CommandSkip | None:
        """One command from the feed: apply it, reconcile once, then store the applied ids
        (before the caller commits the offset, so a redelivery after a crash is known)."""
        skipped = self.apply(cmd)
        if skipped is None and cmd.lora_name not in self.records:
            # The planner saw a registry change before our tail delivered it: look now
            # rather than refuse a version that is simply newer than our copy.
            await self.refresh_registry()
            if cmd.lora_name not in self.records:
                # The registry topic may trail the planner by a moment: give the tail a
                # grace period before refusing the name as not_in_registry.
                self._rt.awaiting_registry[cmd.lora_name] = self._clock() + REGISTRY_GRACE_S
        await self.reconcile_once()
        if skipped is not None and skipped is not CommandSkip.duplicate:
            self.publish_state()  # the planner stops expecting it at once
        if skipped is not CommandSkip.duplicate:
            await self._remember()
        return skipped

    async def _remember(self) -> None:
        """Store the applied ids and the protected copies (``applied_commands``)."""
        path = self.config.applied_commands_path
        if path is not None:
            protected = self.desired.protected
            try:
                await self.threads.run(
                    save_applied, path, dict(self.desired.seen_commands), protected
                )
            except OSError as exc:  # a full disk: the command still stands, only its memory
                self._warnings.note(  # is at risk; the next save writes every id again
                    "applied command ids not saved: a restart may apply them again",
                    f"{path}: {exc}"[:300],
                )
                return
            self._saved_protected = protected

    def _command_dropped(self, command_id: str | None) -> None:
        """An intent the worker drops without carrying it out (a refusal): its planner
        command, if still within its deadline, is reported (``_not_carried_out``)."""
        deadline = None if command_id is None else self.desired.seen_commands.get(command_id)
        if command_id is not None and deadline is not None:
            self._not_carried_out(command_id, deadline)

    def _not_carried_out(self, command_id: str, deadline: datetime) -> None:
        """Report ``command_id`` in the heartbeat's ``skipped_commands`` until its deadline."""
        now = now_utc()
        self._rt.skipped = {c: d for c, d in self._rt.skipped.items() if d > now}
        if deadline > now:
            self._rt.skipped[command_id] = deadline
        while len(self._rt.skipped) > MAX_SKIPPED_REPORTED:
            del self._rt.skipped[next(iter(self._rt.skipped))]

    def request_load(
        self, record: AdapterRecord, *, wait_s: float = 0.0
    ) -> asyncio.Future[LoadOutcome]:
        """Called by the gateway for a cold adapter: ask for a load (folded like a command,
        origin ``gateway_request``), get its outcome later. ``wait_s``: how long the
        request's class may still wait for the cold-load budget (batch-like; 0: it may
        not), which demand admission weighs (``workers.demand_admission``)."""
        name = record.lora_name
        if wait_s > 0:
            self._waiting.add(self._clock())
        fut: asyncio.Future[LoadOutcome] = asyncio.get_running_loop().create_future()
        if self.is_hot(name):
            fut.set_result(LoadOutcome(True))
            return fut
        known = self.load_failure(name)
        if known is not None and known.permanent:  # retrying will not help: say so at once
            fut.set_result(known)  # and no new fetch until the hold ends
            return fut
        gpu_intents = sum(1 for i in self.desired.intents.values() if i.tier == "gpu")
        if gpu_intents >= self.config.gpu_slots and not self.is_on_host(name):
            # full, and its bytes are not here yet: fetch them first, and let a copy give
            # its slot up only once they are verified (the next request loads it)
            self._fold(Ask.gateway_prefetch(record))
            self._rt.waiters.setdefault(name, []).append(fut)
            self._wake.set()
            return fut
        refused = _not_loaded(self._fold(Ask.gateway_load(record), wait_s=wait_s))
        if refused is not None:
            self._no_slot_log.note(refused.value, name[:80])
            fut.set_result(LoadOutcome(False, refused))
            return fut
        self._rt.waiters.setdefault(name, []).append(fut)
        self._wake.set()
        return fut

    def load_failure(self, name: str) -> LoadOutcome | None:
        """What the last fetch of ``name`` found, while it still holds (a refusal for
        ``refusal_hold_s``, with the seconds left as ``hold_s``; a transient failure until
        its backoff ends, with the seconds left as ``retry_after_s``); None once it was
        fetched or the hold ended."""
        held = self._rt.last_failure.get(name)
        if held is None:
            return None
        outcome, until, _ = held
        left = until - self._clock()
        if left <= 0:
            del self._rt.last_failure[name]
            return None
        return (
            replace(outcome, hold_s=left)
            if outcome.permanent
            else replace(outcome, retry_after_s=left)
        )

    def is_hot(self, name: str) -> bool:
        return name in self._rt.gpu and name not in self._rt.draining

    @property
    def upstream_stalled(self) -> bool:
        return self._rt.vllm_stalled

    @property
    def wrong_base_model(self) -> bool:
        return self._rt.wrong_base is not None

    def is_on_host(self, name: str) -> bool:
        return name in self._host

    def is_warming(self, name: str) -> bool:
        """True while the golden-set warm-up after a load of ``name`` is still running."""
        return name in self._rt.warming

    @contextmanager
    def serving(self, name: str) -> Iterator[None]:
        """Count a request in flight on ``name``: the drain rule waits for it."""
        self._rt.in_flight[name] += 1
        self._rt.touched[name] = self._clock()
        try:
            yield
        finally:
            self._rt.in_flight[name] -= 1
            self._rt.last_used[name] = now_utc()
            self._rt.touched[name] = self._clock()
            if self._rt.in_flight[name] <= 0:
                del self._rt.in_flight[name]
                self._wake.set()

    # ---- the loop ---------------------------------------------------------------------
    async def reconcile_once(self) -> list[Action]:
        """One tick; a heartbeat goes out at once when it found vLLM turn unfit or fit again
        (``WorkerState.not_run``): routers park the worker, or take it back, without
        waiting for the next interval."""
        was = unfit(self)
        actions = await self._reconcile_tick()
        if unfit(self) is not was:
            self.publish_state()
        return actions

    async def _reconcile_tick(self) -> list[Action]:
        async with self._lock:
            try:
                actual = await self.read_actual()
            except VllmError as exc:
                self._warnings.note("vLLM unreadable, skipping ticks", str(exc)[:300])
                if exc.reason is VllmErrorCode.timeout and not self._rt.vllm_stalled:
                    self._rt.vllm_stalled = True
                    log.warning(
                        "vLLM takes connections and does not answer: requests are refused "
                        "as not run (the router sends them elsewhere) until it answers"
                    )
                return []
            if self._rt.vllm_stalled:
                self._rt.vllm_stalled = False
                log.warning("vLLM answers again: serving")
            if self._rt.wrong_base is not None:
                return []  # no load checked against another model's shapes
            self._adopt_resolved(actual)
            now = self._clock()
            self._rt.cold_loads = [t for t in self._rt.cold_loads if now - t < 60.0]
            budget = LoadBudget(self.cold_load_budget(), tuple(self._rt.cold_loads))
            actions = reconcile(
                self.desired,
                actual,
                self.records,
                base_model=self.config.base_model,
                budget=budget,
                now=now,
                backoff=self._rt.backoff,
                awaiting_registry=self._rt.awaiting_registry,
                gpu_slots=self.config.gpu_slots,
                fetching=frozenset(self._rt.fetches),
            )
            self._rt.failing &= {(type(a).__name__, a.lora_name) for a in actions}
            for action in actions:
                try:
                    await self._execute(action)
                except Exception as exc:  # one action's trouble: the others still run
                    self._action_failed(action, exc)
                else:
                    self._rt.failing.discard((type(action).__name__, action.lora_name))
            if actions:
                self.publish_state()
            if self.desired.protected != self._saved_protected:  # a request's load, a registry
                await self._remember()  # change: protection survives a restart as it is now
            return actions

    def _action_failed(self, action: Action, exc: Exception) -> None:
        """An action that raised (a host-tier disk that refuses: permissions changed, a
        folder that cannot be renamed) is logged and, the first time in a row, reported as a
        ``fail`` event (``host_io_error`` for a disk error); the next tick tries it again."""
        name = action.lora_name
        self._warnings.note(
            f"{type(action).__name__} failed; retried next tick",
            f"{name[:80]}: {type(exc).__name__}: {exc}"[:300],
            exc_info=not isinstance(exc, OSError),
        )
        key = (type(action).__name__, name)
        if key in self._rt.failing:
            return
        self._rt.failing.add(key)
        self._event(
            name,
            CacheEventKind.fail,
            reason=ArtifactReason.host_io_error if isinstance(exc, OSError) else NO_REASON,
            detail=f"{type(action).__name__}: {type(exc).__name__}: {exc}",
            command_id=getattr(action, "command_id", None),
        )

    def _adopt_resolved(self, actual: ActualState) -> None:
        """A copy vLLM's host-tier resolver loaded since the last tick was asked for by a
        request that went to vLLM: raise it to the GPU as a gateway load would, else a host
        intent would demote it at once (and the next request resolve it again). Once per
        copy, so a later demote or evict moves it as usual."""
        self._rt.resolved &= set(actual.gpu.items())
        for name, root in sorted(actual.gpu.items()):
            entry = actual.host.get(name)
            record = self.records.get(name)
            if (
                entry is None
                or record is None
                or root == entry.path
                or actual.loaded_by_agent.get(name) == root
                or (name, root) in self._rt.resolved
                or not vouched(name, root, actual, self.records)
            ):
                continue
            self._rt.resolved.add((name, root))
            self._rt.loaded_by_agent[name] = root
            log.info("vLLM resolved %s from the host tier on demand: kept on the GPU", name)
            self._fold(Ask.gateway_load(record))

    async def run(self, feed: CommandFeed | None = None) -> None:
        """Run until cancelled. However it ends, a start still under way included (its
        first reconcile can start fetches), its loops, warm-ups and fetches end with it."""
        tasks: list[asyncio.Task[None]] = []
        try:
            if not self.started:
                await self.start()
            tasks = [
                asyncio.create_task(self._tick_loop()),
                asyncio.create_task(self._heartbeat_loop()),
                asyncio.create_task(self._registry_loop()),
            ]
            if feed is not None:
                tasks.append(asyncio.create_task(self._command_loop(feed)))
            await asyncio.gather(*tasks)
        finally:
            self._rt.stopped = True
            await cancel_all(tasks)  # the others, when one ended: none acts after the run
            await cancel_all(self._rt.warming.values())  # canary warm-ups send no more
            await self.stop_fetches()

    async def stop_fetches(self) -> None:
        """Stop the host tier's downloads and cancel the fetch tasks in flight. An install
        in its thread ends at its download's next chunk (``HostTier.stop_fetches``: about
        one socket read, not the fetch deadline), all or nothing: a complete, verified
        entry or none (its ``.partial-`` folder removed; one a kill leaves is deleted by
        the next start's scan). Nothing is recorded of it here. No fetch starts after this."""
        self._rt.stopped = True
        self.host_tier.stop_fetches()
        await cancel_all(self._rt.fetches.values())

    async def _command_loop(self, feed: CommandFeed) -> None:
        """Never ends by an exception: a command (or a broker hiccup on commit) that makes
        one step fail is logged and the loop goes on. The consumer's position is already
        past it, so the next commit covers it: one bad message can't crash-loop the agent
        (and its gateway) on every restart."""
        while True:
            try:
                await self._next_command(feed)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.metrics.command_loop_error()
                self._warnings.note("command loop step failed; going on", exc_info=True)
                await asyncio.sleep(1.0)

    async def _next_command(self, feed: CommandFeed) -> None:
        delivery = await feed.next(0.5)
        if delivery is None:
            return
        skipped = await self.handle(delivery.command)
        refusal = REFUSED_SKIPS.get(skipped) if skipped is not None else None
        if refusal is not None:
            feed.refuse(
                delivery,
                refusal,
                f"{delivery.command.action} {delivery.command.lora_name}: {skipped}",
            )
        await feed.commit(delivery.message)

    async def _tick_loop(self) -> None:
        while True:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.tick_s)
            self._wake.clear()
            try:
                await self.reconcile_once()
            except Exception:  # a host tier unreadable this tick: the next one reads again
                self._warnings.note("reconcile tick failed; going on", exc_info=True)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                self.publish_state()
            except Exception:  # a state that cannot be built this time: the next one tries
                self._warnings.note("heartbeat not published; going on", exc_info=True)

    async def _registry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.registry_poll_s)
            await self.refresh_registry()

    # ---- actions ----------------------------------------------------------------------
    async def _execute(self, action: Action) -> None:
        match action:
            case Conflict(name, root):
                await self._conflict(name, root)
            case Vanished(name, path):
                self._rt.loaded_by_agent.pop(name, None)
                self._foreign(
                    ForeignChange.copy_vanished,
                    name,
                    path,
                    f"vLLM no longer serves {name!r}, which this agent loaded from "
                    f"{path!r}: unloaded behind the agent's back, or vLLM restarted",
                )
            case Unload(name, reason, cmd):
                await self._unload(name, reason, cmd)
            case RemoveHost(name, reason, cmd):
                await self.threads.run(self.host_tier.remove, name)
                self._host.pop(name, None)
                self._event(name, CacheEventKind.evict, reason=reason, command_id=cmd)
                self._report(action)
            case Fetch():
                self._start_fetch(action)
            case Load(name, record, cmd, warmup):
                if len(self._rt.gpu.keys() - {name}) >= self.config.gpu_slots:
                    return  # the slot's copy got a request since reconcile looked: next tick
                if not self._ready(record):
                    self._start_fetch(action)  # its bytes first; the tick after loads them
                    return
                await self._load(record, cmd, warmup)
            case BusyRetry(name, retry_after_s, cmd):
                self._resolve(name, LoadOutcome(False, LoadDeferral.busy_retry, retry_after_s))
                if name not in self._rt.busy_reported:
                    self._rt.busy_reported.add(name)
                    self._event(
                        name,
                        CacheEventKind.fail,
                        reason=LoadDeferral.busy_retry,
                        detail=f"cold-load budget spent; retry in {retry_after_s:.1f}s",
                        command_id=cmd,
                    )
            case Refuse(name, reason, cmd):
                self._event(name, CacheEventKind.refuse, reason=reason, command_id=cmd)
                self._command_dropped(cmd)
                self._resolve(name, LoadOutcome(False, reason))
                self._report(action)

    async def _conflict(self, name: str, root: str) -> None:
        self.metrics.conflict(self.labels(name))
        self._foreign(
            ForeignChange.unvouched_copy,
            name,
            root,
            f"vLLM serves {name!r} from {root!r}, bytes this agent cannot vouch for",
        )
        self._event(
            name,
            CacheEventKind.kv_namespace_conflict,
            reason=UnloadReason.kv_namespace_conflict,
            detail=f"vLLM serves {name!r} from {root!r}, not loaded by this agent",
        )
        await self._unload(name, UnloadReason.kv_namespace_conflict, None, force=True)

    async def _unload(
        self, name: str, reason: UnloadReason, cmd: str | None, force: bool = False
    ) -> None:
        drain = not force and reason != UnloadReason.revoked
        if drain and self._rt.in_flight.get(name, 0) > 0:
            return  # a request started since reconcile looked; retry next tick
        self._rt.draining.add(name)
        warm_up = self._rt.warming.pop(name, None)
        if warm_up is not None:
            warm_up.cancel()
        try:
            await self.vllm.unload(name)
        except VllmError as exc:
            if exc.reason != VllmErrorCode.not_found:
                self._event(
                    name,
                    CacheEventKind.fail,
                    reason=exc.reason.failure,
                    detail=exc.message,
                    command_id=cmd,
                )
                self._rt.draining.discard(name)
                return
        self._rt.gpu.pop(name, None)
        self._rt.loaded_by_agent.pop(name, None)
        self._rt.touched.pop(name, None)
        self._rt.loaded_at.pop(name, None)
        self._rt.draining.discard(name)
        if reason != UnloadReason.kv_namespace_conflict:
            self._event(name, CacheEventKind.unload, reason=reason, command_id=cmd)

    def _ready(self, record: AdapterRecord) -> bool:
        """Does the host tier hold ``record``'s bytes, verified and unchanged since, as this
        tick read it? Then its load asks the tier inline (no download); else a fetch task
        brings them first."""
        entry = self._host.get(record.lora_name)
        return entry is not None and entry.sha256 == record.sha256 and entry.intact

    def _start_fetch(self, action: Load | Fetch) -> None:
        """Fetch ``action``'s artifact in a task of its own, so that no tick waits for a
        download (a revoke, an unload, a load from the host tier go on meanwhile): at most
        ``fetch_concurrency`` at once, one per name. The tick passes the names in flight to
        ``reconcile`` (``fetching``), which starts nothing for them; a fetch that ends wakes
        the tick, which decides again from the desired state as it is then."""
        name, at_most = action.lora_name, max(1, self.config.fetch_concurrency)
        if self._rt.stopped:
            return  # the stop cancelled the fetches: a later one would outlive it
        if name in self._rt.fetches or len(self._rt.fetches) >= at_most:
            return  # every fetch slot taken: the first to end wakes the tick
        self._rt.fetches[name] = asyncio.create_task(self._fetch_apart(action))

    async def _fetch_apart(self, action: Load | Fetch) -> None:
        """One fetch task: the tier's ``ensure`` outside the agent's lock, then its outcome
        recorded under it (between two ticks), exactly as an inline fetch records it."""
        name, record, cmd = action.lora_name, action.record, action.command_id
        known, started = self._host.get(name), time.perf_counter()
        try:
            got = await self._ensure(record)
            async with self._lock:
                path = self._fetched(record, cmd, got, known, started)
                if path is None and isinstance(action, Load):
                    self.metrics.cold_load(self.labels(name), ok=False)
                elif path is not None and isinstance(action, Fetch):
                    self._prefetched(record)
                self.publish_state()
        except Exception as exc:  # its bookkeeping raised: reported as an action's would be
            self._action_failed(action, exc)
        finally:
            if self._rt.fetches.get(name) is asyncio.current_task():
                del self._rt.fetches[name]
            self._wake.set()

    def _prefetched(self, record: AdapterRecord) -> None:
        """A request waits on a fetched version (a prefetch because every slot was taken):
        now that its bytes are verified, a copy may give its slot up for it, if its host
        intent still stands (a command or a refusal since has answered its waiters)."""
        name = record.lora_name
        intent = self.desired.intents.get(name)
        if intent is None or intent.tier != "host" or not self._rt.waiters.get(name):
            return
        refused = _not_loaded(self._fold(Ask.gateway_load(record)))
        if refused is not None:
            self._resolve(name, LoadOutcome(False, refused))

    async def _ensure(self, record: AdapterRecord) -> Path | ArtifactError:
        """The host tier's verified folder of ``record`` (in a thread), or why not."""
        try:
            return await self.threads.run(self.host_tier.ensure, record)
        except Exception as raised:  # every error is a reason, a backoff and an answer
            return _install_error(record.lora_name, raised)

    async def _fetch(self, record: AdapterRecord, cmd: str | None) -> Path | None:
        """An inline fetch: of a load whose bytes the host tier holds (``_ready``)."""
        known, started = self._host.get(record.lora_name), time.perf_counter()
        return self._fetched(record, cmd, await self._ensure(record), known, started)

    def _fetched(
        self,
        record: AdapterRecord,
        cmd: str | None,
        got: Path | ArtifactError,
        known: HostEntry | None,
        started: float,
    ) -> Path | None:
        """Record what a fetch got: a failure is an event, a backoff (or a refusal's hold
        and dropped intent) and the waiters' answer; a new entry is a ``fetch`` event. None
        unless the folder is there to load."""
        name = record.lora_name
        if isinstance(got, ArtifactError):
            exc = got
            kind = CacheEventKind.fail if exc.is_failure else CacheEventKind.refuse
            self.metrics.host_install_failed(exc.reasons[0])
            self._event(name, kind, reason=exc.reasons[0], detail=str(exc)[:1024], command_id=cmd)
            self._not_loaded(name, exc.reasons[0], None if exc.is_failure else "host")
            return None
        path = got
        if name in self._rt.last_failure and self._rt.last_failure[name][2] != "gpu":
            del self._rt.last_failure[name]  # a vLLM refusal's hold is not the bytes' to end
        if known is not None and known.path == str(path):
            return path
        self._host[name] = HostEntry(name, str(path), record.sha256, record.size_bytes)
        self._event(
            name,
            CacheEventKind.fetch,
            swap_ms=(time.perf_counter() - started) * 1000,
            bytes_=record.size_bytes,
            command_id=cmd,
        )
        return path

    def _not_loaded(self, name: str, reason: CacheEventReason, refused: Tier | None) -> None:
        """A fetch or a load of ``name`` that failed: a transient failure (``refused``
        None) backs the name off for ``load_backoff_s``; a refusal (the same version is
        refused the same way again: by the verifier, ``refused`` "host", or by vLLM's
        loader, "gpu") drops its intent, reports the command that asked for it as not
        carried out, and holds for ``refusal_hold_s``: until the hold ends requests hear it
        at once (``load_failure``) and a command or ask that would fetch or load it again
        is skipped as ``refusal_held`` without a call to the artifact store or vLLM
        (``Usage.held``). The waiters hear it now."""
        if refused is not None:
            intent = self.desired.intents.get(name)
            self._fold(Outcome(name, Settled.refused))
            if intent is not None:
                self._command_dropped(intent.command_id)
            hold = self.config.refusal_hold_s
            outcome = LoadOutcome(False, reason, permanent=True, hold_s=hold)
        else:
            self._rt.backoff[name] = self._clock() + self.config.load_backoff_s
            outcome = LoadOutcome(False, reason, self.config.load_backoff_s)
            hold = self.config.load_backoff_s
        self._rt.last_failure[name] = (outcome, self._clock() + hold, refused)
        self._resolve(name, outcome)

    async def _load(self, record: AdapterRecord, cmd: str | None, warmup: int = 0) -> None:
        name = record.lora_name
        labels = self.labels(name)
        path = await self._fetch(record, cmd)
        if path is None:
            self.metrics.cold_load(labels, ok=False)
            return
        started = self._clock()
        self._rt.cold_loads.append(started)
        try:
            swap_ms = await self.vllm.load(name, str(path))
            await self._confirm_loaded(name, str(path))
        except VllmError as exc:
            self.metrics.cold_load(labels, ok=False)
            refused = exc.reason.refuses_load
            self._event(
                name,
                CacheEventKind.refuse if refused else CacheEventKind.fail,
                reason=exc.reason.failure,
                detail=exc.message,
                command_id=cmd,
            )
            self._not_loaded(name, exc.reason.failure, "gpu" if refused else None)
            return
        self.metrics.cold_load(labels, ok=True, swap_ms=swap_ms)
        self._loads.add(started, self._clock())  # vLLM loads in its step loop: the batch waits
        self._rt.gpu[name] = str(path)
        self._rt.loaded_by_agent[name] = str(path)
        self._rt.touched[name] = self._clock()
        self._rt.loaded_at[name] = (self._clock(), now_utc())
        self._rt.backoff.pop(name, None)
        self._rt.busy_reported.discard(name)
        self._event(
            name, CacheEventKind.load, swap_ms=swap_ms, bytes_=record.size_bytes, command_id=cmd
        )
        if warmup > 0 and not self._rt.stopped:  # marked warming before any waiter hears
            self._rt.warming[name] = asyncio.create_task(self._warm_up(record, warmup))
        self._resolve(name, LoadOutcome(True))

    async def _confirm_loaded(self, name: str, path: str) -> None:
        """Raise ``bad_response`` unless vLLM now lists ``name`` from ``path``: a 200 to the
        load is not taken for a served adapter (a vLLM that answers it and serves nothing
        would have requests sent to a copy that is not there)."""
        listed = {m.id: m.root for m in await self.vllm.models() if m.is_adapter}
        if listed.get(name) != path:
            raise VllmError(
                VllmErrorCode.bad_response,
                f"vLLM answered 200 to loading {name!r} from {path!r} but lists "
                + (f"it from {listed[name]!r}" if name in listed else "no such adapter"),
            )

    async def _warm_up(self, record: AdapterRecord, count: int) -> None:
        name = record.lora_name
        count = min(count, self.guard.max_warmup_requests)  # the fold clamps it too
        try:
            ok = await send_golden_set(
                self.vllm,
                record,
                count,
                worker_id=self.config.worker_id,
                base_model=self.config.base_model,
                serving=self.serving,
                emit=lambda entry: self.sink.emit("requests", record.adapter_id, entry),
            )
            log.info("warm-up of %s done: %d/%d golden requests ok", name, ok, count)
        finally:
            if self._rt.warming.get(name) is asyncio.current_task():
                del self._rt.warming[name]

    def _resolve(self, name: str, outcome: LoadOutcome) -> None:
        for fut in self._rt.waiters.pop(name, []):
            if not fut.done():
                fut.set_result(outcome)

    # ---- reporting --------------------------------------------------------------------
    def _foreign(self, reason: ForeignChange, name: str, path: str, detail: str) -> None:
        """A change to vLLM this agent did not make: a counter by reason and a dead letter
        with what was observed (vLLM's route guard should make it impossible)."""
        self.metrics.foreign_change(reason)
        log.warning("%s: %s", reason.value, detail)
        observed = json.dumps(
            {"lora_name": name, "path": path, "worker_id": self.config.worker_id}
        ).encode()
        self.sink.emit(
            "dead-letters",
            self.config.worker_id,
            dead_letter_of_observation(
                "vllm:/v1/models", name, observed, time.time(), "worker-agent", reason, detail
            ),
        )

    def labels(self, name: str) -> AdapterLabels:
        """A name's Prometheus labels: its registry record's, else ``unknown`` (a label
        value taken from a name vLLM or a request made up would be a new series for good)."""
        record = self.records.get(name)
        if record is not None:
            return AdapterLabels(
                record.adapter_id, record.version, record.tenant_id, self.config.base_model
            )
        return AdapterLabels("unknown", "0", "unknown", self.config.base_model)

    def _described(self, name: str) -> AdapterLabels:
        """A name's fields in an event or the heartbeat: ``labels``, or what the name itself
        says when the registry does not know it (a message, not a series)."""
        parsed = None if name in self.records else LORA_NAME_RE.fullmatch(name)
        if parsed is None:
            return self.labels(name)
        return AdapterLabels(
            parsed["adapter_id"], parsed["version"], "unknown", self.config.base_model
        )

    def _event(
        self,
        name: str,
        kind: CacheEventKind,
        *,
        reason: CacheEventReason = NO_REASON,
        detail: str = "",
        swap_ms: float = 0.0,
        bytes_: int = 0,
        command_id: str | None = None,
    ) -> None:
        labels = self._described(name)
        event = CacheEvent(
            event_id=uuid.uuid4().hex,
            ts=now_utc(),
            worker_id=self.config.worker_id,
            base_model=self.config.base_model,
            tenant_id=labels.tenant_id,
            adapter_id=labels.adapter_id,
            adapter_version=labels.adapter_version,
            lora_name=name[:200],
            kind=kind,
            swap_ms=swap_ms,
            bytes=bytes_,
            reason=reason,
            detail=detail[:1024],
            command_id=command_id,
        )
        log.info(
            "cache event %s %s swap_ms=%.1f %s %s", kind.value, name, swap_ms, reason, detail[:200]
        )
        self.sink.emit("cache-events", labels.adapter_id, event)

    def resident(self) -> list[Resident]:
        """Every copy this worker holds: GPU copies at level gpu, host-tier copies not on GPU
        at level cpu (``vllm:lora_adapter_loaded``, and the heartbeat's adapters). A name
        vLLM serves that the agent neither loaded nor holds in the host tier is not one: it
        is being unloaded as a conflict, and however many vLLM lists, they only count as
        used slots (``gpu_slots_used``)."""
        gpu = self._rt.gpu
        ours = {n for n in gpu if n in self._rt.loaded_by_agent or n in self._host}
        return [
            Resident(
                name,
                "gpu" if name in gpu else "cpu",
                bool((i := self.desired.intents.get(name)) and i.pinned),
                r.rank if (r := self.records.get(name)) else 0,
            )
            for name in sorted(ours | set(self._host))
        ]

    def worker_state(self) -> WorkerState:
        adapters = []
        for copy in self.resident():
            name = copy.adapter_name
            labels = self._described(name)
            intent = self.desired.intents.get(name)
            adapters.append(
                LoadedAdapter(
                    lora_name=name[:200],
                    adapter_id=labels.adapter_id,
                    version=labels.adapter_version,
                    tenant_id=labels.tenant_id,
                    tier="gpu" if copy.level == "gpu" else "host",
                    pinned=copy.pinned,
                    protected=name in self.desired.protected,
                    origin=intent.origin if intent else None,
                    size_bytes=self._resident_bytes(name, self.records.get(name)),
                    rank=copy.rank,
                    last_used=self._rt.last_used.get(name),
                    loaded_at=(
                        loaded[1]
                        if copy.level == "gpu"
                        and (loaded := self._rt.loaded_at.get(name)) is not None
                        else None
                    ),
                    in_flight=self._rt.in_flight.get(name, 0),
                )
            )
        now = self._clock()
        return WorkerState(
            worker_id=self.config.worker_id,
            base_model=self.config.base_model,
            ts=now_utc(),
            gateway_url=self.config.gateway_url,
            gpu_slots_used=len(self._rt.gpu),
            gpu_slots_total=self.config.gpu_slots,
            host_bytes_used=sum(e.size_bytes for e in self._host.values()),
            host_bytes_budget=self.config.host_budget_bytes,
            hbm_usage=self._hbm(),
            max_lora_rank=self.config.max_lora_rank,
            cold_loads_last_minute=sum(1 for t in self._rt.cold_loads if now - t < 60.0),
            cold_load_budget=(
                self.cold_load_budget() if self.config.policy.load_stall_share else None
            ),
            load_stall=self._stall.stall(),
            load_seconds=self._loads.load_s,
            adapters=adapters,
            command_partition=self._command_partition(),
            skipped_commands=[c for c, d in self._rt.skipped.items() if d > now_utc()],
            not_run=None if (code := unfit(self)) is None else code.failure,
        )

    def _resident_bytes(self, name: str, record: AdapterRecord | None) -> int:
        """A copy's bytes: its host-tier entry's, else (a GPU copy adopted without one, or
        an entry that did not record its size) the manifest's, through the registry."""
        entry = self._host.get(name)
        if entry is not None and entry.size_bytes:
            return entry.size_bytes
        return record.size_bytes if record is not None else 0

    def publish_state(self) -> None:
        self.sink.emit("worker-state", self.config.worker_id, self.worker_state())
        self.metrics.heartbeat(time.time())
