"""Serving does not depend on Kafka (issue #19, item 2): the worker's verified registry merges
each read into the views it accepted, adapter by adapter, newest first; a read that fails, is
cut short or comes back empty drops nothing; a revoke still takes effect; the last verified
views survive a restart in the host tier and are re-verified on load."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.kernel.bus import Record, TopicReadIncomplete
from loraplane.registry.live import VerifiedRegistry, newer
from loraplane.schemas.keyring import Keyring, KeyringFile, save_keyring
from loraplane.schemas.registry import AdapterView
from loraplane.workers.worker_metrics import WorkerMetrics
from tests.unit.test_registry_evidence import HIST_A, HIST_B, KIT, NOW, fold
from tests.unit.test_registry_trust import Sink, Topic

STEPS_A = [v for n in range(1, len(HIST_A) + 1) if (v := fold(HIST_A[:n])) is not None]
VIEW_A, VIEW_B = STEPS_A[-1], fold(HIST_B)
assert VIEW_B is not None and len(STEPS_A) == len(HIST_A)


class Reader:
    """The topic, or a broker that is away (``down``) or a read cut short (``only``)."""

    def __init__(self, topic: Topic) -> None:
        self.topic = topic
        self.down = False
        self.only: Callable[[Record], bool] | None = None

    def __call__(self) -> list[Record]:
        if self.down:
            raise TopicReadIncomplete("registry: the end was not reached within 10s")
        records = self.topic.latest()
        return [r for r in records if self.only(r)] if self.only else records


def world(
    home: Path, keyring: Keyring = KIT.keyring
) -> tuple[VerifiedRegistry, Topic, Reader, WorkerMetrics]:
    path = home / "keyring.yaml"
    if not path.exists():
        save_keyring(keyring, path)
    topic, metrics = Topic(), WorkerMetrics()
    reader = Reader(topic)
    registry = VerifiedRegistry(
        KeyringFile(path),
        reader,
        sink=Sink(),
        component="worker-w1",
        checkpoints_path=home / ".registry-checkpoints.json",
        views_path=home / ".registry-views.json",
        on_refused=metrics.view_refused,
        on_read_failed=metrics.registry_read_failed,
        clock=lambda: NOW + timedelta(minutes=10),
    )
    return registry, topic, reader, metrics


def versions(*views: AdapterView) -> list[str]:
    return sorted(f"{r.adapter_id}@{r.version}:{r.status}" for v in views for r in v.versions)


def served(registry: VerifiedRegistry) -> list[str]:
    return sorted(f"{r.adapter_id}@{r.version}:{r.status}" for r in registry.records())


def test_a_failed_read_keeps_every_view_and_is_counted(tmp_path: Path) -> None:
    registry, topic, reader, metrics = world(tmp_path)
    topic.write(VIEW_A.adapter_id, VIEW_A)
    topic.write(VIEW_B.adapter_id, VIEW_B)
    assert served(registry) == versions(VIEW_A, VIEW_B)
    reader.down = True
    for _ in range(3):
        assert served(registry) == versions(VIEW_A, VIEW_B)
    assert metrics.registry.get_sample_value("loraplane_registry_read_failures_total") == 3


def test_an_empty_or_cut_short_read_drops_nothing(tmp_path: Path) -> None:
    registry, topic, reader, _ = world(tmp_path)
    topic.write(VIEW_A.adapter_id, VIEW_A)
    topic.write(VIEW_B.adapter_id, VIEW_B)
    registry.records()
    reader.only = lambda r: r.key == VIEW_B.adapter_id.encode()
    assert served(registry) == versions(VIEW_A, VIEW_B)
    reader.only = lambda _r: False
    assert served(registry) == versions(VIEW_A, VIEW_B)


def test_a_revoke_still_takes_effect_and_an_older_copy_never_wins(tmp_path: Path) -> None:
    registry, topic, _, _ = world(tmp_path)
    before = STEPS_A[-2]  # version 2 still rolled back, not yet revoked
    topic.write(VIEW_A.adapter_id, before)
    assert served(registry) == versions(before)
    topic.write(VIEW_A.adapter_id, VIEW_A)  # the revoke of version 2
    assert served(registry) == versions(VIEW_A)
    assert "support-bot@2:revoked" in served(registry)
    topic.write(VIEW_A.adapter_id, before)  # replayed older copy: refused, revoke stays
    assert served(registry) == versions(VIEW_A)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.integers(0, len(STEPS_A) - 1), min_size=1, max_size=12))
def test_the_merge_keeps_the_newest_view_seen_whatever_order_reads_come_in(
    tmp_path_factory: pytest.TempPathFactory, order: list[int]
) -> None:
    """Reads see the adapter's views in any order (each read a snapshot of a topic being
    rewritten): what is served is always the newest one seen so far."""
    registry, topic, _, _ = world(tmp_path_factory.mktemp("merge"))
    best = -1
    for n in order:
        topic.write(VIEW_A.adapter_id, STEPS_A[n])
        best = max(best, n)
        assert served(registry) == versions(STEPS_A[best])


def test_newer_is_the_views_own_order() -> None:
    assert all(newer(b, a) and not newer(a, b) for a, b in itertools.pairwise(STEPS_A))
    assert newer(VIEW_A, None) and not newer(VIEW_A, VIEW_A)


def test_a_restart_while_kafka_is_down_serves_the_saved_views(tmp_path: Path) -> None:
    registry, topic, _, _ = world(tmp_path)
    topic.write(VIEW_A.adapter_id, VIEW_A)
    topic.write(VIEW_B.adapter_id, VIEW_B)
    registry.records()
    restarted, _, reader, _ = world(tmp_path)
    reader.down = True
    assert served(restarted) == versions(VIEW_A, VIEW_B)


def test_saved_views_are_trusted_no_more_than_the_topic(tmp_path: Path) -> None:
    """ATTACK: an edited views file (another sha256), a view from before an accepted revoke
    (rollback), and a key revoked while the agent was down: none of them is served."""
    registry, topic, _, _ = world(tmp_path)
    topic.write(VIEW_A.adapter_id, VIEW_A)
    topic.write(VIEW_B.adapter_id, VIEW_B)
    registry.records()
    views_file = tmp_path / ".registry-views.json"
    saved = json.loads(views_file.read_text())
    saved[VIEW_B.adapter_id]["versions"][0]["sha256"] = "e" * 64
    saved[VIEW_A.adapter_id] = json.loads(STEPS_A[-2].model_dump_json())
    views_file.write_text(json.dumps(saved))
    restarted, _, reader, _ = world(tmp_path)
    reader.down = True
    assert served(restarted) == []

    registry.records()  # rewrites the file with the genuine views
    ci = KIT.keys["ci"].key_id
    save_keyring(
        Keyring(keys=[k.model_copy(update={"revoked": k.key_id == ci}) for k in KIT.keyring.keys]),
        tmp_path / "keyring.yaml",
    )
    restarted, _, reader, _ = world(tmp_path)
    reader.down = True
    assert served(restarted) == []


def test_an_unreadable_views_file_starts_empty(tmp_path: Path) -> None:
    (tmp_path / ".registry-views.json").write_text('{"a": [')
    registry, topic, _, _ = world(tmp_path)
    assert registry.records() == []
    topic.write(VIEW_A.adapter_id, VIEW_A)
    assert served(registry) == versions(VIEW_A)
    assert json.loads((tmp_path / ".registry-views.json").read_text()).keys() == {VIEW_A.adapter_id}


@pytest.mark.parametrize("name", [".registry-views.json", ".registry-checkpoints.json"])
@pytest.mark.parametrize("kind", ["fifo", "endless-device", "folder", "deep-json"])
def test_a_hostile_saved_state_file_starts_empty(kind: str, name: str, tmp_path: Path) -> None:
    """Whatever sits at the saved views' or checkpoints' path, the registry starts without
    it (never hangs on a FIFO, reads a device without end or dies of RecursionError) and
    serves what the topic verifies."""
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "endless-device":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    else:
        path.write_bytes(b'{"a": ' + b"[" * 100_000)
    registry, topic, _, _ = world(tmp_path)
    assert registry.records() == []
    topic.write(VIEW_A.adapter_id, VIEW_A)
    assert served(registry) == versions(VIEW_A)


@pytest.mark.parametrize("fault", ["folder", "full-disk"])
def test_checkpoints_it_cannot_save_are_no_read_failure_and_are_saved_later(
    fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the checkpoints' failed write escaped ``refresh``: every read was counted as
    a read failure, the views were never saved (a restart with Kafka away served nothing)
    and the checkpoints were not written again until another view changed."""
    import errno

    from loraplane.registry import live

    path = tmp_path / ".registry-checkpoints.json"
    real = live.write_atomic

    def full(target: Path, data: str | bytes, mode: int = 0o666) -> None:
        if target == path:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(target, data, mode)

    if fault == "folder":
        path.mkdir()
    else:
        monkeypatch.setattr(live, "write_atomic", full)
    registry, topic, _, metrics = world(tmp_path)
    topic.write(VIEW_A.adapter_id, VIEW_A)
    assert served(registry) == versions(VIEW_A)
    assert not metrics.registry.get_sample_value("loraplane_registry_read_failures_total")
    assert "checkpoints not saved" in caplog.text
    restarted, _, down, _ = world(tmp_path)
    down.down = True
    assert served(restarted) == versions(VIEW_A)  # the views were saved all the same

    if fault == "folder":
        path.rmdir()
    else:
        monkeypatch.setattr(live, "write_atomic", real)
    registry.records()  # nothing new in the topic: the checkpoints are written now
    assert VIEW_A.adapter_id in json.loads(path.read_text())
