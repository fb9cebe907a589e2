"""The fleet router on the real stack: Kafka, our own S3 (s3proxy), three real worker processes
(`loraplane worker run`, each beside its own FAKE vLLM) and `loraplane router run` in front.
Registry views are signed as in test_worker_e2e (the router and the workers verify them with
the module's keyring); the router secret is a 0600 file of the shared LORAPLANE_HOME.

Bound stated and asserted: a killed worker is drained within 3 heartbeats + one drain pass
(heartbeat 1 s here: <= 5 s, asserted <= 8 s to leave room for a loaded machine).

Last, on the same fleet (no start of its own: ~10 s), a real Prometheus (Debian's, through
infra/prometheus.py, 127.0.0.1 only, the project's rules loaded) scrapes the live workers,
the router and a ``streams planner`` every second, and the per-adapter series are read back
through Prometheus' own HTTP API."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from loraplane.infra.processes import free_port
from loraplane.infra.prometheus import Prometheus, binary
from loraplane.kernel import metric_names as m
from loraplane.kernel.config import Settings
from loraplane.tiny_model import TinyLlama
from tests.integration.router_env import (
    E2E_ADAPTERS,
    LORAPLANE,
    WORKERS,
    Fleet,
    running_fleet,
)
from tests.integration.test_worker_e2e import KEY_A, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def fleet(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with running_fleet(stack, tmp_path_factory.mktemp("router"), E2E_ADAPTERS) as f:
        f.load("w2", f.records["sql"])
        wait_for(lambda: f.health().get("gpu_copies", 0) >= 1, 60, "sql hot on w2, seen")
        yield f


def test_a_hot_adapter_is_served_where_it_is_hot(fleet: Fleet) -> None:
    for _ in range(10):
        resp = fleet.ask("sql")
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-Loraplane-Worker"] == "w2"
        assert resp.headers["X-Loraplane-Route"] == "gpu"
        assert resp.headers["X-Loraplane-Tier"] == "gpu"
    assert fleet.adapters_on("w1") == fleet.adapters_on("w3") == set()  # no cold load


def test_unknown_foreign_and_unauthenticated_requests_are_refused(fleet: Fleet) -> None:
    assert fleet.ask("no-such-adapter").status_code == 404
    foreign, unknown = fleet.ask("other"), fleet.ask("no-such-adapter")  # tenant B's, none
    assert foreign.status_code == 404
    assert foreign.text == unknown.text.replace("no-such-adapter", "other")
    assert fleet.ask("sql", key="wrong").status_code == 401
    direct = requests.post(
        f"http://127.0.0.1:{fleet.gateways['w2']}/v1/completions",
        json={"model": "sql", "prompt": "x"},
        timeout=10,
        headers={"X-Loraplane-Tenant": "tenant-a"},
    )
    assert direct.status_code == 401  # a forwarded tenant without the router's signature


def test_the_official_openai_client(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=fleet.router_url + "/v1", api_key=KEY_A, max_retries=0)
    assert {m.id for m in client.models.list()} == {"sql", "chat"}
    done = client.completions.create(model="sql", prompt="hello", max_tokens=4)
    assert done.choices and done.choices[0].text
    assert done.model == "sql"  # the adapter id asked for: never a lora name or a path
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content and chat.model == "sql"
    chunks = list(
        client.chat.completions.create(
            model="sql",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert not chunks[-1].choices
    assert {c.model for c in chunks} == {"sql"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2)


def test_fleet_status_shows_each_worker_and_the_hot_copy(fleet: Fleet) -> None:
    """``loraplane fleet status --json`` on the real topic: the three live workers, the
    hot copy of sql on w2 (one replica), and the same liveness rule as the router."""
    import json

    out = subprocess.run(
        [LORAPLANE, "fleet", "status", "--json", "--heartbeat-s", "1"],
        env=fleet.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (base,) = json.loads(out.stdout)["base_models"]
    assert [w["worker_id"] for w in base["workers"]] == list(WORKERS)
    assert all(w["live"] for w in base["workers"]) and base["live_workers"] == 3
    assert base["replicas"] == {fleet.records["sql"].lora_name: 1}
    w2 = next(w for w in base["workers"] if w["worker_id"] == "w2")
    assert w2["gpu_versions"] == 1
    # the router's own heartbeat (router-state): live, nothing queued at rest
    assert base["routers"] == 1 and base["queue_depth"] == 0, base


def test_a_stopped_worker_is_drained_within_the_bound(fleet: Fleet) -> None:
    fleet.kill("w3")
    start = time.monotonic()
    wait_for(lambda: fleet.health().get("workers") == 2, 15, "w3 drained")
    assert time.monotonic() - start <= 8
    assert fleet.ask("sql").headers["X-Loraplane-Worker"] == "w2"


def _direct(url: str, name: str, **labels: str) -> float:
    """The sum of one series as the endpoint serves it (what Prometheus must agree with)."""
    text = requests.get(url + "/metrics", timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.mark.skipif(
    binary("prometheus") is None,
    reason="prometheus is missing: scripts/setup.d/20-services.sh installs Debian's (CI has it)",
)
def test_prometheus_scrapes_workers_router_and_planner(fleet: Fleet, tmp_path: Path) -> None:
    sql = fleet.records["sql"]
    planner_port = free_port()
    fleet.spawn("planner", [LORAPLANE, "streams", "planner", "--metrics-port", str(planner_port)])
    live = [w for w in WORKERS if w in fleet.procs]
    server = Prometheus(
        tmp_path / "prometheus",
        free_port(),
        {
            "loraplane-worker": [f"127.0.0.1:{fleet.worker_metrics[w]}" for w in live],
            "loraplane-router": [fleet.router_metrics_url.removeprefix("http://")],
            "loraplane-streams": [f"127.0.0.1:{planner_port}"],
        },
    )
    server.start()
    try:
        for _ in range(3):
            assert fleet.ask("sql").headers["X-Loraplane-Worker"] == "w2"
        w2 = f"127.0.0.1:{fleet.worker_metrics['w2']}"
        served = {
            f"127.0.0.1:{fleet.worker_metrics[w]}": n
            for w in live
            if (
                n := _direct(
                    f"http://127.0.0.1:{fleet.worker_metrics[w]}",
                    m.ADAPTER_REQUESTS,
                    adapter_id=sql.adapter_id,
                )
            )
        }
        assert requests.get(fleet.router_url + "/metrics", timeout=5).status_code == 404
        routed = _direct(fleet.router_metrics_url, m.ROUTER_REQUESTS)  # the 404 counted too
        for w in live:  # the gateways, the tenants' and the routers' port, serve none either
            gateway = f"http://127.0.0.1:{fleet.gateways[w]}/metrics"
            assert requests.get(gateway, timeout=5).status_code == 404
        assert served[w2] >= 3
        wait_for(
            lambda: len(server.query("up == 1")) == len(live) + 2,
            30,
            "every target up in Prometheus",
        )

        def per_adapter() -> dict[str, float]:
            return {
                r["metric"]["instance"]: float(r["value"][1])
                for r in server.query(
                    f'sum by (instance) ({m.ADAPTER_REQUESTS}{{adapter_id="{sql.adapter_id}",'
                    f'tenant_id="{sql.tenant_id}"}})'
                )
            }

        wait_for(
            lambda: per_adapter() == served,
            10,
            "sql's requests per worker in Prometheus as the workers serve them",
        )
        loaded = server.query(f'{m.LORA_ADAPTER_LOADED}{{adapter_name="{sql.lora_name}"}}')
        assert (w2, "gpu", "false", str(sql.rank), "1") in [
            (
                r["metric"]["instance"],
                r["metric"]["level"],
                r["metric"]["pinned"],
                r["metric"]["rank"],
                r["value"][1],
            )
            for r in loaded
        ]
        wait_for(
            lambda: float(server.query(f"sum({m.ROUTER_REQUESTS})")[0]["value"][1]) == routed,
            10,
            "the router's outcomes in Prometheus",
        )
        wait_for(lambda: server.query(m.PLANNER_ACTIVE), 20, "the planner's lease series")
        wait_for(
            lambda: len(server.query("loraplane:worker_heartbeat_age_seconds")) == len(live),
            10,
            "the heartbeat ages (a recording rule) evaluated",
        )
        ages = server.query("loraplane:worker_heartbeat_age_seconds")
        assert all(float(a["value"][1]) < 15 for a in ages), ages  # the alert's threshold
        groups = server.api("rules")["groups"]
        assert {g["name"] for g in groups} == {"loraplane-recording", "loraplane-alerts"}
        assert all(r["health"] != "err" for g in groups for r in g["rules"])
    finally:
        server.stop()
        fleet.kill("planner")


def _not_run(gateway: str) -> str | None:
    """What a gateway's /healthz says it refuses requests as (None: it serves)."""
    try:
        return requests.get(gateway + "/healthz", timeout=2).json().get("not_run")
    except requests.RequestException:
        return "unreachable"


def test_attack_a_vllm_restarted_with_another_base_model_gets_no_adapter(fleet: Fleet) -> None:
    """ATTACK (last: it restarts w2's vLLM): w2's FAKE vLLM restarted under its running
    agent serving a model of other shapes. The agent kept the shapes it had checked sql
    against and loaded it again into the other model. It loads nothing there: its gateway
    refuses as not run (``vllm_wrong_base_model``), the router serves sql elsewhere, and
    once vLLM serves the verified model again w2 loads sql back."""
    wide = fleet.tmp / "wide-model"
    wide.mkdir()
    arch = TinyLlama(hidden_size=256)
    (wide / "config.json").write_text(json.dumps(arch.hf_config(arch.vocab_size)))
    sql = fleet.records["sql"]
    gateway = f"http://127.0.0.1:{fleet.gateways['w2']}"
    verified = fleet.commands["vllm-w2"]
    other = list(verified)
    other[other.index("--model") + 1] = str(wide)
    fleet.kill("vllm-w2")
    fleet.spawn("vllm-w2", other)
    wait_for(lambda: _not_run(gateway) == "vllm_wrong_base_model", 30, "w2 refusing")
    direct = requests.post(
        gateway + "/v1/completions",
        timeout=30,
        json={"model": "sql", "prompt": "hello", "max_tokens": 4},
        headers={"Authorization": f"Bearer {KEY_A}"},
    )
    assert direct.status_code == 503, direct.text
    assert direct.headers["X-Loraplane-Not-Run"] == "vllm_wrong_base_model"
    for _ in range(3):
        resp = fleet.ask("sql")
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-Loraplane-Worker"] != "w2"
    time.sleep(1.0)  # five of w2's ticks, each wanting sql back on its GPU
    assert fleet.adapters_on("w2") == set()
    fleet.kill("vllm-w2")
    fleet.spawn("vllm-w2", verified)
    wait_for(lambda: _not_run(gateway) is None, 30, "w2 serving again")
    wait_for(lambda: sql.lora_name in fleet.adapters_on("w2"), 30, "sql back on w2")
