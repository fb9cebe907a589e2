"""What a topic tail holds of the records its user refused (kernel/topic_tail.py ``refuse``):
a writer of a snapshot topic (``registry``, ``planner-memory``) inventing keys grows the
tail only up to its bounds, the oldest refused forgotten first and counted; a new keyring
re-reads the topic from its start, so a record forgotten while it was refused comes back to
be judged again, and the verified registry hands back every record it does not hold."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from loraplane.kernel.bus import Record
from loraplane.kernel.topic_tail import TailView
from loraplane.registry.live import VerifiedRegistry
from loraplane.schemas.codec import encode
from loraplane.schemas.keyring import KeyringFile, save_keyring
from tests.unit.test_registry_evidence import KIT, NOW, VIEW_A
from tests.unit.test_registry_trust import Sink


def rec(offset: int, key: str, value: bytes | None = b"v", partition: int = 0) -> Record:
    return Record("reg", partition, offset, key.encode(), value, {}, 0)


def test_attack_refused_records_are_held_only_within_the_bounds() -> None:
    """10,000 keys written once and refused leave the newest ``max_refused`` held; the
    accepted key stays whatever is refused after it."""
    view = TailView(max_refused=3)
    view.assign({("reg", 0): 0})
    view.apply(rec(0, "genuine"))
    for i in range(1, 10_001):
        forged = rec(i, f"forged-{i}", b"x" * 100)
        view.apply(forged)
        view.refuse(forged)
    keys = [r.key for r in view.snapshot()]
    assert keys == [b"genuine", b"forged-9998", b"forged-9999", b"forged-10000"]
    assert view.forgotten == 9_997
    assert view.refused_held() == (3, 3 * (len(b"forged-9999") + 100) + 1)


def test_the_refused_bytes_are_bounded_too() -> None:
    view = TailView(max_refused=1000, max_refused_bytes=1000)
    view.assign({("reg", 0): 0})
    for i in range(20):
        view.apply(r := rec(i, f"k{i:02d}", b"x" * 300))
        view.refuse(r)
    assert view.refused_held() == (3, 3 * 303) and view.forgotten == 17


def test_a_refused_record_replaced_by_a_newer_one_is_judged_again() -> None:
    """``refuse`` of a record that is no longer its key's last one does nothing, and a new
    record of a refused key is no longer counted as refused."""
    view = TailView(max_refused=1)
    view.assign({("reg", 0): 0})
    old = rec(0, "a")
    view.apply(old)
    view.apply(rec(1, "a", b"newer"))
    view.refuse(old)
    assert view.refused_held() == (0, 0)
    view.refuse(rec(1, "a", b"newer"))
    view.apply(rec(2, "a", b"newest"))
    assert view.refused_held() == (0, 0)
    assert [r.value for r in view.snapshot()] == [b"newest"]


def test_a_rewind_reads_from_the_start_and_keeps_the_newest_records() -> None:
    """Only once something was forgotten; until the re-read began, no ``read_to`` holds;
    an older record read again does not replace the newer one held."""
    view = TailView(max_refused=1)
    view.assign({("reg", 0): 3})
    view.apply(rec(0, "a", b"old"))
    view.apply(rec(1, "a", b"new"))
    view.apply(rec(2, "b"))
    assert view.caught_up and not view.ask_rewind()
    view.refuse(rec(2, "b"))
    view.apply(rec(3, "c"))
    view.refuse(rec(3, "c"))  # b forgotten
    assert [r.key for r in view.snapshot()] == [b"a", b"c"]
    assert view.ask_rewind() and not view.read_to({("reg", 0): 4})
    view.rewind()
    assert view.positions() == {("reg", 0): 0} and view.caught_up
    for offset, key, value in [(0, "a", b"old"), (1, "a", b"new"), (2, "b", b"v"), (3, "c", b"v")]:
        view.apply(rec(offset, key, value))
    assert {r.key: r.value for r in view.snapshot()} == {b"a": b"new", b"b": b"v", b"c": b"v"}
    assert view.read_to({("reg", 0): 4}) and not view.ask_rewind()


class ViewSource:
    """A ``TailView`` as the verified registry's ``source`` (``TopicTail`` without Kafka)."""

    def __init__(self, view: TailView) -> None:
        self.view = view
        self.rewinds = 0

    def refuse(self, record: Record) -> None:
        self.view.refuse(record)

    def rewind(self) -> bool:
        asked = self.view.ask_rewind()
        self.rewinds += asked
        return asked


def test_attack_the_verified_registry_hands_back_what_it_does_not_hold(tmp_path: Path) -> None:
    """Forged views and tombstones under 500 new adapter ids: the tail keeps its bound of
    them beside the verified view, and a new keyring asks for a re-read from the start."""
    path = tmp_path / "keyring.yaml"
    save_keyring(KIT.keyring, path)
    view = TailView(max_refused=10)
    view.assign({("reg", 0): 0})
    source = ViewSource(view)
    registry = VerifiedRegistry(
        KeyringFile(path),
        view.snapshot,
        sink=Sink(),
        component="worker-w1",
        clock=lambda: NOW + timedelta(minutes=10),
        source=source,
    )
    view.apply(rec(0, VIEW_A.adapter_id, encode(VIEW_A)))
    forged = VIEW_A.model_copy(update={"evidence": VIEW_A.evidence[:1]})
    for i in range(1, 501):
        key = f"ghost-{i}"
        value = None if i % 2 else encode(forged.model_copy(update={"adapter_id": key}))
        view.apply(rec(i, key, value))
    assert registry.records() == VIEW_A.versions
    assert len(view.snapshot()) == 11 and view.forgotten == 490
    assert source.rewinds == 0
    save_keyring(KIT.keyring, path)  # rewritten: a new keyring
    path.touch()
    registry.records()
    assert source.rewinds == 1 and view.rewind_due
