"""``kernel.tasks.cancel_all``: the one way a runtime ends the tasks it started."""

from __future__ import annotations

import asyncio

import pytest

from loraplane.kernel.tasks import cancel_all


async def test_every_task_has_ended_when_cancel_all_returns() -> None:
    """A task cancelled mid-await finishes its own clean-up (which awaits) before
    ``cancel_all`` returns; a finished and a failed task are only waited for, and the
    failure is neither raised here nor left unretrieved."""
    cleaned: list[str] = []

    async def holds(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.01)  # its clean-up needs the loop
            cleaned.append(name)

    async def fails() -> None:
        raise RuntimeError("boom")

    async def done() -> int:
        return 1

    tasks = {name: asyncio.create_task(holds(name)) for name in ("a", "b")}
    failed, finished = asyncio.create_task(fails()), asyncio.create_task(done())
    await asyncio.sleep(0)  # each is started, the two last have ended
    await cancel_all([*tasks.values(), failed, finished])
    assert sorted(cleaned) == ["a", "b"]
    assert all(t.cancelled() for t in tasks.values())
    assert isinstance(failed.exception(), RuntimeError) and finished.result() == 1


async def test_any_iterable_is_read_once_before_the_first_await() -> None:
    """A dict's view may change while the tasks end (their done callbacks remove them):
    what it held at the call is what is cancelled and waited for."""
    live: dict[str, asyncio.Task[None]] = {}

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            live.pop(name, None)

    for name in ("x", "y", "z"):
        live[name] = asyncio.create_task(forever(name))
    held = list(live.values())
    await asyncio.sleep(0)  # each waits in its body
    await cancel_all(live.values())
    assert live == {} and all(t.done() for t in held)
    await cancel_all([])  # nothing to end


async def test_the_caller_cancelled_while_waiting_still_cancels_every_task() -> None:
    """The owner itself stopped (its task cancelled) while it waits: its tasks are cancelled
    all the same, and the cancellation reaches the owner."""
    inner = [asyncio.create_task(asyncio.Event().wait()) for _ in range(3)]

    async def owner() -> None:
        await cancel_all(inner)

    outer = asyncio.create_task(owner())
    await asyncio.sleep(0)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    await asyncio.sleep(0)
    assert all(t.cancelled() for t in inner)
