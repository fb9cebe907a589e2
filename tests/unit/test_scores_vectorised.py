"""``hot_scores`` (numpy columns, what the planner uses) against the formula written out per
version with ``ScoreState``'s own rate methods (``math.exp``: equal but for the last bits),
and a version's score the same to the last bit whether it was scored alone or anywhere in a
batch, so ties rank the same either way."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from loraplane.kernel.policy import Policy
from loraplane.streams.scores import (
    TAU_1M_S,
    TAU_10M_S,
    Daily,
    Decayed,
    ScoreInputs,
    ScoreState,
    decayed_at,
    hot_score,
    hot_scores_of,
    priority_values,
)

T0 = 1_700_000_000.0
POLICIES = [
    Policy(),
    Policy(
        hot_score_formula="0.3 * qps_1m + 0.3 * qps_10m + 0.2 * "
        "ttft_penalty_if_cold + 0.1 * tenant_priority + 0.1 * "
        "scheduled_warmup_score",
        normalisation={"qps_10m": 0.5, "qps_1m": 3.0, "ttft_penalty_ms": 700.0},
    ),
    Policy(
        hot_score_formula="0.9 * weighted_demand + 0.1 * scheduled_warmup_score",
        normalisation={"weighted_demand": 0.3},
        demand_trend_weight=0.7,
    ),
]


def clip(x: float) -> float:
    return min(1.0, max(0.0, x))


def reference(
    state: ScoreState, priority: str, scheduled: float, policy: Policy, now: float
) -> float:
    norm = policy.normalisation
    terms = {
        "qps_10m": clip(state.qps_10m(now) / norm.qps_10m),
        "qps_1m": clip(state.qps_1m(now) / norm.qps_1m),
        "ttft_penalty_if_cold": clip(
            state.ttft_penalty_ms(policy.ttft_penalty_prior_ms) / norm.ttft_penalty_ms
        ),
        "tenant_priority": clip(policy.tenant_priority_values.get(priority, 0.0)),
        "scheduled_warmup_score": clip(scheduled),
        "weighted_demand": clip(
            (
                state.qps_10m(now)
                + policy.demand_trend_weight * max(0.0, state.qps_1m(now) - state.qps_10m(now))
            )
            * policy.tenant_priority_values.get(priority, 0.0)
            / norm.weighted_demand
        ),
    }
    return sum(w * terms[name] for name, w in policy.weights.items())


counts = st.one_of(st.just(0.0), st.floats(min_value=0, max_value=1e5))
ages = st.floats(min_value=-60, max_value=30_000)
ttft = st.one_of(st.none(), st.floats(min_value=0, max_value=1e5))
states = st.builds(
    lambda v10, a10, v1, a1, cold, hot: ScoreState(
        requests_10m=Decayed(TAU_10M_S, v10, T0 - a10),
        requests_1m=Decayed(TAU_1M_S, v1, T0 - a1),
        ttft_cold_ms=cold,
        ttft_hot_ms=hot,
    ),
    counts,
    ages,
    counts,
    ages,
    ttft,
    ttft,
)
rows = st.tuples(
    states,
    st.sampled_from(["bronze", "silver", "gold", "platinum", "other"]),
    st.floats(min_value=-1, max_value=2),
)


def hot_scores(
    states: list[ScoreState],
    priorities: list[str],
    scheduled: list[float],
    policy: Policy,
    now: float,
) -> np.ndarray:
    return hot_scores_of(
        ScoreInputs.from_states(states),
        priority_values(priorities, policy),
        np.asarray(scheduled, dtype=float).reshape(len(states)),
        policy,
        now,
    )


@given(st.lists(rows, max_size=40), st.sampled_from(POLICIES))
def test_vectorised_scores_equal_the_formula_per_version(batch: list, policy: Policy) -> None:
    got = hot_scores(
        [s for s, _, _ in batch], [p for _, p, _ in batch], [w for _, _, w in batch], policy, T0
    )
    for score, (s, p, w) in zip(got.tolist(), batch, strict=True):
        assert math.isclose(score, reference(s, p, w, policy, T0), rel_tol=1e-12, abs_tol=1e-15)
    assert [hot_score(s, p, w, policy, T0) for s, p, w in batch] == got.tolist()


@given(st.lists(st.tuples(counts, ages), min_size=1, max_size=300), st.data())
def test_a_decay_is_the_same_alone_and_anywhere_in_a_batch(
    counters: list, data: st.DataObject
) -> None:
    value = np.array([v for v, _ in counters])
    at = np.array([T0 - a for _, a in counters])
    batch = decayed_at(value, at, TAU_10M_S, T0)
    i = data.draw(st.integers(0, len(counters) - 1))
    assert decayed_at(value[i : i + 1], at[i : i + 1], TAU_10M_S, T0)[0] == batch[i]
    j = data.draw(st.integers(0, i))  # the same counter at another offset of a batch
    shifted = decayed_at(value[j:], at[j:], TAU_10M_S, T0)
    assert shifted[i - j] == batch[i]


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


floats = st.floats(min_value=-1e6, max_value=1e6)
profiles = st.builds(
    Daily,
    n=counts,
    c1=floats,
    s1=floats,
    c2=floats,
    s2=floats,
    at=st.floats(min_value=0, max_value=2e9),
    since=st.one_of(st.none(), st.floats(min_value=0, max_value=2e9)),
)
odd_ttft = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))


@given(st.lists(st.tuples(states, profiles, odd_ttft, odd_ttft), max_size=30))
def test_the_score_columns_hold_each_state_s_own_fields(batch: list) -> None:
    """``ScoreInputs.from_states`` reads a column at a time; row by row it holds each
    state's counters, its TTFT gap where both TTFTs are known (None is unknown; a NaN or an
    infinity is a value) and its daily profile (NaN: never requested)."""
    states_ = [replace(s, daily=d, ttft_cold_ms=cold, ttft_hot_ms=hot) for s, d, cold, hot in batch]
    x = ScoreInputs.from_states(states_)
    assert x.daily.shape == (len(states_), 7)
    for i, s in enumerate(states_):
        assert x.r10_value[i] == s.requests_10m.value and x.r10_at[i] == s.requests_10m.at
        assert x.r1_value[i] == s.requests_1m.value and x.r1_at[i] == s.requests_1m.at
        known = s.ttft_cold_ms is not None and s.ttft_hot_ms is not None
        assert bool(x.ttft_known[i]) is known
        if known:
            assert s.ttft_cold_ms is not None and s.ttft_hot_ms is not None
            assert same(x.ttft_gap_ms[i], s.ttft_cold_ms - s.ttft_hot_ms)
        else:
            assert x.ttft_gap_ms[i] == 0.0
        d = s.daily
        row = (d.n, d.c1, d.s1, d.c2, d.s2, d.at, math.nan if d.since is None else d.since)
        assert all(same(a, b) for a, b in zip(x.daily[i].tolist(), row, strict=True))
