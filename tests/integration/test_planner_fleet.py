"""The fleet with the planner in the loop, on the real stack: the whole system of a load test
(``loraplane.demo.system``: the streams app with scoring + planner, the ClickHouse sink, three
FAKE vLLMs each with its ``loraplane worker run``, ``loraplane router run`` in front; Kafka,
ClickHouse, local S3), heartbeats every second, a planner tick every half second, and a
policy whose ``worker_capacity_rps`` (3) the test's ~14 req/s exceed.

- replicas: the planner gives a hot adapter a second GPU copy (``load_gpu``,
  ``replica_demand``), the heartbeats show it, and its traffic through the router splits
  across the copies (``X-Loraplane-Worker``). Once the traffic stops, the decaying demand
  stays inside the band for at least 60 s x ln((1 + h) / (1 - h)) (h = 0.1: 12 s), so the
  copy stays that long; then ``replica_surplus`` gives it back (the last test, which waits
  for it while the kill test runs).
- a worker SIGKILLed (agent and FAKE vLLM) while an adapter it alone holds takes traffic: the
  router drops it (a refused connection at once, else after 3 silent heartbeats), the
  planner stops counting it after 3 heartbeats and sends ``load_gpu`` to a survivor for the
  idle adapter it alone held, and a survivor serves the busy one from a GPU copy. The bound
  (docs/router.md): 3 heartbeats + one planner tick + the load + one heartbeat for the
  router to see the copy = 4.5 s + load at these settings, asserted <= 20 s for a loaded
  2-core machine. Every request sent meanwhile is answered 200 or 429/503 + Retry-After.
The numbers are printed (pytest -s) for the report.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import pytest
import requests
from rich.console import Console

from loraplane.demo.catalog import Adapter, Artifacts, Catalog
from loraplane.demo.namespace import RunSpace
from loraplane.demo.steps import Steps
from loraplane.demo.supervisor import Supervisor
from loraplane.demo.system import ROOT, LiveSystem, SystemOptions, in_parallel
from loraplane.kernel import kafka
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.schemas.codec import decode
from loraplane.schemas.commands import CacheCommand, CommandAction
from loraplane.schemas.reasons import CommandRule
from loraplane.schemas.worker_state import WorkerState
from tests.integration.router_env import Answer, ask
from tests.integration.test_loadtest import drop_namespace

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
HEARTBEAT_S, TICK_S = 1.0, 0.5
CAPACITY_RPS, HYSTERESIS = 3.0, 0.1
# the replica band, not the minimum residency (180 s by default), decides here when the
# extra copy goes: a short residency keeps it from hiding the band's own timing
POLICY = {
    "worker_capacity_rps": CAPACITY_RPS,
    "replica_hysteresis": HYSTERESIS,
    "planner_interval_s": TICK_S,
    "worker_heartbeat_s": HEARTBEAT_S,
    "min_residency_s": 10.0,
}
OPTIONS = SystemOptions(fake_vllm=True, gpu_slots=4, tick_s=0.2, heartbeat_s=HEARTBEAT_S)
TAU_1M_S = 60.0  # the planner's demand: the decayed 1-minute request count / 60 s
HOT_RATE, KILL_RATE, CONCURRENCY = 14.0, 8.0, 4
HOT = Adapter("hot", "acme", "gold", seed=301)
SPREAD = tuple(Adapter(f"spread-{i}", "acme", "gold", seed=310 + i) for i in range(1, 5))
CATALOG = Catalog((HOT, *SPREAD))
MOVE_BOUND_S = 20.0


class Tail:
    """The run's cache commands and worker states as they arrive (a consumer thread), each
    with the monotonic time it was read."""

    def __init__(self, settings: Settings) -> None:
        self.commands: list[tuple[float, CacheCommand]] = []
        self.states: list[tuple[float, WorkerState]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(settings,), daemon=True)
        self._thread.start()

    def _run(self, settings: Settings) -> None:
        kinds = {
            topic_name(settings, "commands"): CacheCommand,
            topic_name(settings, "worker-state"): WorkerState,
        }
        consumer = kafka.consumer(settings, f"test-tail-{uuid.uuid4().hex[:8]}", quiet=True)
        try:
            consumer.subscribe(list(kinds))
            while not self._stop.is_set():
                for msg in consumer.consume(100, 0.1):
                    if msg.error() is not None or msg.value() is None:
                        continue
                    item = decode(kinds[msg.topic() or ""], msg.value())
                    if isinstance(item, CacheCommand):
                        self.commands.append((time.monotonic(), item))
                    else:
                        self.states.append((time.monotonic(), item))
        finally:
            consumer.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def gpu(self, adapter_id: str, *, after: float = 0.0) -> dict[str, float]:
        """worker -> when its latest state read after ``after`` showed ``adapter_id`` on GPU
        (the first of its current run of such states)."""
        since: dict[str, float] = {}
        for at, s in list(self.states):
            if at <= after:
                continue
            if any(a.adapter_id == adapter_id and a.tier == "gpu" for a in s.adapters):
                since.setdefault(s.worker_id, at)
            else:
                since.pop(s.worker_id, None)
        return since

    def issued(
        self, adapter_id: str, action: CommandAction, rule: CommandRule | None = None
    ) -> list[tuple[float, CacheCommand]]:
        return [
            (at, c)
            for at, c in list(self.commands)
            if c.adapter_id == adapter_id
            and c.action == action
            and (rule is None or c.reason.rule == rule)
        ]


class Traffic:
    """Requests for ``adapters`` (in turn) through the router at ``rate`` per second, at most
    CONCURRENCY at once, until ``stop``; every answer is kept."""

    def __init__(self, url: str, key: str, adapters: list[str], rate: float) -> None:
        self.answers: list[Answer] = []
        self.url, self.key = url, key
        self._local = threading.local()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(CONCURRENCY)
        self._futures: list[Future[Answer]] = []
        self._thread = threading.Thread(target=self._send, args=(adapters, rate))
        self._thread.start()

    def _send(self, adapters: list[str], rate: float) -> None:
        start = time.monotonic()
        for i, adapter in enumerate(itertools.cycle(adapters)):
            time.sleep(max(0.0, start + i / rate - time.monotonic()))
            if self._stop.is_set():
                return
            self._futures.append(self._pool.submit(self._one, adapter))

    def _one(self, adapter: str) -> Answer:
        if not hasattr(self._local, "s"):
            self._local.s = requests.Session()
        answer = ask(self.url, adapter, self._local.s, key=self.key, max_tokens=16)
        self.answers.append(answer)
        return answer

    def after(self, t: float) -> list[Answer]:
        return [a for a in list(self.answers) if a.at > t]

    def stop(self) -> list[Answer]:
        """Stop sending; every request sent is answered (a hang fails here)."""
        self._stop.set()
        self._thread.join(10)
        answers = [f.result(timeout=60) for f in self._futures]
        self._pool.shutdown()
        return answers


@dataclass
class Live:
    system: LiveSystem
    key: str
    tail: Tail
    spread: Future[None]  # the spread adapters published (in the background)
    hot_stopped: float | None = None  # wall time the hot adapter's traffic stopped
    hot_copies: int = 0
    hot_add_demand: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.system.router_url

    def wait(self, probe: Callable[[], object], timeout_s: float, what: str) -> float:
        """Poll ``probe`` every 0.1 s until true; the monotonic time it became true."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if probe():
                return time.monotonic()
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")

    def warm(self, adapter_id: str) -> str:
        """Requests for it until one is served from a GPU copy and the router's view shows
        one more copy than before; the worker that serves it."""
        session, before = requests.Session(), self.system.router_health().get("gpu_copies", 0)
        served: list[Answer] = []

        def hot() -> bool:
            served.append(ask(self.url, adapter_id, session, key=self.key))
            return (
                served[-1].tier == "gpu"
                and self.system.router_health().get("gpu_copies", 0) > before
            )

        self.wait(hot, 60, f"{adapter_id} served from a GPU copy")
        return str(served[-1].worker)


@pytest.fixture(scope="module")
def live(stack: Settings) -> Iterator[Live]:
    space = RunSpace.fresh(stack.home, "planner-fleet", secrets_dir=stack.secrets_dir)
    artifacts = Artifacts(stack.home / "demo")
    artifacts.ensure(CATALOG)
    env = {
        **space.child_env(),
        **{f"LORAPLANE_POLICY__{k.upper()}": str(v) for k, v in POLICY.items()},
    }
    steps = Steps(Console(stderr=True))
    try:
        with Supervisor(space.log_dir, env, ROOT) as supervisor:
            system = LiveSystem(supervisor, space, artifacts, OPTIONS, space.settings(stack))
            keys = system.bring_up(steps, CATALOG.tenants, workers=3)
            tail = Tail(system.settings)

            def publish(a: Adapter) -> None:
                system.publish(
                    a.adapter_id, a.tenant_id, "1", artifacts.adapter_dir(a.seed), a.priority
                )
                system.lifecycle("promote", a.adapter_id, "1")

            steps.run("publish + promote the hot adapter", partial(publish, HOT))
            session = requests.Session()  # the gateways refresh their registry on their own
            steps.run(
                "the router and a gateway serve it",
                lambda: system.wait(
                    lambda: (
                        ask(
                            system.router_url, HOT.adapter_id, session, key=keys[HOT.tenant_id]
                        ).status
                        == 200
                    ),
                    60,
                    "a 200 for the adapter",
                    interval_s=0.2,
                ),
            )
            # its first copy shows in a heartbeat before the load: a copy the router placed
            # by itself (rule 3) and a cold load the planner sent meanwhile to another
            # worker would otherwise make a second copy that no replica rule asked for
            steps.run(
                "its first GPU copy shows, to the router too",
                lambda: system.wait(
                    lambda: (
                        len(tail.gpu(HOT.adapter_id)) >= 1
                        and system.router_health().get("gpu_copies", 0) >= 1
                    ),
                    60,
                    "a GPU copy of it",
                    interval_s=0.2,
                ),
            )
            with ThreadPoolExecutor(1) as background:  # the kill test's, during the first
                spread = background.submit(in_parallel, publish, SPREAD)
                live = Live(system, keys[HOT.tenant_id], tail, spread)
                try:
                    yield live
                finally:
                    tail.stop()
                    print("\n".join(live.notes))
    finally:
        drop_namespace(stack, space.topic_prefix, space.database)


def test_demand_over_one_workers_capacity_gets_a_second_copy_and_the_traffic_splits(
    live: Live,
) -> None:
    started = time.monotonic()
    traffic = Traffic(live.url, live.key, [HOT.adapter_id], HOT_RATE)
    try:
        # the replica rule's copy, on the GPU next to another: the planner may also move
        # the first copy first (demoted while its score was still low, loaded again
        # elsewhere: seen in a clean CI), which is not what this test is about
        live.wait(
            lambda: (
                len(live.tail.gpu(HOT.adapter_id)) >= 2
                and any(
                    c.worker_id in live.tail.gpu(HOT.adapter_id)
                    for _, c in live.tail.issued(
                        HOT.adapter_id, CommandAction.load_gpu, CommandRule.replica_demand
                    )
                )
            ),
            90,
            "a second GPU copy of the hot adapter by the replica rule",
        )
        holders = live.tail.gpu(HOT.adapter_id)
        seen = live.wait(
            lambda: live.system.router_health().get("gpu_copies", 0) >= len(holders),
            30,
            "the router to see the copies",
        )
        live.wait(lambda: len(traffic.after(seen)) >= 40, 30, "traffic to the copies")
    finally:
        answers = traffic.stop()
        live.hot_stopped = time.time()
    adds = live.tail.issued(HOT.adapter_id, CommandAction.load_gpu, CommandRule.replica_demand)
    every = [
        (round(at - started, 1), c.worker_id, c.action.value, str(c.reason.rule))
        for at, c in list(live.tail.commands)
        if c.adapter_id == HOT.adapter_id
    ]
    print(f"\ncommands for {HOT.adapter_id} (s after the load began): {every}")
    split = Counter(a.worker for a in answers if a.at > seen and a.status == 200)
    kinds = Counter(a.kind for a in answers)
    live.hot_copies = len(holders)
    added_s = max(holders.values()) if len(holders) else 0.0  # the replica's copy
    print(
        f"\nreplicas: {len(holders)} GPU copies of {HOT.adapter_id} on {sorted(holders)} "
        f"after {max(holders.values()) - started:.1f}s at {HOT_RATE:g} req/s (capacity "
        f"{CAPACITY_RPS:g}/worker, hysteresis {HYSTERESIS:g}); load_gpu replica_demand: "
        f"{[(c.worker_id, c.reason.detail) for _, c in adds]}; after the router saw them: "
        f"{dict(split)}; {len(answers)} requests: {dict(kinds)}"
    )
    assert adds and {c.worker_id for _, c in adds} <= set(holders)
    live.hot_add_demand = float(adds[0][1].reason.detail.split()[1])  # the band test's input
    assert added_s >= started
    # every copy takes traffic: the router's rule 1 sends to the least busy copy, and idle
    # copies take turns (before turns, ties went to the lowest id: 0 to 11 of ~40 took the
    # second copy, 0 in a CI run of 2026-12-02)
    assert set(split) == set(holders) and min(split.values()) >= sum(split.values()) // 4, split
    assert kinds["ok"] == len(answers)


def test_a_killed_worker_is_left_out_its_adapters_placed_again_and_no_request_lost(
    live: Live,
) -> None:
    live.spread.result(timeout=180)
    live.wait(
        lambda: live.system.router_health().get("adapters") == len(CATALOG.adapters),
        60,
        "the router's view of the spread adapters",
    )
    hot_holders = set(live.tail.gpu(HOT.adapter_id))
    where = {a.adapter_id: live.warm(a.adapter_id) for a in SPREAD}

    def alone() -> dict[str, list[str]]:
        """Per worker without the hot adapter: the spread adapters only it holds."""
        return {
            w: [a for a in where if set(live.tail.gpu(a)) == {w}]
            for w in set(where.values()) - hot_holders
        }

    # the planner may load a second copy of a spread adapter the router had placed (its own
    # pick, not the router's), which then no longer sits alone on one worker: wait a little
    # for a worker that holds two alone, else go on with one (the idle check is then void)
    try:
        live.wait(
            lambda: any(len(v) >= 2 for v in alone().values()),
            20,
            "a worker outside the hot holders with two adapters alone",
        )
    except AssertionError:
        print(f"\nno worker outside {hot_holders} holds two spread adapters alone: {where}")
    held = alone()
    assert any(held.values()), f"every spread adapter has a hot holder's copy: {where}"
    victim = max(held, key=lambda w: (len(held[w]), w))
    busy, *idle = held[victim]
    survivors = {w.worker_id for w in live.system.workers} - {victim}
    traffic = Traffic(live.url, live.key, [busy], KILL_RATE)
    try:
        live.wait(lambda: len(traffic.answers) >= 16, 30, "traffic before the kill")
        killed, killed_wall = time.monotonic(), time.time()
        for child in [
            c
            for c in live.system.supervisor.children
            if c.name in (f"worker-{victim}", f"fake-vllm-{victim[1:]}")
        ]:
            os.killpg(child.pid, signal.SIGKILL)  # no goodbye heartbeat, no unload
        drained = live.wait(
            lambda: live.system.router_health().get("workers") == 2,
            30,
            f"the router to drop {victim}",
        )

        def placed(adapter_id: str) -> dict[str, float]:
            return {
                w: at for w, at in live.tail.gpu(adapter_id, after=killed).items() if w in survivors
            }

        for a in (busy, *idle):
            live.wait(partial(placed, a), 60, f"{a} on a survivor's GPU")
        loaded = {a: min(placed(a).values()) for a in (busy, *idle)}
        live.wait(
            lambda: any(a.tier == "gpu" and a.worker in survivors for a in traffic.after(killed)),
            30,
            f"{busy} served from a survivor's GPU copy",
        )
        served = min(
            a.at for a in traffic.after(killed) if a.tier == "gpu" and a.worker in survivors
        )
        after = len(traffic.answers)
        live.wait(lambda: len(traffic.answers) >= after + 16, 30, "traffic after the move")
    finally:
        answers = traffic.stop()
    replaced = {
        a: [
            (c.worker_id, c.reason.rule)
            for _, c in live.tail.issued(a, CommandAction.load_gpu)
            if c.issued_at.timestamp() > killed_wall
        ]
        for a in idle
    }
    kinds = Counter(a.kind for a in answers)
    during = Counter(a.kind for a in answers if a.at > killed)
    print(
        f"\nkill: {victim} (alone held busy {busy}, idle {idle}) SIGKILLed; router drained "
        f"it after {drained - killed:.1f}s; GPU copy on a survivor after "
        + ", ".join(f"{a} {t - killed:.1f}s" for a, t in loaded.items())
        + f" (copies of {busy} now on {sorted(placed(busy))})"
        + f"; {busy} first served from it after {served - killed:.1f}s; planner load_gpu "
        f"after the kill: {replaced}; {len(answers)} requests: {dict(kinds)} "
        f"({dict(during)} after the kill)\n  after the kill (s, worker, tier): "
        + " ".join(f"{a.at - killed:.1f}/{a.worker}/{a.tier}" for a in answers if a.at > killed)[
            :1200
        ]
    )
    live.notes.append(
        f"kill bound {MOVE_BOUND_S:g}s: drained {drained - killed:.1f}s, "
        f"placed {max(loaded.values()) - killed:.1f}s, served "
        f"{served - killed:.1f}s"
    )
    assert drained - killed <= 3 * HEARTBEAT_S + HEARTBEAT_S + 4  # + slack for 2 cores
    assert max(loaded.values()) - killed <= MOVE_BOUND_S
    assert served - killed <= MOVE_BOUND_S
    for a in idle:  # nobody asked for it since: the planner placed it again
        assert any(w in survivors for w, _ in replaced[a]), replaced
    assert set(kinds) <= {"ok", "retryable"}, kinds  # none lost, none hanging (stop waits)
    assert all(a.worker != victim for a in answers if a.at > drained and a.status == 200)


def test_the_extra_copy_stays_inside_the_band_then_replica_surplus_drops_it(live: Live) -> None:
    if live.hot_stopped is None or live.hot_copies < 2:
        pytest.skip("no second copy to give back")
    n, cap, h = live.hot_copies, CAPACITY_RPS, HYSTERESIS
    # the demand at the stop was at least the one that added the copy (it only grew), so
    # it stays above (n - 1) x capacity x (1 - h) for at least this long:
    kept_s = TAU_1M_S * math.log(live.hot_add_demand / ((n - 1) * cap * (1 - h)))
    live.wait(
        lambda: live.tail.issued(
            HOT.adapter_id, CommandAction.demote_to_host, CommandRule.replica_surplus
        ),
        120,
        "replica_surplus to drop the extra copy",
    )
    [(_, drop), *_] = live.tail.issued(
        HOT.adapter_id, CommandAction.demote_to_host, CommandRule.replica_surplus
    )
    after_s = drop.issued_at.timestamp() - live.hot_stopped
    live.wait(
        lambda: len(live.tail.gpu(HOT.adapter_id)) == n - 1,
        30,
        "one GPU copy fewer in the heartbeats",
    )
    print(
        f"\nreplica_surplus: {drop.worker_id} gives its copy back {after_s:.1f}s after the "
        f"traffic stopped (kept at least {kept_s:.1f}s by the band); {drop.reason.detail}"
    )
    assert after_s >= kept_s - 1.0
