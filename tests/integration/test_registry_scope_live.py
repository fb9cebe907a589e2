"""The registry per base model on real Kafka (loraplane/registry/topic.py ``RegistryScope``):
the real registry agent (``loraplane streams run``) writes each view with its base model
header, and a worker's registry built as the runner builds it (``runner.worker_registry``)
holds its base model's adapters only and reads past the others' records.

ATTACK: records written straight onto the registry topic, as anyone able to write it could:
a genuine revoke relabelled with another base model's header still withdraws the version
from the worker holding the adapter, and another base model's genuine view relabelled with
the worker's header is not held.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from loraplane.kernel import kafka
from loraplane.kernel.bus import Record, read_topic
from loraplane.kernel.config import Settings
from loraplane.registry.fold import Accepted, AdapterState, evaluate
from loraplane.registry.live import VerifiedRegistry
from loraplane.registry.topic import BASE_MODEL_HEADER
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.lifecycle import LifecycleEvent
from loraplane.schemas.registry import AdapterView
from loraplane.workers.runner import WorkerOptions, worker_registry
from loraplane.workers.worker_metrics import WorkerMetrics
from tests.integration.registry_env import Env, running, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
OURS, THEIRS = "base-ours", "base-theirs"
ADAPTERS = {"ours-1": OURS, "ours-2": OURS, "theirs-1": THEIRS, "theirs-2": THEIRS}


class Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, Any]] = []

    def emit(self, topic_suffix: str, key: str, message: Any) -> None:
        self.sent.append((topic_suffix, key, message))


@pytest.fixture(scope="module")
def env(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with running(stack, tmp_path_factory.mktemp("registry-scope")) as env:
        yield env


def lifecycle(env: Env, adapter_id: str, base: str, now: datetime) -> list[LifecycleEvent]:
    """publish 1, promote 1, and (not sent) revoke 1."""
    return [
        env.kit.event("ci", "publish", adapter_id, "1", 1, now, base_model=base),
        env.kit.event("ci", "promote", adapter_id, "1", 2, now, base_model=base),
        env.kit.event("ops", "revoke", adapter_id, "1", 3, now, base_model=base, reason="test"),
    ]


def folded(env: Env, events: list[LifecycleEvent], now: datetime) -> AdapterView:
    """The view the registry agent would write after ``events`` (its own fold)."""
    state: AdapterState | None = None
    for event in events:
        decision = evaluate(event, env.kit.keyring, lambda _a, s=state: s, now)
        assert isinstance(decision, Accepted), decision
        state = decision.state
    assert state is not None
    return state.view


def write(env: Env, adapter_id: str, value: bytes, header: str) -> None:
    """A record onto the registry topic, not through the registry agent."""
    p = kafka.producer(env.settings)
    p.produce(
        env.topic("registry"),
        key=adapter_id.encode(),
        value=value,
        headers=[(BASE_MODEL_HEADER, header.encode())],
    )
    assert p.flush(20) == 0


def held(registry: VerifiedRegistry) -> dict[str, tuple[str, str]]:
    return {r.adapter_id: (r.version, str(r.status)) for r in registry.records()}


def test_a_worker_holds_its_base_model_and_no_header_changes_that(env: Env, tmp_path: Path) -> None:
    now = now_utc()
    events = {aid: lifecycle(env, aid, base, now) for aid, base in ADAPTERS.items()}
    env.send([(aid.encode(), e) for aid, evs in events.items() for e in evs[:2]])
    for aid in ADAPTERS:
        env.view(aid, lambda v: v.active_version == "1")
    # the registry agent labels every view it writes with the view's own base model
    records: list[Record] = list(read_topic(env.settings, env.topic("registry"), timeout_s=20))
    assert len(records) == 8
    assert all(
        r.headers[BASE_MODEL_HEADER] == decode(AdapterView, r.value or b"").base_model.encode()
        for r in records
    )

    options = WorkerOptions(
        worker_id="scope-w1",
        base_model=OURS,
        vllm_url="",
        gateway_port=0,
        metrics_port=None,
        host_tier_dir=tmp_path / "host",
        host_budget_bytes=1,
    )
    options.host_tier_dir.mkdir()
    tail, registry = worker_registry(
        env.settings,
        options,
        Sink(),  # type: ignore[arg-type]
        WorkerMetrics(),
    )
    try:
        assert tail.wait_caught_up(30)
        assert held(registry) == {"ours-1": ("1", "active"), "ours-2": ("1", "active")}
        assert sorted(r.key or b"" for r in tail.snapshot()) == [b"ours-1", b"ours-2"]
        assert tail.skipped == 4  # theirs-1 and theirs-2: publish and promote, not decoded

        # ATTACK: the revoke of ours-1, written under the other base model's header
        revoked = folded(env, events["ours-1"], now)
        write(env, "ours-1", encode(revoked), THEIRS)
        wait_for(
            lambda: True if held(registry).get("ours-1") == ("1", "revoked") else None,
            "the relabelled revoke withdrawn at the worker",
            30,
        )
        # ATTACK: theirs-1's genuine view under this worker's header: read, never held
        theirs = next(r for r in records if r.key == b"theirs-1")
        before = tail.version
        write(env, "theirs-1", theirs.value or b"", OURS)
        wait_for(lambda: True if tail.version > before else None, "the relabelled view", 30)
        assert held(registry) == {"ours-1": ("1", "revoked"), "ours-2": ("1", "active")}
    finally:
        tail.stop()
