"""ATTACK: a router given ``--base-model`` answers the caller's own adapter of another base
model exactly as an adapter id that does not exist: 404 ``unknown_adapter``, the front
door's one message (``frontdoor.admission.NO_SUCH_ADAPTER``), byte-identical (the ``Date``
header aside), whether its registry record carries its base model's header or one
relabelled to the router's. The router's view is the real chain: a scoped tail
(``RegistryScope.keeps`` over ``TailView``) into a ``VerifiedRegistry`` of that scope."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from loraplane.frontdoor.api_keys import ApiKeys, key_digest
from loraplane.kernel.policy import RequestBudgets
from loraplane.router.routing import FleetIndex
from loraplane.router.server import Fleet, Router, serving_versions
from tests.lifecycle_kit import TENANT
from tests.unit.test_front_door_attacks import SECRET, Loop, Reply, send, serve
from tests.unit.test_gateway import ListSink
from tests.unit.test_planner import POLICY
from tests.unit.test_registry_scope import OURS, STEPS, consumer

KEYS = ApiKeys({key_digest("key-acme"): TENANT})
_DATE = re.compile(rb"\r\nDate: [^\r]*", re.IGNORECASE)


@dataclass
class ScopedRouter:
    loop: Loop
    router: Router
    port: int

    def ask(self, adapter: str) -> Reply:
        body = json.dumps({"model": adapter, "prompt": "q"}).encode()
        lines = [
            b"Content-Type: application/json",
            b"X-Request-Id: req-1",
            b"Authorization: Bearer key-acme",
        ]
        return send(self.port, "/v1/completions", lines, body)


@pytest.fixture
def scoped(tmp_path: Path) -> Iterator[ScopedRouter]:
    """A router of ``OURS`` (``--base-model base-one``) over the registry: ``ours-a`` of its
    base model, ``theirs-a`` of the other with its honest header, ``theirs-b`` of the other
    relabelled as ``OURS``; every one the caller's tenant's, active."""
    registry, stream, _ = consumer(tmp_path, [OURS])
    stream.write("ours-a", STEPS["ours-a"][1])
    stream.write("theirs-a", STEPS["theirs-a"][1])
    stream.write("theirs-b", STEPS["theirs-b"][1], header=OURS)
    fleet = Fleet(FleetIndex(POLICY, 3600.0), ListSink(), "router-t")
    fleet.versions = serving_versions(registry.records())
    assert all(v.tenant_id == TENANT for vs in fleet.versions.values() for v in vs)
    loop = Loop()
    router = Router(fleet, api_keys=KEYS, budgets=RequestBudgets(), secret=SECRET)
    runner, port = loop.run(serve(router.app()))
    yield ScopedRouter(loop, router, port)
    loop.run(runner.cleanup())
    loop.close()


def _normal(reply: Reply) -> tuple[int, bytes, bytes]:
    return reply.status, _DATE.sub(b"", reply.headers), reply.body


@pytest.mark.parametrize("adapter", ["theirs-a", "theirs-b"])
def test_attack_the_callers_adapter_of_another_base_model_is_unknown(
    scoped: ScopedRouter, adapter: str
) -> None:
    held = scoped.router.fleet.versions
    answer = scoped.ask(adapter)
    scoped.router.fleet.versions = {k: v for k, v in held.items() if k != adapter}
    nonexistent = scoped.ask(adapter)  # the same id, with no record of it anywhere
    scoped.router.fleet.versions = held
    assert nonexistent.status == 404, nonexistent
    error = json.loads(nonexistent.body)["error"]
    assert error["type"] == "unknown_adapter", error
    assert _normal(answer) == _normal(nonexistent)
    # the scope holds its own base model's adapter: admitted (no live worker here: a 503)
    ours = scoped.ask("ours-a")
    assert (ours.status, ours.error_type()) == (503, "no_live_worker"), ours
