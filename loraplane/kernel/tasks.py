"""Ending the asyncio tasks a runtime started (the router's loops and probes, the worker
agent's loops and fetches, the worker process's own): cancelled, then waited for, so none is
left pending to act after its owner stopped, and none's exception goes unretrieved."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

__all__ = ["cancel_all"]


async def cancel_all(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until each has ended (an HTTP request in flight in one is
    abandoned, its connection closed): none is left pending, none acts later. What each
    ended with (its result, its exception, its cancellation) is taken and dropped here: the
    caller stops them, it does not judge them. A task already done is only waited for. A
    task awaiting ``asyncio.to_thread`` ends at once, but its thread runs on to its end: what
    such a thread touches needs its own stop (the host tier's ``stop_fetches``), and is
    closed only after it (``kernel.thread_calls``)."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
