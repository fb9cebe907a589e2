"""The pure reconcile rules: idempotence, convergence, cold-load budget, drain, conflicts."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.kernel.command_effects import Copy
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Compatibility
from loraplane.schemas.commands import CacheCommand, CommandAction, CommandReason
from loraplane.schemas.reasons import CommandRule
from loraplane.schemas.worker_state import CopyOrigin, LoadedAdapter, WorkerState
from loraplane.streams import planner
from loraplane.workers.demand_admission import DemandCounts
from loraplane.workers.reconcile import (
    IDLE,
    MAX_CONFLICTS_PER_TICK,
    ActualState,
    Ask,
    BusyRetry,
    Change,
    CommandSkip,
    Conflict,
    DesiredState,
    Fetch,
    Guard,
    GuardChanged,
    HostEntry,
    Intent,
    Load,
    LoadBudget,
    Outcome,
    Refuse,
    RemoveHost,
    Settled,
    Unload,
    Usage,
    Vanished,
    adopt,
    apply_command,
    may_move_down,
    overridden,
    reconcile,
    registry_by_name,
    settled_by,
    vouched,
)
from loraplane.workers.reconcile import fold as fold_one

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
BASE = "tiny-llama"
WORKER = "w1"


def record(
    adapter: str,
    version: str = "1",
    status: AdapterStatus = AdapterStatus.active,
    tenant: str = "t1",
    base: str = BASE,
) -> AdapterRecord:
    sha = (adapter + version).encode().hex().ljust(64, "0")[:64]
    return AdapterRecord(
        adapter_id=adapter,
        base_model=base,
        version=version,
        rank=8,
        artifact_uri=f"s3://loraplane-artifacts/{adapter}/{version}/",
        sha256=sha,
        size_bytes=1000,
        status=status,
        tenant_id=tenant,
        compatibility=Compatibility(target_modules=["q_proj"], max_lora_rank=8),
    )


RECORDS = [record(f"a{i}", v) for i in range(6) for v in ("1", "2")]
REGISTRY = registry_by_name(RECORDS)


def command(
    rec: AdapterRecord,
    action: CommandAction,
    cid: str,
    worker: str = WORKER,
    deadline: datetime | None = None,
) -> CacheCommand:
    return CacheCommand(
        command_id=cid,
        worker_id=worker,
        action=action,
        base_model=BASE,
        tenant_id=rec.tenant_id,
        adapter_id=rec.adapter_id,
        version=rec.version,
        sha256=rec.sha256,
        lora_name=rec.lora_name,
        reason=CommandReason(rule=CommandRule.hot_score),
        issued_at=NOW,
        deadline=deadline or NOW + timedelta(minutes=1),
    )


def fold(state: DesiredState, commands: list[CacheCommand]) -> DesiredState:
    for cmd in commands:
        state, _ = apply_command(state, cmd, worker_id=WORKER, base_model=BASE, now=NOW)
    return state


EMPTY = ActualState(gpu={}, host={})
commands_st = st.lists(
    st.builds(
        lambda i, a, n: command(RECORDS[i], a, f"c{n}"),
        st.integers(0, len(RECORDS) - 1),
        st.sampled_from(list(CommandAction)),
        st.integers(0, 30),
    ),
    max_size=25,
)


def run(
    desired: DesiredState,
    actual: ActualState,
    budget: int = 6,
    now: float = 100.0,
    recent: tuple[float, ...] = (),
) -> list:
    return reconcile(
        desired, actual, REGISTRY, base_model=BASE, budget=LoadBudget(budget, recent), now=now
    )


def execute(actions: list, actual: ActualState) -> ActualState:
    """A perfect executor: what vLLM and the host tier look like after the actions."""
    gpu, host, ours = dict(actual.gpu), dict(actual.host), dict(actual.loaded_by_agent)
    for a in actions:
        match a:
            case Load(name, rec, _) | Fetch(name, rec, _):
                host[name] = HostEntry(name, f"/host/{name}", rec.sha256)
                if isinstance(a, Load):
                    gpu[name] = ours[name] = f"/host/{name}"
            case Unload(name, _, _) | Conflict(name, _):
                gpu.pop(name, None)
                ours.pop(name, None)
            case Vanished(name, _):
                ours.pop(name, None)
            case RemoveHost(name, _, _):
                host.pop(name, None)
    return replace(actual, gpu=gpu, host=host, loaded_by_agent=ours)


@settings(max_examples=150, deadline=None)
@given(commands_st)
def test_redelivering_commands_changes_nothing(commands: list[CacheCommand]) -> None:
    once = fold(DesiredState(), commands)
    twice = fold(once, commands)
    assert twice.intents == once.intents
    assert run(twice, EMPTY) == run(once, EMPTY)


@settings(max_examples=150, deadline=None)
@given(commands_st, st.integers(1, 6), st.lists(st.floats(0, 100), max_size=8))
def test_never_more_cold_loads_than_the_budget(
    commands: list[CacheCommand], per_minute: int, recent: list[float]
) -> None:
    actions = run(fold(DesiredState(), commands), EMPTY, budget=per_minute, recent=tuple(recent))
    loads = [a for a in actions if isinstance(a, Load)]
    assert len(loads) <= LoadBudget(per_minute, tuple(recent)).remaining(100.0)
    wanted_gpu = [i for i in fold(DesiredState(), commands).intents.values() if i.tier == "gpu"]
    busy = [a for a in actions if isinstance(a, BusyRetry)]
    assert len(loads) + len(busy) == len(wanted_gpu)


@settings(max_examples=100, deadline=None)
@given(commands_st)
def test_executing_the_actions_converges(commands: list[CacheCommand]) -> None:
    desired = fold(DesiredState(), commands)
    actual = EMPTY
    for _ in range(3):
        actual = execute(run(desired, actual, budget=100), actual)
    assert run(desired, actual, budget=100) == []
    for name, intent in desired.intents.items():
        assert (name in actual.gpu) == (intent.tier == "gpu")


def test_over_budget_is_busy_retry_with_the_time_until_a_slot_frees() -> None:
    desired = fold(
        DesiredState(), [command(RECORDS[i], CommandAction.load_gpu, f"c{i}") for i in range(3)]
    )
    actions = run(desired, EMPTY, budget=2, now=100.0, recent=(50.0,))
    assert [type(a) for a in actions] == [Load, BusyRetry, BusyRetry]
    assert actions[1].retry_after_s == 10.0


def test_old_version_unloads_only_when_drained() -> None:
    old, new = record("a0", "1"), record("a0", "2")
    desired = fold(
        DesiredState(),
        [
            command(new, CommandAction.load_gpu, "c1"),
            command(old, CommandAction.demote_to_host, "c2"),
        ],
    )
    actual = ActualState(
        gpu={old.lora_name: "/host/old"},
        host={old.lora_name: HostEntry(old.lora_name, "/host/old", old.sha256)},
        in_flight={old.lora_name: 2},
    )
    actions = run(desired, actual)
    assert actions == [Load(new.lora_name, new, "c1")]  # new beside old, old still serving
    drained = replace(execute(actions, actual), in_flight={})
    assert run(desired, drained) == [Unload(old.lora_name, "demote", "c2")]


def test_revoked_is_removed_now_even_in_flight() -> None:
    rec = record("a1", "1")
    revoked = {rec.lora_name: rec.model_copy(update={"status": AdapterStatus.revoked})}
    actual = ActualState(
        gpu={rec.lora_name: "/h/a1"},
        host={rec.lora_name: HostEntry(rec.lora_name, "/h/a1", rec.sha256)},
        in_flight={rec.lora_name: 5},
    )
    desired = fold(DesiredState(), [command(rec, CommandAction.pin, "c1")])
    actions = reconcile(desired, actual, revoked, base_model=BASE, budget=LoadBudget(6), now=0.0)
    assert Unload(rec.lora_name, "revoked", "c1") in actions
    assert RemoveHost(rec.lora_name, "revoked", "c1") in actions


def test_unvouched_name_is_a_conflict() -> None:
    rec = record("a2", "1")
    other_bytes = HostEntry(rec.lora_name, "/h/a2", "f" * 64)  # sha8 does not match the name
    for actual in (
        ActualState(gpu={rec.lora_name: "/tmp/evil"}, host={}),
        ActualState(gpu={rec.lora_name: "/h/a2"}, host={rec.lora_name: other_bytes}),
        ActualState(gpu={"rogue": "/x"}, host={}),
    ):
        ((name, root),) = actual.gpu.items()
        assert run(DesiredState(), actual)[0] == Conflict(name, root)


def test_a_copy_removed_behind_the_agents_back_is_reported_and_loaded_again() -> None:
    """Someone unloaded a copy the agent loaded (vLLM's unguarded SageMaker DELETE, or a
    vLLM restart): the very next reconcile reports it, and the intent loads it again."""
    rec = record("a1", "1")
    desired = fold(DesiredState(), [command(rec, CommandAction.load_gpu, "c1")])
    loaded = ActualState(
        gpu={rec.lora_name: "/h/a1"},
        host={rec.lora_name: HostEntry(rec.lora_name, "/h/a1", rec.sha256)},
        loaded_by_agent={rec.lora_name: "/h/a1"},
    )
    assert not any(isinstance(a, Vanished) for a in run(desired, loaded))
    gone = replace(loaded, gpu={})
    actions = run(desired, gone)
    assert actions[0] == Vanished(rec.lora_name, "/h/a1")
    assert any(isinstance(a, Load) and a.lora_name == rec.lora_name for a in actions)


def test_restart_adopts_what_it_can_vouch_for() -> None:
    rec, gone = record("a3", "1"), record("a4", "1")
    actual = ActualState(
        gpu={rec.lora_name: "/h/a3"},
        host={
            rec.lora_name: HostEntry(rec.lora_name, "/h/a3", rec.sha256),
            gone.lora_name: HostEntry(gone.lora_name, "/h/a4", gone.sha256),
        },
    )
    desired = adopt(actual, REGISTRY)
    assert desired.intents[rec.lora_name].tier == "gpu"
    assert desired.intents[gone.lora_name].tier == "host"
    assert run(desired, actual) == []  # nothing unloaded, nothing reloaded


def test_commands_that_do_not_apply_are_skipped_with_a_reason() -> None:
    rec = record("a5", "1")
    state, why = apply_command(
        DesiredState(),
        command(rec, CommandAction.load_gpu, "x", worker="w2"),
        worker_id=WORKER,
        base_model=BASE,
        now=NOW,
    )
    assert why == "other_worker" and not state.intents
    late = command(rec, CommandAction.load_gpu, "y", deadline=NOW - timedelta(seconds=1))
    assert apply_command(state, late, worker_id=WORKER, base_model=BASE, now=NOW)[1] == "expired"
    pinned = fold(DesiredState(), [command(rec, CommandAction.pin, "p")])
    demote = command(rec, CommandAction.evict, "e")
    assert apply_command(pinned, demote, worker_id=WORKER, base_model=BASE, now=NOW)[1] == "pinned"


def test_unknown_or_revoked_or_foreign_records_are_refused() -> None:
    ghost = record("ghost", "9")
    foreign = record("a0", "1", base="other-model")
    desired = fold(DesiredState(), [command(ghost, CommandAction.load_gpu, "g")])
    assert run(desired, EMPTY) == [Refuse(ghost.lora_name, "not_in_registry", "g")]
    desired = fold(DesiredState(), [command(foreign, CommandAction.load_gpu, "f")])
    actions = reconcile(
        desired, EMPTY, registry_by_name([foreign]), base_model=BASE, budget=LoadBudget(6), now=0.0
    )
    assert actions == [Refuse(foreign.lora_name, "base_model_mismatch", "f")]


def test_applied_ids_are_forgotten_only_once_their_deadline_passed() -> None:
    rec = RECORDS[0]
    early = command(rec, CommandAction.pin, "early", deadline=NOW + timedelta(seconds=10))
    late = command(rec, CommandAction.unpin, "late", deadline=NOW + timedelta(minutes=10))
    state = fold(DesiredState(), [early, late])
    assert set(state.seen_commands) == {"early", "late"}
    later = NOW + timedelta(minutes=1)
    state, _ = apply_command(
        state,
        command(rec, CommandAction.pin, "next", deadline=later + timedelta(minutes=1)),
        worker_id=WORKER,
        base_model=BASE,
        now=later,
    )
    assert set(state.seen_commands) == {"late", "next"}
    # the forgotten id, redelivered, still changes nothing: it is expired
    assert apply_command(state, early, worker_id=WORKER, base_model=BASE, now=later) == (
        state,
        "expired",
    )
    assert apply_command(state, late, worker_id=WORKER, base_model=BASE, now=later) == (
        state,
        "duplicate",
    )


def test_a_load_carries_the_commands_warmup_requests() -> None:
    canary = record("a1", "2", status=AdapterStatus.canary)
    load = command(canary, CommandAction.load_gpu, "c1").model_copy(update={"warmup_requests": 3})
    desired = fold(DesiredState(), [load, command(canary, CommandAction.pin, "c2")])
    assert run(desired, EMPTY) == [Load(canary.lora_name, REGISTRY[canary.lora_name], "c2", 3)]
    plain = fold(desired, [command(canary, CommandAction.load_gpu, "c3")])
    assert run(plain, EMPTY)[0].warmup_requests == 0


def test_a_name_newer_than_our_registry_copy_waits_for_a_refresh_then_is_refused() -> None:
    ghost = record("ghost", "9")
    desired = fold(DesiredState(), [command(ghost, CommandAction.load_gpu, "g")])
    waiting = {ghost.lora_name: 110.0}
    assert (
        reconcile(
            desired,
            EMPTY,
            REGISTRY,
            base_model=BASE,
            budget=LoadBudget(6, ()),
            now=100.0,
            awaiting_registry=waiting,
        )
        == []
    )
    assert reconcile(
        desired,
        EMPTY,
        REGISTRY,
        base_model=BASE,
        budget=LoadBudget(6, ()),
        now=111.0,
        awaiting_registry=waiting,
    ) == [Refuse(ghost.lora_name, "not_in_registry", "g")]
    known = registry_by_name([*RECORDS, ghost])
    assert [
        type(a).__name__
        for a in reconcile(
            desired,
            EMPTY,
            known,
            base_model=BASE,
            budget=LoadBudget(6, ()),
            now=100.0,
            awaiting_registry=waiting,
        )
    ] == ["Load"]


def test_a_gateway_ask_loads_but_never_overrides_the_planners_word() -> None:
    canary = record("a1", "2", status=AdapterStatus.canary)
    asked, why = fold_change(DesiredState(), Ask.gateway_load(canary))
    assert why is None
    assert asked.intents[canary.lora_name] == Intent(
        canary.lora_name, "a1", "2", canary.tenant_id, "gpu", origin=CopyOrigin.gateway_request
    )
    load = command(canary, CommandAction.load_gpu, "c1").model_copy(update={"warmup_requests": 3})
    planned = fold(DesiredState(), [load])
    again, why = fold_change(planned, Ask.gateway_load(canary))
    assert (again, why) == (planned, CommandSkip.already_desired)  # its id and warm-up stay
    demoted = fold(planned, [command(canary, CommandAction.demote_to_host, "c2")])
    reloaded, _ = fold_change(demoted, Ask.gateway_load(canary))
    intent = reloaded.intents[canary.lora_name]
    assert (intent.tier, intent.warmup_requests, intent.command_id, intent.origin) == (
        "gpu",
        3,
        None,
        CopyOrigin.gateway_request,
    )


def fold_change(state: DesiredState, change: Change) -> tuple[DesiredState, str | None]:
    return fold_one(state, change, worker_id=WORKER, base_model=BASE, now=NOW)


START = [Copy(), Copy("host"), Copy("host", True), Copy("gpu"), Copy("gpu", True)]
NAMES = [r.lora_name for r in RECORDS[:4]]


def worker_state(start: dict[str, Copy]) -> WorkerState:
    adapters = [
        LoadedAdapter(
            lora_name=n,
            adapter_id=REGISTRY[n].adapter_id,
            version=REGISTRY[n].version,
            tenant_id=REGISTRY[n].tenant_id,
            tier=c.tier,
            pinned=c.pinned,
            size_bytes=REGISTRY[n].size_bytes,
        )
        for n, c in start.items()
        if c.present
    ]
    return WorkerState(
        worker_id=WORKER,
        base_model=BASE,
        ts=NOW,
        gpu_slots_used=0,
        gpu_slots_total=8,
        host_bytes_used=sum(a.size_bytes for a in adapters),
        host_bytes_budget=10**9,
        max_lora_rank=8,
        adapters=adapters,
    )


def planner_expects(start: dict[str, Copy], commands: list[CacheCommand]) -> dict[str, Copy]:
    """What the planner expects the worker to hold once it took ``commands`` (as when it
    issues them: each applied in order on top of the worker's state)."""
    state = worker_state(start)
    w = planner._effective(state, planner._Tiers.of(state), planner.WorkerMemory(), REGISTRY, 0.0)
    for c in commands:
        planner._apply(w, c.action, c.lora_name, REGISTRY[c.lora_name].size_bytes)
    expected = {n: planner._copy_on(w, n) for n in NAMES}
    assert w.host_bytes == sum(REGISTRY[n].size_bytes for n, c in expected.items() if c.present)
    return expected


def worker_reconciles_to(start: dict[str, Copy], commands: list[CacheCommand]) -> dict[str, Copy]:
    """Where the worker's copies end up: each command folded into its desired state, then
    reconciled by a perfect executor whose outcomes are folded back, as the agent does."""
    desired = DesiredState(
        {
            n: Intent(
                n,
                REGISTRY[n].adapter_id,
                REGISTRY[n].version,
                REGISTRY[n].tenant_id,
                c.tier,
                c.pinned,
            )
            for n, c in start.items()
            if c.present
        }
    )
    gpu = {n: f"/host/{n}" for n, c in start.items() if c.tier == "gpu"}
    actual = ActualState(
        gpu=gpu,
        loaded_by_agent=gpu,
        host={
            n: HostEntry(n, f"/host/{n}", REGISTRY[n].sha256) for n, c in start.items() if c.present
        },
    )
    for c in commands:
        desired = fold(desired, [c])
        for _ in range(4):
            actions = run(desired, actual, budget=100)
            if not actions:
                break
            actual = execute(actions, actual)
            for outcome in filter(None, map(settled_by, actions)):
                desired, _ = fold_change(desired, outcome)
        assert run(desired, actual, budget=100) == []

    def copy(name: str) -> Copy:
        intent = desired.intents.get(name)
        tier = "gpu" if name in actual.gpu else "host" if name in actual.host else "gone"
        return Copy(tier, bool(intent and intent.pinned))

    return {n: copy(n) for n in NAMES}


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.sampled_from(NAMES), st.sampled_from(START)),
    st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(list(CommandAction))), max_size=12),
)
def test_the_planner_expects_what_the_worker_reconciles_to(
    start: dict[str, Copy], steps: list[tuple[str, CommandAction]]
) -> None:
    commands = [command(REGISTRY[n], a, f"c{i}") for i, (n, a) in enumerate(steps)]
    assert planner_expects(start, commands) == worker_reconciles_to(start, commands)


def test_the_planner_sees_a_command_shown_as_the_table_says() -> None:
    rec = RECORDS[0]
    state = {a.lora_name: a for a in worker_state({rec.lora_name: Copy("gpu", True)}).adapters}
    assert not planner._reflected(command(rec, CommandAction.demote_to_host, "d"), state)
    assert planner._reflected(command(rec, CommandAction.pin, "p"), state)
    assert not planner._reflected(command(rec, CommandAction.pin, "p"), {})


# ---- the worker's own GPU slots (Guard.gpu_slots, make_room) ---------------------------

SLOTS = Guard(gpu_slots=2)


def gateway(
    state: DesiredState, rec: AdapterRecord, guard: Guard = SLOTS, usage: Usage = IDLE
) -> tuple[DesiredState, str | None]:
    return fold_one(
        state,
        Ask.gateway_load(rec),
        worker_id=WORKER,
        base_model=BASE,
        now=NOW,
        guard=guard,
        usage=usage,
    )


def on_gpu(*recs: AdapterRecord) -> ActualState:
    gpu = {r.lora_name: f"/host/{r.lora_name}" for r in recs}
    return ActualState(
        gpu=gpu,
        loaded_by_agent=gpu,
        host={r.lora_name: HostEntry(r.lora_name, f"/host/{r.lora_name}", r.sha256) for r in recs},
    )


def gpu_intents(state: DesiredState) -> set[str]:
    return {n for n, i in state.intents.items() if i.tier == "gpu"}


A0, A1, A2, A3 = (record(f"a{i}") for i in range(4))


def test_a_load_past_the_slots_demotes_the_least_recently_used_copy() -> None:
    state = DesiredState()
    for rec in (A0, A1):
        state, why = gateway(state, rec)
        assert why is None
    used = Usage(last_used={A0.lora_name: 10.0, A1.lora_name: 5.0})  # a1 is the older
    state, why = gateway(state, A2, usage=used)
    assert why is None and gpu_intents(state) == {A0.lora_name, A2.lora_name}
    demoted = state.intents[A1.lora_name]
    assert (demoted.tier, demoted.unload_reason) == ("host", "slot_needed")
    actions = reconcile(
        state, on_gpu(A0, A1), REGISTRY, base_model=BASE, budget=LoadBudget(6), now=0.0, gpu_slots=2
    )
    assert actions == [
        Unload(A1.lora_name, "slot_needed", None),
        Load(A2.lora_name, REGISTRY[A2.lora_name], None),
    ]
    reloaded, _ = gateway(
        state, A1, usage=Usage(last_used={A0.lora_name: 10.0, A2.lora_name: 11.0})
    )
    assert reloaded.intents[A1.lora_name].unload_reason is None  # a plain GPU copy again
    assert reloaded.intents[A0.lora_name].tier == "host"


def test_pinned_protected_and_busy_copies_keep_their_slot_and_the_load_is_refused() -> None:
    guard = Guard(
        never_evict={A1.lora_name: "tenant_priority == platinum"}, max_protected=1, gpu_slots=3
    )
    state = fold(
        DesiredState(),
        [command(A0, CommandAction.pin, "p"), command(A0, CommandAction.load_gpu, "l")],
    )
    for rec in (A1, A2):
        state, _ = gateway(state, rec, guard)
    assert state.protected == {A1.lora_name} and len(gpu_intents(state)) == 3
    busy = Usage(in_flight={A2.lora_name: 1})
    after, why = gateway(state, A3, guard, busy)
    assert (after, why) == (state, CommandSkip.no_free_slot)  # nothing changed
    after, why = fold_one(
        state,
        command(A3, CommandAction.load_gpu, "c"),
        worker_id=WORKER,
        base_model=BASE,
        now=NOW,
        guard=guard,
        usage=busy,
    )
    assert why == CommandSkip.no_free_slot and A3.lora_name not in after.intents
    after, why = gateway(state, A3, guard)  # once a2 is idle, it is the one that moves
    assert why is None and after.intents[A2.lora_name].tier == "host"


def test_a_requests_load_takes_only_the_slot_of_a_copy_in_no_more_demand() -> None:
    """Demand admission: a gateway load may take only a slot its version outranks in
    (decayed, priority-weighted) demand here; refused as busier_copies, nothing changed; a
    planner load of the same version still takes the LRU slot."""
    state = DesiredState()
    for rec in (A0, A1):
        state, _ = gateway(state, rec)
    counts = DemandCounts(600.0)
    for name, n in ((A0.lora_name, 5), (A1.lora_name, 3), (A2.lora_name, 2)):
        for _ in range(n):
            counts.observe(name, 1.0, 0.0)
    used = Usage(
        last_used={A0.lora_name: 5.0, A1.lora_name: 10.0},
        admits=lambda c, n: counts.admits(c, n, 0.0),
    )
    after, why = gateway(state, A2, usage=used)
    assert (after, why) == (state, CommandSkip.busier_copies)
    after, why = fold_one(
        state,
        command(A2, CommandAction.load_gpu, "p"),
        worker_id=WORKER,
        base_model=BASE,
        now=NOW,
        usage=used,
        guard=SLOTS,
    )
    assert why is None and after.intents[A0.lora_name].tier == "host"  # the LRU copy
    counts.observe(A2.lora_name, 1.0, 0.0)  # a third request: now a1 (3) may give way
    after, why = gateway(state, A2, usage=used)
    assert why is None and after.intents[A1.lora_name].tier == "host"
    assert after.intents[A0.lora_name].tier == "gpu"
    # with every copy that may move outranking it, but another pinned, still busier_copies;
    # with nothing that may move at all, no_free_slot as before
    pinned = fold(state, [command(A0, CommandAction.pin, "pin")])
    assert gateway(pinned, A3, usage=used)[1] == CommandSkip.busier_copies
    busy = Usage(in_flight={A0.lora_name: 1, A1.lora_name: 1}, admits=used.admits)
    assert gateway(state, A3, usage=busy)[1] == CommandSkip.no_free_slot


def test_no_load_takes_the_slot_of_a_copy_within_the_minimum_residency() -> None:
    """Guard.min_residency_s: neither a request's load nor a planner's takes the slot of a
    copy loaded sooner (refused as min_residency, nothing changed); once it is past, the LRU
    copy gives way; a never-evict version the worker will protect may take it at once, one
    it will not protect (its cap full) may not."""
    state = fold(
        DesiredState(),
        [command(A0, CommandAction.load_gpu, "l0"), command(A1, CommandAction.load_gpu, "l1")],
    )
    guard = Guard(gpu_slots=2, min_residency_s=180.0)
    fresh = Usage(loaded_at={A0.lora_name: 100.0, A1.lora_name: 50.0}, now=200.0)
    assert gateway(state, A2, guard, fresh) == (state, CommandSkip.min_residency)
    after, why = fold_one(
        state,
        command(A2, CommandAction.load_gpu, "l2"),
        worker_id=WORKER,
        base_model=BASE,
        now=NOW,
        guard=guard,
        usage=fresh,
    )
    assert why == CommandSkip.min_residency and A2.lora_name not in after.intents
    later = replace(fresh, now=240.0)  # a1 was loaded 190 s ago
    after, why = gateway(state, A2, guard, later)
    assert why is None and after.intents[A1.lora_name].tier == "host"
    urgent = replace(
        guard, never_evict={A2.lora_name: "platinum", A3.lora_name: "platinum"}, max_protected=1
    )
    after, why = gateway(state, A2, urgent, fresh)
    assert why is None and after.protected == {A2.lora_name}
    assert (
        gateway(
            after, A3, urgent, replace(fresh, loaded_at={**fresh.loaded_at, A2.lora_name: 199.0})
        )[1]
        == CommandSkip.min_residency
    )


def test_a_planner_load_whose_slot_goes_to_another_load_is_reported_not_carried_out() -> None:
    """``overridden``: the worker's own slot rule took the GPU intent of a planner command
    away; the agent reports its id in the heartbeat's skipped_commands."""
    state = fold(
        DesiredState(),
        [command(A0, CommandAction.load_gpu, "l0"), command(A1, CommandAction.load_gpu, "l1")],
    )
    used = Usage(last_used={A0.lora_name: 5.0, A1.lora_name: 10.0})
    after, why = gateway(state, A2, usage=used)
    assert why is None and overridden(state, after) == ["l0"]
    assert overridden(after, after) == []


def test_with_the_demand_known_a_requests_copy_gives_its_slot_before_the_planners() -> None:
    """``Usage.demand`` given: the copy that gives up its slot is one a request loaded before
    one the planner placed, then the least demanded, whatever was used last."""
    state = fold(DesiredState(), [command(A0, CommandAction.load_gpu, "l0")])
    state, _ = gateway(state, A1)  # a request's copy
    demand = {A0.lora_name: 0.0, A1.lora_name: 9.0}
    used = Usage(last_used={A0.lora_name: 1.0, A1.lora_name: 50.0}, demand=demand.__getitem__)
    after, why = gateway(state, A2, usage=used)
    assert why is None and after.intents[A1.lora_name].tier == "host"  # busier, but not planned
    state = fold(
        DesiredState(),
        [command(A0, CommandAction.load_gpu, "l0"), command(A1, CommandAction.load_gpu, "l1")],
    )
    after, why = gateway(state, A2, usage=used)  # both planned: the least demanded goes
    assert why is None and after.intents[A0.lora_name].tier == "host"


def test_the_planners_demote_then_load_evicts_nothing_more() -> None:
    state = fold(
        DesiredState(),
        [command(A0, CommandAction.load_gpu, "l0"), command(A1, CommandAction.load_gpu, "l1")],
    )
    guard_state, _ = fold_one(
        state,
        command(A1, CommandAction.demote_to_host, "d1"),
        worker_id=WORKER,
        base_model=BASE,
        now=NOW,
        guard=SLOTS,
    )
    state, why = fold_one(
        guard_state,
        command(A2, CommandAction.load_gpu, "l2"),
        worker_id=WORKER,
        base_model=BASE,
        now=NOW,
        guard=SLOTS,
    )
    assert why is None and gpu_intents(state) == {A0.lora_name, A2.lora_name}
    assert state.intents[A0.lora_name].command_id == "l0"  # untouched
    assert state.intents[A1.lora_name].unload_reason is None  # the planner's demote
    draining = replace(on_gpu(A0, A1), in_flight={A1.lora_name: 1})
    run_ = reconcile(
        state, draining, REGISTRY, base_model=BASE, budget=LoadBudget(6), now=0.0, gpu_slots=2
    )
    assert run_ == []  # a2 waits for a1's slot; nothing else leaves
    drained = reconcile(
        state, on_gpu(A0, A1), REGISTRY, base_model=BASE, budget=LoadBudget(6), now=0.0, gpu_slots=2
    )
    assert drained == [
        Unload(A1.lora_name, "demote", "d1"),
        Load(A2.lora_name, REGISTRY[A2.lora_name], "l2"),
    ]


def test_an_idle_copy_no_intent_holds_gives_its_slot_to_a_waiting_load() -> None:
    state, _ = gateway(DesiredState(), A2)
    actual = on_gpu(A0, A1)  # vouched, but nothing holds them (a registry gap at adoption)
    actions = reconcile(
        state, actual, REGISTRY, base_model=BASE, budget=LoadBudget(6), now=0.0, gpu_slots=2
    )
    assert actions == [Unload(A0.lora_name, "slot_needed", None)]
    after = execute(actions, actual)
    assert [
        type(a)
        for a in reconcile(
            state, after, REGISTRY, base_model=BASE, budget=LoadBudget(6), now=0.0, gpu_slots=2
        )
    ] == [Load]


def test_a_guard_with_fewer_slots_demotes_the_excess_at_once() -> None:
    state = adopt(on_gpu(A0, A1, A2), REGISTRY)
    state, _ = fold_one(
        state,
        GuardChanged(),
        worker_id=WORKER,
        base_model=BASE,
        now=NOW,
        guard=SLOTS,
        usage=Usage(last_used={A0.lora_name: 1.0}),
    )
    assert gpu_intents(state) == {A0.lora_name, A2.lora_name}  # a1 never used: it goes


SLOT_NAMES = [r.lora_name for r in RECORDS[:6]]
change_st = st.one_of(
    st.builds(
        lambda i, a, n: command(RECORDS[i], a, f"c{n}"),
        st.integers(0, 5),
        st.sampled_from(list(CommandAction)),
        st.integers(0, 40),
    ),
    st.builds(lambda i: Ask.gateway_load(RECORDS[i]), st.integers(0, 5)),
    st.builds(
        lambda i, s: Outcome(SLOT_NAMES[i], s), st.integers(0, 5), st.sampled_from(list(Settled))
    ),
    st.just(GuardChanged()),
)
usage_st = st.builds(
    lambda busy, used: Usage({n: 1 for n in busy}, used),
    st.sets(st.sampled_from(SLOT_NAMES), max_size=3),
    st.dictionaries(st.sampled_from(SLOT_NAMES), st.floats(0, 100), max_size=6),
)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 3),
    st.sets(st.sampled_from(SLOT_NAMES), max_size=3),
    st.lists(st.tuples(change_st, usage_st), max_size=20),
)
def test_no_sequence_of_changes_fills_more_slots_than_the_worker_has(
    slots: int, never_evict: set[str], steps: list[tuple[Change, Usage]]
) -> None:
    guard = Guard(
        {n: "tenant_priority == platinum" for n in never_evict}, max_protected=1, gpu_slots=slots
    )
    state, actual = DesiredState(), EMPTY
    for change, usage in steps:
        before = state
        state, _ = fold_one(
            state, change, worker_id=WORKER, base_model=BASE, now=NOW, guard=guard, usage=usage
        )
        assert len(gpu_intents(state)) <= slots
        victims = {
            n
            for n in gpu_intents(before) - gpu_intents(state)
            if (i := state.intents.get(n)) is not None and i.unload_reason == "slot_needed"
        }
        for name in victims:
            assert may_move_down(before, name, usage)  # not pinned, protected or in flight
            asked = getattr(change, "lora_name", None)
            assert name != asked
            kept = [n for n in gpu_intents(state) if n != asked and may_move_down(before, n, usage)]
            assert all(
                usage.last_used.get(n, -1.0) >= usage.last_used.get(name, -1.0) for n in kept
            )  # the least recently used went first
        actual = replace(actual, in_flight=dict(usage.in_flight))
        for _ in range(2):  # a perfect executor never puts more on vLLM than its slots
            actions = reconcile(
                state,
                actual,
                REGISTRY,
                base_model=BASE,
                budget=LoadBudget(100),
                now=0.0,
                gpu_slots=slots,
            )
            actual = execute(actions, actual)
            assert len(actual.gpu) <= slots
            for outcome in filter(None, map(settled_by, actions)):
                state, _ = fold_one(
                    state,
                    outcome,
                    worker_id=WORKER,
                    base_model=BASE,
                    now=NOW,
                    guard=guard,
                    usage=usage,
                )


def test_a_flood_of_foreign_names_is_unloaded_a_bounded_batch_a_tick() -> None:
    """ATTACK: a vLLM listing 100,000 names nobody loaded. Every one was a Conflict in one
    tick: 100,000 unload calls, dead letters and events while the tick held the agent's
    lock (commands waited behind it). At most MAX_CONFLICTS_PER_TICK go per tick, and
    ticks still converge: every foreign name is unloaded in the end."""
    actual = ActualState(gpu={f"rogue{i:06d}": "/x" for i in range(100_000)}, host={})
    conflicts = [a for a in run(DesiredState(), actual) if isinstance(a, Conflict)]
    assert len(conflicts) == MAX_CONFLICTS_PER_TICK
    small = ActualState(gpu={f"rogue{i}": "/x" for i in range(3 * MAX_CONFLICTS_PER_TICK)}, host={})
    for _ in range(3):
        small = execute(run(DesiredState(), small), small)
    assert small.gpu == {}


def test_a_copy_verified_against_a_digest_the_registry_no_longer_pins_is_not_vouched() -> None:
    """ATTACK: the registry's record of a name on the GPU now pins another digest with the
    same first 8 hex (a version republished after the registry topic was reset, or a
    collision a publisher ground out). ``vouched`` compared the copy's entry with the name's
    8 hex only, so the bytes of the old digest kept serving, on a restart adopted too. Now
    the entry's full digest must be the one the registry pins: the copy is unloaded as a
    conflict and the intent loads the registry's bytes again."""
    rec = record("a1", "1")
    path = f"/h/{rec.lora_name}/adapter"
    entry = HostEntry(rec.lora_name, path, rec.sha256[:8] + "f" * 56)
    desired = fold(DesiredState(), [command(rec, CommandAction.load_gpu, "c1")])
    copy = "/h/.resolver-copies/" + rec.lora_name + ".abc123"
    for root, by_agent in ((path, {rec.lora_name: path}), (path, {}), (copy, {})):
        actual = ActualState(
            gpu={rec.lora_name: root}, host={rec.lora_name: entry}, loaded_by_agent=by_agent
        )
        assert not vouched(rec.lora_name, root, actual, REGISTRY)
        actions = run(desired, actual)
        assert actions[0] == Conflict(rec.lora_name, root)
        assert any(isinstance(a, Load) and a.lora_name == rec.lora_name for a in actions)
        assert adopt(actual, REGISTRY).intents[rec.lora_name].tier == "host"
    genuine = replace(entry, sha256=rec.sha256)
    actual = ActualState(gpu={rec.lora_name: copy}, host={rec.lora_name: genuine})
    assert vouched(rec.lora_name, copy, actual, REGISTRY)


def test_a_copy_from_an_entry_changed_on_disk_is_not_vouched() -> None:
    """vLLM re-reads the folder it loaded (its CPU cache): a copy loaded from an entry whose
    files changed since their verification is a conflict, unloaded and loaded again."""
    rec = record("a1", "1")
    path = f"/h/{rec.lora_name}/adapter"
    changed = HostEntry(rec.lora_name, path, rec.sha256, intact=False)
    desired = fold(DesiredState(), [command(rec, CommandAction.load_gpu, "c1")])
    for by_agent in ({rec.lora_name: path}, {}):
        actual = ActualState(
            gpu={rec.lora_name: path}, host={rec.lora_name: changed}, loaded_by_agent=by_agent
        )
        actions = run(desired, actual)
        assert actions[0] == Conflict(rec.lora_name, path)
        assert any(isinstance(a, Load) and a.lora_name == rec.lora_name for a in actions)
    copy = f"/h/.resolver-copies/{rec.lora_name}.abc123"  # the resolver's own copy: unaffected
    actual = ActualState(gpu={rec.lora_name: copy}, host={rec.lora_name: changed})
    assert vouched(rec.lora_name, copy, actual, REGISTRY)


def test_a_name_being_fetched_is_not_fetched_again_and_holds_no_slot_or_budget() -> None:
    """``fetching``: a tick while a name's download is in flight starts no second one, and
    the name holds no GPU slot or cold load meanwhile (others load); a refusal still drops
    its intent."""
    slow, warm, host_only, gone = (record(f"a{i}") for i in range(4))
    desired = fold(
        DesiredState(),
        [
            command(slow, CommandAction.load_gpu, "c1"),
            command(warm, CommandAction.load_gpu, "c2"),
            command(host_only, CommandAction.prewarm_host, "c3"),
            command(gone, CommandAction.load_gpu, "c4"),
        ],
    )
    actual = ActualState(
        gpu={}, host={warm.lora_name: HostEntry(warm.lora_name, "/h", warm.sha256)}
    )
    registry = {n: r for n, r in REGISTRY.items() if n != gone.lora_name}
    fetching = {slow.lora_name, host_only.lora_name, gone.lora_name}
    actions = reconcile(
        desired,
        actual,
        registry,
        base_model=BASE,
        budget=LoadBudget(1),
        now=0.0,
        gpu_slots=1,
        fetching=fetching,
    )
    assert actions == [
        Load(warm.lora_name, warm, "c2"),
        Refuse(gone.lora_name, "not_in_registry", "c4"),
    ]
