"""The scoring agent on the real broker: a SIGKILL in the middle of a stream neither loses nor
double-counts a request log (one Kafka transaction per batch), bad logs become exactly one
dead letter each, and the state is bounded by the registry: 10k random pattern-valid ids
create no score key (one unknown bucket per partition counts them) and a revoke
tombstones its keys."""

from __future__ import annotations

import random
import signal
import string
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.workload import request_logs
from loraplane.kernel import kafka
from loraplane.kernel.config import Settings
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.dead_letter import DeadLetter
from loraplane.schemas.request_log import RequestStatus
from loraplane.schemas.score_snapshot import is_unknown_key, unknown_key
from loraplane.streams.score_keeper import read_back
from loraplane.streams.scores import snapshot
from tests.integration.planner_env import PlannerEnv as Env
from tests.integration.registry_env import wait_for
from tests.integration.scores_env import committed, committed_records, expected_states, wait_states
from tests.lifecycle_kit import BASE

pytestmark = pytest.mark.integration
# the scoring agent learns the registry from its topic: the registry agent fills it
AGENT = ("loraplane.streams.registry_agent", "loraplane.streams.scoring_agent")


@pytest.fixture
def env(stack: Settings, tmp_path: Path) -> Iterator[Env]:
    with Env.create(stack, tmp_path).owned() as e:
        yield e


def produce(env: Env, messages: list[tuple[bytes, bytes]]) -> None:
    p = kafka.producer(env.settings, linger_ms=20)
    for key, value in messages:
        p.produce(env.topic("requests"), key=key, value=value)
    assert p.flush(30) == 0


def test_sigkill_mid_stream_neither_loses_nor_double_counts(env: Env) -> None:
    logs = request_logs(40_000, adapters=10, seed=7)
    first, second = logs[:10_000], logs[10_000:]
    env.start(AGENT)
    records = [env.publish(a, BASE) for a in sorted({x.adapter_id for x in logs})]
    env.wait_registered(*((r, "active") for r in records))
    produce(env, [(x.adapter_id.encode(), encode(x)) for x in first])
    wait_states(env, expected_states(first))

    bad = [
        (b"a00001", b"{not json"),
        (b"not-the-adapter", encode(second[0])),
    ]  # key is not its adapter_id
    produce(env, [*bad, *((x.adapter_id.encode(), encode(x)) for x in second)])
    time.sleep(0.3)  # mid-stream: the agent is folding and committing batches
    assert env.worker is not None
    env.worker.send_signal(signal.SIGKILL)
    env.worker.wait(10)
    env.worker = None
    env.start(AGENT)

    wait_states(env, expected_states(first + second))
    letters = [decode(DeadLetter, v) for v in committed(env, "dead-letters")]
    assert sorted((d.component, d.reason) for d in letters) == [
        ("scoring", "key_mismatch"),
        ("scoring", "malformed"),
    ]


def random_ids(n: int, avoid: set[str], seed: int = 15) -> list[str]:
    """``n`` distinct ids matching ``schemas.base.ID_PATTERN`` and none of ``avoid``."""
    rng = random.Random(seed)
    first, rest = (
        string.ascii_lowercase + string.digits,
        string.ascii_lowercase + string.digits + "._-",
    )
    ids: set[str] = set()
    while len(ids) < n:
        ids.add(rng.choice(first) + "".join(rng.choices(rest, k=rng.randrange(0, 40))))
    return sorted(ids - avoid) + [f"z{i}" for i in range(n - len(ids - avoid))]


def test_random_ids_create_no_score_key_and_a_revoke_tombstones_its_keys(env: Env) -> None:
    env.start(AGENT)
    k1, k2 = env.publish("k1", BASE), env.publish("k2", BASE)
    env.wait_registered((k1, "active"), (k2, "active"))
    t0 = now_utc()
    known = [
        x.model_copy(
            update={
                "adapter_id": a,
                "adapter_version": v,
                "ts": t0,
                "event_id": f"k{i}",
                "status": status,
            }
        )
        for i, (a, v, status) in enumerate(
            [("k1", "1", RequestStatus.ok)] * 50
            + [("k2", "1", RequestStatus.ok)] * 50
            + [("k2", None, RequestStatus.ok)] * 10
            + [("k1", "1", RequestStatus.refused)] * 5
        )
        for x in request_logs(1, adapters=1, seed=i)
    ]
    strangers = [
        x.model_copy(
            update={"adapter_id": aid, "adapter_version": "1" if n % 2 else None, "ts": t0}
        )
        for n, (aid, x) in enumerate(
            zip(random_ids(10_000, {"k1", "k2"}), request_logs(10_000, seed=3), strict=True)
        )
    ]
    produce(env, [(x.adapter_id.encode(), encode(x)) for x in known + strangers])

    def state(keys: set[str], unknown: int) -> bool | None:
        read = read_back(env.settings)
        states, tally = read.merged(), read.unknown_total()
        return True if set(states) == keys and tally.logs == unknown else None

    wait_for(lambda: state({"k1@1", "k2@1", "k2@*"}, 10_005), "scores of k1, k2 only")
    read = read_back(env.settings)
    states = read.merged()
    # the unknown logs are counted on the partitions they came from, one bucket each
    assert set(read.unknown) == set(range(6)) and read.unknown_total().logs == 10_005
    assert {k: snapshot(v).model_dump() for k, v in states.items()} == expected_states(
        [x for x in known if x.status is not RequestStatus.refused]
    )

    env.send(
        [
            (
                b"k2",
                env.kit.event(
                    "ops", "revoke", "k2", "1", env._next_seq(), now_utc(), base_model=BASE
                ),
            )
        ]
    )
    wait_for(lambda: state({"k1@1"}, 10_005), "k2's keys tombstoned")
    again = known[60].model_copy(update={"event_id": "k60-later"})  # a new request, not a replay
    produce(env, [(b"k2", encode(again))])  # k2@1 is revoked: unknown from now on
    wait_for(lambda: state({"k1@1"}, 10_006), "a revoked version's log counted unknown")
    tombstoned = {m.key() for m in committed_records(env, "scores") if m.value() is None}
    assert tombstoned == {b"k2@1", b"k2@*"}
    assert not any(is_unknown_key(k) for k in states)
    buckets = {
        (m.key().decode(), m.partition())
        for m in committed_records(env, "scores")
        if is_unknown_key(m.key().decode())
    }
    assert buckets == {(unknown_key(p), p) for p in range(6)}

    # a log right after its publish reached the registry topic is scored, not unknown
    k3 = env.publish("k3", BASE)
    env.wait_registered((k3, "active"))
    fresh = known[0].model_copy(update={"adapter_id": "k3", "event_id": "k3"})
    produce(env, [(b"k3", encode(fresh))])
    wait_for(lambda: state({"k1@1", "k3@1"}, 10_006), "k3's first log scored")
