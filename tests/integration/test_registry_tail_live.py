"""The registry as a live tail (issue #15 item 4), on real Kafka: a lifecycle change reaches
a worker's and a router's verified view within a second, and a broker restart neither loses
the view nor makes the tail re-read the topic.

The worker side is ``runner.verified_registry`` over ``registry_view.registry_tail`` asked
every ``WorkerConfig.registry_poll_s``, as the agent's registry loop does; the router side is
the router's own ``_refresh_registry`` loop over its own tail into a ``Fleet``. The changes
come from the real registry agent (``loraplane streams run``).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

from loraplane.kernel import kafka
from loraplane.kernel.bus import produce_sync
from loraplane.kernel.config import Settings
from loraplane.kernel.topic_tail import TopicTail
from loraplane.kernel.topics import topic_name
from loraplane.registry.live import VerifiedRegistry
from loraplane.registry.topic import registry_tail
from loraplane.router.routing import FleetIndex
from loraplane.router.server import Fleet, _refresh_registry
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import decode
from loraplane.schemas.keyring import KeyringFile
from loraplane.schemas.registry import AdapterView
from loraplane.workers.agent import WorkerConfig
from loraplane.workers.runner import WorkerOptions, verified_registry
from loraplane.workers.worker_metrics import WorkerMetrics
from tests.integration.fault_report import report_fault
from tests.integration.private_kafka import kill, private_kafka, start
from tests.integration.registry_env import Env, running, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
CHANGES_PER_ADAPTER = ("publish", "canary", "promote", "revoke")
ADAPTERS = 5  # 20 changes


class Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, Any]] = []

    def emit(self, topic_suffix: str, key: str, message: Any) -> None:
        self.sent.append((topic_suffix, key, message))


class Watch:
    """Calls ``read`` every ``every_s`` on a thread and notes when its answer changed."""

    def __init__(self, read: Callable[[], object], every_s: float) -> None:
        self.read, self.every_s = read, every_s
        self.changes: list[tuple[float, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last: object = None
        while not self._stop.is_set():
            now = self.read()
            if now != last:
                self.changes.append((time.time(), now))
                last = now
            self._stop.wait(self.every_s)

    def changed_after(self, t: float, done: Callable[[object], bool]) -> float:
        """When the answer first met ``done`` after ``t`` (waits up to 10 s)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for at, value in list(self.changes):
                if at >= t and done(value):
                    return at
            time.sleep(0.01)
        raise AssertionError(f"no change after {t} met the condition: {self.changes[-3:]}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture(scope="module")
def env(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with running(stack, tmp_path_factory.mktemp("registry-tail")) as env:
        yield env


def statuses(records: object, adapter_id: str) -> tuple[tuple[str, str], ...]:
    assert isinstance(records, list)
    return tuple(sorted((r.version, str(r.status)) for r in records if r.adapter_id == adapter_id))


def test_a_change_is_in_the_workers_and_the_routers_view_within_a_second(
    env: Env, tmp_path: Path
) -> None:
    options = WorkerOptions(
        worker_id="tail-w1",
        base_model="b",
        vllm_url="",
        gateway_port=0,
        metrics_port=None,
        host_tier_dir=tmp_path / "host",
        host_budget_bytes=1,
    )
    options.host_tier_dir.mkdir()
    worker_tail = registry_tail(env.settings, "worker-tail-w1")
    router_tail = registry_tail(env.settings, "router-tail-r1")
    assert worker_tail.wait_caught_up(10) and router_tail.wait_caught_up(10)
    worker = verified_registry(
        options,
        worker_tail,
        Sink(),
        WorkerMetrics(),  # type: ignore[arg-type]
        KeyringFile(env.settings.keyring_path),
    )
    router_registry = VerifiedRegistry(
        KeyringFile(env.settings.keyring_path),
        router_tail.snapshot,
        sink=Sink(),  # type: ignore[arg-type]
        component="router-r1",
        version=lambda: router_tail.version,
    )
    fleet = Fleet(FleetIndex(env.settings.policy, 5.0), Sink(), "router-r1")  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()

    def run_router_loop() -> None:
        with suppress(asyncio.CancelledError):
            loop.run_until_complete(_refresh_registry(router_registry, fleet))

    router_loop = threading.Thread(target=run_router_loop, daemon=True)
    router_loop.start()
    worker_watch = Watch(worker.records, WorkerConfig("w", "b", "", 1).registry_poll_s)
    router_watch = Watch(lambda: [r for v in fleet.versions.values() for r in v], 0.01)
    worker_s: list[float] = []
    router_s: list[float] = []
    try:
        for _ in range(ADAPTERS):
            aid = f"tail-{uuid.uuid4().hex[:8]}"
            for seq, action in enumerate(CHANGES_PER_ADAPTER, 1):
                fields = {"canary_percent": 10.0} if action == "canary" else {}
                if action == "revoke":
                    fields["reason"] = "test"
                signer = "ops" if action == "revoke" else "ci"  # ci's key may not revoke
                event = env.kit.event(signer, action, aid, "1", seq, now_utc(), **fields)
                env.send([(aid.encode(), event)])
                # the registry agent's record, as the tails hold it: when it was written
                record = wait_for(
                    lambda a=aid, s=seq: next(
                        (
                            r
                            for r in router_tail.snapshot()
                            if r.key == a.encode()
                            and r.value
                            and len(decode(AdapterView, r.value).evidence) == s
                        ),
                        None,
                    ),
                    f"{aid} seq {seq} in the tail",
                    timeout_s=30,
                )
                written = record.timestamp_ms / 1000
                want = statuses(decode(AdapterView, record.value or b"").versions, aid)
                assert want, action
                worker_s.append(
                    worker_watch.changed_after(
                        written, lambda v, a=aid, w=want: statuses(v, a) == w
                    )
                    - written
                )
                router_s.append(
                    router_watch.changed_after(
                        written, lambda v, a=aid, w=want: statuses(v, a) == w
                    )
                    - written
                )
    finally:
        worker_watch.stop()
        router_watch.stop()
        loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        router_loop.join(5)
        worker_tail.stop()
        router_tail.stop()
    report = (
        f"{len(worker_s)} changes, written -> visible: worker p50 "
        f"{statistics.median(worker_s):.3f}s max {max(worker_s):.3f}s; router p50 "
        f"{statistics.median(router_s):.3f}s max {max(router_s):.3f}s"
    )
    print(report)
    assert len(worker_s) == ADAPTERS * len(CHANGES_PER_ADAPTER)
    assert max(worker_s) < 1.0 and max(router_s) < 1.0, report


@pytest.mark.fault_long
def test_a_broker_restart_keeps_the_view_and_the_tail_resumes(tmp_path: Path) -> None:
    """The broker is killed -9 and started again on its data: the view stays (and reads
    as not current while the broker is away), and what is written after the restart arrives
    without a re-read of the topic (one change per record, not the whole topic again)."""
    with private_kafka(tmp_path, ("registry",)) as (settings, broker):
        topic = topic_name(settings, "registry")
        for i in range(30):
            produce_sync(settings, topic, f"k{i}", f"v{i}".encode())
        tail = TopicTail(settings, topic, component="test-registry").start()
        try:
            assert tail.wait_caught_up(20)
            assert len(tail.snapshot()) == 30
            assert wait_for(lambda: True if tail.current() else None, "current", 10)
            kill(broker)
            killed = time.monotonic()
            assert wait_for(
                lambda: True if not tail.current() else None,
                "the tail to notice the broker away",
                30,
            )
            assert len(tail.snapshot()) == 30  # the view stays while the broker is away
            start(broker)
            restarted = time.monotonic()
            before = tail.version
            tombstone = kafka.producer(settings)
            tombstone.produce(topic, key=b"k0", value=None)
            assert tombstone.flush(20) == 0
            produce_sync(settings, topic, "k30", b"v30")
            wait_for(
                lambda: True if tail.version >= before + 2 else None,
                "the records written after the restart",
                60,
            )
            time.sleep(1.0)
            assert tail.version == before + 2  # resumed at its position, no re-read
            view = {r.key: r.value for r in tail.snapshot()}
            assert view[b"k0"] is None and view[b"k30"] == b"v30" and len(view) == 31
            assert wait_for(lambda: True if tail.current() else None, "current again", 30)
            report_fault(
                "registry tail: broker SIGKILL, restarted",
                answered=32,
                stored=len(view) + 1,
                lost=0,
                duplicated=tail.version - before - 2,
                recovered=True,
                down_s=restarted - killed,
                recovery_s=time.monotonic() - restarted,
                note="the view stayed (not current) while the broker was away; "
                "resumed at its position, no re-read",
            )
        finally:
            tail.stop()
