"""The daily profile of the scores (streams.scores.Daily): the demand forecast reads a
version's usual rate at the time of day ahead, once a whole day was seen."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.kernel.policy import Policy
from loraplane.schemas.codec import SchemaError, decode, encode
from loraplane.schemas.request_log import RequestStatus, Tier
from loraplane.schemas.score_snapshot import ScoreSnapshot
from loraplane.streams.scores import (
    DAY_S,
    Daily,
    Sample,
    ScoreInputs,
    ScoreState,
    daily_merged,
    daily_rates_at,
    from_snapshot,
    hot_score,
    merged,
    observe_many,
    snapshot,
)

T0 = 1_800_000_000.0 - math.fmod(1_800_000_000.0, DAY_S)  # a midnight (UTC)
COST = Policy.model_validate({"hot_score_formula": "1.0 * weighted_demand"})


def fold(times: list[float]) -> ScoreState:
    return observe_many(
        ScoreState(), [Sample(t, "interactive", Tier.gpu, RequestStatus.ok, 40.0) for t in times]
    )[0]


def mornings(days: int, per_hour: int = 120, hour: int = 8) -> list[float]:
    """``per_hour`` requests a day from ``hour``:00 to ``hour``:59, ``days`` days."""
    return [
        T0 + d * DAY_S + hour * 3600 + j * 3600 / per_hour
        for d in range(days)
        for j in range(per_hour)
    ]


def test_a_steady_rate_reads_as_itself_at_every_hour() -> None:
    state = fold([T0 + j * 30.0 for j in range(int(3 * DAY_S / 30))])  # 1 every 30 s, 3 days
    now = T0 + 3 * DAY_S
    for hour in range(0, 24, 3):
        assert state.daily.rate_at(now + hour * 3600, now) == pytest.approx(1 / 30, rel=0.02)


def test_a_morning_version_is_forecast_before_its_morning_and_not_at_night() -> None:
    state = fold(mornings(3))
    morning, night = T0 + 3 * DAY_S + 8.5 * 3600, T0 + 3 * DAY_S + 20 * 3600
    now = T0 + 3 * DAY_S + 7.9 * 3600
    assert state.daily.rate_at(morning, now) > 5 * state.daily.rate_at(night, now)
    # the planner's forecast ten minutes before 8:00 ranks it above an idle version,
    # though its last request was ~23 h ago (its 10-minute rate is 0)
    idle = fold([now - 3600.0])
    assert hot_score(state, "silver", 0.0, COST, now) > hot_score(idle, "silver", 0.0, COST, now)
    off = COST.model_copy(update={"demand_diurnal_weight": 0.0})
    assert hot_score(state, "silver", 0.0, off, now) < hot_score(idle, "silver", 0.0, off, now)


def test_less_than_a_day_of_history_forecasts_nothing() -> None:
    state = fold([T0 + 8 * 3600 + j * 30.0 for j in range(120)])  # one morning
    now = T0 + 20 * 3600
    assert state.daily.rate_at(now + DAY_S / 2, now) == 0.0
    assert state.daily.rate_at(now + DAY_S / 2, T0 + 8 * 3600 + DAY_S) > 0


profiles = st.lists(st.floats(T0, T0 + 4 * DAY_S), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(profiles, st.floats(0, 5 * DAY_S), st.floats(0, DAY_S))
def test_the_columns_read_as_each_profile(times: list[float], after: float, ahead: float) -> None:
    states = [fold(sorted(times)), fold(times), ScoreState()]
    now = T0 + after
    cols = daily_rates_at(ScoreInputs.from_states(states).daily, now + ahead, now)
    for state, col in zip(states, cols, strict=True):
        assert col == pytest.approx(state.daily.rate_at(now + ahead, now), rel=1e-9, abs=1e-15)
        assert col >= 0


@settings(max_examples=60, deadline=None)
@given(profiles, profiles)
def test_merged_profiles_are_the_profile_of_both_streams(a: list[float], b: list[float]) -> None:
    both = fold(sorted(a + b)).daily
    m = daily_merged(fold(sorted(a)).daily, fold(sorted(b)).daily)
    for x, y in zip(
        (m.n, m.c1, m.s1, m.c2, m.s2), (both.n, both.c1, both.s1, both.c2, both.s2), strict=True
    ):
        assert x == pytest.approx(y, rel=1e-6, abs=1e-6)
    assert m.since == both.since and m.at == both.at
    assert merged(fold(sorted(a)), fold(sorted(b))).daily == m


@settings(max_examples=60, deadline=None)
@given(profiles)
def test_a_profile_survives_the_wire_and_its_harmonics_never_exceed_its_count(
    times: list[float],
) -> None:
    state = fold(times)
    d = state.daily
    assert all(abs(h) <= d.n * (1 + 1e-9) for h in (d.c1, d.s1, d.c2, d.s2))
    assert from_snapshot(decode(ScoreSnapshot, encode(snapshot(state)))) == state


@pytest.mark.parametrize(
    "day",
    [
        [1.0, 5.0, 0.0, 0.0, 0.0, T0],  # a harmonic beyond the count: an invented peak
        [1.0, 0.0, 0.0, 0.0, -2.0, T0],
        [-1.0, 0.0, 0.0, 0.0, 0.0, T0],  # a negative count
        [1.0, float("nan"), 0.0, 0.0, 0.0, T0],
        [1.0, 0.0, 0.0, 0.0, 0.0],  # short
    ],
)
def test_a_forged_profile_is_refused_on_read(day: list[float]) -> None:
    record = snapshot(fold([T0])).model_dump()
    record["day"] = day
    with pytest.raises(SchemaError):
        decode(ScoreSnapshot, encode_raw(record))


def encode_raw(record: dict[str, object]) -> bytes:
    return json.dumps(record, allow_nan=True).encode()


def test_old_records_without_a_profile_read_as_none_yet() -> None:
    record = snapshot(fold([T0])).model_dump()
    del record["day"], record["since"]
    state = from_snapshot(decode(ScoreSnapshot, encode_raw(record)))
    assert state.daily == Daily()
    assert np.isnan(ScoreInputs.from_states([state]).daily[0, 6])
