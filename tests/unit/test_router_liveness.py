"""Which workers the router routes to while Kafka, which carries their heartbeats, is away
(router/liveness.py, ``FleetIndex`` in router/routing.py, the probe in router/server.py):
a heartbeat's age counts only against a worker-state feed that was current; otherwise the
worker's gateway decides, by a probe that must name the worker. Attack tests: a forged or
replayed worker state keeps neither a dead worker in the view for good nor a live one out."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from hypothesis import given
from hypothesis import strategies as st

from loraplane.kernel.policy import RequestBudgets
from loraplane.router.liveness import (
    RECONNECT_GRACE_S,
    Feed,
    Verdict,
    beat_of,
    probe_ok,
    verdict,
)
from loraplane.router.liveness import Gateway as GatewaySeen
from loraplane.router.routing import FleetIndex, RouteKind
from loraplane.router.server import Fleet, Router, _watch_fleet, serving_versions
from loraplane.schemas.reasons import VllmFailure
from loraplane.workers.gateway import Gateway
from tests.unit.test_gateway import AUTH_A, KEYS, RECORDS, FakeServing, ListSink
from tests.unit.test_planner import NOW, POLICY, record, worker
from tests.unit.test_router import SECRET, at

HB = 1.0
LIMIT = 3 * HB


def judge(
    beat: float,
    now: float,
    feed: Feed | None,
    ok_at: float | None = None,
    failed_at: float | None = None,
) -> Verdict:
    return verdict(beat, now, HB, feed, GatewaySeen(ok_at=ok_at, failed_at=failed_at))


# ---- the rule -------------------------------------------------------------------------------
def test_a_stale_heartbeat_is_drained_only_when_a_current_feed_shows_the_silence() -> None:
    beat = NOW
    answering = Feed(since=NOW - 600, last=NOW + 10)  # current all along
    assert judge(beat, NOW + 2, answering) is Verdict.live
    assert judge(beat, NOW + 10, answering) is Verdict.gone
    away = Feed(since=NOW - 600, last=NOW + 0.5)  # the broker went away just after the beat
    assert judge(beat, NOW + 2, away) is Verdict.live
    assert judge(beat, NOW + 90, away) is Verdict.check  # routed, its gateway probed
    assert judge(beat, NOW + 90, away, ok_at=NOW + 89.5) is Verdict.live
    assert judge(beat, NOW + 90, None) is Verdict.gone  # no feed: the heartbeat alone


@given(st.floats(0, HB), st.floats(0, 3600), st.floats(0, 1800))
def test_no_worker_heard_before_the_broker_died_is_drained_while_it_is_away(
    before_kill: float, down: float, answering_before: float
) -> None:
    """Onset: the feed's span ends at its last answer, with no detection delay, so a worker
    that beat on time is never drained for the silence of a broker that is away."""
    kill = NOW
    feed = Feed(since=kill - answering_before - HB, last=kill)
    assert judge(kill - before_kill, kill + down, feed) in (Verdict.live, Verdict.check)


def test_after_the_feed_comes_back_a_worker_has_the_reconnect_grace_to_beat() -> None:
    beat, back = NOW, NOW + 90
    for last in (back, back + LIMIT + RECONNECT_GRACE_S - 0.1):
        assert judge(beat, last, Feed(since=back, last=last)) is Verdict.check
    late = back + LIMIT + RECONNECT_GRACE_S + 0.1
    assert judge(beat, late, Feed(since=back, last=late)) is Verdict.gone
    # a heartbeat sent during the outage, replayed from the worker's spool after it: no
    # fresher than its stamp, and judged as from before the feed's return
    spooled = NOW + 40
    assert judge(spooled, back + 1, Feed(since=back, last=back + 1)) is Verdict.check
    assert judge(back + 2, back + 3, Feed(since=back, last=back + 3)) is Verdict.live


def test_a_failed_gateway_is_out_until_its_next_heartbeat_or_good_probe() -> None:
    feed = Feed(since=NOW - 600, last=NOW + 1)
    assert judge(NOW, NOW + 1, feed, failed_at=NOW + 0.5) is Verdict.out
    assert judge(NOW, NOW + 1, feed, ok_at=NOW + 0.8, failed_at=NOW + 0.5) is Verdict.live
    assert judge(NOW + 0.9, NOW + 1, feed, failed_at=NOW + 0.5) is Verdict.live  # beat after
    # out, and a current feed shows it silent too: forgotten
    later = Feed(since=NOW - 600, last=NOW + 10)
    assert judge(NOW, NOW + 10, later, failed_at=NOW + 0.5) is Verdict.gone
    assert judge(NOW, NOW + 10, None, failed_at=NOW + 0.5) is Verdict.gone


@given(st.floats(0, 1e9))
def test_attack_a_state_stamped_in_the_future_is_no_fresher_than_its_arrival(ahead: float) -> None:
    """A forged (or skewed) ``ts`` cannot keep a dead worker in the view: its heartbeat
    counts from when it arrived, and a current feed drains it three intervals later."""
    arrived = NOW
    beat = beat_of(arrived + ahead, arrived)
    assert beat == arrived
    feed = Feed(since=NOW - 600, last=NOW + LIMIT + 0.1)
    assert judge(beat, NOW + LIMIT + 0.1, feed) is Verdict.gone


def test_attack_a_replayed_old_state_of_a_dead_worker_does_not_bring_it_back() -> None:
    """As old as its stamp: gone at once on a current feed; with the feed away, routed only
    until its gateway fails the probe, then out; gone once the feed shows the silence."""
    old = NOW - 3600
    assert judge(beat_of(old, NOW), NOW, Feed(since=NOW - 7200, last=NOW)) is Verdict.gone
    away = Feed(since=NOW - 7200, last=old - 10)
    assert judge(old, NOW, away) is Verdict.check
    assert judge(old, NOW + 1, away, failed_at=NOW + 0.5) is Verdict.out
    back = Feed(since=NOW + 10, last=NOW + 10 + RECONNECT_GRACE_S + LIMIT + 1)
    assert judge(old, back.last, back, failed_at=NOW + 0.5) is Verdict.gone


def test_a_probe_counts_only_when_the_gateway_names_the_worker() -> None:
    assert probe_ok("w1", 200, {"ok": True, "worker_id": "w1"})
    assert not probe_ok("w1", 200, {"ok": True, "worker_id": "w2"})  # another worker's
    assert not probe_ok("w1", 200, {"ok": True})  # says nothing of who it is
    assert not probe_ok("w1", 503, {"ok": False, "worker_id": "w1"})  # not started
    assert not probe_ok("w1", 200, {"ok": "yes", "worker_id": "w1"})
    assert not probe_ok("w1", 200, ["ok", "w1"])
    assert not probe_ok("w1", 200, None)


@pytest.mark.parametrize("why", ["vllm_timeout", "vllm_wrong_base_model", True, "anything"])
def test_a_probe_of_a_gateway_that_refuses_requests_as_not_run_does_not_vouch(why: object) -> None:
    """Up and naming the worker, but refusing every request as not run: it serves nothing."""
    assert not probe_ok("w1", 200, {"ok": True, "worker_id": "w1", "not_run": why})
    assert probe_ok("w1", 200, {"ok": True, "worker_id": "w1", "not_run": None})
    # a proof of the router secret asks whether the gateway is the worker's, not whether it
    # serves: an honest worker with a hung vLLM fails no proof
    assert probe_ok("w1", 200, {"ok": True, "worker_id": "w1", "not_run": why}, serving=False)


# ---- the index ------------------------------------------------------------------------------
def test_attack_a_forged_future_state_does_not_hold_back_the_workers_own() -> None:
    a = record("a")
    fleet = FleetIndex(POLICY, HB)
    fleet.update(at(worker("w1", gpu=[a]), NOW), NOW)
    fleet.update(at(worker("w1"), NOW + 10**8, "http://elsewhere"), NOW + 0.2)  # forged
    assert fleet.route(a, NOW + 0.3, {}).kind is RouteKind.free_slot
    fleet.update(at(worker("w1", gpu=[a]), NOW + 1), NOW + 1)  # the worker's own, later
    route = fleet.route(a, NOW + 1, {})
    assert (route.kind, route.gateway_url) == (RouteKind.gpu, "http://w1")
    fleet.update(at(worker("w1"), NOW - 5), NOW + 1.5)  # a replay of an older one
    assert fleet.route(a, NOW + 1.5, {}).kind is RouteKind.gpu


def test_attack_a_forged_state_keeps_a_dead_worker_three_intervals_at_most() -> None:
    a = record("a")
    fleet = FleetIndex(POLICY, HB)
    fleet.feed = Feed(since=NOW - 600, last=NOW)
    fleet.update(at(worker("w9", gpu=[a]), NOW + 10**8), NOW)
    assert fleet.route(a, NOW + LIMIT, {}) is not None
    fleet.feed = Feed(since=NOW - 600, last=NOW + LIMIT + 0.1)
    assert fleet.drain(NOW + LIMIT + 0.1).gone == ["w9"]
    assert fleet.route(a, NOW + LIMIT + 0.1, {}) is None


FORGED = st.lists(st.tuples(st.floats(0, 30), st.floats(-1e6, 1e9), st.booleans()), max_size=12)


@given(FORGED)
def test_attack_forged_and_replayed_states_keep_no_dead_worker_for_good(
    forged: list[tuple[float, float, bool]],
) -> None:
    """Whatever states an attacker writes for a dead worker (any stamp, past or far future,
    holding the adapter or not), three intervals of a current feed after the last one the
    worker is out of routing."""
    a = record("a")
    fleet = FleetIndex(POLICY, HB)
    fleet.update(at(worker("w1", gpu=[a]), NOW), NOW)  # its last genuine heartbeat
    last = NOW
    for arrived, ts, hot in sorted(forged):
        last = NOW + arrived
        fleet.update(at(worker("w1", gpu=[a] if hot else []), NOW + ts), last)
    after = last + LIMIT + 0.01
    fleet.feed = Feed(since=NOW - 600, last=after)
    assert fleet.route(a, after, {}) is None
    assert fleet.drain(after).gone == ["w1"]


@given(FORGED, st.floats(0, 0.9))
def test_attack_forged_states_hold_back_no_later_heartbeat_of_a_live_worker(
    forged: list[tuple[float, float, bool]], latency: float
) -> None:
    """The worker's own next heartbeat stamped after the last forged state arrived is taken
    (its residency and gateway are the router's view again), whatever was forged before."""
    a = record("a")
    fleet = FleetIndex(POLICY, HB)
    fleet.feed = Feed(since=NOW - 600, last=NOW + 100)
    last = NOW
    for arrived, ts, hot in sorted(forged):
        last = NOW + arrived
        fleet.update(at(worker("w1", gpu=[a] if hot else []), NOW + ts, "http://evil"), last)
    sent = last + 0.01
    fleet.update(at(worker("w1", gpu=[a]), sent), sent + latency)
    route = fleet.route(a, sent + latency, {})
    assert route is not None and (route.kind, route.gateway_url) == (RouteKind.gpu, "http://w1")


def test_with_the_feed_away_the_index_keeps_routing_and_names_the_gateways_to_probe() -> None:
    a = record("a")
    fleet = FleetIndex(POLICY, HB)
    fleet.update(at(worker("w1", gpu=[a]), NOW), NOW)
    fleet.update(at(worker("w2"), NOW), NOW)
    fleet.feed = Feed(since=NOW - 600, last=NOW + 0.5)  # then the broker died
    later = NOW + 60
    drained = fleet.drain(later)
    assert drained.gone == [] and sorted(drained.probe) == [
        ("w1", "http://w1"),
        ("w2", "http://w2"),
    ]
    assert drained.unvouched == 2
    assert fleet.drain(later).probe == []  # one probe at a time per worker
    route = fleet.route(a, later, {})
    assert (route.worker_id, route.kind) == ("w1", RouteKind.gpu)  # the last residency
    fleet.probed("w1", "http://w1", True, later)
    fleet.probed("w2", "http://w2", False, later)
    assert set(fleet.workers) == {"w1"} and set(fleet.parked) == {"w2"}
    assert fleet.worker_count(POLICY_BASE) == 1
    assert sorted(fleet.drain(later + 2).probe) == [("w1", "http://w1"), ("w2", "http://w2")]
    fleet.probed("w2", "http://w2", True, later + 2)  # back, on its last state
    assert set(fleet.workers) == {"w1", "w2"} and not fleet.parked


POLICY_BASE = worker("w").base_model


def test_a_failed_gateway_is_parked_and_its_delayed_older_heartbeat_keeps_it_out() -> None:
    a = record("a")
    fleet = FleetIndex(POLICY, HB)
    fleet.feed = Feed(since=NOW - 600, last=NOW + 1)
    fleet.update(at(worker("w1", gpu=[a]), NOW), NOW)
    fleet.failed("w1", NOW + 0.5)
    assert fleet.route(a, NOW + 0.6, {}) is None and set(fleet.parked) == {"w1"}
    fleet.update(at(worker("w1", gpu=[a]), NOW + 0.4), NOW + 0.7)  # sent before it failed
    assert fleet.route(a, NOW + 0.7, {}) is None
    fleet.update(at(worker("w1", gpu=[a]), NOW + 1), NOW + 1)  # its next heartbeat
    assert fleet.route(a, NOW + 1, {}).kind is RouteKind.gpu and not fleet.parked


@pytest.mark.parametrize("why", list(VllmFailure))
def test_a_state_saying_not_run_is_parked_until_a_state_without_it(why: VllmFailure) -> None:
    """A worker whose gateway refuses every request as not run says so in its heartbeat: it
    is kept out of the view (no tenant request pays a round trip to learn it) until a state
    without ``not_run``, or a probe whose /healthz has none, brings it back."""
    a = record("a")
    fleet = FleetIndex(POLICY, HB)
    fleet.feed = Feed(since=NOW - 600, last=NOW + 1)
    fleet.update(at(worker("w1", gpu=[a]), NOW), NOW)
    fleet.update(at(worker("w1", gpu=[a]), NOW + 1, not_run=why), NOW + 1)
    assert fleet.route(a, NOW + 1, {}) is None and set(fleet.parked) == {"w1"}
    assert fleet.worker_count(a.base_model) == 0
    # its next heartbeat still says it: still out
    fleet.update(at(worker("w1", gpu=[a]), NOW + 2, not_run=why), NOW + 2)
    assert fleet.route(a, NOW + 2, {}) is None and set(fleet.parked) == {"w1"}
    fleet.update(at(worker("w1", gpu=[a]), NOW + 3), NOW + 3)  # vLLM serves again
    assert fleet.route(a, NOW + 3, {}).kind is RouteKind.gpu and not fleet.parked
    # parked again; a good probe (its /healthz without not_run) brings it back
    fleet.update(at(worker("w1", gpu=[a]), NOW + 4, not_run=why), NOW + 4)
    assert fleet.route(a, NOW + 4, {}) is None
    fleet.probed("w1", "http://w1", True, NOW + 4.5)
    assert fleet.route(a, NOW + 4.5, {}).kind is RouteKind.gpu and not fleet.parked


def test_a_probe_of_a_gateway_the_worker_has_left_is_ignored() -> None:
    fleet = FleetIndex(POLICY, HB)
    fleet.feed = Feed(since=NOW - 600, last=NOW + 0.5)  # away
    fleet.update(at(worker("w1"), NOW, "http://old"), NOW)
    assert fleet.drain(NOW + 60).probe == [("w1", "http://old")]
    fleet.update(at(worker("w1"), NOW + 61, "http://new"), NOW + 61)  # restarted elsewhere
    fleet.probed("w1", "http://old", False, NOW + 62)  # the old gateway's answer, late
    assert set(fleet.workers) == {"w1"} and not fleet.parked


def test_a_tombstone_forgets_a_parked_worker_too() -> None:
    fleet = FleetIndex(POLICY, HB)
    fleet.update(at(worker("w1"), NOW), NOW)
    fleet.failed("w1", NOW)
    fleet.forget("w1")
    assert not fleet.workers and not fleet.parked
    fleet.probed("w1", "http://w1", True, NOW + 1)  # a late probe of a forgotten one
    assert not fleet.workers


# ---- the router, with real gateways in this process -------------------------------------------
@pytest.mark.asyncio(loop_scope="session")
async def test_with_kafka_away_the_router_serves_live_gateways_and_parks_dead_ones() -> None:
    """Every heartbeat is a minute old and the feed stopped answering with the broker: the
    router probes each gateway, keeps the ones that answer as themselves on their last
    residency (a hot adapter stays on its GPU copy), and parks a dead one and one whose
    state points at another worker's gateway."""
    sql = RECORDS[2]
    servers = []
    now = datetime.now(UTC).timestamp()
    fleet = Fleet(FleetIndex(POLICY, HB), ListSink(), "router-t")
    urls = {}
    for wid, hot in (("w1", False), ("w2", True)):
        serving = FakeServing(hot={sql.lora_name} if hot else set(), worker_id=wid)
        gateway = Gateway(
            serving, api_keys=KEYS, budgets=RequestBudgets(), sink=ListSink(), router_secret=SECRET
        )
        server = TestServer(gateway.app(), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        urls[wid] = serving.gateway_url = str(server.make_url("")).rstrip("/")
        fleet.index.update(
            at(
                worker(wid, gpu=[sql] if hot else [], slots=2, base=sql.base_model),
                now - 60,
                urls[wid],
                max_lora_rank=64,
            ),
            now - 60,
        )
    for wid, url in (("w3", "http://127.0.0.1:9"), ("w4", urls["w1"])):  # dead; forged url
        fleet.index.update(
            at(
                worker(wid, gpu=[sql], slots=2, base=sql.base_model),
                now - 60,
                url,
                max_lora_rank=64,
            ),
            now - 60,
        )
    fleet.versions = serving_versions(list(RECORDS))
    router = Router(fleet, api_keys=KEYS, budgets=RequestBudgets(), secret=SECRET)
    server = TestServer(router.app(), host="127.0.0.1")
    await server.start_server()
    span = (now - 3600, now - 59.5)  # the worker-state tail's last answer: the kill
    watch = asyncio.create_task(_watch_fleet(router, lambda: span, HB, poll_s=0.05))
    try:
        for _ in range(100):
            await asyncio.sleep(0.05)
            if set(fleet.index.parked) == {"w3", "w4"}:
                break
        assert set(fleet.index.parked) == {"w3", "w4"}
        assert set(fleet.index.workers) == {"w1", "w2"}
        async with ClientSession() as http:
            for _ in range(3):
                async with http.post(
                    str(server.make_url("/v1/completions")),
                    headers=AUTH_A,
                    json={"model": "sql", "prompt": "q"},
                ) as resp:
                    assert resp.status == 200
                    assert (
                        resp.headers["X-Loraplane-Worker"],
                        resp.headers["X-Loraplane-Route"],
                    ) == ("w2", "gpu")
    finally:
        watch.cancel()
        for s in (server, *servers):
            await s.close()
