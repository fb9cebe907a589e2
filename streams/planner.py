"""The planner: registry + scores + worker states -> where each adapter version should be,
and the cache commands that get it there. Pure: no I/O, ``now`` is epoch seconds, so the
policy simulator runs it with simulated time.

Rules, per base model, in the order they are applied:

0. protected cap: at most ``ceil(policy.max_protected_gpu_share * hot-set size)`` (at least 1)
   never-evict versions stay protected, the best-ranked ones; the others are treated as
   unprotected this tick (ranked by score, demotable, unpinned) so idle protected versions
   cannot hold every slot while hot ones fall back to the base model.
   Pinned GPU copies of versions no longer protected (over the cap, or not protected by any
   condition, not serving, revoked) are unpinned first: a worker refuses to unload a pinned
   copy, so the unpin must precede any demote or evict of it in the same tick.
1. revoke: every copy of a revoked version is evicted now, on every worker, outside budgets.
2. not serving: GPU copies of versions that are neither active nor canary are demoted.
3. demote: GPU copies whose facts meet a ``policy.demote_when`` condition are demoted
   (a scheduled peak or a canary counts as expected demand, so they are not "idle").
4. hot set: wanted versions (never-evict ones, canaries, and any not meeting a demote
   condition) ranked by hot score, never-evict and canary versions first; a version already
   on GPU ranks with ``policy.hysteresis_margin`` added, so a challenger must beat it by
   the margin (no swapping back and forth). The first ``gpu_slots_per_base_model`` form the
   hot set; a version in it stays where it is (no needless moves).
5. load: hot versions not on any GPU are loaded in rank order on the worker with the most
   free slots, at most ``cold_loads_per_minute_per_worker`` loads per worker in any 60 s
   (sliding); the rest wait for a later tick. A worker above ``hbm_low_watermark`` gets no
   loads. When no slot is free, the lowest-ranked resident outside the hot set is demoted
   to make room ("slot_needed"); never a never-evict one.
6. pin: never-evict versions on GPU are pinned (a minimum hot copy).
7. HBM: a worker above the watermark demotes its lowest-ranked evictable resident.
8. host tier: wanted versions on no worker at all are prewarmed to the host tier (most free
   host bytes first) within ``host_slots_per_base_model`` and each worker's byte budget;
   host copies over either limit are evicted lowest rank first.
9. canary: canary versions are wanted from the moment they appear, so they are prewarmed
   on a GPU before traffic reaches them; their ``load_gpu`` asks for
   ``request_budgets.canary.warmup_requests`` shadow/golden-set requests.

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
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import repeat

import numpy as np
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.planner_memory import PlannerMemory
from loraplane.schemas.reasons import CommandRule, WaitReason
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.worker_state import LoadedAdapter, WorkerState
from loraplane.streams.planner_columns import BaseRows, Categories, Columns, Registry, Scores
from loraplane.streams.scores import (
    MIN_ERROR_SAMPLES,
    TAU_10M_S,
    ScoreState,
    decayed_at,
    hot_scores_of,
)

from loraplane.kernel.command_effects import Copy, effect, shows
from loraplane.kernel.policy import Clause, Condition, Policy

LOAD_WINDOW_S = 60.0
_COMPARE: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    "==": np.equal, "!=": np.not_equal, ">": np.greater, ">=": np.greater_equal,
    "<": np.less, "<=": np.less_equal}
"""``Clause.op`` as numpy comparisons, for a numeric fact against a numeric literal."""


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


class _Lazy(Mapping):
    """A dict built on first read. ``Plan.gpu``, ``host`` and ``scores`` hold 100k entries
    at scale, and the planner agent reads none of them (the simulator and audits do): a
    tick spent ~40 ms building them."""

    def __init__(self, build: Callable[[], dict]) -> None:
        self._build: Callable[[], dict] | None = build
        self._dict: dict = {}

    def _get(self) -> dict:
        if self._build is not None:
            self._dict, self._build = self._build(), None
        return self._dict

    def __getitem__(self, key: object) -> object:
        return self._get()[key]

    def __iter__(self) -> Iterator:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __eq__(self, other: object) -> bool:
        return self._get() == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._get())


Rank = tuple[int, float, str]
"""Sort key of a candidate: smaller ranks higher."""


class _Candidates:
    """Every serving version (active or canary) as columns, one row each: the registry can
    hold 100k of them and a tick looks at few beyond the hot set and the residents, so
    scores and conditions are computed column-wise (numpy) and nothing is built per row.
    The time-independent columns come from ``streams.planner_columns``, kept between
    ticks; this tick's decays, scores and conditions are computed here.

    Python lists serve per-row reads, numpy arrays the column-wise ones; ``unprotect`` is
    the one change after construction and keeps both in step."""

    def __init__(self, registry: Registry, scores: Scores, scheduled: Mapping[str, float],
                 policy: Policy, now: float, never_evict: tuple[Condition, ...],
                 demote: tuple[Condition, ...]) -> None:
        n = len(registry.lora)
        self.registry, self.columns = registry, scores
        self.record = registry.record
        self.lora = registry.lora
        self.now = now
        self.scheduled = registry.scheduled(scheduled)
        self.canary = registry.canary
        self.score_np = hot_scores_of(
            scores.inputs, registry.priorities.lookup(policy.tenant_priority_values, 0.0),
            self.scheduled, policy, now, policy.weights)
        self.score = self.score_np.tolist()
        self.never_evict, self.demote = never_evict, demote
        self.protected_by = _first_holding(never_evict, self._fact, n)
        self.demoted_by = _first_holding(demote, self._fact, n)
        self.protected_np = self.protected_by >= 0
        self.first_np = self.protected_np | self.canary
        self.demoted_np = (self.demoted_by >= 0) & ~self.protected_np
        self.protected = self.protected_np.tolist()
        self.first = self.first_np.tolist()
        self.demoted = self.demoted_np.tolist()
        self.over_capacity: dict[int, str] = {}  # row -> why it lost its protection

    def _fact(self, fact: str, rows: np.ndarray) -> np.ndarray | Categories:
        """The values of one condition fact for ``rows``: a float column (NaN = unknown) or
        a ``Categories`` column. Facts a condition does not read are never computed."""
        now, c = self.now, self.columns
        match fact:
            case "status":
                return self.registry.status.take(rows)
            case "tenant_priority":
                return self.registry.priorities.take(rows)
            case "canary_percent":  # read rarely (after a canary status clause): per tick
                return np.fromiter((self.record[i].release.canary_percent
                                    for i in rows.tolist()), float, len(rows))
            case "no_request_for_minutes":
                # A scheduled peak or a canary counts as expected demand: never idle.
                idle = np.maximum(0.0, now - c.last[rows]) / 60.0
                idle[~np.isfinite(idle)] = 1e18  # never requested
                idle[(self.scheduled[rows] > 0) | self.canary[rows]] = 0.0
                return idle
            case "error_rate_after_load":
                served = decayed_at(c.served_value[rows], c.served_at[rows], TAU_10M_S, now)
                known = served >= MIN_ERROR_SAMPLES
                rates = np.full(len(rows), np.nan)
                rates[known] = decayed_at(c.errors_value[rows[known]], c.errors_at[rows[known]],
                                          TAU_10M_S, now) / served[known]
                return rates
            case "request_class":
                states = c.state
                return Categories.of(states[i].dominant_class(now) for i in rows.tolist())
        raise ValueError(f"unknown fact {fact!r}")

    def rank(self, i: int, resident: bool, margin: float) -> Rank:
        """Never-evict and canary versions first, then by score (a resident's raised by the
        hysteresis margin), then by name."""
        return (0 if self.first[i] else 1, -(self.score[i] + (margin if resident else 0.0)),
                self.lora[i])

    def detail(self, i: int) -> str:
        """Why the row is wanted, for the command's reason."""
        which = int(self.protected_by[i])
        text = (f"never_evict: {self.never_evict[which].text}" if which >= 0
                else "scheduled warm-up" if self.scheduled[i] > 0
                else "canary prewarm" if self.canary[i] else "")
        note = self.over_capacity.get(i)
        return text if note is None else f"{text}; {note}"

    def demote_rule(self, i: int) -> str:
        return self.demote[int(self.demoted_by[i])].text

    def unprotect(self, i: int, note: str) -> None:
        """Over the protected cap: ranked by score, demotable, unpinned."""
        self.protected[i] = self.first[i] = False
        self.protected_np[i] = self.first_np[i] = False
        self.demoted[i] = self.demoted_np[i] = bool(self.demoted_by[i] >= 0)
        self.over_capacity[i] = note


def _holds(clause: Clause, values: np.ndarray | Categories) -> np.ndarray:
    """``clause.holds`` for each value of a fact column. A numeric fact against a number is
    one numpy comparison; anything else is decided by ``Clause.holds`` itself once per
    distinct value (statuses, priorities, classes: a handful)."""
    if isinstance(values, np.ndarray):
        if values.dtype != object and not isinstance(clause.value, str):
            return ~np.isnan(values) & _COMPARE[clause.op](values, clause.value)
        values = Categories.of(None if isinstance(v, float) and math.isnan(v) else v
                               for v in values.tolist())
    holds = np.fromiter((clause.holds({clause.fact: v}) for v in values.values), bool,
                        len(values.values))
    return holds[values.codes]


def _first_holding(conditions: tuple[Condition, ...],
                   fact: Callable[[str, np.ndarray], np.ndarray | Categories],
                   n: int) -> np.ndarray:
    """For each of ``n`` rows the index of the first condition that holds, -1 where none.
    A clause is evaluated only on the rows where the clauses before it hold, and a
    condition only on the rows no earlier condition decided."""
    which = np.full(n, -1)
    undecided = np.arange(n)
    for k, condition in enumerate(conditions):
        rows = undecided
        for clause in condition.clauses:
            if not rows.size:
                break
            rows = rows[_holds(clause, fact(clause.fact, rows))]
        which[rows] = k
        undecided = undecided[which[undecided] < 0]
    return which


@dataclass(frozen=True)
class _BaseCandidates:
    """The candidates of one base model: ``index`` maps a name to its row in ``table``."""

    table: _Candidates
    index: dict[str, int]
    rows: np.ndarray  # index.values()


class _Ranking:
    """The rows of wanted versions in rank order, sorted lazily: a tick reads the hot set
    and the top of the host tier, rarely the whole ranking, so only a prefix (doubled as
    needed) is selected with ``np.partition`` and sorted. Iterating twice reuses it."""

    def __init__(self, table: _Candidates, rows: np.ndarray, resident: np.ndarray,
                 margin: float, expected: int = 0) -> None:
        """``expected``: how many rows the caller will read at least (the hot set)."""
        self.table = table
        self.expected = expected
        key = -(table.score_np[rows] + margin * resident)
        first = table.first_np[rows]
        # Never-evict and canary versions rank first: two groups, each by (key, name).
        self.groups = [(rows[first], key[first]), (rows[~first], key[~first])]
        self.rows = rows  # unordered
        self.size = len(rows)
        self.order: list[int] = []

    def top(self, k: int) -> list[int]:
        """The first ``k`` rows in rank order (fewer when fewer are wanted)."""
        while len(self.order) < k and self._extend():
            pass
        return self.order[:k]

    def __iter__(self) -> Iterator[int]:
        n = 0
        while n < len(self.order) or self._extend():
            yield self.order[n]
            n += 1

    def _extend(self) -> bool:
        if len(self.order) == self.size:
            return False
        m = max(64, self.expected + 1, 2 * len(self.order))
        order: list[int] = []
        for rows, key in self.groups:
            if len(order) >= m:
                break
            order += self._top(rows, key, m - len(order))
        self.order = order
        return True

    def _top(self, rows: np.ndarray, key: np.ndarray, m: int) -> list[int]:
        """The ``m`` best of ``rows`` by (key, name), in order."""
        if m < len(rows):
            kth = np.partition(key, m - 1)[m - 1]
            keep = key <= kth  # every tie at the m-th key: the names decide among them
            rows, key = rows[keep], key[keep]
        by_key = np.argsort(key, kind="stable")
        rows, key = rows[by_key], key[by_key]
        out = rows.tolist()
        tied = np.diff(np.concatenate(([0], (key[1:] == key[:-1]).astype(np.int8), [0])))
        lora = self.table.lora
        for start, end in zip(np.flatnonzero(tied == 1).tolist(),
                              np.flatnonzero(tied == -1).tolist(), strict=True):
            out[start:end + 1] = sorted(out[start:end + 1], key=lora.__getitem__)
        return out[:m]


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

    @classmethod
    def of(cls, state: WorkerState) -> _Tiers:
        adapters = state.adapters
        return cls({a.lora_name: a.pinned for a in adapters if a.tier == "gpu"},
                   frozenset(a.lora_name for a in adapters if a.tier != "gpu"),
                   frozenset(a.lora_name for a in adapters if a.tier != "gpu" and a.pinned))


def _effective(state: WorkerState, tiers: _Tiers, memory: WorkerMemory,
               records: Mapping[str, AdapterRecord], now: float) -> _Worker:
    adapters = state.adapters
    w = _Worker(state=state, gpu=tiers.gpu, host=tiers.host, host_pinned=tiers.host_pinned,
                host_bytes=state.host_bytes_used,
                loads=[t for t in memory.loads if now - t < LOAD_WINDOW_S], seq=memory.seq)
    if memory.pending:
        loaded = {a.lora_name: a for a in adapters}
        w.pending = [c for c in memory.pending
                     if c.deadline.timestamp() > now and not _reflected(c, loaded)]
        for c in w.pending:
            r = records.get(c.lora_name)
            _apply(w, c.action, c.lora_name, r.size_bytes if r is not None else 0)
    return w


def _copy_on(w: _Worker, lora: str) -> Copy:
    if lora in w.gpu:
        return Copy("gpu", w.gpu[lora])
    return Copy("host", lora in w.host_pinned) if lora in w.host else Copy()


def _apply(w: _Worker, action: CommandAction, lora: str, size: int) -> None:
    """Expect ``action``'s effect (``kernel.command_effects``) on ``w``'s copy of ``lora``."""
    before = _copy_on(w, lora)
    after = effect(action, before).after
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
    if after.tier == "host" and after.pinned:
        w.host_pinned.add(lora)
    else:
        w.host_pinned.discard(lora)
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
        doubled their cost)."""
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
            cmd = self.validated = CacheCommand(**fields)
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
        records, revoked = registry.records, registry.revoked
        table = _Candidates(registry, columns, scheduled or {}, policy, now, policy.never_evict,
                            policy.demote)
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
            rows = registry.bases.get(base, no_rows)
            _plan_base(p, _BaseCandidates(table, rows.index, rows.rows), records, revoked,
                       fleet.get(base, []))

        workers_out = [w for ws in fleet.values() for w in ws]
        new_memory = {**memory, **{w.id: w.memory() for w in workers_out}}
        return Plan(_Lazy(lambda: _placement(workers_out, "gpu")),
                    _Lazy(lambda: _placement(workers_out, "host")), p.commands, p.waiting,
                    new_memory,
                    _Lazy(lambda: dict(zip(registry.ranked_names,
                                           table.score_np[registry.ranked_rows].tolist(),
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


def _plan_base(p: _Planner, cands: _BaseCandidates, records: Mapping[str, AdapterRecord],
               revoked: set[str], workers: list[_Worker]) -> None:
    """Rules 0-9 for one base model; ``revoked`` names the revoked versions."""
    policy = p.policy
    margin = policy.hysteresis_margin
    t, index = cands.table, cands.index
    capacity = sum(max(0, w.state.gpu_slots_total) for w in workers)
    k = min(policy.gpu_slots_per_base_model, capacity)
    resident_names: set[str] = set().union(*(w.gpu for w in workers))
    _cap_protected(cands, resident_names, k, policy)

    # 0: unpin what is no longer protected before anything may unload it.
    for w in workers:
        for lora in sorted(lora for lora, pinned in w.gpu.items() if pinned):
            i = index.get(lora)
            if (i is not None and t.protected[i]) or lora not in records:
                continue
            if i is not None and i in t.over_capacity:
                p.issue(w, CommandAction.unpin, t.record[i], lora,
                        CommandRule.protected_over_capacity, t.score[i], t.detail(i))
            else:
                p.issue(w, CommandAction.unpin, records[lora], lora,
                        CommandRule.no_longer_protected, t.score[i] if i is not None else None)

    # 1-3: revoked everywhere; not-serving and demote-condition residents off the GPU. Only
    # the residents these rules act on are visited (in name order, as if all were), found
    # column-wise: each resident name is looked up once.
    names = list(resident_names)
    name_rows = np.fromiter(map(index.get, names, repeat(-1)), np.intp, len(names))
    known = np.flatnonzero(name_rows >= 0)
    acting_names = (resident_names & revoked) | {
        names[j] for j in np.flatnonzero(name_rows < 0).tolist() if names[j] in records} | {
        names[j] for j in known[t.demoted_np[name_rows[known]]].tolist()}
    for w in workers:
        acting = (w.host & revoked) | (w.gpu.keys() & acting_names)
        for lora in sorted(acting):
            r = records[lora]
            i = index.get(lora)
            if lora in revoked:
                p.issue(w, CommandAction.evict, r, lora, CommandRule.revoke, None,
                        "version revoked")
            elif lora in w.gpu and i is None:
                p.issue(w, CommandAction.demote_to_host, r, lora, CommandRule.not_serving, None,
                        f"status {r.status.value}")
            elif lora in w.gpu and i is not None and t.demoted[i]:
                p.issue(w, CommandAction.demote_to_host, r, lora, CommandRule.demote, t.score[i],
                        f"demote_when: {t.demote_rule(i)}")

    on_gpu: dict[str, list[_Worker]] = defaultdict(list)
    for w in workers:
        for lora in w.gpu:
            on_gpu[lora].append(w)
    rows = cands.rows
    wanted_rows = rows[~t.demoted_np[rows]]
    on_rows = np.fromiter(map(index.get, on_gpu, repeat(-1)), np.intp, len(on_gpu))
    resident = np.isin(wanted_rows, on_rows[on_rows >= 0])
    wanted = _Ranking(t, wanted_rows, resident, margin, k)
    hot = wanted.top(k)
    hot_names = set(map(t.lora.__getitem__, hot))

    # Residents outside the hot set that may give up their slot: lowest rank first (a heap
    # of distinct keys: the order it is built in does not matter).
    displaceable: list[tuple[Rank, str, str]] = [
        (_worst_first(t.rank(i, True, margin)), lora, w.id)
        for lora in on_gpu.keys() - hot_names
        if (i := index.get(lora)) is not None and not t.protected[i]
        for w in on_gpu[lora]]
    heapq.heapify(displaceable)
    by_id = {w.id: w for w in workers}
    in_use = len(on_gpu)

    # 5: loads in rank order.
    free_heap = [(-w.free_slots(), w.id) for w in workers]
    heapq.heapify(free_heap)
    free_somewhere: bool | None = None  # any worker with a free slot, until the next command
    missing = hot_names - on_gpu.keys()  # loading one adds only itself to on_gpu
    for i in hot if missing else ():
        lora = t.lora[i]
        if lora not in missing:
            continue
        target = _worker_with_free_slot(free_heap, by_id, policy) if in_use < k else None
        rule = CommandRule.hot_score
        if target is None:
            victim = _pop_victim(displaceable, by_id, policy)
            if victim is None:
                # No victim left means ``displaceable`` is empty: only free slots can block.
                if free_somewhere is None:
                    free_somewhere = any(w.free_slots() > 0 for w in workers)
                p.waiting.append(Waiting(lora, t.score[i], WaitReason.cold_load_budget
                                         if free_somewhere else WaitReason.no_gpu_slot))
                continue
            victim_lora, target = victim
            v = index[victim_lora]
            p.issue(target, CommandAction.demote_to_host, t.record[v], victim_lora,
                    CommandRule.slot_needed, t.score[v],
                    f"for {lora} scoring {t.score[i]:.4f} (> {t.score[v]:.4f} + margin {margin})")
            in_use -= 1
            rule = CommandRule.hot_score_displace
        warmup = (policy.request_budgets.canary.warmup_requests
                  if t.record[i].status is AdapterStatus.canary else 0)
        p.issue(target, CommandAction.load_gpu, t.record[i], lora, rule, t.score[i],
                t.detail(i), warmup)
        free_somewhere = None
        in_use += 1
        on_gpu[lora].append(target)
        heapq.heappush(free_heap, (-target.free_slots(), target.id))

    # 6: a pinned minimum hot copy for never-evict versions (unpins came first, in 0).
    protected_names = set(map(t.lora.__getitem__, cands.rows[t.protected_np[cands.rows]].tolist()))
    for w in workers:
        for lora in sorted(lora for lora in w.gpu.keys() & protected_names if not w.gpu[lora]):
            i = index[lora]
            p.issue(w, CommandAction.pin, t.record[i], lora, CommandRule.never_evict, t.score[i],
                    t.detail(i))

    # 7: HBM above the low watermark: give back the lowest-ranked evictable resident.
    for w in workers:
        if not w.above_watermark(policy) or any(
                c.action in (CommandAction.demote_to_host, CommandAction.evict)
                for c in w.pending):
            continue  # wait for the pending unload to show in the worker's HBM usage
        evictable = [i for lora in w.gpu
                     if (i := index.get(lora)) is not None and not t.protected[i]]
        if evictable:
            worst = max(evictable, key=lambda i: t.rank(i, True, margin))
            p.issue(w, CommandAction.demote_to_host, t.record[worst], t.lora[worst],
                    CommandRule.hbm_watermark, t.score[worst],
                    f"hbm_usage {w.state.hbm_usage:.2f} > {policy.hbm_low_watermark}")

    _plan_host(p, cands, wanted, records, workers)


def protected_cap(policy: Policy, slots: int) -> int:
    """How many never-evict versions of one base model may be protected (pinned, ranked
    first) when the base model has ``slots`` hot-set slots. Rounded up so that a share of a
    slot is a slot; the tolerance keeps ``0.3 * 10`` at 3."""
    return max(1, math.ceil(round(policy.max_protected_gpu_share * slots, 9)))


def _cap_protected(cands: _BaseCandidates, resident: set[str], slots: int,
                   policy: Policy) -> None:
    """Unprotect the never-evict versions beyond ``protected_cap``, lowest rank first (a
    resident ranks with the hysteresis margin, so the protected set does not flap). They
    then compete by score, may be demoted or displaced, and are unpinned."""
    t = cands.table
    protected = cands.rows[t.protected_np[cands.rows]].tolist()
    cap = protected_cap(policy, slots)
    if len(protected) <= cap:
        return
    margin = policy.hysteresis_margin
    protected.sort(key=lambda i: t.rank(i, t.lora[i] in resident, margin))
    note = (f"over capacity: the policy promises {len(protected)} never-evict copies, more than "
            f"max_protected_gpu_share {policy.max_protected_gpu_share} of {slots} GPU slots "
            f"allows ({cap}); ranked by score, not pinned")
    for i in protected[cap:]:
        t.unprotect(i, note)


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


def _pop_victim(displaceable: list, by_id: Mapping[str, _Worker],
                policy: Policy) -> tuple[str, _Worker] | None:
    """The lowest-ranked displaceable resident on a worker that may still load."""
    while displaceable:
        _, lora, wid = heapq.heappop(displaceable)
        w = by_id[wid]
        if lora in w.gpu and w.loads_left(policy) > 0 and not w.above_watermark(policy):
            return lora, w
    return None


def _plan_host(p: _Planner, cands: _BaseCandidates, wanted: _Ranking,
               records: Mapping[str, AdapterRecord], workers: list[_Worker]) -> None:
    """Host tier: prewarm wanted versions found nowhere; evict host copies over limits."""
    policy = p.policy
    margin = policy.hysteresis_margin
    t, index = cands.table, cands.index
    host_only: set[str] = set().union(*(w.host for w in workers))
    slots_left = policy.host_slots_per_base_model - len(host_only)
    # Only a prewarm reads where versions are: a full host tier needs no such set.
    anywhere = host_only.union(*(w.gpu for w in workers)) if slots_left > 0 else host_only
    byte_heap = [(-(w.state.host_bytes_budget - w.host_bytes), w.id) for w in workers]
    heapq.heapify(byte_heap)
    by_id = {w.id: w for w in workers}
    ranked = iter(wanted)
    smallest: int | None = None  # size of the smallest wanted version, once one did not fit
    while slots_left > 0 and byte_heap and (i := next(ranked, None)) is not None:
        lora = t.lora[i]
        if lora in anywhere:
            continue
        neg_free, wid = byte_heap[0]
        if -neg_free < t.record[i].size_bytes:
            # Does not fit the emptiest worker: skip, smaller ones may fit. When none is small
            # enough, stop (a fleet with full host tiers would walk the whole ranking).
            if smallest is None:
                smallest = int(t.registry.size_bytes[wanted.rows].min())
            if -neg_free < smallest:
                break
            continue
        w = by_id[wid]
        p.issue(w, CommandAction.prewarm_host, t.record[i], lora, CommandRule.host_tier, t.score[i],
                t.detail(i))
        host_only.add(lora)
        slots_left -= 1
        heapq.heapreplace(byte_heap, (-(w.state.host_bytes_budget - w.host_bytes), wid))

    def worst_first(loras: Iterable[str]) -> list[str]:
        def key(lora: str) -> Rank:
            i = index.get(lora)
            return _worst_first(t.rank(i, False, margin)) if i is not None else (-2, 0.0, lora)
        return sorted(loras, key=key)

    def evict(w: _Worker, lora: str, detail: str) -> None:
        i = index.get(lora)
        p.issue(w, CommandAction.evict, records[lora], lora, CommandRule.host_pressure,
                t.score[i] if i is not None else None, detail)

    # Sorting is most of the host pass's cost: sort only when a limit is exceeded.
    over = len(host_only) - policy.host_slots_per_base_model
    if over > 0:
        holders: dict[str, list[_Worker]] = defaultdict(list)
        for w in workers:
            for lora in w.host:
                holders[lora].append(w)
        for lora in worst_first(lora for lora in holders if lora in records):
            if over <= 0:
                break
            for w in holders[lora]:
                evict(w, lora, "host slots per base model")
            over -= 1
    for w in workers:
        if w.host_bytes <= w.state.host_bytes_budget:
            continue
        for lora in worst_first(w.host):
            if w.host_bytes <= w.state.host_bytes_budget:
                break
            if lora in records:
                evict(w, lora, "host byte budget")
