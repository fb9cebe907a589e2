"""The workers' demand admission (``workers.demand_admission``): decayed, priority-weighted
request counts per lora name, bounded, and the rule a request's load is admitted by."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from loraplane.workers.demand_admission import (
    DemandCounts,
    WaitingMisses,
    any_slot,
    give_up_order,
    has_room,
)

names = st.sampled_from([f"n{i}" for i in range(12)])
events = st.lists(st.tuples(names, st.floats(-2.0, 2.0), st.floats(0.0, 5000.0)), max_size=200)


def test_a_count_decays_with_its_time_constant() -> None:
    counts = DemandCounts(600.0)
    for _ in range(4):
        counts.observe("a", 0.5, 100.0)
    assert counts.count("a", 100.0) == 2.0
    assert math.isclose(counts.count("a", 700.0), 2.0 / math.e)
    assert counts.count("never", 700.0) == 0.0


@given(events)
def test_counts_are_never_negative_never_grow_by_waiting_and_stay_bounded(
    seen: list[tuple[str, float, float]],
) -> None:
    counts = DemandCounts(300.0, max_names=5)
    for name, weight, at in seen:  # any order of time: a clock may step back
        before = counts.count(name, at)
        counts.observe(name, weight, at)
        assert counts.count(name, at) >= before  # a request never lowers its own count
        assert counts.count(name, at + 1000.0) <= counts.count(name, at) + 1e-9
        assert len(counts._counts) <= 5
        assert all(counts.count(n, at) >= 0.0 for n in counts._counts)


@given(events, names, names, st.floats(0.0, 10_000.0))
def test_admission_is_the_order_of_counts_and_ties_admit(
    seen: list[tuple[str, float, float]], challenger: str, copy: str, now: float
) -> None:
    counts = DemandCounts(300.0)
    for name, weight, at in seen:
        counts.observe(name, weight, at)
    assert counts.admits(challenger, copy, now) == (
        counts.count(copy, now) <= counts.count(challenger, now)
    )
    assert counts.admits(copy, copy, now)


def test_a_flood_of_names_forgets_the_least_demanded_not_the_busy_ones() -> None:
    counts = DemandCounts(600.0, max_names=100)
    for _ in range(50):
        counts.observe("busy", 1.0, 0.0)
    for i in range(1000):  # one request each for many versions
        counts.observe(f"once-{i}", 1.0, float(i) / 1000)
    assert counts.count("busy", 1.0) > 49 and len(counts._counts) <= 100


@given(st.integers(0, 20), st.integers(1, 20), st.integers(0, 20), st.booleans())
def test_a_request_that_may_wait_skips_the_comparison_exactly_when_the_budget_has_time(
    used: int, per_minute: int, waiting: int, in_time: bool
) -> None:
    """Batch-like: decided by the budget's time alone. Interactive: only while the budget
    leaves more than the waiting requests' loads of the last minute, plus one; so never
    while a batch-like request of the minute would find it spent."""
    assert (
        any_slot(may_wait=True, in_time=in_time, used=used, per_minute=per_minute, waiting=waiting)
        == in_time
    )
    interactive = any_slot(
        may_wait=False, in_time=in_time, used=used, per_minute=per_minute, waiting=waiting
    )
    assert interactive == (used + waiting + 1 < per_minute)
    if interactive:
        assert has_room(used + 1, per_minute, waiting)  # its load still leaves theirs


def test_waiting_misses_count_the_last_minute_only() -> None:
    waiting = WaitingMisses()
    for t in (0.0, 10.0, 59.0):
        waiting.add(t)
    assert waiting.count(59.5) == 3
    assert waiting.count(60.0) == 2  # the one at 0 s left the window
    assert waiting.count(200.0) == 0


@given(
    st.lists(
        st.tuples(names, st.booleans(), st.floats(0.0, 10.0), st.floats(0.0, 100.0)),
        min_size=1,
        max_size=12,
        unique_by=lambda x: x[0],
    )
)
def test_give_up_order_puts_requests_copies_first_then_the_least_demanded(
    copies: list[tuple[str, bool, float, float]],
) -> None:
    first = min(
        copies, key=lambda c: give_up_order(c[0], planned=c[1], demand=c[2], last_used=c[3])
    )
    if any(not planned for _, planned, _, _ in copies):
        assert not first[1]
    same = [c for c in copies if c[1] == first[1]]
    assert first[2] == min(c[2] for c in same)
