"""The planner: registry + scores + worker states -> where each adapter version should be,
and the cache commands that get it there. Pure: no I/O, ``now`` is epoch seconds, so the
policy simulator runs it with simulated time.

Ten rules per base model, applied in order (``_RULES``: one function each, whose docstring
opens with its number; docs/planner.md, "Planner rules", numbers them the same way):
protected cap, unpin, retire, hot set, load, replicas, pin, HBM, host prewarm, host
pressure. Commands issued but not yet visible in a worker's state are remembered
(``WorkerMemory``) and applied on top of it, so nothing is issued twice, and none is issued
that changes nothing or that the worker would refuse (``command_effects.effect``).
``Planner`` keeps what does not depend on time between ticks and re-derives only the rows
of the score keys changed since its last tick; only the top of the ranking is sorted, so a
tick is O(n + m log m) for n versions and the m read in rank order.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import repeat
from typing import Any, Generic, TypeVar

import numpy as np
from pydantic import BaseModel

from loraplane.kernel import collector
from loraplane.kernel.command_effects import (
    Copy,
    copy_at,
    effect,
    may_protect,
    never_evict_rule,
    protected_cap,
    record_facts,
    shows,
)
from loraplane.kernel.policy import Policy
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.commands import CacheCommand, CommandAction
from loraplane.schemas.planner_memory import PlannerMemory
from loraplane.schemas.reasons import CommandRule, WaitReason
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.worker_state import CopyOrigin, LoadedAdapter, WorkerState
from loraplane.streams.planner_candidates import Candidates, Rank, Ranking
from loraplane.streams.planner_columns import BaseRows, Columns, Registry
from loraplane.streams.scores import ScoreState

__all__ = [
    "LOAD_WINDOW_S",
    "Displaceable",
    "FreeHeaps",
    "Plan",
    "Planner",
    "Waiting",
    "WorkerMemory",
    "command_id",
    "plan",
    "replica_targets",
    "still_pending",
]

LOAD_WINDOW_S = 60.0


@dataclass(frozen=True)
class WorkerMemory:
    """What the planner told one worker that the worker's state may not show yet."""

    seq: int = 0  # commands issued to this worker so far: the counter in command ids
    pending: tuple[CacheCommand, ...] = ()
    loads: tuple[float, ...] = ()  # issue times of load_gpu commands in the last minute
    epoch: int = 0  # the planner session that issued its last command (``Planner.tick``)

    def record(self) -> PlannerMemory:
        """The memory as written to the ``planner-memory`` table. Not validated: the
        commands were validated when built and the rest is the planner's own numbers."""
        return PlannerMemory.model_construct(
            seq=self.seq, pending=self.pending, loads=self.loads, epoch=self.epoch
        )

    @classmethod
    def of(cls, record: PlannerMemory) -> WorkerMemory:
        """The memory a (decoded, so validated) table record holds."""
        return cls(seq=record.seq, pending=record.pending, loads=record.loads, epoch=record.epoch)


@dataclass(frozen=True, slots=True)
class Waiting:
    """A hot-set version that could not be loaded this tick, and why."""

    lora_name: str
    score: float
    reason: WaitReason


@dataclass(frozen=True)
class Plan:
    gpu: Mapping[str, tuple[str, ...]]  # lora_name -> workers holding it on GPU once applied
    host: Mapping[str, tuple[str, ...]]  # lora_name -> workers holding it on host only
    commands: list[CacheCommand]
    waiting: list[Waiting]
    memory: dict[str, WorkerMemory]
    scores: Mapping[str, float]  # lora_name -> hot score, for audit


class _Lazy(Mapping[str, Any]):
    """A dict built on first read. ``Plan.gpu``, ``host`` and ``scores`` hold 100k entries
    at scale, and the planner agent reads none of them (the simulator and audits do): a
    tick spent ~40 ms building them."""

    def __init__(self, build: Callable[[], dict[str, Any]]) -> None:
        self._build: Callable[[], dict[str, Any]] | None = build
        self._dict: dict[str, Any] = {}

    def _get(self) -> dict[str, Any]:
        if self._build is not None:
            self._dict, self._build = self._build(), None
        return self._dict

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __eq__(self, other: object) -> bool:
        return self._get() == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._get())


@dataclass
class _Worker:
    """A worker's state with pending commands applied; mutated while planning."""

    state: WorkerState
    gpu: dict[str, bool]  # lora -> pinned
    host: set[str] | frozenset[str]  # host-only copies
    host_bytes: int
    loads: list[float]  # issue times of load_gpu commands in the last minute
    seq: int  # commands issued to this worker so far
    pending: list[CacheCommand] = field(default_factory=list)
    epoch: int = 0  # the planner session of its last command
    host_pinned: set[str] | frozenset[str] = frozenset()  # host-only copies that are pinned
    protected: frozenset[str] = frozenset()  # copies the worker may refuse to move down
    held: frozenset[str] = frozenset()  # copies the worker reported protected
    room: bool = False  # its reported protected copies leave room under its cap
    loaded_at: Mapping[str, float] = field(default_factory=dict)  # GPU copy -> its load (epoch)
    recent: dict[str, float] = field(default_factory=dict)  # lora -> a pending load's issue time
    # (action, lora) of pending commands the worker will not carry out: not issued again
    failed: set[tuple[CommandAction, str]] = field(default_factory=set)
    shared: bool = True
    """``gpu``, ``host`` and ``host_pinned`` are still the worker state's own (``_Tiers``,
    kept between ticks): copied on the first change only, as most workers see none in a tick
    (copying every worker's was ~30 ms of a 100k x 1000 tick)."""

    def own(self) -> set[str]:
        """Make the tiers this worker's own; returns ``host``, now mutable."""
        if self.shared:
            self.gpu, self.host, self.shared = dict(self.gpu), set(self.host), False
            self.host_pinned = set(self.host_pinned)
        assert isinstance(self.host, set)
        return self.host

    @property
    def id(self) -> str:
        return self.state.worker_id

    def free_slots(self) -> int:
        return self.state.gpu_slots_total - len(self.gpu)

    def loads_left(self, policy: Policy) -> int:
        return self.state.load_budget(policy.cold_loads_per_minute_per_worker) - len(self.loads)

    def hbm_above(self, watermark: float) -> bool:
        """The worker's reported HBM use is above ``watermark`` (unknown: it is not)."""
        return self.state.hbm_usage is not None and self.state.hbm_usage > watermark

    def may_load(self, policy: Policy) -> bool:
        """May take a load: load budget left, HBM at most the low watermark, and serving
        (a worker whose state says ``not_run`` carries out no load)."""
        return (
            self.loads_left(policy) > 0
            and not self.hbm_above(policy.hbm_low_watermark)
            and self.state.serves
        )

    def memory(self) -> WorkerMemory:
        return WorkerMemory(
            seq=self.seq, pending=tuple(self.pending), loads=tuple(self.loads), epoch=self.epoch
        )

    def may_protect(self, lora: str, rule: Callable[[str], bool]) -> None:
        """A copy of ``lora`` is expected here now: with room under its cap, the worker may
        protect it if its never-evict ``rule`` holds (``command_effects.may_protect``)."""
        if (
            self.room
            and lora not in self.protected
            and rule(lora)
            and (lora in self.gpu or lora in self.host)
        ):
            self.protected = self.protected | {lora}

    def settled(self, lora: str, now: float, policy: Policy) -> bool:
        """Is this worker's GPU copy of ``lora`` past ``policy.min_residency_s`` since its
        load (the worker's ``loaded_at``, else the issue time of a load still pending)? A
        copy whose load time is unknown (found on vLLM when the worker started) is."""
        at = self.recent.get(lora)
        if at is None:
            at = self.loaded_at.get(lora)
        return at is None or now - at >= policy.min_residency_s


_MOVES_DOWN = frozenset({CommandAction.demote_to_host, CommandAction.evict})


def _reflected(
    cmd: CacheCommand, loaded: Mapping[str, LoadedAdapter], reloaded_after: bool = False
) -> bool:
    """Does the worker's reported state (``loaded``: its adapters by name) already show the
    command's effect (``kernel.command_effects.shows``)? A move down of a GPU copy loaded
    after the command was issued was carried out and undone since, when a request loaded
    the copy again or a load the planner issued after the move (``reloaded_after``) did:
    expecting it still would free a slot the worker does not have. A copy the planner's
    own load put there, with no load issued after the move, is that earlier load's doing,
    landed after the move was issued: the move is still on its way."""
    a = loaded.get(cmd.lora_name)
    if a is None:
        return shows(cmd.action, Copy())
    if (
        cmd.action in _MOVES_DOWN
        and a.tier == "gpu"
        and a.loaded_at is not None
        and a.loaded_at > cmd.issued_at
        and (a.origin is not CopyOrigin.planner or reloaded_after)
    ):
        return True
    return shows(cmd.action, Copy(a.tier, a.pinned))


def still_pending(
    pending: Iterable[CacheCommand],
    loaded: Mapping[str, LoadedAdapter],
    now: float,
    skipped: Container[str] = (),
) -> list[CacheCommand]:
    """The commands of ``pending`` (in issue order) to keep within their deadline: those
    the worker reported it will not carry out (``skipped``: remembered, so the same command
    is not issued again before its deadline, but no longer expected), and those not shown in
    its state (``loaded``) or issued after a command of the same name that is kept. The
    worker applies one name's commands in order, so a later one that shows (an ``unpin``
    after a ``pin`` it has not applied yet, a ``demote_to_host`` after a ``load_gpu`` still
    waiting for the load budget) is not done until the earlier ones are: forgetting it alone
    would leave the earlier one expected on its own, and the rule that issued the later one
    would issue it again every tick until the earlier one's deadline."""
    kept: list[CacheCommand] = []
    waiting: set[str] = set()  # names with an earlier command expected
    last_load: dict[str, datetime] = {}  # name -> the issue time of its latest pending load
    for c in pending:
        if c.action is CommandAction.load_gpu:
            last_load[c.lora_name] = c.issued_at
    for c in pending:
        if c.deadline.timestamp() <= now:
            continue
        if c.command_id in skipped:
            kept.append(c)
            continue
        load = last_load.get(c.lora_name)
        if c.lora_name in waiting or not _reflected(
            c, loaded, load is not None and load > c.issued_at
        ):
            kept.append(c)
            waiting.add(c.lora_name)
    return kept


@dataclass(frozen=True)
class _Tiers:
    """What a worker state says it holds (a worker copies it before changing it), and what
    the worker may refuse to move down by its own never-evict rule."""

    gpu: dict[str, bool]  # lora -> pinned
    host: frozenset[str]  # host-only copies
    host_pinned: frozenset[str] = frozenset()  # host-only copies that are pinned
    held: frozenset[str] = frozenset()  # copies the worker reports protected
    protected: frozenset[str] = frozenset()  # copies it may protect (``may_protect``)
    room: bool = False  # the protected copies it reported leave room under its cap
    loaded_at: Mapping[str, float] = field(default_factory=dict)  # GPU copy -> load (epoch)

    @classmethod
    def of(
        cls, state: WorkerState, rule: Callable[[str], bool] = lambda _: False, cap: int = 1
    ) -> _Tiers:
        """``rule``: does the worker's never-evict rule hold for a lora name
        (``command_effects.never_evict_rule`` on the planner's record); ``cap``: how many
        copies it protects at most (``command_effects.protected_cap`` of its slots)."""
        adapters = state.adapters
        names = [a.lora_name for a in adapters]
        held = frozenset(a.lora_name for a in adapters if a.protected)
        may = may_protect(held, names, frozenset(filter(rule, names)), cap)
        return cls(
            {a.lora_name: a.pinned for a in adapters if a.tier == "gpu"},
            frozenset(a.lora_name for a in adapters if a.tier != "gpu"),
            frozenset(a.lora_name for a in adapters if a.tier != "gpu" and a.pinned),
            held,
            may.copies,
            may.room,
            {
                a.lora_name: a.loaded_at.timestamp()
                for a in adapters
                if a.tier == "gpu" and a.loaded_at is not None
            },
        )


def _effective(
    state: WorkerState,
    tiers: _Tiers,
    memory: WorkerMemory,
    records: Mapping[str, AdapterRecord],
    now: float,
    rule: Callable[[str], bool] = lambda _: False,
) -> _Worker:
    """The worker as the planner expects it once its pending commands apply (``rule``: the
    worker's never-evict rule, for the copies they bring)."""
    adapters = state.adapters
    w = _Worker(
        state=state,
        gpu=tiers.gpu,
        host=tiers.host,
        host_pinned=tiers.host_pinned,
        protected=tiers.protected,
        held=tiers.held,
        room=tiers.room,
        loaded_at=tiers.loaded_at,
        host_bytes=state.host_bytes_used,
        loads=[t for t in memory.loads if now - t < LOAD_WINDOW_S],
        seq=memory.seq,
        epoch=memory.epoch,
    )
    if memory.pending:
        skipped = frozenset(state.skipped_commands)
        w.pending = still_pending(memory.pending, {a.lora_name: a for a in adapters}, now, skipped)
        for c in w.pending:
            if c.command_id in skipped:
                w.failed.add((c.action, c.lora_name))
                continue
            if c.action is CommandAction.load_gpu:
                w.recent[c.lora_name] = c.issued_at.timestamp()
            r = records.get(c.lora_name)
            _apply(
                w,
                c.action,
                c.lora_name,
                r.size_bytes if r is not None else 0,
                c.lora_name in w.protected,
            )
            w.may_protect(c.lora_name, rule)
    return w


def _copy_on(w: _Worker, lora: str) -> Copy:
    if lora in w.gpu:
        return copy_at("gpu", w.gpu[lora])
    return copy_at("host", lora in w.host_pinned) if lora in w.host else copy_at("gone", False)


def _apply(
    w: _Worker, action: CommandAction, lora: str, size: int, protected: bool = False
) -> None:
    """Expect ``action``'s effect (``kernel.command_effects``) on ``w``'s copy of ``lora``;
    ``protected``: the worker holds it never-evict and refuses to move it down."""
    before = _copy_on(w, lora)
    _move(w, lora, before, effect(action, before, protected).after, size)


def _move(w: _Worker, lora: str, before: Copy, after: Copy, size: int) -> None:
    """Move ``w``'s copy of ``lora`` (``size`` bytes) from ``before`` to ``after``."""
    if after == before:
        return
    host = w.own()
    if after.tier == "gpu":
        w.gpu[lora] = after.pinned
    else:
        w.gpu.pop(lora, None)
    if after.tier == "host":
        host.add(lora)
    else:
        host.discard(lora)
    pinned_host = w.host_pinned
    assert isinstance(pinned_host, set)  # own() made it mutable
    if after.tier == "host" and after.pinned:
        pinned_host.add(lora)
    else:
        pinned_host.discard(lora)
    if before.present != after.present:
        w.host_bytes = w.host_bytes + size if after.present else max(0, w.host_bytes - size)


def command_id(worker_id: str, action: str, lora: str, seq: int, epoch: int = 0) -> str:
    """The id of a worker's ``seq``-th command under planner session ``epoch``: unique per
    (seq, epoch), so a takeover whose counter went back (a replayed ``planner-memory``
    record) still issues ids the worker never saw. Epoch 0 (no lease: the simulator,
    ``plan show``) adds nothing to the hashed text."""
    text = f"{worker_id}|{action}|{lora}|{seq}" + (f"|{epoch}" if epoch else "")
    digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    return f"c{digest}"


class _Planner:
    def __init__(
        self,
        policy: Policy,
        now: float,
        rule: Callable[[str], bool] = lambda _: False,
        epoch: int = 0,
    ) -> None:
        """``rule``: does a worker's never-evict rule hold for a lora name. ``epoch``: the
        planner session's, in every command id it issues."""
        self.policy = policy
        self.now = now
        self.rule = rule
        self.epoch = epoch
        self.commands: list[CacheCommand] = []
        self.waiting: list[Waiting] = []
        self.issued_at = datetime.fromtimestamp(now, UTC)
        self.deadline = self.issued_at + timedelta(seconds=policy.command_deadline_s)
        self.validated: CacheCommand | None = None

    def issue(
        self,
        w: _Worker,
        action: CommandAction,
        record: AdapterRecord,
        lora: str,
        rule: CommandRule,
        score: float | None,
        detail: str = "",
        warmup: int = 0,
    ) -> bool:
        """Issue one command; whether it was. Never one the worker would refuse by its own
        rules (``command_effects.effect`` on the copy expected there: a move down of a pinned
        copy, or of one it may protect, ``_Worker.protected``), nor one that would change
        nothing there (a command still pending already asks for it), nor the same command as
        one the worker reported it will not carry out, before that one's deadline. Its fields
        come from validated records, worker states and the policy, so only the tick's first
        command is validated; the others are copies of it with every field replaced (a cold
        tick issues ~30k commands; validating each doubled their cost)."""
        before = _copy_on(w, lora)
        protected = lora in w.protected
        outcome = effect(action, before, protected)
        after = outcome.after
        if outcome.refused is not None or after == before or (action, lora) in w.failed:
            return False
        w.seq += 1
        w.epoch = self.epoch
        reason = {
            "rule": rule,
            "score": None if score is None else round(score, 6),
            "detail": detail[:512],
        }
        fields = {
            "command_id": command_id(w.id, action.value, lora, w.seq, self.epoch),
            "worker_id": w.id,
            "action": action,
            "base_model": record.base_model,
            "tenant_id": record.tenant_id,
            "adapter_id": record.adapter_id,
            "version": record.version,
            "sha256": record.sha256,
            "lora_name": lora,
            "reason": reason,
            "issued_at": self.issued_at,
            "deadline": self.deadline,
            "warmup_requests": warmup,
        }
        if self.validated is None:
            cmd = self.validated = CacheCommand.model_validate(fields)
        else:
            fields["reason"] = _like(self.validated.reason, reason)
            cmd = _like(self.validated, fields)
        w.pending.append(cmd)
        if action is CommandAction.load_gpu:
            w.loads.append(self.now)
            w.recent[lora] = self.now
        _move(w, lora, before, after, record.size_bytes)
        w.may_protect(lora, self.rule)
        self.commands.append(cmd)
        return True


_M = TypeVar("_M", bound=BaseModel)


def _like(template: _M, values: dict[str, Any]) -> _M:
    """``template.model_copy(update=values)`` where ``values`` holds every field the
    template was given, without pydantic's copies of its dict, fields set and extras (a
    third of a command's cost): same class, same fields set, nothing validated."""
    model = _new(type(template))
    _setattr(model, "__dict__", {**template.__dict__, **values})
    _setattr(model, "__pydantic_fields_set__", template.__pydantic_fields_set__)
    _setattr(model, "__pydantic_extra__", template.__pydantic_extra__)
    _setattr(model, "__pydantic_private__", template.__pydantic_private__)
    return model


_new = object.__new__
_setattr = object.__setattr__


class Planner:
    """The planner of one process, for its whole life: keeps the registry and score columns
    (``streams.planner_columns``) between ticks, so a tick re-derives only what changed.
    ``tick`` takes the same inputs as ``plan`` and returns the same ``Plan``."""

    def __init__(self) -> None:
        self._columns = Columns()
        self._tiers: dict[str, _Tiers] = {}  # worker_id -> tiers of its last state object
        self._tiers_of: dict[str, WorkerState] = {}
        self._rules_of: tuple[Registry, Policy] | None = None  # what ``_never_evict`` is of
        self._never_evict: dict[str, bool] = {}  # lora -> the workers' never-evict rule holds

    def tick(
        self,
        views: Iterable[AdapterView],
        scores: Mapping[str, ScoreState],
        workers: Iterable[WorkerState],
        policy: Policy,
        now: float,
        memory: Mapping[str, WorkerMemory] | None = None,
        scheduled: Mapping[str, float] | None = None,
        changed: Iterable[str] | None = None,
        epoch: int = 0,
    ) -> Plan:
        """One planning tick. ``scheduled`` maps adapter_id -> scheduled warm-up score
        (streams.schedules.warmup_scores); ``memory`` is the previous plan's ``memory``;
        ``changed``: the score keys added, replaced or removed since this planner's last
        tick (None: unknown, every key is compared), so only their rows are read again.
        ``epoch``: the planner session's (``planner_runtime``), in every command id. The
        garbage collector is held off meanwhile (``collector.held_off``): a cold tick builds
        100k-row columns that each young collection would walk again."""
        with collector.held_off():
            return self._tick(
                views, scores, workers, policy, now, memory, scheduled, changed, epoch
            )

    def _tick(
        self,
        views: Iterable[AdapterView],
        scores: Mapping[str, ScoreState],
        workers: Iterable[WorkerState],
        policy: Policy,
        now: float,
        memory: Mapping[str, WorkerMemory] | None,
        scheduled: Mapping[str, float] | None,
        changed: Iterable[str] | None,
        epoch: int = 0,
    ) -> Plan:
        memory = memory or {}
        registry, columns = self._columns.update(views, scores, changed)
        records = registry.records
        table = Candidates(registry, columns, scheduled or {}, policy, now)
        fleet: dict[str, list[_Worker]] = defaultdict(list)
        states = sorted(workers, key=lambda s: s.worker_id)
        rule = self._worker_rule(registry, policy)
        self._tiers = {
            s.worker_id: self._tiers[s.worker_id]
            if self._tiers_of.get(s.worker_id) is s
            else _Tiers.of(s, rule, protected_cap(policy, s.gpu_slots_total))
            for s in states
        }
        self._tiers_of = {s.worker_id: s for s in states}
        for state in states:
            fleet[state.base_model].append(
                _effective(
                    state,
                    self._tiers[state.worker_id],
                    memory.get(state.worker_id, WorkerMemory()),
                    records,
                    now,
                    rule,
                )
            )

        p = _Planner(policy, now, rule, epoch)
        no_rows = BaseRows({}, np.zeros(0, np.intp))
        for base in sorted(set(registry.bases) | set(fleet)):
            _plan_base(p, table, registry.bases.get(base, no_rows), registry, fleet.get(base, []))

        workers_out = [w for ws in fleet.values() for w in ws]
        new_memory = {**memory, **{w.id: w.memory() for w in workers_out}}
        return Plan(
            _Lazy(lambda: _placement(workers_out, "gpu")),
            _Lazy(lambda: _placement(workers_out, "host")),
            p.commands,
            p.waiting,
            new_memory,
            _Lazy(
                lambda: dict(
                    zip(
                        registry.ranked[0],
                        table.score[registry.ranked[1]].tolist(),
                        strict=True,
                    )
                )
            ),
        )

    def prime(
        self,
        views: Iterable[AdapterView],
        scores: Mapping[str, ScoreState],
        changed: Iterable[str] | None = None,
    ) -> None:
        """Bring the registry and score columns up to date without planning (``changed``
        as for ``tick``). A standby keeps its planner primed as records arrive
        (``streams.planner_runtime``), so the first tick after it takes over derives what
        changed since, not every column (~0.5 s at 100k versions); the collector held off
        as in ``tick``."""
        with collector.held_off():
            self._columns.update(views, scores, changed)

    def _worker_rule(self, registry: Registry, policy: Policy) -> Callable[[str], bool]:
        """Does a worker's never-evict rule hold for a lora name: the workers' own
        predicate (``command_effects.never_evict_rule``, on the record and the policy alone)
        on our record of it, remembered until the registry or the policy changes (then the
        cached worker tiers, which read it, are derived again)."""
        if (
            self._rules_of is None
            or self._rules_of[0] is not registry
            or self._rules_of[1] is not policy
        ):
            self._rules_of, self._never_evict, self._tiers_of = (registry, policy), {}, {}
        memo, records, conditions = self._never_evict, registry.records, policy.never_evict
        # The rule reads a record's status and its ``record_facts`` alone: a handful of
        # distinct combinations, each decided once (a cold tick asks for ~27k names).
        by_facts: dict[tuple[Any, ...], bool] = {}

        def rule(lora: str) -> bool:
            holds = memo.get(lora)
            if holds is None:
                record = records.get(lora)
                if record is None:
                    holds = False
                else:
                    key = (record.status, *record_facts(record).values())
                    holds = by_facts.get(key)
                    if holds is None:
                        holds = by_facts[key] = never_evict_rule(record, conditions) is not None
                memo[lora] = holds
            return holds

        return rule


def _placement(workers: list[_Worker], tier: str) -> dict[str, tuple[str, ...]]:
    """lora_name -> the workers holding it in ``tier`` ("gpu" or "host")."""
    holders: dict[str, list[str]] = defaultdict(list)
    for w in workers:
        for lora in getattr(w, tier):
            holders[lora].append(w.id)
    return {k: tuple(v) for k, v in holders.items()}


def plan(
    views: Iterable[AdapterView],
    scores: Mapping[str, ScoreState],
    workers: Iterable[WorkerState],
    policy: Policy,
    now: float,
    memory: Mapping[str, WorkerMemory] | None = None,
    scheduled: Mapping[str, float] | None = None,
) -> Plan:
    """One planning tick on a fresh ``Planner`` (see ``Planner.tick``)."""
    return Planner().tick(views, scores, workers, policy, now, memory, scheduled)


@dataclass
class _BaseTick:
    """What the rules share while planning one base model in one tick: the inputs, and what
    earlier rules leave for later ones (the hot set from rule 4 on, the host-only names from
    rule 9 on). Rules mutate the workers (through ``planner.issue``) and the table (the
    protected cap), never the inputs."""

    planner: _Planner
    table: Candidates
    index: dict[str, int]  # lora_name -> row in ``table``, for this base model's versions
    rows: np.ndarray  # index.values()
    records: Mapping[str, AdapterRecord]  # every version of the registry by lora_name
    revoked: set[str]
    workers: list[_Worker]
    slots: int = field(init=False)  # the hot set's size and the most GPU copies planned
    serving: list[_Worker] = field(init=False)  # workers whose state says no not_run
    not_run: list[_Worker] = field(init=False)  # workers whose state says not_run
    resident: set[str] = field(init=False)  # names on some GPU as the tick starts
    by_id: dict[str, _Worker] = field(init=False)
    max_ranks: np.ndarray = field(init=False)  # the serving workers' max_lora_rank, sorted
    on_gpu: dict[str, list[_Worker]] = field(init=False)  # rule 4 on: name -> GPU holders
    wanted: Ranking = field(init=False)  # rule 4 on: wanted versions in rank order
    hot: list[int] = field(init=False)  # rule 4 on: the hot set's rows, in rank order
    hot_names: set[str] = field(init=False)
    host_only: set[str] = field(init=False)  # rule 9 on: names held host-only somewhere
    # lora -> workers that will not carry out a load of it still within its deadline
    failed_loads: dict[str, set[str]] = field(init=False)
    _fitting: dict[int, int] = field(init=False, default_factory=dict)  # rank -> fitting()

    def __post_init__(self) -> None:
        self.failed_loads = defaultdict(set)
        for w in self.workers:
            for action, lora in w.failed:
                if action is CommandAction.load_gpu:
                    self.failed_loads[lora].add(w.id)
        # a worker whose state says not_run serves nothing: its slots are no capacity (the
        # hot set, the GPU-copy budget, the protected cap) and it fits no rank (rule 5's
        # loads, rule 6's most copies). When none serves, the hot set is sized by their
        # slots, so its versions wait as ``worker_not_run`` rather than vanish from the plan
        self.serving = serving = [w for w in self.workers if w.state.serves]
        self.not_run = [w for w in self.workers if not w.state.serves]
        capacity = sum(max(0, w.state.gpu_slots_total) for w in serving or self.workers)
        self.slots = min(self.policy.gpu_slots_per_base_model, capacity)
        self.resident = set().union(*(w.gpu for w in self.workers))
        self.by_id = {w.id: w for w in self.workers}
        self.max_ranks = np.sort(
            np.fromiter((w.state.max_lora_rank for w in serving), np.int64, len(serving))
        )

    def fitting(self, rank: int) -> int:
        """How many serving workers of the base model can hold a version of ``rank`` (asked
        once per waiting version: a cold tick's ~10k are of a handful of ranks)."""
        count = self._fitting.get(rank)
        if count is None:
            count = self._fitting[rank] = len(self.max_ranks) - int(
                np.searchsorted(self.max_ranks, rank)
            )
        return count

    def fitting_counts(self, ranks: np.ndarray) -> np.ndarray:
        counts: np.ndarray = len(self.max_ranks) - np.searchsorted(self.max_ranks, ranks)
        return counts

    def copies(self) -> int:
        """GPU copies on the base model's workers, as planned so far (rule 4 on)."""
        return sum(map(len, self.on_gpu.values()))

    def drop_holder(self, lora: str, w: _Worker) -> None:
        holders = self.on_gpu[lora]
        holders.remove(w)
        if not holders:
            del self.on_gpu[lora]

    @property
    def policy(self) -> Policy:
        return self.planner.policy

    @property
    def margin(self) -> float:
        return self.planner.policy.hysteresis_margin


def _cap_protected(t: _BaseTick) -> None:
    """1. Unprotect the never-evict versions beyond ``protected_cap``, canaries last, then
    lowest rank first (a resident ranks with the hysteresis margin, so the protected set does
    not flap). They then compete by score, may be demoted or displaced, and are unpinned. A
    canary keeps its protection before any other version: it is a release under test, its
    share of the traffic is small by design (so its score is low), and a cold start there is
    what the canary's warm-up exists to prevent. A copy pinned here or by a pending pin
    that the worker may protect by its own rule counts as held too: no unpin would be
    carried out, so keeping another version instead would pin one more than the cap."""
    table, policy = t.table, t.policy
    protected = t.rows[table.protected[t.rows]].tolist()
    held = set().union(  # no command moves these down; a not_run worker's serve nothing
        *(w.held for w in t.serving),
        *({lora for lora in w.protected if w.gpu.get(lora)} for w in t.serving),
    )
    cap = max(protected_cap(policy, t.slots), sum(1 for i in protected if table.lora[i] in held))
    if len(protected) <= cap:
        return
    protected.sort(
        key=lambda i: (
            table.lora[i] not in held,
            not table.canary[i],
            table.rank(i, table.lora[i] in t.resident, t.margin),
        )
    )
    note = (
        f"over capacity: the policy promises {len(protected)} never-evict copies, more than "
        f"max_protected_gpu_share {policy.max_protected_gpu_share} of {t.slots} GPU slots "
        f"allows ({cap}); ranked by score, not pinned"
    )
    for i in protected[cap:]:
        table.unprotect(i, note)


def _unpin(t: _BaseTick) -> None:
    """2. Unpin every pinned copy of a version no longer protected (over the cap, no
    condition holding, not serving, revoked) before any rule may unload it: a worker
    refuses to unload a pinned copy."""
    table, issue = t.table, t.planner.issue
    for w in t.workers:
        for lora in sorted(lora for lora, pinned in w.gpu.items() if pinned):
            i = t.index.get(lora)
            if (i is not None and table.protected[i]) or lora not in t.records:
                continue
            if i is not None and i in table.over_capacity:
                issue(
                    w,
                    CommandAction.unpin,
                    table.record[i],
                    lora,
                    CommandRule.protected_over_capacity,
                    table.score_of(i),
                    table.detail(i),
                )
            else:
                issue(
                    w,
                    CommandAction.unpin,
                    t.records[lora],
                    lora,
                    CommandRule.no_longer_protected,
                    table.score_of(i) if i is not None else None,
                )


def _leaving(t: _BaseTick) -> set[str]:
    """The residents rule 3 acts on: revoked, not serving, or meeting a demote condition,
    found column-wise (each resident name is looked up once)."""
    names = list(t.resident)
    name_rows = np.fromiter(map(t.index.get, names, repeat(-1)), np.intp, len(names))
    known = np.flatnonzero(name_rows >= 0)
    not_serving = {
        names[j] for j in np.flatnonzero(name_rows < 0).tolist() if names[j] in t.records
    }
    demoted = {names[j] for j in known[t.table.demoted[name_rows[known]]].tolist()}
    return (t.resident & t.revoked) | not_serving | demoted


def _retire(t: _BaseTick) -> None:
    """3. Every copy of a revoked version is evicted (on every worker, outside every
    budget); GPU copies of versions not serving (``not_serving``) or meeting a demote
    condition (``demote``) are demoted to the host. One pass per worker in name order."""
    table, issue = t.table, t.planner.issue
    leaving = _leaving(t)
    for w in t.workers:
        for lora in sorted((w.host & t.revoked) | (w.gpu.keys() & leaving)):
            r = t.records[lora]
            i = t.index.get(lora)
            if lora in t.revoked:
                issue(w, CommandAction.evict, r, lora, CommandRule.revoke, None, "version revoked")
            elif lora in w.gpu and i is None:
                issue(
                    w,
                    CommandAction.demote_to_host,
                    r,
                    lora,
                    CommandRule.not_serving,
                    None,
                    f"status {r.status.value}",
                )
            elif lora in w.gpu and i is not None and table.demoted[i]:
                issue(
                    w,
                    CommandAction.demote_to_host,
                    r,
                    lora,
                    CommandRule.demote,
                    table.score_of(i),
                    f"demote_when: {table.demote_rule(i)}",
                )


def _rank_hot_set(t: _BaseTick) -> None:
    """4. Rank the wanted versions (protected or meeting no demote condition; a resident
    with the hysteresis margin): the first ``slots`` are the hot set. The GPU copies of a
    worker whose state says ``not_run`` serve nothing: they are no holders here (rule 5
    loads such a version elsewhere, rule 6 counts only the copies that serve)."""
    on_gpu: dict[str, list[_Worker]] = defaultdict(list)
    for w in t.serving:
        for lora in w.gpu:
            on_gpu[lora].append(w)
    wanted_rows = t.rows[~t.table.demoted[t.rows]]
    on_rows = np.fromiter(map(t.index.get, on_gpu, repeat(-1)), np.intp, len(on_gpu))
    resident = np.isin(wanted_rows, on_rows[on_rows >= 0])
    t.on_gpu = on_gpu
    t.wanted = Ranking(t.table, wanted_rows, resident, t.margin, t.slots)
    t.hot = t.wanted.top(t.slots)
    t.hot_names = set(map(t.table.lora.__getitem__, t.hot))


def _load(t: _BaseTick) -> None:
    """5. Hot-set versions on no GPU are loaded in rank order (``hot_score``), into a free
    slot of a worker that fits their rank, else into the slot of an extra copy or of the
    lowest-ranked resident outside the hot set (``slot_needed`` then
    ``hot_score_displace``); else they wait."""
    missing = t.hot_names - t.on_gpu.keys()  # loading one adds only itself to on_gpu
    if not missing:
        return
    table, policy, slots = t.table, t.policy, _Slots.of(t)
    for k, i in enumerate(t.hot):
        lora = table.lora[i]
        if lora not in missing:
            continue
        rank, skip = table.record[i].rank, t.failed_loads.get(lora, ())
        target, rule = slots.free_worker(t, rank, skip), CommandRule.hot_score
        if target is None:
            target = _displace_for(t, slots, i, rank, skip)
            rule = CommandRule.hot_score_displace
        if target is None:
            t.planner.waiting.append(Waiting(lora, table.score_of(i), slots.blocked(t, rank)))
            if slots.spent(t):
                _wait(t, slots, t.hot[k + 1 :], missing)
                return
            continue
        warmup = (
            policy.request_budgets.canary.warmup_requests
            if table.record[i].status is AdapterStatus.canary
            else 0
        )
        if t.planner.issue(
            target,
            CommandAction.load_gpu,
            table.record[i],
            lora,
            rule,
            table.score_of(i),
            table.detail(i),
            warmup,
        ):
            slots.loaded(target)
            t.on_gpu[lora].append(target)
        else:
            slots.free.push(target.state.max_lora_rank, (-target.free_slots(), target.id))


def _wait(t: _BaseTick, slots: _Slots, rows: list[int], missing: set[str]) -> None:
    """Rule 5 once no worker may take a load (``_Slots.spent``): nothing can refill the
    heaps (only a version that found a worker pushes one back), so each missing version of
    ``rows`` waits, for the reason of its rank (~10k of a cold tick's hot set at
    100k x 1,000, without a look at the heaps)."""
    table = t.table
    rows = [i for i in rows if table.lora[i] in missing]
    reasons: dict[int, WaitReason] = {}
    for i, score, rank in zip(
        rows,
        table.score[rows].tolist(),
        table.registry.ranks[rows].tolist(),
        strict=True,
    ):
        reason = reasons.get(rank)
        if reason is None:
            reason = reasons[rank] = slots.blocked(t, rank)
        t.planner.waiting.append(Waiting(table.lora[i], score, reason))


_T = TypeVar("_T", bound=tuple[Any, ...])


class _RankHeaps(Generic[_T]):
    """Min-heaps of entries, one per ``max_lora_rank`` of the worker an entry is about. A
    version of rank r reads only the heaps of ranks >= r: a fleet has a handful of distinct
    ranks, so a pick costs a few heap tops, never a scan of the fleet, and an entry that
    does not fit one version stays for the next."""

    def __init__(self, entries: Iterable[tuple[int, _T]]) -> None:
        self.heaps: dict[int, list[_T]] = defaultdict(list)
        for max_rank, entry in entries:
            self.heaps[max_rank].append(entry)
        for heap in self.heaps.values():
            heapq.heapify(heap)
        self.ranks = sorted(self.heaps, reverse=True)

    def fitting(self, rank: int) -> Iterator[list[_T]]:
        for max_rank in self.ranks:
            if max_rank < rank:
                return
            yield self.heaps[max_rank]

    def push(self, max_rank: int, entry: _T) -> None:
        if max_rank not in self.heaps:
            self.ranks = sorted([*self.ranks, max_rank], reverse=True)
        heapq.heappush(self.heaps[max_rank], entry)


FreeHeaps = _RankHeaps[tuple[int, str]]  # (-free slots, worker id)
_EXTRA = -2  # first element of an extra copy's worst-first key: displaced before any other


Displaceable = _RankHeaps[tuple[Rank, str, str]]  # (worst-first rank, lora_name, worker id)


@dataclass
class _Slots:
    """Where rule 5 may put a load: workers by free GPU slots (most free first) and the
    copies that may give up their slot (distinct keys, worst first: extra copies, then
    residents outside the hot set by rank), both per the worker's ``max_lora_rank``. A copy
    the worker may protect never gives its slot; one within ``min_residency_s`` of its load
    (``recent``) only to a never-evict version."""

    free: FreeHeaps
    displaceable: Displaceable
    recent: Displaceable
    in_use: int  # GPU copies
    free_somewhere: dict[int, bool] = field(default_factory=dict)  # rank -> any free slot

    @classmethod
    def of(cls, t: _BaseTick) -> _Slots:
        table, hot, now, policy = t.table, t.hot_names, t.planner.now, t.policy
        settled: list[tuple[int, tuple[Rank, str, str]]] = []
        recent: list[tuple[int, tuple[Rank, str, str]]] = []
        for lora, holders in t.on_gpu.items():
            if (
                (lora in hot and len(holders) < 2)
                or (i := t.index.get(lora)) is None
                or table.protected[i]
            ):
                continue
            key = _worst_first(table.rank(i, True, t.margin))
            for n, w in enumerate(_keep_order(holders, lora)):
                if (n or lora not in hot) and lora not in w.protected:
                    (settled if w.settled(lora, now, policy) else recent).append(
                        (
                            w.state.max_lora_rank,
                            ((_EXTRA, key[1], key[2]) if n else key, lora, w.id),
                        )
                    )
        return cls(_free_heaps(t.workers), _RankHeaps(settled), _RankHeaps(recent), t.copies())

    def free_worker(self, t: _BaseTick, rank: int, skip: Container[str] = ()) -> _Worker | None:
        """The worker (not in ``skip``) to load into a free slot, while the GPU-copy budget
        has room."""
        return (
            _worker_with_free_slot(self.free, t.by_id, t.policy, rank, skip)
            if self.in_use < t.slots
            else None
        )

    def blocked(self, t: _BaseTick, rank: int) -> WaitReason:
        """Why a version waits. No victim left means no displaceable copy on a fitting
        worker: only free slots (out of budget or above the watermark) can block. A worker
        whose state says not_run takes no load: its slots and rank are the reason only when
        no serving worker would do (``worker_not_run``)."""
        if not t.fitting(rank):
            if any(w.state.max_lora_rank >= rank for w in t.not_run):
                return WaitReason.worker_not_run
            return WaitReason.no_worker_fits_rank
        if rank not in self.free_somewhere:
            self.free_somewhere[rank] = any(
                w.free_slots() > 0 for w in t.serving if w.state.max_lora_rank >= rank
            )
        if self.free_somewhere[rank]:
            return WaitReason.cold_load_budget
        if any(self.recent.fitting(rank)):
            return WaitReason.min_residency
        if any(w.free_slots() > 0 and w.state.max_lora_rank >= rank for w in t.not_run):
            return WaitReason.worker_not_run
        return WaitReason.no_gpu_slot

    def spent(self, t: _BaseTick) -> bool:
        """No free slot may be taken (the GPU-copy budget is used, or every worker with a
        free slot was dropped for its budget or watermark) and no copy is left to displace:
        no version of any rank can be loaded until something is pushed back."""
        no_free = self.in_use >= t.slots or not any(self.free.heaps.values())
        return (
            no_free
            and not any(self.displaceable.heaps.values())
            and not any(self.recent.heaps.values())
        )

    def loaded(self, w: _Worker) -> None:
        self.free_somewhere.clear()
        self.in_use += 1
        self.free.push(w.state.max_lora_rank, (-w.free_slots(), w.id))


def _free_heaps(workers: Iterable[_Worker]) -> FreeHeaps:
    return _RankHeaps((w.state.max_lora_rank, (-w.free_slots(), w.id)) for w in workers)


def _keep_order(holders: list[_Worker], lora: str) -> list[_Worker]:
    """A version's GPU copies, the one kept longest first: held never-evict by the worker,
    then pinned, then by worker id. The last ones are its extra copies."""
    return sorted(holders, key=lambda w: (lora not in w.protected, not w.gpu.get(lora), w.id))


def _displace_for(
    t: _BaseTick, slots: _Slots, i: int, rank: int, skip: Container[str] = ()
) -> _Worker | None:
    """Demote the first displaceable copy on a worker that fits ``rank`` (not in ``skip``)
    for row ``i`` (``slot_needed``): a copy within ``min_residency_s`` of its load only for a
    never-evict version; its worker, or None when none is left on a worker that may load."""
    table = t.table
    while True:
        victim = _pop_victim(slots.displaceable, t.by_id, t.policy, rank, skip)
        if victim is None and table.protected[i]:
            victim = _pop_victim(slots.recent, t.by_id, t.policy, rank, skip)
        if victim is None:
            return None
        victim_lora, target = victim
        v = t.index[victim_lora]
        score, victim_score = table.score_of(i), table.score_of(v)
        extra = "an extra copy, " if len(t.on_gpu[victim_lora]) > 1 else ""
        if t.planner.issue(
            target,
            CommandAction.demote_to_host,
            table.record[v],
            victim_lora,
            CommandRule.slot_needed,
            victim_score,
            f"{extra}for {table.lora[i]} scoring {score:.4f} "
            f"(> {victim_score:.4f} + margin {t.margin})",
        ):
            t.drop_holder(victim_lora, target)
            slots.in_use -= 1
            return target


def _worst_first(rank: Rank) -> Rank:
    """Turn a rank (smaller = better) into a key that sorts the worst first (ties by name)."""
    return (-rank[0], -rank[1], rank[2])


def _worker_with_free_slot(
    free: FreeHeaps,
    by_id: Mapping[str, _Worker],
    policy: Policy,
    rank: int,
    skip: Container[str] = (),
) -> _Worker | None:
    """The worker with the most free GPU slots (then the lowest id) that fits ``rank`` and
    may still load, not in ``skip``; popped (the caller pushes it back once loaded). Stale
    entries and workers that may not load (``_Worker.may_load``: out of budget, above the
    HBM watermark, not run) are dropped; skipped ones are put back."""
    best: list[tuple[int, str]] | None = None
    skipped: list[tuple[list[tuple[int, str]], tuple[int, str]]] = []
    for heap in free.fitting(rank):
        while heap:
            neg_free, wid = heap[0]
            w = by_id[wid]
            if -neg_free != w.free_slots():
                heapq.heapreplace(heap, (-w.free_slots(), wid))
            elif w.free_slots() <= 0 or not w.may_load(policy):
                heapq.heappop(heap)
            elif wid in skip:
                skipped.append((heap, heapq.heappop(heap)))
            else:
                break
        if heap and (best is None or heap[0] < best[0]):
            best = heap
    chosen = by_id[heapq.heappop(best)[1]] if best is not None else None
    for heap, entry in skipped:
        heapq.heappush(heap, entry)
    return chosen


def _pop_victim(
    displaceable: Displaceable,
    by_id: Mapping[str, _Worker],
    policy: Policy,
    rank: int,
    skip: Container[str] = (),
) -> tuple[str, _Worker] | None:
    """The first displaceable copy on a worker that fits ``rank``, may still load
    (``_Worker.may_load``) and is not in ``skip`` (those are put back)."""
    best: list[tuple[Rank, str, str]] | None = None
    skipped: list[tuple[list[tuple[Rank, str, str]], tuple[Rank, str, str]]] = []
    for heap in displaceable.fitting(rank):
        while heap:
            _, lora, wid = heap[0]
            w = by_id[wid]
            if lora not in w.gpu or not w.may_load(policy):
                heapq.heappop(heap)
            elif wid in skip:
                skipped.append((heap, heapq.heappop(heap)))
            else:
                break
        if heap and (best is None or heap[0] < best[0]):
            best = heap
    chosen = heapq.heappop(best) if best is not None else None
    for heap, entry in skipped:
        heapq.heappush(heap, entry)
    return None if chosen is None else (chosen[1], by_id[chosen[2]])


def replica_targets(
    copies: np.ndarray, demand: np.ndarray, policy: Policy, most: np.ndarray
) -> np.ndarray:
    """How many GPU copies each version should have, from its ``copies`` now (at least 1),
    its ``demand`` (requests/s) and the ``most`` workers that may hold it: up to
    ``ceil(demand / capacity)`` above ``n * capacity * (1 + h)``, one fewer below
    ``(n - 1) * capacity * (1 - h)``, else unchanged (so copies do not flap)."""
    cap, h = policy.worker_capacity_rps, policy.replica_hysteresis
    n = np.maximum(copies, 1)
    up = demand > n * cap * (1 + h)
    down = (n > 1) & (demand < (n - 1) * cap * (1 - h))
    want = np.where(up, np.ceil(demand / cap), np.where(down, n - 1, n))
    out: np.ndarray = np.maximum(1, np.minimum(want, most)).astype(np.intp)
    return out


def _replicas(t: _BaseTick) -> None:
    """6. Copies by demand (``replica_targets``): a version over its band gives back one
    copy (``replica_surplus``: unpinned first, never one the worker holds never-evict); a
    hot-set version under it gets more (``replica_demand``), each on the worker with the
    most free slots that fits its rank and holds none, within the GPU-copy budget and the
    cold-load budgets. Only free slots: an extra copy never displaces another. Reads only
    what can change: versions with several copies (none in most ticks: one sum tells) and
    hot versions whose demand exceeds one worker's band."""
    table, policy = t.table, t.policy
    cap, h = policy.worker_capacity_rps, policy.replica_hysteresis
    if t.copies() > len(t.on_gpu):
        multi = [lora for lora, holders in t.on_gpu.items() if len(holders) > 1 and lora in t.index]
        rows = np.fromiter(map(t.index.__getitem__, multi), np.intp, len(multi))
        copies = np.fromiter((len(t.on_gpu[lora]) for lora in multi), np.intp, len(multi))
        demand = table.demand(rows)
        want = replica_targets(copies, demand, policy, t.fitting_counts(table.registry.ranks[rows]))
        for k in np.flatnonzero(want < copies).tolist():
            _drop_replica(t, int(rows[k]), multi[k], float(demand[k]))
    if not t.hot or t.copies() >= t.slots:
        return
    hot = np.asarray(t.hot, np.intp)
    demand = table.demand(hot)
    over = np.flatnonzero(demand > cap * (1 + h))  # more than one copy's band
    adds: list[tuple[int, int, float]] = []  # (row, copies wanted, demand), in rank order
    for k in over.tolist():
        i = int(hot[k])
        holders = t.on_gpu.get(table.lora[i])
        if holders:
            wanted = int(
                replica_targets(
                    np.array([len(holders)]),
                    demand[k : k + 1],
                    policy,
                    t.fitting_counts(table.registry.ranks[i : i + 1]),
                )[0]
            )
            if wanted > len(holders):
                adds.append((i, wanted, float(demand[k])))
    if adds:
        _add_replicas(t, adds)


def _drop_replica(t: _BaseTick, i: int, lora: str, demand: float) -> None:
    """Give back one copy of row ``i``: the last kept (``_keep_order``) that the worker
    does not hold never-evict; unpinned first when pinned."""
    policy, table = t.policy, t.table
    holders = t.on_gpu[lora]
    victims = [
        w
        for w in _keep_order(holders, lora)
        if lora not in w.protected and w.settled(lora, t.planner.now, policy)
    ]
    if not victims:
        return
    w, r = victims[-1], table.record[i]
    detail = (
        f"demand {demand:.2f} req/s < {len(holders) - 1} x {policy.worker_capacity_rps}"
        f" x (1 - {policy.replica_hysteresis})"
    )
    if w.gpu[lora]:
        t.planner.issue(
            w, CommandAction.unpin, r, lora, CommandRule.replica_surplus, table.score_of(i), detail
        )
    if t.planner.issue(
        w,
        CommandAction.demote_to_host,
        r,
        lora,
        CommandRule.replica_surplus,
        table.score_of(i),
        detail,
    ):
        t.drop_holder(lora, w)


def _add_replicas(t: _BaseTick, adds: list[tuple[int, int, float]]) -> None:
    """Load the extra copies ``adds`` asks for, best-ranked version first, while the
    GPU-copy budget has room."""
    table, policy = t.table, t.policy
    cap, h = policy.worker_capacity_rps, policy.replica_hysteresis
    in_use, free = t.copies(), _free_heaps(t.workers)
    for i, wanted, d in adds:
        lora, r = table.lora[i], table.record[i]
        holders = t.on_gpu[lora]
        while len(holders) < wanted and in_use < t.slots:
            held = {c.id for c in holders} | t.failed_loads.get(lora, set())
            target = _worker_with_free_slot(free, t.by_id, policy, r.rank, held)
            if target is None:
                break
            t.planner.issue(
                target,
                CommandAction.load_gpu,
                r,
                lora,
                CommandRule.replica_demand,
                table.score_of(i),
                f"demand {d:.2f} req/s > {len(holders)} x {cap} x (1 + {h}): "
                f"copy {len(holders) + 1} of {wanted}",
            )
            holders.append(target)
            in_use += 1
            free.push(target.state.max_lora_rank, (-target.free_slots(), target.id))


def _pin(t: _BaseTick) -> None:
    """7. Pin every unpinned GPU copy of a protected version (a minimum hot copy; the
    unpins came first, in rule 2)."""
    table = t.table
    protected_names = set(map(table.lora.__getitem__, t.rows[table.protected[t.rows]].tolist()))
    for w in t.workers:
        for lora in sorted(lora for lora in w.gpu.keys() & protected_names if not w.gpu[lora]):
            i = t.index[lora]
            t.planner.issue(
                w,
                CommandAction.pin,
                table.record[i],
                lora,
                CommandRule.never_evict,
                table.score_of(i),
                table.detail(i),
            )


def _relieve_hbm(t: _BaseTick) -> None:
    """8. A worker above the HBM high watermark demotes its lowest-ranked unprotected
    resident, one per tick, and none while an unload is pending (it has yet to show in
    the worker's HBM usage). Loads stop at the low watermark (here and in the worker's own
    admission); between the two a copy shed would be loaded back by the next request."""
    table, policy = t.table, t.policy
    for w in t.workers:
        if not w.hbm_above(policy.hbm_high_watermark) or any(
            c.action in (CommandAction.demote_to_host, CommandAction.evict) for c in w.pending
        ):
            continue
        evictable = [
            i
            for lora in w.gpu
            if (i := t.index.get(lora)) is not None
            and not table.protected[i]
            and lora not in w.protected
            and w.settled(lora, t.planner.now, policy)
        ]
        if evictable:
            worst = max(evictable, key=lambda i: table.rank(i, True, t.margin))
            t.planner.issue(
                w,
                CommandAction.demote_to_host,
                table.record[worst],
                table.lora[worst],
                CommandRule.hbm_watermark,
                table.score_of(worst),
                f"hbm_usage {w.state.hbm_usage:.2f} > {policy.hbm_high_watermark}",
            )


def _prewarm_host(t: _BaseTick) -> None:
    """9. Wanted versions on no worker at all are prewarmed in rank order on the worker with
    the most free host bytes that fits their rank and has fewer than
    ``host_prewarms_in_flight_per_worker`` prewarms pending, within
    ``host_slots_per_base_model`` and its byte budget."""
    table, workers = t.table, t.serving  # a not_run worker's copies serve nothing
    t.host_only = host_only = set().union(*(w.host for w in t.workers))
    slots_left = t.policy.host_slots_per_base_model - len(host_only)
    # Only a prewarm reads where versions are: a full host tier needs no such set.
    anywhere = host_only.union(*(w.gpu for w in workers)) if slots_left > 0 else host_only
    byte_heaps = _RankHeaps(
        (w.state.max_lora_rank, (-(w.state.host_bytes_budget - w.host_bytes), w.id))
        for w in workers
    )
    bound = t.policy.host_prewarms_in_flight_per_worker
    in_flight: dict[str, int] = {}  # worker id -> its pending prewarms, once looked at
    ranked = iter(t.wanted)
    fitting: dict[int, list[list[tuple[int, str]]]] = {}  # rank -> its heaps (lists kept)
    smallest: int | None = None  # size of the smallest wanted version, once one did not fit
    while slots_left > 0 and workers and (i := next(ranked, None)) is not None:
        lora = table.lora[i]
        if lora in anywhere:
            continue
        r = table.record[i]
        heaps = fitting.get(r.rank)
        if heaps is None:
            heaps = fitting[r.rank] = list(byte_heaps.fitting(r.rank))
        if not heaps:
            continue  # no worker holds its rank: nowhere to prewarm it
        # The heaps only change by the replace below and by dropping workers at the
        # bound, so each top is valid: the fitting worker with the most free host bytes
        # that may take a prewarm heads one of the fitting heaps.
        heap = _least_full(heaps, t.by_id, in_flight, bound)
        if heap is None:  # every fitting worker is at the bound
            if not any(byte_heaps.heaps.values()):
                break  # and so is every worker: the rest waits for their reports
            continue
        neg_free, wid = heap[0]
        if -neg_free < r.size_bytes:
            # Does not fit the emptiest worker: skip, smaller ones may fit. When none is small
            # enough for any worker, stop (a fleet with full host tiers would walk the whole
            # ranking).
            if smallest is None:
                smallest = int(table.registry.size_bytes[t.wanted.rows].min())
            if -min(h[0] for h in byte_heaps.fitting(0) if h)[0] < smallest:
                break
            continue
        w = t.by_id[wid]
        if not t.planner.issue(
            w,
            CommandAction.prewarm_host,
            r,
            lora,
            CommandRule.host_tier,
            table.score_of(i),
            table.detail(i),
        ):
            continue  # the worker reported it will not: left for after that one's deadline
        host_only.add(lora)
        slots_left -= 1
        in_flight[wid] += 1
        heapq.heapreplace(heap, (-(w.state.host_bytes_budget - w.host_bytes), wid))


def _least_full(
    heaps: list[list[tuple[int, str]]],
    by_id: Mapping[str, _Worker],
    in_flight: dict[str, int],
    bound: int,
) -> list[tuple[int, str]] | None:
    """Of ``heaps`` (rule 9's, by free host bytes), the one headed by the worker with the
    most free host bytes that may take another prewarm (fewer than ``bound`` pending,
    counted into ``in_flight`` once per worker); workers at the bound are popped (their
    count only grows within a tick). None when every heap is empty."""
    best: list[tuple[int, str]] | None = None
    for heap in heaps:
        while heap:
            wid = heap[0][1]
            count = in_flight.get(wid)
            if count is None:
                w = by_id[wid]
                count = in_flight[wid] = sum(
                    c.action is CommandAction.prewarm_host
                    and (c.action, c.lora_name) not in w.failed
                    for c in w.pending
                )
            if count < bound:
                break
            heapq.heappop(heap)
        if heap and (best is None or heap[0] < best[0]):
            best = heap
    return best


def _evict_host(t: _BaseTick) -> None:
    """10. Host-only copies are evicted lowest rank first (``host_pressure``): the versions
    over ``host_slots_per_base_model`` on every worker holding them, then each worker's
    copies over its ``host_bytes_budget``. Sorted only when a limit is exceeded (sorting is
    most of the host tier's cost)."""
    over = len(t.host_only) - t.policy.host_slots_per_base_model
    if over > 0:
        holders: dict[str, list[_Worker]] = defaultdict(list)
        for w in t.workers:
            for lora in w.host:
                holders[lora].append(w)
        for lora in _worst_first_names(t, (lora for lora in holders if lora in t.records)):
            if over <= 0:
                break
            evicted = [
                _evict_for_pressure(t, w, lora, "host slots per base model") for w in holders[lora]
            ]
            if any(evicted):  # one the workers would refuse leaves the next one to go
                over -= 1
    for w in t.workers:
        if w.host_bytes <= w.state.host_bytes_budget:
            continue
        for lora in _worst_first_names(t, w.host):
            if w.host_bytes <= w.state.host_bytes_budget:
                break
            if lora in t.records:
                _evict_for_pressure(t, w, lora, "host byte budget")


def _worst_first_names(t: _BaseTick, loras: Iterable[str]) -> list[str]:
    """``loras`` lowest rank first (as non-residents); versions not serving come first."""

    def key(lora: str) -> Rank:
        i = t.index.get(lora)
        return _worst_first(t.table.rank(i, False, t.margin)) if i is not None else (-2, 0.0, lora)

    return sorted(loras, key=key)


def _evict_for_pressure(t: _BaseTick, w: _Worker, lora: str, detail: str) -> bool:
    """Evict ``lora`` from ``w`` for pressure; whether the command was issued."""
    i = t.index.get(lora)
    return t.planner.issue(
        w,
        CommandAction.evict,
        t.records[lora],
        lora,
        CommandRule.host_pressure,
        t.table.score_of(i) if i is not None else None,
        detail,
    )


_RULES: tuple[Callable[[_BaseTick], None], ...] = (
    _cap_protected,
    _unpin,
    _retire,
    _rank_hot_set,
    _load,
    _replicas,
    _pin,
    _relieve_hbm,
    _prewarm_host,
    _evict_host,
)
"""The planner rules of docs/planner.md, in their order (rule n is ``_RULES[n - 1]``)."""


def _plan_base(
    planner: _Planner, table: Candidates, rows: BaseRows, registry: Registry, workers: list[_Worker]
) -> None:
    """One base model's tick: every rule, in order, on one shared ``_BaseTick``."""
    tick = _BaseTick(
        planner, table, rows.index, rows.rows, registry.records, registry.revoked, workers
    )
    for rule in _RULES:
        rule(tick)
