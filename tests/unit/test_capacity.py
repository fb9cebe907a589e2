"""``loraplane capacity``: the target parser, the sweep's answer (the smallest fleet that
reaches every target) and the command's output, progress and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from loraplane import extras
from loraplane.cli import app
from loraplane.simulator import benchmark, capacity
from loraplane.simulator.capacity import CLASSES, Grid, TargetError, parse_targets
from loraplane.simulator.scenario import load_scenario

SMALL = """
name: cap
seed: 3
workload: {requests: 600, rate_qps: 4, adapters: 24, batch_fraction: 0.3}
fleet: {base_models: [{workers: 1, gpu_slots_per_worker: 2}]}
adapter_cache_policy: {request_budgets: {interactive: {max_wait_ms: 250}}}
"""


@given(st.dictionaries(st.sampled_from(CLASSES), st.floats(0.001, 1.0), min_size=1))
def test_targets_read_back_what_was_written(targets: dict[str, float]) -> None:
    text = ",".join(f"{k}={v!r}" for k, v in targets.items())
    assert parse_targets(text) == targets


@pytest.mark.parametrize(
    "text",
    [
        "",
        "interactive",
        "interactive=",
        "bronze=0.9",
        "interactive=1.5",
        "interactive=0",
        "batch=x",
        "batch=0.9,batch=0.8",
    ],
)
def test_a_target_that_does_not_parse_says_so(text: str) -> None:
    with pytest.raises(TargetError):
        parse_targets(text)


def test_the_answer_is_the_smallest_point_that_reaches_every_target(tmp_path: Path) -> None:
    path = tmp_path / "cap.yaml"
    path.write_text(SMALL)
    bench = benchmark.prepare(load_scenario(path))
    grid = Grid((1, 2, 3), (2, 4), (6,))
    (found,) = capacity.sweep(bench, "lru", {"interactive": 0.4}, {0: grid})
    assert found.answer is not None and found.answer.meets
    assert all(not p.meets for p in found.points if p.workers < found.answer.workers)
    assert all(p.workers <= found.answer.workers for p in found.points)  # stopped there
    same = [p for p in found.points if p.workers == found.answer.workers and p.meets]
    assert found.answer == min(same, key=lambda p: (p.slots, p.loads_per_minute))
    (never,) = capacity.sweep(bench, "lru", {"interactive": 1.0}, {0: Grid((1,), (2,), (6,))})
    assert never.answer is None and len(never.points) == 1


def test_the_command_answers_writes_json_and_png_and_shows_progress(tmp_path: Path) -> None:
    path = tmp_path / "cap.yaml"
    path.write_text(SMALL)
    out, png = tmp_path / "cap.json", tmp_path / "cap.png"
    result = CliRunner().invoke(
        app,
        [
            "capacity",
            "--scenario",
            str(path),
            "--target",
            "interactive=0.3,batch=0.3",
            "--workers",
            "1,2",
            "--slots",
            "2,4",
            "--loads",
            "6",
            "--policy",
            "lru",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["targets"] == {"interactive": 0.3, "batch": 0.3} and data["policy"] == "lru"
    (pool,) = data["pools"]
    answer = pool["answer"]
    assert answer is not None and answer["meets"]
    assert f"{answer['workers']} workers x {answer['slots']} GPU slots" in result.stdout
    assert "[1/4] 1 workers x 2 slots, 6 loads/min" in result.stderr  # progress as it runs
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_target_no_point_reaches_exits_1_and_says_what_the_largest_reached(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cap.yaml"
    path.write_text(SMALL)
    result = CliRunner().invoke(
        app,
        [
            "capacity",
            "--scenario",
            str(path),
            "--target",
            "interactive=1.0",
            "--workers",
            "1",
            "--slots",
            "2",
            "--loads",
            "6",
            "--policy",
            "lru",
        ],
    )
    assert result.exit_code == 1
    assert "no point of the grid reaches the target" in result.stdout


@pytest.mark.parametrize(
    "args, said",
    [
        (["--target", "interactive=0.9"], "give --scenario FILE or --from-clickhouse"),
        (["--target", "fast=0.9", "--scenario", "{path}"], "expected CLASS=SHARE"),
        (["--target", "batch=0.9", "--scenario", "{path}", "--workers", "0"], "at least 1"),
        (["--target", "batch=0.9", "--scenario", "{path}", "--slots", "a,b"], "whole numbers"),
        (
            ["--target", "batch=0.9", "--scenario", "{path}", "--policy", "nope"],
            "unknown policy 'nope'",
        ),
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, args: list[str], said: str) -> None:
    path = tmp_path / "cap.yaml"
    path.write_text(SMALL)
    result = CliRunner().invoke(app, ["capacity", *[a.format(path=path) for a in args]])
    assert result.exit_code == 2
    assert said in result.output


def test_without_the_sim_extra_it_exits_2_with_the_install_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(extras, "missing", lambda extra: ["scipy"])
    result = CliRunner().invoke(app, ["capacity", "--target", "batch=0.9"])
    assert result.exit_code == 2
    assert "pip install 'loraplane[sim]'" in result.output
