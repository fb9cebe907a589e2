"""bench.decision_quality: the goals it checks, its JSON, and the doc table it writes only
when asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import decision_quality as dq

SMALL = """
name: dq
seed: 4
workload: {requests: 500, rate_qps: 4, adapters: 16, batch_fraction: 0.3,
           canaries: {count: 1, percent: 20}}
fleet: {base_models: [{workers: 1, gpu_slots_per_worker: 2}]}
adapter_cache_policy: {request_budgets: {interactive: {max_wait_ms: 250}}}
"""


def _row(cost: float, i: float, b: float, c: float = 1.0, cold: int = 0) -> dict[str, Any]:
    return {
        "weighted_miss_cost": cost,
        "platinum_cold_starts": cold,
        "canary_cold_starts": 0,
        "slo_attainment": {"interactive": i, "batch": b, "canary": c},
    }


def _result(default: dict[str, Any]) -> dict[str, Any]:
    online = {"online": True, "baseline": True, "own_deployment": False}
    return {
        "policies": {
            "lru": _row(10.0, 0.5, 0.6),
            "gdsf": _row(8.0, 0.4, 0.7),
            "belady": _row(1.0, 0.9, 0.9),
            "loraplane": default,
        },
        "kinds": {
            "lru": online,
            "gdsf": online,
            "belady": {**online, "online": False},
            "loraplane": {**online, "baseline": False},
        },
        "hindsight": {"weighted_miss_cost": 6.0},
    }


def test_each_goal_is_against_the_best_online_baseline_not_the_offline_one() -> None:
    met = dq.goals(_result(_row(7.0, 0.5, 0.7)), fits=True)
    assert met["all"] and met["best_online"]["cost"] == "gdsf"
    assert (met["best_online"]["interactive"], met["best_online"]["batch"]) == (0.5, 0.7)
    missed = dq.goals(_result(_row(7.5, 0.49, 0.7, c=0.98, cold=1)), fits=True)
    assert [
        k
        for k in ("cost", "interactive", "batch", "canary", "guarantee", "hindsight")
        if missed[k] is False
    ] == ["interactive", "canary", "guarantee", "hindsight"]
    assert dq.goals(_result(_row(7.0, 0.5, 0.7, cold=3)), fits=False)["guarantee"] is None


def test_it_prints_json_and_edits_the_doc_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "dq.yaml"
    path.write_text(SMALL)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"before\n{dq.TABLE_START}\nOLD-TABLE\n{dq.TABLE_END}\nafter\n")
    monkeypatch.setattr(dq, "DOC", doc)
    assert dq.main([str(path), "--policies", "lru,gdsf,loraplane"]) == 0
    out = json.loads(capsys.readouterr().out)
    (result,) = out["results"]
    assert set(result["goals"]) >= {"cost", "interactive", "batch", "canary", "hindsight"}
    assert "OLD-TABLE" in doc.read_text()  # not asked: untouched
    assert dq.main([str(path), "--policies", "lru,gdsf,loraplane", "--write-doc"]) == 0
    text = doc.read_text()
    assert "OLD-TABLE" not in text and "| dq (500) |" in text
    assert text.startswith("before\n") and text.endswith("after\n")


def test_a_run_without_baselines_or_without_the_default_prints_what_it_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "dq.yaml"
    path.write_text(SMALL)
    assert dq.main([str(path), "--policies", "loraplane"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["goals"]["cost"] is None and result["goals"]["interactive"] is None
    assert dq.main([str(path), "--policies", "lru"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["results"]
    assert result["goals"] is None and "lru" in result["policies"]
