"""The hindsight per-window set (loraplane/simulator/hindsight.py): the reference an online
policy's cost is compared with, on hand-checked traces and against the whole-trace set."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplane.simulator.fleet import CostModel
from loraplane.simulator.hindsight import _next_set, hindsight_set
from loraplane.simulator.requests import Requests
from tests.unit.simulator_tiny import catalog, scenario


def test_each_window_holds_its_own_most_valuable_versions() -> None:
    """One slot, 600 s windows: adapter 0 is wanted in the first window, 1 in the second;
    each window's set holds its own, so only the one request of the other adapter in each
    window is charged (an interactive fallback, 1 s, bronze weight 1)."""
    sc = scenario(1)
    times = [0.0, 10.0, 20.0, 30.0, 600.0, 610.0, 620.0, 630.0]
    seq = [0, 0, 0, 1, 1, 1, 1, 0]
    reqs = Requests(times, seq, [180] * 8, [False] * 8)
    found = hindsight_set(sc, catalog(2), reqs)
    miss = CostModel(sc.fleet.costs, sc.policy).unloaded_miss_ms(False)
    assert found.weighted_miss_cost == 2 * miss
    assert (found.windows, found.loads) == (2, 2)
    whole = hindsight_set(sc, catalog(2), reqs, window_s=1e9)
    assert whole.weighted_miss_cost == 4 * miss and whole.loads == 1


def test_a_window_changes_the_set_by_at_most_the_budget() -> None:
    demand = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}
    assert _next_set(demand, set(), 2, 10) == {2, 3}
    assert _next_set(demand, {0, 1}, 2, 1) == {1, 3}  # one newcomer, the best kept


@settings(max_examples=60, deadline=None)
@given(
    seq=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    gaps=st.lists(st.floats(0.0, 120.0), min_size=40, max_size=40),
    batch=st.lists(st.booleans(), min_size=40, max_size=40),
    slots=st.integers(1, 3),
    window=st.sampled_from([60.0, 300.0, 600.0]),
)
def test_per_window_sets_cost_no_more_than_one_set_for_the_whole_trace(
    seq: list[int], gaps: list[float], batch: list[bool], slots: int, window: float
) -> None:
    """With a budget that lets every window change its whole set, choosing per window can
    only do better than one set for all of them; and no set costs more than missing all."""
    sc = scenario(slots)  # 10,000 loads a minute: no window is held back
    times = [sum(gaps[: j + 1]) for j in range(len(seq))]
    reqs = Requests(times, list(seq), [180] * len(seq), batch[: len(seq)])
    cat = catalog(6)
    per_window = hindsight_set(sc, cat, reqs, window_s=window).weighted_miss_cost
    whole = hindsight_set(sc, cat, reqs, window_s=1e9).weighted_miss_cost
    cm = CostModel(sc.fleet.costs, sc.policy)
    everything = sum(cm.unloaded_miss_ms(b) for b in reqs.batch)
    assert 0.0 <= per_window <= whole + 1e-9 <= everything + 1e-9
