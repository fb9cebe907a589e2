"""The simulator without pooled slots: per-worker slots behind the router's own rule
(``router.routing.pick_worker``), per-worker serving capacity, and the Dynamo-style baseline."""

from __future__ import annotations

from itertools import pairwise

from loraplane.simulator.engine import simulate
from loraplane.simulator.policies import policy_factory
from loraplane.simulator.policies.dynamo import Dynamo
from loraplane.simulator.requests import Requests
from tests.unit.simulator_tiny import catalog, requests, scenario


def test_requests_follow_the_copy_and_free_slots_fill_like_the_planner() -> None:
    # 2 workers x 1 slot. a0 -> free slot on worker 0 (most free, lowest id); a1 -> worker 1's
    # free slot; then every a0 and a1 is routed to its copy: 2 loads, no thrashing.
    c = simulate(
        scenario(1, workers=2),
        catalog(2),
        requests([0, 1, 0, 1, 0, 1, 1, 0]),
        policy_factory("lru"),
    )
    assert (c.swaps, c.gpu_hits) == (2, 6)
    assert c.routes == {"free_slot": 2, "gpu": 6}


def test_a_demoted_copy_is_found_again_on_its_workers_host_tier() -> None:
    # 2 workers x 1 slot: a0 -> worker 0, a1 -> worker 1 (free slots); a2 finds no copy and no
    # free slot: cold budget on the least busy worker (a tie: worker 0), whose LRU demotes a0
    # to its host tier; a0 then goes to worker 0's host copy (a swap, no S3 fetch).
    c = simulate(scenario(1, workers=2), catalog(3), requests([0, 1, 2, 0]), policy_factory("lru"))
    assert c.routes == {"free_slot": 2, "cold_budget": 1, "host": 1}
    assert (c.cold_loads, c.swaps, c.host_hits) == (3, 4, 1)


def test_a_saturated_worker_queues_and_the_wait_adds_to_latency() -> None:
    # One serving place, 180 tokens at 40.5 tok/s = 4.44 s each, a request every second:
    # every request after the first waits for the one before it.
    trace = [0] * 6
    roomy = simulate(scenario(1), catalog(1), requests(trace), policy_factory("lru"))
    tight = simulate(
        scenario(1, max_concurrent=1), catalog(1), requests(trace), policy_factory("lru")
    )
    assert roomy.queued == 0 and tight.queued == 5
    waits = tight.ttft_penalty_ms[1:]
    assert all(b > a for a, b in pairwise(waits))
    assert waits[0] > 3000  # 4.44 s of service of the first, less its 1 s head start
    assert tight.weighted_miss_cost > roomy.weighted_miss_cost


def test_least_in_flight_splits_traffic_between_copies() -> None:
    # Dynamo gives the one hot adapter a copy on both workers; with one serving place per
    # worker the router sends each request to the idler copy, so the copies share the load.
    sc = scenario(2, workers=2, max_concurrent=1)
    n = 200
    reqs = Requests([i * 0.5 for i in range(n)], [0] * n, [180] * n, [False] * n)
    c = simulate(sc, catalog(1), reqs, policy_factory("dynamo"))
    assert c.swaps == 2  # one copy per worker, loaded once each
    lru = simulate(sc, catalog(1), reqs, policy_factory("lru"))
    assert lru.swaps == 1 and c.queued < lru.queued


def test_dynamo_replicas_follow_demand_and_placement_is_sticky() -> None:
    # 4 workers x 2 slots; a0 takes most of the traffic, a1..a3 a little.
    sc = scenario(2, workers=4)
    trace = [0, 0, 0, 1, 0, 0, 2, 0, 0, 3] * 60
    reqs = requests(trace, gap_s=0.2)
    ctx_policy: list[Dynamo] = []

    def factory(ctx):  # type: ignore[no-untyped-def]
        ctx_policy.append(Dynamo(ctx))
        return ctx_policy[0]

    simulate(sc, catalog(4), reqs, factory)
    d = ctx_policy[0]
    holders = {a: [w for w, res in enumerate(d.assigned) if a in res] for a in range(4)}
    assert len(holders[0]) > max(len(holders[a]) for a in (1, 2, 3)) >= 1
    # rendezvous order: the copies sit on the first workers of the adapter's hash order
    assert holders[0] == sorted(d.hrw(0)[: len(holders[0])])
    again: list[Dynamo] = []

    def factory2(ctx):  # type: ignore[no-untyped-def]
        again.append(Dynamo(ctx))
        return again[0]

    simulate(sc, catalog(4), reqs, factory2)
    assert again[0].assigned == d.assigned  # deterministic


def test_every_policy_runs_on_several_workers_and_is_deterministic() -> None:
    sc = scenario(2, workers=3, max_concurrent=4)
    trace = [(i * 7) % 9 for i in range(300)]
    reqs = requests(trace, gap_s=0.3)
    for name in (
        "lru",
        "fifo",
        "s3-fifo",
        "sieve",
        "gdsf",
        "belady",
        "static-merge",
        "dynamo",
        "loraplane",
        "loraplane-demand",
        "loraplane-cost",
    ):
        a = simulate(sc, catalog(9), reqs, policy_factory(name)).summary()
        b = simulate(sc, catalog(9), reqs, policy_factory(name)).summary()
        assert a == b, name
        assert sum(a["routes"].values()) == len(trace), name
