"""The dashboard's fleet panel API (``GET /api/fleet``, dashboards/web.py): the fleet view
(loraplane/router/fleet_view.py) of the latest worker and router states, with fake states in place
of the worker-state / router-state topic read."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from loraplane.dashboards import web as dashboard_web
from loraplane.dashboards.web import Dashboard
from loraplane.kernel.config import Settings
from loraplane.kernel.worker_states import FleetStates
from loraplane.schemas.router_state import QueueDepth, RouterState
from loraplane.schemas.worker_state import WorkerState
from tests.unit.test_fleet_view import state

pytestmark = pytest.mark.asyncio(loop_scope="session")


def aged(s: WorkerState, age_s: float) -> WorkerState:
    """``s`` as last heard ``age_s`` ago by the real clock (the API reads ``time.time``)."""
    return s.model_copy(update={"ts": datetime.fromtimestamp(time.time() - age_s, UTC)})


class FakeTopic:
    """``latest_fleet_states`` with states aged against the real clock, or a broker away."""

    def __init__(self) -> None:
        self.reads = 0
        self.down = False
        self.malformed = 0
        self.routers: list[RouterState] = []

    def __call__(self, settings: Settings, timeout_s: float = 10.0) -> FleetStates:
        self.reads += 1
        if self.down:
            raise RuntimeError("broker 127.0.0.1:1 unreachable\nsecond line\nthird")
        hb = settings.policy.worker_heartbeat_s
        states = [
            aged(
                state(
                    "w1",
                    "llama",
                    ["a@1-aa", "b@1-bb"],
                    ["c@1-cc"],
                    slots=2,
                    in_flight=1,
                    protected=("a@1-aa",),
                ),
                0.5 * hb,
            ),
            aged(state("w2", "llama", ["a@1-aa"], slots=2), hb),
            aged(state("w3", "llama", ["z@1-zz"]), 4 * hb),
        ]
        return FleetStates(
            {s.worker_id: s for s in states}, {r.router_id: r for r in self.routers}, self.malformed
        )


@pytest.fixture
def topic(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTopic]:
    fake = FakeTopic()
    monkeypatch.setattr(dashboard_web, "latest_fleet_states", fake)
    yield fake


async def get(dashboard: Dashboard, path: str) -> tuple[int, dict]:
    server = TestServer(dashboard.app(), host="127.0.0.1")
    await server.start_server()
    try:
        async with ClientSession() as http, http.get(server.make_url(path)) as resp:
            return resp.status, await resp.json()
    finally:
        await server.close()


async def test_the_fleet_panel_shows_slots_tiers_replicas_and_liveness(
    topic: FakeTopic, tmp_path: Path
) -> None:
    topic.malformed = 1
    topic.routers = [
        RouterState(
            router_id="r1",
            ts=datetime.now(UTC),
            in_flight={"llama": 2},
            queues=[QueueDepth(base_model="llama", band="batch-silver", queued=3)],
        )
    ]
    settings = Settings(home=tmp_path)
    status, body = await get(Dashboard(settings), "/api/fleet")
    assert status == 200
    assert body["heartbeat_s"] == settings.policy.worker_heartbeat_s
    assert body["malformed_states"] == 1  # counted, never shown
    (llama,) = body["base_models"]
    assert [(w["worker_id"], w["live"]) for w in llama["workers"]] == [
        ("w1", True),
        ("w2", True),
        ("w3", False),
    ]  # w3: 4 heartbeats silent
    w1 = llama["workers"][0]
    assert (w1["gpu_slots_used"], w1["gpu_slots_free"], w1["protected"], w1["in_flight"]) == (
        2,
        0,
        1,
        3,
    )
    assert (w1["gpu_loras"], w1["host_loras"]) == (["a@1-aa", "b@1-bb"], ["c@1-cc"])
    assert llama["replicas"] == {"a@1-aa": 2, "b@1-bb": 1}  # w3's copy takes no traffic
    assert (llama["live_workers"], llama["gpu_slots_free"], llama["queue_depth"]) == (2, 1, 3)
    assert (llama["routers"], llama["router_in_flight"]) == (1, 2)
    assert llama["queued_by_band"] == {"batch-silver": 3}


async def test_pages_share_one_read_and_a_broker_away_is_a_503_with_the_reason(
    topic: FakeTopic, tmp_path: Path
) -> None:
    dashboard = Dashboard(Settings(home=tmp_path), refresh_s=60.0)
    server = TestServer(dashboard.app(), host="127.0.0.1")
    await server.start_server()
    try:
        async with ClientSession() as http:
            for _ in range(3):
                async with http.get(server.make_url("/api/fleet")) as resp:
                    assert resp.status == 200
                    body = await resp.json()
            assert topic.reads == 1  # within refresh_s / 2: one topic read for every page
            (llama,) = body["base_models"]
            assert llama["queue_depth"] is None  # no router reports: "-"
    finally:
        await server.close()
    topic.down = True
    status, body = await get(Dashboard(Settings(home=tmp_path)), "/api/fleet")
    assert status == 503 and body == {"error": "Kafka: broker 127.0.0.1:1 unreachable second line"}
