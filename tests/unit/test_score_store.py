"""The score states one streams worker shares between its scoring thread and its planner:
the planner's copy never changes under it and never shows half a reload."""

from __future__ import annotations

import asyncio
import threading

import pytest
from loraplane.streams.score_store import ScoreStore
from loraplane.streams.scores import Decayed, ScoreState

T0 = 1_800_000_000.0


def state(n: float) -> ScoreState:
    return ScoreState(requests_10m=Decayed(600.0, n, T0), last_request=T0)


def test_the_planner_copy_does_not_follow_later_writes() -> None:
    store = ScoreStore()
    store.update({"a@1": state(1)})
    copy = store.states()
    store.update({"a@1": state(2), "b@1": state(3)})
    assert copy == {"a@1": state(1)}
    assert store.states() == {"a@1": state(2), "b@1": state(3)}


def test_replace_all_drops_keys_the_topic_no_longer_has() -> None:
    store = ScoreStore()
    store.update({"a@1": state(1), "b@1": state(2)})
    store.replace_all({"b@1": state(5)})
    assert store.states() == {"b@1": state(5)}


def test_the_writer_reads_live_but_cannot_write_through_the_view() -> None:
    store = ScoreStore()
    live = store.live()
    store.update({"a@1": state(1)})
    assert live["a@1"] == state(1)
    with pytest.raises(TypeError):
        live["b@1"] = state(2)  # type: ignore[index]


def test_a_reader_sees_every_reload_whole() -> None:
    """A writer thread swaps between two full sets; every copy is one of them."""
    store = ScoreStore()
    sets = [{f"k{i}": state(1) for i in range(2000)}, {f"j{i}": state(2) for i in range(2000)}]
    store.replace_all(sets[0])
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            store.replace_all(sets[i % 2])

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(200):
            assert store.states() in sets
    finally:
        stop.set()
        thread.join()


def test_two_stores_are_independent() -> None:
    """Nothing is module state: a second app (or test) gets its own states and events."""
    a, b = ScoreStore(), ScoreStore()
    a.update({"a@1": state(1)})

    async def mark() -> None:
        a.ready.set()

    asyncio.run(mark())
    assert b.states() == {} and not b.ready.is_set() and a.ready.is_set()
