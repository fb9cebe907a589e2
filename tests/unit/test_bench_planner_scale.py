"""bench.planner_scale runs on a tiny size and prints one JSON object (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import planner_scale


def test_tiny_run_prints_json_and_writes_its_row_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "benchmarks.md"
    planner_scale.main(
        ["--adapters", "50", "200", "--workers", "10", "20", "--reps", "1", "--write-doc", str(doc)]
    )
    out = json.loads(capsys.readouterr().out)
    assert [(c["adapters"], c["workers"]) for c in out["cases"]] == [
        (50, 10),
        (50, 20),
        (200, 10),
        (200, 20),
    ]
    assert all(c["cold_commands"] > 0 for c in out["cases"])  # an empty fleet gets loads
    for c in out["cases"]:  # the first tick bounds its prewarms; the host tier follows
        assert c["cold_commands"] <= c["cold_commands_unbounded"]
        assert c["ticks_to_host_tier"] >= 0
        assert {"cold_ms", "prime_ms", "unprimed_ms"} <= c.keys()
    assert {tick: set(g) for tick, g in out["growth"].items()} == {
        tick: {"vs_adapters", "vs_workers"} for tick in ("cold", "steady")
    }
    assert "bench.planner_scale" in out["command"]
    assert "planner tick (200 adapters x 20 workers)" in doc.read_text()
