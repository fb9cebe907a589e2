"""A registry worker (``loraplane streams run``) on its own topic prefix, for the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Self, TypeVar

from loraplane.kernel import kafka, topics
from loraplane.kernel.bus import TopicReadIncomplete, read_topic
from loraplane.kernel.config import Settings
from loraplane.registry.topic import load_registry
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import encode
from loraplane.schemas.keyring import save_keyring
from loraplane.schemas.lifecycle import LifecycleEvent
from loraplane.schemas.registry import AdapterView
from tests.lifecycle_kit import Kit, make_kit

if TYPE_CHECKING:
    from confluent_kafka import Producer

LOG_READY = "Worker ready"
LOG_TAIL = 6000
"""How much of the worker's log a failed start shows (the log lives in a temporary home)."""
START_WAIT_S = 150.0
"""How long one start may take: 90 s was missed once on 2 loaded cores."""
START_TRIES = 2
LORAPLANE = str(Path(sys.executable).parent / "loraplane")
T = TypeVar("T")


class OneProducer:
    """A producer (``kafka.producer``) made on first use and then reused, each send flushed
    by its caller: a fresh idempotent producer waits ~0.5 s for its producer id before its
    first message is acknowledged, and a test sends dozens of times. It lives as long as its
    env, so it never outlives a private broker that a test stops."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._made: Producer | None = None
        self._lock = threading.Lock()  # a test's load thread sends beside its main thread

    def __call__(self) -> Producer:
        with self._lock:
            if self._made is None:
                self._made = kafka.producer(self._settings)
            return self._made


def wait_for(probe: Callable[[], T | None], what: str, timeout_s: float = 60) -> T:
    """Poll ``probe`` until it finds something; a read that did not reach a topic's end in
    its time (a loaded broker) finds nothing yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            found = probe()
        except TopicReadIncomplete:
            found = None
        if found is not None:
            return found
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def wait_partitions(settings: Settings, suffix: str, count: int) -> None:
    """Wait until the broker's metadata gives topic ``suffix`` ``count`` partitions: a topic
    just made or grown is not in every metadata answer yet."""
    admin, topic = kafka.admin(settings), topics.topic_name(settings, suffix)
    wait_for(
        lambda: (
            True
            if len(admin.list_topics(topic, timeout=5).topics[topic].partitions) == count
            else None
        ),
        f"{topic} with {count} partitions",
        timeout_s=30,
    )


@dataclass
class Env:
    settings: Settings
    kit: Kit
    home: Path
    env: dict[str, str]
    worker: subprocess.Popen | None = None
    metrics_port: int = 0
    """When set, the app serves its consumers' hold-ups on it (``--metrics-port``)."""
    producer: OneProducer = field(init=False, repr=False)
    """``env.producer()``: the env's one producer, for its sends and a test's own."""

    def __post_init__(self) -> None:
        self.producer = OneProducer(self.settings)

    @classmethod
    def create(cls, stack: Settings, home: Path) -> Env:
        """Topics for a fresh prefix and a keyring file; no worker yet."""
        prefix = f"t-{uuid.uuid4().hex[:10]}"
        settings = stack.model_copy(
            update={
                "topic_prefix": prefix,
                "home": home,
                "keyring_path": home / "keyring.yaml",
                "planner_key_path": home / "keys" / "planner.key",
            }
        )
        topics.apply(settings)
        kit = make_kit(now_utc())
        save_keyring(kit.keyring, settings.keyring_path)
        kit.keys["planner"].save(settings.planner_key_path)  # the planner agent signs with it
        return cls(
            settings,
            kit,
            home,
            {
                **os.environ,
                "LORAPLANE_TOPIC_PREFIX": prefix,
                "LORAPLANE_HOME": str(home),
                "LORAPLANE_SECRETS_DIR": str(stack.secrets_dir),
                "LORAPLANE_KEYRING_PATH": str(settings.keyring_path),
                "LORAPLANE_PLANNER_KEY_PATH": str(settings.planner_key_path),
            },
        )

    def start(self, agents: tuple[str, ...] = ("loraplane.streams.registry_agent",)) -> None:
        """Start ``loraplane streams run`` with ``agents`` (empty: every agent). A worker not
        ready within ``START_WAIT_S`` (seen once in CI, its log lost) is stopped and started
        once more; each failed try's log tail goes to stderr and into the error."""
        failures: list[str] = []
        for attempt in range(1, START_TRIES + 1):
            failure = self._start_once(agents)
            if failure is None:
                return
            self.stop()
            failures.append(f"try {attempt}: {failure}")
            print(f"loraplane streams run, {failures[-1]}", file=sys.stderr)
        raise AssertionError(
            f"the Faust worker did not start in {START_TRIES} tries:\n" + "\n---\n".join(failures)
        )

    def _start_once(self, agents: tuple[str, ...]) -> str | None:
        """One start: None once the log says ready, else what went wrong and the log's end."""
        log_path = self.home / "streams.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        with log_path.open("a") as log:
            worker = self.worker = subprocess.Popen(
                [
                    LORAPLANE,
                    "streams",
                    "run",
                    *(a for agent in agents for a in ("--agent", agent)),
                    *(("--metrics-port", str(self.metrics_port)) if self.metrics_port else ()),
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        def since() -> str:  # offset counts bytes: the log has multi-byte characters
            return log_path.read_bytes()[offset:].decode(errors="replace")

        def outcome() -> str | None:
            if LOG_READY in since():
                return "ready"
            return "exited" if worker.poll() is not None else None

        try:
            seen = wait_for(outcome, "the Faust worker to start", timeout_s=START_WAIT_S)
        except AssertionError as exc:
            seen = str(exc)
        if seen == "ready":
            return None
        what = f"exited {worker.returncode}" if seen == "exited" else seen
        return f"{what}; its log ends:\n{since()[-LOG_TAIL:]}"

    @contextmanager
    def owned(self) -> Iterator[Self]:
        """The block owns this env: stopped and its topics deleted after, whatever the block
        did (a fixture's ``with Env.create(...).owned() as env: yield env``)."""
        try:
            yield self
        finally:
            self.stop()
            self.delete_topics()

    @contextmanager
    def run(self) -> Iterator[Self]:
        """``start()`` (its default agents) for the block, then as ``owned``."""
        with self.owned():
            self.start()
            yield self

    def stop(self) -> None:
        if self.worker is None:
            return
        self.worker.send_signal(signal.SIGTERM)
        try:
            self.worker.wait(20)
        except subprocess.TimeoutExpired:
            self.worker.kill()
            self.worker.wait()
        self.worker = None

    def delete_topics(self) -> None:
        admin = kafka.admin(self.settings)
        prefix = self.settings.topic_prefix
        names = [n for n in admin.list_topics(timeout=10).topics if n.startswith(prefix)]
        if names:
            admin.delete_topics(names, request_timeout=10)

    def topic(self, suffix: str) -> str:
        return topics.topic_name(self.settings, suffix)

    def send(self, messages: list[tuple[bytes, bytes | LifecycleEvent]]) -> None:
        p = self.producer()
        for key, value in messages:
            p.produce(
                self.topic("lifecycle"),
                key=key,
                value=value if isinstance(value, bytes) else encode(value),
            )
        assert p.flush(20) == 0

    def records(self, suffix: str) -> list[bytes]:
        return [
            r.value
            for r in read_topic(self.settings, self.topic(suffix), timeout_s=10, idle_s=1.0)
            if r.value is not None
        ]

    def view(self, adapter_id: str, done: Callable[[AdapterView], bool]) -> AdapterView:
        def probe() -> AdapterView | None:
            v = load_registry(self.settings, timeout_s=5).get(adapter_id)
            return v if v is not None and done(v) else None

        return wait_for(probe, f"registry view of {adapter_id}")


@contextmanager
def running(stack: Settings, folder: Path) -> Iterator[Env]:
    """An ``Env`` whose registry agent runs for the block; stopped and its topics deleted
    after, whatever the block did."""
    with Env.create(stack, folder).run() as env:
        yield env
