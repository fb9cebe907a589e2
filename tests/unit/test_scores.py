"""Hot-score state from request logs: decayed rates, TTFT penalty, errors, bounds."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from loraplane.kernel.policy import SEED_FORMULA, Policy
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.request_log import RequestStatus, Tier
from loraplane.schemas.score_snapshot import ScoreSnapshot
from loraplane.streams.scores import (
    TAU_1M_S,
    TAU_10M_S,
    Decayed,
    ScoreState,
    from_snapshot,
    hot_score,
    is_burst,
    merged,
    observe,
    snapshot,
)

POLICY = Policy()
T0 = 1_700_000_000.0


def requests(
    n: int,
    start: float = T0,
    every_s: float = 1.0,
    tier: Tier = Tier.gpu,
    status: RequestStatus = RequestStatus.ok,
    ttft: float | None = 50.0,
    state: ScoreState | None = None,
    cls: str = "interactive",
) -> ScoreState:
    state = state or ScoreState()
    for i in range(n):
        state = observe(
            state, ts=start + i * every_s, request_class=cls, tier=tier, status=status, ttft_ms=ttft
        )
    return state


def wire(state: ScoreState) -> bytes:
    """The state as the scoring agent writes it to the scores topic."""
    return encode(snapshot(state))


def read(raw: bytes | str) -> ScoreState:
    """A scores record as the scoring agent reads it back."""
    return from_snapshot(decode(ScoreSnapshot, raw))


def test_steady_rate_converges_to_the_arrival_rate() -> None:
    s = requests(7200, every_s=0.5)  # 2 qps for an hour (six time constants)
    now = T0 + 7200 * 0.5
    assert math.isclose(s.qps_10m(now), 2.0, rel_tol=0.05)
    assert math.isclose(s.qps_1m(now), 2.0, rel_tol=0.05)


def test_out_of_order_event_counts_as_if_in_order() -> None:
    in_order = Decayed(TAU_10M_S).add(T0).add(T0 + 30)
    reversed_ = Decayed(TAU_10M_S).add(T0 + 30).add(T0)
    assert math.isclose(in_order.at_time(T0 + 60), reversed_.at_time(T0 + 60))


def test_ttft_penalty_uses_prior_until_both_observed() -> None:
    s = requests(5, tier=Tier.gpu, ttft=40.0)
    assert s.ttft_penalty_ms(800.0) == 800.0
    s = requests(5, tier=Tier.cold, ttft=1040.0, state=s)
    assert math.isclose(s.ttft_penalty_ms(800.0), 1000.0)


def test_error_rate_needs_samples_and_counts_only_served_requests() -> None:
    few = requests(5, status=RequestStatus.error)
    assert few.error_rate_after_load(T0 + 5) is None
    s = requests(90, status=RequestStatus.ok)
    s = requests(10, start=T0 + 90, status=RequestStatus.error, state=s)
    s = requests(50, start=T0 + 100, tier=Tier.cold, status=RequestStatus.error, state=s)
    assert math.isclose(s.error_rate_after_load(T0 + 150), 0.1, rel_tol=0.1)


def test_refused_requests_are_not_demand() -> None:
    s = requests(10, status=RequestStatus.refused)
    assert s.last_request is None and s.qps_10m(T0 + 10) == 0


def test_class_mix_and_idle_minutes() -> None:
    s = requests(3, cls="batch")
    s = requests(1, start=T0 + 10, cls="interactive", state=s)
    mix = s.class_mix(T0 + 10)
    assert math.isclose(sum(mix.values()), 1.0) and mix["batch"] > mix["interactive"]
    assert s.dominant_class(T0 + 10) == "batch"
    assert math.isclose(s.idle_minutes(T0 + 10 + 3600), 60.0)
    assert ScoreState().idle_minutes(T0) == math.inf


def test_burst_fires_once_when_the_minute_rate_jumps() -> None:
    quiet = requests(2, every_s=200)
    burst = requests(1, start=T0 + 400, state=quiet)
    fired = []
    for i in range(5):
        before, burst = (
            burst,
            observe(
                burst,
                ts=T0 + 401 + i,
                request_class="interactive",
                tier=Tier.cold,
                status=RequestStatus.ok,
                ttft_ms=None,
            ),
        )
        fired.append(is_burst(before, burst, T0 + 401 + i))
    assert fired.count(True) == 1


def test_merged_adds_demand_and_keeps_version_facts() -> None:
    a = requests(10, tier=Tier.cold, ttft=900)
    b = requests(10, start=T0 + 5)
    m = merged(a, b)
    now = T0 + 20
    assert math.isclose(m.qps_10m(now), a.qps_10m(now) + b.qps_10m(now))
    assert m.ttft_cold_ms == a.ttft_cold_ms and m.last_request == b.last_request


def test_serialisation_round_trips() -> None:
    s = requests(7, tier=Tier.cold, ttft=300.0)
    s = requests(3, start=T0 + 100, state=s, cls="batch")
    assert read(wire(s)) == s


qps = st.floats(min_value=0, max_value=50, allow_nan=False)
prio = st.sampled_from(["bronze", "silver", "gold", "platinum", "unknown"])
warm = st.floats(min_value=-1, max_value=2, allow_nan=False)


def steady(rate: float, now: float) -> ScoreState:
    """The steady state of a constant arrival ``rate`` (requests/s) at ``now``."""
    return ScoreState(
        requests_10m=Decayed(TAU_10M_S, rate * TAU_10M_S, now),
        requests_1m=Decayed(TAU_1M_S, rate * TAU_1M_S, now),
        last_request=now,
    )


@given(qps, qps, prio, warm)
def test_hot_score_is_monotonic_in_qps(a: float, b: float, priority: str, w: float) -> None:
    lo, hi = sorted((a, b))
    assert (
        hot_score(steady(lo, T0), priority, w, POLICY, T0)
        <= hot_score(steady(hi, T0), priority, w, POLICY, T0) + 1e-12
    )


@given(
    qps, prio, warm, st.floats(min_value=0, max_value=1e6), st.floats(min_value=0, max_value=1e6)
)
def test_hot_score_is_bounded(
    rate: float, priority: str, w: float, cold: float, hot: float
) -> None:
    s = replace(steady(rate, T0), ttft_cold_ms=cold, ttft_hot_ms=hot)
    score = hot_score(s, priority, w, POLICY, T0)
    assert 0.0 <= score <= sum(POLICY.weights.values()) + 1e-12


@given(st.floats(min_value=1e-3, max_value=50), st.floats(min_value=1, max_value=7200))
def test_scores_decay_without_requests(rate: float, later: float) -> None:
    s = steady(rate, T0)
    assert s.qps_10m(T0 + later) < s.qps_10m(T0)
    assert hot_score(s, "silver", 0, POLICY, T0 + later) <= hot_score(s, "silver", 0, POLICY, T0)


def test_shadow_warmup_requests_are_not_demand_but_their_errors_count() -> None:
    warm = requests(30, cls="shadow", status=RequestStatus.error)
    assert warm.qps_10m(T0 + 30) == 0.0 and warm.last_request is None
    assert warm.error_rate_after_load(T0 + 30) == 1.0
    assert hot_score(warm, "silver", 0.0, POLICY, T0 + 30) == hot_score(
        ScoreState(), "silver", 0.0, POLICY, T0 + 30
    )


def test_a_count_hovering_at_the_floor_fires_once_then_rearms_after_quiet() -> None:
    state, fired = ScoreState(), []
    for i in range(40):  # ~3 requests a minute: the decayed 1-minute count hovers near 3
        ts = T0 + i * 20.0
        before = state
        state = observe(
            state,
            ts=ts,
            request_class="interactive",
            tier=Tier.cold,
            status=RequestStatus.ok,
            ttft_ms=None,
        )
        fired.append(is_burst(before, state, ts))
    assert fired.count(True) == 1
    later = T0 + 40 * 20.0 + 600  # quiet for 10 minutes, then a real burst
    again = []
    for i in range(5):
        before = state
        state = observe(
            state,
            ts=later + i,
            request_class="interactive",
            tier=Tier.cold,
            status=RequestStatus.ok,
            ttft_ms=None,
        )
        again.append(is_burst(before, state, later + i))
    assert again.count(True) == 1


def test_burst_state_survives_the_changelog_round_trip() -> None:
    state = requests(10)
    assert read(wire(state)) == state
    assert read(
        json.dumps({k: v for k, v in json.loads(wire(state)).items() if k != "armed"})
    ).burst_armed


COST = Policy(hot_score_formula="1.0 * weighted_demand")


def test_weighted_demand_ranks_a_busy_bronze_version_above_an_idle_platinum_one() -> None:
    """What a miss costs is rate times priority: the seed's sum would rank them the other
    way round (priority adds 0.15 of score, as much as 0.33 requests/s of demand)."""
    busy_bronze, idle_platinum = steady(0.2, T0), steady(0.01, T0)
    assert hot_score(busy_bronze, "bronze", 0, COST, T0) > hot_score(
        idle_platinum, "platinum", 0, COST, T0
    )
    seed = Policy(hot_score_formula=SEED_FORMULA)
    assert hot_score(busy_bronze, "bronze", 0, seed, T0) < hot_score(
        idle_platinum, "platinum", 0, seed, T0
    )


@given(qps, qps, prio)
def test_weighted_demand_is_monotonic_and_bounded(a: float, b: float, priority: str) -> None:
    lo, hi = sorted((a, b))
    low, high = (hot_score(steady(r, T0), priority, 0, COST, T0) for r in (lo, hi))
    assert 0.0 <= low <= high + 1e-12 <= 1.0 + 1e-12


@given(st.floats(min_value=0.01, max_value=0.5), st.floats(min_value=2, max_value=10))
def test_weighted_demand_counts_a_rise_early_and_a_fall_late(rate: float, factor: float) -> None:
    """The forecast adds ``demand_trend_weight`` of a 1-minute rate above the 10-minute one;
    a 1-minute rate below it changes nothing (a lull keeps the copy)."""
    base = steady(rate, T0)
    rising = replace(base, requests_1m=Decayed(TAU_1M_S, rate * factor * TAU_1M_S, T0))
    falling = replace(base, requests_1m=Decayed(TAU_1M_S, rate / factor * TAU_1M_S, T0))
    flat = Policy(hot_score_formula="1.0 * weighted_demand", demand_trend_weight=0.0)
    assert hot_score(rising, "silver", 0, COST, T0) > hot_score(base, "silver", 0, COST, T0)
    assert math.isclose(
        hot_score(rising, "silver", 0, flat, T0), hot_score(base, "silver", 0, flat, T0)
    )
    assert math.isclose(
        hot_score(falling, "silver", 0, COST, T0), hot_score(base, "silver", 0, COST, T0)
    )
