"""Planner and workers agree on the live system, across a worker restart: the demo's fleet
(``loraplane.demo.system``: the streams app with scoring and the planner, the ClickHouse sink,
two FAKE vLLMs of 4 slots with their ``loraplane worker run``, ``loraplane router run`` in
front; Kafka, ClickHouse, local S3), the demo's catalog (a platinum adapter, a canary: nine
versions for eight slots), 15 requests/s through the router with a power-law mix whose
ranking turns every ``SHIFT_S`` (other versions become hot: slot pressure), the canary
promoted at a quarter of the run and rolled back at three quarters (protection changes), and
worker w1's agent stopped halfway for ``DOWN_S`` (longer than the planner's three heartbeats,
so its copies are placed again elsewhere) and started again (vLLM kept its copies: the
restarted agent adopts them).

Recorded from the topics (commands, worker-state, dead-letters, cache-events):

- refused: dead letters ``protected_copy`` / ``pinned_copy`` (a worker refusing a planner
  command by a rule the planner knows): 0;
- repeated: a command issued again (same worker, action, copy) within the deadline of the last
  command on that copy, when no heartbeat between them showed it done (``shows``): 0;
- undone: a GPU load unloaded within ``min_residency_s`` by the planner (not a revoke, a
  version no longer serving or a ``demote_when`` condition) or by the worker for a load other
  than a request's own taking a request's copy: printed (with the raw counts) and asserted 0.

``LORAPLANE_AGREEMENT_S`` sets the seconds of traffic (default 120);
the measurement in docs/planner.md ran 1200 (``pytest -s`` prints the numbers).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

import pytest
import requests
from rich.console import Console

from loraplane.demo.catalog import DEMO_CATALOG, Artifacts
from loraplane.demo.flow import publish_catalog, registry_complete
from loraplane.demo.namespace import RunSpace
from loraplane.demo.steps import Steps
from loraplane.demo.supervisor import Supervisor
from loraplane.demo.system import ROOT, LiveSystem, SystemOptions, http_ok
from loraplane.kernel import kafka
from loraplane.kernel.command_effects import Copy, shows
from loraplane.kernel.config import Settings
from loraplane.kernel.policy import Policy
from loraplane.kernel.topics import topic_name
from loraplane.schemas.cache_event import CacheEvent
from loraplane.schemas.codec import SchemaError, decode
from loraplane.schemas.commands import CacheCommand, CommandAction
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.reasons import CommandRule
from loraplane.schemas.worker_state import WorkerState
from tests.integration.router_env import Answer, ask
from tests.integration.test_loadtest import drop_namespace

TRAFFIC_S = float(os.environ.get("LORAPLANE_AGREEMENT_S", "120"))
RATE, CONCURRENCY = 15.0, 8
SHIFT_S, DOWN_S = 40.0, 20.0
# ~3 minutes with its fleet: run by ``pytest -m fault_long`` beside the other long live
# runs, outside ./run test's 25-minute budget (the property test of the same rules,
# tests/unit/test_planner_worker_agree.py, runs in every suite)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(int(TRAFFIC_S) + 600),
    pytest.mark.fault_long,
]
OPTIONS = SystemOptions(fake_vllm=True)  # the demo's: 4 slots, heartbeat 2 s, tick 0.5 s
POLICY = Policy()  # what the children run with (no override)
REFUSED = {"protected_copy", "pinned_copy"}  # CommandRejection
UNDONE_BY = (CommandRule.revoke, CommandRule.not_serving, CommandRule.demote)


@dataclass
class Recorded:
    """Every record of the run's commands, worker states, dead letters and cache events."""

    commands: dict[str, CacheCommand] = field(default_factory=dict)  # by id (resends once)
    states: list[WorkerState] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    events: list[CacheEvent] = field(default_factory=list)


class Recorder:
    """Reads the four topics from their start until ``stop`` (a consumer thread)."""

    def __init__(self, settings: Settings) -> None:
        self.rec = Recorded()
        self.unreadable = 0
        self._stop = threading.Event()
        self._kinds = {
            topic_name(settings, "commands"): CacheCommand,
            topic_name(settings, "worker-state"): WorkerState,
            topic_name(settings, "dead-letters"): DeadLetter,
            topic_name(settings, "cache-events"): CacheEvent,
        }
        self._thread = threading.Thread(target=self._run, args=(settings,), daemon=True)
        self._thread.start()

    def _run(self, settings: Settings) -> None:
        consumer = kafka.consumer(settings, f"test-agree-{uuid.uuid4().hex[:8]}", quiet=True)
        try:
            consumer.subscribe(list(self._kinds))
            while not self._stop.is_set():
                for msg in consumer.consume(200, 0.2):
                    if msg.error() is not None or msg.value() is None:
                        continue
                    try:
                        item = decode(self._kinds[msg.topic() or ""], msg.value())
                    except SchemaError:
                        self.unreadable += 1
                        continue
                    match item:
                        case CacheCommand():
                            self.rec.commands.setdefault(item.command_id, item)
                        case WorkerState():
                            self.rec.states.append(item)
                        case DeadLetter():
                            self.rec.dead.append(item)
                        case CacheEvent():
                            self.rec.events.append(item)
        finally:
            consumer.close()

    def stop(self) -> Recorded:
        self._stop.set()
        self._thread.join(20)
        return self.rec


def repeated(rec: Recorded) -> tuple[list[tuple[CacheCommand, CacheCommand]], int]:
    """The repeats (see the module docstring), and the raw count of commands issued again
    within the deadline of an identical earlier one, whatever came between."""
    states: dict[str, list[WorkerState]] = {}
    for s in rec.states:
        states.setdefault(s.worker_id, []).append(s)
    last: dict[tuple[str, str], CacheCommand] = {}
    identical: dict[tuple[str, str, str], CacheCommand] = {}
    out, raw = [], 0
    for cmd in sorted(rec.commands.values(), key=lambda c: c.issued_at):
        key = (cmd.worker_id, cmd.lora_name)
        same = identical.get((*key, cmd.action.value))
        raw += same is not None and cmd.issued_at < same.deadline
        earlier = last.get(key)
        if (
            earlier is not None
            and earlier.action is cmd.action
            and cmd.issued_at < earlier.deadline
            and not any(
                earlier.issued_at <= s.ts <= cmd.issued_at
                and shows(
                    earlier.action,
                    next(
                        (
                            Copy(a.tier, a.pinned)
                            for a in s.adapters
                            if a.lora_name == cmd.lora_name
                        ),
                        Copy(),
                    ),
                )
                for s in states.get(cmd.worker_id, [])
            )
        ):
            out.append((earlier, cmd))
        last[key] = identical[(*key, cmd.action.value)] = cmd
    return out, raw


def undone(
    rec: Recorded, never_evict: set[str], restarted: dict[str, datetime]
) -> list[tuple[CacheEvent, CacheEvent]]:
    """GPU loads unloaded within ``min_residency_s`` that no rule allowed (module docstring):
    a never-evict version's load beside the unload (within 2 s, or issued in the same tick
    on the same worker) allows it too, and a load before its worker's agent restarted is not
    known to the agent."""
    loads: dict[tuple[str, str], CacheEvent] = {}
    out = []
    events = sorted(rec.events, key=lambda e: e.ts)
    for e in events:
        key = (e.worker_id, e.lora_name)
        if e.kind == "load":
            loads[key] = e
            continue
        load = loads.get(key)
        if (
            e.kind != "unload"
            or load is None
            or e.reason == "revoked"
            or (e.ts - load.ts).total_seconds() >= POLICY.min_residency_s
            or load.ts < restarted.get(e.worker_id, datetime.min.replace(tzinfo=e.ts.tzinfo))
        ):
            continue
        cmd = rec.commands.get(e.command_id or "")
        if cmd is not None and cmd.reason.rule in UNDONE_BY:
            continue
        if e.reason == "slot_needed" and cmd is None and load.command_id is None:
            continue  # a request's copy giving its slot to another load, as requests compete
        if cmd is not None and _for_never_evict(cmd, rec, never_evict):
            continue
        if any(
            x.kind == "load"
            and x.worker_id == e.worker_id
            and x.lora_name in never_evict
            and abs((x.ts - e.ts).total_seconds()) <= 2
            for x in events
        ):
            continue
        out.append((load, e))
    return out


def _for_never_evict(cmd: CacheCommand, rec: Recorded, never_evict: set[str]) -> bool:
    """Did ``cmd`` (a ``slot_needed`` demote) make room for a never-evict version's load on
    the same worker in the same tick (the planner's rule: a copy within ``min_residency_s``
    gives its slot to such a version only)? Read from the commands, not from when the
    worker's load event lands, which a busy machine delays by seconds."""
    return cmd.reason.rule == CommandRule.slot_needed and any(
        c.action == CommandAction.load_gpu
        and c.worker_id == cmd.worker_id
        and c.issued_at == cmd.issued_at
        and c.lora_name in never_evict
        for c in rec.commands.values()
    )


class Traffic:
    """RATE requests/s through the router: at first adapter i of the catalog with weight
    1/(i+1), the ranking turned by 3 every SHIFT_S."""

    def __init__(self, url: str, keys: dict[str, str]) -> None:
        self.answers: list[Answer] = []
        adapters = DEMO_CATALOG.adapters
        self._pick = random.Random(29)
        self._names = [a.adapter_id for a in adapters]
        self._weights = [1 / (i + 1) for i in range(len(adapters))]
        self._keys = {a.adapter_id: keys[a.tenant_id] for a in adapters}
        self._url, self._local = url, threading.local()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(CONCURRENCY)
        self._thread = threading.Thread(target=self._send)
        self._thread.start()

    def _send(self) -> None:
        start = time.monotonic()
        for i in range(10**9):
            time.sleep(max(0.0, start + i / RATE - time.monotonic()))
            if self._stop.is_set():
                return
            turn = 3 * int((time.monotonic() - start) // SHIFT_S)
            weights = (
                self._weights[-turn % len(self._weights) :]
                + self._weights[: -turn % len(self._weights)]
            )
            self._pool.submit(self._one, self._pick.choices(self._names, weights)[0])

    def _one(self, adapter: str) -> None:
        if not hasattr(self._local, "s"):
            self._local.s = requests.Session()
        self.answers.append(
            ask(self._url, adapter, self._local.s, key=self._keys[adapter], max_tokens=8)
        )

    def stop(self) -> list[Answer]:
        self._stop.set()
        self._thread.join(10)
        self._pool.shutdown(wait=True)
        return self.answers


@pytest.fixture(scope="module")
def system(stack: Settings) -> Iterator[tuple[LiveSystem, dict[str, str]]]:
    space = RunSpace.fresh(stack.home, "agreement", secrets_dir=stack.secrets_dir)
    artifacts = Artifacts(stack.home / "demo")
    artifacts.ensure(DEMO_CATALOG)
    steps = Steps(Console(stderr=True))
    try:
        with Supervisor(space.log_dir, space.child_env(), ROOT) as supervisor:
            live = LiveSystem(supervisor, space, artifacts, OPTIONS, space.settings(stack))
            keys = live.bring_up(steps, DEMO_CATALOG.tenants, workers=2)
            yield live, keys
    finally:
        drop_namespace(stack, space.topic_prefix, space.database)


def restart(live: LiveSystem, worker_id: str) -> tuple[float, datetime]:
    """Stop the worker's agent and gateway (SIGTERM; its vLLM keeps its copies), wait DOWN_S
    and start it again with the same command line: the seconds until its gateway answers
    again, and when the new agent started."""
    child = next(c for c in live.supervisor.children if c.name == f"worker-{worker_id}")
    gateway = next(w.gateway_url for w in live.workers if w.worker_id == worker_id)
    started = time.monotonic()
    live.supervisor.stop(child)
    time.sleep(DOWN_S)
    at = datetime.now().astimezone()
    again = live.supervisor.start(child.name, child.argv)
    live.supervisor.wait_ready(
        again, lambda: http_ok(gateway + "/healthz"), 180, "healthy again (/healthz)"
    )
    return time.monotonic() - started, at


def test_no_refused_or_repeated_command_across_a_worker_restart(
    system: tuple[LiveSystem, dict[str, str]],
) -> None:
    live, keys = system
    recorder = Recorder(live.settings)
    publish_catalog(live)
    live.wait(lambda: registry_complete(live), 120, "the registry")
    canary = DEMO_CATALOG.canaries[0].adapter_id
    traffic = Traffic(live.router_url, keys)
    began = time.monotonic()
    try:
        time.sleep(TRAFFIC_S / 4)
        live.lifecycle("promote", canary, "2", reason="agreement: canary looks good")
        time.sleep(max(0.0, began + TRAFFIC_S / 2 - time.monotonic()))
        down_s, restarted_at = restart(live, "w1")
        time.sleep(max(0.0, began + 3 * TRAFFIC_S / 4 - time.monotonic()))
        live.lifecycle("rollback", canary, "2", reason="agreement: roll back")
        time.sleep(max(0.0, began + TRAFFIC_S - time.monotonic()))
    finally:
        answers = traffic.stop()
    time.sleep(2 * OPTIONS.heartbeat_s + 2)  # the last heartbeats and dead letters land
    rec = recorder.stop()
    never_evict = {
        r.lora_name
        for v in live.registry().values()
        for r in v.versions
        if r.priority == "platinum" or (r.status == "canary" and r.release.canary_percent > 0)
    }
    refused = [d for d in rec.dead if d.reason in REFUSED]
    repeats, raw = repeated(rec)
    flaps = undone(rec, never_evict, {"w1": restarted_at})
    no_slot_lines = sum(
        path.read_text(errors="replace").count("no GPU slot")
        for path in live.space.log_dir.glob("worker-*.log")
    )
    loads = Counter((e.worker_id, e.kind) for e in rec.events if e.kind in ("load", "unload"))
    print(
        "\n"
        + json.dumps(
            {
                "traffic_s": TRAFFIC_S,
                "requests": len(answers),
                "answers": dict(Counter(a.kind for a in answers)),
                "served_hot": sum(a.status == 200 and a.tier == "gpu" for a in answers),
                "restart_down_s": round(down_s, 1),
                "commands": len(rec.commands),
                "commands_by_action": dict(Counter(c.action.value for c in rec.commands.values())),
                "dead_letters": dict(Counter(str(d.reason) for d in rec.dead)),
                "refused": len(refused),
                "repeated": len(repeats),
                "identical_within_deadline": raw,
                "undone_within_min_residency": len(flaps),
                "gpu_loads_unloads": {f"{w} {k}": n for (w, k), n in sorted(loads.items())},
                "no_gpu_slot_log_lines": no_slot_lines,
                "unreadable_records": recorder.unreadable,
            },
            indent=1,
        )
    )
    for earlier, cmd in repeats[:10]:
        print(
            f"repeated: {cmd.worker_id} {cmd.action} {cmd.lora_name} {cmd.reason.rule} "
            f"{(cmd.issued_at - earlier.issued_at).total_seconds():.1f}s after"
        )
    for load, unload in flaps[:10]:
        by = rec.commands.get(unload.command_id or "")
        print(
            f"undone: {unload.worker_id} {unload.lora_name} loaded {load.ts:%H:%M:%S} "
            f"({load.command_id}) unloaded {unload.ts:%H:%M:%S} {unload.reason} "
            f"({unload.command_id}: {by.reason if by else 'no command'})"
        )
        for c in sorted(rec.commands.values(), key=lambda c: c.issued_at):
            # every command on that copy, and those of the unload's tick, for the reader
            if c.lora_name == unload.lora_name or (by is not None and c.issued_at == by.issued_at):
                print(
                    f"  {c.issued_at:%H:%M:%S.%f} {c.worker_id} {c.action} {c.lora_name} {c.reason}"
                )
    assert refused == [], [d.detail for d in refused]
    assert repeats == []
    assert flaps == []
    assert Counter(a.kind for a in answers)["ok"] >= 0.9 * len(answers)
    assert any(s.worker_id == "w1" and s.ts > restarted_at for s in rec.states)
    assert CommandAction.load_gpu in {c.action for c in rec.commands.values()}
