"""A warmed ``Planner`` (columns kept between ticks) decides exactly what a fresh ``plan``
decides on the same inputs, after any sequence of changes between ticks: registry views
replaced, added, removed or duplicated; score states replaced, added or deleted (in the
same dict or a copy, with the changed keys handed over or not); worker states changed,
added or removed; time advanced; schedules and memory carried over."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.kernel.decayed import Decayed
from loraplane.kernel.policy import Policy
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Priority
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.worker_state import WorkerState
from loraplane.streams.planner import Plan, Planner, WorkerMemory, plan
from loraplane.streams.scores import TAU_10M_S, ScoreState, score_key
from tests.unit.test_planner import MB, NOW, busy, record, views, worker

ADAPTERS = [f"a{i}" for i in range(8)]
BASES = ["llama", "mistral"]
POLICIES = [
    Policy(
        gpu_slots_per_base_model=3, host_slots_per_base_model=2, cold_loads_per_minute_per_worker=2
    ),
    Policy(
        gpu_slots_per_base_model=6,
        host_slots_per_base_model=6,
        max_protected_gpu_share=0.25,
        never_evict_when=['tenant_priority == "platinum"', 'request_class == "batch"'],
        demote_when=[
            "no_request_for_minutes > 1",
            "error_rate_after_load > 0.02",
            'request_class == "interactive" and canary_percent < 5',
        ],
        hot_score_formula="0.4 * qps_1m + 0.2 * qps_10m + 0.2 * ttft_penalty_if_cold"
        " + 0.1 * tenant_priority + 0.1 * scheduled_warmup_score",
    ),
]
STATUSES = [
    AdapterStatus.active,
    AdapterStatus.canary,
    AdapterStatus.retired,
    AdapterStatus.revoked,
]


@st.composite
def adapter_views(draw: st.DrawFn, adapter: str) -> AdapterView:
    """One adapter with 1-3 versions (at most one active), a drawn base and priority."""
    base = BASES[ADAPTERS.index(adapter) % 2]
    priority = draw(st.sampled_from(Priority))
    records = []
    for v in range(1, draw(st.integers(1, 3)) + 1):
        status = draw(st.sampled_from(STATUSES))
        if status is AdapterStatus.active and any(
            r.status is AdapterStatus.active for r in records
        ):
            status = AdapterStatus.retired
        records.append(
            record(
                adapter,
                version=str(v),
                status=status,
                priority=priority,
                canary=draw(st.sampled_from([0, 5])),
                base=base,
                size=draw(st.integers(1, 50)) * MB,
            )
        )
    (view,) = views(*records)
    return view


@st.composite
def score_states(draw: st.DrawFn, now: float) -> ScoreState:
    state = busy(
        draw(st.sampled_from([0.0, 0.01, 0.3, 1.0, 3.0])),
        last=now - draw(st.sampled_from([0, 30, 90, 4000])),
    )
    served = draw(st.sampled_from([0.0, 10.0, 50.0]))
    return replace(
        state,
        ttft_cold_ms=draw(st.sampled_from([None, 900.0])),
        ttft_hot_ms=draw(st.sampled_from([None, 100.0])),
        served_after_load=Decayed(TAU_10M_S, served, now - 10),
        errors_after_load=Decayed(TAU_10M_S, served * draw(st.sampled_from([0, 0.1])), now - 5),
        classes={
            c: Decayed(TAU_10M_S, draw(st.sampled_from([1.0, 4.0])), now)
            for c in draw(st.sets(st.sampled_from(["batch", "interactive"])))
        },
    )


def score_keys(registry: dict[str, AdapterView]) -> list[str]:
    return sorted(
        {score_key(a, None) for a in ADAPTERS}
        | {
            score_key(a, r.version)
            for a in ADAPTERS
            for r in (registry[a].versions if a in registry else [])
        }
        | {"ghost@1"}
    )


@st.composite
def fleet_states(
    draw: st.DrawFn, registry: dict[str, AdapterView], workers: dict[str, WorkerState], now: float
) -> dict[str, WorkerState]:
    """Some workers replaced (holding any versions, even unknown ones), added or removed."""
    known: list[AdapterRecord] = [r for v in registry.values() for r in v.versions]
    known.append(record("gone"))  # a version the registry does not hold
    out = dict(workers)
    for wid in draw(st.sets(st.sampled_from(["w0", "w1", "w2", "w3"]))):
        if draw(st.integers(0, 4)) == 0:
            out.pop(wid, None)
            continue
        base = BASES[int(wid[1]) % 2]
        mine = [r for r in known if r.base_model == base or r.adapter_id == "gone"]
        gpu = (
            draw(st.lists(st.sampled_from(mine), max_size=3, unique_by=lambda r: r.lora_name))
            if mine
            else []
        )
        rest = [r for r in mine if r not in gpu]
        host = (
            draw(st.lists(st.sampled_from(rest), max_size=2, unique_by=lambda r: r.lora_name))
            if rest
            else []
        )
        ws = worker(
            wid,
            gpu=gpu,
            host=host,
            slots=draw(st.integers(0, 4)),
            base=base,
            pinned=draw(st.sets(st.sampled_from(ADAPTERS))),
            hbm=draw(st.sampled_from([None, 0.5, 0.95])),
            host_budget=draw(st.integers(0, 200)) * MB,
        )
        out[wid] = ws
    return out


def redraw_registry(
    draw: st.DrawFn, registry: dict[str, AdapterView], most: int | None = None
) -> None:
    """Some adapters of ``registry`` (at most ``most``) removed or given a new view."""
    for adapter in draw(st.sets(st.sampled_from(ADAPTERS), max_size=most)):
        if adapter in registry and draw(st.booleans()):
            del registry[adapter]
        else:
            registry[adapter] = draw(adapter_views(adapter))


def redraw_scores(
    draw: st.DrawFn, scores: dict[str, ScoreState], registry: dict[str, AdapterView], now: float
) -> set[str]:
    """Some score states of ``scores`` replaced, added or deleted; their keys."""
    changed = draw(st.sets(st.sampled_from(score_keys(registry))))
    for key in changed:
        if key in scores and draw(st.integers(0, 4)) == 0:
            del scores[key]
        else:
            scores[key] = draw(score_states(now))
    return changed


def assert_same(warm: Plan, fresh: Plan) -> None:
    """The warmed planner's tick decided exactly what the fresh plan decided."""
    assert warm.commands == fresh.commands
    assert warm.waiting == fresh.waiting
    assert warm.memory == fresh.memory
    assert dict(warm.gpu) == dict(fresh.gpu) and dict(warm.host) == dict(fresh.host)
    assert dict(warm.scores) == dict(fresh.scores)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(2, 6))
def test_a_warmed_planner_plans_what_a_fresh_plan_plans(data: st.DataObject, ticks: int) -> None:
    draw = data.draw
    planner = Planner()
    registry: dict[str, AdapterView] = {}
    scores: dict[str, ScoreState] = {}
    workers: dict[str, WorkerState] = {}
    memory: dict[str, WorkerMemory] = {}
    now = NOW
    told = draw(st.booleans())  # the changed score keys handed over, as the runtime does
    for _ in range(ticks):
        redraw_registry(draw, registry)
        order = list(registry.values())
        if order and draw(st.integers(0, 5)) == 0:
            order.append(order[0])  # the same adapter twice: the last copy wins
        if draw(st.integers(0, 3)) == 0:  # a copy (the scoring agent's) or the same dict
            scores = dict(scores)
        changed = redraw_scores(draw, scores, registry, now)
        workers = draw(fleet_states(registry, workers, now))
        scheduled = {
            a: draw(st.sampled_from([0.5, 1.0]))
            for a in draw(st.sets(st.sampled_from(ADAPTERS), max_size=2))
        }
        fleet = list(workers.values())
        policy = draw(st.sampled_from(POLICIES))
        warm = planner.tick(
            order, scores, fleet, policy, now, memory, scheduled, changed if told else None
        )
        fresh = plan(order, scores, fleet, policy, now, memory, scheduled)
        assert_same(warm, fresh)
        memory = fresh.memory
        now += draw(st.sampled_from([0.0, 1.0, 30.0, 61.0, 3600.0]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(2, 8))
def test_a_planner_told_the_changed_score_keys_plans_what_a_fresh_plan_plans(
    data: st.DataObject, ticks: int
) -> None:
    """The steady tick's path: one registry, and between ticks only score states (replaced,
    added, deleted; the changed keys handed over as the runtime's score view does), worker
    states and time change. Every tick decides what a full recomputation decides."""
    draw = data.draw
    registry = {
        a: draw(adapter_views(a)) for a in draw(st.sets(st.sampled_from(ADAPTERS), min_size=1))
    }
    order = list(registry.values())
    policy = draw(st.sampled_from(POLICIES))
    planner = Planner()
    scores: dict[str, ScoreState] = {}
    workers: dict[str, WorkerState] = {}
    memory: dict[str, WorkerMemory] = {}
    now = NOW
    for _ in range(ticks):
        scores = dict(scores)  # a fresh copy each tick, as ScoreView.take hands over
        changed = redraw_scores(draw, scores, registry, now)
        workers = draw(fleet_states(registry, workers, now))
        fleet = list(workers.values())
        warm = planner.tick(order, scores, fleet, policy, now, memory, changed=changed)
        fresh = plan(order, scores, fleet, policy, now, memory)
        assert_same(warm, fresh)
        memory = fresh.memory
        now += draw(st.sampled_from([0.0, 1.0, 30.0, 61.0]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.integers(2, 8))
def test_a_planner_primed_while_standby_plans_what_a_fresh_plan_plans(
    data: st.DataObject, steps: int
) -> None:
    """The standby's path: the planner is primed (``Planner.prime``) as registry views and
    score states change, handed the keys changed since its last read as the runtime's
    score view does, and now and then ticks (a takeover, a lease lost and won again).
    Every tick decides what a fresh plan decides."""
    draw = data.draw
    planner = Planner()
    registry: dict[str, AdapterView] = {}
    scores: dict[str, ScoreState] = {}
    workers: dict[str, WorkerState] = {}
    memory: dict[str, WorkerMemory] = {}
    now = NOW
    policy = draw(st.sampled_from(POLICIES))
    since: set[str] | None = None  # keys changed since the planner's last read: unknown first
    for _ in range(steps):
        redraw_registry(draw, registry, most=2)
        order = list(registry.values())
        scores = dict(scores)
        changed = redraw_scores(draw, scores, registry, now)
        if since is not None:
            since |= changed
        if draw(st.booleans()):
            planner.prime(order, scores, since)
        else:
            workers = draw(fleet_states(registry, workers, now))
            fleet = list(workers.values())
            warm = planner.tick(order, scores, fleet, policy, now, memory, changed=since)
            fresh = plan(order, scores, fleet, policy, now, memory)
            assert_same(warm, fresh)
            memory = fresh.memory
        since = set()
        now += draw(st.sampled_from([0.0, 1.0, 30.0, 61.0]))
