"""Every load-test scenario, shortened, end to end through ``loraplane loadtest --json``
against the real stack (Kafka, ClickHouse, S3) with the FAKE vLLM; only the scenarios'
invariants are asserted, never a timing.

Bringing a live system up costs more than a shortened scenario, so the suite runs them as
three ``loraplane loadtest`` commands side by side (RUNS); the scenarios of one command
share one system, each with its own adapters and measurement window (see
loraplane.demo.loadtest.run_scenarios). Each command has its own topics and database; the
rows one command leaves are replayed by ``loraplane simulate --from-clickhouse`` beside the
others, before its database is dropped."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from loraplane.kernel import kafka
from loraplane.kernel.config import Settings
from loraplane.metrics.clickhouse import connect
from tests.integration.metrics_env import drop_database

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
LORAPLANE = str(Path(sys.executable).parent / "loraplane")
ROOT = Path(__file__).resolve().parents[2]

# The checks each shortened run must pass; latency budgets are reported, not asserted.
MUST_PASS = {
    "hot-adapter": {"target_hit_rate", "no_errors"},
    "cold-adapter": {"targets_became_hot", "interactive_never_waited_for_a_load", "no_errors"},
    "burst-loading": {
        "every_target_served",
        "cold_loads_within_budget",
        "interactive_never_waited_for_a_load",
        "no_errors",
    },
    "bulk-eviction": {
        "revoked_versions_evicted",
        "no_load_after_revoke",
        "platinum_never_evicted",
        "no_errors",
    },
    "artifact-store-unavailable": {
        "load_failures_recorded_with_reason",
        "nothing_loaded_without_its_artifact",
        "no_errors",
    },
    "signature-failure": {
        "no_unsigned_load",
        "dead_lettered_with_reason",
        "requests_for_untrusted_refused",
    },
}


# How a loadtest or demo run names its namespace on stderr: (topic prefix, database).
RUN_NAMESPACE = re.compile(r"prefix\s+((?:loadtest|demo)-[0-9a-z-]+),\s+database\s+(lp_\w+)")


def drop_run(settings: Settings, output: str) -> None:
    """Delete the topics and the ClickHouse database of each run named in ``output``."""
    for found in RUN_NAMESPACE.finditer(output):
        drop_namespace(settings, *found.groups())


def drop_namespace(settings: Settings, prefix: str, database: str) -> None:
    """Delete the topics under ``prefix`` and the ClickHouse ``database`` of one run."""
    admin = kafka.admin(settings)
    names = [
        n
        for n in admin.list_topics(timeout=10).topics
        if n.startswith(prefix + ".") or n.startswith(prefix + "-")
    ]
    if names:
        admin.delete_topics(names, request_timeout=10)
    drop_database(settings, database)


RUNS = (
    ("bulk-eviction",),
    ("cold-adapter", "burst-loading"),
    ("signature-failure", "hot-adapter", "artifact-store-unavailable"),
)
"""The commands, run side by side (most of a scenario is waiting, not CPU), balanced so that
each takes about as long: the fixture lasts as long as the longest. bulk-eviction, the
longest scenario, runs alone (no scenario before it spends the worker's rolling-minute load
budget, which must leave it loads to evict); artifact-store-unavailable stops an S3 of its
own and so gets a system of its own anyway, after the two short ones' shared system."""


@dataclass(frozen=True)
class Replayed:
    """``loraplane simulate --from-clickhouse`` on one run's rows, before they are dropped;
    kept, not asserted, so that a failing replay fails its own test only."""

    request_rows: int  # in the run's request_log
    answers: list[tuple[int, str]]  # exit status and output: as seen, what if, empty window
    reports: list[dict[str, Any]]  # the JSON of the first two ({} when none was written)
    ran_beside_s: float  # from the replayed run's end to the end of the last run
    added_s: float  # what the replays added after that (they ran beside the others)


@dataclass(frozen=True)
class Ran:
    result: dict[str, Any]
    returncode: int  # of the whole command
    all_passed: bool  # every scenario of the command
    stderr: str
    replayed: Replayed | None = None


REPLAYED_RUN = 1  # the RUNS command whose rows are replayed: two scenarios, many adapters


@dataclass(frozen=True)
class Replaying:
    """The replays of one run, started as soon as that run ended (the others still run)."""

    started: float
    database: str
    env: dict[str, str]
    procs: list[subprocess.Popen[str]]
    outs: list[Path]


def start_replays(output: str, folder: Path) -> Replaying | None:
    """``simulate --from-clickhouse`` of the run named in ``output``: the fleet as it was and
    with 2 more workers and 16 slots, side by side. None: the run named no namespace."""
    found = RUN_NAMESPACE.search(output)
    if found is None:
        return None
    prefix, database = found.groups()
    env = {"LORAPLANE_TOPIC_PREFIX": prefix, "LORAPLANE_CLICKHOUSE__DATABASE": database}
    base = [
        LORAPLANE,
        "simulate",
        "--from-clickhouse",
        "--since",
        "1h",
        "--policies",
        "lru,loraplane",
    ]
    outs = [folder / "replay.json", folder / "replay-what-if.json"]
    procs = [
        subprocess.Popen(
            c,
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for c in (
            [*base, "--json", str(outs[0])],
            [*base, "--add-workers", "2", "--slots", "16", "--json", str(outs[1])],
        )
    ]
    return Replaying(time.monotonic(), database, env, procs, outs)


def finish_replays(settings: Settings, replaying: Replaying) -> Replayed:
    """Their reports, the run's row count, and an empty window's answer (in this process: it
    exits before any Kafka read)."""
    from typer.testing import CliRunner

    from loraplane.cli import app
    from loraplane.kernel.config import get_settings

    finishing = time.monotonic()
    client = connect(settings, database=replaying.database)
    try:
        rows = client.execute("SELECT count() FROM request_log FINAL")[0][0]
    finally:
        client.disconnect()
    answers: list[tuple[int, str]] = []
    for p in replaying.procs:
        try:
            said = p.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            said = "no answer in 60 s"
        answers.append((p.wait(), said))
    reports = [json.loads(o.read_text()) if o.is_file() else {} for o in replaying.outs]
    get_settings.cache_clear()
    try:
        empty = CliRunner().invoke(
            app, ["simulate", "--from-clickhouse", "--since", "1s"], env=replaying.env
        )
    finally:
        get_settings.cache_clear()
    answers.append((empty.exit_code, empty.output))
    return Replayed(
        int(rows),
        answers,
        reports,
        round(finishing - replaying.started, 1),
        round(time.monotonic() - finishing, 1),
    )


@pytest.fixture(scope="module")
def loadtests(stack: Settings, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """The RUNS commands, started together (output to files: a full pipe would block one);
    each scenario's JSON object by name."""
    assert sorted(n for names in RUNS for n in names) == sorted(MUST_PASS)
    folder = tmp_path_factory.mktemp("loadtest")
    files = [(folder / f"{i}.json", folder / f"{i}.err") for i in range(len(RUNS))]
    procs = []
    for names, (out, err) in zip(RUNS, files, strict=True):
        with out.open("w") as stdout, err.open("w") as stderr:
            procs.append(
                subprocess.Popen(
                    [LORAPLANE, "loadtest", *names, "--fake-vllm", "--json", "--duration", "10"],
                    cwd=ROOT,
                    stdout=stdout,
                    stderr=stderr,
                )
            )
    deadline = time.monotonic() + 540
    replaying: Replaying | None = None
    try:  # the replayed run first: its replays run while the others finish
        for n in (REPLAYED_RUN, *(i for i in range(len(RUNS)) if i != REPLAYED_RUN)):
            procs[n].wait(max(1.0, deadline - time.monotonic()))
            if n == REPLAYED_RUN:
                replaying = start_replays(files[n][1].read_text(), folder)
    finally:  # SIGTERM: a loadtest stops its children on it; SIGKILL would orphan them
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(90)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    ran: dict[str, Ran] = {}
    for n, (names, p, (out, err)) in enumerate(zip(RUNS, procs, files, strict=True)):
        stderr = err.read_text()
        try:
            replayed = finish_replays(stack, replaying) if n == REPLAYED_RUN and replaying else None
        finally:
            drop_run(stack, stderr)
        assert out.read_text(), stderr[-3000:]
        parsed = json.loads(out.read_text())
        objects = parsed if isinstance(parsed, list) else [parsed]
        assert [o["scenario"] for o in objects] == list(names)
        for o in objects:
            ran[o["scenario"]] = Ran(
                o, p.returncode, all(x["passed"] for x in objects), stderr, replayed
            )
    return ran


@pytest.mark.parametrize("scenario", sorted(MUST_PASS))
def test_scenario(loadtests: dict[str, Ran], scenario: str) -> None:
    ran = loadtests[scenario]
    result = ran.result
    checks = {c["name"]: c for c in result["checks"]}
    failed = {n: checks[n]["detail"] for n in MUST_PASS[scenario] if not checks[n]["passed"]}
    assert not failed, f"{failed}\n{ran.stderr[-3000:]}"
    assert result["scenario"] == scenario and "FAKE" in result["vllm"]
    if scenario == "signature-failure":  # the router refuses them before any worker
        assert result["requests"] == 0 and set(result["client_status"]) == {"404"}
    else:
        assert result["requests"] > 0
    for cls in result["ttft_by_class"].values():
        assert cls["requests"] > 0
    assert ran.returncode == (0 if ran.all_passed else 1)
    if scenario == "signature-failure":
        assert {"registry:unknown_key", "registry:tenant_out_of_scope"} <= set(result["refusals"])
    if scenario == "artifact-store-unavailable":
        assert any(k.startswith("load:fail:") for k in result["refusals"])


def test_the_runs_own_traffic_replays_in_the_simulator(loadtests: dict[str, Ran]) -> None:
    """Every request_log row of the run is one replayed request; the what-if has the fleet
    the operator asked for and reports every policy on the same requests."""
    replayed = loadtests[RUNS[REPLAYED_RUN][0]].replayed
    assert replayed is not None, "the replayed run named no namespace"
    for code, said in replayed.answers[:2]:
        assert code == 0, said
    seen, more = replayed.reports
    assert replayed.request_rows > 0
    assert seen["requests"] == more["requests"] == replayed.request_rows
    assert seen["replay"]["rows"] == replayed.request_rows
    pools, more_pools = seen["replay"]["pools"], more["replay"]["pools"]
    assert pools.keys() == more_pools.keys()
    for name, pool in pools.items():
        assert more_pools[name]["workers"] == pool["workers"] + 2
        assert more_pools[name]["gpu_slots_per_worker"] == 16
    for report in (seen, more):
        assert set(report["policies"]) == {"lru", "loraplane"}
        for summary in report["policies"].values():
            assert sum(summary["routes"].values()) == replayed.request_rows
    code, said = replayed.answers[2]
    assert code == 1 and "no request rows in the last 1s" in said, said
    print(
        f"replays: {replayed.ran_beside_s} s beside the other runs, {replayed.added_s} s "
        "after them",
        seen["replay"],
        more["replay"],
        sep="\n",
    )


def test_unknown_scenario_is_a_usage_error() -> None:
    done = subprocess.run(
        [LORAPLANE, "loadtest", "nope", "--fake-vllm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "hot-adapter" in done.stderr
