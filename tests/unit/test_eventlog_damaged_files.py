"""The event journal and spool read back at start whatever a crash, a full disk or a local
user left at their paths: a segment, cursor or lock that is a folder, a FIFO, a name the code
never writes or a file past any segment's size is logged and left, never a crash or a hang
of the process, and the events of the intact segments still come back once."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from loraplane.eventlog.journal import EventJournal
from loraplane.eventlog.spool import CURSOR_FILE, READ_LIMIT, EventSpool
from tests.unit.test_event_spool import Broker, Clock, details, drain, event, sink_on


def _folder(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"x")


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _huge(path: Path) -> None:
    with path.open("wb") as fh:
        fh.truncate(READ_LIMIT + 1)


DAMAGE: dict[str, Callable[[Path], None]] = {"folder": _folder, "fifo": _fifo, "huge": _huge}
ODD_NAMES = ["².journal", "7.journal", "٣.journal"]  # isdigit(), but not a name it writes


def _journal_with_events(folder: Path, n: int) -> None:
    journal = EventJournal(folder)
    for i in range(n):
        journal.append("t", None, f"v{i}".encode())
    journal.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_journal_segment_that_is_no_file_is_left_and_the_rest_recovered(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "j"
    _journal_with_events(folder, 3)
    DAMAGE[kind](folder / f"{5:012d}.journal")
    journal = EventJournal(folder)
    assert [e.value for e in journal.recovered] == [b"v0", b"v1", b"v2"]
    assert "not read" in caplog.text
    journal.forget()  # the damaged one stays for an operator, out of the way
    assert [p.name.split("-")[0] for p in folder.glob("*.damaged-*")] == [
        f"{5:012d}.journal.damaged"
    ]
    assert journal.append("t", None, b"new") == 3
    journal.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ODD_NAMES)
def test_a_journal_segment_name_it_never_writes_is_ignored(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "j"
    _journal_with_events(folder, 2)
    (folder / name).write_bytes(b"planted")
    journal = EventJournal(folder)
    assert [e.value for e in journal.recovered] == [b"v0", b"v1"]
    journal.close()


@pytest.mark.timeout(30)
def test_a_journal_lock_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    from loraplane.eventlog.journal import JournalUnavailable

    folder = tmp_path / "j"
    folder.mkdir()
    os.mkfifo(folder / ".lock")
    with pytest.raises(JournalUnavailable):
        EventJournal(folder)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_spool_segment_or_cursor_that_is_no_file_is_left_and_the_rest_replayed(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "s"
    spool = EventSpool(folder, max_bytes=10**6)
    for i in range(3):
        assert spool.append("t", None, f"v{i}".encode())
    spool.close()
    DAMAGE[kind](folder / f"{9:012d}.spool")
    (folder / CURSOR_FILE).unlink(missing_ok=True)
    DAMAGE[kind](folder / CURSOR_FILE)
    again = EventSpool(folder, max_bytes=10**6)
    assert [e.value for e in again.peek(10)] == [b"v0", b"v1", b"v2"]
    assert again.records == 3
    assert "not read" in caplog.text
    assert again.append("t", None, b"v3")  # appends go on past the damaged segment
    assert [e.value for e in again.peek(10)][-1] == b"v3"
    again.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["².spool", "7.spool"])
def test_a_spool_segment_name_it_never_writes_is_ignored(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "s"
    spool = EventSpool(folder, max_bytes=10**6)
    assert spool.append("t", None, b"v0")
    spool.close()
    (folder / name).write_bytes(b"planted\n")
    again = EventSpool(folder, max_bytes=10**6)
    assert [e.value for e in again.peek(10)] == [b"v0"] and again.records == 1
    again.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_sink_starts_over_damaged_state_and_delivers_what_it_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Before, the worker, gateway or router died (or hung on a FIFO) building its sink."""
    folder = tmp_path / "spool" / "w1" / "journal"
    journal = EventJournal(folder)
    for i in range(2):
        journal.append("lp.audit", None, event(i).model_dump_json().encode())
    journal.close()
    DAMAGE[kind](folder / f"{8:012d}.journal")
    DAMAGE[kind](folder.parent / f"{8:012d}.spool")
    broker, clock = Broker(), Clock()
    sink = sink_on(broker, tmp_path, monkeypatch, clock)
    assert sink.counts.recovered == 2
    sink.emit("audit", "k", event(2))
    drain(sink, clock)
    assert details(broker.log) == [0, 1, 2]
    sink.close(1.0)


def test_recovered_events_the_spool_cannot_take_stay_in_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, they were counted as dropped and the journal's segments removed all the same:
    a restart onto a smaller spool bound (or a full disk) lost events the journal held."""
    folder = tmp_path / "spool" / "w1" / "journal"
    journal = EventJournal(folder)
    for i in range(5):
        journal.append("lp.audit", None, event(i).model_dump_json().encode())
    journal.close()
    broker, clock = Broker(), Clock()
    small = sink_on(broker, tmp_path, monkeypatch, clock, max_bytes=700)
    assert small.counts.recovered < 5 and small.counts.dropped == 0
    drain(small, clock)
    small.close(1.0)
    roomy = sink_on(broker, tmp_path, monkeypatch, clock)
    drain(roomy, clock)
    roomy.close(1.0)
    assert set(details(broker.log)) == set(range(5))  # each at least once, none lost
    assert not list((tmp_path / "spool").rglob("*.journal"))


@pytest.mark.parametrize("failing", ["cursor", "fsync"])
def test_a_disk_error_under_the_spool_never_stops_the_sinks_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """Before, a full disk under the spool's cursor (or an fsync error) raised out of
    ``poll``, which ended the process's ``poll_forever`` task for good: no replay, no
    journal fsync, no delivery report served outside ``emit`` from then on."""
    import errno

    from loraplane.eventlog import spool as spool_module

    broker, clock = Broker(), Clock()
    sink = sink_on(broker, tmp_path, monkeypatch, clock)
    broker.up = False
    for i in range(5):
        sink.emit("audit", "k", event(i))
    sink.poll()
    assert sink.backlog == 5

    def full(*_a: object, **_k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    if failing == "cursor":
        monkeypatch.setattr(spool_module, "write_atomic", full)
    else:
        monkeypatch.setattr(spool_module.os, "fsync", full)
    sink.emit("audit", "k", event(5))
    broker.up = True
    drain(sink, clock)
    assert details(broker.log) == list(range(6))


def test_the_background_poll_outlives_a_poll_that_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever a poll raises, the process's ``poll_forever`` task goes on polling: before,
    one exception ended it silently for the rest of the process's life."""
    import asyncio

    from loraplane.eventlog.sink import poll_forever

    broker, clock = Broker(), Clock()
    sink = sink_on(broker, tmp_path, monkeypatch, clock)
    real, calls = sink.poll, []

    def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        real()

    monkeypatch.setattr(sink, "poll", flaky)

    async def run() -> None:
        task = asyncio.create_task(poll_forever(sink, every_s=0))
        while len(calls) < 3 and not task.done():
            await asyncio.sleep(0)
        assert not task.done()
        task.cancel()

    asyncio.run(run())
    assert len(calls) >= 3 and "event sink poll failed" in caplog.text


RUNTIME_DAMAGE: dict[str, Callable[[Path], None]] = {
    "fifo": _fifo,
    "folder": _folder,
    "endless-device": lambda p: p.symlink_to("/dev/zero"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", sorted(RUNTIME_DAMAGE))
def test_a_head_segment_replaced_while_the_spool_runs_is_not_waited_on(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "s"
    spool = EventSpool(folder, max_bytes=10**6)
    assert spool.append("t", None, b"v0")
    spool._close_tail()
    head = folder / f"{0:012d}.spool"
    kept = head.read_bytes()
    head.unlink()
    RUNTIME_DAMAGE[kind](head)
    assert spool.peek(10) == []
    assert "not read" in caplog.text
    head.unlink() if not head.is_dir() else (head / "inside").unlink() or head.rmdir()
    head.write_bytes(kept)  # readable again: replayed from where it stopped
    assert [e.value for e in spool.peek(10)] == [b"v0"]
    spool.close()


@pytest.mark.timeout(30)
def test_a_fifo_planted_at_the_next_tail_segment_refuses_the_event_not_the_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "s"
    spool = EventSpool(folder, max_bytes=10**6, segment_bytes=16)
    assert spool.append("t", None, b"v0")
    os.mkfifo(folder / f"{1:012d}.spool")
    assert not spool.append("t", None, b"v1")  # the tail rolls onto the FIFO
    assert "could not write an event" in caplog.text
    assert [e.value for e in spool.peek(10)] == [b"v0"]
    spool.close()


@pytest.mark.timeout(30)
def test_a_fifo_planted_at_the_next_journal_segment_fails_the_append_not_the_process(
    tmp_path: Path,
) -> None:
    """The journal opens a new segment when the tail is full: a FIFO planted at that name
    blocked the open (and the sink's emit) for good. It is an OSError, which the caller
    handles as a disk refusing (nothing written); once it is gone, appends go on."""
    folder = tmp_path / "j"
    journal = EventJournal(folder, segment_bytes=16)
    journal.append("t", None, b"v0")
    fifo = folder / f"{journal._next_segment:012d}.journal"
    os.mkfifo(fifo)
    with pytest.raises(OSError):
        journal.append("t", None, b"v1")
    fifo.unlink()
    journal.append("t", None, b"v2")
    journal.close()
