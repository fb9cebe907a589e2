"""Every load-test scenario, shortened, end to end through ``loraplane loadtest --json``
against the real stack (Kafka, ClickHouse, S3) with the FAKE vLLM. Each run has its own
topics and database; only the scenario's invariants are asserted, never a timing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loraplane.kernel import kafka
from loraplane.kernel.config import Settings
from loraplane.metrics.clickhouse import connect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
LORAPLANE = str(Path(sys.executable).parent / "loraplane")
ROOT = Path(__file__).resolve().parents[2]

# The checks each shortened run must pass; latency budgets are reported, not asserted.
MUST_PASS = {
    "hot-adapter": {"target_hit_rate", "no_errors"},
    "cold-adapter": {"targets_became_hot", "interactive_never_waited_for_a_load", "no_errors"},
    "burst-loading": {"every_target_served", "cold_loads_within_budget",
                      "interactive_never_waited_for_a_load", "no_errors"},
    "bulk-eviction": {"revoked_versions_evicted", "no_load_after_revoke",
                      "platinum_never_evicted", "no_errors"},
    "artifact-store-unavailable": {"load_failures_recorded_with_reason",
                                   "nothing_loaded_without_its_artifact", "no_errors"},
    "signature-failure": {"no_unsigned_load", "dead_lettered_with_reason",
                          "requests_for_untrusted_refused"},
}


def drop_run(settings: Settings, output: str) -> None:
    """Delete the topics and the ClickHouse database of the run named in ``output``."""
    found = re.search(r"prefix\s+((?:loadtest|demo)-[0-9a-z-]+),\s+database\s+(lp_\w+)", output)
    if found is None:
        return
    drop_namespace(settings, *found.groups())


def drop_namespace(settings: Settings, prefix: str, database: str) -> None:
    """Delete the topics under ``prefix`` and the ClickHouse ``database`` of one run."""
    admin = kafka.admin(settings)
    names = [n for n in admin.list_topics(timeout=10).topics if n.startswith(prefix + ".")
             or n.startswith(prefix + "-")]
    if names:
        admin.delete_topics(names, request_timeout=10)
    client = connect(settings, database="")
    try:
        client.execute(f"DROP DATABASE IF EXISTS `{database}`")
    finally:
        client.disconnect()


@pytest.mark.parametrize("scenario", sorted(MUST_PASS))
def test_scenario(stack: Settings, scenario: str) -> None:
    done = subprocess.run([LORAPLANE, "loadtest", scenario, "--fake-vllm", "--json",
                           "--duration", "10"], cwd=ROOT, capture_output=True, text=True,
                          timeout=290, check=False)
    drop_run(stack, done.stderr)
    assert done.stdout, done.stderr[-3000:]
    result = json.loads(done.stdout)
    checks = {c["name"]: c for c in result["checks"]}
    failed = {n: checks[n]["detail"] for n in MUST_PASS[scenario] if not checks[n]["passed"]}
    assert not failed, f"{failed}\n{done.stderr[-3000:]}"
    assert result["scenario"] == scenario and "FAKE" in result["vllm"]
    if scenario == "signature-failure":  # the router refuses them before any worker
        assert result["requests"] == 0 and set(result["client_status"]) == {"404"}
    else:
        assert result["requests"] > 0
    for cls in result["ttft_by_class"].values():
        assert cls["requests"] > 0
    assert done.returncode == (0 if result["passed"] else 1)
    if scenario == "signature-failure":
        assert {"registry:unknown_key", "registry:tenant_out_of_scope"} <= set(
            result["refusals"])
    if scenario == "artifact-store-unavailable":
        assert any(k.startswith("load:fail:") for k in result["refusals"])


def test_unknown_scenario_is_a_usage_error() -> None:
    done = subprocess.run([LORAPLANE, "loadtest", "nope", "--fake-vllm"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "hot-adapter" in done.stderr
