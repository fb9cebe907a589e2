"""The event sink's write-ahead journal (loraplane/eventlog/journal.py): an emitted event of a log
topic outlives a kill -9 of its process, and comes back once, at the next start, only if
Kafka had not acknowledged it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from loraplane.eventlog.journal import EventJournal, JournalUnavailable
from loraplane.eventlog.sink import REPLAY_BATCH, KafkaEventSink, SinkMetrics
from loraplane.eventlog.spool import EventSpool
from loraplane.kernel.config import Settings
from tests.unit.test_event_spool import Broker, Clock, details, drain, event, sink_on, step

ROOT = Path(__file__).resolve().parents[2]


class Lingering(Broker):
    """librdkafka's ``linger.ms``: a produced event is sent (and acknowledged) only at the
    poll after the one that first saw it queued, so ``emit``'s own poll leaves it in memory."""

    def __init__(self, queue_limit: int = 50) -> None:
        super().__init__(queue_limit)
        self._seen = 0

    def poll(self, _timeout: float = 0) -> int:
        ready, later = self.queue[: self._seen], self.queue[self._seen :]
        self.queue, self._seen = ready, len(later)
        sent = super().poll()
        self.queue = later + self.queue
        return sent


# ---- the journal on its own -------------------------------------------------------------------
def test_what_is_not_done_comes_back_in_order_and_seqs_go_on(tmp_path: Path) -> None:
    journal = EventJournal(tmp_path / "j")
    seqs = [
        journal.append("t", f"k{i}".encode() if i % 2 else None, f"v{i}".encode())
        for i in range(10)
    ]
    for seq in seqs[::3]:
        journal.done(seq)
    journal.write_acks()
    assert journal.pending == 6
    journal.close()  # as a kill leaves it: only what is done is gone
    again = EventJournal(tmp_path / "j")
    left = again.recovered
    assert [e.value for e in left] == [f"v{i}".encode() for i in range(10) if i % 3]
    assert [e.key for e in left][:2] == [b"k1", None] and {e.topic for e in left} == {"t"}
    assert again.append("t", None, b"new") == 10  # never a seq the old segments used
    again.forget()
    assert not again.recovered and len(list((tmp_path / "j").glob("*.journal"))) == 1


def test_a_torn_last_record_is_skipped_and_the_rest_recovered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = EventJournal(tmp_path / "j")
    for i in range(3):
        journal.append("t", None, f"v{i}".encode())
    journal.close()
    (segment,) = (tmp_path / "j").glob("*.journal")
    data = segment.read_bytes()
    segment.write_bytes(data + data[: len(data) // 3 // 2])  # a write the kill cut short
    again = EventJournal(tmp_path / "j")
    assert [e.value for e in again.recovered] == [b"v0", b"v1", b"v2"]
    assert "torn or corrupt" in caplog.text
    again.close()
    segment.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the last crc does not match
    assert [e.value for e in EventJournal(tmp_path / "j").recovered] == [b"v0", b"v1"]


def test_segments_go_once_all_their_events_are_done(tmp_path: Path) -> None:
    journal = EventJournal(tmp_path / "j", segment_bytes=200)
    seqs = [journal.append("t", None, b"x" * 40) for _ in range(20)]
    assert len(list((tmp_path / "j").glob("*.journal"))) > 3
    for seq in seqs[:-1]:
        journal.done(seq)
    journal.write_acks()
    assert len(list((tmp_path / "j").glob("*.journal"))) == 2  # the last event's and the tail
    journal.done(seqs[-1])
    journal.sync()
    journal.close()
    assert not list((tmp_path / "j").glob("*.journal"))


def test_a_second_process_gets_no_journal(tmp_path: Path) -> None:
    first = EventJournal(tmp_path / "j")
    with pytest.raises(JournalUnavailable, match="in use"):
        EventJournal(tmp_path / "j")
    first.close()


# ---- the sink: a real kill -9 ------------------------------------------------------------------
def _killed_child(home: str, emitted: int, acked: int) -> None:
    """Run in a child process: emit ``emitted`` audit events, the first ``acked`` of them
    acknowledged by the broker, the rest still in the (fake) librdkafka queue; then SIGKILL
    itself the moment the last ``emit`` returns."""
    with pytest.MonkeyPatch.context() as mp:
        broker = Broker(queue_limit=10**6)
        sink = sink_on(broker, Path(home), mp, Clock())
        for i in range(acked):
            sink.emit("audit", "k", event(i))
        sink.poll()  # their acks
        broker.poll = lambda _t=0: 0  # type: ignore[method-assign]  # the rest: no ack yet
        for i in range(acked, emitted):
            sink.emit("audit", "k", event(i))
        os.kill(os.getpid(), signal.SIGKILL)


def test_an_event_emitted_just_before_a_kill_9_is_delivered_once_after_the_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the journal, the 30 events held in librdkafka's memory were lost."""
    code = (
        f"from tests.unit.test_event_journal import _killed_child; "
        f"_killed_child({str(tmp_path)!r}, 50, 20)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    broker, clock = Broker(), Clock()
    restarted = sink_on(broker, tmp_path, monkeypatch, clock)
    assert restarted.counts.recovered == 30 and restarted.backlog == 30
    drain(restarted, clock)
    assert details(broker.log) == list(range(20, 50))  # the acked 20 are not sent again
    registry = CollectorRegistry()
    registry.register(SinkMetrics(restarted))
    assert (
        'loraplane_event_sink_recovered_total{client="w1"} 30.0'
        in generate_latest(registry).decode()
    )
    restarted.close(1.0)
    assert not list((tmp_path / "spool").rglob("*.journal"))


def test_states_are_not_journaled_and_the_journal_can_be_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker, clock = Broker(), Clock()
    broker.poll = lambda _t=0: 0  # type: ignore[method-assign]
    sink = sink_on(broker, tmp_path, monkeypatch, clock)
    sink.emit("worker-state", "w1", event(0))  # compacted: the next state replaces it
    assert sink.journal_pending == 0
    sink.emit("audit", "k", event(1))
    assert sink.journal_pending == 1
    off = KafkaEventSink(Settings(home=tmp_path / "off", event_journal=False), "w1")
    off.emit("audit", "k", event(2))
    assert off.journal_pending == 0 and not (tmp_path / "off" / "spool").exists()


def test_a_journal_it_cannot_write_is_counted_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker, clock = Broker(), Clock()
    sink = sink_on(broker, tmp_path, monkeypatch, clock)
    sink.emit("audit", "k", event(0))
    journal = sink._journal  # type: ignore[attr-defined]

    def full(*_a: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal, "append", full)
    sink.emit("audit", "k", event(1))
    sink.poll()
    assert sink.counts.unjournaled == 1 and details(broker.log) == [0, 1]


# ---- the sink over any pattern of outages, kills and restarts ---------------------------------
def _kill(sink: KafkaEventSink) -> set[bytes]:
    """What a SIGKILL leaves: the files (no close, no flush); librdkafka's memory is gone.
    Returns the spooled events a replay delivered but did not commit yet (a round in flight,
    or delivered in a round that failed): the spool sends those again (at least once; the
    same event_id, kept once downstream)."""
    sent_again = set()
    if sink._round is not None:  # type: ignore[attr-defined]
        sent_again = {e.value for e in sink._round.events}  # type: ignore[attr-defined]
    if sink._spool is not None:  # type: ignore[attr-defined]
        head = sink._spool.peek(REPLAY_BATCH)  # type: ignore[attr-defined]
        sent_again |= {
            head[i].value
            for i in sink._done  # type: ignore[attr-defined]
            if i < len(head)
        }
    for part in (sink._journal, sink._spool):  # type: ignore[attr-defined]
        if part is not None:
            part.close()
    sink._producer.queue.clear()  # type: ignore[attr-defined]
    return sent_again


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.sampled_from(["emit", "emit", "emit", "poll", "down", "up", "tick", "kill"]),
        max_size=120,
    )
)
def test_any_pattern_of_outages_and_kills_delivers_every_event_once(ops: list[str]) -> None:
    """None lost; twice only what a spool replay round had delivered and not yet committed
    at a kill (the journal itself sends nothing Kafka acknowledged)."""
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        broker, clock = Lingering(queue_limit=5), Clock()
        sink = sink_on(broker, Path(tmp), mp, clock)
        n, may_repeat = 0, set()
        for op in ops:
            if op == "kill":
                may_repeat |= _kill(sink)
                sink = sink_on(broker, Path(tmp), mp, clock)
            else:
                n = step(op, sink, broker, clock, n)
        broker.up = True
        drain(sink, clock)
        assert set(details(broker.log)) == set(range(n))  # none lost
        twice = {v for v in broker.log if broker.log.count(v) > 1}
        assert twice <= may_repeat, details(sorted(twice - may_repeat))


# ---- the sink after close ----------------------------------------------------------------------
def test_after_close_nothing_is_sent_or_reopened_and_each_emit_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An emitter that outlives its sink: its events are not sent, journaled or spooled, and
    are counted and logged; the journal's and the spool's folder locks stay released (they
    were retaken by the first late emit and held until the process exited)."""
    broker, clock = Broker(), Clock()
    sink = sink_on(broker, tmp_path, monkeypatch, clock)
    sink.emit("audit", "k", event(0))
    sink.close(1.0)
    assert details(broker.log) == [0]
    broker.up = False  # a spool would take what the broker fails: it must not open either
    sink.emit("audit", "k", event(1))  # a log topic: journaled before the close
    sink.emit("audit", "k", event(2))
    sink.emit("worker-state", "w1", event(3))  # compacted
    sink.poll()
    assert broker.queue == [] and details(broker.log) == [0] and sink.backlog == 0
    assert sink.counts.after_close == 3 and sink.journal_pending == 0
    assert "audit event for key 'k' emitted after w1's sink closed" in caplog.text
    EventJournal(sink._spool_dir / "journal").close()  # type: ignore[attr-defined]
    EventSpool(sink._spool_dir, 10**6).close()  # type: ignore[attr-defined]
    registry = CollectorRegistry()
    registry.register(SinkMetrics(sink))
    assert (
        'loraplane_event_sink_refused_total{client="w1"} 3.0' in generate_latest(registry).decode()
    )


def test_a_report_served_after_close_reopens_no_spool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that cannot purge leaves an event queued past ``close``; its failed delivery
    report, served later, is counted as dropped instead of reopening the spool."""
    broker, clock = Broker(), Clock()
    sink = sink_on(broker, tmp_path, monkeypatch, clock)
    serve = broker.poll
    broker.poll = lambda _t=0: 0  # type: ignore[method-assign]  # no report before the close

    def cannot_purge(**_k: object) -> None:
        raise RuntimeError("an old client")

    broker.purge = cannot_purge  # type: ignore[method-assign]
    sink.emit("worker-state", "w1", event(0))
    sink.close(0.1)
    broker.up = False
    serve()  # the report: the broker did not take it
    assert sink.dropped == 1 and sink.backlog == 0
    EventSpool(sink._spool_dir, 10**6).close()  # type: ignore[attr-defined]
