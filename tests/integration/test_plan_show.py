"""``loraplane plan show`` on the real broker: it plans what the topics hold (a verified
registry view, scores folded by the real scoring keeper from real request logs, a worker
heartbeat) with the planner's own tick, prints the load with its rule and score, and writes
nothing: no command, memory, decision, audit record or dead letter. No Faust worker: the
registry view is written signed, as the registry agent would (the keyring verifies it);
the scoring keeper runs in a thread of the test. About 15 s."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplane.kernel.bus import produce_sync, read_topic
from loraplane.kernel.config import Settings
from loraplane.schemas.adapter import AdapterStatus
from loraplane.schemas.base import now_utc
from loraplane.streams.score_keeper import ScoreKeeper, restore
from loraplane.streams.scores import score_key
from tests.integration.planner_env import PlannerEnv
from tests.integration.registry_env import LORAPLANE, wait_for
from tests.lifecycle_kit import record, signed_view

pytestmark = pytest.mark.integration
WRITTEN_BY_A_PLANNER = ("commands", "planner-memory", "decisions", "audit", "dead-letters")


@pytest.fixture
def env(stack: Settings, tmp_path: Path) -> Iterator[PlannerEnv]:
    with PlannerEnv.create(stack, tmp_path).owned() as e:
        yield e


def plan_show(env: PlannerEnv, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LORAPLANE, "plan", "show", *args],
        env={**env.env, **extra_env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_plan_show_lists_the_load_with_its_rule_and_writes_nothing(env: PlannerEnv) -> None:
    base, worker = f"b-show-{uuid.uuid4().hex[:6]}", f"w-{uuid.uuid4().hex[:6]}"
    hot = record(f"hot-{uuid.uuid4().hex[:6]}", "1", base=base).model_copy(
        update={"status": AdapterStatus.active}
    )
    view = signed_view(env.kit.keys["ops"], [hot], now_utc(), env.kit.keyring)
    produce_sync(env.settings, env.topic("registry"), hot.adapter_id, view)
    stop = threading.Event()
    keeper = threading.Thread(
        target=ScoreKeeper(env.settings, "show").run, args=(stop,), daemon=True
    )
    keeper.start()
    try:
        env.requests(hot, 5)
        key = score_key(hot.adapter_id, hot.version)
        wait_for(lambda: True if key in restore(env.settings) else None, "the score", 60)
    finally:
        stop.set()
        keeper.join(30)
    env.heartbeat(worker, base)

    shown = plan_show(env, "--base-model", base, "--json")
    assert shown.returncode == 0, shown.stderr[-2000:]
    out = json.loads(shown.stdout)
    assert out["inputs"] | {"refused_views": None} == {
        "adapters": 1,
        "score_keys": 1,
        "workers": 1,
        "live_workers": 1,
        "serving_workers": 1,
        "memory_workers": 0,
        "pending_commands": 0,
        "refused_views": None,
    }
    (load,) = out["commands"]
    assert (load["worker_id"], load["action"], load["lora_name"], load["rule"]) == (
        worker,
        "load_gpu",
        hot.lora_name,
        "hot_score",
    )
    assert load["score"] > 0
    assert (
        list(
            read_topic(
                env.settings,
                [env.topic(t) for t in WRITTEN_BY_A_PLANNER],
                timeout_s=20,
                to_end=True,
            )
        )
        == []
    )


def test_plan_show_without_a_broker_says_so_and_fails(env: PlannerEnv) -> None:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shown = plan_show(env, "--timeout-s", "2", LORAPLANE_KAFKA__PORT=str(port))
    assert shown.returncode == 2
    assert "error: cannot read the planner's topics" in shown.stderr
    assert shown.stdout == ""
