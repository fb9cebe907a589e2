"""The simulator against hand-computed tiny traces, and its determinism."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loraplane.cli import app
from loraplane.simulator import benchmark
from loraplane.simulator.engine import simulate
from loraplane.simulator.policies import ALL, BYPASS, CachePolicy, policy_factory, resolve
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import Scenario, load_scenario
from loraplane.simulator.trace import TraceError, load_trace
from tests.unit.simulator_tiny import catalog, requests, scenario

CLASSIC = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]  # the textbook trace, 3 slots
SCENARIOS = Path(__file__).resolve().parents[2] / "bench" / "scenarios"


def hits(name: str, trace: list[int], slots: int) -> int:
    n = max(trace) + 1
    return simulate(scenario(slots), catalog(n), requests(trace), policy_factory(name)).gpu_hits


def test_lru_exact_hits_on_classic_trace() -> None:
    # 10 faults with LRU: hits are the 1,2 at positions 4,5 only.
    assert hits("lru", CLASSIC, 3) == 2


def test_fifo_exact_hits_on_classic_trace() -> None:
    # Belady's anomaly trace: FIFO with 3 frames faults 9 times.
    assert hits("fifo", CLASSIC, 3) == 3


def test_belady_exact_hits_on_classic_trace() -> None:
    # MIN faults 7 times (1 2 3 | 4 bypassed | 1 2 hit | 5 bypassed | 1 2 3 hit | 4 5).
    assert hits("belady", CLASSIC, 3) == 5


def test_lru_and_belady_on_short_trace() -> None:
    # A B A C A B, 2 slots. LRU: C evicts B, B comes back as a miss -> 2 hits.
    # Belady: C is never used again, so it is bypassed and B stays -> 3 hits.
    trace = [0, 1, 0, 2, 0, 1]
    assert hits("lru", trace, 2) == 2
    assert hits("belady", trace, 2) == 3


def test_counters_on_a_known_trace() -> None:
    sc = scenario(2)
    c = simulate(sc, catalog(3), requests([0, 1, 0, 2, 0, 1]), policy_factory("lru"))
    s = c.summary()
    assert (c.gpu_hits, c.swaps, c.cold_loads, c.host_hits) == (2, 4, 3, 1)
    assert s["fallbacks"] == 0
    # every miss waits one swap (+ an S3 fetch when cold), nothing else
    assert s["ttft_penalty_ms"]["p50"] > 0 and s["weighted_miss_cost"] > 0


def test_spent_load_budget_sends_interactive_to_the_base_model() -> None:
    sc = scenario(1)
    sc = sc.model_copy(
        update={"policy": sc.policy.model_copy(update={"cold_loads_per_minute_per_worker": 1})}
    )
    c = simulate(sc, catalog(3), requests([0, 1, 2]), policy_factory("lru"))
    assert (c.swaps, c.fallbacks) == (1, 2)


def test_a_429_for_a_spent_budget_is_charged_its_retry_after() -> None:
    """One slot, one load a minute, batch requests 5 s apart: the first loads, the second
    finds the budget spent for 55 s, more than batch's 30 s wait, and gets a 429 whose
    Retry-After is those 55 s (what the gateway sends: ``LoadBudget.retry_after_s``). It is
    charged them, not the class's 5 s, which is for a refusal that has nothing to wait for."""
    sc = scenario(1)
    sc = sc.model_copy(
        update={"policy": sc.policy.model_copy(update={"cold_loads_per_minute_per_worker": 1})}
    )
    c = simulate(
        sc, catalog(2), requests([0, 1], batch=[True, True], gap_s=5.0), policy_factory("lru")
    )
    assert (c.swaps, c.retries) == (1, 1)
    first = c.ttft_penalty_ms[0]  # the load of the first (fetch + swap)
    assert c.ttft_penalty_ms[1] == pytest.approx(55_000.0)
    assert c.weighted_miss_cost == pytest.approx(first + 55_000.0)  # bronze: weight 1


class _Declines(CachePolicy):
    """Loads anything on a miss, evicting its only resident, except adapter 2, whose load its
    admission refuses whatever the budget."""

    name = "declines-2"

    def on_hit(self, worker: int, adapter: int, i: int, now: float) -> None:
        pass

    def on_miss(self, worker: int, adapter: int, i: int, now: float, full: bool) -> int | None:
        if adapter == 2:
            return BYPASS
        return next(iter(self.ctx.residents[worker])) if full else None

    def declines(self, worker: int, adapter: int, i: int, now: float, full: bool) -> bool:
        return adapter == 2


def test_a_load_admission_refuses_gets_the_class_answer_even_while_the_budget_is_spent() -> None:
    """The gateway asks admission before the budget: a request whose load would be refused
    anyway is told the class's own Retry-After (5 s), not the wait for the budget (55 s)."""
    sc = scenario(1)
    sc = sc.model_copy(
        update={"policy": sc.policy.model_copy(update={"cold_loads_per_minute_per_worker": 1})}
    )
    reqs = Requests([0.0, 5.0, 6.0], [0, 1, 2], [180] * 3, [True] * 3)
    c = simulate(sc, catalog(3), reqs, _Declines)
    assert c.retries == 2
    assert c.ttft_penalty_ms[1] == pytest.approx(55_000.0)  # admitted, waits for the budget
    assert c.ttft_penalty_ms[2] == pytest.approx(5_000.0)  # refused by admission


def test_slo_attainment_is_the_share_served_by_the_adapter_within_the_class_budget(
    tmp_path: Path,
) -> None:
    """A request attains its class's SLO when its adapter served it (no base-model fallback,
    no 429 retry) within the class's TTFT budget; canary versions' requests are counted apart."""
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    small = load_scenario(path)
    costs = small.fleet.costs
    assert small.policy.request_budgets.interactive.on_cold == "fallback"
    retry_ms = small.policy.request_budgets.batch.retry_after_s * 1000.0
    for budget_ms in (0.0, 250.0, 1e9):
        sc = small.model_copy(
            update={
                "fleet": small.fleet.model_copy(
                    update={
                        "costs": costs.model_copy(
                            update={"slo_ttft_ms": {"interactive": budget_ms, "batch": budget_ms}}
                        )
                    }
                )
            }
        )
        bench = benchmark.prepare(sc)
        for name in ("lru", "gdsf", "loraplane"):
            c = benchmark.run_policy(bench, name)
            within = sum(p <= budget_ms for p in c.ttft_penalty_ms)
            (n_i, met_i), (n_b, met_b) = c.slo["interactive"], c.slo["batch"]
            assert n_i + n_b == c.requests and 0 < n_b < c.requests
            # a fallback waits 0 ms and a batch retry its Retry-After: both miss
            assert c.retries > 0
            assert met_i + met_b == within - c.fallbacks - (
                c.retries if budget_ms >= retry_ms else 0
            )
            assert c.slo["canary"][0] > 0 and c.slo["canary"][1] <= c.slo["canary"][0]
            if budget_ms == 1e9:
                assert met_i + met_b == c.requests - c.fallbacks - c.retries


SMALL = """
name: small
seed: 5
workload:
  requests: 1500
  rate_qps: 10
  cv: 2.0
  diurnal: {amplitude: 0.5, period_s: 120}
  adapters: 20
  batch_fraction: 0.3
  canaries: {count: 2, percent: 20}
  bursts: [{at_s: 30, duration_s: 20, share: 0.5, rank: 15}]
  peaks: [{at_s: 60, duration_s: 30, qps: 2, rank: 18, lead_s: 60}]
fleet: {base_models: [{workers: 2, gpu_slots_per_worker: 2}]}
"""


def test_same_seed_same_result(tmp_path: Path) -> None:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    small = load_scenario(path)
    a, b = benchmark.prepare(small), benchmark.prepare(small)
    assert a.requests == b.requests
    assert a.catalog == b.catalog
    for name in ("lru", "s3-fifo", "loraplane"):
        assert benchmark.run_policy(a, name).summary() == benchmark.run_policy(b, name).summary()
    other = benchmark.prepare(small.model_copy(update={"seed": small.seed + 1}))
    assert other.requests != a.requests


def test_every_shipped_scenario_parses() -> None:
    files = sorted(SCENARIOS.rglob("*.yaml"))  # the held-out ones too
    assert len(files) >= 5
    for path in files:
        sc = load_scenario(path)
        resolve(sc.policies)
        if sc.workload.trace:
            assert Path(sc.workload.trace).is_file(), path


def test_trace_loader(tmp_path: Path) -> None:
    good = tmp_path / "t.csv"
    good.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
    )
    times, tokens = load_trace(good)
    assert times.tolist() == pytest.approx([0.0, 4.314579])
    assert tokens.tolist() == [44, 109]
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nnot-a-time,1,2\n")
    with pytest.raises(TraceError, match=r"bad\.csv:2"):
        load_trace(bad)


def test_cli_writes_json_in_the_documented_shape_and_plots(tmp_path: Path) -> None:
    sc = tmp_path / "s.yaml"
    sc.write_text(
        "name: cli\nseed: 2\nworkload: {requests: 400, rate_qps: 5, adapters: 12}\n"
        "sweep: {gpu_slots_per_worker: [1, 2]}\n"
        "adapter_cache_policy: {request_budgets: {interactive: {max_wait_ms: 1000}}}\n"
    )
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--scenario",
            str(sc),
            "--policies",
            "all",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {
        "scenario",
        "requests",
        "policies",
        "optimum",
        "bound",
        "bounds",
        "hindsight",
        "kinds",
    } <= set(data)
    assert data["requests"] == 400 and set(data["policies"]) == set(ALL)
    for metrics in data["policies"].values():
        assert set(metrics) == {
            "gpu_hit_rate",
            "host_hit_rate",
            "cold_loads",
            "swaps",
            "fallbacks",
            "retries",
            "retry_wait_s_mean",
            "declined",
            "queued",
            "ttft_penalty_ms",
            "weighted_miss_cost",
            "platinum_cold_starts",
            "canary_cold_starts",
            "routes",
            "slo_attainment",
            "slo_attainment_by_priority",
        }
        assert set(metrics["slo_attainment"]) <= {"interactive", "batch", "canary"}
        assert set(metrics["slo_attainment_by_priority"]) <= {
            "bronze",
            "silver",
            "gold",
            "platinum",
        }
        assert all(0 <= v <= 1 for v in metrics["slo_attainment"].values())
        assert sum(metrics["routes"].values()) == 400
        assert set(metrics["ttft_penalty_ms"]) == {"p50", "p95", "p99"}
    assert data["optimum"]["exact"] is True
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "cli-hit-rate.png",
        "cli-weighted-cost.png",
    ]


def test_cli_rejects_an_unknown_policy(tmp_path: Path) -> None:
    sc = tmp_path / "s.yaml"
    sc.write_text("name: cli\n")
    result = CliRunner().invoke(app, ["simulate", "--scenario", str(sc), "--policies", "nope"])
    assert result.exit_code == 2
    assert "unknown policy 'nope'" in result.output


def test_loraplane_demand_frees_the_slots_of_idle_platinum_adapters() -> None:
    # Four platinum adapters, two slots. The first hour wants a0 and a1, two hours later only
    # a2 and a3. Conditioned on demand, the idle pins go and a2, a3 get slots. With the seed's
    # guard all four are never-evict: the worker protects the first it loaded for good (its
    # own cap, max_protected_gpu_share of its 2 slots), so a2 and a3 share the other slot and
    # take it in turn (each request's own load; the planner's cap does not bind the worker).
    sc = scenario(2)
    sc = sc.model_copy(update={"policy": sc.policy.model_copy(update={"planner_interval_s": 60.0})})
    trace = [0, 1] * 30 + [2, 3] * 30
    times = [float(i) for i in range(60)] + [7200.0 + i for i in range(60)]
    reqs = Requests(times, trace, [180] * 120, [False] * 120)
    cat = catalog(4, ["platinum"] * 4)
    seed = simulate(sc, cat, reqs, policy_factory("loraplane"))
    demand = simulate(sc, cat, reqs, policy_factory("loraplane-demand"))
    assert seed.fallbacks == 0 and 55 <= seed.gpu_hits <= 65 and seed.demand_swaps >= 55
    assert demand.fallbacks < 10 and demand.gpu_hits > 110


def _hbm_tight(high_watermark: float) -> Scenario:
    """A worker of 8 slots whose base model and KV cache take 0.815 of its HBM: two of the
    tiny adapters (0.0027 each) take it past the low watermark (0.82), never past 0.9."""
    sc = scenario(8)
    pool = sc.fleet.base_models[0].model_copy(
        update={
            "hbm_bytes_per_worker": 10e9,
            "base_weights_bytes": 4.0e9,
            "kv_reserved_bytes": 4.15e9,
        }
    )
    policy = sc.policy.model_copy(update={"hbm_high_watermark": high_watermark})
    fleet = sc.fleet.model_copy(update={"base_models": [pool]})
    return sc.model_copy(update={"fleet": fleet, "policy": policy})


def test_a_copy_the_planner_sheds_for_hbm_is_not_loaded_back_by_requests_in_a_cycle() -> None:
    """Two adapters, asked in turn for 10 minutes, on a worker they take past the HBM low
    watermark (no load from the planner) but not the high one (no copy shed). With one
    watermark for both (high = low), the planner sheds a copy each tick and the next
    request loads it back, a load each time; with the band, the two loads are all."""
    reqs = requests([0, 1] * 300)
    one = simulate(_hbm_tight(0.82), catalog(2), reqs, policy_factory("loraplane"))
    two = simulate(_hbm_tight(0.9), catalog(2), reqs, policy_factory("loraplane"))
    assert one.swaps > 4
    assert (two.swaps, two.cold_loads, two.fallbacks) == (2, 2, 0)


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
)


@pytest.mark.parametrize(
    ("text", "says"),
    [(BILLION_LAUGHS, "expands"), ("name: [unclosed\n", "not YAML"), ("- a list\n", "mapping")],
)
def test_attack_a_hostile_scenario_file_is_refused_naming_it(
    text: str, says: str, tmp_path: Path
) -> None:
    """Operators run scenario files they were sent: an alias bomb is refused before it is
    expanded (it would hold ``simulate`` for minutes), and text that is no YAML names its file."""
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=says) as refused:
        load_scenario(path)
    assert str(path) in str(refused.value)
