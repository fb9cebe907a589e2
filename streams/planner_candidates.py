"""This tick's candidates: every serving version (active or canary) with its hot score, the
conditions that hold for it and its rank, as numpy columns over the rows of
``streams.planner_columns``.

Why columns: the registry can hold 100k serving versions and a tick looks at few beyond the
hot set and the residents, so scores and conditions are computed column-wise and nothing is
built per row. Each column has one representation, a numpy array; a rule reads one row
through ``score_of`` and ``rank``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from loraplane.kernel.policy import Clause, Condition, Policy
from loraplane.schemas.adapter import AdapterRecord
from loraplane.streams.planner_columns import Categories, Registry, Scores
from loraplane.streams.scores import (
    MIN_ERROR_SAMPLES,
    TAU_1M_S,
    TAU_10M_S,
    decayed_at,
    hot_scores_of,
)

__all__ = ["Candidates", "Rank", "Ranking", "first_holding"]

_COMPARE: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    "==": np.equal,
    "!=": np.not_equal,
    ">": np.greater,
    ">=": np.greater_equal,
    "<": np.less,
    "<=": np.less_equal,
}
"""``Clause.op`` as numpy comparisons, for a numeric fact against a numeric literal."""

Rank = tuple[int, float, str]
"""Sort key of a candidate: smaller ranks higher."""


class Candidates:
    """The serving versions of the registry, one row each, as of ``now``. The
    time-independent columns come from ``streams.planner_columns`` (kept between ticks);
    this tick's scores and conditions are computed here. ``unprotect`` is the one change
    after construction (the protected cap)."""

    def __init__(
        self,
        registry: Registry,
        scores: Scores,
        scheduled: Mapping[str, float],
        policy: Policy,
        now: float,
    ) -> None:
        n = len(registry.lora)
        self.registry, self.columns, self.now = registry, scores, now
        self.record: list[AdapterRecord] = registry.record
        self.lora: list[str] = registry.lora
        self.scheduled = registry.scheduled(scheduled)
        self.canary = registry.canary
        self.score = hot_scores_of(
            scores.inputs,
            registry.priorities.lookup(policy.tenant_priority_values, 0.0),
            self.scheduled,
            policy,
            now,
            policy.weights,
        )
        self.never_evict, self.demote = policy.never_evict, policy.demote
        self.protected_by = first_holding(self.never_evict, self._fact, n)
        self.demoted_by = first_holding(self.demote, self._fact, n)
        self.protected = self.protected_by >= 0
        self.first = self.protected | self.canary  # ranked before every other version
        self.demoted = (self.demoted_by >= 0) & ~self.protected
        self.over_capacity: dict[int, str] = {}  # row -> why it lost its protection

    def _fact(self, fact: str, rows: np.ndarray) -> np.ndarray | Categories:
        """The values of one condition fact for ``rows``: a float column (NaN = unknown) or
        a ``Categories`` column. Facts a condition does not read are never computed."""
        now, c = self.now, self.columns
        match fact:
            case "status":
                return self.registry.status.take(rows)
            case "tenant_priority":
                return self.registry.priorities.take(rows)
            case "canary_percent":  # read rarely (after a canary status clause): per tick
                return np.fromiter(
                    (self.record[i].release.canary_percent for i in rows.tolist()), float, len(rows)
                )
            case "no_request_for_minutes":
                # A scheduled peak or a canary counts as expected demand: never idle.
                idle: np.ndarray = np.maximum(0.0, now - c.last[rows]) / 60.0
                idle[~np.isfinite(idle)] = 1e18  # never requested
                idle[(self.scheduled[rows] > 0) | self.canary[rows]] = 0.0
                return idle
            case "error_rate_after_load":
                served = decayed_at(c.served_value[rows], c.served_at[rows], TAU_10M_S, now)
                known = served >= MIN_ERROR_SAMPLES
                rates = np.full(len(rows), np.nan)
                rates[known] = (
                    decayed_at(
                        c.errors_value[rows[known]], c.errors_at[rows[known]], TAU_10M_S, now
                    )
                    / served[known]
                )
                return rates
            case "request_class":
                states = c.state
                return Categories.encode(states[i].dominant_class(now) for i in rows.tolist())
        raise ValueError(f"unknown fact {fact!r}")

    def demand(self, rows: np.ndarray) -> np.ndarray:
        """Requests/s of ``rows`` now: the larger of the 1- and 10-minute rates, so a burst
        adds copies at once and they are given back only once both rates have fallen."""
        x = self.columns.inputs
        r1 = decayed_at(x.r1_value[rows], x.r1_at[rows], TAU_1M_S, self.now) / TAU_1M_S
        r10 = decayed_at(x.r10_value[rows], x.r10_at[rows], TAU_10M_S, self.now) / TAU_10M_S
        rate: np.ndarray = np.maximum(r1, r10)
        return rate

    def score_of(self, i: int) -> float:
        return float(self.score[i])

    def rank(self, i: int, resident: bool, margin: float) -> Rank:
        """Never-evict and canary versions first, then by score (a resident's raised by the
        hysteresis margin), then by name."""
        return (
            0 if self.first[i] else 1,
            -(self.score_of(i) + (margin if resident else 0.0)),
            self.lora[i],
        )

    def detail(self, i: int) -> str:
        """Why the row is wanted, for the command's reason."""
        which = int(self.protected_by[i])
        text = (
            f"never_evict: {self.never_evict[which].text}"
            if which >= 0
            else "scheduled warm-up"
            if self.scheduled[i] > 0
            else "canary prewarm"
            if self.canary[i]
            else ""
        )
        note = self.over_capacity.get(i)
        return text if note is None else f"{text}; {note}"

    def demote_rule(self, i: int) -> str:
        return self.demote[int(self.demoted_by[i])].text

    def unprotect(self, i: int, note: str) -> None:
        """Over the protected cap: ranked by score, demotable, unpinned."""
        self.protected[i] = self.first[i] = False
        self.demoted[i] = self.demoted_by[i] >= 0
        self.over_capacity[i] = note


def _holds(clause: Clause, values: np.ndarray | Categories) -> np.ndarray:
    """``clause.holds`` for each value of a fact column. A numeric fact against a number is
    one numpy comparison; anything else is decided by ``Clause.holds`` itself once per
    distinct value (statuses, priorities, classes: a handful)."""
    if isinstance(values, np.ndarray):
        if values.dtype != object and not isinstance(clause.value, str):
            compared: np.ndarray = ~np.isnan(values) & _COMPARE[clause.op](values, clause.value)
            return compared
        values = Categories.encode(
            None if isinstance(v, float) and math.isnan(v) else v for v in values.tolist()
        )
    holds = np.array([clause.holds({clause.fact: v}) for v in values.values], dtype=np.bool_)
    held: np.ndarray = holds[values.codes]
    return held


def first_holding(
    conditions: tuple[Condition, ...],
    fact: Callable[[str, np.ndarray], np.ndarray | Categories],
    n: int,
) -> np.ndarray:
    """For each of ``n`` rows the index of the first condition that holds, -1 where none.
    A clause is evaluated only on the rows where the clauses before it hold, and a
    condition only on the rows no earlier condition decided."""
    which = np.full(n, -1)
    undecided = np.arange(n)
    for k, condition in enumerate(conditions):
        rows = undecided
        for clause in condition.clauses:
            if not rows.size:
                break
            rows = rows[_holds(clause, fact(clause.fact, rows))]
        which[rows] = k
        undecided = undecided[which[undecided] < 0]
    return which


class Ranking:
    """The rows of wanted versions in rank order, sorted lazily: a tick reads the hot set
    and the top of the host tier, rarely the whole ranking, so only a prefix (doubled as
    needed) is selected with ``np.partition`` and sorted. Iterating twice reuses it."""

    def __init__(
        self,
        table: Candidates,
        rows: np.ndarray,
        resident: np.ndarray,
        margin: float,
        expected: int = 0,
    ) -> None:
        """``expected``: how many rows the caller will read at least (the hot set)."""
        self.table = table
        self.expected = expected
        key = -(table.score[rows] + margin * resident)
        first = table.first[rows]
        # Never-evict and canary versions rank first: two groups, each by (key, name).
        self.groups = [(rows[first], key[first]), (rows[~first], key[~first])]
        self.rows = rows  # unordered
        self.size = len(rows)
        self.order: list[int] = []

    def top(self, k: int) -> list[int]:
        """The first ``k`` rows in rank order (fewer when fewer are wanted)."""
        while len(self.order) < k and self._extend():
            pass
        return self.order[:k]

    def __iter__(self) -> Iterator[int]:
        n = 0
        while n < len(self.order) or self._extend():
            yield self.order[n]
            n += 1

    def _extend(self) -> bool:
        if len(self.order) == self.size:
            return False
        m = max(64, self.expected + 1, 2 * len(self.order))
        order: list[int] = []
        for rows, key in self.groups:
            if len(order) >= m:
                break
            order += self._top(rows, key, m - len(order))
        self.order = order
        return True

    def _top(self, rows: np.ndarray, key: np.ndarray, m: int) -> list[int]:
        """The ``m`` best of ``rows`` by (key, name), in order."""
        if m < len(rows):
            kth = np.partition(key, m - 1)[m - 1]
            keep = key <= kth  # every tie at the m-th key: the names decide among them
            rows, key = rows[keep], key[keep]
        by_key = np.argsort(key, kind="stable")
        rows, key = rows[by_key], key[by_key]
        out: list[int] = rows.tolist()
        tied = np.diff(np.concatenate(([0], (key[1:] == key[:-1]).astype(np.int8), [0])))
        lora = self.table.lora
        for start, end in zip(
            np.flatnonzero(tied == 1).tolist(), np.flatnonzero(tied == -1).tolist(), strict=True
        ):
            out[start : end + 1] = sorted(out[start : end + 1], key=lora.__getitem__)
        return out[:m]
