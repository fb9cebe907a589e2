"""The planner agent: runs the pure planner (one ``streams.planner.Planner`` for the life of
the worker, which keeps its columns between ticks) and says what it decided on Kafka.

Inputs, all in this Faust worker: the registry table (streams.registry_agent), the score
states (``score_store``: the ``scores`` topic, written by every scoring keeper, tailed into
the planner's own store and read to its end before the first tick), the ``worker-states``
table (latest WorkerState per worker, from the compacted worker-state topic) and the
schedule file (re-read when it changes).

One loop plans every ``policy.planner_interval_s`` seconds (the timer) and at once on a
significant event: a burst (scoring agent) or a registry change (the registry topic). A tick
writes the planner's memory (``schemas.planner_memory.PlannerMemory``) to the
``planner-memory`` table and flushes it *before* sending any command, then sends each
command to the commands topic (key worker_id) and to the decisions topic, and its audit
record to the audit topic. So after a crash the memory knows every command that may have
gone out: nothing is re-decided under a new command_id, and on start the pending ones are
sent again under their own ids (workers drop duplicates by command_id). A memory record
that does not decode is skipped with its reason: the worker is planned as if it had none,
and that tick's memory replaces the record.

Every command is signed at send time (``_send``: ``SigningKey.sign_command`` with the key file
``settings.planner_key_path``, role ``planner`` in the keyring the workers verify with), not
while planning: the planner's memory keeps commands unsigned and the resend after a restart
signs them again. Planning waits for the key file too: an unsigned command would be refused
by every worker.

A worker whose last state is older than three ``policy.worker_heartbeat_s`` intervals
(``workers.routing.heard_lately``: the router drains it by the same rule) is left out of the
plan: its copies count for nothing, so the hot versions it held are loaded elsewhere.

Planning waits for table recovery and the score states: a planner that ran on an empty
memory would re-issue, one on empty scores would demote everything.
The wall clock is the planner's ``now``; tests control time through the timestamps of the
request logs and worker states they produce, and choose schedule cron times near now.
Assumes one streams worker holds all partitions (the planner needs the whole fleet).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import faust
from loraplane.schemas.audit import AuditRecord
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.planner_memory import PlannerMemory
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.score_snapshot import ScoreSnapshot, is_unknown_key
from loraplane.schemas.signing import KeyFileError, SigningKey
from loraplane.schemas.worker_state import WorkerState
from loraplane.streams import scoring_agent  # noqa: F401  (a keeper runs beside the planner)
from loraplane.streams.app import app, dead_letter_of, raw_topic
from loraplane.streams.lifecycle import AdapterState
from loraplane.streams.planner import Plan, Planner, WorkerMemory
from loraplane.streams.registry_agent import registry_table
from loraplane.streams.schedules import ScheduleFile, warmup_scores
from loraplane.streams.score_store import ScoreStore
from loraplane.streams.scores import from_snapshot
from loraplane.workers.routing import heard_lately

from loraplane.kernel.bus import Record
from loraplane.kernel.config import get_settings
from loraplane.kernel.progress import Progress
from loraplane.kernel.topic_tail import TopicTail
from loraplane.kernel.topics import spec, topic_name

log = logging.getLogger(__name__)
T = TypeVar("T")
COMPONENT: Literal["planner"] = "planner"
settings = get_settings()


score_store = ScoreStore()
"""The score states the planner plans on: a bridge until the planner runtime of #15 item 2
(``_follow_scores``: the scores topic tailed into this store; nothing shared with a keeper)."""


def _take_score(record: Record, loop: asyncio.AbstractEventLoop) -> None:
    """One scores record into ``score_store``; a key whose burst just fired (armed went
    off) sets ``burst``, so the planner re-plans now."""
    key = (record.key or b"").decode("utf-8", "replace")
    if is_unknown_key(key):
        return
    if record.value is None:
        score_store.remove([key])
        return
    try:
        state = from_snapshot(decode(ScoreSnapshot, record.value))
    except SchemaError as exc:
        log.error("scores %s@%s unreadable, skipped: %s", record.partition, record.offset, exc)
        return
    before = score_store.live().get(key)
    score_store.update({key: state})
    if (before is None or before.burst_armed) and not state.burst_armed:
        loop.call_soon_threadsafe(score_store.burst.set)


@app.task
async def _follow_scores() -> None:
    loop = asyncio.get_running_loop()
    tail = TopicTail(settings, topic_name(settings, "scores"), component="planner-scores",
                     on_record=lambda r: _take_score(r, loop)).start()
    while not await asyncio.to_thread(tail.wait_caught_up, 1.0):
        pass
    score_store.ready.set()


worker_state_topic = raw_topic("worker-state")
registry_topic = raw_topic("registry")
commands_topic = raw_topic("commands")
decisions_topic = raw_topic("decisions")
audit_topic = raw_topic("audit")
dead_letter_topic = raw_topic("dead-letters")

worker_states = app.Table("worker-states", partitions=spec("worker-state").partitions,
                          help="worker_id -> latest WorkerState (JSON)")
planner_memory = app.Table("planner-memory", partitions=3, use_partitioner=True,
                           value_type=bytes,  # raw: decoded by schemas.codec
                           help="worker_id -> schemas.planner_memory.PlannerMemory (JSON)")


schedule_file = ScheduleFile(settings.schedules_path)
progress = Progress(COMPONENT)
"""The planning loop's hold-ups (Kafka not taking commands): logged as STALLED planner."""
SEND_TIMEOUT_S = 30.0
"""A tick's sends give up after this long (and the loop goes on) instead of hanging."""
replan = asyncio.Event()
"""Set by significant events; the planning loop wakes up at once."""


@app.agent(worker_state_topic)
async def worker_state_agent(stream: faust.StreamT) -> None:
    async for event in stream.events():
        try:
            state = decode(WorkerState, event.value)
        except SchemaError as exc:
            await dead_letter_topic.send(key=event.key, value=encode(dead_letter_of(
                event.message, COMPONENT, exc.reason, str(exc))))
            continue
        stored = worker_states.get(state.worker_id)
        if stored is None or WorkerState.model_validate(stored).ts <= state.ts:
            worker_states[state.worker_id] = state.model_dump(mode="json")


@app.agent(registry_topic)
async def registry_changes(stream: faust.StreamT) -> None:
    """A lifecycle change (publish, canary, revoke, ...) is worth planning for now."""
    async for _ in stream:
        replan.set()


class _Views:
    """Registry views, re-validated only when an adapter's state changed (by last_seq)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, AdapterView]] = {}

    def current(self) -> list[AdapterView]:
        views = []
        for adapter_id, raw in registry_table.items():
            seq = raw.get("view", {}).get("last_seq")
            cached = self._cache.get(adapter_id)
            if cached is None or cached[0] != seq:
                view = AdapterState.model_validate(raw).view
                cached = self._cache[adapter_id] = (view.last_seq, view)
            views.append(cached[1])
        return views


class _Parsed(Generic[T]):
    """Table values parsed once per change, not once per tick (1000 worker states cost
    ~140 ms a tick to validate). A value is parsed again only when it is not the object
    parsed last time: Faust's memory store hands out the stored object until a write
    replaces it, and nothing here mutates a stored value. A value ``parse`` refuses
    (``SchemaError``) is left out, logged once with its reason."""

    def __init__(self, parse: Callable[[Any], T]) -> None:
        self._parse = parse
        self._cache: dict[str, tuple[Any, T | None]] = {}

    def of(self, items: Iterable[tuple[str, Any]]) -> dict[str, T]:
        fresh = {}
        for key, raw in items:
            hit = self._cache.get(key)
            fresh[key] = hit if hit is not None and hit[0] is raw else (raw, self._try(key, raw))
        self._cache = fresh
        return {key: parsed for key, (_, parsed) in fresh.items() if parsed is not None}

    def _try(self, key: str, raw: Any) -> T | None:
        try:
            return self._parse(raw)
        except SchemaError as exc:
            log.error("%s: unreadable value skipped: %s", key, exc)
            return None


def _memory_of(raw: bytes) -> WorkerMemory:
    return WorkerMemory.of(decode(PlannerMemory, raw))


def _audit(cmd: CacheCommand) -> AuditRecord:
    return AuditRecord(
        event_id=cmd.command_id, ts=cmd.issued_at, component=COMPONENT,
        action=cmd.action.value, decision="issued", reason=cmd.reason.rule,
        subject_event_id=cmd.command_id, tenant_id=cmd.tenant_id, adapter_id=cmd.adapter_id,
        version=cmd.version, actor=cmd.worker_id,
        detail=json.dumps({"worker_id": cmd.worker_id, "lora_name": cmd.lora_name,
                           "score": cmd.reason.score, "detail": cmd.reason.detail}))


async def _planner_key() -> SigningKey:
    """The planner's signing key; waits (logging why) until the key file can be read."""
    while True:
        try:
            return SigningKey.load(settings.planner_key_path)
        except KeyFileError as exc:
            log.error("planner key unavailable, no commands until it is: %s", exc)
            await asyncio.sleep(5.0)


async def _send(cmd: CacheCommand, key: SigningKey) -> None:
    cmd = key.sign_command(cmd)
    payload = encode(cmd)
    await commands_topic.send(key=cmd.worker_id.encode(), value=payload)
    await audit_topic.send(key=cmd.adapter_id.encode(), value=encode(_audit(cmd)))
    # The decisions topic carries the commands themselves (ClickHouse `decisions` table).
    await decisions_topic.send(key=cmd.base_model.encode(), value=payload)


async def _announce_waiting(result: Plan, last: list[str]) -> list[str]:
    """One decision when the set of versions waiting for a load changes (not every tick)."""
    names = [w.lora_name for w in result.waiting]
    if names and names != last:
        detail = json.dumps([{"lora_name": w.lora_name, "score": round(w.score, 6),
                              "reason": w.reason} for w in result.waiting[:50]])
        await audit_topic.send(key=b"planner", value=encode(AuditRecord(
            event_id=f"wait-{int(time.time() * 1000)}", ts=now_utc(), component=COMPONENT,
            action="load_gpu", decision="refused", reason=result.waiting[0].reason,
            detail=detail[:2048])))
    return names


@dataclass
class _Inputs:
    """What the planning loop keeps between ticks so that a tick parses only changes."""

    views: _Views = field(default_factory=_Views)
    workers: _Parsed[WorkerState] = field(
        default_factory=lambda: _Parsed(WorkerState.model_validate))
    memory: _Parsed[WorkerMemory] = field(default_factory=lambda: _Parsed(_memory_of))
    planner: Planner = field(default_factory=Planner)


def plan_now(inputs: _Inputs, scores: ScoreStore, memory: dict[str, WorkerMemory]) -> Plan:
    now = time.time()
    current = inputs.views.current()
    scheduled = warmup_scores(schedule_file.current(),
                              ((v.adapter_id, v.tenant_id) for v in current), now)
    heartbeat_s = settings.policy.worker_heartbeat_s
    workers = [w for w in inputs.workers.of(worker_states.items()).values()
               if heard_lately(w, now, heartbeat_s)]  # a silent worker's copies take no traffic
    return inputs.planner.tick(current, scores.states(), workers, settings.policy, now,
                               memory, scheduled)


@app.task
async def planner_loop() -> None:
    # faust's TableManagerT type omits `recovery`, which its TableManager has
    await app.tables.recovery.completed.wait()  # type: ignore[attr-defined]
    await score_store.ready.wait()
    key = await _planner_key()
    inputs = _Inputs()
    for mem in inputs.memory.of(list(planner_memory.items())).values():
        for cmd in mem.pending:  # resend what may not have gone out
            await commands_topic.send(key=cmd.worker_id.encode(),
                                      value=encode(key.sign_command(cmd)))
    # What recovery loaded (tables, 100k score states) lives as long as the worker: out of
    # the collector's way, or a full collection over it adds up to a second to a tick.
    gc.collect()
    gc.freeze()
    log.info("planner ready: %d workers in memory", len(planner_memory))
    waiting: list[str] = []
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_any_trigger(score_store),
                                   timeout=settings.policy.planner_interval_s)
        replan.clear()
        score_store.burst.clear()
        try:
            memory = inputs.memory.of(planner_memory.items())
            result = plan_now(inputs, score_store, memory)
        except Exception:  # a bad record must not stop planning for everyone else
            log.exception("planning tick failed; retrying at the next tick")
            continue
        for wid, mem in result.memory.items():
            if mem != memory.get(wid):
                planner_memory[wid] = encode(mem.record())
        try:
            await asyncio.wait_for(_issue(result, key), SEND_TIMEOUT_S)
            waiting = await asyncio.wait_for(_announce_waiting(result, waiting),
                                             SEND_TIMEOUT_S)
        except Exception as exc:  # Kafka away: planning goes on; the memory keeps them pending
            progress.blocked(f"commands not sent: {exc or type(exc).__name__}")
            progress.check()
            log.error("planner: %d commands not sent (%s); planning goes on",
                      len(result.commands), exc or type(exc).__name__)
            continue
        progress.advanced()


async def _issue(result: Plan, key: SigningKey) -> None:
    if not result.commands:
        return
    await app.producer.flush()  # memory is durable before any command leaves
    for cmd in result.commands:
        await _send(cmd, key)
    log.info("planner issued %d commands: %s", len(result.commands),
             ", ".join(f"{c.action.value} {c.lora_name} -> {c.worker_id}"
                       for c in result.commands[:20]))


async def _any_trigger(scores: ScoreStore) -> None:
    waits = [asyncio.ensure_future(replan.wait()), asyncio.ensure_future(scores.burst.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
