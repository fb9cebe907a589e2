"""The planner runtime primes its planner while standby (``PlannerRuntime._prime``): the
columns follow what the tails hold, the score view's changes are handed over once, and a
priming that fails never stops the standby and leaves the next read comparing everything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loraplane.streams.planner import Plan, Planner
from loraplane.streams.planner_runtime import PlannerRuntime
from loraplane.streams.scores import score_key, snapshot_bytes
from tests.unit.test_planner import busy
from tests.unit.test_planner_liveness import runtime_with


class PrimeSpy(Planner):
    """A real planner that records what it was primed with and ticked on."""

    def __init__(self) -> None:
        super().__init__()
        self.primed: list[tuple[set[str], set[str] | None]] = []
        self.ticked: list[set[str] | None] = []

    def prime(self, views: Any, scores: Any, changed: Any = None) -> None:
        self.primed.append((set(scores), None if changed is None else set(changed)))
        super().prime(views, scores, changed)

    def tick(self, *args: Any, **kwargs: Any) -> Plan:
        changed = args[7] if len(args) > 7 else kwargs.get("changed")
        self.ticked.append(None if changed is None else set(changed))
        return super().tick(*args, **kwargs)


def score(runtime: PlannerRuntime, adapter: str, qps: float) -> str:
    key = score_key(adapter, "1")
    runtime.scores.apply(key, snapshot_bytes(busy(qps)))
    return key


def test_a_standby_primes_once_per_change_and_its_first_tick_reads_only_what_changed(
    tmp_path: Path,
) -> None:
    runtime = runtime_with(tmp_path)
    spy = runtime.planner = PrimeSpy()
    a = score(runtime, "a", 1.0)
    runtime._prime()
    assert spy.primed == [({a}, None)]  # the first read: every key compared
    b = score(runtime, "b", 2.0)
    runtime._prime()  # moved, but within the planner interval: not yet
    assert len(spy.primed) == 1
    runtime._prime_due = 0.0  # the interval passed
    runtime._prime()
    assert spy.primed[-1] == ({a, b}, {b})
    runtime._prime_due = 0.0
    runtime._prime()  # nothing moved: not primed again
    assert len(spy.primed) == 2
    c = score(runtime, "c", 0.5)
    runtime.plan_now(runtime.planner)  # the takeover's first tick
    assert spy.ticked == [{c}]  # only the key changed since the last priming


def test_a_priming_that_fails_does_not_stop_the_standby_and_the_next_read_compares_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = runtime_with(tmp_path)
    spy = runtime.planner = PrimeSpy()
    score(runtime, "a", 1.0)
    runtime.scores.take()  # changes known from here on
    score(runtime, "b", 1.0)

    def broken(*_: Any) -> None:
        raise ValueError("a bad record")

    monkeypatch.setattr(spy, "prime", broken)
    runtime._prime()  # does not raise: the standby goes on
    assert runtime.scores.take()[1] is None  # the changes it took were not read: unknown
