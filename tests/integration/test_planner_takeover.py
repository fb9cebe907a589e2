"""Planner high availability on the real broker (issue #15 item 2): two ``loraplane streams
planner`` processes share the lease of their prefix; under load the active one is killed
with SIGKILL and the standby must plan within 10 s, with the memory the killed one committed,
so no decision is re-issued under a new command id, and commands keep flowing.

The registry and scoring agents run in ``loraplane streams run`` without its planner; the
fake worker never applies a command (a 10-minute deadline keeps them pending, so nothing is
retried under a new id for a reason of its own).
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplane.kernel.bus import read_topic
from loraplane.kernel.config import Settings
from loraplane.schemas.codec import decode
from loraplane.schemas.planner_memory import PlannerMemory
from tests.integration.planner_env import PlannerEnv
from tests.integration.registry_env import LORAPLANE, wait_for

pytestmark = pytest.mark.integration
TAKEOVER_LIMIT_S = 10.0
AGENTS = ("loraplane.streams.registry_agent", "loraplane.streams.scoring_agent")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Planner:
    """One ``loraplane streams planner`` process with its metrics port and log."""

    def __init__(self, env: PlannerEnv, name: str) -> None:
        self.port = free_port()
        self.log = env.home / f"{name}.log"
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                [LORAPLANE, "streams", "planner", "--metrics-port", str(self.port)],
                env=env.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def active(self) -> bool | None:
        """loraplane_planner_active as served (None: not served yet)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=1) as r:
                text = r.read().decode()
        except OSError:
            return None
        found = re.search(r"^loraplane_planner_active\{[^}]*\} (\S+)$", text, re.M)
        return None if found is None else float(found.group(1)) == 1.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def env(stack: Settings, tmp_path: Path) -> Iterator[PlannerEnv]:
    e = PlannerEnv.create(
        stack, tmp_path, command_deadline_s=600, cold_loads_per_minute_per_worker=100
    )
    try:
        e.start(AGENTS)
        yield e
    finally:
        e.stop()
        e.delete_topics()


def uid(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


def test_sigkill_of_the_active_planner_under_load_hands_over_within_10_s(env: PlannerEnv) -> None:
    base = uid("b-ha")
    recs = [env.publish(uid(f"a{i}"), base) for i in range(6)]
    env.wait_registered(*((r, "active") for r in recs))
    worker = uid("w")
    env.heartbeat(worker, base, slots=16)
    planners = [Planner(env, "planner-1"), Planner(env, "planner-2")]
    stop_load = threading.Event()
    try:
        wait_for(
            lambda: True if all(p.active() is not None for p in planners) else None,
            "both planners to serve loraplane_planner_active",
            timeout_s=90,
        )
        active = wait_for(
            lambda: next((p for p in planners if p.active()), None),
            "one planner to take the lease",
            timeout_s=60,
        )
        assert [p.active() for p in planners].count(True) == 1
        standby = next(p for p in planners if p is not active)

        def load() -> None:  # request logs for the first adapters, all along
            while not stop_load.is_set():
                for r in recs[:3]:
                    env.requests(r, 3)
                stop_load.wait(0.3)

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        env.requests(recs[0], 10)
        env.requests(recs[1], 10)
        env.wait_commands(
            base,
            lambda c: {recs[0].lora_name, recs[1].lora_name} <= {x.lora_name for x in c},
            "loads planned by the first active",
        )
        env.requests(recs[2], 10)
        time.sleep(1.0)
        before = env.commands(base)

        active.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        active.proc.wait(10)
        wait_for(
            lambda: True if standby.active() else None, "the standby to take over", timeout_s=30
        )
        takeover_s = time.monotonic() - killed
        print(f"\nplanner takeover after SIGKILL: {takeover_s:.2f} s")
        assert takeover_s < TAKEOVER_LIMIT_S

        # Commands keep flowing: adapters first requested after the kill are loaded.
        for r in recs[3:]:
            env.requests(r, 10)
        env.wait_commands(
            base,
            lambda c: {r.lora_name for r in recs[3:]} <= {x.lora_name for x in c},
            "loads planned by the new active",
            timeout_s=60,
        )
        stop_load.set()
        loader.join(10)
        time.sleep(1.0)
        after = env.commands(base)
    finally:
        stop_load.set()
        for p in planners:
            p.stop()

    ids: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for c in after:
        ids[(c.worker_id, c.lora_name, c.action.value)].add(c.command_id)
    # Nothing re-decided: one command id per (worker, lora_name, action), resends included.
    assert {k: v for k, v in ids.items() if len(v) > 1} == {}
    assert {c.command_id for c in before} <= {c.command_id for c in after}
    # The memory on the topic knows every command that went out, under the same id.
    memory: dict[str, PlannerMemory] = {}
    for record in read_topic(env.settings, env.topic("planner-memory"), timeout_s=20, to_end=True):
        if record.value is not None:
            memory[(record.key or b"").decode()] = decode(PlannerMemory, record.value)
    pending = {
        (c.worker_id, c.lora_name, c.action.value): c.command_id
        for m in memory.values()
        for c in m.pending
    }
    assert {k: {v} for k, v in pending.items() if k[0] == worker} == dict(ids)
    assert memory[worker].seq >= len(ids)
