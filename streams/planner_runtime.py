"""The planner runtime: the pure ``streams.planner.Planner`` fed from Kafka only (live tails
of ``scores``, ``registry`` through ``VerifiedRegistry``, ``worker-state`` and
``planner-memory``, plus the schedule file), planning only while it holds the lease
(``streams.planner_lease``) and only once every tail has read its topic to the end. A
tick's commands (signed at send time), decisions, audit records and the memory of the
workers it changed are one Kafka transaction, so after a crash or a takeover the memory
knows exactly what went out: the new active resends pending commands under their own ids
and never re-decides them. ``preview`` plans one tick and writes nothing (``loraplane plan
show``). docs/architecture.md, "The planner runtime", gives the inputs, the transaction and
the takeover.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import msgspec
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel

from loraplane.kernel import collector, kafka
from loraplane.kernel import metric_names as m
from loraplane.kernel.bus import ProducerSink, Record, latest_per_key, moved_away, read_topic
from loraplane.kernel.command_partition import PartitionCount, commands_partitions, partition_for
from loraplane.kernel.config import Settings
from loraplane.kernel.heartbeat import beat_of, heard_lately
from loraplane.kernel.log_burst import LogBurst
from loraplane.kernel.progress import Progress, Watchdog
from loraplane.kernel.topic_tail import TopicTail
from loraplane.kernel.topics import topic_name
from loraplane.kernel.transactions import STEP_TIMEOUT_S, bounded, transact
from loraplane.kernel.worker_states import AtHome, Placed, at_home, worker_state_of
from loraplane.registry.live import CHECKPOINTS_FILE, VerifiedRegistry
from loraplane.registry.topic import RegistryScope, registry_tail
from loraplane.schemas.audit import AuditRecord
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.keyring import (
    Keyring,
    KeyringError,
    KeyringFile,
    KeyRole,
)
from loraplane.schemas.planner_memory import PLANNER_MEMORY_SIGNING_DOMAIN, PlannerMemory
from loraplane.schemas.reasons import RegistryViewRejection as ViewReason
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.score_snapshot import UNKNOWN_KEY, ScoreSnapshot
from loraplane.schemas.signing import KeyFileError, SigningKey, verify_raw
from loraplane.schemas.worker_state import WorkerState
from loraplane.streams.planner import Plan, Planner, WorkerMemory
from loraplane.streams.planner_lease import Lease, LeaseHolder, group_id, slug
from loraplane.streams.schedules import Schedule, ScheduleFile, warmup_scores
from loraplane.streams.score_admission import Known, score_key_of, stale_keys
from loraplane.streams.scores import ScoreState, from_snapshot

__all__ = [
    "CLIENT_ID",
    "COMPONENT",
    "FIRST_READ_S",
    "LOG_EVERY_S",
    "MAX_CHANGED",
    "MEMORY_READ_S",
    "PREVIEW_TOPICS",
    "RETRY_S",
    "WAKE_POLL_S",
    "LeaseLost",
    "LeaseMetrics",
    "MemoryGate",
    "PlannerRuntime",
    "Preview",
    "ScoreView",
    "WorkerStates",
    "audit_of",
    "memory_of",
    "memory_refusal",
    "of_base",
    "plan_tick",
    "planned_workers",
    "preview",
    "preview_json",
    "waiting_audit",
]

log = logging.getLogger(__name__)
COMPONENT: Literal["planner"] = "planner"
CLIENT_ID = "loraplane-planner"
FIRST_READ_S = 120.0
"""How long the first complete read of every input may take before it is logged again."""
MEMORY_READ_S = 30.0
"""Taking the lease gives up (and tries again) if the memory is not read to its end by then."""
WAKE_POLL_S = 0.1
RETRY_S = 1.0
MAX_CHANGED = 20_000
"""Score keys changed between two ticks beyond which a tick compares every key instead."""
LOG_EVERY_S = 30.0
"""An error that would repeat every tick is logged once per kind this often, with a count."""


class LeaseLost(RuntimeError):
    """The lease moved while a tick was being written: the transaction is aborted."""


def _fenced(exc: BaseException) -> bool:
    """Whether a producer error says another producer took our transactional id."""
    from confluent_kafka import KafkaError

    fenced = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
    seen: BaseException | None = exc
    while seen is not None:
        args = getattr(seen, "args", ())
        err: Any = args[0] if args else None
        if err is not None and hasattr(err, "code") and err.code() in fenced:
            return True
        seen = seen.__cause__
    return False


def _noted(keys: set[str] | None, key: str) -> set[str] | None:
    """``keys`` with ``key`` added; None (unknown: every key is to be looked at, as cheap as
    holding them) past ``MAX_CHANGED`` keys, or when it was None."""
    if keys is None:
        return None
    keys.add(key)
    return keys if len(keys) <= MAX_CHANGED else None


@dataclass
class ScoreView:
    """The scores topic as the planner sees it: the last committed state of every adapter
    key. ``apply`` says whether a record is a burst (its key's ``armed`` went True ->
    False; a new key counts as armed before). Written by the tail thread, read by the
    planner under ``lock``. ``take`` also hands over the keys changed since the last
    ``take`` (``Planner.tick``'s ``changed``: a tick re-reads only those); over
    ``MAX_CHANGED`` of them, or before the first ``take``, they are unknown (None)."""

    states: dict[str, ScoreState] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    unreadable: int = 0
    changed: set[str] | None = None
    unchecked: set[str] | None = None
    """Keys written since ``retain`` last ran (None: every key is to be checked)."""
    checked_against: Known | None = field(default=None, repr=False)
    """The live versions ``retain`` last checked the keys against."""

    def apply(self, key: str | bytes | None, value: bytes | None) -> bool:
        """One record under ``key`` (as read off the topic, or its text); one whose key is
        not UTF-8 text is refused and counted as ``unreadable`` (``score_key_of``)."""
        if not isinstance(key, str):
            text = score_key_of(key)
            if text is None:
                with self.lock:
                    self.unreadable += 1
                log.warning("scores record keyed %r skipped: not UTF-8 text", (key or b"")[:64])
                return False
            key = text
        if key.startswith(UNKNOWN_KEY):
            return False  # the unknown buckets hold counts, not adapters
        if value is None:
            with self.lock:
                self.states.pop(key, None)
                self._note(key)
            return False
        try:
            state = from_snapshot(decode(ScoreSnapshot, value))
        except SchemaError as exc:
            self.unreadable += 1
            log.error("scores record %s unreadable, skipped: %s", key[:200], exc)
            return False
        with self.lock:
            before = self.states.get(key)
            self.states[key] = state
            self._note(key)
            self.unchecked = _noted(self.unchecked, key)
        return (before is None or before.burst_armed) and not state.burst_armed

    def _note(self, key: str) -> None:
        self.changed = _noted(self.changed, key)

    def retain(self, known: Known) -> int:
        """Forget the keys ``known`` (the live versions of the planner's verified registry)
        does not back, as the keeper tombstones them: anyone may write the scores topic, and
        a key of no live version is planned by no tick. A registry with no live version (not
        verified yet: a keyring unreadable at start) forgets nothing. Returns how many were
        forgotten.

        Why it checks only the keys written since its last run while ``known`` is the same
        object (the runtime keeps one per registry version): a pass over every key costs
        ~0.5 us a key, 50 ms a tick at 100k adapters, more than the tick itself."""
        if not known.versions:
            return 0
        with self.lock:
            if known is self.checked_against and self.unchecked is not None:
                keys: Iterable[str] = [k for k in self.unchecked if k in self.states]
            else:
                keys = self.states
            stale = stale_keys(known, keys)
            for key in stale:
                del self.states[key]
                self._note(key)
            self.unchecked, self.checked_against = set(), known
        return len(stale)

    def copy(self) -> dict[str, ScoreState]:
        with self.lock:
            return dict(self.states)

    def quiet(self) -> bool:
        """No key changed since the last ``take`` (and the changes are known)."""
        with self.lock:
            return self.changed is not None and not self.changed

    def take(self) -> tuple[dict[str, ScoreState], set[str] | None]:
        """A copy of the states and the keys changed since the last ``take`` (None:
        unknown), counting afresh from now."""
        with self.lock:
            changed, self.changed = self.changed, set()
            return dict(self.states), changed

    def forget_changes(self) -> None:
        """The next ``take`` says the changes are unknown (a tick that failed did not read
        the ones it took)."""
        with self.lock:
            self.changed = None


@dataclass
class WorkerStates:
    """The newest state per worker from the worker-state topic (a tombstone removes it). A
    state object is replaced only by a newer record: the planner caches per state object."""

    states: dict[str, WorkerState] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    unreadable: int = 0

    def apply(
        self,
        key: bytes | None,
        value: bytes | None,
        arrived: float | None = None,
        placed: Placed | None = None,
    ) -> None:
        """Take one record, which arrived at epoch seconds ``arrived`` (None: now), read at
        ``placed`` (its partition and the topic's count; None: not checked): one off its
        key's partition, a tombstone too, is skipped and counted (``worker_states.at_home``).
        A state counts from ``beat_of`` its stamp and its arrival, as at the router: one
        stamped in the future is held as of its arrival, so it neither outranks the worker's
        next genuine state nor counts as heard lately forever."""
        wid = (key or b"").decode("utf-8", "replace")
        try:
            if value is None:
                at_home(key, placed)
                with self.lock:
                    self.states.pop(wid, None)
                return
            state = worker_state_of(key, value, placed)
        except SchemaError as exc:
            self.unreadable += 1
            log.warning("worker state %s skipped: %s", wid[:64], str(exc)[:200])
            return
        at = time.time() if arrived is None else arrived
        if state.ts.timestamp() > at:
            state = state.model_copy(
                update={"ts": datetime.fromtimestamp(beat_of(state.ts.timestamp(), at), UTC)}
            )
        with self.lock:
            stored = self.states.get(wid)
            if stored is None or stored.ts <= state.ts:
                self.states[wid] = state

    def copy(self) -> list[WorkerState]:
        with self.lock:
            return list(self.states.values())

    def forget_silent(self, now: float, heartbeat_s: float) -> int:
        """Forget the workers not heard lately at epoch seconds ``now`` (no tick plans them:
        ``plan_tick``'s rule), so the states held are the workers beating now, not every
        worker id ever written to the compacted topic. Returns how many were forgotten."""
        with self.lock:
            silent = [w for w, s in self.states.items() if not heard_lately(s, now, heartbeat_s)]
            for wid in silent:
                del self.states[wid]
        return len(silent)

    def command_partition(self, worker_id: str) -> int | None:
        """The commands partition ``worker_id`` announced in its newest state, if any."""
        with self.lock:
            state = self.states.get(worker_id)
        return state.command_partition if state is not None else None


class _MemoryPeek(msgspec.Struct):
    """The two fields of a planner-memory record read before its signature is checked."""

    worker_id: str | None = None
    key_id: str = ""


_PEEK = msgspec.json.Decoder(_MemoryPeek)
_SIGNATURE_FIELD = b',"signature":"'


def _signed_parts(value: bytes) -> tuple[bytes, str] | None:
    """The body a record's signature is of, and the signature, read off the raw JSON the
    planner writes (``encode``: the fields in declared order, ``signature`` last): the JSON
    without its ``signature`` field, byte for byte (``PlannerMemory.signed_bytes``), so a
    record verifies only as it was signed: a key added or changed anywhere (a second
    ``epoch``, which the decoder would read last) does not. None when it is not that
    shape. A string value cannot hold ``,"signature":"`` (its quotes are escaped)."""
    at = value.rfind(_SIGNATURE_FIELD)
    if at < 0 or not value.endswith(b'"}'):
        return None
    try:
        signature = value[at + len(_SIGNATURE_FIELD) : -2].decode("ascii")
    except UnicodeDecodeError:
        return None
    return value[:at] + b"}", signature


def memory_refusal(record: Record, keyring: Keyring | None) -> str | None:
    """Why ``record`` is no planner-memory record a ``planner`` key of ``keyring`` signed for
    the worker its Kafka key names (None: it is), checked on its raw bytes before any
    decoding: two fields peeked, then one Ed25519 verification (``verify_raw``). A
    retired key's records stay valid (an idle worker's record is not rewritten when the key
    rotates); a revoked key's do not."""
    wid = (record.key or b"").decode("utf-8", "replace")
    if record.value is None:
        return "a tombstone"
    try:
        peek = _PEEK.decode(record.value)
    except (msgspec.DecodeError, RecursionError):
        return "unreadable"
    if peek.worker_id != wid:
        return "the memory of another worker"
    if keyring is None:
        return "keyring unavailable"
    entry = keyring.get(peek.key_id)
    if entry is None or entry.role is not KeyRole.planner or entry.revoked:
        return "no planner key of the keyring signed it"
    parts = _signed_parts(record.value)
    if parts is None:
        return "not a signed record"
    body, signature = parts
    domain = PLANNER_MEMORY_SIGNING_DOMAIN.encode("ascii") + b"\n"
    if not verify_raw(domain + body, signature, entry.public_key):
        return f"signature does not verify with key {entry.key_id}"
    return None


def memory_of(
    records: Iterable[Record],
    keyring: Keyring | None,
    *,
    newest: Mapping[str, WorkerMemory] | None = None,
    refuse: Callable[[Record], None] | None = None,
) -> dict[str, WorkerMemory]:
    """The memory per worker in the planner-memory topic's last records. A record is read
    only when a ``planner`` key of ``keyring`` that is not revoked signed it for the worker
    its Kafka key names (``memory_refusal``, before it is decoded): the next active planner
    re-signs its pending commands, so an unsigned record would make it sign anyone's
    commands. One older (epoch, then seq) than ``newest``'s memory of its worker (what this
    process read or wrote before) is a replay. A record refused for any of these, or for a
    pending command for another worker, is handed to ``refuse`` (its tail holds it within
    bounds) and counted in one summary line (the worker is planned as if it had none, and
    that tick's memory replaces the record)."""
    out: dict[str, WorkerMemory] = {}
    refused: Counter[str] = Counter()
    example = ""
    for record in records:
        wid = (record.key or b"").decode("utf-8", "replace")
        why = memory_refusal(record, keyring)
        if why is None:
            try:
                memory = decode(PlannerMemory, record.value or b"")
            except SchemaError as exc:
                why = f"unreadable: {str(exc)[:200]}"
        if why is None:
            other = next((c.worker_id for c in memory.pending if c.worker_id != wid), None)
            before = None if newest is None else newest.get(wid)
            if other is not None:
                why = "it holds a pending command for another worker"
            elif before is not None and (memory.epoch, memory.seq) < (before.epoch, before.seq):
                why = "older than the memory read before (a replay)"
        if why is None:
            out[wid] = WorkerMemory.of(memory)
            continue
        if record.value is not None:  # a tombstone is only the absence of a memory
            refused[why.split(":")[0]] += 1
            example = example or f"{wid[:64]!r}: {why}"
        if refuse is not None:
            refuse(record)
    if refused:
        log.error(
            "planner-memory: %d records skipped (%s); e.g. %s",
            refused.total(),
            ", ".join(f"{why}: {n}" for why, n in refused.most_common()),
            example,
        )
    return out


class MemoryGate:
    """The planner-memory tail's ``on_record``: each record as it arrives is checked
    (``memory_refusal``, no decoding) and one refused is handed back to the tail
    (``TopicTail.refuse``: held within its bounds), logged as a rate-limited count. A
    new keyring re-reads the tail from its start when it forgot any."""

    def __init__(self, keyring: KeyringFile, tail: Callable[[], TopicTail]) -> None:
        self._keyring_file = keyring
        self._tail = tail
        self._keyring: Keyring | None = None
        self._log = LogBurst("planner-memory record refused", LOG_EVERY_S, logger=log)
        self.refused = 0

    def keyring(self) -> Keyring | None:
        """The keyring now; a new one re-reads what the tail forgot. Unreadable, it refuses
        every record, said in the gate's rate-limited log (asked once a record: a line each
        flooded the log)."""
        try:
            keyring: Keyring | None = self._keyring_file.current()
        except KeyringError:
            self._log.note("keyring unreadable")
            keyring = None
        if keyring is not self._keyring:
            if self._keyring is not None:
                self._tail().rewind()
            self._keyring = keyring
        return keyring

    def __call__(self, record: Record) -> None:
        why = memory_refusal(record, self.keyring())
        if why is None:
            return
        self._tail().refuse(record)
        if record.value is not None:
            self.refused += 1
            self._log.note(why.split(" with key")[0])


def _keyring_or_none(keyring: KeyringFile) -> Keyring | None:
    """The keyring as its file says now; None (every signed record refused) when it cannot
    be read."""
    try:
        return keyring.current()
    except KeyringError as exc:
        log.error("keyring unreadable: %s", exc)
        return None


def audit_of(cmd: CacheCommand) -> AuditRecord:
    return AuditRecord(
        event_id=cmd.command_id,
        ts=cmd.issued_at,
        component=COMPONENT,
        action=cmd.action.value,
        decision="issued",
        reason=cmd.reason.rule,
        subject_event_id=cmd.command_id,
        tenant_id=cmd.tenant_id,
        adapter_id=cmd.adapter_id,
        version=cmd.version,
        actor=cmd.worker_id,
        detail=json.dumps(
            {
                "worker_id": cmd.worker_id,
                "lora_name": cmd.lora_name,
                "score": cmd.reason.score,
                "detail": cmd.reason.detail,
            }
        ),
    )


def waiting_audit(result: Plan, last: list[str]) -> AuditRecord | None:
    """One decision when the set of versions waiting for a load changes (not every tick)."""
    names = [w.lora_name for w in result.waiting]
    if not names or names == last:
        return None
    detail = json.dumps(
        [
            {"lora_name": w.lora_name, "score": round(w.score, 6), "reason": w.reason}
            for w in result.waiting[:50]
        ]
    )
    return AuditRecord(
        event_id=f"wait-{int(time.time() * 1000)}",
        ts=now_utc(),
        component=COMPONENT,
        action="load_gpu",
        decision="refused",
        reason=result.waiting[0].reason,
        detail=detail[:2048],
    )


def of_base(
    base_model: str | None, views: Iterable[AdapterView], workers: Iterable[WorkerState]
) -> tuple[list[AdapterView], list[WorkerState]]:
    """The views with a version of ``base_model`` and its workers (everything for None)."""
    if base_model is None:
        return list(views), list(workers)
    return (
        [v for v in views if any(r.base_model == base_model for r in v.versions)],
        [w for w in workers if w.base_model == base_model],
    )


def planned_workers(
    settings: Settings, workers: Iterable[WorkerState], now: float
) -> list[WorkerState]:
    """The workers a tick plans with: those heard lately (the router's rule, as ``fleet
    status`` counts them live). One whose state says ``not_run`` is among them: the planner
    gives it nothing (``WorkerState.serves``), as the router routes it nothing."""
    heartbeat_s = settings.policy.worker_heartbeat_s
    return [w for w in workers if heard_lately(w, now, heartbeat_s)]


def plan_tick(
    planner: Planner,
    settings: Settings,
    base_model: str | None,
    views: Iterable[AdapterView],
    scores: Mapping[str, ScoreState],
    workers: Iterable[WorkerState],
    memory: Mapping[str, WorkerMemory],
    schedule: Schedule,
    now: float,
    changed: Iterable[str] | None = None,
    epoch: int = 0,
) -> Plan:
    """One tick on what the tails hold: the one place that narrows the inputs to
    ``base_model``, adds the scheduled warm-ups and keeps only the workers heard lately (the
    router's rule), shared by the runtime and ``loraplane plan show`` so that the preview
    plans exactly what the active planner would. ``changed``: the score keys changed since
    ``planner``'s last tick (``ScoreView.take``); ``epoch``: the planner session's."""
    chosen, states = of_base(base_model, views, workers)
    scheduled = warmup_scores(schedule, ((v.adapter_id, v.tenant_id) for v in chosen), now)
    live = planned_workers(settings, states, now)
    return planner.tick(
        chosen, scores, live, settings.policy, now, memory, scheduled, changed, epoch
    )


PREVIEW_TOPICS = ("registry", "scores", "worker-state", "planner-memory")


class _Unsent:
    """The preview's ``EventSink``: a refused registry view is counted (``Preview``), never
    dead-lettered; ``plan show`` writes nothing anywhere."""

    def emit(self, topic_suffix: str, key: str, message: BaseModel) -> None:
        pass


@dataclass(frozen=True)
class Preview:
    """What ``loraplane plan show`` prints: one tick's plan and the inputs it saw."""

    plan: Plan
    adapters: int  # verified views planned (of the base model, when one is named)
    score_keys: int
    workers: int  # worker states of the base model
    live_workers: int  # those heard lately (``planned_workers``): the only ones planned for
    serving_workers: int  # the live ones whose gateway serves (``WorkerState.serves``)
    memory_workers: int
    pending: int  # commands the active planner still waits on (planner-memory)
    refused: list[ViewReason]  # registry views refused by the keyring, with their reason


def preview(
    settings: Settings, base_model: str | None, *, timeout_s: float = 10.0, now: float | None = None
) -> Preview:
    """One tick on one read of every input the runtime tails, written nowhere (no command,
    memory, audit or dead letter): what the active planner would issue now and why. The
    records go through the runtime's own readers (``ScoreView``, ``WorkerStates``,
    ``memory_of``, ``VerifiedRegistry`` with the keyring) and ``plan_tick``. Every topic
    is read to its end or ``TopicReadIncomplete`` is raised: a broker away never reads as an
    empty fleet. The active planner's view checkpoints are not consulted (a rolled-back view
    it would refuse is planned here)."""
    topics = {topic_name(settings, t): t for t in PREVIEW_TOPICS}
    counts: dict[str, int] = {}
    workers = WorkerStates()
    # a ghost off its key's partition is neither a worker's last state nor its tombstone
    home = AtHome(counts, only=[topic_name(settings, "worker-state")])
    read = read_topic(
        settings,
        list(topics),
        timeout_s=timeout_s,
        to_end=True,
        quiet=True,
        partition_counts=counts,
    )
    # a score key's home is its adapter's requests partition, not its own hash
    unhashed = [topic_name(settings, "scores")]
    by_topic: dict[str, list[Record]] = {t: [] for t in PREVIEW_TOPICS}
    for (topic, _key), record in latest_per_key(home(read), counts, unhashed).items():
        by_topic[topics[topic]].append(record)
    workers.unreadable += home.misplaced
    scores = ScoreView()
    for record in by_topic["scores"]:
        scores.apply(record.key, record.value)
    for record in by_topic["worker-state"]:
        workers.apply(record.key, record.value)
    keyring = KeyringFile(settings.keyring_path)
    memory = memory_of(by_topic["planner-memory"], _keyring_or_none(keyring))
    refused: list[ViewReason] = []
    registry = VerifiedRegistry(
        keyring,
        lambda: by_topic["registry"],
        sink=_Unsent(),
        component=f"{COMPONENT}-preview",
        on_refused=refused.append,
    )
    registry.refresh()  # no readable keyring: every view refused (counted), as the runtime
    views, states = of_base(base_model, registry.accepted.values(), workers.copy())
    at = time.time() if now is None else now
    result = plan_tick(
        Planner(),
        settings,
        base_model,
        views,
        scores.copy(),
        states,
        memory,
        ScheduleFile(settings.schedules_path).current(),
        at,
    )
    live = planned_workers(settings, states, at)
    return Preview(
        result,
        len(views),
        len(scores.states),
        len(states),
        len(live),
        sum(w.serves for w in live),
        len(memory),
        sum(len(m.pending) for m in memory.values()),
        refused,
    )


def preview_json(p: Preview) -> dict[str, Any]:
    """``plan show --json``: the inputs counted, each command with its rule, score and
    detail, each waiting version with its reason."""
    return {
        "inputs": {
            "adapters": p.adapters,
            "score_keys": p.score_keys,
            "workers": p.workers,
            "live_workers": p.live_workers,
            "serving_workers": p.serving_workers,
            "memory_workers": p.memory_workers,
            "pending_commands": p.pending,
            "refused_views": [r.value for r in p.refused],
        },
        "commands": [
            {
                "worker_id": c.worker_id,
                "base_model": c.base_model,
                "action": c.action.value,
                "lora_name": c.lora_name,
                "adapter_id": c.adapter_id,
                "version": c.version,
                "tenant_id": c.tenant_id,
                "rule": c.reason.rule.value,
                "score": c.reason.score,
                "detail": c.reason.detail,
                "command_id": c.command_id,
            }
            for c in p.plan.commands
        ],
        "waiting": [
            {"lora_name": w.lora_name, "score": w.score, "reason": w.reason.value}
            for w in p.plan.waiting
        ],
    }


class LeaseMetrics(Collector):
    """``loraplane_planner_active``: 1 while this process holds the lease and plans (fenced the
    previous active, read its memory, resent its pending commands), else 0."""

    def __init__(self, runtime: PlannerRuntime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            m.PLANNER_ACTIVE,
            "1 while this planner holds the lease of its base model and plans, 0 on standby",
            labels=["base_model"],
        )
        gauge.add_metric([slug(self.runtime.base_model)], 1.0 if self.runtime.planning() else 0.0)
        yield gauge


class PlannerRuntime:
    """The planning thread (``run``) and the tails and lease it owns."""

    def __init__(self, settings: Settings, base_model: str | None = None) -> None:
        self.settings = settings
        self.base_model = base_model
        self.lease = Lease()
        self.scores = ScoreView()
        self.workers = WorkerStates()
        self.wake = threading.Event()
        self.progress = Progress(COMPONENT)
        self.schedule = ScheduleFile(settings.schedules_path)
        self.memory: dict[str, WorkerMemory] = {}
        self.planner = Planner()
        """The process's one planner: primed while standby, planning while active."""
        self._known: tuple[int, Known] | None = None
        """The live versions of the verified registry, and its ``changes`` they are of."""
        self._primed_at = -1  # the registry tail's version the planner was primed at
        self._prime_due = 0.0  # monotonic time before which the standby does not prime it
        self._caught_up = False
        self._partitions: PartitionCount | None = None
        """The commands topic's partition count, from the active session's metadata client."""
        self._planning_epoch: int | None = None
        self._session_epoch = 0
        """The planner session's epoch (``memory.epoch``), past every one read: milliseconds
        at the takeover, or one more than the newest read. It is in every command id, so a
        counter set back by a replayed record still gives ids the workers never saw."""
        self._errors = LogBurst("planner", LOG_EVERY_S, logger=log)

    def metrics(self) -> Collector:
        return LeaseMetrics(self)

    def planning(self) -> bool:
        """Active: the lease is held and its session is past the takeover steps."""
        epoch = self._planning_epoch
        return epoch is not None and self.lease.holds(epoch)

    # ---- tails ----------------------------------------------------------------------------
    def _score_record(self, record: Record) -> None:
        if self.scores.apply(record.key, record.value) and self._caught_up:
            log.info("burst for %s", (record.key or b"").decode("utf-8", "replace"))
            self.wake.set()

    def _state_record(self, record: Record) -> None:
        """One worker-state record from the tail; a tombstone a worker left on its previous
        partition after a grow (``bus.moved_away``) removes nothing and is no fault."""
        if not moved_away(record):
            self.workers.apply(record.key, record.value, placed=self.state_tail.placed(record))

    def _start_tails(self) -> list[TopicTail]:
        s = self.settings
        self.score_tail = TopicTail(
            s,
            topic_name(s, "scores"),
            component=f"{COMPONENT}-scores",
            on_record=self._score_record,
            keep=False,  # ScoreView holds what is planned
        ).start()
        self.state_tail = TopicTail(
            s,
            topic_name(s, "worker-state"),
            component=f"{COMPONENT}-worker-state",
            on_record=self._state_record,
            keep=False,  # WorkerStates holds what is planned
        )
        self.state_tail.start()
        self.keyring = KeyringFile(s.keyring_path)
        # its own file reader: the gate runs on the memory tail's thread, and a KeyringFile
        # reloads without a lock (a second caller mid-reload reads no keyring)
        self.memory_gate = MemoryGate(KeyringFile(s.keyring_path), lambda: self.memory_tail)
        self.memory_tail = TopicTail(
            s,
            topic_name(s, "planner-memory"),
            component=f"{COMPONENT}-memory",
            on_record=self.memory_gate,  # what no planner key signed is held within bounds
        ).start()
        scope = RegistryScope(None if self.base_model is None else [self.base_model])
        self.registry_tail = registry_tail(s, COMPONENT, scope, start=False)
        tail = self.registry_tail
        self.registry = VerifiedRegistry(
            self.keyring,
            tail.snapshot,
            sink=ProducerSink(s, CLIENT_ID),
            component=COMPONENT,
            checkpoints_path=s.home / "planner" / slug(self.base_model) / CHECKPOINTS_FILE,
            version=lambda: tail.version,
            scope=scope,
            source=tail,
        )
        tail.start()
        return [self.score_tail, self.state_tail, self.memory_tail, self.registry_tail]

    # ---- the thread -----------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Tails, then the lease, then plan whenever the lease is held, until ``stop``."""
        (self.settings.home / "planner" / slug(self.base_model)).mkdir(parents=True, exist_ok=True)
        tails = self._start_tails()
        watchdog = Watchdog([self.progress]).start()
        holder: LeaseHolder | None = None
        try:
            for tail in tails:
                self.progress.blocked(f"reading {tail.topics[0]} to its end")
                while not tail.wait_caught_up(1.0):
                    if stop.is_set():
                        return
            self._caught_up = True
            key = self._planner_key(stop)
            if key is None:
                return
            self._prime()
            # What the first read loaded lives as long as the process: out of the
            # collector's way, or a full collection over it adds up to a second to a tick.
            collector.freeze_survivors()
            self.progress.advanced()
            log.info(
                "planner ready (%s): %d score keys, %d workers; joining %s",
                slug(self.base_model),
                len(self.scores.states),
                len(self.workers.states),
                group_id(self.settings, self.base_model),
            )
            holder = LeaseHolder(self.settings, self.base_model, self.lease).start()
            while not stop.is_set():
                epoch = self.lease.epoch
                if not self.lease.holds(epoch):
                    self.progress.advanced()  # a standby waits; it is not held up
                    self._prime()  # verified and derived ahead: a quick takeover
                    self.lease.wait_change(epoch, 0.5)
                    continue
                try:
                    self._session(epoch, key, stop)
                except LeaseLost:
                    log.info("planner: lease moved; the open tick was not committed")
                except Exception as exc:  # ProducerBroken, KafkaException, ...
                    if _fenced(exc):
                        self.lease.fenced(epoch)
                    else:
                        self.progress.blocked(f"planner session ended: {exc}")
                        log.error("planner session ended (%s); again in %.0f s", exc, RETRY_S)
                        stop.wait(RETRY_S)
        finally:
            if holder is not None:
                holder.stop()
            watchdog.stop()
            for tail in tails:
                tail.stop()

    def _planner_key(self, stop: threading.Event) -> SigningKey | None:
        """The planner's signing key; waits (logging why) until the key file can be read:
        an unsigned command would be refused by every worker."""
        while not stop.is_set():
            try:
                return SigningKey.load(self.settings.planner_key_path)
            except KeyFileError as exc:
                log.error("planner key unavailable, no commands until it is: %s", exc)
                stop.wait(5.0)
        return None

    def _session(self, epoch: int, key: SigningKey, stop: threading.Event) -> None:
        """One lease epoch: fence, read the memory to its end, resend, plan."""
        s = self.settings
        txn = kafka.transactional_producer(s, group_id(s, self.base_model), client_id=CLIENT_ID)
        meta = kafka.consumer(
            s, f"{group_id(s, self.base_model)}-meta", client_id=CLIENT_ID, quiet=True
        )
        try:
            self.progress.blocked("init_transactions")
            bounded(
                "init_transactions", lambda: txn.init_transactions(STEP_TIMEOUT_S), STEP_TIMEOUT_S
            )
            self._read_memory()
            self._guard(epoch)
            self._partitions = commands_partitions(topic_name(s, "commands"), meta)
            self._partitions.current()  # known before the first send (raises if not)
            self._resend(txn, key, epoch)
            self._planning_epoch = epoch
            planner = self.planner
            waiting: list[str] = []
            last_registry = -1
            due = 0.0
            interval = s.policy.planner_interval_s
            while not stop.is_set():
                self._guard(epoch)
                version = self.registry_tail.version
                if version == last_registry and time.monotonic() < due and not self.wake.is_set():
                    self.wake.wait(WAKE_POLL_S)
                    continue
                self.wake.clear()
                last_registry = version
                due = time.monotonic() + interval
                try:
                    result = self.plan_now(planner)
                except Exception:  # a bad record must not stop planning for everyone else
                    self._errors.note(
                        "planning tick failed; retrying at the next tick", exc_info=True
                    )
                    continue
                waiting = self._commit(txn, meta, key, epoch, result, waiting)
                self.progress.advanced()
        finally:
            self._planning_epoch = None
            meta.close()
            txn.flush(1.0)

    def _guard(self, epoch: int) -> None:
        if not self.lease.holds(epoch):
            raise LeaseLost("the lease moved")

    def _read_memory(self) -> None:
        """Wait until the memory tail holds everything committed before the fence."""
        self.progress.blocked("reading planner-memory to its end")
        keyring = self.memory_gate.keyring()  # a new one re-reads what the tail forgot
        ends = self.memory_tail.ends(10.0)  # taken after init_transactions fenced the last one
        if not self.memory_tail.wait_read_to(ends, MEMORY_READ_S):
            raise RuntimeError(f"planner-memory not read to its end within {MEMORY_READ_S} s")
        self.memory = memory_of(
            self.memory_tail.snapshot(),
            keyring,
            newest=self.memory,  # what this process read or wrote before: no replay under it
            refuse=self.memory_tail.refuse,
        )
        seen = max((mem.epoch for mem in self.memory.values()), default=0)
        self._session_epoch = max(int(time.time() * 1000), seen + 1, self._session_epoch + 1)
        log.info(
            "planner: memory of %d workers read (%d pending commands); session epoch %d",
            len(self.memory),
            sum(len(m.pending) for m in self.memory.values()),
            self._session_epoch,
        )

    def _produce_command(
        self, txn: Any, cmd: CacheCommand, key: SigningKey, partitions: int
    ) -> bytes:
        payload = encode(key.sign_command(cmd))
        txn.produce(
            topic_name(self.settings, "commands"),
            key=cmd.worker_id.encode(),
            value=payload,
            partition=partition_for(
                cmd.worker_id, self.workers.command_partition(cmd.worker_id), partitions
            ),
        )
        return payload

    def _commands_partitions(self) -> int:
        assert self._partitions is not None, "set when the session took the lease"
        return self._partitions.current()

    def _resend(self, txn: Any, key: SigningKey, epoch: int) -> None:
        """The pending commands of the memory, under their own ids (the previous active may
        have died after they committed but before the workers applied them)."""
        now = now_utc()
        pending = [
            cmd for mem in self.memory.values() for cmd in mem.pending if cmd.deadline >= now
        ]
        if not pending:
            return
        partitions = self._commands_partitions()

        def fill() -> None:
            for cmd in pending:
                self._produce_command(txn, cmd, key, partitions)
            self._guard(epoch)

        transact(txn, fill, on_step=self.progress.blocked)
        log.info("planner resent %d pending commands under their own ids", len(pending))

    def _prime(self) -> None:
        """Verify the registry ahead and, at most once per ``planner_interval_s`` and only
        when the registry or the scores moved, bring the planner's columns up to what the
        tails hold without planning: the views it would plan on and the scores changed
        since it last read them. Its first tick then derives what changed since, not 100k
        versions' columns (~0.5 s). A failure leaves the changes unknown: the next read
        compares them all."""
        version = self.registry_tail.version
        if version:
            self.registry.records()  # verified ahead (only what changed): quick takeover
        now = time.monotonic()
        if now < self._prime_due or (version == self._primed_at and self.scores.quiet()):
            return
        self._prime_due = now + self.settings.policy.planner_interval_s
        try:
            self._forget_unplanned()
            scores, changed = self.scores.take()
            views, _ = of_base(self.base_model, self.registry.accepted.values(), ())
            self.planner.prime(views, scores, changed)
            self._primed_at = version
        except Exception:  # a bad record must not stop the standby
            self.scores.forget_changes()
            self._errors.note("priming the planner failed; its first tick reads all", exc_info=True)

    def _forget_unplanned(self) -> None:
        """Forget the workers not heard lately and the score keys of no live version of the
        verified registry (rebuilt when its accepted views change, not on every record its
        tail reads: any topic writer moves that): what no tick plans is not held."""
        self.workers.forget_silent(time.time(), self.settings.policy.worker_heartbeat_s)
        version = self.registry.changes
        if self._known is None or self._known[0] != version:
            views, _ = of_base(self.base_model, self.registry.accepted.values(), ())
            self._known = (version, Known.from_records(r for v in views for r in v.versions))
        self.scores.retain(self._known[1])

    def plan_now(self, planner: Planner) -> Plan:
        """One tick of ``planner`` on what the tails hold now. The score keys changed since
        its last tick go with it; a tick that fails leaves them unknown for the next."""
        if self.registry_tail.version:
            self.registry.records()  # refresh; a failed read keeps the last verified views
        self._forget_unplanned()
        scores, changed = self.scores.take()
        try:
            return plan_tick(
                planner,
                self.settings,
                self.base_model,
                self.registry.accepted.values(),
                scores,
                self.workers.copy(),
                self.memory,
                self.schedule.current(),
                time.time(),
                changed,
                self._session_epoch,
            )
        except BaseException:
            self.scores.forget_changes()
            raise

    def _commit(
        self, txn: Any, meta: Any, key: SigningKey, epoch: int, result: Plan, waiting: list[str]
    ) -> list[str]:
        """The tick's commands, decisions, audit and changed memory in one transaction; the
        in-process memory follows only once it committed."""
        changed = {wid: mem for wid, mem in result.memory.items() if mem != self.memory.get(wid)}
        wait_record = waiting_audit(result, waiting)
        names = [w.lora_name for w in result.waiting]
        if not result.commands and not changed and wait_record is None:
            return names
        s = self.settings
        partitions = self._commands_partitions()
        audit, decisions = topic_name(s, "audit"), topic_name(s, "decisions")
        memory_topic = topic_name(s, "planner-memory")

        def fill() -> None:
            for cmd in result.commands:
                payload = self._produce_command(txn, cmd, key, partitions)
                txn.produce(audit, key=cmd.adapter_id.encode(), value=encode(audit_of(cmd)))
                # The decisions topic carries the commands themselves (ClickHouse).
                txn.produce(decisions, key=cmd.base_model.encode(), value=payload)
            for wid, mem in changed.items():
                record = key.sign_memory(wid, mem.record())
                txn.produce(memory_topic, key=wid.encode(), value=encode(record))
            if wait_record is not None:
                txn.produce(audit, key=b"planner", value=encode(wait_record))
            self._guard(epoch)

        transact(txn, fill, on_step=self.progress.blocked)
        self.memory.update(changed)
        if result.commands:
            log.info(
                "planner issued %d commands: %s",
                len(result.commands),
                ", ".join(
                    f"{c.action.value} {c.lora_name} -> {c.worker_id}" for c in result.commands[:20]
                ),
            )
        return names
