"""The measured cost of a load and the budget that follows (``workers.load_interference``)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loraplane.workers.load_interference import (
    MIN_POINTS,
    LoadWindows,
    StallEstimate,
    adapted_budget,
)


@given(st.floats(0.0, 0.95), st.floats(5.0, 200.0), st.integers(0, 2**32 - 1))
def test_the_line_through_finished_requests_finds_the_stall(
    stall: float, r0: float, seed: int
) -> None:
    rng = random.Random(seed)
    est = StallEstimate()
    for k in range(400):
        overlap = 0.0 if k % 2 else rng.random()  # half ran beside no load
        rate = r0 * (1 - stall * overlap) * (1 + rng.uniform(-0.02, 0.02))
        est.observe(overlap, rate, float(k))
    found = est.stall()
    assert found is not None and abs(found - stall) < 0.05


def test_no_stall_is_known_until_requests_with_and_without_a_load_were_seen() -> None:
    est = StallEstimate()
    for _ in range(500):  # a worker that never loaded while serving
        est.observe(0.0, 40.0, 0.0)
    assert est.stall() is None
    for _ in range(int(MIN_POINTS) - 1):
        est.observe(0.5, 30.0, 0.0)
    assert est.stall() is None
    est.observe(0.5, 30.0, 0.0)
    assert est.stall() == pytest.approx(0.5)  # 40 tokens/s alone, 30 half beside a load


odd = st.sampled_from([float("nan"), float("inf"), -float("inf")])


@given(st.lists(st.tuples(st.floats(-1e6, 1e6) | odd, st.floats(-1e6, 1e6) | odd), max_size=60))
def test_hostile_points_never_raise_nor_leave_0_to_1(points: list[tuple[float, float]]) -> None:
    est = StallEstimate()
    for k, (x, y) in enumerate(points):
        est.observe(x, y, float(k))
    s = est.stall()
    assert s is None or 0.0 <= s <= 1.0


windows = st.lists(st.tuples(st.floats(0, 100), st.floats(0, 20)), max_size=12)


@given(windows, st.floats(0, 120), st.just(0.0) | st.floats(1e-3, 30))
def test_overlap_is_the_share_of_a_request_under_the_union_of_loads(
    spans: list[tuple[float, float]], start: float, length: float
) -> None:
    loads = LoadWindows()
    for lo, d in spans:
        loads.add(lo, lo + d)
    end = start + length
    got = loads.overlap(start, end)
    steps = 2000  # the same measure by sampling
    if length > 0:
        inside = sum(
            any(lo <= start + (k + 0.5) * length / steps < lo + d for lo, d in spans)
            for k in range(steps)
        )
        assert abs(got - inside / steps) <= 0.01 + 1e-9
    else:
        assert got == 0.0
    assert 0.0 <= got <= 1.0 + 1e-9


def test_the_load_time_is_a_moving_average_and_old_windows_go() -> None:
    loads = LoadWindows()
    loads.add(0.0, 1.0)
    assert loads.load_s == 1.0
    loads.add(10.0, 10.5)
    assert loads.load_s is not None and 0.5 < loads.load_s < 1.0
    loads.add(10_000.0, 10_000.1)
    assert loads.windows == [(10_000.0, 10_000.1)]


@given(
    st.integers(1, 10_000),
    st.floats(0.0, 1.0),
    st.none() | st.floats(0.0, 1.0),
    st.none() | st.floats(0.0, 100.0),
)
def test_the_budget_stays_between_one_and_the_policys_and_falls_as_loads_cost_more(
    ceiling: int, share: float, stall: float | None, load_s: float | None
) -> None:
    n = adapted_budget(ceiling, share, stall, load_s)
    assert 1 <= n <= ceiling
    if share == 0 or stall is None or load_s is None:
        assert n == ceiling
    if stall is not None and load_s is not None:
        assert adapted_budget(ceiling, share, min(1.0, stall * 2), load_s) <= n
        assert adapted_budget(ceiling, share, stall, load_s * 2) <= n


def test_a_load_that_stalls_half_the_batch_for_a_second_at_2_percent() -> None:
    # each load costs 0.5 s of decode; 2% of a minute is 1.2 s: two loads a minute
    assert adapted_budget(6, 0.02, 0.5, 1.0) == 2
    assert adapted_budget(6, 0.02, 0.5, 0.01) == 6  # cheap loads: the policy's ceiling
