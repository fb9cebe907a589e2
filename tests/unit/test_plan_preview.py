"""``loraplane plan show`` counts live and serving workers as ``fleet status`` does: a worker
heard lately whose state says ``not_run`` is live, not serving; a silent one is neither."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

import loraplane.streams.planner_runtime as runtime
from loraplane.cli import app
from loraplane.kernel import kafka
from loraplane.kernel.bus import Record
from loraplane.kernel.config import get_settings
from loraplane.kernel.topics import topic_name
from loraplane.router.fleet_view import fleet_view
from loraplane.schemas.codec import encode
from loraplane.schemas.reasons import VllmFailure
from loraplane.schemas.worker_state import WorkerState
from tests.unit.test_fleet_view import state


def fleet(now: float, heartbeat_s: float) -> list[WorkerState]:
    """Two serving workers, one not run (heard lately), one silent for long."""
    at = {"ts": datetime.fromtimestamp(now - 1.0, UTC)}
    return [
        state("w1", "llama", []).model_copy(update=at),
        state("w2", "llama", []).model_copy(update=at),
        state("w3", "llama", []).model_copy(
            update={**at, "not_run": VllmFailure.vllm_wrong_base_model}
        ),
        state("w4", "llama", []).model_copy(
            update={"ts": datetime.fromtimestamp(now - 100 * heartbeat_s, UTC)}
        ),
    ]


@pytest.fixture
def topics(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[WorkerState]]:
    """The worker-state topic as ``preview`` reads it (no broker): the fleet above."""
    settings = get_settings()
    states = fleet(time.time(), settings.policy.worker_heartbeat_s)
    records = [
        Record(topic_name(settings, "worker-state"), 0, i, s.worker_id.encode(), encode(s), {}, 0)
        for i, s in enumerate(states)
    ]
    monkeypatch.setattr(runtime, "read_topic", lambda *_a, **_k: iter(records))
    monkeypatch.setattr(kafka, "act_as", lambda _principal: None)  # the CLI's, process-wide
    yield states


def test_plan_show_counts_a_not_run_worker_live_not_serving(topics: list[WorkerState]) -> None:
    settings = get_settings()
    now = time.time()
    (base,) = fleet_view(topics, now, settings.policy.worker_heartbeat_s).base_models
    assert (base.live_workers, base.serving_workers) == (3, 2)  # what fleet status says

    shown = runtime.preview(settings, "llama", now=now)
    assert (shown.workers, shown.live_workers, shown.serving_workers) == (4, 3, 2)

    runner = CliRunner()
    out = runner.invoke(app, ["plan", "show", "--base-model", "llama", "--json"])
    assert out.exit_code == 0, out.output
    inputs = json.loads(out.stdout)["inputs"]
    assert (inputs["workers"], inputs["live_workers"], inputs["serving_workers"]) == (4, 3, 2)
    text = runner.invoke(app, ["plan", "show", "--base-model", "llama"])
    assert text.exit_code == 0, text.output
    assert "3/4 workers live, 2 serving" in text.stdout
