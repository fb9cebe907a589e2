"""The planner and the workers' reconcile agree (tests/unit/fleet_loop.py runs the real pure
planner and the real pure reconcile together, with commands and heartbeats in flight):
over random fleets, slot pressure, requests reaching workers without a copy, registry
changes and worker restarts, the planner

* issues no command a worker refuses by a rule the planner knows (a move down of a copy it
  protects or that is pinned), except one already on its way when a registry change made
  its copy never-evict (no heartbeat could have told the planner);
* sends no load that finds no slot, except when a request's own load took the slot first
  (a restart may have adopted that copy since) or a move down sent with it to free the
  slot was refused by such a registry change;
* never issues the same command again while an earlier one is within its deadline and not
  shown done;
* never undoes a load within ``min_residency_s`` but for a revoke, a version no longer
  serving, a ``demote_when`` condition or a never-evict version's load.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.kernel.policy import Policy
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Priority
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.reasons import CommandRule
from loraplane.schemas.worker_state import CopyOrigin, LoadedAdapter, WorkerState
from loraplane.streams.planner import Plan, WorkerMemory, command_id, plan, still_pending
from loraplane.streams.scores import score_key
from tests.unit import fleet_loop
from tests.unit.fleet_loop import REFUSALS, SLOT_RACES, Loop, SimWorker
from tests.unit.test_planner import NOW, POLICY, busy, record, scores, views, worker

RATES = (0.0, 0.01, 0.1, 0.5, 2.0, 5.0, 15.0)


@st.composite
def fleets(draw: st.DrawFn) -> Loop:
    policy = Policy(
        min_residency_s=draw(st.sampled_from([0.0, 30.0, 180.0])),
        demand_admission_tau_s=draw(st.sampled_from([0.0, 600.0])),
        max_protected_gpu_share=draw(st.sampled_from([0.25, 0.5, 1.0])),
        gpu_slots_per_base_model=draw(st.sampled_from([2, 4, 64])),
    )
    priorities = st.sampled_from(
        [Priority.bronze, Priority.silver, Priority.gold, Priority.platinum]
    )
    records = [
        fleet_loop.record(f"a{i}", priority=draw(priorities))
        for i in range(draw(st.integers(2, 12)))
    ]
    if draw(st.booleans()):
        records.append(
            fleet_loop.record("a0", version="2", status=AdapterStatus.canary, canary=10.0)
        )
    workers = [
        SimWorker(f"w{i}", draw(st.integers(1, 5)), policy) for i in range(draw(st.integers(1, 4)))
    ]
    rng = random.Random(draw(st.integers(0, 2**32)))
    loop = Loop(records, workers, policy, rng)
    loop.qps = {r.lora_name: rng.choice(RATES) for r in records}
    return loop


def run(loop: Loop, seconds: int) -> None:
    """``seconds`` of traffic with demand shifts, worker restarts and registry changes."""
    rng = loop.rng
    for _ in range(seconds):
        if rng.random() < 0.03:
            loop.qps[rng.choice(loop.records).lora_name] = rng.choice(RATES)
        if rng.random() < 0.01:
            w = rng.choice(loop.workers)
            if w.up:
                loop.stop(w, rng.choice([2.0, 8.0, 20.0]))
        if rng.random() < 0.01:
            loop.change_registry(
                rng.randrange(len(loop.records)),
                rng.choice(["priority", "priority", "promote", "revoke"]),
            )
        loop.step(requests=rng.randint(0, 8))


def assert_agreement(loop: Loop) -> None:
    """No refusal, no slot race, no repeat and no load undone too soon but those excused."""
    refused = [
        (c, why) for c, why in loop.skipped if why in REFUSALS and c not in loop.registry_races
    ]
    assert refused == []
    no_slot = [(c, why) for c, why in loop.skipped if why in SLOT_RACES and c not in loop.races]
    assert no_slot == []
    assert loop.repeated == []
    assert loop.undone_too_soon() == []
    assert loop.issued  # the fleet was planned for


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets())
def test_the_planner_and_the_workers_agree(loop: Loop) -> None:
    run(loop, 240)
    assert_agreement(loop)


def test_a_load_counting_on_a_move_down_refused_by_a_registry_race_is_excused() -> None:
    """The planner unpins and demotes ``a2`` on w1 to free the slot for a load of ``a1`` sent
    with them; a registry change while they are on their way makes ``a2`` never-evict there,
    so w1 refuses them (a registry race) and the load finds no free slot. That load fails
    with the refused move, by the same race, not by a planner and worker disagreement."""
    policy = Policy(
        min_residency_s=0.0,
        demand_admission_tau_s=0.0,
        max_protected_gpu_share=1.0,
        gpu_slots_per_base_model=2,
    )
    priorities = (Priority.platinum, Priority.bronze, Priority.platinum, Priority.bronze)
    records = [fleet_loop.record(f"a{i}", priority=p) for i, p in enumerate(priorities)]
    workers = [SimWorker(w, slots, policy) for w, slots in (("w0", 2), ("w1", 1), ("w2", 1))]
    rng = random.Random(702)
    loop = Loop(records, workers, policy, rng)
    loop.qps = {r.lora_name: rng.choice(RATES) for r in records}
    run(loop, 240)
    assert_agreement(loop)


def test_a_load_whose_slot_a_request_took_before_a_restart_is_excused() -> None:
    """One worker of one slot. The planner sends it a canary's load with a demote to free
    the slot; before they arrive a request loads a platinum version into that slot and the
    worker restarts, adopting the copy (its origin is no longer the request's). The load
    finds no free slot because the request took it, as when no restart came between."""
    policy = Policy(
        min_residency_s=0.0,
        demand_admission_tau_s=0.0,
        max_protected_gpu_share=0.25,
        gpu_slots_per_base_model=2,
    )
    priorities = [Priority.platinum if i == 2 else Priority.bronze for i in range(7)]
    records = [fleet_loop.record(f"a{i}", priority=p) for i, p in enumerate(priorities)]
    records.append(fleet_loop.record("a0", version="2", status=AdapterStatus.canary, canary=10.0))
    rng = random.Random(5)
    loop = Loop(records, [SimWorker("w0", 1, policy)], policy, rng)
    loop.qps = {r.lora_name: rng.choice(RATES) for r in records}
    run(loop, 240)
    assert_agreement(loop)


def test_a_worker_restart_under_slot_pressure_ends_in_agreement() -> None:
    """The live run's shape: two workers of four slots, more versions in demand than slots, a
    platinum one and a canary, requests sometimes reaching a worker without a copy; one worker
    restarts for 20 s in the middle. No refusal, no repeat, no load undone within residency,
    and the restarted worker is planned for again."""
    policy = Policy()
    new = fleet_loop.record
    records = [
        new("support-en", priority=Priority.gold),
        new("support-de", priority=Priority.gold),
        new("support-de", version="2", status=AdapterStatus.canary, canary=10.0),
        new("contracts", priority=Priority.platinum),
        *(new(f"a{i}", priority=Priority.silver) for i in range(6)),
    ]
    loop = Loop(
        records, [SimWorker("w1", 4, policy), SimWorker("w2", 4, policy)], policy, random.Random(29)
    )
    loop.qps = dict(
        zip(
            (r.lora_name for r in records),
            (5.5, 2.7, 0.3, 1.8, 1.4, 1.1, 0.9, 0.7, 0.3, 0.1),
            strict=True,
        )
    )
    run_for = 600
    for t in range(run_for):
        if t == run_for // 2:
            loop.stop(loop.workers[0], 20.0)
        loop.step(requests=15)
    assert [why for c, why in loop.skipped if why in REFUSALS] == []
    assert [c for c, why in loop.skipped if why in SLOT_RACES and c not in loop.races] == []
    assert loop.repeated == []
    assert loop.undone_too_soon() == []
    restart = loop.now - run_for // 2
    after = [
        c
        for c in loop.issued
        if c.worker_id == "w1"
        and c.issued_at.timestamp() > restart + 20
        and c.action is CommandAction.load_gpu
    ]
    assert loop.workers[0].up and (after or loop.workers[0].gpu)


# ---- the pieces, one at a time ----------------------------------------------------------


def command(
    r: AdapterRecord, action: CommandAction, seq: int, at: float, worker: str = "w1"
) -> CacheCommand:
    issued = datetime.fromtimestamp(at, UTC)
    return CacheCommand(
        command_id=command_id(worker, action.value, r.lora_name, seq),
        worker_id=worker,
        action=action,
        base_model=r.base_model,
        tenant_id=r.tenant_id,
        adapter_id=r.adapter_id,
        version=r.version,
        sha256=r.sha256,
        lora_name=r.lora_name,
        reason=CommandReason(rule=CommandRule.hot_score),
        issued_at=issued,
        deadline=issued + timedelta(seconds=60),
    )


def test_a_command_shown_while_an_earlier_one_on_its_copy_waits_is_not_issued_again() -> None:
    """The planner loaded ``idle`` on w1 and then demoted it (idle for an hour: demote_when);
    the worker has not loaded it yet (its load budget), so its state shows the copy on the
    host tier: the demote shows, the load does not. Both stay expected (the worker applies
    them in order), so the demote is not issued again every tick until the load's deadline."""
    idle, busy_one = record("idle"), record("busy")
    load, demote = (
        command(idle, CommandAction.load_gpu, 1, NOW - 10),
        command(idle, CommandAction.demote_to_host, 2, NOW - 5),
    )
    memory = {"w1": WorkerMemory(seq=2, pending=(load, demote))}
    states = [worker("w1", gpu=[busy_one], host=[idle], slots=2)]
    sc = {**scores(busy=1.0), score_key("idle", "1"): busy(1.0, last=NOW - 3 * 3600)}
    p = plan(views(idle, busy_one), sc, states, POLICY, NOW, memory)
    assert [c for c in p.commands if c.lora_name == idle.lora_name] == []
    assert p.memory["w1"].pending == (load, demote)
    assert still_pending([load, demote], {}, NOW) == [load, demote]
    shown = {idle.lora_name: states[0].adapters[-1]}
    assert still_pending([demote], shown, NOW) == []  # alone, a shown command is done


def test_a_demote_carried_out_and_undone_by_a_request_frees_no_slot() -> None:
    """The planner demoted ``a`` while an older load of it still waited to be shown; the
    worker demoted it, then a request loaded it again. Its state shows ``a`` on the GPU,
    loaded after the demote was issued: the demote is done, not expected, so the planner
    does not count a free slot there and sends no load the worker would refuse."""
    a, b, c = record("a"), record("b"), record("c")
    load = command(a, CommandAction.load_gpu, 1, NOW - 40)
    demote = command(a, CommandAction.demote_to_host, 2, NOW - 8)
    state = worker("w1", gpu=[a, b], slots=2)
    reloaded = [
        x.model_copy(update={"loaded_at": datetime.fromtimestamp(NOW - 1, UTC)})
        if x.lora_name == a.lora_name
        else x
        for x in state.adapters
    ]
    state = state.model_copy(update={"adapters": reloaded})
    shown = {x.lora_name: x for x in state.adapters}
    assert still_pending([load, demote], shown, NOW) == []
    p = plan(
        views(a, b, c),
        scores(a=1.0, b=1.0, c=3.0),
        [state],
        POLICY.model_copy(update={"min_residency_s": 30.0}),
        NOW,
        {"w1": WorkerMemory(seq=2, pending=(load, demote))},
    )
    assert [x for x in p.commands if x.action is CommandAction.load_gpu] == []


def test_a_command_the_worker_will_not_carry_out_is_no_longer_expected_nor_sent_again() -> None:
    """w1 reports the load it skipped (no slot it may take, say) in ``skipped_commands``: the
    planner stops expecting the copy there at once, keeps the command to its deadline, and
    sends the load to w2 instead of to w1 again."""
    a = record("a")
    load = command(a, CommandAction.load_gpu, 1, NOW - 5)
    w1 = worker("w1", slots=2).model_copy(update={"skipped_commands": [load.command_id]})
    p = plan(
        views(a),
        scores(a=1.0),
        [w1, worker("w2", slots=1)],
        POLICY,
        NOW,
        {"w1": WorkerMemory(seq=1, pending=(load,))},
    )
    assert [(c.action, c.worker_id) for c in p.commands if c.lora_name == a.lora_name] == [
        (CommandAction.load_gpu, "w2")
    ]
    assert p.memory["w1"].pending == (load,)  # not sent again before its deadline
    p = plan(
        views(a), scores(a=1.0), [w1], POLICY, NOW, {"w1": WorkerMemory(seq=1, pending=(load,))}
    )
    assert not gpu_moves(p) and [w.lora_name for w in p.waiting] == [a.lora_name]


def at(state: WorkerState, loaded: dict[str, float]) -> WorkerState:
    """``state`` with its GPU copies' ``loaded_at`` (epoch s, by adapter id)."""
    return state.model_copy(
        update={
            "adapters": [
                a.model_copy(
                    update={"loaded_at": datetime.fromtimestamp(loaded[a.adapter_id], UTC)}
                )
                if a.adapter_id in loaded
                else a
                for a in state.adapters
            ]
        }
    )


def test_a_load_is_not_undone_within_the_minimum_residency() -> None:
    """A hotter version does not take the slot of a copy loaded 60 s ago (it waits, reason
    min_residency), nor is the copy the surplus replica; past ``min_residency_s`` it is; a
    platinum (never-evict, protected) version's load may take it at once."""
    cold, hot = record("cold"), record("hot")
    full = worker("w1", gpu=[cold], slots=1)
    recent = at(full, {"cold": NOW - 60})
    p = plan(views(cold, hot), scores(cold=0.01, hot=5.0), [recent], POLICY, NOW)
    assert not gpu_moves(p) and [(w.lora_name, w.reason) for w in p.waiting] == [
        (hot.lora_name, "min_residency")
    ]
    p = plan(
        views(cold, hot), scores(cold=0.01, hot=5.0), [at(full, {"cold": NOW - 181})], POLICY, NOW
    )
    assert gpu_moves(p) == [
        (CommandAction.demote_to_host, cold.lora_name),
        (CommandAction.load_gpu, hot.lora_name),
    ]
    plat = record("plat", priority=Priority.platinum)
    p = plan(views(cold, plat), scores(cold=0.01, plat=5.0), [recent], POLICY, NOW)
    assert gpu_moves(p) == [
        (CommandAction.demote_to_host, cold.lora_name),
        (CommandAction.load_gpu, plat.lora_name),
    ]
    twice = [at(worker(w, gpu=[hot], slots=1), {"hot": NOW - 60}) for w in ("w1", "w2")]
    assert not gpu_moves(plan(views(hot), scores(hot=1.0), twice, POLICY, NOW))
    twice = [at(s, {"hot": NOW - 200}) for s in twice]
    assert gpu_moves(plan(views(hot), scores(hot=1.0), twice, POLICY, NOW)) == [
        (CommandAction.demote_to_host, hot.lora_name)
    ]


def gpu_moves(p: Plan) -> list[tuple[CommandAction, str]]:
    """The plan's loads and unloads of GPU copies, in order."""
    return [
        (c.action, c.lora_name)
        for c in p.commands
        if c.action in (CommandAction.load_gpu, CommandAction.demote_to_host)
    ]


def test_a_demote_sent_after_a_load_still_on_its_way_stays_expected() -> None:
    """The planner loaded ``a`` on w1 and demoted it a second later, both on their way; the
    load landed after the demote was issued, so w1's state shows ``a`` on the GPU, loaded by
    the planner after the demote's issue time. That copy is the earlier load's doing: the
    demote is still on its way, kept, and not issued again (it was, every tick, by a
    random example of the test above). A request's load, or a load issued after the
    demote, would have undone it instead."""
    a = record("a")
    load = command(a, CommandAction.load_gpu, 1, NOW - 3)
    demote = command(a, CommandAction.demote_to_host, 2, NOW - 2)
    state = worker("w1", gpu=[a], slots=2)

    def copy(origin: CopyOrigin) -> dict[str, LoadedAdapter]:
        at = datetime.fromtimestamp(NOW - 1, UTC)
        return {
            x.lora_name: x.model_copy(update={"loaded_at": at, "origin": origin})
            for x in state.adapters
        }

    assert still_pending([load, demote], copy(CopyOrigin.planner), NOW) == [demote]
    assert still_pending([load, demote], copy(CopyOrigin.gateway_request), NOW) == []
    again = command(a, CommandAction.load_gpu, 3, NOW - 1.5)
    assert still_pending([load, demote, again], copy(CopyOrigin.planner), NOW) == []
