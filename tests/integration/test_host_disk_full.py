"""A full host-tier disk under a live worker: `loraplane worker run` beside the FAKE vLLM
(tests/integration/router_env.py, one worker, no router), its host tier on a real tmpfs
much smaller than its byte budget, artifacts on a real S3 (an s3proxy of the test's own).

The adapter that does not fit is refused with its reason (``host_disk_full``, retriable:
429 + Retry-After), leaves no partial file, is not retried in a storm (once per backoff),
shows on ``/metrics`` and in the log; the hot and the warm adapter keep serving; and once
the disk has room again the same adapter loads, the agent never restarted."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from loraplane.kernel.config import Settings
from loraplane.schemas.commands import CommandAction
from tests.integration.fault_report import report_fault
from tests.integration.router_env import Fleet, running_fleet
from tests.integration.test_worker_e2e import KEY_A, KEY_B, wait_for
from tests.integration.tmpfs import small_tmpfs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ADAPTERS = {"sql": (21, "tenant-a"), "chat": (22, "tenant-a"), "other": (23, "tenant-b")}
FULL_FOR_S = 8.0  # two backoffs (WorkerConfig.load_backoff_s 5 s) of steady asking


def ask(
    f: Fleet, adapter: str, key: str = KEY_A, request_class: str = "batch"
) -> requests.Response:
    """A request to the gateway; ``batch`` waits for a cold load and says why one failed,
    ``interactive`` is served by the base model at once while the adapter is cold."""
    return requests.post(
        f"http://127.0.0.1:{f.gateways['w1']}/v1/completions",
        timeout=60,
        json={"model": adapter, "prompt": "hello", "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}", "X-Request-Class": request_class},
    )


def install_failures(f: Fleet) -> dict[str, float]:
    text = requests.get(f"http://127.0.0.1:{f.worker_metrics['w1']}/metrics", timeout=5).text
    return {
        s.labels["reason"]: s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == "loraplane_host_install_failures"
        for s in fam.samples
        if s.name == "loraplane_host_install_failures_total"
    }


def test_a_full_host_disk_refuses_keeps_serving_and_heals_without_restart(
    stack: Settings, tmp_path: Path
) -> None:
    with (
        small_tmpfs(tmp_path / "host-w1", 1 << 20) as disk,
        running_fleet(stack, tmp_path, ADAPTERS, workers=("w1",), router=False, gpu_slots=3) as f,
    ):
        agent = f.procs["w1"]
        hot, warm, big = (f.records[n].lora_name for n in ("sql", "other", "chat"))
        f.load("w1", f.records["sql"])
        f.load("w1", f.records["other"], CommandAction.prewarm_host)
        wait_for(
            lambda: hot in f.adapters_on("w1") and (disk.path / warm).is_dir(),
            30,
            "the hot adapter on the GPU and the warm one on the host tier",
        )
        disk.resize(disk.used + 8192)  # two pages left: a 35 KB adapter cannot fit

        answers: Counter[str] = Counter()
        hot_answers: list[tuple[int, str | None]] = []
        stop = threading.Event()

        def keep_asking_hot() -> None:
            while not stop.is_set():
                r = ask(f, "sql", request_class="interactive")
                hot_answers.append((r.status_code, r.headers.get("X-Loraplane-Tier")))
                time.sleep(0.05)

        asker = threading.Thread(target=keep_asking_hot, daemon=True)
        t_full = time.monotonic()
        asker.start()
        try:
            while time.monotonic() - t_full < FULL_FOR_S:
                r = ask(f, "chat", request_class="interactive")  # served by the base model
                assert r.status_code == 200 and r.headers["X-Loraplane-Fallback"] == "base"
                answers[f"base fallback, {r.headers['X-Loraplane-Fallback-Reason']}"] += 1
                time.sleep(0.1)
            resp = ask(f, "chat")  # batch: waits for the next attempt, then says why
            assert resp.status_code == 429 and "Retry-After" in resp.headers, resp.text
            assert "host_disk_full" in resp.json()["error"]["message"], resp.text
            answers["429 host_disk_full"] += 1
            # the attempt has just failed (the next is a backoff away): nothing half-written
            assert not [
                p.name
                for p in disk.path.iterdir()
                if p.name.startswith(".partial-") or p.name.endswith(".tmp")
            ]
        finally:
            stop.set()
            asker.join(60)
        assert answers["base fallback, host_disk_full"] > 0, answers
        assert hot_answers and set(hot_answers) == {(200, "gpu")}, Counter(hot_answers)
        answers["hot served from GPU"] = len(hot_answers)
        warm_resp = ask(f, "other", KEY_B)  # host -> GPU needs no disk space
        assert warm_resp.status_code == 200, warm_resp.text
        assert warm_resp.headers["X-Loraplane-Tier"] == "host"
        answers["warm served"] += 1
        full_s = time.monotonic() - t_full
        entries = sorted(p.name for p in disk.path.iterdir() if not p.name.startswith("."))
        assert entries == sorted([hot, warm])
        failures = install_failures(f)
        # a failure holds the adapter for its backoff: one fetch per 5 s, not per request
        assert 1 <= failures.get("host_disk_full", 0) <= 2 + full_s / 5, failures
        log = (tmp_path / "w1.log").read_text()
        assert "No space left on device" in log and "host_disk_full" in log

        disk.resize(1 << 20)
        t_room = time.monotonic()
        healed = wait_for(
            lambda: (r := ask(f, "chat")).status_code == 200 and r,
            30,
            "the same adapter loading once there is room",
        )
        recovery_s = time.monotonic() - t_room
        assert healed.headers["X-Loraplane-Tier"] in ("cold", "host")
        answers["loaded after room"] += 1
        assert big in f.adapters_on("w1") and (disk.path / big).is_dir()
        assert agent.poll() is None and f.procs["w1"] is agent  # never restarted
        print(
            f"full host disk: {dict(answers)} in {full_s:.1f} s, install failures "
            f"{failures}, loaded {recovery_s:.1f} s after the disk had room"
        )
        total = sum(answers.values())
        report_fault(
            "Host-tier disk full (a real tmpfs) under requests, then room again",
            answered=total,
            stored=total,
            lost=0,
            duplicated=0,
            recovered=True,
            down_s=full_s,
            recovery_s=recovery_s,
            note=f"{answers['base fallback, host_disk_full']} requests for it "
            f"served by the base model with reason host_disk_full, "
            f"{failures.get('host_disk_full', 0):g} fetches (one per backoff); "
            f"{len(hot_answers)} hot and 1 warm request served; no partial "
            "file; the same agent loaded it once there was room",
        )
