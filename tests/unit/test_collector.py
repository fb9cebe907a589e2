"""The collector held off for a block: no automatic collection inside it, enabled again
after it exactly when it was before (nested blocks and errors included); a planner's tick
and priming leave it as they found it."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from loraplane.kernel import collector
from loraplane.kernel.policy import Policy
from loraplane.streams.planner import Planner, plan


@pytest.fixture
def enabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_held_off_inside_and_enabled_again_after(enabled: None) -> None:
    with collector.held_off():
        assert not gc.isenabled()
        with collector.held_off():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outermost block enables it again
    assert gc.isenabled()


def test_enabled_again_after_an_error(enabled: None) -> None:
    with pytest.raises(RuntimeError), collector.held_off():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled(enabled: None) -> None:
    gc.disable()
    with collector.held_off():
        pass
    assert not gc.isenabled()


def test_a_tick_and_a_priming_leave_the_collector_as_they_found_it(enabled: None) -> None:
    planner = Planner()
    planner.prime([], {})
    assert gc.isenabled()
    assert plan([], {}, [], Policy(), 0.0).commands == []
    assert gc.isenabled()
    gc.disable()
    planner.tick([], {}, [], Policy(), 1.0)
    assert not gc.isenabled()
