"""The planner as a pure function on hand-built registry, scores and worker states."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from loraplane.kernel.command_effects import never_evict_rule, protected_cap, protected_copies
from loraplane.kernel.decayed import Decayed
from loraplane.kernel.policy import SEED_FORMULA, Policy
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Compatibility, Priority, Release
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.commands import CacheCommand, CommandAction
from loraplane.schemas.planner_memory import PlannerMemory
from loraplane.schemas.reasons import VllmFailure
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.worker_state import LoadedAdapter, WorkerState
from loraplane.streams.planner import Plan, WorkerMemory, plan
from loraplane.streams.scores import TAU_1M_S, TAU_10M_S, ScoreState, score_key

NOW = 1_800_000_000.0
POLICY = Policy(hot_score_formula=SEED_FORMULA, max_protected_gpu_share=0.5)
PREWARM = CommandAction.prewarm_host
"""The seed's policy (its hot score, half the slots protected): the rules below are written
against its numbers; the defaults differ (test_protected_cap_is_a_share_of_the_hot_set...)."""
MB = 1024**2


def record(
    adapter: str,
    version: str = "1",
    status: AdapterStatus = AdapterStatus.active,
    priority: Priority = Priority.silver,
    canary: float = 0.0,
    size: int = 10 * MB,
    base: str = "llama",
) -> AdapterRecord:
    sha = (adapter.encode().hex() + version.replace(".", "") + "0" * 64)[:64]
    return AdapterRecord(
        adapter_id=adapter,
        base_model=base,
        version=version,
        rank=8,
        artifact_uri=f"s3://loraplane-artifacts/{adapter}/",
        sha256=sha,
        size_bytes=size,
        status=status,
        tenant_id=f"t-{adapter}",
        priority=priority,
        compatibility=Compatibility(target_modules=["q_proj"], max_lora_rank=64),
        release=Release(canary_percent=canary),
    )


def views(*records: AdapterRecord) -> list[AdapterView]:
    by: dict[str, list[AdapterRecord]] = {}
    for r in records:
        by.setdefault(r.adapter_id, []).append(r)
    return [
        AdapterView(
            adapter_id=a,
            tenant_id=rs[0].tenant_id,
            base_model=rs[0].base_model,
            active_version=next((r.version for r in rs if r.status is AdapterStatus.active), None),
            versions=rs,
            last_seq=1,
            last_event_id="e1",
            updated_at=datetime.fromtimestamp(NOW, UTC),
        )
        for a, rs in by.items()
    ]


def worker(
    wid: str,
    gpu: list[AdapterRecord] = (),
    host: list[AdapterRecord] = (),
    slots: int = 8,
    pinned: set[str] = frozenset(),
    hbm: float | None = 0.5,
    host_budget: int = 10_000 * MB,
    base: str = "llama",
    protected: set[str] = frozenset(),
) -> WorkerState:
    """``pinned``, ``protected``: adapter ids (``protected``: held never-evict by the
    worker's own rule, as it reports it)."""
    loaded = [
        LoadedAdapter(
            lora_name=r.lora_name,
            adapter_id=r.adapter_id,
            version=r.version,
            tenant_id=r.tenant_id,
            tier=tier,
            size_bytes=r.size_bytes,
            pinned=r.adapter_id in pinned,
            protected=tier == "gpu" and r.adapter_id in protected,
        )
        for tier, rs in (("gpu", gpu), ("host", host))
        for r in rs
    ]
    return WorkerState(
        worker_id=wid,
        base_model=base,
        ts=datetime.fromtimestamp(NOW, UTC),
        gpu_slots_used=len(gpu),
        gpu_slots_total=slots,
        host_bytes_used=sum(r.size_bytes for r in (*gpu, *host)),
        host_bytes_budget=host_budget,
        hbm_usage=hbm,
        max_lora_rank=64,
        adapters=loaded,
    )


def busy(qps: float, last: float = NOW) -> ScoreState:
    """The steady state of ``qps`` requests/s up to ``last``."""
    return ScoreState(
        requests_10m=Decayed(TAU_10M_S, qps * TAU_10M_S, last),
        requests_1m=Decayed(TAU_1M_S, qps * TAU_1M_S, last),
        last_request=last,
    )


def scores(**qps: float) -> dict[str, ScoreState]:
    return {score_key(a.replace("_", "-"), "1"): busy(q) for a, q in qps.items()}


def cmds(p: Plan, action: CommandAction | None = None) -> list[CacheCommand]:
    return [c for c in p.commands if action is None or c.action is action]


def test_cold_adapter_with_demand_is_loaded_on_the_emptiest_worker() -> None:
    a = record("a")
    p = plan(views(a), scores(a=0.5), [worker("w1", gpu=[record("x")]), worker("w2")], POLICY, NOW)
    (load,) = cmds(p, CommandAction.load_gpu)
    assert (load.worker_id, load.lora_name, load.reason.rule) == ("w2", a.lora_name, "hot_score")
    assert load.reason.score and load.reason.score > 0
    assert (load.deadline - load.issued_at).total_seconds() == POLICY.command_deadline_s
    assert p.gpu[a.lora_name] == ("w2",)


def test_no_needless_moves_and_no_demand_no_load() -> None:
    a, b = record("a"), record("b")
    p = plan(views(a, b), scores(a=0.5), [worker("w1"), worker("w2", gpu=[a])], POLICY, NOW)
    assert p.commands == []  # a stays on w2; b has no demand and is not loaded


def test_platinum_and_active_canary_survive_slot_pressure_and_are_pinned() -> None:
    plat = record("plat", priority=Priority.platinum)
    can = record("can", version="2", status=AdapterStatus.canary, canary=10)
    low = record("low")
    hot = [record(f"hot{i}") for i in range(3)]
    ws = [worker("w1", gpu=[plat, can, low], slots=3)]
    p = plan(views(plat, can, low, *hot), scores(hot0=5, hot1=5, hot2=5, low=0.01), ws, POLICY, NOW)
    unloaded = {
        c.lora_name
        for c in p.commands
        if c.action in (CommandAction.demote_to_host, CommandAction.evict)
    }
    assert unloaded == {low.lora_name}
    assert {c.lora_name for c in cmds(p, CommandAction.pin)} == {plat.lora_name, can.lora_name}
    assert len(cmds(p, CommandAction.load_gpu)) == 1


def test_idle_adapter_is_demoted_and_erroring_adapter_too() -> None:
    idle, bad, fine = record("idle"), record("bad"), record("fine")
    erroring = busy(1.0)
    erroring = ScoreState(
        **{
            **vars(erroring),
            "served_after_load": Decayed(TAU_10M_S, 100, NOW),
            "errors_after_load": Decayed(TAU_10M_S, 5, NOW),
        }
    )
    sc = {
        score_key("idle", "1"): busy(1.0, last=NOW - 61 * 60),
        score_key("bad", "1"): erroring,
        score_key("fine", "1"): busy(1.0),
    }
    p = plan(views(idle, bad, fine), sc, [worker("w1", gpu=[idle, bad, fine])], POLICY, NOW)
    demoted = {c.lora_name: c.reason.detail for c in cmds(p, CommandAction.demote_to_host)}
    assert set(demoted) == {idle.lora_name, bad.lora_name}
    assert "no_request_for_minutes" in demoted[idle.lora_name]
    assert "error_rate_after_load" in demoted[bad.lora_name]


def test_cold_load_budget_per_worker_per_minute_in_score_order() -> None:
    rs = [record(f"a{i:02d}") for i in range(20)]
    sc = {score_key(r.adapter_id, "1"): busy(0.05 * (i + 1)) for i, r in enumerate(rs)}
    ws = [worker("w1", slots=64)]
    p1 = plan(views(*rs), sc, ws, POLICY, NOW)
    loads = cmds(p1, CommandAction.load_gpu)
    assert len(loads) == POLICY.cold_loads_per_minute_per_worker
    assert [c.adapter_id for c in loads] == [r.adapter_id for r in reversed(rs)][:6]
    assert [c.reason.score for c in loads] == sorted((c.reason.score for c in loads), reverse=True)
    assert {w.reason for w in p1.waiting} == {"cold_load_budget"} and len(p1.waiting) == 14
    # 30 s later nothing more may load; 61 s later the next six, still in score order.
    p2 = plan(views(*rs), sc, ws, POLICY, NOW + 30, memory=p1.memory)
    assert cmds(p2, CommandAction.load_gpu) == []
    loaded = [r for r in rs if r.adapter_id in {c.adapter_id for c in loads}]
    p3 = plan(
        views(*rs), sc, [worker("w1", gpu=loaded, slots=64)], POLICY, NOW + 61, memory=p2.memory
    )
    assert [c.adapter_id for c in cmds(p3, CommandAction.load_gpu)] == [
        r.adapter_id for r in reversed(rs)
    ][6:12]


def test_a_worker_reporting_a_lower_load_budget_gets_fewer_loads_never_more() -> None:
    """A worker that measured its loads to be costly reports a lower ``cold_load_budget``
    (``policy.load_stall_share``): the planner sends it that many. Attack: a heartbeat that
    reports more than the policy allows (any writer of the worker-state topic could) still
    gets the policy's budget, not a flood of loads."""
    rs = [record(f"a{i:02d}") for i in range(20)]
    sc = {score_key(r.adapter_id, "1"): busy(0.05 * (i + 1)) for i, r in enumerate(rs)}
    for reported, sent in ((2, 2), (10_000, POLICY.cold_loads_per_minute_per_worker)):
        w = worker("w1", slots=64).model_copy(update={"cold_load_budget": reported})
        p = plan(views(*rs), sc, [w], POLICY, NOW)
        assert len(cmds(p, CommandAction.load_gpu)) == sent


def test_hysteresis_margin_prevents_swaps_between_close_scores() -> None:
    resident, close, far = record("resident"), record("close"), record("far")
    policy = Policy(gpu_slots_per_base_model=1)
    base = busy(0.2)
    p = plan(
        views(resident, close),
        {score_key("resident", "1"): base, score_key("close", "1"): busy(0.25)},
        [worker("w1", gpu=[resident], slots=1)],
        policy,
        NOW,
    )
    assert cmds(p, CommandAction.load_gpu) == []
    p = plan(
        views(resident, far),
        {score_key("resident", "1"): base, score_key("far", "1"): busy(1.0)},
        [worker("w1", gpu=[resident], slots=1)],
        policy,
        NOW,
    )
    assert [(c.action, c.adapter_id) for c in p.commands] == [
        (CommandAction.demote_to_host, "resident"),
        (CommandAction.load_gpu, "far"),
    ]
    assert p.commands[0].reason.rule == "slot_needed"


def test_hbm_above_watermark_demotes_lowest_and_takes_no_loads() -> None:
    lo, hi, new = record("lo"), record("hi"), record("new")
    ws = [worker("w1", gpu=[lo, hi], hbm=0.95), worker("w2", hbm=0.5)]
    p = plan(views(lo, hi, new), scores(lo=0.1, hi=1.0, new=0.5), ws, POLICY, NOW)
    assert [(c.action, c.worker_id, c.adapter_id) for c in p.commands] == [
        (CommandAction.load_gpu, "w2", "new"),
        (CommandAction.demote_to_host, "w1", "lo"),
    ]
    again = plan(
        views(lo, hi, new), scores(lo=0.1, hi=1.0, new=0.5), ws, POLICY, NOW + 1, memory=p.memory
    )
    # w1 demotes nothing more while its demote is pending; lo moves to the worker with room.
    assert [(c.action, c.worker_id, c.adapter_id) for c in again.commands] == [
        (CommandAction.load_gpu, "w2", "lo")
    ]


def test_between_the_hbm_watermarks_a_worker_gets_no_loads_and_sheds_nothing() -> None:
    """Above the low watermark nothing is added (here, or by the worker's requests); only
    above the high one is a copy shed. With one watermark for both, a copy shed at one tick
    was loaded back by the next request and shed again, a cold load lost each time."""
    lo, hi, new = record("lo"), record("hi"), record("new")
    ws = [worker("w1", gpu=[lo, hi], hbm=0.86), worker("w2", hbm=0.5)]
    assert POLICY.hbm_low_watermark < 0.86 < POLICY.hbm_high_watermark
    p = plan(views(lo, hi, new), scores(lo=0.1, hi=1.0, new=0.5), ws, POLICY, NOW)
    assert [(c.action, c.worker_id, c.adapter_id) for c in p.commands] == [
        (CommandAction.load_gpu, "w2", "new"),
    ]


@pytest.mark.parametrize("why", list(VllmFailure))
def test_a_worker_whose_state_says_not_run_gets_no_load(why: VllmFailure) -> None:
    """A worker whose gateway refuses every request as not run (vLLM hung, another base
    model) carries out no load: neither a hot-set load into its free slots, a displacing
    one, nor an extra copy goes there; they go to a worker that serves."""
    lo, hot, new = record("lo"), record("hot"), record("new")
    down = worker("w1", gpu=[lo], slots=4).model_copy(update={"not_run": why})
    ws = [down, worker("w2", gpu=[hot], slots=4)]
    p = plan(views(lo, hot, new), scores(lo=0.1, hot=9.0, new=0.5), ws, POLICY, NOW)
    loads = cmds(p, CommandAction.load_gpu)
    assert loads and all(c.worker_id == "w2" for c in loads)
    # alone and full: no copy is displaced there for a load it would not carry out
    full = worker("w1", gpu=[lo], slots=1).model_copy(update={"not_run": why})
    only = plan(views(lo, new), scores(lo=0.1, new=5.0), [full], POLICY, NOW)
    assert not cmds(only, CommandAction.load_gpu)
    assert not cmds(only, CommandAction.demote_to_host)
    assert [w.lora_name for w in only.waiting] == [new.lora_name]


def test_a_hot_version_held_only_by_a_not_run_worker_is_loaded_on_one_that_serves() -> None:
    """A copy on a worker whose gateway refuses every request serves nothing: it does not
    keep its version off the GPUs that serve, nor count as one of its replicas."""
    hot, busy_ = record("hot"), record("busy")
    down = worker("w1", gpu=[hot, busy_], slots=4).model_copy(
        update={"not_run": VllmFailure.vllm_timeout}
    )
    ws = [down, worker("w2", gpu=[busy_], slots=4)]
    p = plan(views(hot, busy_), scores(hot=0.5, busy=0.5), ws, POLICY, NOW)
    assert [(c.action, c.worker_id, c.adapter_id) for c in cmds(p, CommandAction.load_gpu)] == [
        (CommandAction.load_gpu, "w2", "hot")
    ]
    assert not cmds(p, CommandAction.demote_to_host)  # busy's one serving copy stays


def test_a_not_run_worker_s_slots_are_no_capacity_for_the_hot_set() -> None:
    """The hot set's size (and the GPU-copy budget) is the slots of the workers that serve:
    a not_run worker's 4 made it 8, so the 4 low versions on the one serving worker were
    "hot" too, never displaced, and the 4 best versions (held only where nothing serves)
    waited for good. They displace the low ones there."""
    best = [record(f"best{i}") for i in range(4)]
    low = [record(f"low{i}") for i in range(4)]
    down = worker("w1", gpu=best, slots=4).model_copy(update={"not_run": VllmFailure.vllm_timeout})
    ws = [down, worker("w2", gpu=low, slots=4)]
    qps = {**{f"best{i}": 9.0 for i in range(4)}, **{f"low{i}": 0.1 for i in range(4)}}
    p = plan(views(*best, *low), scores(**qps), ws, POLICY, NOW)
    loads = cmds(p, CommandAction.load_gpu)
    assert {(c.worker_id, c.adapter_id) for c in loads} == {("w2", r.adapter_id) for r in best}
    assert {c.lora_name for c in cmds(p, CommandAction.demote_to_host)} == {
        r.lora_name for r in low
    }
    assert p.waiting == []
    # no worker serves: the hot set is what their slots would hold, and it waits for them
    alone = plan(views(*best, *low), scores(**qps), [down], POLICY, NOW)
    assert not cmds(alone, CommandAction.load_gpu)
    assert {(w.lora_name, w.reason) for w in alone.waiting} == {
        (r.lora_name, "worker_not_run") for r in best
    }


def test_a_not_run_worker_s_protected_copies_do_not_raise_the_protected_cap() -> None:
    """The protected cap is a share of the serving slots (0.5 of 4: 2). Copies a worker
    holds protected keep their place over the cap, but a not_run worker's serve nothing:
    its 4 protected platinum copies raised the cap to 4, and all 4 versions were loaded
    and pinned on the one serving worker, displacing its two hot ones."""
    plats = [record(f"plat{i}", priority=Priority.platinum) for i in range(4)]
    hot = [record(f"hot{i}") for i in range(2)]
    ids = {r.adapter_id for r in plats}
    down = worker("w1", gpu=plats, slots=4, pinned=ids, protected=ids).model_copy(
        update={"not_run": VllmFailure.vllm_timeout}
    )
    ws = [down, worker("w2", gpu=hot, slots=4)]
    demand = scores(plat0=0.05, plat1=0.04, plat2=0.02, plat3=0.01, hot0=5, hot1=5)
    p = plan(views(*plats, *hot), demand, ws, POLICY, NOW)
    loaded = {c.adapter_id for c in cmds(p, CommandAction.load_gpu) if c.worker_id == "w2"}
    assert loaded == {"plat0", "plat1"}
    assert not cmds(p, CommandAction.demote_to_host) and not cmds(p, CommandAction.evict)


def test_a_version_on_a_not_run_worker_only_is_prewarmed_on_one_that_serves() -> None:
    """Rule 9 prewarms wanted versions held nowhere on a host tier. A GPU copy on a
    not_run worker is nowhere a request can use, and such a worker is no place to
    prewarm: the version goes to the host tier of the worker that serves."""
    top = [record(f"top{i}") for i in range(2)]
    spare = record("spare")
    down = worker("w1", gpu=[spare], slots=1).model_copy(
        update={"not_run": VllmFailure.vllm_timeout}
    )
    ws = [down, worker("w2", gpu=top, slots=2)]
    p = plan(views(*top, spare), scores(top0=9, top1=9, spare=1), ws, POLICY, NOW)
    prewarms = cmds(p, CommandAction.prewarm_host)
    assert [(c.worker_id, c.adapter_id) for c in prewarms] == [("w2", "spare")]


@pytest.mark.parametrize("why", list(VllmFailure))
def test_a_version_only_a_not_run_worker_could_take_waits_for_that_reason(
    why: VllmFailure,
) -> None:
    """A version that waits because the only worker fitting its rank, or the only free
    slot, is on a worker whose state says not_run waits as ``worker_not_run``: it read
    ``cold_load_budget`` (free slots and budget there) though no budget blocks it."""
    big = record("big").model_copy(update={"rank": 16})
    down = worker("w1", slots=4).model_copy(update={"not_run": why})
    small = worker("w2", slots=4).model_copy(update={"max_lora_rank": 8})
    p = plan(views(big), scores(big=1.0), [down, small], POLICY, NOW)
    assert not cmds(p, CommandAction.load_gpu)  # a host prewarm may go to w1
    assert [(w.lora_name, w.reason) for w in p.waiting] == [(big.lora_name, "worker_not_run")]
    # a serving worker fits rank 16 but is full of a hotter one: the free slots are w1's
    top = record("top").model_copy(update={"rank": 16})
    wide = worker("w3", gpu=[top], slots=1).model_copy(update={"max_lora_rank": 16})
    p = plan(views(big, top), scores(big=1.0, top=9.0), [down, small, wide], POLICY, NOW)
    assert not cmds(p, CommandAction.load_gpu) and not cmds(p, CommandAction.demote_to_host)
    assert [(w.lora_name, w.reason) for w in p.waiting] == [(big.lora_name, "worker_not_run")]
    # no worker fits the rank at all, not_run or not: the reason stays its own
    p = plan(views(big), scores(big=1.0), [small], POLICY, NOW)
    assert [w.reason for w in p.waiting] == ["no_worker_fits_rank"]


def test_the_high_hbm_watermark_is_never_below_the_low_one() -> None:
    with pytest.raises(ValidationError, match="hbm_high_watermark must not be below"):
        Policy(hbm_low_watermark=0.9, hbm_high_watermark=0.85)
    assert Policy(hbm_low_watermark=0.9, hbm_high_watermark=0.9).hbm_high_watermark == 0.9


def test_canary_is_prewarmed_with_warmup_requests_before_traffic() -> None:
    stable = record("a", "1")
    canary = record("a", "2", status=AdapterStatus.canary, canary=0)
    p = plan(views(stable, canary), {}, [worker("w1")], POLICY, NOW)
    (load,) = cmds(p, CommandAction.load_gpu)
    assert load.lora_name == canary.lora_name
    assert load.warmup_requests == POLICY.request_budgets.canary.warmup_requests


def test_revoke_evicts_everywhere_outside_any_budget() -> None:
    bad = record("bad", status=AdapterStatus.revoked)
    rs = [record(f"a{i}") for i in range(6)]
    ws = [worker("w1", gpu=[bad]), worker("w2", host=[bad])]
    p1 = plan(
        views(bad, *rs),
        {score_key(r.adapter_id, "1"): busy(1) for r in rs},
        ws,
        Policy(cold_loads_per_minute_per_worker=3),
        NOW,
    )
    evicts = {(c.worker_id, c.reason.rule) for c in cmds(p1, CommandAction.evict)}
    assert evicts == {("w1", "revoke"), ("w2", "revoke")}
    assert bad.lora_name not in p1.gpu and bad.lora_name not in p1.host


def test_replanning_with_memory_issues_nothing_twice_and_ids_are_deterministic() -> None:
    a, b = record("a"), record("b")
    ws = [worker("w1")]
    p1 = plan(views(a, b), scores(a=1, b=1), ws, POLICY, NOW)
    assert len(p1.commands) == 2
    assert plan(views(a, b), scores(a=1, b=1), ws, POLICY, NOW).commands == p1.commands
    restored = {
        k: WorkerMemory.of(decode(PlannerMemory, encode(v.record()))) for k, v in p1.memory.items()
    }
    assert plan(views(a, b), scores(a=1, b=1), ws, POLICY, NOW + 5, restored).commands == []
    # The worker now shows a loaded; b's command expired: b is re-issued under a new id.
    later = NOW + POLICY.command_deadline_s + 1
    p3 = plan(views(a, b), scores(a=1, b=1), [worker("w1", gpu=[a])], POLICY, later, restored)
    (again,) = p3.commands
    assert again.adapter_id == "b"
    assert again.command_id not in {c.command_id for c in p1.commands}
    assert p3.memory["w1"].pending == (again,)


def test_waiting_adapters_are_prewarmed_on_host_within_byte_budget() -> None:
    big = record("big", size=900 * MB)
    small = record("small", size=50 * MB)
    resident = [record(f"r{i}") for i in range(2)]
    ws = [worker("w1", gpu=resident, slots=2, host_budget=100 * MB)]
    p = plan(
        views(big, small, *resident), scores(big=0.001, small=0.001, r0=1, r1=1), ws, POLICY, NOW
    )
    assert [(c.action, c.adapter_id) for c in p.commands] == [(CommandAction.prewarm_host, "small")]


def test_a_worker_has_at_most_its_bound_of_prewarms_in_flight_the_rest_follow() -> None:
    """Rule 9 gives a worker no more prewarms than ``host_prewarms_in_flight_per_worker``
    pending: the next ones, in rank order, go out as its state shows the first ones."""
    resident = [record(f"r{i}") for i in range(2)]
    waiting = [record(f"h{i}") for i in range(5)]
    policy = POLICY.model_copy(update={"host_prewarms_in_flight_per_worker": 2})
    demand = scores(r0=1, r1=1, **{f"h{i}": 0.5 - 0.01 * i for i in range(5)})
    ws = [worker("w1", gpu=resident, slots=2)]
    p1 = plan(views(*resident, *waiting), demand, ws, policy, NOW)
    assert [(c.action, c.adapter_id) for c in p1.commands] == [
        (CommandAction.prewarm_host, "h0"),
        (CommandAction.prewarm_host, "h1"),
    ]
    # Still pending: nothing more.
    p2 = plan(views(*resident, *waiting), demand, ws, policy, NOW + 1, p1.memory)
    assert p2.commands == []
    # The worker shows h0 on its host tier: one more goes out.
    ws = [worker("w1", gpu=resident, host=waiting[:1], slots=2)]
    p3 = plan(views(*resident, *waiting), demand, ws, policy, NOW + 2, p2.memory)
    assert [(c.action, c.adapter_id) for c in p3.commands] == [(CommandAction.prewarm_host, "h2")]


def test_protected_versions_over_the_share_are_unpinned_and_compete_by_score() -> None:
    # 4 platinum versions pinned on 4 slots; max_protected_gpu_share 0.5 protects 2 (the
    # worker too: the first two it was asked for)
    plats = [record(f"plat{i}", priority=Priority.platinum) for i in range(4)]
    hot = [record(f"hot{i}") for i in range(2)]
    ws = [
        worker(
            "w1",
            gpu=plats,
            slots=4,
            pinned={r.adapter_id for r in plats},
            protected={"plat0", "plat1"},
        )
    ]
    p = plan(
        views(*plats, *hot),
        scores(plat0=0.05, plat1=0.04, plat2=0.02, plat3=0.01, hot0=5, hot1=5),
        ws,
        POLICY,
        NOW,
    )
    over = {plats[2].lora_name, plats[3].lora_name}
    unpins = cmds(p, CommandAction.unpin)
    assert {c.lora_name for c in unpins} == over
    assert {c.reason.rule for c in unpins} == {"protected_over_capacity"}
    assert all("max_protected_gpu_share 0.5" in c.reason.detail for c in unpins)
    # The hot unprotected adapters take the over-capacity slots; each unpin comes first,
    # since a worker refuses to unload a pinned copy.
    demotes = cmds(p, CommandAction.demote_to_host)
    assert {c.lora_name for c in demotes} == over
    assert {c.reason.rule for c in demotes} == {"slot_needed"}
    order = [(c.action, c.lora_name) for c in p.commands]
    for lora in over:
        assert order.index((CommandAction.unpin, lora)) < order.index(
            (CommandAction.demote_to_host, lora)
        )
    assert {c.lora_name for c in cmds(p, CommandAction.load_gpu)} == {r.lora_name for r in hot}
    assert not cmds(p, CommandAction.pin)
    assert set(p.gpu) == {plats[0].lora_name, plats[1].lora_name, *(r.lora_name for r in hot)}


def test_copies_a_worker_holds_protected_keep_their_place_even_over_the_cap() -> None:
    """A worker refuses every move down of a copy it reports ``protected`` (its own
    never-evict rule), so the planner ranks those first and never asks: here the worker
    protects the two least-used platinum versions; they stay, the busier platinum ones are
    the ones unprotected, and no unpin, demote or evict names a protected copy."""
    plats = [record(f"plat{i}", priority=Priority.platinum) for i in range(4)]
    hot = [record(f"hot{i}") for i in range(2)]
    w = worker("w1", gpu=plats, slots=4, pinned={r.adapter_id for r in plats})
    held = {plats[2].lora_name, plats[3].lora_name}
    w = w.model_copy(
        update={
            "adapters": [
                a.model_copy(update={"protected": a.lora_name in held}) for a in w.adapters
            ]
        }
    )
    p = plan(
        views(*plats, *hot),
        scores(plat0=0.05, plat1=0.04, plat2=0.02, plat3=0.01, hot0=5, hot1=5),
        [w],
        POLICY,
        NOW,
    )
    down = (CommandAction.unpin, CommandAction.demote_to_host, CommandAction.evict)
    assert not {c.lora_name for c in p.commands if c.action in down} & held
    assert {c.lora_name for c in cmds(p, CommandAction.unpin)} == {
        plats[0].lora_name,
        plats[1].lora_name,
    }
    assert held <= set(p.gpu)


def test_protected_cap_ties_go_by_lora_name_and_idle_over_cap_versions_are_demoted() -> None:
    policy = Policy(max_protected_gpu_share=0.25)  # 1 of 4 slots
    plats = [record(f"plat{i}", priority=Priority.platinum) for i in range(3)]
    p = plan(
        views(*plats), {}, [worker("w1", gpu=plats, slots=4, protected={"plat0"})], policy, NOW
    )
    kept = min(r.lora_name for r in plats)  # no demand: equal scores, and all idle
    assert [c.lora_name for c in cmds(p, CommandAction.pin)] == [kept]
    demoted = cmds(p, CommandAction.demote_to_host)
    assert {c.lora_name for c in demoted} == {r.lora_name for r in plats} - {kept}
    assert {c.reason.rule for c in demoted} == {"demote"}


def test_a_canary_keeps_its_protection_before_busier_platinum_versions() -> None:
    """Over the protected cap a canary is the last to lose protection: its share of the
    traffic is small by design (a low score), yet a cold start there is what the canary's
    warm-up exists to prevent (the simulator found canary cold starts on Azure traces when
    the cap went by score alone)."""
    policy = Policy(max_protected_gpu_share=0.5)  # 2 of 4 slots
    plats = [record(f"plat{i}", priority=Priority.platinum) for i in range(3)]
    canary = record(
        "plat0", "2", status=AdapterStatus.canary, priority=Priority.platinum, canary=10.0
    )
    busy_plats = scores(plat0=0.9, plat1=0.8, plat2=0.7)
    p = plan(
        views(*plats, canary),
        busy_plats,
        [worker("w1", gpu=[*plats, canary], slots=4)],
        policy,
        NOW,
    )
    pinned = {c.lora_name for c in cmds(p, CommandAction.pin)}
    assert canary.lora_name in pinned and len(pinned) == 2
    assert plats[0].lora_name in pinned  # the busiest platinum version takes the other place


def test_protected_cap_is_a_share_of_the_hot_set_rounded_up() -> None:
    assert protected_cap(Policy(), 16) == 4  # the default share, 0.25
    assert protected_cap(POLICY, 16) == 8  # the seed's, 0.5
    assert protected_cap(POLICY, 3) == 2
    assert protected_cap(Policy(max_protected_gpu_share=0.3), 10) == 3
    assert protected_cap(Policy(max_protected_gpu_share=0.01), 16) == 1
    assert protected_cap(Policy(), 0) == 1


# --- property: no plan exceeds any slot, byte or budget limit --------------------------------


def by_name(r: AdapterRecord) -> str:
    return r.lora_name


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list, dict, list, Policy, dict]:
    n = draw(st.integers(1, 25))
    statuses = st.sampled_from(
        [
            AdapterStatus.active,
            AdapterStatus.active,
            AdapterStatus.canary,
            AdapterStatus.retired,
            AdapterStatus.revoked,
        ]
    )
    recs = [
        record(
            f"a{i}",
            status=draw(statuses),
            priority=draw(st.sampled_from(Priority)),
            canary=draw(st.sampled_from([0, 5])),
            size=draw(st.integers(1, 200)) * MB,
        )
        for i in range(n)
    ]
    policy = Policy(
        gpu_slots_per_base_model=draw(st.integers(1, 12)),
        host_slots_per_base_model=draw(st.integers(1, 12)),
        cold_loads_per_minute_per_worker=draw(st.integers(1, 4)),
        host_prewarms_in_flight_per_worker=draw(st.integers(1, 4)),
    )
    sc = {
        score_key(r.adapter_id, "1"): busy(
            draw(st.floats(0, 3)), last=NOW - draw(st.sampled_from([0, 7200]))
        )
        for r in recs
        if draw(st.booleans())
    }
    ws = []
    placed: set[str] = set()
    for j in range(draw(st.integers(1, 4))):
        slots = draw(st.integers(0, 5))
        free = [r for r in recs if r.lora_name not in placed]
        gpu = (
            draw(st.lists(st.sampled_from(free), max_size=slots, unique_by=by_name)) if free else []
        )
        placed |= {r.lora_name for r in gpu}
        rest = [r for r in recs if r.lora_name not in placed]
        host = draw(st.lists(st.sampled_from(rest), max_size=3, unique_by=by_name)) if rest else []
        budget = sum(r.size_bytes for r in (*gpu, *host)) + draw(st.integers(0, 400)) * MB
        ws.append(
            worker(
                f"w{j}",
                gpu=gpu,
                host=host,
                slots=slots,
                host_budget=budget,
                hbm=draw(st.sampled_from([None, 0.5, 0.86, 0.95])),
            )
        )
    return recs, sc, ws, policy, {}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), st.integers(1, 4))
def test_no_plan_exceeds_any_slot_byte_or_budget_limit(fleet: tuple, ticks: int) -> None:
    recs, sc, ws, policy, memory = fleet
    loads: Counter[str] = Counter()
    gpu_before = {w.worker_id: sum(a.tier == "gpu" for a in w.adapters) for w in ws}
    host_before = len({a.lora_name for w in ws for a in w.adapters if a.tier == "host"})
    size = {r.lora_name: r.size_bytes for r in recs}
    issued: list[CacheCommand] = []
    for t in range(ticks):  # ticks within one minute: the budget spans them all
        p = plan(views(*recs), sc, ws, policy, NOW + 10 * t, memory=memory)
        memory = p.memory
        loads.update(c.worker_id for c in cmds(p, CommandAction.load_gpu))
        gpu_per_worker = Counter(w for ws_ in p.gpu.values() for w in ws_)
        for w in ws:
            assert loads[w.worker_id] <= policy.cold_loads_per_minute_per_worker
            assert gpu_per_worker[w.worker_id] <= max(w.gpu_slots_total, gpu_before[w.worker_id])
        assert len(p.gpu) <= max(policy.gpu_slots_per_base_model, sum(gpu_before.values()))
        assert len(p.host) <= max(policy.host_slots_per_base_model, host_before)
        for w in ws:  # the workers report nothing: every prewarm stays in flight
            prewarms = [c for c in p.memory[w.worker_id].pending if c.action is PREWARM]
            assert len(prewarms) <= policy.host_prewarms_in_flight_per_worker
        issued += p.commands
        for w in ws:  # host bytes only grow by prewarms that fit the budget
            mine = [c for c in issued if c.worker_id == w.worker_id]
            added = sum(size[c.lora_name] for c in mine if c.action is CommandAction.prewarm_host)
            freed = sum(size[c.lora_name] for c in mine if c.action is CommandAction.evict)
            assert added == 0 or w.host_bytes_used + added - freed <= w.host_bytes_budget
        revoked = {r.lora_name for r in recs if r.status is AdapterStatus.revoked}
        assert not revoked & (set(p.gpu) | set(p.host))


def as_reported(state: WorkerState, records: list[AdapterRecord], policy: Policy) -> WorkerState:
    """``state`` with the ``protected`` flags its worker reports: its own never-evict rule
    over its GPU copies in the order it holds them (``command_effects.protected_copies``)."""
    by_name = {r.lora_name: r for r in records}
    gpu = [a.lora_name for a in state.adapters if a.tier == "gpu"]
    never_evict = {n for n in gpu if never_evict_rule(by_name[n], policy.never_evict)}
    held = protected_copies((), gpu, never_evict, protected_cap(policy, state.gpu_slots_total))
    return state.model_copy(
        update={
            "adapters": [
                a.model_copy(update={"protected": a.lora_name in held}) for a in state.adapters
            ]
        }
    )


@st.composite
def pinned_fleets(draw: st.DrawFn) -> tuple[list, dict, list, Policy]:
    """``fleets`` with some GPU copies already pinned, a drawn protected share, and each
    worker reporting the copies it protects by its own rule."""
    recs, sc, ws, policy, _ = draw(fleets())
    share = draw(st.sampled_from([0.1, 0.25, 0.5, 1.0]))
    policy = policy.model_copy(update={"max_protected_gpu_share": share})
    ws = [
        as_reported(
            w.model_copy(
                update={
                    "adapters": [
                        a.model_copy(update={"pinned": a.tier == "gpu" and draw(st.booleans())})
                        for a in w.adapters
                    ]
                }
            ),
            recs,
            policy,
        )
        for w in ws
    ]
    return recs, sc, ws, policy


def test_a_pending_pin_the_worker_may_hold_keeps_the_cap_when_ranks_change() -> None:
    """Two canaries, one protected slot: the first tick pins the busier one. When the other
    becomes busier before the worker reports, the planner does not pin it as well: the
    worker may protect the first by its own rule, so an unpin would not be carried out."""
    recs = [record(f"c{i}", status=AdapterStatus.canary, canary=5) for i in range(2)]
    ws = [worker("w0", slots=2, hbm=None)]
    policy = Policy(gpu_slots_per_base_model=2, max_protected_gpu_share=0.1)
    first = plan(views(*recs), scores(c1=0.5), ws, policy, NOW)
    assert [c.lora_name for c in first.commands if c.action is CommandAction.pin] == [
        recs[1].lora_name
    ]
    second = plan(views(*recs), scores(c0=5.0), ws, policy, NOW + 10, memory=first.memory)
    assert not [c for c in second.commands if c.action is CommandAction.pin]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pinned_fleets(), st.integers(1, 3))
def test_pinned_versions_never_exceed_the_protected_cap(fleet: tuple, ticks: int) -> None:
    """Beyond the versions the workers hold protected themselves (which no command may
    unpin), the planner keeps no more pinned than its cap."""
    recs, sc, ws, policy = fleet
    slots = min(policy.gpu_slots_per_base_model, sum(w.gpu_slots_total for w in ws))
    held = {a.lora_name for w in ws for a in w.adapters if a.protected}
    pinned = {(w.worker_id, a.lora_name) for w in ws for a in w.adapters if a.pinned}
    memory: dict[str, WorkerMemory] = {}
    for t in range(ticks):
        p = plan(views(*recs), sc, ws, policy, NOW + 10 * t, memory=memory)
        memory = p.memory
        for c in p.commands:
            key = (c.worker_id, c.lora_name)
            if c.action is CommandAction.pin:
                pinned.add(key)
            elif c.action is CommandAction.unpin:
                pinned.discard(key)
            elif c.action in (CommandAction.demote_to_host, CommandAction.evict):
                assert key not in pinned  # a worker refuses to unload a pinned copy
        assert len({lora for _, lora in pinned}) <= max(protected_cap(policy, slots), len(held))
