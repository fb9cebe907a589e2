"""ATTACK: the front door is no oracle of other tenants' adapters. For a caller, an adapter id
that does not exist, another tenant's adapter, another tenant's adapter whose versions are
revoked or retired, and another tenant's adapter without the version a forward names get
byte-identical answers (the ``Date`` header aside) through the fleet router and the worker
gateway, by API key and by a router's signed forward alike, for every spelling of id and
version; the worker does the same work for each (none), and only ops (the request log, the
router's counts) see which case it was. A tenant's model list shows none of them.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from secrets import token_hex

import pytest

from loraplane.frontdoor.forwarded import (
    SIGNATURE_HEADER,
    TENANT_HEADER,
    VERSION_HEADER,
    VERSION_REASON_HEADER,
    Forward,
    sign,
)
from loraplane.kernel.policy import RequestBudgets
from loraplane.router.routing import FleetIndex
from loraplane.router.server import Fleet, Router, serving_versions
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus
from loraplane.schemas.request_log import RequestLog
from loraplane.workers.gateway import Gateway
from tests.unit.test_front_door_attacks import COMPLETIONS, SECRET, Loop, Reply, send, serve
from tests.unit.test_gateway import KEYS, FakeServing, ListSink, record
from tests.unit.test_planner import POLICY, worker

IDS = ["x", "chat2", "a.b-c_d", "9lives", "z" * 128]
VERSIONS = ["1", "v2", "1.4.0", "999999999.0.0.1"]
OTHER = "tenant-b"


def cases(adapter: str, version: str) -> dict[str, list[AdapterRecord]]:
    """What the door holds of ``adapter`` in each case; ``version`` is the one a forward names."""
    absent = "77" if version != "77" else "78"
    return {
        "does_not_exist": [],
        "another_tenants": [record(adapter, version, AdapterStatus.active, OTHER)],
        "another_tenants_revoked": [
            record(adapter, version, AdapterStatus.revoked, OTHER),
            record(adapter, absent, AdapterStatus.retired, OTHER),
        ],
        "another_tenants_without_that_version": [
            record(adapter, absent, AdapterStatus.active, OTHER)
        ],
    }


@dataclass
class ViewServing(FakeServing):
    """A worker whose verified registry is ``records``, swapped between requests."""

    records: list[AdapterRecord] = field(default_factory=list)

    def versions(self, adapter_id: str) -> list[AdapterRecord]:
        return [r for r in self.records if r.adapter_id == adapter_id]


@dataclass
class Doors:
    loop: Loop
    serving: ViewServing
    fleet: Fleet
    router: Router
    sink: ListSink
    gateway: int
    router_port: int

    def hold(self, records: list[AdapterRecord]) -> None:
        self.serving.records = records
        self.fleet.versions = serving_versions(records)


@pytest.fixture(scope="module")
def doors() -> Iterator[Doors]:
    loop = Loop()
    sink = ListSink()
    serving = ViewServing(worker_id="w1")
    gateway = Gateway(
        serving, api_keys=KEYS, budgets=RequestBudgets(), sink=sink, router_secret=SECRET
    )
    gw, gw_port = loop.run(serve(gateway.app()))
    fleet = Fleet(FleetIndex(POLICY, 3600.0), ListSink(), "router-t")
    state = worker("w1", gpu=[], slots=4, base=record("x", "1", AdapterStatus.active).base_model)
    fleet.index.update(
        state.model_copy(
            update={"ts": datetime.now(UTC), "gateway_url": f"http://127.0.0.1:{gw_port}"}
        )
    )
    router = Router(fleet, api_keys=KEYS, budgets=RequestBudgets(), secret=SECRET)
    rs, rs_port = loop.run(serve(router.app()))
    yield Doors(loop, serving, fleet, router, sink, gw_port, rs_port)
    loop.run(rs.cleanup())
    loop.run(gw.cleanup())
    loop.close()


_DATE = re.compile(rb"\r\nDate: [^\r]*", re.IGNORECASE)


def _normal(reply: Reply) -> tuple[int, bytes, bytes]:
    """The reply as the caller reads it, its ``Date`` header aside (the clock's, not ours)."""
    return reply.status, _DATE.sub(b"", reply.headers), reply.body


def _ask(doors: Doors, through: str, adapter: str, version: str, tenant: str) -> Reply:
    body = json.dumps({"model": adapter, "prompt": "q"}).encode()
    lines = [b"Content-Type: application/json", b"X-Request-Id: req-1"]
    if through == "forward":  # a router's signed decision, naming the version
        fwd = Forward(tenant, "interactive", version, "active")
        lines += [
            TENANT_HEADER.encode() + b": " + tenant.encode(),
            b"X-Request-Class: interactive",
            VERSION_HEADER.encode() + b": " + version.encode(),
            VERSION_REASON_HEADER.encode() + b": active",
            SIGNATURE_HEADER.encode()
            + b": "
            + sign(
                SECRET,
                fwd,
                COMPLETIONS,
                "req-1",
                body,
                time.time(),
                worker_id="w1",
                nonce=token_hex(16),
            ).encode(),
        ]
    else:
        key = {"tenant-a": b"key-a", OTHER: b"key-b"}[tenant]
        lines.append(b"Authorization: Bearer " + key)
    port = doors.router_port if through == "router" else doors.gateway
    return send(port, "/v1/completions", lines, body)


def _models(doors: Doors, key: bytes) -> list[str]:
    reply = send(doors.router_port, "/v1/models", [b"Authorization: Bearer " + key], method=b"GET")
    assert reply.status == 200, reply
    return [m["id"] for m in json.loads(reply.body)["data"]]


@pytest.mark.parametrize("through", ["gateway", "forward", "router"])
@pytest.mark.parametrize("adapter", IDS)
@pytest.mark.parametrize("version", VERSIONS)
def test_attack_another_tenants_adapter_answers_as_one_that_does_not_exist(
    doors: Doors, through: str, adapter: str, version: str
) -> None:
    answers: dict[str, tuple[int, bytes, bytes]] = {}
    ops: dict[str, list[str]] = {}
    for case, records in cases(adapter, version).items():
        doors.hold(records)
        logs_before = len(doors.sink.messages(RequestLog))
        counts_before = dict(doors.router.outcomes)
        reply = _ask(doors, through, adapter, version, "tenant-a")
        answers[case] = _normal(reply)
        new_logs = doors.sink.messages(RequestLog)[logs_before:]
        counted = {
            str(k): v - counts_before.get(k, 0)
            for k, v in doors.router.outcomes.items()
            if v != counts_before.get(k, 0)
        }
        ops[case] = [str(log.error) for log in new_logs] + sorted(counted)
        assert _models(doors, b"key-a") == []  # nothing of it is the caller's to list
    first = answers["does_not_exist"]
    assert first[0] == 404, first
    assert json.loads(first[2])["error"]["type"] == "unknown_adapter"
    assert all(answer == first for answer in answers.values()), answers
    # the worker did nothing for any of them: no load asked, no copy counted or held
    assert (doors.serving.asked, doors.serving.counted, doors.serving.held) == ([], [], [])
    # ops still tell the cases apart (the gateway's request log, the router's counts)
    assert ops["does_not_exist"] == ["unknown_adapter"]
    for case in cases(adapter, version):
        if case != "does_not_exist":
            assert ops[case] == ["forbidden"], (case, ops)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_owner_keeps_its_own_answers(doors: Doors, version: str) -> None:
    """The owner still learns what concerns only its adapter: a forwarded revoked version
    is a 410, one its worker does not hold yet a 503, no serving version a 404 that says so;
    and its model list shows the adapter exactly while a version serves."""
    held = cases("mine", version)
    doors.hold(held["another_tenants_revoked"])
    reply = _ask(doors, "forward", "mine", version, OTHER)
    assert (reply.status, reply.error_type()) == (410, "version_revoked"), reply
    assert _models(doors, b"key-b") == []
    doors.hold(held["another_tenants_without_that_version"])
    reply = _ask(doors, "forward", "mine", version, OTHER)
    assert (reply.status, reply.error_type()) == (503, "version_unknown"), reply
    assert _models(doors, b"key-b") == ["mine"]
    doors.hold([record("mine", version, AdapterStatus.canary, OTHER, canary=0.0)])
    reply = _ask(doors, "router", "mine", version, OTHER)
    assert (reply.status, reply.error_type()) == (404, "no_serving_version"), reply
    assert _models(doors, b"key-b") == []  # a canary at 0 % serves nobody: not listed
