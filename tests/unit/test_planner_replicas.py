"""Planner rules 5, 6, 8 and 9 on what a worker can hold: copies by demand (rule 6, with
hysteresis), rank fit (a version never goes to a worker whose max_lora_rank is below its
rank) and the HBM watermark."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.kernel.policy import Policy
from loraplane.schemas.adapter import AdapterRecord, Priority
from loraplane.schemas.commands import CommandAction
from loraplane.schemas.worker_state import WorkerState
from loraplane.streams.planner import Plan, plan, replica_targets
from loraplane.streams.scores import score_key
from tests.unit.test_planner import NOW, POLICY, busy, cmds, record, scores, views, worker

CAP, H = POLICY.worker_capacity_rps, POLICY.replica_hysteresis


def ranked(adapter: str, rank: int, **kw: object) -> AdapterRecord:
    return record(adapter, **kw).model_copy(update={"rank": rank})  # type: ignore[arg-type]


def fits(state: WorkerState, max_rank: int) -> WorkerState:
    return state.model_copy(update={"max_lora_rank": max_rank})


def moves(p: Plan, lora: str) -> list[tuple[str, str, str]]:
    return [(c.action.value, c.worker_id, c.reason.rule) for c in p.commands if c.lora_name == lora]


def test_ordinary_demand_keeps_one_copy() -> None:
    a = record("a")
    p = plan(
        views(a), scores(a=5.0), [worker("w1", gpu=[a]), worker("w2"), worker("w3")], POLICY, NOW
    )
    assert p.commands == [] and p.gpu[a.lora_name] == ("w1",)


def test_demand_over_capacity_adds_copies_on_other_workers_most_free_first() -> None:
    a = record("a")
    fleet = [worker("w1", gpu=[a]), worker("w2", slots=4), worker("w3"), worker("w4")]
    p = plan(views(a), scores(a=25.0), fleet, POLICY, NOW)  # ceil(25 / 10) = 3 copies
    assert moves(p, a.lora_name) == [
        ("load_gpu", "w3", "replica_demand"),
        ("load_gpu", "w4", "replica_demand"),
    ]
    assert sorted(p.gpu[a.lora_name]) == ["w1", "w3", "w4"]
    (first, _) = cmds(p, CommandAction.load_gpu)
    assert first.reason.detail.startswith("demand 25.00 req/s > 1 x 10.0 x (1 + 0.2)")


def test_a_cold_version_gets_its_first_copy_then_its_replicas_in_one_tick() -> None:
    a = record("a")
    p = plan(views(a), scores(a=100.0), [worker("w1"), worker("w2")], POLICY, NOW)
    assert moves(p, a.lora_name) == [
        ("load_gpu", "w1", "hot_score"),
        ("load_gpu", "w2", "replica_demand"),
    ]  # two workers: 2


def test_replicas_respect_the_cold_load_budget_and_the_copy_budget() -> None:
    a, b = record("a"), record("b")
    budget = Policy(cold_loads_per_minute_per_worker=1)
    p = plan(views(a), scores(a=100.0), [worker("w1"), worker("w2"), worker("w3")], budget, NOW)
    assert [w for _, w, _ in moves(p, a.lora_name)] == ["w1", "w2", "w3"]  # one load each
    again = plan(
        views(a),
        scores(a=100.0),
        [worker("w1"), worker("w2"), worker("w3")],
        budget,
        NOW + 1,
        p.memory,
    )
    assert again.commands == []  # nothing twice, every worker's budget spent
    two = Policy(gpu_slots_per_base_model=2)  # counts copies: b's first copy, one of a's
    p = plan(
        views(a, b), scores(a=100.0, b=1.0), [worker("w1"), worker("w2"), worker("w3")], two, NOW
    )
    assert sorted(p.gpu) == sorted([a.lora_name, b.lora_name])
    assert len(p.gpu[a.lora_name]) == 1 and len(p.gpu[b.lora_name]) == 1


def test_hysteresis_no_change_inside_the_band_one_copy_fewer_below_it() -> None:
    a = record("a")
    fleet = [worker("w1", gpu=[a]), worker("w2", gpu=[a]), worker("w3")]
    for qps in (CAP * (1 - H) + 0.01, CAP * 1.5, 2 * CAP * (1 + H) - 0.01):  # band of n = 2
        assert plan(views(a), scores(a=qps), fleet, POLICY, NOW).commands == [], qps
    p = plan(views(a), scores(a=CAP * (1 - H) - 0.01), fleet, POLICY, NOW)
    assert moves(p, a.lora_name) == [("demote_to_host", "w2", "replica_surplus")]
    p = plan(views(a), scores(a=0.1), fleet, POLICY, NOW)
    assert p.gpu[a.lora_name] == ("w1",)  # never below one copy
    p = plan(views(a), scores(a=2 * CAP * (1 + H) + 0.01), fleet, POLICY, NOW)
    assert moves(p, a.lora_name) == [("load_gpu", "w3", "replica_demand")]


def test_a_pinned_surplus_copy_is_unpinned_first_and_the_pinned_copy_kept() -> None:
    """``plat`` is protected by the planner, but no worker holds its copy protected: each
    protects another platinum version, which fills its own cap (one of its two slots at
    share 0.34); w4's empty slots raise the planner's cap to all four versions."""
    policy = Policy(max_protected_gpu_share=0.34)
    plat = record("plat", priority=Priority.platinum)
    own = [record(f"own{i}", priority=Priority.platinum) for i in range(3)]
    fleet = [
        worker(
            f"w{i + 1}",
            gpu=[own[i], plat],
            slots=2,
            protected={own[i].adapter_id},
            pinned={own[i].adapter_id, *(("plat",) if i < 2 else ())},
        )
        for i in range(3)
    ] + [worker("w4", slots=4)]
    p = plan(views(plat, *own), scores(plat=0.5), fleet, policy, NOW)
    # w3's copy is not pinned: the pinned ones are kept longest; one copy per tick
    assert moves(p, plat.lora_name) == [("demote_to_host", "w3", "replica_surplus")]
    p = plan(views(plat, *own), scores(plat=0.5), [*fleet[:2], fleet[3]], policy, NOW)
    assert moves(p, plat.lora_name) == [
        ("unpin", "w2", "replica_surplus"),
        ("demote_to_host", "w2", "replica_surplus"),
    ]


def test_a_copy_the_worker_may_protect_is_never_the_surplus() -> None:
    """Each worker protects the never-evict copies it holds up to its own cap, in the order it
    was asked for them: one that reports room under its cap may hold any never-evict copy
    protected by the time a command arrives, so no copy of such a version there is given
    back; here only w3's own copy is known to be unprotected."""
    plat = record("plat", priority=Priority.platinum)
    other = record("other", priority=Priority.platinum)
    fleet = [
        worker("w1", gpu=[plat], slots=2),
        worker("w2", gpu=[plat], slots=2),
        worker("w3", gpu=[other, plat], slots=2, protected={"other"}),
    ]

    def surplus(p: Plan) -> list[tuple[str, str, str]]:
        return [m for m in moves(p, plat.lora_name) if m[2] == "replica_surplus"]

    p = plan(views(plat, other), scores(plat=0.5), fleet, POLICY, NOW)
    assert surplus(p) == [("demote_to_host", "w3", "replica_surplus")]
    assert surplus(plan(views(plat, other), scores(plat=0.5), fleet[:2], POLICY, NOW)) == []


def test_extra_copies_are_the_first_to_go_when_a_slot_is_needed() -> None:
    x, b, c, low = record("x"), record("b"), record("c"), record("low")
    fleet = [worker("w1", gpu=[x, low], slots=2), worker("w2", gpu=[x], slots=1)]
    p = plan(
        views(x, b, c, low),
        scores(x=15.0, b=5.0, c=4.0, low=0.01),
        fleet,
        Policy(gpu_slots_per_base_model=3),
        NOW,
    )  # hot set x, b, c; 3 copies at most
    demotes = cmds(p, CommandAction.demote_to_host)
    assert [(d.lora_name, d.worker_id) for d in demotes] == [
        (x.lora_name, "w2"),
        (low.lora_name, "w1"),
    ]
    assert demotes[0].reason.detail.startswith("an extra copy, for ")
    assert {c.lora_name: c.worker_id for c in cmds(p, CommandAction.load_gpu)} == {
        b.lora_name: "w2",
        c.lora_name: "w1",
    }
    assert p.gpu[x.lora_name] == ("w1",)  # x wants 2 copies: no slot left, it keeps one


def test_a_rank_16_adapter_never_goes_to_a_rank_8_worker() -> None:
    a = ranked("a", 16)
    small, big = fits(worker("w1", slots=8), 8), fits(worker("w2", slots=2), 16)
    p = plan(views(a), scores(a=1.0), [small, big], POLICY, NOW)
    assert moves(p, a.lora_name) == [("load_gpu", "w2", "hot_score")]
    p = plan(views(a), scores(a=1.0), [small], POLICY, NOW)
    assert p.commands == []
    assert [(w.lora_name, w.reason) for w in p.waiting] == [(a.lora_name, "no_worker_fits_rank")]
    # replicas too: at 100 req/s, one copy per worker that fits
    p = plan(views(a), scores(a=100.0), [small, big, fits(worker("w3"), 32)], POLICY, NOW)
    assert sorted(p.gpu[a.lora_name]) == ["w2", "w3"]


def test_a_displacement_happens_only_on_a_worker_that_fits() -> None:
    a, lo8, lo16 = ranked("a", 16), record("lo8"), record("lo16")
    fleet = [fits(worker("w1", gpu=[lo8], slots=1), 8), fits(worker("w2", gpu=[lo16], slots=1), 16)]
    p = plan(
        views(a, lo8, lo16),
        scores(a=5.0, lo8=0.01, lo16=0.5),
        fleet,
        Policy(gpu_slots_per_base_model=1),
        NOW,
    )  # lo8 ranks lower, but w1 cannot hold a
    assert [(c.action.value, c.lora_name, c.worker_id) for c in p.commands] == [
        ("demote_to_host", lo16.lora_name, "w2"),
        ("load_gpu", a.lora_name, "w2"),
    ]
    # a rank-8 version behind it still gets w1's slot from lo8 (the heap kept the entry)
    b = record("b")
    p = plan(
        views(a, b, lo8, lo16),
        scores(a=5.0, b=4.0, lo8=0.01, lo16=0.5),
        fleet,
        Policy(gpu_slots_per_base_model=2),
        NOW,
    )
    assert {c.lora_name: c.worker_id for c in cmds(p, CommandAction.load_gpu)} == {
        a.lora_name: "w2",
        b.lora_name: "w1",
    }


def test_a_host_prewarm_goes_only_to_a_worker_that_fits() -> None:
    a, b = record("a"), ranked("b", 16)
    roomy = fits(worker("w1", host_budget=10_000 * 1024**2), 8)
    tight = fits(worker("w2", gpu=[a], slots=1, host_budget=100 * 1024**2), 16)
    p = plan(
        views(a, b), scores(a=5.0, b=1.0), [roomy, tight], Policy(gpu_slots_per_base_model=1), NOW
    )
    assert moves(p, b.lora_name) == [("prewarm_host", "w2", "host_tier")]
    p = plan(
        views(a, b),
        scores(a=5.0, b=1.0),
        [roomy, fits(tight, 8)],
        Policy(gpu_slots_per_base_model=1),
        NOW,
    )
    assert moves(p, b.lora_name) == []


def test_a_worker_above_the_watermark_gets_no_loads_and_sheds_its_lowest_copy() -> None:
    hi, lo, a = record("hi"), record("lo"), record("a")
    full = worker("w1", gpu=[hi, lo], slots=8, hbm=0.95)  # 6 free slots, but above 0.9
    p = plan(
        views(hi, lo, a),
        scores(hi=5.0, lo=0.5, a=2.0),
        [full, worker("w2", slots=4, hbm=0.5)],
        POLICY,
        NOW,
    )
    assert moves(p, a.lora_name) == [("load_gpu", "w2", "hot_score")]
    assert moves(p, lo.lora_name) == [("demote_to_host", "w1", "hbm_watermark")]
    assert moves(p, hi.lora_name) == []
    (shed,) = cmds(p, CommandAction.demote_to_host)
    assert shed.reason.detail == "hbm_usage 0.95 > 0.9"
    p = plan(
        views(a), scores(a=100.0), [worker("w1", gpu=[a]), worker("w2", hbm=0.83)], POLICY, NOW
    )
    assert p.commands == []  # no replica on a worker above the watermark either


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 64), st.floats(0, 200), st.floats(0.5, 50), st.floats(0, 0.9), st.integers(0, 8)
)
def test_replica_targets_stay_in_bounds_and_keep_the_band(
    copies: int, demand: float, cap: float, h: float, most: int
) -> None:
    policy = Policy(worker_capacity_rps=cap, replica_hysteresis=h)

    def target(n: int) -> int:
        return int(replica_targets(np.array([n]), np.array([demand]), policy, np.array([most]))[0])

    n, want = max(copies, 1), target(copies)
    assert 1 <= want <= max(1, most)
    if (n - 1) * cap * (1 - h) <= demand <= n * cap * (1 + h) and n <= most:
        assert want == n  # inside the band: no change
    if demand > n * cap * (1 + h):
        assert want == max(1, min(most, math.ceil(demand / cap)))
        assert target(want) == want  # where it went up to is inside its own band
    if n <= most and demand < (n - 1) * cap * (1 - h):
        assert want == n - 1  # one copy fewer per tick


def _applied(p: Plan, states: list[WorkerState], records: list[AdapterRecord]) -> list[WorkerState]:
    """The fleet as it is once the plan's GPU placement happened."""
    by_name = {r.lora_name: r for r in records}
    out = []
    for s in states:
        gpu = [by_name[lora] for lora, holders in p.gpu.items() if s.worker_id in holders]
        out.append(
            fits(
                worker(s.worker_id, gpu=gpu, slots=s.gpu_slots_total, hbm=s.hbm_usage),
                s.max_lora_rank,
            )
        )
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(1, 4), st.sampled_from([8, 16, 64]), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    st.lists(st.tuples(st.floats(0.0, 80.0), st.sampled_from([8, 16])), min_size=1, max_size=4),
    st.integers(1, 12),
)
def test_replicas_never_exceed_fitting_workers_never_share_a_worker_and_do_not_flap(
    shape: list[tuple[int, int, bool]], demand: list[tuple[float, int]], budget: int
) -> None:
    records = [ranked(f"a{k}", rank) for k, (_, rank) in enumerate(demand)]
    by_worker = {
        f"w{i}": [
            r for k, r in enumerate(records) if held and (k + i) % 2 == 0 and r.rank <= max_rank
        ][:slots]
        for i, (slots, max_rank, held) in enumerate(shape)
    }
    states = [
        fits(worker(f"w{i}", gpu=by_worker[f"w{i}"], slots=slots), max_rank)
        for i, (slots, max_rank, _) in enumerate(shape)
    ]
    demand_of = {
        score_key(r.adapter_id, "1"): busy(q) for r, (q, _) in zip(records, demand, strict=True)
    }
    policy = Policy(gpu_slots_per_base_model=budget, cold_loads_per_minute_per_worker=50)
    p = plan(views(*records), demand_of, states, policy, NOW)
    rank_of = {s.worker_id: s.max_lora_rank for s in states}
    held = {(a.lora_name, s.worker_id) for s in states for a in s.adapters}
    for c in cmds(p, CommandAction.load_gpu):
        assert (c.lora_name, c.worker_id) not in held  # never a second copy on one worker
        assert rank_of[c.worker_id] >= next(r.rank for r in records if r.lora_name == c.lora_name)
    for r in records:
        holders = p.gpu.get(r.lora_name, ())
        assert len(set(holders)) == len(holders)
        assert len(holders) <= sum(1 for s in states if s.max_lora_rank >= r.rank)
    assert sum(map(len, p.gpu.values())) <= max(budget, sum(len(v) for v in by_worker.values()))
    # the fleet the plan leads to, at the same demand: no copy added then dropped, or back
    again = plan(views(*records), demand_of, _applied(p, states, records), policy, NOW + 1)
    for first, then in (
        ("replica_demand", "replica_surplus"),
        ("replica_surplus", "replica_demand"),
    ):
        moved = {c.lora_name for c in p.commands if c.reason.rule == first}
        assert not [c for c in again.commands if c.reason.rule == then and c.lora_name in moved]
