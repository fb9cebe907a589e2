"""The planner's inputs as columns kept between ticks: what the registry and the score
states say about every serving version, rebuilt only where they changed.

Why: a tick at 100k versions spent ~400 ms re-deriving the same facts (names, statuses,
score keys, counter values) from the same objects every second. Change is detected by
identity, which is cheap and exact here: registry views are immutable and replaced when an
adapter's state changes (``streams.planner_agent._Views`` caches them by ``last_seq``), and
score states are replaced, never mutated, when a request touches them. So a tick looks up
each version's score state (two C-level passes) and re-derives only the rows whose state
object is new; a changed registry is re-read whole (rare: lifecycle events), carrying the
score columns of the versions it still holds over by name.

Only facts that do not depend on time live here; the planner decays them each tick.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, repeat
from operator import attrgetter, is_not, itemgetter
from typing import Any, TypeVar, cast

import numpy as np

from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.base import lora_names
from loraplane.schemas.registry import AdapterView
from loraplane.streams.scores import (
    ScoreInputs,
    ScoreState,
    merged,
    score_keys,
    unattributed_keys,
)

__all__ = ["EMPTY", "BaseRows", "Categories", "Columns", "Registry", "Scores"]

EMPTY = ScoreState()
_STALE = object()  # a carried-over row whose score columns must be re-derived
_VERSIONS = attrgetter("versions")
_LAST_REQUEST = attrgetter("last_request")
_SERVED = attrgetter("served_after_load")
_ERRORS = attrgetter("errors_after_load")
_VALUE = attrgetter("value")
_AT = attrgetter("at")
_C = TypeVar("_C")


@dataclass(frozen=True)
class Categories:
    """A column of few distinct values (statuses, priorities, request classes): each row's
    code into ``values``, so a condition is decided once per distinct value."""

    codes: np.ndarray
    values: list[Any]  # statuses, priority names, request classes: whatever the column holds

    @classmethod
    def encode(cls, items: Iterable[Hashable]) -> Categories:
        items = list(items)
        values = list(dict.fromkeys(items))
        index = {v: code for code, v in enumerate(values)}
        return cls(np.fromiter(map(index.__getitem__, items), np.intp, len(items)), values)

    def code(self, value: Hashable) -> int:
        """The code of ``value``; -1 when no row holds it."""
        return self.values.index(value) if value in self.values else -1

    def take(self, rows: np.ndarray) -> Categories:
        return Categories(self.codes[rows], self.values)

    def renamed(self, name: Callable[[Any], Any]) -> Categories:
        """The same rows with each distinct value replaced by ``name(value)`` (one-to-one)."""
        return Categories(self.codes, list(map(name, self.values)))

    def lookup(self, value_of: Mapping[Any, float], default: float) -> np.ndarray:
        """``value_of.get(row's value, default)`` for each row, as floats."""
        table = np.array([value_of.get(v, default) for v in self.values], dtype=float)
        looked_up: np.ndarray = table[self.codes]
        return looked_up


class Registry:
    """Every version in the registry, and the serving ones (active or canary) as rows in
    registry order."""

    def __init__(self, views: list[AdapterView]) -> None:
        self.views = views
        versions = list(chain.from_iterable(map(_VERSIONS, views)))
        # Each record's fields, read from its dict a column at a time: a pass per field
        # (a pass building a tuple per row allocates 100k tracked tuples, each a step
        # towards a collection that walks every object built since), and a dict look-up
        # per value (a third cheaper than an attribute read on a model).
        fields: list[Mapping[str, Any]] = list(map(vars, versions))

        def column(name: str, of: list[Mapping[str, Any]]) -> list[Any]:
            return list(map(itemgetter(name), of))

        adapter_ids, shas = column("adapter_id", fields), column("sha256", fields)
        version_ids, statuses = column("version", fields), column("status", fields)
        keys = score_keys(adapter_ids, version_ids)
        loras = lora_names(keys, shas)
        self.records: dict[str, AdapterRecord] = dict(zip(loras, versions, strict=True))
        status = Categories.encode(statuses)
        # A name seen twice is its last record's (as the dict says).
        self.revoked = {
            lora
            for lora in map(
                loras.__getitem__,
                np.flatnonzero(status.codes == status.code(AdapterStatus.revoked)).tolist(),
            )
            if self.records[lora].status is AdapterStatus.revoked
        }
        serving = np.flatnonzero(
            (status.codes == status.code(AdapterStatus.active))
            | (status.codes == status.code(AdapterStatus.canary))
        )
        n, rows = len(serving), serving.tolist()

        def pick(column: list[_C]) -> list[_C]:
            """The serving rows of a column (all of it in the common case)."""
            return column if n == len(versions) else list(map(column.__getitem__, rows))

        self.record: list[AdapterRecord] = pick(versions)
        self.lora: list[str] = pick(loras)
        self.status = status.take(serving)
        self.canary = self.status.codes == self.status.code(AdapterStatus.canary)
        fields = pick(fields)
        self.priorities = Categories.encode(column("priority", fields)).renamed(str)
        self.size_bytes = np.fromiter(map(itemgetter("size_bytes"), fields), np.int64, n)
        self.ranks = np.fromiter(map(itemgetter("rank"), fields), np.int64, n)
        self.adapters: list[str] = pick(adapter_ids)
        self.keys = pick(keys)
        self.active = self.status.codes == self.status.code(AdapterStatus.active)
        self.unattributed: list[str | None] = unattributed_keys(self.adapters)
        for i in np.flatnonzero(~self.active).tolist():
            self.unattributed[i] = None
        self.bases = _bases(Categories.encode(column("base_model", fields)), self.lora)

    @cached_property
    def row_of_key(self) -> dict[str, int] | None:
        """Score key -> the row reading it; None when some key is read by several rows (an
        adapter listed twice), and then every tick looks every row up. Built on the first
        tick that reads only what changed: a first tick looks every row up anyway."""
        n = len(self.keys)
        row_of_key = dict(zip(self.keys, range(n), strict=True))
        active_rows = np.flatnonzero(self.active).tolist()
        read = dict(zip(map(self.unattributed.__getitem__, active_rows), active_rows, strict=True))
        if len(row_of_key) + len(read) < n + len(active_rows) or not row_of_key.keys().isdisjoint(
            read
        ):
            return None
        # every active row has an unattributed key: no None among them
        row_of_key.update(cast(dict[str, int], read))
        return row_of_key

    @cached_property
    def ranked(self) -> tuple[list[str], np.ndarray]:
        """Every serving name and its row, base model by base model (``Plan.scores``)."""
        ranked = [self.bases[base] for base in sorted(self.bases)]
        return (
            list(chain.from_iterable(b.index for b in ranked)),
            np.concatenate([b.rows for b in ranked] or [np.zeros(0, np.intp)]),
        )

    @cached_property
    def rows_of_adapter(self) -> dict[str, list[int]]:
        rows: dict[str, list[int]] = {}
        for i, a in enumerate(self.adapters):
            rows.setdefault(a, []).append(i)
        return rows

    def scheduled(self, scores: Mapping[str, float]) -> np.ndarray:
        """The scheduled warm-up score of each row, from ``{adapter_id: score}``."""
        column = np.zeros(len(self.lora))
        for adapter_id, score in scores.items():
            column[self.rows_of_adapter.get(adapter_id, [])] = score
        return column


@dataclass(frozen=True)
class BaseRows:
    """The serving rows of one base model by name (a name seen twice keeps its last row)."""

    index: dict[str, int]
    rows: np.ndarray  # index.values()


def _bases(base_of: Categories, lora: list[str]) -> dict[str, BaseRows]:
    order = np.argsort(base_of.codes, kind="stable")
    ends = np.cumsum(np.bincount(base_of.codes, minlength=len(base_of.values))).tolist()
    out = {}
    for base, start, end in zip(base_of.values, [0, *ends], ends, strict=False):
        rows = order[start:end].tolist()
        index = dict(zip(map(lora.__getitem__, rows), rows, strict=True))
        out[base] = BaseRows(index, np.fromiter(index.values(), np.intp, len(index)))
    return out


class Scores:
    """The time-independent score facts of each serving row: the state it was derived
    from (a version's own, merged with its adapter's unattributed demand when active) and
    its counters as float columns."""

    def __init__(self, n: int) -> None:
        # Every row reflects the mapping of the last refresh (``changed`` is relative to it).
        self.synced = False
        self.fresh = True  # no row read yet: a first refresh derives every one
        # The score mapping as of the last full scan, in order; None: not kept (rows not
        # derived yet, or refreshed since from the changed keys alone).
        self.seen_keys: list[str] | None = None
        self.seen_states: list[ScoreState] = []
        # the score state objects the rows come from (_STALE: not read yet)
        self.own: list[ScoreState | object] = [_STALE] * n
        self.unattributed: list[ScoreState | object | None] = [_STALE] * n
        self.state: list[ScoreState] = [EMPTY] * n
        zeros = np.zeros
        self.inputs = ScoreInputs.zeros(n)
        self.last = zeros(n)  # last request time, NaN when never
        self.served_value, self.served_at = zeros(n), zeros(n)
        self.errors_value, self.errors_at = zeros(n), zeros(n)

    def carried(self, src: np.ndarray) -> Scores:
        """The rows ``src`` (-1: a new row, to be derived) of these columns."""
        keep = src >= 0
        if not keep.any():
            return Scores(len(src))
        out = Scores(0)
        out.fresh = False
        take = np.where(keep, src, 0)
        picked = [i if k else -1 for i, k in zip(take.tolist(), keep.tolist(), strict=True)]

        def rows(values: list[object]) -> list[object]:
            return [values[i] if i >= 0 else _STALE for i in picked]

        out.own, out.unattributed = rows(self.own), rows(self.unattributed)
        out.state = [self.state[i] if i >= 0 else EMPTY for i in picked]
        x = self.inputs
        out.inputs = x.rows(take)
        out.last = self.last[take]
        out.served_value, out.served_at = self.served_value[take], self.served_at[take]
        out.errors_value, out.errors_at = self.errors_value[take], self.errors_at[take]
        return out

    def refresh(
        self,
        registry: Registry,
        scores: Mapping[str, ScoreState],
        changed: Iterable[str] | None = None,
    ) -> None:
        """Re-derive the rows whose score states are new objects. ``changed``: every key
        added, replaced or removed since the mapping of the last refresh (the planner
        runtime's score view counts them); then only their rows are read, so a tick costs
        what changed, not the registry's size. Without it, when the mapping still starts
        with the keys it had last time (states are replaced in place, new keys are
        appended: a dict's order), the changed keys are found by one positional scan of
        its states; otherwise every row's states are looked up again."""
        # ``row_of_key`` is built on first use: a first refresh looks every row up.
        if changed is not None and self.synced and (row_of := registry.row_of_key) is not None:
            rows = sorted({i for key in changed if (i := row_of.get(key)) is not None})
            self._read(registry, scores, rows)
            # The positional scan compares against the last full scan: stale from now on.
            self.seen_keys, self.seen_states = None, []
            return
        keys, states = list(scores), list(scores.values())
        seen, m = self.seen_keys, len(self.seen_states)
        # Equal keys at the same positions are the same keys; ids of the states held in
        # ``seen_states`` cannot have been reused by other objects.
        if (
            seen is not None
            and (row_of := registry.row_of_key) is not None
            and len(keys) >= m
            and (keys if len(keys) == m else keys[:m]) == seen
        ):
            moved = np.flatnonzero(
                np.fromiter(map(id, states), np.intp, m)  # the first m
                != np.fromiter(map(id, self.seen_states), np.intp, m)
            )
            rows = sorted(
                {
                    i
                    for j in (*moved.tolist(), *range(m, len(keys)))
                    if (i := row_of.get(keys[j])) is not None
                }
            )
            self._read(registry, scores, rows)
        else:
            # map over the bound get: the rebuild reads 100k keys (a comprehension is slower)
            get = cast(Callable[[str | None, ScoreState | None], ScoreState | None], scores.get)
            own: list[ScoreState | object] = list(map(get, registry.keys, repeat(EMPTY)))
            unattributed: list[ScoreState | object | None] = list(
                map(get, registry.unattributed, repeat(None))
            )
            n = len(own)
            changed = (
                np.arange(n)
                if self.fresh
                else np.flatnonzero(
                    np.fromiter(map(is_not, own, self.own), bool, n)
                    | np.fromiter(map(is_not, unattributed, self.unattributed), bool, n)
                )
            )
            self.own, self.unattributed = own, unattributed
            self._derive(changed)
        self.seen_keys, self.seen_states = keys, states
        self.synced, self.fresh = True, False

    def _read(self, registry: Registry, scores: Mapping[str, ScoreState], rows: list[int]) -> None:
        """Look ``rows``' states up again and re-derive them."""
        for i in rows:
            self.own[i] = scores.get(registry.keys[i], EMPTY)
            u = registry.unattributed[i]
            self.unattributed[i] = None if u is None else scores.get(u)
        self._derive(np.array(rows, dtype=np.intp))

    def _derive(self, rows: np.ndarray) -> None:
        if not rows.size:
            return
        m, every = len(rows), len(rows) == len(self.state)  # rows: distinct, ascending
        index = rows.tolist()
        own = self.own if every else list(map(self.own.__getitem__, index))
        extra = self.unattributed if every else list(map(self.unattributed.__getitem__, index))
        states = cast(list[ScoreState], list(own))
        # An adapter's unattributed demand merged into its active version (rows with some)
        for k in np.flatnonzero(np.fromiter(map(is_not, extra, repeat(None)), bool, m)).tolist():
            states[k] = merged(cast(ScoreState, own[k]), cast(ScoreState, extra[k]))
        if every:
            self.state = states
        else:
            for i, state in zip(index, states, strict=True):
                self.state[i] = state
        fresh = ScoreInputs.from_states(states)
        if every:
            self.inputs = fresh
        else:
            x = self.inputs
            for column, values in (
                (x.r10_value, fresh.r10_value),
                (x.r10_at, fresh.r10_at),
                (x.r1_value, fresh.r1_value),
                (x.r1_at, fresh.r1_at),
                (x.ttft_known, fresh.ttft_known),
                (x.ttft_gap_ms, fresh.ttft_gap_ms),
                (x.daily, fresh.daily),
            ):
                column[rows] = values
        self.last[rows] = np.array(list(map(_LAST_REQUEST, states)), dtype=float)
        served, errors = list(map(_SERVED, states)), list(map(_ERRORS, states))
        self.served_value[rows] = np.fromiter(map(_VALUE, served), float, m)
        self.served_at[rows] = np.fromiter(map(_AT, served), float, m)
        self.errors_value[rows] = np.fromiter(map(_VALUE, errors), float, m)
        self.errors_at[rows] = np.fromiter(map(_AT, errors), float, m)


class Columns:
    """The registry and score columns of the last tick, brought up to date for the next."""

    def __init__(self) -> None:
        self.registry = Registry([])
        self.scores = Scores(0)

    def update(
        self,
        views: Iterable[AdapterView],
        scores: Mapping[str, ScoreState],
        changed: Iterable[str] | None = None,
    ) -> tuple[Registry, Scores]:
        """``changed``: the score keys added, replaced or removed since the last update
        (``Scores.refresh``); None when unknown."""
        views = views if isinstance(views, list) else list(views)
        old = self.registry
        # The same view objects (or equal ones) in the same order: list equality, which
        # checks identity first, is one C-level pass.
        if views != old.views:
            self.registry = Registry(views)
            row_of = {lora: i for i, lora in enumerate(old.lora)}
            src = np.fromiter(
                map(row_of.get, self.registry.lora, repeat(-1)), np.intp, len(self.registry.lora)
            )
            self.scores = self.scores.carried(src)  # its snapshot is empty: a full look-up
        try:
            self.scores.refresh(self.registry, scores, changed)
        except BaseException:
            # Rows half re-derived would pass for current: start the next one afresh.
            self.scores = Scores(len(self.registry.lora))
            raise
        return self.registry, self.scores
