"""The planner: registry + scores + worker states -> where each adapter version should be,
and the cache commands that get it there. Pure: no I/O, ``now`` is epoch seconds, so the
policy simulator runs it with simulated time.

Rules, per base model, in the order they are applied (``_RULES``: one function each, called
in turn on one ``_BaseTick``; docs/planner.md numbers them the same way):

1. protected cap: at most ``ceil(policy.max_protected_gpu_share * hot-set size)`` (at least 1)
   never-evict versions stay protected, the best-ranked ones; the others are treated as
   unprotected this tick (ranked by score, demotable, unpinned) so idle protected versions
   cannot hold every slot while hot ones fall back to the base model. A copy a worker
   reports ``protected`` (its own never-evict rule, ``workers.reconcile.protect``) refuses
   every move down, so its version keeps its place first, over the cap if need be.
2. unpin: pinned GPU copies of versions no longer protected (over the cap, or not protected
   by any condition, not serving, revoked) are unpinned first: a worker refuses to unload a
   pinned copy, so the unpin must precede any demote or evict of it in the same tick.
3. retire: every copy of a revoked version is evicted now, on every worker, outside budgets;
   GPU copies of versions that are neither active nor canary, or whose facts meet a
   ``policy.demote_when`` condition (a scheduled peak or a canary counts as expected
   demand, so they are not "idle"), are demoted. One pass per worker in name order.
4. hot set: wanted versions (never-evict ones, canaries, and any not meeting a demote
   condition) ranked by hot score, never-evict and canary versions first; a version already
   on GPU ranks with ``policy.hysteresis_margin`` added, so a challenger must beat it by
   the margin (no swapping back and forth). The first ``gpu_slots_per_base_model`` form the
   hot set; a version in it stays where it is (no needless moves). Canaries are wanted from
   the moment they appear, so they are loaded before traffic reaches them.
5. load: hot versions not on any GPU are loaded in rank order on the worker with the most
   free slots, at most ``cold_loads_per_minute_per_worker`` loads per worker in any 60 s
   (sliding); the rest wait for a later tick. A worker above ``hbm_low_watermark`` gets no
   loads. When no slot is free, the lowest-ranked resident outside the hot set is demoted
   to make room ("slot_needed"); never a never-evict one. A canary's ``load_gpu`` asks for
   ``request_budgets.canary.warmup_requests`` shadow/golden-set requests.
6. pin: never-evict versions on GPU are pinned (a minimum hot copy).
7. HBM: a worker above the watermark demotes its lowest-ranked evictable resident.
8. host prewarm: wanted versions on no worker at all are prewarmed to the host tier (most
   free host bytes first) within ``host_slots_per_base_model`` and each worker's budget.
9. host pressure: host copies over either limit are evicted lowest rank first.

Commands issued but not yet visible in a worker's state are remembered (``WorkerMemory``)
and applied on top of that state, so nothing is issued twice; they are forgotten once the
state shows them or their deadline passes. ``command_id`` is a hash of worker, action, LoRA
name and the worker's command sequence number from that memory, so a restarted planner with
its memory restored neither re-issues a pending decision nor reuses an old id.

Cost: one pass over versions and residents; scores and conditions are numpy columns over all
serving versions, and only the top of the ranking is sorted (as far as the hot set and host
tier read it), so a tick is O(n + m log m) for n versions and m read in rank order; commands
are built only for what changes.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import repeat
from typing import Any

import numpy as np
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.planner_memory import PlannerMemory
from loraplane.schemas.reasons import CommandRule, WaitReason
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.worker_state import LoadedAdapter, WorkerState
from loraplane.streams.planner_candidates import Candidates, Rank, Ranking
from loraplane.streams.planner_columns import BaseRows, Columns, Registry
from loraplane.streams.scores import ScoreState

from loraplane.kernel.command_effects import (
    UNPROTECTING,
    Copy,
    copy_at,
    effect,
    protected_cap,
    shows,
)
from loraplane.kernel.policy import Policy

LOAD_WINDOW_S = 60.0


@dataclass(frozen=True)
class WorkerMemory:
    """What the planner told one worker that the worker's state may not show yet."""

    seq: int = 0  # commands issued to this worker so far: the epoch in command ids
    pending: tuple[CacheCommand, ...] = ()
    loads: tuple[float, ...] = ()  # issue times of load_gpu commands in the last minute

    def record(self) -> PlannerMemory:
        """The memory as written to the ``planner-memory`` table. Not validated: the
        commands were validated when built and the rest is the planner's own numbers."""
        return PlannerMemory.model_construct(seq=self.seq, pending=self.pending,
                                             loads=self.loads)

    @classmethod
    def of(cls, record: PlannerMemory) -> WorkerMemory:
        """The memory a (decoded, so validated) table record holds."""
        return cls(seq=record.seq, pending=record.pending, loads=record.loads)


@dataclass(frozen=True)
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
    host_pinned: set[str] | frozenset[str] = frozenset()  # host-only copies that are pinned
    protected: frozenset[str] = frozenset()  # copies the worker refuses to move down (its rule)
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
        return policy.cold_loads_per_minute_per_worker - len(self.loads)

    def above_watermark(self, policy: Policy) -> bool:
        return self.state.hbm_usage is not None and self.state.hbm_usage > policy.hbm_low_watermark

    def memory(self) -> WorkerMemory:
        return WorkerMemory(seq=self.seq, pending=tuple(self.pending), loads=tuple(self.loads))


def _reflected(cmd: CacheCommand, loaded: Mapping[str, LoadedAdapter]) -> bool:
    """Does the worker's reported state (``loaded``: its adapters by name) already show the
    command's effect (``kernel.command_effects.shows``)?"""
    a = loaded.get(cmd.lora_name)
    return shows(cmd.action, Copy() if a is None else Copy(a.tier, a.pinned))


@dataclass(frozen=True)
class _Tiers:
    """What a worker state says it holds (a worker copies it before changing it)."""

    gpu: dict[str, bool]  # lora -> pinned
    host: frozenset[str]  # host-only copies
    host_pinned: frozenset[str] = frozenset()  # host-only copies that are pinned
    protected: frozenset[str] = frozenset()  # GPU copies the worker holds never-evict

    @classmethod
    def of(cls, state: WorkerState) -> _Tiers:
        adapters = state.adapters
        return cls({a.lora_name: a.pinned for a in adapters if a.tier == "gpu"},
                   frozenset(a.lora_name for a in adapters if a.tier != "gpu"),
                   frozenset(a.lora_name for a in adapters if a.tier != "gpu" and a.pinned),
                   frozenset(a.lora_name for a in adapters if a.tier == "gpu" and a.protected))


def _effective(state: WorkerState, tiers: _Tiers, memory: WorkerMemory,
               records: Mapping[str, AdapterRecord], now: float) -> _Worker:
    adapters = state.adapters
    w = _Worker(state=state, gpu=tiers.gpu, host=tiers.host, host_pinned=tiers.host_pinned,
                protected=tiers.protected, host_bytes=state.host_bytes_used,
                loads=[t for t in memory.loads if now - t < LOAD_WINDOW_S], seq=memory.seq)
    if memory.pending:
        loaded = {a.lora_name: a for a in adapters}
        w.pending = [c for c in memory.pending
                     if c.deadline.timestamp() > now and not _reflected(c, loaded)]
        for c in w.pending:
            r = records.get(c.lora_name)
            _apply(w, c.action, c.lora_name, r.size_bytes if r is not None else 0,
                   c.lora_name in w.protected)
    return w


def _copy_on(w: _Worker, lora: str) -> Copy:
    if lora in w.gpu:
        return copy_at("gpu", w.gpu[lora])
    return copy_at("host", lora in w.host_pinned) if lora in w.host else copy_at("gone", False)


def _apply(w: _Worker, action: CommandAction, lora: str, size: int,
           protected: bool = False) -> None:
    """Expect ``action``'s effect (``kernel.command_effects``) on ``w``'s copy of ``lora``;
    ``protected``: the worker holds it never-evict and refuses to move it down."""
    before = _copy_on(w, lora)
    after = effect(action, before, protected).after
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


def command_id(worker_id: str, action: str, lora: str, seq: int) -> str:
    digest = hashlib.blake2b(f"{worker_id}|{action}|{lora}|{seq}".encode(),
                             digest_size=16).hexdigest()
    return f"c{digest}"


class _Planner:
    def __init__(self, policy: Policy, now: float) -> None:
        self.policy = policy
        self.now = now
        self.commands: list[CacheCommand] = []
        self.waiting: list[Waiting] = []
        self.issued_at = datetime.fromtimestamp(now, UTC)
        self.deadline = self.issued_at + timedelta(seconds=policy.command_deadline_s)
        self.validated: CacheCommand | None = None

    def issue(self, w: _Worker, action: CommandAction, record: AdapterRecord, lora: str,
              rule: CommandRule, score: float | None, detail: str = "", warmup: int = 0) -> None:
        """Issue one command. Its fields come from validated records, worker states and the
        policy, so only the tick's first command is validated; the others are copies of it
        with every field replaced (a cold tick issues ~30k commands; validating each
        doubled their cost). Never one the worker refuses by its own rule: a move down of a
        copy it reports protected (``LoadedAdapter.protected``)."""
        if action in UNPROTECTING and lora in w.protected:
            return
        w.seq += 1
        fields = {
            "command_id": command_id(w.id, action.value, lora, w.seq), "worker_id": w.id,
            "action": action, "base_model": record.base_model, "tenant_id": record.tenant_id,
            "adapter_id": record.adapter_id, "version": record.version,
            "sha256": record.sha256, "lora_name": lora,
            "reason": CommandReason(rule=rule, score=None if score is None else round(score, 6),
                                    detail=detail[:512]),
            "issued_at": self.issued_at, "deadline": self.deadline, "warmup_requests": warmup}
        if self.validated is None:
            cmd = self.validated = CacheCommand.model_validate(fields)
        else:
            cmd = self.validated.model_copy(update=fields)
        w.pending.append(cmd)
        if action is CommandAction.load_gpu:
            w.loads.append(self.now)
        _apply(w, action, lora, record.size_bytes)
        self.commands.append(cmd)


class Planner:
    """The planner of one process, for its whole life: keeps the registry and score columns
    (``streams.planner_columns``) between ticks, so a tick re-derives only what changed.
    ``tick`` takes the same inputs as ``plan`` and returns the same ``Plan``."""

    def __init__(self) -> None:
        self._columns = Columns()
        self._tiers: dict[str, _Tiers] = {}  # worker_id -> tiers of its last state object
        self._tiers_of: dict[str, WorkerState] = {}

    def tick(self, views: Iterable[AdapterView], scores: Mapping[str, ScoreState],
             workers: Iterable[WorkerState], policy: Policy, now: float,
             memory: Mapping[str, WorkerMemory] | None = None,
             scheduled: Mapping[str, float] | None = None) -> Plan:
        """One planning tick. ``scheduled`` maps adapter_id -> scheduled warm-up score
        (streams.schedules.warmup_scores); ``memory`` is the previous plan's ``memory``."""
        memory = memory or {}
        registry, columns = self._columns.update(views, scores)
        records = registry.records
        table = Candidates(registry, columns, scheduled or {}, policy, now)
        fleet: dict[str, list[_Worker]] = defaultdict(list)
        states = sorted(workers, key=lambda s: s.worker_id)
        self._tiers = {s.worker_id: self._tiers[s.worker_id]
                       if self._tiers_of.get(s.worker_id) is s else _Tiers.of(s) for s in states}
        self._tiers_of = {s.worker_id: s for s in states}
        for state in states:
            fleet[state.base_model].append(_effective(
                state, self._tiers[state.worker_id], memory.get(state.worker_id, WorkerMemory()),
                records, now))

        p = _Planner(policy, now)
        no_rows = BaseRows({}, np.zeros(0, np.intp))
        for base in sorted(set(registry.bases) | set(fleet)):
            _plan_base(p, table, registry.bases.get(base, no_rows), registry,
                       fleet.get(base, []))

        workers_out = [w for ws in fleet.values() for w in ws]
        new_memory = {**memory, **{w.id: w.memory() for w in workers_out}}
        return Plan(_Lazy(lambda: _placement(workers_out, "gpu")),
                    _Lazy(lambda: _placement(workers_out, "host")), p.commands, p.waiting,
                    new_memory,
                    _Lazy(lambda: dict(zip(registry.ranked_names,
                                           table.score[registry.ranked_rows].tolist(),
                                           strict=True))))


def _placement(workers: list[_Worker], tier: str) -> dict[str, tuple[str, ...]]:
    """lora_name -> the workers holding it in ``tier`` ("gpu" or "host")."""
    holders: dict[str, list[str]] = defaultdict(list)
    for w in workers:
        for lora in getattr(w, tier):
            holders[lora].append(w.id)
    return {k: tuple(v) for k, v in holders.items()}


def plan(views: Iterable[AdapterView], scores: Mapping[str, ScoreState],
         workers: Iterable[WorkerState], policy: Policy, now: float,
         memory: Mapping[str, WorkerMemory] | None = None,
         scheduled: Mapping[str, float] | None = None) -> Plan:
    """One planning tick on a fresh ``Planner`` (see ``Planner.tick``)."""
    return Planner().tick(views, scores, workers, policy, now, memory, scheduled)


@dataclass
class _BaseTick:
    """What the rules share while planning one base model in one tick: the inputs, and what
    earlier rules leave for later ones (the hot set from rule 4 on, the host-only names from
    rule 8 on). Rules mutate the workers (through ``planner.issue``) and the table (the
    protected cap), never the inputs."""

    planner: _Planner
    table: Candidates
    index: dict[str, int]  # lora_name -> row in ``table``, for this base model's versions
    rows: np.ndarray  # index.values()
    records: Mapping[str, AdapterRecord]  # every version of the registry by lora_name
    revoked: set[str]
    workers: list[_Worker]
    slots: int = field(init=False)  # the hot set's size
    resident: set[str] = field(init=False)  # names on some GPU as the tick starts
    by_id: dict[str, _Worker] = field(init=False)
    on_gpu: dict[str, list[_Worker]] = field(init=False)  # rule 4 on: name -> GPU holders
    wanted: Ranking = field(init=False)  # rule 4 on: wanted versions in rank order
    hot: list[int] = field(init=False)  # rule 4 on: the hot set's rows, in rank order
    hot_names: set[str] = field(init=False)
    host_only: set[str] = field(init=False)  # rule 8 on: names held host-only somewhere

    def __post_init__(self) -> None:
        capacity = sum(max(0, w.state.gpu_slots_total) for w in self.workers)
        self.slots = min(self.policy.gpu_slots_per_base_model, capacity)
        self.resident = set().union(*(w.gpu for w in self.workers))
        self.by_id = {w.id: w for w in self.workers}

    @property
    def policy(self) -> Policy:
        return self.planner.policy

    @property
    def margin(self) -> float:
        return self.planner.policy.hysteresis_margin


def _cap_protected(t: _BaseTick) -> None:
    """1. Unprotect the never-evict versions beyond ``protected_cap``, lowest rank first (a
    resident ranks with the hysteresis margin, so the protected set does not flap). They
    then compete by score, may be demoted or displaced, and are unpinned."""
    table, policy = t.table, t.policy
    protected = t.rows[table.protected[t.rows]].tolist()
    held = set().union(*(w.protected for w in t.workers))  # no command moves these down
    cap = max(protected_cap(policy, t.slots),
              sum(1 for i in protected if table.lora[i] in held))
    if len(protected) <= cap:
        return
    protected.sort(key=lambda i: (table.lora[i] not in held,
                                  table.rank(i, table.lora[i] in t.resident, t.margin)))
    note = (f"over capacity: the policy promises {len(protected)} never-evict copies, more than "
            f"max_protected_gpu_share {policy.max_protected_gpu_share} of {t.slots} GPU slots "
            f"allows ({cap}); ranked by score, not pinned")
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
                issue(w, CommandAction.unpin, table.record[i], lora,
                      CommandRule.protected_over_capacity, table.score_of(i), table.detail(i))
            else:
                issue(w, CommandAction.unpin, t.records[lora], lora,
                      CommandRule.no_longer_protected, table.score_of(i) if i is not None else None)


def _leaving(t: _BaseTick) -> set[str]:
    """The residents rule 3 acts on: revoked, not serving, or meeting a demote condition,
    found column-wise (each resident name is looked up once)."""
    names = list(t.resident)
    name_rows = np.fromiter(map(t.index.get, names, repeat(-1)), np.intp, len(names))
    known = np.flatnonzero(name_rows >= 0)
    not_serving = {names[j] for j in np.flatnonzero(name_rows < 0).tolist()
                   if names[j] in t.records}
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
                issue(w, CommandAction.demote_to_host, r, lora, CommandRule.not_serving, None,
                      f"status {r.status.value}")
            elif lora in w.gpu and i is not None and table.demoted[i]:
                issue(w, CommandAction.demote_to_host, r, lora, CommandRule.demote,
                      table.score_of(i), f"demote_when: {table.demote_rule(i)}")


def _rank_hot_set(t: _BaseTick) -> None:
    """4. Rank the wanted versions (protected or meeting no demote condition; a resident
    with the hysteresis margin): the first ``slots`` are the hot set."""
    on_gpu: dict[str, list[_Worker]] = defaultdict(list)
    for w in t.workers:
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
    slot, else into the slot of the lowest-ranked resident outside the hot set
    (``slot_needed`` then ``hot_score_displace``); else they wait."""
    missing = t.hot_names - t.on_gpu.keys()  # loading one adds only itself to on_gpu
    if not missing:
        return
    table, policy, slots = t.table, t.policy, _Slots.of(t)
    for i in t.hot:
        lora = table.lora[i]
        if lora not in missing:
            continue
        target, rule = slots.free_worker(t), CommandRule.hot_score
        if target is None:
            target, rule = _displace_for(t, slots, i), CommandRule.hot_score_displace
        if target is None:
            t.planner.waiting.append(Waiting(lora, table.score_of(i), slots.blocked(t)))
            continue
        warmup = (policy.request_budgets.canary.warmup_requests
                  if table.record[i].status is AdapterStatus.canary else 0)
        t.planner.issue(target, CommandAction.load_gpu, table.record[i], lora, rule,
                        table.score_of(i), table.detail(i), warmup)
        slots.loaded(target)
        t.on_gpu[lora].append(target)


@dataclass
class _Slots:
    """Where rule 5 may put a load: workers by free GPU slots (a heap, most free first) and
    the residents outside the hot set that may give up their slot (a heap of distinct keys,
    lowest rank first: the order it is built in does not matter)."""

    free: list[tuple[int, str]]  # (-free slots, worker id)
    displaceable: list[tuple[Rank, str, str]]  # (worst-first rank, lora_name, worker id)
    in_use: int  # versions on some GPU
    free_somewhere: bool | None = None  # any worker with a free slot, until the next load

    @classmethod
    def of(cls, t: _BaseTick) -> _Slots:
        table = t.table
        displaceable = [(_worst_first(table.rank(i, True, t.margin)), lora, w.id)
                        for lora in t.on_gpu.keys() - t.hot_names
                        if (i := t.index.get(lora)) is not None and not table.protected[i]
                        for w in t.on_gpu[lora]]
        heapq.heapify(displaceable)
        free = [(-w.free_slots(), w.id) for w in t.workers]
        heapq.heapify(free)
        return cls(free, displaceable, len(t.on_gpu))

    def free_worker(self, t: _BaseTick) -> _Worker | None:
        """The worker to load into a free slot, while the hot set has room on the GPUs."""
        return _worker_with_free_slot(self.free, t.by_id, t.policy) \
            if self.in_use < t.slots else None

    def blocked(self, t: _BaseTick) -> WaitReason:
        """Why a version waits. No victim left means ``displaceable`` is empty: only free
        slots (out of budget or above the watermark) can block."""
        if self.free_somewhere is None:
            self.free_somewhere = any(w.free_slots() > 0 for w in t.workers)
        return WaitReason.cold_load_budget if self.free_somewhere else WaitReason.no_gpu_slot

    def loaded(self, w: _Worker) -> None:
        self.free_somewhere = None
        self.in_use += 1
        heapq.heappush(self.free, (-w.free_slots(), w.id))


def _displace_for(t: _BaseTick, slots: _Slots, i: int) -> _Worker | None:
    """Demote the lowest-ranked displaceable resident for row ``i`` (``slot_needed``);
    its worker, or None when none is left on a worker that may still load."""
    victim = _pop_victim(slots.displaceable, t.by_id, t.policy)
    if victim is None:
        return None
    victim_lora, target = victim
    table, v = t.table, t.index[victim_lora]
    score, victim_score = table.score_of(i), table.score_of(v)
    t.planner.issue(target, CommandAction.demote_to_host, table.record[v], victim_lora,
                    CommandRule.slot_needed, victim_score,
                    f"for {table.lora[i]} scoring {score:.4f} "
                    f"(> {victim_score:.4f} + margin {t.margin})")
    slots.in_use -= 1
    return target


def _worst_first(rank: Rank) -> Rank:
    """Turn a rank (smaller = better) into a key that sorts the worst first (ties by name)."""
    return (-rank[0], -rank[1], rank[2])


def _worker_with_free_slot(free_heap: list[tuple[int, str]], by_id: Mapping[str, _Worker],
                           policy: Policy) -> _Worker | None:
    """The worker with the most free GPU slots that may still load; stale heap entries
    and workers out of budget or above the HBM watermark are dropped."""
    while free_heap:
        neg_free, wid = free_heap[0]
        w = by_id[wid]
        if -neg_free != w.free_slots():
            heapq.heapreplace(free_heap, (-w.free_slots(), wid))
            continue
        if w.free_slots() > 0 and w.loads_left(policy) > 0 and not w.above_watermark(policy):
            heapq.heappop(free_heap)
            return w
        heapq.heappop(free_heap)
    return None


def _pop_victim(displaceable: list[tuple[Rank, str, str]], by_id: Mapping[str, _Worker],
                policy: Policy) -> tuple[str, _Worker] | None:
    """The lowest-ranked displaceable resident on a worker that may still load."""
    while displaceable:
        _, lora, wid = heapq.heappop(displaceable)
        w = by_id[wid]
        if lora in w.gpu and w.loads_left(policy) > 0 and not w.above_watermark(policy):
            return lora, w
    return None


def _pin(t: _BaseTick) -> None:
    """6. Pin every unpinned GPU copy of a protected version (a minimum hot copy; the
    unpins came first, in rule 2)."""
    table = t.table
    protected_names = set(map(table.lora.__getitem__, t.rows[table.protected[t.rows]].tolist()))
    for w in t.workers:
        for lora in sorted(lora for lora in w.gpu.keys() & protected_names if not w.gpu[lora]):
            i = t.index[lora]
            t.planner.issue(w, CommandAction.pin, table.record[i], lora, CommandRule.never_evict,
                            table.score_of(i), table.detail(i))


def _relieve_hbm(t: _BaseTick) -> None:
    """7. A worker above the HBM low watermark demotes its lowest-ranked unprotected
    resident, one per tick, and none while an unload is pending (it has yet to show in
    the worker's HBM usage)."""
    table, policy = t.table, t.policy
    for w in t.workers:
        if not w.above_watermark(policy) or any(
                c.action in (CommandAction.demote_to_host, CommandAction.evict)
                for c in w.pending):
            continue
        evictable = [i for lora in w.gpu
                     if (i := t.index.get(lora)) is not None and not table.protected[i]]
        if evictable:
            worst = max(evictable, key=lambda i: table.rank(i, True, t.margin))
            t.planner.issue(w, CommandAction.demote_to_host, table.record[worst],
                            table.lora[worst], CommandRule.hbm_watermark, table.score_of(worst),
                            f"hbm_usage {w.state.hbm_usage:.2f} > {policy.hbm_low_watermark}")


def _prewarm_host(t: _BaseTick) -> None:
    """8. Wanted versions on no worker at all are prewarmed in rank order on the worker with
    the most free host bytes, within ``host_slots_per_base_model`` and its byte budget."""
    table, workers = t.table, t.workers
    t.host_only = host_only = set().union(*(w.host for w in workers))
    slots_left = t.policy.host_slots_per_base_model - len(host_only)
    # Only a prewarm reads where versions are: a full host tier needs no such set.
    anywhere = host_only.union(*(w.gpu for w in workers)) if slots_left > 0 else host_only
    byte_heap = [(-(w.state.host_bytes_budget - w.host_bytes), w.id) for w in workers]
    heapq.heapify(byte_heap)
    ranked = iter(t.wanted)
    smallest: int | None = None  # size of the smallest wanted version, once one did not fit
    while slots_left > 0 and byte_heap and (i := next(ranked, None)) is not None:
        lora = table.lora[i]
        if lora in anywhere:
            continue
        neg_free, wid = byte_heap[0]
        if -neg_free < table.record[i].size_bytes:
            # Does not fit the emptiest worker: skip, smaller ones may fit. When none is small
            # enough, stop (a fleet with full host tiers would walk the whole ranking).
            if smallest is None:
                smallest = int(table.registry.size_bytes[t.wanted.rows].min())
            if -neg_free < smallest:
                break
            continue
        w = t.by_id[wid]
        t.planner.issue(w, CommandAction.prewarm_host, table.record[i], lora, CommandRule.host_tier,
                        table.score_of(i), table.detail(i))
        host_only.add(lora)
        slots_left -= 1
        heapq.heapreplace(byte_heap, (-(w.state.host_bytes_budget - w.host_bytes), wid))


def _evict_host(t: _BaseTick) -> None:
    """9. Host-only copies are evicted lowest rank first (``host_pressure``): the versions
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
            for w in holders[lora]:
                _evict_for_pressure(t, w, lora, "host slots per base model")
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
        return _worst_first(t.table.rank(i, False, t.margin)) if i is not None \
            else (-2, 0.0, lora)
    return sorted(loras, key=key)


def _evict_for_pressure(t: _BaseTick, w: _Worker, lora: str, detail: str) -> None:
    i = t.index.get(lora)
    t.planner.issue(w, CommandAction.evict, t.records[lora], lora, CommandRule.host_pressure,
                    t.table.score_of(i) if i is not None else None, detail)


_RULES: tuple[Callable[[_BaseTick], None], ...] = (
    _cap_protected, _unpin, _retire, _rank_hot_set, _load, _pin, _relieve_hbm, _prewarm_host,
    _evict_host)
"""The planner rules of docs/planner.md, in their order (rule n is ``_RULES[n - 1]``)."""


def _plan_base(planner: _Planner, table: Candidates, rows: BaseRows, registry: Registry,
               workers: list[_Worker]) -> None:
    """One base model's tick: every rule, in order, on one shared ``_BaseTick``."""
    tick = _BaseTick(planner, table, rows.index, rows.rows, registry.records, registry.revoked,
                     workers)
    for rule in _RULES:
        rule(tick)
