"""ATTACK tests of the worker's registry copy (loraplane/registry/live.py), without Kafka:
records as a topic writer would write them, the worker's own keyring file, its dead letters
and its metric."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from loraplane.kernel.bus import Record
from loraplane.registry.live import VerifiedRegistry
from loraplane.schemas.codec import encode
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.keyring import Keyring, KeyringFile, save_keyring
from loraplane.schemas.registry import AdapterView
from loraplane.workers.worker_metrics import WorkerMetrics
from tests.unit.test_registry_evidence import HIST_A, KIT, NOW, VIEW_A, fold, history


class Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, Any]] = []

    def emit(self, topic_suffix: str, key: str, message: Any) -> None:
        self.sent.append((topic_suffix, key, message))

    def letters(self) -> list[DeadLetter]:
        return [m for t, _, m in self.sent if t == "dead-letters"]


class Topic:
    def __init__(self) -> None:
        self.records: list[Record] = []

    def write(self, key: str, value: bytes | AdapterView | None) -> None:
        raw = encode(value) if isinstance(value, AdapterView) else value
        self.records.append(
            Record("lp-registry", 0, len(self.records), key.encode(), raw, {}, 1_700_000_000_000)
        )

    def latest(self) -> list[Record]:
        """As ``registry.topic.latest_registry_records``: a tombstone is kept."""
        out: dict[bytes | None, Record] = {}
        for r in self.records:
            out[r.key] = r
        return list(out.values())


def world(
    tmp_path: Path, keyring: Keyring | None = None, checkpoints: Path | None = None
) -> tuple[VerifiedRegistry, Topic, Sink, WorkerMetrics, Path]:
    path = tmp_path / "keyring.yaml"
    if not path.exists():
        save_keyring(keyring or KIT.keyring, path)
    topic, sink, metrics = Topic(), Sink(), WorkerMetrics()
    registry = VerifiedRegistry(
        KeyringFile(path),
        topic.latest,
        sink=sink,
        component="worker-w1",
        checkpoints_path=checkpoints or tmp_path / ".checkpoints.json",
        on_refused=metrics.view_refused,
        clock=lambda: NOW + timedelta(minutes=10),
    )
    return registry, topic, sink, metrics, path


def refused_count(metrics: WorkerMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "loraplane_registry_view_refused_total", {"reason": reason}
    )
    return value or 0.0


def test_a_genuine_view_becomes_records(tmp_path: Path) -> None:
    registry, topic, sink, _, _ = world(tmp_path)
    topic.write(VIEW_A.adapter_id, VIEW_A)
    assert registry.records() == VIEW_A.versions
    assert sink.letters() == []


def test_a_record_written_straight_into_the_topic_is_refused_counted_dead_lettered(
    tmp_path: Path,
) -> None:
    """ATTACK: the hostile review's record: no lifecycle event behind it at all."""
    registry, topic, sink, metrics, _ = world(tmp_path)
    bare = VIEW_A.model_copy(update={"evidence": []})
    topic.write(bare.adapter_id, bare)
    topic.write("junk", b"{not json")
    for _ in range(3):  # refreshed every few seconds: reported once
        assert registry.records() == []
    letters = sink.letters()
    assert sorted(d.reason for d in letters) == ["view_malformed", "view_no_evidence"]
    assert all(d.component == "worker-w1" and d.source_topic == "lp-registry" for d in letters)
    assert refused_count(metrics, "view_no_evidence") == 1
    assert refused_count(metrics, "view_malformed") == 1
    assert b"loraplane_registry_view_refused_total" in metrics.exposition()


def test_a_view_under_another_key_is_malformed(tmp_path: Path) -> None:
    registry, topic, sink, _, _ = world(tmp_path)
    topic.write("other-adapter", VIEW_A)
    assert registry.records() == []
    assert [d.reason for d in sink.letters()] == ["view_malformed"]


def test_an_edit_over_an_accepted_view_keeps_the_verified_one(tmp_path: Path) -> None:
    """ATTACK: overwrite the compacted record with an edited copy (sha256 of the attacker's
    upload): the worker keeps serving from the view it verified, and refuses the edit."""
    registry, topic, sink, _, _ = world(tmp_path)
    topic.write(VIEW_A.adapter_id, VIEW_A)
    assert registry.records() == VIEW_A.versions
    data = json.loads(VIEW_A.model_dump_json())
    data["versions"][0]["sha256"] = "e" * 64
    topic.write(VIEW_A.adapter_id, AdapterView.model_validate(data))
    assert registry.records() == VIEW_A.versions
    assert [d.reason for d in sink.letters()] == ["view_mismatch"]


def test_an_older_genuine_view_is_a_rollback_even_after_a_restart(tmp_path: Path) -> None:
    """ATTACK (rollback): the genuine view from before version 2 was revoked is replayed
    onto the topic; a restarted worker still remembers what it accepted."""
    registry, topic, sink, _, _ = world(tmp_path)
    topic.write(VIEW_A.adapter_id, VIEW_A)
    registry.records()
    old = fold(HIST_A[:5])
    assert old is not None and old.active_version == "2"
    topic.write(VIEW_A.adapter_id, old)
    assert registry.records() == VIEW_A.versions
    restarted, topic2, sink2, _, _ = world(tmp_path)
    topic2.write(old.adapter_id, old)
    assert restarted.records() == []
    assert [d.reason for d in sink.letters()] == ["view_rollback"]
    assert [d.reason for d in sink2.letters()] == ["view_rollback"]


def test_revoking_a_key_in_the_keyring_withdraws_its_views_without_a_restart(
    tmp_path: Path,
) -> None:
    registry, topic, _, _, path = world(tmp_path)
    topic.write(VIEW_A.adapter_id, VIEW_A)
    assert registry.records() == VIEW_A.versions
    ci = KIT.keys["ci"].key_id
    save_keyring(
        Keyring(keys=[k.model_copy(update={"revoked": k.key_id == ci}) for k in KIT.keyring.keys]),
        path,
    )
    assert registry.records() == []
    save_keyring(KIT.keyring, path)  # and trusted again once the keyring says so
    assert registry.records() == VIEW_A.versions


def test_no_keyring_trusts_nothing(tmp_path: Path) -> None:
    registry, topic, sink, _, path = world(tmp_path)
    topic.write(VIEW_A.adapter_id, VIEW_A)
    path.unlink()
    assert registry.records() == []
    assert [d.reason for d in sink.letters()] == ["view_keyring_unavailable"]


def test_an_unsigned_tombstone_withdraws_nothing(tmp_path: Path) -> None:
    """ATTACK: anyone who can write the registry topic can write a tombstone (a record
    without a value) over any adapter's key. The registry never deletes an adapter: a held
    view leaves only by signed events (retire, revoke) or the keyring (a revoked key), so a
    tombstone is refused and dead-lettered like junk, and the verified view stays."""
    registry, topic, sink, metrics, _ = world(tmp_path)
    topic.write(VIEW_A.adapter_id, VIEW_A)
    assert registry.records() == VIEW_A.versions
    topic.write(VIEW_A.adapter_id, None)
    assert registry.records() == VIEW_A.versions
    assert registry.records() == VIEW_A.versions  # read again: reported once
    assert [d.reason for d in sink.letters()] == ["view_tombstone"]
    assert refused_count(metrics, "view_tombstone") == 1.0
    topic.write("never-held", None)  # nothing held: nothing to refuse, nothing reported
    assert registry.records() == VIEW_A.versions
    assert [d.reason for d in sink.letters()] == ["view_tombstone"]


def test_unreadable_checkpoints_start_empty(tmp_path: Path) -> None:
    (tmp_path / ".checkpoints.json").write_text("[1, 2")
    registry, topic, _, _, _ = world(tmp_path)
    topic.write(VIEW_A.adapter_id, VIEW_A)
    assert registry.records() == VIEW_A.versions
    saved = json.loads((tmp_path / ".checkpoints.json").read_text())
    assert saved[VIEW_A.adapter_id]["last_seq"] == VIEW_A.last_seq


def test_a_read_of_many_views_writes_the_checkpoints_once(tmp_path: Path, monkeypatch: Any) -> None:
    """A first read of N views saves the checkpoints file once, not N times (each save
    rewrites and fsyncs the whole file: quadratic in the registry), and before the views."""
    from loraplane.registry import live as registry_trust

    registry, topic, _, _, _ = world(tmp_path)
    views = [fold(history(f"bulk-{i}", start=10 * i + 1000)) for i in range(20)]
    for view in views:
        assert view is not None
        topic.write(view.adapter_id, view)
    writes: list[str] = []
    real = registry_trust.write_atomic
    monkeypatch.setattr(
        registry_trust,
        "write_atomic",
        lambda path, text: (writes.append(Path(path).name), real(path, text)),
    )
    assert len(registry.records()) == sum(len(v.versions) for v in views if v is not None)
    assert writes == [".checkpoints.json"]  # this registry keeps no views file
    saved = json.loads((tmp_path / ".checkpoints.json").read_text())
    assert sorted(saved) == sorted(v.adapter_id for v in views if v is not None)
    writes.clear()
    registry.records()  # nothing new on the topic: nothing written
    assert writes == []


def test_attack_a_stream_of_refused_records_holds_no_memory_once_they_are_gone(
    tmp_path: Path,
) -> None:
    """ATTACK: a topic writer overwrites one key with junk again and again (compaction keeps
    the last). Each refused record was remembered, so it would be reported once, for the
    consumer's whole life: memory grew by every record ever refused, in every worker,
    router and keeper. A record no longer in the source is forgotten, as its verdict is;
    each is still reported once."""
    registry, topic, sink, _, _ = world(tmp_path)
    for n in range(200):
        topic.write("junk", b"{not json %d" % n)
        registry.records()
        registry.records()  # the same record read again: not reported again
    assert len(sink.letters()) == 200
    assert len(registry._reported) <= len(topic.latest())
