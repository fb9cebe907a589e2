"""The planner lease: one active planner per base model.

The lease is the one partition of the ``planner-lease`` topic (nothing is ever written to
it): every planner process of a base model joins the consumer group
``{prefix}-planner-{slug}`` and subscribes to it; the member the group assigns the partition
is the active planner, the others are standbys. Kafka's group coordinator is the election:
a member that stops heartbeating (``kill -9``) is dropped after ``SESSION_TIMEOUT_MS`` and
the partition goes to a standby; cooperative-sticky assignment keeps it where it is when a
standby joins. A lost lease alone does not stop a zombie that still believes it is active:
the new active's ``init_transactions`` (same transactional id) fences its producer, so
nothing it plans afterwards commits.

``Lease`` is the pure part (what assignment, revocation and fencing mean, and the epoch that
tells the planning thread its lease changed under it); ``LeaseHolder`` is the consumer
thread that drives it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

from loraplane.kernel import kafka
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name

__all__ = [
    "ALL_BASE_MODELS",
    "HEARTBEAT_MS",
    "POLL_S",
    "SESSION_TIMEOUT_MS",
    "Lease",
    "LeaseHolder",
    "group_id",
    "slug",
]

log = logging.getLogger(__name__)

SESSION_TIMEOUT_MS = 6000
"""A killed active is dropped from the group (and a standby assigned) after this long."""
HEARTBEAT_MS = 1000
POLL_S = 0.1
"""The lease consumer polls this often: assignment callbacks run inside poll."""
ALL_BASE_MODELS = "all"
"""The slug of a planner that plans every base model (the default)."""


def slug(base_model: str | None) -> str:
    """A base model as it may appear in a group or transactional id."""
    if base_model is None:
        return ALL_BASE_MODELS
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base_model).strip("-") or ALL_BASE_MODELS


def group_id(settings: Settings, base_model: str | None) -> str:
    """The lease's consumer group, also the planner's transactional id."""
    return f"{settings.topic_prefix}-planner-{slug(base_model)}"


class Lease:
    """Whether this process holds the lease, and since when. ``epoch`` grows on every
    change: a tick that began under another epoch must not commit. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._held = False
        self._fenced_epoch: int | None = None
        self.epoch = 0

    @property
    def active(self) -> bool:
        """Held and not fenced under the current epoch."""
        with self._lock:
            return self._held and self._fenced_epoch != self.epoch

    def assigned(self) -> None:
        with self._lock:
            if self._held:
                return
            self._held = True
            self.epoch += 1
            self._lock.notify_all()
        log.info("planner lease: ACTIVE (epoch %d)", self.epoch)

    def revoked(self, why: str = "revoked") -> None:
        with self._lock:
            if not self._held:
                return
            self._held = False
            self.epoch += 1
            self._lock.notify_all()
        log.info("planner lease: STANDBY (%s)", why)

    def fenced(self, epoch: int) -> None:
        """Another planner took the transactional id: stop until the lease changes."""
        with self._lock:
            if epoch != self.epoch:
                return
            self._fenced_epoch = epoch
            self._lock.notify_all()
        log.warning(
            "planner lease: STANDBY (fenced by another planner; waiting for the "
            "group to move the lease)"
        )

    def holds(self, epoch: int) -> bool:
        """Still active under ``epoch`` (checked before every commit)."""
        with self._lock:
            return self._held and self.epoch == epoch and self._fenced_epoch != epoch

    def wait_change(self, epoch: int, timeout_s: float) -> bool:
        """Block until the epoch moves past ``epoch`` (True) or ``timeout_s``."""
        with self._lock:
            return self._lock.wait_for(lambda: self.epoch != epoch, timeout_s)


class LeaseHolder:
    """The lease consumer's thread: joins the group, polls every ``POLL_S`` (the heartbeat is
    librdkafka's own thread), and turns assignment callbacks into ``Lease`` changes."""

    def __init__(self, settings: Settings, base_model: str | None, lease: Lease) -> None:
        self.settings = settings
        self.group = group_id(settings, base_model)
        self.lease = lease
        self.topic = topic_name(settings, "planner-lease")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LeaseHolder:
        self._thread = threading.Thread(target=self._run, name="planner-lease", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Leave the group (a clean stop hands the lease over at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                consumer = kafka.consumer(
                    self.settings,
                    self.group,
                    client_id="loraplane-planner-lease",
                    session_timeout_ms=SESSION_TIMEOUT_MS,
                    heartbeat_ms=HEARTBEAT_MS,
                    cooperative=True,
                    quiet=True,
                )
            except Exception as exc:
                log.error("planner lease consumer not built: %s", exc)
                self._stop.wait(1.0)
                continue
            try:
                consumer.subscribe(
                    [self.topic],
                    on_assign=self._on_assign,
                    on_revoke=self._on_revoke,
                    on_lost=self._on_lost,
                )
                while not self._stop.is_set():
                    msg = consumer.poll(POLL_S)
                    if msg is not None and (err := msg.error()) is not None and err.fatal():
                        raise RuntimeError(f"lease consumer: {err}")
            except Exception as exc:
                self.lease.revoked(f"lease consumer failed: {exc}")
                log.error("planner lease consumer failed (%s); rejoining", exc)
                time.sleep(1.0)
            finally:
                self.lease.revoked("leaving the group")
                consumer.close()

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        if partitions:
            self.lease.assigned()

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        if partitions:
            self.lease.revoked("revoked by the group")

    def _on_lost(self, consumer: Any, partitions: list[Any]) -> None:
        self.lease.revoked("lost: no heartbeat within the session")
