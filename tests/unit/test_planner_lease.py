"""The pure parts of the planner runtime (streams.planner_lease, streams.planner_runtime):
what the lease's assignment, revocation and fencing mean, how a burst is read off the
scores topic, and which worker state wins."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from datetime import UTC, datetime

import pytest
from confluent_kafka import KafkaError, KafkaException

from loraplane.kernel import kafka
from loraplane.kernel.config import get_settings
from loraplane.kernel.decayed import Decayed
from loraplane.kernel.topics import spec
from loraplane.kernel.transactions import ProducerBroken
from loraplane.schemas.codec import encode
from loraplane.schemas.score_snapshot import UnknownTally
from loraplane.streams.planner_lease import Lease, group_id, slug
from loraplane.streams.planner_runtime import ScoreView, WorkerStates, _fenced
from loraplane.streams.scores import TAU_1M_S, ScoreState, snapshot
from tests.unit.test_fleet_view import state


def test_assignment_makes_active_and_revocation_standby_each_a_new_epoch() -> None:
    lease = Lease()
    assert not lease.active and lease.epoch == 0
    lease.assigned()
    epoch = lease.epoch
    assert lease.active and lease.holds(epoch)
    lease.assigned()  # an incremental assignment of nothing new changes nothing
    assert lease.epoch == epoch
    lease.revoked()
    assert not lease.active and not lease.holds(epoch)
    lease.assigned()
    assert lease.active and not lease.holds(epoch)  # a tick of the old epoch must not commit


def test_a_fenced_planner_stays_standby_until_the_lease_moves() -> None:
    lease = Lease()
    lease.assigned()
    epoch = lease.epoch
    lease.fenced(epoch)
    assert not lease.active and not lease.holds(epoch)
    lease.fenced(epoch - 1)  # a stale fence is ignored
    lease.revoked()
    lease.assigned()
    assert lease.active and lease.holds(lease.epoch)


def test_wait_change_wakes_on_a_revoke() -> None:
    lease = Lease()
    lease.assigned()
    epoch = lease.epoch
    threading.Timer(0.05, lease.revoked).start()
    assert lease.wait_change(epoch, 5.0)
    assert not lease.wait_change(lease.epoch, 0.01)


def test_the_lease_group_and_transactional_id_name_the_base_model() -> None:
    settings = get_settings().model_copy(update={"topic_prefix": "p"})
    assert group_id(settings, None) == "p-planner-all"
    assert group_id(settings, "meta-llama/Llama 3") == "p-planner-meta-llama-Llama-3"
    assert slug("///") == "all"
    assert spec("planner-lease").partitions == 1
    assert spec("planner-memory").cleanup_policy == "compact"


def test_the_lease_consumer_heartbeats_often_and_keeps_its_partition_when_a_member_joins() -> None:
    conf = kafka.consumer_config(
        get_settings(), "g", session_timeout_ms=6000, heartbeat_ms=1000, cooperative=True
    )
    assert conf["session.timeout.ms"] == 6000 and conf["heartbeat.interval.ms"] == 1000
    assert conf["partition.assignment.strategy"] == "cooperative-sticky"
    assert "partition.assignment.strategy" not in kafka.consumer_config(get_settings(), "g")


def _record(armed: bool, r1: float = 1.0) -> bytes:
    return encode(
        snapshot(ScoreState(requests_1m=Decayed(TAU_1M_S, r1, 1000.0), burst_armed=armed))
    )


def test_a_burst_is_a_key_whose_armed_went_true_to_false() -> None:
    view = ScoreView()
    assert not view.apply("a@1", _record(armed=True))
    assert view.apply("a@1", _record(armed=False))  # disarmed: it fired
    assert not view.apply("a@1", _record(armed=False, r1=9.0))  # still disarmed: no new burst
    assert view.apply("b@1", _record(armed=False))  # a new key that fired at once
    assert set(view.copy()) == {"a@1", "b@1"}
    assert not view.apply("a@1", None)  # tombstone
    assert set(view.copy()) == {"b@1"}


def test_unknown_buckets_and_unreadable_records_hold_no_key() -> None:
    view = ScoreView()
    assert not view.apply("(unknown)", encode(UnknownTally(logs=3)))
    assert not view.apply("(unknown)/4", encode(UnknownTally(logs=3)))
    assert not view.apply("c@1", b'{"r10": "nope"}')
    assert view.copy() == {} and view.unreadable == 1


def test_the_newest_worker_state_wins_and_a_tombstone_removes_it() -> None:
    states = WorkerStates()
    new = state("w1", "llama", ["a@1"]).model_copy(update={"ts": datetime(2026, 1, 2, tzinfo=UTC)})
    old = new.model_copy(update={"ts": datetime(2026, 1, 1, tzinfo=UTC), "gpu_slots_total": 9})
    states.apply(b"w1", encode(new))
    states.apply(b"w1", encode(old))  # late and older: ignored
    (kept,) = states.copy()
    assert kept.ts == new.ts
    states.apply(b"w2", encode(new))  # keyed as another worker: refused
    states.apply(b"w1", b"{}")
    assert len(states.copy()) == 1 and states.unreadable == 2
    states.apply(b"w1", None)
    assert states.copy() == []


def test_attack_a_state_stamped_in_the_future_counts_from_its_arrival() -> None:
    """A worker state stamped years ahead (forged by whoever may write the topic, or a
    worker's clock gone wrong) is held as of its arrival: the worker's next genuine state
    replaces it, and without one it stops counting as heard after the usual intervals."""
    from loraplane.kernel.heartbeat import DRAIN_AFTER_HEARTBEATS, heard_lately

    arrived = datetime(2026, 1, 2, tzinfo=UTC).timestamp()
    forged = state("w1", "llama", ["evil@1"]).model_copy(
        update={"ts": datetime(9999, 12, 31, tzinfo=UTC)}
    )
    states = WorkerStates()
    states.apply(b"w1", encode(forged), arrived=arrived)
    (held,) = states.copy()
    assert held.ts.timestamp() == arrived
    assert not heard_lately(held, arrived + DRAIN_AFTER_HEARTBEATS * 5.0 + 1, 5.0)
    genuine = state("w1", "llama", ["a@1"]).model_copy(
        update={"ts": datetime(2026, 1, 2, 0, 0, 5, tzinfo=UTC)}
    )
    states.apply(b"w1", encode(genuine), arrived=arrived + 5)
    assert states.copy() == [genuine]
    states.apply(b"w1", encode(forged), arrived=arrived + 1)  # replayed late: older now
    assert states.copy() == [genuine]


def test_a_fenced_producer_is_told_from_a_broker_away() -> None:
    fenced = KafkaException(KafkaError(KafkaError._FENCED, fatal=True))
    try:
        raise ProducerBroken("transaction failed fatally") from fenced
    except ProducerBroken as exc:
        assert _fenced(exc)
    assert not _fenced(ProducerBroken("not committed after 5 attempts"))
    assert not _fenced(KafkaException(KafkaError(KafkaError._TIMED_OUT)))


def test_take_hands_over_the_keys_changed_since_the_last_take() -> None:
    view = ScoreView()
    view.apply("a@1", _record(armed=True))
    states, changed = view.take()
    assert set(states) == {"a@1"} and changed is None  # before the first take: unknown
    view.apply("b@1", _record(armed=True))
    view.apply("a@1", None)
    view.apply("(unknown)", encode(UnknownTally(logs=3)))
    view.apply("c@1", b'{"r10": "nope"}')
    states, changed = view.take()
    assert set(states) == {"b@1"} and changed == {"a@1", "b@1"}
    assert view.take()[1] == set()
    view.apply("b@1", _record(armed=False))
    view.forget_changes()  # the tick that took them failed
    assert view.take()[1] is None


def test_attack_worker_ids_that_stopped_beating_are_forgotten() -> None:
    """Whoever may write worker-state writes states under ever new worker ids (or workers
    come and go under new ids): the compacted topic keeps each, and the planner held every
    one for its life. A worker not heard lately is planned by no tick, and is forgotten."""
    from loraplane.kernel.heartbeat import DRAIN_AFTER_HEARTBEATS

    now = datetime(2026, 1, 2, tzinfo=UTC).timestamp()
    states = WorkerStates()
    for n in range(500):
        old = state(f"ghost-{n}", "llama", []).model_copy(
            update={"ts": datetime.fromtimestamp(now - 3600 - n, UTC)}
        )
        states.apply(f"ghost-{n}".encode(), encode(old), arrived=now)
    live = state("w1", "llama", []).model_copy(update={"ts": datetime.fromtimestamp(now, UTC)})
    states.apply(b"w1", encode(live), arrived=now)
    assert states.forget_silent(now, 5.0) == 500
    assert states.copy() == [live]
    assert states.forget_silent(now + DRAIN_AFTER_HEARTBEATS * 5.0, 5.0) == 0
    assert states.forget_silent(now + DRAIN_AFTER_HEARTBEATS * 5.0 + 1, 5.0) == 1


def test_attack_score_keys_of_no_live_version_are_forgotten() -> None:
    """Whoever may write the scores topic writes snapshots under ever new keys: the
    keeper tombstones only its own partitions' keys at a restore, and the planner held
    every key for its life (and copied them all at each tick). The keys the verified
    registry does not back are forgotten, and count as changed for the next tick."""
    from loraplane.streams.score_admission import Known
    from tests.unit.test_planner import record

    view = ScoreView()
    view.take()  # changes are counted from here
    for n in range(1000):
        view.apply(f"ghost-{n}@1", _record(armed=True))
    view.apply("a@1", _record(armed=True))
    view.apply("a@*", _record(armed=True))
    live = record("a")
    assert view.retain(Known.from_records([])) == 0  # a registry not verified yet
    assert view.retain(Known.from_records([live])) == 1000
    states, changed = view.take()
    assert set(states) == {"a@1", "a@*"}
    assert changed is not None and "ghost-7@1" in changed


def _count_checked_keys(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many keys each ``ScoreView.retain`` checks, in order, from now."""
    from loraplane.streams import planner_runtime
    from loraplane.streams.score_admission import Known, stale_keys

    checked: list[int] = []

    def counting(known: Known, keys: Iterable[str]) -> list[str]:
        keys = list(keys)
        checked.append(len(keys))
        return stale_keys(known, keys)

    monkeypatch.setattr(planner_runtime, "stale_keys", counting)
    return checked


def test_score_keys_are_checked_once_per_registry_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """``retain`` runs every tick: against the same live versions it checks only the keys
    written since its last run (a key written later is still forgotten), and every key again
    when the live versions change (a version retired since)."""
    from loraplane.streams.score_admission import Known
    from tests.unit.test_planner import record

    checked = _count_checked_keys(monkeypatch)
    view = ScoreView()
    for n in range(100):
        view.apply(f"a{n}@1", _record(armed=True))
    known = Known.from_records([record(f"a{n}") for n in range(100)])
    assert view.retain(known) == 0
    assert view.retain(known) == 0
    view.apply("ghost@1", _record(armed=True))
    view.apply("a5@1", _record(armed=False))
    assert view.retain(known) == 1  # the ghost, written after the last check
    assert checked == [100, 0, 2]
    fewer = Known.from_records([record(f"a{n}") for n in range(50)])
    assert view.retain(fewer) == 50  # a new registry version: every key again
    assert checked[-1] == 100
    assert set(view.copy()) == {f"a{n}@1" for n in range(50)}


def test_past_max_changed_keys_every_key_is_looked_at(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``MAX_CHANGED`` keys written between two looks, neither the keys a tick re-reads
    (``take``) nor the keys ``retain`` checks are held one by one: both are every key."""
    from loraplane.streams import planner_runtime
    from loraplane.streams.score_admission import Known
    from tests.unit.test_planner import record

    checked = _count_checked_keys(monkeypatch)
    monkeypatch.setattr(planner_runtime, "MAX_CHANGED", 3)
    known = Known.from_records([record(f"a{n}") for n in range(10)])
    view = ScoreView()
    view.take()
    assert view.retain(known) == 0 and checked == [0]
    for n in range(3):
        view.apply(f"a{n}@1", _record(armed=True))
    assert view.take()[1] == {"a0@1", "a1@1", "a2@1"}
    assert view.retain(known) == 0 and checked == [0, 3]
    for n in range(4):
        view.apply(f"a{n}@1", _record(armed=True))
    assert view.take()[1] is None
    assert view.retain(known) == 0 and checked == [0, 3, 4]  # every key: 4 held
    for n in range(4, 10):
        view.apply(f"a{n}@1", _record(armed=True))
    assert view.retain(known) == 0 and checked == [0, 3, 4, 10]
