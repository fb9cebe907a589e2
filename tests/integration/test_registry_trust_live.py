"""The real registry agent's views verify at a worker; what a topic writer adds does not.

Real Kafka and the real ``loraplane streams run`` registry agent on a topic prefix of their
own; the worker side is its verified registry (loraplane/registry_trust.py) with a real Kafka
sink, reading the real registry topic with its own copy of the keyring file.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import decode
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.keyring import Keyring, KeyringFile, save_keyring
from loraplane.schemas.registry import AdapterView
from loraplane.workers.event_sink import KafkaEventSink
from loraplane.workers.worker_metrics import WorkerMetrics

from loraplane.kernel.bus import produce_sync, read_topic
from loraplane.kernel.config import Settings
from loraplane.kernel.registry_view import latest_registry_records
from loraplane.registry_trust import VerifiedRegistry
from tests.integration.registry_env import Env, running, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with running(stack, tmp_path_factory.mktemp("registry-trust")) as env:
        yield env


def worker_registry(env: Env, tmp: Path) -> tuple[VerifiedRegistry, KafkaEventSink,
                                                  WorkerMetrics, Path]:
    keyring = tmp / "worker-keyring.yaml"  # the worker's own copy of the keyring file
    keyring.write_text(env.settings.keyring_path.read_text())
    sink, metrics = KafkaEventSink(env.settings, "test-worker"), WorkerMetrics()
    registry = VerifiedRegistry(KeyringFile(keyring),
                                lambda: latest_registry_records(env.settings, timeout_s=5),
                                sink=sink, component="worker-test",
                                checkpoints_path=tmp / ".registry-checkpoints.json",
                                on_refused=metrics.view_refused)
    return registry, sink, metrics, keyring


def test_the_agents_views_verify_and_topic_writes_are_refused(env: Env, tmp_path: Path) -> None:
    """ATTACK on the real topic: a bare record, an edited copy of a genuine view, and a
    genuine older view replayed after the newer one was accepted."""
    aid, bare_id = f"trust-{uuid.uuid4().hex[:8]}", f"bare-{uuid.uuid4().hex[:8]}"
    now, kit = now_utc(), env.kit
    steps = [kit.event("ci", "publish", aid, "1", 1, now),
             kit.event("ci", "canary", aid, "1", 2, now, canary_percent=10.0),
             kit.event("ci", "promote", aid, "1", 3, now),
             kit.event("ci", "publish", aid, "2", 4, now)]
    env.send([(aid.encode(), e) for e in steps[:3]])
    older = env.view(aid, lambda v: v.last_event_id == steps[2].event_id)
    registry, sink, metrics, keyring = worker_registry(env, tmp_path)
    assert {r.version: str(r.status) for r in registry.records()} == {"1": "active"}
    env.send([(aid.encode(), steps[3])])
    current = env.view(aid, lambda v: v.last_event_id == steps[3].event_id)
    assert len(current.evidence) == 4  # the agent's view carries its signed events
    assert {r.version for r in registry.records()} == {"1", "2"}

    topic = env.topic("registry")
    bare = current.model_copy(update={"adapter_id": bare_id, "evidence": [], "versions": [
        r.model_copy(update={"adapter_id": bare_id}) for r in current.versions]})
    produce_sync(env.settings, topic, bare_id, bare)
    data = json.loads(current.model_dump_json())
    data["versions"][1]["sha256"] = "e" * 64
    data["versions"][1]["status"] = "active"
    data["versions"][0]["status"] = "retired"
    data["active_version"] = "2"
    produce_sync(env.settings, topic, aid, AdapterView.model_validate(data))

    def letters(at_least: int) -> Callable[[], list[tuple[str, str]] | None]:
        def probe() -> list[tuple[str, str]] | None:
            # each refresh reads the topic again: a read cut short by its timeout on a
            # loaded machine must not hide a record (a refused record is dead-lettered once)
            registry.records()
            sink.flush(10)
            got = sorted(((r.key or b"").decode(), str(decode(DeadLetter, r.value).reason))
                         for r in read_topic(env.settings, env.topic("dead-letters"),
                                             timeout_s=10, idle_s=1.0)
                         if r.value and decode(DeadLetter, r.value).component == "worker-test")
            return got if len(got) >= at_least else None
        return probe

    # the edited view is seen (and refused) before the next write to its key supersedes it:
    # a compacted topic's reader only ever sees the latest record of a key
    assert wait_for(letters(2), "the bare and the edited views refused") == sorted([
        (bare_id, "view_no_evidence"), (aid, "view_mismatch")])
    records = registry.records()
    assert {(r.adapter_id, r.version, r.sha256) for r in records} == {
        (aid, r.version, r.sha256) for r in current.versions}  # the verified view stays
    produce_sync(env.settings, topic, aid, older)  # genuine, but older than what we accepted
    assert wait_for(letters(3), "the worker's dead letters") == sorted([
        (bare_id, "view_no_evidence"), (aid, "view_mismatch"), (aid, "view_rollback")])
    assert {r.version for r in registry.records()} == {"1", "2"}
    exposition = metrics.exposition().decode()
    for reason in ("view_no_evidence", "view_mismatch", "view_rollback"):
        assert f'loraplane_registry_view_refused_total{{reason="{reason}"}} 1.0' in exposition

    # the worker's keyring revokes CI's key: without a restart, nothing CI signed serves
    ci = kit.keys["ci"].key_id
    save_keyring(Keyring(keys=[k.model_copy(update={"revoked": k.key_id == ci})
                               for k in kit.keyring.keys]), keyring)
    assert registry.records() == []
