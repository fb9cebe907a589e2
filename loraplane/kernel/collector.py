"""CPython's cyclic garbage collector, tuned for the long-running components whose live
objects make its default thresholds costly. The thresholds are the process's (CPython has
one collector), so these only ever raise them: components sharing a process never undo each
other's setting."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collect_the_oldest_after", "collect_the_young_after", "freeze_survivors", "held_off"]


def collect_the_young_after(allocations: int) -> None:
    """A young collection once ``allocations`` more container objects are alive than at
    the last one (CPython: 700)."""
    young, middle, oldest = gc.get_threshold()
    if young and young < allocations:
        gc.set_threshold(allocations, middle, oldest)


def collect_the_oldest_after(middle_collections: int) -> None:
    """A full collection once ``middle_collections`` middle-generation ones ran since the
    last (CPython: 10, and only once a quarter of the old objects are new)."""
    young, middle, oldest = gc.get_threshold()
    if young and oldest < middle_collections:
        gc.set_threshold(young, middle, middle_collections)


@contextmanager
def held_off() -> Iterator[None]:
    """No automatic collection while the block runs; the collector is enabled again after
    it if it was before (a block inside another, or beside one on another thread, leaves it
    to the outermost). For a burst that builds many long-lived containers at once, such as
    a planner's 100k-row columns: every young collection on the way walks each large list
    built so far, item by item (a hundred walks of the same rows per cold tick), where the
    first collection after the block walks them once. Garbage is collected later, never
    lost."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_survivors() -> None:
    """Collect everything once, then move every object still alive into the permanent
    generation (``gc.freeze``), where no later collection walks it: what a long-running
    component holds before its loop (its modules, a framework's objects, state read at start)
    would otherwise be walked again by every full collection, which stops all of the
    process's threads. Called again (a keeper's next read-back after a rebalance), it first
    unfreezes, so a cycle frozen earlier and dead since is collected by that one walk rather
    than kept for good. Frozen objects are still freed when their last reference goes."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
