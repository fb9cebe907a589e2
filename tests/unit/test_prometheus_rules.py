"""Prometheus on the project's own terms: ``promtool check rules`` and ``promtool test rules``
pass on dashboards/prometheus, and ``promtool check metrics`` is clean on the /metrics of
every runtime (worker, router, streams app, metrics sink) after real traffic, but for the
colon of vLLM's ``vllm:lora_adapter_loaded``. Residency is served in vLLM's proposed shape."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplane.eventlog.sink import SinkMetrics, _Counts
from loraplane.infra import prometheus as prom
from loraplane.kernel import metric_names as m
from loraplane.kernel.progress import Progress
from loraplane.kernel.progress_metrics import ProgressMetrics, TailMetrics, progress_registry
from loraplane.streams.planner_runtime import LeaseMetrics
from loraplane.workers.command_feed import ReadBytes
from loraplane.workers.worker_metrics import CommandBytesMetrics
from tests.unit.test_flow_control import _post, slow_fleet
from tests.unit.test_gateway import AUTH_A, RECORDS, World, load, world  # noqa: F401 (fixture)
from tests.unit.test_router import router_metrics

pytestmark = pytest.mark.skipif(
    prom.binary("promtool") is None,
    reason="promtool is missing: scripts/setup.d/20-services.sh "
    "installs Debian's prometheus (CI has it)",
)


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


def test_the_rules_check_and_their_unit_tests_pass() -> None:
    checked = prom.check_rules()
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 13 rules found" in checked.stdout
    tested = prom.run_rule_tests()
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_rules_read_only_names_the_code_serves() -> None:
    """Every loraplane_ series a rule reads is one of kernel.metric_names (a renamed series
    would leave a rule silently empty)."""
    import re

    text = prom.RULES_FILE.read_text()
    served = {v for k, v in vars(m).items() if k.isupper() and isinstance(v, str)}
    read = {
        re.sub(r"_(bucket|count|sum)$", "", n) for n in re.findall(r"\bloraplane_[a-z_]+", text)
    }
    assert read and read <= served, read - served


def test_check_metrics_reports_what_it_should() -> None:
    """The helper is not blind: the seed's names fail, the vllm: colon alone passes."""
    bad = "# HELP adapter_swap_ms x\n# TYPE adapter_swap_ms counter\nadapter_swap_ms 1\n"
    assert prom.check_metrics(bad)
    ok = (
        f"# HELP {m.LORA_ADAPTER_LOADED} x\n# TYPE {m.LORA_ADAPTER_LOADED} gauge\n"
        f'{m.LORA_ADAPTER_LOADED}{{adapter_name="a"}} 1\n'
    )
    assert prom.check_metrics(ok) == []


@pytest.mark.asyncio(loop_scope="session")
async def test_the_worker_metrics_are_promtool_clean_and_show_residency(world: World) -> None:  # noqa: F811
    """After a cold load, a request and a heartbeat; plus every collector runner.py adds."""
    hot = RECORDS[0]
    await load(world, hot)
    status, _, _ = await world.post({"model": "chat", "prompt": "hi"})
    assert status == 200
    world.agent.publish_state()
    registry = world.agent.metrics.registry
    sink = SimpleNamespace(
        counts=_Counts(), client_id="worker-w1", backlog=0, backlog_bytes=0, journal_pending=0
    )
    tail = SimpleNamespace(
        component="worker-w1-registry",
        caught_up=True,
        lag=lambda: 0,
        current=lambda: True,
        forgotten=0,
    )
    registry.register(SinkMetrics(sink))  # type: ignore[arg-type]
    registry.register(TailMetrics([tail]))  # type: ignore[list-item]
    registry.register(ProgressMetrics([Progress("worker-commands")]))
    registry.register(CommandBytesMetrics(ReadBytes()))
    # The request may start a load of another version in the background (a canary): the
    # gauge and the agent's state are compared once no load moves them between the scrape
    # and the comparison (the scrape is served while other coroutines run).
    for _ in range(100):
        async with world.http.get(world.metrics_url + "/metrics") as resp:
            text = await resp.text()
        loaded = samples(text, m.LORA_ADAPTER_LOADED)
        resident = {dict(k)["adapter_name"]: dict(k)["level"] for k in loaded}
        expected = {
            n: "gpu" if world.agent.is_hot(n) else "cpu"
            for n in set(world.agent._rt.gpu) | set(world.agent._host)
        }
        if resident == expected:
            break
        await asyncio.sleep(0.05)
    assert prom.check_metrics(text) == []
    assert (
        loaded[
            (
                ("adapter_name", hot.lora_name),
                ("level", "gpu"),
                ("pinned", "false"),
                ("rank", str(hot.rank)),
            )
        ]
        == 1.0
    )
    assert resident == expected
    assert set(loaded.values()) == {1.0}
    beat = samples(text, m.WORKER_HEARTBEAT)[()]
    assert abs(beat - time.time()) < 60
    assert samples(text, m.ADAPTER_SWAP_SECONDS + "_count")  # seconds, not the seed's ms


@pytest.mark.asyncio(loop_scope="session")
async def test_the_router_metrics_are_promtool_clean() -> None:
    from loraplane.kernel.policy import QueueBudget

    async with slow_fleet(QueueBudget(max_in_flight_per_worker=1, max_queued_per_band=1)) as (
        router,
        url,
        _serving,
        http,
    ):
        replies = await asyncio.gather(
            *(_post(http, url, "sql", AUTH_A, "interactive") for _ in range(4))
        )
        assert {r[0] for r in replies} >= {200}
        text = await router_metrics(router, http)
    assert prom.check_metrics(text) == []
    assert samples(text, m.ROUTER_QUEUE_WAIT_SECONDS + "_count")
    assert sum(samples(text, m.ROUTER_REQUESTS).values()) == 4


def test_the_streams_app_and_sink_metrics_are_promtool_clean() -> None:
    """What ``--metrics-port`` serves: every Progress, and the planner's lease."""
    stuck = Progress("planner")
    stuck.blocked("broker away")
    runtime = SimpleNamespace(base_model="tiny/llama", planning=lambda: True)
    lease = LeaseMetrics(runtime)  # type: ignore[arg-type]
    text = generate_latest(progress_registry([lease])).decode()
    assert prom.check_metrics(text) == []
    assert samples(text, m.PLANNER_ACTIVE)
    assert samples(text, m.CONSUMER_STUCK_SECONDS)[(("component", "planner"),)] >= 0
