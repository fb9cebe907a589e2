"""Kafka -> sink -> ClickHouse -> query pack, checked against numbers computed here."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import pytest

from loraplane.kernel.bus import read_topic
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.metrics import queries
from loraplane.metrics.clickhouse import connect
from loraplane.metrics.sink import Sink, SinkConfig, SinkStats
from loraplane.schemas.codec import decode
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.reasons import ArtifactReason
from tests.integration.metrics_env import (
    REPO,
    cache_event,
    count,
    env_for,
    metrics_env,
    produce_all,
    request_events,
    wait_for,
)

pytestmark = pytest.mark.integration

N = 400


def exact_quantile(values: list[float], level: float) -> float:
    """ClickHouse's quantileExact: the element at floor(level * n) of the sorted values."""
    ordered = sorted(values)
    return ordered[min(int(level * len(ordered)), len(ordered) - 1)]


@pytest.fixture(scope="module")
def loaded() -> Iterator[tuple[Settings, list, SinkStats]]:
    with metrics_env(Settings()) as settings:
        events = request_events(N, seed=7)
        # A replay (same bytes twice), a message that is not JSON, a value the table cannot
        # hold (UInt64 overflow) and a timestamp past DateTime's range (refused before the
        # insert, not by ClickHouse's client): exact counts, three dead letters, the rest
        # lands.
        produce_all(
            settings, "requests", [*events, events[0], events[1]], key=lambda m: m.adapter_id
        )
        produce_all(settings, "requests", [b"{not json"])
        loads = [cache_event(i, "load", swap_ms=10.0 * i) for i in range(1, 21)]
        produce_all(
            settings,
            "cache-events",
            [
                *loads,
                cache_event(100, "fail", reason=ArtifactReason.fetch_failed),
                cache_event(101, "kv_namespace_conflict"),
                cache_event(102, "load", size=2**70),
                cache_event(103, "evict").model_copy(
                    update={"ts": datetime(2200, 1, 1, tzinfo=UTC)}
                ),
            ],
        )
        stop = threading.Event()
        sink = Sink(settings, SinkConfig(batch_size=150, max_wait_s=0.3))
        thread = threading.Thread(target=sink.run, args=(stop,), daemon=True)
        thread.start()
        try:
            wait_for(lambda: count(settings, "request_log") == N, 60, "request_log rows")
            wait_for(lambda: count(settings, "dead_letters") == 3, 60, "dead letters table")
        finally:
            stop.set()
            thread.join(30)
        yield settings, events, sink.stats


def test_per_adapter_hit_rate_cold_and_ttft_match_independent_computation(loaded) -> None:
    settings, events, _ = loaded
    by_adapter = defaultdict(list)
    for e in events:
        by_adapter[e.adapter_id].append(e)
    client = connect(settings)
    params = queries.window("1h")
    merged = defaultdict(list)
    for r in queries.run(client, "adapter_summary", params):
        merged[r["adapter_id"]].append(r)
    assert set(merged) == set(by_adapter)
    for adapter, evs in by_adapter.items():
        got = merged[adapter]
        assert sum(r["requests"] for r in got) == len(evs)
        assert sum(r["cold"] for r in got) == sum(e.tier_at_arrival == "cold" for e in evs)
    # Per (adapter, tenant) row: rate and exact percentiles.
    for (adapter, tenant), evs in _group(events).items():
        row = next(r for r in merged[adapter] if r["tenant_id"] == tenant)
        gpu = sum(e.tier_at_arrival == "gpu" for e in evs)
        assert row["requests"] == len(evs)
        assert row["gpu_hits"] == gpu
        assert row["hot_adapter_hit_rate"] == round(gpu / len(evs), 4)
        ttfts = [e.ttft_ms for e in evs]
        assert row["ttft_p50_ms"] == exact_quantile(ttfts, 0.5)
        assert row["ttft_p95_ms"] == exact_quantile(ttfts, 0.95)
        assert row["ttft_p99_ms"] == exact_quantile(ttfts, 0.99)
    client.disconnect()


def _group(events: list) -> dict[tuple[str, str], list]:
    grouped = defaultdict(list)
    for e in events:
        grouped[(e.adapter_id, e.tenant_id)].append(e)
    return grouped


def test_replayed_events_count_once_in_rollups_too(loaded) -> None:
    settings, _, _ = loaded
    assert count(settings, "request_log", final=False) >= N  # the replay was inserted ...
    client = connect(settings)
    series = queries.run(client, "timeseries_requests", queries.window("1h"))
    assert sum(r["requests_n"] for r in series) == N  # ... and counted once
    client.disconnect()


def test_cache_summary_swap_percentiles_failures_and_conflicts(loaded) -> None:
    settings, _, _ = loaded
    client = connect(settings)
    [row] = queries.run(client, "cache_summary", queries.window("1h", adapter_id="alpha"))
    swaps = [10.0 * i for i in range(1, 21)]
    assert row["loads"] == 20
    assert row["swap_p50_ms"] == exact_quantile(swaps, 0.5)
    assert row["swap_p99_ms"] == exact_quantile(swaps, 0.99)
    assert row["load_failures"] == 1
    assert row["cold_load_fail_ratio"] == round(1 / 21, 4)
    assert row["kv_namespace_conflicts"] == 1
    [failure] = queries.run(client, "load_failures", queries.window("1h"))
    assert (failure["reason"], failure["failures"]) == (ArtifactReason.fetch_failed, 1)
    client.disconnect()


def test_undecodable_and_rejected_rows_are_dead_lettered_with_reasons(loaded) -> None:
    settings, _, stats = loaded
    letters = [
        decode(DeadLetter, r.value)
        for r in read_topic(settings, topic_name(settings, "dead-letters"))
    ]
    reasons = sorted(d.reason for d in letters)
    assert reasons == ["malformed", "out_of_range", "out_of_range"]
    (stamp,) = (d for d in letters if "DateTime range" in d.detail)
    assert stamp.source_topic == topic_name(settings, "cache-events")
    assert stamp.reason == "out_of_range"
    assert stats.dead_letters == 3
    assert count(settings, "cache_events") == 22  # the batch's other rows landed


def test_query_parameters_are_bound_not_formatted(loaded) -> None:
    """``window`` refuses a filter no column holds; below it, a value that got past it
    anyway is bound by the driver, never formatted into the SQL."""
    settings, _, _ = loaded
    client = connect(settings)
    with pytest.raises(ValueError, match="adapter_id must be an id"):
        queries.window("1h", adapter_id="alpha' OR '1'='1")
    bounds = queries.window("1h")
    hostile = queries.Params(bounds.since, bounds.until, adapter_id="alpha' OR '1'='1")
    assert queries.run(client, "adapter_summary", hostile) == []
    client.disconnect()


def test_every_query_of_the_pack_runs_on_this_server(loaded) -> None:
    settings, _, _ = loaded
    client = connect(settings)
    for name in queries.names():
        queries.run(client, name, queries.window("1h"))
    view = queries.adapter_view(client, queries.window("1h", adapter_id="alpha"))
    assert {r["adapter_id"] for r in view} == {"alpha"}
    assert any(r.get("loads") == 20 for r in view)
    client.disconnect()


def test_report_cli_prints_the_per_adapter_view(loaded) -> None:
    settings, events, _ = loaded
    loraplane = str(Path(sys.executable).parent / "loraplane")
    run = partial(
        subprocess.run, cwd=REPO, env=env_for(settings), capture_output=True, text=True, timeout=60
    )
    as_json = run([loraplane, "report", "--since", "1h", "--adapter", "alpha", "--json"])
    assert as_json.returncode == 0, as_json.stderr
    rows = json.loads(as_json.stdout)
    assert sum(r["requests"] for r in rows) == sum(e.adapter_id == "alpha" for e in events)
    assert any(r.get("loads") == 20 for r in rows)
    table = run([loraplane, "report", "--since", "1h"])
    assert table.returncode == 0, table.stderr
    assert "alpha" in table.stdout and "hit rate" in table.stdout
    print(table.stdout)
