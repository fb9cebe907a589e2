"""The demo's pure parts and its process supervisor: trace replay plan, scheduled peak,
router replay, run namespace, clean-up of every child (and its detached children)."""

from __future__ import annotations

import asyncio
import io
import os
import select
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from loraplane.demo.catalog import DEMO_CATALOG, Artifacts
from loraplane.demo.flow import show_keys
from loraplane.demo.namespace import RunSpace
from loraplane.demo.peak import ScheduledPeak, write_schedule
from loraplane.demo.replay import Planned, Replayer, TrafficShape, plan
from loraplane.demo.supervisor import ChildFailed, Supervisor, process_tree
from loraplane.demo.system import ROOT, LiveSystem, SystemOptions
from loraplane.demo.traces import DEFAULT_TRACE
from loraplane.frontdoor.api_keys import ApiKeysFile
from loraplane.kernel.config import KafkaSettings, Settings
from loraplane.router.server import WORKER_HEADER
from loraplane.simulator.scenario import Burst, Peak
from loraplane.streams.schedules import ScheduleFile

TRACE = DEFAULT_TRACE


def test_plan_is_bounded_deterministic_and_has_burst_and_peak() -> None:
    shape = TrafficShape(
        60,
        max_qps=3,
        bursts=(Burst(at_s=20, duration_s=10, share=0.8, rank=6),),
        peaks=(Peak(at_s=40, duration_s=10, qps=2, rank=5),),
        seed=3,
    )
    trace = TRACE if TRACE.is_file() else None
    a, b = plan(DEMO_CATALOG.adapters, shape, trace), plan(DEMO_CATALOG.adapters, shape, trace)
    assert a == b
    assert all(0 <= p.at_s < 60 for p in a)
    base = [p for p in a if not (40 <= p.at_s < 50 and p.adapter_id == "translate-fr")]
    assert len(base) <= 3 * 60
    in_burst = [p for p in a if 20 <= p.at_s < 30]
    assert sum(p.adapter_id == "sql-helper" for p in in_burst) > len(in_burst) / 2
    assert sum(p.adapter_id == "translate-fr" for p in a if 40 <= p.at_s < 50) >= 10
    assert {p.request_class for p in a} == {"interactive", "batch"}
    tenants = {x.adapter_id: x.tenant_id for x in DEMO_CATALOG.adapters}
    assert all(p.tenant_id == tenants[p.adapter_id] and 1 <= p.max_tokens <= 16 for p in a)


def test_plan_without_a_trace_uses_synthetic_arrivals() -> None:
    planned = plan(DEMO_CATALOG.adapters, TrafficShape(30, max_qps=2), None)
    assert 20 <= len(planned) <= 60


def test_scheduled_peak_window_covers_the_replayed_peak(tmp_path: Path) -> None:
    start = datetime(2026, 11, 29, 8, 14, 50, tzinfo=UTC)
    peak = ScheduledPeak.at("translate-fr", start, at_s=25.0, duration_s=30.0, qps=1.5)
    assert peak.entry()["cron"] == "15 8 * * *"
    path = tmp_path / "schedules.yaml"
    write_schedule(path, [peak])
    entries = ScheduleFile(path).current().schedules
    assert [e.adapter_id for e in entries] == ["translate-fr"]
    for second in (-60.0, 25.0, 55.0):  # ahead of, at and after the peak
        now = start.timestamp() + second
        assert entries[0].warmup_at(now) == 1.0
    assert yaml.safe_load(path.read_text())["schedules"][0]["lead_minutes"] == 2.0


async def _replay_once(url: str) -> list:
    planned = [Planned(0.0, "contracts", "acme", "interactive", 4, "s1")]
    return await Replayer(url, {"acme": "key-acme"}, timeout_s=5).run(planned)


def test_the_replayer_sends_to_the_router_and_tells_who_answered() -> None:
    """One URL (the router's) and the tenants' API keys: the request carries the key, the
    class and the session; an answer with the router's worker header reached a worker, one
    without it (the router's own refusal) did not."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    seen: list[tuple[str, dict]] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append((request.headers["Authorization"], dict(request.headers)))
        if len(seen) == 1:
            return web.json_response({}, headers={WORKER_HEADER: "w2", "X-Loraplane-Tier": "gpu"})
        return web.json_response({"error": {}}, status=429)

    async def main() -> tuple[list, list]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        async with TestServer(app, host="127.0.0.1") as server:
            url = str(server.make_url("/"))
            return await _replay_once(url), await _replay_once(url)

    first, second = asyncio.run(main())
    assert first[0].status == 200 and first[0].worker == "w2" and first[0].reached_worker
    assert first[0].tier == "gpu"
    assert second[0].status == 429 and not second[0].reached_worker
    auth, headers = seen[0]
    assert auth == "Bearer key-acme" and headers["X-Session-Key"] == "s1"
    assert headers["X-Request-Class"] == "interactive"


def test_run_space_isolates_topics_database_and_home(tmp_path: Path) -> None:
    space = RunSpace.fresh(tmp_path, "demo")
    other = RunSpace.fresh(tmp_path, "demo")
    assert space.topic_prefix != other.topic_prefix and space.database != other.database
    s = space.with_s3("http://127.0.0.1:1").settings(Settings())
    assert s.topic_prefix == space.topic_prefix and s.clickhouse.database == space.database
    assert s.s3.endpoint_url == "http://127.0.0.1:1" and s.keyring_path.parent == space.home
    assert space.log_dir == tmp_path / "demo" / "logs" / space.run_id
    env = space.child_env()
    assert env["LORAPLANE_HOME"] == str(space.home) and "LORAPLANE_KEYRING_PATH" not in env
    assert "LORAPLANE_SECRETS_DIR" not in env
    stacked = RunSpace.fresh(tmp_path, "demo", secrets_dir=tmp_path / "secrets")
    assert stacked.child_env()["LORAPLANE_SECRETS_DIR"] == str(tmp_path / "secrets")
    # one folder of credentials: a child that is given it finds the Kafka passwords there too
    child = Settings(home=space.home, secrets_dir=tmp_path / "secrets", kafka=KafkaSettings())
    assert child.kafka.credentials_dir == tmp_path / "secrets" / "kafka"


DETACHING = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                 start_new_session=True)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("children started", flush=True)
time.sleep(120)
"""


def _wait_tree(pid: int, n: int) -> list[tuple[int, int]]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        tree = process_tree(pid)
        if len(tree) >= n:
            return tree
        time.sleep(0.1)
    raise AssertionError("children did not start")


def test_supervisor_leaves_nothing_behind_even_detached_grandchildren(tmp_path: Path) -> None:
    with Supervisor(tmp_path, os.environ, tmp_path) as sup:
        child = sup.start("detaching", [sys.executable, "-c", DETACHING])
        tree = _wait_tree(child.pid, 2)
    pids = [child.pid] + [p for p, _ in tree]
    assert sup.leftovers() == [] and sup.stopped == 3
    for pid in pids:
        assert (
            not Path(f"/proc/{pid}").exists()
            or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
        )


def test_supervisor_cleans_up_on_an_exception_and_on_sigterm(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt), Supervisor(tmp_path, os.environ, tmp_path) as sup:
        child = sup.start("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"])
        os.kill(os.getpid(), signal.SIGTERM)  # becomes KeyboardInterrupt while entered
        time.sleep(5)
    assert child.popen.poll() is not None and sup.leftovers() == []


def test_run_reports_a_failing_command_with_its_log(tmp_path: Path) -> None:
    with Supervisor(tmp_path, os.environ, tmp_path) as sup:
        assert sup.run("ok", [sys.executable, "-c", "print('hi')"]).strip() == "hi"
        with pytest.raises(ChildFailed, match="boom"):
            sup.run("bad", [sys.executable, "-c", "import sys; sys.exit('boom')"])
        child = sup.start("dies", [sys.executable, "-c", "print('bye')"])
        with pytest.raises(ChildFailed, match="exited with 0 before ready"):
            sup.wait_ready(child, lambda: False, 10, "ready")


def _private_files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}


def test_attack_an_api_key_never_reaches_a_log_and_logs_are_the_users_alone(tmp_path: Path) -> None:
    """``loraplane worker add-key`` as the demo runs it: the key comes back to the caller,
    its log holds the command and the key's length only, every log is 0600 in a 0700
    folder (a run's logs said what tenants sent, and held the keys, world-readable)."""
    space = RunSpace.fresh(tmp_path / "state", "demo")
    logs = space.log_dir
    with Supervisor(logs, space.child_env(), ROOT) as sup:
        system = LiveSystem(
            sup,
            space,
            Artifacts(tmp_path / "artifacts"),
            SystemOptions(),
            space.settings(Settings(home=tmp_path / "state")),
        )
        key = system.add_api_key("tenant-a")
        sup.start("talker", [sys.executable, "-c", "print('ready')"]).popen.wait(30)
    assert key.startswith("lp-") and len(key) > 20
    assert ApiKeysFile.open(space.home / "api-keys.json").grant(f"Bearer {key}") == (
        "tenant-a",
        None,
    )
    every = {p: p.read_bytes() for p in logs.parent.rglob("*") if p.is_file()}
    assert every and not [p for p, raw in every.items() if key.encode() in raw]
    assert "worker add-key --tenant tenant-a" in (logs / "api-keys.log").read_text()
    assert logs.stat().st_mode & 0o777 == 0o700
    assert _private_files(logs) == {"api-keys.log": 0o600, "talker.log": 0o600}


def test_the_demo_shows_keys_on_a_terminal_only(tmp_path: Path) -> None:
    piped = io.StringIO()
    show_keys(Console(file=piped, width=200), "http://127.0.0.1:1", {"tenant-a": "lp-secret"})
    assert "lp-secret" not in piped.getvalue()
    assert "worker add-key --tenant T" in piped.getvalue()
    leader, follower = os.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            show_keys(Console(file=tty, width=200), "http://127.0.0.1:1", {"tenant-a": "lp-secret"})
        seen = b""
        while b"tenant-a lp-secret" not in seen and select.select([leader], [], [], 5)[0]:
            seen += os.read(leader, 65536)  # a terminal hands output over in pieces
        assert b"tenant-a lp-secret" in seen
    finally:
        os.close(leader)
        os.close(follower)


def test_process_tree_of_a_leaf_is_empty() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert process_tree(proc.pid) == []
    finally:
        proc.kill()
        proc.wait()


def test_cli_lists_exactly_the_scenarios() -> None:
    from loraplane.commands.loadtest import SCENARIO_NAMES
    from loraplane.demo.loadtest import SCENARIOS

    assert set(SCENARIO_NAMES) == set(SCENARIOS)
