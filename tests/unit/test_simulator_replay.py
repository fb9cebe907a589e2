"""Replaying request-log rows: rows -> workload and worker states -> fleet (simulator.replay),
and the CLI's errors before any row is read."""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from loraplane.cli import app
from loraplane.schemas.registry import AdapterView
from loraplane.schemas.worker_state import LoadedAdapter, WorkerState
from loraplane.simulator import benchmark
from loraplane.simulator.replay import (
    AdapterFacts,
    RequestRow,
    WhatIf,
    WorkerFacts,
    adapter_facts,
    build,
    row_of,
    worker_facts,
)
from loraplane.simulator.scenario import Scenario

BASE = Scenario(name="replay-test")
T0 = 1_764_633_600.0  # 2025-12-02T00:00:00Z

rows_strategy = st.lists(
    st.builds(
        RequestRow,
        ts=st.floats(T0, T0 + 86_400, allow_nan=False),
        base_model=st.sampled_from(["llama", "qwen"]),
        adapter_id=st.sampled_from(["a", "b", "c-1"]),
        adapter_version=st.sampled_from(["", "1", "1.0", "2", "1.1.0", "v3"]),
        tenant_id=st.sampled_from(["acme", "globex"]),
        worker_id=st.sampled_from(["w0", "w1", "w2"]),
        request_class=st.sampled_from(["interactive", "batch", "canary", "shadow"]),
        prompt_tokens=st.integers(0, 10_000),
        output_tokens=st.integers(0, 10_000),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(rows_strategy, st.integers(0, 2**32 - 1), st.randoms(use_true_random=False))
def test_any_rows_replay_as_the_same_requests_sorted_whatever_their_order(
    rows: list[RequestRow], seed: int, rnd: random.Random
) -> None:
    shuffled = rows[:]
    rnd.shuffle(shuffled)
    base = BASE.model_copy(update={"seed": seed})
    one, two = build(rows, [], {}, base), build(shuffled, [], {}, base)
    assert (one.catalog, one.requests, one.scenario) == (two.catalog, two.requests, two.scenario)
    req = one.requests
    assert len(req) == len(rows) and one.summary["rows"] == len(rows)
    assert req.time_s == sorted(req.time_s) and req.time_s[0] == 0.0
    assert one.scenario.seed == seed
    assert sum(req.batch) == sum(r.request_class == "batch" for r in rows)
    assert min(req.output_tokens) >= 1
    # every request names the catalog entry of its own base model and adapter
    pools = [b.name for b in one.scenario.fleet.base_models]
    want = sorted((r.base_model, r.adapter_id) for r in rows)
    got = sorted(
        (pools[one.catalog.adapters[a].base_model], one.catalog.adapters[a].adapter_id)
        for a in req.adapter
    )
    assert got == want
    # one stable version per adapter, every other version a canary of it
    for a in one.catalog.adapters:
        if a.stable_of is not None:
            stable = one.catalog.adapters[a.stable_of]
            assert (stable.adapter_id, stable.base_model, stable.is_canary) == (
                a.adapter_id,
                a.base_model,
                False,
            )


def _rows(
    n: int,
    base_model: str = "llama",
    adapter_version: str = "1.0.0",
    tenant_id: str = "acme",
    worker_id: str = "w0",
    request_class: str = "interactive",
) -> list[RequestRow]:
    """``n`` rows a second apart over adapters a0, a1, a2 in turn."""
    return [
        RequestRow(
            T0 + i,
            base_model,
            f"a{i % 3}",
            adapter_version,
            tenant_id,
            worker_id,
            request_class,
            10,
            20,
        )
        for i in range(n)
    ]


def test_a_replay_runs_every_kind_of_policy_and_is_deterministic_per_seed() -> None:
    rows = (
        _rows(36)
        + _rows(6, adapter_version="1.1.0", request_class="canary")
        + _rows(6, adapter_version="", worker_id="w1", request_class="batch")
    )
    replayed = build(rows, [], {}, BASE.model_copy(update={"seed": 5}))
    bench = benchmark.Workbench(replayed.scenario, replayed.catalog, replayed.requests)
    names = ["lru", "gdsf", "static-merge", "dynamo", "loraplane", "loraplane-demand"]
    first, second = benchmark.run(bench, names), benchmark.run(bench, names)
    for result in (first, second):
        result.pop("timing_s")
    assert first == second and first["requests"] == 48
    assert all(sum(p["routes"].values()) == 48 for p in first["policies"].values())
    canaries = [a for a in replayed.catalog.adapters if a.is_canary]
    assert {(a.version, a.canary_percent) for a in canaries} == {("1.1.0", 12.5), ("0", 12.5)}


def test_the_fleet_comes_from_the_worker_states_and_the_what_if_from_the_operator() -> None:
    rows = _rows(6) + _rows(3, base_model="qwen", worker_id="q9")
    states = [
        WorkerFacts("w0", "llama", 16, 8_000_000_000, 64),
        WorkerFacts("w5", "llama", 12, 4_000_000_000, 32),
    ]
    replayed = build(rows, states, {}, BASE)
    llama, qwen = replayed.scenario.fleet.base_models
    assert (llama.name, llama.workers, llama.gpu_slots_per_worker, llama.host_bytes_per_worker) == (
        "llama",
        2,
        16,
        8e9,
    )
    default = BASE.fleet.base_models[0]
    assert (qwen.name, qwen.workers, qwen.gpu_slots_per_worker) == (
        "qwen",
        1,
        default.gpu_slots_per_worker,
    )
    assert any("qwen: no worker state" in n for n in replayed.notes)
    # no registry: sized at the pool's max LoRA rank, which the states say
    sizes = {(a.base_model, a.rank) for a in replayed.catalog.adapters}
    assert sizes == {(0, 64), (1, max(BASE.workload.ranks))}
    more = build(rows, states, {}, BASE, WhatIf(add_workers=2, gpu_slots=32))
    assert [(b.workers, b.gpu_slots_per_worker) for b in more.scenario.fleet.base_models] == [
        (4, 32),
        (3, 32),
    ]
    seeded = BASE.model_copy(update={"overrides": {"lru": {"gpu_slots_per_worker": 2}}})
    assert build(rows, states, {}, seeded).scenario.overrides == {}  # the real fleet's slots
    exact = build(rows, states, {}, BASE, WhatIf(workers=5))
    assert [b.workers for b in exact.scenario.fleet.base_models] == [5, 5]


def test_priority_rank_size_and_owner_come_from_the_registry() -> None:
    rows = _rows(9, tenant_id="someone-else")
    facts = {("llama", "a0", "1.0.0"): AdapterFacts(8, 5e6, "platinum", "acme", active=True)}
    replayed = build(rows, [], facts, BASE)
    a0 = next(a for a in replayed.catalog.adapters if a.adapter_id == "a0")
    assert (a0.priority, a0.rank, a0.size_bytes, a0.tenant) == ("platinum", 8, 5e6, "acme")
    a1 = next(a for a in replayed.catalog.adapters if a.adapter_id == "a1")
    assert (a1.priority, a1.tenant) == ("silver", "someone-else")
    assert any("2 of 3 adapter versions" in n for n in replayed.notes)


def test_facts_of_registry_views_and_worker_states() -> None:
    now = datetime.now(UTC)
    loaded = LoadedAdapter(
        lora_name="a1@2",
        adapter_id="a1",
        version="2",
        tenant_id="acme",
        tier="gpu",
        rank=32,
        size_bytes=7,
    )
    state = WorkerState(
        worker_id="w0",
        base_model="llama",
        ts=now,
        gpu_slots_used=1,
        gpu_slots_total=4,
        host_bytes_used=0,
        host_bytes_budget=10,
        max_lora_rank=64,
        adapters=[loaded],
    )
    record = {
        "adapter_id": "a0",
        "base_model": "llama",
        "version": "1",
        "rank": 16,
        "artifact_uri": "s3://loraplane-artifacts/a0/1/",
        "sha256": "0" * 64,
        "size_bytes": 99,
        "status": "canary",
        "tenant_id": "acme",
        "priority": "gold",
        "compatibility": {"target_modules": ["q_proj"], "max_lora_rank": 64},
        "release": {"canary_percent": 25},
    }
    view = AdapterView.model_validate(
        {
            "adapter_id": "a0",
            "tenant_id": "acme",
            "base_model": "llama",
            "versions": [record],
            "last_seq": 1,
            "last_event_id": "e1",
            "updated_at": now,
        }
    )
    facts = adapter_facts([view], [state])
    assert facts[("llama", "a0", "1")] == AdapterFacts(16, 99.0, "gold", "acme", False, 25.0)
    assert facts[("llama", "a1", "2")] == AdapterFacts(32, 7.0, tenant_id="acme")
    assert worker_facts([state]) == [WorkerFacts("w0", "llama", 4, 10, 64)]


def test_a_clickhouse_row_converts_with_or_without_a_time_zone() -> None:
    naive = datetime(2025, 12, 2, 0, 0, 1, 500_000)
    values = (naive, "llama", "a0", "1", "acme", "w0", "batch", 3, 4)
    assert row_of(values) == RequestRow(T0 + 1.5, "llama", "a0", "1", "acme", "w0", "batch", 3, 4)
    assert row_of((naive.replace(tzinfo=UTC), *values[1:])) == row_of(values)
    with pytest.raises(ValueError, match="no request rows"):
        build([], [], {}, BASE)


@pytest.mark.parametrize(
    ("args", "code", "said"),
    [
        (["--since", "1x"], 2, "invalid duration '1x'"),
        (["--since", "1h", "--trace", __file__], 2, "two workloads: give one"),
        (["--workers", "3", "--add-workers", "1"], 2, "--workers sets the count"),
    ],
)
def test_cli_usage_errors(args: list[str], code: int, said: str) -> None:
    result = CliRunner().invoke(app, ["simulate", "--from-clickhouse", *args])
    assert result.exit_code == code and said in result.output


def test_cli_says_which_clickhouse_it_could_not_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplane.kernel.config import get_settings

    monkeypatch.setenv("LORAPLANE_CLICKHOUSE__TCP_PORT", "1")
    monkeypatch.setenv("LORAPLANE_CLICKHOUSE__READER_PASSWORD", "x")
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["simulate", "--from-clickhouse", "--since", "1h"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 1, result.output
    assert "cannot read ClickHouse at 127.0.0.1:1, database" in result.output


def test_what_if_options_need_a_replay() -> None:
    result = CliRunner().invoke(app, ["simulate", "--add-workers", "2"])
    assert result.exit_code == 2 and "go with --from-clickhouse" in result.output


def _named(n: int, field: str) -> list[RequestRow]:
    """``n`` rows, each naming its own ``field`` (an id a writer of the topic chose)."""
    row = RequestRow(T0, "llama", "a", "1", "acme", "w0", "interactive", 1, 1)
    spell = str if field == "adapter_version" else "x{}".format
    return [row._replace(ts=T0 + i, **{field: spell(i)}) for i in range(n)]


@pytest.mark.parametrize(
    ("field", "what"),
    [
        ("adapter_id", "adapter versions"),
        ("adapter_version", "adapter versions"),
        ("tenant_id", "tenants"),
        ("worker_id", "workers of one base model"),
        ("base_model", "base models"),
    ],
)
def test_attack_rows_naming_more_ids_than_a_replay_holds_are_refused_by_name(
    field: str, what: str
) -> None:
    """ATTACK: request rows naming 100,001 adapters (a tenant's refused requests carry the id
    it sent), versions, tenants, workers or base models (a writer of the requests topic
    chooses each). Before, the replay built a catalog or fleet of them and pydantic then
    refused a count (``workload.adapters``), with no word of the window; 100,001 base models
    were never reached, as the fleet walked every row once a pool (10^10 steps). Now the
    counts are asked first, naming what and the way out."""
    with pytest.raises(ValueError, match=f"name 100001 {what}, more than a replay holds"):
        build(_named(100_001, field), [], {}, BASE)
    build(_named(3, field), [], {}, BASE)  # a few are a replay


def test_attack_worker_states_naming_more_workers_than_a_replay_holds_are_refused() -> None:
    """ATTACK: a writer of the worker-state topic announces 100,001 workers of the pool the
    rows use. The fleet counts a pool's workers from the rows and the states together, so
    the bound counts them the same way: refused by name before a fleet is built; a pool's
    states under another base model, which the replay does not build, do not count."""
    from loraplane.simulator.scenario import MAX_COUNT

    rows = _named(3, "tenant_id")
    many = [WorkerFacts(f"s{i}", "llama", 4, 10, 64) for i in range(MAX_COUNT + 1)]
    # the rows' own worker, w0, is one more
    with pytest.raises(ValueError, match=f"name {MAX_COUNT + 2} workers of one base model"):
        build(rows, many, {}, BASE)
    elsewhere = [dataclasses.replace(w, base_model="other") for w in many]
    build(rows, elsewhere, {}, BASE)


def test_a_window_of_more_rows_than_a_replay_holds_is_never_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ATTACK (or just a busy fleet): a window of more request rows than the simulator takes
    (10^7). Before, every row was read into memory (a tuple and six strings each) and then
    refused by the workload's bound; now the count refuses it before the read."""
    from loraplane.metrics import clickhouse, queries
    from loraplane.simulator.scenario import MAX_REQUESTS

    class Client:
        def disconnect(self) -> None:
            pass

    def never_read(client: object, params: object) -> object:
        raise AssertionError("rows read past the count")
        yield

    monkeypatch.setattr(clickhouse, "connect", lambda *a, **k: Client())
    monkeypatch.setattr(queries, "count_arrivals", lambda client, params: MAX_REQUESTS + 1)
    monkeypatch.setattr(queries, "request_arrivals", never_read)
    result = CliRunner().invoke(app, ["simulate", "--from-clickhouse", "--since", "7d"])
    assert result.exit_code == 2, result.output
    assert f"holds {MAX_REQUESTS + 1} request rows, more than a replay holds" in result.output
    assert "give a shorter --since" in result.output
