"""The planner and the workers' reconcile run together, in simulated time, as the live system
runs them: the real pure ``streams.planner.Planner`` and, per worker, the real pure
``workers.reconcile`` (``fold`` of commands, gateway asks and outcomes; ``reconcile`` of the
desired state against a simulated vLLM and host tier), with what lies between them modelled:
commands reach a worker a tick or two after they are issued, heartbeats reach the planner a
tick after they are published (and only every ``heartbeat_s``, or after an action), workers
restart (adopting what vLLM holds, keeping their applied command ids, silent meanwhile) and
requests reach workers that hold no copy (a gateway ask, with demand admission).

What the loop records is what the live system would show: every command the planner issued,
every fold skip of a planner command (a refusal is ``protected``, ``pinned`` or
``no_free_slot``), every load and unload with its time and why. Tests assert on it
(tests/unit/test_planner_worker_agree.py).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from loraplane.kernel.command_effects import Copy, shows
from loraplane.kernel.policy import Policy
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Compatibility, Priority, Release
from loraplane.schemas.commands import CacheCommand, CommandAction
from loraplane.schemas.reasons import CommandRule, UnloadReason
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.worker_state import CopyOrigin, LoadedAdapter, WorkerState
from loraplane.streams.planner import Planner, WorkerMemory
from loraplane.streams.scores import TAU_1M_S, TAU_10M_S, Decayed, ScoreState, score_key
from loraplane.workers.demand_admission import DemandCounts
from loraplane.workers.reconcile import (
    ActualState,
    Ask,
    BusyRetry,
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
    Unload,
    Usage,
    adopt,
    fold,
    overridden,
    reconcile,
    registry_by_name,
    settled_by,
)

T0 = 1_800_000_000.0
BASE = "llama"
REFUSALS = frozenset({CommandSkip.protected, CommandSkip.pinned})
"""Fold skips of a planner command that are the worker refusing it by a rule the planner
knows (``command_effects.effect``): a move down of a protected or pinned copy."""
SLOT_RACES = frozenset({CommandSkip.no_free_slot, CommandSkip.min_residency})
"""Fold skips of a planner load that found no slot it may take: only when a request's own
load took the slot first, which no state the planner read could show."""


def record(
    adapter: str,
    *,
    version: str = "1",
    status: AdapterStatus = AdapterStatus.active,
    priority: Priority = Priority.silver,
    canary: float = 0.0,
) -> AdapterRecord:
    sha = (adapter.encode().hex() + version + "0" * 64)[:64]
    return AdapterRecord(
        adapter_id=adapter,
        base_model=BASE,
        version=version,
        rank=8,
        artifact_uri=f"s3://loraplane-artifacts/{adapter}/{version}/",
        sha256=sha,
        size_bytes=1000,
        status=status,
        tenant_id=f"t-{adapter}",
        priority=priority,
        compatibility=Compatibility(target_modules=["q_proj"], max_lora_rank=64),
        release=Release(canary_percent=canary),
    )


def views_of(records: list[AdapterRecord]) -> list[AdapterView]:
    by: dict[str, list[AdapterRecord]] = {}
    for r in records:
        by.setdefault(r.adapter_id, []).append(r)
    return [
        AdapterView(
            adapter_id=a,
            tenant_id=rs[0].tenant_id,
            base_model=BASE,
            active_version=next((r.version for r in rs if r.status is AdapterStatus.active), None),
            versions=rs,
            last_seq=1,
            last_event_id="e1",
            updated_at=datetime.fromtimestamp(T0, UTC),
        )
        for a, rs in by.items()
    ]


def steady(qps: float, now: float) -> ScoreState:
    """The score state of ``qps`` requests/s up to ``now``."""
    if qps <= 0:
        return ScoreState()
    return ScoreState(
        requests_10m=Decayed(TAU_10M_S, qps * TAU_10M_S, now),
        requests_1m=Decayed(TAU_1M_S, qps * TAU_1M_S, now),
        last_request=now,
    )


@dataclass(frozen=True)
class Move:
    """A load into or an unload out of one worker's GPU, as the executor carried it out."""

    at: float
    worker: str
    lora: str
    loaded: bool
    reason: UnloadReason | None = None  # an unload's
    command: CacheCommand | None = None  # the planner command that asked for it, if any
    for_never_evict: bool = False  # it made room for a never-evict version's load
    for_request: bool = False  # the worker's own slot_needed, for a request's own load


@dataclass
class SimWorker:
    """One worker agent: its desired state (folded by ``reconcile.fold`` only) and a
    simulated vLLM (``gpu``) and host tier, executed as ``workers.agent`` executes."""

    id: str
    slots: int
    policy: Policy
    desired: DesiredState = field(default_factory=DesiredState)
    gpu: dict[str, str] = field(default_factory=dict)
    host: dict[str, HostEntry] = field(default_factory=dict)
    loaded_by_agent: dict[str, str] = field(default_factory=dict)
    loads: list[float] = field(default_factory=list)
    loaded_at: dict[str, float] = field(default_factory=dict)
    touched: dict[str, float] = field(default_factory=dict)
    demand: DemandCounts | None = None
    inbox: deque[tuple[float, CacheCommand]] = field(default_factory=deque)
    commanded: dict[str, CacheCommand] = field(default_factory=dict)  # lora -> last command
    # make_room's victims whose slot went to a never-evict version's load / to a request's
    displaced_for_never_evict: set[str] = field(default_factory=set)
    displaced_for_request: set[str] = field(default_factory=set)
    started_at: float = -1e18  # its agent's last start (a load before it is not known)
    asked_at: dict[str, float] = field(default_factory=dict)  # a request's load asked, by name
    skipped: dict[str, datetime] = field(default_factory=dict)  # commands it will not carry out
    down_until: float | None = None
    last_beat: float = -1e9
    dirty: bool = True

    def __post_init__(self) -> None:
        tau = self.policy.demand_admission_tau_s
        self.demand = DemandCounts(tau) if tau > 0 else None

    @property
    def up(self) -> bool:
        return self.down_until is None

    def actual(self) -> ActualState:
        return ActualState(
            gpu=dict(self.gpu), host=dict(self.host), loaded_by_agent=dict(self.loaded_by_agent)
        )

    def usage(self, now: float) -> Usage:
        demand = self.demand
        return Usage(
            {},
            self.touched,
            admits=None if demand is None else lambda c, n: demand.admits(c, n, now),
            demand=None if demand is None else lambda n: demand.count(n, now),
            loaded_at=self.loaded_at,
            now=now,
        )


@dataclass
class Loop:
    """The planner and ``workers`` stepped a second at a time."""

    records: list[AdapterRecord]
    workers: list[SimWorker]
    policy: Policy
    rng: random.Random
    qps: dict[str, float] = field(default_factory=dict)  # lora -> requests/s
    now: float = T0
    heartbeat_s: float = 2.0
    planner: Planner = field(default_factory=Planner)
    memory: dict[str, WorkerMemory] = field(default_factory=dict)
    seen: dict[str, WorkerState] = field(default_factory=dict)  # the planner's view
    in_transit: list[tuple[float, WorkerState]] = field(default_factory=list)
    issued: list[CacheCommand] = field(default_factory=list)
    shown: dict[str, float] = field(default_factory=dict)  # command id -> first state showing it
    urgent: set[str] = field(default_factory=set)  # slot_needed demotes for a never-evict load
    planned_on: dict[str, WorkerState | None] = field(default_factory=dict)  # id -> its state
    races: list[CacheCommand] = field(default_factory=list)  # SLOT_RACES with a request's load
    registry_changed: list[float] = field(default_factory=list)  # when the registry changed
    # REFUSALS of a command on its way when a registry change made its copy never-evict
    registry_races: list[CacheCommand] = field(default_factory=list)
    repeated: list[tuple[CacheCommand, CacheCommand]] = field(default_factory=list)
    skipped: list[tuple[CacheCommand, CommandSkip]] = field(default_factory=list)
    moves: list[Move] = field(default_factory=list)

    @property
    def registry(self) -> dict[str, AdapterRecord]:
        return registry_by_name(self.records)

    def guard(self, w: SimWorker) -> Guard:
        return Guard.of(self.registry, self.policy, w.slots)

    def scores(self) -> dict[str, ScoreState]:
        by_name = self.registry
        return {
            score_key(by_name[n].adapter_id, by_name[n].version): steady(q, self.now)
            for n, q in self.qps.items()
            if n in by_name
        }

    # ---- the planner --------------------------------------------------------------------
    def plan(self) -> list[CacheCommand]:
        for at, state in list(self.in_transit):
            if at <= self.now:
                self.seen[state.worker_id] = state
                self.in_transit.remove((at, state))
                self._shown(state)
        live = [
            s
            for s in self.seen.values()
            if self.now - s.ts.timestamp() <= 3 * self.policy.worker_heartbeat_s
        ]
        result = self.planner.tick(
            views_of(self.records), self.scores(), live, self.policy, self.now, self.memory
        )
        self.memory = result.memory
        by_id = {w.id: w for w in self.workers}
        rule = Guard.of(self.registry, self.policy, 1).never_evict
        for cmd, then in zip(result.commands, result.commands[1:], strict=False):
            if (
                cmd.reason.rule is CommandRule.slot_needed
                and then.worker_id == cmd.worker_id
                and then.action is CommandAction.load_gpu
                and then.lora_name in rule
            ):
                self.urgent.add(cmd.command_id)  # the load that follows it takes its slot
        arrive: dict[str, float] = {}  # one transaction per tick, one partition per worker
        for cmd in result.commands:
            self._repeats(cmd)
            self.issued.append(cmd)
            self.planned_on[cmd.command_id] = self.seen.get(cmd.worker_id)
            w = by_id[cmd.worker_id]
            if cmd.worker_id not in arrive:
                arrive[cmd.worker_id] = max(
                    self.now + self.rng.choice((0, 1, 1, 2)), w.inbox[-1][0] if w.inbox else 0.0
                )
            w.inbox.append((arrive[cmd.worker_id], cmd))
        return result.commands

    def _shown(self, state: WorkerState) -> None:
        """Note the commands the planner can see done in ``state`` (``command_effects.shows``;
        a state published before a command was issued shows nothing of it). A move down of
        a GPU copy that a request loaded after the move was issued counts as done and undone
        (``planner.still_pending``): the planner cannot tell whether the move is still on its
        way, and expecting it would free a slot the worker may not have, so it forgets it and
        a later move is a new decision."""
        copies = {a.lora_name: Copy(a.tier, a.pinned) for a in state.adapters}
        requested = {
            a.lora_name: a.loaded_at
            for a in state.adapters
            if a.tier == "gpu" and a.origin is CopyOrigin.gateway_request and a.loaded_at
        }
        for cmd in self.issued[-2000:]:
            if cmd.worker_id != state.worker_id or cmd.command_id in self.shown:
                continue
            loaded_at = requested.get(cmd.lora_name)
            if (
                state.ts >= cmd.issued_at and shows(cmd.action, copies.get(cmd.lora_name, Copy()))
            ) or (
                cmd.action in (CommandAction.demote_to_host, CommandAction.evict)
                and loaded_at is not None
                and loaded_at > cmd.issued_at
            ):
                self.shown[cmd.command_id] = self.now

    def _repeats(self, cmd: CacheCommand) -> None:
        """A repeat: the same action on the same copy issued again within the deadline of the
        last command on that copy, which no state the planner read since has shown done (it
        forgot a command still on its way; one shown done and undone since, or followed by
        another command on the copy, is a new decision)."""
        for earlier in reversed(self.issued[-2000:]):
            if (earlier.worker_id, earlier.lora_name) == (cmd.worker_id, cmd.lora_name):
                if (
                    earlier.action is cmd.action
                    and cmd.issued_at < earlier.deadline
                    and earlier.command_id not in self.shown
                ):
                    self.repeated.append((earlier, cmd))
                return

    # ---- a worker -----------------------------------------------------------------------
    def fold(
        self, w: SimWorker, change: CacheCommand | Ask | Outcome | GuardChanged
    ) -> CommandSkip | None:
        state, guard = w.desired, self.guard(w)
        before = state.intents
        w.desired, skipped = fold(
            state,
            change,
            worker_id=w.id,
            base_model=BASE,
            now=datetime.fromtimestamp(self.now, UTC),
            guard=guard,
            usage=w.usage(self.now),
        )
        for cid in overridden(state, w.desired):
            if cid in w.desired.seen_commands:
                w.skipped[cid] = w.desired.seen_commands[cid]
        for name, intent in w.desired.intents.items():
            if intent.unload_reason is UnloadReason.slot_needed and before.get(name) is not intent:
                urgent = (
                    isinstance(change, CacheCommand | Ask) and change.lora_name in guard.never_evict
                )
                request = isinstance(change, Ask)
                for flag, marked in (
                    (urgent, w.displaced_for_never_evict),
                    (request, w.displaced_for_request),
                ):
                    if flag:
                        marked.add(name)
                    else:
                        marked.discard(name)
        return skipped

    def deliver(self, w: SimWorker) -> None:
        while w.inbox and w.inbox[0][0] <= self.now:
            _, cmd = w.inbox.popleft()
            skipped = self.fold(w, cmd)
            w.commanded[cmd.lora_name] = cmd
            if skipped is not None:
                self.skipped.append((cmd, skipped))
                if skipped is not CommandSkip.duplicate:
                    w.skipped[cmd.command_id] = cmd.deadline
                if skipped in SLOT_RACES and (
                    self._raced(w, cmd) or self._freed_by_a_registry_race(w, cmd)
                ):
                    self.races.append(cmd)
                if skipped in REFUSALS and any(
                    cmd.issued_at.timestamp() <= t <= self.now for t in self.registry_changed
                ):
                    self.registry_races.append(cmd)
            w.dirty = True

    def _freed_by_a_registry_race(self, w: SimWorker, cmd: CacheCommand) -> bool:
        """Was the slot ``cmd`` counted on to be freed by a move down issued with it to ``w``
        that ``w`` refused as a registry race? The load fails with that move, not by itself."""
        return any(
            r.worker_id == w.id and r.issued_at == cmd.issued_at for r in self.registry_races
        )

    def _raced(self, w: SimWorker, cmd: CacheCommand) -> bool:
        """Did a request's load take a GPU slot of ``w`` that the state the planner issued
        ``cmd`` on did not show taken, or take it since? A copy a request asked for since
        counts whatever its origin now: a restart in between adopts it."""
        state = self.planned_on.get(cmd.command_id)
        shown = {a.lora_name for a in state.adapters if a.tier == "gpu"} if state else set()
        return any(
            i.tier == "gpu"
            and (
                w.asked_at.get(n, -1e18) >= cmd.issued_at.timestamp()
                or (i.origin is CopyOrigin.gateway_request and n not in shown)
            )
            for n, i in w.desired.intents.items()
        )

    def request(self, w: SimWorker, lora: str) -> None:
        """A request routed to ``w`` for ``lora`` (``WorkerAgent.request_load``)."""
        r = self.registry.get(lora)
        if r is None or r.status not in (AdapterStatus.active, AdapterStatus.canary):
            return
        if w.demand is not None:
            w.demand.observe(lora, self.policy.priority_value(r.priority), self.now)
        if lora in w.gpu:
            w.touched[lora] = self.now
            return
        gpu_intents = sum(1 for i in w.desired.intents.values() if i.tier == "gpu")
        if gpu_intents >= w.slots and lora not in w.host:
            self.fold(w, Ask.gateway_prefetch(r))
        elif self.fold(w, Ask.gateway_load(r)) is None:
            w.asked_at[lora] = self.now
        w.dirty = True

    def reconcile(self, w: SimWorker) -> None:
        w.loads = [t for t in w.loads if self.now - t < 60.0]
        budget = LoadBudget(self.policy.cold_loads_per_minute_per_worker, tuple(w.loads))
        actions = reconcile(
            w.desired,
            w.actual(),
            self.registry,
            base_model=BASE,
            budget=budget,
            now=self.now,
            gpu_slots=w.slots,
        )
        for action in actions:
            self.execute(w, action)
            outcome = settled_by(action)
            if outcome is not None:
                self.fold(w, outcome)
        if actions:
            w.dirty = True

    def execute(self, w: SimWorker, action: object) -> None:
        match action:
            case Load(name, rec, _, _):
                if len(w.gpu.keys() - {name}) >= w.slots:
                    return
                w.host.setdefault(name, HostEntry(name, f"/host/{name}", rec.sha256, 1000))
                w.gpu[name] = w.loaded_by_agent[name] = f"/host/{name}"
                w.loads.append(self.now)
                w.loaded_at[name] = w.touched[name] = self.now
                self.moves.append(
                    Move(
                        self.now,
                        w.id,
                        name,
                        True,
                        command=self._command(w, name, CommandAction.load_gpu),
                    )
                )
            case Fetch(name, rec, _):
                w.host.setdefault(name, HostEntry(name, f"/host/{name}", rec.sha256, 1000))
            case Unload(name, reason, _) | Conflict(name, reason):
                if name in w.gpu:
                    w.gpu.pop(name)
                    w.loaded_by_agent.pop(name, None)
                    cmd = self._command(w, name, CommandAction.demote_to_host, CommandAction.evict)
                    self.moves.append(
                        Move(
                            self.now,
                            w.id,
                            name,
                            False,
                            reason if isinstance(reason, UnloadReason) else None,
                            cmd,
                            name in w.displaced_for_never_evict
                            or (cmd is not None and cmd.command_id in self.urgent),
                            name in w.displaced_for_request,
                        )
                    )
                    w.displaced_for_never_evict.discard(name)
                    w.displaced_for_request.discard(name)
            case RemoveHost(name, _, _):
                w.host.pop(name, None)
            case Refuse(_, _, cmd) if cmd is not None and cmd in w.desired.seen_commands:
                w.skipped[cmd] = w.desired.seen_commands[cmd]
            case BusyRetry() | Refuse():
                pass

    def _command(self, w: SimWorker, lora: str, *actions: CommandAction) -> CacheCommand | None:
        """The planner command that last set the intent of ``lora``, when it is one of
        ``actions`` (else the worker or a request moved it)."""
        intent = w.desired.intents.get(lora)
        cmd = w.commanded.get(lora)
        if cmd is None or cmd.action not in actions:
            return None
        if intent is not None and intent.command_id not in (None, cmd.command_id):
            return None
        return cmd if intent is None or intent.command_id == cmd.command_id else None

    def beat(self, w: SimWorker) -> None:
        """Publish the worker's state (``WorkerAgent.worker_state``) after a change or every
        ``heartbeat_s``; the planner reads it a second later."""
        if not (w.dirty or self.now - w.last_beat >= self.heartbeat_s):
            return
        registry = self.registry
        adapters = []
        for name in sorted(set(w.gpu) | set(w.host)):
            r = registry.get(name)
            if r is None:
                continue
            intent = w.desired.intents.get(name)
            adapters.append(
                LoadedAdapter(
                    lora_name=name,
                    adapter_id=r.adapter_id,
                    version=r.version,
                    tenant_id=r.tenant_id,
                    tier="gpu" if name in w.gpu else "host",
                    pinned=bool(intent and intent.pinned),
                    protected=name in w.desired.protected,
                    origin=intent.origin if intent else None,
                    size_bytes=r.size_bytes,
                    rank=r.rank,
                    **self._loaded_at(w, name),
                )
            )
        state = WorkerState(
            worker_id=w.id,
            base_model=BASE,
            ts=datetime.fromtimestamp(self.now, UTC),
            gpu_slots_used=len(w.gpu),
            gpu_slots_total=w.slots,
            host_bytes_used=sum(e.size_bytes for e in w.host.values()),
            host_bytes_budget=10**9,
            hbm_usage=None,
            max_lora_rank=64,
            cold_loads_last_minute=len(w.loads),
            adapters=adapters,
            skipped_commands=[c for c, d in w.skipped.items() if d.timestamp() > self.now],
        )
        self.in_transit.append((self.now + 1.0, state))
        w.last_beat, w.dirty = self.now, False

    def _loaded_at(self, w: SimWorker, name: str) -> dict[str, datetime | None]:
        if "loaded_at" not in LoadedAdapter.model_fields:
            return {}
        at = w.loaded_at.get(name) if name in w.gpu else None
        return {"loaded_at": None if at is None else datetime.fromtimestamp(at, UTC)}

    def stop(self, w: SimWorker, for_s: float) -> None:
        """Kill the agent (vLLM and the host tier stay); it starts again ``for_s`` later."""
        w.down_until = self.now + for_s

    def start(self, w: SimWorker) -> None:
        """``WorkerAgent.start``: adopt what vLLM holds and it can vouch for, keep the
        applied command ids and the protected copies (the applied-commands file), report
        those ids as not carried out (their intents are gone), and decide protection again."""
        seen, protected = w.desired.seen_commands, w.desired.protected  # the file keeps them
        w.loaded_by_agent = {}
        w.desired = replace(
            adopt(w.actual(), self.registry), seen_commands=seen, protected=protected
        )
        w.touched = {}
        w.loaded_at = {}
        w.skipped.update((cid, d) for cid, d in seen.items() if d.timestamp() > self.now)
        self.fold(w, GuardChanged())
        w.down_until = None
        w.started_at = self.now
        w.dirty = True

    # ---- the whole fleet ----------------------------------------------------------------
    def step(self, requests: int = 0, misroute: float = 0.1) -> None:
        """One second: the planner ticks, each live worker takes its commands and
        ``requests`` requests (routed to a holder of their version, else to any worker; a
        share ``misroute`` to any worker), reconciles and beats."""
        self.plan()
        names = [n for n, q in self.qps.items() if q > 0]
        weights = [self.qps[n] for n in names]
        for w in self.workers:
            if w.down_until is not None:
                if self.now >= w.down_until:
                    self.start(w)
                else:
                    continue
            self.deliver(w)
        live = [w for w in self.workers if w.up]
        for _ in range(requests if names and live else 0):
            lora = self.rng.choices(names, weights)[0]
            holders = [w for w in live if lora in w.gpu]
            pool = holders if holders and self.rng.random() >= misroute else live
            self.request(self.rng.choice(pool), lora)
        for w in live:
            self.reconcile(w)
            self.beat(w)
        self.now += 1.0

    def change_registry(self, index: int, kind: str) -> None:
        """Change record ``index`` of the registry: ``priority`` flips it between gold and
        platinum (never-evict), ``promote`` makes a canary the active version (the old one
        retired), ``revoke`` revokes it; the workers and the planner see it at once."""
        r = self.records[index]
        records = list(self.records)
        if kind == "priority":
            r = r.model_copy(
                update={
                    "priority": Priority.gold
                    if r.priority is Priority.platinum
                    else Priority.platinum
                }
            )
        elif kind == "promote" and r.status is AdapterStatus.canary:
            records = [
                x.model_copy(update={"status": AdapterStatus.retired})
                if x.adapter_id == r.adapter_id and x.status is AdapterStatus.active
                else x
                for x in records
            ]
            r = r.model_copy(update={"status": AdapterStatus.active})
        elif kind == "revoke":
            r = r.model_copy(update={"status": AdapterStatus.revoked})
        records[index] = r
        self.records = records
        self.guard_changed()

    def undone_too_soon(self) -> list[tuple[Move, Move]]:
        """Each (load, unload) of a GPU copy less than ``min_residency_s`` apart that no rule
        allowed: a revoke, a version no longer serving or a ``demote_when`` condition (the
        planner's ``revoke``, ``not_serving``, ``demote``), a never-evict version's load
        taking the slot, or a request's own load taking the slot of a copy a request loaded
        (those compete by recency and demand admission, not the planner's residency). A load
        before the worker's last restart is not known to it."""
        last: dict[tuple[str, str], Move] = {}
        started = {w.id: w.started_at for w in self.workers}
        out = []
        for m in self.moves:
            key = (m.worker, m.lora)
            if m.loaded:
                last[key] = m
                continue
            load = last.get(key)
            if (
                load is None
                or m.at - load.at >= self.policy.min_residency_s
                or load.at < started[m.worker]
                or m.for_never_evict
                or m.reason is UnloadReason.revoked
                or (m.for_request and load.command is None)
            ):
                continue
            if m.command is not None and m.command.reason.rule in (
                CommandRule.revoke,
                CommandRule.not_serving,
                CommandRule.demote,
            ):
                continue
            out.append((load, m))
        return out

    def guard_changed(self) -> None:
        """The registry changed (``records`` were replaced): every live worker decides
        protection again now, and the planner plans with it from its next tick."""
        self.registry_changed.append(self.now)
        for w in self.workers:
            if w.up:
                self.fold(w, GuardChanged())
                w.dirty = True
