"""The planner runtime plans only with workers heard lately (``heard_lately``, policy
``worker_heartbeat_s``): a silent worker's copies count for nothing, as in the router."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from loraplane.kernel.config import get_settings
from loraplane.schemas.codec import encode
from loraplane.streams.planner import Plan
from loraplane.streams.planner_runtime import PlannerRuntime
from tests.unit.test_dashboard_fleet import aged
from tests.unit.test_fleet_view import state


class SpyPlanner:
    """Records the workers it is asked to plan with."""

    def __init__(self) -> None:
        self.workers: list[str] = []

    def tick(self, views: Any, scores: Any, workers: Any, *_: Any) -> Plan:
        self.workers = sorted(w.worker_id for w in workers)
        return Plan({}, {}, [], [], {}, {})


def runtime_with(tmp_path: Path, base_model: str | None = None) -> PlannerRuntime:
    """A runtime whose tails are not started: an empty registry, no schedule."""
    settings = get_settings().model_copy(update={"schedules_path": tmp_path / "none.yaml"})
    runtime = PlannerRuntime(settings, base_model)
    runtime.registry_tail = SimpleNamespace(version=0)  # type: ignore[assignment]
    runtime.registry = SimpleNamespace(accepted={}, changes=0)  # type: ignore[assignment]
    return runtime


def test_a_worker_silent_for_three_heartbeats_is_left_out_of_the_plan(tmp_path: Path) -> None:
    runtime = runtime_with(tmp_path)
    hb = runtime.settings.policy.worker_heartbeat_s
    ages = {"w1": 0.1 * hb, "w2": 2.5 * hb, "w3": 3.5 * hb, "w4": 100 * hb}
    for wid, age in ages.items():
        runtime.workers.apply(wid.encode(), encode(aged(state(wid, "llama", ["a@1-aa"]), age)))
    spy = SpyPlanner()
    runtime.plan_now(spy)  # type: ignore[arg-type]
    assert spy.workers == ["w1", "w2"]  # within 3 intervals; w3 and w4 are drained


def test_a_planner_of_one_base_model_plans_only_its_workers(tmp_path: Path) -> None:
    runtime = runtime_with(tmp_path, base_model="llama")
    for wid, base in (("w1", "llama"), ("w2", "qwen")):
        runtime.workers.apply(wid.encode(), encode(aged(state(wid, base, []), 1.0)))
    spy = SpyPlanner()
    runtime.plan_now(spy)  # type: ignore[arg-type]
    assert spy.workers == ["w1"]


def test_a_command_goes_to_the_partition_its_worker_announced_else_the_hash(tmp_path: Path) -> None:
    from loraplane.kernel.command_partition import partition_of
    from tests.unit.test_command_trust import command

    runtime = runtime_with(tmp_path)
    sent: list[tuple[bytes, int]] = []
    txn = SimpleNamespace(
        produce=lambda topic, key, value, partition: sent.append((key, partition))
    )
    key = SimpleNamespace(sign_command=lambda cmd: cmd)
    slotted = state("w-slot", "b", []).model_copy(update={"command_partition": 7})
    for s in (slotted, state("w-hash", "b", [])):
        runtime.workers.apply(s.worker_id.encode(), encode(s))
    for wid in ("w-slot", "w-hash", "w-unknown"):
        runtime._produce_command(txn, command(worker=wid), key, 64)  # type: ignore[arg-type]
    assert sent == [
        (b"w-slot", 7),
        (b"w-hash", partition_of("w-hash", 64)),
        (b"w-unknown", partition_of("w-unknown", 64)),
    ]


def test_a_view_the_planner_cannot_verify_is_never_planned(tmp_path: Path) -> None:
    """ATTACK: the planner reads the registry topic itself now (no Faust table between), so
    a view written straight into the topic, or signed by a key outside the keyring, must not
    reach the plan: it is verified where it is used (``VerifiedRegistry``), dead-lettered."""
    from tests.lifecycle_kit import make_kit
    from tests.unit.test_registry_evidence import NOW, VIEW_A, fold
    from tests.unit.test_registry_trust import world

    class ViewSpy(SpyPlanner):
        def tick(self, views: Any, *rest: Any) -> Plan:
            self.views = sorted(v.adapter_id for v in views)
            return super().tick(views, *rest)

    runtime = runtime_with(tmp_path)
    registry, topic, sink, _, _ = world(tmp_path)
    runtime.registry = registry
    runtime.registry_tail = SimpleNamespace(version=1)  # type: ignore[assignment]
    stranger = make_kit(NOW)  # a key pair the keyring does not hold
    topic.write(VIEW_A.adapter_id, VIEW_A)
    forged = fold([stranger.event("ci", "publish", "forged-bot", "1", 1, NOW)], stranger.keyring)
    assert forged is not None  # a well-formed view, only under a key nobody trusts
    topic.write("forged-bot", forged)
    bare = VIEW_A.model_copy(update={"evidence": []})
    topic.write("bare-bot", bare.model_copy(update={"adapter_id": "bare-bot"}))
    spy = ViewSpy()
    runtime.plan_now(spy)  # type: ignore[arg-type]
    assert spy.views == [VIEW_A.adapter_id]
    assert len(sink.letters()) == 2
