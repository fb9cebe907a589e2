"""Interference in the simulator's worker model (``fleet.interference``): a load stalls the
batch on its worker and is slowed by it, slots reserve HBM and shrink the batch; and with the
parameters of bench/scenarios/seed-004-24-adapters.yaml the seed's three rows come out within
15% (static merge, on-demand hot loading, pooled hot set: swap ms, HBM peak, P95 tokens/s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplane.simulator import benchmark
from loraplane.simulator.engine import simulate
from loraplane.simulator.fleet import CostModel
from loraplane.simulator.metrics import Counters
from loraplane.simulator.policies import policy_factory
from loraplane.simulator.requests import Requests
from loraplane.simulator.scenario import Interference, Scenario, load_scenario
from tests.unit.simulator_tiny import catalog, scenario

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "bench" / "scenarios" / "seed-004-24-adapters.yaml"
COLUMNS = {
    "hbm_peak_ratio": "hbm_peak",
    "swap_ms": "swap_ms",
    "p95_tokens_per_s": "p95_tokens_per_s",
}


def _with(sc: Scenario, **interference: float) -> Scenario:
    fleet = sc.fleet.model_copy(update={"interference": Interference(**interference)})
    return sc.model_copy(update={"fleet": fleet})


def _run(sc: Scenario, times: list[float], adapters: list[int], policy: str = "lru") -> Counters:
    reqs = Requests(times, adapters, [180] * len(times), [False] * len(times))
    return simulate(sc, catalog(4), reqs, policy_factory(policy))


# a0 loads at 0 (cold: fetch + swap) and decodes; a0 again at 0.5 (hit); a1 loads at 1.0
# while both decode; a0 at 1.05 starts decoding inside a1's load window.
TIMES, ADAPTERS = [0.0, 0.5, 1.0, 1.05], [0, 0, 1, 0]


def test_a_load_stalls_every_request_decoding_on_its_worker() -> None:
    base = scenario(2)
    cm = CostModel(base.fleet.costs, base.policy)
    size = catalog(4).adapters[0].size_bytes
    load_s = (cm.swap_ms(size) + cm.fetch_ms(size)) / 1000.0
    calm = _run(base, TIMES, ADAPTERS)
    stalled = _run(_with(base, stall_fraction=0.5), TIMES, ADAPTERS)
    # time in service of each request, recovered from tokens/s and its penalty
    spent = [
        180 / tps - p / 1000.0
        for tps, p in zip(stalled.tokens_per_s, stalled.ttft_penalty_ms, strict=True)
    ]
    plain = [
        180 / tps - p / 1000.0
        for tps, p in zip(calm.tokens_per_s, calm.ttft_penalty_ms, strict=True)
    ]
    lo, hi = 1.0, 1.0 + load_s  # a1's load window
    expected = [0.5 * load_s, 0.5 * load_s, 0.0, 0.5 * (hi - 1.05)]
    for got, before, extra in zip(spent, plain, expected, strict=True):
        assert got - before == pytest.approx(extra, abs=1e-9)
    assert lo < 1.05 < hi


def test_a_load_is_slowed_by_the_requests_running_on_its_worker() -> None:
    base = scenario(2)
    cm = CostModel(base.fleet.costs, base.policy)
    size = catalog(4).adapters[0].size_bytes
    c = _run(_with(base, load_slowdown_per_request=0.5, page_alloc_ms=3.0), TIMES, ADAPTERS)
    gpu = cm.swap_ms(size) + 3.0
    # a0's load meets an idle worker; a1's meets two requests decoding
    first, second = gpu + cm.fetch_ms(size), gpu * (1 + 0.5 * 2) + cm.fetch_ms(size)
    assert c.demand_swaps == 2
    assert c.swap_ms_total == pytest.approx(first + second)


def test_slot_reservations_raise_the_hbm_peak_and_shrink_the_batch() -> None:
    base = scenario(2)  # 24 GB HBM, 1 GB base weights, 1 GB KV reserved
    times, adapters = [0.0, 0.1], [0, 0]
    roomy = _run(_with(base, kv_bytes_per_sequence=11e9), times, adapters)
    assert roomy.queued == 0  # (24 - 1) // 11 = 2 requests at once
    tight = _run(_with(base, kv_bytes_per_sequence=11e9, slot_reserved_bytes=1e9), times, adapters)
    assert tight.queued == 1  # (24 - 1 - 2 x 1) // 11 = 1
    staged = catalog(4).adapters[0].size_bytes  # the first load's bytes in transit
    assert tight.hbm_peak_ratio == pytest.approx((1e9 + 1e9 + 2e9 + staged) / 24e9, abs=1e-4)
    merged = _run(_with(base, slot_reserved_bytes=1e9), times, adapters, "static-merge")
    assert merged.hbm_peak_ratio < tight.hbm_peak_ratio  # merged weights reserve no slot


def test_the_seed_rows_reproduce_within_15_percent() -> None:
    """Costs ~10 s (loraplane's planner on 30k requests)."""
    sc = load_scenario(SEED)
    bench = benchmark.prepare(sc)
    for name, seed in sc.seed_reference.items():
        ours = benchmark.run_policy(bench, name).seed_columns()
        for column, key in COLUMNS.items():
            want = getattr(seed, key)
            assert abs(ours[column] - want) <= 0.15 * want, (name, column, ours[column], want)


def test_with_load_stall_share_the_loraplane_workers_load_as_often_as_their_loads_allow() -> None:
    """policy.load_stall_share: each simulated worker's budget is the agent's
    (``load_interference.adapted_budget``) from its loads' time and the modelled stall. A
    load here takes ~0.1 s (a fetch and a swap) and stalls decode by half, so at a share of
    0.001 (0.06 s of decode a minute) a worker may load once a minute: one load per minute
    per worker in a stream of misses, where the constant budget would allow 10,000."""
    base = _with(scenario(1, workers=1), stall_fraction=0.5)
    sc = base.model_copy(
        update={
            "policy": base.policy.model_copy(
                update={"load_stall_share": 0.001, "demand_admission_tau_s": 0.0}
            )
        }
    )
    times = [float(t) for t in range(0, 180, 3)]  # a miss every 3 s for 3 minutes
    adapters = [k % 4 for k in range(len(times))]
    c = _run(sc, times, adapters, policy="loraplane")
    free = _run(
        base.model_copy(
            update={"policy": base.policy.model_copy(update={"demand_admission_tau_s": 0.0})}
        ),
        times,
        adapters,
        policy="loraplane",
    )
    assert free.swaps > 30
    assert 3 <= c.swaps <= 4  # the first, then one a minute
