"""The real registry agent's views verify at a worker; what a topic writer adds does not.

Real Kafka and the real ``loraplane streams run`` registry agent on a topic prefix of their
own; the worker side is its verified registry (loraplane/registry/live.py) with a real Kafka
sink, reading the real registry topic with its own copy of the keyring file.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplane.eventlog.sink import KafkaEventSink
from loraplane.kernel import kafka
from loraplane.kernel.bus import produce_sync, read_topic
from loraplane.kernel.config import Settings
from loraplane.registry.live import VerifiedRegistry
from loraplane.registry.topic import latest_registry_records
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.keyring import Keyring, KeyringFile, save_keyring
from loraplane.schemas.lifecycle import LifecycleEvent
from loraplane.schemas.registry import AdapterView
from loraplane.workers.worker_metrics import WorkerMetrics
from tests.integration.registry_env import Env, running, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with running(stack, tmp_path_factory.mktemp("registry-trust")) as env:
        yield env


def worker_registry(
    env: Env, tmp: Path
) -> tuple[VerifiedRegistry, KafkaEventSink, WorkerMetrics, Path]:
    keyring = tmp / "worker-keyring.yaml"  # the worker's own copy of the keyring file
    keyring.write_text(env.settings.keyring_path.read_text())
    sink, metrics = KafkaEventSink(env.settings, "test-worker"), WorkerMetrics()
    registry = VerifiedRegistry(
        KeyringFile(keyring),
        lambda: latest_registry_records(env.settings, timeout_s=10),
        sink=sink,
        component="worker-test",
        checkpoints_path=tmp / ".registry-checkpoints.json",
        on_refused=metrics.view_refused,
    )
    return registry, sink, metrics, keyring


def test_the_agents_views_verify_and_topic_writes_are_refused(env: Env, tmp_path: Path) -> None:
    """ATTACK on the real topic: a bare record, an edited copy of a genuine view, and a
    genuine older view replayed after the newer one was accepted."""
    aid, bare_id = f"trust-{uuid.uuid4().hex[:8]}", f"bare-{uuid.uuid4().hex[:8]}"
    now, kit = now_utc(), env.kit
    steps = [
        kit.event("ci", "publish", aid, "1", 1, now),
        kit.event("ci", "canary", aid, "1", 2, now, canary_percent=10.0),
        kit.event("ci", "promote", aid, "1", 3, now),
        kit.event("ci", "publish", aid, "2", 4, now),
    ]
    env.send([(aid.encode(), e) for e in steps[:3]])
    older = env.view(aid, lambda v: v.last_event_id == steps[2].event_id)
    registry, sink, metrics, keyring = worker_registry(env, tmp_path)
    assert {r.version: str(r.status) for r in registry.records()} == {"1": "active"}
    env.send([(aid.encode(), steps[3])])
    current = env.view(aid, lambda v: v.last_event_id == steps[3].event_id)
    assert len(current.evidence) == 4  # the agent's view carries its signed events
    assert {r.version for r in registry.records()} == {"1", "2"}

    topic = env.topic("registry")
    bare = current.model_copy(
        update={
            "adapter_id": bare_id,
            "evidence": [],
            "versions": [r.model_copy(update={"adapter_id": bare_id}) for r in current.versions],
        }
    )
    data = json.loads(current.model_dump_json())
    data["versions"][1]["sha256"] = "e" * 64
    data["versions"][1]["status"] = "active"
    data["versions"][0]["status"] = "retired"
    data["active_version"] = "2"
    written = {bare_id: encode(bare), aid: encode(AdapterView.model_validate(data))}
    for key, value in written.items():
        produce_sync(env.settings, topic, key, value, producer=env.producer())

    def refused(expected: set[tuple[str, str]], what: str) -> list[tuple[str, str]]:
        """The worker's dead letters once they hold every (key, reason) of ``expected``."""
        seen: list[tuple[str, str]] = []

        def probe() -> list[tuple[str, str]] | None:
            # each refresh reads the topic again: a read cut short by its timeout on a
            # loaded machine must not hide a record (a refused record is dead-lettered once)
            registry.records()
            sink.flush(10)
            seen[:] = sorted(
                ((r.key or b"").decode(), str(decode(DeadLetter, r.value).reason))
                for r in read_topic(
                    env.settings, env.topic("dead-letters"), timeout_s=10, idle_s=1.0
                )
                if r.value and decode(DeadLetter, r.value).component == "worker-test"
            )
            if expected <= set(seen):
                return seen
            rewrite_superseded({key for key, _ in expected - set(seen)})
            return None

        try:
            return wait_for(probe, what, timeout_s=120)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the worker's dead letters: {seen}") from None

    def rewrite_superseded(keys: set[str]) -> None:
        """A reader only ever sees a key's last record (a compacted topic, a latest-per-key
        view), so a later write to the key hides a write not yet read: the registry agent
        writes the genuine view again when a lifecycle event comes twice (a redelivery after
        a rebalance, on a loaded machine). The attacker then writes again, as one would."""
        latest = {
            (r.key or b"").decode(): r.value
            for r in latest_registry_records(env.settings, timeout_s=10)
        }
        for key in keys:
            if key in latest and latest[key] != written[key]:
                print(f"{key}: the attack was superseded before it was read; written again")
                produce_sync(env.settings, topic, key, written[key], producer=env.producer())

    first = {(bare_id, "view_no_evidence"), (aid, "view_mismatch")}
    assert set(refused(first, "the bare and the edited views refused")) == first
    records = registry.records()
    assert {(r.adapter_id, r.version, r.sha256) for r in records} == {
        (aid, r.version, r.sha256) for r in current.versions
    }  # the verified view stays
    written = {aid: encode(older)}  # genuine, but older than what we accepted
    produce_sync(env.settings, topic, aid, written[aid], producer=env.producer())
    every = first | {(aid, "view_rollback")}
    letters = refused(every, "the worker's dead letters")
    assert set(letters) == every  # once per record written (twice where one was rewritten)
    assert {r.version for r in registry.records()} == {"1", "2"}
    exposition = metrics.exposition().decode()
    for reason, count in Counter(reason for _, reason in letters).items():
        assert (
            f'loraplane_registry_view_refused_total{{reason="{reason}"}} {float(count)}'
            in exposition
        )

    # the worker's keyring revokes CI's key: without a restart, nothing CI signed serves
    ci = kit.keys["ci"].key_id
    save_keyring(
        Keyring(keys=[k.model_copy(update={"revoked": k.key_id == ci}) for k in kit.keyring.keys]),
        keyring,
    )
    assert registry.records() == []


def test_a_tombstone_on_the_real_topic_withdraws_no_verified_view(env: Env, tmp_path: Path) -> None:
    """ATTACK on the real topic: a record without a value over a genuine adapter's key (as
    anyone who can write the topic can send) leaves the worker's verified view in place and
    is dead-lettered as ``view_tombstone``; the registry never deletes an adapter."""
    aid = f"tomb-{uuid.uuid4().hex[:8]}"
    now = now_utc()
    steps = [
        env.kit.event("ci", "publish", aid, "1", 1, now),
        env.kit.event("ci", "promote", aid, "1", 2, now),
    ]
    env.send([(aid.encode(), e) for e in steps])
    env.view(aid, lambda v: v.last_event_id == steps[1].event_id)
    registry, sink, _, _ = worker_registry(env, tmp_path)
    assert {(r.adapter_id, r.version, str(r.status)) for r in registry.records()} >= {
        (aid, "1", "active")
    }
    producer = kafka.producer(env.settings)
    producer.produce(env.topic("registry"), key=aid.encode(), value=None)
    assert producer.flush(20) == 0

    def tombstone_read() -> bool | None:
        latest = {
            (r.key or b"").decode(): r.value
            for r in latest_registry_records(env.settings, timeout_s=10)
        }
        return True if aid in latest and latest[aid] is None else None

    wait_for(tombstone_read, "the tombstone on the registry topic")

    def letter() -> bool | None:
        assert (aid, "1", "active") in {
            (r.adapter_id, r.version, str(r.status)) for r in registry.records()
        }
        sink.flush(10)
        return (
            True
            if any(
                (r.key or b"").decode() == aid
                and decode(DeadLetter, r.value).component == "worker-test"
                and str(decode(DeadLetter, r.value).reason) == "view_tombstone"
                for r in read_topic(
                    env.settings, env.topic("dead-letters"), timeout_s=10, idle_s=1.0
                )
                if r.value
            )
            else None
        )

    wait_for(letter, "the tombstone dead-lettered, the view kept", timeout_s=120)


def test_the_real_agent_accepts_only_what_a_consumer_verifies(env: Env) -> None:
    """ATTACK (or a CI clock behind): an event dated before its key's window, with a seq of
    now. The registry's clock alone finds nothing wrong; a consumer folds the event at its
    issued_at and would refuse this view and every later one of the adapter. The real
    agent refuses the event, so the view after the next genuine event still verifies."""
    from datetime import timedelta

    from loraplane.registry.evidence import ViewVerified, verify_view
    from loraplane.schemas.lifecycle import seq_at

    aid = f"skew-{uuid.uuid4().hex[:8]}"
    now, kit = now_utc(), env.kit
    first = kit.event("ci", "publish", aid, "1", seq_at(now), now)
    ci = kit.keyring.get(kit.keys["ci"].key_id)
    assert ci is not None
    early = ci.not_before - timedelta(minutes=1)
    backdated = kit.event("ci", "promote", aid, "1", seq_at(now) + 1, early, ttl=timedelta(days=7))
    last = kit.event("ci", "publish", aid, "2", seq_at(now) + 2, now)
    env.send([(aid.encode(), e) for e in (first, backdated, last)])
    view = env.view(aid, lambda v: v.last_event_id == last.event_id)
    assert backdated.event_id not in {e.event_id for e in view.evidence}
    verdict = verify_view(view, kit.keyring, now_utc())
    assert isinstance(verdict, ViewVerified), verdict


def test_our_producers_put_a_key_in_the_partition_faust_puts_it(env: Env) -> None:
    """The registry agent (Faust, aiokafka: murmur2, as Java clients) writes each view to its
    key's partition; a record for the same key from the project's producer factory must land
    in that same partition, or a compacted topic holds the key twice with no single latest
    record (seen in CI: the attack above landed beside the genuine view, not over it, so
    readers kept finding the genuine one last). librdkafka's default partitioner put 8 of 12
    such keys elsewhere."""
    now, ids = now_utc(), [f"part-{uuid.uuid4().hex[:8]}" for _ in range(12)]
    env.send([(aid.encode(), env.kit.event("ci", "publish", aid, "1", 1, now)) for aid in ids])
    faust_partition: dict[str, int] = {}

    def all_written() -> dict[str, int] | None:
        for r in read_topic(env.settings, env.topic("registry"), timeout_s=10, to_end=True):
            faust_partition[(r.key or b"").decode()] = r.partition
        return faust_partition if set(ids) <= set(faust_partition) else None

    wait_for(all_written, "the registry agent's views")
    producer = env.producer()  # the factory's (kafka.producer), one for all: ~0.5 s each fresh
    ours = {
        aid: produce_sync(
            env.settings, env.topic("registry"), aid, b"not a view", producer=producer
        )[0]
        for aid in ids
    }
    assert ours == {aid: faust_partition[aid] for aid in ids}


def test_a_rotation_keeps_what_the_old_key_signed_serving(env: Env, tmp_path: Path) -> None:
    """``loraplane keys rotate`` on the real agent's keyring file: the old key is retired,
    so the real agent refuses what it signs from then on (``key_expired``, also an event it
    signed before but that arrives after), the new key's events are taken, and the view the
    old key's events began still verifies at a worker reading the real topic with the
    rotated keyring: the adapter stays online."""
    import base64

    from typer.testing import CliRunner

    from loraplane.cli import app
    from loraplane.lifecycle_events import signed_event
    from loraplane.registry.evidence import ViewVerified, verify_view
    from loraplane.schemas.keyring import load_keyring
    from loraplane.schemas.lifecycle import LifecycleAction, seq_at
    from loraplane.schemas.signing import SigningKey
    from tests.lifecycle_kit import BASE, TENANT, record

    aid, kit = f"rot-{uuid.uuid4().hex[:8]}", env.kit
    old = kit.keys["ci2"]  # acme's second CI key: no other test of the module signs with it
    now = now_utc()
    steps = [
        kit.event("ci2", "publish", aid, "1", seq_at(now), now),
        kit.event("ci2", "promote", aid, "1", seq_at(now) + 1, now),
    ]
    in_flight = kit.event("ci2", "publish", aid, "2", seq_at(now) + 2, now)
    env.send([(aid.encode(), e) for e in steps])
    env.view(aid, lambda v: v.last_event_id == steps[1].event_id)
    registry, _, _, keyring = worker_registry(env, tmp_path)
    assert (aid, "1", "active") in {
        (r.adapter_id, r.version, str(r.status)) for r in registry.records()
    }

    new_path = tmp_path / "ci-acme-next.key"
    done = CliRunner().invoke(
        app,
        [
            *("keys", "rotate", "--keyring", str(env.settings.keyring_path)),
            *("--key-id", old.key_id, "--new-key-id", "ci-acme-next"),
            *("--out", str(new_path), "--no-audit"),
        ],
    )
    assert done.exit_code == 0 and "retired from" in done.stdout, done.output
    keyring.write_text(env.settings.keyring_path.read_text())  # the worker's copy follows
    new = SigningKey.load(new_path)
    after = now_utc()

    def event(key: SigningKey, version: str, n: int) -> LifecycleEvent:
        return signed_event(
            key,
            LifecycleAction.publish,
            adapter_id=aid,
            tenant_id=TENANT,
            base_model=BASE,
            version=version,
            record=record(aid, version),
            seq=seq_at(after) + n,
            now=after,
        )

    late, taken = event(old, "3", 0), event(new, "4", 1)
    env.send([(aid.encode(), in_flight), (aid.encode(), late), (aid.encode(), taken)])
    view = env.view(aid, lambda v: v.last_event_id == taken.event_id)
    assert [e.event_id for e in view.evidence] == [
        *(e.event_id for e in steps),
        taken.event_id,
    ]
    verdict = verify_view(view, load_keyring(env.settings.keyring_path), now_utc())
    assert isinstance(verdict, ViewVerified), verdict

    refused = {encode(in_flight), encode(late)}

    def letters() -> dict[bytes, str] | None:
        found = {
            base64.b64decode(d.raw_b64): str(d.reason)
            for d in (decode(DeadLetter, raw) for raw in env.records("dead-letters"))
            if base64.b64decode(d.raw_b64) in refused
        }
        return found if found.keys() == refused else None

    found = wait_for(letters, "the retired key's events dead-lettered")
    assert set(found.values()) == {"key_expired"}

    def served() -> set[tuple[str, str]] | None:
        held = {(r.version, str(r.status)) for r in registry.records() if r.adapter_id == aid}
        return held if ("4", "published") in held else None

    assert wait_for(served, "the worker's view after the rotation") == {
        ("1", "active"),
        ("4", "published"),
    }
