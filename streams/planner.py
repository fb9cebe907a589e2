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

Cost: one pass over versions and residents plus heap operations: O(n log n) per tick.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from loraplane.policy import Condition, Policy
from schemas.adapter import AdapterRecord, AdapterStatus
from schemas.commands import CacheCommand, CommandAction, CommandReason
from schemas.registry import AdapterView
from schemas.worker_state import LoadedAdapter, WorkerState
from streams.scores import ScoreState, hot_score, merged, score_key

LOAD_WINDOW_S = 60.0
_EMPTY = ScoreState()
RECORD_FACTS = frozenset({"status", "canary_percent", "tenant_priority"})
"""Facts that come from the registry record alone: the same for every version that shares
them, whatever its demand."""


@dataclass(frozen=True)
class WorkerMemory:
    """What the planner told one worker that the worker's state may not show yet."""

    seq: int = 0  # commands issued to this worker so far: the epoch in command ids
    pending: tuple[CacheCommand, ...] = ()
    loads: tuple[float, ...] = ()  # issue times of load_gpu commands in the last minute

    def to_dict(self) -> dict:
        return {"seq": self.seq, "loads": list(self.loads),
                "pending": [c.model_dump(mode="json") for c in self.pending]}

    @classmethod
    def from_dict(cls, data: dict) -> WorkerMemory:
        return cls(seq=int(data["seq"]), loads=tuple(float(t) for t in data["loads"]),
                   pending=tuple(CacheCommand.model_validate(c) for c in data["pending"]))


@dataclass(frozen=True)
class Waiting:
    """A hot-set version that could not be loaded this tick, and why."""

    lora_name: str
    score: float
    reason: str  # "cold_load_budget" | "no_gpu_slot"


@dataclass(frozen=True)
class Plan:
    gpu: dict[str, tuple[str, ...]]  # lora_name -> workers holding it on GPU once applied
    host: dict[str, tuple[str, ...]]  # lora_name -> workers holding it on host only
    commands: list[CacheCommand]
    waiting: list[Waiting]
    memory: dict[str, WorkerMemory]
    scores: dict[str, float]  # lora_name -> hot score, for audit


@dataclass
class _Candidate:
    record: AdapterRecord
    lora: str  # record.lora_name, computed once: it is read on every comparison
    score: float
    protected: bool  # a never_evict condition holds: keep a pinned hot copy
    first: bool  # ranked ahead of scores (never-evict or canary)
    demote_rule: str | None  # text of the demote condition that holds, if any
    reason_detail: str = ""
    over_capacity: bool = False  # protected, but beyond max_protected_gpu_share: unprotected

    @property
    def demoted(self) -> bool:
        """A demote condition holds and nothing protects the version."""
        return self.demote_rule is not None and not self.protected

    def rank(self, resident: bool, margin: float) -> tuple[int, float, str]:
        """Sort key: smaller ranks higher."""
        return (0 if self.first else 1, -(self.score + (margin if resident else 0.0)), self.lora)


@dataclass
class _Worker:
    """A worker's state with pending commands applied; mutated while planning."""

    state: WorkerState
    gpu: dict[str, bool] = field(default_factory=dict)  # lora -> pinned
    host: set[str] = field(default_factory=set)  # host-only copies
    host_bytes: int = 0
    loads: list[float] = field(default_factory=list)
    memory: WorkerMemory = field(default_factory=WorkerMemory)

    @property
    def id(self) -> str:
        return self.state.worker_id

    def free_slots(self) -> int:
        return self.state.gpu_slots_total - len(self.gpu)

    def loads_left(self, policy: Policy) -> int:
        return policy.cold_loads_per_minute_per_worker - len(self.loads)

    def above_watermark(self, policy: Policy) -> bool:
        return self.state.hbm_usage is not None and self.state.hbm_usage > policy.hbm_low_watermark


def _reflected(cmd: CacheCommand, loaded: Mapping[str, LoadedAdapter]) -> bool:
    """Does the worker's reported state (``loaded``: its adapters by name) already show the
    command's effect?"""
    a = loaded.get(cmd.lora_name)
    match cmd.action:
        case CommandAction.load_gpu:
            return a is not None and a.tier == "gpu"
        case CommandAction.prewarm_host:
            return a is not None
        case CommandAction.demote_to_host:
            return a is None or a.tier == "host"
        case CommandAction.evict:
            return a is None
        case CommandAction.pin:
            return a is not None and a.pinned
        case CommandAction.unpin:
            return a is None or not a.pinned
    return False


def _effective(state: WorkerState, memory: WorkerMemory, sizes: Mapping[str, int],
               now: float) -> _Worker:
    loaded = {a.lora_name: a for a in state.adapters}
    pending = tuple(c for c in memory.pending
                    if c.deadline.timestamp() > now and not _reflected(c, loaded))
    w = _Worker(state=state, memory=replace(memory, pending=pending),
                loads=[t for t in memory.loads if now - t < LOAD_WINDOW_S],
                host_bytes=state.host_bytes_used)
    for a in state.adapters:
        if a.tier == "gpu":
            w.gpu[a.lora_name] = a.pinned
        else:
            w.host.add(a.lora_name)
    for c in pending:
        _apply(w, c.action, c.lora_name, sizes.get(c.lora_name, 0))
    return w


def _apply(w: _Worker, action: CommandAction, lora: str, size: int) -> None:
    match action:
        case CommandAction.load_gpu:
            if lora not in w.gpu and lora not in w.host:
                w.host_bytes += size
            w.host.discard(lora)
            w.gpu.setdefault(lora, False)
        case CommandAction.prewarm_host:
            if lora not in w.gpu and lora not in w.host:
                w.host_bytes += size
                w.host.add(lora)
        case CommandAction.demote_to_host:
            if w.gpu.pop(lora, None) is not None:
                w.host.add(lora)
        case CommandAction.evict:
            if w.gpu.pop(lora, None) is not None or lora in w.host:
                w.host_bytes = max(0, w.host_bytes - size)
            w.host.discard(lora)
        case CommandAction.pin | CommandAction.unpin:
            if lora in w.gpu:
                w.gpu[lora] = action is CommandAction.pin


def command_id(worker_id: str, action: str, lora: str, seq: int) -> str:
    digest = hashlib.blake2b(f"{worker_id}|{action}|{lora}|{seq}".encode(),
                             digest_size=16).hexdigest()
    return f"c{digest}"


class _Planner:
    def __init__(self, policy: Policy, now: float) -> None:
        self.policy = policy
        self.now = now
        self.weights = policy.weights
        self.never_evict: tuple[Condition, ...] = policy.never_evict
        self.demote: tuple[Condition, ...] = policy.demote
        self.facts_read = {cl.fact for c in (*self.never_evict, *self.demote) for cl in c.clauses}
        """Facts some condition reads: the others are not computed (one tick computes the facts
        of every version)."""
        self.protected_by_record: dict[tuple[object, ...], str | None] | None = (
            {} if all(cl.fact in RECORD_FACTS for c in self.never_evict for cl in c.clauses)
            else None)
        """When every never_evict condition reads only record facts (the default), which one
        holds is looked up by (status, canary_percent, priority): a handful of keys for all
        versions."""
        self.commands: list[CacheCommand] = []
        self.waiting: list[Waiting] = []
        self.issued_at = datetime.fromtimestamp(now, UTC)
        self.deadline = self.issued_at + timedelta(seconds=policy.command_deadline_s)

    def issue(self, w: _Worker, action: CommandAction, record: AdapterRecord, rule: str,
              score: float | None, detail: str = "", warmup: int = 0) -> None:
        seq = w.memory.seq + 1
        lora = record.lora_name
        cmd = CacheCommand(
            command_id=command_id(w.id, action.value, lora, seq),
            worker_id=w.id, action=action, base_model=record.base_model,
            tenant_id=record.tenant_id, adapter_id=record.adapter_id, version=record.version,
            sha256=record.sha256, lora_name=lora,
            reason=CommandReason(rule=rule, score=None if score is None else round(score, 6),
                                 detail=detail[:512]),
            issued_at=self.issued_at, deadline=self.deadline, warmup_requests=warmup)
        w.memory = replace(w.memory, seq=seq, pending=(*w.memory.pending, cmd))
        if action is CommandAction.load_gpu:
            w.loads.append(self.now)
        _apply(w, action, lora, record.size_bytes)
        self.commands.append(cmd)

    def candidate(self, record: AdapterRecord, lora: str,
                  scores: Mapping[str, ScoreState], scheduled: float) -> _Candidate:
        state = scores.get(score_key(record.adapter_id, record.version), _EMPTY)
        unattributed = scores.get(score_key(record.adapter_id, None))
        if record.status is AdapterStatus.active and unattributed is not None:
            state = merged(state, unattributed)  # merging an empty state changes nothing
        score = hot_score(state, record.priority.value, scheduled, self.policy, self.now,
                          self.weights)
        canary = record.status is AdapterStatus.canary
        expected = scheduled > 0 or canary
        idle = 0.0 if expected else state.idle_minutes(self.now)
        read = self.facts_read
        facts: dict[str, float | str | None] = {
            "status": record.status.value,
            "canary_percent": record.release.canary_percent,
            "tenant_priority": record.priority.value,
            "no_request_for_minutes": idle if math.isfinite(idle) else 1e18,
        }
        if "error_rate_after_load" in read:
            facts["error_rate_after_load"] = state.error_rate_after_load(self.now)
        if "request_class" in read:
            facts["request_class"] = state.dominant_class(self.now)
        cache = self.protected_by_record
        key = (facts["status"], facts["canary_percent"], facts["tenant_priority"])
        if cache is not None and key in cache:
            protected = cache[key]
        else:
            protected = next((c.text for c in self.never_evict if c.holds(facts)), None)
            if cache is not None:
                cache[key] = protected
        # Computed for protected versions too: one over the protected cap loses protection.
        demote = next((c.text for c in self.demote if c.holds(facts)), None)
        detail = (f"never_evict: {protected}" if protected
                  else "scheduled warm-up" if scheduled > 0 else "canary prewarm" if canary
                  else "")
        return _Candidate(record, lora, score, protected is not None,
                          protected is not None or canary, demote, detail)


def plan(views: Iterable[AdapterView], scores: Mapping[str, ScoreState],
         workers: Iterable[WorkerState], policy: Policy, now: float,
         memory: Mapping[str, WorkerMemory] | None = None,
         scheduled: Mapping[str, float] | None = None) -> Plan:
    """One planning tick. ``scheduled`` maps adapter_id -> scheduled warm-up score
    (streams.schedules.warmup_scores); ``memory`` is the previous plan's ``memory``."""
    memory = memory or {}
    scheduled = scheduled or {}
    p = _Planner(policy, now)
    records: dict[str, AdapterRecord] = {}
    by_base: dict[str, list[_Candidate]] = defaultdict(list)
    for view in views:
        for r in view.versions:
            lora = r.lora_name
            records[lora] = r
            if r.status in (AdapterStatus.active, AdapterStatus.canary):
                by_base[r.base_model].append(
                    p.candidate(r, lora, scores, scheduled.get(r.adapter_id, 0.0)))
    sizes = {lora: r.size_bytes for lora, r in records.items()}
    fleet: dict[str, list[_Worker]] = defaultdict(list)
    for state in sorted(workers, key=lambda s: s.worker_id):
        fleet[state.base_model].append(
            _effective(state, memory.get(state.worker_id, WorkerMemory()), sizes, now))

    all_scores: dict[str, float] = {}
    for base in sorted(set(by_base) | set(fleet)):
        cands = {c.lora: c for c in by_base.get(base, [])}
        all_scores.update({lora: c.score for lora, c in cands.items()})
        _plan_base(p, cands, records, fleet.get(base, []))

    workers_out = [w for ws in fleet.values() for w in ws]
    new_memory = {**memory, **{w.id: replace(w.memory, loads=tuple(w.loads))
                               for w in workers_out}}
    gpu: dict[str, list[str]] = defaultdict(list)
    host: dict[str, list[str]] = defaultdict(list)
    for w in workers_out:
        for lora in w.gpu:
            gpu[lora].append(w.id)
        for lora in w.host:
            host[lora].append(w.id)
    return Plan({k: tuple(v) for k, v in gpu.items()}, {k: tuple(v) for k, v in host.items()},
                p.commands, p.waiting, new_memory, all_scores)


def _plan_base(p: _Planner, cands: dict[str, _Candidate], records: Mapping[str, AdapterRecord],
               workers: list[_Worker]) -> None:
    policy = p.policy
    margin = policy.hysteresis_margin
    capacity = sum(max(0, w.state.gpu_slots_total) for w in workers)
    k = min(policy.gpu_slots_per_base_model, capacity)
    _cap_protected(cands, {lora for w in workers for lora in w.gpu}, k, policy)

    # 0: unpin what is no longer protected before anything may unload it.
    for w in workers:
        for lora, pinned in sorted(w.gpu.items()):
            c = cands.get(lora)
            if not pinned or (c is not None and c.protected) or lora not in records:
                continue
            if c is not None and c.over_capacity:
                p.issue(w, CommandAction.unpin, c.record, "protected_over_capacity", c.score,
                        c.reason_detail)
            else:
                p.issue(w, CommandAction.unpin, records[lora], "no_longer_protected",
                        c.score if c else None)

    # 1-3: revoked everywhere; not-serving and demote-condition residents off the GPU.
    for w in workers:
        for lora in sorted({*w.gpu, *w.host}):
            r = records.get(lora)
            if r is None:
                continue  # not in the registry: nothing to address it by; ignore
            if r.status is AdapterStatus.revoked:
                p.issue(w, CommandAction.evict, r, "revoke", None, "version revoked")
            elif lora in w.gpu and lora not in cands:
                p.issue(w, CommandAction.demote_to_host, r, "not_serving", None,
                        f"status {r.status.value}")
            elif lora in w.gpu and cands[lora].demoted:
                c = cands[lora]
                p.issue(w, CommandAction.demote_to_host, r, "demote", c.score,
                        f"demote_when: {c.demote_rule}")

    on_gpu: dict[str, list[_Worker]] = defaultdict(list)
    for w in workers:
        for lora in w.gpu:
            on_gpu[lora].append(w)
    wanted = sorted((c for c in cands.values() if not c.demoted),
                    key=lambda c: c.rank(c.lora in on_gpu, margin))
    hot = wanted[:k]
    hot_names = {c.lora for c in hot}

    # Residents outside the hot set that may give up their slot: lowest rank first.
    displaceable: list[tuple[tuple[int, float, str], str, str]] = []
    for lora, ws in on_gpu.items():
        c = cands.get(lora)
        if c is not None and lora not in hot_names and not c.protected:
            for w in ws:
                heapq.heappush(displaceable, (_worst_first(c.rank(True, margin)), lora, w.id))
    by_id = {w.id: w for w in workers}
    in_use = len(on_gpu)

    # 5: loads in rank order.
    free_heap = [(-w.free_slots(), w.id) for w in workers]
    heapq.heapify(free_heap)
    for c in hot:
        if c.lora in on_gpu:
            continue
        target = _worker_with_free_slot(free_heap, by_id, policy) if in_use < k else None
        rule = "hot_score"
        if target is None:
            victim = _pop_victim(displaceable, by_id, policy)
            if victim is None:
                blocked = any(w.free_slots() > 0 or displaceable for w in workers)
                p.waiting.append(Waiting(c.lora, c.score, "cold_load_budget"
                                         if blocked else "no_gpu_slot"))
                continue
            lora, target = victim
            vc = cands[lora]
            p.issue(target, CommandAction.demote_to_host, vc.record, "slot_needed", vc.score,
                    f"for {c.lora} scoring {c.score:.4f} (> {vc.score:.4f} + margin {margin})")
            in_use -= 1
            rule = "hot_score_displace"
        warmup = (policy.request_budgets.canary.warmup_requests
                  if c.record.status is AdapterStatus.canary else 0)
        p.issue(target, CommandAction.load_gpu, c.record, rule, c.score, c.reason_detail,
                warmup)
        in_use += 1
        on_gpu[c.lora].append(target)
        heapq.heappush(free_heap, (-target.free_slots(), target.id))

    # 6: a pinned minimum hot copy for never-evict versions (unpins came first, in 0).
    for w in workers:
        for lora, pinned in sorted(w.gpu.items()):
            c = cands.get(lora)
            if c is not None and c.protected and not pinned:
                p.issue(w, CommandAction.pin, c.record, "never_evict", c.score, c.reason_detail)

    # 7: HBM above the low watermark: give back the lowest-ranked evictable resident.
    for w in workers:
        if not w.above_watermark(policy) or any(
                c.action in (CommandAction.demote_to_host, CommandAction.evict)
                for c in w.memory.pending):
            continue  # wait for the pending unload to show in the worker's HBM usage
        evictable = [cands[lora] for lora in w.gpu if lora in cands and not cands[lora].protected]
        if evictable:
            worst = max(evictable, key=lambda c: c.rank(True, margin))
            p.issue(w, CommandAction.demote_to_host, worst.record, "hbm_watermark", worst.score,
                    f"hbm_usage {w.state.hbm_usage:.2f} > {policy.hbm_low_watermark}")

    _plan_host(p, cands, wanted, records, workers)


def protected_cap(policy: Policy, slots: int) -> int:
    """How many never-evict versions of one base model may be protected (pinned, ranked
    first) when the base model has ``slots`` hot-set slots. Rounded up so that a share of a
    slot is a slot; the tolerance keeps ``0.3 * 10`` at 3."""
    return max(1, math.ceil(round(policy.max_protected_gpu_share * slots, 9)))


def _cap_protected(cands: Mapping[str, _Candidate], resident: set[str], slots: int,
                   policy: Policy) -> None:
    """Unprotect the never-evict versions beyond ``protected_cap``, lowest rank first (a
    resident ranks with the hysteresis margin, so the protected set does not flap). They
    then compete by score, may be demoted or displaced, and are unpinned."""
    protected = [c for c in cands.values() if c.protected]
    cap = protected_cap(policy, slots)
    if len(protected) <= cap:
        return
    margin = policy.hysteresis_margin
    protected.sort(key=lambda c: c.rank(c.lora in resident, margin))
    note = (f"over capacity: the policy promises {len(protected)} never-evict copies, more than "
            f"max_protected_gpu_share {policy.max_protected_gpu_share} of {slots} GPU slots "
            f"allows ({cap}); ranked by score, not pinned")
    for c in protected[cap:]:
        c.protected = c.first = False
        c.over_capacity = True
        c.reason_detail = f"{c.reason_detail}; {note}"


def _worst_first(rank: tuple[int, float, str]) -> tuple[int, float, str]:
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


def _plan_host(p: _Planner, cands: dict[str, _Candidate], wanted: list[_Candidate],
               records: Mapping[str, AdapterRecord], workers: list[_Worker]) -> None:
    """Host tier: prewarm wanted versions found nowhere; evict host copies over limits."""
    policy = p.policy
    margin = policy.hysteresis_margin
    anywhere = {lora for w in workers for lora in (*w.gpu, *w.host)}
    host_only = {lora for w in workers for lora in w.host}
    slots_left = policy.host_slots_per_base_model - len(host_only)
    byte_heap = [(-(w.state.host_bytes_budget - w.host_bytes), w.id) for w in workers]
    heapq.heapify(byte_heap)
    by_id = {w.id: w for w in workers}
    for c in wanted:
        if slots_left <= 0 or not byte_heap:
            break
        if c.lora in anywhere:
            continue
        neg_free, wid = byte_heap[0]
        if -neg_free < c.record.size_bytes:
            continue  # does not fit the emptiest worker: skip, smaller ones may fit
        w = by_id[wid]
        p.issue(w, CommandAction.prewarm_host, c.record, "host_tier", c.score, c.reason_detail)
        slots_left -= 1
        heapq.heapreplace(byte_heap, (-(w.state.host_bytes_budget - w.host_bytes), wid))

    def worst_first(loras: Iterable[str]) -> list[str]:
        def key(lora: str) -> tuple[int, float, str]:
            c = cands.get(lora)
            return _worst_first(c.rank(False, margin)) if c else (-2, 0.0, lora)
        return sorted(loras, key=key)

    def evict(w: _Worker, lora: str, detail: str) -> None:
        c = cands.get(lora)
        p.issue(w, CommandAction.evict, records[lora], "host_pressure",
                c.score if c else None, detail)

    holders: dict[str, list[_Worker]] = defaultdict(list)
    for w in workers:
        for lora in w.host:
            holders[lora].append(w)
    # Sorting is most of the host pass's cost: sort only when a limit is exceeded.
    over = len(holders) - policy.host_slots_per_base_model
    if over > 0:
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
