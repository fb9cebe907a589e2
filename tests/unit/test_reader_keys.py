"""ATTACK tests: the one-shot readers of compacted topics (``fleet status``, the dashboard's
fleet panel, the traffic replay, ``registry`` reads) take a record only under its own key.

A compacted topic keeps the last record of each key. A record under another key than the
message's own id is never replaced or tombstoned by the genuine writer's records: a writer
of ``worker-state`` (the ``worker`` principal) could put a state of worker ``w1`` under key
``zz``, and the readers showed it for ``w1``, in place of w1's own latest state when read
after it, and forever after w1 was tombstoned. The live readers (the router, the planner,
``VerifiedRegistry``) already refuse such records; these readers counted them as the id
inside."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from loraplane.kernel import worker_states
from loraplane.kernel.bus import Record
from loraplane.kernel.config import Settings
from loraplane.kernel.topics import topic_name
from loraplane.registry import topic as registry_topic
from loraplane.schemas.codec import encode
from loraplane.schemas.router_state import RouterState
from loraplane.schemas.worker_state import WorkerState
from tests.lifecycle_kit import make_kit, record, signed_view

NOW = datetime(2026, 6, 1, tzinfo=UTC)


def state(worker_id: str, slots: int = 4) -> bytes:
    return encode(
        WorkerState(
            worker_id=worker_id,
            base_model="b",
            ts=NOW,
            gpu_slots_used=0,
            gpu_slots_total=slots,
            host_bytes_used=0,
            host_bytes_budget=10**9,
            max_lora_rank=16,
        )
    )


def router(router_id: str) -> bytes:
    return encode(RouterState(router_id=router_id, ts=NOW))


def records(topic: str, *pairs: tuple[bytes | None, bytes | None]) -> list[Record]:
    return [Record(topic, 0, i, k, v, {}, 0) for i, (k, v) in enumerate(pairs)]


def fleet(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, got: list[Record]) -> Any:
    def read(*_a: Any, **_k: Any) -> Iterator[Record]:
        yield from got

    monkeypatch.setattr(worker_states, "read_topic", read)
    return worker_states.latest_fleet_states(Settings(home=tmp_path))


def test_attack_a_worker_state_under_another_key_is_not_that_worker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    s = Settings(home=tmp_path)
    topic = topic_name(s, "worker-state")
    got = fleet(
        monkeypatch,
        tmp_path,
        records(
            topic,
            (b"w1", state("w1")),
            (b"zz", state("w1", slots=99)),  # read after w1's own: took its place
            (b"w2", state("w2")),
            (b"w2", None),  # retired
            (b"yy", state("w2")),  # kept a retired worker in the fleet
        ),
    )
    assert sorted(got.workers) == ["w1"] and got.workers["w1"].gpu_slots_total == 4
    assert got.malformed == 2


def test_attack_a_router_state_under_another_key_is_not_that_router(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    topic = topic_name(Settings(home=tmp_path), "router-state")
    got = fleet(monkeypatch, tmp_path, records(topic, (b"r1", None), (b"zz", router("r1"))))
    assert got.routers == {} and got.malformed == 1


def test_attack_a_registry_view_under_another_key_is_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    now = datetime.now(UTC).replace(microsecond=0)  # the registry refuses a seq from the future
    kit = make_kit(now)
    view = signed_view(kit.keys["ci"], [record("a", "1")], now, kit.keyring)
    topic = topic_name(Settings(home=tmp_path), "registry")

    def read(*_a: Any, **_k: Any) -> Iterator[Record]:
        yield from records(topic, (b"a", None), (b"b", encode(view)))

    monkeypatch.setattr(registry_topic, "read_topic", read)
    assert registry_topic.load_registry(Settings(home=tmp_path)) == {}
