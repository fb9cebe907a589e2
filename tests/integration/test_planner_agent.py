"""The planner on the real broker with the real Faust worker (``loraplane streams run``).

One worker process serves the module; each test plans its own base model, so the tests do
not see each other's adapters or fake workers. Time is controlled by the timestamps of the
request logs (an idle adapter's last request is two hours old) and by choosing the schedule's
cron peak near now. Commands are given a 10-minute deadline so that fake workers, which
never apply them, do not make the planner retry (and issue new ids) during the module.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from loraplane.kernel.config import Settings
from loraplane.schemas.adapter import Priority
from loraplane.schemas.base import now_utc
from loraplane.schemas.commands import CacheCommand, CommandAction
from tests.integration.planner_env import PlannerEnv

pytestmark = pytest.mark.integration
BUDGET = 6


def uid(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def env(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlannerEnv]:
    # half the slots protected: the slot-pressure test keeps two never-evict versions on
    # three slots (the default quarter protects one there, by design)
    e = PlannerEnv.create(
        stack,
        tmp_path_factory.mktemp("planner"),
        command_deadline_s=600,
        cold_loads_per_minute_per_worker=BUDGET,
        max_protected_gpu_share=0.5,
    )
    with e.run():
        yield e


def actions(cmds: list[CacheCommand]) -> set[tuple[str, str]]:
    return {(c.action.value, c.adapter_id) for c in cmds}


def test_burst_for_a_cold_adapter_yields_load_gpu(env: PlannerEnv) -> None:
    base = uid("b-burst")
    rec = env.publish(uid("cold"), base)
    env.wait_registered((rec, "active"))
    env.heartbeat(uid("w"), base)
    time.sleep(2)  # a tick with the worker known: nothing to load without demand
    assert env.commands(base) == []
    env.requests(rec, 5)
    (load,) = env.wait_commands(base, lambda c: len(c) > 0, "load_gpu for the burst")
    assert (load.action, load.lora_name) == (CommandAction.load_gpu, rec.lora_name)
    assert load.reason.rule == "hot_score" and load.reason.score > 0


def test_platinum_and_active_canary_are_never_evicted_under_slot_pressure(env: PlannerEnv) -> None:
    base = uid("b-press")
    plat = env.publish(uid("plat"), base, priority=Priority.platinum)
    stable_id = uid("stable")
    env.publish(stable_id, base)
    canary = env.publish(stable_id, base, version="2", canary=10)
    low = env.publish(uid("low"), base)
    hot = [env.publish(uid(f"hot{i}"), base) for i in range(3)]
    env.wait_registered(
        (plat, "active"), (canary, "canary"), (low, "active"), *((h, "active") for h in hot)
    )
    env.requests(low, 1)
    for h in hot:
        env.requests(h, 300)  # 0.5 qps over 10 min: beats low by more than the margin
    worker = uid("w")
    env.heartbeat(worker, base, gpu=[plat, canary, low], slots=3)
    cmds = env.wait_commands(
        base,
        lambda c: any(x.action is CommandAction.load_gpu for x in c),
        "a load under slot pressure",
    )
    time.sleep(3)  # a few more ticks: still nothing may touch plat or the canary
    cmds = env.commands(base)
    unloaded = {
        c.adapter_id
        for c in cmds
        if c.action in (CommandAction.demote_to_host, CommandAction.evict)
    }
    assert unloaded == {low.adapter_id}
    assert {c.lora_name for c in cmds if c.action is CommandAction.pin} == {
        plat.lora_name,
        canary.lora_name,
    }
    assert len([c for c in cmds if c.action is CommandAction.load_gpu]) == 1


def test_adapter_idle_past_the_demote_threshold_is_demoted(env: PlannerEnv) -> None:
    base = uid("b-idle")
    idle = env.publish(uid("idle"), base)
    env.wait_registered((idle, "active"))
    env.requests(idle, 3, ts=now_utc() - timedelta(hours=2))
    time.sleep(2)  # the scoring agent has folded the old requests in
    env.heartbeat(uid("w"), base, gpu=[idle])
    (cmd,) = env.wait_commands(base, lambda c: len(c) > 0, "the demote")
    assert (cmd.action, cmd.adapter_id, cmd.reason.rule) == (
        CommandAction.demote_to_host,
        idle.adapter_id,
        "demote",
    )
    assert "no_request_for_minutes" in cmd.reason.detail


def test_twenty_adapters_on_one_worker_load_within_budget_in_score_order(env: PlannerEnv) -> None:
    base = uid("b-budget")
    recs = [env.publish(uid(f"a{i:02d}"), base) for i in range(20)]
    env.wait_registered(*((r, "active") for r in recs))
    for i, r in enumerate(recs):  # more demand, higher score: a19 first
        env.requests(r, 2 * (i + 1))
    time.sleep(2)  # all demand is in the scores before the worker appears
    env.heartbeat(uid("w"), base, slots=64)
    env.wait_commands(base, lambda c: len(c) >= BUDGET, "the first loads")
    time.sleep(5)  # several more ticks inside the same minute
    loads = [c for c in env.commands(base) if c.action is CommandAction.load_gpu]
    assert [c.adapter_id for c in loads] == [r.adapter_id for r in reversed(recs)][:BUDGET]


def test_schedule_brings_its_adapter_to_gpu_before_the_peak(env: PlannerEnv) -> None:
    base = uid("b-sched")
    rec = env.publish(uid("sched"), base)
    env.wait_registered((rec, "active"))
    env.heartbeat(uid("w"), base)
    peak = (datetime.now(UTC) + timedelta(minutes=2)).replace(second=0, microsecond=0)
    (env.home / "schedules.yaml").write_text(
        f"schedules:\n  - cron: '{peak.minute} {peak.hour} * * *'\n"
        f"    adapter_id: '{rec.adapter_id}'\n    lead_minutes: 5\n    duration_minutes: 10\n"
    )
    (load,) = env.wait_commands(base, lambda c: len(c) > 0, "the scheduled load")
    assert (load.action, load.adapter_id) == (CommandAction.load_gpu, rec.adapter_id)
    assert load.issued_at < peak and "scheduled" in load.reason.detail


def test_sigkill_and_restart_keeps_state_and_reissues_nothing_under_new_ids(
    env: PlannerEnv,
) -> None:
    base = uid("b-restart")
    rec = env.publish(uid("kept"), base)
    fresh = env.publish(uid("fresh"), base)  # registered before the kill, requested after
    env.wait_registered((rec, "active"), (fresh, "active"))
    worker = uid("w")
    env.heartbeat(worker, base)
    env.requests(rec, 5)
    env.wait_commands(base, lambda c: len(c) > 0, "the load before the kill")
    time.sleep(2)  # let the memory's changelog land (it is flushed before any command)
    before = env.commands(base)
    assert env.worker is not None
    env.worker.send_signal(signal.SIGKILL)
    env.worker.wait(10)
    env.worker = None
    env.start()
    # The worker now shows the load applied: with the scores recovered the adapter is busy,
    # not idle, so nothing is demoted; with the memory recovered nothing is re-decided.
    env.heartbeat(worker, base, gpu=[rec])
    time.sleep(3)
    # The planner runs after the restart and still knows the registry (from its changelog).
    env.requests(fresh, 5)
    env.wait_commands(
        base,
        lambda c: fresh.lora_name in {x.lora_name for x in c},
        "a load planned after the restart",
    )
    after = env.commands()
    ids: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for c in after:
        ids[(c.worker_id, c.action.value, c.lora_name)].add(c.command_id)
    assert {k: v for k, v in ids.items() if len(v) > 1} == {}
    assert {c.command_id for c in after if c.base_model == base} == {
        c.command_id for c in before
    } | {c.command_id for c in after if c.lora_name == fresh.lora_name}
    assert actions([c for c in after if c.base_model == base]) == {
        ("load_gpu", rec.adapter_id),
        ("load_gpu", fresh.adapter_id),
    }
