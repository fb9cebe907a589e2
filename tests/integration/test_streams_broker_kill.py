"""The streams app (``loraplane streams run``: registry, scoring and planner agents) survives
faults by itself (issue 19). On a throwaway Kafka of the module's own, under steady
request-log load through a worker's event sink (its spool takes what the broker cannot):

1. the broker is SIGKILLed, kept down ``LORAPLANE_FAULT_DOWN_S`` (20 s) and started again
   on the same ports and data; the app is not restarted: every request log on the topic
   is counted exactly once in the scores (also one the spool's replay delivered twice:
   what the dying broker took without acknowledging), a signed lifecycle event published after the
   restart is accepted, the planner plans new demand, every ``STALLED`` it logged is
   followed by its ``RECOVERED``, and its ``/metrics`` (``--metrics-port``) shows the
   scoring and planner consumers at ``loraplane_consumer_stuck_seconds`` 0 again; the
   planner's lease was lost while the broker was away and taken again after
   (docs/reliability.md, "Kafka away");
2. the app itself is SIGKILLed under load and started again: the scores are still exact
   and the planner re-issues nothing under new command ids.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplane.eventlog.sink import KafkaEventSink
from loraplane.infra.kafka import Kafka
from loraplane.infra.processes import free_port
from loraplane.kernel.config import Settings
from loraplane.schemas.codec import decode
from loraplane.schemas.commands import CacheCommand
from loraplane.schemas.request_log import RequestLog
from loraplane.streams.score_keeper import restore
from loraplane.streams.scores import score_key
from tests.integration.fault_report import report_fault
from tests.integration.planner_env import PlannerEnv
from tests.integration.private_kafka import SteadyLoad, kill, private_kafka, start
from tests.integration.scores_env import committed, expected_states, wait_states

# long (bench.faults runs it, docs/reliability.md): not in ./run test
pytestmark = [pytest.mark.integration, pytest.mark.fault_long]

RATE_HZ = 50
DOWN_S = float(os.environ.get("LORAPLANE_FAULT_DOWN_S", "20"))
"""How long the broker stays dead under load (``bench.faults --outage-s`` for the long form)."""
HOLD_UP = re.compile(r"(STALLED|RECOVERED) (\S+):")
LEASE = re.compile(r"planner lease: (ACTIVE|STANDBY) \(([^)]*)\)")


def uid(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, Kafka]]:
    with private_kafka(tmp_path_factory.mktemp("kafka"), ()) as found:
        yield found


@pytest.fixture
def env(broker: tuple[Settings, Kafka], tmp_path: Path) -> Iterator[PlannerEnv]:
    """The app on a prefix of its own, its children pointed at the throwaway broker."""
    settings, _ = broker
    e = PlannerEnv.create(settings, tmp_path, command_deadline_s=600)
    e.metrics_port = free_port()
    e.env |= {
        "LORAPLANE_KAFKA__PORT": str(settings.kafka.port),
        "LORAPLANE_KAFKA__CONTROLLER_PORT": str(settings.kafka.controller_port),
        "LORAPLANE_KAFKA__CREDENTIALS_DIR": str(settings.kafka.credentials_dir),
    }
    with e.run():
        yield e


def exactly_once(env: PlannerEnv, load: SteadyLoad, timeout_s: float = 120) -> tuple[int, int]:
    """Every request log the load sent reached the topic, and the scores are the fold of
    every distinct log on it, each counted once: the event sink delivers at least once (a
    replay of what the broker took without acknowledging it is on the topic twice).
    Returns (distinct logs of the load on the topic, deliveries of them beyond the first)."""
    logs = [decode(RequestLog, v) for v in committed(env, "requests")]
    seen = Counter(x.event_id for x in logs if x.adapter_id == load.adapter_id)
    assert set(seen) == {f"{load.prefix}{n}" for n in range(load.n)}, (
        f"{load.n - len(seen)} of {load.n} request logs lost"
    )
    first: dict[str, RequestLog] = {}
    for x in logs:
        first.setdefault(x.event_id, x)
    wait_states(env, expected_states(list(first.values())), timeout_s)
    return len(seen), sum(seen.values()) - len(seen)


def hold_ups(env: PlannerEnv) -> tuple[Counter[str], set[str]]:
    """STALLED lines per component in the app's log, and the components still stalled (no
    RECOVERED after their last STALLED)."""
    stalls: Counter[str] = Counter()
    open_: set[str] = set()
    for kind, component in HOLD_UP.findall((env.home / "streams.log").read_text()):
        if kind == "STALLED":
            stalls[component] += 1
            open_.add(component)
        else:
            open_.discard(component)
    return stalls, open_


def lease_changes(env: PlannerEnv) -> list[str]:
    """The planner lease's changes in the app's log: ``ACTIVE``, ``STANDBY (why)``."""
    return [
        state if state == "ACTIVE" else f"{state} ({why})"
        for state, why in LEASE.findall((env.home / "streams.log").read_text())
    ]


def stuck_seconds(env: PlannerEnv) -> dict[str, float]:
    """``loraplane_consumer_stuck_seconds`` per component, from the app's own /metrics."""
    import urllib.request

    url = f"http://127.0.0.1:{env.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("loraplane_consumer_stuck_seconds{")
    }


def scored(env: PlannerEnv, load: SteadyLoad) -> int:
    """Wait (serving the load's sink) until the scoring agent has committed a batch of the
    load: the kill must hit an app with state to keep. Returns the logs sent by then."""
    key = score_key(load.adapter_id, "1")
    deadline = time.monotonic() + 60
    while key not in restore(env.settings):
        assert time.monotonic() < deadline, "the scoring agent committed nothing"
        load.run_for(0.5)
    return load.n


def steady_adapter(env: PlannerEnv) -> str:
    """The load's adapter, published (only registry versions are scored) for a base model
    no worker serves, so the planner issues no command for it."""
    steady = env.publish(uid("steady"), uid("b-nobody"))
    env.wait_registered((steady, "active"))
    return steady.adapter_id


def plans_new_demand(env: PlannerEnv, base: str, what: str) -> CacheCommand:
    """A freshly published (signed) adapter is accepted by the registry and its first
    requests make the planner load it."""
    fresh = env.publish(uid("fresh"), base)
    env.wait_registered((fresh, "active"))
    env.requests(fresh, 5)
    cmds = env.wait_commands(
        base, lambda c: fresh.lora_name in {x.lora_name for x in c}, what, timeout_s=90
    )
    return next(c for c in cmds if c.lora_name == fresh.lora_name)


def test_the_app_heals_from_a_broker_kill_by_itself(
    broker: tuple[Settings, Kafka], env: PlannerEnv
) -> None:
    _, kafka_node = broker
    base = uid("b-kafka")
    env.heartbeat(uid("w"), base)
    events = KafkaEventSink(env.settings, "streams-broker-kill-test")
    load = SteadyLoad(events, "s", RATE_HZ, adapter_id=steady_adapter(env))
    try:
        load.run_for(3)
        committed_before = scored(env, load)
        load.run_for(2)
        leases_before = len(lease_changes(env))
        kill(kafka_node)
        t_down = time.monotonic()
        load.run_for(DOWN_S)
        start(kafka_node)
        down_s = time.monotonic() - t_down
        t_up = time.monotonic()
        load.run_for(5)
        load.drain()
        spooled = events.counts.spooled
    finally:
        events.close(5)

    load_cmd = plans_new_demand(env, base, "a load planned after the broker restart")
    stored, delivered_twice = exactly_once(env, load)
    recovery_s = time.monotonic() - t_up
    assert env.worker is not None and env.worker.poll() is None, "the streams app died"
    stalls, still = hold_ups(env)
    print(
        f"broker down {down_s:.0f} s: {load.n} request logs ({committed_before} sent "
        f"before a batch was committed), {spooled} spooled, all "
        f"counted once; {load_cmd.action.value} {load_cmd.lora_name}; stalls {dict(stalls)}; "
        f"recovered {recovery_s:.0f} s after the restart; planner lease "
        f"{lease_changes(env)[max(0, leases_before - 1) :]}"
    )
    assert still == set(), f"still STALLED: {still}"
    leases = lease_changes(env)[max(0, leases_before - 1) :]  # from the one held at the kill
    assert leases[0] == "ACTIVE" and leases[-1] == "ACTIVE", leases
    assert any(c.startswith("STANDBY (lost") for c in leases), leases
    assert spooled > 0, "the outage should have reached the event spool"
    stuck = stuck_seconds(env)
    assert {"scoring", "planner"} <= set(stuck), stuck
    assert all(v == 0 for v in stuck.values()), f"a consumer still says it is stuck: {stuck}"
    report_fault(
        "streams app: Kafka (1 broker) SIGKILL under load, restarted",
        answered=load.n,
        stored=stored,
        lost=load.n - stored,
        duplicated=0,
        recovered=True,
        down_s=down_s,
        recovery_s=recovery_s,
        note=f"scores exact (every log counted once; {delivered_twice} delivered "
        f"twice by the spool's replay, skipped by event_id); {spooled} events "
        f"spooled; "
        f"registry and planner took new work after it; STALLED then RECOVERED: "
        f"{', '.join(sorted(stalls)) or 'none'}; the app never restarted",
    )


def test_a_killed_app_restarts_exact_and_reissues_nothing(env: PlannerEnv) -> None:
    base = uid("b-kill")
    kept = env.publish(uid("kept"), base)
    env.wait_registered((kept, "active"))
    worker = uid("w")
    env.heartbeat(worker, base)
    env.requests(kept, 5)
    env.wait_commands(base, lambda c: len(c) > 0, "the load before the kill")
    time.sleep(2)  # the memory's changelog lands before any command goes out
    before = env.commands(base)

    events = KafkaEventSink(env.settings, "streams-app-kill-test")
    load = SteadyLoad(events, "k", RATE_HZ, adapter_id=steady_adapter(env))
    scored(env, load)
    sender = threading.Thread(target=load.run_for, args=(20,), name="load")
    sender.start()
    try:
        time.sleep(2)
        assert env.worker is not None
        env.worker.send_signal(signal.SIGKILL)
        env.worker.wait(10)
        t_kill = time.monotonic()
        env.worker = None
        env.start()
        restart_s = time.monotonic() - t_kill
        sender.join()
        load.drain()
    finally:
        sender.join()
        events.close(5)

    env.heartbeat(worker, base, gpu=[kept])  # the load was applied
    fresh_cmd = plans_new_demand(env, base, "a load planned after the app's restart")
    stored, delivered_twice = exactly_once(env, load)
    recovery_s = time.monotonic() - t_kill
    after = env.commands(base)
    ids: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for c in after:
        ids[(c.worker_id, c.action.value, c.lora_name)].add(c.command_id)
    assert {k: v for k, v in ids.items() if len(v) > 1} == {}, "re-issued under new ids"
    assert {c.command_id for c in after} == {c.command_id for c in before} | {fresh_cmd.command_id}
    report_fault(
        "streams app SIGKILL under load, started again",
        answered=load.n,
        stored=stored,
        lost=load.n - stored,
        duplicated=0,
        recovered=True,
        down_s=restart_s,
        recovery_s=recovery_s,
        note=f"started again by hand (as a supervisor would); scores exact (every "
        f"log counted once, {delivered_twice} delivered twice); {len(before)} "
        f"command(s) from before the kill not re-issued under new ids; new "
        f"demand planned",
    )
