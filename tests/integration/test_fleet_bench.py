"""``bench.fleet_scale`` at a tiny size on the real broker: it runs end to end and says what
it measured (the figures themselves are docs/benchmarks.md's subject, not this test's)."""

from __future__ import annotations

import json

import pytest

from bench.fleet_scale import run
from loraplane.kernel.config import Settings

pytestmark = pytest.mark.integration


def test_fleet_bench_tiny(stack: Settings) -> None:
    r = run(
        stack,
        workers=4,
        adapters=40,
        processes=2,
        probes=2,
        slots=2,
        heartbeat_s=5.0,
        quiet_s=2.0,
        timeout_s=120.0,
        bases=2,
    )
    print(json.dumps(r))  # the bench prints it as one JSON object
    # every load the planner issued reached its worker's feed, verified, and only there:
    # per base model, its 2 workers' 4 slots
    assert r["commands_issued"] == r["commands_received"] == r["hot_adapters"] == 8
    assert r["workers_with_commands"] == 4
    for name in (
        "delivery_issued_to_received_ms",
        "delivery_broker_to_received_ms",
        "kafka_round_trip_floor_ms",
        "planner_tick_with_kafka_io_ms",
    ):
        d = r[name]
        assert 0 <= d["p50"] <= d["p99"] <= d["max"], name
    assert r["delivery_issued_to_received_ms"]["n"] == 8
    # worker j reads command slot j: exactly its own commands' bytes
    assert r["command_partitions"] == "slots 0..W-1"
    assert r["read_over_own"]["p50"] == r["read_over_own"]["max"] == 1.0
    assert r["bytes_read_per_worker"]["max"] <= r["commands_topic_bytes"]
    assert r["registry_convergence_ms"]["n"] == 2
    assert r["registry_tail_first_read_s"] >= 0
    # each worker's tail holds its base model's 20 adapters and its probe, no other
    assert r["registry_records_per_worker"]["p50"] == r["registry_records_per_worker"]["max"] == 21
    assert r["unscoped_tail"]["registry_records"] == 40  # read before the probes
    assert r["probes_seen_by_other_base_models"] == 0
    assert 0 < r["registry_state_worker_over_unscoped"] < 1
    assert isinstance(r["takeover"]["measurable"], bool) and r["takeover"]
