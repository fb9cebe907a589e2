"""The sink's journal is closed only after a sync still running in another thread: a process's
``poll_forever`` fsyncs the journal through ``asyncio.to_thread``, and cancelling that task at
the stop leaves its thread running. ``close`` returned while that fsync was still under way
(its own final sync found nothing left: the running one had taken the writes), and a sync
that began after ``close`` duplicated closed descriptors (EBADF in the thread, or another
file's descriptor reusing the number)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loraplane.eventlog import journal as journal_module
from loraplane.eventlog.journal import EventJournal
from loraplane.kernel.tasks import cancel_all
from tests.unit.test_event_spool import Broker, Clock, event, sink_on


class BlockedFsync:
    """``os.fsync`` that, once armed, blocks its first call until ``release``; records the
    order of what happened (``synced``, and the test's own marks)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.order: list[str] = []
        self._real: Callable[[int], None] = os.fsync
        self._first = True

    def __call__(self, fd: int) -> None:
        if self._first:
            self._first = False
            self.entered.set()
            assert self.go.wait(10), "never released"
            self._real(fd)
            self.order.append("synced")
            return
        self._real(fd)


@pytest.fixture
def fsync(monkeypatch: pytest.MonkeyPatch) -> Iterator[BlockedFsync]:
    blocked = BlockedFsync()
    monkeypatch.setattr(journal_module.os, "fsync", blocked)
    yield blocked
    blocked.go.set()


def _closing(close: Callable[[], object], order: list[str]) -> threading.Thread:
    def run() -> None:
        close()
        order.append("closed")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_close_waits_for_a_sync_running_in_another_thread(
    tmp_path: Path, fsync: BlockedFsync
) -> None:
    journal = EventJournal(tmp_path / "j")
    journal.append("t", None, b"v0")
    errors: list[BaseException] = []

    def sync() -> None:
        try:
            journal.sync()
        except BaseException as exc:
            errors.append(exc)

    syncing = threading.Thread(target=sync, daemon=True)
    syncing.start()
    assert fsync.entered.wait(10)  # the sync holds the writes, its fsync not done
    closing = _closing(journal.close, fsync.order)
    closing.join(0.2)  # before: close returned at once, the fsync still under way
    fsync.go.set()
    syncing.join(10)
    closing.join(10)
    assert fsync.order == ["synced", "closed"]
    assert errors == []
    assert [e.value for e in EventJournal(tmp_path / "j").recovered] == [b"v0"]


def test_a_sync_after_close_does_nothing(tmp_path: Path) -> None:
    """A sync whose thread took the journal before ``close`` and runs after it: no closed
    descriptor is duplicated."""
    journal = EventJournal(tmp_path / "j")
    journal.done(journal.append("t", None, b"v0"))
    journal.sync()
    journal.close()  # removes the done segment: the directory has changes to fsync
    journal.sync()  # before: os.dup of the closed directory descriptor, EBADF


def test_close_is_bounded_and_says_so(
    tmp_path: Path, fsync: BlockedFsync, caplog: pytest.LogCaptureFixture
) -> None:
    journal = EventJournal(tmp_path / "j")
    journal.append("t", None, b"v0")
    syncing = threading.Thread(target=journal.sync, daemon=True)
    syncing.start()
    assert fsync.entered.wait(10)
    with caplog.at_level(logging.ERROR, logger=journal_module.log.name):
        journal.close(wait_s=0.05)
    assert "a sync still runs after 0.1 s" in caplog.text
    fsync.go.set()
    syncing.join(10)
    assert fsync.order == ["synced"]  # its fsync ended on its own descriptor, no error
    assert [e.value for e in EventJournal(tmp_path / "j").recovered] == [b"v0"]


async def test_the_sink_closes_after_its_cancelled_poller_s_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: BlockedFsync
) -> None:
    """The runtimes' stop: ``poll_forever``'s task cancelled while its ``to_thread`` fsync
    runs, then ``sink.close``: it returns only after that fsync (before: at once)."""
    broker = Broker()
    sink = sink_on(broker, tmp_path, monkeypatch, Clock())
    for n in range(3):
        sink.emit("audit", f"k{n}", event(n))
    poller = asyncio.create_task(asyncio.to_thread(sink.sync))
    assert await asyncio.to_thread(fsync.entered.wait, 10)
    await cancel_all({poller})  # the task ends, its thread does not
    threading.Timer(0.2, fsync.go.set).start()
    sink.close(5.0)
    fsync.order.append("closed")
    assert fsync.order == ["synced", "closed"]
