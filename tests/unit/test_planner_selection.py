"""The planner's column-wise fast paths against the plain per-version definitions: the lazy
partial ranking against ``sorted`` by rank, and the column-wise conditions against
``Condition.holds`` on each version's facts."""

from __future__ import annotations

from itertools import islice
from types import SimpleNamespace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from loraplane.kernel.policy import Condition, parse_condition
from loraplane.streams.planner_candidates import Ranking, first_holding

# Few distinct scores: ties are the point (they break by name).
scores = st.sampled_from([0.0, 0.1, 0.1 + 1e-12, 0.25, 0.5, 0.95, 1.0])


@given(
    st.lists(st.tuples(scores, st.booleans(), st.booleans(), st.booleans()), max_size=300),
    st.sampled_from([0.0, 0.05, 0.25]),
    st.integers(0, 400),
)
def test_ranking_reads_like_a_full_sort_by_rank(rows: list, margin: float, k: int) -> None:
    lora = [f"a{i * 7919 % 1000:03d}-{i}" for i in range(len(rows))]
    table = SimpleNamespace(
        lora=lora,
        score=np.array([r[0] for r in rows], dtype=float),
        first=np.array([r[1] for r in rows], dtype=bool),
    )
    wanted = np.array([i for i, r in enumerate(rows) if r[2]], dtype=np.intp)
    resident = np.array([rows[i][3] for i in wanted.tolist()], dtype=bool)

    def rank(i: int) -> tuple[int, float, str]:
        s, first, _, res = rows[i]
        return (0 if first else 1, -(s + (margin if res else 0.0)), lora[i])

    expected = sorted(wanted.tolist(), key=rank)
    ranking = Ranking(table, wanted, resident, margin)  # type: ignore[arg-type]
    assert list(islice(ranking, k)) == expected[:k]
    assert list(ranking) == expected  # read again, further: the same order
    hinted = Ranking(table, wanted, resident, margin, k)  # type: ignore[arg-type]
    assert hinted.top(k) == expected[:k]
    assert list(hinted) == expected


STATUS = ["active", "canary", "retired"]
PRIORITY = ["bronze", "silver", "platinum"]
CLASS = [None, "batch", "interactive"]
NUMBER = [None, 0.0, 0.02, 5.0, 60.0, 1e18]
NUMERIC = ("canary_percent", "no_request_for_minutes", "error_rate_after_load")
clauses = st.one_of(
    st.tuples(
        st.sampled_from(["status", "tenant_priority", "request_class"]),
        st.sampled_from(["==", "!=", ">"]),
        st.sampled_from(['"canary"', "platinum", "batch", "5"]),
    ),
    st.tuples(
        st.sampled_from(NUMERIC),
        st.sampled_from(["==", "!=", ">", ">=", "<", "<="]),
        st.sampled_from(["0", "0.02", "5", "60", '"5.0"', "active"]),
    ),
)
conditions = st.lists(
    st.lists(clauses, min_size=1, max_size=3).map(
        lambda cs: parse_condition(" and ".join(f"{f} {op} {v}" for f, op, v in cs))
    ),
    max_size=3,
)
facts = st.fixed_dictionaries(
    {
        "status": st.sampled_from(STATUS),
        "tenant_priority": st.sampled_from(PRIORITY),
        "request_class": st.sampled_from(CLASS),
        "canary_percent": st.sampled_from([0.0, 5.0]),
        "no_request_for_minutes": st.sampled_from([0.0, 30.0, 60.0, 61.5, 1e18]),
        "error_rate_after_load": st.sampled_from(NUMBER),
    }
)


@given(conditions, st.lists(facts, max_size=60))
def test_conditions_column_wise_hold_where_they_hold_per_version(
    conds: list[Condition], rows: list[dict]
) -> None:
    def column(fact: str, picked: np.ndarray) -> np.ndarray:
        values = [rows[i][fact] for i in picked.tolist()]
        if fact in NUMERIC:
            return np.array([np.nan if v is None else v for v in values], dtype=float)
        return np.array(values, dtype=object)

    got = first_holding(tuple(conds), column, len(rows)).tolist()
    assert got == [next((k for k, c in enumerate(conds) if c.holds(r)), -1) for r in rows]
