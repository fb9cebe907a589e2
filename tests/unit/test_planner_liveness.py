"""The planner agent plans only with workers heard lately (``routing.heard_lately``, policy
``worker_heartbeat_s``): a silent worker's copies count for nothing, as in the router."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from loraplane.streams import planner_agent
from loraplane.streams.planner import Plan
from loraplane.streams.schedules import ScheduleFile

from tests.unit.test_dashboard_fleet import aged
from tests.unit.test_fleet_view import state


class SpyPlanner:
    """Records the workers it is asked to plan with."""

    def __init__(self) -> None:
        self.workers: list[str] = []

    def tick(self, views: Any, scores: Any, workers: Any, *_: Any) -> Plan:
        self.workers = sorted(w.worker_id for w in workers)
        return Plan({}, {}, [], [], {}, {})


class NoScores:
    def states(self) -> dict[str, Any]:
        return {}


def test_a_worker_silent_for_three_heartbeats_is_left_out_of_the_plan(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hb = planner_agent.settings.policy.worker_heartbeat_s
    ages = {"w1": 0.1 * hb, "w2": 2.5 * hb, "w3": 3.5 * hb, "w4": 100 * hb}
    states = {wid: aged(state(wid, "llama", ["a@1-aa"]), age).model_dump(mode="json")
              for wid, age in ages.items()}
    monkeypatch.setattr(planner_agent, "worker_states", states)
    monkeypatch.setattr(planner_agent, "registry_table", {})
    monkeypatch.setattr(planner_agent, "schedule_file", ScheduleFile(tmp_path / "none.yaml"))
    spy = SpyPlanner()
    planner_agent.plan_now(planner_agent._Inputs(planner=spy), NoScores(), {})  # type: ignore[arg-type]
    assert spy.workers == ["w1", "w2"]  # within 3 intervals; w3 and w4 are drained
