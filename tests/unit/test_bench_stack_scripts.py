"""The benchmarks that need the real stack run on a tiny size and print one JSON object with
both figures and the ratio (no timing asserted); with ``--write-doc`` the row lands in the
given doc."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import (
    artifact_path,
    gateway_overhead,
    reaction_time,
    registry_memory,
    sink_throughput,
    stream_throughput,
)
from loraplane.kernel.config import Settings

pytestmark = pytest.mark.integration


def run_json(main, args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    main([*args, "--write-doc", str(tmp_path / "benchmarks.md")])
    out = json.loads(capsys.readouterr().out)
    assert (tmp_path / "benchmarks.md").read_text().count(out["benchmark"]) == 1
    return out


def test_artifact_path(stack: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(artifact_path.main, ["--sizes", "1", "2", "--reps", "1"], tmp_path, capsys)
    assert out["loraplane_mib_s"]["median"] > 0
    assert out["baseline"] in ("download_file", "get_object")
    assert out["ratio"] > 0


def test_sink_throughput(
    stack: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_json(
        sink_throughput.main, ["--rows", "600", "--batch", "100", "--reps", "1"], tmp_path, capsys
    )
    assert out["sink_rows_s"]["median"] > 0 and out["raw_insert_rows_s"]["median"] > 0
    assert out["ratio"] > 0


def test_stream_throughput(
    stack: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_json(
        stream_throughput.main,
        ["--events", "300", "--adapters", "20", "--reps", "1"],
        tmp_path,
        capsys,
    )
    assert out["loraplane_events_s"]["median"] > 0 and out["raw_consume_events_s"]["median"] > 0
    assert out["ratio"] > 0
    assert out["loraplane_events_per_cpu_s"]["median"] > 0 and out["cpu_ratio"] > 0


def test_gateway_overhead(
    stack: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_json(
        gateway_overhead.main,
        ["--requests", "40", "--concurrency", "4", "--reps", "1"],
        tmp_path,
        capsys,
    )
    assert out["vllm"].startswith("fake")
    assert out["gateway_rps"]["median"] > 0 and out["direct_rps"]["median"] > 0
    assert {"added_p50_ms", "added_p99_ms", "ratio"} <= set(out)
    assert out["worker_cpu_ms_per_request"]["median"] >= 0  # /proc ticks: 0 for so few
    assert out["vllm_cpu_ms_per_request"]["median"] >= 0


def test_reaction_time(stack: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        reaction_time.main, ["--bursts", "2", "--background-rate", "50"], tmp_path, capsys
    )
    reaction = out["first_event_to_load_gpu_consumed_ms"]
    assert 0 < reaction["p50"] <= reaction["p99"]
    assert out["kafka_round_trip_floor_ms"]["p99"] > 0
    assert out["planner"] == "own process"
    # where each reaction's time went, for every burst whose score record was seen
    assert out["stages_timed"] == 0 or set(out["stages_ms"]) == {
        "keeper",
        "scores_commit",
        "planner",
        "delivery",
    }


def test_registry_memory(
    stack: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_json(
        registry_memory.main, ["--adapters", "40", "--base-models", "4"], tmp_path, capsys
    )
    worker, every = out["worker"], out["every_base_model"]
    assert worker["scoped_code"] and worker["views_accepted"] == worker["lora_names"] == 10
    assert worker["records_kept"] == 10 and worker["records_read_past"] == 30
    assert every["views_accepted"] == 40 and every["records_read_past"] == 0
    assert worker["state_mb"] <= every["state_mb"] and worker["state_bytes_per_view"] > 0
    assert worker["rss_mb"] > 0
    assert out["selection_per_record"]["header_us"] > 0
